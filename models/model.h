/* models/model.h: models built from layers with explicit forward and
 * backward, over flat buffers.
 *
 * A model owns, on its device, one flat parameter buffer, one flat
 * gradient buffer with the same offsets, and one flat buffer of
 * non-trainable buffers (batchnorm running statistics); a table of
 * {name, shape, offset} describes each. Parameters are laid out in layer
 * order, so backward (last layer first) finishes them from the end of the
 * buffer towards the start: a DDP bucket is then a contiguous view.
 *
 * Models know nothing of parallelism. They expose a grad-ready hook, called
 * after each layer's parameter gradients are final in a backward pass, and
 * the flat buffers; DP (dp/) and DDP (ddp/) build on those.
 *
 * Conventions: forward writes its output; backward *adds* into gradients
 * (tdm_model_zero_grad is an explicit step). Inputs are row-major
 * (batch, in_features) of the model's input dtype: float32 features for
 * the MLP and CNN (images are (batch, C, H, W) flattened), int32 token ids
 * (batch, T) for the GPT. Both are 4-byte elements, so code that only
 * moves inputs (DP's scatter, DDP's staging) handles either as
 * in_features 4-byte elements per sample. A sample has out_rows rows of
 * logits and as many int32 targets: 1 for the classifiers, T (the next
 * byte at every position) for the GPT, whose per-sample loss is the mean
 * over its positions. Pointers passed to forward/backward/loss are device
 * pointers of the model's device. */
#ifndef TDM_MODELS_MODEL_H
#define TDM_MODELS_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_MODEL_MAX_DIMS 16
#define TDM_MODEL_NAME_MAX 48
/* Each tensor starts on a 64-byte boundary of its flat buffer; the
 * padding elements are zero in parameters and gradients. */
#define TDM_MODEL_ALIGN_ELEMS 16

typedef enum tdm_model_kind {
    TDM_MODEL_MLP = 0,
    TDM_MODEL_CNN,
    TDM_MODEL_GPT,
    TDM_MODEL_SEQ,      /* a list of layers: the C builder (models/builder.h), a model file */
} tdm_model_kind;

/* The element type of a model's inputs (4 bytes either way). */
typedef enum tdm_model_input {
    TDM_MODEL_INPUT_F32 = 0,     /* float32 features */
    TDM_MODEL_INPUT_TOKENS,      /* int32 token ids in [0, n_classes) */
} tdm_model_input;

/* One entry of a TDM_MODEL_SEQ spec (models/builder.h). */
#define TDM_MODEL_MAX_OPS 160
#define TDM_MODEL_MAX_NEST 8      /* residual blocks open at once */
typedef enum tdm_model_op_kind {
    TDM_MODEL_OP_LINEAR = 0,    /* n: out features (weight, bias) */
    TDM_MODEL_OP_CONV,          /* n: out channels; k x k, stride, pad (weight, no bias) */
    TDM_MODEL_OP_BATCHNORM,     /* per channel (weight, bias; running_mean, running_var) */
    TDM_MODEL_OP_RELU,
    TDM_MODEL_OP_GELU,
    TDM_MODEL_OP_TANH,
    TDM_MODEL_OP_SIGMOID,
    TDM_MODEL_OP_MAXPOOL,       /* k x k window, stride k */
    TDM_MODEL_OP_AVGPOOL,       /* k x kw window, stride k (kw = k; global: the plane) */
    TDM_MODEL_OP_FLATTEN,
    TDM_MODEL_OP_RES_OPEN,      /* a residual block's input */
    TDM_MODEL_OP_RES_CLOSE,     /* output = block + input (proj: through a projection) */
    TDM_MODEL_OP_DROPOUT,       /* p: drop probability (training only) */
    /* the GPT's layers (input tokens; models/builder_gpt.c) */
    TDM_MODEL_OP_EMBEDDING,     /* k: vocabulary, n: width (tokens -> (T, n) rows) */
    TDM_MODEL_OP_POS_EMBEDDING, /* learned positions (T, C), added to the rows */
    TDM_MODEL_OP_LAYERNORM,     /* each row over its C features (weight, bias) */
    TDM_MODEL_OP_ATTENTION,     /* n: heads; causal self-attention with its projections */
    TDM_MODEL_OP_GPT_MLP,       /* linear 4C, gelu, linear C */
    TDM_MODEL_OP_LM_HEAD,       /* rows -> logits over the vocabulary (proj 0: tied) */
} tdm_model_op_kind;

