/* cuda/device_cuda_impl.h: what the CUDA device backend's C files share:
 * cuda/device_cuda.c (the GPU: memory, compute entries, open), cuda/emulator.c
 * (the same compute entries on host memory) and cuda/hooks.c (what
 * core/device.c calls). Not public (it names CUDA types); not for
 * cuda/kernels_cuda.cu, which sees only cuda/cuda_impl.h. */
#ifndef TDM_CUDA_DEVICE_CUDA_IMPL_H
#define TDM_CUDA_DEVICE_CUDA_IMPL_H

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "core/device_impl.h"
#include "cuda/cuda_impl.h"

/* A device's state (tdm_device.impl), the GPU's and the emulator's. */
typedef struct tdm_cuda_dev {
    cudaStream_t stream;  /* all work of this device, in issue order */
    cublasHandle_t blas;  /* bound to stream */
    int *bad_row;         /* device int: softmax_xent's label check */
    tdm_cuda_exec exec;   /* {stream, 0}; the emulator: {NULL, 1} */
    tdm_device *host;     /* the emulator's gemm (a host device) */
    int tf32;             /* cuBLAS in TF32 tensor-op math (TANDEM_CUDA_TF32=1) */
    int64_t emu_allocs;   /* the emulator: alloc calls so far (atomic) */
    int64_t emu_xfers;    /* the emulator: asynchronous copies not finished yet (atomic) */
    /* the copy stream (tdm_dev_copy_async), made at the first copy;
     * every collective the NCCL communicator orders after the compute
     * stream is ordered after it too (tdm_cuda_order_after_compute) */
    cudaStream_t copy_stream;
} tdm_cuda_dev;

static inline tdm_cuda_dev *tdm_cuda_impl(tdm_device *d) { return (tdm_cuda_dev *)d->impl; }

/* The two tables: a GPU's (device_cuda.c) and the emulator's (emulator.c). */
extern const tdm_device_ops tdm_cuda_ops;
extern const tdm_device_ops tdm_cuda_emu_ops;
/* What core/device.c's hooks point at (hooks.c); device_cuda.c's
 * constructor registers it. */
extern const tdm_device_cuda_hooks tdm_cuda_hooks;

/* device_cuda.c's helpers for its sibling files: every entry makes the
 * device current first (the emulator: nothing to do); a CUDA error as a
 * status with "<dev>: <what>: <CUDA's string> (<name>)". */
tdm_status tdm_cuda_enter(tdm_device *d);
tdm_status tdm_cuda_fail(const char *dev, const char *what, cudaError_t e);
/* Records the copy stream of the device whose compute stream is compute
 * in the table of open devices (tdm_cuda_order_after_compute joins it). */
void tdm_cuda_open_set_copy(cudaStream_t compute, cudaStream_t copy);

/* The copy stream (cuda/device_copy.c): tdm_dev_copy_async's entries of
 * a GPU's table, and its end at the device's close. */
tdm_status tdm_cuda_copy_async(tdm_device *d, tdm_dev_xfer_dir dir, void *dst, const void *src,
                               size_t nbytes, void **xfer);
tdm_status tdm_cuda_xfer_finish(tdm_device *d, void *xfer, tdm_dev_xfer_until until);
void tdm_cuda_copy_close(tdm_device *d);

/* Opens cuda:<index>, a GPU (no emulator): tdm_device_open's path. */
tdm_status tdm_cuda_gpu_open(tdm_device **out, int index);

/* The compute entries (device_cuda.c): each launches its kernel on the
 * device's stream, or, for an emulator device (exec.host), runs the same
 * functor as a loop on the calling thread; gemm is cuBLAS, or the host
 * backend's for the emulator. Both tables list them through
 * TDM_CUDA_COMPUTE_OPS, so the two cannot drift apart; only memory, sync
 * and close differ. */
tdm_status tdm_cuda_gemm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                         float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc);
tdm_status tdm_cuda_bias_act(tdm_device *d, float *y, const float *bias, int64_t rows,
                             int cols, tdm_act act);
tdm_status tdm_cuda_relu_bwd(tdm_device *d, float *dy, const float *y, int64_t n_elem);
tdm_status tdm_cuda_softmax_xent(tdm_device *d, const float *logits, const int32_t *labels,
                                 int rows, int cols, float scale, float *loss_row,
                                 float *dlogits);
