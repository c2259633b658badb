/* ddp/ddp.c: the DDP wrapper, in the order a training step uses it:
 * construction (the Reducer's checks and plan, rank 0's parameters
 * broadcast), forward (inputs staged to the device, loss and its
 * gradient, scaled for the SUM all-reduce), backward (local, or
 * synchronised through the Reducer: ddp/reducer.c), the optimizer step,
 * evaluation spread over the ranks, and rank-0 checkpoints. Not a
 * launcher and not a communicator: it only calls core/comm.h. */
#include "ddp/ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/log.h"
#include "ddp/reducer_impl.h"
#include "models/train.h"

struct tdm_ddp {
    tdm_model *m;                /* borrowed */
    tdm_comm *comm;              /* borrowed */
    tdm_comm *hcomm;             /* borrowed: host-memory collectives (o.host_comm or comm) */
    tdm_device *dev;             /* borrowed: the model's */
    tdm_ddp_opts o;
    int rank, world;
    tdm_ddp_reducer red;         /* the gradient storage, its buckets and their all-reduces */
    int sync;                    /* 0 under no_sync */
    uint64_t fwd_count;          /* training forwards run (the check tail's sequence) */
    int64_t steps_done;          /* optimizer steps: the flight recorder's step */
    double loss_accum, loss_global;  /* this rank's since the last sync; all ranks' */
    float *dlogits;
    size_t dlogits_bytes;
    void *x_dev;
    int32_t *y_dev;
    int stage_cap;
    int fwd_batch, have_fwd;
    int fwd_bn_empty;            /* that forward had no samples but shadowed SyncBatchNorm's sums */
    double fwd_loss;             /* the pending forward's loss sum, added at its backward */
    const char *fwd_lost;        /* why there is no forward to go back through, or NULL */
    int joined;                  /* opts.join: this rank ran out of data (tdm_ddp_join) */
    int n_active;                /* ranks that contributed to the last training forward */
    int join_sync;               /* opts.join: that forward's backward synchronises (else no_sync) */
    uint64_t ext_syncs;          /* tdm_ddp_sync_begin calls (the check tail's sequence) */
    uint32_t ext_seq;            /* the one begun */
    int ext_open;                /* between tdm_ddp_sync_begin and _end */
    tdm_ddp_times times;
};

size_t tdm_ddp_arena_bytes(int64_t param_elems)
{
    /* the gradients, the Reducer's check tail after them, and slack */
    return ((size_t)param_elems + TDM_DDP_TAIL_ELEMS) * sizeof(float) + 4096;
}

/* ---- construction ---- */

/* SyncBatchNorm's callback (models/model.h): per-channel partial sums
 * summed over the ranks, in rank order (float64 SUM). */
static tdm_status tdm_ddp_allsum(void *ctx, double *v, int n)
{
    tdm_ddp *d = ctx;
    tdm_comm_set_label(d->hcomm, "ddp SyncBatchNorm statistics");
    tdm_status st = tdm_comm_all_reduce(d->hcomm, v, v, (size_t)n, TDM_DTYPE_FLOAT64,
                                        TDM_REDOP_SUM);
    if (st) tdm_error_prefix(st, "ddp: SyncBatchNorm statistics");
    return st;
}

