/* cuda/nccl_comm.c: the NCCL communicator behind core/comm.h (one rank per
 * process, for DDP on GPUs) and an NCCL group over the GPUs of one
 * process (for DP's replicate and reduce-add).
 *
 * Fail fast, never hang: every NCCL communicator is non-blocking
 * (ncclConfig_t.blocking = 0). After each enqueue the calling thread
 * watches it: it polls ncclCommGetAsyncError (errors NCCL detects), an
 * event recorded after the collective (completion), the abort flag
 * (tdm_comm_abort from any thread) and a deadline; on an error, an abort
 * or the deadline it calls ncclCommAbort, which stops the kernels still
 * waiting for peers, and returns a status naming what happened. Because
 * `run` only returns once its work is complete or aborted, that wait is
 * the watchdog: no NCCL work is ever outstanding outside a call.
 *
 * Not here: the device backend (cuda/device_cuda.c) and the async queue
 * (core/comm.c runs calls on its progress thread). */
#include "cuda/cuda.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/comm_impl.h"
#include "core/log.h"
#include "cuda/cuda_impl.h"

#define TDM_NCCL_DEFAULT_TIMEOUT_MS 300000

_Static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0, "ncclUniqueId size");

/* --- shared helpers ---------------------------------------------------------- */

static int64_t tdm_nccl_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t tdm_nccl_timeout(const tdm_nccl_opts *opts)
{
    if (opts && opts->timeout_ms > 0) return opts->timeout_ms;
    const char *e = getenv("TANDEM_NCCL_TIMEOUT_MS");
    if (e && *e) {
        char *end = NULL;
        long long v = strtoll(e, &end, 10);
        if (end && *end == '\0' && v > 0) return (int64_t)v;
        TDM_WARN(CUDA, "TANDEM_NCCL_TIMEOUT_MS='%s' is not a positive number; using %d ms", e,
                 TDM_NCCL_DEFAULT_TIMEOUT_MS);
    }
    return TDM_NCCL_DEFAULT_TIMEOUT_MS;
}

/* Poll politely: a few hundred quick checks (small collectives finish in
 * microseconds), then sleeps growing to 1 ms. */
static void tdm_nccl_backoff(int *polls)
{
    if (++*polls < 256) return;
    long ns = *polls < 1024 ? 10000 : *polls < 4096 ? 100000 : 1000000;
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

static tdm_status tdm_nccl_status_of(ncclResult_t r)
{
    switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return TDM_STATUS_INVALID_ARG;
    case ncclRemoteError: return TDM_STATUS_PEER_FAILED;
    default: return TDM_STATUS_SYSTEM;
    }
}

/* Every tdm_dtype has its NCCL type (callers validate dt < COUNT_). The
 * communicator does not take the 16-bit types (half_types 0: shm reduces
 * them in float32, NCCL in their own precision, so results would differ
 * by backend); the DP group helpers take them as NCCL does. */
static ncclDataType_t tdm_nccl_dtype(tdm_dtype dt)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT64: return ncclFloat64;
    case TDM_DTYPE_INT32: return ncclInt32;
    case TDM_DTYPE_INT64: return ncclInt64;
    case TDM_DTYPE_BFLOAT16: return ncclBfloat16;
    case TDM_DTYPE_FLOAT16: return ncclFloat16;
    case TDM_DTYPE_FLOAT32:
    default: return ncclFloat32;
    }
}

static ncclRedOp_t tdm_nccl_op(tdm_redop op)
{
    switch (op) {
    case TDM_REDOP_PROD: return ncclProd;
    case TDM_REDOP_MIN: return ncclMin;
    case TDM_REDOP_MAX: return ncclMax;
    case TDM_REDOP_AVG: return ncclAvg; /* integers: sum / n, truncated (NCCL's SumPostDiv) */
    case TDM_REDOP_SUM:
    default: return ncclSum;
    }
}

/* A set of NCCL communicators watched together (one for a rank, one per
 * GPU for a group). */
typedef struct tdm_nccl_watch {
    int n;
    ncclComm_t *comms;
    const int *devices;
    cudaEvent_t *events;       /* completion of the last enqueue; NULL: none */
    int64_t timeout_ms;
    atomic_int *abort_flag;    /* 0 running, 1 raised, 2 raised and reason written */
    const char *abort_reason;
    const char *(*ext_check)(void *ctx); /* tdm_nccl_opts.abort_check */
    void *ext_ctx;
    int *dead;                 /* set once the comms are aborted */
    tdm_comm *bootstrap;       /* told of every abort; NULL: nobody */
} tdm_nccl_watch;

/* Aborts the comms (kernels waiting for peers exit) and first tells the
 * bootstrap group, whose other ranks may be blocked in NCCL waiting for
 * this one: their watchdogs poll its flag (abort_check). The reason is the
 * current error message. */
static void tdm_nccl_abort_all(tdm_nccl_watch *w)
{
    if (w->bootstrap) {
        char reason[512];
        snprintf(reason, sizeof reason, "%s", tdm_error_message()[0] ? tdm_error_message()
                                                                   : "NCCL communicator aborted");
        (void)tdm_comm_abort(w->bootstrap, reason);
        tdm_error_set(TDM_STATUS_ABORTED, "%s", reason); /* keep the message */
    }
    for (int i = 0; i < w->n; i++) {
        if (!w->comms[i]) continue;
        if (cudaSetDevice(w->devices[i]) != cudaSuccess) (void)cudaGetLastError();
        ncclResult_t r = ncclCommAbort(w->comms[i]);
        if (r != ncclSuccess)
            TDM_WARN(CUDA, "ncclCommAbort on cuda:%d: %s", w->devices[i], ncclGetErrorString(r));
        w->comms[i] = NULL; /* freed by ncclCommAbort */
    }
    *w->dead = 1;
}

