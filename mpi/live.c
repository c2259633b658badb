/* mpi/live.c: the liveness of an MPI job's ranks (mpi/mpi_impl.h,
 * tdm_mpi_live_*): every rank's heartbeat thread sends a beat to every
 * other rank every period over a communicator of its own, and notes the
 * beats it receives. A peer silent for the stall bound, or (on this
 * machine) whose process is gone without saying goodbye, is published as
 * the reason that every wait of the job's communicators then stops with
 * (tdm_mpi_wait_all and the watchdog poll tdm_mpi_live_reason), naming
 * the rank: "rank 1 (pid 4121) is stopped (process state T: SIGSTOP or
 * job control): no heartbeat for 3.0 s". Without it a stopped rank was
 * found only by the collective timeout (300 s), unnamed; the shm
 * backend's heartbeats (shm/wait.c) name it in seconds, and so now does
 * every MPI backend, across machines too.
 *
 * A rank that leaves the job in order (tdm_mpi_job_free) says goodbye
 * first and is no longer watched. Not the waits themselves
 * (mpi/runtime.c) nor the job (mpi/job.c). */
#include "mpi/mpi_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/flight.h"
#include "core/log.h"
#include "core/proc.h"
#include "core/timer.h"

#define TDM_MPI_LIVE_TAG 0x7d52
#define TDM_MPI_LIVE_BEAT 1
#define TDM_MPI_LIVE_BYE 2
#define TDM_MPI_LIVE_DUMP 3                  /* a rank aborts the job: dump now */
#define TDM_MPI_LIVE_DUMPED 4                /* ... done */
#define TDM_MPI_LIVE_DUMP_MS 2000            /* the aborting rank waits this long at most */
#define TDM_MPI_LIVE_DEFAULT_STALL_MS 3000   /* as shm's TANDEM_SHM_STALL_MS */
#define TDM_MPI_LIVE_MIN_STALL_MS 500
#define TDM_MPI_LIVE_BEATS_PER_STALL 6       /* a beat every stall/6: 5 may be late */
#define TDM_MPI_LIVE_BYE_MS 500              /* goodbyes get this long to leave */
#define TDM_MPI_LIVE_HOST 64

typedef struct tdm_mpi_live_peer {
    int32_t pid;
    char host[TDM_MPI_LIVE_HOST];
    int local;                 /* on this machine: /proc can say more */
    int gone;                  /* said goodbye */
    uint64_t last_ns;          /* the last beat received (or the start) */
    MPI_Request rreq, sreq;
    int64_t rbuf, sbuf;
    /* the job's abort: this peer asked us to dump (answered by the thread),
     * or answered ours (dumped) */
    int dump_asked;
    _Atomic int dumped;
    MPI_Request areq;
    int64_t abuf;
} tdm_mpi_live_peer;

struct tdm_mpi_live {
    MPI_Comm comm;             /* owned: a duplicate of MPI_COMM_WORLD */
    int rank, size;
    uint64_t stall_ns, period_ns;
    tdm_mpi_live_peer *peer;   /* (size) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;                  /* under mu */
    _Atomic int flagged;       /* 1: reason is written (release) */
    char reason[512];
};

/* The job's liveness, for the waits (one MPI job per process). */
static _Atomic(tdm_mpi_live *) tdm_mpi_live_now;

const char *tdm_mpi_live_reason(void)
{
    tdm_mpi_live *l = atomic_load_explicit(&tdm_mpi_live_now, memory_order_acquire);
    /* acquire pairs with the release store of `flagged` after the text */
    return l && atomic_load_explicit(&l->flagged, memory_order_acquire) ? l->reason : NULL;
}

/* What /proc says of a local pid: 'X' gone (or a zombie), else its state
 * letter ('?' when unreadable). */
static char tdm_mpi_live_proc(int32_t pid)
{
    if (pid <= 0) return '?';
    if (kill(pid, 0) == -1 && errno == ESRCH) return 'X';
    char buf[512];
    const char *p = tdm_proc_stat(pid, buf, sizeof buf);
    if (!p) return errno == ENOENT ? 'X' : '?';
    return p[0] == 'Z' ? 'X' : p[0];
}

