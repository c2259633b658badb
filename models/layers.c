/* models/layers.c: forward and backward of one layer of the MLP and CNN
 * models over device memory: linear (optionally with a fused relu),
 * conv2d (im2col + gemm over chunks of the batch, no bias: batchnorm
 * follows),
 * batchnorm2d (optionally with a fused relu), maxpool2d, flatten and the
 * input's NCHW -> CNHW. Every product is the device's gemm, everything
 * else a device kernel (core/device.h). models/model.c builds the layers
 * and walks them; the GPT's layers are models/layers_gpt.c. */
#include "models/model_impl.h"

/* torch.nn.BatchNorm2d's defaults */
#define TDM_BN_EPS 1e-5f
#define TDM_BN_MOMENTUM 0.1f

static tdm_conv_geom tdm_layer_geom(const tdm_layer *l, int batch)
{
    return (tdm_conv_geom){.n = batch, .c = l->c, .h = l->h, .w = l->w, .kh = l->k, .kw = l->k,
                           .stride = l->stride, .pad = l->pad, .oh = l->oh, .ow = l->ow};
}

/* A conv layer's chunk of images [n0, n0 + nb) of a batch of B: the
 * im2col geometry over the chunk, in place in the batch's CNHW tensors. */
static tdm_conv_geom tdm_layer_chunk_geom(const tdm_layer *l, int nb, int B)
{
    tdm_conv_geom g = tdm_layer_geom(l, nb);
    g.ns = B;
    return g;
}

static float *tdm_param(tdm_model *m, int i) { return tdm_model_pdata(m, i); }
static float *tdm_grad(tdm_model *m, int i) { return tdm_model_gdata(m, i); }
static float *tdm_buffer(tdm_model *m, int i) { return m->buffers + m->buffers_info[i].offset; }

/* A convolution runs in chunks of l->chunk images so that the chunk's col
 * (written by im2col, read by the gemms) and its gradient (written by a
 * gemm, read by col2im) stay in cache: over the whole batch they were
 * tens of MB each, written and read through memory. Column-major gemm
 * arguments (tdm_dev_gemm), since a chunk's columns of out and dout are a
 * slice of rows of length np = B*oh*ow: row-major (oc, np) read
 * column-major is (np, oc) with ld np, and the chunk starts n0*oh*ow in.
 * col (kk, cn) row-major is (cn, kk) column-major with ld cn, W (oc, kk)
 * is (kk, oc) with ld kk. */
tdm_status tdm_layer_conv_fwd(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    tdm_device *d = m->dev;
    int kk = l->c * l->k * l->k, per = l->oh * l->ow, np = B * per;
    int64_t in_plane = (int64_t)l->h * l->w;
    const float *w = tdm_param(m, l->p0);
    for (int n0 = 0; n0 < B; n0 += l->chunk) {
        int nb = B - n0 < l->chunk ? B - n0 : l->chunk, cn = nb * per;
        tdm_conv_geom g = tdm_layer_chunk_geom(l, nb, B);
        TDM_CHECK(tdm_dev_im2col(d, &g, x + n0 * in_plane, m->col));
        /* out[:, chunk] (oc, cn) = W (oc, kk) col (kk, cn), i.e.
         * out^T (cn, oc) = col^T (cn, kk) W^T (kk, oc); 16-bit
         * precisions: the chunk's col rounded, the weights' copy */
        if (tdm_model_low(m)) {
            TDM_CHECK(tdm_dev_convert(d, m->col16, m->lev.adt, m->col, TDM_DTYPE_FLOAT32,
                                      (int64_t)cn * kk));
            TDM_CHECK(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, cn, l->oc, kk, 1.0f, m->col16,
                                      cn, tdm_model_wlow(m, l->p0), kk, 0.0f,
                                      l->out + (int64_t)n0 * per, np, m->lev.adt));
            continue;
        }
        TDM_CHECK(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, cn, l->oc, kk, 1.0f, m->col, cn, w,
                               kk, 0.0f, l->out + (int64_t)n0 * per, np));
    }
    return TDM_STATUS_OK;
}

