/* shm/spawn.c: fork N ranks around a function, watch them, clean up.
 * See shm/spawn.h. Not a general process launcher. */
#include "shm/spawn.h"
#include "shm/shm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/proc.h"
#include "core/timer.h"

static void tdm_shm_spawn_child(tdm_shm_group *g, int rank, pid_t parent,
                                tdm_shm_spawn_fn fn, void *arg, const tdm_shm_opts *o)
{
    /* Die with the parent, so a killed test leaves no rank behind. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(125);
    tdm_log_reset();
    tdm_comm *comm = NULL;
    tdm_status st = tdm_shm_comm_init(&comm, g, rank, o);
    if (st) {
        fprintf(stderr, "rank %d: %s\n", rank, tdm_error_message());
        _exit(124);
    }
    int rc = fn(comm, arg);
    tdm_comm_free(comm);
    fflush(stdout);
    fflush(stderr);
    /* exit codes are 8 bits: a non-zero rc must not wrap to success */
    _exit(rc == 0 ? 0 : (rc & 0xff) ? (rc & 0xff) : 1);
}

static void tdm_shm_spawn_sleep_ms(double ms)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(ms * 1e6)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

void tdm_shm_wait_status_str(int wstatus, char *out, size_t n)
{
    if (WIFSIGNALED(wstatus))
        snprintf(out, n, "was killed by signal %d (%s)", WTERMSIG(wstatus),
                 strsignal(WTERMSIG(wstatus)));
    else if (WIFEXITED(wstatus))
        snprintf(out, n, "exited with code %d", WEXITSTATUS(wstatus));
    else
        snprintf(out, n, "died (wait status 0x%x)", (unsigned)wstatus);
}

/* --- the watch: one rule for naming the root cause ------------------------- */

static int tdm_shm_failed(int wstatus) { return !(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0); }

void tdm_shm_watch_init(tdm_shm_watch *w, tdm_shm_group *g, int world)
{
    memset(w, 0, sizeof *w);
    w->group = g;
    w->world = world;
    w->abort_raiser = w->abort_culprit = -1;
}

void tdm_shm_watch_started(tdm_shm_watch *w, int rank, pid_t pid)
{
    if (rank < 0 || rank >= w->world) return;
    w->pid[rank] = pid;
    tdm_shm_group_set_pid(w->group, rank, pid);
}

int tdm_shm_watch_ended(tdm_shm_watch *w, int rank, int wstatus)
{
    if (rank < 0 || rank >= w->world || w->ended[rank]) return 0;
    w->wstatus[rank] = wstatus;
    w->ended[rank] = ++w->n_ended;
    w->induced[rank] = w->stopping;
    tdm_shm_group_mark_ended(w->group, rank, wstatus);
    return tdm_shm_failed(wstatus);
}

/* The group abort as it stands, into the watch. */
static int tdm_shm_watch_read_abort(const tdm_shm_watch *w, int *raiser, int *culprit,
                                    char *reason, size_t n)
{
    tdm_shm_abort_info a;
    if (!w->group || !tdm_shm_abort_get(w->group->base, &w->group->geom, w->group->base, &a))
        return 0;
    *raiser = a.raiser;
    *culprit = a.culprit;
    /* the reason lives in the segment, which any rank can write: bounded copy */
    snprintf(reason, n, "%.*s", TDM_SHM_REASON_BYTES - 1, a.reason);
    return 1;
}

void tdm_shm_watch_stopping(tdm_shm_watch *w, tdm_status st, const char *why)
{
    if (w->stopping) return;
    w->stopping = 1;
    w->stop_cause = why == NULL;
    w->stop_status = st;
    snprintf(w->stop_why, sizeof w->stop_why, "%s", why ? why : "");
    w->aborted = tdm_shm_watch_read_abort(w, &w->abort_raiser, &w->abort_culprit,
                                          w->abort_reason, sizeof w->abort_reason);
}

/* pid's state letter from /proc/pid/stat (the field after the command
 * name, which may itself hold spaces and parentheses); '?' when unknown. */
static char tdm_shm_proc_state(pid_t pid)
{
    char buf[512];
    const char *p = tdm_proc_stat(pid, buf, sizeof buf);
    return p ? p[0] : '?';
}

