/* dist/batch.c: a rank's share of a global batch and its staging on the
 * device (see dist/batch.h). */
#include "dist/batch.h"

#include "core/timer.h"

void tdm_dist_share(int64_t n, int rank, int world, int64_t *lo, int64_t *hi)
{
    *lo = n * rank / world;
    *hi = n * (rank + 1) / world;
}

void tdm_dist_share_rows(const void *x, const int32_t *y, int batch, int rank, int world,
                         int64_t in_elems, int64_t out_rows, const void **xs,
                         const int32_t **ys, int *n)
{
    int64_t lo, hi;
    tdm_dist_share(batch, rank, world, &lo, &hi);
    /* 4-byte inputs of either dtype */
    *xs = x ? (const char *)x + lo * in_elems * (int64_t)sizeof(float) : NULL;
    *ys = y ? y + lo * out_rows : NULL;
    *n = (int)(hi - lo);
}

tdm_status tdm_dist_forward_loss(tdm_train_stage *s, tdm_model *m, tdm_dist_forward_fn fwd,
                                 void *fwd_ctx, const void *xd, const int32_t *yd, int B,
                                 float grad_scale, double *loss_sum, uint64_t *t_forward_end)
{
    const float *logits = NULL;
    *loss_sum = 0.0;
    TDM_CHECK(fwd ? fwd(fwd_ctx, xd, B, &logits) : tdm_model_forward(m, xd, B, &logits));
    *t_forward_end = tdm_time_ns();
    /* logits per sample: classes of every output row */
    size_t nb = (size_t)B * (size_t)tdm_model_n_classes(m) * (size_t)tdm_model_out_rows(m) *
                sizeof(float);
    TDM_CHECK(tdm_train_stage_dlogits(s, nb));
    return tdm_model_loss(m, logits, yd, B, grad_scale, loss_sum, s->dlogits);
}

void tdm_dist_fwd_begin(tdm_dist_fwd *f)
{
    f->state = TDM_DIST_FWD_NONE;
    f->lost = NULL;
}

void tdm_dist_fwd_done(tdm_dist_fwd *f, int batch, double loss, int train)
{
    f->state = TDM_DIST_FWD_PENDING;
    f->batch = batch;
    f->loss = loss;   /* counted once its backward runs: a replaced forward is not reduced */
    if (train) f->count++;
}

void tdm_dist_fwd_lose(tdm_dist_fwd *f, const char *what)
{
    if (f->state != TDM_DIST_FWD_PENDING) return;
    f->state = TDM_DIST_FWD_LOST;
    f->lost = what;
}

tdm_status tdm_dist_fwd_take(tdm_dist_fwd *f, const char *who, double *loss)
{
    TDM_REQUIRE(f->state != TDM_DIST_FWD_LOST, TDM_STATUS_INVALID_ARG,
                "%s backward: %s ran forwards on the model since the last tdm_%s_forward and "
                "replaced its activations; call tdm_%s_forward again before backward", who,
                f->lost, who, who);
    TDM_REQUIRE(f->state == TDM_DIST_FWD_PENDING, TDM_STATUS_INVALID_ARG,
                "%s backward: no forward before it; call tdm_%s_forward first", who, who);
    f->state = TDM_DIST_FWD_NONE;
    *loss = f->loss;
    return TDM_STATUS_OK;
}
