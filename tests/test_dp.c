/* tests/test_dp.c: DataParallel (dp/) against one device.
 *
 * - scatter sizes: torch.chunk's split, explicit sizes validated;
 * - scatter/gather round trips;
 * - equivalence: for 1..4 devices and batches that do and do not divide
 *   (and smaller than the device count), one DP step gives the loss,
 *   gradients and updated parameters of one single-device step over the
 *   same global batch; 50-step loss curves agree;
 * - batchnorm: PyTorch DP's semantics (per-chunk statistics, running
 *   statistics from the master's chunk);
 * - parallel_apply: errors named "replica i on device cpu:i: ...", after
 *   every thread stopped, pool usable afterwards; many calls, none lost;
 * - bad use refused with a message.
 *
 * Tolerance (MLP): DP computes the same sums as one device, grouped
 * differently: each gradient is a sum of per-chunk gemms plus the reduce,
 * instead of one gemm over the batch, so only the association of float
 * additions changes. We require |dp - ref| <= 1e-5 + 1e-4 |ref| element-wise
 * for gradients, parameters and loss. Measured on this machine (OpenBLAS,
 * 20-16-10, batches up to 13): max |diff| ~1e-8 on gradients of size
 * ~1e-1, i.e. about 10x float epsilon, so the bound has a margin of >100x
 * while a wrong scale (say 1/chunk instead of 1/B) or a missing replica
 * (differences of order |ref|) fails it. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/rng.h"
#include "dp/dp.h"
#include "dp/pool.h"
#include "models/model.h"
#include "models/optim.h"
#include "tests/test_util.h"

#define ATOL 1e-5
#define RTOL 1e-4

/* ---- helpers ---- */

typedef struct devs {
    tdm_device *d[TDM_DP_MAX_DEVICES];
    int n;
} devs;

static void open_devs(devs *v, int n)
{
    char spec[32];
    snprintf(spec, sizeof spec, "cpu:%d", n);
    cr_assert_eq(tdm_dp_devices_open(spec, v->d, &v->n), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(v->n, n);
}

static void close_devs(devs *v) { tdm_dp_devices_close(v->d, v->n); }

static void make_data(float *x, int32_t *y, int batch, int features, int classes, uint64_t seed)
{
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_TEST);
    for (int64_t i = 0; i < (int64_t)batch * features; i++) x[i] = tdm_rng_normal(&r);
    for (int i = 0; i < batch; i++) y[i] = (int32_t)tdm_rng_below(&r, (uint64_t)classes);
}

/* max over i of |a-b| / (ATOL + RTOL |ref|): <= 1 passes; *max_abs the max |a-b| */
static double tol_ratio(const float *a, const float *ref, int64_t n, double *max_abs)
{
    return tu_tol_ratio(a, ref, n, ATOL, RTOL, NULL, max_abs);
}

static const int MLP_DIMS[] = {20, 16, 10};

