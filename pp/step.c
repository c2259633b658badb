/* pp/step.c: running a schedule on one stage: each action (F i: receive
 * the input, forward, send the output; B i: receive the output's gradient
 * or take the loss's, backward, send the input's), the transfers (each
 * recv posted as soon as its buffer is free, so it arrives while the
 * stage computes; each send issued as soon as its data exists and waited
 * for only when its buffer is needed again), the tied embedding's
 * gradient, the memory levers (pp/levers.c) and the optimizer step, the
 * loss for the global batch, evaluation through the pipeline, and the
 * timings. Set-up is pp/pp.c. */
#include "pp/pp_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"

/* Micro-batch i's first row in the batch, and its rows. */
static int64_t tdm_pp_mb_lo(const tdm_pp *p, int i)
{
    if (tdm_pp_sharded(p) && !p->run.eval) return p->shards.lo[i];
    return (int64_t)i * p->run.micro;
}

static int tdm_pp_mb_size(const tdm_pp *p, int i)
{
    if (tdm_pp_sharded(p) && !p->run.eval) return p->shards.lo[i + 1] - p->shards.lo[i];
    int left = p->run.batch - i * p->run.micro;
    return left < p->run.micro ? left : p->run.micro;
}

/* The global batch's micro-batches: models/accum.h's cut. */
static tdm_status tdm_pp_cut(tdm_pp *p, int batch, int eval)
{
    if (tdm_pp_sharded(p) && !eval) return tdm_pp_shards_cut(p, batch);
    int M = p->o.micro_batches, fixed = p->o.micro_size;
    p->run.batch = batch;
    p->run.micro = (batch + M - 1) / M;
    if (fixed > 0 && batch <= (int64_t)fixed * M) p->run.micro = batch < fixed ? batch : fixed;
    p->run.n_mb = (batch + p->run.micro - 1) / p->run.micro;
    return TDM_STATUS_OK;
}

static double tdm_pp_ms(uint64_t t0, uint64_t t1) { return (double)(t1 - t0) * 1e-6; }

/* ---- transfers ---- */

/* The activation sets this run cycles through: the schedule's in-flight
 * count (evaluation: 2, one computing while the other is sent, but on
 * the last stage, which sends none, and never more than the
 * micro-batches: then an evaluation at a step's batch holds no more than
 * the step's sets); and its input slots: one more on a stage that
 * receives, so that micro-batch i + 1's input arrives while i computes,
 * bounded by the micro-batches. */
static void tdm_pp_slots(tdm_pp *p)
{
    int eval_sets = p->s + 1 == p->S ? 1 : p->run.n_mb < 2 ? p->run.n_mb : 2;
    int sets = p->run.eval ? eval_sets : tdm_pp_schedule_in_flight(p->sched, p->s);
    if (sets < 1) sets = 1;
    int n_in = sets + 1 < p->run.n_mb ? sets + 1 : p->run.n_mb;
    if (n_in < sets) n_in = sets;
    p->run.sets = sets;
    p->run.n_in = p->s > 0 ? n_in : 0;
}

static tdm_status tdm_pp_wait(tdm_pp *p, tdm_pp_xfer *x, double *ms, const char *what, int peer)
{
    if (!x->work) return TDM_STATUS_OK;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_comm_work_wait(x->work, -1);
    *ms += tdm_time_ms_since(t0);
    tdm_comm_work_free(x->work);
    x->work = NULL;
    if (st) return tdm_pp_fail(p, st, "%s mb %d %s stage %d", what, x->mb,
                               what[0] == 's' ? "to" : "from", peer);
    return TDM_STATUS_OK;
}

