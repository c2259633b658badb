/* tools/bench_models.c: `tandem bench gemm` (the sgemm ceiling of one
 * device at the shapes the models use: one core's BLAS on the host,
 * cuBLAS with --device cuda:I) and `tandem bench train` (single-device
 * training throughput, as samples/s and as a fraction of that ceiling).
 * Figures for docs/PERFORMANCE.md; nothing here is a test. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/data.h"
#include "core/device.h"
#include "core/rng.h"
#include "core/timer.h"
#include "dist/run.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/bench.h"
#include "tools/devices.h"
#include "tools/stats.h"
#include "tools/tools.h"

/* Median seconds per call of C(m,n) = A(m,k) B(k,n) (row-major, the
 * layers' own call) on device d, over `reps` samples. Operands live on
 * the device; each sample ends with tdm_dev_sync, so on a GPU it is the
 * GPU's time. A GPU sample is 10 back-to-back calls (a call at these
 * shapes is tens of microseconds, close to the launch and sync latency);
 * elsewhere one call. */
static tdm_status tdm_bench_gemm_one(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n,
                                     int k, int reps, double *sec)
{
    tdm_status st = TDM_STATUS_OK;
    size_t a_bytes = (size_t)m * k * sizeof(float), b_bytes = (size_t)k * n * sizeof(float);
    size_t c_bytes = (size_t)m * n * sizeof(float);
    int per = tdm_dist_device_is_gpu(d) ? 10 : 1;
    float *ha = malloc(a_bytes), *hb = malloc(b_bytes), *a = NULL, *b = NULL, *c = NULL;
    double *t = malloc((size_t)reps * sizeof(double));
    if (!ha || !hb || !t) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "gemm %dx%dx%d: host buffers", m, n, k);
        goto fail;
    }
    for (size_t i = 0; i < (size_t)m * k; i++) ha[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < (size_t)k * n; i++) hb[i] = (float)(i % 5) * 0.1f;
    TDM_TRY(tdm_dev_alloc(d, a_bytes, (void **)&a));
    TDM_TRY(tdm_dev_alloc(d, b_bytes, (void **)&b));
    TDM_TRY(tdm_dev_alloc_zero(d, c_bytes, (void **)&c));
    TDM_TRY(tdm_dev_copy_from_host(d, a, ha, a_bytes));
    TDM_TRY(tdm_dev_copy_from_host(d, b, hb, b_bytes));
    TDM_TRY(tdm_dev_gemm_rm(d, ta, tb, m, n, k, 1.0f, a, b, 0.0f, c)); /* warm-up */
    TDM_TRY(tdm_dev_sync(d));
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = tdm_time_ns();
        for (int j = 0; j < per; j++)
            TDM_TRY(tdm_dev_gemm_rm(d, ta, tb, m, n, k, 1.0f, a, b, 0.0f, c));
        TDM_TRY(tdm_dev_sync(d));
        t[r] = (double)(tdm_time_ns() - t0) * 1e-9 / per;
    }
    *sec = tdm_tool_median(t, reps);
fail:
    tdm_dev_free(d, a);
    tdm_dev_free(d, b);
    tdm_dev_free(d, c);
    free(ha); free(hb); free(t);
    return st;
}

/* One row-major C(m,n) = op(A) op(B) the model computes, as its layer calls it. */
typedef struct tdm_bench_shape {
    tdm_trans ta, tb;
    int m, n, k;
    char what[64];
} tdm_bench_shape;
#define TDM_BENCH_SHAPES_MAX 8

/* The gemm shapes of a model: the default MLP's (784-1024-1024-10, batch
 * 256) for every model but a GPT; a GPT's linear layers at `batch`
 * windows (N = batch * T rows; weights (out, in) as nn.Linear's, so
 * forward is A B^T). The attention's batched products are not here. */
