/* cuda/kernels_cuda.cu: the CUDA side of the device interface's
 * elementwise and row-wise kernels.
 *
 * Each kernel is a small functor whose operator()(i) takes one flat index,
 * splits it into the coordinates that core/kernels.h's per-element or
 * per-row function takes (in the same nesting order as the host loops of
 * core/device_host.c) and calls that function *unchanged* (TDM_HD is
 * __host__ __device__ under nvcc). One grid-stride kernel template runs
 * any functor on the GPU. The same functor can also run as a plain loop
 * on the host (tdm_cuda_exec.host): that is how the host tests check the
 * index arithmetic of every kernel without a GPU (cuda/emulator.c's
 * emulator device).
 *
 * This file is only kernels and their launchers (C linkage, declared in
 * cuda/cuda_impl.h); memory, streams, cuBLAS and error messages live in
 * cuda/device_cuda.c. Softmax cross-entropy runs one thread per row (a
 * row is a sample's few logits); batchnorm's per-channel reductions run a
 * block per channel over the same shared per-element code (below). */
#include <cstring>

#include "cuda/cuda_impl.h"

namespace {

constexpr int kThreads = 256;
/* Per-row kernels: few rows, long loops; small blocks spread them over SMs. */
constexpr int kRowThreads = 64;
constexpr int64_t kMaxBlocks = 65536;

template <class F>
__global__ void k_grid(int64_t n, F f)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

/* n work items: on the host a loop; on the GPU enough blocks to cover n
 * once (capped; the loop strides over the rest), then the launch's own
 * error (bad configuration, no kernel image for this GPU). */
template <class F>
cudaError_t run(const tdm_cuda_exec *x, int64_t n, int threads, F f)
{
    if (n <= 0) return cudaSuccess;
    if (x->host) {
        for (int64_t i = 0; i < n; i++) f(i);
        return cudaSuccess;
    }
    int64_t b = (n + threads - 1) / threads;
    if (b > kMaxBlocks) b = kMaxBlocks;
    /* the check below must see this launch's error only: drop a stale
     * non-sticky one (every call's own result is checked where it is
     * made; sticky errors are returned again by the launch anyway) */
    (void)cudaGetLastError();
    k_grid<<<(unsigned)b, threads, 0, x->stream>>>(n, f);
    return cudaGetLastError();
}

struct BiasAct {
    float *y;
    const float *bias;
    int cols, relu;
    __host__ __device__ void operator()(int64_t i) const
    {
        tdm_k_bias_act(i, (int)(i % cols), y, bias, relu);
    }
};

struct ReluBwd {
    float *dy;
    const float *y;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_relu_bwd(i, dy, y); }
};

struct SoftmaxXent {
    const float *logits;
    const int32_t *labels;
    int cols;
    float scale;
    float *loss_row, *dlogits;
    int *bad_row;
    __host__ __device__ void operator()(int64_t r) const
    {
        int y = labels[r];
        if (y < 0 || y >= cols) {
#ifdef __CUDA_ARCH__
            atomicMin(bad_row, (int)r);
#else
            if ((int)r < *bad_row) *bad_row = (int)r;
#endif
            return;
        }
        tdm_k_softmax_xent_row((int)r, logits, labels, cols, scale, loss_row, dlogits);
    }
};

struct Axpy {
    float alpha;
    const float *x;
    float *y;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_axpy(i, alpha, x, y); }
};

struct Scale {
    float alpha;
    float *x;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_scale(i, alpha, x); }
};

/* col (C*KH*KW, N*OH*OW): host nesting ci, ki, kj, n, oy, ox. */
struct Im2col {
    tdm_conv_geom g;
    const float *x;
    float *col;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t t = i;
        int ox = (int)(t % g.ow); t /= g.ow;
        int oy = (int)(t % g.oh); t /= g.oh;
        int n = (int)(t % g.n); t /= g.n;
        int kj = (int)(t % g.kw); t /= g.kw;
        int ki = (int)(t % g.kh); t /= g.kh;
        tdm_k_im2col(i, (int)t, ki, kj, n, oy, ox, g, x, col);
    }
};

