/* tests/test_fsdp_cli.c: `tandem train --mode fsdp` end to end, and
 * fsdp/ on CUDA devices.
 * - fsdp_cli: every --sharding on cpu:2 ends an epoch as --mode single
 *   and --mode ddp do (the printed losses and accuracy); the full
 *   checkpoint it writes resumes in --mode single and the sharded one in
 *   --mode fsdp at another N, ending as an uninterrupted run; a killed
 *   rank is named (with --uneven too, DDP's as well); --help gives PyTorch's and DeepSpeed's names; bad
 *   --sharding and misplaced flags are refused (exit 2); a GPT (tied
 *   embedding and head) trains in every sharding as on one device, its
 *   checkpoint samples, and compare's sharded modes agree on it.
 * - fsdp_emu (cuda/ built, no GPU): every sharding over CUDA-emulated
 *   devices (TANDEM_CUDA_EMULATOR; shm carries the collectives, device
 *   memory is host memory) against one host device, through the library
 *   and through the CLI. What this does not test: CUDA, NCCL.
 * - cuda_gpu (where a GPU is lent; skipped otherwise): two ranks on one
 *   GPU over NCCL (the one-GPU kit), every sharding, through the library
 *   (run by make test; not in make test-gpu's list of binaries). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/test_fsdp_util.h"
#include "tests/test_util.h"

__attribute__((weak)) tdm_status tdm_cuda_emulator_open_accel(tdm_device **out, int index);

#define DATA "--data", "synthetic", "--synthetic-size", "1536", "--batch", "64"
#define MODEL "--model", "mlp:784-48-24-10"

static const char *g_shard[] = {"full", "grad_op", "optimizer"};

Test(fsdp_cli, every_sharding_ends_the_epoch_as_single_and_ddp, .timeout = 240)
{
    static cli_result r;
    char single[256], other[256];
    CLI(&r, "train", "--mode", "single", DATA, MODEL, "--epochs", "1", "--quiet");
    expect(&r, 0, "test accuracy");
    epoch_result(r.out, "epoch 1/1", single, sizeof single);
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", DATA, MODEL, "--epochs", "1",
        "--quiet");
    expect(&r, 0, "test accuracy");
    epoch_result(r.out, "epoch 1/1", other, sizeof other);
    cr_assert_str_eq(other, single);
    for (int s = 0; s < 3; s++) {
        CLI(&r, "train", "--mode", "fsdp", "--sharding", g_shard[s], "--device", "cpu:3", DATA,
            MODEL, "--epochs", "1", "--quiet");
        expect(&r, 0, "fsdp memory (rank 0)");
        cr_assert(strstr(r.out, "all-gather exposed") && strstr(r.out, "reduce-scatter exposed"),
                  "%s", r.out);
        epoch_result(r.out, "epoch 1/1", other, sizeof other);
        cr_assert_str_eq(other, single, "--sharding %s: %s vs single %s", g_shard[s], other,
                         single);
    }
    /* under tandem launch each rank joins the launched job instead of forking */
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), "train", "--mode", "fsdp", "--device", "cpu:2",
        DATA, MODEL, "--epochs", "1", "--quiet");
    expect(&r, 0, "[rank 0] fsdp memory");
    epoch_result(r.out, "[rank 0] epoch 1/1", other, sizeof other);
    cr_assert_str_eq(other, single, "launched: %s vs single %s", other, single);
    CLI(&r, "train", "--mode", "fsdp", "--sharding", "zero2", "--device", "cpu:2", DATA, MODEL,
        "--epochs", "1", "--quiet", "--optim", "adamw");
    expect(&r, 0, "SHARD_GRAD_OP, ZeRO stage 2");
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(fsdp_cli, checkpoints_resume_in_single_and_at_another_n, .timeout = 240)
{
    static cli_result r;
    char dir[64];
    tu_mkdtemp(dir, sizeof dir, "fsdp_cli");
    char full[256], idx[256], straight[256], resumed[256];
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    snprintf(idx, sizeof idx, "%s/sharded.index", dir);
    CLI(&r, "train", "--mode", "single", DATA, MODEL, "--epochs", "2", "--quiet");
    expect(&r, 0, "test accuracy");
    epoch_result(r.out, "epoch 2/2", straight, sizeof straight);
    /* full form: written by fsdp, resumed by single */
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", DATA, MODEL, "--epochs", "1",
        "--save", full);
    expect(&r, 0, "saved");
    CLI(&r, "train", "--mode", "single", DATA, MODEL, "--epochs", "2", "--resume", full,
        "--quiet");
    expect(&r, 0, "resumed");
    epoch_result(r.out, "epoch 2/2", resumed, sizeof resumed);
    cr_assert_str_eq(resumed, straight);
    /* sharded form: written at N=2 with grad_op, resumed at N=3 with full */
    CLI(&r, "train", "--mode", "fsdp", "--sharding", "grad_op", "--device", "cpu:2", DATA, MODEL,
        "--epochs", "1", "--save", idx, "--save-sharded");
    expect(&r, 0, "sharded: a file per rank plus this index");
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:3", DATA, MODEL, "--epochs", "2",
        "--resume", idx, "--quiet");
    expect(&r, 0, "resumed");
    epoch_result(r.out, "epoch 2/2", resumed, sizeof resumed);
    cr_assert_str_eq(resumed, straight);
    /* and a single-device checkpoint into fsdp */
    CLI(&r, "train", "--mode", "single", DATA, MODEL, "--epochs", "1", "--save", full,
        "--quiet");
    expect(&r, 0, NULL);
    CLI(&r, "train", "--mode", "fsdp", "--sharding", "optimizer", "--device", "cpu:2", DATA,
        MODEL, "--epochs", "2", "--resume", full, "--quiet");
    expect(&r, 0, "resumed");
    epoch_result(r.out, "epoch 2/2", resumed, sizeof resumed);
    cr_assert_str_eq(resumed, straight);
    /* another model's checkpoint is refused naming both models */
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", DATA, "--model", "mlp:784-40-24-10",
        "--epochs", "2", "--resume", full, "--quiet");
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "mlp 784-48-24-10"), "%s", r.out);
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(fsdp_cli, a_killed_rank_is_named, .timeout = 120)
{
    static cli_result r;
    cr_assert_eq(setenv("TANDEM_DDP_TEST_KILL", "1:5", 1), 0);
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:3", DATA, MODEL, "--epochs", "1",
        "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "rank 1 (pid"), "%s", r.out);
    cr_assert(strstr(r.out, "killed by signal 9"), "%s", r.out);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* The test hook fires with --uneven too (each rank's own samples, join):
 * docs/DEBUGGING.md has TANDEM_DDP_TEST_KILL for DDP and FSDP alike.
 * (It was never read on that path: the run ended with exit 0.) */
Test(fsdp_cli, a_killed_rank_is_named_with_uneven_inputs, .timeout = 240)
{
    static cli_result r;
    static const char *modes[] = {"fsdp", "ddp"};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(setenv("TANDEM_DDP_TEST_KILL", "1:3", 1), 0);
        CLI(&r, "train", "--mode", modes[i], "--device", "cpu:2", DATA, MODEL, "--epochs", "1",
            "--uneven", "--quiet");
        unsetenv("TANDEM_DDP_TEST_KILL");
        cr_assert_eq(r.code, 1, "--mode %s: %s", modes[i], r.out);
        cr_assert(strstr(r.out, "rank 1 (pid"), "%s", r.out);
        cr_assert(strstr(r.out, "killed by signal 9"), "%s", r.out);
        cr_assert_eq(cli_shm_entries(), 0);
    }
}

/* --comm-hook allreduce (DDP's name of the uncompressed default) is
 * named so in the report, not "none". */
Test(fsdp_cli, the_allreduce_hook_is_named_as_given, .timeout = 120)
{
    static cli_result r;
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "256", "--batch", "64", MODEL, "--epochs", "1", "--quiet",
        "--comm-hook", "allreduce");
    expect(&r, 0, "fsdp comm hook allreduce: ");
    cr_assert(!strstr(r.out, "hook none"), "%s", r.out);
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(fsdp_cli, help_and_usage_errors)
{
    static cli_result r;
    CLI(&r, "train", "--help");
    expect(&r, 0, "--sharding");
    static const char *names[] = {"FULL_SHARD", "ZeRO-3", "SHARD_GRAD_OP", "ZeRO-2",
                                  "ZeroRedundancyOptimizer", "ZeRO-1", "--save-sharded"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        cr_assert(strstr(r.out, names[i]), "train --help lacks %s", names[i]);
    /* the dumps and the doctor's verdict are --mode fsdp's too (forked
     * through the same loop as ddp's) */
    cr_assert(strstr(r.out, "When a ddp or fsdp rank fails"), "%s", r.out);
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", "--sharding", "zero4");
    expect(&r, 2, "--sharding: ");
    cr_assert(strstr(r.out, "zero4") && strstr(r.out, "grad_op"), "%s", r.out);
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--sharding", "full");
    expect(&r, 2, "apply to --mode fsdp");
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", "--model", "gpt", "--sharding",
        "zero4");
    expect(&r, 2, "--sharding: ");
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", "--data", "synthetic", "--model",
        "cnn", "--synthetic-size", "64", "--batch", "2", "--max-steps", "1", "--epochs", "1",
        "--no-eval", "--quiet");
    expect(&r, 0, "epoch 1/1");
}

/* ---- --model gpt --mode fsdp ---- */

#define GPT_TINY "gpt:2-16-2-24"

/* A GPT (its output head tied to the token embedding: one unit used at
 * both ends of the model) trains from the command line in every sharding
 * on the global batches --mode single trains on: the same losses up to
 * float reassociation (as DDP's, tests/test_cli_gpt.c), validation spread
 * over the ranks included; its full checkpoint is what `tandem sample`
 * reads; compare runs the sharded modes on it and they agree. */
Test(fsdp_cli, gpt_every_sharding_trains_as_one_device, .timeout = 240)
{
    static cli_result r;
    char dir[64], text[256], ck[256];
    tu_mkdtemp(dir, sizeof dir, "fsdp_gpt");
    snprintf(text, sizeof text, "%s/text.txt", dir);
    snprintf(ck, sizeof ck, "%s/gpt.safetensors", dir);
    FILE *fp = fopen(text, "w");
    cr_assert_not_null(fp);
    static const char *const words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a",
                                        "lazy", "dog", "and", "runs", "home", "at", "night"};
    tdm_rng rng;
    tdm_rng_init(&rng, 99, TDM_RNG_STREAM_TEST);
    for (int s = 0; s < 400; s++) {
        int n = 3 + (int)tdm_rng_below(&rng, 6);
        for (int w = 0; w < n; w++)
            fprintf(fp, "%s%s", w ? " " : "", words[tdm_rng_below(&rng, 14)]);
        fputs(s % 5 == 4 ? ".\n\n" : ". ", fp);
    }
    fclose(fp);
    double t0, v0, t, v;
    CLI(&r, "train", "--model", GPT_TINY, "--data", text, "--epochs", "2", "--max-steps", "4",
        "--batch", "5", "--lr", "0.01");
    expect(&r, 0, "bigram model gets");
    cli_epoch_losses(r.out, "epoch 2/2", &t0, &v0);
    for (int s = 0; s < 3; s++) {
        /* 5 windows over 2 ranks: 2 and 3 */
        CLI(&r, "train", "--model", GPT_TINY, "--data", text, "--mode", "fsdp", "--sharding",
            g_shard[s], "--device", "cpu:2", "--epochs", "2", "--max-steps", "4", "--batch", "5",
            "--lr", "0.01");
        expect(&r, 0, "fsdp memory (rank 0)");
        cr_assert(strstr(r.out, "2 processes on cpu:2, sharding ") &&
                      strstr(r.out, "batch 5 windows of 24 bytes"), "%s", r.out);
        cli_epoch_losses(r.out, "epoch 2/2", &t, &v);
        cr_assert(fabs(t - t0) <= 2e-4 * t0 && fabs(v - v0) <= 2e-4 * v0,
                  "--sharding %s: train %.5f val %.5f vs single %.5f %.5f", g_shard[s], t, v, t0,
                  v0);
    }
    /* the full checkpoint is the file every mode and tandem sample read */
    CLI(&r, "train", "--model", GPT_TINY, "--data", text, "--mode", "fsdp", "--device", "cpu:2",
        "--epochs", "1", "--max-steps", "2", "--batch", "4", "--save", ck);
    expect(&r, 0, "tandem sample --resume");
    CLI(&r, "sample", "--resume", ck, "--prompt", "the lazy ", "--tokens", "20", "--seed", "5");
    expect(&r, 0, "the lazy ");
    CLI(&r, "compare", "--model", GPT_TINY, "--data", text, "--batch", "5", "--steps", "3",
        "--device", "cpu:2", "--modes", "ddp,fsdp,zero2,zero1");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "FSDP vs DDP: bitwise the same parameters") &&
                  strstr(r.out, "ZeRO-1 vs DDP: bitwise the same parameters"), "%s", r.out);
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* ---- CUDA-emulated devices ---- */

