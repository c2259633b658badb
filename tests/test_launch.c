/* tests/test_launch.c: `tandem launch` (environment, output prefixes and
 * log files, a failing rank stops the others with a summary, SIGTERM is
 * forwarded) and `tandem train --mode ddp` end to end, launched and
 * forked: a rank SIGKILLed mid-training makes the job fail fast naming it,
 * leaves no process behind, and the last checkpoint resumes.
 * Runs build/tandem (found next to this binary) under `timeout`. */
#include <criterion/criterion.h>
#include <dirent.h>

#include <libgen.h>
#include <stdarg.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/timer.h"
#include "tests/cli_util.h"

static char g_tandem[PATH_MAX];
static char g_dir[PATH_MAX];

static void setup(void)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    cr_assert_gt(n, 0);
    exe[n] = 0;
    char *d = dirname(exe);   /* BUILD/tests */
    snprintf(g_tandem, sizeof g_tandem, "%s/../tandem", d);
    cr_assert_eq(access(g_tandem, X_OK), 0, "%s not built", g_tandem);
    snprintf(g_dir, sizeof g_dir, "/tmp/tdm_launch_test_XXXXXX");
    cr_assert(mkdtemp(g_dir));
}

static void teardown(void)
{
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    (void)system(cmd);
}

/* Runs cmd (sh) bounded by `secs`; stdout/stderr into g_dir/out, g_dir/err.
 * Returns the exit code (or 128+signal). */
