/* tests/test_tp_cli.c: `tandem train --mode tp` end to end.
 * - equivalence: tp on 2 and 4 devices and --mesh dp=2,tp=2 write, after
 *   2 epochs, the checkpoint --mode single writes on the same global
 *   batches, within the float bound of tests/test_tp.c (row-parallel
 *   sums add in another order: measured here within 7.5e-8, checked at
 *   1e-5; tp on 1 device: the same bytes);
 * - the GPT (attention split by heads) on 2 ranks and on dp=2 x tp=2
 *   writes single's checkpoint within 1e-4 (AdamW; tests/test_tp.c's
 *   bound) and its file samples;
 * - checkpoints: a tp file resumes in single and a single file in tp at
 *   another N, and each goes on as the uninterrupted run within the bound;
 * - faults: a killed rank of a dp x tp mesh is named with its
 *   coordinates (dp, pp, tp), exit 1, nothing left behind;
 * - CUDA-emulated devices (cuda/ built, no GPU) write the host ranks'
 *   checkpoint bit for bit (what this does not test: CUDA, NCCL);
 * - compare --modes ...,tp: its section, the bytes per step the plan's;
 * - --sequence-parallel (the GPT): 2 ranks and dp=2 x tp=2 write single's
 *   checkpoint within 1e-4 (measured 1.7e-6), compare's tp-sp section
 *   counts the plan's collectives, emulated CUDA ranks write the host
 *   ranks' file, and its bad input is one line and exit 2;
 * - ZeRO-1 and ZeRO-2 on the dp dimension (--sharding optimizer,
 *   grad_op): the plain dp x tp mesh's file byte for byte, resumed runs
 *   ending on the same bytes, emulated CUDA ranks on the host ranks';
 * - bad input (the CNN, the GPT, a width the ranks do not divide, a
 *   pipeline in the mesh, one linear layer, pp's and the levers' options)
 *   is one line and exit 2. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/mesh_doctor_util.h"
#include "tests/test_util.h"

#define MODEL "mlp:20-24-16-12-5"
#define MLP "--model", MODEL
#define SYN "--data", "synthetic", "--synthetic-size", "200"
#define TOL 1e-5

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "tp_cli"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(tp_cli, .init = setup, .fini = teardown, .timeout = 240);

static void path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s.safetensors", g_dir, name);
}

static double ck_diff(const char *a, const char *b) { return ck_diff_of(MODEL, a, b); }

static void single(const char *save, const char *epochs, const char *resume)
{
    static cli_result r;
    if (resume)
        CLI(&r, "train", "--mode", "single", MLP, SYN, "--batch", "32", "--epochs", epochs,
            "--no-eval", "--quiet", "--save", save, "--resume", resume);
    else
        CLI(&r, "train", "--mode", "single", MLP, SYN, "--batch", "32", "--epochs", epochs,
            "--no-eval", "--quiet", "--save", save);
    expect(&r, 0, "/");
}

static void tp(const char *save, const char *dev, const char *mesh, const char *epochs,
               const char *resume)
{
    static cli_result r;
    const char *m = mesh ? "--mesh" : "--quiet", *mv = mesh ? mesh : "--quiet";
    const char *rs = resume ? "--resume" : "--quiet", *rv = resume ? resume : "--quiet";
    CLI(&r, "train", "--mode", "tp", "--device", dev, m, mv, MLP, SYN, "--batch", "32",
        "--epochs", epochs, "--no-eval", "--quiet", "--save", save, rs, rv);
    expect(&r, 0, "/");
}

Test(tp_cli, tp_and_dp_x_tp_write_single_devices_checkpoint_within_the_bound)
{
    char one[128], t1[128], t2[128], t4[128], m[128];
    path(one, sizeof one, "single");
    path(t1, sizeof t1, "tp1");
    path(t2, sizeof t2, "tp2");
    path(t4, sizeof t4, "tp4");
    path(m, sizeof m, "mesh");
    single(one, "2", NULL);
    tp(t1, "cpu:1", NULL, "2", NULL);
    tp(t2, "cpu:2", NULL, "2", NULL);
    tp(t4, "cpu:4", NULL, "2", NULL);
    tp(m, "cpu:4", "dp=2,tp=2", "2", NULL);
    cr_assert(cli_same_file(one, t1), "tp on one device is not single's checkpoint");
    double d2 = ck_diff(one, t2), d4 = ck_diff(one, t4), dm = ck_diff(one, m);
    cr_assert(d2 <= TOL && d4 <= TOL && dm <= TOL, "tp 2: %g, tp 4: %g, dp=2,tp=2: %g", d2, d4,
              dm);
    cr_assert(d2 > 0 || d4 > 0, "bit for bit: the stated rounding no longer happens");
}

/* An epoch whose last batch holds fewer samples than there are replicas
 * (201 samples in batches of 40: the sixth batch is 1 sample, replica
 * 1's share of it empty): that replica adds no gradient but joins the
 * sum over the dp dimension and the step, as DDP's does; the run equals
 * one device's. */
