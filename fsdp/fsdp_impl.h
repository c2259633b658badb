/* fsdp/fsdp_impl.h: the inside of a tdm_fsdp, shared by fsdp/fsdp.c (the
 * API: construction, forward, backward, step), fsdp/eval.c (evaluation,
 * the gathered full parameters), fsdp/units.c (a unit's life: its
 * buffers, gathers, reduce-scatters and the model's hooks), fsdp/ckpt.c
 * (checkpoints) and the option files (comm_hook.c, join.c, plan.c). Not a
 * public header. */
#ifndef TDM_FSDP_FSDP_IMPL_H
#define TDM_FSDP_FSDP_IMPL_H

#include "dist/batch.h"
#include "dist/join.h"
#include "dist/step.h"
#include "dist/timeout.h"
#include "fsdp/fsdp.h"

#define TDM_FSDP_MAX_RANKS 64
#define TDM_FSDP_POOL_CACHE 16
/* per rank: forward count, loss sum (two halves of a double's worth) */
#define TDM_FSDP_TAIL_ELEMS (3 * TDM_FSDP_MAX_RANKS)

/* Where a unit's full parameters stand. */
typedef enum tdm_fsdp_params {
    TDM_FSDP_PARAMS_ABSENT = 0,  /* FULL_SHARD: only the shard; the others: the full copy
                                    awaits the all-gather of a stepped shard */
    TDM_FSDP_PARAMS_GATHERING,   /* its all-gather is in flight (ag) */
    TDM_FSDP_PARAMS_PRESENT,     /* the full parameters are in place */
} tdm_fsdp_params;

typedef struct tdm_fsdp_unit {
    int first, last;          /* parameter indices */
    int64_t offset, n_elem;   /* range of the model's flat buffer */
    int64_t shard, padded;    /* padded = N * shard >= n_elem */
    int64_t shard_off;        /* in the rank's shard buffers (and optimizer state) */
    int64_t full_off;         /* in pfull / gfull (grad_op, optimizer) */
    /* parameters: FULL_SHARD gathers into a pool block; the others keep
     * them at pfull + full_off */
    float *pbuf;
    size_t pbuf_bytes;
    tdm_fsdp_params params;
    tdm_comm_work *ag;
    int ag_event;             /* index into events, or -1 */
    /* gradients: FULL_SHARD and SHARD_GRAD_OP hold a pool block from the
     * unit's backward to its reduce-scatter's end; SHARD_OPTIM gfull */
    float *gbuf;
    size_t gbuf_bytes;
    float *rs_tmp;            /* staging when the shard accumulates */
    size_t rs_tmp_bytes;
    tdm_comm_work *rs;
    int rs_event;
    int pending;              /* parameters not final yet in this backward */
    /* opts.comm_hook: the 16-bit values reduce-scattered in place (a pool
     * block of padded halves), from launch to the end of the collective */
    uint16_t *hook_buf;
    size_t hook_bytes;
    /* opts.offload PARAMS: this rank's reduced slice on its way down to
     * the host gradient shard (an asynchronous copy) and the full
     * gradient block it reads, held until the copy is finished
     * (tdm_fsdp_drain: at the next pool request, or at backward's end) */
    tdm_dev_xfer *down;
    float *dbuf;
    size_t dbuf_bytes;
} tdm_fsdp_unit;

typedef struct tdm_fsdp_block {
    void *p;
    size_t nbytes;
} tdm_fsdp_block;

/* An internal event: times in ns (absolute), turned into ms from the
 * step's start by tdm_fsdp_get_times. */
typedef struct tdm_fsdp_ev {
    int kind, unit, prefetch;
    uint64_t start_ns, end_ns;
    double wait_ms, bytes;
} tdm_fsdp_ev;

/* The persistent storage of the rank's state (which exist depends on the
 * sharding: tdm_fsdp_alloc_state). */
typedef struct tdm_fsdp_store {
    float *pshard;            /* FULL_SHARD: this rank's parameter shards */
    float *gshard;            /* FULL_SHARD, SHARD_GRAD_OP: gradient shards */
    float *pfull;             /* SHARD_GRAD_OP, SHARD_OPTIM: padded full parameters */
    float *gfull;             /* SHARD_OPTIM: padded full gradients */
    float *gacc;              /* SHARD_OPTIM with a hook: the reduced gradient held aside */
    /* opts.offload PARAMS: pshard and gshard are host memory (on hdev),
     * pinned for the device's copies where its backend can (pinned: 1);
     * hstage a gradient slice copied down to be added into a shard that
     * holds earlier gradients */
    float *hstage;
    int pinned;
} tdm_fsdp_store;

