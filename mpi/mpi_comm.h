/* mpi/mpi_comm.h: the MPI communicator behind core/comm.h, for ranks
 * started by an MPI launcher (Open MPI's mpirun, or srun with PMIx) on one
 * or several machines. Plain C types only: no MPI header is needed to
 * include this one (only the .c files of mpi/ include mpi.h, as only
 * cuda/ includes CUDA headers).
 *
 * Every collective of core/comm.h maps onto MPI's. A call issued
 * asynchronously (DDP's bucket all-reduces) is an MPI non-blocking
 * collective (MPI_Iallreduce, MPI_Ibcast, ...; MPI_Isend/MPI_Irecv) posted
 * and driven to completion by MPI_Test from the communicator's progress
 * thread (core/comm.c), so it progresses while backward computes. A call
 * issued synchronously uses MPI's blocking collective (Open MPI's tuned
 * algorithms, measured at 0.3-0.8 of the time of its non-blocking ones from
 * 8 B to 16 MiB), bounded by a watchdog thread. The choice depends only on
 * how the call was issued, which every rank does alike (MPI never matches
 * a blocking collective with a non-blocking one); TANDEM_MPI_NB=all|none
 * forces one kind (measurements).
 *
 * Thread level: MPI_THREAD_MULTIPLE. MPI is called from the issuing
 * thread, from each communicator's progress thread (several
 * communicators, e.g. the hierarchical one's parts, may progress at
 * once) and, for an abort, from any thread. tdm_mpi_init requests it and
 * fails, naming the level it got, when the MPI library does not provide
 * it (Open MPI provides it since 3.0 unless built without threads).
 *
 * Failures: MPI offers no way to cancel a collective that a peer never
 * joins, and the buffers of a pending one still belong to MPI. So every
 * wait has a deadline, and on a deadline, an MPI error, or
 * tdm_comm_abort the rank writes the reason to stderr
 * ("tandem: rank 2 of 4: MPI job aborted: ...") and calls MPI_Abort,
 * which ends every process of the job (mpirun then exits non-zero).
 * That is the one place where the library ends the process: the job
 * cannot continue, and it is the only way to stop ranks on other
 * machines.
 *
 * Only present in builds that found MPI's development files (GNUmakefile
 * includes mpi/mpi.mk); tools/ reaches these functions through weak
 * symbols and says how to get MPI when they are missing. */
#ifndef TDM_MPI_MPI_COMM_H
#define TDM_MPI_MPI_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_mpi_opts {
    /* Deadline of every wait in ms; past it the job is aborted (MPI_Abort)
     * with a message naming the call. 0: $TANDEM_MPI_TIMEOUT_MS, or 300000
     * (5 minutes). */
    int64_t timeout_ms;
    /* Deadline of the joining handshake in tdm_comm_init_mpi (and of the
     * other set-up steps) in ms; rank 0 names every rank that has not
     * arrived when it passes. 0: $TANDEM_MPI_JOIN_TIMEOUT_MS, or 60000. */
    int64_t join_timeout_ms;
    /* 1: never spin on MPI_Test, always back off to short sleeps (ranks
     * outnumbering cores do this anyway). */
    int no_spin;
    /* Optional, polled while a call waits (keep it cheap): a non-NULL
     * return stops the wait and aborts the job with that reason. The
     * hierarchical communicator passes the shm group's abort reason, so
     * that a local rank's death stops a rank blocked on the network. */
    const char *(*abort_check)(void *ctx);
    void *abort_ctx;
} tdm_mpi_opts;

/* Initialises MPI (MPI_Init_thread, MPI_THREAD_MULTIPLE) unless the
 * program already did, and checks the thread level in either case. A
 * process that has not been started by an MPI launcher runs as a job of
 * one rank (MPI's singleton init). Safe to call more than once. */
tdm_status tdm_mpi_init(void);
/* MPI_Finalize, if tdm_mpi_init initialised MPI and it is not finalised
 * yet; every tandem communicator over MPI must have been freed. */
void tdm_mpi_finalize(void);
/* Ends the whole job: writes "tandem: rank R of N (host, pid P): MPI job
 * aborted: <reason>" to stderr and calls MPI_Abort (or _exit(1) before
 * MPI is up). For tools whose rank fails outside any communicator (in
 * set-up): the other ranks may be waiting for it. Never returns. */
void tdm_mpi_abort(const char *reason) __attribute__((noreturn)); /* not _Noreturn: C++ reads this too */
/* "Open MPI v4.1.4, ..." (MPI_Get_library_version; callable before
 * init), truncated to len. */
void tdm_mpi_library_version(char *buf, size_t len);

/* A communicator over every rank of the MPI job (a duplicate of
 * MPI_COMM_WORLD, so tandem's traffic never mixes with the program's).
 * Collective: every rank calls it. Joining is bounded: each rank reports
 * to rank 0, which names the ranks that have not arrived within
 * join_timeout_ms and aborts the job. Calls tdm_mpi_init. opts may be
 * NULL. Rank and size are MPI_COMM_WORLD's. */
tdm_status tdm_comm_init_mpi(tdm_comm **out, const tdm_mpi_opts *opts);

/* --- Open MPI's own collectives, for the benchmark's peer column -------- */

/* Runs the call (validated as tdm_comm_run would) with MPI's blocking
 * collective (MPI_Allreduce, MPI_Bcast, ...) on the MPI communicator of
 * comm, which must be an MPI one: what a program calling MPI directly
 * gets, measured by the same tool. AVG is MPI_SUM then a division, the
 * 16-bit types are refused (MPI has no reduction for them). No
 * deadline: for benchmarks only. */
tdm_status tdm_mpi_peer_run(tdm_comm *comm, const tdm_comm_call *call);

#ifdef __cplusplus
}
#endif

#endif
