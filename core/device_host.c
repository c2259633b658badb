/* core/device_host.c: the host backend of the device interface.
 * Memory is 64-byte aligned malloc'd memory; gemm maps cublasSgemm's
 * column-major arguments one to one onto cblas_sgemm(CblasColMajor, ...);
 * every other kernel is a loop over the shared per-element / per-row
 * functions of core/kernels.h. Work runs on the calling thread, so a host
 * device is as parallel as the thread that drives it (plus BLAS threads
 * when opened with threads > 1). Not thread-safe per device: one thread
 * drives one device at a time, as in DP and DDP. */
#include "core/device_impl.h"

#include <cblas.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dnnl_impl.h"
#include "core/kernels.h"
#include "core/log.h"

/* OpenBLAS extensions (declared in its cblas.h, repeated for clarity). */
void openblas_set_num_threads(int num_threads);
char *openblas_get_config(void);
int openblas_get_num_threads(void);

/* Test hook, read nowhere else and not for users:
 * TANDEM_TEST_DEV_FAIL_AFTER=N, set when a host device is opened, makes
 * that device fail every allocation and every host-to-device copy after
 * its first N of them (OUT_OF_MEMORY, as a full device would), so tests
 * reach the failure paths of the code that sets a run up. */
#define TDM_HOST_FAIL_ENV "TANDEM_TEST_DEV_FAIL_AFTER"
#define TDM_HOST_FAIL_OFF (-1)

static int64_t host_fail_after(void);
static tdm_status host_fault(tdm_device *d, const char *what, size_t nbytes);

static tdm_status host_alloc(tdm_device *d, size_t nbytes, void **out)
{
    *out = NULL;
    TDM_CHECK(host_fault(d, "allocation", nbytes));
    return tdm_device_host_mem_alloc(d, nbytes, out);
}

static void host_free(tdm_device *d, void *p)
{
    tdm_device_host_mem_free(d, p);
}

static tdm_status host_copy(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    (void)d;
    if (nbytes && dst != src) memmove(dst, src, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status host_copy_from_host(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    TDM_CHECK(host_fault(d, "copy from the host", nbytes));
    return host_copy(d, dst, src, nbytes);
}

static tdm_status host_memset_zero(tdm_device *d, void *p, size_t nbytes)
{
    (void)d;
    if (nbytes) memset(p, 0, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status host_sync(tdm_device *d)
{
    (void)d;
    return TDM_STATUS_OK;
}

/* A host device's own state (d->impl): its oneDNN primitives (made on
 * the first bfloat16 product) and the float32 copies of float16
 * operands, in memory counted as the device's. */
typedef struct tdm_host_impl {
    tdm_dnnl *dnnl;
    int64_t fail_after, fallible;   /* TANDEM_TEST_DEV_FAIL_AFTER, and the calls it counted */
    int bf16_widen;         /* oneDNN could not run a bfloat16 product: widen them too */
    float *wide;            /* 16-bit operands widened; wide_elems floats */
    int64_t wide_elems;
} tdm_host_impl;

static void host_close(tdm_device *d)
{
    tdm_host_impl *h = d->impl;
    if (!h) return;
    tdm_dnnl_free(h->dnnl);
    tdm_device_host_mem_free(d, h->wide);
    free(h);
    d->impl = NULL;
}

static tdm_status host_gemm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                            float alpha, const float *a, int lda, const float *b, int ldb,
                            float beta, float *c, int ldc)
{
    (void)d;
    /* The same argument list as cublasSgemm(handle, ta, tb, m, n, k, &alpha,
     * A, lda, B, ldb, &beta, C, ldc): column-major, op() per flag. */
    cblas_sgemm(CblasColMajor, ta == TDM_TRANS_T ? CblasTrans : CblasNoTrans,
                tb == TDM_TRANS_T ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
                beta, c, ldc);
    return TDM_STATUS_OK;
}

/* The elementwise kernels of the CNN and the GPT are built for AVX2 as well (see TDM_HOST_WIDE below):
 * every element is computed as before, only in wider registers. */
#ifdef __SANITIZE_THREAD__
/* target_clones' ifunc resolver runs during relocation, before the
 * ThreadSanitizer runtime is up, and crashes there: one version under TSan */
#define TDM_HOST_WIDE
#else
#define TDM_HOST_WIDE __attribute__((target_clones("avx2", "default")))
#endif

TDM_HOST_WIDE static tdm_status host_bias_act(tdm_device *d, float *y, const float *bias,
                                             int64_t rows, int cols, tdm_act act)
{
    (void)d;
    int relu = act == TDM_ACT_RELU;
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) tdm_k_bias_act(r * cols + c, c, y, bias, relu);
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_relu_bwd(tdm_device *d, float *dy, const float *y, int64_t n_elem)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++) tdm_k_relu_bwd(i, dy, y);
    return TDM_STATUS_OK;
}

static tdm_status host_softmax_xent(tdm_device *d, const float *logits, const int32_t *labels,
                                    int rows, int cols, float scale, float *loss_row,
                                    float *dlogits)
{
    for (int r = 0; r < rows; r++)
        if (labels[r] < 0 || labels[r] >= cols)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "%s: label %d of sample %d is outside [0, %d)", d->name,
                                 labels[r], r, cols);
    for (int r = 0; r < rows; r++)
        tdm_k_softmax_xent_row(r, logits, labels, cols, scale, loss_row, dlogits);
    return TDM_STATUS_OK;
}

