/* cuda/device_cuda.c: the CUDA backend of the device interface
 * (core/device.h). One tdm_device is one GPU driven through one
 * non-blocking stream and one cuBLAS handle bound to it: every compute
 * entry enqueues work on that stream and returns, copies to and from the
 * host wait for it, and sync waits for everything. gemm maps
 * cublasSgemm's column-major arguments one to one (the host backend maps
 * the same list onto cblas_sgemm). Elementwise and row-wise kernels are
 * launched from cuda/kernels_cuda.cu, which runs core/kernels.h's shared
 * functions.
 *
 * Also here: registration with core/device.c (a constructor that only
 * stores a pointer to cuda/hooks.c's table, never calls CUDA, so loading
 * never fails), the device count with CUDA's own error when there is no
 * driver or device, and the table of open devices the NCCL communicator
 * orders its stream after. The compute entries serve the emulator too
 * (cuda/emulator.c: host memory, kernels as host loops). Not here:
 * collectives (cuda/nccl_comm.c, cuda/nccl_group.c), `tandem info`'s
 * lines (cuda/describe.c). */
#include "cuda/cuda.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/log.h"
#include "cuda/cuda_libs_impl.h"
#include "cuda/device_cuda_impl.h"

/* --- errors --------------------------------------------------------------- */

tdm_status tdm_cuda_status_of(cudaError_t e)
{
    switch (e) {
    case cudaErrorMemoryAllocation: return TDM_STATUS_OUT_OF_MEMORY;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable: return TDM_STATUS_NO_DEVICE;
    case cudaErrorInvalidValue: return TDM_STATUS_INVALID_ARG;
    default: return TDM_STATUS_SYSTEM;
    }
}

void tdm_cuda_warn(const char *where, const char *what, cudaError_t e)
{
    if (e != cudaSuccess)
        TDM_WARN(CUDA, "%s: %s: %s (%s)", where, what, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}

/* Errors a kernel leaves behind for later calls to report: the call that
 * reports one may not be the one that caused it. */
static int tdm_cuda_sticky(cudaError_t e)
{
    return e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure ||
           e == cudaErrorMisalignedAddress || e == cudaErrorIllegalInstruction ||
           e == cudaErrorHardwareStackError || e == cudaErrorAssert;
}

/* "<dev>: <what>: <CUDA's string> (<CUDA's error name>)" */
tdm_status tdm_cuda_fail(const char *dev, const char *what, cudaError_t e)
{
    return tdm_error_set(tdm_cuda_status_of(e), "%s: %s: %s (%s)%s", dev, what,
                         cudaGetErrorString(e), cudaGetErrorName(e),
                         tdm_cuda_sticky(e) ? "; it may come from an earlier kernel on this "
                                              "device (rerun with CUDA_LAUNCH_BLOCKING=1)"
                                            : "");
}

#define TDM_CUDA_CHECK(d, what, call)                                     \
    do {                                                                  \
        cudaError_t tdm_cu_e_ = (call);                                   \
        if (tdm_cu_e_ != cudaSuccess) return tdm_cuda_fail((d)->name, (what), tdm_cu_e_); \
    } while (0)

static tdm_status tdm_cublas_fail(const tdm_device *d, const char *what, cublasStatus_t s)
{
    tdm_status st = s == CUBLAS_STATUS_ALLOC_FAILED    ? TDM_STATUS_OUT_OF_MEMORY
                    : s == CUBLAS_STATUS_INVALID_VALUE ? TDM_STATUS_INVALID_ARG
                                                       : TDM_STATUS_SYSTEM;
    return tdm_error_set(st, "%s: %s: %s (cuBLAS status %d)", d->name, what,
                         cublasGetStatusString(s), (int)s);
}

/* Every entry makes the device current first: DP drives several GPUs from
 * several threads, and the current device is per thread. */
tdm_status tdm_cuda_enter(tdm_device *d)
{
    if (tdm_cuda_impl(d)->exec.host) return TDM_STATUS_OK; /* the emulator */
    TDM_CUDA_CHECK(d, "cudaSetDevice", cudaSetDevice(d->index));
    return TDM_STATUS_OK;
}

/* --- the table of open devices (for the NCCL communicator) ----------------- */

#define TDM_CUDA_MAX_OPEN 256
static pthread_mutex_t tdm_cuda_open_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int index;
    cudaStream_t stream;
    cudaStream_t copy;    /* its copy stream once made (tdm_dev_copy_async), or NULL */
} tdm_cuda_open_tab[TDM_CUDA_MAX_OPEN];
static int tdm_cuda_open_n;

static void tdm_cuda_open_add(int index, cudaStream_t s)
{
    pthread_mutex_lock(&tdm_cuda_open_mu);
    if (tdm_cuda_open_n < TDM_CUDA_MAX_OPEN) {
        tdm_cuda_open_tab[tdm_cuda_open_n].index = index;
        tdm_cuda_open_tab[tdm_cuda_open_n].stream = s;
        tdm_cuda_open_tab[tdm_cuda_open_n].copy = NULL;
        tdm_cuda_open_n++;
    } else {
        TDM_WARN(CUDA, "more than %d CUDA devices open: NCCL falls back to device-wide "
                 "synchronisation for cuda:%d", TDM_CUDA_MAX_OPEN, index);
    }
    pthread_mutex_unlock(&tdm_cuda_open_mu);
}

