/* models/layers_seq.c: forward and backward of the layers that model
 * files and the C builder add to the MLP's and CNN's (models/builder.c
 * builds them): an elementwise activation (relu, gelu, tanh, sigmoid),
 * average pooling, and the end of a residual block, which adds the
 * block's input (through a 1x1 convolution or a linear projection when
 * the shapes differ) to the block's output. The block's skip gradient is
 * kept in the layer's scratch until backward reaches the block's first
 * layer, where tdm_seq_skip_add adds it into that layer's input gradient.
 * Not here: the layers of the built-in models (models/layers.c). */
#include "models/builder.h"
#include "models/model_impl.h"

#include <stdlib.h>

static tdm_status tdm_seq_drop_forward(tdm_model *m, tdm_layer *l, const float *x, int B);
static tdm_status tdm_seq_drop_backward(tdm_model *m, tdm_layer *l, const float *dout,
                                        float *din, int B);

static tdm_conv_geom tdm_seq_pool_geom(const tdm_layer *l, int B)
{
    return (tdm_conv_geom){.n = B, .c = l->c, .h = l->h, .w = l->w, .kh = l->k, .kw = l->kw,
                           .stride = l->stride, .pad = 0, .oh = l->oh, .ow = l->ow};
}

/* The block input a residual layer reads: layer skip's output, or the
 * model's input (layer 0's). */
static const float *tdm_seq_skip_in(const tdm_model *m, const tdm_layer *l)
{
    return l->skip >= 0 ? m->layers[l->skip].out : m->layers[0].in;
}

static tdm_status tdm_seq_res_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    tdm_device *d = m->dev;
    const float *skip = tdm_seq_skip_in(m, l);
    int64_t n = (int64_t)B * l->out_elems;
    TDM_REQUIRE(skip, TDM_STATUS_INTERNAL, "residual: the block input is missing");
    if (!l->proj) {
        TDM_CHECK(tdm_dev_copy(d, l->out, x, (size_t)n * sizeof(float)));
        TDM_CHECK(tdm_dev_axpy(d, n, 1.0f, skip, l->out));
        l->in = skip;
        return TDM_STATUS_OK;
    }
    if (l->k == 1) {
        /* a 1x1 convolution of stride `stride` (CNHW in and out) */
        TDM_CHECK(tdm_layer_conv_fwd(m, l, skip, B));
    } else {
        /* out (B, oc) = skip (B, c) W^T + b */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_T, B, l->oc, l->c, 1.0f, skip,
                                  tdm_model_pdata(m, l->p0), 0.0f, l->out));
        TDM_CHECK(tdm_dev_bias_act(d, l->out, tdm_model_pdata(m, l->p0 + 1), B, l->oc,
                                   TDM_ACT_NONE));
    }
    TDM_CHECK(tdm_dev_axpy(d, n, 1.0f, x, l->out));
    l->in = skip;   /* what the projection's backward reads */
    return TDM_STATUS_OK;
}

/* dout: the block output's gradient. The body's gradient is dout itself
 * (din), the skip path's dout through the projection (l->skipg), added
 * into the block input's gradient later (tdm_seq_skip_add). With din NULL
 * nobody needs an input gradient: only the projection's weights get one. */
static tdm_status tdm_seq_res_backward(tdm_model *m, tdm_layer *l, const float *dout, float *din,
                                       int B)
{
    tdm_device *d = m->dev;
    int64_t n = (int64_t)B * l->out_elems;
    if (l->proj && l->k == 1) {
        TDM_CHECK(tdm_layer_conv_bwd(m, l, dout, din ? l->skipg : NULL, B));
    } else if (l->proj) {
        /* dW (oc, c) += dout^T skip; db += ones dout; skipg = dout W */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_T, TDM_TRANS_N, l->oc, l->c, B, 1.0f, dout, l->in,
                                  1.0f, tdm_model_gdata(m, l->p0)));
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, 1, l->oc, B, 1.0f, m->ones, dout,
                                  1.0f, tdm_model_gdata(m, l->p0 + 1)));
        if (din)
            TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, B, l->c, l->oc, 1.0f, dout,
                                      tdm_model_pdata(m, l->p0), 0.0f, l->skipg));
    } else if (din) {
        TDM_CHECK(tdm_dev_copy(d, l->skipg, dout, (size_t)n * sizeof(float)));
    }
    if (din) TDM_CHECK(tdm_dev_copy(d, din, dout, (size_t)n * sizeof(float)));
    return TDM_STATUS_OK;
}

