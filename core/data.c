/* core/data.c: IDX file reading (zlib, gzip or plain), the Fashion-MNIST
 * file layout, the synthetic dataset, and batch gathering; see
 * core/data.h. Not a shuffler or sharder: the training loop owns the
 * order of samples. */
#include "core/data.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "core/log.h"
#include "core/safefile.h"
#include "core/rng.h"

#define IDX_MAGIC_IMAGES 0x00000803u
#define IDX_MAGIC_LABELS 0x00000801u
#define IDX_DTYPE_U8 0x08
#define IDX_MAX_PIXELS (1u << 20)        /* rows * cols */
#define IDX_MAX_COUNT (1u << 28)         /* samples */
#define IDX_CHUNK_NBYTES (1u << 20)      /* gzread size while converting */
#define FMNIST_HINT "install the Debian package dataset-fashion-mnist, or pass --data synthetic"

int64_t tdm_data_features(const tdm_dataset *d)
{
    return (int64_t)d->c * d->h * d->w;
}

void tdm_data_free(tdm_dataset *d)
{
    if (!d) return;
    free(d->x);
    free(d->y);
    memset(d, 0, sizeof *d);
}

/* ---- IDX files ---------------------------------------------------------- */

typedef struct idx_file {
    const char *path;   /* borrowed */
    gzFile gz;
    uint32_t dims[3];
    int ndim;
    size_t header_nbytes;
    size_t payload_nbytes;  /* product of dims */
    size_t file_nbytes;     /* on disk (compressed or not) */
} idx_file;

static tdm_status idx_open(idx_file *f, const char *path)
{
    int fd;
    memset(f, 0, sizeof *f);
    f->path = path;
    TDM_CHECK(tdm_file_open_read(path, &fd, &f->file_nbytes));
    f->gz = gzdopen(fd, "rb");
    if (!f->gz) {
        close(fd);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: gzdopen failed (out of memory)",
                             path);
    }
    /* A large input buffer keeps inflate fed in big steps (60000 images in
     * well under a second). */
    gzbuffer(f->gz, 1u << 18);
    return TDM_STATUS_OK;
}

static void idx_close(idx_file *f)
{
    if (f->gz) gzclose(f->gz);
    f->gz = NULL;
}

/* Reads up to nbytes; *got says how many arrived (fewer at end of file).
 * Fails only on a read error or corrupt compressed data. */
static tdm_status idx_read(idx_file *f, void *dst, size_t nbytes, size_t *got)
{
    unsigned char *p = dst;
    *got = 0;
    while (*got < nbytes) {
        size_t want = nbytes - *got;
        int r = gzread(f->gz, p + *got, (unsigned)(want > (1u << 30) ? (1u << 30) : want));
        if (r < 0) {
            int errnum;
            const char *msg = gzerror(f->gz, &errnum);
            if (errnum == Z_ERRNO)
                return tdm_error_set(TDM_STATUS_IO, "%s: read failed: %s", f->path,
                                     strerror(errno));
            /* Z_BUF_ERROR is zlib's "unexpected end of file" in a
             * truncated gzip stream: let the caller report the count. */
            if (errnum == Z_BUF_ERROR) break;
            return tdm_error_set(TDM_STATUS_FORMAT, "%s: corrupt gzip data: %s", f->path, msg);
        }
        if (r == 0) break;
        *got += (size_t)r;
    }
    return TDM_STATUS_OK;
}

