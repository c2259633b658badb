/* models/gpt_impl.h: the inside of the GPT, shared by models/gpt.c (spec,
 * parameters, activations, the FP32 passes, checkpointing, generation)
 * and models/gpt_low.c (the passes of the 16-bit precisions). Not a
 * public header. */
#ifndef TDM_MODELS_GPT_IMPL_H
#define TDM_MODELS_GPT_IMPL_H

#include "models/gpt.h"
#include "models/model_impl.h"

#define TDM_GPT_LN_EPS 1e-5f
/* parameters per block, and their order inside it */
#define TDM_GPT_PER_BLOCK 12
enum {
    TDM_GPT_LN1_W = 0, TDM_GPT_LN1_B, TDM_GPT_ATTN_W, TDM_GPT_ATTN_B, TDM_GPT_APROJ_W,
    TDM_GPT_APROJ_B, TDM_GPT_LN2_W, TDM_GPT_LN2_B, TDM_GPT_FC_W, TDM_GPT_FC_B,
    TDM_GPT_MPROJ_W, TDM_GPT_MPROJ_B,
};
#define TDM_GPT_WTE 0
#define TDM_GPT_WPE 1

/* What one block keeps for backward (room for cap windows of T). FP32:
 * the float tensors; BF16/FP16: the residual stream (res1, res2) and the
 * LayerNorm statistics in float32, the rest as 16-bit tensors (the
 * pointers ending in h), q, k and v together in their c_attn layout. */
typedef struct tdm_gpt_block {
    float *ln1, *ln1_mean, *ln1_rstd;   /* ln_1 output (N, C) and its statistics */
    float *q, *k, *v, *att;             /* attention's (B, H, T, hd) and (B, H, T, T) */
    float *atty;                        /* heads merged (N, C): attn.c_proj's input */
    float *res1;                        /* stream after attention (N, C) */
    float *ln2, *ln2_mean, *ln2_rstd;
    float *fch, *fcg;                   /* mlp.c_fc output, and its gelu (N, 4C) */
    float *res2;                        /* block output (N, C) */
    void *ln1h, *qkvh, *atth, *attyh, *ln2h, *fchh, *fcgh;  /* 16-bit: (N, C), (N, 3C),
                                           (B, H, T, T), (N, C), (N, C), (N, 4C), (N, 4C) */
} tdm_gpt_block;

typedef struct tdm_gpt {
    int L, C, H, T, V;
    int seq;                 /* positions of the last forward */
    const int32_t *tok;      /* borrowed: the last forward's tokens (device) */
    int32_t *tok_host;       /* host copy for the range check (non-host devices) */
    float *res0;             /* embeddings (N, C) */
    tdm_gpt_block *blk;      /* L */
    float *lnf, *lnf_mean, *lnf_rstd, *logits;
    void *lnfh;              /* 16-bit: ln_f's output rounded, the head's input */
    /* scratch shared by the blocks */
    float *qkv;              /* forward: c_attn output (N, 3C); backward: its gradient */
    float *yh;               /* forward: heads' outputs; backward: their gradient (N*C) */
    float *dres, *dln;       /* (N, C): the stream's gradient; a LayerNorm output's */
    float *dfc;              /* (N, 4C) */
    float *datt;             /* (B, H, T, T) */
    float *dq, *dk, *dv;     /* (B, H, T, hd); FP32 only */
    float *ones;             /* N ones: bias gradients as gemms */
    void *low;               /* 16-bit: a gradient rounded for a product */
    float *wide;             /* 16-bit: a kept tensor widened for a float32 kernel */
} tdm_gpt;

static inline int tdm_gpt_p(int l, int j) { return 2 + TDM_GPT_PER_BLOCK * l + j; }
static inline int tdm_gpt_p_lnf(int L) { return 2 + TDM_GPT_PER_BLOCK * L; }
/* Logical layers: 0 embeddings; block l's six at 1 + 6l + (ln_1, c_attn,
 * attn.c_proj, ln_2, c_fc, mlp.c_proj); ln_f at 1 + 6L; the head last. */
static inline int tdm_gpt_layer(int l, int j) { return 1 + 6 * l + j; }

/* The grad-ready hook for a logical layer, if set. */
void tdm_gpt_hook(tdm_model *m, int layer);

/* models/gpt_low.c: the passes of BF16 and FP16, over the rounded
 * tensors (models/precision.h says what is rounded where). Block l's
 * forward from the stream res (B windows of Tr), writing its kept
 * tensors and res2; its backward from g->dres (the gradient of res2),
 * leaving the gradient of its input in g->dres, calling the hooks; the
 * final LayerNorm and head forward (logits) and backward. */
tdm_status tdm_gpt_block_forward_low(tdm_model *m, int l, const float *res, int B, int Tr);
tdm_status tdm_gpt_block_backward_low(tdm_model *m, int l, const float *res_in, int B, int Tr);
tdm_status tdm_gpt_head_forward_low(tdm_model *m, const float *res, int B, int Tr);
tdm_status tdm_gpt_head_backward_low(tdm_model *m, const float *res, const float *dlogits, int B,
                                     int Tr);

#endif