tdm_status tdm_ddp_init(tdm_ddp **out, tdm_model *m, tdm_comm *comm, const tdm_ddp_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(out && m && comm, TDM_STATUS_INVALID_ARG, "tdm_ddp_init: NULL argument");
    *out = NULL;
    TDM_REQUIRE(tdm_comm_size(comm) <= TDM_DDP_MAX_RANKS, TDM_STATUS_INVALID_ARG,
                "ddp: at most %d ranks (got %d)", TDM_DDP_MAX_RANKS, tdm_comm_size(comm));
    TDM_REQUIRE(tdm_model_n_params(m) > 0, TDM_STATUS_INVALID_ARG, "ddp: model has no parameters");
    tdm_ddp *d = calloc(1, sizeof *d);
    TDM_REQUIRE(d, TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
    d->m = m;
    d->comm = comm;
    d->dev = tdm_model_device(m);
    if (opts) d->o = *opts;
    d->hcomm = d->o.host_comm ? d->o.host_comm : comm;
    if (d->hcomm != comm &&
        (tdm_comm_rank(d->hcomm) != tdm_comm_rank(comm) ||
         tdm_comm_size(d->hcomm) != tdm_comm_size(comm))) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                           "ddp: host communicator is rank %d of %d but the communicator is "
                           "rank %d of %d", tdm_comm_rank(d->hcomm), tdm_comm_size(d->hcomm),
                           tdm_comm_rank(comm), tdm_comm_size(comm));
        free(d);
        return st;
    }
    d->rank = tdm_comm_rank(comm);
    d->world = tdm_comm_size(comm);
    d->sync = 1;
    d->n_active = d->world;
    TDM_TRY(tdm_ddp_reducer_init(&d->red, m, comm, d->hcomm, &d->o));
    tdm_comm_set_label(comm, "ddp broadcast parameters");
    TDM_TRY(tdm_comm_broadcast(comm, tdm_model_params(m), tdm_model_params(m),
                               (size_t)tdm_model_param_elems(m), TDM_DTYPE_FLOAT32, 0));
    if (tdm_model_buffer_elems(m) > 0) {
        tdm_comm_set_label(comm, "ddp broadcast buffers");
        TDM_TRY(tdm_comm_broadcast(comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                   (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0));
    }
    TDM_TRY(tdm_ddp_reducer_attach(&d->red));
    if (d->o.sync_bn) {
        if (d->o.join) {
            st = tdm_error_set(TDM_STATUS_INVALID_ARG, "ddp: sync_bn cannot be combined with "
                               "join (a joined rank runs no forward to take part in the "
                               "statistics)");
            goto fail;
        }
        tdm_model_set_sync_bn(m, tdm_ddp_allsum, d);
    }
    TDM_INFO(DDP, "rank %d of %d: %lld parameters in %d bucket(s), %s, overlap %s", d->rank,
             d->world, (long long)tdm_model_param_elems(m), d->red.nb,
             d->red.zero_copy ? "zero-copy" : "copying", d->o.no_overlap ? "off" : "on");
    *out = d;
    return TDM_STATUS_OK;
fail:
    /* tdm_ddp_free undoes any prefix of the above: no work is in flight,
     * and the Reducer gives back only what it took. */
    tdm_ddp_free(d);
    return st;
}

void tdm_ddp_free(tdm_ddp *d)
{
    if (!d) return;
    if (d->o.sync_bn) tdm_model_set_sync_bn(d->m, NULL, NULL);
    tdm_ddp_reducer_free(&d->red);
    tdm_dev_free(d->dev, d->dlogits);
    tdm_dev_free(d->dev, d->x_dev);
    tdm_dev_free(d->dev, d->y_dev);
    free(d);
}

tdm_model *tdm_ddp_model(tdm_ddp *d) { return d->m; }
tdm_comm *tdm_ddp_comm(tdm_ddp *d) { return d->comm; }
int tdm_ddp_n_buckets(const tdm_ddp *d) { return d->red.nb; }
int tdm_ddp_zero_copy(const tdm_ddp *d) { return d->red.zero_copy; }

void tdm_ddp_bucket_info(const tdm_ddp *d, int b, int *first_param, int *last_param,
                         int64_t *offset, int64_t *n_elem)
{
    const tdm_ddp_bucket *bk = &d->red.b[b];
    if (first_param) *first_param = bk->first;
    if (last_param) *last_param = bk->last;
    if (offset) *offset = bk->offset;
    if (n_elem) *n_elem = bk->n_elem;
}

tdm_status tdm_ddp_zero_grad(tdm_ddp *d) { return tdm_model_zero_grad(d->m); }

/* ---- communication hooks ---- */

