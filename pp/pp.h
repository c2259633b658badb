/* pp/pp.h: pipeline parallelism: one process per stage, each holding a
 * run of consecutive layers of the model (models/stage.h); a global batch
 * cut into micro-batches whose activations flow forward and whose
 * gradients flow back by send/recv, in a GPipe or 1F1B schedule;
 * gradients accumulated over the micro-batches and one optimizer step per
 * global batch on every stage. The same training step as one device with
 * gradient accumulation over the same micro-batches (models/accum.h):
 * bit for bit on host devices for the MLP and CNN; for the GPT up to the
 * rounding of its tied embedding's gradient (below).
 *
 * A stage (tdm_pp) is: its stage model and an optimizer over its slice of
 * the parameters, its place in the pipeline (stage s of S: rank s of the
 * pipeline's communicator), and its links to the stages beside it. The
 * links are communicators split from the pipeline's (tdm_comm_split, p2p
 * option): a stage sends activations downstream while it receives
 * gradients from there, and one communicator's calls run one at a time,
 * so each direction of each link has one of its own (link s -> s+1 on
 * communicator s % 2, s+1 -> s on 2 + s % 2: every rank issues one kind
 * of call on each), and transfers go on while the stage computes. Every
 * send and recv is labelled in the flight recorder ("pp send act mb 3
 * stage 0->1").
 *
 * Schedules are data (tdm_pp_schedule): per stage a list of actions, F i
 * (forward of micro-batch i) and B i (its backward), printable. GPipe:
 * every forward, then every backward (in micro-batch order, as gradient
 * accumulation adds them). 1F1B (PipeDream-flush): min(S - s - 1, M)
 * warm-up forwards on stage s, then one forward one backward, then the
 * remaining backwards. A stage keeps a micro-batch's activations from its
 * F to its B in one of the model's activation sets: GPipe holds M at
 * once, 1F1B at most S - s.
 *
 * Loss and accuracy come from the last stage (the loss gradient scaled by
 * 1/B_global, as gradient accumulation scales it) and are broadcast to
 * every stage for the global batch. The GPT's token embedding lives on
 * the first stage and, for the tied head, as a copy on the last: after
 * the backwards the two stages exchange their shares of its gradient and
 * both add first + last (Megatron's tied-embedding all-reduce), so the
 * copies stay equal; one device adds the shares in another order, which
 * is the only rounding difference of a GPT pipeline.
 *
 * Data parallelism on top (a dp x pp mesh, dist/mesh.h): pass each stage
 * the pp communicator of its replica and, in tdm_pp_opts.grad_sync, the
 * two halves of a synchronised backward over the dp communicator (DDP's
 * Reducer: tdm_ddp_sync_begin/_end), run around the last micro-batch's
 * backward. pp/ knows nothing of DDP.
 *
 * Not here: rank start-up, the command line, checkpoint files (a
 * stage's slice is where tdm_model_stage_info.slice_offset says in the
 * whole model's flat buffer: tdm_pp_gather_params assembles them). */
#ifndef TDM_PP_PP_H
#define TDM_PP_PP_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/data.h"
#include "core/device.h"
#include "core/status.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/precision.h"
#include "models/stage.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- schedules (pp/schedule.c) -------------------------------------------- */

typedef enum tdm_pp_schedule_kind {
    TDM_PP_GPIPE = 0,
    TDM_PP_1F1B,
    TDM_PP_SCHEDULE_COUNT_
} tdm_pp_schedule_kind;

typedef enum tdm_pp_op {
    TDM_PP_FORWARD = 0,
    TDM_PP_BACKWARD,
} tdm_pp_op;

typedef struct tdm_pp_action {
    tdm_pp_op op;
    int mb;                     /* micro-batch */
} tdm_pp_action;

typedef struct tdm_pp_schedule {
    tdm_pp_schedule_kind kind;
    int stages, micro;          /* S, M */
    int *n_actions;             /* per stage (2M) */
    tdm_pp_action **actions;    /* per stage, in the order it runs them */
} tdm_pp_schedule;

/* "gpipe", "1f1b"; "?" when invalid. */
const char *tdm_pp_schedule_name(tdm_pp_schedule_kind k);
/* "gpipe" or "1f1b" (also "GPipe", "1F1B"); one-line INVALID_ARG else. */
tdm_status tdm_pp_schedule_parse(const char *text, tdm_pp_schedule_kind *out);
/* The schedule of S >= 1 stages and M >= 1 micro-batches. */
tdm_status tdm_pp_schedule_build(tdm_pp_schedule **out, tdm_pp_schedule_kind kind, int stages,
                                 int micro);
