/* ddp/ddp.c: the DDP wrapper and its Reducer: construction checks,
 * bucket plan and its rebuild after the first step, grad-ready hook that
 * launches bucket all-reduces in order, end-of-backward wait, the reducer
 * sequence check, no_sync, find_unused_parameters, timings and rank-0
 * checkpoints. Not a launcher and not a communicator: it only calls
 * core/comm.h.
 *
 * Reducer sequence check: the gradient storage holds TDM_DDP_SEQ_ELEMS
 * floats after the parameters, inside the bucket of the last parameter.
 * At each synchronised backward rank r writes the number of training forwards it has run
 * (that backward's forward included) into slot r and zero elsewhere;
 * after the SUM every slot holds its rank's count, so a rank that skipped
 * a backward (or ran an extra step) is named at the end of that same
 * backward instead of silently averaging gradients of different steps. */
#include "ddp/ddp.h"
#include "ddp/spawn.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "models/train.h"

#define TDM_DDP_MAX_RANKS 64
/* After the parameters: per-rank slots of the forward count, then of the
 * rank's loss sum split in two floats (hi + lo: ~48 bits, exact through a
 * SUM where the other ranks contribute zeros). */
#define TDM_DDP_TAIL_SEQ 0
#define TDM_DDP_TAIL_LOSS_HI TDM_DDP_MAX_RANKS
#define TDM_DDP_TAIL_LOSS_LO (2 * TDM_DDP_MAX_RANKS)
#define TDM_DDP_SEQ_ELEMS (3 * TDM_DDP_MAX_RANKS)
#define TDM_DDP_SEQ_MOD (1u << 23)  /* counts stay exact in float32 */

/* Declared in ddp/spawn.h (what a launcher needs); here, next to the
 * layout it sizes. */
size_t tdm_ddp_arena_bytes(int64_t param_elems)
{
    /* the gradients, the check tail after them, and slack */
    return ((size_t)param_elems + TDM_DDP_SEQ_ELEMS) * sizeof(float) + 4096;
}

typedef struct tdm_ddp_bucket {
    int first, last;             /* parameter indices, first <= last */
    int64_t offset, n_elem;      /* view of the gradient buffer */
    int pending;                 /* parameters not yet ready this backward */
    int done;
    tdm_comm_work *work;
} tdm_ddp_bucket;

struct tdm_ddp {
    tdm_model *m;                /* borrowed */
    tdm_comm *comm;              /* borrowed */
    tdm_comm *hcomm;             /* borrowed: host-memory collectives (o.host_comm or comm) */
    tdm_device *dev;             /* borrowed: the model's */
    tdm_ddp_opts o;
    int rank, world, n_params;
    float *grads;                /* param_elems + TDM_DDP_SEQ_ELEMS floats */
    int zero_copy;               /* grads from tdm_comm_alloc (else dev alloc, owned) */
    int64_t param_elems;
    int nb;
    tdm_ddp_bucket *b;
    tdm_ddp_bucket_times *bt;
    int *param_bucket;
    int *order, n_order;         /* parameters in the order they became ready (recording) */
    int *group;                  /* scratch of the planner */
    int record_order;            /* 1: record the ready order in the next synchronised backward */
    int rebuild_pending;         /* 1: re-plan from `order` at the next synchronised backward */
    unsigned char *ready;
    int next_launch;
    int in_backward, sync;
    uint64_t t_bwd0, sync_count, fwd_count;
    int64_t steps_done;       /* optimizer steps: the flight recorder's step */
    double loss_accum, loss_global;  /* this rank's since the last sync; all ranks' */
    tdm_status hook_st;
    char hook_msg[512];
    float *dlogits;
    size_t dlogits_bytes;
    void *x_dev;
    int32_t *y_dev;
    int stage_cap;
    int fwd_batch, have_fwd;
    double fwd_loss;             /* the pending forward's loss sum, added at its backward */
    const char *fwd_lost;        /* why there is no forward to go back through, or NULL */
    tdm_ddp_times times;
};

static uint64_t tdm_ddp_fnv(const void *p, size_t n, uint64_t h)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

static uint64_t tdm_ddp_tensor_hash(const tdm_tensor_info *t)
{
    uint64_t h = tdm_ddp_fnv(t->name, strlen(t->name), 1469598103934665603ull);
    h = tdm_ddp_fnv(&t->ndim, sizeof t->ndim, h);
    h = tdm_ddp_fnv(t->shape, sizeof t->shape[0] * (size_t)t->ndim, h);
    h = tdm_ddp_fnv(&t->offset, sizeof t->offset, h);
    return h;
}

/* ---- bucket plan ---- */

/* PyTorch's bucket_size_limits: first_cap for the first bucket closed,
 * cap for every later one. */
