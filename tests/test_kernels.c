/* tests/test_kernels.c: the host backend's elementwise and row-wise kernels
 * (core/kernels.h through core/device_host.c) against naive references:
 * softmax cross-entropy (double reference, huge logits, bad labels),
 * im2col / col2im (direct and adjointness), max pooling forward/backward,
 * batchnorm statistics, layout transposes, axpy, scale, bias+relu and its
 * backward. gemm is in test_gemm.c; whole layers in test_layers.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/kernels.h"
#include "models/model.h"
#include "tests/test_util.h"

static tdm_device *g_dev;
static void setup(void) { g_dev = tu_host(); }
static void teardown(void) { tdm_device_free(g_dev); }
TestSuite(kernels, .init = setup, .fini = teardown);

/* ---- softmax cross-entropy ---- */

static void ref_xent_row(const float *z, int cols, int y, double scale, double *loss, double *dz)
{
    double mx = z[0];
    for (int j = 1; j < cols; j++) mx = z[j] > mx ? z[j] : mx;
    double s = 0.0;
    for (int j = 0; j < cols; j++) s += exp((double)z[j] - mx);
    *loss = mx + log(s) - z[y];
    for (int j = 0; j < cols; j++) dz[j] = (exp((double)z[j] - mx) / s - (j == y)) * scale;
}

Test(kernels, softmax_xent_matches_double_reference)
{
    static const int shapes[][2] = {{1, 1}, {1, 2}, {3, 10}, {17, 7}, {5, 1000}};
    static const float scales[] = {1.0f, 0.25f, 1.0f / 17.0f};
    double worst_l = 0.0, worst_g = 0.0;
    for (size_t si = 0; si < 5; si++) {
        int rows = shapes[si][0], cols = shapes[si][1];
        tdm_rng r = tu_rng(40 + si);
        float *z = tu_malloc((size_t)rows * cols * sizeof(float));
        float *dz = tu_malloc((size_t)rows * cols * sizeof(float));
        float *loss = tu_malloc((size_t)rows * sizeof(float));
        int32_t *y = tu_malloc((size_t)rows * sizeof(int32_t));
        double *rdz = tu_malloc((size_t)cols * sizeof(double));
        for (int rr = 0; rr < rows; rr++) {
            /* some rows at huge magnitude: exp without the max shift would overflow */
            float off = rr % 3 == 1 ? 1000.0f : rr % 3 == 2 ? -1000.0f : 0.0f;
            for (int j = 0; j < cols; j++) z[(size_t)rr * cols + j] = off + tu_unif(&r, -8, 8);
            y[rr] = (int32_t)tdm_rng_below(&r, (uint64_t)cols);
        }
        for (size_t ci = 0; ci < 3; ci++) {
            TU_OK(tdm_dev_softmax_xent(g_dev, z, y, rows, cols, scales[ci], loss, dz));
            double sum = 0.0;
            for (int rr = 0; rr < rows; rr++) {
                double rl;
                ref_xent_row(z + (size_t)rr * cols, cols, y[rr], scales[ci], &rl, rdz);
                sum += rl;
                cr_assert(isfinite(loss[rr]), "rows %d cols %d: loss[%d] not finite", rows, cols, rr);
                double el = fabs(loss[rr] - rl) / (1e-5 + 1e-5 * fabs(rl));
                worst_l = el > worst_l ? el : worst_l;
                cr_assert(el <= 1.0, "rows %d cols %d: loss[%d] = %.9g, reference %.9g", rows, cols,
                          rr, (double)loss[rr], rl);
                double gs = 0.0;
                for (int j = 0; j < cols; j++) {
                    double g = dz[(size_t)rr * cols + j];
                    gs += g;
                    double eg = fabs(g - rdz[j]) / (1e-6 + 1e-5 * fabs(rdz[j]));
                    worst_g = eg > worst_g ? eg : worst_g;
                    cr_assert(eg <= 1.0, "rows %d cols %d scale %g: dz[%d][%d] = %.9g, ref %.9g",
                              rows, cols, (double)scales[ci], rr, j, g, rdz[j]);
                }
                /* softmax - onehot sums to zero */
                cr_assert(fabs(gs) < 1e-5, "row %d: gradient sums to %g", rr, gs);
            }
            /* the loss wrapper: sum of the rows, dlogits optional */
            double s2 = -1.0;
            TU_OK(tdm_loss_softmax_xent(g_dev, z, y, rows, cols, 1.0f, &s2, NULL));
            cr_assert(tu_close(s2, sum, 1e-5 * rows, 1e-6), "loss sum %.9g, reference %.9g", s2, sum);
        }
        free(z);
        free(dz);
        free(loss);
        free(y);
        free(rdz);
    }
    fprintf(stderr, "softmax_xent: worst loss err/tol %.3f, grad err/tol %.3f\n", worst_l, worst_g);
}

