/* tests/test_cli_usage.c: what a new user meets first tells the truth:
 * `tandem --help` names every design train and compare run, `--version`
 * (and `info`) print the version, --bucket-cap-mb takes a float as
 * PyTorch's does, compare's gpt defaults are train's, the GPT progress
 * line uses the epoch line's unit, bench's header counts the cores
 * before pinning, and bench --backend mpi starts as root. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/device.h"
#include "tests/cli_util.h"

Test(cli_usage, help_names_every_design_and_version_is_printed, .timeout = 30)
{
    cli_result r;
    CLI(&r, "--help");
    expect(&r, 0, "train     train a model: one device, DP, DDP or FSDP/ZeRO (--mode)");
    cr_expect(strstr(r.out, "compare   one device, DP, DDP, FSDP, ZeRO-2, ZeRO-1 and PP"), "%s",
              r.out);
    cr_expect(strstr(r.out, "--version"), "%s", r.out);
    CLI(&r, "--version");
    expect(&r, 0, "tandem 0.1.0");
    char version[256];
    snprintf(version, sizeof version, "%.*s", (int)strcspn(r.out, "\n"), r.out);
    CLI(&r, "info");
    expect(&r, 0, version);
    cr_expect(!strncmp(r.out, version, strlen(version)), "info does not start with '%s':\n%s",
              version, r.out);
    /* train's and compare's --mode/--modes lists agree with the summary */
    CLI(&r, "train", "--help");
    expect(&r, 0, "fsdp");
    CLI(&r, "compare", "--help");
    expect(&r, 0, "zero1");
}

Test(cli_usage, bucket_cap_mb_takes_a_float_and_refuses_zero, .timeout = 120)
{
    cli_result r;
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "256", "--batch", "64", "--model", "mlp:784-32-10", "--epochs", "1",
        "--no-eval", "--bucket-cap-mb", "0.1");
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", "--mode", "ddp", "--bucket-cap-mb", "0");
    expect(&r, 2, "--bucket-cap-mb: 0 is out of range");
    CLI(&r, "compare", "--bucket-cap-mb", "0");
    expect(&r, 2, "--bucket-cap-mb: 0 is out of range");
    cr_expect(!cli_shm_entries());
}

/* compare --model gpt trains as train --model gpt does: AdamW at 2e-3. */
Test(cli_usage, compare_gpt_uses_train_gpt_defaults, .timeout = 300)
{
    char dir[] = "/tmp/tdm_usage_XXXXXX", text[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(text, sizeof text, "%s/words.txt", dir);
    cli_write_words(text);
    cli_result r;
    CLI(&r, "compare", "--model", "gpt:1-32-2-16", "--data", text, "--modes", "single,ddp",
        "--steps", "3", "--warmup", "1");
    cr_expect(r.code == 0 || r.code == 3, "exit %d:\n%s", r.code, r.out);
    cr_expect(strstr(r.out, "adamw lr 0.002"), "compare's gpt does not use AdamW 2e-3:\n%s",
              r.out);
    CLI(&r, "compare", "--model", "mlp", "--help");
    expect(&r, 0, "gpt: adamw");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}

/* The progress line of a gpt says windows/s = tokens/s, as its epoch line. */
Test(cli_usage, gpt_progress_and_epoch_lines_use_one_unit, .timeout = 300)
{
    char dir[] = "/tmp/tdm_usage_XXXXXX", text[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(text, sizeof text, "%s/words.txt", dir);
    cli_write_words(text);
    cli_result r;
    CLI(&r, "train", "--model", "gpt:1-32-2-16", "--data", text, "--batch", "4", "--epochs", "1",
        "--max-steps", "20", "--no-eval");
    expect(&r, 0, "epoch 1/1: train loss");
    const char *progress = strstr(r.out, "  epoch 1/1 step ");
    cr_assert_not_null(progress, "no progress line:\n%s", r.out);
    char line[256];
    snprintf(line, sizeof line, "%.*s", (int)strcspn(progress, "\n"), progress);
    cr_expect(strstr(line, "windows/s = ") && strstr(line, "tokens/s"), "%s", line);
    cr_expect(!strstr(line, "samples/s"), "%s", line);
    cr_expect(strstr(r.out, "windows/s = "), "%s", r.out);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* Rank 0 pins itself before it prints the header: the count is taken
 * before, and is this process's cores. */
Test(cli_usage, bench_header_counts_cores_before_pinning, .timeout = 120)
{
    cli_result r;
    CLI(&r, "bench", "all_reduce", "-n", "2", "-b", "8", "-e", "64");
    expect(&r, 0, "# tandem bench all_reduce: 2 ranks (shm, ");
    char want[64];
    int cores = tdm_device_host_cores();
    snprintf(want, sizeof want, "(shm, %d cores", cores);
    cr_expect(strstr(r.out, want), "want '%s' (%d cores here):\n%s", want, cores, r.out);
    cr_expect(!cli_shm_entries());
}

/* As root, bench --backend mpi starts mpirun with Open MPI's two
 * allow-run-as-root variables and says so (here the test's own are
 * removed first: tests/mpi_test_util.h sets them for other tests). */
Test(cli_usage, bench_mpi_starts_as_root, .timeout = 200)
{
    if (geteuid() != 0) cr_skip_test("not root");
    if (system("command -v mpirun >/dev/null 2>&1") != 0) cr_skip_test("no mpirun");
    unsetenv("OMPI_ALLOW_RUN_AS_ROOT");
    unsetenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM");
    /* make asan: the ranks this bench starts under mpirun would report
     * Open MPI's own allocations left at exit (its plugins are unloaded
     * by then, so no suppression can name them) and exit 1; they keep
     * ASan's other checks (as tests/mpi_test_util.h's runs do) */
    const char *asan = getenv("ASAN_OPTIONS");
    char *saved = asan ? strdup(asan) : NULL;
    if (asan) {
        static char opts[1024];
        snprintf(opts, sizeof opts, "%s:detect_leaks=0", asan);
        setenv("ASAN_OPTIONS", opts, 1);
    }
    cli_result r;
    CLI(&r, "bench", "all_reduce", "--backend", "shm,mpi", "-b", "8", "-e", "64");
    if (saved) setenv("ASAN_OPTIONS", saved, 1);
    free(saved);
    if (strstr(r.out, "mpi/ is not built") || strstr(r.out, "MPI's development files"))
        cr_skip_test("built without MPI");
    expect(&r, 0, "# running as root: OMPI_ALLOW_RUN_AS_ROOT=1");
    cr_expect(strstr(r.out, "2 cores here") || strstr(r.out, "cores here"), "%s", r.out);
    cr_expect(strstr(r.out, "| mpi "), "%s", r.out);
    cr_expect(!cli_shm_entries());
}
