/* tools/plan.c: `tandem plan`: the memory one device (one rank) will
 * hold at its peak while a configuration trains, before anything runs:
 * models/plan.h's single-device plan, split into parameters, gradients,
 * optimizer state, activations and scratch, for --mode single and for
 * each rank of --mode ddp (its model at its share of the global batch;
 * on host devices DDP's gradient buckets live in the job's shared-memory
 * arena, listed beside the device's bytes), and for each rank of --mode
 * fsdp (fsdp/mem.c: its shards, gathered units and set-up), and for
 * --mode dp's output device (the master and the whole batch's buffers),
 * and for each stage of --mode pp on host devices. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "ddp/ddp.h"
#include "fsdp/fsdp.h"
#include "dist/run.h"
#include "models/builder.h"
#include "models/plan.h"
#include "models/stage.h"
#include "pp/pp.h"
#include "tools/plan_peak.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_plan_args {
    const char *model, *mode, *device, *precision, *ckpt, *offload, *optim, *sharding;
    const char *schedule;
    long long batch, stages, micro;
    double clip, momentum;
} tdm_plan_args;

static void tdm_plan_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem plan [--model M] [--mode single|dp|ddp|fsdp|pp] [--sharding S]\n"
        "                   [--device D] [--stages S] [--microbatches M]\n"
        "                   [--schedule gpipe|1f1b]\n"
        "                   [--batch B] [--precision fp32|bf16|fp16]\n"
        "                   [--checkpoint-activations [all|N]]\n"
        "                   [--clip-grad-norm X] [--offload optimizer|params]\n"
        "                   [--optim sgd|adamw]\n"
        "\n"
        "Prints the peak memory of one device (one rank) while the configuration\n"
        "trains, before anything is allocated: parameters, gradients, optimizer\n"
        "state, kept activations and scratch, as `tandem train` with the same\n"
        "options allocates them (exact for a training step: the allocator's peak\n"
        "with --no-eval; docs/MEMORY.md). ddp: each rank's model at its share of\n"
        "the global batch (the largest share), plus DDP's gradient buckets in the\n"
        "job's shared memory on host devices. fsdp: each rank's model at its share,\n"
        "less the flat buffers it releases, plus its shards (or full copies), the\n"
        "optimizer over the shard, the loss gradient, and the gathered units and full\n"
        "gradients at their most; or the set-up's peak (the model's buffers beside the\n"
        "new shards) where that is higher. dp: the output device, which holds the\n"
        "master (replica 0, at the largest chunk) with the optimizer, and the whole\n"
        "batch's inputs, logits, their gradient and labels (its loss is the batch's).\n"
        "pp (host devices, one pipeline of --stages S, the balanced split): each\n"
        "stage's model slice, the schedule's activation sets at ceil(B/M) samples,\n"
        "the shared scratch and the GPT's tied-gradient buffer (the received\n"
        "activations and gradients are in the links' shared memory).\n"
        "  --model M      as tandem train                          [mlp]\n"
        "  --mode M       single, dp, ddp, fsdp or pp              [single]\n"
        "  --stages S, --microbatches M, --schedule K   pp's, as tandem train's\n"
        "                                        [the devices, 4, 1f1b]\n"
        "  --sharding S   fsdp: full (ZeRO-3), grad_op (ZeRO-2), optimizer (ZeRO-1)\n"
        "                                                           [full]\n"
        "  --device D     cpu, cpu:N, cuda, cuda:N (ddp: one rank per device; dp:\n"
        "                 one replica per device)                   [cpu]\n"
        "  --batch B      the global batch                 [256; gpt: %d]\n"
        "  --momentum M   SGD momentum (0: no optimizer state)    [0.9]\n",
        TDM_TRAIN_GPT_BATCH);
}

/* *help: --help was asked for (printed). */
static tdm_status tdm_plan_parse(int argc, char **argv, tdm_plan_args *a, int *help)
{
    *help = 0;
    *a = (tdm_plan_args){.model = "mlp", .mode = "single", .device = "cpu", .momentum = 0.9};
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
            tdm_plan_usage(stdout);
            *help = 1;
            return TDM_STATUS_OK;
        }
        const char **str = !strcmp(s, "--model")       ? &a->model
                           : !strcmp(s, "--mode")      ? &a->mode
                           : !strcmp(s, "--device")    ? &a->device
                           : !strcmp(s, "--precision") ? &a->precision
                           : !strcmp(s, "--offload")   ? &a->offload
                           : !strcmp(s, "--optim")     ? &a->optim
                           : !strcmp(s, "--sharding")  ? &a->sharding
                           : !strcmp(s, "--schedule")  ? &a->schedule
                                                       : NULL;
        if (str || !strcmp(s, "--batch") || !strcmp(s, "--clip-grad-norm") ||
            !strcmp(s, "--momentum") || !strcmp(s, "--stages") || !strcmp(s, "--microbatches")) {
            if (!v) return tdm_tool_usage_error("tandem plan: %s needs a value\n", s);
            i++;
            char *end = NULL;
            if (str) *str = v;
            else if (!strcmp(s, "--batch")) a->batch = strtoll(v, &end, 10);
            else if (!strcmp(s, "--stages")) a->stages = strtoll(v, &end, 10);
            else if (!strcmp(s, "--microbatches")) a->micro = strtoll(v, &end, 10);
            else if (!strcmp(s, "--clip-grad-norm")) a->clip = strtod(v, &end);
            else a->momentum = strtod(v, &end);
            if (end && (*end || end == v))
                return tdm_tool_usage_error("tandem plan: %s '%s': expected a number\n", s, v);
            continue;
        }
        if (!strcmp(s, "--checkpoint-activations")) {
            a->ckpt = "all";
            if (v && v[0] != '-') a->ckpt = argv[++i];
            continue;
        }
        if (!strncmp(s, "--checkpoint-activations=", 25)) {
            a->ckpt = s + 25;
            continue;
        }
        return tdm_tool_usage_error("tandem plan: unknown option '%s' (tandem plan --help)\n", s);
    }
    return TDM_STATUS_OK;
}

