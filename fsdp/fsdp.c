/* fsdp/fsdp.c: sharded data parallel's public calls: construction
 * (shards from rank 0's parameters, the model's flat buffers given up for
 * views), forward (buffers broadcast, a
 * rank without samples still taking part), backward (its end-of-step
 * check and loss sum), the optimizer step on the local shard, and timings
 * and memory. A unit's life inside a pass (gathers, reduce-scatters,
 * hooks) is fsdp/units.c; evaluation and the gathered full parameters
 * fsdp/eval.c; checkpoints fsdp/ckpt.c. Only core/comm.h talks to other
 * ranks. */
#include "fsdp/fsdp_impl.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "dist/check.h"

/* ---- names ---- */

const char *tdm_fsdp_sharding_name(tdm_fsdp_sharding s)
{
    static const char *const n[] = {"full", "grad_op", "optimizer"};
    return (unsigned)s < TDM_FSDP_SHARDING_COUNT_ ? n[s] : "?";
}

const char *tdm_fsdp_sharding_describe(tdm_fsdp_sharding s)
{
    static const char *const n[] = {
        "full (FSDP FULL_SHARD, ZeRO stage 3)", "grad_op (FSDP SHARD_GRAD_OP, ZeRO stage 2)",
        "optimizer (ZeroRedundancyOptimizer, ZeRO stage 1)"};
    return (unsigned)s < TDM_FSDP_SHARDING_COUNT_ ? n[s] : "?";
}

tdm_status tdm_fsdp_sharding_parse(const char *text, tdm_fsdp_sharding *out)
{
    static const struct {
        const char *name;
        tdm_fsdp_sharding s;
    } t[] = {{"full", TDM_FSDP_FULL_SHARD},          {"full_shard", TDM_FSDP_FULL_SHARD},
             {"zero3", TDM_FSDP_FULL_SHARD},         {"3", TDM_FSDP_FULL_SHARD},
             {"grad_op", TDM_FSDP_SHARD_GRAD_OP},    {"shard_grad_op", TDM_FSDP_SHARD_GRAD_OP},
             {"zero2", TDM_FSDP_SHARD_GRAD_OP},      {"2", TDM_FSDP_SHARD_GRAD_OP},
             {"optimizer", TDM_FSDP_SHARD_OPTIM},    {"zero1", TDM_FSDP_SHARD_OPTIM},
             {"1", TDM_FSDP_SHARD_OPTIM}};
    for (size_t i = 0; text && i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(text, t[i].name)) {
            *out = t[i].s;
            return TDM_STATUS_OK;
        }
    return tdm_error_set(TDM_STATUS_INVALID_ARG,
                         "unknown sharding '%s': expected full (FSDP FULL_SHARD, ZeRO-3; also "
                         "full_shard, zero3, 3), grad_op (SHARD_GRAD_OP, ZeRO-2; also "
                         "shard_grad_op, zero2, 2) or optimizer (ZeroRedundancyOptimizer, "
                         "ZeRO-1; also zero1, 1)", text ? text : "(null)");
}

/* ---- construction ---- */

/* A model built without flat buffers (tdm_model_init_released), offloaded:
 * rank 0 draws each unit's initial values from the model's seed into a
 * host block and scatters it over the host communicator straight into
 * the host shards. The device holds nothing of it at any time. */
static tdm_status tdm_fsdp_distribute_host(tdm_fsdp *f)
{
    tdm_model *m = f->m;
    float *blk = malloc((size_t)f->max_padded * sizeof(float));
    if (!blk)
        return tdm_fsdp_fail(f, tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                                              "fsdp: a host block of %lld floats to draw the "
                                              "units in", (long long)f->max_padded));
    tdm_status st = TDM_STATUS_OK;
    for (int u = 0; st == TDM_STATUS_OK && u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        if (f->rank == 0) {
            memset(blk, 0, (size_t)x->padded * sizeof(float));
            for (int i = x->first; i <= x->last; i++)
                tdm_model_init_param_host(m, tdm_model_seed(m), i,
                                          blk + (tdm_model_param_info(m, i)->offset - x->offset));
        }
        tdm_comm_set_label(f->hcomm, "%s scatter parameters unit %d", tdm_fsdp_tag(f), u);
        st = tdm_comm_scatter(f->hcomm, blk, f->buf.pshard + x->shard_off, (size_t)x->shard,
                              TDM_DTYPE_FLOAT32, 0);
    }
    free(blk);
    return st ? tdm_fsdp_fail(f, st) : TDM_STATUS_OK;
}

