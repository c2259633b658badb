/* ps/worker.c: a parameter-server worker: pull every shard (as fresh as
 * the mode needs: sync, the version of this step; bounded:K, at most K
 * behind it; async, any), forward and backward on its share of the batch,
 * push each shard of the gradient to its server; and the parsing of the
 * modes. The loss gradient is scaled by 1/B (B the global batch), so
 * that the W gradients of a step sum to the global batch's mean-loss
 * gradient. Pulls and pushes go to all servers at once (futures). A server
 * answers a pull it cannot serve yet with its version, and the worker
 * asks again after a short sleep (doubling up to PS_POLL_MAX_US).
 * Not the server's side: ps/server.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/timer.h"
#include "ps/ps_impl.h"

#define PS_POLL_MIN_US 50
#define PS_POLL_MAX_US 2000

struct tdm_ps_worker {
    tdm_rpc *rpc;                 /* borrowed */
    tdm_model *m;                 /* borrowed */
    tdm_ps_layout l;
    tdm_ps_sync_mode mode;
    int index;
    int64_t timeout_ms;
    int64_t clock;
    int64_t used[TDM_RPC_MAX_RANKS];    /* per server: the version pulled */
    double wait_ms;
    uint8_t *push_buf;            /* header + the largest shard */
};

tdm_status tdm_ps_sync_parse(const char *s, tdm_ps_sync_mode *out)
{
    TDM_REQUIRE(s, TDM_STATUS_INVALID_ARG, "--ps-sync: missing");
    if (!strcmp(s, "sync")) { *out = (tdm_ps_sync_mode){TDM_PS_SYNC, 0}; return TDM_STATUS_OK; }
    if (!strcmp(s, "async")) { *out = (tdm_ps_sync_mode){TDM_PS_ASYNC, 0}; return TDM_STATUS_OK; }
    if (!strncmp(s, "bounded:", 8)) {
        char *end = NULL;
        long k = strtol(s + 8, &end, 10);
        if (end != s + 8 && !*end && k >= 0 && k <= TDM_PS_MAX_BOUND) {
            *out = (tdm_ps_sync_mode){TDM_PS_BOUNDED, (int)k};
            return TDM_STATUS_OK;
        }
    }
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "--ps-sync '%s': expected sync, async or bounded:K (K 0..%d)", s,
                         TDM_PS_MAX_BOUND);
}

const char *tdm_ps_sync_str(const tdm_ps_sync_mode *m, char *buf, size_t n)
{
    if (m->kind == TDM_PS_BOUNDED) snprintf(buf, n, "bounded:%d", m->bound);
    else snprintf(buf, n, "%s", m->kind == TDM_PS_ASYNC ? "async" : "sync");
    return buf;
}

tdm_status tdm_ps_worker_init(tdm_ps_worker **out, tdm_rpc *rpc, tdm_model *m,
                              const tdm_ps_layout *l, const tdm_ps_sync_mode *mode,
                              int64_t timeout_ms)
{
    *out = NULL;
    int rank = tdm_rpc_rank(rpc);
    TDM_REQUIRE(l->servers >= 1 && l->workers >= 1 && l->workers <= TDM_PS_MAX_WORKERS &&
                    l->servers + l->workers == tdm_rpc_world(rpc) && rank >= l->servers,
                TDM_STATUS_INVALID_ARG, "ps: rank %d of %d is not a worker of %d servers and %d workers", rank,
                tdm_rpc_world(rpc), l->servers, l->workers);
    TDM_REQUIRE(tdm_model_param_elems(m) == l->n_elem, TDM_STATUS_INVALID_ARG,
                "ps: the worker's model has %lld parameters, the servers' layout %lld",
                (long long)tdm_model_param_elems(m), (long long)l->n_elem);
    tdm_ps_worker *w = calloc(1, sizeof *w);
    TDM_REQUIRE(w, TDM_STATUS_OUT_OF_MEMORY, "ps: no memory for a worker");
    w->rpc = rpc;
    w->m = m;
    w->l = *l;
    w->mode = *mode;
    w->index = rank - l->servers;
    w->timeout_ms = timeout_ms;
    int64_t lo, hi, most = 0;
    for (int s = 0; s < l->servers; s++) {
        tdm_ps_shard(l, s, &lo, &hi);
        if (hi - lo > most) most = hi - lo;
    }
    w->push_buf = malloc(sizeof(tdm_ps_push_hdr) + (size_t)most * sizeof(float));
    if (!w->push_buf) {
        free(w);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "ps: no memory for a worker's push buffer");
    }
    *out = w;
    return TDM_STATUS_OK;
}

