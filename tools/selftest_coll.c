/* tools/selftest_coll.c: `tandem selftest`'s collectives check: every
 * collective x op at a few sizes over the devices' communicator (shm
 * between host devices, NCCL between GPUs, staged through device
 * buffers), its wrong elements and bus bandwidth against this machine's
 * copy bandwidth. See tools/selftest.h. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/rng.h"
#include "core/safefile.h"
#include "core/timer.h"
#include "dist/run.h"
#include "shm/spawn.h"
#include "tools/devices.h"
#include "tools/selftest.h"
#include "tools/tools.h"

/* --- 3. collectives ------------------------------------------------------------ */

typedef struct tdm_st_coll {
    int quick, cuda;
    tdm_device_list dl;   /* cuda: the ranks' devices */
    /* written by rank 0 */
    double busbw_gbs;     /* all_reduce busbw at the largest size */
    double copy_gbs;      /* cuda: its device's device-to-device copy bandwidth */
    long long wrong;      /* elements wrong, summed over the ranks */
    char comm[16];        /* the communicator the collectives ran on */
} tdm_st_coll;

/* Rank r's value at element j: small integers, so every op is exact in
 * float32 whatever the order. */
static float tdm_st_val(size_t j, int r) { return (float)((j + 3 * (size_t)r) % 5 + 1); }

/* A rank's buffers: values are written and checked in host memory; on a
 * device (cuda) the collectives run on device copies, staged in and out
 * outside the calls, every copy checked. */
typedef struct tdm_st_bufs {
    tdm_device *dev;      /* NULL: the host buffers are the collectives' own */
    float *hs, *hr;       /* (cap) each */
    void *ds, *dr;        /* dev: (cap) floats each */
    size_t cap;
} tdm_st_bufs;

static void *tdm_st_send(const tdm_st_bufs *b) { return b->dev ? b->ds : (void *)b->hs; }
static void *tdm_st_recv(const tdm_st_bufs *b) { return b->dev ? b->dr : (void *)b->hr; }

/* Host values hs[0, n) into the send buffer. */
static tdm_status tdm_st_put(const tdm_st_bufs *b, size_t n)
{
    if (!b->dev) return TDM_STATUS_OK;
    return tdm_dev_copy_from_host(b->dev, b->ds, b->hs, n * sizeof(float));
}

/* The first n results of the receive buffer (from_send: of the send
 * buffer, for an in-place call) into host memory: hr, or hs. */
static tdm_status tdm_st_get(const tdm_st_bufs *b, size_t n, int from_send)
{
    if (!b->dev) return TDM_STATUS_OK;
    TDM_CHECK(tdm_dev_copy_to_host(b->dev, from_send ? b->hs : b->hr,
                                   from_send ? b->ds : b->dr, n * sizeof(float)));
    return tdm_dev_sync(b->dev);
}

/* Every op of all_reduce at n elements; counts the wrong ones. */
static tdm_status tdm_st_coll_all_reduce(tdm_comm *comm, const tdm_st_bufs *b, size_t n,
                                         long long *wrong)
{
    int me = tdm_comm_rank(comm), W = tdm_comm_size(comm);
    for (int op = 0; op < TDM_REDOP_COUNT_; op++) {
        if (op == TDM_REDOP_PROD && n > 1000) continue;   /* 5^W stays exact; small sizes do */
        for (size_t j = 0; j < n; j++) b->hs[j] = tdm_st_val(j, me);
        TDM_CHECK(tdm_st_put(b, n));
        tdm_comm_set_label(comm, "selftest all_reduce %s", tdm_redop_name((tdm_redop)op));
        TDM_CHECK(tdm_comm_all_reduce(comm, tdm_st_send(b), tdm_st_recv(b), n,
                                      TDM_DTYPE_FLOAT32, (tdm_redop)op));
        TDM_CHECK(tdm_st_get(b, n, 0));
        for (size_t j = 0; j < n; j++) {
            double want = op == TDM_REDOP_PROD ? 1 : op == TDM_REDOP_MIN ? 1e30 :
                          op == TDM_REDOP_MAX ? -1e30 : 0;
            for (int q = 0; q < W; q++) {
                double v = tdm_st_val(j, q);
                if (op == TDM_REDOP_PROD) want *= v;
                else if (op == TDM_REDOP_MIN) want = v < want ? v : want;
                else if (op == TDM_REDOP_MAX) want = v > want ? v : want;
                else want += v;
            }
            if (op == TDM_REDOP_AVG) want /= W;
            if (fabs(b->hr[j] - want) > 1e-6 * fabs(want)) (*wrong)++;
        }
    }
    return TDM_STATUS_OK;
}

