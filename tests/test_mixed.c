/* tests/test_mixed.c: the device interface's mixed-precision entries
 * (core/device.h, core/kernels.h): the 16-bit conversions against
 * core/comm.c's scalar ones (every 16-bit pattern, and floats sampled over
 * the whole range, ties included); tdm_dev_gemm_ex in bfloat16 and float16
 * against a double reference over the rounded inputs, for every transpose
 * pair, padded leading dimensions, alpha/beta, batched and row-major
 * forms, on the host device and on the CUDA emulator (which must give the
 * host's bits); float32 through gemm_ex gives tdm_dev_gemm's bits; the
 * argument checks; loss-scale unscaling with its non-finite flag; the
 * chunked squared norm; and that a host device's bfloat16 gemm runs on
 * its own thread (no OpenMP team) when two threads drive two devices,
 * and libdnnl is loaded by the first bfloat16 product, not before;
 * without oneDNN (or a bfloat16 kernel for the CPU) bfloat16 products
 * widen to float32 and stay within the same bound. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <pthread.h>

#include "core/comm.h"
#include "core/kernels.h"
#include "tests/test_util.h"

#define CM(p, ld, r, c) ((p)[(size_t)(c) * (ld) + (r)])

static float to_f(tdm_dtype t, uint16_t h) { return t == TDM_DTYPE_BFLOAT16 ? tdm_bf16_to_f32(h) : tdm_f16_to_f32(h); }
static uint16_t from_f(tdm_dtype t, float f) { return t == TDM_DTYPE_BFLOAT16 ? tdm_f32_to_bf16(f) : tdm_f32_to_f16(f); }

static int same_bits(float a, float b) { return memcmp(&a, &b, 4) == 0; }

Test(mixed, widening_matches_comm_for_every_pattern)
{
    for (uint32_t h = 0; h < 65536; h++) {
        cr_assert(same_bits(tdm_k_bf16_to_f32((uint16_t)h), tdm_bf16_to_f32((uint16_t)h)), "bf16 0x%04x", h);
        float a = tdm_k_f16_to_f32((uint16_t)h), b = tdm_f16_to_f32((uint16_t)h);
        cr_assert(same_bits(a, b) || (isnan(a) && isnan(b)), "f16 0x%04x: %a vs %a", h, a, b);
    }
}

Test(mixed, narrowing_matches_comm_over_the_float_range)
{
    /* every 61st bit pattern (70 M floats: normals, subnormals, NaNs,
     * infinities), then every tie of each 16-bit type exactly */
    for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += 61) {
        float f = tdm_k_bits_f32((uint32_t)u);
        cr_assert_eq(tdm_k_f32_to_bf16(f), tdm_f32_to_bf16(f), "bf16 of 0x%08x", (unsigned)u);
        cr_assert_eq(tdm_k_f32_to_f16(f), tdm_f32_to_f16(f), "f16 of 0x%08x", (unsigned)u);
    }
    for (uint32_t h = 0; h < 0x7f80; h++) {   /* halfway above each positive bf16 */
        uint32_t u = (h << 16) | 0x8000u;
        float f = tdm_k_bits_f32(u);
        cr_assert_eq(tdm_k_f32_to_bf16(f), (h & 1) ? h + 1 : h, "tie 0x%08x", u);
        cr_assert_eq(tdm_k_f32_to_bf16(-f), ((h & 1) ? h + 1 : h) | 0x8000, "tie -0x%08x", u);
    }
    for (uint32_t h = 0; h < 0x7bff; h++) {   /* halfway between consecutive halfs */
        double mid = ((double)tdm_f16_to_f32((uint16_t)h) + tdm_f16_to_f32((uint16_t)(h + 1))) / 2;
        float f = (float)mid;   /* exact: halfs are 11 bits, their midpoint 12 */
        cr_assert_eq(tdm_k_f32_to_f16(f), (h & 1) ? h + 1 : h, "f16 tie above 0x%04x", h);
    }
    cr_assert_eq(tdm_k_f32_to_f16(65520.0f), 0x7c00);   /* the first value that rounds to inf */
    cr_assert_eq(tdm_k_f32_to_f16(65519.996f), 0x7bff);
    cr_assert_eq(tdm_k_f32_to_bf16(3.4028235e38f), 0x7f80);
}

/* "cpu" or the emulated "cuda" device (TANDEM_CUDA_EMULATOR, when the
 * CUDA backend is linked; NULL otherwise). */
