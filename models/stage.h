/* models/stage.h: a model made of a run of its spec's layers (a pipeline
 * stage), and activation sets (the activations of several forwards kept
 * at once for their backwards). Models know nothing of pipelines: this is
 * "the model of layers [lo, hi)" and "keep this forward's activations
 * aside"; pp/ builds stages, schedules and transfers on it.
 *
 * Pipeline layers of a spec: the MLP's linear layers; the CNN's layers
 * (each convolution, batchnorm, pooling, the flatten and each linear is
 * one); the GPT's embeddings, each transformer block, and the final
 * LayerNorm with the head: L + 2.
 *
 * A stage model is a tdm_model like any other (flat buffers, grad-ready
 * hook, views, DDP's Reducer, optimizers, memory reports), whose
 * parameter table is the slice of the whole model's table that its layers
 * own: the same names and shapes, its flat buffer the same floats at the
 * same relative offsets (tdm_model_stage_info.slice_offset says where they
 * sit in the whole model's buffer), initialised as the whole model
 * initialises them. So a whole model's buffer is the concatenation of
 * its stages' slices, and a checkpoint gathered from stages is the whole
 * model's. The GPT's last stage also holds a copy of the tied token
 * embedding for its head ("lm_head.weight", after the slice: the
 * whole model's wte, initialised the same); its gradient is that stage's
 * share of wte's, and the pipeline sums it with the first stage's.
 *
 * Forward takes the stage's input - the model's input for the first
 * stage, else the previous stage's output activation, float32 (batch,
 * in_elems) - and gives its output: the logits for the last stage, else
 * the activation (batch, out_elems). Backward takes the output's gradient
 * and, for a stage after the first, leaves the input's gradient in
 * tdm_model_input_grad (valid until the next backward on this model).
 * The input of a forward must stay unchanged until its backward. */
#ifndef TDM_MODELS_STAGE_H
#define TDM_MODELS_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/status.h"
#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The number of pipeline layers of a spec (INVALID_ARG for a bad spec). */
tdm_status tdm_model_spec_n_layers(const tdm_model_spec *s, int *n);

/* What each pipeline layer costs, for balancing stages: parameter
 * elements (alignment padding included) and the gemm multiply-adds of a
 * forward and a backward per sample (3x the forward's; layers without a
 * gemm - batchnorm, pooling, flatten, the embeddings - count 0). */
typedef struct tdm_model_layer_cost {
    int64_t param_elems;
    double flops;
    int no_cut;     /* 1: no stage may start here (inside a model file's residual block) */
} tdm_model_layer_cost;
/* The model can be cut into pipeline stages at all: INVALID_ARG for a
 * GPT with an untied head (a model file's `lmhead`), which runs whole. */
tdm_status tdm_model_spec_check_stages(const tdm_model_spec *s);
/* A split (the first layer of each of `stages` stages) that cuts no
 * model file's residual block: else INVALID_ARG naming the block's line. */
tdm_status tdm_model_spec_check_split(const tdm_model_spec *s, const int *first, int stages);
/* Tensor-parallel pipeline stages of a model file (a TDM_MODEL_SEQ spec
 * cut by first[0..stages), N ranks per stage; tools/rank_pptp.h): within
 * a stage its linear layers pair up from the first, column-parallel then
 * row-parallel (the stage's odd last one whole); kinds[0..n) (n the
 * spec's pipeline layers) says each layer's partial sum
 * (tdm_model_set_partial_sums); *narrow is the spec with each
 * column-parallel layer's output width divided by N, whose tensors are
 * one rank's slices. Between a column layer and its row layer only
 * elementwise layers may stand (relu, gelu, tanh, sigmoid, dropout: they
 * run on the rank's columns); layers outside a pair run whole on every
 * rank. One-line USAGE errors naming the file's line: another layer
 * inside a pair (a layernorm: it normalises over all of a sample's
 * features, which the pair splits), a width N does not divide. */
tdm_status tdm_model_spec_tp_stages(const tdm_model_spec *s, const int *first, int stages, int N,
                                    tdm_model_partial *kinds, int n, tdm_model_spec *narrow);
/* out: n entries (n from tdm_model_spec_n_layers). */
tdm_status tdm_model_spec_layer_costs(const tdm_model_spec *s, tdm_model_layer_cost *out, int n);

/* The model of pipeline layers [lo, hi) of spec on dev, its parameters
 * those of tdm_model_init(spec, seed) for its tensors. */
tdm_status tdm_model_init_stage(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                                uint64_t seed, int lo, int hi);

typedef struct tdm_model_stage_info {
    int lo, hi, n_layers;        /* pipeline layers [lo, hi) of n_layers */
    int is_first, is_last;       /* it holds layer 0 / layer n_layers - 1 */
    int param_first;             /* the whole model's index of its tensor 0 */
    int n_slice_params;          /* tensors of the slice (a tied copy follows) */
    int64_t slice_offset;        /* where the slice's floats start in the whole model's
                                    flat parameter buffer */
    int64_t slice_elems;         /* how many (the tied copy's not included) */
    int64_t buffer_offset;       /* the same for the buffer of buffers */
    int tied_param;              /* the tied copy's index in this model, -1: none */
    int tied_source;             /* the whole model's tensor it copies */
    int64_t tied_source_offset;  /* and where that tensor starts in the whole buffer */
    int64_t in_elems;            /* per sample: the input (4-byte elements) */
    int64_t out_elems;           /* per sample: the output (logits: out_rows x classes) */
} tdm_model_stage_info;
void tdm_model_get_stage(const tdm_model *m, tdm_model_stage_info *out);
int64_t tdm_model_stage_in_elems(const tdm_model *m);
int64_t tdm_model_stage_out_elems(const tdm_model *m);

/* Forward of the stage over `batch` samples: x its input (see above);
 * *y its output, owned by the model, in the current activation set. */
tdm_status tdm_model_stage_forward(tdm_model *m, const void *x, int batch, const float **y);
/* Backward of the current set's forward from dy (batch, out_elems),
 * adding into the gradients; *dx (may be NULL) the input's gradient, NULL
 * for the first stage. */
tdm_status tdm_model_stage_backward(tdm_model *m, const float *dy, const float **dx);
/* The last backward's input gradient (NULL for the first stage). */
const float *tdm_model_input_grad(const tdm_model *m);

/* --- activation sets -------------------------------------------------------
 * A forward writes its activations into the current set and a backward
 * goes back through the current set's forward; selecting another set
 * parks the current one (nothing is copied) so that several forwards can
 * wait for their backwards. Sets are allocated when first used, sized by
 * the largest batch each has run, and kept (freed with the model or
 * tdm_model_set_conv_chunk). The scratch that backward uses (gradient
 * buffers, convolution chunks) is shared by all sets. A model that never
 * selects uses set 0. */
#define TDM_MODEL_MAX_ACT_SETS 4096
tdm_status tdm_model_select_act_set(tdm_model *m, int set);
int tdm_model_act_set(const tdm_model *m);
/* Bytes every set holds together, and the shared scratch. */
void tdm_model_act_bytes(const tdm_model *m, size_t *sets, size_t *scratch);
/* Bytes the current set holds. */
size_t tdm_model_act_set_bytes(const tdm_model *m);

#ifdef __cplusplus
}
#endif

#endif
