/* core/device_mixed.c: the dispatchers of the device interface's
 * mixed-precision entries (core/device.h): gemm with 16-bit inputs and
 * its batched and row-major forms, dtype conversion, loss-scale
 * unscaling with the non-finite check, and the chunked squared norm.
 * Argument checks live here, once for every backend; float32 inputs take
 * the plain gemm's own path so that they compute its bits. Not the
 * backends (core/device_host.c with core/device_dnnl.c, cuda/). */
#include "core/device_impl.h"
#include "core/kernels.h"

_Static_assert(TDM_DEV_SUMSQ_CHUNK == TDM_K_SUMSQ_CHUNK,
               "core/device.h and core/kernels.h must chunk the norm alike");

static int tdm_dev_float_type(tdm_dtype t)
{
    return t == TDM_DTYPE_FLOAT32 || t == TDM_DTYPE_BFLOAT16 || t == TDM_DTYPE_FLOAT16;
}

static tdm_status tdm_dev_gemm_ex_check(const tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                        int n, int k, int lda, int ldb, int ldc, tdm_dtype in)
{
    int arows = ta == TDM_TRANS_N ? m : k;
    int brows = tb == TDM_TRANS_N ? k : n;
    TDM_REQUIRE(tdm_dev_float_type(in), TDM_STATUS_INVALID_ARG,
                "gemm_ex: input type %s (expected float32, bfloat16 or float16)",
                tdm_dtype_name(in));
    TDM_REQUIRE(m >= 0 && n >= 0 && k >= 0, TDM_STATUS_INVALID_ARG,
                "gemm_ex: negative size m=%d n=%d k=%d", m, n, k);
    TDM_REQUIRE(lda >= (arows > 1 ? arows : 1), TDM_STATUS_INVALID_ARG, "gemm_ex: lda=%d < %d",
                lda, arows);
    TDM_REQUIRE(ldb >= (brows > 1 ? brows : 1), TDM_STATUS_INVALID_ARG, "gemm_ex: ldb=%d < %d",
                ldb, brows);
    TDM_REQUIRE(ldc >= (m > 1 ? m : 1), TDM_STATUS_INVALID_ARG, "gemm_ex: ldc=%d < %d", ldc, m);
    TDM_REQUIRE(in == TDM_DTYPE_FLOAT32 || d->ops->gemm_ex, TDM_STATUS_UNSUPPORTED,
                "%s: this backend has no %s gemm", d->name, tdm_dtype_name(in));
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_gemm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                           float alpha, const void *a, int lda, const void *b, int ldb,
                           float beta, float *c, int ldc, tdm_dtype in)
{
    TDM_CHECK(tdm_dev_gemm_ex_check(d, ta, tb, m, n, k, lda, ldb, ldc, in));
    if (m == 0 || n == 0) return TDM_STATUS_OK;
    if (in == TDM_DTYPE_FLOAT32)
        return d->ops->gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return d->ops->gemm_ex(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, in);
}

tdm_status tdm_dev_gemm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                           int n, int k, float alpha, const void *a, int lda,
                                           long long stride_a, const void *b, int ldb,
                                           long long stride_b, float beta, float *c, int ldc,
                                           long long stride_c, int batch, tdm_dtype in)
{
    TDM_CHECK(tdm_dev_gemm_ex_check(d, ta, tb, m, n, k, lda, ldb, ldc, in));
    TDM_REQUIRE(batch >= 0 && stride_a >= 0 && stride_b >= 0 && stride_c >= 0,
                TDM_STATUS_INVALID_ARG,
                "batched gemm_ex: batch %d and strides %lld, %lld, %lld must not be negative",
                batch, stride_a, stride_b, stride_c);
    if (m == 0 || n == 0 || batch == 0) return TDM_STATUS_OK;
    if (in == TDM_DTYPE_FLOAT32)
        return tdm_dev_gemm_strided_batched(d, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                                            stride_b, beta, c, ldc, stride_c, batch);
    if (d->ops->gemm_strided_batched_ex)
        return d->ops->gemm_strided_batched_ex(d, ta, tb, m, n, k, alpha, a, lda, stride_a, b,
                                               ldb, stride_b, beta, c, ldc, stride_c, batch, in);
    size_t es = tdm_dtype_size(in);
    for (int i = 0; i < batch; i++)
        TDM_CHECK(d->ops->gemm_ex(d, ta, tb, m, n, k, alpha, (const char *)a + i * stride_a * es,
                                  lda, (const char *)b + i * stride_b * es, ldb, beta,
                                  c + i * stride_c, ldc, in));
    return TDM_STATUS_OK;
}

/* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
 * row-major matrix with row stride ld read column-major is its transpose
 * with leading dimension ld: B goes first, with its own flag. */
tdm_status tdm_dev_gemm_rm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                              float alpha, const void *a, int lda, const void *b, int ldb,
                              float beta, float *c, int ldc, tdm_dtype in)
{
    return tdm_dev_gemm_ex(d, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc, in);
}

tdm_status tdm_dev_gemm_rm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                              int n, int k, float alpha, const void *a, int lda,
                                              long long stride_a, const void *b, int ldb,
                                              long long stride_b, float beta, float *c,
                                              int ldc, long long stride_c, int batch,
                                              tdm_dtype in)
{
    return tdm_dev_gemm_strided_batched_ex(d, tb, ta, n, m, k, alpha, b, ldb, stride_b, a, lda,
                                           stride_a, beta, c, ldc, stride_c, batch, in);
}

tdm_status tdm_dev_convert(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                           tdm_dtype src_type, int64_t n_elem)
{
    TDM_REQUIRE(n_elem >= 0, TDM_STATUS_INVALID_ARG, "convert: %lld elements",
                (long long)n_elem);
    if (dst_type == src_type && tdm_dev_float_type(dst_type)) {
        if (n_elem == 0 || dst == src) return TDM_STATUS_OK;
        return d->ops->copy(d, dst, src, (size_t)n_elem * tdm_dtype_size(dst_type));
    }
    int to16 = src_type == TDM_DTYPE_FLOAT32 &&
               (dst_type == TDM_DTYPE_BFLOAT16 || dst_type == TDM_DTYPE_FLOAT16);
    int from16 = dst_type == TDM_DTYPE_FLOAT32 &&
                 (src_type == TDM_DTYPE_BFLOAT16 || src_type == TDM_DTYPE_FLOAT16);
    TDM_REQUIRE(to16 || from16, TDM_STATUS_INVALID_ARG,
                "convert: %s to %s (expected float32 to or from bfloat16 or float16)",
                tdm_dtype_name(src_type), tdm_dtype_name(dst_type));
    TDM_REQUIRE(d->ops->convert, TDM_STATUS_UNSUPPORTED, "%s: this backend has no conversions",
                d->name);
    if (n_elem == 0) return TDM_STATUS_OK;
    return d->ops->convert(d, dst, dst_type, src, src_type, n_elem);
}

tdm_status tdm_dev_unscale_check(tdm_device *d, float *x, int64_t n_elem, float inv_scale,
                                 float *found_inf)
{
    TDM_REQUIRE(n_elem >= 0 && found_inf, TDM_STATUS_INVALID_ARG,
                "unscale: %lld elements, found_inf %p", (long long)n_elem, (void *)found_inf);
    TDM_REQUIRE(d->ops->unscale_check, TDM_STATUS_UNSUPPORTED,
                "%s: this backend has no unscale kernel", d->name);
    if (n_elem == 0) return TDM_STATUS_OK;
    return d->ops->unscale_check(d, x, n_elem, inv_scale, found_inf);
}

tdm_status tdm_dev_sumsq(tdm_device *d, const float *x, int64_t n_elem, double *partials)
{
    TDM_REQUIRE(n_elem >= 0 && partials, TDM_STATUS_INVALID_ARG,
                "sumsq: %lld elements, partials %p", (long long)n_elem, (void *)partials);
    TDM_REQUIRE(d->ops->sumsq, TDM_STATUS_UNSUPPORTED, "%s: this backend has no norm kernel",
                d->name);
    if (n_elem == 0) return TDM_STATUS_OK;
    return d->ops->sumsq(d, x, n_elem, partials);
}
