/* tools/rank_pptp_levers.c: the memory levers on a pipeline's
 * tensor-parallel stages (tools/rank_pptp.h). The loss scaling, the norm's
 * all-reduce and the clipping are pp/'s (pp/levers.c, over the whole
 * job's communicator: every stage, tp rank and replica); here what a
 * tensor-parallel stage counts of the norm. */
#include "tools/rank_pptp.h"

#include "models/clip.h"
#include "models/stage.h"

/* Tensor i of the stage model (narrow index k) is split: the narrow
 * model holds fewer of its elements than the whole one. */
static int tdm_pptp_split(const tdm_pptp *q, int k)
{
    return tdm_model_param_info(q->slim, k)->n_elem < tdm_model_param_info(q->whole, k)->n_elem;
}

tdm_status tdm_pptp_sumsq(void *ctx, tdm_model *m, double *sq)
{
    const tdm_pptp *q = ctx;
    *sq = 0.0;
    if (q->replica != 0) return TDM_STATUS_OK;
    tdm_model_stage_info si;
    tdm_model_get_stage(m, &si);
    const float *g = tdm_model_grads(m);
    tdm_device *dev = tdm_model_device(m);
    int64_t run_off = 0, run_n = 0;
    for (int i = 0; i <= si.n_slice_params; i++) {
        const tdm_tensor_info *t = i < si.n_slice_params ? tdm_model_param_info(m, i) : NULL;
        int counted = t && (q->t == 0 || tdm_pptp_split(q, si.param_first + i));
        if (counted && run_n && run_off + run_n == t->offset) {
            run_n += t->n_elem;
            continue;
        }
        if (run_n) {
            double s = 0.0;
            TDM_CHECK(tdm_clip_sumsq(dev, g + run_off, run_n, &s));
            *sq += s;
        }
        run_off = counted ? t->offset : 0;
        run_n = counted ? t->n_elem : 0;
    }
    return TDM_STATUS_OK;
}
