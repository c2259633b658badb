/* tests/test_cli_gpt_file.c: examples/models/gpt.tdm, the default GPT
 * written as a model file, through the CLI: it trains on text as
 * `--model gpt` does, to the same checkpoint bytes and losses, in single,
 * DP, DDP and FSDP, with the memory levers (--precision bf16|fp16,
 * --checkpoint-activations, --clip-grad-norm) too; compare passes in
 * every data-parallel mode and the pipeline; sample and eval read its
 * checkpoint. The same file with an untied head (`lmhead`) passes compare
 * in every data-parallel mode, and the pipeline and tensor parallelism
 * refuse it in one line. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[128];
static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "cligptfile"); }
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(cli_gpt_file, .init = setup, .fini = teardown, .timeout = 600);

#define GPT_FILE "file:examples/models/gpt.tdm"

/* The same training from --model file and --model gpt: the checkpoints
 * byte for byte (every tensor, the optimizer state, the metadata) and
 * the losses. */
static void same_run(const char *words, const char *const *opts, int n_opts, const char *tag)
{
    static cli_result r[2];
    static const char *const models[2] = {GPT_FILE, "gpt"};
    char ck[2][40];
    double train[2], val[2];
    for (int k = 0; k < 2; k++) {
        snprintf(ck[k], sizeof ck[k], "%s-%d.safetensors", tag, k);
        const char *path = tu_tpath(g_dir, ck[k]);
        const char *args[40] = {"train", "--model", models[k], "--data", words, "--epochs", "1",
                                "--max-steps", "3", "--batch", "4", "--save", path};
        int n = 13;
        for (int i = 0; i < n_opts; i++) args[n++] = opts[i];
        args[n] = NULL;
        cli_run(&r[k], args);
        expect(&r[k], 0, "model gpt:4-128-4-128");
        cli_epoch_losses(r[k].out, "epoch 1/1", &train[k], &val[k]);
    }
    cr_assert(train[0] == train[1] && val[0] == val[1], "%s: losses %.6f %.6f vs %.6f %.6f", tag,
              train[0], val[0], train[1], val[1]);
    cr_assert(cli_same_file(tu_tpath(g_dir, ck[0]), tu_tpath(g_dir, ck[1])),
              "%s: the checkpoints differ\n%s\n%s", tag, r[0].out, r[1].out);
}

Test(cli_gpt_file, trains_bitwise_as_the_builtin_gpt_in_every_mode_and_lever)
{
    const char *words = tu_tpath(g_dir, "words.txt");
    cli_write_words(words);
    same_run(words, NULL, 0, "single");
    same_run(words, (const char *const[]){"--mode", "dp", "--device", "cpu:2",
                                          "--clip-grad-norm", "1"}, 6, "dp-clip");
    same_run(words, (const char *const[]){"--mode", "ddp", "--device", "cpu:2", "--precision",
                                          "bf16", "--checkpoint-activations", "2",
                                          "--clip-grad-norm", "1"}, 10, "ddp-bf16-ckpt-clip");
    same_run(words, (const char *const[]){"--mode", "fsdp", "--device", "cpu:2", "--precision",
                                          "fp16", "--checkpoint-activations", "1",
                                          "--clip-grad-norm", "0.5"}, 10, "fsdp-fp16-ckpt-clip");
    same_run(words, (const char *const[]){"--precision", "bf16", "--checkpoint-activations",
                                          "1"}, 4, "single-bf16-ckpt");
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(cli_gpt_file, compare_passes_in_every_data_parallel_mode_and_the_pipeline)
{
    static cli_result r;
    const char *words = tu_tpath(g_dir, "words.txt");
    cli_write_words(words);
    CLI(&r, "compare", "--model", GPT_FILE, "--data", words, "--steps", "2", "--batch", "4",
        "--device", "cpu:2", "--modes", "single,dp,ddp,fsdp,zero2,zero1");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "FSDP vs DDP: bitwise the same parameters"), "%s", r.out);
    cr_assert(strstr(r.out, "DDP vs DP      step 1: params max |diff| 0.00e+00"), "%s", r.out);
    CLI(&r, "compare", "--model", GPT_FILE, "--data", words, "--steps", "2", "--batch", "4",
        "--device", "cpu:2", "--modes", "pp");
    expect(&r, 0, "verdict: PASS");
    /* the pipeline's cuts fall between the file's blocks (layers: the
     * embeddings, each block, the final layernorm and head) */
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--split", "0,3", "--model", GPT_FILE,
        "--data", words, "--epochs", "1", "--max-steps", "2", "--batch", "4");
    expect(&r, 0, "epoch 1/1");
    cr_assert_eq(cli_shm_entries(), 0);
}

