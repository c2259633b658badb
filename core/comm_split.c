/* core/comm_split.c: tdm_comm_split, the backend-independent half of
 * MPI_Comm_split: every rank's (color, key) all-gathered over the parent,
 * the groups and the new ranks decided from them (key, then parent rank),
 * the job ranks carried over; then the backend makes the communicator
 * (tdm_comm_ops.split: shm/split.c, mpi/split.c, cuda/nccl_comm.c).
 * Not a backend, and it creates nothing itself. */
#include "core/comm_impl.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"

/* One rank's entry, as all-gathered. */
typedef struct tdm_split_entry {
    int32_t color, key;
} tdm_split_entry;

typedef struct tdm_split_sort {
    int32_t key;
    int rank;
} tdm_split_sort;

static int tdm_split_cmp(const void *a, const void *b)
{
    const tdm_split_sort *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return (x->rank > y->rank) - (x->rank < y->rank);
}

tdm_status tdm_comm_split(tdm_comm *comm, int color, int key, tdm_comm **out)
{
    return tdm_comm_split_ex(comm, color, key, NULL, out);
}

tdm_status tdm_comm_split_ex(tdm_comm *comm, int color, int key, const tdm_comm_split_opts *opts,
                             tdm_comm **out)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(comm && out, TDM_STATUS_INVALID_ARG, "comm split: communicator and out are required");
    *out = NULL;
    TDM_REQUIRE(color >= 0 || color == TDM_COMM_SPLIT_UNDEFINED, TDM_STATUS_INVALID_ARG,
                "comm split: color %d (expected >= 0, or TDM_COMM_SPLIT_UNDEFINED to take no "
                "part)", color);
    int size = tdm_comm_size(comm), me = tdm_comm_rank(comm);
    tdm_comm_split_opts o = {0};
    if (opts) o = *opts;
    tdm_split_entry *all = calloc((size_t)size, sizeof *all);
    tdm_split_sort *sorted = calloc((size_t)size, sizeof *sorted);
    int *members = calloc((size_t)size, sizeof *members);
    int *jobs = calloc((size_t)size, sizeof *jobs);
    if (!all || !sorted || !members || !jobs) {
        /* the others are about to wait for this rank in the all_gather */
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "comm split: cannot allocate the tables "
                           "of %d ranks", size);
        (void)tdm_comm_abort(comm, tdm_error_message());
        goto fail;
    }
    tdm_split_entry mine = {.color = color, .key = key};
    tdm_comm_set_label(comm, "comm split: colors and keys");
    /* host values: staged through a device-memory backend's own memory */
    TDM_TRY(tdm_comm_all_gather_host(comm, (const int32_t *)&mine, (int32_t *)all, 2));
    int n = 0, new_rank = -1;
    if (color != TDM_COMM_SPLIT_UNDEFINED) {
        for (int r = 0; r < size; r++)
            if (all[r].color == color) sorted[n++] = (tdm_split_sort){.key = all[r].key, .rank = r};
        qsort(sorted, (size_t)n, sizeof *sorted, tdm_split_cmp);
        for (int i = 0; i < n; i++) {
            members[i] = sorted[i].rank;
            jobs[i] = tdm_comm_job_rank(comm, sorted[i].rank);
            if (sorted[i].rank == me) new_rank = i;
        }
    }
    tdm_comm_split_info info = {.parent = comm, .color = color, .key = key, .rank = new_rank,
                                .size = n, .members = members, .job_ranks = jobs, .opts = &o,
                                .seq = tdm_comm_next_split(comm)};
    TDM_TRY(tdm_comm_backend_split(comm, &info, out));
    if (*out) {
        if (tdm_comm_size(*out) != n || tdm_comm_rank(*out) != new_rank) {
            st = tdm_error_set(TDM_STATUS_INTERNAL, "comm split: the %s backend made rank %d of "
                               "%d, expected rank %d of %d", tdm_comm_backend_name(comm),
                               tdm_comm_rank(*out), tdm_comm_size(*out), new_rank, n);
            goto fail;
        }
        TDM_TRY(tdm_comm_set_job_ranks(*out, jobs));
        tdm_comm_fr_set_group(*out, comm, info.seq, color);
        char was[48], now[48];
        TDM_INFO(CORE, "comm split #%d of %s: color %d key %d -> %s of %d", info.seq,
                 tdm_comm_rank_str(comm, me, was, sizeof was), color, key,
                 tdm_comm_rank_str(*out, new_rank, now, sizeof now), n);
    }
fail:
    if (st != TDM_STATUS_OK) {
        tdm_comm_free(*out);
        *out = NULL;
    }
    free(all);
    free(sorted);
    free(members);
    free(jobs);
    return st;
}