/* Layernorm of each sample's c features (the GPT's kernels, eps 1e-5):
 * the B means and rstds follow the values in the layer's output buffer
 * (so an activation set holds them, models/recompute.c). */
#define TDM_SEQ_LN_EPS 1e-5f

static tdm_status tdm_seq_ln_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    float *mean = l->out + (int64_t)B * l->c, *rstd = mean + B;
    l->in = x;
    return tdm_dev_layernorm_fwd(m->dev, x, tdm_model_pdata(m, l->p0),
                                 tdm_model_pdata(m, l->p0 + 1), l->out, mean, rstd, B, l->c,
                                 TDM_SEQ_LN_EPS);
}

/* The kernel adds into the input gradient: din is zeroed first; without
 * one (nobody needs it) the other gradient buffer takes it. */
static tdm_status tdm_seq_ln_backward(tdm_model *m, tdm_layer *l, const float *dout, float *din,
                                      int B)
{
    const float *mean = l->out + (int64_t)B * l->c, *rstd = mean + B;
    float *dx = din ? din : dout == m->dbuf[0] ? m->dbuf[1] : m->dbuf[0];
    TDM_CHECK(tdm_dev_memset_zero(m->dev, dx, (size_t)B * l->c * sizeof(float)));
    return tdm_dev_layernorm_bwd(m->dev, l->in, dout, tdm_model_pdata(m, l->p0), mean, rstd, dx,
                                 tdm_model_gdata(m, l->p0), tdm_model_gdata(m, l->p0 + 1), B,
                                 l->c);
}

tdm_status tdm_seq_layer_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    tdm_conv_geom g;
    switch (l->kind) {
    case TDM_LAYER_ACT:
        l->in = x;
        return tdm_dev_act_fwd(m->dev, l->act, x, l->out, (int64_t)B * l->out_elems);
    case TDM_LAYER_AVGPOOL:
        l->in = x;
        g = tdm_seq_pool_geom(l, B);
        return tdm_dev_avgpool_fwd(m->dev, &g, x, l->out);
    case TDM_LAYER_RES:
        return tdm_seq_res_forward(m, l, x, B);
    case TDM_LAYER_DROPOUT:
        return tdm_seq_drop_forward(m, l, x, B);
    case TDM_LAYER_LN:
        return tdm_seq_ln_forward(m, l, x, B);
    default:
        break;
    }
    return tdm_error_set(TDM_STATUS_INTERNAL, "seq layer: unknown kind %d", (int)l->kind);
}

tdm_status tdm_seq_layer_backward(tdm_model *m, tdm_layer *l, float *dout, float *din, int B)
{
    tdm_conv_geom g;
    switch (l->kind) {
    case TDM_LAYER_ACT:
        if (!din) return TDM_STATUS_OK;
        return tdm_dev_act_bwd(m->dev, l->act, l->in, l->out, dout, din,
                               (int64_t)B * l->out_elems);
    case TDM_LAYER_AVGPOOL:
        if (!din) return TDM_STATUS_OK;
        g = tdm_seq_pool_geom(l, B);
        return tdm_dev_avgpool_bwd(m->dev, &g, dout, din);
    case TDM_LAYER_RES:
        return tdm_seq_res_backward(m, l, dout, din, B);
    case TDM_LAYER_DROPOUT:
        return tdm_seq_drop_backward(m, l, dout, din, B);
    case TDM_LAYER_LN:
        return tdm_seq_ln_backward(m, l, dout, din, B);
    default:
        break;
    }
    return tdm_error_set(TDM_STATUS_INTERNAL, "seq layer: unknown kind %d", (int)l->kind);
}

