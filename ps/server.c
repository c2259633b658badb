/* ps/server.c: a parameter server's shard: its parameters, its
 * optimizer, the pull/push/done functions that workers call over rpc/,
 * and the gradient slots that sync and bounded:K sum in worker order.
 * Wire (host order): pull {i64 min_version} -> {i64 version, i64 ready}
 * [+ the shard's floats when ready]; push {i32 worker, i32 0, i64 clock,
 * i64 version_used} + the shard's gradient; done {i32 worker}; fail
 * {i32 worker, i32 0} + the worker's error message.
 * Not the worker's side: ps/worker.c. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/log.h"
#include "core/timer.h"
#include "ps/ps_impl.h"

/* How often a waiting server looks at its workers' liveness. */
#define PS_SERVER_CHECK_MS 20

typedef struct ps_slot {
    int64_t clock;                /* -1: free */
    int count;
    int have[TDM_PS_MAX_WORKERS];
    int64_t used[TDM_PS_MAX_WORKERS];   /* the version each gradient was computed on */
    float *grads;                 /* workers x n */
} ps_slot;

struct tdm_ps_server {
    tdm_rpc *rpc;                 /* borrowed */
    tdm_device *dev;              /* borrowed */
    tdm_ps_layout l;
    tdm_ps_sync_mode mode;
    int index;
    int64_t lo, hi, n;
    float *params;                /* n */
    float *acc;                   /* n: the sum being applied */
    tdm_optim *opt;
    int nslots;
    ps_slot *slots;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    tdm_ps_server_stats st;
    int done[TDM_PS_MAX_WORKERS];
    int lost[TDM_PS_MAX_WORKERS];
    int64_t pushed[TDM_PS_MAX_WORKERS];   /* per worker: steps pushed */
    char failed[512];             /* a push that could not be applied */
};

void tdm_ps_shard(const tdm_ps_layout *l, int s, int64_t *lo, int64_t *hi)
{
    int64_t base = l->n_elem / l->servers, extra = l->n_elem % l->servers;
    *lo = s * base + (s < extra ? s : extra);
    *hi = *lo + base + (s < extra ? 1 : 0);
}

static void count_stale(tdm_ps_server *s, int64_t stale)
{
    if (stale < 0) stale = 0;
    int b = stale >= TDM_PS_STALE_BUCKETS - 1 ? TDM_PS_STALE_BUCKETS - 1 : (int)stale;
    s->st.stale[b]++;
}

/* One optimizer step of the shard with acc (mu held). */
static tdm_status apply(tdm_ps_server *s, const float *grad)
{
    tdm_optim_range r = {.param = s->params, .grad = grad, .state_offset = 0, .n_elem = s->n};
    TDM_CHECK(tdm_optim_step_ranges(s->opt, &r, 1));
    s->st.version++;
    pthread_cond_broadcast(&s->cv);
    return TDM_STATUS_OK;
}

/* sync and bounded: applies every complete step in clock order (mu held).
 * The sum runs over the workers in index order whatever order their
 * pushes came in: the same bits every run. */
static tdm_status apply_ready(tdm_ps_server *s)
{
    for (;;) {
        ps_slot *sl = &s->slots[s->st.version % s->nslots];
        if (sl->clock != s->st.version || sl->count < s->l.workers) return TDM_STATUS_OK;
        int W = s->l.workers;
        memcpy(s->acc, sl->grads, (size_t)s->n * sizeof(float));
        for (int w = 1; w < W; w++) {
            const float *g = sl->grads + (size_t)w * (size_t)s->n;
            for (int64_t i = 0; i < s->n; i++) s->acc[i] += g[i];
        }
        for (int w = 0; w < W; w++) count_stale(s, s->st.version - sl->used[w]);
        sl->clock = -1;
        sl->count = 0;
        memset(sl->have, 0, sizeof sl->have);
        TDM_CHECK(apply(s, s->acc));
    }
}

