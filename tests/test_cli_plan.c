/* tests/test_cli_plan.c: `tandem plan` before a run against the
 * allocator's peak `tandem train` measures with the same options
 * (--no-eval: the training step's), --mode single and --mode ddp on
 * cpu:2, for the MLP and the GPT in fp32, bf16 with checkpointing and
 * fp16 with clipping: equal as printed (to 0.01 MiB; the single-device
 * plan is exact to the byte, tests/test_plan.c, and a DDP rank on a host
 * device holds its model at its share of the batch, DDP's buckets being
 * in the job's shared memory); --mode fsdp, every sharding at 1, 2 and 4
 * ranks with and without levers, within 5% of rank 0's measured peak;
 * --mode dp's output device at 1..4 devices, within 5% of the master's
 * measured peak; --mode pp's every stage at 2 and 3 stages, and every
 * replica's stage of dp x pp meshes (with ZeRO-1 over dp too), within 5%
 * of that rank's measured peak; --mode tp's rank equal to rank 0's
 * measured peak as printed. What is not planned is refused (exit 2). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

TestSuite(cli_plan, .timeout = 240);

static cli_result g_r;

/* The figure after key, as printed ("25.62"). */
static void figure(const char *key, char *buf, size_t n)
{
    const char *p = strstr(g_r.out, key);
    cr_assert_not_null(p, "no '%s' in:\n%s", key, g_r.out);
    p += strlen(key);
    size_t k = strspn(p, "0123456789.");
    cr_assert(k > 0 && k < n, "%s", p);
    memcpy(buf, p, k);
    buf[k] = 0;
}

Test(cli_plan, planned_equals_measured_single_and_ddp)
{
    static const struct { const char *model, *batch, *lever[5]; } cases[] = {
        {"mlp:784-256-128-10", "64", {"--precision", "fp32"}},
        {"mlp:784-256-128-10", "64", {"--precision", "bf16", "--checkpoint-activations", "2"}},
        {"mlp:784-256-128-10", "64", {"--precision", "fp16", "--clip-grad-norm", "1"}},
        {"gpt:2-32-2-16", "4", {"--precision", "bf16", "--checkpoint-activations"}},
        {"gpt:2-32-2-16", "4", {"--precision", "fp32", "--clip-grad-norm", "1"}},
    };
    static const char *const modes[][2] = {{"single", "cpu"}, {"ddp", "cpu:2"}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int m = 0; m < 2; m++) {
            const char *const *lv = cases[c].lever;
            const char *args[24] = {"plan", "--model", cases[c].model, "--batch", cases[c].batch,
                                    "--mode", modes[m][0], "--device", modes[m][1]};
            int n = 9;
            for (int i = 0; i < 5 && lv[i]; i++) args[n++] = lv[i];
            args[n] = NULL;
            cli_run(&g_r, args);
            cr_assert_eq(g_r.code, 0, "%s", g_r.out);
            char planned[32], measured[32];
            figure("peak per device: ", planned, sizeof planned);
            args[0] = "train";
            args[n++] = "--epochs";
            args[n++] = "1";
            args[n++] = "--no-eval";
            args[n++] = "--quiet";
            if (strncmp(cases[c].model, "gpt", 3)) {
                args[n++] = "--data";
                args[n++] = "synthetic";
                args[n++] = "--synthetic-size";
                args[n++] = "256";
            } else {
                args[n++] = "--max-steps";
                args[n++] = "2";
            }
            args[n] = NULL;
            cli_run(&g_r, args);
            cr_assert_eq(g_r.code, 0, "%s", g_r.out);
            figure(m ? "peak memory on rank 0's cpu:0: " : "peak memory on cpu:0: ", measured,
                   sizeof measured);
            cr_assert_str_eq(planned, measured, "%s %s %s %s: planned %s MiB, measured %s MiB",
                             cases[c].model, modes[m][0], lv[1], lv[2] ? lv[2] : "", planned,
                             measured);
        }
    cr_assert_eq(cli_shm_entries(), 0);
}

/* The figure printed as "<key><number>" (MiB), as a double. */
static double figure_mib(const char *key)
{
    char buf[32];
    figure(key, buf, sizeof buf);
    return strtod(buf, NULL);
}

/* Nonzero: train_as_planned evaluates after the epoch (a test set of 200
 * images, larger than every batch here; the GPT's validation windows). */
static int g_eval;

/* args[0..n) (room for 8 more) ran as `plan`: runs them as a short
 * `train` (one epoch of 128 synthetic samples, or 1200 with g_eval; the
 * GPT, 3 steps of its text), which must exit 0; its output is in g_r. */
static void train_as_planned(const char **args, int n, int gpt)
{
    static const char *const tail_img[] = {"--data", "synthetic", "--synthetic-size", "128",
                                           NULL};
    static const char *const tail_eval[] = {"--data", "synthetic", "--synthetic-size", "1200",
                                            NULL};
    static const char *const tail_gpt[] = {"--max-steps", "3", NULL};
    const char *const *tail = gpt ? tail_gpt : g_eval ? tail_eval : tail_img;
    args[0] = "train";
    args[n++] = "--epochs";
    args[n++] = "1";
    if (!g_eval) args[n++] = "--no-eval";
    args[n++] = "--quiet";
    for (int i = 0; tail[i]; i++) args[n++] = tail[i];
    args[n] = NULL;
    cli_run(&g_r, args);
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
}

/* --mode fsdp, every sharding, at 1, 2 and 4 ranks, without levers and
 * with bf16, segments of 2 and clipping: planned within 5% of rank 0's
 * measured peak (the set-up's peak included: the model's flat buffers
 * beside the new shards). Measured on this machine: equal as printed in
 * every case of this matrix but one rank's full shard of the MLP (+2.5%:
 * with one rank a reduce-scatter may end before the next unit's gradient
 * is asked for, which the plan does not count on); that timing-bound
 * term moves a figure by one unit's block at most. */
