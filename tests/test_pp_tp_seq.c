/* tests/test_pp_tp_seq.c: `tandem train --mode pp --mesh [dp=D,]pp=S,tp=N
 * --sequence-parallel`: Megatron's sequence parallelism on a pipeline's
 * tensor-parallel GPT stages (models/gpt.c's sequence-parallel passes,
 * tools/rank_pptp_seq.c's collectives):
 * - equivalence: pp=2,tp=2 and dp=2,pp=2,tp=2, 2 micro-batches, write
 *   after 10 steps the checkpoint of the same mesh without it within
 *   test_tp.c's GPT bound, 1e-4 (measured 2.9e-6 and 2.5e-6: the
 *   reduce-scatters add in another order than the all-reduces), and
 *   print its loss;
 * - communication: stage 0's all-gathers and reduce-scatters (counted by
 *   the stage's callback as the communicator counts them, n floats each)
 *   are exactly the plan's per step times the steps, and the plan is the
 *   hand count of gpt:3-32-2-16 split 0,3 (stage 0: the embeddings and
 *   blocks 0 and 1): per micro-batch of 4 windows 8 per block, less block
 *   0's ln_1 gather (it normalises the whole embeddings), plus the
 *   embeddings' gradient gather: 16 of 4*16*32 floats; and the
 *   LayerNorms' partial gradients, 4 all-reduces of 2*32 floats a step;
 * - between stages each tp rank sends its own rows only: the stage's
 *   input is T*C/N floats a window (models/stage.c), which the equal
 *   checkpoints above depend on;
 * - what it does not run is one line and exit 2: the MLP, no tp in the
 *   mesh, bf16, checkpointing, a context the group does not divide, a
 *   stage without a block. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

#define LV_DIR_PREFIX "pptpseq"
#include "tests/lever_cli_util.h"

#define GPT_MODEL "gpt:2-32-2-16"
#define GPT_TOL 1e-4

TestSuite(pp_tp_seq, .init = setup, .fini = teardown, .timeout = 300);

#define RUN "train", "--mode", "pp", "--model", GPT_MODEL, "--microbatches", "2", "--epochs", \
            "1", "--max-steps", "10", "--batch", "8", "--quiet", "--no-eval"

Test(pp_tp_seq, sequence_parallel_stages_equal_the_same_mesh_without_it)
{
    static const char *const meshes[][2] = {{"cpu:4", "pp=2,tp=2"},
                                            {"cpu:8", "dp=2,pp=2,tp=2"}};
    for (int i = 0; i < 2; i++) {
        char off[128], on[128];
        CLI(&g_r, RUN, "--device", meshes[i][0], "--mesh", meshes[i][1], "--save", path("off"));
        ok(meshes[i][1]);
        epoch_result(g_r.out, "epoch 1/1", off, sizeof off);
        CLI(&g_r, RUN, "--device", meshes[i][0], "--mesh", meshes[i][1], "--sequence-parallel",
            "--save", path("on"));
        ok(meshes[i][1]);
        cr_assert(strstr(g_r.out, "sequence parallel: the stream's tokens split"), "%s",
                  g_r.out);
        epoch_result(g_r.out, "epoch 1/1", on, sizeof on);
        cr_assert_str_eq(on, off, "%s", meshes[i][1]);
        double d = ck_diff_of(GPT_MODEL, path("on"), path("off"));
        cr_log_info("%s: sequence parallel %g off without\n", meshes[i][1], d);
        cr_assert(d <= GPT_TOL, "%s: %g off the run without sequence parallelism",
                  meshes[i][1], d);
    }
}

Test(pp_tp_seq, stage_0_moves_exactly_the_planned_bytes)
{
    CLI(&g_r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--model",
        "gpt:3-32-2-16", "--split", "0,3", "--microbatches", "2", "--epochs", "1",
        "--max-steps", "6", "--batch", "8", "--quiet", "--no-eval", "--sequence-parallel");
    ok("gpt:3 pp=2,tp=2");
    const char *l = strstr(g_r.out, "pp-tp sequence parallel: rank 0 ran ");
    cr_assert(l, "%s", g_r.out);
    long long calls, bytes, ln, ln_bytes, p_calls, p_bytes, p_ln, p_ln_bytes;
    double ms;
    int n = sscanf(l, "pp-tp sequence parallel: rank 0 ran %lld all-gathers and "
                   "reduce-scatters of %lld bytes in %lf ms over the run, and %lld LayerNorm "
                   "gradient all-reduces of %lld bytes; planned per step: %lld of %lld bytes, "
                   "and %lld of %lld bytes", &calls, &bytes, &ms, &ln, &ln_bytes, &p_calls,
                   &p_bytes, &p_ln, &p_ln_bytes);
    cr_assert_eq(n, 9, "%s", l);
    /* per micro-batch of 4 windows of 16 tokens, 32 wide: 16 collectives */
    cr_assert(p_calls == 2 * 16 && p_bytes == 2LL * 16 * 4 * 16 * 32 * 4, "%s", l);
    cr_assert(p_ln == 4 && p_ln_bytes == 4LL * 2 * 32 * 4, "%s", l);
    cr_assert(calls == 6 * p_calls && bytes == 6 * p_bytes, "%s", l);
    cr_assert(ln == 6 * p_ln && ln_bytes == 6 * p_ln_bytes, "%s", l);
}

