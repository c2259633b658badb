/* tests/test_selftest.c: `tandem selftest --quick` on two host devices:
 * every check passes, the table and the final line, the JUnit file
 * validates against the common JUnit schema (tests/junit.xsd, with
 * xmllint) and holds one test case per check; a baseline it cannot meet
 * fails the throughput check (and only it) with exit 1; bad usage is 2.
 * With --device cuda on emulated GPUs (TANDEM_CUDA_EMULATOR) the
 * collectives run staged through device buffers over the devices'
 * communicator (NCCL on GPUs; shm between emulated ones), not skipped. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/device.h"
#include "tests/cli_util.h"

static char *st_slurp(const char *path)
{
    static char buf[1 << 16];
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s is missing", path);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static int st_count(const char *s, const char *what)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, what)); p++) n++;
    return n;
}

static void st_validate(const char *xml)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "xmllint --noout --schema tests/junit.xsd '%s' 2>&1", xml);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    char out[4096];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int rc = pclose(p);
    cr_assert_eq(rc, 0, "%s does not validate against tests/junit.xsd:\n%s\n%s", xml, out,
                 st_slurp(xml));
}

Test(selftest, quick_run_passes_with_a_valid_junit_file, .timeout = 300)
{
    char dir[] = "/tmp/tdm_selftest_XXXXXX", xml[64], base[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(xml, sizeof xml, "%s/junit.xml", dir);
    snprintf(base, sizeof base, "%s/base.txt", dir);
    cli_result r;
    CLI(&r, "selftest", "--quick", "--device", "cpu:2", "--junit", xml, "--save-baseline", base);
    expect(&r, 0, "selftest: 7 passed, 0 failed");
    static const char *const checks[] = {"devices", "gemm", "collectives",
        "dp_ddp_vs_one_device", "checkpoint_resume_bit_exact", "killed_rank_named",
        "throughput"};
    for (int i = 0; i < 7; i++) {
        char row[64];
        snprintf(row, sizeof row, "\n%-30s ok ", checks[i]);
        cr_expect(strstr(r.out, row), "no passing row for %s:\n%s", checks[i], r.out);
    }
    cr_expect(strstr(r.out, "#wrong = 0"), "%s", r.out);
    cr_expect(strstr(r.out, "bit-identical"), "%s", r.out);
    st_validate(xml);
    char *x = st_slurp(xml);
    cr_expect_eq(st_count(x, "<testcase "), 7, "%s", x);
    cr_expect(strstr(x, "tests=\"7\" failures=\"0\""), "%s", x);
    cr_expect_eq(st_count(x, "<failure"), 0, "%s", x);
    char *b = st_slurp(base);
    double v = 0;
    double spread = -1;
    cr_expect_eq(sscanf(b, "ddp_samples_per_s cpu:2 %lf\nddp_spread cpu:2 %lf", &v, &spread), 2,
                 "%s", b);
    cr_expect_gt(v, 0);
    cr_expect_geq(spread, 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}

Test(selftest, a_baseline_not_met_fails_the_throughput_check, .timeout = 300)
{
    char dir[] = "/tmp/tdm_selftest_XXXXXX", xml[64], base[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(xml, sizeof xml, "%s/junit.xml", dir);
    snprintf(base, sizeof base, "%s/base.txt", dir);
    FILE *f = fopen(base, "w");
    cr_assert_not_null(f);
    fprintf(f, "ddp_samples_per_s cpu:2 1e12\n");   /* no machine trains this fast */
    fclose(f);
    cli_result r;
    CLI(&r, "selftest", "--quick", "--junit", xml, "--baseline", base);
    expect(&r, 1, "selftest: 6 passed, 1 failed");
    cr_expect(strstr(r.out, "\nthroughput                     FAIL"), "%s", r.out);
    cr_expect(strstr(r.out, "below the baseline's 1000000000000 (tolerance "), "%s", r.out);
    st_validate(xml);
    char *x = st_slurp(xml);
    cr_expect_eq(st_count(x, "<failure "), 1, "%s", x);
    cr_expect(strstr(x, "failures=\"1\""), "%s", x);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

Test(selftest, collectives_run_on_emulated_gpus, .timeout = 300)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    cli_result r;
    CLI(&r, "selftest", "--quick", "--device", "cuda");
    cr_expect(strstr(r.out, "\ncollectives                    ok "), "%s", r.out);
    cr_expect(strstr(r.out, "2 ranks over shm (emulated GPUs); all_reduce (5 ops)"), "%s", r.out);
    cr_expect(strstr(r.out, "#wrong = 0; all_reduce 1 MiB busbw "), "%s", r.out);
    cr_expect(strstr(r.out, "of the device-to-device copy ceiling"), "%s", r.out);
    expect(&r, 0, "selftest: 7 passed, 0 failed");
    cr_expect(!cli_shm_entries());
}