/* Every rank's shards (and full copies) from rank 0's parameters. */
static tdm_status tdm_fsdp_distribute(tdm_fsdp *f)
{
    tdm_model *m = f->m;
    tdm_device *d = f->dev;
    if (tdm_model_storage_released(m)) return tdm_fsdp_distribute_host(f);
    const float *src = tdm_model_params(m);
    /* A rank that cannot stage what it sends aborts the communicator: the
     * others are waiting in the collective it will not join, and must
     * learn it now, not at the communicator's timeout (tdm_fsdp_fail). */
    if (f->o.sharding != TDM_FSDP_FULL_SHARD) {
        for (int u = 0; u < f->nu; u++) {
            const tdm_fsdp_unit *x = &f->u[u];
            tdm_status cst = tdm_dev_copy(d, f->buf.pfull + x->full_off, src + x->offset,
                                          (size_t)x->n_elem * sizeof(float));
            if (cst) return tdm_fsdp_fail(f, cst);
        }
        tdm_comm_set_label(f->comm, "%s broadcast parameters", tdm_fsdp_tag(f));
        return tdm_comm_broadcast(f->comm, f->buf.pfull, f->buf.pfull, (size_t)f->full_elems,
                                  TDM_DTYPE_FLOAT32, 0);
    }
    tdm_status st = TDM_STATUS_OK;
    float *blk = NULL, *stage = NULL;
    size_t nb = 0, snb = 0;
    st = tdm_fsdp_pool_get(f, (size_t)f->max_padded * sizeof(float), 0, &blk, &nb);
    /* offload: each shard lands on the device, then goes down to the host */
    if (st == TDM_STATUS_OK && tdm_fsdp_offloaded(f))
        st = tdm_fsdp_pool_get(f, (size_t)(f->max_padded / f->world) * sizeof(float), 0, &stage,
                               &snb);
    if (st) {
        tdm_fsdp_pool_put(f, blk, nb);
        return tdm_fsdp_fail(f, st);
    }
    for (int u = 0; st == TDM_STATUS_OK && u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        if (f->rank == 0) {
            st = tdm_dev_copy(d, blk, src + x->offset, (size_t)x->n_elem * sizeof(float));
            if (st == TDM_STATUS_OK && x->padded > x->n_elem)
                st = tdm_dev_memset_zero(d, blk + x->n_elem,
                                         (size_t)(x->padded - x->n_elem) * sizeof(float));
        }
        if (st == TDM_STATUS_OK) {
            tdm_comm_set_label(f->comm, "%s scatter parameters unit %d", tdm_fsdp_tag(f), u);
            st = tdm_comm_scatter(f->comm, blk, stage ? stage : f->buf.pshard + x->shard_off,
                                  (size_t)x->shard, TDM_DTYPE_FLOAT32, 0);
        }
        if (st == TDM_STATUS_OK && stage)
            st = tdm_dev_copy_between(f->sdev, f->buf.pshard + x->shard_off, d, stage,
                                      (size_t)x->shard * sizeof(float));
    }
    tdm_fsdp_pool_put(f, stage, snb);
    tdm_fsdp_pool_put(f, blk, nb);
    tdm_fsdp_pool_trim(f);
    return st ? tdm_fsdp_fail(f, st) : TDM_STATUS_OK;
}

static tdm_status tdm_fsdp_alloc_state(tdm_fsdp *f)
{
    tdm_device *d = f->dev;
    size_t sb = (size_t)(f->shard_elems ? f->shard_elems : 1) * sizeof(float);
    size_t fb = (size_t)(f->full_elems ? f->full_elems : 1) * sizeof(float);
    switch (f->o.sharding) {
    case TDM_FSDP_FULL_SHARD:
        /* offload: on the host device, pinned for the model device's copies */
        TDM_CHECK(tdm_dev_alloc_zero(f->sdev, sb, (void **)&f->buf.pshard));
        TDM_CHECK(tdm_dev_alloc_zero(f->sdev, sb, (void **)&f->buf.gshard));
        if (tdm_fsdp_offloaded(f)) {
            tdm_status ps = tdm_dev_host_pin(d, f->buf.pshard, sb);
            if (ps == TDM_STATUS_OK) {
                f->buf.pinned = 1;
                ps = tdm_dev_host_pin(d, f->buf.gshard, sb);
                if (ps == TDM_STATUS_OK) f->buf.pinned = 2;
            }
            if (ps != TDM_STATUS_OK && ps != TDM_STATUS_UNSUPPORTED) return ps;
        }
        break;
    case TDM_FSDP_SHARD_GRAD_OP:
        TDM_CHECK(tdm_dev_alloc_zero(d, fb, (void **)&f->buf.pfull));
        TDM_CHECK(tdm_dev_alloc_zero(d, sb, (void **)&f->buf.gshard));
        break;
    default:
        TDM_CHECK(tdm_dev_alloc_zero(d, fb, (void **)&f->buf.pfull));
        TDM_CHECK(tdm_dev_alloc_zero(d, fb, (void **)&f->buf.gfull));
        break;
    }
    f->grad.zero = 1;
    return TDM_STATUS_OK;
}

/* Defined before tdm_fsdp_init, whose fail path runs it on any prefix of
 * what it made. */