static tdm_status open_emu(tdm_device **out, int rank) { return tdm_cuda_emulator_open_accel(out, rank); }

/* --model gpt --mode fsdp ranks honour TANDEM_DDP_TEST_KILL as DDP's do
 * (tools/elastic.h: first attempt only), and --max-restarts starts every
 * rank again from the epoch's full checkpoint: the run ends with the
 * checkpoint of an uninterrupted one, bit for bit. 4 steps an epoch,
 * rank 1 killed before step 6 (epoch 2). */
Test(fsdp_cli, gpt_restart_after_a_killed_rank_is_bit_identical, .timeout = 240)
{
    static cli_result r;
    char dir[64], text[256], straight[256], restarted[256];
    tu_mkdtemp(dir, sizeof dir, "fsdp_el");
    snprintf(text, sizeof text, "%s/text.txt", dir);
    snprintf(straight, sizeof straight, "%s/straight.safetensors", dir);
    snprintf(restarted, sizeof restarted, "%s/restarted.safetensors", dir);
    cli_write_words(text);
    setenv("TMPDIR", dir, 1);   /* the failed attempt's dumps land here */
#define EL_GPT "train", "--model", GPT_TINY, "--data", text, "--mode", "fsdp", "--sharding", \
               "grad_op", "--device", "cpu:2", "--epochs", "3", "--max-steps", "4", "--batch", \
               "6", "--lr", "0.01", "--no-eval", "--quiet"
    /* one run id for both: their checkpoints must be the same bytes (the
     * "run" metadata included) */
    setenv("TANDEM_RUN_ID", "00000000000000e1", 1);
    CLI(&r, EL_GPT, "--save", straight);
    expect(&r, 0, NULL);
    setenv("TANDEM_DDP_TEST_KILL", "1:6", 1);
    CLI(&r, EL_GPT, "--save", restarted, "--max-restarts", "1");
    unsetenv("TANDEM_DDP_TEST_KILL");
    expect(&r, 0, "tandem train: rank 1: test fault: SIGKILL before step 6");
    expect(&r, 0, "tandem train: restart 1 of 1 after 200 ms: rank 1 (pid ");
    expect(&r, 0, "every rank starts again from ");
    expect(&r, 0, "(epoch 1, step 4)");
    expect(&r, 0, "resumed");
    expect(&r, 0, "epoch 3/3: train loss");
#undef EL_GPT
    unsetenv("TMPDIR");
    cr_expect(cli_same_file(straight, restarted),
              "the restarted gpt's parameters differ from the uninterrupted run's");
    cr_expect_eq(cli_shm_entries(), 0);
    tu_rmtree(dir);
}