/* Measured figures, printed with TDM_TEST_VERBOSE=1. */
static void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char *fmt, ...)
{
    if (!getenv("TDM_TEST_VERBOSE")) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* ---- scatter sizes ---- */

static void expect_sizes(int batch, int n, const int *want, int want_chunks)
{
    int sizes[TDM_DP_MAX_DEVICES], chunks = -1;
    cr_assert_eq(tdm_dp_scatter_sizes(batch, n, NULL, sizes, &chunks), TDM_STATUS_OK);
    cr_assert_eq(chunks, want_chunks, "N=%d n=%d: %d chunks, want %d", batch, n, chunks,
                 want_chunks);
    for (int i = 0; i < n; i++)
        cr_assert_eq(sizes[i], want[i], "N=%d n=%d: chunk %d has %d rows, want %d", batch, n, i,
                     sizes[i], want[i]);
}

Test(dp_scatter, torch_chunk_cases)
{
    expect_sizes(10, 4, (int[]){3, 3, 3, 1}, 4);
    expect_sizes(2, 4, (int[]){1, 1, 0, 0}, 2);
    expect_sizes(7, 3, (int[]){3, 3, 1}, 3);
    expect_sizes(9, 4, (int[]){3, 3, 3, 0}, 3);   /* torch.chunk(9 rows, 4) -> 3 chunks */
    expect_sizes(8, 4, (int[]){2, 2, 2, 2}, 4);
    expect_sizes(1, 4, (int[]){1, 0, 0, 0}, 1);
    expect_sizes(5, 1, (int[]){5}, 1);
    expect_sizes(6, 4, (int[]){2, 2, 2, 0}, 3);
    expect_sizes(256, 3, (int[]){86, 86, 84}, 3);
}

Test(dp_scatter, torch_chunk_formula)
{
    /* size = ceil(N/n), chunks = ceil(N/size), all full but the last */
    for (int n = 1; n <= 8; n++) {
        for (int batch = 1; batch <= 70; batch++) {
            int sizes[TDM_DP_MAX_DEVICES], chunks;
            cr_assert_eq(tdm_dp_scatter_sizes(batch, n, NULL, sizes, &chunks), TDM_STATUS_OK);
            int size = (batch + n - 1) / n, want_chunks = (batch + size - 1) / size, sum = 0;
            cr_assert_eq(chunks, want_chunks);
            for (int i = 0; i < n; i++) {
                int want = i < want_chunks - 1 ? size
                           : i == want_chunks - 1 ? batch - size * (want_chunks - 1) : 0;
                cr_assert_eq(sizes[i], want, "N=%d n=%d i=%d", batch, n, i);
                sum += sizes[i];
            }
            cr_assert_eq(sum, batch);
        }
    }
}

Test(dp_scatter, explicit_sizes)
{
    int sizes[4], chunks;
    cr_assert_eq(tdm_dp_scatter_sizes(10, 4, (int[]){1, 0, 5, 4}, sizes, &chunks), TDM_STATUS_OK);
    cr_assert_eq(chunks, 3);
    cr_assert(sizes[0] == 1 && sizes[1] == 0 && sizes[2] == 5 && sizes[3] == 4);
    cr_assert_eq(tdm_dp_scatter_sizes(10, 4, (int[]){1, 0, 5, 5}, sizes, &chunks),
                 TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "sum to 11"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dp_scatter_sizes(10, 4, (int[]){6, -1, 5, 0}, sizes, &chunks),
                 TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "negative"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dp_scatter_sizes(0, 4, NULL, sizes, &chunks), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "batch 0"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dp_scatter_sizes(4, 0, NULL, sizes, &chunks), TDM_STATUS_INVALID_ARG);
}

/* ---- scatter / gather ---- */

Test(dp_ops, scatter_gather_round_trip)
{
    devs v;
    open_devs(&v, 3);
    tdm_model *m;
    cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 1), TDM_STATUS_OK);
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    enum { B = 11, F = 5 };
    float x[B * F], back[B * F];
    for (int i = 0; i < B * F; i++) x[i] = (float)i;
    const int *cases[] = {NULL, (int[]){0, 11, 0}, (int[]){4, 0, 7}};
    for (int c = 0; c < 3; c++) {
        int sizes[3];
        cr_assert_eq(tdm_dp_scatter_sizes(B, 3, cases[c], sizes, NULL), TDM_STATUS_OK);
        float *chunks[3];
        for (int i = 0; i < 3; i++) chunks[i] = calloc(B * F, sizeof(float));
        cr_assert_eq(tdm_dp_scatter(dp, NULL, x, B, F, sizes, chunks), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        int off = 0;
        for (int i = 0; i < 3; i++) {
            for (int k = 0; k < sizes[i] * F; k++) cr_assert_eq(chunks[i][k], x[off * F + k]);
            off += sizes[i];
        }
        memset(back, 0, sizeof back);
        cr_assert_eq(tdm_dp_gather(dp, (const float *const *)chunks, sizes, F, back),
                     TDM_STATUS_OK);
        cr_assert_eq(memcmp(back, x, sizeof x), 0, "case %d", c);
        for (int i = 0; i < 3; i++) free(chunks[i]);
    }
    tdm_dp_free(dp);
    tdm_model_free(m);
    close_devs(&v);
}

/* ---- equivalence with one device ---- */

typedef struct equiv_result {
    double loss_diff, grad_ratio, param_ratio, grad_abs, param_abs;
} equiv_result;

/* One SGD (momentum) step on one device and under DP over n devices from
 * the same seed and batch; compares loss, gradients and parameters. */
