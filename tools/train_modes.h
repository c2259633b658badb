/* tools/train_modes.h: what the files of `tandem train` share: the parsed
 * arguments, one process's set-up steps, the one epoch loop that every
 * mode and model runs (tools/train_loop.c), and one entry per mode.
 * tools/train.c parses, checks and dispatches and runs --mode single;
 * train_dp.c and train_ddp.c are the other image modes (linked weakly, so
 * a build without them still trains on one device), train_text.c is
 * --model gpt in every mode. Each function below says on stderr what
 * failed and returns the status (TDM_STATUS_USAGE for a command line
 * that cannot work); tdm_tool_exit (tools/tools.h) makes the exit code. */
#ifndef TDM_TOOLS_TRAIN_MODES_H
#define TDM_TOOLS_TRAIN_MODES_H

#include <stdint.h>

#include "core/comm.h"
#include "core/data.h"
#include "core/text.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

/* The default global batch of a gpt: windows of its context. */
#define TDM_TRAIN_GPT_BATCH 32

typedef struct tdm_train_args {
    const char *mode, *model, *device, *optim, *data, *save, *resume;
    long long threads, epochs, batch, seed, synthetic_size, max_steps, bucket_cap_mb;
    long long max_restarts;   /* ddp: elastic restarts (tools/elastic.h) */
    double lr, momentum, weight_decay;
    const char *lr_schedule;  /* "const" or "cosine" */
    const char *backend;      /* ddp under an MPI launcher: auto|shm|mpi|hier (NULL: auto) */
    const char *timeout;      /* ddp: --timeout SECONDS as given (checked by the ddp mode) */
    const char *sharding;     /* fsdp: --sharding as given (NULL: full) */
    int nesterov, no_eval, quiet, no_overlap;
    int save_sharded;         /* fsdp: --save writes the sharded form */
    long long grad_accum;     /* micro-batches of `batch` per optimizer step (>= 1) */
    const char *comm_hook;    /* ddp: --comm-hook (NULL: allreduce) */
    long long powersgd_rank, powersgd_start_step;
    int uneven;               /* ddp: --uneven (tools/train_uneven.c) */
    int sync_bn;              /* ddp: --sync-bn */
} tdm_train_args;

/* The samples per optimizer step: batch * grad_accum. */
static inline long long tdm_train_effective_batch(const tdm_train_args *a)
{
    return a->batch * (a->grad_accum > 1 ? a->grad_accum : 1);
}

/* ---- set-up steps (tools/train.c) ---- */

/* "tandem train: <what>: <the error message, or the status's name>" on
 * stderr; returns st. */
tdm_status tdm_train_fail(const char *what, tdm_status st);
/* A mode this build does not have: USAGE. */
tdm_status tdm_train_mode_absent(const char *mode);
/* A process's training set-up on dev (single and DP): loads the data,
 * builds the model, checks that the data fits it, makes the optimizer
 * and applies --resume. What it made is in *m / *opt / train / test
 * either way, for the caller to free. */
tdm_status tdm_train_setup(const tdm_train_args *a, const tdm_model_spec *spec, tdm_device *dev,
                           tdm_dataset *train, tdm_dataset *test, tdm_model **m,
                           tdm_optim **opt, int64_t *start_epoch);
/* Fashion-MNIST (--data DIR) or the synthetic set; on failure nothing is
 * left to free. */
tdm_status tdm_train_load_data(const tdm_train_args *a, const tdm_model_spec *spec,
                               tdm_dataset *train, tdm_dataset *test);
/* The run's memory plan (models/mem_plan.h: parameters, gradients,
 * optimizer state and activations of every replica, each process's own,
 * the shared-memory segment) against the memory this process can still
 * take (MemAvailable and the cgroup's headroom; the data, loaded by then,
 * is in what is in use). OUT_OF_MEMORY after saying the figures
 * (tools/train_mem.c). */
