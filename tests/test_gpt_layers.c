/* tests/test_gpt_layers.c: every layer of the GPT on its own - token and
 * position embedding, LayerNorm, GELU, causal multi-head self-attention
 * (softmax and mask included), linear and the tied head - on the host
 * device: forward against a double reference written here, backward
 * against central finite differences of that reference, at odd shapes
 * (T not a multiple of anything, H dividing D, batch 1). The loss is
 * sum(w * y) for a fixed random w, so the output gradient is w. Also the
 * new kernels' own properties (rows of the causal softmax sum to 1 with
 * the future exactly 0, heads split/merge are inverse, backward adds) and
 * the strided-batched gemm (host entry and the dispatcher's loop). The
 * whole model is tests/test_gpt.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/device_impl.h"   /* a fake backend without gemm_strided_batched */
#include "core/kernels.h"
#include "models/layers_gpt.h"
#include "tests/test_util.h"

#define FD_H 1e-6
#define FD_ATOL 2e-5
#define FD_RTOL 1e-3

static tdm_device *g_dev;
static void setup(void) { g_dev = tu_host(); }
static void teardown(void) { tdm_device_free(g_dev); }
TestSuite(gpt_layers, .init = setup, .fini = teardown);

/* A double copy of float data. */
static double *to_d(const float *x, int64_t n)
{
    double *d = tu_malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

static double dot_w(const double *y, const float *w, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += y[i] * w[i];
    return s;
}

/* The reference: loss(theta) for a layer, theta being the doubles the
 * test perturbs (its inputs and parameters, packed by the test). */
typedef double (*ref_loss_fn)(void *ctx);

/* Central differences of f with respect to v[0..n) (a view inside the
 * context's doubles), against the float gradient g; every element, or
 * every `stride`-th. */
static void check_fd(const char *what, ref_loss_fn f, void *ctx, double *v, const float *g,
                     int64_t n, int stride)
{
    double worst = 0.0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i += stride) {
        double keep = v[i];
        v[i] = keep + FD_H;
        double lp = f(ctx);
        v[i] = keep - FD_H;
        double lm = f(ctx);
        v[i] = keep;
        double fd = (lp - lm) / (2 * FD_H);
        double r = fabs(g[i] - fd) / (FD_ATOL + FD_RTOL * fabs(fd));
        if (r > worst) {
            worst = r;
            at = i;
        }
    }
    cr_assert(worst <= 1.0, "%s: gradient[%lld] %.8g vs finite differences (ratio %.3f of the "
              "tolerance)", what, (long long)at, at >= 0 ? g[at] : 0.0, worst);
}

/* ---- embedding ---- */

typedef struct emb_ctx {
    int B, T, C;
    const int32_t *tok;
    double *wte, *wpe;
    const float *w;
} emb_ctx;

static double emb_ref(void *p)
{
    emb_ctx *c = p;
    double s = 0.0;
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            int64_t n = (int64_t)b * c->T + t;
            for (int j = 0; j < c->C; j++)
                s += (c->wte[c->tok[n] * c->C + j] + c->wpe[t * c->C + j]) * c->w[n * c->C + j];
        }
    return s;
}

