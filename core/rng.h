/* core/rng.h: a deterministic, counter-based random number generator.
 *
 * A stream is named by (seed, stream id); its values depend on nothing
 * else, in particular not on how many threads or devices consume them, so
 * parameter initialisation and data shuffling are identical under one
 * device, DP and DDP. The generator is Philox-4x32-10 (Salmon et al., "Parallel
 * random numbers: as easy as 1, 2, 3", SC'11): value i of a stream is a pure
 * function of (key, i), which also makes skipping ahead free. */
#ifndef TDM_CORE_RNG_H
#define TDM_CORE_RNG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_rng {
    uint32_t key[2];
    uint64_t counter;   /* index of the next 128-bit block */
    uint32_t buf[4];
    int buf_left;       /* unused 32-bit words in buf */
} tdm_rng;

void tdm_rng_init(tdm_rng *r, uint64_t seed, uint64_t stream);
uint32_t tdm_rng_u32(tdm_rng *r);
uint64_t tdm_rng_u64(tdm_rng *r);
/* Uniform in [0, 1) with 24 random bits (exactly representable). */
float tdm_rng_uniform(tdm_rng *r);
/* Standard normal (Box-Muller on two uniforms). */
float tdm_rng_normal(tdm_rng *r);
/* Uniform integer in [0, n), without modulo bias. n > 0. */
uint64_t tdm_rng_below(tdm_rng *r, uint64_t n);
/* Fisher-Yates permutation of 0..n-1 into perm. */
void tdm_rng_permutation(tdm_rng *r, int64_t *perm, int64_t n);

/* Well-known stream ids, so modules do not collide. */
enum {
    TDM_RNG_STREAM_INIT = 1,      /* + parameter index */
    TDM_RNG_STREAM_SHUFFLE = 1u << 20,  /* + epoch */
    TDM_RNG_STREAM_DATA = 1u << 21,     /* synthetic dataset */
    TDM_RNG_STREAM_TEST = 1u << 22,
    TDM_RNG_STREAM_SAMPLE = 1u << 23,   /* text generation */
    TDM_RNG_STREAM_TEXT = 1u << 24,     /* + (step << 32) + window: text windows */
};

#ifdef __cplusplus
}
#endif

#endif
