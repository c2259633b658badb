/* cuda/nccl_group.c: an NCCL group over the GPUs of one process, driven by
 * one thread (ncclGroupStart/End around one rank per GPU), for
 * DataParallel's replicate (broadcast) and reduce-add (cuda/hooks.c hands
 * it to core/device.c). Waited for like the rank communicator, through
 * cuda/nccl_watch.c. Not the one-rank-per-process communicator of DDP
 * (cuda/nccl_comm.c). */
#include "cuda/nccl_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "cuda/cuda_impl.h"
#include "cuda/cuda_libs_impl.h"

struct tdm_cuda_nccl_group {
    int n;
    int dead;
    int64_t timeout_ms;
    const char *(*ext_check)(void *ctx);
    void *ext_ctx;
    int *devices;
    ncclComm_t *comms;
    cudaStream_t *streams;
    cudaEvent_t *events;
};

int tdm_cuda_nccl_group_size(const tdm_cuda_nccl_group *g) { return g ? g->n : 0; }

static tdm_nccl_watch tdm_nccl_group_watch(tdm_cuda_nccl_group *g)
{
    return (tdm_nccl_watch){.n = g->n, .comms = g->comms, .devices = g->devices,
                            .events = g->events, .timeout_ms = g->timeout_ms,
                            .ext_check = g->ext_check, .ext_ctx = g->ext_ctx, .dead = &g->dead};
}

void tdm_cuda_nccl_group_free(tdm_cuda_nccl_group *g)
{
    if (!g) return;
    if (g->comms) {
        tdm_nccl_watch w = tdm_nccl_group_watch(g);
        if (!g->dead) {
            /* Finalize every rank (non-blocking), wait, then destroy. */
            tdm_status st = TDM_STATUS_OK;
            for (int i = 0; i < g->n && st == TDM_STATUS_OK; i++) {
                if (!g->comms[i]) continue;
                if (cudaSetDevice(g->devices[i]) != cudaSuccess) (void)cudaGetLastError();
                st = tdm_nccl_enq(&w, ncclCommFinalize(g->comms[i]), "ncclCommFinalize",
                                  g->devices[i]);
            }
            if (st == TDM_STATUS_OK) st = tdm_nccl_wait(&w, 0, "ncclCommFinalize");
            if (st != TDM_STATUS_OK) TDM_WARN(CUDA, "%s", tdm_error_message());
            for (int i = 0; i < g->n; i++)
                if (g->comms[i]) {
                    if (cudaSetDevice(g->devices[i]) != cudaSuccess) (void)cudaGetLastError();
                    ncclResult_t r = ncclCommDestroy(g->comms[i]);
                    if (r != ncclSuccess)
                        TDM_WARN(CUDA, "ncclCommDestroy on cuda:%d: %s", g->devices[i],
                                 ncclGetErrorString(r));
                }
        } else {
            for (int i = 0; i < g->n; i++)
                if (g->comms[i]) {
                    ncclResult_t r = ncclCommAbort(g->comms[i]);
                    if (r != ncclSuccess)
                        TDM_WARN(CUDA, "ncclCommAbort on cuda:%d: %s", g->devices[i],
                                 ncclGetErrorString(r));
                }
        }
    }
    for (int i = 0; i < g->n; i++) {
        if (g->devices && cudaSetDevice(g->devices[i]) != cudaSuccess) (void)cudaGetLastError();
        if (g->events && g->events[i])
            tdm_cuda_warn("nccl group", "cudaEventDestroy", cudaEventDestroy(g->events[i]));
        if (g->streams && g->streams[i])
            tdm_cuda_warn("nccl group", "cudaStreamDestroy", cudaStreamDestroy(g->streams[i]));
    }
    free(g->devices);
    free(g->comms);
    free(g->streams);
    free(g->events);
    free(g);
}