Test(gpt_layers, embedding_forward_and_backward_with_repeated_tokens)
{
    static const int shapes[][4] = {{1, 7, 5, 3}, {3, 5, 9, 4}, {2, 1, 3, 2}};  /* B T C V */
    for (size_t si = 0; si < 3; si++) {
        int B = shapes[si][0], T = shapes[si][1], C = shapes[si][2], V = shapes[si][3];
        int64_t N = (int64_t)B * T;
        tdm_rng r = tu_rng(10 + si);
        int32_t *tok = tu_malloc((size_t)N * sizeof(int32_t));
        for (int64_t i = 0; i < N; i++) tok[i] = (int32_t)tdm_rng_below(&r, (uint64_t)V);
        float *wte = tu_malloc((size_t)V * C * 4), *wpe = tu_malloc((size_t)T * C * 4);
        float *y = tu_malloc((size_t)N * C * 4), *w = tu_malloc((size_t)N * C * 4);
        float *dwte = tu_malloc((size_t)V * C * 4), *dwpe = tu_malloc((size_t)T * C * 4);
        tu_fill(&r, wte, (int64_t)V * C, -1, 1);
        tu_fill(&r, wpe, (int64_t)T * C, -1, 1);
        tu_fill(&r, w, N * C, -1, 1);
        TU_OK(tdm_dev_embed_fwd(g_dev, tok, wte, wpe, y, B, T, C));
        for (int64_t n = 0; n < N; n++)
            for (int j = 0; j < C; j++)
                cr_assert_float_eq(y[n * C + j], wte[tok[n] * C + j] + wpe[(n % T) * C + j], 0.0f);
        /* backward adds: start from 1 */
        for (int64_t i = 0; i < (int64_t)V * C; i++) dwte[i] = 1.0f;
        for (int64_t i = 0; i < (int64_t)T * C; i++) dwpe[i] = 1.0f;
        TU_OK(tdm_dev_embed_bwd(g_dev, tok, w, dwte, dwpe, B, T, C));
        for (int64_t i = 0; i < (int64_t)V * C; i++) dwte[i] -= 1.0f;
        for (int64_t i = 0; i < (int64_t)T * C; i++) dwpe[i] -= 1.0f;
        emb_ctx c = {.B = B, .T = T, .C = C, .tok = tok, .wte = to_d(wte, (int64_t)V * C),
                     .wpe = to_d(wpe, (int64_t)T * C), .w = w};
        check_fd("embedding wte", emb_ref, &c, c.wte, dwte, (int64_t)V * C, 1);
        check_fd("embedding wpe", emb_ref, &c, c.wpe, dwpe, (int64_t)T * C, 1);
        free(c.wte); free(c.wpe);
        free(tok); free(wte); free(wpe); free(y); free(w); free(dwte); free(dwpe);
    }
}

/* ---- LayerNorm ---- */

typedef struct ln_ctx {
    int64_t rows;
    int C;
    double *x, *g, *b;
    const float *w;
    double *y;   /* out, for the forward check */
} ln_ctx;

static void ln_ref_fwd(ln_ctx *c)
{
    for (int64_t r = 0; r < c->rows; r++) {
        const double *x = c->x + r * c->C;
        double m = 0.0, v = 0.0;
        for (int j = 0; j < c->C; j++) m += x[j];
        m /= c->C;
        for (int j = 0; j < c->C; j++) v += (x[j] - m) * (x[j] - m);
        v /= c->C;
        double s = 1.0 / sqrt(v + 1e-5);
        for (int j = 0; j < c->C; j++) c->y[r * c->C + j] = (x[j] - m) * s * c->g[j] + c->b[j];
    }
}

static double ln_ref(void *p)
{
    ln_ctx *c = p;
    ln_ref_fwd(c);
    return dot_w(c->y, c->w, c->rows * c->C);
}

