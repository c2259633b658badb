/* tp/step.c: a tensor-parallel rank's forward (the row-parallel partial
 * outputs all-reduced), loss, backward (the column-parallel input
 * gradients all-reduced), the sum over the dp dimension, the optimizer
 * step, and evaluation. The data flow is tp/tp.h's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"
#include "tp/tp_impl.h"

tdm_status tdm_tp_fail(tdm_tp *p, tdm_status st)
{
    if (p->failed) return st;
    p->failed = 1;
    /* the other ranks wait in (or are about to enter) a collective */
    tdm_comm_abort(p->comm, tdm_error_message());
    if (p->hcomm != p->comm) tdm_comm_abort(p->hcomm, tdm_error_message());
    if (p->gcomm) tdm_comm_abort(p->gcomm, tdm_error_message());
    if (p->lev.comm && p->lev.comm != p->comm && p->lev.comm != p->gcomm)
        tdm_comm_abort(p->lev.comm, tdm_error_message());
    return st;
}

tdm_status tdm_tp_allreduce(tdm_tp *p, float *buf, int64_t n, const char *what, int l)
{
    TDM_CHECK(tdm_dev_sync(p->dev));
    tdm_comm_set_label(p->comm, "tp all-reduce %s%d", what, l);
    tdm_status st = tdm_comm_all_reduce(p->comm, buf, buf, (size_t)n, TDM_DTYPE_FLOAT32,
                                        TDM_REDOP_SUM);
    if (st) tdm_error_prefix(st, "tp rank %d: the all-reduce %s%d", p->rank, what, l);
    return st;
}

/* Forward of B samples already at p->x: the logits in the last layer's
 * act. Times the all-reduces into *ar_ms. */
static tdm_status tdm_tp_forward(tdm_tp *p, int B, int train, double *ar_ms)
{
    const float *cur = p->x;
    TDM_CHECK(tdm_tp_post_forward(p, 0, B, p->shape.dims[0], 0, train, &cur));
    for (int l = 0; l < p->n_layers; l++) {
        tdm_tp_layer *L = &p->layers[l];
        L->in_act = cur;
        /* act (B, lout) = cur (B, lin) W^T, W (lout, lin) */
        TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_N, TDM_TRANS_T, B, L->lout, L->lin, 1.0f, cur,
                              p->params + L->w_off, 0.0f, L->act));
        if (L->split == TDM_TP_ROW && p->size > 1) {
            uint64_t t0 = tdm_time_ns();
            TDM_CHECK(tdm_tp_allreduce(p, L->act, (int64_t)B * L->lout, "forward fc", l + 1));
            *ar_ms += tdm_time_ms_since(t0);
        }
        TDM_CHECK(tdm_dev_bias_act(p->dev, L->act, p->params + L->b_off, B, L->lout,
                                   L->relu ? TDM_ACT_RELU : TDM_ACT_NONE));
        cur = L->act;
        if (L->act == p->ckpt_act) p->ckpt_live = l;
        int64_t j0 = L->split == TDM_TP_COLUMN ? (int64_t)p->rank * L->lout : 0;
        TDM_CHECK(tdm_tp_post_forward(p, l + 1, B, L->lout, j0, train, &cur));
    }
    return TDM_STATUS_OK;
}

