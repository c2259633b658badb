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
#include <sys/wait.h>

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

/* The throughput gate holds on noise and catches a real slowdown: under a
 * busy loop taking a core away, a baseline saved on this build passes 10
 * checks in a row; the same build planted 2x slower (TANDEM_TEST_SLOWDOWN,
 * the test hook of tools/train_loop.c) fails. Each check's figures (the
 * median, the spread, the tolerance) are printed for the record. */
Test(selftest, baseline_gate_holds_on_noise_and_catches_a_2x_slowdown, .timeout = 900)
{
    char dir[] = "/tmp/tdm_selftest_XXXXXX", base[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(base, sizeof base, "%s/base.txt", dir);
    pid_t busy = fork();
    cr_assert(busy >= 0);
    if (busy == 0) {
        alarm(900);   /* never outlives the test */
        for (volatile unsigned long x = 0;; x++) {}
    }
    cli_result r;
    unsetenv("TANDEM_TEST_SLOWDOWN");
    CLI(&r, "selftest", "--quick", "--only", "throughput", "--save-baseline", base);
    int saved_ok = r.code == 0;
    char *b = saved_ok ? st_slurp(base) : r.out;
    fprintf(stderr, "selftest gate: baseline under a busy loop: %s", b);
    int passes = 0;
    for (int i = 0; saved_ok && i < 10; i++) {
        CLI(&r, "selftest", "--quick", "--only", "throughput", "--baseline", base);
        const char *row = strstr(r.out, "\nthroughput ");
        fprintf(stderr, "selftest gate: check %d: exit %d: %.*s\n", i + 1, r.code,
                row ? (int)strcspn(row + 1, "\n") : 0, row ? row + 1 : "");
        cr_expect_eq(r.code, 0, "check %d of 10 failed on an unchanged build:\n%s", i + 1, r.out);
        passes += r.code == 0;
    }
    cr_assert(setenv("TANDEM_TEST_SLOWDOWN", "2", 1) == 0);
    if (saved_ok) CLI(&r, "selftest", "--quick", "--only", "throughput", "--baseline", base);
    unsetenv("TANDEM_TEST_SLOWDOWN");
    kill(busy, SIGKILL);
    waitpid(busy, NULL, 0);
    cr_assert(saved_ok, "--save-baseline failed:\n%s", b);
    cr_expect_eq(passes, 10);
    fprintf(stderr, "selftest gate: planted 2x slowdown: %.*s\n",
            (int)strcspn(strstr(r.out, "\nthroughput ") ? strstr(r.out, "\nthroughput ") + 1 : "",
                         "\n"),
            strstr(r.out, "\nthroughput ") ? strstr(r.out, "\nthroughput ") + 1 : "");
    expect(&r, 1, "selftest: 1 passed, 1 failed");
    cr_expect(strstr(r.out, "\nthroughput                     FAIL"), "%s", r.out);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
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
