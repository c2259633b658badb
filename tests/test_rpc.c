/* tests/test_rpc.c: rpc/ over both transports, in forked ranks: calls and
 * futures between every pair of ranks for worlds 2..8 and sizes from 0
 * bytes to several rings' worth, many threads of many ranks calling one
 * rank at once, a callee's error and its message reaching the caller,
 * unknown names and oversized arguments refused with a clear error while
 * the callee goes on serving, and a callee killed in the middle of a call
 * named to its caller within a bound, and a rank killed in set-up while
 * another is late leaving no /dev/shm name. The malformed-input (fuzz) tests of
 * the TCP port are in tests/test_rpc_fuzz.c. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/timer.h"
#include "rpc/rpc.h"
#include "shm/spawn.h"
#include "tests/timeout_util.h"

#define MAX_RANKS 8

typedef struct rpc_out {
    int status[MAX_RANKS];
    char err[MAX_RANKS][600];
    int64_t served[MAX_RANKS];
    double dead_ms;
} rpc_out;

typedef struct rpc_case {
    tdm_rpc_transport tp;
    rpc_out *o;
    size_t max_msg;
} rpc_case;

static int fail(rpc_out *o, int r, int code, const char *what)
{
    snprintf(o->err[r], sizeof o->err[r], "%s: %s", what, tdm_error_message());
    o->status[r] = code;
    return code;
}

static int64_t timeout_ms(void) { return tu_scaled_ms(30000); }

/* echo: the reply is the arguments, each byte plus the callee's rank */
static tdm_status fn_echo(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    uint8_t *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, req->nbytes, (void **)&out));
    const uint8_t *in = req->args;
    for (size_t i = 0; i < req->nbytes; i++) out[i] = (uint8_t)(in[i] + tdm_rpc_rank(req->rpc));
    return TDM_STATUS_OK;
}

static tdm_status fn_fail(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    int v = req->nbytes >= sizeof(int) ? *(const int *)req->args : -1;
    return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "bad input %d from rank %d", v, req->caller);
}

typedef struct counter {
    pthread_mutex_t mu;
    int64_t n;
} counter;

static tdm_status fn_count(tdm_rpc_req *req, void *ctx)
{
    counter *c = ctx;
    int64_t add = 0;
    if (req->nbytes == sizeof add) memcpy(&add, req->args, sizeof add);
    pthread_mutex_lock(&c->mu);
    c->n += add;
    int64_t now = c->n;
    pthread_mutex_unlock(&c->mu);
    int64_t *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, sizeof now, (void **)&out));
    *out = now;
    return TDM_STATUS_OK;
}

static tdm_status open_rpc(tdm_comm *comm, const rpc_case *k, tdm_rpc **out)
{
    tdm_rpc_opts opts = {.transport = k->tp, .comm = comm, .max_msg_bytes = k->max_msg,
                         .setup_ms = timeout_ms(), .ring_bytes = 64 << 10};
    return tdm_rpc_init(out, &opts);
}

static void fill(uint8_t *p, size_t n, unsigned salt)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(i * 31u + salt);
}

static int check_echo(const uint8_t *sent, const uint8_t *got, size_t n, int callee)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != (uint8_t)(sent[i] + callee)) return 0;
    return 1;
}

/* Every rank calls every rank (itself too) synchronously, then with all
 * its futures in flight at once, for sizes across the ring's. */