Test(gpt_layers, layernorm_forward_and_backward)
{
    static const int shapes[][2] = {{1, 5}, {7, 3}, {6, 17}, {2, 64}};
    for (size_t si = 0; si < 4; si++) {
        int64_t rows = shapes[si][0];
        int C = shapes[si][1];
        int64_t n = rows * C;
        tdm_rng r = tu_rng(20 + si);
        float *x = tu_malloc((size_t)n * 4), *y = tu_malloc((size_t)n * 4), *w = tu_malloc((size_t)n * 4);
        float *g = tu_malloc((size_t)C * 4), *b = tu_malloc((size_t)C * 4);
        float *mean = tu_malloc((size_t)rows * 4), *rstd = tu_malloc((size_t)rows * 4);
        float *dx = tu_malloc((size_t)n * 4), *dg = tu_malloc((size_t)C * 4), *db = tu_malloc((size_t)C * 4);
        /* an offset and a scale per row: the statistics must not care */
        for (int64_t i = 0; i < rows; i++) {
            float off = tu_unif(&r, -3, 3), sc = tu_unif(&r, 0.2f, 4);
            for (int j = 0; j < C; j++) x[i * C + j] = off + sc * tu_unif(&r, -1, 1);
        }
        tu_fill(&r, g, C, 0.5f, 1.5f);
        tu_fill(&r, b, C, -0.5f, 0.5f);
        tu_fill(&r, w, n, -1, 1);
        TU_OK(tdm_dev_layernorm_fwd(g_dev, x, g, b, y, mean, rstd, rows, C, 1e-5f));
        ln_ctx c = {.rows = rows, .C = C, .x = to_d(x, n), .g = to_d(g, C), .b = to_d(b, C), .w = w,
                    .y = tu_malloc((size_t)n * sizeof(double))};
        ln_ref_fwd(&c);
        int64_t at = 0;
        float *yr = tu_malloc((size_t)n * 4);
        for (int64_t i = 0; i < n; i++) yr[i] = (float)c.y[i];
        cr_assert(tu_tol_ratio(y, yr, n, 1e-5, 1e-5, &at, NULL) <= 1.0,
                  "layernorm %lldx%d: y[%lld] %g vs %g", (long long)rows, C, (long long)at, y[at],
                  yr[at]);
        /* backward adds into dx, dg, db: start them at 0.5 */
        for (int64_t i = 0; i < n; i++) dx[i] = 0.5f;
        for (int j = 0; j < C; j++) dg[j] = db[j] = 0.5f;
        TU_OK(tdm_dev_layernorm_bwd(g_dev, x, w, g, mean, rstd, dx, dg, db, rows, C));
        for (int64_t i = 0; i < n; i++) dx[i] -= 0.5f;
        for (int j = 0; j < C; j++) {
            dg[j] -= 0.5f;
            db[j] -= 0.5f;
        }
        check_fd("layernorm x", ln_ref, &c, c.x, dx, n, 1);
        check_fd("layernorm weight", ln_ref, &c, c.g, dg, C, 1);
        check_fd("layernorm bias", ln_ref, &c, c.b, db, C, 1);
        free(c.x); free(c.g); free(c.b); free(c.y); free(yr);
        free(x); free(y); free(w); free(g); free(b); free(mean); free(rstd); free(dx); free(dg); free(db);
    }
}

/* ---- GELU ---- */

