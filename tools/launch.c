/* tools/launch.c: `tandem launch -n N [--log-dir DIR] -- PROGRAM ARGS...`,
 * a torchrun-like launcher for DDP programs on one machine. It creates the
 * shared-memory group, exports what the ranks need to join it
 * (TANDEM_SHM_FD; each rank calls tdm_dist_pg_init_from_env), sets RANK,
 * LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, execs N copies of PROGRAM,
 * prefixes every output line with "[rank N] " (or writes DIR/rank_N.log),
 * starts each rank in its own process group and signals the group, so
 * that what a rank starts stops with it (nothing is left once the job
 * ends), forwards SIGINT/SIGTERM/SIGHUP, and when a rank fails tells the group
 * (the other ranks' collectives fail at once), stops the rest (SIGTERM,
 * then SIGKILL after a grace period) and exits 1 with a summary naming
 * the root cause by the rule every parent of ranks shares
 * (tdm_shm_watch_blame, shm/spawn.h). Restarts (--max-restarts) are
 * tools/elastic.c's loop around this; one machine. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/safefile.h"
#include "core/timer.h"
#include "dist/pg.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tools/args.h"
#include "tools/doctor.h"
#include "tools/elastic.h"
#include "tools/tools.h"

#define TDM_LAUNCH_LINE_MAX 4096

static volatile sig_atomic_t tdm_launch_sig;

static void tdm_launch_on_signal(int sig) { tdm_launch_sig = sig; }

static void tdm_launch_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem launch -n N [options] -- PROGRAM [ARGS...]\n"
        "\n"
        "Runs N copies of PROGRAM as the ranks of one DDP job on this machine.\n"
        "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and\n"
        "TANDEM_SHM_FD (join with tdm_dist_pg_init_from_env). Each rank runs in its\n"
        "own process group, which the launcher signals whole: what a rank starts\n"
        "stops with the job (a rank is not in the terminal's foreground group, so\n"
        "one that reads the terminal is stopped).\n"
        "\n"
        "  -n, --nproc N        number of ranks (1..%d)\n"
        "  --log-dir DIR        write each rank's output to DIR/rank_N.log (DIR must\n"
        "                       be yours and not writable by others)\n"
        "                       (default: prefix lines with \"[rank N] \")\n"
        "  --arena-mb M         zero-copy memory per rank for DDP gradients [32]\n"
        "  --grace-ms MS        after a failure: SIGTERM to the others after\n"
        "                       min(MS, 1000), SIGKILL MS after that      [3000]\n"
        "  --timeout SECONDS    process-group timeout: a rank that waits longer\n"
        "                       for a peer in a collective fails, naming it;\n"
        "                       exported to the ranks as TANDEM_TIMEOUT\n"
        "                       [$TANDEM_TIMEOUT, else 300]\n"
        "  --max-restarts K     when a rank fails, stop the rest and start every rank\n"
        "                       again, at most K times (the ranks see\n"
        "                       TANDEM_RESTART_COUNT; tandem train resumes from its\n"
        "                       --save checkpoint); never after a signal to the launcher [0]\n"
        "  --checkpoint PATH    the checkpoint restarted ranks resume from, named in the\n"
        "                       restart line and exported as TANDEM_RESUME\n"
        "\n"
        "On a failure the ranks' flight recorders are dumped (in $TANDEM_FR_DUMP, else\n"
        "--log-dir, else a new $TMPDIR/tandem-fr-* directory, removed if no rank\n"
        "dumped, and only the newest 5 of which are kept) and the summary ends with\n"
        "the one-line verdict of tandem doctor. When the restarts run out, one line\n"
        "says so and what failed each time.\n"
        "\n"
        "Exit codes: 0 every rank succeeded, 1 a rank failed (summary on\n"
        "stderr), 2 bad usage, 128+S stopped by signal S.\n", TDM_SHM_MAX_RANKS);
}

typedef struct tdm_launch_out {
    int fd;              /* read end, -1 when closed */
    int rank, dest;      /* dest: 1 stdout, 2 stderr */
    size_t len;
    char buf[TDM_LAUNCH_LINE_MAX];
} tdm_launch_out;

static void tdm_launch_write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

static void tdm_launch_emit(tdm_launch_out *o, const char *line, size_t n)
{
    char pre[32];
    int pl = snprintf(pre, sizeof pre, "[rank %d] ", o->rank);
    char tmp[TDM_LAUNCH_LINE_MAX + 40];
    memcpy(tmp, pre, (size_t)pl);
    memcpy(tmp + pl, line, n);
    tmp[pl + n] = '\n';
    tdm_launch_write_all(o->dest, tmp, (size_t)pl + n + 1);
}

