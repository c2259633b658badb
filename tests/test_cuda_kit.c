/* tests/test_cuda_kit.c: the GPU test runners (cuda/test-cuda.sh behind
 * `make test-cuda`, cuda/test-gpu.sh behind `make test-gpu`) judged on
 * fake builds, so that their verdicts are tested on every machine: fake
 * test binaries print canned Criterion output (GPU tests passed, or all
 * skipped "no CUDA device: ..."), a fake `tandem info` prints the CUDA
 * versions, and a fake nvidia-smi or /proc/driver/nvidia says whether the
 * kernel driver sees a GPU (TANDEM_NVIDIA_SMI, TANDEM_NVIDIA_PROC).
 *
 * The case that matters: GPUs present, every GPU test skipped (a driver
 * too old for this build's CUDA runtime) must fail loudly with the
 * versions found, not pass as "skipped".
 *
 * Runs from the repository root (as tests/run_all.sh does); needs sh. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct kit_fake {
    char dir[256];
    char out[65536];
    int code;
} kit_fake;

static void kit_write(const char *path, const char *text, int exec)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(chmod(path, exec ? 0755 : 0644), 0);
}

static void kit_mkdir(const kit_fake *k, const char *sub)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", k->dir, sub);
    cr_assert_eq(mkdir(p, 0755), 0, "%s", p);
}

#define KIT_NODEV "no CUDA device: CUDA driver version is insufficient for CUDA runtime " \
                  "version (cudaErrorInsufficientDriver from cudaGetDeviceCount); use --device cpu:N"

/* A fake test binary: `gpu` says how its GPU tests ended ("PASS", "SKIP"
 * or "FAIL"); `multi` likewise for its test that needs two GPUs; its
 * host-side test passes. */
static void kit_fake_test(const kit_fake *k, const char *name, const char *gpu, const char *multi)
{
    char path[512], text[4096];
    int tested = 1, passing = 1, failing = 0;
    char lines[2048] = "";
    const char *st[2] = {gpu, multi};
    const char *test[2] = {"cuda_gpu::kernels_match_host", "cuda_multi::nccl_group_broadcast"};
    for (int i = 0; i < 2; i++) {
        size_t used = strlen(lines);
        if (!strcmp(st[i], "SKIP")) {
            snprintf(lines + used, sizeof lines - used, "[SKIP] %s: %s\n", test[i],
                     i == 1 && !strcmp(gpu, "PASS") ? "needs 2 CUDA devices, 1 visible"
                                                    : KIT_NODEV);
            continue;
        }
        tested++;
        if (!strcmp(st[i], "PASS")) {
            passing++;
            snprintf(lines + used, sizeof lines - used, "[PASS] %s: (0.10s)\n", test[i]);
        } else {
            failing++;
            snprintf(lines + used, sizeof lines - used,
                     "[----] tests/%s.c:10: Assertion Failed\n[FAIL] %s: (0.10s)\n", name,
                     test[i]);
        }
    }
    snprintf(text, sizeof text,
             "#!/bin/sh\ncat <<'EOF'\n[====] Running 1 test from cuda_emu:\n"
             "[PASS] cuda_emu::%s_host_side: (0.01s)\n%s"
             "[====] Synthesis: Tested: %d | Passing: %d | Failing: %d | Crashing: 0 \nEOF\n"
             "exit %d\n", name, lines, tested, passing, failing, failing ? 1 : 0);
    snprintf(path, sizeof path, "%s/build/tests/%s", k->dir, name);
    kit_write(path, text, 1);
}

/* A fake build (six test binaries, `tandem info`), and the driver's view:
 * smi_gpus GPUs listed by a fake nvidia-smi (-1: no nvidia-smi), proc_gpus
 * GPUs under a fake /proc/driver/nvidia. */
