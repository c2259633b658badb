/* core/kernels.h: the elementwise and row-wise kernels, written once.
 *
 * Each kernel is a per-element (index i) or per-row/per-channel function,
 * static inline and marked TDM_HD, so the host backend calls it from a
 * plain loop and a CUDA grid-stride kernel calls the same source unchanged
 * (nvcc defines __CUDACC__ and TDM_HD becomes __host__ __device__).
 * Nothing here allocates, synchronises or knows about devices.
 *
 * Layout conventions: dense row-major; convolution activations are CNHW
 * (channel-major) so that a whole batch is one gemm and batchnorm's
 * per-channel reductions run over contiguous rows. */
#ifndef TDM_CORE_KERNELS_H
#define TDM_CORE_KERNELS_H

#include <stdint.h>
#include <math.h>

#include "core/geom.h"

#ifdef __CUDACC__
/* Not __forceinline__: it expands to `__inline__ __attribute__((always_inline))`,
 * and with the `static inline` below nvcc rejects the repeated inline. */
#define TDM_HD __host__ __device__ __attribute__((always_inline))
#else
#define TDM_HD __attribute__((always_inline))
#endif

/* ---- dense ---- */

/* Element i = (row, c): y[i] = act(y[i] + bias[c]). Callers pass both
 * the flat index and the column so the host loop needs no division. */
static inline TDM_HD void tdm_k_bias_act(int64_t i, int c, float *y, const float *bias, int relu)
{
    float v = y[i] + (bias ? bias[c] : 0.0f);
    y[i] = (relu && v < 0.0f) ? 0.0f : v;
}

