/* fsdp/fsdp_impl.h: the inside of a tdm_fsdp, shared by fsdp/fsdp.c (the
 * API: construction, forward, backward, step), fsdp/eval.c (evaluation,
 * the gathered full parameters), fsdp/units.c (a unit's life: its
 * buffers, gathers, reduce-scatters and the model's hooks), fsdp/ckpt.c
 * (checkpoints) and the option files (comm_hook.c, join.c, plan.c). Not a
 * public header. */
#ifndef TDM_FSDP_FSDP_IMPL_H
#define TDM_FSDP_FSDP_IMPL_H

#include "fsdp/fsdp.h"

#define TDM_FSDP_MAX_RANKS 64
#define TDM_FSDP_POOL_CACHE 16
/* per rank: forward count, loss sum (two halves of a double's worth) */
#define TDM_FSDP_TAIL_ELEMS (3 * TDM_FSDP_MAX_RANKS)

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
    int p_state;              /* 0 absent, 1 gather in flight, 2 present */
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
    int launched;             /* reduce-scatter issued in this backward */
    /* opts.comm_hook: the 16-bit values reduce-scattered in place (a pool
     * block of padded halves), from launch to the end of the collective */
    uint16_t *hook_buf;
    size_t hook_bytes;
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

struct tdm_fsdp {
    tdm_model *m;             /* borrowed */
    tdm_comm *comm;           /* borrowed */
    tdm_comm *hcomm;          /* borrowed: host-memory collectives */
    tdm_device *dev;          /* borrowed: the model's */
    tdm_fsdp_opts o;
    int rank, world, n_params;
    int nu;
    tdm_fsdp_unit *u;
    int *param_unit;          /* n_params */
    unsigned char *ready;     /* n_params: final in this backward */
    int64_t shard_elems, full_elems;
    int64_t max_padded;
    /* persistent storage */
    float *pshard;            /* FULL_SHARD: this rank's parameter shards */
    float *gshard;            /* FULL_SHARD, SHARD_GRAD_OP: gradient shards */
    float *pfull;             /* SHARD_GRAD_OP, SHARD_OPTIM: padded full parameters */
    float *gfull;             /* SHARD_OPTIM: padded full gradients */
    int gshard_zero;          /* 1: the gradient shards are known to hold zeros */
    /* SHARD_OPTIM: 1 when gfull outside this rank's slices still holds the
     * local gradients of the last reduce-scatter (they are cleared by the
     * next zero_grad, or before the next backward adds into them) */
    int gfull_stale;
    /* SHARD_OPTIM with opts.comm_hook: 1 when the owned slices hold a
     * reduced gradient (a reduce-scatter since the last zero_grad). The
     * next backward moves it aside into gacc (shard_elems) so that only
     * the new local gradients are rounded to 16 bits; gacc_live until each
     * unit's reduce-scatter has added it back, as the other shardings add
     * their shard to the result (rs_tmp) */
    int gfull_reduced, gacc_live;
    float *gacc;
    /* the pool of unit blocks */
    tdm_fsdp_block cache[TDM_FSDP_POOL_CACHE];
    int n_cached;
    size_t pool_live, pool_peak;
    /* unit order of the passes (recorded once, checked after) */
    int *fwd_order, fwd_len, fwd_pos, fwd_rec, fwd_broken;
    int *bwd_order, bwd_len, bwd_pos, bwd_rec, bwd_broken;
    int cur_f, cur_b;
    /* the pass in progress */
    int in_forward, in_backward, sync, next_rs;
    tdm_status hook_st;
    char hook_msg[640];
    uint64_t t_step0;         /* ns: the step's start (its first forward) */
    int step_open;
    double ag_wait_ms, rs_wait_ms;   /* waits of the current pass */
    /* forward state, as DDP's */
    float *dlogits;
    size_t dlogits_bytes;
    void *x_dev;
    int32_t *y_dev;
    int stage_cap;
    float *dummy_x;           /* one zero sample (device) for a rank without samples */
    int32_t *dummy_y;
    float *buf_save;          /* buffers saved around a dummy forward */
    int fwd_batch, fwd_ran, have_fwd;
    double fwd_loss, loss_accum, loss_global;
    const char *fwd_lost;
    uint64_t fwd_count, sync_count;
    double tail[TDM_FSDP_TAIL_ELEMS];
    /* timings */
    tdm_fsdp_ev *ev;
    int n_ev, cap_ev;
    tdm_fsdp_event *ev_out;   /* tdm_fsdp_get_times' copy */
    int rs_done_in_bwd, ag_ready_at_use;
    tdm_fsdp_times times;
    /* opts.join (fsdp/join.c) */
    int joined;               /* this rank ran out of data (tdm_fsdp_join) */
    int stepped;              /* tdm_fsdp_step ran since the last synchronised backward */
    int64_t steps_done;       /* tdm_fsdp_step calls completed: the flight recorder's step */
    int n_active;             /* ranks with data in the last training forward */
    int join_sync;            /* that forward's backward synchronises */
};

/* fsdp/fsdp.c: forward pieces fsdp/eval.c shares. stage: the batch on
 * the device (host: as given). dummy: one zero sample for a rank without
 * samples. broadcast_buffers: rank 0's buffers to all (when: for the
 * message and label). run_forward: the model's forward over B samples
 * at xd (FULL_SHARD gathers through the hooks; keep: the unit forward
 * ended in stays gathered for backward). */
tdm_status tdm_fsdp_stage(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                          const void **xd, const int32_t **yd);
tdm_status tdm_fsdp_dummy(tdm_fsdp *f);
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
/* Issues u's all-gather (asynchronously). */
tdm_status tdm_fsdp_issue_gather(tdm_fsdp *f, int u, int prefetch);
/* SHARD_OPTIM: clears gfull outside this rank's slices if the last
 * reduce-scatter left local gradients there (gfull_stale). */
tdm_status tdm_fsdp_clear_stale(tdm_fsdp *f);
/* SHARD_OPTIM with a hook, before a backward: the reduced gradient of the
 * owned slices aside into gacc (gfull_reduced). */
tdm_status tdm_fsdp_hold_reduced(tdm_fsdp *f);
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

/* Drops the label set for a collective that was not issued after all
 * (its submission failed): a pending label names the communicator's next
 * call, whatever it is (core/comm.h), and would mislead `tandem doctor`. */
static inline void tdm_fsdp_unlabel(tdm_fsdp *f) { tdm_comm_set_label(f->comm, "%s", ""); }

/* Pointers into the shard buffers: unit u's parameter and gradient shard. */
static inline float *tdm_fsdp_pshard(tdm_fsdp *f, int u)
{
    const tdm_fsdp_unit *x = &f->u[u];
    return f->o.sharding == TDM_FSDP_FULL_SHARD ? f->pshard + x->shard_off
                                                : f->pfull + x->full_off + f->rank * x->shard;
}
static inline float *tdm_fsdp_gshard(tdm_fsdp *f, int u)
{
    const tdm_fsdp_unit *x = &f->u[u];
    return f->o.sharding == TDM_FSDP_SHARD_OPTIM ? f->gfull + x->full_off + f->rank * x->shard
                                                 : f->gshard + x->shard_off;
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
