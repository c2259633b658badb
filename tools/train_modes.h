/* tools/train_modes.h: what the files of `tandem train` share: the parsed
 * arguments, one process's set-up steps, the one epoch loop that every
 * mode and model runs (tools/train_loop.c), and one entry per mode.
 * tools/train.c parses, checks and dispatches; train_local.c runs --mode
 * single and dp, train_ranks.c --mode ddp and fsdp (the designs' tables
 * in rank_ddp.c and rank_fsdp.c), train_text.c holds --model gpt's text
 * and header, train_levers.c the memory levers. Each function below
 * says on stderr what failed and returns the status (TDM_STATUS_USAGE
 * for a command line that cannot work); tdm_tool_exit (tools/tools.h)
 * makes the exit code. */
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
    const char *val_data;     /* --val-data X.npy,Y.npy (tools/train_npy.c) */
    const char *json, *csv;   /* --json, --csv: per-epoch records (tools/train_out.c) */
    const char *trace;        /* --trace: a Chrome trace of the run (tools/train_trace.h) */
    long long threads, epochs, batch, seed, synthetic_size, max_steps;
    double bucket_cap_mb;     /* ddp: MiB, a float as PyTorch's (0: the default 25) */
    long long max_restarts;   /* ddp: elastic restarts (tools/elastic.h) */
    double lr, momentum, weight_decay;
    const char *lr_schedule;  /* "const" or "cosine" */
    const char *backend;      /* ddp under an MPI launcher: auto|shm|mpi|hier (NULL: auto) */
    const char *timeout;      /* ddp: --timeout SECONDS as given (checked by the ddp mode) */
    const char *sharding;     /* fsdp: --sharding as given (NULL: full) */
    int nesterov, no_eval, quiet, no_overlap;
    int precise;              /* --precise: the epoch line's losses with 9 significant digits */
    int save_sharded;         /* fsdp: --save writes the sharded form */
    long long grad_accum;     /* micro-batches of `batch` per optimizer step (>= 1) */
    const char *comm_hook;    /* ddp: --comm-hook (NULL: allreduce) */
    long long powersgd_rank, powersgd_start_step;
    int uneven;               /* ddp: --uneven (tools/train_uneven.c) */
    int sync_bn;              /* ddp: --sync-bn */
    int sequence_parallel;    /* tp (the GPT): --sequence-parallel */
    /* pp: --stages (0: the devices over the mesh's dp), --microbatches,
     * --schedule, --split, --mesh (as given) */
    long long stages, microbatches;
    const char *schedule, *split, *mesh;
    long long min_devices;    /* --min-devices M: elastic resize (with --deterministic) */
    long long deterministic;  /* --deterministic K: K virtual shards (dist/det.h); 0: off */
    /* the memory levers (tools/train_levers.c): --precision, --checkpoint-activations
     * (all = 1 unit per segment), --clip-grad-norm (0: off), --offload */
    const char *precision, *ckpt, *offload;
    const char *offload_other;   /* an earlier --offload of another kind (refused) */
    double clip_grad_norm;
    const char *tool;            /* the command its usage errors name (NULL: tandem train) */
    /* ps (tools/train_ps.c): --servers S (0: 1), --ps-sync, --ps-transport (as given) */
    long long servers;
    const char *ps_sync, *ps_transport;
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
/* Fashion-MNIST (--data DIR) or the synthetic set; on failure nothing is
 * left to free. */
/* tools/train_npy.c: --data X.npy,Y.npy (and --val-data): the training
 * set, and the validation set (--val-data, else the last 10% of --data's
 * samples); labels checked against the model's classes. */
/* A model file's refusals before any work: 16-bit precision, activation
 * checkpointing (exit 2). */
tdm_status tdm_train_check_seq(const tdm_train_args *a, const tdm_model_spec *spec);
/* 1 when --model names a language model: gpt, gpt:L-D-H-T, or a model
 * file of tokens (a GPT written as layers); 0 otherwise, and for a name
 * that does not parse (its parse says why, later). */
int tdm_train_model_is_gpt(const char *model);
tdm_status tdm_train_load_npy(const tdm_train_args *a, const tdm_model_spec *spec,
                              tdm_dataset *train, tdm_dataset *test);
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
/* What a parent of forked ranks checks before forking: loads the data and
 * checks it against a probe model built on a host device (and freed);
 * train NULL (a gpt's text): the probe alone. *param_elems (NULL: not
 * wanted) is the model's parameter count. On failure the message is
 * printed or set and nothing is left to free. */
