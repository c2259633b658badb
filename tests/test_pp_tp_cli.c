/* tests/test_pp_tp_cli.c: `tandem train --mode pp --mesh dp=D,pp=S,tp=N`:
 * a pipeline whose stages are tensor-parallel (tools/rank_pptp.h), on
 * host devices.
 * - equivalence: dp=2,pp=2,tp=2 on 8 devices and pp=2,tp=2 on 4 write,
 *   after 1 step and after 10, the checkpoint one device writes with
 *   --grad-accum M over the same micro-batches, within TOL (the
 *   row-parallel sums and DDP's sum over the replicas add in another
 *   order: measured 7.5e-9 after 1 step and 6.0e-8 after 10;
 *   checked at 1e-5, tests/test_tp_cli.c's bound);
 * - checkpoints: the pp-tp file resumes in single, a single file in
 *   pp-tp, each as the uninterrupted run within TOL;
 * - faults: a killed rank is named with its (dp, pp, tp) coordinates,
 *   exit 1, nothing left behind, and by the doctor with its own stage,
 *   never at the splits' all_gather; a stopped one (SIGSTOP) is named
 *   STALLED, with its coordinates;
 * - CUDA-emulated devices (cuda/ built, no GPU) write the host ranks'
 *   checkpoint bit for bit (what this does not test: CUDA, NCCL);
 * - ZeRO-1 on the dp dimension: the unsharded 3-D mesh's checkpoint
 *   byte for byte, the dp dimension's bytes per step the plan's exactly,
 *   half the optimizer state per rank;
 * - bad meshes (a product that is not the device count, a width the
 *   group does not divide, the CNN, more stages than layers, ZeRO-1
 *   without replicas, ZeRO-2, a pipeline under --mode tp) are one line
 *   and exit 2. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/mesh_doctor_util.h"
#include "tests/test_util.h"

#define MODEL "mlp:20-24-16-12-5"
#define MLP "--model", MODEL
#define SYN "--data", "synthetic", "--synthetic-size", "200"
#define TOL 1e-5

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "pp_tp_cli"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(pp_tp_cli, .init = setup, .fini = teardown, .timeout = 240);

static void path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s.safetensors", g_dir, name);
}

static double ck_diff(const char *a, const char *b) { return ck_diff_of(MODEL, a, b); }

/* One device: the pipeline's step is --batch 32 cut into 4 micro-batches
 * of 8, which is --batch 8 --grad-accum 4. --max-steps caps each epoch. */
static void single(const char *save, const char *epochs, const char *steps, const char *resume)
{
    static cli_result r;
    const char *rs = resume ? "--resume" : "--quiet", *rv = resume ? resume : "--quiet";
    CLI(&r, "train", "--mode", "single", MLP, SYN, "--batch", "8", "--grad-accum", "4",
        "--epochs", epochs, "--max-steps", steps, "--no-eval", "--quiet", "--save", save, rs,
        rv);
    expect(&r, 0, "/");
}

/* Stages fc1-fc2 and fc3-fc4: both tensor-parallel (column, row). */
static void pptp(const char *save, const char *dev, const char *mesh, const char *epochs,
                 const char *steps, const char *resume)
{
    static cli_result r;
    const char *rs = resume ? "--resume" : "--quiet", *rv = resume ? resume : "--quiet";
    CLI(&r, "train", "--mode", "pp", "--device", dev, "--mesh", mesh, "--split", "0,2", MLP,
        SYN, "--batch", "32", "--epochs", epochs, "--max-steps", steps, "--no-eval", "--quiet",
        "--save", save, rs, rv);
    expect(&r, 0, "x tp 2 (fc1 column, fc2 row, fc3 column, fc4 row)");
}

