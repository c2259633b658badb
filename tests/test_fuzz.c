/* tests/test_fuzz.c: random mutations (seeded: every run is the same) of a
 * valid checkpoint and of valid IDX files through the loaders. A loader
 * may refuse a file (with a message naming it, the model left as it was)
 * or load it; it must never crash (Criterion reports a signal), hang (the
 * timeout) or accept a ruined file. Which loads are right is decided by
 * reading the mutated bytes independently: a checkpoint load is right only
 * if the file is the same size and every loaded tensor equals the bytes at
 * its place in the file (a mutation that changed only metadata text,
 * whitespace or a finite value is a valid file); a plain IDX load only if
 * it equals an independent parse of the file; a gzip IDX load only if it
 * equals the original (a corrupted deflate stream that still inflates to a
 * different valid payload with a matching CRC is not a concern here). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "core/data.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tests/safety_util.h"
#include "tests/test_util.h"

#define FUZZ_ROUNDS 400

static char g_dir[64];
static tdm_device *g_dev;

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "fuzz");
    g_dev = tu_host();
}

static void teardown(void)
{
    tu_rmtree(g_dir);
    tdm_device_free(g_dev);
}

TestSuite(fuzz, .init = setup, .fini = teardown, .timeout = 60);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

typedef struct buf {
    unsigned char *p;
    size_t n, cap;
} buf;

static void put_file(const char *path, const buf *b)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    if (b->n) cr_assert_eq(fwrite(b->p, 1, b->n, f), b->n);
    cr_assert_eq(fclose(f), 0);
}

static buf get_file(const char *path)
{
    size_t n = 0;
    char *p = su_slurp(path, &n);
    cr_assert_not_null(p, "%s", path);
    buf b = {(unsigned char *)p, n, n + 1};
    return b;
}

static const unsigned char interesting[] = {0x00, 0xff, 0x7f, 0x80, '"', '{', '}', '[', ']',
                                            ',', ':', '0', '1', '9', '-', '.', ' ', 'e', '\\'};

/* Values that break float data and IDX dimensions. */
static const uint32_t special_f32[] = {0x7fc00000u, 0xffc00000u, 0x7f800000u, 0xff800000u,
                                       0x7f7fffffu, 0x00000001u};
static const uint32_t special_u32[] = {0, 1, 0x7fffffffu, 0xffffffffu, 1u << 28, (1u << 28) + 1,
                                       1u << 20, 0x10000, 21, 19};

/* One random mutation of b, mostly (70%) within its first `hot` bytes. */
static void mutate(tdm_rng *r, buf *b, size_t hot)
{
    if (b->n == 0) return;
    size_t span = tdm_rng_below(r, 10) < 7 && hot > 0 && hot <= b->n ? hot : b->n;
    size_t at = (size_t)tdm_rng_below(r, span);
    size_t at4 = at & ~(size_t)3;   /* floats and IDX words are 4-byte aligned */
    switch (tdm_rng_below(r, 9)) {
    case 7:                          /* NaN, infinities, extremes in place (native order) */
        if (at4 + 4 <= b->n) {
            uint32_t v = special_f32[tdm_rng_below(r, sizeof special_f32 / 4)];
            memcpy(b->p + at4, &v, 4);
        }
        break;
    case 8:                          /* absurd counts and sizes (big-endian, as IDX) */
        if (at4 + 4 <= b->n) {
            uint32_t v = special_u32[tdm_rng_below(r, sizeof special_u32 / 4)];
            for (int k = 0; k < 4; k++) b->p[at4 + k] = (unsigned char)(v >> (24 - 8 * k));
        }
        break;
    case 0: b->p[at] ^= (unsigned char)(1u << tdm_rng_below(r, 8)); break;
    case 1: b->p[at] = (unsigned char)tdm_rng_u32(r); break;
    case 2: b->p[at] = interesting[tdm_rng_below(r, sizeof interesting)]; break;
    case 3: b->n = at; break;                                   /* truncate */
    case 4: {                                                   /* insert 1..8 bytes */
        size_t k = 1 + (size_t)tdm_rng_below(r, 8);
        if (b->n + k > b->cap) {
            b->cap = b->n + k + 64;
            b->p = realloc(b->p, b->cap);
            cr_assert_not_null(b->p);
        }
        memmove(b->p + at + k, b->p + at, b->n - at);
        for (size_t i = 0; i < k; i++) b->p[at + i] = (unsigned char)tdm_rng_u32(r);
        b->n += k;
        break;
    }
    case 5: {                                                   /* delete 1..8 bytes */
        size_t k = 1 + (size_t)tdm_rng_below(r, 8);
        if (at + k > b->n) k = b->n - at;
        memmove(b->p + at, b->p + at + k, b->n - at - k);
        b->n -= k;
        break;
    }
    default: {                                                  /* copy a chunk over another */
        size_t from = (size_t)tdm_rng_below(r, b->n), k = 1 + (size_t)tdm_rng_below(r, 16);
        if (from + k > b->n) k = b->n - from;
        if (at + k > b->n) k = b->n - at;
        memmove(b->p + at, b->p + from, k);
        break;
    }
    }
}

