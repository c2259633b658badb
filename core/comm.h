/* core/comm.h: the communicator interface. A communicator joins `size`
 * ranks (processes, one per device) and runs collectives between them:
 * broadcast, reduce, all_reduce, reduce_scatter, all_gather, gather,
 * scatter, barrier and point-to-point send/recv, with SUM/PROD/MIN/MAX/AVG
 * over float32/float64/int32/int64, synchronously or asynchronously.
 *
 * Semantics follow NCCL / torch.distributed (c10d):
 * - every rank issues the same sequence of collectives with the same
 *   dtype, count, op and root; calls from one rank complete in the order
 *   they were issued (synchronous and asynchronous ones alike);
 * - counts are elements: reduce_scatter's count is the per-rank output
 *   (sendbuf holds size*count), all_gather's and gather's count is the
 *   per-rank input (recvbuf holds size*count), scatter's count is the
 *   per-rank output (root's sendbuf holds size*count);
 * - in place: sendbuf == recvbuf (all_reduce, reduce, broadcast);
 *   sendbuf == recvbuf + rank*count for all_gather and gather;
 *   recvbuf == sendbuf + rank*count for reduce_scatter and scatter;
 * - reductions combine ranks in rank order 0, 1, ..., size-1, so every
 *   rank gets bitwise the same result. AVG is SUM divided by size (integer
 *   division, truncating, for integer types).
 *
 * - one thread of a rank issues its calls (like a CUDA stream or an NCCL
 *   communicator); tdm_comm_abort and the work functions may be called
 *   from any thread.
 *
 * This file is the interface as callers see it (ddp/, tools/, tests/): a
 * communicator is opaque and made by a backend's constructor
 * (tdm_comm_init_shm in shm/shm_comm.h, tdm_comm_init_nccl in
 * cuda/cuda.h). The backend side, the table a backend fills and
 * tdm_comm_create, is core/comm_impl.h. Asynchronous calls run on one
 * progress thread per communicator, created on the first asynchronous
 * call, in issue order. */
#ifndef TDM_CORE_COMM_H
#define TDM_CORE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reduction operators. (Named TDM_REDOP_* so as not to collide with the
 * device interface's gemm transpose flags.) */
typedef enum tdm_redop {
    TDM_REDOP_SUM = 0,
    TDM_REDOP_PROD,
    TDM_REDOP_MIN,
    TDM_REDOP_MAX,
    TDM_REDOP_AVG,
    TDM_REDOP_COUNT_
} tdm_redop;

typedef enum tdm_coll {
    TDM_COLL_BROADCAST = 0,
    TDM_COLL_REDUCE,
    TDM_COLL_ALL_REDUCE,
    TDM_COLL_REDUCE_SCATTER,
    TDM_COLL_ALL_GATHER,
    TDM_COLL_GATHER,
    TDM_COLL_SCATTER,
    TDM_COLL_BARRIER,
    TDM_COLL_SEND,
    TDM_COLL_RECV,
    TDM_COLL_COUNT_
} tdm_coll;

/* "sum", "prod", "min", "max", "avg"; "?" when invalid. */
const char *tdm_redop_name(tdm_redop op);
/* "all_reduce", "broadcast", ...; "?" when invalid. */
const char *tdm_coll_name(tdm_coll c);
/* Parse the names above (tdm_dtype_parse: core/dtype.h).
 * Return TDM_STATUS_INVALID_ARG with a message listing the valid names. */
tdm_status tdm_redop_parse(const char *s, tdm_redop *out);
tdm_status tdm_coll_parse(const char *s, tdm_coll *out);

typedef struct tdm_comm tdm_comm;
typedef struct tdm_comm_work tdm_comm_work;

/* One call, as the dispatcher hands it to a backend. `root` is the root of
 * rooted collectives and the peer of send/recv (-1 otherwise). `count`
 * follows the conventions at the top of this file. */
typedef struct tdm_comm_call {
    tdm_coll coll;
    const void *sendbuf;
    void *recvbuf;
    size_t count;
    tdm_dtype dtype;
    tdm_redop op;
    int root;
    /* Set by the dispatcher: 1 when the call was issued asynchronously and
     * runs on the progress thread while the issuing thread goes on
     * computing (backends may then prefer sleeping to spinning); 0 for a
     * synchronous call, also when it runs on the progress thread behind
     * queued ones (its issuer waits). So it depends only on how the call
     * was issued, which every rank does alike, not on what this rank
     * happened to have queued (mpi/ relies on that). Ignored on input. */
    int async;
    /* Set by the backend's `prepare` for a queued call (NULL otherwise):
     * what it captured on the issuing thread; `run` consumes and releases
     * it. Ignored on input. */
    void *token;
} tdm_comm_call;

/* Waits for pending asynchronous calls (each bounded by the backend's
 * timeout), stops the progress thread and releases the backend.
 * NULL is a no-op. */
void tdm_comm_free(tdm_comm *comm);

