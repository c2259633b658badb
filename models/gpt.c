/* models/gpt.c: the GPT (see models/gpt.h): its parameter table,
 * activation sets, forward and backward over the layers of
 * models/layers_gpt.c, for the whole model or a run of its pipeline
 * layers (models/stage.h: the embeddings, blocks b0..b1-1, ln_f and the
 * head). It plugs into models/model.c through tdm_model_vt: the flat
 * buffers, tables, gradient storage and hook stay model.c's. Not here:
 * its spec and what its shape costs (models/gpt_spec.c), the kernels
 * (core/kernels.h), the loss (models/loss.c), generation
 * (models/gpt_generate.c), text data (core/text.h), any parallelism. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "models/gpt_impl.h"
#include "models/layers_gpt.h"

/* ---- parameters ---- */


static float *tdm_gpt_param(tdm_model *m, int i) { return tdm_model_pdata(m, i); }
static float *tdm_gpt_grad(tdm_model *m, int i) { return tdm_model_gdata(m, i); }

static void tdm_gpt_init_param(const tdm_model *m, uint64_t seed, int i, float *p)
{
    int L = m->spec.n_layer;
    const tdm_tensor_info *t = &m->params_info[i];
    int is_ln = strstr(t->name, ".ln_") != NULL;
    int is_bias = strstr(t->name, ".bias") != NULL;
    if (is_ln && !is_bias) {
        for (int64_t j = 0; j < t->n_elem; j++) p[j] = 1.0f;
        return;
    }
    if (is_bias) return;   /* zero */
    /* GPT-2: N(0, 0.02); the projections that write into the residual
     * stream scaled by 1/sqrt(2L), one per residual add */
    float std = 0.02f;
    if (strstr(t->name, ".c_proj.weight")) std = 0.02f / sqrtf(2.0f * (float)L);
    /* the whole model's stream of the tensor: a stage (and a tied copy)
     * starts as the whole model's part of it does */
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_INIT + (uint64_t)tdm_model_global_param(m, i));
    for (int64_t j = 0; j < t->n_elem; j++) p[j] = std * tdm_rng_normal(&r);
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

static void tdm_gpt_free_set(tdm_model *m, tdm_gpt_act *a)
{
    tdm_gpt *g = m->ext;
    tdm_act_free(m, &a->act, &a->arena);   /* every buffer its layout allocated */
    for (int l = 0; a->blk && l < g->nb; l++) memset(&a->blk[l], 0, sizeof a->blk[l]);
    a->res0 = a->lnf = a->lnf_mean = a->lnf_rstd = a->logits = NULL;
    a->lnfh = NULL;
    a->cap = 0;
    a->bytes = 0;
}

static void tdm_gpt_free_scratch(tdm_model *m)
{
    tdm_gpt *g = m->ext;
    tdm_act_free(m, &g->act_scratch, NULL);
    float **all[] = {&g->qkv, &g->yh, &g->dres, &g->dln, &g->dfc, &g->datt, &g->dq, &g->dk,
                     &g->dv, &g->ones, &g->wide, &g->part, &m->dlogits};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) *all[i] = NULL;
    g->low = NULL;
    free(g->tok_host);
    g->tok_host = NULL;
    g->scratch_cap = 0;
    g->scratch_bytes = 0;
    m->input_grad = NULL;
}

static void tdm_gpt_free_activations(tdm_model *m)
{
    tdm_gpt *g = m->ext;
    if (!g) return;
    for (int k = 0; k < g->n_sets; k++) tdm_gpt_free_set(m, &g->sets[k]);
    tdm_gpt_free_scratch(m);
    m->cap = 0;
    m->batch = 0;
    m->act_bytes = 0;
    m->set_bytes = 0;
}

static void tdm_gpt_free_ext(tdm_model *m)
{
    tdm_gpt *g = m->ext;
    if (!g) return;
    if (m->dev) tdm_gpt_free_activations(m);
    for (int k = 0; k < g->n_sets; k++) free(g->sets[k].blk);
    free(g->sets);
    free(g);
    m->ext = NULL;
}

/* Set k exists (empty) and is the current one. */
static tdm_status tdm_gpt_select_set(tdm_model *m, int k)
{
    tdm_gpt *g = m->ext;
    if (k >= g->n_sets) {
        tdm_gpt_act *s = realloc(g->sets, (size_t)(k + 1) * sizeof *s);
        TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "gpt: cannot grow the activation sets to %d",
                    k + 1);
        g->sets = s;
        for (int i = g->n_sets; i <= k; i++) {
            memset(&s[i], 0, sizeof s[i]);
            s[i].blk = calloc((size_t)(g->nb ? g->nb : 1), sizeof *s[i].blk);
            if (!s[i].blk) {
                g->n_sets = i;
                g->a = &s[m->set];
                return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: activation set %d", i);
            }
        }
        g->n_sets = k + 1;
    }
    g->a = &g->sets[k];
    return TDM_STATUS_OK;
}

static void tdm_gpt_held_bytes(const tdm_model *m, size_t *sets, size_t *scratch)
{
    const tdm_gpt *g = m->ext;
    *sets = 0;
    for (int k = 0; k < g->n_sets; k++) *sets += g->sets[k].bytes;
    *scratch = g->scratch_bytes;
}

/* 1 when the stage's block l ends its checkpoint segment (keeps its
 * output); segments count from the stage's first block. */
static int tdm_gpt_seg_last(const tdm_model *m, int l)
{
    const tdm_gpt *g = m->ext;
    int N = m->lev.ckpt, k = l - g->b0;
    return N > 0 && (k % N == N - 1 || l == g->b1 - 1);
}

/* The buffers of the current set and of the scratch for `batch` windows:
 * FP32 or 16-bit tensors, checkpointed blocks' in the set's arena (block
 * l at slot (l - b0) % N; its output only there when the segment goes on
 * past it), then what the blocks and sets share. */