int tdm_shm_watch_only_stopped(const tdm_shm_watch *w)
{
    int stopped = 0;
    for (int r = 0; r < w->world; r++) {
        if (w->pid[r] <= 0 || w->ended[r]) continue;
        char st = tdm_shm_proc_state(w->pid[r]);
        if (st != 'T' && st != 't') return 0;
        stopped++;
    }
    return stopped;
}

tdm_status tdm_shm_watch_blame(const tdm_shm_watch *w, tdm_shm_cause *cause)
{
    tdm_shm_cause dummy;
    if (!cause) cause = &dummy;
    *cause = TDM_SHM_CAUSE_NONE;
    int failed = w->stopping;
    for (int r = 0; r < w->world; r++)
        if (w->ended[r] && tdm_shm_failed(w->wstatus[r])) failed = 1;
    if (!failed) return TDM_STATUS_OK;
    *cause = TDM_SHM_CAUSE_RANK;
    char how[128];
    /* 1. the first failure anyone saw, as of the first signal */
    int aborted = w->aborted, raiser = w->abort_raiser, culprit = w->abort_culprit;
    char live[512];
    const char *reason = w->abort_reason;
    if (!w->stopping) {
        aborted = tdm_shm_watch_read_abort(w, &raiser, &culprit, live, sizeof live);
        reason = live;
    }
    if (aborted) {
        int c = culprit >= 0 ? culprit : raiser;
        if (c >= 0 && w->ended[c] && !w->induced[c] && tdm_shm_failed(w->wstatus[c])) {
            /* it ended by itself: how, exactly, in the parent's words;
             * then its own, if it raised the abort */
            tdm_shm_wait_status_str(w->wstatus[c], how, sizeof how);
            if (raiser == c)
                return tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s: %s", c,
                                     (int)w->pid[c], how, reason);
            if (raiser >= 0)
                return tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s", c,
                                     (int)w->pid[c], how);
        }
        /* its end (if any) was the teardown's, an exit 0, or not its own
         * doing: the words of whoever saw it name it */
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "%s", reason);
    }
    /* 2. no abort: the first rank that failed by itself */
    int first = -1;
    for (int r = 0; r < w->world; r++)
        if (w->ended[r] && !w->induced[r] && tdm_shm_failed(w->wstatus[r]) &&
            (first < 0 || w->ended[r] < w->ended[first]))
            first = r;
    if (first >= 0) {
        tdm_shm_wait_status_str(w->wstatus[first], how, sizeof how);
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s", first,
                             (int)w->pid[first], how);
    }
    /* 3. the parent's own reason for stopping */
    if (w->stopping && !w->stop_cause) {
        *cause = TDM_SHM_CAUSE_PARENT;
        return tdm_error_set(w->stop_status ? w->stop_status : TDM_STATUS_ABORTED, "%s",
                             w->stop_why);
    }
    /* stopped for a rank's failure that left no trace (cannot happen: a
     * failure is an abort); name the first failure anyway */
    for (int r = 0; r < w->world; r++)
        if (w->ended[r] && tdm_shm_failed(w->wstatus[r]) &&
            (first < 0 || w->ended[r] < w->ended[first]))
            first = r;
    if (first < 0) return tdm_error_set(TDM_STATUS_PEER_FAILED, "ranks were stopped");
    tdm_shm_wait_status_str(w->wstatus[first], how, sizeof how);
    return tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s", first,
                         (int)w->pid[first], how);
}

/* --- fork N ranks ----------------------------------------------------------- */

/* After a failure, a rank still running that has used this much CPU time
 * since it was last seen inside a collective (and was outside one at each
 * of this many polls at least) is computing - an evaluation, a long
 * forward - and will not see the group abort before its next collective,
 * which may be seconds away: it is stopped now (SIGTERM), as a rank inside
 * a collective stops by itself at once. CPU time, not wall time: on a
 * loaded machine a training rank may wait for a core for longer than
 * this between two collectives, and a rank asleep (a debugger, a test's
 * usleep) is not computing; neither is stopped early. */