static tdm_status host_axpy(tdm_device *d, int64_t n_elem, float alpha, const float *x, float *y)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++) tdm_k_axpy(i, alpha, x, y);
    return TDM_STATUS_OK;
}

static tdm_status host_scale(tdm_device *d, int64_t n_elem, float alpha, float *x)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++) tdm_k_scale(i, alpha, x);
    return TDM_STATUS_OK;
}


/* The rows oy whose input row iy = oy * stride - pad + ki is inside the
 * image: [*lo, *hi) (tdm_k_conv_span in the other direction). */
static void host_conv_rows(const tdm_conv_geom *g, int ki, int *lo, int *hi)
{
    tdm_k_conv_span(g->oh, g->h, g->stride, ki - g->pad, lo, hi);
}

/* The "same" convolution (stride 1, output as large as the input: k =
 * 2 pad + 1), the CNN's: row (ci, ki, kj) of col is the channel's images,
 * which CNHW keeps contiguous, shifted by d = (ki - pad) w + (kj - pad).
 * So im2col is one copy of the whole run, then zeros where the shift
 * crossed an image's edge (the rows and columns tdm_k_im2col reads as
 * padding), and col2im one long add per image and (ki, kj), with the few
 * elements at the edge columns that must not receive the add kept aside
 * and put back. The same values as the row forms below, bit for bit:
 * copies, and the same single addition per element and (ki, kj), in the
 * same order. Rows of 14 or 28 floats made the row forms' loop overhead,
 * not memory, their cost. */
static int host_conv_same(const tdm_conv_geom *g)
{
    return g->stride == 1 && g->oh == g->h && g->ow == g->w && g->kh == 2 * g->pad + 1 &&
           g->kw == 2 * g->pad + 1 && g->pad <= 64;
}

TDM_HOST_WIDE static void host_im2col_same(const tdm_conv_geom g, const float *x, float *col)
{
    int64_t hw = (int64_t)g.h * g.w, total = (int64_t)g.n * hw;
    size_t row_bytes = (size_t)g.w * sizeof(float);
    float *out = col;
    for (int ci = 0; ci < g.c; ci++) {
        const float *xc = x + tdm_k_geom_xoff(g, ci, 0, 0, 0);
        for (int ki = 0; ki < g.kh; ki++) {
            int ylo, yhi;
            host_conv_rows(&g, ki, &ylo, &yhi);
            for (int kj = 0; kj < g.kw; kj++, out += total) {
                int dxo = kj - g.pad, lo, hi;
                tdm_k_conv_span(g.ow, g.w, 1, dxo, &lo, &hi);
                int64_t d = (int64_t)(ki - g.pad) * g.w + dxo;
                /* out[j] = xc[j + d] where that is inside the run */
                int64_t j0 = d < 0 ? -d : 0, j1 = total - (d > 0 ? d : 0);
                if (j0 > total) j0 = total;
                if (j1 < j0) j1 = j0;
                /* (the calls are many and small: none for nothing) */
                if (j0) memset(out, 0, (size_t)j0 * sizeof(float));
                memcpy(out + j0, xc + j0 + d, (size_t)(j1 - j0) * sizeof(float));
                if (j1 < total) memset(out + j1, 0, (size_t)(total - j1) * sizeof(float));
                for (int n = 0; n < g.n; n++) {
                    float *o = out + n * hw;
                    if (ylo) memset(o, 0, (size_t)ylo * row_bytes);
                    if (yhi < g.h)
                        memset(o + (int64_t)yhi * g.w, 0, (size_t)(g.h - yhi) * row_bytes);
                    if (lo == 0 && hi == g.w) continue;
                    for (int oy = ylo; oy < yhi; oy++) {
                        float *r = o + (int64_t)oy * g.w;
                        for (int ox = 0; ox < lo; ox++) r[ox] = 0.0f;
                        for (int ox = hi; ox < g.w; ox++) r[ox] = 0.0f;
                    }
                }
            }
        }
    }
}