static equiv_result one_step(int n, int batch, int output_device)
{
    devs v;
    open_devs(&v, n);
    tdm_device *ref_dev;
    cr_assert_eq(tdm_device_open(&ref_dev, "cpu", 0, 1), TDM_STATUS_OK);
    tdm_model *ref, *m;
    cr_assert_eq(tdm_mlp_init(&ref, ref_dev, MLP_DIMS, 3, 42), TDM_STATUS_OK);
    cr_assert_eq(tdm_mlp_init(&m, v.d[output_device], MLP_DIMS, 3, 42), TDM_STATUS_OK);
    tdm_optim *oref, *odp;
    cr_assert_eq(tdm_sgd_init(&oref, ref, 0.1f, 0.9f), TDM_STATUS_OK);
    cr_assert_eq(tdm_sgd_init(&odp, m, 0.1f, 0.9f), TDM_STATUS_OK);
    tdm_dp_opts o;
    tdm_dp_opts_default(&o);
    o.output_device = output_device;
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, &o), TDM_STATUS_OK, "%s", tdm_error_message());

    float *x = malloc(sizeof(float) * batch * MLP_DIMS[0]);
    int32_t *y = malloc(sizeof(int32_t) * batch);
    make_data(x, y, batch, MLP_DIMS[0], MLP_DIMS[2], 1000 + batch);

    double lref, ldp;
    cr_assert_eq(tdm_model_zero_grad(ref), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_forward_backward(ref, x, y, batch, &lref), TDM_STATUS_OK);
    cr_assert_eq(tdm_optim_step(oref), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_step(dp, odp, x, y, batch, &ldp), TDM_STATUS_OK, "%s",
                 tdm_error_message());

    int64_t np = tdm_model_param_elems(m);
    equiv_result r;
    r.loss_diff = fabs(ldp - lref) / (ATOL + RTOL * fabs(lref));
    r.grad_ratio = tol_ratio(tdm_model_grads(m), tdm_model_grads(ref), np, &r.grad_abs);
    r.param_ratio = tol_ratio(tdm_model_params(m), tdm_model_params(ref), np, &r.param_abs);

    const tdm_dp_timings *t = tdm_dp_last_timings(dp);
    int want_active = 0;
    for (int i = 0; i < n; i++) want_active += t->chunk[i] > 0;
    cr_assert_eq(t->n_active, want_active);
    cr_assert_eq(t->batch, batch);
    cr_assert_gt(t->step_ms, 0.0);
    cr_assert_gt(t->wall.ms[TDM_PHASE_FORWARD], 0.0);
    /* a phase's wall-clock covers every device's share of it; idle
     * devices do no work */
    double sum_wall = 0.0;
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
        sum_wall += t->wall.ms[p];
        for (int i = 0; i < n; i++)
            cr_assert_leq(t->device[i].ms[p], t->wall.ms[p] + 1e-9, "phase %d device %d", p, i);
    }
    cr_assert_leq(sum_wall, t->step_ms + 1e-9);
    for (int i = 0; i < n; i++) {
        if (t->chunk[i] > 0) cr_assert_gt(t->device[i].ms[TDM_PHASE_FORWARD], 0.0);
        else cr_assert_eq(t->device[i].ms[TDM_PHASE_FORWARD], 0.0);
    }
    cr_assert_gt(t->wall.ms[TDM_PHASE_STEP], 0.0);

    free(x);
    free(y);
    tdm_dp_free(dp);
    tdm_optim_free(oref);
    tdm_optim_free(odp);
    tdm_model_free(ref);
    tdm_model_free(m);
    tdm_device_free(ref_dev);
    close_devs(&v);
    return r;
}

Test(dp_equiv, one_step_matches_one_device)
{
    const int batches[] = {1, 2, 3, 4, 5, 7, 8, 13};
    double worst = 0.0, worst_grad = 0.0, worst_param = 0.0;
    for (int n = 1; n <= 4; n++) {
        for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
            equiv_result r = one_step(n, batches[b], 0);
            cr_assert_leq(r.loss_diff, 1.0, "n=%d batch=%d: loss off by %.3g x tolerance", n,
                          batches[b], r.loss_diff);
            cr_assert_leq(r.grad_ratio, 1.0, "n=%d batch=%d: gradients off by %.3g x tolerance "
                          "(max |diff| %.3g)", n, batches[b], r.grad_ratio, r.grad_abs);
            cr_assert_leq(r.param_ratio, 1.0, "n=%d batch=%d: parameters off by %.3g x tolerance",
                          n, batches[b], r.param_ratio);
            if (r.grad_abs > worst_grad) worst_grad = r.grad_abs;
            if (r.param_abs > worst_param) worst_param = r.param_abs;
            if (r.grad_ratio > worst) worst = r.grad_ratio;
        }
    }
    note("max |grad diff| %.3g, max |param diff| %.3g, worst ratio to bound %.3g",
                worst_grad, worst_param, worst);
}

