/* tests/test_pp_cli.c: `tandem train --mode pp` end to end.
 * - equivalence: a pipeline of S stages with M micro-batches writes the
 *   very checkpoint (bit for bit) that --mode single --batch B/M
 *   --grad-accum M writes, for the MLP and the CNN, S = 2..4, M = 1..4,
 *   GPipe and 1F1B, a short last batch included; --mesh dp=2,pp=2 ends
 *   its epochs as one device does (the printed losses), and with ZeRO-1
 *   on the dp dimension writes DDP x pp's checkpoint bit for bit, resumes
 *   (at its dp size and another, and under --max-restarts) bit for bit;
 * - checkpoints: a pipeline's file resumes in single (bit for bit as an
 *   uninterrupted single run), ddp and fsdp; a ddp file resumes in a
 *   pipeline; a pipeline resumes at another S and schedule bit for bit
 *   as the uninterrupted pipeline; --max-restarts restarts a killed stage
 *   from the last checkpoint and ends as the uninterrupted run;
 * - the GPT trains through the pipeline (tied embedding) as on one
 *   device, up to rounding;
 * - faults: a killed stage is named (and the doctor's verdict said); a
 *   NaN loss stops every stage with exit 1, the last good checkpoint
 *   kept; nothing left behind;
 * - bad configurations are one-line errors with exit 2;
 * - the ranks of `tandem launch` and of mpirun (shm and MPI backends) run
 *   the same pipeline as forked ranks: the same checkpoint;
 * - CUDA-emulated devices (cuda/ built, no GPU) train the host devices'
 *   pipeline bit for bit. What this does not test: CUDA, NCCL. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/mesh_doctor_util.h"
#include "tests/mpi_test_util.h"
#include "tests/safety_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

#define MLP "--model", "mlp:20-24-16-12-5"
#define SYN "--data", "synthetic", "--synthetic-size", "200"

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "pp_cli"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(pp_cli, .init = setup, .fini = teardown, .timeout = 240);

static void path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s.safetensors", g_dir, name);
}

/* pp (S, M, schedule) at --batch B vs single --batch B/M --grad-accum M:
 * the two checkpoints after 2 epochs of 200 samples (the last batch
 * short) are the same bytes. */
static void same_as_accum(const char *model, int S, int M, const char *sched, int B)
{
    static cli_result r;
    char pp[128], one[128], dev[16], sm[8], mm[8], bb[8], mb[8];
    path(pp, sizeof pp, "pp");
    path(one, sizeof one, "single");
    snprintf(dev, sizeof dev, "cpu:%d", S);
    snprintf(sm, sizeof sm, "%d", S);
    snprintf(mm, sizeof mm, "%d", M);
    snprintf(bb, sizeof bb, "%d", B);
    snprintf(mb, sizeof mb, "%d", B / M);
    CLI(&r, "train", "--mode", "pp", "--device", dev, "--stages", sm, "--microbatches", mm,
        "--schedule", sched, "--model", model, SYN, "--batch", bb, "--epochs", "2", "--no-eval",
        "--quiet", "--save", pp);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "single", "--model", model, SYN, "--batch", mb, "--grad-accum",
        mm, "--epochs", "2", "--no-eval", "--quiet", "--save", one);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(pp, one), "%s S=%d M=%d %s B=%d: pp's checkpoint differs from "
              "single --grad-accum %d's", model, S, M, sched, B, M);
}

Test(pp_cli, mlp_equals_single_with_grad_accum_bit_for_bit)
{
    static const char *sched[] = {"gpipe", "1f1b"};
    for (int k = 0; k < 2; k++) {
        same_as_accum("mlp:20-24-16-12-5", 2, 4, sched[k], 32);
        same_as_accum("mlp:20-24-16-12-5", 3, 3, sched[k], 33);
        same_as_accum("mlp:20-24-16-12-5", 4, 2, sched[k], 16);
    }
    same_as_accum("mlp:20-24-16-12-5", 2, 1, "1f1b", 16);
}

Test(pp_cli, cnn_equals_single_with_grad_accum_bit_for_bit)
{
    same_as_accum("cnn", 2, 2, "gpipe", 16);
    same_as_accum("cnn", 3, 4, "1f1b", 16);
}

/* Two replicas of a two-stage pipeline (DDP over the dp dimension) end
 * each epoch with one device's printed losses and accuracy. */
