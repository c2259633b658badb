/* tests/test_comm_split.c: tdm_comm_split on the shm backend: MPI_Comm_split's
 * groups and ranks for 2..8 ranks (colors, keys, ties, an undefined color),
 * collectives and send/recv on the sub-communicators (also while the
 * parent and another split run), a split of a split keeping job ranks,
 * argument checks, and failures: a dead rank named by its job rank on a
 * sub-communicator, a deadline naming its peer, a failure on a
 * sub-communicator stopping the rest of the job. Nothing is left behind
 * (no process, no segment held). */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/timeout_util.h"

#define MAXW 8

typedef struct split_out {
    int status[MAXW];
    char err[MAXW][512];
} split_out;

static split_out *out_new(void)
{
    split_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(o != MAP_FAILED);
    memset(o, 0, sizeof *o);
    return o;
}

static void out_free(split_out *o) { munmap(o, sizeof *o); }

/* A scheme: this rank's color and key. */
/* Schemes: 0: color r % 2, key -r (reversed); 1: color r / 2, key 0
 * (ties: parent order); 2: every third rank undefined, the others one
 * color with keys r % 3; 3: one color, keys (5 r) % world (a shuffle). */
static void color_key(int kind, int r, int w, int *color, int *key)
{
    switch (kind) {
    case 0: *color = r % 2; *key = -r; break;
    case 1: *color = r / 2; *key = 0; break;
    case 2: *color = r % 3 == 2 ? TDM_COMM_SPLIT_UNDEFINED : 0; *key = r % 3; break;
    default: *color = 0; *key = (r * 5) % w; break;
    }
}

/* The new group of rank r, computed here independently: members of r's
 * color in (key, rank) order. Returns the size; *me is r's place. */
static int expect_group(int kind, int r, int w, int *members, int *me)
{
    int c, k, n = 0;
    color_key(kind, r, w, &c, &k);
    *me = -1;
    if (c == TDM_COMM_SPLIT_UNDEFINED) return 0;
    int keys[MAXW];
    for (int q = 0; q < w; q++) {
        int cq, kq;
        color_key(kind, q, w, &cq, &kq);
        if (cq != c) continue;
        int i = n++;
        while (i > 0 && (keys[i - 1] > kq || (keys[i - 1] == kq && members[i - 1] > q))) {
            keys[i] = keys[i - 1];
            members[i] = members[i - 1];
            i--;
        }
        keys[i] = kq;
        members[i] = q;
    }
    for (int i = 0; i < n; i++)
        if (members[i] == r) *me = i;
    return n;
}

typedef struct groups_arg {
    int kind;
    split_out *out;
} groups_arg;

#define FAIL(code, ...)                                                                 \
    do {                                                                                \
        snprintf(a->out->err[r], sizeof a->out->err[r], __VA_ARGS__);                    \
        a->out->status[r] = (code);                                                     \
        rc = (code);                                                                    \
        goto done;                                                                      \
    } while (0)

/* Splits, checks the group, then runs collectives and a ring of send/recv
 * on the sub-communicator while the parent runs an all_reduce too. */