/* The conv backward of 16-bit precisions: dout rounded once for the
 * products (whole, since chunks are column slices of it), each chunk's
 * col rounded from the widened input (l->in, restored by the caller),
 * the weight gradient summed in float32 straight into dW. */
static tdm_status tdm_layer_conv_backward_low(tdm_model *m, tdm_layer *l, const float *dout,
                                              float *din, int B)
{
    tdm_device *d = m->dev;
    int kk = l->c * l->k * l->k, per = l->oh * l->ow, np = B * per;
    int64_t in_plane = (int64_t)l->h * l->w;
    size_t es = tdm_dtype_size(m->lev.adt);
    const void *w16 = tdm_model_wlow(m, l->p0);
    float *dw = tdm_grad(m, l->p0);
    TDM_CHECK(tdm_dev_convert(d, m->d16, m->lev.adt, dout, TDM_DTYPE_FLOAT32, (int64_t)l->oc * np));
    for (int n0 = 0; n0 < B; n0 += l->chunk) {
        int nb = B - n0 < l->chunk ? B - n0 : l->chunk, cn = nb * per;
        const char *d16 = (const char *)m->d16 + (size_t)n0 * per * es;
        tdm_conv_geom g = tdm_layer_chunk_geom(l, nb, B);
        TDM_CHECK(tdm_dev_im2col(d, &g, l->in + n0 * in_plane, m->col));
        TDM_CHECK(tdm_dev_convert(d, m->col16, m->lev.adt, m->col, TDM_DTYPE_FLOAT32,
                                  (int64_t)cn * kk));
        TDM_CHECK(tdm_dev_gemm_ex(d, TDM_TRANS_T, TDM_TRANS_N, kk, l->oc, cn, 1.0f, m->col16, cn,
                                  d16, np, 1.0f, dw, kk, m->lev.adt));
        if (!din) continue;
        TDM_CHECK(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_T, cn, kk, l->oc, 1.0f, d16, np, w16,
                                  kk, 0.0f, m->col, cn, m->lev.adt));
        TDM_CHECK(tdm_dev_col2im(d, &g, m->col, din + n0 * in_plane));
    }
    return TDM_STATUS_OK;
}

/* A tensor-parallel layer's partial sum (tdm_model_set_partial_sums)
 * summed over the group through the model's callback. */
static tdm_status tdm_layer_partial_sum(tdm_model *m, tdm_layer *l, float *buf, int64_t n)
{
    return m->partial(m->partial_ctx, buf, n, (int)(l - m->layers));
}

/* The linear backward of 16-bit precisions, after the relu mask: dout
 * rounded for the two products (dW summed in float32 into the gradient),
 * the bias gradient from the float32 dout as in FP32. */
static tdm_status tdm_layer_linear_backward_low(tdm_model *m, tdm_layer *l, const float *dout,
                                                float *din, int B)
{
    tdm_device *d = m->dev;
    tdm_dtype t = m->lev.adt;
    TDM_CHECK(tdm_dev_convert(d, m->d16, t, dout, TDM_DTYPE_FLOAT32, (int64_t)B * l->oc));
    TDM_CHECK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_T, TDM_TRANS_N, l->oc, l->c, B, 1.0f, m->d16, l->oc,
                                 l->in16, l->c, 1.0f, tdm_grad(m, l->p0), l->c, t));
    TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, 1, l->oc, B, 1.0f, m->ones, dout, 1.0f,
                              tdm_grad(m, l->p0 + 1)));
    if (din)
        TDM_CHECK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_N, TDM_TRANS_N, B, l->c, l->oc, 1.0f, m->d16,
                                     l->oc, tdm_model_wlow(m, l->p0), l->c, 0.0f, din, l->c, t));
    /* column parallel: a partial sum, as in float32 */
    if (din && l->partial == TDM_MODEL_PARTIAL_IN && m->partial)
        TDM_CHECK(tdm_layer_partial_sum(m, l, din, (int64_t)B * l->c));
    return TDM_STATUS_OK;
}

