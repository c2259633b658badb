/* models/model_impl.h: the inside of a tdm_model, shared by the files
 * that build models: models/model.c (the layer graph of the MLP and CNN,
 * the flat buffers, the public accessors), models/layers.c (those
 * layers' forward and backward) and models/gpt.c (the GPT,
 * which brings its own forward and backward through tdm_model_vt).
 * Not a public header: nothing outside models/ includes it. */
#ifndef TDM_MODELS_MODEL_IMPL_H
#define TDM_MODELS_MODEL_IMPL_H

#include "models/model.h"
#include "models/precision.h"
#include "models/stage.h"

/* A GPT with L blocks has 12 L + 4 parameter tensors and 6 L + 3 logical
 * layers (one per group of parameters backward finishes together). */
#define TDM_MODEL_MAX_LAYERS 288
#define TDM_MODEL_MAX_TENSORS 512

typedef enum tdm_layer_kind {
    TDM_LAYER_LINEAR = 0,
    TDM_LAYER_CONV,
    TDM_LAYER_BN,
    TDM_LAYER_MAXPOOL,
    TDM_LAYER_FLATTEN,   /* CNHW -> (N, C*H*W) */
    TDM_LAYER_TO_CNHW,   /* (N, C, H, W) input -> CNHW */
    TDM_LAYER_GROUP,     /* a model with its own vt: only names a parameter range */
    /* model files and the C builder (models/builder.c, models/layers_seq.c) */
    TDM_LAYER_ACT,       /* elementwise relu, gelu, tanh or sigmoid (l->act) */
    TDM_LAYER_AVGPOOL,   /* k x kw windows at stride k, CNHW */
    TDM_LAYER_RES,       /* out = previous layer's out + (projected) output of layer skip */
    TDM_LAYER_DROPOUT,   /* training: x * mask / (1 - p), the mask keyed on each sample */
    TDM_LAYER_LN,        /* layernorm of each sample's c features; its output buffer holds
                            B means and B rstds after the B x c values */
} tdm_layer_kind;

typedef struct tdm_layer {
    tdm_layer_kind kind;
    int p0, np;             /* parameter tensors [p0, p0+np) */
    int b0, nb;             /* buffer tensors */
    int relu;               /* fused relu on the output */
    int c, h, w;            /* input shape per sample (linear: c = in features) */
    int oc, oh, ow;         /* output shape per sample (linear: oc = out features) */
    int k, stride, pad;     /* conv / pool */
    int kw;                 /* avgpool: window width (k: its height) */
    tdm_act act;            /* TDM_LAYER_ACT */
    /* TDM_LAYER_RES: c, h, w is the block input's shape (layer skip's
     * output; -1: the model's input), in_elems = out_elems the block's
     * output; proj: a 1x1 conv of stride `stride` (images: weight only)
     * (k = 1) or a linear layer (features, k = 0: weight, bias) on the skip path */
    int skip, proj;
    int64_t skip_elems;
    float *skipg;           /* backward: the skip path's input gradient (scratch) */
    float p;                /* TDM_LAYER_DROPOUT: drop probability */
    int op;                 /* a model file's layer: its op's index in the spec (dropout:
                               keys its mask) */
    int64_t j0;             /* TDM_LAYER_DROPOUT on a column-parallel slice: where its
                               values start in the whole vector (the mask's columns) */
    int64_t in_elems, out_elems; /* per sample */
    tdm_model_partial partial;   /* tensor parallelism's partial sums (linear layers) */
    int block;              /* tdm_model_layer_block */
    int line;               /* model file line of its op (residual: where the block opens) */
    /* activations (capacity m->cap samples) */
    float *out;
    int chunk;              /* conv: images per chunk (tdm_model_set_conv_chunk) */
    int32_t *argmax;        /* maxpool */
    float *mean, *var, *invstd; /* bn, per channel */
    const float *in;        /* input of the last forward (borrowed) */
    /* the memory levers (models/precision.c, models/recompute.c) */
    int unit;               /* checkpoint unit (tdm_model_layer_unit), -1: none */
    int seg_last;           /* 1: the last layer of its checkpoint segment (keeps its output) */
    const void *in16;       /* 16-bit precisions: the input as kept (borrowed) */
    void *out16;            /* 16-bit precisions: the output as kept (not the last layer's) */
} tdm_layer;

