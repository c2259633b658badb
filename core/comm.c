/* core/comm.c: the communicator dispatcher: names of dtypes, ops and
 * collectives, argument checks, and the per-communicator progress thread
 * that runs asynchronous calls in issue order.
 * It knows nothing of shared memory or NCCL: backends plug in through
 * tdm_comm_ops (core/comm_impl.h). */
#include "core/comm_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "core/flight.h"
#include "core/log.h"

struct tdm_comm_work {
    tdm_comm_call call;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;                 /* under mu */
    tdm_status status;        /* valid once done */
    char msg[TDM_ERROR_MSG_MAX];
    atomic_int refs;          /* the caller's handle + the queue's */
    uint64_t fr_seq;          /* its flight-recorder entry */
    tdm_fr *fr;               /* borrowed from the communicator; NULL: off */
    const tdm_comm *comm;     /* borrowed, for messages (the handle must not outlive it) */
    tdm_comm_work *next;      /* queue link, under comm->mu */
};

struct tdm_comm {
    const tdm_comm_ops *ops;  /* borrowed: static in the backend */
    void *impl;
    int rank, size;
    /* Progress thread. `pending` counts submitted works not yet completed;
     * it is written under mu but read without it by the submitting thread
     * (the only thread that makes it grow), so the fast synchronous path
     * takes no lock when nothing is queued. Release on completion pairs
     * with the acquire load in tdm_comm_run. */
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* queue became non-empty, or stop */
    tdm_comm_work *head, *tail;
    atomic_int pending;
    int thread_started, stop;
    pthread_t thread;
    tdm_fr *fr;               /* flight recorder (core/flight.h); NULL: off */
    /* Sub-communicators (core/comm_split.c): each rank's job rank (NULL:
     * the identity, a communicator that was never split), and the splits
     * made of this one so far. */
    int *job_ranks;
    int splits;
    /* What this rank handed each kind of call (tdm_comm_traffic_get):
     * completed calls and their payload bytes. Written by the one thread
     * that runs calls at a time, read by any: relaxed atomics. */
    atomic_llong traffic_calls[TDM_COLL_COUNT_];
    atomic_llong traffic_bytes[TDM_COLL_COUNT_];
};

static const char *const tdm_dtype_names[TDM_DTYPE_COUNT_] = {
    [TDM_DTYPE_FLOAT32] = "float32", [TDM_DTYPE_FLOAT64] = "float64",
    [TDM_DTYPE_INT32] = "int32", [TDM_DTYPE_INT64] = "int64",
    [TDM_DTYPE_BFLOAT16] = "bfloat16", [TDM_DTYPE_FLOAT16] = "float16",
};
static const size_t tdm_dtype_sizes[TDM_DTYPE_COUNT_] = {
    [TDM_DTYPE_FLOAT32] = 4, [TDM_DTYPE_FLOAT64] = 8,
    [TDM_DTYPE_INT32] = 4, [TDM_DTYPE_INT64] = 8,
    [TDM_DTYPE_BFLOAT16] = 2, [TDM_DTYPE_FLOAT16] = 2,
};
static const char *const tdm_redop_names[TDM_REDOP_COUNT_] = {
    [TDM_REDOP_SUM] = "sum", [TDM_REDOP_PROD] = "prod", [TDM_REDOP_MIN] = "min",
    [TDM_REDOP_MAX] = "max", [TDM_REDOP_AVG] = "avg",
};
static const char *const tdm_coll_names[TDM_COLL_COUNT_] = {
    [TDM_COLL_BROADCAST] = "broadcast", [TDM_COLL_REDUCE] = "reduce",
    [TDM_COLL_ALL_REDUCE] = "all_reduce", [TDM_COLL_REDUCE_SCATTER] = "reduce_scatter",
    [TDM_COLL_ALL_GATHER] = "all_gather", [TDM_COLL_GATHER] = "gather",
    [TDM_COLL_SCATTER] = "scatter", [TDM_COLL_BARRIER] = "barrier",
    [TDM_COLL_SEND] = "send", [TDM_COLL_RECV] = "recv",
};

