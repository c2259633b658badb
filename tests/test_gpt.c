/* tests/test_gpt.c: the whole GPT (models/gpt.c) on the host device
 * against an independent double-precision reference of the same math
 * written here from the parameter table alone (embeddings, pre-LN blocks
 * with causal attention and a GELU MLP, ln_f, the tied head, the mean
 * next-byte cross-entropy): the loss; every parameter's gradient against
 * central differences of the reference; one SGD step (momentum, weight
 * decay) against the same step in double. Also: GPT-2's tensor names and
 * shapes, the grad-ready hook (each parameter announced once, end to
 * start, with its final gradient - the tied embedding last), backward
 * adds, a shorter forward equals the full one's prefix, generation, and
 * bad input (heads that do not divide the width, tokens outside the
 * vocabulary); the same check of a GPT written as a model file
 * (models/builder_gpt.c). The layers one by one are
 * tests/test_gpt_layers.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/builder.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tests/test_util.h"

#define FD_H 1e-5
#define G_ATOL 2e-5
#define G_RTOL 2e-3

/* ---- the double reference ---- */

typedef struct ref_gpt {
    tdm_model *m;
    double *P;            /* parameters, flat with the model's offsets */
    const int32_t *tok, *tgt;
    int B, T;
} ref_gpt;

