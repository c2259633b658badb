/* mpi/runtime.c: what every MPI communicator of tandem stands on: MPI's
 * initialisation with its thread-level check, finalisation, the bounded
 * wait on requests (spin, then short sleeps, a deadline, an external
 * abort check), the watchdog that bounds MPI's blocking set-up calls, and
 * the job abort (a message on stderr, then MPI_Abort).
 * Not the collectives (mpi/mpi_comm.c) nor the job's topology
 * (mpi/job.c). */
#include "mpi/mpi_impl.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/device.h"
#include "core/flight.h"
#include "core/log.h"
#include "core/timer.h"

/* 1 when tdm_mpi_init called MPI_Init_thread (and so finalises it). */
static atomic_int tdm_mpi_we_initialised;
static pthread_mutex_t tdm_mpi_init_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *tdm_mpi_level_name(int level)
{
    switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown thread level";
    }
}

void tdm_mpi_error_string(int rc, char *out, size_t n)
{
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "error %d", rc);
    snprintf(out, n, "%s", s);
}

static int64_t tdm_mpi_env_ms(const char *name, int64_t dflt)
{
    const char *e = getenv(name);
    if (!e || !*e) return dflt;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(e, &end, 10);
    if (errno || !end || *end || v <= 0) {
        TDM_WARN(MPI, "%s='%s' is not a positive number of milliseconds; using %lld", name, e,
                 (long long)dflt);
        return dflt;
    }
    return (int64_t)v;
}

tdm_mpi_opts tdm_mpi_opts_resolve(const tdm_mpi_opts *opts)
{
    tdm_mpi_opts o = opts ? *opts : (tdm_mpi_opts){0};
    if (o.timeout_ms <= 0)
        o.timeout_ms = tdm_mpi_env_ms("TANDEM_MPI_TIMEOUT_MS", TDM_MPI_DEFAULT_TIMEOUT_MS);
    if (o.join_timeout_ms <= 0)
        o.join_timeout_ms = tdm_mpi_env_ms("TANDEM_MPI_JOIN_TIMEOUT_MS",
                                           TDM_MPI_DEFAULT_JOIN_TIMEOUT_MS);
    return o;
}

int tdm_mpi_cores(void) { return tdm_device_host_cores(); }

void tdm_mpi_affinity_mask(uint64_t *mask)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) {
        /* no mask: every online core, as tdm_device_host_cores says */
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        for (long i = 0; i < n && i < CPU_SETSIZE; i++) CPU_SET((int)i, &set);
    }
    memset(mask, 0, TDM_MPI_MASK_WORDS * sizeof *mask);
    for (int i = 0; i < CPU_SETSIZE; i++)
        if (CPU_ISSET(i, &set)) mask[i / 64] |= (uint64_t)1 << (i % 64);
}

int tdm_mpi_mask_cores(const uint64_t *mask)
{
    int n = 0;
    for (int i = 0; i < TDM_MPI_MASK_WORDS; i++) n += __builtin_popcountll(mask[i]);
    return n > 0 ? n : 1;
}

int tdm_mpi_union_cores(MPI_Comm comm, int64_t ms)
{
    uint64_t mask[TDM_MPI_MASK_WORDS];
    tdm_mpi_affinity_mask(mask);
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, mask, TDM_MPI_MASK_WORDS, MPI_UINT64_T, MPI_BOR, comm, &req);
    tdm_mpi_waiter w = {.timeout_ms = ms};
    tdm_mpi_wait_all(&w, 1, &req, NULL, "mpi: the union of the machine's ranks' CPU affinity");
    return tdm_mpi_mask_cores(mask);
}

void tdm_mpi_library_version(char *buf, size_t len)
{
    char v[MPI_MAX_LIBRARY_VERSION_STRING];
    int n = 0;
    if (MPI_Get_library_version(v, &n) != MPI_SUCCESS) {
        snprintf(buf, len, "unknown MPI library");
        return;
    }
    /* the first line is enough ("Open MPI v4.1.4, package: ...") */
    size_t line = strcspn(v, "\n");
    snprintf(buf, len, "%.*s", (int)line, v);
}

/* The level asked of MPI_Init_thread: MPI_THREAD_MULTIPLE, unless
 * TANDEM_MPI_THREAD_LEVEL names a lower one. That variable exists to test
 * the check below (MPI grants what is asked), not to run with less. */
static int tdm_mpi_level_wanted(void)
{
    const char *e = getenv("TANDEM_MPI_THREAD_LEVEL");
    if (!e || !*e) return MPI_THREAD_MULTIPLE;
    if (!strcmp(e, "single")) return MPI_THREAD_SINGLE;
    if (!strcmp(e, "funneled")) return MPI_THREAD_FUNNELED;
    if (!strcmp(e, "serialized")) return MPI_THREAD_SERIALIZED;
    return MPI_THREAD_MULTIPLE;
}