/* dx (C, N, H, W), the chunk's N of a batch of g.ns: host nesting ci, n,
 * iy, ix (the kernel finds the element's place in dx). */
struct Col2im {
    tdm_conv_geom g;
    const float *col;
    float *dx;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t t = i;
        int ix = (int)(t % g.w); t /= g.w;
        int iy = (int)(t % g.h); t /= g.h;
        int n = (int)(t % g.n); t /= g.n;
        tdm_k_col2im((int)t, n, iy, ix, g, col, dx);
    }
};

/* y (C*N planes, OH, OW): host nesting plane, oy, ox. */
struct MaxpoolFwd {
    tdm_conv_geom g;
    const float *x;
    float *y;
    int32_t *argmax;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t t = i;
        int ox = (int)(t % g.ow); t /= g.ow;
        int oy = (int)(t % g.oh); t /= g.oh;
        tdm_k_maxpool_fwd(i, t, oy, ox, g, x, y, argmax);
    }
};

/* dx (C*N planes, H, W): host nesting plane, iy, ix. */
struct MaxpoolBwd {
    tdm_conv_geom g;
    const float *dy;
    const int32_t *argmax;
    float *dx;
    __host__ __device__ void operator()(int64_t i) const
    {
        tdm_k_maxpool_bwd(i, i / ((int64_t)g.oh * g.ow), g, dy, argmax, dx);
    }
};

/* Standalone activations and average pooling (model files). */
struct ActFwd {
    int act;
    const float *x;
    float *y;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_act_fwd(i, act, x, y); }
};

struct ActBwd {
    int act;
    const float *x, *y, *dy;
    float *dx;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_act_bwd(i, act, x, y, dy, dx); }
};

/* y / dy (C*N planes, OH, OW): host nesting plane, oy, ox. */
struct AvgpoolFwd {
    tdm_conv_geom g;
    const float *x;
    float *y;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t t = i;
        int ox = (int)(t % g.ow); t /= g.ow;
        int oy = (int)(t % g.oh); t /= g.oh;
        tdm_k_avgpool_fwd(i, t, oy, ox, g, x, y);
    }
};

struct AvgpoolBwd {
    tdm_conv_geom g;
    const float *dy;
    float *dx;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t t = i;
        int ox = (int)(t % g.ow); t /= g.ow;
        int oy = (int)(t % g.oh); t /= g.oh;
        tdm_k_avgpool_bwd(i, t, oy, ox, g, dy, dx);
    }
};

struct BnPrep {
    float *mean;
    const float *var;
    float *invstd, *run_mean, *run_var;
    float eps, momentum;
    int64_t len;
    int train;
    __host__ __device__ void operator()(int64_t ch) const
    {
        tdm_k_bn_prep_ch((int)ch, mean, var, invstd, run_mean, run_var, eps, momentum, len,
                         train);
    }
};

/* y (channels, len): host nesting ch, j. */
struct BnFwd {
    const float *x;
    int64_t len;
    const float *mean, *invstd, *gamma, *beta;
    float *y;
    __host__ __device__ void operator()(int64_t i) const
    {
        tdm_k_bn_fwd(i, (int)(i / len), x, mean, invstd, gamma, beta, y);
    }
};

/* Indexed by the output so that writes coalesce: y (N, C, F). */
struct CnhwToNchw {
    const float *x;
    float *y;
    int c, n;
    int64_t f;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t fi = i % f, t = i / f;
        tdm_k_cnhw_to_nchw((int)(t / c), (int)(t % c), fi, x, y, c, n, f);
    }
};

/* y (C, N, F). */
struct NchwToCnhw {
    const float *x;
    float *y;
    int c, n;
    int64_t f;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t fi = i % f, t = i / f;
        tdm_k_nchw_to_cnhw((int)(t % n), (int)(t / n), fi, x, y, c, n, f);
    }
};