void tdm_fsdp_free(tdm_fsdp *f)
{
    if (!f) return;
    tdm_model *m = f->m;
    /* A collective still running may write the unit blocks and the shards:
     * after a bounded wait, the communicator is aborted so that it ends;
     * one that does not even then keeps its memory (leaked, not freed
     * under the progress thread). */
    int aborted = 0, stuck = 0;
    for (int u = 0; f->u && u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        tdm_comm_work *w[2] = {x->ag, x->rs};
        for (int k = 0; k < 2; k++) {
            if (!w[k]) continue;
            if (tdm_comm_work_wait(w[k], TDM_DIST_DRAIN_TIMEOUT_MS) == TDM_STATUS_TIMEOUT &&
                !aborted) {
                aborted = 1;
                (void)tdm_comm_abort(f->comm, "fsdp free: a collective still running");
                if (f->hcomm != f->comm)
                    (void)tdm_comm_abort(f->hcomm, "fsdp free: a collective still running");
                (void)tdm_comm_work_wait(w[k], TDM_DIST_DRAIN_TIMEOUT_MS);
            }
            if (!tdm_fsdp_work_over(w[k])) stuck = 1;
        }
        tdm_comm_work_free(x->ag);
        tdm_comm_work_free(x->rs);
        x->ag = x->rs = NULL;
    }
    if (stuck) {
        TDM_WARN(FSDP, "free: a collective did not end after an abort: its memory is "
                       "leaked rather than freed while it may still be written");
        free(f->u);
        f->u = NULL;
        f->buf.pshard = f->buf.gshard = f->buf.pfull = f->buf.gfull = NULL;
        f->pool.n_cached = 0;
    }
    tdm_model_set_grad_hook(m, NULL, NULL);
    tdm_model_set_use_hook(m, NULL, NULL);
    (void)tdm_fsdp_drain(f, TDM_DEV_XFER_HOST);   /* copies down still reading blocks */
    if (tdm_fsdp_offloaded(f) && tdm_model_storage_released(m)) {
        /* offloaded: the model is not given the whole of itself on the
         * device (it may not fit: FULL_SHARD's would be zeros anyway);
         * its views into the pool's blocks go */
        for (int u = 0; f->u && u < f->nu; u++) {
            (void)tdm_model_set_param_view(m, f->u[u].first, f->u[u].last, NULL);
            (void)tdm_model_set_grad_view(m, f->u[u].first, f->u[u].last, NULL);
        }
    } else if (tdm_model_storage_released(m) && tdm_model_restore_storage(m) == TDM_STATUS_OK &&
               f->buf.pfull) {
        /* a full copy exists: the model gets it back */
        for (int u = 0; u < f->nu; u++)
            (void)tdm_dev_copy(f->dev, tdm_model_params(m) + f->u[u].offset,
                                    f->buf.pfull + f->u[u].full_off,
                                    (size_t)f->u[u].n_elem * sizeof(float));
    }
    for (int u = 0; f->u && u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        if (f->o.sharding == TDM_FSDP_FULL_SHARD) tdm_fsdp_pool_put(f, x->pbuf, x->pbuf_bytes);
        if (f->o.sharding != TDM_FSDP_SHARD_OPTIM) tdm_fsdp_pool_put(f, x->gbuf, x->gbuf_bytes);
        tdm_fsdp_pool_put(f, x->rs_tmp, x->rs_tmp_bytes);
        tdm_fsdp_hook_release(f, u);
    }
    tdm_fsdp_pool_trim(f);
    tdm_device *d = f->dev;
    if (f->buf.pinned > 0) tdm_dev_host_unpin(d, f->buf.pshard);
    if (f->buf.pinned > 1) tdm_dev_host_unpin(d, f->buf.gshard);
    if (f->sdev) {
        tdm_dev_free(f->sdev, f->buf.pshard);
        tdm_dev_free(f->sdev, f->buf.gshard);
        tdm_dev_free(f->sdev, f->buf.hstage);
    }
    tdm_dev_free(d, f->buf.pfull);
    tdm_dev_free(d, f->buf.gfull);
    tdm_dev_free(d, f->buf.gacc);
    tdm_train_stage_free(&f->stage);
    tdm_dev_free(d, f->buf_save);
    free(f->u);
    free(f->param_unit);
    free(f->pass.ready);
    free(f->pass.fwd.unit);
    free(f->pass.bwd.unit);
    free(f->timing.ev);
    free(f->timing.ev_out);
    tdm_device_free(f->hdev);
    free(f);
}

