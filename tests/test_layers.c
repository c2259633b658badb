/* tests/test_layers.c: the models' forward and backward (models/model.c)
 * against an independent double-precision reference written here from the
 * parameter table alone: MLP (linear, relu, linear, softmax cross-entropy)
 * and CNN ([conv3x3 - batchnorm - relu - maxpool2] x 2 - flatten - linear).
 * Float loss == double loss; every parameter gradient == central finite
 * differences of the double reference (batchnorm in train and eval mode);
 * running statistics; backward adds; the grad-ready hook's order and
 * ranges. Not a test of the kernels one by one (test_kernels.c). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/model.h"
#include "tests/test_util.h"

#define FD_ATOL 1e-4
#define FD_RTOL 1e-3
#define FD_H 1e-6
#define BN_EPS 1e-5
#define BN_MOM 0.1

/* ---- the double reference ------------------------------------------------ */

typedef struct ref_ctx {
    tdm_model *m;
    const double *P;    /* parameters, flat with the model's offsets */
    const double *Bu;   /* buffers, same */
    const float *x;     /* (B, in_features) */
    const int32_t *y;
    int B;
    int train;
    /* out: batch statistics of each batchnorm (train) */
    double bn_mean[2][64], bn_var[2][64];
} ref_ctx;

static const tdm_tensor_info *find_tensor(tdm_model *m, int buffer, const char *name)
{
    int n = buffer ? tdm_model_n_buffers(m) : tdm_model_n_params(m);
    for (int i = 0; i < n; i++) {
        const tdm_tensor_info *t = buffer ? tdm_model_buffer_info(m, i) : tdm_model_param_info(m, i);
        if (!strcmp(t->name, name)) return t;
    }
    cr_assert_fail("model has no %s '%s'", buffer ? "buffer" : "parameter", name);
    return NULL;
}

static const double *ref_p(ref_ctx *c, const char *name)
{
    return c->P + find_tensor(c->m, 0, name)->offset;
}

/* Mean over rows of logsumexp(z) - z[y]. */
static double ref_xent(const double *z, const int32_t *y, int B, int C)
{
    double s = 0.0;
    for (int n = 0; n < B; n++) {
        const double *r = z + (size_t)n * C;
        double mx = r[0];
        for (int j = 1; j < C; j++) mx = r[j] > mx ? r[j] : mx;
        double e = 0.0;
        for (int j = 0; j < C; j++) e += exp(r[j] - mx);
        s += mx + log(e) - r[y[n]];
    }
    return s / B;
}

static double ref_mlp(ref_ctx *c)
{
    const tdm_model_spec *s = tdm_model_get_spec(c->m);
    int maxw = 0, B = c->B;
    for (int i = 0; i < s->ndims; i++) maxw = s->dims[i] > maxw ? s->dims[i] : maxw;
    double *h = tu_malloc((size_t)B * maxw * sizeof(double));
    double *z = tu_malloc((size_t)B * maxw * sizeof(double));
    for (int i = 0; i < B * s->dims[0]; i++) h[i] = c->x[i];
    for (int l = 0; l + 1 < s->ndims; l++) {
        char nw[32], nb[32];
        snprintf(nw, sizeof nw, "fc%d.weight", l + 1);
        snprintf(nb, sizeof nb, "fc%d.bias", l + 1);
        const double *W = ref_p(c, nw), *b = ref_p(c, nb);
        int in = s->dims[l], out = s->dims[l + 1], relu = l + 2 < s->ndims;
        for (int n = 0; n < B; n++)
            for (int o = 0; o < out; o++) {
                double a = b[o];
                for (int i = 0; i < in; i++) a += W[(size_t)o * in + i] * h[(size_t)n * in + i];
                z[(size_t)n * out + o] = relu && a < 0.0 ? 0.0 : a;
            }
        double *t = h;
        h = z;
        z = t;
    }
    double loss = ref_xent(h, c->y, B, s->dims[s->ndims - 1]);
    free(h);
    free(z);
    return loss;
}

/* One CNN block on x (N, C, H, W) -> (N, OC, H/2, W/2): conv3x3 pad 1 (no
 * bias), batchnorm (batch statistics with biased variance, or running
 * statistics), relu, maxpool 2x2 stride 2 (floor). */