static int calls_rank(tdm_comm *comm, void *arg)
{
    rpc_case *k = arg;
    rpc_out *o = k->o;
    int r = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_rpc *rpc = NULL;
    static const size_t sizes[] = {0, 8, 4096, 65536 + 7, 1 << 20};
    enum { NS = sizeof sizes / sizeof sizes[0] };
    uint8_t *src = malloc(1 << 20);
    if (open_rpc(comm, k, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "echo", fn_echo, NULL)) return fail(o, r, 2, "register");
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 3, "barrier");
    for (int si = 0; si < NS; si++) {
        size_t n = sizes[si];
        fill(src, n, (unsigned)(r * 7 + si));
        for (int d = 0; d < world; d++) {
            void *rep = NULL;
            size_t rn = 0;
            if (tdm_rpc_call(rpc, d, "echo", src, n, &rep, &rn, timeout_ms())) return fail(o, r, 4, "call");
            if (rn != n || (n && !check_echo(src, rep, n, d))) {
                free(rep);
                return fail(o, r, 5, "echo reply wrong");
            }
            free(rep);
        }
        tdm_rpc_future *f[MAX_RANKS] = {0};
        for (int d = 0; d < world; d++)
            if (tdm_rpc_call_async(rpc, (r + d) % world, "echo", src, n, &f[d]))
                return fail(o, r, 6, "call_async");
        for (int d = 0; d < world; d++) {
            void *rep = NULL;
            size_t rn = 0;
            if (tdm_rpc_future_wait(f[d], timeout_ms(), &rep, &rn)) return fail(o, r, 7, "future_wait");
            if (!tdm_rpc_future_done(f[d]) || rn != n || (n && !check_echo(src, rep, n, (r + d) % world))) {
                free(rep);
                return fail(o, r, 8, "future reply wrong");
            }
            free(rep);
            /* its result is handed over once */
            if (tdm_rpc_future_wait(f[d], 0, NULL, NULL) != TDM_STATUS_INVALID_ARG)
                return fail(o, r, 9, "second wait");
            tdm_rpc_future_free(f[d]);
        }
    }
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 10, "final barrier");
    tdm_rpc_stats s;
    tdm_rpc_get_stats(rpc, &s);
    o->served[r] = (int64_t)s.calls_served;
    tdm_rpc_free(rpc);
    free(src);
    o->status[r] = 0;
    return 0;
}

static void run_world(int world, tdm_shm_spawn_fn fn, rpc_case *k)
{
    memset(k->o, 0, sizeof *k->o);
    for (int r = 0; r < world; r++) k->o->status[r] = -1;
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000), .grace_ms = tu_scaled_ms(20000)};
    tdm_status st = tdm_shm_spawn(world, fn, k, &so, NULL);
    for (int r = 0; r < world; r++)
        if (k->o->status[r])
            fprintf(stderr, "%s world %d rank %d: %s\n", tdm_rpc_transport_name(k->tp), world, r,
                    k->o->err[r]);
    for (int r = 0; r < world; r++)
        cr_assert_eq(k->o->status[r], 0, "%s world %d rank %d: %s", tdm_rpc_transport_name(k->tp), world, r,
                     k->o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
}

static rpc_out *shared_out(void)
{
    rpc_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    return o;
}

static void calls_all_worlds(tdm_rpc_transport tp)
{
    rpc_case k = {.tp = tp, .o = shared_out()};
    /* every world 2..8; under the sanitizers (TANDEM_TEST_MATRIX=rotate-ops,
     * ranks many times slower) the smallest, an odd one and the largest */
    const char *m = getenv("TANDEM_TEST_MATRIX");
    int sparse = m && !strcmp(m, "rotate-ops");
    for (int world = 2; world <= MAX_RANKS; world++) {
        if (sparse && world != 2 && world != 5 && world != MAX_RANKS) continue;
        run_world(world, calls_rank, &k);
        /* every rank served: 5 sizes x world callers x 2 (sync, async),
         * plus the barriers' calls */
        for (int r = 0; r < world; r++)
            cr_assert_geq(k.o->served[r], 5 * world * 2, "%d served %lld", r, (long long)k.o->served[r]);
    }
    munmap(k.o, sizeof *k.o);
}

Test(rpc, calls_and_futures_shm_worlds_2_to_8, .timeout = 240) { calls_all_worlds(TDM_RPC_SHM); }
Test(rpc, calls_and_futures_tcp_worlds_2_to_8, .timeout = 240) { calls_all_worlds(TDM_RPC_TCP); }

/* --- many callers, one callee -------------------------------------------- */

#define CONC_THREADS 4
#define CONC_CALLS 100

typedef struct conc_thread {
    tdm_rpc *rpc;
    int ok;
    char err[400];
} conc_thread;

static void *conc_main(void *arg)
{
    conc_thread *t = arg;
    for (int i = 0; i < CONC_CALLS; i++) {
        int64_t one = 1, *rep = NULL;
        size_t rn = 0;
        tdm_status st = tdm_rpc_call(t->rpc, 0, "count", &one, sizeof one, (void **)&rep, &rn, timeout_ms());
        if (st || rn != sizeof(int64_t) || *rep < 1) {
            snprintf(t->err, sizeof t->err, "call %d: %s", i, tdm_error_message());
            free(rep);
            return NULL;
        }
        free(rep);
    }
    t->ok = 1;
    return NULL;
}

