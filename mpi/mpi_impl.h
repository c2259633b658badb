/* mpi/mpi_impl.h: internals shared by the files of mpi/ (the only header
 * of the project that includes mpi.h): the MPI communicator's state, the
 * bounded wait on MPI requests, the watchdog that bounds MPI's blocking
 * set-up calls, and the job abort.
 * Not a public header: users include mpi/mpi_comm.h. */
#ifndef TDM_MPI_MPI_IMPL_H
#define TDM_MPI_MPI_IMPL_H

#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "core/comm_impl.h"
#include "mpi/mpi_comm.h"

#define TDM_MPI_DEFAULT_TIMEOUT_MS 300000
#define TDM_MPI_DEFAULT_JOIN_TIMEOUT_MS 60000
#define TDM_MPI_SPIN_NS (50u * 1000)
#define TDM_MPI_YIELD_NS (2u * 1000 * 1000)
#define TDM_MPI_WATCH_MS 50   /* the watchdog's period */
/* Tag of the joining handshake on MPI_COMM_WORLD (the only traffic
 * tandem sends there; everything else runs on duplicates). */
#define TDM_MPI_TAG_JOIN 0x7d41

/* How a rank waits for MPI requests. */
typedef struct tdm_mpi_waiter {
    int64_t timeout_ms;
    int spin;                 /* poll without sleeping for spin_ns first */
    uint64_t spin_ns;
    uint64_t yield_ns;        /* then poll and yield for this long, then sleep */
    const char *(*abort_check)(void *ctx);
    void *abort_ctx;
} tdm_mpi_waiter;

typedef struct tdm_mpi_impl {
    MPI_Comm comm;            /* owned: a duplicate or a split */
    int rank, size;           /* in comm */
    int job_rank, job_size;   /* what messages say: the job's (a part's differ: hier's) */
    tdm_mpi_waiter wait;
    int spin, spin_async;     /* the policy for synchronous / queued calls */
    /* Which calls use MPI's non-blocking collectives (the others its
     * blocking ones; see mpi_comm.c). */
    enum { TDM_MPI_NB_ASYNC = 0, TDM_MPI_NB_ALL, TDM_MPI_NB_NONE } nb;
    /* The watchdog of blocking calls: the caller publishes which call it
     * is in (its seq, release) after what it is; the watchdog thread,
     * woken every TDM_MPI_WATCH_MS while started, times each call from
     * when it first sees it and aborts the job past the deadline or when
     * abort_check fires. */
    pthread_t wd_thread;
    pthread_mutex_t wd_mu;
    pthread_cond_t wd_cv;
    int wd_started, wd_stop;  /* under wd_mu */
    _Atomic uint64_t wd_call;             /* the blocking call's seq; 0: none */
    _Atomic int wd_coll, wd_dtype;
    _Atomic size_t wd_count;
    uint64_t seq;             /* calls run, for messages */
    const char *algo;
    void *scratch;            /* float32 staging of the 16-bit types, in-place copies */
    size_t scratch_bytes;
    char what[48];            /* "mpi" or "hier (network part)": names it in messages */
} tdm_mpi_impl;

/* Options with the environment's defaults filled in. */
tdm_mpi_opts tdm_mpi_opts_resolve(const tdm_mpi_opts *opts);
/* Host cores this process may run on. */
int tdm_mpi_cores(void);
/* Cores the ranks of comm (one machine's) can run on together: the union
 * of their CPU affinity masks, counted. Not one rank's own count: under
 * `mpirun --bind-to core` each rank sees one core, yet the ranks have one
 * each and should spin. Collective over comm, bounded by ms. */
int tdm_mpi_union_cores(MPI_Comm comm, int64_t ms);
/* This process's CPU affinity as bits (every online core when it cannot
 * be read), and a mask's count (at least 1). */
#define TDM_MPI_MASK_WORDS (CPU_SETSIZE / 64)
void tdm_mpi_affinity_mask(uint64_t *mask);
int tdm_mpi_mask_cores(const uint64_t *mask);

