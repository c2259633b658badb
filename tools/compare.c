/* tools/compare.c: `tandem compare`: the same training run three ways -
 * one device, DataParallel on N devices, DistributedDataParallel on N
 * ranks - from the same initial parameters over the same global batches,
 * and what differs: throughput, where each step's time goes, whether the
 * three computed the same parameters, memory per device, and a reading of
 * those figures in words. Options --trace, --csv, --plot write the raw
 * material; --sweep repeats DP and DDP over device counts. */
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
#include "ddp/spawn.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/compare.h"
#include "tools/devices.h"
#include "tools/mpi_job.h"
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
#define TDM_CMP_FLOOR_FACTOR 10.0

static void tdm_cmp_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem compare [options]\n"
        "\n"
        "Runs the same training three ways - one device, DataParallel on N devices and\n"
        "DistributedDataParallel on N ranks - from the same initial parameters over the\n"
        "same global batches, and prints throughput, a per-phase breakdown, an\n"
        "equivalence verdict, memory per device and a reading of the figures.\n"
        "\n"
        "  --model NAME         mlp, mlp:W0-..-Wn, cnn, gpt, gpt:L-D-H-T      [mlp]\n"
        "  --device SPEC        devices for DP and DDP: cpu:N (N >= 1), or GPUs\n"
        "                       cuda (all) / cuda:I,J,.. (single runs on the first) [cpu:2]\n"
        "  --steps S            training steps per mode                      [30]\n"
        "  --warmup W           steps left out of the timing figures         [3]\n"
        "  --batch B            global batch size (B >= N)   [256; gpt: %d windows]\n"
        "  --data DIR|synthetic Fashion-MNIST directory or synthetic data  [Fashion-MNIST]\n"
        "  --data FILE|DIR      gpt: any file, or a fortunes directory  [Debian's fortunes]\n"
        "  --optim sgd|adamw    [sgd]   --lr LR [sgd 0.05, adamw 0.001]   --momentum M [0.9]\n"
        "  --seed S             initial parameters and data order            [1]\n"
        "  --bucket-cap-mb MB   DDP bucket cap                               [25]\n"
        "  --no-overlap         DDP all-reduces after backward (to see what overlap buys)\n"
        "  --trace FILE         Chrome trace-event JSON (Perfetto, chrome://tracing)\n"
        "  --csv FILE           raw per-step figures\n"
        "  --plot DIR           loss, throughput, phase (and scaling) charts, with gnuplot;\n"
        "                       DIR must be yours and not writable by others\n"
        "  --sweep 1,2,4        also run DP and DDP at these device counts\n"
        "  --perturb-rank R     testing aid: DDP rank R adds 1%% to its gradient share,\n"
        "                       which the equivalence verdict must catch\n"
        "  --backend B          under mpirun/srun: DDP's communicator, shm, mpi, hier or\n"
        "                       auto (shm on one machine, hier otherwise)    [auto]\n"
        "\n"
        "Under an MPI launcher (mpirun -np N tandem compare ...) DDP's N ranks are the\n"
        "job's; rank 0 also runs one device and DP (give it the cores: --bind-to none)\n"
        "and prints the report; --device defaults to cpu:N.\n"
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
    static const tdm_phase rows[] = {
        TDM_PHASE_REPLICATE, TDM_PHASE_SCATTER, TDM_PHASE_FORWARD, TDM_PHASE_GATHER,
        TDM_PHASE_LOSS, TDM_PHASE_BACKWARD, TDM_PHASE_REDUCE, TDM_PHASE_ALLREDUCE_WAIT,
        TDM_PHASE_STEP};
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
    for (size_t q = 0; q < sizeof rows / sizeof rows[0]; q++) {
        tdm_phase p = rows[q];
        printf("  %-22s", p == TDM_PHASE_ALLREDUCE_WAIT ? "all-reduce (exposed)" : tdm_phase_name(p));
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
}

