/* tools/info.c: `tandem info`: what this build contains (backends, BLAS,
 * compiler, versions) and the devices it sees. */
#include <stdio.h>
#include <string.h>
#include <zlib.h>

#include "core/device.h"
#include "tools/devices.h"
#include "tools/tools.h"

#include "cuda/cuda_weak.h"   /* tdm_cuda_describe: NULL without the backend */
#include "mpi/mpi_weak.h"

#ifndef TDM_VERSION
#define TDM_VERSION "0.1.0"
#endif
#ifndef TDM_NVCC
#define TDM_NVCC ""
#endif

const char *tdm_tool_version(void)
{
    return TDM_VERSION;
}

int tdm_tool_info_main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: tandem info\n\nPrints the build configuration (backends, BLAS, "
                   "compiler, library versions)\nand the devices this machine offers.\n");
            return tdm_tool_exit(TDM_STATUS_OK);
        }
        return tdm_tool_exit(tdm_tool_usage_error("tandem info: unknown option '%s'\n", argv[i]));
    }
    printf("tandem %s\n", tdm_tool_version());
    printf("build:\n");
    printf("  compiler       gcc %s\n", __VERSION__);
    printf("  host backend   yes (OpenBLAS: %s)\n", tdm_device_host_blas_info());
    printf("  zlib           %s\n", zlibVersion());
    printf("  CUDA backend   %s\n", tdm_device_cuda_linked() ? "yes" : "no (cuda/ not linked into this binary)");
    if (TDM_NVCC[0]) printf("  nvcc           %s\n", TDM_NVCC);
    else printf("  nvcc           not found at build time\n");
    if (tdm_mpi_library_version) {
        char v[256];
        tdm_mpi_library_version(v, sizeof v);
        v[strcspn(v, ",")] = '\0';    /* "Open MPI v4.1.4" */
        printf("  MPI            yes: %s (mpi/: --backend mpi|hier, jobs under mpirun or srun)\n",
               v);
    } else {
        printf("  MPI            no (MPI's development files not found at build time: make "
               "deps installs libopenmpi-dev and openmpi-bin)\n");
    }
    printf("devices:\n");
    printf("  cpu            %d cores usable (host devices cpu:0..N-1 are logical: one "
           "thread each)\n", tdm_device_host_cores());
    if (tdm_device_cuda_linked()) {
        int n = 0;
        tdm_status st = tdm_device_cuda_count(&n);
        if (st == TDM_STATUS_OK && tdm_tool_cuda_emulated()) {
            printf("  cuda           %d emulated device%s (cuda-emu:0..%d), no GPU used\n", n,
                   n == 1 ? "" : "s", n - 1);
            tdm_tool_print_emulated(stdout, "cuda");
        } else if (tdm_cuda_describe) {
            /* the versions first, whether or not a device answers (they
             * matter most when the driver is too old), then each GPU or
             * CUDA's error */
            static char buf[16384];
            if (st == TDM_STATUS_OK) printf("  cuda           %d device%s\n", n, n == 1 ? "" : "s");
            (void)tdm_cuda_describe(buf, sizeof buf);
            fputs(buf, stdout);
        } else {
            printf("  cuda           %s\n", st ? tdm_error_message() : "CUDA backend without "
                   "tdm_cuda_describe");
        }
    }
    return tdm_tool_exit(TDM_STATUS_OK);
}