static void tdm_mpi_live_flag(tdm_mpi_live *l, int q, char state, double silent_s)
{
    const tdm_mpi_live_peer *p = &l->peer[q];
    if (state == 'X')
        snprintf(l->reason, sizeof l->reason, "rank %d (pid %d) died: its process is gone and it "
                 "never left the job (mpirun says how it ended)", q, (int)p->pid);
    else if (state == 'T' || state == 't')
        snprintf(l->reason, sizeof l->reason, "rank %d (pid %d) is stopped %s: no heartbeat for "
                 "%.1f s", q, (int)p->pid, state == 'T' ? "(process state T: SIGSTOP or job "
                 "control)" : "by a debugger (process state t)", silent_s);
    else if (p->local)
        snprintf(l->reason, sizeof l->reason, "rank %d (pid %d) is frozen: no heartbeat for "
                 "%.1f s (process state %c)", q, (int)p->pid, silent_s, state);
    else
        snprintf(l->reason, sizeof l->reason, "rank %d (pid %d) is frozen or unreachable: no "
                 "heartbeat from %s for %.1f s (stopped, hung, or its network is down; "
                 "TANDEM_MPI_STALL_MS sets the bound)", q, (int)p->pid, p->host, silent_s);
    /* release: the waits read the text only after they see the flag */
    atomic_store_explicit(&l->flagged, 1, memory_order_release);
    TDM_WARN(MPI, "liveness: %s", l->reason);
}

