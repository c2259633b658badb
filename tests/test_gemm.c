/* tests/test_gemm.c: the host gemm behind the device interface
 * (core/device.h): tdm_dev_gemm with cublasSgemm's column-major arguments
 * against a naive double reference for every transpose pair, padded
 * leading dimensions, alpha/beta other than 0/1, odd and empty sizes; the
 * argument validation; and the row-major helper tdm_dev_gemm_rm. Not a
 * test of the CUDA backend (that compares against this one). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "tests/test_util.h"

/* Column-major element (r, c) of a matrix with leading dimension ld. */
#define CM(p, ld, r, c) ((p)[(size_t)(c) * (ld) + (r)])

/* C = alpha op(A) op(B) + beta C, column-major, in double. */
static void ref_gemm_cm(tdm_trans ta, tdm_trans tb, int m, int n, int k, double alpha,
                        const float *a, int lda, const float *b, int ldb, double beta,
                        double *c, int ldc)
{
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0.0;
            for (int p = 0; p < k; p++) {
                double av = ta == TDM_TRANS_N ? CM(a, lda, i, p) : CM(a, lda, p, i);
                double bv = tb == TDM_TRANS_N ? CM(b, ldb, p, j) : CM(b, ldb, j, p);
                s += av * bv;
            }
            CM(c, ldc, i, j) = alpha * s + (beta == 0.0 ? 0.0 : beta * CM(c, ldc, i, j));
        }
}

static const char *tname(tdm_trans t) { return t == TDM_TRANS_N ? "N" : "T"; }

/* One case: random A, B, C with padded leading dimensions; the padding of
 * C must be left untouched. Returns the max relative-to-tolerance error. */
static double gemm_case(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                        float alpha, float beta, int pad, uint64_t seed)
{
    tdm_rng r = tu_rng(seed);
    int arows = ta == TDM_TRANS_N ? m : k, acols = ta == TDM_TRANS_N ? k : m;
    int brows = tb == TDM_TRANS_N ? k : n, bcols = tb == TDM_TRANS_N ? n : k;
    int lda = (arows > 1 ? arows : 1) + pad, ldb = (brows > 1 ? brows : 1) + pad;
    int ldc = (m > 1 ? m : 1) + pad;
    size_t na = (size_t)lda * (acols > 0 ? acols : 1), nb = (size_t)ldb * (bcols > 0 ? bcols : 1);
    size_t nc = (size_t)ldc * (n > 0 ? n : 1);
    float *a = tu_malloc(na * sizeof(float)), *b = tu_malloc(nb * sizeof(float));
    float *c = tu_malloc(nc * sizeof(float));
    double *ref = tu_malloc(nc * sizeof(double));
    tu_fill(&r, a, (int64_t)na, -1.0f, 1.0f);
    tu_fill(&r, b, (int64_t)nb, -1.0f, 1.0f);
    tu_fill(&r, c, (int64_t)nc, -1.0f, 1.0f);
    for (size_t i = 0; i < nc; i++) ref[i] = c[i];
    ref_gemm_cm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, ref, ldc);
    TU_OK(tdm_dev_gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc));
    double worst = 0.0;
    for (int j = 0; j < (n > 0 ? n : 0); j++)
        for (int i = 0; i < ldc; i++) {
            double got = CM(c, ldc, i, j), want = CM(ref, ldc, i, j);
            if (i >= m) {
                cr_assert(got == want, "gemm %s%s m=%d n=%d k=%d: padding C(%d,%d) changed %g -> %g",
                          tname(ta), tname(tb), m, n, k, i, j, want, got);
                continue;
            }
            /* float accumulation over k terms of size <= 1 */
            double tol = 1e-5 * (1.0 + k) * (fabs(alpha) + 1.0) + 1e-6 * fabs(want);
            double e = fabs(got - want) / tol;
            if (e > worst) worst = e;
            cr_assert(e <= 1.0,
                      "gemm %s%s m=%d n=%d k=%d lda=%d ldb=%d ldc=%d alpha=%g beta=%g: "
                      "C(%d,%d) = %.8g, reference %.8g",
                      tname(ta), tname(tb), m, n, k, lda, ldb, ldc, (double)alpha, (double)beta,
                      i, j, got, want);
        }
    free(a);
    free(b);
    free(c);
    free(ref);
    return worst;
}

