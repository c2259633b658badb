/* tests/test_cli_levers_tp.c: the memory levers in `tandem train --mode
 * tp` and `--mesh dp=D,tp=N`, end to end:
 * - --clip-grad-norm: the MLP on 2 and 4 tensor-parallel ranks and on
 *   dp=2 x tp=2 (also with ZeRO-1 on the dp dimension), and the GPT on 2 ranks (also sequence parallel) and on
 *   dp=2 x tp=2, end their epochs with the loss and the global gradient
 *   norm --mode single prints on the same global batches (4 significant
 *   digits: the row-parallel sums differ from one device's by float
 *   rounding, tests/test_tp_levers.c bounds it), and write single's
 *   checkpoint within tests/test_tp.c's bounds (1e-5 MLP, 1e-4 GPT);
 * - --precision bf16 and fp16 (the MLP on 2 ranks and dp=2 x tp=2, the
 *   GPT on 2 ranks) end with single's printed loss in the same precision
 *   (4 digits), fp16 with its loss scale;
 * - fp16: an inf planted in one rank's gradient (TANDEM_TEST_GRAD_INF,
 *   after the sum over the dp dimension) at step 3 makes every rank skip
 *   it: the checkpoint is bitwise that of a run that stopped after step
 *   2 but for the loss scale, halved; and fp16 resume goes on from the
 *   saved scale, bit for bit as the uninterrupted run;
 * - --checkpoint-activations: the GPT on 2 ranks (bf16, clipped; also
 *   sequence parallel) and the MLP on dp=2 x tp=2 write the checkpoint of
 *   the same run without it, bit for bit, and the GPT's report counts
 *   the recomputed blocks' all-reduces in the plan;
 * - emulated CUDA ranks (TANDEM_CUDA_EMULATOR; cuda/ built, no GPU) write
 *   the host ranks' checkpoint bit for bit with every lever, fp16 and
 *   bf16, the MLP and the GPT (what this does not test: CUDA, NCCL);
 * - tandem compare --modes single,tp runs tp's checkpointing (its verdict
 *   PASS) and refuses --precision for tp in one line (tp's bf16 is not
 *   the one-device reference's computation);
 * - what tp does not build yet (--offload, checkpointing segments of
 *   more than one block) is one line and exit 2. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

#define LV_DIR_PREFIX "lvtp"
#include "tests/lever_cli_util.h"

#define MODEL "mlp:20-24-16-12-5"
#define MLP "--model", MODEL
#define SYN "--data", "synthetic", "--synthetic-size", "200"
#define GPT_MODEL "gpt:2-32-2-16"

TestSuite(levers_tp, .init = setup, .fini = teardown, .timeout = 300);

#define MLP_RUN MLP, SYN, "--batch", "32", "--epochs", "2", "--no-eval", "--quiet", \
                "--clip-grad-norm", "0.05"

Test(levers_tp, the_mlp_clipped_over_tp_prints_one_devices_loss_and_norm)
{
    char one[2][256], got[256];
    CLI(&g_r, "train", "--mode", "single", MLP_RUN, "--save", path("one"));
    ok("single");
    epoch_line("epoch 1/2", one[0], sizeof one[0]);
    epoch_line("epoch 2/2", one[1], sizeof one[1]);
    static const char *const layouts[][6] = {
        {"cpu:2", NULL},
        {"cpu:4", NULL},
        {"cpu:4", "--mesh", "dp=2,tp=2", NULL},
        /* ZeRO-1: each replica holds its chunk's summed gradient alone */
        {"cpu:4", "--mesh", "dp=2,tp=2", "--sharding", "optimizer", NULL}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const char *const *l = layouts[i];
        CLI(&g_r, "train", "--mode", "tp", "--device", l[0], MLP_RUN, "--save", path("tp"),
            l[1] ? l[1] : "--quiet", l[1] ? l[2] : "--quiet", l[1] && l[3] ? l[3] : "--quiet",
            l[1] && l[3] ? l[4] : "--quiet");
        ok(l[0]);
        cr_assert(strstr(g_r.out, "memory levers on every rank: precision fp32, global gradient "
                                  "norm clipped to 0.05"), "%s", g_r.out);
        epoch_line("epoch 1/2", got, sizeof got);
        cr_assert_str_eq(got, one[0], "%s %s", l[0], l[1] ? l[2] : "");
        epoch_line("epoch 2/2", got, sizeof got);
        cr_assert_str_eq(got, one[1], "%s %s", l[0], l[1] ? l[2] : "");
        double d = ck_diff_of(MODEL, path("tp"), path("one"));
        cr_assert(d <= 1e-5, "%s %s: the clipped tp checkpoint is %g off single's", l[0],
                  l[1] ? l[2] : "", d);
    }
}