/* Elements of dx kept aside per group of rows while a long add passes over
 * them (at most pad per row, so pad <= 64 leaves groups of >= 4 rows). */
#define HOST_COL2IM_KEEP 256

TDM_HOST_WIDE static void host_col2im_same(const tdm_conv_geom g, const float *col, float *dx)
{
    int64_t hw = (int64_t)g.h * g.w, ncols = (int64_t)g.n * hw;
    float keep[HOST_COL2IM_KEEP];
    for (int ci = 0; ci < g.c; ci++) {
        float *dc = dx + tdm_k_geom_xoff(g, ci, 0, 0, 0);
        memset(dc, 0, (size_t)ncols * sizeof(float));
        for (int ki = 0; ki < g.kh; ki++) {
            int dy = ki - g.pad;
            /* dx row iy receives col row oy = iy - dy, when that is one */
            int iylo = dy > 0 ? dy : 0, iyhi = g.h + (dy < 0 ? dy : 0);
            for (int kj = 0; kj < g.kw; kj++) {
                int dxo = kj - g.pad;
                int ixlo = dxo > 0 ? dxo : 0, ixhi = g.w + (dxo < 0 ? dxo : 0);
                if (iyhi <= iylo || ixhi <= ixlo) continue;
                int skip = g.w - (ixhi - ixlo);   /* columns that receive nothing */
                int group = skip ? HOST_COL2IM_KEEP / skip : g.h;
                int64_t d = (int64_t)dy * g.w + dxo;
                const float *crow = col + (((int64_t)ci * g.kh + ki) * g.kw + kj) * ncols;
                for (int n = 0; n < g.n; n++)
                    for (int r0 = iylo; r0 < iyhi; r0 += group) {
                        int r1 = r0 + group < iyhi ? r0 + group : iyhi, k = 0;
                        for (int iy = r0; iy < r1; iy++) {
                            float *r = dc + n * hw + (int64_t)iy * g.w;
                            for (int ix = 0; ix < ixlo; ix++) keep[k++] = r[ix];
                            for (int ix = ixhi; ix < g.w; ix++) keep[k++] = r[ix];
                        }
                        /* j - d outside col only for elements kept aside */
                        int64_t j0 = n * hw + (int64_t)r0 * g.w, j1 = n * hw + (int64_t)r1 * g.w;
                        if (j0 < d) j0 = d;
                        if (j1 > ncols + d) j1 = ncols + d;
                        for (int64_t j = j0; j < j1; j++) dc[j] += crow[j - d];
                        k = 0;
                        for (int iy = r0; iy < r1; iy++) {
                            float *r = dc + n * hw + (int64_t)iy * g.w;
                            for (int ix = 0; ix < ixlo; ix++) r[ix] = keep[k++];
                            for (int ix = ixhi; ix < g.w; ix++) r[ix] = keep[k++];
                        }
                    }
            }
        }
    }
}

/* im2col as strided row copies: for each row (ci, ki, kj) of col and each
 * image n, the oh x ow block read from the input plane shifted by (ki, kj),
 * zeros outside the image. col is written in order; the values are
 * tdm_k_im2col's. The spans depend on (ki, kj) only. The planes of a
 * chunk (g.ns > g.n) are found where tdm_k_geom_xoff puts them. */
TDM_HOST_WIDE static tdm_status host_im2col(tdm_device *d, const tdm_conv_geom *gp,
                                           const float *x, float *col)
{
    (void)d;
    const tdm_conv_geom g = *gp;
    if (host_conv_same(&g)) {
        host_im2col_same(g, x, col);
        return TDM_STATUS_OK;
    }
    size_t row_bytes = (size_t)g.ow * sizeof(float);
    float *out = col;
    for (int ci = 0; ci < g.c; ci++)
        for (int ki = 0; ki < g.kh; ki++) {
            int ylo, yhi;
            host_conv_rows(&g, ki, &ylo, &yhi);
            for (int kj = 0; kj < g.kw; kj++) {
                int dx = kj - g.pad, lo, hi;
                tdm_k_conv_span(g.ow, g.w, g.stride, dx, &lo, &hi);
                for (int n = 0; n < g.n; n++, out += (int64_t)g.oh * g.ow) {
                    const float *plane = x + tdm_k_geom_xoff(g, ci, n, 0, 0);
                    memset(out, 0, (size_t)ylo * row_bytes);
                    for (int oy = ylo; oy < yhi; oy++) {
                        int iy = oy * g.stride - g.pad + ki;
                        tdm_k_im2col_row(out + (int64_t)oy * g.ow, plane + (int64_t)iy * g.w,
                                         g.ow, g.stride, dx, lo, hi);
                    }
                    memset(out + (int64_t)yhi * g.ow, 0, (size_t)(g.oh - yhi) * row_bytes);
                }
            }
        }
    return TDM_STATUS_OK;
}