static double *ref_block(ref_ctx *c, int blk, const double *x, int N, int C, int H, int W, int OC)
{
    char name[32];
    snprintf(name, sizeof name, "conv%d.weight", blk + 1);
    const double *K = ref_p(c, name);
    snprintf(name, sizeof name, "bn%d.weight", blk + 1);
    const double *g = ref_p(c, name);
    snprintf(name, sizeof name, "bn%d.bias", blk + 1);
    const double *be = ref_p(c, name);
    snprintf(name, sizeof name, "bn%d.running_mean", blk + 1);
    const double *rm = c->Bu + find_tensor(c->m, 1, name)->offset;
    snprintf(name, sizeof name, "bn%d.running_var", blk + 1);
    const double *rv = c->Bu + find_tensor(c->m, 1, name)->offset;

    double *a = tu_malloc((size_t)N * OC * H * W * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++)
            for (int yy = 0; yy < H; yy++)
                for (int xx = 0; xx < W; xx++) {
                    double s = 0.0;
                    for (int ci = 0; ci < C; ci++)
                        for (int ki = 0; ki < 3; ki++)
                            for (int kj = 0; kj < 3; kj++) {
                                int iy = yy + ki - 1, ix = xx + kj - 1;
                                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                                s += K[((o * C + ci) * 3 + ki) * 3 + kj] *
                                     x[(((size_t)n * C + ci) * H + iy) * W + ix];
                            }
                    a[(((size_t)n * OC + o) * H + yy) * W + xx] = s;
                }
    double L = (double)N * H * W;
    for (int o = 0; o < OC; o++) {
        double mean, var;
        if (c->train) {
            double s = 0.0, q = 0.0;
            for (int n = 0; n < N; n++)
                for (int j = 0; j < H * W; j++) s += a[((size_t)n * OC + o) * H * W + j];
            mean = s / L;
            for (int n = 0; n < N; n++)
                for (int j = 0; j < H * W; j++) {
                    double d = a[((size_t)n * OC + o) * H * W + j] - mean;
                    q += d * d;
                }
            var = q / L;
            c->bn_mean[blk][o] = mean;
            c->bn_var[blk][o] = var;
        } else {
            mean = rm[o];
            var = rv[o];
        }
        double is = 1.0 / sqrt(var + BN_EPS);
        for (int n = 0; n < N; n++)
            for (int j = 0; j < H * W; j++) {
                double *v = &a[((size_t)n * OC + o) * H * W + j];
                double t = (*v - mean) * is * g[o] + be[o];
                *v = t > 0.0 ? t : 0.0;
            }
    }
    int OH = H / 2, OW = W / 2;
    double *p = tu_malloc((size_t)N * OC * OH * OW * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++)
            for (int yy = 0; yy < OH; yy++)
                for (int xx = 0; xx < OW; xx++) {
                    const double *pl = a + ((size_t)n * OC + o) * H * W;
                    double mx = -INFINITY;
                    for (int ki = 0; ki < 2; ki++)
                        for (int kj = 0; kj < 2; kj++) {
                            double v = pl[(2 * yy + ki) * W + 2 * xx + kj];
                            mx = v > mx ? v : mx;
                        }
                    p[(((size_t)n * OC + o) * OH + yy) * OW + xx] = mx;
                }
    free(a);
    return p;
}

static double ref_cnn(ref_ctx *c)
{
    const tdm_model_spec *s = tdm_model_get_spec(c->m);
    int N = c->B, C = s->in_c, H = s->in_h, W = s->in_w;
    size_t nin = (size_t)N * C * H * W;
    double *x = tu_malloc(nin * sizeof(double));
    for (size_t i = 0; i < nin; i++) x[i] = c->x[i];
    double *h1 = ref_block(c, 0, x, N, C, H, W, s->ch1);
    H /= 2;
    W /= 2;
    double *h2 = ref_block(c, 1, h1, N, s->ch1, H, W, s->ch2);
    H /= 2;
    W /= 2;
    int F = s->ch2 * H * W, K = s->n_classes;
    if (s->fc_hidden > 0) {
        /* hidden linear + relu, then the classifier on its output */
        int Hd = s->fc_hidden;
        const double *hw = ref_p(c, "fc1.weight"), *hb = ref_p(c, "fc1.bias");
        double *hid = tu_malloc((size_t)N * Hd * sizeof(double));
        for (int n = 0; n < N; n++)
            for (int k = 0; k < Hd; k++) {
                double a = hb[k];
                for (int f = 0; f < F; f++) a += hw[(size_t)k * F + f] * h2[(size_t)n * F + f];
                hid[(size_t)n * Hd + k] = a > 0.0 ? a : 0.0;
            }
        free(h2);
        h2 = hid;
        F = Hd;
    }
    const double *fw = ref_p(c, s->fc_hidden > 0 ? "fc2.weight" : "fc.weight");
    const double *fb = ref_p(c, s->fc_hidden > 0 ? "fc2.bias" : "fc.bias");
    double *z = tu_malloc((size_t)N * K * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double a = fb[k];
            for (int f = 0; f < F; f++) a += fw[(size_t)k * F + f] * h2[(size_t)n * F + f];
            z[n * K + k] = a;
        }
    double loss = ref_xent(z, c->y, N, K);
    free(x);
    free(h1);
    free(h2);
    free(z);
    return loss;
}

static double ref_loss(ref_ctx *c)
{
    return tdm_model_get_spec(c->m)->kind == TDM_MODEL_MLP ? ref_mlp(c) : ref_cnn(c);
}

