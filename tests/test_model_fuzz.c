/* tests/test_model_fuzz.c: hostile input to the model file parser
 * (models/model_file.c) and the .npy reader (core/npy.c): every header
 * field of a .npy file broken one at a time, each refused with a message
 * naming what is wrong; then thousands of random mutations (truncations,
 * flipped bytes, spliced lines, huge and negative numbers, unbalanced
 * braces; the GPT's layers with bad heads, widths they do not divide,
 * embeddings without a vocabulary) of valid files, each either accepted (and a model file then
 * built and run once) or refused in one line - never a crash (the suite
 * runs this binary under ASan too: make asan ASAN_TESTS=test_model_fuzz). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/npy.h"
#include "models/builder.h"
#include "tests/test_util.h"

/* ---- .npy ------------------------------------------------------------------ */

/* A version-1.0 file with header text hdr (padded to 64 bytes with its
 * newline) and nd data bytes of value 1. */
static size_t npy_make(unsigned char *buf, size_t cap, const char *hdr, size_t nd)
{
    size_t hl = strlen(hdr), pad = (64 - (10 + hl + 1) % 64) % 64, total = 10 + hl + pad + 1 + nd;
    cr_assert(total <= cap);
    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (unsigned char)((hl + pad + 1) & 0xff);
    buf[9] = (unsigned char)((hl + pad + 1) >> 8);
    memcpy(buf + 10, hdr, hl);
    memset(buf + 10 + hl, ' ', pad);
    buf[10 + hl + pad] = '\n';
    memset(buf + 11 + hl + pad, 1, nd);
    return total;
}

static void npy_refused(const unsigned char *buf, size_t n, const char *want)
{
    tdm_npy a;
    tdm_status st = tdm_npy_parse(&a, "t.npy", buf, n);
    cr_assert_eq(st, TDM_STATUS_FORMAT, "accepted (want '%s')", want);
    cr_assert(strstr(tdm_error_message(), want), "'%s' lacks '%s'", tdm_error_message(), want);
    cr_assert(!strchr(tdm_error_message(), '\n'));
    cr_assert_null(a.data);
}

Test(npy, a_valid_file_parses)
{
    unsigned char buf[512];
    size_t n = npy_make(buf, sizeof buf, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 24);
    tdm_npy a;
    TU_OK(tdm_npy_parse(&a, "t.npy", buf, n));
    cr_assert(a.dtype == TDM_NPY_F4 && a.ndim == 2 && a.shape[0] == 2 && a.shape[1] == 3 &&
              a.n_elem == 6);
    tdm_npy_free(&a);
    n = npy_make(buf, sizeof buf, "{'shape': (3,), 'fortran_order': False, 'descr': '<i8'}", 24);
    TU_OK(tdm_npy_parse(&a, "t.npy", buf, n));
    cr_assert(a.dtype == TDM_NPY_I8 && a.ndim == 1 && a.shape[0] == 3);
    cr_assert_eq(tdm_npy_int(&a, 2), 0x0101010101010101LL);
    tdm_npy_free(&a);
    n = npy_make(buf, sizeof buf, "{'descr': '|u1', 'fortran_order': False, 'shape': (), }", 1);
    TU_OK(tdm_npy_parse(&a, "t.npy", buf, n));
    cr_assert(a.ndim == 0 && a.n_elem == 1);
    tdm_npy_free(&a);
}