struct Sgd {
    float *p;
    const float *grad;
    float *mom;
    float lr, momentum, dampening, wd;
    int nesterov, first;
    __host__ __device__ void operator()(int64_t i) const
    {
        tdm_k_sgd(i, p, grad, mom, lr, momentum, dampening, wd, nesterov, first);
    }
};

struct Adamw {
    float *p;
    const float *grad;
    float *m, *v;
    float lr, b1, b2, eps, wd, bc1, bc2;
    __host__ __device__ void operator()(int64_t i) const
    {
        tdm_k_adamw(i, p, grad, m, v, lr, b1, b2, eps, wd, bc1, bc2);
    }
};

/* Batchnorm's per-channel reductions (statistics, backward): a block per
 * channel, not a thread. Thread t of the block takes the strided slice
 * j = t, t + T, ... of the channel's row through core/kernels.h's partial
 * functions (coalesced loads), a tree in shared memory adds the T
 * partials, and every thread then writes its slice of dx. On the host
 * (the emulator) the same T slices and the same tree run as loops, so the
 * host tests check this decomposition too. One block per channel is
 * enough parallelism for the few, long rows of a CNN (a row is N*H*W). */
constexpr int kBnThreads = 256;

__device__ double bn_block_sum(double v, double *sh)
{
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = kBnThreads / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads(); /* sh is reused by the caller's next reduction */
    return r;
}

/* bn_block_sum's tree on the host, in the same order */
double bn_host_tree(double *p)
{
    for (int s = kBnThreads / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; t++) p[t] += p[t + s];
    return p[0];
}

__global__ void k_bn_stats(const float *x, int channels, int64_t len, float *mean, float *var)
{
    __shared__ double sh[kBnThreads];
    for (int ch = blockIdx.x; ch < channels; ch += gridDim.x) {
        const float *r = x + (int64_t)ch * len;
        double m = bn_block_sum(tdm_k_bn_sum_part(r, len, threadIdx.x, kBnThreads), sh) /
                   (double)len;
        double q = bn_block_sum(tdm_k_bn_sqdev_part(r, len, m, threadIdx.x, kBnThreads), sh);
        if (threadIdx.x == 0) tdm_k_bn_stats_store(ch, m, q, len, mean, var);
    }
}

void bn_stats_host(const float *x, int channels, int64_t len, float *mean, float *var)
{
    double p[kBnThreads];
    for (int ch = 0; ch < channels; ch++) {
        const float *r = x + (int64_t)ch * len;
        for (int t = 0; t < kBnThreads; t++) p[t] = tdm_k_bn_sum_part(r, len, t, kBnThreads);
        double m = bn_host_tree(p) / (double)len;
        for (int t = 0; t < kBnThreads; t++) p[t] = tdm_k_bn_sqdev_part(r, len, m, t, kBnThreads);
        tdm_k_bn_stats_store(ch, m, bn_host_tree(p), len, mean, var);
    }
}

struct BnBwdArgs {
    const float *x, *dy;
    int channels;
    int64_t len;
    const float *mean, *invstd, *gamma;
    float *dx, *dgamma, *dbeta;
    int train;
};

__global__ void k_bn_bwd(BnBwdArgs a)
{
    __shared__ double sh[kBnThreads];
    for (int ch = blockIdx.x; ch < a.channels; ch += gridDim.x) {
        const float *xr = a.x + (int64_t)ch * a.len, *dyr = a.dy + (int64_t)ch * a.len;
        float m = a.mean[ch], is = a.invstd[ch], g = a.gamma[ch];
        double sdy, sdyx;
        tdm_k_bn_bwd_part(xr, dyr, a.len, m, is, threadIdx.x, kBnThreads, &sdy, &sdyx);
        sdy = bn_block_sum(sdy, sh);
        sdyx = bn_block_sum(sdyx, sh);
        if (threadIdx.x == 0) tdm_k_bn_bwd_params(ch, sdy, sdyx, a.dgamma, a.dbeta);
        if (!a.dx) continue;
        float *dxr = a.dx + (int64_t)ch * a.len;
        for (int64_t j = threadIdx.x; j < a.len; j += kBnThreads)
            tdm_k_bn_bwd_dx(j, xr, dyr, dxr, m, is, g, a.len, sdy, sdyx, a.train);
    }
}

