/* tools/bench_dp.c: `tandem bench dp` (tools/bench.c dispatches here):
 * training throughput of one device
 * against DataParallel over several (samples/s after warm-up, median
 * step), their ratio, and where a DP step's time goes (each phase's share
 * of the step's wall-clock, and per device). Synthetic data. On host
 * devices the single device is cpu:0; on CUDA devices it is the first
 * listed GPU, and every step is timed to the GPUs' completion.
 * Figures for docs/perf/dp.md; nothing here is a test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/data.h"
#include "core/device.h"
#include "core/timer.h"
#include "dp/dp.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/bench.h"
#include "tools/compare.h"
#include "tools/devices.h"
#include "tools/stats.h"
#include "tools/tools.h"

static void tdm_bench_dp_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem bench dp [options]\n"
        "\n"
        "One device against DataParallel: samples/s of the median training step\n"
        "(SGD, momentum 0.9) after warm-up, and the DP step's phases. The single\n"
        "device is cpu:0 for host devices, the first listed GPU for CUDA devices;\n"
        "on GPUs each step is timed until every GPU has finished it (the 'sync'\n"
        "phase: work still queued on any GPU when tdm_dp_step returned, which\n"
        "waits for the master's update only).\n"
        "\n"
        "  --model NAME     mlp (784-1024-1024-10), mlp:W0-..-Wn, cnn or file:PATH\n"
        "                   (a model file, docs/MODELS.md)                  [mlp]\n"
        "  --batch B        global batch                    [mlp: 256, cnn: 128]\n"
        "  --device SPEC    DP devices: cpu:N, cpu:I,J,.., cuda or cuda:I,J,..\n"
        "                   (TANDEM_CUDA_EMULATOR=N: emulated, not a GPU)  [cpu:2]\n"
        "  --steps S        measured steps per mode and round                 [10]\n"
        "  --warmup W       warm-up steps per mode                             [3]\n"
        "  --rounds R       alternate single/DP measurements R times           [2]\n"
        "  --spin-us U      DP pool spin before sleeping (-1: auto)           [-1]\n"
        "  --blas-threads T also time one device with T BLAS threads (intra-op\n"
        "                   parallelism instead of DP; 0: skip; host only)    [0]\n"
        "  --seed S                                                           [1]\n");
}

typedef struct tdm_bench_dp_data {
    int batch, n_batches, features;
    float *x;        /* (n_batches * batch, features) */
    int32_t *y;
} tdm_bench_dp_data;

/* The single device's step. On a host device the calls the DP devices
 * make; elsewhere tdm_single_step, which stages x and y onto the device
 * and returns after tdm_dev_sync, so the time is the device's. */
static tdm_status tdm_bench_dp_single_step(tdm_single *s, const float *x, const int32_t *y,
                                           int batch)
{
    double loss;
    if (tdm_dev_kind(tdm_model_device(s->model)) != TDM_DEVICE_HOST)
        return tdm_single_step(s, x, y, batch, &loss);
    TDM_CHECK(tdm_model_zero_grad(s->model));
    TDM_CHECK(tdm_model_forward_backward(s->model, x, y, batch, &loss));
    return tdm_optim_step(s->opt);
}

/* The k-th batch of the synthetic set, cycling. */
static void tdm_bench_dp_batch(const tdm_bench_dp_data *d, int k, const float **x,
                               const int32_t **y)
{
    size_t b = (size_t)(k % d->n_batches);
    *x = d->x + b * d->batch * d->features;
    *y = d->y + b * d->batch;
}

static tdm_status tdm_bench_dp_fail(const char *what, tdm_status st)
{
    fprintf(stderr, "tandem bench dp: %s: %s\n", what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return st;
}

typedef struct tdm_bench_dp_args {
    const char *model, *device;
    long long batch, steps, warmup, rounds, spin, seed, blas;
    int help;
} tdm_bench_dp_args;

static tdm_status tdm_bench_dp_parse(int argc, char **argv, tdm_bench_dp_args *g)
{
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_HELP(g->help)
        TDM_ARGS_STR("--model", g->model)
        TDM_ARGS_STR("--device", g->device)
        TDM_ARGS_INT("--batch", 1, 1 << 20, g->batch)
        TDM_ARGS_INT("--steps", 1, 100000, g->steps)
        TDM_ARGS_INT("--warmup", 0, 100000, g->warmup)
        TDM_ARGS_INT("--rounds", 1, 1000, g->rounds)
        TDM_ARGS_INT("--spin-us", -1, 1000000, g->spin)
        TDM_ARGS_INT("--blas-threads", 0, 64, g->blas)
        TDM_ARGS_INT("--seed", 0, INT64_MAX, g->seed)
        fprintf(stderr, "tandem bench dp: unknown option '%s'\n", argv[i]);
        tdm_bench_dp_usage(stderr);
        return TDM_STATUS_USAGE;
    }
    return TDM_STATUS_OK;
}