struct tdm_act_layout;   /* models/recompute.c's, below */

/* What a model kind that is not a list of model.c's layers supplies
 * (the GPT). model.c keeps the tables, flat buffers, gradient storage,
 * hook and training flag, and calls these for the rest. */
typedef struct tdm_model_vt {
    /* Parameter tensor i's initial values on the host (p: its n_elem
     * floats, zeroed); m may be tables only. */
    void (*init_param)(const tdm_model *m, uint64_t seed, int i, float *p);
    /* After tdm_model_forward's argument checks, with m->batch = 0. */
    tdm_status (*forward)(tdm_model *m, const void *x, int batch, const float **logits);
    /* After tdm_model_backward's checks: adds into the gradients and calls
     * the grad-ready hook itself. */
    tdm_status (*backward)(tdm_model *m, const float *dlogits);
    const float *(*last_logits)(const tdm_model *m);
    void (*gemm_flops)(const tdm_model *m, double *fwd, double *bwd);
    /* Frees every activation set and the shared scratch (and zeroes
     * m->cap, m->act_bytes). */
    void (*free_activations)(tdm_model *m);
    void (*free_ext)(tdm_model *m);           /* m->ext itself */
    /* Makes set k (allocated as needed, empty) the one the next forward
     * writes and the next backward reads (models/stage.c keeps m->batch,
     * m->cap and m->set_bytes per set around it). */
    tdm_status (*select_set)(tdm_model *m, int k);
    /* Bytes of every activation set, and of the shared scratch. */
    void (*act_bytes)(const tdm_model *m, size_t *sets, size_t *scratch);
    /* The buffers of one activation set and of the shared scratch for
     * `batch` (models/recompute.c's layout; what the planner sums). */
    void (*layout)(tdm_model *m, int batch, struct tdm_act_layout *set,
                   struct tdm_act_layout *scratch);
} tdm_model_vt;

/* A model is pipeline layers [lo, hi) of its spec's n (models/stage.h);
 * the whole model is [0, n). Fixed when it is built. */
typedef struct tdm_model_stage {
    int lo, hi, n;
    int p_base;                 /* the full model's index of tensor 0 */
    int n_slice;                /* tensors of the slice of the full table; */
    int tied;                   /* then the tied copy's index (-1: none), */
    int tied_source;            /* a copy of the full model's tensor tied_source */
    int64_t tied_offset;        /* which starts there in the full flat buffer */
    int64_t elem_base, slice_elems;    /* the slice in the full flat parameter buffer */
    int b_base;                 /* the full model's index of buffer 0 */
    int64_t buf_base;           /* and where the buffers start in its buffer of buffers */
    int input_grad;             /* backward computes the input's gradient (lo > 0) */
} tdm_model_stage;

