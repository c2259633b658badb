/* tests/test_det.c: --deterministic K as a user meets it. With K = 8 the
 * final checkpoint after 20 steps holds the same bytes (cmp) whatever the
 * device count (1, 2, 4, 8) and whatever the data-parallel mode (single,
 * DP, DDP, ZeRO-1, ZeRO-2, FSDP), for the MLP, the CNN (per-shard
 * batchnorm), the GPT and a model file with dropout, with SGD and AdamW,
 * with and without --grad-accum; without --deterministic the device
 * counts differ (the test would catch nothing if they did not). A
 * checkpoint written at N = 4 resumes at N = 2 and ends on the bytes of
 * an uninterrupted run on one device. Bad combinations get one line and
 * exit 2. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[128];
static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "det");
    cli_write_words(tu_tpath(g_dir, "words.txt"));
}
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(det, .init = setup, .fini = teardown, .timeout = 600);

/* A mode at a device count: --mode and --device (and --sharding). */
typedef struct det_mode {
    const char *mode, *sharding;
} det_mode;
static const det_mode k_modes[] = {{"dp", NULL},       {"ddp", NULL},
                                   {"fsdp", "optimizer"}, {"fsdp", "grad_op"},
                                   {"fsdp", "full"}};
#define N_MODES (int)(sizeof k_modes / sizeof k_modes[0])

/* One model's run: the arguments every run of it shares. */
typedef struct det_case {
    const char *name;
    const char *args[16];
} det_case;

/* Trains 20 steps (one epoch) in mode md (NULL: single) on n devices
 * with the case's arguments, --deterministic K (0: without), saving at
 * path. */
static void det_train(const det_case *c, const det_mode *md, int n, int K, const char *path)
{
    static cli_result r;
    const char *argv[48];
    char dev[16], k[16];
    int a = 0;
    snprintf(dev, sizeof dev, "cpu:%d", n);
    snprintf(k, sizeof k, "%d", K);
    argv[a++] = "train";
    argv[a++] = "--mode";
    argv[a++] = md ? md->mode : "single";
    argv[a++] = "--device";
    argv[a++] = md ? dev : "cpu";
    if (md && md->sharding) {
        argv[a++] = "--sharding";
        argv[a++] = md->sharding;
    }
    if (K) {
        argv[a++] = "--deterministic";
        argv[a++] = k;
    }
    for (int i = 0; c->args[i]; i++) argv[a++] = c->args[i];
    const char *tail[] = {"--epochs", "1", "--max-steps", "20", "--no-eval", "--quiet",
                          "--save", path, NULL};
    for (int i = 0; tail[i]; i++) argv[a++] = tail[i];
    argv[a] = NULL;
    cli_run(&r, argv);
    cr_assert_eq(r.code, 0, "%s %s%s%s on %d: exit %d:\n%s", c->name, md ? md->mode : "single",
                 md && md->sharding ? " " : "", md && md->sharding ? md->sharding : "", n,
                 r.code, r.out);
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
}

/* Single device first, then every N in 2, 4, 8 in `per_n` modes of the
 * list (rotated by `rot`, so that the cases together cover every mode at
 * every N): every checkpoint the same bytes as the single device's. */
static void det_same_everywhere(const det_case *c, int per_n, int rot)
{
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    det_train(c, NULL, 1, 8, ref);
    static const int ns[] = {2, 4, 8};
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < per_n; j++) {
            const det_mode *md = &k_modes[(rot + i + j) % N_MODES];
            snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "run.safetensors"));
            det_train(c, md, ns[i], 8, path);
            cr_assert(cli_same_file(ref, path), "%s: %s%s%s on %d devices: checkpoint differs "
                      "from one device's", c->name, md->mode, md->sharding ? " " : "",
                      md->sharding ? md->sharding : "", ns[i]);
        }
    }
}

#define SYN "--data", "synthetic", "--synthetic-size", "1200"

Test(det, mlp_sgd_every_mode_every_count_same_bytes)
{
    det_case c = {"mlp sgd", {"--model", "mlp:784-24-10", SYN, "--batch", "32", NULL}};
    det_same_everywhere(&c, N_MODES, 0);
}

