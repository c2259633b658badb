/* models/gpt_impl.h: the inside of the GPT, shared by models/gpt.c (spec,
 * parameters, activation sets, the FP32 passes, checkpointing) and
 * models/gpt_low.c (the passes of the 16-bit precisions). Not a public
 * header. */
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
 * pointers ending in h), q, k and v together in c_attn's layout. */
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

/* One activation set: what a forward keeps for its backward. */
typedef struct tdm_gpt_act {
    int cap;                 /* windows it holds */
    int seq;                 /* positions of its forward */
    size_t bytes;
    const int32_t *tok;      /* borrowed: its forward's tokens (device; the first stage) */
    const float *in;         /* borrowed: its forward's input stream (a later stage) */
    float *res0;             /* embeddings (N, C) (the first stage) */
    tdm_gpt_block *blk;      /* the stage's blocks */
    float *lnf, *lnf_mean, *lnf_rstd, *logits;   /* the last stage */
    void *lnfh;              /* 16-bit: ln_f's output rounded, the head's input */
    void *arena;             /* checkpointing: one segment's blocks */
    struct tdm_act_layout *act;   /* what its reserve allocated (models/recompute.c) */
} tdm_gpt_act;

typedef struct tdm_gpt {
    int L, C, H, T, V;
    /* a tensor-parallel slice (tdm_model_spec.tp_ranks = tp > 1): its
     * heads Hl = H/tp of width Ca = C/tp side by side, c_fc's F = 4C/tp
     * rows; the whole model: tp 1, Hl H, Ca C, F 4C */
    int tp, Hl, Ca, F;
    float *part;             /* tp > 1: a row-parallel product (N, C), summed */
    /* sequence parallel (tdm_model_spec.tp_seq): the stream's rows of this
     * rank, Nl = N/tp of them from row off = rank * Nl (tdm_gpt_rows) */
    int sp;
    /* The stage: blocks [b0, b1) of L, with the embeddings (first stage)
     * and the final LayerNorm and head (last stage); local indices of the
     * tensors. The whole model is one stage of everything. */
    int b0, b1, nb;
    int has_emb, has_head;
    int p_blk0;              /* block b0's first tensor */
    int p_head;              /* the head's weight: wte (0), or the tied copy */
    int layer_blk0;          /* block b0's first logical layer */
    tdm_gpt_act *a;          /* the current set, in sets */
    tdm_gpt_act *sets;
    int n_sets;
    int32_t *tok_host;       /* host copy for the range check (non-host devices) */
    /* scratch shared by the blocks and the sets */
    int scratch_cap;
    size_t scratch_bytes;
    float *qkv;              /* forward: c_attn output (N, 3C); backward: its gradient */
    float *yh;               /* forward: heads' outputs; backward: their gradient (N*C) */
    float *dres, *dln;       /* (N, C): the stream's gradient; a LayerNorm output's */
    float *dfc;              /* (N, 4C) */
    float *datt;             /* (B, H, T, T) */
    float *dq, *dk, *dv;     /* (B, H, T, hd); FP32 only */
    float *ones;             /* N ones: bias gradients as gemms */
    void *low;               /* 16-bit: a gradient rounded for a product */
    float *wide;             /* 16-bit: a kept tensor widened for a float32 kernel */
    struct tdm_act_layout *act_scratch;   /* what reserve_scratch allocated */
} tdm_gpt;

/* Local index of block l's tensor j, and of ln_f's weight. */
static inline int tdm_gpt_p(const tdm_gpt *g, int l, int j)
{
    return g->p_blk0 + TDM_GPT_PER_BLOCK * (l - g->b0) + j;
}
static inline int tdm_gpt_p_lnf(const tdm_gpt *g) { return g->p_blk0 + TDM_GPT_PER_BLOCK * g->nb; }
/* Logical layers of the stage: the embeddings (first stage); block l's
 * six at layer_blk0 + 6 (l - b0) + (ln_1, c_attn, attn.c_proj, ln_2,
 * c_fc, mlp.c_proj); then ln_f and the head (last stage). */
static inline int tdm_gpt_layer(const tdm_gpt *g, int l, int j)
{
    return g->layer_blk0 + 6 * (l - g->b0) + j;
}

/* The gemm multiply-adds of a forward and a backward of one window
 * (models/gpt_spec.c; the model's vt). */
void tdm_gpt_gemm_flops(const tdm_model *m, double *fwd, double *bwd);

/* The grad-ready hook for a logical layer, if set. */
void tdm_gpt_hook(tdm_model *m, int layer);

/* models/gpt_low.c: the passes of BF16 and FP16 over the current set
 * (models/precision.h says what is rounded where). Block l's forward from
 * the stream res (B windows of Tr), writing its kept tensors and res2;
 * its backward from g->dres (the gradient of res2), leaving the gradient
 * of its input in g->dres, calling the hooks; the final LayerNorm and the
 * head: forward (the set's logits; raises the head's use after ln_f's)
 * and the head's backward (from dlogits, leaving ln_f's output gradient
 * in g->dln: the caller runs ln_f's backward, as in float32). */
tdm_status tdm_gpt_block_forward_low(tdm_model *m, int l, const float *res, int B, int Tr);
tdm_status tdm_gpt_block_backward_low(tdm_model *m, int l, const float *res_in, int B, int Tr);
tdm_status tdm_gpt_head_forward_low(tdm_model *m, const float *res, int B, int Tr);
tdm_status tdm_gpt_head_backward_low(tdm_model *m, const float *dlogits, int B, int Tr);

#endif