typedef struct tdm_model_op {
    tdm_model_op_kind kind;
    int n, k, kw, stride, pad;
    int proj;                   /* RES_CLOSE: 1x1 conv (images) or linear (features) */
    float p;                    /* DROPOUT */
    int line;                   /* the model file's line (0: built in C) */
    int c, h, w, flat;          /* the shape after this op (flat: features in w) */
    int seq;                    /* a token model's shape: TDM_MODEL_SEQ_TOKENS (w of them)
                                   or _ROWS (h positions of w features); 0: neither */
} tdm_model_op;

/* tdm_model_op.seq */
#define TDM_MODEL_SEQ_TOKENS 1
#define TDM_MODEL_SEQ_ROWS 2

typedef struct tdm_model_spec {
    tdm_model_kind kind;
    int ndims;                      /* MLP: widths, input first, classes last */
    int dims[TDM_MODEL_MAX_DIMS];
    int in_c, in_h, in_w;           /* CNN input image (default 1x28x28) */
    int n_classes;                  /* CNN (MLP: dims[ndims-1]) */
    int ch1, ch2;                   /* CNN channels (default 32, 64) */
    int fc_hidden;                  /* CNN hidden linear+relu width before the
                                       classifier (default 128; 0: none) */
    /* GPT (GPT-2's config names): blocks, width, heads, context, vocabulary
     * (256: bytes). See models/gpt.h. */
    int n_layer, n_embd, n_head, n_ctx, vocab;
    int head_untied;            /* 1: the output head has a weight of its own,
                                   lm_head.weight (a model file's `lmhead`) */
    /* GPT, > 1: the model is one of tp_ranks tensor-parallel ranks'
     * slices of every block (a pipeline of tensor-parallel stages,
     * tools/rank_pptp.h): H/tp_ranks heads (attn.c_attn (3C/N, C),
     * attn.c_proj (C, C/N)), mlp.c_fc (4C/N, C), mlp.c_proj (C, 4C/N); the
     * row-parallel products and the column-parallel input gradients are
     * summed by the partial-sum callback (tdm_model_set_partial_sums).
     * 0 or 1: the whole model. FP32 without activation checkpointing. */
    int tp_ranks;
    /* SEQ: the layers, the input shape above (in_c x in_h x in_w; flat
     * input: 1 x 1 x features), n_classes the last op's width. */
    int n_ops, in_flat;
    int in_tokens;              /* 1: the input is in_w tokens (a GPT written as layers:
                                   tdm_model_seq_finish makes the spec a TDM_MODEL_GPT) */
    int open[TDM_MODEL_MAX_NEST], n_open;   /* the builder's open residual blocks */
    char name[64];              /* what describe prints ("file:lenet.tdm") */
    tdm_model_op ops[TDM_MODEL_MAX_OPS];
} tdm_model_spec;

/* tdm_model_spec_mlp(s, NULL, 0) is the default MLP; other dims must hold
 * 2..TDM_MODEL_MAX_DIMS widths, else tdm_model_init refuses the spec.
 * Defaults: MLP 784-1024-1024-10; CNN 1x28x28 -> [conv3x3 32, bn, relu,
 * pool2] -> [conv3x3 64, bn, relu, pool2] -> fc 128 relu -> fc 10 (the
 * shape of Fashion-MNIST's "2 Conv+pooling" baseline). */
