/* dist/step.h: a design's per-step entry points (the ops of its table,
 * dist/run.h), and the training steps dist builds from them, so that no
 * design writes its step's plumbing again: this rank's rows of the global
 * batch, the loss-gradient scale that makes the sum over ranks the global
 * batch's mean-loss gradient, the check that the loss is finite before
 * any gradient collective (a rank that diverged stops every rank at the
 * same step, naming itself), gradient accumulation under no_sync, and the
 * abort of the group with the rank's message on any failure.
 *
 * The ops a design fills: a data-parallel design (DDP, FSDP/ZeRO) the
 * pieces of its step (TDM_DIST_OPS_DEFINE makes them from its calls); a
 * design whose step does not split into one forward and one backward (a
 * pipeline's schedule interleaves the micro-batches of both) leaves
 * zero_grad, forward and backward NULL and drives its own step from its
 * run callback. Every op is collective unless it says
 * otherwise, and every one may be NULL where the design or the tool does
 * not use it. */
#ifndef TDM_DIST_STEP_H
#define TDM_DIST_STEP_H

#include <stdint.h>

#include "core/comm.h"
#include "core/data.h"
#include "core/status.h"
#include "dist/batch.h"
#include "models/accum.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_dist_ops tdm_dist_ops;

/* The gradients a rank holds after a synchronised backward, which the
 * memory levers read and scale (loss scaling's unscale and found-inf
 * check, clipping): n_bufs buffers of dev's memory. replicated: every
 * rank holds the same whole gradient (DDP after its all-reduce); else
 * each holds a disjoint part, together the whole (FSDP/ZeRO shards).
 * comm: the design's collectives on dev's memory. bufs and n_elem are
 * malloc'd by the design's grads op; tdm_dist_grads_free frees them. */
typedef struct tdm_dist_grads {
    float **bufs;
    int64_t *n_elem;
    int n_bufs;
    int replicated;
    tdm_device *dev;
    tdm_comm *comm;
} tdm_dist_grads;
void tdm_dist_grads_free(tdm_dist_grads *g);

/* w is the design's wrapper (a tdm_ddp, a tdm_fsdp); opt its optimizer
 * (over what this rank holds: the replica, or its shards). */
struct tdm_dist_ops {
    tdm_status (*zero_grad)(void *w);
    /* Forward and loss over this rank's n samples (host; n may be 0: the
     * rank still takes part), the loss gradient scaled by grad_scale;
     * *loss_sum: the sum of this rank's per-sample losses. */
    tdm_status (*forward)(void *w, const void *x, const int32_t *y, int n, float grad_scale,
                          double *loss_sum);
    /* Uneven inputs (join): the mean-loss gradient over the ranks with
     * data in this forward; *loss_mean this rank's mean loss. */
    tdm_status (*forward_mean)(void *w, const void *x, const int32_t *y, int n,
                               double *loss_mean);
    void (*no_sync)(void *w, int enable);     /* local: backward accumulates, no collective */
    tdm_status (*backward)(void *w);
    /* The gradients this rank holds after the last synchronised backward
     * (above). Local. */
    tdm_status (*grads)(void *w, tdm_dist_grads *out);
    tdm_status (*step)(void *w, tdm_optim *opt);
    /* Every rank's loss sum of the forwards the last synchronised
     * backward reduced (carried by its collectives). Local. */
    double (*loss_sum)(void *w);
    /* A rank out of data shadows the others' steps until every rank has
     * joined (dist/join.h); *shadowed: the synchronised steps it shadowed. */
    tdm_status (*join)(void *w, tdm_optim *opt, int64_t *shadowed);
    /* The test set's mean loss and accuracy, spread over the ranks. */
    tdm_status (*evaluate)(void *w, const tdm_dataset *test, int batch, double *loss_mean,
                           double *accuracy);
    /* The loss sum of n samples in eval mode (n may be 0); collective
     * where the design's forward is (FSDP), local otherwise (DDP). */
    tdm_status (*eval_loss)(void *w, const void *x, const int32_t *y, int n, double *loss_sum);
    /* A checkpoint every rank takes part in (the full model, readable by
     * every design and by one device), and reading one. */
    tdm_status (*save)(void *w, const char *path, tdm_optim *opt, const tdm_ckpt_info *info);
    tdm_status (*load)(void *w, const char *path, tdm_optim *opt, tdm_ckpt_info *info);
    /* --deterministic (dist/det.h), for a design whose gradients are not
     * the model's flat buffer (the sharded ones): this rank's local
     * gradient of the backwards since zero_grad, in the model's flat
     * layout, into host (tdm_model_param_elems floats); and the reduced
     * gradient at host (the same layout) made what the next step applies
     * (the local one dropped). Local. NULL: the model's flat gradients. */
    tdm_status (*local_grads)(void *w, float *host);
    tdm_status (*set_grads)(void *w, const float *host);
};