/* Reads what is there; emits complete lines (and over-long ones). */
static void tdm_launch_pump(tdm_launch_out *o)
{
    char chunk[4096];
    ssize_t n = read(o->fd, chunk, sizeof chunk);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
        if (o->len) tdm_launch_emit(o, o->buf, o->len);
        o->len = 0;
        close(o->fd);
        o->fd = -1;
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        if (chunk[i] == '\n' || o->len == sizeof o->buf) {
            tdm_launch_emit(o, o->buf, o->len);
            o->len = 0;
            if (chunk[i] == '\n') continue;
        }
        o->buf[o->len++] = chunk[i];
    }
}


static void tdm_launch_sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

typedef struct tdm_launch_opts {
    long long world, arena_mb, grace_ms;
    const char *log_dir, *timeout;
    int prog;   /* argv index of PROGRAM */
    int help;
} tdm_launch_opts;

static tdm_status tdm_launch_parse(int argc, char **argv, tdm_launch_opts *o)
{
    *o = (tdm_launch_opts){.arena_mb = 32, .grace_ms = 3000, .prog = -1};
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        if (!strcmp(argv[i], "--")) { o->prog = i + 1; break; }
        TDM_ARGS_HELP(o->help)
        TDM_CHECK(tdm_args_value2(argc, argv, &i, "-n", "--nproc", &v));
        if (v) {
            TDM_CHECK(tdm_args_int("-n", v, 1, TDM_SHM_MAX_RANKS, &o->world));
            continue;
        }
        TDM_ARGS_STR("--log-dir", o->log_dir);
        TDM_ARGS_INT("--arena-mb", 0, 1 << 16, o->arena_mb);
        TDM_ARGS_INT("--grace-ms", 0, 600000, o->grace_ms);
        TDM_ARGS_STR("--timeout", o->timeout);
        if (argv[i][0] != '-') { o->prog = i; break; }
        return tdm_tool_usage_error(
            "tandem launch: unknown option '%s' (see tandem launch --help)\n", argv[i]);
    }
    if (o->world < 1 || o->prog < 0 || o->prog >= argc)
        return tdm_tool_usage_error(
            "tandem launch: need -n N and a program after '--' (see --help)\n");
    return TDM_STATUS_OK;
}

/* One launch, from the options to the ranks' ends. */
typedef struct tdm_launch_job {
    tdm_launch_opts o;
    char **argv;
    int W;
    tdm_shm_group *g;
    tdm_shm_watch watch;         /* names the root cause: the rule of shm/spawn.h */
    tdm_doctor_job frj;          /* the ranks' flight-recorder dumps (tools/doctor.h) */
    pid_t pid[TDM_SHM_MAX_RANKS];   /* > 0 running, < 0 ended (-pid), 0 never started */
    pid_t pgid[TDM_SHM_MAX_RANKS];  /* each rank's own process group (its first pid) */
    int wst[TDM_SHM_MAX_RANKS];
    int logfd[TDM_SHM_MAX_RANKS];
    tdm_launch_out *outs;
    int n_outs, running, fwd_sig;
    struct sigaction old_int, old_term, old_hup;
} tdm_launch_job;

/* --timeout, else TANDEM_TIMEOUT: the ranks read it from TANDEM_TIMEOUT
 * (tdm_dist_pg_init), so a bad value is refused here, once, rather than by
 * every rank. */
static tdm_status tdm_launch_check_timeout(const tdm_launch_opts *o)
{
    int64_t timeout_ms = 0;
    if (o->timeout ? tdm_dist_timeout_parse("--timeout", o->timeout, &timeout_ms)
                   : tdm_dist_timeout_from_env(&timeout_ms))
        return tdm_tool_usage_error("tandem launch: %s\n", tdm_error_message());
    if (o->timeout) setenv(TDM_DIST_ENV_TIMEOUT, o->timeout, 1);
    return TDM_STATUS_OK;
}

/* Every log is opened before any rank starts: in a directory no one else
 * can write (core/safefile.h), relative to its descriptor, and only as a
 * regular file of ours (no symlink followed). */
