/* models/precision.h: mixed precision for a model, as torch.autocast
 * with bfloat16 or float16 does it, and the loss scaler float16 needs
 * (PyTorch's GradScaler).
 *
 * In BF16 and FP16 every matrix product (linear layers, convolutions,
 * attention, the GPT's tied head) reads 16-bit inputs and sums in float32
 * (tdm_dev_gemm_ex); the activations a layer keeps for backward are
 * stored in the 16-bit type (the residual stream of the GPT, the
 * LayerNorm and batchnorm statistics, and the logits stay float32);
 * LayerNorm, batchnorm, softmax, GELU and the loss compute in float32 on
 * the widened 16-bit values. Each layer's output is rounded once, and the
 * next layer reads the rounded values (in forward, in backward and when
 * a checkpointed segment is recomputed), so backward differentiates the
 * forward that ran. The weights a product reads are cast to the 16-bit
 * type at each forward use of their layer (autocast's weight cache: a
 * copy of param_elems 16-bit elements); the master parameters, their
 * gradients (accumulated in float32 straight from the products) and the
 * optimizer state stay float32. Activation gradients flow in float32 and
 * are rounded to the 16-bit type only where a product reads them.
 *
 * FP16's range is small (6e-8 .. 65504): gradients underflow unless the
 * loss is scaled up, which the scaler below does; BF16 has float32's
 * range and needs none. On host devices bfloat16 products run on
 * oneDNN's bf16 kernels; float16 ones are widened to float32 first (no
 * half matmul on these CPUs): same numerics, no speed-up (core/device.h). */
#ifndef TDM_MODELS_PRECISION_H
#define TDM_MODELS_PRECISION_H

#include <stdint.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_precision {
    TDM_PRECISION_FP32 = 0,
    TDM_PRECISION_BF16,
    TDM_PRECISION_FP16,
} tdm_precision;

/* "fp32", "bf16", "fp16" (also "float32", "bfloat16", "float16");
 * INVALID_ARG naming the accepted words otherwise. */
tdm_status tdm_precision_parse(const char *s, tdm_precision *out);
const char *tdm_precision_name(tdm_precision p);
/* The activations' element type: float32, bfloat16 or float16. */
tdm_dtype tdm_precision_dtype(tdm_precision p);

/* Sets the precision of the following forward and backward passes (drops
 * the activations: call it between steps). FP32 is the default and
 * computes exactly what a model that never heard of precision computes. */
tdm_status tdm_model_set_precision(tdm_model *m, tdm_precision p);
tdm_precision tdm_model_precision(const tdm_model *m);

/* ---- dynamic loss scaling (torch.cuda.amp.GradScaler) ----
 * Per step: scale the loss gradient by `scale` (tdm_grad_scaler_scale),
 * backward, tdm_grad_scaler_unscale (gradients divided by scale, and
 * whether any was NaN or infinite), in multi-process modes
 * tdm_grad_scaler_sync_found_inf so that every rank decides alike, then
 * step the optimizer unless found_inf, then tdm_grad_scaler_update:
 * found_inf halves the scale (backoff) and restarts the count; otherwise
 * after growth_interval clean steps in a row the scale doubles. */
typedef struct tdm_grad_scaler_opts {
    float init_scale;        /* 65536 (2^16) */
    float growth_factor;     /* 2 */
    float backoff_factor;    /* 0.5 */
    int64_t growth_interval; /* 2000 */
} tdm_grad_scaler_opts;
void tdm_grad_scaler_opts_default(tdm_grad_scaler_opts *o);

typedef struct tdm_grad_scaler {
    tdm_grad_scaler_opts opts;
    float scale;
    int64_t growth_tracker;  /* clean steps since the scale last changed */
    int64_t skipped;         /* steps skipped so far (found_inf) */
} tdm_grad_scaler;

/* INVALID_ARG unless init_scale > 0 and finite, growth_factor > 1,
 * 0 < backoff_factor < 1, growth_interval >= 1. */
tdm_status tdm_grad_scaler_init(tdm_grad_scaler *s, const tdm_grad_scaler_opts *o);
/* What the loss gradient is multiplied by this step. */
float tdm_grad_scaler_scale(const tdm_grad_scaler *s);
/* grads (n_elem floats on dev) *= 1/scale; *found_inf = 1 when any of
 * them was NaN or infinite before (tdm_dev_unscale_check). */
tdm_status tdm_grad_scaler_unscale(tdm_grad_scaler *s, tdm_device *dev, float *grads,
                                   int64_t n_elem, int *found_inf);
/* The multi-process hook (FairScale's ShardedGradScaler): every rank
 * passes its own flag and gets the OR over all ranks, through one
 * all-reduce (MAX of one float) labelled "grad scaler found inf" in the
 * flight recorder, staged through dev's memory (an NCCL communicator
 * reduces device memory); collective. Ranks whose gradients are bitwise
 * replicas (DDP after its all-reduce) may skip it: they agree already. */
tdm_status tdm_grad_scaler_sync_found_inf(tdm_comm *comm, tdm_device *dev, int *found_inf);
/* After the (possibly skipped) step: the scale for the next one. */
void tdm_grad_scaler_update(tdm_grad_scaler *s, int found_inf);

#ifdef __cplusplus
}
#endif

#endif
