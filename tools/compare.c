/* tools/compare.c: `tandem compare`: the same training run three ways -
 * one device, DataParallel on N devices, DistributedDataParallel on N
 * ranks - from the same initial parameters over the same global batches,
 * and what differs: throughput, where each step's time goes, whether the
 * three computed the same parameters, memory per device, and a reading of
 * those figures in words. Options --trace, --csv, --plot write the raw
 * material; --sweep repeats DP and DDP over device counts. In the order
 * it runs: parse, check the options, check the output paths, load the
 * data and the global batches, run the modes (compare_run.c), print the
 * throughput, the phases, the equivalence verdict, the memory and the
 * reading, run the sweep, write the trace, CSV and charts
 * (compare_out.c). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/device.h"
#include "core/safefile.h"
#include "ddp/ddp.h"
#include "ddp/hooks.h"
#include "dist/mpi_job.h"
#include "dist/run.h"
#include "core/npy.h"
#include "models/builder.h"
#include "models/stage.h"
#include "models/train.h"
#include "pp/pp.h"
#include "tp/tp.h"
#include "tools/args.h"
#include "tools/compare.h"
#include "tools/devices.h"
#include "tools/rank_pptp.h"
#include "tools/compare_json.h"
#include "tools/tools.h"

/* Float tolerances of the equivalence verdict, |a - b| <= atol + rtol |b|.
 * After one step the modes differ only by the reassociation of sums over
 * the batch (gemm blocking, per-chunk partial sums): measured max |diff|
 * ~1.5e-8 on parameters of size ~1e-2, far inside the bound. Over many
 * steps SGD amplifies any difference, however small, so the final check
 * also accepts a difference up to TDM_CMP_FLOOR_FACTOR times what a
 * one-ulp change of the initial parameters produces on one device over
 * the same run (measured in the same run: the float-noise floor). */
#define TDM_CMP_ATOL_FIRST 1e-5
#define TDM_CMP_RTOL_FIRST 1e-4
#define TDM_CMP_ATOL_LAST 1e-4
#define TDM_CMP_RTOL_LAST 1e-3
#define TDM_CMP_LOSS_RTOL 1e-4

static void tdm_cmp_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem compare [options]\n"
        "\n"
        "Runs the same training several ways - one device, DataParallel on N devices,\n"
        "DistributedDataParallel on N ranks and sharded data parallel on N ranks - from\n"
        "the same initial parameters over the same global batches, and prints\n"
        "throughput, a per-phase breakdown, an equivalence verdict, memory per device\n"
        "and a reading of the figures.\n"
        "\n"
        "  --modes LIST         any of single, dp, ddp, fsdp, zero2, zero1, pp, tp, tp-sp,\n"
        "                       ps, ps-async (comma-\n"
        "                       separated; single always runs, as the reference)\n"
        "                                                          [single,dp,ddp,fsdp]\n"
        "                       fsdp:  PyTorch FSDP FULL_SHARD, DeepSpeed ZeRO stage 3\n"
        "                       zero2: FSDP SHARD_GRAD_OP, ZeRO stage 2\n"
        "                       zero1: ZeroRedundancyOptimizer, ZeRO stage 1\n"
        "                       pp:    a pipeline of the layers (GPipe or 1F1B): its\n"
        "                       throughput, per-stage phases and bubble, memory, the\n"
        "                       trace's F and B of each micro-batch per stage, and its\n"
        "                       verdict against one host device with --grad-accum M\n"
        "                       tp:    tensor parallel over the N devices (the MLP's\n"
        "                       column/row pairs, the GPT's heads): its throughput, phases\n"
        "                       with the all-reduces, memory and bytes per rank, and\n"
        "                       its verdict against one host device (compare's\n"
        "                       bound after the last step)\n"
        "                       tp-sp: tp with sequence parallelism (the GPT:\n"
        "                       reduce-scatters and all-gathers along the tokens)\n"
        "                       ps, ps-async: a parameter server (tandem train --mode\n"
        "                       ps, mlp, host devices), sync or async, N-1 workers and\n"
        "                       each count of --servers: samples/s against DDP, each\n"
        "                       server's bytes in and out per step against DDP's\n"
        "                       all-reduced bytes, the staleness of applied gradients,\n"
        "                       the loss curve against DDP's, the server sweep\n"
        "  --servers 1,2        ps: server counts to run     [1, and 2 from cpu:4]\n"
        "  --stages S           pp: stages, one device each (S <= N)    [N]\n"
        "  --microbatches M     pp: micro-batches per global batch       [4]\n"
        "  --schedule S         pp: gpipe or 1f1b                        [1f1b]\n"
        "  --mesh dp=D,pp=S     the pp row as D replicas of S stages, or\n"
        "  --mesh dp=D,tp=N     the tp row as D replicas of N ranks, or\n"
        "  --mesh dp=D,pp=S,tp=N the pp row with stages tensor-parallel over N\n"
        "                       ranks (the MLP; the product: the devices)\n"
        "  --model NAME         mlp, mlp:W0-..-Wn, cnn, gpt, gpt:L-D-H-T or\n"
        "                       file:PATH (a model file, docs/MODELS.md)      [mlp]\n"
        "  --device SPEC        devices for DP and DDP: cpu:N (N >= 1), or GPUs\n"
        "                       cuda (all) / cuda:I,J,.. (single runs on the first) [cpu:2]\n"
        "  --steps S            training steps per mode                      [30]\n"
        "  --warmup W           steps left out of the timing figures, below --steps\n"
        "                       [3, or half of --steps when that is fewer]\n"
        "  --batch B            global batch size (B >= N)   [256; gpt: %d windows]\n"
        "  --data DIR|synthetic Fashion-MNIST directory or synthetic data  [Fashion-MNIST]\n"
        "  --data X.npy,Y.npy   NumPy arrays: inputs (n, ...), labels (n,) (docs/MODELS.md)\n"
        "  --data FILE|DIR      gpt: any file, or a fortunes directory  [Debian's fortunes]\n"
        "  --optim sgd|adamw    [sgd; gpt: adamw]                    --momentum M [0.9]\n"
        "  --lr LR              [sgd: 0.05, adamw: 0.001 (gpt: 0.002)], as train's\n"
        "  --seed S             initial parameters and data order            [1]\n"
        "  --bucket-cap-mb MB   DDP bucket cap                               [25]\n"
        "  --no-overlap         DDP all-reduces after backward (to see what overlap buys)\n"
        "  --trace FILE         Chrome trace-event JSON (Perfetto, chrome://tracing)\n"
        "  --csv FILE           raw per-step figures, the sweep's runs too (columns:\n"
        "                       docs/OUTPUTS.md)\n"
        "  --json FILE          the results for a program: per mode throughput (median,\n"
        "                       min, max), phases, memory, bytes, the verdict and its\n"
        "                       bounds (schema: docs/OUTPUTS.md)\n"
        "  --plot DIR           loss, throughput, phase (and scaling) charts, with gnuplot;\n"
        "                       DIR must be yours and not writable by others\n"
        "  --sweep 1,2,4        also run DP and DDP (and with pp, a pipeline of as many\n"
        "                       stages) at these device counts\n"
        "  --deterministic K    instead: every mode of --modes at every count of --sweep\n"
        "                       (else 1 and --device's) with tandem train --deterministic\n"
        "                       K, each final checkpoint against one device's byte for\n"
        "                       byte (\"bitwise identical\"), and each run's throughput\n"
        "                       against the default mode's (docs/DETERMINISM.md)\n"
        "  --sync-bn            DDP with SyncBatchNorm: the CNN's DDP is then checked\n"
        "                       against one device with the MLP's tolerance\n"
        "  --comm-hook H        also run DDP with a comm hook: fp16, bf16 or powersgd,\n"
        "                       beside the float32 one: bytes per step, exposed time,\n"
        "                       throughput, loss curve, and a verdict on the expected,\n"
        "                       bounded difference (docs/DDP.md); fp16 and bf16 also\n"
        "                       run the sharded modes of --modes with the hook, each\n"
        "                       against hooked DDP (docs/FSDP.md)        [allreduce]\n"
        "  --powersgd-rank R    [4]   --powersgd-start-step S (plain before)   [10]\n"
        "  --precision P        fp32 or bf16 in every mode but tp (fp16's loss scaling,\n"
        "                       and tp's: tandem train)                   [fp32]\n"
        "  --checkpoint-activations N  recompute segments of N blocks in backward\n"
        "                       in every mode (tp: N = 1)\n"
        "  --clip-grad-norm X   clip the global gradient norm to X in the pp row (and its\n"
        "                       one-device reference): --modes pp only (single runs\n"
        "                       beside it unclipped, as the speed baseline)\n"
        "  --perturb-rank R     testing aid: DDP rank R adds 1%% to its gradient share,\n"
        "                       which the equivalence verdict must catch (with\n"
        "                       --comm-hook: only the hooked run, for its verdict)\n"
        "  --backend B          under mpirun/srun: the communicator of DDP and the sharded\n"
        "                       modes, shm, mpi, hier or auto (shm on one machine, hier\n"
        "                       otherwise)    [auto]\n"
        "\n"
        "Under an MPI launcher (mpirun -np N tandem compare ...) the N ranks of DDP and\n"
        "of the sharded modes are the job's; rank 0 also runs one device and DP (give\n"
        "it the cores: --bind-to none) and prints the report; --device defaults to cpu:N.\n"
        "\n"
        "Exit codes: 0 ok and equivalent, 1 a run failed, 2 bad usage, 3 the\n"
        "equivalence verdict failed.\n", TDM_CMP_GPT_BATCH);
}