static int groups_rank(tdm_comm *comm, void *argp)
{
    groups_arg *a = argp;
    int r = tdm_comm_rank(comm), w = tdm_comm_size(comm), rc = 0;
    int color, key, members[MAXW], me;
    color_key(a->kind, r, w, &color, &key);
    int n = expect_group(a->kind, r, w, members, &me);
    tdm_comm *sub = NULL, *sub2 = NULL;
    if (tdm_comm_split(comm, color, key, &sub) != TDM_STATUS_OK)
        FAIL(1, "split: %s", tdm_error_message());
    if (n == 0) {
        if (sub) FAIL(2, "undefined color gave a communicator");
    } else {
        if (!sub) FAIL(3, "no communicator");
        if (tdm_comm_size(sub) != n || tdm_comm_rank(sub) != me)
            FAIL(4, "rank %d of %d, expected %d of %d", tdm_comm_rank(sub), tdm_comm_size(sub),
                 me, n);
        for (int i = 0; i < n; i++)
            if (tdm_comm_job_rank(sub, i) != members[i])
                FAIL(5, "job rank of %d is %d, expected %d", i, tdm_comm_job_rank(sub, i),
                     members[i]);
    }
    /* an all_reduce of job ranks on the sub-communicator, asynchronously,
     * while every rank (undefined ones too) reduces over the parent */
    int64_t v = r, sum = 0, want = 0, pv = 1;
    for (int i = 0; i < n; i++) want += members[i];
    tdm_comm_work *wk = NULL;
    if (sub && tdm_comm_all_reduce_async(sub, &v, &sum, 1, TDM_DTYPE_INT64, TDM_REDOP_SUM, &wk))
        FAIL(6, "all_reduce_async: %s", tdm_error_message());
    if (tdm_comm_all_reduce(comm, &pv, &pv, 1, TDM_DTYPE_INT64, TDM_REDOP_SUM))
        FAIL(7, "parent all_reduce: %s", tdm_error_message());
    if (sub) {
        if (tdm_comm_work_wait(wk, -1)) FAIL(8, "wait: %s", tdm_error_message());
        tdm_comm_work_free(wk);
        if (sum != want || pv != w) FAIL(9, "sums %lld (want %lld), %lld", (long long)sum,
                                         (long long)want, (long long)pv);
        /* broadcast from the last, all_gather of job ranks */
        int32_t b = me == n - 1 ? 1000 + r : -1, all[MAXW];
        if (tdm_comm_broadcast(sub, &b, &b, 1, TDM_DTYPE_INT32, n - 1))
            FAIL(10, "broadcast: %s", tdm_error_message());
        if (b != 1000 + members[n - 1]) FAIL(11, "broadcast gave %d", b);
        int32_t j = r;
        if (tdm_comm_all_gather(sub, &j, all, 1, TDM_DTYPE_INT32))
            FAIL(12, "all_gather: %s", tdm_error_message());
        for (int i = 0; i < n; i++)
            if (all[i] != members[i]) FAIL(13, "all_gather[%d] = %d", i, all[i]);
        /* a ring: send to the next, receive from the previous, a message
         * larger than the channel's buffering (128 KiB), so that the send
         * needs its receiver. One queue per communicator: even ranks queue
         * the recv first, odd ones the send, or every rank's queue would
         * hold a send that waits for a peer stuck in its own send */
        if (n > 1) {
            enum { N = 70000 };
            static float s[N], q[N];
            for (int i = 0; i < N; i++) s[i] = (float)(r * N + i);
            tdm_comm_work *ws = NULL, *wr = NULL;
            int next = (me + 1) % n, prev = (me + n - 1) % n;
            tdm_status a1 = me % 2 ? tdm_comm_isend(sub, s, N, TDM_DTYPE_FLOAT32, next, &ws)
                                   : tdm_comm_irecv(sub, q, N, TDM_DTYPE_FLOAT32, prev, &wr);
            tdm_status a2 = me % 2 ? tdm_comm_irecv(sub, q, N, TDM_DTYPE_FLOAT32, prev, &wr)
                                   : tdm_comm_isend(sub, s, N, TDM_DTYPE_FLOAT32, next, &ws);
            if (a1 || a2) FAIL(14, "isend/irecv: %s", tdm_error_message());
            if (tdm_comm_work_wait(ws, -1) || tdm_comm_work_wait(wr, -1))
                FAIL(15, "ring wait: %s", tdm_error_message());
            tdm_comm_work_free(ws);
            tdm_comm_work_free(wr);
            for (int i = 0; i < N; i++)
                if (q[i] != (float)(members[prev] * N + i)) FAIL(16, "ring[%d] = %g", i, q[i]);
        }
        /* a split of the split keeps job ranks */
        if (tdm_comm_split(sub, me % 2, 0, &sub2)) FAIL(17, "split of split: %s", tdm_error_message());
        int32_t jr = r, jall[MAXW];
        if (tdm_comm_all_gather(sub2, &jr, jall, 1, TDM_DTYPE_INT32))
            FAIL(18, "all_gather 2: %s", tdm_error_message());
        for (int i = 0; i < tdm_comm_size(sub2); i++)
            if (tdm_comm_job_rank(sub2, i) != jall[i])
                FAIL(19, "nested job rank of %d: %d vs %d", i, tdm_comm_job_rank(sub2, i), jall[i]);
    }
    /* every rank, also undefined ones, goes on with the parent */
    if (tdm_comm_barrier(comm)) FAIL(20, "barrier: %s", tdm_error_message());
done:
    tdm_comm_free(sub2);
    tdm_comm_free(sub);
    return rc;
}

static void run_groups(int kind, int world)
{
    split_out *o = out_new();
    groups_arg a = {.kind = kind, .out = o};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
    tdm_status st = tdm_shm_spawn(world, groups_rank, &a, &so, NULL);
    for (int r = 0; r < world; r++)
        cr_assert_eq(o->status[r], 0, "scheme %d, %d ranks, rank %d: %s", kind, world, r,
                     o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "scheme %d, %d ranks: %s", kind, world, tdm_error_message());
    out_free(o);
}

