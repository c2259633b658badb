/* cuda/cuda_weak.h: cuda/cuda.h for code that must also link in builds
 * without the CUDA backend (tools/, tests/): every function cuda.h
 * declares, made a weak reference, so that where cuda/ is not linked each
 * one is NULL and the caller tests it before calling:
 *
 *     if (tdm_cuda_emulator_env && tdm_cuda_emulator_env()) ...
 *
 * (or tdm_device_cuda_linked(), core/device.h, for "is the backend here").
 * Never include it in cuda/ itself: it would make the definitions weak.
 * A function added to cuda.h is added here too. */
#ifndef TDM_CUDA_CUDA_WEAK_H
#define TDM_CUDA_CUDA_WEAK_H

#include "cuda/cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#pragma weak tdm_cuda_device_count
#pragma weak tdm_cuda_device_check
#pragma weak tdm_cuda_emulator_open
#pragma weak tdm_cuda_emulator_open_accel
#pragma weak tdm_cuda_device_is_emulator
#pragma weak tdm_cuda_emulator_allocs
#pragma weak tdm_cuda_emulator_xfers
#pragma weak tdm_cuda_device_tf32
#pragma weak tdm_cuda_emulator_env
#pragma weak tdm_cuda_describe
#pragma weak tdm_comm_init_nccl
#pragma weak tdm_comm_init_nccl_opts
#pragma weak tdm_cuda_nccl_group_init
#pragma weak tdm_cuda_nccl_group_free
#pragma weak tdm_cuda_nccl_group_size
#pragma weak tdm_cuda_nccl_group_broadcast
#pragma weak tdm_cuda_nccl_group_reduce
#pragma weak tdm_cuda_nccl_group_all_reduce

#ifdef __cplusplus
}
#endif

#endif
