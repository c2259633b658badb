/* dist/det.h: world-size-invariant training (--deterministic K). The
 * global batch is cut into K fixed virtual shards (K a power of two,
 * shard k = tdm_dist_share(batch, k, K)); rank r of N computes the
 * gradients of shards r*K/N .. (r+1)*K/N - 1, one forward and backward
 * each with the shapes of a shard whatever N is and the loss gradient
 * scaled by 1/(the global batch), and every shard's gradient is summed in
 * one fixed binary tree over the K shards: each rank reduces its subtree
 * (K/N leaves, left + right at every node) on the host, the subtree sums
 * are all-gathered over the process group, and every rank adds the top
 * log2(N) levels in the same order. The all-gather goes in chunks of at
 * most chunk_elems floats per rank, each added up as it arrives: the
 * host memory it needs is N chunks (N MiB by default), not N models,
 * and the additions, elementwise, are the same. The sum is then the very bits one
 * device gets running the K shards one after the other, so the whole
 * trajectory (losses, parameters, optimizer state, checkpoints) depends
 * on the seed, the data, the hyper-parameters and K only.
 *
 * Buffers (batchnorm's running statistics): every shard's forward starts
 * from the step's buffers, so each shard's update is (1-m) r + m s_k for
 * its own statistics s_k; the step's new buffers are the tree sum of
 * those K updates times 1/K (exact: K is a power of two), that is the
 * update by the mean of the K shards' statistics, whatever N is. The
 * statistics a forward normalises with are the shard's own (per-shard
 * batchnorm).
 *
 * Gradient accumulation: each micro-batch of the step is cut into K
 * shards and summed by the tree across the ranks; the micro-batches' sums
 * are added in their order. The per-shard loss sums ride with the subtree
 * sums and are added in shard order, so the printed losses are
 * N-invariant too.
 *
 * What it is not: a replacement for a design's collectives in general.
 * The ops run a shard's forward and backward with no collective of
 * gradients (DDP under no_sync, one device as is); the tree here is the
 * only gradient reduction: over the host group, or with dev_comm over
 * NCCL as an all-gather with the top levels added in the same order on
 * the device (no NCCL reduction order is relied upon). */
#ifndef TDM_DIST_DET_H
#define TDM_DIST_DET_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "dist/step.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most virtual shards (and the most ranks of a deterministic job). */
#define TDM_DIST_DET_MAX_K 1024
/* The most bytes per rank one all-gather of the subtree sums carries: the
 * gather buffer is world times this, whatever the model (the whole
 * model's sums per rank made it N x the model on every rank); 1 MiB keeps
 * each collective's fixed cost small beside its transfer. */
#define TDM_DIST_DET_CHUNK_BYTES ((int64_t)1 << 20)

/* USAGE with a one-line reason unless K is a power of two in
 * [1, TDM_DIST_DET_MAX_K], world (> 0) divides K and K divides batch:
 * "--deterministic 6: K must be a power of two (1, 2, 4, 8, ...)". */
tdm_status tdm_dist_det_check(int K, int world, int64_t batch);

/* What a design does for one shard. Every op is local (no collective of
 * gradients); a design whose forward takes part in collectives of its
 * own (DDP's buffer broadcast) is called the same number of times on
 * every rank: once per shard, empty shards (n = 0) included. */
typedef struct tdm_dist_det_ops {
    tdm_status (*zero_grad)(void *ctx);
    /* Forward, loss (its gradient times scale) and backward of n samples
     * at host x, y, adding into the zeroed gradients; *loss_sum: the sum
     * of their per-sample losses. */
    tdm_status (*shard)(void *ctx, const void *x, const int32_t *y, int n, float scale,
                        double *loss_sum);
    /* The optimizer step on the summed gradients. */
    tdm_status (*step)(void *ctx);
    /* Optional (dist/step.h's of the same names): the local gradient
     * into host, the summed one from host, in the model's flat layout.
     * NULL: the model's flat gradient buffer is both. */
    tdm_status (*local_grads)(void *ctx, float *host);
    tdm_status (*set_grads)(void *ctx, const float *host);
} tdm_dist_det_ops;

/* The ops of one device over a tdm_single (models/train.h). */
extern const tdm_dist_det_ops tdm_dist_det_single_ops;
/* The ops of a data-parallel design over a tdm_dist_stepper s (their
 * ctx): its zero_grad, forward and backward under no_sync, its step, and
 * its local_grads and set_grads where it has them. */
const tdm_dist_det_ops *tdm_dist_det_stepper_ops(const tdm_dist_stepper *s);

/* A deterministic step's context. Fill the public part, then call
 * tdm_dist_det_init; tdm_dist_det_free frees what init made. */