static void tdm_ddp_caps(const tdm_ddp *d, size_t *first_cap, size_t *cap)
{
    *cap = d->o.bucket_cap_bytes ? d->o.bucket_cap_bytes
           : (size_t)((d->o.bucket_cap_mb > 0 ? d->o.bucket_cap_mb : 25.0) * 1048576.0);
    *first_cap = d->o.first_bucket_bytes ? d->o.first_bucket_bytes : 1048576;
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
static int tdm_ddp_set_plan(tdm_ddp *d, const int *order, const int *group, int ng, int reversed)
{
    tdm_model *m = d->m;
    int n = d->n_params;
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
        d->param_bucket[order[i]] = b;
    }
    for (int b = 0; b < ng; b++) {
        d->b[b] = (tdm_ddp_bucket){.first = n, .last = -1};
        d->bt[b] = (tdm_ddp_bucket_times){0};
    }
    for (int p = 0; p < n; p++) {
        tdm_ddp_bucket *bk = &d->b[d->param_bucket[p]];
        if (p < bk->first) bk->first = p;
        if (p > bk->last) bk->last = p;
    }
    for (int b = 0; b < ng; b++) {
        tdm_ddp_bucket *bk = &d->b[b];
        bk->offset = tdm_model_param_info(m, bk->first)->offset;
        /* the bucket holding the last parameter carries the check tail */
        int64_t end = bk->last + 1 < n ? tdm_model_param_info(m, bk->last + 1)->offset
                                       : d->param_elems + TDM_DDP_SEQ_ELEMS;
        bk->n_elem = end - bk->offset;
    }
    d->nb = ng;
    d->times.n_buckets = ng;
    return 1;
}

static void tdm_ddp_log_plan(const tdm_ddp *d, const char *what)
{
    if (!tdm_log_enabled(TDM_LOG_LEVEL_INFO, TDM_LOG_DDP)) return;
    size_t first_cap, cap;
    tdm_ddp_caps(d, &first_cap, &cap);
    TDM_INFO(DDP, "bucket plan (%s): %d bucket(s), cap %zu bytes, first bucket cap %zu bytes",
             what, d->nb, cap, first_cap);
    for (int i = 0; i < d->nb; i++) {
        const tdm_ddp_bucket *bk = &d->b[i];
        TDM_INFO(DDP, "  bucket %d: %lld elements at offset %lld, parameters %d..%d (%s .. %s)", i,
                 (long long)bk->n_elem, (long long)bk->offset, bk->first, bk->last,
                 tdm_model_param_info(d->m, bk->first)->name,
                 tdm_model_param_info(d->m, bk->last)->name);
    }
}

/* The construction plan, as PyTorch's DDP makes it. Without
 * find_unused_parameters: one bucket for the first synchronised backward
 * (PyTorch's [sys.maxsize] limit: the order gradients become ready is not
 * known yet), which records that order; the next one rebuilds the plan
 * from it (tdm_ddp_rebuild). With it: the limits walked in parameter
 * (definition) order, the groups reversed so that bucket 0 holds the last
 * parameters, never rebuilt (the used set may change from step to step). */
static tdm_status tdm_ddp_plan(tdm_ddp *d)
{
    int n = d->n_params;
    d->b = calloc((size_t)n, sizeof *d->b);
    d->bt = calloc((size_t)n, sizeof *d->bt);
    d->param_bucket = calloc((size_t)n, sizeof *d->param_bucket);
    d->ready = calloc((size_t)n, 1);
    d->order = calloc((size_t)n, sizeof *d->order);
    d->group = calloc((size_t)n, sizeof *d->group);
    if (!d->b || !d->bt || !d->param_bucket || !d->ready || !d->order || !d->group)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ddp: bucket plan for %d parameters", n);
    size_t first_cap, cap;
    tdm_ddp_caps(d, &first_cap, &cap);
    for (int p = 0; p < n; p++) d->order[p] = p;
    int ng = d->o.find_unused_parameters
                 ? tdm_ddp_assign(d->m, d->order, n, first_cap, cap, d->group)
                 : tdm_ddp_assign(d->m, d->order, n, SIZE_MAX, SIZE_MAX, d->group);
    (void)tdm_ddp_set_plan(d, d->order, d->group, ng, 1);  /* parameter order: always ranges */
    d->record_order = !d->o.find_unused_parameters;
    tdm_ddp_log_plan(d, d->record_order ? "first step" : "find_unused_parameters");
    return TDM_STATUS_OK;
}

static uint64_t tdm_ddp_plan_hash(const tdm_ddp *d)
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < d->nb; i++) {
        int64_t v[3] = {d->b[i].first, d->b[i].last, d->b[i].offset};
        h = tdm_ddp_fnv(v, sizeof v, h);
    }
    return h;
}

/* ---- construction checks ---- */

enum { TDM_DDP_SUM_NPARAMS, TDM_DDP_SUM_PELEMS, TDM_DDP_SUM_NBUF, TDM_DDP_SUM_BELEMS,
       TDM_DDP_SUM_PLAN, TDM_DDP_SUM_NBUCKETS, TDM_DDP_SUM_ZC, TDM_DDP_SUM_N };

