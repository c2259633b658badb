/* models/gpt.c: the GPT (see models/gpt.h): its spec, parameter table,
 * activations, forward and backward over the layers of
 * models/layers_gpt.c, and generation. It plugs into models/model.c
 * through tdm_model_vt: the flat buffers, tables, gradient storage and
 * hook stay model.c's. Not here: the kernels (core/kernels.h), the loss
 * (models/loss.c), text data (core/text.h), any parallelism. */
#include "models/gpt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "models/layers_gpt.h"
#include "models/model_impl.h"

#define TDM_GPT_LN_EPS 1e-5f
/* parameters per block, and their order inside it */
#define TDM_GPT_PER_BLOCK 12
enum {
    TDM_GPT_LN1_W = 0, TDM_GPT_LN1_B, TDM_GPT_ATTN_W, TDM_GPT_ATTN_B, TDM_GPT_APROJ_W,
    TDM_GPT_APROJ_B, TDM_GPT_LN2_W, TDM_GPT_LN2_B, TDM_GPT_FC_W, TDM_GPT_FC_B,
    TDM_GPT_MPROJ_W, TDM_GPT_MPROJ_B,
};
#define TDM_GPT_WTE 0
#define TDM_GPT_WPE 1

/* What one block keeps for backward (room for cap windows of T). */
typedef struct tdm_gpt_block {
    float *ln1, *ln1_mean, *ln1_rstd;   /* ln_1 output (N, C) and its statistics */
    float *q, *k, *v, *att;             /* attention's (B, H, T, hd) and (B, H, T, T) */
    float *atty;                        /* heads merged (N, C): attn.c_proj's input */
    float *res1;                        /* stream after attention (N, C) */
    float *ln2, *ln2_mean, *ln2_rstd;
    float *fch, *fcg;                   /* mlp.c_fc output, and its gelu (N, 4C) */
    float *res2;                        /* block output (N, C) */
} tdm_gpt_block;

typedef struct tdm_gpt {
    int L, C, H, T, V;
    int seq;                 /* positions of the last forward */
    const int32_t *tok;      /* borrowed: the last forward's tokens (device) */
    int32_t *tok_host;       /* host copy for the range check (non-host devices) */
    float *res0;             /* embeddings (N, C) */
    tdm_gpt_block *blk;      /* L */
    float *lnf, *lnf_mean, *lnf_rstd, *logits;
    /* scratch shared by the blocks */
    float *qkv;              /* forward: c_attn output (N, 3C); backward: its gradient */
    float *yh;               /* forward: heads' outputs; backward: their gradient (N*C) */
    float *dres, *dln;       /* (N, C): the stream's gradient; a LayerNorm output's */
    float *dfc;              /* (N, 4C) */
    float *datt;             /* (B, H, T, T) */
    float *dq, *dk, *dv;     /* (B, H, T, hd) */
    float *ones;             /* N ones: bias gradients as gemms */
} tdm_gpt;

/* ---- spec ---- */

void tdm_model_spec_gpt(tdm_model_spec *s, int n_layer, int n_embd, int n_head, int n_ctx)
{
    memset(s, 0, sizeof *s);
    s->kind = TDM_MODEL_GPT;
    s->n_layer = n_layer;
    s->n_embd = n_embd;
    s->n_head = n_head;
    s->n_ctx = n_ctx;
    s->vocab = TDM_GPT_VOCAB;
    s->n_classes = TDM_GPT_VOCAB;
    s->in_c = 1;   /* a window of n_ctx tokens (tdm_model_spec_sample_shape) */
    s->in_h = 1;
    s->in_w = n_ctx;
}