/* SHARD_OPTIM with opts.comm_hook: where the reduced gradient of the
 * owned slices of gfull is (a reduce-scatter since the last zero_grad).
 * The next backward moves it aside into gacc, so that only the new local
 * gradients are rounded to 16 bits; each unit's reduce-scatter adds it
 * back, as the other shardings add their shard to the result (rs_tmp). */
typedef enum tdm_fsdp_reduced {
    TDM_FSDP_REDUCED_NONE = 0,   /* no reduced gradient since zero_grad */
    TDM_FSDP_REDUCED_IN_PLACE,   /* in the owned slices */
    TDM_FSDP_REDUCED_HELD,       /* in gacc, until this backward's reduce-scatters end */
} tdm_fsdp_reduced;

/* What the gradient buffers are known to hold. */
typedef struct tdm_fsdp_grads {
    int zero;                 /* FULL_SHARD, SHARD_GRAD_OP: the shards hold zeros */
    /* SHARD_OPTIM: gfull outside this rank's slices still holds the local
     * gradients of the last reduce-scatter (cleared by the next zero_grad,
     * or before the next backward adds into them) */
    int stale;
    tdm_fsdp_reduced reduced;
} tdm_fsdp_grads;

/* The pool of unit blocks (fsdp/units.c). */
typedef struct tdm_fsdp_pool {
    tdm_fsdp_block cache[TDM_FSDP_POOL_CACHE];
    int n_cached;
    size_t live, peak;        /* bytes allocated now, and at most since the last reset */
} tdm_fsdp_pool;

/* The order of a pass's units, recorded in the first pass and followed
 * after (the prefetch gathers the unit expected next). A pass that
 * leaves it stops prefetching and is recorded again next time. */
typedef enum tdm_fsdp_order_state {
    TDM_FSDP_ORDER_RECORDING = 0,   /* this pass records the order */
    TDM_FSDP_ORDER_FOLLOWING,       /* this pass follows the recorded order */
    TDM_FSDP_ORDER_BROKEN,          /* this pass left it (or overflowed it) */
} tdm_fsdp_order_state;

typedef struct tdm_fsdp_order {
    int *unit;                /* 2 * nu + 4 entries */
    int len;                  /* recorded entries (0: none yet) */
    int pos;                  /* this pass's position in it */
    int cur;                  /* the unit this pass is in (-1: none yet) */
    tdm_fsdp_order_state state;
} tdm_fsdp_order;

/* The model's forward or backward in progress (its hooks act then). */
typedef enum tdm_fsdp_phase {
    TDM_FSDP_PHASE_IDLE = 0,
    TDM_FSDP_PHASE_FORWARD,
    TDM_FSDP_PHASE_BACKWARD,
} tdm_fsdp_phase;

/* The pass in progress. */
typedef struct tdm_fsdp_pass {
    tdm_fsdp_phase phase;
    tdm_fsdp_order fwd, bwd;
    int sync;                 /* 0 under no_sync */
    int ran;                  /* the pending forward ran the model (its backward runs it) */
    unsigned char *ready;     /* n_params: final in this backward */
    int next_rs;              /* the unit whose reduce-scatter goes out next (last first) */
    tdm_status hook_st;       /* the first failure inside the model's hooks */
    char hook_msg[640];
    double ag_wait_ms, rs_wait_ms;   /* waits of the current pass */
    double copy_ms;           /* offload: issuing and finishing host copies in this pass */
} tdm_fsdp_pass;

/* The end-of-backward check (every rank's forward count and loss sum in
 * one SUM) and the loss sums it carries. */
typedef struct tdm_fsdp_check {
    uint64_t count;           /* synchronised backwards run */
    double loss_accum;        /* this rank's since the last synchronised backward */
    double loss_global;       /* every rank's, of the last synchronised backward */
    double tail[TDM_FSDP_TAIL_ELEMS];
    int stepped;              /* tdm_fsdp_step ran since the last synchronised backward */
} tdm_fsdp_check;

/* The step's timeline and phases. */
typedef struct tdm_fsdp_timing {
    int open;                 /* a step's timeline is open (since its first forward) */
    int64_t steps;            /* tdm_fsdp_step calls completed: the flight recorder's step */
    uint64_t t_step0;         /* ns: the step's start */
    tdm_fsdp_ev *ev;
    int n_ev, cap_ev;
    tdm_fsdp_event *ev_out;   /* tdm_fsdp_get_times' copy */
    int rs_done_in_bwd, ag_ready_at_use;
    tdm_fsdp_times times;
} tdm_fsdp_timing;