void tdm_pp_schedule_free(tdm_pp_schedule *s);   /* NULL ok */
/* "F0 F1 B0 F2 B1 B2" for stage, truncated to n; returns buf. */
const char *tdm_pp_schedule_format(const tdm_pp_schedule *s, int stage, char *buf, size_t n);
/* The most micro-batches stage holds between their F and their B. */
int tdm_pp_schedule_in_flight(const tdm_pp_schedule *s, int stage);
/* Every stage runs each micro-batch's F once and then its B once, Fs and
 * Bs each in micro-batch order (what the runtime needs). */
tdm_status tdm_pp_schedule_check(const tdm_pp_schedule *s);
/* Runs the schedule with every action taking one time unit and transfers
 * none (an action waits for its input from the stage beside it):
 * *makespan the units until the last action ends; *idle the share of
 * stage-units spent waiting, (S - 1) / (M + S - 1) for both schedules
 * (the bubble). */
tdm_status tdm_pp_schedule_simulate(const tdm_pp_schedule *s, int *makespan, double *idle);

/* --- splitting the layers (pp/split.c) ----------------------------------- */

/* How the default split balances the stages: the gemm multiply-adds of
 * forward and backward per layer (tdm_model_spec_layer_costs: what the
 * stages spend their time on; layers without a gemm count nothing), or
 * the parameter count (what the stages hold). */
typedef enum tdm_pp_balance {
    TDM_PP_BALANCE_FLOPS = 0,
    TDM_PP_BALANCE_PARAMS,
} tdm_pp_balance;

/* Checks a split: first[s] is the first layer of stage s; first[0] = 0,
 * strictly increasing, below n_layers; stages <= n_layers. One-line
 * INVALID_ARG messages ("split 0,3,3: stage 2 starts at layer 3, where
 * stage 1 starts (the first layers must increase)"). */
tdm_status tdm_pp_split_check(const int *first, int stages, int n_layers);
/* Parses "0,3,5" (the first layer of each stage) for `stages` stages of a
 * model of n_layers layers, and checks it. */
tdm_status tdm_pp_split_parse(const char *text, int stages, int n_layers, int *first);
/* The split of spec into `stages` contiguous runs that makes the largest
 * stage's cost (by b) the smallest (ties: the earliest such cut). */
tdm_status tdm_pp_split_balance(const tdm_model_spec *spec, int stages, tdm_pp_balance b,
                                int *first);
/* "0,3,5" */
const char *tdm_pp_split_str(const int *first, int stages, char *buf, size_t n);

/* --- a stage ---------------------------------------------------------------- */

/* Called around the last micro-batch's backward of each step (data
 * parallelism over the stage's replicas: tdm_ddp_sync_begin/_end).
 * empty (optional): called instead, once, in a step whose replica has no
 * samples (tdm_pp_step_scaled with batch 0: a short global batch's empty
 * share), with the stage's gradients zeroed and no backward run
 * (tdm_ddp_sync_empty); without it batch 0 is refused. */
typedef struct tdm_pp_grad_sync {
    tdm_status (*begin)(void *ctx);
    tdm_status (*end)(void *ctx, tdm_status backward_status);
    tdm_status (*empty)(void *ctx);
    void *ctx;
} tdm_pp_grad_sync;

/* The stage's optimizer step, replacing the pipeline's own optimizer
 * (ZeRO-1 over the replicas: each steps its slice of the stage's flat
 * parameters from the all-reduced gradients and the slices are gathered
 * back). Called once per step after the tied gradient is summed; the
 * stage then builds no optimizer: tdm_pp_optim is NULL, the stats'
 * optimizer bytes are 0 (the hook's owner says its own), and checkpoints
 * of optimizer state (tdm_pp_gather_state, tdm_pp_load_state with
 * h->optim) are refused. */
typedef struct tdm_pp_optim_step {
    tdm_status (*fn)(void *ctx, tdm_model *m);
    void *ctx;
} tdm_pp_optim_step;

/* The micro-batches as virtual shards (--deterministic K, dist/det.h):
 * each micro-batch's forward starts from the step's buffers and its
 * backward from zeroed gradients, so that after it the stage's gradients
 * (and, restored, the buffers its forward left) are that micro-batch's
 * alone, exactly as one device computes that shard: leaf takes them (the
 * gradients are zeroed after it). The GPT's tied embedding: the last
 * stage sends each micro-batch's head share of its gradient to the first
 * stage, whose backward of that micro-batch starts from it (one device's
 * order of the two shares), and keeps zero in its own copy's leaf. After
 * the schedule, reduce writes the step's summed gradients and buffers
 * into the stage's model (*loss_sum: the global batch's loss sum, used on
 * the last stage), and the first stage's summed token-embedding gradient
 * replaces the last stage's copy's; then the optimizer steps. grad_sync
 * is not used with it. */