Test(cli_plan, planned_fsdp_within_5_percent_of_measured, .timeout = 600)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "4"}};
    static const char *const shardings[] = {"full", "grad_op", "optimizer"};
    static const char *const devices[] = {"cpu", "cpu:2", "cpu:4"};
    static const char *const levers[2][7] = {
        {"--precision", "fp32"},
        {"--precision", "bf16", "--checkpoint-activations", "2", "--clip-grad-norm", "1"}};
    double worst = 0.0;
    for (int mo = 0; mo < 3; mo++)
        for (int sh = 0; sh < 3; sh++)
            for (int d = 0; d < 3; d++)
                for (int lv = 0; lv < 2; lv++) {
                    const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                            models[mo].batch, "--mode", "fsdp", "--sharding",
                                            shardings[sh], "--device", devices[d]};
                    int n = 11;
                    for (int i = 0; i < 6 && levers[lv][i]; i++) args[n++] = levers[lv][i];
                    args[n] = NULL;
                    cli_run(&g_r, args);
                    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
                    double planned = figure_mib("peak per device: ");
                    train_as_planned(args, n, mo == 2);
                    double measured = figure_mib("peak memory on rank 0's cpu:0: ");
                    double err = (planned - measured) / measured;
                    if (fabs(err) > fabs(worst)) worst = err;
                    cr_assert(fabs(err) <= 0.05, "%s %s %s %s: planned %.2f MiB, measured "
                              "%.2f MiB (%+.1f%%)", models[mo].model, shardings[sh],
                              devices[d], levers[lv][1], planned, measured, 100.0 * err);
                }
    cr_log_info("fsdp plan vs measured: worst %+.2f%%", 100.0 * worst);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* --mode dp: the output device (the master at the largest chunk, the
 * whole batch's inputs, logits, their gradient and labels, and its loss
 * rows) at 1, 2 and 4 devices, the MLP, the CNN and the GPT, without
 * levers, in bf16 with segments of 2 and clipping, and in fp16 with
 * clipping: within 5% of the master's measured peak (measured on this
 * machine: equal as printed in all 30 cases, the uneven chunks of 3
 * devices and of the GPT's batch of 5 included). */
Test(cli_plan, planned_dp_within_5_percent_of_measured, .timeout = 600)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "5"}};
    static const char *const devices[] = {"cpu", "cpu:2", "cpu:4", "cpu:3"};
    static const char *const levers[3][7] = {
        {"--precision", "fp32"},
        {"--precision", "bf16", "--checkpoint-activations", "2", "--clip-grad-norm", "1"},
        {"--precision", "fp16", "--clip-grad-norm", "1"}};
    double worst = 0.0;
    for (int mo = 0; mo < 3; mo++)
        for (int d = 0; d < 4; d++)
            for (int lv = 0; lv < 3; lv++) {
                if (d == 3 && lv > 0) continue;   /* the uneven chunk: once per model */
                const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                        models[mo].batch, "--mode", "dp", "--device",
                                        devices[d]};
                int n = 9;
                for (int i = 0; i < 6 && levers[lv][i]; i++) args[n++] = levers[lv][i];
                args[n] = NULL;
                cli_run(&g_r, args);
                cr_assert_eq(g_r.code, 0, "%s", g_r.out);
                double planned = figure_mib("peak per device: ");
                train_as_planned(args, n, mo == 2);
                double measured = figure_mib("peak memory on the master's cpu:0: ");
                /* train prints the same plan beside it */
                cr_assert_eq(figure_mib("MiB measured (allocator), "), planned, "%s", g_r.out);
                double err = (planned - measured) / measured;
                if (fabs(err) > fabs(worst)) worst = err;
                cr_assert(fabs(err) <= 0.05, "%s dp on %s %s: planned %.2f MiB, measured %.2f "
                          "MiB (%+.1f%%)", models[mo].model, devices[d], levers[lv][1], planned,
                          measured, 100.0 * err);
            }
    cr_log_info("dp plan vs measured: worst %+.2f%%", 100.0 * worst);
}

/* Every stage's figure `tandem plan --mode pp` printed ("  stage s
 * (layers a-b): X MiB"), from g_r; returns the stages. */
static int plan_stages(double *planned, int max)
{
    int S = 0;
    for (const char *p = g_r.out; (p = strstr(p, "  stage ")) && S < max; p++) {
        int s;
        const char *q = strstr(p, "): ");
        if (sscanf(p, "  stage %d (layers", &s) != 1 || !q) continue;
        cr_assert_eq(s, S, "%s", g_r.out);
        planned[S++] = strtod(q + 3, NULL);
    }
    cr_assert(S >= 1, "no stage in:\n%s", g_r.out);
    return S;
}

/* train --mode pp's lines for every rank ("  stage s[, replica d] (rank
 * k): X MiB measured, Y MiB planned"), from g_r, against `tandem plan`'s
 * figure of each stage: train's plan equal to it as printed, the measured
 * peak within 5%; and the headline ("peak memory on a device: ") the
 * largest rank's. Returns the ranks seen; *worst the largest difference. */
static int pp_ranks_within(const double *planned, int S, int ranks, const char *what,
                           double *worst)
{
    int seen = 0;
    double top = 0.0;
    for (const char *p = g_r.out; (p = strstr(p, "\n  stage ")); p++) {
        int s, k;
        const char *rk = strstr(p, " (rank "), *eol = strchr(p + 1, '\n');
        if (sscanf(p, "\n  stage %d", &s) != 1 || !rk || (eol && rk > eol) ||
            !strstr(rk, "MiB measured, ") || (eol && strstr(rk, "MiB measured, ") > eol))
            continue;
        double measured, plan_t;
        const char *colon = strstr(rk, "): ");
        cr_assert(sscanf(rk, " (rank %d's ", &k) == 1 && colon, "%s: %.80s", what, rk);
        cr_assert_eq(sscanf(colon, "): %lf MiB measured, %lf MiB planned", &measured, &plan_t),
                     2, "%s: %.80s", what, rk);
        cr_assert(s >= 0 && s < S && k == seen, "%s: rank %d's line, stage %d:\n%s", what, k, s,
                  g_r.out);
        cr_assert_eq(plan_t, planned[s], "%s stage %d: train planned %.2f, plan %.2f MiB", what,
                     s, plan_t, planned[s]);
        double err = (planned[s] - measured) / measured;
        if (fabs(err) > fabs(*worst)) *worst = err;
        cr_assert(fabs(err) <= 0.05, "%s stage %d (rank %d): planned %.2f MiB, measured %.2f "
                  "MiB (%+.1f%%)", what, s, k, planned[s], measured, 100.0 * err);
        /* replica 0's stages: to the byte in every case measured, so equal
         * as printed (the CNN's stages with its first batchnorm failed this
         * while the plan kept its per-batch statistics once, not per
         * activation set) */
        int rep = 0;
        if (sscanf(p, "\n  stage %d, replica %d", &s, &rep) == 2 && rep > 0) rep = 1;
        if (!rep)
            cr_assert(fabs(planned[s] - measured) < 0.005, "%s stage %d (rank %d): planned "
                      "%.2f MiB, measured %.2f MiB: not equal as printed", what, s, k,
                      planned[s], measured);
        if (measured > top) top = measured;
        seen++;
    }
    cr_assert_eq(seen, ranks, "%s: %d rank lines of %d:\n%s", what, seen, ranks, g_r.out);
    cr_assert_eq(figure_mib("peak memory on a device: "), top, "%s", g_r.out);
    return seen;
}

/* One pp configuration (args[0..n): room for 16 more): planned, then
 * trained, every rank within 5% of its stage's plan. */
static void pp_case(const char **args, int n, int gpt, int ranks, const char *what,
                    double *worst)
{
    double planned[64];
    cli_run(&g_r, args);
    cr_assert_eq(g_r.code, 0, "%s: %s", what, g_r.out);
    int S = plan_stages(planned, 64);
    train_as_planned(args, n, gpt);
    pp_ranks_within(planned, S, ranks, what, worst);
}