/* Backward from the loss gradient in dbuf[0] (B, classes). */
static tdm_status tdm_tp_backward(tdm_tp *p, int B, double *ar_ms)
{
    int cur = 0;
    for (int l = p->n_layers - 1; l >= 0; l--) {
        tdm_tp_layer *L = &p->layers[l];
        float *dout = p->dbuf[cur], *din = p->dbuf[1 - cur];
        int64_t j0 = L->split == TDM_TP_COLUMN ? (int64_t)p->rank * L->lout : 0;
        TDM_CHECK(tdm_tp_post_backward(p, l + 1, B, L->lout, j0, L->act, dout));
        /* activation checkpointing: a row layer's input, its column
         * partner's output, is recomputed unless the shared buffer
         * holds it (the last pair's, after the forward) */
        if (L->split == TDM_TP_ROW && p->ckpt_act && p->ckpt_live != l - 1) {
            const tdm_tp_layer *c = &p->layers[l - 1];
            TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_N, TDM_TRANS_T, B, c->lout, c->lin, 1.0f,
                                  c->in_act, p->params + c->w_off, 0.0f, c->act));
            TDM_CHECK(tdm_dev_bias_act(p->dev, c->act, p->params + c->b_off, B, c->lout,
                                       c->relu ? TDM_ACT_RELU : TDM_ACT_NONE));
            p->ckpt_live = l - 1;
        }
        if (L->relu) TDM_CHECK(tdm_dev_relu_bwd(p->dev, dout, L->act, (int64_t)B * L->lout));
        /* dW (lout, lin) += dout^T x; db (1, lout) += ones (1, B) dout */
        float *gw, *gb;
        TDM_CHECK(tdm_tp_grad_at(p, L->w_off, &gw));
        TDM_CHECK(tdm_tp_grad_at(p, L->b_off, &gb));
        TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_T, TDM_TRANS_N, L->lout, L->lin, B, 1.0f, dout,
                              L->in_act, 1.0f, gw));
        TDM_CHECK(tdm_dev_gemm_rm(p->dev, TDM_TRANS_N, TDM_TRANS_N, 1, L->lout, B, 1.0f, p->ones,
                                  dout, 1.0f, gb));
        /* ZeRO-2's buckets from layer l on are final */
        TDM_CHECK(tdm_tp_grads_done(p, L->w_off));
        if (l == 0) break;   /* the data needs no gradient */
        /* din (B, lin) = dout (B, lout) W (lout, lin): a partial sum on a
         * column-parallel layer, whose input is replicated */
        TDM_CHECK(tdm_tp_gemm(p, TDM_TRANS_N, TDM_TRANS_N, B, L->lin, L->lout, 1.0f, dout,
                              p->params + L->w_off, 0.0f, din));
        if (L->split == TDM_TP_COLUMN && p->size > 1) {
            uint64_t t0 = tdm_time_ns();
            TDM_CHECK(tdm_tp_allreduce(p, din, (int64_t)B * L->lin, "backward fc", l + 1));
            *ar_ms += tdm_time_ms_since(t0);
        }
        cur = 1 - cur;
    }
    return TDM_STATUS_OK;
}

/* Input elements (4 bytes: features or tokens) and target rows per sample. */
static int tdm_tp_in_elems(const tdm_tp *p)
{
    return p->gpt ? p->spec.n_ctx : p->shape.dims[0];
}
static int tdm_tp_rows(const tdm_tp *p) { return p->gpt ? p->spec.n_ctx : 1; }
static int tdm_tp_classes(const tdm_tp *p)
{
    return p->gpt ? p->spec.vocab : p->shape.dims[p->n_layers];
}

static tdm_status tdm_tp_inputs(tdm_tp *p, const void *x, const int32_t *y, int B, int train)
{
    TDM_REQUIRE(B >= 1 && x && y, TDM_STATUS_INVALID_ARG,
                "tp: a batch needs x, y and at least one sample (got %d)", B);
    if (p->gpt) {
        const int32_t *tok = x;
        for (int64_t i = 0; i < (int64_t)B * p->spec.n_ctx; i++)
            TDM_REQUIRE(tok[i] >= 0 && tok[i] < p->spec.vocab, TDM_STATUS_INVALID_ARG,
                        "tp: token %d at position %lld of window %lld is outside the "
                        "vocabulary [0, %d)", (int)tok[i], (long long)(i % p->spec.n_ctx),
                        (long long)(i / p->spec.n_ctx), p->spec.vocab);
    }
    TDM_CHECK(tdm_tp_reserve(p, B));
    if (train && !p->gpt) TDM_CHECK(tdm_tp_drop_keys(p, x, B));
    size_t n = (size_t)B * (size_t)tdm_tp_rows(p);
    TDM_CHECK(tdm_dev_copy_from_host(p->dev, p->x, x,
                                     (size_t)B * (size_t)tdm_tp_in_elems(p) * sizeof(float)));
    return tdm_dev_copy_from_host(p->dev, p->y, y, n * sizeof(int32_t));
}