tdm_status tdm_train_load_and_probe(const tdm_train_args *a, const tdm_model_spec *spec,
                                    tdm_dataset *train, tdm_dataset *test,
                                    int64_t *param_elems);
/* With --resume, loads the checkpoint into m and opt and sets *resumed
 * to what it says (its epoch is where training goes on; its loss scaler,
 * tdm_train_levers_apply's); all zero without. */
tdm_status tdm_train_resume(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                            tdm_ckpt_info *resumed);
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

/* A gpt's text (tools/train_text.c fills it): the corpus, the context
 * T, the evaluation windows and the bigram baseline beside them. */
typedef struct tdm_train_text_set {
    const tdm_text_corpus *corpus;
    int T;
    int64_t eval_count;
    double bigram;
} tdm_train_text_set;
/* One process's run as the epoch loop sees it. */
typedef struct tdm_train_run {
    tdm_model *m;                  /* borrowed */
    tdm_optim *opt;                /* borrowed */
    int64_t start_epoch;           /* epochs a resumed checkpoint had done */
    tdm_train_step_fn step;        /* the mode's step (models/train.h) */
    void *step_ctx;
    /* images: the training and test sets */
    const tdm_dataset *train, *test;
    /* text (when set): the corpus, its context and the bigram baseline
     * printed beside the validation loss, and this process's windows
     * [lo, hi) of each global batch */
    const tdm_train_text_set *text;
    int lo, hi;
    tdm_train_eval_fn eval;        /* NULL: tdm_evaluate on the test set here (images) */
    void *eval_ctx;
    tdm_train_after_epoch_fn after;    /* may be NULL */
    void *after_ctx;
    struct tdm_single *single;     /* --mode single's step: its lever figures go in the epoch
                                      line (tools/train_levers.c); NULL elsewhere */
    const struct tdm_dist_stepper *ranks;  /* --mode ddp/fsdp's, the same; NULL elsewhere */
    /* --trace: this process's recorder (NULL: none), and the last step's
     * phases where the mode measures them (NULL: steps without phases) */
    struct tdm_train_trace *trace;
    int (*phases)(void *ctx, tdm_phase_times *out);
    void *phases_ctx;
} tdm_train_run;

/* --json / --csv (tools/train_out.c): epoch's record appended and the
 * files rewritten; nothing when neither is given. T: a gpt's window (0:
 * images); eval_metric: test accuracy, or a gpt's validation bits per byte. */
tdm_status tdm_train_out_epoch(const tdm_train_args *a, int64_t T, int64_t epoch,
                               double train_loss, double samples_per_s, double seconds,
                               double eval_loss, double eval_metric);

/* Epochs start_epoch..--epochs-1: the learning-rate schedule on the
 * optimizer, each epoch (with the progress line), evaluation, the epoch's
 * line, the checkpoint (--save; refused when the last gradients are not
 * finite), then `after`. On a failure, says what --save still holds. */
tdm_status tdm_train_epochs(const tdm_train_args *a, const tdm_train_run *r);

/* ---- the modes ---- */

typedef struct tdm_comm tdm_comm;
typedef struct tdm_dist_ops tdm_dist_ops;
typedef struct tdm_tool_design tdm_tool_design;

/* The header lines of a gpt run (tools/train_text.c). */
void tdm_train_text_header(const tdm_train_text_set *t, const tdm_model_spec *spec,
                           const tdm_train_args *a, int64_t params, const char *devices);
/* Evaluation windows at most, and windows per evaluation forward. */
#define TDM_TRAIN_TEXT_EVAL_CAP 512
#define TDM_TRAIN_TEXT_EVAL_BATCH 32
/* Test images per evaluation forward at most. */
#define TDM_TRAIN_EVAL_BATCH 1000

/* The samples (a gpt: windows) of one evaluation forward on a device
 * whose step runs its replica's share of --batch over `replicas`: the
 * smallest share, floor(B / replicas) (at least 1; the same on every
 * rank, as a sharded design's collective forwards need), at most `cap`
 * (TDM_TRAIN_EVAL_BATCH, or TDM_TRAIN_TEXT_EVAL_BATCH). No larger than
 * any replica's step, it reuses the activations and scratch the step
 * reserved, so evaluation between epochs does not raise a device's peak
 * above its step's (which `tandem plan` predicts); a larger evaluation
 * batch would grow them. */
