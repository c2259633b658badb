/* core/safetensors.c: safetensors writer (atomic, aligned header) and
 * validating reader; see core/safetensors.h for the format. The header
 * JSON is parsed by core/json.c. Not a memory-mapped or lazy reader, and
 * it does not convert between dtypes. */
#include "core/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/json.h"
#include "core/log.h"
#include "core/safefile.h"

/* The format is little-endian and this code copies bytes as they are. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "core/safetensors.c assumes a little-endian host"
#endif

#define ST_META_KEY "__metadata__"
/* No dimension beyond 2^40 elements: catches garbage before any product
 * can overflow (8 dims * 40 bits is still checked with overflow builtins). */
#define ST_MAX_DIM ((int64_t)1 << 40)

static const struct {
    const char *name;
    size_t size;
} st_dtypes[TDM_ST_DTYPE_COUNT_] = {
    [TDM_ST_F64] = { "F64", 8 },  [TDM_ST_F32] = { "F32", 4 },
    [TDM_ST_F16] = { "F16", 2 },  [TDM_ST_BF16] = { "BF16", 2 },
    [TDM_ST_I64] = { "I64", 8 },  [TDM_ST_I32] = { "I32", 4 },
    [TDM_ST_I16] = { "I16", 2 },  [TDM_ST_I8] = { "I8", 1 },
    [TDM_ST_U64] = { "U64", 8 },  [TDM_ST_U32] = { "U32", 4 },
    [TDM_ST_U16] = { "U16", 2 },  [TDM_ST_U8] = { "U8", 1 },
    [TDM_ST_BOOL] = { "BOOL", 1 },
};

const char *tdm_st_dtype_name(tdm_st_dtype dt)
{
    if ((unsigned)dt >= TDM_ST_DTYPE_COUNT_) return "?";
    return st_dtypes[dt].name;
}

size_t tdm_st_dtype_size(tdm_st_dtype dt)
{
    if ((unsigned)dt >= TDM_ST_DTYPE_COUNT_) return 0;
    return st_dtypes[dt].size;
}

static int st_dtype_parse(const char *s, tdm_st_dtype *out)
{
    for (int k = 0; k < TDM_ST_DTYPE_COUNT_; k++) {
        if (strcmp(s, st_dtypes[k].name) == 0) {
            *out = (tdm_st_dtype)k;
            return 0;
        }
    }
    return -1;
}

/* product(shape) * esize, or -1 on overflow or a bad dimension. */
static int st_shape_nbytes(int ndim, const int64_t *shape, size_t esize, size_t *out)
{
    size_t n = esize;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || shape[d] > ST_MAX_DIM) return -1;
        if (__builtin_mul_overflow(n, (size_t)shape[d], &n)) return -1;
    }
    *out = n;
    return 0;
}