Test(pp_cli, mesh_dp2_pp2_ends_the_epochs_as_one_device)
{
    static cli_result r;
    char one[2][256], mesh[2][256];
    CLI(&r, "train", "--mode", "single", MLP, SYN, "--batch", "8", "--grad-accum", "4",
        "--epochs", "2", "--quiet");
    expect(&r, 0, "epoch 2/2");
    epoch_result(r.out, "epoch 1/2", one[0], sizeof one[0]);
    epoch_result(r.out, "epoch 2/2", one[1], sizeof one[1]);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
        "--batch", "32", "--microbatches", "4", "--epochs", "2", "--quiet");
    expect(&r, 0, "x 2 replicas (DDP over the dp dimension)");
    expect(&r, 0, "gradients summed over the replicas by DDP");
    epoch_result(r.out, "epoch 1/2", mesh[0], sizeof mesh[0]);
    epoch_result(r.out, "epoch 2/2", mesh[1], sizeof mesh[1]);
    cr_assert_str_eq(mesh[0], one[0]);
    cr_assert_str_eq(mesh[1], one[1]);
}

/* stage s's optimizer MiB as the summary prints it */
static double stage_optim_mib(const char *out, int s)
{
    char want[64];
    snprintf(want, sizeof want, "  stage %d memory: ", s);
    const char *l = strstr(out, want);
    cr_assert(l, "no %s in:\n%s", want, out);
    const char *o = strstr(l, "optimizer ");
    cr_assert(o, "%s", l);
    return atof(o + strlen("optimizer "));
}

/* ZeRO-1 over the dp dimension (--sharding optimizer): each replica of
 * a stage steps its half of the stage from the all-reduced gradients
 * and the halves are gathered back, which is the step DDP x pp takes:
 * the same checkpoint bit for bit (parameters and the optimizer state
 * gathered from the replicas' slices), SGD with momentum and AdamW, a
 * stage whose parameter count is odd (the padded chunk) included; each
 * rank holds half the optimizer state. */
Test(pp_cli, zero1_on_the_dp_dimension_is_ddp_x_pp_bit_for_bit)
{
    static cli_result r;
    static const char *const optims[] = {"sgd", "adamw"};
    for (int i = 0; i < 2; i++) {
        char ddp[128], z1[128];
        path(ddp, sizeof ddp, "mesh-ddp");
        path(z1, sizeof z1, "mesh-zero1");
        /* stage 1 of mlp:20-24-16-12-5 has 669 parameters: an odd count */
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
            "--batch", "32", "--microbatches", "4", "--epochs", "2", "--optim", optims[i],
            "--quiet", "--save", ddp);
        expect(&r, 0, "epoch 2/2");
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
            "--batch", "32", "--microbatches", "4", "--epochs", "2", "--optim", optims[i],
            "--sharding", "optimizer", "--quiet", "--save", z1);
        expect(&r, 0, "ZeRO-1: each replica steps 1/D of a stage");
        cr_assert(cli_same_file(ddp, z1), "%s: ZeRO-1's checkpoint differs from DDP x pp's",
                  optims[i]);
    }
    /* a model large enough for the printed MiB: half the state per rank */
    double full[2], half[2];
    const char *big[] = {"--model", "mlp:200-256-128-10", "--optim", "adamw"};
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", big[0], big[1],
        big[2], big[3], SYN, "--batch", "32", "--epochs", "1", "--max-steps", "1");
    expect(&r, 0, "epoch 1/1");
    for (int s = 0; s < 2; s++) full[s] = stage_optim_mib(r.out, s);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", big[0], big[1],
        big[2], big[3], SYN, "--batch", "32", "--epochs", "1", "--max-steps", "1", "--sharding",
        "optimizer");
    expect(&r, 0, "optimizer state per stage and replica is 1/D");
    for (int s = 0; s < 2; s++) {
        half[s] = stage_optim_mib(r.out, s);
        cr_assert(full[s] > 0.1 && fabs(half[s] - full[s] / 2) <= 0.0015,
                  "stage %d: optimizer %.3f MiB with ZeRO-1, %.3f MiB without", s, half[s],
                  full[s]);
    }
}

