/* tests/test_gpu_bundle.c: the GPU bundle (`make gpu-bundle`, docs/CUDA_TESTING.md,
 * "Validating on a bare GPU machine"), proved without a GPU:
 *  - gpu_bundle: BUILD/gpu-bundle (make test builds it) run as on a bare
 *    GPU machine: in a private mount namespace (unshare -m, as root) the
 *    system's copies of the libraries the bundle brings are hidden (bind
 *    mounts of /dev/null; BUILD/tandem, linked against them, no longer
 *    starts) and NCCL is reachable only as pip's nvidia-nccl of a python3
 *    "with torch"; ldd over every binary and library resolves with only
 *    the bundle and the toolkit added, and run.sh finds cuBLAS and that
 *    NCCL, runs the emulator and no-GPU suites and ends with the no-GPU
 *    verdict, exit 77 (tests/gpu_bundle_check.sh does the namespace part);
 *    the folder is at most 64 MiB and carries sm_90 code;
 *  - gpu_bench: cuda/gpu-bench.sh's summary and results from a fake GPU
 *    run (a fake tandem and nvidia-smi printing an H100's lines, a fake
 *    python printing PyTorch's), since none of it can run here: peak
 *    percentages, the tandem/PyTorch ratio, a parameter-count mismatch
 *    failing, the time budget skipping items;
 *  - torch_ref: tools/torch_gpt_ref.py parses (py_compile) and counts the
 *    same parameters as tandem's GPT for several shapes (its --count-only
 *    formula, no torch needed).
 * Skipped, each with its reason: without nvcc (no CUDA backend, no
 * bundle), in sanitizer builds (the bundle is made from the plain build),
 * without root or unshare, without python3. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

#define GB_OUT_MAX (1 << 20)

/* Runs `sh -c cmd`, stdout+stderr into out; returns the exit status. */
static int gb_sh(const char *cmd, char *out, size_t len)
{
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f, "popen %s: %s", cmd, strerror(errno));
    size_t n = 0, k;
    while (n < len - 1 && (k = fread(out + n, 1, len - 1 - n, f)) > 0) n += k;
    out[n] = '\0';
    char sink[4096];
    while (fread(sink, 1, sizeof sink, f) > 0) {}
    int ws = pclose(f);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + (WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
}

static void gb_read(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = '\0';
    fclose(f);
}

static void gb_write(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(chmod(path, mode), 0);
}

#define GB_HAS(text, phrase) \
    cr_assert(strstr((text), (phrase)), "no '%s' in:\n%s", (phrase), (text))

/* The build folder of the tandem under test ($TANDEM_BIN's). */
static void gb_build_dir(char *buf, size_t len)
{
    snprintf(buf, len, "%s", cli_bin());
    char *slash = strrchr(buf, '/');
    if (slash) *slash = '\0';
    else snprintf(buf, len, ".");
}

/* The value of KEY= in BUILD/config.mk's one line "NVCC=... CC=gcc
 * SANFLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer ...": a
 * value runs to the next " NAME=" (upper case), "" when empty. */
static void gb_config(const char *build, const char *key, char *val, size_t len)
{
    char path[512], text[4096];
    snprintf(path, sizeof path, "%s/config.mk", build);
    gb_read(path, text, sizeof text);
    size_t klen = strlen(key);
    val[0] = '\0';
    for (const char *p = text; (p = strstr(p, key)); p += klen) {
        if ((p != text && p[-1] != ' ') || p[klen] != '=') continue;
        const char *v = p + klen + 1, *e = v;
        for (; *e && *e != '\n'; e++) {
            if (*e != ' ') continue;
            const char *w = e + 1;
            while ((*w >= 'A' && *w <= 'Z') || *w == '_') w++;
            if (w > e + 1 && *w == '=') break;
        }
        snprintf(val, len, "%.*s", (int)(e - v), v);
        return;
    }
}

static int gb_have(const char *prog)
{
    char cmd[256], out[256];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", prog);
    return gb_sh(cmd, out, sizeof out) == 0;
}

/* ---------------------------- the bundle ---------------------------------- */

/* Skips (saying why) where no bundle is expected; fails where one is and
 * is missing. Fills bundle with BUILD/gpu-bundle. */
