/* tp/gpt.c: the GPT split over a tensor-parallel group, Megatron's way.
 * Per block, rank r of N holds:
 *   attn.c_attn  column-parallel by heads: the rows of its H/N heads in
 *                each of the q, k and v thirds of the weight and bias
 *                (3C/N, C); attention runs on its heads alone;
 *   attn.c_proj  row-parallel: the columns of its heads (C, C/N); the
 *                bias whole, added once after the all-reduce;
 *   mlp.c_fc     column-parallel (4C/N, C) and its bias;
 *   mlp.c_proj   row-parallel (C, 4C/N); the bias whole;
 *   ln_1, ln_2, ln_f, wte, wpe whole (replicated).
 * Forward all-reduces the stream's two partial sums per block (after
 * attn.c_proj and mlp.c_proj: B*T*C floats each); backward the input
 * gradients of c_attn and c_fc (B*T*C each), whose inputs (ln_1's and
 * ln_2's outputs) are replicated. Everything else - LayerNorms, the
 * embeddings, the tied head, the loss - runs on the same bits on every
 * rank, so their gradients agree without communication. The layers are
 * models/layers_gpt.h's and the device's kernels, as one device's GPT
 * (models/gpt.c) runs them, in fp32. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"
#include "models/gpt.h"
#include "models/layers_gpt.h"
#include "tp/tp_impl.h"

#define TDM_TP_GPT_LN_EPS 1e-5f   /* models/gpt.c's */
#define TDM_TP_GPT_PER_BLOCK 12   /* a block's tensors in the whole model's table */

enum { TB_LN1_W = 0, TB_LN1_B, TB_ATTN_W, TB_ATTN_B, TB_APROJ_W, TB_APROJ_B, TB_LN2_W, TB_LN2_B,
       TB_FC_W, TB_FC_B, TB_MPROJ_W, TB_MPROJ_B };

typedef struct tdm_tp_gpt_block {
    int64_t off[TDM_TP_GPT_PER_BLOCK];   /* the rank's slices in its flat buffers */
    float *ln1, *ln1_mean, *ln1_rstd, *q, *k, *v, *att, *atty, *res1;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fcg, *res2;
} tdm_tp_gpt_block;

struct tdm_tp_gpt {
    int L, C, H, T, V;
    int Hl, Cl, Fl;                      /* this rank's heads, their width, c_fc's rows */
    int sp;                              /* sequence parallel (on more than one rank) */
    int64_t wte, wpe, lnf_w, lnf_b;      /* offsets */
    int64_t ln_off, ln_elems;            /* every block's ln_1 and ln_2, side by side */
    tdm_tp_gpt_block *blk;
    int cap;
    float *res0, *lnf, *lnf_mean, *lnf_rstd, *logits;
    /* scratch */
    float *qkv, *yh, *part, *dres, *dln, *dfc, *datt, *dq, *dk, *dv, *dlogits;
    float **allocs;
    int n_allocs, max_allocs;
};

tdm_status tdm_tp_gpt_plan(const tdm_model_spec *spec, int ranks)
{
    TDM_REQUIRE(spec->n_head % ranks == 0, TDM_STATUS_USAGE,
                "the GPT's %d heads are not divisible by the %d tensor-parallel ranks (attention "
                "is split by heads)", spec->n_head, ranks);
    return TDM_STATUS_OK;
}

/* ---- layout ---- */

/* The whole model's index of `name`, checked. */
static int tdm_tp_gpt_index(const tdm_tp *p, int want, const char *name)
{
    const tdm_tensor_info *t = tdm_model_param_info(p->tables, want);
    return t && !strcmp(t->name, name) ? want : -1;
}

