/* tests/test_data.c: datasets (core/data.h): the real Fashion-MNIST files
 * (skipped when absent), crafted good and bad IDX files in a temporary
 * directory, the synthetic dataset's determinism, split and balance, and
 * batch gathering. Not a test of training on the data. */
#include <criterion/criterion.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "core/data.h"
#include "core/rng.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "data"); }
static void teardown(void) { tu_rmtree(g_dir); }

TestSuite(data, .init = setup, .fini = teardown);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

/* ---- crafting IDX files ------------------------------------------------- */

typedef struct bytes {
    unsigned char *p;
    size_t n;
} bytes;

static void put_u32be(bytes *b, uint32_t v)
{
    b->p[b->n++] = (unsigned char)(v >> 24);
    b->p[b->n++] = (unsigned char)(v >> 16);
    b->p[b->n++] = (unsigned char)(v >> 8);
    b->p[b->n++] = (unsigned char)v;
}

/* Pixel value of image i at (r, c): a deterministic pattern covering 0..255. */
static unsigned char pix(uint32_t i, uint32_t r, uint32_t c)
{
    return (unsigned char)((i * 37 + r * 11 + c * 5) & 0xff);
}

static bytes idx_images(uint32_t magic, uint32_t n, uint32_t rows, uint32_t cols)
{
    bytes b = { malloc(16 + (size_t)n * rows * cols + 64), 0 };
    put_u32be(&b, magic);
    put_u32be(&b, n);
    put_u32be(&b, rows);
    put_u32be(&b, cols);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t r = 0; r < rows; r++)
            for (uint32_t c = 0; c < cols; c++) b.p[b.n++] = pix(i, r, c);
    return b;
}

static bytes idx_labels(uint32_t magic, uint32_t n)
{
    bytes b = { malloc(8 + n + 64), 0 };
    put_u32be(&b, magic);
    put_u32be(&b, n);
    for (uint32_t i = 0; i < n; i++) b.p[b.n++] = (unsigned char)((i * 7) % 10);
    return b;
}

