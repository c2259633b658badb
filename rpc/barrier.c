/* rpc/barrier.c: tdm_rpc_barrier: every rank calls rank 0's
 * tdm.barrier.arrive; rank 0, once it has counted every arrival, calls
 * every rank's tdm.barrier.release. Waits watch the peers' liveness
 * (rank 0 every rank, the others rank 0: a released peer may leave at
 * once). Not a collective of a communicator: calls over rpc/. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/timer.h"
#include "rpc/rpc_impl.h"

#define RPC_BARRIER_ARRIVE "tdm.barrier.arrive"
#define RPC_BARRIER_RELEASE "tdm.barrier.release"
/* How often a barrier's wait looks at the peers' liveness. */
#define RPC_BARRIER_CHECK_MS 20

static tdm_status barrier_arrive(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    tdm_rpc *rpc = req->rpc;
    pthread_mutex_lock(&rpc->mu);
    rpc->barrier.arrived++;
    pthread_cond_broadcast(&rpc->cv);
    pthread_mutex_unlock(&rpc->mu);
    return TDM_STATUS_OK;
}

static tdm_status barrier_release(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    tdm_rpc *rpc = req->rpc;
    pthread_mutex_lock(&rpc->mu);
    rpc->barrier.released++;
    pthread_cond_broadcast(&rpc->cv);
    pthread_mutex_unlock(&rpc->mu);
    return TDM_STATUS_OK;
}

/* Waits (mu held) until *counter >= target, a watched peer is lost, or
 * the deadline. Rank 0 watches all (it waits for every arrival); the
 * others watch rank 0 only (a released peer may leave at once). */
static tdm_status barrier_wait(tdm_rpc *rpc, const uint64_t *counter, uint64_t target,
                               uint64_t t0, int64_t timeout_ms, const char *what, int watch)
{
    while (*counter < target) {
        for (int r = 0; r < rpc->world; r++) {
            if (r == rpc->rank || (watch >= 0 && r != watch)) continue;
            if (rpc->peers.state[r] != TDM_RPC_PEER_UP)
                return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc barrier (%s): rank %d %s", what, r,
                                     rpc->peers.why[r]);
        }
        if (timeout_ms >= 0 && tdm_time_ns() - t0 >= (uint64_t)timeout_ms * 1000000u)
            return tdm_error_set(TDM_STATUS_TIMEOUT, "rpc barrier (%s): %llu of %llu after %lld ms",
                                 what, (unsigned long long)*counter, (unsigned long long)target,
                                 (long long)timeout_ms);
        pthread_mutex_unlock(&rpc->mu);
        for (int r = 0; r < rpc->world; r++) {
            char why[160];
            if (watch >= 0 && r != watch) continue;
            if (r != rpc->rank && rpc->ops->peer_gone(rpc, r, why, sizeof why))
                tdm_rpc_peer_lost(rpc, r, TDM_RPC_PEER_GONE, why);
        }
        pthread_mutex_lock(&rpc->mu);
        if (*counter >= target) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += RPC_BARRIER_CHECK_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&rpc->cv, &rpc->mu, &ts);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_rpc_barrier(tdm_rpc *rpc, int64_t timeout_ms)
{
    tdm_status st = TDM_STATUS_OK;
    uint64_t t0 = tdm_time_ns();
    pthread_mutex_lock(&rpc->mu);
    uint64_t gen = ++rpc->barrier.entered;
    pthread_mutex_unlock(&rpc->mu);
    if (rpc->world == 1) return TDM_STATUS_OK;
    if (rpc->rank == 0) {
        pthread_mutex_lock(&rpc->mu);
        st = barrier_wait(rpc, &rpc->barrier.arrived, gen * (uint64_t)(rpc->world - 1), t0, timeout_ms,
                          "arrivals", -1);
        pthread_mutex_unlock(&rpc->mu);
        if (st != TDM_STATUS_OK) return st;
        tdm_rpc_future *f[TDM_RPC_MAX_RANKS] = {0};
        for (int r = 1; r < rpc->world && st == TDM_STATUS_OK; r++)
            st = tdm_rpc_call_async(rpc, r, RPC_BARRIER_RELEASE, NULL, 0, &f[r]);
        for (int r = 1; r < rpc->world; r++) {
            if (!f[r]) continue;
            tdm_status s2 = tdm_rpc_future_wait(f[r], timeout_ms, NULL, NULL);
            /* every rank arrived: the barrier holds. One that dies once
             * released (before its answer went) fails what comes next,
             * not this barrier (a test hook killing a rank at its first
             * step raced its answer here) */
            if (s2 == TDM_STATUS_PEER_FAILED) s2 = TDM_STATUS_OK;
            if (st == TDM_STATUS_OK) st = s2;
            tdm_rpc_future_free(f[r]);
        }
        return st;
    }
    TDM_CHECK(tdm_rpc_call(rpc, 0, RPC_BARRIER_ARRIVE, NULL, 0, NULL, NULL, timeout_ms));
    pthread_mutex_lock(&rpc->mu);
    st = barrier_wait(rpc, &rpc->barrier.released, gen, t0, timeout_ms, "release", 0);
    pthread_mutex_unlock(&rpc->mu);
    return st;
}

tdm_status tdm_rpc_barrier_register(tdm_rpc *rpc)
{
    TDM_CHECK(tdm_rpc_register(rpc, RPC_BARRIER_ARRIVE, barrier_arrive, NULL));
    return tdm_rpc_register(rpc, RPC_BARRIER_RELEASE, barrier_release, NULL);
}