static const double *rp(ref_gpt *r, const char *fmt, int l)
{
    char name[64];
    snprintf(name, sizeof name, fmt, l);
    for (int i = 0; i < tdm_model_n_params(r->m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(r->m, i);
        if (!strcmp(t->name, name)) return r->P + t->offset;
    }
    cr_assert_fail("no parameter %s", name);
    return NULL;
}

static void r_ln(const double *x, const double *g, const double *b, int64_t N, int C, double *y)
{
    for (int64_t n = 0; n < N; n++) {
        double m = 0, v = 0;
        for (int j = 0; j < C; j++) m += x[n * C + j];
        m /= C;
        for (int j = 0; j < C; j++) v += (x[n * C + j] - m) * (x[n * C + j] - m);
        v /= C;
        double s = 1.0 / sqrt(v + 1e-5);
        for (int j = 0; j < C; j++) y[n * C + j] = (x[n * C + j] - m) * s * g[j] + b[j];
    }
}

/* y (N, out) (+)= x (N, in) W^T + b */
static void r_lin(const double *x, const double *W, const double *b, int64_t N, int in, int out,
                  int add, double *y)
{
    for (int64_t n = 0; n < N; n++)
        for (int o = 0; o < out; o++) {
            double a = b ? b[o] : 0.0;
            for (int i = 0; i < in; i++) a += x[n * in + i] * W[(int64_t)o * in + i];
            y[n * out + o] = (add ? y[n * out + o] : 0.0) + a;
        }
}

static double ref_loss(ref_gpt *r)
{
    const tdm_model_spec *s = tdm_model_get_spec(r->m);
    int L = s->n_layer, C = s->n_embd, H = s->n_head, V = s->vocab, T = r->T, hd = C / H;
    int64_t N = (int64_t)r->B * T;
    double *x = tu_malloc((size_t)(N * C) * 8), *h = tu_malloc((size_t)(N * C) * 8);
    double *qkv = tu_malloc((size_t)(N * 3 * C) * 8), *y = tu_malloc((size_t)(N * C) * 8);
    double *f = tu_malloc((size_t)(N * 4 * C) * 8), *sc = tu_malloc((size_t)T * 8);
    const double *wte = rp(r, "transformer.wte.weight", 0), *wpe = rp(r, "transformer.wpe.weight", 0);
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < C; j++) x[n * C + j] = wte[r->tok[n] * C + j] + wpe[(n % T) * C + j];
    for (int l = 0; l < L; l++) {
        r_ln(x, rp(r, "transformer.h.%d.ln_1.weight", l), rp(r, "transformer.h.%d.ln_1.bias", l), N, C, h);
        r_lin(h, rp(r, "transformer.h.%d.attn.c_attn.weight", l),
              rp(r, "transformer.h.%d.attn.c_attn.bias", l), N, C, 3 * C, 0, qkv);
        for (int b = 0; b < r->B; b++)
            for (int hh = 0; hh < H; hh++)
                for (int t = 0; t < T; t++) {
                    const double *q = qkv + ((int64_t)b * T + t) * 3 * C + hh * hd;
                    double mx = -INFINITY, sum = 0;
                    for (int j = 0; j <= t; j++) {
                        const double *k = qkv + ((int64_t)b * T + j) * 3 * C + C + hh * hd;
                        double a = 0;
                        for (int e = 0; e < hd; e++) a += q[e] * k[e];
                        sc[j] = a / sqrt((double)hd);
                        if (sc[j] > mx) mx = sc[j];
                    }
                    for (int j = 0; j <= t; j++) sum += (sc[j] = exp(sc[j] - mx));
                    for (int e = 0; e < hd; e++) {
                        double a = 0;
                        for (int j = 0; j <= t; j++)
                            a += sc[j] / sum * qkv[((int64_t)b * T + j) * 3 * C + 2 * C + hh * hd + e];
                        y[((int64_t)b * T + t) * C + hh * hd + e] = a;
                    }
                }
        r_lin(y, rp(r, "transformer.h.%d.attn.c_proj.weight", l),
              rp(r, "transformer.h.%d.attn.c_proj.bias", l), N, C, C, 1, x);
        r_ln(x, rp(r, "transformer.h.%d.ln_2.weight", l), rp(r, "transformer.h.%d.ln_2.bias", l), N, C, h);
        r_lin(h, rp(r, "transformer.h.%d.mlp.c_fc.weight", l), rp(r, "transformer.h.%d.mlp.c_fc.bias", l),
              N, C, 4 * C, 0, f);
        for (int64_t i = 0; i < N * 4 * C; i++) {
            double v = f[i];
            f[i] = 0.5 * v * (1.0 + tanh(sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
        }
        r_lin(f, rp(r, "transformer.h.%d.mlp.c_proj.weight", l),
              rp(r, "transformer.h.%d.mlp.c_proj.bias", l), N, 4 * C, C, 1, x);
    }
    r_ln(x, rp(r, "transformer.ln_f.weight", 0), rp(r, "transformer.ln_f.bias", 0), N, C, h);
    /* the head: tied (wte), or an untied model file's own weight */
    const double *head = s->head_untied ? rp(r, "lm_head.weight", 0) : wte;
    double loss = 0.0;
    double *z = tu_malloc((size_t)V * 8);
    for (int64_t n = 0; n < N; n++) {
        double mx = -INFINITY, se = 0;
        for (int v = 0; v < V; v++) {
            double a = 0;
            for (int j = 0; j < C; j++) a += h[n * C + j] * head[(int64_t)v * C + j];
            z[v] = a;
            if (a > mx) mx = a;
        }
        for (int v = 0; v < V; v++) se += exp(z[v] - mx);
        loss += mx + log(se) - z[r->tgt[n]];
    }
    free(x); free(h); free(qkv); free(y); free(f); free(sc); free(z);
    return loss / (double)N;
}

/* ---- helpers ---- */

/* Parameters spread wider than GPT-2's initialisation, so that every
 * path carries a gradient well above float noise. */
static void randomize(tdm_model *m, uint64_t seed)
{
    tdm_rng r = tu_rng(seed);
    float *p = tdm_model_params(m);
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        int ln = strstr(t->name, ".ln_") != NULL, bias = strstr(t->name, ".bias") != NULL;
        float lo = ln && !bias ? 0.6f : bias ? -0.2f : -0.35f, hi = ln && !bias ? 1.4f : bias ? 0.2f : 0.35f;
        tu_fill(&r, p + t->offset, t->n_elem, lo, hi);
    }
}

static void make_batch(int B, int T, uint64_t seed, int32_t *tok, int32_t *tgt)
{
    /* a small alphabet, so tokens repeat inside and across windows */
    static const int32_t alphabet[] = {'e', 't', ' ', 'a', '\n', 200, 0, 255};
    tdm_rng r = tu_rng(seed);
    for (int64_t i = 0; i < (int64_t)B * T; i++) {
        tok[i] = alphabet[tdm_rng_below(&r, 8)];
        tgt[i] = alphabet[tdm_rng_below(&r, 8)];
    }
}

static tdm_model *make_gpt(tdm_device *d, int L, int C, int H, int T, uint64_t seed)
{
    tdm_model_spec s;
    tdm_model *m = NULL;
    tdm_model_spec_gpt(&s, L, C, H, T);
    TU_OK(tdm_model_init(&m, d, &s, seed));
    return m;
}

static void check_spec_against_reference(const tdm_model_spec *s, int B, uint64_t seed)
{
    tdm_device *d = tu_host();
    int L = s->n_layer, C = s->n_embd, H = s->n_head, T = s->n_ctx;
    tdm_model *m = NULL;
    TU_OK(tdm_model_init(&m, d, s, 3));
    randomize(m, seed);
    int64_t N = (int64_t)B * T, pe = tdm_model_param_elems(m);
    int32_t *tok = tu_malloc((size_t)N * 4), *tgt = tu_malloc((size_t)N * 4);
    make_batch(B, T, seed + 1, tok, tgt);
    float *p0 = tu_malloc((size_t)pe * 4);
    memcpy(p0, tdm_model_params(m), (size_t)pe * 4);
    ref_gpt r = {.m = m, .P = tu_malloc((size_t)pe * 8), .tok = tok, .tgt = tgt, .B = B, .T = T};
    for (int64_t i = 0; i < pe; i++) r.P[i] = p0[i];

    /* one training step: SGD with momentum and weight decay */
    tdm_optim *opt = NULL;
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    oo.lr = 0.1f;
    oo.momentum = 0.9f;
    oo.weight_decay = 0.01f;
    TU_OK(tdm_optim_init(&opt, m, &oo));
    tdm_single single = {.model = m, .opt = opt};
    double loss = 0.0;
    TU_OK(tdm_single_step(&single, tok, tgt, B, &loss));
    double ref = ref_loss(&r);
    cr_assert(fabs(loss - ref) <= 1e-5 * fabs(ref), "gpt %d-%d-%d-%d batch %d: loss %.9f vs double %.9f",
              L, C, H, T, B, loss, ref);
    /* every gradient against central differences of the reference */
    const float *g = tdm_model_grads(m);
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        double worst = 0.0;
        int64_t at = -1;
        double fd_at = 0.0;
        /* the token embedding has 256 rows; only the batch's tokens (and the
         * head, for every row) reach them, so sample its rows sparsely */
        int64_t stride = t->n_elem > 600 ? 7 : 1;
        for (int64_t j = 0; j < t->n_elem; j += stride) {
            double *v = r.P + t->offset + j, keep = *v;
            *v = keep + FD_H;
            double lp = ref_loss(&r);
            *v = keep - FD_H;
            double lm = ref_loss(&r);
            *v = keep;
            double fd = (lp - lm) / (2 * FD_H);
            double q = fabs(g[t->offset + j] - fd) / (G_ATOL + G_RTOL * fabs(fd));
            if (q > worst) {
                worst = q;
                at = j;
                fd_at = fd;
            }
        }
        cr_assert(worst <= 1.0, "gpt %d-%d-%d-%d batch %d: %s[%lld] gradient %.8g vs finite "
                  "differences %.8g", L, C, H, T, B, t->name, (long long)at,
                  g[t->offset + at], fd_at);
    }
    /* the step, in double from the float gradients' reference (the finite
     * differences are checked above; here the update rule): first SGD
     * step with momentum: buf = g + wd p; p -= lr buf */
    const float *p1 = tdm_model_params(m);
    for (int64_t j = 0; j < pe; j++) {
        double want = p0[j] - 0.1 * ((double)g[j] + 0.01 * p0[j]);
        cr_assert(fabs(p1[j] - want) <= 1e-6 + 1e-6 * fabs(want), "param %lld after the step: "
                  "%.9g vs %.9g", (long long)j, p1[j], want);
    }
    free(r.P); free(p0); free(tok); free(tgt);
    tdm_single_free(&single);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(d);
}

