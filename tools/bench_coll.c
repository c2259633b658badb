/* tools/bench_coll.c: `tandem bench <collective>`, the collective
 * benchmark of the shm communicator, with the columns of nccl-tests
 * (size, count, type, redop, root, time, algbw, busbw, #wrong, out of
 * place and in place) plus the algorithm each row used and its bus
 * bandwidth as a fraction of the machine's memcpy bandwidth with the same
 * number of processes copying at once (measured in the same run).
 * Not a test: correctness is checked once per size (#wrong), but the
 * tests are in tests/test_shm_*.c. */
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
#include "tools/tools.h"

typedef struct bench_cfg {
    tdm_coll coll;
    int nranks;
    size_t min_bytes, max_bytes;
    double factor;
    tdm_dtype dtype;
    tdm_redop op;
    int root;
    int warmup, iters;
    int zero_copy;
    size_t memcpy_bytes;
    size_t slot_bytes;
    size_t one_shot_bytes;
    int bind;
} bench_cfg;

static void bench_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem bench <collective> [options]\n"
        "  collective: all_reduce | reduce_scatter | all_gather | broadcast | reduce\n"
        "Forks RANKS processes joined by a shared-memory communicator and sweeps message\n"
        "sizes from MIN to MAX (multiplying by FACTOR), printing the nccl-tests columns:\n"
        "size (bytes of the largest buffer), count (its elements), type, redop, root,\n"
        "then out-of-place and in-place time (us, slowest rank's mean), algbw = size/time\n"
        "and busbw = algbw * factor (all_reduce 2(n-1)/n; reduce_scatter and all_gather\n"
        "(n-1)/n; broadcast and reduce 1) in GB/s (1e9 bytes/s), #wrong (elements differing\n"
        "from the exact reference, summed over ranks), the algorithm used, and busbw as a\n"
        "fraction of the memcpy bandwidth of one process while RANKS processes copy at once\n"
        "(measured first, in the same run). Ends with the average busbw (out of place).\n"
        "options:\n"
        "  -n, --nranks N       ranks (processes), 1..%d (default 2)\n"
        "  -b, --minbytes SIZE  smallest size, e.g. 8, 4K, 1M (default 8)\n"
        "  -e, --maxbytes SIZE  largest size (default 64M)\n"
        "  -f, --stepfactor F   size multiplier per row, > 1 (default 2)\n"
        "  -d, --datatype T     float|float32|double|float64|int32|int64|bf16|fp16\n"
        "                       (default float; bf16/fp16 are reduced in float32)\n"
        "  -o, --op OP          sum|prod|min|max|avg (default sum)\n"
        "  -r, --root R         root of broadcast/reduce (default 0)\n"
        "  -w, --warmup N       untimed iterations per size (default 5)\n"
        "  -i, --iters N        timed iterations per size (default 20)\n"
        "  --device cpu         the shm communicator between host processes (the only\n"
        "                       one benchmarked here; --device cuda is refused: use\n"
        "                       nccl-tests' all_reduce_perf for NCCL)\n"
        "  --zero-copy          buffers live in the shared segment (tdm_shm_comm_alloc);\n"
        "                       in-place all_reduce then reads peers' buffers directly\n"
        "  --no-bind            do not pin rank r to the r-th allowed core (pinning, as\n"
        "                       mpirun does, is the default when ranks <= cores)\n"
        "  --slot-bytes SIZE    staging buffer per rank (default 1M; two per rank)\n"
        "  --one-shot-bytes SIZE  all_reduce/reduce up to SIZE use one-shot (default 4K)\n"
        "  --memcpy-bytes SIZE  bytes each process copies for the memcpy reference\n"
        "                       (default: max(MAX, 64M))\n"
        "exit status: 0 ok, 1 runtime failure or #wrong > 0, 2 usage error.\n"
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

static double bench_bus_factor(tdm_coll c, int n)
{
    switch (c) {
    case TDM_COLL_ALL_REDUCE: return 2.0 * (n - 1) / n;
    case TDM_COLL_REDUCE_SCATTER: case TDM_COLL_ALL_GATHER: return (double)(n - 1) / n;
    default: return 1.0;
    }
}

