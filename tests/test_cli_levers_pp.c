/* tests/test_cli_levers_pp.c: the memory levers in `tandem train --mode
 * pp` and `--mesh dp=D,pp=S`, end to end:
 * - a pipeline with --precision bf16|fp16, --checkpoint-activations and
 *   --clip-grad-norm writes the very checkpoint (bit for bit, the loss
 *   scaler's metadata included) that --mode single --grad-accum M writes
 *   with the same levers: the MLP at 2 and 3 stages, GPipe and 1F1B, and
 *   the CNN; the printed gradient norm is one device's;
 * - dp=2 x pp=2 with the same levers ends its epochs with one device's
 *   printed loss and norm; checkpointing changes no bit of it; ZeRO-1 on
 *   the dp dimension writes DDP x pp's checkpoint bit for bit in fp16
 *   with clipping;
 * - fp16: an inf planted in one rank's gradient (one stage of one
 *   replica) at step 3 makes every rank skip that step: the parameters
 *   and optimizer state bitwise those of a run that stopped after step 2,
 *   the loss scale halved ("1 step skipped" and the saved scale);
 * - fp16 resume goes on from the saved loss scale, bit for bit as the
 *   uninterrupted run;
 * - the GPT trains through the pipeline in fp16 with checkpointing and
 *   clipping as on one device (the printed loss and norm);
 * - emulated CUDA stages (TANDEM_CUDA_EMULATOR) write the host stages'
 *   checkpoint bit for bit in fp16 and bf16;
 * - --offload with pp is a one-line refusal (exit 2); the levers on
 *   tensor-parallel stages: tests/test_cli_levers_pptp.c. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/safetensors.h"
#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

#define LV_DIR_PREFIX "lvpp"
#include "tests/lever_cli_util.h"

#define MLP "--model", "mlp:20-24-16-12-5"
#define SYN "--data", "synthetic", "--synthetic-size", "200"

TestSuite(levers_pp, .init = setup, .fini = teardown, .timeout = 300);

/* The levers of a case, as arguments: up to 6. */
typedef struct lv_case {
    const char *model;
    int S, M, B;
    const char *sched;
    const char *lv[6];
} lv_case;

/* last on a command line: the first NULL ends it */
#define LV_ARGS(c) (c)->lv[0], (c)->lv[1], (c)->lv[2], (c)->lv[3], (c)->lv[4], (c)->lv[5]

/* pp (S, M) at --batch B vs single --batch B/M --grad-accum M, the same
 * levers: the same checkpoint bytes, and the same printed norm. */
static void same_as_accum(const lv_case *c)
{
    char dev[16], sm[8], mm[8], bb[8], mb[8], one_line[2][256], pp_line[256];
    snprintf(dev, sizeof dev, "cpu:%d", c->S);
    snprintf(sm, sizeof sm, "%d", c->S);
    snprintf(mm, sizeof mm, "%d", c->M);
    snprintf(bb, sizeof bb, "%d", c->B);
    snprintf(mb, sizeof mb, "%d", c->B / c->M);
    const char *pp = path("pp"), *one = path("one");
    CLI(&g_r, "train", "--mode", "single", "--model", c->model, SYN, "--batch", mb,
        "--grad-accum", mm, "--epochs", "2", "--no-eval", "--quiet", "--save", one, LV_ARGS(c));
    ok("single --grad-accum");
    epoch_line("epoch 2/2", one_line[0], sizeof one_line[0]);
    CLI(&g_r, "train", "--mode", "pp", "--device", dev, "--stages", sm, "--microbatches", mm,
        "--schedule", c->sched, "--model", c->model, SYN, "--batch", bb, "--epochs", "2",
        "--no-eval", "--quiet", "--save", pp, LV_ARGS(c));
    ok("pp");
    cr_assert(strstr(g_r.out, "memory levers on every rank: precision "), "%s", g_r.out);
    epoch_line("epoch 2/2", pp_line, sizeof pp_line);
    cr_assert_str_eq(pp_line, one_line[0], "%s S=%d M=%d %s %s %s %s", c->model, c->S, c->M,
                     c->sched, c->lv[0], c->lv[1], c->lv[2]);
    cr_assert(cli_same_file(pp, one), "%s S=%d M=%d %s B=%d (%s %s %s %s): pp's checkpoint "
              "differs from single --grad-accum's", c->model, c->S, c->M, c->sched, c->B,
              c->lv[0], c->lv[1], c->lv[2], c->lv[3]);
}

