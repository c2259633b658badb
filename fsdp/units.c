/* fsdp/units.c: a unit's life during a step: the pool its full buffers
 * come from, its all-gathers (on use, or prefetched one unit ahead in the
 * order the first pass recorded), the reduce-scatters launched in unit
 * order as backward finishes units, the waits at the end of backward, and
 * the model's two hooks that drive all of it. Not here: construction,
 * the optimizer step and the public calls (fsdp/fsdp.c), checkpoints
 * (fsdp/ckpt.c). Only core/comm.h talks to other ranks. */
#include "fsdp/fsdp_impl.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"

/* ---- the pool of unit buffers ----
 * Gathered parameters and full gradients are blocks from the device's
 * allocator, so that what they cost is what the allocator counts. A block
 * given back is kept for the next request it can serve (best fit): a
 * cudaFree would synchronise the whole GPU in the middle of the step. A
 * request no kept block fits first gives every kept block back, so the
 * blocks alive at once are never more than the units alive at once; the
 * pool is emptied at the end of every backward, and between steps only
 * the shards remain. */

static void tdm_fsdp_pool_note(tdm_fsdp *f)
{
    if (f->pool.live > f->pool.peak) f->pool.peak = f->pool.live;
}

void tdm_fsdp_pool_trim(tdm_fsdp *f)
{
    for (int i = 0; i < f->pool.n_cached; i++) {
        tdm_dev_free(f->dev, f->pool.cache[i].p);
        f->pool.live -= f->pool.cache[i].nbytes;
    }
    f->pool.n_cached = 0;
}

tdm_status tdm_fsdp_pool_get(tdm_fsdp *f, size_t nbytes, int zero, float **out, size_t *got)
{
    /* offload: a block a copy down still reads comes back first, after
     * the device's later work has been ordered behind the copy; the pool
     * then decides as if it had been given back when its reduce-scatter
     * ended (the plan's replay) */
    TDM_CHECK(tdm_fsdp_drain(f, TDM_DEV_XFER_DEVICE));
    int best = -1;
    for (int i = 0; i < f->pool.n_cached; i++)
        if (f->pool.cache[i].nbytes >= nbytes &&
            (best < 0 || f->pool.cache[i].nbytes < f->pool.cache[best].nbytes))
            best = i;
    void *p = NULL;
    size_t sz = nbytes;
    if (best >= 0) {
        p = f->pool.cache[best].p;
        sz = f->pool.cache[best].nbytes;
        f->pool.cache[best] = f->pool.cache[--f->pool.n_cached];
    } else {
        tdm_fsdp_pool_trim(f);
        TDM_CHECK(tdm_dev_alloc(f->dev, nbytes, &p));
        f->pool.live += sz;
        tdm_fsdp_pool_note(f);
    }
    if (zero) {
        tdm_status st = tdm_dev_memset_zero(f->dev, p, nbytes);
        if (st) {
            tdm_fsdp_pool_put(f, p, sz);
            return st;
        }
    }
    *out = p;
    *got = sz;
    return TDM_STATUS_OK;
}

void tdm_fsdp_pool_put(tdm_fsdp *f, float *p, size_t nbytes)
{
    if (!p) return;
    if (f->pool.n_cached < TDM_FSDP_POOL_CACHE) {
        f->pool.cache[f->pool.n_cached++] = (tdm_fsdp_block){p, nbytes};
        return;
    }
    tdm_dev_free(f->dev, p);
    f->pool.live -= nbytes;
}

/* ---- events and waits ---- */

int tdm_fsdp_new_event(tdm_fsdp *f, int kind, int unit, int prefetch, double bytes)
{
    if (f->timing.n_ev == f->timing.cap_ev) {
        int cap = f->timing.cap_ev ? 2 * f->timing.cap_ev : 64;
        tdm_fsdp_ev *e = realloc(f->timing.ev, (size_t)cap * sizeof *e);
        if (!e) return -1;   /* the timeline loses an entry; the step goes on */
        f->timing.ev = e;
        f->timing.cap_ev = cap;
    }
    f->timing.ev[f->timing.n_ev] = (tdm_fsdp_ev){.kind = kind, .unit = unit, .prefetch = prefetch,
                                   .start_ns = tdm_time_ns(), .bytes = bytes};
    return f->timing.n_ev++;
}

static void tdm_fsdp_event_end(tdm_fsdp *f, int e, double wait_ms)
{
    if (e < 0 || e >= f->timing.n_ev) return;
    if (!f->timing.ev[e].end_ns) f->timing.ev[e].end_ns = tdm_time_ns();
    f->timing.ev[e].wait_ms += wait_ms;
}