/* col2im as a scatter of rows onto each zeroed (ci, n) plane, (ki, kj) in
 * order: the same sums in the same order as tdm_k_col2im's gather (see
 * tdm_k_col2im_add_row), with the plane in L1 and col read in runs. */
TDM_HOST_WIDE static tdm_status host_col2im(tdm_device *d, const tdm_conv_geom *gp,
                                           const float *col, float *dx)
{
    (void)d;
    const tdm_conv_geom g = *gp;
    if (host_conv_same(&g)) {
        host_col2im_same(g, col, dx);
        return TDM_STATUS_OK;
    }
    int64_t ncols = (int64_t)g.n * g.oh * g.ow;
    for (int ci = 0; ci < g.c; ci++)
        for (int n = 0; n < g.n; n++) {
            float *plane = dx + tdm_k_geom_xoff(g, ci, n, 0, 0);
            memset(plane, 0, (size_t)g.h * g.w * sizeof(float));
            for (int ki = 0; ki < g.kh; ki++) {
                int ylo, yhi;
                host_conv_rows(&g, ki, &ylo, &yhi);
                for (int kj = 0; kj < g.kw; kj++) {
                    int dxo = kj - g.pad, lo, hi;
                    tdm_k_conv_span(g.ow, g.w, g.stride, dxo, &lo, &hi);
                    const float *crow = col + (((int64_t)ci * g.kh + ki) * g.kw + kj) * ncols +
                                        (int64_t)n * g.oh * g.ow;
                    for (int oy = ylo; oy < yhi; oy++) {
                        int iy = oy * g.stride - g.pad + ki;
                        tdm_k_col2im_add_row(plane + (int64_t)iy * g.w, crow + (int64_t)oy * g.ow,
                                             g.stride, dxo, lo, hi);
                    }
                }
            }
        }
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_maxpool_fwd(tdm_device *d, const tdm_conv_geom *gp,
                                                const float *x, float *y, int32_t *argmax)
{
    (void)d;
    const tdm_conv_geom g = *gp;
    int64_t planes = (int64_t)g.c * g.n, i = 0;
    if (g.kh == 2 && g.kw == 2 && g.stride == 2) {
        /* The usual window, with its constants visible to the compiler so
         * that a row of outputs vectorises: the same per-element kernel. */
        tdm_conv_geom g2 = g;
        g2.kh = g2.kw = g2.stride = 2;
        for (int64_t p = 0; p < planes; p++)
            for (int oy = 0; oy < g2.oh; oy++)
                for (int ox = 0; ox < g2.ow; ox++, i++)
                    tdm_k_maxpool_fwd(i, p, oy, ox, g2, x, y, argmax);
        return TDM_STATUS_OK;
    }
    for (int64_t p = 0; p < planes; p++)
        for (int oy = 0; oy < g.oh; oy++)
            for (int ox = 0; ox < g.ow; ox++, i++) tdm_k_maxpool_fwd(i, p, oy, ox, g, x, y, argmax);
    return TDM_STATUS_OK;
}

static tdm_status host_maxpool_bwd(tdm_device *d, const tdm_conv_geom *gp, const float *dy,
                                   const int32_t *argmax, float *dx)
{
    (void)d;
    const tdm_conv_geom g = *gp;
    int64_t planes = (int64_t)g.c * g.n, per = (int64_t)g.oh * g.ow, i = 0;
    memset(dx, 0, (size_t)(planes * g.h * g.w) * sizeof(float));
    for (int64_t p = 0; p < planes; p++)
        for (int64_t j = 0; j < per; j++, i++) tdm_k_maxpool_bwd(i, p, g, dy, argmax, dx);
    return TDM_STATUS_OK;
}

/* The batchnorm reductions run TDM_K_BN_LANES slices at once (the slices
 * of core/kernels.h, added as a tree): a single running double sum is one
 * dependent add per element, several times slower than the row's load. */
TDM_HOST_WIDE static tdm_status host_bn_stats(tdm_device *d, const float *x, int channels,
                                             int64_t len, float *mean, float *var)
{
    (void)d;
    double acc[TDM_K_BN_LANES];
    for (int ch = 0; ch < channels; ch++) {
        const float *r = x + (int64_t)ch * len;
        tdm_k_bn_sum_lanes(r, len, acc);
        double m = tdm_k_bn_lanes_total(acc) / (double)len;
        tdm_k_bn_sqdev_lanes(r, len, m, acc);
        tdm_k_bn_stats_store(ch, m, tdm_k_bn_lanes_total(acc), len, mean, var);
    }
    return TDM_STATUS_OK;
}

static tdm_status host_bn_prep(tdm_device *d, int channels, float *mean, const float *var,
                               float *invstd, float *run_mean, float *run_var, float eps,
                               float momentum, int64_t len, int train)
{
    (void)d;
    for (int ch = 0; ch < channels; ch++)
        tdm_k_bn_prep_ch(ch, mean, var, invstd, run_mean, run_var, eps, momentum, len, train);
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_bn_fwd(tdm_device *d, const float *x, int channels,
                                           int64_t len, const float *mean, const float *invstd,
                                           const float *gamma, const float *beta, float *y)
{
    (void)d;
    for (int ch = 0; ch < channels; ch++) {
        /* the channel's constants in locals, which y cannot alias: the
         * row loop then vectorises */
        const float m = mean[ch], is = invstd[ch], ga = gamma[ch], be = beta[ch];
        const float *xr = x + (int64_t)ch * len;
        float *yr = y + (int64_t)ch * len;
        for (int64_t j = 0; j < len; j++) tdm_k_bn_fwd(j, 0, xr, &m, &is, &ga, &be, yr);
    }
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_bn_bwd(tdm_device *d, const float *x, const float *dy,
                                           int channels, int64_t len, const float *mean,
                                           const float *invstd, const float *gamma, float *dx,
                                           float *dgamma, float *dbeta, int train)
{
    (void)d;
    double a[TDM_K_BN_LANES], b[TDM_K_BN_LANES];
    for (int ch = 0; ch < channels; ch++) {
        const float *xr = x + (int64_t)ch * len, *dyr = dy + (int64_t)ch * len;
        float m = mean[ch], is = invstd[ch], g = gamma[ch];
        tdm_k_bn_bwd_lanes(xr, dyr, len, m, is, a, b);
        double sdy = tdm_k_bn_lanes_total(a), sdyx = tdm_k_bn_lanes_total(b);
        tdm_k_bn_bwd_params(ch, sdy, sdyx, dgamma, dbeta);
        if (!dx) continue;
        float *dxr = dx + (int64_t)ch * len;
        for (int64_t j = 0; j < len; j++)
            tdm_k_bn_bwd_dx(j, xr, dyr, dxr, m, is, g, len, sdy, sdyx, train);
    }
    return TDM_STATUS_OK;
}

static tdm_status host_cnhw_to_nchw(tdm_device *d, const float *x, float *y, int c, int n,
                                    int64_t f)
{
    (void)d;
    for (int ni = 0; ni < n; ni++)
        for (int ci = 0; ci < c; ci++)
            for (int64_t fi = 0; fi < f; fi++) tdm_k_cnhw_to_nchw(ni, ci, fi, x, y, c, n, f);
    return TDM_STATUS_OK;
}

static tdm_status host_nchw_to_cnhw(tdm_device *d, const float *x, float *y, int c, int n,
                                    int64_t f)
{
    (void)d;
    for (int ci = 0; ci < c; ci++)
        for (int ni = 0; ni < n; ni++)
            for (int64_t fi = 0; fi < f; fi++) tdm_k_nchw_to_cnhw(ni, ci, fi, x, y, c, n, f);
    return TDM_STATUS_OK;
}

static tdm_status host_gemm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                            int n, int k, float alpha, const float *a, int lda,
                                            long long stride_a, const float *b, int ldb,
                                            long long stride_b, float beta, float *c, int ldc,
                                            long long stride_c, int batch)
{
    (void)d;
    /* cublasSgemmStridedBatched's arguments as a loop of cblas_sgemm: each
     * product of attention is small (T x T x hd), and OpenBLAS's own batch
     * interface is not in every build */
    CBLAS_TRANSPOSE cta = ta == TDM_TRANS_T ? CblasTrans : CblasNoTrans;
    CBLAS_TRANSPOSE ctb = tb == TDM_TRANS_T ? CblasTrans : CblasNoTrans;
    for (int i = 0; i < batch; i++)
        cblas_sgemm(CblasColMajor, cta, ctb, m, n, k, alpha, a + i * stride_a, lda,
                    b + i * stride_b, ldb, beta, c + i * stride_c, ldc);
    return TDM_STATUS_OK;
}

static tdm_status host_embed_fwd(tdm_device *d, const int32_t *tok, const float *wte,
                                 const float *wpe, float *out, int B, int T, int C)
{
    (void)d;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int64_t n = (int64_t)b * T + t;
            for (int c = 0; c < C; c++) tdm_k_embed_fwd(n, t, c, tok, wte, wpe, C, out);
        }
    return TDM_STATUS_OK;
}

static tdm_status host_embed_bwd(tdm_device *d, const int32_t *tok, const float *dout,
                                 float *dwte, float *dwpe, int B, int T, int C)
{
    (void)d;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int64_t n = (int64_t)b * T + t;
            for (int c = 0; c < C; c++) tdm_k_embed_bwd(n, t, c, tok, dout, C, dwte, dwpe);
        }
    return TDM_STATUS_OK;
}

