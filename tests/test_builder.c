/* tests/test_builder.c: layer-list models (models/builder.h): the C
 * builder's shapes and errors; the new layers (tanh, sigmoid, gelu, a
 * standalone relu, average pooling, residual blocks with and without
 * projection, strided and padded convolutions) against an independent
 * double-precision reference written here from the op list alone, every
 * parameter gradient against central finite differences; the built-in
 * MLP and CNN written with the builder give the same bits as the
 * built-ins through forward, backward and an SGD step. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/builder.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "tests/test_util.h"

#define FD_ATOL 1e-4
#define FD_RTOL 1e-3
#define FD_H 1e-6
#define BN_EPS 1e-5
#define REF_MAX_NEST 8

/* ---- the double reference: the op list on (B, C, H, W) samples ---------- */

typedef struct ref_t {
    int B, c, h, w;
    double *x;          /* B * c * h * w, NCHW */
} ref_t;

typedef struct ref_ctx {
    tdm_model *m;
    const double *P, *Bu;
    const float *x;
    const int32_t *y;
    int B, train;
    uint64_t seed;      /* the model's, for dropout's masks */
    int64_t fwd;        /* training forwards the model ran before */
    int pi, bi;         /* the next parameter / buffer tensor */
} ref_ctx;

static const double *ref_next(ref_ctx *c)
{
    return c->P + tdm_model_param_info(c->m, c->pi++)->offset;
}

static ref_t ref_new(int B, int ch, int h, int w)
{
    ref_t t = {.B = B, .c = ch, .h = h, .w = w};
    t.x = tu_malloc((size_t)B * ch * h * w * sizeof(double) + 8);
    memset(t.x, 0, (size_t)B * ch * h * w * sizeof(double));
    return t;
}

static double *at(ref_t *t, int n, int ch, int y, int x)
{
    return &t->x[(((size_t)n * t->c + ch) * t->h + y) * t->w + x];
}

static ref_t ref_conv(const ref_t *in, const double *K, int oc, int k, int s, int p)
{
    int oh = (in->h + 2 * p - k) / s + 1, ow = (in->w + 2 * p - k) / s + 1;
    ref_t o = ref_new(in->B, oc, oh, ow);
    for (int n = 0; n < in->B; n++)
        for (int co = 0; co < oc; co++)
            for (int yy = 0; yy < oh; yy++)
                for (int xx = 0; xx < ow; xx++) {
                    double a = 0.0;
                    for (int ci = 0; ci < in->c; ci++)
                        for (int ky = 0; ky < k; ky++)
                            for (int kx = 0; kx < k; kx++) {
                                int iy = yy * s - p + ky, ix = xx * s - p + kx;
                                if (iy < 0 || ix < 0 || iy >= in->h || ix >= in->w) continue;
                                a += K[((co * in->c + ci) * k + ky) * k + kx] *
                                     *at((ref_t *)in, n, ci, iy, ix);
                            }
                    *at(&o, n, co, yy, xx) = a;
                }
    return o;
}

static ref_t ref_linear(const ref_t *in, const double *W, const double *b, int out)
{
    int F = in->c * in->h * in->w;
    ref_t o = ref_new(in->B, 1, 1, out);
    for (int n = 0; n < in->B; n++)
        for (int j = 0; j < out; j++) {
            double a = b ? b[j] : 0.0;
            for (int i = 0; i < F; i++) a += W[(size_t)j * F + i] * in->x[(size_t)n * F + i];
            o.x[(size_t)n * out + j] = a;
        }
    return o;
}

static void ref_bn(ref_ctx *c, ref_t *t)
{
    const double *g = ref_next(c), *be = ref_next(c);
    const double *rm = c->Bu + tdm_model_buffer_info(c->m, c->bi)->offset;
    const double *rv = c->Bu + tdm_model_buffer_info(c->m, c->bi + 1)->offset;
    c->bi += 2;
    int len = t->B * t->h * t->w;
    for (int ch = 0; ch < t->c; ch++) {
        double mean = rm[ch], var = rv[ch];
        if (c->train) {
            mean = var = 0.0;
            for (int n = 0; n < t->B; n++)
                for (int i = 0; i < t->h * t->w; i++) mean += *at(t, n, ch, 0, i);
            mean /= len;
            for (int n = 0; n < t->B; n++)
                for (int i = 0; i < t->h * t->w; i++) {
                    double d = *at(t, n, ch, 0, i) - mean;
                    var += d * d;
                }
            var /= len;
        }
        for (int n = 0; n < t->B; n++)
            for (int i = 0; i < t->h * t->w; i++) {
                double *v = at(t, n, ch, 0, i);
                *v = (*v - mean) / sqrt(var + BN_EPS) * g[ch] + be[ch];
            }
    }
}