tdm_status tdm_layer_conv_bwd(tdm_model *m, tdm_layer *l, const float *dout, float *din, int B)
{
    if (tdm_model_low(m)) return tdm_layer_conv_backward_low(m, l, dout, din, B);
    tdm_device *d = m->dev;
    int kk = l->c * l->k * l->k, per = l->oh * l->ow, np = B * per;
    int64_t in_plane = (int64_t)l->h * l->w;
    const float *w = tdm_param(m, l->p0);
    float *dw = tdm_grad(m, l->p0);
    for (int n0 = 0; n0 < B; n0 += l->chunk) {
        int nb = B - n0 < l->chunk ? B - n0 : l->chunk, cn = nb * per;
        const float *dout_c = dout + (int64_t)n0 * per;
        tdm_conv_geom g = tdm_layer_chunk_geom(l, nb, B);
        /* the forward's col of this chunk, again: cheaper from cache than
         * the whole batch's kept through memory */
        TDM_CHECK(tdm_dev_im2col(d, &g, l->in + n0 * in_plane, m->col));
        /* dW (oc, kk) += dout[:, chunk] (oc, cn) col^T (cn, kk), i.e.
         * dW^T (kk, oc) += col (kk, cn) dout[:, chunk]^T (cn, oc); the
         * sum over the batch's columns runs chunk by chunk */
        TDM_CHECK(tdm_dev_gemm(d, TDM_TRANS_T, TDM_TRANS_N, kk, l->oc, cn, 1.0f, m->col, cn,
                               dout_c, np, 1.0f, dw, kk));
        if (!din) continue;
        /* dcol (kk, cn) = W^T (kk, oc) dout[:, chunk] (oc, cn), i.e.
         * dcol^T (cn, kk) = dout[:, chunk]^T (cn, oc) W (oc, kk), over the
         * chunk's col, which dW has used */
        TDM_CHECK(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_T, cn, kk, l->oc, 1.0f, dout_c, np, w,
                               kk, 0.0f, m->col, cn));
        TDM_CHECK(tdm_dev_col2im(d, &g, m->col, din + n0 * in_plane));
    }
    return TDM_STATUS_OK;
}

/* ---- batchnorm and max pooling over a range of channels ----
 * Both work channel by channel on CNHW rows (channel ch owns B*h*w
 * contiguous floats), so channels [c0, c1) are the same kernels over a
 * slice of every tensor and per-channel array: the same values as over
 * all channels at once, bit for bit. tdm_model_pair_* below run a
 * batchnorm and the max pooling after it one channel at a time, so that
 * the channel's row stays in cache from the batchnorm's first read to
 * the pooling's. */

static tdm_status tdm_layer_bn_check(const tdm_model *m, const tdm_layer *l, int B)
{
    int64_t len = (int64_t)B * l->h * l->w;
    TDM_REQUIRE(!m->train || len > 1, TDM_STATUS_INVALID_ARG,
                "batchnorm in training mode needs more than 1 value per channel "
                "(batch %d of %dx%d images)", B, l->h, l->w);
    return TDM_STATUS_OK;
}