/* Waits until every comm has left ncclInProgress (after a non-blocking
 * init, enqueue or finalize) and, when wait_events, until every event has
 * completed. On failure, aborts the comms and returns the status. `what`
 * names the call in messages. */
static tdm_status tdm_nccl_wait(tdm_nccl_watch *w, int wait_events, const char *what)
{
    int64_t deadline = tdm_nccl_now_ms() + w->timeout_ms;
    int polls = 0;
    for (;;) {
        int pending = 0;
        if (w->abort_flag && atomic_load_explicit(w->abort_flag, memory_order_acquire)) {
            /* Acquire pairs with the release store of 2 in tdm_nccl_abort_op. */
            int have = atomic_load_explicit(w->abort_flag, memory_order_acquire) == 2;
            tdm_error_set(TDM_STATUS_ABORTED, "nccl: %s aborted: %s", what,
                          have ? w->abort_reason : "abort requested");
            tdm_nccl_abort_all(w);
            return TDM_STATUS_ABORTED;
        }
        const char *why = w->ext_check ? w->ext_check(w->ext_ctx) : NULL;
        if (why) {
            tdm_status st = tdm_error_set(TDM_STATUS_PEER_FAILED,
                                          "nccl: %s stopped: %s; communicator aborted", what, why);
            tdm_nccl_abort_all(w);
            return st;
        }
        for (int i = 0; i < w->n; i++) {
            ncclResult_t ar = ncclSuccess;
            ncclResult_t r = ncclCommGetAsyncError(w->comms[i], &ar);
            if (r != ncclSuccess) ar = r;
            if (ar == ncclInProgress) {
                pending = 1;
                continue;
            }
            if (ar != ncclSuccess) {
                const char *last = ncclGetLastError(w->comms[i]);
                tdm_status st = tdm_error_set(tdm_nccl_status_of(ar),
                                              "nccl: %s on cuda:%d: %s (%s); communicator aborted",
                                              what, w->devices[i], ncclGetErrorString(ar),
                                              last && *last ? last : "no detail");
                tdm_nccl_abort_all(w);
                return st;
            }
            if (wait_events && w->events && w->events[i]) {
                cudaError_t e = cudaEventQuery(w->events[i]);
                if (e == cudaErrorNotReady) {
                    /* not an error, but recorded as the thread's last one:
                     * clear it, or the next kernel launch check reports it */
                    (void)cudaGetLastError();
                    pending = 1;
                } else if (e != cudaSuccess) {
                    tdm_status st = tdm_error_set(TDM_STATUS_SYSTEM,
                                                  "nccl: %s on cuda:%d: %s (%s); communicator "
                                                  "aborted", what, w->devices[i],
                                                  cudaGetErrorString(e), cudaGetErrorName(e));
                    tdm_nccl_abort_all(w);
                    return st;
                }
            }
        }
        if (!pending) return TDM_STATUS_OK;
        if (tdm_nccl_now_ms() > deadline) {
            tdm_error_set(TDM_STATUS_TIMEOUT,
                          "nccl: %s did not complete within %lld ms (a peer died, stalled or "
                          "issued a different collective); communicator aborted",
                          what, (long long)w->timeout_ms);
            tdm_nccl_abort_all(w);
            return TDM_STATUS_TIMEOUT;
        }
        tdm_nccl_backoff(&polls);
    }
}

/* A non-blocking NCCL call returns ncclInProgress while it is enqueued in
 * the background; anything else but success is an error now. */
static tdm_status tdm_nccl_enq(tdm_nccl_watch *w, ncclResult_t r, const char *what, int dev)
{
    if (r == ncclSuccess || r == ncclInProgress) return TDM_STATUS_OK;
    tdm_status st = tdm_error_set(tdm_nccl_status_of(r), "nccl: %s on cuda:%d: %s", what, dev,
                                  ncclGetErrorString(r));
    tdm_nccl_abort_all(w);
    return st;
}

