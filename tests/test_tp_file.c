/* tests/test_tp_file.c: `--mode tp` with `--model file:PATH`.
 * - a GPT written as a model file (tied head) is the built-in GPT on the
 *   tensor-parallel ranks: on 2 ranks, with --sequence-parallel and on
 *   dp=2 x tp=2 it writes the built-in gpt's tp checkpoint byte for byte;
 *   the untied head is refused in one line, exit 2;
 * - a file of linear layers with elementwise layers between them (gelu,
 *   tanh, sigmoid, an unfused relu, dropout before the first linear layer
 *   and on a column-parallel output) splits in column/row pairs: tp on 1
 *   device writes single's checkpoint bit for bit, on 2 and 4 ranks and
 *   dp=2 x tp=2 within tests/test_tp_cli.c's bound (1e-5; the dropout is
 *   live: the same file without it ends elsewhere, farther than the
 *   bound);
 * - a layer tp cannot split (conv, batchnorm, a residual block, layernorm
 *   in a pair) and a width the ranks do not divide: one line naming the
 *   file's line, exit 2;
 * - CUDA-emulated ranks (dropout staged through the host, the device's
 *   activation kernels) write the host ranks' checkpoint bit for bit;
 * - compare --modes single,tp on the file: its section, PASS, the plan's
 *   all-reduce bytes counted by the communicator. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

#define SYN "--data", "synthetic", "--synthetic-size", "200"
#define TOL 1e-5

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "tp_file"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(tp_file, .init = setup, .fini = teardown, .timeout = 240);

static void in_dir(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", g_dir, name);
}

/* Writes text to g_dir/name; its "file:PATH" into spec. */
static void write_model(const char *name, const char *text, char *spec, size_t n)
{
    char p[128];
    in_dir(p, sizeof p, name);
    FILE *f = fopen(p, "w");
    cr_assert(f, "cannot write %s", p);
    fputs(text, f);
    fclose(f);
    snprintf(spec, n, "file:%s", p);
}

static const char gpt_file[] = "input tokens 8\n"
                               "embedding vocab 256 dim 16\n"
                               "embedding positions\n"
                               "residual {\n  layernorm\n  attention heads 2\n}\n"
                               "residual {\n  layernorm\n  gptmlp\n}\n"
                               "residual {\n  layernorm\n  attention heads 2\n}\n"
                               "residual {\n  layernorm\n  gptmlp\n}\n"
                               "layernorm\n"
                               "lmhead tied\n";

static void gpt_tp(const char *model, const char *text, const char *dev, const char *extra,
                   const char *extra_v, const char *save)
{
    static cli_result r;
    CLI(&r, "train", "--model", model, "--data", text, "--mode", "tp", "--device", dev, "--batch",
        "8", "--epochs", "1", "--max-steps", "4", "--quiet", "--save", save, extra, extra_v);
    expect(&r, 0, "val loss");
}

Test(tp_file, a_gpt_file_is_the_built_in_gpt_byte_for_byte)
{
    char text[128], file[160], a[128], b[128];
    in_dir(text, sizeof text, "text.txt");
    cli_write_words(text);
    write_model("gpt.tdm", gpt_file, file, sizeof file);
    static const struct {
        const char *dev, *extra, *extra_v;
    } runs[] = {{"cpu:2", "--quiet", "--quiet"},
                {"cpu:2", "--sequence-parallel", "--quiet"},
                {"cpu:4", "--mesh", "dp=2,tp=2"}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        in_dir(a, sizeof a, "builtin.safetensors");
        in_dir(b, sizeof b, "file.safetensors");
        gpt_tp("gpt:2-16-2-8", text, runs[i].dev, runs[i].extra, runs[i].extra_v, a);
        gpt_tp(file, text, runs[i].dev, runs[i].extra, runs[i].extra_v, b);
        cr_assert(cli_same_file(a, b), "%s %s %s: the file's tp checkpoint is not the built-in "
                  "gpt's", runs[i].dev, runs[i].extra, runs[i].extra_v);
    }
    /* the untied head: one line, exit 2 */
    static char untied[sizeof gpt_file];
    snprintf(untied, sizeof untied, "%s", gpt_file);
    char *t = strstr(untied, " tied");
    t[0] = '\n';
    t[1] = '\0';
    write_model("untied.tdm", untied, file, sizeof file);
    static cli_result r;
    CLI(&r, "train", "--model", file, "--data", text, "--mode", "tp", "--device", "cpu:2");
    expect(&r, 2, "untied head");
    cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "more than one line:\n%s", r.out);
}

/* Dropout on the input (before fc1, replicated) and on fc1's
 * column-parallel output; gelu, an unfused relu after it, tanh after the
 * row-parallel fc2, sigmoid after the column-parallel fc3. */
static const char mlp_file[] = "# an MLP family model file\n"
                               "input 20\n"
                               "dropout 0.1\n"
                               "linear 24\n"
                               "gelu\n"
                               "dropout 0.25\n"
                               "relu\n"
                               "linear 16\n"
                               "tanh\n"
                               "linear 12\n"
                               "sigmoid\n"
                               "linear 5\n";

