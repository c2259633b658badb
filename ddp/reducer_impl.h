/* ddp/reducer_impl.h: DDP's Reducer, internal to ddp/ (ddp/ddp.c drives
 * it; nothing outside ddp/ includes this header). The Reducer owns the
 * gradient storage and the bucket plan over it; it verifies at
 * construction that every rank has the same model and plan, re-plans the
 * buckets after the first synchronised backward, and during a
 * synchronised backward launches each bucket's all-reduce from the
 * model's grad-ready hook as soon as the bucket is complete, waits for
 * them at the end and reads the check tail. It does not run the model's
 * forward or backward, stage inputs or step the optimizer (ddp/ddp.c).
 *
 * One synchronised backward, as ddp.c calls it:
 *   tdm_ddp_reducer_begin   rebuild the plan if one is due (a collective),
 *                           start the clock, write this rank's check tail
 *   model backward          with in_backward = 1: the hook marks
 *                           parameters ready and launches complete buckets
 *   tdm_ddp_reducer_end     parameters that took no part, the rest of the
 *                           launches, the wait (drain + finish), the tail
 *
 * Check tail: the gradient storage holds TDM_DDP_TAIL_ELEMS floats after
 * the parameters, inside the bucket of the last parameter. At each
 * synchronised backward rank r writes the number of training forwards it
 * has run (that backward's forward included) into slot r and zero
 * elsewhere, and its loss sum split in two floats (hi + lo: ~48 bits,
 * exact through a SUM where the other ranks contribute zeros); after the
 * SUM every slot holds its rank's values, so a rank that skipped a
 * backward (or ran an extra step) is named at the end of that same
 * backward instead of silently averaging gradients of different steps,
 * and every rank gets the global loss sum without a collective of its
 * own. */
#ifndef TDM_DDP_REDUCER_IMPL_H
#define TDM_DDP_REDUCER_IMPL_H

#include <stdint.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/status.h"
#include "ddp/ddp.h"
#include "ddp/hooks.h"
#include "dist/timeout.h"
#include "models/model.h"

#define TDM_DDP_MAX_RANKS 64
/* The check tail after the parameters: per-rank slots of the forward
 * count, then of the loss sum's high and low floats. */
#define TDM_DDP_TAIL_SEQ 0
#define TDM_DDP_TAIL_LOSS_HI TDM_DDP_MAX_RANKS
#define TDM_DDP_TAIL_LOSS_LO (2 * TDM_DDP_MAX_RANKS)
#define TDM_DDP_TAIL_ELEMS (3 * TDM_DDP_MAX_RANKS)
#define TDM_DDP_SEQ_MOD (1u << 23)  /* counts stay exact in float32 */

typedef struct tdm_ddp_bucket {
    int first, last;             /* parameter indices, first <= last */
    int64_t offset, n_elem;      /* view of the gradient buffer */
    int pending;                 /* parameters not yet ready this backward */
    int done;
    int launched;                /* this backward */
    tdm_comm_work *work;         /* the all-reduce (with a comm hook: the check tail's) */
} tdm_ddp_bucket;

typedef struct tdm_ddp_reducer {
    tdm_model *m;                /* borrowed */
    tdm_comm *comm;              /* borrowed: the gradients' all-reduces */
    tdm_comm *hcomm;             /* borrowed: host-memory collectives (plan checks) */
    tdm_device *dev;             /* borrowed: the model's */
    tdm_ddp_opts o;              /* bucket caps, overlap, find_unused_parameters, timeout */
    int rank, world, n_params;
    int64_t param_elems;
    float *grads;                /* param_elems + TDM_DDP_TAIL_ELEMS floats */
    int zero_copy;               /* grads from tdm_comm_alloc (else dev alloc, owned) */
    int adopted;                 /* grads tdm_dev_mem_adopt'ed by dev: disown them */
    int attached;                /* the model's gradients live in grads, the hook is ours */
    int nb;
    tdm_ddp_bucket *b;
    tdm_ddp_bucket_times *bt;
    int *param_bucket;
    int *order, n_order;         /* parameters in the order they became ready (recording) */
    int *group;                  /* scratch of the planner */
    int record_order;            /* 1: record the ready order in the next synchronised backward */
    int rebuild_pending;         /* 1: re-plan from `order` at the next synchronised backward */
    unsigned char *ready;
    int next_launch;
    /* 1 while the model's backward of a synchronised backward runs: the
     * hook acts only then, and a bucket launched then counts as overlapped */
    int in_backward;
    uint64_t t0;                 /* start of the current synchronised backward */
    uint64_t sync_count;         /* synchronised backwards completed */
    tdm_status hook_st;
    char hook_msg[512];
    double overlapped_bytes;     /* since init: launched while backward still computed */
    double reduced_bytes;        /* since init: all-reduced (padding and check tail included) */
    /* The communication hook (ddp/hooks.h); .launch NULL: the Reducer's
     * own float32 all-reduce of each bucket, check tail included. */
    tdm_ddp_comm_hook hook;
    int own_hook;                /* 1: hook.free(hook.state) when the Reducer is freed */
    tdm_ddp_hook_bucket *hb;     /* per bucket, from launch to wait */
} tdm_ddp_reducer;

/* Plans the buckets, allocates the gradient storage (communicator memory
 * when it has room: zero-copy) and checks that every rank has the same
 * model layout and plan (collective over hcomm, naming the rank and
 * tensor that differ). r is zeroed first; on failure
 * tdm_ddp_reducer_free undoes what was done. */
tdm_status tdm_ddp_reducer_init(tdm_ddp_reducer *r, tdm_model *m, tdm_comm *comm,
                                tdm_comm *hcomm, const tdm_ddp_opts *opts);
/* Backs the model's gradients with the storage and installs the
 * grad-ready hook (after the parameters have been broadcast). */
tdm_status tdm_ddp_reducer_attach(tdm_ddp_reducer *r);
/* Waits (TDM_DIST_DRAIN_TIMEOUT_MS at most each) for buckets still in
 * flight, gives the model back its own gradient storage (copying the
 * gradients), removes the hook and frees the storage. */
void tdm_ddp_reducer_free(tdm_ddp_reducer *r);

/* Start of a synchronised backward: rebuilds the plan when the first one
 * has recorded the ready order (a collective check, run before the clock
 * starts), then starts the clock and writes this rank's check tail: seq
 * (its training forwards, counted from 1, mod TDM_DDP_SEQ_MOD) and
 * loss_sum. On failure the communicator is aborted. */
tdm_status tdm_ddp_reducer_begin(tdm_ddp_reducer *r, uint32_t seq, double loss_sum);
/* End of the synchronised backward begun with tdm_ddp_reducer_begin:
 * reduces the gradients of parameters whose hook did not fire as they
 * stand (with find_unused_parameters, or when this rank had no samples;
 * else fails naming them), launches and waits for every bucket in bucket
 * order, and checks the tail against seq; *loss_global is then every
 * rank's loss sum. On failure the communicator is aborted. */
tdm_status tdm_ddp_reducer_end(tdm_ddp_reducer *r, uint32_t seq, int had_samples,
                               double *loss_global);
/* Fails the current synchronised backward with st (message kept): aborts
 * the communicator so the other ranks stop too, drains launched buckets.
 * Returns st. */
tdm_status tdm_ddp_reducer_abort(tdm_ddp_reducer *r, tdm_status st);
/* First bucket start to last bucket end of the last synchronised
 * backward, in ms. */
double tdm_ddp_reducer_comm_ms(const tdm_ddp_reducer *r);

#endif