static tdm_status tdm_nccl_cuda_fail(const char *what, int dev, cudaError_t e)
{
    return tdm_error_set(tdm_cuda_status_of(e), "nccl: %s on cuda:%d: %s (%s)", what, dev,
                         cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Orders stream s after the compute stream of the tdm_device open on dev
 * (or after the whole GPU when none is open in this process). */
static tdm_status tdm_nccl_order(int dev, cudaStream_t s)
{
    int found = 0;
    cudaError_t e = tdm_cuda_order_after_compute(dev, s, &found);
    if (e == cudaSuccess && !found) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("ordering after the compute stream", dev, e);
    return TDM_STATUS_OK;
}

/* --- one rank per process ------------------------------------------------------ */

typedef struct tdm_nccl_impl {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t done;
    int device, rank, size;
    int dead;                 /* aborted: only destroy is left */
    int64_t timeout_ms;
    int32_t *scratch;         /* device int for barrier */
    tdm_comm *bootstrap;      /* borrowed; NULL: do not forward aborts */
    const char *(*ext_check)(void *ctx);
    void *ext_ctx;
    atomic_int aborted;       /* see tdm_nccl_watch.abort_flag */
    char reason[256];
    const char *algo;
    void **allocs;            /* tdm_comm_alloc'd device memory */
    size_t n_allocs, cap_allocs;
} tdm_nccl_impl;

static tdm_nccl_watch tdm_nccl_watch_of(tdm_nccl_impl *c)
{
    return (tdm_nccl_watch){.n = 1, .comms = &c->comm, .devices = &c->device,
                            .events = &c->done, .timeout_ms = c->timeout_ms,
                            .abort_flag = &c->aborted, .abort_reason = c->reason,
                            .ext_check = c->ext_check, .ext_ctx = c->ext_ctx, .dead = &c->dead,
                            .bootstrap = c->bootstrap};
}

static tdm_status tdm_nccl_local_copy(tdm_nccl_impl *c, void *dst, const void *src, size_t nbytes)
{
    if (!nbytes || dst == src) return TDM_STATUS_OK;
    cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, c->stream);
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaMemcpyAsync (own block)", c->device, e);
    return TDM_STATUS_OK;
}

/* Enqueues one call on c->stream (without waiting). */
static tdm_status tdm_nccl_enqueue(tdm_nccl_impl *c, const tdm_comm_call *k, tdm_nccl_watch *w)
{
    const char *name = tdm_coll_name(k->coll);
    ncclDataType_t dt = tdm_nccl_dtype(k->dtype);
    size_t es = tdm_dtype_size(k->dtype);
    size_t blk = k->count * es;
    ncclComm_t comm = c->comm;
    cudaStream_t s = c->stream;
    const void *sb = k->sendbuf;
    void *rb = k->recvbuf;
    ncclResult_t r = ncclSuccess;
    c->algo = "nccl";
    switch (k->coll) {
    case TDM_COLL_ALL_REDUCE:
        r = ncclAllReduce(sb, rb, k->count, dt, tdm_nccl_op(k->op), comm, s);
        break;
    case TDM_COLL_BROADCAST:
        /* sendbuf is only read on the root. */
        r = ncclBroadcast(c->rank == k->root ? sb : rb, rb, k->count, dt, k->root, comm, s);
        break;
    case TDM_COLL_REDUCE:
        /* recvbuf is only written on the root. */
        r = ncclReduce(sb, rb ? rb : (void *)sb, k->count, dt, tdm_nccl_op(k->op), k->root, comm,
                       s);
        break;
    case TDM_COLL_ALL_GATHER:
        /* In place is sendbuf == recvbuf + rank*count, NCCL's convention too. */
        r = ncclAllGather(sb, rb, k->count, dt, comm, s);
        break;
    case TDM_COLL_REDUCE_SCATTER:
        r = ncclReduceScatter(sb, rb, k->count, dt, tdm_nccl_op(k->op), comm, s);
        break;
    case TDM_COLL_BARRIER:
        r = ncclAllReduce(c->scratch, c->scratch, 1, ncclInt32, ncclSum, comm, s);
        break;
    case TDM_COLL_SEND:
        r = ncclSend(sb, k->count, dt, k->root, comm, s);
        c->algo = "nccl-p2p";
        break;
    case TDM_COLL_RECV:
        r = ncclRecv(rb, k->count, dt, k->root, comm, s);
        c->algo = "nccl-p2p";
        break;
    case TDM_COLL_GATHER:
    case TDM_COLL_SCATTER: {
        /* Grouped point-to-point: the root exchanges one block with every
         * other rank; its own block is a local copy (skipped in place). */
        int gather = k->coll == TDM_COLL_GATHER;
        c->algo = "nccl-p2p-group";
        if (c->rank == k->root) {
            char *base = gather ? (char *)rb : (char *)sb;
            if (gather) TDM_CHECK(tdm_nccl_local_copy(c, base + (size_t)c->rank * blk, sb, blk));
            else TDM_CHECK(tdm_nccl_local_copy(c, rb, base + (size_t)c->rank * blk, blk));
            r = ncclGroupStart();
            if (r != ncclSuccess) break;
            for (int p = 0; p < c->size && (r == ncclSuccess || r == ncclInProgress); p++) {
                if (p == c->rank) continue;
                r = gather ? ncclRecv(base + (size_t)p * blk, k->count, dt, p, comm, s)
                           : ncclSend(base + (size_t)p * blk, k->count, dt, p, comm, s);
            }
            ncclResult_t r2 = ncclGroupEnd();
            if (r == ncclSuccess || r == ncclInProgress) r = r2;
        } else {
            r = gather ? ncclSend(sb, k->count, dt, k->root, comm, s)
                       : ncclRecv(rb, k->count, dt, k->root, comm, s);
        }
        break;
    }
    default:
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "nccl: collective %d", (int)k->coll);
    }
    return tdm_nccl_enq(w, r, name, c->device);
}

