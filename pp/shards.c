/* pp/shards.c: the micro-batches as virtual shards (tdm_pp_opts.shards,
 * pp/pp.h): each micro-batch's gradients and buffers kept apart for the
 * caller's fixed tree (dist/det.h), the GPT's tied head share moved to
 * the first stage per micro-batch, and the step's sum written back. The
 * schedule itself is pp/step.c's. */
#include "pp/pp_impl.h"

#include <stdlib.h>

/* The tied token embedding's gradient on this stage: the first stage's
 * own table, the last stage's copy; NULL where a stage has neither or the
 * pipeline has one stage (the model then adds both shares itself). */
static float *tdm_pp_tied_grad(tdm_pp *p, size_t *n)
{
    if (p->S == 1 || p->spec.kind != TDM_MODEL_GPT || (p->s != 0 && p->s != p->S - 1))
        return NULL;
    const tdm_tensor_info *t = tdm_model_param_info(p->m, p->s == 0 ? 0 : p->info.tied_param);
    *n = (size_t)t->n_elem;
    return tdm_model_grads(p->m) + t->offset;
}

tdm_status tdm_pp_shards_cut(tdm_pp *p, int batch)
{
    int M = p->o.micro_batches;
    if (!p->shards.lo) {
        p->shards.lo = calloc((size_t)M + 1, sizeof *p->shards.lo);
        TDM_REQUIRE(p->shards.lo, TDM_STATUS_OUT_OF_MEMORY, "pp: %d micro-batch bounds", M);
    }
    int big = 0;
    for (int i = 0; i < M; i++) {
        int lo = 0, hi = 0;
        p->o.shards.cut(p->o.shards.ctx, batch, i, &lo, &hi);
        /* in order, covering the batch, none empty */
        TDM_REQUIRE(lo == (i ? p->shards.lo[i] : 0) && hi > lo && hi <= batch &&
                    (i + 1 < M || hi == batch), TDM_STATUS_INVALID_ARG,
                    "pp: a batch of %d rows cut into %d virtual shards gives micro-batch %d "
                    "rows [%d, %d): every shard needs a sample (a short last batch of fewer "
                    "samples than shards cannot be cut)", batch, M, i, lo, hi);
        p->shards.lo[i] = lo;
        p->shards.lo[i + 1] = hi;
        if (hi - lo > big) big = hi - lo;
    }
    p->run.batch = batch;
    p->run.micro = big;
    p->run.n_mb = M;
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_shards_begin(tdm_pp *p)
{
    int64_t be = tdm_model_buffer_elems(p->m);
    size_t n = 0;
    if (be && !p->shards.snap) {
        TDM_CHECK(tdm_dev_alloc(p->dev, (size_t)be * sizeof(float), (void **)&p->shards.snap));
        TDM_CHECK(tdm_dev_alloc(p->dev, (size_t)(be * p->o.micro_batches) * sizeof(float),
                                (void **)&p->shards.fwd));
    }
    if (p->s == p->S - 1 && tdm_pp_tied_grad(p, &n) && !p->shards.head)
        TDM_CHECK(tdm_dev_alloc(p->dev, n * sizeof(float), (void **)&p->shards.head));
    p->shards.fwd0 = tdm_model_train_forwards(p->m);
    if (!be) return TDM_STATUS_OK;
    return tdm_dev_copy(p->dev, p->shards.snap, tdm_model_buffers(p->m),
                        (size_t)be * sizeof(float));
}

/* Every micro-batch's forward from the step's buffers (as every shard's
 * on one device), as the step's forward number one device gives its
 * shard (dropout's masks), what it left kept for its leaf. */
tdm_status tdm_pp_shards_before_forward(tdm_pp *p, int mb)
{
    tdm_model_set_train_forwards(p->m, p->shards.fwd0 + p->o.shards.first + mb);
    int64_t be = tdm_model_buffer_elems(p->m);
    if (!be) return TDM_STATUS_OK;
    return tdm_dev_copy(p->dev, tdm_model_buffers(p->m), p->shards.snap,
                        (size_t)be * sizeof(float));
}

tdm_status tdm_pp_shards_after_forward(tdm_pp *p, int mb)
{
    int64_t be = tdm_model_buffer_elems(p->m);
    if (!be) return TDM_STATUS_OK;
    return tdm_dev_copy(p->dev, p->shards.fwd + (int64_t)mb * be, tdm_model_buffers(p->m),
                        (size_t)be * sizeof(float));
}

/* The first stage of a GPT: the micro-batch's head share (from the last
 * stage) as its token embedding's gradient before the embedding's
 * backward adds its rows to it, as one device's backward does. */
tdm_status tdm_pp_shards_before_backward(tdm_pp *p, int mb)
{
    size_t n = 0;
    float *g = tdm_pp_tied_grad(p, &n);
    if (!g || p->s != 0) return TDM_STATUS_OK;
    tdm_comm_set_label(p->comm, "pp tied head share mb %d stage %d->0", mb, p->S - 1);
    tdm_status st = tdm_comm_recv(p->comm, g, n, TDM_DTYPE_FLOAT32, p->S - 1);
    if (st) return tdm_pp_fail(p, st, "B%d: the tied head's share from stage %d", mb, p->S - 1);
    return TDM_STATUS_OK;
}

static tdm_status tdm_pp_shards_head_wait(tdm_pp *p)
{
    if (!p->shards.head_send) return TDM_STATUS_OK;
    tdm_status st = tdm_comm_work_wait(p->shards.head_send, -1);
    tdm_comm_work_free(p->shards.head_send);
    p->shards.head_send = NULL;
    if (st) return tdm_pp_fail(p, st, "the tied head's share to stage 0");
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_shards_after_backward(tdm_pp *p, int mb)
{
    size_t n = 0;
    float *g = tdm_pp_tied_grad(p, &n);
    tdm_status st;
    if (g && p->s == p->S - 1) {
        /* the share goes to the first stage; this copy's leaf is zero */
        TDM_CHECK(tdm_pp_shards_head_wait(p));
        TDM_CHECK(tdm_dev_copy(p->dev, p->shards.head, g, n * sizeof(float)));
        TDM_CHECK(tdm_dev_memset_zero(p->dev, g, n * sizeof(float)));
        TDM_CHECK(tdm_dev_sync(p->dev));
        tdm_comm_set_label(p->comm, "pp tied head share mb %d stage %d->0", mb, p->s);
        if ((st = tdm_comm_isend(p->comm, p->shards.head, n, TDM_DTYPE_FLOAT32, 0,
                                 &p->shards.head_send)))
            return tdm_pp_fail(p, st, "B%d: the tied head's share to stage 0", mb);
    }
    int64_t be = tdm_model_buffer_elems(p->m);
    if (be)
        TDM_CHECK(tdm_dev_copy(p->dev, tdm_model_buffers(p->m), p->shards.fwd + (int64_t)mb * be,
                               (size_t)be * sizeof(float)));
    double loss = p->s == p->S - 1 ? p->shards.mb_loss : 0.0;
    if ((st = p->o.shards.leaf(p->o.shards.ctx, p->m, mb, loss)))
        return tdm_pp_fail(p, st, "B%d: its virtual shard's gradients", mb);
    return tdm_model_zero_grad(p->m);
}

tdm_status tdm_pp_shards_end(tdm_pp *p)
{
    /* every replica ends the step at one device's count of forwards */
    int total = p->o.shards.total > 0 ? p->o.shards.total : p->o.micro_batches;
    tdm_model_set_train_forwards(p->m, p->shards.fwd0 + total);
    TDM_CHECK(tdm_pp_shards_head_wait(p));
    double loss = 0.0;
    tdm_status st = p->o.shards.reduce(p->o.shards.ctx, p->m, &loss);
    if (st) return tdm_pp_fail(p, st, "the sum of the virtual shards' gradients");
    if (p->s == p->S - 1) p->run.loss_sum = loss;
    size_t n = 0;
    float *g = tdm_pp_tied_grad(p, &n);
    if (!g) return TDM_STATUS_OK;
    /* the first stage's sum is the whole gradient of the token embedding:
     * the last stage's copy takes it, so both step alike */
    tdm_comm_set_label(p->comm, "pp tied embedding grad stage 0->%d", p->S - 1);
    st = p->s == 0 ? tdm_comm_send(p->comm, g, n, TDM_DTYPE_FLOAT32, p->S - 1)
                   : tdm_comm_recv(p->comm, g, n, TDM_DTYPE_FLOAT32, 0);
    if (st) return tdm_pp_fail(p, st, "the tied embedding's gradient %s stage %s",
                               p->s == 0 ? "to" : "from", p->s == 0 ? "last" : "0");
    return TDM_STATUS_OK;
}

void tdm_pp_shards_free(tdm_pp *p)
{
    if (p->shards.head_send) {
        (void)tdm_comm_work_wait(p->shards.head_send, -1);
        tdm_comm_work_free(p->shards.head_send);
    }
    free(p->shards.lo);
    if (p->shards.snap) tdm_dev_free(p->dev, p->shards.snap);
    if (p->shards.fwd) tdm_dev_free(p->dev, p->shards.fwd);
    if (p->shards.head) tdm_dev_free(p->dev, p->shards.head);
    p->shards.head_send = NULL;
    p->shards.lo = NULL;
    p->shards.snap = p->shards.fwd = p->shards.head = NULL;
}
