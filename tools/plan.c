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
#include "dist/mesh.h"
#include "dist/run.h"
#include "models/builder.h"
#include "models/plan.h"
#include "models/stage.h"
#include "pp/pp.h"
#include "tp/tp.h"
#include "tools/plan_peak.h"
#include "tools/rank_pptp.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_plan_args {
    const char *model, *mode, *device, *precision, *ckpt, *offload, *optim, *sharding;
    const char *schedule, *mesh;
    const char *offload_other;   /* an earlier --offload of another kind (refused) */
    long long batch, stages, micro;
    int seq_par;                 /* --sequence-parallel (tp) */
    double clip, momentum;
    double bucket_mb;            /* --bucket-cap-mb (tp grad_op; 0: train's default) */
} tdm_plan_args;

static void tdm_plan_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem plan [--model M] [--mode single|dp|ddp|fsdp|pp|tp] [--sharding S]\n"
        "                   [--device D] [--stages S] [--mesh dp=D,pp=S[,tp=N]|dp=D,tp=N]\n"
        "                   [--microbatches M] [--schedule gpipe|1f1b] [--sequence-parallel]\n"
        "                   [--batch B] [--precision fp32|bf16|fp16]\n"
        "                   [--checkpoint-activations [all|N]]\n"
        "                   [--clip-grad-norm X] [--offload optimizer|params]\n"
        "                   [--optim sgd|adamw]\n"
        "\n"
        "Prints the peak memory of one device (one rank) while the configuration\n"
        "trains, before anything is allocated: parameters, gradients, optimizer\n"
        "state, kept activations and scratch, as `tandem train` with the same\n"
        "options allocates them (the allocator's peak over the run, evaluation\n"
        "between epochs included: it runs at the step's batch; docs/MEMORY.md).\n"
        "ddp: each rank's model at its share of\n"
        "the global batch (the largest share), plus DDP's gradient buckets in the\n"
        "job's shared memory on host devices. fsdp: each rank's model at its share,\n"
        "less the flat buffers it releases, plus its shards (or full copies), the\n"
        "optimizer over the shard, the loss gradient, and the gathered units and full\n"
        "gradients at their most; or the set-up's peak (the model's buffers beside the\n"
        "new shards) where that is higher. dp: the output device, which holds the\n"
        "master (replica 0, at the largest chunk) with the optimizer, and the whole\n"
        "batch's inputs, logits, their gradient and labels (its loss is the batch's).\n"
        "pp (the balanced split): each stage's model slice, the schedule's activation\n"
        "sets at ceil(B/M) samples, the shared scratch and the GPT's tied-gradient\n"
        "buffer (the received activations and gradients: in the links' shared memory\n"
        "on host devices, counted on a GPU's); with D replicas (--mesh dp=D,pp=S, or\n"
        "--stages S of D*S devices) every replica's stage alike at ceil(B/D) samples,\n"
        "and with --sharding optimizer its optimizer state over 1/D of the stage;\n"
        "with tp=N stages (--mesh dp=D,pp=S,tp=N) a rank's slices of its stage.\n"
        "tp (--mesh dp=D,tp=N, or N = the devices): a rank's slices of the parameters,\n"
        "gradients and optimizer state (ZeRO-1 over dp with --sharding optimizer; ZeRO-2\n"
        "with grad_op: a gradient shard kept, and inside a step the most of the\n"
        "gradient's buckets backward holds at once: --bucket-cap-mb, as train's), the\n"
        "activations and scratch at ceil(B/D) samples (with checkpointing: one block's\n"
        "set and the block outputs), the scratch (loss rows, the levers'), and with\n"
        "--precision bf16|fp16 the products' 16-bit operands (the largest product's).\n"
        "  --model M      as tandem train                          [mlp]\n"
        "  --mode M       single, dp, ddp, fsdp, pp or tp          [single]\n"
        "  --stages S, --microbatches M, --schedule K, --mesh dp=D,pp=S   pp's, as\n"
        "                 tandem train's       [the devices, 4, 1f1b, dp=1]\n"
        "  --mesh dp=D,tp=N, --sequence-parallel   tp's, as tandem train's\n"
        "  --sharding S   fsdp: full (ZeRO-3), grad_op (ZeRO-2), optimizer (ZeRO-1);\n"
        "                 pp and tp with dp >= 2: optimizer; tp: grad_op too [full]\n"
        "  --device D     cpu, cpu:N, cuda, cuda:N (ddp: one rank per device; dp:\n"
        "                 one replica per device)                   [cpu]\n"
        "  --batch B      the global batch                 [256; gpt: %d]\n"
        "  --bucket-cap-mb MB   tp grad_op: ZeRO-2's gradient bucket cap   [25]\n"
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
                           : !strcmp(s, "--mesh")      ? &a->mesh
                                                       : NULL;
        if (str || !strcmp(s, "--batch") || !strcmp(s, "--clip-grad-norm") ||
            !strcmp(s, "--momentum") || !strcmp(s, "--stages") || !strcmp(s, "--microbatches") ||
            !strcmp(s, "--bucket-cap-mb")) {
            if (!v) return tdm_tool_usage_error("tandem plan: %s needs a value\n", s);
            i++;
            char *end = NULL;
            if (str == &a->offload && a->offload && strcmp(a->offload, v) && !a->offload_other)
                a->offload_other = a->offload;
            if (str) *str = v;
            else if (!strcmp(s, "--batch")) a->batch = strtoll(v, &end, 10);
            else if (!strcmp(s, "--stages")) a->stages = strtoll(v, &end, 10);
            else if (!strcmp(s, "--microbatches")) a->micro = strtoll(v, &end, 10);
            else if (!strcmp(s, "--clip-grad-norm")) a->clip = strtod(v, &end);
            else if (!strcmp(s, "--bucket-cap-mb")) a->bucket_mb = strtod(v, &end);
            else a->momentum = strtod(v, &end);
            if (end && (*end || end == v))
                return tdm_tool_usage_error("tandem plan: %s '%s': expected a number\n", s, v);
            if (!strcmp(s, "--bucket-cap-mb") && !(a->bucket_mb > 0))
                return tdm_tool_usage_error("tandem plan: --bucket-cap-mb '%s': expected a "
                                            "size in MiB above 0\n", v);
            continue;
        }
        if (!strcmp(s, "--checkpoint-activations")) {
            a->ckpt = "all";
            if (v && v[0] != '-') a->ckpt = argv[++i];
            continue;
        }
        if (!strcmp(s, "--sequence-parallel")) {
            a->seq_par = 1;
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

/* DataParallel's master on a device that is not the host reads its
 * chunk from DataParallel's own buffers (dp/dp.c), not through
 * tdm_single's input staging, which the single-device plan counts: out
 * of p. */
static void tdm_plan_dp_master(const tdm_plan_opts *o, tdm_plan *p)
{
    if (o->device == TDM_DEVICE_HOST) return;
    size_t B = (size_t)o->batch, in = 0;
    int c = 1, h = 1, w = 1, classes;
    if (o->spec.kind == TDM_MODEL_GPT) {
        in = (size_t)o->spec.n_ctx;
    } else {
        tdm_model_spec_sample_shape(&o->spec, &c, &h, &w, &classes);
        in = (size_t)c * (size_t)h * (size_t)w;
    }
    size_t staging = (B * in * sizeof(float) + 63) / 64 * 64 +
                     (B * (size_t)p->out_rows * sizeof(int32_t) + 63) / 64 * 64;
    if (staging > p->step_scratch) staging = p->step_scratch;
    p->step_scratch -= staging;
    p->peak -= staging;
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
    if (mode == TDM_TOOL_PLAN_DP) tdm_plan_dp_master(o, &p);
    *peak = p.peak + (mode == TDM_TOOL_PLAN_DDP ? tdm_plan_stage_bytes(o) : 0) +
            (mode == TDM_TOOL_PLAN_DP ? tdm_plan_dp_bytes(o, &p) : 0);
    return TDM_STATUS_OK;
}

static size_t tdm_plan_round64(size_t n) { return (n + 63) / 64 * 64; }

tdm_status tdm_tool_plan_pp_stage(const tdm_plan_opts *o, const tdm_tool_pp_place *at,
                                  size_t *peak, tdm_plan *p)
{
    int n = 0, S = at->S, s = at->s, sets = at->sets > 0 ? at->sets : 1;
    TDM_CHECK(tdm_model_spec_n_layers(&o->spec, &n));
    tdm_plan_opts so = *o;
    so.stage_lo = at->first[s];
    so.stage_hi = s + 1 < S ? at->first[s + 1] : n;
    TDM_CHECK(tdm_plan_single(&so, p));
    /* the set's rounded input is in act_scratch once: per set here */
    size_t x16 = p->act_set - p->activations, shared = p->act_scratch - x16;
    size_t tied = 0, links = 0;
    if (o->spec.kind == TDM_MODEL_GPT && S > 1 && (s == 0 || s == S - 1))
        tied = tdm_plan_round64((size_t)o->spec.vocab * (size_t)o->spec.n_embd * sizeof(float));
    if (at->zero1_reps > 1) {
        /* ZeRO-1 over the dp dimension (tools/rank_pp.c): the state over
         * this replica's chunk of the stage, and the stage's parameters
         * padded to reps chunks where they do not divide evenly */
        size_t pe = (size_t)p->param_elems, reps = (size_t)at->zero1_reps;
        size_t chunk = (pe + reps - 1) / reps;
        p->optim = (size_t)tdm_optim_kind_n_state(&o->optim) * tdm_plan_round64(chunk * 4);
        if (chunk * reps != pe) p->optim += tdm_plan_round64(chunk * reps * 4);
    }
    if (o->device != TDM_DEVICE_HOST) {
        /* pp/pp.c's tdm_pp_buffers on a device that is not the host */
        size_t B = (size_t)o->batch;
        size_t in_b = tdm_plan_round64(B * (size_t)p->in_elems * 4);
        size_t out_b = tdm_plan_round64(B * (size_t)p->out_elems * 4);
        int n_in = sets + 1 < at->n_mb ? sets + 1 : at->n_mb;
        if (n_in < sets) n_in = sets;
        links = (size_t)(s > 0 ? n_in : sets) * in_b;
        if (s + 1 < S) links += 2 * out_b;
        else links += tdm_plan_round64(B * (size_t)p->out_rows * sizeof(int32_t));
    }
    /* batchnorm's per-batch statistics (mean, var, invstd) are kept per
     * activation set (models/stage.c), the running ones once */
    size_t running = p->buffer_elems ? tdm_plan_round64((size_t)p->buffer_elems * 4) : 0;
    size_t bn_sets = (size_t)(sets - 1) * (p->buffers - running);
    *peak = p->params + p->grads + p->buffers + bn_sets + p->params_low + p->optim +
            (size_t)sets * p->act_set + shared + p->step_scratch + tied + links;
    return TDM_STATUS_OK;
}

tdm_status tdm_tool_plan_pp_rank(const tdm_tool_build *b, const tdm_mesh_shape *shape,
                                 const int coord[TDM_MESH_NDIMS], tdm_device_kind dev,
                                 int batch, int threads, int grad_norm, size_t *planned)
{
    int S = shape->size[TDM_MESH_PP], reps = shape->size[TDM_MESH_DP], n = 0;
    int s = coord[TDM_MESH_PP], first[64];
    *planned = 0;
    TDM_REQUIRE(!b->deterministic, TDM_STATUS_UNSUPPORTED,
                "plan: --deterministic's virtual shards are not planned");
    TDM_REQUIRE(S >= 1 && S <= 64 && b->pp.micro >= 1 && batch >= 1, TDM_STATUS_INVALID_ARG,
                "plan: %d stages (1..64), %d micro-batches, a batch of %d", S, b->pp.micro,
                batch);
    TDM_CHECK(tdm_model_spec_n_layers(&b->spec, &n));
    TDM_CHECK(b->pp.split ? tdm_pp_split_parse(b->pp.split, S, n, first)
                          : tdm_pp_split_balance(&b->spec, S, TDM_PP_BALANCE_FLOPS, first));
    /* tensor-parallel stages (tools/rank_pptp.h): a rank's stage is the
     * stage of the narrow spec (its slices), its partial sums in place */
    tdm_model_spec spec = b->spec;
    if (shape->size[TDM_MESH_TP] > 1) {
        tdm_pptp_cut cut[TDM_PPTP_MAX_LAYERS];
        TDM_CHECK(tdm_pptp_plan(&b->spec, S, first, shape->size[TDM_MESH_TP], cut, &spec));
    }
    tdm_pp_schedule *sched = NULL;
    TDM_CHECK(tdm_pp_schedule_build(&sched, b->pp.schedule, S, b->pp.micro));
    int share = (batch + reps - 1) / reps;
    tdm_plan_opts o;
    tdm_plan stage;
    tdm_plan_opts_default(&o, &spec, (share + b->pp.micro - 1) / b->pp.micro);
    o.precision = b->precision;
    o.ckpt = b->ckpt;
    o.optim = b->optim;
    o.device = dev;
    o.threads = threads;
    o.loss_scaling = o.precision == TDM_PRECISION_FP16;
    o.grad_norm = grad_norm;
    tdm_tool_pp_place at = {.S = S, .first = first, .s = s,
                            .sets = tdm_pp_schedule_in_flight(sched, s),
                            .n_mb = (share + o.batch - 1) / o.batch,
                            .zero1_reps = b->pp.zero1 ? reps : 0};
    tdm_pp_schedule_free(sched);
    return tdm_tool_plan_pp_stage(&o, &at, planned, &stage);
}

tdm_status tdm_tool_plan_tp_rank(const tdm_model_spec *spec, const tdm_optim_opts *optim, int T,
                                 int D, int share, int seq_par, int zero, double bucket_mb,
                                 int ckpt, const tdm_tool_tp_levers *lev, tdm_tool_tp_plan *out)
{
    int zero1 = zero != 0;   /* ZeRO-1 or 2: the same chunks */
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(T >= 1 && D >= 1 && share >= 1, TDM_STATUS_INVALID_ARG,
                "plan: tp over %d ranks, %d replicas, a share of %d samples", T, D, share);
    tdm_tp_rank_footprint fp;
    TDM_CHECK(tdm_tp_footprint_ckpt(spec, T, share, seq_par, ckpt, &fp));
    size_t n = (size_t)fp.elems;
    size_t chunk = zero1 && D > 1 ? (n + (size_t)D - 1) / (size_t)D : n;
    /* ZeRO-1 pads the flat parameters and gradients to D whole chunks
     * (tp/tp.c's tdm_tp_flat_alloc), so both collectives run in place */
    size_t flat = tdm_plan_round64((zero1 && D > 1 ? chunk * (size_t)D : n) * sizeof(float));
    out->elems = fp.elems;
    out->params = out->grads = flat;
    /* ZeRO-2: the kept shard, besides the step's whole gradient or (with
     * buckets, not under sequence parallelism) the most of its buckets
     * backward holds at once */
    out->grad_shard = zero == 2 && D > 1 ? tdm_plan_round64(chunk * sizeof(float)) : 0;
    if (zero == 2 && D > 1 && bucket_mb > 0 && !seq_par)
        TDM_CHECK(tdm_tp_zero2_bucket_bytes(spec, T, D, (size_t)(bucket_mb * 1048576.0),
                                            &out->grads));
    out->optim = (size_t)tdm_optim_kind_n_state(optim) * tdm_plan_round64(chunk * sizeof(float));
    out->activations = fp.act_bytes;
    /* the device's scratch through a step (models/plan.h): the loss's
     * per-row values, fp16's found-inf flag, the norm's partial sums over
     * the elements rank 0 counts (its whole slice, or under ZeRO-1
     * replica 0's chunk of it: tp/levers.c) and the norm itself */
    size_t rows = (size_t)share * (size_t)(spec->kind == TDM_MODEL_GPT ? spec->n_ctx : 1);
    size_t needs[4];
    int k = 0;
    tdm_precision prec = lev ? lev->precision : TDM_PRECISION_FP32;
    needs[k++] = rows * sizeof(float);
    if (prec == TDM_PRECISION_FP16) needs[k++] = sizeof(float);
    if (lev && lev->grad_norm) {
        needs[k++] = (size_t)tdm_dev_sumsq_chunks((int64_t)(chunk < n ? chunk : n)) *
                     sizeof(double);
        needs[k++] = sizeof(double);
    }
    out->scratch = tdm_plan_scratch_peak(needs, k);
    /* the 16-bit products' operand block (tp/levers.c), and a host
     * device's float32 widening of fp16 operands */
    if (prec != TDM_PRECISION_FP32) {
        out->low = tdm_plan_round64(fp.low_bytes);
        if (lev->device == TDM_DEVICE_HOST && prec == TDM_PRECISION_FP16)
            out->low += tdm_plan_round64((size_t)fp.wide_elems * sizeof(float));
    }
    out->peak = out->params + out->grads + out->grad_shard + out->optim + out->activations +
                out->scratch + out->low;
    return TDM_STATUS_OK;
}

/* --mode tp [--mesh dp=D,tp=N] on the devices: one rank's plan (every
 * rank's slices have the same sizes; the largest replica's share). */
static tdm_status tdm_plan_tp_print(const tdm_plan_args *a, const tdm_plan_opts *o, int devices)
{
    tdm_mesh_shape shape = {.size = {1, 1, devices}};
    if (a->mesh && tdm_mesh_parse(a->mesh, devices, &shape))
        return tdm_tool_usage_error("tandem plan: --mesh: %s\n", tdm_error_message());
    int D = shape.size[TDM_MESH_DP], T = shape.size[TDM_MESH_TP], zero1 = a->sharding != NULL;
    /* --sharding optimizer (ZeRO-1) or grad_op (ZeRO-2; checked) */
    tdm_fsdp_sharding sh = TDM_FSDP_SHARD_OPTIM;
    if (zero1) (void)tdm_fsdp_sharding_parse(a->sharding, &sh);
    int zero = !zero1 ? 0 : sh == TDM_FSDP_SHARD_GRAD_OP ? 2 : 1;
    if (shape.size[TDM_MESH_PP] > 1)
        return tdm_tool_usage_error("tandem plan: --mode tp --mesh %s: a pipeline of "
                                    "tensor-parallel stages is --mode pp's, not planned yet\n",
                                    a->mesh);
    if (zero1 && D < 2)
        return tdm_tool_usage_error("tandem plan: --sharding %s shards over the dp "
                                    "dimension: it needs --mesh dp=D,tp=N with D >= 2\n",
                                    a->sharding);
    if (a->batch < D)
        return tdm_tool_usage_error("tandem plan: --batch %lld is smaller than the %d "
                                    "replicas\n", a->batch, D);
    tdm_tool_tp_plan t;
    tdm_tool_tp_levers lev = {.precision = o->precision, .grad_norm = o->grad_norm,
                              .device = o->device};
    tdm_status st = tdm_tool_plan_tp_rank(&o->spec, &o->optim, T, D,
                                          (int)((a->batch + D - 1) / D), a->seq_par, zero,
                                          a->bucket_mb > 0 ? a->bucket_mb
                                                           : TDM_TOOL_TP_BUCKET_MB,
                                          o->ckpt, &lev, &t);
    if (st) {
        fprintf(stderr, "tandem plan: --mode tp: %s\n", tdm_error_message());
        return st == TDM_STATUS_INVALID_ARG ? TDM_STATUS_USAGE : st;
    }
    printf("tandem plan: %s, mode tp on %s (%d rank%s%s%s%s), batch %lld (%lld per replica at "
           "most), precision %s%s\n", a->model, a->device, T, T == 1 ? "" : "s",
           D > 1 ? " x " : "",
           D > 1 ? (zero == 2 ? "replicas, ZeRO-2 over dp" : zero ? "replicas, ZeRO-1 over dp"
                                                                 : "replicas")
                 : "",
           a->seq_par ? ", sequence parallel" : "", a->batch, (a->batch + D - 1) / D,
           tdm_precision_name(o->precision), o->ckpt ? ", checkpointing" : "");
    printf("peak per device: %.2f MiB (a rank of the replica with the largest share; every "
           "rank's slices have the same sizes)\n", t.peak / 1048576.0);
    printf("  %-22s %10lld elements\n", "the rank's slice", (long long)t.elems);
    tdm_plan_line("parameters", t.params);
    tdm_plan_line(zero == 2 ? "gradients (in a step)" : "gradients", t.grads);
    if (zero == 2) tdm_plan_line("gradient shard (1/D)", t.grad_shard);
    tdm_plan_line(zero1 ? "optimizer (1/D of it)" : "optimizer state", t.optim);
    tdm_plan_line("activations, scratch", t.activations);
    tdm_plan_line("scratch (loss rows)", t.scratch);
    if (t.low) tdm_plan_line("16-bit operands", t.low);
    printf("  not counted: %s\n", o->device == TDM_DEVICE_HOST
                                      ? "nothing on host devices (DDP over dp: the job's shared "
                                        "memory)"
                                      : "cuBLAS's and NCCL's own buffers");
    return TDM_STATUS_OK;
}

/* --mode pp: every stage's plan (the balanced split),
 * the micro-batches of ceil(ceil(B/D)/M) samples: one pipeline over the
 * devices, or D replicas of S stages (--mesh dp=D,pp=S, or --stages S
 * of D*S devices), each replica's stage planned alike at the largest
 * replica's share (the pipeline sizes every replica's micro-batches by
 * it), --sharding optimizer: ZeRO-1 over the dp dimension. */
static tdm_status tdm_plan_pp_print(const tdm_plan_args *a, tdm_plan_opts *o, int devices)
{
    int M = a->micro > 0 ? (int)a->micro : 4, n = 0, zero1 = a->sharding != NULL;
    tdm_pp_schedule_kind kind = TDM_PP_1F1B;
    if (a->schedule && tdm_pp_schedule_parse(a->schedule, &kind))
        return tdm_tool_usage_error("tandem plan: --schedule: %s\n", tdm_error_message());
    tdm_mesh_shape shape = {.size = {1, devices, 1}};
    int S0 = a->stages > 0 ? (int)a->stages : devices;
    if (a->mesh) {
        if (tdm_mesh_parse(a->mesh, devices, &shape))
            return tdm_tool_usage_error("tandem plan: --mesh: %s\n", tdm_error_message());
        if (a->stages > 0 && a->stages != shape.size[TDM_MESH_PP])
            return tdm_tool_usage_error("tandem plan: --stages %lld, but --mesh %s has pp=%d\n",
                                        a->stages, a->mesh, shape.size[TDM_MESH_PP]);
    } else if (S0 >= 1 && devices % S0 == 0) {
        shape = (tdm_mesh_shape){.size = {devices / S0, S0, 1}};
    } else {
        return tdm_tool_usage_error("tandem plan: --stages %d does not divide the %d devices: a "
                                    "pipeline of S stages runs on S devices (or D*S: D "
                                    "replicas)\n", S0, devices);
    }
    int S = shape.size[TDM_MESH_PP], D = shape.size[TDM_MESH_DP], T = shape.size[TDM_MESH_TP];
    if (zero1 && D < 2)
        return tdm_tool_usage_error("tandem plan: --sharding optimizer shards each stage's "
                                    "optimizer over the dp dimension: it needs --mesh dp=D,pp=S "
                                    "with D >= 2 (dp is %d)\n", D);
    TDM_CHECK(tdm_model_spec_n_layers(&o->spec, &n));
    int share = (int)((a->batch + D - 1) / D);
    if (S < 1 || S > 64 || S > n || M < 1 || M > a->batch)
        return tdm_tool_usage_error("tandem plan: --mode pp: %d stages of a model of %d "
                                    "pipeline layers, %d micro-batches of a batch of %lld: "
                                    "expected 1 <= S <= layers (at most 64), 1 <= M <= batch\n",
                                    S, n, M, a->batch);
    int first[64];
    tdm_pp_schedule *sched = NULL;
    TDM_CHECK(tdm_pp_split_balance(&o->spec, S, TDM_PP_BALANCE_FLOPS, first));
    if (T > 1) {
        /* tensor-parallel stages (tools/rank_pptp.h): a rank's stage is
         * the narrow spec's, its slices; its partial sums run in place */
        tdm_pptp_cut cut[TDM_PPTP_MAX_LAYERS];
        tdm_model_spec narrow;
        if (tdm_pptp_plan(&o->spec, S, first, T, cut, &narrow))
            return tdm_tool_usage_error("tandem plan: --mesh %s: %s\n", a->mesh,
                                        tdm_error_message());
        o->spec = narrow;
    }
    TDM_CHECK(tdm_pp_schedule_build(&sched, kind, S, M));
    o->batch = (share + M - 1) / M;
    size_t peak[64], most = 0;
    tdm_plan st[1];
    tdm_status rc = TDM_STATUS_OK;
    for (int s = 0; s < S && !rc; s++) {
        tdm_tool_pp_place at = {.S = S, .first = first, .s = s,
                                .sets = tdm_pp_schedule_in_flight(sched, s),
                                .n_mb = (share + o->batch - 1) / o->batch,
                                .zero1_reps = zero1 ? D : 0};
        rc = tdm_tool_plan_pp_stage(o, &at, &peak[s], st);
        if (!rc && peak[s] > most) most = peak[s];
    }
    if (rc) {
        tdm_pp_schedule_free(sched);
        fprintf(stderr, "tandem plan: %s\n", tdm_error_message());
        return rc;
    }
    char split[160], reps[160] = "", tps[96] = "";
    if (T > 1)
        snprintf(tps, sizeof tps, ", each stage over %d tensor-parallel ranks (a rank's slices)",
                 T);
    if (D > 1)
        snprintf(reps, sizeof reps, " x %d replicas (dp=%d, %s)", D, D,
                 zero1 ? "ZeRO-1: each replica keeps 1/D of a stage's optimizer state"
                       : "DDP over the dp dimension");
    printf("tandem plan: %s, mode pp on %s (%d stages%s%s, %s, %d micro-batches of %d), "
           "precision %s%s\n", a->model, a->device, S, reps, tps, tdm_pp_schedule_name(kind), M,
           o->batch, tdm_precision_name(o->precision), o->ckpt ? ", checkpointing" : "");
    printf("peak per device: %.2f MiB (the largest stage's%s; first layers %s)\n",
           most / 1048576.0, D > 1 ? ", every replica alike" : "",
           tdm_pp_split_str(first, S, split, sizeof split));
    for (int s = 0; s < S; s++)
        printf("  stage %d (layers %d-%d): %.2f MiB, %d activation set%s\n", s, first[s],
               (s + 1 < S ? first[s + 1] : n) - 1, peak[s] / 1048576.0,
               tdm_pp_schedule_in_flight(sched, s), tdm_pp_schedule_in_flight(sched, s) == 1
               ? "" : "s");
    if (o->device == TDM_DEVICE_HOST)
        printf("  the received activations and gradients: in the links' shared memory (not the "
               "devices')%s\n", D > 1 && !zero1 ? "; DDP's buckets over the dp dimension: in "
               "the job's shared memory" : "");
    else
        printf("  the received activations and gradients, the inputs and targets: in the "
               "device's memory (counted); not counted: cuBLAS's and NCCL's own buffers%s\n",
               D > 1 && !zero1 ? ", nor DDP's gradient buffer over the dp dimension (on a "
               "GPU NCCL's cudaMalloc, the stage's parameters x 4 bytes more; on the emulator "
               "the host communicator's)" : "");
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
    int dp = !strcmp(a.mode, "dp"), pp = !strcmp(a.mode, "pp"), tp = !strcmp(a.mode, "tp");
    if (!ddp && !dp && !pp && !tp && strcmp(a.mode, "single"))
        return tdm_tool_exit(tdm_tool_usage_error(
            "tandem plan: --mode %s: this build plans single, dp, ddp, fsdp, pp and tp\n",
            a.mode));
    if ((a.stages || a.micro || a.schedule) && !pp)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --stages, --microbatches and "
                                                  "--schedule apply to --mode pp\n"));
    if (a.mesh && !pp && !tp)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --mesh applies to --mode pp "
                                                  "and tp\n"));
    if (a.seq_par && !tp)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --sequence-parallel applies to "
                                                  "--mode tp\n"));
    tdm_fsdp_sharding sharding = TDM_FSDP_FULL_SHARD;
    if (a.sharding && !fsdp && !pp && !tp)
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --sharding applies to --mode "
                                                  "fsdp (and optimizer to --mode pp's dp "
                                                  "dimension)\n"));
    if (a.sharding && tdm_fsdp_sharding_parse(a.sharding, &sharding))
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --sharding: %s\n",
                                                  tdm_error_message()));
    if (a.sharding && (pp || tp) && sharding != TDM_FSDP_SHARD_OPTIM &&
        !(tp && sharding == TDM_FSDP_SHARD_GRAD_OP))
        return tdm_tool_exit(tdm_tool_usage_error("tandem plan: --mode %s --sharding %s: its "
                                                  "replicas shard only the optimizer state "
                                                  "(--sharding optimizer%s)\n", a.mode,
                                                  a.sharding, tp ? ", or grad_op" : ""));
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
                         .sharding = a.sharding, .mesh = a.mesh, .tool = "tandem plan",
                         .offload_other = a.offload_other,
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
    if (tp) return tdm_tool_exit(tdm_plan_tp_print(&a, &o, dl.count));
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
        tdm_plan_dp_master(&o, &p);
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