Test(pp_tp_cli, dp_x_pp_x_tp_writes_single_devices_checkpoint_after_1_and_10_steps)
{
    static const struct {
        const char *epochs, *steps;
    } runs[] = {{"1", "1"}, {"2", "5"}};
    for (int k = 0; k < 2; k++) {
        char one[128], m8[128], m4[128];
        path(one, sizeof one, "single");
        path(m8, sizeof m8, "dp2pp2tp2");
        path(m4, sizeof m4, "pp2tp2");
        single(one, runs[k].epochs, runs[k].steps, NULL);
        pptp(m8, "cpu:8", "dp=2,pp=2,tp=2", runs[k].epochs, runs[k].steps, NULL);
        pptp(m4, "cpu:4", "pp=2,tp=2", runs[k].epochs, runs[k].steps, NULL);
        double d8 = ck_diff(one, m8), d4 = ck_diff(one, m4);
        cr_assert(d8 <= TOL && d4 <= TOL, "after %s x %s steps: dp=2,pp=2,tp=2 %g, pp=2,tp=2 %g",
                  runs[k].epochs, runs[k].steps, d8, d4);
    }
}

/* The printed optimizer MiB of stage s ("  stage s memory: ... optimizer X"). */
static double stage_optim_mib(const char *out, int s)
{
    char want[32];
    snprintf(want, sizeof want, "  stage %d memory:", s);
    const char *l = strstr(out, want);
    cr_assert(l, "no %s in:\n%s", want, out);
    const char *o = strstr(l, "optimizer ");
    cr_assert(o, "%s", l);
    return atof(o + strlen("optimizer "));
}

/* ZeRO-1 on the dp dimension of the 3-D mesh (--mesh dp=2,pp=2,tp=2
 * --sharding optimizer): each replica of a stage's tensor-parallel rank
 * steps its half of the rank's narrow slice from DDP's all-reduced
 * gradients and the halves are all-gathered back: the unsharded 3-D
 * mesh's checkpoint bit for bit (SGD with momentum, AdamW), the
 * optimizer state gathered over dp, the pipeline and stage 0's group.
 * The dp dimension's bytes of rank 0's last step, counted by its
 * communicator, are the plan's exactly: stage 0 of the narrow MLP holds
 * fc1's column half (12 x 20 and 12 floats, padded to 16) and fc2's row
 * half (16 x 12 and 16): n = 464; DDP all-reduces them and its check
 * tail of 192 floats (ddp/reducer_impl.h), the loss adds one double,
 * and ZeRO-1 all-gathers 2 chunks of 232. Each rank's optimizer state
 * is half the unsharded mesh's (a larger model for the printed MiB). */
Test(pp_tp_cli, zero1_on_the_dp_dimension_is_the_3d_meshs_bit_for_bit)
{
    static cli_result r;
    static const char *const optims[] = {"sgd", "adamw"};
    for (int i = 0; i < 2; i++) {
        char plain[128], z1[128];
        path(plain, sizeof plain, "mesh3d");
        path(z1, sizeof z1, "mesh3d-zero1");
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2",
            "--split", "0,2", MLP, SYN, "--batch", "32", "--epochs", "2", "--max-steps", "5",
            "--optim", optims[i], "--momentum", "0.9", "--no-eval", "--quiet", "--save", plain);
        expect(&r, 0, "/");
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2",
            "--split", "0,2", MLP, SYN, "--batch", "32", "--epochs", "2", "--max-steps", "5",
            "--optim", optims[i], "--momentum", "0.9", "--no-eval", "--sharding", "optimizer",
            "--save", z1);
        expect(&r, 0, "ZeRO-1: each replica steps 1/D of a stage");
        expect(&r, 0, "all-reduces of 2632 bytes");
        expect(&r, 0, "all-gathers of 1856 bytes (the replicas' chunks of 232 elements)");
        cr_assert(cli_same_file(plain, z1), "%s: ZeRO-1's checkpoint differs from the 3-D "
                  "mesh's", optims[i]);
    }
    double full[2], half[2];
    const char *big[] = {"--model", "mlp:200-256-128-64-10", "--optim", "adamw"};
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", big[0], big[1], big[2], big[3], SYN, "--batch", "32", "--epochs", "1",
        "--max-steps", "1", "--no-eval");
    expect(&r, 0, "epoch 1/1");
    for (int s = 0; s < 2; s++) full[s] = stage_optim_mib(r.out, s);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", big[0], big[1], big[2], big[3], SYN, "--batch", "32", "--epochs", "1",
        "--max-steps", "1", "--no-eval", "--sharding", "optimizer");
    expect(&r, 0, "optimizer state per stage and replica is 1/D");
    for (int s = 0; s < 2; s++) {
        half[s] = stage_optim_mib(r.out, s);
        cr_assert(full[s] > 0.03 && fabs(half[s] - full[s] / 2) <= 0.0015,
                  "stage %d: optimizer %.3f MiB with ZeRO-1, %.3f MiB without", s, half[s],
                  full[s]);
    }
}