tdm_status tdm_cuda_axpy(tdm_device *d, int64_t n_elem, float alpha, const float *x, float *y);
tdm_status tdm_cuda_scale(tdm_device *d, int64_t n_elem, float alpha, float *x);
tdm_status tdm_cuda_im2col(tdm_device *d, const tdm_conv_geom *g, const float *x, float *col);
tdm_status tdm_cuda_col2im(tdm_device *d, const tdm_conv_geom *g, const float *col, float *dx);
tdm_status tdm_cuda_maxpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x,
                                float *y, int32_t *argmax);
tdm_status tdm_cuda_maxpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                                const int32_t *argmax, float *dx);
tdm_status tdm_cuda_act_fwd(tdm_device *d, tdm_act act, const float *x, float *y, int64_t n_elem);
tdm_status tdm_cuda_act_bwd(tdm_device *d, tdm_act act, const float *x, const float *y,
                            const float *dy, float *dx, int64_t n_elem);
tdm_status tdm_cuda_avgpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y);
tdm_status tdm_cuda_avgpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy, float *dx);
tdm_status tdm_cuda_bn_stats(tdm_device *d, const float *x, int channels, int64_t len,
                             float *mean, float *var);
tdm_status tdm_cuda_bn_prep(tdm_device *d, int channels, float *mean, const float *var,
                            float *invstd, float *run_mean, float *run_var, float eps,
                            float momentum, int64_t len, int train);
tdm_status tdm_cuda_bn_fwd(tdm_device *d, const float *x, int channels, int64_t len,
                           const float *mean, const float *invstd, const float *gamma,
                           const float *beta, float *y);
tdm_status tdm_cuda_bn_bwd(tdm_device *d, const float *x, const float *dy, int channels,
                           int64_t len, const float *mean, const float *invstd,
                           const float *gamma, float *dx, float *dgamma, float *dbeta,
                           int train);
tdm_status tdm_cuda_cnhw_to_nchw(tdm_device *d, const float *x, float *y, int c, int n,
                                 int64_t f);
tdm_status tdm_cuda_nchw_to_cnhw(tdm_device *d, const float *x, float *y, int c, int n,
                                 int64_t f);
tdm_status tdm_cuda_sgd_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                             float *mom, float lr, float momentum, float dampening,
                             float weight_decay, int nesterov, int first_step);
tdm_status tdm_cuda_adamw_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                               float *m, float *v, float lr, float beta1, float beta2,
                               float eps, float weight_decay, float bc1, float bc2);
tdm_status tdm_cuda_gemm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                         int n, int k, float alpha, const float *a, int lda,
                                         long long stride_a, const float *b, int ldb,
                                         long long stride_b, float beta, float *c, int ldc,
                                         long long stride_c, int batch);
tdm_status tdm_cuda_embed_fwd(tdm_device *d, const int32_t *tok, const float *wte,
                              const float *wpe, float *out, int B, int T, int C);
tdm_status tdm_cuda_embed_bwd(tdm_device *d, const int32_t *tok, const float *dout,
                              float *dwte, float *dwpe, int B, int T, int C);
tdm_status tdm_cuda_layernorm_fwd(tdm_device *d, const float *x, const float *g,
                                  const float *b, float *out, float *mean, float *rstd,
                                  int64_t rows, int C, float eps);
tdm_status tdm_cuda_layernorm_bwd(tdm_device *d, const float *x, const float *dout,
                                  const float *g, const float *mean, const float *rstd,
                                  float *dx, float *dg, float *db, int64_t rows, int C);
tdm_status tdm_cuda_gelu_fwd(tdm_device *d, const float *x, float *y, int64_t n_elem);
tdm_status tdm_cuda_gelu_bwd(tdm_device *d, const float *x, const float *dy, float *dx,
                             int64_t n_elem);
tdm_status tdm_cuda_heads_split(tdm_device *d, const float *src, int ld, int off, float *dst,
                                int B, int T, int H, int hd);
tdm_status tdm_cuda_heads_merge(tdm_device *d, const float *src, float *dst, int ld, int off,
                                int B, int T, int H, int hd);
