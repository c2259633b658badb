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
#include <string.h>

#include "core/geom.h"

#ifdef __cplusplus
extern "C" {
#endif

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


/* The batch stride of x and dx in images (tdm_conv_geom.ns). */
static inline TDM_HD int tdm_k_geom_ns(const tdm_conv_geom g) { return g.ns > 0 ? g.ns : g.n; }

/* Offset of (ci, n, iy, ix) in x or dx: channel rows ns images apart, so
 * that a geometry over a chunk of a batch addresses the chunk in place. */
static inline TDM_HD int64_t tdm_k_geom_xoff(const tdm_conv_geom g, int ci, int n, int iy, int ix)
{
    return (((int64_t)ci * tdm_k_geom_ns(g) + n) * g.h + iy) * g.w + ix;
}

/* col has rows (ci, ki, kj) and columns (n, oy, ox). Element i of col with
 * its coordinates already split (the host loop nests, CUDA divides). */
static inline TDM_HD void tdm_k_im2col(int64_t i, int ci, int ki, int kj, int n, int oy, int ox,
                                       const tdm_conv_geom g, const float *x, float *col)
{
    int iy = oy * g.stride - g.pad + ki, ix = ox * g.stride - g.pad + kj;
    float v = 0.0f;
    if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) v = x[tdm_k_geom_xoff(g, ci, n, iy, ix)];
    col[i] = v;
}

/* Element (ci, n, iy, ix) of dx (C, ns, H, W): the sum of every col entry
 * it fed. Written as a gather so no two threads write the same element
 * (no atomics). */
static inline TDM_HD void tdm_k_col2im(int ci, int n, int iy, int ix, const tdm_conv_geom g,
                                       const float *col, float *dx)
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
    dx[tdm_k_geom_xoff(g, ci, n, iy, ix)] = s;
}

/* The host's form of im2col and col2im: whole rows as strided copies.
 * For one (ci, ki, kj) row of col and one (n, oy) whose input row iy is
 * inside the image, column ox reads input column ix = ox * stride + d
 * (d = kj - pad) when 0 <= ix < w, else a zero. [*lo, *hi) is the range
 * of ox that reads the image. */
static inline TDM_HD void tdm_k_conv_span(int ow, int w, int stride, int d, int *lo, int *hi)
{
    int l = d >= 0 ? 0 : (-d + stride - 1) / stride;
    int h = w - d <= 0 ? 0 : (w - d + stride - 1) / stride;
    h = h < ow ? h : ow;
    *lo = l < h ? l : h;
    *hi = h;
}

/* out[ox] for ox in [0, ow): the values tdm_k_im2col writes for this row
 * (a zero-filled head and tail, a copy in between); lo, hi from
 * tdm_k_conv_span, which depends on the column offset only. */
static inline TDM_HD void tdm_k_im2col_row(float *out, const float *xrow, int ow, int stride,
                                           int d, int lo, int hi)
{
    for (int ox = 0; ox < lo; ox++) out[ox] = 0.0f;
    if (stride == 1)
        for (int ox = lo; ox < hi; ox++) out[ox] = xrow[ox + d];
    else
        for (int ox = lo; ox < hi; ox++) out[ox] = xrow[ox * stride + d];
    for (int ox = hi; ox < ow; ox++) out[ox] = 0.0f;
}

/* Adds this col row's entries to the input row they were read from. Run
 * over (ki, kj) in order on a zeroed plane, every dx element receives its
 * contributions in the order tdm_k_col2im sums them, starting from 0: the
 * same bits (each (ki, kj) reaches an element at most once). */
static inline TDM_HD void tdm_k_col2im_add_row(float *dxrow, const float *colrow, int stride,
                                               int d, int lo, int hi)
{
    if (stride == 1)
        for (int ox = lo; ox < hi; ox++) dxrow[ox + d] += colrow[ox];
    else
        for (int ox = lo; ox < hi; ox++) dxrow[ox * stride + d] += colrow[ox];
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
 * first + step, ... < len) plus a finishing step, so that the host
 * (TDM_K_BN_LANES slices at once, below, added as a tree) and a CUDA block
 * (one slice per thread, then a tree over the partials) share the
 * arithmetic of every element; only the number of slices differs.
 * Two passes (mean, then squared deviations), both in double: one pass of
 * sum and sum of squares cancels for rows far from zero. */

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

