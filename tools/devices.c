/* tools/devices.c: see tools/devices.h. */
#include "tools/devices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_weak.h"

int tdm_tool_cuda_emulated(void)
{
    return tdm_cuda_emulator_env && tdm_device_cuda_linked() ? tdm_cuda_emulator_env() : 0;
}

void tdm_tool_print_emulated(FILE *f, const char *spec)
{
    int n = tdm_tool_cuda_emulated();
    if (n && spec && !strncmp(spec, "cuda", 4))
        fprintf(f, "  CUDA EMULATOR (TANDEM_CUDA_EMULATOR=%d): the cuda devices are emulated on "
                "the host (host memory, the CUDA kernels' code run as host loops, DDP reducing "
                "over the host communicator, not NCCL): not a GPU result\n", n);
}

int tdm_tool_device_tf32(const tdm_device *d)
{
    return tdm_cuda_device_tf32 && tdm_cuda_device_tf32(d);
}

tdm_status tdm_tool_parse_one_device(tdm_device_list *dl, const char *spec)
{
    TDM_CHECK(tdm_device_list_parse(dl, spec));
    if (dl->kind == TDM_DEVICE_CUDA && !strcmp(spec, "cuda")) {
        dl->count = 1;
        dl->index[0] = 0;
    }
    return TDM_STATUS_OK;
}
