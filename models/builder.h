/* models/builder.h: models as a list of layers, in C (the builder) and
 * as a plain-text model file parsed into the same calls.
 *
 * A builder spec starts from its input shape, and each call appends one
 * layer whose output shape is inferred from the current one; a call that
 * does not fit the current shape fails naming both, and leaves the spec
 * as it was. tdm_model_seq_finish checks the whole (blocks closed, the
 * output a vector of at least 2 classes); tdm_model_init takes the
 * result. The spec is plain data (no pointers): it can be copied, and
 * every process of a parallel run parses the same file into the same
 * bytes.
 *
 *     tdm_model_spec s;
 *     tdm_model_seq_init(&s, 1, 28, 28);          // (C, H, W) input
 *     tdm_model_seq_conv(&s, 32, 3, 1, 1);        // 32 channels, 3x3, stride 1, pad 1
 *     tdm_model_seq_batchnorm(&s);
 *     tdm_model_seq_act(&s, TDM_MODEL_OP_RELU);
 *     tdm_model_seq_residual_open(&s);
 *     ...
 *     tdm_model_seq_residual_close(&s, 0);        // 1: through a projection
 *     tdm_model_seq_pool(&s, TDM_MODEL_OP_MAXPOOL, 2);
 *     tdm_model_seq_flatten(&s);
 *     tdm_model_seq_linear(&s, 10);
 *     tdm_model_seq_finish(&s);
 *     tdm_model_init(&m, dev, &s, seed);
 *
 * A GPT is written the same way from tdm_model_seq_init_tokens (below).
 *
 * Layers and their tensors (named by kind and count, in file order:
 * conv1, bn1, fc1, res1.proj): docs/MODELS.md. Layouts: images are
 * (C, H, W) per sample, features a vector; linear needs features
 * (flatten first). */
#ifndef TDM_MODELS_BUILDER_H
#define TDM_MODELS_BUILDER_H

#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest width, channel count or image side a builder accepts. */
#define TDM_MODEL_SEQ_MAX_DIM (1 << 20)
/* Largest per-sample activation (elements) a layer may produce. */
#define TDM_MODEL_SEQ_MAX_ELEMS ((int64_t)1 << 28)

/* An empty spec reading images of c x h x w (c, h, w >= 1) ... */
tdm_status tdm_model_seq_init(tdm_model_spec *s, int c, int h, int w);
/* ... or vectors of `features`. */
tdm_status tdm_model_seq_init_flat(tdm_model_spec *s, int features);

tdm_status tdm_model_seq_linear(tdm_model_spec *s, int out_features);
tdm_status tdm_model_seq_conv(tdm_model_spec *s, int out_channels, int k, int stride, int pad);
tdm_status tdm_model_seq_batchnorm(tdm_model_spec *s);
/* kind: TDM_MODEL_OP_RELU, _GELU, _TANH or _SIGMOID. */
tdm_status tdm_model_seq_act(tdm_model_spec *s, tdm_model_op_kind kind);
/* kind: TDM_MODEL_OP_MAXPOOL or _AVGPOOL; k x k windows at stride k
 * (a partial last window is dropped, as PyTorch's floor mode does). */
tdm_status tdm_model_seq_pool(tdm_model_spec *s, tdm_model_op_kind kind, int k);
/* Average over each channel's whole plane: (C, H, W) -> (C, 1, 1). */
tdm_status tdm_model_seq_avgpool_global(tdm_model_spec *s);
tdm_status tdm_model_seq_flatten(tdm_model_spec *s);
/* Dropout with probability p (0 <= p < 1): in training, each value is
 * zeroed with probability p and the others scaled by 1 / (1 - p), with a
 * mask that depends on the model's seed, how many training forwards the
 * model has run, the sample's input bytes and the value's place in the
 * sample - not on the rank, the batch or the sample's place in it, so
 * every parallel design drops the same values (docs/MODELS.md). The
 * identity in evaluation. */
tdm_status tdm_model_seq_dropout(tdm_model_spec *s, float p);
/* A residual block: output = block(x) + x, or + proj(x) when proj is 1
 * (a 1x1 convolution of the stride that maps x's plane onto the block's
 * output, or a linear layer for features). Without proj the block must
 * keep the shape. At most TDM_MODEL_MAX_NEST open at once. */