tdm_status tdm_cuda_attn_softmax_fwd(tdm_device *d, float *att, int64_t rows, int T);
tdm_status tdm_cuda_attn_softmax_bwd(tdm_device *d, const float *p, float *dp, int64_t rows,
                                     int T);

/* Mixed precision (core/device.h): cublasGemmEx / cublasGemmStridedBatchedEx
 * with CUBLAS_COMPUTE_32F (the emulator: the host backend's gemm_ex, same
 * rounding of the same 16-bit inputs), and the conversion, unscale and
 * norm kernels of core/kernels.h. */
tdm_status tdm_cuda_gemm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                            float alpha, const void *a, int lda, const void *b, int ldb,
                            float beta, float *c, int ldc, tdm_dtype in);
tdm_status tdm_cuda_gemm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                            int n, int k, float alpha, const void *a, int lda,
                                            long long stride_a, const void *b, int ldb,
                                            long long stride_b, float beta, float *c, int ldc,
                                            long long stride_c, int batch, tdm_dtype in);
tdm_status tdm_cuda_convert(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                            tdm_dtype src_type, int64_t n_elem);
tdm_status tdm_cuda_unscale_check(tdm_device *d, float *x, int64_t n_elem, float inv_scale,
                                  float *found_inf);
tdm_status tdm_cuda_sumsq(tdm_device *d, const float *x, int64_t n_elem, double *partials);

#define TDM_CUDA_COMPUTE_OPS                                                          \
    .gemm = tdm_cuda_gemm, .bias_act = tdm_cuda_bias_act, .relu_bwd = tdm_cuda_relu_bwd, \
    .softmax_xent = tdm_cuda_softmax_xent, .axpy = tdm_cuda_axpy,                     \
    .scale = tdm_cuda_scale, .im2col = tdm_cuda_im2col, .col2im = tdm_cuda_col2im,    \
    .maxpool_fwd = tdm_cuda_maxpool_fwd, .maxpool_bwd = tdm_cuda_maxpool_bwd,         \
    .act_fwd = tdm_cuda_act_fwd, .act_bwd = tdm_cuda_act_bwd,                         \
    .avgpool_fwd = tdm_cuda_avgpool_fwd, .avgpool_bwd = tdm_cuda_avgpool_bwd,         \
    .bn_stats = tdm_cuda_bn_stats, .bn_prep = tdm_cuda_bn_prep,                       \
    .bn_fwd = tdm_cuda_bn_fwd, .bn_bwd = tdm_cuda_bn_bwd,                             \
    .cnhw_to_nchw = tdm_cuda_cnhw_to_nchw, .nchw_to_cnhw = tdm_cuda_nchw_to_cnhw,     \
    .sgd_step = tdm_cuda_sgd_step, .adamw_step = tdm_cuda_adamw_step, TDM_CUDA_GPT_OPS,   \
    TDM_CUDA_MIXED_OPS

/* Mixed precision, in the same two tables. */
#define TDM_CUDA_MIXED_OPS                                                            \
    .gemm_ex = tdm_cuda_gemm_ex, .gemm_strided_batched_ex = tdm_cuda_gemm_strided_batched_ex, \
    .convert = tdm_cuda_convert, .unscale_check = tdm_cuda_unscale_check,             \
    .sumsq = tdm_cuda_sumsq

/* The transformer's (core/device.h), in the same two tables. */
#define TDM_CUDA_GPT_OPS                                                              \
    .gemm_strided_batched = tdm_cuda_gemm_strided_batched,                            \
    .embed_fwd = tdm_cuda_embed_fwd, .embed_bwd = tdm_cuda_embed_bwd,                 \
    .layernorm_fwd = tdm_cuda_layernorm_fwd, .layernorm_bwd = tdm_cuda_layernorm_bwd, \
    .gelu_fwd = tdm_cuda_gelu_fwd, .gelu_bwd = tdm_cuda_gelu_bwd,                     \
    .heads_split = tdm_cuda_heads_split, .heads_merge = tdm_cuda_heads_merge,         \
    .attn_softmax_fwd = tdm_cuda_attn_softmax_fwd,                                    \
    .attn_softmax_bwd = tdm_cuda_attn_softmax_bwd

#endif