/* ZeRO-1's resume: --save writes the file every mode writes (each
 * optimizer state gathered over the replicas' chunks); --resume cuts it
 * into this run's chunks again. 20 steps on dp=2 x pp=2 with ZeRO-1 and
 * 20 more resumed from their file equal 40 straight, bit for bit (AdamW:
 * its moments and step count must come back); the same file resumed on
 * dp=4 x pp=2 with ZeRO-1 (chunks of a quarter) equals DDP x pp's resume
 * of it on dp=4 (the unsharded step at that size) bit for bit; and a
 * stage killed in epoch 2 under --max-restarts 1 restarts every rank
 * from the epoch 1 file and ends on the uninterrupted run's bytes; the
 * GPT's 20 + 20 equal its 40 too (AdamW). */
Test(pp_cli, zero1_resumes_bit_for_bit_at_any_dp_size)
{
    static cli_result r;
    char straight[128], half[128], resumed[128], d4z[128], d4p[128];
    path(straight, sizeof straight, "z1-40");
    path(half, sizeof half, "z1-20");
    path(resumed, sizeof resumed, "z1-20-20");
    path(d4z, sizeof d4z, "z1-dp4");
    path(d4p, sizeof d4p, "ddp-dp4");
#define Z1_RUN "train", "--mode", "pp", MLP, "--data", "synthetic", "--synthetic-size", "320", \
               "--batch", "32", "--optim", "adamw", "--no-eval", "--quiet"
    CLI(&r, Z1_RUN, "--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding", "optimizer",
        "--epochs", "4", "--save", straight);
    expect(&r, 0, "epoch 4/4");
    CLI(&r, Z1_RUN, "--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding", "optimizer",
        "--epochs", "2", "--save", half);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, Z1_RUN, "--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding", "optimizer",
        "--epochs", "4", "--resume", half, "--save", resumed);
    expect(&r, 0, "epoch 4/4");
    cr_assert(cli_same_file(straight, resumed), "20 + 20 resumed steps differ from 40");
    CLI(&r, Z1_RUN, "--device", "cpu:8", "--mesh", "dp=4,pp=2", "--sharding", "optimizer",
        "--epochs", "4", "--resume", half, "--save", d4z);
    expect(&r, 0, "epoch 4/4");
    CLI(&r, Z1_RUN, "--device", "cpu:8", "--mesh", "dp=4,pp=2", "--epochs", "4", "--resume",
        half, "--save", d4p);
    expect(&r, 0, "epoch 4/4");
    cr_assert(cli_same_file(d4z, d4p), "ZeRO-1 on dp=4 resumed from dp=2's file differs from "
              "DDP x pp's");
#undef Z1_RUN
    /* the GPT: its tied embedding's state comes back on both ends */
    char text[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    cli_write_words(text);
#define Z1_GPT "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", "--model", \
               "gpt:2-16-4-8", "--data", text, "--batch", "8", "--max-steps", "10", \
               "--no-eval", "--quiet", "--sharding", "optimizer"
    CLI(&r, Z1_GPT, "--epochs", "4", "--save", straight);
    expect(&r, 0, "epoch 4/4");
    CLI(&r, Z1_GPT, "--epochs", "2", "--save", half);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, Z1_GPT, "--epochs", "4", "--resume", half, "--save", resumed);
    expect(&r, 0, "epoch 4/4");
#undef Z1_GPT
    cr_assert(cli_same_file(straight, resumed), "GPT: 20 + 20 resumed steps differ from 40");
    char a[128], b[128];
    path(a, sizeof a, "z1-restarted");
    path(b, sizeof b, "z1-straight");
    setenv("TANDEM_RUN_ID", "pp-cli-zero1-restart", 1);
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "1:10", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
        "--batch", "32", "--epochs", "2", "--quiet", "--sharding", "optimizer",
        "--max-restarts", "1", "--save", a);
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 0, "tandem train: rank 1: test fault: SIGKILL before step 10");
    expect(&r, 0, "every rank starts again from");
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
        "--batch", "32", "--epochs", "2", "--quiet", "--sharding", "optimizer", "--save", b);
    unsetenv("TANDEM_RUN_ID");
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(a, b), "the restarted ZeRO-1 run differs");
}

/* 1 when some "aborted by [job ]rank N: ..." of out carries the test
 * hook's reason directly (the next "aborted by" or the line's end comes
 * after "test hook") and every such one has N == rank. */
