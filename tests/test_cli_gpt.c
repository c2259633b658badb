/* tests/test_cli_gpt.c: tandem train --model gpt and tandem sample as a
 * user meets them, on a small made-up text: every mode trains on the same
 * global batches (single, DP(2) and DDP(2) print the same losses up to
 * float reassociation), a resumed run ends where an uninterrupted one
 * does, sampling is seeded and prints the prompt first, and bad input
 * (empty or too-short text, heads that do not divide the width, a
 * checkpoint that is not a GPT) gets one clear message and its exit code. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

static char g_dir[128];
static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "cligpt");
    /* about 12 KB of varied sentences */
    static const char *const words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a",
                                        "lazy", "dog", "and", "runs", "home", "at", "night"};
    FILE *f = fopen(tu_tpath(g_dir, "text.txt"), "w");
    cr_assert_not_null(f);
    tdm_rng r = tu_rng(99);
    for (int s = 0; s < 400; s++) {
        int n = 3 + (int)tdm_rng_below(&r, 6);
        for (int w = 0; w < n; w++)
            fprintf(f, "%s%s", w ? " " : "", words[tdm_rng_below(&r, 14)]);
        fputs(s % 5 == 4 ? ".\n\n" : ". ", f);
    }
    fclose(f);
}
static void teardown(void) { tu_rmtree(g_dir); }
TestSuite(cli_gpt, .init = setup, .fini = teardown, .timeout = 240);

/* "epoch E/N: train loss X, ..., val loss Y nats" -> X, Y */
static void losses(const char *out, const char *epoch, double *train, double *val)
{
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no '%s' line in:\n%s", key, out);
    *train = strtod(p + strlen(key), NULL);
    const char *v = strstr(p, "val loss ");
    cr_assert_not_null(v, "no val loss in:\n%s", out);
    *val = strtod(v + 9, NULL);
}

#define TINY "gpt:2-16-2-24"

Test(cli_gpt, every_mode_trains_on_the_same_global_batches)
{
    static cli_result r;
    const char *text = tu_tpath(g_dir, "text.txt");
    double tl[3], vl[3];
    static const char *const modes[3][2] = {{"single", "cpu"}, {"dp", "cpu:2"}, {"ddp", "cpu:2"}};
    for (int k = 0; k < 3; k++) {
        CLI(&r, "train", "--model", TINY, "--data", text, "--mode", modes[k][0], "--device",
            modes[k][1], "--epochs", "2", "--max-steps", "6", "--batch", "5", "--lr", "0.01");
        expect(&r, 0, "bigram model gets");
        cr_assert(strstr(r.out, "bits per byte"), "%s", r.out);
        cr_assert(strstr(r.out, "batch 5 windows of 24 bytes"), "%s", r.out);
        losses(r.out, "epoch 2/2", &tl[k], &vl[k]);
    }
    /* 5 windows over 2 ranks: 2 and 3 (uneven), the same 5 as one device */
    for (int k = 1; k < 3; k++) {
        cr_assert(fabs(tl[k] - tl[0]) <= 2e-4 * tl[0], "%s train loss %.4f vs single %.4f",
                  modes[k][0], tl[k], tl[0]);
        cr_assert(fabs(vl[k] - vl[0]) <= 2e-4 * vl[0], "%s val loss %.4f vs single %.4f",
                  modes[k][0], vl[k], vl[0]);
    }
    /* it learns: two short epochs already beat the start */
    CLI(&r, "train", "--model", TINY, "--data", text, "--epochs", "1", "--max-steps", "1",
        "--batch", "5", "--lr", "0.01");
    expect(&r, 0, "epoch 1/1");
    double t0, v0;
    losses(r.out, "epoch 1/1", &t0, &v0);
    cr_assert(vl[0] < v0, "val loss %.4f after 12 steps vs %.4f after 1", vl[0], v0);
}

