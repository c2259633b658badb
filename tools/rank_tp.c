/* tools/rank_tp.c: tensor parallelism's table for the CLI (tools/ranks.h):
 * a rank is one rank of a tensor-parallel group (tp/tp.h: Megatron's
 * column/row split of the MLP and the GPT), and with --mesh dp=D,tp=N one rank of one
 * of D replicas of the group, whose gradients are summed over the dp
 * dimension's sub-communicator after backward. The layout (the mesh and
 * the plan's checks before any rank starts), the rank's step (its
 * replica's share of the global batch through the group), evaluation
 * (every group evaluates the test set), checkpoints (the whole model's
 * state gathered on rank 0 into the one file every mode reads; any mode's
 * file sliced by every rank) and the summary (rank 0's phases, memory and
 * the bytes its communicator counted).
 *
 * A GPT's rank trains on its replica's windows (every rank of a group
 * draws the same) and evaluates the validation windows through the group.
 *
 * The rank's r->m is the whole model's tables without storage
 * (tdm_model_init_tables): what the CLI reads of a model (its input and
 * output sizes, its parameter count); the parameters live in tp/. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/batch.h"
#include "dist/mesh.h"
#include "dist/step.h"
#include "tools/ranks.h"
#include "tools/train_modes.h"
#include "tp/tp.h"

typedef struct tdm_tool_tp {
    tdm_tp *p;
    tdm_mesh *dev_mesh;          /* a GPU's: the mesh over the device communicator */
    tdm_comm *tcomm;             /* the group's host communicator (borrowed) */
    tdm_comm *dcomm;             /* the dp dimension's host communicator (borrowed) */
    tdm_comm *tdev;              /* the group's device communicator (borrowed) */
    int rep, reps;
    int in_elems, out_rows;      /* per sample: 4-byte inputs, target rows */
} tdm_tool_tp;

/* ---- the layout ---- */

tdm_status tdm_tool_tp_check(const tdm_tool_build *b, int world, tdm_mesh_shape *shape)
{
    if (b->pp.mesh) {
        if (tdm_mesh_parse(b->pp.mesh, world, shape)) {
            char why[TDM_ERROR_MSG_MAX];
            snprintf(why, sizeof why, "%s", tdm_error_message());
            return tdm_error_set(TDM_STATUS_USAGE, "--mesh: %s", why);
        }
    } else {
        *shape = (tdm_mesh_shape){.size = {1, 1, world}};
    }
    TDM_REQUIRE(shape->size[TDM_MESH_PP] == 1, TDM_STATUS_USAGE,
                "--mesh: pp=%d: --mode tp combines with dp only (dp=D,tp=N); a pipeline of "
                "tensor-parallel stages is not built", shape->size[TDM_MESH_PP]);
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L;
    TDM_CHECK(tdm_tp_plan(&b->spec, shape->size[TDM_MESH_TP], split, &L));
    TDM_REQUIRE(!b->tp.zero1 || shape->size[TDM_MESH_DP] >= 2, TDM_STATUS_USAGE,
                "--sharding optimizer shards the optimizer over the dp dimension: it needs "
                "--mesh dp=D,tp=N with D >= 2");
    return b->tp.seq_par ? tdm_tp_check_seq(&b->spec, shape->size[TDM_MESH_TP]) : TDM_STATUS_OK;
}

static tdm_status tdm_rank_tp_layout(void *ctx, int world, int rank, tdm_mesh_shape *shape,
                                     int *role)
{
    (void)rank;
    *role = 0;
    return tdm_tool_tp_check(ctx, world, shape);
}

/* ---- set-up ---- */

static void tdm_rank_tp_free(void *ctx, void *self)
{
    (void)ctx;
    tdm_tool_rank *r = self;
    if (!r) return;
    tdm_tool_tp *q = r->w;
    if (q) {
        tdm_tp_free(q->p);   /* owns r->opt */
        tdm_mesh_free(q->dev_mesh);
        free(q);
    }
    r->opt = NULL;
    tdm_tool_rank_free(r);   /* frees r->m, the tables */
}

