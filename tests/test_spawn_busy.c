/* tests/test_spawn_busy.c: a rank that dies while the others compute
 * outside any collective (an evaluation, a long forward) stops the job at
 * once, as it does in training, where the others are inside a collective
 * and see the abort by themselves: the parent stops ranks it sees
 * computing for TDM_SHM_BUSY_STOP_MS after the failure (shm/spawn.c)
 * instead of waiting for them to reach their next collective or for the
 * grace period. Before: the survivor ran on until its next collective or
 * the grace period (here 60 s) ended. And end to end: a DDP rank killed
 * during the test-set evaluation. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/timer.h"
#include "shm/spawn.h"
#include "tests/cli_util.h"
#include "tests/timeout_util.h"

/* How long the survivors would compute, and the grace period: far longer
 * than the bound below, so that only the parent's stop can meet it. */
#define BUSY_COMPUTE_S 60
#define BUSY_GRACE_MS 60000
/* The bound on the whole job after the death (must not fire: scaled). */
#define BUSY_BOUND_S 15.0

TestSuite(spawn_busy, .timeout = 240);

/* Rank 1 dies after a barrier; the others compute (no collective) for
 * BUSY_COMPUTE_S, or (in_call = 1) wait in a barrier, which the abort ends. */
static int busy_rank(tdm_comm *comm, void *arg)
{
    int in_call = *(int *)arg;
    int r = tdm_comm_rank(comm);
    if (tdm_comm_barrier(comm)) return 100;
    if (r == 1) {
        usleep(100 * 1000);
        raise(SIGKILL);
    }
    if (in_call) {
        tdm_status st = tdm_comm_barrier(comm);
        fprintf(stderr, "rank %d: %s\n", r, tdm_error_message());
        return st == TDM_STATUS_PEER_FAILED ? 7 : 101;
    }
    volatile double x = 0;
    uint64_t t0 = tdm_time_ns();
    while (tdm_time_ns() - t0 < (uint64_t)BUSY_COMPUTE_S * 1000000000ull)
        for (int i = 0; i < 100000; i++) x += 1e-9 * i;
    return 0;
}

static void run_busy(int world, int in_call)
{
    tdm_shm_spawn_opts o = {.timeout_ms = 200000, .grace_ms = BUSY_GRACE_MS};
    tdm_shm_spawn_result res;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_shm_spawn(world, busy_rank, &in_call, &o, &res);
    double el = tdm_time_ms_since(t0) / 1000.0;
    fprintf(stderr, "%d ranks, survivors %s: the job ended %.2f s after it started\n", world,
            in_call ? "in a collective" : "computing", el);
    cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "rank 1 (pid ") &&
                  strstr(tdm_error_message(), "killed by signal 9"),
              "the summary does not name rank 1: %s", tdm_error_message());
    cr_assert_lt(el, BUSY_BOUND_S * tu_timeout_scale(), "the job took %.1f s to stop", el);
    for (int r = 0; r < world; r++) {
        if (r == 1) continue;
        int ws = res.wstatus[r];
        if (in_call)
            /* inside a collective: it stops by itself, in its own words */
            cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 7, "rank %d: status 0x%x", r, ws);
        else
            cr_assert(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGTERM, "rank %d: status 0x%x", r, ws);
    }
}

Test(spawn_busy, computing_survivors_are_stopped_at_once) { run_busy(3, 0); }
Test(spawn_busy, survivors_inside_a_collective_stop_by_themselves) { run_busy(3, 1); }

/* The pids of tandem's children (the forked ranks), in pid order. */
static int child_pids(pid_t parent, pid_t *out, int max)
{
    int n = 0;
    DIR *d = opendir("/proc");
    for (struct dirent *e; d && (e = readdir(d));) {
        char path[300], buf[512];
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t k = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[k] = 0;
        const char *p = strrchr(buf, ')');
        int ppid = 0;
        char st;
        if (p && sscanf(p + 1, " %c %d", &st, &ppid) == 2 && ppid == parent && n < max)
            out[n++] = (pid_t)atoi(e->d_name);
    }
    if (d) closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && out[j] < out[j - 1]; j--) {
            pid_t t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

/* `tandem train --mode ddp`, rank 1 SIGKILLed while both ranks evaluate a
 * wide model (37M parameters) on the 5000-sample test set (about 5 s of
 * work on an idle 2-core machine; 784-2048-2048-10 took under 0.5 s once
 * the evaluation got faster, and the ranks had ended before the kill): the job ends, naming
 * rank 1, without the evaluation finishing: 0.7-0.9 s after the kill on
 * an idle machine, 1.5 s under a load of 18 on 2 cores (300 ms of the
 * survivor's CPU time, then SIGTERM). Before: 4.1 s (the survivor went on
 * until the 3 s grace ran out). The bound must not fire on a loaded
 * machine, so it does not tell the two apart: the tests above do, with a
 * 60 s grace. */
#define EVAL_BOUND_S 10.0
Test(spawn_busy, rank_killed_during_evaluation_stops_the_job_at_once)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        alarm(200);
        execl(cli_bin(), cli_bin(), "train", "--mode", "ddp", "--device", "cpu:2", "--data",
              "synthetic", "--synthetic-size", "30000", "--batch", "64", "--model",
              "mlp:784-4096-4096-4096-10", "--epochs", "1", "--max-steps", "2", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    static char out[1 << 16];
    size_t len = 0;
    ssize_t k;
    uint64_t killed_at = 0;
    while ((k = read(fds[0], out + len, sizeof out - 1 - len)) > 0) {
        len += (size_t)k;
        out[len] = 0;
        /* step 1 of 2 printed: step 2 takes a few hundred milliseconds,
         * then the evaluation of 5000 samples about 4 s */
        if (!killed_at && strstr(out, "step 1/2")) {
            usleep(500 * 1000);
            pid_t ranks[4];
            int nr = child_pids(pid, ranks, 4);
            cr_assert_eq(nr, 2, "%d ranks running, not 2:\n%s", nr, out);
            kill(ranks[1], SIGKILL);
            killed_at = tdm_time_ns();
        }
    }
    close(fds[0]);
    int ws;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    double el = killed_at ? (double)(tdm_time_ns() - killed_at) * 1e-9 : -1;
    fprintf(stderr, "rank 1 killed during the evaluation: the job ended %.2f s later\n", el);
    cr_assert(killed_at, "never saw step 1 of 2:\n%s", out);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 1, "status 0x%x:\n%s", ws, out);
    cr_assert(strstr(out, "rank 1 (pid ") && strstr(out, "killed by signal 9"), "%s", out);
    cr_assert(!strstr(out, "test accuracy"), "the evaluation finished:\n%s", out);
    cr_assert_lt(el, EVAL_BOUND_S * tu_timeout_scale(), "%.1f s from the kill to the end:\n%s", el,
                 out);
}