Test(dp_equiv, output_device_not_first)
{
    /* the master on the last device; batches where it gets rows and where
     * it gets none (5 over 4 devices: 2,2,1,0) */
    const int batches[] = {8, 5, 3};
    for (int b = 0; b < 3; b++) {
        equiv_result r = one_step(4, batches[b], 3);
        cr_assert_leq(r.loss_diff, 1.0);
        cr_assert_leq(r.grad_ratio, 1.0, "batch %d: %.3g", batches[b], r.grad_ratio);
        cr_assert_leq(r.param_ratio, 1.0);
    }
}

Test(dp_equiv, explicit_chunk_sizes)
{
    devs v;
    open_devs(&v, 3);
    tdm_model *ref, *m;
    cr_assert_eq(tdm_mlp_init(&ref, v.d[0], MLP_DIMS, 3, 5), TDM_STATUS_OK);
    cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 5), TDM_STATUS_OK);
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
    enum { B = 9 };
    float x[B * 20];
    int32_t y[B];
    make_data(x, y, B, 20, 10, 77);
    double lref, ldp;
    cr_assert_eq(tdm_model_forward_backward(ref, x, y, B, &lref), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_forward_backward(dp, x, y, B, (int[]){0, 7, 2}, &ldp), TDM_STATUS_OK,
                 "%s", tdm_error_message());
    cr_assert_leq(fabs(ldp - lref), ATOL + RTOL * fabs(lref));
    cr_assert_leq(tol_ratio(tdm_model_grads(m), tdm_model_grads(ref), tdm_model_param_elems(m),
                            NULL), 1.0);
    cr_assert_eq(tdm_dp_last_timings(dp)->n_active, 2);
    /* forward_backward adds into the master's gradients, like
     * tdm_model_forward_backward: a second call doubles both */
    cr_assert_eq(tdm_model_forward_backward(ref, x, y, B, &lref), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_forward_backward(dp, x, y, B, NULL, &ldp), TDM_STATUS_OK);
    cr_assert_leq(tol_ratio(tdm_model_grads(m), tdm_model_grads(ref), tdm_model_param_elems(m),
                            NULL), 1.0);
    tdm_dp_free(dp);
    tdm_model_free(ref);
    tdm_model_free(m);
    close_devs(&v);
}

/* 50 steps of AdamW on a fixed sequence of batches: the loss curves agree.
 * Differences compound through the parameters, so the bound is looser:
 * |dp - ref| <= 1e-4 + 1e-3 |ref| per step (measured: ~1e-6). */
Test(dp_equiv, loss_curves_50_steps)
{
    const int n_dev[] = {2, 3, 4};
    for (int k = 0; k < 3; k++) {
        devs v;
        open_devs(&v, n_dev[k]);
        tdm_model *ref, *m;
        cr_assert_eq(tdm_mlp_init(&ref, v.d[0], MLP_DIMS, 3, 9), TDM_STATUS_OK);
        cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 9), TDM_STATUS_OK);
        tdm_optim_opts oo;
        tdm_optim_opts_default(&oo, TDM_OPTIM_ADAMW);
        oo.lr = 1e-2f;
        tdm_optim *oref, *odp;
        cr_assert_eq(tdm_optim_init(&oref, ref, &oo), TDM_STATUS_OK);
        cr_assert_eq(tdm_optim_init(&odp, m, &oo), TDM_STATUS_OK);
        tdm_dp *dp;
        cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
        enum { B = 30 };
        float x[B * 20];
        int32_t y[B];
        double worst = 0.0, first = 0.0, last = 0.0;
        for (int s = 0; s < 50; s++) {
            make_data(x, y, B, 20, 10, 500 + s % 5);   /* 5 batches, cycled: learnable */
            double lref, ldp;
            cr_assert_eq(tdm_model_zero_grad(ref), TDM_STATUS_OK);
            cr_assert_eq(tdm_model_forward_backward(ref, x, y, B, &lref), TDM_STATUS_OK);
            cr_assert_eq(tdm_optim_step(oref), TDM_STATUS_OK);
            cr_assert_eq(tdm_dp_step(dp, odp, x, y, B, &ldp), TDM_STATUS_OK);
            double d = fabs(ldp - lref);
            cr_assert_leq(d, 1e-4 + 1e-3 * fabs(lref), "devices %d step %d: %.8f vs %.8f",
                          n_dev[k], s, ldp, lref);
            if (d > worst) worst = d;
            if (s == 0) first = lref;
            last = lref;
        }
        cr_assert_lt(last, first * 0.7, "the model should learn: loss %.4f -> %.4f", first, last);
        note("devices %d: 50 steps, loss %.4f -> %.4f, max |dp - ref| %.3g", n_dev[k],
                    first, last, worst);
        tdm_dp_free(dp);
        tdm_optim_free(oref);
        tdm_optim_free(odp);
        tdm_model_free(ref);
        tdm_model_free(m);
        close_devs(&v);
    }
}