int tdm_train_eval_rows(const tdm_train_args *a, int replicas, int cap);

/* --uneven: one rank's epochs over its own samples, with join
 * (tools/train_uneven.c), through the design's ops on w: zero_grad,
 * forward_mean (the mean over the ranks with data), backward, step, join
 * and (images) evaluate. eval (collective, may be NULL) replaces the test
 * set's evaluation (a gpt's validation loss); save (may be NULL) runs
 * after each epoch, collectively. text: NULL for the image models, else
 * a gpt's windows (train and test unused). */
typedef struct tdm_train_uneven {
    const tdm_dist_ops *ops;
    void *w;                      /* the design's wrapper */
    tdm_optim *opt;
    tdm_model *m;
    tdm_comm *comm;
    const tdm_dataset *train, *test;
    const tdm_train_text_set *text;
    tdm_train_eval_fn eval;
    tdm_train_after_epoch_fn save;
    void *ctx;                    /* eval's and save's */
    int64_t start_epoch;
} tdm_train_uneven;
tdm_status tdm_train_uneven_run(const tdm_train_args *a, const tdm_train_uneven *u);

/* --mode dp --deterministic K (tools/train_det.c): the virtual shards
 * over DataParallel's devices, the master's single (its optimizer) the
 * one that steps; micro: --grad-accum's micro-batch (0: none). A
 * tdm_train_step_fn over the result. */
typedef struct tdm_train_det_dp tdm_train_det_dp;
typedef struct tdm_dp tdm_dp;
tdm_status tdm_train_det_dp_init(tdm_train_det_dp **out, tdm_dp *dp, tdm_single *master, int K,
                                 int micro, int in_elems, int out_rows);
void tdm_train_det_dp_free(tdm_train_det_dp *p);
tdm_status tdm_train_det_dp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                 double *loss_mean);
/* --mode tp --deterministic K (tools/train_det.c): one optimizer step of
 * a tensor-parallel rank whose replica holds rows [row0, row0 + its
 * share) of a global batch of `global` at x, y: the replica's shards of
 * the K (dist/batch.h's cut, virtual shards rep*K/D ..) through the group
 * one at a time from zeroed gradients, each fed to det (over the rank's
 * flat gradients, its comm the dp dimension's), the tree's top over the
 * replicas, the sum written back and the optimizer stepped (the tp rank
 * built without grad_comm). *loss_sum: the global batch's. Collective. */
typedef struct tdm_tp tdm_tp;
typedef struct tdm_dist_det tdm_dist_det;
/* The device communicator for --deterministic's tree top (dist/det.h's
 * dev_comm) of a group whose host communicator is host and device one
 * dev: dev where it differs (NCCL on a GPU), else NULL (the host path);
 * TANDEM_TEST_DET_DEV_COMM=1, a test hook read only by
 * tests/test_det_gpu.c, takes the device path over dev even when it is
 * host, so that host devices and the emulator run it. */
tdm_comm *tdm_train_det_dev_comm(tdm_comm *host, tdm_comm *dev);
tdm_status tdm_train_det_tp_step(tdm_tp *p, tdm_dist_det *det, const void *x, const int32_t *y,
                                 int global, int64_t row0, double *loss_sum);

/* ---- the memory levers (tools/train_levers.c) ---- */

/* The checks of --precision, --checkpoint-activations, --clip-grad-norm
 * and --offload that need no model (USAGE, said on stderr). */
tdm_status tdm_train_levers_check(const tdm_train_args *a);
/* --mode single: the precision and checkpointing on m, the clipping and
 * (fp16) the loss scaler on the step; scaler: storage for it, going on
 * from the resumed checkpoint's scaler when it has one (resumed may be
 * NULL). Then the line that says what is on and the planner's peak. */
tdm_status tdm_train_levers_apply(const tdm_train_args *a, tdm_model *m, struct tdm_single *s,
                                  struct tdm_grad_scaler *scaler, const tdm_ckpt_info *resumed);
/* After training: the device's measured peak beside the planned one. */
void tdm_train_levers_report(const tdm_train_args *a, tdm_model *m);
/* The epoch line's lever figures (", grad norm ..., loss scale ..."). */
void tdm_train_levers_epoch(const tdm_train_run *r);
/* --mode ddp and fsdp: what every rank builds (precision and
 * checkpointing on its model, the optimizer's offload) into b; then, in
 * each rank, the clipping and (fp16) loss scaler on its stepper (scaler:
 * storage for it; from r->resumed's scaler when it has one) and rank 0's
 * line saying what is on; after training
 * rank 0's measured peak. */
