/* core/device.h: the device interface, as its callers see it (models/,
 * dp/, ddp/, tools/, tests/). A device is opaque: callers open it, ask its
 * name and kind, and call the tdm_dev_* functions below, one per entry of
 * the backend's table plus helpers where there is something to add
 * (argument checks, the row-major gemm, cross-device copies). The table,
 * the struct and the backend hooks are core/device_impl.h's, included only
 * by backends: the host backend (core/device_host.c) and the CUDA backend
 * (cuda/); never call a backend's functions by name.
 *
 * gemm takes exactly cublasSgemm's column-major arguments; the host backend
 * maps them to CBLAS, so the mapping the CUDA backend relies on is tested
 * on every machine. Elementwise and row-wise kernels are per-element /
 * per-row functions in core/kernels.h, looped here and grid-strided there.
 *
 * A host device computes on one thread with single-threaded BLAS (unless
 * opened with threads > 1): it is the unit that DP and DDP multiply.
 * Pointers passed to compute functions are device pointers of that device;
 * compute is ordered on the device (a CUDA stream) and may still be running
 * when the call returns: tdm_dev_sync, or a copy to the host, waits. */
#ifndef TDM_CORE_DEVICE_H
#define TDM_CORE_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/geom.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_device_kind {
    TDM_DEVICE_HOST = 0,
    TDM_DEVICE_CUDA,
} tdm_device_kind;

typedef enum tdm_trans {
    TDM_TRANS_N = 0,  /* as cuBLAS CUBLAS_OP_N */
    TDM_TRANS_T = 1,  /* as cuBLAS CUBLAS_OP_T */
} tdm_trans;

typedef enum tdm_act {
    TDM_ACT_NONE = 0,
    TDM_ACT_RELU,
    TDM_ACT_GELU,       /* tanh form, as the GPT's */
    TDM_ACT_TANH,
    TDM_ACT_SIGMOID,
} tdm_act;

/* Opaque: core/device_impl.h defines it for backends. */
typedef struct tdm_device tdm_device;

/* What a device's allocator has handed out: bytes allocated and not yet
 * freed (each allocation rounded up to 64 bytes, as the allocator hands
 * it out), the most that were live at once since the device was opened or
 * the last tdm_dev_mem_reset_peak, and the number of allocations. Like
 * torch.cuda.memory_allocated / max_memory_allocated: what tests and
 * `compare` read to say what a mode keeps in memory, measured rather than
 * estimated. TDM_STATUS_UNSUPPORTED (no message kept) when the backend
 * keeps no accounting (a real GPU, today). */
typedef struct tdm_dev_mem_stats {
    size_t live_bytes, peak_bytes;
    int64_t allocs;
} tdm_dev_mem_stats;
tdm_status tdm_dev_mem_query(const tdm_device *d, tdm_dev_mem_stats *out);
/* Starts a new peak window: peak = live. */
void tdm_dev_mem_reset_peak(tdm_device *d);

/* Opens a device by kind name and index: "cpu" (or "host": host devices
 * are logical, any index >= 0 is valid; threads: BLAS threads for its
 * gemm, 1 = the single-core unit, 0 means 1) or "cuda" (GPU index, or an
 * emulated one under TANDEM_CUDA_EMULATOR; threads unused). NO_DEVICE
 * with a message when the CUDA backend is not built or finds no such GPU;
 * INVALID_ARG for an unknown kind or a negative index. */
tdm_status tdm_device_open(tdm_device **out, const char *kind, int index, int threads);
void tdm_device_free(tdm_device *d);   /* NULL ok */

/* "cpu:0", "cuda:1", "cuda-emu:0": what messages and tables print. */
const char *tdm_dev_name(const tdm_device *d);
tdm_device_kind tdm_dev_kind(const tdm_device *d);
/* The index it was opened with (cpu:<index>, cuda:<index>). */
int tdm_dev_index(const tdm_device *d);
/* Host: the BLAS threads its gemm uses; 1 for other devices. */
int tdm_dev_threads(const tdm_device *d);