static tdm_status tdm_launch_open_logs(tdm_launch_job *j)
{
    const char *log_dir = j->o.log_dir;
    int dirfd = -1;
    tdm_status lst = tdm_dir_open_safe(log_dir, "--log-dir", 1, &dirfd);
    for (int r = 0; lst == TDM_STATUS_OK && r < j->W; r++) {
        char name[32];
        snprintf(name, sizeof name, "rank_%d.log", r);
        if ((lst = tdm_file_open_write(dirfd, name, 0, &j->logfd[r])))
            tdm_error_prefix(lst, "--log-dir %s", log_dir);
    }
    /* emptied only once all are good: a refusal keeps the last logs */
    for (int r = 0; lst == TDM_STATUS_OK && r < j->W; r++)
        if (ftruncate(j->logfd[r], 0) != 0)
            lst = tdm_error_set(TDM_STATUS_IO, "--log-dir %s: rank_%d.log: %s", log_dir, r,
                                strerror(errno));
    if (dirfd >= 0) close(dirfd);
    if (lst != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem launch: %s\n", tdm_error_message());
    return TDM_STATUS_OK;
}

/* Forks and execs rank r, its output to its log or to two pipes; 0 when
 * it could not be started (said on stderr). */
static int tdm_launch_start_rank(tdm_launch_job *j, int r, pid_t self)
{
    const char *log_dir = j->o.log_dir;
    char **argv = j->argv;
    int prog = j->o.prog;
    int fds[2][2] = {{-1, -1}, {-1, -1}};
    if (log_dir) {
        /* opened above */
    } else if (pipe2(fds[0], O_CLOEXEC)) {
        fprintf(stderr, "tandem launch: pipe: %s\n", strerror(errno));
        return 0;
    } else if (pipe2(fds[1], O_CLOEXEC)) {
        fprintf(stderr, "tandem launch: pipe: %s\n", strerror(errno));
        close(fds[0][0]);
        close(fds[0][1]);
        return 0;
    }
    pid_t p = fork();
    if (p == 0) {
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGINT, &dfl, NULL);
        sigaction(SIGTERM, &dfl, NULL);
        sigaction(SIGHUP, &dfl, NULL);
        prctl(PR_SET_PDEATHSIG, SIGKILL);   /* never outlive the launcher */
        if (getppid() != self) _exit(125);
        /* its own process group, which the launcher signals whole: what
         * the rank starts goes with it (torchrun does the same) */
        setpgid(0, 0);
        tdm_dist_env_export(r, j->W);
        if (log_dir) {
            dup2(j->logfd[r], STDOUT_FILENO);
            dup2(j->logfd[r], STDERR_FILENO);
        } else {
            dup2(fds[0][1], STDOUT_FILENO);
            dup2(fds[1][1], STDERR_FILENO);
        }
        execvp(argv[prog], argv + prog);
        fprintf(stderr, "tandem launch: rank %d: cannot run %s: %s\n", r, argv[prog],
                strerror(errno));
        _exit(127);
    }
    if (j->logfd[r] >= 0) close(j->logfd[r]);
    j->logfd[r] = -1;
    if (!log_dir) {
        close(fds[0][1]);
        close(fds[1][1]);
    }
    if (p < 0) {
        fprintf(stderr, "tandem launch: fork of rank %d: %s\n", r, strerror(errno));
        if (!log_dir) { close(fds[0][0]); close(fds[1][0]); }
        return 0;
    }
    setpgid(p, p);   /* as the child does: whichever runs first (EACCES once it has exec'd) */
    j->pid[r] = p;
    j->pgid[r] = p;
    j->running++;
    tdm_shm_watch_started(&j->watch, r, p);
    if (!log_dir) {
        j->outs[j->n_outs++] = (tdm_launch_out){.fd = fds[0][0], .rank = r, .dest = STDOUT_FILENO};
        j->outs[j->n_outs++] = (tdm_launch_out){.fd = fds[1][0], .rank = r, .dest = STDERR_FILENO};
    }
    return 1;
}

/* Sends sig to each rank's process group: the running ranks' (running =
 * 1), or every rank's, ended ones too, whose children may outlive them.
 * An ended rank's group is signalled only while no process has its pid:
 * the group id is that pid, and once the group is empty the pid (reaped by
 * us) may belong to someone else's new group. */
static void tdm_launch_signal(tdm_launch_job *j, int sig, int running)
{
    for (int r = 0; r < j->W; r++) {
        if (j->pgid[r] <= 0 || (running && j->pid[r] <= 0)) continue;
        if (j->pid[r] > 0) {
            kill(-j->pgid[r], sig);
            kill(j->pid[r], sig);   /* in case it left its group */
        } else if (kill(j->pgid[r], 0) != 0 && errno == ESRCH) {
            kill(-j->pgid[r], sig);
        }
    }
}

/* Catches SIGINT, SIGTERM, SIGHUP (to forward them) and starts the ranks
 * in order, stopping at the first that cannot be started. */
