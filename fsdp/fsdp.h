/* fsdp/fsdp.h: sharded data parallel over one model per process: ZeRO-1,
 * ZeRO-2 and FSDP (ZeRO-3), after PyTorch's FullyShardedDataParallel and
 * ZeroRedundancyOptimizer and DeepSpeed's ZeRO stages (docs/FSDP.md).
 *
 * The model's parameters are grouped into units: by default one per
 * architectural block (tdm_model_layer_block: each layer with parameters
 * of the MLP and CNN, each transformer block of the GPT plus its
 * embeddings and its final LayerNorm); min_unit_elems groups consecutive
 * blocks. A unit is a range of the parameter table and of the flat buffer
 * (alignment padding between tensors included), padded to a multiple of
 * the world size N and split into N equal shards: rank r owns shard r of
 * each unit's parameters, gradients and optimizer state, and the rank's
 * shards of all units lie end to end in one local buffer per kind, which
 * the optimizer steps as a few ranges (tdm_optim_step_ranges).
 *
 * Sharding strategies (PyTorch's ShardingStrategy / DeepSpeed's stage):
 * - FULL_SHARD (ZeRO-3): only shards persist. A unit's full parameters are
 *   all-gathered just before its forward (the next unit's gather is
 *   prefetched while this one computes) and freed when the forward moves
 *   on to another unit (the unit forward ends in is kept for backward),
 *   gathered again for backward, and freed once its gradients are final;
 *   its full gradients exist from its backward until their reduce-scatter
 *   into the owners' shards, launched as soon as the unit's backward is
 *   done and overlapped with the backward of earlier units.
 * - SHARD_GRAD_OP (ZeRO-2): full parameters persist (gathered once per
 *   step, after the optimizer step); gradients as in FULL_SHARD.
 * - SHARD_OPTIM (ZeRO-1, ZeroRedundancyOptimizer): full parameters and
 *   full gradients persist; gradients are reduce-scattered per unit (in
 *   place), each rank steps its shard, parameters are all-gathered.
 * In every strategy the reduce-scatters run in unit order (the last unit
 * first), whatever order gradients become ready in, so that every rank
 * issues the same collectives; the optimizer steps only the local shard.
 *
 * The layout (units, offsets, shard sizes, strategy and options) must be
 * the same on every rank, checked at construction; a difference names the
 * rank and the unit. Parameters and buffers are broadcast from rank 0 at
 * construction; buffers (batchnorm statistics) stay replicated and are
 * broadcast from rank 0 at each training forward, as DDP's
 * broadcast_buffers.
 *
 * Gradient semantics are DDP's: tdm_fsdp_forward_scaled with grad_scale
 * 1/B_global, and a SUM reduce-scatter, give the gradient of the global
 * batch's mean loss for any split of the batch. On shm the reduce-scatter
 * adds in rank order like shm's all-reduce, so every strategy's gradient
 * shard holds bitwise what DDP's all-reduced gradient holds there.
 *
 * Options from DDP's issue (docs/FSDP.md): comm_hook compresses the
 * reduce-scatters to fp16/bf16 (fsdp/comm_hook.c); join lets ranks with
 * different numbers of batches finish (tdm_fsdp_join, fsdp/join.c).
 *
 * Every rank must run the same layers in the same order in each pass (the
 * collectives follow the model's parameter-use events); a rank with no
 * samples in a step still takes part (FULL_SHARD runs the model on one
 * zero sample with a zero loss gradient, restoring its buffers after).
 *
 * Uses only core/comm.h (and ddp/'s process group, launcher and sampler
 * through their headers, in programs): never ddp/'s Reducer, never dp/. */
#ifndef TDM_FSDP_FSDP_H
#define TDM_FSDP_FSDP_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/data.h"
#include "core/status.h"
#include "core/timer.h"
#include "dist/step.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_fsdp_sharding {
    TDM_FSDP_FULL_SHARD = 0,   /* FSDP FULL_SHARD, ZeRO stage 3 ("full") */
    TDM_FSDP_SHARD_GRAD_OP,    /* FSDP SHARD_GRAD_OP, ZeRO stage 2 ("grad_op", "zero2") */
    TDM_FSDP_SHARD_OPTIM,      /* ZeroRedundancyOptimizer, ZeRO stage 1 ("optimizer", "zero1") */
    TDM_FSDP_SHARDING_COUNT_
} tdm_fsdp_sharding;