static void check_against_reference(int L, int C, int H, int T, int B, uint64_t seed)
{
    tdm_model_spec s;
    tdm_model_spec_gpt(&s, L, C, H, T);
    check_spec_against_reference(&s, B, seed);
}

Test(gpt, one_step_matches_the_double_reference, .timeout = 300)
{
    check_against_reference(2, 12, 3, 7, 2, 11);   /* T prime, hd 4 */
}

Test(gpt, one_step_matches_the_double_reference_batch_1_one_head, .timeout = 300)
{
    check_against_reference(1, 10, 1, 5, 1, 12);
}

Test(gpt, one_step_matches_the_double_reference_head_per_feature, .timeout = 300)
{
    check_against_reference(1, 6, 6, 3, 3, 13);   /* hd 1, T 3 */
}

/* The GPT written as layers in a model file (models/builder_gpt.c): its
 * token embedding, positions, layernorms, attention, gptmlp and tied
 * head against the reference, every gradient against finite differences. */
Test(gpt, a_model_file_of_its_layers_matches_the_double_reference, .timeout = 300)
{
    const char *text = "input tokens 5\n"
                       "embedding vocab 256 dim 8\n"
                       "embedding positions\n"
                       "residual {\n layernorm\n attention heads 2\n}\n"
                       "residual {\n layernorm\n gptmlp\n}\n"
                       "layernorm\n"
                       "lmhead tied\n";
    tdm_model_spec s;
    TU_OK(tdm_model_seq_parse_text(&s, "gpt.tdm", text, strlen(text)));
    cr_assert_eq(s.kind, TDM_MODEL_GPT);
    check_spec_against_reference(&s, 2, 14);
}

