/* tests/test_torch_check.c: the PyTorch loader check (tools/torch_check.py)
 * on small data: each example model file trains two steps with tandem
 * (lenet5, the ResNet in ddp, the MLP with dropout on a .npy set of 256
 * pseudo-random images; the GPT on a small text), and the same net built
 * with torch.nn from the file, loaded from the checkpoint, must agree with
 * `tandem eval` within the script's bounds, and so must a file of every
 * other layer the check builds; a weight changed in torch's
 * copy must be reported as a mismatch. Where no python3 imports torch
 * (python3-torch is not in DEB_PKGS: `make torch-check` installs it and
 * runs the full check on Fashion-MNIST), those tests skip, saying so; the
 * model file parser's one-line errors need no torch and always run. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

#define TC_SCRIPT "tools/torch_check.py"
#define TC_SAMPLES 256
#define TC_PIXELS (28 * 28)
#define TC_CLASSES 10

static char g_dir[128];
static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "torchcheck"); }
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(torch_check, .init = setup, .fini = teardown, .timeout = 600);

/* Runs argv (argv[0] looked up in PATH), stdout+stderr captured. */
static void run_cmd(cli_result *r, const char *const *argv)
{
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        alarm(540);   /* bounds a hung child under the suite's timeout */
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t k;
    while ((k = read(fds[0], r->out + len, sizeof r->out - 1 - len)) > 0) len += (size_t)k;
    r->out[len] = '\0';
    close(fds[0]);
    int ws;
    cr_assert(waitpid(pid, &ws, 0) == pid);
    r->code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

#define RUN(r, ...) run_cmd((r), (const char *const[]){__VA_ARGS__, NULL})

/* The python3 that imports torch (Debian's python3-torch installs into
 * /usr/bin/python3's packages, which a python3 earlier in PATH may not
 * see), or NULL. */
static const char *torch_python(void)
{
    static const char *const cands[] = {"python3", "/usr/bin/python3"};
    static cli_result r;
    for (size_t i = 0; i < sizeof cands / sizeof *cands; i++) {
        RUN(&r, cands[i], "-c", "import torch");
        if (r.code == 0) return cands[i];
    }
    return NULL;
}

static const char *need_torch(void)
{
    const char *py = torch_python();
    if (!py) {
        /* tests/run_all.sh shows this line beside the binary's count */
        fprintf(stderr, "test_torch_check: SKIPPED the torch tests: no python3 here imports "
                        "torch (make torch-check installs python3-torch and runs the full "
                        "check)\n");
        /* a skipped test does not run the suite's .fini: remove the
         * directory here */
        teardown();
        g_dir[0] = '\0';
        cr_skip_test("no python3 here imports torch (make torch-check installs python3-torch)");
    }
    return py;
}

/* A .npy header (version 1.0, padded to 64 bytes) for descr and shape. */
static void npy_header(FILE *f, const char *descr, const char *shape)
{
    char h[128];
    int n = snprintf(h, sizeof h, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                     descr, shape);
    int total = 10 + n + 1, pad = (64 - total % 64) % 64;
    uint16_t hl = (uint16_t)(n + pad + 1);
    fwrite("\x93NUMPY\x01\x00", 1, 8, f);
    fputc(hl & 0xff, f);
    fputc(hl >> 8, f);
    fputs(h, f);
    for (int i = 0; i < pad; i++) fputc(' ', f);
    fputc('\n', f);
}

/* TC_SAMPLES uint8 images whose label is a function of their pixels. */
static void write_npy(const char *xpath, const char *ypath)
{
    FILE *fx = fopen(xpath, "wb"), *fy = fopen(ypath, "wb");
    cr_assert(fx && fy, "%s, %s", xpath, ypath);
    char shape[64];
    snprintf(shape, sizeof shape, "(%d, 1, 28, 28)", TC_SAMPLES);
    npy_header(fx, "|u1", shape);
    snprintf(shape, sizeof shape, "(%d,)", TC_SAMPLES);
    npy_header(fy, "<i8", shape);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < TC_SAMPLES; i++) {
        int64_t label = i % TC_CLASSES;
        for (int p = 0; p < TC_PIXELS; p++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            /* a bright band at the label's rows, noise elsewhere */
            int row = p / 28, band = row / 3 == label;
            fputc(band ? 200 + (int)(s >> 61) : (int)(s >> 58), fx);
        }
        fwrite(&label, sizeof label, 1, fy);
    }
    cr_assert_eq(fclose(fx), 0);
    cr_assert_eq(fclose(fy), 0);
}

static void expect_agree(const cli_result *r, const char *what)
{
    cr_assert_eq(r->code, 0, "%s: torch_check exit %d:\n%s", what, r->code, r->out);
    cr_assert(strstr(r->out, "torch_check: AGREE"), "%s:\n%s", what, r->out);
}