static tdm_status tdm_ddp_verify(tdm_ddp *d)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_model *m = d->m;
    int W = d->world, nbuf = tdm_model_n_buffers(m);
    int64_t mine[TDM_DDP_SUM_N] = {
        [TDM_DDP_SUM_NPARAMS] = d->n_params, [TDM_DDP_SUM_PELEMS] = d->param_elems,
        [TDM_DDP_SUM_NBUF] = nbuf, [TDM_DDP_SUM_BELEMS] = tdm_model_buffer_elems(m),
        [TDM_DDP_SUM_PLAN] = (int64_t)tdm_ddp_plan_hash(d), [TDM_DDP_SUM_NBUCKETS] = d->nb,
        [TDM_DDP_SUM_ZC] = d->zero_copy};
    int64_t *all = calloc((size_t)W * TDM_DDP_SUM_N, sizeof *all);
    int64_t *tens = NULL;
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
    memcpy(all + (size_t)d->rank * TDM_DDP_SUM_N, mine, sizeof mine);
    TDM_TRY(tdm_comm_all_gather(d->hcomm, all + (size_t)d->rank * TDM_DDP_SUM_N, all,
                                TDM_DDP_SUM_N, TDM_DTYPE_INT64));
    for (int r = 1; r < W; r++) {
        const int64_t *a = all, *b = all + (size_t)r * TDM_DDP_SUM_N;
        /* equal counts: the per-tensor comparison below names the tensor */
        if (a[TDM_DDP_SUM_NPARAMS] != b[TDM_DDP_SUM_NPARAMS] ||
            a[TDM_DDP_SUM_NBUF] != b[TDM_DDP_SUM_NBUF]) {
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "ddp: model layout differs between ranks: rank 0 has %lld "
                               "parameter tensors (%lld elements) and %lld buffers (%lld "
                               "elements), rank %d has %lld (%lld) and %lld (%lld); every rank "
                               "must build the same model",
                               (long long)a[0], (long long)a[1], (long long)a[2], (long long)a[3],
                               r, (long long)b[0], (long long)b[1], (long long)b[2],
                               (long long)b[3]);
            goto fail;
        }
    }
    /* Same counts everywhere: compare per-tensor (hash, n_elem). */
    int nt = d->n_params + nbuf;
    tens = calloc((size_t)W * (size_t)nt * 2, sizeof *tens);
    if (!tens) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
        goto fail;
    }
    int64_t *own = tens + (size_t)d->rank * nt * 2;
    for (int i = 0; i < nt; i++) {
        const tdm_tensor_info *t = i < d->n_params ? tdm_model_param_info(m, i)
                                                   : tdm_model_buffer_info(m, i - d->n_params);
        own[2 * i] = (int64_t)tdm_ddp_tensor_hash(t);
        own[2 * i + 1] = t->n_elem;
    }
    TDM_TRY(tdm_comm_all_gather(d->hcomm, own, tens, (size_t)nt * 2, TDM_DTYPE_INT64));
    for (int r = 1; r < W; r++) {
        for (int i = 0; i < nt; i++) {
            const int64_t *a = tens + 2 * i, *b = tens + ((size_t)r * nt + i) * 2;
            if (a[0] == b[0] && a[1] == b[1]) continue;
            int is_p = i < d->n_params;
            const tdm_tensor_info *t = is_p ? tdm_model_param_info(m, i)
                                            : tdm_model_buffer_info(m, i - d->n_params);
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "ddp: %s %d differs between ranks: rank 0's has %lld elements, "
                               "rank %d's has %lld (name, shape or offset differ; here, on rank "
                               "%d, it is '%s'); every rank must build the same model",
                               is_p ? "parameter" : "buffer", is_p ? i : i - d->n_params,
                               (long long)a[1], r, (long long)b[1], d->rank, t->name);
            goto fail;
        }
    }
    for (int r = 1; r < W; r++) {
        const int64_t *a = all, *b = all + (size_t)r * TDM_DDP_SUM_N;
        if (a[TDM_DDP_SUM_PLAN] != b[TDM_DDP_SUM_PLAN] || a[TDM_DDP_SUM_ZC] != b[TDM_DDP_SUM_ZC]) {
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "ddp: bucket plan differs between ranks: rank 0 planned %lld "
                               "bucket(s)%s, rank %d %lld%s; use the same bucket cap (and "
                               "communicator arena) on every rank",
                               (long long)a[TDM_DDP_SUM_NBUCKETS],
                               a[TDM_DDP_SUM_ZC] ? " (zero-copy)" : "", r,
                               (long long)b[TDM_DDP_SUM_NBUCKETS],
                               b[TDM_DDP_SUM_ZC] ? " (zero-copy)" : "");
            goto fail;
        }
    }
fail:
    free(all);
    free(tens);
    return st;
}

