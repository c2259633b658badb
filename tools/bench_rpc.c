/* tools/bench_rpc.c: `tandem bench rpc`: the round-trip latency of an
 * RPC (rpc/: a call whose reply is its arguments) between two forked
 * ranks, over the shm and TCP transports, beside a plain TCP ping-pong
 * on loopback (send n bytes, the peer sends them back: no RPC layer)
 * measured in the same run, for sizes 8 B .. 1 MiB. Each figure is the
 * median of --iters round trips after --warmup ones. Figures for
 * docs/PERFORMANCE.md; nothing here is a test. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/timer.h"
#include "rpc/rpc.h"
#include "shm/spawn.h"
#include "tools/args.h"
#include "tools/bench.h"
#include "tools/tools.h"

#define RPC_BENCH_SIZES 6
static const size_t rpc_bench_size[RPC_BENCH_SIZES] = {8, 1024, 16384, 65536, 262144, 1 << 20};

typedef struct rpc_bench {
    int iters, warmup;
    double us[3][RPC_BENCH_SIZES];   /* rpc shm, rpc tcp, plain tcp */
    int status[2];
    char err[2][512];
} rpc_bench;

static tdm_status rb_echo(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    void *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, req->nbytes, &out));
    memcpy(out, req->args, req->nbytes);
    return TDM_STATUS_OK;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

static int rb_fail(rpc_bench *b, int r, const char *what)
{
    snprintf(b->err[r], sizeof b->err[r], "%s: %s", what, tdm_error_message());
    return b->status[r] = 1;
}

static int rb_rpc(tdm_comm *comm, rpc_bench *b, tdm_rpc_transport tp, int row, char *buf, double *t)
{
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    tdm_rpc_opts o = {.transport = tp, .comm = comm};
    if (tdm_rpc_init(&rpc, &o) || tdm_rpc_register(rpc, "echo", rb_echo, NULL)) return rb_fail(b, r, "rpc");
    if (tdm_rpc_barrier(rpc, 60000)) return rb_fail(b, r, "barrier");
    if (r == 0) {
        for (int s = 0; s < RPC_BENCH_SIZES; s++) {
            for (int i = 0; i < b->warmup + b->iters; i++) {
                void *rep = NULL;
                uint64_t t0 = tdm_time_ns();
                if (tdm_rpc_call(rpc, 1, "echo", buf, rpc_bench_size[s], &rep, NULL, 60000))
                    return rb_fail(b, r, "call");
                if (i >= b->warmup) t[i - b->warmup] = (double)(tdm_time_ns() - t0) / 1e3;
                free(rep);
            }
            b->us[row][s] = median(t, b->iters);
        }
    }
    if (tdm_rpc_barrier(rpc, 60000)) return rb_fail(b, r, "barrier");
    tdm_rpc_free(rpc);
    return 0;
}

static int rb_io(int fd, char *buf, size_t n, int send_it)
{
    size_t done = 0;
    while (done < n) {
        ssize_t k = send_it ? send(fd, buf + done, n - done, MSG_NOSIGNAL) : recv(fd, buf + done, n - done, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        done += (size_t)k;
    }
    return 0;
}

/* The plain ping-pong: rank 1 listens on loopback (its port over the
 * communicator), rank 0 connects. */
static int rb_tcp(tdm_comm *comm, rpc_bench *b, char *buf, double *t)
{
    int r = tdm_comm_rank(comm);
    int fd = -1, lfd = -1;
    int64_t port = 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (r == 1) {
        lfd = socket(AF_INET, SOCK_STREAM, 0);
        socklen_t len = sizeof a;
        if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 1) ||
            getsockname(lfd, (struct sockaddr *)&a, &len)) {
            tdm_error_set(TDM_STATUS_SYSTEM, "%s", strerror(errno));
            return rb_fail(b, r, "listen");
        }
        port = ntohs(a.sin_port);
    }
    if (tdm_comm_broadcast(comm, &port, &port, 1, TDM_DTYPE_INT64, 1)) return rb_fail(b, r, "broadcast");
    if (r == 1) fd = accept(lfd, NULL, NULL);
    else {
        a.sin_port = htons((uint16_t)port);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a)) {
            close(fd);
            fd = -1;
        }
    }
    if (fd < 0) {
        tdm_error_set(TDM_STATUS_SYSTEM, "%s", strerror(errno));
        return rb_fail(b, r, "connect");
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (int s = 0; s < RPC_BENCH_SIZES; s++) {
        size_t n = rpc_bench_size[s];
        for (int i = 0; i < b->warmup + b->iters; i++) {
            uint64_t t0 = tdm_time_ns();
            int e = r == 0 ? rb_io(fd, buf, n, 1) || rb_io(fd, buf, n, 0) : rb_io(fd, buf, n, 0) || rb_io(fd, buf, n, 1);
            if (e) {
                tdm_error_set(TDM_STATUS_SYSTEM, "ping-pong of %zu bytes: %s", n, strerror(errno));
                return rb_fail(b, r, "tcp");
            }
            if (i >= b->warmup) t[i - b->warmup] = (double)(tdm_time_ns() - t0) / 1e3;
        }
        if (r == 0) b->us[2][s] = median(t, b->iters);
    }
    close(fd);
    if (lfd >= 0) close(lfd);
    return 0;
}

