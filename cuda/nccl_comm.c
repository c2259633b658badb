/* cuda/nccl_comm.c: the NCCL communicator behind core/comm.h (one rank per
 * process, for DDP on GPUs).
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
 * That watch is cuda/nccl_watch.c, shared with the group over the GPUs
 * of one process (cuda/nccl_group.c, DP's replicate and reduce-add).
 * Not here: the device backend (cuda/device_cuda.c) and the async queue
 * (core/comm.c runs calls on its progress thread). */
#include "cuda/cuda.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/comm_impl.h"
#include "core/log.h"
#include "cuda/cuda_impl.h"
#include "cuda/cuda_libs_impl.h"
#include "cuda/nccl_impl.h"

_Static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0, "ncclUniqueId size");

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

static tdm_status tdm_nccl_split_op(void *impl, const tdm_comm_split_info *in, tdm_comm **out);

/* Host values to or from the communicator's device memory, complete on
 * return (on c->stream, then synchronised: a plain cudaMemcpy from
 * pageable memory may return before its DMA lands, and the legacy stream
 * orders nothing against a non-blocking one). Built, not run on a GPU. */
static tdm_status tdm_nccl_host_copy_op(void *impl, void *dst, const void *src, size_t nbytes,
                                        int to_device)
{
    tdm_nccl_impl *c = impl;
    if (!nbytes) return TDM_STATUS_OK;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(dst, src, nbytes,
                            to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                            c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess)
        return tdm_nccl_cuda_fail(to_device ? "cudaMemcpyAsync (host values to the device)"
                                            : "cudaMemcpyAsync (host values from the device)",
                                  c->device, e);
    return TDM_STATUS_OK;
}

static const tdm_comm_ops tdm_nccl_ops = {
    .name = "nccl",
    .run = tdm_nccl_run,
    .abort = tdm_nccl_abort_op,
    .last_algo = tdm_nccl_last_algo,
    .alloc = tdm_nccl_alloc_op,
    .destroy = tdm_nccl_destroy,
    .prepare = tdm_nccl_prepare,
    .split = tdm_nccl_split_op,
    .host_copy = tdm_nccl_host_copy_op,
};

/* The id block broadcast from rank 0: ok flag, padding, the id. */
typedef struct tdm_nccl_id_msg {
    int32_t ok, pad;
    ncclUniqueId id;
} tdm_nccl_id_msg;
_Static_assert(sizeof(tdm_nccl_id_msg) % sizeof(int32_t) == 0, "id message size");

/* 1. Can this rank use its GPU? Every rank learns every rank's answer
 *    before anyone enters NCCL, so that one rank without a GPU makes all
 *    of them fail now instead of waiting out a timeout. */
static tdm_status tdm_nccl_agree_devices(tdm_comm *bootstrap, int device_index, int rank,
                                         int size)
{
    tdm_status st = TDM_STATUS_OK;
    char local_msg[512] = "";
    tdm_status local = tdm_cuda_device_check(device_index);
    if (local == TDM_STATUS_OK) {
        cudaError_t e = cudaSetDevice(device_index);
        /* cudaFree(0) creates the context now, where errors are clear. */
        if (e == cudaSuccess) e = cudaFree(0);
        if (e != cudaSuccess) local = tdm_nccl_cuda_fail("creating the CUDA context",
                                                         device_index, e);
    }
    /* NCCL itself is loaded here (cuda/cuda_libs.c): a rank that cannot
     * load it fails every rank now, as one without a GPU does */
    if (local == TDM_STATUS_OK) local = tdm_cuda_lib_load(TDM_CUDA_LIB_NCCL);
    if (local != TDM_STATUS_OK) snprintf(local_msg, sizeof local_msg, "%s", tdm_error_message());
    int32_t *oks = calloc((size_t)size, sizeof *oks);
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
fail:
    free(oks);
    return st;
}

/* 2. Rank 0 makes the unique id; everyone gets it over bootstrap. */
static tdm_status tdm_nccl_agree_id(tdm_comm *bootstrap, int rank, ncclUniqueId *id)
{
    char local_msg[512] = "";
    tdm_nccl_id_msg msg;
    memset(&msg, 0, sizeof msg);
    if (rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&msg.id);
        msg.ok = r == ncclSuccess;
        if (r != ncclSuccess) {
            snprintf(local_msg, sizeof local_msg, "ncclGetUniqueId: %s", ncclGetErrorString(r));
        }
    }
    TDM_CHECK(tdm_comm_broadcast(bootstrap, &msg, &msg, sizeof msg / sizeof(int32_t),
                                 TDM_DTYPE_INT32, 0));
    if (!msg.ok)
        return tdm_error_set(TDM_STATUS_SYSTEM, "nccl: rank 0 could not create the unique id%s%s",
                             rank == 0 ? ": " : " (see rank 0's error)",
                             rank == 0 ? local_msg : "");
    *id = msg.id;
    return TDM_STATUS_OK;
}

/* A rank's state on its GPU, without its NCCL communicator yet: the
 * stream its collectives run on, the completion event, the barrier's
 * int. On failure *out holds what was made (tdm_nccl_destroy frees it),
 * NULL when even the struct could not be. */