/* The images' --mode fsdp likewise (its ranks are tools/rank_fsdp.c's):
 * rank 1 killed before step 20 (16 steps an epoch). */
Test(fsdp_cli, image_restart_after_a_killed_rank_is_bit_identical, .timeout = 240)
{
    static cli_result r;
    char dir[64], straight[256], restarted[256];
    tu_mkdtemp(dir, sizeof dir, "fsdp_el");
    snprintf(straight, sizeof straight, "%s/straight.safetensors", dir);
    snprintf(restarted, sizeof restarted, "%s/restarted.safetensors", dir);
    setenv("TMPDIR", dir, 1);
#define EL_IMG "train", "--mode", "fsdp", "--device", "cpu:2", "--data", "synthetic", \
               "--synthetic-size", "1024", "--batch", "64", "--model", "mlp:784-32-10", \
               "--no-eval", "--quiet", "--epochs", "3"
    /* one run id for both: their checkpoints must be the same bytes (the
     * "run" metadata included) */
    setenv("TANDEM_RUN_ID", "00000000000000e1", 1);
    CLI(&r, EL_IMG, "--save", straight);
    expect(&r, 0, NULL);
    setenv("TANDEM_DDP_TEST_KILL", "1:20", 1);
    CLI(&r, EL_IMG, "--save", restarted, "--max-restarts", "2");
    unsetenv("TANDEM_DDP_TEST_KILL");
    expect(&r, 0, "tandem train: rank 1: test fault: SIGKILL before step 20");
    expect(&r, 0, "tandem train: restart 1 of 2 after 200 ms: rank 1 (pid ");
    expect(&r, 0, "(epoch 1, step 16)");
    expect(&r, 0, "epoch 3/3: train loss");
    cr_expect(!strstr(r.out, "restart 2 of 2"), "%s", r.out);
#undef EL_IMG
    unsetenv("TMPDIR");
    cr_expect(cli_same_file(straight, restarted),
              "the restarted run's parameters differ from the uninterrupted run's");
    cr_expect_eq(cli_shm_entries(), 0);
    tu_rmtree(dir);
}