Test(kernels, softmax_xent_refuses_bad_labels)
{
    float z[6] = {0, 1, 2, 3, 4, 5}, loss[2], dz[6];
    const int32_t bad[][2] = {{0, 3}, {-1, 0}, {2, 100}};
    for (int i = 0; i < 3; i++) {
        tdm_status st = tdm_dev_softmax_xent(g_dev, z, bad[i], 2, 3, 1.0f, loss, dz);
        cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "labels {%d, %d} of 3 classes accepted", bad[i][0],
                     bad[i][1]);
        cr_assert(strstr(tdm_error_message(), "label"), "message: %s", tdm_error_message());
        double s;
        st = tdm_loss_softmax_xent(g_dev, z, bad[i], 2, 3, 1.0f, &s, dz);
        cr_assert_eq(st, TDM_STATUS_INVALID_ARG);
    }
    double s;
    cr_assert_eq(tdm_loss_softmax_xent(g_dev, z, bad[0], 0, 3, 1.0f, &s, NULL), TDM_STATUS_INVALID_ARG);
}

/* ---- im2col / col2im ---- */

static tdm_conv_geom geom(int n, int c, int h, int w, int k, int stride, int pad)
{
    tdm_conv_geom g = {.n = n, .c = c, .h = h, .w = w, .kh = k, .kw = k, .stride = stride, .pad = pad};
    g.oh = (h + 2 * pad - k) / stride + 1;
    g.ow = (w + 2 * pad - k) / stride + 1;
    return g;
}

static const int g_geoms[][7] = {
    /* n, c, h, w, k, stride, pad */
    {1, 1, 3, 3, 3, 1, 1}, {2, 3, 5, 7, 3, 1, 1}, {3, 2, 6, 6, 3, 2, 1}, {2, 2, 7, 5, 2, 2, 0},
    {1, 4, 4, 4, 3, 1, 0}, {2, 1, 9, 4, 3, 2, 0}, {4, 3, 1, 1, 3, 1, 1}, {2, 2, 8, 6, 5, 1, 2},
};