tdm_status tdm_fsdp_init(tdm_fsdp **out, tdm_model *m, tdm_comm *comm, const tdm_fsdp_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(out && m && comm, TDM_STATUS_INVALID_ARG, "tdm_fsdp_init: NULL argument");
    *out = NULL;
    TDM_REQUIRE(tdm_comm_size(comm) <= TDM_FSDP_MAX_RANKS, TDM_STATUS_INVALID_ARG,
                "fsdp: at most %d ranks (got %d)", TDM_FSDP_MAX_RANKS, tdm_comm_size(comm));
    TDM_REQUIRE(tdm_model_n_params(m) > 0, TDM_STATUS_INVALID_ARG,
                "fsdp: model has no parameters");
    int off = opts && opts->offload == TDM_FSDP_OFFLOAD_PARAMS &&
              opts->sharding == TDM_FSDP_FULL_SHARD;
    TDM_REQUIRE(!tdm_model_storage_released(m) || (off && !tdm_model_has_views(m)),
                TDM_STATUS_INVALID_ARG,
                "fsdp: the model's flat buffers were released: %s",
                off ? "its parameters are already sharded (a model built by "
                      "tdm_model_init_released has no views yet)"
                    : "its parameters are already sharded, or it was built by "
                      "tdm_model_init_released, which only parameter offload (FULL_SHARD) "
                      "can shard");
    TDM_REQUIRE(!opts || (unsigned)opts->sharding < TDM_FSDP_SHARDING_COUNT_,
                TDM_STATUS_INVALID_ARG,
                "fsdp: sharding %d is not one of TDM_FSDP_FULL_SHARD, TDM_FSDP_SHARD_GRAD_OP, "
                "TDM_FSDP_SHARD_OPTIM", opts ? (int)opts->sharding : 0);
    TDM_REQUIRE(!opts || opts->min_unit_elems >= 0, TDM_STATUS_INVALID_ARG,
                "fsdp: min_unit_elems %lld is negative (0: one unit per block)",
                opts ? (long long)opts->min_unit_elems : 0LL);
    TDM_CHECK(tdm_fsdp_hook_check(opts, m));
    if (opts && opts->offload != TDM_FSDP_OFFLOAD_NONE) {
        TDM_REQUIRE(opts->offload == TDM_FSDP_OFFLOAD_PARAMS, TDM_STATUS_INVALID_ARG,
                    "fsdp: unknown offload %d", (int)opts->offload);
        TDM_REQUIRE(opts->sharding == TDM_FSDP_FULL_SHARD, TDM_STATUS_INVALID_ARG,
                    "fsdp: parameter offload keeps FULL_SHARD's shards in host memory; %s keeps "
                    "full parameters on the device (offload its optimizer instead)",
                    tdm_fsdp_sharding_describe(opts->sharding));
        TDM_REQUIRE(tdm_dev_kind(tdm_model_device(m)) != TDM_DEVICE_HOST,
                    TDM_STATUS_INVALID_ARG,
                    "fsdp: parameter offload: %s's memory is host memory already; offload is "
                    "for accelerators (cuda)", tdm_dev_name(tdm_model_device(m)));
    }
    tdm_fsdp *f = calloc(1, sizeof *f);
    TDM_REQUIRE(f, TDM_STATUS_OUT_OF_MEMORY, "fsdp: calloc");
    f->m = m;
    f->comm = comm;
    f->dev = tdm_model_device(m);
    f->sdev = f->dev;
    f->stage.dev = f->dev;
    if (opts) f->o = *opts;
    f->hcomm = f->o.host_comm ? f->o.host_comm : comm;
    f->rank = tdm_comm_rank(comm);
    f->world = tdm_comm_size(comm);
    f->n_params = tdm_model_n_params(m);
    f->pass.sync = 1;
    tdm_dist_join_init(&f->join, f->world);
    if (f->hcomm != comm &&
        (tdm_comm_rank(f->hcomm) != f->rank || tdm_comm_size(f->hcomm) != f->world)) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                           "fsdp: host communicator is rank %d of %d but the communicator is "
                           "rank %d of %d", tdm_comm_rank(f->hcomm), tdm_comm_size(f->hcomm),
                           f->rank, f->world);
        free(f);
        return st;
    }
    if (tdm_fsdp_offloaded(f)) {
        TDM_TRY(tdm_device_open(&f->hdev, "cpu", 0, 1));
        f->sdev = f->hdev;
    }
    TDM_TRY(tdm_fsdp_plan(f));
    f->pass.fwd.unit = calloc((size_t)(2 * f->nu + 4), sizeof *f->pass.fwd.unit);
    f->pass.bwd.unit = calloc((size_t)(2 * f->nu + 4), sizeof *f->pass.bwd.unit);
    if (!f->pass.fwd.unit || !f->pass.bwd.unit) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: calloc");
        goto fail;
    }
    TDM_TRY(tdm_fsdp_verify(f));
    TDM_TRY(tdm_fsdp_alloc_state(f));
    TDM_TRY(tdm_fsdp_distribute(f));
    if (tdm_model_buffer_elems(m) > 0) {
        tdm_comm_set_label(comm, "%s broadcast buffers", tdm_fsdp_tag(f));
        TDM_TRY(tdm_comm_broadcast(comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                   (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0));
    }
    /* From here on the model reads its parameters through views. */
    TDM_TRY(tdm_model_release_storage(m));
    for (int u = 0; u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        if (f->o.sharding == TDM_FSDP_FULL_SHARD) continue;
        x->pbuf = f->buf.pfull + x->full_off;
        x->params = TDM_FSDP_PARAMS_PRESENT;
        TDM_TRY(tdm_model_set_param_view(m, x->first, x->last, x->pbuf));
        if (f->o.sharding == TDM_FSDP_SHARD_OPTIM)
            TDM_TRY(tdm_model_set_grad_view(m, x->first, x->last, f->buf.gfull + x->full_off));
    }
    tdm_model_set_grad_hook(m, tdm_fsdp_grad_hook, f);
    tdm_model_set_use_hook(m, tdm_fsdp_use_hook, f);
    TDM_INFO(FSDP, "rank %d of %d: %s, %d unit(s), %lld parameters, shard of %lld, "
             "prefetch %s, overlap %s%s", f->rank, f->world,
             tdm_fsdp_sharding_describe(f->o.sharding), f->nu,
             (long long)tdm_model_param_elems(m), (long long)f->shard_elems,
             f->o.no_prefetch ? "off" : "on", f->o.no_overlap ? "off" : "on",
             tdm_fsdp_offloaded(f) ? ", shards offloaded to host memory" : "");
    *out = f;
    return TDM_STATUS_OK;
fail:
    tdm_fsdp_free(f);
    return st;
}

tdm_model *tdm_fsdp_model(tdm_fsdp *f) { return f->m; }
tdm_comm *tdm_fsdp_comm(tdm_fsdp *f) { return f->comm; }
tdm_fsdp_sharding tdm_fsdp_get_sharding(const tdm_fsdp *f) { return f->o.sharding; }
int tdm_fsdp_n_units(const tdm_fsdp *f) { return f->nu; }
int64_t tdm_fsdp_shard_elems(const tdm_fsdp *f) { return f->shard_elems; }

void tdm_fsdp_unit_info(const tdm_fsdp *f, int u, int *first, int *last, int64_t *offset,
                        int64_t *n_elem, int64_t *shard)
{
    const tdm_fsdp_unit *x = &f->u[u];
    if (first) *first = x->first;
    if (last) *last = x->last;
    if (offset) *offset = x->offset;
    if (n_elem) *n_elem = x->n_elem;
    if (shard) *shard = x->shard;
}

tdm_status tdm_fsdp_optim_init(tdm_optim **out, tdm_fsdp *f, const tdm_optim_opts *opts)
{
    if (!tdm_fsdp_offloaded(f)) return tdm_optim_init_flat(out, f->dev, f->shard_elems, opts);
    /* the state beside the shards, stepped there: host memory */
    return tdm_optim_init_host(out, f->shard_elems, opts);
}