/* The doctor's verdict on a GPT FSDP rank killed by the test hook: it
 * names the rank and the labelled collective the others waited in. */
Test(fsdp_cli, gpt_killed_rank_gets_the_doctors_verdict, .timeout = 120)
{
    static cli_result r;
    char dir[64], text[256];
    tu_mkdtemp(dir, sizeof dir, "fsdp_dr");
    snprintf(text, sizeof text, "%s/text.txt", dir);
    cli_write_words(text);
    setenv("TMPDIR", dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "1:3", 1);
    CLI(&r, "train", "--model", GPT_TINY, "--data", text, "--mode", "fsdp", "--device", "cpu:2",
        "--epochs", "1", "--max-steps", "6", "--batch", "6", "--no-eval", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 1: test fault: SIGKILL before step 3");
    expect(&r, 1, "tandem train: doctor: DIED: rank 1 ");
    expect(&r, 1, "'fsdp ");
    expect(&r, 1, "tandem train: flight-recorder dumps in ");
    cr_expect_eq(cli_shm_entries(), 0);
    tu_rmtree(dir);
}

Test(fsdp_emu, every_sharding_on_emulated_devices_equals_one_host_device, .timeout = 240)
{
    CU_NEED_BACKEND();
    tdm_dataset d;
    tf_cfg c = tf_cfg_default();
    c.steps = 3;
    c.batch = 23;
    cr_assert_eq(tf_data(&d, &c, 500), TDM_STATUS_OK);
    static double ref_loss[TF_MAX_STEPS];
    static float ref_g[TF_MAX_ELEMS], ref_p[TF_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tf_reference(&c, &d, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK);
    c.open_dev = open_emu;
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        for (int w = 1; w <= 3; w += 2) {
            c.sharding = (tdm_fsdp_sharding)s;
            tf_shared *sh = tf_shared_new();
            cr_assert(sh);
            cr_assert_eq(tf_spawn(w, &c, &d, sh, 120000), TDM_STATUS_OK, "%s / %s",
                         tdm_error_message(), sh->err[0]);
            int64_t at = 0;
            /* the emulator runs the CUDA kernels' code as host loops: the
             * same float bounds as the host tests */
            cr_assert(tf_excess(sh->grads0, ref_g, n, 1e-6, 1e-6, &at) <= 0,
                      "%s N=%d grad[%lld] %g vs %g", g_shard[s], w, (long long)at, sh->grads0[at],
                      ref_g[at]);
            cr_assert(tf_excess(sh->params, ref_p, n, 1e-6, 1e-6, &at) <= 0,
                      "%s N=%d param[%lld] %g vs %g", g_shard[s], w, (long long)at,
                      sh->params[at], ref_p[at]);
            tf_shared_free(sh);
        }
    tdm_data_free(&d);
}

Test(fsdp_emu, cli_on_emulated_gpus_ends_as_on_host, .timeout = 240)
{
    CU_NEED_BACKEND();
    static cli_result r;
    char host[256], emu[256];
    CLI(&r, "train", "--mode", "single", DATA, MODEL, "--epochs", "1", "--quiet");
    expect(&r, 0, "test accuracy");
    epoch_result(r.out, "epoch 1/1", host, sizeof host);
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    for (int s = 0; s < 3; s++) {
        CLI(&r, "train", "--mode", "fsdp", "--sharding", g_shard[s], "--device", "cuda:0,1", DATA,
            MODEL, "--epochs", "1", "--quiet");
        expect(&r, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)");
        epoch_result(r.out, "epoch 1/1", emu, sizeof emu);
        cr_assert_str_eq(emu, host, "--sharding %s", g_shard[s]);
    }
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-32-10", "--device", "cuda:0,1",
        "--steps", "4", "--batch", "32", "--modes", "ddp,fsdp,zero2,zero1");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "ZeRO-2 vs DDP: bitwise the same"), "%s", r.out);
    unsetenv("TANDEM_CUDA_EMULATOR");
}

