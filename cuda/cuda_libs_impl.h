/* cuda/cuda_libs_impl.h: the CUDA libraries the backend loads at run time
 * (cuda/cuda_libs.c): cuBLAS and NCCL are opened with dlopen the first time
 * a GPU device, an NCCL communicator or `tandem info` needs them, never at
 * program start, so a process that only uses host devices does not map
 * them (the CUDA runtime is linked statically and loads the driver only
 * when CUDA is first called). Internal to cuda/; plain C types only. */
#ifndef TDM_CUDA_CUDA_LIBS_IMPL_H
#define TDM_CUDA_CUDA_LIBS_IMPL_H

#include "core/status.h"

typedef enum tdm_cuda_lib {
    TDM_CUDA_LIB_CUBLAS = 0,
    TDM_CUDA_LIB_NCCL,
    TDM_CUDA_LIB_COUNT_
} tdm_cuda_lib;

#ifdef __cplusplus
extern "C" {
#endif

/* Loads lib once per process (thread-safe; later calls return the first
 * outcome): TANDEM_CUBLAS_LIB / TANDEM_NCCL_LIB when set (a path or a
 * file name), else the soname this build was compiled against
 * (libcublas.so.<major>, libnccl.so.2), found the way dlopen finds it
 * (LD_LIBRARY_PATH, the binary's rpath, ld.so.cache). On failure:
 * TDM_STATUS_NO_DEVICE with dlopen's reason, what was tried and where the
 * library comes from. */
tdm_status tdm_cuda_lib_load(tdm_cuda_lib lib);

/* Whether lib is loaded in this process (no attempt to load it). */
int tdm_cuda_lib_loaded(tdm_cuda_lib lib);

/* The file lib was loaded from (e.g. /usr/local/cuda/lib64/libcublas.so.13),
 * or "" when it is not loaded. */
const char *tdm_cuda_lib_path(tdm_cuda_lib lib);

#ifdef __cplusplus
}
#endif

#endif