static double gelu_d(double x)
{
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

typedef struct gelu_ctx {
    int64_t n;
    double *x;
    const float *w;
} gelu_ctx;

static double gelu_ref(void *p)
{
    gelu_ctx *c = p;
    double s = 0.0;
    for (int64_t i = 0; i < c->n; i++) s += gelu_d(c->x[i]) * c->w[i];
    return s;
}

Test(gpt_layers, gelu_forward_and_backward_including_the_tails)
{
    int64_t n = 203;
    tdm_rng r = tu_rng(30);
    float *x = tu_malloc((size_t)n * 4), *y = tu_malloc((size_t)n * 4), *w = tu_malloc((size_t)n * 4);
    float *dx = tu_malloc((size_t)n * 4);
    tu_fill(&r, x, n, -6, 6);
    x[0] = 0.0f; x[1] = 1e-6f; x[2] = -1e-6f; x[3] = 40.0f; x[4] = -40.0f; x[5] = 200.0f; x[6] = -200.0f;
    tu_fill(&r, w, n, -1, 1);
    TU_OK(tdm_dev_gelu_fwd(g_dev, x, y, n));
    for (int64_t i = 0; i < n; i++)
        cr_assert(tu_close(y[i], gelu_d(x[i]), 1e-6, 1e-5), "gelu(%g) = %g, reference %g", x[i],
                  y[i], gelu_d(x[i]));
    /* in place: dx aliases dy */
    memcpy(dx, w, (size_t)n * 4);
    TU_OK(tdm_dev_gelu_bwd(g_dev, x, dx, dx, n));
    gelu_ctx c = {.n = n, .x = to_d(x, n), .w = w};
    check_fd("gelu", gelu_ref, &c, c.x, dx, n, 1);
    free(c.x); free(x); free(y); free(w); free(dx);
}

/* ---- linear and the tied head ---- */

typedef struct lin_ctx {
    int64_t N;
    int in, out;
    double *x, *W, *b;   /* b may be NULL */
    const float *w;
} lin_ctx;

static double lin_ref(void *p)
{
    lin_ctx *c = p;
    double s = 0.0;
    for (int64_t n = 0; n < c->N; n++)
        for (int o = 0; o < c->out; o++) {
            double a = c->b ? c->b[o] : 0.0;
            for (int i = 0; i < c->in; i++) a += c->x[n * c->in + i] * c->W[o * c->in + i];
            s += a * c->w[n * c->out + o];
        }
    return s;
}

static void linear_case(int64_t N, int in, int out, int bias, int accumulate, uint64_t seed)
{
    tdm_rng r = tu_rng(seed);
    float *x = tu_malloc((size_t)(N * in) * 4), *W = tu_malloc((size_t)out * in * 4);
    float *b = bias ? tu_malloc((size_t)out * 4) : NULL;
    float *y = tu_malloc((size_t)(N * out) * 4), *w = tu_malloc((size_t)(N * out) * 4);
    float *dW = tu_malloc((size_t)out * in * 4), *db = bias ? tu_malloc((size_t)out * 4) : NULL;
    float *dx = tu_malloc((size_t)(N * in) * 4), *ones = tu_malloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) ones[i] = 1.0f;
    tu_fill(&r, x, N * in, -1, 1);
    tu_fill(&r, W, (int64_t)out * in, -1, 1);
    if (b) tu_fill(&r, b, out, -1, 1);
    tu_fill(&r, w, N * out, -1, 1);
    for (int64_t i = 0; i < N * out; i++) y[i] = accumulate ? 2.0f : NAN;
    TU_OK(tdm_layers_linear_fwd(g_dev, x, W, b, N, in, out, accumulate, y));
    lin_ctx c = {.N = N, .in = in, .out = out, .x = to_d(x, N * in),
                 .W = to_d(W, (int64_t)out * in), .b = b ? to_d(b, out) : NULL, .w = w};
    for (int64_t n = 0; n < N; n++)
        for (int o = 0; o < out; o++) {
            double a = (accumulate ? 2.0 : 0.0) + (b ? b[o] : 0.0);
            for (int i = 0; i < in; i++) a += c.x[n * in + i] * c.W[o * in + i];
            cr_assert(tu_close(y[n * out + o], a, 1e-5, 1e-5), "linear y[%lld][%d] %g vs %g",
                      (long long)n, o, y[n * out + o], a);
        }
    for (int64_t i = 0; i < (int64_t)out * in; i++) dW[i] = 0.25f;
    if (db) for (int o = 0; o < out; o++) db[o] = 0.25f;
    for (int64_t i = 0; i < N * in; i++) dx[i] = 3.0f;
    TU_OK(tdm_layers_linear_bwd(g_dev, x, W, w, ones, N, in, out, dW, db, dx, accumulate));
    for (int64_t i = 0; i < (int64_t)out * in; i++) dW[i] -= 0.25f;
    if (db) for (int o = 0; o < out; o++) db[o] -= 0.25f;
    if (accumulate) for (int64_t i = 0; i < N * in; i++) dx[i] -= 3.0f;
    check_fd("linear weight", lin_ref, &c, c.W, dW, (int64_t)out * in, 1);
    if (b) check_fd("linear bias", lin_ref, &c, c.b, db, out, 1);
    check_fd("linear input", lin_ref, &c, c.x, dx, N * in, 1);
    free(c.x); free(c.W); free(c.b);
    free(x); free(W); free(b); free(y); free(w); free(dW); free(db); free(dx); free(ones);
}

Test(gpt_layers, linear_with_bias_and_accumulating)
{
    linear_case(7, 5, 3, 1, 0, 40);
    linear_case(1, 4, 12, 1, 1, 41);
    linear_case(5, 9, 9, 1, 1, 42);
}

/* The head tied to the token embedding: logits (N, V) = x (N, D) wte^T,
 * no bias: dwte += dlogits^T x, dx = dlogits wte. */
Test(gpt_layers, tied_head)
{
    linear_case(6, 5, 11, 0, 0, 43);
    linear_case(1, 8, 256, 0, 0, 44);
}