/* Reads and checks the magic and dimensions. kind: "image" or "label". */
static tdm_status idx_read_header(idx_file *f, uint32_t magic, const char *kind)
{
    unsigned char hdr[16];
    size_t got;
    int ndim = (int)(magic & 0xff);
    TDM_CHECK(idx_read(f, hdr, 4, &got));
    TDM_REQUIRE(got == 4, TDM_STATUS_FORMAT,
                "%s: truncated: %zu bytes, too short for an IDX header: not an IDX %s file",
                f->path, got, kind);
    uint32_t m = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
    /* IDX dtype codes: 0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32,
     * 0x0E f64. Anything else is not IDX at all; the others are IDX we do
     * not read. */
    int idx_dtype = hdr[2] == 0x08 || hdr[2] == 0x09 || (hdr[2] >= 0x0B && hdr[2] <= 0x0E);
    TDM_REQUIRE(hdr[0] == 0 && hdr[1] == 0 && idx_dtype, TDM_STATUS_FORMAT,
                "%s: bad magic 0x%08" PRIx32 " (expected 0x%08" PRIx32 "): not an IDX %s file",
                f->path, m, magic, kind);
    TDM_REQUIRE(hdr[2] == IDX_DTYPE_U8, TDM_STATUS_FORMAT,
                "%s: unsupported IDX dtype byte 0x%02x in magic 0x%08" PRIx32
                " (expected 0x08, unsigned byte)", f->path, hdr[2], m);
    TDM_REQUIRE(hdr[3] == ndim, TDM_STATUS_FORMAT,
                "%s: bad magic 0x%08" PRIx32 " (expected 0x%08" PRIx32 "): %d dimension(s), "
                "not an IDX %s file", f->path, m, magic, hdr[3], kind);
    TDM_CHECK(idx_read(f, hdr + 4, 4 * (size_t)ndim, &got));
    TDM_REQUIRE(got == 4 * (size_t)ndim, TDM_STATUS_FORMAT,
                "%s: truncated: IDX header needs %d bytes, got %zu", f->path, 4 + 4 * ndim,
                4 + got);
    f->ndim = ndim;
    f->header_nbytes = 4 + 4 * (size_t)ndim;
    for (int d = 0; d < ndim; d++) {
        const unsigned char *b = hdr + 4 + 4 * d;
        f->dims[d] = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
    }
    if (ndim == 3)
        TDM_REQUIRE(f->dims[0] && f->dims[1] && f->dims[2], TDM_STATUS_FORMAT,
                    "%s: zero dimension in %" PRIu32 " x %" PRIu32 " x %" PRIu32 " images",
                    f->path, f->dims[0], f->dims[1], f->dims[2]);
    else
        TDM_REQUIRE(f->dims[0], TDM_STATUS_FORMAT, "%s: zero dimension: 0 labels", f->path);
    TDM_REQUIRE(f->dims[0] <= IDX_MAX_COUNT, TDM_STATUS_FORMAT,
                "%s: %" PRIu32 " samples is more than the limit %u: corrupt header?", f->path,
                f->dims[0], IDX_MAX_COUNT);
    f->payload_nbytes = f->dims[0];
    if (ndim == 3) {
        uint64_t px = (uint64_t)f->dims[1] * f->dims[2];
        TDM_REQUIRE(px <= IDX_MAX_PIXELS, TDM_STATUS_FORMAT,
                    "%s: %" PRIu32 " x %" PRIu32 " images exceed the limit of %u pixels: "
                    "corrupt header?", f->path, f->dims[1], f->dims[2], IDX_MAX_PIXELS);
        f->payload_nbytes *= (size_t)px;
    }
    return TDM_STATUS_OK;
}

static tdm_status idx_truncated(const idx_file *f, const char *kind, size_t got)
{
    return tdm_error_set(TDM_STATUS_FORMAT,
                         "%s: truncated: expected %zu bytes of %s data after the %zu-byte "
                         "header, got %zu%s", f->path, f->payload_nbytes, kind,
                         f->header_nbytes, got, gzdirect(f->gz) ? "" : " (decompressed)");
}

/* Before allocating for what the header promises: a plain file must be
 * exactly that long, and a gzip file cannot inflate to more than 1032
 * times its size (deflate's limit), so a corrupt count is refused here
 * instead of after gigabytes are reserved for it. */