static void tdm_gpt_layout(tdm_model *m, int batch, tdm_act_layout *lay, tdm_act_layout *scr)
{
    tdm_gpt *g = m->ext;
    tdm_gpt_act *a = g->a;
    size_t N = (size_t)batch * g->T, C = g->C, att = (size_t)batch * g->Hl * g->T * g->T;
    size_t Ca = g->Ca, F = g->F;   /* the heads' width, c_fc's rows (a slice's) */
    size_t f = sizeof(float), es = tdm_dtype_size(m->lev.adt), off = 0, slot = 0;
    int low = tdm_model_low(m), ck = m->lev.ckpt > 0;
    memset(lay, 0, sizeof *lay);
    memset(scr, 0, sizeof *scr);
    if (g->has_emb) tdm_act_add(lay, (void **)&a->res0, N * C * f, 0, 0, &off);
    for (int pass = 0; pass < 2 && g->nb > 0; pass++) {
        /* pass 0 measures one block's slot (offsets from 0), pass 1 lays
         * every block out */
        for (int k = 0; k < (pass ? g->nb : 1); k++) {
            tdm_gpt_block *b = &a->blk[k];
            tdm_act_layout *to = pass ? lay : scr;   /* pass 0 only measures */
            int layer = tdm_gpt_layer(g, g->b0 + k, 0), ar = ck;
            off = pass ? (size_t)(k % (ck ? m->lev.ckpt : 1)) * slot : 0;
            if (low) {
                tdm_act_add(to, &b->ln1h, N * C * es, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln1_mean, N * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln1_rstd, N * f, layer, ar, &off);
                tdm_act_add(to, &b->qkvh, 3 * N * Ca * es, layer, ar, &off);
                tdm_act_add(to, &b->atth, att * es, layer, ar, &off);
                tdm_act_add(to, &b->attyh, N * Ca * es, layer, ar, &off);
                tdm_act_add(to, (void **)&b->res1, N * C * f, layer, ar, &off);
                tdm_act_add(to, &b->ln2h, N * C * es, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln2_mean, N * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln2_rstd, N * f, layer, ar, &off);
                tdm_act_add(to, &b->fchh, N * F * es, layer, ar, &off);
                tdm_act_add(to, &b->fcgh, N * F * es, layer, ar, &off);
            } else {
                /* sequence parallel: the stream and the LayerNorms'
                 * statistics of the rank's Nl rows (the first stage's
                 * block 0 normalises the whole embeddings) */
                size_t Nl = g->sp ? N / (size_t)g->tp : N;
                size_t N1 = g->has_emb && k == 0 ? N : Nl;
                tdm_act_add(to, (void **)&b->ln1, N * C * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln1_mean, N1 * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln1_rstd, N1 * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->q, N * Ca * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->k, N * Ca * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->v, N * Ca * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->att, att * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->atty, N * Ca * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->res1, Nl * C * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln2, N * C * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln2_mean, Nl * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->ln2_rstd, Nl * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->fch, N * F * f, layer, ar, &off);
                tdm_act_add(to, (void **)&b->fcg, N * F * f, layer, ar, &off);
            }
            int keep_out = !ck || tdm_gpt_seg_last(m, g->b0 + k);
            /* sequence parallel: the rank's rows, but the model's top
             * block's output (gathered whole for ln_f) */
            size_t N2 = g->sp && !(g->has_head && k == g->nb - 1) ? N / (size_t)g->tp : N;
            tdm_act_add(to, (void **)&b->res2, N2 * C * f, layer, pass ? !keep_out : 1, &off);
            if (!pass) slot = off;
        }
    }
    memset(scr, 0, sizeof *scr);
    off = 0;
    if (g->has_head) {
        int head = tdm_gpt_layer(g, g->b1, 0);
        if (low) tdm_act_add(lay, &a->lnfh, N * C * es, head, 0, &off);
        else tdm_act_add(lay, (void **)&a->lnf, N * C * f, head, 0, &off);
        tdm_act_add(lay, (void **)&a->lnf_mean, N * f, head, 0, &off);
        tdm_act_add(lay, (void **)&a->lnf_rstd, N * f, head, 0, &off);
        tdm_act_add(lay, (void **)&a->logits, N * g->V * f, head + 1, 0, &off);
        tdm_act_add(scr, (void **)&m->dlogits, N * g->V * f, -1, 0, &off);
    }
    tdm_act_add(scr, (void **)&g->qkv, 3 * N * Ca * f, -1, 0, &off);
    tdm_act_add(scr, (void **)&g->yh, N * Ca * f, -1, 0, &off);
    tdm_act_add(scr, (void **)&g->dres, N * C * f, -1, 0, &off);
    tdm_act_add(scr, (void **)&g->dln, N * C * f, -1, 0, &off);
    tdm_act_add(scr, (void **)&g->dfc, N * F * f, -1, 0, &off);
    tdm_act_add(scr, (void **)&g->datt, att * f, -1, 0, &off);
    if (!low) {
        tdm_act_add(scr, (void **)&g->dq, N * Ca * f, -1, 0, &off);
        tdm_act_add(scr, (void **)&g->dk, N * Ca * f, -1, 0, &off);
        tdm_act_add(scr, (void **)&g->dv, N * Ca * f, -1, 0, &off);
    }
    if (g->tp > 1) tdm_act_add(scr, (void **)&g->part, N * C * f, -1, 0, &off);
    tdm_act_add(scr, (void **)&g->ones, N * f, -1, 0, &off);
    if (low) {
        size_t lo = 4 * N * C, wi = 4 * N * C;
        if (att > lo) lo = att;
        if (g->has_head && N * g->V > lo) lo = N * g->V;
        if (att > wi) wi = att;
        tdm_act_add(scr, &g->low, lo * es, -1, 0, &off);
        tdm_act_add(scr, (void **)&g->wide, wi * f, -1, 0, &off);
    }
}

/* The scratch for `batch` windows of the full context. */
static tdm_status tdm_gpt_reserve_scratch(tdm_model *m, int batch)
{
    tdm_gpt *g = m->ext;
    if (batch <= g->scratch_cap) return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    tdm_act_layout *lay = NULL, *scr = NULL;
    tdm_gpt_free_scratch(m);
    int64_t N = (int64_t)batch * g->T;
    lay = malloc(sizeof *lay);
    scr = malloc(sizeof *scr);
    if (!lay || !scr) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: cannot allocate a layout");
        goto fail;
    }
    tdm_gpt_layout(m, batch, lay, scr);
    TDM_TRY(tdm_act_alloc(m, scr, &g->act_scratch, NULL, &g->scratch_bytes));
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
    if (tdm_dev_kind(m->dev) != TDM_DEVICE_HOST && g->has_emb) {
        g->tok_host = malloc((size_t)N * sizeof(int32_t));
        if (!g->tok_host) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: cannot allocate %lld tokens",
                               (long long)N);
            goto fail;
        }
    }
    free(lay);
    free(scr);
    g->scratch_cap = batch;
    return TDM_STATUS_OK;