Test(kernels, im2col_matches_reference_and_col2im_is_its_adjoint)
{
    for (size_t gi = 0; gi < sizeof g_geoms / sizeof g_geoms[0]; gi++) {
        const int *q = g_geoms[gi];
        tdm_conv_geom g = geom(q[0], q[1], q[2], q[3], q[4], q[5], q[6]);
        int64_t nx = (int64_t)g.c * g.n * g.h * g.w;
        int64_t rows = (int64_t)g.c * g.kh * g.kw, cols = (int64_t)g.n * g.oh * g.ow;
        float *x = tu_malloc((size_t)nx * sizeof(float)), *dx = tu_malloc((size_t)nx * sizeof(float));
        float *col = tu_malloc((size_t)(rows * cols) * sizeof(float));
        float *c2 = tu_malloc((size_t)(rows * cols) * sizeof(float));
        tdm_rng r = tu_rng(60 + gi);
        tu_fill(&r, x, nx, -1, 1);
        tu_fill(&r, c2, rows * cols, -1, 1);
        TU_OK(tdm_dev_im2col(g_dev, &g, x, col));
        /* direct: row (ci, ki, kj), column (n, oy, ox); x is (C, N, H, W) */
        for (int ci = 0; ci < g.c; ci++)
            for (int ki = 0; ki < g.kh; ki++)
                for (int kj = 0; kj < g.kw; kj++)
                    for (int n = 0; n < g.n; n++)
                        for (int oy = 0; oy < g.oh; oy++)
                            for (int ox = 0; ox < g.ow; ox++) {
                                int iy = oy * g.stride - g.pad + ki, ix = ox * g.stride - g.pad + kj;
                                float want = (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w)
                                                 ? 0.0f
                                                 : x[(((size_t)ci * g.n + n) * g.h + iy) * g.w + ix];
                                int64_t row = (ci * g.kh + ki) * g.kw + kj;
                                int64_t cc = ((int64_t)n * g.oh + oy) * g.ow + ox;
                                cr_assert(col[row * cols + cc] == want,
                                          "geom %zu: col[%lld][%lld] = %g, expected %g", gi,
                                          (long long)row, (long long)cc, (double)col[row * cols + cc],
                                          (double)want);
                            }
        /* adjointness: <im2col(x), c> == <x, col2im(c)> */
        for (int64_t i = 0; i < nx; i++) dx[i] = 12345.0f; /* col2im writes, never adds */
        TU_OK(tdm_dev_col2im(g_dev, &g, c2, dx));
        double lhs = 0.0, rhs = 0.0, mag = 0.0;
        for (int64_t i = 0; i < rows * cols; i++) {
            lhs += (double)col[i] * c2[i];
            mag += fabs((double)col[i] * c2[i]);
        }
        for (int64_t i = 0; i < nx; i++) rhs += (double)x[i] * dx[i];
        cr_assert(fabs(lhs - rhs) <= 1e-6 * (1.0 + mag),
                  "geom %zu (n%d c%d %dx%d k%d s%d p%d): <im2col x, c> = %.10g but <x, col2im c> = %.10g",
                  gi, g.n, g.c, g.h, g.w, g.kh, g.stride, g.pad, lhs, rhs);
        free(x);
        free(dx);
        free(col);
        free(c2);
    }
}

/* The host runs im2col and col2im as row copies and row scatters
 * (core/kernels.h's tdm_k_im2col_row, tdm_k_col2im_add_row); CUDA runs the
 * per-element tdm_k_im2col / tdm_k_col2im. Both must give the same bits,
 * col2im included (the same additions in the same order). */
Test(kernels, host_row_forms_equal_the_per_element_kernels_bitwise)
{
    for (size_t gi = 0; gi < sizeof g_geoms / sizeof g_geoms[0]; gi++) {
        const int *q = g_geoms[gi];
        tdm_conv_geom g = geom(q[0], q[1], q[2], q[3], q[4], q[5], q[6]);
        int64_t nx = (int64_t)g.c * g.n * g.h * g.w;
        int64_t rows = (int64_t)g.c * g.kh * g.kw, cols = (int64_t)g.n * g.oh * g.ow;
        float *x = tu_malloc((size_t)nx * sizeof(float)), *dx = tu_malloc((size_t)nx * sizeof(float));
        float *rdx = tu_malloc((size_t)nx * sizeof(float));
        float *col = tu_malloc((size_t)(rows * cols) * sizeof(float));
        float *rcol = tu_malloc((size_t)(rows * cols) * sizeof(float));
        tdm_rng r = tu_rng(90 + gi);
        tu_fill(&r, x, nx, -1, 1);
        TU_OK(tdm_dev_im2col(g_dev, &g, x, col));
        int64_t i = 0;
        for (int ci = 0; ci < g.c; ci++)
            for (int ki = 0; ki < g.kh; ki++)
                for (int kj = 0; kj < g.kw; kj++)
                    for (int n = 0; n < g.n; n++)
                        for (int oy = 0; oy < g.oh; oy++)
                            for (int ox = 0; ox < g.ow; ox++, i++)
                                tdm_k_im2col(i, ci, ki, kj, n, oy, ox, g, x, rcol);
        cr_assert(!memcmp(col, rcol, (size_t)(rows * cols) * sizeof(float)),
                  "geom %zu: host im2col differs from tdm_k_im2col", gi);
        tu_fill(&r, col, rows * cols, -1, 1);
        TU_OK(tdm_dev_col2im(g_dev, &g, col, dx));
        i = 0;
        for (int ci = 0; ci < g.c; ci++)
            for (int n = 0; n < g.n; n++)
                for (int iy = 0; iy < g.h; iy++)
                    for (int ix = 0; ix < g.w; ix++) tdm_k_col2im(ci, n, iy, ix, g, col, rdx);
        for (int64_t j = 0; j < nx; j++)
            cr_assert(!memcmp(&dx[j], &rdx[j], sizeof(float)),
                      "geom %zu (k%d s%d p%d): host col2im dx[%lld] = %.9g, tdm_k_col2im %.9g", gi,
                      g.kh, g.stride, g.pad, (long long)j, (double)dx[j], (double)rdx[j]);
        free(x);
        free(dx);
        free(rdx);
        free(col);
        free(rcol);
    }
}

