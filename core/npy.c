/* core/npy.c: NumPy .npy files and datasets from a pair of them (see
 * core/npy.h). The header is a Python dict literal; this parses exactly
 * the subset numpy.save writes (single-quoted keys and strings, True or
 * False, a tuple of integers) and refuses anything else. Not a general
 * Python parser, not .npz. */
#include "core/npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/safefile.h"

#define TDM_NPY_MAGIC "\x93NUMPY"
#define TDM_NPY_MAGIC_LEN 6
/* numpy writes headers of a few hundred bytes; a longer one is not a
 * header numpy wrote */
#define TDM_NPY_MAX_HEADER 65536
/* Largest size of one dimension (and labels' count) accepted. */
#define TDM_NPY_MAX_DIM ((int64_t)1 << 40)

static const struct {
    const char *descr;
    tdm_npy_dtype dtype;
    size_t itemsize;
} tdm_npy_types[] = {
    {"<f4", TDM_NPY_F4, 4}, {"|u1", TDM_NPY_U1, 1}, {"<u1", TDM_NPY_U1, 1},
    {"|i1", TDM_NPY_I1, 1}, {"<i1", TDM_NPY_I1, 1}, {"<i2", TDM_NPY_I2, 2},
    {"<u2", TDM_NPY_U2, 2}, {"<i4", TDM_NPY_I4, 4}, {"<i8", TDM_NPY_I8, 8},
};

typedef struct tdm_npy_lex {
    const char *name;
    const char *p, *end;
} tdm_npy_lex;

static void tdm_npy_ws(tdm_npy_lex *l)
{
    while (l->p < l->end && (*l->p == ' ' || *l->p == '\t')) l->p++;
}

static int tdm_npy_eat(tdm_npy_lex *l, char c)
{
    tdm_npy_ws(l);
    if (l->p < l->end && *l->p == c) {
        l->p++;
        return 1;
    }
    return 0;
}

static tdm_status tdm_npy_bad(const tdm_npy_lex *l, const char *what)
{
    return tdm_error_set(TDM_STATUS_FORMAT, "%s: bad .npy header: %s", l->name, what);
}

/* A single-quoted string (no escapes: numpy writes none) into buf. */
static tdm_status tdm_npy_string(tdm_npy_lex *l, char *buf, size_t cap)
{
    if (!tdm_npy_eat(l, '\'')) return tdm_npy_bad(l, "expected a quoted string");
    size_t n = 0;
    while (l->p < l->end && *l->p != '\'') {
        if (n + 1 >= cap) return tdm_npy_bad(l, "string too long");
        if (*l->p == '\n') return tdm_npy_bad(l, "a newline inside a string");
        buf[n++] = *l->p++;
    }
    if (l->p >= l->end) return tdm_npy_bad(l, "unterminated string");
    l->p++;
    buf[n] = 0;
    return TDM_STATUS_OK;
}

