/* tests/test_pp_short_cli.c: a pipeline with a dp dimension whose
 * replica has no samples in a step (the epoch's last batch shorter than
 * the replicas, or --batch 1): that replica runs no micro-batch but joins
 * the step - a zero gradient into DDP's sum over the dp dimension, the
 * levers' collectives, the optimizer step - as DDP's own ranks do.
 * - dp=2,pp=2 (DDP, and ZeRO-1 on the dp dimension) and dp=2,pp=2,tp=2:
 *   2 epochs of 201 samples in batches of 40 (a last batch of 1) end
 *   within 1e-5 of one device's checkpoint (the bound of pp's dp meshes,
 *   tests/test_pp_tp_cli.c); ZeRO-1 writes DDP x pp's file bit for bit;
 * - fp16 with gradient clipping: the same run within 1e-5 of one
 *   device's fp16 run with the same clipping;
 * - --batch 1: every step leaves replica 1 empty; within 1e-5 of one
 *   device's --batch 1;
 * - CUDA-emulated ranks (cuda/ built, no GPU) write the host ranks'
 *   dp=2,pp=2 file bit for bit. What this does not test: CUDA, NCCL.
 * --deterministic does not apply: it refuses a last batch shorter than
 * its K virtual shards (each replica then has K/D of them, never none). */
#include <criterion/criterion.h>

#include <stdio.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

#define MODEL "mlp:20-24-16-12-5"
#define MLP "--model", MODEL
#define SHORT "--data", "synthetic", "--synthetic-size", "201"
#define TOL 1e-5

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "pp_short"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(pp_short_cli, .init = setup, .fini = teardown, .timeout = 240);

static void path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s.safetensors", g_dir, name);
}

static double ck_diff(const char *a, const char *b) { return ck_diff_of(MODEL, a, b); }

Test(pp_short_cli, dp2_pp2_with_an_empty_share_in_the_last_batch_ends_as_one_device)
{
    static cli_result r;
    char one[128], ddp[128], z1[128];
    path(one, sizeof one, "single");
    path(ddp, sizeof ddp, "ddp_pp");
    path(z1, sizeof z1, "zero1_pp");
    CLI(&r, "train", "--mode", "single", MLP, SHORT, "--batch", "40", "--epochs", "2",
        "--no-eval", "--quiet", "--save", one);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SHORT,
        "--batch", "40", "--epochs", "2", "--no-eval", "--quiet", "--save", ddp);
    expect(&r, 0, "epoch 2/2");
    double d = ck_diff(one, ddp);
    cr_assert(d <= TOL, "dp=2,pp=2 with a 1-sample last batch: %g from one device", d);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding",
        "optimizer", MLP, SHORT, "--batch", "40", "--epochs", "2", "--no-eval", "--quiet",
        "--save", z1);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(ddp, z1), "ZeRO-1 x pp's checkpoint differs from DDP x pp's");
}

Test(pp_short_cli, dp2_pp2_tp2_with_an_empty_share_in_the_last_batch_ends_as_one_device)
{
    static cli_result r;
    char one[128], m[128];
    path(one, sizeof one, "single");
    path(m, sizeof m, "pptp");
    CLI(&r, "train", "--mode", "single", MLP, SHORT, "--batch", "40", "--epochs", "2",
        "--no-eval", "--quiet", "--save", one);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", MLP, SHORT, "--batch", "40", "--epochs", "2", "--no-eval", "--quiet", "--save",
        m);
    expect(&r, 0, "epoch 2/2");
    double d = ck_diff(one, m);
    cr_assert(d <= TOL, "dp=2,pp=2,tp=2 with a 1-sample last batch: %g from one device", d);
}

/* The empty replica takes part in the scaler's found-inf OR and the
 * clipping norm's sum, with a zero gradient. */
Test(pp_short_cli, fp16_and_clipping_with_an_empty_share_end_as_one_device)
{
    static cli_result r;
    char one[128], m[128];
    path(one, sizeof one, "single");
    path(m, sizeof m, "mesh");
    CLI(&r, "train", "--mode", "single", MLP, SHORT, "--batch", "40", "--epochs", "2",
        "--precision", "fp16", "--clip-grad-norm", "0.05", "--no-eval", "--quiet", "--save",
        one);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SHORT,
        "--batch", "40", "--epochs", "2", "--precision", "fp16", "--clip-grad-norm", "0.05",
        "--no-eval", "--quiet", "--save", m);
    expect(&r, 0, "epoch 2/2");
    double d = ck_diff(one, m);
    cr_assert(d <= TOL, "dp=2,pp=2 fp16 + clipping with a 1-sample last batch: %g from one "
              "device", d);
}

/* --batch 1: replica 1's share is empty in every step. */
Test(pp_short_cli, batch_1_leaves_a_replica_empty_every_step_and_ends_as_one_device)
{
    static cli_result r;
    char one[128], m[128];
    path(one, sizeof one, "single");
    path(m, sizeof m, "mesh");
    CLI(&r, "train", "--mode", "single", MLP, "--data", "synthetic", "--synthetic-size", "24",
        "--batch", "1", "--epochs", "1", "--no-eval", "--quiet", "--save", one);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, "--data",
        "synthetic", "--synthetic-size", "24", "--batch", "1", "--microbatches", "1",
        "--epochs", "1", "--no-eval", "--quiet", "--save", m);
    expect(&r, 0, "epoch 1/1");
    double d = ck_diff(one, m);
    cr_assert(d <= TOL, "dp=2,pp=2 --batch 1: %g from one device", d);
}

Test(pp_short_cli, emulated_cuda_ranks_write_the_host_ranks_checkpoint)
{
    CU_NEED_BACKEND();
    static cli_result r;
    char host[128], emu[128];
    path(host, sizeof host, "host");
    path(emu, sizeof emu, "emu");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SHORT,
        "--batch", "40", "--epochs", "2", "--no-eval", "--quiet", "--save", host);
    expect(&r, 0, "epoch 2/2");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "4", 1), 0);
    CLI(&r, "train", "--mode", "pp", "--device", "cuda", "--mesh", "dp=2,pp=2", MLP, SHORT,
        "--batch", "40", "--epochs", "2", "--no-eval", "--quiet", "--save", emu);
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&r, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=4)");
    cr_assert(cli_same_file(host, emu), "emulated ranks differ from host ranks");
}