static void gb_need_bundle(char *build, size_t blen, char *bundle, size_t len)
{
    char v[1024];
    gb_build_dir(build, blen);
    gb_config(build, "NVCC", v, sizeof v);
    if (!v[0]) cr_skip_test("gpu bundle: nvcc absent at build time: no CUDA backend, no bundle");
    gb_config(build, "SANFLAGS", v, sizeof v);
    if (v[0]) cr_skip_test("gpu bundle: a sanitizer build (%s); the bundle is made from the plain "
                           "build (make test)", v);
    snprintf(bundle, len, "%s/gpu-bundle", build);
    char p[600];
    snprintf(p, sizeof p, "%s/run.sh", bundle);
    cr_assert_eq(access(p, R_OK), 0, "%s missing: make test builds the bundle; run make "
                 "gpu-bundle", p);
}

/* Whether the .nv_fatbin section dumped in path holds machine code (an
 * ELF entry, kind 2; PTX is kind 1) for sm_<sm>. The layout, as nvcc
 * writes it: a header {u32 magic 0xBA55ED50, u16 version, u16 header
 * size, u64 size of the entries}, then entries {u16 kind, u16 version,
 * u32 header size, u32 padded payload size, ..., u32 sm at offset 28}. */
static int gb_fatbin_has_sass(const char *path, unsigned sm)
{
    static unsigned char d[16 << 20];
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    size_t n = fread(d, 1, sizeof d, f);
    fclose(f);
    for (size_t off = 0; off + 16 <= n; off += 8) {
        uint32_t magic, hs32;
        uint16_t hs;
        uint64_t size;
        memcpy(&magic, d + off, 4);
        if (magic != 0xBA55ED50u) continue;
        memcpy(&hs, d + off + 6, 2);
        memcpy(&size, d + off + 8, 8);
        for (size_t p = off + hs; p + 32 <= n && p < off + hs + size;) {
            uint16_t kind;
            uint32_t pad, esm;
            memcpy(&kind, d + p, 2);
            memcpy(&hs32, d + p + 4, 4);
            memcpy(&pad, d + p + 8, 4);
            memcpy(&esm, d + p + 28, 4);
            if (kind == 2 && esm == sm) return 1;
            if (!hs32) break;
            p += (size_t)hs32 + pad;
        }
        off += hs + size - 8;
    }
    return 0;
}

Test(gpu_bundle, fits_64_mib_and_carries_sm_90, .timeout = 60)
{
    char build[256], bundle[300], p[400], text[8192], cmd[1024];
    gb_need_bundle(build, sizeof build, bundle, sizeof bundle);
    snprintf(p, sizeof p, "%s/BUNDLE.txt", bundle);
    gb_read(p, text, sizeof text);
    GB_HAS(text, "cudart=static");
    GB_HAS(text, "nccl_soname=libnccl.so.2");
    const char *a = strstr(text, "cuda_archs=");
    cr_assert(a && strstr(a, " 90") && strstr(a, " 90") < strchr(a, '\n'), "%s", text);
    snprintf(cmd, sizeof cmd, "du -sb '%s' | cut -f1", bundle);
    cr_assert_eq(gb_sh(cmd, text, sizeof text), 0);
    long long bytes = atoll(text);
    cr_assert(bytes > 0 && bytes <= 64LL * 1048576, "the bundle is %lld bytes", bytes);
    /* the kernels in the shared object: sm_90 machine code (an ELF entry
     * of the fatbinary), not only PTX */
    char fb[128];
    tu_mkdtemp(fb, sizeof fb, "gpu_bundle_fatbin");
    snprintf(cmd, sizeof cmd, "objcopy -O binary --only-section=.nv_fatbin "
             "'%s/lib/libtandem_bundle.so' '%s/fatbin' 2>&1", bundle, fb);
    cr_assert_eq(gb_sh(cmd, text, sizeof text), 0, "%s", text);
    int sass = gb_fatbin_has_sass(tu_tpath(fb, "fatbin"), 90);
    tu_rmtree(fb);
    cr_assert(sass, "no sm_90 machine code in %s/lib/libtandem_bundle.so", bundle);
}

