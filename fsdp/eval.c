/* fsdp/eval.c: what reads the sharded model outside a training step:
 * evaluation spread over the ranks (tdm_fsdp_evaluate on a test set,
 * tdm_fsdp_eval_loss on a rank's batch; in FULL_SHARD every rank runs as
 * many forwards as the largest share needs, the gathers being
 * collective) and the full parameters and gradients gathered to one rank
 * or all (tdm_fsdp_gather_params, tdm_fsdp_gather_grads). The forward
 * pieces they share with training are fsdp/fsdp.c's. */
#include "fsdp/fsdp_impl.h"

#include <stdio.h>

/* ---- evaluation ---- */

tdm_status tdm_fsdp_evaluate(tdm_fsdp *f, const tdm_dataset *test, int batch, double *loss_mean,
                             double *accuracy)
{
    tdm_model *m = f->m;
    TDM_CHECK(tdm_dist_eval_begin(&f->fwd, "fsdp", "tdm_fsdp_evaluate", test, batch,
                                  loss_mean, accuracy));
    int full = f->o.sharding == TDM_FSDP_FULL_SHARD, was_train = tdm_model_is_train(m);
    tdm_status st = tdm_fsdp_settle_params(f, full);
    if (st == TDM_STATUS_OK) st = tdm_fsdp_broadcast_buffers(f, "evaluate");
    if (st) return tdm_fsdp_fail(f, st);
    int64_t n = test->n, lo, hi;
    tdm_dist_share(n, f->rank, f->world, &lo, &hi);
    /* FULL_SHARD: every rank runs as many forwards as the largest share
     * needs (the gathers are collective); the others run their own */
    int64_t rows_max = full ? (n + f->world - 1) / f->world : hi - lo;
    int64_t nbatch = (rows_max + batch - 1) / batch;
    int64_t feat = tdm_data_features(test);
    double sums[3] = {0.0, 0.0, (double)(hi - lo)};   /* loss sum, correct, samples */
    tdm_model_set_train(m, 0);
    for (int64_t b = 0; st == TDM_STATUS_OK && b < nbatch; b++) {
        int64_t r0 = lo + b * batch, k = hi - r0 < batch ? hi - r0 : batch;
        const void *xd;
        const int32_t *yd;
        const float *logits;
        if (k <= 0) {   /* this rank's share is done: take part only */
            st = tdm_train_stage_dummy(&f->stage, m, &xd, &yd);
            if (st == TDM_STATUS_OK) st = tdm_fsdp_run_forward(f, xd, 1, 0, &logits);
            continue;
        }
        st = tdm_train_stage_batch(&f->stage, m, test->x + r0 * feat, test->y + r0, (int)k, &xd,
                                  &yd);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_run_forward(f, xd, (int)k, 0, &logits);
        double ls = 0.0;
        int64_t correct = 0;
        if (st == TDM_STATUS_OK) st = tdm_model_loss(m, logits, yd, (int)k, 1.0f, &ls, NULL);
        if (st == TDM_STATUS_OK) st = tdm_model_count_correct(m, test->y + r0, (int)k, &correct);
        sums[0] += ls;
        sums[1] += (double)correct;
    }
    tdm_model_set_train(m, was_train);
    tdm_fsdp_pool_trim(f);
    if (st) {
        tdm_error_prefix(st, "fsdp evaluate: rank %d (rows %lld..%lld)", f->rank, (long long)lo,
                         (long long)hi - 1);
        return tdm_fsdp_fail(f, st);
    }
    char label[32];
    snprintf(label, sizeof label, "%s evaluate sums", tdm_fsdp_tag(f));
    return tdm_dist_eval_sums(f->hcomm, "fsdp", label, sums, loss_mean, accuracy);
}