tdm_status tdm_fsdp_zero_grad(tdm_fsdp *f)
{
    tdm_device *d = f->dev;
    if (f->o.sharding == TDM_FSDP_SHARD_OPTIM) {
        TDM_CHECK(tdm_dev_memset_zero(d, f->buf.gfull, (size_t)f->full_elems * sizeof(float)));
        f->grad.stale = 0;
        f->grad.reduced = TDM_FSDP_REDUCED_NONE;   /* what was held aside is dropped too */
        return TDM_STATUS_OK;
    }
    /* accumulated full gradients (no_sync) are dropped with the shards */
    for (int u = 0; u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        if (!x->gbuf || x->rs) continue;
        (void)tdm_model_set_grad_view(f->m, x->first, x->last, NULL);
        tdm_fsdp_pool_put(f, x->gbuf, x->gbuf_bytes);
        x->gbuf = NULL;
    }
    TDM_CHECK(tdm_dev_memset_zero(f->sdev, f->buf.gshard,
                                  (size_t)f->shard_elems * sizeof(float)));
    f->grad.zero = 1;
    return TDM_STATUS_OK;
}

void tdm_fsdp_no_sync(tdm_fsdp *f, int enable) { f->pass.sync = !enable; }
double tdm_fsdp_loss_sum(const tdm_fsdp *f) { return f->check.loss_global; }

/* ---- forward ---- */

static void tdm_fsdp_step_start(tdm_fsdp *f, uint64_t now)
{
    if (f->timing.open) return;
    f->timing.open = 1;
    f->timing.t_step0 = now;
    memset(&f->timing.times.last, 0, sizeof f->timing.times.last);
    f->timing.ag_ready_at_use = 0;
    /* the new timeline keeps the collectives still in flight: moved to
     * its front in event order (so no kept entry is overwritten before
     * it moves) */
    int keep = 0;
    for (int i = 0; i < f->timing.n_ev; i++) {
        for (int u = 0; u < f->nu; u++) {
            tdm_fsdp_unit *x = &f->u[u];
            int *es[2] = {&x->ag_event, &x->rs_event};
            for (int k = 0; k < 2; k++) {
                if (*es[k] != i) continue;
                f->timing.ev[keep] = f->timing.ev[i];
                *es[k] = keep++;
            }
        }
    }
    f->timing.n_ev = keep;
}

static void tdm_fsdp_add_phase(tdm_fsdp *f, tdm_phase p, double ms)
{
    if (ms < 0) ms = 0;
    f->timing.times.last.ms[p] += ms;
    f->timing.times.total.ms[p] += ms;
}

tdm_status tdm_fsdp_broadcast_buffers(tdm_fsdp *f, const char *when)
{
    char label[64], what[32];
    snprintf(label, sizeof label, "%s broadcast buffers (%s)", tdm_fsdp_tag(f), when);
    snprintf(what, sizeof what, "fsdp %s", when);
    return tdm_dist_broadcast_buffers(f->comm, f->m, label, what);
}

/* The model's forward over B samples at xd; FULL_SHARD gathers through
 * the hooks. keep: leave the unit forward ended in gathered (backward
 * starts with it). */
tdm_status tdm_fsdp_run_forward(tdm_fsdp *f, const void *xd, int B, int keep,
                                const float **logits)
{
    tdm_fsdp_order_begin(&f->pass.fwd);
    f->pass.phase = TDM_FSDP_PHASE_FORWARD;
    tdm_status st = tdm_model_forward(f->m, xd, B, logits);
    f->pass.phase = TDM_FSDP_PHASE_IDLE;
    tdm_fsdp_order_end(&f->pass.fwd);
    if (st == TDM_STATUS_OK && !keep && f->o.sharding == TDM_FSDP_FULL_SHARD)
        st = tdm_fsdp_settle_params(f, 1);
    return st;
}

/* tdm_fsdp_run_forward as a dist/batch.h forward: a training forward
 * keeps the unit it ended in gathered for backward, another drops it. */
static tdm_status tdm_fsdp_forward_keep(void *ctx, const void *xd, int B, const float **logits)
{
    return tdm_fsdp_run_forward(ctx, xd, B, 1, logits);
}

static tdm_status tdm_fsdp_forward_drop(void *ctx, const void *xd, int B, const float **logits)
{
    return tdm_fsdp_run_forward(ctx, xd, B, 0, logits);
}

