/* cuda/describe.c: tdm_cuda_describe, the CUDA lines of `tandem info`:
 * runtime, driver, NCCL and cuBLAS versions, each GPU and the peer-access
 * matrix, or CUDA's own error when there is no device. */
#include "cuda/cuda.h"

#include <stdarg.h>
#include <stdio.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda/cuda_libs_impl.h"

typedef struct tdm_cuda_buf {
    char *p;
    size_t len, used;
} tdm_cuda_buf;

__attribute__((format(printf, 2, 3))) static void tdm_cuda_put(tdm_cuda_buf *b, const char *fmt,
                                                               ...)
{
    if (!b->len || b->used >= b->len - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->used, b->len - b->used, fmt, ap);
    va_end(ap);
    if (n > 0) b->used += (size_t)n < b->len - b->used ? (size_t)n : b->len - b->used - 1;
}

static void tdm_cuda_put_version(tdm_cuda_buf *b, const char *label, int v)
{
    /* CUDA encodes 1000*major + 10*minor. */
    if (v > 0) tdm_cuda_put(b, "  %-15s%d.%d\n", label, v / 1000, (v % 1000) / 10);
    else tdm_cuda_put(b, "  %-15snone\n", label);
}

tdm_status tdm_cuda_describe(char *buf, size_t len)
{
    tdm_cuda_buf b = {.p = buf, .len = len, .used = 0};
    if (len) buf[0] = '\0';
    int rt = 0, drv = 0, nccl = 0, maj = 0, min = 0, patch = 0;
    if (cudaRuntimeGetVersion(&rt) != cudaSuccess) rt = 0;
    if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
    tdm_cuda_put_version(&b, "CUDA runtime", rt);
    tdm_cuda_put_version(&b, "CUDA driver", drv);
    /* the libraries are loaded here (cuda/cuda_libs.c): their versions,
     * and which files they are, or why they could not be loaded */
    if (tdm_cuda_lib_load(TDM_CUDA_LIB_NCCL) != TDM_STATUS_OK)
        tdm_cuda_put(&b, "  %-15snot loaded: %s\n", "NCCL", tdm_error_message());
    else if (ncclGetVersion(&nccl) == ncclSuccess)
        /* NCCL >= 2.9 encodes 10000*major + 100*minor + patch. */
        tdm_cuda_put(&b, "  %-15s%d.%d.%d (%s)\n", "NCCL", nccl / 10000, (nccl % 10000) / 100,
                     nccl % 100, tdm_cuda_lib_path(TDM_CUDA_LIB_NCCL));
    if (tdm_cuda_lib_load(TDM_CUDA_LIB_CUBLAS) != TDM_STATUS_OK)
        tdm_cuda_put(&b, "  %-15snot loaded: %s\n", "cuBLAS", tdm_error_message());
    else if (cublasGetProperty(MAJOR_VERSION, &maj) == CUBLAS_STATUS_SUCCESS &&
             cublasGetProperty(MINOR_VERSION, &min) == CUBLAS_STATUS_SUCCESS &&
             cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
        tdm_cuda_put(&b, "  %-15s%d.%d.%d (%s)\n", "cuBLAS", maj, min, patch,
                     tdm_cuda_lib_path(TDM_CUDA_LIB_CUBLAS));

    int n = 0;
    tdm_status st = tdm_cuda_device_count(&n);
    if (st != TDM_STATUS_OK) {
        tdm_cuda_put(&b, "  %-15s%s\n", "cuda", tdm_error_message());
        return st;
    }
    if (n == 0) {
        tdm_cuda_put(&b, "  %-15snone visible\n", "cuda");
        return TDM_STATUS_OK;
    }
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp p;
        char name[24]; /* "cuda:" and any int */
        snprintf(name, sizeof name, "cuda:%d", i);
        cudaError_t e = cudaGetDeviceProperties(&p, i);
        if (e != cudaSuccess) {
            tdm_cuda_put(&b, "  %-15scudaGetDeviceProperties: %s (%s)\n", name,
                         cudaGetErrorString(e), cudaGetErrorName(e));
            continue;
        }
        tdm_cuda_put(&b, "  %-15s%s, %.1f GiB, compute capability %d.%d, %d SMs, "
                     "PCI %04x:%02x:%02x.0\n", name, p.name,
                     (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), p.major, p.minor,
                     p.multiProcessorCount, p.pciDomainID, p.pciBusID, p.pciDeviceID);
    }
    if (n > 1) {
        /* Row i, column j: can cuda:i read and write cuda:j's memory
         * directly (NVLink or PCIe P2P)? */
        tdm_cuda_put(&b, "  %-15s", "peer access");
        for (int j = 0; j < n; j++) tdm_cuda_put(&b, " %3d", j);
        tdm_cuda_put(&b, "\n");
        for (int i = 0; i < n; i++) {
            char row[24];
            snprintf(row, sizeof row, "from cuda:%d", i);
            tdm_cuda_put(&b, "  %-15s", row);
            for (int j = 0; j < n; j++) {
                int can = 0;
                if (i != j && cudaDeviceCanAccessPeer(&can, i, j) != cudaSuccess) can = -1;
                tdm_cuda_put(&b, " %3s", i == j ? "-" : can > 0 ? "yes" : can == 0 ? "no" : "?");
            }
            tdm_cuda_put(&b, "\n");
        }
    }
    return TDM_STATUS_OK;
}