/* The same with an untied head (`lmhead`: lm_head.weight of its own). */
Test(gpt, a_model_file_with_an_untied_head_matches_the_double_reference, .timeout = 300)
{
    const char *text = "input tokens 4\n"
                       "embedding vocab 256 dim 6\n"
                       "embedding positions\n"
                       "residual {\n layernorm\n attention heads 3\n}\n"
                       "residual {\n layernorm\n gptmlp\n}\n"
                       "layernorm\n"
                       "lmhead\n";
    tdm_model_spec s;
    TU_OK(tdm_model_seq_parse_text(&s, "gpt_untied.tdm", text, strlen(text)));
    cr_assert(s.kind == TDM_MODEL_GPT && s.head_untied);
    check_spec_against_reference(&s, 2, 15);
}

/* ---- structure ---- */

Test(gpt, gpt2_names_shapes_and_layer_groups)
{
    tdm_device *d = tu_host();
    tdm_model *m = make_gpt(d, 3, 16, 4, 9, 1);
    cr_assert_eq(tdm_model_n_params(m), 12 * 3 + 4);
    cr_assert_eq(tdm_model_n_buffers(m), 0);
    cr_assert_eq(tdm_model_input_dtype(m), TDM_MODEL_INPUT_TOKENS);
    cr_assert_eq(tdm_model_in_features(m), 9);
    cr_assert_eq(tdm_model_out_rows(m), 9);
    cr_assert_eq(tdm_model_n_classes(m), 256);
    static const struct { int i; const char *name; int ndim; int64_t s0, s1; } want[] = {
        {0, "transformer.wte.weight", 2, 256, 16},
        {1, "transformer.wpe.weight", 2, 9, 16},
        {2, "transformer.h.0.ln_1.weight", 1, 16, 0},
        {3, "transformer.h.0.ln_1.bias", 1, 16, 0},
        {4, "transformer.h.0.attn.c_attn.weight", 2, 48, 16},
        {5, "transformer.h.0.attn.c_attn.bias", 1, 48, 0},
        {6, "transformer.h.0.attn.c_proj.weight", 2, 16, 16},
        {8, "transformer.h.0.ln_2.weight", 1, 16, 0},
        {10, "transformer.h.0.mlp.c_fc.weight", 2, 64, 16},
        {12, "transformer.h.0.mlp.c_proj.weight", 2, 16, 64},
        {13, "transformer.h.0.mlp.c_proj.bias", 1, 16, 0},
        {14, "transformer.h.1.ln_1.weight", 1, 16, 0},
        {38, "transformer.ln_f.weight", 1, 16, 0},
        {39, "transformer.ln_f.bias", 1, 16, 0},
    };
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, want[k].i);
        cr_assert_str_eq(t->name, want[k].name);
        cr_assert_eq(t->ndim, want[k].ndim, "%s", t->name);
        cr_assert_eq(t->shape[0], want[k].s0, "%s", t->name);
        if (t->ndim == 2) cr_assert_eq(t->shape[1], want[k].s1, "%s", t->name);
        cr_assert_eq(t->offset % TDM_MODEL_ALIGN_ELEMS, 0);
    }
    /* every group's parameters are contiguous and groups are in order */
    int next = 0;
    for (int l = 0; l < tdm_model_n_layers(m); l++) {
        int f, la;
        tdm_model_layer_params(m, l, &f, &la);
        if (la < f) continue;
        cr_assert_eq(f, next);
        next = la + 1;
    }
    cr_assert_eq(next, tdm_model_n_params(m));
    /* GPT-2's initialisation: LayerNorm 1 and 0, c_proj narrower */
    const float *p = tdm_model_params(m);
    const tdm_tensor_info *ln = tdm_model_param_info(m, 2), *lb = tdm_model_param_info(m, 3);
    for (int j = 0; j < 16; j++) {
        cr_assert_eq(p[ln->offset + j], 1.0f);
        cr_assert_eq(p[lb->offset + j], 0.0f);
    }
    double s2[2] = {0, 0};
    const tdm_tensor_info *fc = tdm_model_param_info(m, 10), *pr = tdm_model_param_info(m, 12);
    for (int64_t j = 0; j < fc->n_elem; j++) s2[0] += (double)p[fc->offset + j] * p[fc->offset + j];
    for (int64_t j = 0; j < pr->n_elem; j++) s2[1] += (double)p[pr->offset + j] * p[pr->offset + j];
    double sd_fc = sqrt(s2[0] / fc->n_elem), sd_pr = sqrt(s2[1] / pr->n_elem);
    cr_assert(fabs(sd_fc - 0.02) < 0.003, "c_fc std %g", sd_fc);
    cr_assert(fabs(sd_pr - 0.02 / sqrt(6.0)) < 0.0015, "c_proj std %g", sd_pr);
    char desc[64];
    tdm_model_spec_describe(tdm_model_get_spec(m), desc, sizeof desc);
    cr_assert_str_eq(desc, "gpt:3-16-4-9");
    tdm_model_spec back;
    TU_OK(tdm_model_spec_parse(&back, desc));
    cr_assert_eq(back.n_layer, 3);
    cr_assert_eq(back.n_ctx, 9);
    tdm_model_free(m);
    tdm_device_free(d);
}