/* A geometry over a chunk of images [n0, n0 + nb) of a batch of N (ns = N,
 * x and dx at the chunk's first image): im2col gives the whole batch's
 * col columns of those images, col2im writes those images of dx with the
 * whole batch's values and leaves the others alone; the host's row forms
 * and the per-element kernels (what CUDA runs) alike, bit for bit. Chunks
 * of 1, 2 and 3 images, the last one partial. A stride below the chunk
 * is refused. */
Test(kernels, im2col_col2im_over_a_chunk_of_the_batch)
{
    for (size_t gi = 0; gi < sizeof g_geoms / sizeof g_geoms[0]; gi++) {
        const int *q = g_geoms[gi];
        tdm_conv_geom g = geom(q[0] + 3, q[1], q[2], q[3], q[4], q[5], q[6]);
        int N = g.n;
        int64_t plane = (int64_t)g.h * g.w, per = (int64_t)g.oh * g.ow;
        int64_t nx = (int64_t)g.c * N * plane;
        int64_t rows = (int64_t)g.c * g.kh * g.kw, cols = (int64_t)N * per;
        float *x = tu_malloc((size_t)nx * sizeof(float));
        float *col = tu_malloc((size_t)(rows * cols) * sizeof(float));
        float *dcol = tu_malloc((size_t)(rows * cols) * sizeof(float));
        float *dxw = tu_malloc((size_t)nx * sizeof(float)), *dx = tu_malloc((size_t)nx * sizeof(float));
        float *rdx = tu_malloc((size_t)nx * sizeof(float));
        float *cc = tu_malloc((size_t)(rows * cols) * sizeof(float));
        float *rc = tu_malloc((size_t)(rows * cols) * sizeof(float));
        tdm_rng r = tu_rng(130 + gi);
        tu_fill(&r, x, nx, -1, 1);
        tu_fill(&r, dcol, rows * cols, -1, 1);
        TU_OK(tdm_dev_im2col(g_dev, &g, x, col));
        TU_OK(tdm_dev_col2im(g_dev, &g, dcol, dxw));
        for (int nb = 1; nb <= 3; nb++) {
            for (int64_t i = 0; i < nx; i++) dx[i] = rdx[i] = 777.0f;
            for (int n0 = 0; n0 < N; n0 += nb) {
                int cnt = N - n0 < nb ? N - n0 : nb;
                int64_t cn = (int64_t)cnt * per;
                tdm_conv_geom gc = g;
                gc.n = cnt;
                gc.ns = N;
                TU_OK(tdm_dev_im2col(g_dev, &gc, x + n0 * plane, cc));
                int64_t i = 0;
                for (int ci = 0; ci < g.c; ci++)
                    for (int ki = 0; ki < g.kh; ki++)
                        for (int kj = 0; kj < g.kw; kj++)
                            for (int n = 0; n < cnt; n++)
                                for (int oy = 0; oy < g.oh; oy++)
                                    for (int ox = 0; ox < g.ow; ox++, i++)
                                        tdm_k_im2col(i, ci, ki, kj, n, oy, ox, gc, x + n0 * plane, rc);
                for (int64_t row = 0; row < rows; row++) {
                    const float *whole = col + row * cols + n0 * per;
                    cr_assert(!memcmp(cc + row * cn, whole, (size_t)cn * sizeof(float)),
                              "geom %zu chunk %d at %d: im2col row %lld differs from the batch's",
                              gi, nb, n0, (long long)row);
                    cr_assert(!memcmp(rc + row * cn, whole, (size_t)cn * sizeof(float)),
                              "geom %zu chunk %d at %d: tdm_k_im2col row %lld differs from the "
                              "batch's", gi, nb, n0, (long long)row);
                    /* the chunk's columns of dcol, as col2im's input */
                    memcpy(cc + row * cn, dcol + row * cols + n0 * per, (size_t)cn * sizeof(float));
                }
                TU_OK(tdm_dev_col2im(g_dev, &gc, cc, dx + n0 * plane));
                for (int ci = 0; ci < g.c; ci++)
                    for (int n = 0; n < cnt; n++)
                        for (int iy = 0; iy < g.h; iy++)
                            for (int ix = 0; ix < g.w; ix++)
                                tdm_k_col2im(ci, n, iy, ix, gc, cc, rdx + n0 * plane);
                /* images past the chunk are still untouched */
                for (int ci = 0; ci < g.c; ci++)
                    for (int64_t k = (ci * (int64_t)N + n0 + cnt) * plane;
                         k < (ci + 1) * (int64_t)N * plane; k++)
                        cr_assert(dx[k] == 777.0f && rdx[k] == 777.0f,
                                  "geom %zu chunk %d at %d: col2im wrote dx[%lld] outside the chunk",
                                  gi, nb, n0, (long long)k);
            }
            for (int64_t k = 0; k < nx; k++)
                cr_assert(!memcmp(&dx[k], &dxw[k], sizeof(float)) &&
                              !memcmp(&rdx[k], &dxw[k], sizeof(float)),
                          "geom %zu chunks of %d: col2im dx[%lld] = %.9g (per element %.9g), "
                          "whole batch %.9g", gi, nb, (long long)k, (double)dx[k], (double)rdx[k],
                          (double)dxw[k]);
        }
        tdm_conv_geom bad = g;
        bad.n = 2;
        bad.ns = 1;
        cr_assert_eq(tdm_dev_im2col(g_dev, &bad, x, cc), TDM_STATUS_INVALID_ARG);
        cr_assert_eq(tdm_dev_col2im(g_dev, &bad, cc, dx), TDM_STATUS_INVALID_ARG);
        free(x);
        free(col);
        free(dcol);
        free(dxw);
        free(dx);
        free(rdx);
        free(cc);
        free(rc);
    }
}

