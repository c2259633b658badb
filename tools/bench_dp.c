/* tools/bench_dp.c: `tandem bench dp`: training throughput of one device
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
#include "core/device_impl.h" /* to be converted to tdm_dev_* (issue 12) */
#include "core/timer.h"
#include "dp/dp.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/devices.h"
#include "tools/stats.h"

int tdm_tool_bench_dp_main(int argc, char **argv);

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
        "  --model NAME     mlp (784-1024-1024-10), mlp:W0-..-Wn, cnn        [mlp]\n"
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

/* CPU time the whole machine spent busy (/proc/stat, clock ticks) and
 * this process's own (getrusage): their difference over a run is what
 * other processes took, which a DP figure on a shared machine needs next
 * to it (a DP step needs all its cores at once). */
typedef struct tdm_bench_dp_cpu {
    double busy_s, self_s, wall_s;
} tdm_bench_dp_cpu;

static void tdm_bench_dp_cpu_sample(tdm_bench_dp_cpu *c)
{
    memset(c, 0, sizeof *c);
    c->wall_s = (double)tdm_time_ns() * 1e-9;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        c->self_s = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
                    (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return;
    unsigned long long v[8] = {0};
    if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
               &v[4], &v[5], &v[6], &v[7]) == 8) {
        /* user nice system idle iowait irq softirq steal: all but idle, iowait */
        double ticks = (double)sysconf(_SC_CLK_TCK);
        c->busy_s = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / ticks;
    }
    fclose(f);
}