static tdm_status fn_pull(tdm_rpc_req *req, void *ctx)
{
    tdm_ps_server *s = ctx;
    int64_t min = 0;
    if (req->nbytes != sizeof min)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "ps.pull: %zu bytes (expected 8)", req->nbytes);
    memcpy(&min, req->args, sizeof min);
    pthread_mutex_lock(&s->mu);
    int ready = s->st.version >= min;
    s->st.pulls++;
    if (!ready) s->st.pulls_early++;
    int64_t *out = NULL;
    size_t nbytes = 2 * sizeof(int64_t) + (ready ? (size_t)s->n * sizeof(float) : 0);
    tdm_status st = tdm_rpc_req_reply(req, nbytes, (void **)&out);
    if (st == TDM_STATUS_OK) {
        out[0] = s->st.version;
        out[1] = ready;
        if (ready) memcpy(out + 2, s->params, (size_t)s->n * sizeof(float));
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

static tdm_status fn_push(tdm_rpc_req *req, void *ctx)
{
    tdm_ps_server *s = ctx;
    tdm_ps_push_hdr h;
    size_t want = sizeof h + (size_t)s->n * sizeof(float);
    if (req->nbytes != want)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "ps.push: %zu bytes (expected %zu for a shard of %lld)",
                                req->nbytes, want, (long long)s->n);
    memcpy(&h, req->args, sizeof h);
    if (h.worker < 0 || h.worker >= s->l.workers)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "ps.push: worker %d of %d", h.worker, s->l.workers);
    const float *g = (const float *)((const uint8_t *)req->args + sizeof h);
    tdm_status st = TDM_STATUS_OK;
    pthread_mutex_lock(&s->mu);
    s->st.pushes++;
    int64_t slowest = h.clock;
    for (int w = 0; w < s->l.workers; w++)
        if (s->pushed[w] < slowest) slowest = s->pushed[w];
    if (h.clock - slowest > s->st.clock_gap_max) s->st.clock_gap_max = h.clock - slowest;
    if (h.clock + 1 > s->pushed[h.worker]) s->pushed[h.worker] = h.clock + 1;
    if (s->mode.kind == TDM_PS_ASYNC) {
        count_stale(s, s->st.version - h.version_used);
        st = apply(s, g);
    } else {
        /* a worker at clock c pulled a version >= c - K, so every clock
         * below c - K is applied and c lies within nslots of version */
        if (h.clock < s->st.version || h.clock >= s->st.version + s->nslots) {
            st = tdm_rpc_req_fail(req, TDM_STATUS_INTERNAL,
                                  "ps.push: worker %d's clock %lld is outside [%lld, %lld)", h.worker,
                                  (long long)h.clock, (long long)s->st.version,
                                  (long long)(s->st.version + s->nslots));
        } else {
            ps_slot *sl = &s->slots[h.clock % s->nslots];
            if (sl->clock == -1) sl->clock = h.clock;
            if (sl->clock != h.clock || sl->have[h.worker]) {
                st = tdm_rpc_req_fail(req, TDM_STATUS_INTERNAL, "ps.push: worker %d pushed clock %lld twice",
                                      h.worker, (long long)h.clock);
            } else {
                memcpy(sl->grads + (size_t)h.worker * (size_t)s->n, g, (size_t)s->n * sizeof(float));
                sl->have[h.worker] = 1;
                sl->used[h.worker] = h.version_used;
                sl->count++;
                st = apply_ready(s);
            }
        }
    }
    if (st != TDM_STATUS_OK && !s->failed[0])
        snprintf(s->failed, sizeof s->failed, "%s", req->err[0] ? req->err : tdm_error_message());
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* state -> {i64 version, i64 sync kind, i64 n_state, i64 workers,
 * i64 pushed[workers]} + the shard's parameters and state buffers */