static tdm_status host_layernorm_fwd(tdm_device *d, const float *x, const float *g,
                                     const float *b, float *out, float *mean, float *rstd,
                                     int64_t rows, int C, float eps)
{
    (void)d;
    for (int64_t r = 0; r < rows; r++) tdm_k_layernorm_fwd_row(r, x, g, b, C, eps, out, mean, rstd);
    return TDM_STATUS_OK;
}

static tdm_status host_layernorm_bwd(tdm_device *d, const float *x, const float *dout,
                                     const float *g, const float *mean, const float *rstd,
                                     float *dx, float *dg, float *db, int64_t rows, int C)
{
    (void)d;
    for (int64_t r = 0; r < rows; r++) {
        tdm_k_layernorm_bwd_row(r, x, dout, g, mean, rstd, C, dx);
        for (int c = 0; c < C; c++) tdm_k_layernorm_bwd_param(r, c, x, dout, mean, rstd, C, dg, db);
    }
    return TDM_STATUS_OK;
}

/* GELU and the attention softmax are the elementwise kernels a GPT step
 * spends real time in (their exp): also built for AVX2, picked at load time
 * where the CPU has it; no FMA, so both versions compute the same bits. */
TDM_HOST_WIDE static tdm_status host_gelu_fwd(tdm_device *d, const float *x, float *y,
                                             int64_t n_elem)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++) tdm_k_gelu_fwd(i, x, y);
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_gelu_bwd(tdm_device *d, const float *x, const float *dy,
                                             float *dx, int64_t n_elem)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++) tdm_k_gelu_bwd(i, x, dy, dx);
    return TDM_STATUS_OK;
}

