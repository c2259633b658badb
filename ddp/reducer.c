/* ddp/reducer.c: DDP's Reducer (see ddp/reducer_impl.h): the bucket plan
 * and its rebuild after the first step, the construction checks, the
 * grad-ready hook that launches bucket all-reduces in order, the wait at
 * the end of backward and the check tail. Not the DDP wrapper (ddp/ddp.c
 * runs forward, backward and the optimizer around it) and not a
 * communicator: it only calls core/comm.h. */
#include "ddp/reducer_impl.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/timer.h"
#include "dist/check.h"

/* ---- bucket plan ---- */

/* PyTorch's bucket_size_limits: first_cap for the first bucket closed,
 * cap for every later one. */
static void tdm_ddp_caps(const tdm_ddp_reducer *r, size_t *first_cap, size_t *cap)
{
    *cap = r->o.bucket_cap_bytes ? r->o.bucket_cap_bytes
           : (size_t)((r->o.bucket_cap_mb > 0 ? r->o.bucket_cap_mb : 25.0) * 1048576.0);
    *first_cap = r->o.first_bucket_bytes ? r->o.first_bucket_bytes : 1048576;
    if (*first_cap > *cap) *first_cap = *cap;
}

/* PyTorch's compute_bucket_assignment_by_size (c10d/reducer.cpp), one
 * dtype and device: walking the parameters in `order`, each one joins the
 * open bucket, and the bucket closes once its bytes reach the limit
 * (first_cap for the first bucket closed, cap after it); what is still
 * open at the end is the last group. A parameter larger than the limit
 * closes its bucket at once: never split. Writes each position's group;
 * returns the number of groups. */
static int tdm_ddp_assign(const tdm_model *m, const int *order, int n, size_t first_cap,
                          size_t cap, int *group)
{
    int ng = 0, open = 0;
    size_t bytes = 0, lim = first_cap;
    for (int i = 0; i < n; i++) {
        group[i] = ng;
        open = 1;
        bytes += (size_t)tdm_model_param_info(m, order[i])->n_elem * sizeof(float);
        if (bytes >= lim) {
            ng++;
            open = 0;
            bytes = 0;
            lim = cap;
        }
    }
    return ng + open;
}

/* Makes group g (of the positions of `order`) bucket g, or bucket ng-1-g
 * when reversed. Returns 0, changing nothing, when a group's parameters
 * are not one range of indices: a bucket is a view of the flat buffer. */
static int tdm_ddp_set_plan(tdm_ddp_reducer *r, const int *order, const int *group, int ng,
                            int reversed)
{
    tdm_model *m = r->m;
    int n = r->n_params;
    for (int g = 0; g < ng; g++) {
        int lo = n, hi = -1, cnt = 0;
        for (int i = 0; i < n; i++) {
            if (group[i] != g) continue;
            if (order[i] < lo) lo = order[i];
            if (order[i] > hi) hi = order[i];
            cnt++;
        }
        if (hi - lo + 1 != cnt) return 0;
    }
    for (int i = 0; i < n; i++) {
        int b = reversed ? ng - 1 - group[i] : group[i];
        r->param_bucket[order[i]] = b;
    }
    for (int b = 0; b < ng; b++) {
        r->b[b] = (tdm_ddp_bucket){.first = n, .last = -1};
        r->bt[b] = (tdm_ddp_bucket_times){0};
    }
    for (int p = 0; p < n; p++) {
        tdm_ddp_bucket *bk = &r->b[r->param_bucket[p]];
        if (p < bk->first) bk->first = p;
        if (p > bk->last) bk->last = p;
    }
    for (int b = 0; b < ng; b++) {
        tdm_ddp_bucket *bk = &r->b[b];
        bk->offset = tdm_model_param_info(m, bk->first)->offset;
        /* the bucket holding the last parameter carries the check tail */
        int64_t end = bk->last + 1 < n ? tdm_model_param_info(m, bk->last + 1)->offset
                                       : r->param_elems + TDM_DDP_TAIL_ELEMS;
        bk->n_elem = end - bk->offset;
    }
    r->nb = ng;
    return 1;
}