static void train(const char *model, const char *mode, const char *dev, const char *mesh,
                  const char *save)
{
    static cli_result r;
    const char *m = mesh ? "--mesh" : "--quiet", *mv = mesh ? mesh : "--quiet";
    CLI(&r, "train", "--mode", mode, "--device", dev, m, mv, "--model", model, SYN, "--batch",
        "32", "--epochs", "2", "--no-eval", "--quiet", "--save", save);
    expect(&r, 0, "/");
}

Test(tp_file, a_file_of_linear_pairs_equals_one_device_within_the_bound)
{
    char model[160], nodrop[160], one[128], t1[128], t2[128], t4[128], m[128], nd[128];
    write_model("mlp.tdm", mlp_file, model, sizeof model);
    char text[sizeof mlp_file];
    snprintf(text, sizeof text, "%s", mlp_file);
    memcpy(strstr(text, "dropout 0.1"), "dropout 0.0", 11);
    memcpy(strstr(text, "dropout 0.25"), "dropout 0.00", 12);
    /* the same name (a checkpoint names its model file), another folder */
    char sub[128];
    in_dir(sub, sizeof sub, "nodrop");
    cr_assert_eq(mkdir(sub, 0700), 0);
    write_model("nodrop/mlp.tdm", text, nodrop, sizeof nodrop);
    in_dir(one, sizeof one, "single.safetensors");
    in_dir(t1, sizeof t1, "tp1.safetensors");
    in_dir(t2, sizeof t2, "tp2.safetensors");
    in_dir(t4, sizeof t4, "tp4.safetensors");
    in_dir(m, sizeof m, "mesh.safetensors");
    in_dir(nd, sizeof nd, "nodrop.safetensors");
    train(model, "single", "cpu:1", NULL, one);
    train(model, "tp", "cpu:1", NULL, t1);
    train(model, "tp", "cpu:2", NULL, t2);
    train(model, "tp", "cpu:4", NULL, t4);
    train(model, "tp", "cpu:4", "dp=2,tp=2", m);
    train(nodrop, "single", "cpu:1", NULL, nd);
    cr_assert(cli_same_file(one, t1), "tp on one device is not single's checkpoint");
    double d2 = ck_diff_of(model, one, t2), d4 = ck_diff_of(model, one, t4);
    double dm = ck_diff_of(model, one, m), dd = ck_diff_of(model, one, nd);
    cr_assert(d2 <= TOL && d4 <= TOL && dm <= TOL, "tp 2: %g, tp 4: %g, dp=2,tp=2: %g", d2, d4,
              dm);
    cr_assert(dd > 100 * TOL, "without dropout the run ends %g from it: is dropout live?", dd);
}

Test(tp_file, a_layer_tp_cannot_split_is_named_by_its_line)
{
    static const struct {
        const char *text, *says;
    } bad[] = {
        {"input 1x8x8\nconv 3x3 4\nflatten\nlinear 8\nlinear 4\n",
         "line 2: `conv`: --mode tp cannot split it: a convolution"},
        {"input 1x8x8\nbatchnorm\nflatten\nlinear 8\nlinear 4\n",
         "line 2: `batchnorm`: --mode tp cannot split it"},
        {"input 16\nlinear 8\nresidual {\n  linear 8\n}\nlinear 4\n",
         "line 3: `residual {`: --mode tp cannot split it: a residual block"},
        {"input 16\nlinear 8\nlayernorm\nlinear 4\n",
         "line 3: `layernorm`: --mode tp cannot split it: layernorm"},
        {"input 16\n# width 7\nlinear 7\nlinear 4\n",
         "line 3: layer fc1's output width 7 (fc2's input) is not divisible by the 2"},
        {"input 16\nrelu\nlinear 4\n", "has 1 linear layer"},
    };
    static cli_result r;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char model[160], name[32];
        snprintf(name, sizeof name, "bad%zu.tdm", i);
        write_model(name, bad[i].text, model, sizeof model);
        CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", "--model", model, SYN);
        expect(&r, 2, bad[i].says);
        expect(&r, 2, name);
        cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "more than one line:\n%s",
                  r.out);
    }
}

Test(tp_file, compare_runs_the_file_through_tp)
{
    char model[160];
    write_model("mlp.tdm", mlp_file, model, sizeof model);
    static cli_result r;
    CLI(&r, "compare", "--modes", "single,tp", "--device", "cpu:2", "--model", model, "--data",
        "synthetic", "--batch", "32", "--steps", "6");
    expect(&r, 0, "tensor-parallel throughput");
    expect(&r, 0, "tp(2): largest parameter difference");
    expect(&r, 0, "over 6 steps -> PASS");
    /* a batch of 32: forward fc2's (16) and fc4's (5) all-reduces, backward
     * fc3's (16) */
    expect(&r, 0, "all-reduce payload handed to the communicator 4736 bytes per step in 3.0 "
                  "calls (the plan: 4736 bytes in 3)");
}

Test(tp_file, emulated_cuda_ranks_write_the_host_ranks_checkpoint)
{
    CU_NEED_BACKEND();
    char model[160], host[128], emu[128];
    write_model("mlp.tdm", mlp_file, model, sizeof model);
    in_dir(host, sizeof host, "host.safetensors");
    in_dir(emu, sizeof emu, "emu.safetensors");
    train(model, "tp", "cpu:2", NULL, host);
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    train(model, "tp", "cuda", NULL, emu);
    unsetenv("TANDEM_CUDA_EMULATOR");
    cr_assert(cli_same_file(host, emu), "emulated ranks differ from host ranks");
}
