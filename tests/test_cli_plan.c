/* tests/test_cli_plan.c: `tandem plan` before a run against the
 * allocator's peak `tandem train` measures with the same options
 * (--no-eval: the training step's), --mode single and --mode ddp on
 * cpu:2, for the MLP and the GPT in fp32, bf16 with checkpointing and
 * fp16 with clipping: equal as printed (to 0.01 MiB; the single-device
 * plan is exact to the byte, tests/test_plan.c, and a DDP rank on a host
 * device holds its model at its share of the batch, DDP's buckets being
 * in the job's shared memory). Modes not planned are refused (exit 2). */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"

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

Test(cli_plan, refuses_what_it_does_not_plan)
{
    CLI(&g_r, "plan", "--mode", "fsdp", "--device", "cpu:2");
    expect(&g_r, 2, "fsdp's shards and gathered units");
    CLI(&g_r, "plan", "--precision", "fp8");
    expect(&g_r, 2, "--precision");
    CLI(&g_r, "plan", "--bogus");
    expect(&g_r, 2, "unknown option '--bogus'");
    CLI(&g_r, "plan", "--help");
    expect(&g_r, 0, "usage: tandem plan");
}