static int tdm_bench_gemm_shapes(const tdm_model_spec *spec, int batch, tdm_bench_shape *s)
{
    static const tdm_bench_shape mlp[] = {
        {TDM_TRANS_N, TDM_TRANS_T, 256, 1024, 784, "fc1 forward   (256x784)x(784x1024)"},
        {TDM_TRANS_N, TDM_TRANS_T, 256, 1024, 1024, "fc2 forward   (256x1024)x(1024x1024)"},
        {TDM_TRANS_T, TDM_TRANS_N, 1024, 1024, 256, "fc2 dW        (1024x256)x(256x1024)"},
        {TDM_TRANS_N, TDM_TRANS_N, 256, 1024, 1024, "fc2 dX        (256x1024)x(1024x1024)"},
        {TDM_TRANS_N, TDM_TRANS_N, 1024, 1024, 1024, "square 1024"},
    };
    if (spec->kind != TDM_MODEL_GPT) {
        memcpy(s, mlp, sizeof mlp);
        return (int)(sizeof mlp / sizeof mlp[0]);
    }
    int N = batch * spec->n_ctx, C = spec->n_embd, V = spec->vocab;
    const struct { tdm_trans ta, tb; int m, n, k; const char *what; } g[] = {
        {TDM_TRANS_N, TDM_TRANS_T, N, 3 * C, C, "c_attn forward"},
        {TDM_TRANS_N, TDM_TRANS_T, N, C, C, "attn.c_proj forward"},
        {TDM_TRANS_N, TDM_TRANS_T, N, 4 * C, C, "mlp.c_fc forward"},
        {TDM_TRANS_N, TDM_TRANS_T, N, C, 4 * C, "mlp.c_proj forward"},
        {TDM_TRANS_N, TDM_TRANS_T, N, V, C, "head forward"},
        {TDM_TRANS_T, TDM_TRANS_N, 4 * C, C, N, "mlp.c_fc dW"},
        {TDM_TRANS_N, TDM_TRANS_N, N, C, 4 * C, "mlp.c_fc dX"},
    };
    int n = (int)(sizeof g / sizeof g[0]);
    for (int i = 0; i < n; i++) {
        s[i] = (tdm_bench_shape){.ta = g[i].ta, .tb = g[i].tb, .m = g[i].m, .n = g[i].n,
                                 .k = g[i].k};
        snprintf(s[i].what, sizeof s[i].what, "%-19s (%dx%d)x(%dx%d)", g[i].what, g[i].m,
                 g[i].k, g[i].k, g[i].n);
    }
    return n;
}

/* The device's ceiling: the best of the model's own gemm shapes. */
static tdm_status tdm_bench_gemm_ceiling(tdm_device *d, const tdm_model_spec *spec, int batch,
                                         int verbose, double *best)
{
    tdm_bench_shape shapes[TDM_BENCH_SHAPES_MAX];
    int n = tdm_bench_gemm_shapes(spec, batch, shapes);
    *best = 0.0;
    for (int i = 0; i < n; i++) {
        double s = 0.0;
        TDM_CHECK(tdm_bench_gemm_one(d, shapes[i].ta, shapes[i].tb, shapes[i].m, shapes[i].n,
                                     shapes[i].k, 15, &s));
        double gf = 2.0 * shapes[i].m * shapes[i].n * shapes[i].k / s * 1e-9;
        if (verbose) printf("  %-40s %8.3f ms  %6.1f GFLOP/s\n", shapes[i].what, s * 1e3, gf);
        if (gf > *best) *best = gf;
    }
    return TDM_STATUS_OK;
}

/* --device of bench gemm and bench train: one device, host devices with
 * `threads` BLAS threads (--threads, refused elsewhere: cuBLAS has no
 * such knob). */
