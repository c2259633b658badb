/* cuda/cuda_libs.c: cuBLAS and NCCL loaded with dlopen when they are
 * first needed (see cuda/cuda_libs_impl.h). The binaries are linked with no
 * DT_NEEDED entry for either: this file defines every cuBLAS and NCCL
 * function the backend calls, with the headers' own prototypes (so the
 * compiler checks each against cublas_v2.h and nccl.h), and each forwards
 * to the library's function found with dlsym. Linking them used to map
 * about 220 MB (libnccl, libcublas, libcublasLt) into every process,
 * `tandem --help` included.
 *
 * A function called before its library was loaded loads it; when that
 * fails it returns the library's "not initialized"/"system error" code
 * (and the string functions say the library is missing), so no call ever
 * jumps through NULL. The entry points that need a library
 * (tdm_cuda_gpu_open, the NCCL communicator and group, describe) call
 * tdm_cuda_lib_load first, which says which file is missing and why.
 *
 * A cuBLAS or NCCL function the backend starts to call must be added to
 * the lists below: the link fails with "undefined reference" otherwise.
 * Not here: the CUDA runtime (linked statically, -lcudart_static; it
 * dlopens the driver, libcuda.so.1, on the first CUDA call). */
#include "cuda/cuda_libs_impl.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The wrappers must not be exported from a shared object that links this
 * file, or they could interpose on the real libraries' own symbols. */
#pragma GCC visibility push(hidden)
#include <cublas_v2.h>
#include <nccl.h>
#pragma GCC visibility pop

#include "core/status.h"

#define TDM_STR_(x) #x
#define TDM_STR(x) TDM_STR_(x)

/* X(return type, name, (parameters), (arguments), value when not loaded) */
#define TDM_CUBLAS_FNS(X)                                                                       \
    X(cublasStatus_t, cublasCreate_v2, (cublasHandle_t * h), (h), CUBLAS_STATUS_NOT_INITIALIZED) \
    X(cublasStatus_t, cublasDestroy_v2, (cublasHandle_t h), (h), CUBLAS_STATUS_NOT_INITIALIZED)  \
    X(cublasStatus_t, cublasSetStream_v2, (cublasHandle_t h, cudaStream_t s), (h, s),           \
      CUBLAS_STATUS_NOT_INITIALIZED)                                                            \
    X(cublasStatus_t, cublasSetMathMode, (cublasHandle_t h, cublasMath_t m), (h, m),            \
      CUBLAS_STATUS_NOT_INITIALIZED)                                                            \
    X(cublasStatus_t, cublasGetProperty, (libraryPropertyType t, int *v), (t, v),               \
      CUBLAS_STATUS_NOT_INITIALIZED)                                                            \
    X(const char *, cublasGetStatusString, (cublasStatus_t s), (s), "cuBLAS is not loaded")     \
    X(cublasStatus_t, cublasSgemm_v2,                                                           \
      (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,       \
       const float *alpha, const float *a, int lda, const float *b, int ldb, const float *beta, \
       float *c, int ldc),                                                                      \
      (h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), CUBLAS_STATUS_NOT_INITIALIZED) \
    X(cublasStatus_t, cublasSgemmStridedBatched,                                                \
      (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,       \
       const float *alpha, const float *a, int lda, long long int sa, const float *b, int ldb,  \
       long long int sb, const float *beta, float *c, int ldc, long long int sc, int count),    \
      (h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, count),             \
      CUBLAS_STATUS_NOT_INITIALIZED)                                                            \
    X(cublasStatus_t, cublasGemmEx,                                                             \
      (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,       \
       const void *alpha, const void *a, cudaDataType at, int lda, const void *b,               \
       cudaDataType bt, int ldb, const void *beta, void *c, cudaDataType ct, int ldc,           \
       cublasComputeType_t comp, cublasGemmAlgo_t algo),                                        \
      (h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, comp, algo),        \
      CUBLAS_STATUS_NOT_INITIALIZED)                                                            \
    X(cublasStatus_t, cublasGemmStridedBatchedEx,                                               \
      (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,       \
       const void *alpha, const void *a, cudaDataType at, int lda, long long int sa,            \
       const void *b, cudaDataType bt, int ldb, long long int sb, const void *beta, void *c,    \
       cudaDataType ct, int ldc, long long int sc, int count, cublasComputeType_t comp,         \
       cublasGemmAlgo_t algo),                                                                  \
      (h, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc, sc, count,  \
       comp, algo),                                                                             \
      CUBLAS_STATUS_NOT_INITIALIZED)