typedef struct tdm_cmp_diff {
    double max_abs, max_rel;
    int worst;          /* tensor index with the largest violation ratio */
    double worst_ratio; /* max over elements of |a-b| / (atol + rtol |b|) */
    int ok;
} tdm_cmp_diff;

static void tdm_cmp_compare(const tdm_model *m, const float *a, const float *b, double atol,
                            double rtol, tdm_cmp_diff *d)
{
    memset(d, 0, sizeof *d);
    d->worst = -1;
    for (int t = 0; t < tdm_model_n_params(m); t++) {
        const tdm_tensor_info *ti = tdm_model_param_info(m, t);
        for (int64_t j = 0; j < ti->n_elem; j++) {
            double x = a[ti->offset + j], y = b[ti->offset + j];
            double diff = fabs(x - y);
            double rel = diff / (fabs(y) > 1e-12 ? fabs(y) : 1e-12);
            double ratio = diff / (atol + rtol * fabs(y));
            if (!(diff <= d->max_abs)) d->max_abs = diff; /* NaN wins */
            if (rel > d->max_rel && fabs(y) > 1e-6) d->max_rel = rel;
            if (!(ratio <= d->worst_ratio)) {
                d->worst_ratio = ratio;
                d->worst = t;
            }
        }
    }
    d->ok = d->worst_ratio <= 1.0;
}

/* --sweep's device counts; -1 when it is not a list of 1..TDM_CMP_MAX_DEV. */
static int tdm_cmp_parse_sweep(const char *s, int *out, int max)
{
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > TDM_CMP_MAX_DEV || n >= max) return -1;
        out[n++] = (int)v;
        p = end;
        if (*p == ',') p++;
        else if (*p) return -1;
    }
    return n;
}

static void tdm_cmp_print_phase_table(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n)
{
    tdm_phase_times pm[TDM_CMP_NMODES];
    double mean[TDM_CMP_NMODES];
    printf("\nWhere the time goes (ms per step and share of the step, means after warm-up)\n");
    printf("  %-22s", "phase");
    for (int k = 0; k < n; k++) {
        char h[32];
        snprintf(h, sizeof h, "%s(%d)", tdm_cmp_mode_name(res[k]->mode), res[k]->n_dev);
        printf(" %18s", h);
        tdm_cmp_phase_mean(o, res[k], &pm[k]);
        /* shares are of the mean step, the same statistic as the phases */
        tdm_cmp_means(o, res[k], &mean[k], NULL, NULL);
    }
    printf("\n");
    for (int q = 0; q < tdm_cmp_n_phase_rows; q++) {
        tdm_phase p = tdm_cmp_phase_rows[q];
        printf("  %-22s", tdm_cmp_phase_label(p));
        for (int k = 0; k < n; k++) {
            double v = pm[k].ms[p];
            if (v <= 0.0) printf(" %18s", "-");
            else printf(" %9.2f  %5.1f%%  ", v, 100.0 * v / mean[k]);
        }
        printf("\n");
    }
    printf("  %-22s", "other (outside phases)");
    for (int k = 0; k < n; k++) {
        double s = 0.0;
        for (int p = 0; p < TDM_PHASE_COUNT_; p++) s += pm[k].ms[p];
        double other = mean[k] - s;
        printf(" %9.2f  %5.1f%%  ", other > 0 ? other : 0.0, other > 0 ? 100.0 * other / mean[k] : 0.0);
    }
    printf("\n  %-22s", "step (mean)");
    for (int k = 0; k < n; k++) printf(" %9.2f  100.0%%  ", mean[k]);
    printf("\n");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        if (r->mode != TDM_CMP_DDP) continue;
        double step, comm, exposed;
        tdm_cmp_means(o, r, &step, &comm, &exposed);
        printf("  DDP all-reduce: %.2f ms per step from the first bucket's start to the last's "
               "end, in %d bucket%s;\n  %.2f ms of it exposed after backward; %.0f%% of the "
               "gradient bytes were launched while backward still ran\n", comm, r->n_buckets,
               r->n_buckets == 1 ? "" : "s", exposed, 100.0 * r->overlap_bytes_frac);
    }
    tdm_cmp_fsdp_print_phases(o, res, n);
}

static void tdm_cmp_print_memory(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n)
{
    printf("\nMemory per device (MiB)\n");
    printf("  %-18s %9s %9s %9s %9s %11s %9s %9s %9s %9s\n", "mode/device", "params",
           "grads", "optimizer", "buffers", "activations", "comm", "total", "peak", "planned");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        int shown = r->n_dev < 2 ? r->n_dev : 2;
        for (int d = 0; d < shown; d++) {
            const tdm_cmp_memory *m = &r->mem[d];
            char name[64], dev[32];
            tdm_cmp_dev_name(o, d, dev, sizeof dev);
            if (r->mode == TDM_CMP_DDP || tdm_cmp_is_sharded(r->mode))
                snprintf(name, sizeof name, "%s rank %s", tdm_cmp_mode_name(r->mode),
                         d == 0 ? "0" : r->n_dev > 2 ? "1.." : "1");
            else
                snprintf(name, sizeof name, "%s %s%s", tdm_cmp_mode_name(r->mode), dev,
                         d == 1 && r->n_dev > 2 ? ".." : "");
            double mib = 1.0 / (1024.0 * 1024.0);
            double total = m->params + m->grads + m->optim + m->buffers + m->activations + m->comm;
            /* the allocator's peak over the run beside the planner's
             * (tools/compare_mem.c; "-": DP's other devices, not planned) */
            char planned[16] = "        -";
            double pl = r->mode == TDM_CMP_DP && d > 0 ? -1.0
                                                       : tdm_cmp_planned_peak(o, r->mode, r->n_dev);
            if (pl >= 0) snprintf(planned, sizeof planned, "%9.3f", pl * mib);
            printf("  %-18s %9.3f %9.3f %9.3f %9.3f %11.3f %9.3f %9.3f %9.3f %s\n", name,
                   m->params * mib, m->grads * mib, m->optim * mib, m->buffers * mib,
                   m->activations * mib, m->comm * mib, total * mib, m->peak * mib, planned);
        }
    }
    if (o->dl.kind == TDM_DEVICE_CUDA && !tdm_tool_cuda_emulated())
        printf("  DP's output device holds the master (with optimizer state) and the gathered\n"
               "  logits and their gradient (comm); DDP's gradients are NCCL-allocated device\n"
               "  memory, reduced in place (comm 0; NCCL's own buffers are not counted).\n");
    else if (o->ddp_comm && strcmp(tdm_comm_backend_name(o->ddp_comm), "shm"))
        printf("  DP's output device holds the master (with optimizer state) and the gathered\n"
               "  logits and their gradient (comm); DDP's gradients are the model's own, reduced\n"
               "  in place over %s (comm 0; MPI's own buffers are not counted).\n",
               tdm_comm_backend_name(o->ddp_comm));
    else
        printf("  DP's output device holds the master (with optimizer state) and the gathered\n"
               "  logits and their gradient (comm); DDP's gradients live in the shared segment\n"
               "  and comm is the rest of that segment's arena.\n");
    tdm_cmp_fsdp_print_memory_note(res, n);
}

/* Everything one `tandem compare` run holds, from the options to the
 * verdict. */
typedef struct tdm_cmp_job {
    tdm_cmp_opts o;
    tdm_model_spec spec;
    int gpt, help;
    int sweep_dev[16], n_sweep;
    char plot_dir[4096];             /* --plot without trailing slashes */
    tdm_cmp_data data;
    tdm_cmp_result res[TDM_CMP_NMODES], floor_r;
    tdm_cmp_floor floor;   /* floor_r against single, for the design sections */
    tdm_cmp_result *rp[TDM_CMP_NMODES];
    int nres;
    double sps[TDM_CMP_NMODES];      /* samples/s of the median step, by mode */
    double other_cores[TDM_CMP_NMODES]; /* other processes' CPU during each mode, in
                                          cores (tools/compare_load.c; -1: unknown) */
    tdm_cmp_sweep_point sweep[16];
    tdm_cmp_result sweep_res[32];    /* the sweep's DP and DDP runs, for --csv */
    int n_sweep_res;
    tdm_cmp_report rep;              /* the verdict's pairs and bounds, for --json */
    int verdict;                     /* 1: the modes computed the same training */
    const char *modes_arg;           /* --modes as given */
    long long det;                   /* --deterministic K (tools/compare_det.c); 0: off */
    int ran[TDM_CMP_NMODES];         /* 1: the mode ran */
    const char *default_device;      /* o.device until --device is given */
    int err_fd;                      /* an MPI job's rank > 0: its stderr, kept aside */
} tdm_cmp_job;

