/* tp/tp.h: tensor parallelism (Megatron-LM's feature split) of the MLP:
 * every rank of a tensor-parallel group holds a slice of each split
 * linear layer and the ranks all-reduce partial results inside the step.
 *
 * The plan (tdm_tp_plan): the MLP's consecutive linear layers pair up,
 * fc1+fc2, fc3+fc4, ...; the first of a pair is column-parallel (its
 * output features split: rank r holds rows [r*out/N, (r+1)*out/N) of the
 * weight and of the bias; its input is replicated), the second
 * row-parallel (its input features split: rank r holds columns
 * [r*in/N, (r+1)*in/N) of the weight; its bias is whole). An odd last
 * layer (fc3 of 784-W1-W2-10) is replicated: every rank holds it whole.
 * The width between the two layers of a pair must divide by N.
 *
 * The data flow of one pair, B samples (x replicated on every rank):
 *   column  h_r = relu(x W1_r^T + b1_r)            (B, W/N), no communication
 *   row     p_r = h_r W2_r^T                        (B, out) a partial sum
 *           z   = all-reduce(sum over r of p_r)     forward all-reduce
 *           y   = act(z + b2)                       replicated on every rank
 * backward, dy replicated:
 *   row     dW2_r += dy^T h_r, db2 += colsum(dy), dh_r = dy W2_r (local)
 *   column  dW1_r += dh_r^T x, db1_r += colsum(dh_r),
 *           dx = all-reduce(sum over r of dh_r W1_r)  backward all-reduce
 *           (skipped for fc1, whose input is the data: no gradient needed)
 * So a step all-reduces B * (the row layer's output width) floats per pair
 * in forward and B * (the column layer's input width) floats per pair but
 * the first in backward, and nothing else (tdm_tp_step_bytes).
 *
 * Replicated parameters (row-parallel biases, the replicated last layer)
 * get the same gradient on every rank without communication: their
 * inputs (the all-reduced z, its relu, the loss gradient) are the same
 * bits on every rank, because an all-reduce hands every rank the same
 * result, and every rank runs the same kernels on them.
 *
 * Row-parallel sums add the N partial products in another order than one
 * device's single gemm, so TP equals one device within float rounding,
 * not bit for bit (tests/test_tp.c measures the bound).
 *
 * Data parallelism on top (a dp x tp mesh): pass grad_comm, the dp
 * dimension's communicator; once per optimizer step the rank's whole flat
 * gradient is all-reduced (SUM) over it, the loss gradient being scaled
 * by 1/B_global (tdm_tp_step_scaled), so the sum is the global batch's
 * mean-loss gradient.
 *
 * The GPT is split too (tp/gpt.c: attention by heads, the MLP column/row;
 * LayerNorms, embeddings and the tied head replicated), optionally
 * sequence parallel (tdm_tp_check_seq). ZeRO-1 and 2 over the dp
 * dimension: tdm_tp_opts.zero. Not here: dp x pp x tp, rank start-up,
 * the command line (tools/rank_tp.c). */
#ifndef TDM_TP_TP_H
#define TDM_TP_TP_H

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

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_tp_split {
    TDM_TP_COLUMN = 0,          /* output features split */
    TDM_TP_ROW,                 /* input features split, partial outputs all-reduced */
    TDM_TP_REPLICATED,          /* whole on every rank */
} tdm_tp_split;

/* "column", "row", "replicated"; "?" else. */
const char *tdm_tp_split_name(tdm_tp_split s);

/* The split of each of spec's linear layers on `ranks` tensor-parallel
 * ranks into split[0..*n_layers) (room for TDM_MODEL_MAX_DIMS). One-line
 * USAGE errors: a model other than the MLP, the GPT and a model file of
 * linear layers with elementwise layers between them ("--mode tp supports
 * the MLP, the GPT and model files of linear layers; the cnn is not
 * supported"; a file's other layer named by its line: "file:x.tdm line 3:
 * `conv`: --mode tp cannot split it: ..."), an MLP of one
 * linear layer, a width that does not divide ("layer fc1's output width
 * 100 (fc2's input) is not divisible by the 3 tensor-parallel ranks"), a
 * GPT whose heads do not divide ("the GPT's 4 heads are not divisible by
 * the 3 tensor-parallel ranks (attention is split by heads)"). */