Test(tp_cli, a_replica_with_no_samples_in_the_last_batch_joins_the_step)
{
    static cli_result r;
    char one[128], m[128];
    path(one, sizeof one, "short_single");
    path(m, sizeof m, "short_mesh");
    CLI(&r, "train", "--mode", "single", MLP, "--data", "synthetic", "--synthetic-size", "201",
        "--batch", "40", "--epochs", "2", "--no-eval", "--quiet", "--save", one);
    expect(&r, 0, "/");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, "--data",
        "synthetic", "--synthetic-size", "201", "--batch", "40", "--epochs", "2", "--no-eval",
        "--quiet", "--save", m);
    expect(&r, 0, "/");
    double d = ck_diff(one, m);
    cr_assert(d <= TOL, "dp=2,tp=2 with a 1-sample last batch: %g from one device", d);
}

Test(tp_cli, checkpoints_go_between_tp_and_single)
{
    char one1[128], one3[128], tp1[128], tp3[128], a[128], b[128];
    path(one1, sizeof one1, "one1");
    path(one3, sizeof one3, "one3");
    path(tp1, sizeof tp1, "tp1");
    path(tp3, sizeof tp3, "tp3");
    path(a, sizeof a, "single_from_tp");
    path(b, sizeof b, "tp_from_single");
    single(one1, "1", NULL);
    single(one3, "3", NULL);
    tp(tp1, "cpu:2", NULL, "1", NULL);
    tp(tp3, "cpu:2", NULL, "3", NULL);
    single(a, "3", tp1);                  /* a tp file in single */
    tp(b, "cpu:4", NULL, "3", one1);      /* a single file in tp at N = 4 */
    double da = ck_diff(one3, a), db = ck_diff(one3, b), dt = ck_diff(tp3, a);
    cr_assert(da <= TOL && db <= TOL && dt <= TOL, "%g %g %g", da, db, dt);
}

Test(tp_cli, a_killed_rank_is_named_with_its_coordinates)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "3:3", 1);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
        "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 3: test fault: SIGKILL before step 3");
    expect(&r, 1, "tandem train: rank 3 (killed by signal 9) is at dp 1, pp 0, tp 1 of the "
                  "mesh dp=2 x pp=1 x tp=2");
    expect(&r, 1, "tandem train: doctor: DIED: rank 3 was killed by signal 9");
    static cli_result d;
    mesh_doctor(&r, &d);
    expect(&d, 4, "verdict: DIED: rank 3 was killed by signal 9");
    cr_expect(!strstr(d.out, "comm split"), "%s", d.out);
}

/* A stopped rank (SIGSTOP) is STALLED, named with its coordinates. */
Test(tp_cli, a_stopped_rank_is_named_stalled_with_its_coordinates)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "3:3:STOP", 1);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", "--timeout",
        "3", MLP, SYN, "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 3: test fault: SIGSTOP before step 3");
    expect(&r, 1, "tandem train: rank 3 (stopped) is at dp 1, pp 0, tp 1 of the mesh dp=2 x "
                  "pp=1 x tp=2");
    expect(&r, 1, "tandem train: doctor: STALLED: rank 3 ");
    cr_expect(!strstr(r.out, "doctor: DIED") && !strstr(r.out, "doctor (after the teardown): "
                                                               "DIED"), "%s", r.out);
    static cli_result d;
    mesh_doctor(&r, &d);
    expect(&d, 5, "stopped first: rank 3 (stopped or frozen");
    cr_expect(!strstr(d.out, "comm split"), "%s", d.out);
}