#define GPT_RUN "--model", GPT_MODEL, "--epochs", "1", "--max-steps", "6", "--batch", "8", \
                "--quiet", "--no-eval", "--clip-grad-norm", "0.1"

Test(levers_tp, the_gpt_clipped_over_tp_prints_one_devices_loss_and_norm)
{
    char one[256], got[256];
    CLI(&g_r, "train", "--mode", "single", GPT_RUN, "--save", path("one"));
    ok("gpt single");
    epoch_line("epoch 1/1", one, sizeof one);
    static const char *const layouts[][4] = {{"cpu:2", NULL},
                                             {"cpu:2", "--sequence-parallel", NULL},
                                             {"cpu:4", "--mesh", "dp=2,tp=2", NULL}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const char *const *l = layouts[i];
        CLI(&g_r, "train", "--mode", "tp", "--device", l[0], GPT_RUN, "--save", path("tp"),
            l[1] ? l[1] : "--quiet", l[1] && l[2] ? l[2] : "--quiet");
        ok(l[0]);
        epoch_line("epoch 1/1", got, sizeof got);
        cr_assert_str_eq(got, one, "%s %s", l[0], l[1] ? l[1] : "");
        double d = ck_diff_of(GPT_MODEL, path("tp"), path("one"));
        cr_assert(d <= 1e-4, "%s %s: the clipped tp GPT checkpoint is %g off single's", l[0],
                  l[1] ? l[1] : "", d);
    }
}

/* The epoch line's loss (and loss scale) alone into buf. */
static void loss_line(const char *epoch, char *buf, size_t n)
{
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *line = strstr(g_r.out, key);
    cr_assert(line, "no %s line:\n%s", epoch, g_r.out);
    const char *ls = strstr(line, "loss scale "), *eol = strchr(line, '\n');
    snprintf(buf, n, "%.*s | %.*s", (int)strcspn(line, ","), line,
             ls && (!eol || ls < eol) ? (int)strcspn(ls, "\n") : 0, ls ? ls : "");
}

Test(levers_tp, bf16_and_fp16_over_tp_print_single_losses)
{
    static const char *const precs[] = {"bf16", "fp16"};
    char one[256], got[256];
    for (int i = 0; i < 2; i++) {
        CLI(&g_r, "train", "--mode", "single", MLP, SYN, "--batch", "32", "--epochs", "2",
            "--no-eval", "--quiet", "--precision", precs[i]);
        ok("single");
        loss_line("epoch 2/2", one, sizeof one);
        CLI(&g_r, "train", "--mode", "tp", "--device", "cpu:2", MLP, SYN, "--batch", "32",
            "--epochs", "2", "--no-eval", "--quiet", "--precision", precs[i]);
        ok("tp 2");
        cr_assert(strstr(g_r.out, "memory levers on every rank: precision "), "%s", g_r.out);
        loss_line("epoch 2/2", got, sizeof got);
        cr_assert_str_eq(got, one, "%s tp=2", precs[i]);
        CLI(&g_r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN,
            "--batch", "32", "--epochs", "2", "--no-eval", "--quiet", "--precision", precs[i]);
        ok("dp=2,tp=2");
        loss_line("epoch 2/2", got, sizeof got);
        cr_assert_str_eq(got, one, "%s dp=2,tp=2", precs[i]);
#define GPT_P "--model", GPT_MODEL, "--epochs", "1", "--max-steps", "20", "--batch", "8", \
              "--quiet", "--no-eval", "--precision", precs[i]
        CLI(&g_r, "train", "--mode", "single", GPT_P);
        ok("gpt single");
        loss_line("epoch 1/1", one, sizeof one);
        CLI(&g_r, "train", "--mode", "tp", "--device", "cpu:2", GPT_P);
        ok("gpt tp 2");
        loss_line("epoch 1/1", got, sizeof got);
        /* the GPT's attention products stay float32 under tp: its last
         * digit may differ from one device's (measured 4.7291 vs 4.7293
         * in bf16 at step 20) */
        double a = atof(strstr(one, "train loss ") + 11), b = atof(strstr(got, "train loss ") + 11);
        cr_assert(fabs(a - b) <= 2e-3, "gpt %s: tp loss %s, single %s", precs[i], got, one);
#undef GPT_P
    }
}