void tdm_model_spec_mlp(tdm_model_spec *s, const int *dims, int ndims);
void tdm_model_spec_cnn(tdm_model_spec *s);
/* Parses "mlp", "mlp:784-128-10", "cnn", "gpt", "gpt:L-D-H-T" and
 * "file:PATH" (a model file: models/builder.h). */
tdm_status tdm_model_spec_parse(tdm_model_spec *s, const char *text);
/* The sample shape a model reads and its class count, for building
 * matching (e.g. synthetic) data: the CNN's image; an MLP with 784 inputs
 * reads 1x28x28 images (Fashion-MNIST), any other MLP 1x1xN. */
void tdm_model_spec_sample_shape(const tdm_model_spec *s, int *c, int *h, int *w, int *classes);
/* "mlp 784-1024-1024-10", "gpt:4-128-4-128" */
void tdm_model_spec_describe(const tdm_model_spec *s, char *buf, size_t len);

typedef struct tdm_tensor_info {
    char name[TDM_MODEL_NAME_MAX];  /* "fc1.weight", "bn1.running_mean" */
    int ndim;
    int64_t shape[4];
    int64_t n_elem;
    int64_t offset;                 /* elements from the start of its flat buffer */
    int layer;                      /* index of the layer that owns it */
} tdm_tensor_info;

typedef struct tdm_model tdm_model;

/* Called after a layer's parameter gradients are final during backward:
 * parameters first..last (inclusive, indices into the parameter table)
 * are ready. Backward calls it for the last layer first, and exactly once
 * per parameter per backward, when nothing later in that backward adds to
 * its gradient: a tensor used twice (the GPT's token embedding, read again
 * by the tied output head) is announced after its last use - the
 * embedding's backward, at the very end - never at the head, whose
 * contribution is only part of its gradient. Such a tensor comes first in
 * the parameter table, so the order stays end-to-start. */
typedef void (*tdm_grad_ready_fn)(void *ctx, tdm_model *m, int first_param, int last_param);

/* Builds a model on dev with parameters drawn from (seed, parameter
 * index) streams: the same seed gives the same parameters on any device
 * and in any process. Weights: He normal (std sqrt(2/fan_in); the output
 * layer, no relu after it, sqrt(1/fan_in)); biases 0;
 * batchnorm gamma 1, beta 0, running mean 0, running var 1. */
tdm_status tdm_model_init(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                          uint64_t seed);
tdm_status tdm_mlp_init(tdm_model **out, tdm_device *dev, const int *dims, int ndims,
                        uint64_t seed);
tdm_status tdm_cnn_init(tdm_model **out, tdm_device *dev, uint64_t seed);
/* The tables of spec's whole model (names, shapes, offsets, layers, in
 * and out sizes) without a device or any storage: for a design that keeps
 * the parameters in a layout of its own (tensor parallel) and reads and
 * writes checkpoints in the whole model's (tdm_checkpoint_save_host with
 * it). Its flat buffers are NULL; forward, backward and anything that
 * touches storage must not be called. Free with tdm_model_free. */
tdm_status tdm_model_init_tables(tdm_model **out, const tdm_model_spec *spec);
/* Parameter tensor i's initial values, those tdm_model_init(seed) gives
 * it, into p (host memory: the tensor's n_elem floats). m may be tables
 * only: a design that holds a part of a tensor builds the tensor alone,
 * not the whole model. */
void tdm_model_init_param_host(const tdm_model *m, uint64_t seed, int i, float *p);
/* tdm_model_init without the flat parameter and gradient buffers: the
 * model is built on dev released from the start (as after
 * tdm_model_release_storage: every tensor needs a view before a layer
 * uses it), with its buffers (batchnorm statistics) initialised as
 * tdm_model_init's; the parameters' initial values are
 * tdm_model_init_param_host(m, tdm_model_seed(m), i, ...), wherever the
 * caller keeps them. For a design that must never hold the whole model
 * on the device (FSDP with parameter offload: tdm_fsdp_init draws each
 * unit on the host). */