/* A run's state: the single device's model and the DP master over the
 * same synthetic batches, and what was measured. */
typedef struct tdm_bench_dp {
    const tdm_bench_dp_args *g;
    tdm_model_spec ms;
    int n_dev, accel;
    tdm_device *devs[TDM_DP_MAX_DEVICES];
    tdm_device *single_dev, *own_single;
    tdm_model *single, *master;
    tdm_optim *single_opt, *dp_opt;
    tdm_single single_step;
    tdm_dp *dp;
    tdm_dataset ds;
    tdm_bench_dp_data d;
    double *t_single, *t_dp;   /* measured step times, ms */
    int ks, kd, k;             /* measured single and DP steps; batches used */
    double sync_ms;            /* GPUs: waiting for every device after tdm_dp_step */
    tdm_dp_timings sum;        /* DP's phases over the measured steps */
} tdm_bench_dp;

static void tdm_bench_dp_free(tdm_bench_dp *b)
{
    free(b->t_single);
    free(b->t_dp);
    tdm_data_free(&b->ds);
    tdm_dp_free(b->dp);
    tdm_single_free(&b->single_step);   /* its staging, on the model's device */
    tdm_optim_free(b->single_opt);
    tdm_optim_free(b->dp_opt);
    tdm_model_free(b->single);
    tdm_model_free(b->master);
    tdm_device_free(b->own_single);
    tdm_dp_devices_close(b->devs, b->n_dev);
}

/* The devices: DP's, and the baseline, the first listed GPU (shared with
 * the DP master) or one host device with single-threaded BLAS like each
 * DP device. */
static tdm_status tdm_bench_dp_devices(tdm_bench_dp *b)
{
    const tdm_bench_dp_args *g = b->g;
    tdm_status st;
    if ((st = tdm_dp_devices_open(g->device, b->devs, &b->n_dev)) != TDM_STATUS_OK)
        return tdm_bench_dp_fail("--device",
                                 st == TDM_STATUS_INVALID_ARG ? tdm_tool_usage(st) : st);
    b->accel = tdm_dev_kind(b->devs[0]) != TDM_DEVICE_HOST;
    if (b->accel && g->blas > 0)
        return tdm_tool_usage_error("tandem bench dp: --blas-threads applies to host devices "
                                    "only, not to --device %s\n", g->device);
    if (b->accel) {
        b->single_dev = b->devs[0];
        return TDM_STATUS_OK;
    }
    if ((st = tdm_device_open(&b->own_single, "cpu", 0, 1)) != TDM_STATUS_OK)
        return tdm_bench_dp_fail("opening cpu:0", st);
    b->single_dev = b->own_single;
    return TDM_STATUS_OK;
}