static void tdm_ddp_log_plan(const tdm_ddp_reducer *r, const char *what)
{
    if (!tdm_log_enabled(TDM_LOG_LEVEL_INFO, TDM_LOG_DDP)) return;
    size_t first_cap, cap;
    tdm_ddp_caps(r, &first_cap, &cap);
    TDM_INFO(DDP, "bucket plan (%s): %d bucket(s), cap %zu bytes, first bucket cap %zu bytes",
             what, r->nb, cap, first_cap);
    for (int i = 0; i < r->nb; i++) {
        const tdm_ddp_bucket *bk = &r->b[i];
        TDM_INFO(DDP, "  bucket %d: %lld elements at offset %lld, parameters %d..%d (%s .. %s)", i,
                 (long long)bk->n_elem, (long long)bk->offset, bk->first, bk->last,
                 tdm_model_param_info(r->m, bk->first)->name,
                 tdm_model_param_info(r->m, bk->last)->name);
    }
}

/* The construction plan, as PyTorch's DDP makes it. Without
 * find_unused_parameters: one bucket for the first synchronised backward
 * (PyTorch's [sys.maxsize] limit: the order gradients become ready is not
 * known yet), which records that order; the next one rebuilds the plan
 * from it (tdm_ddp_rebuild). With it: the limits walked in parameter
 * (definition) order, the groups reversed so that bucket 0 holds the last
 * parameters, never rebuilt (the used set may change from step to step). */
static tdm_status tdm_ddp_plan(tdm_ddp_reducer *r)
{
    int n = r->n_params;
    r->b = calloc((size_t)n, sizeof *r->b);
    r->bt = calloc((size_t)n, sizeof *r->bt);
    r->param_bucket = calloc((size_t)n, sizeof *r->param_bucket);
    r->ready = calloc((size_t)n, 1);
    r->order = calloc((size_t)n, sizeof *r->order);
    r->group = calloc((size_t)n, sizeof *r->group);
    r->hb = calloc((size_t)n, sizeof *r->hb);
    if (!r->b || !r->bt || !r->param_bucket || !r->ready || !r->order || !r->group || !r->hb)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ddp: bucket plan for %d parameters", n);
    size_t first_cap, cap;
    tdm_ddp_caps(r, &first_cap, &cap);
    for (int p = 0; p < n; p++) r->order[p] = p;
    int ng = r->o.find_unused_parameters
                 ? tdm_ddp_assign(r->m, r->order, n, first_cap, cap, r->group)
                 : tdm_ddp_assign(r->m, r->order, n, SIZE_MAX, SIZE_MAX, r->group);
    (void)tdm_ddp_set_plan(r, r->order, r->group, ng, 1);  /* parameter order: always ranges */
    r->record_order = !r->o.find_unused_parameters;
    tdm_ddp_log_plan(r, r->record_order ? "first step" : "find_unused_parameters");
    return TDM_STATUS_OK;
}

static uint64_t tdm_ddp_plan_hash(const tdm_ddp_reducer *r)
{
    uint64_t h = TDM_DIST_HASH_SEED;
    for (int i = 0; i < r->nb; i++) {
        int64_t v[3] = {r->b[i].first, r->b[i].last, r->b[i].offset};
        h = tdm_dist_hash(v, sizeof v, h);
    }
    return h;
}

/* ---- construction checks ---- */

/* The plan's values gathered with the model check's counts. */
enum { TDM_DDP_PLAN_HASH, TDM_DDP_PLAN_NBUCKETS, TDM_DDP_PLAN_ZC, TDM_DDP_PLAN_N };

