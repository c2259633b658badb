/* models/gpt_low.c: the GPT's passes in BF16 and FP16 (models/precision.h),
 * over the current activation set of a whole model or a pipeline stage.
 * Every product reads 16-bit operands through tdm_dev_gemm_ex and sums in
 * float32; LayerNorm, the attention softmax, GELU and the residual stream
 * stay float32. What a block keeps: ln_1's and ln_2's outputs, c_attn's
 * output (q, k and v in place: each head reads its columns with the row
 * stride 3C, no split), the attention probabilities, the heads' output,
 * c_fc's output and its GELU, all rounded; res1, res2 and the LayerNorm
 * statistics in float32. The heads' products write straight into the
 * merged (N, C) or (N, 3C) layouts (row stride C or 3C, head stride hd),
 * one strided-batched product over the H heads per window.
 *
 * Rounding: every kept tensor is rounded once, where it is made, and the
 * next reader reads the rounded values (GELU's input is c_fc's rounded
 * output; the softmax reads the float32 scores of its product and its
 * backward the rounded probabilities). Gradients flow in float32 and are
 * rounded only as a product's operand; weight gradients are summed in
 * float32 straight into the float32 gradient buffer. Not here: FP32
 * (models/gpt.c), which this file does not change. */
#include "models/gpt_impl.h"

#include <math.h>

static float *tdm_gpt_lp(tdm_model *m, int i) { return tdm_model_pdata(m, i); }
static float *tdm_gpt_lg(tdm_model *m, int i) { return tdm_model_gdata(m, i); }

/* y (N, out) = x16 (N, in) W^T (+ beta y): a linear layer's product. */
static tdm_status tdm_gpt_lin(tdm_model *m, const void *x16, int w, int64_t N, int in, int out,
                              float beta, float *y)
{
    return tdm_dev_gemm_rm_ex(m->dev, TDM_TRANS_N, TDM_TRANS_T, (int)N, out, in, 1.0f, x16, in,
                              tdm_model_wlow(m, w), in, beta, y, out, m->lev.adt);
}

/* A linear layer's backward from dy (N, out, float32): dy rounded into
 * g->low; dW += dy16^T x16; db += the column sums of dy (float32); dx
 * (N, in) = dy16 W. */
static tdm_status tdm_gpt_lin_bwd(tdm_model *m, const void *x16, int w, const float *dy,
                                  int64_t N, int in, int out, float *dx)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_dtype t = m->lev.adt;
    TDM_CHECK(tdm_dev_convert(d, g->low, t, dy, TDM_DTYPE_FLOAT32, N * out));
    TDM_CHECK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_T, TDM_TRANS_N, out, in, (int)N, 1.0f, g->low, out,
                                 x16, in, 1.0f, tdm_gpt_lg(m, w), in, t));
    TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, 1, out, (int)N, 1.0f, g->ones, dy,
                              1.0f, tdm_gpt_lg(m, w + 1)));
    return tdm_dev_gemm_rm_ex(d, TDM_TRANS_N, TDM_TRANS_N, (int)N, in, out, 1.0f, g->low, out,
                              tdm_model_wlow(m, w), in, 0.0f, dx, in, t);
}

/* y (N, C) += x16 (N, in) W^T, a projection onto the stream (the bias
 * after): accumulated by the gemm (the whole model), or (a
 * tensor-parallel slice, row-parallel) the product summed over the group
 * by the partial-sum callback first, then added, as in float32. */
static tdm_status tdm_gpt_proj_low(tdm_model *m, const void *x16, int w, int64_t N, int in,
                                   float *y, int layer)
{
    tdm_gpt *g = m->ext;
    if (g->tp == 1) return tdm_gpt_lin(m, x16, w, N, in, g->C, 1.0f, y);
    TDM_CHECK(tdm_gpt_lin(m, x16, w, N, in, g->C, 0.0f, g->part));
    TDM_CHECK(m->partial(m->partial_ctx, g->part, N * g->C, layer));
    return tdm_dev_axpy(m->dev, N * g->C, 1.0f, g->part, y);
}

/* A column-parallel layer's input gradient dx (N, C): partial on a
 * tensor-parallel slice, summed over the group (the callback). */
static tdm_status tdm_gpt_sum_dx_low(tdm_model *m, float *dx, int64_t N, int layer)
{
    tdm_gpt *g = m->ext;
    return g->tp == 1 ? TDM_STATUS_OK : m->partial(m->partial_ctx, dx, N * g->C, layer);
}

/* 16-bit element offset into a tensor. */
static const void *tdm_gpt_at(const void *p, int64_t elems, tdm_dtype t)
{
    return (const char *)p + (size_t)elems * tdm_dtype_size(t);
}

