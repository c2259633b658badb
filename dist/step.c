/* dist/step.c: the training steps of a data-parallel design, built from
 * its ops (see dist/step.h). */
#include "dist/step.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "dist/batch.h"
#include "models/clip.h"
#include "models/precision.h"

void tdm_dist_grads_free(tdm_dist_grads *g)
{
    free(g->bufs);
    free(g->n_elem);
    *g = (tdm_dist_grads){0};
}

tdm_status tdm_dist_diverged(tdm_comm *comm, int rank, int64_t step, double loss,
                             const char *where)
{
    char why[256];
    snprintf(why, sizeof why, "loss is %s at step %lld (%s): training diverged (a lower "
             "learning rate may help)", isnan(loss) ? "NaN" : loss > 0 ? "+inf" : "-inf",
             (long long)step, where);
    tdm_comm_abort(comm, why);
    return tdm_error_set(TDM_STATUS_NONFINITE, "rank %d: %s", rank, why);
}

tdm_status tdm_dist_broadcast_buffers(tdm_comm *comm, tdm_model *m, const char *label,
                                      const char *what)
{
    if (tdm_comm_size(comm) == 1 || tdm_model_buffer_elems(m) == 0) return TDM_STATUS_OK;
    tdm_comm_set_label(comm, "%s", label);
    tdm_status st = tdm_comm_broadcast(comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                       (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0);
    return st ? tdm_error_prefix(st, "%s: broadcast of buffers from rank 0", what) : st;
}

tdm_status tdm_dist_eval_begin(tdm_dist_fwd *fwd, const char *who, const char *what,
                               const tdm_dataset *test, int batch, const double *loss_mean,
                               const double *accuracy)
{
    TDM_REQUIRE(test && batch > 0 && loss_mean && accuracy, TDM_STATUS_INVALID_ARG,
                "%s evaluate: test, batch > 0 and outputs are required", who);
    tdm_dist_fwd_lose(fwd, what);
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_eval_sums(tdm_comm *comm, const char *who, const char *label,
                              double sums[3], double *loss_mean, double *accuracy)
{
    tdm_comm_set_label(comm, "%s", label);
    TDM_CHECK(tdm_comm_all_reduce(comm, sums, sums, 3, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    TDM_REQUIRE(sums[2] > 0, TDM_STATUS_INVALID_ARG, "%s evaluate: the test set is empty", who);
    *loss_mean = sums[0] / sums[2];
    *accuracy = sums[1] / sums[2];
    return TDM_STATUS_OK;
}

/* A failed step: the message names the rank, and the group is stopped. */
static tdm_status tdm_dist_step_fail(tdm_dist_stepper *s, tdm_status st)
{
    tdm_error_prefix(st, "rank %d", s->rank);
    tdm_comm_abort(s->comm, tdm_error_message());
    return st;
}

/* This rank's rows of a global batch of `batch` at x, y. */
static void tdm_dist_step_rows(const tdm_dist_stepper *s, const void *x, const int32_t *y,
                               int batch, const void **xs, const int32_t **ys, int *n)
{
    if (s->own_rows) {
        *xs = x;
        *ys = y;
        *n = batch;
        return;
    }
    tdm_dist_share_rows(x, y, batch, s->rank, s->world, s->in_elems, s->out_rows, xs, ys, n);
}

/* The forward of this rank's rows, stopping the group on a loss that is
 * not finite; what, for the message: "rank 1's 3 samples of the batch of
 * 8" or "rank 1, micro-batch 2". */
static tdm_status tdm_dist_step_forward(tdm_dist_stepper *s, const void *x, const int32_t *y,
                                        int batch, int global, float scale, int micro,
                                        double *loss_sum)
{
    const void *xs;
    const int32_t *ys;
    int n;
    tdm_dist_step_rows(s, x, y, batch, &xs, &ys, &n);
    tdm_status st = s->ops->forward(s->w, xs, ys, n, scale, loss_sum);
    if (st) {
        if (micro > 0) s->ops->no_sync(s->w, 0);
        return tdm_dist_step_fail(s, st);
    }
    if (isfinite(*loss_sum)) return TDM_STATUS_OK;
    char where[96];
    if (micro > 0)
        snprintf(where, sizeof where, "rank %d, micro-batch %d", s->rank, micro);
    else
        snprintf(where, sizeof where, "rank %d's %d %s%s of the batch of %d", s->rank, n,
                 s->unit ? s->unit : "sample", n == 1 ? "" : "s", global);
    return tdm_dist_diverged(s->comm, s->rank, tdm_optim_steps(s->opt) + 1, *loss_sum, where);
}

static void tdm_dist_step_begin(tdm_dist_stepper *s)
{
    s->begun++;
    if (s->before) s->before(s->before_ctx, s->begun);
}

/* The levers between the backward's collectives and the step: the
 * gradients this rank holds unscaled, found-inf ORed over the ranks,
 * the global norm clipped; *found_inf: every rank's verdict. */
static tdm_status tdm_dist_step_levers(tdm_dist_stepper *s, int *found_inf)
{
    *found_inf = 0;
    int clip = s->clip_norm > 0.0 || s->measure_norm;
    if (!s->scaler && !clip && !s->after_backward) return TDM_STATUS_OK;
    TDM_REQUIRE(s->ops->grads, TDM_STATUS_UNSUPPORTED,
                "loss scaling and gradient clipping need the design's gradients (its grads op)");
    tdm_dist_grads g = {0};
    TDM_CHECK(s->ops->grads(s->w, &g));
    tdm_status st = TDM_STATUS_OK;
    if (s->after_backward) s->after_backward(s->before_ctx, s->begun, &g);
    for (int i = 0; s->scaler && st == TDM_STATUS_OK && i < g.n_bufs; i++) {
        int inf = 0;
        if (g.n_elem[i] > 0)
            st = tdm_grad_scaler_unscale(s->scaler, g.dev, g.bufs[i], g.n_elem[i], &inf);
        *found_inf |= inf;
    }
    /* replicas agree already when the inf came through the all-reduce;
     * one planted after it (or a shard's) must still stop every rank */
    if (s->scaler && st == TDM_STATUS_OK)
        st = tdm_grad_scaler_sync_found_inf(g.comm, g.dev, found_inf);
    if (clip && st == TDM_STATUS_OK && !*found_inf)
        st = g.replicated ? tdm_clip_grad_norm_bufs(g.dev, g.bufs, g.n_elem, g.n_bufs,
                                                    s->clip_norm, &s->last_norm)
                          : tdm_clip_grad_norm_comm(g.comm, g.dev, g.bufs, g.n_elem, g.n_bufs,
                                                    s->clip_norm, &s->last_norm);
    tdm_dist_grads_free(&g);
    return st;
}

tdm_status tdm_dist_step(void *stepper, const void *x, const int32_t *y, int batch,
                         double *loss_mean)
{
    tdm_dist_stepper *s = stepper;
    int global = s->own_rows ? s->global_batch : batch;
    double ls = 0.0;
    tdm_dist_step_begin(s);
    tdm_status st = s->ops->zero_grad(s->w);
    if (st) return tdm_dist_step_fail(s, st);
    /* the loss scale times 1/B, one rounding (exact for the scaler's
     * powers of two), as tdm_single_step */
    float lscale = s->scaler ? tdm_grad_scaler_scale(s->scaler) : 1.0f;
    TDM_CHECK(tdm_dist_step_forward(s, x, y, batch, global, lscale / (float)global, 0, &ls));
    int found_inf = 0;
    if ((st = s->ops->backward(s->w)) || (st = tdm_dist_step_levers(s, &found_inf)))
        return tdm_dist_step_fail(s, st);
    /* a skipped step still runs the design's step (its gathers of the
     * unchanged shards), around an update that does not happen */
    tdm_optim_set_skip(s->opt, found_inf);
    st = s->ops->step(s->w, s->opt);
    tdm_optim_set_skip(s->opt, 0);
    if (st) return tdm_dist_step_fail(s, st);
    if (s->scaler) tdm_grad_scaler_update(s->scaler, found_inf);
    s->last_skipped = found_inf;
    *loss_mean = s->ops->loss_sum(s->w) / global;   /* carried by the gradient collectives */
    return TDM_STATUS_OK;
}

static tdm_status tdm_dist_accum_zero(void *ctx)
{
    tdm_dist_stepper *s = ctx;
    tdm_dist_step_begin(s);
    tdm_status st = s->ops->zero_grad(s->w);
    return st ? tdm_dist_step_fail(s, st) : st;
}

static tdm_status tdm_dist_accum_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                       float grad_scale, int index, int last, double *loss_sum)
{
    tdm_dist_stepper *s = ctx;
    TDM_CHECK(tdm_dist_step_forward(s, x, y, batch, batch, grad_scale, index + 1, loss_sum));
    s->ops->no_sync(s->w, !last);
    tdm_status st = s->ops->backward(s->w);
    if (st) {
        s->ops->no_sync(s->w, 0);
        return tdm_dist_step_fail(s, st);
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_dist_accum_opt(void *ctx, double *loss_sum)
{
    tdm_dist_stepper *s = ctx;
    tdm_status st = s->ops->step(s->w, s->opt);
    if (st) return tdm_dist_step_fail(s, st);
    *loss_sum = s->ops->loss_sum(s->w);   /* every rank's, reduced with the gradients */
    return TDM_STATUS_OK;
}

const tdm_accum_ops tdm_dist_accum_ops = {.zero_grad = tdm_dist_accum_zero,
                                          .micro = tdm_dist_accum_micro,
                                          .step = tdm_dist_accum_opt};

tdm_status tdm_dist_replicas_loss(tdm_comm *comm, tdm_comm *dcomm, int reps, int rank,
                                  const char *label, double loss_sum, int global, int64_t step,
                                  const char *where, double *loss_mean)
{
    double ls = loss_sum;
    if (reps > 1) {
        tdm_comm_set_label(dcomm, label);
        tdm_status st = tdm_comm_all_reduce(dcomm, &ls, &ls, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM);
        if (st) {
            tdm_error_prefix(st, "rank %d: the loss over the dp dimension", rank);
            tdm_comm_abort(comm, tdm_error_message());
            return st;
        }
    }
    *loss_mean = ls / (double)global;
    if (isfinite(*loss_mean)) return TDM_STATUS_OK;
    return tdm_dist_diverged(comm, rank, step, *loss_mean, where);
}
