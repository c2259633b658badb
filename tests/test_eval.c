/* tests/test_eval.c: `tandem eval --resume CK`: the loss and accuracy of a
 * checkpoint on data, without training, are the numbers train printed
 * for the same checkpoint (train --precise: 9 significant digits, the
 * same as eval's), for images (DDP-trained, evaluated on one device) and
 * a gpt (bits per byte); images evaluated at train's batch (--batch)
 * give train's digits, at another batch the same to rounding;
 * --dump-logits writes one row per sample (per
 * position) of target + logits; bad usage is 2. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_util.h"

/* The text after `key` up to the next ',' or space-delimited field end. */
static void ev_field(const char *out, const char *key, char *buf, size_t len)
{
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no '%s' in:\n%s", key, out);
    p += strlen(key);
    snprintf(buf, len, "%.*s", (int)strcspn(p, ", \n"), p);
}

static int ev_lines(const char *path, int *cols)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    char line[1 << 16];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#') continue;
        int c = 1;
        for (char *p = line; *p && *p != '\n'; p++) c += *p == ' ';
        *cols = c;
        n++;
    }
    fclose(f);
    return n;
}

Test(eval, images_checkpoint_matches_train_and_dumps_logits, .timeout = 300)
{
    char dir[] = "/tmp/tdm_eval_XXXXXX", ck[64], dump[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(ck, sizeof ck, "%s/m.safetensors", dir);
    snprintf(dump, sizeof dump, "%s/logits.txt", dir);
    cli_result r;
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "1200", "--model", "mlp:784-32-10", "--epochs", "2", "--precise",
        "--save", ck);
    expect(&r, 0, "epoch 2/2: train loss ");
    char tl[64], ta[64];
    const char *e2 = strstr(r.out, "epoch 2/2:");
    ev_field(e2, "test loss ", tl, sizeof tl);
    ev_field(e2, "test accuracy ", ta, sizeof ta);
    cr_expect_gt(strlen(tl), 6, "--precise printed '%s'", tl);
    CLI(&r, "eval", "--resume", ck, "--data", "synthetic", "--synthetic-size", "1200",
        "--dump-logits", dump);
    expect(&r, 0, "test set (200 samples): loss ");
    char el[64], ea[64];
    ev_field(r.out, "test set (200 samples): loss ", el, sizeof el);
    ev_field(r.out, ", accuracy ", ea, sizeof ea);
    /* DDP's evaluation adds its ranks' sums: the same to float rounding */
    cr_expect(fabs(strtod(el, NULL) - strtod(tl, NULL)) <= 1e-6 * strtod(tl, NULL),
              "eval's loss %s, train's %s", el, tl);
    cr_expect_str_eq(ea, ta);
    cr_expect(strstr(r.out, "epoch 2, step 10"), "%s", r.out);
    int cols = 0;
    cr_expect_eq(ev_lines(dump, &cols), 8);
    cr_expect_eq(cols, 11, "target + 10 logits");
    /* trained on one device: the same digits */
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "1200", "--model",
        "mlp:784-32-10", "--epochs", "1", "--precise", "--save", ck);
    expect(&r, 0, "epoch 1/1: train loss ");
    ev_field(r.out, "test loss ", tl, sizeof tl);
    CLI(&r, "eval", "--resume", ck, "--data", "synthetic", "--synthetic-size", "1200");
    ev_field(r.out, "test set (200 samples): loss ", el, sizeof el);
    cr_expect_str_eq(el, tl);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}

/* The CNN trained on one device at --batch 32: train evaluates at its
 * batch, and `eval --batch 32` prints its digits. At eval's default
 * (1000 images a pass) the products' shapes differ and OpenBLAS rounds
 * them otherwise: the last digit may move (1.63400202 against train's
 * 1.63400203, a review's run), so the default is checked to rounding. */
Test(eval, cnn_at_trains_batch_gives_trains_digits, .timeout = 300)
{
    char dir[] = "/tmp/tdm_eval_XXXXXX", ck[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(ck, sizeof ck, "%s/c.safetensors", dir);
    cli_result r;
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "1500", "--model", "cnn",
        "--batch", "32", "--epochs", "1", "--precise", "--save", ck);
    expect(&r, 0, "epoch 1/1: train loss ");
    char tl[64], ta[64], el[64], ea[64];
    const char *e1 = strstr(r.out, "epoch 1/1:");
    ev_field(e1, "test loss ", tl, sizeof tl);
    ev_field(e1, "test accuracy ", ta, sizeof ta);
    CLI(&r, "eval", "--resume", ck, "--data", "synthetic", "--synthetic-size", "1500",
        "--batch", "32");
    expect(&r, 0, "test set (250 samples): loss ");
    ev_field(r.out, "test set (250 samples): loss ", el, sizeof el);
    ev_field(r.out, ", accuracy ", ea, sizeof ea);
    cr_expect_str_eq(el, tl);
    cr_expect_str_eq(ea, ta);
    CLI(&r, "eval", "--resume", ck, "--data", "synthetic", "--synthetic-size", "1500");
    ev_field(r.out, "test set (250 samples): loss ", el, sizeof el);
    cr_expect(fabs(strtod(el, NULL) - strtod(tl, NULL)) <= 1e-6 * strtod(tl, NULL),
              "eval's loss %s at 1000 a pass, train's %s", el, tl);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}

Test(eval, gpt_checkpoint_bits_per_byte_match_train, .timeout = 300)
{
    char dir[] = "/tmp/tdm_eval_XXXXXX", ck[64], text[64], dump[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(ck, sizeof ck, "%s/g.safetensors", dir);
    snprintf(text, sizeof text, "%s/words.txt", dir);
    snprintf(dump, sizeof dump, "%s/logits.txt", dir);
    cli_write_words(text);
    cli_result r;
    CLI(&r, "train", "--model", "gpt:1-32-2-16", "--data", text, "--batch", "8", "--epochs", "1",
        "--max-steps", "5", "--precise", "--save", ck);
    expect(&r, 0, "val loss ");
    char vl[64], bpb[64];
    ev_field(r.out, "val loss ", vl, sizeof vl);
    ev_field(r.out, " nats = ", bpb, sizeof bpb);
    CLI(&r, "eval", "--resume", ck, "--data", text, "--dump-logits", dump);
    expect(&r, 0, "validation text (");
    char el[64], eb[64];
    ev_field(r.out, "bytes): loss ", el, sizeof el);
    ev_field(r.out, " nats = ", eb, sizeof eb);
    cr_expect_str_eq(el, vl);
    cr_expect_str_eq(eb, bpb);
    int cols = 0;
    cr_expect_eq(ev_lines(dump, &cols), 16, "one row per position of the window");
    cr_expect_eq(cols, 1 + 256);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

Test(eval, usage, .timeout = 30)
{
    cli_result r;
    CLI(&r, "eval");
    expect(&r, 2, "--resume CK is required");
    CLI(&r, "eval", "--resume", "x.safetensors", "--batch", "0");
    expect(&r, 2, "--batch");
    CLI(&r, "eval", "--resume", "x.safetensors", "--mode", "ddp");
    expect(&r, 2, "evaluation runs on one device");
    CLI(&r, "eval", "--resume", "/nonexistent/x.safetensors");
    cr_expect_eq(r.code, 1, "%s", r.out);
    CLI(&r, "eval", "--help");
    expect(&r, 0, "--dump-logits FILE");
    CLI(&r, "--help");
    expect(&r, 0, "eval      a checkpoint's loss");
}