Test(gemm, column_major_all_transposes_sizes_and_scalars)
{
    tdm_device *d = tu_host();
    static const int sizes[] = {1, 7, 33, 64};
    static const float ab[][2] = {{1.0f, 0.0f}, {0.75f, -0.5f}, {-1.25f, 1.0f}, {2.0f, 0.3f}};
    uint64_t seed = 1;
    double worst = 0.0;
    int cases = 0;
    for (int t = 0; t < 4; t++) {
        tdm_trans ta = t & 1 ? TDM_TRANS_T : TDM_TRANS_N, tb = t & 2 ? TDM_TRANS_T : TDM_TRANS_N;
        for (int im = 0; im < 4; im++)
            for (int in = 0; in < 4; in++)
                for (int ik = 0; ik < 4; ik++) {
                    int s = (im + in + ik) % 4;
                    int pad = (im * 3 + ik) % 3 == 0 ? 0 : 1 + (im + in) % 5;
                    double w = gemm_case(d, ta, tb, sizes[im], sizes[in], sizes[ik], ab[s][0],
                                         ab[s][1], pad, seed++);
                    if (w > worst) worst = w;
                    cases++;
                }
    }
    fprintf(stderr, "gemm: %d cases, worst error / tolerance %.3f\n", cases, worst);
    tdm_device_free(d);
}

/* beta = 0 must ignore C's contents entirely (NaN in C does not leak). */
Test(gemm, beta_zero_ignores_nan_in_c)
{
    tdm_device *d = tu_host();
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
    float c[4];
    for (int i = 0; i < 4; i++) c[i] = NAN;
    /* A (2x3) col-major, B (3x2) col-major */
    TU_OK(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 3, 1.0f, a, 2, b, 3, 0.0f, c, 2));
    double ref[4] = {0};
    ref_gemm_cm(TDM_TRANS_N, TDM_TRANS_N, 2, 2, 3, 1.0, a, 2, b, 3, 0.0, ref, 2);
    for (int i = 0; i < 4; i++) cr_assert(c[i] == ref[i], "C[%d] = %g, expected %g", i, c[i], ref[i]);
    tdm_device_free(d);
}

/* m, n or k = 0: nothing to multiply. k = 0 scales C by beta (BLAS and
 * cuBLAS semantics); m or n = 0 touches nothing. */
Test(gemm, empty_sizes)
{
    tdm_device *d = tu_host();
    float a[16], b[16], c[16];
    tdm_rng r = tu_rng(5);
    tu_fill(&r, a, 16, -1, 1);
    tu_fill(&r, b, 16, -1, 1);
    for (int t = 0; t < 4; t++) {
        tdm_trans ta = t & 1 ? TDM_TRANS_T : TDM_TRANS_N, tb = t & 2 ? TDM_TRANS_T : TDM_TRANS_N;
        for (int i = 0; i < 16; i++) c[i] = (float)i;
        TU_OK(tdm_dev_gemm(d, ta, tb, 0, 3, 2, 1.0f, a, 3, b, 3, 0.5f, c, 1));
        TU_OK(tdm_dev_gemm(d, ta, tb, 3, 0, 2, 1.0f, a, 3, b, 3, 0.5f, c, 3));
        for (int i = 0; i < 16; i++)
            cr_assert(c[i] == (float)i, "m or n = 0 changed C[%d] to %g", i, (double)c[i]);
        /* k = 0: C = beta C */
        TU_OK(tdm_dev_gemm(d, ta, tb, 3, 4, 0, 1.0f, a, 3, b, 4, 0.5f, c, 3));
        for (int i = 0; i < 12; i++)
            cr_assert(c[i] == 0.5f * (float)i, "k = 0 (%s%s): C[%d] = %g, expected beta*C = %g",
                      tname(ta), tname(tb), i, (double)c[i], 0.5 * i);
        for (int i = 12; i < 16; i++) cr_assert(c[i] == (float)i);
        /* row-major helper with an empty dimension */
        for (int i = 0; i < 16; i++) c[i] = (float)i;
        TU_OK(tdm_dev_gemm_rm(d, ta, tb, 0, 4, 3, 1.0f, a, b, 0.0f, c));
        TU_OK(tdm_dev_gemm_rm(d, ta, tb, 4, 0, 3, 1.0f, a, b, 0.0f, c));
        for (int i = 0; i < 16; i++) cr_assert(c[i] == (float)i);
    }
    tdm_device_free(d);
}

