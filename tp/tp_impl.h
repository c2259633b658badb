/* tp/tp_impl.h: the inside of a tensor-parallel rank, shared by tp/tp.c
 * (the plan, set-up, slicing to and from the whole model's layout) and
 * tp/step.c (forward, backward, the step, evaluation). Not a public
 * header: users include tp/tp.h. */
#ifndef TDM_TP_TP_IMPL_H
#define TDM_TP_TP_IMPL_H

#include "tp/tp.h"

/* An elementwise layer of a model file between (or before) its linear
 * layers (tp/seq.c): an activation, or dropout with the model's
 * rank-independent mask; out: its output (cap rows of the layer's width
 * on this rank), NULL before the first linear layer (run in place). */
#define TDM_TP_MAX_POST 8
typedef struct tdm_tp_post {
    tdm_model_op_kind kind;     /* TDM_MODEL_OP_DROPOUT or an activation */
    tdm_act act;
    float p;
    int op;                     /* its index in the spec (dropout's mask) */
    float *out;
} tdm_tp_post;

/* The linear layers of the MLP or of a model file of linear layers and
 * elementwise layers (tp/seq.c): widths (input first), a relu fused
 * into linear l, and the elementwise layers before the first linear
 * (post[0]) and after linear l (post[l + 1]); line: the file's line of
 * each linear layer (0: the built-in MLP). */
typedef struct tdm_tp_shape {
    int ndims, dims[TDM_MODEL_MAX_DIMS];
    int relu[TDM_MODEL_MAX_DIMS], line[TDM_MODEL_MAX_DIMS];
    int n_post[TDM_MODEL_MAX_DIMS];
    tdm_tp_post post[TDM_MODEL_MAX_DIMS][TDM_TP_MAX_POST];
    int dropout;                /* any dropout */
} tdm_tp_shape;

/* spec's shape for the MLP path; USAGE naming the file's line for a
 * layer the tensor-parallel MLP path cannot run (tp/seq.c). */
tdm_status tdm_tp_shape_of(const tdm_model_spec *spec, tdm_tp_shape *out);

/* One linear layer as this rank holds it. */
typedef struct tdm_tp_layer {
    tdm_tp_split split;
    int in, out;                /* the whole layer's widths */
    int lin, lout;              /* this rank's: the gemm's k and n */
    int relu;                   /* fused relu on the (all-reduced) output */
    int wp, bp;                 /* the whole model's parameter indices */
    int64_t w_off, b_off;       /* in the rank's flat buffers */
    int64_t b_elems;            /* lout (column) or out */
    float *act;                 /* forward output (cap, lout): kept for backward */
    const float *in_act;        /* the input of the last forward (borrowed) */
} tdm_tp_layer;

/* How one tensor of the whole model is cut (tdm_tp_slice): whole is
 * (rows, cols) row-major, seen as `parts` blocks of rows/parts rows
 * (c_attn's q, k and v thirds). ROWS: rank r takes rows
 * [r*k, (r+1)*k) of each block, k = rows/parts/N; COLS: columns
 * [r*cols/N, (r+1)*cols/N) of every row; REPL: all of it. */
typedef enum tdm_tp_cut { TDM_TP_CUT_REPL = 0, TDM_TP_CUT_ROWS, TDM_TP_CUT_COLS } tdm_tp_cut;
typedef struct tdm_tp_tensor {
    int wp;                     /* the whole model's parameter index */
    tdm_tp_cut cut;
    int parts;
    int64_t rows, cols;         /* the whole tensor's */
    int64_t off, n_elem;        /* the rank's slice in its flat buffers */
} tdm_tp_tensor;

#define TDM_TP_MAX_TENSORS 512

typedef struct tdm_tp_gpt tdm_tp_gpt;   /* tp/gpt.c */

/* ZeRO-2's gradient bucket: flat elements [lo, hi) of the rank's slice,
 * buf (hi - lo floats on dev) while backward fills it (tp/buckets.c). */