static tdm_status tdm_bench_open_device(const char *tool, const char *spec, long long threads,
                                        int threads_set, tdm_device **out)
{
    tdm_device_list dl;
    tdm_status st = tdm_tool_parse_one_device(&dl, spec);
    if (st) {
        fprintf(stderr, "tandem bench %s: --device: %s\n", tool, tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    int cuda = dl.kind == TDM_DEVICE_CUDA;
    if (dl.count != 1)
        return tdm_tool_usage_error("tandem bench %s: --device %s names %d devices; it runs on "
                                    "one (e.g. --device %s)\n", tool, spec, dl.count,
                                    cuda ? "cuda:0" : "cpu");
    if (cuda && threads_set)
        return tdm_tool_usage_error("tandem bench %s: --threads sets host BLAS threads; not "
                                    "with --device %s\n", tool, spec);
    if ((st = tdm_device_open(out, cuda ? "cuda" : "cpu", dl.index[0], (int)threads))) {
        fprintf(stderr, "tandem bench %s: --device %s: %s\n", tool, spec, tdm_error_message());
        return st;
    }
    return TDM_STATUS_OK;
}

/* "cuda:0 (cuBLAS, FP32)": what computes the gemm on a CUDA device. */
static void tdm_bench_cuda_what(const tdm_device *d, char *buf, size_t len)
{
    if (!tdm_dist_device_is_gpu(d))
        snprintf(buf, len, "%s (emulated: the host's gemm, not cuBLAS)", tdm_dev_name(d));
    else if (tdm_tool_device_tf32(d))
        snprintf(buf, len, "%s (cuBLAS, TF32 tensor cores: TANDEM_CUDA_TF32=1)", tdm_dev_name(d));
    else
        snprintf(buf, len, "%s (cuBLAS, full FP32)", tdm_dev_name(d));
}

/* ---- bench gemm ---- */

typedef struct tdm_bench_gemm_args {
    long long threads, batch;
    int threads_set, help;
    const char *device, *model;
} tdm_bench_gemm_args;

static tdm_status tdm_bench_gemm_parse(int argc, char **argv, tdm_bench_gemm_args *g)
{
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_STR("--model", g->model)
        TDM_ARGS_INT("--batch", 1, 1 << 16, g->batch)
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--threads", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("--threads", v, 1, 256, &g->threads));
            g->threads_set = 1;
            continue;
        }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--device", &v));
        if (v) {
            g->device = v;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            g->help = 1;
            return TDM_STATUS_OK;
        } else {
            return tdm_tool_usage_error("tandem bench gemm: unknown option '%s'\n", argv[i]);
        }
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_bench_gemm_run(tdm_bench_gemm_args *g)
{
    tdm_model_spec spec;
    if (tdm_model_spec_parse(&spec, g->model) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem bench gemm: %s\n", tdm_error_message());
    if (strcmp(g->model, "mlp") && spec.kind != TDM_MODEL_GPT)
        return tdm_tool_usage_error("tandem bench gemm: --model %s: the shapes are the default "
                                    "mlp's or a gpt's (--model mlp, gpt or gpt:L-D-H-T)\n",
                                    g->model);
    if (spec.kind != TDM_MODEL_GPT && g->batch)
        return tdm_tool_usage_error("tandem bench gemm: --batch sets a gpt's windows; the mlp's "
                                    "shapes are fixed (batch 256)\n");
    if (!g->batch) g->batch = 32;
    tdm_device *d;
    TDM_CHECK(tdm_bench_open_device("gemm", g->device, g->threads, g->threads_set, &d));
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
        printf("sgemm on one host device, %lld BLAS thread%s (OpenBLAS %s)\n", g->threads,
               g->threads > 1 ? "s" : "", tdm_device_host_blas_info());
    } else {
        char what[160];
        tdm_bench_cuda_what(d, what, sizeof what);
        printf("sgemm on %s\n", what);
        tdm_tool_print_emulated(stdout, g->device);
    }
    if (spec.kind == TDM_MODEL_GPT) {
        char desc[160];
        tdm_model_spec_describe(&spec, desc, sizeof desc);
        printf("shapes of %s, batch %lld windows\n", desc, g->batch);
    }
    double best;
    tdm_status st = tdm_bench_gemm_ceiling(d, &spec, (int)g->batch, 1, &best);
    if (st) fprintf(stderr, "tandem bench gemm: %s\n", tdm_error_message());
    else printf("ceiling: %.1f GFLOP/s\n", best);
    tdm_device_free(d);
    return st;
}

int tdm_bench_gemm_main(int argc, char **argv)
{
    tdm_bench_gemm_args g = {.threads = 1, .device = "cpu", .model = "mlp"};
    tdm_status st = tdm_bench_gemm_parse(argc, argv, &g);
    if (st == TDM_STATUS_OK && g.help) {
        printf("usage: tandem bench gemm [--device cpu|cuda|cuda:I] [--threads T]\n"
               "                        [--model mlp|gpt|gpt:L-D-H-T] [--batch B]\n\n"
               "sgemm rate of one device at a model's shapes (median of 15 samples each):\n"
               "the default MLP's, or a GPT's linear layers at B windows (default 32);\n"
               "a host device with T BLAS threads (default cpu, T = 1), or cuda:I through\n"
               "cuBLAS (cuda: GPU 0; operands in device memory; each sample is 10 calls\n"
               "ended by a sync, so the time is the GPU's; --threads is host only). With\n"
               "TANDEM_CUDA_EMULATOR=N, cuda:I is emulated: the host's gemm, not a GPU.\n");
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK) st = tdm_bench_gemm_run(&g);
    return tdm_tool_exit(st);
}

/* ---- bench train ---- */

static void tdm_bench_nop_progress(void *ctx, int64_t s, int64_t n, double l, double sps)
{
    (void)ctx; (void)s; (void)n; (void)l; (void)sps;
}

typedef struct tdm_bench_step_ctx {
    tdm_single single;
    double *times;
    double *cpu;            /* the step's CPU time on this thread (the device's only thread) */
    int64_t n;
    uint64_t last;
    double loss;            /* the last step's */
    tdm_dev_mem_stats mem;  /* the device's after the steps (before the gemm ceiling's) */
    int mem_counted;
} tdm_bench_step_ctx;

static tdm_status tdm_bench_step(void *ctx, const void *x, const int32_t *y, int batch,
                                 double *loss)
{
    tdm_bench_step_ctx *c = ctx;
    struct timespec c0, c1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_single_step(&c->single, x, y, batch, loss);
    c->times[c->n] = (double)(tdm_time_ns() - t0) * 1e-9;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    c->cpu[c->n++] = (double)(c1.tv_sec - c0.tv_sec) + (double)(c1.tv_nsec - c0.tv_nsec) * 1e-9;
    c->loss = *loss;
    return st;
}

/* steps single-device steps of a gpt on random bytes. */
static tdm_status tdm_bench_text_steps(tdm_model *m, int batch, int steps,
                                       tdm_bench_step_ctx *ctx)
{
    int64_t n = (int64_t)batch * tdm_model_in_features(m);
    int32_t *x = malloc((size_t)n * sizeof(int32_t)), *y = malloc((size_t)n * sizeof(int32_t));
    tdm_status st = TDM_STATUS_OK;
    if (!x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "a batch of %d windows", batch);
        goto fail;
    }
    tdm_rng r;
    tdm_rng_init(&r, 7, TDM_RNG_STREAM_DATA);
    for (int s = 0; s < steps; s++) {
        for (int64_t i = 0; i < n; i++) {
            x[i] = (int32_t)(tdm_rng_u32(&r) & 255);
            y[i] = (int32_t)(tdm_rng_u32(&r) & 255);
        }
        double loss;
        TDM_TRY(tdm_bench_step(ctx, x, y, batch, &loss));
    }
fail:
    free(x);
    free(y);
    return st;
}

typedef struct tdm_bench_train_args {
    const char *model, *device, *precision;
    long long batch, steps, threads, ckpt;
    int threads_set, help;
} tdm_bench_train_args;

static void tdm_bench_train_usage(void)
{
    printf("usage: tandem bench train [--model mlp|cnn|gpt|mlp:...|gpt:L-D-H-T|file:PATH]\n"
           "                         [--batch B] [--steps S]"
           " [--device cpu|cuda|cuda:I] [--threads T]\n"
           "                         [--precision fp32|bf16|fp16] [--checkpoint-activations N]\n\n"
           "Single-device training throughput on synthetic data (a gpt: random bytes,\n"
           "AdamW; the others: synthetic images, SGD) (median step after\n"
           "5 warm-up steps), and the achieved gemm rate as a fraction of the same\n"
           "device's sgemm ceiling (tandem bench gemm at the model's shapes: a gpt's\n"
           "own, the default mlp's for the others). The device is a host device\n"
           "with T BLAS threads (default cpu, T = 1) or cuda:I (cuda: GPU 0; inputs\n"
           "staged to the GPU each step, every step timed until the GPU has finished\n"
           "it; --threads is host only). With TANDEM_CUDA_EMULATOR=N, cuda:I is\n"
           "emulated on the host, not a GPU.\n"
           "--precision: the products' inputs and the kept activations in bf16 or fp16\n"
           "(float32 sums, master weights and optimizer; fp16 with dynamic loss scaling);\n"
           "--checkpoint-activations N: segments of N blocks keep only their input and\n"
           "are recomputed in backward (docs/MEMORY.md). The device's peak memory is\n"
           "printed where its allocator counts it (host and emulated devices).\n"
           "Defaults: batch 256 (mlp), 128 (cnn), 32 windows (gpt); 60 steps.\n");
}

static tdm_status tdm_bench_train_parse(int argc, char **argv, tdm_bench_train_args *t)
{
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_STR("--model", t->model)
        TDM_ARGS_STR("--device", t->device)
        TDM_ARGS_STR("--precision", t->precision)
        TDM_ARGS_INT("--checkpoint-activations", 0, 1 << 16, t->ckpt)
        TDM_ARGS_INT("--batch", 1, 1 << 16, t->batch)
        TDM_ARGS_INT("--steps", 5, 100000, t->steps)
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--threads", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("--threads", v, 1, 256, &t->threads));
            t->threads_set = 1;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            t->help = 1;
            return TDM_STATUS_OK;
        } else {
            return tdm_tool_usage_error("tandem bench train: unknown option '%s'\n", argv[i]);
        }
    }
    return TDM_STATUS_OK;
}