Test(det, mlp_adamw_and_grad_accum_same_bytes)
{
    det_case c = {"mlp adamw", {"--model", "mlp:784-24-10", SYN, "--batch", "32", "--optim",
                                "adamw", NULL}};
    det_same_everywhere(&c, 2, 1);
    det_case ga = {"mlp sgd grad-accum", {"--model", "mlp:784-24-10", SYN, "--batch", "16",
                                          "--grad-accum", "3", NULL}};
    det_same_everywhere(&ga, 2, 3);
    det_case gb = {"mlp adamw grad-accum", {"--model", "mlp:784-24-10", SYN, "--batch", "16",
                                            "--grad-accum", "2", "--optim", "adamw", NULL}};
    det_same_everywhere(&gb, 1, 2);
}

Test(det, cnn_per_shard_batchnorm_same_bytes)
{
    det_case c = {"cnn sgd", {"--model", "cnn", SYN, "--batch", "16", NULL}};
    det_same_everywhere(&c, 2, 0);
    det_case a = {"cnn adamw grad-accum", {"--model", "cnn", SYN, "--batch", "8", "--grad-accum",
                                           "2", "--optim", "adamw", NULL}};
    det_same_everywhere(&a, 1, 4);
}

/* A model file with dropout: each shard's masks are those one device
 * draws for it, whichever rank runs it (the masks count the training
 * forwards: the shard's place in the step's K, not the rank's count). */
Test(det, dropout_model_file_same_bytes)
{
    char file[256], model[300];
    snprintf(file, sizeof file, "%s", tu_tpath(g_dir, "drop.tdm"));
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs("input 784\nlinear 24\ngelu\ndropout 0.25\nlinear 10\n", f);
    fclose(f);
    snprintf(model, sizeof model, "file:%s", file);
    det_case c = {"mlp dropout file", {"--model", model, SYN, "--batch", "32", NULL}};
    det_same_everywhere(&c, 2, 0);
}

Test(det, gpt_same_bytes)
{
    char text[256];
    snprintf(text, sizeof text, "%s", tu_tpath(g_dir, "words.txt"));   /* tu_tpath's is reused */
    det_case c = {"gpt adamw", {"--model", "gpt:1-16-2-16", "--data", text, "--batch", "16",
                                NULL}};
    det_same_everywhere(&c, 2, 2);
    det_case s = {"gpt sgd", {"--model", "gpt:1-16-2-16", "--data", text, "--batch", "8",
                              "--optim", "sgd", "--lr", "0.1", NULL}};
    det_same_everywhere(&s, 1, 0);
}

/* The all-gather of the subtree sums goes in chunks (1 MiB per rank by
 * default, dist/det.h); chunks of 1000 floats (the losses' chunk holds
 * gradient elements too) and of 4776 (19104 / 4: the losses alone in the
 * last chunk) split the MLP's 19104 parameters into many, through the
 * test hook TANDEM_TEST_DET_CHUNK_ELEMS: the same bytes as one device. */
Test(det, chunked_all_gather_same_bytes)
{
    det_case c = {"mlp sgd", {"--model", "mlp:784-24-10", SYN, "--batch", "32", NULL}};
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "ref.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "run.safetensors"));
    det_train(&c, NULL, 1, 8, ref);
    static const char *const chunks[] = {"1000", "4776"};
    static const det_mode ddp = {"ddp", NULL}, full = {"fsdp", "full"};
    for (int i = 0; i < 2; i++) {
        setenv("TANDEM_TEST_DET_CHUNK_ELEMS", chunks[i], 1);
        det_train(&c, &ddp, 2, 8, path);
        cr_assert(cli_same_file(ref, path), "ddp on 2, chunks of %s: differs", chunks[i]);
        det_train(&c, &full, 4, 8, path);
        cr_assert(cli_same_file(ref, path), "fsdp on 4, chunks of %s: differs", chunks[i]);
        unsetenv("TANDEM_TEST_DET_CHUNK_ELEMS");
    }
}

/* What the test above would miss if sums did not depend on N: without
 * --deterministic, one device and two differ. */
Test(det, without_it_device_counts_differ)
{
    det_case c = {"mlp sgd", {"--model", "mlp:784-24-10", SYN, "--batch", "32", NULL}};
    char a[256], b[256];
    snprintf(a, sizeof a, "%s", tu_tpath(g_dir, "a.safetensors"));
    snprintf(b, sizeof b, "%s", tu_tpath(g_dir, "b.safetensors"));
    det_train(&c, NULL, 1, 0, a);
    det_train(&c, &k_modes[1], 2, 0, b);
    cr_assert(!cli_same_file(a, b), "one device and DDP(2) agree bit for bit without "
              "--deterministic: the test of it proves nothing");
}

