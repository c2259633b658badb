/* tests/test_safetensors.c: the safetensors reader and writer
 * (core/safetensors.h) and the JSON parser under it (core/json.h):
 * round trips of every dtype, the on-disk layout checked byte by byte,
 * every class of corrupt file refused with a message naming the problem,
 * and atomic replacement. Not a test of model checkpoints. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/json.h"
#include "core/safetensors.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "st"); }
static void teardown(void) { tu_rmtree(g_dir); }

TestSuite(st, .init = setup, .fini = teardown);
TestSuite(json);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc((size_t)len + 1);
    cr_assert_eq(fread(p, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return p;
}

/* Number of directory entries other than . and .. */
static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    cr_assert_not_null(d);
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* A file with this header text (length hlen, or strlen when hlen < 0)
 * followed by data_nbytes bytes 0, 1, 2, ... */
static void write_raw(const char *path, const char *header, int64_t hlen, size_t data_nbytes)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint64_t n = hlen < 0 ? strlen(header) : (uint64_t)hlen;
    unsigned char len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (unsigned char)(n >> (8 * k));
    cr_assert_eq(fwrite(len8, 1, 8, f), 8u);
    cr_assert_eq(fwrite(header, 1, strlen(header), f), strlen(header));
    for (size_t k = 0; k < data_nbytes; k++) fputc((int)(k & 0xff), f);
    cr_assert_eq(fclose(f), 0);
}

static void expect_load_fail(const char *path, tdm_status st, const char *p1, const char *p2)
{
    tdm_st_file *f = (tdm_st_file *)0x1;
    tdm_status got = tdm_st_load(&f, path);
    const char *msg = tdm_error_message();
    cr_assert_eq(got, st, "status %s, expected %s: %s", tdm_status_name(got),
                 tdm_status_name(st), msg);
    cr_assert_null(f);
    cr_assert(strstr(msg, path), "message does not name the file: %s", msg);
    cr_assert(strstr(msg, p1), "message lacks '%s': %s", p1, msg);
    if (p2) cr_assert(strstr(msg, p2), "message lacks '%s': %s", p2, msg);
}

static void expect_header_fail(const char *header, size_t data_nbytes, const char *p1,
                               const char *p2)
{
    write_raw(tpath("bad.safetensors"), header, -1, data_nbytes);
    expect_load_fail(tpath("bad.safetensors"), TDM_STATUS_FORMAT, p1, p2);
}

/* ---- round trip --------------------------------------------------------- */

enum { N_RT = 16 };

typedef struct rt_case {
    tdm_st_tensor t[N_RT];
    void *buf[N_RT];
    int n;
} rt_case;

static void rt_add(rt_case *c, const char *name, tdm_st_dtype dt, int ndim, const int64_t *shape)
{
    tdm_st_tensor *t = &c->t[c->n];
    size_t n_elem = 1;
    memset(t, 0, sizeof *t);
    t->name = name;
    t->dtype = dt;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        t->shape[d] = shape[d];
        n_elem *= (size_t)shape[d];
    }
    t->nbytes = n_elem * tdm_st_dtype_size(dt);
    unsigned char *p = malloc(t->nbytes + 1);
    for (size_t k = 0; k < t->nbytes; k++) p[k] = (unsigned char)(k * 31 + (size_t)c->n * 7 + 1);
    if (dt == TDM_ST_F32)
        for (size_t k = 0; k < n_elem; k++) ((float *)p)[k] = (float)k * 0.5f - 3.0f;
    if (dt == TDM_ST_F64)
        for (size_t k = 0; k < n_elem; k++) ((double *)p)[k] = (double)k / 3.0;
    c->buf[c->n] = p;
    t->data = p;
    c->n++;
}