typedef struct tdm_tp_bucket {
    int64_t lo, hi;
    float *buf;
    int held;                   /* buf allocated (or, without a device, counted) */
} tdm_tp_bucket;

struct tdm_tp {
    tdm_comm *comm;             /* borrowed: the tensor-parallel group */
    tdm_comm *hcomm;            /* borrowed: host-memory collectives */
    tdm_comm *gcomm;            /* borrowed, may be NULL: gradients summed over it */
    tdm_device *dev;            /* borrowed */
    int rank, size;
    int seq_par;                /* sequence parallelism (the GPT, more than one rank) */
    tdm_model_spec spec;
    tdm_model *tables;          /* the whole model's tables, no storage */
    int n_layers;                /* the MLP's linear layers */
    tdm_tp_layer layers[TDM_MODEL_MAX_DIMS];
    tdm_tp_shape shape;          /* the MLP path's widths and elementwise layers */
    uint64_t seed;               /* dropout's masks: the model's seed, */
    int64_t n_train_fwd;         /* training forwards run, */
    uint64_t *drop_keys;         /* the current batch's keys (host, cap) */
    tdm_tp_gpt *gpt;             /* the GPT's blocks and activations; NULL: an MLP */
    int n_tensors;
    tdm_tp_tensor tensors[TDM_TP_MAX_TENSORS];
    float *params, *grads;      /* flat, n_elem each (tdm_tp_flat_alloc held), on dev */
    int64_t n_elem;
    tdm_optim *opt;             /* over n_elem, or (ZeRO) the replica's zchunk */
    /* ZeRO-1 or 2 over gcomm: replica zrep of zreps holds the optimizer state
     * of elements [zrep*zchunk, ...) of the flat slice; params and grads
     * hold zreps * zchunk floats (the last chunk padded with fewer than
     * zreps zeros), so that the gradients' reduce-scatter and the
     * parameters' all-gather run in place */
    tdm_tp_zero zero;
    int zrep, zreps;
    int64_t zchunk;
    /* ZeRO-2: the replica's summed chunk of the gradients (zchunk floats,
     * kept); p->grads is then a buffer of the step, NULL between steps
     * (tdm_tp_grads_take, tdm_tp_grads_release) */
    float *gshard;
    /* ZeRO-2 with buckets (tdm_tp_opts.bucket_bytes): the flat gradient
     * as buckets in flat order instead of p->grads (NULL throughout);
     * buckets [0, next_bucket) not yet summed this step; flush_bwd: the
     * running backward's gradients are the step's final ones */
    tdm_tp_bucket *buckets;
    int n_buckets, next_bucket, flush_bwd;
    size_t zlive;                /* the bytes of the buckets allocated now */
    /* activations and scratch for cap samples */
    int cap, max_width;
    float *x, *ones, *dbuf[2];
    int32_t *y;
    float *host_logits;         /* evaluation's argmax (host) */
    tdm_tp_levers lev;           /* the step's levers (tp/levers.c) */
    tdm_precision prec;          /* the linear layers' products (tdm_tp_opts.precision) */
    int ckpt;                    /* activation checkpointing (tdm_tp_opts.ckpt) */
    float *ckpt_act;             /* the MLP's: the column layers' shared output */
    int ckpt_live;               /* and the column layer whose output it holds */
    void *low;                   /* their 16-bit operands (dev, low_bytes) */
    size_t low_bytes;
    tdm_tp_stats stats;
    int failed;                 /* the group was aborted */
};

/* The local slice of a whole-layout host array (the whole model's flat
 * layout) into a rank-layout host array, for rank r (tp/tp.c). */
void tdm_tp_slice(const tdm_tp *p, int r, const float *whole, float *local);
/* The whole layout from the N ranks' local arrays (size * n_elem). */
void tdm_tp_unslice(const tdm_tp *p, const float *locals, float *whole);

/* Appends tensor wp's cut to p->tensors at the end of the rank's flat
 * layout (p->n_elem grows), counting it in the stats (tp/tp.c). */