static void st_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape)
{
    size_t n = 0;
    n += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, d ? ", " : "", shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* ---- writing ------------------------------------------------------------ */

typedef struct st_buf {
    char *p;
    size_t len, cap;
    int oom;
} st_buf;

static void st_buf_put(st_buf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t ncap = b->cap ? b->cap : 256;
        while (ncap < b->len + n + 1) ncap *= 2;
        char *np = realloc(b->p, ncap);
        if (!np) { b->oom = 1; return; }
        b->p = np;
        b->cap = ncap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void st_buf_puts(st_buf *b, const char *s) { st_buf_put(b, s, strlen(s)); }

static void st_buf_printf(st_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void st_buf_printf(st_buf *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) { b->oom = 1; return; }
    st_buf_put(b, tmp, (size_t)n);
}

/* A JSON string literal. Bytes >= 0x80 pass through: names are expected
 * to be UTF-8, and the reader validates that. */
static void st_buf_json_string(st_buf *b, const char *s)
{
    st_buf_puts(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"') st_buf_puts(b, "\\\"");
        else if (*c == '\\') st_buf_puts(b, "\\\\");
        else if (*c == '\n') st_buf_puts(b, "\\n");
        else if (*c == '\t') st_buf_puts(b, "\\t");
        else if (*c < 0x20) st_buf_printf(b, "\\u%04x", *c);
        else st_buf_put(b, (const char *)c, 1);
    }
    st_buf_puts(b, "\"");
}

static tdm_status st_check_args(const char *path, const tdm_st_tensor *tensors, int n_tensors,
                                const tdm_st_meta *meta, int n_meta)
{
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "safetensors save: empty path");
    TDM_REQUIRE(n_tensors >= 0 && (n_tensors == 0 || tensors), TDM_STATUS_INVALID_ARG,
                "%s: %d tensors given", path, n_tensors);
    TDM_REQUIRE(n_meta >= 0 && (n_meta == 0 || meta), TDM_STATUS_INVALID_ARG,
                "%s: %d metadata entries given", path, n_meta);
    for (int k = 0; k < n_tensors; k++) {
        const tdm_st_tensor *t = &tensors[k];
        size_t nb;
        TDM_REQUIRE(t->name && t->name[0], TDM_STATUS_INVALID_ARG,
                    "%s: tensor #%d has an empty name", path, k);
        TDM_REQUIRE(strcmp(t->name, ST_META_KEY) != 0, TDM_STATUS_INVALID_ARG,
                    "%s: tensor #%d may not be named '%s'", path, k, ST_META_KEY);
        TDM_REQUIRE(tdm_st_dtype_size(t->dtype) > 0, TDM_STATUS_INVALID_ARG,
                    "%s: tensor '%s' has invalid dtype %d", path, t->name, (int)t->dtype);
        TDM_REQUIRE(t->ndim >= 0 && t->ndim <= TDM_ST_MAX_DIMS, TDM_STATUS_INVALID_ARG,
                    "%s: tensor '%s' has %d dimensions (at most %d)", path, t->name,
                    t->ndim, TDM_ST_MAX_DIMS);
        TDM_REQUIRE(st_shape_nbytes(t->ndim, t->shape, tdm_st_dtype_size(t->dtype), &nb) == 0,
                    TDM_STATUS_INVALID_ARG, "%s: tensor '%s' has an invalid shape", path,
                    t->name);
        TDM_REQUIRE(nb == t->nbytes, TDM_STATUS_INVALID_ARG,
                    "%s: tensor '%s' has nbytes %zu but its shape and dtype make %zu",
                    path, t->name, t->nbytes, nb);
        TDM_REQUIRE(nb == 0 || t->data, TDM_STATUS_INVALID_ARG,
                    "%s: tensor '%s' has no data", path, t->name);
        for (int j = 0; j < k; j++)
            TDM_REQUIRE(strcmp(tensors[j].name, t->name) != 0, TDM_STATUS_INVALID_ARG,
                        "%s: duplicate tensor name '%s'", path, t->name);
    }
    for (int k = 0; k < n_meta; k++) {
        TDM_REQUIRE(meta[k].key && meta[k].value, TDM_STATUS_INVALID_ARG,
                    "%s: metadata entry #%d has a NULL key or value", path, k);
        for (int j = 0; j < k; j++)
            TDM_REQUIRE(strcmp(meta[j].key, meta[k].key) != 0, TDM_STATUS_INVALID_ARG,
                        "%s: duplicate metadata key '%s'", path, meta[k].key);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_st_save(const char *path, const tdm_st_tensor *tensors, int n_tensors,
                       const tdm_st_meta *meta, int n_meta)
{
    tdm_status st = TDM_STATUS_OK;
    st_buf hdr = { 0 };
    tdm_file_out out = { .fd = -1, .dirfd = -1 };
    size_t offset = 0;

    TDM_CHECK(st_check_args(path, tensors, n_tensors, meta, n_meta));

    st_buf_puts(&hdr, "{");
    if (n_meta > 0) {
        st_buf_puts(&hdr, "\"" ST_META_KEY "\":{");
        for (int k = 0; k < n_meta; k++) {
            if (k) st_buf_puts(&hdr, ",");
            st_buf_json_string(&hdr, meta[k].key);
            st_buf_puts(&hdr, ":");
            st_buf_json_string(&hdr, meta[k].value);
        }
        st_buf_puts(&hdr, "}");
    }
    for (int k = 0; k < n_tensors; k++) {
        const tdm_st_tensor *t = &tensors[k];
        if (k || n_meta > 0) st_buf_puts(&hdr, ",");
        st_buf_json_string(&hdr, t->name);
        st_buf_printf(&hdr, ":{\"dtype\":\"%s\",\"shape\":[", tdm_st_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++)
            st_buf_printf(&hdr, "%s%" PRId64, d ? "," : "", t->shape[d]);
        st_buf_printf(&hdr, "],\"data_offsets\":[%zu,%zu]}", offset, offset + t->nbytes);
        offset += t->nbytes;
    }
    st_buf_puts(&hdr, "}");
    /* Pad with spaces so that the data section (8 + N) is 8-byte aligned. */
    while (!hdr.oom && hdr.len % 8 != 0) st_buf_puts(&hdr, " ");
    if (hdr.oom) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory building the header",
                           path);
        goto fail;
    }
    if (hdr.len > TDM_ST_MAX_HEADER_NBYTES) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                           "%s: header of %zu bytes exceeds the format's limit of %u", path,
                           hdr.len, TDM_ST_MAX_HEADER_NBYTES);
        goto fail;
    }

    TDM_TRY(tdm_file_replace_open(&out, AT_FDCWD, path));
    unsigned char len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (unsigned char)((uint64_t)hdr.len >> (8 * k));
    TDM_TRY(tdm_file_write_all(out.fd, len8, sizeof len8, path));
    TDM_TRY(tdm_file_write_all(out.fd, hdr.p, hdr.len, path));
    for (int k = 0; k < n_tensors; k++)
        TDM_TRY(tdm_file_write_all(out.fd, tensors[k].data, tensors[k].nbytes, path));
    TDM_TRY(tdm_file_replace_commit(&out));
    TDM_INFO(DATA, "wrote %s: %d tensors, %zu data bytes, header %zu bytes", path, n_tensors,
             offset, hdr.len);
    free(hdr.p);
    return TDM_STATUS_OK;