/* --mode pp on host devices: every stage's plan (its model's slice, the
 * schedule's activation sets at the micro-batch size, the shared scratch,
 * the loss and levers' scratch, the GPT's tied buffer; the received
 * activations and gradients are in the links' shared memory) against
 * that stage's measured peak, which train prints for every rank, for the
 * MLP, the CNN and the GPT at 2 and 3 stages, 1F1B and GPipe, without
 * levers, in bf16 with segments of 2 and clipping, and in fp16 with
 * clipping: within 5% (measured on this machine: equal as printed for
 * every stage of all 36 cases; the largest stage is the first of the
 * MLP, the last of the CNN and the GPT). */
Test(cli_plan, planned_pp_within_5_percent_of_measured, .timeout = 900)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "8"}};
    static const char *const devices[] = {"cpu:2", "cpu:3"};
    static const char *const scheds[] = {"1f1b", "gpipe"};
    static const char *const levers[3][7] = {
        {"--precision", "fp32"},
        {"--precision", "bf16", "--checkpoint-activations", "2", "--clip-grad-norm", "1"},
        {"--precision", "fp16", "--clip-grad-norm", "1"}};
    double worst = 0.0;
    for (int mo = 0; mo < 3; mo++)
        for (int d = 0; d < 2; d++)
            for (int k = 0; k < 2; k++)
                for (int lv = 0; lv < 3; lv++) {
                    const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                            models[mo].batch, "--mode", "pp", "--device",
                                            devices[d], "--schedule", scheds[k]};
                    int n = 11;
                    for (int i = 0; i < 6 && levers[lv][i]; i++) args[n++] = levers[lv][i];
                    args[n] = NULL;
                    char what[128];
                    snprintf(what, sizeof what, "%s pp on %s %s %s", models[mo].model,
                             devices[d], scheds[k], levers[lv][1]);
                    pp_case(args, n, mo == 2, d + 2, what, &worst);
                }
    cr_log_info("pp plan vs measured: worst %+.2f%%", 100.0 * worst);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* dp x pp meshes: `tandem plan --mode pp --mesh dp=D,pp=S` plans every
 * replica's stage alike (at the largest replica's share; DDP's buckets
 * over the dp dimension are in the job's shared memory), and with
 * --sharding optimizer (ZeRO-1 over the dp dimension) the optimizer
 * state over 1/D of the stage plus the padded parameter buffer where the
 * stage does not divide by D: every rank of the MLP, the CNN and the GPT
 * on dp=2 x pp=2 and dp=3 x pp=2 (ZeRO-1; --stages 2 of 6 devices, train's
 * other spelling), without levers and in bf16 with segments of 2 and
 * clipping, within 5% of its measured peak (measured on this machine:
 * equal as printed in all 18 cases, replica 0's to the byte; a replica
 * after the first skips the norm's partial sums with clipping, the norm
 * being counted once, and holds up to that scratch less: 832 bytes on
 * the CNN's last stage). */
Test(cli_plan, planned_pp_mesh_within_5_percent_of_measured, .timeout = 900)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "8"}};
    static const char *const meshes[3][5] = {
        {"--device", "cpu:4", "--mesh", "dp=2,pp=2"},
        {"--device", "cpu:4", "--mesh", "dp=2,pp=2", "--sharding"},
        {"--device", "cpu:6", "--stages", "2", "--sharding"}};
    static const char *const levers[2][7] = {
        {"--precision", "fp32"},
        {"--precision", "bf16", "--checkpoint-activations", "2", "--clip-grad-norm", "1"}};
    double worst = 0.0;
    for (int mo = 0; mo < 3; mo++)
        for (int me = 0; me < 3; me++)
            for (int lv = 0; lv < 2; lv++) {
                const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                        models[mo].batch, "--mode", "pp"};
                int n = 7;
                for (int i = 0; i < 5 && meshes[me][i]; i++) args[n++] = meshes[me][i];
                if (me) args[n++] = "optimizer";
                for (int i = 0; i < 6 && levers[lv][i]; i++) args[n++] = levers[lv][i];
                args[n] = NULL;
                char what[128];
                snprintf(what, sizeof what, "%s pp %s %s%s %s", models[mo].model, meshes[me][1],
                         meshes[me][3], me ? " zero1" : "", levers[lv][1]);
                pp_case(args, n, mo == 2, me == 2 ? 6 : 4, what, &worst);
            }
    cr_log_info("pp mesh plan vs measured: worst %+.2f%%", 100.0 * worst);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* --mode dp on emulated GPUs: the output device's plan without
 * tdm_single's input staging (the master reads its chunk from
 * DataParallel's buffers), with the parameters' staging: the MLP, the
 * CNN and the GPT on 2 and 3 devices, without levers and in bf16 with
 * segments of 2 and clipping: equal to the master's measured peak as
 * printed (0.01 MiB; DataParallel's buffers are allocated in one
 * process, in a fixed order). Before the staging was taken out the MLP
 * on cuda:0,1 was planned 4.12 MiB against 4.03 measured, and this
 * failed. */
Test(cli_plan, planned_dp_on_emulated_gpus_equals_measured, .timeout = 600)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "5"}};
    static const char *const devices[] = {"cuda:0,1", "cuda:0,1,2"};
    static const char *const levers[2][7] = {
        {"--precision", "fp32"},
        {"--precision", "bf16", "--checkpoint-activations", "2", "--clip-grad-norm", "1"}};
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "3", 1), 0);
    double worst = 0.0;
    for (int mo = 0; mo < 3; mo++)
        for (int d = 0; d < 2; d++)
            for (int lv = 0; lv < 2; lv++) {
                const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                        models[mo].batch, "--mode", "dp", "--device",
                                        devices[d]};
                int n = 9;
                for (int i = 0; i < 6 && levers[lv][i]; i++) args[n++] = levers[lv][i];
                args[n] = NULL;
                cli_run(&g_r, args);
                cr_assert_eq(g_r.code, 0, "%s", g_r.out);
                double planned = figure_mib("peak per device: ");
                train_as_planned(args, n, mo == 2);
                double measured = figure_mib("peak memory on the master's cuda-emu:0: ");
                cr_assert_eq(figure_mib("MiB measured (allocator), "), planned, "%s", g_r.out);
                double err = (planned - measured) / measured;
                if (fabs(err) > fabs(worst)) worst = err;
                cr_assert(fabs(planned - measured) < 0.005, "%s dp on emulated %s %s: planned "
                          "%.2f MiB, measured %.2f MiB (%+.1f%%)", models[mo].model,
                          devices[d], levers[lv][1], planned, measured, 100.0 * err);
            }
    unsetenv("TANDEM_CUDA_EMULATOR");
    cr_log_info("dp plan vs measured on emulated GPUs: worst %+.2f%%", 100.0 * worst);
}