static void rt_build(rt_case *c)
{
    memset(c, 0, sizeof *c);
    static const int64_t s23[] = { 2, 3 }, s5[] = { 5 }, s7x1[] = { 7, 1 }, s0x3[] = { 0, 3 },
                         s8d[] = { 1, 2, 1, 2, 1, 2, 1, 3 }, s345[] = { 3, 4, 5 };
    rt_add(c, "fc1.weight", TDM_ST_F32, 2, s23);
    rt_add(c, "fc1.bias", TDM_ST_F64, 1, s5);
    rt_add(c, "half", TDM_ST_F16, 2, s7x1);
    rt_add(c, "bhalf", TDM_ST_BF16, 1, s5);
    rt_add(c, "step", TDM_ST_I64, 0, NULL);   /* scalar */
    rt_add(c, "i32", TDM_ST_I32, 3, s345);
    rt_add(c, "i16", TDM_ST_I16, 1, s5);
    rt_add(c, "i8", TDM_ST_I8, 1, s5);
    rt_add(c, "u64", TDM_ST_U64, 1, s5);
    rt_add(c, "u32", TDM_ST_U32, 1, s5);
    rt_add(c, "u16", TDM_ST_U16, 2, s23);
    rt_add(c, "bytes", TDM_ST_U8, 1, s5);     /* 5 bytes: later tensors unaligned */
    rt_add(c, "flags", TDM_ST_BOOL, 1, s5);
    rt_add(c, "empty", TDM_ST_F32, 2, s0x3);
    rt_add(c, "eight.dims", TDM_ST_F32, 8, s8d);
    rt_add(c, "odd \"name\"\\ with\nescapes \xc3\xa9\xf0\x9f\x98\x80", TDM_ST_F32, 1, s5);
}

static void rt_free(rt_case *c)
{
    for (int k = 0; k < c->n; k++) free(c->buf[k]);
}

static const tdm_st_meta rt_meta[] = {
    { "format", "pt" },
    { "tandem.note", "quote \" backslash \\ tab \t newline \n ctrl \x01 utf8 \xc3\xa9" },
};

Test(st, round_trip_every_dtype_with_metadata)
{
    rt_case c;
    rt_build(&c);
    const char *path = tpath("rt.safetensors");
    cr_assert_eq(tdm_st_save(path, c.t, c.n, rt_meta, 2), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(count_entries(g_dir), 1, "temporary file left behind");
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_str_eq(tdm_st_path(f), path);
    cr_assert_eq(tdm_st_count(f), c.n);
    for (int k = 0; k < c.n; k++) {
        const tdm_st_tensor *want = &c.t[k], *got = tdm_st_get(f, k);
        cr_assert_not_null(got);
        cr_assert_str_eq(got->name, want->name, "tensor %d", k);   /* header order kept */
        cr_assert_eq(tdm_st_find(f, want->name), got);
        cr_assert_eq(got->dtype, want->dtype);
        cr_assert_eq(got->ndim, want->ndim);
        for (int d = 0; d < want->ndim; d++) cr_assert_eq(got->shape[d], want->shape[d]);
        cr_assert_eq(got->nbytes, want->nbytes);
        cr_assert_eq(memcmp(got->data, want->data, want->nbytes), 0, "tensor %s", want->name);
        void *dst = malloc(want->nbytes + 1);
        cr_assert_eq(tdm_st_read(f, want->name, want->dtype, want->ndim, want->shape, dst),
                     TDM_STATUS_OK, "%s", tdm_error_message());
        cr_assert_eq(memcmp(dst, want->data, want->nbytes), 0);
        free(dst);
    }
    cr_assert_null(tdm_st_get(f, -1));
    cr_assert_null(tdm_st_get(f, c.n));
    cr_assert_null(tdm_st_find(f, "absent"));
    cr_assert_eq(tdm_st_meta_count(f), 2);
    cr_assert_str_eq(tdm_st_meta_get(f, "format"), "pt");
    cr_assert_str_eq(tdm_st_meta_get(f, "tandem.note"), rt_meta[1].value);
    cr_assert_str_eq(tdm_st_meta_at(f, 1)->key, "tandem.note");
    cr_assert_null(tdm_st_meta_at(f, 2));
    cr_assert_null(tdm_st_meta_get(f, "absent"));
    /* Values survive as numbers, not just bytes. */
    float w[6];
    const int64_t s23[] = { 2, 3 };
    cr_assert_eq(tdm_st_read(f, "fc1.weight", TDM_ST_F32, 2, s23, w), TDM_STATUS_OK);
    cr_assert_float_eq(w[5], 5 * 0.5f - 3.0f, 0.0f);
    tdm_st_free(f);
    tdm_st_free(NULL);
    rt_free(&c);
}

Test(st, empty_file_no_tensors)
{
    const char *path = tpath("empty.safetensors");
    cr_assert_eq(tdm_st_save(path, NULL, 0, NULL, 0), TDM_STATUS_OK, "%s", tdm_error_message());
    size_t n;
    unsigned char *b = slurp(path, &n);
    cr_assert_eq(n, 16u);
    cr_assert_eq(memcmp(b, "\x08\0\0\0\0\0\0\0{}      ", 16), 0);
    free(b);
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_st_count(f), 0);
    cr_assert_eq(tdm_st_meta_count(f), 0);
    tdm_st_free(f);
}