#define FP16_TP "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN, \
                "--batch", "32", "--no-eval", "--quiet", "--precision", "fp16",                 \
                "--clip-grad-norm", "0.05"

Test(levers_tp, an_inf_in_one_ranks_gradient_makes_every_rank_skip)
{
    static const char *const ranks[] = {"1", "3"};
    for (int i = 0; i < 2; i++) {
        char hook[16], said[96];
        snprintf(hook, sizeof hook, "%s:3", ranks[i]);
        snprintf(said, sizeof said, "rank %s: test hook: an inf planted in its gradient at step 3",
                 ranks[i]);
        CLI(&g_r, FP16_TP, "--epochs", "1", "--max-steps", "2", "--save", path("two"));
        ok("fp16, 2 steps");
        cr_assert(strstr(g_r.out, "loss scale 65536 (0 steps skipped)"), "%s", g_r.out);
        setenv("TANDEM_TEST_GRAD_INF", hook, 1);
        CLI(&g_r, FP16_TP, "--epochs", "1", "--max-steps", "3", "--save", path("three"));
        unsetenv("TANDEM_TEST_GRAD_INF");
        ok("fp16, an inf at step 3");
        cr_assert(strstr(g_r.out, said) && strstr(g_r.out, "loss scale 32768 (1 step skipped)"),
                  "rank %s: %s", ranks[i], g_r.out);
        cr_assert(same_but_loss_scaler(path("two"), path("three")),
                  "rank %s: the skipped step changed the parameters or the optimizer", ranks[i]);
        cr_assert_eq(ckpt_loss_scale(path("two")), 65536.0);
        cr_assert_eq(ckpt_loss_scale(path("three")), 32768.0);
    }
}

Test(levers_tp, fp16_resume_goes_on_from_the_saved_loss_scale)
{
    setenv("TANDEM_RUN_ID", "levers-tp-fp16-resume", 1);   /* the same "run" in each file */
    setenv("TANDEM_TEST_GRAD_INF", "2:3", 1);
    CLI(&g_r, FP16_TP, "--epochs", "2", "--save", path("straight"));
    ok("straight");
    CLI(&g_r, FP16_TP, "--epochs", "1", "--save", path("first"));
    ok("first epoch");
    cr_assert_eq(ckpt_loss_scale(path("first")), 32768.0);
    /* the hook counts this process's steps: it would plant again */
    unsetenv("TANDEM_TEST_GRAD_INF");
    CLI(&g_r, FP16_TP, "--epochs", "2", "--resume", path("first"), "--save", path("resumed"));
    unsetenv("TANDEM_RUN_ID");
    ok("resumed");
    cr_assert(strstr(g_r.out, "dynamic loss scaling from 32768"), "%s", g_r.out);
    cr_assert(cli_same_file(path("straight"), path("resumed")), "the resumed fp16 tp run "
              "differs from the uninterrupted one");
}

Test(levers_tp, checkpointing_writes_the_same_bits)
{
#define CK_GPT "train", "--mode", "tp", "--device", "cpu:2", "--model", "gpt:3-32-2-16", \
               "--epochs", "1", "--max-steps", "6", "--batch", "8", "--no-eval",         \
               "--precision", "bf16", "--clip-grad-norm", "0.1"
    for (int sp = 0; sp < 2; sp++) {
        const char *spa = sp ? "--sequence-parallel" : "--quiet";
        CLI(&g_r, CK_GPT, spa, "--save", path("off"));
        ok("gpt");
        CLI(&g_r, CK_GPT, spa, "--checkpoint-activations", "--save", path("on"));
        ok("gpt checkpointed");
        cr_assert(strstr(g_r.out, "activation checkpointing (segments of 1)"), "%s", g_r.out);
        /* 3 blocks: 12 collectives per step, 4 more (blocks 0 and 1's
         * forward ones again); sequence parallel: 12 reduce-scatters
         * and all-gathers, 4 and 3 more; counted in the 6 passes, exactly
         * the plan's */
        cr_assert(strstr(g_r.out, sp ? "96 reduce-scatters" : "96 all-reduces") &&
                      strstr(g_r.out, sp ? "90 all-gathers" : "in the 6 training passes") &&
                      strstr(g_r.out, sp ? "(16 and 15 per pass)"
                                         : "; 16 per pass of the full batch by the plan)"),
                  "%s", g_r.out);
        cr_assert(cli_same_file(path("off"), path("on")), "sp=%d: checkpointing changed the "
                  "GPT's tp run", sp);
    }
#undef CK_GPT
#define CK_MLP "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP, SYN, \
               "--batch", "32", "--epochs", "2", "--no-eval", "--quiet", "--precision", "fp16"
    CLI(&g_r, CK_MLP, "--save", path("off"));
    ok("mlp");
    CLI(&g_r, CK_MLP, "--checkpoint-activations", "all", "--save", path("on"));
    ok("mlp checkpointed");
    cr_assert(cli_same_file(path("off"), path("on")), "checkpointing changed the MLP's tp run");
#undef CK_MLP
}