tdm_status tdm_model_init_released(tdm_model **out, tdm_device *dev,
                                   const tdm_model_spec *spec, uint64_t seed);
/* The seed the model's parameters were drawn from (and its dropout keyed on). */
uint64_t tdm_model_seed(const tdm_model *m);
/* A model with src's spec on dev, parameters and buffers copied from src
 * (a replica). Gradients zero. */
tdm_status tdm_model_clone(tdm_model **out, const tdm_model *src, tdm_device *dev);
void tdm_model_free(tdm_model *m);

const tdm_model_spec *tdm_model_get_spec(const tdm_model *m);
tdm_device *tdm_model_device(const tdm_model *m);
/* Input elements per sample (GPT: its context T). */
int tdm_model_in_features(const tdm_model *m);
tdm_model_input tdm_model_input_dtype(const tdm_model *m);
/* Classes per row of logits (GPT: the vocabulary). */
int tdm_model_n_classes(const tdm_model *m);
/* Rows of logits (and targets) per sample: 1, or the GPT's T. */
int tdm_model_out_rows(const tdm_model *m);

/* The parameter and buffer tables. */
int tdm_model_n_params(const tdm_model *m);
const tdm_tensor_info *tdm_model_param_info(const tdm_model *m, int i);
int tdm_model_n_buffers(const tdm_model *m);
const tdm_tensor_info *tdm_model_buffer_info(const tdm_model *m, int i);
/* Number of layers and the parameter range [first, last] of layer l
 * (first > last when the layer has none). */
int tdm_model_n_layers(const tdm_model *m);
void tdm_model_layer_params(const tdm_model *m, int layer, int *first, int *last);

/* The flat buffers (device pointers) and their lengths in elements
 * (including alignment padding). */
float *tdm_model_params(tdm_model *m);
float *tdm_model_grads(tdm_model *m);
float *tdm_model_buffers(tdm_model *m);
int64_t tdm_model_param_elems(const tdm_model *m);
/* Training forwards run so far: the count dropout's masks are keyed on
 * (with the seed and the sample's bytes). A copy that ran fewer (a
 * DataParallel replica left idle by a short batch) takes the master's,
 * so that its next masks are the ones one device draws. */
int64_t tdm_model_train_forwards(const tdm_model *m);
void tdm_model_set_train_forwards(tdm_model *m, int64_t n);
int64_t tdm_model_buffer_elems(const tdm_model *m);

/* Replaces the gradient storage with caller-owned device memory of
 * tdm_model_param_elems() floats (e.g. a shared-memory segment so DDP can
 * all-reduce buckets in place). The current gradients are copied over.
 * The model does not free it; pass NULL to go back to owned storage. */
tdm_status tdm_model_set_grad_storage(tdm_model *m, float *grads /* borrowed */);

/* SyncBatchNorm (a callback, so that models/ knows nothing of
 * communicators; DDP installs it: tdm_ddp_opts.sync_bn). When set, every
 * batchnorm layer in training mode computes its batch statistics over
 * all replicas: it calls fn(ctx, v, n) with per-channel partial sums in
 * v (host doubles) - forward: sum x and the sample count, then the sum of
 * squared deviations from the global mean; backward: sum dy and sum
 * dy*xhat - and fn must replace them by their sums over every replica
 * (every replica calls it in the same order, with the same n). The
 * parameter gradients (dgamma, dbeta) stay this replica's own sums (DDP
 * reduces them); the input gradient uses the global ones, so the group
 * computes what one device computes on the union of the batches. The
 * sums are taken on the host (staged through copies on an accelerator).
 * NULL: local statistics (the default). */