/* Causal attention of one block over the rounded qkv (N, 3Ca): scores
 * (float32, B Hl T T in g->datt), softmax, probabilities rounded into
 * atth, the heads' output merged into g->yh (N, Ca, float32). A
 * tensor-parallel slice holds Hl of the H heads, Ca = C/tp wide; the
 * whole model Hl = H, Ca = C. */
static tdm_status tdm_gpt_attention_low(tdm_model *m, tdm_gpt_block *b, int B, int T)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_dtype t = m->lev.adt;
    int C = g->Ca, H = g->Hl, hd = C / H;
    long long tt = (long long)T * T;
    float scale = 1.0f / sqrtf((float)hd);
    for (int w = 0; w < B; w++) {
        /* window w's rows of qkv; head h's q at column h*hd (k: + C, v: + 2C) */
        const void *q = tdm_gpt_at(b->qkvh, (int64_t)w * T * 3 * C, t);
        TDM_CHECK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_N, TDM_TRANS_T, T, T, hd, scale,
                                                     q, 3 * C, hd, tdm_gpt_at(q, C, t), 3 * C, hd,
                                                     0.0f, g->datt + (int64_t)w * H * tt, T, tt,
                                                     H, t));
    }
    TDM_CHECK(tdm_dev_attn_softmax_fwd(d, g->datt, (int64_t)B * H * T, T));
    TDM_CHECK(tdm_dev_convert(d, b->atth, t, g->datt, TDM_DTYPE_FLOAT32, (int64_t)B * H * tt));
    for (int w = 0; w < B; w++) {
        const void *v = tdm_gpt_at(b->qkvh, (int64_t)w * T * 3 * C + 2 * C, t);
        TDM_CHECK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_N, TDM_TRANS_N, T, hd, T, 1.0f,
                                                     tdm_gpt_at(b->atth, w * H * tt, t), T, tt, v,
                                                     3 * C, hd, 0.0f,
                                                     g->yh + (int64_t)w * T * C, C, hd, H, t));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_gpt_block_forward_low(tdm_model *m, int l, const float *res, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    tdm_dtype t = m->lev.adt;
    int C = g->C, Ca = g->Ca, F = g->F;   /* a slice's heads' width and c_fc rows */
    int64_t N = (int64_t)B * Tr;
    size_t row_bytes = (size_t)N * C * sizeof(float);
#define P(j) tdm_gpt_lp(m, tdm_gpt_p(g, l, (j)))
    /* ln_1 in float32 into dln (free in forward), rounded for c_attn */
    TDM_CHECK(tdm_dev_layernorm_fwd(d, res, P(TDM_GPT_LN1_W), P(TDM_GPT_LN1_B), g->dln,
                                    b->ln1_mean, b->ln1_rstd, N, C, TDM_GPT_LN_EPS));
    TDM_CHECK(tdm_dev_convert(d, b->ln1h, t, g->dln, TDM_DTYPE_FLOAT32, N * C));
    TDM_CHECK(tdm_gpt_lin(m, b->ln1h, tdm_gpt_p(g, l, TDM_GPT_ATTN_W), N, C, 3 * Ca, 0.0f,
                          g->qkv));
    TDM_CHECK(tdm_dev_bias_act(d, g->qkv, P(TDM_GPT_ATTN_B), N, 3 * Ca, TDM_ACT_NONE));
    TDM_CHECK(tdm_dev_convert(d, b->qkvh, t, g->qkv, TDM_DTYPE_FLOAT32, N * 3 * Ca));
    TDM_CHECK(tdm_gpt_attention_low(m, b, B, Tr));
    TDM_CHECK(tdm_dev_convert(d, b->attyh, t, g->yh, TDM_DTYPE_FLOAT32, N * Ca));
    /* x + attn(ln_1(x)) */
    TDM_CHECK(tdm_dev_copy(d, b->res1, res, row_bytes));
    TDM_CHECK(tdm_gpt_proj_low(m, b->attyh, tdm_gpt_p(g, l, TDM_GPT_APROJ_W), N, Ca, b->res1,
                               tdm_gpt_layer(g, l, 2)));
    TDM_CHECK(tdm_dev_bias_act(d, b->res1, P(TDM_GPT_APROJ_B), N, C, TDM_ACT_NONE));
    TDM_CHECK(tdm_dev_layernorm_fwd(d, b->res1, P(TDM_GPT_LN2_W), P(TDM_GPT_LN2_B), g->dln,
                                    b->ln2_mean, b->ln2_rstd, N, C, TDM_GPT_LN_EPS));
    TDM_CHECK(tdm_dev_convert(d, b->ln2h, t, g->dln, TDM_DTYPE_FLOAT32, N * C));
    /* c_fc into dfc (free in forward), rounded; GELU of the rounded
     * values in place, rounded again for c_proj */
    TDM_CHECK(tdm_gpt_lin(m, b->ln2h, tdm_gpt_p(g, l, TDM_GPT_FC_W), N, C, F, 0.0f, g->dfc));
    TDM_CHECK(tdm_dev_bias_act(d, g->dfc, P(TDM_GPT_FC_B), N, F, TDM_ACT_NONE));
    TDM_CHECK(tdm_model_round(m, g->dfc, b->fchh, N * F));
    TDM_CHECK(tdm_dev_gelu_fwd(d, g->dfc, g->dfc, N * F));
    TDM_CHECK(tdm_dev_convert(d, b->fcgh, t, g->dfc, TDM_DTYPE_FLOAT32, N * F));
    TDM_CHECK(tdm_dev_copy(d, b->res2, b->res1, row_bytes));
    TDM_CHECK(tdm_gpt_proj_low(m, b->fcgh, tdm_gpt_p(g, l, TDM_GPT_MPROJ_W), N, F, b->res2,
                               tdm_gpt_layer(g, l, 5)));
    TDM_CHECK(tdm_dev_bias_act(d, b->res2, P(TDM_GPT_MPROJ_B), N, C, TDM_ACT_NONE));
#undef P
    return TDM_STATUS_OK;
}