static tdm_status tdm_nccl_run_call(tdm_nccl_impl *c, const tdm_comm_call *k)
{
    const char *name = tdm_coll_name(k->coll);
    tdm_nccl_watch w = tdm_nccl_watch_of(c);
    if (c->dead)
        return tdm_error_set(TDM_STATUS_ABORTED, "nccl: %s: the communicator was aborted by an "
                             "earlier failure or abort%s%s; create a new one", name,
                             c->reason[0] ? ": " : "", c->reason);
    if (atomic_load_explicit(&c->aborted, memory_order_acquire)) {
        /* Nothing of ours is on the GPU: aborting now only frees it. */
        tdm_error_set(TDM_STATUS_ABORTED, "nccl: %s: aborted: %s", name,
                      c->reason[0] ? c->reason : "abort requested");
        tdm_nccl_abort_all(&w);
        return TDM_STATUS_ABORTED;
    }
    if (k->coll != TDM_COLL_BARRIER && k->count == 0) return TDM_STATUS_OK;
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaSetDevice", c->device, e);
    if (k->token) {
        /* queued: after the compute work issued before the call was made
         * (tdm_nccl_prepare), not after what was issued since, which is
         * what lets DDP's bucket all-reduces overlap the rest of backward */
        e = cudaStreamWaitEvent(c->stream, (cudaEvent_t)k->token, 0);
        if (e != cudaSuccess)
            return tdm_nccl_cuda_fail("cudaStreamWaitEvent (compute work before the call)",
                                      c->device, e);
    } else {
        TDM_CHECK(tdm_nccl_order(c->device, c->stream));
    }
    TDM_CHECK(tdm_nccl_enqueue(c, k, &w));
    /* Enqueued (NCCL may still be launching in the background): then the
     * completion event, then wait for both. */
    TDM_CHECK(tdm_nccl_wait(&w, 0, name));
    e = cudaEventRecord(c->done, c->stream);
    if (e != cudaSuccess) {
        tdm_status st = tdm_nccl_cuda_fail("cudaEventRecord", c->device, e);
        tdm_nccl_abort_all(&w);
        return st;
    }
    char what[96];
    snprintf(what, sizeof what, "%s(%s, count=%zu) on rank %d of %d", name,
             tdm_dtype_name(k->dtype), k->count, c->rank, c->size);
    return tdm_nccl_wait(&w, 1, what);
}

static tdm_status tdm_nccl_run(void *impl, const tdm_comm_call *k)
{
    tdm_nccl_impl *c = impl;
    tdm_status st = tdm_nccl_run_call(c, k);
    if (k->token) {
        /* waits on it are already enqueued: destroying it now is allowed */
        if (cudaSetDevice(c->device) != cudaSuccess) (void)cudaGetLastError();
        char where[32];
        snprintf(where, sizeof where, "nccl on cuda:%d", c->device);
        tdm_cuda_warn(where, "cudaEventDestroy", cudaEventDestroy((cudaEvent_t)k->token));
    }
    return st;
}

/* On the issuing thread of a queued call: an event on the compute stream
 * now. Without it the collective would be ordered when the progress
 * thread runs it, after all the backward kernels the issuer has enqueued
 * meanwhile, and DDP's buckets would never overlap backward on a GPU. */
static tdm_status tdm_nccl_prepare(void *impl, tdm_comm_call *k)
{
    tdm_nccl_impl *c = impl;
    if (c->dead || atomic_load_explicit(&c->aborted, memory_order_acquire)) return TDM_STATUS_OK;
    cudaEvent_t ev = NULL;
    cudaError_t e = tdm_cuda_mark_compute(c->device, &ev);
    if (e != cudaSuccess)
        return tdm_nccl_cuda_fail("recording the compute stream for a queued collective",
                                  c->device, e);
    k->token = ev;
    return TDM_STATUS_OK;
}

static tdm_status tdm_nccl_abort_op(void *impl, const char *reason)
{
    tdm_nccl_impl *c = impl;
    int expected = 0;
    /* First abort wins: it writes the reason, then publishes 2 (release,
     * pairs with the acquire loads in tdm_nccl_wait and tdm_nccl_run). */
    if (atomic_compare_exchange_strong(&c->aborted, &expected, 1)) {
        snprintf(c->reason, sizeof c->reason, "%s", reason ? reason : "abort requested");
        atomic_store_explicit(&c->aborted, 2, memory_order_release);
        /* The other ranks may be waiting in NCCL kernels for us: raise the
         * bootstrap's group flag so that their watchdogs see it there. */
        if (c->bootstrap) (void)tdm_comm_abort(c->bootstrap, c->reason);
    }
    return TDM_STATUS_OK;
}

static const char *tdm_nccl_last_algo(void *impl) { return ((tdm_nccl_impl *)impl)->algo; }