/* by_active: the scale is 1/(batch * the ranks with data) (opts.join) */
static tdm_status tdm_fsdp_forward_impl(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                                        float grad_scale, int by_active, double *loss_sum)
{
    TDM_REQUIRE(batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "fsdp forward: bad batch %d or NULL input", batch);
    TDM_REQUIRE(!f->join.joined || batch == 0, TDM_STATUS_INVALID_ARG,
                "fsdp forward: this rank has joined (tdm_fsdp_join): it has no data left");
    if (f->o.join) {
        tdm_status js = tdm_fsdp_join_forward(f, tdm_model_is_train(f->m), batch, by_active,
                                              &grad_scale);
        if (js) return tdm_fsdp_fail(f, js);
    }
    tdm_model *m = f->m;
    tdm_device *d = f->dev;
    uint64_t t0 = tdm_time_ns();
    tdm_fsdp_step_start(f, t0);
    tdm_dist_fwd_begin(&f->fwd);
    f->pass.ag_wait_ms = 0.0;
    f->pass.copy_ms = 0.0;
    int train = tdm_model_is_train(m);
    int full = f->o.sharding == TDM_FSDP_FULL_SHARD;
    tdm_status st = TDM_STATUS_OK;
    /* a unit kept from a forward nobody went back through goes first */
    if (full) st = tdm_fsdp_settle_params(f, 1);
    if (st == TDM_STATUS_OK && train && !f->o.no_broadcast_buffers)
        st = tdm_fsdp_broadcast_buffers(f, "forward");
    if (st) return tdm_fsdp_fail(f, st);
    int run = batch > 0 || full, B = batch > 0 ? batch : 1;
    double ls = 0.0;
    uint64_t t1 = tdm_time_ns();
    if (run) {
        const void *xd;
        const int32_t *yd;
        int64_t be = tdm_model_buffer_elems(m);
        int dummy = batch == 0, save = dummy && train && be > 0;
        if (dummy) {
            st = tdm_train_stage_dummy(&f->stage, m, &xd, &yd);
            if (st == TDM_STATUS_OK && save && !f->buf_save)
                st = tdm_dev_alloc(d, (size_t)be * sizeof(float), (void **)&f->buf_save);
            /* batchnorm would learn running statistics from the zero sample */
            if (st == TDM_STATUS_OK && save)
                st = tdm_dev_copy(d, f->buf_save, tdm_model_buffers(m), (size_t)be * sizeof(float));
        } else {
            st = tdm_train_stage_batch(&f->stage, m, x, y, batch, &xd, &yd);
        }
        /* the zero sample takes part with a zero loss gradient */
        tdm_dist_forward_fn fwd = train ? tdm_fsdp_forward_keep : tdm_fsdp_forward_drop;
        if (st == TDM_STATUS_OK)
            st = tdm_dist_forward_loss(&f->stage, m, fwd, f, xd, yd, B,
                                       dummy ? 0.0f : grad_scale, &ls, &t1);
        if (st == TDM_STATUS_OK && save)
            st = tdm_dev_copy(d, tdm_model_buffers(m), f->buf_save, (size_t)be * sizeof(float));
        if (dummy) ls = 0.0;
        /* the other ranks wait in this step's collectives: stop them */
        if (st) return tdm_fsdp_fail(f, tdm_error_prefix(st, "fsdp forward (rank %d)", f->rank));
    }
    uint64_t t2 = tdm_time_ns();
    f->pass.ran = run;
    tdm_dist_fwd_done(&f->fwd, batch, ls, train);
    tdm_fsdp_add_phase(f, TDM_PHASE_FORWARD,
                       (double)(t1 - t0) * 1e-6 - f->pass.ag_wait_ms - f->pass.copy_ms);
    tdm_fsdp_add_phase(f, TDM_PHASE_HOST_COPY, f->pass.copy_ms);
    tdm_fsdp_add_phase(f, TDM_PHASE_ALLGATHER_WAIT, f->pass.ag_wait_ms);
    tdm_fsdp_add_phase(f, TDM_PHASE_LOSS, (double)(t2 - t1) * 1e-6);
    f->timing.times.ag_ready_at_use = f->timing.ag_ready_at_use;
    if (loss_sum) *loss_sum = ls;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_forward_scaled(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                                   float grad_scale, double *loss_sum)
{
    return tdm_fsdp_forward_impl(f, x, y, batch, grad_scale, 0, loss_sum);
}

tdm_status tdm_fsdp_forward(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                            double *loss_mean)
{
    double ls = 0.0;
    float scale = batch > 0 ? 1.0f / ((float)batch * (float)f->world) : 0.0f;
    TDM_CHECK(tdm_fsdp_forward_impl(f, x, y, batch, scale, f->o.join, &ls));
    if (loss_mean) *loss_mean = batch > 0 ? ls / batch : 0.0;
    return TDM_STATUS_OK;
}

/* ---- backward ---- */

/* After the reduce-scatters: every rank's forward count and loss sum, in
 * its own slots (zeros elsewhere, so the SUM is exact). A rank that ran
 * another number of steps is named at the end of the same backward. */
static tdm_status tdm_fsdp_check_tail(tdm_fsdp *f)
{
    int W = f->world;
    memset(f->check.tail, 0, sizeof f->check.tail);
    f->check.tail[f->rank] = (double)f->fwd.count;
    f->check.tail[TDM_FSDP_MAX_RANKS + f->rank] = f->check.loss_accum;
    f->check.loss_accum = 0.0;
    tdm_comm_set_label(f->hcomm, "%s end-of-backward check", tdm_fsdp_tag(f));
    tdm_status st = tdm_comm_all_reduce(f->hcomm, f->check.tail, f->check.tail,
                                        2 * TDM_FSDP_MAX_RANKS,
                                        TDM_DTYPE_FLOAT64, TDM_REDOP_SUM);
    if (st) return tdm_error_prefix(st, "fsdp: step %" PRIu64 ": the end-of-backward check",
                                    f->check.count);
    TDM_CHECK(tdm_dist_check_seq("fsdp", f->check.tail, W, f->rank, (double)f->fwd.count));
    double loss = 0.0;
    for (int r = 0; r < W; r++) loss += f->check.tail[TDM_FSDP_MAX_RANKS + r];
    f->check.loss_global = loss;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_backward(tdm_fsdp *f)
{
    double fwd_loss;
    TDM_CHECK(tdm_dist_fwd_take(&f->fwd, "fsdp", &fwd_loss));
    f->check.loss_accum += fwd_loss;
    uint64_t t0 = tdm_time_ns();
    f->pass.ag_wait_ms = 0.0;
    f->pass.rs_wait_ms = 0.0;
    f->pass.copy_ms = 0.0;
    /* a backward without zero_grad since the last reduce-scatter (no_sync
     * accumulation onto reduced gradients) adds onto zeros outside the
     * owned slices, as it would after the clearing zero_grad skips */
    tdm_status st = tdm_fsdp_clear_stale(f);
    /* with a hook, ZeRO-1 rounds only the new gradients to 16 bits */
    if (st == TDM_STATUS_OK) st = tdm_fsdp_hold_reduced(f);
    if (st) return tdm_fsdp_fail(f, st);
    tdm_fsdp_backward_begin(f);
    if (f->pass.ran) {
        f->pass.phase = TDM_FSDP_PHASE_BACKWARD;
        st = tdm_model_backward(f->m, f->stage.dlogits);
        f->pass.phase = TDM_FSDP_PHASE_IDLE;
        if (st) return tdm_fsdp_fail(f, st);
    }
    uint64_t t1 = tdm_time_ns();
    /* waits inside backward (a gather not yet complete; a reduce-scatter
     * finished early to bound the full gradients alive) are
     * communication, not compute */
    double bwd_ag = f->pass.ag_wait_ms, bwd_rs = f->pass.rs_wait_ms, bwd_cp = f->pass.copy_ms;
    st = tdm_fsdp_backward_end(f);
    if (st == TDM_STATUS_OK && f->pass.sync) st = tdm_fsdp_check_tail(f);
    if (st) return tdm_fsdp_fail(f, st);
    uint64_t t2 = tdm_time_ns();
    tdm_fsdp_add_phase(f, TDM_PHASE_BACKWARD,
                       (double)(t1 - t0) * 1e-6 - bwd_ag - bwd_rs - bwd_cp);
    tdm_fsdp_add_phase(f, TDM_PHASE_ALLGATHER_WAIT, f->pass.ag_wait_ms);
    tdm_fsdp_add_phase(f, TDM_PHASE_REDUCE_SCATTER_WAIT,
                       (double)(t2 - t1) * 1e-6 - (f->pass.ag_wait_ms - bwd_ag) + bwd_rs -
                           (f->pass.copy_ms - bwd_cp));
    tdm_fsdp_add_phase(f, TDM_PHASE_HOST_COPY, f->pass.copy_ms);
    if (f->pass.sync) {
        f->check.stepped = 0;
        f->check.count++;
        f->timing.times.steps++;
        f->timing.times.rs_done_in_backward = f->timing.rs_done_in_bwd;
    }
    return TDM_STATUS_OK;
}

/* ---- the optimizer step ---- */

tdm_status tdm_fsdp_grad_bufs(tdm_fsdp *f, tdm_dist_grads *out)
{
    int n = f->nu > 0 ? f->nu : 1;
    *out = (tdm_dist_grads){.bufs = calloc((size_t)n, sizeof(float *)),
                            .n_elem = calloc((size_t)n, sizeof(int64_t)), .n_bufs = f->nu,
                            .replicated = 0, .dev = f->sdev,
                            /* host shards: their scalars reduced in host memory */
                            .comm = tdm_fsdp_offloaded(f) ? f->hcomm : f->comm};
    if (!out->bufs || !out->n_elem) {
        tdm_dist_grads_free(out);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp grads: %d units", f->nu);
    }
    for (int u = 0; u < f->nu; u++) {
        out->bufs[u] = tdm_fsdp_gshard(f, u);
        out->n_elem[u] = f->u[u].shard;
    }
    return TDM_STATUS_OK;
}

/* A step completed: counted, and told to the communicators, whose flight
 * recorders keep it with every later call and in their dumps ("last
 * completed step", docs/DEBUGGING.md), as DDP's step does. */
static void tdm_fsdp_step_done(tdm_fsdp *f)
{
    f->timing.steps++;
    tdm_comm_set_step(f->comm, f->timing.steps);
    if (f->hcomm != f->comm) tdm_comm_set_step(f->hcomm, f->timing.steps);
    f->timing.open = 0;
}

tdm_status tdm_fsdp_step(tdm_fsdp *f, tdm_optim *opt)
{
    TDM_REQUIRE(opt && tdm_optim_n_elem(opt) == f->shard_elems, TDM_STATUS_INVALID_ARG,
                "fsdp step: the optimizer covers %lld elements, this rank's shard %lld: make it "
                "with tdm_fsdp_optim_init", opt ? (long long)tdm_optim_n_elem(opt) : -1LL,
                (long long)f->shard_elems);
    /* the ranges' pointers are f->sdev's memory: the optimizer must read
     * them there (a host optimizer given device shards, or a ZeRO-Offload
     * one that copies host shards as if on the device, runs on the
     * emulator, where both are host memory, and fails on a GPU) */
    tdm_device *pd = tdm_optim_param_device(opt);
    TDM_REQUIRE(pd == f->sdev ||
                    (tdm_dev_kind(pd) == TDM_DEVICE_HOST &&
                     tdm_dev_kind(f->sdev) == TDM_DEVICE_HOST),
                TDM_STATUS_INVALID_ARG,
                "fsdp step: the shards are in %s's memory but the optimizer reads its "
                "parameters on %s: make it with tdm_fsdp_optim_init", tdm_dev_name(f->sdev),
                tdm_dev_name(pd));
    uint64_t t0 = tdm_time_ns();
    tdm_fsdp_step_start(f, t0);
    tdm_optim_range *r = calloc((size_t)f->nu, sizeof *r);
    TDM_REQUIRE(r, TDM_STATUS_OUT_OF_MEMORY, "fsdp step: calloc");
    for (int u = 0; u < f->nu; u++)
        r[u] = (tdm_optim_range){.param = tdm_fsdp_pshard(f, u), .grad = tdm_fsdp_gshard(f, u),
                                 .state_offset = f->u[u].shard_off, .n_elem = f->u[u].shard};
    tdm_status st = TDM_STATUS_OK;
    if (f->o.sharding == TDM_FSDP_FULL_SHARD) {
        st = tdm_optim_step_ranges(opt, r, f->nu);
        if (st == TDM_STATUS_OK) st = tdm_dev_sync(f->dev);
        free(r);
        TDM_CHECK(st);
        tdm_fsdp_add_phase(f, TDM_PHASE_STEP, tdm_time_ms_since(t0));
        tdm_fsdp_step_done(f);
        return TDM_STATUS_OK;
    }
    /* A joined rank shadows one step, with its all-gathers, per backward
     * of the others (fsdp/join.c): a second step's gathers would meet its
     * join count instead. Every rank still training saw the same count at
     * the forward, so all refuse alike; the abort ends the joined rank's
     * wait too. */
    if (f->check.stepped && f->join.n_active < f->world) {
        free(r);
        return tdm_fsdp_fail(f, tdm_error_set(
            TDM_STATUS_INVALID_ARG, "fsdp step: a second step without a backward while %d of "
            "%d ranks have joined (tdm_fsdp_join): the joined ranks shadow one step per "
            "backward; step once per backward under join", f->world - f->join.n_active, f->world));
    }
    f->check.stepped = 1;
    /* grad_op, optimizer: every rank's new shard into every rank's full
     * copy, each unit awaited where it is next used (its forward). A
     * unit's all-gather goes out as soon as its shard is stepped, in unit
     * order (the forward's): the first unit's gather, which the next
     * forward waits for at once, then travels while the later units'
     * shards are stepped instead of after all of them. The step count
     * goes back before each unit so that the step is counted once and
     * every unit sees the same step number (AdamW's bias correction, the
     * schedule): each element gets what one call over all ranges gives it. */
    int64_t steps0 = tdm_optim_steps(opt);
    double issue_ms = 0.0, wait0 = f->pass.ag_wait_ms;
    for (int u = 0; st == TDM_STATUS_OK && u < f->nu; u++) {
        /* A step with no backward since the last one (PyTorch allows it:
         * the same gradients are applied again) finds the unit's gather
         * from that step still in flight: it reads this rank's slice and
         * writes the others', so it ends before the slice is stepped
         * again and gathered anew. After a backward it has ended. */
        int comm_failed = 0;
        if (f->u[u].params == TDM_FSDP_PARAMS_GATHERING && (st = tdm_fsdp_need_params(f, u, 0)))
            comm_failed = 1;
        if (st == TDM_STATUS_OK) {
            tdm_optim_set_steps(opt, steps0);
            st = tdm_optim_step_ranges(opt, &r[u], 1);
        }
        if (st == TDM_STATUS_OK) st = tdm_dev_sync(f->dev);
        if (st == TDM_STATUS_OK) {
            uint64_t ti = tdm_time_ns();
            f->u[u].params = TDM_FSDP_PARAMS_ABSENT;
            st = tdm_fsdp_issue_gather(f, u, 1);
            issue_ms += tdm_time_ms_since(ti);
            comm_failed = st != TDM_STATUS_OK;
        }
        if (comm_failed) {
            free(r);
            return tdm_fsdp_fail(f, st);
        }
    }
    free(r);
    TDM_CHECK(st);
    double wait_ms = f->pass.ag_wait_ms - wait0;
    tdm_fsdp_add_phase(f, TDM_PHASE_STEP, tdm_time_ms_since(t0) - issue_ms - wait_ms);
    tdm_fsdp_add_phase(f, TDM_PHASE_ALLGATHER_WAIT, wait_ms);
    tdm_fsdp_step_done(f);
    return TDM_STATUS_OK;
}

/* ---- timings and memory ---- */

void tdm_fsdp_get_times(const tdm_fsdp *fc, tdm_fsdp_times *out)
{
    tdm_fsdp *f = (tdm_fsdp *)fc;   /* the event copy is a cache */
    *out = f->timing.times;
    out->n_events = 0;
    out->events = NULL;
    tdm_fsdp_event *e =
        realloc(f->timing.ev_out, (size_t)(f->timing.n_ev ? f->timing.n_ev : 1) * sizeof *e);
    if (!e) return;
    f->timing.ev_out = e;
    double t0 = (double)f->timing.t_step0;
    for (int i = 0; i < f->timing.n_ev; i++) {
        const tdm_fsdp_ev *s = &f->timing.ev[i];
        e[i] = (tdm_fsdp_event){.kind = s->kind, .unit = s->unit, .prefetch = s->prefetch,
                                .start_ms = ((double)s->start_ns - t0) * 1e-6,
                                .end_ms = s->end_ns ? ((double)s->end_ns - t0) * 1e-6 : -1.0,
                                .wait_ms = s->wait_ms, .bytes = s->bytes};
    }
    out->n_events = f->timing.n_ev;
    out->events = e;
}

void tdm_fsdp_get_memory(const tdm_fsdp *f, const tdm_optim *opt, tdm_fsdp_memory *out)
{
    memset(out, 0, sizeof *out);
    size_t sb = (size_t)(f->shard_elems ? f->shard_elems : 1) * sizeof(float);
    size_t fb = (size_t)(f->full_elems ? f->full_elems : 1) * sizeof(float);
    if (f->buf.pshard) out->shard_params = sb;
    if (f->buf.gshard) out->shard_grads = sb;
    if (f->buf.pfull) out->full_params = fb;
    if (f->buf.gfull) out->full_grads = fb;
    out->optim_state = opt ? tdm_optim_state_bytes(opt) : 0;
    out->units_live = f->pool.live;
    out->units_peak = f->pool.peak;
    out->max_unit_bytes = (size_t)f->max_padded * sizeof(float);
    out->offload = f->o.offload;
}

void tdm_fsdp_reset_peak(tdm_fsdp *f) { f->pool.peak = f->pool.live; }

static tdm_status tdm_fsdp_ops_local_grads(void *w, float *host)
{
    return tdm_fsdp_local_grads((tdm_fsdp *)w, host);
}
static tdm_status tdm_fsdp_ops_set_grads(void *w, const float *host)
{
    return tdm_fsdp_set_grads((tdm_fsdp *)w, host);
}
TDM_DIST_OPS_DEFINE_WITH(fsdp, tdm_fsdp, tdm_fsdp_save_full, tdm_fsdp_load,
                         .local_grads = tdm_fsdp_ops_local_grads,
                         .set_grads = tdm_fsdp_ops_set_grads);