/* ---- setup of a non-degenerate point ------------------------------------- */

/* Random parameters (not the init's zero biases / unit gammas) and, for
 * eval mode, non-trivial running statistics. Padding stays zero. */
static void perturb_model(tdm_model *m, tdm_rng *r)
{
    float *p = tdm_model_params(m);
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        float *q = p + t->offset;
        int bn = !strncmp(t->name, "bn", 2);
        int weight = strstr(t->name, ".weight") != NULL;
        if (bn && weight) tu_fill(r, q, t->n_elem, 0.5f, 1.5f);
        else if (bn || !weight) tu_fill(r, q, t->n_elem, -0.5f, 0.5f);
        else {
            float a = 1.7f / sqrtf((float)(t->n_elem / t->shape[0]));
            tu_fill(r, q, t->n_elem, -a, a);
        }
    }
    float *b = tdm_model_buffers(m);
    for (int i = 0; i < tdm_model_n_buffers(m); i++) {
        const tdm_tensor_info *t = tdm_model_buffer_info(m, i);
        if (strstr(t->name, "running_mean")) tu_fill(r, b + t->offset, t->n_elem, -0.5f, 0.5f);
        else tu_fill(r, b + t->offset, t->n_elem, 0.5f, 2.0f);
    }
}

static double *to_double(const float *x, int64_t n)
{
    double *d = tu_malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

typedef struct fd_stats {
    double max_abs;     /* max |analytic - fd| */
    double max_ratio;   /* max |analytic - fd| / (atol + rtol |fd|) */
    double loss_err;    /* |float loss - double loss| */
    int64_t checked;
} fd_stats;

static void fd_stats_merge(fd_stats *a, const fd_stats *b)
{
    if (b->max_abs > a->max_abs) a->max_abs = b->max_abs;
    if (b->max_ratio > a->max_ratio) a->max_ratio = b->max_ratio;
    if (b->loss_err > a->loss_err) a->loss_err = b->loss_err;
    a->checked += b->checked;
}

/* The whole check on model m (parameters already perturbed, mode set):
 * float loss vs double loss, then every parameter's gradient (or 200
 * random elements of a tensor with more than 300) vs central differences
 * of the double reference. */
static fd_stats check_model(tdm_model *m, int B, uint64_t seed, const char *what)
{
    tdm_rng r = tu_rng(seed);
    int F = tdm_model_in_features(m), K = tdm_model_n_classes(m);
    float *x = tu_malloc((size_t)B * F * sizeof(float));
    int32_t *y = tu_malloc((size_t)B * sizeof(int32_t));
    tu_fill(&r, x, (int64_t)B * F, -1.5f, 1.5f);
    for (int i = 0; i < B; i++) y[i] = (int32_t)tdm_rng_below(&r, (uint64_t)K);

    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    double *P = to_double(tdm_model_params(m), pe);
    double *Bu = to_double(tdm_model_buffers(m), be);
    ref_ctx c = {.m = m, .P = P, .Bu = Bu, .x = x, .y = y, .B = B,
                 .train = tdm_model_is_train(m)};
    double ref = ref_loss(&c);

    double loss = 0.0;
    TU_OK(tdm_model_zero_grad(m));
    TU_OK(tdm_model_forward_backward(m, x, y, B, &loss));
    fd_stats st = {.loss_err = fabs(loss - ref)};
    cr_assert(tu_close(loss, ref, 1e-5, 1e-5), "%s: float loss %.9g != double reference %.9g",
              what, loss, ref);
    const float *G = tdm_model_grads(m);

    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        int64_t n = t->n_elem, count = n > 300 ? 200 : n;
        for (int64_t s = 0; s < count; s++) {
            int64_t j = n > 300 ? (int64_t)tdm_rng_below(&r, (uint64_t)n) : s;
            double *pj = &P[t->offset + j], save = *pj;
            *pj = save + FD_H;
            double lp = ref_loss(&c);
            *pj = save - FD_H;
            double lm = ref_loss(&c);
            *pj = save;
            double fd = (lp - lm) / (2 * FD_H);
            double a = G[t->offset + j];
            double err = fabs(a - fd), ratio = err / (FD_ATOL + FD_RTOL * fabs(fd));
            if (err > st.max_abs) st.max_abs = err;
            if (ratio > st.max_ratio) st.max_ratio = ratio;
            st.checked++;
            cr_assert(ratio <= 1.0,
                      "%s: d loss / d %s[%lld]: analytic %.9g, finite difference %.9g "
                      "(|diff| %.3g > %.3g)",
                      what, t->name, (long long)j, a, fd, err, FD_ATOL + FD_RTOL * fabs(fd));
        }
    }
    /* padding between tensors must keep a zero gradient */
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        int64_t end = i + 1 < tdm_model_n_params(m) ? tdm_model_param_info(m, i + 1)->offset : pe;
        for (int64_t k = t->offset + t->n_elem; k < end; k++)
            cr_assert(G[k] == 0.0f, "%s: padding gradient [%lld] after %s is %g", what,
                      (long long)k, t->name, (double)G[k]);
    }
    fprintf(stderr, "  %-44s loss |f-d| %.2e  grad max|a-fd| %.2e  max ratio %.3f (%lld elems)\n",
            what, st.loss_err, st.max_abs, st.max_ratio, (long long)st.checked);
    free(x);
    free(y);
    free(P);
    free(Bu);
    return st;
}