static void tdm_cmp_print_memory(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n)
{
    printf("\nMemory per device (MiB)\n");
    printf("  %-18s %9s %9s %9s %9s %11s %9s %9s\n", "mode/device", "params", "grads",
           "optimizer", "buffers", "activations", "comm", "total");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        int shown = r->n_dev < 2 ? r->n_dev : 2;
        for (int d = 0; d < shown; d++) {
            const tdm_cmp_memory *m = &r->mem[d];
            char name[64], dev[32];
            tdm_cmp_dev_name(o, d, dev, sizeof dev);
            if (r->mode == TDM_CMP_DDP)
                snprintf(name, sizeof name, "DDP rank %s", d == 0 ? "0" : r->n_dev > 2 ? "1.." : "1");
            else
                snprintf(name, sizeof name, "%s %s%s", tdm_cmp_mode_name(r->mode), dev,
                         d == 1 && r->n_dev > 2 ? ".." : "");
            double mib = 1.0 / (1024.0 * 1024.0);
            double total = m->params + m->grads + m->optim + m->buffers + m->activations + m->comm;
            printf("  %-18s %9.3f %9.3f %9.3f %9.3f %11.3f %9.3f %9.3f\n", name, m->params * mib,
                   m->grads * mib, m->optim * mib, m->buffers * mib, m->activations * mib,
                   m->comm * mib, total * mib);
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
}

/* An MPI job's rank (tdm_tool_compare_main releases it). */
static tdm_tool_mpi_rank tdm_cmp_mr;

/* Under an MPI launcher: joins the job (collective) and makes DDP's
 * communicator. Ranks other than 0 print nothing to stdout, and nothing
 * to stderr until the runs start (*err_fd keeps it; usage errors, alike
 * on every rank, are then said once). Returns 0 or the exit code. */
static int tdm_cmp_mpi_join(tdm_cmp_opts *o, int device_given, int *err_fd)
{
    tdm_mpi_backend b = TDM_MPI_BACKEND_AUTO;
    if (o->backend && !tdm_tool_backend_parse("compare", o->backend, &b)) return 2;
    if (!tdm_tool_mpi_launched()) {
        if (b == TDM_MPI_BACKEND_AUTO || b == TDM_MPI_BACKEND_SHM) return 0;
        if (!tdm_tool_mpi_built()) {
            tdm_tool_mpi_missing("--backend mpi|hier");
            fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
            return 1;
        }
        fprintf(stderr, "tandem compare: --backend %s runs DDP between the ranks of an MPI job: "
                "start them with `mpirun -np N tandem compare --backend %s ...`\n", o->backend,
                o->backend);
        return 2;
    }
    if (o->sweep) {
        if (tdm_tool_mpi_env_rank() == 0)
            fprintf(stderr, "tandem compare: --sweep: under an MPI launcher DDP's ranks are the "
                    "job's; run one job per size instead\n");
        return 2;
    }
    tdm_shm_opts so = {.arena_bytes = tdm_ddp_arena_bytes(tdm_cmp_param_elems(o))};
    if (tdm_tool_mpi_rank_init(&tdm_cmp_mr, b, 0, &so) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: joining the MPI job: %s\n", tdm_error_message());
        return 1;
    }
    o->ddp_comm = tdm_cmp_mr.comm;
    static char dev[32];
    if (!device_given) {
        snprintf(dev, sizeof dev, "cpu:%d", tdm_cmp_mr.env.world_size);
        o->device = dev;
    }
    if (tdm_cmp_mr.env.rank != 0) {
        int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            *err_fd = dup(STDERR_FILENO);
            dup2(fd, STDOUT_FILENO);
            dup2(fd, STDERR_FILENO);
            close(fd);
        }
    }
    return 0;
}

static int tdm_cmp_main(int argc, char **argv);

int tdm_tool_compare_main(int argc, char **argv)
{
    int rc = tdm_cmp_main(argc, argv);
    /* a run that failed here ends the job (others may wait for this rank);
     * usage errors, alike everywhere, and the verdict, rank 0's alone
     * after the runs, do not */
    if (tdm_cmp_mr.job) tdm_tool_mpi_rank_end(&tdm_cmp_mr, rc);
    return rc;
}

