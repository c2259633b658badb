/* tp/levers.c: the memory levers at the end of a tensor-parallel step
 * (tp/tp.h, tdm_tp_levers): fp16's loss scaling with the skip decided
 * once for every rank of the job (the tensor-parallel group and its
 * data-parallel replicas), and the global gradient norm and clipping
 * over the group's slices. The order of a step is tp/step.c's: the
 * backward, the sums (sequence-parallel LayerNorms over the group, the
 * replicas over the dp dimension), then here, then the optimizer step
 * unless skipped. */
#include <math.h>
#include <string.h>

#include "core/timer.h"
#include "models/clip.h"
#include "models/precision.h"
#include "tp/tp_impl.h"

void tdm_tp_set_levers(tdm_tp *p, const tdm_tp_levers *l)
{
    if (l) p->lev = *l;
    else memset(&p->lev, 0, sizeof p->lev);
}

float tdm_tp_loss_scale(const tdm_tp *p)
{
    return p->lev.scaler ? tdm_grad_scaler_scale(p->lev.scaler) : 1.0f;
}

static tdm_comm *tdm_tp_lever_comm(const tdm_tp *p)
{
    return p->lev.comm ? p->lev.comm : p->comm;
}

/* The sum of squares this rank counts: its split tensors' slices (every
 * rank of the group holds other elements of them) and, on the group's
 * rank 0 alone, the replicated tensors (the same bits on every rank of
 * the group, tp/tp.h); nothing on a replica other than replica 0 of the
 * dp dimension (after the sum over it every replica holds the same
 * gradient). Runs of adjacent counted tensors are summed as one buffer
 * (models/clip.h's fixed chunk order). */
static tdm_status tdm_tp_sumsq(tdm_tp *p, double *sq)
{
    *sq = 0.0;
    if (p->lev.replica != 0) return TDM_STATUS_OK;
    int64_t run_off = 0, run_n = 0;
    for (int i = 0; i <= p->n_tensors; i++) {
        const tdm_tp_tensor *t = i < p->n_tensors ? &p->tensors[i] : NULL;
        int counted = t && (t->cut != TDM_TP_CUT_REPL || p->rank == 0);
        if (counted && run_n && run_off + run_n == t->off) {
            run_n += t->n_elem;
            continue;
        }
        if (run_n) {
            double s = 0.0;
            TDM_CHECK(tdm_clip_sumsq(p->dev, p->grads + run_off, run_n, &s));
            *sq += s;
        }
        run_off = counted ? t->off : 0;
        run_n = counted ? t->n_elem : 0;
    }
    return TDM_STATUS_OK;
}

/* The global norm: the counted squares summed over the job (one double,
 * one all-reduce), then every rank's whole flat gradient clipped alike
 * (the all-reduce hands every rank the same norm). */
static tdm_status tdm_tp_norm(tdm_tp *p)
{
    tdm_comm *comm = tdm_tp_lever_comm(p);
    double sq = 0.0, *buf = NULL;
    TDM_CHECK(tdm_tp_sumsq(p, &sq));
    TDM_CHECK(tdm_dev_scratch(p->dev, sizeof(double), (void **)&buf));
    TDM_CHECK(tdm_dev_copy_from_host(p->dev, buf, &sq, sizeof sq));
    tdm_comm_set_label(comm, "tp clip grad norm over the group and its replicas");
    tdm_status st = tdm_comm_all_reduce(comm, buf, buf, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM);
    if (st) {
        tdm_error_prefix(st, "tp rank %d: the gradient norm's all-reduce", p->rank);
        return st;
    }
    TDM_CHECK(tdm_dev_copy_to_host(p->dev, &sq, buf, sizeof sq));
    p->stats.last_norm = sqrt(sq);
    float *g = p->grads;
    int64_t n = p->n_elem;
    return tdm_clip_apply_norm(p->dev, &g, &n, 1, p->lev.clip_norm, p->stats.last_norm);
}

tdm_status tdm_tp_levers_apply(tdm_tp *p, int *skip)
{
    const tdm_tp_levers *l = &p->lev;
    *skip = 0;
    if (l->after_backward) l->after_backward(l->ctx, p->grads, p->n_elem, p->dev);
    if (l->scaler) {
        TDM_CHECK(tdm_grad_scaler_unscale(l->scaler, p->dev, p->grads, p->n_elem, skip));
        TDM_CHECK(tdm_grad_scaler_sync_found_inf(tdm_tp_lever_comm(p), p->dev, skip));
    }
    if (!*skip && (l->clip_norm > 0.0 || l->measure_norm)) TDM_CHECK(tdm_tp_norm(p));
    return TDM_STATUS_OK;
}

void tdm_tp_levers_done(tdm_tp *p, int skipped)
{
    if (p->lev.scaler) tdm_grad_scaler_update(p->lev.scaler, skipped);
    p->stats.last_skipped = skipped;
    p->stats.skipped += skipped;
}
