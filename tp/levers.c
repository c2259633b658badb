/* tp/levers.c: the memory levers of a tensor-parallel rank (tp/tp.h):
 * the linear layers' products in bf16 or fp16 (tdm_tp_opts.precision;
 * used by tp/step.c's MLP and tp/gpt.c), and at the end of a step
 * (tdm_tp_levers) fp16's loss scaling with the skip decided once for
 * every rank of the job (the tensor-parallel group and its
 * data-parallel replicas) and the global gradient norm and clipping over
 * the group's slices. The order of a step is tp/step.c's: the backward,
 * the sums (sequence-parallel LayerNorms over the group, the replicas
 * over the dp dimension), then here, then the optimizer step unless
 * skipped. Activation checkpointing lives with the passes it changes
 * (tp/gpt.c, tp/step.c). */
#include <math.h>
#include <string.h>

#include "models/clip.h"
#include "models/layers_gpt.h"
#include "models/precision.h"
#include "tp/tp_impl.h"

/* ---- the products' precision ---- */

/* 16-bit elements, rounded up to a 64-byte line (the second operand's
 * start stays aligned). */
static int64_t tdm_tp_low_elems(int64_t n) { return (n + 31) / 32 * 32; }

tdm_status tdm_tp_gemm(tdm_tp *p, tdm_trans ta, tdm_trans tb, int m, int n, int k, float alpha,
                       const float *a, const float *b, float beta, float *c)
{
    if (p->prec == TDM_PRECISION_FP32)
        return tdm_dev_gemm_rm(p->dev, ta, tb, m, n, k, alpha, a, b, beta, c);
    tdm_dtype t = tdm_precision_dtype(p->prec);
    int64_t na = tdm_tp_low_elems((int64_t)m * k), nb = (int64_t)k * n;
    size_t need = (size_t)(na + nb) * tdm_dtype_size(t);   /* tdm_tp_low_note's */
    if (need > p->low_bytes) {
        tdm_dev_free(p->dev, p->low);
        p->low = NULL;
        p->low_bytes = 0;
        TDM_CHECK(tdm_dev_alloc(p->dev, need, &p->low));
        p->low_bytes = need;
    }
    char *a16 = p->low, *b16 = a16 + (size_t)na * tdm_dtype_size(t);
    TDM_CHECK(tdm_dev_convert(p->dev, a16, t, a, TDM_DTYPE_FLOAT32, (int64_t)m * k));
    TDM_CHECK(tdm_dev_convert(p->dev, b16, t, b, TDM_DTYPE_FLOAT32, nb));
    int lda = ta == TDM_TRANS_N ? k : m, ldb = tb == TDM_TRANS_N ? n : k;
    return tdm_dev_gemm_rm_ex(p->dev, ta, tb, m, n, k, alpha, a16, lda, b16, ldb, beta, c, n, t);
}

void tdm_tp_low_note(tdm_tp_low_max *x, int64_t m, int64_t n, int64_t k)
{
    /* bfloat16 and float16 elements alike: 2 bytes */
    size_t need = (size_t)(tdm_tp_low_elems(m * k) + k * n) * 2;
    if (need > x->bytes) x->bytes = need;
    if (m * k + k * n > x->wide) x->wide = m * k + k * n;
}

void tdm_tp_linear_note(tdm_tp_low_max *x, int64_t N, int in, int out, int dx)
{
    tdm_tp_low_note(x, N, out, in);        /* forward */
    tdm_tp_low_note(x, out, in, N);        /* dW */
    if (dx) tdm_tp_low_note(x, N, in, out);
}

tdm_status tdm_tp_linear_fwd(tdm_tp *p, const float *x, const float *w, const float *b,
                             int64_t N, int in, int out, int accumulate, float *y)
{
    if (p->prec == TDM_PRECISION_FP32)
        return tdm_layers_linear_fwd(p->dev, x, w, b, N, in, out, accumulate, y);
    TDM_REQUIRE(N <= INT32_MAX, TDM_STATUS_INVALID_ARG, "tp linear: %lld rows", (long long)N);
    TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_N, TDM_TRANS_T, (int)N, out, in, 1.0f, x, w,
                          accumulate ? 1.0f : 0.0f, y));
    return b ? tdm_dev_bias_act(p->dev, y, b, N, out, TDM_ACT_NONE) : TDM_STATUS_OK;
}

tdm_status tdm_tp_linear_bwd(tdm_tp *p, const float *x, const float *w, const float *dy,
                             int64_t N, int in, int out, float *dw, float *db, float *dx)
{
    if (p->prec == TDM_PRECISION_FP32)
        return tdm_layers_linear_bwd(p->dev, x, w, dy, p->ones, N, in, out, dw, db, dx, 0);
    TDM_REQUIRE(N <= INT32_MAX, TDM_STATUS_INVALID_ARG, "tp linear: %lld rows", (long long)N);
    TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_T, TDM_TRANS_N, out, in, (int)N, 1.0f, dy, x, 1.0f, dw));
    if (db)
        TDM_CHECK(tdm_dev_gemm_rm(p->dev, TDM_TRANS_N, TDM_TRANS_N, 1, out, (int)N, 1.0f, p->ones,
                                  dy, 1.0f, db));
    if (dx)
        TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_N, TDM_TRANS_N, (int)N, in, out, 1.0f, dy, w, 0.0f,
                              dx));
    return TDM_STATUS_OK;
}

