/* rpc/rpc.c: the RPC endpoint: the registry of functions, the futures of
 * calls in flight, the decoding of messages from the transports, the
 * reader and server threads, and the barrier.
 * Not a transport: bytes move in rpc/rpc_shm.c and rpc/rpc_tcp.c. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "core/log.h"
#include "core/timer.h"
#include "rpc/rpc_impl.h"

/* How often a wait looks at its callee's liveness: a dead callee is named
 * within about this long (plus the transport's own detection). */
#define TDM_RPC_CHECK_MS 20
/* A future's wait that times out after at least this long is noted as
 * the flight recorder's failure (shorter ones are polls). */
#define TDM_RPC_FR_TIMEOUT_MS 1000
/* The reader's longest sleep between looks at the stop flag. */
#define TDM_RPC_PUMP_NAP_MS 50
/* Longest a freed endpoint waits to say goodbye to a peer that reads
 * nothing (a stopped process). */
#define TDM_RPC_BYE_STALL_MS 200
/* Longest a freed endpoint goes on serving the calls that arrived. */
#define TDM_RPC_DRAIN_MS 5000


typedef enum tdm_rpc_fstate {
    TDM_RPC_F_PENDING = 0,
    TDM_RPC_F_DONE,
    TDM_RPC_F_TAKEN,          /* the result was handed to the caller */
} tdm_rpc_fstate;

struct tdm_rpc_future {
    tdm_rpc *rpc;             /* borrowed */
    uint64_t id;
    int dst;
    char name[TDM_RPC_NAME_MAX + 1];
    tdm_rpc_fstate state;
    int detached;             /* freed by its owner while pending */
    uint64_t fr_seq;          /* its entry in the flight recorder */
    tdm_status st;
    char *err;
    void *reply;
    size_t reply_nbytes;
    struct tdm_rpc_future *next;
};

int tdm_rpc_rank(const tdm_rpc *rpc) { return rpc->rank; }
int tdm_rpc_world(const tdm_rpc *rpc) { return rpc->world; }

int64_t tdm_rpc_setup_ms(const tdm_rpc *rpc)
{
    return rpc->opts.setup_ms > 0 ? rpc->opts.setup_ms : TDM_RPC_DEFAULT_SETUP_MS;
}

void tdm_rpc_get_stats(const tdm_rpc *rpc, tdm_rpc_stats *out)
{
    tdm_rpc *r = (tdm_rpc *)rpc;
    pthread_mutex_lock(&r->mu);
    *out = r->stats;
    pthread_mutex_unlock(&r->mu);
}

/* --- futures ------------------------------------------------------------ */

/* Completes f (mu held); a detached one is freed. */
static void future_complete(tdm_rpc *rpc, tdm_rpc_future *f, tdm_status st, const char *err,
                            void *reply, size_t n)
{
    tdm_rpc_future **pp = &rpc->calls.pending;
    while (*pp && *pp != f) pp = &(*pp)->next;
    if (*pp) *pp = f->next;
    f->next = NULL;
    if (f->detached) {
        free(reply);
        free(f);
        return;
    }
    f->st = st;
    f->err = err ? strdup(err) : NULL;
    f->reply = reply;
    f->reply_nbytes = n;
    f->state = TDM_RPC_F_DONE;
    pthread_cond_broadcast(&rpc->cv);
}

/* Fails every pending call to dst (mu held); record: as failed in the
 * flight recorder (not when this endpoint is freed: they were pending). */
static void fail_pending_to(tdm_rpc *rpc, int dst, const char *why, int record)
{
    tdm_rpc_future *f = rpc->calls.pending;
    while (f) {
        tdm_rpc_future *next = f->next;
        if (dst < 0 || f->dst == dst) {
            char msg[640];
            snprintf(msg, sizeof msg, "rpc: call #%llu '%s' to rank %d: %s",
                     (unsigned long long)f->id, f->name, f->dst, why);
            if (record) tdm_rpc_fr_end(rpc, f->fr_seq, TDM_STATUS_PEER_FAILED, msg);
            future_complete(rpc, f, TDM_STATUS_PEER_FAILED, msg, NULL, 0);
        }
        f = next;
    }
}

void tdm_rpc_peer_lost(tdm_rpc *rpc, int src, tdm_rpc_peer_state state, const char *why)
{
    pthread_mutex_lock(&rpc->mu);
    if (rpc->peers.state[src] == TDM_RPC_PEER_UP) {
        rpc->peers.state[src] = state;
        snprintf(rpc->peers.why[src], sizeof rpc->peers.why[src], "%s", why);
        if (state == TDM_RPC_PEER_GONE) {
            char msg[sizeof rpc->peers.why[0] + 64];
            snprintf(msg, sizeof msg, "rpc: rank %d: rank %d %s", rpc->rank, src, why);
            TDM_WARN(CORE, "%s", msg);
            tdm_rpc_fr_failure(rpc, TDM_STATUS_PEER_FAILED, msg);
        }
    }
    /* a peer that left in order is no failure of this rank's record */
    fail_pending_to(rpc, src, rpc->peers.why[src], rpc->peers.state[src] == TDM_RPC_PEER_GONE);
    pthread_cond_broadcast(&rpc->cv);
    pthread_mutex_unlock(&rpc->mu);
}