Test(levers_tp, emulated_cuda_ranks_write_the_host_ranks_checkpoint)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    static const char *const prec[] = {"fp16", "bf16"};
    for (int i = 0; i < 2; i++) {
#define EMU_MLP "train", "--mode", "tp", MLP, SYN, "--batch", "32", "--epochs", "2", \
                "--no-eval", "--quiet", "--clip-grad-norm", "0.05",                 \
                "--checkpoint-activations", "--precision", prec[i]
        CLI(&g_r, EMU_MLP, "--device", "cpu:2", "--save", path("host"));
        ok("host ranks");
        cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
        CLI(&g_r, EMU_MLP, "--device", "cuda:0,1", "--save", path("emu"));
        unsetenv("TANDEM_CUDA_EMULATOR");
        ok("emulated ranks");
        cr_assert(strstr(g_r.out, "CUDA EMULATOR"), "%s", g_r.out);
        cr_assert(cli_same_file(path("host"), path("emu")), "mlp %s: emulated ranks differ "
                  "from host ranks", prec[i]);
#undef EMU_MLP
#define EMU_GPT "train", "--mode", "tp", "--model", GPT_MODEL, "--epochs", "1", "--max-steps", \
                "4", "--batch", "8", "--no-eval", "--quiet", "--clip-grad-norm", "0.1",      \
                "--checkpoint-activations", "--precision", prec[i]
        CLI(&g_r, EMU_GPT, "--device", "cpu:2", "--save", path("host"));
        ok("gpt host ranks");
        cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
        CLI(&g_r, EMU_GPT, "--device", "cuda:0,1", "--save", path("emu"));
        unsetenv("TANDEM_CUDA_EMULATOR");
        ok("gpt emulated ranks");
        cr_assert(cli_same_file(path("host"), path("emu")), "gpt %s: emulated ranks differ "
                  "from host ranks", prec[i]);
#undef EMU_GPT
    }
}

Test(levers_tp, compare_runs_tp_checkpointed_and_refuses_its_precision)
{
    CLI(&g_r, "compare", "--modes", "single,tp", "--device", "cpu:2", "--model",
        "mlp:784-128-128-10", "--steps", "4", "--warmup", "1", "--checkpoint-activations", "1");
    ok("compare tp checkpointed");
    cr_assert(strstr(g_r.out, "tp(2): largest parameter difference") &&
                  strstr(g_r.out, "-> PASS"), "%s", g_r.out);
    CLI(&g_r, "compare", "--modes", "single,tp", "--device", "cpu:2", "--precision", "bf16");
    cr_assert_eq(g_r.code, 2, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "--precision applies to tp in tandem train only"), "%s", g_r.out);
    cr_assert(strchr(g_r.out, '\n') == g_r.out + strlen(g_r.out) - 1, "more than one line:\n%s",
              g_r.out);
}

Test(levers_tp, what_tp_does_not_build_is_refused_in_one_line)
{
    static const struct {
        const char *a[2];
        const char *says;
    } bad[] = {
        {{"--checkpoint-activations", "2"}, "segments of more are not built for tp"},
        {{"--offload", "optimizer"}, "--mode tp does not support --offload"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CLI(&g_r, "train", "--mode", "tp", "--device", "cpu:2", MLP, SYN, bad[i].a[0],
            bad[i].a[1]);
        cr_assert_eq(g_r.code, 2, "%s: %s", bad[i].a[0], g_r.out);
        cr_assert(strstr(g_r.out, bad[i].says), "%s: %s", bad[i].a[0], g_r.out);
        cr_assert(strchr(g_r.out, '\n') == g_r.out + strlen(g_r.out) - 1,
                  "more than one line:\n%s", g_r.out);
    }
}