static tdm_status idx_check_size(const idx_file *f, const char *kind)
{
    size_t have = f->file_nbytes > f->header_nbytes ? f->file_nbytes - f->header_nbytes : 0;
    if (gzdirect(f->gz)) {
        if (have < f->payload_nbytes) return idx_truncated(f, kind, have);
        TDM_REQUIRE(have == f->payload_nbytes, TDM_STATUS_FORMAT,
                    "%s: trailing bytes after the expected %zu-byte header and %zu bytes of data",
                    f->path, f->header_nbytes, f->payload_nbytes);
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(f->payload_nbytes / 1032 <= f->file_nbytes, TDM_STATUS_FORMAT,
                "%s: the header promises %zu bytes of %s data, more than a %zu-byte gzip file "
                "can hold: truncated or corrupt", f->path, f->payload_nbytes, kind,
                f->file_nbytes);
    return TDM_STATUS_OK;
}

/* The payload must end exactly at end of file. */
static tdm_status idx_check_end(idx_file *f)
{
    unsigned char extra[64];
    size_t got;
    TDM_CHECK(idx_read(f, extra, sizeof extra, &got));
    TDM_REQUIRE(got == 0, TDM_STATUS_FORMAT,
                "%s: trailing bytes after the expected %zu-byte header and %zu bytes of data%s",
                f->path, f->header_nbytes, f->payload_nbytes,
                gzdirect(f->gz) ? "" : " (decompressed)");
    return TDM_STATUS_OK;
}

/* Reads the pixels in chunks and normalises them through a 256-entry
 * table, so the u8 payload never needs a buffer of its own. */
static tdm_status idx_read_images(idx_file *f, float *x)
{
    tdm_status st = TDM_STATUS_OK;
    float lut[256];
    unsigned char *chunk = malloc(IDX_CHUNK_NBYTES);
    size_t done = 0;
    if (!chunk) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", f->path);
    for (int v = 0; v < 256; v++)
        lut[v] = ((float)v / 255.0f - TDM_DATA_FMNIST_MEAN) / TDM_DATA_FMNIST_STD;
    while (done < f->payload_nbytes) {
        size_t want = f->payload_nbytes - done, got;
        if (want > IDX_CHUNK_NBYTES) want = IDX_CHUNK_NBYTES;
        TDM_TRY(idx_read(f, chunk, want, &got));
        for (size_t k = 0; k < got; k++) x[done + k] = lut[chunk[k]];
        done += got;
        if (got < want) {
            st = idx_truncated(f, "image", done);
            goto fail;
        }
    }
    free(chunk);
    return TDM_STATUS_OK;
fail:
    free(chunk);
    return st;
}

static tdm_status idx_read_labels(idx_file *f, int32_t *y)
{
    tdm_status st = TDM_STATUS_OK;
    size_t n = f->payload_nbytes, got;
    unsigned char *raw = malloc(n);
    if (!raw) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", f->path);
    TDM_TRY(idx_read(f, raw, n, &got));
    if (got < n) {
        st = idx_truncated(f, "label", got);
        goto fail;
    }
    for (size_t k = 0; k < n; k++) {
        if (raw[k] >= TDM_DATA_IDX_CLASSES) {
            st = tdm_error_set(TDM_STATUS_FORMAT,
                               "%s: label %d at index %zu is out of range [0, %d)", f->path,
                               raw[k], k, TDM_DATA_IDX_CLASSES);
            goto fail;
        }
        y[k] = raw[k];
    }
    free(raw);
    return TDM_STATUS_OK;
fail:
    free(raw);
    return st;
}

tdm_status tdm_data_load_idx(tdm_dataset *out, const char *images_path, const char *labels_path)
{
    tdm_status st = TDM_STATUS_OK;
    idx_file fi = { 0 }, fl = { 0 };
    tdm_dataset d = { 0 };
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(images_path && labels_path, TDM_STATUS_INVALID_ARG,
                "tdm_data_load_idx: NULL path");
    TDM_TRY(idx_open(&fi, images_path));
    TDM_TRY(idx_read_header(&fi, IDX_MAGIC_IMAGES, "image"));
    TDM_TRY(idx_open(&fl, labels_path));
    TDM_TRY(idx_read_header(&fl, IDX_MAGIC_LABELS, "label"));
    if (fi.dims[0] != fl.dims[0]) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s has %" PRIu32 " images but %s has %" PRIu32 " labels: "
                           "files from different sets?", images_path, fi.dims[0],
                           labels_path, fl.dims[0]);
        goto fail;
    }
    TDM_TRY(idx_check_size(&fi, "image"));
    TDM_TRY(idx_check_size(&fl, "label"));
    d.n = fi.dims[0];
    d.c = 1;
    d.h = (int)fi.dims[1];
    d.w = (int)fi.dims[2];
    d.n_classes = TDM_DATA_IDX_CLASSES;
    d.x = malloc(fi.payload_nbytes * sizeof *d.x);
    d.y = malloc((size_t)d.n * sizeof *d.y);
    if (!d.x || !d.y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %zu floats",
                           images_path, fi.payload_nbytes);
        goto fail;
    }
    TDM_TRY(idx_read_images(&fi, d.x));
    TDM_TRY(idx_check_end(&fi));
    TDM_TRY(idx_read_labels(&fl, d.y));
    TDM_TRY(idx_check_end(&fl));
    idx_close(&fi);
    idx_close(&fl);
    TDM_INFO(DATA, "loaded %s: %" PRId64 " images of %dx%d, labels from %s", images_path, d.n,
             d.h, d.w, labels_path);
    *out = d;
    return TDM_STATUS_OK;
