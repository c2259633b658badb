/* tests/mpi_test_util.h: running a test binary's own ranks under mpirun
 * (header only: a tests/ file not named test_* is linked into every test
 * binary).
 *
 * A test file lists its rank programs ("workers") in a table and hands it
 * to MPI_T_WORKERS; a test calls mpi_t_run, which starts
 *   mpirun -np N ... <this test binary> <worker> [args]
 * with TDM_MPI_TEST_WORKER set, so that in each rank a constructor runs
 * the worker before Criterion's main ever starts, and exits with its code.
 * mpirun's output is captured; the run is bounded (mpirun --timeout, then
 * SIGKILL of every process carrying this run's tag); as root, the two
 * variables Open MPI asks for are set here. Multi-machine runs are
 * pretend ones on loopback only: with .tcp, MPI's TCP transport is the
 * only one and it is confined to lo.
 *
 * mpi/ is reached through weak symbols: without MPI's development files
 * the tests skip, saying why. */
#ifndef TDM_TESTS_MPI_TEST_UTIL_H
#define TDM_TESTS_MPI_TEST_UTIL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/comm.h"
#include "mpi/mpi_weak.h"
#include "tests/cli_util.h"
#include "tests/timeout_util.h"

#define MPI_T_ENV_WORKER "TDM_MPI_TEST_WORKER"
#define MPI_T_ENV_TAG "TDM_MPI_TEST_TAG"

typedef int (*mpi_t_worker_fn)(int argc, char **argv);
typedef struct mpi_t_worker {
    const char *name;
    mpi_t_worker_fn fn;
} mpi_t_worker;

/* In a rank: runs the worker named by TDM_MPI_TEST_WORKER with the
 * arguments after the binary's name, and exits with its code. */
static inline void mpi_t_worker_main(const mpi_t_worker *w, size_t n, int argc, char **argv)
{
    const char *name = getenv(MPI_T_ENV_WORKER);
    if (!name) return;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(w[i].name, name)) {
            int rc = w[i].fn(argc - 2, argv + 2); /* after the binary and the worker name */
            fflush(NULL);
            exit(rc);
        }
    fprintf(stderr, "mpi test worker '%s' does not exist in %s\n", name, argv[0]);
    exit(99);
}

/* glibc passes argc and argv to constructors. */
#define MPI_T_WORKERS(table)                                                      \
    __attribute__((constructor)) static void mpi_t_worker_entry(int argc, char **argv) \
    {                                                                             \
        mpi_t_worker_main(table, sizeof table / sizeof table[0], argc, argv);     \
    }

static inline int mpi_t_have_mpirun(void)
{
    return system("command -v mpirun >/dev/null 2>&1") == 0;
}

#define MPI_T_NEED()                                                                      \
    do {                                                                                  \
        if (!tdm_comm_init_mpi)                                                           \
            cr_skip_test("MPI communicator not built (no MPI development files: make deps)"); \
        if (!mpi_t_have_mpirun()) cr_skip_test("mpirun not found (make deps)");          \
    } while (0)

typedef struct mpi_t_job {
    int np;                    /* 0: run exe directly, not under mpirun */
    const char *exe;           /* NULL: this test binary, running `worker` */
    const char *worker;
    const char *const *args;   /* NULL-terminated, may be NULL */
    const char *const *env;    /* "NAME=value", NULL-terminated, may be NULL */
    int tcp;                   /* MPI over TCP on lo only (pretend machines) */
    int timeout_s;             /* mpirun --timeout; 0: 120 */
    const char *bind;          /* mpirun --bind-to (e.g. "core"); NULL: none */
} mpi_t_job;

/* Processes of this run still alive: those whose environment holds tag. */
static inline int mpi_t_tagged(const char *tag, int kill_them)
{
    char want[96];
    snprintf(want, sizeof want, "%s=%s", MPI_T_ENV_TAG, tag);
    int n = 0;
    DIR *d = opendir("/proc");
    if (!d) return 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300], buf[65536];
        snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t len = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (len <= 0) continue;
        buf[len] = '\0';
        for (ssize_t i = 0; i < len; i += (ssize_t)strlen(buf + i) + 1)
            if (!strcmp(buf + i, want)) {
                /* a zombie has no environment; this one runs */
                n++;
                if (kill_them) kill((pid_t)atoi(e->d_name), SIGKILL);
                break;
            }
    }
    closedir(d);
    return n;
}

static inline int64_t mpi_t_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Runs the job; r gets mpirun's exit code and its output (stdout and
 * stderr of every rank). Fails the test if a process of the run is left
 * behind. */