/* The printed peak activations of stage s ("peak activations X MiB"), as
 * a string. */
static void stage_act(const char *out, int s, char *buf, size_t n)
{
    char want[32];
    snprintf(want, sizeof want, "  stage %d memory:", s);
    const char *l = strstr(out, want);
    cr_assert(l, "no %s in:\n%s", want, out);
    const char *a = strstr(l, "peak activations ");
    cr_assert(a, "%s", l);
    a += strlen("peak activations ");
    snprintf(buf, n, "%.*s", (int)strcspn(a, " "), a);
}

/* ZeRO-1 shards the optimizer, not the activations: each stage's printed
 * peak activations are the unsharded run's (the ZeRO-1 optimizer state
 * and the padded gather buffer, allocated after the pipeline's set-up,
 * are not activations). dp=3 pads the chunks: a gather buffer on every
 * stage whose slice 3 does not divide. */
Test(pp_tp_cli, zero1_leaves_the_printed_peak_activations_alone)
{
    static cli_result r;
    static const char *const mesh[][2] = {{"cpu:12", "dp=3,pp=2,tp=2"}, {"cpu:6", "dp=3,pp=2"}};
    for (int i = 0; i < 2; i++) {
        char plain[2][32], z1[2][32];
        CLI(&r, "train", "--mode", "pp", "--device", mesh[i][0], "--mesh", mesh[i][1],
            "--split", "0,2", MLP, SYN, "--batch", "30", "--epochs", "1", "--max-steps", "2",
            "--optim", "adamw", "--no-eval");
        expect(&r, 0, "epoch 1/1");
        for (int s = 0; s < 2; s++) stage_act(r.out, s, plain[s], sizeof plain[s]);
        CLI(&r, "train", "--mode", "pp", "--device", mesh[i][0], "--mesh", mesh[i][1],
            "--split", "0,2", MLP, SYN, "--batch", "30", "--epochs", "1", "--max-steps", "2",
            "--optim", "adamw", "--no-eval", "--sharding", "optimizer");
        expect(&r, 0, "epoch 1/1");
        for (int s = 0; s < 2; s++) {
            stage_act(r.out, s, z1[s], sizeof z1[s]);
            cr_assert_str_eq(z1[s], plain[s], "%s stage %d: peak activations %s MiB with "
                             "ZeRO-1, %s MiB without", mesh[i][1], s, z1[s], plain[s]);
        }
    }
}

/* ZeRO-1 on the 3-D mesh resumes: 20 steps and 20 resumed from their
 * file equal 40 straight, bit for bit (AdamW). */
