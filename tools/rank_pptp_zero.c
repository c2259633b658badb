/* tools/rank_pptp_zero.c: ZeRO-1 on the dp dimension of the 3-D mesh:
 * a stage's buffer gathered into the whole model's layout
 * (tools/rank_pptp_zero.h). */
#include "tools/rank_pptp_zero.h"

#include <stdlib.h>

tdm_status tdm_pptp_gather_stage(tdm_pptp *q, tdm_pp *p, const float *stage, float *whole,
                                 const char *what)
{
    int first = tdm_pp_stage(p) == 0;
    int64_t ne = tdm_model_param_elems(q->slim), n1 = ne > 0 ? ne : 1;
    float *narrow = NULL, *all = NULL;
    tdm_status st = TDM_STATUS_OK;
    if (first) {
        narrow = malloc((size_t)n1 * sizeof *narrow);
        all = malloc((size_t)n1 * (size_t)q->N * sizeof *all);
        if (!narrow || !all)
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp-tp ZeRO-1 gather of the %s: "
                               "%lld floats", what, (long long)(ne * (q->N + 1)));
    }
    if (st) {
        /* the later stages are about to send theirs here, the stage's
         * group to gather with this rank */
        tdm_comm_abort(q->phost, tdm_error_message());
        tdm_comm_abort(q->thost, tdm_error_message());
        goto done;
    }
    /* this tp index's pipeline onto its stage 0, in the narrow layout */
    if ((st = tdm_pp_gather_stage(p, stage, narrow, 0, what)) || !first) goto done;
    /* stage 0's group: every rank's narrow array, put into the whole
     * layout by the root */
    tdm_comm_set_label(q->thost, "pp-tp zero1 gather of the %s", what);
    st = tdm_comm_all_gather(q->thost, narrow, all, (size_t)ne, TDM_DTYPE_FLOAT32);
    if (st) {
        tdm_error_prefix(st, "tensor-parallel rank %d of stage 0: the gather of the %s", q->t,
                         what);
        tdm_comm_abort(q->thost, tdm_error_message());
        goto done;
    }
    for (int t = 0; whole && t < q->N; t++) tdm_pptp_unslice(q, t, all + (int64_t)t * ne, whole);
done:
    free(narrow);
    free(all);
    return st;
}
