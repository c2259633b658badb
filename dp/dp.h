/* dp/dp.h: DataParallel: one process, one thread per device, and
 * torch.nn.DataParallel's data flow every step:
 *
 *   replicate  master params+buffers -> every active replica
 *   scatter    the batch along dim 0 -> per-device chunks (torch.chunk sizes)
 *   forward    every replica on its chunk, at once (parallel_apply)
 *   gather     the chunks' logits -> (B, classes) on the output device
 *   loss       softmax cross-entropy over the whole batch, scale 1/B
 *   scatter    the logit gradients back to the devices
 *   backward   every replica at once
 *   reduce     reduce-add every replica's gradients onto the master
 *              (the backward of replicate)
 *   step       the optimizer, on the master only
 *
 * The master model lives on the output device and *is* that device's
 * replica (like PyTorch's replica 0, which shares the module's storage):
 * its buffers (batchnorm running statistics) are updated in place by its
 * own chunk's forward and kept; the other replicas are clones made once at
 * init and refreshed each step by one copy of the flat parameter buffer
 * and one of the flat buffer buffer. Each replica's batchnorm normalises
 * with its own chunk's statistics, exactly as in PyTorch DP.
 *
 * The memory levers (docs/MEMORY.md) are the master's: the replicas take
 * its precision and activation checkpointing at every forward (set them
 * on the master, before or after tdm_dp_init); tdm_dp_step_levers adds
 * fp16's loss scaling and gradient clipping on the master's summed
 * gradients, so that one decision covers every replica.
 *
 * The four operations are public for users' own programs. Not here: the
 * multiprocess DDP (ddp/), data loading, the CLI. */
#ifndef TDM_DP_DP_H
#define TDM_DP_DP_H

#include <stdint.h>

#include "core/device.h"
#include "core/status.h"
#include "core/timer.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_DP_MAX_DEVICES 64

typedef struct tdm_dp tdm_dp;

typedef struct tdm_dp_opts {
    int output_device;  /* position in the device list; the master must live there (default 0) */
    int spin_us;        /* pool waits spin this long before sleeping; < 0: auto (default -1:
                           50 us when devices <= cores, else 0) */
    int allow_same_device; /* 1: accept two handles (tdm_device objects) on one accelerator,
                              e.g. cuda:0 opened twice: replicas on separate streams and
                              threads, copies and reduce through the per-device path (a
                              one-GPU machine's test of DP; never faster than one handle).
                              Default 0: a device listed twice is refused. */
} tdm_dp_opts;

/* output_device 0, spin_us -1. */
void tdm_dp_opts_default(tdm_dp_opts *o);

/* What the last tdm_dp_step / tdm_dp_forward_backward spent where:
 * device[i] is the time device i's thread spent in each phase (its own
 * work only), wall the step's wall-clock per phase (the critical path of
 * each fork/join round, as the caller saw it). SCATTER holds both
 * scatters (inputs, then logit gradients); in tdm_dp_step, REPLICATE also
 * holds the master's zero_grad (done by all threads in that round) and
 * STEP the optimizer; ALLREDUCE_WAIT stays 0. */
typedef struct tdm_dp_timings {
    int n_devices;
    int n_active;                             /* devices with a non-empty chunk */
    int batch;
    int chunk[TDM_DP_MAX_DEVICES];            /* rows per device (0: idle) */
    tdm_phase_times device[TDM_DP_MAX_DEVICES];
    tdm_phase_times wall;
    double step_ms;                           /* whole step, wall-clock */
} tdm_dp_timings;

/* Opens the devices of a spec ("cpu:4", "cpu:0,2", "cuda:0,1") into
 * devices[0..*n_out), each host device with single-threaded BLAS.
 * devices must hold TDM_DP_MAX_DEVICES entries. A spec that does not parse
 * is TDM_STATUS_INVALID_ARG; a device that does not exist (a CUDA index
 * past the visible GPUs, any CUDA device in a build without CUDA) is
 * TDM_STATUS_NO_DEVICE. */