static tdm_status tdm_rank_tp_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    const tdm_tool_build *b = ctx;
    tdm_tool_rank *r = calloc(1, sizeof *r);
    tdm_tool_tp *q = calloc(1, sizeof *q);
    if (!r || !q) {
        free(r);
        free(q);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", d->env.rank);
    }
    *self = r;
    *r = (tdm_tool_rank){.b = b, .dist = d, .rank = d->env.rank, .world = d->env.world_size,
                         .w = q};
    q->rep = d->coord[TDM_MESH_DP];
    q->reps = d->shape.size[TDM_MESH_DP];
    q->tcomm = tdm_mesh_comm(d->mesh, TDM_MESH_TP);
    q->dcomm = tdm_mesh_comm(d->mesh, TDM_MESH_DP);
    tdm_comm *tp_dev = q->tcomm, *dp_dev = q->dcomm;
    tdm_status st;
    if (d->dev_comm != d->comm) {
        /* on a GPU the all-reduces run over NCCL, the host collectives
         * over the group's */
        if ((st = tdm_mesh_init(&q->dev_mesh, d->dev_comm, &d->shape)))
            return tdm_tool_rank_fail(r, "device mesh", st);
        tp_dev = tdm_mesh_comm(q->dev_mesh, TDM_MESH_TP);
        dp_dev = tdm_mesh_comm(q->dev_mesh, TDM_MESH_DP);
    }
    q->tdev = tp_dev;
    if ((st = tdm_model_init_tables(&r->m, &b->spec)))
        return tdm_tool_rank_fail(r, "model tables", st);
    q->in_elems = tdm_model_in_features(r->m);
    q->out_rows = tdm_model_out_rows(r->m);
    tdm_tp_opts o = {.seed = b->seed, .optim = b->optim,
                     .grad_comm = q->reps > 1 ? dp_dev : NULL,
                     .host_comm = tp_dev != q->tcomm ? q->tcomm : NULL,
                     .sequence_parallel = b->tp.seq_par,
                     .zero = b->tp.zero1 ? TDM_TP_ZERO_OPTIMIZER : TDM_TP_ZERO_NONE};
    if ((st = tdm_tp_init(&q->p, tp_dev, d->dev, &b->spec, &o)))
        return tdm_tool_rank_fail(r, "tensor-parallel set-up", st);
    r->opt = tdm_tp_optim(q->p);
    r->model_params = tdm_model_param_elems(r->m);
    return tdm_tool_rank_resume(r);
}

/* ---- the step ---- */

/* One optimizer step of the global batch over the rank's tdm_dist_stepper:
 * this replica's share through the group, the loss gradient scaled by
 * 1/B so that the sum over the replicas is the global batch's mean-loss
 * gradient. */
static tdm_status tdm_rank_tp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                   double *loss_mean)
{
    tdm_dist_stepper *s = ctx;
    tdm_tool_tp *q = s->w;
    s->begun++;
    if (s->before) s->before(s->before_ctx, s->begun);
    /* images: x, y hold the global batch, of which this replica runs its
     * share; a GPT's: only this replica's windows (drawn alike by every
     * rank of its group) of a global batch of s->global_batch */
    int global = s->own_rows ? s->global_batch : batch;
    int64_t lo = 0, hi = batch;
    if (!s->own_rows) tdm_dist_share(batch, q->rep, q->reps, &lo, &hi);
    double ls = 0.0;
    tdm_status st = tdm_tp_step_scaled(q->p, (const int32_t *)x + lo * q->in_elems,
                                       y + lo * q->out_rows, (int)(hi - lo),
                                       1.0f / (float)global, &ls);
    if (st) return st;
    char where[96];
    snprintf(where, sizeof where, "the global batch of %d, seen by tensor-parallel rank %d of "
             "replica %d", global, tdm_tp_rank(q->p), q->rep);
    return tdm_dist_replicas_loss(s->comm, q->dcomm, q->reps, s->rank, "tp loss over the replicas",
                                  ls, global, tdm_optim_steps(s->opt), where, loss_mean);
}

/* --grad-accum (the MLP): each micro-batch is a global one, this
 * replica's share of it through the group (tdm_tp_forward_backward,
 * adding into the gradients, the loss gradient scaled by 1/the
 * effective batch); one sum over the dp dimension and one optimizer
 * step after the last (tdm_tp_optim_step). */
static tdm_status tdm_rank_tp_accum_zero(void *ctx)
{
    tdm_dist_stepper *s = ctx;
    s->begun++;
    if (s->before) s->before(s->before_ctx, s->begun);
    return tdm_tp_zero_grad(((tdm_tool_tp *)s->w)->p);
}