typedef tdm_status (*tdm_model_allsum_fn)(void *ctx, double *v, int n);
void tdm_model_set_sync_bn(tdm_model *m, tdm_model_allsum_fn fn, void *ctx);
/* A replica with no samples in this step (a short last global batch)
 * still takes part in every statistics sum, as PyTorch's SyncBatchNorm
 * accepts empty input: these make the same fn calls, in the same order,
 * as a training forward / backward would, with zero sums and a count of
 * 0; the forward also updates the running statistics from the global
 * ones. The backward calls the grad-ready hook (tdm_model_set_grad_hook)
 * layer by layer as a backward does, and adds nothing to the gradients.
 * Only with a callback set, in training mode. */
tdm_status tdm_model_sync_bn_forward_empty(tdm_model *m);
tdm_status tdm_model_sync_bn_backward_empty(tdm_model *m);
/* Tensor parallelism's partial sums (a callback, as SyncBatchNorm's, so
 * that models/ knows nothing of communicators): a model whose linear
 * layers hold a slice of the whole layer's (Megatron's column- and
 * row-parallel layers, tools/rank_pptp.c) marks them. A
 * TDM_MODEL_PARTIAL_OUT layer holds a slice of its input features (row
 * parallel): its forward's product (batch, out) is a partial sum, which
 * fn(ctx, buf, n, layer) must replace by the sum over the tensor-parallel
 * group before the layer adds its bias and activation. A
 * TDM_MODEL_PARTIAL_IN layer holds a slice of its output features (column
 * parallel): its backward's input gradient (batch, in) is a partial sum,
 * summed the same way (not called where no input gradient is computed).
 * buf is device memory of n floats; every rank of the group calls fn in
 * the same order. Linear layers in FP32 only: with a 16-bit precision or
 * activation checkpointing set, the forward and backward refuse
 * (INVALID_ARG). kinds: one per layer of m (tdm_model_n_layers); NULL fn
 * clears them all. A GPT of tdm_model_spec.tp_ranks > 1 takes kinds NULL:
 * its spec says which of its layers are split (per block: attn.c_attn
 * and mlp.c_fc column-parallel, both c_proj row-parallel, layer: the
 * layer: the logical layer of the model), and it runs only with fn set. */
typedef enum tdm_model_partial {
    TDM_MODEL_PARTIAL_NONE = 0,
    TDM_MODEL_PARTIAL_OUT,     /* row parallel: the forward's product is summed */
    TDM_MODEL_PARTIAL_IN,      /* column parallel: the backward's input gradient is summed */
} tdm_model_partial;
typedef tdm_status (*tdm_model_partial_fn)(void *ctx, float *buf, int64_t n, int layer);
tdm_status tdm_model_set_partial_sums(tdm_model *m, const tdm_model_partial *kinds, int n,
                                      tdm_model_partial_fn fn, void *ctx);
/* The tensor-parallel rank whose slices the model's column-parallel
 * layers hold (after tdm_model_set_partial_sums): a dropout layer between
 * a column-parallel layer and its row-parallel one drops the whole
 * vector's values [rank*w, (rank+1)*w) of its w, as one device drops
 * them, so the ranks' masks are one device's mask cut in N. */
void tdm_model_set_partial_rank(tdm_model *m, int rank);
/* Batchnorm layers of the model (0 for the MLP and GPT). */
int tdm_model_n_batchnorm(const tdm_model *m);

void tdm_model_set_train(tdm_model *m, int train);
int tdm_model_is_train(const tdm_model *m);
void tdm_model_set_grad_hook(tdm_model *m, tdm_grad_ready_fn fn, void *ctx);
/* Backward stops at layer `layer` (0..n_layers): layers 0..layer-1 get no
 * gradient and no grad-ready call, as when the input of that layer is
 * detached in PyTorch (a frozen prefix whose parameters take no part in
 * the step: what DDP's find_unused_parameters is for). 0, the default:
 * backward through every layer. Applies to the following backward passes. */
tdm_status tdm_model_set_backward_stop(tdm_model *m, int layer);