Test(tp_cli, bad_input_is_one_line_and_exit_2)
{
    static cli_result r;
    static const struct {
        const char *a[6];
        const char *says;
    } bad[] = {
        {{"--device", "cpu:2", "--model", "cnn"}, "--model cnn is not supported"},
        {{"--device", "cpu:3", "--model", "mlp:20-100-5"},
         "layer fc1's output width 100 (fc2's input) is not divisible by the 3"},
        {{"--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP}, "combines with dp only"},
        {{"--device", "cpu:4", "--mesh", "dp=3,tp=2", MLP}, "6 ranks"},
        {{"--device", "cpu:2", "--model", "mlp:20-5"}, "the MLP has 1 linear layer"},
        {{"--device", "cpu:2", "--stages", "2", MLP}, "apply to --mode pp"},
        {{"--device", "cpu:2", "--offload", "optimizer", MLP}, "does not support --offload"},
        {{"--device", "cpu:2", "--uneven", MLP}, "--mode tp takes none of"},
        {{"--device", "cpu:2", "--sharding", "optimizer", MLP}, "it needs --mesh dp=D,tp=N "
                                                                "with D >= 2"},
        {{"--device", "cpu:4", "--sharding", "grad_op", MLP}, "--sharding grad_op shards the "
                                                              "gradients and the optimizer over "
                                                              "the dp dimension: it needs"},
        {{"--device", "cpu:4", "--mesh", "dp=2,tp=2", "--sharding", "full"},
         "ZeRO-3 (--sharding full) is not built for tp"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *const *a = bad[i].a;
        CLI(&r, "train", "--mode", "tp", SYN, a[0], a[1], a[2] ? a[2] : "--quiet",
            a[3] ? a[3] : "--quiet", a[4] ? a[4] : "--quiet", a[5] ? a[5] : "--quiet");
        expect(&r, 2, bad[i].says);
        cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "more than one line:\n%s",
                  r.out);
    }
    char text[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    cli_write_words(text);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:3", "--model", "gpt:2-16-2-8", "--data",
        text);
    expect(&r, 2, "the GPT's 2 heads are not divisible by the 3 tensor-parallel ranks");
    cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "more than one line:\n%s", r.out);
    CLI(&r, "train", "--help");
    expect(&r, 0, "--mesh dp=D,tp=N");
}

/* compare's section: the verdict, the all-reduces as phases, and the bytes
 * the communicator counted per step equal to the plan's. */
Test(tp_cli, compare_has_the_tensor_parallel_section)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,ddp,tp", "--device", "cpu:2", MLP, "--data",
        "synthetic", "--batch", "32", "--steps", "6");
    expect(&r, 0, "tensor-parallel throughput");
    expect(&r, 0, "fwd all-reduce");
    expect(&r, 0, "bwd all-reduce");
    expect(&r, 0, "tp(2): largest parameter difference");
    expect(&r, 0, "over 6 steps -> PASS");
    /* 20-24-16-12-5 at a batch of 32: 32 * (16 + 5 + 16) floats in 3 */
    /* the payload, and what a ring sends for it: 2(N-1)/N of it, N = 2 */
    expect(&r, 0, "all-reduce payload handed to the communicator 4736 bytes per step in 3.0 "
                  "calls (the plan: 4736 bytes in 3), which a ring algorithm sends as 4736 bytes "
                  "per step");
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:3", "--model", "mlp:20-100-5",
        "--data", "synthetic");
    expect(&r, 2, "is not divisible by the 3 tensor-parallel ranks");
}

/* The ranks' device path (device buffers, the device communicator) on
 * the CUDA emulator: the host ranks' checkpoint, the same bytes. */
