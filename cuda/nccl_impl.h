/* cuda/nccl_impl.h: what the two NCCL users in cuda/ share: the rank
 * communicator (cuda/nccl_comm.c) and the group over one process's GPUs
 * (cuda/nccl_group.c) both enqueue on non-blocking NCCL communicators and
 * then watch them with cuda/nccl_watch.c's tdm_nccl_wait, which is the
 * watchdog (see nccl_comm.c's opening comment). Internal: names CUDA and
 * NCCL types. */
#ifndef TDM_CUDA_NCCL_IMPL_H
#define TDM_CUDA_NCCL_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda/cuda.h"

/* A set of NCCL communicators watched together (one for a rank, one per
 * GPU for a group). */
typedef struct tdm_nccl_watch {
    int n;
    ncclComm_t *comms;
    const int *devices;
    cudaEvent_t *events;       /* completion of the last enqueue; NULL: none */
    int64_t timeout_ms;
    atomic_int *abort_flag;    /* 0 running, 1 raised, 2 raised and reason written */
    const char *abort_reason;
    const char *(*ext_check)(void *ctx); /* tdm_nccl_opts.abort_check */
    void *ext_ctx;
    int *dead;                 /* set once the comms are aborted */
    tdm_comm *bootstrap;       /* told of every abort; NULL: nobody */
} tdm_nccl_watch;

/* opts' timeout_ms, else TANDEM_NCCL_TIMEOUT_MS, else 300 s. */
int64_t tdm_nccl_timeout(const tdm_nccl_opts *opts);
/* NCCL's result as a tdm_status (invalid argument/usage, remote, other). */
tdm_status tdm_nccl_status_of(ncclResult_t r);
/* Every tdm_dtype and tdm_redop has its NCCL counterpart (callers
 * validate the value first). */
ncclDataType_t tdm_nccl_dtype(tdm_dtype dt);
ncclRedOp_t tdm_nccl_op(tdm_redop op);
/* Tells w's bootstrap group (if any), aborts every comm, marks w dead. */
void tdm_nccl_abort_all(tdm_nccl_watch *w);
/* Waits until every comm of w has left ncclInProgress and, when
 * wait_events, every event has completed; on an NCCL error, an abort, a
 * peer's failure or the deadline, aborts the comms and returns why. */
tdm_status tdm_nccl_wait(tdm_nccl_watch *w, int wait_events, const char *what);
/* The result of a non-blocking NCCL call: in progress is fine, an error
 * aborts w's comms. */
tdm_status tdm_nccl_enq(tdm_nccl_watch *w, ncclResult_t r, const char *what, int dev);
/* A failed CUDA call around a collective, as an error status. */
tdm_status tdm_nccl_cuda_fail(const char *what, int dev, cudaError_t e);
/* Orders stream s after the compute stream of the device open on dev (or
 * the whole GPU when none is open in this process). */
tdm_status tdm_nccl_order(int dev, cudaStream_t s);

#endif
