/* mpi/mpi_comm.c: the MPI backend of core/comm.h. Each call is one MPI
 * non-blocking collective (or MPI_Isend/MPI_Irecv) on a duplicate of
 * MPI_COMM_WORLD (or, inside the hierarchical communicator, a split of
 * it), waited for with tdm_mpi_wait_all: MPI_Test from the thread that
 * runs the call, a deadline, and the job abort on failure. The same
 * mapping with MPI's blocking collectives is the benchmark's peer
 * (tdm_mpi_peer_run).
 *
 * Mapping onto MPI: AVG is MPI_SUM followed by a division by the size
 * (integers truncate, as shm's); the 16-bit float types are widened into
 * a float32 scratch, reduced in float32 and rounded once (as shm does),
 * and moved as 16-bit integers by the collectives that do not reduce; in
 * place is MPI_IN_PLACE, except that MPI's in-place reduce_scatter leaves
 * the result at the start of the buffer, from where it is moved to this
 * rank's block (the other blocks are then unspecified). Float sums are
 * combined in MPI's algorithm's order: every rank gets the same bits, but
 * not necessarily those of rank order 0..N-1 (shm's).
 *
 * Not here: MPI's initialisation, waits and aborts (mpi/runtime.c), the
 * job's topology and backend choice (mpi/job.c), the hierarchical
 * communicator (mpi/hier.c). */
#include "mpi/mpi_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/timer.h"

#define TDM_MPI_TAG_P2P 0x7d50

static int tdm_mpi_half(tdm_dtype dt)
{
    return dt == TDM_DTYPE_BFLOAT16 || dt == TDM_DTYPE_FLOAT16;
}

/* The MPI type that moves elements of dt (the 16-bit floats as 16-bit
 * integers: only the collectives that do not reduce see them). */
static MPI_Datatype tdm_mpi_type(tdm_dtype dt)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT64: return MPI_DOUBLE;
    case TDM_DTYPE_INT32: return MPI_INT32_T;
    case TDM_DTYPE_INT64: return MPI_INT64_T;
    case TDM_DTYPE_BFLOAT16:
    case TDM_DTYPE_FLOAT16: return MPI_UINT16_T;
    case TDM_DTYPE_FLOAT32:
    default: return MPI_FLOAT;
    }
}

static MPI_Op tdm_mpi_op(tdm_redop op)
{
    switch (op) {
    case TDM_REDOP_PROD: return MPI_PROD;
    case TDM_REDOP_MIN: return MPI_MIN;
    case TDM_REDOP_MAX: return MPI_MAX;
    case TDM_REDOP_AVG:
    case TDM_REDOP_SUM:
    default: return MPI_SUM;
    }
}

#define TDM_MPI_DIVIDE(T, D)                                                  \
    do {                                                                      \
        T *p_ = x;                                                            \
        for (size_t i = 0; i < n; i++) p_[i] = p_[i] / (D);                   \
    } while (0)

/* AVG = SUM / size, as shm/kernels.c divides. */
static void tdm_mpi_divide(void *x, size_t n, tdm_dtype dt, int d)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32: TDM_MPI_DIVIDE(float, (float)d); break;
    case TDM_DTYPE_FLOAT64: TDM_MPI_DIVIDE(double, (double)d); break;
    case TDM_DTYPE_INT32: TDM_MPI_DIVIDE(int32_t, d); break;
    case TDM_DTYPE_INT64: TDM_MPI_DIVIDE(int64_t, d); break;
    default: break;
    }
}

static tdm_status tdm_mpi_scratch(tdm_mpi_impl *c, size_t nbytes, void **p)
{
    if (nbytes > c->scratch_bytes) {
        void *s = realloc(c->scratch, nbytes);
        TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes of scratch",
                    c->what, nbytes);
        c->scratch = s;
        c->scratch_bytes = nbytes;
    }
    *p = c->scratch;
    return TDM_STATUS_OK;
}

/* Posts (nb) or runs (!nb: MPI's blocking collective) one call whose
 * elements MPI can move and reduce as they are. stat: the blocking
 * recv's status. */
