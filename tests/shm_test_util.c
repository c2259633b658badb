/* tests/shm_test_util.c: the shm communicator tests' helpers (declared
 * and explained in tests/shm_test_util.h), compiled once and linked into
 * every test binary. Runs inside forked ranks: reports with fprintf,
 * never cr_assert. */
#include "tests/shm_test_util.h"

#include <ctype.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* Value of element j on rank r for op (exact sums/products in float32). */
int64_t shm_t_val(size_t j, int r, tdm_redop op, unsigned salt)
{
    switch (op) {
    case TDM_REDOP_PROD:
        return ((j + (size_t)r + salt) % 3 == 0 ? 2 : 1) * (((j * 7 + (size_t)r) % 5 == 0) ? -1 : 1);
    case TDM_REDOP_MIN:
    case TDM_REDOP_MAX:
        return (int64_t)((j * 31 + (size_t)r * 17 + salt) % 101) - 50;
    default:
        return (int64_t)((j * 7 + (size_t)r * 3 + salt) % 17) - 8;
    }
}

void shm_t_store(void *buf, size_t i, tdm_dtype dt, int64_t v)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case TDM_DTYPE_FLOAT64: ((double *)buf)[i] = (double)v; break;
    case TDM_DTYPE_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case TDM_DTYPE_INT64: ((int64_t *)buf)[i] = v; break;
    case TDM_DTYPE_BFLOAT16: ((uint16_t *)buf)[i] = tdm_f32_to_bf16((float)v); break;
    case TDM_DTYPE_FLOAT16: ((uint16_t *)buf)[i] = tdm_f32_to_f16((float)v); break;
    default: break;
    }
}

/* 1 when buf[i] equals the value v would have after reduction op over
 * world ranks (v is the exact integer SUM/PROD/MIN/MAX result). */
int shm_t_equal(const void *buf, size_t i, tdm_dtype dt, tdm_redop op, int64_t v, int world)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32: {
        float want = op == TDM_REDOP_AVG ? (float)v / (float)world : (float)v;
        return ((const float *)buf)[i] == want;
    }
    case TDM_DTYPE_FLOAT64: {
        double want = op == TDM_REDOP_AVG ? (double)v / (double)world : (double)v;
        return ((const double *)buf)[i] == want;
    }
    case TDM_DTYPE_INT32:
        return ((const int32_t *)buf)[i] == (int32_t)(op == TDM_REDOP_AVG ? v / world : v);
    case TDM_DTYPE_INT64:
        return ((const int64_t *)buf)[i] == (op == TDM_REDOP_AVG ? v / world : v);
    case TDM_DTYPE_BFLOAT16: case TDM_DTYPE_FLOAT16: {
        /* float32 accumulation, one rounding at the end */
        float want = op == TDM_REDOP_AVG ? (float)v / (float)world : (float)v;
        uint16_t w16 = dt == TDM_DTYPE_BFLOAT16 ? tdm_f32_to_bf16(want) : tdm_f32_to_f16(want);
        return ((const uint16_t *)buf)[i] == w16;
    }
    default: return 0;
    }
}

/* Exact reduction of shm_t_val(j, 0..world-1) (AVG: the sum). */
int64_t shm_t_ref(size_t j, int world, tdm_redop op, unsigned salt)
{
    int64_t acc = shm_t_val(j, 0, op, salt);
    for (int r = 1; r < world; r++) {
        int64_t x = shm_t_val(j, r, op, salt);
        switch (op) {
        case TDM_REDOP_PROD: acc *= x; break;
        case TDM_REDOP_MIN: acc = x < acc ? x : acc; break;
        case TDM_REDOP_MAX: acc = x > acc ? x : acc; break;
        default: acc += x; break;
        }
    }
    return acc;
}

void shm_t_case_str(const shm_t_case *k, char *out, size_t n)
{
    snprintf(out, n, "%s(%s, op=%s, count=%zu, root=%d, %s)", tdm_coll_name(k->coll),
             tdm_dtype_name(k->dtype), tdm_redop_name(k->op), k->count, k->root,
             k->inplace ? "in-place" : "out-of-place");
}

/* Runs one collective on this rank and checks its result against the
 * reference. Returns 0 when right; prints the first wrong element. */