size_t tdm_dtype_size(tdm_dtype dt)
{
    return (unsigned)dt < TDM_DTYPE_COUNT_ ? tdm_dtype_sizes[dt] : 0;
}
const char *tdm_dtype_name(tdm_dtype dt)
{
    return (unsigned)dt < TDM_DTYPE_COUNT_ ? tdm_dtype_names[dt] : "?";
}
const char *tdm_redop_name(tdm_redop op)
{
    return (unsigned)op < TDM_REDOP_COUNT_ ? tdm_redop_names[op] : "?";
}
const char *tdm_coll_name(tdm_coll c)
{
    return (unsigned)c < TDM_COLL_COUNT_ ? tdm_coll_names[c] : "?";
}

/* --- 16-bit floats --------------------------------------------------------- */

static uint32_t tdm_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float tdm_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float tdm_bf16_to_f32(uint16_t h) { return tdm_bits_f32((uint32_t)h << 16); }

uint16_t tdm_f32_to_bf16(float f)
{
    uint32_t u = tdm_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1);   /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

float tdm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return tdm_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {   /* zero or subnormal: m * 2^-24 */
        float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    return tdm_bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t tdm_f32_to_f16(float f)
{
    uint32_t u = tdm_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;               /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00;               /* rounds to inf */
    if (a < 0x38800000u) {                                    /* subnormal or 0 */
        /* value * 2^24, rounded to nearest even by the float unit */
        float v = tdm_bits_f32(a) * 0x1p24f;   /* exact: a power-of-two scale */
        uint32_t m = (uint32_t)v;
        float frac = v - (float)m;               /* exact: v < 2^10 */
        if (frac > 0.5f || (frac == 0.5f && (m & 1))) m++;
        return sign | (uint16_t)m;
    }
    uint32_t e = (a >> 23) - 112, m = a & 0x7fffffu;
    uint32_t h = (e << 10) | (m >> 13);
    uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;   /* ties to even; may carry */
    return sign | (uint16_t)h;
}

tdm_status tdm_dtype_parse(const char *s, tdm_dtype *out)
{
    if (s && !strcasecmp(s, "float")) s = "float32";
    if (s && !strcasecmp(s, "double")) s = "float64";
    if (s && !strcasecmp(s, "bf16")) s = "bfloat16";
    if (s && (!strcasecmp(s, "fp16") || !strcasecmp(s, "half"))) s = "float16";
    for (int i = 0; s && i < TDM_DTYPE_COUNT_; i++)
        if (!strcasecmp(s, tdm_dtype_names[i])) { *out = (tdm_dtype)i; return TDM_STATUS_OK; }
    return tdm_error_set(TDM_STATUS_INVALID_ARG,
                         "unknown dtype '%s' (expected float|float32|double|float64|int32|int64|"
                         "bfloat16|bf16|float16|fp16)",
                         s ? s : "(null)");
}
tdm_status tdm_redop_parse(const char *s, tdm_redop *out)
{
    for (int i = 0; s && i < TDM_REDOP_COUNT_; i++)
        if (!strcasecmp(s, tdm_redop_names[i])) { *out = (tdm_redop)i; return TDM_STATUS_OK; }
    return tdm_error_set(TDM_STATUS_INVALID_ARG,
                         "unknown reduction op '%s' (expected sum|prod|min|max|avg)",
                         s ? s : "(null)");
}
tdm_status tdm_coll_parse(const char *s, tdm_coll *out)
{
    for (int i = 0; s && i < TDM_COLL_COUNT_; i++)
        if (!strcasecmp(s, tdm_coll_names[i])) { *out = (tdm_coll)i; return TDM_STATUS_OK; }
    return tdm_error_set(TDM_STATUS_INVALID_ARG,
                         "unknown collective '%s' (expected all_reduce|broadcast|reduce|"
                         "reduce_scatter|all_gather|gather|scatter|barrier|send|recv)", s ? s : "(null)");
}

/* --- lifecycle ---------------------------------------------------------- */

tdm_status tdm_comm_create(tdm_comm **out, const tdm_comm_ops *ops, void *impl,
                           int rank, int size)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_comm *c = NULL;
    if (!out || !ops || !ops->run || !ops->abort || !ops->destroy) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                           "tdm_comm_create: out, ops, ops->run/abort/destroy are required");
        goto fail;
    }
    if (size < 1 || rank < 0 || rank >= size) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "tdm_comm_create: rank %d of size %d",
                           rank, size);
        goto fail;
    }
    c = calloc(1, sizeof *c);
    if (!c) { st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "tdm_comm_create: calloc"); goto fail; }
    if ((st = tdm_fr_init(&c->fr, rank, size, ops->name))) { free(c); goto fail; }
    c->ops = ops;
    c->impl = impl;
    c->rank = rank;
    c->size = size;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    atomic_init(&c->pending, 0);
    *out = c;
    return TDM_STATUS_OK;