/* Reference values: small integers, exact in every dtype (as in tests). */
static int64_t bench_val(size_t j, int r, tdm_redop op)
{
    switch (op) {
    case TDM_REDOP_PROD: return (j + (size_t)r) % 3 == 0 ? 2 : 1;
    case TDM_REDOP_MIN: case TDM_REDOP_MAX: return (int64_t)((j * 31 + (size_t)r * 17) % 101) - 50;
    default: return (int64_t)((j * 7 + (size_t)r * 3) % 17) - 8;
    }
}

static int64_t bench_ref(size_t j, int n, tdm_redop op)
{
    int64_t acc = bench_val(j, 0, op);
    for (int r = 1; r < n; r++) {
        int64_t x = bench_val(j, r, op);
        if (op == TDM_REDOP_PROD) acc *= x;
        else if (op == TDM_REDOP_MIN) acc = x < acc ? x : acc;
        else if (op == TDM_REDOP_MAX) acc = x > acc ? x : acc;
        else acc += x;
    }
    return acc;
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

static int bench_equal(const void *b, size_t i, tdm_dtype dt, int64_t v, int avg_n)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32:
        return ((const float *)b)[i] == (avg_n ? (float)v / (float)avg_n : (float)v);
    case TDM_DTYPE_FLOAT64:
        return ((const double *)b)[i] == (avg_n ? (double)v / (double)avg_n : (double)v);
    case TDM_DTYPE_INT32:
        return ((const int32_t *)b)[i] == (int32_t)(avg_n ? v / avg_n : v);
    case TDM_DTYPE_BFLOAT16: case TDM_DTYPE_FLOAT16: {
        float want = avg_n ? (float)v / (float)avg_n : (float)v;
        return ((const uint16_t *)b)[i] == (dt == TDM_DTYPE_BFLOAT16 ? tdm_f32_to_bf16(want)
                                                                     : tdm_f32_to_f16(want));
    }
    default:
        return ((const int64_t *)b)[i] == (avg_n ? v / avg_n : v);
    }
}

typedef struct bench_bufs {
    unsigned char *send, *recv;
    size_t send_count, recv_count; /* elements */
    size_t count;                  /* the collective's count argument */
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
        bench_store(send, i, cfg->dtype, bench_val(i, r, cfg->op));
}

static tdm_status bench_call(tdm_comm *comm, const bench_cfg *cfg, const bench_bufs *b,
                             int inplace)
{
    int r = tdm_comm_rank(comm);
    size_t es = tdm_dtype_size(cfg->dtype);
    void *send = b->send, *recv = b->recv;
    if (inplace) {
        if (cfg->coll == TDM_COLL_REDUCE_SCATTER) recv = b->send + (size_t)r * b->count * es;
        else if (cfg->coll == TDM_COLL_ALL_GATHER) send = b->recv + (size_t)r * b->count * es;
        else recv = send;
    }
    tdm_comm_call k = {.coll = cfg->coll, .sendbuf = send, .recvbuf = recv, .count = b->count,
                       .dtype = cfg->dtype, .op = cfg->op, .root = cfg->root};
    return tdm_comm_run(comm, &k);
}