static int hook_aborts_name(const char *out, int rank)
{
    int seen = 0;
    for (const char *p = strstr(out, "aborted by "); p; p = strstr(p + 1, "aborted by ")) {
        const char *q = p + strlen("aborted by ");
        if (!strncmp(q, "job ", 4)) q += 4;
        int n = -1;
        if (sscanf(q, "rank %d: ", &n) != 1) continue;
        const char *eol = strchr(q, '\n'), *next = strstr(q, "aborted by ");
        const char *hook = strstr(q, "test hook");
        if (!hook || (eol && hook > eol) || (next && hook > next)) continue;
        if (n != rank) return 0;
        seen = 1;
    }
    return seen;
}

/* A ZeRO-1 rank that fails in its step (before the gather over the dp
 * dimension) or in its save (before the state gathers) stops every stage
 * and replica at once, naming itself: none waits for it until the
 * collective timeout (300 s here; the bound below, scaled for the
 * sanitizers, stays under it). Planted through the test hook
 * TANDEM_TEST_PP_ZERO1_FAIL (tools/rank_pp.c). */
Test(pp_cli, a_zero1_failure_stops_the_dp_peers_at_once)
{
    static cli_result r;
    static const struct { const char *hook; int rank; const char *said; } cases[] = {
        {"step:1:3", 1, "test hook: ZeRO-1 step 3 fails"},
        {"step:2:3", 2, "test hook: ZeRO-1 step 3 fails"},
        {"save:3", 3, "test hook: ZeRO-1 save fails"},
        {"save:0", 0, "test hook: ZeRO-1 save fails"},
    };
    char z1[128];
    path(z1, sizeof z1, "zero1-fail");
    setenv("TMPDIR", g_dir, 1);   /* the flight-recorder dumps */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        setenv("TANDEM_TEST_PP_ZERO1_FAIL", cases[i].hook, 1);
        int64_t t0 = mpi_t_now_ms();
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
            "--batch", "32", "--microbatches", "4", "--epochs", "1", "--max-steps", "4",
            "--sharding", "optimizer", "--timeout", "300", "--quiet", "--save", z1);
        int64_t ms = mpi_t_now_ms() - t0;
        unsetenv("TANDEM_TEST_PP_ZERO1_FAIL");
        char said[128];
        snprintf(said, sizeof said, "rank %d: %s", cases[i].rank, cases[i].said);
        expect(&r, 1, said);
        /* the others stopped with its reason, not a timeout of their own,
         * and every abort that carries it names it (by job rank) */
        cr_assert(hook_aborts_name(r.out, cases[i].rank), "%s: an abort names another rank "
                  "than %d, or none names it:\n%s", cases[i].hook, cases[i].rank, r.out);
        cr_assert(!strstr(r.out, "did not complete within"), "%s: %s", cases[i].hook, r.out);
        cr_assert_lt(ms, tu_scaled_ms(10000), "%s: the run took %lld ms to stop:\n%s",
                     cases[i].hook, (long long)ms, r.out);
    }
    unsetenv("TMPDIR");
}

/* The summary has every stage's phases and memory. */
Test(pp_cli, the_summary_has_every_stage)
{
    static cli_result r;
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:3", "--schedule", "gpipe", MLP, SYN,
        "--batch", "32", "--epochs", "1", "--quiet");
    expect(&r, 0, "pp gpipe, 3 stages, 4 micro-batches of 8");
    expect(&r, 0, "ideal bubble (S-1)/(M+S-1) = 33.3%");
    for (int s = 0; s < 3; s++) {
        char want[64];
        snprintf(want, sizeof want, "  stage %d (layers ", s);
        expect(&r, 0, want);
        snprintf(want, sizeof want, "  stage %d memory: parameters ", s);
        expect(&r, 0, want);
    }
    expect(&r, 0, "peak activations");
}