static void write_file(const char *path, const void *p, size_t n, int gz)
{
    if (gz) {
        gzFile f = gzopen(path, "wb");
        cr_assert_not_null(f);
        if (n) cr_assert_eq(gzwrite(f, p, (unsigned)n), (int)n);
        cr_assert_eq(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        cr_assert_not_null(f);
        cr_assert_eq(fwrite(p, 1, n, f), n);
        cr_assert_eq(fclose(f), 0);
    }
}

/* Writes the good pair: 5 images of 6x7 and their labels. */
enum { GN = 5, GR = 6, GC = 7 };
static void write_good(const char *img, const char *lbl, int gz)
{
    bytes bi = idx_images(0x803, GN, GR, GC), bl = idx_labels(0x801, GN);
    write_file(img, bi.p, bi.n, gz);
    write_file(lbl, bl.p, bl.n, gz);
    free(bi.p);
    free(bl.p);
}

/* Loads and expects failure with status st and every phrase in the message. */
static void expect_fail(const char *img, const char *lbl, tdm_status st, const char *p1,
                        const char *p2)
{
    tdm_dataset d;
    memset(&d, 0x5a, sizeof d);
    tdm_status got = tdm_data_load_idx(&d, img, lbl);
    const char *msg = tdm_error_message();
    cr_assert_eq(got, st, "status %s, expected %s: %s", tdm_status_name(got),
                 tdm_status_name(st), msg);
    cr_assert(strstr(msg, p1), "message lacks '%s': %s", p1, msg);
    if (p2) cr_assert(strstr(msg, p2), "message lacks '%s': %s", p2, msg);
    cr_assert_null(d.x, "failed load left x set");
    cr_assert_null(d.y);
    cr_assert_eq(d.n, 0);
}

static float norm_px(unsigned char p)
{
    return ((float)p / 255.0f - TDM_DATA_FMNIST_MEAN) / TDM_DATA_FMNIST_STD;
}

/* ---- real Fashion-MNIST ------------------------------------------------- */

static int have_fmnist(void)
{
    return access(TDM_DATA_FMNIST_DEFAULT_DIR "/train-images-idx3-ubyte.gz", R_OK) == 0 &&
           access(TDM_DATA_FMNIST_DEFAULT_DIR "/t10k-labels-idx1-ubyte.gz", R_OK) == 0;
}

static void check_fmnist(int train, int64_t n_expect)
{
    if (!have_fmnist())
        cr_skip_test("Fashion-MNIST not installed in " TDM_DATA_FMNIST_DEFAULT_DIR
                     " (Debian package dataset-fashion-mnist)");
    tdm_dataset d;
    unsetenv("TANDEM_DATA_DIR");
    cr_assert_eq(tdm_data_load_fashion_mnist(&d, NULL, train), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(d.n, n_expect);
    cr_assert_eq(d.c, 1);
    cr_assert_eq(d.h, 28);
    cr_assert_eq(d.w, 28);
    cr_assert_eq(d.n_classes, 10);
    cr_assert_eq(tdm_data_features(&d), 784);
    int64_t count[10] = { 0 };
    for (int64_t i = 0; i < d.n; i++) {
        cr_assert(d.y[i] >= 0 && d.y[i] < 10, "label %d at %ld", d.y[i], (long)i);
        count[d.y[i]]++;
    }
    /* Fashion-MNIST is exactly balanced. */
    for (int k = 0; k < 10; k++) cr_assert_eq(count[k], n_expect / 10, "class %d", k);
    double s = 0, s2 = 0;
    float lo = norm_px(0), hi = norm_px(255);
    int64_t N = d.n * 784;
    for (int64_t i = 0; i < N; i++) {
        cr_assert(d.x[i] >= lo - 1e-6f && d.x[i] <= hi + 1e-6f);
        s += d.x[i];
        s2 += (double)d.x[i] * d.x[i];
    }
    double mean = s / N, sd = sqrt(s2 / N - mean * mean);
    cr_assert(fabs(mean) < 0.02, "mean %f", mean);
    cr_assert(fabs(sd - 1.0) < 0.02, "std %f", sd);
    tdm_data_free(&d);
}

Test(data, fashion_mnist_train) { check_fmnist(1, 60000); }
Test(data, fashion_mnist_test) { check_fmnist(0, 10000); }

Test(data, fashion_mnist_missing_dir_names_file_and_package)
{
    tdm_dataset d;
    cr_assert_eq(tdm_data_load_fashion_mnist(&d, g_dir, 1), TDM_STATUS_IO);
    const char *msg = tdm_error_message();
    cr_assert(strstr(msg, "train-images-idx3-ubyte.gz: No such file or directory"), "%s", msg);
    cr_assert(strstr(msg, g_dir), "%s", msg);
    cr_assert(strstr(msg, "dataset-fashion-mnist"), "%s", msg);
    cr_assert(strstr(msg, "--data synthetic"), "%s", msg);
    cr_assert_null(d.x);
}

/* TANDEM_DATA_DIR is used when dir is NULL; plain files are found when
 * there is no .gz, and a mix of .gz and plain works. */
Test(data, fashion_mnist_env_dir_plain_and_gz)
{
    write_good(tpath("t10k-images-idx3-ubyte"), tpath("t10k-labels-idx1-ubyte.gz"), 0);
    /* The labels were written plain under a .gz name: zlib reads plain
     * data transparently, so this checks content sniffing too. */
    setenv("TANDEM_DATA_DIR", g_dir, 1);
    tdm_dataset d;
    cr_assert_eq(tdm_data_load_fashion_mnist(&d, NULL, 0), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(d.n, GN);
    cr_assert_eq(d.h, GR);
    cr_assert_eq(d.w, GC);
    tdm_data_free(&d);
    /* The train files are not there. */
    cr_assert_eq(tdm_data_load_fashion_mnist(&d, NULL, 1), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "train-images-idx3-ubyte"));
    unsetenv("TANDEM_DATA_DIR");
}

/* ---- crafted IDX files -------------------------------------------------- */

Test(data, idx_good_values_and_layout)
{
    for (int gz = 0; gz < 2; gz++) {
        const char *img = tpath(gz ? "i.gz" : "i"), *lbl = tpath(gz ? "l.gz" : "l");
        write_good(img, lbl, gz);
        tdm_dataset d;
        cr_assert_eq(tdm_data_load_idx(&d, img, lbl), TDM_STATUS_OK, "%s", tdm_error_message());
        cr_assert_eq(d.n, GN);
        cr_assert_eq(d.c, 1);
        cr_assert_eq(d.h, GR);
        cr_assert_eq(d.w, GC);
        cr_assert_eq(d.n_classes, 10);
        for (uint32_t i = 0; i < GN; i++) {
            cr_assert_eq(d.y[i], (int32_t)((i * 7) % 10));
            for (uint32_t r = 0; r < GR; r++)
                for (uint32_t c = 0; c < GC; c++)
                    cr_assert_float_eq(d.x[(i * GR + r) * GC + c], norm_px(pix(i, r, c)), 1e-6f);
        }
        tdm_data_free(&d);
        tdm_data_free(&d);   /* idempotent */
        cr_assert_null(d.x);
    }
    tdm_data_free(NULL);
    /* The extreme pixel values map as documented. */
    cr_assert_float_eq(norm_px(0), -0.2860f / 0.3530f, 1e-6f);
    cr_assert_float_eq(norm_px(255), (1.0f - 0.2860f) / 0.3530f, 1e-6f);
}

Test(data, idx_gz_and_plain_identical)
{
    write_good(tpath("i"), tpath("l"), 0);
    write_good(tpath("i.gz"), tpath("l.gz"), 1);
    /* Make sure the .gz really is compressed. */
    FILE *f = fopen(tpath("i.gz"), "rb");
    unsigned char m[2];
    cr_assert_eq(fread(m, 1, 2, f), 2u);
    fclose(f);
    cr_assert(m[0] == 0x1f && m[1] == 0x8b);
    tdm_dataset a, b;
    cr_assert_eq(tdm_data_load_idx(&a, tpath("i"), tpath("l")), TDM_STATUS_OK);
    cr_assert_eq(tdm_data_load_idx(&b, tpath("i.gz"), tpath("l.gz")), TDM_STATUS_OK);
    cr_assert_eq(a.n, b.n);
    cr_assert_eq(memcmp(a.x, b.x, (size_t)a.n * GR * GC * sizeof(float)), 0);
    cr_assert_eq(memcmp(a.y, b.y, (size_t)a.n * sizeof(int32_t)), 0);
    tdm_data_free(&a);
    tdm_data_free(&b);
}

Test(data, idx_missing_file)
{
    write_good(tpath("i"), tpath("l"), 0);
    expect_fail(tpath("nope"), tpath("l"), TDM_STATUS_IO, "nope: No such file or directory",
                NULL);
    expect_fail(tpath("i"), tpath("nope-labels"), TDM_STATUS_IO,
                "nope-labels: No such file or directory", NULL);
}

Test(data, idx_truncated_images)
{
    for (int gz = 0; gz < 2; gz++) {
        bytes bi = idx_images(0x803, GN, GR, GC), bl = idx_labels(0x801, GN);
        const char *img = tpath(gz ? "i.gz" : "i"), *lbl = tpath("l");
        write_file(img, bi.p, bi.n - 10, gz);
        write_file(lbl, bl.p, bl.n, 0);
        expect_fail(img, lbl, TDM_STATUS_FORMAT, "truncated: expected 210 bytes of image data",
                    "got 200");
        cr_assert(strstr(tdm_error_message(), img));
        free(bi.p);
        free(bl.p);
    }
}

/* A gzip stream cut in the middle (not a complete stream of short data). */
Test(data, idx_truncated_gzip_stream)
{
    bytes bi = idx_images(0x803, 200, 28, 28), bl = idx_labels(0x801, 200);
    write_file(tpath("i.gz"), bi.p, bi.n, 1);
    write_file(tpath("l"), bl.p, bl.n, 0);
    struct stat sb;
    cr_assert_eq(stat(tpath("i.gz"), &sb), 0);
    cr_assert_eq(truncate(tpath("i.gz"), sb.st_size / 2), 0);
    tdm_dataset d;
    tdm_status st = tdm_data_load_idx(&d, tpath("i.gz"), tpath("l"));
    cr_assert_eq(st, TDM_STATUS_FORMAT, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "truncated"), "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "expected 156800 bytes"), "%s", tdm_error_message());
    free(bi.p);
    free(bl.p);
}

Test(data, idx_truncated_labels)
{
    bytes bi = idx_images(0x803, GN, GR, GC), bl = idx_labels(0x801, GN);
    write_file(tpath("i"), bi.p, bi.n, 0);
    write_file(tpath("l.gz"), bl.p, bl.n - 2, 1);
    expect_fail(tpath("i"), tpath("l.gz"), TDM_STATUS_FORMAT,
                "truncated: expected 5 bytes of label data", "got 3 (decompressed)");
    /* Shorter than the header itself. */
    write_file(tpath("l.gz"), bl.p, 6, 1);
    expect_fail(tpath("i"), tpath("l.gz"), TDM_STATUS_FORMAT, "truncated", "IDX header");
    write_file(tpath("l.gz"), bl.p, 2, 0);
    expect_fail(tpath("i"), tpath("l.gz"), TDM_STATUS_FORMAT, "truncated", "not an IDX label");
    write_file(tpath("l.gz"), bl.p, 0, 0);
    expect_fail(tpath("i"), tpath("l.gz"), TDM_STATUS_FORMAT, "truncated", NULL);
    free(bi.p);
    free(bl.p);
}

Test(data, idx_wrong_magic)
{
    write_good(tpath("i"), tpath("l"), 0);
    bytes bad = idx_images(0x12340803, GN, GR, GC);
    write_file(tpath("bad"), bad.p, bad.n, 0);
    expect_fail(tpath("bad"), tpath("l"), TDM_STATUS_FORMAT,
                "bad: bad magic 0x12340803 (expected 0x00000803): not an IDX image file", NULL);
    /* All zero, as in the style guide's example. */
    memset(bad.p, 0, 4);
    write_file(tpath("bad"), bad.p, bad.n, 1);
    expect_fail(tpath("bad"), tpath("l"), TDM_STATUS_FORMAT,
                "bad magic 0x00000000 (expected 0x00000803)", NULL);
    free(bad.p);
    /* Images and labels swapped. */
    expect_fail(tpath("l"), tpath("i"), TDM_STATUS_FORMAT,
                "bad magic 0x00000801 (expected 0x00000803)", "not an IDX image file");
    bytes lab = idx_labels(0x803, GN);
    write_file(tpath("bad"), lab.p, lab.n, 0);
    expect_fail(tpath("i"), tpath("bad"), TDM_STATUS_FORMAT,
                "bad magic 0x00000803 (expected 0x00000801)", "not an IDX label file");
    free(lab.p);
}

Test(data, idx_wrong_dtype_byte)
{
    write_good(tpath("i"), tpath("l"), 0);
    bytes bad = idx_images(0x0d03, GN, GR, GC);   /* 0x0d: float */
    write_file(tpath("bad"), bad.p, bad.n, 0);
    expect_fail(tpath("bad"), tpath("l"), TDM_STATUS_FORMAT, "dtype byte 0x0d",
                "expected 0x08");
    free(bad.p);
    bytes badl = idx_labels(0x0c01, GN);
    write_file(tpath("bad"), badl.p, badl.n, 0);
    expect_fail(tpath("i"), tpath("bad"), TDM_STATUS_FORMAT, "dtype byte 0x0c", NULL);
    free(badl.p);
}

Test(data, idx_zero_and_absurd_dimensions)
{
    write_good(tpath("i"), tpath("l"), 0);
    const uint32_t dims[][3] = { { 0, GR, GC }, { GN, 0, GC }, { GN, GR, 0 } };
    for (int k = 0; k < 3; k++) {
        bytes b = idx_images(0x803, dims[k][0], dims[k][1], dims[k][2]);
        write_file(tpath("bad"), b.p, b.n, 0);
        expect_fail(tpath("bad"), tpath("l"), TDM_STATUS_FORMAT, "zero dimension", NULL);
        free(b.p);
    }
    bytes l0 = idx_labels(0x801, 0);
    write_file(tpath("bad"), l0.p, l0.n, 0);
    expect_fail(tpath("i"), tpath("bad"), TDM_STATUS_FORMAT, "zero dimension", NULL);
    free(l0.p);
    /* Headers only: the limits are checked before any allocation. */
    bytes h = { malloc(16), 0 };
    put_u32be(&h, 0x803);
    put_u32be(&h, 1);
    put_u32be(&h, 2048);
    put_u32be(&h, 2048);
    write_file(tpath("bad"), h.p, h.n, 0);
    expect_fail(tpath("bad"), tpath("l"), TDM_STATUS_FORMAT, "exceed the limit", NULL);
    h.n = 0;
    put_u32be(&h, 0x803);
    put_u32be(&h, 0xffffffffu);
    put_u32be(&h, 28);
    put_u32be(&h, 28);
    write_file(tpath("bad"), h.p, h.n, 0);
    expect_fail(tpath("bad"), tpath("l"), TDM_STATUS_FORMAT, "4294967295 samples", NULL);
    free(h.p);
}

Test(data, idx_mismatched_counts)
{
    bytes bi = idx_images(0x803, 4, GR, GC), bl = idx_labels(0x801, 5);
    write_file(tpath("i"), bi.p, bi.n, 0);
    write_file(tpath("l"), bl.p, bl.n, 0);
    expect_fail(tpath("i"), tpath("l"), TDM_STATUS_FORMAT, "i has 4 images but",
                "l has 5 labels");
    free(bi.p);
    free(bl.p);
}

Test(data, idx_trailing_bytes)
{
    for (int gz = 0; gz < 2; gz++) {
        bytes bi = idx_images(0x803, GN, GR, GC), bl = idx_labels(0x801, GN);
        const char *img = tpath(gz ? "i.gz" : "i"), *lbl = tpath(gz ? "l.gz" : "l");
        bi.p[bi.n++] = 0;   /* one extra byte */
        write_file(img, bi.p, bi.n, gz);
        write_file(lbl, bl.p, bl.n, gz);
        expect_fail(img, lbl, TDM_STATUS_FORMAT, "trailing bytes", img);
        bi.n--;
        write_file(img, bi.p, bi.n, gz);
        memcpy(bl.p + bl.n, "garbage", 7);
        write_file(lbl, bl.p, bl.n + 7, gz);
        expect_fail(img, lbl, TDM_STATUS_FORMAT, "trailing bytes", lbl);
        free(bi.p);
        free(bl.p);
    }
}

Test(data, idx_bad_label_value)
{
    bytes bi = idx_images(0x803, GN, GR, GC), bl = idx_labels(0x801, GN);
    bl.p[8 + 3] = 10;
    bl.p[8 + 4] = 200;
    write_file(tpath("i"), bi.p, bi.n, 0);
    write_file(tpath("l"), bl.p, bl.n, 1);
    expect_fail(tpath("i"), tpath("l"), TDM_STATUS_FORMAT, "label 10 at index 3",
                "out of range [0, 10)");
    free(bi.p);
    free(bl.p);
}

Test(data, idx_corrupt_gzip)
{
    bytes bi = idx_images(0x803, 50, 28, 28);
    write_file(tpath("i.gz"), bi.p, bi.n, 1);
    write_good(tpath("x"), tpath("l"), 0);
    /* Flip bytes in the middle of the deflate stream. */
    FILE *f = fopen(tpath("i.gz"), "r+b");
    fseek(f, 200, SEEK_SET);
    fwrite("\xff\xff\xff\xff\xff\xff\xff\xff", 1, 8, f);
    fclose(f);
    tdm_dataset d;
    tdm_status st = tdm_data_load_idx(&d, tpath("i.gz"), tpath("l"));
    cr_assert_eq(st, TDM_STATUS_FORMAT, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "i.gz"), "%s", tdm_error_message());
    free(bi.p);
}

/* ---- synthetic ---------------------------------------------------------- */

static size_t xbytes(const tdm_dataset *d, int64_t n)
{
    return (size_t)n * (size_t)tdm_data_features(d) * sizeof(float);
}

Test(data, synthetic_deterministic)
{
    tdm_dataset a, b, c;
    cr_assert_eq(tdm_data_synthetic(&a, 300, 1, 28, 28, 10, 7, 0), TDM_STATUS_OK);
    cr_assert_eq(tdm_data_synthetic(&b, 300, 1, 28, 28, 10, 7, 0), TDM_STATUS_OK);
    cr_assert_eq(tdm_data_synthetic(&c, 300, 1, 28, 28, 10, 8, 0), TDM_STATUS_OK);
    cr_assert_eq(a.n, 300);
    cr_assert_eq(a.c * a.h * a.w, 784);
    cr_assert_eq(a.n_classes, 10);
    cr_assert_eq(memcmp(a.x, b.x, xbytes(&a, 300)), 0);
    cr_assert_eq(memcmp(a.y, b.y, 300 * sizeof(int32_t)), 0);
    cr_assert_neq(memcmp(a.x, c.x, xbytes(&a, 300)), 0);
    cr_assert_neq(memcmp(a.y, c.y, 300 * sizeof(int32_t)), 0);
    for (int64_t i = 0; i < a.n * 784; i++) cr_assert(isfinite(a.x[i]));
    tdm_data_free(&a);
    tdm_data_free(&b);
    tdm_data_free(&c);
}

/* Sample i does not depend on how many samples were generated. */
Test(data, synthetic_prefix_stable)
{
    const int shapes[][3] = { { 1, 28, 28 }, { 3, 8, 5 }, { 2, 1, 1 } };
    for (int s = 0; s < 3; s++) {
        tdm_dataset a, b;
        const int *sh = shapes[s];
        for (int split = 0; split < 2; split++) {
            cr_assert_eq(tdm_data_synthetic(&a, 100, sh[0], sh[1], sh[2], 7, 3, split),
                         TDM_STATUS_OK);
            cr_assert_eq(tdm_data_synthetic(&b, 53, sh[0], sh[1], sh[2], 7, 3, split),
                         TDM_STATUS_OK);
            cr_assert_eq(memcmp(a.x, b.x, xbytes(&b, 53)), 0, "shape %d split %d", s, split);
            cr_assert_eq(memcmp(a.y, b.y, 53 * sizeof(int32_t)), 0);
            tdm_data_free(&a);
            tdm_data_free(&b);
        }
    }
}

Test(data, synthetic_split_disjoint_same_classes)
{
    tdm_dataset tr, te;
    cr_assert_eq(tdm_data_synthetic(&tr, 2000, 1, 28, 28, 10, 11, 0), TDM_STATUS_OK);
    cr_assert_eq(tdm_data_synthetic(&te, 1000, 1, 28, 28, 10, 11, 1), TDM_STATUS_OK);
    const int64_t F = 784;
    /* No test sample equals a train sample. */
    for (int64_t i = 0; i < 200; i++)
        for (int64_t j = 0; j < 200; j++)
            cr_assert_neq(memcmp(tr.x + i * F, te.x + j * F, F * sizeof(float)), 0);
    cr_assert_neq(memcmp(tr.y, te.y, 200 * sizeof(int32_t)), 0);
    /* Same classes: class means of the train split classify the test
     * split well (learnable), but not perfectly (not trivial). */
    double *mean = calloc(10 * F, sizeof *mean);
    int64_t cnt[10] = { 0 };
    for (int64_t i = 0; i < tr.n; i++) {
        cnt[tr.y[i]]++;
        for (int64_t j = 0; j < F; j++) mean[tr.y[i] * F + j] += tr.x[i * F + j];
    }
    for (int k = 0; k < 10; k++)
        for (int64_t j = 0; j < F; j++) mean[k * F + j] /= (double)cnt[k];
    int64_t ok = 0;
    for (int64_t i = 0; i < te.n; i++) {
        int best = -1;
        double bd = INFINITY;
        for (int k = 0; k < 10; k++) {
            double s = 0;
            for (int64_t j = 0; j < F; j++) {
                double d = te.x[i * F + j] - mean[k * F + j];
                s += d * d;
            }
            if (s < bd) { bd = s; best = k; }
        }
        ok += best == te.y[i];
    }
    double acc = (double)ok / (double)te.n;
    cr_assert(acc > 0.85 && acc < 0.995, "nearest-class-mean accuracy %.3f", acc);
    free(mean);
    tdm_data_free(&tr);
    tdm_data_free(&te);
}

Test(data, synthetic_labels_balanced_and_moments)
{
    const int ks[] = { 2, 3, 10, 17 };
    const int64_t ns[] = { 1000, 1005, 7 };
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 3; b++) {
            int K = ks[a];
            int64_t n = ns[b];
            tdm_dataset d;
            cr_assert_eq(tdm_data_synthetic(&d, n, 1, 6, 6, K, 5, b & 1), TDM_STATUS_OK);
            int64_t cnt[17] = { 0 };
            for (int64_t i = 0; i < n; i++) {
                cr_assert(d.y[i] >= 0 && d.y[i] < K, "label %d", d.y[i]);
                cnt[d.y[i]]++;
            }
            for (int k = 0; k < K; k++)
                cr_assert(cnt[k] == n / K || cnt[k] == n / K + 1, "K %d n %ld class %d: %ld",
                          K, (long)n, k, (long)cnt[k]);
            tdm_data_free(&d);
        }
    tdm_dataset d;
    cr_assert_eq(tdm_data_synthetic(&d, 2000, 1, 28, 28, 10, 1, 0), TDM_STATUS_OK);
    double s = 0, s2 = 0;
    int64_t N = d.n * 784;
    for (int64_t i = 0; i < N; i++) {
        s += d.x[i];
        s2 += (double)d.x[i] * d.x[i];
    }
    double mean = s / N, sd = sqrt(s2 / N - mean * mean);
    cr_assert(fabs(mean) < 0.05, "mean %f", mean);
    cr_assert(fabs(sd - 1) < 0.05, "std %f", sd);
    /* Labels are not simply i % K. */
    int64_t mod = 0;
    for (int64_t i = 0; i < d.n; i++) mod += d.y[i] == i % 10;
    cr_assert(mod < d.n / 2);
    tdm_data_free(&d);
}