/* A parsed device list: "cpu", "cpu:4" (4 devices cpu:0..3), "cpu:0,2",
 * "cuda", "cuda:0,1". Validated against what exists. */
#define TDM_DEVICE_LIST_MAX 64
typedef struct tdm_device_list {
    tdm_device_kind kind;
    int count;
    int index[TDM_DEVICE_LIST_MAX];
} tdm_device_list;
tdm_status tdm_device_list_parse(tdm_device_list *out, const char *spec);
/* Host devices the machine can run at full speed at once (cores). */
int tdm_device_host_cores(void);

/* 1 when the CUDA backend is linked into this program (built with nvcc:
 * it registers itself when loaded), 0 otherwise. */
int tdm_device_cuda_linked(void);
/* GPUs the CUDA backend sees (the emulator's count under
 * TANDEM_CUDA_EMULATOR); NO_DEVICE with a message when the backend is
 * not linked or there is no driver. */
tdm_status tdm_device_cuda_count(int *n);

/* BLAS threads for the calling process (OpenBLAS is process-global). */
void tdm_device_host_set_blas_threads(int threads);
const char *tdm_device_host_blas_info(void);

/* A collective group over devices of this process (DataParallel): rank i
 * is devs[i]. Only the CUDA backend has one (NCCL); elsewhere
 * tdm_dev_group_init returns TDM_STATUS_UNSUPPORTED (no message kept) and
 * callers fall back to tdm_dev_copy_between. Calls come from one thread. */
typedef struct tdm_dev_group tdm_dev_group;
tdm_status tdm_dev_group_init(tdm_dev_group **out, tdm_device *const *devs, int n);
void tdm_dev_group_free(tdm_dev_group *g);   /* NULL ok */
/* bufs[i] (n_elem floats on devs[i]) = bufs[root] for every i. */
tdm_status tdm_dev_group_broadcast(tdm_dev_group *g, float *const *bufs, size_t n_elem,
                                   int root);
/* recvbuf (on devs[root]) = sum over i of sendbufs[i]; recvbuf may be
 * sendbufs[root] (in place). */
tdm_status tdm_dev_group_reduce_sum(tdm_dev_group *g, const float *const *sendbufs,
                                    float *recvbuf, size_t n_elem, int root);

/* --- memory (nbytes in bytes; pointers of d's memory unless "host") --- */
tdm_status tdm_dev_alloc(tdm_device *d, size_t nbytes, void **out);
void tdm_dev_free(tdm_device *d, void *p);   /* NULL ok */
/* Allocates nbytes and zeroes them. */
tdm_status tdm_dev_alloc_zero(tdm_device *d, size_t nbytes, void **out);
/* dst = src on d (the ranges may overlap). */
tdm_status tdm_dev_copy(tdm_device *d, void *dst, const void *src, size_t nbytes);
/* host_dst = src: waits for the work issued on d before it. */
tdm_status tdm_dev_copy_to_host(tdm_device *d, void *host_dst, const void *src, size_t nbytes);
tdm_status tdm_dev_copy_from_host(tdm_device *d, void *dst, const void *host_src,
                                  size_t nbytes);
tdm_status tdm_dev_memset_zero(tdm_device *d, void *p, size_t nbytes);
/* Page-locks the nbytes of host memory at p for d's host copies
 * (cudaHostRegister: copies to and from it then go at the bus's speed
 * without a staging copy), where d's backend has pinned memory;
 * TDM_STATUS_UNSUPPORTED (no message kept) where it has none or needs
 * none (host devices, the CUDA emulator): the memory is then used as it
 * is. p stays the caller's: tdm_dev_host_unpin before freeing it. */
tdm_status tdm_dev_host_pin(tdm_device *d, void *p, size_t nbytes);
void tdm_dev_host_unpin(tdm_device *d, void *p);   /* NULL ok */
/* Waits until the work issued on d has finished. */
tdm_status tdm_dev_sync(tdm_device *d);