/* ---- the grad-ready hook ---- */

typedef struct hook_rec {
    int calls;
    int first[256], last[256];
    int seen[512];
    float *copy;          /* each parameter's gradient when announced */
} hook_rec;

static void record_hook(void *ctx, tdm_model *m, int first, int last)
{
    hook_rec *h = ctx;
    h->first[h->calls] = first;
    h->last[h->calls] = last;
    h->calls++;
    for (int p = first; p <= last; p++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, p);
        h->seen[p]++;
        memcpy(h->copy + t->offset, tdm_model_grads(m) + t->offset, (size_t)t->n_elem * 4);
    }
}

Test(gpt, hook_announces_each_parameter_once_end_to_start_with_its_final_gradient)
{
    tdm_device *d = tu_host();
    tdm_model *m = make_gpt(d, 2, 8, 2, 5, 1);
    randomize(m, 21);
    int B = 3, T = 5;
    int32_t tok[15], tgt[15];
    make_batch(B, T, 22, tok, tgt);
    hook_rec h = {.copy = tu_malloc((size_t)tdm_model_param_elems(m) * 4)};
    tdm_model_set_grad_hook(m, record_hook, &h);
    TU_OK(tdm_model_zero_grad(m));
    double loss;
    TU_OK(tdm_model_forward_backward(m, tok, tgt, B, &loss));
    int np = tdm_model_n_params(m);
    /* ln_f, then 6 groups per block, then the embeddings */
    cr_assert_eq(h.calls, 1 + 6 * 2 + 1);
    int expect_last = np - 1;
    for (int c = 0; c < h.calls; c++) {
        cr_assert_eq(h.last[c], expect_last, "call %d announced %d..%d", c, h.first[c], h.last[c]);
        expect_last = h.first[c] - 1;
    }
    cr_assert_eq(expect_last, -1);
    cr_assert_eq(h.first[h.calls - 1], 0, "the tied embedding comes last");
    for (int p = 0; p < np; p++) cr_assert_eq(h.seen[p], 1, "parameter %d announced %d times", p, h.seen[p]);
    /* what a bucket would have sent is what backward ended with, bitwise */
    cr_assert(!memcmp(h.copy, tdm_model_grads(m), (size_t)tdm_model_param_elems(m) * 4),
              "a parameter's gradient changed after it was announced");
    /* the head's share of wte is real: the embedding's alone differs */
    tdm_model_set_grad_hook(m, NULL, NULL);
    free(h.copy);
    tdm_model_free(m);
    tdm_device_free(d);
}