static int tdm_mpi_post(tdm_mpi_impl *c, const tdm_comm_call *k, int nb, MPI_Request *req,
                        MPI_Status *stat)
{
    MPI_Datatype t = tdm_mpi_type(k->dtype);
    MPI_Op op = tdm_mpi_op(k->op);
    MPI_Comm comm = c->comm;
    int n = (int)k->count, root = k->root, me = c->rank;
    size_t blk = k->count * tdm_dtype_size(k->dtype);
    const char *sb = k->sendbuf;
    char *rb = k->recvbuf;
    switch (k->coll) {
    case TDM_COLL_ALL_REDUCE: {
        const void *s = sb == rb ? MPI_IN_PLACE : sb;
        c->algo = nb ? "MPI_Iallreduce" : "MPI_Allreduce";
        return nb ? MPI_Iallreduce(s, rb, n, t, op, comm, req) : MPI_Allreduce(s, rb, n, t, op, comm);
    }
    case TDM_COLL_BROADCAST:
        /* the root's recvbuf gets the data too (out of place) */
        if (me == root && sb != rb) memcpy(rb, sb, blk);
        c->algo = nb ? "MPI_Ibcast" : "MPI_Bcast";
        return nb ? MPI_Ibcast(rb, n, t, root, comm, req) : MPI_Bcast(rb, n, t, root, comm);
    case TDM_COLL_REDUCE: {
        const void *s = me == root && sb == rb ? MPI_IN_PLACE : sb;
        void *r = me == root ? rb : NULL;
        c->algo = nb ? "MPI_Ireduce" : "MPI_Reduce";
        return nb ? MPI_Ireduce(s, r, n, t, op, root, comm, req)
                  : MPI_Reduce(s, r, n, t, op, root, comm);
    }
    case TDM_COLL_REDUCE_SCATTER: {
        /* MPI's in place reads the whole input from recvbuf and leaves
         * the result at its start: sendbuf is that buffer here */
        int inplace = rb == sb + (size_t)me * blk;
        const void *s = inplace ? MPI_IN_PLACE : sb;
        void *r = inplace ? (void *)sb : rb;
        c->algo = nb ? "MPI_Ireduce_scatter_block" : "MPI_Reduce_scatter_block";
        return nb ? MPI_Ireduce_scatter_block(s, r, n, t, op, comm, req)
                  : MPI_Reduce_scatter_block(s, r, n, t, op, comm);
    }
    case TDM_COLL_ALL_GATHER: {
        /* in place is MPI's convention too: the input sits in its block */
        int inplace = sb == rb + (size_t)me * blk;
        c->algo = nb ? "MPI_Iallgather" : "MPI_Allgather";
        if (inplace)
            return nb ? MPI_Iallgather(MPI_IN_PLACE, 0, t, rb, n, t, comm, req)
                      : MPI_Allgather(MPI_IN_PLACE, 0, t, rb, n, t, comm);
        return nb ? MPI_Iallgather(sb, n, t, rb, n, t, comm, req)
                  : MPI_Allgather(sb, n, t, rb, n, t, comm);
    }
    case TDM_COLL_GATHER: {
        const void *s = me == root && sb == rb + (size_t)me * blk ? MPI_IN_PLACE : sb;
        c->algo = nb ? "MPI_Igather" : "MPI_Gather";
        return nb ? MPI_Igather(s, n, t, me == root ? rb : NULL, n, t, root, comm, req)
                  : MPI_Gather(s, n, t, me == root ? rb : NULL, n, t, root, comm);
    }
    case TDM_COLL_SCATTER: {
        void *r = me == root && rb == sb + (size_t)me * blk ? MPI_IN_PLACE : rb;
        const void *s = me == root ? sb : NULL;
        c->algo = nb ? "MPI_Iscatter" : "MPI_Scatter";
        return nb ? MPI_Iscatter(s, n, t, r, n, t, root, comm, req)
                  : MPI_Scatter(s, n, t, r, n, t, root, comm);
    }
    case TDM_COLL_BARRIER:
        c->algo = nb ? "MPI_Ibarrier" : "MPI_Barrier";
        return nb ? MPI_Ibarrier(comm, req) : MPI_Barrier(comm);
    case TDM_COLL_SEND:
        c->algo = nb ? "MPI_Isend" : "MPI_Send";
        return nb ? MPI_Isend(sb, n, t, root, TDM_MPI_TAG_P2P, comm, req)
                  : MPI_Send(sb, n, t, root, TDM_MPI_TAG_P2P, comm);
    case TDM_COLL_RECV:
        c->algo = nb ? "MPI_Irecv" : "MPI_Recv";
        return nb ? MPI_Irecv(rb, n, t, root, TDM_MPI_TAG_P2P, comm, req)
                  : MPI_Recv(rb, n, t, root, TDM_MPI_TAG_P2P, comm, stat);
    default:
        return MPI_ERR_OTHER;
    }
}

