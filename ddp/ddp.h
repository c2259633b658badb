/* ddp/ddp.h: DistributedDataParallel over one model replica per process.
 *
 * tdm_ddp_init checks that every rank has the same parameter layout and
 * bucket plan (naming the rank and tensor that differ), broadcasts
 * parameters and buffers from rank 0, moves the gradient buffer into
 * communicator memory (tdm_comm_alloc: zero-copy all-reduce) and plans
 * buckets as PyTorch's DDP does (compute_bucket_assignment_by_size): each
 * parameter joins the open bucket, which closes once it holds at least
 * the limit (first_bucket_bytes for the first bucket closed, the bucket
 * cap after it); a parameter is never split. Without
 * find_unused_parameters the first synchronised backward reduces every
 * gradient as one bucket and records the order in which they became
 * ready; the next one re-plans the buckets in that order (PyTorch's
 * rebuild; every rank must get the same plan, and a rank that does not is
 * named) and that plan holds from then on. With find_unused_parameters the
 * plan is made once, walking the parameters in definition order, and
 * bucket 0 holds the last ones. A bucket is a contiguous view of the flat
 * gradient buffer. The Reducer (the model's grad-ready hook) launches each
 * bucket's asynchronous all-reduce (or hands it to a communication hook:
 * ddp/hooks.h) as soon as it is complete, strictly in bucket order, while
 * backward continues.
 *
 * Gradient semantics: tdm_ddp_forward scales the loss gradient so that a
 * SUM all-reduce gives the gradient of the global batch's mean loss:
 * tdm_ddp_forward_scaled with grad_scale 1/B_global is exact for any split
 * of the global batch (uneven shares included); tdm_ddp_forward uses
 * 1/(B_local * world), which is PyTorch's mean-loss-then-AVG (exact when
 * every rank has the same B_local). The order of the summation is the
 * communicator's. The shm communicator adds in rank order in every
 * algorithm, so every rank gets bitwise the same gradient, with or without
 * overlap and whatever the bucket plan. NCCL adds in its own order (ring
 * or tree, chosen by message size), so results equal shm's within
 * rounding, not bitwise; its algorithms reduce each element once and pass
 * the result on, so the ranks still receive the same values.
 *
 * Uses only core/comm.h: it does not create communicators (dist/pg.h does)
 * and knows nothing of processes (dist/spawn.h, tools/launch.c). */
#ifndef TDM_DDP_DDP_H
#define TDM_DDP_DDP_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/data.h"
#include "core/status.h"
#include "core/timer.h"
#include "ddp/hooks.h"
#include "dist/batch.h"
#include "dist/step.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Zero-initialised options are the defaults. */
typedef struct tdm_ddp_opts {
    double bucket_cap_mb;        /* bucket cap in MiB; 0: 25 */
    size_t bucket_cap_bytes;     /* when non-zero, overrides bucket_cap_mb (tests) */
    size_t first_bucket_bytes;   /* limit of the first bucket closed; 0: 1 MiB (never above
                                    the cap; PyTorch's _DEFAULT_FIRST_BUCKET_BYTES) */
    int no_overlap;              /* 1: all-reduce every bucket after backward */
    int no_broadcast_buffers;    /* 1: do not broadcast buffers at each forward */
    /* 1: a parameter whose grad-ready hook has not fired by the end of a
     * synchronised backward took no part in the step, and its gradient is
     * reduced as it stands (zeros, or what no_sync accumulated); 0: that
     * backward fails naming it. Also selects PyTorch's plan for it (see
     * above): made once, never rebuilt. */
    int find_unused_parameters;
    int64_t timeout_ms;          /* bound on each bucket wait; 0: the communicator's */
    /* 1: uneven inputs (PyTorch's Join): every training forward first
     * all-reduces how many ranks still have data (one int32 over
     * host_comm), tdm_ddp_forward divides by that count instead of the
     * world size, and a rank out of data calls tdm_ddp_join, which
     * shadows the others' steps until every rank has joined. */
    int join;
    /* 1: SyncBatchNorm (PyTorch's convert_sync_batchnorm): the model's
     * batchnorm layers compute their training statistics over all ranks
     * (tdm_model_set_sync_bn; two float64 all-reduces over host_comm per
     * layer in forward, one in backward), so DDP's CNN computes what one
     * device computes on the whole global batch. On accelerators the
     * statistics are staged through the host (correct, not fast); every
     * rank needs a sample in every step; not with join. */
    int sync_bn;
    /* Borrowed, optional: the communicator for the few collectives on host
     * memory (the layout and plan checks, evaluation's sums, checkpoint
     * flags), with the same
     * ranks as comm. Needed when comm only takes device memory (NCCL: pass
     * the shm communicator it was bootstrapped over); NULL: comm. */
    tdm_comm *host_comm;
} tdm_ddp_opts;