void tdm_tp_add_tensor(tdm_tp *p, int wp, tdm_tp_cut cut, int parts, int64_t rows, int64_t cols);

/* The GPT (tp/gpt.c): its plan's checks (USAGE), its layout into p's
 * tensors, its activations for B windows, forward (logits of the
 * windows at p->x as tokens), backward from the logits' gradient at
 * dlogits, and freeing. */
tdm_status tdm_tp_gpt_plan(const tdm_model_spec *spec, int ranks);
tdm_status tdm_tp_gpt_layout(tdm_tp *p);
tdm_status tdm_tp_gpt_reserve(tdm_tp *p, int B);
tdm_status tdm_tp_gpt_forward(tdm_tp *p, int B, const float **logits, double *ar_ms);
tdm_status tdm_tp_gpt_backward(tdm_tp *p, int B, const float *dlogits, double *ar_ms);
float *tdm_tp_gpt_dlogits(tdm_tp *p);
/* Sequence parallelism: the ranks' partial gradients of every block's
 * LayerNorms summed over the group (one all-reduce, in place; nothing
 * without it). Its time added to *ms. */
tdm_status tdm_tp_gpt_sum_ln(tdm_tp *p, double *ms);
void tdm_tp_gpt_free(tdm_tp *p);
/* buf (n floats on the device) summed over the group, in place (tp/step.c). */
tdm_status tdm_tp_allreduce(tdm_tp *p, float *buf, int64_t n, const char *what, int l);

/* The elementwise layers after linear l (post[l + 1]) forward on its
 * output at *cur (B rows of width w, this rank's columns [j0, j0 + w)):
 * *cur becomes the last one's output; slot 0 (before the first linear)
 * runs in place on the input. train: dropout drops (else the identity).
 * Backward: dout (B, w) from after them to before them, in place; in0
 * the first one's input (tp/seq.c). */
tdm_status tdm_tp_post_forward(tdm_tp *p, int slot, int B, int w, int64_t j0, int train,
                               const float **cur);
tdm_status tdm_tp_post_backward(tdm_tp *p, int slot, int B, int w, int64_t j0,
                                const float *in0, float *dout);
/* Dropout's keys of the B samples at host x, one more training forward
 * counted (nothing without dropout; tp/seq.c). */
tdm_status tdm_tp_drop_keys(tdm_tp *p, const void *x, int B);

/* Activations and scratch for B samples (grown, never shrunk; tp/tp.c). */
tdm_status tdm_tp_reserve(tdm_tp *p, int B);

/* ZeRO-2: the whole flat gradient for the step (allocated if absent,
 * zeroed either way), and its release after the reduce-scatter (tp/tp.c);
 * without ZeRO-2 take zeroes p->grads and release does nothing. */
tdm_status tdm_tp_grads_take(tdm_tp *p);
void tdm_tp_grads_release(tdm_tp *p);
/* The gradient the levers and the optimizer read after the sums: the
 * whole flat one (n_elem floats at *g, element 0 of the slice at *g),
 * or under ZeRO-2 the shard (*n = its k elements; element lo of the
 * slice at *g; tdm_tp_zero_range). */
void tdm_tp_grads_summed(tdm_tp *p, float **g, int64_t *n);

/* ZeRO-2's buckets (tp/buckets.c): the table for a cap of cap_bytes;
 * the address of flat gradient element off for backward to add into
 * (p->grads + off without buckets; else its bucket's, allocated zeroed
 * at first use); every element from `from` on is final: the buckets
 * wholly past it summed into the owners' shards and freed (when
 * flush_bwd); the rest of the step's buckets summed (tdm_tp_sync);
 * the live buckets zeroed (tdm_tp_zero_grad); freeing. */
