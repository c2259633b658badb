/* tools/rank_fsdp.c: the sharded modes' table for the CLI (tools/ranks.h):
 * FSDP (FULL_SHARD, ZeRO-3), ZeRO-2 (SHARD_GRAD_OP) and ZeRO-1 (sharded
 * optimizer) through fsdp/. A rank's model, given up to fsdp/ for views
 * of its shards, the shards' optimizer, a resumed checkpoint (the full
 * form, or a sharded one's index, recognised by its format line); the
 * per-step ops; checkpoints every rank writes together (the full form
 * gathered to rank 0, the very file the other modes read, or with
 * --save-sharded a file per rank plus an index); the header's and the
 * summary's words (phases, communication, memory). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/ranks.h"
#include "tools/train_modes.h"

#define TDM_RANK_FSDP(self) ((tdm_fsdp *)((tdm_tool_rank *)(self))->w)

/* 1 when path holds a sharded checkpoint's index (its format line). */
static int tdm_rank_fsdp_is_index(const char *path)
{
    /* the format sits in the safetensors header's metadata, whose length
     * grows with the units listed there: read up to 1 MiB of it */
    size_t cap = 1 << 20;
    char *buf = malloc(cap + 1);
    FILE *fp = buf ? fopen(path, "rb") : NULL;
    if (!fp) {
        free(buf);
        return 0;
    }
    size_t n = fread(buf, 1, cap, fp);
    fclose(fp);
    buf[n] = 0;
    for (size_t i = 0; i < n; i++)
        if (!buf[i]) buf[i] = ' ';
    int found = strstr(buf, "tandem-fsdp-sharded-") != NULL;
    free(buf);
    return found;
}

/* ---- set-up ---- */

static void tdm_rank_fsdp_free(void *ctx, void *self)
{
    tdm_tool_rank *r = self;
    (void)ctx;
    if (!r) return;
    tdm_fsdp_free(r->w);
    tdm_optim_free(r->opt);
    tdm_model_free(r->m);
    free(r);
}

/* The model, its shards (on the device communicator, the host
 * collectives on the group), the shards' optimizer and --resume (every
 * rank reads the checkpoint and keeps its shards). */
static tdm_status tdm_rank_fsdp_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    const tdm_tool_build *b = ctx;
    tdm_tool_rank *r = calloc(1, sizeof *r);
    TDM_REQUIRE(r, TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", d->env.rank);
    *self = r;
    *r = (tdm_tool_rank){.b = b, .dist = d, .rank = d->env.rank, .world = d->env.world_size};
    TDM_CHECK(tdm_tool_rank_model(r));
    tdm_fsdp_opts o = {.sharding = b->sharding, .no_overlap = b->no_overlap, .join = b->join,
                       .host_comm = d->dev_comm != d->comm ? d->comm : NULL};
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
    if (!b->resume) return TDM_STATUS_OK;
    tdm_ckpt_info info;
    st = tdm_rank_fsdp_is_index(b->resume) ? tdm_fsdp_load_sharded(f, b->resume, r->opt, &info)
                                           : tdm_fsdp_load_full(f, b->resume, r->opt, &info);
    if (st) return tdm_tool_rank_fail(r, "resuming", st);
    r->start_epoch = info.epoch;
    if (r->rank == 0) tdm_train_print_resumed(b->resume, &info);
    return TDM_STATUS_OK;
}

/* ---- the ops ---- */

static tdm_status tdm_rank_fsdp_zero(void *self) { return tdm_fsdp_zero_grad(TDM_RANK_FSDP(self)); }

static tdm_status tdm_rank_fsdp_forward(void *self, const void *x, const int32_t *y, int n,
                                        float grad_scale, double *loss_sum)
{
    return tdm_fsdp_forward_scaled(TDM_RANK_FSDP(self), x, y, n, grad_scale, loss_sum);
}

static tdm_status tdm_rank_fsdp_forward_mean(void *self, const void *x, const int32_t *y, int n,
                                             double *loss_mean)
{
    return tdm_fsdp_forward(TDM_RANK_FSDP(self), x, y, n, loss_mean);
}

static void tdm_rank_fsdp_no_sync(void *self, int enable)
{
    tdm_fsdp_no_sync(TDM_RANK_FSDP(self), enable);
}