typedef struct tdm_ddp tdm_ddp;

/* Per-bucket times of the last synchronised backward, in ms from the
 * start of backward. end_ms is when the Reducer first saw the work done. */
typedef struct tdm_ddp_bucket_times {
    double ready_ms, start_ms, end_ms;
} tdm_ddp_bucket_times;

/* Times of the last step, and sums over all steps since init. Bucket
 * completion is only observed at the next grad-ready hook, so comm_ms
 * over-estimates; the exposed wait (ALLREDUCE_WAIT) is exact, and
 * overlapped_bytes / reduced_bytes is the share of the gradients whose
 * all-reduce was launched while backward was still computing. */
typedef struct tdm_ddp_times {
    tdm_phase_times last;        /* FORWARD, LOSS, BACKWARD (compute), ALLREDUCE_WAIT, STEP */
    tdm_phase_times total;
    int64_t steps;               /* synchronised backwards counted in total */
    double comm_ms_last;         /* first bucket start to last bucket end */
    double comm_ms_total;
    double exposed_ms_total;     /* = total.ms[ALLREDUCE_WAIT] */
    double reduced_bytes_total;  /* bytes all-reduced (padding and check tail included;
                                    with a comm hook, what the hook reported) */
    double overlapped_bytes_total; /* of which launched while backward still ran */
    int n_buckets;
    const tdm_ddp_bucket_times *buckets;   /* borrowed; last backward */
} tdm_ddp_times;

/* Builds the Reducer around m (borrowed; its gradient storage and hook
 * are taken over until tdm_ddp_free). Collective: every rank calls it. */
tdm_status tdm_ddp_init(tdm_ddp **out, tdm_model *m, tdm_comm *comm, const tdm_ddp_opts *opts);
/* Gives the model back its own gradient storage (copying the gradients)
 * and removes the grad-ready hook. Call before freeing the communicator.
 * NULL is a no-op. */
void tdm_ddp_free(tdm_ddp *d);

tdm_model *tdm_ddp_model(tdm_ddp *d);
tdm_comm *tdm_ddp_comm(tdm_ddp *d);

/* The current plan: one bucket from init until the first synchronised
 * backward has run (without find_unused_parameters), then the plan
 * rebuilt at the start of the next one. Bucket b holds parameters
 * first..last (first <= last; bucket 0 holds the last parameters, the
 * ones backward finishes first) as the view [offset, offset + n_elem) of
 * the flat gradient buffer (alignment padding included; the bucket of the
 * last parameter also carries the Reducer's 192-float check tail). */
int tdm_ddp_n_buckets(const tdm_ddp *d);
void tdm_ddp_bucket_info(const tdm_ddp *d, int b, int *first_param, int *last_param,
                         int64_t *offset, int64_t *n_elem);
/* Communication hooks (ddp/hooks.h): from the next synchronised backward
 * on, each complete bucket goes to the hook instead of the Reducer's own
 * float32 all-reduce. Register before the first forward, once (as in
 * PyTorch); every rank must register the same hook. The hook's state is
 * borrowed: it must outlive d. */
tdm_status tdm_ddp_register_comm_hook(tdm_ddp *d, const tdm_ddp_comm_hook *hook);
/* A built-in by name ("allreduce", "fp16", "bf16", "powersgd"; popts:
 * PowerSGD's options, NULL: defaults), its state owned by d. "allreduce"
 * keeps the Reducer's own path. The others need a host device
 * (UNSUPPORTED otherwise). */