/* "full", "grad_op", "optimizer"; "?" when invalid. */
const char *tdm_fsdp_sharding_name(tdm_fsdp_sharding s);
/* "FULL_SHARD / ZeRO-3", ... (both families' names, for messages). */
const char *tdm_fsdp_sharding_describe(tdm_fsdp_sharding s);
/* Parses full|grad_op|optimizer, and the aliases full_shard, shard_grad_op,
 * zero3, zero2, zero1, 3, 2, 1; INVALID_ARG listing them otherwise. */
tdm_status tdm_fsdp_sharding_parse(const char *text, tdm_fsdp_sharding *out);

/* What one rank will hold on its device at its peak (fsdp/mem.c), before
 * anything is allocated: o describes the rank's model at its share of the
 * global batch (models/plan.h: its model-side figures in `model`), world
 * the ranks, min_unit_elems as tdm_fsdp_opts'. The step's peak is the
 * model's buffers, 16-bit weights, activations and scratch, the shards
 * (or full copies) the sharding keeps, the optimizer state over the
 * shard, the stage's loss gradient (comm) and the gathered units and full
 * gradients at their most (gathered; timing-bound: it counts a unit's
 * full gradient still being reduce-scattered beside the next one's, and
 * the next unit's parameters prefetched); the set-up's peak is the
 * model's flat buffers beside the new shards. With o->offload
 * TDM_PLAN_OFFLOAD_PARAMS (FULL_SHARD only, else INVALID_ARG) the shards
 * and the optimizer state are host memory (`host`, not in the peak), and
 * the set-up is that of a model built by tdm_model_init_released: its
 * buffers and 16-bit weights only (the units are drawn and scattered in
 * host memory). */
typedef struct tdm_fsdp_mem_plan {
    tdm_plan model;               /* the single-device plan of the rank's model */
    size_t shards;                /* parameter/gradient shards or full copies */
    size_t optim;                 /* optimizer state over the shard (0: offloaded) */
    size_t host;                  /* o->offload PARAMS: the shards and state in host memory */
    size_t comm;                  /* the loss gradient staged for the collectives' step */
    size_t gathered;              /* gathered units and full gradients at their most */
    size_t step_peak, init_peak, peak;
    int n_units;
    int64_t shard_elems, full_elems;
} tdm_fsdp_mem_plan;
tdm_status tdm_fsdp_plan_memory(const tdm_plan_opts *o, int world, tdm_fsdp_sharding sharding,
                                int64_t min_unit_elems, tdm_fsdp_mem_plan *out);

/* Compression of the gradient reduce-scatters (fsdp/comm_hook.c; PyTorch's
 * fp16_compress_hook / bf16_compress_hook registered on a sharded FSDP):
 * each unit's full local gradient is rounded to 16 bits (to nearest
 * even), the 16-bit values are reduce-scattered (half the bytes), and
 * the owner widens its slice into its gradient shard. On shm the sum is
 * accumulated in float32 in rank order and rounded once to 16 bits: each
 * element is the 16-bit rounding of the float32 sum of the ranks' rounded
 * values, bit for bit what DDP's fp16/bf16 hooks give it (ddp/hooks.h has
 * the precision of each format). ZeRO-1's gradient collective is the same
 * per-unit reduce-scatter (of its persistent full gradients), compressed
 * alike. Host devices only (the rounding runs on the CPU). PowerSGD is not
 * offered: its factors are all-reduced whole and its error feedback keeps
 * a full local gradient per rank, which a reduce-scatter into shards has
 * no place for (PyTorch's FSDP offers only these two for sharded
 * strategies). */
typedef enum tdm_fsdp_comm_hook {
    TDM_FSDP_HOOK_NONE = 0,      /* float32 reduce-scatter ("allreduce", "none") */
    TDM_FSDP_HOOK_FP16,          /* IEEE binary16 ("fp16") */
    TDM_FSDP_HOOK_BF16,          /* bfloat16 ("bf16") */
    TDM_FSDP_HOOK_COUNT_
} tdm_fsdp_comm_hook;