fail:
    free(lay);
    free(scr);
    tdm_gpt_free_scratch(m);
    return tdm_error_prefix(st, "gpt: scratch for %d windows of %d", batch, g->T);
}

/* Set a (the current one, empty): its activations for `batch` windows. */
static tdm_status tdm_gpt_alloc_set(tdm_model *m, tdm_gpt_act *a, int batch)
{
    tdm_gpt *g = m->ext;
    tdm_status st = TDM_STATUS_OK;
    tdm_act_layout *lay = malloc(sizeof *lay), *scr = malloc(sizeof *scr);
    if (!lay || !scr) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gpt: cannot allocate a layout");
        goto fail;
    }
    tdm_gpt_layout(m, batch, lay, scr);
    TDM_TRY(tdm_act_alloc(m, lay, &a->act, &a->arena, &a->bytes));
    free(lay);
    free(scr);
    a->cap = batch;
    return TDM_STATUS_OK;
fail:
    free(lay);
    free(scr);
    tdm_gpt_free_set(m, a);
    return tdm_error_prefix(st, "gpt: activations for %d windows of %d", batch, g->T);
}

/* The current set: room for `batch` windows of the full context. */
static tdm_status tdm_gpt_reserve(tdm_model *m, int batch)
{
    tdm_gpt *g = m->ext;
    tdm_gpt_act *a = g->a;
    int64_t N = (int64_t)batch * g->T, C = g->C;
    TDM_REQUIRE(N * 4 * C <= INT32_MAX && N * g->V <= INT32_MAX, TDM_STATUS_INVALID_ARG,
                "gpt: a batch of %d windows of %d is too large for one gemm (at most %lld "
                "windows)", batch, g->T, (long long)(INT32_MAX / (4 * C * g->T)));
    TDM_CHECK(tdm_gpt_reserve_scratch(m, batch));
    if (batch > a->cap) {
        tdm_gpt_free_set(m, a);
        tdm_status st = tdm_gpt_alloc_set(m, a, batch);
        if (st != TDM_STATUS_OK) {
            m->cap = 0;
            m->set_bytes = 0;
            return st;
        }
    }
    m->cap = a->cap;
    m->set_bytes = a->bytes;
    m->act_bytes = a->bytes + g->scratch_bytes;
    return TDM_STATUS_OK;
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
                                 "vocabulary [0, %d)", (int)h[i], (long long)(i % g->a->seq),
                                 (long long)(i / g->a->seq), g->V);
    return TDM_STATUS_OK;
}

/* y (N, C) += x (N, in) w^T + bias, a projection onto the stream:
 * accumulated by the gemm (the whole model), or (a tensor-parallel
 * slice, row-parallel) the product summed over the group by the
 * partial-sum callback first, then added with the bias once. */
static tdm_status tdm_gpt_proj_fwd(tdm_model *m, const float *x, const float *w,
                                   const float *bias, int64_t N, int in, float *y, int layer)
{
    tdm_gpt *g = m->ext;
    int C = g->C;
    if (g->tp == 1) return tdm_layers_linear_fwd(m->dev, x, w, bias, N, in, C, 1, y);
    TDM_CHECK(tdm_layers_linear_fwd(m->dev, x, w, NULL, N, in, C, 0, g->part));
    TDM_CHECK(m->partial(m->partial_ctx, g->part, N * C, layer));
    TDM_CHECK(tdm_dev_axpy(m->dev, N * C, 1.0f, g->part, y));
    return tdm_dev_bias_act(m->dev, y, bias, N, C, TDM_ACT_NONE);
}

/* A column-parallel layer's input gradient (N, C), partial on a
 * tensor-parallel slice, summed over the group (the callback; sequence
 * parallel: only the rank's rows, at off, reduce-scattered). */
static tdm_status tdm_gpt_sum_dx(tdm_model *m, float *dx, int64_t N, int layer)
{
    tdm_gpt *g = m->ext;
    if (g->sp)
        return m->seq(m->seq_ctx, TDM_MODEL_SEQ_SCATTER, dx,
                      dx + (int64_t)m->partial_rank * (N / g->tp) * g->C, N * g->C, layer);
    return g->tp == 1 ? TDM_STATUS_OK : m->partial(m->partial_ctx, dx, N * g->C, layer);
}

/* Sequence parallelism: the rank's Nl of the N rows, from row off (all
 * of them without it). */
static void tdm_gpt_rows(const tdm_model *m, int64_t N, int64_t *Nl, int64_t *off)
{
    const tdm_gpt *g = m->ext;
    *Nl = g->sp ? N / g->tp : N;
    *off = g->sp ? (int64_t)m->partial_rank * *Nl : 0;
}

/* Sequence parallelism: buf (N rows of C) from the rank's rows at off,
 * every rank's rows gathered in place. */
static tdm_status tdm_gpt_gather(tdm_model *m, float *buf, int64_t N, int layer)
{
    tdm_gpt *g = m->ext;
    int64_t Nl, off;
    tdm_gpt_rows(m, N, &Nl, &off);
    return m->seq(m->seq_ctx, TDM_MODEL_SEQ_GATHER, buf + off * g->C, buf, N * g->C, layer);
}

/* Sequence parallelism: out (N rows) = LayerNorm of the rank's Nl rows
 * of x into its rows at off, gathered; statistics of the Nl rows. */
static tdm_status tdm_gpt_ln_seq(tdm_model *m, const float *x, const float *w, const float *b,
                                 float *out, float *mean, float *rstd, int64_t N, int layer)
{
    tdm_gpt *g = m->ext;
    int64_t Nl, off;
    tdm_gpt_rows(m, N, &Nl, &off);
    TDM_CHECK(tdm_dev_layernorm_fwd(m->dev, x, w, b, out + off * g->C, mean, rstd, Nl, g->C,
                                    TDM_GPT_LN_EPS));
    return tdm_gpt_gather(m, out, N, layer);
}

/* Sequence parallelism: y (the rank's Nl rows) = res (its Nl rows) + the
 * group's sum of x (N, in) w^T at its rows + bias: the product
 * reduce-scattered along the tokens. */