/* --- asynchronous host copies (a copy stream) ---
 * A copy between host memory and d's memory that runs beside d's
 * compute: on a GPU a cudaMemcpyAsync on a second stream of the device's
 * own (asynchronous for pinned host memory, tdm_dev_host_pin), ordered
 * after the work already issued on d (the destination may be a block that
 * work still reads) and before nothing until it is finished: till then
 * the copy may read its source and write its destination at any moment,
 * so neither may be touched. tdm_dev_xfer_finish says what must come
 * after it. The CUDA emulator copies only when the handle is finished
 * (the latest moment a GPU may), so that a buffer touched too early
 * gives other bits in the tests instead of passing by luck. A device
 * without a copy stream (host devices) copies at once. */
typedef struct tdm_dev_xfer tdm_dev_xfer;
typedef enum tdm_dev_xfer_dir {
    TDM_DEV_XFER_TO_DEVICE = 0,   /* dst in d's memory, src host memory */
    TDM_DEV_XFER_TO_HOST,         /* dst host memory, src in d's memory */
} tdm_dev_xfer_dir;
typedef enum tdm_dev_xfer_until {
    TDM_DEV_XFER_HOST = 0,   /* the caller waits for the copy: both buffers are its own again */
    TDM_DEV_XFER_DEVICE,     /* the work issued on d from now on (and the collectives ordered
                              * after it) comes after the copy; the caller does not wait: it
                              * reads a host destination after tdm_dev_sync(d) */
    TDM_DEV_XFER_COMM,       /* only the collectives on d's memory issued from now on come
                              * after the copy (a GPU: its copy stream is joined by every
                              * collective anyway); d's compute does not wait, so it reads
                              * the destination only after such a collective has ended */
} tdm_dev_xfer_until;
/* Starts the copy of nbytes (0: a handle with nothing to do). */
tdm_status tdm_dev_copy_async(tdm_device *d, tdm_dev_xfer_dir dir, void *dst, const void *src,
                              size_t nbytes, tdm_dev_xfer **out);
/* Orders what comes after x as `until` says and frees x; NULL ok. An
 * error (a GPU's copy failed) is returned after x is freed. */
tdm_status tdm_dev_xfer_finish(tdm_dev_xfer *x, tdm_dev_xfer_until until);
/* A scratch buffer of at least nbytes in d's memory, owned by the device:
 * grown when a call asks for more, kept otherwise, freed with the device.
 * For temporaries on the training step's path (the loss's per-row values),
 * where an allocation per call would be a cudaMalloc, and its free a
 * cudaFree that synchronises the whole GPU, every step. The contents last
 * until the next call; one caller at a time (the thread driving d). */
tdm_status tdm_dev_scratch(tdm_device *d, size_t nbytes, void **out);
/* Copies between two devices: host<->host is memcpy; host<->accelerator the
 * device's host copy; two devices of one accelerator backend its copy_peer;
 * otherwise staged through host memory. */
tdm_status tdm_dev_copy_between(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                const void *src, size_t nbytes);

/* --- gemm --- */
/* C = alpha op(A) op(B) + beta C, column-major, cublasSgemm's arguments
 * (checked: sizes >= 0, leading dimensions at least the stored rows). */
tdm_status tdm_dev_gemm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                        float alpha, const float *a, int lda, const float *b, int ldb,
                        float beta, float *c, int ldc);

/* Checks the arguments as tdm_dev_gemm does (and strides >= 0, batch >= 0)
 * and runs the device's gemm_strided_batched, or, when the device has
 * none, a loop of its gemm. */
tdm_status tdm_dev_gemm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n,
                                        int k, float alpha, const float *a, int lda,
                                        long long stride_a, const float *b, int ldb,
                                        long long stride_b, float beta, float *c, int ldc,
                                        long long stride_c, int batch);

/* Row-major helpers over gemm (what the layers use).
 * C(m,n) = alpha * op(A) op(B) + beta C, all row-major, where op(A) is
 * (m,k) and op(B) is (k,n). Mapped to column-major by computing C^T. */