fail:
    idx_close(&fi);
    idx_close(&fl);
    tdm_data_free(&d);
    return st;
}

/* "<dir>/<name>.gz" if it exists, else "<dir>/<name>" if it exists. */
static tdm_status fmnist_find(char *buf, size_t cap, const char *dir, const char *name)
{
    struct stat sb;
    int n = snprintf(buf, cap, "%s/%s.gz", dir, name);
    TDM_REQUIRE(n > 3 && (size_t)n < cap, TDM_STATUS_INVALID_ARG, "%s: path too long", dir);
    if (stat(buf, &sb) == 0) return TDM_STATUS_OK;
    buf[n - 3] = '\0';   /* drop ".gz" */
    if (stat(buf, &sb) == 0) return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_IO, "%s/%s.gz: %s (" FMNIST_HINT ")", dir, name,
                         strerror(ENOENT));
}

tdm_status tdm_data_load_fashion_mnist(tdm_dataset *out, const char *dir, int train)
{
    char img[4096], lbl[4096];
    memset(out, 0, sizeof *out);
    if (!dir) {
        dir = getenv("TANDEM_DATA_DIR");
        if (!dir || !*dir) dir = TDM_DATA_FMNIST_DEFAULT_DIR;
    }
    const char *split = train ? "train" : "t10k";
    char name[64];
    struct stat sb, lb;
    /* a FIFO, a device or a file where the directory should be: say so,
     * rather than that the IDX files inside it are missing */
    if (stat(dir, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return tdm_error_set(TDM_STATUS_IO, "%s: is %s%s, not a directory: give the directory "
                             "holding the IDX files (train-images-idx3-ubyte[.gz], ...)", dir,
                             lstat(dir, &lb) == 0 && S_ISLNK(lb.st_mode) ? "a symbolic link to "
                                                                         : "",
                             tdm_file_kind(sb.st_mode));
    snprintf(name, sizeof name, "%s-images-idx3-ubyte", split);
    TDM_CHECK(fmnist_find(img, sizeof img, dir, name));
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte", split);
    TDM_CHECK(fmnist_find(lbl, sizeof lbl, dir, name));
    return tdm_data_load_idx(out, img, lbl);
}

/* ---- synthetic data ----------------------------------------------------- */

/* Stream ids: TDM_RNG_STREAM_DATA plus a kind in bits 40.. and an index
 * below, far from every other module's ids. */
#define SYN_STREAM(kind, index) \
    ((uint64_t)TDM_RNG_STREAM_DATA + ((uint64_t)(kind) << 40) + (uint64_t)(index))
enum { SYN_KIND_PROTO = 1, SYN_KIND_SAMPLE = 2, SYN_KIND_LABELS = 4 };

#define SYN_SHIFT 2          /* max translation, pixels */
#define SYN_BLOBS 6          /* Gaussian blobs per prototype channel */
/* Signal and noise scales: per-pixel variance about SYN_AMP^2 + SYN_NOISE^2
 * = 1. The per-pixel signal is weak but spread over all pixels: with
 * 1x28x28 and 10 classes, softmax regression is ~55% accurate after one
 * SGD pass over 64 samples and plateaus near 97% (nearest class mean:
 * 97%), so learning curves are visible; a CNN, tolerant to the shifts,
 * does better. */
#define SYN_AMP 0.2f
#define SYN_NOISE 0.98f

/* Two independent standard normals (Box-Muller, both outputs used). */
static void syn_normal2(tdm_rng *r, float *a, float *b)
{
    float u1 = ((float)(tdm_rng_u32(r) >> 8) + 1.0f) * (1.0f / 16777216.0f);
    float u2 = (float)(tdm_rng_u32(r) >> 8) * (1.0f / 16777216.0f);
    float rad = sqrtf(-2.0f * logf(u1));
    float th = 6.2831853f * u2;
    *a = rad * cosf(th);
    *b = rad * sinf(th);
}

/* Prototypes on a grid padded by SYN_SHIFT on each side, (K, c, H, W)
 * with H = h + 2*SYN_SHIFT, W likewise; zero-mean unit-variance over each
 * class's unpadded window. */
static void syn_prototypes(float *proto, int n_classes, int c, int h, int w, uint64_t seed)
{
    const int H = h + 2 * SYN_SHIFT, W = w + 2 * SYN_SHIFT;
    tdm_rng r;
    tdm_rng_init(&r, seed, SYN_STREAM(SYN_KIND_PROTO, 0));
    for (int k = 0; k < n_classes; k++) {
        float *pk = proto + (size_t)k * c * H * W;
        for (int ch = 0; ch < c; ch++) {
            float *p = pk + (size_t)ch * H * W;
            memset(p, 0, (size_t)H * W * sizeof *p);
            for (int b = 0; b < SYN_BLOBS; b++) {
                float cy = tdm_rng_uniform(&r) * (float)h + SYN_SHIFT;
                float cx = tdm_rng_uniform(&r) * (float)w + SYN_SHIFT;
                float sy = (0.08f + 0.17f * tdm_rng_uniform(&r)) * (float)h + 0.5f;
                float sx = (0.08f + 0.17f * tdm_rng_uniform(&r)) * (float)w + 0.5f;
                float amp = tdm_rng_normal(&r);
                for (int y = 0; y < H; y++) {
                    float dy = ((float)y - cy) / sy;
                    for (int x = 0; x < W; x++) {
                        float dx = ((float)x - cx) / sx;
                        p[(size_t)y * W + x] += amp * expf(-0.5f * (dy * dy + dx * dx));
                    }
                }
            }
        }
        double sum = 0, sq = 0;
        for (int ch = 0; ch < c; ch++)
            for (int y = 0; y < h; y++)
                for (int x = 0; x < w; x++) {
                    double v = pk[((size_t)ch * H + y + SYN_SHIFT) * W + x + SYN_SHIFT];
                    sum += v;
                    sq += v * v;
                }
        double cnt = (double)c * h * w;
        double mean = sum / cnt, var = sq / cnt - mean * mean;
        float inv = var > 1e-12 ? (float)(1.0 / sqrt(var)) : 1.0f;
        for (size_t k2 = 0; k2 < (size_t)c * H * W; k2++)
            pk[k2] = (pk[k2] - (float)mean) * inv;
    }
}

tdm_status tdm_data_synthetic(tdm_dataset *out, int64_t n, int c, int h, int w,
                              int n_classes, uint64_t seed, int split)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_dataset d = { 0 };
    float *proto = NULL;
    int64_t *perm = NULL;
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(n >= 0 && n <= ((int64_t)1 << 32), TDM_STATUS_INVALID_ARG,
                "synthetic data: n = %" PRId64 " out of range [0, 2^32]", n);
    TDM_REQUIRE(c >= 1 && h >= 1 && w >= 1 && (int64_t)c * h * w <= (1 << 20),
                TDM_STATUS_INVALID_ARG,
                "synthetic data: shape %dx%dx%d invalid (each >= 1, product <= 2^20)", c, h, w);
    TDM_REQUIRE(n_classes >= 2 && n_classes <= 1024, TDM_STATUS_INVALID_ARG,
                "synthetic data: %d classes out of range [2, 1024]", n_classes);
    TDM_REQUIRE(split == 0 || split == 1, TDM_STATUS_INVALID_ARG,
                "synthetic data: split %d is neither 0 (train) nor 1 (test)", split);

    const int H = h + 2 * SYN_SHIFT, W = w + 2 * SYN_SHIFT;
    const size_t feat = (size_t)c * h * w;
    d.n = n;
    d.c = c;
    d.h = h;
    d.w = w;
    d.n_classes = n_classes;
    d.x = malloc((n ? (size_t)n : 1) * feat * sizeof *d.x);
    d.y = malloc((n ? (size_t)n : 1) * sizeof *d.y);
    proto = malloc((size_t)n_classes * c * H * W * sizeof *proto);
    perm = malloc((size_t)n_classes * sizeof *perm);
    if (!d.x || !d.y || !proto || !perm) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                           "synthetic data: cannot allocate %" PRId64 " samples of %zu floats",
                           n, feat);
        goto fail;
    }
    syn_prototypes(proto, n_classes, c, h, w, seed);

    for (int64_t i = 0; i < n; i++) {
        int64_t slot = i % n_classes;
        if (slot == 0 || i == 0) {
            /* Each block of n_classes samples holds every class once. */
            tdm_rng rl;
            tdm_rng_init(&rl, seed, SYN_STREAM(SYN_KIND_LABELS + split, i / n_classes));
            tdm_rng_permutation(&rl, perm, n_classes);
        }
        int32_t k = (int32_t)perm[slot];
        d.y[i] = k;

        tdm_rng r;
        tdm_rng_init(&r, seed, SYN_STREAM(SYN_KIND_SAMPLE + split, i));
        float amp = SYN_AMP * (0.75f + 0.5f * tdm_rng_uniform(&r));
        int sy = (int)tdm_rng_below(&r, 2 * SYN_SHIFT + 1);
        int sx = (int)tdm_rng_below(&r, 2 * SYN_SHIFT + 1);
        float *xi = d.x + (size_t)i * feat;
        const float *pk = proto + (size_t)k * c * H * W;
        for (int ch = 0; ch < c; ch++) {
            for (int y = 0; y < h; y++) {
                const float *src = pk + ((size_t)ch * H + y + sy) * W + sx;
                float *dst = xi + ((size_t)ch * h + y) * w;
                for (int x = 0; x < w; x++) dst[x] = amp * src[x];
            }
        }
        size_t j = 0;
        for (; j + 1 < feat; j += 2) {
            float a, b;
            syn_normal2(&r, &a, &b);
            xi[j] += SYN_NOISE * a;
            xi[j + 1] += SYN_NOISE * b;
        }
        if (j < feat) {
            float a, b;
            syn_normal2(&r, &a, &b);
            xi[j] += SYN_NOISE * a;
        }
    }
    TDM_INFO(DATA, "synthetic %s set: %" PRId64 " samples of %dx%dx%d, %d classes, seed %" PRIu64,
             split ? "test" : "train", n, c, h, w, n_classes, seed);
    free(proto);
    free(perm);
    *out = d;
    return TDM_STATUS_OK;
fail:
    free(proto);
    free(perm);
    tdm_data_free(&d);
    return st;
}

void tdm_data_gather(const tdm_dataset *d, const int64_t *idx, int64_t count, float *x,
                     int32_t *y)
{
    const size_t feat = (size_t)tdm_data_features(d);
    for (int64_t k = 0; k < count; k++) {
        int64_t i = idx[k];
        assert(i >= 0 && i < d->n);
        memcpy(x + (size_t)k * feat, d->x + (size_t)i * feat, feat * sizeof *x);
        if (y) y[k] = d->y[i];
    }
}