struct tdm_model {
    tdm_model_spec spec;
    tdm_model_stage stage;
    tdm_device *dev;        /* borrowed; NULL in a skeleton (models/plan.c) */
    tdm_device_kind dev_kind;  /* the device's kind and threads (a skeleton's: as planned) */
    int dev_threads;
    const tdm_model_vt *vt; /* NULL: model.c's layers */
    void *ext;              /* the vt's state */
    int n_layers;
    tdm_layer layers[TDM_MODEL_MAX_LAYERS];
    int n_params, n_buffers;
    tdm_tensor_info params_info[TDM_MODEL_MAX_TENSORS];
    tdm_tensor_info buffers_info[TDM_MODEL_MAX_TENSORS];
    int64_t param_elems, buffer_elems;
    float *params, *grads, *buffers;
    float *grads_owned;     /* NULL while grads are borrowed */
    int train;
    /* dropout (models/layers_seq.c): the init seed, training forwards so
     * far, and the last training forward's per-sample keys (host) */
    uint64_t seed;
    int64_t n_train_fwd;
    uint64_t *drop_keys;
    int drop_cap;
    int bwd_stop;           /* backward runs layers n_layers-1 .. bwd_stop */
    tdm_grad_ready_fn hook;
    void *hook_ctx;
    tdm_param_use_fn use_hook;
    void *use_ctx;
    /* per-tensor views (NULL: the flat buffer); see tdm_model_set_param_view */
    float *pview[TDM_MODEL_MAX_TENSORS];
    float *gview[TDM_MODEL_MAX_TENSORS];
    int released;           /* tdm_model_release_storage: params and grads_owned freed */
    tdm_model_allsum_fn sync_bn;   /* SyncBatchNorm: sums batch statistics over replicas */
    void *sync_bn_ctx;
    tdm_model_partial_fn partial;  /* tensor parallelism: sums a layer's partial sums */
    void *partial_ctx;
    int partial_rank;              /* the tensor-parallel rank (tdm_model_set_partial_rank) */
    tdm_model_seq_fn seq;          /* sequence parallelism's collectives */
    void *seq_ctx;
    /* the memory levers: precision (models/precision.c) and activation
     * checkpointing (models/recompute.c) */
    struct {
        tdm_precision prec;
        tdm_dtype adt;      /* activations and product inputs: float32 or the 16-bit type */
        void *wlow;         /* product weights in adt, param_elems (same offsets), cast at
                               each forward use of their layer; NULL in FP32 */
        int ckpt;           /* 0: every activation kept; N: segments of N units */
        int n_units;
        int recomputing;    /* a segment's forward again, inside backward */
    } lev;
    /* activations */
    int cap;                /* samples the activations hold */
    int batch;              /* batch of the last forward */
    float *dbuf[2];         /* backward ping-pong, max activation size */
    float *col;             /* conv scratch, one chunk of the largest layer: im2col of
                               the chunk (forward; backward recomputes it from the
                               layer's input), then its gradient (backward) */
    int conv_chunk;         /* images per conv chunk asked for; 0: sized to the cache */
    float *ones;            /* cap ones, for bias gradients via gemm */
    float *dlogits;         /* forward_backward scratch */
    int64_t max_elems;      /* largest per-sample activation */
    size_t act_bytes;       /* the current set's and the shared scratch's */
    size_t set_bytes;       /* the current set's */
    int scratch_cap;        /* samples the shared scratch (dbuf, col, ones, dlogits) holds */
    /* Activation sets (models/stage.c): what a forward keeps for its
     * backward lives in the current set (above: layers' out, in, argmax,
     * batchnorm statistics; cap, batch); the others are parked in `sets`. */
    int set, n_sets;
    void *sets;
    const float *input_grad;   /* the last backward's input gradient (stage.input_grad) */
    /* the layer chain's buffers for 16-bit precisions and checkpointing
     * (models/recompute.c's layouts) */
    float *f32s[2];         /* scratch: forward's outputs, ping-pong, before and after
                               rounding; backward: kept 16-bit tensors widened */
    void *d16;              /* scratch: an output gradient rounded for a product */
    void *col16;            /* scratch: a conv chunk's col, rounded */
    struct tdm_act_layout *act_scratch;   /* what reserve_scratch allocated */
    void *x16;              /* the current set's: the input, rounded (in16 of layer 0) */
    void *arena;            /* the current set's: one checkpoint segment's inner activations */
    struct tdm_act_layout *act_set;       /* what the current set's reserve allocated */
};

/* Parameter i's values and gradient: its view, else its place in the flat
 * buffer (NULL when the storage was released and no view is set). */
static inline float *tdm_model_pdata(tdm_model *m, int i)
{
    if (m->pview[i]) return m->pview[i];
    return m->params ? m->params + m->params_info[i].offset : NULL;
}
static inline float *tdm_model_gdata(tdm_model *m, int i)
{
    if (m->gview[i]) return m->gview[i];
    return m->grads ? m->grads + m->params_info[i].offset : NULL;
}

/* Raises a parameter-use event for parameters first..last (the use hook,
 * if any) and checks that each has storage for that use afterwards. */