tdm_status tdm_train_check_memory(const tdm_train_args *a, const tdm_model_spec *spec);
/* USAGE unless the data's features per sample fit the model. */
tdm_status tdm_train_check_features(const tdm_dataset *train, const tdm_model *m);
/* A rank's loss turned non-finite before its gradient collectives: stops
 * the group now with the reason ("loss is NaN at step S (<where>):
 * training diverged ..."; every other rank leaves its next collective
 * naming it) and returns NONFINITE with that message. where: e.g.
 * "rank 1's 3 samples of the batch of 8" or "rank 1, micro-batch 2". */
tdm_status tdm_train_rank_diverged(tdm_comm *comm, int rank, int64_t step, double loss,
                                   const char *where);
/* What a parent of forked ranks checks before forking: loads the data and
 * checks it against a probe model built on a host device (and freed);
 * *param_elems (NULL: not wanted) is the model's parameter count. On
 * failure the message is printed or set and nothing is left to free. */
tdm_status tdm_train_load_and_probe(const tdm_train_args *a, const tdm_model_spec *spec,
                                    tdm_dataset *train, tdm_dataset *test,
                                    int64_t *param_elems);
/* With --resume, loads the checkpoint into m and opt and sets *start_epoch
 * (0 without). */
tdm_status tdm_train_resume(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                            int64_t *start_epoch);
void tdm_train_print_resumed(const char *path, const tdm_ckpt_info *info);
tdm_status tdm_train_make_optim(const tdm_train_args *a, tdm_model *m, tdm_optim **opt);
/* The two header lines of an image run. */
void tdm_train_print_header(const tdm_train_args *a, const tdm_model_spec *spec,
                            const tdm_dataset *train, const tdm_dataset *test, int64_t params,
                            const char *devices);
/* A note on stderr when --threads was given to a mode whose devices
 * compute on one thread each ("DP device", "DDP rank"). */
void tdm_train_note_threads(const tdm_train_args *a, const char *unit);
/* "DP step, mean over N steps" and each phase's share (DP modes). */
void tdm_train_print_dp_phases(const tdm_phase_times *sum, double step_ms, int64_t steps);

/* ---- the epoch loop (tools/train_loop.c) ---- */

/* After each epoch: evaluation (loss, and accuracy for images: NaN for
 * text), and the hook after it (DDP's end-of-epoch barrier). */
typedef tdm_status (*tdm_train_eval_fn)(void *ctx, double *loss_mean, double *accuracy);
typedef tdm_status (*tdm_train_after_epoch_fn)(void *ctx, int64_t epoch);

/* One process's run as the epoch loop sees it. */
typedef struct tdm_train_run {
    tdm_model *m;                  /* borrowed */
    tdm_optim *opt;                /* borrowed */
    int64_t start_epoch;           /* epochs a resumed checkpoint had done */
    tdm_train_step_fn step;        /* the mode's step (models/train.h) */
    void *step_ctx;
    /* images: the training and test sets */
    const tdm_dataset *train, *test;
    /* text (when set): the training bytes, the context T, this process's
     * windows [lo, hi) of each global batch, and the bigram baseline
     * printed beside the validation loss */
    const tdm_text *text;
    int T, lo, hi;
    double bigram;
    tdm_train_eval_fn eval;        /* NULL: tdm_evaluate on the test set here (images) */
    void *eval_ctx;
    tdm_train_after_epoch_fn after;    /* may be NULL */
    void *after_ctx;
} tdm_train_run;

/* Epochs start_epoch..--epochs-1: the learning-rate schedule on the
 * optimizer, each epoch (with the progress line), evaluation, the epoch's
 * line, the checkpoint (--save; refused when the last gradients are not
 * finite), then `after`. On a failure, says what --save still holds. */
tdm_status tdm_train_epochs(const tdm_train_args *a, const tdm_train_run *r);

/* ---- the modes ---- */

typedef struct tdm_ddp tdm_ddp;
typedef struct tdm_comm tdm_comm;
/* --uneven with --model gpt: the epoch's windows instead of a training
 * set's samples (tools/train_uneven.c says which), and the validation
 * loss in place of the test set's. */
typedef struct tdm_train_uneven_text {
    const tdm_text *train;
    int T;                        /* the context: bytes per window */
    double bigram;                /* printed beside the validation loss */
    tdm_train_eval_fn eval;       /* collective: every rank, after each epoch */
    void *eval_ctx;
} tdm_train_uneven_text;

