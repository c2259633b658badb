/* models/clip.c: the global gradient norm and clipping of models/clip.h,
 * on one device and across ranks that hold parts of the gradient. */
#include "models/clip.h"

#include <math.h>
#include <stdlib.h>

#include "models/model_impl.h"

tdm_status tdm_clip_sumsq(tdm_device *dev, const float *x, int64_t n_elem, double *sumsq)
{
    *sumsq = 0.0;
    int64_t nc = tdm_dev_sumsq_chunks(n_elem);
    if (nc == 0) return TDM_STATUS_OK;
    double *part = NULL, *host = malloc((size_t)nc * sizeof(double));
    TDM_REQUIRE(host, TDM_STATUS_OUT_OF_MEMORY, "clip: %lld partial sums", (long long)nc);
    tdm_status st = tdm_dev_scratch(dev, (size_t)nc * sizeof(double), (void **)&part);
    if (st == TDM_STATUS_OK) st = tdm_dev_sumsq(dev, x, n_elem, part);
    if (st == TDM_STATUS_OK) st = tdm_dev_copy_to_host(dev, host, part, (size_t)nc * sizeof(double));
    double s = 0.0;
    for (int64_t c = 0; st == TDM_STATUS_OK && c < nc; c++) s += host[c];
    free(host);
    *sumsq = s;
    return st;
}

tdm_status tdm_clip_apply_norm(tdm_device *dev, float *const *grads, const int64_t *n_elem,
                               int n_bufs, double max_norm, double total)
{
    TDM_REQUIRE(isfinite(total), TDM_STATUS_NONFINITE,
                "the gradient norm is %s: a gradient holds a NaN or an infinity; not clipping "
                "(a lower learning rate, or loss scaling with fp16, may help)",
                isnan(total) ? "NaN" : "infinite");
    if (max_norm <= 0.0) return TDM_STATUS_OK;
    double coef = max_norm / (total + 1e-6);
    if (coef >= 1.0) return TDM_STATUS_OK;
    for (int i = 0; i < n_bufs; i++)
        if (n_elem[i] > 0) TDM_CHECK(tdm_dev_scale(dev, n_elem[i], (float)coef, grads[i]));
    return TDM_STATUS_OK;
}

/* The model's gradient buffers: the flat one, or each tensor's view. */
static tdm_status tdm_clip_model_bufs(tdm_model *m, float ***bufs, int64_t **n, int *count)
{
    int np = m->params ? 1 : m->n_params;
    *bufs = malloc((size_t)np * sizeof **bufs);
    *n = malloc((size_t)np * sizeof **n);
    if (!*bufs || !*n) {
        free(*bufs);
        free(*n);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "clip: %d buffers", np);
    }
    if (m->params && m->grads) {
        (*bufs)[0] = m->grads;
        (*n)[0] = m->param_elems;
    } else {
        for (int i = 0; i < np; i++) {
            (*bufs)[i] = tdm_model_gdata(m, i);
            (*n)[i] = (*bufs)[i] ? m->params_info[i].n_elem : 0;
        }
    }
    *count = np;
    return TDM_STATUS_OK;
}

tdm_status tdm_clip_grad_norm(tdm_model *m, double max_norm, double *total_norm)
{
    float **bufs = NULL;
    int64_t *n = NULL;
    int count = 0;
    TDM_CHECK(tdm_clip_model_bufs(m, &bufs, &n, &count));
    double sq = 0.0, part;
    tdm_status st = TDM_STATUS_OK;
    for (int i = 0; st == TDM_STATUS_OK && i < count; i++) {
        st = tdm_clip_sumsq(m->dev, bufs[i], n[i], &part);
        sq += part;
    }
    double total = sqrt(sq);
    if (total_norm) *total_norm = total;
    if (st == TDM_STATUS_OK) st = tdm_clip_apply_norm(m->dev, bufs, n, count, max_norm, total);
    free(bufs);
    free(n);
    return st;
}

tdm_status tdm_clip_grad_norm_bufs(tdm_device *dev, float *const *grads, const int64_t *n_elem,
                                   int n_bufs, double max_norm, double *total_norm)
{
    double sq = 0.0, part;
    for (int i = 0; i < n_bufs; i++) {
        TDM_CHECK(tdm_clip_sumsq(dev, grads[i], n_elem[i], &part));
        sq += part;
    }
    double total = sqrt(sq);
    if (total_norm) *total_norm = total;
    return tdm_clip_apply_norm(dev, grads, n_elem, n_bufs, max_norm, total);
}

tdm_status tdm_clip_grad_norm_comm(tdm_comm *comm, tdm_device *dev, float *const *grads,
                                   const int64_t *n_elem, int n_bufs, double max_norm,
                                   double *total_norm)
{
    TDM_REQUIRE(comm && dev && n_bufs >= 0 && (n_bufs == 0 || (grads && n_elem)),
                TDM_STATUS_INVALID_ARG, "clip: %d buffers without a communicator, device or "
                "arrays", n_bufs);
    double sq = 0.0, part, *buf = NULL;
    for (int i = 0; i < n_bufs; i++) {
        TDM_CHECK(tdm_clip_sumsq(dev, grads[i], n_elem[i], &part));
        sq += part;
    }
    TDM_CHECK(tdm_dev_scratch(dev, sizeof(double), (void **)&buf));
    TDM_CHECK(tdm_dev_copy_from_host(dev, buf, &sq, sizeof sq));
    tdm_comm_set_label(comm, "clip grad norm");
    TDM_CHECK(tdm_comm_all_reduce(comm, buf, buf, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    TDM_CHECK(tdm_dev_copy_to_host(dev, &sq, buf, sizeof sq));
    double total = sqrt(sq);
    if (total_norm) *total_norm = total;
    return tdm_clip_apply_norm(dev, grads, n_elem, n_bufs, max_norm, total);
}