static void tdm_plan_line(const char *what, size_t bytes)
{
    printf("  %-22s %10.2f MiB\n", what, bytes / 1048576.0);
}

/* A DDP rank's loss gradient goes to its stage's buffer (dist/batch.c),
 * beside the model's own: rows x classes floats of its share, as the
 * allocator rounds them. */
static size_t tdm_plan_stage_bytes(const tdm_plan_opts *o)
{
    int c, h, w, classes, rows = 1;
    if (o->spec.kind == TDM_MODEL_GPT) {
        classes = o->spec.vocab;
        rows = o->spec.n_ctx;
    } else {
        tdm_model_spec_sample_shape(&o->spec, &c, &h, &w, &classes);
    }
    return ((size_t)o->batch * (size_t)rows * (size_t)classes * sizeof(float) + 63) / 64 * 64;
}

/* DataParallel's buffers on its output device beside the master model
 * (dp/dp.c's reserve, for the whole batch o->loss_batch): the inputs,
 * the gathered logits and their gradient, the labels; with a device that
 * is not the host, the parameters' staging. */
static size_t tdm_plan_dp_bytes(const tdm_plan_opts *o, const tdm_plan *p)
{
    int c = 1, h = 1, w = 1, classes;
    size_t in = (size_t)o->spec.n_ctx;
    if (o->spec.kind != TDM_MODEL_GPT) {
        tdm_model_spec_sample_shape(&o->spec, &c, &h, &w, &classes);
        in = (size_t)c * (size_t)h * (size_t)w;
    }
    size_t B = (size_t)o->loss_batch, rows = (size_t)p->out_rows;
    size_t x = (B * in * sizeof(float) + 63) / 64 * 64;
    size_t y = (B * rows * (size_t)p->n_classes * sizeof(float) + 63) / 64 * 64;
    size_t lab = (B * rows * sizeof(int32_t) + 63) / 64 * 64;
    size_t stage = o->device == TDM_DEVICE_HOST ? 0 : (p->param_elems * sizeof(float) + 63) / 64 * 64;
    return x + 2 * y + lab + stage;
}