Test(tp_cli, emulated_cuda_ranks_write_the_host_ranks_checkpoint)
{
    CU_NEED_BACKEND();
    static cli_result r;
    char host[128], emu[128];
    path(host, sizeof host, "host");
    path(emu, sizeof emu, "emu");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", MLP, SYN, "--batch", "32",
        "--epochs", "1", "--quiet", "--save", host);
    expect(&r, 0, "epoch 1/1");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    CLI(&r, "train", "--mode", "tp", "--device", "cuda", MLP, SYN, "--batch", "32",
        "--epochs", "1", "--quiet", "--save", emu);
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&r, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)");
    cr_assert(cli_same_file(host, emu), "emulated ranks differ from host ranks");
    /* the GPT's kernels too */
    char text[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    cli_write_words(text);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", "--model", "gpt:2-16-2-8", "--data",
        text, "--batch", "8", "--epochs", "1", "--max-steps", "4", "--quiet", "--save", host);
    expect(&r, 0, "val loss");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    CLI(&r, "train", "--mode", "tp", "--device", "cuda", "--model", "gpt:2-16-2-8", "--data",
        text, "--batch", "8", "--epochs", "1", "--max-steps", "4", "--quiet", "--save", emu);
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&r, 0, "val loss");
    cr_assert(cli_same_file(host, emu), "emulated GPT ranks differ from host ranks");
    /* and sequence parallel: the reduce-scatters and all-gathers over
     * the device communicator */
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", "--model", "gpt:2-16-2-8", "--data",
        text, "--batch", "8", "--epochs", "1", "--max-steps", "4", "--quiet", "--save", host,
        "--sequence-parallel");
    expect(&r, 0, "val loss");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    CLI(&r, "train", "--mode", "tp", "--device", "cuda", "--model", "gpt:2-16-2-8", "--data",
        text, "--batch", "8", "--epochs", "1", "--max-steps", "4", "--quiet", "--save", emu,
        "--sequence-parallel");
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&r, 0, "val loss");
    cr_assert(cli_same_file(host, emu), "emulated sequence-parallel ranks differ from host ranks");
    /* ZeRO-2 on dp=2 x tp=2: the step's whole gradient allocated and
     * released on the device, reduce-scattered into the kept shard over
     * the device communicator */
    for (int e = 0; e < 2; e++) {
        if (e) cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "4", 1), 0);
        CLI(&r, "train", "--mode", "tp", "--device", e ? "cuda" : "cpu:4", "--mesh", "dp=2,tp=2",
            MLP, SYN, "--batch", "32", "--epochs", "1", "--quiet", "--sharding", "grad_op",
            "--save", e ? emu : host);
        unsetenv("TANDEM_CUDA_EMULATOR");
        expect(&r, 0, "epoch 1/1");
    }
    cr_assert(cli_same_file(host, emu), "emulated ZeRO-2 ranks differ from host ranks");
}

/* The GPT split by heads: tp on 2 ranks and dp=2 x tp=2 end where one
 * device ends, within tests/test_tp.c's GPT bound; the file samples. */
Test(tp_cli, gpt_split_by_heads_writes_single_devices_checkpoint_within_the_bound)
{
    static cli_result r;
    char text[128], one[128], t2[128], m[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    path(one, sizeof one, "gpt_single");
    path(t2, sizeof t2, "gpt_tp2");
    path(m, sizeof m, "gpt_mesh");
    cli_write_words(text);
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "single", "--batch",
        "8", "--epochs", "1", "--max-steps", "6", "--quiet", "--save", one);
    expect(&r, 0, "val loss");
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "tp", "--device",
        "cpu:2", "--batch", "8", "--epochs", "1", "--max-steps", "6", "--quiet", "--save", t2);
    expect(&r, 0, "attention split by heads, 1 of 2 per rank");
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "tp", "--device",
        "cpu:4", "--mesh", "dp=2,tp=2", "--batch", "8", "--epochs", "1", "--max-steps", "6",
        "--quiet", "--save", m);
    expect(&r, 0, "val loss");
    double d2 = ck_diff_of("gpt:2-16-2-8", one, t2), dm = ck_diff_of("gpt:2-16-2-8", one, m);
    cr_assert(d2 <= 1e-4 && dm <= 1e-4, "tp 2: %g, dp=2,tp=2: %g", d2, dm);
    CLI(&r, "sample", "--resume", t2, "--tokens", "8", "--prompt", "a");
    cr_assert_eq(r.code, 0, "%s", r.out);
    /* compare's section: 4 all-reduces per block of 8 windows x 8 x 16 */
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:2", "--model", "gpt:2-16-2-8",
        "--data", text, "--batch", "8", "--steps", "4");
    /* the payload, and what a ring sends for it: 2(N-1)/N of it, N = 2 */
    expect(&r, 0, "all-reduce payload handed to the communicator 32768 bytes per step in 8.0 "
                  "calls (the plan: 32768 bytes in 8), which a ring algorithm sends as 32768 bytes "
                  "per step");
    expect(&r, 0, "over 4 steps -> PASS");
}