static tdm_status host_heads_split(tdm_device *d, const float *src, int ld, int off, float *dst,
                                   int B, int T, int H, int hd)
{
    (void)d;
    int64_t i = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++)
                for (int e = 0; e < hd; e++, i++)
                    tdm_k_heads_split(i, b, h, t, e, T, hd, src, ld, off, dst);
    return TDM_STATUS_OK;
}

static tdm_status host_heads_merge(tdm_device *d, const float *src, float *dst, int ld, int off,
                                   int B, int T, int H, int hd)
{
    (void)d;
    int64_t i = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++)
                for (int e = 0; e < hd; e++, i++)
                    tdm_k_heads_merge(i, b, h, t, e, T, hd, src, dst, ld, off);
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_attn_softmax_fwd(tdm_device *d, float *att, int64_t rows,
                                                     int T)
{
    (void)d;
    for (int64_t r = 0; r < rows; r++) tdm_k_attn_softmax_row(r, (int)(r % T), att, T);
    return TDM_STATUS_OK;
}

static tdm_status host_attn_softmax_bwd(tdm_device *d, const float *p, float *dp, int64_t rows,
                                        int T)
{
    (void)d;
    for (int64_t r = 0; r < rows; r++) tdm_k_attn_softmax_bwd_row(r, (int)(r % T), p, dp, T);
    return TDM_STATUS_OK;
}

static tdm_status host_sgd_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                                float *mom, float lr, float momentum, float dampening,
                                float weight_decay, int nesterov, int first_step)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++)
        tdm_k_sgd(i, param, grad, mom, lr, momentum, dampening, weight_decay, nesterov,
                  first_step);
    return TDM_STATUS_OK;
}