/* The same slices, all at once, for a vectorising host loop: lane t of
 * each result equals the slice function with first = t and step =
 * TDM_K_BN_LANES (every lane adds its elements in increasing j), and
 * tdm_k_bn_lanes_total adds the lanes as a tree. So the host computes
 * exactly what a CUDA block of TDM_K_BN_LANES threads would. */
#define TDM_K_BN_LANES 8

static inline TDM_HD double tdm_k_bn_lanes_total(const double *p)
{
    double q[TDM_K_BN_LANES];
    for (int t = 0; t < TDM_K_BN_LANES; t++) q[t] = p[t];
    for (int s = TDM_K_BN_LANES / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; t++) q[t] += q[t + s];
    return q[0];
}

static inline TDM_HD void tdm_k_bn_sum_lanes(const float *r, int64_t len, double *acc)
{
    for (int t = 0; t < TDM_K_BN_LANES; t++) acc[t] = 0.0;
    int64_t j = 0;
    for (; j + TDM_K_BN_LANES <= len; j += TDM_K_BN_LANES)
        for (int t = 0; t < TDM_K_BN_LANES; t++) acc[t] += r[j + t];
    for (int t = 0; j + t < len; t++) acc[t] += r[j + t];
}

static inline TDM_HD void tdm_k_bn_sqdev_lanes(const float *r, int64_t len, double m, double *acc)
{
    for (int t = 0; t < TDM_K_BN_LANES; t++) acc[t] = 0.0;
    int64_t j = 0;
    for (; j + TDM_K_BN_LANES <= len; j += TDM_K_BN_LANES)
        for (int t = 0; t < TDM_K_BN_LANES; t++) {
            double dlt = r[j + t] - m;
            acc[t] += dlt * dlt;
        }
    for (int t = 0; j + t < len; t++) {
        double dlt = r[j + t] - m;
        acc[t] += dlt * dlt;
    }
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

/* tdm_k_bn_bwd_part's slices, all lanes at once (see tdm_k_bn_sum_lanes). */
static inline TDM_HD void tdm_k_bn_bwd_lanes(const float *xr, const float *dyr, int64_t len,
                                             float m, float is, double *sdy, double *sdyx)
{
    /* local lanes: the compiler cannot prove sdy and sdyx apart */
    double a[TDM_K_BN_LANES], b[TDM_K_BN_LANES];
    for (int t = 0; t < TDM_K_BN_LANES; t++) a[t] = b[t] = 0.0;
    int64_t j = 0;
    for (; j + TDM_K_BN_LANES <= len; j += TDM_K_BN_LANES)
        for (int t = 0; t < TDM_K_BN_LANES; t++) {
            double xh = (double)(xr[j + t] - m) * is;
            a[t] += dyr[j + t];
            b[t] += dyr[j + t] * xh;
        }
    for (int t = 0; j + t < len; t++) {
        double xh = (double)(xr[j + t] - m) * is;
        a[t] += dyr[j + t];
        b[t] += dyr[j + t] * xh;
    }
    for (int t = 0; t < TDM_K_BN_LANES; t++) {
        sdy[t] = a[t];
        sdyx[t] = b[t];
    }
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

/* ---- transformer (GPT) ----
 * Activations are row-major (N = B*T rows, C columns); attention scores
 * are (B, H, T, T) and the per-head tensors (B, H, T, hd). Reductions over
 * rows into a per-column result (embedding and LayerNorm parameter
 * gradients) are written per element (n, c) and *accumulate*: the host
 * loops n outer, c inner; a CUDA thread owns a column c and loops n in
 * the same order, so the sums are deterministic, need no atomics and are
 * the same on both. */

/* Element (n, t, c) of out (N, C), t = n % T: token embedding plus
 * position embedding. tok[n] must lie in [0, vocab) (the model checks). */
static inline TDM_HD void tdm_k_embed_fwd(int64_t n, int t, int c, const int32_t *tok,
                                          const float *wte, const float *wpe, int C, float *out)
{
    out[n * C + c] = wte[(int64_t)tok[n] * C + c] + wpe[(int64_t)t * C + c];
}

/* Element (n, t, c): dwte[tok[n]][c] += dout[n][c], dwpe[t][c] += dout[n][c]
 * (a token may repeat: see the ordering rule above). */
static inline TDM_HD void tdm_k_embed_bwd(int64_t n, int t, int c, const int32_t *tok,
                                          const float *dout, int C, float *dwte, float *dwpe)
{
    float g = dout[n * C + c];
    dwte[(int64_t)tok[n] * C + c] += g;
    dwpe[(int64_t)t * C + c] += g;
}

/* Row r of x (rows, C): LayerNorm (Ba et al. 2016) with the biased
 * variance, as torch.nn.LayerNorm: out = (x - mean) * rstd * g + b,
 * rstd = 1 / sqrt(var + eps); mean and rstd are kept for backward. */
static inline TDM_HD void tdm_k_layernorm_fwd_row(int64_t r, const float *x, const float *g,
                                                  const float *b, int C, float eps, float *out,
                                                  float *mean, float *rstd)
{
    const float *xr = x + r * C;
    float *o = out + r * C;
    float m = 0.0f;
    for (int j = 0; j < C; j++) m += xr[j];
    m /= (float)C;
    float v = 0.0f;
    for (int j = 0; j < C; j++) {
        float d = xr[j] - m;
        v += d * d;
    }
    v /= (float)C;
    float s = 1.0f / sqrtf(v + eps);
    for (int j = 0; j < C; j++) o[j] = (xr[j] - m) * s * g[j] + b[j];
    mean[r] = m;
    rstd[r] = s;
}

/* Row r: dx += rstd * (dn - mean(dn) - xhat * mean(dn * xhat)), dn = dout * g,
 * xhat = (x - mean) * rstd: the input gradient of LayerNorm. Adds, so the
 * residual stream's gradient accumulates in place. */
static inline TDM_HD void tdm_k_layernorm_bwd_row(int64_t r, const float *x, const float *dout,
                                                  const float *g, const float *mean,
                                                  const float *rstd, int C, float *dx)
{
    const float *xr = x + r * C, *dr = dout + r * C;
    float *o = dx + r * C;
    float m = mean[r], s = rstd[r];
    float sdn = 0.0f, sdnx = 0.0f;
    for (int j = 0; j < C; j++) {
        float dn = dr[j] * g[j];
        sdn += dn;
        sdnx += dn * (xr[j] - m) * s;
    }
    sdn /= (float)C;
    sdnx /= (float)C;
    for (int j = 0; j < C; j++) {
        float xh = (xr[j] - m) * s;
        o[j] += s * (dr[j] * g[j] - sdn - xh * sdnx);
    }
}

/* Element (r, c): dg[c] += dout * xhat, db[c] += dout. */
static inline TDM_HD void tdm_k_layernorm_bwd_param(int64_t r, int c, const float *x,
                                                    const float *dout, const float *mean,
                                                    const float *rstd, int C, float *dg,
                                                    float *db)
{
    float d = dout[r * C + c];
    dg[c] += d * ((x[r * C + c] - mean[r]) * rstd[r]);
    db[c] += d;
}

/* GELU with GPT-2's tanh approximation (Hendrycks & Gimpel 2016;
 * torch.nn.GELU(approximate='tanh')): 0.5 x (1 + tanh(u)),
 * u = sqrt(2/pi) (x + 0.044715 x^3). */
#define TDM_K_GELU_S 0.7978845608028654f
#define TDM_K_GELU_C 0.044715f

/* e^x as Cephes' expf computes it (S. Moshier): e^x = 2^n e^r with
 * n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two so r is exact)
 * and e^r by its degree-6 minimax polynomial on |r| <= ln2/2: within 2
 * ulp of expf on [-87.3, 88] (x is clamped to it: ~1e-38 below, 1.65e38
 * above; NaN stays NaN). Branch-free and without a libm call, so the host
 * loops over it vectorise (expf does not, and was a fifth of a GPT step). */
static inline TDM_HD float tdm_k_expf(float x)
{
    float c = x < 88.0f ? x : 88.0f;   /* NaN too, so the integer part stays in range */
    c = c > -87.3f ? c : -87.3f;
    /* t + 128.5 > 0, so truncation rounds t to nearest: n in [-126, 127] */
    int n = (int)(c * 1.44269504088896341f + 128.5f) - 128;
    float fn = (float)n;
    float r = c - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)(n + 127) << 23;   /* 2^n, n + 127 in [1, 254] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x != x ? x : p * scale;
}

/* tanh through one exp: 1 - 2 / (exp(2u) + 1), exact at the limits
 * (e^2u clamps to 1.65e38 -> 1, to ~1e-38 -> -1). Its absolute error is a
 * few ulp of 1 (near u = 0 the relative error grows), which is all GELU
 * needs: it only ever uses 1 + tanh and 1 - tanh^2. */
static inline TDM_HD float tdm_k_tanh(float u)
{
    return 1.0f - 2.0f / (tdm_k_expf(2.0f * u) + 1.0f);
}

static inline TDM_HD void tdm_k_gelu_fwd(int64_t i, const float *x, float *y)
{
    float v = x[i];
    float t = tdm_k_tanh(TDM_K_GELU_S * (v + TDM_K_GELU_C * v * v * v));
    y[i] = 0.5f * v * (1.0f + t);
}

/* dx = dy * gelu'(x); dx may be dy (in place). */
static inline TDM_HD void tdm_k_gelu_bwd(int64_t i, const float *x, const float *dy, float *dx)
{
    float v = x[i];
    float t = tdm_k_tanh(TDM_K_GELU_S * (v + TDM_K_GELU_C * v * v * v));
    float du = TDM_K_GELU_S * (1.0f + 3.0f * TDM_K_GELU_C * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
}

/* ---- standalone activations and average pooling (model files) ---- */

/* Element i of an activation layer: act 2 gelu, 3 tanh, 4 sigmoid (the
 * values of tdm_act). tanh and sigmoid use the libm functions: unlike
 * GELU, a tanh layer's output near 0 is used directly, where
 * tdm_k_tanh's relative error grows. */
static inline TDM_HD void tdm_k_act_fwd(int64_t i, int act, const float *x, float *y)
{
    float v = x[i];
    if (act == 1) y[i] = v > 0.0f ? v : 0.0f;
    else if (act == 2) tdm_k_gelu_fwd(i, x, y);
    else if (act == 3) y[i] = tanhf(v);
    else y[i] = 1.0f / (1.0f + expf(-v));
}

/* dx = dy * act'(x), from the input x (gelu) or the output y (relu, tanh,
 * sigmoid); dx may be dy. */
static inline TDM_HD void tdm_k_act_bwd(int64_t i, int act, const float *x, const float *y,
                                        const float *dy, float *dx)
{
    float o = y[i];
    if (act == 1) dx[i] = o > 0.0f ? dy[i] : 0.0f;
    else if (act == 2) tdm_k_gelu_bwd(i, x, dy, dx);
    else if (act == 3) dx[i] = dy[i] * (1.0f - o * o);
    else dx[i] = dy[i] * o * (1.0f - o);
}

/* Output element i of plane `plane` (ci * N + n) of an average pooling
 * over CNHW, window kh x kw at stride (non-overlapping windows, no pad):
 * the window's mean, summed in window order. */
static inline TDM_HD void tdm_k_avgpool_fwd(int64_t i, int64_t plane, int oy, int ox,
                                            const tdm_conv_geom g, const float *x, float *y)
{
    const float *xp = x + plane * g.h * g.w;
    float s = 0.0f;
    for (int ki = 0; ki < g.kh; ki++)
        for (int kj = 0; kj < g.kw; kj++) s += xp[(oy * g.stride + ki) * g.w + ox * g.stride + kj];
    y[i] = s / (float)(g.kh * g.kw);
}

/* dx of output element i's window: dy / (kh * kw) at each input of the
 * window; windows do not overlap, so dx is written once per element (the
 * caller zeroes dx first for rows and columns past the last window). */
static inline TDM_HD void tdm_k_avgpool_bwd(int64_t i, int64_t plane, int oy, int ox,
                                            const tdm_conv_geom g, const float *dy, float *dx)
{
    float *dp = dx + plane * g.h * g.w;
    float v = dy[i] / (float)(g.kh * g.kw);
    for (int ki = 0; ki < g.kh; ki++)
        for (int kj = 0; kj < g.kw; kj++) dp[(oy * g.stride + ki) * g.w + ox * g.stride + kj] = v;
}

/* Element i = (b, h, t, e) of dst (B, H, T, hd) from the row-major src
 * (B*T, ld) at columns off + h*hd + e: one head's slice of q, k or v out of
 * the fused qkv projection (ld = 3C, off = 0, C, 2C), or of a gradient. */
static inline TDM_HD void tdm_k_heads_split(int64_t i, int b, int h, int t, int e, int T,
                                            int hd, const float *src, int ld, int off,
                                            float *dst)
{
    dst[i] = src[((int64_t)b * T + t) * ld + off + h * hd + e];
}

/* The inverse: element i = (b, h, t, e) of src (B, H, T, hd) written to dst
 * (B*T, ld) at columns off + h*hd + e (heads back side by side). */
static inline TDM_HD void tdm_k_heads_merge(int64_t i, int b, int h, int t, int e, int T,
                                            int hd, const float *src, float *dst, int ld, int off)
{
    dst[((int64_t)b * T + t) * ld + off + h * hd + e] = src[i];
}

/* Row r of the scores (rows, T) at query position t = r % T, in place:
 * causal softmax: columns j <= t get softmax over j <= t (max-shifted),
 * columns j > t (the future) get exactly 0. */
static inline TDM_HD void tdm_k_attn_softmax_row(int64_t r, int t, float *att, int T)
{
    float *a = att + r * T;
    float mx = a[0];
    for (int j = 1; j <= t; j++) mx = a[j] > mx ? a[j] : mx;
    /* exp in a loop of its own, which vectorises; the sum in order after */
    for (int j = 0; j <= t; j++) a[j] = tdm_k_expf(a[j] - mx);
    float sum = 0.0f;
    for (int j = 0; j <= t; j++) sum += a[j];
    float inv = 1.0f / sum;
    for (int j = 0; j <= t; j++) a[j] *= inv;
    for (int j = t + 1; j < T; j++) a[j] = 0.0f;
}

/* Row r, in place on dp: the gradient of the scores from the gradient
 * of the probabilities p: ds_j = p_j (dp_j - sum_k p_k dp_k) for j <= t,
 * 0 for the masked j > t. */
static inline TDM_HD void tdm_k_attn_softmax_bwd_row(int64_t r, int t, const float *p,
                                                     float *dp, int T)
{
    const float *pr = p + r * T;
    float *d = dp + r * T;
    float s = 0.0f;
    for (int j = 0; j <= t; j++) s += pr[j] * d[j];
    for (int j = 0; j <= t; j++) d[j] = pr[j] * (d[j] - s);
    for (int j = t + 1; j < T; j++) d[j] = 0.0f;
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

/* ---- mixed precision: 16-bit floats, loss-scale unscaling, norms ---- */

static inline TDM_HD uint32_t tdm_k_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline TDM_HD float tdm_k_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bfloat16 is float32's upper half: widening is exact. */
static inline TDM_HD float tdm_k_bf16_to_f32(uint16_t h) { return tdm_k_bits_f32((uint32_t)h << 16); }

/* Round to nearest, ties to even, as PyTorch's c10::BFloat16 (and
 * core/comm.c's tdm_f32_to_bf16): add 0x7fff plus the kept half's lowest
 * bit, keep the upper half. A NaN stays a (quiet) NaN; values past the
 * largest bfloat16 round to infinity by the same carry. */
static inline TDM_HD uint16_t tdm_k_f32_to_bf16(float f)
{
    uint32_t u = tdm_k_f32_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1)) >> 16, nan = (u >> 16) | 0x40;
    /* a select, not a branch: host loops over it vectorise */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* IEEE binary16 -> float32, exact (subnormal halfs are normal floats). */
static inline TDM_HD float tdm_k_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return tdm_k_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e != 0) return tdm_k_bits_f32(sign | ((e + 112) << 23) | (m << 13));
    /* zero or subnormal: m * 2^-24, exact in float32 */
    float v = (float)m * 5.9604644775390625e-8f;   /* 2^-24, exact */
    return sign ? -v : v;
}

/* float32 -> binary16, round to nearest even, overflow to infinity, in
 * integer arithmetic only (the same results as core/comm.c's
 * tdm_f32_to_f16, which tests/test_mixed.c checks over every float). */
static inline TDM_HD uint16_t tdm_k_f32_to_f16(float f)
{
    uint32_t u = tdm_k_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;            /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00;            /* rounds to infinity */
    if (a >= 0x38800000u) {                                /* a normal half */
        uint32_t h = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3ffu);
        uint32_t rest = a & 0x1fffu;
        h += rest > 0x1000u || (rest == 0x1000u && (h & 1)); /* may carry into the exponent */
        return sign | (uint16_t)h;
    }
    uint32_t e = a >> 23;                                  /* biased float exponent */
    if (e < 102) return sign;                              /* below 2^-25: rounds to 0 */
    /* subnormal half: the value in units of 2^-24 is mant >> (126 - e) */
    uint32_t mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t h = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += rest > half || (rest == half && (h & 1));         /* 0x400 is the smallest normal */
    return sign | (uint16_t)h;
}