/* "allreduce" (DDP's name of the uncompressed default), "fp16", "bf16";
 * "?" when invalid. */
const char *tdm_fsdp_comm_hook_name(tdm_fsdp_comm_hook h);
/* Parses fp16, bf16, and allreduce or none (no compression). powersgd is
 * refused saying why; anything else lists the choices (INVALID_ARG). */
tdm_status tdm_fsdp_comm_hook_parse(const char *text, tdm_fsdp_comm_hook *out);

/* Where FULL_SHARD keeps this rank's shards (PyTorch's
 * CPUOffload(offload_params=True); `tandem train --offload params`).
 * PARAMS, for a model on an accelerator (a GPU or an emulated one): the
 * parameter shards, the gradient shards and the optimizer state over
 * them live in host memory (pinned where the device's backend has it,
 * tdm_dev_host_pin), and the optimizer steps on the host. Each unit's
 * gather first copies this rank's shard up into its slice of the unit's
 * gathered block and all-gathers in place; each reduce-scatter lands in
 * place in the unit's full gradient block and this rank's slice is copied
 * down into the host shard. The device then holds no shard at all: only
 * the gathered units and full gradients (as without offload), the model's
 * activations and buffers. The update is the same per-element function on
 * the same values, so the bits equal a run without offload (on the
 * emulator; a GPU: built, not run). FULL_SHARD only: grad_op and
 * optimizer keep full parameters on the device (INVALID_ARG). */
typedef enum tdm_fsdp_offload {
    TDM_FSDP_OFFLOAD_NONE = 0,
    TDM_FSDP_OFFLOAD_PARAMS,
} tdm_fsdp_offload;

/* Zero-initialised options are the defaults. */
typedef struct tdm_fsdp_opts {
    tdm_fsdp_sharding sharding;  /* default FULL_SHARD */
    /* Units: consecutive blocks are grouped until a unit holds at least
     * this many elements (PyTorch's size_based_auto_wrap_policy); 0: one
     * unit per block. */
    int64_t min_unit_elems;
    int no_prefetch;             /* 1: gather each unit when used, never ahead */
    int no_overlap;              /* 1: reduce-scatter after backward, not during */
    int no_broadcast_buffers;    /* 1: do not broadcast buffers at each forward */
    int64_t timeout_ms;          /* bound on each wait; 0: the communicator's. A wait past it
                                  * fails the call (TIMEOUT) and aborts the
                                  * communicator; the collective keeps its
                                  * buffers until it has ended */
    tdm_fsdp_comm_hook comm_hook;   /* default NONE: float32 reduce-scatters */
    /* 1: uneven inputs (PyTorch's Join, as tdm_ddp_opts.join): every
     * training forward first all-reduces how many ranks still have data
     * (two int32 over host_comm), the loss gradient is averaged over those
     * ranks, and a rank out of data calls tdm_fsdp_join, which shadows the
     * others' collectives until every rank has joined. */
    int join;
    /* Borrowed, optional: a communicator with the same ranks for the few
     * collectives on host memory (layout check, loss sums, checkpoint
     * flags). Needed when comm only takes device memory (NCCL: pass the
     * shm communicator it was bootstrapped over); NULL: comm. */
    tdm_comm *host_comm;
    tdm_fsdp_offload offload;    /* default NONE: the shards on the model's device */
} tdm_fsdp_opts;

typedef struct tdm_fsdp tdm_fsdp;

/* Wraps m (borrowed): shards its parameters, frees its flat buffers and
 * reads them through views from then on (tdm_model_set_param_view), sets
 * its hooks. Collective: every rank calls it. With opts.offload PARAMS, m
 * may be a model built without flat buffers (tdm_model_init_released):
 * rank 0 then draws each unit's initial values from m's seed into host
 * memory (tdm_model_init_param_host) and scatters them over the host
 * communicator into the host shards, so that the device never holds more
 * than the model's buffers at set-up (tdm_fsdp_plan_memory's init_peak).
 * A model built so is refused without offload. */