tdm_status tdm_gpt_spec_parse(tdm_model_spec *s, const char *text)
{
    static const char *const what[4] = {"blocks L", "width D", "heads H", "context T"};
    static const int maxv[4] = {TDM_GPT_MAX_LAYERS, 1 << 16, 1 << 12, 1 << 16};
    int v[4] = {TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH, TDM_GPT_DEFAULT_HEADS,
                TDM_GPT_DEFAULT_CONTEXT};
    if (strcmp(text, "gpt") != 0) {
        TDM_REQUIRE(!strncmp(text, "gpt:", 4) && text[4], TDM_STATUS_INVALID_ARG,
                    "model '%s': expected gpt or gpt:L-D-H-T (blocks, width, heads, context), "
                    "e.g. gpt:%d-%d-%d-%d", text, v[0], v[1], v[2], v[3]);
        const char *p = text + 4;
        for (int i = 0; i < 4; i++) {
            char *end;
            long x = strtol(p, &end, 10);
            if (end == p || x < 1 || x > maxv[i])
                return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                     "model '%s': %s must be an integer in [1, %d] "
                                     "(gpt:L-D-H-T, e.g. gpt:%d-%d-%d-%d)", text, what[i],
                                     maxv[i], TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH,
                                     TDM_GPT_DEFAULT_HEADS, TDM_GPT_DEFAULT_CONTEXT);
            v[i] = (int)x;
            p = end;
            if (i < 3) {
                TDM_REQUIRE(*p == '-', TDM_STATUS_INVALID_ARG,
                            "model '%s': expected four numbers L-D-H-T separated by '-'", text);
                p++;
            }
        }
        TDM_REQUIRE(*p == '\0', TDM_STATUS_INVALID_ARG,
                    "model '%s': unexpected '%s' after L-D-H-T", text, p);
    }
    TDM_REQUIRE(v[1] % v[2] == 0, TDM_STATUS_INVALID_ARG,
                "model '%s': %d heads do not divide the width %d (each head gets width/heads "
                "features: pick a width that is a multiple of the heads)", text, v[2], v[1]);
    tdm_model_spec_gpt(s, v[0], v[1], v[2], v[3]);
    return TDM_STATUS_OK;
}

void tdm_gpt_spec_describe(const tdm_model_spec *s, char *buf, size_t len)
{
    snprintf(buf, len, "gpt:%d-%d-%d-%d", s->n_layer, s->n_embd, s->n_head, s->n_ctx);
}

/* ---- parameters ---- */

static int tdm_gpt_p(int l, int j) { return 2 + TDM_GPT_PER_BLOCK * l + j; }
static int tdm_gpt_p_lnf(int L) { return 2 + TDM_GPT_PER_BLOCK * L; }

static float *tdm_gpt_param(tdm_model *m, int i) { return tdm_model_pdata(m, i); }
static float *tdm_gpt_grad(tdm_model *m, int i) { return tdm_model_gdata(m, i); }

static void tdm_gpt_init_params(tdm_model *m, uint64_t seed, float *hp)
{
    int L = m->spec.n_layer;
    for (int i = 0; i < m->n_params; i++) {
        const tdm_tensor_info *t = &m->params_info[i];
        float *p = hp + t->offset;
        int is_ln = strstr(t->name, ".ln_") != NULL;
        int is_bias = strstr(t->name, ".bias") != NULL;
        if (is_ln && !is_bias) {
            for (int64_t j = 0; j < t->n_elem; j++) p[j] = 1.0f;
            continue;
        }
        if (is_bias) continue;   /* zero */
        /* GPT-2: N(0, 0.02); the projections that write into the residual
         * stream scaled by 1/sqrt(2L), one per residual add */
        float std = 0.02f;
        if (strstr(t->name, ".c_proj.weight")) std = 0.02f / sqrtf(2.0f * (float)L);
        tdm_rng r;
        tdm_rng_init(&r, seed, TDM_RNG_STREAM_INIT + (uint64_t)i);
        for (int64_t j = 0; j < t->n_elem; j++) p[j] = std * tdm_rng_normal(&r);
    }
}

/* One logical layer per group of parameters that backward finishes at once. */
static tdm_status tdm_gpt_group(tdm_model *m, int ntensors, const char *const *names,
                                const int64_t (*shapes)[2], const int *ndims)
{
    int li = m->n_layers;
    tdm_layer *l = tdm_model_add_layer(m, TDM_LAYER_GROUP);
    for (int i = 0; i < ntensors; i++)
        TDM_CHECK(tdm_model_add_tensor(m, 0, li, names[i], ndims[i], shapes[i]));
    l->np = ntensors;
    return TDM_STATUS_OK;
}

static tdm_status tdm_gpt_linear_group(tdm_model *m, const char *prefix, int out, int in)
{
    char w[TDM_MODEL_NAME_MAX], b[TDM_MODEL_NAME_MAX];
    snprintf(w, sizeof w, "%s.weight", prefix);
    snprintf(b, sizeof b, "%s.bias", prefix);
    const char *names[2] = {w, b};
    const int64_t shapes[2][2] = {{out, in}, {out, 0}};
    const int nd[2] = {2, 1};
    return tdm_gpt_group(m, 2, names, shapes, nd);
}