#define TDM_NCCL_FNS(X)                                                                         \
    X(const char *, ncclGetErrorString, (ncclResult_t r), (r), "NCCL is not loaded")            \
    X(const char *, ncclGetLastError, (ncclComm_t c), (c), "NCCL is not loaded")                \
    X(ncclResult_t, ncclGetVersion, (int *v), (v), ncclSystemError)                             \
    X(ncclResult_t, ncclGetUniqueId, (ncclUniqueId * id), (id), ncclSystemError)                \
    X(ncclResult_t, ncclCommInitRankConfig,                                                     \
      (ncclComm_t * c, int n, ncclUniqueId id, int rank, ncclConfig_t *cfg),                    \
      (c, n, id, rank, cfg), ncclSystemError)                                                   \
    X(ncclResult_t, ncclCommFinalize, (ncclComm_t c), (c), ncclSystemError)                     \
    X(ncclResult_t, ncclCommSplit,                                                              \
      (ncclComm_t c, int color, int key, ncclComm_t *n, ncclConfig_t *cfg),                     \
      (c, color, key, n, cfg), ncclSystemError)                                                 \
    X(ncclResult_t, ncclCommDestroy, (ncclComm_t c), (c), ncclSystemError)                      \
    X(ncclResult_t, ncclCommAbort, (ncclComm_t c), (c), ncclSystemError)                        \
    X(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t c, ncclResult_t * e), (c, e),            \
      ncclSystemError)                                                                          \
    X(ncclResult_t, ncclAllReduce,                                                              \
      (const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,        \
       cudaStream_t st),                                                                        \
      (s, r, n, t, op, c, st), ncclSystemError)                                                 \
    X(ncclResult_t, ncclBroadcast,                                                              \
      (const void *s, void *r, size_t n, ncclDataType_t t, int root, ncclComm_t c,              \
       cudaStream_t st),                                                                        \
      (s, r, n, t, root, c, st), ncclSystemError)                                               \
    X(ncclResult_t, ncclReduce,                                                                 \
      (const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op, int root,            \
       ncclComm_t c, cudaStream_t st),                                                          \
      (s, r, n, t, op, root, c, st), ncclSystemError)                                           \
    X(ncclResult_t, ncclAllGather,                                                              \
      (const void *s, void *r, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t st),      \
      (s, r, n, t, c, st), ncclSystemError)                                                     \
    X(ncclResult_t, ncclReduceScatter,                                                          \
      (const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,        \
       cudaStream_t st),                                                                        \
      (s, r, n, t, op, c, st), ncclSystemError)                                                 \
    X(ncclResult_t, ncclSend,                                                                   \
      (const void *s, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st),     \
      (s, n, t, peer, c, st), ncclSystemError)                                                  \
    X(ncclResult_t, ncclRecv,                                                                   \
      (void *r, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st),           \
      (r, n, t, peer, c, st), ncclSystemError)                                                  \
    X(ncclResult_t, ncclGroupStart, (void), (), ncclSystemError)                                \
    X(ncclResult_t, ncclGroupEnd, (void), (), ncclSystemError)

/* The pointers dlsym filled, one per function above. */
#define TDM_LIB_PTR(ret, name, params, args, none) static ret(*tdm_p_##name) params;
TDM_CUBLAS_FNS(TDM_LIB_PTR)
TDM_NCCL_FNS(TDM_LIB_PTR)
#undef TDM_LIB_PTR

typedef struct tdm_cuda_lib_sym {
    const char *name;
    void **slot;
} tdm_cuda_lib_sym;

#define TDM_LIB_SYM(ret, name, params, args, none) {#name, (void **)&tdm_p_##name},
static const tdm_cuda_lib_sym tdm_cublas_syms[] = {TDM_CUBLAS_FNS(TDM_LIB_SYM)};
static const tdm_cuda_lib_sym tdm_nccl_syms[] = {TDM_NCCL_FNS(TDM_LIB_SYM)};
#undef TDM_LIB_SYM

/* One library: what to open, how to say where it comes from, and the
 * outcome of the one attempt. */
typedef struct tdm_cuda_lib_state {
    const char *what;     /* "cuBLAS" */
    const char *env;      /* the override variable */
    const char *soname;   /* what this build was compiled against */
    const char *hint;     /* where it comes from */
    const tdm_cuda_lib_sym *syms;
    size_t n_syms;
    pthread_once_t once;
    void *handle;         /* NULL: not loaded */
    atomic_int loaded;    /* handle is set (release, read with acquire) */
    tdm_status status;
    char path[512];       /* the loaded file */
    char error[1024];     /* why it failed */
} tdm_cuda_lib_state;

