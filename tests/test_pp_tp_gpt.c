/* tests/test_pp_tp_gpt.c: the GPT through a pipeline of tensor-parallel
 * stages (`tandem train --mode pp --mesh dp=D,pp=S,tp=N`,
 * tools/rank_pptp.h: each stage's blocks split by heads and c_fc's rows,
 * the embeddings, LayerNorms and tied head replicated), on host devices.
 * - equivalence: pp=2,tp=2 on 4 devices and dp=2,pp=2,tp=2 on 8, split
 *   0,2 (a block on each stage, the tied embedding on both ends), end
 *   where one device ends after 10 steps and after 30 within
 *   tests/test_tp.c's GPT bound 1e-4 (the row-parallel sums and the
 *   micro-batches add in another order: measured 1.1e-6 after 10 steps
 *   and 5.8e-6 after 30);
 * - ZeRO-1 on the dp dimension of dp=2 x pp=2 x tp=2: the unsharded
 *   mesh's checkpoint byte for byte (AdamW);
 * - checkpoints: the pp-tp file is the whole model's, resumed in single
 *   and in --mode tp, and a single file resumed in pp-tp, each as the
 *   uninterrupted run within the bound;
 * - the partial sums the stage's tp communicator counts per step are the
 *   plan's, bytes and calls (compare's pp row);
 * - the GPT written as a model file (examples/models/gpt.tdm's layers,
 *   2 blocks of 16) trains bitwise as --model gpt:2-16-4-8 through it;
 * - a killed rank is named with its (dp, pp, tp) coordinates;
 * - CUDA-emulated devices (cuda/ built, no GPU) write the host ranks'
 *   checkpoint bit for bit (what this does not test: CUDA, NCCL);
 * - what it cannot run is one line and exit 2 (heads the group does not
 *   divide, --sequence-parallel without tp, the CNN; sequence parallelism's
 *   own: tests/test_pp_tp_seq.c). */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/mesh_doctor_util.h"
#include "tests/test_util.h"

#define MODEL "gpt:2-16-4-8"
#define TOL 1e-4

static char g_dir[64], g_text[128];

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "pp_tp_gpt");
    snprintf(g_text, sizeof g_text, "%s/text.txt", g_dir);
    cli_write_words(g_text);
}
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(pp_tp_gpt, .init = setup, .fini = teardown, .timeout = 240);

static void path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s.safetensors", g_dir, name);
}

static double ck_diff(const char *a, const char *b) { return ck_diff_of(MODEL, a, b); }

/* One device, or --mode tp on cpu:2: a batch of 32 windows; --max-steps
 * caps each epoch. */
static void whole(const char *mode, const char *save, const char *epochs, const char *resume)
{
    static cli_result r;
    const char *rs = resume ? "--resume" : "--quiet", *rv = resume ? resume : "--quiet";
    CLI(&r, "train", "--mode", mode, "--device", strcmp(mode, "tp") ? "cpu" : "cpu:2",
        "--model", MODEL, "--data", g_text, "--batch", "32", "--epochs", epochs, "--max-steps",
        "10", "--no-eval", "--quiet", "--save", save, rs, rv);
    expect(&r, 0, "train loss");
}

/* Stages: the embeddings and block 0; block 1, ln_f and the tied head. */
static void pptp(const char *save, const char *dev, const char *mesh, const char *epochs,
                 const char *resume)
{
    static cli_result r;
    const char *rs = resume ? "--resume" : "--quiet", *rv = resume ? resume : "--quiet";
    CLI(&r, "train", "--mode", "pp", "--device", dev, "--mesh", mesh, "--split", "0,2",
        "--model", MODEL, "--data", g_text, "--batch", "32", "--epochs", epochs, "--max-steps",
        "10", "--no-eval", "--quiet", "--save", save, rs, rv);
    expect(&r, 0, "x tp 2 (per block: attn.c_attn column by heads, 2 of 4 per rank, "
                  "attn.c_proj row, mlp.c_fc column, mlp.c_proj row; embeddings, LayerNorms "
                  "and the tied head replicated)");
}