/* ---- attention ---- */

typedef struct attn_ctx {
    int B, T, H, C;
    double *qkv;       /* (N, 3C) */
    const float *w;    /* (N, C) */
    double *y;         /* (N, C) out */
} attn_ctx;

static void attn_ref_fwd(attn_ctx *c)
{
    int B = c->B, T = c->T, H = c->H, C = c->C, hd = C / H;
    double scale = 1.0 / sqrt((double)hd);
    double *s = tu_malloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const double *q = c->qkv + ((int64_t)b * T + t) * 3 * C + h * hd;
                double mx = -INFINITY, sum = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double *k = c->qkv + ((int64_t)b * T + j) * 3 * C + C + h * hd;
                    double a = 0.0;
                    for (int e = 0; e < hd; e++) a += q[e] * k[e];
                    s[j] = a * scale;
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = 0; j <= t; j++) sum += (s[j] = exp(s[j] - mx));
                double *y = c->y + ((int64_t)b * T + t) * C + h * hd;
                for (int e = 0; e < hd; e++) {
                    double a = 0.0;
                    for (int j = 0; j <= t; j++)
                        a += s[j] / sum * c->qkv[((int64_t)b * T + j) * 3 * C + 2 * C + h * hd + e];
                    y[e] = a;
                }
            }
    free(s);
}

static double attn_ref(void *p)
{
    attn_ctx *c = p;
    attn_ref_fwd(c);
    return dot_w(c->y, c->w, (int64_t)c->B * c->T * c->C);
}

typedef struct attn_bufs {
    float *qkv, *q, *k, *v, *att, *yh, *y, *w, *dyh, *datt, *dq, *dk, *dv, *dqkv;
} attn_bufs;

static void attn_alloc(attn_bufs *a, int B, int T, int H, int C)
{
    int64_t N = (int64_t)B * T, NC = N * C, TT = (int64_t)B * H * T * T;
    a->qkv = tu_malloc((size_t)(3 * NC) * 4);
    a->q = tu_malloc((size_t)NC * 4); a->k = tu_malloc((size_t)NC * 4); a->v = tu_malloc((size_t)NC * 4);
    a->att = tu_malloc((size_t)TT * 4); a->yh = tu_malloc((size_t)NC * 4);
    a->y = tu_malloc((size_t)NC * 4); a->w = tu_malloc((size_t)NC * 4);
    a->dyh = tu_malloc((size_t)NC * 4); a->datt = tu_malloc((size_t)TT * 4);
    a->dq = tu_malloc((size_t)NC * 4); a->dk = tu_malloc((size_t)NC * 4); a->dv = tu_malloc((size_t)NC * 4);
    a->dqkv = tu_malloc((size_t)(3 * NC) * 4);
    (void)H;
}

