/* tests/test_bench_cuda.c: `tandem bench` on CUDA devices, through the
 * CLI. No GPU is needed: with TANDEM_CUDA_EMULATOR=2 in the child's
 * environment the backend reports two emulated GPUs (cuda-emu:0,1), so
 * every bench subcommand runs its CUDA path (rank per device, device
 * buffers staged from the host for the #wrong check, the d2d reference,
 * the first listed device as DP's baseline, device-side gemm operands)
 * with the collectives over shm instead of NCCL.
 *
 * - bench_emu: each subcommand on emulated devices: exit 0, the emulator
 *   line, #wrong 0 on every row of every collective; flags that do not
 *   apply to CUDA refused with exit 2 and one line.
 * - bench_nodev: without the emulator and without a GPU, each subcommand
 *   with --device cuda exits 1 with one "no CUDA device" line.
 * - cuda_gpu (a GPU only): every collective on one NCCL rank, bench train
 *   and dp on GPU 0.
 * - bench_check: the #wrong check itself (tools/bench_check.h) against
 *   NCCL's definition of AVG, which the emulator cannot produce (it
 *   reduces over shm, which averages as sum / n).
 *
 * What this does not test: CUDA itself, NCCL, GPU timings. Skipped when
 * the CUDA backend is not built (no nvcc). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/device.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tools/bench_check.h"

/* Criterion runs each test in its own process: the variable only reaches
 * the tandem processes this test starts. */
static void emu_init(void) { setenv("TANDEM_CUDA_EMULATOR", "2", 1); }
static void emu_fini(void) { unsetenv("TANDEM_CUDA_EMULATOR"); }

static void expect_one_line(const cli_result *r, int code, const char *phrase)
{
    expect(r, code, phrase);
    cr_assert(strchr(r->out, '\n') == strrchr(r->out, '\n'), "more than one line:\n%s", r->out);
}

/* Rows of a bench <collective> table: each row's two #wrong columns must
 * be 0 and each row's type must be dtype. Returns the number of rows. */
static int check_rows(const char *out, const char *dtype)
{
    int rows = 0;
    for (const char *line = out, *nl; *line; line = nl ? nl + 1 : line + strlen(line)) {
        nl = strchr(line, '\n');
        size_t size, count;
        char type[16], redop[8];
        int root;
        double us[2], alg[2], bus[2];
        long long wrong[2];
        if (sscanf(line, "%zu %zu %15s %7s %d | %lf %lf %lf %lld | %lf %lf %lf %lld |", &size,
                   &count, type, redop, &root, &us[0], &alg[0], &bus[0], &wrong[0], &us[1],
                   &alg[1], &bus[1], &wrong[1]) != 13)
            continue;
        cr_assert_eq(wrong[0] + wrong[1], 0, "#wrong on the row of %zu bytes:\n%s", size, out);
        cr_assert_str_eq(type, dtype, "row of %zu bytes:\n%s", size, out);
        cr_assert(us[0] > 0 && us[1] > 0, "row of %zu bytes has no time:\n%s", size, out);
        rows++;
    }
    return rows;
}

Test(bench_emu, all_reduce_on_emulated_devices, .init = emu_init, .fini = emu_fini,
     .timeout = 60)
{
    CU_NEED_BACKEND();
    static cli_result r;
    CLI(&r, "bench", "all_reduce", "--device", "cuda", "-b", "8", "-e", "1M");
    expect(&r, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)");
    cr_assert(strstr(r.out, "2 ranks, one per device of --device cuda (cuda-emu:0,cuda-emu:1)"),
              "header lacks the devices:\n%s", r.out);
    cr_assert(strstr(r.out, "# d2d reference: 2 devices each copying"), "no d2d line:\n%s",
              r.out);
    cr_assert(strstr(r.out, "busbw/d2d(oop,ip)"), "no d2d column:\n%s", r.out);
    cr_assert(strstr(r.out, "device buffers"), "buffers not named:\n%s", r.out);
    cr_assert(strstr(r.out, "# Out of bounds values : 0 OK"), "%s", r.out);
    /* 8, 16, .., 1M: 18 rows */
    cr_assert_eq(check_rows(r.out, "float32"), 18, "rows:\n%s", r.out);
}