tdm_status tdm_tp_plan(const tdm_model_spec *spec, int ranks, tdm_tp_split *split,
                       int *n_layers);

/* The payload bytes one rank all-reduces over the tensor-parallel group
 * in one training step of `batch` samples (the plan's theoretical volume,
 * above); 0 for one rank. */
int64_t tdm_tp_step_bytes(const tdm_model_spec *spec, int ranks, int batch);
/* And the number of those all-reduces. */
int tdm_tp_step_allreduces(const tdm_model_spec *spec, int ranks);

/* Sequence parallelism (Megatron-LM's, the GPT only): the all-reduce
 * after each row-parallel projection becomes a reduce-scatter along the
 * tokens, the LayerNorms and residual adds run on the rank's 1/N of the
 * B*T tokens (rows [r*BT/N, (r+1)*BT/N): window after window, the
 * sequence of the batch's windows cut in N runs), and an all-gather along
 * the tokens precedes each column-parallel layer; backward swaps them.
 * The ranks' partial gradients of every block's ln_1 and ln_2 are summed
 * over the group once per optimizer step (one all-reduce). USAGE errors:
 * a model other than the GPT ("--sequence-parallel applies to the GPT;
 * the mlp has no sequence"), a context that does not divide ("the GPT's
 * context of 12 tokens is not divisible by the 5 tensor-parallel ranks
 * (--sequence-parallel splits every window's tokens)"). */
tdm_status tdm_tp_check_seq(const tdm_model_spec *spec, int ranks);

/* The payload one rank hands the tensor-parallel group's communicator
 * in one optimizer step of `batch` samples, per kind of call (calls and
 * bytes, as tdm_comm_traffic_get counts them), with or without sequence
 * parallelism (seq_par; ignored but for the GPT on more than one rank).
 * Without it: tdm_tp_step_allreduces all-reduces of tdm_tp_step_bytes.
 * With it, the GPT of L blocks, C wide, on B*T tokens: 4L reduce-scatters
 * and 4L all-gathers of B*T*C floats each (so what a ring sends for them,
 * 2 * 4L * (N-1)/N of it, is what it sends for the 4L all-reduces
 * without), and one all-reduce of the LayerNorms' 4LC gradients. */
void tdm_tp_step_traffic(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                         tdm_comm_traffic *out);

/* What activation checkpointing (tdm_tp_opts.ckpt) adds to
 * tdm_tp_step_traffic's counts in one step: the forward collectives of
 * every block but the last, run again (the GPT of L blocks: 2(L-1)
 * all-reduces of B*T*C floats; sequence parallel: 2(L-1)
 * reduce-scatters and 2(L-1) - 1 all-gathers of them, block 0's ln_1
 * reading the whole embeddings); nothing for the MLP. */
void tdm_tp_recompute_traffic(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                              tdm_comm_traffic *out);

/* What the dp dimension of a dp x tp mesh shards (grad_comm's replicas). */
typedef enum tdm_tp_zero {
    TDM_TP_ZERO_NONE = 0,       /* every replica keeps its slices' whole state */
    /* ZeRO-1: replica d of D keeps the optimizer state of elements
     * [d*c, (d+1)*c) of the rank's flat slice, c = ceil(n/D) (the
     * parameters and gradients are D*c floats, the last chunk padded);
     * the gradients are reduce-scattered over grad_comm (replica d gets
     * the sum of its chunk only), it steps those and all-gathers the
     * parameters, both in place: the plain step's bits (on the shm
     * communicator), 1/D of its optimizer state, the plain all-reduce's
     * ring bytes */
    TDM_TP_ZERO_OPTIMIZER,
    /* ZeRO-2: ZeRO-1 whose gradients are sharded too. The replica keeps
     * a persistent gradient shard of c floats (1/D of ZeRO-1's D*c);
     * the whole flat gradient (D*c floats) is a buffer of the step:
     * allocated by tdm_tp_zero_grad (or the step's first backward),
     * reduce-scattered over grad_comm straight into the shard, and
     * released at once, before the levers and the optimizer step. So
     * between steps a rank holds its parameters, the gradient shard and
     * the optimizer shard; inside a step, from the first backward (or
     * the zeroing) to the reduce-scatter, the whole gradient besides
     * (the peak is ZeRO-1's plus the shard), unless bucket_bytes cuts it
     * into buckets summed during backward. The same bits and bytes as
     * ZeRO-1 (the reduce-scatter's sums are the same) */
    TDM_TP_ZERO_GRADS,
} tdm_tp_zero;

