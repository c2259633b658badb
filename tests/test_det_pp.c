/* tests/test_det_pp.c: --deterministic K with the pipeline design. The
 * micro-batches of each of the D pipeline replicas are its K/D virtual
 * shards and their gradients are summed by the same fixed tree as the
 * data-parallel modes', so after 20 steps the final checkpoint holds the
 * bytes (cmp) of one device's --deterministic K run, for S = 1, 2, 3 and
 * D x S = 2 x 2, both schedules, on the MLP, the CNN (per-shard
 * batchnorm), the GPT (its tied embedding's gradient added in one
 * device's order) and a model file with dropout in the first stage; a
 * short last batch of an epoch is cut the same way; a checkpoint of a
 * 2 x 2 mesh resumes on another shape; ZeRO-1 over the dp dimension
 * keeps the bytes. Bad combinations get one line and exit 2. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[128];
static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "detpp");
    cli_write_words(tu_tpath(g_dir, "words.txt"));
}
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(det_pp, .init = setup, .fini = teardown, .timeout = 600);

/* A pipeline layout: its --device, --mesh (NULL: none), --schedule. */
typedef struct pp_shape {
    const char *device, *mesh, *schedule;
} pp_shape;

static const pp_shape k_shapes[] = {{"cpu:1", NULL, "1f1b"},
                                    {"cpu:2", NULL, "1f1b"},
                                    {"cpu:2", NULL, "gpipe"},
                                    {"cpu:4", "dp=2,pp=2", "1f1b"},
                                    {"cpu:4", "dp=2,pp=2", "gpipe"}};
#define N_SHAPES (int)(sizeof k_shapes / sizeof k_shapes[0])

/* 20 steps (one epoch unless steps say more) of args, single (sh NULL)
 * or pipelined, with --deterministic 8, saved at path. */
static void pp_train(const char *const *args, const pp_shape *sh, const char *path)
{
    static cli_result r;
    const char *argv[48];
    int a = 0;
    argv[a++] = "train";
    if (sh) {
        argv[a++] = "--mode";
        argv[a++] = "pp";
        argv[a++] = "--device";
        argv[a++] = sh->device;
        argv[a++] = "--schedule";
        argv[a++] = sh->schedule;
        if (sh->mesh) {
            argv[a++] = "--mesh";
            argv[a++] = sh->mesh;
        }
    }
    for (int i = 0; args[i]; i++) argv[a++] = args[i];
    const char *tail[] = {"--deterministic", "8", "--no-eval", "--quiet", "--save", path, NULL};
    for (int i = 0; tail[i]; i++) argv[a++] = tail[i];
    argv[a] = NULL;
    cli_run(&r, argv);
    cr_assert_eq(r.code, 0, "%s on %s%s%s (%s): exit %d:\n%s", args[1], sh ? sh->device : "one",
                 sh && sh->mesh ? " --mesh " : "", sh && sh->mesh ? sh->mesh : "",
                 sh ? sh->schedule : "single", r.code, r.out);
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
}

/* One device's run, then every shape: the same bytes. */
static void pp_same_as_single(const char *const *args)
{
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "pp.safetensors"));
    pp_train(args, NULL, ref);
    for (int i = 0; i < N_SHAPES; i++) {
        pp_train(args, &k_shapes[i], path);
        cr_assert(cli_same_file(ref, path), "%s: pp on %s%s%s (%s): checkpoint differs from one "
                  "device's", args[1], k_shapes[i].device, k_shapes[i].mesh ? " --mesh " : "",
                  k_shapes[i].mesh ? k_shapes[i].mesh : "", k_shapes[i].schedule);
    }
}

#define SYN "--data", "synthetic", "--synthetic-size", "1200"
#define STEPS "--epochs", "1", "--max-steps", "20"

Test(det_pp, mlp_same_bytes_as_one_device)
{
    const char *sgd[] = {"--model", "mlp:784-24-10", SYN, "--batch", "32", STEPS, NULL};
    pp_same_as_single(sgd);
    /* three stages */
    const char *deep[] = {"--model", "mlp:784-24-16-10", SYN, "--batch", "32", "--optim", "adamw",
                          STEPS, NULL};
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "pp3.safetensors"));
    static const pp_shape three = {"cpu:3", NULL, "1f1b"};
    pp_train(deep, NULL, ref);
    pp_train(deep, &three, path);
    cr_assert(cli_same_file(ref, path), "mlp on 3 stages differs from one device");
}

