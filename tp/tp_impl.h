/* tp/tp_impl.h: the inside of a tensor-parallel rank, shared by tp/tp.c
 * (the plan, set-up, slicing to and from the whole model's layout) and
 * tp/step.c (forward, backward, the step, evaluation). Not a public
 * header: users include tp/tp.h. */
#ifndef TDM_TP_TP_IMPL_H
#define TDM_TP_TP_IMPL_H

#include "tp/tp.h"

/* One linear layer as this rank holds it. */
typedef struct tdm_tp_layer {
    tdm_tp_split split;
    int in, out;                /* the whole layer's widths */
    int lin, lout;              /* this rank's: the gemm's k and n */
    int relu;                   /* fused relu on the (all-reduced) output */
    int wp, bp;                 /* the whole model's parameter indices */
    int64_t w_off, b_off;       /* in the rank's flat buffers */
    int64_t b_elems;            /* lout (column) or out */
    float *act;                 /* forward output (cap, lout): kept for backward */
    const float *in_act;        /* the input of the last forward (borrowed) */
} tdm_tp_layer;

struct tdm_tp {
    tdm_comm *comm;             /* borrowed: the tensor-parallel group */
    tdm_comm *hcomm;            /* borrowed: host-memory collectives */
    tdm_comm *gcomm;            /* borrowed, may be NULL: gradients summed over it */
    tdm_device *dev;            /* borrowed */
    int rank, size;
    tdm_model_spec spec;
    tdm_model *tables;          /* the whole model's tables, no storage */
    int n_layers;
    tdm_tp_layer layers[TDM_MODEL_MAX_DIMS];
    float *params, *grads;      /* flat, n_elem each, on dev */
    int64_t n_elem;
    tdm_optim *opt;
    /* activations and scratch for cap samples */
    int cap, max_width;
    float *x, *ones, *dbuf[2];
    int32_t *y;
    float *host_logits;         /* evaluation's argmax (host) */
    tdm_tp_stats stats;
    int failed;                 /* the group was aborted */
};

/* The local slice of a whole-layout host array (the whole model's flat
 * layout) into a rank-layout host array, for rank r (tp/tp.c). */
void tdm_tp_slice(const tdm_tp *p, int r, const float *whole, float *local);
/* The whole layout from the N ranks' local arrays (size * n_elem). */
void tdm_tp_unslice(const tdm_tp *p, const float *locals, float *whole);

/* Activations and scratch for B samples (grown, never shrunk; tp/tp.c). */
tdm_status tdm_tp_reserve(tdm_tp *p, int B);

/* Aborts the group (and grad_comm) with the current message once;
 * returns st (tp/step.c). */
tdm_status tdm_tp_fail(tdm_tp *p, tdm_status st);

#endif