typedef struct tdm_pp_shards {
    /* Micro-batch mb's rows [*lo, *hi) of this replica's batch of `batch`
     * rows, each micro-batch at least one row, in order, covering it. */
    void (*cut)(void *ctx, int batch, int mb, int *lo, int *hi);
    /* loss: the micro-batch's loss sum on the last stage, 0 elsewhere */
    tdm_status (*leaf)(void *ctx, tdm_model *m, int mb, double loss);
    tdm_status (*reduce)(void *ctx, tdm_model *m, double *loss_sum);
    void *ctx;
    /* Dropout's masks count the model's training forwards: micro-batch
     * mb's forward runs as the step's forward number first + mb of
     * `total` (this replica's first virtual shard among the step's
     * total), as one device's; total 0: the micro-batches alone (first 0,
     * total micro_batches). Also honoured without the hooks (a replica
     * whose gradients grad_sync sums): first the replica's first
     * micro-batch among the replicas' total. */
    int first, total;
} tdm_pp_shards;

/* Zero-initialised options are the defaults, but for spec-related ones. */
typedef struct tdm_pp_opts {
    tdm_pp_schedule_kind schedule;
    int micro_batches;          /* M >= 1: a global batch of B samples becomes
                                   ceil(B / ceil(B / M)) micro-batches of ceil(B / M)
                                   (the last shorter): models/accum.h's cut */
    const int *split;           /* the first layer of each stage; NULL: balanced */
    tdm_pp_balance balance;     /* the default split's */
    uint64_t seed;              /* the model's initial parameters */
    tdm_optim_opts optim;       /* the optimizer (over the stage's slice) */
    tdm_pp_grad_sync grad_sync; /* optional */
    tdm_pp_optim_step optim_step; /* optional: instead of the stage's own optimizer */
    tdm_pp_shards shards;       /* optional: micro-batches as virtual shards (micro_size
                                   is then unused: cut says the rows) */
    /* The largest global batch the steps will take (0: not known). On
     * host devices over shm it sizes the links' zero-copy memory and the
     * receive buffers are placed there: activations and gradients then
     * arrive written in place by their sender (one copy instead of two,
     * no chunk-by-chunk exchange). Without it, or for a larger batch,
     * they go through the links' staging. */
    int batch;
    /* The micro-batch size (0: ceil(B / M) of each step's batch B). With
     * it, a batch B <= micro_size * M is cut into ceil(B / micro_size)
     * micro-batches of micro_size (the last shorter): a short last batch of
     * an epoch is then cut as one device's --grad-accum M with micro-batches
     * of micro_size cuts it, so the two stay the same step. Larger batches
     * are cut as without it. */
    int micro_size;
    /* Borrowed, optional: a communicator with the same ranks for the few
     * collectives on host memory (the configuration check, the loss,
     * gathering): needed when the pipeline's communicator only takes
     * device memory (NCCL: pass the shm communicator it was bootstrapped
     * over). NULL: the pipeline's. */
    tdm_comm *host_comm;
    /* The memory levers of the stage's model (docs/MEMORY.md): every
     * matrix product in bf16 or fp16 with float32 sums (models/
     * precision.h), and activation checkpointing in segments of ckpt
     * units (models/recompute.h; 0: none): a micro-batch's activation set
     * keeps the segments' inputs from its F to its B, and its B runs
     * each segment's forward again. Every stage the same (checked). */
    tdm_precision precision;
    int ckpt;
} tdm_pp_opts;

typedef struct tdm_pp tdm_pp;

/* Stage tdm_comm_rank(comm) of tdm_comm_size(comm): builds its stage
 * model of spec on dev (borrowed) and its optimizer, checks that every
 * stage has the same configuration (naming the one that differs), and
 * splits its links. Collective over comm (borrowed; it must outlive the
 * stage). Errors are one line: more stages than layers, M < 1, a split
 * out of range or not increasing. Starts a new peak window of dev's
 * allocator (what the memory report measures from). */
tdm_status tdm_pp_init(tdm_pp **out, tdm_comm *comm, tdm_device *dev, const tdm_model_spec *spec,
                       const tdm_pp_opts *opts);
void tdm_pp_free(tdm_pp *p);   /* NULL ok */

int tdm_pp_stage(const tdm_pp *p);
int tdm_pp_stages(const tdm_pp *p);
tdm_model *tdm_pp_model(tdm_pp *p);
tdm_optim *tdm_pp_optim(tdm_pp *p);
/* The split in use: the first layer of each of the S stages. */
const int *tdm_pp_split(const tdm_pp *p);

