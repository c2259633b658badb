/* tools/plan_peak.h: the planned peak of one device or rank of a mode,
 * which `tandem plan` prints and `tandem compare` prints beside the
 * measured one (tools/plan.c): --mode single's models/plan.h plan, a DDP
 * rank's (its model at its share plus the loss gradient its stage holds),
 * an FSDP/ZeRO rank's (fsdp/fsdp.h's tdm_fsdp_plan_memory), and
 * DataParallel's output device (the master). */
#ifndef TDM_TOOLS_PLAN_PEAK_H
#define TDM_TOOLS_PLAN_PEAK_H

#include <stddef.h>

#include "fsdp/fsdp.h"
#include "models/plan.h"
#include "tools/ranks.h"

typedef enum tdm_tool_plan_mode {
    TDM_TOOL_PLAN_SINGLE = 0,
    TDM_TOOL_PLAN_DDP,
    TDM_TOOL_PLAN_FSDP,
    TDM_TOOL_PLAN_DP,
} tdm_tool_plan_mode;

/* o: the device's (rank's) model at its share of the batch; world and
 * sharding: the ranks and the sharding of TDM_TOOL_PLAN_FSDP. DP: the
 * output device's (the master's, at the largest chunk), o->loss_batch
 * the whole batch (dp/dp.h: that device holds the whole batch's inputs,
 * logits, their gradient and labels, and computes its loss). */
tdm_status tdm_tool_plan_peak(const tdm_plan_opts *o, tdm_tool_plan_mode mode, int world,
                              tdm_fsdp_sharding sharding, size_t *peak);

/* Where a stage sits in its pipeline (tdm_tool_plan_pp_stage). */
typedef struct tdm_tool_pp_place {
    int S;                       /* stages */
    const int *first;            /* the split: each stage's first layer */
    int s;                       /* this stage */
    int sets;                    /* the schedule's in-flight activation sets on it */
    int n_mb;                    /* micro-batches per step of its replica */
    int zero1_reps;              /* > 1: ZeRO-1 over that many replicas; else 0 */
} tdm_tool_pp_place;

/* A pipeline's stage (pp/pp.h; `tandem train --mode pp`): o at the
 * micro-batch size (o->stage_lo/hi are set here from the split), its
 * model with the schedule's in-flight activation sets (each with its
 * batchnorm layers' per-batch statistics), the shared
 * scratch, the loss and levers' scratch, and the GPT's tied-gradient
 * buffer. On host devices the received activations and gradients are in
 * the links' shared memory, not the device's; on an accelerator
 * (o->device) they are the device's: a stage after the first holds
 * min(sets + 1, n_mb) input slots (at least sets), the first stage its
 * sets' copies of the input, every stage but the last two received
 * gradients, and the last stage the targets. zero1_reps > 1: the stage
 * of one replica of a dp x pp mesh with --sharding optimizer (ZeRO-1
 * over the dp dimension): the optimizer state over its 1/reps chunk,
 * plus the padded parameter buffer where the stage's parameters do not
 * divide evenly (stage->optim holds both); otherwise the stage's own
 * optimizer (DDP over the dp dimension keeps its buckets in the
 * communicator's memory, not the device allocator's). */
tdm_status tdm_tool_plan_pp_stage(const tdm_plan_opts *o, const tdm_tool_pp_place *at,
                                  size_t *peak, tdm_plan *stage);

/* A pipeline rank's stage as built (b: its build, b->pp.split or the
 * balanced split, its schedule, micro-batches, levers and ZeRO-1), at
 * coordinate coord of shape, on a device of kind dev, for a global batch
 * of `batch` (the largest replica's share: the pipeline sizes every
 * replica's micro-batches by it), grad_norm 1 with clipping: *planned.
 * Tensor-parallel stages (tp > 1): the stage of the narrow spec, a
 * rank's slices (tools/rank_pptp.h). UNSUPPORTED for --deterministic
 * (its micro-batches are virtual shards). */
tdm_status tdm_tool_plan_pp_rank(const tdm_tool_build *b, const tdm_mesh_shape *shape,
                                 const int coord[TDM_MESH_NDIMS], tdm_device_kind dev,
                                 int batch, int threads, int grad_norm, size_t *planned);

/* One rank of tensor parallelism over T ranks, D replicas (`tandem
 * train --mode tp [--mesh dp=D,tp=T]`; tp/tp.h): its slices of the
 * parameters and gradients, the optimizer state over them (zero 1 or 2:
 * ZeRO-1 or 2 over the dp dimension; over its 1/D chunk, plus the padded
 * flat buffer where the slices do not divide by D; ZeRO-2 keeps a
 * gradient shard of that chunk besides the whole gradient, which it
 * holds only inside a step: grad_shard, counted in the peak), the
 * activations and scratch tdm_tp_footprint counts for
 * `share` samples (its replica's: tp reserves them at the rows it gets;
 * the largest replica's, ceil(B/D), is the job's peak), the device's
 * scratch (the loss rows; with lev: fp16's flag, the norm's partial
 * sums), and with lev->precision bf16|fp16 the products' 16-bit
 * operand block (tp/levers.c) plus, on a host device in fp16, the
 * float32 widening of the largest product's operands. lev NULL: fp32,
 * no clipping. */
typedef struct tdm_tool_tp_levers {
    tdm_precision precision;
    int grad_norm;               /* --clip-grad-norm */
    tdm_device_kind device;
} tdm_tool_tp_levers;
typedef struct tdm_tool_tp_plan {
    size_t params, grads, grad_shard, optim, activations, scratch, low, peak;
    int64_t elems;               /* the rank's flat slice */
} tdm_tool_tp_plan;
/* ZeRO-2 (zero 2) with bucket_mb > 0 (MiB; tandem train passes
 * --bucket-cap-mb, TDM_TOOL_TP_BUCKET_MB without it): grads is the most
 * bytes of gradient buckets held at once in a step
 * (tdm_tp_zero2_bucket_bytes; one micro-batch per step), not the whole
 * gradient; 0: the whole gradient. */
#define TDM_TOOL_TP_BUCKET_MB 25.0
tdm_status tdm_tool_plan_tp_rank(const tdm_model_spec *spec, const tdm_optim_opts *optim, int T,
                                 int D, int share, int seq_par, int zero, double bucket_mb,
                                 int ckpt, const tdm_tool_tp_levers *lev, tdm_tool_tp_plan *out);

#endif