/* ---- MLP ------------------------------------------------------------------ */

Test(layers, mlp_gradients_match_finite_differences)
{
    static const int cfg[][5] = {{3, 7, 5, 3}, {4, 13, 11, 9, 4}, {3, 1, 1, 2}, {2, 6, 4},
                                 {3, 33, 17, 10}};
    static const int batches[] = {1, 3, 17};
    tdm_device *d = tu_host();
    fd_stats tot = {0};
    uint64_t seed = 100;
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
        for (size_t bi = 0; bi < 3; bi++) {
            tdm_model *m = NULL;
            tdm_model_spec s;
            tdm_model_spec_mlp(&s, &cfg[ci][1], cfg[ci][0]);
            TU_OK(tdm_model_init(&m, d, &s, seed));
            tdm_rng r = tu_rng(seed * 7 + 1);
            perturb_model(m, &r);
            char what[96], desc[64];
            tdm_model_spec_describe(&s, desc, sizeof desc);
            snprintf(what, sizeof what, "%s batch %d", desc, batches[bi]);
            fd_stats st = check_model(m, batches[bi], seed++, what);
            fd_stats_merge(&tot, &st);
            tdm_model_free(m);
        }
    fprintf(stderr, "MLP total: loss max |f-d| %.2e, grad max |a-fd| %.2e, max ratio %.3f over "
            "%lld elements\n", tot.loss_err, tot.max_abs, tot.max_ratio, (long long)tot.checked);
    tdm_device_free(d);
}

/* ---- CNN ------------------------------------------------------------------ */

typedef struct cnn_cfg {
    int c, h, w, ch1, ch2, classes, fc_hidden;
} cnn_cfg;

static const cnn_cfg g_cnn_cfgs[] = {
    {2, 6, 6, 3, 4, 5, 0},
    {1, 8, 10, 2, 3, 3, 7},
    {3, 4, 4, 2, 2, 4, 5},
    {1, 7, 5, 3, 2, 2, 0},   /* odd sizes: pooling drops the last row/column */
    {1, 12, 12, 8, 16, 10, 16}, /* conv2 and fc have > 300 weights: random subsets */
};

static void cnn_spec(tdm_model_spec *s, const cnn_cfg *c)
{
    tdm_model_spec_cnn(s);
    s->in_c = c->c;
    s->in_h = c->h;
    s->in_w = c->w;
    s->ch1 = c->ch1;
    s->ch2 = c->ch2;
    s->n_classes = c->classes;
    s->fc_hidden = c->fc_hidden;
}

static void cnn_fd(int train)
{
    static const int batches[] = {1, 2, 5};
    tdm_device *d = tu_host();
    fd_stats tot = {0};
    uint64_t seed = train ? 300 : 400;
    for (size_t ci = 0; ci < sizeof g_cnn_cfgs / sizeof g_cnn_cfgs[0]; ci++)
        for (size_t bi = 0; bi < 3; bi++) {
            tdm_model *m = NULL;
            tdm_model_spec s;
            cnn_spec(&s, &g_cnn_cfgs[ci]);
            TU_OK(tdm_model_init(&m, d, &s, seed));
            tdm_rng r = tu_rng(seed * 7 + 1);
            perturb_model(m, &r);
            tdm_model_set_train(m, train);
            /* convolutions by chunks of images as well as whole (these
             * small images fit one default chunk): 2 + 2 + 1 at batch 5,
             * 1 + 1 at batch 2, on alternate configurations */
            int chunk = bi == 2 && ci % 2 == 0 ? 2 : bi == 1 && ci % 2 == 1 ? 1 : 0;
            TU_OK(tdm_model_set_conv_chunk(m, chunk));
            char what[128], desc[96];
            tdm_model_spec_describe(&s, desc, sizeof desc);
            snprintf(what, sizeof what, "%s %s b%d chunk %d", desc, train ? "train" : "eval",
                     batches[bi], chunk);
            fd_stats st = check_model(m, batches[bi], seed++, what);
            fd_stats_merge(&tot, &st);
            tdm_model_free(m);
        }
    fprintf(stderr, "CNN %s total: loss max |f-d| %.2e, grad max |a-fd| %.2e, max ratio %.3f over "
            "%lld elements\n", train ? "train" : "eval", tot.loss_err, tot.max_abs, tot.max_ratio,
            (long long)tot.checked);
    tdm_device_free(d);
}

