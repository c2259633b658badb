/* tests/test_cli_models.c: model files and NumPy data through the CLI:
 * each example in examples/models/ trains in single, DP, DDP, FSDP,
 * ZeRO-2 and ZeRO-1 with compare's verdict PASS (DDP == DP and FSDP ==
 * DDP bitwise), and through the pipeline bitwise as one device with
 * --grad-accum; so does a file with layernorm; a checkpoint of a model
 * file evaluates with --model;
 * bad model files, pipeline cuts inside a block and bad .npy files stop
 * with one line and exit 2. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "core/device.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[128];
static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "climodels"); }
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(cli_models, .init = setup, .fini = teardown, .timeout = 300);

static const char *const g_examples[] = {
    "file:examples/models/lenet5.tdm",
    "file:examples/models/resnet_small.tdm",
    "file:examples/models/mlp_dropout.tdm",
};

static void one_line(const cli_result *r)
{
    const char *nl = strchr(r->out, '\n');
    cr_assert(nl && !nl[1], "more than one line:\n%s", r->out);
}

Test(cli_models, examples_pass_compare_in_every_data_parallel_mode)
{
    static cli_result r;
    for (size_t i = 0; i < sizeof g_examples / sizeof *g_examples; i++) {
        CLI(&r, "compare", "--model", g_examples[i], "--data", "synthetic", "--steps", "2",
            "--batch", "16", "--device", "cpu:2", "--modes", "single,dp,ddp,fsdp,zero2,zero1");
        expect(&r, 0, "verdict: PASS");
        cr_assert(strstr(r.out, "FSDP vs DDP: bitwise the same parameters"), "%s", r.out);
        cr_assert(strstr(r.out, "DDP vs DP      step 1: params max |diff| 0.00e+00"), "%s", r.out);
        CLI(&r, "compare", "--model", g_examples[i], "--data", "synthetic", "--steps", "2",
            "--batch", "16", "--device", "cpu:2", "--modes", "pp");
        expect(&r, 0, "BITWISE IDENTICAL");
        cr_assert_eq(cli_shm_entries(), 0);
    }
}

Test(cli_models, train_save_and_eval_a_model_file)
{
    static cli_result r;
    const char *ck = tu_tpath(g_dir, "lenet.safetensors");
    CLI(&r, "train", "--model", g_examples[0], "--data", "synthetic", "--synthetic-size", "256",
        "--epochs", "1", "--max-steps", "2", "--batch", "32", "--save", ck);
    expect(&r, 0, "model file:lenet5.tdm (1x28x28 -> 10)");
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--model", g_examples[2], "--data",
        "synthetic", "--synthetic-size", "256", "--epochs", "1", "--max-steps", "2", "--batch",
        "32");
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "eval", "--resume", ck, "--model", g_examples[0], "--data", "synthetic",
        "--synthetic-size", "256");
    expect(&r, 0, "test set (42 samples)");
    CLI(&r, "eval", "--resume", ck, "--data", "synthetic");
    expect(&r, 2, "give it as --model file:PATH");
    CLI(&r, "plan", "--model", g_examples[1], "--mode", "ddp", "--device", "cpu:2");
    expect(&r, 0, "peak per device");
}

Test(cli_models, bad_model_files_and_cuts_stop_in_one_line)
{
    static cli_result r;
    const char *bad = tu_tpath(g_dir, "bad.tdm");
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("input 1x28x28\nconv 3x3 8\nresidual {\nconv 3x3 8\n}\nflatten\nlinear 10\n", f);
    fclose(f);
    char model[300];
    snprintf(model, sizeof model, "file:%s", bad);
    CLI(&r, "train", "--model", model, "--data", "synthetic");
    expect(&r, 2, "bad.tdm:5: `}`: residual block: its input is 8x26x26 but its output 8x24x24");
    one_line(&r);
    CLI(&r, "train", "--model", "file:/nonexistent.tdm", "--data", "synthetic");
    expect(&r, 2, "/nonexistent.tdm");
    one_line(&r);
    /* layer 6 is inside resnet_small's first block (the stem is 0-2) */
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--split", "0,6", "--model",
        g_examples[1], "--data", "synthetic", "--max-steps", "1", "--epochs", "1");
    expect(&r, 2, "splits the residual block or comes before the dropout of "
                  "file:resnet_small.tdm line 10");
    one_line(&r);
}

/* layernorm of feature vectors: every data-parallel mode and the
 * pipeline (its statistics travel with each micro-batch's activations),
 * bitwise; the memory levers refuse it naming its line. */