/* Every rank the same model (dist/check.h), then the same bucket plan. */
static tdm_status tdm_ddp_verify(tdm_ddp_reducer *r)
{
    int64_t mine[TDM_DDP_PLAN_N] = {[TDM_DDP_PLAN_HASH] = (int64_t)tdm_ddp_plan_hash(r),
                                    [TDM_DDP_PLAN_NBUCKETS] = r->nb,
                                    [TDM_DDP_PLAN_ZC] = r->zero_copy};
    int64_t *all = NULL;
    TDM_CHECK(tdm_dist_check_model(r->hcomm, r->m, "ddp", "ddp model check", mine,
                                   TDM_DDP_PLAN_N, &all));
    tdm_status st = TDM_STATUS_OK;
    for (int k = 1; k < r->world && !st; k++) {
        const int64_t *a = all, *b = all + (size_t)k * TDM_DDP_PLAN_N;
        if (a[TDM_DDP_PLAN_HASH] == b[TDM_DDP_PLAN_HASH] &&
            a[TDM_DDP_PLAN_ZC] == b[TDM_DDP_PLAN_ZC])
            continue;
        st = tdm_error_set(TDM_STATUS_MISMATCH,
                           "ddp: bucket plan differs between ranks: rank 0 planned %lld "
                           "bucket(s)%s, rank %d %lld%s; use the same bucket cap (and "
                           "communicator arena) on every rank",
                           (long long)a[TDM_DDP_PLAN_NBUCKETS],
                           a[TDM_DDP_PLAN_ZC] ? " (zero-copy)" : "", k,
                           (long long)b[TDM_DDP_PLAN_NBUCKETS],
                           b[TDM_DDP_PLAN_ZC] ? " (zero-copy)" : "");
    }
    free(all);
    return st;
}

/* PyTorch's rebuild_buckets: after the first synchronised backward, the
 * plan is made again with the limits over the order its gradients became
 * ready (tandem's models finish parameters from the last to the first, so
 * this is the reverse parameter order unless a model says otherwise).
 * Every rank must get the same plan: one all_gather of plan hashes (where
 * PyTorch broadcasts rank 0's plan) names a rank that differs. */
static tdm_status tdm_ddp_rebuild(tdm_ddp_reducer *r)
{
    int n = r->n_params, W = r->world;
    size_t first_cap, cap;
    r->rebuild_pending = 0;
    tdm_ddp_caps(r, &first_cap, &cap);
    int ng = tdm_ddp_assign(r->m, r->order, n, first_cap, cap, r->group);
    if (!tdm_ddp_set_plan(r, r->order, r->group, ng, 0)) {
        /* a bucket of parameters that are not neighbours in the flat
         * buffer could not be a view of it */
        TDM_WARN(DDP, "rank %d: gradients became ready out of parameter order (parameter %d "
                 "first): buckets planned in reverse parameter order instead", r->rank,
                 r->order[0]);
        for (int i = 0; i < n; i++) r->order[i] = n - 1 - i;
        ng = tdm_ddp_assign(r->m, r->order, n, first_cap, cap, r->group);
        (void)tdm_ddp_set_plan(r, r->order, r->group, ng, 0);
    }
    tdm_ddp_log_plan(r, "rebuilt in the order gradients became ready");
    int64_t *all = calloc((size_t)W * 2, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
    all[2 * r->rank] = (int64_t)tdm_ddp_plan_hash(r);
    all[2 * r->rank + 1] = r->nb;
    tdm_comm_set_label(r->hcomm, "ddp bucket plan check");
    tdm_status st = tdm_comm_all_gather(r->hcomm, all + 2 * r->rank, all, 2, TDM_DTYPE_INT64);
    if (st) {
        tdm_error_prefix(st, "ddp: checking the rebuilt bucket plan");
    } else {
        for (int k = 1; k < W; k++) {
            if (all[2 * k] == all[0]) continue;
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "ddp: bucket plan rebuilt after the first step differs between "
                               "ranks: rank 0 planned %lld bucket(s), rank %d planned %lld "
                               "(here, on rank %d, %d); every rank must use the same bucket "
                               "caps and a model whose backward produces gradients in the same "
                               "order",
                               (long long)all[1], k, (long long)all[2 * k + 1], r->rank, r->nb);
            break;
        }
    }
    free(all);
    return st;
}

