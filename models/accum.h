/* models/accum.h: gradient accumulation. One optimizer step over an
 * effective batch of up to K * micro samples, run as K micro-batches of
 * `micro` samples (the last ones shorter, or absent, when the epoch's
 * final batch is short): the gradients are zeroed once, every
 * micro-batch's forward and backward *adds* its gradient, with the loss
 * gradient scaled by 1/(the effective batch's samples) so that the sum is
 * exactly the mean-loss gradient of the whole effective batch, and the
 * optimizer steps once. This equals one step on the effective batch up
 * to the order of float additions (tested in tests/test_accum.c for
 * single-device, DP and DDP).
 *
 * The mode supplies the three operations (tdm_accum_ops): the
 * single-device one is here; DP's and DDP's live with their modes
 * (tools/train_local.c, dist/step.c), DDP's running the first K-1
 * micro-batches under no_sync. Nothing here knows of parallelism. */
#ifndef TDM_MODELS_ACCUM_H
#define TDM_MODELS_ACCUM_H

#include <stdint.h>

#include "core/status.h"
#include "models/train.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_accum_ops {
    /* Zero the gradients (before the first micro-batch). */
    tdm_status (*zero_grad)(void *ctx);
    /* Forward, loss (its gradient times grad_scale) and backward over one
     * micro-batch of `batch` samples in host memory, adding into the
     * gradients. index counts the step's micro-batches from 0; last is 1
     * for the step's last one. *loss_sum: the micro-batch's per-sample
     * loss sum (this process's part of it, for DDP). */
    tdm_status (*micro)(void *ctx, const void *x, const int32_t *y, int batch, float grad_scale,
                        int index, int last, double *loss_sum);
    /* The optimizer step. *loss_sum holds the sum of the micro-batches'
     * loss sums; the mode may replace it (DDP: every rank's). */
    tdm_status (*step)(void *ctx, double *loss_sum);
} tdm_accum_ops;

typedef struct tdm_accum {
    const tdm_accum_ops *ops;
    void *ctx;
    int micro;              /* samples per micro-batch (>= 1) */
    int in_features;        /* 4-byte input elements per sample */
    int out_rows;           /* targets per sample */
    int64_t micro_steps;    /* micro-batches run so far */
} tdm_accum;

/* A tdm_train_step_fn over a tdm_accum: x holds the effective batch of
 * `batch` samples (at most K * micro); runs ceil(batch / micro)
 * micro-batches of consecutive samples and one optimizer step.
 * *loss_mean: the effective batch's mean loss. */
tdm_status tdm_accum_step(void *accum, const void *x, const int32_t *y, int batch,
                          double *loss_mean);

/* The single-device operations over a tdm_single (its model and
 * optimizer; its staging buffers are used on non-host devices), its
 * memory levers included: with a scaler every micro-batch's loss
 * gradient is scaled too, and the step is tdm_single_finish (unscale,
 * skip on non-finite, clip, step, scaler update). */
extern const tdm_accum_ops tdm_accum_single_ops;

#ifdef __cplusplus
}
#endif

#endif