static void tdm_mpi_dump_at_exit(void) { tdm_fr_dump_all("exit"); }

tdm_status tdm_mpi_init(void)
{
    pthread_mutex_lock(&tdm_mpi_init_mu);
    int inited = 0, finalized = 0, provided = MPI_THREAD_SINGLE;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    tdm_status st = TDM_STATUS_OK;
    if (finalized) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "mpi: MPI has already been finalised in this "
                           "process; it cannot be initialised again");
        goto out;
    }
    if (!inited) {
        tdm_mpi_guard g;
        /* A rank that never starts keeps the others in MPI_Init's
         * exchange of addresses. Its own bound: starting the job's
         * processes (launcher, a loaded machine, sanitizers) is slower
         * than joining, which is counted from here on; by default the
         * join timeout. */
        tdm_mpi_opts o = tdm_mpi_opts_resolve(NULL);
        int64_t init_ms = tdm_mpi_env_ms("TANDEM_MPI_INIT_TIMEOUT_MS", o.join_timeout_ms);
        tdm_mpi_guard_begin(&g, init_ms, "MPI_Init_thread (waiting for every rank of the job to "
                            "start; TANDEM_MPI_INIT_TIMEOUT_MS sets the bound)");
        int rc = MPI_Init_thread(NULL, NULL, tdm_mpi_level_wanted(), &provided);
        tdm_mpi_guard_end(&g);
        if (rc != MPI_SUCCESS) {
            char s[MPI_MAX_ERROR_STRING];
            tdm_mpi_error_string(rc, s, sizeof s);
            st = tdm_error_set(TDM_STATUS_SYSTEM, "mpi: MPI_Init_thread: %s", s);
            goto out;
        }
        atomic_store(&tdm_mpi_we_initialised, 1);
    } else {
        MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_MULTIPLE) {
        st = tdm_error_set(TDM_STATUS_UNSUPPORTED,
                           "mpi: the MPI library provides %s, but tandem's MPI communicator needs "
                           "MPI_THREAD_MULTIPLE (it calls MPI from the calling thread, from each "
                           "communicator's progress thread and, to abort, from any thread)%s",
                           tdm_mpi_level_name(provided),
                           inited ? "; initialise MPI with MPI_Init_thread(..., "
                                    "MPI_THREAD_MULTIPLE, ...) before tandem"
                                  : "; use an MPI built with thread support (Open MPI 3.0 "
                                    "and later by default; --enable-mpi-thread-multiple)");
        goto out;
    }
    TDM_INFO(MPI, "MPI initialised (%s, %s)", tdm_mpi_level_name(provided),
             inited ? "by the program" : "by tandem");
    /* When a rank fails, mpirun ends the others with SIGTERM (then
     * SIGKILL): each dumps its flight records then, as they stand (the
     * application's own SIGTERM handler, if any, is left alone). */
    tdm_fr_dump_on_signal(SIGTERM);
    /* Open MPI ends a process itself on some errors (a peer's connection
     * lost as the job aborts), by exit: whatever recorder is still live
     * then is mid-job, and dumps (a finished job has freed them all) */
    static atomic_int at_exit_set;
    if (!atomic_exchange(&at_exit_set, 1)) atexit(tdm_mpi_dump_at_exit);
out:
    pthread_mutex_unlock(&tdm_mpi_init_mu);
    return st;
}

void tdm_mpi_finalize(void)
{
    pthread_mutex_lock(&tdm_mpi_init_mu);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (atomic_load(&tdm_mpi_we_initialised) && !finalized) {
        tdm_mpi_guard g;
        tdm_mpi_opts o = tdm_mpi_opts_resolve(NULL);
        /* MPI_Finalize waits for the other ranks (Open MPI's closing
         * exchange): bounded like every other wait. */
        tdm_mpi_guard_begin(&g, o.timeout_ms, "MPI_Finalize (waiting for every rank to finish)");
        MPI_Finalize();
        tdm_mpi_guard_end(&g);
    }
    pthread_mutex_unlock(&tdm_mpi_init_mu);
}

/* --- the job abort ---------------------------------------------------------- */

static atomic_int tdm_mpi_aborting;