Test(pp_tp_gpt, pp_x_tp_and_dp_x_pp_x_tp_end_where_one_device_ends_after_10_and_30_steps)
{
    static const char *const epochs[] = {"1", "3"};
    for (int k = 0; k < 2; k++) {
        char one[128], m4[128], m8[128];
        path(one, sizeof one, "single");
        path(m4, sizeof m4, "pp2tp2");
        path(m8, sizeof m8, "dp2pp2tp2");
        whole("single", one, epochs[k], NULL);
        pptp(m4, "cpu:4", "pp=2,tp=2", epochs[k], NULL);
        pptp(m8, "cpu:8", "dp=2,pp=2,tp=2", epochs[k], NULL);
        double d4 = ck_diff(one, m4), d8 = ck_diff(one, m8);
        cr_assert(d4 <= TOL && d8 <= TOL, "after %s0 steps: pp=2,tp=2 %g, dp=2,pp=2,tp=2 %g",
                  epochs[k], d4, d8);
    }
}

/* ZeRO-1 on the dp dimension of dp=2 x pp=2 x tp=2 (the GPT, AdamW):
 * the unsharded 3-D mesh's checkpoint, byte for byte. */
Test(pp_tp_gpt, zero1_on_the_dp_dimension_is_the_3d_meshs_bit_for_bit)
{
    static cli_result r;
    char plain[128], z1[128];
    path(plain, sizeof plain, "mesh3d");
    path(z1, sizeof z1, "mesh3d-zero1");
    pptp(plain, "cpu:8", "dp=2,pp=2,tp=2", "1", NULL);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", "--model", MODEL, "--data", g_text, "--batch", "32", "--epochs", "1",
        "--max-steps", "10", "--no-eval", "--sharding", "optimizer", "--save", z1);
    expect(&r, 0, "ZeRO-1: optimizer state per stage and replica is 1/D");
    cr_assert(cli_same_file(plain, z1), "GPT: ZeRO-1's checkpoint differs from the 3-D mesh's");
}

Test(pp_tp_gpt, its_checkpoint_resumes_in_single_and_tp_and_takes_a_single_file)
{
    char one1[128], one3[128], m1[128], a[128], b[128], c[128];
    path(one1, sizeof one1, "one1");
    path(one3, sizeof one3, "one3");
    path(m1, sizeof m1, "m1");
    path(a, sizeof a, "single_from_pptp");
    path(b, sizeof b, "pptp_from_single");
    path(c, sizeof c, "tp_from_pptp");
    whole("single", one1, "1", NULL);
    whole("single", one3, "3", NULL);
    pptp(m1, "cpu:4", "pp=2,tp=2", "1", NULL);
    whole("single", a, "3", m1);                      /* a pp-tp file in single */
    whole("tp", c, "3", m1);                          /* and in --mode tp */
    pptp(b, "cpu:8", "dp=2,pp=2,tp=2", "3", one1);    /* a single file in pp-tp */
    double d1 = ck_diff(one1, m1), da = ck_diff(one3, a), db = ck_diff(one3, b);
    double dc = ck_diff(one3, c);
    cr_assert(d1 <= TOL && da <= TOL && db <= TOL && dc <= TOL, "%g %g %g %g", d1, da, db, dc);
    static cli_result r;
    CLI(&r, "sample", "--resume", m1, "--tokens", "8", "--prompt", "a");
    cr_assert_eq(r.code, 0, "%s", r.out);
}

/* gpt:4-16-4-8 on 2 stages: the balanced split 0,4 puts blocks 0-2 on
 * stage 0, block 3 and the head on stage 1. Per step each replica's 16
 * windows of 8 tokens, 16 wide, in 4 micro-batches: 4 all-reduces per
 * block and micro-batch, 16 * 8 * 16 floats per block and window. */
Test(pp_tp_gpt, the_partial_sums_counted_by_the_communicator_are_the_plans)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2",
        "--model", "gpt:4-16-4-8", "--data", g_text, "--batch", "32", "--steps", "3",
        "--warmup", "1");
    expect(&r, 0, "Pipeline: dp(2) x pp(2) x tp(2) (each stage tensor-parallel)");
    expect(&r, 0, "stage 0's tp sums: 48.0 all-reduces of 98304 bytes per step (counted by its "
                  "tp communicator; the plan: 98304 bytes in 48;");
    expect(&r, 0, "stage 1's tp sums: 16.0 all-reduces of 32768 bytes per step (counted by its "
                  "tp communicator; the plan: 32768 bytes in 16;");
    expect(&r, 0, "dp(2) x pp(2) x tp(2): largest parameter difference");
    expect(&r, 0, "-> PASS (the stages' row-parallel products");
}