static void tdm_cuda_open_remove(cudaStream_t s)
{
    pthread_mutex_lock(&tdm_cuda_open_mu);
    for (int i = 0; i < tdm_cuda_open_n; i++)
        if (tdm_cuda_open_tab[i].stream == s) {
            tdm_cuda_open_tab[i] = tdm_cuda_open_tab[--tdm_cuda_open_n];
            break;
        }
    pthread_mutex_unlock(&tdm_cuda_open_mu);
}

void tdm_cuda_open_set_copy(cudaStream_t compute, cudaStream_t copy)
{
    pthread_mutex_lock(&tdm_cuda_open_mu);
    for (int i = 0; i < tdm_cuda_open_n; i++)
        if (tdm_cuda_open_tab[i].stream == compute) tdm_cuda_open_tab[i].copy = copy;
    pthread_mutex_unlock(&tdm_cuda_open_mu);
}

/* ev recorded on the compute stream of entry i; with a copy stream, that
 * stream is made to wait for it and *out is a second event recorded on
 * the copy stream (after its copies so far and the compute: both), else
 * *out = ev. The caller destroys *out. Under tdm_cuda_open_mu. */
static cudaError_t tdm_cuda_mark_locked(int i, cudaEvent_t *out)
{
    cudaEvent_t ev = NULL, joined = NULL;
    *out = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
    e = cudaEventRecord(ev, tdm_cuda_open_tab[i].stream);
    cudaStream_t cp = tdm_cuda_open_tab[i].copy;
    if (e == cudaSuccess && !cp) {
        *out = ev;
        return e;
    }
    if (e == cudaSuccess) e = cudaStreamWaitEvent(cp, ev, 0);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&joined, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(joined, cp);
    cudaError_t e2 = cudaEventDestroy(ev);
    if (e == cudaSuccess) e = e2;
    if (e == cudaSuccess) *out = joined;
    else if (joined) (void)cudaEventDestroy(joined);
    return e;
}

cudaError_t tdm_cuda_order_after_compute(int device_index, cudaStream_t s, int *found)
{
    /* the event is recorded on a stream of this device: make it current */
    cudaError_t e = cudaSetDevice(device_index);
    *found = 0;
    if (e != cudaSuccess) return e;
    pthread_mutex_lock(&tdm_cuda_open_mu);
    for (int i = 0; i < tdm_cuda_open_n && e == cudaSuccess; i++) {
        if (tdm_cuda_open_tab[i].index != device_index) continue;
        /* An event recorded on the compute stream and waited on by s: s
         * runs after everything enqueued so far, without blocking the host.
         * Destroying the event at once is allowed; its resources go when
         * the wait has been satisfied. */
        cudaEvent_t ev;
        e = tdm_cuda_mark_locked(i, &ev);
        if (e != cudaSuccess) break;
        e = cudaStreamWaitEvent(s, ev, 0);
        cudaError_t e2 = cudaEventDestroy(ev);
        if (e == cudaSuccess) e = e2;
        *found = 1;
    }
    pthread_mutex_unlock(&tdm_cuda_open_mu);
    return e;
}

cudaError_t tdm_cuda_mark_compute(int device_index, cudaEvent_t *ev)
{
    *ev = NULL;
    cudaError_t e = cudaSetDevice(device_index);
    if (e != cudaSuccess) return e;
    int matches = 0, at = -1;
    pthread_mutex_lock(&tdm_cuda_open_mu);
    for (int i = 0; i < tdm_cuda_open_n; i++)
        if (tdm_cuda_open_tab[i].index == device_index) {
            at = i;
            matches++;
        }
    if (matches == 1) e = tdm_cuda_mark_locked(at, ev);
    pthread_mutex_unlock(&tdm_cuda_open_mu);
    return e;
}

/* --- memory ---------------------------------------------------------------- */

static tdm_status cuda_alloc(tdm_device *d, size_t nbytes, void **out)
{
    TDM_CHECK(tdm_cuda_enter(d));
    /* cudaMalloc(0) may give NULL; callers treat a buffer as a buffer. */
    cudaError_t e = cudaMalloc(out, nbytes ? nbytes : 256);
    if (e != cudaSuccess) {
        *out = NULL;
        size_t free_b = 0, total_b = 0;
        (void)cudaGetLastError(); /* clear the (non-sticky) allocation error */
        if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) free_b = total_b = 0;
        return tdm_error_set(tdm_cuda_status_of(e),
                             "%s: cannot allocate %zu bytes: %s (%s); %zu of %zu bytes free",
                             d->name, nbytes, cudaGetErrorString(e), cudaGetErrorName(e), free_b,
                             total_b);
    }
    return TDM_STATUS_OK;
}

static void cuda_free(tdm_device *d, void *p)
{
    if (!p) return;
    /* cudaFree waits for the device, so pending kernels using p finish. */
    cudaError_t e = cudaSetDevice(d->index);
    if (e == cudaSuccess) e = cudaFree(p);
    if (e != cudaSuccess)
        TDM_WARN(CUDA, "%s: cudaFree(%p): %s (%s)", d->name, p, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}

static tdm_status cuda_copy(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    if (!nbytes || dst == src) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_enter(d));
    TDM_CUDA_CHECK(d, "cudaMemcpyAsync (device to device)",
                   cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice,
                                   tdm_cuda_impl(d)->stream));
    return TDM_STATUS_OK;
}