Test(pp_cli, checkpoints_go_between_every_mode_and_resume_bit_for_bit)
{
    static cli_result r;
    char p1[128], p2[128], whole[128], s1[128], s2[128], d1[128], x[128];
    path(p1, sizeof p1, "pp-e1");
    path(p2, sizeof p2, "pp-e2");
    path(whole, sizeof whole, "pp-whole");
    path(s1, sizeof s1, "single-resumed");
    path(s2, sizeof s2, "single-whole");
    path(d1, sizeof d1, "ddp-e1");
    path(x, sizeof x, "other");
    /* a pipeline of 2 stages, 1 epoch; resumed by 3 stages in GPipe for
     * the second: the same bytes as 2 epochs in one pipeline run */
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", MLP, SYN, "--batch", "32", "--epochs",
        "1", "--quiet", "--save", p1);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:3", "--schedule", "gpipe", MLP, SYN,
        "--batch", "32", "--epochs", "2", "--quiet", "--resume", p1, "--save", p2);
    expect(&r, 0, "resumed");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", MLP, SYN, "--batch", "32", "--epochs",
        "2", "--quiet", "--save", whole);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(p2, whole), "a resumed pipeline differs from an uninterrupted one");
    /* one device resumes the pipeline's file: as one device throughout */
    CLI(&r, "train", "--mode", "single", MLP, SYN, "--batch", "8", "--grad-accum", "4",
        "--epochs", "2", "--quiet", "--resume", p1, "--save", s1);
    expect(&r, 0, "resumed");
    CLI(&r, "train", "--mode", "single", MLP, SYN, "--batch", "8", "--grad-accum", "4",
        "--epochs", "2", "--quiet", "--save", s2);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(s1, s2));
    cr_assert(cli_same_file(s1, whole));
    /* ddp and fsdp load it */
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", MLP, SYN, "--batch", "32",
        "--epochs", "2", "--quiet", "--resume", p1, "--save", x);
    expect(&r, 0, "resumed");
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", MLP, SYN, "--batch", "32",
        "--epochs", "2", "--quiet", "--resume", p1, "--save", x);
    expect(&r, 0, "resumed");
    /* a pipeline resumes ddp's file, as ddp would go on */
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", MLP, SYN, "--batch", "32",
        "--epochs", "1", "--quiet", "--save", d1);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", MLP, SYN, "--batch", "32",
        "--epochs", "2", "--quiet", "--resume", d1, "--save", x);
    expect(&r, 0, "resumed");
    expect(&r, 0, "epoch 2/2");
}

/* A stage killed in epoch 2 is named, every stage restarts from the epoch
 * 1 checkpoint, and the run ends with the uninterrupted run's file. */
Test(pp_cli, max_restarts_resumes_a_killed_stage_bit_for_bit)
{
    static cli_result r;
    char a[128], b[128];
    path(a, sizeof a, "restarted");
    path(b, sizeof b, "straight");
    /* one run id for both: a checkpoint records its run's (docs/DEBUGGING.md) */
    setenv("TANDEM_RUN_ID", "pp-cli-restart", 1);
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "1:10", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:3", MLP, SYN, "--batch", "32",
        "--epochs", "2", "--quiet", "--max-restarts", "1", "--save", a);
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 0, "tandem train: rank 1: test fault: SIGKILL before step 10");
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:3", MLP, SYN, "--batch", "32",
        "--epochs", "2", "--quiet", "--save", b);
    unsetenv("TANDEM_RUN_ID");
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(a, b));
}

/* The GPT's blocks split over 3 stages, its tied embedding on the first
 * and the last: the same training as one device up to rounding; its
 * checkpoint samples. */
Test(pp_cli, gpt_trains_through_the_pipeline_as_on_one_device)
{
    static cli_result r;
    char text[128], ck[128];
    double t1, v1, t2, v2;
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    path(ck, sizeof ck, "gpt");
    cli_write_words(text);
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "single", "--batch",
        "8", "--epochs", "1", "--max-steps", "6", "--quiet");
    expect(&r, 0, "val loss");
    cli_epoch_losses(r.out, "epoch 1/1", &t1, &v1);
    CLI(&r, "train", "--model", "gpt:2-16-2-8", "--data", text, "--mode", "pp", "--device",
        "cpu:3", "--microbatches", "1", "--batch", "8", "--epochs", "1", "--max-steps", "6",
        "--quiet", "--save", ck);
    expect(&r, 0, "val loss");
    cli_epoch_losses(r.out, "epoch 1/1", &t2, &v2);
    cr_assert(fabs(t1 - t2) < 2e-4 && fabs(v1 - v2) < 2e-4,
              "pipeline %.4f/%.4f vs one device %.4f/%.4f", t2, v2, t1, v1);
    CLI(&r, "sample", "--resume", ck, "--tokens", "8", "--prompt", "a");
    cr_assert_eq(r.code, 0, "%s", r.out);
}