static void kit_fake_setup(kit_fake *k, const char *gpu, const char *multi, int smi_gpus,
                           int proc_gpus)
{
    char p[512];
    snprintf(k->dir, sizeof k->dir, "/tmp/tandem-kit-test.XXXXXX");
    cr_assert_not_null(mkdtemp(k->dir));
    kit_mkdir(k, "build");
    kit_mkdir(k, "build/tests");
    kit_mkdir(k, "proc");
    kit_fake_test(k, "test_cuda", gpu, multi);
    kit_fake_test(k, "test_cuda_train", gpu, "SKIP");
    kit_fake_test(k, "test_bench_cuda", gpu, "SKIP");
    kit_fake_test(k, "test_cuda_gpt", gpu, "SKIP");
    kit_fake_test(k, "test_fsdp_cli", gpu, "SKIP");
    kit_fake_test(k, "test_det_gpu", gpu, "SKIP");
    snprintf(p, sizeof p, "%s/build/tandem", k->dir);
    kit_write(p, "#!/bin/sh\ncat <<'EOF'\ntandem 0.1.0 (fake)\ndevices:\n"
                 "  CUDA runtime   13.0\n  CUDA driver    12.2\n  NCCL           2.28.9\n"
                 "  cuda           " KIT_NODEV "\nEOF\n", 1);
    if (smi_gpus >= 0) {
        char text[1024] = "#!/bin/sh\ncase \"$1\" in\n-L)\n";
        for (int i = 0; i < smi_gpus; i++) {
            size_t used = strlen(text);
            snprintf(text + used, sizeof text - used,
                     "echo 'GPU %d: NVIDIA H100 80GB HBM3 (UUID: GPU-fake-%d)'\n", i, i);
        }
        size_t used = strlen(text);
        snprintf(text + used, sizeof text - used,
                 ";;\n--query-gpu=driver_version) echo 535.104.05 ;;\n*) exit 9 ;;\nesac\n");
        snprintf(p, sizeof p, "%s/nvidia-smi", k->dir);
        kit_write(p, text, 1);
    }
    if (proc_gpus > 0) {
        kit_mkdir(k, "proc/gpus");
        for (int i = 0; i < proc_gpus; i++) {
            char sub[64];
            snprintf(sub, sizeof sub, "proc/gpus/0000:%02x:00.0", i + 1);
            kit_mkdir(k, sub);
            snprintf(p, sizeof p, "%s/%s/information", k->dir, sub);
            kit_write(p, "Model: \t\t NVIDIA A100-SXM4-80GB\nIRQ:   \t\t 42\n", 0);
        }
        snprintf(p, sizeof p, "%s/proc/version", k->dir);
        kit_write(p, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 "
                     "01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n", 0);
    }
}

/* Runs `sh cuda/<script> <fake build>` with the fake driver view and
 * $extra_env; output in k->out, exit status in k->code. */
static void kit_fake_run(kit_fake *k, const char *script, const char *extra_env)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "TANDEM_NVIDIA_SMI='%s/nvidia-smi' TANDEM_NVIDIA_PROC='%s/proc' %s "
             "sh cuda/%s '%s/build' 2>&1", k->dir, k->dir, extra_env ? extra_env : "", script,
             k->dir);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    size_t n = fread(k->out, 1, sizeof k->out - 1, f);
    k->out[n] = '\0';
    int ws = pclose(f);
    cr_assert(WIFEXITED(ws), "%s did not exit: 0x%x", script, ws);
    k->code = WEXITSTATUS(ws);
}

static void kit_fake_free(kit_fake *k)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", k->dir);
    cr_assert_eq(system(cmd), 0);
}

static void kit_expect(const kit_fake *k, const char *phrase)
{
    cr_assert(strstr(k->out, phrase), "no '%s' in the output (exit %d):\n%s", phrase, k->code,
              k->out);
}

static void kit_need_scripts(void)
{
    if (access("cuda/test-cuda.sh", R_OK) != 0)
        cr_assert_fail("cuda/test-cuda.sh not found: run the tests from the repository root");
}

/* ------------------------------ test-cuda --------------------------------- */

Test(cuda_kit, test_cuda_fails_when_gpus_are_present_but_every_gpu_test_skipped, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    kit_fake_setup(&k, "SKIP", "SKIP", 2, 0);
    kit_fake_run(&k, "test-cuda.sh", NULL);
    cr_assert_neq(k.code, 0, "exit 0 although 2 GPUs are present and no GPU test ran:\n%s",
                  k.out);
    kit_expect(&k, "2 GPU(s) present, but no GPU test ran");
    kit_expect(&k, "GPU 1: NVIDIA H100");
    kit_expect(&k, "kernel driver 535.104.05");                  /* nvidia-smi */
    kit_expect(&k, "CUDA version the driver supports: 12.2");   /* tandem info */
    kit_expect(&k, "CUDA runtime of this build: 13.0");
    kit_expect(&k, "R580");
    kit_expect(&k, "cudaErrorInsufficientDriver");               /* the tests' reason */
    kit_expect(&k, "make NVCC=/usr/local/cuda-12.x/bin/nvcc test-cuda");
    kit_fake_free(&k);
}

