/* tools/bench_coll.c: `tandem bench <collective>`, the collective
 * benchmark, with the columns of nccl-tests (size, count, type, redop,
 * root, time, algbw, busbw, #wrong, out of place and in place) plus the
 * algorithm each row used and its bus bandwidth as a fraction of a copy
 * bandwidth measured in the same run: on host devices the shm
 * communicator against memcpy with the same number of processes copying
 * at once; with --device cuda one rank per GPU, the NCCL communicator
 * (bootstrapped over shm) on device buffers against a device-to-device
 * copy on every GPU at once. Under TANDEM_CUDA_EMULATOR the CUDA path
 * runs on emulated devices and reduces over shm. With --backend or
 * --peer, or under mpirun/srun, the ranks are an MPI job's
 * (tools/bench_mpi.c) and the same loop measures each backend in turn.
 * In the order it runs: parse, check the options, fork the ranks (or the
 * MPI job); in a rank: set-up, preamble, one size after another, summary.
 * Not a test: correctness is checked once per size (#wrong), but the
 * tests are in tests/test_shm_*.c and tests/test_cuda.c. */
#include <sched.h>
#include <stdint.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/timer.h"
#include "dist/mpi_job.h"
#include "dist/run.h"
#include "mpi/mpi_weak.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tools/args.h"
#include "tools/bench_check.h"
#include "tools/bench_coll.h"
#include "tools/devices.h"
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

static tdm_status bench_parse_size(const char *flag, const char *s, size_t *out)
{
    if (!s || !*s) return tdm_tool_usage_error("tandem bench: %s needs a value\n", flag);
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
    if (errno == ERANGE || v > (1ull << 40) / mul)
        return tdm_tool_usage_error("tandem bench: %s: '%s' is larger than 1 TiB\n", flag, s);
    *out = (size_t)(v * mul);
    return TDM_STATUS_OK;
bad:
    return tdm_tool_usage_error("tandem bench: %s: '%s' is not a size (e.g. 8, 4K, 16M, 1G)\n",
                                flag, s);
}

/* A size flag whose 0 would silently mean "the default": refused with the
 * rule instead. */
static tdm_status bench_parse_size_min(const char *flag, const char *s, size_t lo, size_t hi,
                                       size_t *out)
{
    TDM_CHECK(bench_parse_size(flag, s, out));
    if (*out < lo || *out > hi)
        return tdm_tool_usage_error("tandem bench: %s %s: expected a size from %zu to %zu bytes "
                                    "(leave it out for the default)\n", flag, s, lo, hi);
    return TDM_STATUS_OK;
}

tdm_status tdm_tool_bench_check_ranks(const bench_cfg *cfg, int say)
{
    if (cfg->root >= cfg->nranks) {
        if (say)
            fprintf(stderr, "tandem bench: -r %d: root must be below -n %d (the number of "
                    "ranks)\n", cfg->root, cfg->nranks);
        return TDM_STATUS_USAGE;
    }
    size_t es = tdm_dtype_size(cfg->dtype);
    size_t unit = es * (cfg->coll == TDM_COLL_REDUCE_SCATTER || cfg->coll == TDM_COLL_ALL_GATHER
                            ? (size_t)cfg->nranks : 1);
    if (cfg->min_bytes < unit) {
        if (say)
            fprintf(stderr, "tandem bench: -b %zu: smallest size for %s of %s over %d ranks is "
                    "%zu bytes\n", cfg->min_bytes, tdm_coll_name(cfg->coll),
                    tdm_dtype_name(cfg->dtype), cfg->nranks, unit);
        return TDM_STATUS_USAGE;
    }
    return TDM_STATUS_OK;
}