tdm_status tdm_tp_buckets_init(tdm_tp *p, size_t cap_bytes);
tdm_status tdm_tp_grad_at(tdm_tp *p, int64_t off, float **g);
tdm_status tdm_tp_grads_done(tdm_tp *p, int64_t from);
tdm_status tdm_tp_buckets_flush(tdm_tp *p);
tdm_status tdm_tp_buckets_zero(tdm_tp *p);
void tdm_tp_buckets_free(tdm_tp *p);
/* A rank's layout (tensors, n_elem) without a device, communicators or
 * storage (tdm_tp_footprint_ckpt, tdm_tp_zero2_bucket_bytes), and its
 * freeing (tp/tp.c). Without a device the bucket functions count the
 * bytes (tdm_tp_stats.grads_in_step) instead of allocating and summing;
 * tdm_tp_grad_at gives NULL. */
tdm_status tdm_tp_dry_new(const tdm_model_spec *spec, int ranks, int seq_par, int ckpt,
                          tdm_tp **out);
void tdm_tp_dry_free(tdm_tp *p);
/* The GPT's backward's calls of tdm_tp_grad_at and tdm_tp_grads_done,
 * in its order, and nothing else (tp/gpt.c). */
tdm_status tdm_tp_gpt_grads_replay(tdm_tp *p);

/* ZeRO-1 and 2: the replica's elements [*lo, *lo + *k) of the flat slice. */
void tdm_tp_zero_range(const tdm_tp *p, int64_t *lo, int64_t *k);
/* The floats params and grads hold: n_elem, or (ZeRO) zreps * zchunk. */
int64_t tdm_tp_flat_alloc(const tdm_tp *p);

/* tp/levers.c: what the loss gradient is multiplied by besides
 * grad_scale (the loss scale); after the sums: unscale, found-inf over
 * the job, the norm and clipping (*skip: the optimizer step is to be
 * skipped on every rank); after the (possibly skipped) step: the
 * scaler's update and the counts. */
float tdm_tp_loss_scale(const tdm_tp *p);
/* C (m, n) = alpha op(A) op(B) + beta C, row-major as tdm_dev_gemm_rm:
 * in FP32 that very call; in BF16/FP16 A and B rounded into p->low and
 * multiplied with float32 sums (tdm_dev_gemm_rm_ex). */
tdm_status tdm_tp_gemm(tdm_tp *p, tdm_trans ta, tdm_trans tb, int m, int n, int k, float alpha,
                       const float *a, const float *b, float beta, float *c);
/* models/layers_gpt.h's linear layer through tdm_tp_gemm (FP32: its very
 * calls); the bias gradient stays a float32 product. */
tdm_status tdm_tp_linear_fwd(tdm_tp *p, const float *x, const float *w, const float *b,
                             int64_t N, int in, int out, int accumulate, float *y);
tdm_status tdm_tp_linear_bwd(tdm_tp *p, const float *x, const float *w, const float *dy,
                             int64_t N, int in, int out, float *dw, float *db, float *dx);
tdm_status tdm_tp_levers_apply(tdm_tp *p, int *skip);
void tdm_tp_levers_done(tdm_tp *p, int skipped);
/* The footprint of the 16-bit products (tdm_tp_footprint_ckpt): the
 * largest p->low a product of m x k by k x n needs (bytes of 16-bit
 * elements, as tdm_tp_gemm sizes it) and the largest pair of operands a
 * host device widens to float32 for fp16 (elements), grown by one
 * product; by one linear layer's forward and backward (dx: its input
 * gradient too); the GPT's (tp/gpt.c). */
typedef struct tdm_tp_low_max {
    size_t bytes;
    int64_t wide;
} tdm_tp_low_max;
void tdm_tp_low_note(tdm_tp_low_max *x, int64_t m, int64_t n, int64_t k);
void tdm_tp_linear_note(tdm_tp_low_max *x, int64_t N, int in, int out, int dx);
void tdm_tp_gpt_low(const tdm_tp *p, int B, tdm_tp_low_max *x);

/* Aborts the group (and grad_comm) with the current message once;
 * returns st (tp/step.c). */
tdm_status tdm_tp_fail(tdm_tp *p, tdm_status st);

#endif
