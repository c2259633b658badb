/* tools/devices.h: device handling the subcommands share: parsing
 * --device where one device runs, and the CUDA emulator
 * (TANDEM_CUDA_EMULATOR, see cuda/cuda.h). cuda/ is reached through weak
 * symbols, so builds without the CUDA backend link and refuse CUDA. A
 * rank's device and communicators, and --device parsed without
 * initialising CUDA in a process that forks ranks: dist/run.h. */
#ifndef TDM_TOOLS_DEVICES_H
#define TDM_TOOLS_DEVICES_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "core/device.h"

/* --device where one device runs (train --mode single, bench gemm|train):
 * tdm_device_list_parse, except that a bare "cuda" means GPU 0, as
 * PyTorch's "cuda" device does, rather than every GPU (a list of several
 * is left for the caller to refuse). */
tdm_status tdm_tool_parse_one_device(tdm_device_list *dl, const char *spec);

/* N when TANDEM_CUDA_EMULATOR=N makes "cuda" devices emulated, else 0. */
int tdm_tool_cuda_emulated(void);

/* With the emulator in effect and spec naming CUDA devices, prints to f
 * the line saying that they are emulated on the host, not GPUs. */
void tdm_tool_print_emulated(FILE *f, const char *spec);

/* 1 when d is a GPU computing gemm in TF32 (TANDEM_CUDA_TF32=1). */
int tdm_tool_device_tf32(const tdm_device *d);

#endif