tdm_status tdm_seq_skip_add(tdm_model *m, int lowest, float *din, int B)
{
    if (!din || m->spec.kind != TDM_MODEL_SEQ) return TDM_STATUS_OK;
    /* every block whose input is layer lowest's input (nested blocks may
     * share one), in the order their ends come (a fixed order: the sum is
     * the same on every device) */
    for (int r = m->n_layers - 1; r > lowest; r--) {
        const tdm_layer *l = &m->layers[r];
        if (l->kind != TDM_LAYER_RES || l->skip != lowest - 1) continue;
        TDM_CHECK(tdm_dev_axpy(m->dev, (int64_t)B * l->skip_elems, 1.0f, l->skipg, din));
    }
    return TDM_STATUS_OK;
}

/* ---- dropout ----
 * The mask of value j (in (C, H, W) order) of a sample with key k is
 * splitmix64(k + (j + 1) * golden) >> 40 below p * 2^24: a function of
 * the key and j only. A sample's key hashes (seed, training forwards so
 * far, the sample's input bytes): the same on every rank and in every
 * design that gives the sample to a model that has run as many training
 * forwards, wherever the sample sits in its batch. */

#define TDM_DROP_GOLDEN 0x9e3779b97f4a7c15ull

static uint64_t tdm_drop_mix(uint64_t z)
{
    z += TDM_DROP_GOLDEN;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int tdm_drop_has(const tdm_model *m)
{
    if (m->spec.kind != TDM_MODEL_SEQ) return 0;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].kind == TDM_LAYER_DROPOUT) return 1;
    return 0;
}

tdm_status tdm_seq_drop_keys(tdm_model *m, const void *x, int B)
{
    if (!m->train || !tdm_drop_has(m)) return TDM_STATUS_OK;
    TDM_REQUIRE(m->stage.lo == 0, TDM_STATUS_INVALID_ARG,
                "dropout: a pipeline stage after the first cannot key its masks on the samples");
    size_t row = (size_t)m->layers[0].in_elems * sizeof(float), nb = row * (size_t)B;
    if (B > m->drop_cap) {
        uint64_t *k = realloc(m->drop_keys, (size_t)B * sizeof *k);
        TDM_REQUIRE(k, TDM_STATUS_OUT_OF_MEMORY, "dropout: cannot allocate %d keys", B);
        m->drop_keys = k;
        m->drop_cap = B;
    }
    const unsigned char *h = x;
    unsigned char *copy = NULL;
    if (tdm_dev_kind(m->dev) != TDM_DEVICE_HOST) {
        copy = malloc(nb ? nb : 1);
        TDM_REQUIRE(copy, TDM_STATUS_OUT_OF_MEMORY, "dropout: cannot stage %zu bytes", nb);
        tdm_status st = tdm_dev_copy_to_host(m->dev, copy, x, nb);
        if (st != TDM_STATUS_OK) {
            free(copy);
            return st;
        }
        h = copy;
    }
    tdm_model_drop_keys_host(m->seed, m->n_train_fwd, h, row, B, m->drop_keys);
    free(copy);
    m->n_train_fwd++;
    return TDM_STATUS_OK;
}

void tdm_model_drop_keys_host(uint64_t seed, int64_t forwards, const void *x,
                              size_t row_bytes, int B, uint64_t *keys)
{
    const unsigned char *h = x;
    uint64_t base = tdm_drop_mix(seed ^ tdm_drop_mix((uint64_t)forwards));
    for (int b = 0; b < B; b++) {
        uint64_t f = 0xcbf29ce484222325ull;   /* FNV-1a over the sample's bytes */
        const unsigned char *p = h + (size_t)b * row_bytes;
        for (size_t i = 0; i < row_bytes; i++) f = (f ^ p[i]) * 0x100000001b3ull;
        keys[b] = tdm_drop_mix(base ^ f);
    }
}