static void tdm_launch_start(tdm_launch_job *j)
{
    struct sigaction sa = {.sa_handler = tdm_launch_on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &j->old_int);
    sigaction(SIGTERM, &sa, &j->old_term);
    sigaction(SIGHUP, &sa, &j->old_hup);
    fflush(stdout);
    fflush(stderr);
    pid_t self = getpid();
    for (int r = 0; r < j->W; r++)
        if (!tdm_launch_start_rank(j, r, self)) break;
}

/* Until every rank has ended and its output is drained: pumps the ranks'
 * output, forwards a signal, reaps ranks, and after the first failure
 * (or a signal) stops the rest: the group abort first, SIGTERM a moment
 * later, SIGKILL after the grace period. */
static void tdm_launch_supervise(tdm_launch_job *j)
{
    int W = j->W, stopping = j->running < W, signalled = 0, rank_failed = 0, settled = 0;
    long long grace_ms = j->o.grace_ms;
    uint64_t kill_at = stopping ? tdm_time_ns() + (uint64_t)grace_ms * 1000000ull : UINT64_MAX;
    if (stopping) {
        tdm_shm_watch_stopping(&j->watch, TDM_STATUS_SYSTEM, "not every rank could be started");
        tdm_launch_signal(j, SIGTERM, 1);
    }
    uint64_t drain_until = UINT64_MAX, term_at = UINT64_MAX;
    for (;;) {
        struct pollfd pf[2 * TDM_SHM_MAX_RANKS];
        int np = 0, idx[2 * TDM_SHM_MAX_RANKS];
        for (int i = 0; i < j->n_outs; i++)
            if (j->outs[i].fd >= 0) {
                pf[np] = (struct pollfd){.fd = j->outs[i].fd, .events = POLLIN};
                idx[np++] = i;
            }
        if (j->running == 0 && (np == 0 || tdm_time_ns() > drain_until)) break;
        if (np > 0) {
            int k = poll(pf, (nfds_t)np, 20);
            for (int q = 0; k > 0 && q < np; q++)
                if (pf[q].revents) tdm_launch_pump(&j->outs[idx[q]]);
        } else {
            tdm_launch_sleep_ms(20);
        }
        if (tdm_launch_sig && !j->fwd_sig) {
            j->fwd_sig = tdm_launch_sig;
            char why[64];
            snprintf(why, sizeof why, "received %s", strsignal(j->fwd_sig));
            tdm_shm_watch_stopping(&j->watch, TDM_STATUS_ABORTED, why);
            tdm_launch_signal(j, j->fwd_sig, 0);
            if (!stopping) {
                stopping = 1;
                kill_at = tdm_time_ns() + (uint64_t)grace_ms * 1000000ull;
            }
        }
        int ws;
        pid_t w;
        while (j->running > 0 && (w = waitpid(-1, &ws, WNOHANG)) > 0) {
            int r = 0;
            while (r < W && j->pid[r] != w) r++;
            if (r == W) continue;
            j->pid[r] = -w;
            j->wst[r] = ws;
            j->running--;
            if (!tdm_shm_watch_ended(&j->watch, r, ws)) continue;
            rank_failed = 1;
            if (!stopping) {
                /* The group abort lets ranks inside a collective fail on
                 * their own (and say so) first; SIGTERM comes a moment
                 * later, SIGKILL after the grace period. */
                stopping = 1;
                uint64_t t = tdm_time_ns();
                term_at = t + (uint64_t)(grace_ms < 1000 ? grace_ms : 1000) * 1000000ull;
                kill_at = term_at + (uint64_t)grace_ms * 1000000ull;
            }
        }
        /* a rank failed and the others are stopped: they can say nothing
         * more before the SIGKILL after the grace period, so the doctor
         * speaks now (tools/doctor.h); not for a signal to the launcher */
        if (rank_failed && !settled && !j->fwd_sig && j->running > 0 &&
            tdm_shm_watch_only_stopped(&j->watch)) {
            settled = 1;
            tdm_doctor_job_settled(&j->watch, &j->frj);
        }
        if (stopping && j->running > 0 && tdm_time_ns() >= term_at) {
            tdm_shm_watch_stopping(&j->watch, TDM_STATUS_OK, NULL);   /* a rank failed */
            tdm_launch_signal(j, SIGTERM, 0);   /* and a failed rank's children */
            term_at = UINT64_MAX;
        }
        if (j->running == 0 && drain_until == UINT64_MAX) {
            /* every rank has ended: what they left running goes too */
            tdm_launch_signal(j, SIGKILL, 0);
            drain_until = tdm_time_ns() + 500ull * 1000000ull;  /* grandchildren may hold pipes */
        }
        if (stopping && j->running > 0 && tdm_time_ns() >= kill_at && signalled < 1) {
            tdm_shm_watch_stopping(&j->watch, TDM_STATUS_OK, NULL);
            tdm_launch_signal(j, SIGKILL, 0);
            signalled = 1;
        }
    }
    for (int i = 0; i < j->n_outs; i++)
        if (j->outs[i].fd >= 0) {
            close(j->outs[i].fd);
            j->outs[i].fd = -1;
        }
    sigaction(SIGINT, &j->old_int, NULL);
    sigaction(SIGTERM, &j->old_term, NULL);
    sigaction(SIGHUP, &j->old_hup, NULL);
}

