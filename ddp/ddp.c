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
#include "dist/join.h"
#include "dist/step.h"
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
    int64_t steps_done;          /* optimizer steps: the flight recorder's step */
    double loss_accum, loss_global;  /* this rank's since the last sync; all ranks' */
    tdm_train_stage stage;        /* the batch on the device, the loss gradient */
    tdm_dist_fwd fwd;            /* the forward backward goes back through (its count: the
                                    check tail's sequence) */
    int fwd_bn_empty;            /* that forward had no samples but shadowed SyncBatchNorm's sums */
    tdm_dist_join join;          /* opts.join: the ranks with data, this rank joined */
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

/* Defined before tdm_ddp_init, whose fail path runs it on any prefix of
 * what it made. */
void tdm_ddp_free(tdm_ddp *d)
{
    if (!d) return;
    if (d->o.sync_bn) tdm_model_set_sync_bn(d->m, NULL, NULL);
    tdm_ddp_reducer_free(&d->red);
    tdm_train_stage_free(&d->stage);
    free(d);
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
    d->stage.dev = d->dev;
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
    tdm_dist_join_init(&d->join, d->world);
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
    TDM_REQUIRE(d->red.sync_count == 0 && d->fwd.state != TDM_DIST_FWD_PENDING,
                TDM_STATUS_INVALID_ARG,
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

/* opts.join, at each training forward: how many ranks still train and
 * how many of those synchronise in this forward's backward (dist/join.h).
 * A joined rank shadows a synchronised step only when the others
 * synchronise: under no_sync they accumulate locally, and a backward of
 * its own would meet their next forward's count (PyTorch's join hook asks
 * the same question, _check_global_requires_backward_grad_sync). */
static tdm_status tdm_ddp_join_count(tdm_ddp *d)
{
    return tdm_dist_join_count(&d->join, d->hcomm, d->sync, "ddp", "ddp join count");
}

/* by_active: the scale is 1/(batch * ranks with data this step) (join) */
static tdm_status tdm_ddp_forward_impl(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                       float grad_scale, int by_active, double *loss_sum)
{
    TDM_REQUIRE(batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "ddp forward: bad batch %d or NULL input", batch);
    TDM_REQUIRE(!d->join.joined || batch == 0, TDM_STATUS_INVALID_ARG,
                "ddp forward: this rank has joined (tdm_ddp_join): it has no data left");
    uint64_t t0 = tdm_time_ns();
    tdm_model *m = d->m;
    tdm_dist_fwd_begin(&d->fwd);
    if (d->o.join && tdm_model_is_train(m) && d->world > 1 && !d->join.joined)
        TDM_CHECK(tdm_ddp_join_count(d));
    /* by_active: 1/(batch * the ranks with data); an explicit scale is
     * meant for every rank: under join, the mean over those that
     * contribute (without join every rank does) */
    if (by_active || d->o.join)
        grad_scale = tdm_dist_join_scale(&d->join, d->world, batch, by_active, grad_scale);
    /* SyncBatchNorm on a rank without samples (a short last global
     * batch): the others wait in this rank's statistics, so it takes part
     * with zero sums and a count of 0 (as PyTorch's SyncBatchNorm) */
    int bn_empty = d->o.sync_bn && tdm_model_is_train(m) && batch == 0 &&
                   tdm_model_n_batchnorm(m) > 0;
    if (tdm_model_is_train(m) && !d->o.no_broadcast_buffers)
        TDM_CHECK(tdm_dist_broadcast_buffers(d->comm, m, "ddp broadcast buffers", "ddp forward"));
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
        const int32_t *yd;
        TDM_CHECK(tdm_train_stage_batch(&d->stage, m, x, y, batch, &xd, &yd));
        TDM_CHECK(tdm_dist_forward_loss(&d->stage, m, NULL, NULL, xd, yd, batch, grad_scale, &ls,
                                        &t1));
    }
    uint64_t t2 = tdm_time_ns();
    tdm_dist_fwd_done(&d->fwd, batch, ls, tdm_model_is_train(m));
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
    tdm_dist_share(batch, d->rank, d->world, &lo, &hi);
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
    if (d->fwd.batch > 0) TDM_CHECK(tdm_model_backward(d->m, d->stage.dlogits));
    else if (d->fwd_bn_empty) TDM_CHECK(tdm_model_sync_bn_backward_empty(d->m));
    d->times.last.ms[TDM_PHASE_BACKWARD] = tdm_time_ms_since(t0);
    d->times.last.ms[TDM_PHASE_ALLREDUCE_WAIT] = 0;
    d->times.total.ms[TDM_PHASE_BACKWARD] += d->times.last.ms[TDM_PHASE_BACKWARD];
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_backward(tdm_ddp *d)
{
    double fwd_loss;
    TDM_CHECK(tdm_dist_fwd_take(&d->fwd, "ddp", &fwd_loss));
    d->loss_accum += fwd_loss;
    if (!d->sync) return tdm_ddp_backward_local(d);
    uint32_t seq = (uint32_t)(d->fwd.count % TDM_DDP_SEQ_MOD) + 1;
    TDM_CHECK(tdm_ddp_reducer_begin(&d->red, seq, d->loss_accum));
    d->loss_accum = 0.0;
    if (d->fwd.batch > 0 || d->fwd_bn_empty) {
        d->red.in_backward = 1;   /* the grad-ready hook launches buckets */
        tdm_status st = d->fwd.batch > 0 ? tdm_model_backward(d->m, d->stage.dlogits)
                                         : tdm_model_sync_bn_backward_empty(d->m);
        d->red.in_backward = 0;
        if (st) return tdm_ddp_reducer_abort(&d->red, st);
    }
    uint64_t t1 = tdm_time_ns();
    TDM_CHECK(tdm_ddp_reducer_end(&d->red, seq, d->fwd.batch > 0, &d->loss_global));
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

/* had_samples 0: no backward ran between the halves (a rank without
 * samples); the Reducer reduces every gradient as it stands, as
 * tdm_ddp_backward does for an empty forward. */
static tdm_status tdm_ddp_sync_finish(tdm_ddp *d, tdm_status backward_status, int had_samples)
{
    TDM_REQUIRE(d->ext_open, TDM_STATUS_INVALID_ARG, "ddp sync_end: no sync_begin before it");
    d->ext_open = 0;
    d->red.in_backward = 0;
    if (backward_status) return tdm_ddp_reducer_abort(&d->red, backward_status);
    uint64_t t1 = tdm_time_ns();
    TDM_CHECK(tdm_ddp_reducer_end(&d->red, d->ext_seq, had_samples, &d->loss_global));
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

tdm_status tdm_ddp_sync_end(tdm_ddp *d, tdm_status backward_status)
{
    return tdm_ddp_sync_finish(d, backward_status, 1);
}

tdm_status tdm_ddp_sync_empty(tdm_ddp *d)
{
    TDM_CHECK(tdm_ddp_sync_begin(d, 0.0));
    return tdm_ddp_sync_finish(d, TDM_STATUS_OK, 0);
}

double tdm_ddp_loss_sum(const tdm_ddp *d) { return d->loss_global; }

/* ---- uneven inputs (join) ---- */

int tdm_ddp_active_ranks(const tdm_ddp *d) { return d->join.n_active; }

/* One step of the others, as a rank without samples: sync, a
 * synchronised step (the buffer broadcast, the gradient all-reduce of
 * zeros, the optimizer step); else a no_sync micro-batch of theirs, where
 * they only accumulate: the buffer broadcast and the forward's count (the
 * sequence check), no backward, no step. */
static tdm_status tdm_ddp_shadow_step(void *w, tdm_optim *opt, int sync)
{
    tdm_ddp *d = w;
    if (!sync) {
        TDM_CHECK(tdm_ddp_forward_impl(d, NULL, NULL, 0, 0.0f, 0, NULL));
        d->fwd.state = TDM_DIST_FWD_NONE;   /* no backward follows it */
        return TDM_STATUS_OK;
    }
    TDM_CHECK(tdm_ddp_zero_grad(d));
    TDM_CHECK(tdm_ddp_forward_impl(d, NULL, NULL, 0, 0.0f, 0, NULL));
    TDM_CHECK(tdm_ddp_backward(d));
    return opt ? tdm_ddp_step(d, opt) : TDM_STATUS_OK;
}

tdm_status tdm_ddp_join(tdm_ddp *d, tdm_optim *opt, int64_t *shadowed)
{
    tdm_dist_shadow s = {.who = "ddp", .label = "ddp join count", .enabled = d->o.join,
                         .sync = d->sync, .fwd = &d->fwd, .fn = tdm_ddp_shadow_step, .w = d,
                         .opt = opt};
    tdm_status st = tdm_dist_join_shadow(&d->join, d->hcomm, d->rank, d->world, &s, shadowed);
    if (st) (void)tdm_comm_abort(d->hcomm, tdm_error_message());
    return st;
}

/* ---- optimizer step ---- */

tdm_status tdm_ddp_grad_bufs(tdm_ddp *d, tdm_dist_grads *out)
{
    float *g = tdm_model_grads(d->m);
    TDM_REQUIRE(g, TDM_STATUS_INVALID_ARG, "ddp grads: the model's flat gradient buffer was "
                "released");
    *out = (tdm_dist_grads){.bufs = malloc(sizeof(float *)), .n_elem = malloc(sizeof(int64_t)),
                            .n_bufs = 1, .replicated = 1, .dev = d->dev, .comm = d->comm};
    if (!out->bufs || !out->n_elem) {
        tdm_dist_grads_free(out);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ddp grads: malloc");
    }
    out->bufs[0] = g;
    out->n_elem[0] = tdm_model_param_elems(d->m);
    return TDM_STATUS_OK;
}

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
    TDM_CHECK(tdm_dist_eval_begin(&d->fwd, "ddp", "tdm_ddp_evaluate", test, batch, loss_mean,
                                  accuracy));
    TDM_CHECK(tdm_dist_broadcast_buffers(d->comm, m, "ddp broadcast buffers (evaluate)",
                                         "ddp evaluate"));
    int64_t lo, hi;
    tdm_dist_share(test->n, d->rank, d->world, &lo, &hi);
    double sums[3] = {0.0, 0.0, (double)(hi - lo)}; /* loss sum, correct, samples */
    if (hi > lo) {
        tdm_dataset part = *test;
        part.n = hi - lo;
        part.x = test->x + lo * tdm_data_features(test);
        part.y = test->y + lo;
        double l = 0.0, a = 0.0;
        tdm_status st = tdm_evaluate_staged(m, &part, batch, &d->stage, &l, &a);
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
    return tdm_dist_eval_sums(d->hcomm, "ddp", "ddp evaluate sums", sums, loss_mean, accuracy);
}

tdm_status tdm_ddp_eval_loss(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                             double *loss_sum)
{
    tdm_model *m = d->m;
    TDM_REQUIRE(loss_sum && batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "ddp eval_loss: bad batch %d or NULL argument", batch);
    *loss_sum = 0.0;
    if (batch == 0) return TDM_STATUS_OK;
    tdm_dist_fwd_lose(&d->fwd, "tdm_ddp_eval_loss");
    const void *xd;
    const int32_t *yd;
    const float *logits;
    int was_train = tdm_model_is_train(m);
    tdm_model_set_train(m, 0);
    tdm_status st = tdm_train_stage_batch(&d->stage, m, x, y, batch, &xd, &yd);
    if (st == TDM_STATUS_OK) st = tdm_model_forward(m, xd, batch, &logits);
    if (st == TDM_STATUS_OK) st = tdm_model_loss(m, logits, yd, batch, 1.0f, loss_sum, NULL);
    tdm_model_set_train(m, was_train);
    return st;
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

TDM_DIST_OPS_DEFINE(ddp, tdm_ddp, tdm_ddp_checkpoint_save, tdm_ddp_checkpoint_load);