int tdm_comm_rank(const tdm_comm *comm);
int tdm_comm_size(const tdm_comm *comm);
const char *tdm_comm_backend_name(const tdm_comm *comm);
/* Algorithm of the last completed call (bench output, debug). */
const char *tdm_comm_last_algo(const tdm_comm *comm);

/* What this rank has handed the communicator since it was made, counted
 * by the dispatcher for every backend: per kind of call, the calls that
 * completed and their payload bytes - the whole buffer a call reduces,
 * gathers or moves (all_reduce and broadcast: count elements;
 * reduce_scatter, all_gather, gather, scatter: size * count; send and
 * recv: count; barrier: 0). What a design's step moves, to compare with
 * its theoretical volume. */
typedef struct tdm_comm_traffic {
    int64_t calls[TDM_COLL_COUNT_];
    int64_t bytes[TDM_COLL_COUNT_];
} tdm_comm_traffic;
void tdm_comm_traffic_get(const tdm_comm *comm, tdm_comm_traffic *out);
/* The bytes one rank of `size` sends for t's collectives under the
 * bandwidth-optimal ring algorithms (NCCL's busbw convention): an
 * all-reduce of S bytes 2(size-1)/size * S, a reduce-scatter or
 * all-gather of S bytes (size-1)/size * S, plus what it sent
 * point-to-point. 0 for one rank. */
int64_t tdm_comm_traffic_ring_sent(const tdm_comm_traffic *t, int size);

/* --- synchronous collectives ------------------------------------------ */
tdm_status tdm_comm_broadcast(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                              size_t count, tdm_dtype dtype, int root);
tdm_status tdm_comm_reduce(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                           size_t count, tdm_dtype dtype, tdm_redop op, int root);
tdm_status tdm_comm_all_reduce(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                               size_t count, tdm_dtype dtype, tdm_redop op);
tdm_status tdm_comm_reduce_scatter(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                   size_t recv_count, tdm_dtype dtype, tdm_redop op);
tdm_status tdm_comm_all_gather(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                               size_t send_count, tdm_dtype dtype);
tdm_status tdm_comm_gather(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                           size_t send_count, tdm_dtype dtype, int root);
tdm_status tdm_comm_scatter(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                            size_t recv_count, tdm_dtype dtype, int root);
tdm_status tdm_comm_barrier(tdm_comm *comm);
/* Point to point: only the two ranks involved take part, and a send must
 * be matched by a recv of the same count and dtype on the peer. */
tdm_status tdm_comm_send(tdm_comm *comm, const void *buf, size_t count,
                         tdm_dtype dtype, int peer);
tdm_status tdm_comm_recv(tdm_comm *comm, void *buf, size_t count,
                         tdm_dtype dtype, int peer);

/* Any call, validated then run (synchronously). */
tdm_status tdm_comm_run(tdm_comm *comm, const tdm_comm_call *call);
/* For backends built from other communicators (mpi/'s hierarchical one):
 * validates and runs call on comm on the calling thread, telling the
 * backend whether it runs for a queued call of the outer communicator
 * (async = 1: wait politely, the rank's own thread is computing). comm
 * must have nothing queued (it belongs to the outer backend alone). */
tdm_status tdm_comm_run_inner(tdm_comm *comm, const tdm_comm_call *call, int async);
/* Argument checks shared by every entry point (INVALID_ARG + message). */
tdm_status tdm_comm_call_check(const tdm_comm *comm, const tdm_comm_call *call);

/* Raise the group abort flag with a reason (any thread). */
tdm_status tdm_comm_abort(tdm_comm *comm, const char *reason);

/* --- sub-communicators (core/comm_split.c) -------------------------------
 * MPI_Comm_split's semantics. Collective over comm: every rank calls it,
 * in the same place of its sequence of calls. Ranks that pass the same
 * color (>= 0) form one new communicator, ranked by key, ties broken by
 * their rank in comm; a rank that passes TDM_COMM_SPLIT_UNDEFINED takes
 * part and gets *out = NULL. The new communicator has its own sequence of
 * calls, progress thread and flight recorder (dumped as
 * fr_rank_<R>.c<K>.pid<P>.json); its failures name ranks with their job
 * rank (their rank in the communicator that was never split: "rank 1
 * (job rank 3, pid 4121)"), and a failure on it stops the whole job, as
 * one on comm does. Backends: shm (a new segment per group, set up through
 * comm), MPI (MPI_Comm_split), NCCL (ncclCommSplit); any other fails with
 * TDM_STATUS_UNSUPPORTED on every rank. Free a split communicator before
 * the one it was split from. */
#define TDM_COMM_SPLIT_UNDEFINED (-1)