/* --- sending ------------------------------------------------------------ */

static void dispatch(tdm_rpc *rpc, tdm_rpc_wire *w, uint8_t *body);

/* Sends one message (header + name + payload) to dst, waiting at most
 * stall_ns for a peer that takes nothing (the send lock included); to
 * this rank it is handed to dispatch without a transport. A message left
 * half-written abandons the channel: dst is taken for gone, naming why. */
static tdm_status deliver(tdm_rpc *rpc, int dst, tdm_rpc_kind kind, int32_t status, uint64_t id,
                          const char *name, const void *payload, size_t n, uint64_t stall_ns,
                          uint64_t deadline_ns)
{
    uint32_t name_len = name ? (uint32_t)strlen(name) : 0;
    tdm_rpc_wire w;
    tdm_rpc_wire_fill(&w, kind, rpc->rank, status, id, name_len, name_len + n);
    if (dst == rpc->rank) {
        uint8_t *body = malloc(name_len + n + 1);
        if (!body) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rpc: %zu bytes for a message to self", n);
        if (name_len) memcpy(body, name, name_len);
        if (n) memcpy(body + name_len, payload, n);
        dispatch(rpc, &w, body);
        return TDM_STATUS_OK;
    }
    pthread_mutex_lock(&rpc->mu);
    int up = rpc->peers.state[dst] == TDM_RPC_PEER_UP;
    char why[sizeof rpc->peers.why[0]];
    snprintf(why, sizeof why, "%s", rpc->peers.why[dst]);
    pthread_mutex_unlock(&rpc->mu);
    /* a peer gone or left reads nothing more (its channel may be closed) */
    if (!up) return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc: send to rank %d: it %s", dst, why);
    /* the name travels in the same write as the header */
    uint8_t head[sizeof w + TDM_RPC_NAME_MAX];
    memcpy(head, &w, sizeof w);
    if (name_len) memcpy(head + sizeof w, name, name_len);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + stall_ns % 1000000000u;
    until.tv_sec += (time_t)(stall_ns / 1000000000u + ns / 1000000000u);
    until.tv_nsec = (long)(ns % 1000000000u);
    /* another thread's send to dst may itself be stuck on it */
    if (pthread_mutex_timedlock(&rpc->send_mu[dst], &until) != 0)
        return tdm_error_set(TDM_STATUS_TIMEOUT, "rank %d has not read for %.1f s (another send to it is "
                             "stuck; nothing of this message was sent)", dst, (double)stall_ns / 1e9);
    size_t sent = 0;
    tdm_status st = rpc->ops->send(rpc, dst, head, sizeof w + name_len, payload, n, stall_ns, deadline_ns, &sent);
    if (st != TDM_STATUS_OK && sent == 0) {
        /* the channel is whole: dst stays up ("rank D has not read for X s
         * (...)" on a TIMEOUT) */
        pthread_mutex_unlock(&rpc->send_mu[dst]);
        if (st == TDM_STATUS_TIMEOUT) return tdm_error_prefix(st, "nothing of the message was sent");
        return st;
    }
    if (st != TDM_STATUS_OK) {
        /* part of a message went: the channel is abandoned, dst is gone
         * for this rank (named first: its reader may see the channel end) */
        char lost[sizeof rpc->peers.why[0]];
        snprintf(lost, sizeof lost, "%s%s; %zu of %zu bytes of a message were sent, so the channel to it is "
                 "closed", st == TDM_STATUS_TIMEOUT ? "stopped reading: " : "", tdm_error_message(), sent,
                 sizeof w + name_len + n);
        tdm_rpc_peer_lost(rpc, dst, TDM_RPC_PEER_GONE, lost);
        rpc->ops->abandon(rpc, dst);
        pthread_mutex_unlock(&rpc->send_mu[dst]);
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc: send to rank %d: %s", dst, lost);
    }
    pthread_mutex_unlock(&rpc->send_mu[dst]);
    if (st == TDM_STATUS_OK) {
        pthread_mutex_lock(&rpc->mu);
        rpc->stats.bytes_sent += sizeof w + name_len + n;
        rpc->stats.msgs_sent++;
        pthread_mutex_unlock(&rpc->mu);
    }
    return st;
}

/* --- receiving ---------------------------------------------------------- */

