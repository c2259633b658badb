/* dist/join.h: uneven inputs across ranks (PyTorch's Join context
 * manager), the part every design shares: before each training forward
 * the ranks count, in one int32 SUM, how many still have data and how
 * many of those synchronise in this forward's backward (not under
 * no_sync); the loss gradient is averaged over the ranks that train; and
 * a rank out of data answers the count with 0 and shadows the others'
 * steps until every rank has joined (the count is then 0 everywhere and
 * all leave together). What a shadowed step runs - DDP's zero all-reduce,
 * FSDP's gathers and zero reduce-scatters - is the design's (its shadow
 * function). */
#ifndef TDM_DIST_JOIN_H
#define TDM_DIST_JOIN_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "dist/batch.h"
#include "models/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_dist_join {
    int joined;      /* this rank has run out of data (inside tdm_dist_join_shadow) */
    int n_active;    /* ranks with data in the last training forward */
    int sync;        /* that forward's backward synchronises (else the ranks accumulate) */
} tdm_dist_join;

/* Every rank training, synchronising. */
void tdm_dist_join_init(tdm_dist_join *j, int world);

/* The count at a training forward, collective over comm (host memory):
 * this rank contributes 1 unless it has joined, and synchronises when
 * `sync` (the design's no_sync is off). The ranks that still train must
 * agree on synchronising (else INVALID_ARG on every rank alike). who
 * prefixes the messages ("ddp"); label names the collective for the
 * flight recorder ("ddp join count"). */
tdm_status tdm_dist_join_count(tdm_dist_join *j, tdm_comm *comm, int sync, const char *who,
                               const char *label);

/* The loss-gradient scale of a forward under join: by_active, the mean
 * over the ranks with data (1/(batch * n_active); 0 without samples);
 * else a scale meant for every rank (1/B_global), made the mean over the
 * ranks that contribute (scale * world / n_active). */
float tdm_dist_join_scale(const tdm_dist_join *j, int world, int batch, int by_active,
                          float scale);

/* How a design shadows the others' steps. fn runs one step of theirs as
 * a rank without samples: sync 1 a synchronised step (backward's
 * collectives with zero gradients, and the optimizer step), 0 a no_sync
 * micro-batch (only what its forward and backward issue). */
typedef struct tdm_dist_shadow {
    const char *who;             /* "ddp": the messages' prefix, tdm_<who>_... */
    const char *label;           /* the count's label ("ddp join count") */
    int enabled;                 /* the design was built with opts.join */
    int sync;                    /* its no_sync is off */
    tdm_dist_fwd *fwd;           /* its pending forward: the shadowed steps replace it */
    tdm_status (*fn)(void *w, tdm_optim *opt, int sync);
    void *w;                     /* the design's wrapper */
    tdm_optim *opt;              /* its optimizer (may be NULL where the design allows) */
} tdm_dist_shadow;

/* A rank out of data: joins, and shadows each step of the others (the
 * count, then s->fn) until every rank has joined; returns then, with
 * every rank counted as training again (a later epoch). INVALID_ARG when
 * the design was not built for join or is under no_sync. *shadowed (may
 * be NULL): the synchronised steps it shadowed. On failure the message
 * says "<who> join: rank R, after shadowing N step(s)"; aborting the
 * communicator is the design's. */
tdm_status tdm_dist_join_shadow(tdm_dist_join *j, tdm_comm *comm, int rank, int world,
                                const tdm_dist_shadow *s, int64_t *shadowed);

#ifdef __cplusplus
}
#endif

#endif