static tdm_device *open_dev(int emulated)
{
    tdm_device *d = NULL;
    if (!emulated) return tu_host();
    if (!tdm_device_cuda_linked()) return NULL;
    setenv("TANDEM_CUDA_EMULATOR", "2", 1);
    TU_OK(tdm_device_open(&d, "cuda", 0, 1));
    return d;
}

/* Host data as d's entries take it: a copy in d's memory (an emulated
 * GPU's entries take only their own memory, as a GPU's do). */
static void *dev_up(tdm_device *d, const void *h, size_t nbytes)
{
    void *p = NULL;
    TU_OK(tdm_dev_alloc(d, nbytes ? nbytes : 1, &p));
    if (h && nbytes) TU_OK(tdm_dev_copy_from_host(d, p, h, nbytes));
    return p;
}

static void dev_down(tdm_device *d, void *h, const void *p, size_t nbytes)
{
    if (nbytes) TU_OK(tdm_dev_copy_to_host(d, h, p, nbytes));
}

Test(mixed, device_convert_round_trips)
{
    for (int emu = 0; emu < 2; emu++) {
        tdm_device *d = open_dev(emu);
        if (!d) continue;
        int64_t n = 100003;
        tdm_rng r = tu_rng(5);
        float *x = tu_malloc((size_t)n * 4), *y = tu_malloc((size_t)n * 4);
        uint16_t *h = tu_malloc((size_t)n * 2);
        tu_fill(&r, x, n, -70000.0f, 70000.0f);
        x[0] = NAN;
        x[1] = INFINITY;
        x[2] = 1e-7f;
        float *dx = dev_up(d, x, (size_t)n * 4), *dy = dev_up(d, NULL, (size_t)n * 4);
        uint16_t *dh = dev_up(d, NULL, (size_t)n * 2);
        for (int t = 0; t < 2; t++) {
            tdm_dtype dt = t ? TDM_DTYPE_FLOAT16 : TDM_DTYPE_BFLOAT16;
            TU_OK(tdm_dev_convert(d, dh, dt, dx, TDM_DTYPE_FLOAT32, n));
            TU_OK(tdm_dev_convert(d, dy, TDM_DTYPE_FLOAT32, dh, dt, n));
            dev_down(d, h, dh, (size_t)n * 2);
            dev_down(d, y, dy, (size_t)n * 4);
            for (int64_t i = 0; i < n; i++) {
                cr_assert_eq(h[i], from_f(dt, x[i]), "%s %s element %lld", tdm_dev_name(d), tdm_dtype_name(dt), (long long)i);
                float w = to_f(dt, h[i]);
                cr_assert(same_bits(y[i], w) || (isnan(y[i]) && isnan(w)));
            }
        }
        TU_OK(tdm_dev_convert(d, dy, TDM_DTYPE_FLOAT32, dx, TDM_DTYPE_FLOAT32, n));
        dev_down(d, y, dy, (size_t)n * 4);
        cr_assert(!memcmp(x, y, (size_t)n * 4), "float32 to float32 is a copy");
        tdm_status st = tdm_dev_convert(d, dh, TDM_DTYPE_BFLOAT16, dx, TDM_DTYPE_FLOAT16, n);
        cr_assert_eq(st, TDM_STATUS_INVALID_ARG);
        cr_assert(strstr(tdm_error_message(), "float16 to bfloat16"), "%s", tdm_error_message());
        tdm_dev_free(d, dx); tdm_dev_free(d, dy); tdm_dev_free(d, dh);
        free(x); free(y); free(h);
        tdm_device_free(d);
    }
}

/* A column-major batch of 16-bit matrices: rows x cols, leading dimension
 * ld, batch stride bs, filled with values representable in the type. */
typedef struct mat16 {
    uint16_t *h;
    size_t n;
} mat16;

static mat16 mat_make(tdm_rng *r, tdm_dtype dt, size_t n)
{
    mat16 m = {tu_malloc(n * 2), n};
    for (size_t i = 0; i < n; i++) m.h[i] = from_f(dt, tu_unif(r, -2.0f, 2.0f));
    return m;
}

/* One batched case on d: returns the largest error over its bound
 * (k 2^-22 times the sum of |products|, plus |beta c| 2^-23). The float C
 * of every element outside the product is checked untouched. */