/* ---- max pooling ---- */

Test(kernels, maxpool_forward_backward)
{
    static const int pg[][5] = {{2, 3, 4, 4, 2}, {1, 2, 5, 7, 2}, {3, 1, 6, 6, 3}, {2, 2, 2, 2, 2}, {1, 1, 3, 3, 2}};
    for (size_t gi = 0; gi < 5; gi++) {
        tdm_conv_geom g = {.n = pg[gi][0], .c = pg[gi][1], .h = pg[gi][2], .w = pg[gi][3],
                           .kh = pg[gi][4], .kw = pg[gi][4], .stride = pg[gi][4], .pad = 0};
        g.oh = g.h / g.kh;
        g.ow = g.w / g.kw;
        int64_t planes = (int64_t)g.c * g.n, nx = planes * g.h * g.w, ny = planes * g.oh * g.ow;
        float *x = tu_malloc((size_t)nx * sizeof(float)), *y = tu_malloc((size_t)ny * sizeof(float));
        float *dy = tu_malloc((size_t)ny * sizeof(float)), *dx = tu_malloc((size_t)nx * sizeof(float));
        int32_t *am = tu_malloc((size_t)ny * sizeof(int32_t));
        tdm_rng r = tu_rng(70 + gi);
        tu_fill(&r, x, nx, -1, 1);
        tu_fill(&r, dy, ny, -1, 1);
        TU_OK(tdm_dev_maxpool_fwd(g_dev, &g, x, y, am));
        float *rdx = tu_malloc((size_t)nx * sizeof(float));
        for (int64_t p = 0; p < planes; p++)
            for (int oy = 0; oy < g.oh; oy++)
                for (int ox = 0; ox < g.ow; ox++) {
                    const float *xp = x + p * g.h * g.w;
                    int best = -1;
                    for (int ki = 0; ki < g.kh; ki++)
                        for (int kj = 0; kj < g.kw; kj++) {
                            int off = (oy * g.stride + ki) * g.w + ox * g.stride + kj;
                            if (best < 0 || xp[off] > xp[best]) best = off;
                        }
                    int64_t o = (p * g.oh + oy) * g.ow + ox;
                    cr_assert(y[o] == xp[best] && am[o] == best,
                              "pool %zu: y[%lld] = %g (argmax %d), expected %g (argmax %d)", gi,
                              (long long)o, (double)y[o], am[o], (double)xp[best], best);
                    rdx[p * g.h * g.w + best] += dy[o];
                }
        for (int64_t i = 0; i < nx; i++) dx[i] = 999.0f;
        TU_OK(tdm_dev_maxpool_bwd(g_dev, &g, dy, am, dx));
        for (int64_t i = 0; i < nx; i++)
            cr_assert(dx[i] == rdx[i], "pool %zu: dx[%lld] = %g, expected %g", gi, (long long)i,
                      (double)dx[i], (double)rdx[i]);
        free(x);
        free(y);
        free(dy);
        free(dx);
        free(am);
        free(rdx);
    }
}