void tdm_ps_worker_free(tdm_ps_worker *w)
{
    if (!w) return;
    free(w->push_buf);
    free(w);
}

int64_t tdm_ps_worker_steps(const tdm_ps_worker *w) { return w->clock; }
double tdm_ps_worker_wait_ms(const tdm_ps_worker *w) { return w->wait_ms; }

/* Every shard at a version >= min into the model's parameters. */
static tdm_status pull(tdm_ps_worker *w, int64_t min)
{
    float *params = tdm_model_params(w->m);
    int S = w->l.servers;
    int pending[TDM_RPC_MAX_RANKS];
    for (int s = 0; s < S; s++) pending[s] = 1;
    int left = S;
    unsigned nap_us = PS_POLL_MIN_US;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = TDM_STATUS_OK;
    while (left > 0) {
        tdm_rpc_future *f[TDM_RPC_MAX_RANKS] = {0};
        for (int s = 0; s < S && st == TDM_STATUS_OK; s++)
            if (pending[s]) st = tdm_rpc_call_async(w->rpc, s, TDM_PS_FN_PULL, &min, sizeof min, &f[s]);
        for (int s = 0; s < S; s++) {
            if (!f[s]) continue;
            void *rep = NULL;
            size_t rn = 0;
            tdm_status fs = tdm_rpc_future_wait(f[s], w->timeout_ms, &rep, &rn);
            tdm_rpc_future_free(f[s]);
            if (fs != TDM_STATUS_OK) {
                if (st == TDM_STATUS_OK)
                    st = tdm_error_prefix(fs, "ps: worker %d: pull from server %d", w->index, s);
                free(rep);
                continue;
            }
            int64_t lo, hi, hdr[2] = {0, 0};
            tdm_ps_shard(&w->l, s, &lo, &hi);
            if (rn >= sizeof hdr) memcpy(hdr, rep, sizeof hdr);
            if (rn < sizeof hdr || (hdr[1] && rn != sizeof hdr + (size_t)(hi - lo) * sizeof(float))) {
                if (st == TDM_STATUS_OK)
                    st = tdm_error_set(TDM_STATUS_FORMAT, "ps: worker %d: server %d's pull reply is %zu bytes",
                                       w->index, s, rn);
            } else if (hdr[1]) {
                memcpy(params + lo, (const uint8_t *)rep + sizeof hdr, (size_t)(hi - lo) * sizeof(float));
                w->used[s] = hdr[0];
                pending[s] = 0;
                left--;
            }
            free(rep);
        }
        if (st != TDM_STATUS_OK) return st;
        if (left > 0) {
            if (w->timeout_ms >= 0 && tdm_time_ns() - t0 >= (uint64_t)w->timeout_ms * 1000000u)
                return tdm_error_set(TDM_STATUS_TIMEOUT,
                                     "ps: worker %d: no server reached version %lld within %lld ms (%d behind)",
                                     w->index, (long long)min, (long long)w->timeout_ms, left);
            usleep(nap_us);
            nap_us = nap_us * 2 > PS_POLL_MAX_US ? PS_POLL_MAX_US : nap_us * 2;
        }
    }
    w->wait_ms += (double)(tdm_time_ns() - t0) / 1e6;
    return TDM_STATUS_OK;
}

tdm_status tdm_ps_worker_pull_latest(tdm_ps_worker *w) { return pull(w, 0); }