/* --backend shm,mpi,hier: each once, in the order given. */
static tdm_status bench_parse_backends(const char *v, bench_cfg *cfg)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    cfg->nbackends = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        tdm_mpi_backend b;
        if (tdm_dist_backend_parse(tok, &b))
            return tdm_tool_usage_error("tandem bench: %s\n", tdm_error_message());
        for (int i = 0; i < cfg->nbackends; i++)
            if (cfg->backends[i] == b)
                return tdm_tool_usage_error("tandem bench: --backend '%s' names %s twice\n", v,
                                            tok);
        if (cfg->nbackends == TDM_MPI_BACKEND_COUNT_) return TDM_STATUS_USAGE;
        cfg->backends[cfg->nbackends++] = b;
    }
    if (!cfg->nbackends)
        return tdm_tool_usage_error("tandem bench: --backend needs a list (shm, mpi, hier, "
                                    "auto)\n");
    return TDM_STATUS_OK;
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
        if ((*st = tdm_dev_copy_from_host(b->dev, send, b->stage, b->send_count * es)))
            return 0;
    } else {
        bench_fill(cfg, b, send, r);
    }
    *st = bench_call(t, cfg, b, inplace);
    if (*st) return 0;
    const unsigned char *out = recv;
    if (b->dev && !(cfg->coll == TDM_COLL_REDUCE && r != cfg->root)) {
        size_t out_count = cfg->coll == TDM_COLL_ALL_GATHER ? b->recv_count : b->count;
        if ((*st = tdm_dev_copy_to_host(b->dev, b->stage, out, out_count * es))) return 0;
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

/* GB/s one device copies device-to-device (tdm_dev_copy, the bytes
 * copied per second, as for memcpy) while every rank's device copies at
 * once: the CUDA counterpart of bench_memcpy. */
static tdm_status bench_d2d(tdm_comm *ctl, tdm_device *dev, size_t bytes, double *gbs)
{
    tdm_status st = TDM_STATUS_OK;
    void *src = NULL, *dst = NULL;
    TDM_TRY(tdm_dev_alloc(dev, bytes, &src));
    TDM_TRY(tdm_dev_alloc(dev, bytes, &dst));
    TDM_TRY(tdm_dev_memset_zero(dev, src, bytes));
    TDM_TRY(tdm_dev_copy(dev, dst, src, bytes));
    /* about 1 GiB in all: a GPU copies 64 MiB in tens of microseconds */
    int reps = bytes >= (1u << 30) ? 3 : (int)(((size_t)1 << 30) / (bytes ? bytes : 1)) + 1;
    TDM_TRY(tdm_dev_sync(dev));
    TDM_TRY(tdm_comm_barrier(ctl));
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < reps; i++) TDM_TRY(tdm_dev_copy(dev, dst, src, bytes));
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
    const char *colon = strchr(tdm_dev_name(dev0), ':');
    int kind_len = colon ? (int)(colon - tdm_dev_name(dev0)) : (int)strlen(tdm_dev_name(dev0));
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < cfg->nranks && used < len; i++) {
        int k = snprintf(out + used, len - used, "%s%.*s:%d", i ? "," : "", kind_len,
                         tdm_dev_name(dev0), cfg->dl.index[i]);
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
        printf("  %10zu %11zu %8s %5s %4d | %9.3f %7.2f %7.2f %6lld | %9.3f %7.2f %7.2f %6lld "
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
    printf("  %10zu %11zu %8s %5s %4d | %-7s | %9.3f %7.2f %7.2f %6lld | %9.3f %7.2f %7.2f %6lld "
           "| %-30s %-20s%s\n", size, size / es, tdm_dtype_name(cfg->dtype),
           tdm_redop_name(cfg->op), root, t->name, w->us[0], w->algbw[0], w->busbw[0],
           (long long)w->wrong[0], w->us[1], w->algbw[1], w->busbw[1], (long long)w->wrong[1],
           w->algo, refs, ratio);
}

/* One rank's buffers and references, from set-up to the summary. */
typedef struct bench_state {
    const bench_cfg *cfg;
    tdm_comm *ctl;               /* barriers, time reductions, aborts */
    bench_target *targets;
    int ntargets;
    int r, n, bound;
    bench_bufs b;
    tdm_device *dev;             /* CUDA ranks */
    tdm_comm *nccl;              /* GPUs: targets[0], bootstrapped over ctl */
    size_t send_bytes, recv_bytes;
    double mcpy;                 /* the reference, GB/s per rank */
    bench_row *rows_now;         /* this size's row of each target */
    const bench_row *peer_row;   /* the peer's, when one is measured */
    double *sum_busbw;
    int rows;
    int64_t total_wrong;
} bench_state;

/* A CUDA rank: its device, its NCCL communicator (collective over ctl: a
 * rank failing before it aborts ctl, so the others fail at once too),
 * device buffers and the host stage, and the d2d reference. */
static tdm_status bench_setup_cuda(bench_state *s)
{
    tdm_status st;
    const bench_cfg *cfg = s->cfg;
    TDM_CHECK(tdm_device_open(&s->dev, "cuda", cfg->dl.index[s->r], 1));
    TDM_CHECK(tdm_dist_gpu_comm(s->ctl, s->dev, &s->nccl));
    if (s->nccl) s->targets[0].comm = s->nccl;
    tdm_device *dev = s->dev;
    s->b.dev = dev;
    if ((st = tdm_dev_alloc(dev, s->send_bytes, (void **)&s->b.send)) ||
        (st = tdm_dev_alloc(dev, s->recv_bytes, (void **)&s->b.recv)) ||
        (st = tdm_dev_memset_zero(dev, s->b.send, s->send_bytes)) ||
        (st = tdm_dev_memset_zero(dev, s->b.recv, s->recv_bytes)))
        return st;
    size_t stage = s->send_bytes > s->recv_bytes ? s->send_bytes : s->recv_bytes;
    s->b.stage = malloc(stage);
    if (!s->b.stage)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "host staging buffer of %zu bytes", stage);
    return bench_d2d(s->ctl, dev, cfg->memcpy_bytes, &s->mcpy);
}