void bn_bwd_host(const BnBwdArgs &a)
{
    double p[kBnThreads], q[kBnThreads];
    for (int ch = 0; ch < a.channels; ch++) {
        const float *xr = a.x + (int64_t)ch * a.len, *dyr = a.dy + (int64_t)ch * a.len;
        float m = a.mean[ch], is = a.invstd[ch], g = a.gamma[ch];
        for (int t = 0; t < kBnThreads; t++)
            tdm_k_bn_bwd_part(xr, dyr, a.len, m, is, t, kBnThreads, &p[t], &q[t]);
        double sdy = bn_host_tree(p), sdyx = bn_host_tree(q);
        tdm_k_bn_bwd_params(ch, sdy, sdyx, a.dgamma, a.dbeta);
        if (!a.dx) continue;
        float *dxr = a.dx + (int64_t)ch * a.len;
        for (int t = 0; t < kBnThreads; t++)
            for (int64_t j = t; j < a.len; j += kBnThreads)
                tdm_k_bn_bwd_dx(j, xr, dyr, dxr, m, is, g, a.len, sdy, sdyx, a.train);
    }
}

/* A block per channel, at most kMaxBlocks (the kernels stride over the
 * rest); drops a stale non-sticky error first, as run() does. */
unsigned bn_blocks(int channels)
{
    (void)cudaGetLastError();
    return (unsigned)(channels < kMaxBlocks ? channels : kMaxBlocks);
}

/* ---- transformer (core/kernels.h's GPT kernels) ---- */

/* out (N, C): host nesting n (t = n % T), c. */
struct EmbedFwd {
    const int32_t *tok;
    const float *wte, *wpe;
    int T, C;
    float *out;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t n = i / C;
        tdm_k_embed_fwd(n, (int)(n % T), (int)(i % C), tok, wte, wpe, C, out);
    }
};

/* One thread per column c, rows in the host loop's order: a token that
 * repeats adds into the same row with no race and the same sums. */
struct EmbedBwdCol {
    const int32_t *tok;
    const float *dout;
    int64_t N;
    int T, C;
    float *dwte, *dwpe;
    __host__ __device__ void operator()(int64_t c) const
    {
        for (int64_t n = 0; n < N; n++) tdm_k_embed_bwd(n, (int)(n % T), (int)c, tok, dout, C, dwte, dwpe);
    }
};

struct LayernormFwd {
    const float *x, *g, *b;
    int C;
    float eps;
    float *out, *mean, *rstd;
    __host__ __device__ void operator()(int64_t r) const
    {
        tdm_k_layernorm_fwd_row(r, x, g, b, C, eps, out, mean, rstd);
    }
};

struct LayernormBwdRow {
    const float *x, *dout, *g, *mean, *rstd;
    int C;
    float *dx;
    __host__ __device__ void operator()(int64_t r) const
    {
        tdm_k_layernorm_bwd_row(r, x, dout, g, mean, rstd, C, dx);
    }
};

/* One thread per column, rows in order (as EmbedBwdCol). */
struct LayernormBwdCol {
    const float *x, *dout, *mean, *rstd;
    int64_t rows;
    int C;
    float *dg, *db;
    __host__ __device__ void operator()(int64_t c) const
    {
        for (int64_t r = 0; r < rows; r++)
            tdm_k_layernorm_bwd_param(r, (int)c, x, dout, mean, rstd, C, dg, db);
    }
};

struct GeluFwd {
    const float *x;
    float *y;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_gelu_fwd(i, x, y); }
};