/* PyTorch's rebuild_buckets: after the first synchronised backward, the
 * plan is made again with the limits over the order its gradients became
 * ready (tandem's models finish parameters from the last to the first, so
 * this is the reverse parameter order unless a model says otherwise).
 * Every rank must get the same plan: one all_gather of plan hashes (where
 * PyTorch broadcasts rank 0's plan) names a rank that differs. */
static tdm_status tdm_ddp_rebuild(tdm_ddp *d)
{
    int n = d->n_params, W = d->world;
    size_t first_cap, cap;
    d->rebuild_pending = 0;
    tdm_ddp_caps(d, &first_cap, &cap);
    int ng = tdm_ddp_assign(d->m, d->order, n, first_cap, cap, d->group);
    if (!tdm_ddp_set_plan(d, d->order, d->group, ng, 0)) {
        /* a bucket of parameters that are not neighbours in the flat
         * buffer could not be a view of it */
        TDM_WARN(DDP, "rank %d: gradients became ready out of parameter order (parameter %d "
                 "first): buckets planned in reverse parameter order instead", d->rank,
                 d->order[0]);
        for (int i = 0; i < n; i++) d->order[i] = n - 1 - i;
        ng = tdm_ddp_assign(d->m, d->order, n, first_cap, cap, d->group);
        (void)tdm_ddp_set_plan(d, d->order, d->group, ng, 0);
    }
    tdm_ddp_log_plan(d, "rebuilt in the order gradients became ready");
    int64_t *all = calloc((size_t)W * 2, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
    all[2 * d->rank] = (int64_t)tdm_ddp_plan_hash(d);
    all[2 * d->rank + 1] = d->nb;
    tdm_comm_set_label(d->hcomm, "ddp bucket plan check");
    tdm_status st = tdm_comm_all_gather(d->hcomm, all + 2 * d->rank, all, 2, TDM_DTYPE_INT64);
    if (st) {
        tdm_error_prefix(st, "ddp: checking the rebuilt bucket plan");
    } else {
        for (int r = 1; r < W; r++) {
            if (all[2 * r] == all[0]) continue;
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "ddp: bucket plan rebuilt after the first step differs between "
                               "ranks: rank 0 planned %lld bucket(s), rank %d planned %lld "
                               "(here, on rank %d, %d); every rank must use the same bucket caps and a "
                               "model whose backward produces gradients in the same order",
                               (long long)all[1], r, (long long)all[2 * r + 1], d->rank, d->nb);
            break;
        }
    }
    free(all);
    return st;
}

/* ---- hook and bucket launches ---- */

static double tdm_ddp_rel_ms(const tdm_ddp *d) { return tdm_time_ms_since(d->t_bwd0); }

static void tdm_ddp_hook_fail(tdm_ddp *d, tdm_status st)
{
    if (d->hook_st) return;
    d->hook_st = st;
    snprintf(d->hook_msg, sizeof d->hook_msg, "%s", tdm_error_message());
}

/* Launches every complete bucket from next_launch on, in bucket order,
 * asynchronously (the progress thread runs it while backward goes on).
 * The last bucket holds the parameters backward finishes last (the first
 * layer's): nothing is left to overlap it with, so it is never
 * launched here but run on this thread by tdm_ddp_finish (saving the two
 * thread wake-ups an asynchronous call costs). */
static void tdm_ddp_launch_ready(tdm_ddp *d)
{
    while (d->next_launch < d->nb - 1 && !d->hook_st && d->b[d->next_launch].pending == 0) {
        tdm_ddp_bucket *bk = &d->b[d->next_launch];
        float *v = d->grads + bk->offset;
        d->bt[d->next_launch].start_ms = tdm_ddp_rel_ms(d);
        tdm_comm_set_label(d->comm, "ddp bucket %d", d->next_launch);
        tdm_status st = tdm_comm_all_reduce_async(d->comm, v, v, (size_t)bk->n_elem,
                                                  TDM_DTYPE_FLOAT32, TDM_REDOP_SUM, &bk->work);
        if (st) {
            tdm_error_prefix(st, "ddp: bucket %d all_reduce", d->next_launch);
            tdm_ddp_hook_fail(d, st);
            return;
        }
        if (d->in_backward) d->times.overlapped_bytes_total += (double)bk->n_elem * 4.0;
        d->next_launch++;
    }
}

/* Notes completion times of launched buckets (never blocks). */
static void tdm_ddp_poll(tdm_ddp *d)
{
    for (int i = 0; i < d->next_launch; i++) {
        if (d->b[i].done || !d->b[i].work) continue;
        int done = 0;
        if (tdm_comm_work_test(d->b[i].work, &done) != TDM_STATUS_OK || !done) return;
        d->b[i].done = 1;
        d->bt[i].end_ms = tdm_ddp_rel_ms(d);
    }
}

static void tdm_ddp_mark_ready(tdm_ddp *d, int p)
{
    if (d->ready[p]) return;
    d->ready[p] = 1;
    if (d->record_order) d->order[d->n_order++] = p;
    int bi = d->param_bucket[p];
    if (--d->b[bi].pending == 0) d->bt[bi].ready_ms = tdm_ddp_rel_ms(d);
}

