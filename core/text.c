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
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/rng.h"
#include "core/safefile.h"

/* A mapped text read from start to end gives its pages back in steps of
 * this many bytes. */
#define TDM_TEXT_RELEASE_BYTES ((int64_t)64 << 20)

/* Drops the pages of [off, off + n) of a mapped text from this process
 * (MADV_DONTNEED on a private read-only file mapping: the next read
 * faults them in from the file again). Whole pages inside the range only. */
static void tdm_text_release(const tdm_text *t, int64_t off, int64_t n)
{
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0) return;
    uintptr_t lo = (uintptr_t)(t->bytes + off), hi = (uintptr_t)(t->bytes + off + n);
    lo = (lo + (uintptr_t)pg - 1) & ~((uintptr_t)pg - 1);
    hi &= ~((uintptr_t)pg - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

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

/* The whole of a (small) file, read through core/safefile.h: only a
 * regular file, never blocking on a FIFO. */
static tdm_status tdm_text_read_file(const char *path, uint8_t **out, int64_t *n)
{
    tdm_status st = TDM_STATUS_OK;
    int fd;
    size_t size;
    *out = NULL;
    *n = 0;
    TDM_CHECK(tdm_file_open_read(path, &fd, &size));
    uint8_t *p = NULL;
    if ((int64_t)size > TDM_TEXT_MAX_BYTES) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: %lld bytes is more than the %lld tandem "
                           "loads; train on a part of it", path, (long long)size,
                           (long long)TDM_TEXT_MAX_BYTES);
        goto fail;
    }
    if (!(p = malloc(size + 1))) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %lld bytes", path,
                           (long long)size);
        goto fail;
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, p + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            st = tdm_error_set(TDM_STATUS_IO, "%s: read %zu of %zu bytes%s%s", path, got, size,
                               r < 0 ? ": " : " (the file shrank)", r < 0 ? strerror(errno) : "");
            goto fail;
        }
        got += (size_t)r;
    }
    *out = p;
    *n = (int64_t)got;
    p = NULL;
fail:
    free(p);
    close(fd);
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

/* A plain file is mapped, not copied: a 2 GB text costs address space,
 * not 2 GB of memory (the pages are the file's, which the kernel can drop
 * and read again). Both splits point into the one read-only mapping. */
static tdm_status tdm_text_load_plain(tdm_text_corpus *out, const char *path)
{
    int fd;
    size_t n;
    TDM_CHECK(tdm_file_open_read(path, &fd, &n));
    tdm_status st = TDM_STATUS_OK;
    if (n == 0) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s is empty: there is nothing to train on", path);
    } else if ((int64_t)n > TDM_TEXT_MAX_BYTES) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: %lld bytes is more than the %lld tandem "
                           "loads; train on a part of it", path, (long long)n,
                           (long long)TDM_TEXT_MAX_BYTES);
    } else {
        void *map = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            st = tdm_error_set(errno == ENOMEM ? TDM_STATUS_OUT_OF_MEMORY : TDM_STATUS_IO,
                               "%s: cannot map its %zu bytes: %s", path, n, strerror(errno));
        } else {
            int64_t nt = (int64_t)n * 9 / 10;
            out->map = map;
            out->map_nbytes = n;
            out->train = (tdm_text){.bytes = map, .n = nt, .mapped = 1};
            out->val = (tdm_text){.bytes = (uint8_t *)map + nt, .n = (int64_t)n - nt,
                                  .mapped = 1};
            out->n_files = 1;
            snprintf(out->source, sizeof out->source, "%s (%zu bytes)", path, n);
        }
    }
    close(fd);   /* the mapping keeps the file */
    return st;
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
    if (c->map) {
        munmap(c->map, c->map_nbytes);
    } else {
        free(c->train.bytes);
        free(c->val.bytes);
    }
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
        /* a mapped file: the pages read so far leave this process's
         * memory (the kernel reads them again when a window needs one) */
        if (train->mapped && (i + 1) % TDM_TEXT_RELEASE_BYTES == 0)
            tdm_text_release(train, i + 1 - TDM_TEXT_RELEASE_BYTES, TDM_TEXT_RELEASE_BYTES);
    }
    if (train->mapped) tdm_text_release(train, 0, train->n);
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
