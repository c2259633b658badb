/* pp/levers.c: the memory levers at the end of a pipeline's step
 * (pp/pp.h, tdm_pp_levers): fp16's loss scaling with the skip decided
 * once for every stage of every replica, and the global gradient norm
 * and clipping over the stages' slices. The precision and the
 * checkpointing are the stage model's own (set at init, pp/pp.c); the
 * order of a step is pp/step.c's: the backwards (the replicas' all-reduce
 * inside the last), the tied embedding's sum, then here, then the
 * optimizer step unless skipped. */
#include "pp/pp_impl.h"

#include <math.h>
#include <string.h>

#include "models/clip.h"

void tdm_pp_set_levers(tdm_pp *p, const tdm_pp_levers *l)
{
    if (l) p->lev.set = *l;
    else memset(&p->lev.set, 0, sizeof p->lev.set);
}

float tdm_pp_loss_scale(const tdm_pp *p)
{
    return p->lev.set.scaler ? tdm_grad_scaler_scale(p->lev.set.scaler) : 1.0f;
}

static tdm_comm *tdm_pp_lever_comm(const tdm_pp *p)
{
    return p->lev.set.comm ? p->lev.set.comm : p->comm;
}

/* The global norm: this stage's slice (its tied copy is the first
 * stage's wte, counted there) summed over every rank of comm, one
 * double; then every stage's whole gradient (the copy too, so that the
 * two stay equal) clipped alike. */
static tdm_status tdm_pp_norm(tdm_pp *p)
{
    const tdm_pp_levers *l = &p->lev.set;
    tdm_comm *comm = tdm_pp_lever_comm(p);
    float *g = tdm_model_grads(p->m);
    int64_t n = tdm_model_param_elems(p->m);
    double sq = 0.0, *buf = NULL;
    if (l->sumsq) TDM_CHECK(l->sumsq(l->sumsq_ctx, p->m, &sq));
    else if (l->norm_counted) TDM_CHECK(tdm_clip_sumsq(p->dev, g, p->info.slice_elems, &sq));
    TDM_CHECK(tdm_dev_scratch(p->dev, sizeof(double), (void **)&buf));
    TDM_CHECK(tdm_dev_copy_from_host(p->dev, buf, &sq, sizeof sq));
    tdm_comm_set_label(comm, "pp clip grad norm over every stage and replica");
    TDM_CHECK(tdm_comm_all_reduce(comm, buf, buf, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    TDM_CHECK(tdm_dev_copy_to_host(p->dev, &sq, buf, sizeof sq));
    p->lev.last_norm = sqrt(sq);
    return tdm_clip_apply_norm(p->dev, &g, &n, 1, l->clip_norm, p->lev.last_norm);
}

tdm_status tdm_pp_levers_apply(tdm_pp *p, int *skip)
{
    const tdm_pp_levers *l = &p->lev.set;
    *skip = 0;
    if (l->after_backward) l->after_backward(l->ctx, p->m, p->stats.steps + 1);
    if (l->scaler) {
        tdm_status st = tdm_grad_scaler_unscale(l->scaler, p->dev, tdm_model_grads(p->m),
                                                tdm_model_param_elems(p->m), skip);
        if (!st) st = tdm_grad_scaler_sync_found_inf(tdm_pp_lever_comm(p), p->dev, skip);
        if (st) return tdm_pp_fail(p, st, "loss scaling: unscaling and the found-inf flag");
    }
    if (!*skip && (l->clip_norm > 0.0 || l->measure_norm)) {
        tdm_status st = tdm_pp_norm(p);
        if (st) return tdm_pp_fail(p, st, "the global gradient norm");
    }
    return TDM_STATUS_OK;
}

void tdm_pp_levers_done(tdm_pp *p, int skipped)
{
    if (p->lev.set.scaler) tdm_grad_scaler_update(p->lev.set.scaler, skipped);
    p->lev.last_skipped = skipped;
    p->lev.skipped += skipped;
}