/* An MPI job's rank (tdm_tool_compare_main releases it). */
static tdm_dist_mpi_rank tdm_cmp_mr;

/* Under an MPI launcher: joins the job (collective) and makes DDP's
 * communicator. Ranks other than 0 print nothing to stdout, and nothing
 * to stderr until the runs start (j->err_fd keeps it; usage errors, alike
 * on every rank, are then said once). */
static tdm_status tdm_cmp_mpi_join(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    tdm_mpi_backend b;
    tdm_status st = tdm_dist_backend_choose(o->backend, tdm_dist_mpi_launched(), "compare", &b);
    if (st) {
        fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
        return st == TDM_STATUS_UNSUPPORTED ? st : TDM_STATUS_USAGE;
    }
    if (!tdm_dist_mpi_launched()) return TDM_STATUS_OK;
    if (o->sweep) {
        if (tdm_dist_mpi_env_rank() == 0)
            fprintf(stderr, "tandem compare: --sweep: under an MPI launcher DDP's ranks are the "
                    "job's; run one job per size instead\n");
        return TDM_STATUS_USAGE;
    }
    tdm_shm_opts so = {.arena_bytes = tdm_ddp_arena_bytes(tdm_cmp_param_elems(o))};
    st = tdm_dist_mpi_rank_init(&tdm_cmp_mr, b, TDM_DIST_MPI_WHOLE, 0, &so);
    if (st != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: joining the MPI job: %s\n", tdm_error_message());
        return st;
    }
    o->ddp_comm = tdm_cmp_mr.comm;
    static char dev[32];
    if (o->device == j->default_device) {
        snprintf(dev, sizeof dev, "cpu:%d", tdm_cmp_mr.env.world_size);
        o->device = dev;
    }
    tdm_dist_silence(tdm_cmp_mr.env.rank, &j->err_fd);
    return TDM_STATUS_OK;
}

/* An MPI job's DDP ranks are its ranks: --device names as many devices,
 * and a GPU rank uses its machine's GPU of its rank there. */
static tdm_status tdm_cmp_check_mpi_devices(tdm_cmp_opts *o)
{
    const tdm_dist_env *e = &tdm_cmp_mr.env;
    if (o->n_dev != e->world_size)
        return tdm_tool_usage_error("tandem compare: --device %s names %d devices, but the MPI "
                                    "job has %d ranks (DDP's; omit --device for cpu:%d)\n",
                                    o->device, o->n_dev, e->world_size, e->world_size);
    o->dl.index[e->rank] = o->dl.index[e->local_rank % o->dl.count];
    return TDM_STATUS_OK;
}

/* --precision and --checkpoint-activations: every mode's model (DP's
 * replicas follow its master's, dp/dp.h; the pipeline's stages, not
 * tensor-parallel ones); --clip-grad-norm: the pp row alone. */
static tdm_status tdm_cmp_check_levers(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    o->precision = TDM_PRECISION_FP32;
    if (o->precision_arg && tdm_precision_parse(o->precision_arg, &o->precision))
        return tdm_tool_usage_error("tandem compare: --precision: %s\n", tdm_error_message());
    if (o->precision == TDM_PRECISION_FP16)
        return tdm_tool_usage_error("tandem compare: --precision fp16 needs loss scaling, "
                                    "which compare does not run: compare fp32 or bf16 (tandem "
                                    "train --precision fp16 runs it in every mode)\n");
    if (o->clip > 0.0 && (o->modes & ~(TDM_CMP_PP_BIT | 1u << TDM_CMP_SINGLE)))
        return tdm_tool_usage_error("tandem compare: --clip-grad-norm runs in the pp row (and "
                                    "its one-device reference) only: --modes pp (tandem train "
                                    "--clip-grad-norm clips in every mode)\n");
    if (o->clip > 0.0 && !(o->modes & TDM_CMP_PP_BIT))
        return tdm_tool_usage_error("tandem compare: --clip-grad-norm needs --modes pp\n");
    if (o->precision == TDM_PRECISION_FP32 && !o->ckpt && o->clip <= 0.0) return TDM_STATUS_OK;
    /* tp's bf16 rounds the products' operands alone (docs/TENSOR_PARALLEL.md):
     * not the computation of compare's one-device reference */
    unsigned tp = TDM_CMP_TP_BIT | TDM_CMP_TP_SP_BIT;
    if ((o->modes & tp) && o->precision != TDM_PRECISION_FP32)
        return tdm_tool_usage_error("tandem compare: --precision applies to tp in tandem train "
                                    "only (its bf16 rounds the products alone, not what the "
                                    "one-device reference computes): leave tp out of --modes\n");
    if ((o->modes & tp) && o->ckpt > 1)
        return tdm_tool_usage_error("tandem compare: --checkpoint-activations %d: tp checkpoints "
                                    "every block (1); segments of more are not built for tp\n",
                                    o->ckpt);
    return TDM_STATUS_OK;
}

static tdm_status tdm_cmp_parse(int argc, char **argv, tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_HELP(j->help)
        TDM_ARGS_STR("--model", o->model)
        TDM_ARGS_STR("--json", o->json)
        TDM_ARGS_STR("--device", o->device)
        TDM_ARGS_STR("--data", o->data)
        TDM_ARGS_STR("--optim", o->optim)
        TDM_ARGS_STR("--trace", o->trace)
        TDM_ARGS_STR("--csv", o->csv)
        TDM_ARGS_STR("--plot", o->plot)
        TDM_ARGS_STR("--sweep", o->sweep)
        TDM_ARGS_STR("--modes", j->modes_arg)
        TDM_ARGS_STR("--backend", o->backend)
        TDM_ARGS_INT("--steps", 1, 1000000, o->steps)
        TDM_ARGS_INT("--warmup", 0, 1000000, o->warmup)
        TDM_ARGS_INT("--batch", 1, 1 << 20, o->batch)
        TDM_ARGS_INT("--perturb-rank", 0, TDM_CMP_MAX_DEV - 1, o->perturb_rank)
        TDM_ARGS_FLOAT("--lr", 0.0, 1e3, o->lr)
        TDM_ARGS_FLOAT("--momentum", 0.0, 0.999999, o->momentum)
        TDM_ARGS_FLOAT("--bucket-cap-mb", 1e-6, 1e6, o->bucket_cap_mb)
        TDM_ARGS_INT("--seed", 0, INT64_MAX, o->seed)
        if (!strcmp(argv[i], "--no-overlap")) { o->no_overlap = 1; continue; }
        if (!strcmp(argv[i], "--sync-bn")) { o->sync_bn = 1; continue; }
        TDM_ARGS_STR("--comm-hook", o->comm_hook)
        TDM_ARGS_STR("--servers", o->ps_servers)
        TDM_ARGS_STR("--precision", o->precision_arg)
        TDM_ARGS_INT("--checkpoint-activations", 1, 1 << 16, o->ckpt)
        TDM_ARGS_FLOAT("--clip-grad-norm", 1e-12, 1e12, o->clip)
        TDM_ARGS_INT("--powersgd-rank", 1, 1 << 16, o->powersgd_rank)
        TDM_ARGS_INT("--powersgd-start-step", 0, INT64_MAX, o->powersgd_start_step)
        TDM_ARGS_INT("--stages", 1, TDM_CMP_MAX_DEV, o->pp_stages)
        TDM_ARGS_INT("--microbatches", 1, 1 << 16, o->pp_micro)
        TDM_ARGS_STR("--schedule", o->pp_schedule)
        TDM_ARGS_STR("--mesh", o->mesh)
        TDM_ARGS_INT("--deterministic", 1, 1024, j->det)
        return tdm_tool_usage_error("tandem compare: unknown option '%s' (see tandem compare "
                                    "--help)\n", argv[i]);
    }
    return TDM_STATUS_OK;
}

/* --device: checked in a child when it names CUDA (this process forks
 * DDP's ranks); host devices must be cpu:0..N-1. */