static tdm_status tdm_npy_shape(tdm_npy_lex *l, tdm_npy *a)
{
    if (!tdm_npy_eat(l, '(')) return tdm_npy_bad(l, "shape is not a tuple");
    a->ndim = 0;
    a->n_elem = 1;
    for (;;) {
        if (tdm_npy_eat(l, ')')) break;
        tdm_npy_ws(l);
        if (l->p >= l->end || *l->p < '0' || *l->p > '9')
            return tdm_npy_bad(l, "shape holds something other than non-negative integers");
        int64_t v = 0;
        while (l->p < l->end && *l->p >= '0' && *l->p <= '9') {
            v = v * 10 + (*l->p++ - '0');
            if (v > TDM_NPY_MAX_DIM)
                return tdm_error_set(TDM_STATUS_FORMAT, "%s: shape size above %lld: not an "
                                     "array tandem reads", l->name, (long long)TDM_NPY_MAX_DIM);
        }
        if (a->ndim == TDM_NPY_MAX_DIMS)
            return tdm_error_set(TDM_STATUS_FORMAT, "%s: more than %d dimensions", l->name,
                                 TDM_NPY_MAX_DIMS);
        a->shape[a->ndim++] = v;
        /* the element count stays below 2^62 or is refused */
        if (v > 0 && a->n_elem > ((int64_t)1 << 62) / v)
            return tdm_error_set(TDM_STATUS_FORMAT, "%s: the shape's element count overflows",
                                 l->name);
        a->n_elem *= v;
        if (tdm_npy_eat(l, ')')) break;
        if (!tdm_npy_eat(l, ',')) return tdm_npy_bad(l, "shape sizes not separated by ','");
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_npy_header(tdm_npy_lex *l, tdm_npy *a)
{
    int seen_descr = 0, seen_order = 0, seen_shape = 0;
    if (!tdm_npy_eat(l, '{')) return tdm_npy_bad(l, "not a dict");
    while (!tdm_npy_eat(l, '}')) {
        char key[32], val[32];
        TDM_CHECK(tdm_npy_string(l, key, sizeof key));
        if (!tdm_npy_eat(l, ':')) return tdm_npy_bad(l, "expected ':' after a key");
        if (!strcmp(key, "descr") && !seen_descr++) {
            TDM_CHECK(tdm_npy_string(l, val, sizeof val));
            size_t i = 0, n = sizeof tdm_npy_types / sizeof tdm_npy_types[0];
            while (i < n && strcmp(tdm_npy_types[i].descr, val)) i++;
            if (i == n)
                return tdm_error_set(TDM_STATUS_FORMAT, "%s: dtype '%s' is not one tandem "
                                     "reads (float32 '<f4', uint8, or little-endian integers "
                                     "for labels)", l->name, val);
            a->dtype = tdm_npy_types[i].dtype;
            a->itemsize = tdm_npy_types[i].itemsize;
        } else if (!strcmp(key, "fortran_order") && !seen_order++) {
            tdm_npy_ws(l);
            if (l->end - l->p >= 5 && !memcmp(l->p, "False", 5)) {
                l->p += 5;
            } else if (l->end - l->p >= 4 && !memcmp(l->p, "True", 4)) {
                return tdm_error_set(TDM_STATUS_FORMAT, "%s: fortran_order is True (column-"
                                     "major): save np.ascontiguousarray(x) instead", l->name);
            } else {
                return tdm_npy_bad(l, "fortran_order is neither True nor False");
            }
        } else if (!strcmp(key, "shape") && !seen_shape++) {
            TDM_CHECK(tdm_npy_shape(l, a));
        } else {
            return tdm_error_set(TDM_STATUS_FORMAT, "%s: bad .npy header: key '%s' unknown or "
                                 "repeated", l->name, key);
        }
        if (!tdm_npy_eat(l, ',')) {
            if (!tdm_npy_eat(l, '}')) return tdm_npy_bad(l, "expected ',' or '}'");
            break;
        }
    }
    if (!seen_descr || !seen_order || !seen_shape)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: bad .npy header: missing '%s'", l->name,
                             !seen_descr ? "descr" : !seen_order ? "fortran_order" : "shape");
    tdm_npy_ws(l);
    if (l->p >= l->end || *l->p != '\n' || l->p + 1 != l->end)
        return tdm_npy_bad(l, "the dict is not followed by spaces and one newline");
    return TDM_STATUS_OK;
}

static uint32_t tdm_npy_le(const unsigned char *b, int n)
{
    uint32_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | b[i];
    return v;
}

tdm_status tdm_npy_parse(tdm_npy *out, const char *name, const void *bytes, size_t nbytes)
{
    const unsigned char *b = bytes;
    tdm_npy a = {0};
    memset(out, 0, sizeof *out);
    if (nbytes < TDM_NPY_MAGIC_LEN + 2 || memcmp(b, TDM_NPY_MAGIC, TDM_NPY_MAGIC_LEN))
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: no .npy magic (\\x93NUMPY) at the start: "
                             "not a NumPy .npy file", name);
    int major = b[6], minor = b[7];
    if (major < 1 || major > 3 || minor != 0)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: .npy format version %d.%d (tandem reads "
                             "1.0, 2.0 and 3.0)", name, major, minor);
    size_t len_bytes = major == 1 ? 2 : 4, pre = TDM_NPY_MAGIC_LEN + 2 + len_bytes;
    if (nbytes < pre)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: truncated in its header length", name);
    uint32_t hlen = tdm_npy_le(b + 8, (int)len_bytes);
    if (hlen == 0 || hlen > TDM_NPY_MAX_HEADER)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: header length %u (expected 1..%d)", name,
                             hlen, TDM_NPY_MAX_HEADER);
    if (nbytes < pre + hlen)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: truncated: the header says %u bytes, the "
                             "file has %zu after the header length", name, hlen, nbytes - pre);
    tdm_npy_lex l = {.name = name, .p = (const char *)b + pre, .end = (const char *)b + pre + hlen};
    for (const char *q = l.p; q < l.end; q++)
        if ((unsigned char)*q < 0x20 && *q != '\n' && *q != '\t')
            return tdm_npy_bad(&l, "a control byte in the header");
    TDM_CHECK(tdm_npy_header(&l, &a));
    /* the element count is below 2^62 but times the element size it may
     * wrap: compared before multiplying */
    if ((uint64_t)a.n_elem > TDM_NPY_MAX_BYTES / (uint64_t)a.itemsize)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: %lld elements of %d bytes are above "
                             "tandem's limit of %llu bytes of data", name, (long long)a.n_elem,
                             (int)a.itemsize, (unsigned long long)TDM_NPY_MAX_BYTES);
    uint64_t data_bytes = (uint64_t)a.n_elem * a.itemsize, have = nbytes - pre - hlen;
    if (have != data_bytes)
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: %s: the shape needs %llu bytes of data, "
                             "the file has %llu", name, have < data_bytes ? "truncated" :
                             "trailing bytes", (unsigned long long)data_bytes,
                             (unsigned long long)have);
    a.data = malloc(data_bytes ? (size_t)data_bytes : 1);
    if (!a.data)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %llu bytes", name,
                             (unsigned long long)data_bytes);
    memcpy(a.data, b + pre + hlen, (size_t)data_bytes);
    *out = a;
    return TDM_STATUS_OK;
}