Test(gpt, backward_adds_and_can_run_twice)
{
    tdm_device *d = tu_host();
    tdm_model *m = make_gpt(d, 1, 8, 2, 4, 1);
    randomize(m, 31);
    int32_t tok[8], tgt[8];
    make_batch(2, 4, 32, tok, tgt);
    int64_t pe = tdm_model_param_elems(m);
    const float *logits;
    TU_OK(tdm_model_zero_grad(m));
    TU_OK(tdm_model_forward(m, tok, 2, &logits));
    double ls;
    TU_OK(tdm_model_loss(m, logits, tgt, 2, 0.5f, &ls, tdm_model_loss_grad(m)));
    TU_OK(tdm_model_backward(m, tdm_model_loss_grad(m)));
    float *g1 = tu_malloc((size_t)pe * 4);
    memcpy(g1, tdm_model_grads(m), (size_t)pe * 4);
    TU_OK(tdm_model_backward(m, tdm_model_loss_grad(m)));
    int64_t at = 0;
    float *g2 = tdm_model_grads(m);
    for (int64_t i = 0; i < pe; i++) g1[i] *= 2.0f;
    cr_assert(tu_tol_ratio(g2, g1, pe, 1e-7, 1e-5, &at, NULL) <= 1.0, "grad[%lld] %g vs %g",
              (long long)at, g2[at], g1[at]);
    free(g1);
    tdm_model_free(m);
    tdm_device_free(d);
}

Test(gpt, shorter_forward_is_the_prefix_of_the_full_one)
{
    tdm_device *d = tu_host();
    tdm_model *m = make_gpt(d, 2, 12, 3, 7, 1);
    randomize(m, 41);
    int32_t tok[14], tgt[14], first[6];
    make_batch(2, 7, 42, tok, tgt);
    const float *full, *part;
    TU_OK(tdm_model_forward(m, tok, 2, &full));
    float *keep = tu_malloc((size_t)14 * 256 * 4);
    memcpy(keep, full, (size_t)14 * 256 * 4);
    for (int s = 1; s <= 7; s++) {
        /* window 1's first s tokens */
        for (int t = 0; t < s && t < 6; t++) first[t] = tok[7 + t];
        int32_t buf[7];
        memcpy(buf, tok + 7, (size_t)s * 4);
        TU_OK(tdm_gpt_forward_seq(m, buf, 1, s, &part));
        for (int t = 0; t < s; t++)
            for (int v = 0; v < 256; v++)
                cr_assert(tu_close(part[t * 256 + v], keep[(7 + t) * 256 + v], 1e-5, 1e-5),
                          "seq %d position %d logit %d: %g vs %g", s, t, v, part[t * 256 + v],
                          keep[(7 + t) * 256 + v]);
    }
    (void)first;
    /* a forward over part of the context is not for backward */
    cr_assert_eq(tdm_model_backward(m, tdm_model_loss_grad(m)), TDM_STATUS_INVALID_ARG);
    free(keep);
    tdm_model_free(m);
    tdm_device_free(d);
}

typedef struct emit_buf {
    int n;
    int32_t tok[64];
} emit_buf;

static void emit_tok(void *ctx, int32_t t)
{
    emit_buf *e = ctx;
    e->tok[e->n++] = t;
}