static int conc_rank(tdm_comm *comm, void *arg)
{
    rpc_case *k = arg;
    rpc_out *o = k->o;
    int r = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    counter c = {.mu = PTHREAD_MUTEX_INITIALIZER};
    tdm_rpc *rpc = NULL;
    if (open_rpc(comm, k, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "count", fn_count, &c)) return fail(o, r, 2, "register");
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 3, "barrier");
    if (r != 0) {
        conc_thread t[CONC_THREADS] = {0};
        pthread_t th[CONC_THREADS];
        for (int i = 0; i < CONC_THREADS; i++) {
            t[i].rpc = rpc;
            pthread_create(&th[i], NULL, conc_main, &t[i]);
        }
        for (int i = 0; i < CONC_THREADS; i++) pthread_join(th[i], NULL);
        for (int i = 0; i < CONC_THREADS; i++)
            if (!t[i].ok) {
                snprintf(o->err[r], sizeof o->err[r], "thread %d: %s", i, t[i].err);
                return o->status[r] = 4;
            }
    }
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 5, "barrier 2");
    if (r == 0 && c.n != (int64_t)(world - 1) * CONC_THREADS * CONC_CALLS) {
        snprintf(o->err[r], sizeof o->err[r], "count %lld, expected %d", (long long)c.n,
                 (world - 1) * CONC_THREADS * CONC_CALLS);
        return o->status[r] = 6;
    }
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

Test(rpc, many_ranks_and_threads_call_one_shm, .timeout = 120)
{
    rpc_case k = {.tp = TDM_RPC_SHM, .o = shared_out()};
    run_world(6, conc_rank, &k);
    munmap(k.o, sizeof *k.o);
}

Test(rpc, many_ranks_and_threads_call_one_tcp, .timeout = 120)
{
    rpc_case k = {.tp = TDM_RPC_TCP, .o = shared_out()};
    run_world(6, conc_rank, &k);
    munmap(k.o, sizeof *k.o);
}

/* --- errors ---------------------------------------------------------------- */

#define SMALL_MAX 4096

static int errors_rank(tdm_comm *comm, void *arg)
{
    rpc_case *k = arg;
    rpc_out *o = k->o;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    if (open_rpc(comm, k, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "echo", fn_echo, NULL) || tdm_rpc_register(rpc, "fail", fn_fail, NULL))
        return fail(o, r, 2, "register");
    if (tdm_rpc_register(rpc, "echo", fn_echo, NULL) != TDM_STATUS_INVALID_ARG ||
        !strstr(tdm_error_message(), "already registered"))
        return fail(o, r, 3, "a second 'echo' was not refused");
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 4, "barrier");
    if (r == 0) {
        int v = 42;
        tdm_status st = tdm_rpc_call(rpc, 1, "fail", &v, sizeof v, NULL, NULL, timeout_ms());
        if (st != TDM_STATUS_INVALID_ARG || !strstr(tdm_error_message(), "rank 1: bad input 42 from rank 0"))
            return fail(o, r, 5, "the callee's error did not come back");
        st = tdm_rpc_call(rpc, 1, "nope", NULL, 0, NULL, NULL, timeout_ms());
        if (st != TDM_STATUS_INVALID_ARG || !strstr(tdm_error_message(), "no function named 'nope'"))
            return fail(o, r, 6, "an unknown name was not refused");
        uint8_t *big = calloc(1, SMALL_MAX + 1);
        st = tdm_rpc_call(rpc, 1, "echo", big, SMALL_MAX + 1, NULL, NULL, timeout_ms());
        if (st != TDM_STATUS_INVALID_ARG || !strstr(tdm_error_message(), "over the limit of 4096"))
            return fail(o, r, 7, "oversized arguments were not refused");
        st = tdm_rpc_call(rpc, 7, "echo", big, 1, NULL, NULL, timeout_ms());
        if (st != TDM_STATUS_INVALID_ARG || !strstr(tdm_error_message(), "rank 7 is not in the job"))
            return fail(o, r, 8, "a rank outside the job was not refused");
        /* and the callee still serves, at the limit */
        void *rep = NULL;
        size_t rn = 0;
        fill(big, SMALL_MAX, 3);
        if (tdm_rpc_call(rpc, 1, "echo", big, SMALL_MAX, &rep, &rn, timeout_ms()) || rn != SMALL_MAX ||
            !check_echo(big, rep, rn, 1))
            return fail(o, r, 9, "echo after the errors");
        free(rep);
        /* a future that times out stays pending and can be waited again */
        free(big);
    }
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 10, "barrier 2");
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