/* One training step over a global batch of `batch` samples in host
 * memory, on every stage (collective): x (batch, in_features) of the
 * model's input dtype, read by the first stage (may be NULL elsewhere);
 * y (batch * out_rows) targets, read by the last (may be NULL elsewhere).
 * Zeroes the gradients, runs the schedule, sums the tied embedding's
 * shares, steps the optimizer. *loss_mean (may be NULL): the global
 * batch's mean loss, on every stage. On any failure the pipeline's
 * communicator is aborted, so every stage stops, and the error names the
 * micro-batch, the transfer and the peer. */
tdm_status tdm_pp_step(tdm_pp *p, const void *x, const int32_t *y, int batch, double *loss_mean);
/* The same step with the loss gradient scaled by grad_scale instead of
 * 1/batch: data parallelism over replicas of the pipeline, each running
 * its share of a global batch of B_global, passes 1/B_global, so that the
 * SUM all-reduce of grad_sync gives the global batch's mean-loss gradient
 * (uneven shares included). A replica whose share is empty passes batch 0
 * on every stage (with grad_sync.empty set): no micro-batch runs, its zero
 * gradient joins the sum, the levers and the optimizer step, *loss_sum
 * is 0. *loss_sum (may be NULL): the sum of this replica's per-sample
 * losses, on every stage. */
tdm_status tdm_pp_step_scaled(tdm_pp *p, const void *x, const int32_t *y, int batch,
                              float grad_scale, double *loss_sum);
/* Forward only, in eval mode (restored after), through the pipeline:
 * *loss_sum the sum of the per-sample losses, *correct the correct argmax
 * predictions over batch * out_rows rows, on every stage. */
tdm_status tdm_pp_eval_batch(tdm_pp *p, const void *x, const int32_t *y, int batch,
                             double *loss_sum, int64_t *correct);
/* Mean loss and accuracy over a dataset of images (tdm_data_gather
 * order, batches of `batch`), on every stage: the MLP and the CNN, with
 * the dataset's features those of the model's input (anything else,
 * the GPT included, is refused on every stage). */
tdm_status tdm_pp_evaluate(tdm_pp *p, const tdm_dataset *d, int batch, double *loss_mean,
                           double *accuracy);

/* The whole model's parameters (tdm_model_param_elems of the whole model)
 * assembled on stage root from every stage's slice, into full (host
 * memory, used on root only). Collective. A root without a buffer
 * (full NULL; h or h->params NULL below) is refused on every stage with
 * TDM_STATUS_INVALID_ARG before anything is sent; the pipeline stays
 * usable. */
tdm_status tdm_pp_gather_params(tdm_pp *p, float *full, int root);
/* Checkpoints. The whole model's state assembled on stage root into h
 * (host arrays in the whole model's layout, models/checkpoint.h's
 * tdm_ckpt_host; used on root only): parameters, buffers (h->buffers may
 * be NULL) and, when h->optim is set, the optimizer's state and step
 * count - what tdm_checkpoint_save_host writes for the whole model, a
 * file every mode loads. Collective. */
tdm_status tdm_pp_gather_state(tdm_pp *p, tdm_ckpt_host *h, int root);
/* A buffer in the stage's parameter layout (device memory, e.g. the
 * state of an optim_step's optimizer gathered over the replicas) put
 * into the whole model's layout on stage root, into full (host; used on
 * root only, which must pass one). what names it in errors. Collective. */
tdm_status tdm_pp_gather_stage(tdm_pp *p, const float *stage, float *full, int root,
                               const char *what);
/* Each stage takes its slice (and the GPT's last stage its tied copy) of
 * a whole model's state in h, on every stage (every stage reads the file:
 * tdm_checkpoint_load_host, of any mode's checkpoint): parameters,
 * buffers (if h->buffers) and, when h->optim is set, the optimizer's
 * state and step count. Not collective. */
tdm_status tdm_pp_load_state(tdm_pp *p, const tdm_ckpt_host *h);