typedef struct tdm_tp_opts {
    uint64_t seed;              /* the whole model's initial parameters */
    tdm_optim_opts optim;       /* the optimizer over the rank's flat slice */
    /* Borrowed, optional: gradients summed (SUM) over it after each
     * backward: the dp dimension of a dp x tp mesh. */
    tdm_comm *grad_comm;
    /* Borrowed, optional: a communicator with comm's ranks for host
     * memory (checkpoints); needed when comm takes device memory only
     * (NCCL). NULL: comm. */
    tdm_comm *host_comm;
    /* 1: sequence parallelism (tdm_tp_check_seq); one rank has nothing
     * to split and runs as without it */
    int sequence_parallel;
    /* ZeRO-1 or 2 over grad_comm (needs one of at least 2 ranks) */
    tdm_tp_zero zero;
    /* ZeRO-2's bucket cap in bytes: > 0 cuts the flat gradient, at tensor
     * boundaries, into buckets of consecutive tensors of at least that
     * many bytes, each allocated when backward first writes it and, as
     * soon as backward has completed it (on the step's last micro-batch:
     * tdm_tp_step_scaled, tdm_tp_forward_backward_last), summed over
     * grad_comm into the owners' shards (one reduce per replica's chunk
     * it spans, rank order: the reduce-scatter's bits) and freed; so a
     * step holds the shard plus the buckets backward is filling (the
     * GPT's first, with the tied wte, all backward long) instead of the
     * whole gradient. 0: the whole gradient, reduce-scattered once after
     * backward. Without sequence parallelism (whose LayerNorm gradients
     * are summed over the group after backward) and ZeRO-2 only; else
     * ignored. */
    size_t bucket_bytes;
    /* BF16 or FP16 (models/precision.h): every linear layer's products
     * (forward, the weight gradient, the input gradient) read 16-bit
     * operands, rounded from float32 at each use, and sum in float32
     * (tdm_dev_gemm_rm_ex: oneDNN's bf16 matmul on host devices,
     * cublasGemmEx on CUDA). Unlike one device's mixed precision the
     * kept activations stay float32 (no activation memory saved) and the
     * GPT's attention products (scores, probabilities times values) stay
     * float32; master parameters, gradients, the all-reduces and the
     * optimizer are float32. FP16 wants a loss scaler (tdm_tp_levers).
     * Every rank the same (checked). FP32 (0): the plain products. */
    tdm_precision precision;
    /* 1: activation checkpointing (models/recompute.h's idea, tp's
     * units): the GPT's blocks share one set of activations and keep
     * only their outputs; backward runs each block's forward again
     * (but the last's, which the forward left in place) from its kept
     * input, its collectives included: (L-1) blocks' forward
     * collectives more per step (tdm_tp_recompute_traffic). The MLP's
     * column-parallel layers share one output buffer (each pair keeps
     * its input, the previous row layer's output); backward recomputes
     * each but the last from it: one gemm, no communication. The same
     * bits as without. 0: keep everything. USAGE for other values, and
     * for a model file with elementwise layers between its linear
     * ones. */
    int ckpt;
} tdm_tp_opts;

typedef struct tdm_tp tdm_tp;

/* Rank tdm_comm_rank(comm) of the tensor-parallel group comm (borrowed,
 * outliving the rank): plans spec (errors above), builds this rank's
 * slices of the whole model of opts->seed (each whole tensor alone on the
 * host, then cut) on dev (borrowed) and an optimizer over them, and
 * checks that every rank has
 * the same model and group size. Collective over comm. */
tdm_status tdm_tp_init(tdm_tp **out, tdm_comm *comm, tdm_device *dev, const tdm_model_spec *spec,
                       const tdm_tp_opts *opts);
void tdm_tp_free(tdm_tp *p);   /* NULL ok */

int tdm_tp_rank(const tdm_tp *p);
int tdm_tp_size(const tdm_tp *p);
tdm_optim *tdm_tp_optim(tdm_tp *p);
/* The whole model's tables (no storage; tdm_model_init_tables). */
const tdm_model *tdm_tp_tables(const tdm_tp *p);
/* The split of linear layer l (0-based), of the rank's n_layers linear
 * layers (0: the GPT). */