int shm_t_run_case(tdm_comm *comm, const shm_t_case *k)
{
    int r = tdm_comm_rank(comm), w = tdm_comm_size(comm);
    size_t es = tdm_dtype_size(k->dtype), n = k->count, W = (size_t)w;
    size_t send_n = n, recv_n = n;
    switch (k->coll) {
    case TDM_COLL_REDUCE_SCATTER: send_n = W * n; break;
    case TDM_COLL_ALL_GATHER: case TDM_COLL_GATHER: recv_n = W * n; break;
    case TDM_COLL_SCATTER: send_n = W * n; break;
    default: break;
    }
    size_t big = (send_n > recv_n ? send_n : recv_n) + 1;
    unsigned char *a = malloc(big * es), *b = malloc(big * es);
    if (!a || !b) { free(a); free(b); return 2; }
    /* one guard element past the largest buffer, in both */
    memset(a, 0xA5, big * es);
    memset(b, 0xA5, big * es);
    void *send = a, *recv = b;
    /* fill the send buffer with this rank's values */
    switch (k->coll) {
    case TDM_COLL_ALL_GATHER: case TDM_COLL_GATHER:
        if (k->inplace) send = b + (size_t)r * n * es;
        for (size_t i = 0; i < n; i++) shm_t_store(send, i, k->dtype, shm_t_val(i, r, k->op, k->salt));
        break;
    case TDM_COLL_BROADCAST:
        for (size_t i = 0; i < n; i++) shm_t_store(a, i, k->dtype, shm_t_val(i, r, k->op, k->salt));
        if (k->inplace) recv = a;
        break;
    default:
        for (size_t i = 0; i < send_n; i++) shm_t_store(a, i, k->dtype, shm_t_val(i, r, k->op, k->salt));
        if (k->inplace) {
            if (k->coll == TDM_COLL_REDUCE_SCATTER || k->coll == TDM_COLL_SCATTER)
                recv = a + (size_t)r * n * es;
            else
                recv = a;
        }
    }
    tdm_status st = TDM_STATUS_OK;
    switch (k->coll) {
    case TDM_COLL_ALL_REDUCE: st = tdm_comm_all_reduce(comm, send, recv, n, k->dtype, k->op); break;
    case TDM_COLL_REDUCE: st = tdm_comm_reduce(comm, send, recv, n, k->dtype, k->op, k->root); break;
    case TDM_COLL_REDUCE_SCATTER: st = tdm_comm_reduce_scatter(comm, send, recv, n, k->dtype, k->op); break;
    case TDM_COLL_ALL_GATHER: st = tdm_comm_all_gather(comm, send, recv, n, k->dtype); break;
    case TDM_COLL_GATHER: st = tdm_comm_gather(comm, send, recv, n, k->dtype, k->root); break;
    case TDM_COLL_BROADCAST: st = tdm_comm_broadcast(comm, send, recv, n, k->dtype, k->root); break;
    case TDM_COLL_SCATTER: st = tdm_comm_scatter(comm, send, recv, n, k->dtype, k->root); break;
    default: st = TDM_STATUS_INTERNAL;
    }
    char desc[160];
    shm_t_case_str(k, desc, sizeof desc);
    int bad = 0;
    if (st) {
        fprintf(stderr, "rank %d/%d: %s failed: %s: %s\n", r, w, desc, tdm_status_name(st),
                tdm_error_message());
        bad = 1;
    }
    /* nothing written past the result: the guard bytes are intact (in b
     * from the end of the result when it lives there, and a's guard) */
    size_t b_from = recv == (void *)b ? recv_n * es : (big - 1) * es;
    for (size_t i = b_from; !bad && i < big * es; i++)
        if (b[i] != 0xA5) {
            fprintf(stderr, "rank %d/%d: %s wrote byte %zu past its result\n", r, w, desc,
                    i - recv_n * es);
            bad = 1;
        }
    for (size_t i = (big - 1) * es; !bad && i < big * es; i++)
        if (a[i] != 0xA5) {
            fprintf(stderr, "rank %d/%d: %s wrote into the send buffer's guard\n", r, w, desc);
            bad = 1;
        }
    for (size_t i = 0; !bad && i < recv_n; i++) {
        int ok = 1;
        switch (k->coll) {
        case TDM_COLL_ALL_REDUCE:
            ok = shm_t_equal(recv, i, k->dtype, k->op, shm_t_ref(i, w, k->op, k->salt), w); break;
        case TDM_COLL_REDUCE:
            if (r != k->root) { i = recv_n; break; }
            ok = shm_t_equal(recv, i, k->dtype, k->op, shm_t_ref(i, w, k->op, k->salt), w); break;
        case TDM_COLL_REDUCE_SCATTER:
            ok = shm_t_equal(recv, i, k->dtype, k->op,
                             shm_t_ref((size_t)r * n + i, w, k->op, k->salt), w); break;
        case TDM_COLL_ALL_GATHER:
            ok = shm_t_equal(recv, i, k->dtype, TDM_REDOP_SUM, shm_t_val(i % (n ? n : 1), (int)(i / n), k->op, k->salt), 1); break;
        case TDM_COLL_GATHER:
            if (r != k->root) { i = recv_n; break; }
            ok = shm_t_equal(recv, i, k->dtype, TDM_REDOP_SUM, shm_t_val(i % (n ? n : 1), (int)(i / n), k->op, k->salt), 1); break;
        case TDM_COLL_BROADCAST:
            ok = shm_t_equal(recv, i, k->dtype, TDM_REDOP_SUM, shm_t_val(i, k->root, k->op, k->salt), 1); break;
        case TDM_COLL_SCATTER:
            ok = shm_t_equal(recv, i, k->dtype, TDM_REDOP_SUM, shm_t_val((size_t)r * n + i, k->root, k->op, k->salt), 1); break;
        default: break;
        }
        if (!ok) {
            fprintf(stderr, "rank %d/%d: %s: wrong element %zu (algo %s)\n", r, w, desc, i,
                    tdm_comm_last_algo(comm));
            bad = 1;
        }
    }
    free(a);
    free(b);
    return bad;
}