Test(layers, cnn_gradients_match_finite_differences_train_mode) { cnn_fd(1); }
Test(layers, cnn_gradients_match_finite_differences_eval_mode) { cnn_fd(0); }

/* The default CNN (28x28, conv 32 and 64) over a batch of 7 with its
 * convolutions in chunks of 1, 2, 3 and 7 images and the default: the
 * chunks' columns of every conv output are the same dot products over
 * c*k*k as the whole batch's (a gemm of another width may round them
 * differently), and the gradients agree up to that and the order in which
 * the weight gradient adds the chunks. The last
 * chunk is partial for 2 and 3. Then a chunk of -1 is refused. */
Test(layers, conv_chunks_compute_what_the_whole_batch_does)
{
    enum { B = 7 };
    static const int chunks[] = {1, 2, 3, 0};
    tdm_device *d = tu_host();
    tdm_model *ref = NULL;
    TU_OK(tdm_cnn_init(&ref, d, 5));
    tdm_model_set_train(ref, 1);
    TU_OK(tdm_model_set_conv_chunk(ref, B));
    int F = tdm_model_in_features(ref), K = tdm_model_n_classes(ref);
    int64_t pe = tdm_model_param_elems(ref);
    float *x = tu_malloc((size_t)B * F * sizeof(float));
    int32_t y[B];
    tdm_rng r = tu_rng(77);
    tu_fill(&r, x, (int64_t)B * F, -1.0f, 1.0f);
    for (int i = 0; i < B; i++) y[i] = (int32_t)tdm_rng_below(&r, (uint64_t)K);
    double lref, l;
    TU_OK(tdm_model_zero_grad(ref));
    TU_OK(tdm_model_forward_backward(ref, x, y, B, &lref));
    float *gref = tu_malloc((size_t)pe * sizeof(float));
    memcpy(gref, tdm_model_grads(ref), (size_t)pe * sizeof(float));
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
        tdm_model *m = NULL;
        TU_OK(tdm_cnn_init(&m, d, 5));
        tdm_model_set_train(m, 1);
        TU_OK(tdm_model_set_conv_chunk(m, chunks[ci]));
        TU_OK(tdm_model_zero_grad(m));
        TU_OK(tdm_model_forward_backward(m, x, y, B, &l));
        cr_assert(tu_close(l, lref, 1e-6, 1e-6), "chunk %d: loss %.9g, whole batch %.9g",
                  chunks[ci], l, lref);
        const float *g = tdm_model_grads(m);
        for (int i = 0; i < tdm_model_n_params(m); i++) {
            const tdm_tensor_info *t = tdm_model_param_info(m, i);
            for (int64_t j = t->offset; j < t->offset + t->n_elem; j++)
                cr_assert(tu_close(g[j], gref[j], 1e-6, 1e-4),
                          "chunk %d: d %s[%lld] = %.9g, whole batch %.9g", chunks[ci], t->name,
                          (long long)(j - t->offset), (double)g[j], (double)gref[j]);
        }
        tdm_model_free(m);
    }
    cr_assert_eq(tdm_model_set_conv_chunk(ref, -1), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "-1"), "message: %s", tdm_error_message());
    free(gref);
    free(x);
    tdm_model_free(ref);
    tdm_device_free(d);
}

/* Train-mode forward updates the running statistics as PyTorch does:
 * r = 0.9 r + 0.1 stat, with the unbiased batch variance; eval mode leaves
 * them alone. */
