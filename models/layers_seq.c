/* models/layers_seq.c: forward and backward of the layers that model
 * files and the C builder add to the MLP's and CNN's (models/builder.c
 * builds them): an elementwise activation (relu, gelu, tanh, sigmoid),
 * average pooling, and the end of a residual block, which adds the
 * block's input (through a 1x1 convolution or a linear projection when
 * the shapes differ) to the block's output. The block's skip gradient is
 * kept in the layer's scratch until backward reaches the block's first
 * layer, where tdm_seq_skip_add adds it into that layer's input gradient.
 * Not here: the layers of the built-in models (models/layers.c). */
#include "models/model_impl.h"

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