tdm_status tdm_dev_gemm_rm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                           float alpha, const float *a, const float *b, float beta, float *c);

/* The row-major batched form: batch products C_i = alpha op(A_i) op(B_i) +
 * beta C_i, each matrix row-major and contiguous, A_i = a + i*stride_a
 * (likewise b, c). */
tdm_status tdm_dev_gemm_rm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                           int n, int k, float alpha, const float *a,
                                           long long stride_a, const float *b,
                                           long long stride_b, float beta, float *c,
                                           long long stride_c, int batch);

/* --- mixed precision (core/kernels.h; docs/MEMORY.md) --- */
/* C = alpha op(A) op(B) + beta C, column-major, cublasGemmEx's arguments
 * with CUBLAS_COMPUTE_32F: A and B are elements of `in` (float32,
 * bfloat16 or float16, both the same), every product is summed in float32,
 * C is float32. Checked as tdm_dev_gemm, and `in` must be one of the
 * three. float32 runs tdm_dev_gemm's very call (the same bits). On a host
 * device bfloat16 is oneDNN's matmul (brgemm on AVX512-BF16/AMX CPUs, one
 * OpenMP thread per device unless opened with more, primitives cached by
 * shape; without libdnnl or a bfloat16 kernel for the CPU the device
 * warns once and widens as for float16); float16 is widened to float32
 * in the backend's scratch (counted
 * in the device's memory) and run by OpenBLAS: a product of two halfs is
 * exact in float32, so this sums what a half gemm with float32
 * accumulation sums (oneDNN 2.6 has no half matmul without AVX512-FP16).
 * CUDA: cublasGemmEx. */
tdm_status tdm_dev_gemm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                           float alpha, const void *a, int lda, const void *b, int ldb,
                           float beta, float *c, int ldc, tdm_dtype in);
/* The batched form (cublasGemmStridedBatchedEx); strides in elements. */
tdm_status tdm_dev_gemm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                           int n, int k, float alpha, const void *a, int lda,
                                           long long stride_a, const void *b, int ldb,
                                           long long stride_b, float beta, float *c, int ldc,
                                           long long stride_c, int batch, tdm_dtype in);
/* Row-major forms, as tdm_dev_gemm_rm and tdm_dev_gemm_rm_strided_batched
 * but with leading dimensions (row strides, in elements) given:
 * C (m, n, row stride ldc) = alpha op(A) op(B) + beta C, A stored with
 * row stride lda (m x k, or k x m when transposed), B with ldb. */
tdm_status tdm_dev_gemm_rm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                              float alpha, const void *a, int lda, const void *b, int ldb,
                              float beta, float *c, int ldc, tdm_dtype in);
tdm_status tdm_dev_gemm_rm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                              int n, int k, float alpha, const void *a, int lda,
                                              long long stride_a, const void *b, int ldb,
                                              long long stride_b, float beta, float *c,
                                              int ldc, long long stride_c, int batch,
                                              tdm_dtype in);
/* dst (n_elem of dst_type) = src (n_elem of src_type): float32 to and from
 * bfloat16 and float16, rounded to nearest even (PyTorch's .to()); the
 * same type is a copy. Other pairs: INVALID_ARG. */
tdm_status tdm_dev_convert(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                           tdm_dtype src_type, int64_t n_elem);
/* x *= inv_scale over n_elem floats, and *found_inf (one float in d's
 * memory) set to 1 when any of them was NaN or infinite before, left as
 * it was otherwise: torch._amp_foreach_non_finite_check_and_unscale_. */
tdm_status tdm_dev_unscale_check(tdm_device *d, float *x, int64_t n_elem, float inv_scale,
                                 float *found_inf);
/* The squared L2 norm of x in pieces: partials[c] (double, in d's memory)
 * = the sum in double of x[i]^2 over chunk c of TDM_DEV_SUMSQ_CHUNK
 * elements, in a fixed order (core/kernels.h's tdm_k_sumsq_chunk), for c
 * < tdm_dev_sumsq_chunks(n_elem). The caller adds the chunks in order. */