/* One round: beats out, beats in, verdicts. */
static void tdm_mpi_live_round(tdm_mpi_live *l)
{
    uint64_t now = tdm_time_ns();
    for (int q = 0; q < l->size; q++) {
        tdm_mpi_live_peer *p = &l->peer[q];
        if (q == l->rank) continue;
        int done = 0;
        /* drain every beat that came (one receive posted at a time) */
        while (!p->gone && p->rreq != MPI_REQUEST_NULL &&
               MPI_Test(&p->rreq, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
            if (p->rbuf == TDM_MPI_LIVE_BYE) {
                p->gone = 1;
                break;
            }
            if (p->rbuf == TDM_MPI_LIVE_DUMPED) atomic_store(&p->dumped, 1);
            if (p->rbuf == TDM_MPI_LIVE_DUMP) p->dump_asked = 1;
            p->last_ns = now;
            MPI_Irecv(&p->rbuf, 1, MPI_INT64_T, q, TDM_MPI_LIVE_TAG, l->comm, &p->rreq);
        }
        if (p->gone) continue;
        if (p->dump_asked == 1) {
            /* that rank is ending the job (MPI_Abort, then mpirun's
             * SIGTERM and, a second later, SIGKILL): the flight records
             * are written now, while this process surely runs, and the
             * rank is told (it waits for that before it aborts) */
            tdm_fr_dump_all("job abort");
            p->dump_asked = 2;
            p->abuf = TDM_MPI_LIVE_DUMPED;
            MPI_Isend(&p->abuf, 1, MPI_INT64_T, q, TDM_MPI_LIVE_TAG, l->comm, &p->areq);
        }
        /* one beat in flight per peer: a stopped peer's never piles up */
        done = p->sreq == MPI_REQUEST_NULL;
        if (!done) MPI_Test(&p->sreq, &done, MPI_STATUS_IGNORE);
        if (done) {
            p->sbuf = TDM_MPI_LIVE_BEAT;
            MPI_Isend(&p->sbuf, 1, MPI_INT64_T, q, TDM_MPI_LIVE_TAG, l->comm, &p->sreq);
        }
        if (atomic_load_explicit(&l->flagged, memory_order_relaxed)) continue;
        char state = p->local ? tdm_mpi_live_proc(p->pid) : '?';
        if (state == 'X') tdm_mpi_live_flag(l, q, state, (double)(now - p->last_ns) * 1e-9);
        else if (now - p->last_ns > l->stall_ns)
            tdm_mpi_live_flag(l, q, state, (double)(now - p->last_ns) * 1e-9);
    }
}

static void *tdm_mpi_live_main(void *arg)
{
    tdm_mpi_live *l = arg;
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        pthread_mutex_unlock(&l->mu);
        tdm_mpi_live_round(l);
        pthread_mutex_lock(&l->mu);
        if (l->stop) break;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + l->period_ns;
        ts.tv_sec = (time_t)(t / 1000000000ull);
        ts.tv_nsec = (long)(t % 1000000000ull);
        pthread_cond_timedwait(&l->cv, &l->mu, &ts);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* TANDEM_MPI_STALL_MS: the bound (ms), 0 or negative: no liveness. */
static tdm_status tdm_mpi_live_stall_ms(int64_t *ms)
{
    const char *e = getenv("TANDEM_MPI_STALL_MS");
    *ms = TDM_MPI_LIVE_DEFAULT_STALL_MS;
    if (!e || !*e) return TDM_STATUS_OK;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(e, &end, 10);
    TDM_REQUIRE(!errno && end != e && !*end, TDM_STATUS_INVALID_ARG,
                "TANDEM_MPI_STALL_MS='%s' is not an integer (ms a rank may be silent before it "
                "is named stopped or frozen; 0: no liveness checks)", e);
    *ms = v <= 0 ? 0 : v < TDM_MPI_LIVE_MIN_STALL_MS ? TDM_MPI_LIVE_MIN_STALL_MS : v;
    return TDM_STATUS_OK;
}

/* Rank 0's bound, for every rank: whether to watch at all decides a
 * collective (MPI_Comm_dup), so ranks that disagree (an environment set
 * on one machine only) would call it on some ranks and not on others and
 * hang. A rank whose own setting differs says so and follows rank 0; an
 * invalid setting on rank 0 fails every rank. Collective over
 * MPI_COMM_WORLD. */
static tdm_status tdm_mpi_live_agree_stall_ms(int rank, int64_t join_ms, int64_t *ms)
{
    int64_t mine = 0;
    tdm_status own = tdm_mpi_live_stall_ms(&mine);
    char own_msg[TDM_ERROR_MSG_MAX];
    snprintf(own_msg, sizeof own_msg, "%s", own ? tdm_error_message() : "");
    /* rank 0's bound, and its setting as written: when it is invalid every
     * rank names it, since mpirun may end rank 0 before its own message
     * is out (the others exit 1 at the same moment) */
    struct {
        int64_t agreed;
        char setting[56];
    } msg = {.agreed = -1};
    if (rank == 0) {
        const char *e = getenv("TANDEM_MPI_STALL_MS");
        msg.agreed = own ? -1 : mine;
        snprintf(msg.setting, sizeof msg.setting, "%s", e ? e : "");
    }
    MPI_Request req;
    MPI_Ibcast(&msg, (int)sizeof msg, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    tdm_mpi_waiter w = {.timeout_ms = join_ms};
    tdm_mpi_wait_all(&w, 1, &req, NULL, "mpi: agreeing on TANDEM_MPI_STALL_MS");
    int64_t agreed = msg.agreed;
    msg.setting[sizeof msg.setting - 1] = 0;
    if (agreed < 0)
        return rank == 0 ? tdm_error_set(own, "%s", own_msg)
                         : tdm_error_set(TDM_STATUS_INVALID_ARG,
                                         "rank 0's TANDEM_MPI_STALL_MS='%s' is not an integer "
                                         "(ms a rank may be silent; 0: no liveness checks): the "
                                         "job cannot agree on its liveness bound",
                                         msg.setting);
    if (own || mine != agreed)
        TDM_WARN(MPI, "rank %d: TANDEM_MPI_STALL_MS=%s (%s) differs from rank 0's: every rank "
                 "uses rank 0's, %lld ms%s", rank, getenv("TANDEM_MPI_STALL_MS") ?
                 getenv("TANDEM_MPI_STALL_MS") : "unset", own ? "invalid" : "its bound",
                 (long long)agreed, agreed ? "" : " (no liveness checks)");
    *ms = agreed;
    return TDM_STATUS_OK;
}

tdm_status tdm_mpi_live_start(tdm_mpi_live **out, int64_t join_ms)
{
    *out = NULL;
    int64_t stall_ms = 0;
    int size = 1, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (size < 2) return tdm_mpi_live_stall_ms(&stall_ms);   /* a bad value still said */
    TDM_CHECK(tdm_mpi_live_agree_stall_ms(rank, join_ms, &stall_ms));
    if (!stall_ms) return TDM_STATUS_OK;
    tdm_mpi_live *l = calloc(1, sizeof *l);
    TDM_REQUIRE(l, TDM_STATUS_OUT_OF_MEMORY, "mpi: liveness: calloc");
    l->peer = calloc((size_t)size, sizeof *l->peer);
    tdm_mpi_live_peer *all = l->peer;
    if (!all) {
        free(l);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "mpi: liveness for %d ranks", size);
    }
    tdm_mpi_guard g;
    tdm_mpi_guard_begin(&g, join_ms, "MPI_Comm_dup (the job's heartbeats)");
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &l->comm);
    tdm_mpi_guard_end(&g);
    if (rc != MPI_SUCCESS) {
        free(all);
        free(l);
        return tdm_error_set(TDM_STATUS_SYSTEM, "mpi: liveness: MPI_Comm_dup failed");
    }
    MPI_Comm_set_errhandler(l->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(l->comm, &l->rank);
    l->size = size;
    l->stall_ns = (uint64_t)stall_ms * 1000000u;
    l->period_ns = l->stall_ns / TDM_MPI_LIVE_BEATS_PER_STALL;
    /* every rank's pid and machine: the names and the /proc checks */
    tdm_mpi_live_peer me = {.pid = (int32_t)getpid()};
    gethostname(me.host, sizeof me.host - 1);
    MPI_Request req;
    size_t sz = sizeof(int32_t) + TDM_MPI_LIVE_HOST;
    char *mine = calloc(1, sz), *every = calloc((size_t)size, sz);
    if (mine && every) {
        memcpy(mine, &me.pid, sizeof(int32_t));
        memcpy(mine + sizeof(int32_t), me.host, TDM_MPI_LIVE_HOST);
        MPI_Iallgather(mine, (int)sz, MPI_BYTE, every, (int)sz, MPI_BYTE, l->comm, &req);
        tdm_mpi_waiter w = {.timeout_ms = join_ms};
        tdm_mpi_wait_all(&w, 1, &req, NULL, "mpi: the ranks' pids and machines");
    }
    uint64_t now = tdm_time_ns();
    for (int q = 0; q < size; q++) {
        tdm_mpi_live_peer *p = &all[q];
        if (every) {
            memcpy(&p->pid, every + (size_t)q * sz, sizeof(int32_t));
            memcpy(p->host, every + (size_t)q * sz + sizeof(int32_t), TDM_MPI_LIVE_HOST);
            p->host[TDM_MPI_LIVE_HOST - 1] = 0;
        }
        p->local = every && !strcmp(p->host, me.host);
        p->last_ns = now;
        p->sreq = MPI_REQUEST_NULL;
        p->rreq = MPI_REQUEST_NULL;
        if (q != l->rank)
            MPI_Irecv(&p->rbuf, 1, MPI_INT64_T, q, TDM_MPI_LIVE_TAG, l->comm, &p->rreq);
    }
    free(mine);
    free(every);
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->cv, &ca);
    pthread_condattr_destroy(&ca);
    /* the thread takes no signals: they stay with the program's threads */
    sigset_t block, old;
    sigfillset(&block);
    pthread_sigmask(SIG_SETMASK, &block, &old);
    rc = pthread_create(&l->thread, NULL, tdm_mpi_live_main, l);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        TDM_WARN(MPI, "liveness: pthread_create: %s; a stopped rank is found by the collective "
                 "timeout only", strerror(rc));
        l->stop = 1;
        tdm_mpi_live_stop(l);
        return TDM_STATUS_OK;
    }
    atomic_store_explicit(&tdm_mpi_live_now, l, memory_order_release);
    TDM_INFO(MPI, "liveness: a beat every %llu ms to each of %d ranks; silent %lld ms: named",
             (unsigned long long)(l->period_ns / 1000000u), size - 1, (long long)stall_ms);
    *out = l;
    return TDM_STATUS_OK;
}