Test(gpu_bundle, runs_on_a_bare_machine_to_the_no_gpu_verdict, .timeout = 900)
{
    char build[256], bundle[300], dir[128], cmd[2048];
    static char out[GB_OUT_MAX], run[GB_OUT_MAX], text[65536];
    gb_need_bundle(build, sizeof build, bundle, sizeof bundle);
    if (geteuid() != 0)
        cr_skip_test("gpu bundle: hiding the system's libraries needs root (a private mount "
                     "namespace with bind mounts); run make test as root");
    if (!gb_have("unshare") || !gb_have("python3"))
        cr_skip_test("gpu bundle: needs unshare (util-linux) and python3");
    if (gb_sh("unshare -m true 2>&1", out, sizeof out) != 0)
        cr_skip_test("gpu bundle: unshare -m refused here (%s)", out);
    tu_mkdtemp(dir, sizeof dir, "gpu_bundle");
    /* env -u BXFI_MAP: Criterion's sandbox variable would make the kit's
     * own Criterion binaries act as this test's worker and abort */
    snprintf(cmd, sizeof cmd, "env -u BXFI_MAP TANDEM_RUN_BUDGET=%d unshare -m sh tests/gpu_bundle_check.sh "
             "'%s' '%s' '%s' 2>&1", tu_scaled_ms(360000) / 1000, bundle, build, dir);
    int rc = gb_sh(cmd, out, sizeof out);
    gb_read(tu_tpath(dir, "run.out"), run, sizeof run);
    cr_assert_eq(rc, 0, "gpu_bundle_check.sh exit %d:\n%s\nrun.sh:\n%s", rc, out, run);
    /* the hiding took: the plain build no longer starts, and the bundle's
     * libraries are hidden on the system */
    GB_HAS(out, "no longer starts");
    const char *hidden[] = {"hid: libopenblas.so.0", "hid: libgfortran.so.5",
                            "hid: libquadmath.so.0", "hid: libcriterion.so.3",
                            "hid: libstdc++.so.6", "hid: libgcc_s.so.1"};
    for (size_t i = 0; i < sizeof hidden / sizeof hidden[0]; i++) GB_HAS(out, hidden[i]);
    /* ldd: nothing missing; outside the bundle and the toolkit only glibc
     * and what the tools themselves need (kept) */
    GB_HAS(out, " 0 with a library not found");
    static const char outside[] = "ldd: resolved outside the bundle and the toolkit: ";
    const char *o = strstr(out, outside);
    cr_assert_not_null(o, "%s", out);
    o += strlen(outside);
    char names[2048];
    snprintf(names, sizeof names, "%.*s", (int)strcspn(o, "\n"), o);
    for (char *t = strtok(names, " "); t; t = strtok(NULL, " ")) {
        char kept[300];
        snprintf(kept, sizeof kept, "kept (the tools need it): %s", t);
        int glibc = !strncmp(t, "libc.so", 7) || !strncmp(t, "libm.so", 7) ||
                    !strncmp(t, "libresolv.so", 12) || !strncmp(t, "libdl.so", 8) ||
                    !strncmp(t, "libpthread.so", 13) || !strncmp(t, "librt.so", 8) ||
                    !strncmp(t, "ld-linux", 8);
        cr_assert(glibc || strstr(out, kept), "%s resolved outside the bundle:\n%s", t, out);
    }
    /* run.sh: the libraries it chose, and the no-GPU verdict */
    GB_HAS(out, "run: exit 77");
    char want[600];
    snprintf(want, sizeof want, "run.sh: NCCL: %s/site/nvidia/nccl/lib/libnccl.so.2 (pip package of ",
             dir);
    GB_HAS(run, want);
    GB_HAS(run, "run.sh: cuBLAS: ");
    GB_HAS(run, "(toolkit)");
    GB_HAS(run, "run.sh: libstdc++/libgcc_s: the bundle's copies");
    GB_HAS(run, "run.sh: ldd: every binary and library of the bundle resolves");
    snprintf(want, sizeof want, "run.sh: info:   NCCL           2.");
    GB_HAS(run, want);
    snprintf(want, sizeof want, "%s/site/nvidia/nccl/lib/libnccl.so.2)", dir);
    GB_HAS(run, want);   /* tandem itself loaded that file */
    /* the kit: emulator and no-GPU suites ran and passed */
    gb_read(tu_tpath(dir, "out/test-gpu.txt"), text, sizeof text);
    GB_HAS(text, "verdict          NO GPU");
    const char *rows[] = {"cuda_emu", "cuda_emu_cli", "cuda_nodev", "bench_emu", "fsdp_emu"};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char pat[64];
        snprintf(pat, sizeof pat, "\n  %s ", rows[i]);
        const char *r = strstr(text, pat);
        cr_assert_not_null(r, "no %s row:\n%s", rows[i], text);
        int passed = -1, failed = -1;
        cr_assert_eq(sscanf(r + strlen(pat), "%d %d", &passed, &failed), 2, "%s", text);
        cr_assert(passed > 0 && failed == 0, "%s: %d passed, %d failed:\n%s", rows[i], passed,
                  failed, text);
    }
    gb_read(tu_tpath(dir, "out/summary.txt"), text, sizeof text);
    GB_HAS(text, "verdict          NO GPU");
    snprintf(cmd, sizeof cmd, "python3 -m json.tool '%s/out/results.json' 2>&1", dir);
    cr_assert_eq(gb_sh(cmd, text, sizeof text), 0, "results.json is not JSON: %s", text);
    GB_HAS(text, "\"exit\": 77");
    tu_rmtree(dir);
}

