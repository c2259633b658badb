/* tests/test_det_tp.c: --deterministic K with tensor parallelism. At a
 * fixed tp size N the dp dimension's replicas run their K/D virtual
 * shards through their group one at a time and add them in the fixed
 * tree, so --mesh dp=2,tp=2 writes the bytes of tp over 2 alone (the MLP,
 * the GPT and a model file with dropout); without the flag the two
 * differ (the test would catch nothing otherwise). Another N changes the
 * row-parallel sums: the run says so in its header line. Bad combinations
 * get one line and exit 2. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[128];
static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "dettp");
    cli_write_words(tu_tpath(g_dir, "words.txt"));
}
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(det_tp, .init = setup, .fini = teardown, .timeout = 600);

/* 20 steps of args on `device` (mesh: --mesh, or NULL), K 0: without
 * --deterministic; saved at path; the run's output in *out. */
static void tp_train(const char *const *args, const char *device, const char *mesh, int K,
                     const char *path, cli_result *r)
{
    const char *argv[40];
    char k[16];
    int a = 0;
    snprintf(k, sizeof k, "%d", K);
    argv[a++] = "train";
    argv[a++] = "--mode";
    argv[a++] = "tp";
    argv[a++] = "--device";
    argv[a++] = device;
    if (mesh) {
        argv[a++] = "--mesh";
        argv[a++] = mesh;
    }
    if (K) {
        argv[a++] = "--deterministic";
        argv[a++] = k;
    }
    for (int i = 0; args[i]; i++) argv[a++] = args[i];
    const char *tail[] = {"--epochs", "1", "--max-steps", "20", "--no-eval", "--quiet",
                          "--save", path, NULL};
    for (int i = 0; tail[i]; i++) argv[a++] = tail[i];
    argv[a] = NULL;
    cli_run(r, argv);
    cr_assert_eq(r->code, 0, "%s on %s: exit %d:\n%s", args[1], device, r->code, r->out);
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
}

static void tp_dp_invariant(const char *const *args)
{
    static cli_result r;
    char a[256], b[256];
    snprintf(a, sizeof a, "%s", tu_tpath(g_dir, "tp2.safetensors"));
    snprintf(b, sizeof b, "%s", tu_tpath(g_dir, "dp2tp2.safetensors"));
    tp_train(args, "cpu:2", NULL, 8, a, &r);
    cr_assert(strstr(r.out, "the same bits for any dp dimension at tp size 2 only"),
              "no note on the tp size:\n%s", r.out);
    tp_train(args, "cpu:4", "dp=2,tp=2", 8, b, &r);
    cr_assert(cli_same_file(a, b), "%s: dp=2,tp=2 differs from tp=2 with --deterministic 8",
              args[1]);
    tp_train(args, "cpu:2", NULL, 0, a, &r);
    tp_train(args, "cpu:4", "dp=2,tp=2", 0, b, &r);
    cr_assert(!cli_same_file(a, b), "%s: dp=2,tp=2 and tp=2 agree bit for bit without "
              "--deterministic: the test of it proves nothing", args[1]);
}

Test(det_tp, mlp_dp_dimension_is_invisible)
{
    const char *args[] = {"--model", "mlp:784-24-10", "--data", "synthetic", "--synthetic-size",
                          "1200", "--batch", "32", NULL};
    tp_dp_invariant(args);
}

Test(det_tp, gpt_dp_dimension_is_invisible)
{
    char text[256];
    snprintf(text, sizeof text, "%s", tu_tpath(g_dir, "words.txt"));
    const char *args[] = {"--model", "gpt:1-16-2-16", "--data", text, "--batch", "16", NULL};
    tp_dp_invariant(args);
}

/* Dropout on fc1's column-parallel slice: a shard's masks are one
 * device's whichever replica runs it. */
Test(det_tp, dropout_model_file_dp_dimension_is_invisible)
{
    char file[256], model[300];
    snprintf(file, sizeof file, "%s", tu_tpath(g_dir, "drop.tdm"));
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs("input 784\nlinear 24\ngelu\ndropout 0.25\nlinear 10\n", f);
    fclose(f);
    snprintf(model, sizeof model, "file:%s", file);
    const char *args[] = {"--model", model, "--data", "synthetic", "--synthetic-size", "1200",
                          "--batch", "32", NULL};
    tp_dp_invariant(args);
}

Test(det_tp, bad_combinations_are_one_line_errors)
{
    static cli_result r;
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:8", "--mesh", "dp=4,tp=2",
        "--deterministic", "2", "--batch", "8", "--model", "mlp:784-24-10", "--data", "synthetic",
        "--synthetic-size", "64");
    expect(&r, 2, "K must be divisible by the 4 tensor-parallel replicas");
    cr_assert_eq(strchr(r.out, '\n'), r.out + strlen(r.out) - 1, "not one line:\n%s", r.out);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", "--deterministic", "8", "--batch",
        "12", "--model", "mlp:784-24-10", "--data", "synthetic", "--synthetic-size", "64");
    expect(&r, 2, "global batch 12 is not divisible");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2",
        "--deterministic", "8", "--sharding", "optimizer", "--model", "mlp:784-24-10", "--data",
        "synthetic", "--synthetic-size", "64");
    expect(&r, 2, "--deterministic with --mode tp is not supported with --grad-accum");
    cr_assert_eq(strchr(r.out, '\n'), r.out + strlen(r.out) - 1, "not one line:\n%s", r.out);
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
}