static void tdm_ddp_hook(void *ctx, tdm_model *m, int first, int last)
{
    tdm_ddp *d = ctx;
    (void)m;
    if (!d->in_backward || !d->sync) return;
    for (int p = last; p >= first; p--) tdm_ddp_mark_ready(d, p);
    if (!d->o.no_overlap) tdm_ddp_launch_ready(d);
    tdm_ddp_poll(d);
}

/* Waits for every launched bucket in order, each bounded by
 * opts.timeout_ms when set and always by the communicator's deadline; on
 * the first failure aborts the communicator (so the other ranks stop too)
 * and still drains the rest, 10 s at most each. */
static tdm_status tdm_ddp_drain(tdm_ddp *d)
{
    tdm_status st = TDM_STATUS_OK;
    char msg[768] = "";
    int64_t to = d->o.timeout_ms > 0 ? d->o.timeout_ms : -1;
    for (int i = 0; i < d->nb; i++) {
        tdm_ddp_bucket *bk = &d->b[i];
        if (!bk->work) continue;
        /* Completion usually comes within microseconds: poll (yielding
         * the core to the progress thread) before sleeping on it. */
        uint64_t spin_end = tdm_time_ns() + 200000;
        int done = 0;
        while (!st && tdm_comm_work_test(bk->work, &done) == TDM_STATUS_OK && !done &&
               tdm_time_ns() < spin_end)
            sched_yield();
        tdm_status s = tdm_comm_work_wait(bk->work, st ? 10000 : to);
        if (!bk->done) d->bt[i].end_ms = tdm_ddp_rel_ms(d);
        bk->done = 1;
        if (s && !st) {
            st = s;
            snprintf(msg, sizeof msg, "ddp: backward #%" PRIu64 ": all_reduce of bucket %d "
                     "(%lld elements, parameters %d..%d): %s", d->sync_count, i,
                     (long long)bk->n_elem, bk->first, bk->last, tdm_error_message());
            tdm_comm_abort(d->comm, msg);
        }
        /* freeing a still-running work is allowed: it completes in the
         * background (core/comm.h), and the communicator is aborted */
        tdm_comm_work_free(bk->work);
        bk->work = NULL;
    }
    if (st) tdm_error_set(st, "%s", msg);
    return st;
}

static tdm_status tdm_ddp_fail_abort(tdm_ddp *d, tdm_status st)
{
    char msg[768];
    snprintf(msg, sizeof msg, "%s", tdm_error_message());
    tdm_comm_abort(d->comm, msg);
    (void)tdm_ddp_drain(d);
    return tdm_error_set(st, "%s", msg);
}

/* ---- public API ---- */

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
    d->n_params = tdm_model_n_params(m);
    d->param_elems = tdm_model_param_elems(m);
    d->sync = 1;
    TDM_TRY(tdm_ddp_plan(d));
    size_t gbytes = (size_t)(d->param_elems + TDM_DDP_SEQ_ELEMS) * sizeof(float);
    if (tdm_comm_alloc(comm, gbytes, (void **)&d->grads) == TDM_STATUS_OK) {
        d->zero_copy = 1;
    } else {
        TDM_INFO(DDP, "gradients not in communicator memory (%s): all-reduce will copy",
                 tdm_error_message());
        tdm_error_clear();
        d->grads = NULL;
        TDM_TRY(tdm_dev_alloc(d->dev, gbytes, (void **)&d->grads));
    }
    TDM_TRY(d->dev->ops->memset_zero(d->dev, d->grads, gbytes));
    TDM_TRY(tdm_ddp_verify(d));
    tdm_comm_set_label(comm, "ddp broadcast parameters");
    TDM_TRY(tdm_comm_broadcast(comm, tdm_model_params(m), tdm_model_params(m),
                               (size_t)d->param_elems, TDM_DTYPE_FLOAT32, 0));
    if (tdm_model_buffer_elems(m) > 0)
        TDM_TRY(tdm_comm_broadcast(comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                   (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0));
    TDM_TRY(tdm_model_set_grad_storage(m, d->grads));
    tdm_model_set_grad_hook(m, tdm_ddp_hook, d);
    d->times.buckets = d->bt;
    TDM_INFO(DDP, "rank %d of %d: %lld parameters in %d bucket(s), %s, overlap %s", d->rank,
             d->world, (long long)d->param_elems, d->nb, d->zero_copy ? "zero-copy" : "copying",
             d->o.no_overlap ? "off" : "on");
    *out = d;
    return TDM_STATUS_OK;
fail:
    /* tdm_ddp_free undoes any prefix of the above: no work is in flight,
     * and giving back grad storage the model still owns is a no-op. */
    tdm_ddp_free(d);
    return st;
}