tdm_status tdm_cuda_nccl_group_init(tdm_cuda_nccl_group **out, const int *devices, int ndev,
                                    const tdm_nccl_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_cuda_nccl_group *g = NULL;
    TDM_REQUIRE(out && devices && ndev >= 1, TDM_STATUS_INVALID_ARG,
                "tdm_cuda_nccl_group_init: need out, devices and ndev >= 1 (ndev=%d)", ndev);
    *out = NULL;
    for (int i = 0; i < ndev; i++) {
        TDM_CHECK(tdm_cuda_device_check(devices[i]));
        for (int j = 0; j < i; j++)
            TDM_REQUIRE(devices[i] != devices[j], TDM_STATUS_INVALID_ARG,
                        "tdm_cuda_nccl_group_init: cuda:%d listed twice", devices[i]);
    }
    TDM_CHECK(tdm_cuda_lib_load(TDM_CUDA_LIB_NCCL));
    g = calloc(1, sizeof *g);
    if (!g) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl group: calloc");
    g->n = ndev;
    g->timeout_ms = tdm_nccl_timeout(opts);
    g->ext_check = opts ? opts->abort_check : NULL;
    g->ext_ctx = opts ? opts->abort_ctx : NULL;
    g->devices = calloc((size_t)ndev, sizeof *g->devices);
    g->comms = calloc((size_t)ndev, sizeof *g->comms);
    g->streams = calloc((size_t)ndev, sizeof *g->streams);
    g->events = calloc((size_t)ndev, sizeof *g->events);
    if (!g->devices || !g->comms || !g->streams || !g->events) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "nccl group: calloc");
        goto fail;
    }
    memcpy(g->devices, devices, (size_t)ndev * sizeof *devices);
    for (int i = 0; i < ndev; i++) {
        cudaError_t e = cudaSetDevice(devices[i]);
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&g->streams[i], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->events[i], cudaEventDisableTiming);
        if (e != cudaSuccess) { st = tdm_nccl_cuda_fail("creating stream and event", devices[i], e); goto fail; }
    }
    ncclUniqueId id;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "nccl group: ncclGetUniqueId: %s",
                           ncclGetErrorString(r));
        goto fail;
    }
    /* NCCL's documented single-thread multi-GPU init: one rank per GPU
     * inside a group, here with the non-blocking config. */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    tdm_nccl_watch w = tdm_nccl_group_watch(g);
    r = ncclGroupStart();
    for (int i = 0; i < ndev && (r == ncclSuccess || r == ncclInProgress); i++) {
        cudaError_t e = cudaSetDevice(devices[i]);
        if (e != cudaSuccess) { st = tdm_nccl_cuda_fail("cudaSetDevice", devices[i], e); break; }
        r = ncclCommInitRankConfig(&g->comms[i], ndev, id, i, &cfg);
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (st != TDM_STATUS_OK) goto fail_comms;
    if (r == ncclSuccess || r == ncclInProgress) r = r2;
    if (r != ncclSuccess && r != ncclInProgress) {
        st = tdm_error_set(tdm_nccl_status_of(r), "nccl group: ncclCommInitRankConfig over %d "
                           "GPUs: %s", ndev, ncclGetErrorString(r));
        goto fail_comms;
    }
    TDM_TRY(tdm_nccl_wait(&w, 0, "ncclCommInitRankConfig (group)"));
    *out = g;
    return TDM_STATUS_OK;
fail_comms:
    g->dead = 1; /* abort, never finalize, comms that may be half made */
fail:
    tdm_cuda_nccl_group_free(g);
    return st;
}

typedef enum { TDM_NCCL_G_BCAST, TDM_NCCL_G_REDUCE, TDM_NCCL_G_ALL_REDUCE } tdm_nccl_g_kind;