/* Zero-initialised options are the defaults. */
typedef struct tdm_comm_split_opts {
    /* Bytes of zero-copy memory (tdm_comm_alloc) per rank; 0: as comm's
     * (none with p2p). */
    size_t arena_bytes;
    /* 1: the new communicator carries mostly send/recv (a pipeline's
     * links): the backend may give it less staging memory for collectives
     * (shm: 4 KiB slots instead of comm's, no arena unless arena_bytes
     * asks); every call still works. */
    int p2p;
} tdm_comm_split_opts;

tdm_status tdm_comm_split(tdm_comm *comm, int color, int key, tdm_comm **out);
/* The same with options (NULL: the defaults). */
tdm_status tdm_comm_split_ex(tdm_comm *comm, int color, int key,
                             const tdm_comm_split_opts *opts, tdm_comm **out);
/* The job rank of comm's rank `rank`: the same number for a communicator
 * that was not split; -1 when rank is out of range. */
int tdm_comm_job_rank(const tdm_comm *comm, int rank);
/* "rank 3" on a communicator that was not split, "rank 1 (job rank 3)" on
 * one that was: how messages name comm's rank `rank`. Returns buf. */
const char *tdm_comm_rank_str(const tdm_comm *comm, int rank, char *buf, size_t n);

/* --- flight recorder (core/flight.h, docs/DEBUGGING.md) ------------------
 * Label of the next call issued on this communicator (printf format; kept
 * to 47 bytes), as it will appear in the dump and in `tandem doctor`:
 * "ddp bucket 3". Applies to one call: later calls are unlabelled until
 * labelled again. No-op when the recorder is off (TANDEM_FR_SIZE=0). */
void tdm_comm_set_label(tdm_comm *comm, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Training steps completed so far (recorded with every later call and as
 * the dump's last_step). */
void tdm_comm_set_step(tdm_comm *comm, int64_t step);
/* Writes this rank's dump to TANDEM_FR_DUMP now; 0 when written, -1 when
 * off, without a directory, or when the write failed. */
int tdm_comm_fr_dump(tdm_comm *comm, const char *reason);

/* Backend memory for zero-copy collectives (see tdm_comm_ops.alloc). */
tdm_status tdm_comm_alloc(tdm_comm *comm, size_t nbytes, void **ptr);

/* --- asynchronous collectives ------------------------------------------
 * Each returns at once with a handle; the call runs on the progress
 * thread after every earlier call of this rank. Buffers must stay valid
 * and untouched until the work has completed. Argument errors are
 * returned at once and no handle is made. */
tdm_status tdm_comm_submit(tdm_comm *comm, const tdm_comm_call *call,
                           tdm_comm_work **out);
tdm_status tdm_comm_all_reduce_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                     size_t count, tdm_dtype dtype, tdm_redop op,
                                     tdm_comm_work **out);
tdm_status tdm_comm_broadcast_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                    size_t count, tdm_dtype dtype, int root,
                                    tdm_comm_work **out);
tdm_status tdm_comm_reduce_scatter_async(tdm_comm *comm, const void *sendbuf,
                                         void *recvbuf, size_t recv_count,
                                         tdm_dtype dtype, tdm_redop op,
                                         tdm_comm_work **out);
tdm_status tdm_comm_all_gather_async(tdm_comm *comm, const void *sendbuf, void *recvbuf,
                                     size_t send_count, tdm_dtype dtype,
                                     tdm_comm_work **out);
tdm_status tdm_comm_barrier_async(tdm_comm *comm, tdm_comm_work **out);
/* Point to point, asynchronous: the call goes on the communicator's queue
 * like any asynchronous call (after every earlier call of this rank, so
 * messages between two ranks are matched in the order they were issued)
 * and progresses while the issuing thread computes. The progress thread
 * runs one call at a time: a send that waits for its receiver holds up
 * what was queued behind it. Code that must send and receive at once (a
 * pipeline stage, which sends activations downstream while it receives
 * gradients from there) gives each direction its own communicator
 * (tdm_comm_split with one color, once per direction). buf must stay
 * valid and untouched (send: unmodified; recv: unread) until the work
 * has completed. */
tdm_status tdm_comm_isend(tdm_comm *comm, const void *buf, size_t count, tdm_dtype dtype,
                          int peer, tdm_comm_work **out);
tdm_status tdm_comm_irecv(tdm_comm *comm, void *buf, size_t count, tdm_dtype dtype, int peer,
                          tdm_comm_work **out);

/* Waits up to timeout_ms (< 0: without limit) for the work. Returns the
 * call's own status (and its message) once it has completed, or
 * TDM_STATUS_TIMEOUT if it is still running (the work stays valid and may
 * be waited on again). */
tdm_status tdm_comm_work_wait(tdm_comm_work *work, int64_t timeout_ms);
/* *done = 1 when the work has completed (its status is then what
 * tdm_comm_work_wait returns). Never blocks. */
tdm_status tdm_comm_work_test(tdm_comm_work *work, int *done);
/* Releases the handle; a work still running completes in the background.
 * NULL is a no-op. */
void tdm_comm_work_free(tdm_comm_work *work);

#ifdef __cplusplus
}
#endif

#endif