static tdm_status fn_state(tdm_rpc_req *req, void *ctx)
{
    tdm_ps_server *s = ctx;
    int ns = tdm_optim_n_state(s->opt);
    int W = s->l.workers;
    int64_t *out = NULL;
    pthread_mutex_lock(&s->mu);
    tdm_status st = tdm_rpc_req_reply(req, (size_t)(4 + W) * sizeof(int64_t) +
                                               (size_t)(1 + ns) * (size_t)s->n * sizeof(float),
                                      (void **)&out);
    if (st == TDM_STATUS_OK) {
        out[0] = s->st.version;
        out[1] = s->mode.kind;
        out[2] = ns;
        out[3] = W;
        memcpy(out + 4, s->pushed, (size_t)W * sizeof(int64_t));
        float *p = (float *)(out + 4 + W);
        memcpy(p, s->params, (size_t)s->n * sizeof(float));
        for (int i = 0; i < ns; i++)
            memcpy(p + (size_t)(1 + i) * (size_t)s->n, tdm_optim_state(s->opt, i), (size_t)s->n * sizeof(float));
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* A worker stopped on an error: the job stops with it, in every mode (a
 * worker's NaN is the model's, not the worker's: as DDP does). */
static tdm_status fn_fail(tdm_rpc_req *req, void *ctx)
{
    tdm_ps_server *s = ctx;
    int32_t hdr[2] = {-1, 0};
    if (req->nbytes >= sizeof hdr) memcpy(hdr, req->args, sizeof hdr);
    if (hdr[0] < 0 || hdr[0] >= s->l.workers)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "ps.fail: worker %d of %d", hdr[0], s->l.workers);
    int len = (int)(req->nbytes - sizeof hdr);
    if (len > 400) len = 400;
    pthread_mutex_lock(&s->mu);
    if (!s->failed[0])
        snprintf(s->failed, sizeof s->failed, "worker %d (rank %d) failed: %.*s", hdr[0], s->l.servers + hdr[0],
                 len, (const char *)req->args + sizeof hdr);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return TDM_STATUS_OK;
}

static tdm_status fn_done(tdm_rpc_req *req, void *ctx)
{
    tdm_ps_server *s = ctx;
    int32_t w = -1;
    if (req->nbytes == sizeof w) memcpy(&w, req->args, sizeof w);
    if (w < 0 || w >= s->l.workers)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "ps.done: worker %d of %d", w, s->l.workers);
    pthread_mutex_lock(&s->mu);
    if (!s->done[w]) s->st.workers_done++;
    s->done[w] = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return TDM_STATUS_OK;
}

tdm_status tdm_ps_server_init(tdm_ps_server **out, tdm_rpc *rpc, tdm_device *dev,
                              const tdm_ps_layout *l, const tdm_ps_sync_mode *mode,
                              const tdm_optim_opts *optim, const float *params)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    TDM_REQUIRE(l->servers >= 1 && l->workers >= 1 && l->workers <= TDM_PS_MAX_WORKERS &&
                    l->servers + l->workers == tdm_rpc_world(rpc) && l->n_elem >= l->servers,
                TDM_STATUS_INVALID_ARG, "ps: %d servers and %d workers (1..%d) for %d ranks and %lld parameters",
                l->servers, l->workers, TDM_PS_MAX_WORKERS, tdm_rpc_world(rpc), (long long)l->n_elem);
    TDM_REQUIRE(tdm_rpc_rank(rpc) < l->servers, TDM_STATUS_INVALID_ARG, "ps: rank %d is a worker, not a server",
                tdm_rpc_rank(rpc));
    tdm_ps_server *s = calloc(1, sizeof *s);
    TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "ps: no memory for a server");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->rpc = rpc;
    s->dev = dev;
    s->l = *l;
    s->mode = *mode;
    s->index = tdm_rpc_rank(rpc);
    tdm_ps_shard(l, s->index, &s->lo, &s->hi);
    s->n = s->hi - s->lo;
    s->params = malloc((size_t)s->n * sizeof(float));
    s->acc = malloc((size_t)s->n * sizeof(float));
    s->nslots = mode->kind == TDM_PS_ASYNC ? 0 : mode->bound + 1;
    s->slots = calloc((size_t)(s->nslots ? s->nslots : 1), sizeof *s->slots);
    if (!s->params || !s->acc || !s->slots) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ps: server %d: no memory for a shard of %lld", s->index,
                           (long long)s->n);
        goto fail;
    }
    for (int i = 0; i < s->nslots; i++) {
        s->slots[i].clock = -1;
        s->slots[i].grads = malloc((size_t)l->workers * (size_t)s->n * sizeof(float));
        if (!s->slots[i].grads) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ps: server %d: no memory for %d workers' gradients",
                               s->index, l->workers);
            goto fail;
        }
    }
    memcpy(s->params, params + s->lo, (size_t)s->n * sizeof(float));
    TDM_TRY(tdm_optim_init_flat(&s->opt, dev, s->n, optim));
    TDM_TRY(tdm_rpc_register(rpc, TDM_PS_FN_PULL, fn_pull, s));
    TDM_TRY(tdm_rpc_register(rpc, TDM_PS_FN_PUSH, fn_push, s));
    TDM_TRY(tdm_rpc_register(rpc, TDM_PS_FN_DONE, fn_done, s));
    TDM_TRY(tdm_rpc_register(rpc, TDM_PS_FN_STATE, fn_state, s));
    TDM_TRY(tdm_rpc_register(rpc, TDM_PS_FN_FAIL, fn_fail, s));
    *out = s;
    return TDM_STATUS_OK;
