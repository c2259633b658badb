/* cuda/nccl_watch.c: how tandem waits on NCCL without ever hanging:
 * every communicator is non-blocking, and after each enqueue the calling
 * thread polls its async error, the completion event, the abort flag, an
 * external check and a deadline (tdm_nccl_wait), aborting the comms on
 * any failure. Also the small maps from tandem's types to NCCL's. Used by
 * the rank communicator (cuda/nccl_comm.c) and the group over one
 * process's GPUs (cuda/nccl_group.c); not a communicator itself. */
#include "cuda/nccl_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/comm.h"
#include "core/log.h"
#include "cuda/cuda_impl.h"

#define TDM_NCCL_DEFAULT_TIMEOUT_MS 300000

static int64_t tdm_nccl_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t tdm_nccl_timeout(const tdm_nccl_opts *opts)
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

tdm_status tdm_nccl_status_of(ncclResult_t r)
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
ncclDataType_t tdm_nccl_dtype(tdm_dtype dt)
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

ncclRedOp_t tdm_nccl_op(tdm_redop op)
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

/* Aborts the comms (kernels waiting for peers exit) and first tells the
 * bootstrap group, whose other ranks may be blocked in NCCL waiting for
 * this one: their watchdogs poll its flag (abort_check). The reason is the
 * current error message. */
void tdm_nccl_abort_all(tdm_nccl_watch *w)
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
tdm_status tdm_nccl_wait(tdm_nccl_watch *w, int wait_events, const char *what)
{
    int64_t deadline = tdm_nccl_now_ms() + w->timeout_ms;
    int polls = 0;
    for (;;) {
        int pending = 0;
        if (w->abort_flag && atomic_load_explicit(w->abort_flag, memory_order_acquire)) {
            /* Acquire pairs with the release store of 2 in tdm_nccl_abort_op
             * (cuda/nccl_comm.c). */
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
tdm_status tdm_nccl_enq(tdm_nccl_watch *w, ncclResult_t r, const char *what, int dev)
{
    if (r == ncclSuccess || r == ncclInProgress) return TDM_STATUS_OK;
    tdm_status st = tdm_error_set(tdm_nccl_status_of(r), "nccl: %s on cuda:%d: %s", what, dev,
                                  ncclGetErrorString(r));
    tdm_nccl_abort_all(w);
    return st;
}

tdm_status tdm_nccl_cuda_fail(const char *what, int dev, cudaError_t e)
{
    return tdm_error_set(tdm_cuda_status_of(e), "nccl: %s on cuda:%d: %s (%s)", what, dev,
                         cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Orders stream s after the compute stream of the tdm_device open on dev
 * (or after the whole GPU when none is open in this process). */
tdm_status tdm_nccl_order(int dev, cudaStream_t s)
{
    int found = 0;
    cudaError_t e = tdm_cuda_order_after_compute(dev, s, &found);
    if (e == cudaSuccess && !found) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return tdm_nccl_cuda_fail("ordering after the compute stream", dev, e);
    return TDM_STATUS_OK;
}