/* Host copies are synchronous for the caller: the host buffer may be read
 * or reused as soon as they return (it may be pageable or pinned; the
 * stream synchronisation makes both safe). */
static tdm_status cuda_copy_to_host(tdm_device *d, void *host_dst, const void *src, size_t nbytes)
{
    if (!nbytes) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_enter(d));
    cudaStream_t s = tdm_cuda_impl(d)->stream;
    TDM_CUDA_CHECK(d, "cudaMemcpyAsync (device to host)",
                   cudaMemcpyAsync(host_dst, src, nbytes, cudaMemcpyDeviceToHost, s));
    TDM_CUDA_CHECK(d, "cudaStreamSynchronize after a copy to the host", cudaStreamSynchronize(s));
    return TDM_STATUS_OK;
}

static tdm_status cuda_copy_from_host(tdm_device *d, void *dst, const void *host_src,
                                      size_t nbytes)
{
    if (!nbytes) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_enter(d));
    cudaStream_t s = tdm_cuda_impl(d)->stream;
    TDM_CUDA_CHECK(d, "cudaMemcpyAsync (host to device)",
                   cudaMemcpyAsync(dst, host_src, nbytes, cudaMemcpyHostToDevice, s));
    TDM_CUDA_CHECK(d, "cudaStreamSynchronize after a copy from the host",
                   cudaStreamSynchronize(s));
    return TDM_STATUS_OK;
}

/* Pinned host memory (tdm_dev_host_pin): registered once for every GPU
 * (portable), so that any device's copies to and from it are direct. */
static tdm_status cuda_host_pin(tdm_device *d, void *p, size_t nbytes)
{
    TDM_CHECK(tdm_cuda_enter(d));
    TDM_CUDA_CHECK(d, "cudaHostRegister", cudaHostRegister(p, nbytes, cudaHostRegisterPortable));
    return TDM_STATUS_OK;
}

static void cuda_host_unpin(tdm_device *d, void *p)
{
    cudaError_t e = cudaSetDevice(d->index);
    if (e == cudaSuccess) e = cudaHostUnregister(p);
    if (e != cudaSuccess)
        TDM_WARN(CUDA, "%s: cudaHostUnregister(%p): %s (%s)", d->name, p, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}

static tdm_status cuda_memset_zero(tdm_device *d, void *p, size_t nbytes)
{
    if (!nbytes) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_enter(d));
    TDM_CUDA_CHECK(d, "cudaMemsetAsync", cudaMemsetAsync(p, 0, nbytes, tdm_cuda_impl(d)->stream));
    return TDM_STATUS_OK;
}

static tdm_status cuda_sync(tdm_device *d)
{
    TDM_CHECK(tdm_cuda_enter(d));
    /* Errors of earlier kernels (illegal address, ...) surface here. */
    TDM_CUDA_CHECK(d, "cudaStreamSynchronize", cudaStreamSynchronize(tdm_cuda_impl(d)->stream));
    return TDM_STATUS_OK;
}

/* Lets dst (current device) read and write src's memory directly, once
 * per pair; where that is impossible cudaMemcpyPeerAsync still works (the
 * driver stages it). Errors here are not failures: they are cleared so that
 * the next launch check does not report them. */
static uint64_t tdm_cuda_peer_tried[64]; /* [dst] bit src: set up (or found impossible)
                                           once per process: peer access belongs to the
                                           GPU's context, not to a tdm_device */

static void tdm_cuda_peer_enable(tdm_device *dst_dev, int src_index)
{
    int dst = dst_dev->index;
    if (src_index < 0 || src_index >= 64 || dst < 0 || dst >= 64 || src_index == dst) return;
    uint64_t bit = (uint64_t)1 << src_index;
    if (__atomic_fetch_or(&tdm_cuda_peer_tried[dst], bit, __ATOMIC_ACQ_REL) & bit) return;
    int can = 0;
    cudaError_t e = cudaDeviceCanAccessPeer(&can, dst, src_index);
    if (e == cudaSuccess && can) {
        e = cudaDeviceEnablePeerAccess(src_index, 0);
        /* NCCL or an earlier device object may have enabled it already */
        if (e == cudaErrorPeerAccessAlreadyEnabled) e = cudaSuccess;
    }
    /* a failed runtime call stays the thread's last error until read: clear
     * it, or the next launch check would report it against a kernel */
    (void)cudaGetLastError();
    if (e != cudaSuccess)
        TDM_WARN(CUDA, "%s: peer access to cuda:%d: %s (%s); peer copies are staged by the "
                 "driver", dst_dev->name, src_index, cudaGetErrorString(e), cudaGetErrorName(e));
    else
        TDM_INFO(CUDA, "%s: peer access to cuda:%d %s", dst_dev->name, src_index,
                 can ? "enabled" : "not possible (copies staged by the driver)");
}

/* A copy between two GPUs on dst's stream, ordered both ways with events:
 * it starts after the work already issued on src's stream (which may be
 * producing src) and src's later work waits for it (which may overwrite
 * src), so neither host thread blocks. Events are made per call: several
 * DP threads may copy from the same master at once. */