/* --mode pp on emulated GPUs (cuda/emulator.c: the device allocator's
 * accounting as a GPU's): the received activations and gradients, the
 * first stage's copies of the input and the last stage's targets are the
 * device's memory there, and planned: every stage of the MLP, the CNN
 * and the GPT at 2 and 3 stages, without levers and in bf16 with
 * segments of 2 and clipping, and a dp=2 x pp=2 mesh with ZeRO-1 over dp,
 * within 5% of its measured peak (measured: equal as printed in all 15
 * cases). What this does not test: a GPU (cuBLAS's and NCCL's own
 * buffers are not counted; `tandem plan` says so). */
Test(cli_plan, planned_pp_on_emulated_gpus_within_5_percent, .timeout = 600)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "8"}};
    static const char *const devices[3][5] = {
        {"--device", "cuda:0,1"},
        {"--device", "cuda:0,1,2"},
        {"--device", "cuda:0,1,2,3", "--mesh", "dp=2,pp=2"}};
    static const char *const levers[2][7] = {
        {"--precision", "fp32"},
        {"--precision", "bf16", "--checkpoint-activations", "2", "--clip-grad-norm", "1"}};
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "4", 1), 0);
    double worst = 0.0;
    for (int mo = 0; mo < 3; mo++)
        for (int d = 0; d < 3; d++)
            for (int lv = 0; lv < 2; lv++) {
                if (d == 2 && lv == 0) continue;
                const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                        models[mo].batch, "--mode", "pp"};
                int n = 7;
                for (int i = 0; i < 4 && devices[d][i]; i++) args[n++] = devices[d][i];
                if (d == 2) {
                    args[n++] = "--sharding";
                    args[n++] = "optimizer";
                }
                for (int i = 0; i < 6 && levers[lv][i]; i++) args[n++] = levers[lv][i];
                args[n] = NULL;
                char what[128];
                snprintf(what, sizeof what, "%s pp on emulated %s %s", models[mo].model,
                         devices[d][1], levers[lv][1]);
                pp_case(args, n, mo == 2, d == 2 ? 4 : d + 2, what, &worst);
                cr_assert(strstr(g_r.out, "cuda-emu:0"), "%s", g_r.out);
            }
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cuda:0,1");
    expect(&g_r, 0, "not counted: cuBLAS's and NCCL's own buffers");
    unsetenv("TANDEM_CUDA_EMULATOR");
    cr_log_info("pp plan vs measured on emulated GPUs: worst %+.2f%%", 100.0 * worst);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* Every "peak planned" pair of compare's memory table rows that start with
 * `label`: within 5% (measured on this machine: equal as printed). */
static int compare_rows_within(const char *label)
{
    int rows = 0;
    const char *p = g_r.out;
    while ((p = strstr(p, label))) {
        const char *end = strchr(p, '\n');
        char line[256];
        snprintf(line, sizeof line, "%.*s", end ? (int)(end - p) : (int)strlen(p), p);
        p = end ? end : p + strlen(p);
        double v[9];
        const char *q = line + strlen(label);
        while (*q == ' ') q++;
        while (*q && *q != ' ') q++;   /* the rank or device */
        int n = 0;
        for (char *e; n < 9; n++, q = e) {
            v[n] = strtod(q, &e);
            if (e == q) break;
        }
        if (n != 9) continue;   /* not a memory row */
        double measured = v[7], planned = v[8];
        cr_assert(measured > 0 && fabs(planned - measured) <= 0.05 * measured,
                  "%s: planned %.3f MiB, measured %.3f MiB:\n%s", line, planned, measured,
                  g_r.out);
        rows++;
    }
    return rows;
}

/* compare prints, for every mode it runs, the allocator's peak beside the
 * planner's (the memory table's last two columns, and --json's
 * peak_measured and peak_planned); DP's output device's too, its other
 * devices are not planned ("-", null). */
Test(cli_plan, compare_prints_planned_beside_measured)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "planc");
    const char *json = tu_tpath(dir, "c.json");
    CLI(&g_r, "compare", "--model", "mlp:784-256-128-10", "--data", "synthetic", "--batch", "64",
        "--steps", "3", "--modes", "single,dp,ddp,fsdp,zero2,zero1", "--json", json);
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "total      peak   planned"), "%s", g_r.out);
    static const char *const rows[] = {"single cpu", "DDP rank", "FSDP rank", "ZeRO-2 rank",
                                       "ZeRO-1 rank", "DP cpu"};
    for (int i = 0; i < 6; i++)
        cr_assert(compare_rows_within(rows[i]) >= 1, "no '%s' row:\n%s", rows[i], g_r.out);
    /* DP's other device: not planned */
    cr_assert(strstr(g_r.out, "DP cpu:1") && strstr(strstr(g_r.out, "DP cpu:1"), "        -"),
              "%s", g_r.out);
    FILE *f = fopen(json, "r");
    cr_assert_not_null(f);
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    cr_assert(strstr(text, "\"peak_measured\": ") && strstr(text, "\"peak_planned\": null") &&
              strstr(text, "\"peak_planned\": 3"), "%s", text);
    /* the GPT in bf16 with checkpointing: single, DDP and FSDP */
    CLI(&g_r, "compare", "--model", "gpt:2-32-2-16", "--batch", "4", "--steps", "3", "--modes",
        "single,ddp,fsdp", "--precision", "bf16", "--checkpoint-activations", "2");
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
    for (int i = 0; i < 3; i++)
        cr_assert(compare_rows_within(rows[i]) >= 1, "no '%s' row:\n%s", rows[i], g_r.out);
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* compare --json's "pipeline" object (file `path`): one memory entry
 * per stage (S of them), each with the allocator's peak beside the
 * plan's, within 5% (measured: equal to the byte but the CNN mesh's
 * stage 0), and the layout and verdict. Before, the JSON held no
 * pipeline entry and this failed. */
static void pp_json_memory(const char *path, int S, const char *what)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s: no %s", what, path);
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    const char *p = strstr(text, "\"pipeline\": {\"stages\": ");
    cr_assert_not_null(p, "%s: no pipeline in %s", what, text);
    cr_assert_eq(atoi(p + strlen("\"pipeline\": {\"stages\": ")), S, "%s: %.200s", what, p);
    cr_assert(strstr(p, "\"pass\": true"), "%s: %.300s", what, p);
    int k = 0;
    for (const char *q = p; (q = strstr(q, "{\"stage\": ")); q++, k++) {
        double measured, planned;
        const char *m = strstr(q, "\"peak_measured\": "), *pl = strstr(q, "\"peak_planned\": ");
        cr_assert(m && pl, "%s: %.200s", what, q);
        cr_assert_eq(atoi(q + strlen("{\"stage\": ")), k, "%s: %.200s", what, q);
        measured = strtod(m + strlen("\"peak_measured\": "), NULL);
        planned = strtod(pl + strlen("\"peak_planned\": "), NULL);
        cr_assert(measured > 0 && fabs(planned - measured) <= 0.05 * measured,
                  "%s stage %d: planned %.0f bytes, measured %.0f", what, k, planned, measured);
    }
    cr_assert_eq(k, S, "%s: %d stage entries of %d:\n%s", what, k, S, p);
}