Test(npy, every_header_field_is_checked)
{
    unsigned char buf[1024];
    const char *ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    size_t n = npy_make(buf, sizeof buf, ok, 24);
    npy_refused(buf, 5, "no .npy magic");
    unsigned char b2[1024];
    memcpy(b2, buf, n);
    b2[0] = 'x';
    npy_refused(b2, n, "no .npy magic");
    memcpy(b2, buf, n);
    b2[6] = 4;
    npy_refused(b2, n, "format version 4.0");
    memcpy(b2, buf, n);
    b2[7] = 1;
    npy_refused(b2, n, "format version 1.1");
    npy_refused(buf, 9, "truncated in its header length");
    memcpy(b2, buf, n);
    b2[8] = b2[9] = 0;
    npy_refused(b2, n, "header length 0");
    memcpy(b2, buf, n);
    b2[9] = 0xff;
    npy_refused(b2, n, "truncated: the header says");
    npy_refused(buf, n - 1, "truncated: the shape needs 24 bytes of data, the file has 23");
    memcpy(b2, buf, n);
    b2[n] = 0;
    npy_refused(b2, n + 1, "trailing bytes");
#define HDR(h, want)                                                                  \
    do {                                                                              \
        size_t m_ = npy_make(b2, sizeof b2, h, 24);                                   \
        npy_refused(b2, m_, want);                                                    \
    } while (0)
    HDR("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", "dtype '>f4'");
    HDR("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }", "dtype '<f8'");
    HDR("{'descr': '|O', 'fortran_order': False, 'shape': (2, 3), }", "dtype '|O'");
    HDR("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", "fortran_order is True");
    HDR("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", "neither True nor False");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", "non-negative integers");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", "not a tuple");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999, 3), }",
        "shape size above");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000000000, 1000000), }",
        "element count overflows");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 1000), }",
        "above tandem's limit");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }",
        "more than 8 dimensions");
    /* 2^62 elements of 4 bytes wrap to 0 bytes: a file with no data at
     * all claimed them (a 1-byte buffer behind 2^62 elements) */
    size_t mw = npy_make(b2, sizeof b2, "{'descr': '<f4', 'fortran_order': False, "
                                         "'shape': (1099511627776, 4194304), }", 0);
    npy_refused(b2, mw, "4611686018427387904 elements of 4 bytes are above tandem's limit");
    HDR("{'descr': '<f4', 'fortran_order': False, }", "missing 'shape'");
    HDR("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
        "key 'descr' unknown or repeated");
    HDR("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", "key 'x'");
    HDR("{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3), }", "expected ',' or '}'");
    HDR("['descr']", "not a dict");
    HDR("{'descr: '<f4'}", "expected ':'");
#undef HDR
}

/* Random mutations of a valid file: parsed or refused in one line. */
Test(npy, mutations_never_crash)
{
    unsigned char base[512], buf[600];
    size_t n = npy_make(base, sizeof base,
                        "{'descr': '<i4', 'fortran_order': False, 'shape': (4, 2), }", 32);
    tdm_rng r = tu_rng(42);
    int ok = 0;
    for (int it = 0; it < 5000; it++) {
        memcpy(buf, base, n);
        size_t m = n;
        int k = 1 + (int)tdm_rng_below(&r, 4);
        for (int j = 0; j < k; j++) {
            size_t at = (size_t)tdm_rng_below(&r, (uint64_t)m);
            switch (tdm_rng_below(&r, 4)) {
            case 0: buf[at] = (unsigned char)tdm_rng_below(&r, 256); break;
            case 1: m = at; break;                                   /* truncate */
            case 2: buf[at] = "0123456789(),:'{} -\n"[tdm_rng_below(&r, 20)]; break;
            default: if (m < sizeof buf) buf[m++] = (unsigned char)tdm_rng_below(&r, 256);
            }
            if (m == 0) break;
        }
        tdm_npy a;
        tdm_status st = tdm_npy_parse(&a, "m.npy", buf, m);
        if (st == TDM_STATUS_OK) {
            ok++;
            /* what was accepted fits the limit and is all there */
            cr_assert(a.itemsize > 0 && (uint64_t)a.n_elem <= TDM_NPY_MAX_BYTES / a.itemsize,
                      "mutation %d: %lld elements of %d bytes accepted", it, (long long)a.n_elem,
                      (int)a.itemsize);
            tdm_npy_free(&a);
            continue;
        }
        cr_assert_eq(st, TDM_STATUS_FORMAT, "mutation %d: status %s: %s", it,
                     tdm_status_name(st), tdm_error_message());
        cr_assert(tdm_error_message()[0] && !strchr(tdm_error_message(), '\n'),
                  "mutation %d: '%s'", it, tdm_error_message());
    }
    fprintf(stderr, "  npy: %d of 5000 mutations still valid files\n", ok);
}

/* A dataset from a pair of files on disk. */
static void write_file(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b, 1, n, f), n);
    fclose(f);
}

