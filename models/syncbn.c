/* models/syncbn.c: SyncBatchNorm's arithmetic (see tdm_model_set_sync_bn
 * in models/model.h): a batchnorm layer's training forward and backward
 * whose per-channel sums are completed over all replicas by the model's
 * callback, with the same two-pass, double-precision statistics as the
 * local kernels (core/kernels.h), so the group computes what one device
 * computes on the union of the batches up to the order of the sums. Not
 * a communicator: the callback is DDP's. Host memory only. */
#include <math.h>
#include <stdlib.h>

#include "core/kernels.h"
#include "models/model_impl.h"

#define TDM_SYNCBN_EPS 1e-5f       /* as model.c's batchnorm */
#define TDM_SYNCBN_MOMENTUM 0.1f

static tdm_status tdm_syncbn_check(const tdm_model *m)
{
    TDM_REQUIRE(m->dev->kind == TDM_DEVICE_HOST, TDM_STATUS_UNSUPPORTED,
                "SyncBatchNorm runs on host devices only (the model is on %s)", m->dev->name);
    return TDM_STATUS_OK;
}

tdm_status tdm_syncbn_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    TDM_CHECK(tdm_syncbn_check(m));
    int C = l->c;
    int64_t len = (int64_t)B * l->h * l->w;
    double *v = malloc((size_t)(C + 1) * sizeof *v);
    TDM_REQUIRE(v, TDM_STATUS_OUT_OF_MEMORY, "SyncBatchNorm: %d channels", C);
    tdm_status st;
    /* pass 1: sums and the count -> the global mean */
    for (int ch = 0; ch < C; ch++) v[ch] = tdm_k_bn_sum_part(x + (int64_t)ch * len, len, 0, 1);
    v[C] = (double)len;
    if ((st = m->sync_bn(m->sync_bn_ctx, v, C + 1))) goto fail;
    int64_t n = (int64_t)v[C];
    if (n <= 1) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "SyncBatchNorm needs more than 1 value per "
                           "channel over all replicas (got %lld)", (long long)n);
        goto fail;
    }
    for (int ch = 0; ch < C; ch++) l->mean[ch] = (float)(v[ch] / (double)n);
    /* pass 2: squared deviations from that mean, in double as locally */
    for (int ch = 0; ch < C; ch++) v[ch] = v[ch] / (double)n;
    for (int ch = 0; ch < C; ch++)
        v[ch] = tdm_k_bn_sqdev_part(x + (int64_t)ch * len, len, v[ch], 0, 1);
    if ((st = m->sync_bn(m->sync_bn_ctx, v, C))) goto fail;
    for (int ch = 0; ch < C; ch++) l->var[ch] = (float)(v[ch] / (double)n);
    float *run_mean = m->buffers + m->buffers_info[l->b0].offset;
    float *run_var = m->buffers + m->buffers_info[l->b0 + 1].offset;
    const float *gamma = m->params + m->params_info[l->p0].offset;
    const float *beta = m->params + m->params_info[l->p0 + 1].offset;
    for (int ch = 0; ch < C; ch++)
        tdm_k_bn_prep_ch(ch, l->mean, l->var, l->invstd, run_mean, run_var, TDM_SYNCBN_EPS,
                         TDM_SYNCBN_MOMENTUM, n, 1);
    for (int ch = 0; ch < C; ch++)
        for (int64_t j = 0; j < len; j++)
            tdm_k_bn_fwd((int64_t)ch * len + j, ch, x, l->mean, l->invstd, gamma, beta, l->out);
    if (l->relu)
        for (int64_t i = 0; i < len * C; i++)
            if (l->out[i] < 0.0f) l->out[i] = 0.0f;
    st = TDM_STATUS_OK;
fail:
    free(v);
    return st;
}

tdm_status tdm_syncbn_backward(tdm_model *m, tdm_layer *l, const float *dout, float *din, int B)
{
    TDM_CHECK(tdm_syncbn_check(m));
    int C = l->c;
    int64_t len = (int64_t)B * l->h * l->w;
    double *v = malloc((size_t)(2 * C + 1) * sizeof *v);
    TDM_REQUIRE(v, TDM_STATUS_OUT_OF_MEMORY, "SyncBatchNorm: %d channels", C);
    const float *gamma = m->params + m->params_info[l->p0].offset;
    float *dgamma = m->grads + m->params_info[l->p0].offset;
    float *dbeta = m->grads + m->params_info[l->p0 + 1].offset;
    for (int ch = 0; ch < C; ch++) {
        double sdy, sdyx;
        tdm_k_bn_bwd_part(l->in + (int64_t)ch * len, dout + (int64_t)ch * len, len, l->mean[ch],
                          l->invstd[ch], 0, 1, &sdy, &sdyx);
        /* this replica's share of the parameter gradients (DDP sums them) */
        tdm_k_bn_bwd_params(ch, sdy, sdyx, dgamma, dbeta);
        v[ch] = sdy;
        v[C + ch] = sdyx;
    }
    v[2 * C] = (double)len;
    tdm_status st = m->sync_bn(m->sync_bn_ctx, v, 2 * C + 1);
    if (st == TDM_STATUS_OK && din) {
        int64_t n = (int64_t)v[2 * C];   /* the global count of the forward */
        for (int ch = 0; ch < C; ch++) {
            const float *xr = l->in + (int64_t)ch * len, *dyr = dout + (int64_t)ch * len;
            float *dxr = din + (int64_t)ch * len;
            for (int64_t j = 0; j < len; j++)
                tdm_k_bn_bwd_dx(j, xr, dyr, dxr, l->mean[ch], l->invstd[ch], gamma[ch], n,
                                v[ch], v[C + ch], 1);
        }
    }
    free(v);
    return st;
}