/* NaN wins a window, as in PyTorch (here the last NaN in window order),
 * for the unrolled 2x2 window and the general loop (3x3). */
Test(kernels, maxpool_nan_wins)
{
    for (int k = 2; k <= 3; k++) {
        tdm_conv_geom g = {.n = 1, .c = 1, .h = k, .w = k, .kh = k, .kw = k, .stride = k,
                           .pad = 0, .oh = 1, .ow = 1};
        float x[9], y = 0;
        int32_t am = -1;
        for (int i = 0; i < k * k; i++) x[i] = (float)i;
        x[1] = NAN;
        x[k] = NAN;                       /* two NaNs: the later one wins */
        TU_OK(tdm_dev_maxpool_fwd(g_dev, &g, x, &y, &am));
        cr_assert(y != y, "%dx%d: max %g, expected NaN", k, k, (double)y);
        cr_assert_eq(am, k, "%dx%d: argmax %d", k, k, am);
        x[1] = x[k] = 0.0f;
        TU_OK(tdm_dev_maxpool_fwd(g_dev, &g, x, &y, &am));
        cr_assert_eq(y, (float)(k * k - 1));
        cr_assert_eq(am, k * k - 1);
    }
}

/* The host's 2x2 pooling (its own loop, which a faster host form would
 * replace) against the per-element kernel CUDA runs (the window in order),
 * bit for bit, value and argmax, over every window of values from
 * {1, 2, -0, +0, NaN}: ties, signed zeros and NaNs in every position. A
 * tree of pairs with ties going to the later element fails it. */
Test(kernels, maxpool_2x2_host_equals_the_per_element_kernel_on_ties_and_nans)
{
    static const float vals[5] = {1.0f, 2.0f, -0.0f, 0.0f, NAN};
    enum { W = 625 }; /* 5^4 windows side by side in one 2 x (2 W) plane */
    tdm_conv_geom g = {.n = 1, .c = 1, .h = 2, .w = 2 * W, .kh = 2, .kw = 2, .stride = 2,
                       .pad = 0, .oh = 1, .ow = W};
    float *x = tu_malloc((size_t)4 * W * sizeof(float)), *y = tu_malloc((size_t)W * sizeof(float));
    float *ry = tu_malloc((size_t)W * sizeof(float));
    int32_t *am = tu_malloc((size_t)W * sizeof(int32_t)), *ram = tu_malloc((size_t)W * sizeof(int32_t));
    for (int k = 0; k < W; k++) {
        int q = k;
        x[2 * k] = vals[q % 5], q /= 5;
        x[2 * k + 1] = vals[q % 5], q /= 5;
        x[2 * W + 2 * k] = vals[q % 5], q /= 5;
        x[2 * W + 2 * k + 1] = vals[q % 5];
    }
    TU_OK(tdm_dev_maxpool_fwd(g_dev, &g, x, y, am));
    for (int k = 0; k < W; k++) tdm_k_maxpool_fwd(k, 0, 0, k, g, x, ry, ram);
    for (int k = 0; k < W; k++)
        cr_assert(!memcmp(&y[k], &ry[k], sizeof(float)) && am[k] == ram[k],
                  "window %d (%g %g / %g %g): host %g at %d, per element %g at %d", k,
                  (double)x[2 * k], (double)x[2 * k + 1], (double)x[2 * W + 2 * k],
                  (double)x[2 * W + 2 * k + 1], (double)y[k], am[k], (double)ry[k], ram[k]);
    free(x);
    free(y);
    free(ry);
    free(am);
    free(ram);
}