/* Convolutions run over `images` images of the batch at a time: im2col
 * of the chunk, its gemm, and in backward im2col again (from the layer's
 * input, which is why the input of forward must stay unchanged until its
 * backward, as a linear layer's must), the weight gradient added chunk
 * by chunk, the chunk's column gradient and col2im. The im2col buffer is
 * one chunk of the largest layer, shared by all layers. 0, the default:
 * chunks sized to stay in a core's L2 cache on a host device, the whole
 * batch on other devices. The sums of the weight gradient follow the
 * chunks (another chunk size rounds differently). Drops
 * the activations: call it before a forward, not between a forward and
 * its backward. */
tdm_status tdm_model_set_conv_chunk(tdm_model *m, int images);

/* Zeroes the gradient storage (the flat buffer, or after
 * tdm_model_release_storage every tensor's gradient view that is set). */
tdm_status tdm_model_zero_grad(tdm_model *m);

/* ---- storage views and parameter-use events ----------------------------
 * What sharded data parallel (fsdp/) builds on, as DP and DDP build on the
 * flat buffers and the grad-ready hook; nothing here knows of ranks.
 *
 * A view makes layers read tensors first..last (a range of the parameter
 * table) from caller memory instead of the model's flat buffers: tensor i
 * at base + (offset_i - offset_first), the same relative layout as in the
 * flat buffer. NULL gives the tensors back to the flat buffer. The
 * parameter view is read by forward and backward; the gradient view is
 * where backward adds. Views stay until changed; the caller keeps the
 * memory valid while they are set. */
tdm_status tdm_model_set_param_view(tdm_model *m, int first, int last, float *base /* borrowed */);
tdm_status tdm_model_set_grad_view(tdm_model *m, int first, int last, float *base /* borrowed */);
/* Frees the model's own flat parameter and gradient buffers (for a caller
 * that keeps parameters elsewhere, through views, and wants the memory
 * back): tdm_model_params and tdm_model_grads return NULL from then on,
 * and every tensor must have a view by the time a layer uses it (the
 * use hook below is the place to set it); a layer that finds none fails
 * naming the tensor. Refused while gradients are borrowed
 * (tdm_model_set_grad_storage). Buffers (batchnorm statistics) stay. */
tdm_status tdm_model_release_storage(tdm_model *m);
/* Allocates the flat buffers again (zeroed) and drops every view. */
tdm_status tdm_model_restore_storage(tdm_model *m);
/* 1 after tdm_model_release_storage (until restored), and for a model
 * built by tdm_model_init_released. */
int tdm_model_storage_released(const tdm_model *m);
/* 1 when any tensor has a parameter or gradient view set. */
int tdm_model_has_views(const tdm_model *m);

/* When layers are about to use parameters: forward before a layer reads
 * parameters first..last (a tensor may be read again later: the GPT's
 * head reads the token embedding), backward before a layer reads them
 * and adds into their gradients, backward_grads before a layer only adds
 * into their gradients without reading them (an embedding's backward:
 * a sharded model need not gather them). The grad-ready hook above says
 * when a gradient is final. A hook error stops the pass and is returned
 * by it. Layers without parameters raise no event. */
typedef enum tdm_model_use {
    TDM_MODEL_USE_FORWARD = 0,
    TDM_MODEL_USE_BACKWARD,
    TDM_MODEL_USE_BACKWARD_GRADS,
} tdm_model_use;
typedef tdm_status (*tdm_param_use_fn)(void *ctx, tdm_model *m, tdm_model_use use,
                                       int first_param, int last_param);
void tdm_model_set_use_hook(tdm_model *m, tdm_param_use_fn fn, void *ctx);

/* The architectural block a layer belongs to, for grouping layers into
 * units: a transformer block (the GPT: 0 the embeddings, 1..L the blocks,
 * L+1 the final LayerNorm and head); every layer is its own block in the
 * MLP and CNN. Non-decreasing in the layer index. */
int tdm_model_layer_block(const tdm_model *m, int layer);