/* The ops of a design whose calls follow DDP's names and arguments
 * (tdm_<P>_zero_grad, _forward_scaled, _forward, _no_sync, _backward,
 * _grad_bufs, _step, _loss_sum, _join, _evaluate, _eval_loss on a T *),
 * SAVE and LOAD being its checkpoint calls (T *, path, opt, info): defines the adapters
 * and `const tdm_dist_ops tdm_<P>_dist_ops`, which the design's header
 * declares. Used once, in the design's own .c file. */
#define TDM_DIST_OPS_ROWS_(T, NAME, FN)                                                       \
    static tdm_status NAME(void *w, const void *x, const int32_t *y, int n, double *out)     \
    {                                                                                         \
        return FN((T *)w, x, y, n, out);                                                      \
    }
#define TDM_DIST_OPS_DEFINE(P, T, SAVE, LOAD)                                                 \
    TDM_DIST_OPS_DEFINE_WITH(P, T, SAVE, LOAD, .local_grads = NULL)
/* The same, with more of the ops (designated initializers) after them. */
#define TDM_DIST_OPS_DEFINE_WITH(P, T, SAVE, LOAD, ...)                                       \
    static tdm_status tdm_##P##_ops_zero(void *w) { return tdm_##P##_zero_grad((T *)w); }    \
    static tdm_status tdm_##P##_ops_forward(void *w, const void *x, const int32_t *y, int n,  \
                                            float scale, double *loss_sum)                    \
    {                                                                                         \
        return tdm_##P##_forward_scaled((T *)w, x, y, n, scale, loss_sum);                    \
    }                                                                                         \
    TDM_DIST_OPS_ROWS_(T, tdm_##P##_ops_forward_mean, tdm_##P##_forward)                      \
    static void tdm_##P##_ops_no_sync(void *w, int on) { tdm_##P##_no_sync((T *)w, on); }    \
    static tdm_status tdm_##P##_ops_backward(void *w) { return tdm_##P##_backward((T *)w); } \
    static tdm_status tdm_##P##_ops_grads(void *w, tdm_dist_grads *g)                         \
    {                                                                                         \
        return tdm_##P##_grad_bufs((T *)w, g);                                                \
    }                                                                                         \
    static tdm_status tdm_##P##_ops_step(void *w, tdm_optim *opt)                             \
    {                                                                                         \
        return tdm_##P##_step((T *)w, opt);                                                   \
    }                                                                                         \
    static double tdm_##P##_ops_loss_sum(void *w) { return tdm_##P##_loss_sum((T *)w); }     \
    static tdm_status tdm_##P##_ops_join(void *w, tdm_optim *opt, int64_t *shadowed)         \
    {                                                                                         \
        return tdm_##P##_join((T *)w, opt, shadowed);                                         \
    }                                                                                         \
    static tdm_status tdm_##P##_ops_evaluate(void *w, const tdm_dataset *test, int batch,     \
                                             double *loss_mean, double *accuracy)             \
    {                                                                                         \
        return tdm_##P##_evaluate((T *)w, test, batch, loss_mean, accuracy);                  \
    }                                                                                         \
    TDM_DIST_OPS_ROWS_(T, tdm_##P##_ops_eval_loss, tdm_##P##_eval_loss)                       \
    static tdm_status tdm_##P##_ops_save(void *w, const char *path, tdm_optim *opt,           \
                                         const tdm_ckpt_info *info)                           \
    {                                                                                         \
        return SAVE((T *)w, path, opt, info);                                                 \
    }                                                                                         \
    static tdm_status tdm_##P##_ops_load(void *w, const char *path, tdm_optim *opt,           \
                                         tdm_ckpt_info *info)                                 \
    {                                                                                         \
        return LOAD((T *)w, path, opt, info);                                                 \
    }                                                                                         \
    const tdm_dist_ops tdm_##P##_dist_ops = {                                                 \
        .zero_grad = tdm_##P##_ops_zero, .forward = tdm_##P##_ops_forward,                    \
        .forward_mean = tdm_##P##_ops_forward_mean, .no_sync = tdm_##P##_ops_no_sync,         \
        .backward = tdm_##P##_ops_backward, .grads = tdm_##P##_ops_grads,                     \
        .step = tdm_##P##_ops_step,                                                           \
        .loss_sum = tdm_##P##_ops_loss_sum, .join = tdm_##P##_ops_join,                       \
        .evaluate = tdm_##P##_ops_evaluate, .eval_loss = tdm_##P##_ops_eval_loss,             \
        .save = tdm_##P##_ops_save, .load = tdm_##P##_ops_load, __VA_ARGS__}

/* A training step's context: the design's ops over its wrapper, and where
 * the rank stands. Zero-initialise, then fill. */