static int rb_rank(tdm_comm *comm, void *arg)
{
    rpc_bench *b = arg;
    int r = tdm_comm_rank(comm);
    char *buf = calloc(1, 1 << 20);
    double *t = calloc((size_t)b->iters, sizeof *t);
    if (!buf || !t) return rb_fail(b, r, "calloc");
    int e = rb_rpc(comm, b, TDM_RPC_SHM, 0, buf, t);
    if (!e) e = rb_rpc(comm, b, TDM_RPC_TCP, 1, buf, t);
    if (!e) e = rb_tcp(comm, b, buf, t);
    free(buf);
    free(t);
    return e;
}

static tdm_status rb_parse(int argc, char **argv, long long *iters, long long *warmup, int *help)
{
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_HELP(*help)
        const char *arg = argv[i];
        TDM_ARGS_INT("--iters", 1, 1000000, *iters)
        TDM_ARGS_INT("--warmup", 0, 1000000, *warmup)
        return tdm_tool_usage_error("tandem bench rpc: unknown option '%s' (see tandem bench rpc --help)\n", arg);
    }
    return TDM_STATUS_OK;
}

int tdm_bench_rpc_main(int argc, char **argv)
{
    long long iters = 200, warmup = 20;
    int help = 0;
    tdm_status pst = rb_parse(argc, argv, &iters, &warmup, &help);
    if (pst != TDM_STATUS_OK) return tdm_tool_exit(pst);
    if (help) {
        printf("usage: tandem bench rpc [--iters N] [--warmup W]\n\n"
               "Round-trip latency (median of N, after W) of an RPC echo between two forked ranks\n"
               "over rpc/'s shm and TCP transports, beside a plain TCP ping-pong on loopback in\n"
               "the same run, for 8 B .. 1 MiB.                          [--iters 200 --warmup 20]\n");
        return 0;
    }
    rpc_bench *b = mmap(NULL, sizeof *b, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (b == MAP_FAILED) {
        fprintf(stderr, "tandem bench rpc: mmap: %s\n", strerror(errno));
        return 1;
    }
    memset(b, 0, sizeof *b);
    b->iters = (int)iters;
    b->warmup = (int)warmup;
    tdm_shm_spawn_opts so = {.timeout_ms = 600000};
    tdm_status st = tdm_shm_spawn(2, rb_rank, b, &so, NULL);
    int rc = 0;
    if (st != TDM_STATUS_OK) {
        fprintf(stderr, "tandem bench rpc: %s%s%s\n", tdm_error_message(), b->err[0][0] ? "; rank 0: " : "", b->err[0]);
        rc = 1;
    } else {
        printf("# round trip, median of %d (after %d), microseconds; 2 forked ranks\n", b->iters, b->warmup);
        printf("%10s %12s %12s %12s\n", "bytes", "rpc-shm", "rpc-tcp", "tcp-pingpong");
        for (int s = 0; s < RPC_BENCH_SIZES; s++)
            printf("%10zu %12.1f %12.1f %12.1f\n", rpc_bench_size[s], b->us[0][s], b->us[1][s], b->us[2][s]);
    }
    munmap(b, sizeof *b);
    return rc;
}