/* examples/models/gpt.tdm's layers for gpt:2-16-4-8: bitwise the same
 * run, the same file. */
Test(pp_tp_gpt, a_gpt_model_file_trains_bitwise_as_the_built_in_gpt)
{
    static const char block[] = "residual {\n  layernorm\n  attention heads 4\n}\n"
                                "residual {\n  layernorm\n  gptmlp\n}\n";
    char file[128], spec[160], a[128], b[128];
    snprintf(file, sizeof file, "%s/gpt2.tdm", g_dir);
    snprintf(spec, sizeof spec, "file:%s", file);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fprintf(f, "input tokens 8\nembedding vocab 256 dim 16\nembedding positions\n%s%s"
               "layernorm\nlmhead tied\n", block, block);
    cr_assert_eq(fclose(f), 0);
    path(a, sizeof a, "builtin");
    path(b, sizeof b, "file");
    static cli_result r;
    const char *models[2] = {MODEL, spec}, *saves[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--split",
            "0,2", "--model", models[k], "--data", g_text, "--batch", "32", "--epochs", "1",
            "--max-steps", "4", "--no-eval", "--quiet", "--save", saves[k]);
        expect(&r, 0, "x tp 2 (per block");
    }
    cr_assert(cli_same_file(a, b), "the model file's run differs from --model %s", MODEL);
}

Test(pp_tp_gpt, a_killed_rank_is_named_with_its_coordinates)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "6:3", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", "--model", MODEL, "--data", g_text, "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 6: test fault: SIGKILL before step 3");
    expect(&r, 1, "tandem train: rank 6 (killed by signal 9) is at dp 1, pp 1, tp 0 of the "
                  "mesh dp=2 x pp=2 x tp=2");
    expect(&r, 1, "tandem train: doctor: DIED: ");
    mesh_expect_stages(r.out, 2, 2);
}

Test(pp_tp_gpt, emulated_cuda_ranks_write_the_host_ranks_checkpoint)
{
    CU_NEED_BACKEND();
    char host[128], emu[128];
    path(host, sizeof host, "host");
    path(emu, sizeof emu, "emu");
    static cli_result r;
    const char *devs[2] = {"cpu:4", "cuda"}, *saves[2] = {host, emu};
    for (int k = 0; k < 2; k++) {
        if (k) cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "4", 1), 0);
        CLI(&r, "train", "--mode", "pp", "--device", devs[k], "--mesh", "pp=2,tp=2", "--split",
            "0,2", "--model", MODEL, "--data", g_text, "--batch", "32", "--epochs", "1",
            "--max-steps", "3", "--no-eval", "--quiet", "--save", saves[k]);
        unsetenv("TANDEM_CUDA_EMULATOR");
        expect(&r, 0, "x tp 2 (per block");
    }
    cr_assert(cli_same_file(host, emu), "emulated ranks differ from host ranks");
}

Test(pp_tp_gpt, what_it_cannot_run_is_one_line_and_exit_2)
{
    static cli_result r;
    static const struct {
        const char *dev, *mesh, *model, *extra, *says;
    } bad[] = {
        {"cpu:8", "pp=2,tp=4", "gpt:2-16-2-8", NULL,
         "the GPT's 2 heads are not divisible by the 4 tensor-parallel ranks of each stage "
         "(attention is split by heads)"},
        {"cpu:2", "pp=2", MODEL, "--sequence-parallel",
         "--sequence-parallel with --mode pp splits the tokens of tensor-parallel stages: it "
         "needs --mesh ...,pp=S,tp=N with N > 1"},
        {"cpu:4", "pp=2,tp=2", "cnn", NULL,
         "a pipeline of tensor-parallel stages is built for the MLP, the GPT and model files "
         "(the CNN's is not)"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        const char *data = strcmp(bad[k].model, "cnn") ? g_text : "synthetic";
        if (bad[k].extra)
            CLI(&r, "train", "--mode", "pp", "--device", bad[k].dev, "--mesh", bad[k].mesh,
                "--model", bad[k].model, "--data", data, bad[k].extra);
        else
            CLI(&r, "train", "--mode", "pp", "--device", bad[k].dev, "--mesh", bad[k].mesh,
                "--model", bad[k].model, "--data", data);
        expect(&r, 2, bad[k].says);
        const char *nl = strchr(r.out, '\n');
        cr_assert(nl && !nl[1], "more than one line:\n%s", r.out);
    }
}