/* The bytes on disk follow the format by hand: 8-byte LE length, JSON
 * from '{', space padding to 8-byte alignment, then tensors in order. */
Test(st, layout_by_hand)
{
    rt_case c;
    rt_build(&c);
    const char *path = tpath("layout.safetensors");
    cr_assert_eq(tdm_st_save(path, c.t, c.n, rt_meta, 2), TDM_STATUS_OK);
    size_t n;
    unsigned char *b = slurp(path, &n);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--) hlen = hlen << 8 | b[k];
    cr_assert(hlen > 2 && 8 + hlen <= n);
    cr_assert_eq((8 + hlen) % 8, 0u, "data section not aligned");
    cr_assert_eq(b[8], '{');
    size_t end = 8 + hlen;
    while (b[end - 1] == ' ') end--;
    cr_assert_eq(b[end - 1], '}');
    cr_assert(8 + hlen - end < 8, "more padding than needed");
    char *hdr = strndup((const char *)b + 8, hlen);
    cr_assert(strstr(hdr, "\"__metadata__\":{\"format\":\"pt\""), "%s", hdr);
    cr_assert(strstr(hdr, "\"fc1.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],"
                          "\"data_offsets\":[0,24]}"), "%s", hdr);
    cr_assert(strstr(hdr, "\"fc1.bias\":{\"dtype\":\"F64\",\"shape\":[5],"
                          "\"data_offsets\":[24,64]}"), "%s", hdr);
    cr_assert(strstr(hdr, "\"step\":{\"dtype\":\"I64\",\"shape\":[],"), "%s", hdr);
    cr_assert(strstr(hdr, "\"odd \\\"name\\\"\\\\ with\\nescapes"), "%s", hdr);
    cr_assert(strstr(hdr, "ctrl \\u0001"), "%s", hdr);
    free(hdr);
    size_t total = 0;
    for (int k = 0; k < c.n; k++) {
        cr_assert_eq(memcmp(b + 8 + hlen + total, c.t[k].data, c.t[k].nbytes), 0, "%s",
                     c.t[k].name);
        total += c.t[k].nbytes;
    }
    cr_assert_eq(n, 8 + hlen + total, "file is not exactly header + data");
    free(b);
    rt_free(&c);
}

/* A hand-written file in the reference layout (unpadded, unordered keys,
 * whitespace, metadata last) is accepted. */
Test(st, foreign_file_accepted)
{
    const char *h = " {\n \"b\" : {\"shape\": [2], \"data_offsets\": [8, 16], \"dtype\": \"F32\"},"
                    "\"a\":{\"dtype\":\"U8\",\"shape\":[2,4],\"data_offsets\":[0,8]},"
                    "\"__metadata__\":{\"k\\u00e9\":\"v\\ud83d\\ude00\\/\"}}  ";
    write_raw(tpath("f.safetensors"), h + 1, -1, 16);
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, tpath("f.safetensors")), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(tdm_st_count(f), 2);
    cr_assert_str_eq(tdm_st_get(f, 0)->name, "b");
    cr_assert_str_eq(tdm_st_meta_get(f, "k\xc3\xa9"), "v\xf0\x9f\x98\x80/");
    unsigned char a[8];
    const int64_t s24[] = { 2, 4 };
    cr_assert_eq(tdm_st_read(f, "a", TDM_ST_U8, 2, s24, a), TDM_STATUS_OK);
    for (int k = 0; k < 8; k++) cr_assert_eq(a[k], k);
    tdm_st_free(f);
}

/* ---- corrupt files ------------------------------------------------------ */