fail:
    tdm_file_replace_abort(&out);
    free(hdr.p);
    return st;
}

/* ---- reading ------------------------------------------------------------ */

struct tdm_st_file {
    char *path;
    unsigned char *buf;     /* (buf_nbytes) the whole file, or its header only
                               (tdm_st_load_header) */
    size_t buf_nbytes;
    size_t nbytes;          /* the file's size */
    tdm_json *header;       /* names, keys and values point into it */
    tdm_st_tensor *tensors; /* (n_tensors) in header order */
    int n_tensors;
    tdm_st_meta *meta;      /* (n_meta) */
    int n_meta;
};

void tdm_st_free(tdm_st_file *f)
{
    if (!f) return;
    free(f->path);
    free(f->buf);
    tdm_json_free(f->header);
    free(f->tensors);
    free(f->meta);
    free(f);
}

/* Which part of a file tdm_st_load and tdm_st_load_header read. */
typedef enum st_part {
    ST_PART_FILE,       /* all of it */
    ST_PART_HEADER      /* the length and the JSON header: never the data */
} st_part;

/* Reads n bytes from fd at its position into dst; done: bytes of the
 * file read before (for the message when the file shrank). */
static tdm_status st_read_exact(const tdm_st_file *f, int fd, unsigned char *dst, size_t n,
                                size_t done)
{
    size_t got = 0;
    while (got < n) {
        size_t want = n - got;
        ssize_t r = read(fd, dst + got, want > (1u << 30) ? (1u << 30) : want);
        if (r < 0) {
            if (errno == EINTR) continue;
            return tdm_error_set(TDM_STATUS_IO, "%s: read failed: %s", f->path, strerror(errno));
        }
        if (r == 0)
            return tdm_error_set(TDM_STATUS_IO, "%s: file shrank while reading (%zu of %zu "
                                 "bytes)", f->path, done + got, f->nbytes);
        got += (size_t)r;
    }
    return TDM_STATUS_OK;
}