static tdm_status tdm_gpt_ln_group(tdm_model *m, const char *prefix, int C)
{
    char w[TDM_MODEL_NAME_MAX], b[TDM_MODEL_NAME_MAX];
    snprintf(w, sizeof w, "%s.weight", prefix);
    snprintf(b, sizeof b, "%s.bias", prefix);
    const char *names[2] = {w, b};
    const int64_t shapes[2][2] = {{C, 0}, {C, 0}};
    const int nd[2] = {1, 1};
    return tdm_gpt_group(m, 2, names, shapes, nd);
}

/* ---- activations ---- */

static void tdm_gpt_free_activations(tdm_model *m)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    if (!g) return;
    float **all[] = {&g->res0, &g->lnf, &g->lnf_mean, &g->lnf_rstd, &g->logits, &g->qkv,
                     &g->yh, &g->dres, &g->dln, &g->dfc, &g->datt, &g->dq, &g->dk, &g->dv,
                     &g->ones, &m->dlogits};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        tdm_dev_free(d, *all[i]);
        *all[i] = NULL;
    }
    for (int l = 0; g->blk && l < g->L; l++) {
        tdm_gpt_block *b = &g->blk[l];
        float **ba[] = {&b->ln1, &b->ln1_mean, &b->ln1_rstd, &b->q, &b->k, &b->v, &b->att,
                        &b->atty, &b->res1, &b->ln2, &b->ln2_mean, &b->ln2_rstd, &b->fch,
                        &b->fcg, &b->res2};
        for (size_t i = 0; i < sizeof ba / sizeof ba[0]; i++) {
            tdm_dev_free(d, *ba[i]);
            *ba[i] = NULL;
        }
    }
    free(g->tok_host);
    g->tok_host = NULL;
    m->cap = 0;
    m->act_bytes = 0;
}

static void tdm_gpt_free_ext(tdm_model *m)
{
    tdm_gpt *g = m->ext;
    if (!g) return;
    tdm_gpt_free_activations(m);
    free(g->blk);
    free(g);
    m->ext = NULL;
}

static tdm_status tdm_gpt_alloc(tdm_model *m, float **p, int64_t n_elem)
{
    size_t nb = (size_t)n_elem * sizeof(float);
    TDM_CHECK(tdm_dev_alloc(m->dev, nb, (void **)p));
    m->act_bytes += nb;
    return TDM_STATUS_OK;
}

size_t tdm_gpt_act_bytes(const tdm_model *m, int batch)
{
    const tdm_gpt *g = m->ext;
    /* tdm_gpt_reserve's buffers, counted in floats: per block ln1, q, k,
     * v, atty, res1, ln2, res2 (N x C each), fch and fcg (N x 4C), four
     * means and rstds (N) and the attention (B x H x T x T); then res0,
     * lnf, yh, dres, dln (N x C), qkv and dq/dk/dv (N x 3C each), dfc
     * (N x 4C), lnf's mean and rstd and the ones (N), the logits and
     * their gradient (N x V) and the attention's gradient */
    int64_t N = (int64_t)batch * g->T, C = g->C, att = (int64_t)batch * g->H * g->T * g->T;
    int64_t per_block = 16 * N * C + 4 * N + att;
    int64_t floats = g->L * per_block + 15 * N * C + 3 * N + 2 * N * g->V + att;
    return (size_t)floats * sizeof(float);
}