/* Runs once with reference inputs; returns the number of wrong elements. */
static int64_t bench_check(tdm_comm *comm, const bench_cfg *cfg, const bench_bufs *b,
                           int inplace, tdm_status *st)
{
    int r = tdm_comm_rank(comm), n = tdm_comm_size(comm);
    size_t es = tdm_dtype_size(cfg->dtype);
    void *send = b->send;
    if (inplace && cfg->coll == TDM_COLL_ALL_GATHER) send = b->recv + (size_t)r * b->count * es;
    bench_fill(cfg, b, send, r);
    *st = bench_call(comm, cfg, b, inplace);
    if (*st) return 0;
    const unsigned char *out = b->recv;
    if (inplace) {
        if (cfg->coll == TDM_COLL_REDUCE_SCATTER) out = b->send + (size_t)r * b->count * es;
        else if (cfg->coll != TDM_COLL_ALL_GATHER) out = b->send;
    }
    int64_t wrong = 0;
    int avg_n = cfg->op == TDM_REDOP_AVG ? n : 0;
    switch (cfg->coll) {
    case TDM_COLL_ALL_REDUCE:
        for (size_t i = 0; i < b->count; i++)
            wrong += !bench_equal(out, i, cfg->dtype, bench_ref(i, n, cfg->op), avg_n);
        break;
    case TDM_COLL_REDUCE:
        if (r == cfg->root)
            for (size_t i = 0; i < b->count; i++)
                wrong += !bench_equal(out, i, cfg->dtype, bench_ref(i, n, cfg->op), avg_n);
        break;
    case TDM_COLL_REDUCE_SCATTER:
        for (size_t i = 0; i < b->count; i++)
            wrong += !bench_equal(out, i, cfg->dtype,
                                  bench_ref((size_t)r * b->count + i, n, cfg->op), avg_n);
        break;
    case TDM_COLL_ALL_GATHER:
        for (size_t i = 0; i < b->recv_count; i++)
            wrong += !bench_equal(out, i, cfg->dtype,
                                  bench_val(i % b->count, (int)(i / b->count), cfg->op), 0);
        break;
    case TDM_COLL_BROADCAST:
        for (size_t i = 0; i < b->count; i++)
            wrong += !bench_equal(out, i, cfg->dtype, bench_val(i, cfg->root, cfg->op), 0);
        break;
    default: break;
    }
    return wrong;
}

/* Mean microseconds per call on this rank, then the slowest rank's. */
static tdm_status bench_time(tdm_comm *comm, const bench_cfg *cfg, const bench_bufs *b,
                             int inplace, double *us)
{
    for (int i = 0; i < cfg->warmup; i++) TDM_CHECK(bench_call(comm, cfg, b, inplace));
    TDM_CHECK(tdm_comm_barrier(comm));
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < cfg->iters; i++) TDM_CHECK(bench_call(comm, cfg, b, inplace));
    double mine = (double)(tdm_time_ns() - t0) / 1e3 / cfg->iters;
    return tdm_comm_all_reduce(comm, &mine, us, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_MAX);
}

/* GB/s one process copies while every rank copies at once. */
static tdm_status bench_memcpy(tdm_comm *comm, size_t bytes, double *gbs)
{
    tdm_status st = TDM_STATUS_OK;
    unsigned char *src = malloc(bytes), *dst = malloc(bytes);
    if (!src || !dst) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "memcpy reference: %zu bytes", bytes);
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