Test(pp_cli, a_killed_stage_is_named_with_the_doctors_verdict)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "1:3", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:3", MLP, SYN, "--batch", "32",
        "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 1: test fault: SIGKILL before step 3");
    expect(&r, 1, "rank 1 (pid");
    expect(&r, 1, "killed by signal 9");
    expect(&r, 1, "from stage 1");
    expect(&r, 1, "tandem train: doctor: DIED: stage 1 (rank 1) never sent ");
    expect(&r, 1, "it was killed by signal 9");
}

/* A stage that stops (SIGSTOP) is named by the doctor as the one the
 * others waited on, though the first to time out is a stage before it. */
Test(pp_cli, a_stopped_stage_is_named_with_the_doctors_verdict)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "2:3:STOP", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:3", "--timeout", "3", MLP, SYN,
        "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 2: test fault: SIGSTOP before step 3");
    expect(&r, 1, "tandem train: doctor: STALLED: stage 2 (rank 2) never sent grad mb 0 to "
                  "stage 1 (rank 1)");
    expect(&r, 1, "behind it, stage 0 (rank 0) waited");
    /* the SIGKILL after the grace period was the teardown's */
    cr_expect(!strstr(r.out, "DIED"), "a stopped stage called dead:\n%s", r.out);
}

/* With two replicas, a killed stage of either is named. */
Test(pp_cli, a_killed_stage_of_a_mesh_is_named)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "2:3", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP, SYN,
        "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 2: test fault: SIGKILL before step 3");
    expect(&r, 1, "tandem train: doctor: DIED: ");
    cr_assert(strstr(r.out, "doctor: DIED: stage 0 (rank 2) never sent act mb 0") ||
              strstr(r.out, "doctor: DIED: rank 2 was killed"), "%s", r.out);
}

/* A stopped stage of a mesh is STALLED, named with its coordinates: not
 * the stage that exited after its dump said why (the abort that followed
 * the others' timeouts waiting, through it, for the stopped one). */
Test(pp_cli, a_stopped_stage_of_a_mesh_is_named_stalled_with_its_coordinates)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "2:3:STOP", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", "--timeout",
        "3", MLP, SYN, "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 2: test fault: SIGSTOP before step 3");
    expect(&r, 1, "tandem train: rank 2 (stopped) is at dp 1, pp 0, tp 0 of the mesh dp=2 x "
                  "pp=2 x tp=1");
    expect(&r, 1, "tandem train: doctor: STALLED: ");
    cr_expect(!strstr(r.out, "doctor: DIED") && !strstr(r.out, "doctor (after the teardown): "
                                                               "DIED"), "%s", r.out);
    mesh_expect_stages(r.out, 2, 1);
    static cli_result d;
    mesh_doctor(&r, &d);
    expect(&d, 5, "verdict: STALLED: ");
    expect(&d, 5, "(rank 2)");
    mesh_expect_stages(d.out, 2, 1);
    cr_expect(!strstr(d.out, "comm split"), "%s", d.out);
}

/* lr 1000 diverges: every stage stops with the step named, the good
 * checkpoint kept. */
Test(pp_cli, a_nan_loss_stops_every_stage)
{
    static cli_result r;
    char ck[128];
    path(ck, sizeof ck, "good");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--model", "mlp:784-16-10", "--data", "synthetic", "--synthetic-size", "1200", "--batch", "64",
        "--epochs", "1", "--quiet", "--save", ck);
    expect(&r, 0, "epoch 1/1");
    size_t n0 = 0, n1 = 0;
    char *good = su_slurp(ck, &n0);
    setenv("TMPDIR", g_dir, 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--model", "mlp:784-16-10", "--data", "synthetic", "--synthetic-size", "1200", "--batch", "64",
        "--epochs", "4", "--lr", "1000", "--quiet", "--resume", ck, "--save", ck);
    unsetenv("TMPDIR");
    expect(&r, 1, "at step 2");   /* epoch 2: its steps are 20..38 (19 an epoch) */
    cr_assert(strstr(r.out, "loss is NaN") || strstr(r.out, "loss is +inf"), "%s", r.out);
    cr_assert(!strstr(r.out, "epoch 2/4:"), "%s", r.out);
    char *after = su_slurp(ck, &n1);
    cr_assert(n0 == n1 && !memcmp(good, after, n0), "the good checkpoint was replaced");
    free(good);
    free(after);
}