static buf mutated_copy(tdm_rng *r, const buf *orig, size_t hot)
{
    buf b = {malloc(orig->n + 1), orig->n, orig->n + 1};
    cr_assert_not_null(b.p);
    memcpy(b.p, orig->p, orig->n);
    int k = 1 + (int)tdm_rng_below(r, 3);
    for (int i = 0; i < k; i++) mutate(r, &b, hot);
    return b;
}

/* ---- checkpoints ---------------------------------------------------------- */

typedef struct ckpt_ref {
    int64_t file_off[64];    /* each tensor's byte offset in the file, by table order */
    int n;
} ckpt_ref;

/* Where each tensor the loader fills lives in the valid file (params,
 * buffers, then optimizer state, in the model's table order): 8 + header
 * length + its begin offset, the tensor at the lowest address beginning
 * at 0 (the format leaves no gap). */
static void locate(const char *path, tdm_model *m, tdm_optim *o, uint64_t hlen, ckpt_ref *ref)
{
    tdm_st_file *f;
    TU_OK(tdm_st_load(&f, path));
    const unsigned char *base = NULL;
    for (int i = 0; i < tdm_st_count(f); i++) {
        const unsigned char *p = tdm_st_get(f, i)->data;
        if (!base || p < base) base = p;
    }
    ref->n = 0;
    for (int g = 0; g < 2 + tdm_optim_n_state(o); g++) {
        int cnt = g == 1 ? tdm_model_n_buffers(m) : tdm_model_n_params(m);
        for (int i = 0; i < cnt; i++) {
            const tdm_tensor_info *ti = g == 1 ? tdm_model_buffer_info(m, i)
                                               : tdm_model_param_info(m, i);
            char name[128];
            if (g >= 2)
                snprintf(name, sizeof name, "optim.%s.%s", tdm_optim_state_name(o, g - 2),
                         ti->name);
            else
                snprintf(name, sizeof name, "%s", ti->name);
            const tdm_st_tensor *t = tdm_st_find(f, name);
            cr_assert_not_null(t, "%s", name);
            cr_assert_lt(ref->n, 64);
            ref->file_off[ref->n++] = 8 + (int64_t)hlen + ((const unsigned char *)t->data - base);
        }
    }
    tdm_st_free(f);
}

static void snapshot(tdm_model *m, tdm_optim *o, float *dst)
{
    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    memcpy(dst, tdm_model_params(m), (size_t)pe * sizeof(float));
    if (be) memcpy(dst + pe, tdm_model_buffers(m), (size_t)be * sizeof(float));
    for (int s = 0; s < tdm_optim_n_state(o); s++)
        memcpy(dst + pe + be + s * pe, tdm_optim_state(o, s), (size_t)pe * sizeof(float));
}