/* ---- the levers of the step ---- */

void tdm_tp_set_levers(tdm_tp *p, const tdm_tp_levers *l)
{
    if (l) p->lev = *l;
    else memset(&p->lev, 0, sizeof p->lev);
}

float tdm_tp_loss_scale(const tdm_tp *p)
{
    return p->lev.scaler ? tdm_grad_scaler_scale(p->lev.scaler) : 1.0f;
}

static tdm_comm *tdm_tp_lever_comm(const tdm_tp *p)
{
    return p->lev.comm ? p->lev.comm : p->comm;
}

/* The sum of squares this rank counts: its split tensors' slices (every
 * rank of the group holds other elements of them) and, on the group's
 * rank 0 alone, the replicated tensors (the same bits on every rank of
 * the group, tp/tp.h); of the dp dimension's replicas, which hold the
 * same summed gradient, replica 0 alone, or under ZeRO-1 and 2 (whose
 * reduce-scatter leaves each replica the sum of its own chunk only) every
 * replica over its chunk. Runs of adjacent counted elements are summed as
 * one buffer (models/clip.h's fixed chunk order; ZeRO-2's shard holds
 * the chunk's elements at the same relative places). */
static tdm_status tdm_tp_sumsq(tdm_tp *p, double *sq)
{
    *sq = 0.0;
    int64_t lo = 0, hi = p->n_elem;
    /* element `base_at` of the slice is base[0]: the flat gradient's
     * element 0, or ZeRO-2's shard's first (its chunk's start); no
     * pointer is formed before an allocation's start */
    float *base = p->grads;
    int64_t base_at = 0;
    if (p->zero != TDM_TP_ZERO_NONE) {
        int64_t k;
        tdm_tp_zero_range(p, &lo, &k);
        hi = lo + k;
        if (p->zero == TDM_TP_ZERO_GRADS) {
            base = p->gshard;
            base_at = lo;
        }
    } else if (p->lev.replica != 0) {
        return TDM_STATUS_OK;
    }
    int64_t run_off = 0, run_n = 0;
    for (int i = 0; i <= p->n_tensors; i++) {
        const tdm_tp_tensor *t = i < p->n_tensors ? &p->tensors[i] : NULL;
        int64_t a = t ? (t->off > lo ? t->off : lo) : 0;
        int64_t b = t ? (t->off + t->n_elem < hi ? t->off + t->n_elem : hi) : 0;
        int counted = t && b > a && (t->cut != TDM_TP_CUT_REPL || p->rank == 0);
        if (counted && run_n && run_off + run_n == a) {
            run_n += b - a;
            continue;
        }
        if (run_n) {
            double s = 0.0;
            TDM_CHECK(tdm_clip_sumsq(p->dev, base + (run_off - base_at), run_n, &s));
            *sq += s;
        }
        run_off = counted ? a : 0;
        run_n = counted ? b - a : 0;
    }
    return TDM_STATUS_OK;
}

/* The global norm: the counted squares summed over the job (one double,
 * one all-reduce), then every rank's whole flat gradient clipped alike
 * (the all-reduce hands every rank the same norm). */
static tdm_status tdm_tp_norm(tdm_tp *p)
{
    tdm_comm *comm = tdm_tp_lever_comm(p);
    double sq = 0.0, *buf = NULL;
    TDM_CHECK(tdm_tp_sumsq(p, &sq));
    TDM_CHECK(tdm_dev_scratch(p->dev, sizeof(double), (void **)&buf));
    TDM_CHECK(tdm_dev_copy_from_host(p->dev, buf, &sq, sizeof sq));
    tdm_comm_set_label(comm, "tp clip grad norm over the group and replicas");
    tdm_status st = tdm_comm_all_reduce(comm, buf, buf, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM);
    if (st) {
        tdm_error_prefix(st, "tp rank %d: the gradient norm's all-reduce", p->rank);
        return st;
    }
    TDM_CHECK(tdm_dev_copy_to_host(p->dev, &sq, buf, sizeof sq));
    p->stats.last_norm = sqrt(sq);
    float *g;
    int64_t n;
    tdm_tp_grads_summed(p, &g, &n);
    return tdm_clip_apply_norm(p->dev, &g, &n, 1, p->lev.clip_norm, p->stats.last_norm);
}

tdm_status tdm_tp_levers_apply(tdm_tp *p, int *skip)
{
    const tdm_tp_levers *l = &p->lev;
    *skip = 0;
    float *g;
    int64_t n;
    tdm_tp_grads_summed(p, &g, &n);
    if (l->after_backward) l->after_backward(l->ctx, g, n, p->dev);
    if (l->scaler) {
        /* a replica whose ZeRO-2 chunk is all padding has nothing to check */
        if (n > 0) TDM_CHECK(tdm_grad_scaler_unscale(l->scaler, p->dev, g, n, skip));
        TDM_CHECK(tdm_grad_scaler_sync_found_inf(tdm_tp_lever_comm(p), p->dev, skip));
    }
    if (!*skip && (l->clip_norm > 0.0 || l->measure_norm)) TDM_CHECK(tdm_tp_norm(p));
    return TDM_STATUS_OK;
}

void tdm_tp_levers_done(tdm_tp *p, int skipped)
{
    if (p->lev.scaler) tdm_grad_scaler_update(p->lev.scaler, skipped);
    p->stats.last_skipped = skipped;
    p->stats.skipped += skipped;
}