/* ---- a GPU (the one-GPU kit: two NCCL ranks on GPU 0) ---- */

__attribute__((weak)) tdm_status tdm_comm_init_nccl_opts(tdm_comm **out, tdm_comm *bootstrap,
                                                         int device_index,
                                                         const tdm_nccl_opts *opts);

static tdm_status open_gpu0(tdm_device **out, int rank)
{
    (void)rank;
    return tdm_device_open(out, "cuda", 0, 1);
}
static tdm_status make_nccl(tdm_comm **out, tdm_comm *boot, tdm_device *dev)
{
    tdm_nccl_opts o = {.timeout_ms = 60000};
    return tdm_comm_init_nccl_opts(out, boot, tdm_dev_index(dev), &o);
}

Test(cuda_gpu, two_nccl_ranks_on_one_gpu_equal_one_host_device, .timeout = 300)
{
    NEED_GPUS(1);
    tdm_dataset d;
    tf_cfg c = tf_cfg_default();
    c.steps = 3;
    c.batch = 23;
    cr_assert_eq(tf_data(&d, &c, 500), TDM_STATUS_OK);
    static double ref_loss[TF_MAX_STEPS];
    static float ref_g[TF_MAX_ELEMS], ref_p[TF_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tf_reference(&c, &d, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK);
    c.open_dev = open_gpu0;
    c.make_comm = make_nccl;
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++) {
        c.sharding = (tdm_fsdp_sharding)s;
        tf_shared *sh = tf_shared_new();
        cr_assert(sh);
        cr_assert_eq(tf_spawn(2, &c, &d, sh, 240000), TDM_STATUS_OK, "%s / %s",
                     tdm_error_message(), sh->err[0]);
        int64_t at = 0;
        /* GPU kernels and NCCL sum in other orders: DDP's GPU bounds */
        cr_assert(tf_excess(sh->params, ref_p, n, 1e-4, 1e-3, &at) <= 0,
                  "%s param[%lld] %g vs %g", g_shard[s], (long long)at, sh->params[at], ref_p[at]);
        cr_assert(!memcmp(sh->params, sh->params_r1, (size_t)n * 4), "%s: ranks differ",
                  g_shard[s]);
        tf_shared_free(sh);
    }
    tdm_data_free(&d);
}