/* broadcast (in place, from the first and the last rank), all_gather,
 * reduce_scatter, gather, scatter, reduce at n elements a rank. */
static tdm_status tdm_st_coll_others(tdm_comm *comm, const tdm_st_bufs *b, size_t n,
                                     long long *wrong)
{
    int me = tdm_comm_rank(comm), W = tdm_comm_size(comm);
    size_t nw = n * (size_t)W;
    for (int root = 0; root < W; root += W > 1 ? W - 1 : 1) {
        for (size_t j = 0; j < n; j++) b->hs[j] = me == root ? tdm_st_val(j, root) : -1.0f;
        TDM_CHECK(tdm_st_put(b, n));
        TDM_CHECK(tdm_comm_broadcast(comm, tdm_st_send(b), tdm_st_send(b), n, TDM_DTYPE_FLOAT32,
                                     root));
        TDM_CHECK(tdm_st_get(b, n, 1));
        for (size_t j = 0; j < n; j++) *wrong += b->hs[j] != tdm_st_val(j, root);
    }
    for (size_t j = 0; j < n; j++) b->hs[j] = tdm_st_val(j, me);
    TDM_CHECK(tdm_st_put(b, n));
    TDM_CHECK(tdm_comm_all_gather(comm, tdm_st_send(b), tdm_st_recv(b), n, TDM_DTYPE_FLOAT32));
    TDM_CHECK(tdm_st_get(b, nw, 0));
    for (int q = 0; q < W; q++)
        for (size_t j = 0; j < n; j++) *wrong += b->hr[(size_t)q * n + j] != tdm_st_val(j, q);
    for (size_t j = 0; j < nw; j++) b->hs[j] = tdm_st_val(j, me);
    TDM_CHECK(tdm_st_put(b, nw));
    TDM_CHECK(tdm_comm_reduce_scatter(comm, tdm_st_send(b), tdm_st_recv(b), n, TDM_DTYPE_FLOAT32,
                                      TDM_REDOP_SUM));
    TDM_CHECK(tdm_st_get(b, n, 0));
    for (size_t j = 0; j < n; j++) {
        float want = 0;
        for (int q = 0; q < W; q++) want += tdm_st_val((size_t)me * n + j, q);
        *wrong += b->hr[j] != want;
    }
    for (size_t j = 0; j < n; j++) b->hs[j] = tdm_st_val(j, me);
    TDM_CHECK(tdm_st_put(b, n));
    TDM_CHECK(tdm_comm_gather(comm, tdm_st_send(b), tdm_st_recv(b), n, TDM_DTYPE_FLOAT32, 0));
    if (me == 0) {
        TDM_CHECK(tdm_st_get(b, nw, 0));
        for (int q = 0; q < W; q++)
            for (size_t j = 0; j < n; j++) *wrong += b->hr[(size_t)q * n + j] != tdm_st_val(j, q);
    }
    for (size_t j = 0; j < nw; j++) b->hs[j] = tdm_st_val(j, 0);
    TDM_CHECK(tdm_st_put(b, nw));
    TDM_CHECK(tdm_comm_scatter(comm, tdm_st_send(b), tdm_st_recv(b), n, TDM_DTYPE_FLOAT32, 0));
    TDM_CHECK(tdm_st_get(b, n, 0));
    for (size_t j = 0; j < n; j++) *wrong += b->hr[j] != tdm_st_val((size_t)me * n + j, 0);
    for (size_t j = 0; j < n; j++) b->hs[j] = tdm_st_val(j, me);
    TDM_CHECK(tdm_st_put(b, n));
    TDM_CHECK(tdm_comm_reduce(comm, tdm_st_send(b), tdm_st_recv(b), n, TDM_DTYPE_FLOAT32,
                              TDM_REDOP_MAX, 0));
    if (me == 0) {
        TDM_CHECK(tdm_st_get(b, n, 0));
        for (size_t j = 0; j < n; j++) {
            float want = 0;
            for (int q = 0; q < W; q++) want = tdm_st_val(j, q) > want ? tdm_st_val(j, q) : want;
            *wrong += b->hr[j] != want;
        }
    }
    return tdm_comm_barrier(comm);
}