static int run(int secs, double *elapsed_s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int run(int secs, double *elapsed_s, const char *fmt, ...)
{
    char inner[8192], cmd[8192 + PATH_MAX + 128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(inner, sizeof inner, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout -s KILL %d sh -c '%s' >out 2>err", g_dir, secs,
             inner);
    shm_t_adopt_orphans();   /* a leaked rank stays ours: cli_shm_entries() sees it */
    uint64_t t0 = tdm_time_ns();
    int ws = system(cmd);
    if (elapsed_s) *elapsed_s = tdm_time_ms_since(t0) / 1000.0;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

static char *slurp(const char *name)
{
    static char buf[1 << 16];
    char path[2 * PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "r");
    if (!f) { buf[0] = 0; return buf; }
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Some process whose command line contains pat is still alive (listed
 * on stderr). Zombies (reaped a moment later by their parent) do not count. */
static int leftovers(const char *pat)
{
    char cmd[PATH_MAX + 128];
    /* "[s]leep" matches "sleep" but not this shell's own command line */
    snprintf(cmd, sizeof cmd, "ps -eo pid,ppid,stat,args | grep -- '[%c]%s' | grep -v ' Z' >&2",
             pat[0], pat + 1);
    return system(cmd) == 0;
}

TestSuite(launch, .init = setup, .fini = teardown, .timeout = 120);

Test(launch, sets_environment_and_prefixes_output)
{
    int rc = run(30, NULL, "%s launch -n 4 -- sh -c \"echo env \\$RANK \\$LOCAL_RANK "
                 "\\$WORLD_SIZE \\$LOCAL_WORLD_SIZE fd=\\${TANDEM_SHM_FD:-none}; echo oops "
                 "\\$RANK >&2\"", g_tandem);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    char *out = slurp("out");
    for (int r = 0; r < 4; r++) {
        char want[64];
        snprintf(want, sizeof want, "[rank %d] env %d %d 4 4 fd=", r, r, r);
        cr_assert(strstr(out, want), "missing '%s' in:\n%s", want, out);
    }
    cr_assert(!strstr(out, "fd=none"), "%s", out);
    char *err = slurp("err");
    cr_assert(strstr(err, "[rank 3] oops 3"), "%s", err);
}

Test(launch, log_dir_gets_one_file_per_rank)
{
    int rc = run(30, NULL, "%s launch -n 3 --log-dir logs -- sh -c \"echo hi \\$RANK; "
                 "echo warn \\$RANK >&2\"", g_tandem);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    for (int r = 0; r < 3; r++) {
        char name[64], want[64];
        snprintf(name, sizeof name, "logs/rank_%d.log", r);
        snprintf(want, sizeof want, "hi %d", r);
        char *s = slurp(name);
        cr_assert(strstr(s, want), "%s: %s", name, s);
        snprintf(want, sizeof want, "warn %d", r);
        cr_assert(strstr(s, want), "%s: %s", name, s);
    }
    cr_assert(!strstr(slurp("out"), "hi"));
}

Test(launch, failing_rank_stops_the_others)
{
    double el;
    /* the sleep's argument carries our pid, so that leftovers() finds only
     * this run's processes, not those of another run of the suite */
    char tag[32];
    snprintf(tag, sizeof tag, "sleep 31.7%d", (int)getpid());
    int rc = run(60, &el, "%s launch -n 3 --grace-ms 1000 -- sh -c \"if [ \\$RANK = 1 ]; then "
                 "sleep 0.3; exit 3; fi; exec %s\"", g_tandem, tag);
    cr_assert_eq(rc, 1, "rc %d: %s", rc, slurp("err"));
    cr_assert_lt(el, 10.0, "took %.1f s", el);
    char *err = slurp("err");
    cr_assert(strstr(err, "rank 1 (pid "), "%s", err);
    cr_assert(strstr(err, "exited with code 3"), "%s", err);
    cr_assert(!leftovers(tag));
    cr_assert(!cli_shm_entries());
}

Test(launch, killed_rank_and_term_ignoring_ranks)
{
    double el;
    /* ranks ignore SIGTERM: the launcher must SIGKILL them after the grace */
    char tag[32];
    snprintf(tag, sizeof tag, "sleep 32.7%d", (int)getpid());
    int rc = run(60, &el, "%s launch -n 3 --grace-ms 500 -- sh -c \"trap \\\"\\\" TERM; "
                 "if [ \\$RANK = 2 ]; then sleep 0.3; kill -9 \\$\\$; fi; exec %s\"",
                 g_tandem, tag);
    cr_assert_eq(rc, 1, "rc %d: %s", rc, slurp("err"));
    cr_assert_lt(el, 10.0, "took %.1f s", el);
    char *err = slurp("err");
    cr_assert(strstr(err, "rank 2 (pid "), "%s", err);
    cr_assert(strstr(err, "killed by signal 9"), "%s", err);
    cr_assert(!leftovers(tag));
}

/* Waits up to 2 s for the processes whose command line is exactly
 * "sleep <arg>" (this test's, by their unique argument) to be gone; kills
 * those left, by pid, and returns how many there were. */
static int reap_leftovers(const char *arg)
{
    int left = 0;
    for (int i = 0; i < 40; i++) {
        left = 0;
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            char path[300], buf[256];
            snprintf(path, sizeof path, "/proc/%s/cmdline", e->d_name);
            FILE *f = fopen(path, "r");
            if (!f) continue;
            size_t n = fread(buf, 1, sizeof buf - 1, f);
            fclose(f);
            buf[n] = 0;
            if (n > 6 && !strcmp(buf, "sleep") && !strcmp(buf + 6, arg)) {
                left++;
                if (i == 39) kill(atoi(e->d_name), SIGKILL);
            }
        }
        if (d) closedir(d);
        if (!left) break;
        usleep(50000);
    }
    return left;
}

/* A rank's own children go with it: each rank has its own process group,
 * signalled whole. Before, ranks shared the launcher's group and only
 * their pids were signalled: rank 1 exited 5 and both `sleep`s (rank 1's
 * orphan, and rank 0's behind its `wait`) were left running. */
Test(launch, ranks_children_are_stopped_with_them)
{
    double el;
    char arg[32];
    snprintf(arg, sizeof arg, "300.7%d", (int)getpid());
    int rc = run(60, &el, "%s launch -n 2 --grace-ms 1000 -- sh -c \"sleep %s & [ \\$RANK = 1 ] "
                 "&& exit 5; wait\"", g_tandem, arg);
    cr_assert_eq(rc, 1, "rc %d: %s", rc, slurp("err"));
    cr_assert(strstr(slurp("err"), "exited with code 5"), "%s", slurp("err"));
    /* the kills are sent before the launcher exits; the kernel finishes
     * them a moment later */
    cr_assert_eq(reap_leftovers(arg), 0, "the ranks' children were left running");
    /* and after a job that succeeds, what a rank left behind goes too */
    rc = run(60, &el, "%s launch -n 2 -- sh -c \"sleep %s & exit 0\"", g_tandem, arg);
    cr_assert_eq(rc, 0, "rc %d: %s", rc, slurp("err"));
    cr_assert_eq(reap_leftovers(arg), 0, "a successful job's leftovers were left running");
}

Test(launch, sigterm_is_forwarded)
{
    double el;
    int rc = run(60, &el, "%s launch -n 2 -- sh -c \"trap \\\"echo got-term \\$RANK; exit 0\\\" "
                 "TERM; sleep 20 & wait\" & L=$!; sleep 1; kill -TERM $L; wait $L; echo rc=$?",
                 g_tandem);
    cr_assert_eq(rc, 0);
    cr_assert_lt(el, 10.0, "took %.1f s", el);
    char *out = slurp("out");
    cr_assert(strstr(out, "[rank 0] got-term 0"), "%s", out);
    cr_assert(strstr(out, "[rank 1] got-term 1"), "%s", out);
    cr_assert(strstr(out, "rc=143"), "%s", out);
}

Test(launch, bad_usage)
{
    cr_assert_eq(run(10, NULL, "%s launch -- true", g_tandem), 2);
    cr_assert_eq(run(10, NULL, "%s launch -n 2", g_tandem), 2);
    cr_assert_eq(run(10, NULL, "%s launch -n 2 -- /nonexistent/prog", g_tandem), 1);
    cr_assert(strstr(slurp("err"), "cannot run /nonexistent/prog"), "%s", slurp("err"));
}

/* ---- DDP training end to end ---- */

#define TRAIN_ARGS "train --mode ddp --data synthetic --synthetic-size 2048 --batch 64 " \
                   "--model mlp:784-64-10 --no-eval --quiet"

Test(launch, launched_ddp_training_matches_forked_and_single)
{
    int rc = run(60, NULL, "%s launch -n 2 -- %s " TRAIN_ARGS " --epochs 1", g_tandem, g_tandem);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    char launched[256], forked[256], single[256];
    epoch_result(slurp("out"), "[rank 0] epoch 1/1", launched, sizeof launched);
    rc = run(60, NULL, "%s " TRAIN_ARGS " --device cpu:2 --epochs 1", g_tandem);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    epoch_result(slurp("out"), "epoch 1/1", forked, sizeof forked);
    cr_assert(strstr(slurp("out"), "overlap"), "%s", slurp("out"));
    rc = run(60, NULL, "%s train --mode single --data synthetic --synthetic-size 2048 --batch 64 "
             "--model mlp:784-64-10 --no-eval --quiet --epochs 1", g_tandem);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    epoch_result(slurp("out"), "epoch 1/1", single, sizeof single);
    cr_assert_str_eq(launched, forked);
    cr_assert_str_eq(forked, single);
}

/* 2048 samples / 64 = 32 steps per epoch; rank 2 dies at step 40 (epoch 2) */
static void check_kill_and_resume(int launched)
{
    /* pid in the name: leftovers() must see only this run's processes */
    char ck[64];
    snprintf(ck, sizeof ck, "ck_%s_%d.safetensors", launched ? "launched" : "forked",
             (int)getpid());
    double el;
    int rc;
    if (launched)
        rc = run(90, &el, "TANDEM_DDP_TEST_KILL=2:40 %s launch -n 3 -- %s " TRAIN_ARGS
                 " --epochs 3 --save %s", g_tandem, g_tandem, ck);
    else
        rc = run(90, &el, "TANDEM_DDP_TEST_KILL=2:40 %s " TRAIN_ARGS " --device cpu:3 "
                 "--epochs 3 --save %s", g_tandem, ck);
    char *err = slurp("err");
    cr_assert_eq(rc, 1, "rc %d: %s", rc, err);
    cr_assert_lt(el, 30.0, "took %.1f s", el);
    cr_assert(strstr(err, "rank 2 (pid "), "%s", err);
    cr_assert(strstr(err, "signal 9"), "%s", err);
    if (launched) {
        /* the survivors fail on their own, naming rank 2 */
        char *p0 = strstr(err, "[rank 0] tandem train:"), *p1 = strstr(err, "[rank 1] tandem train:");
        cr_assert(p0 && p1, "%s", err);
        cr_assert(strstr(p0, "rank 2 (pid ") && strstr(p1, "rank 2 (pid "), "%s", err);
    }
    cr_assert(!leftovers(ck));
    cr_assert(!cli_shm_entries());
    /* epoch 1's checkpoint is intact and training resumes from it */
    rc = run(90, NULL, "%s " TRAIN_ARGS " --device cpu:3 --epochs 2 --resume %s", g_tandem, ck);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    char *out = slurp("out"), want[128];
    snprintf(want, sizeof want, "resumed %s: epoch 1, step 32", ck);
    cr_assert(strstr(out, want), "%s", out);
    char resumed[256], straight[256];
    epoch_result(out, "epoch 2/2", resumed, sizeof resumed);
    /* the same two epochs without the kill end the same way */
    rc = run(90, NULL, "%s " TRAIN_ARGS " --device cpu:3 --epochs 2", g_tandem);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
    epoch_result(slurp("out"), "epoch 2/2", straight, sizeof straight);
    cr_assert_str_eq(resumed, straight, "resumed run ends %s, uninterrupted %s", resumed,
                     straight);
    /* and in single-device mode too */
    rc = run(90, NULL, "%s train --mode single --data synthetic --synthetic-size 2048 --batch 64 "
             "--model mlp:784-64-10 --no-eval --quiet --epochs 2 --resume %s", g_tandem, ck);
    cr_assert_eq(rc, 0, "%s", slurp("err"));
}

Test(launch, sigkill_mid_training_launched)
{
    check_kill_and_resume(1);
}

Test(launch, sigkill_mid_training_forked)
{
    check_kill_and_resume(0);
}

/* The failure summary names the root cause, in the words of whoever saw
 * it, not a survivor's exit or the launcher's own clean-up. */

/* Rank 1 stops (SIGSTOP) before joining: rank 0 names it stopped within
 * seconds (heartbeat, /proc), and so does the launcher's summary. */
Test(launch, summary_names_a_stopped_rank)
{
    double el;
    char ck[64];
    snprintf(ck, sizeof ck, "stop_%d", (int)getpid());   /* for leftovers() */
    int rc = run(90, &el, "%s launch -n 2 --grace-ms 500 -- sh -c \"if [ \\$RANK = 1 ]; then "
                 "kill -STOP \\$\\$; fi; exec %s " TRAIN_ARGS " --epochs 1 --save %s\"",
                 g_tandem, g_tandem, ck);
    char *err = slurp("err");
    cr_assert_eq(rc, 1, "rc %d: %s", rc, err);
    cr_assert_lt(el, 60.0, "took %.1f s", el);
    const char *sum = strstr(err, "tandem launch: ");
    cr_assert(sum, "%s", err);
    cr_assert(strstr(sum, "rank 1 (pid ") && strstr(sum, "is stopped"), "%s", err);
    cr_assert(!strstr(sum, "tandem launch: rank 0"), "%s", err);
    cr_assert(!leftovers(ck));
    cr_assert(!cli_shm_entries());
}

/* Rank 2 exits 0 without ever joining: the others cannot run their first
 * collective and fail naming it; the summary names rank 2, not rank 0. */
Test(launch, summary_names_a_rank_that_exited_0)
{
    double el;
    int rc = run(90, &el, "%s launch -n 3 -- sh -c \"if [ \\$RANK = 2 ]; then exit 0; fi; "
                 "exec %s " TRAIN_ARGS " --epochs 1\"", g_tandem, g_tandem);
    char *err = slurp("err");
    cr_assert_eq(rc, 1, "rc %d: %s", rc, err);
    const char *sum = strstr(err, "tandem launch: ");
    cr_assert(sum, "%s", err);
    cr_assert(strstr(sum, "rank 2 (pid ") && strstr(sum, "exited with code 0 before joining"),
              "%s", err);
    cr_assert(!cli_shm_entries());
}

/* Forked ranks: rank 1 stops mid-training; the summary names it stopped,
 * not "killed by signal 9" (the parent's own clean-up of it). */
Test(launch, train_summary_names_a_stopped_rank)
{
    double el;
    char ck[64];
    snprintf(ck, sizeof ck, "stopf_%d", (int)getpid());
    int rc = run(90, &el, "TANDEM_DDP_TEST_KILL=1:5:STOP %s " TRAIN_ARGS " --device cpu:3 "
                 "--epochs 1 --save %s", g_tandem, ck);
    char *err = slurp("err");
    cr_assert_eq(rc, 1, "rc %d: %s", rc, err);
    cr_assert_lt(el, 60.0, "took %.1f s", el);
    const char *sum = strstr(err, "tandem train: ddp: ");
    cr_assert(sum, "%s", err);
    cr_assert(strstr(sum, "rank 1 (pid ") && strstr(sum, "is stopped"), "%s", err);
    cr_assert(!strstr(sum, "signal 9"), "%s", err);
    cr_assert(!leftovers(ck));
    cr_assert(!cli_shm_entries());
}

/* An arena larger than the memory there is: refused at start with the
 * bytes needed and available, not reserved and OOM-killed. (ulimit -f:
 * should the check regress, fallocate fails instead of taking the
 * machine's memory.) */
Test(launch, arena_larger_than_memory_is_refused)
{
    int rc = run(30, NULL, "ulimit -f 4194304; %s launch -n 16 --arena-mb 65536 -- true",
                 g_tandem);
    char *err = slurp("err");
    cr_assert_eq(rc, 1, "rc %d: %s", rc, err);
    cr_assert(strstr(err, "cannot reserve") && strstr(err, "of memory are available"), "%s",
              err);
}

/* A launched DDP rank checks that the data fits the model, as the forked
 * path does (it used to train on rows read at the wrong stride). */
Test(launch, launched_ddp_refuses_data_that_does_not_fit)
{
    if (access("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", R_OK))
        cr_skip_test("Fashion-MNIST not installed (dataset-fashion-mnist)");
    int rc = run(60, NULL, "%s launch -n 2 -- %s train --mode ddp --model mlp:100-10 "
                 "--epochs 1 --max-steps 2 --no-eval", g_tandem, g_tandem);
    char *err = slurp("err");
    cr_assert_eq(rc, 1, "rc %d: %s", rc, err);
    cr_assert(strstr(err, "the data has 784 features per sample but the model expects 100"),
              "%s", err);
}
