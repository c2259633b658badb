/* tests/test_rpc_stall.c: a peer alive but not reading (its process
 * SIGSTOPped) never blocks a send for longer than its bound, on both
 * transports: a caller sending more than the ring or the socket buffers
 * hold to a stopped rank gets "rank 1 has not read for 1.0 s" within its
 * call's timeout; a server replying to a stopped caller gives up after
 * the endpoint's send bound and goes on serving the others. The channel
 * left half-written is closed at both ends (the stopped rank, resumed,
 * takes the other for gone instead of decoding garbage, after the
 * messages sent whole before it), no thread is left behind, and no
 * /dev/shm entry appears. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/timer.h"
#include "rpc/rpc.h"
#include "shm/spawn.h"
#include "tests/timeout_util.h"

#define WORLD 3
/* More than a 64 KiB ring and than loopback TCP's socket buffers hold
 * (net.ipv4.tcp_rmem's limit is 32 MiB on the CI VM, plus a 4 MiB send
 * buffer): the whole message must not fit, or the send never stalls. */
#define BIG_BYTES ((size_t)96 << 20)
/* The bound that must fire: a call's timeout, an endpoint's send bound. */
#define STALL_MS 1000
/* Slack on top of it for a loaded machine (scaled). */
#define SLACK_MS 5000

typedef struct stall_out {
    int status[WORLD];
    char err[WORLD][700];
    pid_t pid[WORLD];
    _Atomic int phase;        /* 1: the stalled send is over; 2: rank 2 called rank 1 */
    _Atomic int left;         /* ranks out of the set-up barrier */
    double stall_ms;          /* how long the failing send/reply took */
    char got[700];            /* the error it gave */
    char peer_why[700];       /* how the resumed rank names the other */
} stall_out;

typedef struct stall_case {
    tdm_rpc_transport tp;
    stall_out *o;
} stall_case;

static int fail(stall_out *o, int r, int code, const char *what)
{
    snprintf(o->err[r], sizeof o->err[r], "%s: %s", what, tdm_error_message());
    o->status[r] = code;
    return code;
}

static int64_t healthy_ms(void) { return tu_scaled_ms(30000); }

static int threads_now(void)
{
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static char proc_state(pid_t pid)
{
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t k = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[k] = '\0';
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' ? p[2] : 0;
}

/* Waits (bounded, healthy) until pid is stopped (want 1) or running. */
static int wait_stopped(pid_t pid, int want)
{
    uint64_t t0 = tdm_time_ns();
    while (tdm_time_ns() - t0 < (uint64_t)healthy_ms() * 1000000u) {
        char s = proc_state(pid);
        if ((s == 'T' || s == 't') == want) return 1;
        usleep(2000);
    }
    return 0;
}

static int wait_phase(stall_out *o, int phase)
{
    uint64_t t0 = tdm_time_ns();
    while (atomic_load(&o->phase) < phase)
        if (tdm_time_ns() - t0 > (uint64_t)healthy_ms() * 1000000u) return 0;
        else usleep(2000);
    return 1;
}

/* The resumed rank learns that the other closed their channel. */
static int wait_peer_gone(tdm_rpc *rpc, int peer, char *why, size_t n)
{
    uint64_t t0 = tdm_time_ns();
    while (tdm_time_ns() - t0 < (uint64_t)healthy_ms() * 1000000u) {
        if (!tdm_rpc_peer_alive(rpc, peer, why, n)) return 1;
        usleep(5000);
    }
    return 0;
}

static tdm_status fn_echo(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    void *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, req->nbytes, &out));
    if (req->nbytes) memcpy(out, req->args, req->nbytes);
    return TDM_STATUS_OK;
}

/* A reply larger than what the channel holds, sent once the caller is
 * stopped (so its reader cannot have drained it first). */