/* compare's pp row with the levers: its stages in bf16 with
 * checkpointing and clipping, the verdict against one host device with
 * --grad-accum under the same levers (the MLP bit for bit; the GPT's tied
 * embedding and a dp x pp mesh's replicas within the bound), the norm
 * printed above the clip (so that clipping bit on both sides of the
 * verdict), and each stage's measured device peak beside its plan,
 * within 5% (measured on this machine: equal as printed). */
Test(cli_plan, compare_pp_row_with_levers, .timeout = 600)
{
    static const struct { const char *model, *batch, *dev, *mesh, *verdict; } cases[] = {
        {"mlp:784-256-128-10", "64", "cpu:2", NULL, "BITWISE IDENTICAL"},
        {"gpt:2-32-2-16", "8", "cpu:3", NULL, "-> PASS"},
        {"cnn", "32", "cpu:4", "dp=2,pp=2", "-> PASS"},
    };
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "planpp");
    const char *json = tu_tpath(dir, "c.json");
    for (int c = 0; c < 3; c++) {
        const char *args[32] = {"compare", "--model", cases[c].model, "--batch", cases[c].batch,
                                "--steps", "3", "--modes", "pp", "--device", cases[c].dev,
                                "--precision", "bf16", "--checkpoint-activations", "2",
                                "--clip-grad-norm", "0.05", "--json", json};
        int n = 19;
        if (cases[c].mesh) {
            args[n++] = "--mesh";
            args[n++] = cases[c].mesh;
        }
        if (strncmp(cases[c].model, "gpt", 3)) {
            args[n++] = "--data";
            args[n++] = "synthetic";
        }
        args[n] = NULL;
        cli_run(&g_r, args);
        cr_assert_eq(g_r.code, 0, "%s", g_r.out);
        const char *eq = strstr(g_r.out, "pipeline equivalence");
        cr_assert(eq && strstr(eq, "both with precision bf16, checkpointing, clipping") &&
                  strstr(eq, cases[c].verdict), "%s: %s", cases[c].model, g_r.out);
        const char *nl = strstr(eq, "global gradient norm at the last step: ");
        cr_assert_not_null(nl, "%s", g_r.out);
        double norm = strtod(nl + strlen("global gradient norm at the last step: "), NULL);
        cr_assert(norm > 0.05, "%s: the norm %g does not exceed the clip", cases[c].model, norm);
        /* "  s  params grads optimizer peak-act peak planned (...": the
         * last two figures before the parenthesis */
        const char *mem = strstr(g_r.out, "pipeline memory per stage");
        cr_assert_not_null(mem, "%s", g_r.out);
        int rows = 0;
        for (const char *p = strstr(mem, "\n  0 "); p && !strncmp(p, "\n  ", 3); rows++) {
            double v[7];
            const char *q = p + 3;
            for (int k = 0; k < 7; k++) {
                char *e;
                v[k] = strtod(q, &e);
                cr_assert(e != q, "%s: %.120s", cases[c].model, p);
                q = e;
            }
            cr_assert_eq(v[0], rows, "%.120s", p);
            cr_assert(v[5] > 0 && fabs(v[6] - v[5]) <= 0.05 * v[5], "%s stage %d: planned %.2f "
                      "MiB, measured %.2f MiB", cases[c].model, rows, v[6], v[5]);
            p = strchr(p + 1, '\n');
        }
        cr_assert_eq(rows, cases[c].mesh ? 2 : cases[c].dev[4] - '0', "%s", mem);
        pp_json_memory(json, rows, cases[c].model);
    }
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* train --mode tp's line for the job's largest device peak (dp >= 2):
 * measured and planned equal as printed, and equal to `tandem plan`'s
 * figure `largest`. */
static void tp_largest_equals(double largest, const char *what)
{
    const char *p = strstr(g_r.out, "tp memory, the largest device peak: ");
    cr_assert_not_null(p, "%s: no largest line:\n%s", what, g_r.out);
    double measured = strtod(p + strlen("tp memory, the largest device peak: "), NULL);
    const char *q = strstr(p, "MiB measured (allocator) on rank ");
    const char *pl = q ? strstr(q, "), ") : NULL;
    cr_assert(q && pl, "%s: %.160s", what, p);
    double planned = strtod(pl + 3, NULL);
    cr_assert(fabs(planned - measured) < 0.005 && fabs(planned - largest) < 0.005,
              "%s: the largest device peak %.2f MiB measured, %.2f planned by train, %.2f by "
              "tandem plan", what, measured, planned, largest);
}

/* --mode tp: a rank's slices, the optimizer over them (ZeRO-1 over dp:
 * its chunk), the activations and scratch tp reserves for its replica's
 * rows, the loss rows: train prints rank 0's plan beside its allocator
 * peak, equal as printed (to the byte in every case measured), and
 * `tandem plan` the largest replica's, the same where the batch divides
 * by the replicas: the MLP and the GPT on tp=2, dp=2 x tp=2, dp=2 x
 * tp=2 with ZeRO-1 and dp=3 x tp=2 with ZeRO-1 (uneven shares), the GPT
 * with sequence parallelism, dp=2 x tp=2 with ZeRO-2 (its peak: ZeRO-1's
 * and the gradient shard it keeps while the step's whole gradient is
 * held). */
Test(cli_plan, planned_tp_equals_measured, .timeout = 600)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"gpt:2-32-2-16", "8"}};
    static const char *const layouts[6][5] = {
        {"--device", "cpu:2"},
        {"--device", "cpu:4", "--mesh", "dp=2,tp=2"},
        {"--device", "cpu:4", "--mesh", "dp=2,tp=2", "--sharding"},
        {"--device", "cpu:6", "--mesh", "dp=3,tp=2", "--sharding"},
        {"--device", "cpu:2", "--sequence-parallel"},
        {"--device", "cpu:4", "--mesh", "dp=2,tp=2", "--sharding"}};
    for (int mo = 0; mo < 2; mo++)
        for (int l = 0; l < 6; l++) {
            if (l == 4 && mo == 0) continue;   /* sequence parallelism: the GPT's */
            const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                    models[mo].batch, "--mode", "tp"};
            int n = 7;
            for (int i = 0; i < 5 && layouts[l][i]; i++) args[n++] = layouts[l][i];
            if (l == 2 || l == 3) args[n++] = "optimizer";
            if (l == 5) args[n++] = "grad_op";
            args[n] = NULL;
            cli_run(&g_r, args);
            cr_assert_eq(g_r.code, 0, "%s", g_r.out);
            double largest = figure_mib("peak per device: ");
            train_as_planned(args, n, mo == 1);
            double measured = figure_mib("tp memory, rank 0: device peak ");
            double planned = figure_mib("MiB measured (allocator), ");
            cr_assert(fabs(planned - measured) < 0.005, "%s tp %s %s: planned %.2f MiB, measured "
                      "%.2f MiB", models[mo].model, layouts[l][1], l ? layouts[l][3] : "",
                      planned, measured);
            /* 64 and 8 samples divide by 2 replicas, not by 3: rank 0's
             * replica has the smaller share there; the job's largest
             * device peak is the largest share's, which plan prints */
            if (l == 3) cr_assert(largest >= planned, "%.2f < %.2f", largest, planned);
            else cr_assert_eq(largest, planned, "%s: plan %.2f, train's plan %.2f",
                              models[mo].model, largest, planned);
            if (l >= 1 && l <= 3) tp_largest_equals(largest, models[mo].model);
        }
    cr_assert_eq(cli_shm_entries(), 0);
}

