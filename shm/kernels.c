/* shm/kernels.c: the arithmetic of the shm collectives: element-wise
 * reduction of N sources in rank order (so every rank and every algorithm
 * gets bitwise the same result), and a copy with non-temporal stores for
 * large one-pass copies.
 * Not the algorithms that decide what to reduce where (shm/coll.c).
 *
 * Integer SUM and PROD wrap (computed in the unsigned type: no undefined
 * overflow). Float MIN/MAX are `a < b ? a : b` / `a > b ? a : b`, which
 * compile to minps/maxps. */
#include "shm/shm_impl.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define TDM_SHM_HAVE_SSE2 1
#endif

/* Sources are combined block by block into a scratch buffer that stays in
 * L1, then stored to the destinations, so a destination may alias any
 * source and two destinations cost one pass. */
#define TDM_SHM_BLOCK_BYTES 8192

typedef void (*tdm_shm_binop_fn)(void *out, const void *a, const void *b, size_t n);

/* The element-wise ops are also built for AVX2 and picked at load time
 * where the CPU has it: each element is one IEEE operation (no FMA, no
 * reassociation), so both builds give the same bits. */
#ifdef __SANITIZE_THREAD__
/* target_clones' ifunc resolver runs during relocation, before the
 * ThreadSanitizer runtime is up, and crashes there: one version under TSan */
#define TDM_SHM_WIDE
#else
#define TDM_SHM_WIDE __attribute__((target_clones("avx2", "default")))
#endif

#define TDM_SHM_BINOP(NAME, T, EXPR)                                          \
    TDM_SHM_WIDE static void NAME(void *out_, const void *a_, const void *b_, size_t n) \
    {                                                                         \
        T *out = out_;                                                        \
        const T *pa = a_, *pb = b_;                                           \
        for (size_t i = 0; i < n; i++) {                                      \
            T a = pa[i], b = pb[i];                                           \
            out[i] = (EXPR);                                                  \
        }                                                                     \
    }

