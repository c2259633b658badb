/* tools/bench_models.c: `tandem bench gemm` (the single-core sgemm
 * ceiling at the shapes the models use) and `tandem bench train` (single
 * host device training throughput, as samples/s and as a fraction of that
 * ceiling). Figures for docs/PERFORMANCE.md; nothing here is a test. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/device.h"
#include "core/timer.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/tools.h"

static int tdm_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median seconds of `reps` calls of C(m,n) = A(m,k) B(k,n) (row-major, the
 * layers' own call) on one host device. */
static double tdm_bench_gemm_one(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                                 int reps)
{
    float *a = malloc((size_t)m * k * sizeof(float)), *b = malloc((size_t)k * n * sizeof(float));
    float *c = calloc((size_t)m * n, sizeof(float));
    double *t = malloc((size_t)reps * sizeof(double));
    for (size_t i = 0; i < (size_t)m * k; i++) a[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < (size_t)k * n; i++) b[i] = (float)(i % 5) * 0.1f;
    tdm_dev_gemm_rm(d, ta, tb, m, n, k, 1.0f, a, b, 0.0f, c); /* warm-up */
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = tdm_time_ns();
        tdm_dev_gemm_rm(d, ta, tb, m, n, k, 1.0f, a, b, 0.0f, c);
        t[r] = (double)(tdm_time_ns() - t0) * 1e-9;
    }
    qsort(t, (size_t)reps, sizeof *t, tdm_cmp_double);
    double med = t[reps / 2];
    free(a); free(b); free(c); free(t);
    return med;
}

/* The single-core ceiling: the best of the MLP's own gemm shapes. */
static double tdm_bench_gemm_ceiling(tdm_device *d, int verbose)
{
    static const struct { tdm_trans ta, tb; int m, n, k; const char *what; } shapes[] = {
        {TDM_TRANS_N, TDM_TRANS_T, 256, 1024, 784, "fc1 forward   (256x784)x(784x1024)"},
        {TDM_TRANS_N, TDM_TRANS_T, 256, 1024, 1024, "fc2 forward   (256x1024)x(1024x1024)"},
        {TDM_TRANS_T, TDM_TRANS_N, 1024, 1024, 256, "fc2 dW        (1024x256)x(256x1024)"},
        {TDM_TRANS_N, TDM_TRANS_N, 256, 1024, 1024, "fc2 dX        (256x1024)x(1024x1024)"},
        {TDM_TRANS_N, TDM_TRANS_N, 1024, 1024, 1024, "square 1024"},
    };
    double best = 0.0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        double s = tdm_bench_gemm_one(d, shapes[i].ta, shapes[i].tb, shapes[i].m, shapes[i].n,
                                      shapes[i].k, 15);
        double gf = 2.0 * shapes[i].m * shapes[i].n * shapes[i].k / s * 1e-9;
        if (verbose) printf("  %-40s %8.3f ms  %6.1f GFLOP/s\n", shapes[i].what, s * 1e3, gf);
        if (gf > best) best = gf;
    }
    return best;
}