static tdm_status cuda_copy_peer(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                 const void *src, size_t nbytes)
{
    if (!nbytes) return TDM_STATUS_OK;
    if (dst_dev == src_dev) return cuda_copy(dst_dev, dst, src, nbytes);
    tdm_status st = TDM_STATUS_OK;
    cudaEvent_t produced = NULL, copied = NULL;
    cudaError_t e = cudaSuccess;
    const char *what = "", *on = src_dev->name;   /* the failing call, its device */
#define TDM_PEER_STEP(call, name)          \
    do {                                   \
        what = (name);                     \
        if ((e = (call)) != cudaSuccess) { \
            st = TDM_STATUS_SYSTEM;        \
            goto done;                     \
        }                                  \
    } while (0)
    TDM_TRY(tdm_cuda_enter(src_dev));
    TDM_PEER_STEP(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming),
                  "cudaEventCreateWithFlags");
    TDM_PEER_STEP(cudaEventRecord(produced, tdm_cuda_impl(src_dev)->stream), "cudaEventRecord");
    TDM_TRY(tdm_cuda_enter(dst_dev));
    on = dst_dev->name;
    tdm_cuda_peer_enable(dst_dev, src_dev->index);
    cudaStream_t s = tdm_cuda_impl(dst_dev)->stream;
    TDM_PEER_STEP(cudaStreamWaitEvent(s, produced, 0), "cudaStreamWaitEvent");
    TDM_PEER_STEP(cudaMemcpyPeerAsync(dst, dst_dev->index, src, src_dev->index, nbytes, s),
                  "cudaMemcpyPeerAsync");
    TDM_PEER_STEP(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming),
                  "cudaEventCreateWithFlags");
    TDM_PEER_STEP(cudaEventRecord(copied, s), "cudaEventRecord");
    TDM_TRY(tdm_cuda_enter(src_dev));
    on = src_dev->name;
    TDM_PEER_STEP(cudaStreamWaitEvent(tdm_cuda_impl(src_dev)->stream, copied, 0),
                  "cudaStreamWaitEvent (source after the copy)");
#undef TDM_PEER_STEP
done:
    if (e != cudaSuccess)
        st = tdm_error_set(tdm_cuda_status_of(e), "%s -> %s: %s (on %s): %s (%s)",
                           src_dev->name, dst_dev->name, what, on, cudaGetErrorString(e),
                           cudaGetErrorName(e));
fail: /* TDM_TRY's: the message is set */
    /* destroying an event with pending waits is allowed: it goes once they
     * are satisfied (a failed create leaves the handle NULL) */
    if (produced) tdm_cuda_warn(src_dev->name, "cudaEventDestroy", cudaEventDestroy(produced));
    if (copied) tdm_cuda_warn(dst_dev->name, "cudaEventDestroy", cudaEventDestroy(copied));
    return st;
}

static void cuda_close(tdm_device *d)
{
    tdm_cuda_dev *c = tdm_cuda_impl(d);
    if (!c) return;
    cudaError_t e = cudaSetDevice(d->index);
    if (e == cudaSuccess && c->stream) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess)
        TDM_WARN(CUDA, "%s: closing: %s (%s)", d->name, cudaGetErrorString(e),
                 cudaGetErrorName(e));
    tdm_cuda_copy_close(d);
    if (c->stream) tdm_cuda_open_remove(c->stream);
    if (c->blas) {
        cublasStatus_t b = cublasDestroy(c->blas);
        if (b != CUBLAS_STATUS_SUCCESS)
            TDM_WARN(CUDA, "%s: closing: cublasDestroy: %s", d->name, cublasGetStatusString(b));
    }
    if (c->bad_row) tdm_cuda_warn(d->name, "closing: cudaFree", cudaFree(c->bad_row));
    if (c->stream) tdm_cuda_warn(d->name, "closing: cudaStreamDestroy", cudaStreamDestroy(c->stream));
    free(c);
    d->impl = NULL;
}

/* --- compute --------------------------------------------------------------- */