/* --sequence-parallel: the GPT on 2 ranks and on dp=2 x tp=2 ends where
 * one device ends, within tests/test_tp.c's GPT bound; compare's tp-sp
 * section counts the plan's reduce-scatters, all-gathers and the
 * LayerNorms' all-reduce; bad input is one line and exit 2. */
Test(tp_cli, sequence_parallel_writes_single_devices_checkpoint_within_the_bound)
{
    static cli_result r;
    char text[128], one[128], t2[128], m[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    path(one, sizeof one, "sp_single");
    path(t2, sizeof t2, "sp_tp2");
    path(m, sizeof m, "sp_mesh");
    cli_write_words(text);
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "single", "--batch",
        "8", "--epochs", "1", "--max-steps", "6", "--quiet", "--save", one);
    expect(&r, 0, "val loss");
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "tp", "--device",
        "cpu:2", "--sequence-parallel", "--batch", "8", "--epochs", "1", "--max-steps", "6",
        "--save", t2);
    expect(&r, 0, "sequence parallel: LayerNorms on 1/N of the tokens");
    /* the plan: one all-reduce (the LayerNorms' gradients), 8
     * reduce-scatters and 8 all-gathers per pass, and the communicator
     * counted that in the 6 training passes (tests/test_tp.c checks it
     * per step; tests/test_cli_tp_traffic.c the line's counts) */
    expect(&r, 0, "6 all-reduces of 0.003 MiB in the 6 training passes");
    expect(&r, 0, "; 1 per pass of the full batch by the plan), 48 reduce-scatters");
    expect(&r, 0, "and 48 all-gathers of 0.188 MiB (8 and 8 per pass)");
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "tp", "--device",
        "cpu:4", "--mesh", "dp=2,tp=2", "--sequence-parallel", "--batch", "8", "--epochs", "1",
        "--max-steps", "6", "--quiet", "--save", m);
    expect(&r, 0, "val loss");
    double d2 = ck_diff_of("gpt:2-16-2-8", one, t2), dm = ck_diff_of("gpt:2-16-2-8", one, m);
    cr_assert(d2 <= 1e-4 && dm <= 1e-4, "tp 2: %g, dp=2,tp=2: %g", d2, dm);
    /* the payload of a collective is the whole stream, 8 windows x 8
     * tokens x 16 floats = 4096 bytes: 8 reduce-scatters and 8
     * all-gathers, plus one all-reduce of 2 blocks x 4 x 16 floats of
     * LayerNorm gradients (512 bytes); a ring sends (N-1)/N of a
     * reduce-scatter's or all-gather's payload and 2(N-1)/N of an
     * all-reduce's: 16 x 2048 + 512 */
    CLI(&r, "compare", "--modes", "single,tp-sp", "--device", "cpu:2", "--model",
        "gpt:2-16-2-8", "--data", text, "--batch", "8", "--steps", "4");
    expect(&r, 0, "reduce-scatter, all-gather and all-reduce payload handed to the "
                  "communicator 66048 bytes per step in 17.0 calls (the plan: 66048 bytes in "
                  "17), which a ring algorithm sends as 33280 bytes per step");
    expect(&r, 0, "tp-sp(2): largest parameter difference");
    expect(&r, 0, "over 4 steps -> PASS");
    static const struct {
        const char *mode, *dev, *model, *says;
    } bad[] = {
        {"tp", "cpu:4", "gpt:2-16-4-6", "the GPT's context of 6 tokens is not divisible by the "
                                        "4 tensor-parallel ranks"},
        {"tp", "cpu:2", MODEL, "--sequence-parallel applies to the GPT; --model " MODEL
                               " has no sequence"},
        {"ddp", "cpu:2", "gpt:2-16-2-8", "--sequence-parallel applies to --mode tp (the GPT), "
                                         "not --mode ddp"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CLI(&r, "train", "--mode", bad[i].mode, "--device", bad[i].dev, "--model", bad[i].model,
            "--data", text, "--sequence-parallel");
        expect(&r, 2, bad[i].says);
        cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "more than one line:\n%s",
                  r.out);
    }
    CLI(&r, "compare", "--modes", "single,tp-sp", "--device", "cpu:3", "--model",
        "gpt:2-18-3-8", "--data", text);
    expect(&r, 2, "the GPT's context of 8 tokens is not divisible by the 3 tensor-parallel");
    CLI(&r, "train", "--help");
    expect(&r, 0, "--sequence-parallel");
}

