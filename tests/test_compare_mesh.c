/* tests/test_compare_mesh.c: `tandem compare --mesh`: the pp row as
 * dp=D x pp=S (DDP over the replicas of each stage) and as dp=2 x pp=2 x
 * tp=2 on 8 host devices (tensor-parallel stages), the tp row as dp=D x
 * tp=N, each judged against one host device on the same global batches
 * within the row's bound (the replicas' sum and the row-parallel sums add
 * in another order: not bit for bit); the tp row's all-reduce bytes per
 * rank equal the plan's for its replica's share of the batch, the
 * tensor-parallel stages' the partial sums of their pairs; and the meshes
 * it cannot run (a product that is not the device count, a mesh for a row
 * not in --modes, --stages against the mesh, widths the group does not
 * divide) are one line and exit 2. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

#define MLP "--model", "mlp:20-24-16-12-5"
#define SYN "--data", "synthetic"

static void teardown(void)
{
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(compare_mesh, .fini = teardown, .timeout = 240);

Test(compare_mesh, the_tp_row_runs_dp_x_tp)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP,
        SYN, "--batch", "32", "--steps", "4", "--warmup", "1");
    expect(&r, 0, "Tensor parallel: dp(2) x tp(2)");
    expect(&r, 0, "dp grad sum");
    expect(&r, 0, "dp(2) x tp(2): largest parameter difference");
    expect(&r, 0, "over 4 steps -> PASS");
    /* each replica's 16 samples: 16 * (16 + 5 + 16) floats in 3 calls */
    expect(&r, 0, "rank 3: params");
    expect(&r, 0, "payload handed to the communicator 2368 bytes per step in 3.0 calls (the "
                  "plan: 2368 bytes in 3)");
    /* uneven shares: replica 0 runs 9 samples, replica 1 8 */
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MLP,
        SYN, "--batch", "17", "--steps", "2", "--warmup", "0");
    expect(&r, 0, "(the plan: 1332 bytes in 3)");
    expect(&r, 0, "(the plan: 1184 bytes in 3)");
    expect(&r, 0, "-> PASS");
}

Test(compare_mesh, the_pp_row_runs_dp_x_pp)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MLP,
        SYN, "--batch", "32", "--steps", "4", "--warmup", "1");
    expect(&r, 0, "Pipeline: dp(2) x pp(2), 1f1b, 4 micro-batches of 4 per replica");
    expect(&r, 0, "replica 0's stages");
    expect(&r, 0, "grad sync");
    expect(&r, 0, "--grad-accum 8 over the same micro-batches of 4");
    expect(&r, 0, "dp(2) x pp(2): largest parameter difference");
    expect(&r, 0, "-> PASS (DDP adds each replica's sum");
    /* dp=1: the plain pipeline, bit for bit */
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:2", "--mesh", "pp=2", MLP, SYN,
        "--batch", "16", "--steps", "2", "--warmup", "0");
    expect(&r, 0, "Pipeline: pp(2)");
    expect(&r, 0, "BITWISE IDENTICAL");
}

/* Dropout's masks are keyed on the training forwards one device counts:
 * replica r's micro-batch mb is one device's accumulation step r*M + mb,
 * and every replica ends the step at D*M, so the masks are one device's. */
Test(compare_mesh, the_pp_row_with_dropout_matches_one_device)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2",
        "--model", "file:examples/models/mlp_dropout.tdm", SYN, "--batch", "32",
        "--steps", "3", "--warmup", "1");
    expect(&r, 0, "--grad-accum 8 over the same micro-batches of 4");
    expect(&r, 0, "-> PASS (DDP adds each replica's sum");
}

Test(compare_mesh, the_pp_row_runs_dp_x_pp_x_tp)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2",
        MLP, SYN, "--batch", "32", "--steps", "4", "--warmup", "1");
    expect(&r, 0, "Pipeline: dp(2) x pp(2) x tp(2) (each stage tensor-parallel)");
    expect(&r, 0, "tp sums");
    /* the balanced split: stage 1 is fc2 (column) fc3 (row) fc4: per
     * micro-batch of 4, fc3's product 4 x 12 and fc2's input gradient
     * 4 x 24 floats, 4 micro-batches */
    expect(&r, 0, "stage 1's tp sums: 8.0 all-reduces of 2304 bytes per step");
    expect(&r, 0, "dp(2) x pp(2) x tp(2): largest parameter difference");
    expect(&r, 0, "-> PASS (the stages' row-parallel products");
}

/* The default GPT's pipeline against one device with --grad-accum: its
 * tied embedding's two shares add in another order, so the row is judged
 * within compare's last-step bound (atol + rtol |b|), the bound every
 * other non-bitwise row uses. An absolute 1e-4 failed here after 20
 * steps of AdamW (0.000111 on a parameter of magnitude near 0.1). */
Test(compare_mesh, the_default_gpt_pipeline_passes_after_20_steps, .timeout = 600)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:2", "--model", "gpt", "--steps",
        "20");
    expect(&r, 0, "pp(2): largest parameter difference");
    expect(&r, 0, "of the allowed atol 1e-04 + rtol 1e-03 |b|), loss rel");
    expect(&r, 0, "-> PASS (the GPT's tied embedding");
}

Test(compare_mesh, meshes_it_cannot_run_are_one_line)
{
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:8", "--mesh", "dp=2,pp=2,tp=2",
        "--model", "mlp:20-24-15-12-5", SYN);
    expect(&r, 2, "stage 1: layer fc2's output width 15 (fc3's input) is not divisible by the 2");
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:4", "--mesh", "dp=3,tp=2", SYN);
    expect(&r, 2, "6 ranks (dp x pp x tp), but the job has 4");
    CLI(&r, "compare", "--modes", "single,ddp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", SYN);
    expect(&r, 2, "lays out the tp row: add tp to --modes");
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "dp=4", SYN);
    expect(&r, 2, "names neither pp nor tp");
    CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2",
        "--stages", "4", SYN);
    expect(&r, 2, "--stages 4, but --mesh dp=2,pp=2 has pp=2");
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2",
        "--model", "mlp:20-25-5", SYN);
    expect(&r, 2, "is not divisible by the 2 tensor-parallel ranks");
    /* one line, nothing else */
    const char *nl = strchr(r.out, '\n');
    cr_assert(nl && !nl[1], "%s", r.out);
}