static void handle_reply(tdm_rpc *rpc, tdm_rpc_wire *w, uint8_t *body)
{
    pthread_mutex_lock(&rpc->mu);
    tdm_rpc_future *f = rpc->calls.pending;
    while (f && !(f->id == w->id && f->dst == w->src)) f = f->next;
    if (!f) {
        /* a reply to a call that already failed (its callee was taken for
         * gone) or to none: dropped */
        pthread_mutex_unlock(&rpc->mu);
        TDM_INFO(CORE, "rpc: rank %d: reply #%llu from rank %d matches no call; dropped", rpc->rank,
                 (unsigned long long)w->id, w->src);
        free(body);
        return;
    }
    size_t n = (size_t)w->body_len - w->name_len;
    /* a reply, an error one too: the call went through */
    tdm_rpc_fr_end(rpc, f->fr_seq, TDM_STATUS_OK, NULL);
    if (w->status == TDM_STATUS_OK) {
        void *reply = NULL;
        if (n) {
            reply = malloc(n);
            if (reply) memcpy(reply, body + w->name_len, n);
        }
        if (n && !reply)
            future_complete(rpc, f, TDM_STATUS_OUT_OF_MEMORY, "rpc: no memory for a reply", NULL, 0);
        else
            future_complete(rpc, f, TDM_STATUS_OK, NULL, reply, n);
    } else {
        char *msg = malloc(n + 64);
        if (msg) snprintf(msg, n + 64, "rank %d: %.*s", w->src, (int)n, (const char *)body + w->name_len);
        future_complete(rpc, f, (tdm_status)w->status, msg ? msg : "rpc: the callee failed", NULL, 0);
        free(msg);
    }
    pthread_mutex_unlock(&rpc->mu);
    free(body);
}

/* A complete message: calls go to the server's queue, replies to their
 * futures. Takes body. */
static void dispatch(tdm_rpc *rpc, tdm_rpc_wire *w, uint8_t *body)
{
    switch ((tdm_rpc_kind)w->kind) {
    case TDM_RPC_KIND_CALL: {
        tdm_rpc_msg *m = malloc(sizeof *m);
        if (!m) {
            free(body);
            return;
        }
        m->w = *w;
        m->body = body;
        m->next = NULL;
        pthread_mutex_lock(&rpc->mu);
        m->fr_seq = tdm_rpc_fr_serve(rpc, body, w->name_len, w->id, w->src,
                                     (size_t)w->body_len - w->name_len);
        if (rpc->queue.tail) rpc->queue.tail->next = m;
        else rpc->queue.head = m;
        rpc->queue.tail = m;
        pthread_cond_broadcast(&rpc->cv);
        pthread_mutex_unlock(&rpc->mu);
        return;
    }
    case TDM_RPC_KIND_REPLY:
        handle_reply(rpc, w, body);
        return;
    case TDM_RPC_KIND_BYE:
        free(body);
        tdm_rpc_peer_lost(rpc, w->src, TDM_RPC_PEER_LEFT, "has left (its RPC endpoint was freed)");
        return;
    default:
        free(body);
        return;
    }
}

tdm_status tdm_rpc_feed(tdm_rpc *rpc, int src, const void *buf, size_t n)
{
    tdm_rpc_decoder *d = &rpc->dec[src];
    const uint8_t *p = buf;
    if (d->broken) return tdm_error_set(TDM_STATUS_FORMAT, "sent a malformed message earlier");
    pthread_mutex_lock(&rpc->mu);
    rpc->stats.bytes_recv += n;
    pthread_mutex_unlock(&rpc->mu);
    while (n > 0) {
        if (d->hdr_have < sizeof d->hdr) {
            size_t k = sizeof d->hdr - d->hdr_have;
            if (k > n) k = n;
            memcpy(d->hdr + d->hdr_have, p, k);
            d->hdr_have += k;
            p += k;
            n -= k;
            if (d->hdr_have < sizeof d->hdr) break;
            tdm_rpc_wire w;
            memcpy(&w, d->hdr, sizeof w);
            if (tdm_rpc_wire_check(rpc, &w, src) != TDM_STATUS_OK) {
                d->broken = 1;
                return tdm_error_prefix(TDM_STATUS_FORMAT, "sent a malformed message");
            }
            d->body = malloc((size_t)w.body_len + 1);
            if (!d->body) {
                d->broken = 1;
                return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "sent a message of %llu bytes, for which rank %d has no memory",
                                     (unsigned long long)w.body_len, rpc->rank);
            }
            d->body_have = 0;
        }
        tdm_rpc_wire w;
        memcpy(&w, d->hdr, sizeof w);
        size_t k = (size_t)w.body_len - d->body_have;
        if (k > n) k = n;
        if (k) memcpy(d->body + d->body_have, p, k);
        d->body_have += k;
        p += k;
        n -= k;
        if (d->body_have == w.body_len) {
            uint8_t *body = d->body;
            d->body = NULL;
            d->hdr_have = 0;
            d->body_have = 0;
            pthread_mutex_lock(&rpc->mu);
            rpc->stats.msgs_recv++;
            pthread_mutex_unlock(&rpc->mu);
            dispatch(rpc, &w, body);
        }
    }
    return TDM_STATUS_OK;
}