/* Forward over a batch: x (batch, in_features) of the input dtype ->
 * *logits (batch * out_rows, n_classes), owned by the model and valid
 * until the next forward. In training mode batchnorm uses this batch's
 * statistics and updates the running buffers. Activations grow to the
 * largest batch seen. */
tdm_status tdm_model_forward(tdm_model *m, const void *x, int batch, const float **logits);
/* Backward of the last forward: dlogits (batch * out_rows, n_classes).
 * Adds into the gradient buffer and calls the grad-ready hook per layer. */
tdm_status tdm_model_backward(tdm_model *m, const float *dlogits);

/* Softmax cross-entropy on dev: over logits (batch, classes) with labels
 * (device int32), returns in *loss_sum the sum of per-sample losses
 * (host float, accumulated in double) and, when dlogits is non-NULL,
 * writes (softmax - onehot) * scale. A mean over the batch is scale=1/B. */
tdm_status tdm_loss_softmax_xent(tdm_device *dev, const float *logits, const int32_t *labels,
                                 int batch, int classes, float scale, double *loss_sum,
                                 float *dlogits);

/* The model's loss over a batch of `batch` samples: softmax cross-entropy
 * over its batch * out_rows rows of logits and targets, each sample's loss
 * the mean over its rows. *loss_sum: the sum of the per-sample losses;
 * dlogits (may be NULL): their gradient times scale (1/B for the batch
 * mean), i.e. each row's (softmax - onehot) * scale / out_rows. With one
 * row per sample this is exactly tdm_loss_softmax_xent. Runs on the
 * model's device. */
tdm_status tdm_model_loss(const tdm_model *m, const float *logits, const int32_t *labels,
                          int batch, float scale, double *loss_sum, float *dlogits);

/* After a forward of B samples: the model's (B * out_rows, classes)
 * scratch on its device for the loss gradient, which tdm_model_backward
 * may take (it is what tdm_model_forward_backward uses). */
float *tdm_model_loss_grad(tdm_model *m);

/* One forward + mean loss + backward over (x, y) on the model's device:
 * the single-device training step's gradient part. y: batch * out_rows. */
tdm_status tdm_model_forward_backward(tdm_model *m, const void *x, const int32_t *y, int batch,
                                      double *loss_mean);
/* Number of correct argmax predictions of the last forward's logits over
 * batch * out_rows rows (y_host: as many targets, host memory). */
tdm_status tdm_model_count_correct(tdm_model *m, const int32_t *y_host, int batch, int64_t *correct);

/* Floating-point operations of the gemms (im2col convolutions included)
 * per sample: forward, and backward (weight and input gradients; the first
 * layer's input gradient is not computed). Elementwise work is not counted.
 * GPT: every projection, the tied head and attention's two batched
 * products (the full T x T score matrix, masked half included). */
void tdm_model_gemm_flops(const tdm_model *m, double *fwd_per_sample, double *bwd_per_sample);

/* What a model of spec would hold, computed without allocating it (for a
 * run's memory plan, models/mem_plan.h): its parameter and buffer counts,
 * its largest parameter tensor, and the activation bytes its forward and
 * backward allocate for `batch` samples (exactly what tdm_model_get_memory
 * reports once a batch of that size has run). dev: the device it would
 * live on (a host device's BLAS threads size the convolution chunks). */
typedef struct tdm_model_footprint {
    int64_t param_elems, buffer_elems, largest_param_elems;
    size_t act_bytes;
} tdm_model_footprint;
tdm_status tdm_model_spec_footprint(const tdm_model_spec *spec, tdm_device *dev, int batch,
                                    tdm_model_footprint *out);

/* Bytes held per kind (for memory reports). */
typedef struct tdm_model_memory {
    size_t params, grads, buffers, activations;
    size_t params_low;   /* 16-bit precisions: the weights' 16-bit copy (models/precision.h) */
} tdm_model_memory;
void tdm_model_get_memory(const tdm_model *m, tdm_model_memory *out);

#ifdef __cplusplus
}
#endif

#endif