Test(pp_cli, bad_configurations_are_one_line_errors)
{
    static cli_result r;
    static const struct {
        const char *a[8];
        const char *says;
    } bad[] = {
        {{"--device", "cpu:4", "--stages", "4", "--model", "mlp:20-12-5"},
         "4 stages but the model has 2 pipeline layers"},
        {{"--device", "cpu:2", "--microbatches", "0", MLP}, "--microbatches"},
        {{"--device", "cpu:2", "--split", "0,7", MLP}, "out of range"},
        {{"--device", "cpu:3", "--split", "0,2,1", MLP}, "must increase"},
        {{"--device", "cpu:2", "--split", "1,2", MLP}, "--split"},
        {{"--device", "cpu:4", "--mesh", "dp=2,pp=3", MLP}, "6 ranks"},
        {{"--device", "cpu:4", "--stages", "3", MLP}, "does not divide the 4 devices"},
        {{"--device", "cpu:2", "--schedule", "zigzag", MLP}, "--schedule"},
        {{"--device", "cpu:2", "--grad-accum", "2", MLP}, "--microbatches 2 instead"},
        {{"--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding", "full"},
         "--mode pp shards only the optimizer"},
        {{"--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding", "grad_op"},
         "it needs them whole until the last one (DeepSpeed refuses ZeRO-2 with pipelines"},
        {{"--device", "cpu:2", "--sharding", "optimizer", MLP}, "with D >= 2 (dp is 1)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *const *a = bad[i].a;
        CLI(&r, "train", "--mode", "pp", SYN, a[0], a[1], a[2], a[3], a[4] ? a[4] : "--quiet",
            a[5] ? a[5] : "--quiet", a[6] ? a[6] : "--quiet", a[7] ? a[7] : "--quiet");
        expect(&r, 2, bad[i].says);
        cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "more than one line:\n%s",
                  r.out);
    }
    CLI(&r, "train", "--mode", "single", "--stages", "2", MLP, SYN);
    expect(&r, 2, "apply to --mode pp");
}

/* The ranks of `tandem launch` and of mpirun (over shm and over MPI
 * itself) train the pipeline forked ranks train: the same bytes. */
Test(pp_cli, launched_and_mpi_ranks_write_the_forked_runs_checkpoint)
{
    static cli_result r;
    char forked[128], other[128];
    path(forked, sizeof forked, "forked");
    path(other, sizeof other, "other");
#define PP_JOB "train", "--mode", "pp", "--device", "cpu:2", "--model", "mlp:20-24-16-12-5", \
               SYN, "--batch", "32", "--epochs", "1", "--quiet"
    CLI(&r, PP_JOB, "--save", forked);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), PP_JOB, "--save", other);
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(forked, other), "tandem launch's pipeline differs");
    if (!tdm_comm_init_mpi || !mpi_t_have_mpirun()) return;   /* no MPI here: the rest */
    static const char *const backends[] = {"shm", "mpi"};
    for (int b = 0; b < 2; b++) {
        unlink(other);
        const char *args[] = {PP_JOB, "--backend", backends[b], "--save", other, NULL};
        mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .tcp = 1, .timeout_s = 120};
        mpi_t_run(&r, &j);
        expect(&r, 0, "2 MPI ranks on cpu:2, pipeline of 2 stages");
        cr_assert(cli_same_file(forked, other), "mpirun --backend %s: the pipeline differs",
                  backends[b]);
    }
#undef PP_JOB
}

/* compare --modes single,pp: the pipeline's section: its throughput, the
 * per-stage phases and bubble, the bitwise verdict against one device
 * with --grad-accum M (MLP, CNN; the GPT within its bound), the
 * per-stage memory, and a trace with each stage's F and B of every
 * micro-batch. */
