/* tools/bench_coll.c: `tandem bench <collective>`, the collective
 * benchmark, with the columns of nccl-tests (size, count, type, redop,
 * root, time, algbw, busbw, #wrong, out of place and in place) plus the
 * algorithm each row used and its bus bandwidth as a fraction of a copy
 * bandwidth measured in the same run: on host devices the shm
 * communicator against memcpy with the same number of processes copying
 * at once; with --device cuda one rank per GPU, the NCCL communicator
 * (bootstrapped over shm) on device buffers against a device-to-device
 * copy on every GPU at once. Under TANDEM_CUDA_EMULATOR the CUDA path
 * runs on emulated devices and reduces over shm.
 * Not a test: correctness is checked once per size (#wrong), but the
 * tests are in tests/test_shm_*.c and tests/test_cuda.c. */
#include <sched.h>
#include <stdint.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/timer.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tools/args.h"
#include "tools/bench_check.h"
#include "tools/bench_coll.h"
#include "tools/devices.h"
#include "tools/mpi_job.h"
#include "tools/tools.h"


static void bench_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem bench <collective> [options]\n"
        "  collective: all_reduce | reduce_scatter | all_gather | broadcast | reduce\n"
        "  (the other benchmarks: tandem bench gemm|train|dp --help)\n"
        "Forks RANKS processes joined by a shared-memory communicator and sweeps message\n"
        "sizes from MIN to MAX (multiplying by FACTOR), printing the nccl-tests columns:\n"
        "size (bytes of the largest buffer), count (its elements), type, redop, root,\n"
        "then out-of-place and in-place time (us, slowest rank's mean), algbw = size/time\n"
        "and busbw = algbw * factor (all_reduce 2(n-1)/n; reduce_scatter and all_gather\n"
        "(n-1)/n; broadcast and reduce 1) in GB/s (1e9 bytes/s), #wrong (elements differing\n"
        "from the exact reference, summed over ranks; a floating-point avg may differ by\n"
        "the roundings of NCCL's premultiplied sum), the algorithm used, and busbw as a\n"
        "fraction of the memcpy bandwidth of one process while RANKS processes copy at once\n"
        "(measured first, in the same run). Ends with the average busbw (out of place).\n"
        "With --device cuda[:I,J,..] there is one rank per listed GPU, each on its own\n"
        "GPU, and the communicator is NCCL (bootstrapped over shm) on device buffers\n"
        "(tdm_dev_alloc); the reference column is then busbw/d2d: the device-to-device\n"
        "copy bandwidth of one GPU while every rank's GPU copies at once. Inputs are\n"
        "staged from the host for the #wrong check, outside the timed loop; times are\n"
        "host times of calls that return once the GPU has finished.\n"
        "options:\n"
        "  -n, --nranks N       ranks (processes), 1..%d (default 2; with --device cuda\n"
        "                       the number of listed devices, and -n must equal it)\n"
        "  -b, --minbytes SIZE  smallest size, e.g. 8, 4K, 1M (default 8)\n"
        "  -e, --maxbytes SIZE  largest size (default 64M)\n"
        "  -f, --stepfactor F   size multiplier per row, > 1 (default 2)\n"
        "  -d, --datatype T     float|float32|double|float64|int32|int64|bf16|fp16\n"
        "                       (default float; bf16/fp16 are reduced in float32; not\n"
        "                       with --device cuda, whose NCCL communicator has no bf16/fp16)\n"
        "  -o, --op OP          sum|prod|min|max|avg (default sum)\n"
        "  -r, --root R         root of broadcast/reduce (default 0)\n"
        "  -w, --warmup N       untimed iterations per size (default 5)\n"
        "  -i, --iters N        timed iterations per size (default 20)\n"
        "  --device SPEC        cpu (default): the shm communicator between host processes;\n"
        "                       cuda, cuda:I or cuda:I,J,..: one rank per GPU, NCCL. With\n"
        "                       TANDEM_CUDA_EMULATOR=N the cuda devices are emulated on the\n"
        "                       host and the ranks reduce over shm (a test, not a GPU result)\n"
        "  --memcpy-bytes SIZE  bytes each process copies for the memcpy reference, or each\n"
        "                       GPU for the d2d one (default: max(MAX, 64M))\n"
        "  --no-bind            do not pin rank r to the r-th allowed core (pinning, as\n"
        "                       mpirun does, is the default when ranks <= cores; CUDA ranks\n"
        "                       are never pinned, and --no-bind is accepted there)\n"
        "MPI (builds with Open MPI's development files; see docs/MULTINODE.md):\n"
        "  --backend LIST       communicators to measure, comma-separated, each size in turn:\n"
        "                       shm (shared memory, one machine), mpi (MPI's collectives;\n"
        "                       the bench's calls are synchronous: MPI's blocking ones),\n"
        "                       hier (shm inside each machine + MPI between\n"
        "                       them), auto (shm on one machine, hier on several). Rows then\n"
        "                       carry a backend column. Anything but shm runs as an MPI job:\n"
        "                       outside one, tandem runs itself under `mpirun -np N`\n"
        "  --peer mpi           also measure Open MPI's own blocking collective (MPI_Allreduce,\n"
        "                       ...) on the same buffers (rows 'mpi-own'), and print each\n"
        "                       backend's speed against it (vs-MPI: its time over ours)\n"
        "  Under mpirun (or srun) the ranks are the MPI job's; -n, if given, must match.\n"
        "  TANDEM_PRETEND_MACHINES=K splits one machine's ranks into K pretend machines, MPI\n"
        "  between them over TCP on lo only (K:shm: over shared memory).\n"
        "shm communicator only (refused with --device cuda):\n"
        "  --zero-copy          buffers live in the shared segment (tdm_shm_comm_alloc);\n"
        "                       in-place all_reduce then reads peers' buffers directly\n"
        "  --slot-bytes SIZE    staging buffer per rank (default 1M; two per rank)\n"
        "  --one-shot-bytes SIZE  all_reduce/reduce up to SIZE use one-shot (default 512 for\n"
        "                       2 ranks on 2 or more cores, else 4K)\n"
        "exit status: 0 ok, 1 runtime failure (including no CUDA device) or #wrong > 0,\n"
        "2 usage error.\n"
        "environment: TANDEM_DEBUG=INFO TANDEM_DEBUG_SUBSYS=SHM logs algorithm choices.\n",
        TDM_SHM_MAX_RANKS);
}