/* The GPT 2-16-2-8 on dp=2 x tp=2 for 6 steps, plain (into plain) and
 * with --sharding `sharding` (into zero): the same checkpoint bytes. */
static void gpt_sharded_equals_plain(const char *sharding, const char *plain, const char *zero)
{
    static cli_result r;
    char text[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    cli_write_words(text);
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "tp", "--device",
        "cpu:4", "--mesh", "dp=2,tp=2", "--batch", "8", "--epochs", "1", "--max-steps", "6",
        "--save", plain);
    expect(&r, 0, "val loss");
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "tp", "--device",
        "cpu:4", "--mesh", "dp=2,tp=2", "--batch", "8", "--epochs", "1", "--max-steps", "6",
        "--sharding", sharding, "--save", zero);
    expect(&r, 0, "val loss");
    cr_assert(cli_same_file(plain, zero), "GPT: --sharding %s differs from the plain dp x tp run",
              sharding);
}

/* ZeRO-1 on the dp dimension (--mesh dp=2,tp=2 --sharding optimizer):
 * the plain dp x tp run's checkpoint, the same bytes (parameters and
 * optimizer state, gathered over the dp dimension), for the MLP with SGD
 * and momentum and the GPT with AdamW; each rank's printed optimizer
 * state is half the plain run's; the ZeRO-1 file resumes in a ZeRO-1
 * run that ends where the uninterrupted one does, bit for bit. */
Test(tp_cli, zero1_on_the_dp_dimension_is_dp_x_tp_bit_for_bit)
{
    static cli_result r;
    char plain[128], zero[128], half[128], resumed[128];
    path(plain, sizeof plain, "z_plain");
    path(zero, sizeof zero, "z_zero");
    path(half, sizeof half, "z_half");
    path(resumed, sizeof resumed, "z_resumed");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
        "--batch", "32", "--epochs", "2", "--optim", "sgd", "--momentum", "0.9", "--no-eval",
        "--save", plain);
    /* rank 0's slice: 597 elements of momentum, 2388 bytes; ZeRO-1: 299
     * (tests/test_tp.c checks the bytes exactly) */
    expect(&r, 0, "optimizer 0.002 MiB");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
        "--batch", "32", "--epochs", "2", "--optim", "sgd", "--momentum", "0.9", "--no-eval",
        "--sharding", "optimizer", "--save", zero);
    expect(&r, 0, "ZeRO-1: the optimizer sharded over it");
    expect(&r, 0, "optimizer 0.001 MiB");
    cr_assert(cli_same_file(plain, zero), "ZeRO-1 differs from the plain dp x tp run");
    /* the resume: 1 epoch, then 1 more from its file */
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
        "--batch", "32", "--epochs", "1", "--optim", "sgd", "--momentum", "0.9", "--no-eval",
        "--quiet", "--sharding", "optimizer", "--save", half);
    expect(&r, 0, "/");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
        "--batch", "32", "--epochs", "2", "--optim", "sgd", "--momentum", "0.9", "--no-eval",
        "--quiet", "--sharding", "optimizer", "--resume", half, "--save", resumed);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(plain, resumed), "the resumed ZeRO-1 run differs");
    gpt_sharded_equals_plain("optimizer", plain, zero);
}