fail:
    if (ops && ops->destroy && impl) ops->destroy(impl);
    return st;
}

void *tdm_comm_impl(const tdm_comm *comm) { return comm ? comm->impl : NULL; }

void tdm_comm_traffic_get(const tdm_comm *comm, tdm_comm_traffic *out)
{
    memset(out, 0, sizeof *out);
    if (!comm) return;
    tdm_comm *c = (tdm_comm *)comm;
    for (int i = 0; i < TDM_COLL_COUNT_; i++) {
        out->calls[i] = atomic_load_explicit(&c->traffic_calls[i], memory_order_relaxed);
        out->bytes[i] = atomic_load_explicit(&c->traffic_bytes[i], memory_order_relaxed);
    }
}

int64_t tdm_comm_traffic_ring_sent(const tdm_comm_traffic *t, int size)
{
    if (size < 2) return 0;
    int64_t n = size;
    return 2 * (n - 1) * t->bytes[TDM_COLL_ALL_REDUCE] / n +
           (n - 1) * (t->bytes[TDM_COLL_REDUCE_SCATTER] + t->bytes[TDM_COLL_ALL_GATHER]) / n +
           t->bytes[TDM_COLL_SEND];
}

int tdm_comm_job_rank(const tdm_comm *comm, int rank)
{
    if (!comm || rank < 0 || rank >= comm->size) return -1;
    return comm->job_ranks ? comm->job_ranks[rank] : rank;
}

const char *tdm_comm_rank_str(const tdm_comm *comm, int rank, char *buf, size_t n)
{
    int j = tdm_comm_job_rank(comm, rank);
    if (!comm || !comm->job_ranks || j < 0) snprintf(buf, n, "rank %d", rank);
    else snprintf(buf, n, "rank %d (job rank %d)", rank, j);
    return buf;
}

tdm_status tdm_comm_set_job_ranks(tdm_comm *comm, const int *job_ranks)
{
    int *j = malloc((size_t)comm->size * sizeof *j);
    TDM_REQUIRE(j, TDM_STATUS_OUT_OF_MEMORY, "communicator: cannot allocate %d job ranks",
                comm->size);
    memcpy(j, job_ranks, (size_t)comm->size * sizeof *j);
    free(comm->job_ranks);
    comm->job_ranks = j;
    return TDM_STATUS_OK;
}

int tdm_comm_next_split(tdm_comm *comm) { return comm->splits++; }

tdm_status tdm_comm_backend_split(tdm_comm *comm, const tdm_comm_split_info *info,
                                  tdm_comm **out)
{
    TDM_REQUIRE(comm->ops->split, TDM_STATUS_UNSUPPORTED,
                "comm split: the %s backend cannot split a communicator", comm->ops->name);
    return comm->ops->split(comm->impl, info, out);
}
int tdm_comm_rank(const tdm_comm *comm) { return comm->rank; }
int tdm_comm_size(const tdm_comm *comm) { return comm->size; }
const char *tdm_comm_backend_name(const tdm_comm *comm) { return comm->ops->name; }

const char *tdm_comm_last_algo(const tdm_comm *comm)
{
    const char *a = comm->ops->last_algo ? comm->ops->last_algo(comm->impl) : NULL;
    return a ? a : "default";
}