Test(bench_emu, every_collective_dtype_and_op, .init = emu_init, .fini = emu_fini,
     .timeout = 60)
{
    CU_NEED_BACKEND();
    static const struct { const char *coll, *dtype, *op, *root; } runs[] = {
        {"reduce_scatter", "float32", "sum", "0"}, {"all_gather", "float32", "sum", "0"},
        {"broadcast", "float32", "sum", "1"},      {"reduce", "float32", "sum", "1"},
        {"all_reduce", "int32", "max", "0"},       {"all_reduce", "float64", "avg", "0"},
        {"all_reduce", "int64", "prod", "0"},      {"reduce_scatter", "int32", "min", "0"},
        {"reduce", "float64", "avg", "0"},
    };
    static cli_result r;
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        /* 64 B to 64 KiB by 4: the shm algorithms' small and large paths */
        CLI(&r, "bench", runs[i].coll, "--device", "cuda:0,1", "-b", "64", "-e", "64K", "-f",
            "4", "-d", runs[i].dtype, "-o", runs[i].op, "-r", runs[i].root, "-w", "1", "-i", "2",
            "--memcpy-bytes", "1M");
        cr_assert_eq(r.code, 0, "%s %s %s: exit %d:\n%s", runs[i].coll, runs[i].dtype,
                     runs[i].op, r.code, r.out);
        cr_assert(strstr(r.out, "CUDA EMULATOR"), "%s", r.out);
        cr_assert(strstr(r.out, "# d2d reference: 2 devices each copying 1048576 bytes"), "%s",
                  r.out);
        cr_assert_eq(check_rows(r.out, runs[i].dtype), 6, "%s %s:\n%s", runs[i].coll,
                     runs[i].dtype, r.out);
    }
    /* one device, one rank */
    CLI(&r, "bench", "all_reduce", "--device", "cuda:1", "-b", "8", "-e", "1K", "-w", "1", "-i",
        "2", "--memcpy-bytes", "64K");
    expect(&r, 0, "1 ranks, one per device of --device cuda:1 (cuda-emu:1)");
    cr_assert_eq(check_rows(r.out, "float32"), 8, "%s", r.out);
}