/* After the call: AVG's division and the in-place reduce_scatter's move. */
static void tdm_mpi_finish(tdm_mpi_impl *c, const tdm_comm_call *k)
{
    size_t es = tdm_dtype_size(k->dtype), blk = k->count * es;
    char *rb = k->recvbuf;
    if (k->coll == TDM_COLL_REDUCE_SCATTER && rb == (const char *)k->sendbuf + (size_t)c->rank * blk &&
        c->rank != 0)
        memmove(rb, k->sendbuf, blk);
    if (k->op != TDM_REDOP_AVG) return;
    if (k->coll == TDM_COLL_ALL_REDUCE || k->coll == TDM_COLL_REDUCE_SCATTER ||
        (k->coll == TDM_COLL_REDUCE && c->rank == k->root))
        tdm_mpi_divide(rb, k->count, k->dtype, c->size);
}

/* seq: the call's number from 1 (c->seq once counted; 0 is the
 * watchdog's "none"); messages say it from 0, as the shm backend and the
 * flight recorder number calls, so "#7" is entry #7 of the dump. */
static void tdm_mpi_describe_seq(const tdm_mpi_impl *c, uint64_t seq, const tdm_comm_call *k,
                                 char *out, size_t n)
{
    seq = seq ? seq - 1 : 0;
    if (k->coll == TDM_COLL_BARRIER)
        snprintf(out, n, "%s: barrier #%llu on rank %d of %d", c->what,
                 (unsigned long long)seq, c->job_rank, c->job_size);
    else
        snprintf(out, n, "%s: %s #%llu (%s, count=%zu) on rank %d of %d", c->what,
                 tdm_coll_name(k->coll), (unsigned long long)seq, tdm_dtype_name(k->dtype),
                 k->count, c->job_rank, c->job_size);
}

static void tdm_mpi_describe(const tdm_mpi_impl *c, const tdm_comm_call *k, char *out, size_t n)
{
    tdm_mpi_describe_seq(c, c->seq, k, out, n);
}

static void tdm_mpi_check_post(const tdm_mpi_impl *c, const tdm_comm_call *k, int rc)
{
    if (rc == MPI_SUCCESS) return;
    char what[160], s[MPI_MAX_ERROR_STRING];
    tdm_mpi_describe(c, k, what, sizeof what);
    tdm_mpi_error_string(rc, s, sizeof s);
    tdm_mpi_abort_job("%s: %s failed: %s", what, c->algo, s);
}

static void tdm_mpi_wait_call(tdm_mpi_impl *c, const tdm_comm_call *k, MPI_Request *req,
                              MPI_Status *stat)
{
    char what[160];
    tdm_mpi_describe(c, k, what, sizeof what);
    tdm_mpi_waiter w = c->wait;
    w.spin = k->async ? c->spin_async : c->spin;
    tdm_mpi_wait_all(&w, 1, req, stat, what);
}

/* --- the watchdog of blocking calls ------------------------------------------ */