static void tdm_comm_work_unref(tdm_comm_work *w)
{
    /* acq_rel: the last owner must see every write of the other. */
    if (atomic_fetch_sub_explicit(&w->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
    }
}

void tdm_comm_free(tdm_comm *comm)
{
    if (!comm) return;
    if (comm->thread_started) {
        pthread_mutex_lock(&comm->mu);
        comm->stop = 1;
        pthread_cond_signal(&comm->cv);
        pthread_mutex_unlock(&comm->mu);
        pthread_join(comm->thread, NULL);
    }
    comm->ops->destroy(comm->impl);
    tdm_fr_free(comm->fr);
    free(comm->job_ranks);
    pthread_mutex_destroy(&comm->mu);
    pthread_cond_destroy(&comm->cv);
    free(comm);
}

/* --- argument checks and dispatch -------------------------------------- */

static int tdm_comm_coll_reduces(tdm_coll c)
{
    return c == TDM_COLL_REDUCE || c == TDM_COLL_ALL_REDUCE || c == TDM_COLL_REDUCE_SCATTER;
}

static int tdm_comm_coll_rooted(tdm_coll c)
{
    return c == TDM_COLL_BROADCAST || c == TDM_COLL_REDUCE || c == TDM_COLL_GATHER ||
           c == TDM_COLL_SCATTER || c == TDM_COLL_SEND || c == TDM_COLL_RECV;
}

tdm_status tdm_comm_call_check(const tdm_comm *comm, const tdm_comm_call *k)
{
    TDM_REQUIRE(comm, TDM_STATUS_INVALID_ARG, "communicator is NULL");
    TDM_REQUIRE(k && (unsigned)k->coll < TDM_COLL_COUNT_, TDM_STATUS_INVALID_ARG,
                "invalid collective %d", k ? (int)k->coll : -1);
    const char *name = tdm_coll_name(k->coll);
    if (k->coll == TDM_COLL_BARRIER) return TDM_STATUS_OK;
    TDM_REQUIRE((unsigned)k->dtype < TDM_DTYPE_COUNT_, TDM_STATUS_INVALID_ARG,
                "%s: invalid dtype %d (expected a tdm_dtype)", name, (int)k->dtype);
    TDM_REQUIRE(comm->ops->half_types ||
                    (k->dtype != TDM_DTYPE_BFLOAT16 && k->dtype != TDM_DTYPE_FLOAT16),
                TDM_STATUS_UNSUPPORTED, "%s: the %s backend does not support %s", name,
                comm->ops->name, tdm_dtype_name(k->dtype));
    if (tdm_comm_coll_reduces(k->coll))
        TDM_REQUIRE((unsigned)k->op < TDM_REDOP_COUNT_, TDM_STATUS_INVALID_ARG,
                    "%s: invalid reduction op %d (expected a tdm_redop)", name, (int)k->op);
    int root = k->root;
    if (tdm_comm_coll_rooted(k->coll)) {
        const char *what = (k->coll == TDM_COLL_SEND || k->coll == TDM_COLL_RECV) ? "peer" : "root";
        TDM_REQUIRE(root >= 0 && root < comm->size, TDM_STATUS_INVALID_ARG,
                    "%s: %s %d out of range (communicator has %d ranks)", name, what, root,
                    comm->size);
        if (k->coll == TDM_COLL_SEND || k->coll == TDM_COLL_RECV)
            TDM_REQUIRE(root != comm->rank, TDM_STATUS_INVALID_ARG,
                        "%s: peer %d is this rank", name, root);
    }
    size_t es = tdm_dtype_size(k->dtype), total;
    /* count * es * size must fit a size_t (a multiplication: this runs on
     * every call, and two divisions cost more than the rest of the checks) */
    TDM_REQUIRE(!__builtin_mul_overflow(k->count, es * (size_t)comm->size, &total),
                TDM_STATUS_INVALID_ARG, "%s: count %zu too large", name, k->count);
    if (k->count == 0) return TDM_STATUS_OK;
    int me_root = root == comm->rank;
    int need_send = 1, need_recv = 1;
    switch (k->coll) {
    case TDM_COLL_BROADCAST: need_send = me_root; break;
    case TDM_COLL_REDUCE: case TDM_COLL_GATHER: need_recv = me_root; break;
    case TDM_COLL_SCATTER: need_send = me_root; break;
    case TDM_COLL_SEND: need_recv = 0; break;
    case TDM_COLL_RECV: need_send = 0; break;
    default: break;
    }
    TDM_REQUIRE(!need_send || k->sendbuf, TDM_STATUS_INVALID_ARG,
                "%s: sendbuf is NULL with count %zu", name, k->count);
    TDM_REQUIRE(!need_recv || k->recvbuf, TDM_STATUS_INVALID_ARG,
                "%s: recvbuf is NULL with count %zu", name, k->count);
    return TDM_STATUS_OK;
}

/* The payload of a call in bytes (tdm_comm_traffic): the buffer it
 * reduces, gathers or moves, whole. */
static long long tdm_comm_payload(const tdm_comm *comm, const tdm_comm_call *k)
{
    long long b = (long long)k->count * (long long)tdm_dtype_size(k->dtype);
    switch (k->coll) {
    case TDM_COLL_REDUCE_SCATTER:
    case TDM_COLL_ALL_GATHER:
    case TDM_COLL_GATHER:
    case TDM_COLL_SCATTER:
        return b * comm->size;
    case TDM_COLL_BARRIER:
        return 0;
    default:
        return b;
    }
}

static tdm_status tdm_comm_exec(tdm_comm *comm, const tdm_comm_call *k)
{
    tdm_status st = comm->ops->run(comm->impl, k);
    if (st == TDM_STATUS_OK && (unsigned)k->coll < TDM_COLL_COUNT_) {
        atomic_fetch_add_explicit(&comm->traffic_calls[k->coll], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&comm->traffic_bytes[k->coll], tdm_comm_payload(comm, k),
                                  memory_order_relaxed);
    }
    TDM_TRACE(CORE, "%s %s(%s, count=%zu) -> %s", comm->ops->name, tdm_coll_name(k->coll),
              tdm_dtype_name(k->dtype), k->count, tdm_status_name(st));
    return st;
}

static tdm_status tdm_comm_queue(tdm_comm *comm, const tdm_comm_call *call, int async,
                                 tdm_comm_work **out);

tdm_status tdm_comm_run(tdm_comm *comm, const tdm_comm_call *call)
{
    TDM_CHECK(tdm_comm_call_check(comm, call));
    tdm_comm_call k = *call;
    k.async = 0;
    k.token = NULL;
    call = &k;
    /* Acquire pairs with the release decrement in tdm_comm_progress: when
     * no work is pending, the progress thread has finished touching the
     * backend and this thread may call it directly. */
    if (atomic_load_explicit(&comm->pending, memory_order_acquire) == 0) {
        if (!comm->fr) return tdm_comm_exec(comm, call);
        uint64_t seq = tdm_fr_begin(comm->fr, call, TDM_FR_RUNNING);
        tdm_status st = tdm_comm_exec(comm, call);
        tdm_fr_end(comm->fr, seq, st);
        return st;
    }
    /* Earlier asynchronous calls are queued: go behind them. */
    tdm_comm_work *w = NULL;
    TDM_CHECK(tdm_comm_queue(comm, call, 0, &w));
    tdm_status st = tdm_comm_work_wait(w, -1);
    tdm_comm_work_free(w);
    return st;
}

tdm_status tdm_comm_run_inner(tdm_comm *comm, const tdm_comm_call *call, int async)
{
    TDM_CHECK(tdm_comm_call_check(comm, call));
    TDM_REQUIRE(atomic_load_explicit(&comm->pending, memory_order_acquire) == 0,
                TDM_STATUS_INTERNAL, "%s: tdm_comm_run_inner on a communicator with queued calls",
                comm->ops->name);
    tdm_comm_call k = *call;
    k.async = async ? 1 : 0;
    k.token = NULL;
    return tdm_comm_exec(comm, &k);
}

/* --- progress thread ---------------------------------------------------- */

static void *tdm_comm_progress(void *arg)
{
    tdm_comm *comm = arg;
    pthread_mutex_lock(&comm->mu);
    for (;;) {
        while (!comm->head && !comm->stop) pthread_cond_wait(&comm->cv, &comm->mu);
        if (!comm->head) break;     /* stop requested and queue drained */
        tdm_comm_work *w = comm->head;
        comm->head = w->next;
        if (!comm->head) comm->tail = NULL;
        pthread_mutex_unlock(&comm->mu);

        tdm_error_clear();
        if (comm->fr) tdm_fr_start(comm->fr, w->fr_seq);
        tdm_status st = tdm_comm_exec(comm, &w->call);
        if (comm->fr) tdm_fr_end(comm->fr, w->fr_seq, st);
        pthread_mutex_lock(&w->mu);
        w->status = st;
        snprintf(w->msg, sizeof w->msg, "%s", st ? tdm_error_message() : "");
        w->done = 1;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        /* Release pairs with the acquire load in tdm_comm_run. */
        atomic_fetch_sub_explicit(&comm->pending, 1, memory_order_release);
        tdm_comm_work_unref(w);

        pthread_mutex_lock(&comm->mu);
    }
    pthread_mutex_unlock(&comm->mu);
    return NULL;
}

tdm_status tdm_comm_submit(tdm_comm *comm, const tdm_comm_call *call, tdm_comm_work **out)
{
    return tdm_comm_queue(comm, call, 1, out);
}

/* Queues a call for the progress thread; async: issued asynchronously
 * (see tdm_comm_call.async), not a synchronous call queued behind. */
static tdm_status tdm_comm_queue(tdm_comm *comm, const tdm_comm_call *call, int async,
                                 tdm_comm_work **out)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "%s_async: out is NULL",
                call ? tdm_coll_name(call->coll) : "?");
    *out = NULL;
    TDM_CHECK(tdm_comm_call_check(comm, call));
    tdm_comm_work *w = calloc(1, sizeof *w);
    TDM_REQUIRE(w, TDM_STATUS_OUT_OF_MEMORY, "%s_async: calloc", tdm_coll_name(call->coll));
    w->call = *call;
    w->call.async = async;
    w->call.token = NULL;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    atomic_init(&w->refs, 2);

    pthread_mutex_lock(&comm->mu);
    if (!comm->thread_started) {
        int rc = pthread_create(&comm->thread, NULL, tdm_comm_progress, comm);
        if (rc) {
            pthread_mutex_unlock(&comm->mu);
            pthread_mutex_destroy(&w->mu);
            pthread_cond_destroy(&w->cv);
            free(w);
            return tdm_error_set(TDM_STATUS_SYSTEM, "communicator progress thread: "
                                 "pthread_create: %s", strerror(rc));
        }
        comm->thread_started = 1;
    }
    /* Last before queuing (nothing can fail after it, so a token always
     * reaches run); under comm->mu, so calls are prepared in queue order. */
    if (comm->ops->prepare) {
        tdm_status pst = comm->ops->prepare(comm->impl, &w->call);
        if (pst != TDM_STATUS_OK) {
            pthread_mutex_unlock(&comm->mu);
            pthread_mutex_destroy(&w->mu);
            pthread_cond_destroy(&w->cv);
            free(w);
            return pst;
        }
    }
    /* under comm->mu, before the progress thread can see the work */
    w->fr = comm->fr;
    w->comm = comm;
    if (comm->fr) w->fr_seq = tdm_fr_begin(comm->fr, &w->call, TDM_FR_QUEUED);
    atomic_fetch_add_explicit(&comm->pending, 1, memory_order_relaxed);
    if (comm->tail) comm->tail->next = w; else comm->head = w;
    comm->tail = w;
    pthread_cond_signal(&comm->cv);
    pthread_mutex_unlock(&comm->mu);
    *out = w;
    return TDM_STATUS_OK;
}

