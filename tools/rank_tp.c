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
#include "dist/det.h"
#include "dist/mesh.h"
#include "dist/step.h"
#include "tools/plan_peak.h"
#include "tools/rank_mesh.h"
#include "tools/ranks.h"
#include "tools/train_modes.h"
#include "tp/tp.h"

typedef struct tdm_tool_tp {
    tdm_tool_mesh mesh;          /* first: the rank's place and communicators */
    tdm_tp *p;
    int rep, reps;
    int in_elems, out_rows;      /* per sample: 4-byte inputs, target rows */
    tdm_comm *jcomm;             /* the whole job's device communicator (the levers') */
    tdm_dist_det det;            /* --deterministic K: the tree over the dp dimension */
    int det_global;              /* the step's global batch */
    int64_t det_row0;            /* and this replica's first row in it */
    int norm;                    /* the steps measured the gradient norm (the plan's scratch) */
    /* after the run (tdm_rank_tp_finish): the rank with the largest
     * device peak, that peak and its plan (rank 0's report) */
    int top_rank, top_rep;
    size_t top_peak, top_planned;
    /* what the tensor-parallel communicator carried in the training
     * passes (forward and backward of a step or a micro-batch): not the
     * set-up's checks, the evaluation's forwards, the checkpoints' gathers */
    tdm_comm_traffic pass_traffic, pass_t0;
    int64_t passes;
} tdm_tool_tp;

/* The tensor-parallel communicator's traffic since q->pass_t0 added to
 * q->pass_traffic. */
static void tdm_rank_tp_count(tdm_tool_tp *q)
{
    tdm_comm_traffic t;
    tdm_comm_traffic_get(q->mesh.dev[TDM_MESH_TP], &t);
    for (int c = 0; c < TDM_COLL_COUNT_; c++) {
        q->pass_traffic.calls[c] += t.calls[c] - q->pass_t0.calls[c];
        q->pass_traffic.bytes[c] += t.bytes[c] - q->pass_t0.bytes[c];
    }
}

/* ---- the layout ---- */

tdm_status tdm_tool_tp_check(const tdm_tool_build *b, int world, tdm_mesh_shape *shape)
{
    tdm_mesh_shape dflt = {.size = {1, 1, world}};   /* no --mesh: tp over every rank */
    TDM_CHECK(tdm_tool_mesh_parse(b, world, &dflt, shape));
    TDM_REQUIRE(shape->size[TDM_MESH_PP] == 1, TDM_STATUS_USAGE,
                "--mesh: pp=%d: --mode tp combines with dp only (dp=D,tp=N); a pipeline of "
                "tensor-parallel stages is --mode pp --mesh dp=D,pp=S,tp=N",
                shape->size[TDM_MESH_PP]);
    int D = shape->size[TDM_MESH_DP];
    TDM_REQUIRE(!b->deterministic || b->deterministic % D == 0, TDM_STATUS_USAGE,
                "--deterministic %d: K must be divisible by the %d tensor-parallel replicas "
                "(--mesh dp=%d): each runs K/D whole virtual shards", b->deterministic, D, D);
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L;
    TDM_CHECK(tdm_tp_plan(&b->spec, shape->size[TDM_MESH_TP], split, &L));
    TDM_REQUIRE(!b->tp.zero || shape->size[TDM_MESH_DP] >= 2, TDM_STATUS_USAGE,
                "--sharding %s shards the %s over the dp dimension: it needs "
                "--mesh dp=D,tp=N with D >= 2", b->tp.zero == 2 ? "grad_op" : "optimizer",
                b->tp.zero == 2 ? "gradients and the optimizer" : "optimizer");
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
        tdm_dist_det_free(&q->det);
        tdm_tp_free(q->p);   /* owns r->opt */
        tdm_tool_mesh_fini(&q->mesh);
        free(q);
    }
    r->opt = NULL;
    tdm_tool_rank_free(r);   /* frees r->m, the tables */
}