/* ZeRO-2 on the dp dimension (--mesh dp=2,tp=2 --sharding grad_op): the
 * plain dp x tp run's checkpoint, the same bytes, for the MLP with SGD
 * and momentum (also under --grad-accum 2, against the plain run's) and
 * the GPT with AdamW; rank 0 keeps half the plain run's gradient bytes
 * and prints the whole gradient as a buffer of the step; a ZeRO-2 file
 * resumes (in ZeRO-2, and a ZeRO-1 file in ZeRO-2) and ends where the
 * uninterrupted run does, bit for bit. */
Test(tp_cli, zero2_on_the_dp_dimension_is_dp_x_tp_bit_for_bit)
{
    static cli_result r;
    char plain[128], zero[128], half[128], half1[128], resumed[128];
    path(plain, sizeof plain, "z2_plain");
    path(zero, sizeof zero, "z2_zero");
    path(half, sizeof half, "z2_half");
    path(half1, sizeof half1, "z2_half1");
    path(resumed, sizeof resumed, "z2_resumed");
#define Z2_MLP "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN, \
               "--batch", "32", "--optim", "sgd", "--momentum", "0.9", "--no-eval"
    CLI(&r, Z2_MLP, "--epochs", "2", "--save", plain);
    /* rank 0's slice: 597 elements, 2388 gradient bytes; ZeRO-2: 299 */
    expect(&r, 0, "gradients 0.002 MiB, optimizer 0.002 MiB");
    CLI(&r, Z2_MLP, "--epochs", "2", "--sharding", "grad_op", "--save", zero);
    expect(&r, 0, "ZeRO-2: gradients and optimizer sharded over the dp dimension");
    expect(&r, 0, "gradients 0.001 MiB (ZeRO-2's shard), optimizer 0.001 MiB");
    expect(&r, 0, "the whole gradient, 0.002 MiB, only inside a step");
    cr_assert(cli_same_file(plain, zero), "ZeRO-2 differs from the plain dp x tp run");
    /* the resume: 1 epoch, then 1 more from its file; and from ZeRO-1's */
    CLI(&r, Z2_MLP, "--epochs", "1", "--quiet", "--sharding", "grad_op", "--save", half);
    expect(&r, 0, "/");
    CLI(&r, Z2_MLP, "--epochs", "2", "--quiet", "--sharding", "grad_op", "--resume", half,
        "--save", resumed);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(plain, resumed), "the resumed ZeRO-2 run differs");
    CLI(&r, Z2_MLP, "--epochs", "1", "--quiet", "--sharding", "optimizer", "--save", half1);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(half, half1), "ZeRO-1's file after 1 epoch differs from ZeRO-2's");
    CLI(&r, Z2_MLP, "--epochs", "2", "--quiet", "--sharding", "grad_op", "--resume", half1,
        "--save", resumed);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(plain, resumed), "ZeRO-2 resumed from ZeRO-1's file differs");
    /* --grad-accum: the whole gradient over both micro-batches */
    CLI(&r, Z2_MLP, "--epochs", "2", "--quiet", "--grad-accum", "2", "--save", plain);
    expect(&r, 0, "/");
    CLI(&r, Z2_MLP, "--epochs", "2", "--quiet", "--grad-accum", "2", "--sharding", "grad_op",
        "--save", zero);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(plain, zero), "ZeRO-2 under --grad-accum differs");
#undef Z2_MLP
    gpt_sharded_equals_plain("grad_op", plain, zero);
}

/* --grad-accum (the MLP): tp on 2 ranks and on dp=2 x tp=2 with 2
 * micro-batches of 16 end 2 epochs where one device with the batch of
 * 32 does, within the bound (the micro-batches' gradients add in another
 * order than one batch's gemm: measured 6.0e-8), and where tp without
 * accumulation does. */