static tdm_status tdm_cmp_check_devices(tdm_cmp_opts *o)
{
    tdm_device_list dl;
    tdm_status st = tdm_dist_parse_devices(&dl, o->device, 1);
    if (st != TDM_STATUS_OK) {
        /* no device is a runtime condition (exit 1, as train), not usage */
        fprintf(stderr, "tandem compare: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    if (dl.kind == TDM_DEVICE_HOST)
        for (int i = 0; i < dl.count; i++)
            if (dl.index[i] != i)
                return tdm_tool_usage_error("tandem compare: --device %s: use cpu:N (devices "
                                            "cpu:0..N-1)\n", o->device);
    if (dl.count > TDM_CMP_MAX_DEV)
        return tdm_tool_usage_error("tandem compare: --device %s: at most %d devices\n",
                                    o->device, TDM_CMP_MAX_DEV);
    o->dl = dl;
    o->n_dev = dl.count;
    return TDM_STATUS_OK;
}

/* --sweep: device counts; GPUs are the ones listed (host devices are
 * logical: any count). */
static tdm_status tdm_cmp_check_sweep(tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    int ps_servers[TDM_CMP_PS_MAX_SERVERS];
    if (o->ps_servers && tdm_cmp_ps_servers(o, ps_servers) <= 0)
        return tdm_tool_usage_error("tandem compare: --servers '%s': expected server counts like 1,2 "
                                    "(each 1..%d, for --modes ps or ps-async)\n", o->ps_servers,
                                    TDM_CMP_PS_MAX_SERVERS);
    if (o->sweep && (j->n_sweep = tdm_cmp_parse_sweep(o->sweep, j->sweep_dev, 16)) <= 0)
        return tdm_tool_usage_error("tandem compare: --sweep '%s': expected device counts like "
                                    "1,2,4 (each 1..%d, at most 16)\n", o->sweep,
                                    TDM_CMP_MAX_DEV);
    for (int i = 0; i < j->n_sweep && o->dl.kind == TDM_DEVICE_CUDA; i++)
        if (j->sweep_dev[i] > o->dl.count)
            return tdm_tool_usage_error("tandem compare: --sweep %d: --device %s names only %d "
                                        "GPU%s (a sweep uses the first k of them)\n",
                                        j->sweep_dev[i], o->device, o->dl.count,
                                        o->dl.count == 1 ? "" : "s");
    return TDM_STATUS_OK;
}

/* --mesh: the layout of the pp row or the tp row (dist/mesh.h), over
 * every device. */
static tdm_status tdm_cmp_check_mesh(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    if (!o->mesh) return TDM_STATUS_OK;
    tdm_mesh_shape m;
    if (tdm_mesh_parse(o->mesh, o->n_dev, &m))
        return tdm_tool_usage_error("tandem compare: --mesh: %s (--device %s)\n",
                                    tdm_error_message(), o->device);
    int D = m.size[TDM_MESH_DP], S = m.size[TDM_MESH_PP], N = m.size[TDM_MESH_TP];
    int first[64];
    tdm_pptp_cut cut[TDM_PPTP_MAX_LAYERS];
    tdm_model_spec narrow;
    /* a pipeline of tensor-parallel stages: the pp row, the default split */
    if (S > 1 && N > 1 &&
        (S > 64 || tdm_pp_split_balance(&j->spec, S, TDM_PP_BALANCE_FLOPS, first) ||
         tdm_pptp_plan(&j->spec, S, first, N, cut, &narrow)))
        return tdm_tool_usage_error("tandem compare: --mesh %s: %s\n", o->mesh,
                                    tdm_error_message());
    unsigned want = S > 1 ? TDM_CMP_PP_BIT : N > 1 ? TDM_CMP_TP_BIT | TDM_CMP_TP_SP_BIT : 0;
    if (!want)
        return tdm_tool_usage_error("tandem compare: --mesh %s names neither pp nor tp: it lays "
                                    "out the pp row (dp=D,pp=S) or the tp row (dp=D,tp=N)\n",
                                    o->mesh);
    if (!(o->modes & want))
        return tdm_tool_usage_error("tandem compare: --mesh %s lays out the %s row: add %s to "
                                    "--modes\n", o->mesh, S > 1 ? "pp" : "tp",
                                    S > 1 ? "pp" : "tp");
    if (S > 1 && o->pp_stages && o->pp_stages != S)
        return tdm_tool_usage_error("tandem compare: --stages %d, but --mesh %s has pp=%d\n",
                                    o->pp_stages, o->mesh, S);
    if (S > 1 && N > 1 && ((o->precision_arg && o->precision != TDM_PRECISION_FP32) || o->ckpt ||
                           o->clip > 0.0))
        return tdm_tool_usage_error("tandem compare: --precision, --checkpoint-activations and "
                                    "--clip-grad-norm run in pipelines of whole stages, not "
                                    "with tensor-parallel stages (--mesh %s)\n", o->mesh);
    if (S > 1) o->pp_stages = S;
    o->mesh_dp = D;
    o->mesh_pp = S;
    o->mesh_tp = N;
    return TDM_STATUS_OK;
}

/* --modes ...,tp: the plan of the model over the devices. */
static tdm_status tdm_cmp_check_tp(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    if (!(o->modes & (TDM_CMP_TP_BIT | TDM_CMP_TP_SP_BIT))) return TDM_STATUS_OK;
    if (o->ddp_comm)
        return tdm_tool_usage_error("tandem compare: --modes tp under an MPI launcher is not "
                                    "supported (run compare on one machine)\n");
    /* the levers: tdm_cmp_check_levers (checkpointing runs, bf16 not) */
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L, T = o->mesh_tp > 1 && o->mesh_pp <= 1 ? o->mesh_tp : o->n_dev;
    if (tdm_tp_plan(&j->spec, T, split, &L))
        return tdm_tool_usage_error("tandem compare: --modes tp: %s\n", tdm_error_message());
    if ((o->modes & TDM_CMP_TP_SP_BIT) && tdm_tp_check_seq(&j->spec, T))
        return tdm_tool_usage_error("tandem compare: --modes tp-sp: %s\n", tdm_error_message());
    return TDM_STATUS_OK;
}

/* --modes ...,pp: its options against the model and the devices. */
static tdm_status tdm_cmp_check_pp(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    tdm_pp_schedule_kind k;
    int pp = (o->modes & TDM_CMP_PP_BIT) != 0, L = 0;
    if (!pp && (o->pp_stages || o->pp_micro || o->pp_schedule))
        return tdm_tool_usage_error("tandem compare: --stages, --microbatches and --schedule "
                                    "apply to --modes ...,pp\n");
    if (!pp) return TDM_STATUS_OK;
    if (o->ddp_comm)
        return tdm_tool_usage_error("tandem compare: --modes pp under an MPI launcher is not "
                                    "supported (run compare on one machine)\n");
    if (o->pp_schedule && tdm_pp_schedule_parse(o->pp_schedule, &k))
        return tdm_tool_usage_error("tandem compare: --schedule: %s\n", tdm_error_message());
    int S = o->pp_stages ? o->pp_stages : o->n_dev;
    if (S > o->n_dev)
        return tdm_tool_usage_error("tandem compare: --stages %d but --device %s has %d "
                                    "devices: one stage per device\n", S, o->device, o->n_dev);
    (void)tdm_model_spec_n_layers(&j->spec, &L);
    if (S > L)
        return tdm_tool_usage_error("tandem compare: %d stages but the model has %d pipeline "
                                    "layers: at most %d stages\n", S, L, L);
    int M = o->pp_micro ? o->pp_micro : 4;
    if (M > o->batch)
        return tdm_tool_usage_error("tandem compare: --microbatches %d is more than --batch %d: "
                                    "every micro-batch needs a sample\n", M, o->batch);
    return TDM_STATUS_OK;
}

/* What the options need of each other, and the defaults that follow. */
static tdm_status tdm_cmp_check(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    if (tdm_model_spec_parse(&j->spec, o->model) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem compare: --model: %s\n", tdm_error_message());
    j->gpt = j->spec.kind == TDM_MODEL_GPT;
    /* train's defaults, so that the two agree: a gpt trains with AdamW at
     * 2e-3 (tools/train.c) */
    if (!o->optim) o->optim = j->gpt ? "adamw" : "sgd";
    if (strcmp(o->optim, "sgd") && strcmp(o->optim, "adamw"))
        return tdm_tool_usage_error("tandem compare: --optim '%s': expected sgd or adamw\n",
                                    o->optim);
    if (o->lr < 0) o->lr = strcmp(o->optim, "sgd") ? (j->gpt ? 2e-3 : 1e-3) : 0.05;
    if (!strcmp(o->optim, "adamw")) o->weight_decay = 0.01;
    if (!o->batch) o->batch = j->gpt ? TDM_CMP_GPT_BATCH : 256;
    if (j->gpt && o->data && !strcmp(o->data, "synthetic"))
        return tdm_tool_usage_error("tandem compare: a gpt trains on text: --data FILE (any "
                                    "bytes) or a fortunes directory [default: Debian's "
                                    "fortunes]\n");
    TDM_CHECK(tdm_cmp_mpi_join(j));
    TDM_CHECK(tdm_cmp_check_devices(o));
    if (o->ddp_comm) TDM_CHECK(tdm_cmp_check_mpi_devices(o));
    if (o->batch < o->n_dev)
        return tdm_tool_usage_error(
            "tandem compare: --batch %d is smaller than the %d devices: DP would split it "
            "into %d chunks of one sample and leave %d device%s idle (as "
            "torch.nn.DataParallel does), and DDP ranks would have nothing to train on; "
            "use --batch >= %d\n", o->batch, o->n_dev, o->batch, o->n_dev - o->batch,
            o->n_dev - o->batch > 1 ? "s" : "", o->n_dev);
    if (o->comm_hook && !tdm_ddp_hook_known(o->comm_hook))
        return tdm_tool_usage_error("tandem compare: --comm-hook '%s': expected allreduce, fp16, "
                                    "bf16 or powersgd\n", o->comm_hook);
    if (o->comm_hook && !strcmp(o->comm_hook, "allreduce")) o->comm_hook = NULL;
    if (o->comm_hook && o->ddp_comm)
        return tdm_tool_usage_error("tandem compare: --comm-hook is not supported under an MPI "
                                    "launcher yet (run compare on one machine)\n");
    if (o->perturb_rank >= o->n_dev)
        return tdm_tool_usage_error("tandem compare: --perturb-rank %d: only ranks 0..%d "
                                    "exist\n", o->perturb_rank, o->n_dev - 1);
    /* a --warmup given that leaves no step to time is refused; the
     * default (3) shrinks to half the steps, as --help says */
    if (o->warmup >= o->steps)
        return tdm_tool_usage_error("tandem compare: --warmup %d leaves none of the %d steps to "
                                    "time: give --warmup below --steps (or raise --steps)\n",
                                    o->warmup, o->steps);
    if (o->warmup < 0)
        o->warmup = TDM_CMP_DEFAULT_WARMUP < o->steps ? TDM_CMP_DEFAULT_WARMUP : o->steps / 2;
    TDM_CHECK(tdm_cmp_check_mesh(j));
    TDM_CHECK(tdm_cmp_check_pp(j));
    TDM_CHECK(tdm_cmp_check_tp(j));
    return tdm_cmp_check_sweep(j);
}

/* The output paths, before the long part (core/safefile.h: what the
 * writes will check again, and nothing left behind). */
static tdm_status tdm_cmp_check_outputs(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    const char *outs[] = {o->trace, o->csv};
    const char *flags[] = {"--trace", "--csv"};
    for (int i = 0; i < 2; i++)
        if (outs[i] && tdm_file_replace_check(AT_FDCWD, outs[i]) != TDM_STATUS_OK)
            return tdm_tool_usage_error("tandem compare: %s: %s\n", flags[i],
                                        tdm_error_message());
    if (!o->plot) return TDM_STATUS_OK;
    /* "out/" and "out" name the same directory: print "out/loss.png" */
    snprintf(j->plot_dir, sizeof j->plot_dir, "%s", o->plot);
    for (size_t n = strlen(j->plot_dir); n > 1 && j->plot_dir[n - 1] == '/'; n--)
        j->plot_dir[n - 1] = '\0';
    o->plot = j->plot_dir;
    int dfd = -1;
    if (tdm_dir_open_safe(o->plot, "--plot", 1, &dfd) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem compare: %s\n", tdm_error_message());
    close(dfd);
    return TDM_STATUS_OK;
}

/* A gpt's text: windows drawn per step (core/text.h), no dataset order. */
static tdm_status tdm_cmp_load_text(tdm_cmp_job *j)
{
    tdm_cmp_data *data = &j->data;
    tdm_status st;
    data->T = j->spec.n_ctx;
    data->seed = j->o.seed;
    if ((st = tdm_text_load(&data->text, j->o.data)) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: loading text: %s\n", tdm_error_message());
        return st;
    }
    if ((st = tdm_text_check_context(&data->text, data->T)) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem compare: --model: %s\n", tdm_error_message());
    return TDM_STATUS_OK;
}

/* The images and the global batches: epoch e's full batches (drop_last),
 * epochs back to back, as many as --steps needs. */
static tdm_status tdm_cmp_load_images(tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    tdm_cmp_data *data = &j->data;
    tdm_status st;
    if (o->data && !strcmp(o->data, "synthetic")) {
        int c, h, w, classes;
        tdm_model_spec_sample_shape(&j->spec, &c, &h, &w, &classes);
        int64_t n = (int64_t)o->batch * (o->steps < 50 ? o->steps : 50);
        st = tdm_data_synthetic(&data->train, n, c, h, w, classes, 1234, 0);
    } else if (tdm_data_is_npy(o->data)) {
        st = tdm_data_load_npy(&data->train, o->data);
    } else {
        st = tdm_data_load_fashion_mnist(&data->train, o->data, 1);
    }
    if (st != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: loading data: %s\n", tdm_error_message());
        return st;
    }
    /* the MLP's in_w is dims[0] */
    int64_t want = (int64_t)j->spec.in_c * j->spec.in_h * j->spec.in_w;
    if (tdm_data_features(&data->train) != want)
        return tdm_tool_usage_error("tandem compare: the data has %lld features per sample but "
                                    "model %s expects %lld\n",
                                    (long long)tdm_data_features(&data->train), o->model,
                                    (long long)want);
    {
        int sc, sh, sw, classes;
        tdm_model_spec_sample_shape(&j->spec, &sc, &sh, &sw, &classes);
        if (data->train.n_classes > classes)
            return tdm_tool_usage_error("tandem compare: the data has label %d but model %s has "
                                        "%d classes (0..%d)\n", data->train.n_classes - 1,
                                        o->model, classes, classes - 1);
    }
    if (data->train.n < o->batch)
        return tdm_tool_usage_error("tandem compare: --batch %d is larger than the %lld "
                                    "training samples\n", o->batch, (long long)data->train.n);
    int64_t per_epoch = data->train.n / o->batch;
    int64_t epochs = (o->steps + per_epoch - 1) / per_epoch;
    data->n_order = epochs * per_epoch * o->batch;
    data->order = malloc((size_t)(epochs * data->train.n) * sizeof(int64_t));
    if (!data->order) {
        fprintf(stderr, "tandem compare: out of memory\n");
        return TDM_STATUS_OUT_OF_MEMORY;
    }
    for (int64_t e = 0; e < epochs; e++)
        tdm_train_epoch_order(data->order + e * per_epoch * o->batch, data->train.n, o->seed, e);
    return TDM_STATUS_OK;
}

static void tdm_cmp_print_header(const tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    char desc[160];
    tdm_model_spec_describe(&j->spec, desc, sizeof desc);
    printf("tandem compare: %s, global batch %d%s, %d steps (%d warm-up), %s lr %g%s%s\n", desc,
           o->batch, j->gpt ? " windows" : "", o->steps, o->warmup, o->optim, o->lr,
           j->gpt ? ", text: " : o->data && !strcmp(o->data, "synthetic") ? ", synthetic data"
                                                                        : ", Fashion-MNIST",
           j->gpt ? j->data.text.source : "");
    if (j->gpt)
        printf("  a sample is a window of %d bytes (%d tokens), its loss the mean over them\n",
               j->data.T, j->data.T);
    char dev0name[32], devspec[TDM_DEVICE_LIST_MAX * 4 + 8];
    tdm_cmp_dev_name(o, 0, dev0name, sizeof dev0name);
    tdm_cmp_dev_spec(o, o->n_dev, devspec, sizeof devspec);
    if (o->dl.kind == TDM_DEVICE_CUDA) {
        printf("  one device (%s) vs DP and DDP on %d GPU%s (%s; DDP's gradients over %s)\n",
               dev0name, o->n_dev, o->n_dev > 1 ? "s" : "", devspec,
               tdm_tool_cuda_emulated() ? "shm" : "NCCL");
        printf("  on GPUs kernels run asynchronously: a phase's time is host time until its "
               "next wait,\n  so phases that wait for the GPU absorb the time of earlier ones; "
               "step times are exact\n");
        tdm_tool_print_emulated(stdout, o->device);
    } else {
        printf("  one device (cpu:0) vs DP and DDP on %d host devices; this machine has %d "
               "core%s\n", o->n_dev, tdm_device_host_cores(),
               tdm_device_host_cores() > 1 ? "s" : "");
    }
    fflush(stdout);
}

/* The three modes, then one device again from parameters one ulp off
 * (the float-noise floor of the equivalence verdict). */
static tdm_status tdm_cmp_run_modes(tdm_cmp_job *j)
{
    if (j->o.ddp_comm) {
        printf("  DDP's ranks: the MPI job's (%s)\n", tdm_cmp_mr.desc);
        if (tdm_device_host_cores() < j->o.n_dev && j->o.dl.kind == TDM_DEVICE_HOST)
            printf("  note: rank 0 may run on %d core%s, and one device and DP run there: "
                   "mpirun --bind-to none gives it the machine\n", tdm_device_host_cores(),
                   tdm_device_host_cores() == 1 ? "" : "s");
        fflush(stdout);
    }
    for (int k = 0; k < TDM_CMP_NMODES; k++) {
        /* under an MPI launcher the other ranks wait for DDP whatever --modes
         * says, then run the sharded modes of --modes with rank 0, in this
         * order (tdm_cmp_mpi_peer) */
        if (!(j->o.modes & 1u << k) && !(k == TDM_CMP_DDP && j->o.ddp_comm)) continue;
        printf("  running %s...\n", tdm_cmp_mode_name((tdm_cmp_mode)k));
        fflush(stdout);
        /* an MPI job's other ranks wait for this before DDP */
        if (k == TDM_CMP_DDP && j->o.ddp_comm) {
            tdm_status st = tdm_comm_barrier(tdm_cmp_mr.world);
            if (st != TDM_STATUS_OK) {
                fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
                return st;
            }
        }
        tdm_cmp_load l0, l1;
        tdm_cmp_load_sample(&l0);
        TDM_CHECK(tdm_cmp_run(&j->o, &j->data, (tdm_cmp_mode)k,
                              k == TDM_CMP_SINGLE ? 1 : j->o.n_dev, &j->res[k]));
        tdm_cmp_load_sample(&l1);
        j->other_cores[k] = tdm_cmp_load_other(&l0, &l1);
        j->rp[j->nres++] = &j->res[k];
        j->ran[k] = 1;
    }
    tdm_cmp_opts on = j->o;
    on.nudge = 1;
    printf("  running single again from parameters one ulp off (the float-noise floor)...\n");
    fflush(stdout);
    return tdm_cmp_run(&on, &j->data, TDM_CMP_SINGLE, 1, &j->floor_r);
}

static void tdm_cmp_print_throughput(tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    printf("\nThroughput (steps %d..%d)\n", o->warmup + 1, o->steps);
    printf("  %-10s %12s %9s %22s\n", "mode", "samples/s", "speed-up", "step ms median (min-max)");
    for (int k = 0; k < j->nres; k++) {
        double med, mn, mx;
        tdm_cmp_step_stats(o, j->rp[k], &med, &mn, &mx);
        /* by mode: single is always there, first */
        tdm_cmp_mode mode = j->rp[k]->mode;
        j->sps[mode] = o->batch / med * 1e3;
        char name[32];
        snprintf(name, sizeof name, "%s(%d)", tdm_cmp_mode_name(j->rp[k]->mode),
                 j->rp[k]->n_dev);
        printf("  %-10s %12.0f %8.2fx %10.2f (%.2f-%.2f)\n", name, j->sps[mode],
               j->sps[mode] / j->sps[0], med, mn, mx);
    }
}

/* One pair of the verdict (a vs b): 1 when it passes, or when it is not
 * expected to match (batchnorm); prints its line. */
static int tdm_cmp_print_pair(const tdm_cmp_job *j, const tdm_model *ref, tdm_cmp_mode ma,
                              tdm_cmp_mode mb, const tdm_cmp_diff *fl, double fl_loss)
{
    const tdm_cmp_opts *o = &j->o;
    const tdm_cmp_result *a = &j->res[ma], *b = &j->res[mb];
    int bn = tdm_model_spec_has_batchnorm(&j->spec);
    char label[40];
    snprintf(label, sizeof label, "%s vs %s", tdm_cmp_mode_name(a->mode),
             tdm_cmp_mode_name(b->mode));
    /* --sync-bn: DDP's batchnorm sees the whole global batch, as one
     * device does; DP's still sees each chunk */
    int ddp_sync = o->sync_bn && a->mode == TDM_CMP_DDP;
    if (bn && b->mode == TDM_CMP_SINGLE && !ddp_sync) {
        printf("  %-14s not expected to match: batchnorm normalises each device's chunk "
               "with that chunk's statistics%s\n", label,
               a->mode == TDM_CMP_DDP ? " (--sync-bn makes DDP match)" : "");
        return 1;
    }
    if (bn && o->sync_bn && b->mode == TDM_CMP_DP) {
        printf("  %-14s not expected to match: DDP's SyncBatchNorm normalises with the "
               "whole batch's statistics, DP with each chunk's\n", label);
        return 1;
    }
    if (bn && o->sync_bn && b->mode == TDM_CMP_DDP && tdm_cmp_is_sharded(a->mode)) {
        printf("  %-14s not expected to match: --sync-bn is DDP's; the sharded modes' "
               "batchnorm normalises each rank's share with that share's statistics\n", label);
        return 1;
    }
    if (bn && ddp_sync)
        printf("  %-14s with --sync-bn: the same tolerance as the MLP's\n", label);
    if (bn && o->batch % o->n_dev && !ddp_sync &&
        (a->mode == TDM_CMP_DP || b->mode == TDM_CMP_DP)) {
        printf("  %-14s not expected to match: DP's chunks (torch.chunk) and DDP's shares "
               "differ when %d does not divide by %d, so batchnorm sees different groups\n",
               label, o->batch, o->n_dev);
        return 1;
    }
    tdm_cmp_diff d1, d2;
    tdm_cmp_compare(ref, a->params_first, b->params_first, TDM_CMP_ATOL_FIRST,
                    TDM_CMP_RTOL_FIRST, &d1);
    tdm_cmp_compare(ref, a->params_last, b->params_last, TDM_CMP_ATOL_LAST,
                    TDM_CMP_RTOL_LAST, &d2);
    double l1 = fabs(a->loss[0] - b->loss[0]) / fabs(b->loss[0]);
    double l2 = fabs(a->loss[o->steps - 1] - b->loss[o->steps - 1]) / fabs(b->loss[o->steps - 1]);
    /* the last step passes within the fixed bound, or within the floor */
    int last_ok = (d2.ok && l2 <= 10 * TDM_CMP_LOSS_RTOL) ||
                  (d2.max_abs <= TDM_CMP_FLOOR_FACTOR * fl->max_abs &&
                   l2 <= TDM_CMP_FLOOR_FACTOR * fl_loss + 10 * TDM_CMP_LOSS_RTOL);
    int ok = d1.ok && l1 <= TDM_CMP_LOSS_RTOL && last_ok;
    printf("  %-14s step 1: params max |diff| %.2e (rel %.2e), loss rel %.1e;  step %d: "
           "params max |diff| %.2e (rel %.2e), loss rel %.1e  -> %s\n", label, d1.max_abs,
           d1.max_rel, l1, o->steps, d2.max_abs, d2.max_rel, l2, ok ? "PASS" : "FAIL");
    if (!d2.ok && last_ok)
        printf("  %-14s step %d is past the fixed bound but within %.1fx the float-noise "
               "floor\n", "", o->steps, fl->max_abs > 0 ? d2.max_abs / fl->max_abs : 0.0);
    const tdm_cmp_diff *w = !d1.ok ? &d1 : &d2;
    if (w->worst >= 0)
        printf("  %-14s tensor that differs most (relative to its tolerance): %s (%.2f of "
               "the allowed difference)\n", "", tdm_model_param_info(ref, w->worst)->name,
               w->worst_ratio);
    return ok;
}

/* The equivalence verdict: each pair of modes after step 1 and after the
 * last, and every DDP rank against rank 0. Sets j->verdict. */
static tdm_status tdm_cmp_print_equivalence(tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    tdm_model *ref = NULL;
    tdm_device *dev0 = NULL;
    tdm_status st;
    if ((st = tdm_device_open(&dev0, "cpu", 0, 1)) ||
        (st = tdm_model_init(&ref, dev0, &j->spec, o->seed))) {
        fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
        tdm_device_free(dev0);
        return st;
    }
    const tdm_cmp_result *single = &j->res[TDM_CMP_SINGLE];
    tdm_cmp_diff fl;
    tdm_cmp_compare(ref, j->floor_r.params_last, single->params_last, TDM_CMP_ATOL_LAST,
                    TDM_CMP_RTOL_LAST, &fl);
    double fl_loss = fabs(j->floor_r.loss[o->steps - 1] - single->loss[o->steps - 1]) /
                     fabs(single->loss[o->steps - 1]);
    j->floor = (tdm_cmp_floor){.max_abs = fl.max_abs, .loss_rel = fl_loss};
    printf("\nEquivalence (|a-b| <= atol + rtol*|b|: after step 1 atol %.0e rtol %.0e; after "
           "step %d atol %.0e rtol %.0e,\n  or within %.0fx the float-noise floor: one device "
           "started one ulp off ends %.2e away (loss rel %.1e))\n", TDM_CMP_ATOL_FIRST,
           TDM_CMP_RTOL_FIRST, o->steps, TDM_CMP_ATOL_LAST, TDM_CMP_RTOL_LAST,
           TDM_CMP_FLOOR_FACTOR, fl.max_abs, fl_loss);
    tdm_cmp_report *rep = &j->rep;
    *rep = (tdm_cmp_report){.atol_first = TDM_CMP_ATOL_FIRST, .rtol_first = TDM_CMP_RTOL_FIRST,
                            .atol_last = TDM_CMP_ATOL_LAST, .rtol_last = TDM_CMP_RTOL_LAST,
                            .loss_rtol = TDM_CMP_LOSS_RTOL, .floor_factor = TDM_CMP_FLOOR_FACTOR,
                            .floor_max_abs = fl.max_abs, .floor_loss_rel = fl_loss};
    int n_pairs = rep->n_pairs = tdm_cmp_fsdp_pairs(j->ran, rep->pairs, 16);
    j->verdict = 1;
    for (int q = 0; q < n_pairs; q++) {
        rep->pair_ok[q] = tdm_cmp_print_pair(j, ref, (tdm_cmp_mode)rep->pairs[q][0],
                                             (tdm_cmp_mode)rep->pairs[q][1], &fl, fl_loss);
        j->verdict &= rep->pair_ok[q];
    }
    if (j->ran[TDM_CMP_DDP] && !j->res[TDM_CMP_DDP].ranks_agree) {
        printf("  DDP ranks ended with different parameters -> FAIL\n");
        j->verdict = 0;
    } else if (j->ran[TDM_CMP_DDP]) {
        printf("  DDP: every rank ended with bitwise the same parameters as rank 0\n");
    }
    j->verdict &= tdm_cmp_fsdp_print_bitwise(o, j->rp, j->nres);
    printf("  verdict: %s\n", j->verdict ? "PASS - the modes computed the same training"
                                         : "FAIL - the modes disagree beyond float tolerance");
    tdm_model_free(ref);
    tdm_device_free(dev0);
    return TDM_STATUS_OK;
}

/* The figures in words: speed-ups, what DP's copies cost, what DDP's
 * overlap hid, the distance to perfect scaling. */
static void tdm_cmp_print_reading(const tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    if (!j->ran[TDM_CMP_DP] || !j->ran[TDM_CMP_DDP]) {
        printf("\nReading\n");
        tdm_cmp_fsdp_reading(o, j->rp, j->nres, j->sps);
        return;
    }
    const double *sps = j->sps;
    tdm_phase_times dp, ddp;
    tdm_cmp_phase_mean(o, &j->res[TDM_CMP_DP], &dp);
    tdm_cmp_phase_mean(o, &j->res[TDM_CMP_DDP], &ddp);
    /* shares of the mean step, as in the phase table */
    double dpm, ddpm, comm, exposed;
    tdm_cmp_means(o, &j->res[TDM_CMP_DP], &dpm, NULL, NULL);
    tdm_cmp_means(o, &j->res[TDM_CMP_DDP], &ddpm, &comm, &exposed);
    double rep = 100.0 * dp.ms[TDM_PHASE_REPLICATE] / dpm;
    double red = 100.0 * dp.ms[TDM_PHASE_REDUCE] / dpm;
    double outdev = 100.0 * (dp.ms[TDM_PHASE_GATHER] + dp.ms[TDM_PHASE_LOSS] +
                             dp.ms[TDM_PHASE_SCATTER]) / dpm;
    const tdm_cmp_result *r = &j->res[TDM_CMP_DDP];
    double hidden = comm > 0 ? 100.0 * (comm - exposed) / comm : 0.0;
    if (hidden < 0) hidden = 0;
    printf("\nReading\n");
    printf("  On %d devices DDP runs %.2fx and DP %.2fx as fast as one device; DDP is %.2fx "
           "as fast as DP.\n", o->n_dev, sps[TDM_CMP_DDP] / sps[0], sps[TDM_CMP_DP] / sps[0],
           sps[TDM_CMP_DDP] / sps[TDM_CMP_DP]);
    printf("  DP spends %.1f%% of each step copying the parameters to the replicas and "
           "%.1f%% adding their gradients back onto the master; scatter, gather and the "
           "whole-batch loss on the output device take another %.1f%%.\n", rep, red, outdev);
    printf("  DDP spends %.1f%% of each step waiting for the all-reduce after backward; "
           "%.0f%% of its all-reduce time (%.2f ms per step) ran while backward was still "
           "computing, and %.0f%% of the gradient bytes were launched then%s.\n",
           100.0 * ddp.ms[TDM_PHASE_ALLREDUCE_WAIT] / ddpm, hidden, comm,
           100.0 * r->overlap_bytes_frac,
           r->overlap_bytes_frac < 0.25 && r->n_buckets > 1
               ? " (the big bucket only fills at the end of backward: a smaller "
                 "--bucket-cap-mb launches more of it early)"
               : "");
    double ideal = sps[0] * o->n_dev;
    int cores = tdm_device_host_cores();
    printf("  Perfect scaling would be %.0f samples/s; DDP reaches %.0f%% of it%s.\n", ideal,
           100.0 * sps[TDM_CMP_DDP] / ideal,
           o->n_dev > cores && (o->dl.kind == TDM_DEVICE_HOST || tdm_tool_cuda_emulated())
               ? " (more devices than cores: they share the cores)" : "");
    tdm_cmp_fsdp_reading(o, j->rp, j->nres, sps);
}

/* --modes ...,pp: the sweep's PP column at k devices (k stages), "-"
 * where a pipeline of k stages cannot run (one device, more stages than
 * layers). */
static void tdm_cmp_sweep_pp(tdm_cmp_job *j, int k)
{
    int L = 0;
    if (!(j->o.modes & TDM_CMP_PP_BIT)) return;
    (void)tdm_model_spec_n_layers(&j->spec, &L);
    double sps = k > 1 && k <= L ? tdm_cmp_pp_sweep_sps(&j->o, &j->data, &j->spec, k) : -1.0;
    if (sps > 0) printf(" %12.0f %8.2fx", sps, sps / j->sps[0]);
    else printf(" %12s %9s", "-", "");
}

/* --sweep: DP and DDP again at each device count (and the pipeline). */
static tdm_status tdm_cmp_sweep(tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    if (j->n_sweep <= 0) return TDM_STATUS_OK;
    printf("\nScaling (samples/s, median step; speed-up over one device at %.0f)\n", j->sps[0]);
    printf("  %-8s %12s %9s %12s %9s", "devices", "DP", "speed-up", "DDP", "speed-up");
    if (j->o.modes & TDM_CMP_PP_BIT) printf(" %12s %9s", "PP", "speed-up");
    printf("\n");
    for (int i = 0; i < j->n_sweep; i++) {
        j->sweep[i] = (tdm_cmp_sweep_point){.devices = j->sweep_dev[i],
                                            .ideal = j->sps[0] * j->sweep_dev[i]};
        if (j->sweep_dev[i] > o->batch) {
            printf("  %-8d skipped: more devices than samples in a batch\n", j->sweep_dev[i]);
            continue;
        }
        tdm_cmp_result a = {0}, b = {0};
        double m1, m2, x1, x2;
        tdm_status st = tdm_cmp_run(o, &j->data, TDM_CMP_DP, j->sweep_dev[i], &a);
        if (st == TDM_STATUS_OK) st = tdm_cmp_run(o, &j->data, TDM_CMP_DDP, j->sweep_dev[i], &b);
        if (st == TDM_STATUS_OK) {
            tdm_cmp_sweep_point *sp = &j->sweep[i];
            tdm_cmp_step_stats(o, &a, &m1, &x1, &x2);
            sp->dp[0] = o->batch / m1 * 1e3;
            sp->dp[1] = o->batch / x2 * 1e3;
            sp->dp[2] = o->batch / x1 * 1e3;
            tdm_cmp_step_stats(o, &b, &m2, &x1, &x2);
            sp->ddp[0] = o->batch / m2 * 1e3;
            sp->ddp[1] = o->batch / x2 * 1e3;
            sp->ddp[2] = o->batch / x1 * 1e3;
            printf("  %-8d %12.0f %8.2fx %12.0f %8.2fx", j->sweep_dev[i], sp->dp[0],
                   sp->dp[0] / j->sps[0], sp->ddp[0], sp->ddp[0] / j->sps[0]);
            tdm_cmp_sweep_pp(j, j->sweep_dev[i]);
            printf("\n");
            fflush(stdout);
        }
        if (st == TDM_STATUS_OK && j->n_sweep_res + 2 <= 32) {
            /* kept for --csv */
            j->sweep_res[j->n_sweep_res++] = a;
            j->sweep_res[j->n_sweep_res++] = b;
        } else {
            tdm_cmp_result_free(&a);
            tdm_cmp_result_free(&b);
        }
        TDM_CHECK(st);
    }
    return TDM_STATUS_OK;
}

/* --trace, --csv, --plot: each is tried; the first failure is returned. */
static tdm_status tdm_cmp_write_outputs(tdm_cmp_job *j)
{
    const tdm_cmp_opts *o = &j->o;
    tdm_status st = TDM_STATUS_OK, s;
    printf("\n");
    if (o->trace) {
        if ((s = tdm_cmp_write_trace(o->trace, o, j->rp, j->nres)) != TDM_STATUS_OK) st = s;
        else printf("trace: %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o->trace);
    }
    if (o->json) {
        j->rep.verdict = j->verdict;
        j->rep.other_cores = j->other_cores;
        j->rep.sweep = j->sweep;
        j->rep.n_sweep = j->n_sweep;
        if ((s = tdm_cmp_write_json_file(o->json, o, j->rp, j->nres, &j->rep)) != TDM_STATUS_OK) {
            if (!st) st = s;
        } else {
            printf("json: %s\n", o->json);
        }
    }
    if (o->csv) {
        tdm_cmp_result *all[TDM_CMP_NMODES + 32];
        int n_all = 0;
        for (int k = 0; k < j->nres; k++) all[n_all++] = j->rp[k];
        for (int k = 0; k < j->n_sweep_res; k++) all[n_all++] = &j->sweep_res[k];
        if ((s = tdm_cmp_write_csv(o->csv, o, all, j->nres, n_all)) != TDM_STATUS_OK) {
            if (!st) st = s;
        } else {
            printf("csv: %s\n", o->csv);
        }
    }
    if (o->plot &&
        (s = tdm_cmp_write_plots(o->plot, o, j->rp, j->nres, j->sweep, j->n_sweep)) !=
            TDM_STATUS_OK &&
        !st)
        st = s;
    return st;
}

/* An MPI job's rank other than 0: wait (asleep) for rank 0's single and
 * DP runs, then run DDP and the sharded modes of --modes with it, in
 * tdm_cmp_run_modes' order; rank 0 alone reports and gives the verdict. */
static tdm_status tdm_cmp_mpi_peer(tdm_cmp_job *j)
{
    j->verdict = 1;
    TDM_CHECK(tdm_comm_barrier(tdm_cmp_mr.world));
    for (int k = TDM_CMP_DDP; k < TDM_CMP_NMODES; k++) {
        if (k != TDM_CMP_DDP && !(tdm_cmp_is_sharded((tdm_cmp_mode)k) && j->o.modes & 1u << k))
            continue;
        TDM_CHECK(tdm_cmp_run(&j->o, &j->data, (tdm_cmp_mode)k, j->o.n_dev, &j->res[k]));
    }
    return TDM_STATUS_OK;
}

/* After the options: the data, the runs, the report. */
static tdm_status tdm_cmp_main_run(tdm_cmp_job *j)
{
    TDM_CHECK(tdm_cmp_check(j));
    TDM_CHECK(tdm_cmp_check_outputs(j));
    /* usage is checked: from here on every rank says what goes wrong */
    tdm_dist_unsilence(&j->err_fd);
    TDM_CHECK(j->gpt ? tdm_cmp_load_text(j) : tdm_cmp_load_images(j));
    tdm_cmp_print_header(j);
    if (j->o.ddp_comm && tdm_cmp_mr.env.rank != 0) return tdm_cmp_mpi_peer(j);
    TDM_CHECK(tdm_cmp_run_modes(j));
    tdm_cmp_print_throughput(j);
    tdm_cmp_print_phase_table(&j->o, j->rp, j->nres);
    TDM_CHECK(tdm_cmp_print_equivalence(j));
    if (j->o.comm_hook) {
        int hv = tdm_cmp_hook_section(&j->o, &j->data, &j->spec, &j->res[TDM_CMP_DDP]);
        if (hv < 0) return TDM_STATUS_PEER_FAILED;
        if (!hv) j->verdict = 0;
        j->rep.hook = j->o.comm_hook;
        j->rep.hook_pass = hv == 1;
    }
    tdm_cmp_print_memory(&j->o, j->rp, j->nres);
    tdm_cmp_print_reading(j);
    for (int sp = 0; sp < 2; sp++) {
        if (!(j->o.modes & (sp ? TDM_CMP_TP_SP_BIT : TDM_CMP_TP_BIT))) continue;
        int tv = tdm_cmp_tp_section(&j->o, &j->data, &j->spec, &j->res[TDM_CMP_SINGLE],
                                    j->ran[TDM_CMP_DDP] ? &j->res[TDM_CMP_DDP] : NULL, sp,
                                    &j->floor);
        if (tv < 0) return TDM_STATUS_PEER_FAILED;
        if (!tv) j->verdict = 0;
    }
    if (j->o.modes & TDM_CMP_PP_BIT) {
        int pv = tdm_cmp_pp_section(&j->o, &j->data, &j->spec, &j->res[TDM_CMP_SINGLE],
                                    j->ran[TDM_CMP_DDP] ? &j->res[TDM_CMP_DDP] : NULL, &j->floor);
        if (pv < 0) return TDM_STATUS_PEER_FAILED;
        if (!pv) j->verdict = 0;
    }
    if (j->o.modes & (TDM_CMP_PS_BIT | TDM_CMP_PS_ASYNC_BIT)) {
        const tdm_cmp_result *ddp = j->ran[TDM_CMP_DDP] ? &j->res[TDM_CMP_DDP] : NULL;
        double med = 0, mn = 0, mx = 0;
        if (ddp) tdm_cmp_step_stats(&j->o, ddp, &med, &mn, &mx);
        int pv = tdm_cmp_ps_section(&j->o, ddp, med > 0 ? j->o.batch / (med / 1000.0) : 0);
        if (pv < 0) return pv == -2 ? TDM_STATUS_USAGE : TDM_STATUS_PEER_FAILED;
    }
    tdm_cmp_load_print(&j->o, j->rp, j->nres, j->other_cores);
    TDM_CHECK(tdm_cmp_sweep(j));
    return tdm_cmp_write_outputs(j);
}

/* --deterministic K: bytes across device counts and modes instead of a
 * noise floor (tools/compare_det.c); --sweep's counts, else 1 and
 * --device's. */
static int tdm_cmp_det(tdm_cmp_job *j)
{
    tdm_cmp_opts *o = &j->o;
    int counts[16], n = 0, identical = 0;
    tdm_status st = tdm_cmp_check_devices(o);
    if (st == TDM_STATUS_OK && o->sweep &&
        (n = tdm_cmp_parse_sweep(o->sweep, counts, 16)) <= 0)
        st = tdm_tool_usage_error("tandem compare: --sweep '%s': expected device counts like "
                                  "1,2,4\n", o->sweep);
    if (st == TDM_STATUS_OK && !o->sweep) {
        counts[n++] = 1;
        if (o->n_dev > 1) counts[n++] = o->n_dev;
    }
    if (st == TDM_STATUS_OK) st = tdm_cmp_det_main(o, (int)j->det, counts, n, &identical);
    return st == TDM_STATUS_OK && !identical ? 3 : tdm_tool_exit(st);
}

int tdm_tool_compare_main(int argc, char **argv)
{
    static const char default_device[] = "cpu:2";
    tdm_cmp_job job = {.default_device = default_device, .err_fd = -1};
    tdm_cmp_job *j = &job;
    j->o = (tdm_cmp_opts){.model = "mlp", .device = default_device, .data = NULL,
                          .optim = NULL, .steps = 30, .warmup = -1, .batch = 0, .lr = -1,
                          .momentum = 0.9, .weight_decay = 0.0, .seed = 1, .bucket_cap_mb = 25,
                          .perturb_rank = -1, .powersgd_rank = TDM_POWERSGD_DEFAULT_RANK,
                          .powersgd_start_step = 10,
                          .modes = 1u << TDM_CMP_SINGLE | 1u << TDM_CMP_DP |
                                   1u << TDM_CMP_DDP | 1u << TDM_CMP_FSDP};
    int rc;
    tdm_status st = tdm_cmp_parse(argc, argv, j);
    if (st == TDM_STATUS_OK && j->help) {
        tdm_cmp_usage(stdout);
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK && j->modes_arg && !tdm_cmp_parse_modes(j->modes_arg, &j->o.modes))
        st = TDM_STATUS_USAGE;
    if (st == TDM_STATUS_OK) st = tdm_cmp_check_levers(j);
    if (st == TDM_STATUS_OK && j->det && (j->o.precision_arg || j->o.ckpt || j->o.clip > 0.0))
        st = tdm_tool_usage_error("tandem compare: --deterministic runs its modes in fp32 "
                                  "without --precision or --checkpoint-activations\n");
    if (st == TDM_STATUS_OK && j->det) return tdm_cmp_det(j);
    if (st == TDM_STATUS_OK) st = tdm_cmp_main_run(j);
    tdm_cmp_result_free(&j->floor_r);
    for (int k = 0; k < TDM_CMP_NMODES; k++) tdm_cmp_result_free(&j->res[k]);
    for (int k = 0; k < j->n_sweep_res; k++) tdm_cmp_result_free(&j->sweep_res[k]);
    free(j->data.order);
    tdm_data_free(&j->data.train);
    tdm_text_free(&j->data.text);
    /* 3: every run and write went well, and the verdict failed */
    rc = st == TDM_STATUS_OK && !j->verdict ? 3 : tdm_tool_exit(st);
    /* a run that failed here ends the job (others may wait for this rank);
     * usage errors, alike everywhere, and the verdict, rank 0's alone
     * after the runs, do not */
    if (tdm_cmp_mr.job) tdm_dist_mpi_rank_end(&tdm_cmp_mr, st);
    return rc;
}