static void attn_free(attn_bufs *a)
{
    float *all[] = {a->qkv, a->q, a->k, a->v, a->att, a->yh, a->y, a->w, a->dyh, a->datt,
                    a->dq, a->dk, a->dv, a->dqkv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

Test(gpt_layers, causal_attention_forward_and_backward)
{
    /* B T H C: T = 1, prime T, H = 1 and H = C (one feature per head) */
    static const int shapes[][4] = {{1, 7, 3, 6}, {2, 5, 2, 8}, {1, 1, 1, 4}, {3, 4, 4, 4},
                                    {2, 9, 1, 3}};
    for (size_t si = 0; si < 5; si++) {
        int B = shapes[si][0], T = shapes[si][1], H = shapes[si][2], C = shapes[si][3];
        int64_t N = (int64_t)B * T;
        attn_bufs a;
        attn_alloc(&a, B, T, H, C);
        tdm_rng r = tu_rng(50 + si);
        tu_fill(&r, a.qkv, 3 * N * C, -2, 2);
        tu_fill(&r, a.w, N * C, -1, 1);
        tdm_layers_attn L = {.B = B, .T = T, .H = H, .C = C, .q = a.q, .k = a.k, .v = a.v,
                             .att = a.att};
        TU_OK(tdm_layers_attention_fwd(g_dev, &L, a.qkv, a.yh, a.y));
        attn_ctx c = {.B = B, .T = T, .H = H, .C = C, .qkv = to_d(a.qkv, 3 * N * C), .w = a.w,
                      .y = tu_malloc((size_t)(N * C) * sizeof(double))};
        attn_ref_fwd(&c);
        for (int64_t i = 0; i < N * C; i++)
            cr_assert(tu_close(a.y[i], c.y[i], 1e-5, 1e-4), "attention %dx%d h%d c%d: y[%lld] %g vs %g",
                      B, T, H, C, (long long)i, a.y[i], c.y[i]);
        TU_OK(tdm_layers_attention_bwd(g_dev, &L, a.w, a.dyh, a.datt, a.dq, a.dk, a.dv, a.dqkv));
        check_fd("attention qkv", attn_ref, &c, c.qkv, a.dqkv, 3 * N * C, 1);
        free(c.qkv);
        free(c.y);
        attn_free(&a);
    }
}

/* The mask is causal: with the loss on one position t0 only, nothing after
 * t0 gets a gradient - exactly zero, not merely small. */
Test(gpt_layers, attention_gradient_never_reaches_the_future)
{
    int B = 2, T = 6, H = 2, C = 4, t0 = 2;
    int64_t N = (int64_t)B * T;
    attn_bufs a;
    attn_alloc(&a, B, T, H, C);
    tdm_rng r = tu_rng(60);
    tu_fill(&r, a.qkv, 3 * N * C, -2, 2);
    memset(a.w, 0, (size_t)(N * C) * 4);
    for (int b = 0; b < B; b++)
        for (int j = 0; j < C; j++) a.w[((int64_t)b * T + t0) * C + j] = tu_unif(&r, -1, 1);
    tdm_layers_attn L = {.B = B, .T = T, .H = H, .C = C, .q = a.q, .k = a.k, .v = a.v, .att = a.att};
    TU_OK(tdm_layers_attention_fwd(g_dev, &L, a.qkv, a.yh, a.y));
    TU_OK(tdm_layers_attention_bwd(g_dev, &L, a.w, a.dyh, a.datt, a.dq, a.dk, a.dv, a.dqkv));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < 3 * C; j++) {
                float gval = a.dqkv[((int64_t)b * T + t) * 3 * C + j];
                if (t > t0) cr_assert_eq(gval, 0.0f, "position %d > %d got gradient %g", t, t0, gval);
            }
    /* and the probabilities: each row sums to 1 over the past, the future is 0 */
    for (int64_t row = 0; row < (int64_t)B * H * T; row++) {
        int t = (int)(row % T);
        double s = 0.0;
        for (int j = 0; j < T; j++) {
            float p = a.att[row * T + j];
            if (j > t) cr_assert_eq(p, 0.0f);
            else cr_assert(p > 0.0f);
            s += p;
        }
        cr_assert(fabs(s - 1.0) < 1e-6, "row %lld sums to %.9f", (long long)row, s);
    }
    attn_free(&a);
}

Test(gpt_layers, causal_softmax_is_stable_at_huge_scores)
{
    int T = 5;
    float att[25], ref[25];
    for (int i = 0; i < 25; i++) att[i] = (i % 3 ? 1000.0f : -1000.0f) + (float)i;
    memcpy(ref, att, sizeof att);
    TU_OK(tdm_dev_attn_softmax_fwd(g_dev, att, T, T));
    for (int t = 0; t < T; t++) {
        double mx = -INFINITY, s = 0.0;
        for (int j = 0; j <= t; j++) mx = ref[t * T + j] > mx ? ref[t * T + j] : mx;
        for (int j = 0; j <= t; j++) s += exp(ref[t * T + j] - mx);
        for (int j = 0; j < T; j++) {
            double want = j <= t ? exp(ref[t * T + j] - mx) / s : 0.0;
            cr_assert(isfinite(att[t * T + j]) && fabs(att[t * T + j] - want) < 1e-6,
                      "row %d col %d: %g vs %g", t, j, att[t * T + j], want);
        }
    }
}

Test(gpt_layers, heads_split_and_merge_are_inverse)
{
    int B = 2, T = 3, H = 3, hd = 2, C = H * hd, ld = 3 * C;
    int64_t N = (int64_t)B * T;
    float *src = tu_malloc((size_t)(N * ld) * 4), *back = tu_malloc((size_t)(N * ld) * 4);
    float *hq = tu_malloc((size_t)(N * C) * 4);
    for (int64_t i = 0; i < N * ld; i++) src[i] = (float)i;
    for (int part = 0; part < 3; part++) {
        TU_OK(tdm_dev_heads_split(g_dev, src, ld, part * C, hq, B, T, H, hd));
        /* (b, h, t, e) holds row b*T+t, column part*C + h*hd + e */
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int t = 0; t < T; t++)
                    for (int e = 0; e < hd; e++)
                        cr_assert_float_eq(hq[(((int64_t)b * H + h) * T + t) * hd + e],
                                           src[((int64_t)b * T + t) * ld + part * C + h * hd + e], 0.0f);
        TU_OK(tdm_dev_heads_merge(g_dev, hq, back, ld, part * C, B, T, H, hd));
    }
    cr_assert(!memcmp(src, back, (size_t)(N * ld) * 4));
    free(src); free(back); free(hq);
}

