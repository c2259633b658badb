/* models/clip.h: gradient clipping by the global L2 norm, as
 * torch.nn.utils.clip_grad_norm_: total = the L2 norm over every
 * gradient element, clip_coef = max_norm / (total + 1e-6), and when that
 * is below 1 every gradient is multiplied by it (float32, rounded once
 * from the double coefficient); above 1 nothing changes.
 *
 * The norm is summed in double in a fixed order: each buffer in chunks of
 * TDM_DEV_SUMSQ_CHUNK elements (core/kernels.h), the chunks in order, the
 * buffers in order; float32 squares are exact in double, so the result
 * is within a few double ulps of the exact sum however a gradient is cut
 * into buffers or shards. A NaN or infinite norm is refused
 * (TDM_STATUS_NONFINITE, nothing scaled: torch's error_if_nonfinite). */
#ifndef TDM_MODELS_CLIP_H
#define TDM_MODELS_CLIP_H

#include <stdint.h>

#include "core/comm.h"
#include "core/device.h"
#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The sum of squares of x (n_elem floats on dev) in double, in the fixed
 * order above. */
tdm_status tdm_clip_sumsq(tdm_device *dev, const float *x, int64_t n_elem, double *sumsq);

/* One device, or ranks whose gradients are replicas (DDP after its
 * all-reduce: every rank holds the whole gradient, bitwise alike, so each
 * computes the global norm alone and no collective runs): the norm of
 * m's gradients (max_norm <= 0: only measured, nothing scaled). */
tdm_status tdm_clip_grad_norm(tdm_model *m, double max_norm, double *total_norm);

/* tdm_clip_grad_norm over n_bufs buffers of dev's memory instead of a
 * model's: the whole gradient, held here (one device, or a replica). */
tdm_status tdm_clip_grad_norm_bufs(tdm_device *dev, float *const *grads, const int64_t *n_elem,
                                   int n_bufs, double max_norm, double *total_norm);
/* Ranks that each hold a disjoint part of the gradient (ZeRO-2/FSDP
 * shards, pipeline stages, tensor-parallel slices): the local sum of
 * squares over the n_bufs buffers (device memory of dev), one all-reduce
 * of that double (SUM, labelled "clip grad norm" in the flight recorder,
 * staged through dev's memory), then the same clipping of the local
 * buffers on every rank. Collective: every rank calls it once per step.
 * Replicated gradients must not come here: their squares would be
 * counted once per rank. */
tdm_status tdm_clip_grad_norm_comm(tdm_comm *comm, tdm_device *dev, float *const *grads,
                                   const int64_t *n_elem, int n_bufs, double max_norm,
                                   double *total_norm);

/* The clipping step alone, from a global norm the caller computed (a
 * design whose ranks count some of their buffers and scale others, as a
 * pipeline's tied copies): NONFINITE for a NaN or infinite total_norm
 * (nothing scaled); else, when max_norm > 0 and max_norm / (total_norm
 * + 1e-6) is below 1, each buffer times that coefficient (rounded to
 * float once). */
tdm_status tdm_clip_apply_norm(tdm_device *dev, float *const *grads, const int64_t *n_elem,
                               int n_bufs, double max_norm, double total_norm);

#ifdef __cplusplus
}
#endif

#endif