tdm_status tdm_fsdp_eval_loss(tdm_fsdp *f, const void *x, const int32_t *y, int batch,
                              double *loss_sum)
{
    tdm_model *m = f->m;
    TDM_REQUIRE(loss_sum && batch >= 0 && (batch == 0 || (x && y)), TDM_STATUS_INVALID_ARG,
                "fsdp eval_loss: bad batch %d or NULL argument", batch);
    *loss_sum = 0.0;
    tdm_dist_fwd_lose(&f->fwd, "tdm_fsdp_eval_loss");
    int full = f->o.sharding == TDM_FSDP_FULL_SHARD, was_train = tdm_model_is_train(m);
    tdm_status st = tdm_fsdp_settle_params(f, full);
    if (st == TDM_STATUS_OK) st = tdm_fsdp_broadcast_buffers(f, "eval_loss");
    if (st) return tdm_fsdp_fail(f, st);
    if (batch == 0 && !full) return TDM_STATUS_OK;   /* nothing to gather, nothing to add */
    const void *xd;
    const int32_t *yd;
    const float *logits = NULL;
    double ls = 0.0;
    tdm_model_set_train(m, 0);
    if (batch == 0) {
        st = tdm_train_stage_dummy(&f->stage, m, &xd, &yd);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_run_forward(f, xd, 1, 0, &logits);
    } else {
        st = tdm_train_stage_batch(&f->stage, m, x, y, batch, &xd, &yd);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_run_forward(f, xd, batch, 0, &logits);
        if (st == TDM_STATUS_OK) st = tdm_model_loss(m, logits, yd, batch, 1.0f, &ls, NULL);
    }
    tdm_model_set_train(m, was_train);
    tdm_fsdp_pool_trim(f);
    if (st)
        return tdm_fsdp_fail(f, tdm_error_prefix(st, "fsdp eval_loss (rank %d, %d samples)",
                                                  f->rank, batch));
    *loss_sum = ls;
    return TDM_STATUS_OK;
}

/* ---- the full parameters ---- */

tdm_status tdm_fsdp_gather_params(tdm_fsdp *f, float *host_out, int root)
{
    tdm_device *d = f->dev;
    int mine = root < 0 || root == f->rank;
    TDM_REQUIRE(!mine || host_out, TDM_STATUS_INVALID_ARG, "fsdp gather_params: NULL output");
    if (f->o.sharding != TDM_FSDP_FULL_SHARD) {
        tdm_status st = tdm_fsdp_settle_params(f, 0);
        if (st) return tdm_fsdp_fail(f, st);
        for (int u = 0; mine && u < f->nu; u++)
            TDM_CHECK(tdm_dev_copy_to_host(d, host_out + f->u[u].offset,
                                           f->buf.pfull + f->u[u].full_off,
                                           (size_t)f->u[u].n_elem * sizeof(float)));
        return TDM_STATUS_OK;
    }
    for (int u = 0; u < f->nu; u++) {
        int had = f->u[u].params == TDM_FSDP_PARAMS_PRESENT;
        tdm_status st = tdm_fsdp_need_params(f, u, 0);
        if (st) return tdm_fsdp_fail(f, st);
        if (mine)
            TDM_CHECK(tdm_dev_copy_to_host(d, host_out + f->u[u].offset, f->u[u].pbuf,
                                           (size_t)f->u[u].n_elem * sizeof(float)));
        if (!had) TDM_CHECK(tdm_fsdp_release_params(f, u));
    }
    tdm_fsdp_pool_trim(f);
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_gather_grads(tdm_fsdp *f, float *host_out, int root)
{
    tdm_device *d = f->dev;
    int mine = root < 0 || root == f->rank;
    TDM_REQUIRE(!mine || host_out, TDM_STATUS_INVALID_ARG, "fsdp gather_grads: NULL output");
    float *blk = NULL, *sstage = NULL;
    size_t nb = 0, snb = 0;
    TDM_CHECK(tdm_fsdp_pool_get(f, (size_t)f->max_padded * sizeof(float), 0, &blk, &nb));
    tdm_status st = TDM_STATUS_OK;
    if (f->sdev != d)   /* host shards (offload) go up to be gathered */
        st = tdm_fsdp_pool_get(f, (size_t)(f->max_padded / f->world) * sizeof(float), 0,
                               &sstage, &snb);
    for (int u = 0; st == TDM_STATUS_OK && u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        const float *send;
        st = tdm_fsdp_comm_src(f, f->sdev, tdm_fsdp_gshard(f, u), x->shard, sstage, &send);
        if (st) break;
        tdm_comm_set_label(f->comm, "%s gather gradients unit %d", tdm_fsdp_tag(f), u);
        st = tdm_comm_all_gather(f->comm, send, blk, (size_t)x->shard, TDM_DTYPE_FLOAT32);
        if (st == TDM_STATUS_OK && mine)
            st = tdm_dev_copy_to_host(d, host_out + x->offset, blk,
                                      (size_t)x->n_elem * sizeof(float));
    }
    tdm_fsdp_pool_put(f, sstage, snb);
    tdm_fsdp_pool_put(f, blk, nb);
    tdm_fsdp_pool_trim(f);
    return st;
}