tdm_tp_split tdm_tp_layer_split(const tdm_tp *p, int l);
int tdm_tp_n_layers(const tdm_tp *p);
/* The rank's flat parameters and gradients (device memory) and their
 * length in elements. Under ZeRO-2 the whole flat gradient exists only
 * inside a step (tdm_tp_opts.zero): tdm_tp_grads is NULL between steps. */
float *tdm_tp_params(tdm_tp *p);
float *tdm_tp_grads(tdm_tp *p);
int64_t tdm_tp_elems(const tdm_tp *p);

/* One training step on every rank of the group (collective): x (batch,
 * in) float32 and y (batch) targets in host memory, the same on every
 * rank of the group. Zeroes the gradients, forward, softmax
 * cross-entropy with its gradient scaled by grad_scale (1/batch: the
 * mean), backward, the sum over grad_comm, the optimizer step.
 * *loss_sum (may be NULL): the sum of the per-sample losses. batch 0
 * (with grad_comm: this replica's share of a short last batch is empty;
 * the same on every rank of the group): no forward or backward, a zero
 * gradient into the sums and the step, *loss_sum 0. On failure the
 * group (and grad_comm) is aborted with the message. */
tdm_status tdm_tp_step_scaled(tdm_tp *p, const void *x, const int32_t *y, int batch,
                              float grad_scale, double *loss_sum);
/* The same without the zeroing, the sum over grad_comm nor the
 * optimizer step: forward, loss, backward (adding into the gradients).
 * Calls may follow each other (gradient accumulation); the sum over
 * grad_comm happens once, in tdm_tp_optim_step. Collective over the
 * group. */
tdm_status tdm_tp_forward_backward(tdm_tp *p, const void *x, const int32_t *y, int batch,
                                   float grad_scale, double *loss_sum);
/* The same for the step's last micro-batch (its gradients are final):
 * under ZeRO-2 with buckets (tdm_tp_opts.bucket_bytes) its backward sums
 * each bucket over grad_comm as soon as backward completes it; earlier
 * micro-batches (tdm_tp_forward_backward) accumulate locally. The same
 * bits as tdm_tp_forward_backward in either case. */
tdm_status tdm_tp_forward_backward_last(tdm_tp *p, const void *x, const int32_t *y, int batch,
                                        float grad_scale, double *loss_sum);
tdm_status tdm_tp_zero_grad(tdm_tp *p);
/* The training forwards run so far, which dropout's masks count (as a
 * model's, models/model.h); set: the next forward runs as number n (a
 * virtual shard's place in its step, --deterministic). */
int64_t tdm_tp_train_forwards(const tdm_tp *p);
void tdm_tp_set_train_forwards(tdm_tp *p, int64_t n);
/* The sum of the accumulated gradients over grad_comm (once: the dp
 * dimension's replicas' micro-batches), then the optimizer step over
 * the rank's slices. Collective over grad_comm. */
tdm_status tdm_tp_optim_step(tdm_tp *p);
/* Forward only: *loss_sum over the batch and *correct argmax predictions
 * (host y). Collective. */
tdm_status tdm_tp_eval_batch(tdm_tp *p, const void *x, const int32_t *y, int batch,
                             double *loss_sum, int64_t *correct);
/* Mean loss and accuracy over a dataset in batches of `batch`
 * (tdm_data_gather order). Collective. */
tdm_status tdm_tp_evaluate(tdm_tp *p, const tdm_dataset *d, int batch, double *loss_mean,
                           double *accuracy);

/* The whole model's state assembled on group rank root into h (host
 * arrays in the whole model's layout, tdm_tp_tables; used on root only):
 * parameters and, when h->optim is set, the optimizer's state and step
 * count: what tdm_checkpoint_save_host writes, the file every mode reads.
 * Collective (with ZeRO-1 or 2 over grad_comm too: every other replica calls
 * tdm_tp_zero_join_gather). */
