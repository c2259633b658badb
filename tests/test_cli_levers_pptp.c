/* tests/test_cli_levers_pptp.c: the memory levers on a pipeline's
 * tensor-parallel stages (`tandem train --mode pp --mesh [dp=D,]pp=S,tp=N`,
 * tools/rank_pptp.h), end to end:
 * - --clip-grad-norm: the global norm over every stage and tp slice
 *   (split tensors summed over the group, replicated ones counted by tp
 *   rank 0, replica 0 only: tools/rank_pptp_levers.c) is one device's on
 *   the same global batch: pp=2,tp=2 and dp=2,pp=2,tp=2 (also with ZeRO-1
 *   on the dp dimension) print the loss and
 *   the norm --mode single prints (4 digits), and write single's
 *   checkpoint within test_tp.c's bounds (1e-5 MLP, 1e-4 GPT; the clip
 *   scales every step by the norm, so a norm counted wrong moves the
 *   parameters far past them), the MLP and the GPT;
 * - --precision bf16 and fp16: the same runs end within tp's 0.04 of one
 *   device's fp32 loss (tests/test_tp_levers.c's bound) and near single's
 *   checkpoint in the same precision (the same roundings at the same
 *   places; the row-parallel sums' order can flip one: the MLP within
 *   MLP_LOW_TOL, the GPT within GPT_LOW_TOL, measured below), fp16 with its loss
 *   scale;
 * - fp16: an inf planted in one rank's gradient (a tp rank of one stage of
 *   one replica) at step 3 makes every rank of the job skip it: the
 *   checkpoint is bitwise that of a run that stopped after step 2 but for
 *   the loss scale, halved;
 * - --checkpoint-activations: the same run without it, bit for bit (the
 *   MLP on dp=2,pp=2,tp=2 in bf16, the GPT on pp=2,tp=2 in fp32 and
 *   fp16), after 10 steps; every stage's measured peak activation bytes
 *   drop (the GPT of 2 blocks per stage). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cuda_test_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

#define LV_DIR_PREFIX "lvpptp"
#include "tests/lever_cli_util.h"

#define MODEL "mlp:20-24-16-12-5"
#define MLP "--model", MODEL
#define SYN "--data", "synthetic", "--synthetic-size", "200"
#define GPT_MODEL "gpt:2-32-2-16"
#define TOL 1e-5
#define GPT_TOL 1e-4
#define LOSS_TOL 0.04
/* The GPT's checkpoint against single's in the same 16-bit precision
 * after 6 AdamW steps: the row-parallel sums' order flips a rounding here
 * and there, and AdamW moves an element whose tiny gradient changed sign
 * by up to 2 lr (4e-3) a step. Measured 2.2e-3 in bf16 (single bf16 is
 * 7.2e-3 off single fp32), 3.6e-3 in fp16 (single fp16: 4.0e-3 off fp32).
 * The MLP (SGD): measured 1.5e-8 in bf16, 2.3e-5
 * in fp16 (dp=2,pp=2,tp=2). */
#define GPT_LOW_TOL 5e-3
#define MLP_LOW_TOL 1e-4

TestSuite(levers_pptp, .init = setup, .fini = teardown, .timeout = 400);

/* The epoch line's train loss. */
static double epoch_loss(const char *epoch)
{
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *line = strstr(g_r.out, key);
    cr_assert(line, "no %s line:\n%s", epoch, g_r.out);
    return atof(line + strlen(key));
}

/* The pipeline's stages fc1-fc2 and fc3-fc4, each column then row
 * (fc2's and fc4's biases replicated); one device takes the same 4
 * micro-batches of 8 as --grad-accum 4. */
#define MLP_ONE "train", "--mode", "single", MLP, SYN, "--batch", "8", "--grad-accum", "4", \
                "--epochs", "2", "--no-eval", "--quiet"
#define MLP_PP "train", "--mode", "pp", "--split", "0,2", MLP, SYN, "--batch", "32", \
               "--epochs", "2", "--no-eval", "--quiet"
/* The GPT: a stage per block (pipeline layers 0-1 and 2-3), one
 * micro-batch per replica, so that one device's step is one batch. */