/* 20 steps at N = 4, saved; 20 more at N = 2 from it: the bytes of 40
 * steps on one device. The checkpoint records nothing of N. */
Test(det, resume_across_device_counts)
{
    static cli_result r;
    char half[256], resumed[256], whole[256];
    snprintf(half, sizeof half, "%s", tu_tpath(g_dir, "half.safetensors"));
    snprintf(resumed, sizeof resumed, "%s", tu_tpath(g_dir, "resumed.safetensors"));
    snprintf(whole, sizeof whole, "%s", tu_tpath(g_dir, "whole.safetensors"));
#define RES_ARGS "--model", "cnn", SYN, "--batch", "16", "--deterministic", "8", "--optim", \
                 "adamw", "--max-steps", "20", "--no-eval", "--quiet"
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:4", RES_ARGS, "--epochs", "1", "--save",
        half);
    expect(&r, 0, "epoch 1/1");
    CLI(&r, "train", "--mode", "fsdp", "--device", "cpu:2", RES_ARGS, "--epochs", "2", "--resume",
        half, "--save", resumed);
    expect(&r, 0, "epoch 2/2");
    CLI(&r, "train", RES_ARGS, "--epochs", "2", "--save", whole);
    expect(&r, 0, "epoch 2/2");
    cr_assert(cli_same_file(resumed, whole), "20 steps at N=4 then 20 at N=2 differ from 40 on "
              "one device");
#undef RES_ARGS
}

Test(det, bad_combinations_are_one_line_errors)
{
    static cli_result r;
    static const struct {
        const char *args[12];
        const char *phrase;
    } cases[] = {
        {{"--deterministic", "6", NULL}, "K must be a power of two"},
        {{"--deterministic", "8", "--batch", "12", NULL}, "global batch 12 is not divisible"},
        {{"--mode", "ddp", "--device", "cpu:3", "--deterministic", "8", NULL},
         "divisible by the 3 devices"},
        {{"--mode", "dp", "--device", "cpu:3", "--deterministic", "4", NULL},
         "divisible by the 3 devices"},
        {{"--mode", "ddp", "--device", "cpu:2", "--model", "cnn", "--deterministic", "8",
          "--sync-bn", NULL},
         "cannot honour the fixed order with --sync-bn"},
        {{"--mode", "ddp", "--device", "cpu:2", "--deterministic", "8", "--uneven", NULL},
         "cannot honour the fixed order with --uneven"},
        {{"--mode", "ddp", "--device", "cpu:2", "--deterministic", "8", "--comm-hook", "fp16",
          NULL}, "cannot honour the fixed order with --comm-hook"},
        {{"--deterministic", "8", "--clip-grad-norm", "1", NULL},
         "not supported with --precision"},
        {{"--mode", "ddp", "--device", "cpu:2", "--min-devices", "2", NULL},
         "--min-devices applies to"},
        {{"--deterministic", "0", NULL}, "--deterministic"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *argv[24];
        int a = 0;
        argv[a++] = "train";
        argv[a++] = "--data";
        argv[a++] = "synthetic";
        argv[a++] = "--synthetic-size";
        argv[a++] = "64";
        for (int j = 0; cases[i].args[j]; j++) argv[a++] = cases[i].args[j];
        argv[a] = NULL;
        cli_run(&r, argv);
        expect(&r, 2, cases[i].phrase);
        cr_assert_eq(strchr(r.out, '\n'), r.out + strlen(r.out) - 1, "not one line:\n%s", r.out);
    }
}

/* Elastic resize: rank 3 of 4 killed before step 8 on every attempt.
 * With --min-devices 2 the second loss of rank 3 sends the job on to 2
 * devices from the last checkpoint, and it ends on the bytes of an
 * uninterrupted run; with --min-devices 4 it stops with one line saying
 * why. */
Test(det, elastic_resize_continues_bit_for_bit)
{
    static cli_result r;
    char whole[256], el[256], el4[256], dumps[256];
    snprintf(whole, sizeof whole, "%s", tu_tpath(g_dir, "whole.safetensors"));
    snprintf(el, sizeof el, "%s", tu_tpath(g_dir, "elastic.safetensors"));
    snprintf(el4, sizeof el4, "%s", tu_tpath(g_dir, "elastic4.safetensors"));
    snprintf(dumps, sizeof dumps, "%s", tu_tpath(g_dir, "fr"));
    cr_assert_eq(mkdir(dumps, 0700), 0, "%s", dumps);   /* the dumps of the failed attempts */
    setenv("TANDEM_FR_DUMP", dumps, 1);
#define EL_ARGS "--model", "mlp:784-24-10", SYN, "--batch", "32", "--deterministic", "8", \
                "--epochs", "3", "--max-steps", "5", "--no-eval", "--quiet"
    /* one run id for every run: a checkpoint records its run's
     * (docs/DEBUGGING.md), and only the restarted ones would carry one */
    setenv("TANDEM_RUN_ID", "det-elastic", 1);
    CLI(&r, "train", EL_ARGS, "--save", whole);
    expect(&r, 0, "epoch 3/3");
    setenv("TANDEM_DDP_TEST_KILL", "3:8:ALWAYS", 1);
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:4", EL_ARGS, "--max-restarts", "3",
        "--min-devices", "2", "--save", el);
    expect(&r, 0, "on 2 devices instead of 4");
    expect(&r, 0, "epoch 3/3");
    cr_assert(cli_same_file(whole, el), "the resized run's checkpoint differs from an "
              "uninterrupted run's:\n%s", r.out);
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:4", EL_ARGS, "--max-restarts", "3",
        "--min-devices", "4", "--save", el4);
    unsetenv("TANDEM_DDP_TEST_KILL");
    unsetenv("TANDEM_FR_DUMP");
    unsetenv("TANDEM_RUN_ID");
    expect(&r, 1, "is below --min-devices 4: stopping");
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
#undef EL_ARGS
}