/* ---- strided-batched gemm ---- */

/* Column-major reference: C_i = alpha op(A_i) op(B_i) + beta C_i. */
static void ref_gemm_batched(tdm_trans ta, tdm_trans tb, int m, int n, int k, float alpha,
                             const float *a, int lda, long long sa, const float *b, int ldb,
                             long long sb, float beta, const float *c0, double *c, int ldc,
                             long long sc, int batch)
{
    for (int i = 0; i < batch; i++)
        for (int col = 0; col < n; col++)
            for (int row = 0; row < m; row++) {
                double s = 0.0;
                for (int p = 0; p < k; p++) {
                    double av = ta == TDM_TRANS_N ? a[i * sa + row + (int64_t)p * lda]
                                                  : a[i * sa + p + (int64_t)row * lda];
                    double bv = tb == TDM_TRANS_N ? b[i * sb + p + (int64_t)col * ldb]
                                                  : b[i * sb + col + (int64_t)p * ldb];
                    s += av * bv;
                }
                int64_t ci = i * sc + row + (int64_t)col * ldc;
                c[ci] = alpha * s + beta * c0[ci];
            }
}

Test(gpt_layers, gemm_strided_batched_host_entry_and_dispatcher_loop)
{
    /* a device whose table lacks the entry: the dispatcher's loop */
    static tdm_device_ops no_batched;
    no_batched = *g_dev->ops;
    no_batched.gemm_strided_batched = NULL;
    tdm_device loopdev = *g_dev;
    loopdev.ops = &no_batched;
    tdm_device *devs[2] = {g_dev, &loopdev};
    cr_assert_not_null(g_dev->ops->gemm_strided_batched, "the host backend has its own entry");
    static const int sizes[][4] = {{3, 5, 4, 3}, {1, 1, 1, 1}, {7, 2, 9, 5}, {4, 4, 1, 2}};
    for (int dv = 0; dv < 2; dv++)
        for (size_t si = 0; si < 4; si++)
            for (int ta = 0; ta < 2; ta++)
                for (int tb = 0; tb < 2; tb++) {
                    int m = sizes[si][0], n = sizes[si][1], k = sizes[si][2], batch = sizes[si][3];
                    int lda = (ta ? k : m) + 1, ldb = (tb ? n : k) + 2, ldc = m + 1;
                    /* strides larger than a matrix: gaps the product must not touch */
                    long long sa = (long long)lda * (ta ? m : k) + 3;
                    long long sb = (long long)ldb * (tb ? k : n) + 1, sc = (long long)ldc * n + 5;
                    tdm_rng r = tu_rng(70 + si * 4 + ta * 2 + tb);
                    float *A = tu_malloc((size_t)(sa * batch) * 4), *B = tu_malloc((size_t)(sb * batch) * 4);
                    float *C = tu_malloc((size_t)(sc * batch) * 4), *C0 = tu_malloc((size_t)(sc * batch) * 4);
                    double *R = tu_malloc((size_t)(sc * batch) * sizeof(double));
                    tu_fill(&r, A, sa * batch, -1, 1);
                    tu_fill(&r, B, sb * batch, -1, 1);
                    tu_fill(&r, C0, sc * batch, -1, 1);
                    memcpy(C, C0, (size_t)(sc * batch) * 4);
                    for (long long i = 0; i < sc * batch; i++) R[i] = C0[i];
                    ref_gemm_batched((tdm_trans)ta, (tdm_trans)tb, m, n, k, 0.75f, A, lda, sa, B,
                                     ldb, sb, -0.5f, C0, R, ldc, sc, batch);
                    TU_OK(tdm_dev_gemm_strided_batched(devs[dv], (tdm_trans)ta, (tdm_trans)tb, m,
                                                       n, k, 0.75f, A, lda, sa, B, ldb, sb, -0.5f,
                                                       C, ldc, sc, batch));
                    for (long long i = 0; i < sc * batch; i++)
                        cr_assert(tu_close(C[i], R[i], 1e-5, 1e-5),
                                  "%s %dx%dx%d batch %d ta %d tb %d: C[%lld] %g vs %g",
                                  dv ? "loop" : "host", m, n, k, batch, ta, tb, i, C[i], R[i]);
                    free(A); free(B); free(C); free(C0); free(R);
                }
    float x = 0.0f;
    cr_assert_eq(tdm_dev_gemm_strided_batched(g_dev, TDM_TRANS_N, TDM_TRANS_N, 1, 1, 1, 1.0f, &x,
                                              1, -1, &x, 1, 0, 0.0f, &x, 1, 0, 1),
                 TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dev_gemm_strided_batched(g_dev, TDM_TRANS_N, TDM_TRANS_N, 2, 1, 1, 1.0f, &x,
                                              1, 0, &x, 1, 0, 0.0f, &x, 2, 0, 1),
                 TDM_STATUS_INVALID_ARG, "lda 1 < m 2 must be refused");
    TU_OK(tdm_dev_gemm_strided_batched(g_dev, TDM_TRANS_N, TDM_TRANS_N, 1, 1, 1, 1.0f, NULL, 1,
                                       0, NULL, 1, 0, 0.0f, NULL, 1, 0, 0));
}