/* A host rank: the memcpy reference, then private or zero-copy buffers. */
static tdm_status bench_setup_host(bench_state *s)
{
    const bench_cfg *cfg = s->cfg;
    TDM_CHECK(bench_memcpy(s->ctl, cfg->memcpy_bytes, &s->mcpy));
    if (cfg->zero_copy) {
        TDM_CHECK(tdm_shm_comm_alloc(s->targets[0].comm, s->send_bytes, (void **)&s->b.send));
        TDM_CHECK(tdm_shm_comm_alloc(s->targets[0].comm, s->recv_bytes, (void **)&s->b.recv));
    } else {
        s->b.send = malloc(s->send_bytes);
        s->b.recv = malloc(s->recv_bytes);
        if (!s->b.send || !s->b.recv)
            return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate the send and receive "
                                 "buffers (%zu + %zu bytes)", s->send_bytes, s->recv_bytes);
    }
    memset(s->b.send, 0, s->send_bytes);
    memset(s->b.recv, 0, s->recv_bytes);
    return TDM_STATUS_OK;
}

/* Rank 0's lines before the table: the run, the reference, the columns. */
static void bench_print_preamble(const bench_state *s, const char *ref)
{
    const bench_cfg *cfg = s->cfg;
    int n = s->n, ncores = cfg->host_cores;
    if (cfg->cuda) {
        char names[512];
        bench_device_names(cfg, s->dev, names, sizeof names);
        printf("# tandem bench %s: %d ranks, one per device of --device %s (%s), %s "
               "communicator, %s, %s, root %d, warmup %d, iters %d, device buffers "
               "(tdm_dev_alloc)\n", tdm_coll_name(cfg->coll), n, cfg->device, names,
               tdm_comm_backend_name(s->targets[0].comm), tdm_dtype_name(cfg->dtype),
               tdm_redop_name(cfg->op), cfg->root, cfg->warmup, cfg->iters);
        tdm_tool_print_emulated(stdout, cfg->device);
        printf("# d2d reference: %d device%s each copying %zu bytes device-to-device at "
               "once: %.2f GB/s per device (%.2f GB/s total)\n", n, n == 1 ? "" : "s",
               cfg->memcpy_bytes, s->mcpy, s->mcpy * n);
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
                   s->bound ? ", rank r pinned to core r" : ", not pinned",
                   tdm_dtype_name(cfg->dtype), tdm_redop_name(cfg->op), cfg->root,
                   cfg->warmup, cfg->iters,
                   cfg->zero_copy ? "zero-copy (in the segment)" : "private (malloc)");
        printf("# memcpy reference: %d processes each copying %zu bytes at once: %.2f GB/s "
               "per process (%.2f GB/s total)\n", n, cfg->memcpy_bytes, s->mcpy, s->mcpy * n);
        if (s->peer_row)
            printf("# vs-MPI: Open MPI's own blocking collective (the mpi-own rows) measured "
                   "in the same run, its time over each backend's (> 1: faster than it)\n");
    }
    bench_print_header(cfg, ref);
    fflush(stdout);
}