Test(gemm, invalid_arguments_refused)
{
    tdm_device *d = tu_host();
    float a[64] = {0}, b[64] = {0}, c[64] = {0};
    struct {
        tdm_trans ta, tb;
        int m, n, k, lda, ldb, ldc;
        const char *why;
    } bad[] = {
        {TDM_TRANS_N, TDM_TRANS_N, 4, 3, 2, 3, 2, 4, "lda < m (A not transposed)"},
        {TDM_TRANS_T, TDM_TRANS_N, 4, 3, 2, 1, 2, 4, "lda < k (A transposed)"},
        {TDM_TRANS_N, TDM_TRANS_N, 4, 3, 2, 4, 1, 4, "ldb < k (B not transposed)"},
        {TDM_TRANS_N, TDM_TRANS_T, 4, 3, 2, 4, 2, 4, "ldb < n (B transposed)"},
        {TDM_TRANS_N, TDM_TRANS_N, 4, 3, 2, 4, 2, 3, "ldc < m"},
        {TDM_TRANS_N, TDM_TRANS_N, 1, 1, 1, 0, 1, 1, "lda = 0"},
        {TDM_TRANS_N, TDM_TRANS_N, 1, 1, 1, 1, 0, 1, "ldb = 0"},
        {TDM_TRANS_N, TDM_TRANS_N, 1, 1, 1, 1, 1, 0, "ldc = 0"},
        {TDM_TRANS_N, TDM_TRANS_N, -1, 1, 1, 1, 1, 1, "m < 0"},
        {TDM_TRANS_N, TDM_TRANS_N, 1, -1, 1, 1, 1, 1, "n < 0"},
        {TDM_TRANS_N, TDM_TRANS_N, 1, 1, -1, 1, 1, 1, "k < 0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int j = 0; j < 64; j++) c[j] = 7.0f;
        tdm_status st = tdm_dev_gemm(d, bad[i].ta, bad[i].tb, bad[i].m, bad[i].n, bad[i].k, 1.0f,
                                     a, bad[i].lda, b, bad[i].ldb, 0.0f, c, bad[i].ldc);
        cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "%s: status %s, expected invalid argument",
                     bad[i].why, tdm_status_name(st));
        cr_assert(strstr(tdm_error_message(), "gemm"), "%s: message '%s' does not name gemm",
                  bad[i].why, tdm_error_message());
        for (int j = 0; j < 64; j++) cr_assert(c[j] == 7.0f, "%s: C written", bad[i].why);
    }
    tdm_device_free(d);
}

/* Row-major C (m,n) = alpha op(A) op(B) + beta C with op(A) (m,k), op(B)
 * (k,n); stored A is (m,k) or (k,m), B (k,n) or (n,k), all dense. */
Test(gemm, row_major_helper_all_transposes)
{
    tdm_device *d = tu_host();
    static const int sizes[] = {1, 2, 7, 33};
    uint64_t seed = 1000;
    for (int t = 0; t < 4; t++) {
        tdm_trans ta = t & 1 ? TDM_TRANS_T : TDM_TRANS_N, tb = t & 2 ? TDM_TRANS_T : TDM_TRANS_N;
        for (int im = 0; im < 4; im++)
            for (int in = 0; in < 4; in++)
                for (int ik = 0; ik < 4; ik++) {
                    int m = sizes[im], n = sizes[in], k = sizes[ik];
                    float alpha = (ik & 1) ? -0.7f : 1.0f, beta = (in & 1) ? 0.25f : 0.0f;
                    tdm_rng r = tu_rng(seed++);
                    float *a = tu_malloc((size_t)m * k * sizeof(float));
                    float *b = tu_malloc((size_t)k * n * sizeof(float));
                    float *c = tu_malloc((size_t)m * n * sizeof(float));
                    tu_fill(&r, a, (int64_t)m * k, -1, 1);
                    tu_fill(&r, b, (int64_t)k * n, -1, 1);
                    tu_fill(&r, c, (int64_t)m * n, -1, 1);
                    double *ref = tu_malloc((size_t)m * n * sizeof(double));
                    for (int i = 0; i < m; i++)
                        for (int j = 0; j < n; j++) {
                            double s = 0.0;
                            for (int p = 0; p < k; p++) {
                                double av = ta == TDM_TRANS_N ? a[(size_t)i * k + p] : a[(size_t)p * m + i];
                                double bv = tb == TDM_TRANS_N ? b[(size_t)p * n + j] : b[(size_t)j * k + p];
                                s += av * bv;
                            }
                            ref[(size_t)i * n + j] = alpha * s + beta * c[(size_t)i * n + j];
                        }
                    TU_OK(tdm_dev_gemm_rm(d, ta, tb, m, n, k, alpha, a, b, beta, c));
                    for (int i = 0; i < m * n; i++)
                        cr_assert(tu_close(c[i], ref[i], 1e-5 * (1 + k), 1e-6),
                                  "gemm_rm %s%s m=%d n=%d k=%d: C[%d][%d] = %.8g, reference %.8g",
                                  tname(ta), tname(tb), m, n, k, i / n, i % n, (double)c[i], ref[i]);
                    free(a);
                    free(b);
                    free(c);
                    free(ref);
                }
    }
    tdm_device_free(d);
}