static tdm_status tdm_nccl_alloc_op(void *impl, size_t nbytes, void **ptr)
{
    tdm_nccl_impl *c = impl;
    *ptr = NULL;
    if (c->n_allocs == c->cap_allocs) {
        size_t cap = c->cap_allocs ? 2 * c->cap_allocs : 16;
        void **a = realloc(c->allocs, cap * sizeof *a);
        if (!a) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl: alloc: realloc");
        c->allocs = a;
        c->cap_allocs = cap;
    }
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaMalloc(ptr, nbytes ? nbytes : 256);
    if (e != cudaSuccess) {
        *ptr = NULL;
        return tdm_error_set(e == cudaErrorMemoryAllocation ? TDM_STATUS_OUT_OF_MEMORY
                                                            : TDM_STATUS_SYSTEM,
                             "nccl: cannot allocate %zu bytes on cuda:%d: %s (%s)", nbytes,
                             c->device, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    c->allocs[c->n_allocs++] = *ptr;
    return TDM_STATUS_OK;
}

static void tdm_nccl_destroy(void *impl)
{
    tdm_nccl_impl *c = impl;
    if (!c) return;
    if (cudaSetDevice(c->device) != cudaSuccess) (void)cudaGetLastError();
    /* An abort requested while no call ran has not reached NCCL yet:
     * finalizing would wait for peers that may be gone. */
    int abort_pending = atomic_load_explicit(&c->aborted, memory_order_acquire) != 0;
    if (c->comm && !c->dead && !abort_pending) {
        /* Finalize flushes outstanding work (none: run waits) and may be
         * in progress for a while; bounded like everything else. */
        tdm_nccl_watch w = tdm_nccl_watch_of(c);
        w.abort_flag = NULL;
        ncclResult_t r = ncclCommFinalize(c->comm);
        tdm_status st = tdm_nccl_enq(&w, r, "ncclCommFinalize", c->device);
        if (st == TDM_STATUS_OK) st = tdm_nccl_wait(&w, 0, "ncclCommFinalize");
        if (st != TDM_STATUS_OK) TDM_WARN(CUDA, "%s", tdm_error_message());
        if (c->comm) {
            r = ncclCommDestroy(c->comm);
            if (r != ncclSuccess)
                TDM_WARN(CUDA, "ncclCommDestroy on cuda:%d: %s", c->device, ncclGetErrorString(r));
        }
    } else if (c->comm) {
        ncclResult_t r = ncclCommAbort(c->comm);
        if (r != ncclSuccess)
            TDM_WARN(CUDA, "ncclCommAbort on cuda:%d: %s", c->device, ncclGetErrorString(r));
    }
    char where[32];
    snprintf(where, sizeof where, "nccl on cuda:%d", c->device);
    for (size_t i = 0; i < c->n_allocs; i++)
        tdm_cuda_warn(where, "cudaFree", cudaFree(c->allocs[i]));
    free(c->allocs);
    if (c->scratch) tdm_cuda_warn(where, "cudaFree", cudaFree(c->scratch));
    if (c->done) tdm_cuda_warn(where, "cudaEventDestroy", cudaEventDestroy(c->done));
    if (c->stream) tdm_cuda_warn(where, "cudaStreamDestroy", cudaStreamDestroy(c->stream));
    free(c);
}

static const tdm_comm_ops tdm_nccl_ops = {
    .name = "nccl",
    .run = tdm_nccl_run,
    .abort = tdm_nccl_abort_op,
    .last_algo = tdm_nccl_last_algo,
    .alloc = tdm_nccl_alloc_op,
    .destroy = tdm_nccl_destroy,
    .prepare = tdm_nccl_prepare,
};

/* The id block broadcast from rank 0: ok flag, padding, the id. */
typedef struct tdm_nccl_id_msg {
    int32_t ok, pad;
    ncclUniqueId id;
} tdm_nccl_id_msg;
_Static_assert(sizeof(tdm_nccl_id_msg) % sizeof(int32_t) == 0, "id message size");

tdm_status tdm_comm_init_nccl_opts(tdm_comm **out, tdm_comm *bootstrap, int device_index,
                                   const tdm_nccl_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_nccl_impl *c = NULL;
    int32_t *oks = NULL;
    TDM_REQUIRE(out && bootstrap, TDM_STATUS_INVALID_ARG,
                "tdm_comm_init_nccl: out and bootstrap are required");
    *out = NULL;
    int rank = tdm_comm_rank(bootstrap), size = tdm_comm_size(bootstrap);

    /* 1. Can this rank use its GPU? Every rank learns every rank's answer
     *    before anyone enters NCCL, so that one rank without a GPU makes
     *    all of them fail now instead of waiting out a timeout. */
    char local_msg[512] = "";
    tdm_status local = tdm_cuda_device_check(device_index);
    if (local == TDM_STATUS_OK) {
        cudaError_t e = cudaSetDevice(device_index);
        /* cudaFree(0) creates the context now, where errors are clear. */
        if (e == cudaSuccess) e = cudaFree(0);
        if (e != cudaSuccess) local = tdm_nccl_cuda_fail("creating the CUDA context",
                                                         device_index, e);
    }
    if (local != TDM_STATUS_OK) snprintf(local_msg, sizeof local_msg, "%s", tdm_error_message());
    oks = calloc((size_t)size, sizeof *oks);
    if (!oks) {
        /* The others are about to wait for us in the all_gather: abort the
         * bootstrap group so they fail now, not at its deadline. */
        tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "tdm_comm_init_nccl: rank %d cannot allocate "
                      "%d ints", rank, size);
        (void)tdm_comm_abort(bootstrap, tdm_error_message());
        return TDM_STATUS_OUT_OF_MEMORY;
    }
    int32_t mine = local == TDM_STATUS_OK ? 1 : -(int32_t)local;
    TDM_TRY(tdm_comm_all_gather(bootstrap, &mine, oks, 1, TDM_DTYPE_INT32));
    if (local != TDM_STATUS_OK) {
        st = tdm_error_set(local, "%s (rank %d, cuda:%d); NCCL communicator not created",
                           local_msg, rank, device_index);
        goto fail;
    }
    for (int r = 0; r < size; r++)
        if (oks[r] != 1) {
            tdm_status rs = oks[r] < 0 && -oks[r] < TDM_STATUS_COUNT_ ? (tdm_status)-oks[r]
                                                                       : TDM_STATUS_MISMATCH;
            st = tdm_error_set(rs, "rank %d cannot use its CUDA device (%s; see that rank's "
                               "error); NCCL communicator not created", r, tdm_status_name(rs));
            goto fail;
        }

    /* 2. Rank 0 makes the unique id; everyone gets it over bootstrap. */
    tdm_nccl_id_msg msg;
    memset(&msg, 0, sizeof msg);
    if (rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&msg.id);
        msg.ok = r == ncclSuccess;
        if (r != ncclSuccess) {
            snprintf(local_msg, sizeof local_msg, "ncclGetUniqueId: %s", ncclGetErrorString(r));
        }
    }
    TDM_TRY(tdm_comm_broadcast(bootstrap, &msg, &msg, sizeof msg / sizeof(int32_t),
                               TDM_DTYPE_INT32, 0));
    if (!msg.ok) {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "nccl: rank 0 could not create the unique id%s%s",
                           rank == 0 ? ": " : " (see rank 0's error)",
                           rank == 0 ? local_msg : "");
        goto fail;
    }

    /* 3. The non-blocking communicator, waited for with a deadline. The
     *    device is made current again: the bootstrap's collectives may
     *    have run CUDA-free code on other threads, but this thread's
     *    resources and ncclCommInitRankConfig (cudaGetDevice) need it. */
    c = calloc(1, sizeof *c);
    if (!c) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl: calloc");
        if (!(opts && opts->no_bootstrap_abort)) (void)tdm_comm_abort(bootstrap, tdm_error_message());
        goto fail;
    }
    c->device = device_index;
    c->rank = rank;
    c->size = size;
    c->timeout_ms = tdm_nccl_timeout(opts);
    c->bootstrap = opts && opts->no_bootstrap_abort ? NULL : bootstrap;
    c->ext_check = opts ? opts->abort_check : NULL;
    c->ext_ctx = opts ? opts->abort_ctx : NULL;
    c->algo = "nccl";
    atomic_init(&c->aborted, 0);
    cudaError_t e = cudaSetDevice(device_index);
    if (e != cudaSuccess) { st = tdm_nccl_cuda_fail("cudaSetDevice", device_index, e); goto fail; }
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        c->stream = NULL;
        st = tdm_nccl_cuda_fail("cudaStreamCreateWithFlags", device_index, e);
        goto fail;
    }
    e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        c->done = NULL;
        st = tdm_nccl_cuda_fail("cudaEventCreateWithFlags", device_index, e);
        goto fail;
    }
    e = cudaMalloc((void **)&c->scratch, sizeof(int32_t));
    if (e == cudaSuccess) e = cudaMemsetAsync(c->scratch, 0, sizeof(int32_t), c->stream);
    if (e != cudaSuccess) { st = tdm_nccl_cuda_fail("cudaMalloc (barrier)", device_index, e); goto fail; }

    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    tdm_nccl_watch w = tdm_nccl_watch_of(c);
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, size, msg.id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = tdm_error_set(tdm_nccl_status_of(r), "nccl: ncclCommInitRankConfig (rank %d of %d, "
                           "cuda:%d): %s", rank, size, device_index, ncclGetErrorString(r));
        if (c->comm) (void)ncclCommAbort(c->comm);
        c->comm = NULL;
        goto fail;
    }
    TDM_TRY(tdm_nccl_wait(&w, 0, "ncclCommInitRankConfig"));
    free(oks);
    TDM_INFO(CUDA, "nccl communicator: rank %d of %d on cuda:%d, timeout %lld ms", rank, size,
             device_index, (long long)c->timeout_ms);
    return tdm_comm_create(out, &tdm_nccl_ops, c, rank, size);