static void *tdm_mpi_watchdog(void *arg)
{
    tdm_mpi_impl *c = arg;
    /* The call last seen in progress and when this thread first saw it:
     * its deadline counts from there (at most one period after the call
     * began), so that the caller need not read a clock. */
    uint64_t seen = 0, seen_ns = 0;
    pthread_mutex_lock(&c->wd_mu);
    while (!c->wd_stop) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_nsec += TDM_MPI_WATCH_MS * 1000000;
        if (dl.tv_nsec >= 1000000000) { dl.tv_sec++; dl.tv_nsec -= 1000000000; }
        pthread_cond_timedwait(&c->wd_cv, &c->wd_mu, &dl);
        if (c->wd_stop) break;
        /* Acquire pairs with the release store in tdm_mpi_watch_begin:
         * the call's fields are those of the call that began then. */
        uint64_t call = atomic_load_explicit(&c->wd_call, memory_order_acquire);
        if (!call) continue;
        uint64_t now = tdm_time_ns();
        if (call != seen) {
            seen = call;
            seen_ns = now;
        }
        tdm_comm_call k = {.coll = (tdm_coll)atomic_load_explicit(&c->wd_coll, memory_order_relaxed),
                           .dtype = (tdm_dtype)atomic_load_explicit(&c->wd_dtype,
                                                                    memory_order_relaxed),
                           .count = atomic_load_explicit(&c->wd_count, memory_order_relaxed)};
        /* the same call still? (it may have ended and another begun) */
        if (atomic_load_explicit(&c->wd_call, memory_order_acquire) != call) continue;
        const char *why = c->wait.abort_check ? c->wait.abort_check(c->wait.abort_ctx) : NULL;
        if (!why) why = tdm_mpi_live_reason();
        int late = now - seen_ns > (uint64_t)c->wait.timeout_ms * 1000000u;
        if (!why && !late) continue;
        char what[160];
        tdm_mpi_describe_seq(c, call, &k, what, sizeof what);
        if (why) tdm_mpi_abort_job("%s stopped: %s", what, why);
        tdm_mpi_abort_job("%s did not complete within %lld ms (a peer died, stalled or issued a "
                          "different call; raise TANDEM_MPI_TIMEOUT_MS if it is only slow)",
                          what, (long long)c->wait.timeout_ms);
    }
    pthread_mutex_unlock(&c->wd_mu);
    return NULL;
}

/* Before a blocking call, on the calling thread: three relaxed stores and
 * one release, no clock (the watchdog times the call), so that small
 * calls stay cheap. The call's number (c->seq, never 0 here) names it. */
static void tdm_mpi_watch_begin(tdm_mpi_impl *c, const tdm_comm_call *k)
{
    atomic_store_explicit(&c->wd_coll, (int)k->coll, memory_order_relaxed);
    atomic_store_explicit(&c->wd_dtype, (int)k->dtype, memory_order_relaxed);
    atomic_store_explicit(&c->wd_count, k->count, memory_order_relaxed);
    atomic_store_explicit(&c->wd_call, c->seq, memory_order_release);
}

static void tdm_mpi_watch_end(tdm_mpi_impl *c)
{
    atomic_store_explicit(&c->wd_call, 0, memory_order_relaxed);
}

/* Runs k: posted non-blocking and waited for with MPI_Test when it was
 * issued asynchronously (DDP's buckets: the progress thread drives it
 * while backward computes), else MPI's blocking collective under the
 * watchdog. The choice depends only on how the call was issued, which
 * every rank does alike (tdm_comm_call.async), never on whether this rank
 * happened to run it from its queue: MPI does not match a blocking
 * collective with a non-blocking one. desc names it in messages. */