Test(st, too_short_and_bad_header_length)
{
    write_raw(tpath("s"), "", 3, 0);   /* 8 bytes of length only */
    /* Fewer than 8 bytes. */
    FILE *fp = fopen(tpath("s"), "wb");
    fwrite("abc", 1, 3, fp);
    fclose(fp);
    expect_load_fail(tpath("s"), TDM_STATUS_FORMAT, "file is 3 bytes, too short", NULL);
    fp = fopen(tpath("s"), "wb");
    fclose(fp);
    expect_load_fail(tpath("s"), TDM_STATUS_FORMAT, "file is 0 bytes", NULL);

    write_raw(tpath("z"), "{}", 0, 0);
    expect_load_fail(tpath("z"), TDM_STATUS_FORMAT, "header length is 0", NULL);
    write_raw(tpath("big"), "{}      ", 9, 0);
    expect_load_fail(tpath("big"), TDM_STATUS_FORMAT, "header length 9 exceeds the file size",
                     "16 bytes");
    write_raw(tpath("huge"), "{}", (int64_t)1 << 40, 0);
    expect_load_fail(tpath("huge"), TDM_STATUS_FORMAT, "exceeds the limit of 100000000", NULL);
    write_raw(tpath("neg"), "{}", -2 /* written as 2^64 - 2 below */, 0);
    /* A length with the top bit set must not wrap around. */
    unsigned char len8[8] = { 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
    fp = fopen(tpath("neg"), "r+b");
    fwrite(len8, 1, 8, fp);
    fclose(fp);
    expect_load_fail(tpath("neg"), TDM_STATUS_FORMAT, "exceeds the limit", NULL);
}

Test(st, truncated_file)
{
    rt_case c;
    rt_build(&c);
    const char *path = tpath("t.safetensors");
    cr_assert_eq(tdm_st_save(path, c.t, c.n, NULL, 0), TDM_STATUS_OK);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    /* Cut in the data section, then in the header. */
    cr_assert_eq(truncate(path, sb.st_size - 1), 0);
    expect_load_fail(path, TDM_STATUS_FORMAT, "beyond the data section", "truncated");
    cr_assert_eq(truncate(path, 40), 0);
    expect_load_fail(path, TDM_STATUS_FORMAT, "exceeds the file size", "truncated");
    rt_free(&c);
}

/* The header alone: the metadata as tdm_st_load reads it, no tensors,
 * the data section never read (a cut in it goes unseen), the header's
 * own faults refused as tdm_st_load refuses them. */
Test(st, load_header_reads_the_metadata_only)
{
    rt_case c;
    rt_build(&c);
    const char *path = tpath("h.safetensors");
    cr_assert_eq(tdm_st_save(path, c.t, c.n, rt_meta, 2), TDM_STATUS_OK);
    tdm_st_file *f = NULL;
    cr_assert_eq(tdm_st_load_header(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_st_count(f), 0);
    cr_assert_null(tdm_st_find(f, "fc1.weight"));
    cr_assert_eq(tdm_st_meta_count(f), 2);
    cr_assert_str_eq(tdm_st_meta_get(f, "format"), "pt");
    cr_assert_str_eq(tdm_st_meta_get(f, "tandem.note"), rt_meta[1].value);
    tdm_st_free(f);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(truncate(path, sb.st_size - 1), 0);
    expect_load_fail(path, TDM_STATUS_FORMAT, "beyond the data section", "truncated");
    cr_assert_eq(tdm_st_load_header(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_str_eq(tdm_st_meta_get(f, "format"), "pt");
    tdm_st_free(f);
    struct { const char *file, *header; int64_t hlen; const char *want; } bad[] = {
        {"cut", NULL, 0, "exceeds the file size"},
        {"short", "", 3, "too short"},
        {"huge", "{}", (int64_t)1 << 40, "exceeds the limit of 100000000"},
        {"json", "{\"a\":", -1, "header"},
        {"meta", "{\"__metadata__\":{\"k\":1}}", -1, "expected a string"},
    };
    cr_assert_eq(truncate(path, 40), 0);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        const char *p = k == 0 ? path : tpath(bad[k].file);
        if (k == 1) {
            FILE *fp = fopen(p, "wb");
            fwrite("abc", 1, 3, fp);
            fclose(fp);
        } else if (k > 1) {
            write_raw(p, bad[k].header, bad[k].hlen, 0);
        }
        f = (tdm_st_file *)0x1;
        cr_assert_eq(tdm_st_load_header(&f, p), TDM_STATUS_FORMAT, "%s: %s", bad[k].file,
                     tdm_error_message());
        cr_assert_null(f);
        cr_assert(strstr(tdm_error_message(), bad[k].want), "%s: %s", bad[k].file,
                  tdm_error_message());
    }
    rt_free(&c);
}

Test(st, missing_file_and_directory)
{
    expect_load_fail(tpath("nope.safetensors"), TDM_STATUS_IO, "No such file or directory",
                     NULL);
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, g_dir), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "not a regular file"), "%s", tdm_error_message());
}