/* From the heads' output gradient in g->dln (N, Ca): the gradient of the
 * block's qkv, merged in g->qkv (N, 3Ca). */
static tdm_status tdm_gpt_attention_bwd_low(tdm_model *m, tdm_gpt_block *b, int B, int T)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_dtype t = m->lev.adt;
    int C = g->Ca, H = g->Hl, hd = C / H;
    long long tt = (long long)T * T;
    int64_t N = (int64_t)B * T;
    float scale = 1.0f / sqrtf((float)hd);
    TDM_CHECK(tdm_dev_convert(d, g->low, t, g->dln, TDM_DTYPE_FLOAT32, N * C));
    for (int w = 0; w < B; w++) {
        const void *dy = tdm_gpt_at(g->low, (int64_t)w * T * C, t);
        const void *v = tdm_gpt_at(b->qkvh, (int64_t)w * T * 3 * C + 2 * C, t);
        /* datt (T, T) = dy (T, hd) v^T; dv (T, hd) = att^T dy */
        TDM_CHECK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_N, TDM_TRANS_T, T, T, hd, 1.0f,
                                                     dy, C, hd, v, 3 * C, hd, 0.0f,
                                                     g->datt + (int64_t)w * H * tt, T, tt, H, t));
        TDM_CHECK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_T, TDM_TRANS_N, T, hd, T, 1.0f,
                                                     tdm_gpt_at(b->atth, w * H * tt, t), T, tt, dy,
                                                     C, hd, 0.0f,
                                                     g->qkv + (int64_t)w * T * 3 * C + 2 * C,
                                                     3 * C, hd, H, t));
    }
    /* through the softmax, with the rounded probabilities the forward's
     * second product read */
    TDM_CHECK(tdm_dev_convert(d, g->wide, TDM_DTYPE_FLOAT32, b->atth, t, (int64_t)B * H * tt));
    TDM_CHECK(tdm_dev_attn_softmax_bwd(d, g->wide, g->datt, (int64_t)B * H * T, T));
    TDM_CHECK(tdm_dev_convert(d, g->low, t, g->datt, TDM_DTYPE_FLOAT32, (int64_t)B * H * tt));
    for (int w = 0; w < B; w++) {
        const void *ds = tdm_gpt_at(g->low, w * H * tt, t);
        const void *q = tdm_gpt_at(b->qkvh, (int64_t)w * T * 3 * C, t);
        float *dq = g->qkv + (int64_t)w * T * 3 * C;
        /* scores = scale q k^T: dq = scale ds k; dk = scale ds^T q */
        TDM_CHECK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_N, TDM_TRANS_N, T, hd, T, scale,
                                                     ds, T, tt, tdm_gpt_at(q, C, t), 3 * C, hd,
                                                     0.0f, dq, 3 * C, hd, H, t));
        TDM_CHECK(tdm_dev_gemm_rm_strided_batched_ex(d, TDM_TRANS_T, TDM_TRANS_N, T, hd, T, scale,
                                                     ds, T, tt, q, 3 * C, hd, 0.0f, dq + C, 3 * C,
                                                     hd, H, t));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_gpt_block_backward_low(tdm_model *m, int l, const float *res_in, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_gpt_block *b = &g->a->blk[l - g->b0];
    int C = g->C, Ca = g->Ca, F = g->F;
    int64_t N = (int64_t)B * Tr;
#define P(j) tdm_gpt_lp(m, tdm_gpt_p(g, l, (j)))
#define G(j) tdm_gpt_lg(m, tdm_gpt_p(g, l, (j)))
    /* x += mlp(ln_2(x)): c_proj's output gradient is dres */
    TDM_CHECK(tdm_gpt_lin_bwd(m, b->fcgh, tdm_gpt_p(g, l, TDM_GPT_MPROJ_W), g->dres, N, F, C,
                              g->dfc));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 5));
    TDM_CHECK(tdm_dev_convert(d, g->wide, TDM_DTYPE_FLOAT32, b->fchh, m->lev.adt, N * F));
    TDM_CHECK(tdm_dev_gelu_bwd(d, g->wide, g->dfc, g->dfc, N * F));
    TDM_CHECK(tdm_gpt_lin_bwd(m, b->ln2h, tdm_gpt_p(g, l, TDM_GPT_FC_W), g->dfc, N, C, F, g->dln));
    TDM_CHECK(tdm_gpt_sum_dx_low(m, g->dln, N, tdm_gpt_layer(g, l, 4)));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 4));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, b->res1, g->dln, P(TDM_GPT_LN2_W), b->ln2_mean,
                                    b->ln2_rstd, g->dres, G(TDM_GPT_LN2_W), G(TDM_GPT_LN2_B), N,
                                    C));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 3));
    /* x += attn(ln_1(x)) */
    TDM_CHECK(tdm_gpt_lin_bwd(m, b->attyh, tdm_gpt_p(g, l, TDM_GPT_APROJ_W), g->dres, N, Ca, C,
                              g->dln));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 2));
    TDM_CHECK(tdm_gpt_attention_bwd_low(m, b, B, Tr));
    TDM_CHECK(tdm_gpt_lin_bwd(m, b->ln1h, tdm_gpt_p(g, l, TDM_GPT_ATTN_W), g->qkv, N, C, 3 * Ca,
                              g->dln));
    TDM_CHECK(tdm_gpt_sum_dx_low(m, g->dln, N, tdm_gpt_layer(g, l, 1)));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 1));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, res_in, g->dln, P(TDM_GPT_LN1_W), b->ln1_mean,
                                    b->ln1_rstd, g->dres, G(TDM_GPT_LN1_W), G(TDM_GPT_LN1_B), N,
                                    C));
    tdm_gpt_hook(m, tdm_gpt_layer(g, l, 0));