static inline void mpi_t_run(cli_result *r, const mpi_t_job *j)
{
    static int runs;
    char self[4096], tag[64], np[16], tmo[16];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    cr_assert(sl > 0);
    self[sl] = '\0';
    snprintf(tag, sizeof tag, "%d-%d", (int)getpid(), ++runs);
    snprintf(np, sizeof np, "%d", j->np);
    int timeout_s = j->timeout_s > 0 ? j->timeout_s : 120;
    snprintf(tmo, sizeof tmo, "%d", timeout_s);
    const char *argv[96];
    int n = 0;
    argv[n++] = "mpirun";
    argv[n++] = "-np"; argv[n++] = np;
    argv[n++] = "--oversubscribe";
    argv[n++] = "--bind-to"; argv[n++] = j->bind ? j->bind : "none";
    argv[n++] = "--timeout"; argv[n++] = tmo;
    /* the launcher's own traffic stays on loopback too */
    argv[n++] = "--mca"; argv[n++] = "oob_tcp_if_include"; argv[n++] = "lo";
    if (j->tcp) {
        argv[n++] = "--mca"; argv[n++] = "btl"; argv[n++] = "tcp,self";
        argv[n++] = "--mca"; argv[n++] = "btl_tcp_if_include"; argv[n++] = "lo";
        argv[n++] = "--mca"; argv[n++] = "btl_tcp_disable_family"; argv[n++] = "6";
        argv[n++] = "--mca"; argv[n++] = "pml"; argv[n++] = "ob1";
    }
    if (j->np == 0) n = 0;     /* no launcher: the program itself */
    argv[n++] = j->exe ? j->exe : self;
    if (!j->exe) argv[n++] = j->worker;
    for (int i = 0; j->args && j->args[i] && n < 94; i++) argv[n++] = j->args[i];
    argv[n] = NULL;
    const char *what = j->exe ? j->exe : j->worker;
    /* Each mpirun gets its own TMPDIR: Open MPI 4.1 creates its session
     * directory (TMPDIR/ompi.<host>.<uid>) with a check-then-mkdir that
     * fails with 'File exists' when two mpiruns start at once (Criterion
     * runs tests in parallel). Removed after the run. */
    char tmp[512];
    const char *base = getenv("TMPDIR");
    snprintf(tmp, sizeof tmp, "%s/mpirun-XXXXXX", base && *base ? base : "/tmp");
    cr_assert_not_null(mkdtemp(tmp), "mkdtemp(%s)", tmp);
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        setpgid(0, 0);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        /* Open MPI refuses root without these; the tests run as root in CI */
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        /* make asan: Open MPI leaves allocations behind at exit from its
         * plugins, unloaded by then, so a leak report cannot name them
         * (nor tests/lsan.supp suppress them): the ranks keep ASan's and
         * UBSan's other checks, without the exit-time leak check */
        const char *asan = getenv("ASAN_OPTIONS");
        if (asan) {
            static char opts[1024];
            snprintf(opts, sizeof opts, "%s:detect_leaks=0", asan);
            setenv("ASAN_OPTIONS", opts, 1);
        }
        setenv("TMPDIR", tmp, 1);
        /* the job's heartbeats (mpi/live.c) name a rank silent for 3 s:
         * stretched as every bound a healthy rank must not hit (a
         * sanitized rank on a loaded machine can be starved that long) */
        if (!getenv("TANDEM_MPI_STALL_MS")) {
            char stall[32];
            snprintf(stall, sizeof stall, "%d", 3000 * tu_timeout_scale());
            setenv("TANDEM_MPI_STALL_MS", stall, 1);
        }
        if (!j->exe) setenv(MPI_T_ENV_WORKER, j->worker, 1);
        setenv(MPI_T_ENV_TAG, tag, 1);
        for (int i = 0; j->env && j->env[i]; i++) putenv((char *)j->env[i]);
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    int64_t deadline = mpi_t_now_ms() + (int64_t)(timeout_s + 15) * 1000;
    size_t len = 0;
    int killed = 0;
    for (;;) {
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        int64_t left = deadline - mpi_t_now_ms();
        if (left <= 0 && !killed) {
            /* mpirun's own timeout did not end it: end everything of this run */
            kill(-pid, SIGKILL);
            mpi_t_tagged(tag, 1);
            killed = 1;
            deadline = mpi_t_now_ms() + 5000;
            continue;
        }
        if (left <= 0) break;
        int pr = poll(&p, 1, (int)(left > 1000 ? 1000 : left));
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0) continue;
        ssize_t k = read(fds[0], r->out + len, sizeof r->out - 1 - len);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        len += (size_t)k;
        if (len == sizeof r->out - 1) len = 0; /* keep the tail */
    }
    r->out[len] = '\0';
    close(fds[0]);
    int ws = 0;
    cr_assert(waitpid(pid, &ws, 0) == pid);
    r->code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    /* mpirun has reaped its ranks when it exits; give stragglers a moment */
    int left = 0;
    for (int i = 0; i < 50 && (left = mpi_t_tagged(tag, 0)) > 0; i++) usleep(100000);
    if (left) mpi_t_tagged(tag, 1);
    char rm[600];
    snprintf(rm, sizeof rm, "rm -rf '%s'", tmp);
    if (system(rm) != 0) fprintf(stderr, "could not remove %s\n", tmp);
    cr_assert(!killed, "mpirun -np %d %s did not end within %d s; output:\n%s", j->np, what,
              timeout_s + 15, r->out);
    cr_assert_eq(left, 0, "%d process(es) of mpirun -np %d %s were left behind; output:\n%s",
                 left, j->np, what, r->out);
}

#endif