tdm_status tdm_fsdp_wait(tdm_fsdp *f, tdm_comm_work *w, double *ms)
{
    uint64_t t0 = tdm_time_ns();
    /* Completion often comes within microseconds: poll, yielding the core
     * to the progress thread, before sleeping on it. */
    uint64_t spin_end = t0 + 200000;
    int done = 0;
    while (tdm_comm_work_test(w, &done) == TDM_STATUS_OK && !done && tdm_time_ns() < spin_end)
        sched_yield();
    tdm_status st = tdm_comm_work_wait(w, f->o.timeout_ms > 0 ? f->o.timeout_ms : -1);
    *ms = tdm_time_ms_since(t0);
    return st;
}

static const char *tdm_fsdp_unit_desc(const tdm_fsdp *f, int u, char *buf, size_t n);

/* Waits for unit u's collective w (what: "all_gather"), ending its event
 * and adding the wait's ms to *acc (may be NULL). On failure the message
 * names the step and the unit, and the status is returned with *running
 * set when w still runs (it timed out): its handle, and the blocks it
 * reads and writes, must then stay until tdm_fsdp_fail or tdm_fsdp_free
 * has aborted the communicator and seen it end. */
static tdm_status tdm_fsdp_wait_unit(tdm_fsdp *f, int u, tdm_comm_work *w, int ev, double *acc,
                                     const char *what, int *running)
{
    double ms = 0.0;
    tdm_status st = tdm_fsdp_wait(f, w, &ms);
    tdm_fsdp_event_end(f, ev, ms);
    if (acc) *acc += ms;
    *running = 0;
    if (st == TDM_STATUS_OK) return st;
    char d[256];
    tdm_error_prefix(st, "fsdp: step %" PRIu64 ": %s of %s", f->check.count, what,
                     tdm_fsdp_unit_desc(f, u, d, sizeof d));
    *running = !tdm_fsdp_work_over(w);
    return st;
}

/* A unit's all-gather has ended: its handle goes. */
static void tdm_fsdp_gather_done(tdm_fsdp_unit *x)
{
    tdm_comm_work_free(x->ag);
    x->ag = NULL;
    x->ag_event = -1;
}

/* After a failed wait: 1 when the work has ended (its buffers are nobody's
 * any more, the handle may go), 0 when it is still running (a timeout):
 * the progress thread may still write its buffers, so the handle stays on
 * the unit and the buffers with it until tdm_fsdp_fail or tdm_fsdp_free
 * has aborted the communicator and seen the work end. */
int tdm_fsdp_work_over(tdm_comm_work *w)
{
    int done = 0;
    return !w || (tdm_comm_work_test(w, &done) == TDM_STATUS_OK && done);
}

static tdm_status tdm_fsdp_finish_rs(tdm_fsdp *f, int u);
static void tdm_fsdp_hook_fail(tdm_fsdp *f, tdm_status st);

/* Notes completions without blocking (the timeline's end times), and
 * during backward finishes the reduce-scatters that are done, so that a
 * unit's full gradient goes back to the pool while backward goes on. */
static void tdm_fsdp_poll(tdm_fsdp *f)
{
    for (int u = 0; u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        int done = 0;
        if (x->ag && x->ag_event >= 0 && !f->timing.ev[x->ag_event].end_ns &&
            tdm_comm_work_test(x->ag, &done) == TDM_STATUS_OK && done)
            tdm_fsdp_event_end(f, x->ag_event, 0.0);
        done = 0;
        if (x->rs && tdm_comm_work_test(x->rs, &done) == TDM_STATUS_OK && done) {
            tdm_fsdp_event_end(f, x->rs_event, 0.0);
            if (f->pass.phase == TDM_FSDP_PHASE_BACKWARD) {
                f->timing.rs_done_in_bwd++;
                tdm_status st = tdm_fsdp_finish_rs(f, u);
                if (st) tdm_fsdp_hook_fail(f, st);
            }
        }
    }
}

/* The reduce-scatters in flight, and the oldest of them (the highest
 * unit: they are launched from the last unit down). */
static int tdm_fsdp_rs_in_flight(const tdm_fsdp *f, int *oldest)
{
    int n = 0;
    *oldest = -1;
    for (int u = f->nu - 1; u >= 0; u--)
        if (f->u[u].rs) {
            if (*oldest < 0) *oldest = u;
            n++;
        }
    return n;
}

static const char *tdm_fsdp_unit_desc(const tdm_fsdp *f, int u, char *buf, size_t n)
{
    const tdm_fsdp_unit *x = &f->u[u];
    snprintf(buf, n, "unit %d (%lld elements, parameters %d..%d, '%s'..'%s')", u,
             (long long)x->n_elem, x->first, x->last, tdm_model_param_info(f->m, x->first)->name,
             tdm_model_param_info(f->m, x->last)->name);
    return buf;
}

/* ---- all-gathers ---- */