fail:
    free(oks);
    if (c) {
        /* past the id exchange the others may be waiting in NCCL's init for
         * this rank: stop them now rather than at their deadline */
        if (c->bootstrap && st != TDM_STATUS_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", tdm_error_message());
            (void)tdm_comm_abort(c->bootstrap, why);
            tdm_error_set(st, "%s", why);
        }
        tdm_nccl_destroy(c);
    }
    return st;
}

tdm_status tdm_comm_init_nccl(tdm_comm **out, tdm_comm *bootstrap, int device_index)
{
    return tdm_comm_init_nccl_opts(out, bootstrap, device_index, NULL);
}

/* --- a group over the GPUs of one process ----------------------------------- */

struct tdm_cuda_nccl_group {
    int n;
    int dead;
    int64_t timeout_ms;
    const char *(*ext_check)(void *ctx);
    void *ext_ctx;
    int *devices;
    ncclComm_t *comms;
    cudaStream_t *streams;
    cudaEvent_t *events;
};

int tdm_cuda_nccl_group_size(const tdm_cuda_nccl_group *g) { return g ? g->n : 0; }

static tdm_nccl_watch tdm_nccl_group_watch(tdm_cuda_nccl_group *g)
{
    return (tdm_nccl_watch){.n = g->n, .comms = g->comms, .devices = g->devices,
                            .events = g->events, .timeout_ms = g->timeout_ms,
                            .ext_check = g->ext_check, .ext_ctx = g->ext_ctx, .dead = &g->dead};
}

