/* models/accum.c: gradient accumulation over micro-batches (see
 * models/accum.h) and its single-device operations. */
#include "models/accum.h"

#include <string.h>

#include "core/timer.h"
#include "models/precision.h"

tdm_status tdm_accum_step(void *p, const void *x, const int32_t *y, int batch, double *loss_mean)
{
    tdm_accum *a = p;
    TDM_REQUIRE(a && a->ops && a->micro >= 1 && batch >= 1, TDM_STATUS_INVALID_ARG,
                "gradient accumulation: bad set-up or batch %d", batch);
    /* 1/batch for every micro-batch: the sum of their gradients is the
     * mean-loss gradient of the whole effective batch, short last
     * micro-batches included (scaling each by 1/its own size and the sum
     * by 1/K would weigh a short one's samples more). */
    float scale = 1.0f / (float)batch;
    int n_micro = (batch + a->micro - 1) / a->micro;
    double loss_sum = 0.0;
    TDM_CHECK(a->ops->zero_grad(a->ctx));
    for (int k = 0; k < n_micro; k++) {
        int lo = k * a->micro, b = batch - lo < a->micro ? batch - lo : a->micro;
        const char *xs = (const char *)x + (int64_t)lo * a->in_features * 4;
        double ls = 0.0;
        TDM_CHECK(a->ops->micro(a->ctx, xs, y + (int64_t)lo * a->out_rows, b, scale, k,
                                k == n_micro - 1, &ls));
        loss_sum += ls;
        a->micro_steps++;
    }
    TDM_CHECK(a->ops->step(a->ctx, &loss_sum));
    if (loss_mean) *loss_mean = loss_sum / batch;
    return TDM_STATUS_OK;
}

/* ---- single device ---- */

static tdm_status tdm_accum_single_zero(void *ctx)
{
    tdm_single *s = ctx;
    memset(s->ms, 0, sizeof s->ms);
    return tdm_model_zero_grad(s->model);
}

static tdm_status tdm_accum_single_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                         float grad_scale, int index, int last, double *loss_sum)
{
    tdm_single *s = ctx;
    tdm_model *m = s->model;
    const void *xd;
    const int32_t *yd;
    const float *logits;
    (void)index;
    (void)last;
    uint64_t t0 = tdm_time_ns();
    TDM_CHECK(tdm_train_stage_batch(&s->stage, m, x, y, batch, &xd, &yd));
    TDM_CHECK(tdm_model_forward(m, xd, batch, &logits));
    uint64_t t1 = tdm_time_ns();
    float *dlogits = tdm_model_loss_grad(m);
    /* loss scaling (models/precision.h): 1/B times the scale, exact for
     * the scaler's powers of two, as tdm_single_step */
    float lscale = s->scaler ? tdm_grad_scaler_scale(s->scaler) : 1.0f;
    TDM_CHECK(tdm_model_loss(m, logits, yd, batch, grad_scale * lscale, loss_sum, dlogits));
    uint64_t t2 = tdm_time_ns();
    TDM_CHECK(tdm_model_backward(m, dlogits));
    s->ms[TDM_PHASE_FORWARD] += (double)(t1 - t0) * 1e-6;
    s->ms[TDM_PHASE_LOSS] += (double)(t2 - t1) * 1e-6;
    s->ms[TDM_PHASE_BACKWARD] += tdm_time_ms_since(t2);
    return TDM_STATUS_OK;
}

static tdm_status tdm_accum_single_opt(void *ctx, double *loss_sum)
{
    tdm_single *s = ctx;
    (void)loss_sum;
    uint64_t t0 = tdm_time_ns();
    /* the levers, then the step (or its skip): tdm_single's */
    TDM_CHECK(tdm_single_finish(s));
    TDM_CHECK(tdm_dev_sync(tdm_model_device(s->model)));
    s->ms[TDM_PHASE_STEP] = tdm_time_ms_since(t0);
    return TDM_STATUS_OK;
}

const tdm_accum_ops tdm_accum_single_ops = {
    .zero_grad = tdm_accum_single_zero,
    .micro = tdm_accum_single_micro,
    .step = tdm_accum_single_opt,
};