/* --- the threads -------------------------------------------------------- */

static void *reader_main(void *arg)
{
    tdm_rpc *rpc = arg;
    while (!atomic_load_explicit(&rpc->stopping, memory_order_acquire))
        rpc->ops->pump(rpc, TDM_RPC_PUMP_NAP_MS);
    return NULL;
}

static tdm_rpc_fn_entry *find_fn(tdm_rpc *rpc, const char *name)
{
    for (int i = 0; i < rpc->reg.n; i++)
        if (!strcmp(rpc->reg.fns[i].name, name)) return &rpc->reg.fns[i];
    return NULL;
}

/* Runs one call and sends its reply: the reply's send status. */
static tdm_status serve(tdm_rpc *rpc, tdm_rpc_msg *m)
{
    char name[TDM_RPC_NAME_MAX + 1];
    memcpy(name, m->body, m->w.name_len);
    name[m->w.name_len] = '\0';
    tdm_rpc_req req = {
        .rpc = rpc,
        .caller = m->w.src,
        .name = name,
        .args = m->body + m->w.name_len,
        .nbytes = (size_t)m->w.body_len - m->w.name_len,
    };
    pthread_mutex_lock(&rpc->mu);
    tdm_rpc_fn_entry *e = strlen(name) == m->w.name_len ? find_fn(rpc, name) : NULL;
    tdm_rpc_fn fn = e ? e->fn : NULL;
    void *ctx = e ? e->ctx : NULL;
    int nfns = rpc->reg.n;
    pthread_mutex_unlock(&rpc->mu);
    tdm_status st;
    if (!fn) {
        char shown[2 * TDM_RPC_NAME_MAX + 1];
        size_t k = 0;
        for (uint32_t i = 0; i < m->w.name_len && k + 1 < sizeof shown; i++) {
            unsigned char c = (unsigned char)m->body[i];
            shown[k++] = c >= 32 && c < 127 ? (char)c : '?';
        }
        shown[k] = '\0';
        st = tdm_rpc_req_fail(&req, TDM_STATUS_INVALID_ARG,
                              "no function named '%s' is registered on rank %d (%d registered)", shown,
                              rpc->rank, nfns);
    } else {
        /* the arguments follow the name: at any offset of the malloc'd
         * body. Functions read them as their types (floats, int64s):
         * moved to the body's start, aligned as malloc aligns */
        if (((uintptr_t)req.args & (sizeof(max_align_t) - 1)) && req.nbytes) {
            memmove(m->body, req.args, req.nbytes);
            req.args = m->body;
        }
        tdm_error_clear();
        st = fn(&req, ctx);
        if (st != TDM_STATUS_OK && !req.err[0])
            snprintf(req.err, sizeof req.err, "%s: %s", name,
                     tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
        if (st == TDM_STATUS_OK && req.reply_nbytes > rpc->max_msg) {
            st = tdm_rpc_req_fail(&req, TDM_STATUS_INVALID_ARG,
                                  "%s: reply of %zu bytes is over the limit of %zu (tdm_rpc_opts.max_msg_bytes)",
                                  name, req.reply_nbytes, rpc->max_msg);
        }
    }
    tdm_status sst;
    if (st == TDM_STATUS_OK)
        sst = deliver(rpc, m->w.src, TDM_RPC_KIND_REPLY, TDM_STATUS_OK, m->w.id, NULL, req.reply,
                      req.reply_nbytes, rpc->send_stall_ns, UINT64_MAX);
    else
        sst = deliver(rpc, m->w.src, TDM_RPC_KIND_REPLY, st, m->w.id, NULL, req.err, strlen(req.err),
                      rpc->send_stall_ns, UINT64_MAX);
    if (sst != TDM_STATUS_OK)
        TDM_INFO(CORE, "rpc: rank %d: reply to rank %d's call '%s' not sent: %s", rpc->rank, m->w.src,
                 name, tdm_error_message());
    free(req.reply);
    pthread_mutex_lock(&rpc->mu);
    rpc->stats.calls_served++;
    pthread_mutex_unlock(&rpc->mu);
    return sst;
}

static void *server_main(void *arg)
{
    tdm_rpc *rpc = arg;
    pthread_mutex_lock(&rpc->mu);
    for (;;) {
        while (!rpc->queue.head && !atomic_load_explicit(&rpc->stopping, memory_order_acquire))
            pthread_cond_wait(&rpc->cv, &rpc->mu);
        if (!rpc->queue.head || atomic_load_explicit(&rpc->stopping, memory_order_acquire)) break;
        tdm_rpc_msg *m = rpc->queue.head;
        rpc->queue.head = m->next;
        if (!rpc->queue.head) rpc->queue.tail = NULL;
        rpc->queue.serving = 1;
        pthread_mutex_unlock(&rpc->mu);
        tdm_rpc_fr_start(rpc, m->fr_seq);
        tdm_status sst = serve(rpc, m);
        tdm_rpc_fr_end(rpc, m->fr_seq, sst, sst ? tdm_error_message() : NULL);
        free(m->body);
        free(m);
        pthread_mutex_lock(&rpc->mu);
        rpc->queue.serving = 0;
        pthread_cond_broadcast(&rpc->cv);
    }
    pthread_mutex_unlock(&rpc->mu);
    return NULL;
}

/* --- registry and requests --------------------------------------------- */

tdm_status tdm_rpc_register(tdm_rpc *rpc, const char *name, tdm_rpc_fn fn, void *ctx)
{
    TDM_REQUIRE(rpc && name && fn, TDM_STATUS_INVALID_ARG, "rpc_register: NULL argument");
    size_t len = strlen(name);
    TDM_REQUIRE(len > 0 && len <= TDM_RPC_NAME_MAX, TDM_STATUS_INVALID_ARG,
                "rpc_register: name '%s' has %zu bytes (1..%d)", name, len, TDM_RPC_NAME_MAX);
    tdm_status st = TDM_STATUS_OK;
    pthread_mutex_lock(&rpc->mu);
    if (find_fn(rpc, name))
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc_register: '%s' is already registered on rank %d",
                           name, rpc->rank);
    else if (rpc->reg.n == TDM_RPC_MAX_FNS)
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc_register: '%s': %d functions registered already (the most)",
                           name, TDM_RPC_MAX_FNS);
    else {
        tdm_rpc_fn_entry *e = &rpc->reg.fns[rpc->reg.n++];
        memcpy(e->name, name, len + 1);
        e->fn = fn;
        e->ctx = ctx;
    }
    pthread_mutex_unlock(&rpc->mu);
    return st;
}