static tdm_cuda_lib_state tdm_cuda_libs[TDM_CUDA_LIB_COUNT_] = {
    [TDM_CUDA_LIB_CUBLAS] = {
        .what = "cuBLAS", .env = "TANDEM_CUBLAS_LIB",
        .soname = "libcublas.so." TDM_STR(CUBLAS_VER_MAJOR),
        .hint = "it is in the CUDA " TDM_STR(CUBLAS_VER_MAJOR) " toolkit's lib64 (or pip's "
                "nvidia/cublas/lib): put that folder on LD_LIBRARY_PATH or set "
                "TANDEM_CUBLAS_LIB to the file",
        .syms = tdm_cublas_syms, .n_syms = sizeof tdm_cublas_syms / sizeof tdm_cublas_syms[0],
        .once = PTHREAD_ONCE_INIT,
    },
    [TDM_CUDA_LIB_NCCL] = {
        .what = "NCCL", .env = "TANDEM_NCCL_LIB",
        .soname = "libnccl.so." TDM_STR(NCCL_MAJOR),
        .hint = "it comes with the CUDA toolkit, the libnccl2 package or pip's nvidia-nccl "
                "(nvidia/nccl/lib): put its folder on LD_LIBRARY_PATH or set TANDEM_NCCL_LIB "
                "to the file",
        .syms = tdm_nccl_syms, .n_syms = sizeof tdm_nccl_syms / sizeof tdm_nccl_syms[0],
        .once = PTHREAD_ONCE_INIT,
    },
};

static void tdm_cuda_lib_open(tdm_cuda_lib_state *l)
{
    const char *env = getenv(l->env);
    const char *file = env && *env ? env : l->soname;
    /* RTLD_NOW: a library that cannot resolve its own dependencies fails
     * here, with dlerror's reason, not at some later call. */
    void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        snprintf(l->error, sizeof l->error, "cannot load %s (%s%s%s): %s; %s", l->what, file,
                 env && *env ? " from " : "", env && *env ? l->env : "", why ? why : "?",
                 l->hint);
        l->status = TDM_STATUS_NO_DEVICE;
        return;
    }
    for (size_t i = 0; i < l->n_syms; i++) {
        void *f = dlsym(h, l->syms[i].name);
        if (!f) {
            snprintf(l->error, sizeof l->error, "cannot load %s: %s has no %s (this build "
                     "needs the %s it was compiled against, %s, or a newer one)", l->what,
                     file, l->syms[i].name, l->what, l->soname);
            for (size_t j = 0; j < i; j++) *l->syms[j].slot = NULL;
            dlclose(h);
            l->status = TDM_STATUS_NO_DEVICE;
            return;
        }
        *l->syms[i].slot = f;
    }
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0])
        snprintf(l->path, sizeof l->path, "%s", lm->l_name);
    else
        snprintf(l->path, sizeof l->path, "%s", file);
    l->handle = h;
    l->status = TDM_STATUS_OK;
    atomic_store_explicit(&l->loaded, 1, memory_order_release);   /* pairs with _loaded */
}

static void tdm_cuda_open_cublas(void) { tdm_cuda_lib_open(&tdm_cuda_libs[TDM_CUDA_LIB_CUBLAS]); }
static void tdm_cuda_open_nccl(void) { tdm_cuda_lib_open(&tdm_cuda_libs[TDM_CUDA_LIB_NCCL]); }

/* 1 when lib is usable (loading it on first use), 0 otherwise. */
static int tdm_cuda_lib_ready(tdm_cuda_lib lib)
{
    tdm_cuda_lib_state *l = &tdm_cuda_libs[lib];
    pthread_once(&l->once, lib == TDM_CUDA_LIB_CUBLAS ? tdm_cuda_open_cublas : tdm_cuda_open_nccl);
    return l->handle != NULL;
}

tdm_status tdm_cuda_lib_load(tdm_cuda_lib lib)
{
    TDM_REQUIRE(lib >= 0 && lib < TDM_CUDA_LIB_COUNT_, TDM_STATUS_INVALID_ARG,
                "tdm_cuda_lib_load: no library %d", (int)lib);
    if (tdm_cuda_lib_ready(lib)) return TDM_STATUS_OK;
    return tdm_error_set(tdm_cuda_libs[lib].status, "%s", tdm_cuda_libs[lib].error);
}

int tdm_cuda_lib_loaded(tdm_cuda_lib lib)
{
    return lib >= 0 && lib < TDM_CUDA_LIB_COUNT_ &&
           atomic_load_explicit(&tdm_cuda_libs[lib].loaded, memory_order_acquire);
}

const char *tdm_cuda_lib_path(tdm_cuda_lib lib)
{
    return tdm_cuda_lib_loaded(lib) ? tdm_cuda_libs[lib].path : "";
}

/* The functions themselves: load on first use, then forward (after the
 * first call, pthread_once is one load and a compare). */
#define TDM_LIB_DEF(lib, ret, name, params, args, none) \
    ret name params                                     \
    {                                                   \
        if (!tdm_cuda_lib_ready(lib)) return none;      \
        return tdm_p_##name args;                       \
    }
#define TDM_LIB_DEF_CUBLAS(ret, name, params, args, none) \
    TDM_LIB_DEF(TDM_CUDA_LIB_CUBLAS, ret, name, params, args, none)
#define TDM_LIB_DEF_NCCL(ret, name, params, args, none) \
    TDM_LIB_DEF(TDM_CUDA_LIB_NCCL, ret, name, params, args, none)
TDM_CUBLAS_FNS(TDM_LIB_DEF_CUBLAS)
TDM_NCCL_FNS(TDM_LIB_DEF_NCCL)