tdm_status tdm_comm_work_wait(tdm_comm_work *w, int64_t timeout_ms)
{
    TDM_REQUIRE(w, TDM_STATUS_INVALID_ARG, "tdm_comm_work_wait: work is NULL");
    struct timespec dl;
    if (timeout_ms >= 0) {
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += timeout_ms / 1000;
        dl.tv_nsec += (timeout_ms % 1000) * 1000000;
        if (dl.tv_nsec >= 1000000000) { dl.tv_sec++; dl.tv_nsec -= 1000000000; }
    }
    pthread_mutex_lock(&w->mu);
    while (!w->done) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&w->cv, &w->mu);
        } else if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT && !w->done) {
            pthread_mutex_unlock(&w->mu);
            /* a send or recv names its peer: the rank that has not matched it */
            char peer[64] = "", who[48], why[256];
            if (w->call.coll == TDM_COLL_SEND || w->call.coll == TDM_COLL_RECV)
                snprintf(peer, sizeof peer, " %s %s", w->call.coll == TDM_COLL_SEND ? "to" : "from",
                         tdm_comm_rank_str(w->comm, w->call.root, who, sizeof who));
            snprintf(why, sizeof why, "%s(%s, count=%zu)%s: still running after %lld ms",
                     tdm_coll_name(w->call.coll), tdm_dtype_name(w->call.dtype), w->call.count,
                     peer, (long long)timeout_ms);
            if (w->fr) tdm_fr_note_failure(w->fr, TDM_STATUS_TIMEOUT, why);
            return tdm_error_set(TDM_STATUS_TIMEOUT, "%s", why);
        }
    }
    tdm_status st = w->status;
    if (st) tdm_error_copy_from(w->msg);
    pthread_mutex_unlock(&w->mu);
    return st;
}