void tdm_mpi_live_dump_everywhere(void)
{
    tdm_mpi_live *l = atomic_load_explicit(&tdm_mpi_live_now, memory_order_acquire);
    if (!l) return;
    /* the peers' heartbeat threads dump and answer; a peer that has been
     * silent (stopped, gone) cannot, and is not waited for */
    MPI_Request *req = calloc((size_t)l->size, sizeof *req);
    int64_t *ask = calloc((size_t)l->size, sizeof *ask);
    if (!req || !ask) {
        free(req);
        free(ask);
        return;
    }
    uint64_t t0 = tdm_time_ns();
    for (int q = 0; q < l->size; q++) {
        req[q] = MPI_REQUEST_NULL;
        if (q == l->rank || l->peer[q].gone) continue;
        ask[q] = TDM_MPI_LIVE_DUMP;
        MPI_Isend(&ask[q], 1, MPI_INT64_T, q, TDM_MPI_LIVE_TAG, l->comm, &req[q]);
    }
    for (;;) {
        int waiting = 0;
        uint64_t now = tdm_time_ns();
        for (int q = 0; q < l->size; q++) {
            const tdm_mpi_live_peer *p = &l->peer[q];
            if (q == l->rank || p->gone || atomic_load(&p->dumped)) continue;
            /* (last_ns is the heartbeat thread's: a stale read only waits longer) */
            if (now - p->last_ns > l->stall_ns / 2) continue;
            waiting++;
        }
        if (!waiting || now - t0 > TDM_MPI_LIVE_DUMP_MS * 1000000ull) break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    /* the asks stay posted (the process ends now): the buffers too */
}

void tdm_mpi_live_stop(tdm_mpi_live *l)
{
    if (!l) return;
    tdm_mpi_live *expect = l;
    atomic_compare_exchange_strong(&tdm_mpi_live_now, &expect, NULL);
    pthread_mutex_lock(&l->mu);
    int started = !l->stop;
    l->stop = 1;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    if (started) pthread_join(l->thread, NULL);
    /* goodbye to every peer still watched, so that none names this rank
     * once it is gone; a peer that cannot take it (stopped, gone) is not
     * waited for beyond TDM_MPI_LIVE_BYE_MS */
    int n = 2 * l->size, done = 0;
    MPI_Request *req = calloc((size_t)n, sizeof *req);
    int64_t *byes = calloc((size_t)l->size, sizeof *byes);
    for (int q = 0; req && byes && q < l->size; q++) {
        tdm_mpi_live_peer *p = &l->peer[q];
        req[2 * q] = p->sreq;   /* a beat still in flight */
        req[2 * q + 1] = MPI_REQUEST_NULL;
        p->sreq = MPI_REQUEST_NULL;
        if (q == l->rank || p->gone) continue;
        byes[q] = TDM_MPI_LIVE_BYE;
        MPI_Isend(&byes[q], 1, MPI_INT64_T, q, TDM_MPI_LIVE_TAG, l->comm, &req[2 * q + 1]);
    }
    uint64_t t0 = tdm_time_ns();
    while (req && byes && !done && tdm_time_ns() - t0 < TDM_MPI_LIVE_BYE_MS * 1000000ull) {
        MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
        if (!done) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    for (int q = 0; q < l->size; q++) {
        tdm_mpi_live_peer *p = &l->peer[q];
        if (p->rreq != MPI_REQUEST_NULL) {
            MPI_Cancel(&p->rreq);
            MPI_Wait(&p->rreq, MPI_STATUS_IGNORE);
        }
    }
    /* A send a peer never took still reads its buffer: its request is
     * released, the buffers kept (a few bytes, and only when a peer is
     * stopped or gone while this rank leaves). */
    for (int i = 0; req && !done && i < n; i++)
        if (req[i] != MPI_REQUEST_NULL) MPI_Request_free(&req[i]);
    MPI_Comm_free(&l->comm);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(req);
    if (done || !byes) {
        free(byes);
        free(l->peer);
        free(l);
    }
}
