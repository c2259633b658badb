/* tests/test_text.c: core/text.c: fortune files cleaned and split by the
 * documented rule (exact bytes of a made-up fortunes directory), plain
 * files split 90/10, bad input (missing path, empty file, no fortunes,
 * text shorter than a window), training windows (a function of seed, step
 * and window alone: any share of a global batch is the same windows),
 * evaluation windows, the bigram baseline by hand, and Debian's fortunes
 * when they are installed. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/text.h"
#include "tests/test_util.h"

static void write_file(const char *path, const char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void wstr(const char *path, const char *s) { write_file(path, s, strlen(s)); }

Test(text, fortunes_cleaned_and_split_by_the_rule)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "fortunes");
    /* "b" sorts after "a"; "a.dat" (an index) and "c.u8" (a link) are skipped,
     * and so is a subdirectory */
    wstr(tu_tpath(dir, "a"),
         "one\n%\n\n\ntwo has\ttab  \n\n%\n%\nthree\r\n%\r\n_\bU_\bL x\x01y\x7f\n%\nfive");
    wstr(tu_tpath(dir, "b"), "six\n%\nseven\n%\neight\n%\nnine\n%\nten\n%\neleven\n%\n");
    wstr(tu_tpath(dir, "a.dat"), "\x00\x01\x02garbage%\n%\n");
    cr_assert_eq(symlink("a", tu_tpath(dir, "c.u8")), 0);
    cr_assert_eq(mkdir(tu_tpath(dir, "sub"), 0755), 0);
    wstr(tu_tpath(dir, "sub/zz"), "never\n%\n");
    tdm_text_corpus c;
    TU_OK(tdm_text_load(&c, dir));
    cr_assert_eq(c.fortunes, 1);
    cr_assert_eq(c.n_files, 2);
    cr_assert_eq(c.n_docs, 11);
    /* fortune 9 (the tenth: "ten") validates, the rest train */
    static const char want_train[] = "one\n\ntwo has\ttab\n\nthree\n\nUL xy\n\nfive\n\nsix\n\n"
                                     "seven\n\neight\n\nnine\n\neleven\n\n";
    cr_assert_eq(c.train.n, (int64_t)strlen(want_train), "train: '%.*s'", (int)c.train.n,
                 (const char *)c.train.bytes);
    cr_assert(!memcmp(c.train.bytes, want_train, strlen(want_train)), "train: '%.*s'",
              (int)c.train.n, (const char *)c.train.bytes);
    cr_assert_eq(c.val.n, 5);
    cr_assert(!memcmp(c.val.bytes, "ten\n\n", 5));
    cr_assert(strstr(c.source, "2 files, 11 fortunes"), "%s", c.source);
    tdm_text_free(&c);
    tdm_text_free(&c);   /* idempotent */
    /* TANDEM_FORTUNES_DIR names the default directory */
    setenv("TANDEM_FORTUNES_DIR", dir, 1);
    TU_OK(tdm_text_load(&c, NULL));
    cr_assert_eq(c.n_docs, 11);
    tdm_text_free(&c);
    unsetenv("TANDEM_FORTUNES_DIR");
    tu_rmtree(dir);
}