tdm_status tdm_comm_work_test(tdm_comm_work *w, int *done)
{
    TDM_REQUIRE(w && done, TDM_STATUS_INVALID_ARG, "tdm_comm_work_test: NULL argument");
    pthread_mutex_lock(&w->mu);
    *done = w->done;
    pthread_mutex_unlock(&w->mu);
    return TDM_STATUS_OK;
}

void tdm_comm_work_free(tdm_comm_work *w)
{
    if (w) tdm_comm_work_unref(w);
}

/* --- entry points ---------------------------------------------------------- */

#define TDM_CALL(c, sb, rb, n, dt, o, r)                                      \
    (tdm_comm_call){.coll = (c), .sendbuf = (sb), .recvbuf = (rb), .count = (n), \
                    .dtype = (dt), .op = (o), .root = (r)}

tdm_status tdm_comm_broadcast(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                              size_t count, tdm_dtype dtype, int root)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_BROADCAST, sendbuf, recvbuf, count, dtype, 0, root);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_reduce(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                           size_t count, tdm_dtype dtype, tdm_redop op, int root)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_REDUCE, sendbuf, recvbuf, count, dtype, op, root);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_all_reduce(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                               size_t count, tdm_dtype dtype, tdm_redop op)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_ALL_REDUCE, sendbuf, recvbuf, count, dtype, op, -1);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_reduce_scatter(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                   size_t recv_count, tdm_dtype dtype, tdm_redop op)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_REDUCE_SCATTER, sendbuf, recvbuf, recv_count, dtype,
                               op, -1);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_all_gather(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                               size_t send_count, tdm_dtype dtype)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_ALL_GATHER, sendbuf, recvbuf, send_count, dtype, 0, -1);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_gather(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                           size_t send_count, tdm_dtype dtype, int root)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_GATHER, sendbuf, recvbuf, send_count, dtype, 0, root);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_scatter(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                            size_t recv_count, tdm_dtype dtype, int root)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_SCATTER, sendbuf, recvbuf, recv_count, dtype, 0, root);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_barrier(tdm_comm *comm)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_BARRIER, NULL, NULL, 0, TDM_DTYPE_FLOAT32, 0, -1);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_send(tdm_comm *comm, const void *buf, size_t count, tdm_dtype dtype,
                         int peer)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_SEND, buf, NULL, count, dtype, 0, peer);
    return tdm_comm_run(comm, &k);
}
tdm_status tdm_comm_recv(tdm_comm *comm, void *buf, size_t count, tdm_dtype dtype, int peer)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_RECV, NULL, buf, count, dtype, 0, peer);
    return tdm_comm_run(comm, &k);
}