/* ---- batchnorm statistics ---- */

Test(kernels, bn_stats_two_pass_precision)
{
    static const float offs[] = {0.0f, 1000.0f, -3e4f};
    for (int oi = 0; oi < 3; oi++) {
        int ch = 3;
        int64_t len = 4099;
        float *x = tu_malloc((size_t)(ch * len) * sizeof(float));
        float mean[3], var[3];
        tdm_rng r = tu_rng(80 + oi);
        for (int c = 0; c < ch; c++)
            for (int64_t j = 0; j < len; j++)
                x[c * len + j] = offs[oi] + (float)(c + 1) * tu_unif(&r, -1, 1);
        TU_OK(tdm_dev_bn_stats(g_dev, x, ch, len, mean, var));
        for (int c = 0; c < ch; c++) {
            double s = 0, q = 0;
            for (int64_t j = 0; j < len; j++) s += x[c * len + j];
            double m = s / len;
            for (int64_t j = 0; j < len; j++) q += (x[c * len + j] - m) * (x[c * len + j] - m);
            q /= len;
            cr_assert(tu_close(mean[c], m, 1e-6, 1e-6), "offset %g ch %d: mean %.9g, ref %.9g",
                      (double)offs[oi], c, (double)mean[c], m);
            cr_assert(tu_close(var[c], q, 1e-6, 1e-5), "offset %g ch %d: biased var %.9g, ref %.9g",
                      (double)offs[oi], c, (double)var[c], q);
        }
        free(x);
    }
}

/* The host's vectorised batchnorm reductions are TDM_K_BN_LANES strided
 * slices of the shared slice functions added as a tree: check the bits
 * against that decomposition (lengths around the lane count included). */
static double lanes_tree(double *p)
{
    for (int s = TDM_K_BN_LANES / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; t++) p[t] += p[t + s];
    return p[0];
}

Test(kernels, bn_host_reductions_are_the_lane_slices)
{
    static const int64_t lens[] = {1, 5, 8, 9, 17, 4099};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int ch = 2;
        int64_t len = lens[li];
        float *x = tu_malloc((size_t)(ch * len) * sizeof(float));
        float *dy = tu_malloc((size_t)(ch * len) * sizeof(float));
        float mean[2], var[2], istd[2], gamma[2] = {0.7f, -1.3f}, dg[2] = {0}, db[2] = {0};
        tdm_rng r = tu_rng(100 + li);
        tu_fill(&r, x, ch * len, -2, 3);
        tu_fill(&r, dy, ch * len, -1, 1);
        TU_OK(tdm_dev_bn_stats(g_dev, x, ch, len, mean, var));
        for (int c = 0; c < ch; c++) {
            const float *row = x + c * len;
            double p[TDM_K_BN_LANES];
            for (int t = 0; t < TDM_K_BN_LANES; t++) p[t] = tdm_k_bn_sum_part(row, len, t, TDM_K_BN_LANES);
            double m = lanes_tree(p) / (double)len;
            for (int t = 0; t < TDM_K_BN_LANES; t++)
                p[t] = tdm_k_bn_sqdev_part(row, len, m, t, TDM_K_BN_LANES);
            float wm[1], wv[1];
            tdm_k_bn_stats_store(0, m, lanes_tree(p), len, wm, wv);
            cr_assert(!memcmp(&mean[c], wm, 4) && !memcmp(&var[c], wv, 4),
                      "len %lld ch %d: mean %.9g var %.9g, lanes give %.9g %.9g", (long long)len, c,
                      (double)mean[c], (double)var[c], (double)wm[0], (double)wv[0]);
            istd[c] = 1.0f / sqrtf(var[c] + 1e-5f);
        }
        TU_OK(tdm_dev_bn_bwd(g_dev, x, dy, ch, len, mean, istd, gamma, NULL, dg, db, 1));
        for (int c = 0; c < ch; c++) {
            double a[TDM_K_BN_LANES], b[TDM_K_BN_LANES];
            for (int t = 0; t < TDM_K_BN_LANES; t++)
                tdm_k_bn_bwd_part(x + c * len, dy + c * len, len, mean[c], istd[c], t, TDM_K_BN_LANES,
                                  &a[t], &b[t]);
            float wg[1] = {0}, wb[1] = {0};
            tdm_k_bn_bwd_params(0, lanes_tree(a), lanes_tree(b), wg, wb);
            cr_assert(!memcmp(&dg[c], wg, 4) && !memcmp(&db[c], wb, 4),
                      "len %lld ch %d: dgamma %.9g dbeta %.9g, lanes give %.9g %.9g",
                      (long long)len, c, (double)dg[c], (double)db[c], (double)wg[0], (double)wb[0]);
        }
        free(x);
        free(dy);
    }
}

