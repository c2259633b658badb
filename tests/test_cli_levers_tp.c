/* tests/test_cli_levers_tp.c: the memory levers in `tandem train --mode
 * tp` and `--mesh dp=D,tp=N`, end to end:
 * - --clip-grad-norm: the MLP on 2 and 4 tensor-parallel ranks and on
 *   dp=2 x tp=2, and the GPT on 2 ranks (also sequence parallel) and on
 *   dp=2 x tp=2, end their epochs with the loss and the global gradient
 *   norm --mode single prints on the same global batches (4 significant
 *   digits: the row-parallel sums differ from one device's by float
 *   rounding, tests/test_tp_levers.c bounds it), and write single's
 *   checkpoint within tests/test_tp.c's bounds (1e-5 MLP, 1e-4 GPT);
 * - what tp does not build yet is one line and exit 2. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

#define MODEL "mlp:20-24-16-12-5"
#define MLP "--model", MODEL
#define SYN "--data", "synthetic", "--synthetic-size", "200"
#define GPT_MODEL "gpt:2-32-2-16"

static char g_dir[64];
static cli_result g_r;

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "lvtp"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(levers_tp, .init = setup, .fini = teardown, .timeout = 300);

static void ok(const char *what)
{
    cr_assert_eq(g_r.code, 0, "%s: exit %d:\n%s", what, g_r.code, g_r.out);
}

static const char *path(const char *name)
{
    static char buf[4][128];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s.safetensors", g_dir, name);
    return buf[k];
}

/* The epoch line's "train loss X" and "grad norm Y" into buf. */
static void epoch_line(const char *epoch, char *buf, size_t n)
{
    char loss[128];
    epoch_result(g_r.out, epoch, loss, sizeof loss);
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *line = strstr(g_r.out, key), *g = line ? strstr(line, "grad norm ") : NULL;
    const char *eol = line ? strchr(line, '\n') : NULL;
    cr_assert(g && (!eol || g < eol), "no grad norm on the %s line:\n%s", epoch, g_r.out);
    snprintf(buf, n, "%s | %.*s", loss, (int)strcspn(g, "("), g);
}

#define MLP_RUN MLP, SYN, "--batch", "32", "--epochs", "2", "--no-eval", "--quiet", \
                "--clip-grad-norm", "0.05"

Test(levers_tp, the_mlp_clipped_over_tp_prints_one_devices_loss_and_norm)
{
    char one[2][256], got[256];
    CLI(&g_r, "train", "--mode", "single", MLP_RUN, "--save", path("one"));
    ok("single");
    epoch_line("epoch 1/2", one[0], sizeof one[0]);
    epoch_line("epoch 2/2", one[1], sizeof one[1]);
    static const char *const layouts[][4] = {
        {"cpu:2", NULL}, {"cpu:4", NULL}, {"cpu:4", "--mesh", "dp=2,tp=2", NULL}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const char *const *l = layouts[i];
        CLI(&g_r, "train", "--mode", "tp", "--device", l[0], MLP_RUN, "--save", path("tp"),
            l[1] ? l[1] : "--quiet", l[1] ? l[2] : "--quiet");
        ok(l[0]);
        cr_assert(strstr(g_r.out, "memory levers on every rank: precision fp32, global gradient "
                                  "norm clipped to 0.05"), "%s", g_r.out);
        epoch_line("epoch 1/2", got, sizeof got);
        cr_assert_str_eq(got, one[0], "%s %s", l[0], l[1] ? l[2] : "");
        epoch_line("epoch 2/2", got, sizeof got);
        cr_assert_str_eq(got, one[1], "%s %s", l[0], l[1] ? l[2] : "");
        double d = ck_diff_of(MODEL, path("tp"), path("one"));
        cr_assert(d <= 1e-5, "%s %s: the clipped tp checkpoint is %g off single's", l[0],
                  l[1] ? l[2] : "", d);
    }
}

#define GPT_RUN "--model", GPT_MODEL, "--epochs", "1", "--max-steps", "6", "--batch", "8", \
                "--quiet", "--no-eval", "--clip-grad-norm", "0.1"

Test(levers_tp, the_gpt_clipped_over_tp_prints_one_devices_loss_and_norm)
{
    char one[256], got[256];
    CLI(&g_r, "train", "--mode", "single", GPT_RUN, "--save", path("one"));
    ok("gpt single");
    epoch_line("epoch 1/1", one, sizeof one);
    static const char *const layouts[][4] = {{"cpu:2", NULL},
                                             {"cpu:2", "--sequence-parallel", NULL},
                                             {"cpu:4", "--mesh", "dp=2,tp=2", NULL}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const char *const *l = layouts[i];
        CLI(&g_r, "train", "--mode", "tp", "--device", l[0], GPT_RUN, "--save", path("tp"),
            l[1] ? l[1] : "--quiet", l[1] && l[2] ? l[2] : "--quiet");
        ok(l[0]);
        epoch_line("epoch 1/1", got, sizeof got);
        cr_assert_str_eq(got, one, "%s %s", l[0], l[1] ? l[1] : "");
        double d = ck_diff_of(GPT_MODEL, path("tp"), path("one"));
        cr_assert(d <= 1e-4, "%s %s: the clipped tp GPT checkpoint is %g off single's", l[0],
                  l[1] ? l[1] : "", d);
    }
}

Test(levers_tp, what_tp_does_not_build_is_refused_in_one_line)
{
    static const struct {
        const char *a[2];
        const char *says;
    } bad[] = {
        {{"--checkpoint-activations", "1"}, "--mode tp does not support"},
        {{"--offload", "optimizer"}, "--mode tp does not support"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CLI(&g_r, "train", "--mode", "tp", "--device", "cpu:2", MLP, SYN, bad[i].a[0],
            bad[i].a[1]);
        cr_assert_eq(g_r.code, 2, "%s: %s", bad[i].a[0], g_r.out);
        cr_assert(strstr(g_r.out, bad[i].says), "%s: %s", bad[i].a[0], g_r.out);
        cr_assert(strchr(g_r.out, '\n') == g_r.out + strlen(g_r.out) - 1,
                  "more than one line:\n%s", g_r.out);
    }
}