typedef struct tdm_dist_stepper {
    const tdm_dist_ops *ops;
    void *w;                     /* the design's wrapper */
    tdm_optim *opt;
    tdm_comm *comm;              /* the process group: aborted on failure */
    int rank, world;
    int in_elems, out_rows;      /* per sample: 4-byte inputs (floats or tokens), targets */
    /* 0: a step's x, y hold the global batch, of which this rank runs
     * its share (tdm_dist_share); 1: they hold only this rank's rows
     * (drawn by the rank itself, as a GPT's windows), of a global batch
     * of global_batch samples */
    int own_rows;
    int global_batch;
    const char *unit;            /* a sample's name in messages ("window"); NULL: "sample" */
    /* Called before each optimizer step's first forward with its number
     * (from 1 over the run): a test's fault hook. May be NULL. */
    void (*before)(void *ctx, int64_t step);
    void *before_ctx;
    int64_t begun;               /* optimizer steps begun (before's count) */
    /* The memory levers (zero: off), as tdm_single's (models/train.h):
     * with a scaler the loss gradient is scaled, the gradients this rank
     * holds are unscaled after the backward's collectives, the found-inf
     * flag ORed over every rank (tdm_grad_scaler_sync_found_inf) and the
     * step skipped on all of them alike; clip_norm > 0 clips the global
     * norm (a replica alone, shards through one all-reduce: models/clip.h)
     * before the step; measure_norm measures it without clipping. */
    struct tdm_grad_scaler *scaler;   /* borrowed */
    double clip_norm;
    int measure_norm;
    double last_norm;            /* the last step's global gradient norm */
    int last_skipped;            /* 1: the last step was skipped on every rank */
    /* Test hook, after the backward and before the levers read the
     * gradients (a planted inf); ctx: before_ctx. May be NULL. */
    void (*after_backward)(void *ctx, int64_t step, const tdm_dist_grads *g);
} tdm_dist_stepper;

/* A tdm_train_step_fn (models/train.h) over a tdm_dist_stepper: one
 * optimizer step over a global batch of `batch` samples at x, y (see
 * own_rows): zero_grad; the forward of this rank's rows, the loss
 * gradient scaled by 1/batch (times the loss scale) so that the sum over
 * ranks is exactly the global batch's mean-loss gradient, uneven shares
 * included; the finite check; backward; the levers (unscale, found-inf
 * over the ranks, clipping); the optimizer step (skipped, the design's
 * step still run, when found-inf). *loss_mean: the global batch's
 * mean loss (every rank's, carried by the gradients' collectives). */
tdm_status tdm_dist_step(void *stepper, const void *x, const int32_t *y, int batch,
                         double *loss_mean);

/* Gradient accumulation (models/accum.h) over a tdm_dist_stepper: every
 * micro-batch is a global one split over the ranks, its loss gradient
 * scaled by 1/(the effective batch); the first K-1 backwards run under
 * no_sync, so only the last one reduces, the sum of all K. */
extern const tdm_accum_ops tdm_dist_accum_ops;

/* Rank 0's buffers (batchnorm's running statistics) to every rank over
 * comm, labelled label; nothing with one rank or no buffers. On failure
 * the message says "<what>: broadcast of buffers from rank 0". */
tdm_status tdm_dist_broadcast_buffers(tdm_comm *comm, tdm_model *m, const char *label,
                                      const char *what);

/* The start of an evaluation spread over the ranks: INVALID_ARG ("<who>
 * evaluate: test, batch > 0 and outputs are required") unless they are
 * given; the evaluation's forwards replace the model's activations, so a
 * pending training forward is lost (to `what`, a static string). */
tdm_status tdm_dist_eval_begin(tdm_dist_fwd *fwd, const char *who, const char *what,
                               const tdm_dataset *test, int batch, const double *loss_mean,
                               const double *accuracy);

/* The end of an evaluation spread over the ranks: sums holds this rank's
 * loss sum, correct count and samples, all-reduced (float64 SUM over
 * comm, labelled label) into the whole set's mean loss and accuracy;
 * INVALID_ARG ("<who> evaluate: the test set is empty") for no samples. */
tdm_status tdm_dist_eval_sums(tdm_comm *comm, const char *who, const char *label,
                              double sums[3], double *loss_mean, double *accuracy);

/* A rank's loss is not finite before its gradient collectives: aborts
 * the group with the reason ("loss is NaN at step S (<where>): training
 * diverged ..."; every other rank leaves its next collective naming it,
 * so all stop at the same step) and returns NONFINITE with "rank R: "
 * and that reason. where: "rank 1's 3 samples of the batch of 8". */
tdm_status tdm_dist_diverged(tdm_comm *comm, int rank, int64_t step, double loss,
                             const char *where);

/* The end of a mesh design's step (a pipeline's, tensor parallelism's):
 * the loss sum of this replica summed over the reps replicas on dcomm
 * (the dp group, the call labelled label; nothing with one replica), its
 * mean over the global batch into *loss_mean, then the finite check as
 * tdm_dist_diverged (step, where). A failed sum aborts comm ("rank R:
 * the loss over the dp dimension"). */
tdm_status tdm_dist_replicas_loss(tdm_comm *comm, tdm_comm *dcomm, int reps, int rank,
                                  const char *label, double loss_sum, int global, int64_t step,
                                  const char *where, double *loss_mean);

#ifdef __cplusplus
}
#endif

#endif