tdm_status tdm_comm_abort(tdm_comm *comm, const char *reason)
{
    TDM_REQUIRE(comm, TDM_STATUS_INVALID_ARG, "tdm_comm_abort: communicator is NULL");
    if (comm->fr)
        tdm_fr_note_failure(comm->fr, TDM_STATUS_ABORTED,
                            reason ? reason : "aborted by the application");
    return comm->ops->abort(comm->impl, reason ? reason : "aborted by the application");
}

/* --- flight recorder (core/flight.h) ------------------------------------ */

void tdm_comm_set_label(tdm_comm *comm, const char *fmt, ...)
{
    if (!comm || !comm->fr) return;
    char buf[TDM_FR_LABEL_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    tdm_fr_set_label(comm->fr, buf);
}

void tdm_comm_set_step(tdm_comm *comm, int64_t step)
{
    if (comm && comm->fr) tdm_fr_set_step(comm->fr, step);
}

void tdm_comm_fr_set_inner(tdm_comm *comm, int job_rank)
{
    if (comm) tdm_fr_set_inner(comm->fr, job_rank);
}

void tdm_comm_fr_set_primary(tdm_comm *comm)
{
    if (comm) tdm_fr_set_primary(comm->fr);
}

void tdm_comm_fr_set_group(tdm_comm *comm, const tdm_comm *parent, int seq, int color)
{
    if (!comm || !comm->fr || !comm->job_ranks) return;
    /* FNV-1a of (the parent's id, the split's number, the color): the
     * same on every member, another for every other split of the job */
    uint64_t h = 1469598103934665603ull;
    const uint64_t parts[3] = {parent && parent->fr ? tdm_fr_group(parent->fr) : 0,
                               (uint64_t)(int64_t)seq, (uint64_t)(int64_t)color};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 8; b++) h = (h ^ ((parts[i] >> (8 * b)) & 0xff)) * 1099511628211ull;
    tdm_fr_set_group(comm->fr, h, comm->job_ranks, comm->size);
}

