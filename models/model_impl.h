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
} tdm_layer_kind;

typedef struct tdm_layer {
    tdm_layer_kind kind;
    int p0, np;             /* parameter tensors [p0, p0+np) */
    int b0, nb;             /* buffer tensors */
    int relu;               /* fused relu on the output */
    int c, h, w;            /* input shape per sample (linear: c = in features) */
    int oc, oh, ow;         /* output shape per sample (linear: oc = out features) */
    int k, stride, pad;     /* conv / pool */
    int64_t in_elems, out_elems; /* per sample */
    int block;              /* tdm_model_layer_block */
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
    /* Parameter values on the host (hp: param_elems floats, zeroed). */
    void (*init_params)(tdm_model *m, uint64_t seed, float *hp);
    /* After tdm_model_forward's argument checks, with m->batch = 0. */
    tdm_status (*forward)(tdm_model *m, const void *x, int batch, const float **logits);
    /* After tdm_model_backward's checks: adds into the gradients and calls
     * the grad-ready hook itself. */
    tdm_status (*backward)(tdm_model *m, const float *dlogits);
    const float *(*last_logits)(const tdm_model *m);
    void (*gemm_flops)(const tdm_model *m, double *fwd, double *bwd);
    void (*free_activations)(tdm_model *m);   /* and zero m->cap, m->act_bytes */
    void (*free_ext)(tdm_model *m);           /* m->ext itself */
    /* The activation buffers for `batch` (models/recompute.c's layout). */
    void (*layout)(tdm_model *m, int batch, struct tdm_act_layout *lay);
} tdm_model_vt;

struct tdm_model {
    tdm_model_spec spec;
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
    size_t act_bytes;
    /* the layer chain's buffers for 16-bit precisions and checkpointing */
    float *f32s[2];         /* forward: the outputs, ping-pong, before and after rounding;
                               backward: kept 16-bit tensors widened (B * max_elems each) */
    void *x16;              /* the model input, rounded (B * in_elems of layer 0) */
    void *d16;              /* an output gradient rounded for a product (B * max_elems) */
    void *col16;            /* a conv chunk's col, rounded */
    void *arena;            /* checkpointing: one segment's inner activations */
    struct tdm_act_layout *act;  /* what the last reserve allocated (freed through it) */
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

/* models/recompute.c: the layer chain's activation buffers for a batch
 * (precision and checkpointing included) as a list, which reserve
 * allocates and models/plan.c sums without allocating. */
#define TDM_ACT_MAX_BUFS 1024
typedef struct tdm_act_buf {
    void **ptr;             /* where the allocation goes (NULL: planning only) */
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
/* The layout of the MLP/CNN chain for `batch` samples. */
void tdm_model_chain_layout(tdm_model *m, int batch, tdm_act_layout *lay);
/* Allocates a layout (the arena once, its slots carved out) and keeps it
 * in m->act; adds the bytes to m->act_bytes. On failure what was
 * allocated stays for tdm_act_free. */
tdm_status tdm_act_alloc(tdm_model *m, const tdm_act_layout *lay);
/* Frees what tdm_act_alloc allocated and clears every pointer it set. */
void tdm_act_free(tdm_model *m);
/* Sets unit and seg_last of every layer of the chain (MLP, CNN) from
 * lev.ckpt. */
void tdm_model_chain_units(tdm_model *m);
/* Backward of the chain reaches layer i, the last of a checkpointed
 * segment: runs the segment's forward again (its input kept). */
tdm_status tdm_model_chain_recompute(tdm_model *m, int i, int batch);

/* models/model.c: a model's layers, tables and units without a device or
 * memory, for planning (models/plan.c): as if on a device of `kind` with
 * `threads` BLAS threads. Free with tdm_model_free. */
tdm_status tdm_model_skeleton(tdm_model **out, const tdm_model_spec *spec, tdm_device_kind kind,
                              int threads);
/* Images per chunk of conv layer l at `batch` (tdm_model_set_conv_chunk). */
int tdm_model_conv_chunk(const tdm_model *m, const tdm_layer *l, int batch);

/* models/model.c: forward through layers first..last of the chain from
 * x (float32; in 16-bit precisions the rounded values), with use events
 * and weight casts unless lev.recomputing. */
tdm_status tdm_model_run_layers(tdm_model *m, int first, int last, const float *x, int batch);
/* Frees the activations (they are reserved again by the next forward). */
void tdm_model_drop_activations(tdm_model *m);

/* models/gpt.c */
tdm_status tdm_gpt_spec_parse(tdm_model_spec *s, const char *text);
void tdm_gpt_spec_describe(const tdm_model_spec *s, char *buf, size_t len);
/* Adds the GPT's tensors and layers and sets m->vt and m->ext. */
tdm_status tdm_gpt_build(tdm_model *m);

#endif