Test(cuda_kit, test_cuda_sees_gpus_through_proc_without_nvidia_smi, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    kit_fake_setup(&k, "SKIP", "SKIP", -1, 1);
    kit_fake_run(&k, "test-cuda.sh", NULL);
    cr_assert_neq(k.code, 0, "exit 0 although /proc/driver/nvidia lists a GPU:\n%s", k.out);
    kit_expect(&k, "1 GPU(s) present");
    kit_expect(&k, "NVIDIA A100-SXM4-80GB");
    kit_expect(&k, "kernel driver 535.104.05");   /* from /proc/driver/nvidia/version */
    kit_fake_free(&k);
}

Test(cuda_kit, test_cuda_without_gpus_passes_and_says_nothing_ran_on_a_gpu, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    kit_fake_setup(&k, "SKIP", "SKIP", -1, 0);
    kit_fake_run(&k, "test-cuda.sh", NULL);
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "SKIPPED");
    kit_expect(&k, "not run on a GPU");
    /* nvidia-smi present but listing no GPU: the same */
    kit_fake_free(&k);
    kit_fake_setup(&k, "SKIP", "SKIP", 0, 0);
    kit_fake_run(&k, "test-cuda.sh", NULL);
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "SKIPPED");
    kit_fake_free(&k);
}

Test(cuda_kit, test_cuda_passes_when_gpu_tests_ran_and_fails_on_a_failure, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    kit_fake_run(&k, "test-cuda.sh", NULL);
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "GPU tests ran");
    kit_fake_free(&k);
    kit_fake_setup(&k, "FAIL", "SKIP", 1, 0);
    kit_fake_run(&k, "test-cuda.sh", NULL);
    cr_assert_eq(k.code, 1, "%s", k.out);
    kit_expect(&k, "test_cuda FAILED");
    kit_fake_free(&k);
}

/* ------------------------------ test-gpu ---------------------------------- */

static void kit_read_file(const kit_fake *k, const char *rel, char *buf, size_t len)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", k->dir, rel);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f, "%s was not written", p);
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = '\0';
    fclose(f);
}

Test(cuda_kit, test_gpu_without_a_gpu_says_nothing_ran_and_exits_77, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    kit_fake_setup(&k, "SKIP", "SKIP", -1, 0);
    kit_fake_run(&k, "test-gpu.sh", NULL);
    cr_assert_eq(k.code, 77, "%s", k.out);
    kit_expect(&k, "no GPU: nothing ran on a GPU");
    kit_expect(&k, "verdict          NO GPU");
    kit_fake_free(&k);
}

Test(cuda_kit, test_gpu_passes_when_every_one_gpu_test_ran_and_records_a_summary, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    static char summary[16384];
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    kit_fake_run(&k, "test-gpu.sh", "TANDEM_COMPUTE_SANITIZER=none");
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "verdict          PASS: all 6 one-GPU tests ran and passed");
    kit_expect(&k, "device           GPU 0: NVIDIA H100");
    kit_expect(&k, "kernel 535.104.05");
    kit_expect(&k, "compute-sanitizer not installed");
    /* the two-GPU test skipped: reported, not required */
    kit_expect(&k, "  cuda_multi            0      0       6");
    kit_read_file(&k, "build/test-gpu.txt", summary, sizeof summary);
    cr_assert(strstr(summary, "verdict          PASS"), "%s", summary);
    kit_read_file(&k, "build/test-gpu.log", summary, sizeof summary);
    cr_assert(strstr(summary, "[PASS] cuda_gpu::kernels_match_host"), "%s", summary);
    kit_fake_free(&k);
}

Test(cuda_kit, test_gpu_fails_when_a_one_gpu_test_skipped_on_a_gpu_machine, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    kit_fake_test(&k, "test_bench_cuda", "SKIP", "SKIP");
    kit_fake_run(&k, "test-gpu.sh", "TANDEM_COMPUTE_SANITIZER=none");
    cr_assert_eq(k.code, 1, "%s", k.out);
    kit_expect(&k, "one-GPU tests did not run");
    kit_expect(&k, "cuda_gpu::kernels_match_host: no CUDA device");
    kit_fake_free(&k);
    /* every GPU test skipped: the versions, as test-cuda */
    kit_fake_setup(&k, "SKIP", "SKIP", 1, 0);
    kit_fake_run(&k, "test-gpu.sh", "TANDEM_COMPUTE_SANITIZER=none");
    cr_assert_eq(k.code, 1, "%s", k.out);
    kit_expect(&k, "no GPU test ran");
    kit_expect(&k, "R580");
    kit_expect(&k, "make NVCC=/usr/local/cuda-12.x/bin/nvcc test-gpu");
    kit_fake_free(&k);
}