static tdm_status fn_big(tdm_rpc_req *req, void *ctx)
{
    stall_out *o = ctx;
    void *out = NULL;
    if (!wait_stopped(o->pid[req->caller], 1)) return tdm_rpc_req_fail(req, TDM_STATUS_TIMEOUT, "caller never stopped");
    TDM_CHECK(tdm_rpc_req_reply(req, BIG_BYTES, &out));
    memset(out, 7, BIG_BYTES);
    return TDM_STATUS_OK;
}

/* A small reply sent once the caller is stopped: whole in the channel
 * before the big one behind it is given up on. */
static tdm_status fn_late(tdm_rpc_req *req, void *ctx)
{
    stall_out *o = ctx;
    void *out = NULL;
    if (!wait_stopped(o->pid[req->caller], 1)) return tdm_rpc_req_fail(req, TDM_STATUS_TIMEOUT, "caller never stopped");
    TDM_CHECK(tdm_rpc_req_reply(req, 4, &out));
    memcpy(out, "late", 4);
    return TDM_STATUS_OK;
}

static tdm_status open_rpc(tdm_comm *comm, const stall_case *k, int64_t send_stall_ms, tdm_rpc **out)
{
    tdm_rpc_opts opts = {.transport = k->tp, .comm = comm, .setup_ms = healthy_ms(), .ring_bytes = 64 << 10,
                         .send_stall_ms = send_stall_ms};
    return tdm_rpc_init(out, &opts);
}

/* --- a caller sends to a stopped callee ----------------------------------- */

