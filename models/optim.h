/* models/optim.h: optimizers over a model's flat buffers: SGD (momentum,
 * dampening, nesterov, weight decay; PyTorch's semantics) and AdamW
 * (decoupled weight decay). Each step is one fused loop over the whole
 * parameter buffer; optimizer state is flat too, with the parameters'
 * offsets. Nothing here knows of parallelism. */
#ifndef TDM_MODELS_OPTIM_H
#define TDM_MODELS_OPTIM_H

#include <stdint.h>

#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_optim_kind {
    TDM_OPTIM_SGD = 0,
    TDM_OPTIM_ADAMW,
} tdm_optim_kind;

/* Where the optimizer's state and step live (ZeRO-Offload, DeepSpeed's
 * offload_optimizer to "cpu"). HOST, for a model on an accelerator: the
 * state buffers are in host memory (a host device of the optimizer's
 * own), and each step copies the gradients and parameters down, runs the
 * same fused update on the host, and copies the parameters up. The
 * accelerator's memory then holds no optimizer state; the update is the
 * same per-element function (core/kernels.h), so the bits equal a step on
 * the device wherever the device computes it without contracting
 * multiply-adds differently (the emulator, here; a GPU: built, not run).
 * The parameters are copied down too, so that the device's copy stays
 * the master (a checkpoint load or a broadcast into the model needs
 * nothing more): three copies per step. */
typedef enum tdm_optim_offload {
    TDM_OPTIM_OFFLOAD_NONE = 0,
    TDM_OPTIM_OFFLOAD_HOST,
} tdm_optim_offload;

typedef struct tdm_optim_opts {
    tdm_optim_kind kind;
    tdm_optim_offload offload;   /* where the state lives (above) */
    float lr;
    float momentum;      /* SGD */
    float dampening;     /* SGD */
    int nesterov;        /* SGD */
    float weight_decay;  /* SGD: L2 added to the gradient; AdamW: decoupled */
    float beta1, beta2, eps; /* AdamW (defaults 0.9, 0.999, 1e-8) */
} tdm_optim_opts;

typedef struct tdm_optim tdm_optim;

/* Defaults: SGD lr 0.01; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01. */
void tdm_optim_opts_default(tdm_optim_opts *o, tdm_optim_kind kind);
/* The options of the optimizer named `name` ("adamw": AdamW; otherwise
 * SGD, with momentum and nesterov) with these hyper-parameters: what the
 * CLI's --optim, --lr, --weight-decay, --momentum and --nesterov say. */
void tdm_optim_opts_named(tdm_optim_opts *o, const char *name, double lr, double weight_decay,
                          double momentum, int nesterov);
tdm_status tdm_optim_init(tdm_optim **out, tdm_model *m /* borrowed */,
                          const tdm_optim_opts *opts);
tdm_status tdm_sgd_init(tdm_optim **out, tdm_model *m, float lr, float momentum);
void tdm_optim_free(tdm_optim *o);

/* p <- update(p, grad); increments the step count. */
tdm_status tdm_optim_step(tdm_optim *o);

/* An optimizer over n_elem elements that belong to no model: a rank's
 * shard of a model's parameters (sharded data parallel), stepped through
 * tdm_optim_step_ranges. Its state buffers have n_elem elements. */
tdm_status tdm_optim_init_flat(tdm_optim **out, tdm_device *dev /* borrowed */, int64_t n_elem,
                               const tdm_optim_opts *opts);
/* A flat optimizer over n_elem elements kept in host memory, on a host
 * device of its own (its state there too; opts->offload is implied): for
 * a shard that lives in host memory (FSDP's parameter offload), stepped
 * through tdm_optim_step_ranges with host pointers. */
tdm_status tdm_optim_init_host(tdm_optim **out, int64_t n_elem, const tdm_optim_opts *opts);
/* One piece of the stepped elements: param[0..n_elem) and grad[0..n_elem)
 * (device pointers) use the state elements [state_offset,
 * state_offset + n_elem). */