Test(text, plain_file_split_90_10_and_bad_input)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "text");
    char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (char)(i * 7);   /* any bytes, zeros included */
    write_file(tu_tpath(dir, "t.bin"), buf, 1000);
    tdm_text_corpus c;
    TU_OK(tdm_text_load(&c, tu_tpath(dir, "t.bin")));
    cr_assert_eq(c.fortunes, 0);
    cr_assert_eq(c.train.n, 900);
    cr_assert_eq(c.val.n, 100);
    cr_assert(!memcmp(c.train.bytes, buf, 900) && !memcmp(c.val.bytes, buf + 900, 100));
    TU_OK(tdm_text_check_context(&c, 99));
    cr_assert_eq(tdm_text_check_context(&c, 100), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "the validation split has 100 bytes, but a context of "
                                          "100 needs at least 101"), "%s", tdm_error_message());
    tdm_text_free(&c);

    write_file(tu_tpath(dir, "empty"), "", 0);
    cr_assert_eq(tdm_text_load(&c, tu_tpath(dir, "empty")), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "is empty"), "%s", tdm_error_message());
    cr_assert_null(c.train.bytes);
    cr_assert_eq(tdm_text_load(&c, tu_tpath(dir, "missing")), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "missing"), "%s", tdm_error_message());
    /* a short text: both splits too small for the context */
    wstr(tu_tpath(dir, "short"), "hello world");
    TU_OK(tdm_text_load(&c, tu_tpath(dir, "short")));
    cr_assert_eq(tdm_text_check_context(&c, 32), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "training split has 9 bytes"), "%s", tdm_error_message());
    tdm_text_free(&c);
    /* a directory without fortunes */
    cr_assert_eq(mkdir(tu_tpath(dir, "nofortunes"), 0755), 0);
    wstr(tu_tpath(dir, "nofortunes/x.dat"), "index");
    cr_assert_eq(tdm_text_load(&c, tu_tpath(dir, "nofortunes")), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "no fortunes"), "%s", tdm_error_message());
    setenv("TANDEM_FORTUNES_DIR", tu_tpath(dir, "nowhere"), 1);
    cr_assert_eq(tdm_text_load(&c, NULL), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "make deps"), "%s", tdm_error_message());
    unsetenv("TANDEM_FORTUNES_DIR");
    tu_rmtree(dir);
}

Test(text, windows_are_a_function_of_seed_step_and_index)
{
    uint8_t bytes[300];
    for (int i = 0; i < 300; i++) bytes[i] = (uint8_t)(i * 31 + 7);
    tdm_text t = {.bytes = bytes, .n = 300};
    int T = 17, B = 9;
    int32_t x[9 * 17], y[9 * 17], x1[17], y1[17];
    tdm_text_windows(&t, T, 5, 3, 0, B, x, y);
    for (int j = 0; j < B; j++) {
        /* inputs are a run of the text, targets the same run one further */
        const uint8_t *p = memchr(bytes, x[j * T], 300);
        cr_assert_not_null(p);
        int off = -1;
        for (int o = 0; o + T < 300 && off < 0; o++) {
            int same = 1;
            for (int i = 0; i < T && same; i++) same = bytes[o + i] == x[j * T + i];
            if (same) off = o;
        }
        cr_assert(off >= 0, "window %d is not a run of the text", j);
        for (int i = 0; i < T; i++) cr_assert_eq(y[j * T + i], bytes[off + i + 1]);
        /* the same window drawn alone (a DDP rank's share) */
        tdm_text_windows(&t, T, 5, 3, j, 1, x1, y1);
        cr_assert(!memcmp(x1, x + j * T, sizeof x1) && !memcmp(y1, y + j * T, sizeof y1));
    }
    /* another step, another seed: other windows */
    int32_t x2[9 * 17], y2[9 * 17];
    tdm_text_windows(&t, T, 5, 4, 0, B, x2, y2);
    cr_assert(memcmp(x, x2, sizeof x));
    tdm_text_windows(&t, T, 6, 3, 0, B, x2, y2);
    cr_assert(memcmp(x, x2, sizeof x));
    /* the edges: a text of T + 2 bytes has offsets 0 and 1, both drawn */
    tdm_text e = {.bytes = bytes, .n = T + 2};
    int seen[2] = {0, 0};
    for (int s = 0; s < 64; s++) {
        tdm_text_windows(&e, T, 1, s, 0, 1, x1, y1);
        cr_assert(x1[0] == bytes[0] || x1[0] == bytes[1]);
        seen[x1[0] == bytes[1]] = 1;
        cr_assert_eq(y1[T - 1], bytes[x1[0] == bytes[1] ? T + 1 : T]);
    }
    cr_assert(seen[0] && seen[1]);
}