tdm_status tdm_rpc_req_reply(tdm_rpc_req *req, size_t nbytes, void **out)
{
    free(req->reply);
    req->reply = malloc(nbytes ? nbytes : 1);
    req->reply_nbytes = req->reply ? nbytes : 0;
    *out = req->reply;
    TDM_REQUIRE(req->reply, TDM_STATUS_OUT_OF_MEMORY, "rpc: %zu bytes for the reply of '%s'", nbytes,
                req->name);
    return TDM_STATUS_OK;
}

tdm_status tdm_rpc_req_fail(tdm_rpc_req *req, tdm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(req->err, sizeof req->err, fmt, ap);
    va_end(ap);
    return st == TDM_STATUS_OK ? TDM_STATUS_INTERNAL : st;
}

/* --- calls -------------------------------------------------------------- */

/* tdm_rpc_call_async with the bound on a send to a peer that reads
 * nothing (tdm_rpc_call: its timeout, when shorter). */
static tdm_status call_start(tdm_rpc *rpc, int dst, const char *name, const void *args, size_t nbytes,
                             uint64_t stall_ns, uint64_t deadline_ns, tdm_rpc_future **out)
{
    *out = NULL;
    TDM_REQUIRE(rpc && name, TDM_STATUS_INVALID_ARG, "rpc_call: NULL argument");
    TDM_REQUIRE(dst >= 0 && dst < rpc->world, TDM_STATUS_INVALID_ARG,
                "rpc_call '%s': rank %d is not in the job (world %d)", name, dst, rpc->world);
    size_t len = strlen(name);
    TDM_REQUIRE(len > 0 && len <= TDM_RPC_NAME_MAX, TDM_STATUS_INVALID_ARG,
                "rpc_call: function name of %zu bytes (1..%d)", len, TDM_RPC_NAME_MAX);
    TDM_REQUIRE(nbytes <= rpc->max_msg, TDM_STATUS_INVALID_ARG,
                "rpc_call '%s' to rank %d: arguments of %zu bytes are over the limit of %zu "
                "(tdm_rpc_opts.max_msg_bytes): send them in pieces",
                name, dst, nbytes, rpc->max_msg);
    TDM_REQUIRE(args || !nbytes, TDM_STATUS_INVALID_ARG, "rpc_call '%s': NULL arguments of %zu bytes",
                name, nbytes);
    tdm_rpc_future *f = calloc(1, sizeof *f);
    TDM_REQUIRE(f, TDM_STATUS_OUT_OF_MEMORY, "rpc_call: no memory for a future");
    f->rpc = rpc;
    f->dst = dst;
    memcpy(f->name, name, len + 1);
    pthread_mutex_lock(&rpc->mu);
    if (rpc->peers.state[dst] != TDM_RPC_PEER_UP) {
        tdm_status st = tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc: call '%s' to rank %d: %s", name, dst,
                                      rpc->peers.why[dst]);
        pthread_mutex_unlock(&rpc->mu);
        free(f);
        return st;
    }
    f->id = ++rpc->calls.next_id;
    f->fr_seq = tdm_rpc_fr_call(rpc, name, f->id, dst, nbytes);
    f->next = rpc->calls.pending;
    rpc->calls.pending = f;
    pthread_mutex_unlock(&rpc->mu);
    tdm_status st = deliver(rpc, dst, TDM_RPC_KIND_CALL, 0, f->id, name, args, nbytes, stall_ns, deadline_ns);
    if (st != TDM_STATUS_OK) {
        char msg[TDM_ERROR_MSG_MAX];
        if (st == TDM_STATUS_TIMEOUT)
            snprintf(msg, sizeof msg, "rpc: call #%llu '%s' to rank %d: %s", (unsigned long long)f->id, name,
                     dst, tdm_error_message());
        else
            snprintf(msg, sizeof msg, "%s", tdm_error_message());
        pthread_mutex_lock(&rpc->mu);
        if (rpc->peers.state[dst] != TDM_RPC_PEER_UP)
            snprintf(msg, sizeof msg, "rpc: call #%llu '%s' to rank %d: %s", (unsigned long long)f->id, name,
                     dst, rpc->peers.why[dst]);
        if (f->state == TDM_RPC_F_PENDING) {
            tdm_rpc_fr_end(rpc, f->fr_seq, st, msg);
            future_complete(rpc, f, st, msg, NULL, 0);
        }
        pthread_mutex_unlock(&rpc->mu);
    } else {
        /* sent: waiting for the reply (unless it came already) */
        pthread_mutex_lock(&rpc->mu);
        if (f->state == TDM_RPC_F_PENDING) tdm_rpc_fr_start(rpc, f->fr_seq);
        pthread_mutex_unlock(&rpc->mu);
    }
    *out = f;
    return TDM_STATUS_OK;
}