tdm_status tdm_tp_gather_state(tdm_tp *p, tdm_ckpt_host *h, int root);
/* The whole model's gradient (host, whole layout) on root. Collective.
 * After a ZeRO-1 step only the replica's chunk of it is summed over the
 * dp dimension; the rest is not the sum (the replica's own gradient, or
 * the MPI backend's scratch). UNSUPPORTED under ZeRO-2 (the whole
 * gradient is not kept), on every rank alike before any collective. */
tdm_status tdm_tp_gather_grads(tdm_tp *p, float *whole, int root);
/* ZeRO-1 or 2 (tdm_tp_opts.zero), a replica other than the one that gathers
 * (which calls tdm_tp_gather_state): its part of the gathers over the dp
 * dimension that assemble each optimizer state for the checkpoint, in
 * tdm_tp_gather_state's order. Nothing without ZeRO. Collective over
 * grad_comm. */
tdm_status tdm_tp_zero_join_gather(tdm_tp *p);
/* This rank's slices of a whole model's state in h (any mode's
 * checkpoint, read by every rank): parameters and, with h->optim, the
 * optimizer state and step count. Not collective. */
tdm_status tdm_tp_load_state(tdm_tp *p, const tdm_ckpt_host *h);

/* The rank's tensors: which of the whole model's (its parameter index),
 * whether it is split (else replicated: whole on every rank), and where
 * the rank's slice lies in its flat buffers. */
typedef struct tdm_tp_tensor_info {
    int whole_index;
    int split;
    int64_t offset, n_elem;
} tdm_tp_tensor_info;
int tdm_tp_n_tensors(const tdm_tp *p);
void tdm_tp_tensor_get(const tdm_tp *p, int i, tdm_tp_tensor_info *out);

/* What one rank of `ranks` will take for `batch` samples per step,
 * before any is started (the pre-run memory check): its flat slice's
 * elements (each of parameters, gradients and every optimizer state
 * holds that many floats), its largest tensor's, and the bytes of the
 * activations and scratch it allocates (tdm_tp_stats.activations), all
 * from the set-up's own layout and allocation code, counted. The plan's
 * and tdm_tp_check_seq's USAGE errors. */
typedef struct tdm_tp_rank_footprint {
    int64_t elems, largest_elems;
    int64_t split_elems;   /* of elems, in split tensors (1/N of one device's) */
    size_t act_bytes;
    int64_t act_allocs;    /* the device allocations act_bytes comes in */
    /* with --precision bf16|fp16 (tdm_tp_opts.precision): the 16-bit
     * operand block the products grow to (bytes, before the allocator's
     * rounding), and on a host device in fp16 the float32 widening
     * buffer's elements (core/device.h's gemm_ex) */
    size_t low_bytes;
    int64_t wide_elems;
} tdm_tp_rank_footprint;
tdm_status tdm_tp_footprint(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                            tdm_tp_rank_footprint *out);
/* The same with activation checkpointing (tdm_tp_opts.ckpt): the
 * activations its shared buffers take. */
tdm_status tdm_tp_footprint_ckpt(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                                 int ckpt, tdm_tp_rank_footprint *out);

/* ZeRO-2 with buckets (tdm_tp_opts.bucket_bytes = cap_bytes > 0) over
 * reps >= 2 replicas of a group of `ranks`: the most bytes of gradient
 * buckets a rank holds at once in a step (each rounded up to the host
 * allocator's 64-byte blocks), from its backward's order of first writes
 * and completions replayed on the layout, nothing computed; what
 * tdm_tp_stats.grads_in_step measures. The step's last micro-batch only
 * (an earlier one leaves every bucket it wrote held). */
tdm_status tdm_tp_zero2_bucket_bytes(const tdm_model_spec *spec, int ranks, int reps,
                                     size_t cap_bytes, size_t *held);