/* The steps of a run: steps + 5 (the warm-up) single-device steps, each
 * timed into ctx->times. */
static tdm_status tdm_bench_train_steps(const tdm_bench_train_args *t,
                                        const tdm_model_spec *spec, tdm_model *m,
                                        tdm_bench_step_ctx *ctx)
{
    if (spec->kind == TDM_MODEL_GPT)
        return tdm_bench_text_steps(m, (int)t->batch, (int)t->steps + 5, ctx);
    /* the image models train with SGD on synthetic images */
    int c, h, w, classes;
    tdm_model_spec_sample_shape(spec, &c, &h, &w, &classes);
    tdm_dataset data = {0};
    tdm_epoch_stats es;
    TDM_CHECK(tdm_data_synthetic(&data, (t->batch * (t->steps + 5)), c, h, w, classes, 7, 0));
    tdm_train_epoch_opts o = {.batch = (int)t->batch, .seed = 1, .drop_last = 1,
                              .max_steps = t->steps + 5, .step = tdm_bench_step,
                              .step_ctx = ctx, .progress = tdm_bench_nop_progress};
    tdm_status st = tdm_train_epoch(&data, &o, &es);
    tdm_data_free(&data);
    return st;
}

/* The model's parameters, counted as PyTorch counts them (the flat
 * buffer, tdm_model_param_elems, also holds each tensor's alignment
 * padding). */