TestSuite(comm_split, .timeout = 240);

Test(comm_split, groups_ranks_and_collectives_2_to_8_ranks)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    for (int w = 2; w <= MAXW; w++)
        for (int kind = 0; kind < 4; kind++) run_groups(kind, w);
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

/* Bad colors are refused on the rank that passed them, before any
 * collective: the others then fail their split at the deadline, so the
 * check runs in a group of one. */
static int bad_color_rank(tdm_comm *comm, void *argp)
{
    (void)argp;
    tdm_comm *sub = (tdm_comm *)1;
    if (tdm_comm_split(comm, -5, 0, &sub) != TDM_STATUS_INVALID_ARG) return 1;
    if (sub != NULL) return 2;
    if (!strstr(tdm_error_message(), "color -5")) return 3;
    /* a group of one works */
    if (tdm_comm_split(comm, 7, 3, &sub) || !sub || tdm_comm_size(sub) != 1) return 4;
    float x = 2.0f;
    if (tdm_comm_all_reduce(sub, &x, &x, 1, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM) || x != 2.0f)
        return 5;
    tdm_comm_free(sub);
    return 0;
}

Test(comm_split, bad_color_and_group_of_one)
{
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    cr_assert_eq(tdm_shm_spawn(1, bad_color_rank, NULL, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
}

/* --- failures ------------------------------------------------------------- */

typedef struct fail_arg {
    int mode;          /* 0: job rank 2 dies; 1: job rank 2 never calls (deadline) */
    split_out *out;
} fail_arg;

/* 4 ranks, color r % 2, key -r: job ranks {2, 0} and {3, 1}; job rank 2
 * is rank 0 of its group. Job rank 0 waits for it in a recv. */
static int fail_rank(tdm_comm *comm, void *argp)
{
    fail_arg *a = argp;
    int r = tdm_comm_rank(comm), rc = 0;
    tdm_comm *sub = NULL;
    if (tdm_comm_split(comm, r % 2, -r, &sub)) {
        snprintf(a->out->err[r], sizeof a->out->err[r], "split: %s", tdm_error_message());
        return 1;
    }
    float x = 0.0f;
    if (r == 2) {
        if (a->mode == 0) raise(SIGKILL);
        sleep(30);   /* never calls: job rank 0's recv reaches its deadline */
        return 0;
    }
    tdm_status st = TDM_STATUS_OK;
    if (r == 0) {
        st = tdm_comm_recv(sub, &x, 1, TDM_DTYPE_FLOAT32, 0);
    } else if (a->mode == 1) {
        /* ranks 1 and 3 leave: nobody waits for them */
        tdm_comm_free(sub);
        return 0;
    } else {
        st = tdm_comm_barrier(comm);   /* ranks 1 and 3: the job's abort stops them */
    }
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    a->out->status[r] = st;
    rc = st ? 3 : 0;
    tdm_comm_free(sub);
    return rc;
}

Test(comm_split, dead_rank_named_by_its_job_rank)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    split_out *o = out_new();
    fail_arg a = {.mode = 0, .out = o};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
    tdm_status st = tdm_shm_spawn(4, fail_rank, &a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "rank 2"), "%s", tdm_error_message());
    /* job rank 0 saw its sub-communicator's peer die: named as rank 0 of
     * that communicator and job rank 2, either by its own wait or by the
     * job's abort (whose ranks are job ranks) */
    cr_assert_eq(o->status[0], TDM_STATUS_PEER_FAILED, "%s", o->err[0]);
    cr_assert(strstr(o->err[0], "rank 0 (job rank 2, pid") ||
                  strstr(o->err[0], "job was aborted (ranks by job rank): rank 2 (pid"),
              "%s", o->err[0]);
    /* the others stopped too */
    for (int r = 1; r < 4; r += 2)
        cr_assert_neq(o->status[r], TDM_STATUS_OK, "rank %d: %s", r, o->err[r]);
    out_free(o);
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

static int deadline_rank(tdm_comm *comm, void *argp)
{
    return fail_rank(comm, argp);
}

Test(comm_split, deadline_names_the_peer_and_its_job_rank)
{
    shm_t_adopt_orphans();
    split_out *o = out_new();
    fail_arg a = {.mode = 1, .out = o};
    /* the recv's deadline is the one that fires: 1.5 s, scaled (it bounds
     * nothing healthy but the split before it) */
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000),
                             .shm = {.timeout_ms = tu_scaled_ms(1500), .stall_ms = -1}};
    tdm_status st = tdm_shm_spawn(4, deadline_rank, &a, &so, NULL);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert_eq(o->status[0], TDM_STATUS_TIMEOUT, "%s", o->err[0]);
    cr_assert(strstr(o->err[0], "rank 1 (job rank 0) timed out after") &&
                  strstr(o->err[0], "waiting for rank 0 (job rank 2, pid"),
              "%s", o->err[0]);
    out_free(o);
}