void tdm_ddp_free(tdm_ddp *d)
{
    if (!d) return;
    for (int i = 0; i < d->nb; i++) {
        if (d->b[i].work) (void)tdm_comm_work_wait(d->b[i].work, 10000);
        tdm_comm_work_free(d->b[i].work);
    }
    tdm_model_set_grad_hook(d->m, NULL, NULL);
    (void)tdm_model_set_grad_storage(d->m, NULL);
    if (!d->zero_copy) tdm_dev_free(d->dev, d->grads);
    tdm_dev_free(d->dev, d->dlogits);
    tdm_dev_free(d->dev, d->x_dev);
    tdm_dev_free(d->dev, d->y_dev);
    free(d->b);
    free(d->bt);
    free(d->param_bucket);
    free(d->ready);
    free(d->order);
    free(d->group);
    free(d);
}

tdm_model *tdm_ddp_model(tdm_ddp *d) { return d->m; }
tdm_comm *tdm_ddp_comm(tdm_ddp *d) { return d->comm; }
int tdm_ddp_n_buckets(const tdm_ddp *d) { return d->nb; }
int tdm_ddp_zero_copy(const tdm_ddp *d) { return d->zero_copy; }

void tdm_ddp_bucket_info(const tdm_ddp *d, int b, int *first_param, int *last_param,
                         int64_t *offset, int64_t *n_elem)
{
    const tdm_ddp_bucket *bk = &d->b[b];
    if (first_param) *first_param = bk->first;
    if (last_param) *last_param = bk->last;
    if (offset) *offset = bk->offset;
    if (n_elem) *n_elem = bk->n_elem;
}

tdm_status tdm_ddp_zero_grad(tdm_ddp *d) { return tdm_model_zero_grad(d->m); }

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
        tdm_status st = tdm_comm_broadcast(d->comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                           (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0);
        if (st) return tdm_error_prefix(st, "ddp evaluate: broadcast of buffers from rank 0");
    }
    int64_t lo = test->n * d->rank / d->world, hi = test->n * (d->rank + 1) / d->world;
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

void tdm_ddp_no_sync(tdm_ddp *d, int enable) { d->sync = !enable; }