/* torch._amp_foreach_non_finite_check_and_unscale_'s element: x *= inv;
 * returns 1 when x was NaN or infinite before (PyTorch checks the value
 * before unscaling too). Written without a branch so host loops vectorise. */
static inline TDM_HD int tdm_k_unscale(int64_t i, float *x, float inv)
{
    float v = x[i];
    x[i] = v * inv;
    return !(fabsf(v) <= 3.402823466e38f);
}

/* The squared L2 norm in fixed pieces, so every device and every launch
 * shape sums the same way: chunk c covers x[c*CHUNK, min(n, (c+1)*CHUNK)),
 * summed in double over TDM_K_SUMSQ_LANES interleaved lanes (lane j takes
 * the elements j, j+LANES, ... of the chunk, in order) that are then added
 * pairwise. The chunks are added in order by the caller. */
#define TDM_K_SUMSQ_CHUNK 4096
#define TDM_K_SUMSQ_LANES 8
static inline TDM_HD double tdm_k_sumsq_chunk(int64_t c, const float *x, int64_t n)
{
    int64_t lo = c * TDM_K_SUMSQ_CHUNK, hi = lo + TDM_K_SUMSQ_CHUNK;
    if (hi > n) hi = n;
    double acc[TDM_K_SUMSQ_LANES] = {0};
    int64_t i = lo;
    for (; i + TDM_K_SUMSQ_LANES <= hi; i += TDM_K_SUMSQ_LANES)
        for (int j = 0; j < TDM_K_SUMSQ_LANES; j++) {
            double v = (double)x[i + j];
            acc[j] += v * v;
        }
    for (int j = 0; i + j < hi; j++) {
        double v = (double)x[i + j];
        acc[j] += v * v;
    }
    for (int w = TDM_K_SUMSQ_LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

#ifdef __cplusplus
}
#endif

#endif