static int bench_rank(tdm_comm *comm, void *arg)
{
    const bench_cfg *cfg = arg;
    int r = tdm_comm_rank(comm), n = tdm_comm_size(comm);
    int ncores = tdm_shm_cpu_count();
    int bound = cfg->bind ? bench_bind(r, n) : 0;
    size_t es = tdm_dtype_size(cfg->dtype);
    int rc = 0;
    bench_bufs b = {0};
    bench_counts(cfg, cfg->max_bytes, &b);
    size_t send_bytes = (b.send_count + 16) * es, recv_bytes = (b.recv_count + 16) * es;
    double mcpy = 0;
    tdm_status st = bench_memcpy(comm, cfg->memcpy_bytes, &mcpy);
    if (st) goto fail;
    if (cfg->zero_copy) {
        if ((st = tdm_shm_comm_alloc(comm, send_bytes, (void **)&b.send))) goto fail;
        if ((st = tdm_shm_comm_alloc(comm, recv_bytes, (void **)&b.recv))) goto fail;
    } else {
        b.send = malloc(send_bytes);
        b.recv = malloc(recv_bytes);
        if (!b.send || !b.recv) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "buffers of %zu bytes", send_bytes);
            goto fail;
        }
    }
    memset(b.send, 0, send_bytes);
    memset(b.recv, 0, recv_bytes);
    double factor = bench_bus_factor(cfg->coll, n);
    if (r == 0) {
        printf("# tandem bench %s: %d ranks (shm, %d cores%s), %s, %s, root %d, warmup %d, "
               "iters %d, %s buffers\n", tdm_coll_name(cfg->coll), n, ncores,
               bound ? ", rank r pinned to core r" : ", not pinned",
               tdm_dtype_name(cfg->dtype), tdm_redop_name(cfg->op), cfg->root, cfg->warmup,
               cfg->iters, cfg->zero_copy ? "zero-copy (in the segment)" : "private (malloc)");
        printf("# memcpy reference: %d processes each copying %zu bytes at once: %.2f GB/s per "
               "process (%.2f GB/s total)\n", n, cfg->memcpy_bytes, mcpy, mcpy * n);
        printf("#\n# %10s %11s %8s %5s %4s | %9s %7s %7s %6s | %9s %7s %7s %6s | %-18s %s\n",
               "size(B)", "count", "type", "redop", "root", "oop us", "algbw", "busbw",
               "#wrong", "ip us", "algbw", "busbw", "#wrong", "algorithm(oop/ip)",
               "busbw/memcpy(oop,ip)");
        fflush(stdout);
    }
    double sum_busbw = 0;
    int rows = 0;
    int64_t total_wrong = 0;
    for (size_t bytes = cfg->min_bytes; bytes <= cfg->max_bytes;) {
        bench_counts(cfg, bytes, &b);
        double us[2], busbw[2], algbw[2];
        int64_t wrong[2];
        const char *algo[2];
        size_t size = (cfg->coll == TDM_COLL_REDUCE_SCATTER ? b.send_count : b.recv_count) * es;
        for (int ip = 0; ip < 2; ip++) {
            if ((st = bench_time(comm, cfg, &b, ip, &us[ip]))) goto fail;
            int64_t w = bench_check(comm, cfg, &b, ip, &st);
            algo[ip] = tdm_comm_last_algo(comm);
            if (st) goto fail;
            if ((st = tdm_comm_all_reduce(comm, &w, &wrong[ip], 1, TDM_DTYPE_INT64,
                                          TDM_REDOP_SUM)))
                goto fail;
            algbw[ip] = (double)size / (us[ip] * 1e3);
            busbw[ip] = algbw[ip] * factor;
            total_wrong += wrong[ip];
        }
        if (r == 0) {
            char alg[64];
            if (strcmp(algo[0], algo[1])) snprintf(alg, sizeof alg, "%s/%s", algo[0], algo[1]);
            else snprintf(alg, sizeof alg, "%s", algo[0]);
            printf("  %10zu %11zu %8s %5s %4d | %9.2f %7.2f %7.2f %6lld | %9.2f %7.2f %7.2f %6lld "
                   "| %-18s %.2f, %.2f\n", size, size / es, tdm_dtype_name(cfg->dtype),
                   tdm_redop_name(cfg->op),
                   cfg->coll == TDM_COLL_BROADCAST || cfg->coll == TDM_COLL_REDUCE ? cfg->root : -1,
                   us[0], algbw[0], busbw[0], (long long)wrong[0], us[1], algbw[1], busbw[1],
                   (long long)wrong[1], alg, busbw[0] / mcpy, busbw[1] / mcpy);
            fflush(stdout);
        }
        sum_busbw += busbw[0];
        rows++;
        size_t next = (size_t)((double)bytes * cfg->factor);
        bytes = next > bytes ? next : bytes + 1;
    }
    if (r == 0) {
        printf("# Out of bounds values : %lld %s\n", (long long)total_wrong,
               total_wrong ? "FAILED" : "OK");
        printf("# Avg bus bandwidth    : %.4f GB/s (out of place; memcpy reference %.2f GB/s)\n",
               rows ? sum_busbw / rows : 0.0, mcpy);
        fflush(stdout);
    }
    rc = total_wrong ? 1 : 0;
    goto out;
fail:
    fprintf(stderr, "tandem bench: rank %d: %s\n", r, tdm_error_message());
    rc = 1;
out:
    if (!cfg->zero_copy) {
        free(b.send);
        free(b.recv);
    }
    return rc;
}

