/* tests/test_cli.c: the tandem command as a user meets it: exit codes and
 * messages for bad input (never a crash), --help, a short successful run,
 * save and resume. Runs the binary named by $TANDEM_BIN (set by
 * tests/run_all.sh), else build/tandem. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "tests/cli_util.h"

Test(cli, usage_errors)
{
    static cli_result r;
    CLI(&r, "frobnicate");
    expect(&r, 2, "unknown command 'frobnicate'");
    CLI(&r, "train", "--bogus");
    expect(&r, 2, "unknown option '--bogus'");
    CLI(&r, "train", "--epochs", "abc");
    expect(&r, 2, "'abc' is not an integer");
    CLI(&r, "train", "--epochs", "0");
    expect(&r, 2, "out of range");
    CLI(&r, "train", "--batch", "12x");
    expect(&r, 2, "not an integer");
    CLI(&r, "train", "--lr", "-1");
    expect(&r, 2, "out of range");
    CLI(&r, "train", "--lr", "nan");
    expect(&r, 2, "not a finite number");
    CLI(&r, "train", "--model", "resnet");
    expect(&r, 2, "unknown model 'resnet'");
    CLI(&r, "train", "--model", "mlp:784-0-10");
    expect(&r, 2, "widths must be integers");
    CLI(&r, "train", "--optim", "rmsprop");
    expect(&r, 2, "expected sgd or adamw");
    CLI(&r, "train", "--mode", "zero");
    expect(&r, 2, "expected single, dp, ddp, fsdp, pp or tp");
    CLI(&r, "train", "--device", "tpu:3");
    expect(&r, 2, "device spec 'tpu:3'");
    CLI(&r, "train", "--device", "cpu:2");
    expect(&r, 2, "--mode single uses one device");
    CLI(&r, "train", "--epochs");
    expect(&r, 2, "--epochs needs a value");
    /* an empty value is missing too, said once, in every subcommand */
    const char *empty[][3] = {{"train", "--mode=", "--mode needs a value"},
                              {"compare", "--device=", "--device needs a value"},
                              {"bench", "gemm", "--threads"},
                              {"launch", "--log-dir=", "--log-dir needs a value"}};
    for (int k = 0; k < 4; k++) {
        if (k == 2) CLI(&r, empty[k][0], empty[k][1], empty[k][2]);
        else CLI(&r, empty[k][0], empty[k][1]);
        expect(&r, 2, k == 2 ? "--threads needs a value" : empty[k][2]);
        cr_assert(strchr(r.out, '\n') == strrchr(r.out, '\n'), "more than one line:\n%s", r.out);
    }
}

