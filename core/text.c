/* core/text.c: loading, cleaning and splitting text, training and
 * evaluation windows, the bigram baseline (see core/text.h). Not a data
 * loader with threads: a window is a few hundred bytes copied on demand. */
#include "core/text.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/rng.h"

/* A growing byte buffer. */
typedef struct tdm_buf {
    uint8_t *p;
    int64_t n, cap;
} tdm_buf;

static tdm_status tdm_buf_put(tdm_buf *b, const uint8_t *src, int64_t n)
{
    if (b->n + n > b->cap) {
        int64_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->n + n) cap *= 2;
        uint8_t *p = realloc(b->p, (size_t)cap);
        TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "text: cannot allocate %lld bytes",
                    (long long)cap);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, (size_t)n);
    b->n += n;
    return TDM_STATUS_OK;
}

static tdm_status tdm_text_read_file(const char *path, uint8_t **out, int64_t *n)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return tdm_error_set(TDM_STATUS_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0) {
        st = tdm_error_set(TDM_STATUS_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    if (sb.st_size > TDM_TEXT_MAX_BYTES) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: %lld bytes is more than the %lld tandem "
                           "loads; train on a part of it", path, (long long)sb.st_size,
                           (long long)TDM_TEXT_MAX_BYTES);
        goto fail;
    }
    uint8_t *p = malloc((size_t)sb.st_size + 1);
    if (!p) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %lld bytes", path,
                           (long long)sb.st_size);
        goto fail;
    }
    size_t got = fread(p, 1, (size_t)sb.st_size, f);
    if (ferror(f) || got != (size_t)sb.st_size) {
        free(p);
        st = tdm_error_set(TDM_STATUS_IO, "%s: read %zu of %lld bytes%s%s", path, got,
                           (long long)sb.st_size, ferror(f) ? ": " : "",
                           ferror(f) ? strerror(errno) : "");
        goto fail;
    }
    *out = p;
    *n = (int64_t)got;
fail:
    fclose(f);
    return st;
}

static int tdm_text_name_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Cleans one fortune (see core/text.h) in place; returns its new length. */
static int64_t tdm_text_clean(uint8_t *s, int64_t n)
{
    int64_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t c = s[i];
        if (c == '\b') {
            if (o > 0 && s[o - 1] != '\n') o--;
            continue;
        }
        if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) continue;
        s[o++] = c;
    }
    int64_t start = 0;
    while (start < o && s[start] == '\n') start++;
    while (o > start && (s[o - 1] == ' ' || s[o - 1] == '\t' || s[o - 1] == '\n')) o--;
    if (start) memmove(s, s + start, (size_t)(o - start));
    return o - start;
}