int tdm_tool_bench_main(int argc, char **argv)
{
    bench_cfg cfg = {.nranks = 2, .min_bytes = 8, .max_bytes = (size_t)64 << 20, .factor = 2,
                     .dtype = TDM_DTYPE_FLOAT32, .op = TDM_REDOP_SUM, .warmup = 5, .iters = 20, .bind = 1};
    int have_coll = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long long x;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { bench_usage(stdout); return 0; }
#define BENCH_FLAG(s, l) ((v = tdm_args_value(argc, argv, &i, s)) || (v = tdm_args_value(argc, argv, &i, l)))
        if (BENCH_FLAG("-n", "--nranks")) {
            if (!tdm_args_int("-n", v, 1, TDM_SHM_MAX_RANKS, &x)) return 2;
            cfg.nranks = (int)x;
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
        } else if (BENCH_FLAG("--one-shot-bytes", "--one-shot-bytes")) {
            if (!bench_parse_size("--one-shot-bytes", v, &cfg.one_shot_bytes)) return 2;
        } else if (BENCH_FLAG("--device", "--device")) {
            /* Only the shm communicator is benchmarked: refuse CUDA with
             * the device's own error where there is none, else plainly. */
            tdm_device_list dl;
            tdm_status dst = tdm_device_list_parse(&dl, v);
            if (dst != TDM_STATUS_OK) {
                fprintf(stderr, "tandem bench: --device: %s\n", tdm_error_message());
                return dst == TDM_STATUS_NO_DEVICE ? 1 : 2;
            }
            if (dl.kind != TDM_DEVICE_HOST) {
                fprintf(stderr, "tandem bench: --device %s: the NCCL communicator is not "
                        "benchmarked by tandem yet; use nccl-tests (all_reduce_perf) for NCCL, "
                        "or --device cpu for the shm communicator\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--no-bind")) {
            cfg.bind = 0;
        } else if (!strcmp(a, "--zero-copy")) {
            cfg.zero_copy = 1;
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
        if (v && !*v) return 2;   /* flag at the end without its value */
    }
    if (!have_coll) {
        fprintf(stderr, "tandem bench: which collective? (see tandem bench --help)\n");
        bench_usage(stderr);
        return 2;
    }
    if (cfg.min_bytes == 0 || cfg.min_bytes > cfg.max_bytes) {
        fprintf(stderr, "tandem bench: need 0 < -b (%zu) <= -e (%zu)\n", cfg.min_bytes,
                cfg.max_bytes);
        return 2;
    }
    if (cfg.root >= cfg.nranks) {
        fprintf(stderr, "tandem bench: -r %d: root must be below -n %d\n", cfg.root, cfg.nranks);
        return 2;
    }
    size_t es = tdm_dtype_size(cfg.dtype);
    size_t unit = es * (cfg.coll == TDM_COLL_REDUCE_SCATTER || cfg.coll == TDM_COLL_ALL_GATHER
                            ? (size_t)cfg.nranks : 1);
    if (cfg.min_bytes < unit) {
        fprintf(stderr, "tandem bench: -b %zu: smallest size for %s of %s over %d ranks is %zu "
                "bytes\n", cfg.min_bytes, tdm_coll_name(cfg.coll), tdm_dtype_name(cfg.dtype),
                cfg.nranks, unit);
        return 2;
    }
    if (!cfg.memcpy_bytes)
        cfg.memcpy_bytes = cfg.max_bytes > ((size_t)64 << 20) ? cfg.max_bytes : (size_t)64 << 20;
    bench_bufs b;
    bench_counts(&cfg, cfg.max_bytes, &b);
    tdm_shm_spawn_opts o = {.timeout_ms = 3600 * 1000};
    o.shm.timeout_ms = 120000;
    o.shm.slot_bytes = cfg.slot_bytes;
    o.shm.one_shot_max_bytes = cfg.one_shot_bytes;
    if (cfg.zero_copy) o.shm.arena_bytes = (b.send_count + b.recv_count + 64) * es + 4096;
    tdm_status st = tdm_shm_spawn(cfg.nranks, bench_rank, &cfg, &o, NULL);
    if (st) {
        fprintf(stderr, "tandem bench: %s\n", tdm_error_message());
        return 1;
    }
    return 0;
}