typedef struct tdm_optim_range {
    float *param;
    const float *grad;
    int64_t state_offset, n_elem;
} tdm_optim_range;
/* One step over the ranges (disjoint pieces of the state), counted once.
 * The update of each element is the same function of (param, grad,
 * state, step) as in tdm_optim_step, so a shard stepped here holds
 * bitwise what a whole-model step gives its elements. Works for either
 * kind of optimizer (a model's: offsets into its flat buffers). */
tdm_status tdm_optim_step_ranges(tdm_optim *o, const tdm_optim_range *ranges, int n_ranges);
/* Elements the optimizer state covers (the model's, or n_elem). */
int64_t tdm_optim_n_elem(const tdm_optim *o);
/* The most steps an optimizer counts: 2^53, beyond which a step count is
 * no longer exact as a double (AdamW's bias correction uses it) and which
 * no real run reaches. tdm_optim_step refuses to go past it. */
#define TDM_OPTIM_MAX_STEPS ((int64_t)1 << 53)
int64_t tdm_optim_steps(const tdm_optim *o);
void tdm_optim_set_steps(tdm_optim *o, int64_t steps);
void tdm_optim_set_lr(tdm_optim *o, float lr);
/* A step skipped as a whole (a loss scaler found inf or NaN gradients,
 * models/precision.h): while skip is 1, tdm_optim_step and
 * tdm_optim_step_ranges change nothing - parameters, state, step count
 * and learning rate stay as they are - so that a design's step (which
 * may gather its shards after the update) runs unchanged around an
 * update that does not happen. */
void tdm_optim_set_skip(tdm_optim *o, int skip);
int tdm_optim_skipping(const tdm_optim *o);

/* Learning-rate schedules. tdm_optim_step sets the rate of each step from
 * the step count before it (so a resumed run, whose count comes from the
 * checkpoint, continues the schedule) and leaves it in opts.lr, where
 * tdm_optim_get_opts and checkpoints see it. */
typedef enum tdm_optim_schedule {
    TDM_OPTIM_SCHEDULE_CONST = 0,   /* opts.lr at every step (the default) */
    /* cosine annealing to 0 (Loshchilov & Hutter, SGDR, without restarts):
     * step k runs at base_lr * (1 + cos(pi * min(k / total_steps, 1))) / 2 */
    TDM_OPTIM_SCHEDULE_COSINE,
} tdm_optim_schedule;
/* base_lr is a double (as a command line gives it) so that each step's
 * rate is rounded to float once; total_steps > 0 for COSINE. CONST puts
 * base_lr in opts.lr. */
tdm_status tdm_optim_set_schedule(tdm_optim *o, tdm_optim_schedule kind, double base_lr,
                                  int64_t total_steps);
const tdm_optim_opts *tdm_optim_get_opts(const tdm_optim *o);

/* State buffers ("momentum" for SGD; "exp_avg", "exp_avg_sq" for AdamW),
 * each tdm_optim_n_elem() floats on the model's (or the flat optimizer's)
 * device. tdm_optim_kind_n_state and _state_name say the same from the
 * options alone (what a checkpoint needs without an optimizer). */
int tdm_optim_kind_n_state(const tdm_optim_opts *opts);
const char *tdm_optim_kind_state_name(tdm_optim_kind kind, int i);
int tdm_optim_n_state(const tdm_optim *o);
const char *tdm_optim_state_name(const tdm_optim *o, int i);
float *tdm_optim_state(tdm_optim *o, int i);
size_t tdm_optim_state_bytes(const tdm_optim *o);
/* The device whose memory holds the state buffers: the model's (or the
 * flat optimizer's), or with offload the optimizer's host device. */
tdm_device *tdm_optim_device(const tdm_optim *o);
/* The device whose memory holds the parameters and gradients it steps
 * (tdm_optim_step's model, tdm_optim_step_ranges' pointers): the model's
 * or the flat optimizer's device, offload or not; tdm_optim_init_host's
 * own host device. */
tdm_device *tdm_optim_param_device(const tdm_optim *o);

#ifdef __cplusplus
}
#endif

#endif
