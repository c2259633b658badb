/* models/syncbn.c: SyncBatchNorm's arithmetic (see tdm_model_set_sync_bn
 * in models/model.h): a batchnorm layer's training forward and backward
 * whose per-channel sums are completed over all replicas by the model's
 * callback, with the same two-pass, double-precision statistics as the
 * local kernels (core/kernels.h), so the group computes what one device
 * computes on the union of the batches up to the order of the sums.
 *
 * The sums are taken on the host: on a host device in place, on an
 * accelerator through staging copies (the layer's input and output
 * gradient come to the host, the statistics and the input gradient go
 * back) - correct, not fast; the normalisation itself (bn_prep, bn_fwd)
 * runs on the device with the global statistics. Not a communicator: the
 * callback is DDP's. */
#include <math.h>
#include <stdlib.h>

#include "core/kernels.h"
#include "models/model_impl.h"

#define TDM_SYNCBN_EPS 1e-5f       /* as model.c's batchnorm */
#define TDM_SYNCBN_MOMENTUM 0.1f

/* A host view of n floats of device memory p: p itself on the host
 * device, else a copy (copy = 1 brings the values). *owned: to free. */
static tdm_status tdm_syncbn_view(tdm_device *d, const float *p, int64_t n, int copy,
                                  float **out, float **owned)
{
    *owned = NULL;
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
        *out = (float *)p;
        return TDM_STATUS_OK;
    }
    float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
    TDM_REQUIRE(h, TDM_STATUS_OUT_OF_MEMORY, "SyncBatchNorm: staging %lld floats",
                (long long)n);
    if (copy && n > 0) {
        tdm_status st = tdm_dev_copy_to_host(d, h, p, (size_t)n * sizeof *h);
        if (st) {
            free(h);
            return st;
        }
    }
    *out = h;
    *owned = h;
    return TDM_STATUS_OK;
}

/* Writes a host view back to device memory p (nothing on the host device). */
static tdm_status tdm_syncbn_back(tdm_device *d, float *p, const float *h, int64_t n)
{
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST || n == 0) return TDM_STATUS_OK;
    return tdm_dev_copy_from_host(d, p, h, (size_t)n * sizeof *h);
}

tdm_status tdm_syncbn_forward(tdm_model *m, tdm_layer *l, const float *x, int B)
{
    tdm_device *d = m->dev;
    int C = l->c;
    int64_t len = (int64_t)B * l->h * l->w;
    double *v = malloc((size_t)(C + 1) * sizeof *v);
    float *hx = NULL, *hx_own = NULL, *stat = malloc((size_t)2 * C * sizeof *stat);
    tdm_status st = TDM_STATUS_OK;
    if (!v || !stat) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "SyncBatchNorm: %d channels", C);
        goto fail;
    }
    if ((st = tdm_syncbn_view(d, x, (int64_t)C * len, 1, &hx, &hx_own))) goto fail;
    /* pass 1: sums and the count -> the global mean */
    for (int ch = 0; ch < C; ch++) v[ch] = tdm_k_bn_sum_part(hx + (int64_t)ch * len, len, 0, 1);
    v[C] = (double)len;
    if ((st = m->sync_bn(m->sync_bn_ctx, v, C + 1))) goto fail;
    int64_t n = (int64_t)v[C];
    if (n <= 1) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "SyncBatchNorm needs more than 1 value per "
                           "channel over all replicas (got %lld)", (long long)n);
        goto fail;
    }
    for (int ch = 0; ch < C; ch++) {
        v[ch] /= (double)n;
        stat[ch] = (float)v[ch];
    }
    /* pass 2: squared deviations from that mean, in double as locally */
    for (int ch = 0; ch < C; ch++)
        v[ch] = tdm_k_bn_sqdev_part(hx + (int64_t)ch * len, len, v[ch], 0, 1);
    if ((st = m->sync_bn(m->sync_bn_ctx, v, C))) goto fail;
    for (int ch = 0; ch < C; ch++) stat[C + ch] = (float)(v[ch] / (double)n);
    if ((st = tdm_dev_copy_from_host(d, l->mean, stat, (size_t)C * sizeof *stat)) ||
        (st = tdm_dev_copy_from_host(d, l->var, stat + C, (size_t)C * sizeof *stat)))
        goto fail;
    /* the device normalises with the global statistics; the running
     * variance's unbiased factor uses the global count */
    float *run_mean = m->buffers + m->buffers_info[l->b0].offset;
    float *run_var = m->buffers + m->buffers_info[l->b0 + 1].offset;
    const float *gamma = m->params + m->params_info[l->p0].offset;
    const float *beta = m->params + m->params_info[l->p0 + 1].offset;
    if ((st = tdm_dev_bn_prep(d, C, l->mean, l->var, l->invstd, run_mean, run_var,
                              TDM_SYNCBN_EPS, TDM_SYNCBN_MOMENTUM, n, 1)))
        goto fail;
    /* B = 0: a replica without samples (tdm_model_sync_bn_forward_empty)
     * took part in the sums and updated the running statistics; there is
     * nothing to normalise */
    if (len == 0) goto fail;
    if ((st = tdm_dev_bn_fwd(d, x, C, len, l->mean, l->invstd, gamma, beta, l->out)))
        goto fail;
    if (l->relu) st = tdm_dev_bias_act(d, l->out, NULL, C, (int)len, TDM_ACT_RELU);