/* Room for `batch` windows of the full context. */
static tdm_status tdm_gpt_reserve(tdm_model *m, int batch)
{
    if (batch <= m->cap) return TDM_STATUS_OK;
    tdm_gpt *g = m->ext;
    tdm_status st = TDM_STATUS_OK;
    tdm_gpt_free_activations(m);
    int64_t N = (int64_t)batch * g->T, C = g->C, att = (int64_t)batch * g->H * g->T * g->T;
    TDM_REQUIRE(N * 4 * C <= INT32_MAX && N * g->V <= INT32_MAX, TDM_STATUS_INVALID_ARG,
                "gpt: a batch of %d windows of %d is too large for one gemm (at most %lld "
                "windows)", batch, g->T, (long long)(INT32_MAX / (4 * C * g->T)));
    TDM_TRY(tdm_gpt_alloc(m, &g->res0, N * C));
    for (int l = 0; l < g->L; l++) {
        tdm_gpt_block *b = &g->blk[l];
        TDM_TRY(tdm_gpt_alloc(m, &b->ln1, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->ln1_mean, N));
        TDM_TRY(tdm_gpt_alloc(m, &b->ln1_rstd, N));
        TDM_TRY(tdm_gpt_alloc(m, &b->q, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->k, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->v, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->att, att));
        TDM_TRY(tdm_gpt_alloc(m, &b->atty, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->res1, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->ln2, N * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->ln2_mean, N));
        TDM_TRY(tdm_gpt_alloc(m, &b->ln2_rstd, N));
        TDM_TRY(tdm_gpt_alloc(m, &b->fch, N * 4 * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->fcg, N * 4 * C));
        TDM_TRY(tdm_gpt_alloc(m, &b->res2, N * C));
    }
    TDM_TRY(tdm_gpt_alloc(m, &g->lnf, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->lnf_mean, N));
    TDM_TRY(tdm_gpt_alloc(m, &g->lnf_rstd, N));
    TDM_TRY(tdm_gpt_alloc(m, &g->logits, N * g->V));
    TDM_TRY(tdm_gpt_alloc(m, &m->dlogits, N * g->V));
    TDM_TRY(tdm_gpt_alloc(m, &g->qkv, N * 3 * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->yh, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->dres, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->dln, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->dfc, N * 4 * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->datt, att));
    TDM_TRY(tdm_gpt_alloc(m, &g->dq, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->dk, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->dv, N * C));
    TDM_TRY(tdm_gpt_alloc(m, &g->ones, N));
    {
        float *h = malloc((size_t)N * sizeof(float));
        if (!h) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: cannot allocate %lld floats",
                               (long long)N);
            goto fail;
        }
        for (int64_t i = 0; i < N; i++) h[i] = 1.0f;
        st = tdm_dev_copy_from_host(m->dev, g->ones, h, (size_t)N * sizeof(float));
        free(h);
        TDM_TRY(st);
    }
    if (tdm_dev_kind(m->dev) != TDM_DEVICE_HOST) {
        g->tok_host = malloc((size_t)N * sizeof(int32_t));
        if (!g->tok_host) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: cannot allocate %lld tokens",
                               (long long)N);
            goto fail;
        }
    }
    m->cap = batch;
    return TDM_STATUS_OK;
fail:
    tdm_gpt_free_activations(m);
    return tdm_error_prefix(st, "gpt: activations for %d windows of %d", batch, g->T);
}

/* ---- forward ---- */

/* Every token must index the embedding: read them where the host can
 * (a copy off an accelerator), since a kernel cannot say which was bad. */
static tdm_status tdm_gpt_check_tokens(tdm_model *m, const int32_t *tok, int64_t n)
{
    tdm_gpt *g = m->ext;
    const int32_t *h = tok;
    if (tdm_dev_kind(m->dev) != TDM_DEVICE_HOST) {
        TDM_CHECK(tdm_dev_copy_to_host(m->dev, g->tok_host, tok, (size_t)n * sizeof(int32_t)));
        h = g->tok_host;
    }
    for (int64_t i = 0; i < n; i++)
        if (h[i] < 0 || h[i] >= g->V)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "gpt: token %d at position %lld of window %lld is outside the "
                                 "vocabulary [0, %d)", (int)h[i], (long long)(i % g->seq),
                                 (long long)(i / g->seq), g->V);
    return TDM_STATUS_OK;
}

static tdm_status tdm_gpt_run_forward(tdm_model *m, const int32_t *tok, int B, int Tr,
                                      const float **logits)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    int C = g->C, L = g->L;
    int64_t N = (int64_t)B * Tr;
    size_t row_bytes = (size_t)N * C * sizeof(float);
    TDM_CHECK(tdm_gpt_reserve(m, B));
    g->seq = Tr;
    TDM_CHECK(tdm_gpt_check_tokens(m, tok, N));
    /* parameter-use events name whole blocks: a block is the unit
     * parameters are grouped by (tdm_model_layer_block) */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, TDM_GPT_WTE, TDM_GPT_WPE));
    TDM_CHECK(tdm_dev_embed_fwd(d, tok, tdm_gpt_param(m, TDM_GPT_WTE), tdm_gpt_param(m, TDM_GPT_WPE),
                           g->res0, B, Tr, C));
    const float *res = g->res0;
    for (int l = 0; l < L; l++) {
        tdm_gpt_block *b = &g->blk[l];
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, tdm_gpt_p(l, 0),
                                tdm_gpt_p(l, TDM_GPT_PER_BLOCK - 1)));