/* --- the step's levers (tp/levers.c) ------------------------------------------
 * Loss scaling (fp16) and gradient clipping over the group and its
 * data-parallel replicas (docs/MEMORY.md). With a scaler the loss
 * gradient is scaled by its scale too; after the backward and the sums
 * (the sequence-parallel LayerNorms over the group, the replicas over
 * grad_comm) every rank unscales its flat gradient and checks it, and the
 * found-inf flag is ORed over comm (one all-reduce, "grad scaler found
 * inf"): a step found bad is skipped on every rank (no optimizer step,
 * no ZeRO gather) and the scale halves on all. With clip_norm > 0 (or
 * measure_norm) the global L2 norm of the whole model's gradient: each
 * rank's sum of squares of its split tensors' slices, the replicated
 * tensors (LayerNorms, embeddings, row-parallel biases, a replicated
 * last layer: the same bits on every rank of the group) counted on the
 * group's rank 0 only, replica 0 of the dp dimension only (the replicas
 * hold the same sum; under ZeRO-1 and 2, whose reduce-scatter leaves each
 * replica its own chunk's sum, every replica its chunk), summed by one
 * all-reduce of one double over comm ("tp clip grad norm"), then torch's
 * clip_grad_norm_ of the rank's whole flat gradient (models/clip.h;
 * ZeRO-2: of its gradient shard).
 * comm: every rank of the job (the group and its replicas) on the device
 * memory of the rank's device, each calling it once per step; NULL: the
 * group's communicator (only without replicas). Every rank must set the
 * same levers. Applied by
 * tdm_tp_step_scaled and tdm_tp_optim_step (the loss scale by
 * tdm_tp_forward_backward too). */
struct tdm_grad_scaler;
typedef struct tdm_tp_levers {
    struct tdm_grad_scaler *scaler;   /* borrowed; NULL: no loss scaling */
    double clip_norm;                 /* > 0: clip to it */
    int measure_norm;                 /* 1: the norm without clipping */
    tdm_comm *comm;                   /* borrowed; NULL: the group's */
    int replica;                      /* the rank's replica: only replica 0's squares count */
    /* Test hook, after the sums, before the levers read the gradients (a
     * planted inf): the rank's flat gradient, n_elem floats on dev
     * (ZeRO-2: its summed chunk, the shard's elements). May be NULL. */
    void (*after_backward)(void *ctx, float *grads, int64_t n_elem, tdm_device *dev);
    void *ctx;
} tdm_tp_levers;
/* Sets (or with NULL clears) the levers of the following steps; copied. */
void tdm_tp_set_levers(tdm_tp *p, const tdm_tp_levers *l);

/* --- what a step did ---------------------------------------------------------- */

/* What the steps did and what the rank holds. */
typedef struct tdm_tp_phases {
    /* fwd_allreduce, bwd_allreduce: the group's collectives inside the
     * step (all-reduces, or reduce-scatters and all-gathers under
     * sequence parallelism); grad_sync: the gradient sums after backward
     * (the sequence-parallel LayerNorms' over the group, the dp
     * dimension's) */
    double forward, fwd_allreduce, loss, backward, bwd_allreduce, grad_sync, step, total;
} tdm_tp_phases;                /* ms, summed over the steps */
typedef struct tdm_tp_stats {
    int64_t steps;
    tdm_tp_phases sum, last;     /* over the steps, and the last one's */
    /* elements of the rank's split and replicated tensors, and of one
     * device's split tensors (the whole model's) */
    int64_t split_elems, replicated_elems, whole_split_elems;
    /* bytes the device's allocator handed out for the rank's parameters,
     * gradients and optimizer state (measured around their allocation;
     * 0 where the device keeps no accounting) */
    size_t state_alloc_bytes;
    /* bytes of each the rank keeps between steps (ZeRO-2: grads is the
     * gradient shard's) */
    size_t params, grads, optimizer;
    /* ZeRO-2: the whole flat gradient's bytes, held only inside a step
     * (tdm_tp_opts.zero), or with buckets (tdm_tp_opts.bucket_bytes) the
     * most bytes of them held at once so far (measured); 0 otherwise
     * (grads holds the whole gradient) */
    size_t grads_in_step;
    size_t activations;                /* bytes of the forward's kept outputs and scratch */
    size_t act_alloc_bytes;            /* and what the allocator handed out for them
                                          (measured; 0 where it keeps no accounting) */
    int64_t act_allocs;                /* the allocations they came in (counted) */
    /* the levers (tdm_tp_set_levers) */
    double last_norm;           /* the last step's global gradient norm (0: not measured) */
    int last_skipped;           /* 1: the last step was skipped on every rank (found inf) */
    int64_t skipped;            /* steps skipped so far */
} tdm_tp_stats;
void tdm_tp_get_stats(const tdm_tp *p, tdm_tp_stats *out);

#ifdef __cplusplus
}
#endif

#endif