tdm_status tdm_ps_worker_step(tdm_ps_worker *w, const void *x, const int32_t *y, int n,
                              int global_batch, double *loss_sum)
{
    TDM_REQUIRE(n >= 0 && global_batch >= 1 && global_batch >= n, TDM_STATUS_INVALID_ARG,
                "ps: worker %d: a share of %d samples of a global batch of %d", w->index, n, global_batch);
    int64_t min = 0;
    if (w->mode.kind == TDM_PS_SYNC) min = w->clock;
    else if (w->mode.kind == TDM_PS_BOUNDED) min = w->clock > w->mode.bound ? w->clock - w->mode.bound : 0;
    TDM_CHECK(pull(w, min));
    TDM_CHECK(tdm_model_zero_grad(w->m));
    /* the loss gradient scaled by 1/B: the workers' gradients summed are
     * the global batch's mean-loss gradient (dist/step.h's rule) */
    const float *logits = NULL;
    double loss = 0;
    float *dlogits = NULL;
    if (n > 0) {
        /* an empty share (a short last batch) pushes zeros: a sync step
         * needs every worker's gradient */
        TDM_CHECK(tdm_model_forward(w->m, x, n, &logits));
        dlogits = tdm_model_loss_grad(w->m);
        TDM_CHECK(tdm_model_loss(w->m, logits, y, n, 1.0f / (float)global_batch, &loss, dlogits));
        TDM_CHECK(tdm_model_backward(w->m, dlogits));
    }
    if (loss_sum) *loss_sum = loss;
    const float *grads = tdm_model_grads(w->m);
    /* one push per server, in turn: each copies its shard into the
     * message before the next is built */
    tdm_status st = TDM_STATUS_OK;
    tdm_rpc_future *f[TDM_RPC_MAX_RANKS] = {0};
    for (int s = 0; s < w->l.servers && st == TDM_STATUS_OK; s++) {
        int64_t lo, hi;
        tdm_ps_shard(&w->l, s, &lo, &hi);
        tdm_ps_push_hdr h = {.worker = w->index, .clock = w->clock, .version_used = w->used[s]};
        memcpy(w->push_buf, &h, sizeof h);
        memcpy(w->push_buf + sizeof h, grads + lo, (size_t)(hi - lo) * sizeof(float));
        st = tdm_rpc_call_async(w->rpc, s, TDM_PS_FN_PUSH, w->push_buf, sizeof h + (size_t)(hi - lo) * sizeof(float),
                                &f[s]);
    }
    for (int s = 0; s < w->l.servers; s++) {
        if (!f[s]) continue;
        tdm_status fs = tdm_rpc_future_wait(f[s], w->timeout_ms, NULL, NULL);
        tdm_rpc_future_free(f[s]);
        if (fs != TDM_STATUS_OK && st == TDM_STATUS_OK)
            st = tdm_error_prefix(fs, "ps: worker %d: push of step %lld to server %d", w->index,
                                  (long long)w->clock, s);
    }
    TDM_CHECK(st);
    w->clock++;
    return TDM_STATUS_OK;
}

tdm_status tdm_ps_worker_done(tdm_ps_worker *w)
{
    int32_t idx = w->index;
    for (int s = 0; s < w->l.servers; s++)
        TDM_CHECK(tdm_rpc_call(w->rpc, s, TDM_PS_FN_DONE, &idx, sizeof idx, NULL, NULL, w->timeout_ms));
    return TDM_STATUS_OK;
}

void tdm_ps_worker_fail(tdm_ps_worker *w, const char *why)
{
    char buf[2 * sizeof(int32_t) + 400];
    int32_t hdr[2] = {w->index, 0};
    size_t len = strlen(why ? why : "");
    if (len > sizeof buf - sizeof hdr) len = sizeof buf - sizeof hdr;
    memcpy(buf, hdr, sizeof hdr);
    memcpy(buf + sizeof hdr, why ? why : "", len);
    /* best effort: a server that cannot take it learns of the worker's
     * exit from rpc/'s liveness check */
    for (int s = 0; s < w->l.servers; s++)
        (void)tdm_rpc_call(w->rpc, s, TDM_PS_FN_FAIL, buf, sizeof hdr + len, NULL, NULL, TDM_PS_FAIL_TIMEOUT_MS);
}
