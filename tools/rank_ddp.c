/* tools/rank_ddp.c: DistributedDataParallel's table for the CLI
 * (tools/ranks.h): a rank's replica, its Reducer over the gradient
 * communicator (NCCL on a GPU, the process group elsewhere) with the
 * --comm-hook of the options, its optimizer and a resumed checkpoint;
 * the header's and the summary's words. Its per-step ops are ddp/'s.
 * Also what every table shares: the rank's model and its messages. */
#include <stdio.h>
#include <stdlib.h>

#include "ddp/ddp.h"
#include "models/recompute.h"
#include "tools/devices.h"
#include "tools/ranks.h"
#include "tools/train_modes.h"

tdm_status tdm_tool_rank_fail(const tdm_tool_rank *r, const char *what, tdm_status st)
{
    fprintf(stderr, "%s: rank %d: %s: %s\n", r->b->cmd, r->rank, what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return st;
}

tdm_status tdm_tool_rank_new(void *ctx, tdm_dist_rank *d, void **self)
{
    tdm_tool_rank *r = calloc(1, sizeof *r);
    TDM_REQUIRE(r, TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", d->env.rank);
    *self = r;
    *r = (tdm_tool_rank){.b = ctx, .dist = d, .rank = d->env.rank, .world = d->env.world_size};
    /* FSDP's parameter offload never holds the whole model on the device:
     * fsdp draws each unit on the host (tdm_fsdp_init) */
    tdm_status st = r->b->offload == TDM_FSDP_OFFLOAD_PARAMS
                        ? tdm_model_init_released(&r->m, d->dev, &r->b->spec, r->b->seed)
                        : tdm_model_init(&r->m, d->dev, &r->b->spec, r->b->seed);
    if (st) return tdm_tool_rank_fail(r, "building model", st);
    if ((st = tdm_model_set_precision(r->m, r->b->precision)) ||
        (st = tdm_model_set_checkpoint(r->m, r->b->ckpt)))
        return tdm_tool_rank_fail(r, "memory levers", st);
    return TDM_STATUS_OK;
}

tdm_status tdm_tool_rank_resume(tdm_tool_rank *r)
{
    const tdm_tool_build *b = r->b;
    tdm_ckpt_info info;
    if (!b->resume) return TDM_STATUS_OK;
    tdm_status st = b->design->dist.ops->load(r->w, b->resume, r->opt, &info);
    if (st) return tdm_tool_rank_fail(r, "resuming", st);
    r->start_epoch = info.epoch;
    r->resumed = info;
    if (r->rank == 0) tdm_train_print_resumed(b->resume, &info);
    return TDM_STATUS_OK;
}

void tdm_tool_rank_free(tdm_tool_rank *r)
{
    tdm_optim_free(r->opt);
    tdm_model_free(r->m);
    free(r);
}

size_t tdm_tool_ddp_arena_bytes(const tdm_device_list *dl, int64_t param_elems)
{
    if (dl->kind == TDM_DEVICE_CUDA && !tdm_tool_cuda_emulated()) return 0;
    return tdm_ddp_arena_bytes(param_elems);
}

/* ---- set-up ---- */

static void tdm_rank_ddp_free(void *ctx, void *self)
{
    (void)ctx;
    if (!self) return;
    tdm_ddp_free(((tdm_tool_rank *)self)->w);
    tdm_tool_rank_free(self);
}

/* The replica, the Reducer (gradients on the device communicator, the
 * host collectives on the group), the hook, the optimizer, --resume
 * (every rank loads the checkpoint). */
static tdm_status tdm_rank_ddp_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    const tdm_tool_build *b = ctx;
    TDM_CHECK(tdm_tool_rank_new(ctx, d, self));
    tdm_tool_rank *r = *self;
    tdm_ddp_opts o = {.bucket_cap_mb = b->bucket_cap_mb, .no_overlap = b->no_overlap,
                      .join = b->join, .sync_bn = b->sync_bn,
                      .host_comm = d->dev_comm != d->comm ? d->comm : NULL};
    tdm_ddp *ddp = NULL;
    tdm_status st = tdm_ddp_init(&ddp, r->m, d->dev_comm, &o);
    if (st) return tdm_tool_rank_fail(r, "ddp set-up", st);
    r->w = ddp;
    if (b->comm_hook && (st = tdm_ddp_set_comm_hook(ddp, b->comm_hook, &b->powersgd)))
        return tdm_tool_rank_fail(r, "--comm-hook", st);
    if ((st = tdm_optim_init(&r->opt, r->m, &b->optim)))
        return tdm_tool_rank_fail(r, "optimizer", st);
    return tdm_tool_rank_resume(r);
}

/* ---- what the CLI prints ---- */

static void tdm_rank_ddp_describe(const tdm_tool_rank *r, char *on, size_t n_on, char *note,
                                  size_t n_note)
{
    snprintf(on, n_on, "%s", "");
    snprintf(note, n_note, "%s", tdm_ddp_zero_copy(r->w) ? ", zero-copy buckets" : "");
}

/* Where a DDP step went (tdm_ddp_get_times): the mean per-step phases,
 * with overlap a second line with the exposed share of the step and the
 * overlapped share of the gradient bytes, then the bytes the comm hook
 * sent. Nothing before the first synchronised step. */
static void tdm_rank_ddp_report(const tdm_tool_rank *r, int overlap)
{
    tdm_ddp_times t;
    tdm_ddp_get_times(r->w, &t);
    if (t.steps == 0) return;
    double n = (double)t.steps, step_ms = 0;
    for (int i = 0; i < TDM_PHASE_COUNT_; i++) step_ms += t.total.ms[i];
    double exposed = t.total.ms[TDM_PHASE_ALLREDUCE_WAIT];
    printf("ddp (rank 0 of %d, %d bucket%s, per step): forward %.3f ms, loss %.3f ms, backward "
           "%.3f ms, all-reduce exposed %.3f ms, optimizer %.3f ms\n",
           r->world, t.n_buckets, t.n_buckets == 1 ? "" : "s", t.total.ms[TDM_PHASE_FORWARD] / n,
           t.total.ms[TDM_PHASE_LOSS] / n, t.total.ms[TDM_PHASE_BACKWARD] / n, exposed / n,
           t.total.ms[TDM_PHASE_STEP] / n);
    if (overlap) {
        double share = t.reduced_bytes_total > 0
                           ? 100.0 * t.overlapped_bytes_total / t.reduced_bytes_total : 0.0;
        printf("ddp communication: exposed (not overlapped) %.3f ms per step = %.1f%% of the "
               "step; overlap: %.1f%% of the gradient bytes were all-reduced while backward "
               "ran\n", exposed / n, step_ms > 0 ? 100.0 * exposed / step_ms : 0.0, share);
    }
    printf("ddp comm hook %s: %.0f bytes all-reduced per step (float32 gradients: %.0f)\n",
           tdm_ddp_comm_hook_name(r->w), t.reduced_bytes_total / n,
           (double)tdm_model_param_elems(r->m) * 4.0);
}

/* Every replica holds the whole model. */
static tdm_status tdm_rank_ddp_params(tdm_tool_rank *r, float *host, int root)
{
    if (root >= 0 && root != r->rank) return TDM_STATUS_OK;
    return tdm_dev_copy_to_host(tdm_model_device(r->m), host, tdm_model_params(r->m),
                                (size_t)tdm_model_param_elems(r->m) * sizeof(float));
}

/* forward, loss, backward, the exposed all-reduce wait, step */
static int tdm_rank_ddp_phases(const tdm_tool_rank *r, tdm_phase_times *out)
{
    tdm_ddp_times t;
    tdm_ddp_get_times(r->w, &t);
    *out = t.last;
    return 1;
}

const tdm_tool_design tdm_tool_ddp_design = {
    .dist = {.name = "ddp", .caps = TDM_DIST_MPI | TDM_DIST_NCCL, .setup = tdm_rank_ddp_setup,
             .free = tdm_rank_ddp_free, .ops = &tdm_ddp_dist_ops},
    .unit = "DDP rank", .save_alone = 1, .describe = tdm_rank_ddp_describe,
    .report = tdm_rank_ddp_report, .params = tdm_rank_ddp_params,
    .phases = tdm_rank_ddp_phases};
