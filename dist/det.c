/* dist/det.c: world-size-invariant steps (see dist/det.h): K virtual
 * shards per global batch, one fixed binary tree over their gradients. */
#include "dist/det.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/batch.h"
#include "models/accum.h"

tdm_status tdm_dist_det_check(int K, int world, int64_t batch)
{
    if (K < 1 || K > TDM_DIST_DET_MAX_K || (K & (K - 1)) != 0)
        return tdm_error_set(TDM_STATUS_USAGE, "--deterministic %d: K must be a power of two "
                             "from 1 to %d (1, 2, 4, 8, ...)", K, TDM_DIST_DET_MAX_K);
    if (world < 1 || K % world != 0)
        return tdm_error_set(TDM_STATUS_USAGE, "--deterministic %d: K must be divisible by the "
                             "%d devices (each computes K/N whole virtual shards); use %s", K,
                             world, world > K ? "fewer devices or a larger K"
                                              : "a power-of-two device count");
    if (batch % K != 0)
        return tdm_error_set(TDM_STATUS_USAGE, "--deterministic %d: the global batch %lld is not "
                             "divisible by K (every virtual shard holds batch/K samples)", K,
                             (long long)batch);
    return TDM_STATUS_OK;
}

/* ---- the ops ---- */

static tdm_status tdm_det_single_zero(void *ctx)
{
    return tdm_accum_single_ops.zero_grad(ctx);
}

static tdm_status tdm_det_single_shard(void *ctx, const void *x, const int32_t *y, int n,
                                       float scale, double *loss_sum)
{
    *loss_sum = 0.0;
    if (n == 0) return TDM_STATUS_OK;   /* a shard without samples adds nothing */
    return tdm_accum_single_ops.micro(ctx, x, y, n, scale, 0, 1, loss_sum);
}

static tdm_status tdm_det_single_step(void *ctx)
{
    double unused = 0.0;
    return tdm_accum_single_ops.step(ctx, &unused);
}

const tdm_dist_det_ops tdm_dist_det_single_ops = {.zero_grad = tdm_det_single_zero,
                                                  .shard = tdm_det_single_shard,
                                                  .step = tdm_det_single_step};

static tdm_status tdm_det_stepper_zero(void *ctx)
{
    tdm_dist_stepper *s = ctx;
    return s->ops->zero_grad(s->w);
}

static tdm_status tdm_det_stepper_shard(void *ctx, const void *x, const int32_t *y, int n,
                                        float scale, double *loss_sum)
{
    tdm_dist_stepper *s = ctx;
    s->ops->no_sync(s->w, 1);
    tdm_status st = s->ops->forward(s->w, x, y, n, scale, loss_sum);
    if (st == TDM_STATUS_OK) st = s->ops->backward(s->w);
    s->ops->no_sync(s->w, 0);
    return st;
}

static tdm_status tdm_det_stepper_step(void *ctx)
{
    tdm_dist_stepper *s = ctx;
    return s->ops->step(s->w, s->opt);
}

static tdm_status tdm_det_stepper_local(void *ctx, float *host)
{
    tdm_dist_stepper *s = ctx;
    return s->ops->local_grads(s->w, host);
}

static tdm_status tdm_det_stepper_set(void *ctx, const float *host)
{
    tdm_dist_stepper *s = ctx;
    return s->ops->set_grads(s->w, host);
}

static const tdm_dist_det_ops tdm_det_stepper_flat = {.zero_grad = tdm_det_stepper_zero,
                                                      .shard = tdm_det_stepper_shard,
                                                      .step = tdm_det_stepper_step};
static const tdm_dist_det_ops tdm_det_stepper_own = {.zero_grad = tdm_det_stepper_zero,
                                                     .shard = tdm_det_stepper_shard,
                                                     .step = tdm_det_stepper_step,
                                                     .local_grads = tdm_det_stepper_local,
                                                     .set_grads = tdm_det_stepper_set};

const tdm_dist_det_ops *tdm_dist_det_stepper_ops(const tdm_dist_stepper *s)
{
    return s->ops->local_grads && s->ops->set_grads ? &tdm_det_stepper_own
                                                     : &tdm_det_stepper_flat;
}

/* ---- set-up ---- */

