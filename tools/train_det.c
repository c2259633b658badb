/* tools/train_det.c: `tandem train --mode dp --deterministic K`, and the
 * step of `--mode tp --deterministic K` (at the end). DP: the K
 * virtual shards of each global batch over DataParallel's devices, K/N
 * on each device's thread (its replica, one shard at a time), the
 * devices' subtree sums and the tree's top added on the caller's thread,
 * then the master's optimizer step. The same tree as one device's and as
 * the ranks' (dist/det.h), so the same bits. Lives in tools/ because dp/
 * and dist/ do not meet below it. */
#include <stdlib.h>
#include <string.h>

#include "dist/batch.h"
#include "dist/det.h"
#include "dp/dp.h"
#include "tools/train_modes.h"
#include "tp/tp.h"

struct tdm_train_det_dp {
    tdm_dp *dp;                       /* borrowed */
    int n, out;                       /* devices, the output device (the master's) */
    tdm_single single[TDM_DP_MAX_DEVICES];   /* the replicas' (the master's is the caller's) */
    tdm_dist_det det[TDM_DP_MAX_DEVICES];
    /* one micro-batch, for the devices' threads */
    const void *x;
    const int32_t *y;
    int b, first;
    float scale;
};

void tdm_train_det_dp_free(tdm_train_det_dp *p)
{
    if (!p) return;
    for (int i = 0; i < p->n; i++) {
        tdm_dist_det_free(&p->det[i]);
        if (i != p->out) tdm_single_free(&p->single[i]);
    }
    free(p);
}

tdm_status tdm_train_det_dp_init(tdm_train_det_dp **out, tdm_dp *dp, tdm_single *master, int K,
                                 int micro, int in_elems, int out_rows)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_train_det_dp *p = calloc(1, sizeof *p);
    TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "deterministic DP: calloc");
    p->dp = dp;
    p->n = tdm_dp_n_devices(dp);
    p->out = tdm_dp_output_device(dp);
    int order[TDM_DP_MAX_DEVICES], k = 0;
    order[k++] = p->out;   /* its gather buffer is the one the others borrow */
    for (int i = 0; i < p->n; i++)
        if (i != p->out) order[k++] = i;
    for (int j = 0; j < p->n; j++) {
        int i = order[j];
        tdm_single *s = i == p->out ? master : &p->single[i];
        if (i != p->out) *s = (tdm_single){.model = tdm_dp_replica(dp, i)};
        p->det[i] = (tdm_dist_det){.ops = &tdm_dist_det_single_ops, .ctx = s,
                                   .m = tdm_dp_replica(dp, i), .rank = i, .world = p->n, .K = K,
                                   .in_elems = in_elems, .out_rows = out_rows, .micro = micro};
        if (j > 0) {
            p->det[i].gather = p->det[p->out].gather;
            p->det[i].gather_borrowed = 1;
        }
        if ((st = tdm_dist_det_init(&p->det[i])) != TDM_STATUS_OK) break;
    }
    if (st) {
        tdm_train_det_dp_free(p);
        return st;
    }
    *out = p;
    return TDM_STATUS_OK;
}

/* On device i's thread: its shards of the micro-batch, from the step's
 * buffers (snapshot at the step's first micro-batch, just replicated). */
static tdm_status tdm_train_det_dp_apply(void *ctx, int i, tdm_model *m, tdm_device *dev)
{
    tdm_train_det_dp *p = ctx;
    (void)m;
    (void)dev;
    if (p->first) TDM_CHECK(tdm_dist_det_snapshot(&p->det[i]));
    return tdm_dist_det_local(&p->det[i], p->x, p->y, p->b, 0, p->scale);
}

tdm_status tdm_train_det_dp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                 double *loss_mean)
{
    tdm_train_det_dp *p = ctx;
    tdm_dist_det *top = &p->det[p->out];
    int mb = top->micro > 0 ? top->micro : batch, n_micro = (batch + mb - 1) / mb;
    double loss_total = 0.0;
    for (int i = 0; i < p->n; i++) p->det[i].begun++;
    TDM_CHECK(tdm_dp_replicate(p->dp, p->n));
    p->scale = 1.0f / (float)batch;
    for (int a = 0; a < n_micro; a++) {
        int lo = a * mb;
        p->b = batch - lo < mb ? batch - lo : mb;
        p->x = (const char *)x + (int64_t)lo * top->in_elems * (int64_t)sizeof(float);
        p->y = y + (int64_t)lo * top->out_rows;
        p->first = a == 0;
        double ls = 0.0;
        TDM_CHECK(tdm_dp_parallel_apply(p->dp, p->n, tdm_train_det_dp_apply, p));
        TDM_CHECK(tdm_dist_det_top(top, &ls));
        loss_total += ls;
        tdm_dist_det_accumulate(top, a);
    }
    TDM_CHECK(tdm_dist_det_apply(top, n_micro));
    *loss_mean = loss_total / batch;
    return TDM_STATUS_OK;
}

/* ---- --mode tp ---- */

tdm_status tdm_train_det_tp_step(tdm_tp *p, tdm_dist_det *det, const void *x, const int32_t *y,
                                 int global, int64_t row0, double *loss_sum)
{
    int m = det->K / det->world;
    float scale = 1.0f / (float)global;
    /* dropout's masks: shard k's forward is the step's k-th, as one
     * device's, whichever replica runs it */
    int64_t fwd0 = tdm_tp_train_forwards(p);
    det->begun++;
    for (int j = 0; j < m; j++) {
        int64_t lo, hi;
        tdm_dist_share(global, det->rank * m + j, det->K, &lo, &hi);
        double ls = 0.0;
        tdm_tp_set_train_forwards(p, fwd0 + det->rank * m + j);
        TDM_CHECK(tdm_tp_zero_grad(p));
        /* an empty shard adds zeros, as one device's does */
        if (hi > lo)
            TDM_CHECK(tdm_tp_forward_backward(p, (const char *)x + (lo - row0) * det->in_elems * 4,
                                              y + (lo - row0) * det->out_rows, (int)(hi - lo),
                                              scale, &ls));
        TDM_CHECK(tdm_dist_det_feed(det, j, ls));
    }
    tdm_tp_set_train_forwards(p, fwd0 + det->K);
    TDM_CHECK(tdm_dist_det_top(det, loss_sum));
    TDM_CHECK(tdm_dist_det_write_top(det));
    return tdm_tp_optim_step(p);
}

tdm_comm *tdm_train_det_dev_comm(tdm_comm *host, tdm_comm *dev)
{
    const char *e = getenv("TANDEM_TEST_DET_DEV_COMM");
    if (dev && (dev != host || (e && !strcmp(e, "1")))) return dev;
    return NULL;
}