tdm_status tdm_model_raise_use(tdm_model *m, tdm_model_use use, int first, int last);

/* Appends a tensor to the parameter (buffer = 0) or buffer table, owned by
 * layer `layer`, at the next 64-byte boundary of its flat buffer. */
tdm_status tdm_model_add_tensor(tdm_model *m, int buffer, int layer, const char *name, int ndim,
                                const int64_t *shape);
/* Appends a layer of the given kind owning the tensors added after it. */
tdm_layer *tdm_model_add_layer(tdm_model *m, tdm_layer_kind kind);

/* models/syncbn.c: a batchnorm layer's training forward and backward
 * with its statistics summed over the replicas through m->sync_bn (host
 * devices). */
tdm_status tdm_syncbn_forward(tdm_model *m, tdm_layer *l, const float *x, int B);
tdm_status tdm_syncbn_backward(tdm_model *m, tdm_layer *l, const float *dout, float *din, int B);

/* models/layers.c: one layer's forward (x (B, in) -> l->out, l->in = x)
 * and backward (adds into its gradients; writes din unless NULL; dout
 * may be modified in place by a fused relu). */
tdm_status tdm_model_layer_forward(tdm_model *m, tdm_layer *l, const float *x, int B);
tdm_status tdm_model_layer_backward(tdm_model *m, tdm_layer *l, float *dout, float *din, int B);

/* A batchnorm at layer i followed by a max pooling, run together one
 * channel at a time (each channel's rows stay in cache between the two):
 * 1 when m runs them so (host devices, no SyncBatchNorm in training).
 * pair_forward sets both layers' in and out as their forwards would;
 * pair_backward takes the pooling's output gradient dout (modified in
 * place, as a fused relu's), writes its
 * input gradient into dmid and the batchnorm's into din (NULL: not
 * needed; it may be dout's buffer) and adds the batchnorm's parameter
 * gradients. The same values as the two layers one after the other. */
int tdm_model_pair_fuses(const tdm_model *m, int i);
tdm_status tdm_model_pair_forward(tdm_model *m, tdm_layer *bn, tdm_layer *pool, const float *x,
                                  int B);
tdm_status tdm_model_pair_backward(tdm_model *m, tdm_layer *bn, tdm_layer *pool, float *dout,
                                   float *dmid, float *din, int B);

/* 1 when layer l runs a convolution through im2col chunks (m->col): a
 * conv layer, a residual projection over images. */
static inline int tdm_layer_convs(const tdm_layer *l)
{
    return l->kind == TDM_LAYER_CONV || (l->kind == TDM_LAYER_RES && l->proj && l->k == 1);
}

/* models/layers.c: a conv layer's forward (l->out = W * x) and backward
 * (adds dW; writes din unless NULL), for the residual projection too. */
tdm_status tdm_layer_conv_fwd(tdm_model *m, tdm_layer *l, const float *x, int B);
tdm_status tdm_layer_conv_bwd(tdm_model *m, tdm_layer *l, const float *dout, float *din, int B);

/* models/layers_seq.c: the forward and backward of the builder's layers
 * (act, avgpool, residual), and the residual blocks' skip gradients added
 * into the input gradient of a block's first layer (lowest: the lowest
 * layer whose backward just ran; din: its input gradient, NULL: none). */
tdm_status tdm_seq_layer_forward(tdm_model *m, tdm_layer *l, const float *x, int B);
tdm_status tdm_seq_layer_backward(tdm_model *m, tdm_layer *l, float *dout, float *din, int B);
tdm_status tdm_seq_skip_add(tdm_model *m, int lowest, float *din, int B);
/* Before a training forward of a model with dropout: each sample's key
 * from (seed, training forwards so far, the sample's input bytes). */
tdm_status tdm_seq_drop_keys(tdm_model *m, const void *x, int B);
/* models/builder.c: a SEQ spec's layers and tensors. */
tdm_status tdm_seq_build(tdm_model *m);
/* models/builder.c: the shape after a spec's last op (the input's when it
 * has none), in words for messages; a spec started empty. */
