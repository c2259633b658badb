/* models/gpt.h: a GPT-2-style byte-level language model (tdm_model kind
 * TDM_MODEL_GPT) and text generation from it.
 *
 * gpt:L-D-H-T is L pre-LayerNorm blocks of width D over a context of T
 * bytes (vocabulary 256, no tokenizer): learned token and position
 * embeddings, then per block x += attn(ln_1(x)), x += mlp(ln_2(x)) with
 * causal multi-head self-attention (H heads of D/H) and an MLP of width 4D
 * with GELU (tanh form, as GPT-2), a final LayerNorm and an output head
 * tied to the token embedding (logits = ln_f(x) wte^T, no bias), trained
 * with cross-entropy on the next byte at every position.
 *
 * Parameters carry GPT-2's names in nanoGPT's layout (nn.Linear's
 * (out, in) weights): transformer.wte.weight (256, D),
 * transformer.wpe.weight (T, D), transformer.h.<i>.{ln_1, attn.c_attn,
 * attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}.{weight, bias},
 * transformer.ln_f.{weight, bias}; lm_head.weight is transformer.wte.weight
 * (tied) and is not stored twice. A checkpoint loads into nanoGPT's GPT
 * (bias=True, vocab_size=256, block_size=T) with strict=False; Hugging
 * Face's GPT2 stores c_attn/c_proj/c_fc as Conv1D, i.e. transposed.
 * Initialisation as GPT-2: weights and embeddings N(0, 0.02), the two
 * c_proj weights N(0, 0.02/sqrt(2L)), biases 0, LayerNorm weight 1.
 *
 * The model is a tdm_model like the others (flat buffers, grad-ready hook,
 * forward/backward/loss of models/model.h, inputs int32 tokens (B, T),
 * T targets per sample). Backward announces parameter groups end to start:
 * ln_f, then per block (last first) mlp.c_proj, mlp.c_fc, ln_2,
 * attn.c_proj, attn.c_attn, ln_1, and last the embeddings (wte, wpe):
 * wte's gradient is only complete there, after the tied head's share was
 * added at the start of backward. */
#ifndef TDM_MODELS_GPT_H
#define TDM_MODELS_GPT_H

#include <stdint.h>

#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The default model, small enough to learn readable text on two cores in
 * minutes. */
#define TDM_GPT_DEFAULT_LAYERS 4
#define TDM_GPT_DEFAULT_WIDTH 128
#define TDM_GPT_DEFAULT_HEADS 4
#define TDM_GPT_DEFAULT_CONTEXT 128
#define TDM_GPT_VOCAB 256
/* The largest L the parameter and layer tables hold. */
#define TDM_GPT_MAX_LAYERS 42

void tdm_model_spec_gpt(tdm_model_spec *s, int n_layer, int n_embd, int n_head, int n_ctx);

/* Forward over the first seq_len (1..T) positions of each of `batch`
 * token rows (tokens: device memory, (batch, seq_len)): *logits is
 * (batch * seq_len, 256). Causal attention makes position t's logits the
 * same as in a forward over the full context. For generation and
 * evaluation only: a following tdm_model_backward is refused. */
tdm_status tdm_gpt_forward_seq(tdm_model *m, const int32_t *tokens, int batch, int seq_len,
                               const float **logits);

/* Continues prompt (n_prompt >= 1 tokens, host memory) by n_new tokens,
 * each drawn from softmax(logits / temperature) of the last position given
 * the last T tokens so far (temperature 0: the most likely token), with
 * random numbers from the stream (seed, TDM_RNG_STREAM_SAMPLE). Every new
 * token goes to emit (may be NULL) as soon as it is drawn, and to out
 * (may be NULL; n_new entries). Runs in eval mode (restores the mode). */
tdm_status tdm_gpt_generate(tdm_model *m, const int32_t *prompt, int n_prompt, int n_new,
                            float temperature, uint64_t seed, int32_t *out,
                            void (*emit)(void *ctx, int32_t token), void *emit_ctx);

#ifdef __cplusplus
}
#endif

#endif