static double gemm_ex_case(tdm_device *d, tdm_dtype dt, tdm_trans ta, tdm_trans tb, int m, int n,
                           int k, float alpha, float beta, int pad, int batch, float *out_c,
                           uint64_t seed)
{
    tdm_rng r = tu_rng(seed);
    int arows = ta == TDM_TRANS_N ? m : k, acols = ta == TDM_TRANS_N ? k : m;
    int brows = tb == TDM_TRANS_N ? k : n, bcols = tb == TDM_TRANS_N ? n : k;
    int lda = (arows > 1 ? arows : 1) + pad, ldb = (brows > 1 ? brows : 1) + pad;
    int ldc = (m > 1 ? m : 1) + pad;
    long long sa = (long long)lda * (acols > 0 ? acols : 1) + pad, sb = (long long)ldb * (bcols > 0 ? bcols : 1);
    long long sc = (long long)ldc * (n > 0 ? n : 1) + 3;
    mat16 a = mat_make(&r, dt, (size_t)(sa * batch)), b = mat_make(&r, dt, (size_t)(sb * batch));
    size_t nc = (size_t)(sc * batch);
    float *c = tu_malloc(nc * 4), *c0 = tu_malloc(nc * 4);
    tu_fill(&r, c, (int64_t)nc, -1.0f, 1.0f);
    memcpy(c0, c, nc * 4);
    void *da = dev_up(d, a.h, a.n * 2), *db = dev_up(d, b.h, b.n * 2);
    float *dc = dev_up(d, c, nc * 4);
    if (batch == 1)
        TU_OK(tdm_dev_gemm_ex(d, ta, tb, m, n, k, alpha, da, lda, db, ldb, beta, dc, ldc, dt));
    else
        TU_OK(tdm_dev_gemm_strided_batched_ex(d, ta, tb, m, n, k, alpha, da, lda, sa, db, ldb, sb,
                                              beta, dc, ldc, sc, batch, dt));
    dev_down(d, c, dc, nc * 4);
    tdm_dev_free(d, da); tdm_dev_free(d, db); tdm_dev_free(d, dc);
    double worst = 0.0;
    for (int q = 0; q < batch; q++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < ldc; i++) {
                size_t ci = (size_t)(q * sc) + (size_t)j * ldc + i;
                if (i >= m) {
                    cr_assert(same_bits(c[ci], c0[ci]), "padding of C written at %d,%d", i, j);
                    continue;
                }
                double s = 0.0, sabs = 0.0;
                for (int p = 0; p < k; p++) {
                    const uint16_t *aq = a.h + q * sa, *bq = b.h + q * sb;
                    double av = to_f(dt, ta == TDM_TRANS_N ? CM(aq, lda, i, p) : CM(aq, lda, p, i));
                    double bv = to_f(dt, tb == TDM_TRANS_N ? CM(bq, ldb, p, j) : CM(bq, ldb, j, p));
                    s += av * bv;
                    sabs += fabs(av * bv);
                }
                double ref = alpha * s + (beta == 0.0f ? 0.0 : beta * (double)c0[ci]);
                double bound = (k + 2) * 0x1p-22 * fabs(alpha) * sabs +
                               0x1p-22 * fabs(beta * (double)c0[ci]) + 1e-30;
                double e = fabs(c[ci] - ref) / bound;
                if (e > worst) worst = e;
            }
    if (out_c) memcpy(out_c, c, nc * 4);
    free(a.h); free(b.h); free(c); free(c0);
    return worst;
}

Test(mixed, gemm_ex_matches_a_double_reference, .timeout = 120)
{
    static const int sizes[][3] = {{1, 1, 1}, {7, 5, 3}, {17, 33, 65}, {64, 48, 128}, {3, 1, 200}, {0, 4, 4}, {4, 4, 0}};
    for (int emu = 0; emu < 2; emu++) {
        tdm_device *d = open_dev(emu);
        if (!d) continue;
        for (int t = 0; t < 2; t++) {
            tdm_dtype dt = t ? TDM_DTYPE_FLOAT16 : TDM_DTYPE_BFLOAT16;
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
                for (int ta = 0; ta < 2; ta++)
                    for (int tb = 0; tb < 2; tb++)
                        for (int v = 0; v < 3; v++) {
                            float alpha = v == 2 ? 0.375f : 1.0f, beta = v == 0 ? 0.0f : v == 1 ? 1.0f : -0.5f;
                            int batch = v == 2 ? 3 : 1, pad = v;
                            double e = gemm_ex_case(d, dt, (tdm_trans)ta, (tdm_trans)tb, sizes[s][0],
                                                    sizes[s][1], sizes[s][2], alpha, beta, pad, batch,
                                                    NULL, 100 + s);
                            cr_assert(e <= 1.0, "%s %s ta%d tb%d %dx%dx%d alpha %g beta %g batch %d: "
                                      "error %.3g of the bound", tdm_dev_name(d), tdm_dtype_name(dt), ta, tb,
                                      sizes[s][0], sizes[s][1], sizes[s][2], alpha, beta, batch, e);
                        }
        }
        tdm_device_free(d);
    }
}