tdm_status tdm_ddp_set_comm_hook(tdm_ddp *d, const char *name, const tdm_ddp_powersgd_opts *popts);
/* The registered hook's name; "allreduce" without one. */
const char *tdm_ddp_comm_hook_name(const tdm_ddp *d);
/* 1 when the gradients live in communicator memory (zero-copy). */
int tdm_ddp_zero_copy(const tdm_ddp *d);
/* The communicator memory (tdm_comm_alloc; the shm arena of
 * tdm_dist_spawn_opts and tandem launch --arena-mb) that zero-copy
 * gradients of a model of param_elems elements take. */
size_t tdm_ddp_arena_bytes(int64_t param_elems);

tdm_status tdm_ddp_zero_grad(tdm_ddp *d);

/* Evaluation spread over the ranks (collective): each rank evaluates its
 * share of the rows of test (tdm_dist_share) in eval mode, with rank 0's buffers
 * (broadcast first, so that batchnorm's running statistics are the same
 * on every rank), and the loss and correct counts are all-reduced: every
 * rank gets the whole set's mean loss and accuracy, in about 1/W of the
 * time one rank would take, and no rank idles while one evaluates alone.
 * Its forwards overwrite the model's activations: a forward not yet gone
 * back through is dropped (its loss is not counted), and a backward
 * before the next tdm_ddp_forward is refused (INVALID_ARG). */
tdm_status tdm_ddp_evaluate(tdm_ddp *d, const tdm_dataset *test, int batch, double *loss_mean,
                            double *accuracy);
/* The loss sum of this rank's `batch` samples (host x, y as for
 * tdm_ddp_forward; batch may be 0) in eval mode, on this replica alone:
 * no collective, the buffers as they are (a GPT's evaluation windows,
 * each rank its share, the sums added by the caller). Replaces a pending
 * forward's activations as tdm_ddp_evaluate does. */
tdm_status tdm_ddp_eval_loss(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                             double *loss_sum);

/* Local forward and loss over this rank's samples (host x (batch, in) of
 * the model's input dtype, y (batch * out_rows)); broadcasts buffers from
 * rank 0 first (training mode, unless disabled). Gradient of the loss
 * scaled by 1/(batch*world); *loss_mean is this rank's mean loss. batch
 * may be 0 (the rank still takes part). */
tdm_status tdm_ddp_forward(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                           double *loss_mean);
/* Same with an explicit loss-gradient scale (1/B_global for a split
 * global batch); *loss_sum is the sum of this rank's per-sample losses.
 * With opts.join the scale is meant for every rank: it is multiplied by
 * world / (the ranks with data in this forward), the mean over those
 * that contribute (as tdm_ddp_forward's 1/(batch * active ranks)). */
tdm_status tdm_ddp_forward_scaled(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                  float grad_scale, double *loss_sum);
/* The forward of a rank that holds the whole global batch: x holds its
 * `batch` samples (host, the model's input dtype), y their batch *
 * out_rows targets; this rank runs its share, samples [lo, hi) of
 * tdm_dist_share(batch, rank, world), with the loss gradient scaled by
 * 1/batch (tdm_ddp_forward_scaled), so that the SUM all-reduce gives the
 * global batch's mean-loss gradient exactly, uneven shares included. A
 * rank whose share is empty (batch < world) still takes part. *loss_sum
 * (may be NULL) is the sum of its share's per-sample losses;
 * tdm_ddp_loss_sum after backward has every rank's. */
tdm_status tdm_ddp_forward_global(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                  double *loss_sum);
/* The same with an explicit loss-gradient scale: gradient accumulation
 * passes 1/(the effective batch) for each of its micro-batches. */
tdm_status tdm_ddp_forward_global_scaled(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                         float grad_scale, double *loss_sum);
/* Backward of the last forward (refused when there is none, or when
 * tdm_ddp_evaluate ran since); in sync mode, all-reduces the gradients
 * (bucket by bucket, overlapped) and returns once all are reduced. On a
 * communication error the communicator is aborted (the other ranks stop)
 * and the error names the failing rank. */
tdm_status tdm_ddp_backward(tdm_ddp *d);
/* The gradients the levers read after a synchronised backward (loss
 * scaling, clipping: dist/step.h): the replica's whole flat gradient,
 * alike on every rank (replicated). Local. */
