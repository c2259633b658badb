/* cuda/cuda_impl.h: internals shared by the CUDA backend's files: the
 * kernel launchers of cuda/kernels_cuda.cu (C linkage, callable from C;
 * they run on the GPU or, for host tests, on the calling thread) and the
 * per-process table of open CUDA devices that the NCCL
 * communicator uses to order its stream after the compute stream.
 * Not a public header: it names CUDA types, and only cuda/ includes it. */
#ifndef TDM_CUDA_CUDA_IMPL_H
#define TDM_CUDA_CUDA_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "core/kernels.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The tdm_status a CUDA error stands for (no device, out of memory, ...);
 * one mapping for the device backend and the NCCL communicator. */
tdm_status tdm_cuda_status_of(cudaError_t e);
/* Teardown calls have no caller to fail to: a failing one is logged at
 * WARN ("<where>: <what>: <CUDA's string> (<name>)") and otherwise ignored. */
void tdm_cuda_warn(const char *where, const char *what, cudaError_t e);

/* Where a launcher runs its kernel: enqueued on `stream` (the GPU), or,
 * when `host` is set, as a plain loop on the calling thread over the
 * very same per-index functor (the emulator of cuda/emulator.c, which
 * lets host tests check the index arithmetic of every kernel). */
typedef struct tdm_cuda_exec {
    cudaStream_t stream;
    int host;
} tdm_cuda_exec;

/* Every launcher runs one grid-stride kernel and returns
 * cudaGetLastError() of the launch (cudaSuccess when there is nothing to
 * do, and always on the host). The argument lists follow core/device.h;
 * shapes are in elements. */
cudaError_t tdm_cuda_launch_bias_act(const tdm_cuda_exec *x, float *y, const float *bias,
                                     int64_t rows, int cols, int relu);
cudaError_t tdm_cuda_launch_relu_bwd(const tdm_cuda_exec *x, float *dy, const float *y,
                                     int64_t n_elem);
/* bad_row: an int (device memory; host memory for x->host) preset to
 * TDM_CUDA_NO_BAD_ROW; receives the smallest row whose label is outside
 * [0, cols) (that row is skipped). */
#define TDM_CUDA_NO_BAD_ROW 0x7f7f7f7f
cudaError_t tdm_cuda_launch_softmax_xent(const tdm_cuda_exec *x, const float *logits,
                                         const int32_t *labels, int rows, int cols, float scale,
                                         float *loss_row, float *dlogits, int *bad_row);
cudaError_t tdm_cuda_launch_axpy(const tdm_cuda_exec *x, int64_t n_elem, float alpha,
                                 const float *xs, float *y);
cudaError_t tdm_cuda_launch_scale(const tdm_cuda_exec *x, int64_t n_elem, float alpha, float *v);
cudaError_t tdm_cuda_launch_im2col(const tdm_cuda_exec *x, tdm_conv_geom g, const float *in,
                                   float *col);
cudaError_t tdm_cuda_launch_col2im(const tdm_cuda_exec *x, tdm_conv_geom g, const float *col,
                                   float *dx);
cudaError_t tdm_cuda_launch_maxpool_fwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *in,
                                        float *y, int32_t *argmax);
/* act: tdm_act's value (relu 1, gelu 2, tanh 3, sigmoid 4). */
cudaError_t tdm_cuda_launch_act_fwd(const tdm_cuda_exec *x, int act, const float *in, float *y,
                                    int64_t n_elem);
cudaError_t tdm_cuda_launch_act_bwd(const tdm_cuda_exec *x, int act, const float *in,
                                    const float *y, const float *dy, float *dx, int64_t n_elem);
cudaError_t tdm_cuda_launch_avgpool_fwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *in,
                                        float *y);
cudaError_t tdm_cuda_launch_avgpool_bwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *dy,
                                        float *dx);
cudaError_t tdm_cuda_launch_maxpool_bwd(const tdm_cuda_exec *x, tdm_conv_geom g, const float *dy,
                                        const int32_t *argmax, float *dx);
cudaError_t tdm_cuda_launch_bn_stats(const tdm_cuda_exec *x, const float *in, int channels,
                                     int64_t len, float *mean, float *var);
cudaError_t tdm_cuda_launch_bn_prep(const tdm_cuda_exec *x, int channels, float *mean,
                                    const float *var, float *invstd, float *run_mean,
                                    float *run_var, float eps, float momentum, int64_t len,
                                    int train);
cudaError_t tdm_cuda_launch_bn_fwd(const tdm_cuda_exec *x, const float *in, int channels,
                                   int64_t len, const float *mean, const float *invstd,
                                   const float *gamma, const float *beta, float *y);
cudaError_t tdm_cuda_launch_bn_bwd(const tdm_cuda_exec *x, const float *in, const float *dy,
                                   int channels, int64_t len, const float *mean,
                                   const float *invstd, const float *gamma, float *dx,
                                   float *dgamma, float *dbeta, int train);
cudaError_t tdm_cuda_launch_cnhw_to_nchw(const tdm_cuda_exec *x, const float *in, float *y,
                                         int c, int n, int64_t f);