tdm_status tdm_tool_plan_peak(const tdm_plan_opts *o, tdm_tool_plan_mode mode, int world,
                              tdm_fsdp_sharding sharding, size_t *peak)
{
    *peak = 0;
    if (mode == TDM_TOOL_PLAN_FSDP) {
        tdm_fsdp_mem_plan f;
        TDM_CHECK(tdm_fsdp_plan_memory(o, world, sharding, 0, &f));
        *peak = f.peak;
        return TDM_STATUS_OK;
    }
    tdm_plan p;
    TDM_CHECK(tdm_plan_single(o, &p));
    *peak = p.peak + (mode == TDM_TOOL_PLAN_DDP ? tdm_plan_stage_bytes(o) : 0) +
            (mode == TDM_TOOL_PLAN_DP ? tdm_plan_dp_bytes(o, &p) : 0);
    return TDM_STATUS_OK;
}

tdm_status tdm_tool_plan_pp_stage(const tdm_plan_opts *o, int S, const int *first, int s,
                                  int sets, size_t *peak, tdm_plan *p)
{
    int n = 0;
    TDM_CHECK(tdm_model_spec_n_layers(&o->spec, &n));
    tdm_plan_opts so = *o;
    so.stage_lo = first[s];
    so.stage_hi = s + 1 < S ? first[s + 1] : n;
    TDM_CHECK(tdm_plan_single(&so, p));
    /* the set's rounded input is in act_scratch once: per set here */
    size_t x16 = p->act_set - p->activations, shared = p->act_scratch - x16;
    size_t tied = 0;
    if (o->spec.kind == TDM_MODEL_GPT && S > 1 && (s == 0 || s == S - 1))
        tied = ((size_t)o->spec.vocab * (size_t)o->spec.n_embd * sizeof(float) + 63) / 64 * 64;
    *peak = p->params + p->grads + p->buffers + p->params_low + p->optim +
            (size_t)(sets > 0 ? sets : 1) * p->act_set + shared + p->step_scratch + tied;
    return TDM_STATUS_OK;
}

/* --mode pp on host devices: every stage's plan (one pipeline over the
 * devices, the balanced split), the micro-batches of ceil(B/M). */