_Noreturn void tdm_mpi_abort_job(const char *fmt, ...)
{
    if (atomic_exchange(&tdm_mpi_aborting, 1)) {
        /* another thread is ending the job: MPI_Abort will end us too */
        for (;;) pause();
    }
    char reason[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    int inited = 0, finalized = 0, rank = -1, size = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    int live = inited && !finalized;
    if (live) {
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
    }
    char host[64] = "?";
    gethostname(host, sizeof host - 1);
    /* The flight records first: every call in flight ends failed with the
     * reason, and each recorder dumps, before MPI_Abort ends this process
     * (mpirun then ends the others with SIGTERM, on which they dump:
     * tdm_mpi_init installs that). */
    tdm_fr_fail_all(strstr(reason, "did not complete within") ? TDM_STATUS_TIMEOUT
                                                               : TDM_STATUS_ABORTED,
                    reason);
    if (live) tdm_mpi_live_dump_everywhere();
    fflush(stdout);
    if (rank >= 0)
        fprintf(stderr, "tandem: rank %d of %d (%s, pid %d): MPI job aborted: %s\n", rank, size,
                host, (int)getpid(), reason);
    else
        fprintf(stderr, "tandem: %s, pid %d: MPI job aborted: %s\n", host, (int)getpid(), reason);
    fflush(stderr);
    if (live) MPI_Abort(MPI_COMM_WORLD, 1);
    _exit(1);
}

_Noreturn void tdm_mpi_abort(const char *reason)
{
    tdm_mpi_abort_job("%s", reason && *reason ? reason : "aborted by the application");
}

/* --- bounded waits -------------------------------------------------------------- */

void tdm_mpi_wait_all(const tdm_mpi_waiter *w, int n, MPI_Request *reqs, MPI_Status *stats,
                      const char *what)
{
    uint64_t t0 = tdm_time_ns();
    uint64_t limit = (uint64_t)w->timeout_ms * 1000000u;
    unsigned polls = 0;
    MPI_Status local[8];
    if (!stats && n <= 8) stats = local;
    for (;;) {
        int done = 0;
        int rc = MPI_Testall(n, reqs, &done, stats ? stats : MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
            /* the error of the request that failed, when MPI says which */
            for (int i = 0; rc == MPI_ERR_IN_STATUS && stats && i < n; i++)
                if (stats[i].MPI_ERROR != MPI_SUCCESS && stats[i].MPI_ERROR != MPI_ERR_PENDING) {
                    rc = stats[i].MPI_ERROR;
                    break;
                }
            char s[MPI_MAX_ERROR_STRING];
            tdm_mpi_error_string(rc, s, sizeof s);
            tdm_mpi_abort_job("%s: MPI error: %s", what, s);
        }
        if (done) return;
        if (w->abort_check) {
            const char *why = w->abort_check(w->abort_ctx);
            if (why) tdm_mpi_abort_job("%s stopped: %s", what, why);
        }
        const char *dead = tdm_mpi_live_reason();   /* a rank of the job stopped or died */
        if (dead) tdm_mpi_abort_job("%s stopped: %s", what, dead);
        uint64_t el = tdm_time_ns() - t0;
        if (el > limit)
            tdm_mpi_abort_job("%s did not complete within %lld ms (a peer died, stalled or "
                              "issued a different call; raise TANDEM_MPI_TIMEOUT_MS if it is "
                              "only slow)", what, (long long)w->timeout_ms);
        if (w->spin && el < w->spin_ns) continue;
        /* MPI progresses only inside MPI calls, so a wait that sleeps
         * stalls the transfer: poll with sched_yield (which hands the core
         * to whatever else is runnable on it, a peer rank or this rank's
         * computing thread) for yield_ns, then sleep in steps growing to
         * 100 us (a late peer: no need to burn a core). */
        if (++polls < 16 || el < w->yield_ns) {
            sched_yield();
        } else {
            unsigned k = polls - 16 < 7 ? polls - 16 : 7;
            struct timespec ts = {0, (long)(1000u << k) > 100000 ? 100000 : (long)(1000u << k)};
            nanosleep(&ts, NULL);
        }
    }
}

/* --- watchdog of blocking set-up calls -------------------------------------------- */

static void *tdm_mpi_guard_main(void *arg)
{
    tdm_mpi_guard *g = arg;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += g->ms / 1000;
    dl.tv_nsec += (g->ms % 1000) * 1000000;
    if (dl.tv_nsec >= 1000000000) { dl.tv_sec++; dl.tv_nsec -= 1000000000; }
    pthread_mutex_lock(&g->mu);
    int rc = 0;
    while (!g->done && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&g->cv, &g->mu, &dl);
    int done = g->done;
    pthread_mutex_unlock(&g->mu);
    if (!done)
        tdm_mpi_abort_job("%s did not complete within %lld ms", g->what, (long long)g->ms);
    return NULL;
}

void tdm_mpi_guard_begin(tdm_mpi_guard *g, int64_t ms, const char *fmt, ...)
{
    memset(g, 0, sizeof *g);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->what, sizeof g->what, fmt, ap);
    va_end(ap);
    g->ms = ms;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    /* Without a thread the call is merely unbounded: warn, go on. */
    int rc = pthread_create(&g->thread, NULL, tdm_mpi_guard_main, g);
    if (rc) TDM_WARN(MPI, "watchdog for %s: pthread_create: %s", g->what, strerror(rc));
    g->started = rc == 0;
}

void tdm_mpi_guard_end(tdm_mpi_guard *g)
{
    pthread_mutex_lock(&g->mu);
    g->done = 1;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (g->started) pthread_join(g->thread, NULL);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}