/* f->nbytes: the file's size; f->buf: its first f->buf_nbytes bytes,
 * all of them for ST_PART_FILE, else the length and the header when the
 * length is within the file and the limit (tdm_st_load's checks refuse
 * the others before reading the header). */
static tdm_status st_read_file(tdm_st_file *f, st_part part)
{
    tdm_status st = TDM_STATUS_OK;
    unsigned char len8[8];
    size_t want, done = 0;
    int fd;
    TDM_CHECK(tdm_file_open_read(f->path, &fd, &f->nbytes));
    want = f->nbytes;
    if (part == ST_PART_HEADER && f->nbytes >= sizeof len8) {
        TDM_TRY(st_read_exact(f, fd, len8, sizeof len8, 0));
        done = sizeof len8;
        uint64_t hlen = 0;
        for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | len8[k];
        int fits = hlen <= TDM_ST_MAX_HEADER_NBYTES && hlen <= f->nbytes - sizeof len8;
        want = sizeof len8 + (fits ? (size_t)hlen : 0);
    }
    f->buf = malloc(want ? want : 1);
    if (!f->buf) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes",
                           f->path, want);
        goto fail;
    }
    if (done) memcpy(f->buf, len8, done);
    TDM_TRY(st_read_exact(f, fd, f->buf + done, want - done, done));
    f->buf_nbytes = want;
    close(fd);
    return TDM_STATUS_OK;
fail:
    close(fd);
    return st;
}

