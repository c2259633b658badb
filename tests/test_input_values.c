/* tests/test_input_values.c: values that used to be quietly replaced by
 * something else are refused with one line that states the rule (exit 2):
 * `train --max-steps 0` (ran every step), `--bucket-cap-mb 0` (became the
 * default 25), `compare --warmup 100 --steps 3` (became 1 warm-up step),
 * `bench --slot-bytes 0`, `--one-shot-bytes 0` and `--memcpy-bytes 0` (the
 * defaults), and garbage in the TANDEM_* variables that hold numbers
 * (TANDEM_MPI_*_MS fell back to the default with a warning; TANDEM_SHM_SPIN_US
 * and TANDEM_MPI_SPIN_US read "2x" as 2 and "x" as 0). Good values still
 * run. Each case failed (exit 0) before. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_util.h"

TestSuite(invalues, .timeout = 300);

#define TRAIN "train", "--data", "synthetic", "--synthetic-size", "256", "--model", \
              "mlp:784-16-10", "--epochs", "1", "--quiet", "--no-eval"
#define COMPARE "compare", "--data", "synthetic", "--model", "mlp:784-16-10", "--batch", "32"

Test(invalues, zero_and_impossible_counts_are_refused_not_coerced)
{
    static cli_result r;
    CLI(&r, TRAIN, "--max-steps", "0");
    expect(&r, 2, "--max-steps: 0 is out of range [1, ");
    CLI(&r, TRAIN, "--mode", "ddp", "--device", "cpu:2", "--bucket-cap-mb", "0");
    expect(&r, 2, "--bucket-cap-mb: 0 is out of range [1e-06, ");   /* a float, as PyTorch's */
    CLI(&r, COMPARE, "--warmup", "100", "--steps", "3");
    expect(&r, 2, "--warmup 100 leaves none of the 3 steps to time");
    CLI(&r, COMPARE, "--warmup", "3", "--steps", "3");
    expect(&r, 2, "--warmup 3 leaves none of the 3 steps to time");
    const char *sizes[] = {"--slot-bytes", "--one-shot-bytes", "--memcpy-bytes"};
    for (int i = 0; i < 3; i++) {
        CLI(&r, "bench", "all_reduce", "-n", "2", "-b", "8", "-e", "64", sizes[i], "0");
        expect(&r, 2, "(leave it out for the default)");
        cr_assert(strstr(r.out, sizes[i]), "%s", r.out);
    }
    CLI(&r, "bench", "all_reduce", "-n", "2", "-b", "8", "-e", "64", "--slot-bytes", "1K");
    expect(&r, 2, "--slot-bytes 1K: expected a size from 4096");
    /* what still works: the default warm-up shrinks for a short run (as
     * --help says), sizes in range run */
    CLI(&r, COMPARE, "--steps", "2", "--modes", "single,dp");
    expect(&r, 0, "Throughput (steps 2..2)");
    CLI(&r, "bench", "all_reduce", "-n", "2", "-b", "8", "-e", "64", "--slot-bytes", "64K");
    expect(&r, 0, NULL);
}

/* The child's environment gets name=value for one run. */
static void run_env(cli_result *r, const char *name, const char *value)
{
    setenv(name, value, 1);
    CLI(r, "info");
    unsetenv(name);
}

Test(invalues, garbage_in_numeric_environment_variables_is_refused)
{
    static cli_result r;
    static const char *const bad[][3] = {
        {"TANDEM_MPI_TIMEOUT_MS", "abc", "milliseconds from 1 to"},
        {"TANDEM_MPI_TIMEOUT_MS", "0", "milliseconds from 1 to"},
        {"TANDEM_MPI_TIMEOUT_MS", "99999999999999999", "milliseconds from 1 to"},
        {"TANDEM_MPI_JOIN_TIMEOUT_MS", "5s", "milliseconds from 1 to"},
        {"TANDEM_MPI_INIT_TIMEOUT_MS", "-3", "milliseconds from 1 to"},
        {"TANDEM_NCCL_TIMEOUT_MS", "1e3", "milliseconds from 1 to"},
        {"TANDEM_SHM_STALL_MS", "soon", "milliseconds (0 or negative: off)"},
        {"TANDEM_MPI_SPIN_US", "2x", "microseconds from 0 to"},
        {"TANDEM_SHM_SPIN_US", "x", "microseconds from 0 to"},
        {"TANDEM_SHM_NT_BYTES", "lots", "bytes from 0 to"},
        {"TANDEM_FR_SIZE", "lots", "flight-recorder entries"},
        {"TANDEM_CUDA_EMULATOR", "0", "emulated CUDA devices"},
        {"TANDEM_RESTART_COUNT", "one", "restarts so far"},
        {"TANDEM_TEST_DEV_FAIL_AFTER", "-1", "device calls before each fails"},
        {"TANDEM_MPI_NB", "sometimes", "expected async|all|none"},
        {"TANDEM_MPI_THREAD_LEVEL", "lots", "expected single|funneled|serialized|multiple"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        run_env(&r, bad[i][0], bad[i][1]);
        char want[160];
        snprintf(want, sizeof want, "%s='%s'", bad[i][0], bad[i][1]);
        expect(&r, 2, want);
        expect(&r, 2, bad[i][2]);
    }
    static const char *const good[][2] = {
        {"TANDEM_MPI_TIMEOUT_MS", "60000"}, {"TANDEM_SHM_STALL_MS", "0"},
        {"TANDEM_SHM_STALL_MS", "-1"}, {"TANDEM_MPI_NB", "all"}, {"TANDEM_FR_SIZE", "0"},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        run_env(&r, good[i][0], good[i][1]);
        expect(&r, 0, NULL);
    }
}