static int bench_parse_size(const char *flag, const char *s, size_t *out)
{
    if (!s || !*s) { fprintf(stderr, "tandem bench: %s needs a value\n", flag); return 0; }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned long long mul = 1;
    if (end == s) goto bad;
    if (*end == 'K' || *end == 'k') { mul = 1ull << 10; end++; }
    else if (*end == 'M' || *end == 'm') { mul = 1ull << 20; end++; }
    else if (*end == 'G' || *end == 'g') { mul = 1ull << 30; end++; }
    if (*end == 'B' || *end == 'b') end++;
    if (*end) goto bad;
    if (errno == ERANGE || v > (1ull << 40) / mul) {
        fprintf(stderr, "tandem bench: %s: '%s' is larger than 1 TiB\n", flag, s);
        return 0;
    }
    *out = (size_t)(v * mul);
    return 1;
bad:
    fprintf(stderr, "tandem bench: %s: '%s' is not a size (e.g. 8, 4K, 16M, 1G)\n", flag, s);
    return 0;
}

int tdm_tool_bench_check_ranks(const bench_cfg *cfg, int say)
{
    if (cfg->root >= cfg->nranks) {
        if (say)
            fprintf(stderr, "tandem bench: -r %d: root must be below -n %d (the number of "
                    "ranks)\n", cfg->root, cfg->nranks);
        return 0;
    }
    size_t es = tdm_dtype_size(cfg->dtype);
    size_t unit = es * (cfg->coll == TDM_COLL_REDUCE_SCATTER || cfg->coll == TDM_COLL_ALL_GATHER
                            ? (size_t)cfg->nranks : 1);
    if (cfg->min_bytes < unit) {
        if (say)
            fprintf(stderr, "tandem bench: -b %zu: smallest size for %s of %s over %d ranks is "
                    "%zu bytes\n", cfg->min_bytes, tdm_coll_name(cfg->coll),
                    tdm_dtype_name(cfg->dtype), cfg->nranks, unit);
        return 0;
    }
    return 1;
}

/* --backend shm,mpi,hier: each once, in the order given. */
static int bench_parse_backends(const char *v, bench_cfg *cfg)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    cfg->nbackends = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        tdm_mpi_backend b;
        if (!tdm_tool_backend_parse("bench", tok, &b)) return 0;
        for (int i = 0; i < cfg->nbackends; i++)
            if (cfg->backends[i] == b) {
                fprintf(stderr, "tandem bench: --backend '%s' names %s twice\n", v, tok);
                return 0;
            }
        if (cfg->nbackends == TDM_MPI_BACKEND_COUNT_) return 0;
        cfg->backends[cfg->nbackends++] = b;
    }
    if (!cfg->nbackends) {
        fprintf(stderr, "tandem bench: --backend needs a list (shm, mpi, hier, auto)\n");
        return 0;
    }
    return 1;
}

static double bench_bus_factor(tdm_coll c, int n)
{
    switch (c) {
    case TDM_COLL_ALL_REDUCE: return 2.0 * (n - 1) / n;
    case TDM_COLL_REDUCE_SCATTER: case TDM_COLL_ALL_GATHER: return (double)(n - 1) / n;
    default: return 1.0;
    }
}

static void bench_store(void *b, size_t i, tdm_dtype dt, int64_t v)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32: ((float *)b)[i] = (float)v; break;
    case TDM_DTYPE_FLOAT64: ((double *)b)[i] = (double)v; break;
    case TDM_DTYPE_INT32: ((int32_t *)b)[i] = (int32_t)v; break;
    case TDM_DTYPE_BFLOAT16: ((uint16_t *)b)[i] = tdm_f32_to_bf16((float)v); break;
    case TDM_DTYPE_FLOAT16: ((uint16_t *)b)[i] = tdm_f32_to_f16((float)v); break;
    default: ((int64_t *)b)[i] = v; break;
    }
}

typedef struct bench_bufs {
    unsigned char *send, *recv;    /* host memory, or device memory of dev */
    size_t send_count, recv_count; /* elements */
    size_t count;                  /* the collective's count argument */
    tdm_device *dev;               /* borrowed; NULL: host buffers */
    unsigned char *stage;          /* with dev: host copy of the checked data */
} bench_bufs;

