/* ddp/hooks.h: DDP communication hooks (PyTorch's
 * DistributedDataParallel.register_comm_hook). The Reducer hands each
 * complete bucket to the hook instead of all-reducing it itself: `launch`
 * is called as soon as the bucket is complete (during backward, in bucket
 * order on every rank) and must start the bucket's communication without
 * waiting for peers (submit asynchronous collectives: tdm_comm_*_async),
 * so that overlap with the rest of backward is kept; `wait` is called
 * after backward, in bucket order, and returns once the bucket's
 * gradients hold their reduced values. Both run on the training thread.
 * Every rank must issue the same collectives in the same order, which it
 * does when the hook's collectives depend only on the bucket (its size,
 * its parameters) and the step.
 *
 * What "reduced" means: tandem scales the loss gradient by 1/B_global
 * (ddp/ddp.h), so the SUM over ranks of the local gradients *is* the
 * average gradient; a hook SUM-reduces (dividing by the world size as
 * PyTorch's allreduce_hook does would be wrong here).
 *
 * The bucket a hook sees excludes the Reducer's check tail (forward
 * counts and loss sums, which must stay exact): with a hook the Reducer
 * all-reduces the tail itself, in float32, right after launching the
 * bucket that carries it. An error returned by either function fails that
 * backward on this rank with the hook's message and aborts the group, so
 * every other rank fails too, quoting it ("aborted by rank 1: ...").
 *
 * Built-ins (tdm_ddp_hook_builtin_init; `tandem train|compare --comm-hook`):
 * - allreduce: float32 SUM, as without a hook (only useful through the API).
 * - fp16 / bf16: each rank rounds its bucket to IEEE binary16 / bfloat16
 *   (to nearest even), all-reduces the 16-bit values (half the bytes) and
 *   widens the result. Over shm the sum is accumulated in float32 in rank
 *   order and rounded once to 16 bits at the end, so the result is the
 *   16-bit rounding of the float32 sum of the rounded inputs (tested
 *   bit for bit): fp16 keeps 11 significant bits (relative error
 *   <= 2^-11 per rounding) but overflows above 65504 and flushes below
 *   6e-8 (subnormals keep less precision); bf16 keeps float32's range with
 *   8 significant bits (<= 2^-8). NCCL adds in the 16-bit type at each
 *   step of its ring, so there error grows with the rank count.
 * - powersgd (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank
 *   Gradient Compression for Distributed Optimization", NeurIPS 2019,
 *   and torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook): for
 *   every parameter of two or more dimensions, viewed as an n x m matrix
 *   (shape[0] x the rest) whose rank-r factors are smaller than it
 *   ((n + m) r < n m): M = gradient + error (error feedback), P = M Q
 *   (Q: m x r, the last step's Q: warm start; random N(0,1), the same on
 *   every rank, at first), all-reduce P, orthonormalise its columns
 *   (Gram-Schmidt), Q = M^T P, all-reduce Q, gradient = P Q^T, and the
 *   error = M - P Q^T / world (this rank's share of what the
 *   approximation missed). Vectors (biases, batchnorm) and matrices too
 *   small to gain are all-reduced uncompressed in float32, in the same
 *   collective as P. Before `start_step` synchronised backwards every
 *   bucket is all-reduced uncompressed (PyTorch's start_powerSGD_iter).
 *   P's all-reduce is launched during backward; Q's depends on it and so
 *   runs in `wait`, after backward (exposed). Host devices only.
 */
#ifndef TDM_DDP_HOOKS_H
#define TDM_DDP_HOOKS_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One bucket, as the Reducer hands it to a hook. */
typedef struct tdm_ddp_hook_bucket {
    int index;                   /* bucket index; 0 is launched first */
    float *grads;                /* the bucket's gradients, n_elem floats (model's device) */
    int64_t n_elem;              /* alignment padding included, check tail excluded */
    int64_t offset;              /* of grads[0] in the model's flat gradient buffer */
    int first_param, last_param; /* parameter indices (tdm_model_param_info) */
    tdm_model *model;            /* borrowed */
    tdm_comm *comm;              /* borrowed: the gradients' communicator */
    int64_t step;                /* synchronised backwards completed before this one */
    int64_t timeout_ms;          /* for wait's own waits; < 0: the communicator's */
    double bytes;                /* set by launch: the bytes this bucket all-reduces */
    void *work;                  /* the hook's, from launch to wait */
} tdm_ddp_hook_bucket;

typedef struct tdm_ddp_comm_hook {
    const char *name;
    void *state;                 /* the hook's; borrowed by the Reducer */
    tdm_status (*launch)(void *state, tdm_ddp_hook_bucket *b);
    tdm_status (*wait)(void *state, tdm_ddp_hook_bucket *b);
    /* Optional: releases state (tdm_ddp_hook_builtin_free, or tdm_ddp_free
     * for a hook registered with ownership). */
    void (*free)(void *state);
} tdm_ddp_comm_hook;

typedef struct tdm_ddp_powersgd_opts {
    int rank;                    /* r; 0: 1 (PyTorch's matrix_approximation_rank) */
    int64_t start_step;          /* plain all-reduce before this many synchronised backwards */
    uint64_t seed;               /* Q's initial draw (every rank must use the same) */
    int no_error_feedback;       /* 1: drop the error (tests show what it buys) */
    int no_warm_start;           /* 1: a fresh random Q every step */
} tdm_ddp_powersgd_opts;

/* "allreduce", "fp16", "bf16" or "powersgd" (INVALID_ARG listing them
 * otherwise). popts: PowerSGD's (NULL: defaults). On success *out holds
 * an allocated state; release it with tdm_ddp_hook_builtin_free. */
tdm_status tdm_ddp_hook_builtin_init(tdm_ddp_comm_hook *out, const char *name,
                                     const tdm_ddp_powersgd_opts *popts);
void tdm_ddp_hook_builtin_free(tdm_ddp_comm_hook *h);
/* 1 when name is a built-in's. */
int tdm_ddp_hook_known(const char *name);

#ifdef __cplusplus
}
#endif

#endif