/* --- a backend that takes device memory only ----------------------------------
 * NCCL's `run` takes device memory: the colors and keys tdm_comm_split
 * all-gathers over the parent must reach it staged through the backend's
 * own memory (host_copy), never as host pointers (an illegal address on
 * a GPU). "devonly" wraps an shm communicator and refuses any buffer
 * outside the pool its alloc hands out, as a GPU would fault on one. */
#include "core/comm_impl.h"

typedef struct devonly {
    tdm_comm *inner;
    char pool[4096];
    size_t used;
    int host_calls;           /* calls refused for a host pointer */
} devonly;

static int devonly_owns(const devonly *d, const void *p)
{
    return (const char *)p >= d->pool && (const char *)p < d->pool + sizeof d->pool;
}

static tdm_status devonly_run(void *impl, const tdm_comm_call *k)
{
    devonly *d = impl;
    if ((k->sendbuf && !devonly_owns(d, k->sendbuf)) || (k->recvbuf && !devonly_owns(d, k->recvbuf))) {
        d->host_calls++;
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "devonly: %s on a host pointer",
                             tdm_coll_name(k->coll));
    }
    if (k->coll != TDM_COLL_ALL_GATHER)
        return tdm_error_set(TDM_STATUS_UNSUPPORTED, "devonly: only all-gather");
    return tdm_comm_all_gather(d->inner, k->sendbuf, k->recvbuf, k->count, k->dtype);
}

static tdm_status devonly_abort(void *impl, const char *why)
{
    return tdm_comm_abort(((devonly *)impl)->inner, why);
}

static tdm_status devonly_alloc(void *impl, size_t n, void **ptr)
{
    devonly *d = impl;
    if (d->used + n > sizeof d->pool) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "devonly");
    *ptr = d->pool + d->used;
    d->used += (n + 15) & ~(size_t)15;
    return TDM_STATUS_OK;
}

static tdm_status devonly_host_copy(void *impl, void *dst, const void *src, size_t n, int to_dev)
{
    devonly *d = impl;
    if (!devonly_owns(d, to_dev ? dst : src))
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "devonly: host copy outside the pool");
    memcpy(dst, src, n);
    return TDM_STATUS_OK;
}

static tdm_status devonly_split(void *impl, const tdm_comm_split_info *in, tdm_comm **out)
{
    return tdm_comm_split(((devonly *)impl)->inner, in->color, in->key, out);
}

static void devonly_destroy(void *impl) { (void)impl; }

static const tdm_comm_ops devonly_ops = {.name = "devonly", .run = devonly_run,
                                         .abort = devonly_abort, .alloc = devonly_alloc,
                                         .host_copy = devonly_host_copy,
                                         .split = devonly_split, .destroy = devonly_destroy};

static int devonly_rank(tdm_comm *comm, void *argp)
{
    split_out *o = argp;
    int r = tdm_comm_rank(comm);
    static devonly d;
    d = (devonly){.inner = comm};
    tdm_comm *dc = NULL, *sub = NULL;
    tdm_status st = tdm_comm_create(&dc, &devonly_ops, &d, r, tdm_comm_size(comm));
    if (!st) st = tdm_comm_split(dc, r % 2, 0, &sub);
    if (!st && (tdm_comm_size(sub) != 2 || tdm_comm_rank(sub) != r / 2))
        st = tdm_error_set(TDM_STATUS_INTERNAL, "rank %d of %d, expected %d of 2",
                           tdm_comm_rank(sub), tdm_comm_size(sub), r / 2);
    o->status[r] = st;
    snprintf(o->err[r], sizeof o->err[r], "%s (host calls %d)", st ? tdm_error_message() : "ok",
             d.host_calls);
    tdm_comm_free(sub);
    tdm_comm_free(dc);
    return st ? 3 : 0;
}

Test(comm_split, a_device_memory_backend_gets_no_host_pointer)
{
    split_out *o = out_new();
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    tdm_status st = tdm_shm_spawn(4, devonly_rank, o, &so, NULL);
    for (int r = 0; r < 4; r++)
        cr_assert_eq(o->status[r], TDM_STATUS_OK, "rank %d: %s", r, o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK);
    out_free(o);
}