static int caller_rank(tdm_comm *comm, void *arg)
{
    stall_case *k = arg;
    stall_out *o = k->o;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    o->pid[r] = getpid();
    if (open_rpc(comm, k, 0, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "echo", fn_echo, NULL)) return fail(o, r, 2, "register");
    if (tdm_rpc_barrier(rpc, healthy_ms())) return fail(o, r, 3, "barrier");
    atomic_fetch_add(&o->left, 1);
    if (r == 1) {
        /* rank 0 leaves the barrier once this rank's answer to its
         * release is in; stopping before that answer went (a slow reply
         * thread, seen under TSan) held rank 0 in the barrier for its
         * whole timeout */
        uint64_t t0 = tdm_time_ns();
        while (atomic_load(&o->left) < WORLD)
            if (tdm_time_ns() - t0 > (uint64_t)healthy_ms() * 1000000u)
                return fail(o, r, 3, "the others never left the barrier");
            else usleep(2000);
        raise(SIGSTOP);
        /* resumed by rank 0 once its send gave up: rank 0 closed the
         * channel, and this rank serves rank 2 all the same */
        if (!wait_phase(o, 2)) return fail(o, r, 4, "rank 2 never called");
        if (!wait_peer_gone(rpc, 0, o->peer_why, sizeof o->peer_why))
            return fail(o, r, 5, "rank 0's closed channel was not seen");
    } else if (r == 0) {
        if (!wait_stopped(o->pid[1], 1)) return fail(o, r, 4, "rank 1 never stopped");
        uint8_t *big = malloc(BIG_BYTES);
        if (!big) return fail(o, r, 5, "malloc");
        memset(big, 3, BIG_BYTES);
        int threads = threads_now();
        uint64_t t0 = tdm_time_ns();
        tdm_status st = tdm_rpc_call(rpc, 1, "echo", big, BIG_BYTES, NULL, NULL, STALL_MS);
        o->stall_ms = (double)(tdm_time_ns() - t0) / 1e6;
        snprintf(o->got, sizeof o->got, "%s", tdm_error_message());
        free(big);
        if (st == TDM_STATUS_OK) return fail(o, r, 6, "a call to a stopped rank succeeded");
        /* the channel is closed: later calls fail at once, naming why */
        t0 = tdm_time_ns();
        if (tdm_rpc_call(rpc, 1, "echo", NULL, 0, NULL, NULL, healthy_ms()) != TDM_STATUS_PEER_FAILED ||
            !strstr(tdm_error_message(), "rank 1 has not read"))
            return fail(o, r, 7, "a second call to the stopped rank");
        if (tdm_time_ns() - t0 > (uint64_t)tu_scaled_ms(SLACK_MS) * 1000000u)
            return fail(o, r, 8, "the second call waited (was the first one's channel left open?)");
        if (threads_now() != threads) return fail(o, r, 9, "a thread was left behind");
        if (tdm_rpc_call(rpc, 2, "echo", NULL, 0, NULL, NULL, healthy_ms())) return fail(o, r, 10, "rank 2");
        kill(o->pid[1], SIGCONT);
        atomic_store(&o->phase, 1);
        if (!wait_phase(o, 2)) return fail(o, r, 11, "rank 2 never called rank 1");
    } else {
        if (!wait_phase(o, 1)) return fail(o, r, 4, "rank 0 never finished");
        if (!wait_stopped(o->pid[1], 0)) return fail(o, r, 5, "rank 1 never resumed");
        if (tdm_rpc_call(rpc, 1, "echo", "x", 1, NULL, NULL, healthy_ms()))
            return fail(o, r, 6, "rank 1 after it resumed");
        atomic_store(&o->phase, 2);
    }
    /* ranks 1 and 2 must outlive the others' calls to them */
    usleep(200 * 1000);
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

/* --- a server replies to a stopped caller --------------------------------- */

static int server_rank(tdm_comm *comm, void *arg)
{
    stall_case *k = arg;
    stall_out *o = k->o;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    o->pid[r] = getpid();
    if (open_rpc(comm, k, STALL_MS, &rpc)) return fail(o, r, 1, "init");
    if (tdm_rpc_register(rpc, "echo", fn_echo, NULL) || tdm_rpc_register(rpc, "big", fn_big, o) ||
        tdm_rpc_register(rpc, "late", fn_late, o))
        return fail(o, r, 2, "register");
    if (tdm_rpc_barrier(rpc, healthy_ms())) return fail(o, r, 3, "barrier");
    if (r == 0) {
        tdm_rpc_future *f = NULL, *fl = NULL;
        /* served first: its whole reply is sent while this rank is stopped */
        if (tdm_rpc_call_async(rpc, 1, "late", NULL, 0, &fl)) return fail(o, r, 4, "call_async late");
        if (tdm_rpc_call_async(rpc, 1, "big", NULL, 0, &f)) return fail(o, r, 4, "call_async");
        raise(SIGSTOP);
        /* the reply sent whole before the channel was given up on is
         * delivered (as over TCP, whose stream holds it before its end) */
        void *late = NULL;
        size_t late_n = 0;
        tdm_status lst = tdm_rpc_future_wait(fl, healthy_ms(), &late, &late_n);
        int late_ok = lst == TDM_STATUS_OK && late_n == 4 && !memcmp(late, "late", 4);
        free(late);
        tdm_rpc_future_free(fl);
        if (!late_ok) return fail(o, r, 6, "the reply sent whole before the abandoned one");
        /* resumed by rank 2: rank 1 gave up on the reply and closed the
         * channel, so the call fails naming rank 1 (not a garbled reply) */
        tdm_status st = tdm_rpc_future_wait(f, healthy_ms(), NULL, NULL);
        snprintf(o->peer_why, sizeof o->peer_why, "%s", tdm_error_message());
        tdm_rpc_future_free(f);
        if (st != TDM_STATUS_PEER_FAILED || !strstr(o->peer_why, "rank 1"))
            return fail(o, r, 5, "the abandoned reply");
    } else if (r == 1) {
        /* the serving thread gives up on rank 0 and serves rank 2 */
        if (!wait_phase(o, 2)) return fail(o, r, 4, "rank 2 never got through");
        char why[400];
        if (tdm_rpc_peer_alive(rpc, 0, why, sizeof why)) return fail(o, r, 5, "rank 0 still taken for up");
        snprintf(o->got, sizeof o->got, "%s", why);
    } else {
        if (!wait_stopped(o->pid[0], 1)) return fail(o, r, 4, "rank 0 never stopped");
        int threads = threads_now();
        uint64_t t0 = tdm_time_ns();
        /* queued behind the reply to rank 0 on rank 1's serving thread */
        tdm_status st = tdm_rpc_call(rpc, 1, "echo", "x", 1, NULL, NULL, healthy_ms());
        o->stall_ms = (double)(tdm_time_ns() - t0) / 1e6;
        if (st) return fail(o, r, 5, "rank 1 stopped serving");
        if (threads_now() != threads) return fail(o, r, 6, "a thread was left behind");
        atomic_store(&o->phase, 2);
        kill(o->pid[0], SIGCONT);
    }
    usleep(200 * 1000);
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

/* --- the cases ------------------------------------------------------------- */

static int shm_entries(void)
{
    DIR *d = opendir("/dev/shm");
    int n = 0;
    if (!d) return 0;
    for (struct dirent *e; (e = readdir(d));)
        if (!strncmp(e->d_name, "tandem", 6)) n++;
    closedir(d);
    return n;
}

static stall_out *run(tdm_rpc_transport tp, tdm_shm_spawn_fn fn)
{
    stall_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    memset(o, 0, sizeof *o);
    for (int r = 0; r < WORLD; r++) o->status[r] = -1;
    stall_case k = {.tp = tp, .o = o};
    int before = shm_entries();
    /* the test's own bound: without a bound on sends, a rank blocks here */
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000), .grace_ms = tu_scaled_ms(5000)};
    tdm_status st = tdm_shm_spawn(WORLD, fn, &k, &so, NULL);
    for (int r = 0; r < WORLD; r++)
        cr_assert_eq(o->status[r], 0, "%s rank %d: %s (stalled send: %.0f ms, %s)", tdm_rpc_transport_name(tp), r,
                     o->err[r], o->stall_ms, o->got);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(shm_entries(), before, "a /dev/shm/tandem* entry was left behind");
    return o;
}