tdm_status tdm_fsdp_drain(tdm_fsdp *f, tdm_dev_xfer_until until)
{
    tdm_status first = TDM_STATUS_OK;
    char msg[512] = "";
    for (int u = 0; f->u && u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        if (!x->down && !x->dbuf) continue;
        uint64_t t0 = tdm_time_ns();
        tdm_status st = tdm_dev_xfer_finish(x->down, until);
        f->pass.copy_ms += tdm_time_ms_since(t0);
        x->down = NULL;
        tdm_fsdp_pool_put(f, x->dbuf, x->dbuf_bytes);
        x->dbuf = NULL;
        if (st && !first) {
            first = st;
            snprintf(msg, sizeof msg, "%s", tdm_error_message());
        }
    }
    if (first) tdm_error_set(first, "fsdp: the copy of a gradient slice to host memory: %s", msg);
    return first;
}

tdm_status tdm_fsdp_issue_gather(tdm_fsdp *f, int u, int prefetch)
{
    tdm_fsdp_unit *x = &f->u[u];
    if (x->params != TDM_FSDP_PARAMS_ABSENT) return TDM_STATUS_OK;
    float *recv, *send;
    if (f->o.sharding == TDM_FSDP_FULL_SHARD) {
        TDM_CHECK(tdm_fsdp_pool_get(f, (size_t)x->padded * sizeof(float), 0, &x->pbuf,
                                    &x->pbuf_bytes));
        recv = x->pbuf;
        send = f->buf.pshard + x->shard_off;
        if (tdm_fsdp_offloaded(f)) {
            /* the host shard up into its slice of the block, on the
             * device's copy stream, gathered in place: the all-gather is
             * ordered after the copy (a GPU: every collective joins the
             * copy stream), the compute stream does not wait for it */
            send = recv + (int64_t)f->rank * x->shard;
            uint64_t tc = tdm_time_ns();
            tdm_dev_xfer *up = NULL;
            tdm_status cst = tdm_dev_copy_async(f->dev, TDM_DEV_XFER_TO_DEVICE, send,
                                                f->buf.pshard + x->shard_off,
                                                (size_t)x->shard * sizeof(float), &up);
            if (cst == TDM_STATUS_OK) cst = tdm_dev_xfer_finish(up, TDM_DEV_XFER_COMM);
            f->pass.copy_ms += tdm_time_ms_since(tc);
            if (cst) {
                tdm_fsdp_pool_put(f, x->pbuf, x->pbuf_bytes);
                x->pbuf = NULL;
                return cst;
            }
        }
    } else {
        /* in place: this rank's shard is its slice of the full copy */
        recv = f->buf.pfull + x->full_off;
        send = recv + (int64_t)f->rank * x->shard;
    }
    tdm_comm_set_label(f->comm, "%s all_gather unit %d", tdm_fsdp_tag(f), u);
    tdm_status st = tdm_comm_all_gather_async(f->comm, send, recv, (size_t)x->shard,
                                              TDM_DTYPE_FLOAT32, &x->ag);
    if (st) {
        tdm_fsdp_unlabel(f);
        if (f->o.sharding == TDM_FSDP_FULL_SHARD) {
            tdm_fsdp_pool_put(f, x->pbuf, x->pbuf_bytes);
            x->pbuf = NULL;
        }
        char d[256];
        return tdm_error_prefix(st, "fsdp: all_gather of %s",
                                tdm_fsdp_unit_desc(f, u, d, sizeof d));
    }
    x->params = TDM_FSDP_PARAMS_GATHERING;
    double bytes = (double)x->padded * sizeof(float);
    x->ag_event = tdm_fsdp_new_event(f, 0, u, prefetch, bytes);
    f->timing.times.ag_bytes_total += bytes;
    if (prefetch) f->timing.times.ag_prefetched_bytes_total += bytes;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_need_params(tdm_fsdp *f, int u, int prefetch_ok)
{
    tdm_fsdp_unit *x = &f->u[u];
    (void)prefetch_ok;
    if (x->params == TDM_FSDP_PARAMS_PRESENT) return TDM_STATUS_OK;
    if (x->params == TDM_FSDP_PARAMS_ABSENT) TDM_CHECK(tdm_fsdp_issue_gather(f, u, 0));
    int done = 0;
    if (tdm_comm_work_test(x->ag, &done) == TDM_STATUS_OK && done && x->ag_event >= 0 &&
        f->timing.ev[x->ag_event].prefetch)
        f->timing.ag_ready_at_use++;
    int running;
    tdm_status st = tdm_fsdp_wait_unit(f, u, x->ag, x->ag_event, &f->pass.ag_wait_ms,
                                       "all_gather", &running);
    if (running) return st;   /* gather, block and params GATHERING stay */
    tdm_fsdp_gather_done(x);
    if (st) {
        x->params = TDM_FSDP_PARAMS_ABSENT;
        if (f->o.sharding == TDM_FSDP_FULL_SHARD) {
            /* the collective ended in an error: nobody writes the block any more */
            tdm_fsdp_pool_put(f, x->pbuf, x->pbuf_bytes);
            x->pbuf = NULL;
        }
        return st;
    }
    x->params = TDM_FSDP_PARAMS_PRESENT;
    if (f->o.sharding == TDM_FSDP_FULL_SHARD)
        TDM_CHECK(tdm_model_set_param_view(f->m, x->first, x->last, x->pbuf));
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_release_params(tdm_fsdp *f, int u)
{
    tdm_fsdp_unit *x = &f->u[u];
    if (f->o.sharding != TDM_FSDP_FULL_SHARD || x->params == TDM_FSDP_PARAMS_ABSENT)
        return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    if (x->params == TDM_FSDP_PARAMS_GATHERING) {
        /* a prefetch nobody used: the block is the collective's until it ends */
        int running;
        st = tdm_fsdp_wait_unit(f, u, x->ag, x->ag_event, NULL, "all_gather", &running);
        if (running) return st;   /* gather, block and params GATHERING stay */
        tdm_fsdp_gather_done(x);
    }
    (void)tdm_model_set_param_view(f->m, x->first, x->last, NULL);
    tdm_fsdp_pool_put(f, x->pbuf, x->pbuf_bytes);
    x->pbuf = NULL;
    x->params = TDM_FSDP_PARAMS_ABSENT;
    return st;
}

tdm_status tdm_fsdp_settle_params(tdm_fsdp *f, int release)
{
    tdm_status first = TDM_STATUS_OK;
    char msg[640] = "";
    for (int u = 0; u < f->nu; u++) {
        tdm_status st;
        if (f->o.sharding == TDM_FSDP_FULL_SHARD && release) st = tdm_fsdp_release_params(f, u);
        else if (f->u[u].params == TDM_FSDP_PARAMS_GATHERING) st = tdm_fsdp_need_params(f, u, 0);
        else continue;
        if (st && !first) {
            first = st;
            snprintf(msg, sizeof msg, "%s", tdm_error_message());
        }
    }
    if (first) tdm_error_set(first, "%s", msg);
    return first;
}

/* ---- the order of a pass ---- */

/* Entries an order holds: each unit once per pass, and in backward a
 * grads-only use of a tied unit besides (u + nu), with room to spare. */
static int tdm_fsdp_order_cap(const tdm_fsdp *f) { return 2 * f->nu + 4; }

void tdm_fsdp_order_begin(tdm_fsdp_order *o)
{
    o->pos = -1;
    o->cur = -1;
    o->state = o->len == 0 ? TDM_FSDP_ORDER_RECORDING : TDM_FSDP_ORDER_FOLLOWING;
}

void tdm_fsdp_order_end(tdm_fsdp_order *o)
{
    if (o->state == TDM_FSDP_ORDER_BROKEN) o->len = 0;   /* record it again next time */
}

/* The pass moved on to unit u: records the order in the first pass,
 * checks it in later ones, and returns the unit expected next (-1: none,
 * or the order is not known). A pass that differs from the recorded one
 * stops prefetching. Every rank runs the same layers, so every rank
 * decides the same and issues the same gathers. */
static int tdm_fsdp_order_step(tdm_fsdp_order *o, int cap, int u)
{
    o->pos++;
    switch (o->state) {
    case TDM_FSDP_ORDER_RECORDING:
        if (o->len < cap) o->unit[o->len++] = u;
        else o->state = TDM_FSDP_ORDER_BROKEN;
        return -1;
    case TDM_FSDP_ORDER_FOLLOWING:
        if (o->pos < o->len && o->unit[o->pos] == u)
            return o->pos + 1 < o->len ? o->unit[o->pos + 1] : -1;
        o->state = TDM_FSDP_ORDER_BROKEN;
        return -1;
    default:
        return -1;
    }
}

/* ---- the model's hooks ---- */

static tdm_status tdm_fsdp_enter_forward(tdm_fsdp *f, int u)
{
    if (u == f->pass.fwd.cur) return TDM_STATUS_OK;
    int full = f->o.sharding == TDM_FSDP_FULL_SHARD;
    if (full && f->pass.fwd.cur >= 0) TDM_CHECK(tdm_fsdp_release_params(f, f->pass.fwd.cur));
    int next = tdm_fsdp_order_step(&f->pass.fwd, tdm_fsdp_order_cap(f), u);
    f->pass.fwd.cur = u;
    TDM_CHECK(tdm_fsdp_need_params(f, u, 1));
    if (full && !f->o.no_prefetch && next >= 0 && next != u)
        TDM_CHECK(tdm_fsdp_issue_gather(f, next, 1));
    return TDM_STATUS_OK;
}

/* params: the layer reads the unit's parameters (0: it only adds into
 * their gradients, TDM_MODEL_USE_BACKWARD_GRADS). The backward order
 * records which (unit u + nu for a grads-only use), so that the prefetch
 * gathers only a unit that will read its parameters. */
static tdm_status tdm_fsdp_enter_backward(tdm_fsdp *f, int u, int params)
{
    tdm_fsdp_unit *x = &f->u[u];
    int full = f->o.sharding == TDM_FSDP_FULL_SHARD;
    if (u != f->pass.bwd.cur) {
        int next = tdm_fsdp_order_step(&f->pass.bwd, tdm_fsdp_order_cap(f),
                                       params ? u : u + f->nu);
        f->pass.bwd.cur = u;
        if (params) TDM_CHECK(tdm_fsdp_need_params(f, u, 1));
        if (full && !f->o.no_prefetch && next >= 0 && next < f->nu && next != u)
            TDM_CHECK(tdm_fsdp_issue_gather(f, next, 1));
    } else if (params) {
        TDM_CHECK(tdm_fsdp_need_params(f, u, 1));
    }
    if (f->o.sharding != TDM_FSDP_SHARD_OPTIM && !x->gbuf) {
        /* A new unit's full gradient: at most one earlier unit's is still
         * being reduce-scattered meanwhile, so at most two units' full
         * gradients exist at once however slow the communication is
         * (no_overlap launches nothing during backward: every unit's full
         * gradient then lives until the end of backward). */
        int oldest;
        while (tdm_fsdp_rs_in_flight(f, &oldest) > 1) TDM_CHECK(tdm_fsdp_finish_rs(f, oldest));
        /* backward adds: the unit's full gradient starts at zero (or holds
         * what no_sync backwards accumulated, kept until the next sync) */
        TDM_CHECK(tdm_fsdp_pool_get(f, (size_t)x->padded * sizeof(float), 1, &x->gbuf,
                                    &x->gbuf_bytes));
        TDM_CHECK(tdm_model_set_grad_view(f->m, x->first, x->last, x->gbuf));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_use_hook(void *ctx, tdm_model *m, tdm_model_use use, int first, int last)
{
    tdm_fsdp *f = ctx;
    (void)m;
    int lo = f->param_unit[first], hi = f->param_unit[last], prev = f->pass.bwd.cur;
    if (use != TDM_MODEL_USE_FORWARD && f->o.sharding == TDM_FSDP_FULL_SHARD && prev >= 0 &&
        (prev < lo || prev > hi) && f->u[prev].pending > 0) {
        /* Backward leaves a unit whose gradients are not final: a tied
         * weight (the GPT's head is its token embedding), whose last
         * share comes at the other end of backward. Its full gradient
         * stays to collect that share before the unit's one
         * reduce-scatter (two would add in another order than DDP's
         * all-reduce); its parameters go back to the pool now. They are
         * gathered again if a later use reads them (prefetched one unit
         * ahead); the GPT's embedding backward only adds into the
         * gradients (TDM_MODEL_USE_BACKWARD_GRADS) and gathers nothing. */
        tdm_status st = tdm_fsdp_release_params(f, prev);
        if (st) return st;
    }
    for (int u = lo; u <= hi; u++) {
        tdm_status st = use == TDM_MODEL_USE_FORWARD
                            ? tdm_fsdp_enter_forward(f, u)
                            : tdm_fsdp_enter_backward(f, u, use == TDM_MODEL_USE_BACKWARD);
        if (st) return st;
    }
    tdm_fsdp_poll(f);
    return TDM_STATUS_OK;
}

static void tdm_fsdp_hook_fail(tdm_fsdp *f, tdm_status st)
{
    if (f->pass.hook_st) return;
    f->pass.hook_st = st;
    snprintf(f->pass.hook_msg, sizeof f->pass.hook_msg, "%s", tdm_error_message());
}

/* Unit u's reduce-scatter: every rank's full gradient of the unit summed,
 * shard r landing on rank r (with opts.comm_hook as 16-bit values:
 * fsdp/comm_hook.c). */
static tdm_status tdm_fsdp_launch_rs(tdm_fsdp *f, int u)
{
    tdm_fsdp_unit *x = &f->u[u];
    tdm_status st;
    if (f->o.comm_hook && f->o.sharding == TDM_FSDP_SHARD_OPTIM) {
        st = tdm_fsdp_hook_launch(f, u, f->buf.gfull + x->full_off);   /* labels it */
    } else if (f->o.sharding == TDM_FSDP_SHARD_OPTIM) {
        float *g = f->buf.gfull + x->full_off;   /* in place */
        tdm_comm_set_label(f->comm, "%s reduce_scatter unit %d", tdm_fsdp_tag(f), u);
        st = tdm_comm_reduce_scatter_async(f->comm, g, g + (int64_t)f->rank * x->shard,
                                           (size_t)x->shard, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM,
                                           &x->rs);
    } else {
        if (!x->gbuf)   /* no layer of the unit ran backward here: its gradient is zero */
            TDM_CHECK(tdm_fsdp_pool_get(f, (size_t)x->padded * sizeof(float), 1, &x->gbuf,
                                        &x->gbuf_bytes));
        float *recv = f->buf.gshard + x->shard_off;
        if (tdm_fsdp_offloaded(f)) {
            /* in place: this rank's slice goes down to the host shard after */
            recv = x->gbuf + (int64_t)f->rank * x->shard;
        } else if (!f->grad.zero) {
            /* the shard holds earlier gradients: receive aside, then add */
            TDM_CHECK(tdm_fsdp_pool_get(f, (size_t)x->shard * sizeof(float), 0, &x->rs_tmp,
                                        &x->rs_tmp_bytes));
            recv = x->rs_tmp;
        }
        if (f->o.comm_hook) {
            st = tdm_fsdp_hook_launch(f, u, x->gbuf);   /* labels it */
        } else {
            tdm_comm_set_label(f->comm, "%s reduce_scatter unit %d", tdm_fsdp_tag(f), u);
            st = tdm_comm_reduce_scatter_async(f->comm, x->gbuf, recv, (size_t)x->shard,
                                               TDM_DTYPE_FLOAT32, TDM_REDOP_SUM, &x->rs);
        }
    }
    if (st) {
        char d[256];
        tdm_fsdp_unlabel(f);
        return tdm_error_prefix(st, "fsdp: reduce_scatter of %s",
                                tdm_fsdp_unit_desc(f, u, d, sizeof d));
    }
    double bytes = (double)x->padded * (f->o.comm_hook ? 2.0 : (double)sizeof(float));
    x->rs_event = tdm_fsdp_new_event(f, 1, u, 0, bytes);
    f->timing.times.rs_bytes_total += bytes;
    if (f->pass.phase == TDM_FSDP_PHASE_BACKWARD)
        f->timing.times.rs_overlapped_bytes_total += bytes;
    return TDM_STATUS_OK;
}

/* Launches the reduce-scatters of finished units, strictly from the last
 * unit down: the order is the same on every rank whatever order units
 * finish in. */
static void tdm_fsdp_launch_ready(tdm_fsdp *f)
{
    while (f->pass.next_rs >= 0 && !f->pass.hook_st && f->u[f->pass.next_rs].pending == 0) {
        tdm_status st = tdm_fsdp_launch_rs(f, f->pass.next_rs);
        if (st) {
            tdm_fsdp_hook_fail(f, st);
            return;
        }
        f->pass.next_rs--;
    }
}

static void tdm_fsdp_unit_done(tdm_fsdp *f, int u)
{
    /* nothing later in this backward reads the unit's parameters */
    tdm_status st = tdm_fsdp_release_params(f, u);
    if (st) tdm_fsdp_hook_fail(f, st);
}

void tdm_fsdp_grad_hook(void *ctx, tdm_model *m, int first, int last)
{
    tdm_fsdp *f = ctx;
    (void)m;
    if (f->pass.phase != TDM_FSDP_PHASE_BACKWARD) return;
    for (int p = last; p >= first; p--) {
        if (f->pass.ready[p]) continue;
        f->pass.ready[p] = 1;
        int u = f->param_unit[p];
        if (--f->u[u].pending == 0) tdm_fsdp_unit_done(f, u);
    }
    if (f->pass.sync && !f->o.no_overlap) tdm_fsdp_launch_ready(f);
    tdm_fsdp_poll(f);
}

/* ---- a backward's start and end ---- */

void tdm_fsdp_backward_begin(tdm_fsdp *f)
{
    for (int u = 0; u < f->nu; u++) f->u[u].pending = f->u[u].last - f->u[u].first + 1;
    memset(f->pass.ready, 0, (size_t)f->n_params);
    f->pass.next_rs = f->nu - 1;
    tdm_fsdp_order_begin(&f->pass.bwd);
    f->pass.hook_st = TDM_STATUS_OK;
    f->timing.rs_done_in_bwd = 0;
}

/* opts.offload PARAMS, after unit u's reduce-scatter (in place in its
 * full gradient): this rank's slice down into the host gradient shard,
 * on the device's copy stream, beside the backward of the units after it
 * (the block is held until tdm_fsdp_drain finishes the copy: x->dbuf);
 * or, when the shard holds earlier gradients, down into host staging and
 * added there (the same addition the device does without offload), at
 * once. */
static tdm_status tdm_fsdp_offload_grad(tdm_fsdp *f, int u)
{
    tdm_fsdp_unit *x = &f->u[u];
    const float *slice = x->gbuf + (int64_t)f->rank * x->shard;
    float *dst = f->buf.gshard + x->shard_off;
    size_t nb = (size_t)x->shard * sizeof(float);
    uint64_t tc = tdm_time_ns();
    if (f->grad.zero) {
        tdm_status st = tdm_dev_copy_async(f->dev, TDM_DEV_XFER_TO_HOST, dst, slice, nb,
                                           &x->down);
        f->pass.copy_ms += tdm_time_ms_since(tc);
        if (st) return st;
        x->dbuf = x->gbuf;
        x->dbuf_bytes = x->gbuf_bytes;
        x->gbuf = NULL;
        return TDM_STATUS_OK;
    }
    if (!f->buf.hstage)
        TDM_CHECK(tdm_dev_alloc(f->sdev, (size_t)(f->max_padded / f->world) * sizeof(float),
                                (void **)&f->buf.hstage));
    tdm_status st = tdm_dev_copy_between(f->sdev, f->buf.hstage, f->dev, slice, nb);
    f->pass.copy_ms += tdm_time_ms_since(tc);
    if (st) return st;
    return tdm_dev_axpy(f->sdev, x->shard, 1.0f, f->buf.hstage, dst);
}

/* Waits for unit u's reduce-scatter and puts its result in place. */
static tdm_status tdm_fsdp_finish_rs(tdm_fsdp *f, int u)
{
    tdm_fsdp_unit *x = &f->u[u];
    if (!x->rs) return TDM_STATUS_OK;
    int running;
    tdm_status st = tdm_fsdp_wait_unit(f, u, x->rs, x->rs_event, &f->pass.rs_wait_ms,
                                       "reduce_scatter", &running);
    /* still running: the handle stays with the blocks it reads and writes
     * (gbuf, rs_tmp, the shard) */
    if (running) return st;
    tdm_comm_work_free(x->rs);
    x->rs = NULL;
    x->rs_event = -1;
    if (st) {
        tdm_fsdp_hook_release(f, u);
        return st;
    }
    tdm_fsdp_hook_finish(f, u);   /* opts.comm_hook: the 16-bit sum into place */
    tdm_device *d = f->dev;
    if (tdm_fsdp_offloaded(f)) TDM_CHECK(tdm_fsdp_offload_grad(f, u));
    if (f->o.sharding == TDM_FSDP_SHARD_OPTIM) {
        /* Only the owned slice counts now. The rest still holds this
         * rank's local gradients, which a later backward must not add
         * onto (the next reduce-scatter would count them twice): they are
         * cleared by the next zero_grad, which clears everything anyway,
         * or before a backward that comes without one
         * (tdm_fsdp_clear_stale). Clearing them here as well cost a pass
         * over (N-1)/N of the gradients every step (issue 14). */
        f->grad.stale = 1;
        if (f->grad.reduced != TDM_FSDP_REDUCED_HELD) f->grad.reduced = TDM_FSDP_REDUCED_IN_PLACE;
        else   /* the reduced gradient held aside by tdm_fsdp_hold_reduced */
            TDM_CHECK(tdm_dev_axpy(d, x->shard, 1.0f, f->buf.gacc + x->shard_off,
                                   tdm_fsdp_gshard(f, u)));
        return TDM_STATUS_OK;
    }
    if (x->rs_tmp) {
        TDM_CHECK(tdm_dev_axpy(d, x->shard, 1.0f, x->rs_tmp, f->buf.gshard + x->shard_off));
        tdm_fsdp_pool_put(f, x->rs_tmp, x->rs_tmp_bytes);
        x->rs_tmp = NULL;
    }
    (void)tdm_model_set_grad_view(f->m, x->first, x->last, NULL);
    tdm_fsdp_pool_put(f, x->gbuf, x->gbuf_bytes);
    x->gbuf = NULL;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_clear_stale(tdm_fsdp *f)
{
    if (!f->grad.stale) return TDM_STATUS_OK;
    for (int u = 0; u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        float *g = f->buf.gfull + x->full_off;
        int64_t lo = (int64_t)f->rank * x->shard, hi = lo + x->shard;
        if (lo > 0) TDM_CHECK(tdm_dev_memset_zero(f->dev, g, (size_t)lo * sizeof(float)));
        if (hi < x->padded)
            TDM_CHECK(tdm_dev_memset_zero(f->dev, g + hi,
                                          (size_t)(x->padded - hi) * sizeof(float)));
    }
    f->grad.stale = 0;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_hold_reduced(tdm_fsdp *f)
{
    if (f->o.sharding != TDM_FSDP_SHARD_OPTIM || !f->o.comm_hook ||
        f->grad.reduced != TDM_FSDP_REDUCED_IN_PLACE)
        return TDM_STATUS_OK;
    if (!f->buf.gacc)
        TDM_CHECK(tdm_dev_alloc(f->dev, (size_t)(f->shard_elems ? f->shard_elems : 1) *
                                            sizeof(float), (void **)&f->buf.gacc));
    for (int u = 0; u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        float *own = tdm_fsdp_gshard(f, u);
        TDM_CHECK(tdm_dev_copy(f->dev, f->buf.gacc + x->shard_off, own,
                               (size_t)x->shard * sizeof(float)));
        TDM_CHECK(tdm_dev_memset_zero(f->dev, own, (size_t)x->shard * sizeof(float)));
    }
    f->grad.reduced = TDM_FSDP_REDUCED_HELD;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_backward_end(tdm_fsdp *f)
{
    tdm_fsdp_order_end(&f->pass.bwd);
    if (!f->pass.sync) {
        /* gradients stay in the units' full buffers for the next sync */
        TDM_CHECK(tdm_fsdp_settle_params(f, 1));
        return TDM_STATUS_OK;
    }
    if (f->pass.hook_st) return tdm_error_set(f->pass.hook_st, "%s", f->pass.hook_msg);
    /* A unit whose hook did not fire (this rank had no samples, or its
     * layers did not run backward) takes part with the gradient it holds:
     * zeros, or what no_sync backwards accumulated. */
    for (int u = 0; u < f->nu; u++) {
        if (f->u[u].pending == 0) continue;
        f->u[u].pending = 0;
        TDM_CHECK(tdm_fsdp_release_params(f, u));
    }
    tdm_fsdp_launch_ready(f);
    if (f->pass.hook_st) return tdm_error_set(f->pass.hook_st, "%s", f->pass.hook_msg);
    for (int u = f->nu - 1; u >= 0; u--) TDM_CHECK(tdm_fsdp_finish_rs(f, u));
    if (tdm_fsdp_offloaded(f)) {
        /* the host gradient shards are read next (the optimizer, the
         * levers): the copies still in flight are waited for, and those
         * finished earlier were ordered before the device's later work,
         * which the device has done once it is synchronised */
        TDM_CHECK(tdm_fsdp_drain(f, TDM_DEV_XFER_HOST));
        uint64_t tc = tdm_time_ns();
        tdm_status sst = tdm_dev_sync(f->dev);
        f->pass.copy_ms += tdm_time_ms_since(tc);
        TDM_CHECK(sst);
    }
    /* every unit has added back what was held: it is in place again */
    if (f->grad.reduced == TDM_FSDP_REDUCED_HELD) f->grad.reduced = TDM_FSDP_REDUCED_IN_PLACE;
    f->grad.zero = 0;
    TDM_CHECK(tdm_fsdp_settle_params(f, 1));
    tdm_fsdp_pool_trim(f);
    return TDM_STATUS_OK;
}

/* ---- failure ---- */

tdm_status tdm_fsdp_fail(tdm_fsdp *f, tdm_status st)
{
    char msg[768];
    snprintf(msg, sizeof msg, "%s", tdm_error_message());
    /* copies down to the host end before their blocks and shards are anyone's */
    (void)tdm_fsdp_drain(f, TDM_DEV_XFER_HOST);
    (void)tdm_comm_abort(f->comm, msg);
    if (f->hcomm != f->comm) (void)tdm_comm_abort(f->hcomm, msg);
    /* The communicator is aborted: what is in flight ends at once (with an
     * error), each wait bounded all the same. */
    for (int u = 0; u < f->nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        if (x->ag) (void)tdm_comm_work_wait(x->ag, TDM_DIST_DRAIN_TIMEOUT_MS);
        if (x->rs) (void)tdm_comm_work_wait(x->rs, TDM_DIST_DRAIN_TIMEOUT_MS);
        /* A work still running after that keeps its handle and its blocks
         * (tdm_fsdp_free waits again, and leaks them if it must). */
        if (tdm_fsdp_work_over(x->rs)) {
            tdm_comm_work_free(x->rs);
            x->rs = NULL;
        }
        if (!tdm_fsdp_work_over(x->ag)) continue;
        tdm_comm_work_free(x->ag);
        x->ag = NULL;
        if (x->params == TDM_FSDP_PARAMS_GATHERING && f->o.sharding == TDM_FSDP_FULL_SHARD) {
            (void)tdm_model_set_param_view(f->m, x->first, x->last, NULL);
            tdm_fsdp_pool_put(f, x->pbuf, x->pbuf_bytes);
            x->pbuf = NULL;
            x->params = TDM_FSDP_PARAMS_ABSENT;
        } else if (x->params == TDM_FSDP_PARAMS_GATHERING) {
            /* what the full copy holds now is not known; it stays */
            x->params = TDM_FSDP_PARAMS_PRESENT;
        }
    }
    return tdm_error_set(st, "%s", msg);
}
