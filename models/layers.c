/* models/layers.c: forward and backward of one layer of the MLP and CNN
 * models over device memory: linear (optionally with a fused relu),
 * conv2d (im2col + one gemm per batch, no bias: batchnorm follows),
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

static float *tdm_param(tdm_model *m, int i) { return m->params + m->params_info[i].offset; }
static float *tdm_grad(tdm_model *m, int i) { return m->grads + m->params_info[i].offset; }
static float *tdm_buffer(tdm_model *m, int i) { return m->buffers + m->buffers_info[i].offset; }

tdm_status tdm_model_layer_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    tdm_device *d = m->dev;
    l->in = x;
    switch (l->kind) {
    case TDM_LAYER_LINEAR:
        /* out (B, oc) = x (B, c) W^T, W (oc, c) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_T, B, l->oc, l->c, 1.0f, x,
                                  tdm_param(m, l->p0), 0.0f, l->out));
        return tdm_dev_bias_act(d, l->out, tdm_param(m, l->p0 + 1), B, l->oc,
                                l->relu ? TDM_ACT_RELU : TDM_ACT_NONE);
    case TDM_LAYER_CONV: {
        tdm_conv_geom g = tdm_layer_geom(l, B);
        TDM_CHECK(tdm_dev_im2col(d, &g, x, l->col));
        /* out (oc, B*oh*ow) = W (oc, c*k*k) col (c*k*k, B*oh*ow) */
        return tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, l->oc, B * l->oh * l->ow,
                               l->c * l->k * l->k, 1.0f, tdm_param(m, l->p0), l->col, 0.0f,
                               l->out);
    }
    case TDM_LAYER_BN: {
        int64_t len = (int64_t)B * l->h * l->w;
        if (m->train) {
            TDM_REQUIRE(len > 1, TDM_STATUS_INVALID_ARG,
                        "batchnorm in training mode needs more than 1 value per channel "
                        "(batch %d of %dx%d images)", B, l->h, l->w);
            TDM_CHECK(tdm_dev_bn_stats(d, x, l->c, len, l->mean, l->var));
        }
        TDM_CHECK(tdm_dev_bn_prep(d, l->c, l->mean, l->var, l->invstd, tdm_buffer(m, l->b0),
                                  tdm_buffer(m, l->b0 + 1), TDM_BN_EPS, TDM_BN_MOMENTUM, len,
                                  m->train));
        TDM_CHECK(tdm_dev_bn_fwd(d, x, l->c, len, l->mean, l->invstd, tdm_param(m, l->p0),
                                 tdm_param(m, l->p0 + 1), l->out));
        if (l->relu) TDM_CHECK(tdm_dev_bias_act(d, l->out, NULL, l->c, (int)len, TDM_ACT_RELU));
        return TDM_STATUS_OK;
    }
    case TDM_LAYER_MAXPOOL: {
        tdm_conv_geom g = tdm_layer_geom(l, B);
        return tdm_dev_maxpool_fwd(d, &g, x, l->out, l->argmax);
    }
    case TDM_LAYER_FLATTEN:
        return tdm_dev_cnhw_to_nchw(d, x, l->out, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_TO_CNHW:
        return tdm_dev_nchw_to_cnhw(d, x, l->out, l->c, B, (int64_t)l->h * l->w);
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
        /* dW (oc, c) += dout^T (oc, B) x (B, c) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_T, TDM_TRANS_N, l->oc, l->c, B, 1.0f, dout, l->in,
                                  1.0f, tdm_grad(m, l->p0)));
        /* db (1, oc) += ones (1, B) dout (B, oc) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, 1, l->oc, B, 1.0f, m->ones, dout,
                                  1.0f, tdm_grad(m, l->p0 + 1)));
        /* din (B, c) = dout (B, oc) W (oc, c) */
        if (din)
            TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, B, l->c, l->oc, 1.0f, dout,
                                      tdm_param(m, l->p0), 0.0f, din));
        return TDM_STATUS_OK;
    case TDM_LAYER_CONV: {
        int kk = l->c * l->k * l->k, np = B * l->oh * l->ow;
        /* dW (oc, kk) += dout (oc, np) col^T (np, kk) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_T, l->oc, kk, np, 1.0f, dout, l->col,
                                  1.0f, tdm_grad(m, l->p0)));
        if (!din) return TDM_STATUS_OK;
        /* dcol (kk, np) = W^T (kk, oc) dout (oc, np) */
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_T, TDM_TRANS_N, kk, np, l->oc, 1.0f,
                                  tdm_param(m, l->p0), dout, 0.0f, m->dcol));
        tdm_conv_geom g = tdm_layer_geom(l, B);
        return tdm_dev_col2im(d, &g, m->dcol, din);
    }
    case TDM_LAYER_BN: {
        int64_t len = (int64_t)B * l->h * l->w;
        if (l->relu) TDM_CHECK(tdm_dev_relu_bwd(d, dout, l->out, len * l->c));
        return tdm_dev_bn_bwd(d, l->in, dout, l->c, len, l->mean, l->invstd, tdm_param(m, l->p0),
                              din, tdm_grad(m, l->p0), tdm_grad(m, l->p0 + 1), m->train);
    }
    case TDM_LAYER_MAXPOOL: {
        if (!din) return TDM_STATUS_OK;
        tdm_conv_geom g = tdm_layer_geom(l, B);
        return tdm_dev_maxpool_bwd(d, &g, dout, l->argmax, din);
    }
    case TDM_LAYER_FLATTEN:
        if (!din) return TDM_STATUS_OK;
        return tdm_dev_nchw_to_cnhw(d, dout, din, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_TO_CNHW:
        if (!din) return TDM_STATUS_OK;
        return tdm_dev_cnhw_to_nchw(d, dout, din, l->c, B, (int64_t)l->h * l->w);
    case TDM_LAYER_GROUP:
        break;
    }
    return tdm_error_set(TDM_STATUS_INTERNAL, "unknown layer kind %d", (int)l->kind);
}
