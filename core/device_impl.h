/* core/device_impl.h: the backend side of the device interface, as ggml's
 * ggml-backend-impl.h is to ggml-backend.h: the table of function pointers
 * a backend fills (with designated initializers), the device struct it
 * allocates, and the hooks through which the CUDA backend registers itself
 * with core/device.c.
 *
 * Included only by backends (core/device_host.c, core/device.c and
 * core/device_ops.c, which dispatch, cuda/) and by tests that build or
 * inspect a backend's table. Everyone else includes core/device.h and
 * calls the tdm_dev_* wrappers, which are where the entries' meaning is
 * written: entry `x` does what tdm_dev_x says, on its device's memory,
 * without the wrapper's argument checks. */
#ifndef TDM_CORE_DEVICE_IMPL_H
#define TDM_CORE_DEVICE_IMPL_H

#include "core/device.h"

typedef struct tdm_device_ops {
    /* --- memory --- */
    tdm_status (*alloc)(tdm_device *d, size_t nbytes, void **out);
    void (*free)(tdm_device *d, void *p);   /* never called with NULL */
    tdm_status (*copy)(tdm_device *d, void *dst, const void *src, size_t nbytes);
    tdm_status (*copy_to_host)(tdm_device *d, void *host_dst, const void *src, size_t nbytes);
    tdm_status (*copy_from_host)(tdm_device *d, void *dst, const void *host_src, size_t nbytes);
    tdm_status (*memset_zero)(tdm_device *d, void *p, size_t nbytes);
    tdm_status (*sync)(tdm_device *d);
    /* Releases the backend's state (d->impl); tdm_device_free then frees d. */
    void (*close)(tdm_device *d);
    /* Optional (NULL: absent): dst on dst_dev = src on src_dev, two devices
     * of this backend (dst_dev->ops == src_dev->ops == this table). Ordered
     * after the work already issued on both devices and before work issued
     * on either afterwards, like a same-device copy. CUDA: a peer copy
     * (cudaMemcpyPeerAsync, direct when peer access is possible), no host
     * staging. tdm_dev_copy_between uses it when present. */
    tdm_status (*copy_peer)(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                            const void *src, size_t nbytes);
    /* Optional (NULL: no pinned memory, tdm_dev_host_pin says
     * UNSUPPORTED): page-locks host memory for this device's copies, and
     * undoes it. CUDA: cudaHostRegister / cudaHostUnregister. */
    tdm_status (*host_pin)(tdm_device *d, void *p, size_t nbytes);
    void (*host_unpin)(tdm_device *d, void *p);
    /* Optional (NULL: tdm_dev_copy_async copies at once, synchronously):
     * a copy on the device's copy stream (tdm_dev_copy_async), its state
     * in *xfer; xfer_finish orders what comes after it as `until` says
     * and releases the state, also when it fails. Both or neither. */
    tdm_status (*copy_async)(tdm_device *d, tdm_dev_xfer_dir dir, void *dst, const void *src,
                             size_t nbytes, void **xfer);
    tdm_status (*xfer_finish)(tdm_device *d, void *xfer, tdm_dev_xfer_until until);

    /* --- compute (see the tdm_dev_* wrapper of each name) --- */
    /* cublasSgemm's arguments, already checked by tdm_dev_gemm (m, n > 0). */
    tdm_status (*gemm)(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                       float alpha, const float *a, int lda, const float *b, int ldb,
                       float beta, float *c, int ldc);
    tdm_status (*bias_act)(tdm_device *d, float *y, const float *bias, int64_t rows, int cols,
                           tdm_act act);
    tdm_status (*relu_bwd)(tdm_device *d, float *dy, const float *y, int64_t n_elem);
    tdm_status (*softmax_xent)(tdm_device *d, const float *logits, const int32_t *labels,
                               int rows, int cols, float scale, float *loss_row,
                               float *dlogits);
    tdm_status (*axpy)(tdm_device *d, int64_t n_elem, float alpha, const float *x, float *y);
    tdm_status (*scale)(tdm_device *d, int64_t n_elem, float alpha, float *x);
    tdm_status (*im2col)(tdm_device *d, const tdm_conv_geom *g, const float *x, float *col);
    tdm_status (*col2im)(tdm_device *d, const tdm_conv_geom *g, const float *col, float *dx);
    tdm_status (*maxpool_fwd)(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y,
                              int32_t *argmax);
    tdm_status (*maxpool_bwd)(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                              const int32_t *argmax, float *dx);
    /* optional (NULL: tdm_dev_* runs the kernels on host copies) */
    tdm_status (*act_fwd)(tdm_device *d, tdm_act act, const float *x, float *y, int64_t n_elem);
    tdm_status (*act_bwd)(tdm_device *d, tdm_act act, const float *x, const float *y,
                          const float *dy, float *dx, int64_t n_elem);
    tdm_status (*avgpool_fwd)(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y);
    tdm_status (*avgpool_bwd)(tdm_device *d, const tdm_conv_geom *g, const float *dy, float *dx);
    tdm_status (*bn_stats)(tdm_device *d, const float *x, int channels, int64_t len,
                           float *mean, float *var /* biased */);
    tdm_status (*bn_prep)(tdm_device *d, int channels, float *mean, const float *var,
                          float *invstd, float *run_mean, float *run_var, float eps,
                          float momentum, int64_t len, int train);
    tdm_status (*bn_fwd)(tdm_device *d, const float *x, int channels, int64_t len,
                         const float *mean, const float *invstd, const float *gamma,
                         const float *beta, float *y);
    tdm_status (*bn_bwd)(tdm_device *d, const float *x, const float *dy, int channels,
                         int64_t len, const float *mean, const float *invstd,
                         const float *gamma, float *dx, float *dgamma, float *dbeta,
                         int train);
    tdm_status (*cnhw_to_nchw)(tdm_device *d, const float *x, float *y, int c, int n, int64_t f);
    tdm_status (*nchw_to_cnhw)(tdm_device *d, const float *x, float *y, int c, int n, int64_t f);
    /* --- transformer kernels (core/kernels.h) --- */
    tdm_status (*embed_fwd)(tdm_device *d, const int32_t *tok, const float *wte,
                            const float *wpe, float *out, int B, int T, int C);
    tdm_status (*embed_bwd)(tdm_device *d, const int32_t *tok, const float *dout, float *dwte,
                            float *dwpe, int B, int T, int C);
    tdm_status (*layernorm_fwd)(tdm_device *d, const float *x, const float *g, const float *b,
                                float *out, float *mean, float *rstd, int64_t rows, int C,
                                float eps);
    tdm_status (*layernorm_bwd)(tdm_device *d, const float *x, const float *dout,
                                const float *g, const float *mean, const float *rstd, float *dx,
                                float *dg, float *db, int64_t rows, int C);
    tdm_status (*gelu_fwd)(tdm_device *d, const float *x, float *y, int64_t n_elem);
    tdm_status (*gelu_bwd)(tdm_device *d, const float *x, const float *dy, float *dx,
                           int64_t n_elem);
    tdm_status (*heads_split)(tdm_device *d, const float *src, int ld, int off, float *dst,
                              int B, int T, int H, int hd);
    tdm_status (*heads_merge)(tdm_device *d, const float *src, float *dst, int ld, int off,
                              int B, int T, int H, int hd);
    tdm_status (*attn_softmax_fwd)(tdm_device *d, float *att, int64_t rows, int T);
    tdm_status (*attn_softmax_bwd)(tdm_device *d, const float *p, float *dp, int64_t rows,
                                   int T);
    /* Optional (NULL: tdm_dev_gemm_strided_batched loops over gemm):
     * cublasSgemmStridedBatched's arguments, already checked. */
    tdm_status (*gemm_strided_batched)(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n,
                                       int k, float alpha, const float *a, int lda,
                                       long long stride_a, const float *b, int ldb,
                                       long long stride_b, float beta, float *c, int ldc,
                                       long long stride_c, int batch);
    /* --- mixed precision (tdm_dev_gemm_ex and the rest; arguments
     * checked, m, n > 0, `in` one of float32/bfloat16/float16) --- */
    tdm_status (*gemm_ex)(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                          float alpha, const void *a, int lda, const void *b, int ldb,
                          float beta, float *c, int ldc, tdm_dtype in);
    /* Optional (NULL: a loop of gemm_ex). */
    tdm_status (*gemm_strided_batched_ex)(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                          int n, int k, float alpha, const void *a, int lda,
                                          long long stride_a, const void *b, int ldb,
                                          long long stride_b, float beta, float *c, int ldc,
                                          long long stride_c, int batch, tdm_dtype in);
    /* A supported pair of different types (the dispatcher copies same to same). */
    tdm_status (*convert)(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                          tdm_dtype src_type, int64_t n_elem);
    tdm_status (*unscale_check)(tdm_device *d, float *x, int64_t n_elem, float inv_scale,
                                float *found_inf);
    tdm_status (*sumsq)(tdm_device *d, const float *x, int64_t n_elem, double *partials);
    /* Fused optimizer loops over flat buffers (see core/kernels.h). */
    tdm_status (*sgd_step)(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                           float *mom, float lr, float momentum, float dampening,
                           float weight_decay, int nesterov, int first_step);
    tdm_status (*adamw_step)(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                             float *m, float *v, float lr, float beta1, float beta2, float eps,
                             float weight_decay, float bias_corr1, float bias_corr2);
} tdm_device_ops;