/* One size: every target, out of place and in place, timed then checked;
 * rank 0 prints the rows. Every target at this size before the next
 * size: a load that comes and goes hits them alike. */
static tdm_status bench_size(bench_state *s, size_t bytes)
{
    const bench_cfg *cfg = s->cfg;
    tdm_status st = TDM_STATUS_OK;
    size_t es = tdm_dtype_size(cfg->dtype);
    double factor = bench_bus_factor(cfg->coll, s->n);
    bench_counts(cfg, bytes, &s->b);
    size_t size = (cfg->coll == TDM_COLL_REDUCE_SCATTER ? s->b.send_count : s->b.recv_count) * es;
    for (int t = 0; t < s->ntargets; t++) {
        bench_row *w = &s->rows_now[t];
        const char *algo[2];
        for (int ip = 0; ip < 2; ip++) {
            TDM_CHECK(bench_time(&s->targets[t], s->ctl, cfg, &s->b, ip, &w->us[ip]));
            int64_t wr = bench_check(&s->targets[t], cfg, &s->b, ip, &st);
            algo[ip] = tdm_comm_last_algo(s->targets[t].comm);
            TDM_CHECK(st);
            TDM_CHECK(tdm_comm_all_reduce(s->ctl, &wr, &w->wrong[ip], 1, TDM_DTYPE_INT64,
                                          TDM_REDOP_SUM));
            w->algbw[ip] = (double)size / (w->us[ip] * 1e3);
            w->busbw[ip] = w->algbw[ip] * factor;
            s->total_wrong += w->wrong[ip];
        }
        if (strcmp(algo[0], algo[1]))
            snprintf(w->algo, sizeof w->algo, "%s/%s", algo[0], algo[1]);
        else
            snprintf(w->algo, sizeof w->algo, "%s", algo[0]);
        s->sum_busbw[t] += w->busbw[0];
    }
    if (s->r == 0) {
        for (int t = 0; t < s->ntargets; t++)
            bench_print_row(cfg, &s->targets[t], &s->rows_now[t], s->peer_row, size, s->mcpy);
        fflush(stdout);
    }
    s->rows++;
    return TDM_STATUS_OK;
}

static void bench_print_summary(const bench_state *s, const char *ref)
{
    const bench_cfg *cfg = s->cfg;
    printf("# Out of bounds values : %lld %s\n", (long long)s->total_wrong,
           s->total_wrong ? "FAILED" : "OK");
    for (int t = 0; t < s->ntargets; t++)
        printf("# Avg bus bandwidth    : %.4f GB/s (out of place; %s reference %.2f GB/s)%s%s\n",
               s->rows ? s->sum_busbw[t] / s->rows : 0.0, ref, s->mcpy, cfg->table ? ": " : "",
               cfg->table ? s->targets[t].name : "");
    fflush(stdout);
}

static void bench_state_free(bench_state *s)
{
    if (s->dev) {
        tdm_dev_free(s->dev, s->b.send);
        tdm_dev_free(s->dev, s->b.recv);
        free(s->b.stage);
    } else if (!s->cfg->zero_copy) {
        free(s->b.send);
        free(s->b.recv);
    }
    tdm_comm_free(s->nccl);   /* before ctl, which bootstrapped it, and dev */
    tdm_device_free(s->dev);
    free(s->rows_now);
    free(s->sum_busbw);
}