Test(selftest, usage, .timeout = 30)
{
    cli_result r;
    CLI(&r, "selftest", "--bogus");
    expect(&r, 2, "unknown argument '--bogus'");
    CLI(&r, "selftest", "--baseline", "a", "--save-baseline", "b");
    expect(&r, 2, "exclude each other");
    CLI(&r, "selftest", "--only", "throughput,gemmm");
    expect(&r, 2, "--only: 'gemmm' is not a check");
    CLI(&r, "selftest", "--help");
    expect(&r, 0, "JUnit");
    CLI(&r, "--help");
    expect(&r, 0, "selftest");
}

/* The gate test's temp directory and busy loop, for its .fini (which
 * runs when an assertion fails too). */
static char st_gate_dir[] = "/tmp/tdm_selftest_XXXXXX";
static int st_gate_made;
static pid_t st_gate_busy = -1;

static void st_gate_fini(void)
{
    if (st_gate_busy > 0) {
        kill(st_gate_busy, SIGKILL);
        waitpid(st_gate_busy, NULL, 0);
        st_gate_busy = -1;
    }
    if (st_gate_made) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", st_gate_dir);
        if (system(cmd) != 0) fprintf(stderr, "selftest gate: could not remove %s\n", st_gate_dir);
        st_gate_made = 0;
    }
}

/* An assertion after the fork: the cleanup first (Criterion does not run
 * .fini when a test is skipped, and the busy loop would outlive it). */
#define ST_GATE_ASSERT(cond, ...)                                                               \
    do {                                                                                        \
        if (!(cond)) {                                                                          \
            st_gate_fini();                                                                     \
            cr_assert_fail(__VA_ARGS__);                                                        \
        }                                                                                       \
    } while (0)

/* CPU seconds: the whole machine's busy time (/proc/stat), this
 * process's and its reaped children's (the selftest runs, getrusage),
 * and the busy loop's (/proc/PID/stat, not reaped until the end). */
typedef struct st_load {
    double wall_s, machine_s, self_s, busy_s;
    int valid;
} st_load;

static void st_load_sample(st_load *c, pid_t busy)
{
    memset(c, 0, sizeof *c);
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    c->wall_s = (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
    double tick = (double)sysconf(_SC_CLK_TCK);
    struct rusage ru;
    for (int who = 0; who < 2; who++)
        if (getrusage(who ? RUSAGE_CHILDREN : RUSAGE_SELF, &ru) == 0)
            c->self_s += (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
                         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
    unsigned long long v[8] = {0};
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return;
    int ok = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2],
                    &v[3], &v[4], &v[5], &v[6], &v[7]) == 8;
    fclose(f);
    if (!ok) return;
    /* user nice system idle iowait irq softirq steal: all but idle, iowait */
    c->machine_s = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tick;
    char path[64], line[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)busy);
    f = fopen(path, "r");
    if (!f) return;
    ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    const char *p = ok ? strrchr(line, ')') : NULL;   /* after the command name */
    unsigned long long ut = 0, stt = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                     &stt) != 2)
        return;
    c->busy_s = (double)(ut + stt) / tick;
    c->valid = 1;
}

/* Other processes' CPU between a and b, in cores' worth; -1: unknown. */
static double st_load_other(const st_load *a, const st_load *b)
{
    double wall = b->wall_s - a->wall_s;
    if (!a->valid || !b->valid || wall <= 0) return -1.0;
    double other = (b->machine_s - a->machine_s) - (b->self_s - a->self_s) -
                   (b->busy_s - a->busy_s);
    return other > 0 ? other / wall : 0.0;
}

/* Other processes taking more than this many cores during a timed run
 * make its figures the machine's load, not the build's: the timing
 * assertions are then skipped with the figure. */
#define ST_GATE_BUSY_CORES 0.25

/* One timed selftest run: its other-process load joins *worst. */
static void st_gate_run(cli_result *r, const char *flag, const char *base, double *worst)
{
    st_load a, b;
    st_load_sample(&a, st_gate_busy);
    CLI(r, "selftest", "--quick", "--only", "throughput", flag, base);
    st_load_sample(&b, st_gate_busy);
    double other = st_load_other(&a, &b);
    if (other < 0 || other > *worst) *worst = other < 0 ? 1e9 : other;
}

static const char *st_row(const cli_result *r, int *len)
{
    const char *row = strstr(r->out, "\nthroughput ");
    *len = row ? (int)strcspn(row + 1, "\n") : 0;
    return row ? row + 1 : "";
}

/* The throughput gate holds on noise and catches a real slowdown: under a
 * busy loop taking a core away, a baseline saved on this build passes 10
 * checks in a row; the same build planted 2x slower (TANDEM_TEST_SLOWDOWN,
 * the test hook of tools/train_loop.c) fails. Each check's figures (the
 * median, the spread, the tolerance) are printed for the record. The
 * machine must be otherwise quiet for that to mean anything: when other
 * processes took more than ST_GATE_BUSY_CORES of the cores during a run
 * (a shared CI box), the test stops there and skips, saying how busy. */
