/* shm/spawn.c: fork N ranks around a function, watch them, clean up.
 * See shm/spawn.h. Not a general process launcher. */
#include "shm/spawn.h"
#include "shm/shm_impl.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
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

tdm_status tdm_shm_spawn(int world, tdm_shm_spawn_fn fn, void *arg,
                         const tdm_shm_spawn_opts *opts, tdm_shm_spawn_result *res)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_shm_group *g = NULL;
    tdm_shm_spawn_opts o = opts ? *opts : (tdm_shm_spawn_opts){0};
    int64_t timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : 60000;
    int64_t grace_ms = o.grace_ms > 0 ? o.grace_ms : 3000;
    pid_t pid[TDM_SHM_MAX_RANKS] = {0};
    int wst[TDM_SHM_MAX_RANKS] = {0};
    int running = 0, first_bad = -1;
    TDM_REQUIRE(fn && world >= 1 && world <= TDM_SHM_MAX_RANKS, TDM_STATUS_INVALID_ARG,
                "tdm_shm_spawn: need a function and 1..%d ranks (got %d)", TDM_SHM_MAX_RANKS,
                world);
    TDM_TRY(tdm_shm_group_create(&g, world, &o.shm));
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
            break;
        }
        pid[r] = p;
        tdm_shm_group_set_pid(g, r, p);
        running++;
    }
    uint64_t deadline = t0 + (uint64_t)timeout_ms * 1000000ull, grace_end = UINT64_MAX;
    int signalled = 0;
    double nap_ms = 0.5;   /* grows to 10 ms while nothing happens */
    while (running > 0) {
        int reaped = 0;
        for (int r = 0; r < world; r++) {
            if (pid[r] <= 0) continue;
            int ws;
            pid_t w = waitpid(pid[r], &ws, WNOHANG);
            if (w == 0 || (w < 0 && errno == EINTR)) continue;
            reaped = 1;
            running--;
            if (w < 0) {
                /* ECHILD: the caller ignores SIGCHLD, so exit statuses are
                 * gone; count the rank as failed, and say so */
                TDM_WARN(SHM, "rank %d (pid %d): waitpid: %s (is SIGCHLD ignored?)", r,
                         (int)pid[r], strerror(errno));
                ws = 255 << 8;
            }
            wst[r] = ws;
            if (res) res->wstatus[r] = wst[r];
            tdm_shm_group_mark_ended(g, r, ws);
            if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
                if (first_bad < 0) {
                    first_bad = r;
                    grace_end = tdm_time_ns() + (uint64_t)grace_ms * 1000000ull;
                    if (!st) {  /* a timeout already named the culprits */
                        char why[128];
                        tdm_shm_wait_status_str(wst[r], why, sizeof why);
                        st = tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s", r,
                                           (int)pid[r], why);
                    }
                }
            }
            pid[r] = -pid[r];   /* reaped; keep the value for res */
        }
        if (running == 0) break;
        uint64_t now = tdm_time_ns();
        if (signalled == 2 && now >= deadline + 5000ull * 1000000ull) break; /* unkillable */
        if ((now >= deadline || now >= grace_end) && signalled < 2) {
            if (now >= deadline && !st) {
                char list[256] = "";
                size_t len = 0;
                for (int r = 0; r < world; r++)
                    if (pid[r] > 0 && len < sizeof list - 8)
                        len += (size_t)snprintf(list + len, sizeof list - len, "%s%d",
                                                len ? "," : "", r);
                st = tdm_error_set(TDM_STATUS_TIMEOUT,
                                   "spawn: rank(s) %s still running after %lld ms; killed",
                                   list, (long long)timeout_ms);
            }
            int sig = signalled == 0 ? SIGTERM : SIGKILL;
            for (int r = 0; r < world; r++)
                if (pid[r] > 0) kill(pid[r], sig);
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
        for (int r = 0; r < world; r++) res->pid[r] = pid[r] < 0 ? -pid[r] : pid[r];
        res->elapsed_ms = tdm_time_ms_since(t0);
    }
    if (st == TDM_STATUS_PEER_FAILED) {
        /* The survivors of a killed rank notice its death (its pid is gone)
         * and exit with an error a moment later, sometimes before this loop
         * has reaped the dead one, so "first reaped" can name a survivor.
         * Name the root cause instead: a rank killed by a signal other than
         * the SIGTERM of the clean-up. */
        for (int r = 0; r < world; r++) {
            if (!WIFSIGNALED(wst[r]) || WTERMSIG(wst[r]) == SIGTERM) continue;
            char why[128];
            tdm_shm_wait_status_str(wst[r], why, sizeof why);
            st = tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s", r,
                               (int)(pid[r] < 0 ? -pid[r] : pid[r]), why);
            break;
        }
    }
    tdm_shm_group_free(g);
    return st;
fail:
    tdm_shm_group_free(g);
    return st;
}