static tdm_status tdm_rank_fsdp_backward(void *self)
{
    return tdm_fsdp_backward(TDM_RANK_FSDP(self));
}

static tdm_status tdm_rank_fsdp_step(void *self)
{
    return tdm_fsdp_step(TDM_RANK_FSDP(self), ((tdm_tool_rank *)self)->opt);
}

static double tdm_rank_fsdp_loss_sum(const void *self)
{
    return tdm_fsdp_loss_sum(((const tdm_tool_rank *)self)->w);
}

static tdm_status tdm_rank_fsdp_join(void *self, int64_t *shadowed)
{
    return tdm_fsdp_join(TDM_RANK_FSDP(self), ((tdm_tool_rank *)self)->opt, shadowed);
}

static tdm_status tdm_rank_fsdp_evaluate(void *self, const tdm_dataset *test, int batch,
                                         double *loss_mean, double *accuracy)
{
    return tdm_fsdp_evaluate(TDM_RANK_FSDP(self), test, batch, loss_mean, accuracy);
}

static tdm_status tdm_rank_fsdp_eval_loss(void *self, const void *x, const int32_t *y, int n,
                                          double *loss_sum)
{
    return tdm_fsdp_eval_loss(TDM_RANK_FSDP(self), x, y, n, loss_sum);
}

/* Every rank saves together: the full form gathers to rank 0, the
 * sharded form writes a file per rank plus rank 0's index. */
static tdm_status tdm_rank_fsdp_save(void *self, const char *path, const tdm_ckpt_info *info)
{
    tdm_tool_rank *r = self;
    return r->b->save_sharded ? tdm_fsdp_save_sharded(r->w, path, r->opt, info)
                              : tdm_fsdp_save_full(r->w, path, r->opt, info);
}

static tdm_status tdm_rank_fsdp_load(void *self, const char *path, tdm_ckpt_info *info)
{
    tdm_tool_rank *r = self;
    return tdm_rank_fsdp_is_index(path) ? tdm_fsdp_load_sharded(r->w, path, r->opt, info)
                                        : tdm_fsdp_load_full(r->w, path, r->opt, info);
}

static const tdm_dist_ops tdm_rank_fsdp_ops = {
    .zero_grad = tdm_rank_fsdp_zero, .forward = tdm_rank_fsdp_forward,
    .forward_mean = tdm_rank_fsdp_forward_mean, .no_sync = tdm_rank_fsdp_no_sync,
    .backward = tdm_rank_fsdp_backward, .step = tdm_rank_fsdp_step,
    .loss_sum = tdm_rank_fsdp_loss_sum, .steps = tdm_tool_rank_steps,
    .join = tdm_rank_fsdp_join, .evaluate = tdm_rank_fsdp_evaluate,
    .eval_loss = tdm_rank_fsdp_eval_loss, .save = tdm_rank_fsdp_save,
    .load = tdm_rank_fsdp_load};

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
    printf("fsdp memory (rank 0): shards %.2f MiB parameters + %.2f MiB gradients + %.2f MiB "
           "optimizer state, full copies %.2f MiB parameters + %.2f MiB gradients, unit "
           "buffers at most %.2f MiB at once\n",
           (double)mm.shard_params * mib, (double)mm.shard_grads * mib,
           (double)mm.optim_state * mib, (double)mm.full_params * mib,
           (double)mm.full_grads * mib, (double)mm.units_peak * mib);
}

/* Gathered from the shards (collective). */
static tdm_status tdm_rank_fsdp_params(tdm_tool_rank *r, float *host, int root)
{
    return tdm_fsdp_gather_params(r->w, host, root);
}

const tdm_tool_design tdm_tool_fsdp_design = {
    .dist = {.name = "fsdp", .caps = TDM_DIST_NCCL, .setup = tdm_rank_fsdp_setup,
             .free = tdm_rank_fsdp_free, .ops = &tdm_rank_fsdp_ops},
    .unit = "FSDP rank", .save_alone = 0, .describe = tdm_rank_fsdp_describe,
    .save_form = tdm_rank_fsdp_save_form, .report = tdm_rank_fsdp_report,
    .params = tdm_rank_fsdp_params};
