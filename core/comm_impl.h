/* core/comm_impl.h: the backend side of the communicator interface
 * (core/comm.h), as ggml's ggml-backend-impl.h is to ggml-backend.h. A
 * new communicator (shm/ between processes of one machine, cuda/'s NCCL,
 * an MPI one between machines) is:
 *
 *   1. a struct of its own state (`impl`), made by its constructor
 *      (tdm_comm_init_<name>(tdm_comm **out, ...), declared in its own
 *      public header);
 *   2. a static tdm_comm_ops filled with designated initializers
 *      (`.run = ...`): run, abort and destroy are required, the rest
 *      optional (NULL);
 *   3. tdm_comm_create(out, &ops, impl, rank, size) at the end of the
 *      constructor, which from then on owns impl.
 *
 * core/comm.c does the rest for every backend: argument checks (a `run`
 * only ever sees a valid call: buffers, counts, root, dtype and op
 * checked, half types refused unless `half_types`), the progress thread
 * that runs asynchronous calls in issue order, work handles, waits with
 * timeouts, and the names of dtypes, ops and collectives.
 *
 * Included only by backends (core/comm.c, shm/, cuda/nccl_comm.c) and by
 * tests that build a fake one. */
#ifndef TDM_CORE_COMM_IMPL_H
#define TDM_CORE_COMM_IMPL_H

#include "core/comm.h"

/* What core/comm_split.c hands a backend's split: the groups are decided
 * (every rank's color and key all-gathered over the parent); the backend
 * makes this rank's new communicator. */
typedef struct tdm_comm_split_info {
    tdm_comm *parent;           /* for the collectives the backend needs to set up */
    int color, key;             /* this rank's (color may be TDM_COMM_SPLIT_UNDEFINED) */
    int rank, size;             /* in the new communicator; size 0 when undefined */
    const int *members;         /* size ranks of the parent, in new-rank order */
    const int *job_ranks;       /* and their job ranks */
    const tdm_comm_split_opts *opts;   /* never NULL */
    int seq;                    /* splits of the parent so far (the same on every rank) */
} tdm_comm_split_info;

/* What a backend implements. `run` executes one validated call
 * synchronously on the calling thread, with the semantics at the top of
 * core/comm.h (counts, in-place forms, rank-order reductions); the
 * dispatcher guarantees that at most one thread calls `run` on a
 * communicator at a time. A `run` never blocks without end: a peer that
 * died or stalled, an abort raised by any rank, or the backend's deadline
 * ends it with a status and a message that names the rank at fault (see
 * shm/wait.c and cuda/nccl_watch.c's watchdog). */
typedef struct tdm_comm_ops {
    const char *name;                                   /* "shm", "nccl" */
    tdm_status (*run)(void *impl, const tdm_comm_call *call);
    /* Raise the group abort flag: this rank's pending and later calls,
     * and every other rank's, fail. Must be safe from any thread, while
     * `run` is blocked in a wait. */
    tdm_status (*abort)(void *impl, const char *reason);
    /* Optional: name of the algorithm the last call used ("one-shot",
     * "rs-ag", "rs-ag-zero-copy", "ring", ...). NULL: "default". */
    const char *(*last_algo)(void *impl);
    /* Optional: memory the backend can reduce in without copying (shm:
     * symmetric buffers inside the segment; NCCL: device memory). NULL:
     * TDM_STATUS_UNSUPPORTED. */
    tdm_status (*alloc)(void *impl, size_t nbytes, void **ptr);
    /* Releases impl. Called once, after the progress thread has drained. */
    void (*destroy)(void *impl);
    /* Optional: called on the issuing thread when a call is queued for the
     * progress thread, before the issuer goes on, so the backend can note
     * where the issuer is now (NCCL: an event on the compute stream, so
     * that the collective waits for the work issued before it and not for
     * what the issuer enqueues after). May set call->token; every queued
     * call then reaches `run`, which must release it. An error fails the
     * submission. */
    tdm_status (*prepare)(void *impl, tdm_comm_call *call);
    /* 1 when `run` handles TDM_DTYPE_BFLOAT16 and TDM_DTYPE_FLOAT16; left 0,
     * the dispatcher refuses them (TDM_STATUS_UNSUPPORTED) before `run`. */
    int half_types;
    /* Optional: the backend's part of tdm_comm_split, collective over
     * info->parent (every rank calls it, undefined colors included): sets
     * *out to this rank's new communicator (NULL when its color is
     * undefined). Every rank must return the same status: a rank that
     * fails tells the others through the parent before returning. NULL:
     * tdm_comm_split fails with TDM_STATUS_UNSUPPORTED. */
    tdm_status (*split)(void *impl, const tdm_comm_split_info *info, tdm_comm **out);
    /* Optional, and required of a backend whose `run` takes device memory
     * only (NCCL): copies nbytes between host memory and memory of its
     * `alloc` (to_device 1: host src to dst; 0: src to host dst),
     * complete when it returns. core/'s own exchanges of host values
     * (tdm_comm_split's colors and keys) stage through it. NULL: `run`
     * takes host memory. */
    tdm_status (*host_copy)(void *impl, void *dst, const void *src, size_t nbytes,
                            int to_device);
} tdm_comm_ops;