tdm_status tdm_rpc_call_async(tdm_rpc *rpc, int dst, const char *name, const void *args,
                              size_t nbytes, tdm_rpc_future **out)
{
    *out = NULL;
    TDM_REQUIRE(rpc, TDM_STATUS_INVALID_ARG, "rpc_call: NULL endpoint");
    return call_start(rpc, dst, name, args, nbytes, rpc->send_stall_ns, UINT64_MAX, out);
}

int tdm_rpc_future_done(const tdm_rpc_future *f)
{
    tdm_rpc *rpc = f->rpc;
    pthread_mutex_lock(&rpc->mu);
    int done = f->state != TDM_RPC_F_PENDING;
    pthread_mutex_unlock(&rpc->mu);
    return done;
}

tdm_status tdm_rpc_future_wait(tdm_rpc_future *f, int64_t timeout_ms, void **reply,
                               size_t *reply_nbytes)
{
    if (reply) *reply = NULL;
    if (reply_nbytes) *reply_nbytes = 0;
    TDM_REQUIRE(f, TDM_STATUS_INVALID_ARG, "rpc_future_wait: NULL future");
    tdm_rpc *rpc = f->rpc;
    uint64_t t0 = tdm_time_ns();
    pthread_mutex_lock(&rpc->mu);
    while (f->state == TDM_RPC_F_PENDING) {
        uint64_t now = tdm_time_ns();
        if (timeout_ms >= 0 && now - t0 >= (uint64_t)timeout_ms * 1000000u) {
            pthread_mutex_unlock(&rpc->mu);
            tdm_status st = tdm_error_set(TDM_STATUS_TIMEOUT,
                                          "rpc: call #%llu '%s' to rank %d: no reply within %lld ms (still "
                                          "pending)", (unsigned long long)f->id, f->name, f->dst,
                                          (long long)timeout_ms);
            /* a wait that gives up is the recorder's failure (a short
             * poll is not: it is waited again) */
            if (timeout_ms >= TDM_RPC_FR_TIMEOUT_MS) tdm_rpc_fr_failure(rpc, st, tdm_error_message());
            return st;
        }
        /* a dead callee never replies: look at it between naps */
        if (rpc->peers.state[f->dst] == TDM_RPC_PEER_UP && f->dst != rpc->rank) {
            char why[160];
            int dst = f->dst;
            pthread_mutex_unlock(&rpc->mu);
            int gone = rpc->ops->peer_gone(rpc, dst, why, sizeof why);
            if (gone) tdm_rpc_peer_lost(rpc, dst, TDM_RPC_PEER_GONE, why);
            pthread_mutex_lock(&rpc->mu);
            if (f->state != TDM_RPC_F_PENDING) break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += TDM_RPC_CHECK_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&rpc->cv, &rpc->mu, &ts);
    }
    if (f->state == TDM_RPC_F_TAKEN) {
        pthread_mutex_unlock(&rpc->mu);
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc: call #%llu '%s': its result was taken already",
                             (unsigned long long)f->id, f->name);
    }
    f->state = TDM_RPC_F_TAKEN;
    tdm_status st = f->st;
    if (st != TDM_STATUS_OK) tdm_error_set(st, "%s", f->err ? f->err : tdm_status_name(st));
    if (reply) *reply = f->reply;
    else free(f->reply);
    if (reply_nbytes) *reply_nbytes = f->reply_nbytes;
    f->reply = NULL;
    pthread_mutex_unlock(&rpc->mu);
    return st;
}

