/* tools/train_levers.c: `tandem train`'s memory levers (docs/MEMORY.md):
 * --precision fp32|bf16|fp16, --checkpoint-activations [all|N],
 * --clip-grad-norm X and --offload optimizer, their checks, what they set
 * on --mode single's model and step and on every rank of --mode ddp and
 * fsdp (each rank's model, the design's optimizer, dist/step.h's
 * stepper), and the lines they print (the planner's peak before
 * training, the measured one after, the gradient norm and loss scale
 * with each epoch). Under --mode dp they are set on the master (its
 * replicas follow it, dp/dp.h) and its step (tdm_dp_step_levers); under
 * --mode pp on every stage (pp/pp.h: tdm_pp_opts, tdm_pp_set_levers);
 * under --mode tp on every rank of every group (tp/tp.h:
 * tdm_tp_set_levers). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/step.h"
#include "models/plan.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "models/stage.h"
#include "models/train.h"
#include "tools/plan_peak.h"
#include "tools/ranks.h"
#include "tools/tools.h"
#include "tools/train_modes.h"
#include "tp/tp.h"

static int tdm_levers_set(const tdm_train_args *a)
{
    return a->precision || a->ckpt || a->clip_grad_norm > 0.0 || a->offload;
}

/* --offload params (FSDP's parameter shards in host memory), not
 * --offload optimizer */
static int tdm_levers_params(const tdm_train_args *a)
{
    return a->offload && !strcmp(a->offload, "params");
}

/* --checkpoint-activations all | N: units per segment */
static int tdm_levers_ckpt(const tdm_train_args *a)
{
    if (!a->ckpt) return 0;
    return !strcmp(a->ckpt, "all") ? 1 : atoi(a->ckpt);
}