tdm_status tdm_tp_gpt_layout(tdm_tp *p)
{
    const tdm_model_spec *s = &p->spec;
    tdm_tp_gpt *g = calloc(1, sizeof *g);
    TDM_REQUIRE(g, TDM_STATUS_OUT_OF_MEMORY, "tp gpt: calloc");
    p->gpt = g;
    *g = (tdm_tp_gpt){.L = s->n_layer, .C = s->n_embd, .H = s->n_head, .T = s->n_ctx,
                      .V = s->vocab};
    g->sp = p->seq_par;
    g->Hl = g->H / p->size;
    g->Cl = g->C / p->size;
    g->Fl = 4 * g->C / p->size;
    g->blk = calloc((size_t)g->L, sizeof *g->blk);
    TDM_REQUIRE(g->blk, TDM_STATUS_OUT_OF_MEMORY, "tp gpt: %d blocks", g->L);
    int C = g->C;
    char name[TDM_MODEL_NAME_MAX];
    TDM_REQUIRE(tdm_tp_gpt_index(p, 0, "transformer.wte.weight") == 0 &&
                    tdm_tp_gpt_index(p, 1, "transformer.wpe.weight") == 1,
                TDM_STATUS_INTERNAL, "tp gpt: the whole model's table is not the GPT's");
    g->wte = p->n_elem;
    tdm_tp_add_tensor(p, 0, TDM_TP_CUT_REPL, 1, g->V, C);
    g->wpe = p->n_elem;
    tdm_tp_add_tensor(p, 1, TDM_TP_CUT_REPL, 1, g->T, C);
    static const char *const sfx[TDM_TP_GPT_PER_BLOCK] = {
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
        "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
    const struct {
        tdm_tp_cut cut;
        int parts;
        int64_t rows, cols;
    } shape[TDM_TP_GPT_PER_BLOCK] = {
        {TDM_TP_CUT_REPL, 1, C, 1},      {TDM_TP_CUT_REPL, 1, C, 1},
        {TDM_TP_CUT_ROWS, 3, 3 * C, C},  {TDM_TP_CUT_ROWS, 3, 3 * C, 1},
        {TDM_TP_CUT_COLS, 1, C, C},      {TDM_TP_CUT_REPL, 1, C, 1},
        {TDM_TP_CUT_REPL, 1, C, 1},      {TDM_TP_CUT_REPL, 1, C, 1},
        {TDM_TP_CUT_ROWS, 1, 4 * C, C},  {TDM_TP_CUT_ROWS, 1, 4 * C, 1},
        {TDM_TP_CUT_COLS, 1, C, 4 * C},  {TDM_TP_CUT_REPL, 1, C, 1}};
    /* two passes: every block's LayerNorms first, side by side (under
     * sequence parallelism their gradients are partial per rank and
     * summed over the group in one all-reduce), then the rest */
    g->ln_off = p->n_elem;
    for (int pass = 0; pass < 2; pass++) {
        for (int l = 0; l < g->L; l++)
            for (int j = 0; j < TDM_TP_GPT_PER_BLOCK; j++) {
                int ln = j == TB_LN1_W || j == TB_LN1_B || j == TB_LN2_W || j == TB_LN2_B;
                if (ln != (pass == 0)) continue;
                int want = 2 + TDM_TP_GPT_PER_BLOCK * l + j;
                snprintf(name, sizeof name, "transformer.h.%d.%s", l, sfx[j]);
                TDM_REQUIRE(tdm_tp_gpt_index(p, want, name) == want, TDM_STATUS_INTERNAL,
                            "tp gpt: tensor %d of the whole model is not %s", want, name);
                g->blk[l].off[j] = p->n_elem;
                tdm_tp_add_tensor(p, want, shape[j].cut, shape[j].parts, shape[j].rows,
                                  shape[j].cols);
            }
        if (pass == 0) g->ln_elems = p->n_elem - g->ln_off;
    }
    int pf = 2 + TDM_TP_GPT_PER_BLOCK * g->L;
    TDM_REQUIRE(tdm_tp_gpt_index(p, pf, "transformer.ln_f.weight") == pf, TDM_STATUS_INTERNAL,
                "tp gpt: tensor %d of the whole model is not transformer.ln_f.weight", pf);
    g->lnf_w = p->n_elem;
    tdm_tp_add_tensor(p, pf, TDM_TP_CUT_REPL, 1, C, 1);
    g->lnf_b = p->n_elem;
    tdm_tp_add_tensor(p, pf + 1, TDM_TP_CUT_REPL, 1, C, 1);
    return TDM_STATUS_OK;
}

/* ---- activations ---- */

static void tdm_tp_gpt_free_acts(tdm_tp *p)
{
    tdm_tp_gpt *g = p->gpt;
    for (int i = 0; i < g->n_allocs; i++) tdm_dev_free(p->dev, g->allocs[i]);
    free(g->allocs);
    g->allocs = NULL;
    g->n_allocs = g->max_allocs = 0;
    g->cap = 0;
}

void tdm_tp_gpt_free(tdm_tp *p)
{
    if (!p->gpt) return;
    tdm_tp_gpt_free_acts(p);
    free(p->gpt->blk);
    free(p->gpt);
    p->gpt = NULL;
}

/* n floats of device memory, remembered for freeing, counted. */
static tdm_status tdm_tp_gpt_alloc(tdm_tp *p, int64_t n, float **out)
{
    tdm_tp_gpt *g = p->gpt;
    if (g->n_allocs == g->max_allocs) {
        int m = g->max_allocs ? 2 * g->max_allocs : 64;
        float **a = realloc(g->allocs, (size_t)m * sizeof *a);
        TDM_REQUIRE(a, TDM_STATUS_OUT_OF_MEMORY, "tp gpt: activations");
        g->allocs = a;
        g->max_allocs = m;
    }
    size_t bytes = (size_t)(n > 0 ? n : 1) * sizeof(float);
    p->stats.activations += bytes;
    p->stats.act_allocs++;
    *out = NULL;
    if (!p->dev) return TDM_STATUS_OK;   /* tdm_tp_footprint: counted only */
    TDM_CHECK(tdm_dev_alloc(p->dev, bytes, (void **)out));
    g->allocs[g->n_allocs++] = *out;
    return TDM_STATUS_OK;
}

/* The rows (tokens) of B windows: all N of them, and the Nl the rank's
 * sequence-parallel regions hold from row off on (Nl = N, off 0 without
 * sequence parallelism). The plan checked that T divides by the ranks,
 * so every batch's B*T tokens do. */
static void tdm_tp_gpt_rows(const tdm_tp *p, int B, int64_t *N, int64_t *Nl, int64_t *off)
{
    *N = (int64_t)B * p->gpt->T;
    *Nl = p->gpt->sp ? *N / p->size : *N;
    *off = p->gpt->sp ? (int64_t)p->rank * *Nl : 0;
}

tdm_status tdm_tp_gpt_reserve(tdm_tp *p, int B)
{
    tdm_tp_gpt *g = p->gpt;
    tdm_tp_gpt_free_acts(p);
    int64_t N, Nl, off, C = g->C, Cl = g->Cl, Fl = g->Fl;
    tdm_tp_gpt_rows(p, B, &N, &Nl, &off);
    int64_t att = (int64_t)B * g->Hl * g->T * g->T;
    /* sequence parallel: the stream (res1, res2), the LayerNorms'
     * statistics and the stream's gradient hold the rank's Nl tokens;
     * what the column-parallel layers read (the LayerNorms' outputs) is
     * gathered whole and kept for their weight gradients. Whole anyway:
     * block 0's ln_1 statistics (it runs on the replicated embeddings)
     * and the last block's output (gathered for ln_f and the head). */
#define A(ptr, n) TDM_CHECK(tdm_tp_gpt_alloc(p, (n), &(ptr)))
    for (int l = 0; l < g->L; l++) {
        tdm_tp_gpt_block *b = &g->blk[l];
        if (p->ckpt && l > 0) {
            /* activation checkpointing: block 0's set (its ln_1
             * statistics whole: the largest) serves every block; each
             * keeps only its output, the next block's input */
            float *res2 = NULL;
            A(res2, (l == g->L - 1 ? N : Nl) * C);
            tdm_tp_gpt_block own = *b;
            *b = g->blk[0];
            memcpy(b->off, own.off, sizeof b->off);   /* its own parameters */
            b->res2 = res2;
            continue;
        }
        A(b->ln1, N * C);
        A(b->ln1_mean, l == 0 ? N : Nl);
        A(b->ln1_rstd, l == 0 ? N : Nl);
        A(b->q, N * Cl);
        A(b->k, N * Cl);
        A(b->v, N * Cl);
        A(b->att, att);
        A(b->atty, N * Cl);
        A(b->res1, Nl * C);
        A(b->ln2, N * C);
        A(b->ln2_mean, Nl);
        A(b->ln2_rstd, Nl);
        A(b->fch, N * Fl);
        A(b->fcg, N * Fl);
        A(b->res2, (l == g->L - 1 ? N : Nl) * C);
    }
    A(g->res0, N * C);
    A(g->lnf, N * C);
    A(g->lnf_mean, N);
    A(g->lnf_rstd, N);
    A(g->logits, N * g->V);
    A(g->qkv, N * 3 * Cl);
    A(g->yh, N * Cl);
    A(g->part, N * C);
    A(g->dres, Nl * C);
    A(g->dln, N * C);
    A(g->dfc, N * Fl);
    A(g->datt, att);
    A(g->dq, N * Cl);
    A(g->dk, N * Cl);
    A(g->dv, N * Cl);
    A(g->dlogits, N * g->V);
    /* what tp/step.c reads and writes: the tokens, the targets, ones for
     * the bias gradients, the logits on the host for evaluation */
    float *x, *y, *ones;
    A(x, N);
    A(y, N);
    A(ones, N);
#undef A
    /* tp/tp.c owns (and frees) p->x, p->y and p->ones: they leave our
     * list now, before anything below can fail, so no path frees them
     * twice */
    if (p->dev) g->n_allocs -= 3;
    p->x = x;
    p->y = (int32_t *)y;
    p->ones = ones;
    if (!p->dev) return TDM_STATUS_OK;
    float *h1 = malloc((size_t)N * sizeof(float));
    TDM_REQUIRE(h1, TDM_STATUS_OUT_OF_MEMORY, "tp gpt: %lld floats", (long long)N);
    for (int64_t i = 0; i < N; i++) h1[i] = 1.0f;
    tdm_status st = tdm_dev_copy_from_host(p->dev, ones, h1, (size_t)N * sizeof(float));
    free(h1);
    TDM_CHECK(st);
    p->host_logits = malloc((size_t)N * (size_t)g->V * sizeof(float));
    TDM_REQUIRE(p->host_logits, TDM_STATUS_OUT_OF_MEMORY, "tp gpt: logits of %d windows", B);
    g->cap = B;
    p->cap = B;
    return TDM_STATUS_OK;
}

float *tdm_tp_gpt_dlogits(tdm_tp *p) { return p->gpt->dlogits; }

/* ---- the sequence-parallel collectives ---- */

/* dst (N rows of C) = the group's Nl-row pieces side by side, rank r's
 * src at rows [r*Nl, (r+1)*Nl): an all-gather along the tokens (src may
 * be dst's own rows: in place). */
static tdm_status tdm_tp_gpt_gather(tdm_tp *p, const float *src, float *dst, int64_t Nl,
                                    const char *what, int l, double *ar_ms)
{
    uint64_t t0 = tdm_time_ns();
    TDM_CHECK(tdm_dev_sync(p->dev));
    tdm_comm_set_label(p->comm, "tp all-gather %s%d", what, l);
    tdm_status st = tdm_comm_all_gather(p->comm, src, dst, (size_t)(Nl * p->gpt->C),
                                        TDM_DTYPE_FLOAT32);
    if (st) tdm_error_prefix(st, "tp rank %d: the all-gather %s%d", p->rank, what, l);
    *ar_ms += tdm_time_ms_since(t0);
    return st;
}

/* buf (N rows of C, a partial sum on every rank) summed over the group:
 * all of it on every rank (an all-reduce) without sequence parallelism;
 * with it, only the rank's Nl rows from row off (a reduce-scatter along
 * the tokens, in place). */
static tdm_status tdm_tp_gpt_sum(tdm_tp *p, float *buf, int64_t N, int64_t Nl, int64_t off,
                                 const char *what, int l, double *ar_ms)
{
    if (p->size < 2) return TDM_STATUS_OK;
    uint64_t t0 = tdm_time_ns();
    tdm_status st;
    if (!p->gpt->sp) {
        st = tdm_tp_allreduce(p, buf, N * p->gpt->C, what, l);
    } else {
        TDM_CHECK(tdm_dev_sync(p->dev));
        tdm_comm_set_label(p->comm, "tp reduce-scatter %s%d", what, l);
        st = tdm_comm_reduce_scatter(p->comm, buf, buf + off * p->gpt->C,
                                     (size_t)(Nl * p->gpt->C), TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
        if (st) tdm_error_prefix(st, "tp rank %d: the reduce-scatter %s%d", p->rank, what, l);
    }
    *ar_ms += tdm_time_ms_since(t0);
    return st;
}

tdm_status tdm_tp_gpt_sum_ln(tdm_tp *p, double *ms)
{
    tdm_tp_gpt *g = p->gpt;
    if (!g || !g->sp || g->ln_elems == 0) return TDM_STATUS_OK;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_tp_allreduce(p, p->grads + g->ln_off, g->ln_elems,
                                     "of the LayerNorms' gradients (sequence parallel), blocks ",
                                     g->L);
    *ms += tdm_time_ms_since(t0);
    return st;
}

/* ---- forward ---- */

/* out (N, C) = LayerNorm(x) on every rank. Without sequence parallelism,
 * or when x is whole (full: block 0 reads the replicated embeddings),
 * over all N rows; with it, over the rank's Nl rows of x (its tokens)
 * into out's rows from off, then gathered along the tokens. */
static tdm_status tdm_tp_gpt_ln(tdm_tp *p, const float *x, const float *w, const float *bias,
                                float *out, float *mean, float *rstd, int64_t N, int64_t Nl,
                                int64_t off, int full, int l, double *ar_ms)
{
    int C = p->gpt->C;
    if (full || !p->gpt->sp)
        return tdm_dev_layernorm_fwd(p->dev, x, w, bias, out, mean, rstd, N, C,
                                     TDM_TP_GPT_LN_EPS);
    TDM_CHECK(tdm_dev_layernorm_fwd(p->dev, x, w, bias, out + off * C, mean, rstd, Nl, C,
                                    TDM_TP_GPT_LN_EPS));
    return tdm_tp_gpt_gather(p, out + off * C, out, Nl, "forward LayerNorm of block ", l, ar_ms);
}

/* y = res + x w^T + bias on the rank's rows, w (C, in) this rank's
 * columns of a row-parallel projection: the N rows' partial products
 * summed over the group (tdm_tp_gpt_sum: all of them, or the rank's Nl
 * rows from off under sequence parallelism), then added to res's rows
 * (Nl of them: res and y hold the rank's rows). One rank: one device's
 * very calls (the stream copied, the projection accumulated onto it). */
static tdm_status tdm_tp_gpt_row(tdm_tp *p, const float *x, const float *w, const float *bias,
                                 int in, const float *res, float *y, int64_t N, int64_t Nl,
                                 int64_t off, const char *what, int l, double *ar_ms)
{
    int C = p->gpt->C;
    float *part = p->gpt->part;
    if (p->size == 1) {
        TDM_CHECK(tdm_dev_copy(p->dev, y, res, (size_t)N * C * sizeof(float)));
        return tdm_tp_linear_fwd(p, x, w, bias, N, in, C, 1, y);
    }
    TDM_CHECK(tdm_tp_linear_fwd(p, x, w, NULL, N, in, C, 0, part));
    TDM_CHECK(tdm_tp_gpt_sum(p, part, N, Nl, off, what, l, ar_ms));
    TDM_CHECK(tdm_dev_copy(p->dev, y, res, (size_t)Nl * C * sizeof(float)));
    TDM_CHECK(tdm_dev_axpy(p->dev, Nl * C, 1.0f, part + off * C, y));
    return tdm_dev_bias_act(p->dev, y, bias, Nl, C, TDM_ACT_NONE);
}

/* Block l's forward from its input res (the rank's rows of the stream;
 * block 0 reads the whole embeddings at res0) into its activations. */
static tdm_status tdm_tp_gpt_block_fwd(tdm_tp *p, int B, int l, const float *res, double *ar_ms)
{
    tdm_tp_gpt *g = p->gpt;
    tdm_device *d = p->dev;
    float *W = p->params;
    int C = g->C, Cl = g->Cl, Fl = g->Fl;
    int64_t N, Nl, off;
    tdm_tp_gpt_rows(p, B, &N, &Nl, &off);
    tdm_tp_gpt_block *b = &g->blk[l];
    int last = l == g->L - 1;
#define P(j) (W + b->off[j])
    TDM_CHECK(tdm_tp_gpt_ln(p, l == 0 ? g->res0 : res, P(TB_LN1_W), P(TB_LN1_B), b->ln1,
                            b->ln1_mean, b->ln1_rstd, N, Nl, off, l == 0, l, ar_ms));
    /* this rank's heads: q, k, v of H/N heads side by side, (N, 3C/N) */
    TDM_CHECK(tdm_tp_linear_fwd(p, b->ln1, P(TB_ATTN_W), P(TB_ATTN_B), N, C, 3 * Cl, 0, g->qkv));
    tdm_layers_attn at = {.B = B, .T = g->T, .H = g->Hl, .C = Cl, .q = b->q, .k = b->k,
                          .v = b->v, .att = b->att};
    TDM_CHECK(tdm_layers_attention_fwd(d, &at, g->qkv, g->yh, b->atty));
    TDM_CHECK(tdm_tp_gpt_row(p, b->atty, P(TB_APROJ_W), P(TB_APROJ_B), Cl, res, b->res1, N, Nl,
                             off, "forward attn.c_proj of block ", l, ar_ms));
    TDM_CHECK(tdm_tp_gpt_ln(p, b->res1, P(TB_LN2_W), P(TB_LN2_B), b->ln2, b->ln2_mean,
                            b->ln2_rstd, N, Nl, off, 0, l, ar_ms));
    TDM_CHECK(tdm_tp_linear_fwd(p, b->ln2, P(TB_FC_W), P(TB_FC_B), N, C, Fl, 0, b->fch));
    TDM_CHECK(tdm_dev_gelu_fwd(d, b->fch, b->fcg, N * Fl));
    /* the last block's output is whole (N rows): the rank's rows at off,
     * gathered for ln_f and the head */
    float *out = b->res2 + (last ? off * C : 0);
    TDM_CHECK(tdm_tp_gpt_row(p, b->fcg, P(TB_MPROJ_W), P(TB_MPROJ_B), Fl, b->res1, out, N, Nl,
                             off, "forward mlp.c_proj of block ", l, ar_ms));
    if (last && g->sp)
        TDM_CHECK(tdm_tp_gpt_gather(p, out, b->res2, Nl, "forward output of block ", l, ar_ms));
#undef P
    return TDM_STATUS_OK;
}

/* Block l's input: the rank's rows of the stream (l - 1 is not the last
 * block, whose output alone is whole). */
static const float *tdm_tp_gpt_block_in(const tdm_tp *p, int B, int l)
{
    int64_t N, Nl, off;
    tdm_tp_gpt_rows(p, B, &N, &Nl, &off);
    return l == 0 ? p->gpt->res0 + off * p->gpt->C : p->gpt->blk[l - 1].res2;
}

void tdm_tp_gpt_low(const tdm_tp *p, int B, tdm_tp_low_max *x)
{
    const tdm_tp_gpt *g = p->gpt;
    int64_t N = (int64_t)B * g->T;
    /* a block's c_attn, attn.c_proj, c_fc, mlp.c_proj (every block's
     * alike), then the tied head; every input gradient is computed */
    if (g->L > 0) {
        tdm_tp_linear_note(x, N, g->C, 3 * g->Cl, 1);
        tdm_tp_linear_note(x, N, g->Cl, g->C, 1);
        tdm_tp_linear_note(x, N, g->C, g->Fl, 1);
        tdm_tp_linear_note(x, N, g->Fl, g->C, 1);
    }
    tdm_tp_linear_note(x, N, g->C, g->V, 1);
}

tdm_status tdm_tp_gpt_forward(tdm_tp *p, int B, const float **logits, double *ar_ms)
{
    tdm_tp_gpt *g = p->gpt;
    tdm_device *d = p->dev;
    float *W = p->params;
    int64_t N, Nl, off;
    tdm_tp_gpt_rows(p, B, &N, &Nl, &off);
    TDM_CHECK(tdm_dev_embed_fwd(d, (const int32_t *)p->x, W + g->wte, W + g->wpe, g->res0, B,
                                g->T, g->C));
    for (int l = 0; l < g->L; l++)
        TDM_CHECK(tdm_tp_gpt_block_fwd(p, B, l, tdm_tp_gpt_block_in(p, B, l), ar_ms));
    const float *whole = g->L ? g->blk[g->L - 1].res2 : g->res0;
    TDM_CHECK(tdm_dev_layernorm_fwd(d, whole, W + g->lnf_w, W + g->lnf_b, g->lnf, g->lnf_mean,
                                    g->lnf_rstd, N, g->C, TDM_TP_GPT_LN_EPS));
    TDM_CHECK(tdm_tp_linear_fwd(p, g->lnf, W + g->wte, NULL, N, g->C, g->V, 0, g->logits));
    *logits = g->logits;
    return TDM_STATUS_OK;
}

/* ---- backward ---- */

/* The whole gradient of the stream (N rows) for a row-parallel layer's
 * backward: dres itself without sequence parallelism; with it, the
 * ranks' rows of dres gathered into part. */
static tdm_status tdm_tp_gpt_dstream(tdm_tp *p, int64_t Nl, const char *what, int l,
                                     double *ar_ms, const float **dy)
{
    tdm_tp_gpt *g = p->gpt;
    *dy = g->dres;
    if (!g->sp) return TDM_STATUS_OK;
    *dy = g->part;
    return tdm_tp_gpt_gather(p, g->dres, g->part, Nl, what, l, ar_ms);
}

/* Block l's gradient addresses (p->grads's, or ZeRO-2's buckets') and
 * its lowest tensor but its LayerNorms' (laid out before every block's
 * others, with block 0's): from there on every gradient is final once
 * the block's backward is done. */
static tdm_status tdm_tp_gpt_block_grads(tdm_tp *p, int l, float **Dg, int64_t *first)
{
    const tdm_tp_gpt_block *b = &p->gpt->blk[l];
    *first = INT64_MAX;
    for (int j = 0; j < TDM_TP_GPT_PER_BLOCK; j++) {
        TDM_CHECK(tdm_tp_grad_at(p, b->off[j], &Dg[j]));
        int ln = j == TB_LN1_W || j == TB_LN1_B || j == TB_LN2_W || j == TB_LN2_B;
        if (!ln && b->off[j] < *first) *first = b->off[j];
    }
    return TDM_STATUS_OK;
}

/* The head's gradients (the tied wte, ln_f), written first. */
static tdm_status tdm_tp_gpt_head_grads(tdm_tp *p, float **gwte, float **glw, float **glb)
{
    TDM_CHECK(tdm_tp_grad_at(p, p->gpt->wte, gwte));
    TDM_CHECK(tdm_tp_grad_at(p, p->gpt->lnf_w, glw));
    return tdm_tp_grad_at(p, p->gpt->lnf_b, glb);
}

tdm_status tdm_tp_gpt_grads_replay(tdm_tp *p)
{
    tdm_tp_gpt *g = p->gpt;
    float *a, *b, *c, *Dg[TDM_TP_GPT_PER_BLOCK];
    int64_t first;
    TDM_CHECK(tdm_tp_gpt_head_grads(p, &a, &b, &c));
    TDM_CHECK(tdm_tp_grads_done(p, g->lnf_w));
    for (int l = g->L - 1; l >= 0; l--) {
        TDM_CHECK(tdm_tp_gpt_block_grads(p, l, Dg, &first));
        TDM_CHECK(tdm_tp_grads_done(p, first));
    }
    TDM_CHECK(tdm_tp_grad_at(p, g->wpe, &a));
    return tdm_tp_grads_done(p, 0);
}

tdm_status tdm_tp_gpt_backward(tdm_tp *p, int B, const float *dlogits, double *ar_ms)
{
    tdm_tp_gpt *g = p->gpt;
    tdm_device *d = p->dev;
    float *W = p->params, *gwte, *glw, *glb, *gwpe, *Dg[TDM_TP_GPT_PER_BLOCK];
    int C = g->C, Cl = g->Cl, Fl = g->Fl;
    int64_t N, Nl, off;
    tdm_tp_gpt_rows(p, B, &N, &Nl, &off);
    const float *res_last = g->L ? g->blk[g->L - 1].res2 : g->res0;
    /* the whole stream's gradient at the top: dres itself, or (sequence
     * parallel) part, of which the rank keeps its rows in dres */
    float *dtop = g->sp ? g->part : g->dres;
    TDM_CHECK(tdm_dev_memset_zero(d, dtop, (size_t)N * C * sizeof(float)));
    /* the tied head: dwte += dlogits^T ln_f(x), d ln_f(x) = dlogits wte */
    /* the gradients' addresses: p->grads's, or ZeRO-2's buckets' */
    TDM_CHECK(tdm_tp_gpt_head_grads(p, &gwte, &glw, &glb));
    TDM_CHECK(tdm_tp_linear_bwd(p, g->lnf, W + g->wte, dlogits, N, C, g->V, gwte, NULL,
                                g->dln));
    TDM_CHECK(tdm_dev_layernorm_bwd(d, res_last, g->dln, W + g->lnf_w, g->lnf_mean, g->lnf_rstd,
                                    dtop, glw, glb, N, C));
    /* ln_f's are final (wte, at the start of the layout, is not yet) */
    TDM_CHECK(tdm_tp_grads_done(p, g->lnf_w));
    if (g->sp)
        TDM_CHECK(tdm_dev_copy(d, g->dres, dtop + off * C, (size_t)Nl * C * sizeof(float)));
    for (int l = g->L - 1; l >= 0; l--) {
        tdm_tp_gpt_block *b = &g->blk[l];
        const float *res_in = tdm_tp_gpt_block_in(p, B, l), *dy = dtop;
        /* activation checkpointing: the blocks share one set of
         * activations, which the forward left holding the last block's;
         * every other block's forward runs again from its kept input, its
         * collectives included */
        if (p->ckpt && l < g->L - 1) TDM_CHECK(tdm_tp_gpt_block_fwd(p, B, l, res_in, ar_ms));
        int64_t first;
        TDM_CHECK(tdm_tp_gpt_block_grads(p, l, Dg, &first));
#define P(j) (W + b->off[j])
#define D(j) (Dg[j])
        /* x += mlp(ln_2(x)): the branch's output gradient is the
         * stream's, whole (the last block's is already) */
        if (l < g->L - 1)
            TDM_CHECK(tdm_tp_gpt_dstream(p, Nl, "backward mlp.c_proj of block ", l, ar_ms, &dy));
        TDM_CHECK(tdm_tp_linear_bwd(p, b->fcg, P(TB_MPROJ_W), dy, N, Fl, C, D(TB_MPROJ_W),
                                    D(TB_MPROJ_B), g->dfc));
        TDM_CHECK(tdm_dev_gelu_bwd(d, b->fch, g->dfc, g->dfc, N * Fl));
        TDM_CHECK(tdm_tp_linear_bwd(p, b->ln2, P(TB_FC_W), g->dfc, N, C, Fl, D(TB_FC_W),
                                    D(TB_FC_B), g->dln));
        TDM_CHECK(tdm_tp_gpt_sum(p, g->dln, N, Nl, off, "backward mlp.c_fc of block ", l,
                                 ar_ms));
        TDM_CHECK(tdm_dev_layernorm_bwd(d, b->res1, g->dln + off * C, P(TB_LN2_W), b->ln2_mean,
                                        b->ln2_rstd, g->dres, D(TB_LN2_W), D(TB_LN2_B), Nl, C));
        /* x += attn(ln_1(x)); dln holds the heads' output gradient (N, C/N) */
        TDM_CHECK(tdm_tp_gpt_dstream(p, Nl, "backward attn.c_proj of block ", l, ar_ms, &dy));
        TDM_CHECK(tdm_tp_linear_bwd(p, b->atty, P(TB_APROJ_W), dy, N, Cl, C, D(TB_APROJ_W),
                                    D(TB_APROJ_B), g->dln));
        tdm_layers_attn at = {.B = B, .T = g->T, .H = g->Hl, .C = Cl, .q = b->q, .k = b->k,
                              .v = b->v, .att = b->att};
        TDM_CHECK(tdm_layers_attention_bwd(d, &at, g->dln, g->yh, g->datt, g->dq, g->dk, g->dv,
                                           g->qkv));
        TDM_CHECK(tdm_tp_linear_bwd(p, b->ln1, P(TB_ATTN_W), g->qkv, N, C, 3 * Cl, D(TB_ATTN_W),
                                    D(TB_ATTN_B), g->dln));
        TDM_CHECK(tdm_tp_gpt_sum(p, g->dln, N, Nl, off, "backward attn.c_attn of block ", l,
                                 ar_ms));
        /* block 0's ln_1 statistics are whole: the rank's rows of them */
        int64_t so = l == 0 ? off : 0;
        TDM_CHECK(tdm_dev_layernorm_bwd(d, res_in, g->dln + off * C, P(TB_LN1_W),
                                        b->ln1_mean + so, b->ln1_rstd + so, g->dres, D(TB_LN1_W),
                                        D(TB_LN1_B), Nl, C));
#undef P
#undef D
        TDM_CHECK(tdm_tp_grads_done(p, first));
    }
    const float *demb = dtop;   /* no block: the top's gradient, whole */
    if (g->L) TDM_CHECK(tdm_tp_gpt_dstream(p, Nl, "backward embeddings, after block ", 0, ar_ms,
                                           &demb));
    TDM_CHECK(tdm_tp_grad_at(p, g->wpe, &gwpe));
    TDM_CHECK(tdm_dev_embed_bwd(d, (const int32_t *)p->x, demb, gwte, gwpe, B, g->T, C));
    return tdm_tp_grads_done(p, 0);
}