static tdm_status tdm_rank_tp_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    const tdm_tool_build *b = ctx;
    TDM_CHECK(tdm_tool_mesh_rank_new(b, d, sizeof(tdm_tool_tp), self));
    tdm_tool_rank *r = *self;
    tdm_tool_tp *q = r->w;
    q->rep = q->mesh.coord[TDM_MESH_DP];
    q->reps = q->mesh.size[TDM_MESH_DP];
    /* on a GPU the all-reduces run over NCCL, the host collectives over
     * the group's */
    tdm_comm *tp_dev = q->mesh.dev[TDM_MESH_TP], *dp_dev = q->mesh.dev[TDM_MESH_DP];
    tdm_comm *tp_host = q->mesh.host[TDM_MESH_TP];
    tdm_status st;
    if ((st = tdm_model_init_tables(&r->m, &b->spec)))
        return tdm_tool_rank_fail(r, "model tables", st);
    q->in_elems = tdm_model_in_features(r->m);
    q->out_rows = tdm_model_out_rows(r->m);
    tdm_tp_opts o = {.seed = b->seed, .optim = b->optim,
                     .grad_comm = q->reps > 1 && !b->deterministic ? dp_dev : NULL,
                     .host_comm = tp_dev != tp_host ? tp_host : NULL,
                     .sequence_parallel = b->tp.seq_par,
                     .zero = b->tp.zero == 2 ? TDM_TP_ZERO_GRADS
                             : b->tp.zero    ? TDM_TP_ZERO_OPTIMIZER
                                             : TDM_TP_ZERO_NONE,
                     .precision = b->precision, .ckpt = b->ckpt};
    /* ZeRO-2: buckets of --bucket-cap-mb (DDP's 25 MiB without it) */
    if (b->tp.zero == 2)
        o.bucket_bytes = (size_t)((b->bucket_cap_mb > 0 ? b->bucket_cap_mb
                                                        : TDM_TOOL_TP_BUCKET_MB) * 1048576.0);
    if ((st = tdm_tp_init(&q->p, tp_dev, d->dev, &b->spec, &o)))
        return tdm_tool_rank_fail(r, "tensor-parallel set-up", st);
    r->opt = tdm_tp_optim(q->p);
    q->jcomm = d->dev_comm;
    r->model_params = tdm_model_param_elems(r->m);
    tdm_comm *dp_host = q->mesh.host[TDM_MESH_DP];
    q->mesh.loss_summed = b->deterministic > 0;   /* the tree's loss sum is every replica's */
    q->det = (tdm_dist_det){.comm = q->reps > 1 ? dp_host : NULL, .rank = q->rep,
                            .world = q->reps, .K = b->deterministic, .in_elems = q->in_elems,
                            .out_rows = q->out_rows, .flat_grads = tdm_tp_grads(q->p),
                            .flat_elems = tdm_tp_elems(q->p), .flat_dev = d->dev,
                            .dev_comm = q->reps > 1 ? tdm_train_det_dev_comm(dp_host, dp_dev)
                                                    : NULL};
    if (b->deterministic && (st = tdm_dist_det_init(&q->det)))
        return tdm_tool_rank_fail(r, "--deterministic", st);
    return tdm_tool_rank_resume(r);
}

/* ---- the step ---- */

/* One optimizer step of the global batch over the rank's tdm_dist_stepper:
 * this replica's share through the group, the loss gradient scaled by
 * 1/B so that the sum over the replicas is the global batch's mean-loss
 * gradient. */
static tdm_status tdm_rank_tp_step_fn(void *ctx, const void *x, const int32_t *y, int n,
                                      float grad_scale, double *loss_sum)
{
    tdm_tool_tp *q = ctx;
    /* --deterministic: the replica's virtual shards one at a time */
    if (q->det.K)
        return tdm_train_det_tp_step(q->p, &q->det, x, y, q->det_global, q->det_row0, loss_sum);
    return tdm_tp_step_scaled(q->p, x, y, n, grad_scale, loss_sum);
}