int tdm_tool_bench_ranks(tdm_comm *ctl, bench_target *targets, int ntargets,
                         const bench_cfg *cfg)
{
    bench_state s = {.cfg = cfg, .ctl = ctl, .targets = targets, .ntargets = ntargets,
                     .r = tdm_comm_rank(ctl), .n = tdm_comm_size(ctl)};
    /* an MPI launcher binds its ranks itself */
    s.bound = cfg->bind && !cfg->cuda && !cfg->job_desc ? bench_bind(s.r, s.n) : 0;
    size_t es = tdm_dtype_size(cfg->dtype);
    tdm_status st = TDM_STATUS_OK;
    s.rows_now = calloc((size_t)ntargets, sizeof *s.rows_now);
    s.sum_busbw = calloc((size_t)ntargets, sizeof *s.sum_busbw);
    bench_counts(cfg, cfg->max_bytes, &s.b);
    s.send_bytes = (s.b.send_count + 16) * es;
    s.recv_bytes = (s.b.recv_count + 16) * es;
    if (!s.rows_now || !s.sum_busbw) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "bench: calloc");
        goto fail;
    }
    TDM_TRY(cfg->cuda ? bench_setup_cuda(&s) : bench_setup_host(&s));
    const char *ref = cfg->cuda ? "d2d" : "memcpy";
    for (int t = 0; t < ntargets; t++)
        if (targets[t].peer) s.peer_row = &s.rows_now[t];
    if (s.r == 0) bench_print_preamble(&s, ref);
    for (size_t bytes = cfg->min_bytes; bytes <= cfg->max_bytes;) {
        TDM_TRY(bench_size(&s, bytes));
        size_t next = (size_t)((double)bytes * cfg->factor);
        bytes = next > bytes ? next : bytes + 1;
    }
    if (s.r == 0) bench_print_summary(&s, ref);
    bench_state_free(&s);
    return s.total_wrong ? 1 : 0;
fail:
    fprintf(stderr, "tandem bench: rank %d: %s\n", s.r,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    char why[64];
    snprintf(why, sizeof why, "rank %d failed", s.r);
    tdm_comm_abort(ctl, why);
    bench_state_free(&s);
    return 1;
}

/* ---- options ---- */

static tdm_status bench_parse_coll(const char *a, bench_cfg *cfg)
{
    if (tdm_coll_parse(a, &cfg->coll) || cfg->coll == TDM_COLL_GATHER ||
        cfg->coll == TDM_COLL_SCATTER || cfg->coll == TDM_COLL_BARRIER ||
        cfg->coll == TDM_COLL_SEND || cfg->coll == TDM_COLL_RECV)
        return tdm_tool_usage_error("tandem bench: unknown collective '%s' (expected all_reduce, "
                                    "reduce_scatter, all_gather, broadcast or reduce)\n", a);
    return TDM_STATUS_OK;
}

