/* tools/train_pp.c: `tandem train --mode pp`: pipeline parallelism, the
 * image models and --model gpt alike. Each rank is one stage of the
 * model's layers (pp/pp.h; the rank's table is tools/rank_pp.c), run by
 * tools/train_ranks.c's loop over dist/run.h like every multi-process
 * mode: forked here one per device (with --max-restarts), or the ranks of
 * `tandem launch`. Here: the options' checks and defaults.
 *
 * A global batch of --batch B is cut into --microbatches M micro-batches
 * of ceil(B/M) samples that flow through the stages in the --schedule's
 * order; the optimizer steps once per global batch: the step of --mode
 * single --batch ceil(B/M) --grad-accum M on the same samples (bit for
 * bit on host devices for the MLP and CNN). With --mesh dp=D,pp=S, D
 * pipelines each take their share of the global batch and DDP sums their
 * gradients over the dp dimension; with --sharding optimizer (ZeRO-1)
 * each replica of a stage steps 1/D of it and the slices are gathered. */
#include <stdio.h>
#include <string.h>

#include "pp/pp.h"
#include "tools/ranks.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

#define TDM_TRAIN_PP_MICRO_DEFAULT 4

tdm_status tdm_train_check_pp(tdm_train_args *a, int gpt)
{
    (void)gpt;
    int pp = !strcmp(a->mode, "pp");
    if (!pp) {
        /* --mesh is --mode tp's too (tools/train_tp.c checks the rest) */
        if (a->stages || a->microbatches || a->schedule || a->split ||
            (a->mesh && strcmp(a->mode, "tp")))
            return tdm_tool_usage_error("tandem train: --stages, --microbatches, --schedule, "
                                        "--split and --mesh apply to --mode pp, not --mode "
                                        "%s\n", a->mode);
        return TDM_STATUS_OK;
    }
    /* --deterministic K: a replica's K/D virtual shards (tools/rank_pp.c) */
    if (!a->microbatches && !a->deterministic) a->microbatches = TDM_TRAIN_PP_MICRO_DEFAULT;
    if (!a->schedule) a->schedule = "1f1b";
    tdm_pp_schedule_kind k;
    if (tdm_pp_schedule_parse(a->schedule, &k))
        return tdm_tool_usage_error("tandem train: --schedule: %s\n", tdm_error_message());
    if (a->grad_accum > 1)
        return tdm_tool_usage_error("tandem train: --mode pp accumulates over its "
                                    "--microbatches: use --microbatches %lld instead of "
                                    "--grad-accum %lld\n", a->grad_accum, a->grad_accum);
    if (a->uneven || a->sync_bn || (a->comm_hook && strcmp(a->comm_hook, "allreduce")))
        return tdm_tool_usage_error("tandem train: --uneven, --sync-bn and --comm-hook apply "
                                    "to --mode ddp and fsdp, not to --mode pp\n");
    tdm_fsdp_sharding sh = TDM_FSDP_SHARD_OPTIM;
    if (a->sharding && tdm_fsdp_sharding_parse(a->sharding, &sh))
        return tdm_tool_usage_error("tandem train: --sharding: %s\n", tdm_error_message());
    if (sh == TDM_FSDP_SHARD_GRAD_OP && !a->save_sharded)
        return tdm_tool_usage_error("tandem train: --mode pp --sharding grad_op (ZeRO-2) is "
                                    "refused: a stage adds every micro-batch's backward into "
                                    "its gradients, so it needs them whole until the last one "
                                    "(DeepSpeed refuses ZeRO-2 with pipelines too); use "
                                    "--sharding optimizer (ZeRO-1)\n");
    if (sh != TDM_FSDP_SHARD_OPTIM || a->save_sharded)
        return tdm_tool_usage_error("tandem train: --mode pp shards only the optimizer over "
                                    "the dp dimension (--sharding optimizer, ZeRO-1): a stage "
                                    "keeps its parameters and gradients whole%s\n",
                                    a->save_sharded ? "; --save-sharded is fsdp's" : "");
    if (a->microbatches > a->batch)
        return tdm_tool_usage_error("tandem train: --microbatches %lld is more than --batch "
                                    "%lld: every micro-batch needs a sample\n", a->microbatches,
                                    a->batch);
    return TDM_STATUS_OK;
}

tdm_status tdm_train_run_pp(const tdm_train_args *a, const tdm_model_spec *spec,
                            const tdm_train_text_set *text)
{
    return tdm_train_run_ranks(a, &tdm_tool_pp_design, spec, text);
}