void tdm_cuda_nccl_group_free(tdm_cuda_nccl_group *g)
{
    if (!g) return;
    if (g->comms) {
        tdm_nccl_watch w = tdm_nccl_group_watch(g);
        if (!g->dead) {
            /* Finalize every rank (non-blocking), wait, then destroy. */
            tdm_status st = TDM_STATUS_OK;
            for (int i = 0; i < g->n && st == TDM_STATUS_OK; i++) {
                if (!g->comms[i]) continue;
                if (cudaSetDevice(g->devices[i]) != cudaSuccess) (void)cudaGetLastError();
                st = tdm_nccl_enq(&w, ncclCommFinalize(g->comms[i]), "ncclCommFinalize",
                                  g->devices[i]);
            }
            if (st == TDM_STATUS_OK) st = tdm_nccl_wait(&w, 0, "ncclCommFinalize");
            if (st != TDM_STATUS_OK) TDM_WARN(CUDA, "%s", tdm_error_message());
            for (int i = 0; i < g->n; i++)
                if (g->comms[i]) {
                    if (cudaSetDevice(g->devices[i]) != cudaSuccess) (void)cudaGetLastError();
                    ncclResult_t r = ncclCommDestroy(g->comms[i]);
                    if (r != ncclSuccess)
                        TDM_WARN(CUDA, "ncclCommDestroy on cuda:%d: %s", g->devices[i],
                                 ncclGetErrorString(r));
                }
        } else {
            for (int i = 0; i < g->n; i++)
                if (g->comms[i]) {
                    ncclResult_t r = ncclCommAbort(g->comms[i]);
                    if (r != ncclSuccess)
                        TDM_WARN(CUDA, "ncclCommAbort on cuda:%d: %s", g->devices[i],
                                 ncclGetErrorString(r));
                }
        }
    }
    for (int i = 0; i < g->n; i++) {
        if (g->devices && cudaSetDevice(g->devices[i]) != cudaSuccess) (void)cudaGetLastError();
        if (g->events && g->events[i])
            tdm_cuda_warn("nccl group", "cudaEventDestroy", cudaEventDestroy(g->events[i]));
        if (g->streams && g->streams[i])
            tdm_cuda_warn("nccl group", "cudaStreamDestroy", cudaStreamDestroy(g->streams[i]));
    }
    free(g->devices);
    free(g->comms);
    free(g->streams);
    free(g->events);
    free(g);
}

tdm_status tdm_cuda_nccl_group_init(tdm_cuda_nccl_group **out, const int *devices, int ndev,
                                    const tdm_nccl_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_cuda_nccl_group *g = NULL;
    TDM_REQUIRE(out && devices && ndev >= 1, TDM_STATUS_INVALID_ARG,
                "tdm_cuda_nccl_group_init: need out, devices and ndev >= 1 (ndev=%d)", ndev);
    *out = NULL;
    for (int i = 0; i < ndev; i++) {
        TDM_CHECK(tdm_cuda_device_check(devices[i]));
        for (int j = 0; j < i; j++)
            TDM_REQUIRE(devices[i] != devices[j], TDM_STATUS_INVALID_ARG,
                        "tdm_cuda_nccl_group_init: cuda:%d listed twice", devices[i]);
    }
    g = calloc(1, sizeof *g);
    if (!g) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl group: calloc");
    g->n = ndev;
    g->timeout_ms = tdm_nccl_timeout(opts);
    g->ext_check = opts ? opts->abort_check : NULL;
    g->ext_ctx = opts ? opts->abort_ctx : NULL;
    g->devices = calloc((size_t)ndev, sizeof *g->devices);
    g->comms = calloc((size_t)ndev, sizeof *g->comms);
    g->streams = calloc((size_t)ndev, sizeof *g->streams);
    g->events = calloc((size_t)ndev, sizeof *g->events);
    if (!g->devices || !g->comms || !g->streams || !g->events) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl group: calloc");
        goto fail;
    }
    memcpy(g->devices, devices, (size_t)ndev * sizeof *devices);
    for (int i = 0; i < ndev; i++) {
        cudaError_t e = cudaSetDevice(devices[i]);
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&g->streams[i], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->events[i], cudaEventDisableTiming);
        if (e != cudaSuccess) { st = tdm_nccl_cuda_fail("creating stream and event", devices[i], e); goto fail; }
    }
    ncclUniqueId id;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "nccl group: ncclGetUniqueId: %s",
                           ncclGetErrorString(r));
        goto fail;
    }
    /* NCCL's documented single-thread multi-GPU init: one rank per GPU
     * inside a group, here with the non-blocking config. */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    tdm_nccl_watch w = tdm_nccl_group_watch(g);
    r = ncclGroupStart();
    for (int i = 0; i < ndev && (r == ncclSuccess || r == ncclInProgress); i++) {
        cudaError_t e = cudaSetDevice(devices[i]);
        if (e != cudaSuccess) { st = tdm_nccl_cuda_fail("cudaSetDevice", devices[i], e); break; }
        r = ncclCommInitRankConfig(&g->comms[i], ndev, id, i, &cfg);
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (st != TDM_STATUS_OK) goto fail_comms;
    if (r == ncclSuccess || r == ncclInProgress) r = r2;
    if (r != ncclSuccess && r != ncclInProgress) {
        st = tdm_error_set(tdm_nccl_status_of(r), "nccl group: ncclCommInitRankConfig over %d "
                           "GPUs: %s", ndev, ncclGetErrorString(r));
        goto fail_comms;
    }
    TDM_TRY(tdm_nccl_wait(&w, 0, "ncclCommInitRankConfig (group)"));
    *out = g;
    return TDM_STATUS_OK;
fail_comms:
    g->dead = 1; /* abort, never finalize, comms that may be half made */
fail:
    tdm_cuda_nccl_group_free(g);
    return st;
}

typedef enum { TDM_NCCL_G_BCAST, TDM_NCCL_G_REDUCE, TDM_NCCL_G_ALL_REDUCE } tdm_nccl_g_kind;