/* ---- hook and bucket launches ---- */

static double tdm_ddp_rel_ms(const tdm_ddp_reducer *r) { return tdm_time_ms_since(r->t0); }

static void tdm_ddp_hook_fail(tdm_ddp_reducer *r, tdm_status st)
{
    if (r->hook_st) return;
    r->hook_st = st;
    snprintf(r->hook_msg, sizeof r->hook_msg, "%s", tdm_error_message());
}

/* Starts bucket i's reduction: the Reducer's own asynchronous float32
 * all-reduce, or the comm hook's launch followed by the check tail's
 * float32 all-reduce when the bucket carries it. Counts its bytes. */
static tdm_status tdm_ddp_bucket_launch(tdm_ddp_reducer *r, int i)
{
    tdm_ddp_bucket *bk = &r->b[i];
    float *v = r->grads + bk->offset;
    double bytes = (double)bk->n_elem * 4.0;
    tdm_status st;
    r->bt[i].start_ms = tdm_ddp_rel_ms(r);
    bk->launched = 1;
    if (!r->hook.launch) {
        tdm_comm_set_label(r->comm, "ddp bucket %d", i);
        st = tdm_comm_all_reduce_async(r->comm, v, v, (size_t)bk->n_elem, TDM_DTYPE_FLOAT32,
                                       TDM_REDOP_SUM, &bk->work);
        if (st) return tdm_error_prefix(st, "ddp: bucket %d all_reduce", i);
    } else {
        int tail = bk->last == r->n_params - 1;
        tdm_ddp_hook_bucket *h = &r->hb[i];
        *h = (tdm_ddp_hook_bucket){
            .index = i, .grads = v, .n_elem = bk->n_elem - (tail ? TDM_DDP_TAIL_ELEMS : 0),
            .offset = bk->offset, .first_param = bk->first, .last_param = bk->last,
            .model = r->m, .comm = r->comm, .step = (int64_t)r->sync_count,
            .timeout_ms = r->o.timeout_ms > 0 ? r->o.timeout_ms : -1};
        /* the label names the hook's first collective */
        tdm_comm_set_label(r->comm, "ddp bucket %d (comm hook)", i);
        st = r->hook.launch(r->hook.state, h);
        if (st) {
            bk->launched = 0;
            return tdm_error_prefix(st, "ddp: comm hook '%s' on bucket %d (launch)",
                                    r->hook.name ? r->hook.name : "user", i);
        }
        bytes = h->bytes;
        if (tail) {
            float *t = r->grads + r->param_elems;
            tdm_comm_set_label(r->comm, "ddp bucket %d check tail", i);
            st = tdm_comm_all_reduce_async(r->comm, t, t, TDM_DDP_TAIL_ELEMS, TDM_DTYPE_FLOAT32,
                                           TDM_REDOP_SUM, &bk->work);
            if (st) return tdm_error_prefix(st, "ddp: check tail all_reduce");
            bytes += TDM_DDP_TAIL_ELEMS * 4.0;
        }
    }
    if (r->in_backward) r->overlapped_bytes += bytes;
    r->reduced_bytes += bytes;
    return TDM_STATUS_OK;
}

/* Launches every complete bucket from next_launch on, in bucket order,
 * asynchronously (the progress thread runs it while backward goes on).
 * The last bucket holds the parameters backward finishes last (the first
 * layer's): nothing is left to overlap it with, so it is never
 * launched here but run on this thread by tdm_ddp_finish (saving the two
 * thread wake-ups an asynchronous call costs). */