/* The logits of the B samples at p->x (B * rows, classes). */
static tdm_status tdm_tp_logits(tdm_tp *p, int B, int train, const float **logits,
                                double *ar_ms)
{
    if (p->gpt) return tdm_tp_gpt_forward(p, B, logits, ar_ms);
    TDM_CHECK(tdm_tp_forward(p, B, train, ar_ms));
    const tdm_tp_layer *L = &p->layers[p->n_layers - 1];
    int k = p->shape.n_post[p->n_layers];
    *logits = k ? p->shape.post[p->n_layers][k - 1].out : L->act;
    return TDM_STATUS_OK;
}

/* The loss of the logits (a sample's: the mean over its rows) and, with
 * dlogits, its gradient times grad_scale, as tdm_model_loss. */
static tdm_status tdm_tp_loss(tdm_tp *p, const float *logits, int B, float grad_scale,
                              double *loss_sum, float *dlogits)
{
    int rows = tdm_tp_rows(p);
    double s = 0.0;
    TDM_CHECK(tdm_loss_softmax_xent(p->dev, logits, p->y, B * rows, tdm_tp_classes(p),
                                    rows == 1 ? grad_scale : grad_scale / (float)rows, &s,
                                    dlogits));
    *loss_sum = rows == 1 ? s : s / rows;
    return TDM_STATUS_OK;
}

static tdm_status tdm_tp_fwd_bwd(tdm_tp *p, const void *x, const int32_t *y, int B,
                                 float grad_scale, double *loss_sum, tdm_tp_phases *ph)
{
    uint64_t t0 = tdm_time_ns();
    const float *logits = NULL;
    /* ZeRO-2: the step's whole gradient, zeroed, if nothing took it yet
     * (with buckets: each at its first use) */
    if (!p->grads && !p->buckets) TDM_CHECK(tdm_tp_grads_take(p));
    TDM_CHECK(tdm_tp_inputs(p, x, y, B, 1));
    TDM_CHECK(tdm_tp_logits(p, B, 1, &logits, &ph->fwd_allreduce));
    ph->forward += tdm_time_ms_since(t0) - ph->fwd_allreduce;
    t0 = tdm_time_ns();
    float *dlogits = p->gpt ? tdm_tp_gpt_dlogits(p) : p->dbuf[0];
    double ls = 0.0;
    /* loss scaling: grad_scale times the scale, one rounding (exact for
     * the scaler's powers of two), as one device's step */
    TDM_CHECK(tdm_tp_loss(p, logits, B, grad_scale * tdm_tp_loss_scale(p), &ls, dlogits));
    if (loss_sum) *loss_sum = ls;
    ph->loss += tdm_time_ms_since(t0);
    t0 = tdm_time_ns();
    if (p->gpt) TDM_CHECK(tdm_tp_gpt_backward(p, B, dlogits, &ph->bwd_allreduce));
    else TDM_CHECK(tdm_tp_backward(p, B, &ph->bwd_allreduce));
    ph->backward += tdm_time_ms_since(t0) - ph->bwd_allreduce;
    return TDM_STATUS_OK;
}

/* ZeRO's sum: the replica's chunk of the gradients summed over
 * grad_comm (a reduce-scatter: each replica steps only its chunk, so
 * the rest of the sum is never needed) from p->grads (zreps * zchunk
 * floats: the padding past n_elem is zero). ZeRO-1: in place, into the
 * chunk's place in p->grads, whose other elements are then not the sum
 * (the replica's own gradient, or the backend's scratch: MPI's in-place
 * reduce-scatter). ZeRO-2: into the kept shard, and the whole gradient
 * is released. */