typedef struct tdm_dist_det {
    const tdm_dist_det_ops *ops;  /* NULL: leaves are fed (tdm_dist_det_feed) */
    void *ctx;                   /* the ops' */
    tdm_model *m;                /* the replica whose gradients and buffers are summed */
    /* m NULL (fed leaves only): a design's own flat gradients, flat_elems
     * floats of device memory on flat_dev, and no buffers */
    float *flat_grads;
    int64_t flat_elems;
    tdm_device *flat_dev;
    tdm_comm *comm;              /* the host process group; NULL with one rank */
    /* Optional, with comm: a communicator on device memory (NCCL on a
     * GPU) with comm's ranks. The subtree sums then go through it: each
     * chunk copied to the device, all-gathered there, the top levels
     * added there (tdm_dev_axpy with alpha 1: one rounding per addition,
     * the host's bits) and the sum copied back. NULL: all-gathered over
     * comm in host memory. Either way the same bits. */
    tdm_comm *dev_comm;
    int rank, world, K;
    int in_elems, out_rows;      /* per sample: 4-byte inputs, targets */
    /* 0: a step's x, y hold the whole global batch; 1: only this rank's
     * rows, [rank*B/N, (rank+1)*B/N) of a global batch of global_batch */
    int own_rows;
    int global_batch;
    int micro;                   /* samples per micro-batch (--grad-accum); 0: the batch */
    /* Called before each optimizer step with its number (from 1 over
     * the run): a test's fault hook. May be NULL. */
    void (*before)(void *ctx, int64_t step);
    void *before_ctx;
    /* Several ranks in one process (DP's devices): comm NULL, and every
     * rank's context shares one gather buffer of world * n_send floats
     * (set gather, and gather_borrowed 1, after tdm_dist_det_init of the
     * first has sized it; tdm_dist_det_free leaves it). */
    int gather_borrowed;
    float *gather;               /* (world, n_send) the ranks' subtree sums; over a
                                    comm: (world, chunk) one chunk of them */
    /* Floats per rank in one all-gather over comm; 0:
     * TDM_DIST_DET_CHUNK_BYTES' worth. Any value gives the same bits. */
    int64_t chunk_elems;
    /* ---- internal ---- */
    int64_t begun;
    int64_t n_vec;               /* gradient elements + buffer elements */
    int64_t n_send;              /* n_vec + this rank's shard losses (2 floats each) */
    int depth, max_depth;
    int *level;                  /* (max_depth) the tree level of each stacked sum */
    float *stack;                /* (max_depth, n_vec) the pending subtree sums */
    float *total;                /* (n_vec) the step's sum over micro-batches */
    int64_t chunk;               /* over a comm: floats per rank per all-gather; 0: none */
    float *sum;                  /* over a comm: (n_vec) the tree's top over the ranks */
    float *stage;                /* over a comm: (chunk) a chunk with this rank's losses */
    float *dstage, *dgather;     /* over dev_comm, device memory: (chunk), (world, chunk) */
    float *snapshot;             /* (buffer elements) the step's buffers */
    double *losses;              /* (K) the shards' loss sums */
} tdm_dist_det;

tdm_status tdm_dist_det_init(tdm_dist_det *d);
void tdm_dist_det_free(tdm_dist_det *d);

/* A tdm_train_step_fn over a tdm_dist_det: one optimizer step over a
 * global (effective) batch of `batch` samples at x, y (see own_rows).
 * Collective. *loss_mean: the batch's mean loss, the same bits on every
 * rank and for every N. */
tdm_status tdm_dist_det_step(void *det, const void *x, const int32_t *y, int batch,
                             double *loss_mean);

/* The pieces of tdm_dist_det_step, for a design that runs several ranks
 * in one process (DP): at the step's start, the model's buffers as every
 * shard's starting point (snapshot); this rank's subtree of one
 * micro-batch of b samples (row0: the global row x starts at) into its
 * slot of gather (local); the tree's top over the slots (collective over
 * comm when there is one) with the micro-batch's loss sum; the micro-batch
 * added to the step's total (accumulate, in micro-batch order); the
 * total made the model's gradient and buffers and the step taken
 * (apply). */
tdm_status tdm_dist_det_snapshot(tdm_dist_det *d);
tdm_status tdm_dist_det_local(tdm_dist_det *d, const void *x, const int32_t *y, int b,
                              int64_t row0, float scale);
tdm_status tdm_dist_det_top(tdm_dist_det *d, double *loss_sum);
void tdm_dist_det_accumulate(tdm_dist_det *d, int micro_index);
tdm_status tdm_dist_det_apply(tdm_dist_det *d, int n_micro);
/* apply without the optimizer step: the step's sum written into the
 * model's gradients and buffers (those through set_grads where the ops
 * have it). */
tdm_status tdm_dist_det_write(tdm_dist_det *d, int n_micro);
/* A step of one micro-batch: its top written as tdm_dist_det_write
 * writes the step's sum, straight from where tdm_dist_det_top left it
 * (no tdm_dist_det_accumulate, no copy). */
tdm_status tdm_dist_det_write_top(tdm_dist_det *d);

/* A design that runs the shards itself (a pipeline's micro-batches are
 * its virtual shards): ops may then be NULL (the model's flat gradients
 * are read and written). After the forward and backward of this rank's
 * j-th shard (j = 0 .. K/world - 1, in order; shard rank*K/world + j),
 * from zeroed gradients, the model's gradients and buffers are that
 * shard's alone: feed takes them as the next leaf of the rank's subtree,
 * with the shard's loss sum (0 where it is not known: a pipeline's first
 * stages; the caller checks that the step's sum is finite). Then tdm_dist_det_top, tdm_dist_det_accumulate and tdm_dist_det_write
 * (or apply) as for tdm_dist_det_local's. */
tdm_status tdm_dist_det_feed(tdm_dist_det *d, int j, double loss);

#ifdef __cplusplus
}
#endif

#endif
