/* tests/test_cli_levers_dp.c: the memory levers in `tandem train --mode
 * dp`, end to end. DP(2) writes bitwise the checkpoint DDP(2) writes in
 * fp32 (what holds without the levers), and so it does in bf16, in bf16
 * with the global norm clipped and with activation checkpointing, on the
 * MLP and the GPT; checkpointing changes no bit of DP's run; fp16 trains
 * with its loss scale printed; --offload is refused under dp. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

TestSuite(cli_levers_dp, .timeout = 300);

#define IMG "train", "--data", "synthetic", "--synthetic-size", "1536", "--batch", "64", \
            "--model", "mlp:784-48-24-10", "--epochs", "1", "--no-eval", "--quiet", \
            "--device", "cpu:2"
#define GPT "train", "--model", "gpt:2-32-2-16", "--epochs", "1", "--max-steps", "4", \
            "--batch", "4", "--quiet", "--no-eval", "--device", "cpu:2"

static cli_result g_r;

static void ok(const char *what)
{
    cr_assert_eq(g_r.code, 0, "%s: exit %d:\n%s", what, g_r.code, g_r.out);
}

static void same(const char *dir, const char *a, const char *b)
{
    char pa[256];
    snprintf(pa, sizeof pa, "%s", tu_tpath(dir, a));
    cr_assert(cli_same_file(pa, tu_tpath(dir, b)), "%s and %s differ", a, b);
}

Test(cli_levers_dp, dp_writes_ddps_checkpoint_in_fp32_and_bf16)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "lvdp");
    CLI(&g_r, IMG, "--mode", "ddp", "--save", tu_tpath(dir, "ddp32"));
    ok("ddp fp32");
    CLI(&g_r, IMG, "--mode", "dp", "--save", tu_tpath(dir, "dp32"));
    ok("dp fp32");
    same(dir, "dp32", "ddp32");
    CLI(&g_r, IMG, "--mode", "ddp", "--precision", "bf16", "--clip-grad-norm", "0.5", "--save",
        tu_tpath(dir, "ddp16"));
    ok("ddp bf16 clipped");
    CLI(&g_r, IMG, "--mode", "dp", "--precision", "bf16", "--clip-grad-norm", "0.5", "--save",
        tu_tpath(dir, "dp16"));
    ok("dp bf16 clipped");
    cr_assert(strstr(g_r.out, "memory levers: precision bf16") &&
              strstr(g_r.out, "gradient norm clipped to 0.5") &&
              strstr(g_r.out, "peak memory on the master's"), "%s", g_r.out);
    same(dir, "dp16", "ddp16");
    CLI(&g_r, IMG, "--mode", "dp", "--precision", "bf16", "--clip-grad-norm", "0.5",
        "--checkpoint-activations", "2", "--save", tu_tpath(dir, "dp16c"));
    ok("dp bf16 clipped, checkpointed");
    same(dir, "dp16c", "dp16");
    /* the GPT: tied head, attention, AdamW */
    CLI(&g_r, GPT, "--mode", "ddp", "--save", tu_tpath(dir, "gddp32"));
    ok("gpt ddp fp32");
    CLI(&g_r, GPT, "--mode", "dp", "--save", tu_tpath(dir, "gdp32"));
    ok("gpt dp fp32");
    same(dir, "gdp32", "gddp32");
    CLI(&g_r, GPT, "--mode", "ddp", "--precision", "bf16", "--save", tu_tpath(dir, "gddp16"));
    ok("gpt ddp bf16");
    CLI(&g_r, GPT, "--mode", "dp", "--precision", "bf16", "--checkpoint-activations", "2",
        "--save", tu_tpath(dir, "gdp16"));
    ok("gpt dp bf16 checkpointed");
    same(dir, "gdp16", "gddp16");
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(cli_levers_dp, fp16_trains_with_loss_scaling)
{
    CLI(&g_r, "train", "--data", "synthetic", "--synthetic-size", "1536", "--batch", "64",
        "--model", "mlp:784-48-24-10", "--epochs", "1", "--no-eval", "--device", "cpu:2",
        "--mode", "dp", "--precision", "fp16", "--clip-grad-norm", "1");
    ok("dp fp16");
    cr_assert(strstr(g_r.out, "loss scale 65536 (0 steps skipped)") &&
              strstr(g_r.out, "grad norm "), "%s", g_r.out);
}