void tdm_rpc_future_free(tdm_rpc_future *f)
{
    if (!f) return;
    tdm_rpc *rpc = f->rpc;
    pthread_mutex_lock(&rpc->mu);
    if (f->state == TDM_RPC_F_PENDING) {
        f->detached = 1;   /* freed when its reply or failure arrives */
        pthread_mutex_unlock(&rpc->mu);
        return;
    }
    pthread_mutex_unlock(&rpc->mu);
    free(f->err);
    free(f->reply);
    free(f);
}

tdm_status tdm_rpc_call(tdm_rpc *rpc, int dst, const char *name, const void *args,
                        size_t nbytes, void **reply, size_t *reply_nbytes, int64_t timeout_ms)
{
    tdm_rpc_future *f = NULL;
    if (reply) *reply = NULL;
    if (reply_nbytes) *reply_nbytes = 0;
    TDM_REQUIRE(rpc, TDM_STATUS_INVALID_ARG, "rpc_call: NULL endpoint");
    uint64_t stall = rpc->send_stall_ns, t0 = tdm_time_ns();
    if (timeout_ms >= 0 && (uint64_t)timeout_ms * 1000000u < stall) stall = (uint64_t)timeout_ms * 1000000u;
    /* the whole send within the call's timeout too: a peer that takes a
     * trickle (the kernel's buffers, not its reader) never stalls */
    uint64_t deadline = timeout_ms >= 0 ? t0 + (uint64_t)timeout_ms * 1000000u : UINT64_MAX;
    TDM_CHECK(call_start(rpc, dst, name, args, nbytes, stall, deadline, &f));
    /* the send took part of the timeout */
    int64_t left = timeout_ms;
    if (timeout_ms >= 0) {
        int64_t spent = (int64_t)((tdm_time_ns() - t0) / 1000000u);
        left = spent < timeout_ms ? timeout_ms - spent : 0;
    }
    tdm_status st = tdm_rpc_future_wait(f, left, reply, reply_nbytes);
    tdm_rpc_future_free(f);
    return st;
}

int tdm_rpc_peer_alive(tdm_rpc *rpc, int rank, char *why, size_t n)
{
    if (rank < 0 || rank >= rpc->world) {
        snprintf(why, n, "rank %d is not in the job", rank);
        return 0;
    }
    if (rank == rpc->rank) return 1;
    char w[160];
    if (rpc->ops->peer_gone(rpc, rank, w, sizeof w)) tdm_rpc_peer_lost(rpc, rank, TDM_RPC_PEER_GONE, w);
    pthread_mutex_lock(&rpc->mu);
    int up = rpc->peers.state[rank] == TDM_RPC_PEER_UP;
    if (!up) snprintf(why, n, "%s", rpc->peers.why[rank]);
    pthread_mutex_unlock(&rpc->mu);
    return up;
}

/* --- set-up and tear-down ----------------------------------------------- */