tdm_status tdm_dp_devices_open(const char *spec, tdm_device **devices, int *n_out);
void tdm_dp_devices_close(tdm_device **devices, int n);

/* Wraps master (borrowed; it must live on devices[output_device]) for DP
 * over devices (borrowed, distinct, all outlive the tdm_dp). Clones a
 * replica on every other device and starts one worker thread per other
 * device; the calling thread runs the output device's work. opts may be
 * NULL (defaults). */
tdm_status tdm_dp_init(tdm_dp **out, tdm_model *master, tdm_device **devices, int n_devices,
                       const tdm_dp_opts *opts);
void tdm_dp_free(tdm_dp *dp);   /* NULL ok; joins the workers */

int tdm_dp_n_devices(const tdm_dp *dp);
int tdm_dp_output_device(const tdm_dp *dp);
tdm_device *tdm_dp_device(const tdm_dp *dp, int i);
/* Replica i (the master for i == output device). */
tdm_model *tdm_dp_replica(const tdm_dp *dp, int i);
/* 1 when replicate and reduce use a device group (CUDA: NCCL broadcast and
 * reduce) whenever every device takes part in a step; 0 when every copy is
 * staged (host devices need neither). */
int tdm_dp_uses_device_group(const tdm_dp *dp);

/* --- the four operations (and the reduce) --- */

/* Copies the master's parameters and buffers (and training mode) onto
 * replicas 0..n_active-1 and zeroes those replicas' gradients (fresh
 * replicas, as PyTorch's have none); the master's gradients are left
 * alone. On host devices every thread copies one slice of the flat
 * buffers onto all replicas; on accelerators with a device group (CUDA:
 * NCCL) and every device active, one broadcast per flat buffer from the
 * output device; otherwise each device's thread copies onto its own
 * replica (staged through the host between GPUs). n_active in
 * 1..n_devices. */
tdm_status tdm_dp_replicate(tdm_dp *dp, int n_active);

/* torch.chunk's split of batch rows over n_devices: chunk = ceil(batch /
 * n_devices) rows each, the last one short, ceil(batch / chunk) chunks in
 * all (fewer than n_devices when batch is small: 9 over 4 is 3,3,3).
 * With explicit_sizes (n_devices entries), those are checked (each >= 0,
 * sum == batch) and used. sizes_out gets n_devices entries (0: that device
 * gets nothing); *n_chunks_out (may be NULL) the number of non-empty ones.
 * batch must be >= 1. */
tdm_status tdm_dp_scatter_sizes(int batch, int n_devices, const int *explicit_sizes,
                                int *sizes_out, int *n_chunks_out);

/* Splits x (batch, row_elems) floats, which lives on src_dev (NULL: host
 * memory), along dim 0: device i gets rows [sum(sizes[<i]), +sizes[i]) in
 * chunks[i] (a device pointer on device i, room for sizes[i] rows; unused
 * when sizes[i] == 0). Each device's thread copies its own chunk. sizes
 * sum to batch (e.g. from tdm_dp_scatter_sizes). */
tdm_status tdm_dp_scatter(tdm_dp *dp, tdm_device *src_dev, const float *x, int batch,
                          int64_t row_elems, const int *sizes, float *const *chunks);

/* What parallel_apply runs on each replica, on that device's thread. */
typedef tdm_status (*tdm_dp_apply_fn)(void *ctx, int replica, tdm_model *replica_model,
                                      tdm_device *dev);

/* Runs fn on replicas 0..n_active-1 at once and returns when all have
 * returned. If any failed, returns the lowest failing replica's status
 * with the message "replica i on device <name>: <its message>"; the pool
 * stays usable. */
tdm_status tdm_dp_parallel_apply(tdm_dp *dp, int n_active, tdm_dp_apply_fn fn, void *ctx);