static long long tdm_bench_param_count(const tdm_model *m)
{
    long long n = 0;
    for (int i = 0; i < tdm_model_n_params(m); i++) n += tdm_model_param_info(m, i)->n_elem;
    return n;
}

static void tdm_bench_train_print(const tdm_bench_train_args *t, const tdm_model_spec *spec,
                                  tdm_device *d, tdm_model *m, const tdm_bench_step_ctx *ctx,
                                  double ceiling)
{
    tdm_model_memory mm;
    double *times = ctx->times + 5;
    double med = tdm_tool_median(times, (int)t->steps);   /* sorts times */
    double fwd, bwd;
    tdm_model_gemm_flops(m, &fwd, &bwd);
    double gflops = (fwd + bwd) * (double)t->batch / med * 1e-9;
    char desc[160];
    tdm_model_spec_describe(spec, desc, sizeof desc);
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
        printf("model %s (%lld parameters), batch %lld, one host device, %lld BLAS thread%s\n",
               desc, tdm_bench_param_count(m), t->batch, t->threads,
               t->threads > 1 ? "s" : "");
    } else {
        char what[160];
        tdm_bench_cuda_what(d, what, sizeof what);
        printf("model %s (%lld parameters), batch %lld, one device: %s\n", desc,
               tdm_bench_param_count(m), t->batch, what);
        tdm_tool_print_emulated(stdout, t->device);
    }
    printf("  step: median %.2f ms (min %.2f, max %.2f) over %lld steps\n", med * 1e3,
           times[0] * 1e3, times[t->steps - 1] * 1e3, t->steps);
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST && t->threads == 1) {
        /* a host device computes on this thread alone: its CPU time is the
         * step's work, whatever else the machine runs at the same time */
        double cmed = tdm_tool_median(ctx->cpu + 5, (int)t->steps);
        printf("  step CPU time (this thread): median %.2f ms", cmed * 1e3);
        if (spec->kind == TDM_MODEL_GPT)
            printf(" = %.0f tokens per CPU second", (double)t->batch * spec->n_ctx / cmed);
        printf("\n");
    }
    if (spec->kind == TDM_MODEL_GPT)
        printf("  throughput: %.0f windows/s = %.0f tokens/s\n", (double)t->batch / med,
               (double)t->batch * spec->n_ctx / med);
    else
        printf("  throughput: %.0f samples/s\n", (double)t->batch / med);
    printf("  gemm work: %.2f MFLOP/sample -> %.1f GFLOP/s = %.0f%% of the %.1f GFLOP/s sgemm "
           "ceiling\n", (fwd + bwd) * 1e-6, gflops, 100.0 * gflops / ceiling, ceiling);
    printf("  phases of the last step (ms): forward %.2f, loss %.2f, backward %.2f, "
           "optimizer %.2f\n", ctx->single.ms[TDM_PHASE_FORWARD], ctx->single.ms[TDM_PHASE_LOSS],
           ctx->single.ms[TDM_PHASE_BACKWARD], ctx->single.ms[TDM_PHASE_STEP]);
    tdm_model_get_memory(m, &mm);
    printf("  precision %s, activation checkpointing %s", tdm_precision_name(tdm_model_precision(m)),
           t->ckpt ? "on" : "off");
    if (t->ckpt) printf(" (segments of %lld block%s)", t->ckpt, t->ckpt > 1 ? "s" : "");
    printf("\n  memory: activations %.2f MiB (the model's own count)", mm.activations / 1048576.0);
    if (ctx->mem_counted)
        printf(", device peak %.2f MiB (allocator)", ctx->mem.peak_bytes / 1048576.0);
    printf("\n  loss of the last step %.4f\n", ctx->loss);
    if (ctx->single.scaler)
        printf("  loss scale %g after the run (%lld step%s skipped)\n",
               (double)ctx->single.scaler->scale, (long long)ctx->single.scaler->skipped,
               ctx->single.scaler->skipped == 1 ? "" : "s");
}

