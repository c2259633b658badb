/* dist/sampler.h: DistributedSampler with torch.utils.data's semantics.
 * Every rank draws the same permutation from (seed, epoch) (the one
 * tdm_train_epoch_order gives, so a single-device run visits the same
 * order), then:
 * - drop_last = 0: pads the list by repeating it from its start until its
 *   length divides by the world size (num_samples = ceil(n / world));
 * - drop_last = 1: drops the tail so that it does (num_samples =
 *   floor(n / world));
 * and rank r takes indices[r], indices[r + world], ... (a strided share).
 * Not a data loader: it only yields indices for tdm_data_gather. */
#ifndef TDM_DIST_SAMPLER_H
#define TDM_DIST_SAMPLER_H

#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_dist_sampler {
    int64_t n;            /* dataset size */
    int rank, world;
    int shuffle, drop_last;
    uint64_t seed;
    int64_t epoch;
    int64_t num_samples;  /* per rank */
    int64_t total_size;   /* num_samples * world */
} tdm_dist_sampler;

tdm_status tdm_dist_sampler_init(tdm_dist_sampler *s, int64_t n, int rank, int world, int shuffle,
                                uint64_t seed, int drop_last);
/* Call before each epoch, as with PyTorch's set_epoch. */
void tdm_dist_sampler_set_epoch(tdm_dist_sampler *s, int64_t epoch);
int64_t tdm_dist_sampler_len(const tdm_dist_sampler *s);
/* Writes this rank's num_samples indices for the current epoch. */
tdm_status tdm_dist_sampler_indices(const tdm_dist_sampler *s, int64_t *out);

#ifdef __cplusplus
}
#endif

#endif