#define P(j) tdm_gpt_param(m, tdm_gpt_p(l, (j)))
        TDM_CHECK(tdm_dev_layernorm_fwd(d, res, P(TDM_GPT_LN1_W), P(TDM_GPT_LN1_B), b->ln1,
                                        b->ln1_mean, b->ln1_rstd, N, C, TDM_GPT_LN_EPS));
        TDM_CHECK(tdm_layers_linear_fwd(d, b->ln1, P(TDM_GPT_ATTN_W), P(TDM_GPT_ATTN_B), N, C,
                                        3 * C, 0, g->qkv));
        tdm_layers_attn a = {.B = B, .T = Tr, .H = g->H, .C = C, .q = b->q, .k = b->k,
                             .v = b->v, .att = b->att};
        TDM_CHECK(tdm_layers_attention_fwd(d, &a, g->qkv, g->yh, b->atty));
        /* x + attn(ln_1(x)): the projection adds onto a copy of the stream */
        TDM_CHECK(tdm_dev_copy(d, b->res1, res, row_bytes));
        TDM_CHECK(tdm_layers_linear_fwd(d, b->atty, P(TDM_GPT_APROJ_W), P(TDM_GPT_APROJ_B), N,
                                        C, C, 1, b->res1));
        TDM_CHECK(tdm_dev_layernorm_fwd(d, b->res1, P(TDM_GPT_LN2_W), P(TDM_GPT_LN2_B), b->ln2,
                                        b->ln2_mean, b->ln2_rstd, N, C, TDM_GPT_LN_EPS));
        TDM_CHECK(tdm_layers_linear_fwd(d, b->ln2, P(TDM_GPT_FC_W), P(TDM_GPT_FC_B), N, C,
                                        4 * C, 0, b->fch));
        TDM_CHECK(tdm_dev_gelu_fwd(d, b->fch, b->fcg, N * 4 * C));
        TDM_CHECK(tdm_dev_copy(d, b->res2, b->res1, row_bytes));
        TDM_CHECK(tdm_layers_linear_fwd(d, b->fcg, P(TDM_GPT_MPROJ_W), P(TDM_GPT_MPROJ_B), N,
                                        4 * C, C, 1, b->res2));
#undef P
        res = b->res2;
    }
    int pf = tdm_gpt_p_lnf(L);
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, pf, pf + 1));
    TDM_CHECK(tdm_dev_layernorm_fwd(d, res, tdm_gpt_param(m, pf), tdm_gpt_param(m, pf + 1), g->lnf,
                               g->lnf_mean, g->lnf_rstd, N, C, TDM_GPT_LN_EPS));
    /* the head tied to the token embedding: logits = ln_f(x) wte^T */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, TDM_GPT_WTE, TDM_GPT_WTE));
    TDM_CHECK(tdm_layers_linear_fwd(d, g->lnf, tdm_gpt_param(m, TDM_GPT_WTE), NULL, N, C, g->V,
                                    0, g->logits));
    g->tok = tok;
    if (logits) *logits = g->logits;
    return TDM_STATUS_OK;
}

static tdm_status tdm_gpt_forward(tdm_model *m, const void *x, int batch, const float **logits)
{
    tdm_gpt *g = m->ext;
    TDM_CHECK(tdm_gpt_run_forward(m, x, batch, g->T, logits));
    m->batch = batch;
    return TDM_STATUS_OK;
}

tdm_status tdm_gpt_forward_seq(tdm_model *m, const int32_t *tokens, int batch, int seq_len,
                               const float **logits)
{
    TDM_REQUIRE(m && m->spec.kind == TDM_MODEL_GPT, TDM_STATUS_INVALID_ARG,
                "gpt forward: not a GPT model");
    tdm_gpt *g = m->ext;
    TDM_REQUIRE(batch > 0 && tokens, TDM_STATUS_INVALID_ARG,
                "gpt forward: batch %d must be positive and tokens non-NULL", batch);
    TDM_REQUIRE(seq_len >= 1 && seq_len <= g->T, TDM_STATUS_INVALID_ARG,
                "gpt forward: %d positions, but the context holds 1..%d", seq_len, g->T);
    m->batch = 0;   /* not for backward (see gpt.h) */
    return tdm_gpt_run_forward(m, tokens, batch, seq_len, logits);
}

static const float *tdm_gpt_last_logits(const tdm_model *m)
{
    return ((const tdm_gpt *)m->ext)->logits;
}

/* ---- backward ---- */