static tdm_status tdm_rank_tp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                   double *loss_mean)
{
    tdm_dist_stepper *s = ctx;
    tdm_tool_tp *q = s->w;
    char who[48];
    snprintf(who, sizeof who, "tensor-parallel rank %d", tdm_tp_rank(q->p));
    /* --deterministic: the global batch and this replica's first row in it */
    int64_t end;
    q->det_global = s->own_rows ? s->global_batch : batch;
    tdm_dist_share(q->det_global, q->rep, q->reps, &q->det_row0, &end);
    /* the levers: found-inf and the norm over the whole job */
    tdm_train_levers_tp_begin(s, q->p, q->jcomm, q->rep);
    q->norm = s->clip_norm > 0.0 || s->measure_norm;
    tdm_comm_traffic_get(q->mesh.dev[TDM_MESH_TP], &q->pass_t0);
    TDM_CHECK(tdm_tool_mesh_step(s, &q->mesh, q->in_elems, q->out_rows, tdm_rank_tp_step_fn, q,
                                 who, "tp loss over the replicas", x, y, batch, loss_mean));
    tdm_rank_tp_count(q);
    q->passes++;
    tdm_train_levers_tp_end(s, q->p);
    return TDM_STATUS_OK;
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
    tdm_dist_stepper *s = ctx;
    tdm_tool_tp *q = s->w;
    int64_t lo = 0, hi = batch;
    tdm_dist_share(batch, q->rep, q->reps, &lo, &hi);
    *loss_sum = 0.0;
    if (hi == lo) return TDM_STATUS_OK;   /* a short micro-batch: the whole group has none */
    tdm_comm_traffic_get(q->mesh.dev[TDM_MESH_TP], &q->pass_t0);
    /* the last: ZeRO-2's buckets summed as its backward completes them */
    TDM_CHECK((last ? tdm_tp_forward_backward_last : tdm_tp_forward_backward)(
        q->p, (const int32_t *)x + lo * q->in_elems, y + lo * q->out_rows, (int)(hi - lo),
        grad_scale, loss_sum));
    tdm_rank_tp_count(q);
    q->passes++;
    return TDM_STATUS_OK;
}