#define TDM_DEV_SUMSQ_CHUNK 4096
static inline int64_t tdm_dev_sumsq_chunks(int64_t n_elem)
{
    return (n_elem + TDM_DEV_SUMSQ_CHUNK - 1) / TDM_DEV_SUMSQ_CHUNK;
}
tdm_status tdm_dev_sumsq(tdm_device *d, const float *x, int64_t n_elem, double *partials);

/* --- compute: the layers' kernels (core/kernels.h); counts are elements --- */
/* y[r][c] = act(y[r][c] + bias[c]) over (rows, cols); bias may be NULL. */
tdm_status tdm_dev_bias_act(tdm_device *d, float *y, const float *bias, int64_t rows, int cols,
                            tdm_act act);
/* dy[i] *= (y[i] > 0): backward of relu, in place on dy, y = relu output. */
tdm_status tdm_dev_relu_bwd(tdm_device *d, float *dy, const float *y, int64_t n_elem);
/* Per row of logits (rows, cols): loss_row[r] = logsumexp - logit[label];
 * dlogits = (softmax - onehot) * scale (dlogits may be NULL). */
tdm_status tdm_dev_softmax_xent(tdm_device *d, const float *logits, const int32_t *labels,
                                int rows, int cols, float scale, float *loss_row,
                                float *dlogits);
/* y += alpha x */
tdm_status tdm_dev_axpy(tdm_device *d, int64_t n_elem, float alpha, const float *x, float *y);
/* x *= alpha */
tdm_status tdm_dev_scale(tdm_device *d, int64_t n_elem, float alpha, float *x);
/* CNHW im2col: col (C*KH*KW, N*OH*OW); col2im writes (not adds) dx. With
 * g->ns > g->n, x and dx are a chunk of N images out of a batch of ns
 * (see tdm_conv_geom): col is the chunk's, x and dx are read and written
 * in place in the batch's tensor; only the chunk's images of dx are
 * written. */
tdm_status tdm_dev_im2col(tdm_device *d, const tdm_conv_geom *g, const float *x, float *col);
tdm_status tdm_dev_col2im(tdm_device *d, const tdm_conv_geom *g, const float *col, float *dx);
/* Max pooling over CNHW, window = stride (non-overlapping), no padding.
 * argmax holds the winning input offset of each output. */
tdm_status tdm_dev_maxpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y,
                               int32_t *argmax);
/* dx written (not added) from dy through argmax. */
tdm_status tdm_dev_maxpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                               const int32_t *argmax, float *dx);
/* y = act(x) elementwise (relu, gelu, tanh, sigmoid; y may be x), and
 * dx = dy * act'(x) from x (gelu) or y (the others; dx may be dy). A
 * backend without its own kernels gets them through host copies. */
tdm_status tdm_dev_act_fwd(tdm_device *d, tdm_act act, const float *x, float *y, int64_t n_elem);
tdm_status tdm_dev_act_bwd(tdm_device *d, tdm_act act, const float *x, const float *y,
                           const float *dy, float *dx, int64_t n_elem);
/* Average pooling over CNHW, non-overlapping windows (g->kh x g->kw at
 * g->stride = the window), no padding; backward writes (not adds) dx, 0
 * past the last window. Same fallback as above. */
tdm_status tdm_dev_avgpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y);
tdm_status tdm_dev_avgpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy, float *dx);
/* Batchnorm over CNHW rows: channel ch owns row ch of length len = N*H*W. */
tdm_status tdm_dev_bn_stats(tdm_device *d, const float *x, int channels, int64_t len,
                            float *mean, float *var /* biased */);
/* Per channel: training -> invstd from var, running stats updated;
 * eval -> mean = running mean, invstd from running var. */
tdm_status tdm_dev_bn_prep(tdm_device *d, int channels, float *mean, const float *var,
                           float *invstd, float *run_mean, float *run_var, float eps,
                           float momentum, int64_t len, int train);