/* The options as given; cfg->help when --help asked for the usage. */
static tdm_status bench_parse(int argc, char **argv, bench_cfg *cfg)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long long x;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            cfg->help = 1;
            return TDM_STATUS_OK;
        }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-n", "--nranks", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("-n", v, 1, TDM_SHM_MAX_RANKS, &x));
            cfg->nranks = (int)x;
            cfg->nranks_set = 1;
            continue;
        }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-b", "--minbytes", &v));
        if (v) { TDM_CHECK(bench_parse_size("-b", v, &cfg->min_bytes)); continue; }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-e", "--maxbytes", &v));
        if (v) { TDM_CHECK(bench_parse_size("-e", v, &cfg->max_bytes)); continue; }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-f", "--stepfactor", &v));
        if (v) { TDM_CHECK(tdm_args_float("-f", v, 1.0001, 1e6, &cfg->factor)); continue; }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-d", "--datatype", &v));
        if (v) {
            if (tdm_dtype_parse(v, &cfg->dtype))
                return tdm_tool_usage_error("tandem bench: -d: %s\n", tdm_error_message());
            continue;
        }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-o", "--op", &v));
        if (v) {
            if (tdm_redop_parse(v, &cfg->op))
                return tdm_tool_usage_error("tandem bench: -o: %s\n", tdm_error_message());
            continue;
        }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-r", "--root", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("-r", v, 0, TDM_SHM_MAX_RANKS - 1, &x));
            cfg->root = (int)x;
            continue;
        }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-w", "--warmup", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("-w", v, 0, 1000000, &x));
            cfg->warmup = (int)x;
            continue;
        }
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-i", "--iters", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("-i", v, 1, 100000000, &x));
            cfg->iters = (int)x;
            continue;
        }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--memcpy-bytes", &v));
        if (v) {
            TDM_CHECK(bench_parse_size_min("--memcpy-bytes", v, 1, (size_t)1 << 40,
                                           &cfg->memcpy_bytes));
            continue;
        }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--slot-bytes", &v));
        if (v) {
            /* shm's bounds (shm/segment.c): a slot holds at least a page */
            TDM_CHECK(bench_parse_size_min("--slot-bytes", v, 4096, (size_t)1 << 30,
                                           &cfg->slot_bytes));
            cfg->shm_flag = "--slot-bytes";
            continue;
        }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--one-shot-bytes", &v));
        if (v) {
            TDM_CHECK(bench_parse_size_min("--one-shot-bytes", v, 1, (size_t)1 << 30,
                                           &cfg->one_shot_bytes));
            cfg->shm_flag = "--one-shot-bytes";
            continue;
        }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--device", &v));
        if (v) { cfg->device = v; continue; }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--backend", &v));
        if (v) { TDM_CHECK(bench_parse_backends(v, cfg)); continue; }
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--peer", &v));
        if (v) {
            if (strcmp(v, "mpi"))
                return tdm_tool_usage_error("tandem bench: --peer '%s': the only peer is mpi "
                                            "(Open MPI's own collectives)\n", v);
            cfg->peer = 1;
            continue;
        }
        if (!strcmp(a, "--no-bind")) {
            cfg->bind = 0;
        } else if (!strcmp(a, "--zero-copy")) {
            cfg->zero_copy = 1;
            cfg->shm_flag = "--zero-copy";
        } else if (a[0] == '-') {
            return tdm_tool_usage_error("tandem bench: unknown option '%s' (see tandem bench "
                                        "--help)\n", a);
        } else if (!cfg->have_coll) {
            TDM_CHECK(bench_parse_coll(a, cfg));
            cfg->have_coll = 1;
        } else {
            return tdm_tool_usage_error("tandem bench: unexpected argument '%s'\n", a);
        }
    }
    return TDM_STATUS_OK;
}

/* --device cuda: one rank per listed device, NCCL on device buffers. */
static tdm_status bench_check_cuda(bench_cfg *cfg)
{
    if (cfg->nranks_set && cfg->nranks != cfg->dl.count)
        return tdm_tool_usage_error("tandem bench: -n %d: --device %s names %d device%s, and "
                                    "there is one rank per device (omit -n, or list %d "
                                    "devices)\n", cfg->nranks, cfg->device, cfg->dl.count,
                                    cfg->dl.count == 1 ? "" : "s", cfg->nranks);
    if (cfg->dl.count > TDM_SHM_MAX_RANKS)
        return tdm_tool_usage_error("tandem bench: --device %s names %d devices; at most %d "
                                    "ranks\n", cfg->device, cfg->dl.count, TDM_SHM_MAX_RANKS);
    cfg->nranks = cfg->dl.count;
    if (cfg->shm_flag)
        return tdm_tool_usage_error("tandem bench: %s applies to the shm communicator only, "
                                    "not to --device %s (NCCL on device buffers)\n",
                                    cfg->shm_flag, cfg->device);
    if (cfg->dtype == TDM_DTYPE_BFLOAT16 || cfg->dtype == TDM_DTYPE_FLOAT16)
        return tdm_tool_usage_error("tandem bench: -d %s: the NCCL communicator of --device %s "
                                    "takes float32, float64, int32 and int64 only\n",
                                    tdm_dtype_name(cfg->dtype), cfg->device);
    return TDM_STATUS_OK;
}