Test(pp_tp_cli, zero1_on_the_3d_mesh_resumes_bit_for_bit)
{
    static cli_result r;
    char straight[128], half[128], resumed[128];
    path(straight, sizeof straight, "z3-40");
    path(half, sizeof half, "z3-20");
    path(resumed, sizeof resumed, "z3-20-20");
#define Z3_RUN "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", \
               "--split", "0,2", MLP, "--data", "synthetic", "--synthetic-size", "320", \
               "--batch", "32", "--optim", "adamw", "--no-eval", "--quiet", "--sharding", \
               "optimizer"
    CLI(&r, Z3_RUN, "--epochs", "4", "--save", straight);
    expect(&r, 0, "epoch 4/4");
    CLI(&r, Z3_RUN, "--epochs", "2", "--save", half);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, Z3_RUN, "--epochs", "4", "--resume", half, "--save", resumed);
    expect(&r, 0, "epoch 4/4");
#undef Z3_RUN
    cr_assert(cli_same_file(straight, resumed), "20 + 20 resumed steps differ from 40");
}

Test(pp_tp_cli, checkpoints_go_between_pp_tp_and_single)
{
    char one1[128], one3[128], m1[128], a[128], b[128];
    path(one1, sizeof one1, "one1");
    path(one3, sizeof one3, "one3");
    path(m1, sizeof m1, "m1");
    path(a, sizeof a, "single_from_pptp");
    path(b, sizeof b, "pptp_from_single");
    single(one1, "1", "100", NULL);
    single(one3, "3", "100", NULL);
    pptp(m1, "cpu:4", "pp=2,tp=2", "1", "100", NULL);
    single(a, "3", "100", m1);                           /* a pp-tp file in single */
    pptp(b, "cpu:8", "dp=2,pp=2,tp=2", "3", "100", one1); /* a single file in pp-tp */
    double d1 = ck_diff(one1, m1), da = ck_diff(one3, a), db = ck_diff(one3, b);
    cr_assert(d1 <= TOL && da <= TOL && db <= TOL, "%g %g %g", d1, da, db);
}

Test(pp_tp_cli, a_killed_rank_is_named_with_its_coordinates)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "5:3", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", MLP, SYN, "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 5: test fault: SIGKILL before step 3");
    expect(&r, 1, "tandem train: rank 5 (killed by signal 9) is at dp 1, pp 0, tp 1 of the "
                  "mesh dp=2 x pp=2 x tp=2");
    expect(&r, 1, "tandem train: doctor: DIED: ");
    mesh_expect_stages(r.out, 2, 2);
    /* the ranks train on the mesh's groups: the splits' all_gather on the
     * job's communicator, which every rank completed, is not where any
     * waited */
    static cli_result d;
    mesh_doctor(&r, &d);
    expect(&d, 4, "(rank 5)");
    mesh_expect_stages(d.out, 2, 2);
    cr_expect(!strstr(d.out, "comm split"), "%s", d.out);
}

/* A stopped rank (SIGSTOP) is STALLED, named with its coordinates. */
Test(pp_tp_cli, a_stopped_rank_is_named_stalled_with_its_coordinates)
{
    static cli_result r;
    setenv("TMPDIR", g_dir, 1);
    setenv("TANDEM_DDP_TEST_KILL", "5:3:STOP", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2", "--split",
        "0,2", "--timeout", "3", MLP, SYN, "--batch", "32", "--epochs", "1", "--quiet");
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TMPDIR");
    expect(&r, 1, "tandem train: rank 5: test fault: SIGSTOP before step 3");
    expect(&r, 1, "tandem train: rank 5 (stopped) is at dp 1, pp 0, tp 1 of the mesh dp=2 x "
                  "pp=2 x tp=2");
    expect(&r, 1, "tandem train: doctor: STALLED: ");
    cr_expect(!strstr(r.out, "doctor: DIED") && !strstr(r.out, "doctor (after the teardown): "
                                                               "DIED"), "%s", r.out);
    mesh_expect_stages(r.out, 2, 2);
    static cli_result d;
    mesh_doctor(&r, &d);
    expect(&d, 5, "(rank 5)");
    mesh_expect_stages(d.out, 2, 2);
    cr_expect(!strstr(d.out, "comm split"), "%s", d.out);
}