/* Models, optimizers, DataParallel and a few distinct batches, cycled. */
static tdm_status tdm_bench_dp_setup(tdm_bench_dp *b)
{
    const tdm_bench_dp_args *g = b->g;
    tdm_status st;
    TDM_CHECK(tdm_bench_dp_devices(b));
    if ((st = tdm_model_init(&b->single, b->single_dev, &b->ms, (uint64_t)g->seed)) ||
        (st = tdm_model_init(&b->master, b->devs[0], &b->ms, (uint64_t)g->seed)))
        return tdm_bench_dp_fail("building the model", st);
    tdm_model_set_train(b->single, 1);
    tdm_model_set_train(b->master, 1);
    if ((st = tdm_sgd_init(&b->single_opt, b->single, 0.01f, 0.9f)) ||
        (st = tdm_sgd_init(&b->dp_opt, b->master, 0.01f, 0.9f)))
        return tdm_bench_dp_fail("optimizer", st);
    b->single_step.model = b->single;
    b->single_step.opt = b->single_opt;
    tdm_dp_opts o;
    tdm_dp_opts_default(&o);
    o.spin_us = (int)g->spin;
    if ((st = tdm_dp_init(&b->dp, b->master, b->devs, b->n_dev, &o)) != TDM_STATUS_OK)
        return tdm_bench_dp_fail("DataParallel", st);
    b->d = (tdm_bench_dp_data){.batch = (int)g->batch, .n_batches = 4,
                               .features = tdm_model_in_features(b->master)};
    int c, h, w, classes;
    tdm_model_spec_sample_shape(&b->ms, &c, &h, &w, &classes);
    if ((st = tdm_data_synthetic(&b->ds, (int64_t)b->d.batch * b->d.n_batches, c, h, w, classes,
                                 (uint64_t)g->seed, 0)) != TDM_STATUS_OK)
        return tdm_bench_dp_fail("synthetic data", st);
    b->d.x = b->ds.x;
    b->d.y = b->ds.y;
    int per_mode = (int)(g->steps * g->rounds);
    b->t_single = calloc((size_t)per_mode, sizeof(double));
    b->t_dp = calloc((size_t)per_mode, sizeof(double));
    if (!b->t_single || !b->t_dp) {
        fprintf(stderr, "tandem bench dp: out of memory\n");
        return TDM_STATUS_OUT_OF_MEMORY;
    }
    return TDM_STATUS_OK;
}

static void tdm_bench_dp_print_header(const tdm_bench_dp *b)
{
    const tdm_bench_dp_args *g = b->g;
    char desc[128];
    tdm_model_spec_describe(&b->ms, desc, sizeof desc);
    if (b->accel) {
        char names[256] = "";
        for (int i = 0, used = 0; i < b->n_dev && used < (int)sizeof names; i++) {
            int k = snprintf(names + used, sizeof names - (size_t)used, "%s%s", i ? "," : "",
                             tdm_dev_name(b->devs[i]));
            if (k < 0) break;
            used += k;
        }
        printf("bench dp: %s, batch %d, single %s vs DP on %s (%d device%s: %s), replicate and "
               "reduce %s\n", desc, b->d.batch, tdm_dev_name(b->single_dev), g->device, b->n_dev,
               b->n_dev > 1 ? "s" : "", names,
               !tdm_dp_uses_device_group(b->dp) ? "staged through the host"
               : tdm_tool_cuda_emulated()        ? "through the emulated device group"
                                                 : "through the device group (NCCL)");
        tdm_tool_print_emulated(stdout, g->device);
    } else {
        printf("bench dp: %s, batch %d, single cpu:0 vs DP on %s (%d devices), %d host cores, "
               "%s\n", desc, b->d.batch, g->device, b->n_dev, tdm_device_host_cores(),
               tdm_device_host_blas_info());
    }
    printf("bench dp: %d warm-up + %d measured steps per mode, alternated over %d rounds\n",
           (int)g->warmup, (int)g->steps, (int)g->rounds);
}

/* n single-device steps; the ones from `from` on are timed into times[*kt]. */
static tdm_status tdm_bench_dp_run_single(tdm_bench_dp *b, int n, int from, double *times,
                                          int *kt)
{
    for (int s = 0; s < n; s++, b->k++) {
        const float *x;
        const int32_t *y;
        tdm_bench_dp_batch(&b->d, b->k, &x, &y);
        uint64_t t0 = tdm_time_ns();
        tdm_status st = tdm_bench_dp_single_step(&b->single_step, x, y, b->d.batch);
        if (st != TDM_STATUS_OK) return tdm_bench_dp_fail("single-device step", st);
        if (s >= from) times[(*kt)++] = tdm_time_ms_since(t0);
    }
    return TDM_STATUS_OK;
}