static void tdm_ddp_launch_ready(tdm_ddp_reducer *r)
{
    while (r->next_launch < r->nb - 1 && !r->hook_st && r->b[r->next_launch].pending == 0) {
        tdm_status st = tdm_ddp_bucket_launch(r, r->next_launch);
        if (st) {
            tdm_ddp_hook_fail(r, st);
            return;
        }
        r->next_launch++;
    }
}

/* Notes completion times of launched buckets (never blocks). */
static void tdm_ddp_poll(tdm_ddp_reducer *r)
{
    if (r->hook.launch) return;   /* a hook's completion is seen at its wait */
    for (int i = 0; i < r->next_launch; i++) {
        if (r->b[i].done || !r->b[i].work) continue;
        int done = 0;
        if (tdm_comm_work_test(r->b[i].work, &done) != TDM_STATUS_OK || !done) return;
        r->b[i].done = 1;
        r->bt[i].end_ms = tdm_ddp_rel_ms(r);
    }
}

static void tdm_ddp_mark_ready(tdm_ddp_reducer *r, int p)
{
    if (r->ready[p]) return;
    r->ready[p] = 1;
    if (r->record_order) r->order[r->n_order++] = p;
    int bi = r->param_bucket[p];
    if (--r->b[bi].pending == 0) r->bt[bi].ready_ms = tdm_ddp_rel_ms(r);
}

static void tdm_ddp_hook(void *ctx, tdm_model *m, int first, int last)
{
    tdm_ddp_reducer *r = ctx;
    (void)m;
    if (!r->in_backward) return;
    for (int p = last; p >= first; p--) tdm_ddp_mark_ready(r, p);
    if (!r->o.no_overlap) tdm_ddp_launch_ready(r);
    tdm_ddp_poll(r);
}

/* Waits for every launched bucket in order, each bounded by
 * opts.timeout_ms when set and always by the communicator's deadline; on
 * the first failure aborts the communicator (so the other ranks stop too)
 * and still drains the rest, 10 s at most each. */
static tdm_status tdm_ddp_drain(tdm_ddp_reducer *r)
{
    tdm_status st = TDM_STATUS_OK;
    char msg[768] = "";
    int64_t to = r->o.timeout_ms > 0 ? r->o.timeout_ms : -1;
    for (int i = 0; i < r->nb; i++) {
        tdm_ddp_bucket *bk = &r->b[i];
        if (!bk->launched) continue;
        bk->launched = 0;
        tdm_status s = TDM_STATUS_OK;
        if (r->hook.launch) {
            /* the hook's wait, then the check tail's (launched after it) */
            r->hb[i].timeout_ms = st ? TDM_DIST_DRAIN_TIMEOUT_MS : to;
            s = r->hook.wait(r->hook.state, &r->hb[i]);
            if (s)
                tdm_error_prefix(s, "comm hook '%s' (wait)", r->hook.name ? r->hook.name : "user");
        }
        if (bk->work) {
            /* Completion usually comes within microseconds: poll (yielding
             * the core to the progress thread) before sleeping on it. */
            uint64_t spin_end = tdm_time_ns() + 200000;
            int done = 0;
            while (!st && !s && tdm_comm_work_test(bk->work, &done) == TDM_STATUS_OK && !done &&
                   tdm_time_ns() < spin_end)
                sched_yield();
            tdm_status s2 =
                tdm_comm_work_wait(bk->work, (st || s) ? TDM_DIST_DRAIN_TIMEOUT_MS : to);
            if (!s) s = s2;
            /* freeing a still-running work is allowed: it completes in the
             * background (core/comm.h), and the communicator is aborted */
            tdm_comm_work_free(bk->work);
            bk->work = NULL;
        }
        if (!bk->done) r->bt[i].end_ms = tdm_ddp_rel_ms(r);
        bk->done = 1;
        if (s && !st) {
            st = s;
            snprintf(msg, sizeof msg, "ddp: backward #%" PRIu64 ": all_reduce of bucket %d "
                     "(%lld elements, parameters %d..%d): %s", r->sync_count, i,
                     (long long)bk->n_elem, bk->first, bk->last, tdm_error_message());
            tdm_comm_abort(r->comm, msg);
        }
    }
    if (st) tdm_error_set(st, "%s", msg);
    return st;
}

