/* pp/pp_impl.h: the inside of a pipeline stage, shared by pp/pp.c (set-up,
 * buffers, memory, gathering) and pp/step.c (running a schedule: the
 * actions, the transfers, the loss, the tied embedding, the step). Not a
 * public header: users include pp/pp.h. */
#ifndef TDM_PP_PP_IMPL_H
#define TDM_PP_PP_IMPL_H

#include "pp/pp.h"

/* Link communicators: the activations of link l (stage l -> l + 1) go on
 * lane l % 2, its gradients on lane TDM_PP_GRAD_LANE(S) + l % 2, so that
 * each stage issues one kind of call on each lane (see pp/pp.h). */
#define TDM_PP_MAX_LANES 4
#define TDM_PP_GRAD_LANE(S) ((S) > 2 ? 2 : 1)

/* One transfer in flight: its handle and what it is, for messages. */
typedef struct tdm_pp_xfer {
    tdm_comm_work *work;        /* NULL: none */
    int mb;
} tdm_pp_xfer;

struct tdm_pp {
    tdm_comm *comm;             /* borrowed: the pipeline, stage = rank */
    tdm_comm *hcomm;            /* borrowed: host-memory collectives (o.host_comm or comm) */
    tdm_device *dev;            /* borrowed */
    int S, s;
    tdm_model_spec spec;
    tdm_pp_opts o;              /* o.split not kept: see first */
    int *first;                 /* the split: first layer of each stage */
    int n_layers;
    tdm_model *m;
    tdm_optim *opt;
    tdm_model_stage_info info;
    int host;                   /* the device reads host memory: no staging */
    int failed;                 /* tdm_pp_fail ran: the communicators are aborted */

    struct {                    /* links; NULL where there is no neighbour */
        tdm_comm *lane[TDM_PP_MAX_LANES];   /* owned */
        tdm_comm *act_in, *act_out, *grad_in, *grad_out;   /* borrowed from lane[] */
    } link;

    struct {                    /* buffers, grown to `cap` samples and `n` slots */
        int cap, n, n_in;       /* samples; slots allocated; input buffers among them */
        /* per input slot (micro-batch i uses slot i % run.n_in): the
         * received input activation, from its recv's post to its B */
        float **in;
        int *owner;             /* the micro-batch using it, -1: free */
        /* per activation set (micro-batch i uses set i % run.sets) */
        void **x;               /* the first stage's staged input */
        const float **out;      /* the forward's output (the model's) */
        float *gin[2];          /* received output gradients */
        int gin_owner[2];
        /* receive buffers in the links' zero-copy memory (o.batch):
         * never freed there (the links own it) */
        unsigned char *in_shared;
        int gin_shared[2];
        int plan_in;            /* input slots the links' memory was sized for */
        int32_t *y;             /* the last stage's staged targets */
        float *tied;            /* the other stage's share of the tied gradient */
        size_t input_bytes, scratch_bytes;
    } buf;

    struct {                    /* the step (or evaluation) in progress */
        int batch, micro, n_mb; /* global batch, micro-batch size, micro-batches */
        int eval;
        int sets;               /* activation sets: the schedule's in-flight count */
        int n_in;               /* input slots: one more, so that the next
                                   micro-batch's input arrives while this one computes */
        const char *x;          /* host inputs and targets of the global batch */
        const int32_t *y;
        int act_next, grad_next;   /* next micro-batch whose recv is to be posted */
        tdm_pp_xfer *act_recv;  /* per input slot */
        tdm_pp_xfer *act_send;  /* per set */
        tdm_pp_xfer grad_recv[2];
        tdm_pp_xfer grad_send;
        float grad_scale;       /* of the loss gradient: 1/batch, or the caller's */
        double loss_sum;
        int64_t correct;
        uint64_t t0;
    } run;

    tdm_pp_schedule *sched;     /* cached for (kind, S, n_mb) */

    struct {                    /* o.shards (pp/shards.c) */
        int *lo;                /* (M + 1): micro-batch i is rows [lo[i], lo[i + 1]) */
        float *snap;            /* (buffer elems, device): the step's buffers */
        float *fwd;             /* (M, buffer elems, device): each micro-batch's after its F */
        float *head;            /* (tied elems, device): the last stage's head share */
        tdm_comm_work *head_send;   /* its send to the first stage, in flight */
        double mb_loss;         /* the last stage: the last loss computed */
        int64_t fwd0;           /* the model's training forwards at the step's start */
    } shards;

    struct {                    /* the step's levers (pp/levers.c) */
        tdm_pp_levers set;
        double last_norm;
        int last_skipped;
        int64_t skipped;
    } lev;

    struct {                    /* what steps did */
        tdm_pp_phases last, sum;
        int64_t steps;
        int64_t overlapped, transfers;
        tdm_pp_event *ev;
        int n_ev, cap_ev;
        size_t mem_base;        /* live bytes at the end of init */
        size_t set_bytes;       /* the largest activation set a forward used */
        int mem_ok;             /* the device keeps accounts */
        /* the transfers pending when the current compute began */
        tdm_comm_work **pending;
        int n_pending, cap_pending;
    } stats;
};

/* pp/pp.c */
/* Buffers for micro-batches of `micro` samples: `sets` activation sets
 * and `n_in` input slots. */
tdm_status tdm_pp_buffers(tdm_pp *p, int micro, int sets, int n_in);
/* "pp stage 1 of 3" prefix of messages, and the abort that stops the
 * other stages after a failure here (returns st). */
tdm_status tdm_pp_fail(tdm_pp *p, tdm_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* pp/shards.c (o.shards set; see pp/pp.h) */
static inline int tdm_pp_sharded(const tdm_pp *p) { return p->o.shards.leaf != NULL; }
/* The step's cut into o.micro_batches shards (run.micro: the largest). */
tdm_status tdm_pp_shards_cut(tdm_pp *p, int batch);
/* At the step's start: the buffers' snapshot. */
tdm_status tdm_pp_shards_begin(tdm_pp *p);
tdm_status tdm_pp_shards_before_forward(tdm_pp *p, int mb);
tdm_status tdm_pp_shards_after_forward(tdm_pp *p, int mb);
tdm_status tdm_pp_shards_before_backward(tdm_pp *p, int mb);
tdm_status tdm_pp_shards_after_backward(tdm_pp *p, int mb);
/* After the schedule: the sum, and the tied copy made the first stage's. */
tdm_status tdm_pp_shards_end(tdm_pp *p);
void tdm_pp_shards_free(tdm_pp *p);

/* pp/levers.c */
/* What the loss gradient is multiplied by besides 1/B: the loss scale. */
float tdm_pp_loss_scale(const tdm_pp *p);
/* After the backwards and the tied sum: unscale, found-inf over the job,
 * the norm and clipping; *skip: the optimizer step is to be skipped. */
tdm_status tdm_pp_levers_apply(tdm_pp *p, int *skip);
/* After the (possibly skipped) step: the scaler's update. */
void tdm_pp_levers_done(tdm_pp *p, int skipped);

/* pp/step.c */
/* Waits for and releases every transfer still in flight (after a failure:
 * bounded by the links' deadlines). */
void tdm_pp_drain(tdm_pp *p);

#endif