fail:
    free(v);
    free(stat);
    free(hx_own);
    return st;
}

tdm_status tdm_syncbn_backward(tdm_model *m, tdm_layer *l, const float *dout, float *din, int B)
{
    tdm_device *d = m->dev;
    int C = l->c;
    int64_t len = (int64_t)B * l->h * l->w, nx = (int64_t)C * len;
    double *v = malloc((size_t)(2 * C + 1) * sizeof *v);
    float *hx = NULL, *hdy = NULL, *hdx = NULL, *hmean = NULL, *hinv = NULL, *hg = NULL;
    float *hdg = NULL, *hdb = NULL;
    float *own[8] = {0};
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(v, TDM_STATUS_OUT_OF_MEMORY, "SyncBatchNorm: %d channels", C);
    float *dgamma = m->grads + m->params_info[l->p0].offset;
    float *dbeta = m->grads + m->params_info[l->p0 + 1].offset;
    if ((st = tdm_syncbn_view(d, l->in, nx, 1, &hx, &own[0])) ||
        (st = tdm_syncbn_view(d, dout, nx, 1, &hdy, &own[1])) ||
        (st = tdm_syncbn_view(d, l->mean, C, 1, &hmean, &own[2])) ||
        (st = tdm_syncbn_view(d, l->invstd, C, 1, &hinv, &own[3])) ||
        (st = tdm_syncbn_view(d, m->params + m->params_info[l->p0].offset, C, 1, &hg,
                              &own[4])) ||
        (st = tdm_syncbn_view(d, dgamma, C, 1, &hdg, &own[5])) ||
        (st = tdm_syncbn_view(d, dbeta, C, 1, &hdb, &own[6])) ||
        (din && (st = tdm_syncbn_view(d, din, nx, 0, &hdx, &own[7]))))
        goto fail;
    for (int ch = 0; ch < C; ch++) {
        double sdy, sdyx;
        tdm_k_bn_bwd_part(hx + (int64_t)ch * len, hdy + (int64_t)ch * len, len, hmean[ch],
                          hinv[ch], 0, 1, &sdy, &sdyx);
        /* this replica's share of the parameter gradients (DDP sums them) */
        tdm_k_bn_bwd_params(ch, sdy, sdyx, hdg, hdb);
        v[ch] = sdy;
        v[C + ch] = sdyx;
    }
    v[2 * C] = (double)len;
    if ((st = tdm_syncbn_back(d, dgamma, hdg, C)) || (st = tdm_syncbn_back(d, dbeta, hdb, C)))
        goto fail;
    if ((st = m->sync_bn(m->sync_bn_ctx, v, 2 * C + 1))) goto fail;
    if (din) {
        int64_t n = (int64_t)v[2 * C];   /* the global count of the forward */
        for (int ch = 0; ch < C; ch++) {
            const float *xr = hx + (int64_t)ch * len, *dyr = hdy + (int64_t)ch * len;
            float *dxr = hdx + (int64_t)ch * len;
            for (int64_t j = 0; j < len; j++)
                tdm_k_bn_bwd_dx(j, xr, dyr, dxr, hmean[ch], hinv[ch], hg[ch], n, v[ch],
                                v[C + ch], 1);
        }
        st = tdm_syncbn_back(d, din, hdx, nx);
    }
fail:
    free(v);
    for (int i = 0; i < 8; i++) free(own[i]);
    return st;
}