static tdm_status tdm_ddp_stage(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                const void **xd, const int32_t **yd)
{
    if (d->dev->kind == TDM_DEVICE_HOST) {
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
        TDM_CHECK(tdm_dev_alloc(d->dev, (size_t)batch * rows * sizeof(int32_t), (void **)&d->y_dev));
        d->stage_cap = batch;
    }
    TDM_CHECK(d->dev->ops->copy_from_host(d->dev, d->x_dev, x, (size_t)batch * feat * sizeof(float)));
    TDM_CHECK(d->dev->ops->copy_from_host(d->dev, d->y_dev, y, (size_t)batch * rows * sizeof(int32_t)));
    *xd = d->x_dev;
    *yd = d->y_dev;
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_forward_scaled(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                                  float grad_scale, double *loss_sum)
{
    TDM_REQUIRE(batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "ddp forward: bad batch %d or NULL input", batch);
    uint64_t t0 = tdm_time_ns();
    tdm_model *m = d->m;
    d->have_fwd = 0;
    d->fwd_lost = NULL;
    if (tdm_model_is_train(m) && !d->o.no_broadcast_buffers && d->world > 1 &&
        tdm_model_buffer_elems(m) > 0) {
        tdm_status st = tdm_comm_broadcast(d->comm, tdm_model_buffers(m), tdm_model_buffers(m),
                                           (size_t)tdm_model_buffer_elems(m), TDM_DTYPE_FLOAT32, 0);
        if (st) return tdm_error_prefix(st, "ddp forward: broadcast of buffers from rank 0");
    }
    double ls = 0.0;
    uint64_t t1 = t0;
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

tdm_status tdm_ddp_forward(tdm_ddp *d, const void *x, const int32_t *y, int batch,
                           double *loss_mean)
{
    double ls = 0.0;
    float scale = batch > 0 ? 1.0f / ((float)batch * (float)d->world) : 0.0f;
    TDM_CHECK(tdm_ddp_forward_scaled(d, x, y, batch, scale, &ls));
    if (loss_mean) *loss_mean = batch > 0 ? ls / batch : 0.0;
    return TDM_STATUS_OK;
}

static tdm_status tdm_ddp_unready_error(tdm_ddp *d)
{
    char list[384] = "";
    size_t len = 0;
    int n = 0;
    for (int p = 0; p < d->n_params; p++) {
        if (d->ready[p]) continue;
        if (n < 8 && len < sizeof list - 64)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s'%s' (%d)", n ? ", " : "",
                                    tdm_model_param_info(d->m, p)->name, p);
        n++;
    }
    return tdm_error_set(TDM_STATUS_MISMATCH,
                         "ddp: backward #%" PRIu64 " on rank %d produced no gradient for %d "
                         "parameter(s): %s%s; their buckets could not be reduced. Construct "
                         "DDP with find_unused_parameters=1 if parameters may take no part in "
                         "a step", d->sync_count, d->rank, n, list, n > 8 ? ", ..." : "");
}

/* Reads the reduced tail: names a rank whose forward count differs, and
 * sums the ranks' loss sums (rank order, double). */
static tdm_status tdm_ddp_check_tail(tdm_ddp *d, uint32_t mine)
{
    float s[TDM_DDP_SEQ_ELEMS];
    TDM_CHECK(d->dev->ops->copy_to_host(d->dev, s, d->grads + d->param_elems, sizeof s));
    double loss = 0.0;
    for (int r = 0; r < d->world; r++) {
        loss += (double)s[TDM_DDP_TAIL_LOSS_HI + r] + (double)s[TDM_DDP_TAIL_LOSS_LO + r];
        if (s[TDM_DDP_TAIL_SEQ + r] == (float)mine) continue;
        return tdm_error_set(TDM_STATUS_MISMATCH,
                             "ddp: collective sequence mismatch: rank %d reduced the "
                             "gradients of its training forward #%lld together with rank %d's "
                             "forward #%" PRIu32 " (a rank skipped a backward or ran a "
                             "different number of steps)",
                             r, (long long)s[TDM_DDP_TAIL_SEQ + r] - 1, d->rank, mine - 1);
    }
    d->loss_global = loss;
    return TDM_STATUS_OK;
}

/* End of a synchronised backward: wait for the asynchronous buckets, run
 * the rest here, in bucket order. */
static tdm_status tdm_ddp_finish(tdm_ddp *d)
{
    TDM_CHECK(tdm_ddp_drain(d));
    for (int i = d->next_launch; i < d->nb; i++) {
        tdm_ddp_bucket *bk = &d->b[i];
        float *v = d->grads + bk->offset;
        d->bt[i].start_ms = tdm_ddp_rel_ms(d);
        tdm_status st;
        tdm_comm_set_label(d->comm, "ddp bucket %d", i);
        if (d->o.timeout_ms > 0) {
            /* bounded by opts.timeout_ms like the asynchronous buckets */
            tdm_comm_work *w = NULL;
            st = tdm_comm_all_reduce_async(d->comm, v, v, (size_t)bk->n_elem, TDM_DTYPE_FLOAT32,
                                           TDM_REDOP_SUM, &w);
            if (st == TDM_STATUS_OK) st = tdm_comm_work_wait(w, d->o.timeout_ms);
            tdm_comm_work_free(w);
        } else {
            st = tdm_comm_all_reduce(d->comm, v, v, (size_t)bk->n_elem, TDM_DTYPE_FLOAT32,
                                     TDM_REDOP_SUM);
        }
        d->bt[i].end_ms = tdm_ddp_rel_ms(d);
        if (st) {
            char msg[768];
            snprintf(msg, sizeof msg, "ddp: backward #%" PRIu64 ": all_reduce of bucket %d "
                     "(%lld elements, parameters %d..%d): %s", d->sync_count, i,
                     (long long)bk->n_elem, bk->first, bk->last, tdm_error_message());
            tdm_comm_abort(d->comm, msg);
            return tdm_error_set(st, "%s", msg);
        }
        d->next_launch = i + 1;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_backward(tdm_ddp *d)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(d->have_fwd || !d->fwd_lost, TDM_STATUS_INVALID_ARG,
                "ddp backward: %s; call tdm_ddp_forward again before backward", d->fwd_lost);
    TDM_REQUIRE(d->have_fwd, TDM_STATUS_INVALID_ARG, "ddp backward: no forward before it");
    d->have_fwd = 0;
    d->loss_accum += d->fwd_loss;
    tdm_model *m = d->m;
    int sync = d->sync;
    uint32_t seq = (uint32_t)(d->fwd_count % TDM_DDP_SEQ_MOD) + 1;
    if (sync && d->rebuild_pending) {
        /* once, before the step's clock starts: its check is a collective */
        st = tdm_ddp_rebuild(d);
        if (st) return tdm_ddp_fail_abort(d, st);
    }
    d->t_bwd0 = tdm_time_ns();
    if (sync) {
        float s[TDM_DDP_SEQ_ELEMS] = {0};
        float hi = (float)d->loss_accum;
        s[TDM_DDP_TAIL_SEQ + d->rank] = (float)seq;
        s[TDM_DDP_TAIL_LOSS_HI + d->rank] = hi;
        s[TDM_DDP_TAIL_LOSS_LO + d->rank] = (float)(d->loss_accum - (double)hi);
        d->loss_accum = 0.0;
        TDM_CHECK(d->dev->ops->copy_from_host(d->dev, d->grads + d->param_elems, s, sizeof s));
        for (int i = 0; i < d->nb; i++) {
            d->b[i].pending = d->b[i].last - d->b[i].first + 1;
            d->b[i].done = 0;
            d->b[i].work = NULL;
            d->bt[i] = (tdm_ddp_bucket_times){0};
        }
        memset(d->ready, 0, (size_t)d->n_params);
        d->n_order = 0;
        d->next_launch = 0;
        d->hook_st = TDM_STATUS_OK;
    }
    if (d->fwd_batch > 0) {
        d->in_backward = 1;
        st = tdm_model_backward(m, d->dlogits);
        d->in_backward = 0;
        if (st) return sync ? tdm_ddp_fail_abort(d, st) : st;
    }
    uint64_t t1 = tdm_time_ns();
    if (!sync) {
        d->times.last.ms[TDM_PHASE_BACKWARD] = (double)(t1 - d->t_bwd0) * 1e-6;
        d->times.last.ms[TDM_PHASE_ALLREDUCE_WAIT] = 0;
        d->times.total.ms[TDM_PHASE_BACKWARD] += d->times.last.ms[TDM_PHASE_BACKWARD];
        return TDM_STATUS_OK;
    }
    if (d->hook_st) {
        tdm_error_set(d->hook_st, "%s", d->hook_msg);
        return tdm_ddp_fail_abort(d, d->hook_st);
    }
    /* A parameter whose grad-ready hook did not fire took no part in this
     * step (its layer's backward did not run, or this rank had no
     * samples): this backward added nothing to its gradient, which holds
     * what zero_grad and any no_sync backwards left there (zeros, or the
     * accumulated micro-batches). It is reduced as it stands, never
     * zeroed. Without find_unused_parameters that is an error, unless the
     * rank had no samples at all. */
    for (int p = d->n_params - 1; p >= 0; p--)
        if (!d->ready[p] && (d->fwd_batch == 0 || d->o.find_unused_parameters))
            tdm_ddp_mark_ready(d, p);
    for (int i = 0; i < d->nb; i++) {
        if (d->b[i].pending == 0) continue;
        st = tdm_ddp_unready_error(d);
        return tdm_ddp_fail_abort(d, st);
    }
    if (!d->o.no_overlap) {
        tdm_ddp_launch_ready(d);
        if (d->hook_st) {
            tdm_error_set(d->hook_st, "%s", d->hook_msg);
            return tdm_ddp_fail_abort(d, d->hook_st);
        }
    }
    TDM_CHECK(tdm_ddp_finish(d));
    st = tdm_ddp_check_tail(d, seq);
    if (st) return tdm_ddp_fail_abort(d, st);
    uint64_t t2 = tdm_time_ns();
    d->sync_count++;
    if (d->record_order) {
        /* the first synchronised backward: the next one rebuilds */
        d->record_order = 0;
        d->rebuild_pending = d->n_order == d->n_params;
    }
    double comm_lo = 1e300, comm_hi = 0;
    for (int i = 0; i < d->nb; i++) {
        if (d->bt[i].start_ms < comm_lo) comm_lo = d->bt[i].start_ms;
        if (d->bt[i].end_ms > comm_hi) comm_hi = d->bt[i].end_ms;
    }
    d->times.comm_ms_last = comm_hi > comm_lo ? comm_hi - comm_lo : 0;
    d->times.comm_ms_total += d->times.comm_ms_last;
    d->times.reduced_bytes_total += (double)(d->param_elems + TDM_DDP_SEQ_ELEMS) * 4.0;
    d->times.last.ms[TDM_PHASE_BACKWARD] = (double)(t1 - d->t_bwd0) * 1e-6;
    d->times.last.ms[TDM_PHASE_ALLREDUCE_WAIT] = (double)(t2 - t1) * 1e-6;
    d->times.total.ms[TDM_PHASE_BACKWARD] += d->times.last.ms[TDM_PHASE_BACKWARD];
    d->times.total.ms[TDM_PHASE_ALLREDUCE_WAIT] += d->times.last.ms[TDM_PHASE_ALLREDUCE_WAIT];
    d->times.exposed_ms_total = d->times.total.ms[TDM_PHASE_ALLREDUCE_WAIT];
    d->times.steps++;
    return TDM_STATUS_OK;
}

double tdm_ddp_loss_sum(const tdm_ddp *d) { return d->loss_global; }

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
    TDM_CHECK(tdm_comm_broadcast(d->hcomm, &ok, &ok, 1, TDM_DTYPE_INT32, 0));
    if (mine) return tdm_error_set(mine, "%s", msg);
    TDM_REQUIRE(ok, TDM_STATUS_IO, "ddp: rank 0 failed to save the checkpoint %s", path);
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_checkpoint_load(tdm_ddp *d, const char *path, tdm_optim *opt,
                                   tdm_ckpt_info *info)
{
    TDM_CHECK(tdm_comm_barrier(d->hcomm));
    tdm_status mine = tdm_checkpoint_load(path, d->m, opt, info);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mine ? tdm_error_message() : "");
    int32_t *all = calloc((size_t)d->world, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "ddp: calloc");
    all[d->rank] = (int32_t)mine;
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