cudaError_t tdm_cuda_launch_nchw_to_cnhw(const tdm_cuda_exec *x, const float *in, float *y,
                                         int c, int n, int64_t f);
cudaError_t tdm_cuda_launch_sgd(const tdm_cuda_exec *x, int64_t n_elem, float *param,
                                const float *grad, float *mom, float lr, float momentum,
                                float dampening, float weight_decay, int nesterov,
                                int first_step);
cudaError_t tdm_cuda_launch_adamw(const tdm_cuda_exec *x, int64_t n_elem, float *param,
                                  const float *grad, float *m, float *v, float lr, float beta1,
                                  float beta2, float eps, float weight_decay, float bc1,
                                  float bc2);

/* The transformer kernels (core/device.h's argument lists). The two
 * column reductions (embedding and LayerNorm parameter gradients) run one
 * thread per column over the rows in order: deterministic and the host's
 * sums, not the fastest possible. */
cudaError_t tdm_cuda_launch_embed_fwd(const tdm_cuda_exec *x, const int32_t *tok,
                                      const float *wte, const float *wpe, float *out, int B,
                                      int T, int C);
cudaError_t tdm_cuda_launch_embed_bwd(const tdm_cuda_exec *x, const int32_t *tok,
                                      const float *dout, float *dwte, float *dwpe, int B, int T,
                                      int C);
cudaError_t tdm_cuda_launch_layernorm_fwd(const tdm_cuda_exec *x, const float *in,
                                          const float *g, const float *b, float *out,
                                          float *mean, float *rstd, int64_t rows, int C,
                                          float eps);
cudaError_t tdm_cuda_launch_layernorm_bwd(const tdm_cuda_exec *x, const float *in,
                                          const float *dout, const float *g, const float *mean,
                                          const float *rstd, float *dx, float *dg, float *db,
                                          int64_t rows, int C);
cudaError_t tdm_cuda_launch_gelu_fwd(const tdm_cuda_exec *x, const float *in, float *y,
                                     int64_t n_elem);
cudaError_t tdm_cuda_launch_gelu_bwd(const tdm_cuda_exec *x, const float *in, const float *dy,
                                     float *dx, int64_t n_elem);
cudaError_t tdm_cuda_launch_heads_split(const tdm_cuda_exec *x, const float *src, int ld,
                                        int off, float *dst, int B, int T, int H, int hd);
cudaError_t tdm_cuda_launch_heads_merge(const tdm_cuda_exec *x, const float *src, float *dst,
                                        int ld, int off, int B, int T, int H, int hd);
cudaError_t tdm_cuda_launch_attn_softmax_fwd(const tdm_cuda_exec *x, float *att, int64_t rows,
                                             int T);
cudaError_t tdm_cuda_launch_attn_softmax_bwd(const tdm_cuda_exec *x, const float *p, float *dp,
                                             int64_t rows, int T);

/* Mixed precision (core/device.h's convert, unscale_check, sumsq). The
 * element types as plain ints, so that this header needs no core/dtype.h
 * in the .cu file: the C side maps tdm_dtype onto them. A pair the kernel
 * does not convert returns cudaErrorInvalidValue. */
enum { TDM_CUDA_T_F32 = 0, TDM_CUDA_T_BF16 = 1, TDM_CUDA_T_F16 = 2 };
cudaError_t tdm_cuda_launch_convert(const tdm_cuda_exec *x, void *dst, int dst_type,
                                    const void *src, int src_type, int64_t n_elem);
/* found_inf: one float in device memory (host memory for x->host). */
cudaError_t tdm_cuda_launch_unscale(const tdm_cuda_exec *x, float *v, int64_t n_elem, float inv,
                                    float *found_inf);
/* partials: ceil(n_elem / TDM_K_SUMSQ_CHUNK) doubles. */
cudaError_t tdm_cuda_launch_sumsq(const tdm_cuda_exec *x, const float *v, int64_t n_elem,
                                  double *partials);

/* --- open devices (cuda/device_cuda.c) ------------------------------------
 * The NCCL communicator runs on its own stream; before a collective it
 * makes that stream wait for everything already enqueued on the compute
 * stream of the tdm_device open on the same GPU in this process.
 * Returns cudaSuccess and sets *found = 0 when no such device is open
 * (the caller then synchronises the whole GPU instead). */
cudaError_t tdm_cuda_order_after_compute(int device_index, cudaStream_t s, int *found);
/* The same, split in two for asynchronous collectives: records (now, on
 * the issuing thread) a new event on the compute stream of the one
 * tdm_device open on device_index, for the collective to wait on later.
 * *ev = NULL when none or several are open (order_after_compute at run
 * time is then the fallback). The caller destroys the event. */
cudaError_t tdm_cuda_mark_compute(int device_index, cudaEvent_t *ev);
/* Both order after the device's copy stream as well, once it has one
 * (tdm_dev_copy_async): the event is then recorded on the copy stream
 * after it has been made to wait for the compute stream, so that a
 * collective reads what a copy put in place (tdm_dev_xfer_finish's
 * TDM_DEV_XFER_COMM) without the compute stream waiting for the copy. */

#ifdef __cplusplus
}
#endif

#endif