Test(pp_tp_cli, emulated_cuda_ranks_write_the_host_ranks_checkpoint)
{
    CU_NEED_BACKEND();
    char host[128], emu[128];
    path(host, sizeof host, "host");
    path(emu, sizeof emu, "emu");
    pptp(host, "cpu:8", "dp=2,pp=2,tp=2", "1", "3", NULL);
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "8", 1), 0);
    pptp(emu, "cuda", "dp=2,pp=2,tp=2", "1", "3", NULL);
    unsetenv("TANDEM_CUDA_EMULATOR");
    cr_assert(cli_same_file(host, emu), "emulated ranks differ from host ranks");
    /* ZeRO-1 on the dp dimension: its step's gather and the save's over
     * the device communicators */
    static cli_result r;
    for (int e = 0; e < 2; e++) {
        if (e) cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "8", 1), 0);
        CLI(&r, "train", "--mode", "pp", "--device", e ? "cuda" : "cpu:8", "--mesh",
            "dp=2,pp=2,tp=2", "--split", "0,2", MLP, SYN, "--batch", "32", "--epochs", "1",
            "--max-steps", "3", "--no-eval", "--quiet", "--optim", "adamw", "--sharding",
            "optimizer", "--save", e ? emu : host);
        unsetenv("TANDEM_CUDA_EMULATOR");
        expect(&r, 0, "/");
    }
    cr_assert(cli_same_file(host, emu), "emulated ZeRO-1 ranks differ from host ranks");
}

Test(pp_tp_cli, bad_meshes_are_one_line_and_exit_2)
{
    static cli_result r;
    static const struct {
        const char *mode, *dev, *mesh, *model, *extra;
        const char *says;
    } bad[] = {
        {"pp", "cpu:4", "dp=2,pp=2,tp=2", MODEL, NULL, "8 ranks (dp x pp x tp), but the job has 4"},
        {"pp", "cpu:4", "pp=2,tp=2", "mlp:20-25-16-12-5", "0,2",
         "stage 0: layer fc1's output width 25 (fc2's input) is not divisible by the 2 "
         "tensor-parallel ranks"},
        {"pp", "cpu:6", "pp=2,tp=3", "mlp:20-24-16-10-5", "0,2",
         "stage 1: layer fc3's output width 10 (fc4's input) is not divisible by the 3"},
        {"pp", "cpu:10", "pp=5,tp=2", MODEL, NULL, "5 stages but the model has 4 pipeline layers"},
        {"tp", "cpu:8", "dp=2,pp=2,tp=2", MODEL, NULL,
         "a pipeline of tensor-parallel stages is --mode pp --mesh dp=D,pp=S,tp=N"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        if (bad[k].extra)
            CLI(&r, "train", "--mode", bad[k].mode, "--device", bad[k].dev, "--mesh", bad[k].mesh,
                "--model", bad[k].model, SYN, "--split", bad[k].extra);
        else
            CLI(&r, "train", "--mode", bad[k].mode, "--device", bad[k].dev, "--mesh", bad[k].mesh,
                "--model", bad[k].model, SYN);
        expect(&r, 2, bad[k].says);
        const char *nl = strchr(r.out, '\n');
        cr_assert(nl && !nl[1], "more than one line:\n%s", r.out);
    }
    /* the GPT's are tests/test_pp_tp_gpt.c's, model files' test_pp_tp_file.c's */
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--model",
        "cnn", "--data", "synthetic");
    expect(&r, 2, "a pipeline of tensor-parallel stages is built for the MLP, the GPT and model "
                  "files (the CNN's is not)");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=1,pp=2,tp=2",
        "--sharding", "optimizer", MLP, SYN);
    expect(&r, 2, "it needs --mesh dp=D,pp=S,tp=N with D >= 2 (dp is 1)");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2",
        "--sharding", "grad_op", MLP, SYN);
    expect(&r, 2, "DeepSpeed refuses ZeRO-2 with pipelines too");
}