static int tdm_bench_gemm(int argc, char **argv)
{
    long long threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if ((v = tdm_args_value(argc, argv, &i, "--threads"))) {
            if (!tdm_args_int("--threads", v, 1, 256, &threads)) return 2;
        } else if (!strcmp(argv[i], "--help")) {
            printf("usage: tandem bench gemm [--threads T]\n\nsgemm rate of one host device "
                   "at the MLP's shapes (median of 15 calls each).\n");
            return 0;
        } else {
            fprintf(stderr, "tandem bench gemm: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    tdm_device *d;
    if (tdm_device_open(&d, "cpu", 0, (int)threads) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem bench gemm: %s\n", tdm_error_message());
        return 1;
    }
    printf("sgemm on one host device, %lld BLAS thread%s (OpenBLAS %s)\n", threads,
           threads > 1 ? "s" : "", tdm_device_host_blas_info());
    double best = tdm_bench_gemm_ceiling(d, 1);
    printf("ceiling: %.1f GFLOP/s\n", best);
    tdm_device_free(d);
    return 0;
}

static void tdm_bench_nop_progress(void *ctx, int64_t s, int64_t n, double l, double sps)
{
    (void)ctx; (void)s; (void)n; (void)l; (void)sps;
}

typedef struct tdm_bench_step_ctx {
    tdm_single single;
    double *times;
    int64_t n;
    uint64_t last;
} tdm_bench_step_ctx;

static tdm_status tdm_bench_step(void *ctx, const float *x, const int32_t *y, int batch,
                                 double *loss)
{
    tdm_bench_step_ctx *c = ctx;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_single_step(&c->single, x, y, batch, loss);
    c->times[c->n++] = (double)(tdm_time_ns() - t0) * 1e-9;
    return st;
}

static int tdm_bench_train(int argc, char **argv)
{
    const char *model = "mlp";
    long long batch = 0, steps = 60, threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if ((v = tdm_args_value(argc, argv, &i, "--model"))) model = v;
        else if ((v = tdm_args_value(argc, argv, &i, "--batch"))) {
            if (!tdm_args_int("--batch", v, 1, 1 << 16, &batch)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--steps"))) {
            if (!tdm_args_int("--steps", v, 5, 100000, &steps)) return 2;
        } else if ((v = tdm_args_value(argc, argv, &i, "--threads"))) {
            if (!tdm_args_int("--threads", v, 1, 256, &threads)) return 2;
        } else if (!strcmp(argv[i], "--help")) {
            printf("usage: tandem bench train [--model mlp|cnn|mlp:...] [--batch B] [--steps S] "
                   "[--threads T]\n\nSingle host device training throughput on synthetic "
                   "data (median step after 5 warm-up steps),\nand the achieved gemm rate as a "
                   "fraction of the same device's sgemm ceiling.\nDefaults: batch 256 (mlp), 128 "
                   "(cnn); 60 steps.\n");
            return 0;
        } else {
            fprintf(stderr, "tandem bench train: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    tdm_model_spec spec;
    if (tdm_model_spec_parse(&spec, model) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem bench train: %s\n", tdm_error_message());
        return 2;
    }
    if (!batch) batch = spec.kind == TDM_MODEL_CNN ? 128 : 256;
    tdm_device *d = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dataset data = {0};
    int rc = 1;
    int c, h, w, classes;
    tdm_model_spec_sample_shape(&spec, &c, &h, &w, &classes);
    tdm_bench_step_ctx ctx = {0};
    tdm_epoch_stats es;
    if (tdm_device_open(&d, "cpu", 0, (int)threads) != TDM_STATUS_OK ||
        tdm_data_synthetic(&data, (batch * (steps + 5)), c, h, w, classes, 7, 0) != TDM_STATUS_OK ||
        tdm_model_init(&m, d, &spec, 1) != TDM_STATUS_OK ||
        tdm_sgd_init(&opt, m, 0.01f, 0.9f) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem bench train: %s\n", tdm_error_message());
        goto done;
    }
    ctx.single.model = m;
    ctx.single.opt = opt;
    ctx.times = calloc((size_t)steps + 5, sizeof(double));
    if (tdm_train_epoch(&data, (int)batch, 1, 0, 1, steps + 5, tdm_bench_step, &ctx,
                        tdm_bench_nop_progress, NULL, &es) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem bench train: %s\n", tdm_error_message());
        goto done;
    }
    double *t = ctx.times + 5;
    qsort(t, (size_t)steps, sizeof *t, tdm_cmp_double);
    double med = t[steps / 2];
    double fwd, bwd;
    tdm_model_gemm_flops(m, &fwd, &bwd);
    double gflops = (fwd + bwd) * (double)batch / med * 1e-9;
    double ceiling = tdm_bench_gemm_ceiling(d, 0);
    char desc[160];
    tdm_model_spec_describe(&spec, desc, sizeof desc);
    printf("model %s, batch %lld, one host device, %lld BLAS thread%s\n", desc, batch, threads,
           threads > 1 ? "s" : "");
    printf("  step: median %.2f ms (min %.2f, max %.2f) over %lld steps\n", med * 1e3, t[0] * 1e3,
           t[steps - 1] * 1e3, steps);
    printf("  throughput: %.0f samples/s\n", (double)batch / med);
    printf("  gemm work: %.2f MFLOP/sample -> %.1f GFLOP/s = %.0f%% of the %.1f GFLOP/s sgemm "
           "ceiling\n", (fwd + bwd) * 1e-6, gflops, 100.0 * gflops / ceiling, ceiling);
    printf("  phases of the last step (ms): forward %.2f, loss %.2f, backward %.2f, "
           "optimizer %.2f\n", ctx.single.ms[TDM_PHASE_FORWARD], ctx.single.ms[TDM_PHASE_LOSS],
           ctx.single.ms[TDM_PHASE_BACKWARD], ctx.single.ms[TDM_PHASE_STEP]);
    rc = 0;
done:
    free(ctx.times);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_data_free(&data);
    tdm_device_free(d);
    return rc;
}

int tdm_tool_bench_models_main(int argc, char **argv)
{
    /* argv[0] is "gemm" or "train" */
    if (!strcmp(argv[0], "gemm")) return tdm_bench_gemm(argc, argv);
    return tdm_bench_train(argc, argv);
}