static tdm_status tdm_layer_bn_forward(tdm_model *m, tdm_layer *l, const float *x, int B, int c0,
                                       int c1)
{
    tdm_device *d = m->dev;
    int nc = c1 - c0;
    int64_t len = (int64_t)B * l->h * l->w, off = (int64_t)c0 * len;
    /* a checkpointed segment's forward again (models/recompute.c): the
     * statistics of this batch are those its forward computed, and the
     * running ones were updated then */
    if (!m->lev.recomputing) {
        if (m->train) TDM_CHECK(tdm_dev_bn_stats(d, x + off, nc, len, l->mean + c0, l->var + c0));
        TDM_CHECK(tdm_dev_bn_prep(d, nc, l->mean + c0, l->var + c0, l->invstd + c0,
                                  tdm_buffer(m, l->b0) + c0, tdm_buffer(m, l->b0 + 1) + c0,
                                  TDM_BN_EPS, TDM_BN_MOMENTUM, len, m->train));
    }
    TDM_CHECK(tdm_dev_bn_fwd(d, x + off, nc, len, l->mean + c0, l->invstd + c0,
                             tdm_param(m, l->p0) + c0, tdm_param(m, l->p0 + 1) + c0,
                             l->out + off));
    if (l->relu)
        TDM_CHECK(tdm_dev_bias_act(d, l->out + off, NULL, nc, (int)len, TDM_ACT_RELU));
    return TDM_STATUS_OK;
}

/* dout's channels [c0, c1) are modified in place (the fused relu, unless
 * relu_done: the caller masked dout already). */
static tdm_status tdm_layer_bn_backward(tdm_model *m, tdm_layer *l, float *dout, float *din,
                                        int B, int c0, int c1, int relu_done)
{
    tdm_device *d = m->dev;
    int nc = c1 - c0;
    int64_t len = (int64_t)B * l->h * l->w, off = (int64_t)c0 * len;
    if (l->relu && !relu_done)
        TDM_CHECK(tdm_dev_relu_bwd(d, dout + off, l->out + off, nc * len));
    return tdm_dev_bn_bwd(d, l->in + off, dout + off, nc, len, l->mean + c0, l->invstd + c0,
                          tdm_param(m, l->p0) + c0, din ? din + off : NULL,
                          tdm_grad(m, l->p0) + c0, tdm_grad(m, l->p0 + 1) + c0, m->train);
}

/* argmax holds offsets within each input plane, so a range of channels
 * is a geometry of fewer channels at the range's planes. */
static tdm_status tdm_layer_pool_forward(tdm_model *m, tdm_layer *l, const float *x, int B,
                                         int c0, int c1)
{
    tdm_conv_geom g = tdm_layer_geom(l, B);
    g.c = c1 - c0;
    int64_t in_off = (int64_t)c0 * B * l->h * l->w, out_off = (int64_t)c0 * B * l->oh * l->ow;
    return tdm_dev_maxpool_fwd(m->dev, &g, x + in_off, l->out + out_off, l->argmax + out_off);
}

static tdm_status tdm_layer_pool_backward(tdm_model *m, tdm_layer *l, const float *dout,
                                          float *din, int B, int c0, int c1)
{
    tdm_conv_geom g = tdm_layer_geom(l, B);
    g.c = c1 - c0;
    int64_t in_off = (int64_t)c0 * B * l->h * l->w, out_off = (int64_t)c0 * B * l->oh * l->ow;
    return tdm_dev_maxpool_bwd(m->dev, &g, dout + out_off, l->argmax + out_off, din + in_off);
}

int tdm_model_pair_fuses(const tdm_model *m, int i)
{
    if (i < 0 || i + 1 >= m->n_layers) return 0;
    const tdm_layer *bn = &m->layers[i], *pool = &m->layers[i + 1];
    /* on GPUs one kernel over all channels beats one per channel; a
     * SyncBatchNorm's statistics are all-reduced for all channels at once */
    /* in 16-bit precisions the batchnorm's output is rounded before the
     * pooling reads it: one layer after the other */
    if (!(tdm_dev_kind(m->dev) == TDM_DEVICE_HOST && !tdm_model_low(m) &&
          bn->kind == TDM_LAYER_BN && pool->kind == TDM_LAYER_MAXPOOL && pool->c == bn->c &&
          !(m->train && m->sync_bn)))
        return 0;
    /* a residual block whose input is the batchnorm's output (the
     * pooling's input) needs that gradient on its own, which the fused
     * backward never forms: one layer after the other then */
    for (int r = i + 1; r < m->n_layers; r++)
        if (m->layers[r].kind == TDM_LAYER_RES && m->layers[r].skip == i) return 0;
    return 1;
}

