/* tools/rank_pptp.h: the pipeline's stages made tensor-parallel (--mode
 * pp --mesh dp=D,pp=S,tp=N; tools/rank_pp.c's table calls these). The
 * designs do not include each other: a stage is still pp/'s stage model,
 * built from a narrow spec (each column-parallel layer's output width
 * divided by N), whose linear layers hold exactly this tensor-parallel
 * rank's slices (Megatron's layout, as tp/tp.h lays out a whole MLP); the
 * partial sums of its row-parallel products (forward) and of its
 * column-parallel input gradients (backward) are summed over the stage's
 * tp group through models/'s partial-sum callback
 * (tdm_model_set_partial_sums). Within a stage the linear layers pair up
 * from its first one, column then row; an odd last layer of a stage is
 * replicated. A stage's input and output are replicated on its N ranks,
 * so tp rank t of stage s sends its copy to tp rank t of stage s + 1:
 * each tp index is a pipeline of its own (the mesh's pp group), with no
 * collective on the activations between stages, and the loss is computed
 * alike by the last stage's N ranks.
 *
 * State moves between the whole model's layout (checkpoints, the initial
 * parameters of the seed) and the narrow model's by slicing: a column
 * layer's rows, a row layer's weight columns, the rest whole.
 *
 * The GPT's stages (a narrow spec of tp_ranks N, models/model.h: its
 * blocks' heads and c_fc rows split, Megatron's layout as tp/gpt.c lays
 * out a whole GPT): the embeddings, the LayerNorms and the tied head are
 * replicated on the N ranks of their stage and computed on the same bits
 * by each (their inputs are the all-reduced stream), so tp rank t's
 * pipeline sums its own tied-embedding shares (pp/'s exchange between
 * the first and the last stage, within tp index t) and the N copies stay
 * equal without communication. A model file's stages pair their linear
 * layers as the MLP's, with elementwise layers (dropout too: its mask
 * the whole vector's columns, tdm_model_set_partial_rank) inside a pair
 * and any layer outside one, run whole on every rank. The CNN's pipeline
 * of tensor-parallel stages is not built: a one-line usage error. */
#ifndef TDM_TOOLS_RANK_PPTP_H
#define TDM_TOOLS_RANK_PPTP_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "pp/pp.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_pptp_cut {
    TDM_PPTP_REPLICATED = 0,
    TDM_PPTP_COLUMN,             /* output features split */
    TDM_PPTP_ROW,                /* input features split: the product summed over the group */
} tdm_pptp_cut;

/* The most pipeline layers a plan cuts (a model file's). */
#define TDM_PPTP_MAX_LAYERS TDM_MODEL_MAX_OPS

/* The plan: spec (an MLP, a GPT or a model file) cut by first[0..S)
 * into stages, each stage's layers on N ranks: cut[l] per pipeline layer
 * (room for TDM_PPTP_MAX_LAYERS; all REPLICATED for the GPT, whose
 * narrow spec says its split) and *narrow, spec with each column layer's
 * output width divided by N (the GPT: tp_ranks N). A model file pairs as
 * tdm_model_spec_tp_stages says (models/stage.h). One-line USAGE
 * errors: the CNN, a width N does not divide ("stage 1: fc3's output
 * width 10 (fc4's input) is not divisible by the 4 tensor-parallel
 * ranks"), heads N does not divide, a model file's layer inside a pair
 * named by its line. */
tdm_status tdm_pptp_plan(const tdm_model_spec *spec, int S, const int *first, int N,
                         tdm_pptp_cut *cut, tdm_model_spec *narrow);

/* The plan's payload of stage s's partial sums in one step of `rows`
 * samples of this replica cut into micro-batches of micro_size (the
 * last shorter): *calls all-reduces of *bytes in all, per rank of the
 * stage's tp group. Per micro-batch of b samples: the GPT's 4 per block
 * of the stage (forward after attn.c_proj and mlp.c_proj, backward
 * c_attn's and c_fc's input gradients) of b*T*C floats each; the MLP's
 * and a model file's one per row layer (b x its output width) and one
 * per column layer but the model's first (b x its input width). 0 for
 * one rank. The plan's USAGE errors. */
tdm_status tdm_pptp_step_plan(const tdm_model_spec *spec, int S, const int *first, int N, int s,
                              int rows, int micro_size, int64_t *calls, int64_t *bytes);

/* A tensor-parallel stage (r of N in the group tp: device memory through
 * tdev, host memory through thost, both borrowed). */
typedef struct tdm_pptp {
    int N, t;
    tdm_comm *tdev, *thost;
    tdm_comm *phost;             /* the pipeline's host communicator (borrowed; the caller's) */
    tdm_device *dev;
    tdm_model_spec narrow;
    tdm_pptp_cut cut[TDM_PPTP_MAX_LAYERS];
    tdm_model *whole, *slim;     /* the tables of the whole and the narrow model */
    int replica;                 /* the rank's replica (the dp coordinate) */
    int64_t sums;                /* partial sums all-reduced, and their bytes */
    int64_t seq_calls;           /* sequence parallel: all-gathers and reduce-scatters, */
    int64_t seq_bytes;           /* their payload bytes (n floats each), */
    double seq_ms;               /* and their time */
    int64_t sum_bytes;
    double sum_ms;
    size_t setup_host_bytes;     /* tdm_pptp_attach's host memory at its most (bytes) */
} tdm_pptp;