tdm_status tdm_model_seq_residual_open(tdm_model_spec *s);
tdm_status tdm_model_seq_residual_close(tdm_model_spec *s, int proj);
/* A GPT written as layers (docs/MODELS.md): an input of `context` token
 * ids (1..65536), then the token embedding (vocabulary 256: bytes), the
 * learned positions, blocks of two residuals - { layernorm, attention },
 * { layernorm, gptmlp } - and a final layernorm and the output head. A
 * model of tokens must follow this arrangement (each call checks that it
 * may come next); tdm_model_seq_finish makes it the TDM_MODEL_GPT spec
 * it is, so it trains bitwise as the built-in gpt:L-D-H-T, whose tensor
 * names it has (transformer.h.<i>.attn.c_attn.weight, ...). */
tdm_status tdm_model_seq_init_tokens(tdm_model_spec *s, int context);
/* (T tokens) -> (T, width) rows; vocab must be 256. */
tdm_status tdm_model_seq_embedding(tdm_model_spec *s, int vocab, int width);
/* Adds a learned vector per position (T, C) to the rows. */
tdm_status tdm_model_seq_pos_embedding(tdm_model_spec *s);
/* LayerNorm (eps 1e-5; weight 1, bias 0 at init): of each position's C
 * features in a model of tokens, of each sample's vector of features in
 * any other (lnK.weight, lnK.bias; not of an image: flatten first). */
tdm_status tdm_model_seq_layernorm(tdm_model_spec *s);
/* Causal multi-head self-attention: the fused q, k, v projection (3C),
 * `heads` heads of C/heads, the output projection (C). heads must
 * divide C and be the same in every block. */
tdm_status tdm_model_seq_attention(tdm_model_spec *s, int heads);
/* linear 4C, gelu (tanh form), linear C. */
tdm_status tdm_model_seq_gptmlp(tdm_model_spec *s);
/* The logits over the vocabulary at every position; tied: the token
 * embedding is the weight (the built-in GPT's), else a weight of its own,
 * lm_head.weight (256, C), N(0, 0.02) at init: that model is described as
 * its file ("file:x.tdm (gpt:L-D-H-T, untied head)") and runs whole (not
 * in pipeline stages or tensor parallel). */
tdm_status tdm_model_seq_lmhead(tdm_model_spec *s, int tied);
/* Any op by its fields (kind, n, k, kw, stride, pad, proj, line); the
 * calls above fill one. The shape fields are the builder's. */
tdm_status tdm_model_seq_add(tdm_model_spec *s, const tdm_model_op *op);
/* The spec is complete: no block open, output a vector of >= 2 classes,
 * at least one layer with parameters. */
tdm_status tdm_model_seq_finish(tdm_model_spec *s);

/* Parses a model file (docs/MODELS.md) into s: each line one layer,
 * errors as "PATH:LINE: `text`: what is wrong". What "file:PATH" in
 * tdm_model_spec_parse does. */
tdm_status tdm_model_seq_load(tdm_model_spec *s, const char *path);
/* The same from text in memory (name: what messages call it). */
tdm_status tdm_model_seq_parse_text(tdm_model_spec *s, const char *name, const char *text,
                                    size_t len);

/* "conv", "linear", ...: an op kind's name in model files. */
const char *tdm_model_op_name(tdm_model_op_kind kind);
/* The memory levers (--precision bf16|fp16, --checkpoint-activations)
 * take a SEQ spec made of the built-in MLP's and CNN's layers only
 * (linear, conv, batchnorm, a relu right after a linear or batchnorm,
 * maxpool, flatten): such a model trains with them bitwise as the built-in
 * model of the same layers. The index of the spec's first op they cannot
 * take, -1 when none (and for every kind but SEQ); and that refusal in
 * words, naming the op and its line ("" when none). */
int tdm_model_spec_lever_op(const tdm_model_spec *s);
void tdm_model_spec_lever_refusal(const tdm_model_spec *s, char *buf, size_t len);
/* 1 when the spec has a batchnorm layer (the CNN, a SEQ with one). */
int tdm_model_spec_has_batchnorm(const tdm_model_spec *s);

#ifdef __cplusplus
}
#endif

#endif