/* ---- layouts, axpy, scale, bias_act, relu_bwd ---- */

Test(kernels, cnhw_nchw_round_trip)
{
    static const int sh[][3] = {{1, 1, 1}, {3, 2, 5}, {4, 7, 9}, {2, 1, 16}};
    for (int si = 0; si < 4; si++) {
        int c = sh[si][0], n = sh[si][1];
        int64_t f = sh[si][2], tot = c * n * f;
        float *x = tu_malloc((size_t)tot * sizeof(float)), *y = tu_malloc((size_t)tot * sizeof(float));
        float *z = tu_malloc((size_t)tot * sizeof(float));
        for (int64_t i = 0; i < tot; i++) x[i] = (float)i;
        TU_OK(tdm_dev_cnhw_to_nchw(g_dev, x, y, c, n, f));
        for (int ni = 0; ni < n; ni++)
            for (int ci = 0; ci < c; ci++)
                for (int64_t fi = 0; fi < f; fi++)
                    cr_assert(y[((int64_t)ni * c + ci) * f + fi] == x[((int64_t)ci * n + ni) * f + fi]);
        TU_OK(tdm_dev_nchw_to_cnhw(g_dev, y, z, c, n, f));
        cr_assert(memcmp(x, z, (size_t)tot * sizeof(float)) == 0, "round trip c%d n%d f%lld differs",
                  c, n, (long long)f);
        free(x);
        free(y);
        free(z);
    }
}

Test(kernels, axpy_scale_bias_act_relu_bwd)
{
    int64_t n = 37;
    float x[37], y[37], y0[37];
    tdm_rng r = tu_rng(90);
    tu_fill(&r, x, n, -2, 2);
    tu_fill(&r, y0, n, -2, 2);
    memcpy(y, y0, sizeof y);
    TU_OK(tdm_dev_axpy(g_dev, n, -0.75f, x, y));
    for (int i = 0; i < n; i++)
        cr_assert(y[i] == y0[i] + -0.75f * x[i], "axpy[%d] = %g, expected %g", i, (double)y[i],
                  (double)(y0[i] + -0.75f * x[i]));
    memcpy(y, y0, sizeof y);
    TU_OK(tdm_dev_scale(g_dev, n, 3.5f, y));
    for (int i = 0; i < n; i++) cr_assert(y[i] == y0[i] * 3.5f, "scale[%d]", i);
    /* bias_act on (rows 4, cols 9), the first 36 of 37: every combination
     * of bias (or none) and relu (or none) */
    float bias[9];
    tu_fill(&r, bias, 9, -1, 1);
    for (int k = 0; k < 4; k++) {
        int has_bias = k & 1, relu = k >> 1;
        memcpy(y, y0, sizeof y);
        TU_OK(tdm_dev_bias_act(g_dev, y, has_bias ? bias : NULL, 4, 9,
                               relu ? TDM_ACT_RELU : TDM_ACT_NONE));
        for (int i = 0; i < 36; i++) {
            float v = y0[i] + (has_bias ? bias[i % 9] : 0.0f);
            if (relu && v < 0) v = 0;
            cr_assert(y[i] == v, "bias_act bias=%d relu=%d [%d] = %g, expected %g", has_bias,
                      relu, i, (double)y[i], (double)v);
        }
        cr_assert(y[36] == y0[36], "bias_act wrote past rows*cols");
    }
    float dy[37];
    memcpy(dy, x, sizeof dy);
    TU_OK(tdm_dev_relu_bwd(g_dev, dy, y, n));
    for (int i = 0; i < n; i++)
        cr_assert(dy[i] == (y[i] > 0 ? x[i] : 0.0f), "relu_bwd[%d]", i);
}
