/* core/dnnl_impl.h: the host backend's bfloat16 matmul through oneDNN
 * (core/device_dnnl.c), used by core/device_host.c's gemm_ex. Not public:
 * only the host backend includes it. */
#ifndef TDM_CORE_DNNL_IMPL_H
#define TDM_CORE_DNNL_IMPL_H

#include "core/device.h"

/* A host device's oneDNN state: an engine, a stream and the primitives
 * made so far, cached by shape. One thread drives it at a time (the
 * device's). */
typedef struct tdm_dnnl tdm_dnnl;

void tdm_dnnl_free(tdm_dnnl *x);   /* NULL ok */

/* C (float32) = alpha op(A) op(B) + beta C for `batch` matrices of
 * bfloat16 A and B, column-major with cublasGemmStridedBatchedEx's
 * arguments (strides in elements), on `threads` OpenMP threads of the
 * calling thread (set before every call: the count is per thread, and a
 * DataParallel worker must not start a team of every core). *x is made
 * on the first call. dev names the device in messages. UNSUPPORTED when
 * oneDNN cannot be loaded or has no kernel for this CPU and shape (its
 * bfloat16 matmul needs AVX-512). */
tdm_status tdm_dnnl_gemm_bf16(tdm_dnnl **x, const char *dev, int threads, tdm_trans ta,
                              tdm_trans tb, int m, int n, int k, float alpha, const void *a,
                              int lda, long long stride_a, const void *b, int ldb,
                              long long stride_b, float beta, float *c, int ldc,
                              long long stride_c, int batch);

/* The implementation oneDNN picked for the last shape it made a primitive
 * for ("brg:avx512_core_bf16"), or "" before any. */
const char *tdm_dnnl_impl(const tdm_dnnl *x);

#endif