static tdm_status tdm_gpt_proj_seq(tdm_model *m, const float *x, const float *w,
                                   const float *bias, int64_t N, int in, const float *res,
                                   float *y, int layer)
{
    tdm_gpt *g = m->ext;
    int C = g->C;
    int64_t Nl, off;
    tdm_gpt_rows(m, N, &Nl, &off);
    TDM_CHECK(tdm_layers_linear_fwd(m->dev, x, w, NULL, N, in, C, 0, g->part));
    TDM_CHECK(tdm_gpt_sum_dx(m, g->part, N, layer));
    TDM_CHECK(tdm_dev_copy(m->dev, y, res, (size_t)Nl * C * sizeof(float)));
    TDM_CHECK(tdm_dev_axpy(m->dev, Nl * C, 1.0f, g->part + off * C, y));
    return tdm_dev_bias_act(m->dev, y, bias, Nl, C, TDM_ACT_NONE);
}

/* Block l's forward under sequence parallelism from res: the rank's
 * rows of the stream, or (full: the first stage's block 0) the whole
 * embeddings. The stage's last block of the model's last stage gathers
 * its output (N rows) for ln_f. */
static tdm_status tdm_gpt_block_forward_seq(tdm_model *m, int l, const float *res, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    int C = g->C, full = g->has_emb && l == g->b0, top = g->has_head && l == g->b1 - 1;
    int64_t N = (int64_t)B * Tr, Nl, off;
    tdm_gpt_rows(m, N, &Nl, &off);
#define P(j) tdm_gpt_param(m, tdm_gpt_p(g, l, (j)))
    if (full)
        TDM_CHECK(tdm_dev_layernorm_fwd(d, res, P(TDM_GPT_LN1_W), P(TDM_GPT_LN1_B), b->ln1,
                                        b->ln1_mean, b->ln1_rstd, N, C, TDM_GPT_LN_EPS));
    else
        TDM_CHECK(tdm_gpt_ln_seq(m, res, P(TDM_GPT_LN1_W), P(TDM_GPT_LN1_B), b->ln1,
                                 b->ln1_mean, b->ln1_rstd, N, tdm_gpt_layer(g, l, 0)));
    TDM_CHECK(tdm_layers_linear_fwd(d, b->ln1, P(TDM_GPT_ATTN_W), P(TDM_GPT_ATTN_B), N, C,
                                    3 * g->Ca, 0, g->qkv));
    tdm_layers_attn at = {.B = B, .T = Tr, .H = g->Hl, .C = g->Ca, .q = b->q, .k = b->k,
                          .v = b->v, .att = b->att};
    TDM_CHECK(tdm_layers_attention_fwd(d, &at, g->qkv, g->yh, b->atty));
    TDM_CHECK(tdm_gpt_proj_seq(m, b->atty, P(TDM_GPT_APROJ_W), P(TDM_GPT_APROJ_B), N, g->Ca,
                               full ? res + off * C : res, b->res1, tdm_gpt_layer(g, l, 2)));
    TDM_CHECK(tdm_gpt_ln_seq(m, b->res1, P(TDM_GPT_LN2_W), P(TDM_GPT_LN2_B), b->ln2,
                             b->ln2_mean, b->ln2_rstd, N, tdm_gpt_layer(g, l, 3)));
    TDM_CHECK(tdm_layers_linear_fwd(d, b->ln2, P(TDM_GPT_FC_W), P(TDM_GPT_FC_B), N, C, g->F,
                                    0, b->fch));
    TDM_CHECK(tdm_dev_gelu_fwd(d, b->fch, b->fcg, N * g->F));
    float *out = b->res2 + (top ? off * C : 0);
    TDM_CHECK(tdm_gpt_proj_seq(m, b->fcg, P(TDM_GPT_MPROJ_W), P(TDM_GPT_MPROJ_B), N, g->F,
                               b->res1, out, tdm_gpt_layer(g, l, 5)));
    if (top) TDM_CHECK(tdm_gpt_gather(m, b->res2, N, tdm_gpt_layer(g, l, 5)));
#undef P
    return TDM_STATUS_OK;
}

/* Block l's FP32 forward from the stream res (B windows of Tr), into the
 * current set. */
static tdm_status tdm_gpt_block_forward(tdm_model *m, int l, const float *res, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    int C = g->C;
    int64_t N = (int64_t)B * Tr;
    size_t row_bytes = (size_t)N * C * sizeof(float);
#define P(j) tdm_gpt_param(m, tdm_gpt_p(g, l, (j)))
    TDM_CHECK(tdm_dev_layernorm_fwd(d, res, P(TDM_GPT_LN1_W), P(TDM_GPT_LN1_B), b->ln1,
                                    b->ln1_mean, b->ln1_rstd, N, C, TDM_GPT_LN_EPS));
    TDM_CHECK(tdm_layers_linear_fwd(d, b->ln1, P(TDM_GPT_ATTN_W), P(TDM_GPT_ATTN_B), N, C,
                                    3 * g->Ca, 0, g->qkv));
    tdm_layers_attn at = {.B = B, .T = Tr, .H = g->Hl, .C = g->Ca, .q = b->q, .k = b->k,
                          .v = b->v, .att = b->att};
    TDM_CHECK(tdm_layers_attention_fwd(d, &at, g->qkv, g->yh, b->atty));
    /* x + attn(ln_1(x)): the projection adds onto a copy of the stream */
    TDM_CHECK(tdm_dev_copy(d, b->res1, res, row_bytes));
    TDM_CHECK(tdm_gpt_proj_fwd(m, b->atty, P(TDM_GPT_APROJ_W), P(TDM_GPT_APROJ_B), N, g->Ca,
                               b->res1, tdm_gpt_layer(g, l, 2)));
    TDM_CHECK(tdm_dev_layernorm_fwd(d, b->res1, P(TDM_GPT_LN2_W), P(TDM_GPT_LN2_B), b->ln2,
                                    b->ln2_mean, b->ln2_rstd, N, C, TDM_GPT_LN_EPS));
    TDM_CHECK(tdm_layers_linear_fwd(d, b->ln2, P(TDM_GPT_FC_W), P(TDM_GPT_FC_B), N, C, g->F,
                                    0, b->fch));
    TDM_CHECK(tdm_dev_gelu_fwd(d, b->fch, b->fcg, N * g->F));
    TDM_CHECK(tdm_dev_copy(d, b->res2, b->res1, row_bytes));
    TDM_CHECK(tdm_gpt_proj_fwd(m, b->fcg, P(TDM_GPT_MPROJ_W), P(TDM_GPT_MPROJ_B), N, g->F,
                               b->res2, tdm_gpt_layer(g, l, 5)));
#undef P
    return TDM_STATUS_OK;
}