static tdm_status tdm_bench_train_run(tdm_bench_train_args *t)
{
    tdm_model_spec spec;
    if (tdm_model_spec_parse(&spec, t->model) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem bench train: %s\n", tdm_error_message());
    int gpt = spec.kind == TDM_MODEL_GPT;
    if (!t->batch) t->batch = spec.kind == TDM_MODEL_CNN ? 128 : gpt ? 32 : 256;
    tdm_device *d = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_bench_step_ctx ctx = {0};
    tdm_grad_scaler scaler;
    tdm_precision prec = TDM_PRECISION_FP32;
    tdm_optim_opts adamw;
    tdm_optim_opts_default(&adamw, TDM_OPTIM_ADAMW);
    tdm_status st = TDM_STATUS_OK;
    if (t->precision && tdm_precision_parse(t->precision, &prec) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem bench train: --precision: %s\n", tdm_error_message());
    TDM_CHECK(tdm_bench_open_device("train", t->device, t->threads, t->threads_set, &d));
    /* a gpt trains with AdamW on random bytes (speed does not depend on
     * the text); the image models with SGD on synthetic images */
    TDM_TRY(tdm_model_init(&m, d, &spec, 1));
    TDM_TRY(tdm_model_set_precision(m, prec));
    TDM_TRY(tdm_model_set_checkpoint(m, (int)t->ckpt));
    TDM_TRY(gpt ? tdm_optim_init(&opt, m, &adamw) : tdm_sgd_init(&opt, m, 0.01f, 0.9f));
    ctx.single.model = m;
    ctx.single.opt = opt;
    if (prec == TDM_PRECISION_FP16) {
        TDM_TRY(tdm_grad_scaler_init(&scaler, NULL));
        ctx.single.scaler = &scaler;
    }
    ctx.times = calloc((size_t)t->steps + 5, sizeof(double));
    ctx.cpu = calloc((size_t)t->steps + 5, sizeof(double));
    if (!ctx.times || !ctx.cpu) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "out of memory");
        goto fail;
    }
    TDM_TRY(tdm_bench_train_steps(t, &spec, m, &ctx));
    ctx.mem_counted = tdm_dev_mem_query(d, &ctx.mem) == TDM_STATUS_OK;
    double ceiling;
    TDM_TRY(tdm_bench_gemm_ceiling(d, &spec, (int)t->batch, 0, &ceiling));
    tdm_bench_train_print(t, &spec, d, m, &ctx, ceiling);
fail:
    if (st) fprintf(stderr, "tandem bench train: %s\n", tdm_error_message());
    free(ctx.times);
    free(ctx.cpu);
    tdm_single_free(&ctx.single);   /* its staging, on the model's device */
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(d);
    return st;
}

int tdm_bench_train_main(int argc, char **argv)
{
    tdm_bench_train_args t = {.model = "mlp", .device = "cpu", .steps = 60, .threads = 1};
    tdm_status st = tdm_bench_train_parse(argc, argv, &t);
    if (st == TDM_STATUS_OK && t.help) {
        tdm_bench_train_usage();
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK) st = tdm_bench_train_run(&t);
    return tdm_tool_exit(st);
}