static void errors_on(tdm_rpc_transport tp)
{
    rpc_case k = {.tp = tp, .o = shared_out(), .max_msg = SMALL_MAX};
    run_world(2, errors_rank, &k);
    munmap(k.o, sizeof *k.o);
}

Test(rpc, errors_reach_the_caller_shm, .timeout = 60) { errors_on(TDM_RPC_SHM); }
Test(rpc, errors_reach_the_caller_tcp, .timeout = 60) { errors_on(TDM_RPC_TCP); }

/* --- timeouts ------------------------------------------------------------- */

static tdm_status fn_slow(tdm_rpc_req *req, void *ctx)
{
    (void)req;
    (void)ctx;
    usleep(300 * 1000);
    return TDM_STATUS_OK;
}

static int timeout_rank(tdm_comm *comm, void *arg)
{
    rpc_case *k = arg;
    rpc_out *o = k->o;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    if (open_rpc(comm, k, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "slow", fn_slow, NULL)) return fail(o, r, 2, "register");
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 3, "barrier");
    if (r == 0) {
        tdm_rpc_future *f = NULL;
        if (tdm_rpc_call_async(rpc, 1, "slow", NULL, 0, &f)) return fail(o, r, 4, "call_async");
        /* 1 ms: the callee sleeps 300 ms, so this wait ends first */
        if (tdm_rpc_future_wait(f, 1, NULL, NULL) != TDM_STATUS_TIMEOUT ||
            !strstr(tdm_error_message(), "no reply within 1 ms"))
            return fail(o, r, 5, "a short wait did not time out");
        if (tdm_rpc_future_done(f)) return fail(o, r, 6, "done after a timeout");
        if (tdm_rpc_future_wait(f, timeout_ms(), NULL, NULL)) return fail(o, r, 7, "second wait");
        tdm_rpc_future_free(f);
        /* a future freed while pending: its reply is dropped on arrival */
        if (tdm_rpc_call_async(rpc, 1, "slow", NULL, 0, &f)) return fail(o, r, 8, "call_async 2");
        tdm_rpc_future_free(f);
    }
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 9, "barrier 2");
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

Test(rpc, future_wait_times_out_and_waits_again, .timeout = 60)
{
    rpc_case k = {.tp = TDM_RPC_SHM, .o = shared_out()};
    run_world(2, timeout_rank, &k);
    k.tp = TDM_RPC_TCP;
    run_world(2, timeout_rank, &k);
    munmap(k.o, sizeof *k.o);
}

/* --- a dead callee -------------------------------------------------------- */

static tdm_status fn_die(tdm_rpc_req *req, void *ctx)
{
    (void)req;
    (void)ctx;
    raise(SIGKILL);
    return TDM_STATUS_OK;
}

/* The bound on naming a dead callee: its death is seen by a liveness
 * check every 20 ms (shm) or the closed connection (TCP); generous for a
 * loaded machine. */
#define DEAD_BOUND_MS 5000