Test(mixed, the_emulator_computes_the_hosts_bits)
{
    tdm_device *emu = open_dev(1);
    if (!emu) cr_skip_test("CUDA backend not built (no nvcc)");
    tdm_device *host = tu_host();
    for (int t = 0; t < 2; t++) {
        tdm_dtype dt = t ? TDM_DTYPE_FLOAT16 : TDM_DTYPE_BFLOAT16;
        float *c1 = tu_malloc(1 << 20), *c2 = tu_malloc(1 << 20);
        gemm_ex_case(host, dt, TDM_TRANS_T, TDM_TRANS_N, 40, 24, 96, 1.0f, 1.0f, 1, 2, c1, 9);
        gemm_ex_case(emu, dt, TDM_TRANS_T, TDM_TRANS_N, 40, 24, 96, 1.0f, 1.0f, 1, 2, c2, 9);
        cr_assert(!memcmp(c1, c2, (size_t)(2 * (41 * 24 + 3)) * 4), "%s", tdm_dtype_name(dt));
        free(c1); free(c2);
    }
    tdm_device_free(emu);
    tdm_device_free(host);
}

Test(mixed, float32_through_gemm_ex_is_the_plain_gemm)
{
    tdm_device *d = tu_host();
    tdm_rng r = tu_rng(3);
    int m = 37, n = 29, k = 51;
    float *a = tu_malloc((size_t)m * k * 4), *b = tu_malloc((size_t)k * n * 4);
    float *c1 = tu_malloc((size_t)m * n * 4), *c2 = tu_malloc((size_t)m * n * 4);
    tu_fill(&r, a, m * k, -1, 1);
    tu_fill(&r, b, k * n, -1, 1);
    tu_fill(&r, c1, m * n, -1, 1);
    memcpy(c2, c1, (size_t)m * n * 4);
    TU_OK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_T, m, n, k, 0.5f, a, b, 1.0f, c1));
    TU_OK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_N, TDM_TRANS_T, m, n, k, 0.5f, a, k, b, k, 1.0f, c2, n,
                             TDM_DTYPE_FLOAT32));
    cr_assert(!memcmp(c1, c2, (size_t)m * n * 4));
    free(a); free(b); free(c1); free(c2);
    tdm_device_free(d);
}

Test(mixed, row_major_forms_with_leading_dimensions)
{
    /* C (m, n) rows of ldc = A (m, k) rows of lda times B^T, B (n, k) rows
     * of ldb: the attention's reading of q and k out of a wider qkv */
    tdm_device *d = tu_host();
    tdm_rng r = tu_rng(4);
    int m = 9, n = 7, k = 5, lda = 12, ldb = 15, ldc = 11;
    uint16_t a[9 * 12], b[7 * 15];
    float c[9 * 11] = {0};
    for (int i = 0; i < 9 * 12; i++) a[i] = tdm_f32_to_bf16(tu_unif(&r, -1, 1));
    for (int i = 0; i < 7 * 15; i++) b[i] = tdm_f32_to_bf16(tu_unif(&r, -1, 1));
    TU_OK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_N, TDM_TRANS_T, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c,
                             ldc, TDM_DTYPE_BFLOAT16));
    for (int i = 0; i < m; i++)
        for (int j = 0; j < ldc; j++) {
            double s = 0.0;
            for (int p = 0; p < k && j < n; p++)
                s += (double)tdm_bf16_to_f32(a[i * lda + p]) * tdm_bf16_to_f32(b[j * ldb + p]);
            cr_assert(tu_close(c[i * ldc + j], s, 1e-6, 1e-6), "(%d, %d): %g vs %g", i, j, c[i * ldc + j], s);
        }
    /* batched: two (m, n) products 40 rows apart */
    float cb[2 * 40 * 11] = {0};
    uint16_t ab[2 * 9 * 12];
    for (int i = 0; i < 2 * 9 * 12; i++) ab[i] = tdm_f32_to_bf16(tu_unif(&r, -1, 1));
    TU_OK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_N, TDM_TRANS_T, m, n, k, 2.0f, ab, lda,
                                             9 * 12, b, ldb, 0, 0.0f, cb, ldc, 40 * 11, 2,
                                             TDM_DTYPE_BFLOAT16));
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double s = 0.0;
                for (int p = 0; p < k; p++)
                    s += (double)tdm_bf16_to_f32(ab[q * 108 + i * lda + p]) * tdm_bf16_to_f32(b[j * ldb + p]);
                cr_assert(tu_close(cb[q * 440 + i * ldc + j], 2 * s, 1e-6, 1e-6));
            }
    tdm_device_free(d);
}