/* Element counts for a row of `bytes` (the largest buffer). */
static void bench_counts(const bench_cfg *cfg, size_t bytes, bench_bufs *b)
{
    size_t es = tdm_dtype_size(cfg->dtype), n = (size_t)cfg->nranks;
    size_t total = bytes / es;
    switch (cfg->coll) {
    case TDM_COLL_REDUCE_SCATTER:
        b->count = total / n; b->send_count = b->count * n; b->recv_count = b->count; break;
    case TDM_COLL_ALL_GATHER:
        b->count = total / n; b->send_count = b->count; b->recv_count = b->count * n; break;
    default:
        b->count = total; b->send_count = total; b->recv_count = total; break;
    }
}

static void bench_fill(const bench_cfg *cfg, const bench_bufs *b, void *send, int r)
{
    for (size_t i = 0; i < b->send_count; i++)
        bench_store(send, i, cfg->dtype, tdm_bench_ref_val(i, r, cfg->op));
}

/* The call's send and receive buffers: in place, reduce_scatter receives
 * into this rank's block of the send buffer, all_gather sends from this
 * rank's block of the receive buffer, the others work in the send buffer. */
static void bench_buffers(const bench_cfg *cfg, const bench_bufs *b, int r, int inplace,
                          unsigned char **send, unsigned char **recv)
{
    size_t blk = (size_t)r * b->count * tdm_dtype_size(cfg->dtype);
    *send = b->send;
    *recv = b->recv;
    if (!inplace) return;
    if (cfg->coll == TDM_COLL_REDUCE_SCATTER) *recv = b->send + blk;
    else if (cfg->coll == TDM_COLL_ALL_GATHER) *send = b->recv + blk;
    else *recv = b->send;
}

__attribute__((weak)) tdm_status tdm_mpi_peer_run(tdm_comm *comm, const tdm_comm_call *call);

static tdm_status bench_call(const bench_target *t, const bench_cfg *cfg, const bench_bufs *b,
                             int inplace)
{
    unsigned char *send, *recv;
    bench_buffers(cfg, b, tdm_comm_rank(t->comm), inplace, &send, &recv);
    tdm_comm_call k = {.coll = cfg->coll, .sendbuf = send, .recvbuf = recv, .count = b->count,
                       .dtype = cfg->dtype, .op = cfg->op, .root = cfg->root};
    /* the peer exists only where mpi/ is built (tools/bench_mpi.c checks) */
    if (t->peer) return tdm_mpi_peer_run(t->comm, &k);
    return tdm_comm_run(t->comm, &k);
}

/* Runs once with reference inputs; returns the number of wrong elements.
 * Device buffers are filled and read back through b->stage. */
static int64_t bench_check(const bench_target *t, const bench_cfg *cfg, const bench_bufs *b,
                           int inplace, tdm_status *st)
{
    int r = tdm_comm_rank(t->comm), n = tdm_comm_size(t->comm);
    size_t es = tdm_dtype_size(cfg->dtype);
    unsigned char *send, *recv;
    bench_buffers(cfg, b, r, inplace, &send, &recv);
    if (b->dev) {
        bench_fill(cfg, b, b->stage, r);
        if ((*st = b->dev->ops->copy_from_host(b->dev, send, b->stage, b->send_count * es)))
            return 0;
    } else {
        bench_fill(cfg, b, send, r);
    }
    *st = bench_call(t, cfg, b, inplace);
    if (*st) return 0;
    const unsigned char *out = recv;
    if (b->dev && !(cfg->coll == TDM_COLL_REDUCE && r != cfg->root)) {
        size_t out_count = cfg->coll == TDM_COLL_ALL_GATHER ? b->recv_count : b->count;
        if ((*st = b->dev->ops->copy_to_host(b->dev, b->stage, out, out_count * es))) return 0;
        out = b->stage;
    }
    int64_t wrong = 0;
    int avg_n = cfg->op == TDM_REDOP_AVG ? n : 0;
    switch (cfg->coll) {
    case TDM_COLL_ALL_REDUCE:
        for (size_t i = 0; i < b->count; i++)
            wrong += !tdm_bench_check_equal(out, i, cfg->dtype, tdm_bench_ref(i, n, cfg->op), avg_n);
        break;
    case TDM_COLL_REDUCE:
        if (r == cfg->root)
            for (size_t i = 0; i < b->count; i++)
                wrong += !tdm_bench_check_equal(out, i, cfg->dtype, tdm_bench_ref(i, n, cfg->op), avg_n);
        break;
    case TDM_COLL_REDUCE_SCATTER:
        for (size_t i = 0; i < b->count; i++)
            wrong += !tdm_bench_check_equal(out, i, cfg->dtype,
                                  tdm_bench_ref((size_t)r * b->count + i, n, cfg->op), avg_n);
        break;
    case TDM_COLL_ALL_GATHER:
        for (size_t i = 0; i < b->recv_count; i++)
            wrong += !tdm_bench_check_equal(out, i, cfg->dtype,
                                  tdm_bench_ref_val(i % b->count, (int)(i / b->count), cfg->op), 0);
        break;
    case TDM_COLL_BROADCAST:
        for (size_t i = 0; i < b->count; i++)
            wrong += !tdm_bench_check_equal(out, i, cfg->dtype, tdm_bench_ref_val(i, cfg->root, cfg->op), 0);
        break;
    default: break;
    }
    return wrong;
}