static void tdm_mpi_exec(tdm_mpi_impl *c, const tdm_comm_call *desc, const tdm_comm_call *k,
                         MPI_Status *stat)
{
    int nb = c->nb == TDM_MPI_NB_ALL || (c->nb == TDM_MPI_NB_ASYNC && desc->async);
    if (!nb) {
        tdm_mpi_watch_begin(c, desc);
        int rc = tdm_mpi_post(c, k, 0, NULL, stat);
        tdm_mpi_watch_end(c);
        tdm_mpi_check_post(c, desc, rc);
        return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    tdm_mpi_check_post(c, desc, tdm_mpi_post(c, k, 1, &req, NULL));
    tdm_mpi_wait_call(c, desc, &req, stat);
}

/* The 16-bit floats in a reduction: widened into float32 scratch,
 * reduced there, rounded once into recvbuf. */
static tdm_status tdm_mpi_run_half(tdm_mpi_impl *c, const tdm_comm_call *k)
{
    int rs = k->coll == TDM_COLL_REDUCE_SCATTER;
    size_t in_n = rs ? k->count * (size_t)c->size : k->count, out_n = k->count;
    int bf = k->dtype == TDM_DTYPE_BFLOAT16;
    float *a = NULL;
    TDM_CHECK(tdm_mpi_scratch(c, (in_n + (rs ? out_n : 0)) * sizeof(float), (void **)&a));
    float *out = rs ? a + in_n : a;
    const uint16_t *src = k->sendbuf;
    for (size_t i = 0; i < in_n; i++) a[i] = bf ? tdm_bf16_to_f32(src[i]) : tdm_f16_to_f32(src[i]);
    tdm_comm_call f = *k;
    f.dtype = TDM_DTYPE_FLOAT32;
    f.sendbuf = a;
    f.recvbuf = out;       /* in place (all_reduce, reduce), out of place (rs) */
    tdm_mpi_exec(c, k, &f, NULL);
    if (k->coll == TDM_COLL_REDUCE && c->rank != k->root) return TDM_STATUS_OK;
    if (k->op == TDM_REDOP_AVG) tdm_mpi_divide(out, out_n, TDM_DTYPE_FLOAT32, c->size);
    uint16_t *dst = k->recvbuf;
    for (size_t i = 0; i < out_n; i++) dst[i] = bf ? tdm_f32_to_bf16(out[i]) : tdm_f32_to_f16(out[i]);
    return TDM_STATUS_OK;
}

static tdm_status tdm_mpi_run(void *impl, const tdm_comm_call *k)
{
    tdm_mpi_impl *c = impl;
    c->seq++;
    if (k->coll != TDM_COLL_BARRIER && k->count == 0) {
        c->algo = "none";
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(k->count <= INT_MAX, TDM_STATUS_UNSUPPORTED,
                "%s: %s of %zu elements: MPI counts stop at %d; split the call",
                c->what, tdm_coll_name(k->coll), k->count, INT_MAX);
    int reduces = k->coll == TDM_COLL_ALL_REDUCE || k->coll == TDM_COLL_REDUCE ||
                  k->coll == TDM_COLL_REDUCE_SCATTER;
    if (reduces && tdm_mpi_half(k->dtype)) return tdm_mpi_run_half(c, k);
    MPI_Status stat;
    tdm_mpi_exec(c, k, k, &stat);
    if (k->coll == TDM_COLL_RECV) {
        int got = 0;
        MPI_Get_count(&stat, tdm_mpi_type(k->dtype), &got);
        TDM_REQUIRE(got == (int)k->count, TDM_STATUS_MISMATCH,
                    "%s: recv #%llu from rank %d expected %zu %s elements, but the peer sent %d",
                    c->what, (unsigned long long)(c->seq - 1), k->root, k->count,
                    tdm_dtype_name(k->dtype), got);
    }
    tdm_mpi_finish(c, k);
    return TDM_STATUS_OK;
}

static tdm_status tdm_mpi_abort_op(void *impl, const char *reason)
{
    tdm_mpi_impl *c = impl;
    tdm_mpi_abort_job("%s: aborted on rank %d: %s", c->what, c->rank, reason);
}

static const char *tdm_mpi_last_algo(void *impl) { return ((tdm_mpi_impl *)impl)->algo; }

static void tdm_mpi_destroy(void *impl)
{
    tdm_mpi_impl *c = impl;
    if (!c) return;
    pthread_mutex_lock(&c->wd_mu);
    c->wd_stop = 1;
    pthread_cond_signal(&c->wd_cv);
    int started = c->wd_started;
    pthread_mutex_unlock(&c->wd_mu);
    if (started) pthread_join(c->wd_thread, NULL);
    pthread_mutex_destroy(&c->wd_mu);
    pthread_cond_destroy(&c->wd_cv);
    int finalized = 0;
    MPI_Finalized(&finalized);
    /* after MPI_Finalize, MPI has released it already */
    if (!finalized && c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
    free(c->scratch);
    free(c);
}

static const tdm_comm_ops tdm_mpi_ops = {
    .name = "mpi",
    .run = tdm_mpi_run,
    .abort = tdm_mpi_abort_op,
    .last_algo = tdm_mpi_last_algo,
    .destroy = tdm_mpi_destroy,
    .half_types = 1,
    .split = tdm_mpi_split,
};

tdm_status tdm_mpi_comm_wrap(tdm_comm **out, MPI_Comm comm, int local_size, int cores,
                             const tdm_mpi_opts *opts, const char *what)
{
    tdm_mpi_opts o = tdm_mpi_opts_resolve(opts);
    tdm_mpi_impl *c = calloc(1, sizeof *c);
    if (!c) {
        MPI_Comm_free(&comm);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "mpi: calloc");
    }
    c->comm = comm;
    pthread_mutex_init(&c->wd_mu, NULL);
    pthread_cond_init(&c->wd_cv, NULL);
    /* Calls issued asynchronously use MPI's non-blocking collectives,
     * progressed by the thread that waits (the progress thread for DDP's
     * buckets); synchronous ones MPI's blocking collectives, bounded by
     * the watchdog: Open MPI's (coll/tuned) take 0.3-0.8 of the time of
     * its non-blocking ones (libnbc) from 8 B to 16 MiB, measured here.
     * TANDEM_MPI_NB=all|none makes every call one or the other
     * (measurements, tests). */
    c->nb = TDM_MPI_NB_ASYNC;
    const char *nbenv = getenv("TANDEM_MPI_NB");
    if (nbenv && !strcmp(nbenv, "all")) c->nb = TDM_MPI_NB_ALL;
    else if (nbenv && !strcmp(nbenv, "none")) c->nb = TDM_MPI_NB_NONE;
    else if (nbenv && *nbenv && strcmp(nbenv, "async"))
        TDM_WARN(MPI, "TANDEM_MPI_NB='%s': expected async, all or none; using async", nbenv);

    /* errors come back to the wait, which names the call and aborts */
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &c->rank);
    MPI_Comm_size(comm, &c->size);
    c->job_rank = c->rank;
    c->job_size = c->size;
    if (cores <= 0) cores = tdm_mpi_cores();
    /* Spin only while this machine's ranks fit the cores they can use
     * together; a queued call waits on the progress thread while the
     * rank's own thread computes: two busy threads per rank. */
    c->spin = !o.no_spin && local_size <= cores;
    c->spin_async = c->spin && 2 * local_size <= cores;
    c->wait = (tdm_mpi_waiter){.timeout_ms = o.timeout_ms, .spin_ns = TDM_MPI_SPIN_NS,
                               .yield_ns = TDM_MPI_YIELD_NS, .abort_check = o.abort_check,
                               .abort_ctx = o.abort_ctx};
    /* tuning knobs for measurements, not an interface */
    const char *spin_us = getenv("TANDEM_MPI_SPIN_US"), *yield_us = getenv("TANDEM_MPI_YIELD_US");
    if (spin_us && *spin_us) c->wait.spin_ns = (uint64_t)strtoull(spin_us, NULL, 10) * 1000;
    if (yield_us && *yield_us) c->wait.yield_ns = (uint64_t)strtoull(yield_us, NULL, 10) * 1000;
    c->algo = "none";
    snprintf(c->what, sizeof c->what, "%s", what);
    TDM_INFO(MPI, "%s: rank %d of %d, %d ranks on this machine, %d cores, %s waits, timeout "
             "%lld ms", what, c->rank, c->size, local_size, cores,
             c->spin ? "spinning" : "sleeping", (long long)o.timeout_ms);
    /* last, once every field it may read is written */
    int wrc = pthread_create(&c->wd_thread, NULL, tdm_mpi_watchdog, c);
    if (wrc) {
        pthread_mutex_destroy(&c->wd_mu);
        pthread_cond_destroy(&c->wd_cv);
        MPI_Comm_free(&c->comm);
        free(c);
        return tdm_error_set(TDM_STATUS_SYSTEM, "%s: the watchdog of blocking calls: "
                             "pthread_create: %s", what, strerror(wrc));
    }
    c->wd_started = 1;
    return tdm_comm_create(out, &tdm_mpi_ops, c, c->rank, c->size);
}

MPI_Comm tdm_mpi_comm_handle(const tdm_comm *comm)
{
    if (!comm || strcmp(tdm_comm_backend_name(comm), "mpi") != 0) return MPI_COMM_NULL;
    const tdm_mpi_impl *c = tdm_comm_impl(comm);
    return c->comm;
}

/* --- joining ----------------------------------------------------------------- */

typedef struct tdm_mpi_hello {
    int32_t pid;
    char host[60];
} tdm_mpi_hello;

/* Every rank reports to rank 0 over MPI_COMM_WORLD; rank 0 names those
 * that have not within the join timeout, then answers everyone. Bounds
 * the communicator's creation (MPI's own, below, cannot be bounded by
 * rank). */
static void tdm_mpi_join(const tdm_mpi_opts *o)
{
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    tdm_mpi_waiter w = {.timeout_ms = o->join_timeout_ms, .spin = 0};
    tdm_mpi_hello me = {.pid = (int32_t)getpid()};
    gethostname(me.host, sizeof me.host - 1);
    if (rank != 0) {
        int32_t go = 0;
        MPI_Request r[2];
        MPI_Isend(&me, (int)sizeof me, MPI_BYTE, 0, TDM_MPI_TAG_JOIN, MPI_COMM_WORLD, &r[0]);
        MPI_Irecv(&go, 1, MPI_INT32_T, 0, TDM_MPI_TAG_JOIN, MPI_COMM_WORLD, &r[1]);
        /* longer than rank 0's own bound, so that its verdict comes first */
        w.timeout_ms = 2 * o->join_timeout_ms;
        tdm_mpi_wait_all(&w, 2, r, NULL, "mpi: joining (waiting for rank 0's answer)");
        return;
    }
    if (size == 1) return;
    tdm_mpi_hello *h = calloc((size_t)size, sizeof *h);
    MPI_Request *r = calloc((size_t)size, sizeof *r);
    int32_t *go = calloc((size_t)size, sizeof *go);
    if (!h || !r || !go) tdm_mpi_abort_job("mpi: joining: cannot allocate for %d ranks", size);
    for (int p = 1; p < size; p++)
        MPI_Irecv(&h[p], (int)sizeof *h, MPI_BYTE, p, TDM_MPI_TAG_JOIN, MPI_COMM_WORLD, &r[p]);
    r[0] = MPI_REQUEST_NULL;
    uint64_t t0 = tdm_time_ns();
    for (;;) {
        int done = 0;
        MPI_Testall(size, r, &done, MPI_STATUSES_IGNORE);
        if (done) break;
        if (tdm_time_ns() - t0 > (uint64_t)o->join_timeout_ms * 1000000u) {
            char missing[512] = "";
            size_t used = 0;
            int n_missing = 0;
            for (int p = 1; p < size; p++) {
                int f = 0;
                if (r[p] != MPI_REQUEST_NULL) MPI_Test(&r[p], &f, MPI_STATUS_IGNORE);
                if (r[p] == MPI_REQUEST_NULL) continue;
                n_missing++;
                if (used < sizeof missing - 16) {
                    int k = snprintf(missing + used, sizeof missing - used, "%s%d",
                                     used ? ", " : "", p);
                    if (k > 0) used += (size_t)k;
                }
            }
            tdm_mpi_abort_job("mpi: rank%s %s of %d did not join within %lld ms (started by the "
                              "launcher but never reached tandem's communicator set-up: stalled, "
                              "or failed before it; TANDEM_MPI_JOIN_TIMEOUT_MS sets the bound)",
                              n_missing == 1 ? "" : "s", missing, size,
                              (long long)o->join_timeout_ms);
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    for (int p = 1; p < size; p++) {
        TDM_TRACE(MPI, "rank %d joined from %.*s (pid %d)", p, (int)sizeof h[p].host,
                  h[p].host, (int)h[p].pid);
        MPI_Isend(&go[p], 1, MPI_INT32_T, p, TDM_MPI_TAG_JOIN, MPI_COMM_WORLD, &r[p]);
    }
    tdm_mpi_wait_all(&w, size, r, NULL, "mpi: joining (answering every rank)");
    free(h);
    free(r);
    free(go);
}

tdm_status tdm_mpi_local_size(MPI_Comm comm, int64_t join_ms, int *local_size, int *cores)
{
    tdm_mpi_guard g;
    MPI_Comm node = MPI_COMM_NULL;
    tdm_mpi_guard_begin(&g, join_ms, "MPI_Comm_split_type (grouping the ranks by machine)");
    int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    tdm_mpi_guard_end(&g);
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING];
        tdm_mpi_error_string(rc, s, sizeof s);
        return tdm_error_set(TDM_STATUS_SYSTEM, "mpi: MPI_Comm_split_type: %s", s);
    }
    MPI_Comm_size(node, local_size);
    *cores = tdm_mpi_union_cores(node, join_ms);
    MPI_Comm_free(&node);
    return TDM_STATUS_OK;
}

tdm_status tdm_comm_init_mpi(tdm_comm **out, const tdm_mpi_opts *opts)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "tdm_comm_init_mpi: out is NULL");
    *out = NULL;
    TDM_CHECK(tdm_mpi_init());
    tdm_mpi_opts o = tdm_mpi_opts_resolve(opts);
    tdm_mpi_join(&o);
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    int rc = MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req);
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING];
        tdm_mpi_error_string(rc, s, sizeof s);
        tdm_mpi_abort_job("mpi: MPI_Comm_idup: %s", s);
    }
    tdm_mpi_waiter w = {.timeout_ms = o.join_timeout_ms};
    tdm_mpi_wait_all(&w, 1, &req, NULL, "mpi: MPI_Comm_idup (creating the communicator)");
    int local = 1, cores = 0;
    tdm_status st = tdm_mpi_local_size(dup, o.join_timeout_ms, &local, &cores);
    if (st != TDM_STATUS_OK) {
        MPI_Comm_free(&dup);
        return st;
    }
    return tdm_mpi_comm_wrap(out, dup, local, cores, &o, "mpi");
}