/* ---- batchnorm semantics ---- */

static tdm_status small_cnn(tdm_model **out, tdm_device *d, uint64_t seed)
{
    tdm_model_spec s;
    tdm_model_spec_cnn(&s);
    s.in_h = s.in_w = 12;
    s.ch1 = 4;
    s.ch2 = 6;
    return tdm_model_init(out, d, &s, seed);
}

Test(dp_batchnorm, per_chunk_statistics_like_pytorch)
{
    enum { N = 3, B = 6 };
    devs v;
    open_devs(&v, N);
    tdm_model *m, *chunk0, *chunked, *whole;
    cr_assert_eq(small_cnn(&m, v.d[0], 3), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(small_cnn(&chunk0, v.d[0], 3), TDM_STATUS_OK);
    cr_assert_eq(small_cnn(&chunked, v.d[0], 3), TDM_STATUS_OK);
    cr_assert_eq(small_cnn(&whole, v.d[0], 3), TDM_STATUS_OK);
    tdm_model_set_train(m, 1);
    tdm_model_set_train(chunk0, 1);
    tdm_model_set_train(chunked, 1);
    tdm_model_set_train(whole, 1);
    int F = tdm_model_in_features(m), C = tdm_model_n_classes(m);
    float *x = malloc(sizeof(float) * B * F);
    int32_t y[B];
    make_data(x, y, B, F, C, 31);

    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
    double ldp;
    cr_assert_eq(tdm_model_zero_grad(m), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_forward_backward(dp, x, y, B, NULL, &ldp), TDM_STATUS_OK, "%s",
                 tdm_error_message());

    /* running statistics: those of a forward over chunk 0 (rows 0..1)
     * alone; the other replicas' updates are discarded */
    const float *logits;
    cr_assert_eq(tdm_model_forward(chunk0, x, 2, &logits), TDM_STATUS_OK);
    int64_t nb = tdm_model_buffer_elems(m);
    cr_assert_gt(nb, 0);
    cr_assert_leq(tol_ratio(tdm_model_buffers(m), tdm_model_buffers(chunk0), nb, NULL), 1.0,
                  "master running stats must equal chunk 0's");

    /* gradients: the sum over chunks of each chunk's gradient, computed
     * with that chunk's own batch statistics and the global 1/B scale */
    float dl[B * 16];
    int32_t *lab = y;
    double lsum = 0.0;
    cr_assert_eq(tdm_model_zero_grad(chunked), TDM_STATUS_OK);
    for (int k = 0; k < N; k++) {
        double ls;
        cr_assert_eq(tdm_model_forward(chunked, x + (size_t)2 * k * F, 2, &logits), TDM_STATUS_OK);
        cr_assert_eq(tdm_loss_softmax_xent(v.d[0], logits, lab + 2 * k, 2, C, 1.0f / B, &ls, dl),
                     TDM_STATUS_OK);
        cr_assert_eq(tdm_model_backward(chunked, dl), TDM_STATUS_OK);
        lsum += ls;
    }
    int64_t np = tdm_model_param_elems(m);
    double gabs;
    double gr = tol_ratio(tdm_model_grads(m), tdm_model_grads(chunked), np, &gabs);
    cr_assert_leq(gr, 1.0, "DP gradients != sum of per-chunk gradients (%.3g x tol, max %.3g)",
                  gr, gabs);
    cr_assert_leq(fabs(ldp - lsum / B), ATOL + RTOL * fabs(ldp));

    /* and this is *not* one device over the whole batch: batch statistics
     * over 6 images differ from those over 2 */
    double lw;
    cr_assert_eq(tdm_model_zero_grad(whole), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_forward_backward(whole, x, y, B, &lw), TDM_STATUS_OK);
    double wabs;
    tol_ratio(tdm_model_grads(m), tdm_model_grads(whole), np, &wabs);
    cr_assert_gt(wabs, 1e-3, "batchnorm under DP should differ from one device (max diff %.3g)",
                 wabs);
    note("batchnorm: DP vs per-chunk reference %.3g, vs whole batch %.3g", gabs, wabs);

    free(x);
    tdm_dp_free(dp);
    tdm_model_free(m);
    tdm_model_free(chunk0);
    tdm_model_free(chunked);
    tdm_model_free(whole);
    close_devs(&v);
}

/* ---- parallel_apply ---- */

typedef struct apply_ctx {
    long calls[TDM_DP_MAX_DEVICES];
    int fail;              /* replica that fails, -1 none */
    int sleep_ms;
    _Atomic int finished;
    tdm_model *seen_model[TDM_DP_MAX_DEVICES];
    tdm_device *seen_dev[TDM_DP_MAX_DEVICES];
} apply_ctx;

static tdm_status apply_fn(void *ctx, int replica, tdm_model *m, tdm_device *dev)
{
    apply_ctx *a = ctx;
    a->calls[replica]++;
    a->seen_model[replica] = m;
    a->seen_dev[replica] = dev;
    if (replica == a->fail) {
        atomic_fetch_add(&a->finished, 1);
        return tdm_error_set(TDM_STATUS_IO, "injected failure (%d)", replica);
    }
    if (a->sleep_ms) {
        struct timespec ts = {0, a->sleep_ms * 1000000L};
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&a->finished, 1);
    return TDM_STATUS_OK;
}

Test(dp_apply, error_names_replica_and_pool_survives)
{
    devs v;
    open_devs(&v, 4);
    tdm_model *m;
    cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 1), TDM_STATUS_OK);
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
    apply_ctx a = {.fail = 2, .sleep_ms = 30};
    tdm_status st = tdm_dp_parallel_apply(dp, 4, apply_fn, &a);
    cr_assert_eq(st, TDM_STATUS_IO);
    cr_assert_str_eq(tdm_error_message(), "replica 2 on device cpu:2: injected failure (2)");
    cr_assert_eq(atomic_load(&a.finished), 4, "returned before every replica stopped");
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(a.seen_model[i], tdm_dp_replica(dp, i));
        cr_assert_eq(a.seen_dev[i], v.d[i]);
    }
    cr_assert_eq(a.seen_model[0], m, "replica 0 is the master itself");

    apply_ctx b = {.fail = -1};
    cr_assert_eq(tdm_dp_parallel_apply(dp, 4, apply_fn, &b), TDM_STATUS_OK);
    for (int i = 0; i < 4; i++) cr_assert_eq(b.calls[i], 1);
    /* only the first n_active run */
    cr_assert_eq(tdm_dp_parallel_apply(dp, 2, apply_fn, &b), TDM_STATUS_OK);
    cr_assert(b.calls[0] == 2 && b.calls[1] == 2 && b.calls[2] == 1 && b.calls[3] == 1);
    /* a failure on the caller's own replica is reported the same way */
    apply_ctx c = {.fail = 0};
    cr_assert_eq(tdm_dp_parallel_apply(dp, 3, apply_fn, &c), TDM_STATUS_IO);
    cr_assert_str_eq(tdm_error_message(), "replica 0 on device cpu:0: injected failure (0)");
    /* and a whole step still works afterwards */
    float x[5 * 20];
    int32_t y[5];
    make_data(x, y, 5, 20, 10, 3);
    double l;
    cr_assert_eq(tdm_dp_forward_backward(dp, x, y, 5, NULL, &l), TDM_STATUS_OK);
    tdm_dp_free(dp);
    tdm_model_free(m);
    close_devs(&v);
}

