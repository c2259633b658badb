/* models/train.h: the epoch loop shared by every mode, the single-device
 * training step, and evaluation.
 *
 * An epoch visits the dataset in the order tdm_train_epoch_order() gives
 * for (seed, epoch) - the same permutation single-device, DP and DDP use -
 * in global batches of `batch` samples, and hands each batch (host memory)
 * to a step function: the single-device step here, tdm_dp_step (dp/) for
 * DataParallel, the ranks' step of DDP and FSDP (dist/step.c). Nothing
 * here knows of parallelism. */
#ifndef TDM_MODELS_TRAIN_H
#define TDM_MODELS_TRAIN_H

#include <stdint.h>

#include "core/data.h"
#include "core/timer.h"
#include "models/model.h"
#include "models/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The permutation of 0..n-1 for an epoch: a pure function of (seed, epoch). */
void tdm_train_epoch_order(int64_t *perm, int64_t n, uint64_t seed, int64_t epoch);

/* One training step over a global batch in host memory; returns the mean
 * loss. x: batch samples of the model's input dtype (float32 features or
 * int32 tokens, 4-byte elements either way); y: batch * out_rows targets. */
typedef tdm_status (*tdm_train_step_fn)(void *ctx, const void *x, const int32_t *y, int batch,
                                        double *loss_mean);
/* Progress after each step (step counts from 1). */
typedef void (*tdm_train_progress_fn)(void *ctx, int64_t step, int64_t steps, double loss_mean,
                                      double samples_per_s);

typedef struct tdm_epoch_stats {
    int64_t steps;
    int64_t samples;
    double loss_mean;        /* mean over samples of the epoch */
    double seconds;
    double samples_per_s;
} tdm_epoch_stats;

/* One epoch's options; zero means the default. */
typedef struct tdm_train_epoch_opts {
    int batch;                    /* global batch, samples (> 0) */
    uint64_t seed;                /* with epoch: the order, tdm_train_epoch_order */
    int64_t epoch;
    int drop_last;                /* skip a final short batch */
    int64_t max_steps;            /* > 0: stop after this many steps (benchmarks, tests) */
    tdm_train_step_fn step;       /* required */
    void *step_ctx;
    tdm_train_progress_fn progress;   /* after each step; may be NULL */
    void *progress_ctx;
} tdm_train_epoch_opts;

/* Runs one epoch of d in global batches of o->batch. A step whose loss is
 * NaN or infinite stops the epoch with TDM_STATUS_NONFINITE: "loss is NaN
 * at step S (epoch E, batch b of n)", S counting the steps of every epoch
 * before this one as this one's (the optimizer's step count when all
 * epochs have the same number of steps). */
tdm_status tdm_train_epoch(const tdm_dataset *d, const tdm_train_epoch_opts *o,
                           tdm_epoch_stats *out);

/* The epoch loops' step (tdm_train_epoch, tdm_train_text_epoch): step s
 * of steps runs o->step over n rows at x, y, a batch of `samples` samples
 * (n, or the global batch a rank's rows are part of), and tallies its
 * mean loss into out (the progress callback is told); tally_end makes
 * out's means. t0: the epoch's start (tdm_time_ns). A NaN or infinite
 * loss is TDM_STATUS_NONFINITE ("training diverged"), counted nowhere: the
 * loss is on the host already, so the check is free, and such a loss
 * means the parameters are ruined too. */
tdm_status tdm_train_step_tally(const tdm_train_epoch_opts *o, tdm_epoch_stats *out, int64_t s,
                                int64_t steps, const void *x, const int32_t *y, int n,
                                int samples, uint64_t t0);
void tdm_train_tally_end(tdm_epoch_stats *out, uint64_t t0);

/* The L2 norm of m's gradients, in double on the host (one copy of the
 * gradient buffer: meant for checkpoints, not every step).
 * TDM_STATUS_NONFINITE names the first parameter whose gradient holds a
 * NaN or an infinity. */
tdm_status tdm_train_grad_norm(tdm_model *m, double *norm);