/* The model's, or (m NULL) the design's flat gradients without buffers. */
static int64_t tdm_det_pe(const tdm_dist_det *d)
{
    return d->m ? tdm_model_param_elems(d->m) : d->flat_elems;
}
static int64_t tdm_det_be(const tdm_dist_det *d)
{
    return d->m ? tdm_model_buffer_elems(d->m) : 0;
}
static tdm_device *tdm_det_dev(const tdm_dist_det *d)
{
    return d->m ? tdm_model_device(d->m) : d->flat_dev;
}
static float *tdm_det_grads(const tdm_dist_det *d)
{
    return d->m ? tdm_model_grads(d->m) : d->flat_grads;
}

static int tdm_det_log2(int v)
{
    int l = 0;
    while ((1 << l) < v) l++;
    return l;
}

tdm_status tdm_dist_det_init(tdm_dist_det *d)
{
    TDM_REQUIRE(d && (d->m || (d->flat_dev && d->flat_elems > 0 && !d->ops)) && d->world >= 1 &&
                    d->rank >= 0 && d->rank < d->world,
                TDM_STATUS_INVALID_ARG, "deterministic step: a model (or fed flat gradients) "
                "and a rank in the world are required");
    TDM_CHECK(tdm_dist_det_check(d->K, d->world, d->own_rows ? d->global_batch : d->K));
    int m = d->K / d->world;
    int64_t pe = tdm_det_pe(d), be = tdm_det_be(d);
    TDM_REQUIRE(tdm_det_grads(d) || (d->ops && d->ops->local_grads && d->ops->set_grads),
                TDM_STATUS_INVALID_ARG,
                "deterministic step: the model's flat gradients are required (a design that "
                "gives them up cannot honour the tree)");
    d->n_vec = pe + be;
    d->n_send = d->n_vec + 2 * (int64_t)m;   /* the shards' losses, a double in 2 floats */
    d->max_depth = tdm_det_log2(m) + 1;
    d->depth = 0;
    d->level = calloc((size_t)d->max_depth, sizeof *d->level);
    d->stack = malloc((size_t)d->max_depth * (size_t)d->n_vec * sizeof(float));
    /* over a comm the ranks' sums arrive a chunk at a time (tdm_det_top_chunked) */
    d->chunk = 0;
    if (d->comm && d->world > 1 && !d->gather_borrowed) {
        int64_t c = d->chunk_elems > 0 ? d->chunk_elems
                                       : TDM_DIST_DET_CHUNK_BYTES / (int64_t)sizeof(float);
        d->chunk = c < d->n_send ? c : d->n_send;
        d->sum = malloc((size_t)(d->n_vec ? d->n_vec : 1) * sizeof(float));
        d->stage = malloc((size_t)d->chunk * sizeof(float));
    }
    tdm_status dst = TDM_STATUS_OK;
    if (d->chunk && d->dev_comm) {
        tdm_device *dev = tdm_det_dev(d);
        dst = tdm_dev_alloc(dev, (size_t)d->chunk * sizeof(float), (void **)&d->dstage);
        if (!dst) dst = tdm_dev_alloc(dev, (size_t)d->world * (size_t)d->chunk * sizeof(float),
                                      (void **)&d->dgather);
        if (dst) {
            tdm_dist_det_free(d);
            return dst;
        }
    }
    if (!d->gather_borrowed)
        d->gather = malloc((size_t)d->world * (size_t)(d->chunk ? d->chunk : d->n_send) *
                           sizeof(float));
    d->total = malloc((size_t)(d->n_vec ? d->n_vec : 1) * sizeof(float));
    d->snapshot = malloc((size_t)(be ? be : 1) * sizeof(float));
    d->losses = calloc((size_t)d->K, sizeof *d->losses);
    if (!d->level || !d->stack || !d->gather || !d->total || !d->snapshot || !d->losses ||
        (d->chunk && (!d->sum || !d->stage))) {
        tdm_dist_det_free(d);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "deterministic step: %d subtree sums of "
                             "%lld floats and %d ranks' of them do not fit in memory",
                             d->max_depth, (long long)d->n_vec, d->world);
    }
    return TDM_STATUS_OK;
}

void tdm_dist_det_free(tdm_dist_det *d)
{
    if (!d) return;
    free(d->level);
    free(d->stack);
    if (!d->gather_borrowed) free(d->gather);
    free(d->total);
    free(d->snapshot);
    free(d->losses);
    free(d->sum);
    free(d->stage);
    if (d->dstage) tdm_dev_free(tdm_det_dev(d), d->dstage);
    if (d->dgather) tdm_dev_free(tdm_det_dev(d), d->dgather);
    d->dstage = d->dgather = NULL;
    d->level = NULL;
    d->stack = d->gather = d->total = d->snapshot = d->sum = d->stage = NULL;
    d->losses = NULL;
}