void tdm_comm_fr_set_job(tdm_comm *comm, uint64_t job)
{
    if (comm) tdm_fr_set_job(comm->fr, job);
}

int tdm_comm_fr_dump(tdm_comm *comm, const char *reason)
{
    return comm && comm->fr ? tdm_fr_dump(comm->fr, reason) : -1;
}

tdm_status tdm_comm_alloc(tdm_comm *comm, size_t nbytes, void **ptr)
{
    TDM_REQUIRE(comm && ptr, TDM_STATUS_INVALID_ARG, "tdm_comm_alloc: NULL argument");
    TDM_REQUIRE(comm->ops->alloc, TDM_STATUS_UNSUPPORTED,
                "tdm_comm_alloc: the %s backend has no zero-copy memory", comm->ops->name);
    return comm->ops->alloc(comm->impl, nbytes, ptr);
}

tdm_status tdm_comm_all_gather_host(tdm_comm *comm, const int32_t *mine, int32_t *all, size_t n)
{
    TDM_REQUIRE(comm && mine && all, TDM_STATUS_INVALID_ARG, "all-gather (host): NULL argument");
    if (!comm->ops->host_copy) return tdm_comm_all_gather(comm, mine, all, n, TDM_DTYPE_INT32);
    size_t bytes = n * sizeof *mine, total = bytes * (size_t)comm->size;
    void *block = NULL;
    TDM_CHECK(tdm_comm_alloc(comm, total + bytes, &block));
    char *dev_all = block, *dev_mine = dev_all + total;
    TDM_CHECK(comm->ops->host_copy(comm->impl, dev_mine, mine, bytes, 1));
    TDM_CHECK(tdm_comm_all_gather(comm, dev_mine, dev_all, n, TDM_DTYPE_INT32));
    return comm->ops->host_copy(comm->impl, all, dev_all, total, 0);
}

tdm_status tdm_comm_all_reduce_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                     size_t count, tdm_dtype dtype, tdm_redop op,
                                     tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_ALL_REDUCE, sendbuf, recvbuf, count, dtype, op, -1);
    return tdm_comm_submit(comm, &k, out);
}
tdm_status tdm_comm_broadcast_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                    size_t count, tdm_dtype dtype, int root,
                                    tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_BROADCAST, sendbuf, recvbuf, count, dtype, 0, root);
    return tdm_comm_submit(comm, &k, out);
}
tdm_status tdm_comm_reduce_scatter_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                         size_t recv_count, tdm_dtype dtype, tdm_redop op,
                                         tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_REDUCE_SCATTER, sendbuf, recvbuf, recv_count, dtype,
                               op, -1);
    return tdm_comm_submit(comm, &k, out);
}
tdm_status tdm_comm_all_gather_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                     size_t send_count, tdm_dtype dtype, tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_ALL_GATHER, sendbuf, recvbuf, send_count, dtype, 0, -1);
    return tdm_comm_submit(comm, &k, out);
}
tdm_status tdm_comm_barrier_async(tdm_comm *comm, tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_BARRIER, NULL, NULL, 0, TDM_DTYPE_FLOAT32, 0, -1);
    return tdm_comm_submit(comm, &k, out);
}
tdm_status tdm_comm_isend(tdm_comm *comm, const void *buf, size_t count, tdm_dtype dtype,
                          int peer, tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_SEND, buf, NULL, count, dtype, 0, peer);
    return tdm_comm_submit(comm, &k, out);
}
tdm_status tdm_comm_irecv(tdm_comm *comm, void *buf, size_t count, tdm_dtype dtype, int peer,
                          tdm_comm_work **out)
{
    tdm_comm_call k = TDM_CALL(TDM_COLL_RECV, NULL, buf, count, dtype, 0, peer);
    return tdm_comm_submit(comm, &k, out);
}
