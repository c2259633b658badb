/* models/mem_plan.h: the memory a training run will take, checked before
 * it starts. A run that does not fit is refused with the figures (the
 * formula is docs/SECURITY.md's), instead of being killed by the OOM
 * killer part-way (a cgroup's limit is enforced by killing, not by a
 * failing malloc). The figures are the large allocations the run makes
 * (parameters, gradients, optimizer state, activations, per model replica;
 * data; the shared-memory segment; each process's own overhead), a lower
 * bound: what is refused cannot fit, what is accepted usually does.
 * Not an allocator and not a profiler: nothing here is measured while the
 * run goes. A replica's figures come from the device planner
 * (models/plan.h, tdm_mem_plan_model): the two share them; this plan
 * adds the whole machine around them (every replica, the processes, the
 * data, the shared segment) in host memory. */
#ifndef TDM_MODELS_MEM_PLAN_H
#define TDM_MODELS_MEM_PLAN_H

#include <stdint.h>

#include "core/status.h"
#include "models/model.h"
#include "models/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What each replica keeps only 1/N of (the sharded modes). */
typedef enum tdm_mem_shard {
    TDM_MEM_SHARD_NONE = 0,    /* every replica holds everything (single, dp, ddp) */
    TDM_MEM_SHARD_OPTIMIZER,   /* ZeRO-1: optimizer state */
    TDM_MEM_SHARD_GRAD_OP,     /* ZeRO-2: + gradients */
    TDM_MEM_SHARD_FULL,        /* FSDP / ZeRO-3: + parameters (a unit gathered at a time) */
} tdm_mem_shard;

/* What each rank process the run forks takes of its own besides the
 * run's tensors: stacks, allocator arenas, BLAS buffers, and the pages it
 * shared with its parent and writes (measured: a forked rank of a
 * 784-16-10 MLP has under 1 MiB private; this budgets more). The process
 * that checks is running already: what it holds is in what is in use. */
#define TDM_MEM_PLAN_FORK_BYTES ((uint64_t)16 << 20)

typedef struct tdm_mem_plan_in {
    tdm_model_footprint model;   /* at one replica's batch (tdm_model_spec_footprint) */
    int optim_states;            /* floats per parameter: 0 SGD, 1 SGD with momentum, 2 AdamW */
    int replicas;                /* model replicas: 1 (single), N (dp threads, ddp/fsdp ranks) */
    int processes;               /* optimizers: 1 (single, dp, one launched rank), N (forked ranks) */
    int forks;                   /* rank processes still to be forked (0, or N) */
    tdm_mem_shard shard;
    int on_host;                 /* 0: the replicas live on GPUs: their state is not host memory */
    uint64_t data_bytes;         /* data still to be loaded, once (forked ranks share it) */
    uint64_t shared_bytes;       /* the ranks' shared-memory segment */
} tdm_mem_plan_in;

typedef struct tdm_mem_plan {
    /* one replica's, in bytes */
    uint64_t params, grads, optim, activations;
    uint64_t total;              /* the whole run, the formula below */
} tdm_mem_plan;

/* A replica's figures (in->model) from the planner (models/plan.h), so
 * that the check counts what the run's precision and checkpointing make
 * of them: the parameter, buffer and largest-tensor counts, and as
 * act_bytes everything the plan puts on the device beside the
 * parameters, gradients, running statistics and optimizer state (the
 * kept activations, the scratch, the 16-bit weights). In fp32 without
 * checkpointing this is tdm_model_spec_footprint's act_bytes up to the
 * allocator's 64-byte rounding (within 0.2% from batch 32 on, measured
 * for the MLP, CNN and GPT; tests/test_mem_plan.c). */
tdm_status tdm_mem_plan_model(const tdm_plan_opts *o, tdm_model_footprint *out);

/* total = replicas x (params + grads + activations) + processes x optim
 * + forks x TDM_MEM_PLAN_FORK_BYTES + data + shared, with, for P the
 * parameters' and buffers' bytes, k = optim_states, N = replicas and U
 * the largest parameter tensor's bytes:
 *   none:      params P,          grads P,   optim k P
 *   optimizer: params P,          grads P,   optim k P / N
 *   grad_op:   params P,          grads P/N, optim k P / N
 *   full:      params P/N + 2 U,  grads P/N, optim k P / N
 * (single and dp keep one optimizer: processes = 1); on GPUs only data,
 * shared and the forks count. */
void tdm_mem_plan_compute(const tdm_mem_plan_in *in, tdm_mem_plan *out);

/* The plan against tdm_mem_available(): OUT_OF_MEMORY when it does not
 * fit, the message giving both figures, the bound that applied, the
 * plan's terms and what to lower. */
tdm_status tdm_mem_plan_check(const tdm_mem_plan_in *in, const tdm_mem_plan *p);

#ifdef __cplusplus
}
#endif

#endif
