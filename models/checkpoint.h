/* models/checkpoint.h: checkpoints of a model (and optimizer) in the
 * safetensors format: parameters under their names, buffers under theirs,
 * optimizer state as "optim.<state>.<param name>", and __metadata__ with
 * the model spec, optimizer kind and hyper-parameters, step, epoch, seed,
 * the optimizer's own step count and the run that wrote it.
 * Written atomically (core/safetensors.h). Loading checks that every
 * expected tensor is present with the right dtype and shape and names the
 * first that is not. Non-finite values (NaN, infinities) are refused both
 * ways (TDM_STATUS_NONFINITE, naming the tensor and the count): a run that
 * went bad never replaces the last good checkpoint, and a ruined file is
 * never resumed from. Knows nothing of DP or DDP: a checkpoint written by
 * any mode loads in any other. */
#ifndef TDM_MODELS_CHECKPOINT_H
#define TDM_MODELS_CHECKPOINT_H

#include <stdint.h>

#include "core/safetensors.h"
#include "models/model.h"
#include "models/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest step and epoch a checkpoint may hold (the optimizer's limit,
 * 2^53); anything beyond is refused as corrupt, not clamped. */
#define TDM_CKPT_MAX_COUNT TDM_OPTIM_MAX_STEPS

typedef struct tdm_ckpt_info {
    int64_t step;      /* optimizer steps taken */
    int64_t epoch;     /* epochs completed */
    uint64_t seed;
    /* fp16's dynamic loss scaler (models/precision.h): its scale and
     * growth tracker, so that a resumed run goes on from them rather than
     * from 2^16; loss_scale 0: none (not written, or not in the file) */
    double loss_scale;
    int64_t loss_scale_growth;
} tdm_ckpt_info;

/* The metadata every checkpoint file carries after its own (format,
 * model, ...): step, epoch and seed (from info; without it, steps and
 * zeros); with o the optimizer's kind ("sgd", "adamw"), lr and options,
 * and its own step count, steps, as "optimizer_steps" (apart from the
 * caller's step, which may count something else: AdamW's bias correction
 * resumes from it); the loss scaler's "loss_scale" and
 * "loss_scale_growth_tracker" when info has one (loss_scale > 0); and the
 * run (tdm_checkpoint_set_run) when one is set.
 * Appended at meta (room for TDM_CKPT_META_MAX); returns how many. Their
 * text lives in *t. Also what fsdp/ writes in a sharded checkpoint's
 * index. */
#define TDM_CKPT_META_MAX 10
typedef struct tdm_ckpt_meta_text {
    char step[32], epoch[32], seed[32], lr[32], hyper[200], osteps[32];
    char loss_scale[32], loss_scale_growth[32];
} tdm_ckpt_meta_text;
int tdm_checkpoint_meta(tdm_st_meta *meta, tdm_ckpt_meta_text *t, const tdm_ckpt_info *info,
                        int64_t steps, const tdm_optim_opts *o);
/* "sgd" or "adamw": the optimizer metadata's value. */
const char *tdm_checkpoint_optim_name(tdm_optim_kind k);
/* Metadata key of f as an unsigned integer in [0, max]: FORMAT naming the
 * file, key and value when it is missing, not a plain non-negative
 * integer, or beyond max (clamping would hide a corrupt file). */
tdm_status tdm_checkpoint_meta_uint(const tdm_st_file *f, const char *key, uint64_t max,
                                    uint64_t *out);
/* The loss scaler f holds into info's loss_scale and loss_scale_growth
 * (0 and 0 when f has none): FORMAT naming the file when "loss_scale" is
 * not a positive finite number or the growth tracker not a count. */
tdm_status tdm_checkpoint_meta_scaler(const tdm_st_file *f, tdm_ckpt_info *info);
/* The optimizer's step count f holds: its "optimizer_steps", checked as
 * tdm_checkpoint_meta_uint does; a file written without it holds only
 * "step", which is then the count (step: that value). */
tdm_status tdm_checkpoint_optim_steps(const tdm_st_file *f, uint64_t step, uint64_t *out);

/* The run the checkpoints of this process belong to, written as the
 * "run" metadata of every checkpoint saved from now on (NULL or "": none).
 * tandem train and tandem launch set it (tdm_dist_run_id_begin,
 * dist/run.h) so that a restart resumes only from a checkpoint its own
 * job wrote, never from one another run left at the same path.
 * Process-wide: forked ranks inherit it. tdm_checkpoint_run: the current one ("" when none). */
#define TDM_CKPT_RUN_MAX 64
void tdm_checkpoint_set_run(const char *run);
const char *tdm_checkpoint_run(void);

/* Host copies of what a checkpoint holds, in the model's flat layout:
 * params (tdm_model_param_elems floats), buffers (tdm_model_buffer_elems),
 * and, when optim is non-NULL, its state buffers (tdm_optim_kind_n_state
 * of them, param_elems floats each) and step count. For callers that hold
 * no device copy of the whole model: sharded data parallel gathers the
 * shards on rank 0 and writes the very file the other modes write. */
typedef struct tdm_ckpt_host {
    float *params;
    float *buffers;
    const tdm_optim_opts *optim;   /* NULL: no optimizer state */
    float *state[2];
    int64_t steps;
} tdm_ckpt_host;

/* Frees the host arrays (the caller's, as they were allocated with
 * malloc or calloc) and zeroes them; optim is borrowed. */
void tdm_ckpt_host_free(tdm_ckpt_host *h);

/* What tdm_checkpoint_save writes, from host arrays; m gives the spec and
 * the tensor tables only (its buffers are not read). */
tdm_status tdm_checkpoint_save_host(const char *path, const tdm_model *m, const tdm_ckpt_host *h,
                                    const tdm_ckpt_info *info);
/* Reads and checks the file into the host arrays of h (allocated by the
 * caller, sized as above; state[s] only when h->optim is set, whose kind
 * must match the file's); h->steps gets the file's step. On failure the
 * arrays may hold part of the file: load into staging, not live state. */
tdm_status tdm_checkpoint_load_host(const char *path, const tdm_model *m, tdm_ckpt_host *h,
                                    tdm_ckpt_info *info);

/* opt may be NULL (parameters and buffers only). */
tdm_status tdm_checkpoint_save(const char *path, tdm_model *m, tdm_optim *opt,
                               const tdm_ckpt_info *info);
/* Loads into an existing model built with the same spec (and optimizer of
 * the same kind, if opt is non-NULL: its state and step are restored). */
tdm_status tdm_checkpoint_load(const char *path, tdm_model *m, tdm_optim *opt,
                               tdm_ckpt_info *info);

#ifdef __cplusplus
}
#endif

#endif
