/* models/layers_gpt.c: linear and causal self-attention over device
 * memory (see models/layers_gpt.h). The matrix products go through the
 * device's gemm (row-major helpers of core/device.h); attention's are
 * strided-batched over the B*H heads; everything else is a device kernel
 * from core/kernels.h. */
#include "models/layers_gpt.h"

#include <math.h>

tdm_status tdm_layers_linear_fwd(tdm_device *d, const float *x, const float *w, const float *b,
                                 int64_t N, int in, int out, int accumulate, float *y)
{
    TDM_REQUIRE(N <= INT32_MAX, TDM_STATUS_INVALID_ARG, "linear: %lld rows", (long long)N);
    TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_T, (int)N, out, in, 1.0f, x, w,
                              accumulate ? 1.0f : 0.0f, y));
    if (b) TDM_CHECK(tdm_dev_bias_act(d, y, b, N, out, TDM_ACT_NONE));
    return TDM_STATUS_OK;
}

tdm_status tdm_layers_linear_bwd(tdm_device *d, const float *x, const float *w, const float *dy,
                                 const float *ones, int64_t N, int in, int out, float *dw,
                                 float *db, float *dx, int accumulate_dx)
{
    TDM_REQUIRE(N <= INT32_MAX, TDM_STATUS_INVALID_ARG, "linear: %lld rows", (long long)N);
    /* dW (out, in) += dy^T (out, N) x (N, in) */
    TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_T, TDM_TRANS_N, out, in, (int)N, 1.0f, dy, x, 1.0f, dw));
    /* db (1, out) += ones (1, N) dy (N, out) */
    if (db)
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, 1, out, (int)N, 1.0f, ones, dy,
                                  1.0f, db));
    /* dx (N, in) = dy (N, out) W (out, in) */
    if (dx)
        TDM_CHECK(tdm_dev_gemm_rm(d, TDM_TRANS_N, TDM_TRANS_N, (int)N, in, out, 1.0f, dy, w,
                                  accumulate_dx ? 1.0f : 0.0f, dx));
    return TDM_STATUS_OK;
}

tdm_status tdm_layers_attention_fwd(tdm_device *d, const tdm_layers_attn *a, const float *qkv,
                                    float *yh, float *y)
{
    int B = a->B, T = a->T, H = a->H, C = a->C, hd = C / H;
    TDM_REQUIRE(B > 0 && T > 0 && H > 0 && C % H == 0, TDM_STATUS_INVALID_ARG,
                "attention: %d heads do not divide width %d", H, C);
    long long s_hd = (long long)T * hd, s_tt = (long long)T * T;
    float scale = 1.0f / sqrtf((float)hd);
    TDM_CHECK(tdm_dev_heads_split(d, qkv, 3 * C, 0, a->q, B, T, H, hd));
    TDM_CHECK(tdm_dev_heads_split(d, qkv, 3 * C, C, a->k, B, T, H, hd));
    TDM_CHECK(tdm_dev_heads_split(d, qkv, 3 * C, 2 * C, a->v, B, T, H, hd));
    /* scores (T, T) = q (T, hd) k^T / sqrt(hd), per head; the masked half
     * is computed and then zeroed by the softmax (one plain gemm beats
     * skipping it at these sizes) */
    TDM_CHECK(tdm_dev_gemm_rm_strided_batched(d, TDM_TRANS_N, TDM_TRANS_T, T, T, hd, scale, a->q,
                                              s_hd, a->k, s_hd, 0.0f, a->att, s_tt, B * H));
    TDM_CHECK(tdm_dev_attn_softmax_fwd(d, a->att, (int64_t)B * H * T, T));
    /* yh (T, hd) = att (T, T) v (T, hd) */
    TDM_CHECK(tdm_dev_gemm_rm_strided_batched(d, TDM_TRANS_N, TDM_TRANS_N, T, hd, T, 1.0f, a->att,
                                              s_tt, a->v, s_hd, 0.0f, yh, s_hd, B * H));
    return tdm_dev_heads_merge(d, yh, y, C, 0, B, T, H, hd);
}

tdm_status tdm_layers_attention_bwd(tdm_device *d, const tdm_layers_attn *a, const float *dy,
                                    float *dyh, float *datt, float *dq, float *dk, float *dv,
                                    float *dqkv)
{
    int B = a->B, T = a->T, H = a->H, C = a->C, hd = C / H;
    long long s_hd = (long long)T * hd, s_tt = (long long)T * T;
    float scale = 1.0f / sqrtf((float)hd);
    TDM_CHECK(tdm_dev_heads_split(d, dy, C, 0, dyh, B, T, H, hd));
    /* datt (T, T) = dyh (T, hd) v^T;  dv (T, hd) = att^T (T, T) dyh */
    TDM_CHECK(tdm_dev_gemm_rm_strided_batched(d, TDM_TRANS_N, TDM_TRANS_T, T, T, hd, 1.0f, dyh,
                                              s_hd, a->v, s_hd, 0.0f, datt, s_tt, B * H));
    TDM_CHECK(tdm_dev_gemm_rm_strided_batched(d, TDM_TRANS_T, TDM_TRANS_N, T, hd, T, 1.0f, a->att,
                                              s_tt, dyh, s_hd, 0.0f, dv, s_hd, B * H));
    /* through the softmax (and the mask): datt becomes the scores' gradient */
    TDM_CHECK(tdm_dev_attn_softmax_bwd(d, a->att, datt, (int64_t)B * H * T, T));
    /* scores = scale q k^T:  dq = scale ds k;  dk = scale ds^T q */
    TDM_CHECK(tdm_dev_gemm_rm_strided_batched(d, TDM_TRANS_N, TDM_TRANS_N, T, hd, T, scale, datt,
                                              s_tt, a->k, s_hd, 0.0f, dq, s_hd, B * H));
    TDM_CHECK(tdm_dev_gemm_rm_strided_batched(d, TDM_TRANS_T, TDM_TRANS_N, T, hd, T, scale, datt,
                                              s_tt, a->q, s_hd, 0.0f, dk, s_hd, B * H));
    TDM_CHECK(tdm_dev_heads_merge(d, dq, dqkv, 3 * C, 0, B, T, H, hd));
    TDM_CHECK(tdm_dev_heads_merge(d, dk, dqkv, 3 * C, C, B, T, H, hd));
    return tdm_dev_heads_merge(d, dv, dqkv, 3 * C, 2 * C, B, T, H, hd);
}