/* The exp under GELU and the attention softmax: within a few ulp of exp
 * over its whole range, clamped outside it, NaN through. */
Test(gpt_layers, fast_exp_accuracy_and_limits)
{
    double worst = 0.0, at = 0.0;
    for (int i = 0; i <= 2000000; i++) {
        float x = -87.3f + (88.0f + 87.3f) * (float)i / 2000000.0f;
        double want = exp((double)x), got = tdm_k_expf(x);
        double rel = fabs(got - want) / want;
        if (rel > worst) {
            worst = rel;
            at = x;
        }
    }
    cr_assert(worst < 3.0 * 0x1p-24, "worst relative error %.3g at x = %.9g", worst, at);
    cr_assert_eq(tdm_k_expf(0.0f), 1.0f);
    cr_assert(tdm_k_expf(1000.0f) > 1e38f && isfinite(tdm_k_expf(1000.0f)));
    cr_assert(tdm_k_expf(INFINITY) > 1e38f && isfinite(tdm_k_expf(INFINITY)));
    cr_assert(tdm_k_expf(-1000.0f) >= 0.0f && tdm_k_expf(-1000.0f) < 1e-37f);
    cr_assert(tdm_k_expf(-INFINITY) < 1e-37f);
    cr_assert(isnan(tdm_k_expf(NAN)));
    /* and tanh at its limits, as GELU uses it */
    cr_assert_eq(tdm_k_tanh(50.0f), 1.0f);
    cr_assert_eq(tdm_k_tanh(-50.0f), -1.0f);
    cr_assert(fabs(tdm_k_tanh(0.5f) - tanh(0.5)) < 1e-7);
}