Test(tp_cli, grad_accum_equals_the_same_global_batch_within_the_bound)
{
    static cli_result r;
    char one[128], acc[128], mesh[128], plain[128];
    path(one, sizeof one, "ga_single");
    path(acc, sizeof acc, "ga_tp2");
    path(mesh, sizeof mesh, "ga_mesh");
    path(plain, sizeof plain, "ga_plain");
    single(one, "2", NULL);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", MLP, SYN, "--batch", "16",
        "--grad-accum", "2", "--epochs", "2", "--no-eval", "--save", acc);
    expect(&r, 0, "tp step, rank 0, mean over 14 steps");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
        "--batch", "16", "--grad-accum", "2", "--epochs", "2", "--no-eval", "--quiet", "--save",
        mesh);
    expect(&r, 0, "/");
    tp(plain, "cpu:2", NULL, "2", NULL);
    double da = ck_diff(one, acc), dm = ck_diff(one, mesh), dp = ck_diff(plain, acc);
    cr_assert(da <= TOL && dm <= TOL && dp <= TOL, "tp --grad-accum: %g from single, mesh %g, "
              "%g from tp without", da, dm, dp);
}

/* ZeRO-2's gradient buckets (--bucket-cap-mb 0.0005: ~130 floats, so
 * rank 0's slice of 597 elements goes in 4 buckets, summed during
 * backward by reduces to their owners): the plain dp x tp run's file
 * byte for byte, under --grad-accum 2 too (only the last micro-batch's
 * backward sums), resumed from a bucketed run's file; the summary names
 * the most bucket bytes held at once; with --clip-grad-norm and with
 * --precision fp16 ZeRO-1's file; emulated CUDA ranks (the buckets
 * allocated, reduced and freed on the device) write the host ranks'
 * file. */
Test(tp_cli, zero2_buckets_are_dp_x_tp_bit_for_bit)
{
    static cli_result r;
    char plain[128], zero[128], half[128], emu[128];
    path(plain, sizeof plain, "zb_plain");
    path(zero, sizeof zero, "zb_zero");
    path(half, sizeof half, "zb_half");
    path(emu, sizeof emu, "zb_emu");
#define ZB_MLP "train", "--mode", "tp", "--mesh", "dp=2,tp=2", MLP, SYN, "--batch", "32", \
               "--optim", "sgd", "--momentum", "0.9", "--no-eval"
#define ZB "--sharding", "grad_op", "--bucket-cap-mb", "0.0005"
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", "--quiet", "--save", plain);
    expect(&r, 0, "/");
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", ZB, "--save", zero);
    expect(&r, 0, "as gradient buckets summed during backward: at most 0.00");
    cr_assert(cli_same_file(plain, zero), "bucketed ZeRO-2 differs from the plain dp x tp run");
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "1", "--quiet", ZB, "--save", half);
    expect(&r, 0, "/");
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", "--quiet", ZB, "--resume", half,
        "--save", zero);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(plain, zero), "the resumed bucketed ZeRO-2 run differs");
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", "--quiet", "--grad-accum", "2",
        "--save", plain);
    expect(&r, 0, "/");
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", "--quiet", "--grad-accum", "2", ZB,
        "--save", zero);
    expect(&r, 0, "/");
    cr_assert(cli_same_file(plain, zero), "bucketed ZeRO-2 under --grad-accum differs");
    /* the levers read the shard the buckets summed into: clipping and
     * fp16's loss scaling end on ZeRO-1's bytes */
    static const char *const lever[2][2] = {{"--clip-grad-norm", "0.05"},
                                            {"--precision", "fp16"}};
    for (int l = 0; l < 2; l++) {
        CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", "--quiet", lever[l][0],
            lever[l][1], "--sharding", "optimizer", "--save", plain);
        expect(&r, 0, "/");
        CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "2", "--quiet", lever[l][0],
            lever[l][1], ZB, "--save", zero);
        expect(&r, 0, "/");
        cr_assert(cli_same_file(plain, zero), "bucketed ZeRO-2 with %s %s differs from ZeRO-1",
                  lever[l][0], lever[l][1]);
    }
    if (!tdm_device_cuda_linked()) return;   /* the emulator needs the CUDA backend */
    CLI(&r, ZB_MLP, "--device", "cpu:4", "--epochs", "1", "--quiet", ZB, "--save", zero);
    expect(&r, 0, "/");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "4", 1), 0);
    CLI(&r, ZB_MLP, "--device", "cuda", "--epochs", "1", "--quiet", ZB, "--save", emu);
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&r, 0, "/");
    cr_assert(cli_same_file(zero, emu), "emulated CUDA ranks' bucketed ZeRO-2 differs");
#undef ZB
#undef ZB_MLP
}