Test(npy, datasets_from_pairs)
{
    char dir[] = "/tmp/tdm-npy-XXXXXX", xp[64], yp[64], pair[160];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(xp, sizeof xp, "%s/x.npy", dir);
    snprintf(yp, sizeof yp, "%s/y.npy", dir);
    snprintf(pair, sizeof pair, "%s,%s", xp, yp);
    unsigned char bx[512], by[512];
    size_t nx = npy_make(bx, sizeof bx, "{'descr': '|u1', 'fortran_order': False, 'shape': (3, 2, 2, 2), }", 24);
    size_t ny = npy_make(by, sizeof by, "{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", 3);
    write_file(xp, bx, nx);
    write_file(yp, by, ny);
    tdm_dataset d;
    TU_OK(tdm_data_load_npy(&d, pair));
    cr_assert(d.n == 3 && d.c == 2 && d.h == 2 && d.w == 2 && d.n_classes == 2);
    cr_assert_float_eq(d.x[0], (1.0f / 255.0f - TDM_DATA_FMNIST_MEAN) / TDM_DATA_FMNIST_STD, 1e-6);
    cr_assert_eq(d.y[2], 1);
    tdm_data_free(&d);
    /* labels: count, dtype, sign */
    ny = npy_make(by, sizeof by, "{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", 2);
    write_file(yp, by, ny);
    cr_assert_eq(tdm_data_load_npy(&d, pair), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "labels must be integers of shape (3,)"), "%s",
              tdm_error_message());
    ny = npy_make(by, sizeof by, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 12);
    write_file(yp, by, ny);
    cr_assert_eq(tdm_data_load_npy(&d, pair), TDM_STATUS_FORMAT);
    ny = npy_make(by, sizeof by, "{'descr': '|i1', 'fortran_order': False, 'shape': (3,), }", 3);
    by[ny - 1] = 0xff;   /* -1 */
    write_file(yp, by, ny);
    cr_assert_eq(tdm_data_load_npy(&d, pair), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "label -1 of sample 2"), "%s", tdm_error_message());
    /* inputs: dtype */
    nx = npy_make(bx, sizeof bx, "{'descr': '<i4', 'fortran_order': False, 'shape': (3, 2), }", 24);
    write_file(xp, bx, nx);
    cr_assert_eq(tdm_data_load_npy(&d, pair), TDM_STATUS_FORMAT);
    cr_assert(strstr(tdm_error_message(), "float32 or uint8"), "%s", tdm_error_message());
    cr_assert_eq(tdm_data_load_npy(&d, xp), TDM_STATUS_INVALID_ARG);
    cr_assert(tdm_data_is_npy(pair) && !tdm_data_is_npy("synthetic") && !tdm_data_is_npy(xp));
    remove(xp);
    remove(yp);
    rmdir(dir);
}

/* ---- model files -------------------------------------------------------------- */

static const char *g_models[] = {
    "input 1x12x12\nconv 3x3 4 pad 1\nbatchnorm\nrelu\nresidual {\n conv 3x3 4 pad 1\n"
    " batchnorm\n}\nrelu\nresidual {\n conv 3x3 8 stride 2 pad 1\n} proj\nmaxpool 2\n"
    "avgpool global\nflatten\nlinear 10\n",
    "input 20\nlinear 16\ngelu\nresidual {\n linear 16\n tanh\n}\nresidual {\n linear 8\n"
    "} proj\nsigmoid\nlinear 3\n",
    "input tokens 6\nembedding vocab 256 dim 8\nembedding positions\nresidual {\n layernorm\n"
    " attention heads 2\n}\nresidual {\n layernorm\n gptmlp\n}\nlayernorm\nlmhead tied\n",
};
#define N_MODELS (int)(sizeof g_models / sizeof *g_models)

static const char *g_splices[] = {
    "}\n", "residual {\n", "} proj\n", "linear 0\n", "linear -1\n", "conv 99x99 3\n",
    "conv 3x3 2147483647\n", "maxpool 1000000\n", "input 3x3x3\n", "avgpool global\n",
    "flatten\n", "linear 99999999999999999999\n", "conv 3x3 4 stride 0\n", "batchnorm\n",
    "# }\n", "residual{\n", "}proj\n", "relu relu\n", "\x01\n", "conv 1x1 1048576\n",
    /* the GPT's layers: bad heads, widths they do not divide, an embedding
     * without its vocabulary, huge sizes, lines out of the arrangement */
    "attention heads 3\n", "attention heads 0\n", "attention heads 4096\n",
    "attention heads 2\n", "embedding dim 8\n", "embedding vocab 256\n",
    "embedding vocab 255 dim 8\n", "embedding vocab 256 dim 65537\n", "embedding positions\n",
    "layernorm\n", "gptmlp\n", "lmhead\n", "lmhead tied\n", "input tokens 99999999\n",
    "input tokens 0\n", "input tokens 4096\n", "residual {\n layernorm\n gptmlp\n}\n",
};