/* Adds the fortunes of one file to train/val; *k counts fortunes. */
static tdm_status tdm_text_fortunes_of(uint8_t *p, int64_t n, tdm_buf *train, tdm_buf *val,
                                       int64_t *k)
{
    static const uint8_t sep[2] = {'\n', '\n'};
    int64_t start = 0, i = 0;
    while (i <= n) {
        /* the end of a line (or of the file) */
        int64_t e = i;
        while (e < n && p[e] != '\n') e++;
        int64_t len = e - i;
        if (len > 0 && p[i + len - 1] == '\r') len--;
        int is_sep = len == 1 && p[i] == '%';
        if (is_sep || e >= n) {
            int64_t end = is_sep ? i : n;
            int64_t m = tdm_text_clean(p + start, end - start);
            if (m > 0) {
                tdm_buf *dst = *k % 10 == 9 ? val : train;
                TDM_CHECK(tdm_buf_put(dst, p + start, m));
                TDM_CHECK(tdm_buf_put(dst, sep, 2));
                (*k)++;
            }
            start = e + 1;
        }
        i = e + 1;
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_text_load_fortunes(tdm_text_corpus *out, const char *dir)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_buf train = {0}, val = {0};
    char **names = NULL;
    int nn = 0, cap = 0;
    DIR *dp = opendir(dir);
    if (!dp)
        return tdm_error_set(TDM_STATUS_IO, "%s: cannot open the fortunes directory: %s%s", dir,
                             strerror(errno),
                             errno == ENOENT ? " (install Debian's fortunes package: make deps, "
                                               "or pass --data FILE with any text)" : "");
    struct dirent *de;
    while ((de = readdir(dp))) {
        const char *nm = de->d_name;
        size_t len = strlen(nm);
        if (nm[0] == '.' || (len > 4 && !strcmp(nm + len - 4, ".dat"))) continue;
        char path[4096];
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", dir, nm);
        if (lstat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        if (nn == cap) {
            cap = cap ? 2 * cap : 64;
            char **nw = realloc(names, (size_t)cap * sizeof *names);
            if (!nw) {
                st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", dir);
                goto fail;
            }
            names = nw;
        }
        names[nn] = strdup(nm);
        if (!names[nn]) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", dir);
            goto fail;
        }
        nn++;
    }
    if (nn > 1) qsort(names, (size_t)nn, sizeof *names, tdm_text_name_cmp);
    int64_t k = 0;
    for (int i = 0; i < nn; i++) {
        char path[4096];
        uint8_t *p;
        int64_t n;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        TDM_TRY(tdm_text_read_file(path, &p, &n));
        st = tdm_text_fortunes_of(p, n, &train, &val, &k);
        free(p);
        TDM_TRY(st);
        TDM_REQUIRE(train.n + val.n <= TDM_TEXT_MAX_BYTES, TDM_STATUS_FORMAT,
                    "%s: more than %lld bytes of fortunes", dir, (long long)TDM_TEXT_MAX_BYTES);
    }
    if (k == 0) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s: no fortunes in %d file%s (expected text files with lines of '%%' "
                           "between fortunes, as Debian's fortunes package installs; or pass "
                           "--data FILE with any text)", dir, nn, nn == 1 ? "" : "s");
        goto fail;
    }
    out->train = (tdm_text){.bytes = train.p, .n = train.n};
    out->val = (tdm_text){.bytes = val.p, .n = val.n};
    train.p = val.p = NULL;
    out->fortunes = 1;
    out->n_docs = k;
    out->n_files = nn;
    snprintf(out->source, sizeof out->source, "fortunes in %s (%d files, %lld fortunes)", dir,
             nn, (long long)k);
fail:
    for (int i = 0; i < nn; i++) free(names[i]);
    free(names);
    closedir(dp);
    free(train.p);
    free(val.p);
    return st;
}

static tdm_status tdm_text_load_plain(tdm_text_corpus *out, const char *path)
{
    uint8_t *p;
    int64_t n;
    TDM_CHECK(tdm_text_read_file(path, &p, &n));
    if (n == 0) {
        free(p);
        return tdm_error_set(TDM_STATUS_FORMAT, "%s is empty: there is nothing to train on", path);
    }
    int64_t nt = n * 9 / 10;
    uint8_t *v = malloc((size_t)(n - nt) + 1);
    if (!v) {
        free(p);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %lld bytes", path,
                             (long long)(n - nt));
    }
    memcpy(v, p + nt, (size_t)(n - nt));
    out->train = (tdm_text){.bytes = p, .n = nt};
    out->val = (tdm_text){.bytes = v, .n = n - nt};
    out->n_files = 1;
    snprintf(out->source, sizeof out->source, "%s (%lld bytes)", path, (long long)n);
    return TDM_STATUS_OK;
}

tdm_status tdm_text_load(tdm_text_corpus *out, const char *path)
{
    memset(out, 0, sizeof *out);
    if (!path || !*path) {
        const char *env = getenv("TANDEM_FORTUNES_DIR");
        path = env && *env ? env : TDM_TEXT_FORTUNES_DEFAULT_DIR;
        return tdm_text_load_fortunes(out, path);
    }
    struct stat sb;
    if (stat(path, &sb) != 0)
        return tdm_error_set(TDM_STATUS_IO, "%s: %s", path, strerror(errno));
    tdm_status st = S_ISDIR(sb.st_mode) ? tdm_text_load_fortunes(out, path)
                                        : tdm_text_load_plain(out, path);
    if (st != TDM_STATUS_OK) tdm_text_free(out);
    return st;
}