/* tandem compare --deterministic: bytes, not a noise floor, and the cost
 * of determinism beside each run. */
Test(det, compare_says_bitwise_identical)
{
    static cli_result r;
    CLI(&r, "compare", "--deterministic", "8", "--sweep", "1,2", "--modes", "single,dp,ddp,zero1",
        "--model", "mlp:784-24-10", "--data", "synthetic", "--batch", "32", "--steps", "6");
    expect(&r, 0, "verdict: bitwise identical across 7 runs");
    cr_assert(strstr(r.out, "ZeRO-1        2"), "%s", r.out);
    cr_assert(!strstr(r.out, "DIFFERS"), "%s", r.out);
    CLI(&r, "compare", "--deterministic", "8", "--sweep", "1,3", "--data", "synthetic");
    expect(&r, 2, "every device count must divide K");
}

/* The CUDA backend through its emulator (cuda/emulator.c): one emulated
 * GPU, DDP over two and FSDP over four, DP over two: the same bytes. The
 * subtree sums leave each GPU for the host group, so no NCCL order is
 * relied upon. */
Test(det, cuda_emulator_same_bytes)
{
    static cli_result r;
    static const char *const modes[][2] = {{"ddp", "cuda:0,1"}, {"fsdp", "cuda:0,1,2,3"},
                                           {"dp", "cuda:0,1"}};
    char ref[256], path[256];
    snprintf(ref, sizeof ref, "%s", tu_tpath(g_dir, "emu1.safetensors"));
    snprintf(path, sizeof path, "%s", tu_tpath(g_dir, "emu.safetensors"));
    setenv("TANDEM_CUDA_EMULATOR", "4", 1);
#define EMU_ARGS "--model", "cnn", SYN, "--batch", "16", "--deterministic", "8", "--epochs", \
                 "1", "--max-steps", "4", "--no-eval", "--quiet"
    CLI(&r, "train", "--device", "cuda", EMU_ARGS, "--save", ref);
    expect(&r, 0, "epoch 1/1");
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        CLI(&r, "train", "--mode", modes[i][0], "--device", modes[i][1], EMU_ARGS, "--save",
            path);
        expect(&r, 0, "epoch 1/1");
        cr_assert(cli_same_file(ref, path), "emulated %s on %s differs from one emulated GPU",
                  modes[i][0], modes[i][1]);
    }
    unsetenv("TANDEM_CUDA_EMULATOR");
#undef EMU_ARGS
}