Test(cli_gpt_file, sample_and_eval_read_its_checkpoint)
{
    static cli_result r;
    const char *words = tu_tpath(g_dir, "words.txt");
    const char *ck = tu_tpath(g_dir, "gpt.safetensors");
    cli_write_words(words);
    CLI(&r, "train", "--model", GPT_FILE, "--data", words, "--epochs", "1", "--max-steps", "2",
        "--batch", "4", "--save", ck);
    expect(&r, 0, "saved");
    CLI(&r, "sample", "--resume", ck, "--tokens", "16", "--prompt", "the");
    expect(&r, 0, "tandem sample: gpt:4-128-4-128");
    CLI(&r, "eval", "--resume", ck, "--model", GPT_FILE, "--data", words);
    expect(&r, 0, "loss");
    CLI(&r, "eval", "--resume", ck, "--model", "file:examples/models/lenet5.tdm");
    expect(&r, 2, "it was trained as 'gpt:4-128-4-128'");
}

Test(cli_gpt_file, an_untied_head_in_every_data_parallel_mode)
{
    static cli_result r;
    const char *words = tu_tpath(g_dir, "words.txt");
    char file[256], model[300], ck[256];
    cli_write_words(words);
    snprintf(file, sizeof file, "%s", tu_tpath(g_dir, "untied.tdm"));
    snprintf(ck, sizeof ck, "%s", tu_tpath(g_dir, "untied.safetensors"));
    snprintf(model, sizeof model, "file:%s", file);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs("input tokens 32\nembedding vocab 256 dim 32\nembedding positions\n"
          "residual {\nlayernorm\nattention heads 2\n}\nresidual {\nlayernorm\ngptmlp\n}\n"
          "residual {\nlayernorm\nattention heads 2\n}\nresidual {\nlayernorm\ngptmlp\n}\n"
          "layernorm\nlmhead\n", f);
    cr_assert_eq(fclose(f), 0);
    CLI(&r, "compare", "--model", model, "--data", words, "--steps", "2", "--batch", "4",
        "--device", "cpu:2", "--modes", "single,dp,ddp,fsdp,zero2,zero1");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "FSDP vs DDP: bitwise the same parameters"), "%s", r.out);
    cr_assert(strstr(r.out, "DDP vs DP      step 1: params max |diff| 0.00e+00"), "%s", r.out);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", "--model", model, "--data", words,
        "--epochs", "1", "--max-steps", "1", "--batch", "4");
    expect(&r, 2, "untied.tdm: a GPT with an untied head runs whole");
    cr_assert(strchr(r.out, '\n') && !strchr(r.out, '\n')[1], "more than one line:\n%s", r.out);
    CLI(&r, "compare", "--model", model, "--data", words, "--steps", "1", "--batch", "4",
        "--device", "cpu:2", "--modes", "tp");
    expect(&r, 2, "has an untied head");
    CLI(&r, "train", "--model", model, "--data", words, "--epochs", "1", "--max-steps", "1",
        "--batch", "4", "--save", ck);
    expect(&r, 0, "--model file:");
    CLI(&r, "sample", "--resume", ck, "--tokens", "8");
    expect(&r, 2, "give it as --model file:PATH");
    CLI(&r, "sample", "--resume", ck, "--tokens", "8", "--model", model);
    expect(&r, 0, "untied head) from");
    CLI(&r, "eval", "--resume", ck, "--model", model, "--data", words);
    expect(&r, 0, "loss");
    cr_assert_eq(cli_shm_entries(), 0);
}