static int st_tensor_begin_cmp(const void *a, const void *b)
{
    const tdm_st_tensor *x = *(const tdm_st_tensor *const *)a;
    const tdm_st_tensor *y = *(const tdm_st_tensor *const *)b;
    if (x->data != y->data) return (const char *)x->data < (const char *)y->data ? -1 : 1;
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

/* One entry of the header: name -> {"dtype", "shape", "data_offsets"}. */
static tdm_status st_parse_tensor(tdm_st_file *f, const char *name, const tdm_json *v,
                                  const unsigned char *data, size_t data_nbytes,
                                  tdm_st_tensor *t)
{
    const char *p = f->path;
    TDM_REQUIRE(v->type == TDM_JSON_OBJECT, TDM_STATUS_FORMAT,
                "%s: tensor '%s': entry is a JSON %s, expected an object", p, name,
                tdm_json_type_name(v->type));
    for (int k = 0; k < v->n; k++) {
        const char *key = v->keys[k];
        TDM_REQUIRE(!strcmp(key, "dtype") || !strcmp(key, "shape") ||
                        !strcmp(key, "data_offsets"),
                    TDM_STATUS_FORMAT, "%s: tensor '%s': unknown field '%s'", p, name, key);
    }
    int dup = tdm_json_find_duplicate(v);
    TDM_REQUIRE(dup < 0, TDM_STATUS_FORMAT, "%s: tensor '%s': duplicate field '%s'", p, name,
                v->keys[dup < 0 ? 0 : dup]);
    const tdm_json *dt = tdm_json_get(v, "dtype");
    const tdm_json *shape = tdm_json_get(v, "shape");
    const tdm_json *offs = tdm_json_get(v, "data_offsets");
    TDM_REQUIRE(dt && shape && offs, TDM_STATUS_FORMAT, "%s: tensor '%s': missing field '%s'",
                p, name, !dt ? "dtype" : !shape ? "shape" : "data_offsets");

    memset(t, 0, sizeof *t);
    t->name = name;
    TDM_REQUIRE(dt->type == TDM_JSON_STRING, TDM_STATUS_FORMAT,
                "%s: tensor '%s': dtype is a JSON %s, expected a string", p, name,
                tdm_json_type_name(dt->type));
    TDM_REQUIRE(st_dtype_parse(dt->str, &t->dtype) == 0, TDM_STATUS_FORMAT,
                "%s: tensor '%s': unknown dtype \"%s\"", p, name, dt->str);

    TDM_REQUIRE(shape->type == TDM_JSON_ARRAY, TDM_STATUS_FORMAT,
                "%s: tensor '%s': shape is a JSON %s, expected an array", p, name,
                tdm_json_type_name(shape->type));
    TDM_REQUIRE(shape->n <= TDM_ST_MAX_DIMS, TDM_STATUS_FORMAT,
                "%s: tensor '%s': shape has %d dimensions (at most %d supported)", p, name,
                shape->n, TDM_ST_MAX_DIMS);
    t->ndim = shape->n;
    for (int d = 0; d < shape->n; d++) {
        const tdm_json *e = &shape->items[d];
        TDM_REQUIRE(e->type == TDM_JSON_INT, TDM_STATUS_FORMAT,
                    "%s: tensor '%s': shape[%d] is a JSON %s, expected an integer", p, name,
                    d, tdm_json_type_name(e->type));
        TDM_REQUIRE(e->i >= 0 && e->i <= ST_MAX_DIM, TDM_STATUS_FORMAT,
                    "%s: tensor '%s': shape[%d] = %" PRId64 " is out of range", p, name, d,
                    e->i);
        t->shape[d] = e->i;
    }

    TDM_REQUIRE(offs->type == TDM_JSON_ARRAY && offs->n == 2 &&
                    offs->items[0].type == TDM_JSON_INT && offs->items[1].type == TDM_JSON_INT,
                TDM_STATUS_FORMAT,
                "%s: tensor '%s': data_offsets must be an array of two integers", p, name);
    int64_t begin = offs->items[0].i, end = offs->items[1].i;
    TDM_REQUIRE(begin >= 0 && begin <= end, TDM_STATUS_FORMAT,
                "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64 "] are invalid "
                "(need 0 <= begin <= end)", p, name, begin, end);
    TDM_REQUIRE((uint64_t)end <= data_nbytes, TDM_STATUS_FORMAT,
                "%s: tensor '%s': data_offsets end %" PRId64 " is beyond the data section "
                "(%zu bytes; file truncated?)", p, name, end, data_nbytes);
    size_t nb;
    char sbuf[200];
    st_shape_str(sbuf, sizeof sbuf, t->ndim, t->shape);
    TDM_REQUIRE(st_shape_nbytes(t->ndim, t->shape, tdm_st_dtype_size(t->dtype), &nb) == 0,
                TDM_STATUS_FORMAT, "%s: tensor '%s': shape %s is too large", p, name, sbuf);
    TDM_REQUIRE(nb == (uint64_t)(end - begin), TDM_STATUS_FORMAT,
                "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64 "] span %" PRId64
                " bytes, but shape %s of %s needs %zu",
                p, name, begin, end, end - begin, sbuf, dt->str, nb);
    t->data = data + begin;
    t->nbytes = nb;
    return TDM_STATUS_OK;
}

/* The spec requires the tensors to cover the data section exactly. */
static tdm_status st_check_coverage(tdm_st_file *f, const unsigned char *data,
                                    size_t data_nbytes)
{
    tdm_status st = TDM_STATUS_OK;
    const char *p = f->path;
    const tdm_st_tensor **order = NULL;
    size_t pos = 0;   /* end of the covered prefix */
    if (f->n_tensors > 0) {
        order = malloc((size_t)f->n_tensors * sizeof *order);
        if (!order)
            return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", p);
    }
    for (int k = 0; k < f->n_tensors; k++) order[k] = &f->tensors[k];
    if (f->n_tensors > 1) qsort(order, (size_t)f->n_tensors, sizeof *order, st_tensor_begin_cmp);
    for (int k = 0; k < f->n_tensors; k++) {
        const tdm_st_tensor *t = order[k];
        size_t begin = (size_t)((const unsigned char *)t->data - data);
        if (begin < pos) {
            const tdm_st_tensor *prev = order[k - 1];
            size_t pb = (size_t)((const unsigned char *)prev->data - data);
            st = tdm_error_set(TDM_STATUS_FORMAT,
                               "%s: tensors '%s' [%zu, %zu) and '%s' [%zu, %zu) overlap", p,
                               prev->name, pb, pb + prev->nbytes, t->name, begin,
                               begin + t->nbytes);
            goto fail;
        }
        if (begin > pos) {
            if (k == 0)
                st = tdm_error_set(TDM_STATUS_FORMAT,
                                   "%s: gap of %zu bytes at the start of the data section, "
                                   "before tensor '%s'", p, begin - pos, t->name);
            else
                st = tdm_error_set(TDM_STATUS_FORMAT,
                                   "%s: gap of %zu bytes between tensors '%s' and '%s'", p,
                                   begin - pos, order[k - 1]->name, t->name);
            goto fail;
        }
        pos = begin + t->nbytes;
    }
    if (pos != data_nbytes) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s: %zu trailing bytes: the data section has %zu bytes but the "
                           "tensors cover %zu", p, data_nbytes - pos, data_nbytes, pos);
        goto fail;
    }
    free(order);
    return TDM_STATUS_OK;