Test(cli_gpt, resume_ends_where_an_uninterrupted_run_ends_and_sample_reads_it)
{
    static cli_result r;
    const char *text = tu_tpath(g_dir, "text.txt"), *ck = tu_tpath(g_dir, "ck.safetensors");
    const char *ck2 = tu_tpath(g_dir, "ck2.safetensors");
    CLI(&r, "train", "--model", TINY, "--data", text, "--epochs", "2", "--max-steps", "4",
        "--batch", "3", "--save", ck2);
    expect(&r, 0, "tandem sample --resume");
    double ta, va, tb, vb;
    losses(r.out, "epoch 2/2", &ta, &va);
    CLI(&r, "train", "--model", TINY, "--data", text, "--epochs", "1", "--max-steps", "4",
        "--batch", "3", "--save", ck);
    expect(&r, 0, "saved");
    CLI(&r, "train", "--model", TINY, "--data", text, "--epochs", "2", "--max-steps", "4",
        "--batch", "3", "--resume", ck);
    expect(&r, 0, "resumed");
    losses(r.out, "epoch 2/2", &tb, &vb);
    cr_assert(ta == tb && va == vb, "resumed %.6f / %.6f vs uninterrupted %.6f / %.6f", tb, vb,
              ta, va);

    static cli_result s1, s2, s3;
    CLI(&s1, "sample", "--resume", ck2, "--prompt", "the lazy ", "--tokens", "40", "--seed", "5");
    expect(&s1, 0, "the lazy ");
    cr_assert(strstr(s1.out, "gpt:2-16-2-24 from"), "%s", s1.out);
    CLI(&s2, "sample", "--resume", ck2, "--prompt", "the lazy ", "--tokens", "40", "--seed", "5");
    expect(&s2, 0, NULL);
    cr_assert_str_eq(s1.out, s2.out, "the same seed must print the same text");
    CLI(&s3, "sample", "--resume", ck2, "--prompt", "the lazy ", "--tokens", "40", "--seed", "6",
        "--temperature", "1.5");
    expect(&s3, 0, "the lazy ");
    cr_assert_str_neq(s1.out, s3.out);
    CLI(&s3, "sample", "--resume", ck2, "--tokens", "10", "--temperature", "0");
    expect(&s3, 0, "temperature 0");
}

Test(cli_gpt, bad_input_gets_one_clear_message)
{
    static cli_result r;
    const char *empty = tu_tpath(g_dir, "empty.txt"), *shortf = tu_tpath(g_dir, "short.txt");
    FILE *f = fopen(empty, "w");
    fclose(f);
    f = fopen(shortf, "w");
    fputs("a short text of forty bytes, no more....", f);
    fclose(f);
    CLI(&r, "train", "--model", TINY, "--data", empty);
    expect(&r, 1, "is empty: there is nothing to train on");
    CLI(&r, "train", "--model", TINY, "--data", shortf);
    expect(&r, 2, "a context of 24 needs at least 25");
    CLI(&r, "train", "--model", "gpt:2-30-4-16", "--data", shortf);
    expect(&r, 2, "4 heads do not divide the width 30");
    CLI(&r, "train", "--model", "gpt:2-16-2", "--data", shortf);
    expect(&r, 2, "L-D-H-T");
    CLI(&r, "train", "--model", TINY, "--data", tu_tpath(g_dir, "nowhere.txt"));
    expect(&r, 1, "nowhere.txt");
    CLI(&r, "train", "--model", TINY, "--data", tu_tpath(g_dir, "text.txt"), "--mode", "ddp",
        "--device", "cpu:3", "--batch", "2");
    expect(&r, 2, "--batch 2 is smaller than the 3 ranks");
    CLI(&r, "train", "--model", TINY, "--data", "synthetic");
    expect(&r, 2, "a gpt trains on text");
    CLI(&r, "sample");
    expect(&r, 2, "--resume CK is required");
    CLI(&r, "sample", "--resume", tu_tpath(g_dir, "none.safetensors"));
    expect(&r, 1, "none.safetensors");
    /* an image model's checkpoint */
    const char *mlp = tu_tpath(g_dir, "mlp.safetensors");
    CLI(&r, "train", "--model", "mlp:20-8-5", "--data", "synthetic", "--synthetic-size", "50",
        "--epochs", "1", "--max-steps", "1", "--batch", "10", "--no-eval", "--save", mlp);
    expect(&r, 0, NULL);
    CLI(&r, "sample", "--resume", mlp);
    expect(&r, 2, "needs a GPT");
    CLI(&r, "train", "--help");
    expect(&r, 0, "gpt:L-D-H-T");
    CLI(&r, "sample", "--help");
    expect(&r, 0, "--temperature");
}