static tdm_status tdm_tp_sync_chunk(tdm_tp *p)
{
    int64_t c = p->zchunk;
    int z2 = p->zero == TDM_TP_ZERO_GRADS;
    if (p->buckets) return tdm_tp_buckets_flush(p);
    tdm_comm_set_label(p->gcomm, "tp zero%d reduce-scatter of the gradients over the dp "
                       "dimension", z2 ? 2 : 1);
    tdm_status st = tdm_comm_reduce_scatter(p->gcomm, p->grads,
                                            z2 ? p->gshard : p->grads + (int64_t)p->zrep * c,
                                            (size_t)c, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
    if (st)
        tdm_error_prefix(st, "tp rank %d: ZeRO-%d's reduce-scatter of the gradients over the "
                         "dp dimension (replica %d)", p->rank, z2 ? 2 : 1, p->zrep);
    else tdm_tp_grads_release(p);
    return st;
}

/* The sum of the accumulated gradients over grad_comm (the dp
 * dimension), once per optimizer step: summing on every
 * forward_backward would count an earlier micro-batch's gradient once
 * per replica again at each later call. */
static tdm_status tdm_tp_sync(tdm_tp *p, tdm_tp_phases *ph)
{
    /* sequence parallel: the LayerNorms' partial gradients over the
     * group first (once per step too: the sum of the micro-batches'
     * partial sums) */
    if (p->gpt) TDM_CHECK(tdm_tp_gpt_sum_ln(p, &ph->grad_sync));
    if (!p->gcomm || tdm_comm_size(p->gcomm) < 2) return TDM_STATUS_OK;
    uint64_t t0 = tdm_time_ns();
    TDM_CHECK(tdm_dev_sync(p->dev));
    tdm_status st;
    if (p->zero != TDM_TP_ZERO_NONE) {
        st = tdm_tp_sync_chunk(p);
    } else {
        tdm_comm_set_label(p->gcomm, "tp gradients over the dp dimension");
        st = tdm_comm_all_reduce(p->gcomm, p->grads, p->grads, (size_t)p->n_elem,
                                 TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
        if (st) tdm_error_prefix(st, "tp rank %d: gradients over the dp dimension", p->rank);
    }
    ph->grad_sync += tdm_time_ms_since(t0);
    return st;
}

tdm_status tdm_tp_zero_grad(tdm_tp *p)
{
    if (p->buckets) return tdm_tp_buckets_zero(p);
    return tdm_tp_grads_take(p);
}

/* ZeRO-1 and 2's step: the replica's chunk of the summed gradients steps its
 * chunk of the parameters (the optimizer holds that chunk's state
 * only), then every replica's chunk is all-gathered over the dp
 * dimension into every replica's parameters, in place (zreps * zchunk
 * floats). SGD and AdamW update each element from its own gradient and
 * state: the plain step's bits. */
static tdm_status tdm_tp_step_zero(tdm_tp *p)
{
    int64_t lo, k, c = p->zchunk;
    tdm_tp_zero_range(p, &lo, &k);
    float *g;
    int64_t n;
    tdm_tp_grads_summed(p, &g, &n);
    tdm_optim_range rg = {.param = p->params + lo, .grad = g == p->gshard ? g : g + lo,
                          .state_offset = 0, .n_elem = k};
    TDM_CHECK(tdm_optim_step_ranges(p->opt, &rg, k > 0));
    TDM_CHECK(tdm_dev_sync(p->dev));
    tdm_comm_set_label(p->gcomm, "tp zero%d gather of the parameters over the dp dimension",
                       p->zero == TDM_TP_ZERO_GRADS ? 2 : 1);
    tdm_status st = tdm_comm_all_gather(p->gcomm, p->params + (int64_t)p->zrep * c, p->params,
                                        (size_t)c, TDM_DTYPE_FLOAT32);
    if (st)
        tdm_error_prefix(st, "tp rank %d: ZeRO-%d's gather over the dp dimension (replica %d)",
                         p->rank, p->zero == TDM_TP_ZERO_GRADS ? 2 : 1, p->zrep);
    return st;
}

static tdm_status tdm_tp_step_plain(tdm_tp *p)
{
    if (p->zero != TDM_TP_ZERO_NONE) return tdm_tp_step_zero(p);
    tdm_optim_range rg = {.param = p->params, .grad = p->grads, .state_offset = 0,
                          .n_elem = p->n_elem};
    return tdm_optim_step_ranges(p->opt, &rg, 1);
}

/* The levers (tp/levers.c), then the optimizer step unless every rank
 * skips it (found inf). */
static tdm_status tdm_tp_step_only(tdm_tp *p)
{
    int skip = 0;
    TDM_CHECK(tdm_tp_levers_apply(p, &skip));
    if (!skip) TDM_CHECK(tdm_tp_step_plain(p));
    tdm_tp_levers_done(p, skip);
    return TDM_STATUS_OK;
}

/* The phases of a step (or of an accumulated step's part) into the
 * stats; steps: optimizer steps it completes (0 or 1). */
static void tdm_tp_count(tdm_tp *p, const tdm_tp_phases *ph, int steps)
{
    tdm_tp_phases *s = &p->stats.sum;
    s->forward += ph->forward;
    s->fwd_allreduce += ph->fwd_allreduce;
    s->loss += ph->loss;
    s->backward += ph->backward;
    s->bwd_allreduce += ph->bwd_allreduce;
    s->grad_sync += ph->grad_sync;
    s->step += ph->step;
    s->total += ph->total;
    p->stats.steps += steps;
}

tdm_status tdm_tp_optim_step(tdm_tp *p)
{
    tdm_tp_phases ph = {0};
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_tp_sync(p, &ph);
    uint64_t t1 = tdm_time_ns();
    if (!st) st = tdm_tp_step_only(p);
    if (!st) st = tdm_dev_sync(p->dev);
    if (st) return tdm_tp_fail(p, st);
    ph.step = tdm_time_ms_since(t1);
    ph.total = tdm_time_ms_since(t0);
    tdm_tp_count(p, &ph, 1);
    return TDM_STATUS_OK;
}

/* One micro-batch; last: its backward leaves the step's final
 * gradients (ZeRO-2's buckets are summed as backward completes them). */
static tdm_status tdm_tp_micro(tdm_tp *p, const void *x, const int32_t *y, int batch,
                               float grad_scale, double *loss_sum, int last)
{
    tdm_tp_phases ph = {0};
    uint64_t t0 = tdm_time_ns();
    p->flush_bwd = last;
    tdm_status st = tdm_tp_fwd_bwd(p, x, y, batch, grad_scale, loss_sum, &ph);
    p->flush_bwd = 0;
    if (st) return tdm_tp_fail(p, st);
    ph.total = tdm_time_ms_since(t0);
    tdm_tp_count(p, &ph, 0);
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_forward_backward(tdm_tp *p, const void *x, const int32_t *y, int batch,
                                   float grad_scale, double *loss_sum)
{
    return tdm_tp_micro(p, x, y, batch, grad_scale, loss_sum, 0);
}

tdm_status tdm_tp_forward_backward_last(tdm_tp *p, const void *x, const int32_t *y, int batch,
                                        float grad_scale, double *loss_sum)
{
    return tdm_tp_micro(p, x, y, batch, grad_scale, loss_sum, 1);
}

tdm_status tdm_tp_step_scaled(tdm_tp *p, const void *x, const int32_t *y, int batch,
                              float grad_scale, double *loss_sum)
{
    uint64_t t0 = tdm_time_ns();
    tdm_tp_phases ph = {0};
    tdm_status st = tdm_tp_zero_grad(p);
    /* an empty share (a short last batch over the dp dimension): a zero
     * gradient, still summed with the other replicas' and stepped */
    if (!st && batch == 0 && loss_sum) *loss_sum = 0.0;
    p->flush_bwd = 1;
    if (!st && batch != 0) st = tdm_tp_fwd_bwd(p, x, y, batch, grad_scale, loss_sum, &ph);
    p->flush_bwd = 0;
    if (!st) st = tdm_tp_sync(p, &ph);
    uint64_t t1 = tdm_time_ns();
    if (!st) st = tdm_tp_step_only(p);
    if (!st) st = tdm_dev_sync(p->dev);
    if (st) return tdm_tp_fail(p, st);
    ph.step = tdm_time_ms_since(t1);
    ph.total = tdm_time_ms_since(t0);
    p->stats.last = ph;
    tdm_tp_count(p, &ph, 1);
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_eval_batch(tdm_tp *p, const void *x, const int32_t *y, int batch,
                             double *loss_sum, int64_t *correct)
{
    double ar = 0.0, ls = 0.0;
    const float *logits = NULL;
    int C = tdm_tp_classes(p), R = batch * tdm_tp_rows(p);
    tdm_status st = tdm_tp_inputs(p, x, y, batch, 0);
    if (!st) st = tdm_tp_logits(p, batch, 0, &logits, &ar);
    if (!st) st = tdm_tp_loss(p, logits, batch, 1.0f, &ls, NULL);
    if (!st) st = tdm_dev_copy_to_host(p->dev, p->host_logits, logits,
                                       (size_t)R * (size_t)C * sizeof(float));
    if (st) return tdm_tp_fail(p, st);
    int64_t ok = 0;
    for (int i = 0; i < R; i++) {
        const float *row = p->host_logits + (int64_t)i * C;
        int best = 0;
        for (int c = 1; c < C; c++)
            if (row[c] > row[best]) best = c;
        ok += best == y[i];
    }
    *loss_sum = ls;
    *correct = ok;
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_evaluate(tdm_tp *p, const tdm_dataset *d, int batch, double *loss_mean,
                           double *accuracy)
{
    TDM_REQUIRE(d && batch > 0 && loss_mean && accuracy && d->n > 0, TDM_STATUS_INVALID_ARG,
                "tp evaluate: a non-empty test set, batch > 0 and outputs are required");
    TDM_REQUIRE(!p->gpt, TDM_STATUS_INVALID_ARG, "tp evaluate: image data, not the GPT's");
    TDM_REQUIRE(tdm_data_features(d) == p->shape.dims[0], TDM_STATUS_INVALID_ARG,
                "tp evaluate: the data has %lld features per sample, the model reads %d",
                (long long)tdm_data_features(d), p->shape.dims[0]);
    int64_t F = tdm_data_features(d), *idx = malloc((size_t)batch * sizeof *idx);
    float *x = malloc((size_t)batch * (size_t)F * sizeof(float));
    int32_t *y = malloc((size_t)batch * sizeof *y);
    double loss = 0.0;
    int64_t correct = 0;
    tdm_status st = idx && x && y ? TDM_STATUS_OK
                                  : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "tp evaluate: malloc");
    for (int64_t i0 = 0; st == TDM_STATUS_OK && i0 < d->n; i0 += batch) {
        int n = (int)(d->n - i0 < batch ? d->n - i0 : batch);
        for (int i = 0; i < n; i++) idx[i] = i0 + i;
        tdm_data_gather(d, idx, n, x, y);
        double ls = 0.0;
        int64_t c = 0;
        st = tdm_tp_eval_batch(p, x, y, n, &ls, &c);
        loss += ls;
        correct += c;
    }
    free(idx);
    free(x);
    free(y);
    if (st) return st;
    *loss_mean = loss / (double)d->n;
    *accuracy = (double)correct / (double)d->n;
    return TDM_STATUS_OK;
}