tdm_status tdm_npy_load(tdm_npy *out, const char *path)
{
    int fd = -1;
    size_t nbytes = 0;
    unsigned char *buf = NULL;
    tdm_status st = TDM_STATUS_OK;
    memset(out, 0, sizeof *out);
    TDM_TRY(tdm_file_open_read(path, &fd, &nbytes));
    if ((uint64_t)nbytes > TDM_NPY_MAX_BYTES + TDM_NPY_MAX_HEADER + 16) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: %zu bytes is above tandem's limit for a .npy "
                           "file", path, nbytes);
        goto fail;
    }
    buf = malloc(nbytes ? nbytes : 1);
    if (!buf) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes", path, nbytes);
        goto fail;
    }
    for (size_t got = 0; got < nbytes;) {
        ssize_t r = read(fd, buf + got, nbytes - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            st = tdm_error_set(TDM_STATUS_IO, "%s: read failed: %s", path,
                               r < 0 ? strerror(errno) : "the file shrank while read");
            goto fail;
        }
        got += (size_t)r;
    }
    st = tdm_npy_parse(out, path, buf, nbytes);
fail:
    if (fd >= 0) close(fd);
    free(buf);
    return st;
}

void tdm_npy_free(tdm_npy *a)
{
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

int64_t tdm_npy_int(const tdm_npy *a, int64_t i)
{
    const unsigned char *p = (const unsigned char *)a->data + (size_t)i * a->itemsize;
    switch (a->dtype) {
    case TDM_NPY_U1: return p[0];
    case TDM_NPY_I1: return (int8_t)p[0];
    case TDM_NPY_I2: return (int16_t)tdm_npy_le(p, 2);
    case TDM_NPY_U2: return (uint16_t)tdm_npy_le(p, 2);
    case TDM_NPY_I4: return (int32_t)tdm_npy_le(p, 4);
    case TDM_NPY_I8: return (int64_t)((uint64_t)tdm_npy_le(p + 4, 4) << 32 | tdm_npy_le(p, 4));
    case TDM_NPY_F4: break;
    }
    return -1;
}

/* ---- datasets ---- */

int tdm_data_is_npy(const char *data)
{
    const char *comma = data ? strchr(data, ',') : NULL;
    return comma && comma - data >= 4 && !strncmp(comma - 4, ".npy", 4);
}

/* Labels are classes: at most this many (a classifier's output width). */
#define TDM_NPY_MAX_CLASSES (1 << 20)

tdm_status tdm_data_load_npy(tdm_dataset *out, const char *pair)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_npy x = {0}, y = {0};
    tdm_dataset d = {0};
    char xp[4096];
    memset(out, 0, sizeof *out);
    const char *comma = pair ? strchr(pair, ',') : NULL;
    TDM_REQUIRE(comma && comma > pair && comma[1] && !strchr(comma + 1, ',') &&
                    (size_t)(comma - pair) < sizeof xp,
                TDM_STATUS_INVALID_ARG, "'%s': expected X.npy,Y.npy (inputs, then labels)",
                pair ? pair : "");
    memcpy(xp, pair, (size_t)(comma - pair));
    xp[comma - pair] = 0;
    const char *yp = comma + 1;
    TDM_TRY(tdm_npy_load(&x, xp));
    TDM_TRY(tdm_npy_load(&y, yp));
    if (x.dtype != TDM_NPY_F4 && x.dtype != TDM_NPY_U1) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: inputs must be float32 or uint8", xp);
        goto fail;
    }
    if (x.ndim < 2 || x.shape[0] < 1) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: inputs of shape (n, ...) with n >= 1 and a "
                           "sample of at least one value, got %d dimension(s)", xp, x.ndim);
        goto fail;
    }
    if (y.dtype == TDM_NPY_F4 || y.ndim != 1 || y.shape[0] != x.shape[0]) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: labels must be integers of shape (%lld,), one "
                           "per sample of %s, got %s of %d dimension(s)%s", yp,
                           (long long)x.shape[0], xp, y.dtype == TDM_NPY_F4 ? "float32" : "integers",
                           y.ndim, y.ndim == 1 ? " with another count" : "");
        goto fail;
    }
    int64_t n = x.shape[0], f = x.n_elem / n;
    if (f < 1 || f > (1 << 24)) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: %lld values per sample (expected 1..%d)", xp,
                           (long long)f, 1 << 24);
        goto fail;
    }
    d.n = n;
    d.c = 1;
    d.h = 1;
    d.w = (int)f;
    if (x.ndim == 4 || x.ndim == 3) {
        d.c = x.ndim == 4 ? (int)x.shape[1] : 1;
        d.h = (int)x.shape[x.ndim - 2];
        d.w = (int)x.shape[x.ndim - 1];
    }
    d.x = malloc((size_t)x.n_elem * sizeof *d.x);
    d.y = malloc((size_t)n * sizeof *d.y);
    if (!d.x || !d.y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %lld floats", xp,
                           (long long)x.n_elem);
        goto fail;
    }
    if (x.dtype == TDM_NPY_F4) {
        memcpy(d.x, x.data, (size_t)x.n_elem * sizeof(float));
        for (int64_t i = 0; i < x.n_elem; i++)
            if (!(d.x[i] == d.x[i]) || d.x[i] > 3.4e38f || d.x[i] < -3.4e38f) {
                st = tdm_error_set(TDM_STATUS_FORMAT, "%s: value %lld of sample %lld is not "
                                   "finite", xp, (long long)(i % f), (long long)(i / f));
                goto fail;
            }
    } else {
        const unsigned char *p = x.data;
        for (int64_t i = 0; i < x.n_elem; i++)
            d.x[i] = ((float)p[i] / 255.0f - TDM_DATA_FMNIST_MEAN) / TDM_DATA_FMNIST_STD;
    }
    int64_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = tdm_npy_int(&y, i);
        if (v < 0 || v >= TDM_NPY_MAX_CLASSES) {
            st = tdm_error_set(TDM_STATUS_FORMAT, "%s: label %lld of sample %lld is not a class "
                               "in [0, %d)", yp, (long long)v, (long long)i, TDM_NPY_MAX_CLASSES);
            goto fail;
        }
        d.y[i] = (int32_t)v;
        top = v > top ? v : top;
    }
    d.n_classes = top + 1 < 2 ? 2 : (int)top + 1;
    *out = d;
    d = (tdm_dataset){0};
fail:
    tdm_npy_free(&x);
    tdm_npy_free(&y);
    tdm_data_free(&d);
    return st;
}