static void many_applies(int n, int calls)
{
    devs v;
    open_devs(&v, n);
    tdm_model *m;
    cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 1), TDM_STATUS_OK);
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
    apply_ctx a = {.fail = -1};
    uint64_t lost0 = tdm_dp_pool_lost_wakeups();
    for (int k = 0; k < calls; k++)
        cr_assert_eq(tdm_dp_parallel_apply(dp, n, apply_fn, &a), TDM_STATUS_OK);
    for (int i = 0; i < n; i++)
        cr_assert_eq(a.calls[i], calls, "replica %d ran %ld of %d calls", i, a.calls[i], calls);
    cr_assert_eq(tdm_dp_pool_lost_wakeups(), lost0, "lost wake-ups over %d calls", calls);
    tdm_dp_free(dp);
    tdm_model_free(m);
    close_devs(&v);
}

Test(dp_apply, thousands_of_calls_no_lost_wakeup)
{
    many_applies(2, 20000);   /* threads <= cores here: spinning waits */
    many_applies(4, 3000);    /* more threads than cores: futex waits only */
}

/* ---- bad use ---- */

Test(dp_bad_use, refused_with_messages)
{
    devs v;
    open_devs(&v, 2);
    tdm_model *m, *m1;
    cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_mlp_init(&m1, v.d[1], MLP_DIMS, 3, 1), TDM_STATUS_OK);
    tdm_dp *dp = (tdm_dp *)1;

    cr_assert_eq(tdm_dp_init(&dp, m, v.d, 0, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert_null(dp);
    cr_assert(strstr(tdm_error_message(), "at least one device"), "%s", tdm_error_message());

    tdm_dp_opts o;
    tdm_dp_opts_default(&o);
    o.output_device = 2;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, 2, &o), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "output device 2 is not in the device list"), "%s",
              tdm_error_message());
    o.output_device = -1;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, 2, &o), TDM_STATUS_INVALID_ARG);

    /* master on cpu:1, output device cpu:0 */
    cr_assert_eq(tdm_dp_init(&dp, m1, v.d, 2, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "lives on cpu:1 but the output device is cpu:0"), "%s",
              tdm_error_message());

    tdm_device *twice[2] = {v.d[0], v.d[0]};
    cr_assert_eq(tdm_dp_init(&dp, m, twice, 2, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "listed twice"), "%s", tdm_error_message());

    /* device specs */
    tdm_device *d[TDM_DP_MAX_DEVICES];
    int n = 7;
    cr_assert_eq(tdm_dp_devices_open("gpu:2", d, &n), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(n, 0);
    cr_assert_eq(tdm_dp_devices_open("cpu:x", d, &n), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_devices_open("cpu:0", d, &n), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_devices_open("", d, &n), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_devices_open("cpu:0,0", d, &n), TDM_STATUS_INVALID_ARG);
    /* more CUDA devices than exist (none at all in a build without CUDA) */
    tdm_status st = tdm_dp_devices_open("cuda:0,1,2,3,4,5,6,7,8", d, &n);
    cr_assert_eq(st, TDM_STATUS_NO_DEVICE, "%s", tdm_error_message());
    cr_assert_eq(n, 0);
    cr_assert_eq(tdm_dp_devices_open("cpu:0,2", d, &n), TDM_STATUS_OK);
    cr_assert(n == 2 && !strcmp(tdm_dev_name(d[0]), "cpu:0") &&
              !strcmp(tdm_dev_name(d[1]), "cpu:2"));
    tdm_dp_devices_close(d, n);

    /* steps */
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, 2, NULL), TDM_STATUS_OK);
    float x[4 * 20] = {0};
    int32_t y[4] = {0, 1, 2, 3};
    tdm_optim *opt;
    cr_assert_eq(tdm_sgd_init(&opt, m, 0.1f, 0.0f), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_step(dp, opt, x, y, 0, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "batch 0"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dp_step(dp, NULL, x, y, 4, NULL), TDM_STATUS_INVALID_ARG);
    y[2] = 10;
    cr_assert_eq(tdm_dp_step(dp, opt, x, y, 4, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "label 10 of sample 2"), "%s", tdm_error_message());
    y[2] = 2;
    cr_assert_eq(tdm_dp_forward_backward(dp, x, y, 4, (int[]){3, 2}, NULL),
                 TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_parallel_apply(dp, 3, apply_fn, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_parallel_apply(dp, 0, apply_fn, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_replicate(dp, 3), TDM_STATUS_INVALID_ARG);
    /* still fine after all that */
    cr_assert_eq(tdm_dp_step(dp, opt, x, y, 4, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    tdm_optim_free(opt);
    tdm_dp_free(dp);
    tdm_dp_free(NULL);
    tdm_model_free(m);
    tdm_model_free(m1);
    close_devs(&v);
}

/* ---- replicate ---- */

Test(dp_ops, replicate_copies_params_buffers_and_mode)
{
    devs v;
    open_devs(&v, 3);
    tdm_model *m;
    cr_assert_eq(small_cnn(&m, v.d[0], 4), TDM_STATUS_OK);
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
    /* change the master after the clones were made */
    int64_t np = tdm_model_param_elems(m), nb = tdm_model_buffer_elems(m);
    for (int64_t i = 0; i < np; i++) tdm_model_params(m)[i] += 0.5f;
    for (int64_t i = 0; i < nb; i++) tdm_model_buffers(m)[i] = (float)i;
    tdm_model_set_train(m, 0);
    tdm_model_grads(tdm_dp_replica(dp, 2))[0] = 3.0f;
    cr_assert_eq(tdm_dp_replicate(dp, 2), TDM_STATUS_OK);
    tdm_model *r1 = tdm_dp_replica(dp, 1), *r2 = tdm_dp_replica(dp, 2);
    cr_assert_eq(memcmp(tdm_model_params(r1), tdm_model_params(m), np * sizeof(float)), 0);
    cr_assert_eq(memcmp(tdm_model_buffers(r1), tdm_model_buffers(m), nb * sizeof(float)), 0);
    cr_assert_eq(tdm_model_is_train(r1), 0);
    cr_assert_neq(memcmp(tdm_model_params(r2), tdm_model_params(m), np * sizeof(float)), 0,
                  "replica 2 was not in the active set");
    cr_assert_eq(tdm_model_grads(r2)[0], 3.0f);
    cr_assert_eq(tdm_dp_replicate(dp, 3), TDM_STATUS_OK);
    cr_assert_eq(memcmp(tdm_model_params(r2), tdm_model_params(m), np * sizeof(float)), 0);
    cr_assert_eq(tdm_model_grads(r2)[0], 0.0f, "a fresh replica has zero gradients");
    tdm_dp_free(dp);
    tdm_model_free(m);
    close_devs(&v);
}

/* ---- batches that change size between steps (buffers grow) ---- */

Test(dp_equiv, batch_size_changes_between_steps)
{
    devs v;
    open_devs(&v, 3);
    tdm_model *ref, *m;
    cr_assert_eq(tdm_mlp_init(&ref, v.d[0], MLP_DIMS, 3, 8), TDM_STATUS_OK);
    cr_assert_eq(tdm_mlp_init(&m, v.d[0], MLP_DIMS, 3, 8), TDM_STATUS_OK);
    tdm_optim *oref, *odp;
    cr_assert_eq(tdm_sgd_init(&oref, ref, 0.05f, 0.9f), TDM_STATUS_OK);
    cr_assert_eq(tdm_sgd_init(&odp, m, 0.05f, 0.9f), TDM_STATUS_OK);
    tdm_dp *dp;
    cr_assert_eq(tdm_dp_init(&dp, m, v.d, v.n, NULL), TDM_STATUS_OK);
    const int batches[] = {3, 13, 1, 8, 40, 2};
    float x[40 * 20];
    int32_t y[40];
    for (int s = 0; s < 6; s++) {
        int b = batches[s];
        make_data(x, y, b, 20, 10, 900 + s);
        double lref, ldp;
        cr_assert_eq(tdm_model_zero_grad(ref), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_forward_backward(ref, x, y, b, &lref), TDM_STATUS_OK);
        cr_assert_eq(tdm_optim_step(oref), TDM_STATUS_OK);
        cr_assert_eq(tdm_dp_step(dp, odp, x, y, b, &ldp), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        cr_assert_leq(fabs(ldp - lref), ATOL + RTOL * fabs(lref), "step %d batch %d", s, b);
        cr_assert_leq(tol_ratio(tdm_model_params(m), tdm_model_params(ref),
                                tdm_model_param_elems(m), NULL), 1.0, "step %d batch %d", s, b);
    }
    tdm_dp_free(dp);
    tdm_optim_free(oref);
    tdm_optim_free(odp);
    tdm_model_free(ref);
    tdm_model_free(m);
    close_devs(&v);
}