tdm_status tdm_cuda_gemm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                         float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc)
{
    tdm_device *h = tdm_cuda_impl(d)->host;
    if (h) return h->ops->gemm(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    TDM_CHECK(tdm_cuda_enter(d));
    /* core/device.h's argument list is cublasSgemm's, one to one. */
    cublasStatus_t s = cublasSgemm(tdm_cuda_impl(d)->blas,
                                   ta == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   tb == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha,
                                   a, lda, b, ldb, &beta, c, ldc);
    if (s != CUBLAS_STATUS_SUCCESS) return tdm_cublas_fail(d, "cublasSgemm", s);
    return TDM_STATUS_OK;
}

/* cuBLAS's names for the input types gemm_ex takes (float32 never comes
 * here: the dispatcher runs tdm_dev_gemm's path for it). */
static cudaDataType_t tdm_cuda_ex_type(tdm_dtype in)
{
    return in == TDM_DTYPE_BFLOAT16 ? CUDA_R_16BF : in == TDM_DTYPE_FLOAT16 ? CUDA_R_16F : CUDA_R_32F;
}

tdm_status tdm_cuda_gemm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                            float alpha, const void *a, int lda, const void *b, int ldb,
                            float beta, float *c, int ldc, tdm_dtype in)
{
    tdm_device *h = tdm_cuda_impl(d)->host;
    if (h) return h->ops->gemm_ex(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, in);
    TDM_CHECK(tdm_cuda_enter(d));
    cudaDataType_t t = tdm_cuda_ex_type(in);
    cublasStatus_t s = cublasGemmEx(tdm_cuda_impl(d)->blas,
                                    ta == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    tb == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha,
                                    a, t, lda, b, t, ldb, &beta, c, CUDA_R_32F, ldc,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return tdm_cublas_fail(d, "cublasGemmEx", s);
    return TDM_STATUS_OK;
}

tdm_status tdm_cuda_gemm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                            int n, int k, float alpha, const void *a, int lda,
                                            long long stride_a, const void *b, int ldb,
                                            long long stride_b, float beta, float *c, int ldc,
                                            long long stride_c, int batch, tdm_dtype in)
{
    tdm_device *h = tdm_cuda_impl(d)->host;
    if (h)
        return h->ops->gemm_strided_batched_ex(h, ta, tb, m, n, k, alpha, a, lda, stride_a, b,
                                               ldb, stride_b, beta, c, ldc, stride_c, batch, in);
    TDM_CHECK(tdm_cuda_enter(d));
    cudaDataType_t t = tdm_cuda_ex_type(in);
    cublasStatus_t s = cublasGemmStridedBatchedEx(
        tdm_cuda_impl(d)->blas, ta == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N,
        tb == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, a, t, lda, stride_a, b, t,
        ldb, stride_b, &beta, c, CUDA_R_32F, ldc, stride_c, batch, CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return tdm_cublas_fail(d, "cublasGemmStridedBatchedEx", s);
    return TDM_STATUS_OK;
}

/* Every kernel entry: make the device current, launch on its stream,
 * check the launch (cudaGetLastError, returned by the launcher). */
#define TDM_CUDA_RUN(d, what, launch)                                     \
    do {                                                                  \
        TDM_CHECK(tdm_cuda_enter(d));                                     \
        const tdm_cuda_exec *s_ = &tdm_cuda_impl(d)->exec;                \
        TDM_CUDA_CHECK(d, what " kernel launch", launch);                 \
        return TDM_STATUS_OK;                                             \
    } while (0)

tdm_status tdm_cuda_bias_act(tdm_device *d, float *y, const float *bias, int64_t rows,
                             int cols, tdm_act act)
{
    TDM_CUDA_RUN(d, "bias_act",
                 tdm_cuda_launch_bias_act(s_, y, bias, rows, cols, act == TDM_ACT_RELU));
}

tdm_status tdm_cuda_relu_bwd(tdm_device *d, float *dy, const float *y, int64_t n_elem)
{
    TDM_CUDA_RUN(d, "relu_bwd", tdm_cuda_launch_relu_bwd(s_, dy, y, n_elem));
}

tdm_status tdm_cuda_softmax_xent(tdm_device *d, const float *logits, const int32_t *labels,
                                 int rows, int cols, float scale, float *loss_row,
                                 float *dlogits)
{
    if (rows <= 0) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_enter(d));
    tdm_cuda_dev *c = tdm_cuda_impl(d);
    int bad = TDM_CUDA_NO_BAD_ROW;
    if (c->exec.host) {
        TDM_CUDA_CHECK(d, "softmax_xent", tdm_cuda_launch_softmax_xent(&c->exec, logits, labels,
                                                                       rows, cols, scale,
                                                                       loss_row, dlogits, &bad));
        if (bad != TDM_CUDA_NO_BAD_ROW)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "%s: label %d of sample %d is outside [0, %d)", d->name,
                                 labels[bad], bad, cols);
        return TDM_STATUS_OK;
    }
    /* Labels live on the device; the kernel reports the first row whose
     * label is out of range, and we read that back (the caller reads the
     * losses right after, so this costs one synchronisation, not two). */
    TDM_CUDA_CHECK(d, "cudaMemsetAsync (label check)",
                   cudaMemsetAsync(c->bad_row, 0x7f, sizeof(int), c->stream));
    TDM_CUDA_CHECK(d, "softmax_xent kernel launch",
                   tdm_cuda_launch_softmax_xent(&c->exec, logits, labels, rows, cols, scale,
                                                loss_row, dlogits, c->bad_row));
    TDM_CUDA_CHECK(d, "cudaMemcpyAsync (label check)",
                   cudaMemcpyAsync(&bad, c->bad_row, sizeof bad, cudaMemcpyDeviceToHost,
                                   c->stream));
    TDM_CUDA_CHECK(d, "cudaStreamSynchronize after softmax_xent",
                   cudaStreamSynchronize(c->stream));
    if (bad != TDM_CUDA_NO_BAD_ROW) {
        int32_t label = 0;
        TDM_CUDA_CHECK(d, "cudaMemcpy (bad label)",
                       cudaMemcpy(&label, labels + bad, sizeof label, cudaMemcpyDeviceToHost));
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "%s: label %d of sample %d is outside [0, %d)", d->name, label, bad,
                             cols);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_cuda_axpy(tdm_device *d, int64_t n_elem, float alpha, const float *x, float *y)
{
    TDM_CUDA_RUN(d, "axpy", tdm_cuda_launch_axpy(s_, n_elem, alpha, x, y));
}

tdm_status tdm_cuda_scale(tdm_device *d, int64_t n_elem, float alpha, float *x)
{
    TDM_CUDA_RUN(d, "scale", tdm_cuda_launch_scale(s_, n_elem, alpha, x));
}