typedef struct tdm_seq_shape {
    int c, h, w, flat;
    int seq;                /* tdm_model_op.seq */
} tdm_seq_shape;
tdm_seq_shape tdm_seq_cur(const tdm_model_spec *s);
void tdm_seq_shape_str(const tdm_seq_shape *sh, char *buf, size_t len);
tdm_status tdm_seq_start(tdm_model_spec *s, int c, int h, int w, int flat);
/* models/builder_gpt.c: the GPT's layers in a builder spec. 1 for their
 * op kinds; the shape after op o (one of them, or any op on a token
 * model's rows); whether o may come next in a token model (the GPT's
 * arrangement); and a finished token model made the TDM_MODEL_GPT spec
 * it describes. */
int tdm_seq_op_is_gpt(tdm_model_op_kind kind);
tdm_status tdm_seq_infer_gpt(const tdm_model_spec *s, const tdm_model_op *o,
                             const tdm_seq_shape *in, tdm_seq_shape *out);
tdm_status tdm_seq_gpt_next(const tdm_model_spec *s, const tdm_model_op *o);
tdm_status tdm_seq_gpt_finish(tdm_model_spec *s);

/* models/model.c: a model of pipeline layers [lo, hi) of spec
 * (tdm_model_init_stage; lo = hi = -1: the whole model). */
tdm_status tdm_model_init_range(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                                uint64_t seed, int lo, int hi);
/* models/model.c: the current set's batchnorm statistics (per channel,
 * what a forward leaves for its backward), allocated where missing. */
tdm_status tdm_model_bn_stats(tdm_model *m);
/* The tables of m->spec's pipeline layers m->stage.lo..hi without any
 * storage (dev may be NULL): what tdm_model_init builds before it
 * allocates. */
tdm_status tdm_model_build_tables(tdm_model *m);
/* models/model.c: frees the current set's activations (layers' out,
 * argmax, batchnorm statistics; cap and batch to 0), and the shared
 * scratch. */
void tdm_model_free_set(tdm_model *m);
void tdm_model_free_scratch(tdm_model *m);

/* models/stage.c */
/* Crops the tables of a whole MLP or CNN just built to m->stage's layers
 * (the flat offsets become the slice's own, from 0). */
tdm_status tdm_model_crop(tdm_model *m);
/* Where a stage's tensors sit in the whole model's tables: fills
 * m->stage's slice fields from a table-only build of the whole model and
 * checks that every tensor of the slice has the whole model's name, shape
 * and relative offset. */
tdm_status tdm_model_stage_place(tdm_model *m);
/* The full table's index of tensor i (the tied copy: its source). */
int tdm_model_global_param(const tdm_model *m, int i);
/* Frees every set but the current, and the set table. */
void tdm_model_free_sets(tdm_model *m);

/* models/precision.c: the 16-bit copy of parameters first..last that
 * products read (those of the layer's weights: every tensor of two or more
 * dimensions), from their current values (views included). No-op in FP32. */
tdm_status tdm_model_cast_params(tdm_model *m, int first, int last);
/* Parameter i's 16-bit copy (lev.wlow + its offset). */
static inline void *tdm_model_wlow(const tdm_model *m, int i)
{
    return (char *)m->lev.wlow + (size_t)m->params_info[i].offset * tdm_dtype_size(m->lev.adt);
}
/* 1 in BF16 and FP16. */
static inline int tdm_model_low(const tdm_model *m) { return m->lev.adt != TDM_DTYPE_FLOAT32; }
/* Rounds n floats of x to the activation type into dst, then x to the
 * rounded values (the next reader sees what backward will). */
tdm_status tdm_model_round(tdm_model *m, float *x, void *dst, int64_t n);

/* models/recompute.c: a model's activation buffers for a batch
 * (precision and checkpointing included) as lists - one activation set's,
 * and the shared scratch's - which reserve allocates and models/plan.c
 * sums without allocating. */
