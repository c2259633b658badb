/* tests/test_cli_levers_ranks.c: the memory levers in `tandem train
 * --mode ddp` and `--mode fsdp` (every sharding), end to end:
 * - bf16: DDP(2) writes bitwise the checkpoint FSDP, ZeRO-2 and ZeRO-1 (2)
 *   write, on the MLP and on the GPT; its loss is within 2e-3 of one
 *   device's in bf16; --checkpoint-activations changes no bit (DDP and
 *   FSDP);
 * - fp16: an inf planted in rank 1's gradient at step 3 (after DDP's
 *   all-reduce, in FSDP's shard) makes rank 0 skip that step too (its
 *   loss scale halves, "1 step skipped"), the parameters and optimizer
 *   state bitwise those of a run that stopped before step 3 (its saved
 *   loss scale halved), and DDP and FSDP agree bitwise;
 * - fp16 resume: saved after epoch 1 (its loss scale halved by the
 *   planted inf) and resumed, DDP and FSDP go on from the saved loss
 *   scale and end on the uninterrupted run's bytes;
 * - clipping: the printed global norm equals one device's in DDP and
 *   every sharding, at 2 and 3 ranks;
 * - optimizer offload on emulated GPUs: bitwise the same checkpoint as
 *   without it in DDP and FSDP, and DDP's peak lower by the state's bytes;
 * - compare --precision bf16 --checkpoint-activations 2 runs single, DDP
 *   and every sharding of the GPT in one run: the sharded modes bitwise
 *   DDP, the verdict PASS; the default modes (dp among them) pass in bf16
 *   with checkpointing;
 * - FSDP (full shard) with segments of 2 units (train and compare):
 *   bitwise DDP's;
 * - refusals: --uneven with fp16, compare in fp16, compare's pp with a
 *   lever. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/safetensors.h"
#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

TestSuite(levers_ranks, .timeout = 300);

#define IMG "train", "--data", "synthetic", "--synthetic-size", "1536", "--batch", "64", \
            "--model", "mlp:784-48-24-10", "--epochs", "1", "--no-eval", "--quiet"
#define GPT "train", "--model", "gpt:2-32-2-16", "--epochs", "1", "--max-steps", "4", \
            "--batch", "4", "--quiet", "--no-eval"

static cli_result g_r;

static void ok(const char *what)
{
    cr_assert_eq(g_r.code, 0, "%s: exit %d:\n%s", what, g_r.code, g_r.out);
}

/* The value after `key` in the output (the last occurrence). */
static double after(const char *key)
{
    const char *p = NULL, *q = g_r.out;
    while ((q = strstr(q, key))) p = q++;
    cr_assert_not_null(p, "no '%s' in:\n%s", key, g_r.out);
    return strtod(p + strlen(key), NULL);
}