static inline TDM_HD void tdm_k_relu_bwd(int64_t i, float *dy, const float *y)
{
    /* a select, not a conditional store, so loops over it vectorise */
    dy[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* Row r of logits (rows, cols): softmax cross-entropy, numerically stable
 * (subtract the row max before exp). loss_row[r] = log sum exp(z) - z[y];
 * d/dz = softmax(z) - onehot(y), times scale (1/B for a batch mean). */
static inline TDM_HD void tdm_k_softmax_xent_row(int r, const float *logits,
                                                 const int32_t *labels, int cols, float scale,
                                                 float *loss_row, float *dlogits)
{
    const float *z = logits + (int64_t)r * cols;
    float mx = z[0];
    for (int j = 1; j < cols; j++) mx = z[j] > mx ? z[j] : mx;
    float sum = 0.0f;
    for (int j = 0; j < cols; j++) sum += expf(z[j] - mx);
    int y = labels[r];
    /* log(sum) - (z[y] - mx), not (mx + log(sum)) - z[y]: the latter
     * cancels two numbers of the logits' magnitude and loses ulp(max|z|)
     * (6e-5 at logits near 1000); z[y] - mx is exact for nearby values. */
    loss_row[r] = logf(sum) - (z[y] - mx);
    if (dlogits) {
        float *dz = dlogits + (int64_t)r * cols;
        float inv = 1.0f / sum;
        for (int j = 0; j < cols; j++)
            dz[j] = (expf(z[j] - mx) * inv - (j == y ? 1.0f : 0.0f)) * scale;
    }
}

static inline TDM_HD void tdm_k_axpy(int64_t i, float alpha, const float *x, float *y)
{
    y[i] += alpha * x[i];
}

static inline TDM_HD void tdm_k_scale(int64_t i, float alpha, float *x) { x[i] *= alpha; }

/* ---- convolution (CNHW) ---- */

/* a / s for a >= 0, without a hardware divide for the strides that occur
 * (1 and 2); the branch is uniform across a whole kernel. */
static inline TDM_HD int tdm_k_div(int a, int s)
{
    return s == 1 ? a : s == 2 ? a >> 1 : a / s;
}


/* col has rows (ci, ki, kj) and columns (n, oy, ox). Element i of col with
 * its coordinates already split (the host loop nests, CUDA divides). */
static inline TDM_HD void tdm_k_im2col(int64_t i, int ci, int ki, int kj, int n, int oy, int ox,
                                       const tdm_conv_geom g, const float *x, float *col)
{
    int iy = oy * g.stride - g.pad + ki, ix = ox * g.stride - g.pad + kj;
    float v = 0.0f;
    if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w)
        v = x[(((int64_t)ci * g.n + n) * g.h + iy) * g.w + ix];
    col[i] = v;
}

/* Element i of dx (C, N, H, W): the sum of every col entry it fed. Written
 * as a gather so no two threads write the same element (no atomics). */
static inline TDM_HD void tdm_k_col2im(int64_t i, int ci, int n, int iy, int ix,
                                       const tdm_conv_geom g, const float *col, float *dx)
{
    int64_t ncols = (int64_t)g.n * g.oh * g.ow;
    float s = 0.0f;
    for (int ki = 0; ki < g.kh; ki++) {
        int ty = iy + g.pad - ki;
        if (ty < 0) continue;
        int oy = tdm_k_div(ty, g.stride);
        if (oy * g.stride != ty) continue;
        if (oy >= g.oh) continue;
        for (int kj = 0; kj < g.kw; kj++) {
            int tx = ix + g.pad - kj;
            if (tx < 0) continue;
            int ox = tdm_k_div(tx, g.stride);
            if (ox * g.stride != tx) continue;
            if (ox >= g.ow) continue;
            int64_t row = ((int64_t)ci * g.kh + ki) * g.kw + kj;
            int64_t cx = ((int64_t)n * g.oh + oy) * g.ow + ox;
            s += col[row * ncols + cx];
        }
    }
    dx[i] = s;
}

/* Output element i of (C, N, OH, OW); window kh x kw at stride, no pad. */
/* The window's running winner: NaN propagates as in PyTorch (a NaN wins,
 * the last one in window order). */
static inline TDM_HD void tdm_k_maxpool_take(float v, int off, float *bv, int *best)
{
    if (v > *bv || v != v) {
        *bv = v;
        *best = off;
    }
}

static inline TDM_HD void tdm_k_maxpool_fwd(int64_t i, int64_t plane, int oy, int ox,
                                            const tdm_conv_geom g, const float *x, float *y,
                                            int32_t *argmax)
{
    /* plane = ci * N + n */
    const float *xp = x + plane * g.h * g.w;
    int row = (oy * g.stride) * g.w + ox * g.stride;
    int best = row;
    float bv = xp[best];
    if (g.kh == 2 && g.kw == 2) {
        /* the usual 2x2 window, unrolled: same order, same rule */
        tdm_k_maxpool_take(xp[row], row, &bv, &best);
        tdm_k_maxpool_take(xp[row + 1], row + 1, &bv, &best);
        tdm_k_maxpool_take(xp[row + g.w], row + g.w, &bv, &best);
        tdm_k_maxpool_take(xp[row + g.w + 1], row + g.w + 1, &bv, &best);
    } else {
        for (int ki = 0; ki < g.kh; ki++, row += g.w)
            for (int kj = 0; kj < g.kw; kj++) tdm_k_maxpool_take(xp[row + kj], row + kj, &bv, &best);
    }
    y[i] = bv;
    argmax[i] = best;
}

/* Output element i of plane `plane`: its gradient goes to the input that
 * won its window. Windows do not overlap, so no two outputs write the same
 * input (no atomics, deterministic); dx must be zeroed first, which gives
 * the inputs that won nothing (and rows or columns past the last window)
 * their zero. One write per output instead of a search per input. */
static inline TDM_HD void tdm_k_maxpool_bwd(int64_t i, int64_t plane, const tdm_conv_geom g,
                                            const float *dy, const int32_t *argmax, float *dx)
{
    dx[plane * g.h * g.w + argmax[i]] = dy[i];
}

/* ---- batchnorm over CNHW rows ----
 * Channel ch owns row x[ch*len .. +len). The per-channel reductions are
 * written as partial sums over a strided slice of the row (j = first,
 * first + step, ... < len) plus a finishing step, so that the host (one
 * slice: first 0, step 1, exactly the plain loop) and a CUDA block (one
 * slice per thread, then a tree over the partials) share the arithmetic
 * of every element; only the order in which partials are added differs. */

/* sum of r[j] over the slice, in double so large batches keep precision */
static inline TDM_HD double tdm_k_bn_sum_part(const float *r, int64_t len, int64_t first,
                                              int64_t step)
{
    double s = 0.0;
    for (int64_t j = first; j < len; j += step) s += r[j];
    return s;
}

/* sum of (r[j] - m)^2 over the slice (the second of two passes) */
static inline TDM_HD double tdm_k_bn_sqdev_part(const float *r, int64_t len, double m,
                                                int64_t first, int64_t step)
{
    double q = 0.0;
    for (int64_t j = first; j < len; j += step) {
        double dlt = r[j] - m;
        q += dlt * dlt;
    }
    return q;
}

/* mean m and biased variance q / len of channel ch */
static inline TDM_HD void tdm_k_bn_stats_store(int ch, double m, double q, int64_t len,
                                               float *mean, float *var)
{
    mean[ch] = (float)m;
    var[ch] = (float)(q / (double)len);
}

/* Channel ch: mean and biased variance of its row, two-pass in double. */
static inline TDM_HD void tdm_k_bn_stats_ch(int ch, const float *x, int64_t len, float *mean,
                                            float *var)
{
    const float *r = x + (int64_t)ch * len;
    double m = tdm_k_bn_sum_part(r, len, 0, 1) / (double)len;
    tdm_k_bn_stats_store(ch, m, tdm_k_bn_sqdev_part(r, len, m, 0, 1), len, mean, var);
}

/* Channel ch, before the normalisation. Training: invstd from the batch's
 * biased variance, and the running statistics updated as PyTorch does
 * (momentum-weighted, running_var with the unbiased variance len/(len-1)).
 * Evaluation: mean and invstd come from the running statistics. */
static inline TDM_HD void tdm_k_bn_prep_ch(int ch, float *mean, const float *var, float *invstd,
                                           float *run_mean, float *run_var, float eps,
                                           float momentum, int64_t len, int train)
{
    if (train) {
        invstd[ch] = 1.0f / sqrtf(var[ch] + eps);
        float unbiased = len > 1 ? var[ch] * (float)len / (float)(len - 1) : var[ch];
        run_mean[ch] = (1.0f - momentum) * run_mean[ch] + momentum * mean[ch];
        run_var[ch] = (1.0f - momentum) * run_var[ch] + momentum * unbiased;
    } else {
        mean[ch] = run_mean[ch];
        invstd[ch] = 1.0f / sqrtf(run_var[ch] + eps);
    }
}

static inline TDM_HD void tdm_k_bn_fwd(int64_t i, int ch, const float *x, const float *mean,
                                       const float *invstd, const float *gamma,
                                       const float *beta, float *y)
{
    y[i] = (x[i] - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch];
}

/* The batchnorm backward of channel ch. In training mode the statistics
 * depend on x, which gives dx = g*istd/L * (L dy - sum dy - xhat sum dy*xhat);
 * in eval mode they are constants and dx = g*istd*dy. The two sums are
 * partials over a slice of the row (see above), then every element's dx. */
static inline TDM_HD void tdm_k_bn_bwd_part(const float *xr, const float *dyr, int64_t len,
                                            float m, float is, int64_t first, int64_t step,
                                            double *sdy, double *sdyx)
{
    double a = 0.0, b = 0.0;
    for (int64_t j = first; j < len; j += step) {
        double xh = (double)(xr[j] - m) * is;
        a += dyr[j];
        b += dyr[j] * xh;
    }
    *sdy = a;
    *sdyx = b;
}

/* dgamma += sum dy*xhat, dbeta += sum dy (the row's totals) */
static inline TDM_HD void tdm_k_bn_bwd_params(int ch, double sdy, double sdyx, float *dgamma,
                                              float *dbeta)
{
    dgamma[ch] += (float)sdyx;
    dbeta[ch] += (float)sdy;
}

/* Element j of the row's dx, from the row's totals. */
static inline TDM_HD void tdm_k_bn_bwd_dx(int64_t j, const float *xr, const float *dyr,
                                          float *dxr, float m, float is, float g, int64_t len,
                                          double sdy, double sdyx, int train)
{
    if (train) {
        float k = g * is / (float)len;
        float xh = (xr[j] - m) * is;
        dxr[j] = k * ((float)len * dyr[j] - (float)sdy - xh * (float)sdyx);
    } else {
        dxr[j] = g * is * dyr[j];
    }
}

static inline TDM_HD void tdm_k_bn_bwd_ch(int ch, const float *x, const float *dy, int64_t len,
                                          const float *mean, const float *invstd,
                                          const float *gamma, float *dx, float *dgamma,
                                          float *dbeta, int train)
{
    const float *xr = x + (int64_t)ch * len;
    const float *dyr = dy + (int64_t)ch * len;
    float m = mean[ch], is = invstd[ch], g = gamma[ch];
    double sdy, sdyx;
    tdm_k_bn_bwd_part(xr, dyr, len, m, is, 0, 1, &sdy, &sdyx);
    tdm_k_bn_bwd_params(ch, sdy, sdyx, dgamma, dbeta);
    if (!dx) return;
    float *dxr = dx + (int64_t)ch * len;
    for (int64_t j = 0; j < len; j++)
        tdm_k_bn_bwd_dx(j, xr, dyr, dxr, m, is, g, len, sdy, sdyx, train);
}

/* Element (ni, ci, fi) of y (N, C, F) from x (C, N, F), and back. */
static inline TDM_HD void tdm_k_cnhw_to_nchw(int ni, int ci, int64_t fi, const float *x, float *y,
                                             int c, int n, int64_t f)
{
    y[((int64_t)ni * c + ci) * f + fi] = x[((int64_t)ci * n + ni) * f + fi];
}

static inline TDM_HD void tdm_k_nchw_to_cnhw(int ni, int ci, int64_t fi, const float *x, float *y,
                                             int c, int n, int64_t f)
{
    y[((int64_t)ci * n + ni) * f + fi] = x[((int64_t)ni * c + ci) * f + fi];
}

/* ---- optimizers (one fused loop each) ---- */

/* PyTorch's SGD: g += wd p; buf = first ? g : momentum buf + (1-dampening) g;
 * g = nesterov ? g + momentum buf : buf; p -= lr g. */
static inline TDM_HD void tdm_k_sgd(int64_t i, float *p, const float *grad, float *mom, float lr,
                                    float momentum, float dampening, float wd, int nesterov,
                                    int first)
{
    float g = grad[i] + wd * p[i];
    if (momentum != 0.0f) {
        float b = first ? g : momentum * mom[i] + (1.0f - dampening) * g;
        mom[i] = b;
        g = nesterov ? g + momentum * b : b;
    }
    p[i] -= lr * g;
}

/* AdamW (Loshchilov & Hutter): decoupled decay p *= 1 - lr wd, then Adam
 * with bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t. */
static inline TDM_HD void tdm_k_adamw(int64_t i, float *p, const float *grad, float *m, float *v,
                                      float lr, float b1, float b2, float eps, float wd,
                                      float bc1, float bc2)
{
    float g = grad[i];
    float pi = p[i] * (1.0f - lr * wd);
    float mi = b1 * m[i] + (1.0f - b1) * g;
    float vi = b2 * v[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / bc1;
    float denom = sqrtf(vi / bc2) + eps;
    p[i] = pi - lr * mhat / denom;
}

#endif