Test(fuzz, checkpoint_mutations_are_refused_or_load_what_the_file_says)
{
    /* a CNN (it has buffers) with AdamW state after a few real steps */
    tdm_model_spec s;
    tdm_model_spec_cnn(&s);
    s.in_c = 1;
    s.in_h = 8;
    s.in_w = 8;
    s.ch1 = 2;
    s.ch2 = 3;
    s.n_classes = 4;
    tdm_model *m;
    tdm_optim *o;
    tdm_optim_opts oo;
    TU_OK(tdm_model_init(&m, g_dev, &s, 1));
    tdm_optim_opts_default(&oo, TDM_OPTIM_ADAMW);
    TU_OK(tdm_optim_init(&o, m, &oo));
    tdm_dataset d;
    TU_OK(tdm_data_synthetic(&d, 32, 1, 8, 8, 4, 3, 0));
    tdm_single single = {.model = m, .opt = o};
    tdm_epoch_stats es;
    TU_OK(tdm_train_epoch(&d, &(tdm_train_epoch_opts){.batch = 8, .seed = 1, .max_steps = 3,
                                                     .step = tdm_single_step,
                                                     .step_ctx = &single},
                          &es));
    tdm_single_free(&single);
    tdm_data_free(&d);
    const char *good = tpath("good.safetensors"), *bad = tpath("bad.safetensors");
    tdm_ckpt_info info0 = {.step = 3, .epoch = 1, .seed = 7};
    TU_OK(tdm_checkpoint_save(good, m, o, &info0));
    buf orig = get_file(good);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | orig.p[k];
    ckpt_ref ref;
    locate(good, m, o, hlen, &ref);

    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    int ns = tdm_optim_n_state(o);
    size_t total = (size_t)(pe + be + ns * pe);
    float *before = tu_malloc(total * sizeof(float)), *after = tu_malloc(total * sizeof(float));
    int loaded = 0, refused = 0;
    tdm_rng r = tu_rng(0xf022);
    for (int round = 0; round < FUZZ_ROUNDS; round++) {
        buf b = mutated_copy(&r, &orig, 8 + (size_t)hlen);
        put_file(bad, &b);
        snapshot(m, o, before);
        tdm_ckpt_info info = {0};
        tdm_error_clear();
        tdm_status st = tdm_checkpoint_load(bad, m, o, &info);
        snapshot(m, o, after);
        if (st != TDM_STATUS_OK) {
            refused++;
            cr_assert(strstr(tdm_error_message(), "bad.safetensors"),
                      "round %d: refusal does not name the file: '%s'", round, tdm_error_message());
            cr_assert(!memcmp(before, after, total * sizeof(float)),
                      "round %d: refused (%s) but the model was changed", round,
                      tdm_error_message());
        } else {
            loaded++;
            cr_assert_eq(b.n, orig.n, "round %d: a file of %zu bytes (valid: %zu) was loaded",
                         round, b.n, orig.n);
            /* every tensor the loader filled holds the file's bytes at its place */
            int64_t k = 0;
            for (int g = 0; g < 2 + ns; g++) {
                int cnt = g == 1 ? tdm_model_n_buffers(m) : tdm_model_n_params(m);
                for (int i = 0; i < cnt; i++, k++) {
                    const tdm_tensor_info *ti = g == 1 ? tdm_model_buffer_info(m, i)
                                                       : tdm_model_param_info(m, i);
                    int64_t at = g == 0 ? ti->offset : g == 1 ? pe + ti->offset
                                                              : pe + be + (g - 2) * pe + ti->offset;
                    cr_assert(!memcmp(after + at, b.p + ref.file_off[k],
                                      (size_t)ti->n_elem * sizeof(float)),
                              "round %d: tensor '%s' (group %d) loaded other values than the "
                              "file holds", round, ti->name, g);
                    for (int64_t e = 0; e < ti->n_elem; e++)
                        cr_assert(isfinite(after[at + e]), "round %d: non-finite value loaded",
                                  round);
                }
            }
            /* put the reference state back for the next round */
            TU_OK(tdm_checkpoint_load(good, m, o, NULL));
        }
        free(b.p);
    }
    cr_log_info("checkpoint fuzz: %d refused, %d loaded (valid mutations)", refused, loaded);
    cr_assert_gt(refused, FUZZ_ROUNDS / 2, "too few refusals (%d): are the mutations effective?",
                 refused);
    free(before);
    free(after);
    free(orig.p);
    tdm_optim_free(o);
    tdm_model_free(m);
}

/* ---- IDX files ------------------------------------------------------------ */

#define IDX_N 20
#define IDX_ROWS 5
#define IDX_COLS 4

static void put_u32be(buf *b, uint32_t v)
{
    for (int k = 3; k >= 0; k--) b->p[b->n++] = (unsigned char)(v >> (8 * k));
}

static buf idx_images(void)
{
    buf b = {malloc(16 + IDX_N * IDX_ROWS * IDX_COLS), 0, 16 + IDX_N * IDX_ROWS * IDX_COLS};
    put_u32be(&b, 0x803);
    put_u32be(&b, IDX_N);
    put_u32be(&b, IDX_ROWS);
    put_u32be(&b, IDX_COLS);
    for (int i = 0; i < IDX_N * IDX_ROWS * IDX_COLS; i++) b.p[b.n++] = (unsigned char)(i * 37);
    return b;
}

static buf idx_labels(void)
{
    buf b = {malloc(8 + IDX_N), 0, 8 + IDX_N};
    put_u32be(&b, 0x801);
    put_u32be(&b, IDX_N);
    for (int i = 0; i < IDX_N; i++) b.p[b.n++] = (unsigned char)(i % 10);
    return b;
}