/* --- the step's levers (pp/levers.c) ------------------------------------------
 * Loss scaling (fp16) and gradient clipping over the whole pipeline, and
 * over its data-parallel replicas. With a scaler, the loss gradient of
 * every micro-batch is scaled by the scale too; after the backwards, the
 * tied embedding's sum and the replicas' all-reduce (grad_sync), each
 * stage unscales its gradients and checks them, and the found-inf flag
 * is ORed over comm (one all-reduce, "grad scaler found inf"): a step
 * found bad is skipped on every stage of every replica (the optimizer,
 * or the optim_step hook, does not run) and the scale halves on all.
 * With clip_norm > 0 (or measure_norm) the global L2 norm: each stage's
 * sum of squares of its slice (the tied copy counted once, on the first
 * stage; of the replicas of a stage only those with norm_counted),
 * summed by one all-reduce of one double over comm ("pp clip grad norm"),
 * then torch's clip_grad_norm_ on every stage (models/clip.h). comm: the
 * whole job's communicator on the stage's device memory (every stage of
 * every replica calls it once per step); NULL: the pipeline's (no
 * replicas). Every stage must set the same levers. A stage whose tensors
 * are not all its own (a tensor-parallel stage: split tensors counted by
 * every rank of its group, replicated ones by one) says its squares
 * through sumsq instead of the slice's (norm_counted is then unused). */
typedef struct tdm_pp_levers {
    struct tdm_grad_scaler *scaler;   /* borrowed; NULL: no loss scaling */
    double clip_norm;                 /* > 0: clip to it */
    int measure_norm;                 /* 1: the norm without clipping */
    tdm_comm *comm;                   /* borrowed; NULL: the pipeline's */
    int norm_counted;                 /* this rank's squares count: one replica per stage */
    /* Optional: *sq, this rank's share of the sum of squares of the
     * gradient of m (device memory, after the sums). */
    tdm_status (*sumsq)(void *ctx, tdm_model *m, double *sq);
    void *sumsq_ctx;
    /* Test hook, after the backwards and the tied sum, before the levers
     * read the gradients (a planted inf). May be NULL. */
    void (*after_backward)(void *ctx, tdm_model *m, int64_t step);
    void *ctx;
} tdm_pp_levers;
/* Sets (or with NULL clears) the levers of the following steps; copied. */
void tdm_pp_set_levers(tdm_pp *p, const tdm_pp_levers *l);

/* --- what a step did ---------------------------------------------------------- */

/* One F or B of the last step, in CLOCK_MONOTONIC ns (one clock for every
 * process of a machine, so stages line up). */
typedef struct tdm_pp_event {
    tdm_pp_op op;
    int mb;
    uint64_t t0_ns, t1_ns;
} tdm_pp_event;

/* Phases of one step on this stage, in ms. pipeline: from the step's
 * start to its last action's end; bubble: pipeline - forward - backward
 * - loss, the time the stage waited on the pipeline (fill, drain, and
 * transfers it could not hide), which the ideal balanced pipeline puts at
 * (S - 1) / (M + S - 1) of pipeline; recv_wait and send_wait: the part of
 * it spent blocked on a transfer's completion. */
typedef struct tdm_pp_phases {
    double forward, backward, loss, recv_wait, send_wait, bubble, pipeline;
    double grad_sync, tied, step, total;
} tdm_pp_phases;

typedef struct tdm_pp_stats {
    int stage, stages, micro_batches, micro_size;
    tdm_pp_phases last, sum;    /* the last step's, and the sums over all steps */
    int64_t steps;
    /* memory, bytes (tdm_dev_mem_query of the stage's device) */
    size_t params, grads, optimizer, buffers;
    size_t act_set;             /* one micro-batch's activations in the model (its set) */
    size_t act_input;           /* one micro-batch's received input activation */
    int act_inputs;             /* input slots: one more than the sets on a stage that
                                   receives (the next input arrives while one computes),
                                   at most the micro-batches; 0 on the first stage */
    int zero_copy;              /* 1: the receive buffers live in the links' shared memory
                                   (tdm_pp_opts.batch; not the device allocator's) */
    size_t act_scratch;         /* shared by the micro-batches: backward's scratch,
                                   the received gradients, staging */
    int act_sets;               /* sets the schedule needs at once */
    size_t peak_act;            /* measured: the allocator's peak since init minus what
                                   was live at the end of init; -1 cast when the device
                                   keeps no accounting */
    /* transfers that were still in flight when a forward or backward began
     * and had completed by its end: communication overlapped with compute */
    int64_t overlapped;
    int64_t transfers;
    /* the levers (tdm_pp_set_levers) */
    double last_norm;           /* the last step's global gradient norm (0: not measured) */
    int last_skipped;           /* 1: the last step was skipped on every stage (found inf) */
    int64_t skipped;            /* steps skipped so far */
} tdm_pp_stats;

void tdm_pp_get_stats(const tdm_pp *p, tdm_pp_stats *out);
/* The last step's F and B events on this stage, in the order run. */
void tdm_pp_trace(const tdm_pp *p, const tdm_pp_event **events, int *n);

#ifdef __cplusplus
}
#endif

#endif