/* ----------------------- gpu-bench.sh on a fake GPU ------------------------ */

/* A fake bundle whose tandem prints an H100's lines, a fake nvidia-smi, a
 * fake python printing PyTorch's JSON lines (params_delta added to the
 * GPT's parameter count, to provoke the mismatch). */
static void gb_fake_gpu(const char *dir, int params_delta)
{
    char p[512], text[8192];
    mkdir(tu_tpath(dir, "b"), 0755);
    mkdir(tu_tpath(dir, "bin"), 0755);
    mkdir(tu_tpath(dir, "out"), 0755);
    gb_write(tu_tpath(dir, "b/tandem"),
             "#!/bin/sh\n"
             "if [ \"$1\" = info ]; then\n"
             "  echo 'tandem 0.1.0 (fake)'; echo 'devices:'\n"
             "  echo '  cuda:0         NVIDIA H100 80GB HBM3, 79.1 GiB, compute capability 9.0, "
             "132 SMs, PCI 0000:1b:00.0'; exit 0\n"
             "fi\n"
             "f=1; m='full FP32'\n"
             "[ \"$TANDEM_CUDA_TF32\" = 1 ] && { f=3; m='TF32 tensor cores: TANDEM_CUDA_TF32=1'; }\n"
             "case \"$2 $*\" in\n"
             "gemm*gpt*)\n"
             "  echo \"sgemm on cuda:0 (cuBLAS, $m)\"\n"
             "  echo '  c_attn forward      (4096x128)x(128x384)    0.010 ms  '$((10000 * f))'.0 GFLOP/s'\n"
             "  echo '  head forward        (4096x128)x(128x256)    0.008 ms  '$((20000 * f))'.0 GFLOP/s'\n"
             "  echo \"ceiling: $((20000 * f)).0 GFLOP/s\" ;;\n"
             "gemm*)\n"
             "  echo \"sgemm on cuda:0 (cuBLAS, $m)\"\n"
             "  echo '  fc1 forward   (256x784)x(784x1024)       0.020 ms  20100.0 GFLOP/s'\n"
             "  echo '  square 1024                              0.050 ms  '$((33500 * f))'.0 GFLOP/s'\n"
             "  echo \"ceiling: $((33500 * f)).0 GFLOP/s\" ;;\n"
             "train*gpt:6*)\n"
             "  echo 'model gpt:6-384-6-256 (10844160 parameters), batch 64, one device: cuda:0 (cuBLAS, full FP32)'\n"
             "  echo '  step: median 40.00 ms (min 39.00, max 41.00) over 30 steps'\n"
             "  echo '  throughput: 1600 windows/s = 409600 tokens/s' ;;\n"
             "train*gpt*)\n"
             "  echo 'model gpt:4-128-4-128 (842496 parameters), batch 32, one device: cuda:0 (cuBLAS, full FP32)'\n"
             "  echo '  step: median 3.20 ms (min 3.10, max 3.50) over 30 steps'\n"
             "  echo '  throughput: 10000 windows/s = 1280000 tokens/s'\n"
             "  echo '  gemm work: 729.81 MFLOP/sample -> 7298.1 GFLOP/s = 36% of the 20000.0 GFLOP/s sgemm ceiling' ;;\n"
             "train*cnn*)\n"
             "  echo 'model cnn (26000 parameters), batch 128, one device: cuda:0 (cuBLAS, full FP32)'\n"
             "  echo '  step: median 1.25 ms (min 1.20, max 1.40) over 30 steps'\n"
             "  echo '  throughput: 102400 samples/s' ;;\n"
             "train*)\n"
             "  echo 'model mlp 784-1024-1024-10 (1863696 parameters), batch 256, one device: cuda:0 (cuBLAS, full FP32)'\n"
             "  echo '  step: median 0.50 ms (min 0.49, max 0.60) over 30 steps'\n"
             "  echo '  throughput: 512000 samples/s' ;;\n"
             "*) echo \"fake tandem: $*\" >&2; exit 2 ;;\n"
             "esac\n", 0755);
    gb_write(tu_tpath(dir, "bin/nvidia-smi"),
             "#!/bin/sh\ncase \"$*\" in\n*clocks*) echo 1980 ;;\n*name*) echo 'NVIDIA H100 80GB "
             "HBM3' ;;\n*) exit 9 ;;\nesac\n", 0755);
    snprintf(text, sizeof text,
             "#!/bin/sh\n"
             "for a in manual sdpa; do\n"
             "  t=2560000; [ $a = sdpa ] && t=5120000\n"
             "  echo '{\"model\": \"gpt:4-128-4-128\", \"batch\": 32, \"attn\": \"'$a'\", \"tf32\": false, "
             "\"params\": %d, \"tokens_per_s\": '$t'.0}'\n"
             "  echo '{\"model\": \"gpt:6-384-6-256\", \"batch\": 64, \"attn\": \"'$a'\", \"tf32\": false, "
             "\"params\": 10844160, \"tokens_per_s\": 819200.0}'\n"
             "done\n", 842496 + params_delta);
    snprintf(p, sizeof p, "%s/python", dir);
    gb_write(p, text, 0755);
}