static tdm_status tdm_gpt_block_fwd(tdm_model *m, int l, const float *res, int B, int Tr)
{
    if (((tdm_gpt *)m->ext)->sp) return tdm_gpt_block_forward_seq(m, l, res, B, Tr);
    if (tdm_model_low(m)) return tdm_gpt_block_forward_low(m, l, res, B, Tr);
    return tdm_gpt_block_forward(m, l, res, B, Tr);
}

/* The stage's forward: tokens (the first stage) or the stream entering
 * block b0 (B, Tr, C), through its blocks, to the logits (the last stage)
 * or the stream leaving block b1 - 1. */
static tdm_status tdm_gpt_run_forward(tdm_model *m, const void *x, int B, int Tr,
                                      const float **out)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    int C = g->C;
    int64_t N = (int64_t)B * Tr;
    TDM_REQUIRE(g->tp == 1 || m->partial, TDM_STATUS_INVALID_ARG,
                "gpt: a tensor-parallel slice (1/%d) runs with its partial sums set", g->tp);
    TDM_REQUIRE(!g->sp || (m->seq && !tdm_model_low(m) && !m->lev.ckpt), TDM_STATUS_INVALID_ARG,
                "gpt: a sequence-parallel slice runs in FP32 without activation checkpointing, "
                "with its collectives set");
    TDM_CHECK(tdm_gpt_reserve(m, B));
    tdm_gpt_act *a = g->a;
    a->seq = Tr;
    a->tok = NULL;
    a->in = NULL;
    const float *res;
    if (g->has_emb) {
        const int32_t *tok = x;
        TDM_CHECK(tdm_gpt_check_tokens(m, tok, N));
        /* parameter-use events name whole blocks: a block is the unit
         * parameters are grouped by (tdm_model_layer_block) */
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, TDM_GPT_WTE, TDM_GPT_WPE));
        TDM_CHECK(tdm_dev_embed_fwd(d, tok, tdm_gpt_param(m, TDM_GPT_WTE),
                                    tdm_gpt_param(m, TDM_GPT_WPE), a->res0, B, Tr, C));
        a->tok = tok;
        res = a->res0;
    } else {
        a->in = x;   /* read again by block b0's backward */
        res = a->in;
    }
    for (int l = g->b0; l < g->b1; l++) {
        int p0 = tdm_gpt_p(g, l, 0), p1 = tdm_gpt_p(g, l, TDM_GPT_PER_BLOCK - 1);
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, p0, p1));
        TDM_CHECK(tdm_model_cast_params(m, p0, p1));
        TDM_CHECK(tdm_gpt_block_fwd(m, l, res, B, Tr));
        res = a->blk[l - g->b0].res2;
    }
    if (g->has_head) {
        int pf = tdm_gpt_p_lnf(g);
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, pf, pf + 1));
        if (tdm_model_low(m)) {
            TDM_CHECK(tdm_gpt_head_forward_low(m, res, B, Tr));
        } else {
            TDM_CHECK(tdm_dev_layernorm_fwd(d, res, tdm_gpt_param(m, pf),
                                            tdm_gpt_param(m, pf + 1), a->lnf, a->lnf_mean,
                                            a->lnf_rstd, N, C, TDM_GPT_LN_EPS));
            /* the head tied to the token embedding: logits = ln_f(x) wte^T
             * (a later stage holds its own copy of wte for it) */
            TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, g->p_head, g->p_head));
            TDM_CHECK(tdm_layers_linear_fwd(d, a->lnf, tdm_gpt_param(m, g->p_head), NULL, N, C,
                                            g->V, 0, a->logits));
        }
        res = a->logits;
    }
    if (out) *out = res;
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
    TDM_REQUIRE(g->has_emb && g->has_head, TDM_STATUS_INVALID_ARG,
                "gpt forward: a pipeline stage (layers %d..%d of %d) cannot generate",
                m->stage.lo, m->stage.hi - 1, m->stage.n);
    TDM_REQUIRE(batch > 0 && tokens, TDM_STATUS_INVALID_ARG,
                "gpt forward: batch %d must be positive and tokens non-NULL", batch);
    TDM_REQUIRE(seq_len >= 1 && seq_len <= g->T, TDM_STATUS_INVALID_ARG,
                "gpt forward: %d positions, but the context holds 1..%d", seq_len, g->T);
    m->batch = 0;   /* not for backward (see gpt.h) */
    return tdm_gpt_run_forward(m, tokens, batch, seq_len, logits);
}

static const float *tdm_gpt_last_logits(const tdm_model *m)
{
    return ((const tdm_gpt *)m->ext)->a->logits;
}

/* ---- backward ---- */

void tdm_gpt_hook(tdm_model *m, int layer)
{
    const tdm_layer *l = &m->layers[layer];
    if (m->hook && l->np > 0) m->hook(m->hook_ctx, m, l->p0, l->p0 + l->np - 1);
}

/* Block l's attention from the heads' output gradient in g->dln (c_proj's
 * backward done) to ln_1's output gradient in g->dln, summed over the
 * tensor-parallel group: the attention's backward and c_attn's, whole
 * rows in both the plain and the sequence-parallel block. */
static tdm_status tdm_gpt_attn_backward(tdm_model *m, int l, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    int C = g->C;
    int64_t N = (int64_t)B * Tr;
#define P(j) tdm_gpt_param(m, tdm_gpt_p(g, l, (j)))
#define G(j) tdm_gpt_grad(m, tdm_gpt_p(g, l, (j)))
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 2));
    tdm_layers_attn at = {.B = B, .T = Tr, .H = g->Hl, .C = g->Ca, .q = b->q, .k = b->k,
                          .v = b->v, .att = b->att};
    TDM_CHECK(tdm_layers_attention_bwd(d, &at, g->dln, g->yh, g->datt, g->dq, g->dk, g->dv,
                                       g->qkv));
    TDM_CHECK(tdm_layers_linear_bwd(d, b->ln1, P(TDM_GPT_ATTN_W), g->qkv, g->ones, N, C,
                                    3 * g->Ca, G(TDM_GPT_ATTN_W), G(TDM_GPT_ATTN_B), g->dln,
                                    0));
    TDM_CHECK(tdm_gpt_sum_dx(m, g->dln, N, tdm_gpt_layer(g, l, 1)));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 1));
#undef P
#undef G
    return TDM_STATUS_OK;
}

/* Block l's FP32 backward: from g->dres (the gradient of its output) to
 * the gradient of its input res_in, left in g->dres. */