/* Mean microseconds per call of coll on this rank, then the slowest
 * rank's. ctl (shm) carries the barrier and the host-memory reduction of
 * the times: coll may be NCCL, which takes device memory only. An NCCL
 * call returns once its work has completed on the GPU (cuda/nccl_comm.c's
 * watchdog waits for it), so host time is GPU time here; the syncs only
 * keep the device's own earlier work (the staging copies) out of the clock. */
static tdm_status bench_time(const bench_target *t, tdm_comm *ctl, const bench_cfg *cfg,
                             const bench_bufs *b, int inplace, double *us)
{
    for (int i = 0; i < cfg->warmup; i++) TDM_CHECK(bench_call(t, cfg, b, inplace));
    if (b->dev) TDM_CHECK(tdm_dev_sync(b->dev));
    TDM_CHECK(tdm_comm_barrier(ctl));
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < cfg->iters; i++) TDM_CHECK(bench_call(t, cfg, b, inplace));
    if (b->dev) TDM_CHECK(tdm_dev_sync(b->dev));
    double mine = (double)(tdm_time_ns() - t0) / 1e3 / cfg->iters;
    return tdm_comm_all_reduce(ctl, &mine, us, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_MAX);
}

/* GB/s one process copies while every rank copies at once. */
static tdm_status bench_memcpy(tdm_comm *comm, size_t bytes, double *gbs)
{
    tdm_status st = TDM_STATUS_OK;
    unsigned char *src = malloc(bytes), *dst = malloc(bytes);
    if (!src || !dst) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate 2 x %zu bytes for the "
                           "memcpy reference", bytes);
        goto fail;
    }
    memset(src, 1, bytes);
    memset(dst, 2, bytes);
    memcpy(dst, src, bytes);
    int reps = bytes >= (64u << 20) ? 5 : (int)((320u << 20) / (bytes ? bytes : 1)) + 1;
    TDM_TRY(tdm_comm_barrier(comm));
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < reps; i++) {
        memcpy(dst, src, bytes);
        __asm__ __volatile__("" ::"r"(dst) : "memory");
    }
    double mine = (double)bytes * reps / (double)(tdm_time_ns() - t0);  /* bytes/ns = GB/s */
    TDM_TRY(tdm_comm_barrier(comm));
    TDM_TRY(tdm_comm_all_reduce(comm, &mine, gbs, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_AVG));
fail:
    free(src);
    free(dst);
    return st;
}

/* GB/s one device copies device-to-device (dev->ops->copy, the bytes
 * copied per second, as for memcpy) while every rank's device copies at
 * once: the CUDA counterpart of bench_memcpy. */
static tdm_status bench_d2d(tdm_comm *ctl, tdm_device *dev, size_t bytes, double *gbs)
{
    tdm_status st = TDM_STATUS_OK;
    void *src = NULL, *dst = NULL;
    TDM_TRY(tdm_dev_alloc(dev, bytes, &src));
    TDM_TRY(tdm_dev_alloc(dev, bytes, &dst));
    TDM_TRY(dev->ops->memset_zero(dev, src, bytes));
    TDM_TRY(dev->ops->copy(dev, dst, src, bytes));
    /* about 1 GiB in all: a GPU copies 64 MiB in tens of microseconds */
    int reps = bytes >= (1u << 30) ? 3 : (int)(((size_t)1 << 30) / (bytes ? bytes : 1)) + 1;
    TDM_TRY(tdm_dev_sync(dev));
    TDM_TRY(tdm_comm_barrier(ctl));
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < reps; i++) TDM_TRY(dev->ops->copy(dev, dst, src, bytes));
    TDM_TRY(tdm_dev_sync(dev));
    double mine = (double)bytes * reps / (double)(tdm_time_ns() - t0);  /* bytes/ns = GB/s */
    TDM_TRY(tdm_comm_barrier(ctl));
    TDM_TRY(tdm_comm_all_reduce(ctl, &mine, gbs, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_AVG));
fail:
    tdm_dev_free(dev, src);
    tdm_dev_free(dev, dst);
    return st;
}

/* Pins this process to the r-th core it may run on; 1 when pinned. */
static int bench_bind(int r, int n)
{
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || n > CPU_COUNT(&allowed)) return 0;
    for (int cpu = 0, k = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &allowed)) continue;
        if (k++ != r) continue;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        return sched_setaffinity(0, sizeof one, &one) == 0;
    }
    return 0;
}

/* "cuda:0,cuda:1" (or "cuda-emu:0,..."): the devices of the ranks, named
 * as rank 0's device is (each rank opens the one at its own position). */
static void bench_device_names(const bench_cfg *cfg, const tdm_device *dev0, char *out,
                               size_t len)
{
    const char *colon = strchr(dev0->name, ':');
    int kind_len = colon ? (int)(colon - dev0->name) : (int)strlen(dev0->name);
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < cfg->nranks && used < len; i++) {
        int k = snprintf(out + used, len - used, "%s%.*s:%d", i ? "," : "", kind_len,
                         dev0->name, cfg->dl.index[i]);
        if (k < 0) break;
        used += (size_t)k;
    }
}

/* One size's results for one target. */
typedef struct bench_row {
    double us[2], algbw[2], busbw[2];
    int64_t wrong[2];
    char algo[64];
} bench_row;