struct GeluBwd {
    const float *x, *dy;
    float *dx;
    __host__ __device__ void operator()(int64_t i) const { tdm_k_gelu_bwd(i, x, dy, dx); }
};

/* (B, H, T, hd): host nesting b, h, t, e. */
struct HeadsSplit {
    const float *src;
    int ld, off, T, H, hd;
    float *dst;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t q = i / hd;
        int e = (int)(i % hd), t = (int)(q % T);
        q /= T;
        tdm_k_heads_split(i, (int)(q / H), (int)(q % H), t, e, T, hd, src, ld, off, dst);
    }
};

struct HeadsMerge {
    const float *src;
    float *dst;
    int ld, off, T, H, hd;
    __host__ __device__ void operator()(int64_t i) const
    {
        int64_t q = i / hd;
        int e = (int)(i % hd), t = (int)(q % T);
        q /= T;
        tdm_k_heads_merge(i, (int)(q / H), (int)(q % H), t, e, T, hd, src, dst, ld, off);
    }
};

struct AttnSoftmaxFwd {
    float *att;
    int T;
    __host__ __device__ void operator()(int64_t r) const
    {
        tdm_k_attn_softmax_row(r, (int)(r % T), att, T);
    }
};

struct AttnSoftmaxBwd {
    const float *p;
    float *dp;
    int T;
    __host__ __device__ void operator()(int64_t r) const
    {
        tdm_k_attn_softmax_bwd_row(r, (int)(r % T), p, dp, T);
    }
};

/* ---- mixed precision ---- */

struct ToBf16 {
    uint16_t *dst;
    const float *src;
    __host__ __device__ void operator()(int64_t i) const { dst[i] = tdm_k_f32_to_bf16(src[i]); }
};

struct ToF16 {
    uint16_t *dst;
    const float *src;
    __host__ __device__ void operator()(int64_t i) const { dst[i] = tdm_k_f32_to_f16(src[i]); }
};

struct FromBf16 {
    float *dst;
    const uint16_t *src;
    __host__ __device__ void operator()(int64_t i) const { dst[i] = tdm_k_bf16_to_f32(src[i]); }
};

struct FromF16 {
    float *dst;
    const uint16_t *src;
    __host__ __device__ void operator()(int64_t i) const { dst[i] = tdm_k_f16_to_f32(src[i]); }
};

/* Every thread that meets a non-finite value stores 1: the same value,
 * so the race is benign (as PyTorch's kernel). */
struct Unscale {
    float *x;
    float inv;
    float *found;
    __host__ __device__ void operator()(int64_t i) const
    {
        if (tdm_k_unscale(i, x, inv)) *found = 1.0f;
    }
};

/* One thread per chunk, summing it in core/kernels.h's fixed order: the
 * host's partial sums, not the fastest reduction. */
struct SumsqChunk {
    const float *x;
    int64_t n;
    double *partials;
    __host__ __device__ void operator()(int64_t c) const
    {
        partials[c] = tdm_k_sumsq_chunk(c, x, n);
    }
};

} // namespace