Test(st, invalid_json)
{
    static const struct { const char *h; const char *why; } cases[] = {
        { "{\"a\":", "unexpected end" },
        { "{\"a\":{\"dtype\":\"F32\",}}", "expected a string key" },
        { "{'a':1}", "expected a string key" },
        { "{\"a\" 1}", "expected ':'" },
        { "{\"a\":01}", "leading zero" },
        { "{\"a\":1.5}", "only integers" },
        { "{\"a\":1e3}", "only integers" },
        { "{\"a\":-}", "expected a digit" },
        { "{\"a\":99999999999999999999}", "out of range" },
        { "{\"a\":\"x\x01y\"}", "control character" },
        { "{\"a\":\"\xc3\x28\"}", "invalid UTF-8" },
        { "{\"a\":\"\xc0\xaf\"}", "invalid UTF-8" },          /* overlong '/' */
        { "{\"a\":\"\xed\xa0\x80\"}", "invalid UTF-8" },      /* encoded surrogate */
        { "{\"a\":\"\\ud800\"}", "unpaired high surrogate" },
        { "{\"a\":\"\\udc00\"}", "unpaired low surrogate" },
        { "{\"a\":\"\\u00zz\"}", "invalid escape" },
        { "{\"a\":\"\\x\"}", "invalid escape" },
        { "{\"a\":\"\\u0000\"}", "\\u0000" },
        { "{\"a\":\"abc}", "unterminated string" },
        { "{\"a\":[1,2}", "expected ',' or ']'" },
        { "{\"a\":1 \"b\":2}", "expected ',' or '}'" },
        { "{\"a\":tru}", "unexpected character" },
        { "{} x", "unexpected text after" },
        { "{}{}", "unexpected text after" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        write_raw(tpath("j"), cases[k].h, -1, 0);
        tdm_st_file *f;
        cr_assert_eq(tdm_st_load(&f, tpath("j")), TDM_STATUS_FORMAT, "case %zu: %s", k,
                     cases[k].h);
        const char *msg = tdm_error_message();
        cr_assert(strstr(msg, "invalid JSON at byte"), "case %zu: %s", k, msg);
        cr_assert(strstr(msg, cases[k].why), "case %zu lacks '%s': %s", k, cases[k].why, msg);
        cr_assert(strstr(msg, tpath("j")), "%s", msg);
    }
    /* Nesting beyond the limit is refused, not a stack overflow. */
    char deep[400];
    size_t n = 0;
    n += (size_t)sprintf(deep, "{\"a\":");
    for (int k = 0; k < 100; k++) deep[n++] = '[';
    for (int k = 0; k < 100; k++) deep[n++] = ']';
    deep[n++] = '}';
    deep[n] = '\0';
    expect_header_fail(deep, 0, "nesting too deep", NULL);
    expect_header_fail("[]", 0, "does not start with '{'", NULL);
    expect_header_fail(" {}", 0, "does not start with '{'", NULL);
}

Test(st, bad_entries)
{
    expect_header_fail("{\"w\":{\"dtype\":\"F31\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                       "tensor 'w': unknown dtype \"F31\"", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                       "unknown dtype", NULL);
    expect_header_fail("{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                       "tensor 'w': dtype is a JSON integer", NULL);
    expect_header_fail("{\"w\":5}", 0, "tensor 'w': entry is a JSON integer", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4,
                       "tensor 'w': missing field 'shape'", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],"
                       "\"extra\":1}}", 4, "tensor 'w': unknown field 'extra'", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"shape\":[1],"
                       "\"data_offsets\":[0,4]}}", 4, "duplicate field 'shape'", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
                       "tensor 'w': shape[0] = -1 is out of range", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,\"3\"],\"data_offsets\":[0,4]}}",
                       4, "shape[1] is a JSON string", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[0,4]}}", 4,
                       "shape is a JSON object", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
                       "\"data_offsets\":[0,1]}}", 1, "9 dimensions (at most 8", NULL);
    /* Dimensions whose product overflows. */
    expect_header_fail("{\"w\":{\"dtype\":\"F64\",\"shape\":[1099511627776,1099511627776],"
                       "\"data_offsets\":[0,8]}}", 8, "too large", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4,
                       "data_offsets must be an array of two integers", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
                       "tensor 'w': data_offsets [4, 0] are invalid", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4,
                       "are invalid", NULL);
    expect_header_fail("{\"__metadata__\":{\"k\":1}}", 0, "value of 'k' is a JSON integer",
                       NULL);
    expect_header_fail("{\"__metadata__\":[]}", 0, "__metadata__ is a JSON array", NULL);
    expect_header_fail("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0,
                       "duplicate __metadata__ key 'k'", NULL);
}