#undef P
#undef G
    return TDM_STATUS_OK;
}

tdm_status tdm_gpt_head_forward_low(tdm_model *m, const float *res, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    int C = g->C, pf = tdm_gpt_p_lnf(g);
    int64_t N = (int64_t)B * Tr;
    tdm_gpt_act *a = g->a;
    TDM_CHECK(tdm_dev_layernorm_fwd(d, res, tdm_gpt_lp(m, pf), tdm_gpt_lp(m, pf + 1), g->dln,
                                    a->lnf_mean, a->lnf_rstd, N, C, TDM_GPT_LN_EPS));
    TDM_CHECK(tdm_dev_convert(d, a->lnfh, m->lev.adt, g->dln, TDM_DTYPE_FLOAT32, N * C));
    /* logits (float32) = ln_f(x) wte^T (a later stage: its tied copy);
     * the head's use is raised once ln_f is done with, as in float32 (a
     * sharded model may release ln_f's unit when the head's is gathered) */
    TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, g->p_head, g->p_head));
    TDM_CHECK(tdm_model_cast_params(m, g->p_head, g->p_head));
    return tdm_gpt_lin(m, a->lnfh, g->p_head, N, C, g->V, 0.0f, a->logits);
}

tdm_status tdm_gpt_head_backward_low(tdm_model *m, const float *dlogits, int B, int Tr)
{
    tdm_gpt *g = m->ext;
    tdm_device *d = m->dev;
    tdm_dtype t = m->lev.adt;
    int C = g->C, V = g->V;
    int64_t N = (int64_t)B * Tr;
    /* the tied head has no bias: dwte += dlogits16^T ln_f16; dln = dlogits16 wte16 */
    tdm_gpt_act *a = g->a;
    TDM_CHECK(tdm_dev_convert(d, g->low, t, dlogits, TDM_DTYPE_FLOAT32, N * V));
    TDM_CHECK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_T, TDM_TRANS_N, V, C, (int)N, 1.0f, g->low, V,
                                 a->lnfh, C, 1.0f, tdm_gpt_lg(m, g->p_head), C, t));
    TDM_CHECK(tdm_dev_gemm_rm_ex(d, TDM_TRANS_N, TDM_TRANS_N, (int)N, C, V, 1.0f, g->low, V,
                                 tdm_model_wlow(m, g->p_head), C, 0.0f, g->dln, C, t));
    return TDM_STATUS_OK;
}