/* A batch on the model's device. On a host device the caller's host
 * pointers are used as they are; elsewhere the batch is copied into
 * buffers that grow to the largest batch seen. A loss-gradient buffer
 * (dlogits) grows likewise, and one sample of zeros (features, or token
 * 0, and target 0) is kept for a caller that must run a forward without
 * samples of its own. The stage owns every buffer it allocated;
 * zero-initialise it and free it with tdm_train_stage_free. */
typedef struct tdm_train_stage {
    tdm_device *dev;          /* borrowed: the model's (set at first use) */
    void *x;                  /* device copies of the last staged batch */
    int32_t *y;
    int cap;                  /* samples x and y have room for */
    float *dlogits;           /* a loss gradient */
    size_t dlogits_bytes;
    void *dummy_x;            /* one sample of zeros */
    int32_t *dummy_y;
} tdm_train_stage;

/* x, y (host; batch samples of m's 4-byte inputs and their out_rows
 * targets) on m's device: *xd, *yd. */
tdm_status tdm_train_stage_batch(tdm_train_stage *s, const tdm_model *m, const void *x,
                                 const int32_t *y, int batch, const void **xd,
                                 const int32_t **yd);
/* The sample of zeros on m's device (made once). */
tdm_status tdm_train_stage_dummy(tdm_train_stage *s, const tdm_model *m, const void **xd,
                                 const int32_t **yd);
/* The loss gradient buffer, at least nbytes. */
tdm_status tdm_train_stage_dlogits(tdm_train_stage *s, size_t nbytes);
void tdm_train_stage_free(tdm_train_stage *s);

/* The single-device step: zero_grad, forward, mean loss, backward,
 * [unscale, skip on non-finite], [clip], optimizer step, [scaler update]. Inputs are staged to the device when it is not the host.
 * Per-phase times of the last step are kept (forward, loss, backward, step). */
typedef struct tdm_single {
    tdm_model *model;   /* borrowed */
    tdm_optim *opt;     /* borrowed */
    tdm_train_stage stage;
    double ms[TDM_PHASE_COUNT_]; /* by tdm_phase: forward, loss, backward, step */
    /* the memory levers (zero: off): with a scaler the loss gradient is
     * scaled, the gradients unscaled after backward and the step skipped
     * when any is NaN or infinite (models/precision.h); clip_norm > 0
     * clips the gradient norm to it before the step (models/clip.h),
     * measure_norm measures the norm without clipping */
    struct tdm_grad_scaler *scaler;   /* borrowed */
    double clip_norm;
    int measure_norm;
    double last_norm;   /* the last step's gradient norm (clipping or measuring) */
    int last_skipped;   /* 1: the last step was skipped (non-finite gradients) */
} tdm_single;
tdm_status tdm_single_step(void *single /* tdm_single */, const void *x, const int32_t *y,
                           int batch, double *loss_mean);
/* The step's end after backward, on s->model's gradients (DataParallel's
 * master holds the replicas' sum there): [unscale, skip on non-finite],
 * [clip], optimizer step, [scaler update]; sets last_norm and
 * last_skipped. Queues the device's work without waiting for it. */
tdm_status tdm_single_finish(tdm_single *s);
void tdm_single_free(tdm_single *s);   /* frees staging only */

/* Mean loss and accuracy over a dataset, in eval mode (restores the mode). */
tdm_status tdm_evaluate(tdm_model *m, const tdm_dataset *d, int batch, double *loss_mean,
                        double *accuracy);
/* tdm_evaluate through the caller's stage (a step's: tdm_single's),
 * which keeps its buffers: evaluating at the step's batch on an
 * accelerator then allocates nothing the step does not hold already. */
tdm_status tdm_evaluate_staged(tdm_model *m, const tdm_dataset *d, int batch,
                               tdm_train_stage *stage, double *loss_mean, double *accuracy);
/* One evaluation forward (the model in eval mode) of b samples on m's
 * device (xd; yd their targets there, y on the host): the summed loss
 * and the count of correct predictions added to *loss_sum, *correct. */
tdm_status tdm_evaluate_batch(tdm_model *m, const void *xd, const int32_t *yd, const int32_t *y,
                              int b, double *loss_sum, int64_t *correct);

#ifdef __cplusplus
}
#endif

#endif