Test(cuda_kit, test_gpu_fails_on_a_memcheck_error, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    char p[512], env[600];
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    /* a fake compute-sanitizer: runs the binary after its 8 option words,
     * then reports what the real one would */
    snprintf(p, sizeof p, "%s/compute-sanitizer", k.dir);
    kit_write(p, "#!/bin/sh\nshift 8\n\"$@\"\necho '========= ERROR SUMMARY: 2 errors'\nexit 86\n", 1);
    snprintf(env, sizeof env, "TANDEM_COMPUTE_SANITIZER='%s'", p);
    kit_fake_run(&k, "test-gpu.sh", env);
    cr_assert_eq(k.code, 1, "%s", k.out);
    kit_expect(&k, "verdict          FAILED: memcheck");
    kit_expect(&k, "test_cuda: FAILED (exit 86, 2 error(s)");
    kit_fake_free(&k);
    /* and a clean one passes */
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    snprintf(p, sizeof p, "%s/compute-sanitizer", k.dir);
    kit_write(p, "#!/bin/sh\nshift 8\n\"$@\"\necho '========= ERROR SUMMARY: 0 errors'\n", 1);
    snprintf(env, sizeof env, "TANDEM_COMPUTE_SANITIZER='%s'", p);
    kit_fake_run(&k, "test-gpu.sh", env);
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "memcheck         test_cuda: 2 tests, 0 errors; test_cuda_train: 2 tests, 0 errors;");
    kit_fake_free(&k);
}

/* memcheck where it starts: a compute-sanitizer that cannot start is
 * reported, not failed; one stopped by TANDEM_MEMCHECK_TIMEOUT says what
 * it checked; the summary and log go to TANDEM_KIT_OUT. */
Test(cuda_kit, test_gpu_reports_a_sanitizer_that_does_not_start_or_is_stopped, .timeout = 60)
{
    kit_need_scripts();
    static kit_fake k;
    static char summary[16384];
    char p[512], env[1200];
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    snprintf(p, sizeof p, "%s/compute-sanitizer", k.dir);
    kit_write(p, "#!/bin/sh\necho '========= Error: Target device is not supported'\nexit 1\n", 1);
    kit_mkdir(&k, "out");
    snprintf(env, sizeof env, "TANDEM_COMPUTE_SANITIZER='%s' TANDEM_KIT_OUT='%s/out'", p, k.dir);
    kit_fake_run(&k, "test-gpu.sh", env);
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "test_cuda: compute-sanitizer did not start (exit 1: ========= Error: Target "
                   "device is not supported), not checked;");
    kit_read_file(&k, "out/test-gpu.txt", summary, sizeof summary);
    cr_assert(strstr(summary, "verdict          PASS"), "%s", summary);
    kit_read_file(&k, "out/test-gpu.log", summary, sizeof summary);
    cr_assert(strstr(summary, "[PASS] cuda_gpu::kernels_match_host"), "%s", summary);
    snprintf(p, sizeof p, "%s/build/test-gpu.txt", k.dir);
    cr_assert_neq(access(p, F_OK), 0, "the summary went to the build, not TANDEM_KIT_OUT");
    kit_fake_free(&k);
    /* a run stopped by the timeout: what ran is reported, no failure */
    kit_fake_setup(&k, "PASS", "SKIP", 1, 0);
    snprintf(p, sizeof p, "%s/compute-sanitizer", k.dir);
    kit_write(p, "#!/bin/sh\nshift 8\n\"$@\"\nexec sleep 30\n", 1);
    snprintf(env, sizeof env, "TANDEM_COMPUTE_SANITIZER='%s' TANDEM_MEMCHECK_TIMEOUT=1", p);
    kit_fake_run(&k, "test-gpu.sh", env);
    cr_assert_eq(k.code, 0, "%s", k.out);
    kit_expect(&k, "test_cuda: stopped after 1 s, 0 errors in the 2 tests it ran;");
    kit_fake_free(&k);
}