Test(pp_cli, compare_has_the_pipelines_section)
{
    static cli_result r;
    char trace[128];
    snprintf(trace, sizeof trace, "%s/trace.json", g_dir);
    static const char *const models[] = {"mlp:20-24-16-12-5", "cnn"};
    for (int k = 0; k < 2; k++) {
        CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:2", "--model", models[k],
            "--data", "synthetic", "--steps", "4", "--warmup", "1", "--batch", "16",
            "--schedule", k ? "gpipe" : "1f1b", "--trace", trace);
        expect(&r, 0, "Pipeline: pp(2)");
        expect(&r, 0, "BITWISE IDENTICAL");
        expect(&r, 0, "bubble share");
        expect(&r, 0, "vs (S-1)/(M+S-1) = 20.0%");
        expect(&r, 0, "pipeline memory per stage");
        size_t n = 0;
        char *t = su_slurp(trace, &n);
        cr_assert(t && strstr(t, "\"name\": \"stage 1\"") && strstr(t, "\"name\": \"F3\"") &&
                  strstr(t, "\"name\": \"B0\""), "%s", t ? t : "(no trace)");
        free(t);
    }
    char text[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    cli_write_words(text);
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:3", "--model", "gpt:2-16-2-8",
        "--data", text, "--steps", "3", "--warmup", "1", "--batch", "8", "--microbatches", "2");
    expect(&r, 0, "the GPT's tied embedding");
    expect(&r, 0, "-> PASS");
    /* --sweep: a PP column, a pipeline of k stages at k devices */
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:2", "--model",
        "mlp:20-24-16-12-5", "--data", "synthetic", "--steps", "3", "--warmup", "1", "--batch",
        "16", "--sweep", "1,2");
    expect(&r, 0, "DDP  speed-up           PP  speed-up");
    cr_assert(strstr(r.out, "\n  1 ") && strstr(r.out, "\n  2 "), "%s", r.out);
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:2", "--stages", "3", "--data",
        "synthetic");
    expect(&r, 2, "--stages 3 but --device cpu:2 has 2 devices");
    CLI(&r, "compare", "--device", "cpu:2", "--microbatches", "2", "--data", "synthetic");
    expect(&r, 2, "apply to --modes ...,pp");
}

Test(pp_cli, emulated_cuda_stages_write_the_host_stages_checkpoint)
{
    CU_NEED_BACKEND();
    static cli_result r;
    char host[128], emu[128];
    path(host, sizeof host, "host");
    path(emu, sizeof emu, "emu");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", MLP, SYN, "--batch", "32",
        "--epochs", "1", "--quiet", "--save", host);
    expect(&r, 0, "epoch 1/1");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    CLI(&r, "train", "--mode", "pp", "--device", "cuda", MLP, SYN, "--batch", "32",
        "--epochs", "1", "--quiet", "--save", emu);
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&r, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)");
    cr_assert(cli_same_file(host, emu), "emulated stages differ from host stages");
}

/* The memory plan covers a pipeline: the whole model once per replica
 * (each stage its layers), the activations of the micro-batches a stage
 * holds; a run that cannot fit is refused before any rank starts. */
Test(pp_cli, the_memory_check_covers_the_pipeline)
{
    static cli_result r;
    setenv("TANDEM_TEST_MEM_LIMIT", "268435456", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--model", "mlp:784-4096-4096-10",
        SYN, "--epochs", "1");
    expect(&r, 1, "tandem train: memory: this run needs at least ");
    expect(&r, 1, "1 replica x (parameters 76.4");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--model", "mlp:784-512-10", SYN,
        "--epochs", "1", "--quiet");
    unsetenv("TANDEM_TEST_MEM_LIMIT");
    expect(&r, 0, "epoch 1/1");
}

/* compare runs the pipeline's stages with the memory levers (tests/
 * test_cli_plan.c), but not tensor-parallel stages (nor does train): it
 * refuses them there rather than running them in fp32 beside modes in
 * bf16; --clip-grad-norm clips the pp row only, and is refused beside
 * the other modes. */
Test(pp_cli, compare_refuses_levers_with_tp_stages)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2",
        "--model", "mlp:20-24-16-12-5", "--data", "synthetic", "--steps", "2", "--precision",
        "bf16");
    expect(&r, 2, "not with tensor-parallel stages (--mesh pp=2,tp=2)");
    CLI(&r, "compare", "--modes", "single,ddp,pp", "--device", "cpu:2", "--model",
        "mlp:20-24-16-12-5", "--data", "synthetic", "--steps", "2", "--clip-grad-norm", "1");
    expect(&r, 2, "--clip-grad-norm runs in the pp row");
    CLI(&r, "compare", "--modes", "single", "--device", "cpu:2", "--model",
        "mlp:20-24-16-12-5", "--data", "synthetic", "--steps", "2", "--clip-grad-norm", "1");
    expect(&r, 2, "--clip-grad-norm needs --modes pp");
}