/* Wraps comm (owned from now on) in a tandem communicator. local_size is
 * the number of ranks of this job on this machine and cores the cores
 * they can use together (spin policy; 0: this process's affinity). */
tdm_status tdm_mpi_comm_wrap(tdm_comm **out, MPI_Comm comm, int local_size, int cores,
                             const tdm_mpi_opts *opts, const char *what);
/* Ranks of comm on this machine (MPI_COMM_TYPE_SHARED) and the cores they
 * can use together (tdm_mpi_union_cores), the split bounded by join_ms. */
tdm_status tdm_mpi_local_size(MPI_Comm comm, int64_t join_ms, int *local_size, int *cores);
/* The MPI communicator of a tandem communicator made here; MPI_COMM_NULL
 * when comm is not one. */
MPI_Comm tdm_mpi_comm_handle(const tdm_comm *comm);

/* Waits until every request has completed (MPI_Testall), spinning then
 * sleeping as w says. On an MPI error, w's abort_check or the deadline,
 * aborts the job naming `what`; never returns an error. */
void tdm_mpi_wait_all(const tdm_mpi_waiter *w, int n, MPI_Request *reqs, MPI_Status *stats,
                      const char *what);

/* Writes "tandem: rank R of N (host, pid P): MPI job aborted: <reason>"
 * to stderr, once per process, and ends the job: MPI_Abort when MPI is
 * initialised, _exit(1) otherwise. Any thread. */
_Noreturn void tdm_mpi_abort_job(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A watchdog for MPI's blocking calls (init, communicator splits,
 * finalize): if tdm_mpi_guard_end has not been called within ms, aborts
 * the job naming what. */
typedef struct tdm_mpi_guard {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, started;
    int64_t ms;
    char what[160];
} tdm_mpi_guard;
void tdm_mpi_guard_begin(tdm_mpi_guard *g, int64_t ms, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void tdm_mpi_guard_end(tdm_mpi_guard *g);

/* The job's liveness (mpi/live.c): a heartbeat thread per rank beats to
 * every other rank every TANDEM_MPI_STALL_MS/6 over a communicator of its
 * own and publishes, once, the first peer silent for TANDEM_MPI_STALL_MS
 * (3000 by default; 0: off), or gone from this machine without leaving
 * the job: "rank 1 (pid 4121) is stopped (...): no heartbeat for 3.0 s".
 * Every wait polls tdm_mpi_live_reason (NULL: all well) and ends the job
 * with it. start: collective over MPI_COMM_WORLD (*out NULL when off or
 * alone), with rank 0's TANDEM_MPI_STALL_MS for every rank (a rank whose
 * own differs says so); stop: says goodbye to every peer, then releases. */
typedef struct tdm_mpi_live tdm_mpi_live;
tdm_status tdm_mpi_live_start(tdm_mpi_live **out, int64_t join_ms);
void tdm_mpi_live_stop(tdm_mpi_live *l);
const char *tdm_mpi_live_reason(void);
/* Before this rank ends the job (tdm_mpi_abort_job): asks every other
 * rank's heartbeat thread to dump its flight records now, and waits (2 s
 * at most) until each that is not silent says it has: mpirun's SIGTERM
 * to them, a second before its SIGKILL, may find a loaded machine too
 * slow to dump. No-op without the job's heartbeats. */
void tdm_mpi_live_dump_everywhere(void);
/* tdm_comm_ops.split of the MPI communicator (MPI_Comm_split) and of the
 * hierarchical one (refused, saying why): mpi/split.c. */
tdm_status tdm_mpi_split(void *impl, const tdm_comm_split_info *in, tdm_comm **out);
tdm_status tdm_mpi_hier_split(void *impl, const tdm_comm_split_info *in, tdm_comm **out);

/* "MPI_ERR_TRUNCATE: message truncated" for an MPI error code. */
void tdm_mpi_error_string(int rc, char *out, size_t n);

#endif