extern "C" {

cudaError_t tdm_cuda_launch_bias_act(const tdm_cuda_exec *x, float *y, const float *bias,
                                     int64_t rows, int cols, int relu)
{
    return run(x, rows * cols, kThreads, BiasAct{y, bias, cols, relu});
}

cudaError_t tdm_cuda_launch_relu_bwd(const tdm_cuda_exec *x, float *dy, const float *y,
                                     int64_t n_elem)
{
    return run(x, n_elem, kThreads, ReluBwd{dy, y});
}

cudaError_t tdm_cuda_launch_softmax_xent(const tdm_cuda_exec *x, const float *logits,
                                         const int32_t *labels, int rows, int cols, float scale,
                                         float *loss_row, float *dlogits, int *bad_row)
{
    return run(x, (int64_t)rows, kRowThreads,
               SoftmaxXent{logits, labels, cols, scale, loss_row, dlogits, bad_row});
}

cudaError_t tdm_cuda_launch_axpy(const tdm_cuda_exec *x, int64_t n_elem, float alpha,
                                 const float *xs, float *y)
{
    return run(x, n_elem, kThreads, Axpy{alpha, xs, y});
}

cudaError_t tdm_cuda_launch_scale(const tdm_cuda_exec *x, int64_t n_elem, float alpha, float *v)
{
    return run(x, n_elem, kThreads, Scale{alpha, v});
}

cudaError_t tdm_cuda_launch_im2col(const tdm_cuda_exec *x, tdm_conv_geom g, const float *in,
                                   float *col)
{
    return run(x, (int64_t)g.c * g.kh * g.kw * g.n * g.oh * g.ow, kThreads, Im2col{g, in, col});
}

cudaError_t tdm_cuda_launch_col2im(const tdm_cuda_exec *x, tdm_conv_geom g, const float *col,
                                   float *dx)
{
    return run(x, (int64_t)g.c * g.n * g.h * g.w, kThreads, Col2im{g, col, dx});
}

cudaError_t tdm_cuda_launch_maxpool_fwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *in,
                                        float *y, int32_t *argmax)
{
    return run(x, (int64_t)g.c * g.n * g.oh * g.ow, kThreads, MaxpoolFwd{g, in, y, argmax});
}

cudaError_t tdm_cuda_launch_maxpool_bwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *dy,
                                        const int32_t *argmax, float *dx)
{
    /* zero dx, then one write per output (the shared function's contract) */
    size_t bytes = (size_t)g.c * g.n * g.h * g.w * sizeof(float);
    if (x->host) {
        memset(dx, 0, bytes);
    } else {
        cudaError_t e = cudaMemsetAsync(dx, 0, bytes, x->stream);
        if (e != cudaSuccess) return e;
    }
    return run(x, (int64_t)g.c * g.n * g.oh * g.ow, kThreads, MaxpoolBwd{g, dy, argmax, dx});
}

cudaError_t tdm_cuda_launch_act_fwd(const tdm_cuda_exec *x, int act, const float *in, float *y,
                                    int64_t n_elem)
{
    return run(x, n_elem, kThreads, ActFwd{act, in, y});
}

cudaError_t tdm_cuda_launch_act_bwd(const tdm_cuda_exec *x, int act, const float *in,
                                    const float *y, const float *dy, float *dx, int64_t n_elem)
{
    return run(x, n_elem, kThreads, ActBwd{act, in, y, dy, dx});
}

cudaError_t tdm_cuda_launch_avgpool_fwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *in,
                                        float *y)
{
    return run(x, (int64_t)g.c * g.n * g.oh * g.ow, kThreads, AvgpoolFwd{g, in, y});
}

cudaError_t tdm_cuda_launch_avgpool_bwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *dy,
                                        float *dx)
{
    /* zero dx (past the last window), then each output writes its window */
    size_t bytes = (size_t)g.c * g.n * g.h * g.w * sizeof(float);
    if (x->host) {
        memset(dx, 0, bytes);
    } else {
        cudaError_t e = cudaMemsetAsync(dx, 0, bytes, x->stream);
        if (e != cudaSuccess) return e;
    }
    return run(x, (int64_t)g.c * g.n * g.oh * g.ow, kThreads, AvgpoolBwd{g, dy, dx});
}

cudaError_t tdm_cuda_launch_bn_stats(const tdm_cuda_exec *x, const float *in, int channels,
                                     int64_t len, float *mean, float *var)
{
    if (channels <= 0 || len <= 0) return cudaSuccess;
    if (x->host) {
        bn_stats_host(in, channels, len, mean, var);
        return cudaSuccess;
    }
    k_bn_stats<<<bn_blocks(channels), kBnThreads, 0, x->stream>>>(in, channels, len, mean, var);
    return cudaGetLastError();
}