/* The summary line and the exit code: 1 naming the root cause when a rank
 * failed, 128+S after forwarding signal S, 1 when not every rank could be
 * started, else 0. */
static int tdm_launch_report(tdm_launch_job *j)
{
    int W = j->W, failed = 0;
    for (int r = 0; r < W; r++)
        if (j->pid[r] == 0 || !(WIFEXITED(j->wst[r]) && WEXITSTATUS(j->wst[r]) == 0)) failed++;
    tdm_shm_cause cause;
    tdm_shm_watch_blame(&j->watch, &cause);
    if (cause == TDM_SHM_CAUSE_RANK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", tdm_error_message());
        fprintf(stderr, "tandem launch: %s; stopped the other ranks (%d of %d failed or were "
                        "stopped)\n", why, failed, W);
        tdm_doctor_job_end(&j->frj, 1, W, j->watch.pid, j->watch.wstatus, j->watch.induced, why);
        snprintf(tdm_elastic_cause, sizeof tdm_elastic_cause, "%s", why);
        return tdm_tool_exit(TDM_STATUS_SYSTEM);
    }
    if (j->fwd_sig) {
        if (j->frj.created) rmdir(j->frj.dir);   /* kept if a rank dumped into it */
        fprintf(stderr, "tandem launch: received %s; forwarded it to %d rank(s)\n",
                strsignal(j->fwd_sig), W);
        return 128 + j->fwd_sig;
    }
    if (failed) {
        fprintf(stderr, "tandem launch: %d of %d ranks could not be started\n", failed, W);
        return tdm_tool_exit(TDM_STATUS_SYSTEM);
    }
    tdm_doctor_job_end(&j->frj, 0, W, NULL, NULL, NULL, NULL);
    return tdm_tool_exit(TDM_STATUS_OK);
}

/* One launch; tools/elastic.c's tdm_tool_launch_main restarts it. */
int tdm_launch_run_once(int argc, char **argv)
{
    tdm_launch_job job = {.argv = argv};
    tdm_launch_job *j = &job;
    tdm_status st = tdm_launch_parse(argc, argv, &j->o);
    if (st == TDM_STATUS_OK && j->o.help) {
        tdm_launch_usage(stdout);
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK) st = tdm_launch_check_timeout(&j->o);
    if (st != TDM_STATUS_OK) return tdm_tool_exit(st);
    j->W = (int)j->o.world;
    for (int r = 0; r < j->W; r++) j->logfd[r] = -1;
    j->outs = calloc((size_t)j->W * 2, sizeof *j->outs);
    if (!j->outs) {
        fprintf(stderr, "tandem launch: out of memory\n");
        return tdm_tool_exit(TDM_STATUS_OUT_OF_MEMORY);
    }
    int rc;
    tdm_shm_opts so = {.arena_bytes = (size_t)j->o.arena_mb << 20};
    if (j->o.log_dir && (st = tdm_launch_open_logs(j)) != TDM_STATUS_OK) {
        rc = tdm_tool_exit(st);
    } else if ((st = tdm_shm_group_create(&j->g, j->W, &so)) ||
               (st = tdm_shm_group_export_env(j->g))) {
        fprintf(stderr, "tandem launch: shared memory: %s\n", tdm_error_message());
        rc = tdm_tool_exit(st);
    } else if ((st = tdm_doctor_job_begin(&j->frj, "tandem launch", j->o.log_dir))) {
        rc = tdm_tool_exit(st);
    } else {
        tdm_shm_watch_init(&j->watch, j->g, j->W);
        tdm_launch_start(j);
        tdm_launch_supervise(j);
        rc = tdm_launch_report(j);
    }
    for (int r = 0; r < j->W; r++) if (j->logfd[r] >= 0) close(j->logfd[r]);
    tdm_shm_group_free(j->g);
    free(j->outs);
    return rc;
}