static tdm_status tdm_gpt_block_backward(tdm_model *m, int l, const float *res_in, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    int C = g->C;
    int64_t N = (int64_t)B * Tr;
#define P(j) tdm_gpt_param(m, tdm_gpt_p(g, l, (j)))
#define G(j) tdm_gpt_grad(m, tdm_gpt_p(g, l, (j)))
    /* x += mlp(ln_2(x)): the branch's output gradient is dres itself */
    TDM_CHECK(tdm_layers_linear_bwd(d, b->fcg, P(TDM_GPT_MPROJ_W), g->dres, g->ones, N,
                                    g->F, C, G(TDM_GPT_MPROJ_W), G(TDM_GPT_MPROJ_B), g->dfc,
                                    0));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 5));
    TDM_CHECK(tdm_dev_gelu_bwd(d, b->fch, g->dfc, g->dfc, N * g->F));
    TDM_CHECK(tdm_layers_linear_bwd(d, b->ln2, P(TDM_GPT_FC_W), g->dfc, g->ones, N, C, g->F,
                                    G(TDM_GPT_FC_W), G(TDM_GPT_FC_B), g->dln, 0));
    TDM_CHECK(tdm_gpt_sum_dx(m, g->dln, N, tdm_gpt_layer(g, l, 4)));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 4));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, b->res1, g->dln, P(TDM_GPT_LN2_W), b->ln2_mean,
                                    b->ln2_rstd, g->dres, G(TDM_GPT_LN2_W),
                                    G(TDM_GPT_LN2_B), N, C));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 3));
    /* x += attn(ln_1(x)); dln holds the heads' output gradient until
     * c_attn's backward overwrites it */
    TDM_CHECK(tdm_layers_linear_bwd(d, b->atty, P(TDM_GPT_APROJ_W), g->dres, g->ones, N,
                                    g->Ca, C, G(TDM_GPT_APROJ_W), G(TDM_GPT_APROJ_B), g->dln,
                                    0));
    TDM_CHECK(tdm_gpt_attn_backward(m, l, B, Tr));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, res_in, g->dln, P(TDM_GPT_LN1_W), b->ln1_mean,
                                    b->ln1_rstd, g->dres, G(TDM_GPT_LN1_W),
                                    G(TDM_GPT_LN1_B), N, C));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 0));
#undef P
#undef G
    return TDM_STATUS_OK;
}

/* Block l's backward under sequence parallelism: from g->dres (the
 * gradient of the rank's rows of its output; the model's top block: top
 * holds the whole gradient, N rows) to the gradient of the rank's rows
 * of its input, left in g->dres. */
static tdm_status tdm_gpt_block_backward_seq(tdm_model *m, int l, const float *res_in,
                                             const float *top, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    int C = g->C, full = g->has_emb && l == g->b0;
    int64_t N = (int64_t)B * Tr, Nl, off;
    tdm_gpt_rows(m, N, &Nl, &off);
    size_t nl_bytes = (size_t)Nl * C * sizeof(float);
    const float *dy = top;
#define P(j) tdm_gpt_param(m, tdm_gpt_p(g, l, (j)))
#define G(j) tdm_gpt_grad(m, tdm_gpt_p(g, l, (j)))
    /* the row-parallel layer's output gradient, whole: the ranks' rows
     * of the stream's gathered into part */
    if (!dy) {
        TDM_CHECK(tdm_dev_copy(d, g->part + off * C, g->dres, nl_bytes));
        TDM_CHECK(tdm_gpt_gather(m, g->part, N, tdm_gpt_layer(g, l, 5)));
        dy = g->part;
    }
    TDM_CHECK(tdm_layers_linear_bwd(d, b->fcg, P(TDM_GPT_MPROJ_W), dy, g->ones, N, g->F, C,
                                    G(TDM_GPT_MPROJ_W), G(TDM_GPT_MPROJ_B), g->dfc, 0));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 5));
    TDM_CHECK(tdm_dev_gelu_bwd(d, b->fch, g->dfc, g->dfc, N * g->F));
    TDM_CHECK(tdm_layers_linear_bwd(d, b->ln2, P(TDM_GPT_FC_W), g->dfc, g->ones, N, C, g->F,
                                    G(TDM_GPT_FC_W), G(TDM_GPT_FC_B), g->dln, 0));
    TDM_CHECK(tdm_gpt_sum_dx(m, g->dln, N, tdm_gpt_layer(g, l, 4)));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 4));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, b->res1, g->dln + off * C, P(TDM_GPT_LN2_W),
                                    b->ln2_mean, b->ln2_rstd, g->dres, G(TDM_GPT_LN2_W),
                                    G(TDM_GPT_LN2_B), Nl, C));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 3));
    TDM_CHECK(tdm_dev_copy(d, g->part + off * C, g->dres, nl_bytes));
    TDM_CHECK(tdm_gpt_gather(m, g->part, N, tdm_gpt_layer(g, l, 2)));
    TDM_CHECK(tdm_layers_linear_bwd(d, b->atty, P(TDM_GPT_APROJ_W), g->part, g->ones, N, g->Ca,
                                    C, G(TDM_GPT_APROJ_W), G(TDM_GPT_APROJ_B), g->dln, 0));
    TDM_CHECK(tdm_gpt_attn_backward(m, l, B, Tr));
    /* the first stage's block 0 normalised the whole embeddings: the
     * rank's rows of them and of their statistics */
    int64_t so = full ? off : 0;
    TDM_CHECK(tdm_dev_layernorm_bwd(d, res_in + so * C, g->dln + off * C, P(TDM_GPT_LN1_W),
                                    b->ln1_mean + so, b->ln1_rstd + so, g->dres,
                                    G(TDM_GPT_LN1_W), G(TDM_GPT_LN1_B), Nl, C));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 0));
#undef P
#undef G
    return TDM_STATUS_OK;
}

tdm_status tdm_model_seq_sum_grads(tdm_model *m)
{
    if (m->spec.kind != TDM_MODEL_GPT || !m->ext || !((tdm_gpt *)m->ext)->sp)
        return TDM_STATUS_OK;
    tdm_gpt *g = m->ext;
    for (int l = g->b0; l < g->b1; l++) {
        /* ln_1's and ln_2's weight and bias lie side by side */
        TDM_CHECK(m->partial(m->partial_ctx, tdm_gpt_grad(m, tdm_gpt_p(g, l, TDM_GPT_LN1_W)),
                             2 * (int64_t)g->C, tdm_gpt_layer(g, l, 0)));
        TDM_CHECK(m->partial(m->partial_ctx, tdm_gpt_grad(m, tdm_gpt_p(g, l, TDM_GPT_LN2_W)),
                             2 * (int64_t)g->C, tdm_gpt_layer(g, l, 3)));
    }
    return TDM_STATUS_OK;
}