Test(bench_emu, flags_that_do_not_apply_to_cuda_are_refused, .init = emu_init,
     .fini = emu_fini, .timeout = 30)
{
    CU_NEED_BACKEND();
    static cli_result r;
    CLI(&r, "bench", "all_reduce", "--device", "cuda", "-n", "3");
    expect_one_line(&r, 2, "-n 3: --device cuda names 2 devices, and there is one rank per "
                           "device");
    CLI(&r, "bench", "all_reduce", "--device", "cuda:0", "-n", "2");
    expect_one_line(&r, 2, "names 1 device,");
    CLI(&r, "bench", "all_reduce", "--device", "cuda", "-d", "bf16");
    expect_one_line(&r, 2, "-d bfloat16: the NCCL communicator of --device cuda takes float32, "
                           "float64, int32 and int64 only");
    CLI(&r, "bench", "all_gather", "--device", "cuda", "-d", "fp16");
    expect_one_line(&r, 2, "-d float16: the NCCL communicator");
    CLI(&r, "bench", "all_reduce", "--device", "cuda", "--zero-copy");
    expect_one_line(&r, 2, "--zero-copy applies to the shm communicator only");
    CLI(&r, "bench", "all_reduce", "--device", "cuda", "--slot-bytes", "4K");
    expect_one_line(&r, 2, "--slot-bytes applies to the shm communicator only");
    CLI(&r, "bench", "all_reduce", "--device", "cuda", "--one-shot-bytes", "1K");
    expect_one_line(&r, 2, "--one-shot-bytes applies to the shm communicator only");
    CLI(&r, "bench", "broadcast", "--device", "cuda", "-r", "2");
    expect_one_line(&r, 2, "-r 2: root must be below -n 2");
    CLI(&r, "bench", "dp", "--device", "cuda:0,1", "--blas-threads", "2");
    expect_one_line(&r, 2, "--blas-threads applies to host devices only");
    CLI(&r, "bench", "gemm", "--device", "cuda:0", "--threads", "2");
    expect_one_line(&r, 2, "--threads sets host BLAS threads; not with --device cuda:0");
    CLI(&r, "bench", "train", "--device", "cuda:0", "--threads", "2");
    expect_one_line(&r, 2, "--threads sets host BLAS threads");
    /* one device: "cuda" is GPU 0 (cuda_emu_cli tests it), a list is refused */
    CLI(&r, "bench", "gemm", "--device", "cuda:0,1");
    expect_one_line(&r, 2, "--device cuda:0,1 names 2 devices; it runs on one");
    /* the shm-only flags stay accepted on host devices */
    CLI(&r, "bench", "all_reduce", "--device", "cpu", "--zero-copy", "-e", "1K", "-w", "1", "-i",
        "2", "--memcpy-bytes", "64K");
    expect(&r, 0, "zero-copy (in the segment)");
    cr_assert_eq(check_rows(r.out, "float32"), 8, "%s", r.out);
}