tdm_status tdm_model_pair_forward(tdm_model *m, tdm_layer *bn, tdm_layer *pool, const float *x,
                                  int B)
{
    bn->in = x;
    pool->in = bn->out;
    TDM_CHECK(tdm_layer_bn_check(m, bn, B));
    for (int ch = 0; ch < bn->c; ch++) {
        TDM_CHECK(tdm_layer_bn_forward(m, bn, x, B, ch, ch + 1));
        TDM_CHECK(tdm_layer_pool_forward(m, pool, bn->out, B, ch, ch + 1));
    }
    return TDM_STATUS_OK;
}

/* dout is the pooling's output gradient (modified in place), dmid its
 * input gradient (the batchnorm's output gradient), din the batchnorm's
 * input gradient (NULL: not needed). din may be dout's buffer, as the
 * model's backward alternates two: channels then run from the last, since
 * channel ch of din covers channels >= ch of dout (a pooling's output
 * plane is no larger than its input plane), which are read by then.
 *
 * The batchnorm's relu backward masks dmid by relu output > 0. dmid is dout
 * at each window's winner and 0 elsewhere, and the winner's value is the
 * pooling's output, so masking dout by pooling output > 0 before the
 * pooling's backward gives the same bits (a masked element becomes the
 * same +0 either way) over a quarter of the elements. */
tdm_status tdm_model_pair_backward(tdm_model *m, tdm_layer *bn, tdm_layer *pool, float *dout,
                                   float *dmid, float *din, int B)
{
    int64_t per_ch = (int64_t)B * pool->oh * pool->ow;
    for (int ch = bn->c - 1; ch >= 0; ch--) {
        if (bn->relu)
            TDM_CHECK(tdm_dev_relu_bwd(m->dev, dout + ch * per_ch, pool->out + ch * per_ch, per_ch));
        TDM_CHECK(tdm_layer_pool_backward(m, pool, dout, dmid, B, ch, ch + 1));
        TDM_CHECK(tdm_layer_bn_backward(m, bn, dmid, din, B, ch, ch + 1, 1));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_model_layer_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    tdm_device *d = m->dev;
    l->in = x;
    switch (l->kind) {
    case TDM_LAYER_LINEAR:
        /* out (B, oc) = x (B, c) W^T, W (oc, c); in 16-bit precisions
         * from the rounded input and weights */
        if (tdm_model_low(m))
            TDM_CHECK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_N, TDM_TRANS_T, B, l->oc, l->c, 1.0f, l->in16,
                                         l->c, tdm_model_wlow(m, l->p0), l->c, 0.0f, l->out, l->oc,
                                         m->lev.adt));
        else
            TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_T, B, l->oc, l->c, 1.0f, x,
                                      tdm_param(m, l->p0), 0.0f, l->out));
        /* row parallel: the group's sum before the bias and activation */
        if (l->partial == TDM_MODEL_PARTIAL_OUT && m->partial)
            TDM_CHECK(tdm_layer_partial_sum(m, l, l->out, (int64_t)B * l->oc));
        return tdm_dev_bias_act(d, l->out, tdm_param(m, l->p0 + 1), B, l->oc,
                                l->relu ? TDM_ACT_RELU : TDM_ACT_NONE);
    case TDM_LAYER_CONV:
        /* out (oc, B*oh*ow) = W (oc, c*k*k) col (c*k*k, B*oh*ow), by chunks */
        return tdm_layer_conv_fwd(m, l, x, B);
    case TDM_LAYER_BN:
        if (m->train && m->sync_bn && !m->lev.recomputing) return tdm_syncbn_forward(m, l, x, B);
        TDM_CHECK(tdm_layer_bn_check(m, l, B));
        return tdm_layer_bn_forward(m, l, x, B, 0, l->c);
    case TDM_LAYER_MAXPOOL:
        return tdm_layer_pool_forward(m, l, x, B, 0, l->c);
    case TDM_LAYER_FLATTEN:
        return tdm_dev_cnhw_to_nchw(d, x, l->out, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_TO_CNHW:
        return tdm_dev_nchw_to_cnhw(d, x, l->out, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_ACT:
    case TDM_LAYER_AVGPOOL:
    case TDM_LAYER_RES:
    case TDM_LAYER_DROPOUT:
    case TDM_LAYER_LN:
        return tdm_seq_layer_forward(m, l, x, B);
    case TDM_LAYER_GROUP:
        break;   /* a vt model's: never run here */
    }
    return tdm_error_set(TDM_STATUS_INTERNAL, "unknown layer kind %d", (int)l->kind);
}