/* The stream entering the stage's block l: the embeddings, the block
 * before's output, or (block b0 of a later stage) the stage's input. */
static const float *tdm_gpt_block_in(const tdm_gpt *g, int l)
{
    const tdm_gpt_act *a = g->a;
    return l > g->b0 ? a->blk[l - 1 - g->b0].res2 : g->has_emb ? a->res0 : a->in;
}

/* Checkpointing (models/recompute.h): backward reached block l, the last
 * of its segment; the segment's blocks run forward again from the
 * segment's input, into the set's arena. */
static tdm_status tdm_gpt_recompute(tdm_model *m, int l, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    int first = l - (l - g->b0) % m->lev.ckpt;
    /* every block of the segment at once, until its own backward
     * (models/recompute.c says why) */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, tdm_gpt_p(g, first, 0),
                                  tdm_gpt_p(g, l, TDM_GPT_PER_BLOCK - 1)));
    tdm_status st = TDM_STATUS_OK;
    m->lev.recomputing = 1;
    for (int j = first; j <= l && st == TDM_STATUS_OK; j++)
        st = tdm_gpt_block_fwd(m, j, tdm_gpt_block_in(g, j), B, Tr);
    m->lev.recomputing = 0;
    return st;
}

/* dy: the logits' gradient (the last stage) or the gradient of the
 * stream leaving block b1 - 1; a later stage ends with the gradient of
 * the stream entering block b0 in dres (m->input_grad). */
static tdm_status tdm_gpt_backward(tdm_model *m, const float *dy)
{
    tdm_gpt *g = m->ext;
    tdm_gpt_act *a = g->a;
    tdm_device *d = m->dev;
    int B = m->batch, Tr = a->seq, C = g->C, low = tdm_model_low(m);
    int64_t N = (int64_t)B * Tr, Nl, off;
    tdm_gpt_rows(m, N, &Nl, &off);
    m->input_grad = NULL;
    const float *res_last = tdm_gpt_block_in(g, g->b1);
    /* sequence parallel: the model's top gradient is whole (N rows) in
     * part, of which the rank keeps its rows in dres */
    float *dtop = g->sp && g->has_head ? g->part : g->dres;
    if (g->has_head) {
        TDM_CHECK(tdm_dev_memset_zero(d, dtop, (size_t)N * C * sizeof(float)));
        /* the head: dwte += dlogits^T ln_f(x) (the first of its two shares
         * where the embedding is on this stage, then no hook: wte is not
         * final yet; a tied copy's whole share here, final at once),
         * d ln_f(x) = dlogits wte */
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, g->p_head, g->p_head));
        int head_layer = tdm_gpt_layer(g, g->b1, 0) + 1;
        int pf = tdm_gpt_p_lnf(g);
        /* in both precisions the head is done with before ln_f's use is
         * raised (a sharded model gathers one unit at a time) */
        if (low)
            TDM_CHECK(tdm_gpt_head_backward_low(m, dy, B, Tr));
        else
            TDM_CHECK(tdm_layers_linear_bwd(d, a->lnf, tdm_gpt_param(m, g->p_head), dy, g->ones,
                                            N, C, g->V, tdm_gpt_grad(m, g->p_head), NULL, g->dln,
                                            0));
        if (!g->has_emb || m->spec.head_untied) tdm_gpt_hook(m, head_layer);
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, pf, pf + 1));
        TDM_CHECK(tdm_dev_layernorm_bwd(d, res_last, g->dln, tdm_gpt_param(m, pf), a->lnf_mean,
                                        a->lnf_rstd, dtop, tdm_gpt_grad(m, pf),
                                        tdm_gpt_grad(m, pf + 1), N, C));
        tdm_gpt_hook(m, head_layer - 1);
        if (g->sp)
            TDM_CHECK(tdm_dev_copy(d, g->dres, dtop + off * C, (size_t)Nl * C * sizeof(float)));
    } else {
        TDM_CHECK(tdm_dev_copy(d, g->dres, dy, (size_t)Nl * C * sizeof(float)));
    }
    for (int l = g->b1 - 1; l >= g->b0; l--) {
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, tdm_gpt_p(g, l, 0),
                                      tdm_gpt_p(g, l, TDM_GPT_PER_BLOCK - 1)));
        if (tdm_gpt_seg_last(m, l)) TDM_CHECK(tdm_gpt_recompute(m, l, B, Tr));
        if (g->sp)
            TDM_CHECK(tdm_gpt_block_backward_seq(m, l, tdm_gpt_block_in(g, l),
                                                 g->has_head && l == g->b1 - 1 ? dtop : NULL,
                                                 B, Tr));
        else if (low)
            TDM_CHECK(tdm_gpt_block_backward_low(m, l, tdm_gpt_block_in(g, l), B, Tr));
        else TDM_CHECK(tdm_gpt_block_backward(m, l, tdm_gpt_block_in(g, l), B, Tr));
    }
    if (!g->has_emb) {
        m->input_grad = g->dres;
        return TDM_STATUS_OK;
    }
    const float *demb = g->dres;
    if (g->sp && g->nb > 0) {
        /* the embeddings' gradient, whole: every rank's rows gathered */
        TDM_CHECK(tdm_dev_copy(d, g->part + off * C, g->dres, (size_t)Nl * C * sizeof(float)));
        TDM_CHECK(tdm_gpt_gather(m, g->part, N, 0));
        demb = g->part;
    } else if (g->sp) {
        demb = dtop;   /* no block: the top's gradient, whole */
    }
    /* the embeddings: wte's second share; now wte and wpe are final. The
     * embedding's backward adds rows of dres into the gradients and
     * reads neither table. */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD_GRADS, TDM_GPT_WTE, TDM_GPT_WPE));
    TDM_CHECK(tdm_dev_embed_bwd(d, a->tok, demb, tdm_gpt_grad(m, TDM_GPT_WTE),
                                tdm_gpt_grad(m, TDM_GPT_WPE), B, Tr, C));
    tdm_gpt_hook(m, 0);
    return TDM_STATUS_OK;
}

static tdm_status tdm_gpt_select(tdm_model *m, int k) { return tdm_gpt_select_set(m, k); }