/* --uneven: one rank's epochs over its own samples, with join
 * (tools/train_uneven.c): the mode's calls, on ctx. save (may be NULL)
 * runs after each epoch, collectively. text: NULL for the image models
 * (then evaluate runs on the test set), else a gpt's windows. */
typedef struct tdm_train_uneven_ops {
    void *ctx;
    tdm_model *m;
    const tdm_train_uneven_text *text;
    tdm_status (*zero_grad)(void *ctx);
    /* the mean over the ranks with data (opts.join's tdm_*_forward); x:
     * floats (images) or int32 tokens (text) */
    tdm_status (*forward)(void *ctx, const void *x, const int32_t *y, int n, double *loss_mean);
    tdm_status (*backward_step)(void *ctx);   /* backward and the optimizer step */
    tdm_status (*join)(void *ctx, int64_t *shadowed);
    tdm_status (*evaluate)(void *ctx, const tdm_dataset *test, double *loss_mean,
                           double *accuracy);
    tdm_status (*save)(void *ctx, int64_t epoch);
} tdm_train_uneven_ops;
tdm_status tdm_train_uneven_run(const tdm_train_args *a, const tdm_train_uneven_ops *ops,
                                tdm_comm *comm, const tdm_dataset *train,
                                const tdm_dataset *test, int64_t start_epoch);
/* --mode ddp --uneven: tdm_train_uneven_run with DDP's calls; ddp built
 * with opts.join. save: the job's --save (NULL: none), the same on every
 * rank (every rank takes part in tdm_ddp_checkpoint_save; rank 0
 * writes). text: NULL for images (train, test), else a gpt's (train and
 * test unused). Says what failed. */
tdm_status tdm_train_uneven_epochs(const tdm_train_args *a, tdm_ddp *ddp, tdm_optim *opt,
                                   tdm_comm *comm, const tdm_dataset *train,
                                   const tdm_dataset *test, const tdm_train_uneven_text *text,
                                   const char *save, int64_t start_epoch);

tdm_status tdm_train_run_single(const tdm_train_args *a);
/* --model gpt: a language model on text, in every mode (tools/train_text.c). */
tdm_status tdm_train_text_main(const tdm_train_args *a);
tdm_status tdm_train_run_dp(const tdm_train_args *a) __attribute__((weak));
tdm_status tdm_train_run_ddp(const tdm_train_args *a) __attribute__((weak));
/* --mode fsdp (tools/train_fsdp.c): sharded data parallel, fsdp/. */
tdm_status tdm_train_run_fsdp(const tdm_train_args *a) __attribute__((weak));
/* The process-group timeout of --mode fsdp and of --model gpt's --mode
 * ddp and fsdp ranks (tools/train_fsdp.c): --timeout (also exported as
 * TANDEM_TIMEOUT for the ranks' NCCL communicators), else the
 * environment's, else the default of a launched (launched = 1) or forked
 * job. USAGE if bad. */
tdm_status tdm_train_pg_timeout(const tdm_train_args *a, int launched, int64_t *timeout_ms);
/* The pieces of --mode fsdp that --model gpt --mode fsdp
 * (tools/train_text.c) shares. Each says on stderr what failed
 * ("tandem train: rank R: ..."). */
typedef struct tdm_fsdp tdm_fsdp;
/* The optimizer over f's shard from the arguments, then --resume (a full
 * checkpoint, or a sharded one's index) into f and *opt. Collective. */
tdm_status tdm_train_fsdp_optim_resume(const tdm_train_args *a, tdm_fsdp *f, int rank,
                                       tdm_optim **opt, int64_t *start_epoch);
/* After epoch `epoch`: every rank saves path together (full, or sharded);
 * nothing when path is NULL. Collective. */
tdm_status tdm_train_fsdp_save(tdm_fsdp *f, tdm_optim *opt, const char *path, int sharded,
                               int64_t epoch, uint64_t seed, int rank);
/* Rank 0's summary after training: phases, communication, memory. */
void tdm_train_fsdp_report(tdm_fsdp *f, tdm_optim *opt, int world);

#endif