static int gb_bench(const char *dir, long deadline, char *out, size_t len)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "PATH='%s/bin':\"$PATH\" sh cuda/gpu-bench.sh '%s/b' '%s/out' %ld "
             "'%s/python' 2>&1", dir, dir, dir, deadline, dir);
    return gb_sh(cmd, out, len);
}

Test(gpu_bench, summarises_a_gpu_run_against_the_peak_and_pytorch, .timeout = 120)
{
    char dir[128];
    static char out[GB_OUT_MAX], txt[16384], json[65536];
    tu_mkdtemp(dir, sizeof dir, "gpu_bench");
    gb_fake_gpu(dir, 0);
    int rc = gb_bench(dir, (long)time(NULL) + 600, out, sizeof out);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    gb_read(tu_tpath(dir, "out/bench.txt"), txt, sizeof txt);
    GB_HAS(txt, "peak             FP32 67, TF32 494.7 TFLOP/s (datasheet (H100/H200 SXM), dense)");
    GB_HAS(txt, "132 SMs, compute capability 9.0, top clock 1980 MHz");
    /* best shape / peak: 33500 of 67000 GFLOP/s; TF32 100500 of 494700 */
    GB_HAS(txt, "mlp fp32                   33500.0 GFLOP/s =  50.0% (square 1024)");
    GB_HAS(txt, "mlp tf32                  100500.0 GFLOP/s =  20.3% (square 1024)");
    GB_HAS(txt, "gpt@32 fp32                20000.0 GFLOP/s =  29.9% (head forward");
    GB_HAS(txt, "mlp 784-1024-1024-10 b256     0.50 ms, 512000 samples/s");
    GB_HAS(txt, "gpt:4-128-4-128 b32          3.20 ms, 1280000 tokens/s");
    GB_HAS(txt, "cnn b128                     1.25 ms, 102400 samples/s");
    /* tandem / PyTorch on the same GPT */
    GB_HAS(txt, "gpt:4-128-4-128 b32      PyTorch 2560000.0 tokens/s (manual attention), "
                "tandem 1280000: 0.50x");
    GB_HAS(txt, "gpt:4-128-4-128 b32      PyTorch 5120000.0 tokens/s (sdpa attention), "
                "tandem 1280000: 0.25x");
    GB_HAS(txt, "gpt:6-384-6-256 b64      PyTorch 819200.0 tokens/s (manual attention), "
                "tandem 409600: 0.50x");
    cr_assert(!strstr(txt, "FAILED") && !strstr(txt, "skipped"), "%s", txt);
    gb_read(tu_tpath(dir, "out/bench.json"), json, sizeof json);
    GB_HAS(json, "\"fp32_tflops\": 67");
    GB_HAS(json, "\"pct_of_peak\": 50.0");
    GB_HAS(json, "\"tokens_per_s\": 1280000");
    if (gb_have("python3")) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "python3 -m json.tool '%s/out/bench.json' 2>&1", dir);
        cr_assert_eq(gb_sh(cmd, out, sizeof out), 0, "bench.json is not JSON: %s\n%s", out, json);
    }
    tu_rmtree(dir);
}