Test(model_file, mutations_never_crash)
{
    tdm_rng r = tu_rng(7);
    char buf[2048];
    int ok = 0, ran = 0, gpt_ran = 0;
    tdm_device *host = tu_host();
    for (int it = 0; it < 3000; it++) {
        const char *base = g_models[it % N_MODELS];
        size_t m = strlen(base);
        memcpy(buf, base, m);
        int k = 1 + (int)tdm_rng_below(&r, 3);
        for (int j = 0; j < k && m > 0; j++) {
            size_t at = (size_t)tdm_rng_below(&r, (uint64_t)m);
            switch (tdm_rng_below(&r, 4)) {
            case 0: buf[at] = (char)tdm_rng_below(&r, 256); break;
            case 1: m = at; break;
            case 2: {   /* a line spliced in at a line start */
                while (at > 0 && buf[at - 1] != '\n') at--;
                const char *s = g_splices[tdm_rng_below(&r, sizeof g_splices / sizeof *g_splices)];
                size_t sl = strlen(s);
                if (m + sl >= sizeof buf) break;
                memmove(buf + at + sl, buf + at, m - at);
                memcpy(buf + at, s, sl);
                m += sl;
                break;
            }
            default: {  /* a line dropped */
                size_t e = at;
                while (at > 0 && buf[at - 1] != '\n') at--;
                while (e < m && buf[e] != '\n') e++;
                if (e < m) e++;
                memmove(buf + at, buf + e, m - e);
                m -= e - at;
            }
            }
        }
        tdm_model_spec s;
        tdm_status st = tdm_model_seq_parse_text(&s, "fuzz.tdm", buf, m);
        if (st != TDM_STATUS_OK) {
            cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "mutation %d: %s: %s", it,
                         tdm_status_name(st), tdm_error_message());
            cr_assert(!strncmp(tdm_error_message(), "fuzz.tdm", 8) &&
                          !strchr(tdm_error_message(), '\n'),
                      "mutation %d: '%s'", it, tdm_error_message());
            continue;
        }
        ok++;
        /* small enough to build and run once */
        tdm_model *mdl = NULL;
        int64_t in = (int64_t)s.in_c * s.in_h * s.in_w;
        tdm_model_footprint fp;
        if (in > 4096 || tdm_model_spec_footprint(&s, host, 2, &fp) != TDM_STATUS_OK ||
            fp.param_elems > (1 << 18) || fp.act_bytes > ((size_t)16 << 20))
            continue;
        if (tdm_model_init(&mdl, host, &s, 1) != TDM_STATUS_OK) continue;
        {
            /* zeros: float features, or token 0 (4 bytes either way) */
            float *x = calloc((size_t)in * 2, sizeof(float));
            int rows = 2 * tdm_model_out_rows(mdl);
            int32_t *y = calloc((size_t)rows, sizeof(int32_t));
            double loss;
            cr_assert(x && y);
            for (int i = 0; i < rows; i++) y[i] = i % 2;
            TU_OK(tdm_model_forward_backward(mdl, x, y, 2, &loss));
            free(x);
            free(y);
            ran++;
            gpt_ran += s.kind == TDM_MODEL_GPT;
        }
        tdm_model_free(mdl);
    }
    tdm_device_free(host);
    fprintf(stderr, "  model files: %d of 3000 mutations valid, %d built and run (%d GPTs)\n", ok,
            ran, gpt_ran);
    cr_assert(gpt_ran > 0, "no mutated GPT file was built and run");
}

Test(model_file, files_on_disk)
{
    tdm_model_spec s;
    cr_assert_eq(tdm_model_spec_parse(&s, "file:/nonexistent/x.tdm"), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "/nonexistent/x.tdm"), "%s", tdm_error_message());
    cr_assert_eq(tdm_model_spec_parse(&s, "file:/dev/null"), TDM_STATUS_IO);   /* not a regular file */
    cr_assert_eq(tdm_model_spec_parse(&s, "file:"), TDM_STATUS_INVALID_ARG);
    TU_OK(tdm_model_spec_parse(&s, "file:examples/models/resnet_small.tdm"));
    cr_assert_eq(s.n_classes, 10);
    char desc[128];
    tdm_model_spec_describe(&s, desc, sizeof desc);
    cr_assert_str_eq(desc, "file:resnet_small.tdm (1x28x28 -> 10)");
}