/* Cores' worth of CPU that other processes used between a and b. */
static double tdm_bench_dp_other_cores(const tdm_bench_dp_cpu *a, const tdm_bench_dp_cpu *b)
{
    double wall = b->wall_s - a->wall_s;
    if (wall <= 0) return 0.0;
    double other = (b->busy_s - a->busy_s) - (b->self_s - a->self_s);
    return other > 0 ? other / wall : 0.0;
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
    if (tdm_model_device(s->model)->kind != TDM_DEVICE_HOST)
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

static int tdm_bench_dp_fail(const char *what, tdm_status st)
{
    fprintf(stderr, "tandem bench dp: %s: %s\n", what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return 1;
}

int tdm_tool_bench_dp_main(int argc, char **argv)
{
    const char *model_name = "mlp", *spec = "cpu:2";
    long long batch = 0, steps = 10, warmup = 3, rounds = 2, spin = -1, seed = 1, blas = 0;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tdm_bench_dp_usage(stdout);
            return 0;
        } else if ((v = tdm_args_value(argc, argv, &i, "--model"))) {
            model_name = v;
        } else if ((v = tdm_args_value(argc, argv, &i, "--device"))) {
            spec = v;
        } else if ((v = tdm_args_value(argc, argv, &i, "--batch"))) {
            if (!tdm_args_int("--batch", v, 1, 1 << 20, &batch)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--steps"))) {
            if (!tdm_args_int("--steps", v, 1, 100000, &steps)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--warmup"))) {
            if (!tdm_args_int("--warmup", v, 0, 100000, &warmup)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--rounds"))) {
            if (!tdm_args_int("--rounds", v, 1, 1000, &rounds)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--spin-us"))) {
            if (!tdm_args_int("--spin-us", v, -1, 1000000, &spin)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--blas-threads"))) {
            if (!tdm_args_int("--blas-threads", v, 0, 64, &blas)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--seed"))) {
            if (!tdm_args_int("--seed", v, 0, INT64_MAX, &seed)) return 2;
        } else {
            fprintf(stderr, "tandem bench dp: unknown option '%s'\n", argv[i]);
            tdm_bench_dp_usage(stderr);
            return 2;
        }
    }

    tdm_status st = TDM_STATUS_OK;
    int rc = 1, n_dev = 0;
    tdm_model_spec ms;
    tdm_device *single_dev = NULL, *own_single = NULL, *devs[TDM_DP_MAX_DEVICES];
    tdm_model *single = NULL, *master = NULL;
    tdm_optim *single_opt = NULL, *dp_opt = NULL;
    tdm_dp *dp = NULL;
    tdm_dataset ds = {0};
    double *t_single = NULL, *t_dp = NULL, sync_ms = 0.0;
    tdm_single single_step = {0};
    tdm_dp_timings sum;
    memset(&sum, 0, sizeof sum);

    if ((st = tdm_model_spec_parse(&ms, model_name)) != TDM_STATUS_OK) {
        tdm_bench_dp_fail("--model", st);
        return 2;
    }
    if (!batch) batch = ms.kind == TDM_MODEL_CNN ? 128 : 256;
    if ((st = tdm_dp_devices_open(spec, devs, &n_dev)) != TDM_STATUS_OK) {
        tdm_bench_dp_fail("--device", st);
        return st == TDM_STATUS_INVALID_ARG ? 2 : 1;
    }
    int accel = devs[0]->kind != TDM_DEVICE_HOST;
    if (accel && blas > 0) {
        fprintf(stderr, "tandem bench dp: --blas-threads applies to host devices only, not to "
                "--device %s\n", spec);
        rc = 2;
        goto done;
    }
    if (accel) {
        /* the baseline: the first listed GPU, shared with the DP master */
        single_dev = devs[0];
    } else {
        /* the baseline: one host device, single-threaded BLAS like each DP device */
        if ((st = tdm_device_open(&own_single, "cpu", 0, 1)) != TDM_STATUS_OK) {
            tdm_bench_dp_fail("opening cpu:0", st);
            goto done;
        }
        single_dev = own_single;
    }
    if ((st = tdm_model_init(&single, single_dev, &ms, (uint64_t)seed)) != TDM_STATUS_OK ||
        (st = tdm_model_init(&master, devs[0], &ms, (uint64_t)seed)) != TDM_STATUS_OK) {
        tdm_bench_dp_fail("building the model", st);
        goto done;
    }
    tdm_model_set_train(single, 1);
    tdm_model_set_train(master, 1);
    if ((st = tdm_sgd_init(&single_opt, single, 0.01f, 0.9f)) != TDM_STATUS_OK ||
        (st = tdm_sgd_init(&dp_opt, master, 0.01f, 0.9f)) != TDM_STATUS_OK) {
        tdm_bench_dp_fail("optimizer", st);
        goto done;
    }
    single_step.model = single;
    single_step.opt = single_opt;
    tdm_dp_opts o;
    tdm_dp_opts_default(&o);
    o.spin_us = (int)spin;
    if ((st = tdm_dp_init(&dp, master, devs, n_dev, &o)) != TDM_STATUS_OK) {
        tdm_bench_dp_fail("DataParallel", st);
        goto done;
    }

    /* a few distinct batches, cycled */
    tdm_bench_dp_data d = {.batch = (int)batch, .n_batches = 4,
                           .features = tdm_model_in_features(master)};
    int c, h, w, classes;
    tdm_model_spec_sample_shape(&ms, &c, &h, &w, &classes);
    if ((st = tdm_data_synthetic(&ds, (int64_t)d.batch * d.n_batches, c, h, w, classes,
                                 (uint64_t)seed, 0)) != TDM_STATUS_OK) {
        tdm_bench_dp_fail("synthetic data", st);
        goto done;
    }
    d.x = ds.x;
    d.y = ds.y;

    int per_mode = (int)(steps * rounds);
    t_single = calloc((size_t)per_mode, sizeof(double));
    t_dp = calloc((size_t)per_mode, sizeof(double));
    if (!t_single || !t_dp) {
        fprintf(stderr, "tandem bench dp: out of memory\n");
        goto done;
    }
    char desc[128];
    tdm_model_spec_describe(&ms, desc, sizeof desc);
    if (accel) {
        char names[256] = "";
        for (int i = 0, used = 0; i < n_dev && used < (int)sizeof names; i++) {
            int k = snprintf(names + used, sizeof names - (size_t)used, "%s%s", i ? "," : "",
                             devs[i]->name);
            if (k < 0) break;
            used += k;
        }
        printf("bench dp: %s, batch %d, single %s vs DP on %s (%d device%s: %s), replicate and "
               "reduce %s\n", desc, d.batch, single_dev->name, spec, n_dev, n_dev > 1 ? "s" : "",
               names, !tdm_dp_uses_device_group(dp) ? "staged through the host"
                      : tdm_tool_cuda_emulated() ? "through the emulated device group"
                                                 : "through the device group (NCCL)");
        tdm_tool_print_emulated(stdout, spec);
    } else {
        printf("bench dp: %s, batch %d, single cpu:0 vs DP on %s (%d devices), %d host cores, "
               "%s\n", desc, d.batch, spec, n_dev, tdm_device_host_cores(),
               tdm_device_host_blas_info());
    }
    printf("bench dp: %d warm-up + %d measured steps per mode, alternated over %d rounds\n",
           (int)warmup, (int)steps, (int)rounds);

    int k = 0, ks = 0, kd = 0;
    tdm_bench_dp_cpu cpu0, cpu1;
    tdm_bench_dp_cpu_sample(&cpu0);
    for (int r = 0; r < rounds; r++) {
        for (int s = 0; s < (r == 0 ? warmup : 0) + steps; s++, k++) {
            const float *x;
            const int32_t *y;
            tdm_bench_dp_batch(&d, k, &x, &y);
            uint64_t t0 = tdm_time_ns();
            if ((st = tdm_bench_dp_single_step(&single_step, x, y, d.batch)) != TDM_STATUS_OK) {
                tdm_bench_dp_fail("single-device step", st);
                goto done;
            }
            if (r > 0 || s >= warmup) t_single[ks++] = tdm_time_ms_since(t0);
        }
        for (int s = 0; s < (r == 0 ? warmup : 0) + steps; s++, k++) {
            const float *x;
            const int32_t *y;
            tdm_bench_dp_batch(&d, k, &x, &y);
            double loss;
            if ((st = tdm_dp_step(dp, dp_opt, x, y, d.batch, &loss)) != TDM_STATUS_OK) {
                tdm_bench_dp_fail("DP step", st);
                goto done;
            }
            /* tdm_dp_step waits for the master's update on an accelerator;
             * anything still queued on another GPU is counted here, so
             * the step ends when every device has finished. */
            uint64_t t_sync = tdm_time_ns();
            for (int i = 0; accel && i < n_dev; i++)
                if ((st = tdm_dev_sync(devs[i])) != TDM_STATUS_OK) {
                    tdm_bench_dp_fail("DP step", st);
                    goto done;
                }
            double synced = accel ? tdm_time_ms_since(t_sync) : 0.0;
            if (r > 0 || s >= warmup) {
                const tdm_dp_timings *t = tdm_dp_last_timings(dp);
                t_dp[kd++] = t->step_ms + synced;
                sync_ms += synced;
                for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
                    sum.wall.ms[p] += t->wall.ms[p];
                    for (int i = 0; i < n_dev; i++) sum.device[i].ms[p] += t->device[i].ms[p];
                }
                sum.step_ms += t->step_ms + synced;
            }
        }
    }
    double ms_single = tdm_tool_median(t_single, ks);   /* t_single is reused below */
    /* one device, T BLAS threads (OpenBLAS's count is process-wide: set it
     * for this run only, back to 1 for the DP devices afterwards) */
    double ms_blas = 0.0;
    if (blas > 0) {
        tdm_device_host_set_blas_threads((int)blas);
        int kb = 0;
        for (int s = 0; s < warmup + steps; s++, k++) {
            const float *x;
            const int32_t *y;
            tdm_bench_dp_batch(&d, k, &x, &y);
            uint64_t t0 = tdm_time_ns();
            if ((st = tdm_bench_dp_single_step(&single_step, x, y, d.batch)) != TDM_STATUS_OK) {
                tdm_device_host_set_blas_threads(1);
                tdm_bench_dp_fail("single-device step", st);
                goto done;
            }
            if (s >= warmup) t_single[kb++] = tdm_time_ms_since(t0);
        }
        tdm_device_host_set_blas_threads(1);
        ms_blas = tdm_tool_median(t_single, kb);
    }
    tdm_bench_dp_cpu_sample(&cpu1);
    double other = tdm_bench_dp_other_cores(&cpu0, &cpu1);
    double ms_dp = tdm_tool_median(t_dp, kd);
    double sps_single = d.batch / (ms_single * 1e-3), sps_dp = d.batch / (ms_dp * 1e-3);
    char label[64];
    printf("\n%-22s %10s %12s\n", "mode", "step ms", "samples/s");
    snprintf(label, sizeof label, "single %s", single_dev->name);
    printf("%-22s %10.2f %12.0f\n", label, ms_single, sps_single);
    snprintf(label, sizeof label, "DP %s", spec);
    printf("%-22s %10.2f %12.0f\n", label, ms_dp, sps_dp);
    if (ms_blas > 0) {
        snprintf(label, sizeof label, "single, %d BLAS thr", (int)blas);
        printf("%-22s %10.2f %12.0f\n", label, ms_blas, d.batch / (ms_blas * 1e-3));
    }
    if (accel)
        printf("speed-up DP/single: %.2fx on %d devices\n", sps_dp / sps_single, n_dev);
    else
        printf("speed-up DP/single: %.2fx on %d devices (%d cores)\n", sps_dp / sps_single,
               n_dev, tdm_device_host_cores());
    printf("other processes used %.2f cores during the run%s\n", other,
           other > 0.2 ? ": the machine was not quiet, DP figures are pessimistic" : "");

    /* where a DP step's time goes: mean over the measured steps */
    printf("\nDP phases, mean ms per step (wall: the step's critical path; then each "
           "device's own work)\n%-10s %8s %6s", "phase", "wall", "share");
    for (int i = 0; i < n_dev; i++) printf(" %8s", devs[i]->name);
    printf("\n");
    double accounted = 0.0;
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
        if (p == TDM_PHASE_ALLREDUCE_WAIT) continue;
        double wms = sum.wall.ms[p] / kd;
        accounted += wms;
        printf("%-10s %8.3f %5.1f%%", tdm_phase_name((tdm_phase)p), wms,
               100.0 * sum.wall.ms[p] / sum.step_ms);
        for (int i = 0; i < n_dev; i++) printf(" %8.3f", sum.device[i].ms[p] / kd);
        printf("\n");
    }
    if (accel) {
        accounted += sync_ms / kd;
        printf("%-10s %8.3f %5.1f%%\n", "sync", sync_ms / kd, 100.0 * sync_ms / sum.step_ms);
    }
    printf("%-10s %8.3f %5.1f%%\n", "other", sum.step_ms / kd - accounted,
           100.0 * (sum.step_ms / kd - accounted) / (sum.step_ms / kd));
    printf("%-10s %8.3f\n", "step", sum.step_ms / kd);
    printf("RESULT model=%s batch=%d devices=%s single_sps=%.0f dp_sps=%.0f speedup=%.3f "
           "other_cores=%.2f\n",
           model_name, d.batch, spec, sps_single, sps_dp, sps_dp / sps_single, other);
    rc = 0;
done:
    free(t_single);
    free(t_dp);
    tdm_data_free(&ds);
    tdm_dp_free(dp);
    tdm_single_free(&single_step);   /* its staging, on the model's device */
    tdm_optim_free(single_opt);
    tdm_optim_free(dp_opt);
    tdm_model_free(single);
    tdm_model_free(master);
    tdm_device_free(own_single);
    tdm_dp_devices_close(devs, n_dev);
    return rc;
}
