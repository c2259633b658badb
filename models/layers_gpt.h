/* models/layers_gpt.h: the transformer's layers as functions over device
 * memory: linear (and the tied output head, a linear without bias that
 * reads the token embedding), causal multi-head self-attention, and the
 * thin ones (embedding, LayerNorm, GELU) that are one device kernel each.
 * models/gpt.c strings them into a GPT; tests/test_gpt_layers.c checks
 * each backward against finite differences on its own. They own no
 * memory: the caller passes activations and scratch.
 *
 * Shapes: N = B*T rows of C = D features, row-major. Forward writes its
 * output (or adds into it, where asked); backward adds into parameter
 * gradients and writes (or adds, where asked) the input gradient. */
#ifndef TDM_MODELS_LAYERS_GPT_H
#define TDM_MODELS_LAYERS_GPT_H

#include <stdint.h>

#include "core/device.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y (N, out) = x (N, in) W^T + b, W (out, in) as torch.nn.Linear; b may be
 * NULL. accumulate: y += instead of y = (the residual connections add
 * their branch onto the stream this way, with no extra pass). */
tdm_status tdm_layers_linear_fwd(tdm_device *d, const float *x, const float *w, const float *b,
                                 int64_t N, int in, int out, int accumulate, float *y);
/* dW += dy^T x; db += the column sums of dy (a gemm against ones, N
 * ones; db may be NULL); dx (may be NULL) = dy W, or += when
 * accumulate_dx. */
tdm_status tdm_layers_linear_bwd(tdm_device *d, const float *x, const float *w, const float *dy,
                                 const float *ones, int64_t N, int in, int out, float *dw,
                                 float *db, float *dx, int accumulate_dx);

/* Causal self-attention over the fused projection qkv (N, 3C): for each
 * batch b and head h, with q, k, v (T, hd) the head's columns of the
 * three C-wide thirds, y = softmax(q k^T / sqrt(hd) + mask) v, the mask
 * -inf above the diagonal (position t sees positions <= t); the heads' y
 * side by side in y (N, C). Keeps, for backward: q, k, v (B, H, T, hd)
 * and the probabilities att (B, H, T, T). yh: (B, H, T, hd) scratch. The
 * two products are strided-batched gemms over the B*H heads. */
typedef struct tdm_layers_attn {
    int B, T, H, C;        /* hd = C / H */
    float *q, *k, *v;      /* (B, H, T, hd) each, kept */
    float *att;            /* (B, H, T, T), kept */
} tdm_layers_attn;
tdm_status tdm_layers_attention_fwd(tdm_device *d, const tdm_layers_attn *a, const float *qkv,
                                    float *yh, float *y);
/* From dy (N, C): dqkv (N, 3C) written. Scratch: dyh, dq, dk, dv (B, H, T,
 * hd) each and datt (B, H, T, T). */
tdm_status tdm_layers_attention_bwd(tdm_device *d, const tdm_layers_attn *a, const float *dy,
                                    float *dyh, float *datt, float *dq, float *dk, float *dv,
                                    float *dqkv);

#ifdef __cplusplus
}
#endif

#endif