/* dout (B, out) may be modified in place (fused relu). din may be NULL for
 * the layers up to the first with parameters: nobody needs their input
 * gradient. */
tdm_status tdm_model_layer_backward(tdm_model *m, tdm_layer *l, float *dout, float *din,
                                    int B)
{
    tdm_device *d = m->dev;
    switch (l->kind) {
    case TDM_LAYER_LINEAR:
        if (l->relu) TDM_CHECK(tdm_dev_relu_bwd(d, dout, l->out, (int64_t)B * l->oc));
        if (tdm_model_low(m)) return tdm_layer_linear_backward_low(m, l, dout, din, B);
        /* dW (oc, c) += dout^T (oc, B) x (B, c) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_T, TDM_TRANS_N, l->oc, l->c, B, 1.0f, dout, l->in,
                                  1.0f, tdm_grad(m, l->p0)));
        /* db (1, oc) += ones (1, B) dout (B, oc) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, 1, l->oc, B, 1.0f, m->ones, dout,
                                  1.0f, tdm_grad(m, l->p0 + 1)));
        /* din (B, c) = dout (B, oc) W (oc, c); column parallel: a partial
         * sum over the group's output slices */
        if (din)
            TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, B, l->c, l->oc, 1.0f, dout,
                                      tdm_param(m, l->p0), 0.0f, din));
        if (din && l->partial == TDM_MODEL_PARTIAL_IN && m->partial)
            TDM_CHECK(tdm_layer_partial_sum(m, l, din, (int64_t)B * l->c));
        return TDM_STATUS_OK;
    case TDM_LAYER_CONV:
        /* dW (oc, kk) += dout (oc, np) col^T (np, kk); din = col2im(W^T dout) */
        return tdm_layer_conv_bwd(m, l, dout, din, B);
    case TDM_LAYER_BN:
        if (m->train && m->sync_bn) {
            int64_t len = (int64_t)B * l->h * l->w;
            if (l->relu) TDM_CHECK(tdm_dev_relu_bwd(d, dout, l->out, len * l->c));
            return tdm_syncbn_backward(m, l, dout, din, B);
        }
        return tdm_layer_bn_backward(m, l, dout, din, B, 0, l->c, 0);
    case TDM_LAYER_MAXPOOL:
        if (!din) return TDM_STATUS_OK;
        return tdm_layer_pool_backward(m, l, dout, din, B, 0, l->c);
    case TDM_LAYER_FLATTEN:
        if (!din) return TDM_STATUS_OK;
        return tdm_dev_nchw_to_cnhw(d, dout, din, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_TO_CNHW:
        if (!din) return TDM_STATUS_OK;
        return tdm_dev_cnhw_to_nchw(d, dout, din, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_ACT:
    case TDM_LAYER_AVGPOOL:
    case TDM_LAYER_RES:
    case TDM_LAYER_DROPOUT:
    case TDM_LAYER_LN:
        return tdm_seq_layer_backward(m, l, dout, din, B);
    case TDM_LAYER_GROUP:
        break;
    }
    return tdm_error_set(TDM_STATUS_INTERNAL, "unknown layer kind %d", (int)l->kind);
}