struct tdm_tool_build;
struct tdm_tool_rank;
void tdm_train_levers_build(const tdm_train_args *a, struct tdm_tool_build *b);
tdm_status tdm_train_levers_rank(const tdm_train_args *a, const struct tdm_tool_rank *r,
                                 struct tdm_dist_stepper *s, struct tdm_grad_scaler *scaler);
void tdm_train_levers_rank_report(const tdm_train_args *a, const struct tdm_tool_rank *r);
/* --mode pp: the stepper's levers on the rank's pipeline before each step
 * (the found-inf flag and the norm over job, the whole job's device
 * communicator; the norm counts replica 0's stages, or with sumsq set,
 * a tensor-parallel stage's, what sumsq(ctx, ...) says: pp/pp.h's
 * tdm_pp_levers), its figures after. */
struct tdm_pp;
struct tdm_model;
void tdm_train_levers_pp_begin(struct tdm_dist_stepper *s, struct tdm_pp *p, tdm_comm *job,
                               int replica,
                               tdm_status (*sumsq)(void *ctx, struct tdm_model *m, double *sq),
                               void *ctx);
void tdm_train_levers_pp_end(struct tdm_dist_stepper *s, const struct tdm_pp *p);
/* --mode tp: the same on a tensor-parallel rank (the norm counts
 * replica 0's group). */
struct tdm_tp;
void tdm_train_levers_tp_begin(struct tdm_dist_stepper *s, struct tdm_tp *p, tdm_comm *job,
                               int replica);
void tdm_train_levers_tp_end(struct tdm_dist_stepper *s, const struct tdm_tp *p);

/* --model gpt: a language model on text, in every mode (tools/train_text.c). */
tdm_status tdm_train_text_main(const tdm_train_args *a);
/* --mode single and dp (tools/train_local.c): one process. spec: the
 * model (NULL: parsed from --model); text: a gpt's (NULL: the image
 * models, their data loaded here). Says what failed. */
tdm_status tdm_train_run_local(const tdm_train_args *a, const tdm_model_spec *spec,
                               const tdm_train_text_set *text);
/* The pipeline's options against the mode and the others (USAGE, said):
 * they apply to --mode pp, which takes no --grad-accum (--microbatches is
 * its accumulation), --uneven, --sync-bn, --comm-hook or sharding; fills
 * the defaults of --microbatches and --schedule (tools/train_pp.c). */
tdm_status tdm_train_check_pp(tdm_train_args *a, int gpt);
/* --mode pp (tools/train_pp.c): checks its options and runs the ranks of
 * the pipeline's table (tools/rank_pp.c) through tdm_train_run_ranks. */
tdm_status tdm_train_run_pp(const tdm_train_args *a, const tdm_model_spec *spec,
                            const tdm_train_text_set *text);
/* --mode tp's options against the others (USAGE, said): the MLP and GPT,
 * none of the data-parallel designs' or the memory levers' options
 * (tools/train_tp.c). */
tdm_status tdm_train_check_tp(const tdm_train_args *a);
/* --mode tp (tools/train_tp.c): the ranks of tensor parallelism's table
 * (tools/rank_tp.c) through tdm_train_run_ranks. */
tdm_status tdm_train_run_tp(const tdm_train_args *a);
/* --mode ps (tools/train_ps.c): a parameter server's ranks over dist/run.h.
 * Checks its options (USAGE, said) and says what failed. spec: the model
 * (NULL: parsed from --model); text: a gpt's (NULL: the MLP). */
tdm_status tdm_train_run_ps(const tdm_train_args *a, const tdm_model_spec *spec, const tdm_train_text_set *text);
/* --mode ddp and fsdp (tools/train_ranks.c): the ranks of a design's
 * table (tools/ranks.h) over dist/run.h, forked, launched or an MPI
 * job's. spec: the model (NULL: parsed from --model); text: a gpt's
 * (NULL: the image models, their data loaded here). Says what failed. */
tdm_status tdm_train_run_ranks(const tdm_train_args *a, const tdm_tool_design *design,
                               const tdm_model_spec *spec, const tdm_train_text_set *text);

#endif
