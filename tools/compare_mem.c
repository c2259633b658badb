/* tools/compare_mem.c: the planned peak of a mode's device (rank 0's)
 * beside the peak its allocator measured: tools/plan_peak.h's plan of
 * the configuration compare ran (its model, share of the batch,
 * precision, checkpointing and optimizer), for single, DP (the output
 * device), DDP and the sharded modes. Not here: the memory table's other
 * columns (tools/compare.c). */
#include "tools/compare.h"

#include "models/plan.h"
#include "tools/plan_peak.h"

double tdm_cmp_planned_peak(const tdm_cmp_opts *o, tdm_cmp_mode mode, int n_dev)
{
    tdm_model_spec spec;
    if (n_dev < 1 || tdm_model_spec_parse(&spec, o->model)) return -1.0;
    if (mode == TDM_CMP_SINGLE) n_dev = 1;
    tdm_plan_opts po;
    /* the largest share: rank 0's in compare's split */
    tdm_plan_opts_default(&po, &spec, (o->batch + n_dev - 1) / n_dev);
    po.precision = o->precision;
    po.ckpt = o->ckpt;
    tdm_optim_opts_named(&po.optim, o->optim, o->lr, o->weight_decay, o->momentum, 0);
    po.device = o->dl.kind;
    po.threads = 1;
    /* DP: the output device's, whose loss is the whole batch's */
    if (mode == TDM_CMP_DP) po.loss_batch = o->batch;
    tdm_tool_plan_mode pm = mode == TDM_CMP_SINGLE ? TDM_TOOL_PLAN_SINGLE
                          : mode == TDM_CMP_DDP    ? TDM_TOOL_PLAN_DDP
                          : mode == TDM_CMP_DP     ? TDM_TOOL_PLAN_DP
                                                   : TDM_TOOL_PLAN_FSDP;
    tdm_fsdp_sharding sh = mode == TDM_CMP_ZERO2   ? TDM_FSDP_SHARD_GRAD_OP
                         : mode == TDM_CMP_ZERO1   ? TDM_FSDP_SHARD_OPTIM
                                                   : TDM_FSDP_FULL_SHARD;
    size_t peak = 0;
    if (tdm_tool_plan_peak(&po, pm, n_dev, sh, &peak) != TDM_STATUS_OK) return -1.0;
    return (double)peak;
}