static void caller_on(tdm_rpc_transport tp)
{
    stall_out *o = run(tp, caller_rank);
    /* within the call's timeout (from the last byte taken) plus slack */
    cr_assert_lt(o->stall_ms, STALL_MS + tu_scaled_ms(SLACK_MS), "%.0f ms: %s", o->stall_ms, o->got);
    /* no byte taken for the bound, or (the kernel's buffers taking a
     * trickle) not the whole message within the call's timeout */
    cr_assert(strstr(o->got, "rank 1 has not read for 1.0 s") ||
              strstr(o->got, "rank 1 has not read the message within the call's timeout"), "%s", o->got);
    cr_assert(strstr(o->got, "'echo' to rank 1"), "%s", o->got);
    /* the resumed rank 1 takes rank 0 for gone */
    cr_assert(o->peer_why[0], "rank 1 gave no reason");
    munmap(o, sizeof *o);
}

static void server_on(tdm_rpc_transport tp)
{
    stall_out *o = run(tp, server_rank);
    /* rank 2 waited for the reply to rank 0 to give up: the send bound */
    cr_assert_lt(o->stall_ms, STALL_MS + tu_scaled_ms(SLACK_MS), "%.0f ms", o->stall_ms);
    cr_assert(strstr(o->got, "rank 0 has not read for 1.0 s"), "%s", o->got);
    cr_assert(strstr(o->peer_why, "rank 1"), "%s", o->peer_why);
    munmap(o, sizeof *o);
}

Test(rpc_stall, send_to_a_stopped_callee_is_bounded_shm, .timeout = 120) { caller_on(TDM_RPC_SHM); }
Test(rpc_stall, send_to_a_stopped_callee_is_bounded_tcp, .timeout = 120) { caller_on(TDM_RPC_TCP); }
Test(rpc_stall, reply_to_a_stopped_caller_is_bounded_shm, .timeout = 120) { server_on(TDM_RPC_SHM); }
Test(rpc_stall, reply_to_a_stopped_caller_is_bounded_tcp, .timeout = 120) { server_on(TDM_RPC_TCP); }