/* An uneven batch over the dp dimension: the replicas' shares differ
 * (7 samples over 2: 3 and 4; rank 0's replica holds the smaller), and
 * train's line for the job's largest device peak (gathered from every
 * rank after the run) equals `tandem plan`'s figure, the largest share's,
 * planned and measured as printed. Before, train printed rank 0's alone:
 * the MLP 784-256-128-10 at dp=2 x tp=2 measured and planned 1.38 MiB
 * there, 0.01 MiB under plan's 1.39. */
Test(cli_plan, tp_uneven_replicas_largest_equals_plan, .timeout = 300)
{
    static const struct { const char *model, *batch, *dev, *mesh; } cases[] = {
        {"mlp:784-256-128-10", "7", "cpu:4", "dp=2,tp=2"},
        {"gpt:2-32-2-16", "7", "cpu:4", "dp=2,tp=2"},
        {"mlp:784-256-128-10", "65", "cpu:6", "dp=3,tp=2"}};
    for (int c = 0; c < 3; c++) {
        const char *args[32] = {"plan", "--model", cases[c].model, "--batch", cases[c].batch,
                                "--mode", "tp", "--device", cases[c].dev, "--mesh",
                                cases[c].mesh, "--precision", "bf16", NULL};
        cli_run(&g_r, args);
        cr_assert_eq(g_r.code, 0, "%s", g_r.out);
        double largest = figure_mib("peak per device: ");
        train_as_planned(args, 13, cases[c].model[0] == 'g');
        tp_largest_equals(largest, cases[c].model);
        /* rank 0's replica has the smaller share: its own plan is lower */
        double rank0 = figure_mib("tp memory, rank 0: device peak ");
        cr_assert(rank0 <= largest, "%s: rank 0 %.2f, largest %.2f", cases[c].model, rank0,
                  largest);
    }
    cr_assert_eq(cli_shm_entries(), 0);
}

/* --mode tp --sharding grad_op --bucket-cap-mb 0.02 (ZeRO-2's gradient
 * buckets, ~20 KiB, summed during backward) on dp=2 x tp=2: `tandem
 * plan`, train's plan and train's allocator peak equal as printed, and
 * below the default's (25 MiB: one bucket, the whole gradient held).
 * Measured: the MLP 784-256-128-10 1.67 -> 1.61 MiB (its fc1 is 85% of
 * the gradient, and a bucket holds whole tensors), the GPT 2-32-2-16
 * 0.67 -> 0.64 MiB. */
Test(cli_plan, planned_tp_zero2_buckets_equal_measured, .timeout = 600)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"gpt:2-32-2-16", "8"}};
    for (int mo = 0; mo < 2; mo++) {
        double peak[2];
        for (int b = 0; b < 2; b++) {
            const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                    models[mo].batch, "--mode", "tp", "--device", "cpu:4",
                                    "--mesh", "dp=2,tp=2", "--sharding", "grad_op"};
            int n = 13;
            if (b) {
                args[n++] = "--bucket-cap-mb";
                args[n++] = "0.02";
            }
            args[n] = NULL;
            cli_run(&g_r, args);
            cr_assert_eq(g_r.code, 0, "%s", g_r.out);
            double largest = figure_mib("peak per device: ");
            train_as_planned(args, n, mo == 1);
            double measured = figure_mib("tp memory, rank 0: device peak ");
            double planned = figure_mib("MiB measured (allocator), ");
            cr_assert(fabs(planned - measured) < 0.005 && largest == planned, "%s, buckets %s: "
                      "plan %.2f MiB, train's plan %.2f, measured %.2f", models[mo].model,
                      b ? "0.02" : "25", largest, planned, measured);
            peak[b] = measured;
        }
        cr_assert(peak[1] < peak[0], "%s: peak with buckets %.2f MiB, without %.2f",
                  models[mo].model, peak[1], peak[0]);
    }
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(cli_plan, refuses_what_it_does_not_plan)
{
    CLI(&g_r, "plan", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,pp=2");
    expect(&g_r, 2, "a pipeline of tensor-parallel stages is --mode pp's, not planned yet");
    /* what tp's training refuses is not planned either */
    CLI(&g_r, "plan", "--mode", "tp", "--device", "cpu:2", "--checkpoint-activations", "2");
    expect(&g_r, 2, "segments of more are not built for tp");
    /* the levers' checks are train's, said as plan's (they said "tandem
     * train:" before) */
    cr_assert(strstr(g_r.out, "tandem plan: --checkpoint-activations 2") &&
                  !strstr(g_r.out, "tandem train:"), "%s", g_r.out);
    /* --offload of two kinds: one clear refusal in both (train kept the
     * last one silently before) */
    CLI(&g_r, "plan", "--mode", "fsdp", "--device", "cuda:0,1", "--offload", "params",
        "--offload", "optimizer");
    expect(&g_r, 2, "tandem plan: --offload params and --offload optimizer: give --offload once");
    CLI(&g_r, "train", "--mode", "fsdp", "--device", "cuda:0,1", "--offload", "optimizer",
        "--offload", "params");
    expect(&g_r, 2, "tandem train: --offload optimizer and --offload params: give --offload "
                    "once");
    CLI(&g_r, "plan", "--mode", "tp", "--device", "cuda:0,1", "--offload", "optimizer");
    expect(&g_r, 2, "--mode tp does not support --offload");
    CLI(&g_r, "plan", "--mode", "ddp", "--device", "cpu:2", "--sequence-parallel");
    expect(&g_r, 2, "--sequence-parallel applies to --mode tp");
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cpu:4", "--stages", "3");
    expect(&g_r, 2, "--stages 3 does not divide the 4 devices");
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--model",
        "cnn");
    expect(&g_r, 2, "the CNN's is not");
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=3");
    expect(&g_r, 2, "--mesh");
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cpu:2", "--sharding", "optimizer");
    expect(&g_r, 2, "it needs --mesh dp=D,pp=S with D >= 2");
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cpu:4", "--stages", "2", "--sharding",
        "full");
    expect(&g_r, 2, "shard only the optimizer state");
    CLI(&g_r, "plan", "--mode", "ddp", "--device", "cpu:2", "--mesh", "dp=2");
    expect(&g_r, 2, "--mesh applies to --mode pp and tp");
    CLI(&g_r, "plan", "--mode", "pp", "--device", "cpu:2", "--model", "mlp:20-10");
    expect(&g_r, 2, "expected 1 <= S <= layers");
    CLI(&g_r, "plan", "--mode", "ddp", "--device", "cpu:2", "--microbatches", "4");
    expect(&g_r, 2, "apply to --mode pp");
    CLI(&g_r, "plan", "--mode", "dp", "--device", "cuda:0,1", "--offload", "optimizer");
    expect(&g_r, 2, "not with --mode dp");
    CLI(&g_r, "plan", "--mode", "ddp", "--sharding", "full", "--device", "cpu:2");
    expect(&g_r, 2, "--sharding applies to --mode fsdp");
    CLI(&g_r, "plan", "--mode", "fsdp", "--sharding", "zero9", "--device", "cpu:2");
    expect(&g_r, 2, "--sharding");
    CLI(&g_r, "plan", "--precision", "fp8");
    expect(&g_r, 2, "--precision");
    CLI(&g_r, "plan", "--bogus");
    expect(&g_r, 2, "unknown option '--bogus'");
    CLI(&g_r, "plan", "--help");
    expect(&g_r, 0, "usage: tandem plan");
}