/* Allocated by the backend's open (calloc'd: tdm_device_free frees it). */
struct tdm_device {
    const tdm_device_ops *ops; /* borrowed: static table of the backend */
    tdm_device_kind kind;
    int index;                  /* cpu:<index> or cuda:<index> */
    int threads;                /* host: BLAS threads used by this device */
    char name[32];              /* "cpu:0", "cuda:1" */
    void *impl;                 /* backend state */
    void *scratch;              /* tdm_dev_scratch's buffer (this device's memory), or NULL */
    size_t scratch_nbytes;
    /* The allocator's own accounting, kept by backends that set
     * mem_counted when they open a device (host memory: the host backend
     * and the CUDA emulator, through tdm_device_host_mem_alloc/free);
     * read with tdm_dev_mem_query.
     * Updated atomically: a device may be freed into from another thread. */
    int mem_counted;
    size_t mem_live, mem_peak;
    int64_t mem_allocs;
};

/* For host-memory backends: 64-byte aligned memory of nbytes, counted in
 * d's accounting; free with tdm_device_host_mem_free. */
tdm_status tdm_device_host_mem_alloc(tdm_device *d, size_t nbytes, void **out);
void tdm_device_host_mem_free(tdm_device *d, void *p);

/* The host backend (core/device_host.c), opened by tdm_device_open. */
tdm_status tdm_device_host_open(tdm_device **out, int index, int threads);

/* CUDA backend hooks: set by cuda/'s constructor when it is linked in,
 * NULL otherwise (tdm_device_cuda_linked() says which). */
typedef struct tdm_device_cuda_hooks {
    tdm_status (*open)(tdm_device **out, int index);
    tdm_status (*count)(int *n);
    /* Optional (NULL: absent): a collective group over several GPUs of
     * this process (NCCL), for DataParallel's replicate and reduce.
     * group_init returns TDM_STATUS_UNSUPPORTED when the devices are not
     * all GPUs of this backend (the caller then stages copies). Counts
     * are float32 elements; buffers are device pointers of devs[i]. */
    tdm_status (*group_init)(void **out, tdm_device *const *devs, int n);
    void (*group_free)(void *g);
    tdm_status (*group_broadcast)(void *g, float *const *bufs, size_t n_elem, int root);
    tdm_status (*group_reduce_sum)(void *g, const float *const *sendbufs, float *recvbuf,
                                   size_t n_elem, int root);
} tdm_device_cuda_hooks;
extern const tdm_device_cuda_hooks *tdm_device_cuda;

#endif