tdm_status tdm_train_levers_check(const tdm_train_args *a)
{
    tdm_precision p;
    if (a->precision && tdm_precision_parse(a->precision, &p) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem train: --precision: %s\n", tdm_error_message());
    if (a->ckpt && strcmp(a->ckpt, "all")) {
        char *end;
        long n = strtol(a->ckpt, &end, 10);
        if (*end || n < 1 || n > 1 << 16)
            return tdm_tool_usage_error("tandem train: --checkpoint-activations '%s': expected "
                                        "all, or N >= 1 blocks per recomputed segment\n", a->ckpt);
    }
    /* tp's limits (plan runs this check too) */
    if (a->offload && !strcmp(a->mode, "tp"))
        return tdm_tool_usage_error("tandem train: --mode tp does not support --offload yet "
                                    "(--precision, --checkpoint-activations and "
                                    "--clip-grad-norm it does)\n");
    if (a->ckpt && !strcmp(a->mode, "tp") && strcmp(a->ckpt, "all") && strcmp(a->ckpt, "1"))
        return tdm_tool_usage_error("tandem train: --checkpoint-activations %s: --mode tp "
                                    "checkpoints every GPT block or MLP layer pair (all, or 1); "
                                    "segments of more are not built for tp\n", a->ckpt);
    if (a->offload && strcmp(a->offload, "optimizer") && strcmp(a->offload, "params"))
        return tdm_tool_usage_error("tandem train: --offload '%s': expected optimizer or "
                                    "params\n", a->offload);
    if (a->offload && strncmp(a->device, "cuda", 4))
        return tdm_tool_usage_error("tandem train: --offload %s moves %s from a GPU to host "
                                    "memory; --device %s is host memory already\n", a->offload,
                                    tdm_levers_params(a) ? "the parameter shards"
                                                         : "the optimizer state", a->device);
    tdm_fsdp_sharding sh = TDM_FSDP_FULL_SHARD;
    if (tdm_levers_params(a) && strcmp(a->mode, "fsdp"))
        return tdm_tool_usage_error("tandem train: --offload params keeps FSDP's parameter "
                                    "shards in host memory: it runs with --mode fsdp (--sharding "
                                    "full), not --mode %s (--offload optimizer runs with single, "
                                    "ddp and fsdp)\n", a->mode);
    /* an unknown --sharding is the sharding check's to name (its choices) */
    if (tdm_levers_params(a) && a->sharding &&
        tdm_fsdp_sharding_parse(a->sharding, &sh) == TDM_STATUS_OK && sh != TDM_FSDP_FULL_SHARD)
        return tdm_tool_usage_error("tandem train: --offload params runs with --sharding full: "
                                    "--sharding %s (%s) keeps full parameters on the device "
                                    "(use --offload optimizer)\n", a->sharding,
                                    sh == TDM_FSDP_SHARD_GRAD_OP ? "SHARD_GRAD_OP, ZeRO-2"
                                                                : "ZeroRedundancyOptimizer, ZeRO-1");
    int dp = !strcmp(a->mode, "dp"), pp = !strcmp(a->mode, "pp");
    if (tdm_levers_set(a) && strcmp(a->mode, "single") && strcmp(a->mode, "ddp") &&
        strcmp(a->mode, "fsdp") && !dp && !pp && strcmp(a->mode, "tp"))
        return tdm_tool_usage_error("tandem train: --precision, --checkpoint-activations, "
                                    "--clip-grad-norm and --offload run with --mode single, dp, "
                                    "ddp, fsdp, pp and tp in this build, not yet with --mode "
                                    "%s\n", a->mode);
    const char *tp = pp && a->mesh ? strstr(a->mesh, "tp=") : NULL;
    if (tdm_levers_set(a) && tp && atoi(tp + 3) > 1)
        return tdm_tool_usage_error("tandem train: --mesh %s: the memory levers run in "
                                    "pipelines of whole stages (tp=1) and in --mode tp, not yet "
                                    "with tensor-parallel stages\n", a->mesh);
    if (a->offload && (dp || pp))
        return tdm_tool_usage_error("tandem train: --offload optimizer runs with --mode single, "
                                    "ddp and fsdp, not with --mode %s%s\n", a->mode,
                                    pp ? " (a stage holds only its own layers' state)" : "");
    int fp16 = a->precision && p == TDM_PRECISION_FP16;
    if (a->uneven && (fp16 || a->clip_grad_norm > 0.0))
        return tdm_tool_usage_error("tandem train: --precision fp16 (its loss scaling) and "
                                    "--clip-grad-norm are not supported with --uneven yet (a "
                                    "joined rank's shadow steps do not take part in their "
                                    "collectives)\n");
    if (a->grad_accum > 1 && (fp16 || a->clip_grad_norm > 0.0) && strcmp(a->mode, "single"))
        return tdm_tool_usage_error("tandem train: --precision fp16 (its loss scaling) and "
                                    "--clip-grad-norm are not supported with --grad-accum "
                                    "yet, but with --mode single (and --mode pp's "
                                    "--microbatches)\n");
    return TDM_STATUS_OK;
}

static void tdm_levers_plan(const tdm_train_args *a, tdm_model *m, tdm_plan *pl, int *ok)
{
    tdm_plan_opts o;
    tdm_plan_opts_default(&o, tdm_model_get_spec(m), (int)a->batch);
    o.precision = tdm_model_precision(m);
    o.ckpt = tdm_model_checkpoint(m);
    tdm_optim_opts_named(&o.optim, a->optim, a->lr, a->weight_decay, a->momentum, a->nesterov);
    o.optim.offload = a->offload && !tdm_levers_params(a) ? TDM_OPTIM_OFFLOAD_HOST
                                                          : TDM_OPTIM_OFFLOAD_NONE;
    o.device = tdm_dev_kind(tdm_model_device(m));
    o.threads = (int)a->threads;
    o.loss_scaling = o.precision == TDM_PRECISION_FP16;
    o.grad_norm = a->clip_grad_norm > 0.0;
    *ok = tdm_plan_single(&o, pl) == TDM_STATUS_OK;
}

/* A resumed run's loss scaler goes on from the checkpoint's (its scale
 * and growth tracker), not from 2^16: the same steps as a run never
 * interrupted. */
static void tdm_levers_scaler_resume(tdm_grad_scaler *sc, const tdm_ckpt_info *resumed)
{
    if (!resumed || resumed->loss_scale <= 0.0) return;
    sc->scale = (float)resumed->loss_scale;
    sc->growth_tracker = resumed->loss_scale_growth;
}

tdm_status tdm_train_levers_apply(const tdm_train_args *a, tdm_model *m, tdm_single *s,
                                  tdm_grad_scaler *scaler, const tdm_ckpt_info *resumed)
{
    tdm_precision p = TDM_PRECISION_FP32;
    if (a->precision) (void)tdm_precision_parse(a->precision, &p);
    tdm_status st;
    if ((st = tdm_model_set_precision(m, p)) || (st = tdm_model_set_checkpoint(m, tdm_levers_ckpt(a))))
        return tdm_train_fail("memory levers", st);
    s->clip_norm = a->clip_grad_norm;
    if (p == TDM_PRECISION_FP16) {
        if ((st = tdm_grad_scaler_init(scaler, NULL))) return tdm_train_fail("loss scaler", st);
        tdm_levers_scaler_resume(scaler, resumed);
        s->scaler = scaler;
    }
    if (!tdm_levers_set(a)) return TDM_STATUS_OK;
    printf("  memory levers: precision %s", tdm_precision_name(p));
    if (p == TDM_PRECISION_FP16) printf(" (dynamic loss scaling from %g)", (double)scaler->scale);
    if (tdm_levers_ckpt(a)) printf(", activation checkpointing (segments of %d)", tdm_levers_ckpt(a));
    if (a->clip_grad_norm > 0.0) printf(", gradient norm clipped to %g", a->clip_grad_norm);
    if (a->offload) printf(", optimizer offloaded to host memory");   /* params: fsdp only */
    if (!strcmp(a->mode, "dp")) {
        /* DP's plan (its output device's) is printed after training,
         * beside the measured peak (tdm_train_levers_report) */
        printf(" (the master's; every replica follows it)\n");
        fflush(stdout);
        return TDM_STATUS_OK;
    }
    tdm_plan pl;
    int ok;
    tdm_levers_plan(a, m, &pl, &ok);
    if (ok)
        printf("\n  planned peak %.2f MiB on %s: parameters %.2f, gradients %.2f, optimizer %.2f, "
               "activations %.2f, scratch %.2f MiB", pl.peak / 1048576.0,
               tdm_dev_name(tdm_model_device(m)), (pl.params + pl.params_low) / 1048576.0,
               pl.grads / 1048576.0, pl.optim / 1048576.0, pl.activations / 1048576.0,
               (pl.act_scratch + pl.step_scratch + pl.buffers) / 1048576.0);
    printf("\n");
    fflush(stdout);
    return TDM_STATUS_OK;
}

void tdm_train_levers_report(const tdm_train_args *a, tdm_model *m)
{
    tdm_dev_mem_stats ms;
    if (!tdm_levers_set(a) || tdm_dev_mem_query(tdm_model_device(m), &ms) != TDM_STATUS_OK)
        return;
    if (!strcmp(a->mode, "dp")) {
        /* the output device's plan (tandem plan --mode dp): the master at
         * the largest chunk, the whole batch's loss and buffers */
        tdm_device_list dl;
        tdm_plan_opts o;
        size_t planned = 0;
        int n = tdm_device_list_parse(&dl, a->device) == TDM_STATUS_OK ? dl.count : 0;
        printf("peak memory on the master's %s: %.2f MiB measured (allocator)",
               tdm_dev_name(tdm_model_device(m)), ms.peak_bytes / 1048576.0);
        if (n >= 1 && a->grad_accum <= 1) {
            tdm_plan_opts_default(&o, tdm_model_get_spec(m), (int)((a->batch + n - 1) / n));
            o.precision = tdm_model_precision(m);
            o.ckpt = tdm_model_checkpoint(m);
            tdm_optim_opts_named(&o.optim, a->optim, a->lr, a->weight_decay, a->momentum,
                                 a->nesterov);
            o.device = tdm_dev_kind(tdm_model_device(m));
            o.threads = (int)a->threads;
            o.loss_scaling = o.precision == TDM_PRECISION_FP16;
            o.grad_norm = a->clip_grad_norm > 0.0;
            o.loss_batch = (int)a->batch;
            if (tdm_tool_plan_peak(&o, TDM_TOOL_PLAN_DP, n, TDM_FSDP_FULL_SHARD, &planned) ==
                TDM_STATUS_OK)
                printf(", %.2f MiB planned (tandem plan)", planned / 1048576.0);
        }
        printf("\n");
        return;
    }
    tdm_plan pl;
    int ok;
    tdm_levers_plan(a, m, &pl, &ok);
    printf("peak memory on %s: %.2f MiB measured (allocator)", tdm_dev_name(tdm_model_device(m)),
           ms.peak_bytes / 1048576.0);
    if (ok) printf(", %.2f MiB planned for the training step", pl.peak / 1048576.0);
    /* tdm_evaluate reserves activations for its own batches of 1000 */
    if (ok && ms.peak_bytes > pl.peak && !a->no_eval &&
        tdm_model_get_spec(m)->kind != TDM_MODEL_GPT && a->batch < 1000)
        printf(" (the test-set evaluation's batches of 1000 are larger: --no-eval leaves the "
               "training step's)");
    printf("\n");
}

static void tdm_levers_figures(double clip_norm, double last_norm, const tdm_grad_scaler *sc)
{
    if (clip_norm > 0.0) printf(", grad norm %.4g (last step)", last_norm);
    if (sc)
        printf(", loss scale %g (%lld step%s skipped)", (double)sc->scale,
               (long long)sc->skipped, sc->skipped == 1 ? "" : "s");
}

void tdm_train_levers_epoch(const tdm_train_run *r)
{
    if (r->single) tdm_levers_figures(r->single->clip_norm, r->single->last_norm, r->single->scaler);
    if (r->ranks) tdm_levers_figures(r->ranks->clip_norm, r->ranks->last_norm, r->ranks->scaler);
}

void tdm_train_levers_build(const tdm_train_args *a, tdm_tool_build *b)
{
    b->precision = TDM_PRECISION_FP32;
    if (a->precision) (void)tdm_precision_parse(a->precision, &b->precision);
    b->ckpt = tdm_levers_ckpt(a);
    if (tdm_levers_params(a)) b->offload = TDM_FSDP_OFFLOAD_PARAMS;
    else if (a->offload) b->optim.offload = TDM_OPTIM_OFFLOAD_HOST;
}

tdm_status tdm_train_levers_rank(const tdm_train_args *a, const tdm_tool_rank *r,
                                 tdm_dist_stepper *s, tdm_grad_scaler *scaler)
{
    s->clip_norm = a->clip_grad_norm;
    if (r->b->precision == TDM_PRECISION_FP16) {
        tdm_status st = tdm_grad_scaler_init(scaler, NULL);
        if (st) return tdm_tool_rank_fail(r, "loss scaler", st);
        tdm_levers_scaler_resume(scaler, &r->resumed);
        s->scaler = scaler;
    }
    if (!tdm_levers_set(a) || r->rank != 0) return TDM_STATUS_OK;
    printf("  memory levers on every rank: precision %s", tdm_precision_name(r->b->precision));
    if (s->scaler)
        printf(" (dynamic loss scaling from %g, found-inf synced over the ranks)",
               (double)s->scaler->scale);
    if (r->b->ckpt) printf(", activation checkpointing (segments of %d)", r->b->ckpt);
    if (a->clip_grad_norm > 0.0) printf(", global gradient norm clipped to %g", a->clip_grad_norm);
    if (tdm_levers_params(a))
        printf(", parameter and gradient shards and the optimizer (its state and step) "
               "offloaded to host memory");
    else if (a->offload)
        printf(", optimizer offloaded to host memory");
    printf("\n");
    fflush(stdout);
    return TDM_STATUS_OK;
}

/* This rank's stage as tandem plan --mode pp plans it; 0: not planned. */
static size_t tdm_levers_pp_planned(const tdm_train_args *a, const tdm_tool_rank *r)
{
    size_t planned = 0;
    if (tdm_tool_plan_pp_rank(r->b, &r->dist->shape, r->dist->coord,
                              tdm_dev_kind(tdm_model_device(r->m)), (int)a->batch,
                              (int)a->threads, a->clip_grad_norm > 0.0, &planned)) {
        tdm_error_clear();
        return 0;
    }
    return planned;
}

/* What each rank sends rank 0 (all-gathered as int64s, byte for byte). */
typedef struct tdm_levers_pp_peak {
    int64_t stage, rep, tp, peak, planned;
    char dev[40];
} tdm_levers_pp_peak;

/* Every rank's measured peak and plan to rank 0 (collective over the
 * job), which prints the largest, then one line per rank: its stage,
 * replica and device. */
static void tdm_levers_pp_report(const tdm_train_args *a, const tdm_tool_rank *r, size_t peak)
{
    enum { WORDS = sizeof(tdm_levers_pp_peak) / sizeof(int64_t) };
    tdm_levers_pp_peak mine = {.stage = r->dist->coord[TDM_MESH_PP],
                               .rep = r->dist->coord[TDM_MESH_DP],
                               .tp = r->dist->coord[TDM_MESH_TP], .peak = (int64_t)peak,
                               .planned = (int64_t)tdm_levers_pp_planned(a, r)};
    snprintf(mine.dev, sizeof mine.dev, "%s", tdm_dev_name(tdm_model_device(r->m)));
    tdm_levers_pp_peak *all = calloc((size_t)r->world, sizeof *all);
    if (!all) return;
    tdm_comm_set_label(r->dist->comm, "pp memory summary");
    if (tdm_comm_all_gather(r->dist->comm, &mine, all, WORDS, TDM_DTYPE_INT64) ||
        r->rank != 0) {
        tdm_error_clear();
        free(all);
        return;
    }
    const double mib = 1.0 / 1048576.0;
    int reps = r->dist->shape.size[TDM_MESH_DP], tps = r->dist->shape.size[TDM_MESH_TP], top = 0;
    for (int k = 1; k < r->world; k++)
        if (all[k].peak > all[top].peak) top = k;
    printf("peak memory on a device: %.2f MiB measured (allocator) on rank %d's %s (stage %lld, "
           "the largest)", all[top].peak * mib, top, all[top].dev, (long long)all[top].stage);
    if (all[top].planned > 0) printf(", %.2f MiB planned (tandem plan)", all[top].planned * mib);
    printf("; each rank's:\n");
    for (int k = 0; k < r->world; k++) {
        const tdm_levers_pp_peak *f = &all[k];
        char who[64] = "";
        if (reps > 1) snprintf(who, sizeof who, ", replica %lld", (long long)f->rep);
        if (tps > 1)
            snprintf(who + strlen(who), sizeof who - strlen(who), ", tp rank %lld",
                     (long long)f->tp);
        printf("  stage %lld%s (rank %d's %s): %.2f MiB measured", (long long)f->stage, who, k,
               f->dev, f->peak * mib);
        if (f->planned > 0) printf(", %.2f MiB planned", f->planned * mib);
        printf("\n");
    }
    free(all);
}

void tdm_train_levers_rank_report(const tdm_train_args *a, const tdm_tool_rank *r)
{
    tdm_dev_mem_stats ms;
    /* the rank's device (a tensor-parallel rank's r->m is the whole
     * model's tables, without a device) */
    tdm_device *dev = r->dist ? r->dist->dev : tdm_model_device(r->m);
    if (!tdm_levers_set(a)) return;
    if (!strcmp(a->mode, "pp")) {
        /* every rank: its peak goes to rank 0 (collective) */
        if (tdm_dev_mem_query(tdm_model_device(r->m), &ms) != TDM_STATUS_OK) ms.peak_bytes = 0;
        tdm_levers_pp_report(a, r, ms.peak_bytes);
        return;
    }
    if (r->rank != 0 || !dev || tdm_dev_mem_query(dev, &ms) != TDM_STATUS_OK)
        return;
    printf("peak memory on rank 0's %s: %.2f MiB measured (allocator)", tdm_dev_name(dev),
           ms.peak_bytes / 1048576.0);
    /* the plan of a rank at the largest share (tools/plan_peak.h), where
     * every step is one pass over that share */
    tdm_plan_opts o;
    size_t planned = 0;
    int fsdp = !strcmp(a->mode, "fsdp");
    if (strcmp(a->mode, "ddp") && !fsdp) {
        printf("\n");
        return;
    }
    tdm_plan_opts_default(&o, &r->b->spec, (int)((a->batch + r->world - 1) / r->world));
    o.precision = r->b->precision;
    o.ckpt = r->b->ckpt;
    o.optim = r->b->optim;
    o.device = tdm_dev_kind(tdm_model_device(r->m));
    o.threads = (int)a->threads;
    o.loss_scaling = o.precision == TDM_PRECISION_FP16;
    o.grad_norm = a->clip_grad_norm > 0.0;
    if (r->b->offload == TDM_FSDP_OFFLOAD_PARAMS) o.offload = TDM_PLAN_OFFLOAD_PARAMS;
    if (a->grad_accum <= 1 && !a->uneven && !a->no_overlap &&
        (!a->comm_hook || !strcmp(a->comm_hook, "allreduce")) &&
        tdm_tool_plan_peak(&o, fsdp ? TDM_TOOL_PLAN_FSDP : TDM_TOOL_PLAN_DDP, r->world,
                           r->b->sharding, &planned) == TDM_STATUS_OK)
        printf(", %.2f MiB planned (tandem plan)", planned / 1048576.0);
    printf("\n");
}

static void tdm_levers_pp_hook(void *ctx, tdm_model *m, int64_t step)
{
    tdm_dist_stepper *s = ctx;
    float *g = tdm_model_grads(m);
    int64_t n = tdm_model_param_elems(m);
    tdm_dist_grads dg = {.bufs = &g, .n_elem = &n, .n_bufs = 1, .dev = tdm_model_device(m)};
    (void)step;   /* the stepper's count, as every design's hook */
    s->after_backward(s->before_ctx, s->begun, &dg);
}

void tdm_train_levers_pp_begin(tdm_dist_stepper *s, tdm_pp *p, tdm_comm *job, int replica)
{
    tdm_pp_levers l = {.scaler = s->scaler, .clip_norm = s->clip_norm,
                       .measure_norm = s->measure_norm, .comm = job,
                       .norm_counted = replica == 0};
    if (s->after_backward) {
        l.after_backward = tdm_levers_pp_hook;
        l.ctx = s;
    }
    tdm_pp_set_levers(p, &l);
}

void tdm_train_levers_pp_end(tdm_dist_stepper *s, const tdm_pp *p)
{
    tdm_pp_stats st;
    tdm_pp_get_stats(p, &st);
    s->last_norm = st.last_norm;
    s->last_skipped = st.last_skipped;
}

static void tdm_levers_tp_hook(void *ctx, float *grads, int64_t n, tdm_device *dev)
{
    tdm_dist_stepper *s = ctx;
    tdm_dist_grads dg = {.bufs = &grads, .n_elem = &n, .n_bufs = 1, .dev = dev};
    s->after_backward(s->before_ctx, s->begun, &dg);
}

void tdm_train_levers_tp_begin(tdm_dist_stepper *s, tdm_tp *p, tdm_comm *job, int replica)
{
    tdm_tp_levers l = {.scaler = s->scaler, .clip_norm = s->clip_norm,
                       .measure_norm = s->measure_norm, .comm = job, .replica = replica};
    if (s->after_backward) {
        l.after_backward = tdm_levers_tp_hook;
        l.ctx = s;
    }
    tdm_tp_set_levers(p, &l);
}

void tdm_train_levers_tp_end(tdm_dist_stepper *s, const tdm_tp *p)
{
    tdm_tp_stats st;
    tdm_tp_get_stats(p, &st);
    s->last_norm = st.last_norm;
    s->last_skipped = st.last_skipped;
}