static tdm_status tdm_ddp_hook_check(tdm_ddp *d, const tdm_ddp_comm_hook *hook)
{
    TDM_REQUIRE(hook && hook->launch && hook->wait, TDM_STATUS_INVALID_ARG,
                "ddp: a comm hook needs launch and wait functions");
    TDM_REQUIRE(!d->red.hook.launch, TDM_STATUS_INVALID_ARG,
                "ddp: a comm hook ('%s') is already registered; register one hook, once",
                d->red.hook.name ? d->red.hook.name : "user");
    TDM_REQUIRE(d->red.sync_count == 0 && !d->have_fwd, TDM_STATUS_INVALID_ARG,
                "ddp: register the comm hook before the first forward (as in PyTorch): "
                "%llu synchronised backward(s) already ran", (unsigned long long)d->red.sync_count);
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_register_comm_hook(tdm_ddp *d, const tdm_ddp_comm_hook *hook)
{
    TDM_CHECK(tdm_ddp_hook_check(d, hook));
    d->red.hook = *hook;
    d->red.own_hook = 0;
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_set_comm_hook(tdm_ddp *d, const char *name, const tdm_ddp_powersgd_opts *popts)
{
    tdm_ddp_comm_hook h;
    TDM_REQUIRE(d, TDM_STATUS_INVALID_ARG, "ddp: NULL");
    TDM_CHECK(tdm_ddp_hook_builtin_init(&h, name, popts));
    if (!strcmp(name, "allreduce")) {
        /* the Reducer's own path: zero-copy, check tail in the bucket */
        tdm_ddp_hook_builtin_free(&h);
        return TDM_STATUS_OK;
    }
    tdm_status st = TDM_STATUS_OK;
    if (tdm_dev_kind(d->dev) != TDM_DEVICE_HOST)
        st = tdm_error_set(TDM_STATUS_UNSUPPORTED, "ddp: comm hook %s runs on host devices "
                           "only (the model is on %s); use --comm-hook allreduce on GPUs",
                           name, tdm_dev_name(d->dev));
    if (!st) st = tdm_ddp_hook_check(d, &h);
    if (st) {
        tdm_ddp_hook_builtin_free(&h);
        return st;
    }
    d->red.hook = h;
    d->red.own_hook = 1;
    return TDM_STATUS_OK;
}

const char *tdm_ddp_comm_hook_name(const tdm_ddp *d)
{
    return d->red.hook.launch ? (d->red.hook.name ? d->red.hook.name : "user") : "allreduce";
}

void tdm_ddp_no_sync(tdm_ddp *d, int enable) { d->sync = !enable; }

/* ---- forward ---- */

static tdm_status tdm_ddp_stage(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                const void **xd, const int32_t **yd)
{
    if (tdm_dev_kind(d->dev) == TDM_DEVICE_HOST) {
        *xd = x;
        *yd = y;
        return TDM_STATUS_OK;
    }
    /* 4-byte inputs of either dtype; out_rows targets per sample */
    size_t feat = (size_t)tdm_model_in_features(d->m);
    size_t rows = (size_t)tdm_model_out_rows(d->m);
    if (batch > d->stage_cap) {
        tdm_dev_free(d->dev, d->x_dev);
        tdm_dev_free(d->dev, d->y_dev);
        d->x_dev = NULL;
        d->y_dev = NULL;
        d->stage_cap = 0;
        TDM_CHECK(tdm_dev_alloc(d->dev, (size_t)batch * feat * sizeof(float), &d->x_dev));
        TDM_CHECK(tdm_dev_alloc(d->dev, (size_t)batch * rows * sizeof(int32_t),
                                (void **)&d->y_dev));
        d->stage_cap = batch;
    }
    TDM_CHECK(tdm_dev_copy_from_host(d->dev, d->x_dev, x,
                                          (size_t)batch * feat * sizeof(float)));
    TDM_CHECK(tdm_dev_copy_from_host(d->dev, d->y_dev, y,
                                          (size_t)batch * rows * sizeof(int32_t)));
    *xd = d->x_dev;
    *yd = d->y_dev;
    return TDM_STATUS_OK;
}

/* opts.join, at each training forward: how many ranks still train (this
 * one contributes 1, a joined one 0) and how many of those will
 * synchronise in this forward's backward (not under no_sync), two int32
 * in one SUM over the host communicator. A joined rank shadows a
 * synchronised step only when the others synchronise: under no_sync
 * they accumulate locally, and a backward of its own would meet their
 * next forward's count (PyTorch's join hook asks the same question,
 * _check_global_requires_backward_grad_sync). */
static tdm_status tdm_ddp_join_count(tdm_ddp *d)
{
    int32_t v[2] = {d->joined ? 0 : 1, !d->joined && d->sync};
    /* named, as the buckets are: a rank that waits here while a peer
     * never comes (a joined rank shadowing one that died) is found by
     * `tandem doctor` in "ddp join count", not in an anonymous all_reduce */
    tdm_comm_set_label(d->hcomm, "ddp join count");
    tdm_status st = tdm_comm_all_reduce(d->hcomm, v, v, 2, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    if (st) return tdm_error_prefix(st, "ddp join: counting the ranks that still have data");
    /* every rank sees the same sums, so every rank fails here alike */
    TDM_REQUIRE(v[1] == 0 || v[1] == v[0], TDM_STATUS_INVALID_ARG,
                "ddp join: %d of the %d ranks still training synchronise in this forward and "
                "the others are under no_sync; call tdm_ddp_no_sync alike on every rank",
                v[1], v[0]);
    d->n_active = v[0];
    d->join_sync = v[1] > 0;
    return TDM_STATUS_OK;
}

/* by_active: the scale is 1/(batch * ranks with data this step) (join) */
static tdm_status tdm_ddp_forward_impl(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                       float grad_scale, int by_active, double *loss_sum)
{
    TDM_REQUIRE(batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "ddp forward: bad batch %d or NULL input", batch);
    TDM_REQUIRE(!d->joined || batch == 0, TDM_STATUS_INVALID_ARG,
                "ddp forward: this rank has joined (tdm_ddp_join): it has no data left");
    uint64_t t0 = tdm_time_ns();
    tdm_model *m = d->m;
    d->have_fwd = 0;
    d->fwd_lost = NULL;
    if (d->o.join && tdm_model_is_train(m) && d->world > 1 && !d->joined)
        TDM_CHECK(tdm_ddp_join_count(d));
    if (by_active)
        grad_scale = batch > 0 ? 1.0f / ((float)batch * (float)d->n_active) : 0.0f;
    else if (d->o.join && d->n_active > 0 && d->n_active != d->world)
        /* an explicit scale is meant for every rank: the mean over the
         * ranks that contribute to this step */
        grad_scale *= (float)d->world / (float)d->n_active;
    /* SyncBatchNorm on a rank without samples (a short last global
     * batch): the others wait in this rank's statistics, so it takes part
     * with zero sums and a count of 0 (as PyTorch's SyncBatchNorm) */
    int bn_empty = d->o.sync_bn && tdm_model_is_train(m) && batch == 0 &&
                   tdm_model_n_batchnorm(m) > 0;
    if (tdm_model_is_train(m) && !d->o.no_broadcast_buffers && d->world > 1 &&
        tdm_model_buffer_elems(m) > 0) {
        tdm_comm_set_label(d->comm, "ddp broadcast buffers");
        tdm_status st = tdm_comm_broadcast(d->comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                           (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0);
        if (st) return tdm_error_prefix(st, "ddp forward: broadcast of buffers from rank 0");
    }
    double ls = 0.0;
    uint64_t t1 = t0;
    d->fwd_bn_empty = 0;
    if (bn_empty) {
        tdm_status st = tdm_model_sync_bn_forward_empty(m);
        if (st) {
            tdm_error_prefix(st, "ddp forward: rank %d (no samples in this step)", d->rank);
            (void)tdm_comm_abort(d->hcomm, tdm_error_message());
            return st;
        }
        d->fwd_bn_empty = 1;
    }
    if (batch > 0) {
        const void *xd;
        const float *logits;
        const int32_t *yd;
        int C = tdm_model_n_classes(m) * tdm_model_out_rows(m);   /* logits per sample */
        size_t nb = (size_t)batch * (size_t)C * sizeof(float);
        TDM_CHECK(tdm_ddp_stage(d, x, y, batch, &xd, &yd));
        TDM_CHECK(tdm_model_forward(m, xd, batch, &logits));
        t1 = tdm_time_ns();
        if (nb > d->dlogits_bytes) {
            tdm_dev_free(d->dev, d->dlogits);
            d->dlogits = NULL;
            d->dlogits_bytes = 0;
            TDM_CHECK(tdm_dev_alloc(d->dev, nb, (void **)&d->dlogits));
            d->dlogits_bytes = nb;
        }
        TDM_CHECK(tdm_model_loss(m, logits, yd, batch, grad_scale, &ls, d->dlogits));
    }
    uint64_t t2 = tdm_time_ns();
    d->fwd_batch = batch;
    d->have_fwd = 1;
    d->fwd_loss = ls;   /* counted once its backward runs: a replaced forward is not reduced */
    if (tdm_model_is_train(m)) d->fwd_count++;
    d->times.last.ms[TDM_PHASE_FORWARD] = (double)(t1 - t0) * 1e-6;
    d->times.last.ms[TDM_PHASE_LOSS] = (double)(t2 - t1) * 1e-6;
    d->times.total.ms[TDM_PHASE_FORWARD] += (double)(t1 - t0) * 1e-6;
    d->times.total.ms[TDM_PHASE_LOSS] += (double)(t2 - t1) * 1e-6;
    if (loss_sum) *loss_sum = ls;
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_forward_scaled(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                  float grad_scale, double *loss_sum)
{
    return tdm_ddp_forward_impl(d, x, y, batch, grad_scale, 0, loss_sum);
}

tdm_status tdm_ddp_forward(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                           double *loss_mean)
{
    double ls = 0.0;
    /* 1/(batch * world), or with join 1/(batch * the ranks with data this
     * step): the mean over the ranks that contributed */
    TDM_CHECK(tdm_ddp_forward_impl(d, x, y, batch, 0.0f, 1, &ls));
    if (loss_mean) *loss_mean = batch > 0 ? ls / batch : 0.0;
    return TDM_STATUS_OK;
}

void tdm_ddp_share(int64_t n, int rank, int world, int64_t *lo, int64_t *hi)
{
    *lo = n * rank / world;
    *hi = n * (rank + 1) / world;
}

tdm_status tdm_ddp_forward_global(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                  double *loss_sum)
{
    return tdm_ddp_forward_global_scaled(d, x, y, batch,
                                         batch > 0 ? 1.0f / (float)batch : 0.0f, loss_sum);
}

tdm_status tdm_ddp_forward_global_scaled(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                         float grad_scale, double *loss_sum)
{
    TDM_REQUIRE(batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "ddp forward: bad global batch %d or NULL input", batch);
    if (batch == 0) return tdm_ddp_forward_scaled(d, NULL, NULL, 0, 0.0f, loss_sum);
    int64_t lo, hi;
    tdm_ddp_share(batch, d->rank, d->world, &lo, &hi);
    /* 4-byte inputs of either dtype; out_rows targets per sample */
    const char *xs = (const char *)x + lo * tdm_model_in_features(d->m) * (int64_t)sizeof(float);
    const int32_t *ys = y + lo * tdm_model_out_rows(d->m);
    return tdm_ddp_forward_scaled(d, xs, ys, (int)(hi - lo), grad_scale, loss_sum);
}

/* ---- backward ---- */

/* no_sync: the gradients accumulate locally; the hook does nothing. */
static tdm_status tdm_ddp_backward_local(tdm_ddp *d)
{
    uint64_t t0 = tdm_time_ns();
    if (d->fwd_batch > 0) TDM_CHECK(tdm_model_backward(d->m, d->dlogits));
    else if (d->fwd_bn_empty) TDM_CHECK(tdm_model_sync_bn_backward_empty(d->m));
    d->times.last.ms[TDM_PHASE_BACKWARD] = tdm_time_ms_since(t0);
    d->times.last.ms[TDM_PHASE_ALLREDUCE_WAIT] = 0;
    d->times.total.ms[TDM_PHASE_BACKWARD] += d->times.last.ms[TDM_PHASE_BACKWARD];
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_backward(tdm_ddp *d)
{
    TDM_REQUIRE(d->have_fwd || !d->fwd_lost, TDM_STATUS_INVALID_ARG,
                "ddp backward: %s; call tdm_ddp_forward again before backward", d->fwd_lost);
    TDM_REQUIRE(d->have_fwd, TDM_STATUS_INVALID_ARG, "ddp backward: no forward before it");
    d->have_fwd = 0;
    d->loss_accum += d->fwd_loss;
    if (!d->sync) return tdm_ddp_backward_local(d);
    uint32_t seq = (uint32_t)(d->fwd_count % TDM_DDP_SEQ_MOD) + 1;
    TDM_CHECK(tdm_ddp_reducer_begin(&d->red, seq, d->loss_accum));
    d->loss_accum = 0.0;
    if (d->fwd_batch > 0 || d->fwd_bn_empty) {
        d->red.in_backward = 1;   /* the grad-ready hook launches buckets */
        tdm_status st = d->fwd_batch > 0 ? tdm_model_backward(d->m, d->dlogits)
                                         : tdm_model_sync_bn_backward_empty(d->m);
        d->red.in_backward = 0;
        if (st) return tdm_ddp_reducer_abort(&d->red, st);
    }
    uint64_t t1 = tdm_time_ns();
    TDM_CHECK(tdm_ddp_reducer_end(&d->red, seq, d->fwd_batch > 0, &d->loss_global));
    uint64_t t2 = tdm_time_ns();
    tdm_ddp_times *t = &d->times;
    t->comm_ms_last = tdm_ddp_reducer_comm_ms(&d->red);
    t->comm_ms_total += t->comm_ms_last;
    t->last.ms[TDM_PHASE_BACKWARD] = (double)(t1 - d->red.t0) * 1e-6;
    t->last.ms[TDM_PHASE_ALLREDUCE_WAIT] = (double)(t2 - t1) * 1e-6;
    t->total.ms[TDM_PHASE_BACKWARD] += t->last.ms[TDM_PHASE_BACKWARD];
    t->total.ms[TDM_PHASE_ALLREDUCE_WAIT] += t->last.ms[TDM_PHASE_ALLREDUCE_WAIT];
    t->exposed_ms_total = t->total.ms[TDM_PHASE_ALLREDUCE_WAIT];
    t->steps++;
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_sync_begin(tdm_ddp *d, double loss_sum)
{
    TDM_REQUIRE(!d->ext_open, TDM_STATUS_INVALID_ARG,
                "ddp sync_begin: the previous synchronised backward was not ended");
    TDM_REQUIRE(d->sync && !d->o.join, TDM_STATUS_INVALID_ARG,
                "ddp sync_begin: not under no_sync, and not with join");
    d->ext_seq = (uint32_t)(d->ext_syncs % TDM_DDP_SEQ_MOD) + 1;
    TDM_CHECK(tdm_ddp_reducer_begin(&d->red, d->ext_seq, loss_sum));
    d->ext_syncs++;
    d->ext_open = 1;
    d->red.in_backward = 1;   /* the grad-ready hook launches buckets */
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_sync_end(tdm_ddp *d, tdm_status backward_status)
{
    TDM_REQUIRE(d->ext_open, TDM_STATUS_INVALID_ARG, "ddp sync_end: no sync_begin before it");
    d->ext_open = 0;
    d->red.in_backward = 0;
    if (backward_status) return tdm_ddp_reducer_abort(&d->red, backward_status);
    uint64_t t1 = tdm_time_ns();
    TDM_CHECK(tdm_ddp_reducer_end(&d->red, d->ext_seq, 1, &d->loss_global));
    tdm_ddp_times *t = &d->times;
    t->comm_ms_last = tdm_ddp_reducer_comm_ms(&d->red);
    t->comm_ms_total += t->comm_ms_last;
    t->last.ms[TDM_PHASE_BACKWARD] = (double)(t1 - d->red.t0) * 1e-6;
    t->last.ms[TDM_PHASE_ALLREDUCE_WAIT] = tdm_time_ms_since(t1);
    t->total.ms[TDM_PHASE_BACKWARD] += t->last.ms[TDM_PHASE_BACKWARD];
    t->total.ms[TDM_PHASE_ALLREDUCE_WAIT] += t->last.ms[TDM_PHASE_ALLREDUCE_WAIT];
    t->exposed_ms_total = t->total.ms[TDM_PHASE_ALLREDUCE_WAIT];
    t->steps++;
    return TDM_STATUS_OK;
}

double tdm_ddp_loss_sum(const tdm_ddp *d) { return d->loss_global; }

/* ---- uneven inputs (join) ---- */

int tdm_ddp_active_ranks(const tdm_ddp *d) { return d->n_active; }

tdm_status tdm_ddp_join(tdm_ddp *d, tdm_optim *opt, int64_t *shadowed)
{
    TDM_REQUIRE(d->o.join, TDM_STATUS_INVALID_ARG,
                "ddp join: construct DDP with opts.join = 1 (every rank counts the ranks with "
                "data at each forward)");
    TDM_REQUIRE(d->sync, TDM_STATUS_INVALID_ARG,
                "ddp join: called under no_sync; finish the accumulation first");
    int64_t n = 0;
    if (shadowed) *shadowed = 0;
    if (d->world == 1) return TDM_STATUS_OK;
    d->joined = 1;
    d->have_fwd = 0;
    tdm_status st = TDM_STATUS_OK;
    for (;;) {
        if ((st = tdm_ddp_join_count(d))) break;
        if (d->n_active == 0) break;   /* every rank has joined: all leave here */
        if (!d->join_sync) {
            /* a no_sync micro-batch of the others: they only accumulate;
             * this rank takes part in the buffer broadcast and counts the
             * forward (the sequence check), no backward, no step */
            if ((st = tdm_ddp_forward_impl(d, NULL, NULL, 0, 0.0f, 0, NULL))) break;
            d->have_fwd = 0;
            continue;
        }
        /* one synchronised step of the others: a rank without samples
         * takes part in the buffer broadcast and reduces zeros */
        if ((st = tdm_ddp_zero_grad(d))) break;
        if ((st = tdm_ddp_forward_impl(d, NULL, NULL, 0, 0.0f, 0, NULL))) break;
        if ((st = tdm_ddp_backward(d))) break;
        if (opt && (st = tdm_ddp_step(d, opt))) break;
        n++;
    }
    /* a later epoch starts with every rank training again */
    d->joined = 0;
    d->n_active = d->world;
    if (shadowed) *shadowed = n;
    if (st) {
        tdm_error_prefix(st, "ddp join: rank %d, after shadowing %lld step(s)", d->rank,
                         (long long)n);
        (void)tdm_comm_abort(d->hcomm, tdm_error_message());
    }
    return st;
}

/* ---- optimizer step ---- */

tdm_status tdm_ddp_step(tdm_ddp *d, tdm_optim *opt)
{
    uint64_t t0 = tdm_time_ns();
    TDM_CHECK(tdm_optim_step(opt));
    TDM_CHECK(tdm_dev_sync(d->dev));
    d->steps_done++;
    tdm_comm_set_step(d->comm, d->steps_done);
    if (d->hcomm != d->comm) tdm_comm_set_step(d->hcomm, d->steps_done);
    double ms = tdm_time_ms_since(t0);
    d->times.last.ms[TDM_PHASE_STEP] = ms;
    d->times.total.ms[TDM_PHASE_STEP] += ms;
    return TDM_STATUS_OK;
}

void tdm_ddp_get_times(const tdm_ddp *d, tdm_ddp_times *out)
{
    *out = d->times;
    out->reduced_bytes_total = d->red.reduced_bytes;
    out->overlapped_bytes_total = d->red.overlapped_bytes;
    out->n_buckets = d->red.nb;
    out->buckets = d->red.bt;
}

/* ---- evaluation ---- */

tdm_status tdm_ddp_evaluate(tdm_ddp *d, const tdm_dataset *test, int batch, double *loss_mean,
                            double *accuracy)
{
    tdm_model *m = d->m;
    TDM_REQUIRE(test && batch > 0 && loss_mean && accuracy, TDM_STATUS_INVALID_ARG,
                "ddp evaluate: test, batch > 0 and outputs are required");
    /* Evaluation runs forwards on this same model: a pending training
     * forward's activations are about to be overwritten. */
    if (d->have_fwd) {
        d->have_fwd = 0;
        d->fwd_lost = "tdm_ddp_evaluate ran forwards on the model since the last "
                      "tdm_ddp_forward and replaced its activations";
    }
    if (d->world > 1 && tdm_model_buffer_elems(m) > 0) {
        tdm_comm_set_label(d->comm, "ddp broadcast buffers (evaluate)");
        tdm_status st = tdm_comm_broadcast(d->comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                           (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0);
        if (st) return tdm_error_prefix(st, "ddp evaluate: broadcast of buffers from rank 0");
    }
    int64_t lo, hi;
    tdm_ddp_share(test->n, d->rank, d->world, &lo, &hi);
    double sums[3] = {0.0, 0.0, (double)(hi - lo)}; /* loss sum, correct, samples */
    if (hi > lo) {
        tdm_dataset part = *test;
        part.n = hi - lo;
        part.x = test->x + lo * tdm_data_features(test);
        part.y = test->y + lo;
        double l = 0.0, a = 0.0;
        tdm_status st = tdm_evaluate(m, &part, batch, &l, &a);
        if (st) {
            /* the others are about to wait for this rank's sums */
            tdm_error_prefix(st, "ddp evaluate: rank %d (rows %lld..%lld)", d->rank,
                             (long long)lo, (long long)hi - 1);
            (void)tdm_comm_abort(d->hcomm, tdm_error_message());
            return st;
        }
        sums[0] = l * (double)part.n;
        sums[1] = a * (double)part.n;
    }
    tdm_comm_set_label(d->hcomm, "ddp evaluate sums");
    TDM_CHECK(tdm_comm_all_reduce(d->hcomm, sums, sums, 3, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    TDM_REQUIRE(sums[2] > 0, TDM_STATUS_INVALID_ARG, "ddp evaluate: the test set is empty");
    *loss_mean = sums[0] / sums[2];
    *accuracy = sums[1] / sums[2];
    return TDM_STATUS_OK;
}

/* ---- checkpoints ---- */

tdm_status tdm_ddp_checkpoint_save(tdm_ddp *d, const char *path, tdm_optim *opt,
                                   const tdm_ckpt_info *info)
{
    int32_t ok = 1;
    char msg[512] = "";
    tdm_status mine = TDM_STATUS_OK;
    if (d->rank == 0) {
        mine = tdm_checkpoint_save(path, d->m, opt, info);
        if (mine) {
            ok = 0;
            snprintf(msg, sizeof msg, "%s", tdm_error_message());
        }
    }
    /* Doubles as the barrier: nobody goes on before the file is in place. */
    tdm_comm_set_label(d->hcomm, "ddp checkpoint saved flag");
    TDM_CHECK(tdm_comm_broadcast(d->hcomm, &ok, &ok, 1, TDM_DTYPE_INT32, 0));
    if (mine) return tdm_error_set(mine, "%s", msg);
    TDM_REQUIRE(ok, TDM_STATUS_IO, "ddp: rank 0 failed to save the checkpoint %s", path);
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_checkpoint_load(tdm_ddp *d, const char *path, tdm_optim *opt,
                                   tdm_ckpt_info *info)
{
    tdm_comm_set_label(d->hcomm, "ddp checkpoint load");
    TDM_CHECK(tdm_comm_barrier(d->hcomm));
    tdm_status mine = tdm_checkpoint_load(path, d->m, opt, info);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mine ? tdm_error_message() : "");
    int32_t *all = calloc((size_t)d->world, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
    all[d->rank] = (int32_t)mine;
    tdm_comm_set_label(d->hcomm, "ddp checkpoint load statuses");
    tdm_status st = tdm_comm_all_gather(d->hcomm, all + d->rank, all, 1, TDM_DTYPE_INT32);
    int bad = -1;
    for (int r = 0; st == TDM_STATUS_OK && r < d->world; r++)
        if (all[r] && bad < 0) bad = r;
    free(all);
    TDM_CHECK(st);
    if (mine) return tdm_error_set(mine, "%s", msg);
    TDM_REQUIRE(bad < 0, TDM_STATUS_PEER_FAILED, "ddp: rank %d failed to load the checkpoint %s",
                bad, path);
    return TDM_STATUS_OK;
}