static tdm_status tdm_nccl_group_run(tdm_cuda_nccl_group *g, tdm_nccl_g_kind kind,
                                     const void *const *send, void *const *recv, void *root_recv,
                                     size_t count, tdm_dtype dtype, tdm_redop op, int root,
                                     const char *name)
{
    TDM_REQUIRE(g, TDM_STATUS_INVALID_ARG, "nccl group %s: group is NULL", name);
    TDM_REQUIRE(!g->dead, TDM_STATUS_ABORTED, "nccl group %s: the group was aborted by an "
                "earlier failure; create a new one", name);
    TDM_REQUIRE((unsigned)dtype < TDM_DTYPE_COUNT_, TDM_STATUS_INVALID_ARG,
                "nccl group %s: invalid dtype %d", name, (int)dtype);
    TDM_REQUIRE((unsigned)op < TDM_REDOP_COUNT_, TDM_STATUS_INVALID_ARG,
                "nccl group %s: invalid op %d", name, (int)op);
    TDM_REQUIRE(kind == TDM_NCCL_G_ALL_REDUCE || (root >= 0 && root < g->n),
                TDM_STATUS_INVALID_ARG, "nccl group %s: root %d out of range (%d GPUs)", name,
                root, g->n);
    if (count == 0) return TDM_STATUS_OK;
    for (int i = 0; i < g->n; i++) {
        const void *p = kind == TDM_NCCL_G_REDUCE ? send[i] : recv[i];
        TDM_REQUIRE(p, TDM_STATUS_INVALID_ARG, "nccl group %s: buffer %d is NULL", name, i);
    }
    TDM_REQUIRE(kind != TDM_NCCL_G_REDUCE || root_recv, TDM_STATUS_INVALID_ARG,
                "nccl group %s: recvbuf is NULL", name);
    tdm_nccl_watch w = tdm_nccl_group_watch(g);
    ncclDataType_t dt = tdm_nccl_dtype(dtype);
    for (int i = 0; i < g->n; i++) {
        cudaError_t e = cudaSetDevice(g->devices[i]);
        if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaSetDevice", g->devices[i], e);
        TDM_CHECK(tdm_nccl_order(g->devices[i], g->streams[i]));
    }
    /* One thread drives every GPU: NCCL requires the calls in a group. */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < g->n && (r == ncclSuccess || r == ncclInProgress); i++) {
        switch (kind) {
        case TDM_NCCL_G_BCAST:
            r = ncclBroadcast(recv[i], recv[i], count, dt, root, g->comms[i], g->streams[i]);
            break;
        case TDM_NCCL_G_REDUCE:
            r = ncclReduce(send[i], i == root ? root_recv : (void *)send[i], count, dt,
                           tdm_nccl_op(op), root, g->comms[i], g->streams[i]);
            break;
        case TDM_NCCL_G_ALL_REDUCE:
            r = ncclAllReduce(recv[i], recv[i], count, dt, tdm_nccl_op(op), g->comms[i],
                              g->streams[i]);
            break;
        }
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = r2;
    TDM_CHECK(tdm_nccl_enq(&w, r, name, g->devices[0]));
    TDM_CHECK(tdm_nccl_wait(&w, 0, name));
    for (int i = 0; i < g->n; i++) {
        cudaError_t e = cudaSetDevice(g->devices[i]);
        if (e == cudaSuccess) e = cudaEventRecord(g->events[i], g->streams[i]);
        if (e != cudaSuccess) {
            tdm_nccl_abort_all(&w);
            return tdm_nccl_cuda_fail("cudaEventRecord", g->devices[i], e);
        }
    }
    char what[96];
    snprintf(what, sizeof what, "group %s(%s, count=%zu) over %d GPUs", name,
             tdm_dtype_name(dtype), count, g->n);
    return tdm_nccl_wait(&w, 1, what);
}

tdm_status tdm_cuda_nccl_group_broadcast(tdm_cuda_nccl_group *g, void *const *bufs, size_t count,
                                         tdm_dtype dtype, int root)
{
    TDM_REQUIRE(bufs, TDM_STATUS_INVALID_ARG, "nccl group broadcast: bufs is NULL");
    return tdm_nccl_group_run(g, TDM_NCCL_G_BCAST, NULL, bufs, NULL, count, dtype, TDM_REDOP_SUM,
                              root, "broadcast");
}

tdm_status tdm_cuda_nccl_group_reduce(tdm_cuda_nccl_group *g, const void *const *sendbufs,
                                      void *recvbuf, size_t count, tdm_dtype dtype,
                                      tdm_redop op, int root)
{
    TDM_REQUIRE(sendbufs, TDM_STATUS_INVALID_ARG, "nccl group reduce: sendbufs is NULL");
    return tdm_nccl_group_run(g, TDM_NCCL_G_REDUCE, sendbufs, NULL, recvbuf, count, dtype, op,
                              root, "reduce");
}

tdm_status tdm_cuda_nccl_group_all_reduce(tdm_cuda_nccl_group *g, void *const *bufs,
                                          size_t count, tdm_dtype dtype, tdm_redop op)
{
    TDM_REQUIRE(bufs, TDM_STATUS_INVALID_ARG, "nccl group all_reduce: bufs is NULL");
    return tdm_nccl_group_run(g, TDM_NCCL_G_ALL_REDUCE, NULL, bufs, NULL, count, dtype, op, 0,
                              "all_reduce");
}
