/* dist/sampler.c: DistributedSampler (see dist/sampler.h). Mirrors
 * torch.utils.data.distributed.DistributedSampler.__iter__: permute (or
 * not), pad by repeating from the start (or truncate), take every
 * world-th index from rank. */
#include "dist/sampler.h"

#include <stdlib.h>

#include "models/train.h"

tdm_status tdm_dist_sampler_init(tdm_dist_sampler *s, int64_t n, int rank, int world, int shuffle,
                                uint64_t seed, int drop_last)
{
    TDM_REQUIRE(s && n >= 0 && world >= 1 && rank >= 0 && rank < world, TDM_STATUS_INVALID_ARG,
                "sampler: invalid rank %d of world %d (n = %lld)", rank, world, (long long)n);
    *s = (tdm_dist_sampler){.n = n, .rank = rank, .world = world, .shuffle = shuffle != 0,
                           .drop_last = drop_last != 0, .seed = seed};
    if (s->drop_last && n % world) s->num_samples = n / world;
    else s->num_samples = (n + world - 1) / world;
    s->total_size = s->num_samples * world;
    return TDM_STATUS_OK;
}

void tdm_dist_sampler_set_epoch(tdm_dist_sampler *s, int64_t epoch) { s->epoch = epoch; }
int64_t tdm_dist_sampler_len(const tdm_dist_sampler *s) { return s->num_samples; }

tdm_status tdm_dist_sampler_indices(const tdm_dist_sampler *s, int64_t *out)
{
    if (s->num_samples == 0) return TDM_STATUS_OK;
    int64_t *perm = malloc((size_t)s->n * sizeof *perm);
    TDM_REQUIRE(perm, TDM_STATUS_OUT_OF_MEMORY, "sampler: %lld indices", (long long)s->n);
    if (s->shuffle) tdm_train_epoch_order(perm, s->n, s->seed, s->epoch);
    else for (int64_t i = 0; i < s->n; i++) perm[i] = i;
    /* index k of the padded (or truncated) list is perm[k mod n] */
    for (int64_t j = 0; j < s->num_samples; j++)
        out[j] = perm[(s->rank + j * s->world) % s->n];
    free(perm);
    return TDM_STATUS_OK;
}
