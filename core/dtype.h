/* core/dtype.h: element types, shared by the communicator interface
 * (core/comm.h: what a collective moves and reduces) and the device
 * interface (core/device.h: what a mixed-precision gemm reads, what a
 * conversion kernel writes). Names, sizes, parsing and the scalar 16-bit
 * conversions are core/comm.c's; the per-element conversions the devices
 * run are core/kernels.h's (the same rounding: to nearest, ties to even,
 * NaN stays NaN, as PyTorch's .to(torch.bfloat16) / .half()). */
#ifndef TDM_CORE_DTYPE_H
#define TDM_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_dtype {
    TDM_DTYPE_FLOAT32 = 0,
    TDM_DTYPE_FLOAT64,
    TDM_DTYPE_INT32,
    TDM_DTYPE_INT64,
    TDM_DTYPE_BFLOAT16,   /* reduced in float32, rounded once (to nearest even) */
    TDM_DTYPE_FLOAT16,    /* IEEE binary16, idem */
    TDM_DTYPE_COUNT_
} tdm_dtype;

/* Bytes per element; 0 for an invalid dtype. */
size_t tdm_dtype_size(tdm_dtype dt);
/* "float32", "float64", "int32", "int64", "bfloat16", "float16"; "?" when
 * invalid. */
const char *tdm_dtype_name(tdm_dtype dt);
/* Conversions of the 16-bit types (round to nearest even; NaN stays NaN). */
float tdm_bf16_to_f32(uint16_t h);
uint16_t tdm_f32_to_bf16(float f);
float tdm_f16_to_f32(uint16_t h);
uint16_t tdm_f32_to_f16(float f);
/* Parses the names above (also "float"/"double", "bf16", "fp16"/"half");
 * TDM_STATUS_INVALID_ARG with a message listing the valid names. */
tdm_status tdm_dtype_parse(const char *s, tdm_dtype *out);

#ifdef __cplusplus
}
#endif

#endif