static int dead_rank(tdm_comm *comm, void *arg)
{
    rpc_case *k = arg;
    rpc_out *o = k->o;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    if (open_rpc(comm, k, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "die", fn_die, NULL) || tdm_rpc_register(rpc, "echo", fn_echo, NULL))
        return fail(o, r, 2, "register");
    if (tdm_rpc_barrier(rpc, timeout_ms())) return fail(o, r, 3, "barrier");
    if (r == 0) {
        uint64_t t0 = tdm_time_ns();
        /* no time bound: only the callee's death ends this wait */
        tdm_status st = tdm_rpc_call(rpc, 2, "die", NULL, 0, NULL, NULL, -1);
        o->dead_ms = (double)(tdm_time_ns() - t0) / 1e6;
        if (st != TDM_STATUS_PEER_FAILED || !strstr(tdm_error_message(), "to rank 2"))
            return fail(o, r, 4, "the dead callee was not named");
        snprintf(o->err[r], sizeof o->err[r], "%s", tdm_error_message());
        /* later calls to it fail at once; the others still serve */
        if (tdm_rpc_call(rpc, 2, "echo", NULL, 0, NULL, NULL, -1) != TDM_STATUS_PEER_FAILED)
            return fail(o, r, 5, "a call after the death");
        if (tdm_rpc_call(rpc, 1, "echo", NULL, 0, NULL, NULL, timeout_ms()))
            return fail(o, r, 6, "rank 1 after rank 2's death");
        if (tdm_rpc_call(rpc, 1, "echo", NULL, 0, NULL, NULL, timeout_ms()))
            return fail(o, r, 7, "rank 1 after rank 2's death");
    }
    /* ranks 0 and 1 wait for rank 0's verdict (rank 1's endpoint must
     * outlive rank 0's calls) over a barrier that rank 2 cannot join: the
     * communicator's would fail; this one is the survivors' own */
    if (r == 2) {
        /* serves until its "die" call kills it */
        usleep((useconds_t)timeout_ms() * 1000);
        return fail(o, r, 8, "rank 2 was never called");
    }
    if (r == 1) {
        uint64_t t0 = tdm_time_ns();
        while (!o->dead_ms && tdm_time_ns() - t0 < (uint64_t)timeout_ms() * 1000000u) usleep(5000);
        usleep(200 * 1000);
    }
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

static void dead_on(tdm_rpc_transport tp)
{
    rpc_case k = {.tp = tp, .o = shared_out()};
    memset(k.o, 0, sizeof *k.o);
    for (int r = 0; r < 3; r++) k.o->status[r] = -1;
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000), .grace_ms = tu_scaled_ms(30000)};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(3, dead_rank, &k, &so, &res);
    cr_assert_neq(st, TDM_STATUS_OK, "rank 2 was killed: the job fails");
    cr_assert(WIFSIGNALED(res.wstatus[2]) && WTERMSIG(res.wstatus[2]) == SIGKILL);
    cr_assert_eq(k.o->status[0], 0, "rank 0: %s", k.o->err[0]);
    cr_assert_eq(k.o->status[1], 0, "rank 1: %s", k.o->err[1]);
    cr_assert_lt(k.o->dead_ms, tu_scaled_ms(DEAD_BOUND_MS), "named after %.0f ms", k.o->dead_ms);
    cr_assert(strstr(k.o->err[0], "rank 2"), "%s", k.o->err[0]);
    munmap(k.o, sizeof *k.o);
}

Test(rpc, dead_callee_named_within_bound_shm, .timeout = 90) { dead_on(TDM_RPC_SHM); }
Test(rpc, dead_callee_named_within_bound_tcp, .timeout = 90) { dead_on(TDM_RPC_TCP); }

/* A killed rank leaves no segment name behind: rank 0 is SIGKILLed 1 s
 * into set-up while rank 1 arrives 3 s late (a slow start on a loaded
 * machine); no /dev/shm name of rank 0's may remain (the segment is a
 * memfd: it has none). */
static pid_t *g_rank0_pid;

static void *kill_self_later(void *arg)
{
    (void)arg;
    sleep(1);
    raise(SIGKILL);
    return NULL;
}

static int late_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    if (r == 1) {
        sleep(3);
    } else {
        *g_rank0_pid = getpid();
        pthread_t t;
        if (pthread_create(&t, NULL, kill_self_later, NULL)) return 1;
    }
    tdm_rpc_opts ro = {.transport = TDM_RPC_SHM, .comm = comm, .setup_ms = tu_scaled_ms(20000)};
    if (tdm_rpc_init(&rpc, &ro)) return 1;
    tdm_rpc_free(rpc);
    return 0;
}

Test(rpc, a_rank_killed_in_setup_leaves_no_shm_name, .timeout = 90)
{
    g_rank0_pid = mmap(NULL, sizeof *g_rank0_pid, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(g_rank0_pid, MAP_FAILED);
    *g_rank0_pid = 0;
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    tdm_status st = tdm_shm_spawn(2, late_rank, NULL, &so, NULL);
    cr_assert_neq(st, TDM_STATUS_OK, "rank 0 was killed: the spawn must fail");
    cr_assert_gt(*g_rank0_pid, 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "ls /dev/shm | grep -q '^tandem-rpc-%d-'", (int)*g_rank0_pid);
    int left = system(cmd) == 0;
    snprintf(cmd, sizeof cmd, "rm -f /dev/shm/tandem-rpc-%d-*", (int)*g_rank0_pid);
    if (left) cr_assert_eq(system(cmd), 0);   /* clean up before failing */
    cr_assert(!left, "/dev/shm/tandem-rpc-%d-* was left behind", (int)*g_rank0_pid);
    munmap(g_rank0_pid, sizeof *g_rank0_pid);
}
