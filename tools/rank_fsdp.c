/* tools/rank_fsdp.c: the sharded modes' table for the CLI (tools/ranks.h):
 * FSDP (FULL_SHARD, ZeRO-3), ZeRO-2 (SHARD_GRAD_OP) and ZeRO-1 (sharded
 * optimizer) through fsdp/. A rank's model, given up to fsdp/ for views
 * of its shards, the shards' optimizer, a resumed checkpoint (either
 * form); checkpoints every rank writes together (the full form gathered
 * to rank 0, the very file the other modes read, or with --save-sharded
 * a file per rank plus an index); the header's and the summary's words
 * (phases, communication, memory). Its per-step ops are fsdp/'s. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/ranks.h"
#include "tools/train_modes.h"

/* ---- set-up ---- */

static void tdm_rank_fsdp_free(void *ctx, void *self)
{
    (void)ctx;
    if (!self) return;
    tdm_fsdp_free(((tdm_tool_rank *)self)->w);
    tdm_tool_rank_free(self);
}

/* --save: the full form (gathered to rank 0), or with --save-sharded a
 * file per rank plus an index. */
static tdm_status tdm_rank_fsdp_save(tdm_tool_rank *r, const char *path,
                                     const tdm_ckpt_info *info)
{
    return r->b->save_sharded ? tdm_fsdp_save_sharded(r->w, path, r->opt, info)
                              : tdm_fsdp_save_full(r->w, path, r->opt, info);
}

/* The model, its shards (on the device communicator, the host
 * collectives on the group), the shards' optimizer and --resume (every
 * rank reads the checkpoint and keeps its shards). */
static tdm_status tdm_rank_fsdp_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    const tdm_tool_build *b = ctx;
    TDM_CHECK(tdm_tool_rank_new(ctx, d, self));
    tdm_tool_rank *r = *self;
    tdm_fsdp_opts o = {.sharding = b->sharding, .no_overlap = b->no_overlap, .join = b->join,
                       .host_comm = d->dev_comm != d->comm ? d->comm : NULL,
                       .offload = b->offload};
    tdm_status st;
    /* checked by the tool's argument checks: fp16 or bf16 */
    if (b->comm_hook && (st = tdm_fsdp_comm_hook_parse(b->comm_hook, &o.comm_hook)))
        return tdm_tool_rank_fail(r, "--comm-hook", st);
    tdm_fsdp *f = NULL;
    if ((st = tdm_fsdp_init(&f, r->m, d->dev_comm, &o)))
        return tdm_tool_rank_fail(r, "fsdp set-up", st);
    r->w = f;
    if ((st = tdm_fsdp_optim_init(&r->opt, f, &b->optim)))
        return tdm_tool_rank_fail(r, "optimizer", st);
    return tdm_tool_rank_resume(r);
}

/* ---- what the CLI prints ---- */

static void tdm_rank_fsdp_describe(const tdm_tool_rank *r, char *on, size_t n_on, char *note,
                                   size_t n_note)
{
    snprintf(on, n_on, ", sharding %s", tdm_fsdp_sharding_describe(r->b->sharding));
    snprintf(note, n_note, "%s", "");
}

static const char *tdm_rank_fsdp_save_form(const tdm_tool_rank *r)
{
    return r->b->save_sharded ? "sharded: a file per rank plus this index" : "full";
}