static void tdm_gpt_hook(tdm_model *m, int layer)
{
    const tdm_layer *l = &m->layers[layer];
    if (m->hook && l->np > 0) m->hook(m->hook_ctx, m, l->p0, l->p0 + l->np - 1);
}

/* Logical layers: 0 embeddings; block l's six at 1 + 6l + (ln_1, c_attn,
 * attn.c_proj, ln_2, c_fc, mlp.c_proj); ln_f at 1 + 6L; the head last. */
static int tdm_gpt_layer(int l, int j) { return 1 + 6 * l + j; }

static tdm_status tdm_gpt_backward(tdm_model *m, const float *dlogits)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    int B = m->batch, Tr = g->seq, C = g->C, L = g->L;
    int64_t N = (int64_t)B * Tr;
    TDM_CHECK(tdm_dev_memset_zero(d, g->dres, (size_t)N * C * sizeof(float)));
    /* the head: dwte += dlogits^T ln_f(x) (the first of its two shares),
     * d ln_f(x) = dlogits wte; no hook: wte is not final yet */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, TDM_GPT_WTE, TDM_GPT_WTE));
    TDM_CHECK(tdm_layers_linear_bwd(d, g->lnf, tdm_gpt_param(m, TDM_GPT_WTE), dlogits, g->ones,
                                    N, C, g->V, tdm_gpt_grad(m, TDM_GPT_WTE), NULL, g->dln, 0));
    int pf = tdm_gpt_p_lnf(L);
    const float *res_last = L > 0 ? g->blk[L - 1].res2 : g->res0;
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, pf, pf + 1));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, res_last, g->dln, tdm_gpt_param(m, pf), g->lnf_mean,
                               g->lnf_rstd, g->dres, tdm_gpt_grad(m, pf),
                               tdm_gpt_grad(m, pf + 1), N, C));
    tdm_gpt_hook(m, 1 + 6 * L);
    for (int l = L - 1; l >= 0; l--) {
        tdm_gpt_block *b = &g->blk[l];
        const float *res_in = l > 0 ? g->blk[l - 1].res2 : g->res0;
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, tdm_gpt_p(l, 0),
                                tdm_gpt_p(l, TDM_GPT_PER_BLOCK - 1)));
#define P(j) tdm_gpt_param(m, tdm_gpt_p(l, (j)))
#define G(j) tdm_gpt_grad(m, tdm_gpt_p(l, (j)))
        /* x += mlp(ln_2(x)): the branch's output gradient is dres itself */
        TDM_CHECK(tdm_layers_linear_bwd(d, b->fcg, P(TDM_GPT_MPROJ_W), g->dres, g->ones, N,
                                        4 * C, C, G(TDM_GPT_MPROJ_W), G(TDM_GPT_MPROJ_B), g->dfc,
                                        0));
        tdm_gpt_hook(m, tdm_gpt_layer(l, 5));
        TDM_CHECK(tdm_dev_gelu_bwd(d, b->fch, g->dfc, g->dfc, N * 4 * C));
        TDM_CHECK(tdm_layers_linear_bwd(d, b->ln2, P(TDM_GPT_FC_W), g->dfc, g->ones, N, C, 4 * C,
                                        G(TDM_GPT_FC_W), G(TDM_GPT_FC_B), g->dln, 0));
        tdm_gpt_hook(m, tdm_gpt_layer(l, 4));
        TDM_CHECK(tdm_dev_layernorm_bwd(d, b->res1, g->dln, P(TDM_GPT_LN2_W), b->ln2_mean,
                                        b->ln2_rstd, g->dres, G(TDM_GPT_LN2_W),
                                        G(TDM_GPT_LN2_B), N, C));
        tdm_gpt_hook(m, tdm_gpt_layer(l, 3));
        /* x += attn(ln_1(x)); dln holds the heads' output gradient until
         * c_attn's backward overwrites it */
        TDM_CHECK(tdm_layers_linear_bwd(d, b->atty, P(TDM_GPT_APROJ_W), g->dres, g->ones, N, C,
                                        C, G(TDM_GPT_APROJ_W), G(TDM_GPT_APROJ_B), g->dln, 0));
        tdm_gpt_hook(m, tdm_gpt_layer(l, 2));
        tdm_layers_attn a = {.B = B, .T = Tr, .H = g->H, .C = C, .q = b->q, .k = b->k,
                             .v = b->v, .att = b->att};
        TDM_CHECK(tdm_layers_attention_bwd(d, &a, g->dln, g->yh, g->datt, g->dq, g->dk, g->dv,
                                           g->qkv));
        TDM_CHECK(tdm_layers_linear_bwd(d, b->ln1, P(TDM_GPT_ATTN_W), g->qkv, g->ones, N, C,
                                        3 * C, G(TDM_GPT_ATTN_W), G(TDM_GPT_ATTN_B), g->dln, 0));
        tdm_gpt_hook(m, tdm_gpt_layer(l, 1));
        TDM_CHECK(tdm_dev_layernorm_bwd(d, res_in, g->dln, P(TDM_GPT_LN1_W), b->ln1_mean,
                                        b->ln1_rstd, g->dres, G(TDM_GPT_LN1_W),
                                        G(TDM_GPT_LN1_B), N, C));
        tdm_gpt_hook(m, tdm_gpt_layer(l, 0));