tdm_status tdm_fsdp_init(tdm_fsdp **out, tdm_model *m, tdm_comm *comm, const tdm_fsdp_opts *opts);
/* Gives the model back flat buffers holding this rank's view of the
 * parameters when it has a full copy (grad_op, optimizer; FULL_SHARD:
 * zeros: call tdm_fsdp_gather_params first to keep them) and removes the
 * hooks; with offload PARAMS the model stays without flat buffers (they
 * could not fit), its views dropped. Not collective. Call before freeing
 * the communicator. NULL ok. */
void tdm_fsdp_free(tdm_fsdp *f);

tdm_model *tdm_fsdp_model(tdm_fsdp *f);
tdm_comm *tdm_fsdp_comm(tdm_fsdp *f);
tdm_fsdp_sharding tdm_fsdp_get_sharding(const tdm_fsdp *f);
tdm_fsdp_comm_hook tdm_fsdp_get_comm_hook(const tdm_fsdp *f);

/* Units: how many, and unit u's parameters first..last, its range
 * [offset, offset + n_elem) of the model's flat buffer and its shard
 * length (n_elem padded to N * shard). */
int tdm_fsdp_n_units(const tdm_fsdp *f);
void tdm_fsdp_unit_info(const tdm_fsdp *f, int u, int *first, int *last, int64_t *offset,
                        int64_t *n_elem, int64_t *shard);
/* This rank's shard length over all units (the optimizer's elements). */
int64_t tdm_fsdp_shard_elems(const tdm_fsdp *f);

/* An optimizer over this rank's shard (tdm_optim_init_flat); step it with
 * tdm_fsdp_step. Owned by the caller (tdm_optim_free). With
 * TDM_FSDP_OFFLOAD_PARAMS it is a host optimizer (tdm_optim_init_host:
 * its state in host memory beside the shards, stepped there; an
 * optimizer offload in opts is then implied). */
tdm_status tdm_fsdp_optim_init(tdm_optim **out, tdm_fsdp *f, const tdm_optim_opts *opts);

tdm_status tdm_fsdp_zero_grad(tdm_fsdp *f);

/* Local forward and loss over this rank's samples (host x (batch, in) of
 * the model's input dtype, y (batch * out_rows)); the loss gradient is
 * scaled by grad_scale (1/B_global for a split global batch) and
 * *loss_sum is the sum of this rank's per-sample losses. batch may be 0:
 * the rank still takes part. Broadcasts buffers from rank 0 first
 * (training mode, unless disabled). */
tdm_status tdm_fsdp_forward_scaled(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                                   float grad_scale, double *loss_sum);
/* The same with grad_scale 1/(batch * world) (the mean loss, then SUM:
 * exact when every rank has the same batch); *loss_mean this rank's.
 * With opts.join: 1/(batch * the ranks with data in this forward), and
 * tdm_fsdp_forward_scaled's scale, meant for every rank, is multiplied by
 * world / (those ranks): the mean over the ranks that contribute. */
tdm_status tdm_fsdp_forward(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                            double *loss_mean);
/* Backward of the last forward; in sync mode reduce-scatters every unit's
 * gradients into the owners' shards (overlapped unless no_overlap) and
 * returns once all are reduced. On a communication error the
 * communicator is aborted (the other ranks stop) and the error names the
 * collective, the unit and the failing rank. */
tdm_status tdm_fsdp_backward(tdm_fsdp *f);
/* The gradients the levers read after a synchronised backward (loss
 * scaling, clipping: dist/step.h): this rank's gradient shard of each
 * unit, disjoint from every other rank's (padding included, zeros).
 * Local. */
tdm_status tdm_fsdp_grad_bufs(tdm_fsdp *f, tdm_dist_grads *out);
/* Sum over all ranks of the per-sample losses of the forwards reduced by
 * the last synchronised backward. */
double tdm_fsdp_loss_sum(const tdm_fsdp *f);
/* no_sync: while enabled, backward only accumulates local (full)
 * gradients; the next synchronised backward reduces their sum. With
 * opts.join, set it before the forward (the forward's count says whether
 * its backward synchronises). */
void tdm_fsdp_no_sync(tdm_fsdp *f, int enable);