/* The tp plan takes every lever tp trains with: activation checkpointing
 * (each block's recomputed activations share one set:
 * tdm_tp_footprint_ckpt), clipping (the norm's partial sums in the
 * device's scratch) and --precision bf16|fp16 (the products' 16-bit
 * operand block, sized by the largest product, and on a host device in
 * fp16 the float32 widening of its operands): train prints its plan
 * beside rank 0's measured peak, equal as printed, and `tandem plan` the
 * same figure, for the MLP at tp = 1, 2, 4 and the GPT at tp = 1, 2 and
 * dp=2 x tp=2, in fp32, bf16 and fp16, with checkpointing, clipping,
 * sequence parallelism and ZeRO-1 over dp. Before, a 16-bit precision
 * was refused ("is not planned") and train printed no plan. */
Test(cli_plan, tp_plans_every_lever, .timeout = 900)
{
    static const struct { const char *model, *batch, *dev, *mesh; } layouts[] = {
        {"mlp:784-256-128-10", "64", "cpu", NULL},
        {"mlp:784-256-128-10", "64", "cpu:2", NULL},
        {"mlp:784-256-128-10", "64", "cpu:4", NULL},
        {"gpt:2-32-2-16", "8", "cpu", NULL},
        {"gpt:2-32-2-16", "8", "cpu:2", NULL},
        {"gpt:2-32-2-16", "8", "cpu:4", "dp=2,tp=2"}};
    static const char *const levers[][6] = {
        {"--precision", "fp32", "--checkpoint-activations"},
        {"--precision", "bf16"},
        {"--precision", "bf16", "--checkpoint-activations", "--clip-grad-norm", "1"},
        {"--precision", "fp16", "--clip-grad-norm", "1"},
        {"--precision", "fp16", "--checkpoint-activations"}};
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++)
        for (size_t v = 0; v < sizeof levers / sizeof levers[0]; v++) {
            int gpt = layouts[l].model[0] == 'g';
            const char *args[32] = {"plan", "--model", layouts[l].model, "--batch",
                                    layouts[l].batch, "--mode", "tp", "--device",
                                    layouts[l].dev};
            int n = 9;
            if (layouts[l].mesh) {
                args[n++] = "--mesh";
                args[n++] = layouts[l].mesh;
                args[n++] = "--sharding";
                args[n++] = "optimizer";
            } else if (gpt && v == 2 && strcmp(layouts[l].dev, "cpu")) {
                args[n++] = "--sequence-parallel";
            }
            for (int i = 0; i < 6 && levers[v][i]; i++) args[n++] = levers[v][i];
            args[n] = NULL;
            char what[160];
            snprintf(what, sizeof what, "%s tp on %s%s%s %s%s%s", layouts[l].model,
                     layouts[l].dev, layouts[l].mesh ? " " : "",
                     layouts[l].mesh ? layouts[l].mesh : "", levers[v][1],
                     levers[v][2] ? " " : "", levers[v][2] ? levers[v][2] : "");
            cli_run(&g_r, args);
            cr_assert_eq(g_r.code, 0, "%s: %s", what, g_r.out);
            cr_assert(strstr(g_r.out, levers[v][1]), "%s: %s", what, g_r.out);
            double largest = figure_mib("peak per device: ");
            train_as_planned(args, n, gpt);
            double measured = figure_mib("tp memory, rank 0: device peak ");
            double planned = figure_mib("MiB measured (allocator), ");
            cr_assert(fabs(planned - measured) < 0.005, "%s: planned %.2f, measured %.2f", what,
                      planned, measured);
            cr_assert_eq(largest, planned, "%s: plan %.2f, train's %.2f", what, largest,
                         planned);
        }
    cr_assert_eq(cli_shm_entries(), 0);
}

/* Evaluation between epochs runs at the step's batch (its replica's
 * share; a pipeline's micro-batches, its last stage one activation set)
 * through the step's own buffers, so the peak `train` measures with it
 * is the step's, which `tandem plan` predicts: every mode on the MLP,
 * the CNN and the GPT with evaluation (a test set of 200 images, larger
 * than the batch; the GPT's validation windows, more than its batch),
 * planned equal to the measured peak as printed (FSDP within 5%, its
 * plan's timing term: measured equal in every case but a loaded run's
 * CNN, 14.71 MiB against 14.77). Before, evaluation ran
 * in batches of 1000 images (32 windows) and grew the activations: the
 * MLP 784-48-24-10 at batch 64 measured 6.79 MiB against 0.85 planned,
 * and a pipeline's last stage kept two evaluation sets to the step's
 * one (the CNN's third stage of three: 6.73 MiB against 6.05). */