struct tdm_fsdp {
    tdm_model *m;             /* borrowed */
    tdm_comm *comm;           /* borrowed */
    tdm_comm *hcomm;          /* borrowed: host-memory collectives */
    tdm_device *dev;          /* borrowed: the model's */
    /* the device whose memory holds the shards (pshard, gshard) and the
     * optimizer state: dev, or with opts.offload PARAMS hdev, a host
     * device of the wrapper's own */
    tdm_device *sdev, *hdev;
    tdm_fsdp_opts o;
    int rank, world, n_params;
    /* the unit plan (fsdp/plan.c) */
    int nu;
    tdm_fsdp_unit *u;
    int *param_unit;          /* n_params */
    int64_t shard_elems, full_elems;
    int64_t max_padded;
    tdm_fsdp_store buf;
    tdm_fsdp_grads grad;
    tdm_fsdp_pool pool;
    tdm_fsdp_pass pass;
    tdm_dist_fwd fwd;         /* the forward backward goes back through */
    tdm_train_stage stage;     /* the batch, or the zero sample, on the device; dlogits */
    float *buf_save;          /* buffers saved around a zero-sample forward */
    tdm_fsdp_check check;
    tdm_fsdp_timing timing;
    tdm_dist_join join;       /* opts.join (fsdp/join.c) */
};

/* fsdp/fsdp.c: forward pieces fsdp/eval.c shares. broadcast_buffers:
 * rank 0's buffers to all (when: for the message and label).
 * run_forward: the model's forward over B samples at xd (FULL_SHARD
 * gathers through the hooks; keep: the unit forward ended in stays
 * gathered for backward). The batch's staging and the zero sample of a
 * rank without samples are f->stage's (dist/batch.h). */
tdm_status tdm_fsdp_broadcast_buffers(tdm_fsdp *f, const char *when);
tdm_status tdm_fsdp_run_forward(tdm_fsdp *f, const void *xd, int B, int keep,
                                const float **logits);

/* fsdp/units.c */
tdm_status tdm_fsdp_pool_get(tdm_fsdp *f, size_t nbytes, int zero, float **out, size_t *got);
void tdm_fsdp_pool_put(tdm_fsdp *f, float *p, size_t nbytes);
void tdm_fsdp_pool_trim(tdm_fsdp *f);
/* The model's hooks. */
tdm_status tdm_fsdp_use_hook(void *ctx, tdm_model *m, tdm_model_use use, int first, int last);
void tdm_fsdp_grad_hook(void *ctx, tdm_model *m, int first, int last);
/* Unit u's full parameters present (gathered, or the gather awaited). */
tdm_status tdm_fsdp_need_params(tdm_fsdp *f, int u, int prefetch_ok);
/* FULL_SHARD: frees u's gathered parameters (waiting for a gather in flight). */
tdm_status tdm_fsdp_release_params(tdm_fsdp *f, int u);
/* Releases every unit's gathered parameters (FULL_SHARD) and waits for the
 * gathers in flight (SHARD_GRAD_OP and SHARD_OPTIM's after a step). */
tdm_status tdm_fsdp_settle_params(tdm_fsdp *f, int release);
/* opts.offload PARAMS: finishes the gradient slices' copies down to the
 * host (until: TDM_DEV_XFER_DEVICE before their blocks are reused,
 * TDM_DEV_XFER_HOST at backward's end) and gives their blocks back to the
 * pool. The first failure is returned; every block goes back. */
tdm_status tdm_fsdp_drain(tdm_fsdp *f, tdm_dev_xfer_until until);
/* Issues u's all-gather (asynchronously). */
tdm_status tdm_fsdp_issue_gather(tdm_fsdp *f, int u, int prefetch);
/* SHARD_OPTIM: clears gfull outside this rank's slices if the last
 * reduce-scatter left local gradients there (gfull_stale). */
tdm_status tdm_fsdp_clear_stale(tdm_fsdp *f);
/* SHARD_OPTIM with a hook, before a backward: the reduced gradient of the
 * owned slices aside into gacc (gfull_reduced). */
tdm_status tdm_fsdp_hold_reduced(tdm_fsdp *f);
/* A pass's unit order: begin at its start (record it, or follow the one
 * recorded), end at its end (one that left it is recorded again). */
void tdm_fsdp_order_begin(tdm_fsdp_order *o);
void tdm_fsdp_order_end(tdm_fsdp_order *o);
/* Backward's start and end (sync: reduce-scatter the rest, wait all). */
void tdm_fsdp_backward_begin(tdm_fsdp *f);
tdm_status tdm_fsdp_backward_end(tdm_fsdp *f);
/* Aborts the communicator with the current message and waits (bounded)
 * for every collective in flight; returns st with the message kept. */