/* --- leaked segments (see tests/shm_test_util.h) ------------------------- */

void shm_t_adopt_orphans(void) { prctl(PR_SET_CHILD_SUBREAPER, 1); }

/* 1 when the file open as /proc/PID/fd/N is a tandem segment: a memfd of
 * that name, or a regular file whose first 8 bytes are the segment magic
 * (an O_TMPFILE segment in opts.shm_dir). */
static int shm_t_fd_is_segment(const char *fdpath)
{
    char link[512];
    ssize_t n = readlink(fdpath, link, sizeof link - 1);
    if (n <= 0) return 0;
    link[n] = '\0';
    if (strstr(link, "memfd:tandem-shm")) return 1;
    if (link[0] != '/' || !strstr(link, "(deleted)")) return 0;
    struct stat sb;
    if (stat(fdpath, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < 8) return 0;
    int fd = open(fdpath, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0;
    uint64_t magic = 0;
    int is = pread(fd, &magic, sizeof magic, 0) == (ssize_t)sizeof magic &&
             magic == 0x314d48534d444e54ull; /* TDM_SHM_MAGIC, "TNDMSHM1" */
    close(fd);
    return is;
}

/* Segment descriptors plus mappings of memfd segments held by pid. */
static int shm_t_segments_of(pid_t pid)
{
    char path[64];
    int n = 0;
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (d) {
        for (struct dirent *e; (e = readdir(d));) {
            if (!isdigit((unsigned char)e->d_name[0])) continue;
            char fdp[320];
            snprintf(fdp, sizeof fdp, "/proc/%d/fd/%s", (int)pid, e->d_name);
            n += shm_t_fd_is_segment(fdp);
        }
        closedir(d);
    }
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    if (f) {
        char line[1024];
        while (fgets(line, sizeof line, f)) n += strstr(line, "/memfd:tandem-shm") != NULL;
        fclose(f);
    }
    return n;
}

/* Parent pid of pid from /proc/pid/stat (0 when gone); *zombie set when
 * it has exited and holds nothing any more. */
static pid_t shm_t_ppid(pid_t pid, int *zombie)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    *zombie = 0;
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    char state = 0;
    int ppid = 0;
    if (!p || sscanf(p + 1, " %c %d", &state, &ppid) != 2) return 0;
    *zombie = state == 'Z' || state == 'X';
    return (pid_t)ppid;
}

/* Segment descriptors and mappings held by this process and every live
 * descendant (see the header). 0 after a job means nothing of it was leaked. */
int shm_t_segments_held(void)
{
    enum { MAXP = 1 << 15 };
    static pid_t pids[MAXP], ppids[MAXP];
    int np = 0;
    DIR *d = opendir("/proc");
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d)) && np < MAXP;) {
        if (!isdigit((unsigned char)e->d_name[0])) continue;
        int z;
        pid_t p = (pid_t)atoi(e->d_name), pp = shm_t_ppid(p, &z);
        if (!pp || z) continue;
        pids[np] = p;
        ppids[np++] = pp;
    }
    closedir(d);
    /* descendants: repeat until no new pid joins the set */
    static unsigned char mine[MAXP];
    memset(mine, 0, sizeof mine);
    int held = shm_t_segments_of(getpid());
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < np; i++) {
            if (mine[i]) continue;
            int parent_mine = ppids[i] == getpid();
            for (int j = 0; !parent_mine && j < np; j++)
                parent_mine = mine[j] && pids[j] == ppids[i];
            if (parent_mine) {
                mine[i] = 1;
                changed = 1;
                held += shm_t_segments_of(pids[i]);
            }
        }
    }
    return held;
}

void shm_t_matrix_ops(int all_ops, size_t size_index, int dtype, int *first, int *op_count)
{
    *first = 0;
    *op_count = all_ops ? TDM_REDOP_COUNT_ : 1;
    const char *e = getenv("TANDEM_TEST_MATRIX");
    if (all_ops && e && !strcmp(e, "rotate-ops")) {
        *first = (int)((size_index + (size_t)dtype) % TDM_REDOP_COUNT_);
        *op_count = 1;
    }
}