Test(mixed, gemm_ex_refuses_bad_arguments)
{
    tdm_device *d = tu_host();
    float c[4];
    uint16_t a[4] = {0}, b[4] = {0};
    cr_assert_eq(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 2, 1, a, 2, b, 2, 0, c, 2,
                                 TDM_DTYPE_INT32), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "input type int32"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 2, 1, a, 1, b, 2, 0, c, 2,
                                 TDM_DTYPE_BFLOAT16), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "lda=1 < 2"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dev_gemm_strided_batched_ex(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 2, 1, a, 2, -1,
                                                 b, 2, 0, 0, c, 2, 0, 2, TDM_DTYPE_FLOAT16),
                 TDM_STATUS_INVALID_ARG);
    tdm_device_free(d);
}

Test(mixed, unscale_flags_non_finite_values)
{
    for (int emu = 0; emu < 2; emu++) {
        tdm_device *d = open_dev(emu);
        if (!d) continue;
        float x[1000], found = 0.0f;
        for (int i = 0; i < 1000; i++) x[i] = (float)(i - 500) * 4.0f;
        float *dx = dev_up(d, x, sizeof x), *dfound = dev_up(d, &found, sizeof found);
        TU_OK(tdm_dev_unscale_check(d, dx, 1000, 0.25f, dfound));
        dev_down(d, x, dx, sizeof x);
        dev_down(d, &found, dfound, sizeof found);
        cr_assert_eq(found, 0.0f);
        for (int i = 0; i < 1000; i++) cr_assert_eq(x[i], (float)(i - 500));
        for (int bad = 0; bad < 3; bad++) {
            x[777] = bad == 0 ? INFINITY : bad == 1 ? -INFINITY : NAN;
            found = 0.0f;
            TU_OK(tdm_dev_copy_from_host(d, dx, x, sizeof x));
            TU_OK(tdm_dev_copy_from_host(d, dfound, &found, sizeof found));
            TU_OK(tdm_dev_unscale_check(d, dx, 1000, 0.5f, dfound));
            dev_down(d, &found, dfound, sizeof found);
            cr_assert_eq(found, 1.0f, "%s: case %d", tdm_dev_name(d), bad);
        }
        /* the flag is only ever set, never cleared */
        x[777] = 1.0f;
        found = 1.0f;
        TU_OK(tdm_dev_copy_from_host(d, dx, x, sizeof x));
        TU_OK(tdm_dev_copy_from_host(d, dfound, &found, sizeof found));
        TU_OK(tdm_dev_unscale_check(d, dx, 1000, 1.0f, dfound));
        dev_down(d, &found, dfound, sizeof found);
        cr_assert_eq(found, 1.0f);
        tdm_dev_free(d, dx);
        tdm_dev_free(d, dfound);
        tdm_device_free(d);
    }
}