static const tdm_model_vt tdm_gpt_vt = {
    .init_param = tdm_gpt_init_param,
    .forward = tdm_gpt_forward,
    .backward = tdm_gpt_backward,
    .last_logits = tdm_gpt_last_logits,
    .gemm_flops = tdm_gpt_gemm_flops,
    .free_activations = tdm_gpt_free_activations,
    .free_ext = tdm_gpt_free_ext,
    .select_set = tdm_gpt_select,
    .act_bytes = tdm_gpt_held_bytes,
    .layout = tdm_gpt_layout,
};

/* The tables of pipeline layers m->stage.lo..hi of the L + 2: 0 the
 * embeddings, 1 + l block l, L + 1 the final LayerNorm and the head. A
 * stage with the head but not the embedding holds its own copy of wte for
 * the head, last in its table ("lm_head.weight", owned by the head
 * layer): its gradient is that stage's share of wte's, summed with the
 * first stage's by the pipeline (Megatron's tied embeddings). */
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
    TDM_REQUIRE(!m->dev || tdm_dev_has_transformer(m->dev), TDM_STATUS_UNSUPPORTED,
                "gpt: device %s has no transformer kernels", tdm_dev_name(m->dev));
    int tp = s->tp_ranks > 1 ? s->tp_ranks : 1;
    TDM_REQUIRE(H % tp == 0 && !(tp > 1 && s->head_untied), TDM_STATUS_INVALID_ARG,
                "gpt: a tensor-parallel slice of %d ranks needs the %d heads divisible by them "
                "and a tied head", tp, H);
    int lo = m->stage.lo, hi = m->stage.hi;
    TDM_REQUIRE(!s->head_untied || (lo == 0 && hi == L + 2), TDM_STATUS_UNSUPPORTED,
                "%s: a GPT with an untied head runs whole: it is not built for pipeline stages "
                "(write `lmhead tied`, or train it in single, dp, ddp or fsdp)", s->name);
    tdm_gpt *g = calloc(1, sizeof *g);
    TDM_REQUIRE(g, TDM_STATUS_OUT_OF_MEMORY, "gpt: out of memory");
    g->L = L;
    g->C = C;
    g->H = H;
    g->T = T;
    g->V = s->vocab;
    g->tp = tp;
    g->Hl = H / tp;
    g->Ca = C / tp;
    g->F = 4 * C / tp;
    g->has_emb = lo == 0;
    g->has_head = hi == L + 2;
    g->b0 = (lo > 0 ? lo : 1) - 1;
    g->b1 = (hi < L + 1 ? hi : L + 1) - 1;
    g->nb = g->b1 - g->b0;
    g->sp = tp > 1 && s->tp_seq;
    TDM_REQUIRE(!g->sp || T % tp == 0, TDM_STATUS_INVALID_ARG,
                "gpt: sequence parallelism over %d ranks needs the context of %d tokens "
                "divisible by them", tp, T);
    TDM_REQUIRE(!g->sp || g->b1 > g->b0, TDM_STATUS_INVALID_ARG,
                "gpt: a sequence-parallel stage (pipeline layers %d-%d) needs at least one "
                "block: the embeddings or the head alone run on whole windows", lo, hi - 1);
    g->p_blk0 = g->has_emb ? 2 : 0;
    g->layer_blk0 = g->has_emb ? 1 : 0;
    m->ext = g;
    m->vt = &tdm_gpt_vt;
    /* set 0, empty */
    TDM_CHECK(tdm_gpt_select_set(m, 0));
    if (g->has_emb) {
        const char *names[2] = {"transformer.wte.weight", "transformer.wpe.weight"};
        const int64_t shapes[2][2] = {{s->vocab, C}, {T, C}};
        const int nd[2] = {2, 2};
        TDM_CHECK(tdm_gpt_group(m, 2, names, shapes, nd));
    }
    char name[TDM_MODEL_NAME_MAX];
    for (int l = g->b0; l < g->b1; l++) {
#define NAME(sfx) (snprintf(name, sizeof name, "transformer.h.%d.%s", l, sfx), name)
        TDM_CHECK(tdm_gpt_ln_group(m, NAME("ln_1"), C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("attn.c_attn"), 3 * g->Ca, C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("attn.c_proj"), C, g->Ca));
        TDM_CHECK(tdm_gpt_ln_group(m, NAME("ln_2"), C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("mlp.c_fc"), g->F, C));
        TDM_CHECK(tdm_gpt_linear_group(m, NAME("mlp.c_proj"), C, g->F));
#undef NAME
    }
    m->stage.p_base = g->has_emb ? 0 : 2 + TDM_GPT_PER_BLOCK * g->b0;
    g->p_head = TDM_GPT_WTE;
    if (g->has_head) {
        TDM_CHECK(tdm_gpt_ln_group(m, "transformer.ln_f", C));
        int li = m->n_layers;
        tdm_layer *head = tdm_model_add_layer(m, TDM_LAYER_GROUP);   /* reads wte */
        m->stage.n_slice = m->n_params;
        if (s->head_untied) {
            /* a weight of its own, a tensor of the whole model */
            g->p_head = m->n_params;
            TDM_CHECK(tdm_model_add_tensor(m, 0, li, "lm_head.weight", 2,
                                           (int64_t[]){s->vocab, C}));
            head->np = 1;
            m->stage.n_slice = m->n_params;
        } else if (!g->has_emb) {
            g->p_head = m->n_params;
            TDM_CHECK(tdm_model_add_tensor(m, 0, li, "lm_head.weight", 2,
                                           (int64_t[]){s->vocab, C}));
            head->np = 1;
            m->stage.tied = g->p_head;
            m->stage.tied_source = TDM_GPT_WTE;
        }
    } else {
        m->stage.n_slice = m->n_params;
    }
    /* blocks: the embeddings, each block's six layers, ln_f and the head,
     * numbered from 0 on the stage */
    for (int i = 0; i < m->n_layers; i++) {
        int k = i - g->layer_blk0;
        m->layers[i].block = i < g->layer_blk0 ? 0
                           : k >= 6 * g->nb   ? g->layer_blk0 + g->nb
                                              : g->layer_blk0 + k / 6;
        /* the checkpoint units are the stage's transformer blocks */
        m->layers[i].unit = i >= g->layer_blk0 && k < 6 * g->nb ? k / 6 : -1;
    }
    m->lev.n_units = g->nb;
    return TDM_STATUS_OK;
}