fail:
    tdm_ps_server_free(s);
    return st;
}

void tdm_ps_server_free(tdm_ps_server *s)
{
    if (!s) return;
    for (int i = 0; i < s->nslots; i++) free(s->slots[i].grads);
    free(s->slots);
    tdm_optim_free(s->opt);
    free(s->params);
    free(s->acc);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* A worker seen gone is taken for lost (or failed) only after this long
 * without its done: its last calls may still be on their way to the
 * server's thread. */
#define PS_SERVER_GONE_GRACE_NS (1000ull * 1000 * 1000)

tdm_status tdm_ps_server_wait(tdm_ps_server *s, int64_t timeout_ms, int *lost, char *lost_why,
                              size_t n)
{
    if (lost_why && n) lost_why[0] = '\0';
    uint64_t t0 = tdm_time_ns();
    int n_lost = 0;
    uint64_t gone_ns[TDM_PS_MAX_WORKERS] = {0};   /* when each worker was first seen gone */
    pthread_mutex_lock(&s->mu);
    for (;;) {
        if (s->failed[0]) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", s->failed);
            pthread_mutex_unlock(&s->mu);
            return tdm_error_set(TDM_STATUS_INTERNAL, "ps: server %d: %s", s->index, msg);
        }
        int finished = 0;
        for (int w = 0; w < s->l.workers; w++) finished += s->done[w] || s->lost[w];
        if (finished == s->l.workers) break;
        if (timeout_ms >= 0 && tdm_time_ns() - t0 >= (uint64_t)timeout_ms * 1000000u) {
            pthread_mutex_unlock(&s->mu);
            return tdm_error_set(TDM_STATUS_TIMEOUT, "ps: server %d: %d of %d workers finished within %lld ms",
                                 s->index, finished, s->l.workers, (long long)timeout_ms);
        }
        pthread_mutex_unlock(&s->mu);
        for (int w = 0; w < s->l.workers; w++) {
            char why[200];
            pthread_mutex_lock(&s->mu);
            int settled = s->done[w] || s->lost[w];
            pthread_mutex_unlock(&s->mu);
            if (settled || tdm_rpc_peer_alive(s->rpc, s->l.servers + w, why, sizeof why)) {
                gone_ns[w] = 0;
                continue;
            }
            /* its last calls (the last push, done) may be read from its
             * ring and still queued for this server's thread: gone
             * counts once they had the time to run, and done is read
             * again after */
            uint64_t now = tdm_time_ns();
            if (!gone_ns[w]) gone_ns[w] = now;
            if (now - gone_ns[w] < PS_SERVER_GONE_GRACE_NS) continue;
            pthread_mutex_lock(&s->mu);
            settled = s->done[w] || s->lost[w];
            pthread_mutex_unlock(&s->mu);
            if (settled) continue;
            if (s->mode.kind != TDM_PS_ASYNC)
                return tdm_error_set(TDM_STATUS_PEER_FAILED,
                                     "ps: server %d: worker %d (rank %d) %s: a %s step needs every worker's "
                                     "gradient; stopping", s->index, w, s->l.servers + w, why,
                                     s->mode.kind == TDM_PS_SYNC ? "sync" : "bounded");
            pthread_mutex_lock(&s->mu);
            s->lost[w] = 1;
            pthread_mutex_unlock(&s->mu);
            n_lost++;
            TDM_WARN(CORE, "ps server %d: worker %d (rank %d) %s; async training goes on with the others",
                     s->index, w, s->l.servers + w, why);
            if (lost_why && n) {
                size_t len = strlen(lost_why);
                snprintf(lost_why + len, n - len, "%sworker %d (rank %d) %s", len ? "; " : "", w,
                         s->l.servers + w, why);
            }
        }
        pthread_mutex_lock(&s->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += PS_SERVER_CHECK_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    int done = s->st.workers_done;
    pthread_mutex_unlock(&s->mu);
    if (lost) *lost = n_lost;
    /* async outlives lost workers, but not all of them: nothing trained */
    if (done == 0)
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "ps: server %d: no worker finished (%s)", s->index,
                             lost_why && n && lost_why[0] ? lost_why : "every worker was lost");
    return TDM_STATUS_OK;
}

void tdm_ps_server_get_stats(tdm_ps_server *s, tdm_ps_server_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    pthread_mutex_unlock(&s->mu);
}

const float *tdm_ps_server_params(const tdm_ps_server *s, int64_t *lo, int64_t *hi)
{
    *lo = s->lo;
    *hi = s->hi;
    return s->params;
}

tdm_status tdm_ps_gather(tdm_rpc *rpc, const tdm_ps_layout *l, float *params, float **state,
                         int n_state, int64_t *optim_steps, int64_t timeout_ms)
{
    int W = l->workers;
    int64_t complete[TDM_PS_MAX_WORKERS];   /* per worker: steps every server took */
    int64_t version = 0;                    /* sync, bounded: the fewest any server applied */
    int async = 0;
    TDM_REQUIRE(W >= 1 && W <= TDM_PS_MAX_WORKERS, TDM_STATUS_INVALID_ARG, "ps: gather: %d workers", W);
    for (int sv = 0; sv < l->servers; sv++) {
        void *rep = NULL;
        size_t rn = 0;
        TDM_CHECK(tdm_rpc_call(rpc, sv, TDM_PS_FN_STATE, NULL, 0, &rep, &rn, timeout_ms));
        int64_t lo, hi, hdr[4] = {0, 0, 0, 0};
        tdm_ps_shard(l, sv, &lo, &hi);
        size_t n = (size_t)(hi - lo);
        if (rn >= sizeof hdr) memcpy(hdr, rep, sizeof hdr);
        size_t head = sizeof hdr + (size_t)W * sizeof(int64_t);
        if (rn < sizeof hdr || hdr[2] < 0 || hdr[2] > 4 || hdr[3] != W ||
            rn != head + (size_t)(1 + hdr[2]) * n * sizeof(float) || (state && hdr[2] != n_state)) {
            free(rep);
            return tdm_error_set(TDM_STATUS_FORMAT, "ps: server %d's state is %zu bytes with %lld state buffers "
                                 "and %lld workers (expected %d and %d)", sv, rn, (long long)hdr[2],
                                 (long long)hdr[3], n_state, W);
        }
        const int64_t *pushed = (const int64_t *)((const uint8_t *)rep + sizeof hdr);
        for (int w = 0; w < W; w++)
            if (sv == 0 || pushed[w] < complete[w]) complete[w] = pushed[w];
        if (sv == 0 || hdr[0] < version) version = hdr[0];
        async = hdr[1] == TDM_PS_ASYNC;
        const float *p = (const float *)((const uint8_t *)rep + head);
        memcpy(params + lo, p, n * sizeof(float));
        for (int i = 0; state && i < n_state; i++) memcpy(state[i] + lo, p + (size_t)(1 + i) * n, n * sizeof(float));
        free(rep);
    }
    if (optim_steps) {
        /* one count for every shard: async, the pushes that reached every
         * server (a worker killed between its pushes to two servers left
         * one shard a step ahead); sync and bounded, the global steps
         * every server applied */
        int64_t steps = 0;
        for (int w = 0; w < W; w++) steps += complete[w];
        *optim_steps = async ? steps : version;
    }
    return TDM_STATUS_OK;
}