Test(gpt, generation_is_seeded_greedy_at_zero_and_slides_past_the_context)
{
    tdm_device *d = tu_host();
    tdm_model *m = make_gpt(d, 1, 8, 2, 6, 1);
    randomize(m, 51);
    int32_t prompt[9] = {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r'}, a[20], b[20], c[20];
    emit_buf e = {0};
    TU_OK(tdm_gpt_generate(m, prompt, 9, 20, 1.0f, 7, a, emit_tok, &e));
    TU_OK(tdm_gpt_generate(m, prompt, 9, 20, 1.0f, 7, b, NULL, NULL));
    TU_OK(tdm_gpt_generate(m, prompt, 9, 20, 1.0f, 8, c, NULL, NULL));
    cr_assert_eq(e.n, 20);
    cr_assert(!memcmp(a, e.tok, sizeof a));
    cr_assert(!memcmp(a, b, sizeof a), "the same seed must give the same text");
    cr_assert(memcmp(a, c, sizeof a), "another seed should give other text");
    for (int i = 0; i < 20; i++) cr_assert(a[i] >= 0 && a[i] < 256);
    cr_assert(tdm_model_is_train(m), "generation restores the training mode");
    /* temperature 0: every token is the argmax given the last 6 */
    TU_OK(tdm_gpt_generate(m, prompt, 9, 5, 0.0f, 1, a, NULL, NULL));
    int32_t seq[14];
    memcpy(seq, prompt, sizeof prompt);
    memcpy(seq + 9, a, 5 * 4);
    for (int n = 9; n < 14; n++) {
        const float *lg;
        TU_OK(tdm_gpt_forward_seq(m, seq + n - 6, 1, 6, &lg));
        int best = 0;
        for (int v = 1; v < 256; v++)
            if (lg[5 * 256 + v] > lg[5 * 256 + best]) best = v;
        cr_assert_eq(a[n - 9], best, "greedy token %d", n - 9);
    }
    cr_assert_eq(tdm_gpt_generate(m, prompt, 0, 5, 1.0f, 1, a, NULL, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_gpt_generate(m, prompt, 3, 5, -1.0f, 1, a, NULL, NULL), TDM_STATUS_INVALID_ARG);
    tdm_model_free(m);
    tdm_device_free(d);
}

/* ---- bad input ---- */

Test(gpt, bad_specs_and_tokens_are_refused_with_clear_messages)
{
    tdm_model_spec s;
    cr_assert_eq(tdm_model_spec_parse(&s, "gpt:4-30-4-64"), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "4 heads do not divide the width 30"), "%s",
              tdm_error_message());
    cr_assert_eq(tdm_model_spec_parse(&s, "gpt:4-32-4"), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "L-D-H-T"), "%s", tdm_error_message());
    cr_assert_eq(tdm_model_spec_parse(&s, "gpt:0-32-4-8"), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "blocks L"), "%s", tdm_error_message());
    cr_assert_eq(tdm_model_spec_parse(&s, "gpt:2-32-4-8x"), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_model_spec_parse(&s, "gptx"), TDM_STATUS_INVALID_ARG);
    TU_OK(tdm_model_spec_parse(&s, "gpt"));
    cr_assert_eq(s.kind, TDM_MODEL_GPT);
    cr_assert_eq(s.n_layer, TDM_GPT_DEFAULT_LAYERS);
    TU_OK(tdm_model_spec_parse(&s, "gpt:2-24-3-17"));
    cr_assert_eq(s.n_embd, 24);
    cr_assert_eq(s.n_head, 3);

    tdm_device *d = tu_host();
    tdm_model *m = NULL;
    tdm_model_spec_gpt(&s, 2, 10, 4, 8);
    cr_assert_eq(tdm_model_init(&m, d, &s, 1), TDM_STATUS_INVALID_ARG);
    cr_assert_null(m);
    cr_assert(strstr(tdm_error_message(), "4 heads do not divide the width 10"), "%s",
              tdm_error_message());

    m = make_gpt(d, 1, 8, 2, 4, 1);
    int32_t tok[4] = {1, 2, 256, 3};
    const float *lg;
    cr_assert_eq(tdm_model_forward(m, tok, 1, &lg), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "token 256 at position 2"), "%s", tdm_error_message());
    tok[2] = -1;
    cr_assert_eq(tdm_model_forward(m, tok, 1, &lg), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_model_backward(m, tdm_model_loss_grad(m)), TDM_STATUS_INVALID_ARG,
                 "no backward after a failed forward");
    int32_t five[5] = {0};
    cr_assert_eq(tdm_gpt_forward_seq(m, five, 1, 5, &lg), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "context holds 1..4"), "%s", tdm_error_message());
    tdm_model_free(m);
    tdm_device_free(d);
}
