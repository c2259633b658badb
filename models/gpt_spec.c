/* models/gpt_spec.c: the GPT's spec (gpt, gpt:L-D-H-T, its description)
 * and what a GPT model's shape costs: the activation bytes of a batch
 * and the gemm multiply-adds of a step (a stage's blocks, a
 * tensor-parallel slice's widths). The model itself is models/gpt.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/gpt_impl.h"

/* ---- spec ---- */

void tdm_model_spec_gpt(tdm_model_spec *s, int n_layer, int n_embd, int n_head, int n_ctx)
{
    memset(s, 0, sizeof *s);
    s->kind = TDM_MODEL_GPT;
    s->n_layer = n_layer;
    s->n_embd = n_embd;
    s->n_head = n_head;
    s->n_ctx = n_ctx;
    s->vocab = TDM_GPT_VOCAB;
    s->n_classes = TDM_GPT_VOCAB;
    s->in_c = 1;   /* a window of n_ctx tokens (tdm_model_spec_sample_shape) */
    s->in_h = 1;
    s->in_w = n_ctx;
}

tdm_status tdm_gpt_spec_parse(tdm_model_spec *s, const char *text)
{
    static const char *const what[4] = {"blocks L", "width D", "heads H", "context T"};
    static const int maxv[4] = {TDM_GPT_MAX_LAYERS, 1 << 16, 1 << 12, 1 << 16};
    int v[4] = {TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH, TDM_GPT_DEFAULT_HEADS,
                TDM_GPT_DEFAULT_CONTEXT};
    if (strcmp(text, "gpt") != 0) {
        TDM_REQUIRE(!strncmp(text, "gpt:", 4) && text[4], TDM_STATUS_INVALID_ARG,
                    "model '%s': expected gpt or gpt:L-D-H-T (blocks, width, heads, context), "
                    "e.g. gpt:%d-%d-%d-%d", text, v[0], v[1], v[2], v[3]);
        const char *p = text + 4;
        for (int i = 0; i < 4; i++) {
            char *end;
            long x = strtol(p, &end, 10);
            if (end == p || x < 1 || x > maxv[i])
                return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                     "model '%s': %s must be an integer in [1, %d] "
                                     "(gpt:L-D-H-T, e.g. gpt:%d-%d-%d-%d)", text, what[i],
                                     maxv[i], TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH,
                                     TDM_GPT_DEFAULT_HEADS, TDM_GPT_DEFAULT_CONTEXT);
            v[i] = (int)x;
            p = end;
            if (i < 3) {
                TDM_REQUIRE(*p == '-', TDM_STATUS_INVALID_ARG,
                            "model '%s': expected four numbers L-D-H-T separated by '-'", text);
                p++;
            }
        }
        TDM_REQUIRE(*p == '\0', TDM_STATUS_INVALID_ARG,
                    "model '%s': unexpected '%s' after L-D-H-T", text, p);
    }
    TDM_REQUIRE(v[1] % v[2] == 0, TDM_STATUS_INVALID_ARG,
                "model '%s': %d heads do not divide the width %d (each head gets width/heads "
                "features: pick a width that is a multiple of the heads)", text, v[2], v[1]);
    tdm_model_spec_gpt(s, v[0], v[1], v[2], v[3]);
    return TDM_STATUS_OK;
}

void tdm_gpt_spec_describe(const tdm_model_spec *s, char *buf, size_t len)
{
    /* an untied head is no built-in gpt: named by its model file */
    if (s->head_untied)
        snprintf(buf, len, "%s (gpt:%d-%d-%d-%d, untied head)", s->name, s->n_layer, s->n_embd,
                 s->n_head, s->n_ctx);
    else snprintf(buf, len, "gpt:%d-%d-%d-%d", s->n_layer, s->n_embd, s->n_head, s->n_ctx);
}

size_t tdm_gpt_act_bytes(const tdm_model *m, int batch)
{
    const tdm_gpt *g = m->ext;
    /* what tdm_gpt_reserve allocates for one activation set and the
     * scratch of a whole model, counted in floats: per block ln1, q, k,
     * v, atty, res1, ln2, res2 (N x C each), fch and fcg (N x 4C), four
     * means and rstds (N) and the attention (B x H x T x T); then res0,
     * lnf, yh, dres, dln (N x C), qkv and dq/dk/dv (N x 3C each), dfc
     * (N x 4C), lnf's mean and rstd and the ones (N), the logits and
     * their gradient (N x V) and the attention's gradient; a
     * tensor-parallel slice: its heads' tensors Ca wide, c_fc's F, and
     * the row-parallel product (N x C) */
    int64_t N = (int64_t)batch * g->T, C = g->C, Ca = g->Ca, F = g->F;
    int64_t att = (int64_t)batch * g->Hl * g->T * g->T;
    int64_t per_block = 4 * N * C + 4 * N * Ca + 2 * N * F + 4 * N + att;
    int64_t floats = g->L * per_block + 4 * N * C + 7 * N * Ca + N * F + 3 * N +
                     2 * N * g->V + att + (g->tp > 1 ? N * C : 0);
    return (size_t)floats * sizeof(float);
}

void tdm_gpt_gemm_flops(const tdm_model *m, double *fwd, double *bwd)
{
    const tdm_model_spec *s = &m->spec;
    const tdm_gpt *g = m->ext;
    double C = s->n_embd, T = s->n_ctx, Ca = g->Ca, F = g->F;
    /* per position: c_attn 3C^2, attn.c_proj C^2, c_fc 4C^2, mlp.c_proj 4C^2
     * multiply-adds, attention 2 T C (scores and values over the full T),
     * the head C V (the stage's blocks, and its head); a tensor-parallel
     * slice's: its heads' Ca and c_fc's F for C and 4C */
    double per_pos = g->nb * (4.0 * C * Ca + 2.0 * C * F + 2.0 * T * Ca) +
                     (g->has_head ? C * s->vocab : 0.0);
    *fwd = 2.0 * per_pos * T;
    /* every product has a weight (or second-operand) and an input gradient */
    *bwd = 2.0 * *fwd;
}