/* Uneven inputs (opts.join; fsdp/join.c): called by a rank that has run
 * out of data, collectively with the others' remaining steps. Until every
 * rank has joined it shadows each step of the ranks still training - the
 * count all-reduce, the buffer broadcast, the all-gathers of parameters
 * (FULL_SHARD runs a zero sample with a zero loss gradient through forward
 * and backward), the reduce-scatters with zero gradient contributions -
 * and steps its shards with opt like them (its shards are part of the
 * model, and in grad_op and optimizer the step's all-gathers are
 * collective: opt is required). Under the others' no_sync it shadows
 * forward and backward only. Returns once every rank has joined;
 * *shadowed (may be NULL): the synchronised steps it shadowed. The
 * reduced gradient of a step is the sum of the active ranks' gradients;
 * with tdm_fsdp_forward the mean over the ranks that contributed. */
tdm_status tdm_fsdp_join(tdm_fsdp *f, tdm_optim *opt, int64_t *shadowed);
/* Ranks that contributed to the last training forward (opts.join; else
 * the world size). */
int tdm_fsdp_active_ranks(const tdm_fsdp *f);

/* Steps this rank's shard with opt (from tdm_fsdp_optim_init) and, in
 * grad_op and optimizer, launches the all-gathers that bring every rank
 * the new full parameters (each awaited when its unit is next used).
 * Collective. May be called again without a backward in between (as
 * PyTorch's optimizer.step()): it applies the gradient shards again,
 * after waiting for the gathers the previous step launched; not in
 * grad_op and optimizer while a rank has joined (INVALID_ARG: the joined
 * rank shadows one step per backward). */
tdm_status tdm_fsdp_step(tdm_fsdp *f, tdm_optim *opt);

/* Evaluation spread over the ranks as tdm_ddp_evaluate does (collective;
 * every rank gets the whole set's mean loss and accuracy), rank 0's
 * buffers broadcast first. */
tdm_status tdm_fsdp_evaluate(tdm_fsdp *f, const tdm_dataset *test, int batch, double *loss_mean,
                             double *accuracy);

/* One evaluation forward of any model (a GPT's windows included) over
 * this rank's host x (batch samples, the model's input dtype) and the sum
 * of the per-sample losses against y (batch * out_rows) into *loss_sum,
 * in eval mode; no gradient. For evaluations tdm_fsdp_evaluate does not
 * cover (a language model's windows): the caller sums over the ranks.
 * Collective in every sharding: every rank calls it the same number of
 * times, with batch 0 when its share is done (FULL_SHARD then runs one
 * zero sample so as to join the gathers; *loss_sum is 0). Rank 0's
 * buffers are broadcast first. */
tdm_status tdm_fsdp_eval_loss(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                              double *loss_sum);

/* The full parameters in the model's flat layout (tdm_model_param_elems
 * floats, host memory) on root, or on every rank when root < 0.
 * Collective. */
tdm_status tdm_fsdp_gather_params(tdm_fsdp *f, float *host_out, int root);

/* The reduced gradient of the last synchronised backward, gathered from
 * the shards, in the model's flat layout (host memory) on root, or on
 * every rank when root < 0. Collective. */
tdm_status tdm_fsdp_gather_grads(tdm_fsdp *f, float *host_out, int root);

/* --deterministic K (dist/det.h): the local gradient the no_sync
 * backwards since zero_grad accumulated, in the model's flat layout, into
 * host (tdm_model_param_elems floats); and a gradient reduced elsewhere
 * (host, the same layout) written into this rank's shards as what the
 * next tdm_fsdp_step applies, the local one dropped. Not collective. */
tdm_status tdm_fsdp_local_grads(tdm_fsdp *f, float *host);
tdm_status tdm_fsdp_set_grads(tdm_fsdp *f, const float *host);

/* ---- timings ---- */

/* One collective of the last step: an all-gather (kind 0) or a
 * reduce-scatter (kind 1) of unit `unit`, issued at start_ms and seen
 * complete at end_ms (ms from the step's forward; completion is seen at
 * the next hook or wait, so end_ms is late by up to one layer), and the
 * part of it this rank waited for (wait_ms: exposed; the rest overlapped
 * compute). prefetch: issued before the unit was needed. */
typedef struct tdm_fsdp_event {
    int kind, unit, prefetch;
    double start_ms, end_ms, wait_ms;
    double bytes;
} tdm_fsdp_event;

/* Last step and sums since init. Phases: FORWARD, LOSS, BACKWARD (compute,
 * waits excluded), ALLGATHER_WAIT and REDUCE_SCATTER_WAIT (exposed
 * communication), STEP. */