static int tdm_cmp_main(int argc, char **argv)
{
    static const char default_device[] = "cpu:2";
    tdm_cmp_opts o = {.model = "mlp", .device = default_device, .data = NULL, .optim = "sgd",
                      .steps = 30, .warmup = 3, .batch = 0, .lr = -1, .momentum = 0.9,
                      .weight_decay = 0.0, .seed = 1, .bucket_cap_mb = 25, .perturb_rank = -1};
    for (int i = 1; i < argc; i++) {
        const char *v;
        long long iv;
        double fv;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tdm_cmp_usage(stdout);
            return 0;
        }
        TDM_ARGS_STR("--model", o.model)
        TDM_ARGS_STR("--device", o.device)
        TDM_ARGS_STR("--data", o.data)
        TDM_ARGS_STR("--optim", o.optim)
        TDM_ARGS_STR("--trace", o.trace)
        TDM_ARGS_STR("--csv", o.csv)
        TDM_ARGS_STR("--plot", o.plot)
        TDM_ARGS_STR("--sweep", o.sweep)
        TDM_ARGS_STR("--backend", o.backend)
        TDM_ARGS_INT("--steps", 1, 1000000, o.steps)
        TDM_ARGS_INT("--warmup", 0, 1000000, o.warmup)
        TDM_ARGS_INT("--batch", 1, 1 << 20, o.batch)
        TDM_ARGS_INT("--perturb-rank", 0, TDM_CMP_MAX_DEV - 1, o.perturb_rank)
        TDM_ARGS_FLOAT("--lr", 0.0, 1e3, o.lr)
        TDM_ARGS_FLOAT("--momentum", 0.0, 0.999999, o.momentum)
        TDM_ARGS_FLOAT("--bucket-cap-mb", 1e-6, 1e6, o.bucket_cap_mb)
        if ((v = tdm_args_value(argc, argv, &i, "--seed"))) {
            if (!tdm_args_int("--seed", v, 0, INT64_MAX, &iv)) return 2;
            o.seed = (uint64_t)iv;
            continue;
        }
        if (!strcmp(argv[i], "--no-overlap")) { o.no_overlap = 1; continue; }
        fprintf(stderr, "tandem compare: unknown option '%s' (see tandem compare --help)\n", argv[i]);
        return 2;
    }
    if (strcmp(o.optim, "sgd") && strcmp(o.optim, "adamw")) {
        fprintf(stderr, "tandem compare: --optim '%s': expected sgd or adamw\n", o.optim);
        return 2;
    }
    if (o.lr < 0) o.lr = strcmp(o.optim, "sgd") ? 1e-3 : 0.05;
    if (!strcmp(o.optim, "adamw")) o.weight_decay = 0.01;
    tdm_model_spec spec;
    if (tdm_model_spec_parse(&spec, o.model) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: --model: %s\n", tdm_error_message());
        return 2;
    }
    int gpt = spec.kind == TDM_MODEL_GPT;
    if (!o.batch) o.batch = gpt ? TDM_CMP_GPT_BATCH : 256;
    if (gpt && o.data && !strcmp(o.data, "synthetic")) {
        fprintf(stderr, "tandem compare: a gpt trains on text: --data FILE (any bytes) or a "
                        "fortunes directory [default: Debian's fortunes]\n");
        return 2;
    }
    int err_fd = -1, jrc = tdm_cmp_mpi_join(&o, o.device != default_device, &err_fd);
    if (jrc) return jrc;
    /* checked in a child when it names CUDA: this process forks DDP's ranks */
    tdm_device_list dl;
    tdm_status dst = tdm_tool_parse_devices(&dl, o.device, 1);
    if (dst != TDM_STATUS_OK) {
        /* no device is a runtime condition (exit 1, as train), not usage */
        fprintf(stderr, "tandem compare: --device: %s\n", tdm_error_message());
        return dst == TDM_STATUS_NO_DEVICE ? 1 : 2;
    }
    if (dl.kind == TDM_DEVICE_HOST)
        for (int i = 0; i < dl.count; i++)
            if (dl.index[i] != i) {
                fprintf(stderr, "tandem compare: --device %s: use cpu:N (devices cpu:0..N-1)\n",
                        o.device);
                return 2;
            }
    if (dl.count > TDM_CMP_MAX_DEV) {
        fprintf(stderr, "tandem compare: --device %s: at most %d devices\n", o.device,
                TDM_CMP_MAX_DEV);
        return 2;
    }
    o.dl = dl;
    o.n_dev = dl.count;
    if (o.ddp_comm) {
        const tdm_ddp_env *e = &tdm_cmp_mr.env;
        if (o.n_dev != e->world_size) {
            fprintf(stderr, "tandem compare: --device %s names %d devices, but the MPI job has %d "
                    "ranks (DDP's; omit --device for cpu:%d)\n", o.device, o.n_dev,
                    e->world_size, e->world_size);
            return 2;
        }
        /* a GPU rank uses its machine's GPU of its rank there */
        o.dl.index[e->rank] = dl.index[e->local_rank % dl.count];
    }
    if (o.batch < o.n_dev) {
        fprintf(stderr,
                "tandem compare: --batch %d is smaller than the %d devices: DP would split it "
                "into %d chunks of one sample and leave %d device%s idle (as "
                "torch.nn.DataParallel does), and DDP ranks would have nothing to train on; "
                "use --batch >= %d\n", o.batch, o.n_dev, o.batch, o.n_dev - o.batch,
                o.n_dev - o.batch > 1 ? "s" : "", o.n_dev);
        return 2;
    }
    if (o.perturb_rank >= o.n_dev) {
        fprintf(stderr, "tandem compare: --perturb-rank %d: only ranks 0..%d exist\n",
                o.perturb_rank, o.n_dev - 1);
        return 2;
    }
    if (o.warmup >= o.steps) o.warmup = o.steps > 1 ? o.steps / 2 : 0;
    int sweep_dev[16], n_sweep = 0;
    if (o.sweep && (n_sweep = tdm_cmp_parse_sweep(o.sweep, sweep_dev, 16)) <= 0) {
        fprintf(stderr, "tandem compare: --sweep '%s': expected device counts like 1,2,4 "
                        "(each 1..%d, at most 16)\n", o.sweep, TDM_CMP_MAX_DEV);
        return 2;
    }
    /* host devices are logical (any count); GPUs are the ones listed */
    for (int i = 0; i < n_sweep && dl.kind == TDM_DEVICE_CUDA; i++)
        if (sweep_dev[i] > dl.count) {
            fprintf(stderr, "tandem compare: --sweep %d: --device %s names only %d GPU%s (a "
                    "sweep uses the first k of them)\n", sweep_dev[i], o.device, dl.count,
                    dl.count == 1 ? "" : "s");
            return 2;
        }
    /* check output paths before the long part (core/safefile.h: what the
     * writes will check again, and nothing left behind) */
    const char *outs[] = {o.trace, o.csv};
    const char *flags[] = {"--trace", "--csv"};
    for (int i = 0; i < 2; i++)
        if (outs[i] && tdm_file_replace_check(AT_FDCWD, outs[i]) != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: %s: %s\n", flags[i], tdm_error_message());
            return 2;
        }
    /* "out/" and "out" name the same directory: print "out/loss.png" */
    static char plot_dir[4096];
    if (o.plot) {
        snprintf(plot_dir, sizeof plot_dir, "%s", o.plot);
        for (size_t n = strlen(plot_dir); n > 1 && plot_dir[n - 1] == '/'; n--)
            plot_dir[n - 1] = '\0';
        o.plot = plot_dir;
        int dfd = -1;
        if (tdm_dir_open_safe(o.plot, "--plot", 1, &dfd) != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
            return 2;
        }
        close(dfd);
    }

    /* usage is checked: from here on every rank says what goes wrong */
    if (err_fd >= 0) {
        dup2(err_fd, STDERR_FILENO);
        close(err_fd);
        err_fd = -1;
    }
    /* data and the global batches */
    tdm_cmp_data data = {0};
    tdm_status st;
    if (gpt) {
        /* windows drawn per step (core/text.h): no dataset order */
        data.T = spec.n_ctx;
        data.seed = o.seed;
        if ((st = tdm_text_load(&data.text, o.data)) != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: loading text: %s\n", tdm_error_message());
            return 1;
        }
        if ((st = tdm_text_check_context(&data.text, data.T)) != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: --model: %s\n", tdm_error_message());
            tdm_text_free(&data.text);
            return 2;
        }
        goto data_ready;
    }
    if (o.data && !strcmp(o.data, "synthetic")) {
        int c, h, w, classes;
        tdm_model_spec_sample_shape(&spec, &c, &h, &w, &classes);
        int64_t n = (int64_t)o.batch * (o.steps < 50 ? o.steps : 50);
        st = tdm_data_synthetic(&data.train, n, c, h, w, classes, 1234, 0);
    } else {
        st = tdm_data_load_fashion_mnist(&data.train, o.data, 1);
    }
    if (st != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: loading data: %s\n", tdm_error_message());
        return 1;
    }
    int64_t want = (int64_t)spec.in_c * spec.in_h * spec.in_w; /* the MLP's in_w is dims[0] */
    if (tdm_data_features(&data.train) != want) {
        fprintf(stderr, "tandem compare: the data has %lld features per sample but model %s "
                        "expects %lld\n", (long long)tdm_data_features(&data.train), o.model,
                (long long)want);
        tdm_data_free(&data.train);
        return 2;
    }
    if (data.train.n < o.batch) {
        fprintf(stderr, "tandem compare: --batch %d is larger than the %lld training samples\n",
                o.batch, (long long)data.train.n);
        tdm_data_free(&data.train);
        return 2;
    }
    int64_t per_epoch = data.train.n / o.batch;
    int64_t epochs = (o.steps + per_epoch - 1) / per_epoch;
    data.n_order = epochs * per_epoch * o.batch;
    data.order = malloc((size_t)(epochs * data.train.n) * sizeof(int64_t));
    if (!data.order) {
        fprintf(stderr, "tandem compare: out of memory\n");
        tdm_data_free(&data.train);
        return 1;
    }
    /* epoch e's full batches, epochs back to back (drop_last) */
    for (int64_t e = 0; e < epochs; e++) {
        tdm_train_epoch_order(data.order + e * per_epoch * o.batch, data.train.n, o.seed, e);
    }