/* n DP steps; the ones from `from` on are timed, with their phases. */
static tdm_status tdm_bench_dp_run_dp(tdm_bench_dp *b, int n, int from)
{
    for (int s = 0; s < n; s++, b->k++) {
        const float *x;
        const int32_t *y;
        tdm_bench_dp_batch(&b->d, b->k, &x, &y);
        double loss;
        tdm_status st = tdm_dp_step(b->dp, b->dp_opt, x, y, b->d.batch, &loss);
        if (st != TDM_STATUS_OK) return tdm_bench_dp_fail("DP step", st);
        /* tdm_dp_step waits for the master's update on an accelerator;
         * anything still queued on another GPU is counted here, so
         * the step ends when every device has finished. */
        uint64_t t_sync = tdm_time_ns();
        for (int i = 0; b->accel && i < b->n_dev; i++)
            if ((st = tdm_dev_sync(b->devs[i])) != TDM_STATUS_OK)
                return tdm_bench_dp_fail("DP step", st);
        double synced = b->accel ? tdm_time_ms_since(t_sync) : 0.0;
        if (s < from) continue;
        const tdm_dp_timings *t = tdm_dp_last_timings(b->dp);
        b->t_dp[b->kd++] = t->step_ms + synced;
        b->sync_ms += synced;
        for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
            b->sum.wall.ms[p] += t->wall.ms[p];
            for (int i = 0; i < b->n_dev; i++) b->sum.device[i].ms[p] += t->device[i].ms[p];
        }
        b->sum.step_ms += t->step_ms + synced;
    }
    return TDM_STATUS_OK;
}

/* The rounds: single, then DP, alternated; the first round's first
 * --warmup steps of each are not timed. */
static tdm_status tdm_bench_dp_rounds(tdm_bench_dp *b)
{
    const tdm_bench_dp_args *g = b->g;
    for (int r = 0; r < g->rounds; r++) {
        int warm = r == 0 ? (int)g->warmup : 0;
        TDM_CHECK(tdm_bench_dp_run_single(b, warm + (int)g->steps, warm, b->t_single, &b->ks));
        TDM_CHECK(tdm_bench_dp_run_dp(b, warm + (int)g->steps, warm));
    }
    return TDM_STATUS_OK;
}

/* One device with --blas-threads T (OpenBLAS's count is process-wide: set
 * for this run only, back to 1 for the DP devices afterwards); reuses
 * t_single, whose median is taken already. */
static tdm_status tdm_bench_dp_blas(tdm_bench_dp *b, double *ms_blas)
{
    const tdm_bench_dp_args *g = b->g;
    int kb = 0;
    *ms_blas = 0.0;
    if (g->blas <= 0) return TDM_STATUS_OK;
    tdm_device_host_set_blas_threads((int)g->blas);
    tdm_status st = tdm_bench_dp_run_single(b, (int)(g->warmup + g->steps), (int)g->warmup,
                                            b->t_single, &kb);
    tdm_device_host_set_blas_threads(1);
    TDM_CHECK(st);
    *ms_blas = tdm_tool_median(b->t_single, kb);
    return TDM_STATUS_OK;
}

/* The throughput table, the speed-up and the machine's other load. */
static void tdm_bench_dp_print_throughput(const tdm_bench_dp *b, double ms_single, double ms_dp,
                                          double ms_blas, double other)
{
    const tdm_bench_dp_args *g = b->g;
    double sps_single = b->d.batch / (ms_single * 1e-3), sps_dp = b->d.batch / (ms_dp * 1e-3);
    char label[64];
    printf("\n%-22s %10s %12s\n", "mode", "step ms", "samples/s");
    snprintf(label, sizeof label, "single %s", tdm_dev_name(b->single_dev));
    printf("%-22s %10.2f %12.0f\n", label, ms_single, sps_single);
    snprintf(label, sizeof label, "DP %s", g->device);
    printf("%-22s %10.2f %12.0f\n", label, ms_dp, sps_dp);
    if (ms_blas > 0) {
        snprintf(label, sizeof label, "single, %d BLAS thr", (int)g->blas);
        printf("%-22s %10.2f %12.0f\n", label, ms_blas, b->d.batch / (ms_blas * 1e-3));
    }
    if (b->accel)
        printf("speed-up DP/single: %.2fx on %d devices\n", sps_dp / sps_single, b->n_dev);
    else
        printf("speed-up DP/single: %.2fx on %d devices (%d cores)\n", sps_dp / sps_single,
               b->n_dev, tdm_device_host_cores());
    if (other < 0)
        printf("other processes' use of the cores: not measurable (/proc/stat unreadable, or "
               "a run under %.2f s)\n", tdm_cmp_load_min_window());
    else
        printf("other processes used %.2f cores during the run%s\n", other,
               other >= TDM_CMP_BUSY_CORES
                   ? ": the machine was not quiet, DP figures are pessimistic" : "");
}