static tdm_status tdm_rank_tp_accum_step(void *ctx, double *loss_sum)
{
    tdm_dist_stepper *s = ctx;
    tdm_tool_tp *q = s->w;
    TDM_CHECK(tdm_tp_optim_step(q->p));
    /* every replica's part of the loss */
    double mean = 0.0;
    TDM_CHECK(tdm_dist_replicas_loss(s->comm, q->mesh.host[TDM_MESH_DP], q->reps, s->rank,
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

static tdm_status tdm_rank_tp_gather(void *ctx, tdm_ckpt_host *h, int root)
{
    (void)root;   /* every rank sends its state (h->optim set) */
    return tdm_tp_gather_state(((tdm_tool_tp *)ctx)->p, h, 0);
}

static tdm_status tdm_rank_tp_take(void *ctx, const tdm_ckpt_host *h)
{
    return tdm_tp_load_state(((tdm_tool_tp *)ctx)->p, h);
}

/* Replica 0's group gathers the whole model on its rank 0 (the job's
 * rank 0), which writes the file every mode writes. */
static tdm_status tdm_rank_tp_save(void *w, const char *path, tdm_optim *opt,
                                   const tdm_ckpt_info *info)
{
    tdm_tool_tp *q = w;
    /* ZeRO-1: the other replicas' parts of each optimizer state's gather */
    if (q->rep != 0) return tdm_tp_zero_join_gather(q->p);
    return tdm_tool_mesh_save(&q->mesh, q->mesh.host[TDM_MESH_TP], tdm_tp_rank(q->p) == 0,
                              tdm_tp_tables(q->p), opt, tdm_rank_tp_gather, q, path, info);
}

/* Any mode's file, read by every rank, which keeps its slices. */
static tdm_status tdm_rank_tp_load(void *w, const char *path, tdm_optim *opt,
                                   tdm_ckpt_info *info)
{
    tdm_tool_tp *q = w;
    return tdm_tool_mesh_load(tdm_tp_tables(q->p), opt, tdm_rank_tp_take, q, path, info);
}

static tdm_status tdm_rank_tp_eval_fn(void *ctx, const void *x, const int32_t *y, int n,
                                      double *loss_sum, int64_t *correct)
{
    return tdm_tp_eval_batch(ctx, x, y, n, loss_sum, correct);
}

/* A GPT's validation windows through the group; the sum said by the
 * group's rank 0 alone, so that a sum over every rank counts each
 * replica's windows once. */
static tdm_status tdm_rank_tp_eval_loss(void *w, const void *x, const int32_t *y, int n,
                                        double *loss_sum)
{
    tdm_tool_tp *q = w;
    return tdm_tool_mesh_eval_loss(tdm_rank_tp_eval_fn, q->p, tdm_tp_rank(q->p) == 0, x, y, n,
                                   loss_sum);
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
    int L = tdm_tp_n_layers(q->p);
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
    char reps[96];
    tdm_tool_mesh_replicas_str(&q->mesh, q->det.K ? "gradients summed over the dp dimension by "
                                                    "the fixed tree"
                                   : r->b->tp.zero == 2 ? "ZeRO-2: gradients and optimizer "
                                                          "sharded over the dp dimension"
                                   : r->b->tp.zero ? "gradients summed over the dp dimension; "
                                                     "ZeRO-1: the optimizer sharded over it"
                                                   : "gradients summed over the dp dimension",
                               reps, sizeof reps);
    int n = snprintf(on, n_on, ", tensor parallel over %d ranks (%s)%s", tdm_tp_size(q->p), plan,
                     reps);
    if (q->det.K && n >= 0 && (size_t)n < n_on)
        snprintf(on + n, n_on - (size_t)n, ", deterministic over %d virtual shards: the same "
                 "bits for any dp dimension at tp size %d only (another tp size adds the "
                 "row-parallel partial sums in another order)", q->det.K, tdm_tp_size(q->p));
    snprintf(note, n_note, "%s", "");
}

/* A rank's plan at its replica's rows (tp reserves its activations for
 * them; tools/plan_peak.h): 0 when not planned (--deterministic's
 * virtual shards, an empty share). */
static size_t tdm_rank_tp_planned(const tdm_tool_rank *r)
{
    const tdm_tool_tp *q = r->w;
    tdm_tool_tp_plan t;
    int64_t lo, hi;
    tdm_dist_share(r->b->pp.batch, q->mesh.coord[TDM_MESH_DP], q->mesh.size[TDM_MESH_DP], &lo,
                   &hi);
    tdm_tool_tp_levers lev = {.precision = r->b->precision, .grad_norm = q->norm,
                              .device = tdm_dev_kind(r->dist->dev)};
    if (r->b->deterministic || hi <= lo ||
        tdm_tool_plan_tp_rank(&r->b->spec, &r->b->optim, q->mesh.size[TDM_MESH_TP],
                              q->mesh.size[TDM_MESH_DP], (int)(hi - lo), r->b->tp.seq_par,
                              r->b->tp.zero,
                              r->b->bucket_cap_mb > 0 ? r->b->bucket_cap_mb
                                                      : TDM_TOOL_TP_BUCKET_MB,
                              r->b->ckpt, &lev, &t)) {
        tdm_error_clear();
        return 0;
    }
    return t.peak;
}

/* Every rank's device peak and plan to rank 0 (collective, after the
 * run): the replicas' shares of an uneven batch differ, and the job's
 * peak is the largest share's, which `tandem plan` prints. */
static tdm_status tdm_rank_tp_finish(tdm_tool_rank *r)
{
    tdm_tool_tp *q = r->w;
    tdm_dev_mem_stats ms;
    int64_t mine[3] = {0, (int64_t)tdm_rank_tp_planned(r), q->mesh.coord[TDM_MESH_DP]};
    int64_t *all = NULL;
    if (tdm_dev_mem_query(r->dist->dev, &ms) == TDM_STATUS_OK) mine[0] = (int64_t)ms.peak_bytes;
    tdm_error_clear();
    all = calloc((size_t)r->world * 3, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "tp memory summary: %d ranks", r->world);
    tdm_comm_set_label(r->dist->comm, "tp memory summary");
    tdm_status st = tdm_comm_all_gather(r->dist->comm, mine, all, 3, TDM_DTYPE_INT64);
    q->top_rank = 0;
    for (int k = 1; st == TDM_STATUS_OK && k < r->world; k++)
        if (all[3 * k] > all[3 * q->top_rank]) q->top_rank = k;
    if (st == TDM_STATUS_OK) {
        q->top_peak = (size_t)all[3 * q->top_rank];
        q->top_planned = (size_t)all[3 * q->top_rank + 1];
        q->top_rep = (int)all[3 * q->top_rank + 2];
    }
    free(all);
    return st ? tdm_tool_rank_fail(r, "tp memory summary", st) : st;
}

/* Rank 0's device peak (the allocator's) beside its plan, and the job's
 * largest (tandem plan --mode tp prints the largest share's; not with
 * --deterministic's virtual shards). */
static void tdm_rank_tp_peak(const tdm_tool_rank *r)
{
    const tdm_tool_tp *q = r->w;
    tdm_dev_mem_stats ms;
    if (tdm_dev_mem_query(r->dist->dev, &ms)) {
        tdm_error_clear();
        return;
    }
    printf("tp memory, rank 0: device peak %.2f MiB measured (allocator)",
           ms.peak_bytes / 1048576.0);
    size_t planned = tdm_rank_tp_planned(r);
    if (planned) printf(", %.2f MiB planned (tandem plan)", planned / 1048576.0);
    printf("\n");
    if (q->mesh.size[TDM_MESH_DP] < 2) return;
    printf("tp memory, the largest device peak: %.2f MiB measured (allocator) on rank %d "
           "(replica %d)", q->top_peak / 1048576.0, q->top_rank, q->top_rep);
    if (q->top_planned) printf(", %.2f MiB planned (tandem plan)", q->top_planned / 1048576.0);
    printf("\n");
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
    printf("tp memory, rank 0: parameters %.3f MiB, gradients %.3f MiB%s, optimizer %.3f MiB "
           "(split tensors %lld of one device's %lld elements, replicated %lld)",
           (double)s.params * mib, (double)s.grads * mib,
           s.grads_in_step ? " (ZeRO-2's shard)" : "", (double)s.optimizer * mib,
           (long long)s.split_elems, (long long)s.whole_split_elems,
           (long long)s.replicated_elems);
    /* ZeRO-2: the whole gradient, or with buckets the most of them held at
     * once (measured) */
    if (s.grads_in_step)
        printf("; the whole gradient, %.3f MiB, only inside a step (as gradient buckets "
               "summed during backward: at most %.3f MiB at once)",
               (double)s.params * mib, s.grads_in_step * mib);
    printf("\n");
    tdm_rank_tp_peak(r);
    const tdm_comm_traffic t = q->pass_traffic;
    tdm_comm_traffic plan;
    tdm_tp_step_traffic(&r->b->spec, tdm_tp_size(q->p), 1, r->b->tp.seq_par, &plan);
    if (r->b->ckpt) {
        /* checkpointing runs blocks' forward collectives again */
        tdm_comm_traffic re;
        tdm_tp_recompute_traffic(&r->b->spec, tdm_tp_size(q->p), 1, r->b->tp.seq_par, &re);
        for (int c = 0; c < TDM_COLL_COUNT_; c++) {
            plan.calls[c] += re.calls[c];
            plan.bytes[c] += re.bytes[c];
        }
    }
    printf("tp communication, rank 0: %lld all-reduces of %.3f MiB in the %lld training "
           "passes (counted by the communicator; %lld per pass of the full batch by the plan)",
           (long long)t.calls[TDM_COLL_ALL_REDUCE], (double)t.bytes[TDM_COLL_ALL_REDUCE] * mib,
           (long long)q->passes, (long long)plan.calls[TDM_COLL_ALL_REDUCE]);
    if (plan.calls[TDM_COLL_REDUCE_SCATTER])
        printf(", %lld reduce-scatters of %.3f MiB and %lld all-gathers of %.3f MiB (%lld and "
               "%lld per pass)", (long long)t.calls[TDM_COLL_REDUCE_SCATTER],
               (double)t.bytes[TDM_COLL_REDUCE_SCATTER] * mib,
               (long long)t.calls[TDM_COLL_ALL_GATHER], (double)t.bytes[TDM_COLL_ALL_GATHER] * mib,
               (long long)plan.calls[TDM_COLL_REDUCE_SCATTER],
               (long long)plan.calls[TDM_COLL_ALL_GATHER]);
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
    .dist = {.name = "tp", .caps = TDM_DIST_MPI | TDM_DIST_NCCL,
             .layout = tdm_rank_tp_layout,
             .setup = tdm_rank_tp_setup, .free = tdm_rank_tp_free, .ops = &tdm_rank_tp_ops},
    .unit = "tensor-parallel rank", .save_alone = 0, .describe = tdm_rank_tp_describe,
    .report = tdm_rank_tp_report, .params = tdm_rank_tp_params, .step = tdm_rank_tp_step,
    .accum = &tdm_rank_tp_accum_ops, .phases = tdm_rank_tp_phases,
    .finish = tdm_rank_tp_finish};