#define TDM_SHM_BUSY_STOP_MS 300
#define TDM_SHM_BUSY_POLLS 8

/* A rank's in_call counter (shm/coll.c): > 0 while inside a collective. */
static int tdm_shm_spawn_in_call(const tdm_shm_group *g, int r)
{
    const tdm_shm_ctrl *k = tdm_shm_geom_ctrl(&g->geom, g->base, r);
    return atomic_load_explicit(&k->in_call, memory_order_relaxed) > 0;
}

/* CPU time pid has used (user + system, all its threads), in ms; -1
 * when /proc cannot tell. */
static int64_t tdm_shm_spawn_cpu_ms(pid_t pid)
{
    char buf[1024];
    /* fields 14 and 15 (utime, stime); p is field 3 (the state) */
    const char *p = tdm_proc_stat(pid, buf, sizeof buf);
    unsigned long long ut, st;
    if (!p || sscanf(p, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    long hz = sysconf(_SC_CLK_TCK);
    return hz > 0 ? (int64_t)((ut + st) * 1000ull / (unsigned long long)hz) : -1;
}

/* The busy-rank rule above, at one poll of the teardown. */
typedef struct tdm_shm_busy {
    int64_t cpu0[TDM_SHM_MAX_RANKS];     /* its CPU ms when first seen outside; -1: not */
    int polls[TDM_SHM_MAX_RANKS];
    int stopped[TDM_SHM_MAX_RANKS];
} tdm_shm_busy;

static void tdm_shm_spawn_stop_busy(tdm_shm_watch *w, tdm_shm_busy *b)
{
    for (int r = 0; r < w->world; r++) {
        if (w->pid[r] <= 0 || w->ended[r] || b->stopped[r]) continue;
        if (tdm_shm_spawn_in_call(w->group, r)) {
            b->cpu0[r] = -1;
            continue;
        }
        int64_t cpu = tdm_shm_spawn_cpu_ms(w->pid[r]);
        if (cpu < 0) continue;
        if (b->cpu0[r] < 0) {
            b->cpu0[r] = cpu;
            b->polls[r] = 0;
        }
        if (++b->polls[r] < TDM_SHM_BUSY_POLLS || cpu - b->cpu0[r] < TDM_SHM_BUSY_STOP_MS)
            continue;
        TDM_INFO(SHM, "rank %d (pid %d) has computed for %d ms of CPU outside any collective "
                 "since a failure: stopping it", r, (int)w->pid[r], TDM_SHM_BUSY_STOP_MS);
        tdm_shm_watch_stopping(w, TDM_STATUS_OK, NULL);   /* a rank failed */
        kill(w->pid[r], SIGTERM);
        b->stopped[r] = 1;
    }
}

tdm_status tdm_shm_spawn(int world, tdm_shm_spawn_fn fn, void *arg,
                         const tdm_shm_spawn_opts *opts, tdm_shm_spawn_result *res)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_shm_group *g = NULL;
    tdm_shm_spawn_opts o = opts ? *opts : (tdm_shm_spawn_opts){0};
    int64_t timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : 60000;
    int64_t grace_ms = o.grace_ms > 0 ? o.grace_ms : 3000;
    tdm_shm_watch w;
    int running = 0, start_failed = 0;
    TDM_REQUIRE(fn && world >= 1 && world <= TDM_SHM_MAX_RANKS, TDM_STATUS_INVALID_ARG,
                "tdm_shm_spawn: need a function and 1..%d ranks (got %d)", TDM_SHM_MAX_RANKS,
                world);
    TDM_TRY(tdm_shm_group_create(&g, world, &o.shm));
    tdm_shm_watch_init(&w, g, world);
    uint64_t t0 = tdm_time_ns();
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < world; r++) {
        pid_t p = fork();
        if (p == 0) tdm_shm_spawn_child(g, r, parent, fn, arg, &o.shm);
        if (p < 0) {
            st = tdm_error_set(TDM_STATUS_SYSTEM, "spawn: fork of rank %d: %s", r, strerror(errno));
            tdm_shm_raise(g->base, &g->geom, g->base, world, &g->raising, -1, TDM_STATUS_ABORTED,
                          "spawn: fork of rank %d failed", r);
            start_failed = 1;
            break;
        }
        tdm_shm_watch_started(&w, r, p);
        running++;
    }
    uint64_t deadline = t0 + (uint64_t)timeout_ms * 1000000ull, grace_end = UINT64_MAX;
    int signalled = 0, settled = 0;
    tdm_shm_busy busy;
    memset(&busy, 0, sizeof busy);
    for (int r = 0; r < TDM_SHM_MAX_RANKS; r++) busy.cpu0[r] = -1;
    double nap_ms = 0.5;   /* grows to 10 ms while nothing happens */
    while (running > 0) {
        int reaped = 0;
        for (int r = 0; r < world; r++) {
            if (w.pid[r] <= 0 || w.ended[r]) continue;
            int ws;
            pid_t pr = waitpid(w.pid[r], &ws, WNOHANG);
            if (pr == 0 || (pr < 0 && errno == EINTR)) continue;
            reaped = 1;
            running--;
            if (pr < 0) {
                /* ECHILD: the caller ignores SIGCHLD, so exit statuses are
                 * gone; count the rank as failed, and say so */
                TDM_WARN(SHM, "rank %d (pid %d): waitpid: %s (is SIGCHLD ignored?)", r,
                         (int)w.pid[r], strerror(errno));
                ws = 255 << 8;
            }
            if (res) res->wstatus[r] = ws;
            /* after a failure the others get grace_ms to stop on their own */
            if (tdm_shm_watch_ended(&w, r, ws) && grace_end == UINT64_MAX && !o.outlive_failures)
                grace_end = tdm_time_ns() + (uint64_t)grace_ms * 1000000ull;
            if (res) res->induced[r] = w.induced[r];
        }
        if (running == 0) break;
        /* a rank failed and the rest are stopped: nothing more will come
         * from them before the SIGKILL below, so the caller may diagnose
         * now rather than after the grace period (read /proc only then) */
        if (o.on_settled && !settled && grace_end != UINT64_MAX && signalled == 0 &&
            tdm_shm_watch_only_stopped(&w)) {
            settled = 1;
            o.on_settled(&w, o.settled_ctx);
        }
        uint64_t now = tdm_time_ns();
        if (grace_end != UINT64_MAX && signalled == 0) tdm_shm_spawn_stop_busy(&w, &busy);
        if (signalled == 2 && now >= deadline + 5000ull * 1000000ull) break; /* unkillable */
        if ((now >= deadline || now >= grace_end) && signalled < 2) {
            if (!signalled) {
                char why[256] = "";
                if (now >= deadline && grace_end == UINT64_MAX) {
                    size_t len = 0;
                    len += (size_t)snprintf(why, sizeof why, "spawn: rank(s) ");
                    for (int r = 0, n = 0; r < world; r++)
                        if (w.pid[r] > 0 && !w.ended[r] && len < sizeof why - 64)
                            len += (size_t)snprintf(why + len, sizeof why - len, "%s%d",
                                                    n++ ? "," : "", r);
                    snprintf(why + len, sizeof why - len, " still running after %lld ms; killed",
                             (long long)timeout_ms);
                }
                tdm_shm_watch_stopping(&w, TDM_STATUS_TIMEOUT, why[0] ? why : NULL);
            }
            int sig = signalled == 0 ? SIGTERM : SIGKILL;
            for (int r = 0; r < world; r++)
                if (w.pid[r] > 0 && !w.ended[r]) kill(w.pid[r], sig);
            signalled++;
            deadline = now + 500ull * 1000000ull;
            grace_end = deadline;
        }
        if (reaped) {
            nap_ms = 0.5;
        } else {
            tdm_shm_spawn_sleep_ms(nap_ms);
            nap_ms = nap_ms * 2 < 10.0 ? nap_ms * 2 : 10.0;
        }
    }
    if (res) {
        for (int r = 0; r < world; r++) res->pid[r] = w.pid[r];
        res->elapsed_ms = tdm_time_ms_since(t0);
    }
    if (!start_failed) st = tdm_shm_watch_blame(&w, NULL);
    tdm_shm_group_free(g);
    return st;
fail:
    tdm_shm_group_free(g);
    return st;
}