tdm_status tdm_cuda_im2col(tdm_device *d, const tdm_conv_geom *g, const float *x, float *col)
{
    TDM_CUDA_RUN(d, "im2col", tdm_cuda_launch_im2col(s_, *g, x, col));
}

tdm_status tdm_cuda_col2im(tdm_device *d, const tdm_conv_geom *g, const float *col, float *dx)
{
    TDM_CUDA_RUN(d, "col2im", tdm_cuda_launch_col2im(s_, *g, col, dx));
}

tdm_status tdm_cuda_maxpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x,
                                float *y, int32_t *argmax)
{
    TDM_CUDA_RUN(d, "maxpool_fwd",
                 tdm_cuda_launch_maxpool_fwd(s_, *g, x, y, argmax));
}

tdm_status tdm_cuda_maxpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                                const int32_t *argmax, float *dx)
{
    TDM_CUDA_RUN(d, "maxpool_bwd",
                 tdm_cuda_launch_maxpool_bwd(s_, *g, dy, argmax, dx));
}

tdm_status tdm_cuda_act_fwd(tdm_device *d, tdm_act act, const float *x, float *y, int64_t n_elem)
{
    TDM_CUDA_RUN(d, "act_fwd", tdm_cuda_launch_act_fwd(s_, (int)act, x, y, n_elem));
}

tdm_status tdm_cuda_act_bwd(tdm_device *d, tdm_act act, const float *x, const float *y,
                            const float *dy, float *dx, int64_t n_elem)
{
    TDM_CUDA_RUN(d, "act_bwd", tdm_cuda_launch_act_bwd(s_, (int)act, x, y, dy, dx, n_elem));
}

tdm_status tdm_cuda_avgpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y)
{
    TDM_CUDA_RUN(d, "avgpool_fwd", tdm_cuda_launch_avgpool_fwd(s_, *g, x, y));
}

tdm_status tdm_cuda_avgpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy, float *dx)
{
    TDM_CUDA_RUN(d, "avgpool_bwd", tdm_cuda_launch_avgpool_bwd(s_, *g, dy, dx));
}

tdm_status tdm_cuda_bn_stats(tdm_device *d, const float *x, int channels, int64_t len,
                             float *mean, float *var)
{
    TDM_CUDA_RUN(d, "bn_stats", tdm_cuda_launch_bn_stats(s_, x, channels, len, mean, var));
}

tdm_status tdm_cuda_bn_prep(tdm_device *d, int channels, float *mean, const float *var,
                            float *invstd, float *run_mean, float *run_var, float eps,
                            float momentum, int64_t len, int train)
{
    TDM_CUDA_RUN(d, "bn_prep",
                 tdm_cuda_launch_bn_prep(s_, channels, mean, var, invstd, run_mean, run_var, eps,
                                         momentum, len, train));
}

tdm_status tdm_cuda_bn_fwd(tdm_device *d, const float *x, int channels, int64_t len,
                           const float *mean, const float *invstd, const float *gamma,
                           const float *beta, float *y)
{
    TDM_CUDA_RUN(d, "bn_fwd",
                 tdm_cuda_launch_bn_fwd(s_, x, channels, len, mean, invstd, gamma, beta, y));
}

tdm_status tdm_cuda_bn_bwd(tdm_device *d, const float *x, const float *dy, int channels,
                           int64_t len, const float *mean, const float *invstd,
                           const float *gamma, float *dx, float *dgamma, float *dbeta,
                           int train)
{
    TDM_CUDA_RUN(d, "bn_bwd",
                 tdm_cuda_launch_bn_bwd(s_, x, dy, channels, len, mean, invstd, gamma, dx,
                                        dgamma, dbeta, train));
}

tdm_status tdm_cuda_cnhw_to_nchw(tdm_device *d, const float *x, float *y, int c, int n,
                                 int64_t f)
{
    TDM_CUDA_RUN(d, "cnhw_to_nchw", tdm_cuda_launch_cnhw_to_nchw(s_, x, y, c, n, f));
}

tdm_status tdm_cuda_nchw_to_cnhw(tdm_device *d, const float *x, float *y, int c, int n,
                                 int64_t f)
{
    TDM_CUDA_RUN(d, "nchw_to_cnhw", tdm_cuda_launch_nchw_to_cnhw(s_, x, y, c, n, f));
}

tdm_status tdm_cuda_sgd_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                             float *mom, float lr, float momentum, float dampening,
                             float weight_decay, int nesterov, int first_step)
{
    TDM_CUDA_RUN(d, "sgd_step",
                 tdm_cuda_launch_sgd(s_, n_elem, param, grad, mom, lr, momentum, dampening,
                                     weight_decay, nesterov, first_step));
}

tdm_status tdm_cuda_adamw_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                               float *m, float *v, float lr, float beta1, float beta2,
                               float eps, float weight_decay, float bc1, float bc2)
{
    TDM_CUDA_RUN(d, "adamw_step",
                 tdm_cuda_launch_adamw(s_, n_elem, param, grad, m, v, lr, beta1, beta2, eps,
                                       weight_decay, bc1, bc2));
}