Test(layers, batchnorm_running_statistics)
{
    tdm_device *d = tu_host();
    for (size_t ci = 0; ci < sizeof g_cnn_cfgs / sizeof g_cnn_cfgs[0]; ci++) {
        tdm_model *m = NULL;
        tdm_model_spec s;
        cnn_spec(&s, &g_cnn_cfgs[ci]);
        TU_OK(tdm_model_init(&m, d, &s, 9));
        tdm_rng r = tu_rng(500 + ci);
        perturb_model(m, &r);
        int B = 3, F = tdm_model_in_features(m);
        float *x = tu_malloc((size_t)B * F * sizeof(float));
        int32_t y[3] = {0, 1, 0};
        tu_fill(&r, x, (int64_t)B * F, -1.0f, 2.0f);
        int64_t be = tdm_model_buffer_elems(m);
        double *P = to_double(tdm_model_params(m), tdm_model_param_elems(m));
        double *B0 = to_double(tdm_model_buffers(m), be);
        ref_ctx c = {.m = m, .P = P, .Bu = B0, .x = x, .y = y, .B = B, .train = 1};
        (void)ref_loss(&c);

        tdm_model_set_train(m, 0);
        TU_OK(tdm_model_forward(m, x, B, NULL));
        const float *buf = tdm_model_buffers(m);
        for (int64_t i = 0; i < be; i++)
            cr_assert(buf[i] == (float)B0[i], "eval forward changed buffer element %lld", (long long)i);

        tdm_model_set_train(m, 1);
        TU_OK(tdm_model_forward(m, x, B, NULL));
        int hw[2] = {s.in_h * s.in_w, (s.in_h / 2) * (s.in_w / 2)};
        int chans[2] = {s.ch1, s.ch2};
        for (int blk = 0; blk < 2; blk++) {
            char n1[32], n2[32];
            snprintf(n1, sizeof n1, "bn%d.running_mean", blk + 1);
            snprintf(n2, sizeof n2, "bn%d.running_var", blk + 1);
            int64_t om = find_tensor(m, 1, n1)->offset, ov = find_tensor(m, 1, n2)->offset;
            double L = (double)B * hw[blk];
            for (int o = 0; o < chans[blk]; o++) {
                double em = (1 - BN_MOM) * B0[om + o] + BN_MOM * c.bn_mean[blk][o];
                double ev = (1 - BN_MOM) * B0[ov + o] + BN_MOM * c.bn_var[blk][o] * L / (L - 1);
                cr_assert(tu_close(buf[om + o], em, 1e-5, 1e-4), "cfg %zu %s[%d] = %.7g, expected %.7g",
                          ci, n1, o, (double)buf[om + o], em);
                cr_assert(tu_close(buf[ov + o], ev, 1e-5, 1e-4), "cfg %zu %s[%d] = %.7g, expected %.7g",
                          ci, n2, o, (double)buf[ov + o], ev);
            }
        }
        free(x);
        free(P);
        free(B0);
        tdm_model_free(m);
    }
    tdm_device_free(d);
}

/* ---- backward contract ----------------------------------------------------- */

static tdm_model *make_model(tdm_device *d, int cnn, uint64_t seed)
{
    tdm_model *m = NULL;
    tdm_model_spec s;
    if (cnn) {
        cnn_spec(&s, &g_cnn_cfgs[0]);
    } else {
        static const int dims[] = {9, 8, 7, 5};
        tdm_model_spec_mlp(&s, dims, 4);
    }
    TU_OK(tdm_model_init(&m, d, &s, seed));
    tdm_rng r = tu_rng(seed);
    perturb_model(m, &r);
    return m;
}

/* Backward adds into the gradient buffer: two backward passes of one
 * forward give exactly twice the gradient of one. */
Test(layers, backward_adds_into_gradients)
{
    tdm_device *d = tu_host();
    for (int cnn = 0; cnn < 2; cnn++) {
        tdm_model *m = make_model(d, cnn, 11);
        int B = 4, F = tdm_model_in_features(m), K = tdm_model_n_classes(m);
        int64_t pe = tdm_model_param_elems(m);
        float *x = tu_malloc((size_t)B * F * sizeof(float));
        float *dl = tu_malloc((size_t)B * K * sizeof(float));
        int32_t y[4] = {0, 1, 2, 1};
        tdm_rng r = tu_rng(12);
        tu_fill(&r, x, (int64_t)B * F, -1.0f, 1.0f);
        const float *logits;
        double ls;
        TU_OK(tdm_model_zero_grad(m));
        TU_OK(tdm_model_forward(m, x, B, &logits));
        TU_OK(tdm_loss_softmax_xent(d, logits, y, B, K, 1.0f / B, &ls, dl));
        TU_OK(tdm_model_backward(m, dl));
        float *g1 = tu_malloc((size_t)pe * sizeof(float));
        memcpy(g1, tdm_model_grads(m), (size_t)pe * sizeof(float));
        double norm = 0.0;
        for (int64_t i = 0; i < pe; i++) norm += fabs(g1[i]);
        cr_assert(norm > 0.0, "gradient of a random point is zero");
        TU_OK(tdm_model_backward(m, dl));
        const float *g2 = tdm_model_grads(m);
        for (int i = 0; i < tdm_model_n_params(m); i++) {
            const tdm_tensor_info *t = tdm_model_param_info(m, i);
            for (int64_t j = 0; j < t->n_elem; j++) {
                int64_t k = t->offset + j;
                cr_assert(tu_close(g2[k], 2.0 * g1[k], 1e-6, 1e-5),
                          "%s: after two backward passes %s[%lld] = %.9g, expected 2 x %.9g",
                          cnn ? "cnn" : "mlp", t->name, (long long)j, (double)g2[k], (double)g1[k]);
            }
        }
        /* zero_grad is the explicit reset */
        TU_OK(tdm_model_zero_grad(m));
        for (int64_t i = 0; i < pe; i++) cr_assert(tdm_model_grads(m)[i] == 0.0f);
        free(x);
        free(dl);
        free(g1);
        tdm_model_free(m);
    }
    tdm_device_free(d);
}

typedef struct hook_rec {
    int n;
    int first[16], last[16];
    float *snap[16];     /* the hooked range's gradient at call time */
} hook_rec;

