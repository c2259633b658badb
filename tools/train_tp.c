/* tools/train_tp.c: `tandem train --mode tp`: tensor parallelism of the
 * MLP, the GPT and model files of linear layers (tp/tp.h: Megatron's column-parallel / row-parallel
 * pairs; the GPT's attention split by heads). Each
 * rank holds a slice of every split layer (its table is
 * tools/rank_tp.c), run by tools/train_ranks.c's loop over dist/run.h
 * like every multi-process mode. With --mesh dp=D,tp=N, D groups of N
 * each take their share of the global batch and their gradients are
 * summed over the dp dimension (--sharding optimizer or grad_op: ZeRO-1
 * or 2 over it). Here: the options' checks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/ranks.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

tdm_status tdm_train_check_tp(const tdm_train_args *a)
{
    const char *tpn = a->mesh ? strstr(a->mesh, "tp=") : NULL;
    if (a->sequence_parallel && !strcmp(a->mode, "pp") && (!tpn || atoi(tpn + 3) < 2))
        return tdm_tool_usage_error("tandem train: --sequence-parallel with --mode pp splits "
                                    "the tokens of tensor-parallel stages: it needs --mesh "
                                    "...,pp=S,tp=N with N > 1\n");
    int low = a->precision && strcmp(a->precision, "fp32");
    if (a->sequence_parallel && !strcmp(a->mode, "pp") && (low || a->ckpt))
        return tdm_tool_usage_error("tandem train: --sequence-parallel on tensor-parallel "
                                    "stages runs in fp32 without --checkpoint-activations "
                                    "(not built with %s%s)\n",
                                    low ? "--precision " : "--checkpoint-activations",
                                    low ? a->precision : "");
    if (a->sequence_parallel && !strcmp(a->mode, "pp")) return TDM_STATUS_OK;
    if (a->sequence_parallel && strcmp(a->mode, "tp"))
        return tdm_tool_usage_error("tandem train: --sequence-parallel applies to --mode tp "
                                    "(the GPT), not --mode %s\n", a->mode);
    if (strcmp(a->mode, "tp")) return TDM_STATUS_OK;
    /* a model file's layers are checked by the plan (tp/seq.c), naming
     * the line it cannot split */
    if (strncmp(a->model, "mlp", 3) && strncmp(a->model, "gpt", 3) &&
        strncmp(a->model, "file:", 5))
        return tdm_tool_usage_error("tandem train: --mode tp supports the MLP, the GPT and "
                                    "model files of linear layers; --model %s is not "
                                    "supported\n", a->model);
    if (a->sequence_parallel && !strncmp(a->model, "mlp", 3))
        return tdm_tool_usage_error("tandem train: --sequence-parallel applies to the GPT; "
                                    "--model %s has no sequence\n", a->model);
    if (a->uneven || a->sync_bn || a->save_sharded ||
        (a->comm_hook && strcmp(a->comm_hook, "allreduce")) || a->max_restarts)
        return tdm_tool_usage_error("tandem train: --mode tp takes none of --uneven, "
                                    "--sync-bn, --save-sharded, --comm-hook, --max-restarts\n");
    if (a->deterministic && (a->grad_accum > 1 || a->sharding || a->sequence_parallel))
        return tdm_tool_usage_error("tandem train: --deterministic with --mode tp is not "
                                    "supported with --grad-accum, --sharding or "
                                    "--sequence-parallel yet\n");
    tdm_fsdp_sharding sh = TDM_FSDP_SHARD_OPTIM;
    if (a->sharding && tdm_fsdp_sharding_parse(a->sharding, &sh))
        return tdm_tool_usage_error("tandem train: --sharding: %s\n", tdm_error_message());
    if (sh == TDM_FSDP_FULL_SHARD)
        return tdm_tool_usage_error("tandem train: --mode tp shards the optimizer (--sharding "
                                    "optimizer, ZeRO-1) or the gradients too (--sharding "
                                    "grad_op, ZeRO-2) over the dp dimension; ZeRO-3 (--sharding "
                                    "%s) is not built for tp\n", a->sharding);
    /* the levers' limits under tp: tdm_train_levers_check (plan's too) */
    if (a->stages || a->microbatches || a->schedule || a->split)
        return tdm_tool_usage_error("tandem train: --stages, --microbatches, --schedule and "
                                    "--split apply to --mode pp, not --mode tp\n");
    return TDM_STATUS_OK;
}

tdm_status tdm_train_run_tp(const tdm_train_args *a)
{
    return tdm_train_run_ranks(a, &tdm_tool_tp_design, NULL, NULL);
}