/* Rank 0's summary after training: phases, communication, memory. */
static void tdm_rank_fsdp_report(const tdm_tool_rank *r, int overlap)
{
    tdm_fsdp *f = r->w;
    tdm_fsdp_times t;
    (void)overlap;
    tdm_fsdp_get_times(f, &t);
    if (t.steps == 0) return;
    double n = (double)t.steps;
    int nu = tdm_fsdp_n_units(f);
    printf("fsdp %s (rank 0 of %d, %d unit%s, per step): forward %.3f ms, loss %.3f ms, "
           "backward %.3f ms, all-gather exposed %.3f ms, reduce-scatter exposed %.3f ms, "
           "optimizer %.3f ms\n",
           tdm_fsdp_sharding_describe(tdm_fsdp_get_sharding(f)), r->world, nu,
           nu == 1 ? "" : "s", t.total.ms[TDM_PHASE_FORWARD] / n,
           t.total.ms[TDM_PHASE_LOSS] / n, t.total.ms[TDM_PHASE_BACKWARD] / n,
           t.total.ms[TDM_PHASE_ALLGATHER_WAIT] / n, t.total.ms[TDM_PHASE_REDUCE_SCATTER_WAIT] / n,
           t.total.ms[TDM_PHASE_STEP] / n);
    if (r->b->offload == TDM_FSDP_OFFLOAD_PARAMS)
        printf("fsdp offload (rank 0, per step): host copy %.3f ms (issuing and finishing the "
               "shards' copies up and the gradient slices' down on the copy stream)\n",
               t.total.ms[TDM_PHASE_HOST_COPY] / n);
    printf("fsdp communication: %.1f%% of the all-gathered bytes were prefetched, %.1f%% of the "
           "reduce-scattered bytes were launched during backward\n",
           t.ag_bytes_total > 0 ? 100.0 * t.ag_prefetched_bytes_total / t.ag_bytes_total : 0.0,
           t.rs_bytes_total > 0 ? 100.0 * t.rs_overlapped_bytes_total / t.rs_bytes_total : 0.0);
    int64_t padded = 0;
    for (int u = 0; u < nu; u++) {
        int64_t shard;
        tdm_fsdp_unit_info(f, u, NULL, NULL, NULL, NULL, &shard);
        padded += shard * r->world;
    }
    printf("fsdp comm hook %s: %.0f bytes reduce-scattered per step (float32 gradients: %.0f)\n",
           tdm_fsdp_comm_hook_name(tdm_fsdp_get_comm_hook(f)), t.rs_bytes_total / n,
           (double)padded * 4.0);
    tdm_fsdp_memory mm;
    tdm_fsdp_get_memory(f, r->opt, &mm);
    double mib = 1.0 / (1024.0 * 1024.0);
    printf("fsdp memory (rank 0): shards%s %.2f MiB parameters + %.2f MiB gradients + %.2f MiB "
           "optimizer state, full copies %.2f MiB parameters + %.2f MiB gradients, unit "
           "buffers at most %.2f MiB at once\n",
           mm.offload == TDM_FSDP_OFFLOAD_PARAMS ? " (in host memory)" : "",
           (double)mm.shard_params * mib, (double)mm.shard_grads * mib,
           (double)mm.optim_state * mib, (double)mm.full_params * mib,
           (double)mm.full_grads * mib, (double)mm.units_peak * mib);
}

/* Gathered from the shards (collective). */
static tdm_status tdm_rank_fsdp_params(tdm_tool_rank *r, float *host, int root)
{
    return tdm_fsdp_gather_params(r->w, host, root);
}

/* forward, backward, the exposed all-gather and reduce-scatter waits, step */
static int tdm_rank_fsdp_phases(const tdm_tool_rank *r, tdm_phase_times *out)
{
    tdm_fsdp_times t;
    tdm_fsdp_get_times(r->w, &t);
    *out = t.last;
    return 1;
}

const tdm_tool_design tdm_tool_fsdp_design = {
    .dist = {.name = "fsdp", .caps = TDM_DIST_NCCL, .setup = tdm_rank_fsdp_setup,
             .free = tdm_rank_fsdp_free, .ops = &tdm_fsdp_dist_ops},
    .unit = "FSDP rank", .save_alone = 0, .describe = tdm_rank_fsdp_describe,
    .save = tdm_rank_fsdp_save, .save_form = tdm_rank_fsdp_save_form,
    .report = tdm_rank_fsdp_report,
    .params = tdm_rank_fsdp_params, .phases = tdm_rank_fsdp_phases};