static tdm_status tdm_plan_pp_print(const tdm_plan_args *a, tdm_plan_opts *o, int devices)
{
    int S = a->stages > 0 ? (int)a->stages : devices, M = a->micro > 0 ? (int)a->micro : 4, n = 0;
    tdm_pp_schedule_kind kind = TDM_PP_1F1B;
    if (a->schedule && tdm_pp_schedule_parse(a->schedule, &kind))
        return tdm_tool_usage_error("tandem plan: --schedule: %s\n", tdm_error_message());
    if (o->device != TDM_DEVICE_HOST)
        return tdm_tool_usage_error("tandem plan: --mode pp is planned on host devices (cpu:N): "
                                    "on a GPU its links' buffers are device memory, not "
                                    "planned yet\n");
    TDM_CHECK(tdm_model_spec_n_layers(&o->spec, &n));
    if (S < 1 || S > 64 || S > n || devices % S || M < 1 || M > a->batch)
        return tdm_tool_usage_error("tandem plan: --mode pp: %d stages of a model of %d "
                                    "pipeline layers on %d devices, %d micro-batches of a batch "
                                    "of %lld: expected 1 <= S <= layers, S dividing the devices "
                                    "(one pipeline), 1 <= M <= batch\n", S, n, devices, M,
                                    a->batch);
    if (devices != S)
        return tdm_tool_usage_error("tandem plan: --mode pp plans one pipeline (--stages %d on "
                                    "%d devices: a dp x pp mesh is not planned yet)\n", S,
                                    devices);
    int first[64];
    tdm_pp_schedule *sched = NULL;
    TDM_CHECK(tdm_pp_split_balance(&o->spec, S, TDM_PP_BALANCE_FLOPS, first));
    TDM_CHECK(tdm_pp_schedule_build(&sched, kind, S, M));
    o->batch = (int)((a->batch + M - 1) / M);
    size_t peak[64], most = 0;
    tdm_plan st[1];
    tdm_status rc = TDM_STATUS_OK;
    for (int s = 0; s < S && !rc; s++) {
        rc = tdm_tool_plan_pp_stage(o, S, first, s, tdm_pp_schedule_in_flight(sched, s), &peak[s],
                                    st);
        if (!rc && peak[s] > most) most = peak[s];
    }
    if (rc) {
        tdm_pp_schedule_free(sched);
        fprintf(stderr, "tandem plan: %s\n", tdm_error_message());
        return rc;
    }
    char split[160];
    printf("tandem plan: %s, mode pp on %s (%d stages, %s, %d micro-batches of %d), precision "
           "%s%s\n", a->model, a->device, S, tdm_pp_schedule_name(kind), M, o->batch,
           tdm_precision_name(o->precision), o->ckpt ? ", checkpointing" : "");
    printf("peak per device: %.2f MiB (the largest stage's; first layers %s)\n",
           most / 1048576.0, tdm_pp_split_str(first, S, split, sizeof split));
    for (int s = 0; s < S; s++)
        printf("  stage %d (layers %d-%d): %.2f MiB, %d activation set%s\n", s, first[s],
               (s + 1 < S ? first[s + 1] : n) - 1, peak[s] / 1048576.0,
               tdm_pp_schedule_in_flight(sched, s), tdm_pp_schedule_in_flight(sched, s) == 1
               ? "" : "s");
    printf("  the received activations and gradients: in the links' shared memory (not the "
           "devices')\n");
    tdm_pp_schedule_free(sched);
    return TDM_STATUS_OK;
}

/* --mode fsdp: fsdp/mem.c's plan of one rank (rank 0: the largest share) */
static tdm_status tdm_plan_fsdp_print(const tdm_plan_args *a, const tdm_plan_opts *o, int world,
                                      tdm_fsdp_sharding sharding)
{
    tdm_fsdp_mem_plan f;
    tdm_status st = tdm_fsdp_plan_memory(o, world, sharding, 0, &f);
    if (st) {
        fprintf(stderr, "tandem plan: %s\n", tdm_error_message());
        return st;
    }
    const tdm_plan *p = &f.model;
    printf("tandem plan: %s, mode fsdp (%s) on %s (%d rank%s), batch %lld (%d per device at "
           "most), precision %s%s%s\n", a->model, tdm_fsdp_sharding_describe(sharding),
           a->device, world, world == 1 ? "" : "s", a->batch, o->batch,
           tdm_precision_name(o->precision), o->ckpt ? ", checkpointing" : "",
           !a->offload ? "" : o->offload ? ", shards and optimizer offloaded"
                                        : ", optimizer offloaded");
    printf("peak per device: %.2f MiB (%s)\n", f.peak / 1048576.0,
           f.peak == f.step_peak ? "during a step" : "at set-up, before the first step");
    printf("  %d units, a shard of %lld elements of %lld\n", f.n_units,
           (long long)f.shard_elems, (long long)p->param_elems);
    tdm_plan_line(sharding == TDM_FSDP_FULL_SHARD      ? "shards (params, grads)"
                  : sharding == TDM_FSDP_SHARD_GRAD_OP ? "full params, grad shard"
                                                       : "full params and grads",
                  f.shards);
    if (p->params_low) tdm_plan_line("16-bit weights", p->params_low);
    if (p->buffers) tdm_plan_line("buffers", p->buffers);
    tdm_plan_line("optimizer state", f.optim);
    tdm_plan_line("activations", p->activations);
    tdm_plan_line("scratch", p->act_scratch + p->step_scratch);
    tdm_plan_line("gathered units, grads", f.gathered);
    tdm_plan_line("comm: loss gradient", f.comm);
    tdm_plan_line("step peak", f.step_peak);
    tdm_plan_line("set-up peak", f.init_peak);
    if (p->optim_host) tdm_plan_line("host: offloaded state", p->optim_host);
    if (f.host) tdm_plan_line("host: shards, state", f.host);
    return TDM_STATUS_OK;
}