/* Seconds per all_reduce of n elements (busbw), and on a device its
 * device-to-device copy bandwidth of 64 MiB, every rank copying at once
 * (the ceiling, as `tandem bench` measures it). */
static tdm_status tdm_st_coll_speed(tdm_comm *comm, tdm_comm *host, const tdm_st_bufs *b,
                                    size_t n, int iters, double *secs, double *copy_gbs)
{
    TDM_CHECK(tdm_comm_barrier(comm));
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < iters; i++)
        TDM_CHECK(tdm_comm_all_reduce(comm, tdm_st_send(b), tdm_st_send(b), n, TDM_DTYPE_FLOAT32,
                                      TDM_REDOP_SUM));
    if (b->dev) TDM_CHECK(tdm_dev_sync(b->dev));
    *secs = (double)(tdm_time_ns() - t0) * 1e-9 / iters;
    *copy_gbs = 0;
    if (!b->dev) return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    size_t bytes = (size_t)64 << 20;
    void *src = NULL, *dst = NULL;
    TDM_TRY(tdm_dev_alloc(b->dev, bytes, &src));
    TDM_TRY(tdm_dev_alloc(b->dev, bytes, &dst));
    TDM_TRY(tdm_dev_memset_zero(b->dev, src, bytes));
    TDM_TRY(tdm_dev_copy(b->dev, dst, src, bytes));
    TDM_TRY(tdm_dev_sync(b->dev));
    TDM_TRY(tdm_comm_barrier(host));
    t0 = tdm_time_ns();
    for (int i = 0; i < 4; i++) TDM_TRY(tdm_dev_copy(b->dev, dst, src, bytes));
    TDM_TRY(tdm_dev_sync(b->dev));
    *copy_gbs = 4.0 * (double)bytes / (double)(tdm_time_ns() - t0);   /* bytes/ns = GB/s */
fail:
    if (src) tdm_dev_free(b->dev, src);
    if (dst) tdm_dev_free(b->dev, dst);
    return st;
}

/* The checks of one rank over comm (the device's communicator: NCCL on a
 * GPU, else host, the shm one); host is the shm group, for the sums. */
static tdm_status tdm_st_coll_run(tdm_comm *comm, tdm_comm *host, const tdm_st_bufs *b,
                                  tdm_st_coll *a, long long *all)
{
    size_t sizes[] = {1, 1000, (size_t)1 << 18};   /* the last (1 MiB) is also timed */
    int nsizes = a->quick ? 2 : 3;
    long long wrong = 0;
    for (int si = 0; si < nsizes; si++) {
        TDM_CHECK(tdm_st_coll_all_reduce(comm, b, sizes[si], &wrong));
        TDM_CHECK(tdm_st_coll_others(comm, b, sizes[si], &wrong));
    }
    double secs = 0, copy = 0;
    TDM_CHECK(tdm_st_coll_speed(comm, host, b, sizes[2], a->quick ? 5 : 20, &secs, &copy));
    int64_t mine = wrong, sum = 0;
    TDM_CHECK(tdm_comm_all_reduce(host, &mine, &sum, 1, TDM_DTYPE_INT64, TDM_REDOP_SUM));
    *all = sum;
    if (tdm_comm_rank(comm) == 0) {
        int W = tdm_comm_size(comm);
        /* busbw: 2(W-1)/W x bytes / time (nccl-tests) */
        a->busbw_gbs = W > 1 ? 2.0 * (W - 1) / W * (double)sizes[2] * 4 / secs / 1e9 : 0;
        a->copy_gbs = copy;
        a->wrong = sum;
        snprintf(a->comm, sizeof a->comm, "%s", tdm_comm_backend_name(comm));
    }
    return TDM_STATUS_OK;
}

/* A forked rank: its device and communicator (cuda), its buffers, the
 * checks. Exit 0, 3 when a value was wrong, 2 when a call failed. */