Test(cli, help_and_info)
{
    static cli_result r;
    CLI(&r, "train", "--help");
    expect(&r, 0, "--mode single|dp|ddp|fsdp");
    static const char *flags[] = {"--model", "--device", "--threads", "--epochs", "--batch",
                                  "--optim", "--lr", "--seed", "--data", "--save", "--resume"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        cr_assert(strstr(r.out, flags[i]), "train --help lacks %s", flags[i]);
    CLI(&r, "info");
    expect(&r, 0, "host backend");
    CLI(&r, "--help");
    expect(&r, 0, "train");
}

Test(cli, no_cuda_device)
{
    static cli_result r;
    CLI(&r, "train", "--device", "cuda", "--data", "synthetic");
    expect(&r, 1, "no CUDA device");
    cr_assert(strstr(r.out, "--device cpu"), "no hint to use cpu:\n%s", r.out);
}

Test(cli, missing_and_bad_data)
{
    static cli_result r;
    CLI(&r, "train", "--data", "/nonexistent-tandem-dir");
    expect(&r, 1, "No such file or directory");

    char dir[] = "/tmp/tandem-cli-XXXXXX";
    cr_assert(mkdtemp(dir));
    char path[256];
    /* A truncated image file next to a good-looking label file. */
    snprintf(path, sizeof path, "%s/train-images-idx3-ubyte", dir);
    FILE *f = fopen(path, "wb");
    unsigned char hdr[16] = {0, 0, 8, 3, 0, 0, 0, 10, 0, 0, 0, 28, 0, 0, 0, 28};
    fwrite(hdr, 1, sizeof hdr, f);
    static const unsigned char some[100];
    fwrite(some, 1, sizeof some, f); /* 100 of 7840 payload bytes */
    fclose(f);
    snprintf(path, sizeof path, "%s/train-labels-idx1-ubyte", dir);
    f = fopen(path, "wb");
    unsigned char lh[8] = {0, 0, 8, 1, 0, 0, 0, 10};
    unsigned char labels[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    fwrite(lh, 1, sizeof lh, f);
    fwrite(labels, 1, sizeof labels, f);
    fclose(f);
    CLI(&r, "train", "--data", dir);
    expect(&r, 1, "train-images-idx3-ubyte");
    cr_assert(strstr(r.out, "trunc") || strstr(r.out, "expected"), "%s", r.out);

    /* wrong magic */
    snprintf(path, sizeof path, "%s/train-images-idx3-ubyte", dir);
    f = fopen(path, "wb");
    memset(hdr, 0, 4);
    fwrite(hdr, 1, sizeof hdr, f);
    fclose(f);
    CLI(&r, "train", "--data", dir);
    expect(&r, 1, "magic");
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert(system(cmd) == 0);
}

Test(cli, train_save_resume_and_bad_checkpoints)
{
    static cli_result r;
    char dir[] = "/tmp/tandem-cli-XXXXXX";
    cr_assert(mkdtemp(dir));
    char ckpt[256], bad[256], cmd[600];
    snprintf(ckpt, sizeof ckpt, "%s/run.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "1200", "--model",
        "mlp:784-32-10", "--batch", "64", "--epochs", "1", "--save", ckpt);
    expect(&r, 0, "test accuracy");
    cr_assert(strstr(r.out, "epoch 1/1"), "%s", r.out);
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "1200", "--model",
        "mlp:784-32-10", "--batch", "64", "--epochs", "2", "--resume", ckpt);
    expect(&r, 0, "resumed");
    cr_assert(!strstr(r.out, "epoch 1/2:"), "resume retrained epoch 1:\n%s", r.out);
    char resumed[256], straight[256];
    epoch_result(r.out, "epoch 2/2", resumed, sizeof resumed);
    /* the same two epochs without the interruption end the same way */
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "1200", "--model",
        "mlp:784-32-10", "--batch", "64", "--epochs", "2");
    expect(&r, 0, "test accuracy");
    epoch_result(r.out, "epoch 2/2", straight, sizeof straight);
    cr_assert_str_eq(resumed, straight, "resumed run ends %s, uninterrupted %s", resumed,
                     straight);

    /* a checkpoint of another model */
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "1200", "--model",
        "mlp:784-16-10", "--epochs", "2", "--resume", ckpt);
    expect(&r, 1, "mlp 784-32-10");

    /* a corrupt checkpoint: header length beyond the file */
    snprintf(cmd, sizeof cmd, "head -c 100 %s > %s", ckpt, bad);
    cr_assert(system(cmd) == 0);
    CLI(&r, "train", "--data", "synthetic", "--model", "mlp:784-32-10", "--resume", bad);
    expect(&r, 1, "bad.safetensors");
    /* not a checkpoint at all */
    snprintf(cmd, sizeof cmd, "echo hello > %s", bad);
    cr_assert(system(cmd) == 0);
    CLI(&r, "train", "--data", "synthetic", "--model", "mlp:784-32-10", "--resume", bad);
    expect(&r, 1, "bad.safetensors");
    CLI(&r, "train", "--data", "synthetic", "--model", "mlp:784-32-10", "--resume",
        "/nonexistent/x.safetensors");
    expect(&r, 1, "No such file");

    /* a checkpoint path that cannot work fails before training, clearly
     * (it used to fail after the first epoch) */
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "600", "--model",
        "mlp:784-16-10", "--epochs", "1", "--save", "/nonexistent-dir/x.safetensors");
    expect(&r, 2, "--save: /nonexistent-dir/x.safetensors: cannot open its directory");
    cr_assert(!strstr(r.out, "epoch 1/1"), "trained before refusing:\n%s", r.out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert(system(cmd) == 0);
}