Test(levers_ranks, bf16_ddp_equals_every_sharding_and_checkpointing_changes_no_bit)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "lvr");
    CLI(&g_r, IMG, "--mode", "single", "--precision", "bf16");
    ok("single bf16");
    double single = after("train loss ");
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cpu:2", "--precision", "bf16", "--save",
        tu_tpath(dir, "ddp"));
    ok("ddp bf16");
    cr_assert(fabs(after("train loss ") - single) < 2e-3, "ddp %g vs single %g",
              after("train loss "), single);
    static const char *const shard[] = {"full", "grad_op", "optimizer"};
    for (int s = 0; s < 3; s++) {
        CLI(&g_r, IMG, "--mode", "fsdp", "--sharding", shard[s], "--device", "cpu:2",
            "--precision", "bf16", "--save", tu_tpath(dir, shard[s]));
        ok(shard[s]);
        cr_assert(cli_same_file(tu_tpath(dir, "ddp"), tu_tpath(dir, shard[s])),
                  "--sharding %s bf16 differs from ddp bf16", shard[s]);
    }
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cpu:2", "--precision", "bf16",
        "--checkpoint-activations", "2", "--save", tu_tpath(dir, "ddp_ckpt"));
    ok("ddp bf16 checkpointed");
    cr_assert(strstr(g_r.out, "activation checkpointing (segments of 2)"), "%s", g_r.out);
    cr_assert(cli_same_file(tu_tpath(dir, "ddp"), tu_tpath(dir, "ddp_ckpt")));
    /* full shard: a segment of two layers gathers both units at once */
    CLI(&g_r, IMG, "--mode", "fsdp", "--device", "cpu:2", "--precision", "bf16",
        "--checkpoint-activations", "2", "--save", tu_tpath(dir, "fsdp_ckpt"));
    ok("fsdp bf16 checkpointed in segments of 2");
    cr_assert(cli_same_file(tu_tpath(dir, "ddp"), tu_tpath(dir, "fsdp_ckpt")));
    /* the GPT: tied head, LayerNorms; FSDP gathers unit by unit */
    CLI(&g_r, GPT, "--mode", "ddp", "--device", "cpu:2", "--precision", "bf16", "--save",
        tu_tpath(dir, "gpt_ddp"));
    ok("gpt ddp bf16");
    CLI(&g_r, GPT, "--mode", "fsdp", "--device", "cpu:2", "--precision", "bf16",
        "--checkpoint-activations", "2", "--save", tu_tpath(dir, "gpt_fsdp"));
    ok("gpt fsdp bf16 checkpointed");
    cr_assert(cli_same_file(tu_tpath(dir, "gpt_ddp"), tu_tpath(dir, "gpt_fsdp")));
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(levers_ranks, an_inf_on_one_rank_makes_every_rank_skip)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "lvr");
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cpu:2", "--precision", "fp16", "--max-steps",
        "2", "--save", tu_tpath(dir, "two"));
    ok("ddp fp16, 2 steps");
    cr_assert(strstr(g_r.out, "loss scale 65536 (0 steps skipped)"), "%s", g_r.out);
    setenv("TANDEM_TEST_GRAD_INF", "1:3", 1);
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cpu:2", "--precision", "fp16", "--max-steps",
        "3", "--save", tu_tpath(dir, "ddp"));
    ok("ddp fp16, an inf at step 3");
    /* rank 0 speaks: its own gradient was finite */
    cr_assert(strstr(g_r.out, "rank 1: test hook: an inf planted in its gradient at step 3") &&
                  strstr(g_r.out, "loss scale 32768 (1 step skipped)"), "%s", g_r.out);
    /* the same tensors and metadata, but the loss scaler's: halved */
    cr_assert(same_but_loss_scaler(tu_tpath(dir, "two"), tu_tpath(dir, "ddp")),
              "the skipped step changed the parameters or the optimizer");
    cr_assert_eq(ckpt_loss_scale(tu_tpath(dir, "two")), 65536.0);
    cr_assert_eq(ckpt_loss_scale(tu_tpath(dir, "ddp")), 32768.0);
    CLI(&g_r, IMG, "--mode", "fsdp", "--device", "cpu:2", "--precision", "fp16", "--save",
        tu_tpath(dir, "fsdp"));
    ok("fsdp fp16, an inf at step 3");
    cr_assert(strstr(g_r.out, "loss scale 32768 (1 step skipped)"), "%s", g_r.out);
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cpu:2", "--precision", "fp16", "--save",
        tu_tpath(dir, "ddp_all"));
    ok("ddp fp16, whole epoch");
    unsetenv("TANDEM_TEST_GRAD_INF");
    cr_assert(cli_same_file(tu_tpath(dir, "fsdp"), tu_tpath(dir, "ddp_all")));
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(levers_ranks, fp16_resume_goes_on_from_the_saved_loss_scale)
{
    char dir[128], straight[192], first[192], resumed[192];
    tu_mkdtemp(dir, sizeof dir, "lvr");
    static const char *const modes[] = {"ddp", "fsdp"};
    setenv("TANDEM_RUN_ID", "levers-ranks-fp16-resume", 1);   /* the same "run" in each file */
    setenv("TANDEM_TEST_GRAD_INF", "1:3", 1);   /* epoch 1 halves the scale */
#define FP16_RANKS "train", "--data", "synthetic", "--synthetic-size", "1536", "--batch", "64", \
                   "--model", "mlp:784-48-24-10", "--no-eval", "--quiet", "--device", "cpu:2", \
                   "--precision", "fp16"
    for (int i = 0; i < 2; i++) {
        snprintf(straight, sizeof straight, "%s", tu_tpath(dir, "straight"));
        snprintf(first, sizeof first, "%s", tu_tpath(dir, "first"));
        snprintf(resumed, sizeof resumed, "%s", tu_tpath(dir, "resumed"));
        CLI(&g_r, FP16_RANKS, "--mode", modes[i], "--epochs", "2", "--save", straight);
        ok(modes[i]);
        CLI(&g_r, FP16_RANKS, "--mode", modes[i], "--epochs", "1", "--save", first);
        ok(modes[i]);
        cr_assert(strstr(g_r.out, "loss scale 32768 (1 step skipped)"), "%s", g_r.out);
        cr_assert_eq(ckpt_loss_scale(first), 32768.0, "%s: %g", modes[i],
                     ckpt_loss_scale(first));
        /* the hook counts this process's steps: it would plant again at
         * the resumed run's third, the uninterrupted run's 27th */
        unsetenv("TANDEM_TEST_GRAD_INF");
        CLI(&g_r, FP16_RANKS, "--mode", modes[i], "--epochs", "2", "--resume", first, "--save",
            resumed);
        setenv("TANDEM_TEST_GRAD_INF", "1:3", 1);
        ok(modes[i]);
        cr_assert(strstr(g_r.out, "dynamic loss scaling from 32768, found-inf synced"), "%s: %s",
                  modes[i], g_r.out);
        cr_assert(cli_same_file(straight, resumed), "%s: the resumed fp16 run differs from the "
                  "uninterrupted one (loss scale %g, uninterrupted %g)", modes[i],
                  ckpt_loss_scale(resumed), ckpt_loss_scale(straight));
    }
#undef FP16_RANKS
    unsetenv("TANDEM_TEST_GRAD_INF");
    unsetenv("TANDEM_RUN_ID");
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(levers_ranks, the_clipped_norm_is_one_devices)
{
    char one[64], other[64];
    CLI(&g_r, IMG, "--mode", "single", "--clip-grad-norm", "0.5");
    ok("single");
    snprintf(one, sizeof one, "%s", strstr(g_r.out, "grad norm ") ? strstr(g_r.out, "grad norm ")
                                                                   : "none");
    cr_assert(strncmp(one, "grad norm ", 10) == 0, "%s", g_r.out);
    *strchr(one, '(') = 0;
    static const char *const modes[][4] = {{"ddp", "full", "cpu:2"},
                                           {"fsdp", "full", "cpu:2"},
                                           {"fsdp", "grad_op", "cpu:3"},
                                           {"fsdp", "optimizer", "cpu:2"},
                                           {"ddp", "full", "cpu:3"}};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        if (!strcmp(modes[i][0], "ddp"))
            CLI(&g_r, IMG, "--mode", "ddp", "--device", modes[i][2], "--clip-grad-norm", "0.5");
        else
            CLI(&g_r, IMG, "--mode", "fsdp", "--sharding", modes[i][1], "--device", modes[i][2],
                "--clip-grad-norm", "0.5");
        ok(modes[i][0]);
        cr_assert(strstr(g_r.out, "global gradient norm clipped to 0.5"), "%s", g_r.out);
        const char *p = strstr(g_r.out, "grad norm ");
        cr_assert_not_null(p, "%s", g_r.out);
        snprintf(other, sizeof other, "%s", p);
        *strchr(other, '(') = 0;
        cr_assert_str_eq(other, one, "%s %s on %s", modes[i][0], modes[i][1], modes[i][2]);
    }
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(levers_ranks, optimizer_offload_on_emulated_gpus)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "lvr");
    setenv("TANDEM_CUDA_EMULATOR", "2", 1);
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cuda", "--precision", "fp32", "--save",
        tu_tpath(dir, "plain"));
    ok("ddp on emulated gpus");
    double plain = after("peak memory on rank 0's cuda-emu:0: ");
    CLI(&g_r, IMG, "--mode", "ddp", "--device", "cuda", "--offload", "optimizer", "--save",
        tu_tpath(dir, "off"));
    ok("ddp offloaded");
    double off = after("peak memory on rank 0's cuda-emu:0: ");
    cr_assert(cli_same_file(tu_tpath(dir, "plain"), tu_tpath(dir, "off")));
    /* SGD momentum: 39120 floats of state leave the device */
    cr_assert(plain - off >= 39120 * 4 / 1048576.0 - 0.01, "peak %g MiB, offloaded %g", plain,
              off);
    CLI(&g_r, IMG, "--mode", "fsdp", "--device", "cuda", "--offload", "optimizer", "--save",
        tu_tpath(dir, "fsdp_off"));
    ok("fsdp offloaded");
    unsetenv("TANDEM_CUDA_EMULATOR");
    cr_assert(cli_same_file(tu_tpath(dir, "plain"), tu_tpath(dir, "fsdp_off")));
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(levers_ranks, refuses_what_it_cannot_do)
{
    CLI(&g_r, "train", "--precision", "fp16", "--mode", "ddp", "--device", "cpu:2", "--uneven");
    expect(&g_r, 2, "not supported with --uneven");
    CLI(&g_r, "train", "--clip-grad-norm", "1", "--mode", "fsdp", "--device", "cpu:2",
        "--grad-accum", "2");
    expect(&g_r, 2, "not supported with --grad-accum");
    CLI(&g_r, "compare", "--precision", "fp16");
    expect(&g_r, 2, "needs loss scaling");
    /* pp takes them (tests/test_cli_plan.c), tensor parallelism not yet */
    CLI(&g_r, "compare", "--precision", "bf16", "--modes", "single,tp", "--device", "cpu:2");
    expect(&g_r, 2, "leave tp out of --modes");
    CLI(&g_r, "compare", "--clip-grad-norm", "1", "--modes", "single,ddp");
    expect(&g_r, 2, "--clip-grad-norm runs in the pp row");
}