static tdm_status tdm_rank_tp_accum_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                          float grad_scale, int index, int last,
                                          double *loss_sum)
{
    (void)index;
    (void)last;
    tdm_dist_stepper *s = ctx;
    tdm_tool_tp *q = s->w;
    int64_t lo = 0, hi = batch;
    tdm_dist_share(batch, q->rep, q->reps, &lo, &hi);
    *loss_sum = 0.0;
    if (hi == lo) return TDM_STATUS_OK;   /* a short micro-batch: the whole group has none */
    return tdm_tp_forward_backward(q->p, (const int32_t *)x + lo * q->in_elems,
                                   y + lo * q->out_rows, (int)(hi - lo), grad_scale, loss_sum);
}

static tdm_status tdm_rank_tp_accum_step(void *ctx, double *loss_sum)
{
    tdm_dist_stepper *s = ctx;
    tdm_tool_tp *q = s->w;
    TDM_CHECK(tdm_tp_optim_step(q->p));
    /* every replica's part of the loss */
    double mean = 0.0;
    TDM_CHECK(tdm_dist_replicas_loss(s->comm, q->dcomm, q->reps, s->rank,
                                     "tp loss over the replicas", *loss_sum, 1,
                                     tdm_optim_steps(s->opt), "an accumulated step", &mean));
    *loss_sum = mean;
    return TDM_STATUS_OK;
}

static const tdm_accum_ops tdm_rank_tp_accum_ops = {.zero_grad = tdm_rank_tp_accum_zero,
                                                    .micro = tdm_rank_tp_accum_micro,
                                                    .step = tdm_rank_tp_accum_step};

/* ---- evaluation and checkpoints ---- */

static tdm_status tdm_rank_tp_evaluate(void *w, const tdm_dataset *test, int batch,
                                       double *loss_mean, double *accuracy)
{
    return tdm_tp_evaluate(((tdm_tool_tp *)w)->p, test, batch, loss_mean, accuracy);
}

/* Host arrays in the whole model's layout for its state. */
static tdm_status tdm_rank_tp_host(const tdm_model *tables, const tdm_optim *opt,
                                   tdm_ckpt_host *h)
{
    memset(h, 0, sizeof *h);
    size_t n = (size_t)tdm_model_param_elems(tables);
    h->params = calloc(n, sizeof(float));
    TDM_REQUIRE(h->params, TDM_STATUS_OUT_OF_MEMORY, "checkpoint: %zu floats", n);
    if (!opt) return TDM_STATUS_OK;
    h->optim = tdm_optim_get_opts(opt);
    for (int i = 0; i < tdm_optim_n_state(opt); i++) {
        h->state[i] = calloc(n, sizeof(float));
        TDM_REQUIRE(h->state[i], TDM_STATUS_OUT_OF_MEMORY, "checkpoint: %zu floats", n);
    }
    return TDM_STATUS_OK;
}

/* Replica 0's group gathers the whole model on its rank 0 (the job's
 * rank 0), which writes the file every mode writes. */
static tdm_status tdm_rank_tp_save(void *w, const char *path, tdm_optim *opt,
                                   const tdm_ckpt_info *info)
{
    tdm_tool_tp *q = w;
    /* ZeRO-1: the other replicas' parts of each optimizer state's gather */
    if (q->rep != 0) return tdm_tp_zero_join_gather(q->p);
    int root = tdm_tp_rank(q->p) == 0;
    const tdm_model *tables = tdm_tp_tables(q->p);
    tdm_ckpt_host h;
    memset(&h, 0, sizeof h);
    tdm_status st = root ? tdm_rank_tp_host(tables, opt, &h) : TDM_STATUS_OK;
    if (st) {
        tdm_comm_abort(q->tcomm, tdm_error_message());
    } else {
        tdm_ckpt_host mine = h;
        mine.optim = tdm_optim_get_opts(opt);   /* every rank sends its state */
        st = tdm_tp_gather_state(q->p, root ? &h : &mine, 0);
    }
    if (st == TDM_STATUS_OK && root) st = tdm_checkpoint_save_host(path, tables, &h, info);
    tdm_ckpt_host_free(&h);
    return st;
}

