/* core/rng.c: Philox-4x32-10. Constants from Random123 (the SC'11 paper);
 * the Box-Muller transform for normals. Not cryptographic. */
#include "core/rng.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static void philox_block(const uint32_t key_in[2], uint64_t ctr, uint32_t out[4])
{
    uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = key_in[0], k1 = key_in[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

void tdm_rng_init(tdm_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t k = splitmix64(seed ^ splitmix64(stream + 0x5851F42D4C957F2Dull));
    r->key[0] = (uint32_t)k;
    r->key[1] = (uint32_t)(k >> 32);
    r->counter = 0;
    r->buf_left = 0;
}

uint32_t tdm_rng_u32(tdm_rng *r)
{
    if (r->buf_left == 0) {
        philox_block(r->key, r->counter++, r->buf);
        r->buf_left = 4;
    }
    return r->buf[4 - r->buf_left--];
}

uint64_t tdm_rng_u64(tdm_rng *r)
{
    uint64_t hi = tdm_rng_u32(r);
    return (hi << 32) | tdm_rng_u32(r);
}

float tdm_rng_uniform(tdm_rng *r)
{
    return (float)(tdm_rng_u32(r) >> 8) * (1.0f / 16777216.0f);
}

float tdm_rng_normal(tdm_rng *r)
{
    /* u1 in (0, 1] so log() is finite. */
    double u1 = ((double)(tdm_rng_u32(r) >> 8) + 1.0) / 16777216.0;
    double u2 = (double)(tdm_rng_u32(r) >> 8) / 16777216.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint64_t tdm_rng_below(tdm_rng *r, uint64_t n)
{
    /* Rejection: draw until the value falls below the largest multiple
     * of n, so every residue is equally likely. */
    uint64_t limit = UINT64_MAX - (UINT64_MAX % n);
    uint64_t x;
    do {
        x = tdm_rng_u64(r);
    } while (x >= limit);
    return x % n;
}

void tdm_rng_permutation(tdm_rng *r, int64_t *perm, int64_t n)
{
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)tdm_rng_below(r, (uint64_t)i + 1);
        int64_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}