data_ready:;
    char desc[160];
    tdm_model_spec_describe(&spec, desc, sizeof desc);
    printf("tandem compare: %s, global batch %d%s, %d steps (%d warm-up), %s lr %g%s%s\n", desc,
           o.batch, gpt ? " windows" : "", o.steps, o.warmup, o.optim, o.lr,
           gpt ? ", text: " : o.data && !strcmp(o.data, "synthetic") ? ", synthetic data"
                                                                 : ", Fashion-MNIST",
           gpt ? data.text.source : "");
    if (gpt)
        printf("  a sample is a window of %d bytes (%d tokens), its loss the mean over them\n",
               data.T, data.T);
    char dev0name[32], devspec[TDM_DEVICE_LIST_MAX * 4 + 8];
    tdm_cmp_dev_name(&o, 0, dev0name, sizeof dev0name);
    tdm_cmp_dev_spec(&o, o.n_dev, devspec, sizeof devspec);
    if (dl.kind == TDM_DEVICE_CUDA) {
        printf("  one device (%s) vs DP and DDP on %d GPU%s (%s; DDP's gradients over %s)\n",
               dev0name, o.n_dev, o.n_dev > 1 ? "s" : "", devspec,
               tdm_tool_cuda_emulated() ? "shm" : "NCCL");
        printf("  on GPUs kernels run asynchronously: a phase's time is host time until its "
               "next wait,\n  so phases that wait for the GPU absorb the time of earlier ones; "
               "step times are exact\n");
        tdm_tool_print_emulated(stdout, o.device);
    } else {
        printf("  one device (cpu:0) vs DP and DDP on %d host devices; this machine has %d "
               "core%s\n", o.n_dev, tdm_device_host_cores(), tdm_device_host_cores() > 1 ? "s" : "");
    }
    fflush(stdout);

    tdm_cmp_result res[TDM_CMP_NMODES];
    tdm_cmp_result *rp[TDM_CMP_NMODES];
    tdm_cmp_result floor_r;
    int rc = 0, nres = 0;
    memset(res, 0, sizeof res);
    memset(&floor_r, 0, sizeof floor_r);
    if (o.ddp_comm) {
        printf("  DDP's ranks: the MPI job's (%s)\n", tdm_cmp_mr.desc);
        if (tdm_device_host_cores() < o.n_dev && dl.kind == TDM_DEVICE_HOST)
            printf("  note: rank 0 may run on %d core%s, and one device and DP run there: "
                   "mpirun --bind-to none gives it the machine\n", tdm_device_host_cores(),
                   tdm_device_host_cores() == 1 ? "" : "s");
        fflush(stdout);
    }
    if (o.ddp_comm && tdm_cmp_mr.env.rank != 0) {
        /* a DDP rank: wait (asleep) for rank 0's single and DP runs */
        int ok = tdm_comm_barrier(tdm_cmp_mr.world) == TDM_STATUS_OK &&
                 tdm_cmp_run(&o, &data, TDM_CMP_DDP, o.n_dev, &res[TDM_CMP_DDP]);
        rc = ok ? 0 : 1;
        goto done;
    }
    for (int k = 0; k < TDM_CMP_NMODES; k++) {
        printf("  running %s...\n", tdm_cmp_mode_name((tdm_cmp_mode)k));
        fflush(stdout);
        /* an MPI job's other ranks wait for this before DDP */
        if (k == TDM_CMP_DDP && o.ddp_comm && tdm_comm_barrier(tdm_cmp_mr.world) != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
            rc = 1;
            goto done;
        }
        if (!tdm_cmp_run(&o, &data, (tdm_cmp_mode)k, k == TDM_CMP_SINGLE ? 1 : o.n_dev, &res[k])) {
            rc = 1;
            goto done;
        }
        rp[nres++] = &res[k];
    }

    /* the float-noise floor: one device again, from parameters one ulp off */
    {
        tdm_cmp_opts on = o;
        on.nudge = 1;
        printf("  running single again from parameters one ulp off (the float-noise floor)...\n");
        fflush(stdout);
        if (!tdm_cmp_run(&on, &data, TDM_CMP_SINGLE, 1, &floor_r)) {
            rc = 1;
            goto done;
        }
    }

    /* 1. throughput */
    double med[TDM_CMP_NMODES], mn[TDM_CMP_NMODES], mx[TDM_CMP_NMODES], sps[TDM_CMP_NMODES];
    printf("\nThroughput (steps %d..%d)\n", o.warmup + 1, o.steps);
    printf("  %-10s %12s %9s %22s\n", "mode", "samples/s", "speed-up", "step ms median (min-max)");
    for (int k = 0; k < nres; k++) {
        tdm_cmp_step_stats(&o, rp[k], &med[k], &mn[k], &mx[k]);
        sps[k] = o.batch / med[k] * 1e3;
        char name[32];
        snprintf(name, sizeof name, "%s(%d)", tdm_cmp_mode_name(rp[k]->mode), rp[k]->n_dev);
        printf("  %-10s %12.0f %8.2fx %10.2f (%.2f-%.2f)\n", name, sps[k], sps[k] / sps[0], med[k],
               mn[k], mx[k]);
    }

    /* 2. phases */
    tdm_cmp_print_phase_table(&o, rp, nres);

    /* 3. equivalence */
    tdm_model *ref = NULL;
    tdm_device *dev0 = NULL;
    if (tdm_device_open(&dev0, "cpu", 0, 1) != TDM_STATUS_OK ||
        tdm_model_init(&ref, dev0, &spec, o.seed) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
        rc = 1;
        goto done;
    }
    int bn = spec.kind == TDM_MODEL_CNN;
    int verdict = 1;
    tdm_cmp_diff fl;
    tdm_cmp_compare(ref, floor_r.params_last, res[TDM_CMP_SINGLE].params_last, TDM_CMP_ATOL_LAST,
                    TDM_CMP_RTOL_LAST, &fl);
    double fl_loss = fabs(floor_r.loss[o.steps - 1] - res[TDM_CMP_SINGLE].loss[o.steps - 1]) /
                     fabs(res[TDM_CMP_SINGLE].loss[o.steps - 1]);
    printf("\nEquivalence (|a-b| <= atol + rtol*|b|: after step 1 atol %.0e rtol %.0e; after "
           "step %d atol %.0e rtol %.0e,\n  or within %.0fx the float-noise floor: one device "
           "started one ulp off ends %.2e away (loss rel %.1e))\n", TDM_CMP_ATOL_FIRST,
           TDM_CMP_RTOL_FIRST, o.steps, TDM_CMP_ATOL_LAST, TDM_CMP_RTOL_LAST,
           TDM_CMP_FLOOR_FACTOR, fl.max_abs, fl_loss);
    static const int pairs[3][2] = {{TDM_CMP_DP, TDM_CMP_SINGLE}, {TDM_CMP_DDP, TDM_CMP_SINGLE},
                                    {TDM_CMP_DDP, TDM_CMP_DP}};
    for (int q = 0; q < 3; q++) {
        tdm_cmp_result *a = &res[pairs[q][0]], *b = &res[pairs[q][1]];
        char label[40];
        snprintf(label, sizeof label, "%s vs %s", tdm_cmp_mode_name(a->mode),
                 tdm_cmp_mode_name(b->mode));
        if (bn && b->mode == TDM_CMP_SINGLE) {
            printf("  %-14s not expected to match: batchnorm normalises each device's chunk "
                   "with that chunk's statistics\n", label);
            continue;
        }
        if (bn && o.batch % o.n_dev) {
            printf("  %-14s not expected to match: DP's chunks (torch.chunk) and DDP's shares "
                   "differ when %d does not divide by %d, so batchnorm sees different groups\n",
                   label, o.batch, o.n_dev);
            continue;
        }
        tdm_cmp_diff d1, d2;
        tdm_cmp_compare(ref, a->params_first, b->params_first, TDM_CMP_ATOL_FIRST,
                        TDM_CMP_RTOL_FIRST, &d1);
        tdm_cmp_compare(ref, a->params_last, b->params_last, TDM_CMP_ATOL_LAST,
                        TDM_CMP_RTOL_LAST, &d2);
        double l1 = fabs(a->loss[0] - b->loss[0]) / fabs(b->loss[0]);
        double l2 = fabs(a->loss[o.steps - 1] - b->loss[o.steps - 1]) / fabs(b->loss[o.steps - 1]);
        /* the last step passes within the fixed bound, or within the floor */
        int last_ok = (d2.ok && l2 <= 10 * TDM_CMP_LOSS_RTOL) ||
                      (d2.max_abs <= TDM_CMP_FLOOR_FACTOR * fl.max_abs &&
                       l2 <= TDM_CMP_FLOOR_FACTOR * fl_loss + 10 * TDM_CMP_LOSS_RTOL);
        int ok = d1.ok && l1 <= TDM_CMP_LOSS_RTOL && last_ok;
        verdict &= ok;
        printf("  %-14s step 1: params max |diff| %.2e (rel %.2e), loss rel %.1e;  step %d: "
               "params max |diff| %.2e (rel %.2e), loss rel %.1e  -> %s\n", label, d1.max_abs,
               d1.max_rel, l1, o.steps, d2.max_abs, d2.max_rel, l2, ok ? "PASS" : "FAIL");
        if (!d2.ok && last_ok)
            printf("  %-14s step %d is past the fixed bound but within %.1fx the float-noise "
                   "floor\n", "", o.steps, fl.max_abs > 0 ? d2.max_abs / fl.max_abs : 0.0);
        tdm_cmp_diff *w = !d1.ok ? &d1 : &d2;
        if (w->worst >= 0)
            printf("  %-14s tensor that differs most (relative to its tolerance): %s (%.2f of "
                   "the allowed difference)\n", "", tdm_model_param_info(ref, w->worst)->name,
                   w->worst_ratio);
    }
    if (!res[TDM_CMP_DDP].ranks_agree) {
        printf("  DDP ranks ended with different parameters -> FAIL\n");
        verdict = 0;
    } else {
        printf("  DDP: every rank ended with bitwise the same parameters as rank 0\n");
    }
    printf("  verdict: %s\n", verdict ? "PASS - the modes computed the same training"
                                      : "FAIL - the modes disagree beyond float tolerance");
    tdm_model_free(ref);
    tdm_device_free(dev0);

    /* 4. memory */
    tdm_cmp_print_memory(&o, rp, nres);

    /* 5. reading */
    {
        tdm_phase_times dp, ddp;
        tdm_cmp_phase_mean(&o, &res[TDM_CMP_DP], &dp);
        tdm_cmp_phase_mean(&o, &res[TDM_CMP_DDP], &ddp);
        /* shares of the mean step, as in the phase table */
        double dpm, ddpm, comm, exposed;
        tdm_cmp_means(&o, &res[TDM_CMP_DP], &dpm, NULL, NULL);
        tdm_cmp_means(&o, &res[TDM_CMP_DDP], &ddpm, &comm, &exposed);
        double rep = 100.0 * dp.ms[TDM_PHASE_REPLICATE] / dpm;
        double red = 100.0 * dp.ms[TDM_PHASE_REDUCE] / dpm;
        double outdev = 100.0 * (dp.ms[TDM_PHASE_GATHER] + dp.ms[TDM_PHASE_LOSS] +
                                 dp.ms[TDM_PHASE_SCATTER]) / dpm;
        const tdm_cmp_result *r = &res[TDM_CMP_DDP];
        double hidden = comm > 0 ? 100.0 * (comm - exposed) / comm : 0.0;
        if (hidden < 0) hidden = 0;
        printf("\nReading\n");
        printf("  On %d devices DDP runs %.2fx and DP %.2fx as fast as one device; DDP is %.2fx "
               "as fast as DP.\n", o.n_dev, sps[TDM_CMP_DDP] / sps[0], sps[TDM_CMP_DP] / sps[0],
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
        double ideal = sps[0] * o.n_dev;
        int cores = tdm_device_host_cores();
        printf("  Perfect scaling would be %.0f samples/s; DDP reaches %.0f%% of it%s.\n", ideal,
               100.0 * sps[TDM_CMP_DDP] / ideal,
               o.n_dev > cores && (o.dl.kind == TDM_DEVICE_HOST || tdm_tool_cuda_emulated())
                   ? " (more devices than cores: they share the cores)" : "");
    }

    /* sweep */
    double sweep_dp[16] = {0}, sweep_ddp[16] = {0};
    if (n_sweep > 0) {
        printf("\nScaling (samples/s, median step; speed-up over one device at %.0f)\n", sps[0]);
        printf("  %-8s %12s %9s %12s %9s\n", "devices", "DP", "speed-up", "DDP", "speed-up");
        for (int i = 0; i < n_sweep; i++) {
            if (sweep_dev[i] > o.batch) {
                printf("  %-8d skipped: more devices than samples in a batch\n", sweep_dev[i]);
                continue;
            }
            tdm_cmp_result a = {0}, b = {0};
            double m1, m2, x1, x2;
            if (!tdm_cmp_run(&o, &data, TDM_CMP_DP, sweep_dev[i], &a) ||
                !tdm_cmp_run(&o, &data, TDM_CMP_DDP, sweep_dev[i], &b)) {
                tdm_cmp_result_free(&a);
                tdm_cmp_result_free(&b);
                rc = 1;
                goto done;
            }
            tdm_cmp_step_stats(&o, &a, &m1, &x1, &x2);
            tdm_cmp_step_stats(&o, &b, &m2, &x1, &x2);
            sweep_dp[i] = o.batch / m1 * 1e3;
            sweep_ddp[i] = o.batch / m2 * 1e3;
            printf("  %-8d %12.0f %8.2fx %12.0f %8.2fx\n", sweep_dev[i], sweep_dp[i],
                   sweep_dp[i] / sps[0], sweep_ddp[i], sweep_ddp[i] / sps[0]);
            fflush(stdout);
            tdm_cmp_result_free(&a);
            tdm_cmp_result_free(&b);
        }
    }

    printf("\n");
    if (o.trace) {
        if (!tdm_cmp_write_trace(o.trace, &o, rp, nres)) rc = 1;
        else printf("trace: %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o.trace);
    }
    if (o.csv) {
        if (!tdm_cmp_write_csv(o.csv, &o, rp, nres)) rc = 1;
        else printf("csv: %s\n", o.csv);
    }
    if (o.plot && !tdm_cmp_write_plots(o.plot, &o, rp, nres, sweep_dev, sweep_dp, sweep_ddp,
                                       n_sweep, sps[0]))
        rc = 1;
    if (rc == 0 && !verdict) rc = 3;
done:
    tdm_cmp_result_free(&floor_r);
    for (int k = 0; k < TDM_CMP_NMODES; k++) tdm_cmp_result_free(&res[k]);
    free(data.order);
    tdm_data_free(&data.train);
    tdm_text_free(&data.text);
    return rc;
}