Test(st, shape_offset_inconsistent)
{
    expect_header_fail("{\"fc1.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],"
                       "\"data_offsets\":[0,20]}}", 20,
                       "tensor 'fc1.weight': data_offsets [0, 20] span 20 bytes, but shape "
                       "[2, 3] of F32 needs 24", NULL);
    expect_header_fail("{\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,4]}}", 4,
                       "shape [] of I64 needs 8", NULL);
    expect_header_fail("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
                       "tensor 'w': data_offsets end 8 is beyond the data section (4 bytes",
                       NULL);
}

Test(st, overlap_gap_trailing_duplicate)
{
    expect_header_fail("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
                       "tensors 'a' [0, 8) and 'b' [4, 12) overlap", NULL);
    /* The same range twice. */
    expect_header_fail("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", 8,
                       "overlap", NULL);
    expect_header_fail("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12,
                       "gap of 4 bytes between tensors 'a' and 'b'", NULL);
    expect_header_fail("{\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 12,
                       "gap of 4 bytes at the start of the data section, before tensor 'a'",
                       NULL);
    expect_header_fail("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 7,
                       "3 trailing bytes", "data section has 7 bytes but the tensors cover 4");
    expect_header_fail("{}", 1, "1 trailing bytes", NULL);
    expect_header_fail("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
                       "duplicate tensor name 'a'", NULL);
}

Test(st, read_checks_name_dtype_shape)
{
    const int64_t shape[] = { 1024, 784 };
    size_t nbytes = 1024 * 784 * sizeof(float);
    float *w = calloc(1024 * 784, sizeof *w);
    tdm_st_tensor t = { .name = "fc1.weight", .dtype = TDM_ST_F32, .ndim = 2,
                        .shape = { 1024, 784 }, .data = w, .nbytes = nbytes };
    const char *path = tpath("ckpt.safetensors");
    cr_assert_eq(tdm_st_save(path, &t, 1, NULL, 0), TDM_STATUS_OK);
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, path), TDM_STATUS_OK);
    const int64_t s512[] = { 512, 784 }, s3[] = { 1024, 784, 1 };
    cr_assert_eq(tdm_st_read(f, "fc1.weight", TDM_ST_F32, 2, s512, w), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(),
                     "ckpt.safetensors: tensor 'fc1.weight' has shape [1024, 784], expected "
                     "[512, 784]"), "%s", tdm_error_message());
    cr_assert_eq(tdm_st_read(f, "fc1.weight", TDM_ST_F32, 3, s3, w), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "expected [1024, 784, 1]"), "%s",
              tdm_error_message());
    cr_assert_eq(tdm_st_read(f, "fc1.weight", TDM_ST_F64, 2, shape, w), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "tensor 'fc1.weight' has dtype F32, expected F64"),
              "%s", tdm_error_message());
    cr_assert_eq(tdm_st_read(f, "fc2.weight", TDM_ST_F32, 2, shape, w), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "ckpt.safetensors: tensor 'fc2.weight' not found"),
              "%s", tdm_error_message());
    cr_assert_eq(tdm_st_read(f, "fc1.weight", TDM_ST_F32, 2, shape, w), TDM_STATUS_OK);
    tdm_st_free(f);
    free(w);
}

