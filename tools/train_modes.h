/* tools/train_modes.h: what `tandem train` shares between its modes: the
 * parsed arguments, data and optimizer set-up, the epoch driver, and one
 * entry per mode. DP and DDP modes live in their own files (linked weakly
 * so a build without them still runs single-device training). */
#ifndef TDM_TOOLS_TRAIN_MODES_H
#define TDM_TOOLS_TRAIN_MODES_H

#include <stdint.h>

#include "core/data.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

/* The default global batch of a gpt: windows of its context. */
#define TDM_TRAIN_GPT_BATCH 32

typedef struct tdm_train_args {
    const char *mode, *model, *device, *optim, *data, *save, *resume;
    long long threads, epochs, batch, seed, synthetic_size, max_steps, bucket_cap_mb;
    double lr, momentum, weight_decay;
    const char *lr_schedule;  /* "const" or "cosine" */
    const char *backend;      /* ddp under an MPI launcher: auto|shm|mpi|hier (NULL: auto) */
    const char *timeout;      /* ddp: --timeout SECONDS as given (checked by the ddp mode) */
    int nesterov, no_eval, quiet, no_overlap;
} tdm_train_args;

/* Evaluates m on test after an epoch (NULL: tdm_evaluate on this process
 * alone; DDP spreads it over the ranks). */
typedef tdm_status (*tdm_train_eval_fn)(void *ctx, tdm_model *m, const tdm_dataset *test,
                                        double *loss_mean, double *accuracy);

/* Called after each epoch (e.g. DDP's barrier); return 0 to stop. */
typedef int (*tdm_train_after_epoch_fn)(void *ctx, int64_t epoch);

int tdm_train_mode_absent(const char *mode);
/* "tandem train: <what>: <the error message, or the status's name>" on stderr. */
void tdm_train_fail(const char *what, tdm_status st);
/* A process's training set-up on dev (single and DP): loads the data,
 * builds the model, checks that the data fits it, makes the optimizer
 * and applies --resume. Returns 0, or the exit code (1 runtime, 2 usage)
 * after saying why; what it made is in *m / *opt / train / test either
 * way, for the caller to free. */
int tdm_train_setup(const tdm_train_args *a, const tdm_model_spec *spec, tdm_device *dev,
                    tdm_dataset *train, tdm_dataset *test, tdm_model **m, tdm_optim **opt,
                    int64_t *start_epoch);
int tdm_train_load_data(const tdm_train_args *a, const tdm_model_spec *spec, tdm_dataset *train,
                        tdm_dataset *test);
/* 1 when the data's features per sample fit the model; else 0, said on stderr. */
int tdm_train_check_features(const tdm_dataset *train, const tdm_model *m);
/* With --resume, loads the checkpoint into m and opt and sets *start_epoch
 * (0 without); 0 on failure, said on stderr. */
int tdm_train_resume(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                     int64_t *start_epoch);
void tdm_train_print_resumed(const char *path, const tdm_ckpt_info *info);
int tdm_train_make_optim(const tdm_train_args *a, tdm_model *m, tdm_optim **opt);
void tdm_train_print_header(const tdm_train_args *a, const tdm_model_spec *spec,
                            const tdm_dataset *train, const tdm_dataset *test, int64_t params,
                            const char *devices);
int tdm_train_epochs(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                     const tdm_dataset *train, const tdm_dataset *test, tdm_train_step_fn step,
                     void *step_ctx, int64_t start_epoch, tdm_train_eval_fn eval,
                     void *eval_ctx, tdm_train_after_epoch_fn after, void *after_ctx);

/* The progress line (a bar on a terminal, every tenth of the epoch
 * otherwise), a tdm_train_progress_fn over a tdm_progress. */
typedef struct tdm_progress {
    int tty, quiet;
    int64_t epoch, epochs;
    int64_t last_tenth;
} tdm_progress;
void tdm_train_progress(void *ctx, int64_t step, int64_t steps, double loss, double sps);

/* The learning-rate schedule wraps the mode's step: cosine annealing
 * (Loshchilov & Hutter, SGDR) from the base rate to 0 over all the run's
 * steps, a function of the optimizer's step count so resuming continues it.
 * tdm_train_sched_step is a tdm_train_step_fn over a tdm_train_sched. */
typedef struct tdm_train_sched {
    tdm_train_step_fn step;
    void *ctx;
    tdm_optim *opt;
    double base_lr;
    int64_t total_steps;
    int cosine;
} tdm_train_sched;
tdm_status tdm_train_sched_step(void *p, const void *x, const int32_t *y, int batch,
                                double *loss);

int tdm_train_run_single(const tdm_train_args *a);
/* --model gpt: a language model on text, in every mode (tools/train_text.c). */
int tdm_train_text_main(const tdm_train_args *a);
int tdm_train_run_dp(const tdm_train_args *a) __attribute__((weak));
int tdm_train_run_ddp(const tdm_train_args *a) __attribute__((weak));

#endif
