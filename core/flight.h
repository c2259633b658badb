/* core/flight.h: the flight recorder of a communicator. Every
 * communicator (shm, NCCL, MPI: whatever goes through core/comm.c) keeps a
 * ring of its last N collectives: sequence number, collective, dtype, op,
 * count, root, the caller's label ("ddp bucket 3"), the training step,
 * enqueue/start/end times and state (queued, running, done, failed). On a
 * failure, a timeout, an abort, SIGUSR1 or at the end of the run it is
 * written as JSON, one file per rank, for `tandem doctor DIR` to read
 * (docs/DEBUGGING.md).
 *
 * Environment (read once, when a communicator is created):
 *   TANDEM_FR_SIZE=N       entries kept (default 2000; 0 turns it off)
 *   TANDEM_FR_DUMP=DIR     where dumps go: DIR/fr_rank_<R>.json (the first
 *                          communicator of the process; later ones
 *                          fr_rank_<R>.c<K>.pid<P>.json, and those a backend
 *                          marks inner, below). Without it nothing is
 *                          written (tandem launch and tandem train set it).
 *   TANDEM_JOB_ID=ID       the job the dumps belong to, written in each
 *                          (16 hex digits; `tandem doctor` reads one job's
 *                          dumps): set by tandem launch and tandem train
 *                          for their ranks, agreed by an MPI job's ranks;
 *                          without it, the backend's (the shm segment's).
 *   TANDEM_FR_DUMP_ON=failure   write only on failure, timeout, abort and
 *                          SIGUSR1, not at the end of a good run (what the
 *                          launchers set); default: also at the end.
 *
 * The writer is async-signal-safe: it takes no lock, calls no malloc or
 * stdio, only open/write/rename/close on a path formatted when the
 * communicator was created, with numbers formatted by hand into a stack
 * buffer. A thread stuck inside a collective (holding whatever locks) can
 * therefore not stop a dump, and SIGUSR1 can dump a hung process. Fields
 * are relaxed atomics: an entry being written while it is dumped may be
 * dumped half-updated (its state tells which), never torn within a field.
 *
 * This is not a tracer of compute (timer.h's phases and traces are) and
 * keeps nothing but the ring: the cost per collective is a few stores and
 * two clock reads. */
#ifndef TDM_CORE_FLIGHT_H
#define TDM_CORE_FLIGHT_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_FR_DEFAULT_SIZE 2000
#define TDM_FR_MAX_SIZE (1 << 22)
#define TDM_FR_LABEL_MAX 48      /* bytes kept of a label, NUL included */
#define TDM_FR_REASON_MAX 512
#define TDM_FR_ENV_JOB "TANDEM_JOB_ID"

typedef enum tdm_fr_state {
    TDM_FR_EMPTY = 0,
    TDM_FR_QUEUED,     /* submitted, waiting for the progress thread */
    TDM_FR_RUNNING,
    TDM_FR_DONE,
    TDM_FR_FAILED,
} tdm_fr_state;

typedef struct tdm_fr tdm_fr;

/* A recorder for `rank` of `world` on `backend` (a static string), sized
 * by TANDEM_FR_SIZE. *out is NULL (and OK returned) when the recorder is
 * turned off. A bad TANDEM_FR_SIZE is INVALID_ARG with a message. */
tdm_status tdm_fr_init(tdm_fr **out, int rank, int world, const char *backend);
/* Writes the end-of-run dump when asked to (TANDEM_FR_DUMP_ON), then
 * releases. NULL is a no-op. */
void tdm_fr_free(tdm_fr *fr);

/* The issuing thread: a new entry for call k in state QUEUED or RUNNING,
 * with the pending label (then cleared) and step. Returns its seq. */
uint64_t tdm_fr_begin(tdm_fr *fr, const tdm_comm_call *k, tdm_fr_state state);
void tdm_fr_start(tdm_fr *fr, uint64_t seq);                 /* QUEUED -> RUNNING */
/* DONE, or FAILED with the status; the first failure is kept as the
 * dump's reason and dumped. */
void tdm_fr_end(tdm_fr *fr, uint64_t seq, tdm_status st);

/* The label of the next call (truncated to TDM_FR_LABEL_MAX - 1 bytes). */
void tdm_fr_set_label(tdm_fr *fr, const char *label);
/* Steps completed so far: stored in every later entry and the dump. */
void tdm_fr_set_step(tdm_fr *fr, int64_t step);
/* Records a failure that is not a call's (a timed-out wait, an abort),
 * keeping the first as the reason, and dumps. */
void tdm_fr_note_failure(tdm_fr *fr, tdm_status st, const char *why);

/* A job id from TANDEM_JOB_ID's text: 1..16 hex digits as they are,
 * anything else hashed; 0 for none. */
uint64_t tdm_fr_job_parse(const char *s);
/* The job of fr's dumps, unless it has one already (TANDEM_JOB_ID's
 * wins): what a backend knows (the shm segment's id). */
void tdm_fr_set_job(tdm_fr *fr, uint64_t job);

/* A communicator that is a part of another (hier's shm and MPI
 * sub-communicators), or serves the job and not its training (an MPI
 * job's control communicator): it gives up the fr_rank_<R>.json name, so
 * that the communicator made next (the composite, the training one) gets
 * it, and is named and dumped with job_rank, the rank in the job (its own
 * rank in the part is kept as "comm_rank"). */
void tdm_fr_set_inner(tdm_fr *fr, int job_rank);
/* fr takes the fr_rank_<R>.json name from whichever recorder has it (a
 * communicator built over a bootstrap one, as NCCL's over the shm group,
 * carries the training's collectives: its record is the rank's). */
void tdm_fr_set_primary(tdm_fr *fr);
/* A communicator split from another (core/comm_split.c): id, the same on
 * every member and different from every other communicator of the job,
 * and members, the job rank of each of its n ranks (copied), are written
 * in its dumps ("comm", "members") for `tandem doctor` to tell which
 * dumps are of one communicator and who belongs to it, also the members
 * that left no dump; its dumps are named and numbered with its job rank
 * (members[rank]), as tdm_fr_set_inner's. Not for a signal handler
 * (allocates). */
void tdm_fr_set_group(tdm_fr *fr, uint64_t id, const int *members, int n);
/* The id tdm_fr_set_group gave fr; 0: none (a job's first communicator)
 * or NULL. */
uint64_t tdm_fr_group(const tdm_fr *fr);
/* Every live recorder of the process: its calls in flight marked failed
 * with st, and the first failure noted (why: the dump's reason) and
 * dumped. For a process about to end all at once (an MPI job's abort).
 * Not async-signal-safe (formats the reason). */
void tdm_fr_fail_all(tdm_status st, const char *why);
/* On signal sig (SIGTERM: how mpirun ends a job's other ranks after a
 * failure), every recorder dumps (trigger "SIGTERM"), then the signal
 * takes its default action. Installed only when the application has no
 * handler of its own; once per signal. */
void tdm_fr_dump_on_signal(int sig);

/* Writes the dump now (async-signal-safe). Returns 0 when written, -1
 * when there is no dump directory or a write failed. */
int tdm_fr_dump(tdm_fr *fr, const char *reason);
/* Dumps every live recorder of this process (async-signal-safe; what the
 * SIGUSR1 handler calls). Returns how many were written. */
int tdm_fr_dump_all(const char *reason);
/* "queued", "running", "done", "failed"; "empty". */
const char *tdm_fr_state_name(tdm_fr_state s);

#ifdef __cplusplus
}
#endif

#endif