void tdm_model_drop_cols(const uint64_t *keys, int op, float p, int B, int64_t j0, int64_t n,
                         const float *src, float *dst)
{
    uint64_t thr = (uint64_t)((double)p * (double)(1 << 24));
    float scale = 1.0f / (1.0f - p);
    for (int b = 0; b < B; b++) {
        uint64_t k = keys[b] ^ tdm_drop_mix((uint64_t)op);
        for (int64_t q = 0; q < n; q++) {
            uint64_t j = (uint64_t)(j0 + q);
            int keep = (tdm_drop_mix(k + (j + 1) * TDM_DROP_GOLDEN) >> 40) >= thr;
            dst[b * n + q] = keep ? src[b * n + q] * scale : 0.0f;
        }
    }
}

/* dst = src * mask / (1 - p) over a (C, B, HW) tensor; the op's index
 * in the spec separates the masks of different dropout layers. */
static void tdm_drop_apply(const tdm_model *m, const tdm_layer *l, const float *src, float *dst,
                           int B)
{
    int64_t hw = (int64_t)l->h * l->w;
    uint64_t thr = (uint64_t)((double)l->p * (double)(1 << 24));
    float scale = 1.0f / (1.0f - l->p);
    for (int ch = 0; ch < l->c; ch++)
        for (int b = 0; b < B; b++) {
            uint64_t k = m->drop_keys[b] ^ tdm_drop_mix((uint64_t)l->op);
            int64_t o = ((int64_t)ch * B + b) * hw;
            for (int64_t q = 0; q < hw; q++) {
                uint64_t j = (uint64_t)(l->j0 + ch * hw + q);
                int keep = (tdm_drop_mix(k + (j + 1) * TDM_DROP_GOLDEN) >> 40) >= thr;
                dst[o + q] = keep ? src[o + q] * scale : 0.0f;
            }
        }
}

/* Runs the mask on the host (staging through host copies on other
 * devices). */
static tdm_status tdm_drop_run(tdm_model *m, tdm_layer *l, const float *src, float *dst, int B)
{
    size_t nb = (size_t)B * (size_t)l->out_elems * sizeof(float);
    if (tdm_dev_kind(m->dev) == TDM_DEVICE_HOST) {
        tdm_drop_apply(m, l, src, dst, B);
        return TDM_STATUS_OK;
    }
    float *h = malloc(nb ? nb : 1);
    TDM_REQUIRE(h, TDM_STATUS_OUT_OF_MEMORY, "dropout: cannot stage %zu bytes", nb);
    tdm_status st = tdm_dev_copy_to_host(m->dev, h, src, nb);
    if (st == TDM_STATUS_OK) {
        tdm_drop_apply(m, l, h, h, B);
        st = tdm_dev_copy_from_host(m->dev, dst, h, nb);
    }
    free(h);
    return st;
}

static tdm_status tdm_seq_drop_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    l->in = x;
    if (!m->train || l->p == 0.0f)
        return tdm_dev_copy(m->dev, l->out, x, (size_t)B * (size_t)l->out_elems * sizeof(float));
    return tdm_drop_run(m, l, x, l->out, B);
}

static tdm_status tdm_seq_drop_backward(tdm_model *m, tdm_layer *l, const float *dout,
                                        float *din, int B)
{
    if (!din) return TDM_STATUS_OK;
    if (!m->train || l->p == 0.0f)
        return tdm_dev_copy(m->dev, din, dout, (size_t)B * (size_t)l->out_elems * sizeof(float));
    return tdm_drop_run(m, l, dout, din, B);
}