tdm_status tdm_cuda_gemm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                         int n, int k, float alpha, const float *a, int lda,
                                         long long stride_a, const float *b, int ldb,
                                         long long stride_b, float beta, float *c, int ldc,
                                         long long stride_c, int batch)
{
    tdm_device *h = tdm_cuda_impl(d)->host;
    if (h)
        return h->ops->gemm_strided_batched(h, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                                            stride_b, beta, c, ldc, stride_c, batch);
    TDM_CHECK(tdm_cuda_enter(d));
    /* core/device.h's argument list is cublasSgemmStridedBatched's, one to one */
    cublasStatus_t s = cublasSgemmStridedBatched(
        tdm_cuda_impl(d)->blas, ta == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N,
        tb == TDM_TRANS_T ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, a, lda, stride_a, b, ldb,
        stride_b, &beta, c, ldc, stride_c, batch);
    if (s != CUBLAS_STATUS_SUCCESS) return tdm_cublas_fail(d, "cublasSgemmStridedBatched", s);
    return TDM_STATUS_OK;
}

tdm_status tdm_cuda_embed_fwd(tdm_device *d, const int32_t *tok, const float *wte,
                              const float *wpe, float *out, int B, int T, int C)
{
    TDM_CUDA_RUN(d, "embed_fwd", tdm_cuda_launch_embed_fwd(s_, tok, wte, wpe, out, B, T, C));
}

tdm_status tdm_cuda_embed_bwd(tdm_device *d, const int32_t *tok, const float *dout,
                              float *dwte, float *dwpe, int B, int T, int C)
{
    TDM_CUDA_RUN(d, "embed_bwd", tdm_cuda_launch_embed_bwd(s_, tok, dout, dwte, dwpe, B, T, C));
}

tdm_status tdm_cuda_layernorm_fwd(tdm_device *d, const float *x, const float *g,
                                  const float *b, float *out, float *mean, float *rstd,
                                  int64_t rows, int C, float eps)
{
    TDM_CUDA_RUN(d, "layernorm_fwd",
                 tdm_cuda_launch_layernorm_fwd(s_, x, g, b, out, mean, rstd, rows, C, eps));
}

tdm_status tdm_cuda_layernorm_bwd(tdm_device *d, const float *x, const float *dout,
                                  const float *g, const float *mean, const float *rstd,
                                  float *dx, float *dg, float *db, int64_t rows, int C)
{
    TDM_CUDA_RUN(d, "layernorm_bwd",
                 tdm_cuda_launch_layernorm_bwd(s_, x, dout, g, mean, rstd, dx, dg, db, rows, C));
}

tdm_status tdm_cuda_gelu_fwd(tdm_device *d, const float *x, float *y, int64_t n_elem)
{
    TDM_CUDA_RUN(d, "gelu_fwd", tdm_cuda_launch_gelu_fwd(s_, x, y, n_elem));
}

tdm_status tdm_cuda_gelu_bwd(tdm_device *d, const float *x, const float *dy, float *dx,
                             int64_t n_elem)
{
    TDM_CUDA_RUN(d, "gelu_bwd", tdm_cuda_launch_gelu_bwd(s_, x, dy, dx, n_elem));
}

tdm_status tdm_cuda_heads_split(tdm_device *d, const float *src, int ld, int off, float *dst,
                                int B, int T, int H, int hd)
{
    TDM_CUDA_RUN(d, "heads_split",
                 tdm_cuda_launch_heads_split(s_, src, ld, off, dst, B, T, H, hd));
}

tdm_status tdm_cuda_heads_merge(tdm_device *d, const float *src, float *dst, int ld, int off,
                                int B, int T, int H, int hd)
{
    TDM_CUDA_RUN(d, "heads_merge",
                 tdm_cuda_launch_heads_merge(s_, src, dst, ld, off, B, T, H, hd));
}

tdm_status tdm_cuda_attn_softmax_fwd(tdm_device *d, float *att, int64_t rows, int T)
{
    TDM_CUDA_RUN(d, "attn_softmax_fwd", tdm_cuda_launch_attn_softmax_fwd(s_, att, rows, T));
}

tdm_status tdm_cuda_attn_softmax_bwd(tdm_device *d, const float *p, float *dp, int64_t rows,
                                     int T)
{
    TDM_CUDA_RUN(d, "attn_softmax_bwd", tdm_cuda_launch_attn_softmax_bwd(s_, p, dp, rows, T));
}

static int tdm_cuda_t(tdm_dtype t)
{
    return t == TDM_DTYPE_BFLOAT16 ? TDM_CUDA_T_BF16 : t == TDM_DTYPE_FLOAT16 ? TDM_CUDA_T_F16
                                                                              : TDM_CUDA_T_F32;
}

tdm_status tdm_cuda_convert(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                            tdm_dtype src_type, int64_t n_elem)
{
    TDM_CUDA_RUN(d, "convert",
                 tdm_cuda_launch_convert(s_, dst, tdm_cuda_t(dst_type), src, tdm_cuda_t(src_type),
                                         n_elem));
}

tdm_status tdm_cuda_unscale_check(tdm_device *d, float *x, int64_t n_elem, float inv_scale,
                                  float *found_inf)
{
    TDM_CUDA_RUN(d, "unscale", tdm_cuda_launch_unscale(s_, x, n_elem, inv_scale, found_inf));
}

tdm_status tdm_cuda_sumsq(tdm_device *d, const float *x, int64_t n_elem, double *partials)
{
    TDM_CUDA_RUN(d, "sumsq", tdm_cuda_launch_sumsq(s_, x, n_elem, partials));
}