Test(bench_emu, dp_on_emulated_devices, .init = emu_init, .fini = emu_fini, .timeout = 60)
{
    CU_NEED_BACKEND();
    static cli_result r;
    CLI(&r, "bench", "dp", "--device", "cuda:0,1", "--model", "mlp:784-64-10", "--batch", "32",
        "--steps", "2", "--warmup", "1", "--rounds", "1");
    expect(&r, 0, "single cuda-emu:0 vs DP on cuda:0,1 (2 devices: cuda-emu:0,cuda-emu:1)");
    cr_assert(strstr(r.out, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)"), "%s", r.out);
    cr_assert(strstr(r.out, "\nsingle cuda-emu:0 "), "baseline row:\n%s", r.out);
    cr_assert(strstr(r.out, "\nsync "), "no sync phase:\n%s", r.out);
    cr_assert(strstr(r.out, "RESULT model=mlp:784-64-10 batch=32 devices=cuda:0,1"), "%s",
              r.out);
    /* a CNN (batchnorm buffers, im2col) and a batch below the device count */
    CLI(&r, "bench", "dp", "--device", "cuda", "--model", "cnn", "--batch", "4", "--steps", "1",
        "--warmup", "0", "--rounds", "1");
    expect(&r, 0, "single cuda-emu:0 vs DP on cuda");
    CLI(&r, "bench", "dp", "--device", "cuda:1,0", "--model", "mlp:784-16-10", "--batch", "1",
        "--steps", "1", "--warmup", "0", "--rounds", "1");
    expect(&r, 0, "single cuda-emu:1 vs DP on cuda:1,0");
}

Test(bench_emu, gemm_and_train_on_an_emulated_device, .init = emu_init, .fini = emu_fini,
     .timeout = 60)
{
    CU_NEED_BACKEND();
    static cli_result r;
    CLI(&r, "bench", "gemm", "--device", "cuda:1");
    expect(&r, 0, "sgemm on cuda-emu:1 (emulated: the host's gemm, not cuBLAS)");
    cr_assert(strstr(r.out, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)"), "%s", r.out);
    double ceiling = 0;
    const char *c = strstr(r.out, "ceiling: ");
    cr_assert(c && sscanf(c, "ceiling: %lf GFLOP/s", &ceiling) == 1 && ceiling > 0, "%s", r.out);
    CLI(&r, "bench", "train", "--device", "cuda:0", "--model", "mlp:784-64-10", "--batch", "32",
        "--steps", "5");
    expect(&r, 0, "one device: cuda-emu:0 (emulated");
    cr_assert(strstr(r.out, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)"), "%s", r.out);
    double sps = 0;
    c = strstr(r.out, "throughput: ");
    cr_assert(c && sscanf(c, "throughput: %lf samples/s", &sps) == 1 && sps > 0, "%s", r.out);
}

/* On one real GPU: every collective with one NCCL rank (#wrong 0, avg
 * included), and bench train and dp on the first GPU. Skipped without a
 * GPU ("no CUDA device: ..."). */
Test(cuda_gpu, cli_bench_on_one_gpu, .timeout = 240)
{
    NEED_GPUS(1);
    static cli_result r;
    const char *colls[] = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"};
    for (size_t i = 0; i < sizeof colls / sizeof *colls; i++) {
        CLI(&r, "bench", colls[i], "--device", "cuda:0", "-b", "8", "-e", "4M", "-o",
            i == 0 ? "avg" : "sum");
        expect(&r, 0, "# Out of bounds values : 0 OK");
        cr_assert_gt(check_rows(r.out, "float32"), 0, "%s: no rows:\n%s", colls[i], r.out);
        cr_assert(!strstr(r.out, "CUDA EMULATOR"), "%s", r.out);
    }
    CLI(&r, "bench", "train", "--device", "cuda", "--model", "cnn", "--batch", "64", "--steps",
        "10");
    expect(&r, 0, "one device: cuda:0");
    CLI(&r, "bench", "dp", "--device", "cuda:0", "--model", "mlp:784-256-10", "--batch", "64",
        "--steps", "3", "--warmup", "1", "--rounds", "1");
    expect(&r, 0, "RESULT model=mlp:784-256-10");
}

Test(bench_nodev, every_subcommand_fails_with_one_line, .timeout = 60)
{
    unsetenv("TANDEM_CUDA_EMULATOR");
    char why[512];
    if (cu_gpu_count(why, sizeof why) > 0) cr_skip_test("a CUDA device exists");
    static cli_result r;
    CLI(&r, "bench", "gemm", "--device", "cuda:0");
    expect_one_line(&r, 1, "tandem bench gemm: --device: no CUDA device: ");
    CLI(&r, "bench", "train", "--device", "cuda:0", "--steps", "5");
    expect_one_line(&r, 1, "tandem bench train: --device: no CUDA device: ");
    CLI(&r, "bench", "dp", "--device", "cuda");
    expect_one_line(&r, 1, "tandem bench dp: --device: no CUDA device: ");
    CLI(&r, "bench", "dp", "--device", "cuda:0,1");
    expect_one_line(&r, 1, "no CUDA device: ");
    CLI(&r, "bench", "all_reduce", "--device", "cuda:0,1", "-e", "1K");
    expect_one_line(&r, 1, "tandem bench: --device: no CUDA device: ");
    cr_assert(!strncmp(r.out, "tandem bench: --device: no CUDA device:", 39), "%s", r.out);
}

/* ============================ the #wrong check ============================ */

/* NCCL's AVG of floating-point data is PreMulSum (src/enqueue.cc,
 * hostToDevRedOp): every rank's input times the scalar 1/n rounded to the
 * type, then a sum in the algorithm's order. order 0: rank order; 1:
 * reverse (a ring that ends elsewhere); 2: pairwise (a tree). */
#define NCCL_AVG(T, NAME)                                                              \
    static T NAME(size_t j, int n, int order)                                          \
    {                                                                                   \
        T s = (T)(1.0 / n), v[64];                                                      \
        for (int r = 0; r < n; r++) v[r] = (T)tdm_bench_ref_val(j, r, TDM_REDOP_AVG) * s; \
        if (order == 2) {                                                               \
            for (int w = 1; w < n; w *= 2)                                              \
                for (int r = 0; r + w < n; r += 2 * w) v[r] = v[r] + v[r + w];          \
            return v[0];                                                                \
        }                                                                               \
        T acc = order ? v[n - 1] : v[0];                                                \
        for (int r = 1; r < n; r++) acc = acc + (order ? v[n - 1 - r] : v[r]);          \
        return acc;                                                                     \
    }
NCCL_AVG(float, nccl_avg_f32)
NCCL_AVG(double, nccl_avg_f64)

Test(bench_check, avg_accepts_nccls_premultiplied_mean)
{
    int differs[9] = {0};
    for (int n = 1; n <= 8; n++)
        for (size_t j = 0; j < 2000; j++) {
            int64_t sum = tdm_bench_ref(j, n, TDM_REDOP_AVG);
            for (int order = 0; order < 3; order++) {
                float f = nccl_avg_f32(j, n, order);
                double d = nccl_avg_f64(j, n, order);
                differs[n] += f != (float)sum / (float)n;
                cr_assert(tdm_bench_check_equal(&f, 0, TDM_DTYPE_FLOAT32, sum, n),
                          "n=%d j=%zu order %d: NCCL's float32 average %.9g counted wrong "
                          "(sum/n = %.9g)", n, j, order, f, (double)((float)sum / (float)n));
                cr_assert(tdm_bench_check_equal(&d, 0, TDM_DTYPE_FLOAT64, sum, n),
                          "n=%d j=%zu order %d: NCCL's float64 average %.17g counted wrong", n,
                          j, order, d);
            }
            /* integers: SumPostDiv, the truncated quotient */
            int32_t i32 = (int32_t)(sum / n);
            int64_t i64 = sum / n;
            cr_assert(tdm_bench_check_equal(&i32, 0, TDM_DTYPE_INT32, sum, n));
            cr_assert(tdm_bench_check_equal(&i64, 0, TDM_DTYPE_INT64, sum, n));
        }
    /* what the issue saw: with 3, 5, 6 or 7 ranks the premultiplied mean
     * is not (float)sum / n for some elements */
    for (int n = 3; n <= 7; n++)
        if (n != 4) cr_assert_gt(differs[n], 0, "n=%d: NCCL's mean never differs here", n);
}

Test(bench_check, avg_still_counts_wrong_values)
{
    for (int n = 2; n <= 8; n++)
        for (size_t j = 0; j < 2000; j++) {
            int64_t sum = tdm_bench_ref(j, n, TDM_REDOP_AVG);
            int64_t last = tdm_bench_ref_val(j, n - 1, TDM_REDOP_AVG);
            /* the sum instead of the mean; one rank's input left out */
            float f = (float)sum;
            double d = (double)sum;
            if (sum != 0) {
                cr_assert(!tdm_bench_check_equal(&f, 0, TDM_DTYPE_FLOAT32, sum, n), "n=%d", n);
                cr_assert(!tdm_bench_check_equal(&d, 0, TDM_DTYPE_FLOAT64, sum, n), "n=%d", n);
            }
            if (last != 0) {
                f = (float)(sum - last) / (float)n;
                d = (double)(sum - last) / n;
                cr_assert(!tdm_bench_check_equal(&f, 0, TDM_DTYPE_FLOAT32, sum, n),
                          "n=%d j=%zu: a missing rank went unnoticed", n, j);
                cr_assert(!tdm_bench_check_equal(&d, 0, TDM_DTYPE_FLOAT64, sum, n),
                          "n=%d j=%zu: a missing rank went unnoticed", n, j);
            }
        }
    /* other ops stay exact */
    float f = 7.0f + 1e-6f;
    cr_assert(!tdm_bench_check_equal(&f, 0, TDM_DTYPE_FLOAT32, 7, 0));
    f = 7.0f;
    cr_assert(tdm_bench_check_equal(&f, 0, TDM_DTYPE_FLOAT32, 7, 0));
}