/* Dropout in the first stage: a micro-batch's masks are those one
 * device draws for its shard, whichever replica runs it. */
Test(det_pp, dropout_model_file_same_bytes)
{
    char file[256], model[300];
    snprintf(file, sizeof file, "%s", tu_tpath(g_dir, "drop.tdm"));
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs("input 784\nlinear 24\ngelu\ndropout 0.25\nlinear 16\nrelu\nlinear 10\n", f);
    fclose(f);
    snprintf(model, sizeof model, "file:%s", file);
    const char *args[] = {"--model", model, SYN, "--batch", "32", STEPS, NULL};
    pp_same_as_single(args);
}

Test(det_pp, cnn_per_shard_batchnorm_same_bytes)
{
    const char *adamw[] = {"--model", "cnn", SYN, "--batch", "16", "--optim", "adamw", STEPS,
                           NULL};
    pp_same_as_single(adamw);
}

Test(det_pp, gpt_tied_embedding_same_bytes)
{
    char text[256];
    snprintf(text, sizeof text, "%s", tu_tpath(g_dir, "words.txt"));
    const char *adamw[] = {"--model", "gpt:1-16-2-16", "--data", text, "--batch", "16", STEPS,
                           NULL};
    pp_same_as_single(adamw);
    /* the embedding, a block and the head each on a stage of their own */
    const char *deep[] = {"--model", "gpt:2-16-2-16", "--data", text, "--batch", "8", "--optim",
                          "sgd", "--lr", "0.1", STEPS, NULL};
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "pp3.safetensors"));
    static const pp_shape three = {"cpu:3", NULL, "1f1b"}, four = {"cpu:4", NULL, "gpipe"};
    pp_train(deep, NULL, ref);
    pp_train(deep, &three, path);
    cr_assert(cli_same_file(ref, path), "gpt on 3 stages differs from one device");
    pp_train(deep, &four, path);
    cr_assert(cli_same_file(ref, path), "gpt on 4 stages differs from one device");
}

/* ZeRO-1 over the dp dimension (--sharding optimizer): each replica
 * steps its slice of a stage from the tree's sum; the same bytes, the
 * GPT's tied embedding included. */
Test(det_pp, zero1_on_the_dp_dimension_same_bytes)
{
    char text[256], ref[256], path[256];
    snprintf(text, sizeof text, "%s", tu_tpath(g_dir, "words.txt"));
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "zero1.safetensors"));
    const char *cnn[] = {"--model", "cnn", SYN, "--batch", "16", "--optim", "adamw", STEPS,
                         NULL};
    const char *gpt[] = {"--model", "gpt:1-16-2-16", "--data", text, "--batch", "16", STEPS,
                         NULL};
    const char *const *cases[] = {cnn, gpt};
    for (int i = 0; i < 2; i++) {
        const char *args[24];
        int a = 0;
        args[a++] = cases[i][0];
        args[a++] = cases[i][1];
        args[a++] = "--sharding";
        args[a++] = "optimizer";
        for (int j = 2; cases[i][j]; j++) args[a++] = cases[i][j];
        args[a] = NULL;
        pp_train(cases[i], NULL, ref);
        pp_train(args, &k_shapes[3], path);
        cr_assert(cli_same_file(ref, path), "%s: ZeRO-1 on a 2 x 2 mesh differs from one device",
                  cases[i][1]);
    }
}

/* Two whole epochs of 1204 samples: each ends on a batch of 20, whose 8
 * shards are of 2 and 3 samples (dist/batch.h's cut, not a pipeline's
 * even one). */
Test(det_pp, short_last_batch_same_bytes)
{
    const char *args[] = {"--model", "mlp:784-24-10", "--data", "synthetic", "--synthetic-size",
                          "1204", "--batch", "32", "--epochs", "2", NULL};
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "pp.safetensors"));
    pp_train(args, NULL, ref);
    pp_train(args, &k_shapes[3], path);
    cr_assert(cli_same_file(ref, path), "two epochs with a short last batch on a 2 x 2 mesh "
              "differ from one device");
}

/* 20 steps on a 2 x 2 mesh, saved; 20 more on a pipeline of 2, and on
 * DDP over 2: the bytes of 40 steps on one device. */