cudaError_t tdm_cuda_launch_bn_prep(const tdm_cuda_exec *x, int channels, float *mean,
                                    const float *var, float *invstd, float *run_mean,
                                    float *run_var, float eps, float momentum, int64_t len,
                                    int train)
{
    return run(x, (int64_t)channels, kRowThreads,
               BnPrep{mean, var, invstd, run_mean, run_var, eps, momentum, len, train});
}

cudaError_t tdm_cuda_launch_bn_fwd(const tdm_cuda_exec *x, const float *in, int channels,
                                   int64_t len, const float *mean, const float *invstd,
                                   const float *gamma, const float *beta, float *y)
{
    return run(x, (int64_t)channels * len, kThreads,
               BnFwd{in, len, mean, invstd, gamma, beta, y});
}

cudaError_t tdm_cuda_launch_bn_bwd(const tdm_cuda_exec *x, const float *in, const float *dy,
                                   int channels, int64_t len, const float *mean,
                                   const float *invstd, const float *gamma, float *dx,
                                   float *dgamma, float *dbeta, int train)
{
    if (channels <= 0 || len <= 0) return cudaSuccess;
    BnBwdArgs a{in, dy, channels, len, mean, invstd, gamma, dx, dgamma, dbeta, train};
    if (x->host) {
        bn_bwd_host(a);
        return cudaSuccess;
    }
    k_bn_bwd<<<bn_blocks(channels), kBnThreads, 0, x->stream>>>(a);
    return cudaGetLastError();
}

cudaError_t tdm_cuda_launch_cnhw_to_nchw(const tdm_cuda_exec *x, const float *in, float *y,
                                         int c, int n, int64_t f)
{
    return run(x, (int64_t)c * n * f, kThreads, CnhwToNchw{in, y, c, n, f});
}

cudaError_t tdm_cuda_launch_nchw_to_cnhw(const tdm_cuda_exec *x, const float *in, float *y,
                                         int c, int n, int64_t f)
{
    return run(x, (int64_t)c * n * f, kThreads, NchwToCnhw{in, y, c, n, f});
}

cudaError_t tdm_cuda_launch_sgd(const tdm_cuda_exec *x, int64_t n_elem, float *param,
                                const float *grad, float *mom, float lr, float momentum,
                                float dampening, float weight_decay, int nesterov,
                                int first_step)
{
    return run(x, n_elem, kThreads,
               Sgd{param, grad, mom, lr, momentum, dampening, weight_decay, nesterov,
                   first_step});
}

cudaError_t tdm_cuda_launch_embed_fwd(const tdm_cuda_exec *x, const int32_t *tok,
                                      const float *wte, const float *wpe, float *out, int B,
                                      int T, int C)
{
    return run(x, (int64_t)B * T * C, kThreads, EmbedFwd{tok, wte, wpe, T, C, out});
}

cudaError_t tdm_cuda_launch_embed_bwd(const tdm_cuda_exec *x, const int32_t *tok,
                                      const float *dout, float *dwte, float *dwpe, int B, int T,
                                      int C)
{
    return run(x, (int64_t)C, kRowThreads, EmbedBwdCol{tok, dout, (int64_t)B * T, T, C, dwte, dwpe});
}

cudaError_t tdm_cuda_launch_layernorm_fwd(const tdm_cuda_exec *x, const float *in,
                                          const float *g, const float *b, float *out,
                                          float *mean, float *rstd, int64_t rows, int C,
                                          float eps)
{
    return run(x, rows, kRowThreads, LayernormFwd{in, g, b, C, eps, out, mean, rstd});
}

cudaError_t tdm_cuda_launch_layernorm_bwd(const tdm_cuda_exec *x, const float *in,
                                          const float *dout, const float *g, const float *mean,
                                          const float *rstd, float *dx, float *dg, float *db,
                                          int64_t rows, int C)
{
    cudaError_t e = run(x, rows, kRowThreads, LayernormBwdRow{in, dout, g, mean, rstd, C, dx});
    if (e != cudaSuccess) return e;
    return run(x, (int64_t)C, kRowThreads, LayernormBwdCol{in, dout, mean, rstd, rows, C, dg, db});
}