Test(cli_gpt, compare_runs_the_three_modes_and_catches_a_bad_rank)
{
    static cli_result r;
    const char *text = tu_tpath(g_dir, "text.txt");
    CLI(&r, "compare", "--model", TINY, "--data", text, "--batch", "5", "--steps", "4",
        "--device", "cpu:2");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "global batch 5 windows"), "%s", r.out);
    cr_assert(strstr(r.out, "a sample is a window of 24 bytes"), "%s", r.out);
    cr_assert(strstr(r.out, "DDP: every rank ended with bitwise the same parameters"), "%s", r.out);
    CLI(&r, "compare", "--model", TINY, "--data", text, "--batch", "5", "--steps", "3",
        "--device", "cpu:2", "--perturb-rank", "1");
    expect(&r, 3, "verdict: FAIL");
    CLI(&r, "compare", "--model", TINY, "--data", "synthetic");
    expect(&r, 2, "a gpt trains on text");
}

/* Under tandem launch each rank joins the job instead of forking its own,
 * and trains on the same global batches. */
Test(cli_gpt, launched_ddp_matches_one_device)
{
    static cli_result r;
    const char *text = tu_tpath(g_dir, "text.txt");
    double t1, v1, t2, v2;
    CLI(&r, "train", "--model", TINY, "--data", text, "--epochs", "1", "--max-steps", "5",
        "--batch", "4", "--lr", "0.01");
    expect(&r, 0, NULL);
    losses(r.out, "epoch 1/1", &t1, &v1);
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), "train", "--model", TINY, "--data", text,
        "--mode", "ddp", "--device", "cpu", "--epochs", "1", "--max-steps", "5", "--batch", "4",
        "--lr", "0.01");
    expect(&r, 0, "2 processes");
    losses(r.out, "epoch 1/1", &t2, &v2);
    cr_assert(fabs(t2 - t1) <= 2e-4 * t1 && fabs(v2 - v1) <= 2e-4 * v1,
              "launched %.4f / %.4f vs one device %.4f / %.4f", t2, v2, t1, v1);
}

/* --timeout reaches the GPT's forked DDP ranks: with stall detection off, a
 * stopped rank is waited for until the process group's timeout, which must
 * be the user's (the forked ranks used a fixed 60 s, past this test's
 * bound). The timeout also bounds the healthy set-up and first steps
 * before the stop: 3 s, stretched under the sanitizers (it was 2 s). */
Test(cli_gpt, ddp_ranks_take_the_timeout_given, .timeout = 45)
{
    static cli_result r;
    char secs[16], want[64];
    snprintf(secs, sizeof secs, "%d", tu_scaled_ms(3000) / 1000);
    snprintf(want, sizeof want, "timed out after %d ms", tu_scaled_ms(3000));
    setenv("TANDEM_SHM_STALL_MS", "0", 1);
    setenv("TANDEM_DDP_TEST_KILL", "1:3:STOP", 1);
    CLI(&r, "train", "--model", TINY, "--data", tu_tpath(g_dir, "text.txt"), "--mode", "ddp",
        "--device", "cpu:2", "--epochs", "1", "--max-steps", "20", "--batch", "4", "--timeout",
        secs, "--quiet");
    unsetenv("TANDEM_SHM_STALL_MS");
    unsetenv("TANDEM_DDP_TEST_KILL");
    expect(&r, 1, want);
    cr_expect(!cli_shm_entries());
}