Test(cli_models, layernorm_in_every_mode)
{
    static cli_result r;
    char model[300];
    const char *file = tu_tpath(g_dir, "ln.tdm");
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs("input 784\nlinear 64\nlayernorm\ngelu\nlinear 32\nrelu\nlayernorm\nlinear 10\n", f);
    fclose(f);
    snprintf(model, sizeof model, "file:%s", file);
    CLI(&r, "compare", "--model", model, "--data", "synthetic", "--steps", "2", "--batch", "16",
        "--device", "cpu:2", "--modes", "single,dp,ddp,fsdp,zero2,zero1");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "FSDP vs DDP: bitwise the same parameters"), "%s", r.out);
    cr_assert(strstr(r.out, "DDP vs DP      step 1: params max |diff| 0.00e+00"), "%s", r.out);
    CLI(&r, "compare", "--model", model, "--data", "synthetic", "--steps", "2", "--batch", "16",
        "--device", "cpu:2", "--modes", "pp");
    expect(&r, 0, "BITWISE IDENTICAL");
    CLI(&r, "train", "--model", model, "--data", "synthetic", "--precision", "bf16");
    expect(&r, 2, "ln.tdm's `layernorm` (line 3)");
    one_line(&r);
    cr_assert_eq(cli_shm_entries(), 0);
}

/* A version-1.0 .npy file of a header and payload. */
static void npy_write(const char *path, const char *hdr, const void *data, size_t nbytes)
{
    size_t hl = strlen(hdr), pad = (64 - (10 + hl + 1) % 64) % 64, len = hl + pad + 1;
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(len & 0xff),
                             (unsigned char)(len >> 8)};
    fwrite(pre, 1, 10, f);
    fputs(hdr, f);
    for (size_t i = 0; i < pad; i++) fputc(' ', f);
    fputc('\n', f);
    fwrite(data, 1, nbytes, f);
    fclose(f);
}

Test(cli_models, numpy_data_trains_and_bad_arrays_stop_in_one_line)
{
    static cli_result r;
    enum { N = 60, F = 784 };
    static unsigned char x[N * F];
    int64_t y[N];
    tdm_rng g = tu_rng(3);
    for (int i = 0; i < N; i++) {
        y[i] = i % 10;
        for (int j = 0; j < F; j++) x[i * F + j] = (unsigned char)((j * (y[i] + 1) + tdm_rng_below(&g, 40)) & 0xff);
    }
    const char *xp = tu_tpath(g_dir, "x.npy"), *yp = tu_tpath(g_dir, "y.npy");
    npy_write(xp, "{'descr': '|u1', 'fortran_order': False, 'shape': (60, 28, 28), }", x, sizeof x);
    npy_write(yp, "{'descr': '<i8', 'fortran_order': False, 'shape': (60,), }", y, sizeof y);
    char pair[300];
    snprintf(pair, sizeof pair, "%s,%s", xp, yp);
    CLI(&r, "train", "--model", g_examples[0], "--data", pair, "--epochs", "1", "--batch", "16");
    expect(&r, 0, "(54 train, 6 test)");
    CLI(&r, "train", "--model", g_examples[0], "--data", pair, "--val-data", pair, "--epochs", "1",
        "--batch", "16");
    expect(&r, 0, "(60 train, 60 test)");
    CLI(&r, "compare", "--model", g_examples[2], "--data", pair, "--steps", "2", "--batch", "16",
        "--modes", "single,ddp");
    expect(&r, 0, "verdict: PASS");
    /* the model reads 784 values per sample; labels up to 9 */
    CLI(&r, "train", "--model", "mlp:100-10", "--data", pair, "--epochs", "1");
    expect(&r, 2, "784 values per sample (1x28x28) but the model reads 100");
    one_line(&r);
    CLI(&r, "train", "--model", "mlp:784-5", "--data", pair, "--epochs", "1");
    expect(&r, 2, "label 9 but the model has 5 classes");
    one_line(&r);
    npy_write(yp, "{'descr': '<f8', 'fortran_order': False, 'shape': (60,), }", y, sizeof y);
    CLI(&r, "train", "--model", g_examples[0], "--data", pair, "--epochs", "1");
    expect(&r, 2, "dtype '<f8'");
    one_line(&r);
    npy_write(yp, "{'descr': '<i8', 'fortran_order': False, 'shape': (60,), }", y, sizeof y - 1);
    CLI(&r, "train", "--model", g_examples[0], "--data", pair, "--epochs", "1");
    expect(&r, 2, "truncated");
    one_line(&r);
}

/* On emulated GPUs (cuda/emulator.c) the new layers run their host
 * fallbacks through device copies: the same verdict. */
Test(cli_models, examples_on_emulated_gpus)
{
    static cli_result r;
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
    CLI(&r, "compare", "--device", "cuda:0,1", "--model", g_examples[2], "--data", "synthetic",
        "--steps", "2", "--batch", "16", "--modes", "single,ddp");
    expect(&r, 0, "verdict: PASS");
    CLI(&r, "train", "--device", "cuda", "--model", g_examples[0], "--data", "synthetic",
        "--synthetic-size", "64", "--epochs", "1", "--max-steps", "1", "--batch", "16");
    expect(&r, 0, "epoch 1/1");
    unsetenv("TANDEM_CUDA_EMULATOR");
}