static void bench_print_header(const bench_cfg *cfg, const char *ref)
{
    char refcol[32];
    snprintf(refcol, sizeof refcol, "busbw/%s(oop,ip)", ref);
    if (!cfg->table) {
        printf("#\n# %10s %11s %8s %5s %4s | %9s %7s %7s %6s | %9s %7s %7s %6s | %-18s %s\n",
               "size(B)", "count", "type", "redop", "root", "oop us", "algbw", "busbw",
               "#wrong", "ip us", "algbw", "busbw", "#wrong", "algorithm(oop/ip)", refcol);
        return;
    }
    printf("#\n# %10s %11s %8s %5s %4s | %-7s | %9s %7s %7s %6s | %9s %7s %7s %6s | %-30s %-20s%s\n",
           "size(B)", "count", "type", "redop", "root", "backend", "oop us", "algbw", "busbw",
           "#wrong", "ip us", "algbw", "busbw", "#wrong", "algorithm(oop/ip)", refcol,
           cfg->peer ? " vs-MPI(oop,ip)" : "");
}

static void bench_print_row(const bench_cfg *cfg, const bench_target *t, const bench_row *w,
                            const bench_row *peer, size_t size, double mcpy)
{
    size_t es = tdm_dtype_size(cfg->dtype);
    int root = cfg->coll == TDM_COLL_BROADCAST || cfg->coll == TDM_COLL_REDUCE ? cfg->root : -1;
    if (!cfg->table) {
        printf("  %10zu %11zu %8s %5s %4d | %9.2f %7.2f %7.2f %6lld | %9.2f %7.2f %7.2f %6lld "
               "| %-18s %.2f, %.2f\n", size, size / es, tdm_dtype_name(cfg->dtype),
               tdm_redop_name(cfg->op), root, w->us[0], w->algbw[0], w->busbw[0],
               (long long)w->wrong[0], w->us[1], w->algbw[1], w->busbw[1],
               (long long)w->wrong[1], w->algo, w->busbw[0] / mcpy, w->busbw[1] / mcpy);
        return;
    }
    char ratio[32] = "";
    /* speed against Open MPI's own collective in the same run: its time
     * over ours (> 1: faster than MPI) */
    if (peer && !t->peer)
        snprintf(ratio, sizeof ratio, " %.2f, %.2f", peer->us[0] / w->us[0],
                 peer->us[1] / w->us[1]);
    char refs[32];
    snprintf(refs, sizeof refs, "%.2f, %.2f", w->busbw[0] / mcpy, w->busbw[1] / mcpy);
    printf("  %10zu %11zu %8s %5s %4d | %-7s | %9.2f %7.2f %7.2f %6lld | %9.2f %7.2f %7.2f %6lld "
           "| %-30s %-20s%s\n", size, size / es, tdm_dtype_name(cfg->dtype),
           tdm_redop_name(cfg->op), root, t->name, w->us[0], w->algbw[0], w->busbw[0],
           (long long)w->wrong[0], w->us[1], w->algbw[1], w->busbw[1], (long long)w->wrong[1],
           w->algo, refs, ratio);
}