/* Posts every recv whose buffer is free, in micro-batch order. */
static tdm_status tdm_pp_post(tdm_pp *p)
{
    while (p->link.act_in && p->run.act_next < p->run.n_mb) {
        int i = p->run.act_next, k = i % p->run.n_in;
        if (p->buf.owner[k] >= 0 || p->run.act_recv[k].work) break;
        tdm_comm_set_label(p->link.act_in, "pp recv act mb %d stage %d->%d", i, p->s - 1, p->s);
        tdm_status st = tdm_comm_irecv(p->link.act_in, p->buf.in[k],
                                       (size_t)tdm_pp_mb_size(p, i) * (size_t)p->info.in_elems,
                                       TDM_DTYPE_FLOAT32, p->s - 1, &p->run.act_recv[k].work);
        if (st) return tdm_pp_fail(p, st, "recv act mb %d from stage %d", i, p->s - 1);
        p->run.act_recv[k].mb = i;
        p->buf.owner[k] = i;
        p->run.act_next++;
        p->stats.transfers++;
    }
    while (!p->run.eval && p->link.grad_in && p->run.grad_next < p->run.n_mb) {
        int i = p->run.grad_next, b = i % 2;
        if (p->buf.gin_owner[b] >= 0) break;
        tdm_comm_set_label(p->link.grad_in, "pp recv grad mb %d stage %d->%d", i, p->s + 1,
                           p->s);
        tdm_status st = tdm_comm_irecv(p->link.grad_in, p->buf.gin[b],
                                       (size_t)tdm_pp_mb_size(p, i) * (size_t)p->info.out_elems,
                                       TDM_DTYPE_FLOAT32, p->s + 1, &p->run.grad_recv[b].work);
        if (st) return tdm_pp_fail(p, st, "recv grad mb %d from stage %d", i, p->s + 1);
        p->run.grad_recv[b].mb = i;
        p->buf.gin_owner[b] = i;
        p->run.grad_next++;
        p->stats.transfers++;
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_pp_send(tdm_pp *p, tdm_comm *link, tdm_pp_xfer *x, const float *buf,
                              int64_t per_sample, int i, int peer, const char *kind)
{
    tdm_comm_set_label(link, "pp send %s mb %d stage %d->%d", kind, i, p->s, peer);
    tdm_status st = tdm_comm_isend(link, buf, (size_t)tdm_pp_mb_size(p, i) * (size_t)per_sample,
                                   TDM_DTYPE_FLOAT32, peer, &x->work);
    if (st) return tdm_pp_fail(p, st, "send %s mb %d to stage %d", kind, i, peer);
    x->mb = i;
    p->stats.transfers++;
    return TDM_STATUS_OK;
}

/* Overlap: the transfers still in flight when a compute begins that have
 * completed when it ends ran while the stage computed. */
static void tdm_pp_pending_add(tdm_pp *p, tdm_comm_work *w)
{
    int done = 1;
    if (!w || tdm_comm_work_test(w, &done) != TDM_STATUS_OK || done) return;
    if (p->stats.n_pending == p->stats.cap_pending) {
        int cap = p->stats.cap_pending ? 2 * p->stats.cap_pending : 16;
        tdm_comm_work **a = realloc(p->stats.pending, (size_t)cap * sizeof *a);
        if (!a) return;   /* a statistic: skip rather than fail the step */
        p->stats.pending = a;
        p->stats.cap_pending = cap;
    }
    p->stats.pending[p->stats.n_pending++] = w;
}

static void tdm_pp_overlap_begin(tdm_pp *p)
{
    p->stats.n_pending = 0;
    for (int k = 0; k < p->buf.n; k++) {
        tdm_pp_pending_add(p, p->run.act_recv[k].work);
        tdm_pp_pending_add(p, p->run.act_send[k].work);
    }
    for (int b = 0; b < 2; b++) tdm_pp_pending_add(p, p->run.grad_recv[b].work);
    tdm_pp_pending_add(p, p->run.grad_send.work);
}

static void tdm_pp_overlap_end(tdm_pp *p)
{
    for (int i = 0; i < p->stats.n_pending; i++) {
        int done = 0;
        if (tdm_comm_work_test(p->stats.pending[i], &done) == TDM_STATUS_OK && done)
            p->stats.overlapped++;
    }
    p->stats.n_pending = 0;
}

void tdm_pp_drain(tdm_pp *p)
{
    tdm_pp_xfer *all[4] = {p->run.act_recv, p->run.act_send, p->run.grad_recv, &p->run.grad_send};
    int n[4] = {p->buf.n, p->buf.n, 2, 1};
    for (int a = 0; a < 4; a++)
        for (int k = 0; all[a] && k < n[a]; k++)
            if (all[a][k].work) {
                (void)tdm_comm_work_wait(all[a][k].work, -1);
                tdm_comm_work_free(all[a][k].work);
                all[a][k].work = NULL;
            }
    for (int k = 0; p->buf.owner && k < p->buf.n; k++) p->buf.owner[k] = -1;
    for (int b = 0; b < 2; b++) p->buf.gin_owner[b] = -1;
}

static void tdm_pp_event_add(tdm_pp *p, tdm_pp_op op, int mb, uint64_t t0, uint64_t t1)
{
    if (p->stats.n_ev == p->stats.cap_ev) {
        int cap = p->stats.cap_ev ? 2 * p->stats.cap_ev : 64;
        tdm_pp_event *e = realloc(p->stats.ev, (size_t)cap * sizeof *e);
        if (!e) return;   /* a trace: skip rather than fail the step */
        p->stats.ev = e;
        p->stats.cap_ev = cap;
    }
    p->stats.ev[p->stats.n_ev++] = (tdm_pp_event){.op = op, .mb = mb, .t0_ns = t0, .t1_ns = t1};
}

/* ---- actions ---- */

/* The last stage's loss (and correct count) of micro-batch i, from the
 * current set's output; the gradient into the model's loss scratch when
 * grad_scale > 0. */
static tdm_status tdm_pp_loss(tdm_pp *p, int i, int k, float grad_scale, tdm_pp_phases *ph)
{
    uint64_t t0 = tdm_time_ns();
    int n = tdm_pp_mb_size(p, i), rows = tdm_model_out_rows(p->m);
    const int32_t *yh = p->run.y + tdm_pp_mb_lo(p, i) * rows, *yd = yh;
    if (!p->host) {
        TDM_CHECK(tdm_dev_copy_from_host(p->dev, p->buf.y, yh, (size_t)n * rows * sizeof *yh));
        yd = p->buf.y;
    }
    double ls = 0.0;
    int64_t correct = 0;
    TDM_CHECK(tdm_model_loss(p->m, p->buf.out[k], yd, n, grad_scale, &ls,
                             grad_scale > 0.0f ? tdm_model_loss_grad(p->m) : NULL));
    TDM_CHECK(tdm_model_count_correct(p->m, yh, n, &correct));
    p->run.loss_sum += ls;
    p->shards.mb_loss = ls;
    p->run.correct += correct;
    ph->loss += tdm_time_ms_since(t0);
    return TDM_STATUS_OK;
}

static tdm_status tdm_pp_forward(tdm_pp *p, int i, tdm_pp_phases *ph)
{
    int k = i % p->run.sets, n = tdm_pp_mb_size(p, i);
    const void *in;
    if (p->s > 0) {
        int j = i % p->run.n_in;
        TDM_CHECK(tdm_pp_post(p));
        if (p->run.act_recv[j].mb != i || !p->run.act_recv[j].work)
            return tdm_pp_fail(p, TDM_STATUS_INTERNAL, "F%d: its input's recv was not posted "
                               "(slot %d holds micro-batch %d)", i, j, p->buf.owner[j]);
        TDM_CHECK(tdm_pp_wait(p, &p->run.act_recv[j], &ph->recv_wait, "recv act", p->s - 1));
        in = p->buf.in[j];
    } else {
        in = p->run.x + tdm_pp_mb_lo(p, i) * p->info.in_elems * 4;
        if (!p->host) {
            TDM_CHECK(tdm_dev_copy_from_host(p->dev, p->buf.x[k], in,
                                             (size_t)n * (size_t)p->info.in_elems * 4));
            in = p->buf.x[k];
        }
    }
    /* the set's previous output may still be on its way downstream */
    TDM_CHECK(tdm_pp_wait(p, &p->run.act_send[k], &ph->send_wait, "send act", p->s + 1));
    TDM_CHECK(tdm_model_select_act_set(p->m, k));
    int shard = tdm_pp_sharded(p) && !p->run.eval;
    if (shard) TDM_CHECK(tdm_pp_shards_before_forward(p, i));
    tdm_pp_overlap_begin(p);
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_model_stage_forward(p->m, in, n, &p->buf.out[k]);
    uint64_t t1 = tdm_time_ns();
    tdm_pp_overlap_end(p);
    if (st) return tdm_pp_fail(p, st, "F%d", i);
    if (shard) TDM_CHECK(tdm_pp_shards_after_forward(p, i));
    ph->forward += tdm_pp_ms(t0, t1);
    tdm_pp_event_add(p, TDM_PP_FORWARD, i, t0, t1);
    size_t sb = tdm_model_act_set_bytes(p->m);
    if (sb > p->stats.set_bytes) p->stats.set_bytes = sb;
    if (p->link.act_out)
        TDM_CHECK(tdm_pp_send(p, p->link.act_out, &p->run.act_send[k], p->buf.out[k],
                              p->info.out_elems, i, p->s + 1, "act"));
    if (p->run.eval) {
        if (p->s + 1 == p->S) {
            st = tdm_pp_loss(p, i, k, 0.0f, ph);
            if (st) return tdm_pp_fail(p, st, "loss of mb %d", i);
        }
        if (p->s > 0) p->buf.owner[i % p->run.n_in] = -1;   /* no backward: its input is free */
    }
    return tdm_pp_post(p);
}

static tdm_status tdm_pp_backward(tdm_pp *p, int i, tdm_pp_phases *ph)
{
    int k = i % p->run.sets, b = i % 2;
    const float *dy;
    TDM_CHECK(tdm_model_select_act_set(p->m, k));
    if (p->s + 1 == p->S) {
        /* 1/B_global for every micro-batch: the sum over them is the
         * global batch's mean-loss gradient (models/accum.h) */
        tdm_status st = tdm_pp_loss(p, i, k, p->run.grad_scale, ph);
        if (st) return tdm_pp_fail(p, st, "loss of mb %d", i);
        dy = tdm_model_loss_grad(p->m);
    } else {
        TDM_CHECK(tdm_pp_post(p));
        if (p->run.grad_recv[b].mb != i || !p->run.grad_recv[b].work)
            return tdm_pp_fail(p, TDM_STATUS_INTERNAL, "B%d: its gradient's recv was not posted",
                               i);
        TDM_CHECK(tdm_pp_wait(p, &p->run.grad_recv[b], &ph->recv_wait, "recv grad", p->s + 1));
        dy = p->buf.gin[b];
    }
    /* the input gradient is the model's scratch: the last one must be out */
    TDM_CHECK(tdm_pp_wait(p, &p->run.grad_send, &ph->send_wait, "send grad", p->s - 1));
    int sync = i == p->run.n_mb - 1 && p->o.grad_sync.begin && !tdm_pp_sharded(p);
    if (tdm_pp_sharded(p)) TDM_CHECK(tdm_pp_shards_before_backward(p, i));
    if (sync) {
        tdm_status st = p->o.grad_sync.begin(p->o.grad_sync.ctx);
        if (st) return tdm_pp_fail(p, st, "B%d: gradient sync", i);
    }
    const float *dx = NULL;
    tdm_pp_overlap_begin(p);
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_model_stage_backward(p->m, dy, &dx);
    uint64_t t1 = tdm_time_ns();
    tdm_pp_overlap_end(p);
    if (sync) {
        uint64_t t2 = tdm_time_ns();
        tdm_status ss = p->o.grad_sync.end(p->o.grad_sync.ctx, st);
        ph->grad_sync += tdm_time_ms_since(t2);
        if (ss) return tdm_pp_fail(p, ss, "B%d: gradient sync", i);
    }
    if (st) return tdm_pp_fail(p, st, "B%d", i);
    ph->backward += tdm_pp_ms(t0, t1);
    tdm_pp_event_add(p, TDM_PP_BACKWARD, i, t0, t1);
    if (p->s + 1 < p->S) p->buf.gin_owner[b] = -1;
    if (p->s > 0) p->buf.owner[i % p->run.n_in] = -1;   /* its input is free */
    if (p->link.grad_out)
        TDM_CHECK(tdm_pp_send(p, p->link.grad_out, &p->run.grad_send, dx, p->info.in_elems, i,
                              p->s - 1, "grad"));
    /* after the send: the gradient goes on upstream while the leaf is taken */
    if (tdm_pp_sharded(p)) TDM_CHECK(tdm_pp_shards_after_backward(p, i));
    return tdm_pp_post(p);
}

/* Every send issued is complete. */
static tdm_status tdm_pp_flush(tdm_pp *p, tdm_pp_phases *ph)
{
    for (int k = 0; k < p->buf.n; k++)
        TDM_CHECK(tdm_pp_wait(p, &p->run.act_send[k], &ph->send_wait, "send act", p->s + 1));
    return tdm_pp_wait(p, &p->run.grad_send, &ph->send_wait, "send grad", p->s - 1);
}

/* ---- the step ---- */

static tdm_status tdm_pp_begin(tdm_pp *p, const void *x, const int32_t *y, int batch, int eval)
{
    /* refused on this stage: the others, waiting for it, are stopped too */
    if (batch < 1)
        return tdm_pp_fail(p, tdm_error_set(TDM_STATUS_INVALID_ARG, "batch %d (expected at "
                                            "least 1)", batch), "step");
    if (p->s == 0 && !x)
        return tdm_pp_fail(p, tdm_error_set(TDM_STATUS_INVALID_ARG, "the first stage needs "
                                            "the inputs (x is NULL)"), "step");
    if (p->s + 1 == p->S && !y)
        return tdm_pp_fail(p, tdm_error_set(TDM_STATUS_INVALID_ARG, "the last stage needs "
                                            "the targets (y is NULL)"), "step");
    TDM_CHECK(tdm_pp_cut(p, batch, eval));
    p->run.eval = eval;
    p->run.x = x;
    p->run.y = y;
    if (!p->sched || p->sched->micro != p->run.n_mb || p->sched->kind != p->o.schedule) {
        tdm_pp_schedule_free(p->sched);
        p->sched = NULL;
        TDM_CHECK(tdm_pp_schedule_build(&p->sched, p->o.schedule, p->S, p->run.n_mb));
    }
    tdm_pp_slots(p);
    TDM_CHECK(tdm_pp_buffers(p, p->run.micro, p->run.sets, p->run.n_in));
    p->run.act_next = p->run.grad_next = 0;
    p->run.loss_sum = 0.0;
    p->run.correct = 0;
    p->stats.n_ev = 0;
    p->run.t0 = tdm_time_ns();
    return tdm_pp_post(p);
}

/* The global batch's loss and correct count, from the last stage to all. */
static tdm_status tdm_pp_share_loss(tdm_pp *p)
{
    double v[2] = {p->run.loss_sum, (double)p->run.correct};
    tdm_comm_set_label(p->hcomm, "pp loss of the global batch");
    tdm_status st = tdm_comm_broadcast(p->hcomm, v, v, 2, TDM_DTYPE_FLOAT64, p->S - 1);
    if (st) return tdm_pp_fail(p, st, "sharing the loss");
    p->run.loss_sum = v[0];
    p->run.correct = (int64_t)v[1];
    return TDM_STATUS_OK;
}

/* The GPT's token embedding: the first stage's share of its gradient and
 * the last stage's (its tied copy) become first + last on both, in that
 * one order, so the two copies take the same optimizer step. */
static tdm_status tdm_pp_tied(tdm_pp *p)
{
    if (p->S == 1 || p->spec.kind != TDM_MODEL_GPT || (p->s != 0 && p->s != p->S - 1))
        return TDM_STATUS_OK;
    int idx = p->s == 0 ? 0 : p->info.tied_param, peer = p->s == 0 ? p->S - 1 : 0;
    const tdm_tensor_info *t = tdm_model_param_info(p->m, idx);
    float *g = tdm_model_grads(p->m) + t->offset;
    size_t n = (size_t)t->n_elem;
    if (!p->buf.tied) TDM_CHECK(tdm_dev_alloc(p->dev, n * sizeof(float), (void **)&p->buf.tied));
    tdm_comm_set_label(p->comm, "pp tied embedding grad stage %d<->%d", 0, p->S - 1);
    tdm_status st;
    /* the first stage sends first, the last receives first */
    if (p->s == 0) {
        st = tdm_comm_send(p->comm, g, n, TDM_DTYPE_FLOAT32, peer);
        tdm_comm_set_label(p->comm, "pp tied embedding grad stage %d<-%d", 0, p->S - 1);
        if (!st) st = tdm_comm_recv(p->comm, p->buf.tied, n, TDM_DTYPE_FLOAT32, peer);
    } else {
        st = tdm_comm_recv(p->comm, p->buf.tied, n, TDM_DTYPE_FLOAT32, peer);
        tdm_comm_set_label(p->comm, "pp tied embedding grad stage %d->%d", p->S - 1, 0);
        if (!st) st = tdm_comm_send(p->comm, g, n, TDM_DTYPE_FLOAT32, peer);
    }
    if (st) return tdm_pp_fail(p, st, "exchanging the tied embedding's gradient with stage %d",
                               peer);
    /* g = 1 * other + g: first + last on both (addition commutes exactly) */
    return tdm_dev_axpy(p->dev, (int64_t)n, 1.0f, p->buf.tied, g);
}

static void tdm_pp_account(tdm_pp *p, tdm_pp_phases *ph)
{
    ph->bubble = ph->pipeline - ph->forward - ph->backward - ph->loss;
    if (ph->bubble < 0) ph->bubble = 0;
    p->stats.last = *ph;
    double *s = &p->stats.sum.forward;
    const double *l = &ph->forward;
    for (size_t i = 0; i < sizeof *ph / sizeof(double); i++) s[i] += l[i];
}

tdm_status tdm_pp_step(tdm_pp *p, const void *x, const int32_t *y, int batch, double *loss_mean)
{
    double sum = 0.0;
    TDM_CHECK(tdm_pp_step_scaled(p, x, y, batch, batch > 0 ? 1.0f / (float)batch : 0.0f, &sum));
    if (loss_mean) *loss_mean = batch > 0 ? sum / batch : 0.0;
    return TDM_STATUS_OK;
}

/* A replica's empty share of the global batch (batch 0, every stage of
 * the replica alike): no micro-batch and no transfer between the stages;
 * the stage's zero gradient joins the replicas' sum (grad_sync.empty),
 * then the tied sum, the levers and the optimizer step run as in a step
 * with samples. Without grad_sync.empty (no replicas), or with shards
 * (every replica's shards are whole), batch 0 is refused. */
static tdm_status tdm_pp_begin_empty(tdm_pp *p, tdm_pp_phases *ph)
{
    if (!p->o.grad_sync.empty || tdm_pp_sharded(p))
        return tdm_pp_fail(p, tdm_error_set(TDM_STATUS_INVALID_ARG, "batch 0 (expected at "
                                            "least 1; an empty share of a global batch needs "
                                            "grad_sync.empty, and no shards)"), "step");
    p->run.batch = p->run.n_mb = 0;
    p->run.eval = 0;
    p->run.x = NULL;
    p->run.y = NULL;
    p->run.loss_sum = 0.0;
    p->run.correct = 0;
    p->stats.n_ev = 0;
    p->run.t0 = tdm_time_ns();
    tdm_model_set_train(p->m, 1);
    TDM_CHECK(tdm_model_zero_grad(p->m));
    tdm_status st = p->o.grad_sync.empty(p->o.grad_sync.ctx);
    ph->grad_sync += tdm_time_ms_since(p->run.t0);
    if (st) return tdm_pp_fail(p, st, "gradient sync of an empty share");
    return TDM_STATUS_OK;
}

static tdm_status tdm_pp_step_run(tdm_pp *p, const void *x, const int32_t *y, int batch,
                                  float grad_scale, double *loss_sum)
{
    tdm_pp_phases ph = {0};
    /* a replica summed by grad_sync: its micro-batch mb is the step's
     * forward first + mb, as one device's (dropout's masks; pp.h) */
    int renum = !tdm_pp_sharded(p) && p->o.shards.total > 0;
    int64_t fwd0 = tdm_model_train_forwards(p->m);
    if (renum) tdm_model_set_train_forwards(p->m, fwd0 + p->o.shards.first);
    if (batch == 0) {
        TDM_CHECK(tdm_pp_begin_empty(p, &ph));
    } else {
        TDM_CHECK(tdm_pp_begin(p, x, y, batch, 0));
        /* loss scaling: 1/B times the scale, one rounding (exact for the
         * scaler's powers of two), as one device's step */
        p->run.grad_scale = grad_scale * tdm_pp_loss_scale(p);
        tdm_model_set_train(p->m, 1);
        TDM_CHECK(tdm_model_zero_grad(p->m));
        if (tdm_pp_sharded(p)) TDM_CHECK(tdm_pp_shards_begin(p));
        const tdm_pp_action *a = p->sched->actions[p->s];
        for (int j = 0; j < p->sched->n_actions[p->s]; j++) {
            if (a[j].op == TDM_PP_FORWARD) TDM_CHECK(tdm_pp_forward(p, a[j].mb, &ph));
            else TDM_CHECK(tdm_pp_backward(p, a[j].mb, &ph));
        }
        TDM_CHECK(tdm_pp_flush(p, &ph));
    }
    uint64_t t1 = tdm_time_ns();
    ph.pipeline = tdm_pp_ms(p->run.t0, t1);
    /* every replica ends the step at one device's count */
    if (renum) tdm_model_set_train_forwards(p->m, fwd0 + p->o.shards.total);
    TDM_CHECK(tdm_pp_sharded(p) ? tdm_pp_shards_end(p) : tdm_pp_tied(p));
    /* a sequence-parallel stage's partial LayerNorm gradients (models/) */
    tdm_status ss = tdm_model_seq_sum_grads(p->m);
    if (ss) return tdm_pp_fail(p, ss, "sequence parallelism's LayerNorm gradients");
    uint64_t t2 = tdm_time_ns();
    ph.tied = tdm_pp_ms(t1, t2);
    int skip = 0;
    TDM_CHECK(tdm_pp_levers_apply(p, &skip));
    tdm_status st = skip ? TDM_STATUS_OK
                    : p->opt ? tdm_optim_step(p->opt)
                             : p->o.optim_step.fn(p->o.optim_step.ctx, p->m);
    if (!st) st = tdm_dev_sync(p->dev);
    if (st) return tdm_pp_fail(p, st, "optimizer step");
    tdm_pp_levers_done(p, skip);
    uint64_t t3 = tdm_time_ns();
    ph.step = tdm_pp_ms(t2, t3);
    TDM_CHECK(tdm_pp_share_loss(p));
    ph.total = tdm_time_ms_since(p->run.t0);
    p->stats.steps++;
    tdm_pp_account(p, &ph);
    tdm_comm_set_step(p->comm, p->stats.steps);
    if (p->hcomm != p->comm) tdm_comm_set_step(p->hcomm, p->stats.steps);
    for (int k = 0; k < TDM_PP_MAX_LANES; k++)
        if (p->link.lane[k]) tdm_comm_set_step(p->link.lane[k], p->stats.steps);
    if (loss_sum) *loss_sum = p->run.loss_sum;
    return TDM_STATUS_OK;
}

/* Every failure inside a step or an evaluation aborts the pipeline (pp.h),
 * also those returned as they are (an allocation, the schedule, zero_grad,
 * a device copy): the other stages then stop with this one's reason
 * instead of waiting for it until their deadline. */
tdm_status tdm_pp_step_scaled(tdm_pp *p, const void *x, const int32_t *y, int batch,
                              float grad_scale, double *loss_sum)
{
    tdm_status st = tdm_pp_step_run(p, x, y, batch, grad_scale, loss_sum);
    if (st && !p->failed) st = tdm_pp_fail(p, st, "step");
    return st;
}

static tdm_status tdm_pp_eval_run(tdm_pp *p, const void *x, const int32_t *y, int batch,
                                  double *loss_sum, int64_t *correct)
{
    tdm_pp_phases ph = {0};
    int was = tdm_model_is_train(p->m);
    TDM_CHECK(tdm_pp_begin(p, x, y, batch, 1));
    tdm_model_set_train(p->m, 0);
    tdm_status st = TDM_STATUS_OK;
    for (int i = 0; i < p->run.n_mb && !st; i++) st = tdm_pp_forward(p, i, &ph);
    if (!st) st = tdm_pp_flush(p, &ph);
    tdm_model_set_train(p->m, was);
    if (!st) st = tdm_pp_share_loss(p);
    if (st) return st;
    if (loss_sum) *loss_sum = p->run.loss_sum;
    if (correct) *correct = p->run.correct;
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_evaluate(tdm_pp *p, const tdm_dataset *d, int batch, double *loss_mean,
                           double *accuracy)
{
    TDM_REQUIRE(d && d->n > 0 && batch > 0, TDM_STATUS_INVALID_ARG,
                "pp evaluate: a non-empty dataset and batch > 0 are required");
    /* a dataset holds one label per image: every stage judges from the
     * spec, so all refuse together (before any transfer) */
    const tdm_model_spec *spec = tdm_model_get_spec(p->m);
    TDM_REQUIRE(spec->kind != TDM_MODEL_GPT, TDM_STATUS_INVALID_ARG,
                "pp evaluate: the GPT predicts every position of a window, not one label per "
                "sample of a dataset of images (evaluate text windows with "
                "tdm_pp_eval_batch)");
    int64_t feat = tdm_data_features(d);
    int64_t want = spec->kind == TDM_MODEL_MLP
                       ? spec->dims[0]
                       : (int64_t)spec->in_c * spec->in_h * spec->in_w;
    TDM_REQUIRE(feat == want, TDM_STATUS_INVALID_ARG,
                "pp evaluate: the dataset has %lld features per sample, the model takes %lld",
                (long long)feat, (long long)want);
    tdm_status st = TDM_STATUS_OK;
    int64_t *idx = malloc((size_t)batch * sizeof *idx);
    float *x = malloc((size_t)batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)batch * sizeof *y);
    double loss = 0.0;
    int64_t correct = 0;
    if (!idx || !x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp evaluate: a batch of %d", batch);
        goto fail;
    }
    for (int64_t lo = 0; lo < d->n; lo += batch) {
        int n = d->n - lo < batch ? (int)(d->n - lo) : batch;
        for (int i = 0; i < n; i++) idx[i] = lo + i;
        tdm_data_gather(d, idx, n, x, y);
        double ls;
        int64_t c;
        TDM_TRY(tdm_pp_eval_batch(p, x, y, n, &ls, &c));
        loss += ls;
        correct += c;
    }
    *loss_mean = loss / (double)d->n;
    *accuracy = (double)correct / ((double)d->n * tdm_model_out_rows(p->m));
fail:
    free(idx);
    free(x);
    free(y);
    return st;
}

tdm_status tdm_pp_eval_batch(tdm_pp *p, const void *x, const int32_t *y, int batch,
                             double *loss_sum, int64_t *correct)
{
    tdm_status st = tdm_pp_eval_run(p, x, y, batch, loss_sum, correct);
    if (st && !p->failed) st = tdm_pp_fail(p, st, "evaluation");
    return st;
}