Test(det_pp, resume_across_mesh_shapes)
{
    static cli_result r;
    char half[256], resumed[256], whole[256];
    snprintf(half, sizeof half, "%s", tu_tpath(g_dir, "half.safetensors"));
    snprintf(resumed, sizeof resumed, "%s", tu_tpath(g_dir, "resumed.safetensors"));
    snprintf(whole, sizeof whole, "%s", tu_tpath(g_dir, "whole.safetensors"));
#define RES_ARGS "--model", "cnn", SYN, "--batch", "16", "--deterministic", "8", "--optim", \
                 "adamw", "--max-steps", "20", "--no-eval", "--quiet"
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", RES_ARGS,
        "--epochs", "1", "--save", half);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", RES_ARGS, "--epochs", "2", "--save", whole);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:2", RES_ARGS, "--epochs", "2", "--resume",
        half, "--save", resumed);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(resumed, whole), "2 x 2 then a pipeline of 2 differ from one device");
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", RES_ARGS, "--epochs", "2", "--resume",
        half, "--save", resumed);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(resumed, whole), "2 x 2 then DDP on 2 differ from one device");
#undef RES_ARGS
}

Test(det_pp, bad_combinations_are_one_line_errors)
{
    static cli_result r;
    static const struct {
        const char *args[14];
        const char *phrase;
    } cases[] = {
        {{"--device", "cpu:8", "--mesh", "dp=4,pp=2", "--deterministic", "2", "--batch", "8",
          NULL},
         "K must be divisible by the 4 pipeline replicas"},
        {{"--device", "cpu:2", "--deterministic", "8", "--microbatches", "4", NULL},
         "--microbatches 4: with --deterministic 8 over 1 pipeline replica the micro-batches "
         "are a replica's K/D = 8"},
        {{"--device", "cpu:2", "--deterministic", "8", "--synthetic-size", "37", "--batch", "32",
          NULL},
         "each epoch ends on a batch of 5 samples, fewer than the K virtual shards"},
        {{"--device", "cpu:2", "--deterministic", "8", "--batch", "12", NULL},
         "global batch 12 is not divisible"},
        {{"--device", "cpu:4", "--mesh", "dp=1,pp=2,tp=2", "--deterministic", "8", NULL},
         "--deterministic 8 with tensor-parallel stages (--mesh ...,tp=2) is not supported"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *argv[32];
        int a = 0;
        argv[a++] = "train";
        argv[a++] = "--mode";
        argv[a++] = "pp";
        argv[a++] = "--model";
        argv[a++] = "mlp:784-24-10";
        argv[a++] = "--data";
        argv[a++] = "synthetic";
        argv[a++] = "--synthetic-size";
        argv[a++] = "64";
        for (int j = 0; cases[i].args[j]; j++) argv[a++] = cases[i].args[j];
        argv[a] = NULL;
        cli_run(&r, argv);
        expect(&r, 2, cases[i].phrase);
        cr_assert_eq(strchr(r.out, '\n'), r.out + strlen(r.out) - 1, "not one line:\n%s", r.out);
        cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
    }
}

/* Through the CUDA emulator (cuda/emulator.c): a pipeline of two
 * emulated GPUs, and a 2 x 2 mesh of them, against one emulated GPU. */
Test(det_pp, cuda_emulator_same_bytes)
{
    static cli_result r;
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "emu1.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "emu.safetensors"));
    setenv("TANDEM_CUDA_EMULATOR", "4", 1);
#define EMU_ARGS "--model", "cnn", SYN, "--batch", "16", "--deterministic", "8", "--epochs", \
                 "1", "--max-steps", "4", "--no-eval", "--quiet"
    CLI(&r, "train", "--device", "cuda", EMU_ARGS, "--save", ref);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", "--mode", "pp", "--device", "cuda:0,1", EMU_ARGS, "--save", path);
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(ref, path), "emulated pp on 2 GPUs differs from one emulated GPU");
    CLI(&r, "train", "--mode", "pp", "--device", "cuda:0,1,2,3", "--mesh", "dp=2,pp=2",
        EMU_ARGS, "--save", path);
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(ref, path), "emulated pp 2 x 2 differs from one emulated GPU");
    unsetenv("TANDEM_CUDA_EMULATOR");
#undef EMU_ARGS
}