static tdm_status host_adamw_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                                  float *m, float *v, float lr, float beta1, float beta2,
                                  float eps, float weight_decay, float bc1, float bc2)
{
    (void)d;
    for (int64_t i = 0; i < n_elem; i++)
        tdm_k_adamw(i, param, grad, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
    return TDM_STATUS_OK;
}

/* ---- mixed precision ---- */

/* The conversions are pure bandwidth: built for AVX-512 too, where 16
 * floats narrow to 16 halves in one register. Integer arithmetic only:
 * every version computes the same bits. */
#ifdef __SANITIZE_THREAD__
#define TDM_HOST_CONV
#else
#define TDM_HOST_CONV __attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
#endif

/* Elements a strided batch of column-major matrices spans (rows x cols,
 * leading dimension ld): from the first element of the first matrix to
 * the last of the last. */
static int64_t host_span(int rows, int cols, int ld, long long stride, int batch)
{
    return (int64_t)stride * (batch - 1) + (int64_t)ld * (cols - 1) + rows;
}

TDM_HOST_CONV static void host_widen_f16(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = tdm_k_f16_to_f32(src[i]);
}

TDM_HOST_CONV static void host_to_bf16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = tdm_k_f32_to_bf16(src[i]);
}
TDM_HOST_CONV static void host_to_f16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = tdm_k_f32_to_f16(src[i]);
}
TDM_HOST_CONV static void host_from_bf16(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = tdm_k_bf16_to_f32(src[i]);
}

static tdm_status host_gemm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                               int n, int k, float alpha, const void *a, int lda,
                                               long long stride_a, const void *b, int ldb,
                                               long long stride_b, float beta, float *c, int ldc,
                                               long long stride_c, int batch, tdm_dtype in)
{
    tdm_host_impl *h = d->impl;
    /* k = 0: C = beta C, no operand read (oneDNN refuses empty products) */
    if (k == 0)
        return host_gemm_strided_batched(d, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                                         stride_b, beta, c, ldc, stride_c, batch);
    if (in == TDM_DTYPE_BFLOAT16 && !h->bf16_widen) {
        tdm_status st = tdm_dnnl_gemm_bf16(&h->dnnl, d->name, d->threads, ta, tb, m, n, k, alpha,
                                           a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
                                           stride_c, batch);
        if (st != TDM_STATUS_UNSUPPORTED) return st;
        /* no libdnnl, or no bfloat16 kernel for this CPU (AVX-512 is
         * needed): every later product of this device widens, so its
         * results do not depend on which shapes oneDNN would take */
        TDM_WARN(DEVICE, "%s; bfloat16 products widen to float32 from now on (the same sums, "
                 "no speed-up)", tdm_error_message());
        h->bf16_widen = 1;
    }
    /* float16 (and bfloat16 without oneDNN): no half matmul on CPUs
     * without AVX512-FP16. Both operands widened (exactly) to float32,
     * then OpenBLAS: every product of two halfs (or two bfloat16s) is
     * exact in float32, so C gets the float32 sums of exact products
     * that a 16-bit gemm with float32 accumulation computes. */
    int64_t na = host_span(ta == TDM_TRANS_N ? m : k, ta == TDM_TRANS_N ? k : m, lda, stride_a,
                           batch);
    int64_t nb = host_span(tb == TDM_TRANS_N ? k : n, tb == TDM_TRANS_N ? n : k, ldb, stride_b,
                           batch);
    if (na + nb > h->wide_elems) {
        tdm_device_host_mem_free(d, h->wide);
        h->wide = NULL;
        h->wide_elems = 0;
        TDM_CHECK(tdm_device_host_mem_alloc(d, (size_t)(na + nb) * sizeof(float),
                                            (void **)&h->wide));
        h->wide_elems = na + nb;
    }
    float *wa = h->wide, *wb = h->wide + na;
    if (in == TDM_DTYPE_BFLOAT16) {
        host_from_bf16(wa, a, na);
        host_from_bf16(wb, b, nb);
    } else {
        host_widen_f16(wa, a, na);
        host_widen_f16(wb, b, nb);
    }
    return host_gemm_strided_batched(d, ta, tb, m, n, k, alpha, wa, lda, stride_a, wb, ldb,
                                     stride_b, beta, c, ldc, stride_c, batch);
}

static tdm_status host_gemm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                               float alpha, const void *a, int lda, const void *b, int ldb,
                               float beta, float *c, int ldc, tdm_dtype in)
{
    return host_gemm_strided_batched_ex(d, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c,
                                        ldc, 0, 1, in);
}

static tdm_status host_convert(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                               tdm_dtype src_type, int64_t n_elem)
{
    (void)d;
    if (src_type == TDM_DTYPE_FLOAT32 && dst_type == TDM_DTYPE_BFLOAT16)
        host_to_bf16(dst, src, n_elem);
    else if (src_type == TDM_DTYPE_FLOAT32)
        host_to_f16(dst, src, n_elem);
    else if (src_type == TDM_DTYPE_BFLOAT16)
        host_from_bf16(dst, src, n_elem);
    else
        host_widen_f16(dst, src, n_elem);
    return TDM_STATUS_OK;
}