/* ---- the tree ---- */

/* dst = dst + src, element by element: a node of the tree, dst its left
 * child (the earlier shards). */
static void tdm_det_add(float *restrict dst, const float *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = dst[i] + src[i];
}

/* out = a + b, element by element: a node written elsewhere. */
static void tdm_det_add3(float *restrict out, const float *restrict a, const float *restrict b,
                         int64_t n)
{
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* The leaf just written at the top of the stack joins the tree: while
 * the sum below it is of the same level, they become their parent (a
 * binary counter: with leaves arriving in order this builds the perfect
 * tree over them). */
static void tdm_det_carry(tdm_dist_det *d)
{
    while (d->depth >= 2 && d->level[d->depth - 2] == d->level[d->depth - 1]) {
        float *left = d->stack + (int64_t)(d->depth - 2) * d->n_vec;
        tdm_det_add(left, left + d->n_vec, d->n_vec);
        d->level[d->depth - 2]++;
        d->depth--;
    }
}

static void tdm_det_push(tdm_dist_det *d)
{
    d->level[d->depth++] = 0;
    tdm_det_carry(d);
}

/* One rank alone (no gather buffer shared with others): its subtree is
 * the whole tree, read where it is (the stack's bottom). */
static int tdm_det_alone(const tdm_dist_det *d) { return d->world == 1 && !d->gather_borrowed; }

/* Where the tree's top (the micro-batch's sum) is after tdm_dist_det_top. */
static float *tdm_det_top_vec(tdm_dist_det *d)
{
    return d->chunk ? d->sum : tdm_det_alone(d) ? d->stack : d->gather;
}

/* A failure: the rank's message, and the group stopped with it. */
static tdm_status tdm_det_fail(tdm_dist_det *d, tdm_status st)
{
    if (!d->comm) return st;
    tdm_error_prefix(st, "rank %d", d->rank);
    tdm_comm_abort(d->comm, tdm_error_message());
    return st;
}

/* Shard k's rows of the micro-batch at x, y of b samples (the global
 * batch's rows from row0; own_rows: x starts at this rank's first row). */
static void tdm_det_rows(const tdm_dist_det *d, const void *x, const int32_t *y, int b, int k,
                         int64_t row0, const void **xs, const int32_t **ys, int *n)
{
    int64_t lo, hi;
    tdm_dist_share(b, k, d->K, &lo, &hi);
    lo -= row0;
    *xs = (const char *)x + lo * d->in_elems * (int64_t)sizeof(float);
    *ys = y + lo * d->out_rows;
    *n = (int)(hi - (lo + row0));
}

tdm_status tdm_dist_det_snapshot(tdm_dist_det *d)
{
    int64_t be = tdm_det_be(d);
    if (!be) return TDM_STATUS_OK;
    tdm_status st = tdm_dev_copy_to_host(tdm_det_dev(d), d->snapshot,
                                         tdm_model_buffers(d->m), (size_t)be * sizeof(float));
    return st ? tdm_det_fail(d, st) : st;
}

/* Shard k's gradients and buffers, now the model's, as the next leaf of
 * this rank's subtree, and its loss sum. */
static tdm_status tdm_det_leaf(tdm_dist_det *d, int k, double loss)
{
    tdm_device *dev = tdm_det_dev(d);
    int64_t pe = tdm_det_pe(d), be = tdm_det_be(d);
    tdm_status st;
    d->losses[k] = loss;
    int own = d->ops && d->ops->local_grads;
    if (!own && d->depth >= 1 && d->level[d->depth - 1] == 0 &&
        tdm_dev_kind(dev) == TDM_DEVICE_HOST) {
        /* a right leaf whose left sibling waits, in host memory: added
         * straight from the model into its parent (the same additions,
         * without a copy of the leaf) */
        float *left = d->stack + (int64_t)(d->depth - 1) * d->n_vec;
        if (pe) tdm_det_add(left, tdm_det_grads(d), pe);
        if (be) tdm_det_add(left + pe, tdm_model_buffers(d->m), be);
        d->level[d->depth - 1] = 1;
        tdm_det_carry(d);
        return TDM_STATUS_OK;
    }
    float *leaf = d->stack + (int64_t)d->depth * d->n_vec;
    if ((pe && own && (st = d->ops->local_grads(d->ctx, leaf))) ||
        (pe && !own && (st = tdm_dev_copy_to_host(dev, leaf, tdm_det_grads(d),
                                                  (size_t)pe * sizeof(float)))) ||
        (be && (st = tdm_dev_copy_to_host(dev, leaf + pe, tdm_model_buffers(d->m),
                                          (size_t)be * sizeof(float)))))
        return tdm_det_fail(d, st);
    tdm_det_push(d);
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_det_feed(tdm_dist_det *d, int j, double loss)
{
    int m = d->K / d->world;
    if (j < 0 || j >= m || (j > 0 && d->depth == 0))
        return tdm_det_fail(d, tdm_error_set(TDM_STATUS_INTERNAL, "deterministic step: leaf %d "
                                             "of %d fed out of order", j, m));
    if (j == 0) d->depth = 0;
    TDM_CHECK(tdm_det_leaf(d, d->rank * m + j, loss));
    if (j < m - 1 || d->chunk || tdm_det_alone(d)) return TDM_STATUS_OK;
    float *mine = d->gather + (int64_t)d->rank * d->n_send;
    memcpy(mine, d->stack, (size_t)d->n_vec * sizeof(float));
    memcpy(mine + d->n_vec, d->losses + d->rank * m, (size_t)m * sizeof(double));
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_det_local(tdm_dist_det *d, const void *x, const int32_t *y, int b,
                              int64_t row0, float scale)
{
    tdm_device *dev = tdm_det_dev(d);
    int64_t be = tdm_det_be(d);
    int m = d->K / d->world;
    tdm_status st;
    d->depth = 0;
    /* dropout's masks count the model's training forwards: shard k's
     * forward is the step's k-th, as on one device, whichever rank runs
     * it, and every rank ends the step at the count one device does */
    int64_t fwd0 = d->m ? tdm_model_train_forwards(d->m) : 0;
    for (int j = 0; j < m; j++) {
        int k = d->rank * m + j, n;
        const void *xs;
        const int32_t *ys;
        tdm_det_rows(d, x, y, b, k, row0, &xs, &ys, &n);
        if (d->m) tdm_model_set_train_forwards(d->m, fwd0 + k);
        if (be && (st = tdm_dev_copy_from_host(dev, tdm_model_buffers(d->m), d->snapshot,
                                               (size_t)be * sizeof(float))))
            return tdm_det_fail(d, st);
        double ls = 0.0;
        if ((st = d->ops->zero_grad(d->ctx)) || (st = d->ops->shard(d->ctx, xs, ys, n, scale, &ls)))
            return tdm_det_fail(d, st);
        if (!isfinite(ls)) {
            char where[96];
            snprintf(where, sizeof where, "%s %d, virtual shard %d of %d",
                     d->comm ? "rank" : "device", d->rank, k, d->K);
            if (d->comm) return tdm_dist_diverged(d->comm, d->rank, d->begun, ls, where);
            return tdm_error_set(TDM_STATUS_NONFINITE, "loss is %s at step %lld (%s): training "
                                 "diverged (a lower learning rate may help)",
                                 isnan(ls) ? "NaN" : "inf", (long long)d->begun, where);
        }
        if ((st = tdm_det_leaf(d, k, ls))) return st;
    }
    if (d->m) tdm_model_set_train_forwards(d->m, fwd0 + d->K);
    /* this rank's subtree and its shards' losses, in its slot (over a
     * comm they are sent from the stack and the losses, a chunk at a time) */
    if (d->chunk || tdm_det_alone(d)) return TDM_STATUS_OK;
    float *mine = d->gather + (int64_t)d->rank * d->n_send;
    memcpy(mine, d->stack, (size_t)d->n_vec * sizeof(float));
    memcpy(mine + d->n_vec, d->losses + d->rank * m, (size_t)m * sizeof(double));
    return TDM_STATUS_OK;
}

/* One chunk of cc floats at send (host; its first nv the subtree sum's,
 * from element c0) through the device communicator: all-gathered on the
 * device, the top levels added there in the host's order, the sum's part
 * and every rank's losses copied back. */
static tdm_status tdm_det_top_dev(tdm_dist_det *d, const float *send, int64_t cc, int64_t nv,
                                  int64_t c0)
{
    tdm_device *dev = tdm_det_dev(d);
    int m = d->K / d->world;
    tdm_status st = tdm_dev_copy_from_host(dev, d->dstage, send, (size_t)cc * sizeof(float));
    if (!st) {
        tdm_comm_set_label(d->dev_comm, "deterministic all_gather of subtree sums (device)");
        st = tdm_comm_all_gather(d->dev_comm, d->dstage, d->dgather, (size_t)cc,
                                 TDM_DTYPE_FLOAT32);
    }
    /* dst = 1 * src + dst: left + right, the one rounding of a host add */
    for (int s = 1; s < d->world && !st && nv; s *= 2)
        for (int i = 0; i + s < d->world && !st; i += 2 * s)
            st = tdm_dev_axpy(dev, nv, 1.0f, d->dgather + (int64_t)(i + s) * cc,
                              d->dgather + (int64_t)i * cc);
    if (!st && nv)
        st = tdm_dev_copy_to_host(dev, d->sum + c0, d->dgather, (size_t)nv * sizeof(float));
    for (int r = 0; r < d->world && nv < cc && !st; r++)
        st = tdm_dev_copy_to_host(dev, (float *)(d->losses + r * m) + (c0 + nv - d->n_vec),
                                  d->dgather + (int64_t)r * cc + nv,
                                  (size_t)(cc - nv) * sizeof(float));
    if (st) {
        /* the others may wait in the device collective, or the host's */
        if (d->dev_comm != d->comm) tdm_comm_abort(d->dev_comm, tdm_error_message());
        return tdm_det_fail(d, st);
    }
    return TDM_STATUS_OK;
}

/* The top over a comm, chunk by chunk: this rank's part of the logical
 * vector [subtree sum (n_vec), shard losses (2m floats)] all-gathered,
 * the top levels added over the chunk's slots (the same elementwise
 * additions as over whole slots) into sum, the losses unpacked. */
static tdm_status tdm_det_top_chunked(tdm_dist_det *d)
{
    int m = d->K / d->world;
    const float *mine_losses = (const float *)(d->losses + d->rank * m);
    for (int64_t c0 = 0; c0 < d->n_send; c0 += d->chunk) {
        int64_t cc = d->n_send - c0 < d->chunk ? d->n_send - c0 : d->chunk;
        int64_t nv = c0 >= d->n_vec ? 0 : d->n_vec - c0 < cc ? d->n_vec - c0 : cc;
        const float *send = d->stack + c0;
        if (nv < cc) {   /* the chunk with the losses */
            memcpy(d->stage, d->stack + c0, (size_t)nv * sizeof(float));
            memcpy(d->stage + nv, mine_losses + (c0 + nv - d->n_vec),
                   (size_t)(cc - nv) * sizeof(float));
            send = d->stage;
        }
        if (d->dev_comm) {
            TDM_CHECK(tdm_det_top_dev(d, send, cc, nv, c0));
            continue;
        }
        tdm_comm_set_label(d->comm, "deterministic all_gather of subtree sums");
        tdm_status st = tdm_comm_all_gather(d->comm, send, d->gather, (size_t)cc,
                                            TDM_DTYPE_FLOAT32);
        if (st) return tdm_det_fail(d, st);
        /* the top levels; the last one's single addition (the world is a
         * power of two) written straight into the sum */
        for (int s = 1; s < d->world; s *= 2)
            for (int i = 0; i + s < d->world; i += 2 * s) {
                float *l = d->gather + (int64_t)i * cc;
                const float *r = d->gather + (int64_t)(i + s) * cc;
                if (2 * s >= d->world) tdm_det_add3(d->sum + c0, l, r, nv);
                else tdm_det_add(l, r, nv);
            }
        for (int r = 0; r < d->world && nv < cc; r++)
            memcpy((float *)(d->losses + r * m) + (c0 + nv - d->n_vec),
                   d->gather + (int64_t)r * cc + nv, (size_t)(cc - nv) * sizeof(float));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_det_top(tdm_dist_det *d, double *loss_sum)
{
    int m = d->K / d->world;
    if (d->chunk) {
        TDM_CHECK(tdm_det_top_chunked(d));
        double sum = 0.0;
        for (int k = 0; k < d->K; k++) sum += d->losses[k];
        *loss_sum = sum;
        return TDM_STATUS_OK;
    }
    if (tdm_det_alone(d)) {
        double sum = 0.0;
        for (int k = 0; k < d->K; k++) sum += d->losses[k];
        *loss_sum = sum;
        return TDM_STATUS_OK;
    }
    if (d->world > 1 && d->comm) {
        float *mine = d->gather + (int64_t)d->rank * d->n_send;
        tdm_comm_set_label(d->comm, "deterministic all_gather of subtree sums");
        tdm_status st = tdm_comm_all_gather(d->comm, mine, d->gather, (size_t)d->n_send,
                                            TDM_DTYPE_FLOAT32);
        if (st) return tdm_det_fail(d, st);
    }
    /* the top log2(N) levels, the same order on every rank */
    for (int s = 1; s < d->world; s *= 2)
        for (int i = 0; i + s < d->world; i += 2 * s)
            tdm_det_add(d->gather + (int64_t)i * d->n_send,
                        d->gather + (int64_t)(i + s) * d->n_send, d->n_vec);
    for (int r = 0; r < d->world; r++)
        memcpy(d->losses + r * m, d->gather + (int64_t)r * d->n_send + d->n_vec,
               (size_t)m * sizeof(double));
    double sum = 0.0;
    for (int k = 0; k < d->K; k++) sum += d->losses[k];
    *loss_sum = sum;
    return TDM_STATUS_OK;
}

void tdm_dist_det_accumulate(tdm_dist_det *d, int micro_index)
{
    const float *top = tdm_det_top_vec(d);
    if (micro_index == 0) memcpy(d->total, top, (size_t)d->n_vec * sizeof(float));
    else tdm_det_add(d->total, top, d->n_vec);
}

/* The step's sum at src (its buffer part scaled in place) into the
 * model's gradients and buffers. */
static tdm_status tdm_det_write_from(tdm_dist_det *d, float *src, int n_micro)
{
    tdm_device *dev = tdm_det_dev(d);
    int64_t pe = tdm_det_pe(d), be = tdm_det_be(d);
    tdm_status st;
    /* the mean of the shards' buffer updates; 1/K is exact for one
     * micro-batch (K a power of two) */
    float inv = (float)(1.0 / ((double)d->K * n_micro));
    for (int64_t i = pe; i < d->n_vec; i++) src[i] *= inv;
    int own = d->ops && d->ops->set_grads;
    if ((pe && own && (st = d->ops->set_grads(d->ctx, src))) ||
        (pe && !own && (st = tdm_dev_copy_from_host(dev, tdm_det_grads(d), src,
                                                    (size_t)pe * sizeof(float)))) ||
        (be && (st = tdm_dev_copy_from_host(dev, tdm_model_buffers(d->m), src + pe,
                                            (size_t)be * sizeof(float)))))
        return tdm_det_fail(d, st);
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_det_write(tdm_dist_det *d, int n_micro)
{
    return tdm_det_write_from(d, d->total, n_micro);
}

tdm_status tdm_dist_det_write_top(tdm_dist_det *d)
{
    return tdm_det_write_from(d, tdm_det_top_vec(d), 1);
}

tdm_status tdm_dist_det_apply(tdm_dist_det *d, int n_micro)
{
    /* one micro-batch: its top is the step's sum, written from where it is */
    TDM_CHECK(n_micro == 1 ? tdm_dist_det_write_top(d) : tdm_dist_det_write(d, n_micro));
    tdm_status st = d->ops->step(d->ctx);
    return st ? tdm_det_fail(d, st) : st;
}

tdm_status tdm_dist_det_step(void *det, const void *x, const int32_t *y, int batch,
                             double *loss_mean)
{
    tdm_dist_det *d = det;
    int global = d->own_rows ? d->global_batch : batch;
    int mb = d->micro > 0 && !d->own_rows ? d->micro : global;
    int n_micro = (global + mb - 1) / mb;
    int64_t row0 = 0, hi;
    if (d->own_rows) tdm_dist_share(global, d->rank, d->world, &row0, &hi);
    d->begun++;
    if (d->before) d->before(d->before_ctx, d->begun);
    TDM_CHECK(tdm_dist_det_snapshot(d));
    /* 1/(the whole effective batch) for every shard: the sum is its
     * mean-loss gradient */
    float scale = 1.0f / (float)global;
    double loss_total = 0.0;
    for (int a = 0; a < n_micro; a++) {
        int lo = a * mb, b = global - lo < mb ? global - lo : mb;
        const char *xa = (const char *)x + (int64_t)lo * d->in_elems * (int64_t)sizeof(float);
        double ls = 0.0;
        TDM_CHECK(tdm_dist_det_local(d, xa, y + (int64_t)lo * d->out_rows, b, row0, scale));
        TDM_CHECK(tdm_dist_det_top(d, &ls));
        loss_total += ls;
        if (n_micro > 1) tdm_dist_det_accumulate(d, a);
    }
    TDM_CHECK(tdm_dist_det_apply(d, n_micro));
    *loss_mean = loss_total / global;
    return TDM_STATUS_OK;
}