#define GPT_ONE "train", "--mode", "single", "--model", GPT_MODEL, "--epochs", "1", \
                "--max-steps", "6", "--batch", "8", "--quiet", "--no-eval"
#define GPT_PP "train", "--mode", "pp", "--model", GPT_MODEL, "--microbatches", "1", \
               "--epochs", "1", "--max-steps", "6", "--batch", "8", "--quiet", "--no-eval"

static const char *const g_meshes[][2] = {{"cpu:4", "pp=2,tp=2"}, {"cpu:8", "dp=2,pp=2,tp=2"}};

Test(levers_pptp, clipping_over_tensor_parallel_stages_is_one_devices_norm)
{
    char one[2][256], got[256];
    CLI(&g_r, MLP_ONE, "--clip-grad-norm", "0.05", "--save", path("one"));
    ok("mlp single");
    epoch_line("epoch 1/2", one[0], sizeof one[0]);
    epoch_line("epoch 2/2", one[1], sizeof one[1]);
    for (int i = 0; i < 2; i++) {
        CLI(&g_r, MLP_PP, "--device", g_meshes[i][0], "--mesh", g_meshes[i][1],
            "--clip-grad-norm", "0.05", "--save", path("pptp"));
        ok(g_meshes[i][1]);
        cr_assert(strstr(g_r.out, "memory levers on every rank: precision fp32, global gradient "
                                  "norm clipped to 0.05"), "%s", g_r.out);
        epoch_line("epoch 1/2", got, sizeof got);
        cr_assert_str_eq(got, one[0], "mlp %s", g_meshes[i][1]);
        epoch_line("epoch 2/2", got, sizeof got);
        cr_assert_str_eq(got, one[1], "mlp %s", g_meshes[i][1]);
        double d = ck_diff_of(MODEL, path("pptp"), path("one"));
        cr_assert(d <= TOL, "mlp %s: the clipped checkpoint is %g off single's", g_meshes[i][1],
                  d);
    }
    /* ZeRO-1 on the dp dimension: each replica steps its slice of the
     * all-reduced gradients, which replica 0's squares still count */
    CLI(&g_r, MLP_PP, "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--sharding",
        "optimizer", "--clip-grad-norm", "0.05", "--save", path("pptp"));
    ok("dp=2,pp=2,tp=2 zero1");
    epoch_line("epoch 2/2", got, sizeof got);
    cr_assert_str_eq(got, one[1], "mlp dp=2,pp=2,tp=2 zero1");
    double dz = ck_diff_of(MODEL, path("pptp"), path("one"));
    cr_assert(dz <= TOL, "mlp zero1: the clipped checkpoint is %g off single's", dz);
    CLI(&g_r, GPT_ONE, "--clip-grad-norm", "0.1", "--save", path("gone"));
    ok("gpt single");
    epoch_line("epoch 1/1", one[0], sizeof one[0]);
    for (int i = 0; i < 2; i++) {
        CLI(&g_r, GPT_PP, "--device", g_meshes[i][0], "--mesh", g_meshes[i][1],
            "--clip-grad-norm", "0.1", "--save", path("gpptp"));
        ok(g_meshes[i][1]);
        epoch_line("epoch 1/1", got, sizeof got);
        cr_assert_str_eq(got, one[0], "gpt %s", g_meshes[i][1]);
        double d = ck_diff_of(GPT_MODEL, path("gpptp"), path("gone"));
        cr_assert(d <= GPT_TOL, "gpt %s: the clipped checkpoint is %g off single's",
                  g_meshes[i][1], d);
    }
}