int tdm_tool_bench_ranks(tdm_comm *ctl, bench_target *targets, int ntargets,
                         const bench_cfg *cfg)
{
    int r = tdm_comm_rank(ctl), n = tdm_comm_size(ctl);
    int ncores = tdm_device_host_cores();
    /* an MPI launcher binds its ranks itself */
    int bound = cfg->bind && !cfg->cuda && !cfg->job_desc ? bench_bind(r, n) : 0;
    size_t es = tdm_dtype_size(cfg->dtype);
    int rc = 0;
    bench_bufs b = {0};
    tdm_device *dev = NULL;
    tdm_comm *nccl = NULL;
    bench_row *rows_now = calloc((size_t)ntargets, sizeof *rows_now);
    double *sum_busbw = calloc((size_t)ntargets, sizeof *sum_busbw);
    bench_counts(cfg, cfg->max_bytes, &b);
    size_t send_bytes = (b.send_count + 16) * es, recv_bytes = (b.recv_count + 16) * es;
    double mcpy = 0;
    tdm_status st = TDM_STATUS_OK;
    if (!rows_now || !sum_busbw) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "bench: calloc");
        goto fail;
    }
    if (cfg->cuda) {
        /* NCCL's bootstrap is collective over ctl: a rank failing before
         * it aborts ctl (below), so the others fail at once too. */
        if ((st = tdm_device_open(&dev, "cuda", cfg->dl.index[r], 1))) goto fail;
        if ((st = tdm_tool_rank_nccl(ctl, dev, &nccl))) goto fail;
        if (nccl) targets[0].comm = nccl;
        b.dev = dev;
        if ((st = tdm_dev_alloc(dev, send_bytes, (void **)&b.send)) ||
            (st = tdm_dev_alloc(dev, recv_bytes, (void **)&b.recv)) ||
            (st = dev->ops->memset_zero(dev, b.send, send_bytes)) ||
            (st = dev->ops->memset_zero(dev, b.recv, recv_bytes)))
            goto fail;
        b.stage = malloc(send_bytes > recv_bytes ? send_bytes : recv_bytes);
        if (!b.stage) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "host staging buffer of %zu bytes",
                               send_bytes > recv_bytes ? send_bytes : recv_bytes);
            goto fail;
        }
        if ((st = bench_d2d(ctl, dev, cfg->memcpy_bytes, &mcpy))) goto fail;
    } else {
        if ((st = bench_memcpy(ctl, cfg->memcpy_bytes, &mcpy))) goto fail;
        if (cfg->zero_copy) {
            if ((st = tdm_shm_comm_alloc(targets[0].comm, send_bytes, (void **)&b.send))) goto fail;
            if ((st = tdm_shm_comm_alloc(targets[0].comm, recv_bytes, (void **)&b.recv))) goto fail;
        } else {
            b.send = malloc(send_bytes);
            b.recv = malloc(recv_bytes);
            if (!b.send || !b.recv) {
                st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate the send and receive "
                                   "buffers (%zu + %zu bytes)", send_bytes, recv_bytes);
                goto fail;
            }
        }
        memset(b.send, 0, send_bytes);
        memset(b.recv, 0, recv_bytes);
    }
    double factor = bench_bus_factor(cfg->coll, n);
    const char *ref = cfg->cuda ? "d2d" : "memcpy";
    const bench_row *peer_row = NULL;
    for (int t = 0; t < ntargets; t++)
        if (targets[t].peer) peer_row = &rows_now[t];
    if (r == 0) {
        if (cfg->cuda) {
            char names[512];
            bench_device_names(cfg, dev, names, sizeof names);
            printf("# tandem bench %s: %d ranks, one per device of --device %s (%s), %s "
                   "communicator, %s, %s, root %d, warmup %d, iters %d, device buffers "
                   "(tdm_dev_alloc)\n", tdm_coll_name(cfg->coll), n, cfg->device, names,
                   tdm_comm_backend_name(targets[0].comm), tdm_dtype_name(cfg->dtype),
                   tdm_redop_name(cfg->op), cfg->root, cfg->warmup, cfg->iters);
            tdm_tool_print_emulated(stdout, cfg->device);
            printf("# d2d reference: %d device%s each copying %zu bytes device-to-device at "
                   "once: %.2f GB/s per device (%.2f GB/s total)\n", n, n == 1 ? "" : "s",
                   cfg->memcpy_bytes, mcpy, mcpy * n);
        } else {
            if (cfg->job_desc)
                printf("# tandem bench %s: %d ranks (%s, %d cores here), %s, %s, root %d, "
                       "warmup %d, iters %d, private (malloc) buffers\n",
                       tdm_coll_name(cfg->coll), n, cfg->job_desc, ncores,
                       tdm_dtype_name(cfg->dtype), tdm_redop_name(cfg->op), cfg->root,
                       cfg->warmup, cfg->iters);
            else
                printf("# tandem bench %s: %d ranks (shm, %d cores%s), %s, %s, root %d, warmup "
                       "%d, iters %d, %s buffers\n", tdm_coll_name(cfg->coll), n, ncores,
                       bound ? ", rank r pinned to core r" : ", not pinned",
                       tdm_dtype_name(cfg->dtype), tdm_redop_name(cfg->op), cfg->root,
                       cfg->warmup, cfg->iters,
                       cfg->zero_copy ? "zero-copy (in the segment)" : "private (malloc)");
            printf("# memcpy reference: %d processes each copying %zu bytes at once: %.2f GB/s "
                   "per process (%.2f GB/s total)\n", n, cfg->memcpy_bytes, mcpy, mcpy * n);
            if (peer_row)
                printf("# vs-MPI: Open MPI's own blocking collective (the mpi-own rows) measured "
                       "in the same run, its time over each backend's (> 1: faster than it)\n");
        }
        bench_print_header(cfg, ref);
        fflush(stdout);
    }
    int rows = 0;
    int64_t total_wrong = 0;
    for (size_t bytes = cfg->min_bytes; bytes <= cfg->max_bytes;) {
        bench_counts(cfg, bytes, &b);
        size_t size = (cfg->coll == TDM_COLL_REDUCE_SCATTER ? b.send_count : b.recv_count) * es;
        /* every target at this size before the next size: a load that
         * comes and goes hits them alike */
        for (int t = 0; t < ntargets; t++) {
            bench_row *w = &rows_now[t];
            const char *algo[2];
            for (int ip = 0; ip < 2; ip++) {
                if ((st = bench_time(&targets[t], ctl, cfg, &b, ip, &w->us[ip]))) goto fail;
                int64_t wr = bench_check(&targets[t], cfg, &b, ip, &st);
                algo[ip] = tdm_comm_last_algo(targets[t].comm);
                if (st) goto fail;
                if ((st = tdm_comm_all_reduce(ctl, &wr, &w->wrong[ip], 1, TDM_DTYPE_INT64,
                                              TDM_REDOP_SUM)))
                    goto fail;
                w->algbw[ip] = (double)size / (w->us[ip] * 1e3);
                w->busbw[ip] = w->algbw[ip] * factor;
                total_wrong += w->wrong[ip];
            }
            if (strcmp(algo[0], algo[1]))
                snprintf(w->algo, sizeof w->algo, "%s/%s", algo[0], algo[1]);
            else
                snprintf(w->algo, sizeof w->algo, "%s", algo[0]);
            sum_busbw[t] += w->busbw[0];
        }
        if (r == 0) {
            for (int t = 0; t < ntargets; t++)
                bench_print_row(cfg, &targets[t], &rows_now[t], peer_row, size, mcpy);
            fflush(stdout);
        }
        rows++;
        size_t next = (size_t)((double)bytes * cfg->factor);
        bytes = next > bytes ? next : bytes + 1;
    }
    if (r == 0) {
        printf("# Out of bounds values : %lld %s\n", (long long)total_wrong,
               total_wrong ? "FAILED" : "OK");
        for (int t = 0; t < ntargets; t++)
            printf("# Avg bus bandwidth    : %.4f GB/s (out of place; %s reference %.2f GB/s)%s%s\n",
                   rows ? sum_busbw[t] / rows : 0.0, ref, mcpy, cfg->table ? ": " : "",
                   cfg->table ? targets[t].name : "");
        fflush(stdout);
    }
    rc = total_wrong ? 1 : 0;
    goto out;