Test(cli_plan, planned_equals_measured_with_evaluation, .timeout = 900)
{
    static const struct { const char *model, *batch; } models[] = {
        {"mlp:784-256-128-10", "64"}, {"cnn", "32"}, {"gpt:2-32-2-16", "8"}};
    static const char *const layouts[][6] = {
        {"single", "--device", "cpu"},
        {"dp", "--device", "cpu:2"},
        {"ddp", "--device", "cpu:2"},
        {"fsdp", "--device", "cpu:2"},
        {"fsdp", "--device", "cpu:2", "--sharding", "optimizer"},
        {"pp", "--device", "cpu:3"},
        {"pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2"},
        {"tp", "--device", "cpu:2"},
        {"tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2"}};
    static const char *const measured_at[] = {
        "peak memory on cpu:0: ", "peak memory on the master's cpu:0: ",
        "peak memory on rank 0's cpu:0: ", "peak memory on rank 0's cpu:0: ",
        "peak memory on rank 0's cpu:0: "};
    double worst = 0.0;
    g_eval = 1;
    for (int mo = 0; mo < 3; mo++)
        for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
            int pp = !strcmp(layouts[l][0], "pp"), tp = !strcmp(layouts[l][0], "tp");
            if (tp && mo == 1) continue;   /* tp: the MLP and the GPT */
            const char *args[32] = {"plan", "--model", models[mo].model, "--batch",
                                    models[mo].batch, "--mode", layouts[l][0]};
            int n = 7;
            for (int i = 1; i < 6 && layouts[l][i]; i++) args[n++] = layouts[l][i];
            args[n++] = "--precision";
            args[n++] = mo == 2 ? "bf16" : "fp32";
            args[n] = NULL;
            char what[160];
            snprintf(what, sizeof what, "%s %s %s %s, with evaluation", models[mo].model,
                     layouts[l][0], layouts[l][2], layouts[l][4] ? layouts[l][4] : "");
            if (pp) {
                pp_case(args, n, mo == 2, layouts[l][2][4] - '0', what, &worst);
                continue;
            }
            cli_run(&g_r, args);
            cr_assert_eq(g_r.code, 0, "%s: %s", what, g_r.out);
            double planned = figure_mib("peak per device: ");
            train_as_planned(args, n, mo == 2);
            cr_assert(strstr(g_r.out, mo == 2 ? "val loss " : "test loss "), "%s: %s", what,
                      g_r.out);
            double measured = figure_mib(tp ? "tp memory, rank 0: device peak "
                                            : measured_at[l < 5 ? l : 4]);
            if (fabs(planned - measured) > fabs(worst)) worst = planned - measured;
            /* FSDP's pool peak depends on when a reduce-scatter ends (the
             * plan assumes one timing): within 5%, as without evaluation */
            if (!strcmp(layouts[l][0], "fsdp"))
                cr_assert(fabs(planned - measured) <= 0.05 * measured, "%s: planned %.2f MiB, "
                          "measured %.2f MiB", what, planned, measured);
            else
                cr_assert(fabs(planned - measured) < 0.005, "%s: planned %.2f MiB, measured "
                          "%.2f MiB", what, planned, measured);
        }
    g_eval = 0;
    cr_log_info("plan vs measured with evaluation: worst %+.2f MiB", worst);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* The 3-D mesh (--mode pp --mesh dp=D,pp=S,tp=N: tools/rank_pptp.c):
 * a rank's stage is the narrow spec's stage (its slices; the partial
 * sums all-reduced in place), which `tandem plan --mode pp` plans:
 * compare --json's measured peak of every stage (replica 0's, tp rank
 * 0's) equals its plan to the byte and plan's figure as printed, for the
 * MLP (784-1024-1024-10) and the GPT on dp=2 x pp=2 x tp=2 and the GPT
 * on pp=2 x tp=2. The set-up builds only its stage's layers of the whole
 * model to slice them (train prints the host bytes): less than the whole
 * model's parameters and gradients, which it built before on every rank
 * (with the narrow model's whole parameters beside them: the MLP's stage
 * 0 measured 19.3 MiB before, 9.2 now; the GPT 4-128-4-128's 8.1, 4.3). Before, plan refused
 * tensor-parallel stages and compare planned none ("-", null). */
Test(cli_plan, planned_pp_tp_mesh_equals_measured, .timeout = 600)
{
    static const struct { const char *model, *batch, *dev, *mesh; } cases[] = {
        {"mlp", "64", "cpu:8", "dp=2,pp=2,tp=2"},
        {"gpt:2-32-2-16", "8", "cpu:8", "dp=2,pp=2,tp=2"},
        {"gpt:2-32-2-16", "8", "cpu:4", "pp=2,tp=2"}};
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "planpt");
    const char *json = tu_tpath(dir, "c.json");
    for (int c = 0; c < 3; c++) {
        int gpt = cases[c].model[0] == 'g';
        const char *args[32] = {"plan", "--model", cases[c].model, "--batch", cases[c].batch,
                                "--mode", "pp", "--device", cases[c].dev, "--mesh",
                                cases[c].mesh, NULL};
        cli_run(&g_r, args);
        cr_assert_eq(g_r.code, 0, "%s", g_r.out);
        double planned[64];
        int S = plan_stages(planned, 64);
        cr_assert_eq(S, 2, "%s", g_r.out);
        const char *cmp[32] = {"compare", "--model", cases[c].model, "--batch", cases[c].batch,
                               "--steps", "3", "--modes", "pp", "--device", cases[c].dev,
                               "--mesh", cases[c].mesh, "--json", json};
        int n = 15;
        if (!gpt) {
            cmp[n++] = "--data";
            cmp[n++] = "synthetic";
        }
        cmp[n] = NULL;
        cli_run(&g_r, cmp);
        cr_assert_eq(g_r.code, 0, "%s", g_r.out);
        FILE *f = fopen(json, "r");
        cr_assert_not_null(f);
        static char text[1 << 20];
        size_t got = fread(text, 1, sizeof text - 1, f);
        fclose(f);
        text[got] = 0;
        int k = 0;
        for (const char *q = strstr(text, "\"pipeline\""); q && (q = strstr(q, "{\"stage\": "));
             q++, k++) {
            double m = strtod(strstr(q, "\"peak_measured\": ") + 17, NULL);
            double p = strtod(strstr(q, "\"peak_planned\": ") + 16, NULL);
            cr_assert(m > 0 && m == p, "%s %s stage %d: planned %.0f bytes, measured %.0f",
                      cases[c].model, cases[c].mesh, k, p, m);
            cr_assert(k < S && fabs(p / 1048576.0 - planned[k]) < 0.005, "%s stage %d: compare's "
                      "plan %.0f bytes, tandem plan's %.2f MiB", cases[c].model, k, p,
                      planned[k]);
        }
        cr_assert_eq(k, S, "%s: %s", cases[c].model, text);
        /* the set-up's host memory: the stage's whole layers, not the model */
        const char *tr[32] = {"plan", "--model", cases[c].model, "--batch", cases[c].batch,
                              "--mode", "pp", "--device", cases[c].dev, "--mesh", cases[c].mesh,
                              NULL};
        train_as_planned(tr, 11, gpt);
        const char *line = strstr(g_r.out, "its set-up built its stage's whole layers in ");
        cr_assert_not_null(line, "%s", g_r.out);
        double setup = strtod(line + strlen("its set-up built its stage's whole layers in "),
                              NULL);
        const char *one[] = {"plan", "--model", cases[c].model, "--batch", cases[c].batch, NULL};
        cli_run(&g_r, one);
        cr_assert_eq(g_r.code, 0, "%s", g_r.out);
        const char *pa = strstr(g_r.out, "  parameters "), *gr = strstr(g_r.out, "  gradients ");
        cr_assert(pa && gr, "%s", g_r.out);
        double whole = strtod(pa + strlen("  parameters "), NULL) +
                       strtod(gr + strlen("  gradients "), NULL);
        cr_assert(setup > 0 && setup < whole, "%s: the set-up held %.3f MiB of host memory, the "
                  "whole model's parameters and gradients %.3f", cases[c].model, setup, whole);
    }
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}