static void hook_fn(void *ctx, tdm_model *m, int first, int last)
{
    hook_rec *h = ctx;
    cr_assert(h->n < 16, "hook called more than 16 times");
    h->first[h->n] = first;
    h->last[h->n] = last;
    const tdm_tensor_info *a = tdm_model_param_info(m, first), *b = tdm_model_param_info(m, last);
    cr_assert(a && b, "hook range [%d, %d] outside the table", first, last);
    int64_t n = b->offset + b->n_elem - a->offset;
    h->snap[h->n] = tu_malloc((size_t)n * sizeof(float));
    memcpy(h->snap[h->n], tdm_model_grads(m) + a->offset, (size_t)n * sizeof(float));
    h->n++;
}

/* The hook runs once per parameterised layer, last layer first, with that
 * layer's parameter range, and the gradients are final when it runs. */
Test(layers, grad_ready_hook_order_and_ranges)
{
    tdm_device *d = tu_host();
    for (int cnn = 0; cnn < 2; cnn++) {
        tdm_model *m = make_model(d, cnn, 21);
        hook_rec h = {0};
        tdm_model_set_grad_hook(m, hook_fn, &h);
        /* expected: layers with parameters, in reverse */
        int ef[16], el[16], ne = 0;
        for (int l = tdm_model_n_layers(m) - 1; l >= 0; l--) {
            int f, la;
            tdm_model_layer_params(m, l, &f, &la);
            if (f <= la) {
                ef[ne] = f;
                el[ne] = la;
                ne++;
            }
        }
        /* and the table: every parameter belongs to exactly one range */
        cr_assert_eq(ef[0] <= el[0] ? el[0] : -1, tdm_model_n_params(m) - 1);
        cr_assert_eq(ef[ne - 1], 0);
        for (int i = 0; i + 1 < ne; i++) cr_assert_eq(ef[i], el[i + 1] + 1);
        cr_assert_eq(ne, cnn ? 5 : 3, "%s has %d parameterised layers", cnn ? "cnn" : "mlp", ne);

        int B = 3, F = tdm_model_in_features(m);
        float *x = tu_malloc((size_t)B * F * sizeof(float));
        int32_t y[3] = {1, 0, 2};
        tdm_rng r = tu_rng(22);
        tu_fill(&r, x, (int64_t)B * F, -1.0f, 1.0f);
        TU_OK(tdm_model_zero_grad(m));
        TU_OK(tdm_model_forward_backward(m, x, y, B, NULL));
        cr_assert_eq(h.n, ne, "hook called %d times, expected %d", h.n, ne);
        for (int i = 0; i < ne; i++) {
            cr_assert(h.first[i] == ef[i] && h.last[i] == el[i],
                      "hook call %d: [%d, %d], expected [%d, %d]", i, h.first[i], h.last[i],
                      ef[i], el[i]);
            const tdm_tensor_info *a = tdm_model_param_info(m, ef[i]);
            const tdm_tensor_info *b = tdm_model_param_info(m, el[i]);
            int64_t n = b->offset + b->n_elem - a->offset;
            cr_assert(memcmp(h.snap[i], tdm_model_grads(m) + a->offset,
                             (size_t)n * sizeof(float)) == 0,
                      "hook call %d: gradients of [%d, %d] changed after the hook", i, ef[i], el[i]);
            free(h.snap[i]);
        }
        /* parameters laid out in layer order: later layers at higher offsets */
        for (int i = 0; i + 1 < tdm_model_n_params(m); i++) {
            const tdm_tensor_info *a = tdm_model_param_info(m, i), *b = tdm_model_param_info(m, i + 1);
            cr_assert(b->offset >= a->offset + a->n_elem && b->offset % TDM_MODEL_ALIGN_ELEMS == 0,
                      "%s at %lld overlaps or misaligned after %s", b->name, (long long)b->offset,
                      a->name);
        }
        free(x);
        tdm_model_free(m);
    }
    tdm_device_free(d);
}

/* Batch size changes between calls (activations grow, then a smaller
 * batch reuses them): the result matches a fresh model's. */
Test(layers, batch_size_changes)
{
    tdm_device *d = tu_host();
    for (int cnn = 0; cnn < 2; cnn++) {
        tdm_model *m = make_model(d, cnn, 31), *m2 = make_model(d, cnn, 31);
        int F = tdm_model_in_features(m);
        int64_t pe = tdm_model_param_elems(m);
        float *x = tu_malloc((size_t)9 * F * sizeof(float));
        int32_t y[9] = {0, 1, 2, 0, 1, 2, 0, 1, 2};
        tdm_rng r = tu_rng(32);
        tu_fill(&r, x, (int64_t)9 * F, -1.0f, 1.0f);
        double l1, l2;
        TU_OK(tdm_model_forward_backward(m, x, y, 2, NULL));
        TU_OK(tdm_model_forward_backward(m, x, y, 9, NULL));
        TU_OK(tdm_model_zero_grad(m));
        TU_OK(tdm_model_forward_backward(m, x, y, 3, &l1));
        TU_OK(tdm_model_zero_grad(m2));
        TU_OK(tdm_model_forward_backward(m2, x, y, 3, &l2));
        cr_assert(l1 == l2, "loss %.9g after batch growth, %.9g fresh", l1, l2);
        if (!cnn) /* batchnorm running stats differ after the extra passes, params do not */
            cr_assert(memcmp(tdm_model_grads(m), tdm_model_grads(m2), (size_t)pe * sizeof(float)) == 0);
        else
            for (int64_t i = 0; i < pe; i++)
                cr_assert(tu_close(tdm_model_grads(m)[i], tdm_model_grads(m2)[i], 1e-7, 1e-5));
        free(x);
        tdm_model_free(m);
        tdm_model_free(m2);
    }
    tdm_device_free(d);
}