/* Any mode's file, read by every rank, which keeps its slices. */
static tdm_status tdm_rank_tp_load(void *w, const char *path, tdm_optim *opt,
                                   tdm_ckpt_info *info)
{
    tdm_tool_tp *q = w;
    tdm_ckpt_host h;
    tdm_status st = tdm_rank_tp_host(tdm_tp_tables(q->p), opt, &h);
    if (st == TDM_STATUS_OK) st = tdm_checkpoint_load_host(path, tdm_tp_tables(q->p), &h, info);
    if (st == TDM_STATUS_OK) st = tdm_tp_load_state(q->p, &h);
    tdm_ckpt_host_free(&h);
    return st;
}

/* A GPT's validation windows through the group; the sum said by the
 * group's rank 0 alone, so that a sum over every rank counts each
 * replica's windows once. */
static tdm_status tdm_rank_tp_eval_loss(void *w, const void *x, const int32_t *y, int n,
                                        double *loss_sum)
{
    tdm_tool_tp *q = w;
    double ls = 0.0;
    int64_t correct = 0;
    *loss_sum = 0.0;
    if (n == 0) return TDM_STATUS_OK;   /* every rank of the group has the same n */
    TDM_CHECK(tdm_tp_eval_batch(q->p, x, y, n, &ls, &correct));
    if (tdm_tp_rank(q->p) == 0) *loss_sum = ls;
    return TDM_STATUS_OK;
}

static const tdm_dist_ops tdm_rank_tp_ops = {
    .evaluate = tdm_rank_tp_evaluate, .eval_loss = tdm_rank_tp_eval_loss,
    .save = tdm_rank_tp_save, .load = tdm_rank_tp_load};

/* ---- what the CLI prints ---- */

static void tdm_rank_tp_describe(const tdm_tool_rank *r, char *on, size_t n_on, char *note,
                                 size_t n_note)
{
    const tdm_tool_tp *q = r->w;
    char plan[160] = "";
    size_t k = 0;
    const tdm_model_spec *sp = tdm_model_get_spec(r->m);
    int L = sp->kind == TDM_MODEL_GPT ? 0 : sp->ndims - 1;
    if (sp->kind == TDM_MODEL_GPT)
        snprintf(plan, sizeof plan, "attention split by heads, %d of %d per rank; mlp c_fc "
                 "column, c_proj row; %s", sp->n_head / tdm_tp_size(q->p), sp->n_head,
                 r->b->tp.seq_par && tdm_tp_size(q->p) > 1
                     ? "sequence parallel: LayerNorms on 1/N of the tokens"
                     : "LayerNorms and embeddings replicated");
    for (int l = 0; l < L && k < sizeof plan; l++) {
        int n = snprintf(plan + k, sizeof plan - k, "%sfc%d %s", l ? ", " : "", l + 1,
                         tdm_tp_split_name(tdm_tp_layer_split(q->p, l)));
        if (n < 0) break;
        k += (size_t)n;
    }
    int n = snprintf(on, n_on, ", tensor parallel over %d ranks (%s)", tdm_tp_size(q->p), plan);
    if (q->reps > 1 && n >= 0 && (size_t)n < n_on)
        snprintf(on + n, n_on - (size_t)n, ", x %d replicas (gradients summed over the dp "
                 "dimension%s)", q->reps, r->b->tp.zero1 ? "; ZeRO-1: the optimizer sharded "
                                                           "over it" : "");
    snprintf(note, n_note, "%s", "");
}