/* Concatenates chunks[i] (sizes[i] rows of row_elems floats, on device i)
 * along dim 0 into out (sum(sizes) rows) on the output device. */
tdm_status tdm_dp_gather(tdm_dp *dp, const float *const *chunks, const int *sizes,
                         int64_t row_elems, float *out);

/* Reduce-adds the gradients of replicas 0..n_active-1 other than the
 * master onto the master's (master += sum of the others, in device
 * order). On host devices each of the n_active threads sums one slice of
 * the flat gradient buffer over all replicas (a parallel reduce onto the
 * master); on accelerators with a device group and every device active,
 * one reduce-sum onto the master (NCCL); otherwise the caller stages each
 * replica's gradients on the output device and adds them there. */
tdm_status tdm_dp_reduce_grads(tdm_dp *dp, int n_active);

/* --- whole steps --- */

/* DP forward + loss + backward over x (batch, in_features; the model's
 * input dtype) and y (batch * out_rows targets) in host memory: replicate, scatter, forward, gather, loss (mean over the
 * global batch), scatter of the logit gradients, backward, reduce. The
 * master's gradients are *added to* (as tdm_model_forward_backward and
 * PyTorch's backward do). chunk_sizes: NULL for torch.chunk's split, or
 * n_devices explicit sizes. *loss_mean (may be NULL): the batch's mean loss.
 * On failure the master's parameters are untouched, its gradients
 * unspecified. */
tdm_status tdm_dp_forward_backward(tdm_dp *dp, const void *x, const int32_t *y, int batch,
                                   const int *chunk_sizes, double *loss_mean);

/* The same with the default split and an explicit loss-gradient scale
 * (gradient accumulation: 1/(the effective batch), so that the
 * micro-batches' gradients add up to the effective batch's mean-loss
 * gradient); *loss_sum (may be NULL): the sum of the per-sample losses. */
tdm_status tdm_dp_forward_backward_scaled(tdm_dp *dp, const void *x, const int32_t *y,
                                          int batch, float grad_scale, double *loss_sum);

/* One training step: zero the master's gradients (inside the replicate
 * round, sliced over the threads), tdm_dp_forward_backward with the
 * default split, then tdm_optim_step(opt) (opt built on the master). On
 * accelerators it returns once the master's update has completed. */
tdm_status tdm_dp_step(tdm_dp *dp, tdm_optim *opt, const void *x, const int32_t *y, int batch,
                       double *loss_mean);

/* tdm_dp_step with the levers of s (models/train.h; s->model must be the
 * master, s->opt its optimizer): with s->scaler the loss gradient is
 * multiplied by the loss scale, and after the reduce the master's
 * gradients (every replica's sum: a NaN or infinity in any replica's
 * gradient is in it) are unscaled and checked once, the step skipped on
 * every replica alike when one is found; s->clip_norm > 0 clips the
 * global norm of that sum (s->measure_norm: measures it); s->last_norm
 * and s->last_skipped are set, as tdm_single_step sets them. Bitwise the
 * single-device step's arithmetic after the reduce. */
tdm_status tdm_dp_step_levers(tdm_dp *dp, tdm_single *s, const void *x,
                              const int32_t *y, int batch, double *loss_mean);

/* tdm_evaluate on the master, `batch` samples per forward, staged in the
 * output device's step buffers (grown to batch rows if smaller): at the
 * master's chunk of a step (ceil(B/N)) or less (train passes floor(B/N))
 * an evaluation between epochs allocates nothing the step does not hold
 * already. */
tdm_status tdm_dp_evaluate(tdm_dp *dp, const tdm_dataset *d, int batch, double *loss_mean,
                           double *accuracy);

/* Timings of the last tdm_dp_step / tdm_dp_forward_backward. */
const tdm_dp_timings *tdm_dp_last_timings(const tdm_dp *dp);

#ifdef __cplusplus
}
#endif

#endif
