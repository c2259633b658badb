/* models/plan.h: the memory planner: what one device will hold at its
 * peak while a configuration trains, before anything is allocated,
 * computed from the same activation layout the model allocates from
 * (models/recompute.c) plus every other allocation a training step makes
 * on the device: parameters, gradients, batchnorm buffers, the 16-bit
 * weight copy, optimizer state (unless offloaded), activations per layer
 * (precision and checkpointing included), the step's scratch (the loss
 * rows, the loss scaler's flag and the norm's partial sums, grown as the
 * device scratch grows), the float16 widening buffer of a host device's
 * products, and the input staging of an accelerator. Each allocation is
 * counted as the allocator hands it out (rounded up to 64 bytes). What is
 * not counted: oneDNN's and cuBLAS's own workspaces, host memory (an
 * offloaded optimizer's state and staging are listed separately).
 *
 * This is the single-device plan (--mode single, a DP replica's or a DDP
 * rank's model and optimizer); the multi-process modes' communication
 * buffers and FSDP's shards and gathered units are theirs to add
 * (fsdp/fsdp.h's tdm_fsdp_plan_memory adds FSDP's and ZeRO's from the
 * parameter table this plan describes). */
#ifndef TDM_MODELS_PLAN_H
#define TDM_MODELS_PLAN_H

#include <stddef.h>

#include "core/device.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/precision.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a sharded rank keeps its parameter shards (fsdp/fsdp.h's
 * TDM_FSDP_OFFLOAD_PARAMS): read by tdm_fsdp_plan_memory only (a single
 * device holds whole parameters; tdm_plan_single ignores it). */
typedef enum tdm_plan_offload {
    TDM_PLAN_OFFLOAD_NONE = 0,
    TDM_PLAN_OFFLOAD_PARAMS,     /* shards, gradient shards, optimizer state in host memory */
} tdm_plan_offload;

typedef struct tdm_plan_opts {
    tdm_model_spec spec;
    int batch;                   /* samples (gpt: windows) per step on the device */
    tdm_precision precision;
    int ckpt;                    /* units per checkpoint segment; 0: none */
    tdm_optim_opts optim;        /* kind, momentum (SGD keeps no state without it), offload */
    tdm_device_kind device;      /* host devices chunk convolutions and widen fp16 products */
    int threads;                 /* a host device's BLAS threads (conv chunks); 0: 1 */
    int conv_chunk;              /* tdm_model_set_conv_chunk's; 0: the default */
    int loss_scaling;            /* a loss scaler unscales (its flag in the scratch) */
    int grad_norm;               /* the gradient norm is measured or clipped */
    int loss_batch;              /* the rows whose loss the device computes (DataParallel's
                                    output device: the whole batch); 0: batch */
    int stage_lo, stage_hi;      /* pipeline layers [lo, hi) (models/stage.h): a pipeline
                                    stage's model; hi 0: the whole model */
    tdm_plan_offload offload;    /* FSDP's parameter offload (above) */
} tdm_plan_opts;

#define TDM_PLAN_MAX_LAYERS 300
typedef struct tdm_plan {
    /* bytes on the device, by kind */
    size_t params, grads, buffers;   /* buffers: batchnorm statistics, running and per batch */
    size_t params_low;               /* the 16-bit weight copy */
    size_t optim;                    /* optimizer state on the device (0 when offloaded) */
    size_t activations;              /* kept for backward (the checkpoint arena included) */
    size_t act_scratch;              /* the model's scratch: gradient ping-pong, col, dlogits, ... */
    size_t step_scratch;             /* the device scratch at its peak, the fp16 widening, staging */
    size_t peak;                     /* the sum: the device's peak */
    size_t optim_host;               /* offloaded: state and staging in host memory */
    /* kept activations per layer (checkpointed units' arena not included) */
    int n_layers;
    size_t layer_bytes[TDM_PLAN_MAX_LAYERS];
    size_t arena;                    /* checkpointing: one segment's shared buffer */
    size_t act_set;                  /* one activation set (models/stage.h): the kept
                                        activations, the arena, the rounded input */
    int64_t in_elems, out_elems;     /* per sample: the model's (a stage's) input and output */
    int64_t slice_elems;             /* a stage's own parameters (its tied copy not counted) */
    /* what a sharded design plans its units from: the model's elements,
     * running-statistics elements, and each layer with parameters: its
     * block (tdm_model_layer_block) and its elements [off, end) of the
     * flat buffer (end: the next tensor's offset, alignment included) */
    int64_t param_elems, buffer_elems, largest_param_elems;
    int n_players;
    int player_block[TDM_PLAN_MAX_LAYERS];
    int player_unit[TDM_PLAN_MAX_LAYERS];   /* its checkpoint unit (MLP, CNN; -1: none) */
    int player_np[TDM_PLAN_MAX_LAYERS];     /* its parameter tensors */
    int64_t player_off[TDM_PLAN_MAX_LAYERS], player_end[TDM_PLAN_MAX_LAYERS];
    int out_rows, n_classes;         /* targets per sample, classes: the loss gradient's shape */
} tdm_plan;

void tdm_plan_opts_default(tdm_plan_opts *o, const tdm_model_spec *spec, int batch);
tdm_status tdm_plan_single(const tdm_plan_opts *o, tdm_plan *out);
/* The peak bytes of a device's scratch (tdm_dev_scratch) asked for
 * needs[0..n) bytes in that order: grown as core/device.c grows it (at
 * least double, at least 256 bytes, each request rounded as the
 * allocator rounds it; the new buffer allocated before the old one is
 * freed). */
size_t tdm_plan_scratch_peak(const size_t *needs, int n);

#ifdef __cplusplus
}
#endif

#endif