tdm_status tdm_dev_bn_fwd(tdm_device *d, const float *x, int channels, int64_t len,
                          const float *mean, const float *invstd, const float *gamma,
                          const float *beta, float *y);
/* dgamma += sum dy*xhat, dbeta += sum dy; dx = training-mode backward. */
tdm_status tdm_dev_bn_bwd(tdm_device *d, const float *x, const float *dy, int channels,
                          int64_t len, const float *mean, const float *invstd,
                          const float *gamma, float *dx, float *dgamma, float *dbeta, int train);
/* (C, N, F) <-> (N, C, F) layout transposes; F = H*W. */
tdm_status tdm_dev_cnhw_to_nchw(tdm_device *d, const float *x, float *y, int c, int n,
                                int64_t f);
tdm_status tdm_dev_nchw_to_cnhw(tdm_device *d, const float *x, float *y, int c, int n,
                                int64_t f);

/* 1 when d's backend has every transformer kernel below (the GPT needs
 * them; a backend may leave them out). */
int tdm_dev_has_transformer(const tdm_device *d);

/* --- transformer kernels: activations are (N = B*T rows, C columns)
 * row-major, tokens int32 in [0, vocab) --- */
/* out (N, C) = wte[tok] + wpe[position]. */
tdm_status tdm_dev_embed_fwd(tdm_device *d, const int32_t *tok, const float *wte,
                             const float *wpe, float *out, int B, int T, int C);
/* dwte[tok[n]] += dout[n], dwpe[n % T] += dout[n] (deterministic order). */
tdm_status tdm_dev_embed_bwd(tdm_device *d, const int32_t *tok, const float *dout, float *dwte,
                             float *dwpe, int B, int T, int C);
/* Per row: out = LayerNorm(x) * g + b; mean and rstd (rows) kept. */
tdm_status tdm_dev_layernorm_fwd(tdm_device *d, const float *x, const float *g, const float *b,
                                 float *out, float *mean, float *rstd, int64_t rows, int C,
                                 float eps);
/* Adds the input gradient into dx and the parameter gradients into dg, db. */
tdm_status tdm_dev_layernorm_bwd(tdm_device *d, const float *x, const float *dout,
                                 const float *g, const float *mean, const float *rstd, float *dx,
                                 float *dg, float *db, int64_t rows, int C);
/* y = gelu(x) (tanh form); dx = dy * gelu'(x), dx may be dy. */
tdm_status tdm_dev_gelu_fwd(tdm_device *d, const float *x, float *y, int64_t n_elem);
tdm_status tdm_dev_gelu_bwd(tdm_device *d, const float *x, const float *dy, float *dx,
                            int64_t n_elem);
/* dst (B, H, T, hd) = columns [off, off + H*hd) of src (B*T, ld), by head;
 * merge writes them back (the inverse). */
tdm_status tdm_dev_heads_split(tdm_device *d, const float *src, int ld, int off, float *dst,
                               int B, int T, int H, int hd);
tdm_status tdm_dev_heads_merge(tdm_device *d, const float *src, float *dst, int ld, int off,
                               int B, int T, int H, int hd);
/* In place over att (rows, T), rows = B*H*T, row r's query at r % T:
 * causal softmax (the future is exactly 0); backward turns dp into the
 * scores' gradient in place. */
tdm_status tdm_dev_attn_softmax_fwd(tdm_device *d, float *att, int64_t rows, int T);
tdm_status tdm_dev_attn_softmax_bwd(tdm_device *d, const float *p, float *dp, int64_t rows,
                                    int T);

/* --- fused optimizer loops over flat buffers (core/kernels.h) --- */
tdm_status tdm_dev_sgd_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                            float *mom, float lr, float momentum, float dampening,
                            float weight_decay, int nesterov, int first_step);
tdm_status tdm_dev_adamw_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                              float *m, float *v, float lr, float beta1, float beta2, float eps,
                              float weight_decay, float bias_corr1, float bias_corr2);

#ifdef __cplusplus
}
#endif

#endif