fail:
    free(order);
    return st;
}

static tdm_status st_load(tdm_st_file **out, const char *path, st_part part)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_st_file *f = NULL;
    *out = NULL;
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "safetensors load: empty path");
    f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
        goto fail;
    }
    TDM_TRY(st_read_file(f, part));
    if (f->nbytes < 8) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s: file is %zu bytes, too short for a safetensors header "
                           "(at least 8)", path, f->nbytes);
        goto fail;
    }
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | f->buf[k];
    if (hlen == 0) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: header length is 0: not a safetensors file",
                           path);
        goto fail;
    }
    if (hlen > TDM_ST_MAX_HEADER_NBYTES) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s: header length %" PRIu64 " exceeds the limit of %u bytes: "
                           "not a safetensors file?", path, hlen, TDM_ST_MAX_HEADER_NBYTES);
        goto fail;
    }
    if (hlen > f->nbytes - 8) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s: header length %" PRIu64 " exceeds the file size (%zu bytes, "
                           "so at most %zu): file truncated?", path, hlen, f->nbytes,
                           f->nbytes - 8);
        goto fail;
    }
    const char *text = (const char *)f->buf + 8;
    const unsigned char *data = f->buf + 8 + hlen;
    size_t data_nbytes = f->nbytes - 8 - (size_t)hlen;
    if (text[0] != '{') {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: header does not start with '{'", path);
        goto fail;
    }
    st = tdm_json_parse(&f->header, text, (size_t)hlen);
    if (st != TDM_STATUS_OK) {
        tdm_error_prefix(st, "%s: header", path);
        goto fail;
    }
    const tdm_json *root = f->header;
    if (root->type != TDM_JSON_OBJECT) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: header is a JSON %s, expected an object",
                           path, tdm_json_type_name(root->type));
        goto fail;
    }
    int dup = tdm_json_find_duplicate(root);
    if (dup >= 0) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: duplicate tensor name '%s' in the header",
                           path, root->keys[dup]);
        goto fail;
    }
    if (root->n > 0) {
        f->tensors = calloc((size_t)root->n, sizeof *f->tensors);
        if (!f->tensors) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
            goto fail;
        }
    }
    for (int k = 0; k < root->n; k++) {
        const char *name = root->keys[k];
        const tdm_json *v = &root->items[k];
        if (strcmp(name, ST_META_KEY) != 0) {
            if (part == ST_PART_HEADER) continue;
            TDM_TRY(st_parse_tensor(f, name, v, data, data_nbytes, &f->tensors[f->n_tensors]));
            f->n_tensors++;
            continue;
        }
        if (v->type != TDM_JSON_OBJECT) {
            st = tdm_error_set(TDM_STATUS_FORMAT,
                               "%s: %s is a JSON %s, expected an object of strings", path,
                               ST_META_KEY, tdm_json_type_name(v->type));
            goto fail;
        }
        if ((dup = tdm_json_find_duplicate(v)) >= 0) {
            st = tdm_error_set(TDM_STATUS_FORMAT, "%s: duplicate %s key '%s'", path,
                               ST_META_KEY, v->keys[dup]);
            goto fail;
        }
        if (v->n > 0 && !(f->meta = calloc((size_t)v->n, sizeof *f->meta))) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
            goto fail;
        }
        for (int j = 0; j < v->n; j++) {
            if (v->items[j].type != TDM_JSON_STRING) {
                st = tdm_error_set(TDM_STATUS_FORMAT,
                                   "%s: %s value of '%s' is a JSON %s, expected a string",
                                   path, ST_META_KEY, v->keys[j],
                                   tdm_json_type_name(v->items[j].type));
                goto fail;
            }
            f->meta[j] = (tdm_st_meta){ .key = v->keys[j], .value = v->items[j].str };
        }
        f->n_meta = v->n;
    }
    if (part == ST_PART_FILE) {
        TDM_TRY(st_check_coverage(f, data, data_nbytes));
        TDM_INFO(DATA, "loaded %s: %d tensors, %zu data bytes", path, f->n_tensors,
                 data_nbytes);
    }
    *out = f;
    return TDM_STATUS_OK;
