/* tests/test_pp_tp_file.c: model files through a pipeline of
 * tensor-parallel stages (`tandem train --mode pp --mesh
 * dp=D,pp=S,tp=N --model file:...`, models/stage.h's
 * tdm_model_spec_tp_stages): each stage's linear layers in column/row
 * pairs, the elementwise layers between them on the rank's columns,
 * every other layer whole on every rank.
 * - examples/models/mlp_dropout.tdm on pp=2,tp=2 ends where one device
 *   ends with --grad-accum 4 over the same micro-batches (dropout inside
 *   a pair drops what one device drops: measured 1.0e-7 after 10 steps),
 *   and on dp=2,pp=2,tp=2 where dp=2,pp=2 ends (5.2e-8; dropout's masks
 *   count each replica's forwards, so a dp mesh is judged against the
 *   same mesh without tp), checked at tests/test_tp_cli.c's 1e-5;
 * - examples/models/lenet5.tdm: its convolutions run whole on every rank,
 *   its linear layers split (measured 3.0e-8 after 3 steps);
 * - a layer a pair cannot hold (layernorm) and a width the group does not
 *   divide are one line naming the file's line, exit 2. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

#define DROP "file:examples/models/mlp_dropout.tdm"
#define LENET "file:examples/models/lenet5.tdm"
#define TOL 1e-5

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "pp_tp_file"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(pp_tp_file, .init = setup, .fini = teardown, .timeout = 240);

static void path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s.safetensors", g_dir, name);
}

/* --mode pp on dev with mesh (NULL: single with --batch 8 --grad-accum 4,
 * the pipeline's 4 micro-batches of 8). */
static void run(const char *model, const char *dev, const char *mesh, const char *steps,
                const char *save, const char *says)
{
    static cli_result r;
    if (mesh)
        CLI(&r, "train", "--mode", "pp", "--device", dev, "--mesh", mesh, "--model", model,
            "--data", "synthetic", "--batch", "32", "--epochs", "1", "--max-steps", steps,
            "--no-eval", "--quiet", "--save", save);
    else
        CLI(&r, "train", "--mode", "single", "--model", model, "--data", "synthetic",
            "--batch", "8", "--grad-accum", "4", "--epochs", "1", "--max-steps", steps,
            "--no-eval", "--quiet", "--save", save);
    expect(&r, 0, says);
}

Test(pp_tp_file, the_mlp_file_with_dropout_splits_its_pairs)
{
    char one[128], m4[128], d4[128], m8[128];
    path(one, sizeof one, "single");
    path(m4, sizeof m4, "pp2tp2");
    path(d4, sizeof d4, "dp2pp2");
    path(m8, sizeof m8, "dp2pp2tp2");
    const char *says = "x tp 2 (fc1 column, fc2 row, fc3 replicated)";
    run(DROP, NULL, NULL, "10", one, "train loss");
    run(DROP, "cpu:4", "pp=2,tp=2", "10", m4, says);
    run(DROP, "cpu:4", "dp=2,pp=2", "10", d4, "train loss");
    run(DROP, "cpu:8", "dp=2,pp=2,tp=2", "10", m8, says);
    double a = ck_diff_of(DROP, one, m4), b = ck_diff_of(DROP, d4, m8);
    cr_assert(a <= TOL && b <= TOL, "pp=2,tp=2 vs single %g, dp=2,pp=2,tp=2 vs dp=2,pp=2 %g", a,
              b);
}

Test(pp_tp_file, lenet_runs_its_convolutions_whole_and_splits_its_linear_layers)
{
    char one[128], m4[128];
    path(one, sizeof one, "single");
    path(m4, sizeof m4, "pp2tp2");
    run(LENET, NULL, NULL, "3", one, "train loss");
    run(LENET, "cpu:4", "pp=2,tp=2", "3", m4, "x tp 2 (fc1 column, fc2 row, fc3 replicated)");
    double d = ck_diff_of(LENET, one, m4);
    cr_assert(d <= TOL, "pp=2,tp=2 vs single %g", d);
}

Test(pp_tp_file, what_a_pair_cannot_hold_is_one_line_naming_the_line)
{
    static const struct {
        const char *text, *says;
    } bad[] = {
        {"input 20\nlinear 24\nlayernorm\nlinear 16\nrelu\nlinear 5\n",
         "line 3: `layernorm` stands between the column-parallel linear of line 2 and its "
         "row-parallel linear: a pipeline of tensor-parallel stages cannot split it: layernorm "
         "normalises over all of a sample's features"},
        {"input 20\nlinear 25\ngelu\nlinear 16\nrelu\nlinear 5\n",
         "line 2: stage 0: linear 25's output width (line 4's input) is not divisible by the 2 "
         "tensor-parallel ranks"},
        /* the block's input is the column layer's slice: its skip (a
         * projection of the slice) was added unsummed, silently wrong */
        {"input 20\nlinear 24\ngelu\nlinear 20\nlinear 16\nresidual {\ngelu\nlinear 16\n} "
         "proj\nlinear 5\n",
         "line 6: `residual {` opens between the column-parallel linear of line 5 and its "
         "row-parallel linear of line 8: a pipeline of tensor-parallel stages cannot split it: "
         "the block's skip path needs its whole input"},
        {"input 20\nlinear 24\ngelu\nlinear 20\nlinear 16\nrelu\nresidual {\ngelu\nlinear "
         "16\n}\nlinear 5\n",
         "line 7: `residual {` opens between the column-parallel linear of line 5 and its "
         "row-parallel linear of line 9"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char file[128], spec[160];
        snprintf(file, sizeof file, "%s/bad%zu.tdm", g_dir, k);
        snprintf(spec, sizeof spec, "file:%s", file);
        FILE *f = fopen(file, "w");
        cr_assert_not_null(f);
        fputs(bad[k].text, f);
        cr_assert_eq(fclose(f), 0);
        static cli_result r;
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", "--split",
            "0,3", "--model", spec, "--data", "synthetic");
        expect(&r, 2, bad[k].says);
        const char *nl = strchr(r.out, '\n');
        cr_assert(nl && !nl[1], "more than one line:\n%s", r.out);
    }
}