cudaError_t tdm_cuda_launch_gelu_fwd(const tdm_cuda_exec *x, const float *in, float *y,
                                     int64_t n_elem)
{
    return run(x, n_elem, kThreads, GeluFwd{in, y});
}

cudaError_t tdm_cuda_launch_gelu_bwd(const tdm_cuda_exec *x, const float *in, const float *dy,
                                     float *dx, int64_t n_elem)
{
    return run(x, n_elem, kThreads, GeluBwd{in, dy, dx});
}

cudaError_t tdm_cuda_launch_heads_split(const tdm_cuda_exec *x, const float *src, int ld,
                                        int off, float *dst, int B, int T, int H, int hd)
{
    return run(x, (int64_t)B * H * T * hd, kThreads, HeadsSplit{src, ld, off, T, H, hd, dst});
}

cudaError_t tdm_cuda_launch_heads_merge(const tdm_cuda_exec *x, const float *src, float *dst,
                                        int ld, int off, int B, int T, int H, int hd)
{
    return run(x, (int64_t)B * H * T * hd, kThreads, HeadsMerge{src, dst, ld, off, T, H, hd});
}

cudaError_t tdm_cuda_launch_attn_softmax_fwd(const tdm_cuda_exec *x, float *att, int64_t rows,
                                             int T)
{
    return run(x, rows, kRowThreads, AttnSoftmaxFwd{att, T});
}

cudaError_t tdm_cuda_launch_attn_softmax_bwd(const tdm_cuda_exec *x, const float *p, float *dp,
                                             int64_t rows, int T)
{
    return run(x, rows, kRowThreads, AttnSoftmaxBwd{p, dp, T});
}

cudaError_t tdm_cuda_launch_adamw(const tdm_cuda_exec *x, int64_t n_elem, float *param,
                                  const float *grad, float *m, float *v, float lr, float beta1,
                                  float beta2, float eps, float weight_decay, float bc1,
                                  float bc2)
{
    return run(x, n_elem, kThreads,
               Adamw{param, grad, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2});
}

cudaError_t tdm_cuda_launch_convert(const tdm_cuda_exec *x, void *dst, int dst_type,
                                    const void *src, int src_type, int64_t n_elem)
{
    if (src_type == TDM_CUDA_T_F32 && dst_type == TDM_CUDA_T_BF16)
        return run(x, n_elem, kThreads, ToBf16{(uint16_t *)dst, (const float *)src});
    if (src_type == TDM_CUDA_T_F32 && dst_type == TDM_CUDA_T_F16)
        return run(x, n_elem, kThreads, ToF16{(uint16_t *)dst, (const float *)src});
    if (src_type == TDM_CUDA_T_BF16 && dst_type == TDM_CUDA_T_F32)
        return run(x, n_elem, kThreads, FromBf16{(float *)dst, (const uint16_t *)src});
    if (src_type == TDM_CUDA_T_F16 && dst_type == TDM_CUDA_T_F32)
        return run(x, n_elem, kThreads, FromF16{(float *)dst, (const uint16_t *)src});
    return cudaErrorInvalidValue;
}

cudaError_t tdm_cuda_launch_unscale(const tdm_cuda_exec *x, float *v, int64_t n_elem, float inv,
                                    float *found_inf)
{
    return run(x, n_elem, kThreads, Unscale{v, inv, found_inf});
}

cudaError_t tdm_cuda_launch_sumsq(const tdm_cuda_exec *x, const float *v, int64_t n_elem,
                                  double *partials)
{
    int64_t chunks = (n_elem + TDM_K_SUMSQ_CHUNK - 1) / TDM_K_SUMSQ_CHUNK;
    return run(x, chunks, kRowThreads, SumsqChunk{v, n_elem, partials});
}

} // extern "C"