Test(selftest, baseline_gate_holds_on_noise_and_catches_a_2x_slowdown, .timeout = 900,
     .fini = st_gate_fini)
{
    char base[64];
    cr_assert_not_null(mkdtemp(st_gate_dir));
    st_gate_made = 1;
    snprintf(base, sizeof base, "%s/base.txt", st_gate_dir);
    st_gate_busy = fork();
    ST_GATE_ASSERT(st_gate_busy >= 0, "fork: the busy loop");
    if (st_gate_busy == 0) {
        alarm(900);   /* never outlives the test */
        for (volatile unsigned long x = 0;; x++) {}
    }
    cli_result r;
    double worst = 0;
    int len;
    unsetenv("TANDEM_TEST_SLOWDOWN");
    st_gate_run(&r, "--save-baseline", base, &worst);
    ST_GATE_ASSERT(r.code == 0 && access(base, R_OK) == 0, "--save-baseline failed:\n%s",
                   r.out);
    fprintf(stderr, "selftest gate: baseline under a busy loop (others: %.2f cores): %s", worst,
            st_slurp(base));
    int passes = 0, checks = 0;
    for (; checks < 10 && worst <= ST_GATE_BUSY_CORES; checks++) {
        double w = 0;
        st_gate_run(&r, "--baseline", base, &w);
        const char *row = st_row(&r, &len);
        fprintf(stderr, "selftest gate: check %d: exit %d (others: %.2f cores): %.*s\n",
                checks + 1, r.code, w, len, row);
        ST_GATE_ASSERT(r.code == 0 || r.code == 1, "check %d: exit %d:\n%s", checks + 1, r.code,
                       r.out);
        ST_GATE_ASSERT(len > 0, "check %d: no throughput row:\n%s", checks + 1, r.out);
        if (w > worst) worst = w;
        if (w <= ST_GATE_BUSY_CORES) {
            cr_expect_eq(r.code, 0, "check %d of 10 failed on an unchanged build:\n%s",
                         checks + 1, r.out);
            passes += r.code == 0;
        }
    }
    if (worst > ST_GATE_BUSY_CORES) {
        st_gate_fini();
        cr_skip_test("other processes took %.2f cores (over %.2f) during a timed run after %d "
                     "of 10 checks (%d passed): the machine is busy, its timings are its load's",
                     worst >= 1e9 ? -1.0 : worst, ST_GATE_BUSY_CORES, checks, passes);
    }
    cr_expect_eq(passes, 10);
    ST_GATE_ASSERT(setenv("TANDEM_TEST_SLOWDOWN", "2", 1) == 0, "setenv");
    double w = 0;
    st_gate_run(&r, "--baseline", base, &w);
    unsetenv("TANDEM_TEST_SLOWDOWN");
    st_gate_fini();
    const char *row = st_row(&r, &len);
    fprintf(stderr, "selftest gate: planted 2x slowdown (others: %.2f cores): %.*s\n", w, len,
            row);
    if (w > ST_GATE_BUSY_CORES)
        cr_skip_test("other processes took %.2f cores (over %.2f) during the planted slowdown's "
                     "run (the 10 checks passed): its timing is the load's",
                     w, ST_GATE_BUSY_CORES);
    expect(&r, 1, "selftest: 1 passed, 1 failed");
    cr_expect(strstr(r.out, "\nthroughput                     FAIL"), "%s", r.out);
    cr_expect(!cli_shm_entries());
}

/* --device cuda where no GPU answers: every check is a testcase, skipped
 * with the reason; the devices row carries no stray "; " (exit 77:
 * nothing was checked). */
Test(selftest, cuda_without_a_gpu_skips_every_check_with_the_reason, .timeout = 120)
{
    unsetenv("TANDEM_CUDA_EMULATOR");
    int n = 0;
    if (tdm_device_cuda_linked() && tdm_device_cuda_count(&n) == TDM_STATUS_OK && n > 0)
        cr_skip_test("a GPU is present");
    char dir[] = "/tmp/tdm_selftest_XXXXXX", xml[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(xml, sizeof xml, "%s/junit.xml", dir);
    cli_result r;
    CLI(&r, "selftest", "--quick", "--device", "cuda", "--junit", xml);
    expect(&r, 77, "selftest: 0 passed, 0 failed (the rest skipped)");
    st_validate(xml);
    char *x = st_slurp(xml);
    cr_expect_eq(st_count(x, "<testcase "), 7, "%s", x);
    cr_expect_eq(st_count(x, "<skipped message=\""), 7, "%s", x);
    cr_expect(strstr(x, "tests=\"7\" failures=\"0\" errors=\"0\" skipped=\"7\""), "%s", x);
    cr_expect(strstr(x, "<skipped message=\"no device to check: --device cuda: "), "%s", x);
    cr_expect(!strstr(x, "<system-out>; "), "%s", x);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