/* A clone computes the same loss and gradients bit for bit and owns its
 * parameters (changing the source does not change the clone). */
Test(layers, clone_is_an_independent_replica)
{
    tdm_device *d = tu_host();
    for (int cnn = 0; cnn < 2; cnn++) {
        tdm_model *m = make_model(d, cnn, 41), *c = NULL;
        tdm_model_set_train(m, 0);
        TU_OK(tdm_model_clone(&c, m, d));
        cr_assert(!tdm_model_is_train(c), "clone lost eval mode");
        int B = 5, F = tdm_model_in_features(m);
        int64_t pe = tdm_model_param_elems(m);
        float *x = tu_malloc((size_t)B * F * sizeof(float));
        int32_t y[5] = {0, 1, 2, 3, 0};
        tdm_rng r = tu_rng(42);
        tu_fill(&r, x, (int64_t)B * F, -1.0f, 1.0f);
        double l1, l2;
        TU_OK(tdm_model_zero_grad(m));
        TU_OK(tdm_model_forward_backward(m, x, y, B, &l1));
        TU_OK(tdm_model_forward_backward(c, x, y, B, &l2));
        cr_assert(l1 == l2, "clone loss %.9g != %.9g", l2, l1);
        cr_assert(memcmp(tdm_model_grads(m), tdm_model_grads(c), (size_t)pe * sizeof(float)) == 0,
                  "clone gradients differ");
        tdm_model_params(m)[0] += 1.0f;
        cr_assert(tdm_model_params(c)[0] != tdm_model_params(m)[0], "clone shares parameters");
        free(x);
        tdm_model_free(c);
        tdm_model_free(m);
    }
    tdm_device_free(d);
}

/* A forward that fails (here: activations for 2^30 samples cannot be
 * allocated) leaves nothing to go back through: backward and
 * count_correct refuse instead of reading freed activations. */
Test(layers, backward_after_a_failed_forward_is_refused)
{
    tdm_device *d = tu_host();
    tdm_model *m = make_model(d, 0, 3);
    int F = tdm_model_in_features(m);
    float *x = tu_malloc((size_t)4 * F * sizeof(float));
    int32_t y[4] = {0, 1, 2, 0};
    const float *logits;
    TU_OK(tdm_model_forward(m, x, 4, &logits));
    cr_assert_eq(tdm_model_forward(m, x, 1 << 30, &logits), TDM_STATUS_OUT_OF_MEMORY, "%s",
                 tdm_error_message());
    float *dl = tu_malloc((size_t)4 * tdm_model_n_classes(m) * sizeof(float));
    cr_assert_eq(tdm_model_backward(m, dl), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "backward called before forward"), "%s",
              tdm_error_message());
    int64_t c = 0;
    cr_assert_eq(tdm_model_count_correct(m, y, 4, &c), TDM_STATUS_INVALID_ARG);
    /* and the model still works */
    TU_OK(tdm_model_forward_backward(m, x, y, 4, NULL));
    free(x);
    free(dl);
    tdm_model_free(m);
    tdm_device_free(d);
}

/* Bad MLP widths are refused, not replaced by the default model. */
Test(layers, bad_mlp_widths_are_refused)
{
    tdm_device *d = tu_host();
    tdm_model *m = NULL;
    int dims[17];
    for (int i = 0; i < 17; i++) dims[i] = 4;
    cr_assert_eq(tdm_mlp_init(&m, d, dims, 1, 1), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "2 to 16 widths"), "%s", tdm_error_message());
    cr_assert_eq(tdm_mlp_init(&m, d, dims, 17, 1), TDM_STATUS_INVALID_ARG);
    cr_assert_null(m);
    TU_OK(tdm_mlp_init(&m, d, dims, 16, 1));
    cr_assert_eq(tdm_model_in_features(m), 4);
    tdm_model_free(m);
    tdm_model_spec s;
    cr_assert_eq(tdm_model_spec_parse(&s, "mlp:784-10-"), TDM_STATUS_INVALID_ARG);
    TU_OK(tdm_model_spec_parse(&s, "mlp:784-10"));
    tdm_device_free(d);
}