static tdm_status tdm_nccl_group_run(tdm_cuda_nccl_group *g, tdm_nccl_g_kind kind,
                                     const void *const *send, void *const *recv, void *root_recv,
                                     size_t count, tdm_dtype dtype, tdm_redop op, int root,
                                     const char *name)
{
    TDM_REQUIRE(g, TDM_STATUS_INVALID_ARG, "nccl group %s: group is NULL", name);
    TDM_REQUIRE(!g->dead, TDM_STATUS_ABORTED, "nccl group %s: the group was aborted by an "
                "earlier failure; create a new one", name);
    TDM_REQUIRE((unsigned)dtype < TDM_DTYPE_COUNT_, TDM_STATUS_INVALID_ARG,
                "nccl group %s: invalid dtype %d", name, (int)dtype);
    TDM_REQUIRE((unsigned)op < TDM_REDOP_COUNT_, TDM_STATUS_INVALID_ARG,
                "nccl group %s: invalid op %d", name, (int)op);
    TDM_REQUIRE(kind == TDM_NCCL_G_ALL_REDUCE || (root >= 0 && root < g->n),
                TDM_STATUS_INVALID_ARG, "nccl group %s: root %d out of range (%d GPUs)", name,
                root, g->n);
    if (count == 0) return TDM_STATUS_OK;
    for (int i = 0; i < g->n; i++) {
        const void *p = kind == TDM_NCCL_G_REDUCE ? send[i] : recv[i];
        TDM_REQUIRE(p, TDM_STATUS_INVALID_ARG, "nccl group %s: buffer %d is NULL", name, i);
    }
    TDM_REQUIRE(kind != TDM_NCCL_G_REDUCE || root_recv, TDM_STATUS_INVALID_ARG,
                "nccl group %s: recvbuf is NULL", name);
    tdm_nccl_watch w = tdm_nccl_group_watch(g);
    ncclDataType_t dt = tdm_nccl_dtype(dtype);
    for (int i = 0; i < g->n; i++) {
        cudaError_t e = cudaSetDevice(g->devices[i]);
        if (e != cudaSuccess) return tdm_nccl_cuda_fail("cudaSetDevice", g->devices[i], e);
        TDM_CHECK(tdm_nccl_order(g->devices[i], g->streams[i]));
    }
    /* One thread drives every GPU: NCCL requires the calls in a group. */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < g->n && (r == ncclSuccess || r == ncclInProgress); i++) {
        switch (kind) {
        case TDM_NCCL_G_BCAST:
            r = ncclBroadcast(recv[i], recv[i], count, dt, root, g->comms[i], g->streams[i]);
            break;
        case TDM_NCCL_G_REDUCE:
            r = ncclReduce(send[i], i == root ? root_recv : (void *)send[i], count, dt,
                           tdm_nccl_op(op), root, g->comms[i], g->streams[i]);
            break;
        case TDM_NCCL_G_ALL_REDUCE:
            r = ncclAllReduce(recv[i], recv[i], count, dt, tdm_nccl_op(op), g->comms[i],
                              g->streams[i]);
            break;
        }
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = r2;
    TDM_CHECK(tdm_nccl_enq(&w, r, name, g->devices[0]));
    TDM_CHECK(tdm_nccl_wait(&w, 0, name));
    for (int i = 0; i < g->n; i++) {
        cudaError_t e = cudaSetDevice(g->devices[i]);
        if (e == cudaSuccess) e = cudaEventRecord(g->events[i], g->streams[i]);
        if (e != cudaSuccess) {
            tdm_nccl_abort_all(&w);
            return tdm_nccl_cuda_fail("cudaEventRecord", g->devices[i], e);
        }
    }
    char what[96];
    snprintf(what, sizeof what, "group %s(%s, count=%zu) over %d GPUs", name,
             tdm_dtype_name(dtype), count, g->n);
    return tdm_nccl_wait(&w, 1, what);
}

tdm_status tdm_cuda_nccl_group_broadcast(tdm_cuda_nccl_group *g, void *const *bufs, size_t count,
                                         tdm_dtype dtype, int root)
{
    TDM_REQUIRE(bufs, TDM_STATUS_INVALID_ARG, "nccl group broadcast: bufs is NULL");
    return tdm_nccl_group_run(g, TDM_NCCL_G_BCAST, NULL, bufs, NULL, count, dtype, TDM_REDOP_SUM,
                              root, "broadcast");
}

tdm_status tdm_cuda_nccl_group_reduce(tdm_cuda_nccl_group *g, const void *const *sendbufs,
                                      void *recvbuf, size_t count, tdm_dtype dtype,
                                      tdm_redop op, int root)
{
    TDM_REQUIRE(sendbufs, TDM_STATUS_INVALID_ARG, "nccl group reduce: sendbufs is NULL");
    return tdm_nccl_group_run(g, TDM_NCCL_G_REDUCE, sendbufs, NULL, recvbuf, count, dtype, op,
                              root, "reduce");
}

tdm_status tdm_cuda_nccl_group_all_reduce(tdm_cuda_nccl_group *g, void *const *bufs,
                                          size_t count, tdm_dtype dtype, tdm_redop op)
{
    TDM_REQUIRE(bufs, TDM_STATUS_INVALID_ARG, "nccl group all_reduce: bufs is NULL");
    return tdm_nccl_group_run(g, TDM_NCCL_G_ALL_REDUCE, NULL, bufs, NULL, count, dtype, op, 0,
                              "all_reduce");
}