Test(mixed, chunked_norm_is_the_double_sum)
{
    static const int64_t ns[] = {0, 1, 7, 4095, 4096, 4097, 12345};
    tdm_device *h = tu_host(), *e = open_dev(1);
    for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
        int64_t n = ns[t], nc = tdm_dev_sumsq_chunks(n);
        tdm_rng r = tu_rng(11);
        float *x = tu_malloc((size_t)(n + 1) * 4);
        double *p1 = tu_malloc((size_t)(nc + 1) * 8), *p2 = tu_malloc((size_t)(nc + 1) * 8);
        tu_fill(&r, x, n, -3, 3);
        TU_OK(tdm_dev_sumsq(h, x, n, p1));
        double tot = 0.0, ref = 0.0;
        for (int64_t c = 0; c < nc; c++) tot += p1[c];
        for (int64_t i = 0; i < n; i++) ref += (double)x[i] * x[i];
        cr_assert(tu_close(tot, ref, 0, (double)(n + 1) * 0x1p-52), "n %lld: %.17g vs %.17g", (long long)n, tot, ref);
        if (e) {
            float *dx = dev_up(e, x, (size_t)(n + 1) * 4);
            double *dp = dev_up(e, NULL, (size_t)(nc + 1) * 8);
            TU_OK(tdm_dev_sumsq(e, dx, n, dp));
            dev_down(e, p2, dp, (size_t)nc * 8);
            tdm_dev_free(e, dx);
            tdm_dev_free(e, dp);
            cr_assert(!memcmp(p1, p2, (size_t)nc * 8), "emulator's partials differ at n %lld", (long long)n);
        }
        free(x); free(p1); free(p2);
    }
    tdm_device_free(h);
    tdm_device_free(e);
}

/* ---- one thread per host device ---- */

static int count_threads(void)
{
    DIR *dir = opendir("/proc/self/task");
    cr_assert_not_null(dir);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dir)))
        if (de->d_name[0] != '.') n++;
    closedir(dir);
    return n;
}

typedef struct worker {
    pthread_barrier_t *bar;
    tdm_status st;
    int threads_seen;
} worker;

static void *gemm_worker(void *p)
{
    worker *w = p;
    tdm_device *d = NULL;
    w->st = tdm_device_open(&d, "cpu", 0, 1);
    int m = 256, n = 256, k = 256;
    uint16_t *a = calloc((size_t)m * k, 2), *b = calloc((size_t)k * n, 2);
    float *c = calloc((size_t)m * n, 4);
    for (int rep = 0; w->st == TDM_STATUS_OK && rep < 20; rep++)
        w->st = tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, m, n, k, 1, a, m, b, k, 0, c, m,
                                TDM_DTYPE_BFLOAT16);
    pthread_barrier_wait(w->bar);   /* both have run: count now */
    w->threads_seen = count_threads();
    pthread_barrier_wait(w->bar);
    free(a); free(b); free(c);
    tdm_device_free(d);
    return NULL;
}

Test(mixed, bf16_gemm_stays_on_the_devices_thread)
{
    int before = count_threads();
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    worker w[2] = {{.bar = &bar}, {.bar = &bar}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) cr_assert_eq(pthread_create(&t[i], NULL, gemm_worker, &w[i]), 0);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&bar);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(w[i].st, TDM_STATUS_OK, "%s", tdm_error_message());
        /* this thread, the two workers, and whatever ran before: no team */
        cr_assert_eq(w[i].threads_seen, before + 2, "%d threads with two workers (%d before): an "
                     "OpenMP team was started", w[i].threads_seen, before);
    }
}

static int maps_have(const char *what)
{
    FILE *f = fopen("/proc/self/maps", "r");
    cr_assert_not_null(f);
    char line[1024];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, what) != NULL;
    fclose(f);
    return found;
}

Test(mixed, onednn_is_loaded_at_the_first_bf16_product)
{
    cr_assert(!maps_have("libdnnl"), "libdnnl mapped before any bfloat16 product");
    tdm_device *d = tu_host();
    uint16_t a[4] = {0}, b[4] = {0};
    float c[4];
    TU_OK(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 2, 1, a, 2, b, 2, 0, c, 2,
                          TDM_DTYPE_FLOAT16));
    cr_assert(!maps_have("libdnnl"), "a float16 product needs no oneDNN");
    TU_OK(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 2, 1, a, 2, b, 2, 0, c, 2,
                          TDM_DTYPE_BFLOAT16));
    cr_assert(maps_have("libdnnl"));
    tdm_device_free(d);
}

Test(mixed, bf16_without_onednn_widens)
{
    setenv("TANDEM_DNNL_LIB", "/nonexistent/libdnnl.so.2", 1);
    setenv("TANDEM_DEBUG", "", 1);
    tdm_device *d = tu_host();
    for (int ta = 0; ta < 2; ta++) {
        double e = gemm_ex_case(d, TDM_DTYPE_BFLOAT16, (tdm_trans)ta, TDM_TRANS_N, 17, 33, 65, 0.5f,
                                1.0f, 1, 2, NULL, 77);
        cr_assert(e <= 1.0, "ta%d: error %.3g of the bound", ta, e);
    }
    cr_assert(!maps_have("libdnnl"));
    tdm_device_free(d);
}