typedef struct tdm_fsdp_times {
    tdm_phase_times last, total;
    int64_t steps;                /* synchronised backwards counted in total */
    double ag_bytes_total, ag_prefetched_bytes_total;    /* all-gathered, of which prefetched */
    double rs_bytes_total, rs_overlapped_bytes_total;  /* reduce-scattered; during backward */
    double ag_ms_total, rs_ms_total;   /* issue to seen-complete, summed over collectives */
    int n_events;                 /* of the last step (forward to step) */
    const tdm_fsdp_event *events; /* borrowed */
    /* the last synchronised backward: reduce-scatters seen complete
     * before its compute ended, and its compute time (ms) */
    int rs_done_in_backward;
    /* the last forward: prefetched gathers already complete when needed */
    int ag_ready_at_use;
} tdm_fsdp_times;
void tdm_fsdp_get_times(const tdm_fsdp *f, tdm_fsdp_times *out);

/* ---- memory ---- */

/* What this rank holds for parameters, gradients and optimizer state, in
 * bytes as allocated: the shards (persistent), the full copies a strategy
 * keeps (grad_op: parameters; optimizer: parameters and gradients), and
 * the most that unit buffers (gathered parameters, full gradients, their
 * staging) held at once since init or the last reset. */
typedef struct tdm_fsdp_memory {
    size_t shard_params, shard_grads, optim_state;
    size_t full_params, full_grads;
    size_t units_live, units_peak;
    size_t max_unit_bytes;        /* the largest unit's padded full parameters */
    /* TDM_FSDP_OFFLOAD_PARAMS: the shards and optimizer state above live
     * in host memory, not the device's */
    tdm_fsdp_offload offload;
} tdm_fsdp_memory;
void tdm_fsdp_get_memory(const tdm_fsdp *f, const tdm_optim *opt, tdm_fsdp_memory *out);
void tdm_fsdp_reset_peak(tdm_fsdp *f);

/* The sharded modes' per-step ops (dist/step.h) over a tdm_fsdp: what
 * dist/ builds a training step, gradient accumulation and uneven inputs
 * from (save: the full form; load: either form). */
extern const tdm_dist_ops tdm_fsdp_dist_ops;

/* ---- checkpoints (fsdp/fsdp_ckpt.c) ---- */

/* The full state dict: every unit's shards gathered to rank 0, which
 * writes the very safetensors file the other modes write (loadable by
 * single, dp, ddp and fsdp at any N); every rank learns whether it
 * succeeded. opt (from tdm_fsdp_optim_init) may be NULL. Collective. */
tdm_status tdm_fsdp_save_full(tdm_fsdp *f, const char *path, tdm_optim *opt,
                              const tdm_ckpt_info *info);
/* Every rank reads the file (written by any mode, at any N) and keeps its
 * shards. Collective; a rank that fails is named on every rank. */
tdm_status tdm_fsdp_load_full(tdm_fsdp *f, const char *path, tdm_optim *opt,
                              tdm_ckpt_info *info);
/* The sharded form, for models too big to gather: rank r writes its
 * shards to "<path>.<id>.rank<r>-of-<N>" and rank 0 then writes the index
 * at path (model, units, world, step, the rank files), atomically, last:
 * an index always names complete rank files; the files of the index it
 * replaced are removed. Collective. */
tdm_status tdm_fsdp_save_sharded(tdm_fsdp *f, const char *path, tdm_optim *opt,
                                 const tdm_ckpt_info *info);
/* Reads the index at path and the rank files this rank's shards come
 * from: the same files at the same N, or the pieces of several at another
 * N (resharding). Refuses another model or unit layout naming what
 * differs. Collective. */
tdm_status tdm_fsdp_load_sharded(tdm_fsdp *f, const char *path, tdm_optim *opt,
                                 tdm_ckpt_info *info);
/* Either form: a sharded checkpoint's index (recognised by its format
 * line) or a full checkpoint. Collective. */
tdm_status tdm_fsdp_load(tdm_fsdp *f, const char *path, tdm_optim *opt, tdm_ckpt_info *info);

#ifdef __cplusplus
}
#endif

#endif