tdm_status tdm_ddp_reducer_abort(tdm_ddp_reducer *r, tdm_status st)
{
    char msg[768];
    snprintf(msg, sizeof msg, "%s", tdm_error_message());
    tdm_comm_abort(r->comm, msg);
    (void)tdm_ddp_drain(r);
    return tdm_error_set(st, "%s", msg);
}

static tdm_status tdm_ddp_unready_error(tdm_ddp_reducer *r)
{
    char list[384] = "";
    size_t len = 0;
    int n = 0;
    for (int p = 0; p < r->n_params; p++) {
        if (r->ready[p]) continue;
        if (n < 8 && len < sizeof list - 64)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s'%s' (%d)", n ? ", " : "",
                                    tdm_model_param_info(r->m, p)->name, p);
        n++;
    }
    return tdm_error_set(TDM_STATUS_MISMATCH,
                         "ddp: backward #%" PRIu64 " on rank %d produced no gradient for %d "
                         "parameter(s): %s%s; their buckets could not be reduced. Construct "
                         "DDP with find_unused_parameters=1 if parameters may take no part in "
                         "a step", r->sync_count, r->rank, n, list, n > 8 ? ", ..." : "");
}

/* Reads the reduced tail: names a rank whose forward count differs, and
 * sums the ranks' loss sums (rank order, double). */
static tdm_status tdm_ddp_check_tail(tdm_ddp_reducer *r, uint32_t mine, double *loss_global)
{
    float s[TDM_DDP_TAIL_ELEMS];
    double seq[TDM_DDP_MAX_RANKS];
    TDM_CHECK(tdm_dev_copy_to_host(r->dev, s, r->grads + r->param_elems, sizeof s));
    double loss = 0.0;
    for (int k = 0; k < r->world; k++) {
        loss += (double)s[TDM_DDP_TAIL_LOSS_HI + k] + (double)s[TDM_DDP_TAIL_LOSS_LO + k];
        seq[k] = (double)s[TDM_DDP_TAIL_SEQ + k] - 1.0;   /* slots hold the count + 1 */
    }
    TDM_CHECK(tdm_dist_check_seq("ddp", seq, r->world, r->rank, (double)mine - 1.0));
    *loss_global = loss;
    return TDM_STATUS_OK;
}

/* End of a synchronised backward: wait for the asynchronous buckets, run
 * the rest here, in bucket order. */
static tdm_status tdm_ddp_finish(tdm_ddp_reducer *r)
{
    TDM_CHECK(tdm_ddp_drain(r));
    for (int i = r->next_launch; i < r->nb; i++) {
        tdm_ddp_bucket *bk = &r->b[i];
        float *v = r->grads + bk->offset;
        tdm_status st;
        if (r->hook.launch) {
            /* the hook's launch and wait, one bucket at a time */
            st = tdm_ddp_bucket_launch(r, i);
            if (st == TDM_STATUS_OK) st = tdm_ddp_drain(r);
            if (st) {
                char msg[768];
                snprintf(msg, sizeof msg, "%s", tdm_error_message());
                tdm_comm_abort(r->comm, msg);
                return tdm_error_set(st, "%s", msg);
            }
            r->next_launch = i + 1;
            continue;
        }
        r->bt[i].start_ms = tdm_ddp_rel_ms(r);
        r->reduced_bytes += (double)bk->n_elem * 4.0;
        tdm_comm_set_label(r->comm, "ddp bucket %d", i);
        if (r->o.timeout_ms > 0) {
            /* bounded by opts.timeout_ms like the asynchronous buckets */
            tdm_comm_work *w = NULL;
            st = tdm_comm_all_reduce_async(r->comm, v, v, (size_t)bk->n_elem, TDM_DTYPE_FLOAT32,
                                           TDM_REDOP_SUM, &w);
            if (st == TDM_STATUS_OK) st = tdm_comm_work_wait(w, r->o.timeout_ms);
            tdm_comm_work_free(w);
        } else {
            st = tdm_comm_all_reduce(r->comm, v, v, (size_t)bk->n_elem, TDM_DTYPE_FLOAT32,
                                     TDM_REDOP_SUM);
        }
        r->bt[i].end_ms = tdm_ddp_rel_ms(r);
        if (st) {
            char msg[768];
            snprintf(msg, sizeof msg, "ddp: backward #%" PRIu64 ": all_reduce of bucket %d "
                     "(%lld elements, parameters %d..%d): %s", r->sync_count, i,
                     (long long)bk->n_elem, bk->first, bk->last, tdm_error_message());
            tdm_comm_abort(r->comm, msg);
            return tdm_error_set(st, "%s", msg);
        }
        r->next_launch = i + 1;
    }
    return TDM_STATUS_OK;
}