Test(pp_tp_seq, what_it_does_not_run_is_one_line_and_exit_2)
{
    static const struct {
        const char *dev, *mesh, *model, *extra, *says;
    } bad[] = {
        {"cpu:4", "pp=2,tp=2", "mlp:20-24-16-12-5", NULL,
         "--sequence-parallel on tensor-parallel stages applies to the GPT"},
        {"cpu:2", "pp=2", GPT_MODEL, NULL, "it needs --mesh ...,pp=S,tp=N with N > 1"},
        {"cpu:4", "pp=2,tp=2", GPT_MODEL, "--checkpoint-activations",
         "runs in fp32 without --checkpoint-activations"},
        {"cpu:4", "pp=2,tp=2", "gpt:2-32-2-15", NULL,
         "the GPT's context of 15 tokens is not divisible by the 2 tensor-parallel ranks"},
        {"cpu:4", "pp=2,tp=2", GPT_MODEL, "--split=0,1",
         "stage 0 (pipeline layers 0-0) holds no transformer block"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        const char *x = bad[k].extra ? bad[k].extra : "--quiet";
        int mlp = !strncmp(bad[k].model, "mlp", 3);   /* images; the GPT reads text */
        CLI(&g_r, "train", "--mode", "pp", "--device", bad[k].dev, "--mesh", bad[k].mesh,
            "--model", bad[k].model, mlp ? "--data" : "--quiet", mlp ? "synthetic" : "--quiet",
            "--sequence-parallel", x);
        cr_assert_eq(g_r.code, 2, "%s: exit %d\n%s", bad[k].says, g_r.code, g_r.out);
        cr_assert(strstr(g_r.out, bad[k].says), "%s", g_r.out);
        const char *nl = strchr(g_r.out, '\n');
        cr_assert(nl && !nl[1], "more than one line:\n%s", g_r.out);
    }
    CLI(&g_r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--model",
        GPT_MODEL, "--sequence-parallel", "--precision", "bf16");
    cr_assert_eq(g_r.code, 2, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "not built with --precision bf16"), "%s", g_r.out);
    /* fp32 with checkpointing: the message names what was refused */
    CLI(&g_r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--model",
        GPT_MODEL, "--sequence-parallel", "--checkpoint-activations");
    cr_assert_eq(g_r.code, 2, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "not built with --checkpoint-activations") &&
                  !strstr(g_r.out, "--precision fp32"), "%s", g_r.out);
}