Test(st, save_refuses_bad_arguments)
{
    float v[4] = { 0 };
    tdm_st_tensor t[2] = {
        { .name = "a", .dtype = TDM_ST_F32, .ndim = 1, .shape = { 4 }, .data = v, .nbytes = 16 },
        { .name = "a", .dtype = TDM_ST_F32, .ndim = 1, .shape = { 4 }, .data = v, .nbytes = 16 },
    };
    const char *path = tpath("x.safetensors");
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "duplicate tensor name 'a'"));
    t[1].name = "__metadata__";
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    t[1].name = "";
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    t[1].name = "b";
    t[1].nbytes = 12;
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "tensor 'b' has nbytes 12 but its shape and dtype "
                                          "make 16"), "%s", tdm_error_message());
    t[1].nbytes = 16;
    t[1].ndim = 9;
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    t[1].ndim = 1;
    t[1].shape[0] = -4;
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    t[1].shape[0] = 4;
    t[1].dtype = TDM_ST_DTYPE_COUNT_;
    cr_assert_eq(tdm_st_save(path, t, 2, NULL, 0), TDM_STATUS_INVALID_ARG);
    t[1].dtype = TDM_ST_F32;
    const tdm_st_meta m[2] = { { "k", "1" }, { "k", "2" } };
    cr_assert_eq(tdm_st_save(path, t, 2, m, 2), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "duplicate metadata key 'k'"));
    cr_assert_eq(count_entries(g_dir), 0, "a refused save created a file");
    cr_assert_eq(tdm_st_save(path, t, 2, m, 1), TDM_STATUS_OK, "%s", tdm_error_message());
}

/* ---- atomic write ------------------------------------------------------- */

static void save_one(const char *path, const char *name, size_t n_elem, float fill,
                     tdm_status expect)
{
    float *v = malloc(n_elem * sizeof *v);
    for (size_t k = 0; k < n_elem; k++) v[k] = fill;
    tdm_st_tensor t = { .name = name, .dtype = TDM_ST_F32, .ndim = 1,
                        .shape = { (int64_t)n_elem }, .data = v,
                        .nbytes = n_elem * sizeof *v };
    tdm_status st = tdm_st_save(path, &t, 1, NULL, 0);
    cr_assert_eq(st, expect, "%s", tdm_error_message());
    free(v);
}

Test(st, unwritable_paths_fail_cleanly)
{
    char path[300];
    snprintf(path, sizeof path, "%s/no-such-dir/ckpt.safetensors", g_dir);
    save_one(path, "w", 4, 1.0f, TDM_STATUS_IO);
    const char *msg = tdm_error_message();
    cr_assert(strstr(msg, path), "%s", msg);
    cr_assert(strstr(msg, "No such file or directory"), "%s", msg);
    cr_assert_eq(count_entries(g_dir), 0);

    save_one("/proc/tdm-test.safetensors", "w", 4, 1.0f, TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "/proc/tdm-test.safetensors"));

    /* path is a directory: refused up front (it used to fail at the
     * rename), and nothing is left behind. */
    snprintf(path, sizeof path, "%s/isdir", g_dir);
    cr_assert_eq(mkdir(path, 0755), 0);
    char inner[320];
    snprintf(inner, sizeof inner, "%s/keep", path);
    fclose(fopen(inner, "w"));
    save_one(path, "w", 4, 1.0f, TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "is a directory, not a regular file"), "%s",
              tdm_error_message());
    cr_assert_eq(count_entries(g_dir), 1, "temporary file left behind");
}

Test(st, overwrite_replaces_wholly)
{
    const char *path = tpath("ckpt.safetensors");
    save_one(path, "big", 1 << 18, 2.0f, TDM_STATUS_OK);
    save_one(path, "small", 3, 7.0f, TDM_STATUS_OK);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_st_count(f), 1);
    cr_assert_null(tdm_st_find(f, "big"));
    const tdm_st_tensor *t = tdm_st_find(f, "small");
    cr_assert_not_null(t);
    cr_assert_eq((size_t)sb.st_size, 8 + 64 + t->nbytes, "size %ld", (long)sb.st_size);
    float v[3];
    const int64_t s3[] = { 3 };
    cr_assert_eq(tdm_st_read(f, "small", TDM_ST_F32, 1, s3, v), TDM_STATUS_OK);
    cr_assert_float_eq(v[2], 7.0f, 0.0f);
    tdm_st_free(f);
    cr_assert_eq(count_entries(g_dir), 1);
}