/* One precision on the MLP (both meshes) and the GPT (pp=2,tp=2). */
static void precision_case(const char *prec)
{
    CLI(&g_r, MLP_ONE, "--save", path("f32"));
    ok("mlp single fp32");
    double f32 = epoch_loss("epoch 2/2");
    CLI(&g_r, MLP_ONE, "--precision", prec, "--save", path("low"));
    ok("mlp single 16-bit");
    for (int i = 0; i < 2; i++) {
        CLI(&g_r, MLP_PP, "--device", g_meshes[i][0], "--mesh", g_meshes[i][1], "--precision",
            prec, "--save", path("pptp"));
        ok(g_meshes[i][1]);
        cr_assert(strstr(g_r.out, "memory levers on every rank: precision "), "%s", g_r.out);
        if (!strcmp(prec, "fp16"))
            cr_assert(strstr(g_r.out, "loss scale 65536 (0 steps skipped)"), "%s", g_r.out);
        double l = epoch_loss("epoch 2/2");
        cr_assert(fabs(l - f32) <= LOSS_TOL, "mlp %s %s: loss %.4f, fp32 %.4f", prec,
                  g_meshes[i][1], l, f32);
        double d = ck_diff_of(MODEL, path("pptp"), path("low"));
        cr_log_info("mlp %s %s: %g off single %s\n", g_meshes[i][1], prec, d, prec);
        cr_assert(d <= MLP_LOW_TOL, "mlp %s %s: %g off single's checkpoint in %s", g_meshes[i][1],
                  prec, d, prec);
    }
    CLI(&g_r, GPT_ONE, "--save", path("gf32"));
    ok("gpt single fp32");
    f32 = epoch_loss("epoch 1/1");
    CLI(&g_r, GPT_ONE, "--precision", prec, "--save", path("glow"));
    ok("gpt single 16-bit");
    CLI(&g_r, GPT_PP, "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--precision", prec, "--save",
        path("gpptp"));
    ok("gpt pp=2,tp=2");
    double l = epoch_loss("epoch 1/1");
    cr_assert(fabs(l - f32) <= LOSS_TOL, "gpt %s: loss %.4f, fp32 %.4f", prec, l, f32);
    double d = ck_diff_of(GPT_MODEL, path("gpptp"), path("glow"));
    cr_log_info("gpt pp=2,tp=2 %s: %g off single %s; single %s is %g off single fp32\n", prec, d,
                prec, prec, ck_diff_of(GPT_MODEL, path("glow"), path("gf32")));
    cr_assert(d <= GPT_LOW_TOL, "gpt %s: %g off single's checkpoint in %s", prec, d, prec);
}

Test(levers_pptp, bf16_and_fp16_on_tensor_parallel_stages_train_as_one_device)
{
    precision_case("bf16");
    precision_case("fp16");
}

/* TANDEM_TEST_GRAD_INF=R:3 plants an inf in rank R's stage gradient
 * after step 3's backwards (after DDP's all-reduce over the replicas). */
static void skip_case(const char *dev, const char *mesh, const char *rank)
{
    char hook[16], said[96];
    snprintf(hook, sizeof hook, "%s:3", rank);
    snprintf(said, sizeof said, "rank %s: test hook: an inf planted in its gradient at step 3",
             rank);
#define SKIP_RUN "train", "--mode", "pp", "--device", dev, "--mesh", mesh, MLP, SYN, "--batch", \
                 "32", "--epochs", "1", "--no-eval", "--quiet", "--precision", "fp16",         \
                 "--clip-grad-norm", "0.05"
    CLI(&g_r, SKIP_RUN, "--max-steps", "2", "--save", path("two"));
    ok("fp16, 2 steps");
    setenv("TANDEM_TEST_GRAD_INF", hook, 1);
    CLI(&g_r, SKIP_RUN, "--max-steps", "3", "--save", path("three"));
    unsetenv("TANDEM_TEST_GRAD_INF");
    ok("fp16, an inf at step 3");
    cr_assert(strstr(g_r.out, said) && strstr(g_r.out, "loss scale 32768 (1 step skipped)"),
              "%s rank %s: %s", mesh, rank, g_r.out);
    cr_assert(same_but_loss_scaler(path("two"), path("three")),
              "%s rank %s: the skipped step changed the parameters or the optimizer", mesh, rank);
    cr_assert_eq(ckpt_loss_scale(path("two")), 65536.0);
    cr_assert_eq(ckpt_loss_scale(path("three")), 32768.0);
#undef SKIP_RUN
}

Test(levers_pptp, an_inf_in_one_tp_rank_makes_every_rank_skip)
{
    skip_case("cpu:4", "pp=2,tp=2", "1");         /* stage 0's tp rank 1 */
    skip_case("cpu:8", "dp=2,pp=2,tp=2", "7");    /* replica 1's last stage, tp rank 1 */
}