#define TDM_SHM_FLOAT_OPS(S, T)                                               \
    TDM_SHM_BINOP(tdm_shm_sum_##S, T, a + b)                                  \
    TDM_SHM_BINOP(tdm_shm_prod_##S, T, a * b)                                 \
    TDM_SHM_BINOP(tdm_shm_min_##S, T, a < b ? a : b)                          \
    TDM_SHM_BINOP(tdm_shm_max_##S, T, a > b ? a : b)

#define TDM_SHM_INT_OPS(S, T, U)                                              \
    TDM_SHM_BINOP(tdm_shm_sum_##S, T, (T)((U)a + (U)b))                       \
    TDM_SHM_BINOP(tdm_shm_prod_##S, T, (T)((U)a * (U)b))                      \
    TDM_SHM_BINOP(tdm_shm_min_##S, T, a < b ? a : b)                          \
    TDM_SHM_BINOP(tdm_shm_max_##S, T, a > b ? a : b)

TDM_SHM_FLOAT_OPS(f32, float)
TDM_SHM_FLOAT_OPS(f64, double)
TDM_SHM_INT_OPS(i32, int32_t, uint32_t)
TDM_SHM_INT_OPS(i64, int64_t, uint64_t)

#define TDM_SHM_ROW(S)                                                        \
    {[TDM_REDOP_SUM] = tdm_shm_sum_##S, [TDM_REDOP_PROD] = tdm_shm_prod_##S,  \
     [TDM_REDOP_MIN] = tdm_shm_min_##S, [TDM_REDOP_MAX] = tdm_shm_max_##S,    \
     [TDM_REDOP_AVG] = tdm_shm_sum_##S}

static const tdm_shm_binop_fn tdm_shm_binops[TDM_DTYPE_COUNT_][TDM_REDOP_COUNT_] = {
    [TDM_DTYPE_FLOAT32] = TDM_SHM_ROW(f32),
    [TDM_DTYPE_FLOAT64] = TDM_SHM_ROW(f64),
    [TDM_DTYPE_INT32] = TDM_SHM_ROW(i32),
    [TDM_DTYPE_INT64] = TDM_SHM_ROW(i64),
};

#define TDM_SHM_DIVIDE(T, D)                                                  \
    do {                                                                      \
        T *p_ = x;                                                            \
        for (size_t i = 0; i < n; i++) p_[i] = p_[i] / (D);                   \
    } while (0)

static void tdm_shm_divide(void *x, size_t n, tdm_dtype dt, int d)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32: TDM_SHM_DIVIDE(float, (float)d); break;
    case TDM_DTYPE_FLOAT64: TDM_SHM_DIVIDE(double, (double)d); break;
    case TDM_DTYPE_INT32: TDM_SHM_DIVIDE(int32_t, d); break;
    case TDM_DTYPE_INT64: TDM_SHM_DIVIDE(int64_t, d); break;
    default: break;
    }
}

static void tdm_shm_load16(float *out, const uint16_t *in, size_t n, int bf16)
{
    if (bf16)
        for (size_t i = 0; i < n; i++) out[i] = tdm_bf16_to_f32(in[i]);
    else
        for (size_t i = 0; i < n; i++) out[i] = tdm_f16_to_f32(in[i]);
}

static void tdm_shm_store16(uint16_t *out, const float *in, size_t n, int bf16)
{
    if (bf16)
        for (size_t i = 0; i < n; i++) out[i] = tdm_f32_to_bf16(in[i]);
    else
        for (size_t i = 0; i < n; i++) out[i] = tdm_f32_to_f16(in[i]);
}

/* bfloat16 / float16: sources are widened to float32, combined in rank
 * order in float32, and rounded once. */
static void tdm_shm_reduce16(void *dst0, void *dst1, const void *const *srcs, int nsrc,
                             size_t n, tdm_dtype dt, tdm_redop op)
{
    enum { BLK = TDM_SHM_BLOCK_BYTES / sizeof(float) };
    int bf16 = dt == TDM_DTYPE_BFLOAT16;
    tdm_shm_binop_fn f = tdm_shm_binops[TDM_DTYPE_FLOAT32][op];
    _Alignas(64) float acc[BLK], tmp[BLK];
    for (size_t off = 0; off < n; off += BLK) {
        size_t m = n - off < BLK ? n - off : BLK;
        tdm_shm_load16(acc, (const uint16_t *)srcs[0] + off, m, bf16);
        for (int j = 1; j < nsrc; j++) {
            tdm_shm_load16(tmp, (const uint16_t *)srcs[j] + off, m, bf16);
            f(acc, acc, tmp, m);
        }
        if (op == TDM_REDOP_AVG && nsrc > 1) tdm_shm_divide(acc, m, TDM_DTYPE_FLOAT32, nsrc);
        tdm_shm_store16((uint16_t *)dst0 + off, acc, m, bf16);
        if (dst1) memcpy((uint16_t *)dst1 + off, (uint16_t *)dst0 + off, m * 2);
    }
}

void tdm_shm_reduce_into(void *dst, const void *const *srcs, int nsrc, size_t n, tdm_dtype dt,
                         tdm_redop op)
{
    if (dt == TDM_DTYPE_BFLOAT16 || dt == TDM_DTYPE_FLOAT16 || nsrc < 2) {
        tdm_shm_reduce(dst, NULL, srcs, nsrc, n, dt, op);
        return;
    }
    /* dst overlaps no source: combine straight into it, in rank order,
     * with no scratch block (and no 8 KiB stack frame to set up). */
    tdm_shm_binop_fn f = tdm_shm_binops[dt][op];
    f(dst, srcs[0], srcs[1], n);
    for (int j = 2; j < nsrc; j++) f(dst, dst, srcs[j], n);
    if (op == TDM_REDOP_AVG) tdm_shm_divide(dst, n, dt, nsrc);
}

void tdm_shm_reduce(void *dst0, void *dst1, const void *const *srcs, int nsrc, size_t n,
                    tdm_dtype dt, tdm_redop op)
{
    if (dt == TDM_DTYPE_BFLOAT16 || dt == TDM_DTYPE_FLOAT16) {
        tdm_shm_reduce16(dst0, dst1, srcs, nsrc, n, dt, op);
        return;
    }
    size_t es = tdm_dtype_size(dt);
    tdm_shm_binop_fn f = tdm_shm_binops[dt][op];
    size_t blk = TDM_SHM_BLOCK_BYTES / es;
    _Alignas(64) unsigned char scratch[TDM_SHM_BLOCK_BYTES];
    for (size_t off = 0; off < n; off += blk) {
        size_t m = n - off < blk ? n - off : blk;
        size_t boff = off * es;
        if (nsrc == 1) {
            memcpy(scratch, (const unsigned char *)srcs[0] + boff, m * es);
        } else {
            f(scratch, (const unsigned char *)srcs[0] + boff,
              (const unsigned char *)srcs[1] + boff, m);
            for (int j = 2; j < nsrc; j++)
                f(scratch, scratch, (const unsigned char *)srcs[j] + boff, m);
        }
        if (op == TDM_REDOP_AVG && nsrc > 1) tdm_shm_divide(scratch, m, dt, nsrc);
        memcpy((unsigned char *)dst0 + boff, scratch, m * es);
        if (dst1) memcpy((unsigned char *)dst1 + boff, scratch, m * es);
    }
}

size_t tdm_shm_nt_threshold = (size_t)8 << 20;

void tdm_shm_copy_nt(void *dst, const void *src, size_t nbytes)
{
#ifdef TDM_SHM_HAVE_SSE2
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    /* The caller decides by message size (tdm_shm_nt_threshold); here only
     * copies too short for the aligned loop fall back (head > nbytes would
     * wrap nbytes - head). */
    if (nbytes < head + 64) {
        memcpy(dst, src, nbytes);
        return;
    }
    memcpy(d, s, head);
    d += head; s += head; nbytes -= head;
    size_t body = nbytes & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    /* Non-temporal stores are weakly ordered: fence before any flag
     * publication that must cover them. */
    _mm_sfence();
    memcpy(d + body, s + body, nbytes - body);
#else
    memcpy(dst, src, nbytes);
#endif
}