Test(torch_check, image_examples_agree_with_torch_and_a_tampered_copy_does_not)
{
    const char *py = need_torch();
    static cli_result r;
    char data[600];
    const char *x = tu_tpath(g_dir, "x.npy"), *y = tu_tpath(g_dir, "y.npy");
    write_npy(x, y);
    snprintf(data, sizeof data, "%s,%s", x, y);
    static const struct { const char *name, *mode, *device; } ex[] = {
        {"lenet5", "single", "cpu"},
        {"resnet_small", "ddp", "cpu:2"},
        {"mlp_dropout", "single", "cpu"},
    };
    for (size_t i = 0; i < sizeof ex / sizeof *ex; i++) {
        char model[160], file[128], name[64];
        snprintf(file, sizeof file, "examples/models/%s.tdm", ex[i].name);
        snprintf(model, sizeof model, "file:%s", file);
        snprintf(name, sizeof name, "%s.safetensors", ex[i].name);
        const char *ck = tu_tpath(g_dir, name);
        CLI(&r, "train", "--model", model, "--mode", ex[i].mode, "--device", ex[i].device,
            "--data", data, "--epochs", "1", "--max-steps", "2", "--batch", "32", "--no-eval",
            "--save", ck);
        expect(&r, 0, "saved");
        RUN(&r, py, TC_SCRIPT, "--model", file, "--checkpoint", ck, "--data", data, "--tandem",
            cli_bin());
        expect_agree(&r, ex[i].name);
        cr_assert(strstr(r.out, "test accuracy: tandem"), "%s", r.out);
    }
    /* every other layer the check builds, in one file of tandem's */
    const char *all = tu_tpath(g_dir, "all.tdm"), *ck = tu_tpath(g_dir, "all.safetensors");
    FILE *f = fopen(all, "w");
    cr_assert_not_null(f);
    fputs("input 1x28x28\nconv 3x3 8 stride 2 pad 1\nbatchnorm\nrelu\nmaxpool 2\n"
          "residual {\n  conv 3x3 8 pad 1\n  gelu\n}\navgpool 7\nflatten\nlinear 32\n"
          "layernorm\nresidual {\n  linear 16\n  sigmoid\n} proj\ntanh\ndropout 0.3\n"
          "linear 10\n", f);
    cr_assert_eq(fclose(f), 0);
    char model[300];
    snprintf(model, sizeof model, "file:%s", all);
    CLI(&r, "train", "--model", model, "--data", data, "--epochs", "1", "--max-steps", "2",
        "--batch", "32", "--no-eval", "--save", ck);
    expect(&r, 0, "saved");
    RUN(&r, py, TC_SCRIPT, "--model", all, "--checkpoint", ck, "--data", data, "--tandem",
        cli_bin());
    expect_agree(&r, "all.tdm");
    /* the negative control: the check can fail */
    RUN(&r, py, TC_SCRIPT, "--model", "examples/models/lenet5.tdm", "--checkpoint",
        tu_tpath(g_dir, "lenet5.safetensors"), "--data", data, "--tandem", cli_bin(), "--tamper",
        "conv1.weight");
    cr_assert_eq(r.code, 1, "a tampered copy: exit %d:\n%s", r.code, r.out);
    cr_assert(strstr(r.out, "MISMATCH: logits differ"), "%s", r.out);
    /* a checkpoint of another model file: one line naming what does not fit */
    RUN(&r, py, TC_SCRIPT, "--model", "examples/models/mlp_dropout.tdm", "--checkpoint",
        tu_tpath(g_dir, "lenet5.safetensors"), "--data", data, "--tandem", cli_bin());
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "the checkpoint does not fit the model file"), "%s", r.out);
}

Test(torch_check, the_gpt_file_agrees_with_torch_on_its_validation_text)
{
    const char *py = need_torch();
    static cli_result r;
    const char *text = tu_tpath(g_dir, "words.txt"), *ck = tu_tpath(g_dir, "gpt.safetensors");
    cli_write_words(text);
    CLI(&r, "train", "--model", "file:examples/models/gpt.tdm", "--data", text, "--epochs", "1",
        "--max-steps", "2", "--batch", "4", "--no-eval", "--save", ck);
    expect(&r, 0, "saved");
    RUN(&r, py, TC_SCRIPT, "--model", "examples/models/gpt.tdm", "--checkpoint", ck, "--data",
        text, "--tandem", cli_bin());
    expect_agree(&r, "gpt");
    cr_assert(strstr(r.out, "loss (nats, validation windows): tandem"), "%s", r.out);
}

/* Needs python3 only: a layer the check does not build, or a broken
 * file, stops it with one line naming the line, exit 2. */
Test(torch_check, unsupported_or_bad_model_files_stop_in_one_line)
{
    static cli_result r;
    static const struct { const char *text, *phrase; } bad[] = {
        {"input 1x28x28\nconv 3x3 4\nmaxout 2\nflatten\nlinear 10\n",
         "bad.tdm:3: `maxout 2`: 'maxout' with these words is not a layer"},
        {"input 1x28x28\nresidual {\nconv 3x3 4 pad 1\nflatten\nlinear 10\n",
         "a residual block is not closed"},
        {"input tokens 16\nembedding vocab 256 dim 8\nembedding positions\nlinear 10\n",
         "bad.tdm:4: `linear 10`: expected a transformer block"},
    };
    const char *path = tu_tpath(g_dir, "bad.tdm");
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f);
        fputs(bad[i].text, f);
        cr_assert_eq(fclose(f), 0);
        RUN(&r, "python3", TC_SCRIPT, "--model", path, "--checkpoint", "unused", "--parse-only");
        cr_assert_eq(r.code, 2, "exit %d:\n%s", r.code, r.out);
        cr_assert(strstr(r.out, bad[i].phrase), "lacks '%s':\n%s", bad[i].phrase, r.out);
        const char *nl = strchr(r.out, '\n');
        cr_assert(nl && !nl[1], "more than one line:\n%s", r.out);
    }
    for (int i = 0; i < 4; i++) {
        static const char *const ex[] = {"lenet5", "resnet_small", "mlp_dropout", "gpt"};
        char file[128];
        snprintf(file, sizeof file, "examples/models/%s.tdm", ex[i]);
        RUN(&r, "python3", TC_SCRIPT, "--model", file, "--checkpoint", "unused", "--parse-only");
        expect(&r, 0, "parsed");
    }
}