#undef P
#undef G
    }
    /* the embeddings: wte's second share; now wte and wpe are final. The
     * embedding's backward adds rows of dres into the gradients and
     * reads neither table. */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD_GRADS, TDM_GPT_WTE, TDM_GPT_WPE));
    TDM_CHECK(tdm_dev_embed_bwd(d, g->tok, g->dres, tdm_gpt_grad(m, TDM_GPT_WTE),
                           tdm_gpt_grad(m, TDM_GPT_WPE), B, Tr, C));
    tdm_gpt_hook(m, 0);
    return TDM_STATUS_OK;
}

static void tdm_gpt_gemm_flops(const tdm_model *m, double *fwd, double *bwd)
{
    const tdm_model_spec *s = &m->spec;
    double C = s->n_embd, T = s->n_ctx;
    /* per position: c_attn 3C^2, attn.c_proj C^2, c_fc 4C^2, mlp.c_proj 4C^2
     * multiply-adds, attention 2 T C (scores and values over the full T),
     * the head C V */
    double per_pos = s->n_layer * (12.0 * C * C + 2.0 * T * C) + C * s->vocab;
    *fwd = 2.0 * per_pos * T;
    /* every product has a weight (or second-operand) and an input gradient */
    *bwd = 2.0 * *fwd;
}

static const tdm_model_vt tdm_gpt_vt = {
    .init_params = tdm_gpt_init_params,
    .forward = tdm_gpt_forward,
    .backward = tdm_gpt_backward,
    .last_logits = tdm_gpt_last_logits,
    .gemm_flops = tdm_gpt_gemm_flops,
    .free_activations = tdm_gpt_free_activations,
    .free_ext = tdm_gpt_free_ext,
};

tdm_status tdm_gpt_build(tdm_model *m)
{
    const tdm_model_spec *s = &m->spec;
    int L = s->n_layer, C = s->n_embd, H = s->n_head, T = s->n_ctx;
    TDM_REQUIRE(L >= 1 && L <= TDM_GPT_MAX_LAYERS && C >= 1 && H >= 1 && T >= 1 &&
                    s->vocab == TDM_GPT_VOCAB,
                TDM_STATUS_INVALID_ARG,
                "gpt: %d blocks (1..%d), width %d, %d heads, context %d and vocabulary %d "
                "(256) are not a valid GPT", L, TDM_GPT_MAX_LAYERS, C, H, T, s->vocab);
    TDM_REQUIRE(C % H == 0, TDM_STATUS_INVALID_ARG,
                "gpt: %d heads do not divide the width %d (each head gets width/heads features)",
                H, C);
    TDM_REQUIRE(tdm_dev_has_transformer(m->dev), TDM_STATUS_UNSUPPORTED,
                "gpt: device %s has no transformer kernels", tdm_dev_name(m->dev));
    tdm_gpt *g = calloc(1, sizeof *g);
    TDM_REQUIRE(g, TDM_STATUS_OUT_OF_MEMORY, "gpt: out of memory");
    g->blk = calloc((size_t)L, sizeof *g->blk);
    if (!g->blk) {
        free(g);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: out of memory");
    }
    g->L = L;
    g->C = C;
    g->H = H;
    g->T = T;
    g->V = s->vocab;
    g->seq = T;
    m->ext = g;
    m->vt = &tdm_gpt_vt;
    {
        const char *names[2] = {"transformer.wte.weight", "transformer.wpe.weight"};
        const int64_t shapes[2][2] = {{s->vocab, C}, {T, C}};
        const int nd[2] = {2, 2};
        TDM_CHECK(tdm_gpt_group(m, 2, names, shapes, nd));
    }
    char name[TDM_MODEL_NAME_MAX];
    for (int l = 0; l < L; l++) {
#define NAME(sfx) (snprintf(name, sizeof name, "transformer.h.%d.%s", l, sfx), name)
        TDM_CHECK(tdm_gpt_ln_group(m, NAME("ln_1"), C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("attn.c_attn"), 3 * C, C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("attn.c_proj"), C, C));
        TDM_CHECK(tdm_gpt_ln_group(m, NAME("ln_2"), C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("mlp.c_fc"), 4 * C, C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("mlp.c_proj"), C, 4 * C));
#undef NAME
    }
    TDM_CHECK(tdm_gpt_ln_group(m, "transformer.ln_f", C));
    tdm_model_add_layer(m, TDM_LAYER_GROUP);   /* the head: reads wte, owns nothing */
    /* blocks: 0 the embeddings, 1 + l block l's six layers, L + 1 ln_f
     * and the head */
    for (int i = 0; i < m->n_layers; i++)
        m->layers[i].block = i == 0 ? 0 : i >= 1 + 6 * L ? L + 1 : 1 + (i - 1) / 6;
    return TDM_STATUS_OK;
}