tdm_status tdm_ddp_grad_bufs(tdm_ddp *d, tdm_dist_grads *out);
/* For a design that runs the model's backward itself (a pipeline stage,
 * whose backward starts from an activation's gradient rather than from a
 * loss this wrapper computed): a synchronised backward in two halves
 * around the caller's own tdm_model_backward (or stage backward). Between
 * them the Reducer's grad-ready hook launches each bucket's all-reduce as
 * the caller's backward completes it, exactly as in tdm_ddp_backward; end
 * waits for them all and checks, through the Reducer's check tail, that
 * every rank ran as many synchronised backwards (counted by begin).
 * Backwards outside the halves (a pipeline's earlier micro-batches) only
 * accumulate. loss_sum: this rank's part of the loss (0 where it has
 * none), summed over the ranks into tdm_ddp_loss_sum. backward_status:
 * the caller's backward's; a failure aborts the communicator (the other
 * ranks stop) and is returned. */
tdm_status tdm_ddp_sync_begin(tdm_ddp *d, double loss_sum);
tdm_status tdm_ddp_sync_end(tdm_ddp *d, tdm_status backward_status);
/* Both halves with no backward between them, for a rank without samples
 * in this step (a pipeline replica's empty share of a short global
 * batch): it takes part in the synchronised backward as a rank with an
 * empty forward does in tdm_ddp_backward, its gradients reduced as they
 * stand (zeros after zero_grad; a no_sync accumulation otherwise), its
 * loss 0. Collective with the others' sync_begin/_end. */
tdm_status tdm_ddp_sync_empty(tdm_ddp *d);
/* Sum over all ranks of the per-sample losses of the forwards reduced by
 * the last synchronised backward (no_sync micro-batches included), carried
 * by that backward's all-reduce: no extra collective. Divide by the
 * global batch for the mean. */
double tdm_ddp_loss_sum(const tdm_ddp *d);

/* Uneven inputs (opts.join): called by a rank that has run out of data,
 * collectively with the others' remaining steps. Until every rank has
 * joined it shadows each step of the ranks still training - the count
 * all-reduce, the buffer broadcast, the gradient all-reduces with zeros
 * (a rank without samples contributes nothing) - and takes the optimizer
 * step on the reduced gradient like them, so its parameters stay
 * bitwise the same; returns once every rank has joined (each joined
 * rank's count all-reduce then gives 0). The others may accumulate
 * under tdm_ddp_no_sync: the count all-reduce also says whether their
 * forward synchronises, and for a no_sync one this rank shadows only the
 * count and the buffer broadcast (no backward, no step). *shadowed (may
 * be NULL): the synchronised steps it shadowed. opt may be NULL (no step: parameters then lag).
 * The reduced gradient of a step is the sum of the active ranks'
 * gradients; with tdm_ddp_forward (scale 1/(batch * active ranks)) the
 * mean over the ranks that contributed. */
tdm_status tdm_ddp_join(tdm_ddp *d, tdm_optim *opt, int64_t *shadowed);
/* Ranks that contributed to the last training forward (opts.join; else
 * the world size). */
int tdm_ddp_active_ranks(const tdm_ddp *d);

/* Optimizer step, timed. */
tdm_status tdm_ddp_step(tdm_ddp *d, tdm_optim *opt);

/* no_sync: while enabled, backward only accumulates local gradients; the
 * next synchronised backward reduces the accumulated sum. */
void tdm_ddp_no_sync(tdm_ddp *d, int enable);

void tdm_ddp_get_times(const tdm_ddp *d, tdm_ddp_times *out);

/* DDP's per-step ops (dist/step.h) over a tdm_ddp: what dist/ builds a
 * training step, gradient accumulation and uneven inputs from. */
extern const tdm_dist_ops tdm_ddp_dist_ops;

/* Rank 0 writes (atomically); every rank learns whether it succeeded. */
tdm_status tdm_ddp_checkpoint_save(tdm_ddp *d, const char *path, tdm_optim *opt,
                                   const tdm_ckpt_info *info);
/* Every rank loads the file, after a barrier. */
tdm_status tdm_ddp_checkpoint_load(tdm_ddp *d, const char *path, tdm_optim *opt,
                                   tdm_ckpt_info *info);

#ifdef __cplusplus
}
#endif

#endif