Test(levers_ranks, compare_runs_every_mode_in_bf16_with_checkpointing)
{
    CLI(&g_r, "compare", "--model", "gpt:2-32-2-16", "--steps", "6", "--batch", "4",
        "--precision", "bf16", "--checkpoint-activations", "2", "--modes",
        "single,ddp,fsdp,zero2,zero1");
    ok("compare bf16");
    static const char *const want[] = {"FSDP vs DDP: bitwise the same parameters",
                                       "ZeRO-2 vs DDP: bitwise the same parameters",
                                       "ZeRO-1 vs DDP: bitwise the same parameters",
                                       "verdict: PASS"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(g_r.out, want[i]), "no '%s' in:\n%s", want[i], g_r.out);
    /* the default modes, dp among them (its replicas follow the master) */
    CLI(&g_r, "compare", "--data", "synthetic", "--model", "mlp:784-32-10", "--steps", "4",
        "--batch", "32", "--precision", "bf16", "--checkpoint-activations", "2");
    ok("compare bf16, default modes");
    cr_assert(strstr(g_r.out, " DP vs single") && strstr(g_r.out, "DDP vs DP") &&
              strstr(g_r.out, "FSDP vs DDP: bitwise") && strstr(g_r.out, "verdict: PASS"),
              "%s", g_r.out);
    cr_assert_eq(cli_shm_entries(), 0);
}