/* Where a DP step's time goes: mean over the measured steps. */
static void tdm_bench_dp_print_phases(const tdm_bench_dp *b)
{
    const tdm_dp_timings *sum = &b->sum;
    int kd = b->kd;
    printf("\nDP phases, mean ms per step (wall: the step's critical path; then each "
           "device's own work)\n%-10s %8s %6s", "phase", "wall", "share");
    for (int i = 0; i < b->n_dev; i++) printf(" %8s", tdm_dev_name(b->devs[i]));
    printf("\n");
    double accounted = 0.0;
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
        if (p == TDM_PHASE_ALLREDUCE_WAIT) continue;
        double wms = sum->wall.ms[p] / kd;
        accounted += wms;
        printf("%-10s %8.3f %5.1f%%", tdm_phase_name((tdm_phase)p), wms,
               100.0 * sum->wall.ms[p] / sum->step_ms);
        for (int i = 0; i < b->n_dev; i++) printf(" %8.3f", sum->device[i].ms[p] / kd);
        printf("\n");
    }
    if (b->accel) {
        accounted += b->sync_ms / kd;
        printf("%-10s %8.3f %5.1f%%\n", "sync", b->sync_ms / kd, 100.0 * b->sync_ms / sum->step_ms);
    }
    printf("%-10s %8.3f %5.1f%%\n", "other", sum->step_ms / kd - accounted,
           100.0 * (sum->step_ms / kd - accounted) / (sum->step_ms / kd));
    printf("%-10s %8.3f\n", "step", sum->step_ms / kd);
}

static tdm_status tdm_bench_dp_run(tdm_bench_dp *b)
{
    const tdm_bench_dp_args *g = b->g;
    TDM_CHECK(tdm_bench_dp_setup(b));
    tdm_bench_dp_print_header(b);
    tdm_cmp_load cpu0, cpu1;
    tdm_cmp_load_sample(&cpu0);
    TDM_CHECK(tdm_bench_dp_rounds(b));
    double ms_single = tdm_tool_median(b->t_single, b->ks);   /* t_single is reused below */
    double ms_blas;
    TDM_CHECK(tdm_bench_dp_blas(b, &ms_blas));
    tdm_cmp_load_sample(&cpu1);
    double other = tdm_cmp_load_other(&cpu0, &cpu1);
    double ms_dp = tdm_tool_median(b->t_dp, b->kd);
    tdm_bench_dp_print_throughput(b, ms_single, ms_dp, ms_blas, other);
    tdm_bench_dp_print_phases(b);
    double sps_single = b->d.batch / (ms_single * 1e-3), sps_dp = b->d.batch / (ms_dp * 1e-3);
    char oc[32] = "unknown";
    if (other >= 0) snprintf(oc, sizeof oc, "%.2f", other);
    printf("RESULT model=%s batch=%d devices=%s single_sps=%.0f dp_sps=%.0f speedup=%.3f "
           "other_cores=%s\n",
           g->model, b->d.batch, g->device, sps_single, sps_dp, sps_dp / sps_single, oc);
    return TDM_STATUS_OK;
}

int tdm_bench_dp_main(int argc, char **argv)
{
    tdm_bench_dp_args g = {.model = "mlp", .device = "cpu:2", .steps = 10, .warmup = 3,
                           .rounds = 2, .spin = -1, .seed = 1};
    tdm_status st = tdm_bench_dp_parse(argc, argv, &g);
    if (st == TDM_STATUS_OK && g.help) {
        tdm_bench_dp_usage(stdout);
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st) return tdm_tool_exit(st);
    tdm_bench_dp b = {.g = &g};
    if ((st = tdm_model_spec_parse(&b.ms, g.model)) != TDM_STATUS_OK)
        return tdm_tool_exit(tdm_bench_dp_fail("--model", tdm_tool_usage(st)));
    if (!g.batch) g.batch = b.ms.kind == TDM_MODEL_CNN ? 128 : 256;
    st = tdm_bench_dp_run(&b);
    tdm_bench_dp_free(&b);
    return tdm_tool_exit(st);
}