TDM_HOST_WIDE static tdm_status host_unscale_check(tdm_device *d, float *x, int64_t n_elem,
                                                  float inv_scale, float *found_inf)
{
    (void)d;
    int bad = 0;
    for (int64_t i = 0; i < n_elem; i++) bad |= tdm_k_unscale(i, x, inv_scale);
    if (bad) *found_inf = 1.0f;
    return TDM_STATUS_OK;
}

static tdm_status host_sumsq(tdm_device *d, const float *x, int64_t n_elem, double *partials)
{
    (void)d;
    int64_t chunks = tdm_dev_sumsq_chunks(n_elem);
    for (int64_t c = 0; c < chunks; c++) partials[c] = tdm_k_sumsq_chunk(c, x, n_elem);
    return TDM_STATUS_OK;
}

static const tdm_device_ops tdm_device_host_ops = {
    .alloc = host_alloc,
    .free = host_free,
    .copy = host_copy,
    .copy_to_host = host_copy,
    .copy_from_host = host_copy_from_host,
    .memset_zero = host_memset_zero,
    .sync = host_sync,
    .close = host_close,
    .gemm = host_gemm,
    .bias_act = host_bias_act,
    .relu_bwd = host_relu_bwd,
    .softmax_xent = host_softmax_xent,
    .axpy = host_axpy,
    .scale = host_scale,
    .im2col = host_im2col,
    .col2im = host_col2im,
    .maxpool_fwd = host_maxpool_fwd,
    .maxpool_bwd = host_maxpool_bwd,
    .bn_stats = host_bn_stats,
    .bn_prep = host_bn_prep,
    .bn_fwd = host_bn_fwd,
    .bn_bwd = host_bn_bwd,
    .cnhw_to_nchw = host_cnhw_to_nchw,
    .nchw_to_cnhw = host_nchw_to_cnhw,
    .embed_fwd = host_embed_fwd,
    .embed_bwd = host_embed_bwd,
    .layernorm_fwd = host_layernorm_fwd,
    .layernorm_bwd = host_layernorm_bwd,
    .gelu_fwd = host_gelu_fwd,
    .gelu_bwd = host_gelu_bwd,
    .heads_split = host_heads_split,
    .heads_merge = host_heads_merge,
    .attn_softmax_fwd = host_attn_softmax_fwd,
    .attn_softmax_bwd = host_attn_softmax_bwd,
    .gemm_strided_batched = host_gemm_strided_batched,
    .sgd_step = host_sgd_step,
    .adamw_step = host_adamw_step,
    .gemm_ex = host_gemm_ex,
    .gemm_strided_batched_ex = host_gemm_strided_batched_ex,
    .convert = host_convert,
    .unscale_check = host_unscale_check,
    .sumsq = host_sumsq,
};

tdm_status tdm_device_host_open(tdm_device **out, int index, int threads)
{
    tdm_device *d = calloc(1, sizeof *d);
    if (!d) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a host device");
    d->impl = calloc(1, sizeof(tdm_host_impl));
    if (!d->impl) {
        free(d);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a host device");
    }
    d->ops = &tdm_device_host_ops;
    d->kind = TDM_DEVICE_HOST;
    d->index = index;
    d->threads = threads > 0 ? threads : 1;
    d->mem_counted = 1;
    ((tdm_host_impl *)d->impl)->fail_after = host_fail_after();
    snprintf(d->name, sizeof d->name, "cpu:%d", index);
    tdm_device_host_set_blas_threads(d->threads);
    *out = d;
    return TDM_STATUS_OK;
}

static int64_t host_fail_after(void)
{
    const char *e = getenv(TDM_HOST_FAIL_ENV);
    if (!e || !*e) return TDM_HOST_FAIL_OFF;
    char *end = NULL;
    long long n = strtoll(e, &end, 10);
    return *end || n < 0 ? TDM_HOST_FAIL_OFF : (int64_t)n;
}

static tdm_status host_fault(tdm_device *d, const char *what, size_t nbytes)
{
    tdm_host_impl *h = d->impl;
    if (h->fail_after == TDM_HOST_FAIL_OFF || h->fallible++ < h->fail_after)
        return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: %s of %zu bytes failed (%s=%lld)",
                         d->name, what, nbytes, TDM_HOST_FAIL_ENV, (long long)h->fail_after);
}

void tdm_device_host_set_blas_threads(int threads)
{
    /* OpenBLAS's thread count is process-wide; with 1 thread each call
     * runs on its caller, which is what concurrent DP workers need. */
    if (threads < 1) threads = 1;
    if (openblas_get_num_threads() != threads) openblas_set_num_threads(threads);
}

const char *tdm_device_host_blas_info(void) { return openblas_get_config(); }