fail:
    fprintf(stderr, "tandem bench: rank %d: %s\n", r, tdm_error_message());
    char why[64];
    snprintf(why, sizeof why, "rank %d failed", r);
    tdm_comm_abort(ctl, why);
    rc = 1;
out:
    if (dev) {
        tdm_dev_free(dev, b.send);
        tdm_dev_free(dev, b.recv);
        free(b.stage);
    } else if (!cfg->zero_copy) {
        free(b.send);
        free(b.recv);
    }
    tdm_comm_free(nccl);   /* before ctl, which bootstrapped it, and dev */
    tdm_device_free(dev);
    free(rows_now);
    free(sum_busbw);
    return rc;
}

/* A forked rank: its shm communicator is the one benchmarked. */
static int bench_rank(tdm_comm *comm, void *arg)
{
    bench_target t = {.name = "shm", .comm = comm};
    return tdm_tool_bench_ranks(comm, &t, 1, arg);
}

int tdm_tool_bench_main(int argc, char **argv)
{
    bench_cfg cfg = {.nranks = 2, .min_bytes = 8, .max_bytes = (size_t)64 << 20, .factor = 2,
                     .dtype = TDM_DTYPE_FLOAT32, .op = TDM_REDOP_SUM, .warmup = 5, .iters = 20, .bind = 1};
    int have_coll = 0, nranks_set = 0, shm_only = 0;
    const char *shm_flag = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long long x;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { bench_usage(stdout); return 0; }
#define BENCH_FLAG(s, l) ((v = tdm_args_value(argc, argv, &i, s)) || (v = tdm_args_value(argc, argv, &i, l)))
        if (BENCH_FLAG("-n", "--nranks")) {
            if (!tdm_args_int("-n", v, 1, TDM_SHM_MAX_RANKS, &x)) return 2;
            cfg.nranks = (int)x;
            nranks_set = 1;
        } else if (BENCH_FLAG("-b", "--minbytes")) {
            if (!bench_parse_size("-b", v, &cfg.min_bytes)) return 2;
        } else if (BENCH_FLAG("-e", "--maxbytes")) {
            if (!bench_parse_size("-e", v, &cfg.max_bytes)) return 2;
        } else if (BENCH_FLAG("-f", "--stepfactor")) {
            if (!tdm_args_float("-f", v, 1.0001, 1e6, &cfg.factor)) return 2;
        } else if (BENCH_FLAG("-d", "--datatype")) {
            if (tdm_dtype_parse(v, &cfg.dtype)) {
                fprintf(stderr, "tandem bench: -d: %s\n", tdm_error_message());
                return 2;
            }
        } else if (BENCH_FLAG("-o", "--op")) {
            if (tdm_redop_parse(v, &cfg.op)) {
                fprintf(stderr, "tandem bench: -o: %s\n", tdm_error_message());
                return 2;
            }
        } else if (BENCH_FLAG("-r", "--root")) {
            if (!tdm_args_int("-r", v, 0, TDM_SHM_MAX_RANKS - 1, &x)) return 2;
            cfg.root = (int)x;
        } else if (BENCH_FLAG("-w", "--warmup")) {
            if (!tdm_args_int("-w", v, 0, 1000000, &x)) return 2;
            cfg.warmup = (int)x;
        } else if (BENCH_FLAG("-i", "--iters")) {
            if (!tdm_args_int("-i", v, 1, 100000000, &x)) return 2;
            cfg.iters = (int)x;
        } else if (BENCH_FLAG("--memcpy-bytes", "--memcpy-bytes")) {
            if (!bench_parse_size("--memcpy-bytes", v, &cfg.memcpy_bytes)) return 2;
        } else if (BENCH_FLAG("--slot-bytes", "--slot-bytes")) {
            if (!bench_parse_size("--slot-bytes", v, &cfg.slot_bytes)) return 2;
            shm_only = 1;
            shm_flag = "--slot-bytes";
        } else if (BENCH_FLAG("--one-shot-bytes", "--one-shot-bytes")) {
            if (!bench_parse_size("--one-shot-bytes", v, &cfg.one_shot_bytes)) return 2;
            shm_only = 1;
            shm_flag = "--one-shot-bytes";
        } else if (BENCH_FLAG("--device", "--device")) {
            cfg.device = v;
        } else if (BENCH_FLAG("--backend", "--backend")) {
            if (!bench_parse_backends(v, &cfg)) return 2;
        } else if (BENCH_FLAG("--peer", "--peer")) {
            if (strcmp(v, "mpi")) {
                fprintf(stderr, "tandem bench: --peer '%s': the only peer is mpi (Open MPI's "
                        "own collectives)\n", v);
                return 2;
            }
            cfg.peer = 1;
        } else if (!strcmp(a, "--no-bind")) {
            cfg.bind = 0;
        } else if (!strcmp(a, "--zero-copy")) {
            cfg.zero_copy = 1;
            shm_only = 1;
            shm_flag = "--zero-copy";
        } else if (a[0] == '-') {
            fprintf(stderr, "tandem bench: unknown option '%s' (see tandem bench --help)\n", a);
            return 2;
        } else if (!have_coll) {
            if (tdm_coll_parse(a, &cfg.coll) || cfg.coll == TDM_COLL_GATHER ||
                cfg.coll == TDM_COLL_SCATTER || cfg.coll == TDM_COLL_BARRIER ||
                cfg.coll == TDM_COLL_SEND || cfg.coll == TDM_COLL_RECV) {
                fprintf(stderr, "tandem bench: unknown collective '%s' (expected all_reduce, "
                        "reduce_scatter, all_gather, broadcast or reduce)\n", a);
                return 2;
            }
            have_coll = 1;
        } else {
            fprintf(stderr, "tandem bench: unexpected argument '%s'\n", a);
            return 2;
        }
#undef BENCH_FLAG
    }
    if (!have_coll) {
        fprintf(stderr, "tandem bench: which collective? (see tandem bench --help)\n");
        bench_usage(stderr);
        return 2;
    }
    if (cfg.device && *cfg.device) {
        /* Checked in a child when it names CUDA: this process forks the
         * ranks, and a process that has initialised CUDA cannot give it
         * to its children. */
        tdm_status dst = tdm_tool_parse_devices(&cfg.dl, cfg.device, 1);
        if (dst != TDM_STATUS_OK) {
            fprintf(stderr, "tandem bench: --device: %s\n", tdm_error_message());
            return dst == TDM_STATUS_NO_DEVICE ? 1 : 2;
        }
        cfg.cuda = cfg.dl.kind == TDM_DEVICE_CUDA;
    }
    if (cfg.cuda) {
        if (nranks_set && cfg.nranks != cfg.dl.count) {
            fprintf(stderr, "tandem bench: -n %d: --device %s names %d device%s, and there is "
                    "one rank per device (omit -n, or list %d devices)\n", cfg.nranks,
                    cfg.device, cfg.dl.count, cfg.dl.count == 1 ? "" : "s", cfg.nranks);
            return 2;
        }
        if (cfg.dl.count > TDM_SHM_MAX_RANKS) {
            fprintf(stderr, "tandem bench: --device %s names %d devices; at most %d ranks\n",
                    cfg.device, cfg.dl.count, TDM_SHM_MAX_RANKS);
            return 2;
        }
        cfg.nranks = cfg.dl.count;
        if (shm_only) {
            fprintf(stderr, "tandem bench: %s applies to the shm communicator only, not to "
                    "--device %s (NCCL on device buffers)\n", shm_flag, cfg.device);
            return 2;
        }
        if (cfg.dtype == TDM_DTYPE_BFLOAT16 || cfg.dtype == TDM_DTYPE_FLOAT16) {
            fprintf(stderr, "tandem bench: -d %s: the NCCL communicator of --device %s takes "
                    "float32, float64, int32 and int64 only\n", tdm_dtype_name(cfg.dtype),
                    cfg.device);
            return 2;
        }
    }
    if (cfg.min_bytes == 0 || cfg.min_bytes > cfg.max_bytes) {
        fprintf(stderr, "tandem bench: need 0 < -b (%zu) <= -e (%zu)\n", cfg.min_bytes,
                cfg.max_bytes);
        return 2;
    }
    /* under a launcher the job's size is known once it has started */
    int launched = tdm_tool_mpi_launched();
    if (launched && !nranks_set) cfg.nranks = 0;
    if (cfg.nranks && !tdm_tool_bench_check_ranks(&cfg, 1)) return 2;
    if (!cfg.memcpy_bytes)
        cfg.memcpy_bytes = cfg.max_bytes > ((size_t)64 << 20) ? cfg.max_bytes : (size_t)64 << 20;
    /* an MPI job: under a launcher, or asked for a backend that needs one */
    int mpi_needed = cfg.peer || getenv(TDM_MPI_ENV_PRETEND);
    for (int i = 0; i < cfg.nbackends; i++)
        mpi_needed |= cfg.backends[i] != TDM_MPI_BACKEND_SHM &&
                      cfg.backends[i] != TDM_MPI_BACKEND_AUTO;
    cfg.table = cfg.nbackends > 1 || cfg.peer;
    if (mpi_needed || launched) {
        if (cfg.zero_copy) {
            fprintf(stderr, "tandem bench: --zero-copy applies to forked ranks over shm only, not "
                    "to an MPI job\n");
            return 2;
        }
        return tdm_tool_bench_mpi(&cfg, argc, argv);
    }
    bench_bufs b;
    bench_counts(&cfg, cfg.max_bytes, &b);
    tdm_shm_spawn_opts o = {.timeout_ms = 3600 * 1000};
    o.shm.timeout_ms = 120000;
    o.shm.slot_bytes = cfg.slot_bytes;
    o.shm.one_shot_max_bytes = cfg.one_shot_bytes;
    if (cfg.zero_copy)
        o.shm.arena_bytes = (b.send_count + b.recv_count + 64) * tdm_dtype_size(cfg.dtype) + 4096;
    tdm_status st = tdm_shm_spawn(cfg.nranks, bench_rank, &cfg, &o, NULL);
    if (st) {
        fprintf(stderr, "tandem bench: %s\n", tdm_error_message());
        return 1;
    }
    return 0;
}