static tdm_status tdm_nccl_impl_new(tdm_nccl_impl **out, int device, int rank, int size,
                                    int64_t timeout_ms, tdm_comm *bootstrap,
                                    const char *(*ext_check)(void *), void *ext_ctx)
{
    tdm_nccl_impl *c = calloc(1, sizeof *c);
    *out = c;
    if (!c) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl: calloc");
    c->device = device;
    c->rank = rank;
    c->size = size;
    c->timeout_ms = timeout_ms;
    c->bootstrap = bootstrap;
    c->ext_check = ext_check;
    c->ext_ctx = ext_ctx;
    c->algo = "nccl";
    atomic_init(&c->aborted, 0);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaSetDevice", device, e);
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        c->stream = NULL;
        return tdm_nccl_cuda_fail("cudaStreamCreateWithFlags", device, e);
    }
    e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        c->done = NULL;
        return tdm_nccl_cuda_fail("cudaEventCreateWithFlags", device, e);
    }
    e = cudaMalloc((void **)&c->scratch, sizeof(int32_t));
    if (e == cudaSuccess) e = cudaMemsetAsync(c->scratch, 0, sizeof(int32_t), c->stream);
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaMalloc (barrier)", device, e);
    return TDM_STATUS_OK;
}

tdm_status tdm_comm_init_nccl_opts(tdm_comm **out, tdm_comm *bootstrap, int device_index,
                                   const tdm_nccl_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_nccl_impl *c = NULL;
    TDM_REQUIRE(out && bootstrap, TDM_STATUS_INVALID_ARG,
                "tdm_comm_init_nccl: out and bootstrap are required");
    *out = NULL;
    int rank = tdm_comm_rank(bootstrap), size = tdm_comm_size(bootstrap);
    ncclUniqueId id;
    TDM_CHECK(tdm_nccl_agree_devices(bootstrap, device_index, rank, size));
    TDM_CHECK(tdm_nccl_agree_id(bootstrap, rank, &id));

    /* 3. The non-blocking communicator, waited for with a deadline. The
     *    device is made current again: the bootstrap's collectives may
     *    have run CUDA-free code on other threads, but this thread's
     *    resources and ncclCommInitRankConfig (cudaGetDevice) need it. */
    st = tdm_nccl_impl_new(&c, device_index, rank, size, tdm_nccl_timeout(opts),
                           opts && opts->no_bootstrap_abort ? NULL : bootstrap,
                           opts ? opts->abort_check : NULL, opts ? opts->abort_ctx : NULL);
    if (st != TDM_STATUS_OK) {
        if (!c && !(opts && opts->no_bootstrap_abort))
            (void)tdm_comm_abort(bootstrap, tdm_error_message());
        goto fail;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    tdm_nccl_watch w = tdm_nccl_watch_of(c);
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, size, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = tdm_error_set(tdm_nccl_status_of(r), "nccl: ncclCommInitRankConfig (rank %d of %d, "
                           "cuda:%d): %s", rank, size, device_index, ncclGetErrorString(r));
        if (c->comm) (void)ncclCommAbort(c->comm);
        c->comm = NULL;
        goto fail;
    }
    TDM_TRY(tdm_nccl_wait(&w, 0, "ncclCommInitRankConfig"));
    TDM_INFO(CUDA, "nccl communicator: rank %d of %d on cuda:%d, timeout %lld ms", rank, size,
             device_index, (long long)c->timeout_ms);
    return tdm_comm_create(out, &tdm_nccl_ops, c, rank, size);
fail:
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

/* --- sub-communicators ------------------------------------------------------- */

/* tdm_comm_split's NCCL half: ncclCommSplit (non-blocking, collective over
 * the parent; an undefined color is NCCL_SPLIT_NOCOLOR), waited for with
 * the parent's deadline on the parent and then on the new communicator,
 * which gets its own stream and the parent's bootstrap and abort check
 * (an abort anywhere still stops the whole job through the bootstrap's
 * group). A failure aborts the parent, so every rank fails, not only
 * this one. Built, not run on a GPU here. */
static tdm_status tdm_nccl_split_op(void *impl, const tdm_comm_split_info *in, tdm_comm **out)
{
    tdm_nccl_impl *c = impl, *n = NULL;
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    if (c->dead)
        return tdm_error_set(TDM_STATUS_ABORTED, "nccl: split: the communicator was aborted "
                             "by an earlier failure or abort%s%s", c->reason[0] ? ": " : "",
                             c->reason);
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaSetDevice", c->device, e);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t nc = NULL;
    tdm_nccl_watch w = tdm_nccl_watch_of(c);
    ncclResult_t r = ncclCommSplit(c->comm, in->size > 0 ? in->color : NCCL_SPLIT_NOCOLOR,
                                   in->key, &nc, &cfg);
    char what[64];
    snprintf(what, sizeof what, "ncclCommSplit #%d (color %d)", in->seq, in->color);
    TDM_TRY(tdm_nccl_enq(&w, r, what, c->device));
    TDM_TRY(tdm_nccl_wait(&w, 0, what));
    if (!nc) return TDM_STATUS_OK;
    st = tdm_nccl_impl_new(&n, c->device, in->rank, in->size, c->timeout_ms, c->bootstrap,
                           c->ext_check, c->ext_ctx);
    if (n) n->comm = nc;
    else (void)ncclCommAbort(nc);
    if (st != TDM_STATUS_OK) goto fail;
    tdm_nccl_watch wn = tdm_nccl_watch_of(n);
    TDM_TRY(tdm_nccl_wait(&wn, 0, what));
    TDM_INFO(CUDA, "nccl split #%d: rank %d of %d on cuda:%d", in->seq, in->rank, in->size,
             c->device);
    return tdm_comm_create(out, &tdm_nccl_ops, n, in->rank, in->size);
fail:
    {
        char why[sizeof c->reason];
        snprintf(why, sizeof why, "%s", tdm_error_message());
        (void)tdm_nccl_abort_op(c, why);
        tdm_error_set(st, "%s", why);
    }
    if (n) tdm_nccl_destroy(n);
    return st;
}