Test(data, synthetic_invalid_args)
{
    tdm_dataset d;
    const struct { int64_t n; int c, h, w, k, split; } bad[] = {
        { -1, 1, 28, 28, 10, 0 }, { 10, 0, 28, 28, 10, 0 }, { 10, 1, 0, 28, 10, 0 },
        { 10, 1, 28, -3, 10, 0 }, { 10, 1, 28, 28, 1, 0 }, { 10, 1, 28, 28, 10, 2 },
        { 10, 1, 2048, 2048, 10, 0 },
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        memset(&d, 0x5a, sizeof d);
        cr_assert_eq(tdm_data_synthetic(&d, bad[k].n, bad[k].c, bad[k].h, bad[k].w, bad[k].k, 1,
                                        bad[k].split),
                     TDM_STATUS_INVALID_ARG, "case %zu", k);
        cr_assert(strstr(tdm_error_message(), "synthetic data"), "%s", tdm_error_message());
        cr_assert_null(d.x);
    }
    /* n = 0 is a valid, empty dataset. */
    cr_assert_eq(tdm_data_synthetic(&d, 0, 1, 4, 4, 3, 1, 0), TDM_STATUS_OK);
    cr_assert_eq(d.n, 0);
    tdm_data_free(&d);
}

Test(data, gather)
{
    tdm_dataset d;
    cr_assert_eq(tdm_data_synthetic(&d, 64, 2, 3, 4, 5, 9, 0), TDM_STATUS_OK);
    const int64_t F = tdm_data_features(&d);
    cr_assert_eq(F, 24);
    tdm_rng r;
    tdm_rng_init(&r, 1, TDM_RNG_STREAM_TEST);
    for (int64_t count = 0; count <= 70; count += 7) {
        int64_t *idx = malloc((size_t)(count + 1) * sizeof *idx);
        float *x = malloc((size_t)(count * F + 1) * sizeof *x);
        int32_t *y = malloc((size_t)(count + 1) * sizeof *y);
        for (int64_t k = 0; k < count; k++) idx[k] = (int64_t)tdm_rng_below(&r, 64);
        if (count) idx[0] = 63;   /* the last sample, duplicates likely */
        tdm_data_gather(&d, idx, count, x, y);
        for (int64_t k = 0; k < count; k++) {
            cr_assert_eq(memcmp(x + k * F, d.x + idx[k] * F, F * sizeof(float)), 0);
            cr_assert_eq(y[k], d.y[idx[k]]);
        }
        memset(x, 0, (size_t)(count * F) * sizeof *x);
        tdm_data_gather(&d, idx, count, x, NULL);   /* y optional */
        for (int64_t k = 0; k < count; k++)
            cr_assert_eq(memcmp(x + k * F, d.x + idx[k] * F, F * sizeof(float)), 0);
        free(idx);
        free(x);
        free(y);
    }
    tdm_data_free(&d);
}