/* What the options need of each other, and the defaults that follow. */
static tdm_status bench_check_cfg(bench_cfg *cfg)
{
    if (!cfg->have_coll) {
        fprintf(stderr, "tandem bench: which collective? (see tandem bench --help)\n");
        bench_usage(stderr);
        return TDM_STATUS_USAGE;
    }
    if (cfg->device && *cfg->device) {
        /* Checked in a child when it names CUDA: this process forks the
         * ranks, and a process that has initialised CUDA cannot give it
         * to its children. */
        tdm_status dst = tdm_dist_parse_devices(&cfg->dl, cfg->device, 1);
        if (dst != TDM_STATUS_OK) {
            fprintf(stderr, "tandem bench: --device: %s\n", tdm_error_message());
            return dst == TDM_STATUS_NO_DEVICE ? dst : tdm_tool_usage(dst);
        }
        cfg->cuda = cfg->dl.kind == TDM_DEVICE_CUDA;
    }
    if (cfg->cuda) TDM_CHECK(bench_check_cuda(cfg));
    if (cfg->min_bytes == 0 || cfg->min_bytes > cfg->max_bytes)
        return tdm_tool_usage_error("tandem bench: need 0 < -b (%zu) <= -e (%zu)\n",
                                    cfg->min_bytes, cfg->max_bytes);
    /* under a launcher the job's size is known once it has started */
    if (tdm_dist_mpi_launched() && !cfg->nranks_set) cfg->nranks = 0;
    if (cfg->nranks) TDM_CHECK(tdm_tool_bench_check_ranks(cfg, 1));
    if (!cfg->memcpy_bytes)
        cfg->memcpy_bytes = cfg->max_bytes > ((size_t)64 << 20) ? cfg->max_bytes
                                                                : (size_t)64 << 20;
    return TDM_STATUS_OK;
}

/* A forked rank: its shm communicator is the one benchmarked. */
static int bench_rank(tdm_comm *comm, void *arg)
{
    bench_target t = {.name = "shm", .comm = comm};
    return tdm_tool_bench_ranks(comm, &t, 1, arg);
}

/* Forks the ranks joined by a shm communicator sized for the buffers. */
static tdm_status bench_run_forked(const bench_cfg *cfg)
{
    size_t es = tdm_dtype_size(cfg->dtype);
    bench_bufs b;
    bench_counts(cfg, cfg->max_bytes, &b);
    tdm_shm_spawn_opts o = {.timeout_ms = 3600 * 1000};
    o.shm.timeout_ms = 120000;
    o.shm.slot_bytes = cfg->slot_bytes;
    o.shm.one_shot_max_bytes = cfg->one_shot_bytes;
    if (cfg->zero_copy) o.shm.arena_bytes = (b.send_count + b.recv_count + 64) * es + 4096;
    tdm_status st = tdm_shm_spawn(cfg->nranks, bench_rank, (void *)cfg, &o, NULL);
    if (st) fprintf(stderr, "tandem bench: %s\n", tdm_error_message());
    return st;
}

int bench_host_cores(void)
{
    const char *v = getenv(TDM_BENCH_CORES_ENV);
    int n = v ? atoi(v) : 0;
    if (n > 0) return n;
    if (tdm_dist_mpi_launched()) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        if (online > 0) return (int)online;
    }
    return tdm_device_host_cores();
}

int tdm_bench_coll_main(int argc, char **argv)
{
    bench_cfg cfg = {.nranks = 2, .min_bytes = 8, .max_bytes = (size_t)64 << 20, .factor = 2,
                     .dtype = TDM_DTYPE_FLOAT32, .op = TDM_REDOP_SUM, .warmup = 5, .iters = 20,
                     .bind = 1, .host_cores = bench_host_cores()};
    tdm_status st = bench_parse(argc, argv, &cfg);
    if (st == TDM_STATUS_OK && cfg.help) {
        bench_usage(stdout);
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK) st = bench_check_cfg(&cfg);
    if (st != TDM_STATUS_OK) return tdm_tool_exit(st);
    /* an MPI job: under a launcher, or asked for a backend that needs one */
    int mpi_needed = cfg.peer || getenv(TDM_MPI_ENV_PRETEND);
    for (int i = 0; i < cfg.nbackends; i++)
        mpi_needed |= cfg.backends[i] != TDM_MPI_BACKEND_SHM &&
                      cfg.backends[i] != TDM_MPI_BACKEND_AUTO;
    cfg.table = cfg.nbackends > 1 || cfg.peer;
    if (mpi_needed || tdm_dist_mpi_launched()) {
        if (cfg.zero_copy)
            return tdm_tool_exit(tdm_tool_usage_error(
                "tandem bench: --zero-copy applies to forked ranks over shm only, not to an MPI "
                "job\n"));
        return tdm_tool_exit(tdm_tool_bench_mpi(&cfg, argc, argv));
    }
    return tdm_tool_exit(bench_run_forked(&cfg));
}