static buf gzip_of(const buf *plain)
{
    uLong cap = compressBound((uLong)plain->n) + 64;
    buf out = {malloc(cap), 0, cap};
    z_stream z = {0};
    cr_assert_eq(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
    z.next_in = plain->p;
    z.avail_in = (uInt)plain->n;
    z.next_out = out.p;
    z.avail_out = (uInt)cap;
    cr_assert_eq(deflate(&z, Z_FINISH), Z_STREAM_END);
    out.n = cap - z.avail_out;
    deflateEnd(&z);
    return out;
}

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* What a correct reader makes of plain IDX bytes: 1 and the dataset's
 * fields when they form a valid image (or label) file, else 0. */
static int parse_plain(const buf *b, int images, uint32_t *n, uint32_t *rows, uint32_t *cols,
                       const unsigned char **payload)
{
    size_t hdr = images ? 16 : 8;
    if (b->n < hdr || be32(b->p) != (images ? 0x803u : 0x801u)) return 0;
    *n = be32(b->p + 4);
    *rows = images ? be32(b->p + 8) : 1;
    *cols = images ? be32(b->p + 12) : 1;
    if (!*n || !*rows || !*cols || *n > (1u << 28) || (uint64_t)*rows * *cols > (1u << 20))
        return 0;
    if ((uint64_t)*n * *rows * *cols != b->n - hdr) return 0;
    *payload = b->p + hdr;
    if (!images)
        for (uint32_t i = 0; i < *n; i++)
            if ((*payload)[i] >= 10) return 0;
    return 1;
}

static float norm_px(unsigned char p)
{
    return ((float)p / 255.0f - TDM_DATA_FMNIST_MEAN) / TDM_DATA_FMNIST_STD;
}

Test(fuzz, idx_mutations_are_refused_or_load_what_the_file_says)
{
    buf img = idx_images(), lbl = idx_labels();
    buf orig[2][2] = {{img, lbl}, {gzip_of(&img), gzip_of(&lbl)}};   /* [gz][labels] */
    tdm_rng r = tu_rng(0x1d8);
    int loaded = 0, refused = 0;
    for (int round = 0; round < FUZZ_ROUNDS; round++) {
        int gz = (int)tdm_rng_below(&r, 2), which = (int)tdm_rng_below(&r, 2);
        const char *paths[2] = {tpath(gz ? "img.gz" : "img"), tpath(gz ? "lbl.gz" : "lbl")};
        buf b = mutated_copy(&r, &orig[gz][which], gz ? 24 : which ? 8 : 16);
        put_file(paths[which], &b);
        put_file(paths[!which], &orig[gz][!which]);
        tdm_dataset d;
        tdm_error_clear();
        tdm_status st = tdm_data_load_idx(&d, paths[0], paths[1]);
        if (st != TDM_STATUS_OK) {
            refused++;
            cr_assert(strstr(tdm_error_message(), g_dir),
                      "round %d: refusal does not name a file: '%s'", round, tdm_error_message());
            cr_assert(d.x == NULL && d.n == 0);
        } else {
            loaded++;
            const buf *im = which == 0 && !gz ? &b : &orig[0][0];
            const buf *lb = which == 1 && !gz ? &b : &orig[0][1];
            uint32_t n, rows, cols, ln, l1, l2;
            const unsigned char *px, *ly;
            /* gzip: only the original content may load */
            cr_assert(parse_plain(im, 1, &n, &rows, &cols, &px) &&
                          parse_plain(lb, 0, &ln, &l1, &l2, &ly) && ln == n,
                      "round %d: loaded a file that is not valid IDX", round);
            cr_assert(d.n == n && d.h == (int)rows && d.w == (int)cols && d.c == 1,
                      "round %d: shape %lld x %dx%d, the file says %u x %ux%u", round,
                      (long long)d.n, d.h, d.w, n, rows, cols);
            for (size_t i = 0; i < (size_t)n * rows * cols; i++)
                cr_assert_eq(d.x[i], norm_px(px[i]), "round %d: pixel %zu", round, i);
            for (uint32_t i = 0; i < n; i++)
                cr_assert_eq(d.y[i], (int32_t)ly[i], "round %d: label %u", round, i);
            tdm_data_free(&d);
        }
        free(b.p);
    }
    cr_log_info("IDX fuzz: %d refused, %d loaded (valid mutations)", refused, loaded);
    cr_assert_gt(refused, FUZZ_ROUNDS / 2, "too few refusals (%d)", refused);
    for (int g = 0; g < 2; g++)
        for (int k = 0; k < 2; k++) free(orig[g][k].p);
}