/* The "peak activations X MiB" of each stage's memory line. */
static void peaks(double *out, int S)
{
    for (int s = 0; s < S; s++) {
        char key[64];
        snprintf(key, sizeof key, "stage %d memory: ", s);
        const char *line = strstr(g_r.out, key);
        const char *p = line ? strstr(line, "peak activations ") : NULL;
        cr_assert(p, "no %s line:\n%s", key, g_r.out);
        out[s] = atof(p + strlen("peak activations "));
    }
}

Test(levers_pptp, checkpointing_tensor_parallel_stages_changes_no_bit_and_saves_memory)
{
    CLI(&g_r, MLP_PP, "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--precision", "bf16",
        "--clip-grad-norm", "0.05", "--save", path("off"));
    ok("mlp without");
    CLI(&g_r, MLP_PP, "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--precision", "bf16",
        "--clip-grad-norm", "0.05", "--checkpoint-activations", "1", "--save", path("on"));
    ok("mlp with");
    cr_assert(cli_same_file(path("off"), path("on")), "checkpointing changed the mlp's run");
    static const char *const prec[] = {"fp32", "fp16"};
    for (int i = 0; i < 2; i++) {
        double off[2], on[2];
#define GPT4 "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--model", \
             "gpt:4-32-2-16", "--microbatches", "4", "--epochs", "1", "--max-steps", "10",   \
             "--batch", "16", "--quiet", "--no-eval", "--precision", prec[i]
        CLI(&g_r, GPT4, "--save", path("goff"));
        ok("gpt without");
        peaks(off, 2);
        CLI(&g_r, GPT4, "--checkpoint-activations", "1", "--save", path("gon"));
        ok("gpt with");
        peaks(on, 2);
#undef GPT4
        cr_assert(cli_same_file(path("goff"), path("gon")), "%s: checkpointing changed the "
                  "gpt's run", prec[i]);
        for (int s = 0; s < 2; s++)
            cr_assert(on[s] < off[s], "%s stage %d: peak activations %.3f MiB with "
                      "checkpointing, %.3f MiB without", prec[i], s, on[s], off[s]);
    }
}

/* The levers and sequence parallelism on tensor-parallel stages of
 * emulated GPUs (TANDEM_CUDA_EMULATOR: cuda/'s kernels' host twins and
 * its ownership checks) write the host ranks' file byte for byte: the
 * MLP in bf16 with clipping and checkpointing, the GPT in fp16 with
 * checkpointing, and the GPT sequence parallel with clipping. */
Test(levers_pptp, emulated_gpus_write_the_host_ranks_file)
{
    CU_NEED_BACKEND();
    static const char *const cases[][8] = {
        {"--model", MODEL, "--data", "synthetic", "--precision", "bf16", "--clip-grad-norm",
         "0.5"},
        {"--model", GPT_MODEL, "--split", "0,2", "--precision", "fp16", "--clip-grad-norm",
         "0.5"},
        {"--model", GPT_MODEL, "--split", "0,2", "--sequence-parallel", "--clip-grad-norm",
         "0.5", NULL},
    };
    for (int c = 0; c < 3; c++) {
        const char *file[2];
        for (int e = 0; e < 2; e++) {
            char name[32];
            snprintf(name, sizeof name, "c%d_%s", c, e ? "emu" : "host");
            file[e] = path(name);
            if (e) cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "4", 1), 0);
            const char *ck = c < 2 ? "--checkpoint-activations" : "--quiet";
            CLI(&g_r, "train", "--mode", "pp", "--mesh", "pp=2,tp=2", "--device",
                e ? "cuda" : "cpu:4", cases[c][0], cases[c][1], cases[c][2], cases[c][3],
                cases[c][4], cases[c][5], cases[c][6], cases[c][7] ? cases[c][7] : "--quiet",
                ck, "--batch", "8", "--epochs", "1", "--max-steps", "3", "--no-eval",
                "--quiet", "--save", file[e]);
            unsetenv("TANDEM_CUDA_EMULATOR");
            ok(file[e]);
        }
        cr_expect(cli_same_file(file[0], file[1]), "case %d: emulated GPUs differ from host", c);
    }
}