/* ---- construction, one synchronised backward, teardown ---- */

tdm_status tdm_ddp_reducer_init(tdm_ddp_reducer *r, tdm_model *m, tdm_comm *comm,
                                tdm_comm *hcomm, const tdm_ddp_opts *opts)
{
    memset(r, 0, sizeof *r);
    r->m = m;
    r->comm = comm;
    r->hcomm = hcomm;
    r->dev = tdm_model_device(m);
    if (opts) r->o = *opts;
    r->rank = tdm_comm_rank(comm);
    r->world = tdm_comm_size(comm);
    r->n_params = tdm_model_n_params(m);
    r->param_elems = tdm_model_param_elems(m);
    TDM_CHECK(tdm_ddp_plan(r));
    size_t gbytes = (size_t)(r->param_elems + TDM_DDP_TAIL_ELEMS) * sizeof(float);
    if (tdm_comm_alloc(comm, gbytes, (void **)&r->grads) == TDM_STATUS_OK) {
        r->zero_copy = 1;
        TDM_CHECK(tdm_dev_mem_adopt(r->dev, r->grads, gbytes));
        r->adopted = 1;
    } else {
        TDM_INFO(DDP, "gradients not in communicator memory (%s): all-reduce will copy",
                 tdm_error_message());
        tdm_error_clear();
        r->grads = NULL;
        TDM_CHECK(tdm_dev_alloc(r->dev, gbytes, (void **)&r->grads));
    }
    TDM_CHECK(tdm_dev_memset_zero(r->dev, r->grads, gbytes));
    return tdm_ddp_verify(r);
}

tdm_status tdm_ddp_reducer_attach(tdm_ddp_reducer *r)
{
    TDM_CHECK(tdm_model_set_grad_storage(r->m, r->grads));
    tdm_model_set_grad_hook(r->m, tdm_ddp_hook, r);
    r->attached = 1;
    return TDM_STATUS_OK;
}

void tdm_ddp_reducer_free(tdm_ddp_reducer *r)
{
    for (int i = 0; i < r->nb; i++) {
        if (r->hook.launch && r->b[i].launched) {
            r->hb[i].timeout_ms = TDM_DIST_DRAIN_TIMEOUT_MS;
            (void)r->hook.wait(r->hook.state, &r->hb[i]);
        }
        if (r->b[i].work) (void)tdm_comm_work_wait(r->b[i].work, TDM_DIST_DRAIN_TIMEOUT_MS);
        tdm_comm_work_free(r->b[i].work);
    }
    if (r->own_hook && r->hook.free) r->hook.free(r->hook.state);
    free(r->hb);
    if (r->attached) {
        tdm_model_set_grad_hook(r->m, NULL, NULL);
        (void)tdm_model_set_grad_storage(r->m, NULL);
    }
    if (r->adopted) tdm_dev_mem_disown(r->dev, r->grads);
    if (!r->zero_copy && r->grads) tdm_dev_free(r->dev, r->grads);
    free(r->b);
    free(r->bt);
    free(r->param_bucket);
    free(r->ready);
    free(r->order);
    free(r->group);
    memset(r, 0, sizeof *r);
}