Test(levers_pp, a_pipeline_equals_single_with_grad_accum_and_the_same_levers)
{
    const lv_case cases[] = {
        {"mlp:20-24-16-12-5", 2, 4, 32, "1f1b",
         {"--precision", "bf16", "--checkpoint-activations", "1", "--clip-grad-norm", "0.05"}},
        {"mlp:20-24-16-12-5", 2, 4, 32, "gpipe",
         {"--precision", "fp16", "--clip-grad-norm", "0.05"}},
        {"mlp:20-24-16-12-5", 3, 3, 33, "1f1b",
         {"--precision", "fp16", "--checkpoint-activations", "2", "--clip-grad-norm", "0.05"}},
        {"cnn", 2, 2, 16, "gpipe",
         {"--precision", "bf16", "--checkpoint-activations", "1", "--clip-grad-norm", "0.05"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) same_as_accum(&cases[i]);
}

#define MESH "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN, \
             "--batch", "32", "--microbatches", "4", "--epochs", "2", "--no-eval", "--quiet"

Test(levers_pp, dp2_pp2_ends_as_one_device_and_checkpointing_changes_no_bit)
{
    char one[2][256], mesh[256];
    CLI(&g_r, "train", "--mode", "single", MLP, SYN, "--batch", "8", "--grad-accum", "4",
        "--epochs", "2", "--no-eval", "--quiet", "--precision", "fp16", "--clip-grad-norm",
        "0.05");
    ok("single");
    epoch_line("epoch 1/2", one[0], sizeof one[0]);
    epoch_line("epoch 2/2", one[1], sizeof one[1]);
    CLI(&g_r, MESH, "--precision", "fp16", "--clip-grad-norm", "0.05", "--save", path("ddp"));
    ok("dp=2,pp=2");
    cr_assert(strstr(g_r.out, "found-inf synced over the ranks"), "%s", g_r.out);
    epoch_line("epoch 1/2", mesh, sizeof mesh);
    cr_assert_str_eq(mesh, one[0]);
    epoch_line("epoch 2/2", mesh, sizeof mesh);
    cr_assert_str_eq(mesh, one[1]);
    /* ZeRO-1 over the dp dimension: DDP x pp's step, the levers too */
    CLI(&g_r, MESH, "--precision", "fp16", "--clip-grad-norm", "0.05", "--sharding",
        "optimizer", "--save", path("zero1"));
    ok("dp=2,pp=2 zero1");
    cr_assert(cli_same_file(path("ddp"), path("zero1")), "ZeRO-1 x pp differs from DDP x pp");
    /* checkpointing: the same bits */
    CLI(&g_r, MESH, "--precision", "bf16", "--clip-grad-norm", "0.05", "--save", path("off"));
    ok("dp=2,pp=2 bf16");
    CLI(&g_r, MESH, "--precision", "bf16", "--clip-grad-norm", "0.05",
        "--checkpoint-activations", "1", "--save", path("on"));
    ok("dp=2,pp=2 bf16 checkpointed");
    cr_assert(cli_same_file(path("off"), path("on")), "checkpointing changed dp=2 x pp=2's run");
}

/* TANDEM_TEST_GRAD_INF=R:S plants an inf in rank R's stage gradient
 * after step S's backwards (after DDP's all-reduce over the replicas). */
static void skip_case(const char *dev, const char *layout_key, const char *layout,
                      const char *rank)
{
    char hook[16], said[96];
    snprintf(hook, sizeof hook, "%s:3", rank);
    snprintf(said, sizeof said, "rank %s: test hook: an inf planted in its gradient at step 3",
             rank);
    CLI(&g_r, "train", "--mode", "pp", "--device", dev, layout_key, layout, MLP, SYN, "--batch",
        "32", "--microbatches", "4", "--epochs", "1", "--no-eval", "--quiet", "--precision",
        "fp16", "--clip-grad-norm", "0.05", "--max-steps", "2", "--save", path("two"));
    ok("fp16, 2 steps");
    cr_assert(strstr(g_r.out, "loss scale 65536 (0 steps skipped)"), "%s", g_r.out);
    setenv("TANDEM_TEST_GRAD_INF", hook, 1);
    CLI(&g_r, "train", "--mode", "pp", "--device", dev, layout_key, layout, MLP, SYN, "--batch",
        "32", "--microbatches", "4", "--epochs", "1", "--no-eval", "--quiet", "--precision",
        "fp16", "--clip-grad-norm", "0.05", "--max-steps", "3", "--save", path("three"));
    unsetenv("TANDEM_TEST_GRAD_INF");
    ok("fp16, an inf at step 3");
    /* rank 0 speaks for the job: its own gradient was finite */
    cr_assert(strstr(g_r.out, said) && strstr(g_r.out, "loss scale 32768 (1 step skipped)"),
              "%s: %s", layout, g_r.out);
    cr_assert(same_but_loss_scaler(path("two"), path("three")),
              "%s: the skipped step changed the parameters or the optimizer", layout);
    cr_assert_eq(ckpt_loss_scale(path("two")), 65536.0);
    cr_assert_eq(ckpt_loss_scale(path("three")), 32768.0);
}

Test(levers_pp, an_inf_in_one_stage_makes_every_rank_skip)
{
    skip_case("cpu:2", "--stages", "2", "1");
    skip_case("cpu:3", "--stages", "3", "1");
    skip_case("cpu:4", "--mesh", "dp=2,pp=2", "3");   /* replica 1's last stage */
    skip_case("cpu:4", "--mesh", "dp=2,pp=2", "1");   /* replica 0's last stage */
}

Test(levers_pp, the_gpt_trains_through_the_pipeline_with_every_lever)
{
    char one[256], pp[256];
#define GPT_LV "train", "--model", "gpt:2-32-2-16", "--epochs", "1", "--max-steps", "6", \
               "--batch", "8", "--quiet", "--no-eval", "--precision", "fp16",            \
               "--checkpoint-activations", "1", "--clip-grad-norm", "0.1"
    CLI(&g_r, GPT_LV, "--mode", "single");
    ok("gpt single");
    epoch_line("epoch 1/1", one, sizeof one);
    CLI(&g_r, GPT_LV, "--mode", "pp", "--device", "cpu:2", "--microbatches", "1");
    ok("gpt pp");
    epoch_line("epoch 1/1", pp, sizeof pp);
    cr_assert_str_eq(pp, one);
#undef GPT_LV
}

Test(levers_pp, offload_is_refused_in_one_line)
{
    CLI(&g_r, "train", "--mode", "pp", "--device", "cuda:2", MLP, SYN, "--offload", "optimizer");
    cr_assert_eq(g_r.code, 2, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "not with --mode pp"), "%s", g_r.out);
}

/* fp16 resume: saved after epoch 1 (its scale halved by a planted inf)
 * and resumed, the pipeline goes on from the saved scale and ends on the
 * uninterrupted run's bytes. */
Test(levers_pp, fp16_resume_goes_on_from_the_saved_loss_scale)
{
#define FP16_PP "train", "--mode", "pp", "--device", "cpu:2", MLP, SYN, "--batch", "32", \
                "--no-eval", "--quiet", "--precision", "fp16", "--clip-grad-norm", "0.05"
    setenv("TANDEM_RUN_ID", "levers-pp-fp16-resume", 1);   /* the same "run" in each file */
    setenv("TANDEM_TEST_GRAD_INF", "1:3", 1);
    CLI(&g_r, FP16_PP, "--epochs", "2", "--save", path("straight"));
    ok("straight");
    CLI(&g_r, FP16_PP, "--epochs", "1", "--save", path("first"));
    ok("first epoch");
    cr_assert_eq(ckpt_loss_scale(path("first")), 32768.0);
    /* the hook counts this process's steps: it would plant again */
    unsetenv("TANDEM_TEST_GRAD_INF");
    CLI(&g_r, FP16_PP, "--epochs", "2", "--resume", path("first"), "--save", path("resumed"));
    unsetenv("TANDEM_RUN_ID");
    ok("resumed");
    cr_assert(strstr(g_r.out, "dynamic loss scaling from 32768"), "%s", g_r.out);
    cr_assert(cli_same_file(path("straight"), path("resumed")), "the resumed fp16 pipeline "
              "differs from the uninterrupted one");
#undef FP16_PP
}

/* Emulated GPUs (cuda/emulator.c): the stages' levers on device memory
 * (the found-inf flag and the norm staged through it, the all-reduces
 * over the device communicator) write the host stages' checkpoint bit for
 * bit. What this does not test: CUDA, NCCL. */
Test(levers_pp, emulated_cuda_stages_write_the_host_stages_checkpoint)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    static const char *const prec[] = {"fp16", "bf16"};
    for (int i = 0; i < 2; i++) {
#define EMU_PP "train", "--mode", "pp", MLP, SYN, "--batch", "32", "--microbatches", "4", \
               "--epochs", "2", "--no-eval", "--quiet", "--clip-grad-norm", "0.05",      \
               "--checkpoint-activations", "1", "--precision", prec[i]
        CLI(&g_r, EMU_PP, "--device", "cpu:2", "--save", path("host"));
        ok("host stages");
        cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
        CLI(&g_r, EMU_PP, "--device", "cuda:0,1", "--save", path("emu"));
        unsetenv("TANDEM_CUDA_EMULATOR");
        ok("emulated stages");
        cr_assert(strstr(g_r.out, "cuda-emu:0"), "%s", g_r.out);
        cr_assert(cli_same_file(path("host"), path("emu")), "%s: emulated stages differ from "
                  "host stages", prec[i]);
#undef EMU_PP
    }
}
