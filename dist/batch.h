/* dist/batch.h: a rank's part of a global batch and its forward: the one
 * split every multi-process design uses (DDP's and the sharded modes'
 * forwards, their evaluations, a GPT rank drawing its own windows), the
 * local forward and loss around a staged batch (models/train.h's
 * tdm_train_stage, whose sample of zeros a rank without samples runs so
 * as to take part in collectives issued from inside the model's forward:
 * FSDP's gathers, a joined rank), and the record of the forward a
 * backward goes back through. Not a data loader: the rows come from the
 * caller (core/data.h, core/text.h). */
#ifndef TDM_DIST_BATCH_H
#define TDM_DIST_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/status.h"
#include "models/model.h"
#include "models/train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rank `rank`'s share of n items split over `world` ranks: [*lo, *hi)
 * with lo = rank * n / world and hi = (rank + 1) * n / world, contiguous,
 * in rank order, sizes differing by at most one (empty for some ranks
 * when n < world). The one split of a global batch (the rows a DDP or
 * FSDP rank runs; a rank that draws only its own rows, as a GPT's rank
 * draws its windows, asks for them here) and of a test set. */
void tdm_dist_share(int64_t n, int rank, int world, int64_t *lo, int64_t *hi);

/* This rank's rows of a global batch held on the host: x holds `batch`
 * samples of in_elems 4-byte values each (floats or token ids), y their
 * out_rows targets each; *xs, *ys point at the share's first sample and
 * *n is its size (0 for a rank whose share is empty). */
void tdm_dist_share_rows(const void *x, const int32_t *y, int batch, int rank, int world,
                         int64_t in_elems, int64_t out_rows, const void **xs,
                         const int32_t **ys, int *n);

/* The training forward a backward goes back through. A design runs one
 * forward, then its backward; an evaluation between them replaces the
 * model's activations, and the backward must then be refused rather than
 * run on the wrong ones. */
typedef enum tdm_dist_fwd_state {
    TDM_DIST_FWD_NONE = 0,       /* no forward to go back through */
    TDM_DIST_FWD_PENDING,        /* a forward awaits its backward */
    TDM_DIST_FWD_LOST,           /* its activations were replaced (lost says by what) */
} tdm_dist_fwd_state;

typedef struct tdm_dist_fwd {
    tdm_dist_fwd_state state;
    const char *lost;            /* LOST: what replaced it (a static string) */
    int batch;                   /* the pending forward's samples */
    double loss;                 /* its loss sum, counted once its backward runs */
    uint64_t count;              /* training forwards run (the end-of-step check's) */
} tdm_dist_fwd;

/* A forward begins: whatever was pending is gone. */
void tdm_dist_fwd_begin(tdm_dist_fwd *f);
/* It ended: batch samples, their loss sum; train counts it. */
void tdm_dist_fwd_done(tdm_dist_fwd *f, int batch, double loss, int train);
/* Something else ran forwards on the model (an evaluation): a pending
 * forward is LOST, by what. */
void tdm_dist_fwd_lose(tdm_dist_fwd *f, const char *what);
/* A backward takes the pending forward (then NONE); INVALID_ARG naming
 * what replaced it, or that none ran ("<who> backward: no forward before
 * it; call tdm_<who>_forward first"). *loss: its loss sum. */
tdm_status tdm_dist_fwd_take(tdm_dist_fwd *f, const char *who, double *loss);

/* A forward over B samples at xd (device) writing *logits: the model's
 * own (NULL), or a design's wrapper around it (FSDP's, which gathers
 * units through the model's hooks). */
typedef tdm_status (*tdm_dist_forward_fn)(void *ctx, const void *xd, int B, const float **logits);

/* The local forward and loss of a training step, as every design runs
 * it: the B samples at xd, yd (already staged) through fwd (NULL: the
 * model's forward), then the loss and its gradient, scaled by grad_scale,
 * into s->dlogits. *loss_sum: the sum of the B per-sample losses;
 * *t_forward_end: when the forward ended (tdm_time_ns), which splits the
 * step's FORWARD and LOSS phases. */
tdm_status tdm_dist_forward_loss(tdm_train_stage *s, tdm_model *m, tdm_dist_forward_fn fwd,
                                 void *fwd_ctx, const void *xd, const int32_t *yd, int B,
                                 float grad_scale, double *loss_sum, uint64_t *t_forward_end);

#ifdef __cplusplus
}
#endif

#endif
