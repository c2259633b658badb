/* tests/test_dist_sampler.c: DistributedSampler against PyTorch's
 * documented semantics (torch.utils.data.distributed.DistributedSampler):
 * same permutation on every rank from (seed, epoch), strided shares,
 * padding from the start of the list or drop_last, set_epoch reshuffles. */
#include <criterion/criterion.h>

#include <stdlib.h>

#include "dist/sampler.h"
#include "models/train.h"

/* The reference, written the way PyTorch's __iter__ reads. */
static void reference(int64_t n, int rank, int world, int shuffle, uint64_t seed, int64_t epoch,
                      int drop_last, int64_t *out, int64_t *len)
{
    int64_t *ind = malloc((size_t)(n + 1) * sizeof *ind);
    if (shuffle) tdm_train_epoch_order(ind, n, seed, epoch);
    else for (int64_t i = 0; i < n; i++) ind[i] = i;
    int64_t num = (drop_last && n % world) ? n / world : (n + world - 1) / world;
    int64_t total = num * world;
    int64_t *full = malloc((size_t)(total + 1) * sizeof *full);
    int64_t k = 0;
    if (!drop_last) {
        for (int64_t i = 0; i < n; i++) full[k++] = ind[i];
        /* indices += (indices * ceil(pad / len(indices)))[:pad] */
        while (k < total) full[k] = full[k - n], k++;
    } else {
        for (int64_t i = 0; i < total; i++) full[k++] = ind[i];
    }
    int64_t j = 0;
    for (int64_t i = rank; i < total; i += world) out[j++] = full[i];
    *len = j;
    free(ind);
    free(full);
}

Test(dist_sampler, matches_reference_for_all_configs)
{
    int64_t ns[] = {1, 2, 3, 7, 10, 11, 64, 101};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (int world = 1; world <= 5; world++)
            for (int dl = 0; dl <= 1; dl++)
                for (int sh = 0; sh <= 1; sh++)
                    for (int rank = 0; rank < world; rank++) {
                        int64_t n = ns[a], got[256], want[256], wl;
                        tdm_dist_sampler s;
                        cr_assert_eq(tdm_dist_sampler_init(&s, n, rank, world, sh, 42, dl),
                                     TDM_STATUS_OK);
                        tdm_dist_sampler_set_epoch(&s, 3);
                        cr_assert_eq(tdm_dist_sampler_indices(&s, got), TDM_STATUS_OK);
                        reference(n, rank, world, sh, 42, 3, dl, want, &wl);
                        cr_assert_eq(tdm_dist_sampler_len(&s), wl, "n %lld world %d", (long long)n,
                                     world);
                        for (int64_t i = 0; i < wl; i++)
                            cr_assert_eq(got[i], want[i]);
                    }
}

Test(dist_sampler, documented_examples)
{
    /* n=10, world 4, no shuffle: padded with 0, 1 -> rank 1 gets 1, 5, 9 */
    tdm_dist_sampler s;
    int64_t got[8];
    tdm_dist_sampler_init(&s, 10, 1, 4, 0, 0, 0);
    cr_assert_eq(tdm_dist_sampler_len(&s), 3);
    tdm_dist_sampler_indices(&s, got);
    cr_assert(got[0] == 1 && got[1] == 5 && got[2] == 9);
    tdm_dist_sampler_init(&s, 10, 3, 4, 0, 0, 0);
    tdm_dist_sampler_indices(&s, got);
    cr_assert(got[0] == 3 && got[1] == 7 && got[2] == 1);   /* 11 -> padded index 1 */
    /* drop_last: 2 each, the tail 8, 9 dropped */
    tdm_dist_sampler_init(&s, 10, 0, 4, 0, 0, 1);
    cr_assert_eq(tdm_dist_sampler_len(&s), 2);
    tdm_dist_sampler_indices(&s, got);
    cr_assert(got[0] == 0 && got[1] == 4);
}

Test(dist_sampler, ranks_partition_and_epochs_reshuffle)
{
    int64_t n = 1000, seen[1000] = {0}, a[400], b[400];
    for (int r = 0; r < 4; r++) {
        tdm_dist_sampler s;
        tdm_dist_sampler_init(&s, n, r, 4, 1, 7, 0);
        tdm_dist_sampler_set_epoch(&s, 1);
        tdm_dist_sampler_indices(&s, a);
        for (int i = 0; i < 250; i++) seen[a[i]]++;
    }
    for (int i = 0; i < n; i++) cr_assert_eq(seen[i], 1);
    tdm_dist_sampler s;
    tdm_dist_sampler_init(&s, n, 0, 4, 1, 7, 0);
    tdm_dist_sampler_indices(&s, a);
    tdm_dist_sampler_set_epoch(&s, 1);
    tdm_dist_sampler_indices(&s, b);
    cr_assert(memcmp(a, b, 250 * sizeof a[0]) != 0);
    cr_assert_neq(tdm_dist_sampler_init(&s, 10, 4, 4, 0, 0, 0), TDM_STATUS_OK);
}