/* Each sample's vector over its features: (x - mean) / sqrt(var + 1e-5)
 * g + b, var biased. */
static void ref_ln(ref_ctx *c, ref_t *t)
{
    const double *g = ref_next(c), *b = ref_next(c);
    int F = t->c * t->h * t->w;
    for (int n = 0; n < t->B; n++) {
        double *x = t->x + (size_t)n * F, mean = 0, var = 0;
        for (int j = 0; j < F; j++) mean += x[j];
        mean /= F;
        for (int j = 0; j < F; j++) var += (x[j] - mean) * (x[j] - mean);
        var /= F;
        double rs = 1.0 / sqrt(var + 1e-5);
        for (int j = 0; j < F; j++) x[j] = (x[j] - mean) * rs * g[j] + b[j];
    }
}

static void ref_act(ref_t *t, tdm_model_op_kind k)
{
    size_t n = (size_t)t->B * t->c * t->h * t->w;
    for (size_t i = 0; i < n; i++) {
        double v = t->x[i];
        if (k == TDM_MODEL_OP_RELU) v = v > 0 ? v : 0;
        else if (k == TDM_MODEL_OP_TANH) v = tanh(v);
        else if (k == TDM_MODEL_OP_SIGMOID) v = 1.0 / (1.0 + exp(-v));
        else v = 0.5 * v * (1.0 + tanh(sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
        t->x[i] = v;
    }
}

static ref_t ref_pool(const ref_t *in, int max, int kh, int kw)
{
    int oh = (in->h - kh) / kh + 1, ow = (in->w - kw) / kh + 1;
    ref_t o = ref_new(in->B, in->c, oh, ow);
    for (int n = 0; n < in->B; n++)
        for (int ch = 0; ch < in->c; ch++)
            for (int yy = 0; yy < oh; yy++)
                for (int xx = 0; xx < ow; xx++) {
                    double a = max ? -INFINITY : 0.0;
                    for (int i = 0; i < kh; i++)
                        for (int j = 0; j < kw; j++) {
                            double v = *at((ref_t *)in, n, ch, yy * kh + i, xx * kh + j);
                            a = max ? (v > a ? v : a) : a + v;
                        }
                    *at(&o, n, ch, yy, xx) = max ? a : a / (kh * kw);
                }
    return o;
}

/* docs/MODELS.md's dropout mask, written again: a sample's key from
 * (seed, training forwards before this one, its input bytes), value j
 * of op `op` kept when splitmix64(key ^ mix(op) + (j + 1) golden) >> 40
 * >= p 2^24. */
#define GOLDEN 0x9e3779b97f4a7c15ull
static uint64_t mix(uint64_t z)
{
    z += GOLDEN;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void ref_dropout(ref_ctx *c, ref_t *t, float p, int op)
{
    if (!c->train) return;
    const tdm_model_spec *s = tdm_model_get_spec(c->m);
    size_t row = (size_t)s->in_c * s->in_h * s->in_w * sizeof(float);
    uint64_t base = mix(c->seed ^ mix((uint64_t)c->fwd));
    uint64_t thr = (uint64_t)((double)p * (double)(1 << 24));
    int per = t->c * t->h * t->w;
    for (int n = 0; n < c->B; n++) {
        uint64_t f = 0xcbf29ce484222325ull;
        const unsigned char *b = (const unsigned char *)c->x + n * row;
        for (size_t i = 0; i < row; i++) f = (f ^ b[i]) * 0x100000001b3ull;
        uint64_t k = mix(base ^ f) ^ mix((uint64_t)op);
        for (int j = 0; j < per; j++) {
            int keep = (mix(k + ((uint64_t)j + 1) * GOLDEN) >> 40) >= thr;
            t->x[(size_t)n * per + j] = keep ? t->x[(size_t)n * per + j] / (1.0 - (double)p) : 0.0;
        }
    }
}

static double ref_loss(ref_ctx *c)
{
    const tdm_model_spec *s = tdm_model_get_spec(c->m);
    c->pi = c->bi = 0;
    ref_t t = ref_new(c->B, s->in_c, s->in_h, s->in_w);
    size_t F = (size_t)s->in_c * s->in_h * s->in_w;
    for (size_t i = 0; i < (size_t)c->B * F; i++) t.x[i] = c->x[i];
    ref_t stack[REF_MAX_NEST];
    int ns = 0;
    for (int i = 0; i < s->n_ops; i++) {
        const tdm_model_op *o = &s->ops[i];
        ref_t nt = {0};
        switch (o->kind) {
        case TDM_MODEL_OP_LINEAR: {
            const double *W = ref_next(c), *b = ref_next(c);
            nt = ref_linear(&t, W, b, o->n);
            break;
        }
        case TDM_MODEL_OP_CONV:
            nt = ref_conv(&t, ref_next(c), o->n, o->k, o->stride, o->pad);
            break;
        case TDM_MODEL_OP_BATCHNORM: ref_bn(c, &t); break;
        case TDM_MODEL_OP_LAYERNORM: ref_ln(c, &t); break;
        case TDM_MODEL_OP_RELU:
        case TDM_MODEL_OP_GELU:
        case TDM_MODEL_OP_TANH:
        case TDM_MODEL_OP_SIGMOID: ref_act(&t, o->kind); break;
        case TDM_MODEL_OP_MAXPOOL:
        case TDM_MODEL_OP_AVGPOOL:
            nt = ref_pool(&t, o->kind == TDM_MODEL_OP_MAXPOOL, o->k, o->kw);
            break;
        case TDM_MODEL_OP_DROPOUT:
            ref_dropout(c, &t, o->p, i);
            break;
        case TDM_MODEL_OP_FLATTEN:
            t.w = t.c * t.h * t.w;
            t.c = t.h = 1;
            break;
        case TDM_MODEL_OP_RES_OPEN: {
            ref_t cp = ref_new(t.B, t.c, t.h, t.w);
            memcpy(cp.x, t.x, (size_t)t.B * t.c * t.h * t.w * sizeof(double));
            stack[ns++] = cp;
            break;
        }
        case TDM_MODEL_OP_RES_CLOSE: {
            ref_t sk = stack[--ns];
            if (o->proj && !o->flat) {
                int st = 1;
                while ((sk.h - 1) / st + 1 != t.h || (sk.w - 1) / st + 1 != t.w) st++;
                ref_t p = ref_conv(&sk, ref_next(c), t.c, 1, st, 0);
                free(sk.x);
                sk = p;
            } else if (o->proj) {
                const double *W = ref_next(c), *b = ref_next(c);
                ref_t p = ref_linear(&sk, W, b, t.w);
                free(sk.x);
                sk = p;
            }
            for (size_t k = 0; k < (size_t)t.B * t.c * t.h * t.w; k++) t.x[k] += sk.x[k];
            free(sk.x);
            break;
        }
        default:   /* the GPT's layers: tests/test_gpt.c's reference */
            cr_assert_fail("op %s has no reference here", tdm_model_op_name(o->kind));
        }
        if (nt.x) {
            free(t.x);
            t = nt;
        }
    }
    cr_assert_eq(c->pi, tdm_model_n_params(c->m), "reference used %d of %d tensors", c->pi,
                 tdm_model_n_params(c->m));
    int C = t.w;
    double loss = 0.0;
    for (int n = 0; n < c->B; n++) {
        const double *r = t.x + (size_t)n * C;
        double mx = r[0], e = 0.0;
        for (int j = 1; j < C; j++) mx = r[j] > mx ? r[j] : mx;
        for (int j = 0; j < C; j++) e += exp(r[j] - mx);
        loss += mx + log(e) - r[c->y[n]];
    }
    free(t.x);
    return loss / c->B;
}

/* ---- the check ------------------------------------------------------------- */

static void perturb(tdm_model *m, tdm_rng *r)
{
    float *p = tdm_model_params(m);
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        /* the norms' weights near 1 */
        int bn = !strncmp(t->name, "bn", 2) || !strncmp(t->name, "ln", 2);
        int weight = strstr(t->name, ".weight") != NULL;
        if (bn && weight) tu_fill(r, p + t->offset, t->n_elem, 0.5f, 1.5f);
        else if (bn || !weight) tu_fill(r, p + t->offset, t->n_elem, -0.5f, 0.5f);
        else {
            float a = 1.7f / sqrtf((float)(t->n_elem / t->shape[0]));
            tu_fill(r, p + t->offset, t->n_elem, -a, a);
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

/* Float loss == double loss; every parameter's gradient (200 random
 * elements of a larger tensor) == central differences of the reference. */
static void check_fd(const char *what, const char *text, int B, int train)
{
    tdm_model_spec s;
    tdm_model *m = NULL;
    TU_OK(tdm_model_seq_parse_text(&s, what, text, strlen(text)));
    TU_OK(tdm_model_init(&m, tu_host(), &s, 5));
    tdm_model_set_train(m, train);
    tdm_rng r = tu_rng(17);
    perturb(m, &r);
    int F = tdm_model_in_features(m), K = tdm_model_n_classes(m);
    float *x = tu_malloc((size_t)B * F * sizeof(float));
    int32_t *y = tu_malloc((size_t)B * sizeof(int32_t));
    tu_fill(&r, x, (int64_t)B * F, -1.5f, 1.5f);
    for (int i = 0; i < B; i++) y[i] = (int32_t)tdm_rng_below(&r, (uint64_t)K);
    double *P = to_double(tdm_model_params(m), tdm_model_param_elems(m));
    double *Bu = to_double(tdm_model_buffers(m), tdm_model_buffer_elems(m));
    ref_ctx c = {.m = m, .P = P, .Bu = Bu, .x = x, .y = y, .B = B, .train = train, .seed = 5};
    double ref = ref_loss(&c), loss = 0.0;
    TU_OK(tdm_model_zero_grad(m));
    TU_OK(tdm_model_forward_backward(m, x, y, B, &loss));
    cr_assert(tu_close(loss, ref, 1e-5, 1e-5), "%s: float loss %.9g != double reference %.9g",
              what, loss, ref);
    const float *G = tdm_model_grads(m);
    double worst = 0.0;
    int64_t checked = 0;
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        int64_t n = t->n_elem, count = n > 300 ? 200 : n;
        for (int64_t k = 0; k < count; k++) {
            int64_t j = n > 300 ? (int64_t)tdm_rng_below(&r, (uint64_t)n) : k;
            double *pj = &P[t->offset + j], save = *pj;
            *pj = save + FD_H;
            double lp = ref_loss(&c);
            *pj = save - FD_H;
            double lm = ref_loss(&c);
            *pj = save;
            double fd = (lp - lm) / (2 * FD_H), a = G[t->offset + j];
            double ratio = fabs(a - fd) / (FD_ATOL + FD_RTOL * fabs(fd));
            worst = ratio > worst ? ratio : worst;
            checked++;
            cr_assert(ratio <= 1.0, "%s: d loss / d %s[%lld]: analytic %.9g, finite difference %.9g",
                      what, t->name, (long long)j, a, fd);
        }
    }
    fprintf(stderr, "  %-28s %s loss |f-d| %.2e  max ratio %.3f (%lld elems)\n", what,
            train ? "train" : "eval ", fabs(loss - ref), worst, (long long)checked);
    tdm_model_free(m);
    free(x);
    free(y);
    free(P);
    free(Bu);
}

Test(builder, activations_and_pooling_match_finite_differences)
{
    check_fd("act+pool",
             "input 2x7x6\n"
             "conv 3x3 3 pad 1\n"
             "tanh\n"
             "conv 3x3 4 stride 2 pad 1  # strided: 4x4x3\n"
             "sigmoid\n"
             "avgpool 2                  # 4x2x1\n"
             "flatten\n"
             "linear 6\n"
             "gelu\n"
             "linear 5\n"
             "sigmoid\n"
             "relu                       # standalone: after sigmoid, not fused\n"
             "linear 3\n", 5, 1);
    check_fd("maxpool+avgpool global",
             "input 3x6x6\n"
             "conv 3x3 4\n"
             "relu\n"
             "maxpool 2\n"
             "gelu\n"
             "avgpool global\n"
             "flatten\n"
             "linear 3\n", 4, 1);
}

Test(builder, dropout_with_its_fixed_mask_matches_finite_differences)
{
    static const char *txt =
        "input 2x5x5\n"
        "conv 3x3 4 pad 1\n"
        "dropout 0.3                # on an image (CNHW inside): the mask in (C, H, W) order\n"
        "relu\n"
        "residual {\n"
        "  conv 3x3 4 pad 1\n"
        "  dropout 0.5\n"
        "}\n"
        "flatten\n"
        "linear 6\n"
        "tanh\n"
        "dropout 0.25               # on features\n"
        "linear 3\n";
    check_fd("dropout", txt, 6, 1);
    check_fd("dropout", txt, 6, 0);   /* the identity in evaluation */
}

Test(builder, residual_blocks_match_finite_differences)
{
    static const char *img =
        "input 2x6x6\n"
        "conv 3x3 3 pad 1\n"
        "batchnorm\n"
        "relu\n"
        "residual {                 # identity skip\n"
        "  conv 3x3 3 pad 1\n"
        "  batchnorm\n"
        "  relu\n"
        "  conv 3x3 3 pad 1\n"
        "}\n"
        "relu\n"
        "residual {\n"
        "  conv 3x3 4 stride 2 pad 1\n"
        "  tanh\n"
        "} proj                     # 1x1 conv, stride 2: 3x6x6 -> 4x3x3\n"
        "avgpool global\n"
        "flatten\n"
        "linear 3\n";
    check_fd("residual images", img, 4, 1);
    check_fd("residual images", img, 4, 0);
    check_fd("residual features",
             "input 10\n"
             "residual {                 # from the model's input\n"
             "  linear 10\n"
             "  tanh\n"
             "}\n"
             "linear 8\n"
             "residual {\n"
             "  residual {               # nested, sharing the input\n"
             "    linear 8\n"
             "    relu\n"
             "    linear 8\n"
             "  }\n"
             "  gelu\n"
             "}\n"
             "residual {\n"
             "  linear 6\n"
             "} proj                     # linear projection 8 -> 6\n"
             "relu\n"
             "linear 4\n", 5, 1);
    check_fd("residual multi-channel input",
             "input 3x4x4\n"
             "residual {\n"
             "  residual {\n"
             "    conv 3x3 3 pad 1\n"
             "  }\n"
             "  sigmoid\n"
             "  conv 3x3 3 pad 1\n"
             "}\n"
             "flatten\n"
             "linear 3\n", 3, 1);
}

/* ---- the built-ins, written with the builder ------------------------------ */

static void same_bits_levers(const tdm_model_spec *a, const tdm_model_spec *b, int B,
                             tdm_precision prec, int ckpt, const char *what)
{
    tdm_model *ma = NULL, *mb = NULL;
    TU_OK(tdm_model_init(&ma, tu_host(), a, 3));
    TU_OK(tdm_model_init(&mb, tu_host(), b, 3));
    TU_OK(tdm_model_set_precision(ma, prec));
    TU_OK(tdm_model_set_precision(mb, prec));
    TU_OK(tdm_model_set_checkpoint(ma, ckpt));
    TU_OK(tdm_model_set_checkpoint(mb, ckpt));
    cr_assert_eq(tdm_model_n_units(ma), tdm_model_n_units(mb), "%s: checkpoint units", what);
    for (int i = 0; i < tdm_model_n_layers(ma) && i < tdm_model_n_layers(mb); i++)
        cr_assert_eq(tdm_model_layer_unit(ma, i), tdm_model_layer_unit(mb, i),
                     "%s: layer %d's unit", what, i);
    cr_assert_eq(tdm_model_n_params(ma), tdm_model_n_params(mb), "%s: tensor count", what);
    cr_assert_eq(tdm_model_param_elems(ma), tdm_model_param_elems(mb), "%s: elements", what);
    for (int i = 0; i < tdm_model_n_params(ma); i++)
        cr_assert_str_eq(tdm_model_param_info(ma, i)->name, tdm_model_param_info(mb, i)->name);
    int F = tdm_model_in_features(ma);
    int64_t pe = tdm_model_param_elems(ma);
    float *x = tu_malloc((size_t)B * F * sizeof(float));
    int32_t *y = tu_malloc((size_t)B * sizeof(int32_t));
    tdm_rng r = tu_rng(9);
    for (int step = 0; step < 3; step++) {
        tu_fill(&r, x, (int64_t)B * F, -1.0f, 1.0f);
        for (int i = 0; i < B; i++) y[i] = (int32_t)tdm_rng_below(&r, 10);
        double la = 0, lb = 0;
        TU_OK(tdm_model_zero_grad(ma));
        TU_OK(tdm_model_zero_grad(mb));
        TU_OK(tdm_model_forward_backward(ma, x, y, B, &la));
        TU_OK(tdm_model_forward_backward(mb, x, y, B, &lb));
        cr_assert(la == lb, "%s step %d: loss %.9g vs %.9g", what, step, la, lb);
        cr_assert(!memcmp(tdm_model_grads(ma), tdm_model_grads(mb), (size_t)pe * sizeof(float)),
                  "%s step %d: gradients differ", what, step);
        float *pa = tdm_model_params(ma), *pb = tdm_model_params(mb);
        const float *ga = tdm_model_grads(ma), *gb = tdm_model_grads(mb);
        for (int64_t i = 0; i < pe; i++) {
            pa[i] -= 0.05f * ga[i];
            pb[i] -= 0.05f * gb[i];
        }
        cr_assert(!memcmp(pa, pb, (size_t)pe * sizeof(float)), "%s step %d: params", what, step);
        cr_assert(tdm_model_buffer_elems(ma) == tdm_model_buffer_elems(mb));
        if (tdm_model_buffer_elems(ma))
            cr_assert(!memcmp(tdm_model_buffers(ma), tdm_model_buffers(mb),
                              (size_t)tdm_model_buffer_elems(ma) * sizeof(float)),
                      "%s step %d: running statistics differ", what, step);
    }
    free(x);
    free(y);
    tdm_model_free(ma);
    tdm_model_free(mb);
}

static void same_bits(const tdm_model_spec *a, const tdm_model_spec *b, int B, const char *what)
{
    same_bits_levers(a, b, B, TDM_PRECISION_FP32, 0, what);
}

Test(builder, builtin_cnn_and_mlp_written_with_the_builder_train_the_same_bits)
{
    tdm_model_spec cnn, seq;
    tdm_model_spec_cnn(&cnn);
    TU_OK(tdm_model_seq_init(&seq, 1, 28, 28));
    for (int b = 0; b < 2; b++) {
        TU_OK(tdm_model_seq_conv(&seq, b ? 64 : 32, 3, 1, 1));
        TU_OK(tdm_model_seq_batchnorm(&seq));
        TU_OK(tdm_model_seq_act(&seq, TDM_MODEL_OP_RELU));
        TU_OK(tdm_model_seq_pool(&seq, TDM_MODEL_OP_MAXPOOL, 2));
    }
    TU_OK(tdm_model_seq_flatten(&seq));
    TU_OK(tdm_model_seq_linear(&seq, 128));
    TU_OK(tdm_model_seq_act(&seq, TDM_MODEL_OP_RELU));
    TU_OK(tdm_model_seq_linear(&seq, 10));
    TU_OK(tdm_model_seq_finish(&seq));
    same_bits(&cnn, &seq, 16, "cnn");

    tdm_model_spec mlp;
    static const int dims[] = {784, 64, 32, 10};
    tdm_model_spec_mlp(&mlp, dims, 4);
    const char *text = "input 784\nlinear 64\nrelu\nlinear 32\nrelu\nlinear 10\n";
    TU_OK(tdm_model_seq_parse_text(&seq, "mlp.tdm", text, strlen(text)));
    same_bits(&mlp, &seq, 32, "mlp");
}

/* The memory levers take a model file of the built-in layers, and train
 * it bitwise as the built-in model with the same levers. */
Test(builder, the_levers_train_builtin_layers_written_as_a_file_the_same_bits)
{
    tdm_model_spec cnn, seq, mlp;
    tdm_model_spec_cnn(&cnn);
    const char *ctext = "input 1x28x28\n"
                        "conv 3x3 32 pad 1\nbatchnorm\nrelu\nmaxpool 2\n"
                        "conv 3x3 64 pad 1\nbatchnorm\nrelu\nmaxpool 2\n"
                        "flatten\nlinear 128\nrelu\nlinear 10\n";
    TU_OK(tdm_model_seq_parse_text(&seq, "cnn.tdm", ctext, strlen(ctext)));
    cr_assert_eq(tdm_model_spec_lever_op(&seq), -1);
    same_bits_levers(&cnn, &seq, 8, TDM_PRECISION_BF16, 1, "cnn bf16 ckpt 1");
    same_bits_levers(&cnn, &seq, 8, TDM_PRECISION_FP16, 0, "cnn fp16");
    static const int dims[] = {784, 64, 32, 10};
    tdm_model_spec_mlp(&mlp, dims, 4);
    const char *mtext = "input 784\nlinear 64\nrelu\nlinear 32\nrelu\nlinear 10\n";
    TU_OK(tdm_model_seq_parse_text(&seq, "mlp.tdm", mtext, strlen(mtext)));
    same_bits_levers(&mlp, &seq, 16, TDM_PRECISION_BF16, 2, "mlp bf16 ckpt 2");
    same_bits_levers(&mlp, &seq, 16, TDM_PRECISION_FP32, 1, "mlp ckpt 1");
}

/* Any other layer keeps them out, naming its line. */
Test(builder, the_levers_refuse_other_layers_naming_the_line)
{
    static const struct { const char *text, *want; } cases[] = {
        {"input 4\nlinear 8\ntanh\nlinear 2\n", "`tanh` (line 3)"},
        {"input 4\nlinear 8\nrelu\nrelu\nlinear 2\n", "`relu` (line 4)"},
        {"input 1x4x4\nconv 3x3 2\nrelu\nflatten\nlinear 2\n", "`relu` (line 3)"},
        {"input 4\nresidual {\nlinear 4\n}\nlinear 2\n", "`residual {` (line 2)"},
        {"input 4\nlinear 8\ndropout 0.5\nlinear 2\n", "`dropout` (line 3)"},
        {"input 1x4x4\navgpool 2\nflatten\nlinear 2\n", "`avgpool` (line 2)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        tdm_model_spec s;
        TU_OK(tdm_model_seq_parse_text(&s, "x.tdm", cases[i].text, strlen(cases[i].text)));
        cr_assert_geq(tdm_model_spec_lever_op(&s), 0, "%s", cases[i].text);
        tdm_model *m = NULL;
        TU_OK(tdm_model_init(&m, tu_host(), &s, 1));
        cr_assert_eq(tdm_model_set_precision(m, TDM_PRECISION_BF16), TDM_STATUS_INVALID_ARG);
        cr_assert(strstr(tdm_error_message(), cases[i].want) &&
                      strstr(tdm_error_message(), "file:x.tdm's"),
                  "'%s' lacks '%s'", tdm_error_message(), cases[i].want);
        cr_assert_eq(tdm_model_set_checkpoint(m, 1), TDM_STATUS_INVALID_ARG);
        cr_assert(strstr(tdm_error_message(), cases[i].want), "%s", tdm_error_message());
        TU_OK(tdm_model_set_checkpoint(m, 0));
        TU_OK(tdm_model_set_precision(m, TDM_PRECISION_FP32));
        tdm_model_free(m);
    }
}

/* layernorm of feature vectors: after a linear, first (no input gradient
 * needed: backward's scratch takes it), inside a residual block. */
Test(builder, layernorm_matches_finite_differences)
{
    check_fd("layernorm",
             "input 6\n"
             "linear 8\n"
             "layernorm\n"
             "gelu\n"
             "residual {\n"
             "  layernorm\n"
             "  linear 8\n"
             "  tanh\n"
             "}\n"
             "linear 3\n", 4, 1);
    check_fd("layernorm first",
             "input 1x3x3\n"
             "flatten\n"
             "layernorm\n"
             "linear 4\n", 3, 1);
}

/* ---- shapes and errors ------------------------------------------------------ */

static void refused(const char *text, const char *want)
{
    tdm_model_spec s;
    tdm_status st = tdm_model_seq_parse_text(&s, "bad.tdm", text, strlen(text));
    cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "accepted: %s", text);
    cr_assert(strstr(tdm_error_message(), want), "message '%s' lacks '%s'", tdm_error_message(),
              want);
    cr_assert(!strchr(tdm_error_message(), '\n'), "more than one line: %s", tdm_error_message());
}

Test(builder, errors_name_the_line_and_the_shapes)
{
    refused("input 1x28x28\nconv 3x3 8\nlinear 10\n",
            "bad.tdm:3: `linear 10`: linear needs features, got an image of 8x26x26");
    refused("input 1x8x8\nresidual {\nconv 3x3 4 pad 1\n}\nflatten\nlinear 2\n",
            "bad.tdm:4: `}`: residual block: its input is 1x8x8 but its output 4x8x8");
    refused("input 1x8x8\nresidual {\nconv 3x3 4\nflatten\nlinear 2\n",
            "the residual block opened on line 2 is never closed");
    refused("input 4\n}\nlinear 2\n", "bad.tdm:2: `}`: `}` closes no residual block");
    refused("input 4\nresidual {\n}\nlinear 2\n", "empty residual block");
    refused("input 4\nlinaer 2\n", "bad.tdm:2: `linaer 2`: unknown layer 'linaer'");
    refused("input 4\nlinear -3\n", "output features '-3' is not a positive integer");
    refused("input 4\nlinear 99999999999\n", "output features 99999999999 is too large");
    refused("input 1x4x4\nconv 5x5 2\nflatten\nlinear 2\n", "does not fit an input of 1x4x4");
    refused("input 1x4x4\nmaxpool 8\nflatten\nlinear 2\n", "window does not fit");
    refused("input 1x4x4\nconv 3x3 2\n", "bad.tdm:2: the model's output is 2x2x2");
    refused("input 1x4x4\nflatten\nlinear 1\n", "at least 2 class scores");
    refused("input 1x4x4\nflatten\nrelu\n", "no layer with parameters");
    refused("linear 4\n", "bad.tdm:1: `linear 4`: a model file starts with `input");
    refused("# nothing\n\n", "no layers");
    refused("input 1x1000000x1000000\n", "at most");
    refused("input 4\nconv 3x3x3 2\n", "kernel width");
    refused("input 4\nlinear 4 4\n", "expected `linear OUT_FEATURES`");
    refused("input 1x4x4\nresidual {\nflatten\nlinear 3\n} proj\n",
            "bad.tdm:5: `} proj`: residual block: a projection maps images to images");
}

Test(builder, shapes_are_inferred_line_by_line)
{
    tdm_model_spec s;
    const char *text = "input 3x32x32\n"
                       "conv 3x3 16 stride 2 pad 1 # 16x16x16\n"
                       "maxpool 3                  # 16x5x5 (floor)\n"
                       "residual {\n"
                       "  conv 3x3 8 stride 2 pad 1   # 8x3x3\n"
                       "} proj\n"
                       "flatten\n"
                       "linear 10\n";
    TU_OK(tdm_model_seq_parse_text(&s, "ok.tdm", text, strlen(text)));
    cr_assert_eq(s.n_ops, 7);
    cr_assert(s.ops[0].c == 16 && s.ops[0].h == 16 && s.ops[0].w == 16);
    cr_assert(s.ops[1].c == 16 && s.ops[1].h == 5 && s.ops[1].w == 5);
    cr_assert(s.ops[4].c == 8 && s.ops[4].h == 3 && s.ops[4].w == 3 && s.ops[4].proj);
    cr_assert(s.ops[5].flat && s.ops[5].w == 72);
    cr_assert_eq(s.n_classes, 10);
    tdm_model *m = NULL;
    TU_OK(tdm_model_init(&m, tu_host(), &s, 1));
    const tdm_tensor_info *t = tdm_model_param_info(m, 2);
    cr_assert_str_eq(t->name, "res1.proj.weight");
    cr_assert(t->shape[0] == 8 && t->shape[1] == 16 && t->shape[2] == 1 && t->shape[3] == 1);
    tdm_model_free(m);
}

/* A block whose input is a batchnorm's output that a maxpool reads: on
 * host devices the pair fuses, and the fused backward had no place for
 * the block's skip gradient (analytic 0.0437 against 0.2347); the same
 * block after an activation (nothing fuses) is the control. */
Test(builder, a_block_opening_between_batchnorm_and_maxpool)
{
    check_fd("bn|res{maxpool} host-fused",
             "input 2x6x6\n"
             "conv 3x3 3 pad 1\n"
             "batchnorm\n"
             "residual {\n"
             "  maxpool 2\n"
             "  conv 3x3 4 pad 1\n"
             "} proj\n"
             "flatten\n"
             "linear 3\n", 4, 1);
}

Test(builder, the_same_block_after_an_activation)
{
    check_fd("bn|tanh|res{maxpool}",
             "input 2x6x6\n"
             "conv 3x3 3 pad 1\n"
             "batchnorm\n"
             "tanh\n"
             "residual {\n"
             "  maxpool 2\n"
             "  conv 3x3 4 pad 1\n"
             "} proj\n"
             "flatten\n"
             "linear 3\n", 4, 1);
}