/* ---- generation ---- */

tdm_status tdm_gpt_generate(tdm_model *m, const int32_t *prompt, int n_prompt, int n_new,
                            float temperature, uint64_t seed, int32_t *out,
                            void (*emit)(void *ctx, int32_t token), void *emit_ctx)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(m && m->spec.kind == TDM_MODEL_GPT, TDM_STATUS_INVALID_ARG,
                "generate: not a GPT model");
    TDM_REQUIRE(prompt && n_prompt >= 1 && n_new >= 0, TDM_STATUS_INVALID_ARG,
                "generate: the prompt needs at least one token (got %d) and n_new >= 0 (%d)",
                n_prompt, n_new);
    TDM_REQUIRE(temperature >= 0.0f && isfinite(temperature), TDM_STATUS_INVALID_ARG,
                "generate: temperature %g must be finite and >= 0", (double)temperature);
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    int T = g->T, V = g->V, was_train = m->train;
    int64_t total = (int64_t)n_prompt + n_new;
    int32_t *seq = malloc((size_t)total * sizeof(int32_t));
    float *row = malloc((size_t)V * sizeof(float));
    double *p = malloc((size_t)V * sizeof(double));
    int32_t *dtok = NULL;
    if (!seq || !row || !p) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "generate: out of memory");
        goto fail;
    }
    if (tdm_dev_kind(d) != TDM_DEVICE_HOST)
        TDM_TRY(tdm_dev_alloc(d, (size_t)T * sizeof(int32_t), (void **)&dtok));
    memcpy(seq, prompt, (size_t)n_prompt * sizeof(int32_t));
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_SAMPLE);
    m->train = 0;
    for (int64_t n = n_prompt; n < total; n++) {
        int ctx = n < T ? (int)n : T;
        const int32_t *window = seq + n - ctx;
        const float *logits;
        if (dtok) {
            TDM_TRY(tdm_dev_copy_from_host(d, dtok, window, (size_t)ctx * sizeof(int32_t)));
            window = dtok;
        }
        TDM_TRY(tdm_gpt_forward_seq(m, window, 1, ctx, &logits));
        TDM_TRY(tdm_dev_copy_to_host(d, row, logits + (int64_t)(ctx - 1) * V,
                                     (size_t)V * sizeof(float)));
        int best = 0;
        for (int j = 1; j < V; j++)
            if (row[j] > row[best]) best = j;
        int tok = best;
        if (temperature > 0.0f) {
            /* softmax(z / temperature), shifted by the max, in double */
            double sum = 0.0;
            for (int j = 0; j < V; j++) {
                p[j] = exp(((double)row[j] - row[best]) / temperature);
                sum += p[j];
            }
            double u = (double)(tdm_rng_u64(&r) >> 11) * 0x1.0p-53 * sum, acc = 0.0;
            tok = V - 1;
            for (int j = 0; j < V; j++) {
                acc += p[j];
                if (u < acc) {
                    tok = j;
                    break;
                }
            }
        }
        seq[n] = tok;
        if (out) out[n - n_prompt] = tok;
        if (emit) emit(emit_ctx, tok);
    }
fail:
    m->train = was_train;
    tdm_dev_free(d, dtok);
    free(seq);
    free(row);
    free(p);
    return st;
}