static int tdm_st_coll_rank(tdm_comm *comm, void *arg)
{
    tdm_st_coll *a = arg;
    int me = tdm_comm_rank(comm), W = tdm_comm_size(comm);
    tdm_comm *nccl = NULL;
    tdm_st_bufs b = {.cap = ((size_t)1 << 18) * (size_t)W};
    tdm_status st = TDM_STATUS_OK;
    long long wrong = 0;
    b.hs = malloc(b.cap * sizeof(float));
    b.hr = malloc(b.cap * sizeof(float));
    if (!b.hs || !b.hr) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "2 x %zu floats", b.cap);
        goto fail;
    }
    if (a->cuda) {
        TDM_TRY(tdm_dist_rank_device(&a->dl, me, &b.dev));
        TDM_TRY(tdm_dev_alloc(b.dev, b.cap * sizeof(float), &b.ds));
        TDM_TRY(tdm_dev_alloc(b.dev, b.cap * sizeof(float), &b.dr));
        /* NCCL on a GPU; emulated GPUs (host memory) reduce over shm */
        TDM_TRY(tdm_dist_gpu_comm(comm, b.dev, &nccl));
    }
    TDM_TRY(tdm_st_coll_run(nccl ? nccl : comm, comm, &b, a, &wrong));
fail:
    if (st) {
        fprintf(stderr, "selftest: collectives: rank %d: %s\n", me, tdm_error_message());
        tdm_comm_abort(comm, tdm_error_message());
    }
    tdm_comm_free(nccl);   /* before the shm communicator, which bootstrapped it */
    if (b.ds) tdm_dev_free(b.dev, b.ds);
    if (b.dr) tdm_dev_free(b.dev, b.dr);
    tdm_device_free(b.dev);
    free(b.hs);
    free(b.hr);
    if (st) return 2;
    return wrong ? 3 : 0;
}

/* The host's copy ceiling: memcpy bandwidth of a 64 MiB buffer. */
static double tdm_st_copy_gbs(void)
{
    size_t n = (size_t)64 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) { free(a); free(b); return 0; }
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 0;
    for (int i = 0; i < 3; i++) {
        uint64_t t0 = tdm_time_ns();
        memcpy(b, a, n);
        double s = (double)(tdm_time_ns() - t0) * 1e-9;
        if (s > 0 && (double)n / s / 1e9 > best) best = (double)n / s / 1e9;
    }
    volatile char sink = b[n / 2];
    (void)sink;
    free(a);
    free(b);
    return best;
}

void tdm_st_collectives(tdm_st *t)
{
    tdm_st_case *c = tdm_st_begin(t, "collectives");
    /* shared with the forked ranks: rank 0 writes its figures here */
    tdm_st_coll *a = mmap(NULL, sizeof *a, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                          -1, 0);
    if (a == MAP_FAILED) {
        tdm_st_fail(c, "mmap: %s", strerror(errno));
        tdm_st_end(c);
        return;
    }
    a->quick = t->quick;
    a->cuda = t->cuda;
    a->dl = t->dl;
    snprintf(a->comm, sizeof a->comm, "?");
    tdm_shm_spawn_opts so = {.timeout_ms = 120000};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(t->world, tdm_st_coll_rank, a, &so, &res);
    if (st) {
        int code = 0;
        for (int r = 0; r < t->world; r++)
            if (WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 3) code = 3;
        tdm_st_fail(c, "%s", code == 3 ? "#wrong > 0: a collective returned a wrong value"
                                      : tdm_error_message());
    }
    tdm_st_fig(c, "%d ranks over %s%s; all_reduce (5 ops), broadcast, all_gather, "
               "reduce_scatter, gather, scatter, reduce, barrier at %s elements; #wrong = %lld",
               t->world, a->comm, t->cuda && tdm_tool_cuda_emulated() ? " (emulated GPUs)" : "",
               t->quick ? "1, 1000" : "1, 1000, 262144", a->wrong);
    double ceil = t->cuda ? a->copy_gbs : tdm_st_copy_gbs();
    if (!c->failed && t->world > 1)
        tdm_st_fig(c, "; all_reduce 1 MiB busbw %.2f GB/s = %.0f%% of the %s copy ceiling "
                   "(%.1f GB/s)", a->busbw_gbs, ceil > 0 ? 100.0 * a->busbw_gbs / ceil : 0,
                   t->cuda ? "device-to-device" : "host", ceil);
    munmap(a, sizeof *a);
    tdm_st_end(c);
}