/* ---- tandem compare with the sharded modes ---- */

#include "core/json.h"

Test(fsdp_cli, compare_every_mode_agrees_with_memory_phases_and_trace, .timeout = 240)
{
    static cli_result r;
    char dir[64];
    tu_mkdtemp(dir, sizeof dir, "fsdp_cmp");
    char trace[256], csv[256];
    snprintf(trace, sizeof trace, "%s/trace.json", dir);
    snprintf(csv, sizeof csv, "%s/run.csv", dir);
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-48-24-10", "--device", "cpu:3",
        "--batch", "50", "--steps", "6", "--warmup", "2", "--modes",
        "single,dp,ddp,fsdp,zero2,zero1", "--trace", trace, "--csv", csv);
    expect(&r, 0, "verdict: PASS");
    const char *want[] = {"FSDP(3)", "ZeRO-2(3)", "ZeRO-1(3)", "all-gather (exposed)",
                          "reduce-scatter (exp.)", "FSDP collectives:", "FSDP vs single",
                          "ZeRO-1 vs DDP", "FSDP vs DDP: bitwise the same parameters",
                          "ZeRO-2 vs DDP: bitwise the same parameters",
                          "ZeRO-1 vs DDP: bitwise the same parameters", "FSDP rank 0",
                          "ZeRO-1 rank 1..", "FSDP peaks at", "x DDP's", "it keeps"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(r.out, want[i]), "output lacks '%s':\n%s", want[i], r.out);
    /* the trace parses and has a collective track with both kinds */
    FILE *fp = fopen(trace, "rb");
    cr_assert(fp);
    static char text[1 << 22];
    size_t len = fread(text, 1, sizeof text - 1, fp);
    fclose(fp);
    text[len] = 0;
    tdm_json *root = NULL;
    cr_assert_eq(tdm_json_parse(&root, text, len), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert(strstr(text, "rank 0 all-gather / reduce-scatter"));
    cr_assert(strstr(text, "\"all-gather unit 0\"") && strstr(text, "\"reduce-scatter unit 0\""));
    tdm_json_free(root);
    /* only single and fsdp; a perturbed rank fails the verdict (exit 3) */
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-48-10", "--device", "cpu:2",
        "--batch", "32", "--steps", "4", "--modes", "fsdp", "--perturb-rank", "1");
    expect(&r, 3, "FSDP vs single");
    cr_assert(strstr(r.out, "-> FAIL") && !strstr(r.out, "DDP("), "%s", r.out);
    CLI(&r, "compare", "--modes", "single,zero4");
    expect(&r, 2, "'zero4' is not a mode");
    CLI(&r, "compare", "--help");
    expect(&r, 0, "ZeroRedundancyOptimizer");
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}