/* --- the benchmark's peer ------------------------------------------------------ */

tdm_status tdm_mpi_peer_run(tdm_comm *comm, const tdm_comm_call *call)
{
    TDM_CHECK(tdm_comm_call_check(comm, call));
    TDM_REQUIRE(tdm_mpi_comm_handle(comm) != MPI_COMM_NULL, TDM_STATUS_INVALID_ARG,
                "tdm_mpi_peer_run: the %s communicator is not an MPI one",
                tdm_comm_backend_name(comm));
    tdm_mpi_impl *c = tdm_comm_impl(comm);
    TDM_REQUIRE(!tdm_mpi_half(call->dtype), TDM_STATUS_UNSUPPORTED,
                "MPI's own collectives have no %s type", tdm_dtype_name(call->dtype));
    TDM_REQUIRE(call->count <= INT_MAX, TDM_STATUS_UNSUPPORTED,
                "MPI counts stop at %d", INT_MAX);
    if (call->coll != TDM_COLL_BARRIER && call->count == 0) return TDM_STATUS_OK;
    /* the calling thread only: the communicator must be idle */
    int rc = tdm_mpi_post(c, call, 0, NULL, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING];
        tdm_mpi_error_string(rc, s, sizeof s);
        tdm_mpi_abort_job("mpi peer: %s failed: %s", c->algo, s);
    }
    tdm_mpi_finish(c, call);
    return TDM_STATUS_OK;
}