tdm_status tdm_ddp_reducer_begin(tdm_ddp_reducer *r, uint32_t seq, double loss_sum)
{
    if (r->rebuild_pending) {
        /* before the step's clock starts: its check is a collective */
        tdm_status st = tdm_ddp_rebuild(r);
        if (st) return tdm_ddp_reducer_abort(r, st);
    }
    r->t0 = tdm_time_ns();
    float s[TDM_DDP_TAIL_ELEMS] = {0};
    float hi = (float)loss_sum;
    s[TDM_DDP_TAIL_SEQ + r->rank] = (float)seq;
    s[TDM_DDP_TAIL_LOSS_HI + r->rank] = hi;
    s[TDM_DDP_TAIL_LOSS_LO + r->rank] = (float)(loss_sum - (double)hi);
    TDM_CHECK(tdm_dev_copy_from_host(r->dev, r->grads + r->param_elems, s, sizeof s));
    for (int i = 0; i < r->nb; i++) {
        r->b[i].pending = r->b[i].last - r->b[i].first + 1;
        r->b[i].done = 0;
        r->b[i].launched = 0;
        r->b[i].work = NULL;
        r->bt[i] = (tdm_ddp_bucket_times){0};
    }
    memset(r->ready, 0, (size_t)r->n_params);
    r->n_order = 0;
    r->next_launch = 0;
    r->hook_st = TDM_STATUS_OK;
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_reducer_end(tdm_ddp_reducer *r, uint32_t seq, int had_samples,
                               double *loss_global)
{
    tdm_status st;
    if (r->hook_st) {
        tdm_error_set(r->hook_st, "%s", r->hook_msg);
        return tdm_ddp_reducer_abort(r, r->hook_st);
    }
    /* A parameter whose grad-ready hook did not fire took no part in this
     * step (its layer's backward did not run, or this rank had no
     * samples): this backward added nothing to its gradient, which holds
     * what zero_grad and any no_sync backwards left there (zeros, or the
     * accumulated micro-batches). It is reduced as it stands, never
     * zeroed. Without find_unused_parameters that is an error, unless the
     * rank had no samples at all. */
    for (int p = r->n_params - 1; p >= 0; p--)
        if (!r->ready[p] && (!had_samples || r->o.find_unused_parameters))
            tdm_ddp_mark_ready(r, p);
    for (int i = 0; i < r->nb; i++) {
        if (r->b[i].pending == 0) continue;
        st = tdm_ddp_unready_error(r);
        return tdm_ddp_reducer_abort(r, st);
    }
    if (!r->o.no_overlap) {
        tdm_ddp_launch_ready(r);
        if (r->hook_st) {
            tdm_error_set(r->hook_st, "%s", r->hook_msg);
            return tdm_ddp_reducer_abort(r, r->hook_st);
        }
    }
    TDM_CHECK(tdm_ddp_finish(r));
    st = tdm_ddp_check_tail(r, seq, loss_global);
    if (st) return tdm_ddp_reducer_abort(r, st);
    r->sync_count++;
    if (r->record_order) {
        /* the first synchronised backward: the next one rebuilds */
        r->record_order = 0;
        r->rebuild_pending = r->n_order == r->n_params;
    }
    return TDM_STATUS_OK;
}

double tdm_ddp_reducer_comm_ms(const tdm_ddp_reducer *r)
{
    double lo = 1e300, hi = 0;
    for (int i = 0; i < r->nb; i++) {
        if (r->bt[i].start_ms < lo) lo = r->bt[i].start_ms;
        if (r->bt[i].end_ms > hi) hi = r->bt[i].end_ms;
    }
    return hi > lo ? hi - lo : 0;
}