tdm_status tdm_rpc_init(tdm_rpc **out, const tdm_rpc_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    TDM_REQUIRE(opts, TDM_STATUS_INVALID_ARG, "rpc_init: NULL options");
    tdm_rpc *rpc = calloc(1, sizeof *rpc);
    TDM_REQUIRE(rpc, TDM_STATUS_OUT_OF_MEMORY, "rpc_init: no memory");
    pthread_mutex_init(&rpc->mu, NULL);
    pthread_cond_init(&rpc->cv, NULL);
    for (int i = 0; i < TDM_RPC_MAX_RANKS; i++) pthread_mutex_init(&rpc->send_mu[i], NULL);
    rpc->opts = *opts;
    rpc->max_msg = opts->max_msg_bytes ? opts->max_msg_bytes : TDM_RPC_DEFAULT_MAX_MSG_BYTES;
    rpc->send_stall_ns = (uint64_t)(opts->send_stall_ms > 0 ? opts->send_stall_ms : TDM_RPC_DEFAULT_SEND_STALL_MS) *
                         1000000u;
    if (opts->comm) {
        rpc->rank = tdm_comm_rank(opts->comm);
        rpc->world = tdm_comm_size(opts->comm);
    } else {
        rpc->rank = opts->rank;
        rpc->world = opts->world;
    }
    if (rpc->world < 1 || rpc->world > TDM_RPC_MAX_RANKS || rpc->rank < 0 || rpc->rank >= rpc->world) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc_init: rank %d of world %d (world 1..%d)", rpc->rank,
                           rpc->world, TDM_RPC_MAX_RANKS);
        goto fail;
    }
    TDM_TRY(tdm_rpc_barrier_register(rpc));
    TDM_TRY(tdm_rpc_fr_open(rpc));
    if (opts->transport == TDM_RPC_SHM) {
        if (!opts->comm) {
            st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                               "rpc_init: the shm transport needs the job's communicator (opts.comm)");
            goto fail;
        }
        TDM_TRY(tdm_rpc_shm_open(rpc));
    } else if (opts->transport == TDM_RPC_TCP) {
        TDM_TRY(tdm_rpc_tcp_open(rpc));
    } else {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc_init: unknown transport %d", (int)opts->transport);
        goto fail;
    }
    int ret = pthread_create(&rpc->reader, NULL, reader_main, rpc);
    if (ret) {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "rpc_init: pthread_create (reader): %s", strerror(ret));
        goto fail;
    }
    rpc->reader_running = 1;
    ret = pthread_create(&rpc->server, NULL, server_main, rpc);
    if (ret) {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "rpc_init: pthread_create (server): %s", strerror(ret));
        goto fail;
    }
    rpc->server_running = 1;
    *out = rpc;
    return TDM_STATUS_OK;
fail:
    tdm_rpc_free(rpc);
    return st;
}

void tdm_rpc_free(tdm_rpc *rpc)
{
    if (!rpc) return;
    if (rpc->server_running) {
        /* serve what has arrived (a barrier's release is answered after
         * its effect is seen here), bounded: a peer that does not read
         * its replies does not hold this rank up */
        uint64_t t0 = tdm_time_ns();
        pthread_mutex_lock(&rpc->mu);
        while ((rpc->queue.head || rpc->queue.serving) &&
               tdm_time_ns() - t0 < (uint64_t)TDM_RPC_DRAIN_MS * 1000000u) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += TDM_RPC_CHECK_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&rpc->cv, &rpc->mu, &ts);
        }
        pthread_mutex_unlock(&rpc->mu);
    }
    if (rpc->reader_running) {
        /* tell the peers first: their calls to this rank fail at once; a
         * peer that reads nothing is not waited for long */
        uint64_t bye_stall_ns = (uint64_t)TDM_RPC_BYE_STALL_MS * 1000000u;
        for (int r = 0; r < rpc->world; r++) {
            if (r == rpc->rank) continue;
            pthread_mutex_lock(&rpc->mu);
            int up = rpc->peers.state[r] == TDM_RPC_PEER_UP;
            pthread_mutex_unlock(&rpc->mu);
            if (up) (void)deliver(rpc, r, TDM_RPC_KIND_BYE, 0, 0, NULL, NULL, 0, bye_stall_ns, UINT64_MAX);
        }
    }
    atomic_store_explicit(&rpc->stopping, 1, memory_order_release);
    pthread_mutex_lock(&rpc->mu);
    pthread_cond_broadcast(&rpc->cv);
    pthread_mutex_unlock(&rpc->mu);
    if (rpc->ops && rpc->ops->wake) rpc->ops->wake(rpc);
    if (rpc->reader_running) pthread_join(rpc->reader, NULL);
    if (rpc->server_running) pthread_join(rpc->server, NULL);
    /* the record as the failure left it, before the calls still
     * pending are failed below */
    tdm_rpc_fr_dump_failed(rpc);
    pthread_mutex_lock(&rpc->mu);
    fail_pending_to(rpc, -1, "this rank's RPC endpoint was freed", 0);
    while (rpc->queue.head) {
        tdm_rpc_msg *m = rpc->queue.head;
        rpc->queue.head = m->next;
        free(m->body);
        free(m);
    }
    pthread_mutex_unlock(&rpc->mu);
    if (rpc->ops) rpc->ops->close(rpc);
    tdm_rref_table_free(rpc);
    tdm_rpc_fr_close(rpc);
    for (int i = 0; i < TDM_RPC_MAX_RANKS; i++) {
        free(rpc->dec[i].body);
        pthread_mutex_destroy(&rpc->send_mu[i]);
    }
    pthread_cond_destroy(&rpc->cv);
    pthread_mutex_destroy(&rpc->mu);
    free(rpc);
}