#define TDM_ACT_MAX_BUFS 1024
typedef struct tdm_act_buf {
    void **ptr;             /* where the allocation goes (only written when allocating:
                               a GPT set's fields move when the set table grows) */
    void *got;              /* what was allocated (own allocations; tdm_act_free frees it) */
    size_t nbytes;
    int layer;              /* the layer it belongs to, -1: the model's scratch */
    int64_t arena_off;      /* >= 0: carved from the arena at this byte offset, no allocation */
} tdm_act_buf;
typedef struct tdm_act_layout {
    int n;
    tdm_act_buf b[TDM_ACT_MAX_BUFS];
    size_t arena_bytes;     /* checkpointing: the shared segment buffer (0: none) */
} tdm_act_layout;
/* Appends a buffer: its own allocation, or (arena: 1) a slot of the
 * arena at the next 64-byte boundary of *arena_off. */
void tdm_act_add(tdm_act_layout *lay, void **ptr, size_t nbytes, int layer, int arena,
                 size_t *arena_off);
/* The MLP/CNN chain's layouts for `batch` samples: one set's (outputs or
 * their 16-bit copies, the pooling's winners, the rounded input, the
 * arena) and the scratch's (gradient ping-pong, col, ones, dlogits, and
 * the 16-bit precisions' working buffers). The conv chunks must be set. */
void tdm_model_chain_layout(tdm_model *m, int batch, tdm_act_layout *set,
                            tdm_act_layout *scratch);
/* Allocates a layout (its arena once, the slots carved out) and keeps
 * the table in *keep (freed through it), the arena in *arena (may be
 * NULL when the layout has none); *bytes gets what was allocated. On
 * failure what was allocated stays for tdm_act_free. */
tdm_status tdm_act_alloc(tdm_model *m, const tdm_act_layout *lay, tdm_act_layout **keep,
                         void **arena, size_t *bytes);
/* Frees what tdm_act_alloc allocated into *keep and *arena (NULL ok).
 * The pointers it set are the caller's to clear. */
void tdm_act_free(tdm_model *m, tdm_act_layout **keep, void **arena);
/* Sets unit and seg_last of every layer of the chain (MLP, CNN) from
 * lev.ckpt. */
void tdm_model_chain_units(tdm_model *m);
/* Backward of the chain reaches layer i, the last of a checkpointed
 * segment: runs the segment's forward again (its input kept). */
tdm_status tdm_model_chain_recompute(tdm_model *m, int i, int batch);

/* models/model.c: a model's layers, tables and units without a device or
 * memory, for planning (models/plan.c): the whole model, as if on a
 * device of `kind` with `threads` BLAS threads. Free with tdm_model_free. */
tdm_status tdm_model_skeleton(tdm_model **out, const tdm_model_spec *spec, tdm_device_kind kind,
                              int threads);
/* The skeleton of pipeline layers [lo, hi) (a stage's; lo < 0: all). */
tdm_status tdm_model_skeleton_range(tdm_model **out, const tdm_model_spec *spec,
                                    tdm_device_kind kind, int threads, int lo, int hi);
/* Images per chunk of conv layer l at `batch` (tdm_model_set_conv_chunk). */
int tdm_model_conv_chunk(const tdm_model *m, const tdm_layer *l, int batch);
/* Forward through layers first..last of the chain from x (float32; in
 * 16-bit precisions the rounded values), with use events and weight
 * casts unless lev.recomputing. */
tdm_status tdm_model_run_layers(tdm_model *m, int first, int last, const float *x, int batch);
/* Frees the activations (they are reserved again by the next forward). */
void tdm_model_drop_activations(tdm_model *m);

/* models/gpt.c */
tdm_status tdm_gpt_spec_parse(tdm_model_spec *s, const char *text);
void tdm_gpt_spec_describe(const tdm_model_spec *s, char *buf, size_t len);
/* The GPT's activation bytes for `batch` windows: what its reserve
 * allocates, counted without allocating (tdm_model_spec_footprint). */
size_t tdm_gpt_act_bytes(const tdm_model *m, int batch);
/* Adds the GPT's tensors and layers and sets m->vt and m->ext. */
tdm_status tdm_gpt_build(tdm_model *m);

#endif
