/* dist/join.c: uneven inputs across ranks (see dist/join.h). */
#include "dist/join.h"

void tdm_dist_join_init(tdm_dist_join *j, int world)
{
    *j = (tdm_dist_join){.n_active = world, .sync = 1};
}

tdm_status tdm_dist_join_count(tdm_dist_join *j, tdm_comm *comm, int sync, const char *who,
                               const char *label)
{
    int32_t v[2] = {j->joined ? 0 : 1, !j->joined && sync};
    /* named, as every design collective: a rank that waits here while a
     * peer never comes (a joined rank shadowing one that died) is found
     * by `tandem doctor` in the join count, not in an anonymous all_reduce */
    tdm_comm_set_label(comm, "%s", label);
    tdm_status st = tdm_comm_all_reduce(comm, v, v, 2, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    if (st) return tdm_error_prefix(st, "%s join: counting the ranks that still have data", who);
    /* every rank sees the same sums, so every rank fails here alike */
    TDM_REQUIRE(v[1] == 0 || v[1] == v[0], TDM_STATUS_INVALID_ARG,
                "%s join: %d of the %d ranks still training synchronise in this forward and "
                "the others are under no_sync; call tdm_%s_no_sync alike on every rank, "
                "before the forward", who, v[1], v[0], who);
    j->n_active = v[0];
    j->sync = v[1] > 0;
    return TDM_STATUS_OK;
}

float tdm_dist_join_scale(const tdm_dist_join *j, int world, int batch, int by_active,
                          float scale)
{
    if (by_active) return batch > 0 ? 1.0f / ((float)batch * (float)j->n_active) : 0.0f;
    if (j->n_active > 0 && j->n_active != world)
        return scale * ((float)world / (float)j->n_active);
    return scale;
}

tdm_status tdm_dist_join_shadow(tdm_dist_join *j, tdm_comm *comm, int rank, int world,
                                const tdm_dist_shadow *s, int64_t *shadowed)
{
    const char *who = s->who;
    TDM_REQUIRE(s->enabled, TDM_STATUS_INVALID_ARG,
                "%s join: construct the tdm_%s with opts.join = 1 (every rank counts the ranks "
                "with data at each forward)", who, who);
    TDM_REQUIRE(s->sync, TDM_STATUS_INVALID_ARG,
                "%s join: called under no_sync; finish the accumulation first", who);
    int64_t n = 0;
    if (shadowed) *shadowed = 0;
    if (world == 1) return TDM_STATUS_OK;
    tdm_dist_fwd_begin(s->fwd);   /* the shadowed steps' forwards replace it */
    j->joined = 1;
    tdm_status st = TDM_STATUS_OK;
    for (;;) {
        if ((st = tdm_dist_join_count(j, comm, 0, who, s->label))) break;
        if (j->n_active == 0) break;   /* every rank has joined: all leave here */
        int sync = j->sync;
        if ((st = s->fn(s->w, s->opt, sync))) break;
        if (sync) n++;
    }
    /* a later epoch starts with every rank training again */
    tdm_dist_join_init(j, world);
    if (shadowed) *shadowed = n;
    if (st) tdm_error_prefix(st, "%s join: rank %d, after shadowing %lld step(s)", who, rank,
                             (long long)n);
    return st;
}