tdm_status tdm_fsdp_fail(tdm_fsdp *f, tdm_status st);
int tdm_fsdp_new_event(tdm_fsdp *f, int kind, int unit, int prefetch, double bytes);
/* Waits for w with the configured bound; the wait's ms into *ms. */
tdm_status tdm_fsdp_wait(tdm_fsdp *f, tdm_comm_work *w, double *ms);
/* 1 when w (NULL included) has ended: after a failed wait, only then may
 * its handle be freed and its buffers go back (a timed-out one still runs). */
int tdm_fsdp_work_over(tdm_comm_work *w);

/* The family name the flight recorder's labels start with ("fsdp
 * all_gather unit 2", "zero1 reduce_scatter unit 0"): fsdp for
 * FULL_SHARD, zero2 for SHARD_GRAD_OP, zero1 for SHARD_OPTIM. */
static inline const char *tdm_fsdp_tag(const tdm_fsdp *f)
{
    return f->o.sharding == TDM_FSDP_SHARD_OPTIM     ? "zero1"
         : f->o.sharding == TDM_FSDP_SHARD_GRAD_OP ? "zero2" : "fsdp";
}

/* opts.offload PARAMS: the shards live in host memory (on f->sdev). */
static inline int tdm_fsdp_offloaded(const tdm_fsdp *f)
{
    return f->o.offload == TDM_FSDP_OFFLOAD_PARAMS;
}

/* src (n floats on src_dev) where a collective on f->comm can read it:
 * src itself when src_dev is the model's device, else copied up into
 * stage (n floats on f->dev), which *out then points at (the shards and
 * an optimizer's state in host memory: offload). */
static inline tdm_status tdm_fsdp_comm_src(tdm_fsdp *f, tdm_device *src_dev, const float *src,
                                           int64_t n, float *stage, const float **out)
{
    *out = src;
    if (src_dev == f->dev) return TDM_STATUS_OK;
    *out = stage;
    return tdm_dev_copy_between(f->dev, stage, src_dev, src, (size_t)n * sizeof(float));
}

/* Drops the label set for a collective that was not issued after all
 * (its submission failed): a pending label names the communicator's next
 * call, whatever it is (core/comm.h), and would mislead `tandem doctor`. */
static inline void tdm_fsdp_unlabel(tdm_fsdp *f) { tdm_comm_set_label(f->comm, "%s", ""); }

/* Pointers into the shard buffers: unit u's parameter and gradient shard. */
static inline float *tdm_fsdp_pshard(tdm_fsdp *f, int u)
{
    const tdm_fsdp_unit *x = &f->u[u];
    return f->o.sharding == TDM_FSDP_FULL_SHARD ? f->buf.pshard + x->shard_off
                                                : f->buf.pfull + x->full_off + f->rank * x->shard;
}
static inline float *tdm_fsdp_gshard(tdm_fsdp *f, int u)
{
    const tdm_fsdp_unit *x = &f->u[u];
    return f->o.sharding == TDM_FSDP_SHARD_OPTIM ? f->buf.gfull + x->full_off + f->rank * x->shard
                                                 : f->buf.gshard + x->shard_off;
}

/* fsdp/comm_hook.c: opts.comm_hook. check: the option is valid and the
 * model's device a host one (at init). launch: rounds unit u's full local
 * gradient `full` (padded floats) to 16 bits into a pool block and
 * reduce-scatters it in place (x->rs). finish: after the collective, widens
 * this rank's slice into where the float32 reduce-scatter would have put
 * it (the gradient shard, its staging rs_tmp, or ZeRO-1's owned slice of
 * the full gradient) and gives the block back; release: gives it back
 * (an ended, failed collective). */
tdm_status tdm_fsdp_hook_check(const tdm_fsdp_opts *o, tdm_model *m);
tdm_status tdm_fsdp_hook_launch(tdm_fsdp *f, int u, const float *full);
void tdm_fsdp_hook_finish(tdm_fsdp *f, int u);
void tdm_fsdp_hook_release(tdm_fsdp *f, int u);
/* fsdp/join.c: opts.join at a forward: counts the ranks with data (a
 * training forward of a rank not joined; a joined rank counts in
 * tdm_fsdp_join) and sets the loss-gradient scale: by_active 1/(batch *
 * active ranks), else *scale * world / active ranks. */
tdm_status tdm_fsdp_join_forward(tdm_fsdp *f, int train, int batch, int by_active, float *scale);

/* fsdp/plan.c, called once by tdm_fsdp_init: the unit plan, then its
 * check that every rank holds the same plan and tensor layout. */
tdm_status tdm_fsdp_plan(tdm_fsdp *f);
tdm_status tdm_fsdp_verify(tdm_fsdp *f);

#endif