/* Rank 0's step: its phases, memory and what its communicator counted. */
static void tdm_rank_tp_report(const tdm_tool_rank *r, int overlap)
{
    (void)overlap;
    const tdm_tool_tp *q = r->w;
    tdm_tp_stats s;
    tdm_tp_get_stats(q->p, &s);
    if (s.steps == 0) return;
    double n = (double)s.steps, mib = 1.0 / (1024.0 * 1024.0);
    const tdm_tp_phases *p = &s.sum;
    printf("tp step, rank 0, mean over %lld steps: %.3f ms: forward %.3f ms, forward "
           "collectives %.3f ms, loss %.3f ms, backward %.3f ms, backward collectives %.3f ms, "
           "gradient sums (dp dimension, sequence-parallel LayerNorms) %.3f ms, optimizer "
           "%.3f ms\n", (long long)s.steps, p->total / n,
           p->forward / n, p->fwd_allreduce / n, p->loss / n, p->backward / n,
           p->bwd_allreduce / n, p->grad_sync / n, p->step / n);
    printf("tp memory, rank 0: parameters %.3f MiB, gradients %.3f MiB, optimizer %.3f MiB "
           "(split tensors %lld of one device's %lld elements, replicated %lld)\n",
           (double)s.params * mib, (double)s.grads * mib, (double)s.optimizer * mib,
           (long long)s.split_elems, (long long)s.whole_split_elems,
           (long long)s.replicated_elems);
    tdm_comm_traffic t;
    tdm_comm_traffic_get(q->tdev, &t);
    tdm_comm_traffic plan;
    tdm_tp_step_traffic(&r->b->spec, tdm_tp_size(q->p), 1, r->b->tp.seq_par, &plan);
    printf("tp communication, rank 0: %lld all-reduces of %.3f MiB over the run (counted by the "
           "communicator; %lld per step of the full batch by the plan)",
           (long long)t.calls[TDM_COLL_ALL_REDUCE], (double)t.bytes[TDM_COLL_ALL_REDUCE] * mib,
           (long long)plan.calls[TDM_COLL_ALL_REDUCE]);
    if (plan.calls[TDM_COLL_REDUCE_SCATTER])
        printf(", %lld reduce-scatters of %.3f MiB and %lld all-gathers of %.3f MiB (%lld of "
               "each per step)", (long long)t.calls[TDM_COLL_REDUCE_SCATTER],
               (double)t.bytes[TDM_COLL_REDUCE_SCATTER] * mib,
               (long long)t.calls[TDM_COLL_ALL_GATHER], (double)t.bytes[TDM_COLL_ALL_GATHER] * mib,
               (long long)plan.calls[TDM_COLL_REDUCE_SCATTER]);
    printf("\n");
}

void tdm_tool_tp_stats(const tdm_tool_rank *r, tdm_tp_stats *out)
{
    tdm_tp_get_stats(((const tdm_tool_tp *)r->w)->p, out);
}

/* Replica 0's group gathers the whole model on rank 0. */
static tdm_status tdm_rank_tp_params(tdm_tool_rank *r, float *host, int root)
{
    tdm_tool_tp *q = r->w;
    TDM_REQUIRE(root == 0, TDM_STATUS_UNSUPPORTED,
                "tp: the whole model's parameters are gathered on rank 0 only");
    if (q->rep != 0) return TDM_STATUS_OK;
    tdm_ckpt_host h = {.params = host};
    return tdm_tp_gather_state(q->p, r->rank == 0 ? &h : NULL, 0);
}

/* train --trace: the last step's forward (its all-reduces apart), loss,
 * backward, the all-reduces (forward, backward and the dp sum: every one
 * exposed) and the optimizer. */
static int tdm_rank_tp_phases(const tdm_tool_rank *r, tdm_phase_times *out)
{
    tdm_tp_stats s;
    tdm_tp_get_stats(((const tdm_tool_tp *)r->w)->p, &s);
    memset(out, 0, sizeof *out);
    if (s.steps == 0) return 0;
    out->ms[TDM_PHASE_FORWARD] = s.last.forward;
    out->ms[TDM_PHASE_LOSS] = s.last.loss;
    out->ms[TDM_PHASE_BACKWARD] = s.last.backward;
    out->ms[TDM_PHASE_ALLREDUCE_WAIT] = s.last.fwd_allreduce + s.last.bwd_allreduce +
                                        s.last.grad_sync;
    out->ms[TDM_PHASE_STEP] = s.last.step;
    return 1;
}

const tdm_tool_design tdm_tool_tp_design = {
    .dist = {.name = "tp", .caps = TDM_DIST_NCCL, .layout = tdm_rank_tp_layout,
             .setup = tdm_rank_tp_setup, .free = tdm_rank_tp_free, .ops = &tdm_rank_tp_ops},
    .unit = "tensor-parallel rank", .save_alone = 0, .describe = tdm_rank_tp_describe,
    .report = tdm_rank_tp_report, .params = tdm_rank_tp_params, .step = tdm_rank_tp_step,
    .accum = &tdm_rank_tp_accum_ops,
    .phases = tdm_rank_tp_phases};