Test(text, evaluation_windows_cover_every_target_once_or_spread)
{
    uint8_t bytes[101];
    for (int i = 0; i < 101; i++) bytes[i] = (uint8_t)i;
    tdm_text t = {.bytes = bytes, .n = 101};
    int T = 10;
    cr_assert_eq(tdm_text_eval_count(&t, T, 0), 10);
    cr_assert_eq(tdm_text_eval_count(&t, T, 4), 4);
    int32_t x[10], y[10];
    for (int w = 0; w < 10; w++) {
        tdm_text_eval_window(&t, T, 10, w, x, y);
        for (int i = 0; i < T; i++) {
            cr_assert_eq(x[i], w * T + i);
            cr_assert_eq(y[i], w * T + i + 1);   /* targets 1..100, each once */
        }
    }
    static const int spread[4] = {0, 2, 5, 7};   /* floor(i * 10 / 4) */
    for (int w = 0; w < 4; w++) {
        tdm_text_eval_window(&t, T, 4, w, x, y);
        cr_assert_eq(x[0], spread[w] * T);
    }
}

Test(text, bigram_baseline_by_hand)
{
    uint8_t tr[] = "abab", ev[] = "ab";
    tdm_text train = {.bytes = tr, .n = 4}, eval = {.bytes = ev, .n = 2};
    double l;
    TU_OK(tdm_text_bigram_loss(&train, &eval, 1, 0, &l));
    /* count(ab) = 2, count(a.) = 2: P(b|a) = 3 / 258 */
    cr_assert(fabs(l - -log(3.0 / 258.0)) < 1e-12, "%.12f", l);
    uint8_t ev2[] = "ba";
    eval.bytes = ev2;
    TU_OK(tdm_text_bigram_loss(&train, &eval, 1, 0, &l));
    cr_assert(fabs(l - -log(2.0 / 257.0)) < 1e-12, "%.12f", l);
    eval.n = 1;
    cr_assert_eq(tdm_text_bigram_loss(&train, &eval, 1, 0, &l), TDM_STATUS_INVALID_ARG);
}

Test(text, debian_fortunes_when_installed)
{
    struct stat sb;
    if (stat(TDM_TEXT_FORTUNES_DEFAULT_DIR, &sb) != 0) {
        cr_skip_test("%s is not installed (make deps installs Debian's fortunes)",
                     TDM_TEXT_FORTUNES_DEFAULT_DIR);
    }
    tdm_text_corpus c;
    TU_OK(tdm_text_load(&c, TDM_TEXT_FORTUNES_DEFAULT_DIR));
    cr_assert(c.n_docs > 10000, "%lld fortunes", (long long)c.n_docs);
    cr_assert(c.train.n > 2000000 && c.val.n > 200000, "train %lld, val %lld",
              (long long)c.train.n, (long long)c.val.n);
    const tdm_text *s[2] = {&c.train, &c.val};
    for (int k = 0; k < 2; k++)
        for (int64_t i = 0; i < s[k]->n; i++) {
            uint8_t b = s[k]->bytes[i];
            cr_assert(b >= 0x20 || b == '\n' || b == '\t', "control byte 0x%02x at %lld", b,
                      (long long)i);
            /* no separator line is left */
            if (b == '%' && (i == 0 || s[k]->bytes[i - 1] == '\n'))
                cr_assert(i + 1 < s[k]->n && s[k]->bytes[i + 1] != '\n',
                          "a separator line at %lld", (long long)i);
        }
    double l;
    TU_OK(tdm_text_bigram_loss(&c.train, &c.val, 128, 512, &l));
    cr_assert(l > 2.3 && l < 2.9, "bigram baseline %.3f nats per byte", l);
    tdm_text_free(&c);
}