void tdm_text_free(tdm_text_corpus *c)
{
    if (!c) return;
    free(c->train.bytes);
    free(c->val.bytes);
    memset(c, 0, sizeof *c);
}

tdm_status tdm_text_check_context(const tdm_text_corpus *c, int T)
{
    TDM_REQUIRE(T >= 1, TDM_STATUS_INVALID_ARG, "context %d must be at least 1", T);
    const tdm_text *s[2] = {&c->train, &c->val};
    static const char *const nm[2] = {"training", "validation"};
    for (int i = 0; i < 2; i++)
        if (s[i]->n < (int64_t)T + 1)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "%s: the %s split has %lld bytes, but a context of %d needs "
                                 "at least %d (a window and its next byte)%s; use a longer text "
                                 "or a smaller context (gpt:L-D-H-T)", c->source, nm[i],
                                 (long long)s[i]->n, T, T + 1,
                                 c->fortunes ? "" : " - the validation split is the last 10% "
                                                    "of the file");
    return TDM_STATUS_OK;
}

void tdm_text_windows(const tdm_text *t, int T, uint64_t seed, int64_t step, int64_t first,
                      int count, int32_t *x, int32_t *y)
{
    uint64_t range = (uint64_t)(t->n - T);   /* offsets 0 .. n - T - 1 */
    for (int j = 0; j < count; j++) {
        tdm_rng r;
        uint64_t stream = TDM_RNG_STREAM_TEXT + ((uint64_t)step << 32) + (uint64_t)(first + j);
        tdm_rng_init(&r, seed, stream);
        const uint8_t *p = t->bytes + tdm_rng_below(&r, range);
        for (int i = 0; i < T; i++) {
            x[(int64_t)j * T + i] = p[i];
            y[(int64_t)j * T + i] = p[i + 1];
        }
    }
}

int64_t tdm_text_eval_count(const tdm_text *t, int T, int64_t cap)
{
    int64_t k = T > 0 && t->n > 0 ? (t->n - 1) / T : 0;
    return cap > 0 && k > cap ? cap : k;
}

void tdm_text_eval_window(const tdm_text *t, int T, int64_t count, int64_t i, int32_t *x,
                          int32_t *y)
{
    int64_t k = (t->n - 1) / T;
    int64_t w = count < k ? (int64_t)((double)i * (double)k / (double)count) : i;
    const uint8_t *p = t->bytes + w * T;
    for (int j = 0; j < T; j++) {
        x[j] = p[j];
        y[j] = p[j + 1];
    }
}

tdm_status tdm_text_bigram_loss(const tdm_text *train, const tdm_text *eval, int T, int64_t cap,
                                double *loss)
{
    int64_t count = tdm_text_eval_count(eval, T, cap);
    TDM_REQUIRE(count > 0 && train->n >= 2, TDM_STATUS_INVALID_ARG,
                "bigram baseline: no evaluation window of %d (%lld bytes) or no training pairs",
                T, (long long)eval->n);
    double *cnt = calloc(256 * 256 + 256, sizeof(double));
    int32_t *x = malloc((size_t)T * 2 * sizeof(int32_t));
    if (!cnt || !x) {
        free(cnt);
        free(x);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "bigram baseline: out of memory");
    }
    double *row = cnt + 256 * 256;
    for (int64_t i = 0; i + 1 < train->n; i++) {
        cnt[train->bytes[i] * 256 + train->bytes[i + 1]] += 1.0;
        row[train->bytes[i]] += 1.0;
    }
    double s = 0.0;
    int32_t *y = x + T;
    for (int64_t w = 0; w < count; w++) {
        tdm_text_eval_window(eval, T, count, w, x, y);
        for (int j = 0; j < T; j++)
            s -= log((cnt[x[j] * 256 + y[j]] + 1.0) / (row[x[j]] + 256.0));
    }
    *loss = s / ((double)count * T);
    free(cnt);
    free(x);
    return TDM_STATUS_OK;
}