Test(gpu_bench, a_parameter_count_mismatch_fails_and_the_budget_skips, .timeout = 120)
{
    char dir[128];
    static char out[GB_OUT_MAX], txt[16384], json[65536];
    tu_mkdtemp(dir, sizeof dir, "gpu_bench");
    gb_fake_gpu(dir, 1);
    int rc = gb_bench(dir, (long)time(NULL) + 600, out, sizeof out);
    cr_assert_eq(rc, 1, "exit %d:\n%s", rc, out);
    gb_read(tu_tpath(dir, "out/bench.txt"), txt, sizeof txt);
    GB_HAS(txt, "PARAMETER COUNTS DIFFER: tandem 842496, PyTorch 842497");
    GB_HAS(txt, "bench FAILED     pytorch-params");
    tu_rmtree(dir);
    /* no time left: every item skipped and listed, nothing failed */
    tu_mkdtemp(dir, sizeof dir, "gpu_bench");
    gb_fake_gpu(dir, 0);
    rc = gb_bench(dir, (long)time(NULL) - 1, out, sizeof out);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    gb_read(tu_tpath(dir, "out/bench.txt"), txt, sizeof txt);
    GB_HAS(txt, "skipped          sgemm mlp fp32, sgemm gpt@32 fp32, train mlp@256,");
    GB_HAS(txt, "train gpt:6-384-6-256@64, pytorch gpt, sgemm mlp tf32,");
    GB_HAS(txt, "sgemm gpt:6-384-6-256@64 tf32 (time budget)");
    gb_read(tu_tpath(dir, "out/bench.json"), json, sizeof json);
    GB_HAS(json, "\"skipped\": [\"sgemm mlp fp32\"");
    tu_rmtree(dir);
}

/* ------------------------- the PyTorch reference -------------------------- */

Test(torch_ref, parses_and_counts_the_parameters_of_tandems_gpt, .timeout = 300)
{
    if (!gb_have("python3")) cr_skip_test("torch_ref: python3 not installed");
    char dir[128], cmd[1024];
    static char out[65536];
    tu_mkdtemp(dir, sizeof dir, "torch_ref");
    snprintf(cmd, sizeof cmd, "python3 -c 'import py_compile, sys; py_compile.compile(sys.argv[1], "
             "cfile=sys.argv[2], doraise=True)' tools/torch_gpt_ref.py '%s/ref.pyc' 2>&1", dir);
    cr_assert_eq(gb_sh(cmd, out, sizeof out), 0, "py_compile: %s", out);
    const char *models[] = {"gpt", "gpt:2-64-4-32", "gpt:6-384-6-256", "gpt:1-24-3-8"};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        snprintf(cmd, sizeof cmd, "python3 tools/torch_gpt_ref.py --count-only --model %s 2>&1",
                 models[i]);
        cr_assert_eq(gb_sh(cmd, out, sizeof out), 0, "%s", out);
        long long ref = -1;
        const char *sp = strchr(out, ' ');
        cr_assert(sp && sscanf(sp, "%lld", &ref) == 1, "%s", out);
        snprintf(cmd, sizeof cmd, "'%s' bench train --model %s --device cpu --batch 1 --steps 5 "
                 "2>&1", cli_bin(), models[i]);
        cr_assert_eq(gb_sh(cmd, out, sizeof out), 0, "%s", out);
        const char *p = strstr(out, " parameters)");
        cr_assert_not_null(p, "%s", out);
        while (p > out && p[-1] != '(') p--;
        long long mine = atoll(p);
        cr_assert_eq(mine, ref, "%s: tandem has %lld parameters, torch_gpt_ref.py counts %lld",
                     models[i], mine, ref);
    }
    tu_rmtree(dir);
}