/* A write that fails half way (file size limit: EFBIG) leaves the old
 * file intact and no temporary file. */
Test(st, failed_write_keeps_old_file)
{
    const char *path = tpath("ckpt.safetensors");
    save_one(path, "old", 16, 3.0f, TDM_STATUS_OK);
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &rl), 0);
    struct rlimit lim = { .rlim_cur = 64 * 1024, .rlim_max = rl.rlim_max };
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    save_one(path, "new", 1 << 20, 4.0f, TDM_STATUS_IO);
    setrlimit(RLIMIT_FSIZE, &rl);
    cr_assert(strstr(tdm_error_message(), "File too large"), "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), path), "%s", tdm_error_message());
    cr_assert_eq(count_entries(g_dir), 1, "temporary file left behind");
    tdm_st_file *f;
    cr_assert_eq(tdm_st_load(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_not_null(tdm_st_find(f, "old"));
    cr_assert_eq(tdm_st_count(f), 1);
    tdm_st_free(f);
}

/* ---- the JSON parser directly ------------------------------------------- */

Test(json, values_and_escapes)
{
    const char *text = " {\"i\": [0, -1, 9223372036854775807, -9223372036854775808],"
                       " \"s\": \"a\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0041\\u00e9\\u20ac\\ud83d\\ude00\","
                       " \"t\": true, \"f\": false, \"n\": null, \"o\": {}, \"e\": []} ";
    tdm_json *v;
    cr_assert_eq(tdm_json_parse(&v, text, strlen(text)), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(v->type, TDM_JSON_OBJECT);
    cr_assert_eq(v->n, 7);
    const tdm_json *i = tdm_json_get(v, "i");
    cr_assert_eq(i->type, TDM_JSON_ARRAY);
    cr_assert_eq(i->n, 4);
    cr_assert_eq(i->items[1].i, -1);
    cr_assert_eq(i->items[2].i, INT64_MAX);
    cr_assert_eq(i->items[3].i, INT64_MIN);
    const tdm_json *s = tdm_json_get(v, "s");
    cr_assert_str_eq(s->str, "a\"\\/\b\f\n\r\tA\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
    cr_assert_eq(s->str_len, strlen(s->str));
    cr_assert_eq(tdm_json_get(v, "t")->i, 1);
    cr_assert_eq(tdm_json_get(v, "f")->type, TDM_JSON_BOOL);
    cr_assert_eq(tdm_json_get(v, "n")->type, TDM_JSON_NULL);
    cr_assert_eq(tdm_json_get(v, "o")->n, 0);
    cr_assert_null(tdm_json_get(v, "missing"));
    cr_assert_null(tdm_json_get(i, "x"));
    cr_assert_eq(tdm_json_find_duplicate(v), -1);
    tdm_json_free(v);
    tdm_json_free(NULL);

    const char *over = "9223372036854775808";
    cr_assert_eq(tdm_json_parse(&v, over, strlen(over)), TDM_STATUS_FORMAT);
    cr_assert_null(v);
    /* Text ends early inside every kind of value. */
    const char *cut = "{\"a\":[1,\"x\",{\"b\":true}]}";
    for (size_t n = 0; n < strlen(cut); n++) {
        cr_assert_eq(tdm_json_parse(&v, cut, n), TDM_STATUS_FORMAT, "prefix %zu", n);
        cr_assert_null(v);
    }
    cr_assert_eq(tdm_json_parse(&v, cut, strlen(cut)), TDM_STATUS_OK);
    tdm_json_free(v);
}

Test(json, duplicates_found)
{
    const char *text = "{\"c\":1,\"a\":2,\"b\":3,\"a\":4,\"c\":5}";
    tdm_json *v;
    cr_assert_eq(tdm_json_parse(&v, text, strlen(text)), TDM_STATUS_OK);
    cr_assert_eq(tdm_json_find_duplicate(v), 3);   /* the second "a" comes first */
    cr_assert_eq(tdm_json_get(v, "a")->i, 2);
    tdm_json_free(v);
}