const tdm_device_ops tdm_cuda_ops = {
    .alloc = cuda_alloc,
    .free = cuda_free,
    .copy = cuda_copy,
    .copy_to_host = cuda_copy_to_host,
    .copy_from_host = cuda_copy_from_host,
    .memset_zero = cuda_memset_zero,
    .sync = cuda_sync,
    .close = cuda_close,
    .copy_peer = cuda_copy_peer,
    .host_pin = cuda_host_pin,
    .host_unpin = cuda_host_unpin,
    .copy_async = tdm_cuda_copy_async,
    .xfer_finish = tdm_cuda_xfer_finish,
    TDM_CUDA_COMPUTE_OPS,
};

/* --- count, open ------------------------------------------------------------ */

tdm_status tdm_cuda_device_count(int *n)
{
    *n = 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return tdm_error_set(TDM_STATUS_NO_DEVICE,
                             "no CUDA device: %s (%s from cudaGetDeviceCount); use --device cpu:N",
                             cudaGetErrorString(e), cudaGetErrorName(e));
    *n = count;
    return TDM_STATUS_OK;
}

tdm_status tdm_cuda_device_check(int index)
{
    int n = 0;
    TDM_CHECK(tdm_cuda_device_count(&n));
    if (n == 0)
        return tdm_error_set(TDM_STATUS_NO_DEVICE,
                             "no CUDA device: cudaGetDeviceCount found none; use --device cpu:N");
    if (index < 0 || index >= n)
        return tdm_error_set(TDM_STATUS_NO_DEVICE,
                             "no CUDA device: cuda:%d does not exist (%d visible: cuda:0..%d); "
                             "use --device cuda:0..%d or cpu:N", index, n, n - 1, n - 1);
    return TDM_STATUS_OK;
}

tdm_status tdm_cuda_gpu_open(tdm_device **out, int index)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *d = NULL;
    tdm_cuda_dev *c = NULL;
    *out = NULL;
    TDM_CHECK(tdm_cuda_device_check(index));
    d = calloc(1, sizeof *d);
    c = calloc(1, sizeof *c);
    if (!d || !c) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a CUDA device");
        goto fail;
    }
    d->ops = &tdm_cuda_ops;
    d->kind = TDM_DEVICE_CUDA;
    d->index = index;
    d->threads = 1;
    d->impl = c;
    snprintf(d->name, sizeof d->name, "cuda:%d", index);
    c->exec.host = 0;

    cudaError_t e = cudaSetDevice(index);
    if (e != cudaSuccess) { st = tdm_cuda_fail(d->name, "cudaSetDevice", e); goto fail; }
    /* Non-blocking: no implicit synchronisation with the legacy default
     * stream, which other libraries in the process may use. */
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        c->stream = NULL;
        st = tdm_cuda_fail(d->name, "cudaStreamCreateWithFlags", e);
        goto fail;
    }
    e = cudaMalloc((void **)&c->bad_row, sizeof(int));
    if (e != cudaSuccess) {
        c->bad_row = NULL;
        st = tdm_cuda_fail(d->name, "cudaMalloc (4 bytes)", e);
        goto fail;
    }
    /* cuBLAS is loaded now, when a GPU is opened (cuda/cuda_libs.c) */
    if ((st = tdm_cuda_lib_load(TDM_CUDA_LIB_CUBLAS))) {
        st = tdm_error_prefix(st, "%s", d->name);
        goto fail;
    }
    cublasStatus_t bs = cublasCreate(&c->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        st = tdm_cublas_fail(d, "cublasCreate", bs);
        goto fail;
    }
    c->exec.stream = c->stream;
    bs = cublasSetStream(c->blas, c->stream);
    if (bs != CUBLAS_STATUS_SUCCESS) { st = tdm_cublas_fail(d, "cublasSetStream", bs); goto fail; }
    /* FP32 gemm in full FP32 (the host backend's precision) unless the
     * user opts into TF32 tensor cores. */
    const char *tf32 = getenv("TANDEM_CUDA_TF32");
    cublasMath_t math = tf32 && tf32[0] == '1' ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
    c->tf32 = math != CUBLAS_DEFAULT_MATH;
    bs = cublasSetMathMode(c->blas, math);
    if (bs != CUBLAS_STATUS_SUCCESS) { st = tdm_cublas_fail(d, "cublasSetMathMode", bs); goto fail; }
    tdm_cuda_open_add(index, c->stream);
    TDM_INFO(CUDA, "opened %s (%s math)", d->name, math == CUBLAS_DEFAULT_MATH ? "fp32" : "tf32");
    *out = d;
    return TDM_STATUS_OK;
fail:
    if (d && c) {
        cuda_close(d); /* releases what was created; c is freed there */
        c = NULL;
    }
    free(c);
    free(d);
    return st;
}

int tdm_cuda_device_tf32(const tdm_device *d)
{
    return d && d->ops == &tdm_cuda_ops && tdm_cuda_impl((tdm_device *)d)->tf32;
}

/* Runs at load time: stores a pointer and nothing else (no CUDA call), so
 * a binary with the backend linked in starts on machines without a GPU or
 * driver; CUDA is first touched when a CUDA device is counted or opened. */
__attribute__((constructor)) static void tdm_cuda_register(void)
{
    tdm_device_cuda = &tdm_cuda_hooks;
}