/* The plan over spec and the two models' tables. */
tdm_status tdm_pptp_init(tdm_pptp *q, const tdm_model_spec *spec, int S, const int *first,
                         int N, int t, tdm_comm *tdev, tdm_comm *thost, tdm_device *dev);
void tdm_pptp_fini(tdm_pptp *q);
/* Installs the partial sums on p's stage model and gives it this rank's
 * slices of the whole model's initial parameters from seed, built for
 * the stage's layers only (in host memory: q->setup_host_bytes). Collective
 * over nothing: every rank computes the same whole layers. */
tdm_status tdm_pptp_attach(tdm_pptp *q, tdm_pp *p, uint64_t seed);

/* whole (the whole model's layout) into narrow (the narrow model's), as
 * tensor-parallel rank t holds it; and back (every tensor's part of rank
 * t into whole: a replicated tensor from any rank is all of it). */
void tdm_pptp_slice(const tdm_pptp *q, int t, const float *whole, float *narrow);
void tdm_pptp_unslice(const tdm_pptp *q, int t, const float *narrow, float *whole);

/* The whole model's state of this replica on its root (stage 0, tp rank
 * 0: root 1 there; h allocated there in the whole layout, h->optim set
 * when opt is given): gathered over each tp index's pipeline (pp/), then
 * over stage 0's tp group. Collective over the replica. */
tdm_status tdm_pptp_gather(tdm_pptp *q, tdm_pp *p, const tdm_optim *opt, tdm_ckpt_host *h,
                           int root);
/* The memory levers on a tensor-parallel stage (tools/rank_pptp_levers.c).
 * The global gradient norm's share of this rank (pp/pp.h's
 * tdm_pp_levers.sumsq; ctx the tdm_pptp): the sum of squares of the
 * stage model m's gradient over its split tensors (every rank of the
 * group holds other elements of them) and, on tp rank 0 alone, its
 * replicated ones (the same bits on every rank of the group: their
 * inputs are the all-reduced stream), of replica 0 alone (the replicas
 * hold the same summed gradient); the GPT's tied copy on the last stage
 * is counted on the first stage's wte, as pp/ counts it. Runs of
 * adjacent counted tensors are summed as one buffer (models/clip.h's
 * fixed order). */
tdm_status tdm_pptp_sumsq(void *ctx, tdm_model *m, double *sq);

/* Sequence parallelism on a GPT stage (narrow.tp_seq, --sequence-parallel;
 * tools/rank_pptp_seq.c): models/' collectives along the tokens
 * (tdm_model_seq_fn; ctx the tdm_pptp) as an all-gather or a
 * reduce-scatter over the stage's group on device memory, labelled in the
 * flight recorder with the layer. Between stages each tp rank sends its
 * own rows of the stream to the same tp rank of the next stage (1/N of
 * the bytes without it). USAGE errors of the check: a model other than
 * the built-in GPT, a context N does not divide, a stage without a
 * block. */
tdm_status tdm_pptp_seq(void *ctx, tdm_model_seq_op op, const float *src, float *dst, int64_t n,
                        int layer);
tdm_status tdm_pptp_check_seq(const tdm_model_spec *spec, int S, const int *first, int N);
/* The theoretical volume of stage s's sequence-parallel collectives in
 * one step of `rows` windows of this replica cut into micro-batches of
 * micro_size (as tdm_pptp_step_plan): per micro-batch of b windows,
 * n = b*T*C floats each, per block of the stage 2 all-gathers (ln_1's
 * and ln_2's outputs; the first stage's block 0 normalises the whole
 * embeddings: 1) and 2 reduce-scatters (the row-parallel products) in
 * forward, 2 all-gathers (the stream's gradient before each row-parallel
 * layer) and 2 reduce-scatters (the column-parallel input gradients) in
 * backward; the first stage 1 all-gather more (the embeddings'
 * gradient); the last stage 1 more (the stream before ln_f) and 1 fewer
 * (its top block's output gradient is whole already): *calls of
 * *bytes (n * 4 bytes each, as tdm_comm_traffic_get counts them); and the
 * LayerNorms' partial gradients: *ln_calls all-reduces (2 per block, once
 * per step) of *ln_bytes (2C floats each). */
void tdm_pptp_seq_plan(const tdm_model_spec *spec, int S, const int *first, int s, int rows,
                       int micro_size, int64_t *calls, int64_t *bytes, int64_t *ln_calls,
                       int64_t *ln_bytes);

/* This rank's part of a whole model's state in h (any mode's file):
 * parameters and, with h->optim, the optimizer state and steps. Local. */
tdm_status tdm_pptp_load(tdm_pptp *q, tdm_pp *p, const tdm_ckpt_host *h);

#ifdef __cplusplus
}
#endif

#endif
