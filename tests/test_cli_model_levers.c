/* tests/test_cli_model_levers.c: the memory levers with model files
 * through the CLI. A model file of the built-in CNN's layers trains with
 * --precision bf16|fp16, --checkpoint-activations and --clip-grad-norm
 * in DDP and FSDP to the same tensors, bit for bit, as --model cnn with
 * the same levers (the checkpoints differ only in the metadata that names
 * the model); plan takes it; a model file with another layer is refused
 * in one line naming the layer's line. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "core/safetensors.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[128];
static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "climodellev"); }
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(cli_model_levers, .init = setup, .fini = teardown, .timeout = 600);

static const char g_cnn[] = "# the built-in CNN (--model cnn) as a model file\n"
                            "input 1x28x28\n"
                            "conv 3x3 32 pad 1\nbatchnorm\nrelu\nmaxpool 2\n"
                            "conv 3x3 64 pad 1\nbatchnorm\nrelu\nmaxpool 2\n"
                            "flatten\nlinear 128\nrelu\nlinear 10\n";

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
}

/* Every tensor of a the same bytes as b's tensor of the same name. */
static void same_tensors(const char *a, const char *b, const char *what)
{
    tdm_st_file *fa = NULL, *fb = NULL;
    TU_OK(tdm_st_load(&fa, a));
    TU_OK(tdm_st_load(&fb, b));
    cr_assert_eq(tdm_st_count(fa), tdm_st_count(fb), "%s: tensor count", what);
    for (int i = 0; i < tdm_st_count(fa); i++) {
        const tdm_st_tensor *x = tdm_st_get(fa, i), *y = tdm_st_find(fb, x->name);
        cr_assert_not_null(y, "%s: %s missing", what, x->name);
        cr_assert(x->nbytes == y->nbytes && !memcmp(x->data, y->data, x->nbytes),
                  "%s: %s differs", what, x->name);
    }
    tdm_st_free(fa);
    tdm_st_free(fb);
}

static void same_run(const char *file, const char *const *opts, int n_opts, const char *tag)
{
    static cli_result r[2];
    char model[300], ck[2][48], res[2][128];
    snprintf(model, sizeof model, "file:%s", file);
    const char *models[2] = {model, "cnn"};
    for (int k = 0; k < 2; k++) {
        snprintf(ck[k], sizeof ck[k], "%s-%d.safetensors", tag, k);
        const char *args[40] = {"train", "--model", models[k], "--data", "synthetic",
                                "--synthetic-size", "256", "--epochs", "1", "--max-steps", "3",
                                "--batch", "32", "--save", tu_tpath(g_dir, ck[k])};
        int n = 15;
        for (int i = 0; i < n_opts; i++) args[n++] = opts[i];
        args[n] = NULL;
        cli_run(&r[k], args);
        expect(&r[k], 0, "epoch 1/1");
        epoch_result(r[k].out, "epoch 1/1", res[k], sizeof res[k]);
    }
    cr_assert_str_eq(res[0], res[1], "%s: the epoch's results differ", tag);
    same_tensors(tu_tpath(g_dir, ck[0]), tu_tpath(g_dir, ck[1]), tag);
}

Test(cli_model_levers, a_file_of_the_cnns_layers_trains_as_the_cnn_with_every_lever)
{
    char file[256];   /* tu_tpath's buffers rotate */
    snprintf(file, sizeof file, "%s", tu_tpath(g_dir, "cnn.tdm"));
    write_text(file, g_cnn);
    same_run(file, (const char *const[]){"--precision", "bf16", "--checkpoint-activations", "1"},
             4, "single-bf16-ckpt");
    same_run(file, (const char *const[]){"--mode", "ddp", "--device", "cpu:2", "--precision",
                                         "bf16", "--checkpoint-activations", "1",
                                         "--clip-grad-norm", "1"}, 10, "ddp-bf16-ckpt-clip");
    same_run(file, (const char *const[]){"--mode", "fsdp", "--device", "cpu:2", "--precision",
                                         "fp16", "--checkpoint-activations", "2",
                                         "--clip-grad-norm", "0.5"}, 10, "fsdp-fp16-ckpt-clip");
    same_run(file, (const char *const[]){"--mode", "dp", "--device", "cpu:2",
                                         "--clip-grad-norm", "1"}, 6, "dp-clip");
    cr_assert_eq(cli_shm_entries(), 0);
    static cli_result r;
    char model[300];
    snprintf(model, sizeof model, "file:%s", file);
    CLI(&r, "plan", "--model", model, "--precision", "bf16", "--checkpoint-activations", "1");
    expect(&r, 0, "peak");
}

Test(cli_model_levers, other_layers_are_refused_naming_their_line)
{
    static cli_result r;
    CLI(&r, "train", "--model", "file:examples/models/lenet5.tdm", "--data", "synthetic",
        "--precision", "bf16");
    expect(&r, 2, "file:lenet5.tdm's `tanh` (line 5) runs in float32");
    cr_assert(strchr(r.out, '\n') && !strchr(r.out, '\n')[1], "more than one line:\n%s", r.out);
    CLI(&r, "train", "--model", "file:examples/models/mlp_dropout.tdm", "--data", "synthetic",
        "--checkpoint-activations", "1", "--mode", "ddp", "--device", "cpu:2");
    expect(&r, 2, "`gelu` (line 7)");
    CLI(&r, "plan", "--model", "file:examples/models/resnet_small.tdm", "--precision", "fp16");
    expect(&r, 2, "resnet_small.tdm's `residual {` (line 10)");
}