/* Wraps impl (owned from now on: destroyed by tdm_comm_free, or here on
 * failure) into a communicator of `size` ranks, this one `rank`. */
tdm_status tdm_comm_create(tdm_comm **out, const tdm_comm_ops *ops,
                           void *impl, int rank, int size);
/* The impl a backend gave tdm_comm_create, for its own functions that take
 * a tdm_comm (check the backend's name first: tdm_comm_backend_name). */
void *tdm_comm_impl(const tdm_comm *comm);

/* For backends built of other communicators (MPI's hier) and an MPI
 * job's control communicator: marks comm as a part, whose flight-recorder
 * dump is not the rank's fr_rank_<R>.json, so that the communicator made
 * next (the composite, the training one) gets that name; its dump is
 * named and numbered with job_rank, the rank in the job (core/flight.h). */
void tdm_comm_fr_set_inner(tdm_comm *comm, int job_rank);
/* comm's record becomes the rank's fr_rank_<R>.json, taken from whichever
 * communicator had it: a communicator bootstrapped over another (NCCL's
 * over the shm group) carries the training's collectives. */
void tdm_comm_fr_set_primary(tdm_comm *comm);
/* For core/comm_split.c: comm, made by split number seq of parent with
 * color, records in its dumps an id its members share and its ranks' job
 * ranks (comm's, set before: tdm_comm_set_job_ranks): core/flight.h's
 * tdm_fr_set_group. */
void tdm_comm_fr_set_group(tdm_comm *comm, const tdm_comm *parent, int seq, int color);
/* The job comm belongs to, written in its flight-recorder dumps for
 * `tandem doctor` (core/flight.h), unless TANDEM_JOB_ID gave one: a
 * backend's own id of the group (the shm segment's). */
void tdm_comm_fr_set_job(tdm_comm *comm, uint64_t job);

/* For core/comm_split.c: records the job rank of each of comm's ranks
 * (copied); the splits of comm made so far (then counts this one); the
 * backend's split (UNSUPPORTED when it has none). */
tdm_status tdm_comm_set_job_ranks(tdm_comm *comm, const int *job_ranks);
int tdm_comm_next_split(tdm_comm *comm);
tdm_status tdm_comm_backend_split(tdm_comm *comm, const tdm_comm_split_info *info,
                                  tdm_comm **out);
/* An all-gather of n int32 per rank in host memory (mine -> all, n * size
 * values) on any backend: through the backend's host_copy and alloc'd
 * memory where it has one (the staging block stays the backend's until
 * the communicator is freed), else as tdm_comm_all_gather. */
tdm_status tdm_comm_all_gather_host(tdm_comm *comm, const int32_t *mine, int32_t *all, size_t n);

#endif