fail:
    tdm_st_free(f);
    return st;
}

tdm_status tdm_st_load(tdm_st_file **out, const char *path)
{
    return st_load(out, path, ST_PART_FILE);
}

tdm_status tdm_st_load_header(tdm_st_file **out, const char *path)
{
    return st_load(out, path, ST_PART_HEADER);
}

const char *tdm_st_path(const tdm_st_file *f) { return f->path; }
int tdm_st_count(const tdm_st_file *f) { return f->n_tensors; }

const tdm_st_tensor *tdm_st_get(const tdm_st_file *f, int i)
{
    if (i < 0 || i >= f->n_tensors) return NULL;
    return &f->tensors[i];
}

const tdm_st_tensor *tdm_st_find(const tdm_st_file *f, const char *name)
{
    for (int k = 0; k < f->n_tensors; k++)
        if (strcmp(f->tensors[k].name, name) == 0) return &f->tensors[k];
    return NULL;
}

int tdm_st_meta_count(const tdm_st_file *f) { return f->n_meta; }

const tdm_st_meta *tdm_st_meta_at(const tdm_st_file *f, int i)
{
    if (i < 0 || i >= f->n_meta) return NULL;
    return &f->meta[i];
}

const char *tdm_st_meta_get(const tdm_st_file *f, const char *key)
{
    for (int k = 0; k < f->n_meta; k++)
        if (strcmp(f->meta[k].key, key) == 0) return f->meta[k].value;
    return NULL;
}

tdm_status tdm_st_read(const tdm_st_file *f, const char *name, tdm_st_dtype dtype, int ndim,
                       const int64_t *shape, void *dst)
{
    TDM_REQUIRE(f && name, TDM_STATUS_INVALID_ARG, "tdm_st_read: NULL file or name");
    TDM_REQUIRE(ndim >= 0 && ndim <= TDM_ST_MAX_DIMS && (ndim == 0 || shape),
                TDM_STATUS_INVALID_ARG, "%s: tensor '%s': invalid expected ndim %d", f->path,
                name, ndim);
    const tdm_st_tensor *t = tdm_st_find(f, name);
    TDM_REQUIRE(t, TDM_STATUS_FORMAT, "%s: tensor '%s' not found", f->path, name);
    TDM_REQUIRE(t->dtype == dtype, TDM_STATUS_FORMAT,
                "%s: tensor '%s' has dtype %s, expected %s", f->path, name,
                tdm_st_dtype_name(t->dtype), tdm_st_dtype_name(dtype));
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char have[200], want[200];
        st_shape_str(have, sizeof have, t->ndim, t->shape);
        st_shape_str(want, sizeof want, ndim, shape);
        return tdm_error_set(TDM_STATUS_FORMAT, "%s: tensor '%s' has shape %s, expected %s",
                             f->path, name, have, want);
    }
    if (t->nbytes) memcpy(dst, t->data, t->nbytes);
    return TDM_STATUS_OK;
}