int tdm_tool_plan_main(int argc, char **argv)
{
    tdm_plan_args a;
    int help;
    tdm_status st = tdm_plan_parse(argc, argv, &a, &help);
    if (st || help) return tdm_tool_exit(st);
    int fsdp = !strcmp(a.mode, "fsdp"), ddp = !strcmp(a.mode, "ddp") || fsdp;
    int dp = !strcmp(a.mode, "dp"), pp = !strcmp(a.mode, "pp");
    if (!ddp && !dp && !pp && strcmp(a.mode, "single"))
        return tdm_tool_exit(tdm_tool_usage_error(
            "tandem plan: --mode %s: this build plans single, dp, ddp, fsdp and pp (tensor "
            "parallelism is not planned yet)\n", a.mode));
    if ((a.stages || a.micro || a.schedule) && !pp)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --stages, --microbatches and "
                                                  "--schedule apply to --mode pp\n"));
    tdm_fsdp_sharding sharding = TDM_FSDP_FULL_SHARD;
    if (a.sharding && !fsdp)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --sharding applies to --mode "
                                                  "fsdp\n"));
    if (a.sharding && tdm_fsdp_sharding_parse(a.sharding, &sharding))
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --sharding: %s\n",
                                                  tdm_error_message()));
    tdm_model_spec spec;
    if (tdm_model_spec_parse(&spec, a.model))
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --model: %s\n",
                                                  tdm_error_message()));
    if (tdm_model_spec_lever_op(&spec) >= 0 && ((a.precision && strcmp(a.precision, "fp32")) ||
                                                 a.ckpt)) {
        char why[512];
        tdm_model_spec_lever_refusal(&spec, why, sizeof why);
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: %s (leave out --precision and "
                                                  "--checkpoint-activations)\n", why));
    }
    int gpt = spec.kind == TDM_MODEL_GPT;
    if (!a.batch) a.batch = gpt ? TDM_TRAIN_GPT_BATCH : 256;
    if (a.batch < 1 || a.batch > 1 << 24)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --batch %lld: expected 1.."
                                                  "16777216\n", a.batch));
    if (!a.optim) a.optim = gpt ? "adamw" : "sgd";
    if (strcmp(a.optim, "sgd") && strcmp(a.optim, "adamw"))
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --optim '%s': expected sgd or "
                                                  "adamw\n", a.optim));
    /* the levers' checks are train's */
    tdm_train_args ta = {.mode = a.mode, .device = a.device, .precision = a.precision,
                         .ckpt = a.ckpt, .offload = a.offload, .clip_grad_norm = a.clip,
                         .sharding = a.sharding,
                         .grad_accum = 1};
    if ((st = tdm_train_levers_check(&ta))) return tdm_tool_exit(st);
    tdm_device_list dl;
    if ((st = tdm_device_list_parse(&dl, a.device)))
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --device: %s\n",
                                                  tdm_error_message()));
    int world = ddp || dp ? dl.count : 1;
    if (world < 1) world = 1;
    if ((ddp || dp) && a.batch < world)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --batch %lld is smaller than the "
                                                  "%d ranks\n", a.batch, world));
    int share = (int)((a.batch + world - 1) / world);   /* the largest rank's */
    tdm_plan_opts o;
    tdm_plan_opts_default(&o, &spec, share);
    o.precision = TDM_PRECISION_FP32;
    if (a.precision) (void)tdm_precision_parse(a.precision, &o.precision);
    o.ckpt = !a.ckpt ? 0 : !strcmp(a.ckpt, "all") ? 1 : atoi(a.ckpt);
    double lr = strcmp(a.optim, "sgd") ? (gpt ? 2e-3 : 1e-3) : 0.05;
    tdm_optim_opts_named(&o.optim, a.optim, lr, strcmp(a.optim, "sgd") ? 0.01 : 0.0, a.momentum,
                         0);
    int params = a.offload && !strcmp(a.offload, "params");   /* fsdp's (checked) */
    o.optim.offload = a.offload && !params ? TDM_OPTIM_OFFLOAD_HOST : TDM_OPTIM_OFFLOAD_NONE;
    o.offload = params ? TDM_PLAN_OFFLOAD_PARAMS : TDM_PLAN_OFFLOAD_NONE;
    o.device = dl.kind;
    o.threads = 1;
    o.loss_scaling = o.precision == TDM_PRECISION_FP16;
    o.grad_norm = a.clip > 0.0;
    if (fsdp) return tdm_tool_exit(tdm_plan_fsdp_print(&a, &o, world, sharding));
    if (pp) return tdm_tool_exit(tdm_plan_pp_print(&a, &o, dl.count));
    tdm_plan p;
    if ((st = tdm_plan_single(&o, &p))) {
        fprintf(stderr, "tandem plan: %s\n", tdm_error_message());
        return tdm_tool_exit(st);
    }
    if (ddp) {
        size_t dl_bytes = tdm_plan_stage_bytes(&o);
        p.act_scratch += dl_bytes;
        p.peak += dl_bytes;
    }
    size_t dp_bytes = 0;
    if (dp) {
        /* the master's device: its loss is the whole batch's */
        o.loss_batch = (int)a.batch;
        if ((st = tdm_plan_single(&o, &p))) {
            fprintf(stderr, "tandem plan: %s\n", tdm_error_message());
            return tdm_tool_exit(st);
        }
        dp_bytes = tdm_plan_dp_bytes(&o, &p);
        p.peak += dp_bytes;
    }
    printf("tandem plan: %s, mode %s on %s (%d %s), batch %lld (%d per device at most), "
           "precision %s%s%s\n", a.model, a.mode, a.device, world,
           dp ? (world == 1 ? "device" : "devices") : (world == 1 ? "rank" : "ranks"),
           a.batch, share, tdm_precision_name(o.precision), o.ckpt ? ", checkpointing" : "",
           a.offload ? ", optimizer offloaded" : "");
    printf("peak per device: %.2f MiB%s\n", p.peak / 1048576.0,
           dp ? " (the output device's: the master, at the largest chunk)" : "");
    tdm_plan_line("parameters", p.params);
    if (p.params_low) tdm_plan_line("16-bit weights", p.params_low);
    tdm_plan_line("gradients", p.grads);
    if (p.buffers) tdm_plan_line("buffers", p.buffers);
    tdm_plan_line("optimizer state", p.optim);
    tdm_plan_line("activations", p.activations);
    tdm_plan_line("scratch", p.act_scratch + p.step_scratch);
    if (p.optim_host) tdm_plan_line("host: offloaded state", p.optim_host);
    if (dp) tdm_plan_line("dp: batch, logits", dp_bytes);
    tdm_model_footprint fp = {0};
    tdm_device *host = NULL;
    if (ddp && dl.kind == TDM_DEVICE_HOST && tdm_device_open(&host, "cpu", 0, 1) == TDM_STATUS_OK &&
        tdm_model_spec_footprint(&spec, host, 1, &fp) == TDM_STATUS_OK)
        printf("  comm buffers: DDP's gradient buckets, %.2f MiB of the job's shared memory "
               "(not the device's)\n",
               tdm_ddp_arena_bytes(fp.param_elems) / 1048576.0);
    else if (ddp)
        printf("  comm buffers: DDP's gradient buckets in NCCL's memory (not planned)\n");
    tdm_device_free(host);
    return tdm_tool_exit(TDM_STATUS_OK);
}
