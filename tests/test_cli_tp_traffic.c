/* tests/test_cli_tp_traffic.c: `tandem train --mode tp`'s communication
 * line counts what the tensor-parallel communicator carried in the
 * training passes, which is the plan's collectives per pass times the
 * passes exactly (tp/tp.h's tdm_tp_step_traffic, with checkpointing's
 * recomputed forward collectives): not the set-up's two checks (the
 * configuration and the set-up's outcome, all-gathers on the same
 * communicator on host devices), nor the evaluation's forwards. Before,
 * the line counted the whole run: with sequence parallelism 2
 * all-gathers over the plan's per run (10 of 8 in one step; 26 of 24 in
 * three), and with evaluation every evaluation forward's collectives. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_util.h"

TestSuite(cli_tp_traffic, .timeout = 240);

/* The line's counts: all-reduces, passes, plan's all-reduces per pass;
 * with sequence parallelism reduce-scatters, all-gathers and the plan's
 * per pass of each (else 0). */
typedef struct traffic_line {
    long long ar, passes, ar_plan, rs, ag, rs_plan, ag_plan;
} traffic_line;

static traffic_line traffic(const char *out)
{
    traffic_line t = {0};
    const char *p = strstr(out, "tp communication, rank 0: ");
    cr_assert_not_null(p, "no communication line in:\n%s", out);
    double mib;
    int n = sscanf(p, "tp communication, rank 0: %lld all-reduces of %lf MiB in the %lld "
                      "training passes (counted by the communicator; %lld per pass",
                   &t.ar, &mib, &t.passes, &t.ar_plan);
    cr_assert_eq(n, 4, "%.300s", p);
    const char *rs = strstr(p, "), ");
    const char *eol = strchr(p, '\n');
    if (rs && (!eol || rs < eol)) {
        double a, b;
        n = sscanf(rs, "), %lld reduce-scatters of %lf MiB and %lld all-gathers of %lf MiB "
                       "(%lld and %lld per pass)", &t.rs, &a, &t.ag, &b, &t.rs_plan,
                   &t.ag_plan);
        cr_assert_eq(n, 6, "%.300s", rs);
    }
    return t;
}

Test(cli_tp_traffic, counted_equals_plan_times_passes)
{
    static const struct { const char *model, *dev, *extra[6]; int sp; } cases[] = {
        {"gpt:2-32-2-16", "cpu:2", {NULL}, 0},
        {"gpt:2-32-2-16", "cpu:2", {"--sequence-parallel"}, 1},
        {"gpt:2-32-2-16", "cpu:2", {"--sequence-parallel", "--checkpoint-activations"}, 1},
        {"gpt:2-32-2-16", "cpu:4", {"--mesh", "dp=2,tp=2", "--sequence-parallel",
                                    "--clip-grad-norm", "1"}, 1},
        {"mlp:784-256-128-10", "cpu:2", {"--data", "synthetic", "--synthetic-size", "1200",
                                         "--grad-accum", "2"}, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *args[32] = {"train", "--model", cases[c].model, "--batch", "8", "--mode",
                                "tp", "--device", cases[c].dev, "--epochs", "1", "--max-steps",
                                "3", "--quiet"};
        int n = 14;
        for (int i = 0; i < 6 && cases[c].extra[i]; i++) args[n++] = cases[c].extra[i];
        args[n] = NULL;
        cli_result r;
        cli_run(&r, args);
        cr_assert_eq(r.code, 0, "%s", r.out);
        /* evaluation ran (its forwards' collectives are not counted) */
        cr_assert(strstr(r.out, "val loss ") || strstr(r.out, "test loss "), "%s", r.out);
        traffic_line t = traffic(r.out);
        long long passes = strstr(cases[c].model, "mlp") ? 6 : 3;   /* --grad-accum 2 */
        cr_assert_eq(t.passes, passes, "case %zu: %s", c, r.out);
        cr_assert_eq(t.ar, t.ar_plan * passes, "case %zu: %lld all-reduces, the plan %lld x %lld",
                     c, t.ar, t.ar_plan, passes);
        if (cases[c].sp) {
            cr_assert(t.rs_plan > 0 && t.ag_plan > 0, "case %zu: %s", c, r.out);
            cr_assert_eq(t.rs, t.rs_plan * passes, "case %zu: %lld reduce-scatters, the plan "
                         "%lld x %lld", c, t.rs, t.rs_plan, passes);
            cr_assert_eq(t.ag, t.ag_plan * passes, "case %zu: %lld all-gathers, the plan %lld "
                         "x %lld", c, t.ag, t.ag_plan, passes);
        }
    }
    cr_assert_eq(cli_shm_entries(), 0);
}
