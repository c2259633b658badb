/* tools/rank_pp.c: pipeline parallelism's table for the CLI
 * (tools/ranks.h): a rank is one stage of a pipeline (pp/pp.h), and with
 * --mesh dp=D,pp=S one stage of one of D replicas, whose gradients DDP's
 * Reducer sums over the dp dimension's sub-communicator (pp/'s grad_sync
 * around the last micro-batch's backward). The layout (the mesh and the
 * checks of --stages and --split before any rank starts), the rank's
 * stage, its step (the schedule over this replica's share of the global
 * batch), evaluation through the pipeline, checkpoints (the whole model's
 * state gathered on rank 0 into the one file every mode reads, and any
 * mode's file loaded by every stage) and the summary (every stage's
 * phases and memory, gathered on rank 0).
 *
 * With --mesh dp=D,pp=S,tp=N (N > 1) each stage is tensor-parallel over
 * its N ranks (tools/rank_pptp.h: pp/'s stage model of a narrow spec, the
 * partial sums all-reduced over the stage's tp group through models/'
 * callback); each tp index is a pipeline of its own, and checkpoints go
 * through the whole model's layout by slicing.
 *
 * With --sharding optimizer (ZeRO-1 over the dp dimension) the stage
 * builds no optimizer of its own: pp/'s optim_step hook steps, on each of
 * the D replicas of a stage, the replica's 1/D slice of the stage's flat
 * parameters (padded to D equal chunks) from the all-reduced gradients,
 * with optimizer state for that slice only, and all-gathers the slices
 * over the dp dimension back into the stage's parameters. The update is
 * elementwise, so the run is DDP x pp's bit for bit. --save gathers the
 * state slices into the file DDP x pp writes; --resume slices any mode's
 * file back into this run's chunks (at any dp size). On
 * tensor-parallel stages (the 3-D mesh) the same, over the narrow stage's
 * flat parameters: the dp group joins one stage's one tp index
 * (tools/rank_pptp_zero.h carries the state into the whole layout). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "dist/batch.h"
#include "dist/det.h"
#include "dist/mesh.h"
#include "dist/step.h"
#include "pp/pp.h"
#include "tools/rank_mesh.h"
#include "tools/rank_pptp.h"
#include "tools/rank_pptp_zero.h"
#include "tools/ranks.h"
#include "tools/train_modes.h"

/* A rank's pipeline state: r->w. */
typedef struct tdm_tool_pp {
    tdm_tool_mesh mesh;          /* first: the rank's place and communicators */
    tdm_pp *p;
    tdm_ddp *ddp;                /* with dp > 1: the Reducer over the dp dimension */
    tdm_model *tables;           /* the whole model's tables (checkpoints' layout) */
    tdm_comm *jcomm;             /* the whole job's device communicator (the levers') */
    /* ZeRO-1 (--sharding optimizer) */
    tdm_optim *zopt;             /* the optimizer of this replica's slice of the stage */
    tdm_comm *zcomm;             /* the dp dimension's device communicator (borrowed) */
    tdm_device *zdev;            /* the stage's device (borrowed) */
    float *zbuf;                 /* the stage's parameters padded to reps chunks; NULL when
                                    they divide evenly (gathered in place) */
    int64_t zchunk;              /* elements per replica's slice */
    size_t zbytes;               /* device bytes its set-up took (state, zbuf): not the
                                    activations that pp/ measures above its own set-up */
    tdm_comm_traffic zstep;      /* what the dp communicator counted in the last step */
    int rep, reps;               /* this replica, of how many */
    int in_elems, out_rows;      /* per sample of the whole model */
    int micro;                   /* micro-batches per replica and step */
    /* --deterministic K: the replica's K/D micro-batches are its virtual
     * shards, summed by dist/det.h's tree over the dp dimension */
    int det_on;
    tdm_dist_det det;
    int det_global;              /* the step's global batch */
    int64_t det_row0;            /* and this replica's first row in it */
    /* --mesh dp=D,pp=S,tp=N, N > 1: the stage is tensor-parallel
     * (tools/rank_pptp.h) */
    int tpn;
    tdm_pptp tp;
} tdm_tool_pp;

tdm_pp *tdm_tool_pp_of(const tdm_tool_rank *r) { return ((const tdm_tool_pp *)r->w)->p; }

void tdm_tool_pp_tp_sums(const tdm_tool_rank *r, int64_t *calls, int64_t *bytes, double *ms)
{
    const tdm_tool_pp *q = r->w;
    tdm_comm_traffic t;
    memset(&t, 0, sizeof t);
    /* the partial sums are the only all-reduces on the stage's tp group */
    if (q->tpn > 1) tdm_comm_traffic_get(q->tp.tdev, &t);
    *calls = t.calls[TDM_COLL_ALL_REDUCE];
    *bytes = t.bytes[TDM_COLL_ALL_REDUCE];
    *ms = q->tpn > 1 ? q->tp.sum_ms : 0.0;
}

/* ---- the layout ---- */

static int tdm_tool_pp_layers(const tdm_model_spec *spec)
{
    int n = 0;
    return tdm_model_spec_n_layers(spec, &n) ? 0 : n;
}

/* USAGE with what and the library's message (copied: it is rewritten). */
static tdm_status tdm_tool_pp_refuse(const char *what)
{
    char why[TDM_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", tdm_error_message());
    return tdm_error_set(TDM_STATUS_USAGE, "%s: %s", what, why);
}

/* --deterministic K: each of the D replicas runs K/D virtual shards as
 * its micro-batches (one device's shards, same shapes, same bits). */
static tdm_status tdm_tool_pp_check_det(const tdm_tool_build *b, const tdm_mesh_shape *shape)
{
    int K = b->deterministic, D = shape->size[TDM_MESH_DP];
    if (!K) return TDM_STATUS_OK;
    if (tdm_dist_det_check(K, 1, b->pp.batch)) return tdm_tool_pp_refuse("--mode pp");
    TDM_REQUIRE(K % D == 0, TDM_STATUS_USAGE,
                "--deterministic %d: K must be divisible by the %d pipeline replicas (--mesh "
                "dp=%d): each runs K/D whole virtual shards as its micro-batches", K, D, D);
    TDM_REQUIRE(!b->pp.micro || b->pp.micro == K / D, TDM_STATUS_USAGE,
                "--microbatches %d: with --deterministic %d over %d pipeline replica%s the "
                "micro-batches are a replica's K/D = %d virtual shards (omit --microbatches)",
                b->pp.micro, K, D, D == 1 ? "" : "s", K / D);
    TDM_REQUIRE(shape->size[TDM_MESH_TP] == 1, TDM_STATUS_USAGE,
                "--deterministic %d with tensor-parallel stages (--mesh ...,tp=%d) is not "
                "supported: the stages' row-parallel sums depend on tp", K,
                shape->size[TDM_MESH_TP]);
    return TDM_STATUS_OK;
}

/* The first layer of each of S stages: --split, else pp/'s default
 * balance of the whole model (what tdm_pp_init would choose). */
static tdm_status tdm_tool_pp_first(const tdm_tool_build *b, int S, int *first)
{
    if (b->pp.split)
        return tdm_pp_split_parse(b->pp.split, S, tdm_tool_pp_layers(&b->spec), first);
    return tdm_pp_split_balance(&b->spec, S, TDM_PP_BALANCE_FLOPS, first);
}

tdm_status tdm_tool_pp_check(const tdm_tool_build *b, int world, tdm_mesh_shape *shape)
{
    /* without --mesh: --stages S (default: every device) times the replicas */
    int S0 = b->pp.stages > 0 ? b->pp.stages : world;
    TDM_REQUIRE(b->pp.mesh || world % S0 == 0, TDM_STATUS_USAGE,
                "--stages %d does not divide the %d devices: a pipeline of S stages runs on S "
                "devices (or D*S with --mesh dp=D,pp=S)", S0, world);
    tdm_mesh_shape dflt = {.size = {world / S0, S0, 1}};
    TDM_CHECK(tdm_tool_mesh_parse(b, world, &dflt, shape));
    int S = shape->size[TDM_MESH_PP], N = shape->size[TDM_MESH_TP];
    TDM_REQUIRE(!b->pp.zero1 || shape->size[TDM_MESH_DP] >= 2, TDM_STATUS_USAGE,
                "--sharding optimizer shards each stage's optimizer over the dp dimension: it "
                "needs --mesh dp=D,pp=S%s with D >= 2 (dp is %d)", N > 1 ? ",tp=N" : "",
                shape->size[TDM_MESH_DP]);
    TDM_REQUIRE(b->pp.stages <= 0 || b->pp.stages == S, TDM_STATUS_USAGE,
                "--stages %d, but --mesh %s has pp=%d", b->pp.stages, b->pp.mesh, S);
    TDM_REQUIRE(b->pp.micro >= 1 || b->deterministic, TDM_STATUS_USAGE,
                "--microbatches %d: at least 1", b->pp.micro);
    TDM_CHECK(tdm_tool_pp_check_det(b, shape));
    int L = tdm_tool_pp_layers(&b->spec);
    if (L <= 0 || tdm_model_spec_check_stages(&b->spec)) return tdm_tool_pp_refuse("--model");
    TDM_REQUIRE(S <= L, TDM_STATUS_USAGE,
                "%d stages but the model has %d pipeline layers: at most %d stages", S, L, L);
    TDM_REQUIRE(S <= 64 || (!b->pp.split && N == 1), TDM_STATUS_USAGE,
                "%s: at most 64 stages (%d)", b->pp.split ? "--split" : "--mesh with tp", S);
    int first[64];
    if (b->pp.split) {
        if (tdm_pp_split_parse(b->pp.split, S, L, first)) return tdm_tool_pp_refuse("--split");
        if (tdm_model_spec_check_split(&b->spec, first, S)) return tdm_tool_pp_refuse("--split");
    }
    if (N == 1) return TDM_STATUS_OK;
    tdm_pptp_cut cut[TDM_PPTP_MAX_LAYERS];
    tdm_model_spec narrow;
    if (!b->pp.split && tdm_tool_pp_first(b, S, first)) return tdm_tool_pp_refuse("--model");
    TDM_CHECK(tdm_pptp_plan(&b->spec, S, first, N, cut, &narrow));
    return b->tp.seq_par ? tdm_pptp_check_seq(&b->spec, S, first, N) : TDM_STATUS_OK;
}

size_t tdm_tool_pp_arena_bytes(const tdm_tool_build *b, const tdm_device_list *dl, int world,
                               int64_t param_elems)
{
    tdm_mesh_shape shape;
    if (tdm_tool_pp_check(b, world, &shape) || shape.size[TDM_MESH_DP] < 2) return 0;
    return tdm_tool_ddp_arena_bytes(dl, param_elems);
}

static tdm_status tdm_rank_pp_layout(void *ctx, int world, int rank, tdm_mesh_shape *shape,
                                     int *role)
{
    (void)rank;
    *role = 0;
    return tdm_tool_pp_check(ctx, world, shape);
}

/* ---- set-up ---- */

static void tdm_rank_pp_free(void *ctx, void *self)
{
    (void)ctx;
    tdm_tool_rank *r = self;
    if (!r) return;
    tdm_tool_pp *q = r->w;
    if (q) {
        tdm_ddp_free(q->ddp);
        tdm_dist_det_free(&q->det);
        tdm_optim_free(q->zopt);
        if (q->zbuf) tdm_dev_free(q->zdev, q->zbuf);
        tdm_pp_free(q->p);   /* owns r->m (and r->opt without ZeRO-1) */
        tdm_pptp_fini(&q->tp);
        tdm_model_free(q->tables);
        tdm_tool_mesh_fini(&q->mesh);
        free(q);
    }
    r->m = NULL;
    r->opt = NULL;
    tdm_tool_rank_free(r);
}

static tdm_status tdm_rank_pp_sync_begin(void *ctx)
{
    return tdm_ddp_sync_begin(((tdm_tool_pp *)ctx)->ddp, 0.0);
}

static tdm_status tdm_rank_pp_sync_end(void *ctx, tdm_status st)
{
    return tdm_ddp_sync_end(((tdm_tool_pp *)ctx)->ddp, st);
}

/* this replica's share of the step is empty (a short last batch) */
static tdm_status tdm_rank_pp_sync_empty(void *ctx)
{
    return tdm_ddp_sync_empty(((tdm_tool_pp *)ctx)->ddp);
}

/* TANDEM_TEST_PP_ZERO1_FAIL=step:R:S (rank R's ZeRO-1 step at optimizer
 * step S fails before its gather) or save:R (rank R's ZeRO-1 save fails
 * before its gathers): a test hook, read only by tests/test_pp_cli.c, for
 * the failure paths that must stop the dp peers too. */
static int tdm_rank_pp_zero1_planted(const tdm_tool_pp *q, const char *what, int64_t step)
{
    const char *e = getenv("TANDEM_TEST_PP_ZERO1_FAIL");
    char kind[8];
    int r = -1;
    long long s = 0;
    if (!e || sscanf(e, "%7[a-z]:%d:%lld", kind, &r, &s) < 2 || strcmp(kind, what) ||
        r != q->mesh.rank)
        return 0;
    return !strcmp(what, "save") || s == step;
}

/* ZeRO-1's step of the stage (pp/'s optim_step): this replica's slice
 * of the all-reduced gradients steps its slice of the parameters, then
 * every replica's slice is gathered into every replica's parameters. */
static tdm_status tdm_rank_pp_zero1_step(void *ctx, tdm_model *m)
{
    tdm_tool_pp *q = ctx;
    float *param = tdm_model_params(m);
    int64_t n = tdm_model_param_elems(m), c = q->zchunk, lo = q->rep * c;
    int64_t k = lo >= n ? 0 : n - lo < c ? n - lo : c;
    tdm_optim_range rg = {.param = param + lo, .grad = tdm_model_grads(m) + lo,
                          .state_offset = 0, .n_elem = k};
    if (tdm_rank_pp_zero1_planted(q, "step", tdm_optim_steps(q->zopt) + 1))
        return tdm_error_set(TDM_STATUS_INTERNAL, "rank %d: test hook: ZeRO-1 step %lld fails",
                             q->mesh.rank, (long long)tdm_optim_steps(q->zopt) + 1);
    TDM_CHECK(tdm_optim_step_ranges(q->zopt, &rg, k > 0));
    float *all = q->zbuf ? q->zbuf : param;
    if (q->zbuf && k) TDM_CHECK(tdm_dev_copy(q->zdev, all + lo, param + lo, (size_t)k * 4));
    TDM_CHECK(tdm_dev_sync(q->zdev));
    tdm_comm_set_label(q->zcomm, "pp zero1 gather of the stage's parameters");
    tdm_status st = tdm_comm_all_gather(q->zcomm, all + lo, all, c, TDM_DTYPE_FLOAT32);
    if (st) {
        /* the other replicas of the stage are in (or about to enter) the gather */
        tdm_error_prefix(st, "ZeRO-1 over the dp dimension (replica %d)", q->rep);
        tdm_comm_abort(q->zcomm, tdm_error_message());
        return st;
    }
    if (q->zbuf) TDM_CHECK(tdm_dev_copy(q->zdev, param, all, (size_t)n * 4));
    return TDM_STATUS_OK;
}

/* ZeRO-1's optimizer over this replica's slice of the stage (rounded up
 * to equal chunks) and the padded buffer for the gather. */
static tdm_status tdm_rank_pp_zero1_init(tdm_tool_pp *q, const tdm_optim_opts *o)
{
    int64_t n = tdm_model_param_elems(tdm_pp_model(q->p));
    tdm_dev_mem_stats a, b;
    int measured = tdm_dev_mem_query(q->zdev, &a) == TDM_STATUS_OK;
    q->zchunk = (n + q->reps - 1) / q->reps;
    TDM_CHECK(tdm_optim_init_flat(&q->zopt, q->zdev, q->zchunk, o));
    if (q->zchunk * q->reps != n)
        TDM_CHECK(tdm_dev_alloc_zero(q->zdev, (size_t)(q->zchunk * q->reps) * sizeof(float),
                                     (void **)&q->zbuf));
    if (measured && tdm_dev_mem_query(q->zdev, &b) == TDM_STATUS_OK && b.live_bytes > a.live_bytes)
        q->zbytes = b.live_bytes - a.live_bytes;
    tdm_error_clear();
    return TDM_STATUS_OK;
}

/* ---- --deterministic K (pp/'s shards hooks over dist/det.h's tree) ---- */

/* Micro-batch mb of this replica is virtual shard rep * K/D + mb of the
 * global batch: its rows, from this replica's first. */
static void tdm_rank_pp_det_cut(void *ctx, int batch, int mb, int *lo, int *hi)
{
    tdm_tool_pp *q = ctx;
    int64_t a, z;
    (void)batch;
    tdm_dist_share(q->det_global, q->rep * q->micro + mb, q->det.K, &a, &z);
    *lo = (int)(a - q->det_row0);
    *hi = (int)(z - q->det_row0);
}

static tdm_status tdm_rank_pp_det_leaf(void *ctx, tdm_model *m, int mb, double loss)
{
    (void)m;
    return tdm_dist_det_feed(&((tdm_tool_pp *)ctx)->det, mb, loss);
}

static tdm_status tdm_rank_pp_det_reduce(void *ctx, tdm_model *m, double *loss_sum)
{
    tdm_tool_pp *q = ctx;
    (void)m;
    TDM_CHECK(tdm_dist_det_top(&q->det, loss_sum));
    return tdm_dist_det_write_top(&q->det);
}

/* The stage of this rank (pipeline d->coord[pp] of the replica
 * d->coord[dp]), the Reducer over the dp dimension, --resume. */
static tdm_status tdm_rank_pp_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    const tdm_tool_build *b = ctx;
    TDM_CHECK(tdm_tool_mesh_rank_new(b, d, sizeof(tdm_tool_pp), self));
    tdm_tool_rank *r = *self;
    tdm_tool_pp *q = r->w;
    q->rep = q->mesh.coord[TDM_MESH_DP];
    q->reps = q->mesh.size[TDM_MESH_DP];
    /* on a GPU the pipeline and the Reducer run over NCCL, their host
     * collectives over the group's */
    tdm_comm *pp_dev = q->mesh.dev[TDM_MESH_PP], *dp_dev = q->mesh.dev[TDM_MESH_DP];
    tdm_comm *pp_host = q->mesh.host[TDM_MESH_PP], *dp_host = q->mesh.host[TDM_MESH_DP];
    tdm_status st;
    if ((st = tdm_model_init_tables(&q->tables, &b->spec)))
        return tdm_tool_rank_fail(r, "model tables", st);
    q->in_elems = tdm_model_in_features(q->tables);
    q->out_rows = tdm_model_out_rows(q->tables);
    int first[64];
    int S = d->shape.size[TDM_MESH_PP];
    q->tpn = q->mesh.size[TDM_MESH_TP];
    if ((b->pp.split || q->tpn > 1) && (st = tdm_tool_pp_first(b, S, first)))
        return tdm_tool_rank_fail(r, "--split", st);
    /* tensor-parallel stages: pp/ builds the narrow model's stage */
    const tdm_model_spec *spec = &b->spec;
    if (q->tpn > 1) {
        if ((st = tdm_pptp_init(&q->tp, &b->spec, S, first, q->tpn, q->mesh.coord[TDM_MESH_TP],
                                q->mesh.dev[TDM_MESH_TP], q->mesh.host[TDM_MESH_TP], d->dev)))
            return tdm_tool_rank_fail(r, "tensor-parallel stages", st);
        q->tp.phost = pp_host;
        q->tp.narrow.tp_seq = b->tp.seq_par;   /* --sequence-parallel (the GPT) */
        spec = &q->tp.narrow;
    }
    q->det_on = b->deterministic > 0;
    q->mesh.loss_summed = q->det_on;   /* the tree's loss sum is every replica's */
    q->micro = q->det_on ? b->deterministic / q->reps : b->pp.micro;
    tdm_pp_opts o = {.schedule = b->pp.schedule, .micro_batches = q->micro,
                     .split = b->pp.split || q->tpn > 1 ? first : NULL, .seed = b->seed,
                     .optim = b->optim,
                     .batch = b->pp.batch > 0 ? (b->pp.batch + q->reps - 1) / q->reps : 0,
                     .micro_size = b->pp.batch > 0 ? ((b->pp.batch + q->reps - 1) / q->reps +
                                                      q->micro - 1) / q->micro : 0,
                     .host_comm = pp_dev != pp_host ? pp_host : NULL,
                     .precision = b->precision, .ckpt = b->ckpt};
    q->jcomm = d->dev_comm;
    if (q->det_on)
        o.shards = (tdm_pp_shards){.cut = tdm_rank_pp_det_cut, .leaf = tdm_rank_pp_det_leaf,
                                   .reduce = tdm_rank_pp_det_reduce, .ctx = q,
                                   .first = q->rep * q->micro, .total = b->deterministic};
    else if (q->reps > 1)
        o.grad_sync = (tdm_pp_grad_sync){.begin = tdm_rank_pp_sync_begin,
                                         .end = tdm_rank_pp_sync_end,
                                         .empty = tdm_rank_pp_sync_empty, .ctx = q};
    if (!q->det_on && q->reps > 1) {
        /* dropout's masks: replica r's micro-batches are one device's
         * accumulation steps r*M .. r*M + M-1 of D*M */
        o.shards.first = q->rep * q->micro;
        o.shards.total = q->reps * q->micro;
    }
    if (b->pp.zero1) {
        q->zcomm = dp_dev;
        q->zdev = d->dev;
        o.optim_step = (tdm_pp_optim_step){.fn = tdm_rank_pp_zero1_step, .ctx = q};
    }
    if ((st = tdm_pp_init(&q->p, pp_dev, d->dev, spec, &o)))
        return tdm_tool_rank_fail(r, "pipeline set-up", st);
    if (q->tpn > 1 && (st = tdm_pptp_attach(&q->tp, q->p, b->seed)))
        return tdm_tool_rank_fail(r, "tensor-parallel stage", st);
    r->m = tdm_pp_model(q->p);
    if (b->pp.zero1 && (st = tdm_rank_pp_zero1_init(q, &b->optim)))
        return tdm_tool_rank_fail(r, "ZeRO-1 optimizer over the dp dimension", st);
    r->opt = b->pp.zero1 ? q->zopt : tdm_pp_optim(q->p);
    if (q->det_on) {
        /* the dp dimension's host group: the tree's top over the replicas */
        q->det = (tdm_dist_det){.m = r->m, .comm = q->reps > 1 ? dp_host : NULL,
                                .rank = q->rep, .world = q->reps, .K = b->deterministic,
                                .dev_comm = q->reps > 1 ? tdm_train_det_dev_comm(dp_host, dp_dev)
                                                        : NULL};
        if ((st = tdm_dist_det_init(&q->det)))
            return tdm_tool_rank_fail(r, "--deterministic", st);
    } else if (q->reps > 1) {
        tdm_ddp_opts dopt = {.bucket_cap_mb = b->bucket_cap_mb, .no_overlap = b->no_overlap,
                             .host_comm = dp_dev != dp_host ? dp_host : NULL};
        if ((st = tdm_ddp_init(&q->ddp, r->m, dp_dev, &dopt)))
            return tdm_tool_rank_fail(r, "ddp over the dp dimension", st);
    }
    r->model_params = tdm_model_param_elems(q->tables);
    return tdm_tool_rank_resume(r);
}

/* ---- the step ---- */

/* One optimizer step of the global batch (a tdm_train_step_fn over the
 * rank's tdm_dist_stepper): this replica's share through the pipeline,
 * the loss gradient scaled by 1/B so that DDP's sum over the replicas is
 * the global batch's mean-loss gradient, as one device's. The loss is
 * complete only on the last stage once backwards have begun, so it is
 * checked after the step, on every stage (all stop at the same step; a
 * checkpoint is never written from it). */
static tdm_status tdm_rank_pp_step_fn(void *ctx, const void *x, const int32_t *y, int n,
                                      float grad_scale, double *loss_sum)
{
    tdm_tool_pp *q = ctx;
    tdm_status st = tdm_pp_step_scaled(q->p, x, y, n, grad_scale, loss_sum);
    if (st && q->tpn > 1) {
        /* the stage's group may wait in a partial sum for this rank */
        tdm_comm_abort(q->tp.thost, tdm_error_message());
        if (q->tp.tdev != q->tp.thost) tdm_comm_abort(q->tp.tdev, tdm_error_message());
    }
    return st;
}

static tdm_status tdm_rank_pp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                   double *loss_mean)
{
    tdm_dist_stepper *s = ctx;
    tdm_tool_pp *q = s->w;
    char who[64];
    if (q->tpn > 1)
        snprintf(who, sizeof who, "tensor-parallel rank %d of pipeline stage %d",
                 q->mesh.coord[TDM_MESH_TP], tdm_pp_stage(q->p));
    else
        snprintf(who, sizeof who, "pipeline stage %d", tdm_pp_stage(q->p));
    /* --deterministic: the global batch and this replica's first row in
     * it, for the micro-batches' cut into virtual shards */
    int64_t end;
    q->det_global = s->own_rows ? s->global_batch : batch;
    tdm_dist_share(q->det_global, q->rep, q->reps, &q->det_row0, &end);
    q->tp.replica = q->rep;
    tdm_train_levers_pp_begin(s, q->p, q->jcomm, q->rep, q->tpn > 1 ? tdm_pptp_sumsq : NULL,
                              &q->tp);
    tdm_comm_traffic z0, z1;
    if (q->zopt) tdm_comm_traffic_get(q->zcomm, &z0);
    TDM_CHECK(tdm_tool_mesh_step(s, &q->mesh, q->in_elems, q->out_rows, tdm_rank_pp_step_fn, q,
                                 who, "pp loss over the replicas", x, y, batch, loss_mean));
    tdm_train_levers_pp_end(s, q->p);
    if (q->zopt) {
        tdm_comm_traffic_get(q->zcomm, &z1);
        for (int c = 0; c < TDM_COLL_COUNT_; c++) {
            q->zstep.calls[c] = z1.calls[c] - z0.calls[c];
            q->zstep.bytes[c] = z1.bytes[c] - z0.bytes[c];
        }
    }
    return TDM_STATUS_OK;
}

/* ---- evaluation ---- */

static tdm_status tdm_rank_pp_evaluate(void *w, const tdm_dataset *test, int batch,
                                       double *loss_mean, double *accuracy)
{
    return tdm_pp_evaluate(((tdm_tool_pp *)w)->p, test, batch, loss_mean, accuracy);
}

static tdm_status tdm_rank_pp_eval_fn(void *ctx, const void *x, const int32_t *y, int n,
                                      double *loss_sum, int64_t *correct)
{
    return tdm_pp_eval_batch(ctx, x, y, n, loss_sum, correct);
}

/* Through the pipeline; the sum said by the first stage alone, so that a
 * sum over every rank counts each replica's windows once. */
static tdm_status tdm_rank_pp_eval_loss(void *w, const void *x, const int32_t *y, int n,
                                        double *loss_sum)
{
    tdm_tool_pp *q = w;
    return tdm_tool_mesh_eval_loss(tdm_rank_pp_eval_fn, q->p,
                                   tdm_pp_stage(q->p) == 0 && q->mesh.coord[TDM_MESH_TP] == 0, x,
                                   y, n, loss_sum);
}

/* ---- checkpoints ---- */

/* ZeRO-1's file: replica 0 gathers the parameters and buffers over the
 * pipeline; each optimizer state is first all-gathered over the dp
 * dimension (every replica's slice, into the stage's layout), then over
 * the pipeline onto rank 0: the file DDP x pp writes. */
static tdm_status tdm_rank_pp_zero1_save(tdm_tool_pp *q, const char *path,
                                         const tdm_ckpt_info *info)
{
    int root = q->rep == 0 && tdm_pp_stage(q->p) == 0 && q->mesh.coord[TDM_MESH_TP] == 0;
    float *all = NULL;
    tdm_ckpt_host h;
    memset(&h, 0, sizeof h);
    tdm_status st = root ? tdm_tool_ckpt_host(q->tables, q->zopt, &h) : TDM_STATUS_OK;
    if (!st && tdm_rank_pp_zero1_planted(q, "save", 0))
        st = tdm_error_set(TDM_STATUS_INTERNAL, "rank %d: test hook: ZeRO-1 save fails",
                           q->mesh.rank);
    if (!st) st = tdm_dev_alloc(q->zdev, (size_t)(q->zchunk * q->reps) * sizeof(float),
                                (void **)&all);
    if (st) goto fail;
    if (q->rep == 0) {
        tdm_ckpt_host hp = h;
        hp.optim = NULL;
        /* tensor-parallel stages: over each tp index's pipeline, then
         * stage 0's group, into the whole layout */
        st = q->tpn > 1 ? tdm_pptp_gather(&q->tp, q->p, NULL, root ? &hp : NULL, root)
                        : tdm_pp_gather_state(q->p, root ? &hp : NULL, 0);
        if (st) goto fail;
    }
    for (int i = 0; i < tdm_optim_n_state(q->zopt); i++) {
        tdm_comm_set_label(q->zcomm, "pp zero1 gather of the optimizer state");
        if ((st = tdm_comm_all_gather(q->zcomm, tdm_optim_state(q->zopt, i), all, q->zchunk,
                                      TDM_DTYPE_FLOAT32)))
            goto fail;
        if (q->rep == 0 && q->tpn > 1 &&
            (st = tdm_pptp_gather_stage(&q->tp, q->p, all, root ? h.state[i] : NULL,
                                        tdm_optim_state_name(q->zopt, i))))
            goto fail;
        if (q->rep == 0 && q->tpn == 1 &&
            (st = tdm_pp_gather_stage(q->p, all, root ? h.state[i] : NULL, 0,
                                      tdm_optim_state_name(q->zopt, i))))
            goto fail;
    }
    h.steps = tdm_optim_steps(q->zopt);
    if (root) st = tdm_checkpoint_save_host(path, q->tables, &h, info);
    goto done;
fail:
    /* the other stages, replicas and tensor-parallel ranks may wait in a
     * gather for this one */
    tdm_comm_abort(q->mesh.host[TDM_MESH_PP], tdm_error_message());
    tdm_comm_abort(q->mesh.host[TDM_MESH_DP], tdm_error_message());
    if (q->tpn > 1) tdm_comm_abort(q->mesh.host[TDM_MESH_TP], tdm_error_message());
done:
    if (all) tdm_dev_free(q->zdev, all);
    tdm_ckpt_host_free(&h);
    return st;
}

static tdm_status tdm_rank_pp_gather(void *ctx, tdm_ckpt_host *h, int root)
{
    tdm_tool_pp *q = ctx;
    if (q->tpn > 1)
        return tdm_pptp_gather(&q->tp, q->p, h->optim ? tdm_pp_optim(q->p) : NULL,
                               root ? h : NULL, root);
    return tdm_pp_gather_state(q->p, root ? h : NULL, 0);
}

/* The stage's part of h, parameters (and buffers, and with h->optim
 * the stage optimizer's state), as it holds them: the stage's slice, or
 * on tensor-parallel stages the narrow stage's. */
static tdm_status tdm_rank_pp_take_stage(tdm_tool_pp *q, const tdm_ckpt_host *h)
{
    if (q->tpn > 1) return tdm_pptp_load(&q->tp, q->p, h);
    return tdm_pp_load_state(q->p, h);
}

/* ZeRO-1's resume from any mode's file (the whole model's state): each
 * optimizer state goes into the stage's parameter layout the way the
 * parameters do (loaded as parameters, which slices it as they are
 * sliced: the narrow stage's under tp, the GPT's tied copy included),
 * and the replica's chunk of that into its ZeRO-1 optimizer; then the
 * parameters themselves. The chunks are this run's, whatever the dp size
 * of the run that wrote the file. */
static tdm_status tdm_rank_pp_zero1_take(tdm_tool_pp *q, const tdm_ckpt_host *h)
{
    tdm_model *m = tdm_pp_model(q->p);
    int64_t n = tdm_model_param_elems(m), c = q->zchunk, lo = q->rep * c;
    int64_t k = lo >= n ? 0 : n - lo < c ? n - lo : c;
    int ns = h->optim ? tdm_optim_kind_n_state(h->optim) : 0;
    TDM_REQUIRE(!h->optim || ns == tdm_optim_n_state(q->zopt), TDM_STATUS_MISMATCH,
                "ZeRO-1 resume: the checkpoint's optimizer keeps %d state buffers, this run's %d",
                ns, tdm_optim_n_state(q->zopt));
    for (int i = 0; i < ns; i++) {
        tdm_ckpt_host as = {.params = h->state[i]};
        TDM_CHECK(tdm_rank_pp_take_stage(q, &as));
        if (k)
            TDM_CHECK(tdm_dev_copy(q->zdev, tdm_optim_state(q->zopt, i), tdm_model_params(m) + lo,
                                   (size_t)k * sizeof(float)));
    }
    tdm_ckpt_host ps = *h;
    ps.optim = NULL;
    TDM_CHECK(tdm_rank_pp_take_stage(q, &ps));
    if (h->optim) tdm_optim_set_steps(q->zopt, h->steps);
    return tdm_dev_sync(q->zdev);
}

static tdm_status tdm_rank_pp_take(void *ctx, const tdm_ckpt_host *h)
{
    tdm_tool_pp *q = ctx;
    if (q->zopt) return tdm_rank_pp_zero1_take(q, h);
    return tdm_rank_pp_take_stage(q, h);
}

/* The whole model's state gathered on replica 0's first stage (rank 0),
 * written there as the file every mode writes. */
static tdm_status tdm_rank_pp_save(void *w, const char *path, tdm_optim *opt,
                                   const tdm_ckpt_info *info)
{
    tdm_tool_pp *q = w;
    if (q->zopt) return tdm_rank_pp_zero1_save(q, path, info);
    tdm_status st = tdm_tool_mesh_save(&q->mesh, q->mesh.host[TDM_MESH_PP],
                                       tdm_pp_stage(q->p) == 0 &&
                                           q->mesh.coord[TDM_MESH_TP] == 0,
                                       q->tables, opt, tdm_rank_pp_gather, q, path, info);
    /* stage 0's group gathers after the pipeline: it may wait for this rank */
    if (st && q->tpn > 1) tdm_comm_abort(q->tp.thost, tdm_error_message());
    return st;
}

/* Any mode's file, read by every stage, which keeps its slice. */
static tdm_status tdm_rank_pp_load(void *w, const char *path, tdm_optim *opt,
                                   tdm_ckpt_info *info)
{
    tdm_tool_pp *q = w;
    return tdm_tool_mesh_load(q->tables, opt, tdm_rank_pp_take, q, path, info);
}

static const tdm_dist_ops tdm_rank_pp_ops = {
    .evaluate = tdm_rank_pp_evaluate, .eval_loss = tdm_rank_pp_eval_loss,
    .save = tdm_rank_pp_save, .load = tdm_rank_pp_load};

/* ---- what the CLI prints ---- */

static void tdm_rank_pp_describe(const tdm_tool_rank *r, char *on, size_t n_on, char *note,
                                 size_t n_note)
{
    const tdm_tool_pp *q = r->w;
    char split[160];
    tdm_pp_split_str(tdm_pp_split(q->p), tdm_pp_stages(q->p), split, sizeof split);
    char reps[160];
    const char *how = q->det_on ? "the fixed tree over the dp dimension"
                                : "DDP over the dp dimension";
    char how_z[128];
    snprintf(how_z, sizeof how_z, "%s%s", how,
             q->zopt ? "; ZeRO-1: each replica steps 1/D of a stage" : "");
    tdm_tool_mesh_replicas_str(&q->mesh, how_z, reps, sizeof reps);
    char tp[256] = "";
    if (q->tpn > 1 && q->tp.narrow.kind == TDM_MODEL_GPT) {
        snprintf(tp, sizeof tp, " x tp %d (per block: attn.c_attn column by heads, %d of %d per "
                 "rank, attn.c_proj row, mlp.c_fc column, mlp.c_proj row; embeddings, "
                 "LayerNorms and the tied head replicated%s)", q->tpn,
                 q->tp.narrow.n_head / q->tpn, q->tp.narrow.n_head,
                 q->tp.narrow.tp_seq ? "; sequence parallel: the stream's tokens split" : "");
    } else if (q->tpn > 1) {
        /* each linear layer (its weight fcK.weight) and its cut */
        int k = snprintf(tp, sizeof tp, " x tp %d (", q->tpn), fc = 0;
        static const char *const cut[] = {"replicated", "column", "row"};
        const tdm_model *t = q->tp.whole;
        for (int i = 0; i < tdm_model_n_params(t) && k > 0 && (size_t)k < sizeof tp; i++) {
            const tdm_tensor_info *w = tdm_model_param_info(t, i);
            int K;
            char rest[16];
            if (sscanf(w->name, "fc%d.%15s", &K, rest) != 2 || strcmp(rest, "weight")) continue;
            k += snprintf(tp + k, sizeof tp - (size_t)k, "%sfc%d %s", fc++ ? ", " : "", K,
                          cut[q->tp.cut[w->layer]]);
        }
        if (k > 0 && (size_t)k < sizeof tp) snprintf(tp + k, sizeof tp - (size_t)k, ")");
    }
    snprintf(on, n_on, ", pipeline of %d stages (first layers %s)%s, %s, %d micro-batches%s",
             tdm_pp_stages(q->p), split, tp, tdm_pp_schedule_name(r->b->pp.schedule),
             q->micro, reps);
    snprintf(note, n_note, "%s", "");
}

/* Per stage, what rank 0 prints: the mean phases, the memory, the
 * transfers (doubles, all-gathered over the pipeline). */
enum {
    TDM_PPF_FORWARD = 0, TDM_PPF_BACKWARD, TDM_PPF_LOSS, TDM_PPF_RECV, TDM_PPF_SEND,
    TDM_PPF_BUBBLE, TDM_PPF_PIPELINE, TDM_PPF_SYNC, TDM_PPF_TIED, TDM_PPF_STEP, TDM_PPF_TOTAL,
    TDM_PPF_PARAMS, TDM_PPF_GRADS, TDM_PPF_OPTIM, TDM_PPF_PEAK, TDM_PPF_SETS, TDM_PPF_SET,
    TDM_PPF_OVERLAPPED, TDM_PPF_TRANSFERS, TDM_PPF_LO, TDM_PPF_HI, TDM_PPF_STEPS,
    TDM_PPF_MICRO, TDM_PPF_COUNT_
};

static void tdm_rank_pp_figures(const tdm_tool_pp *q, double f[TDM_PPF_COUNT_])
{
    tdm_pp_stats s;
    tdm_pp_get_stats(q->p, &s);
    tdm_model_stage_info si;
    tdm_model_get_stage(tdm_pp_model(q->p), &si);
    double n = s.steps > 0 ? (double)s.steps : 1.0;
    const tdm_pp_phases *p = &s.sum;
    double ph[] = {p->forward, p->backward, p->loss, p->recv_wait, p->send_wait, p->bubble,
                   p->pipeline, p->grad_sync, p->tied, p->step, p->total};
    for (int i = 0; i <= TDM_PPF_TOTAL; i++) f[i] = ph[i] / n;
    f[TDM_PPF_PARAMS] = (double)s.params;
    f[TDM_PPF_GRADS] = (double)s.grads;
    f[TDM_PPF_OPTIM] = q->zopt ? (double)tdm_optim_state_bytes(q->zopt) : (double)s.optimizer;
    /* pp/ measures above what its set-up left live: ZeRO-1's state and
     * gather buffer, allocated after it, are no activations */
    f[TDM_PPF_PEAK] = s.peak_act == (size_t)-1 ? -1.0
                      : s.peak_act > q->zbytes ? (double)(s.peak_act - q->zbytes)
                                               : 0.0;
    f[TDM_PPF_SETS] = s.act_sets;
    f[TDM_PPF_SET] = (double)s.act_set;
    f[TDM_PPF_OVERLAPPED] = (double)s.overlapped;
    f[TDM_PPF_TRANSFERS] = (double)s.transfers;
    f[TDM_PPF_LO] = si.lo;
    f[TDM_PPF_HI] = si.hi;
    f[TDM_PPF_STEPS] = (double)s.steps;
    f[TDM_PPF_MICRO] = s.micro_size;
}

static void tdm_rank_pp_print(const tdm_tool_rank *r, const double *all, int S)
{
    const double mib = 1.0 / (1024.0 * 1024.0);
    const tdm_tool_pp *q = r->w;
    int M = q->micro;
    double ideal = 100.0 * (S - 1) / (double)(M + S - 1);
    int rows = (r->b->pp.batch + q->reps - 1) / q->reps;
    printf("pp %s, %d stages, %d micro-batches of %d (replica 0, per step, mean over %.0f "
           "steps; ideal bubble (S-1)/(M+S-1) = %.1f%%):\n",
           tdm_pp_schedule_name(r->b->pp.schedule), S, M, (rows + M - 1) / M,
           all[TDM_PPF_STEPS], ideal);
    double overlapped = 0, transfers = 0;
    for (int s = 0; s < S; s++) {
        const double *f = all + s * TDM_PPF_COUNT_;
        char peak[48];
        if (f[TDM_PPF_PEAK] < 0) snprintf(peak, sizeof peak, "not measured on this device");
        else snprintf(peak, sizeof peak, "%.3f MiB", f[TDM_PPF_PEAK] * mib);
        printf("  stage %d (layers %.0f-%.0f): forward %.3f ms, backward %.3f ms, loss %.3f "
               "ms, recv wait %.3f ms, send wait %.3f ms, bubble %.3f ms = %.1f%% of the "
               "pipeline's %.3f ms, tied %.3f ms, grad sync %.3f ms, optimizer %.3f ms\n",
               s, f[TDM_PPF_LO], f[TDM_PPF_HI] - 1, f[TDM_PPF_FORWARD], f[TDM_PPF_BACKWARD],
               f[TDM_PPF_LOSS], f[TDM_PPF_RECV], f[TDM_PPF_SEND], f[TDM_PPF_BUBBLE],
               f[TDM_PPF_PIPELINE] > 0 ? 100.0 * f[TDM_PPF_BUBBLE] / f[TDM_PPF_PIPELINE] : 0.0,
               f[TDM_PPF_PIPELINE], f[TDM_PPF_TIED], f[TDM_PPF_SYNC], f[TDM_PPF_STEP]);
        printf("  stage %d memory: parameters %.3f MiB, gradients %.3f MiB, optimizer %.3f "
               "MiB, peak activations %s (%.0f set%s of %.3f MiB held at once)\n", s,
               f[TDM_PPF_PARAMS] * mib, f[TDM_PPF_GRADS] * mib, f[TDM_PPF_OPTIM] * mib, peak,
               f[TDM_PPF_SETS], f[TDM_PPF_SETS] == 1 ? "" : "s", f[TDM_PPF_SET] * mib);
        overlapped += f[TDM_PPF_OVERLAPPED];
        transfers += f[TDM_PPF_TRANSFERS];
    }
    printf("pp transfers: %.0f of %.0f completed while a stage computed%s%s\n", overlapped,
           transfers, q->reps > 1 ? (q->det_on ? "; gradients summed over the replicas by "
                                                 "the fixed tree" : "; gradients summed over "
                                                 "the replicas by DDP") : "",
           q->zopt ? "; ZeRO-1: optimizer state per stage and replica is 1/D of the stage's "
                     "(replica 0's shown), the slices gathered over the dp dimension"
                   : "");
    if (q->zopt)
        printf("pp zero1, rank 0's last step over the dp dimension (counted by the "
               "communicator): all-reduces of %lld bytes (DDP's buckets: the stage's gradients "
               "and its check tail; on host devices the loss's 8 too), all-gathers of %lld "
               "bytes (the replicas' chunks of %lld elements)\n",
               (long long)q->zstep.bytes[TDM_COLL_ALL_REDUCE],
               (long long)q->zstep.bytes[TDM_COLL_ALL_GATHER], (long long)q->zchunk);
    if (q->tpn > 1)
        printf("pp-tp: each stage's %d ranks hold 1/%d of its split layers (tp rank 0's shown); "
               "rank 0 all-reduced %lld partial sums of %.3f MiB in %.3f ms over the run; its "
               "set-up built its stage's whole layers in %.3f MiB of host memory to slice "
               "them\n", q->tpn, q->tpn, (long long)q->tp.sums, (double)q->tp.sum_bytes * mib,
               q->tp.sum_ms, (double)q->tp.setup_host_bytes * mib);
    if (q->tpn > 1 && q->tp.narrow.tp_seq) {
        /* stage 0's plan of a full step */
        int64_t c, b, lc, lb;
        tdm_pptp_seq_plan(&r->b->spec, S, tdm_pp_split(q->p), 0, rows, (rows + M - 1) / M, &c,
                          &b, &lc, &lb);
        printf("pp-tp sequence parallel: rank 0 ran %lld all-gathers and reduce-scatters of "
               "%lld bytes in %.3f ms over the run, and %lld LayerNorm gradient all-reduces of "
               "%lld bytes; planned per step: %lld of %lld bytes, and %lld of %lld bytes\n",
               (long long)q->tp.seq_calls, (long long)q->tp.seq_bytes, q->tp.seq_ms,
               (long long)q->tp.sums, (long long)q->tp.sum_bytes, (long long)c, (long long)b,
               (long long)lc, (long long)lb);
    }
}

/* Every stage's figures to rank 0, which prints them (collective). */
static tdm_status tdm_rank_pp_finish(tdm_tool_rank *r)
{
    tdm_tool_pp *q = r->w;
    int S = tdm_pp_stages(q->p);
    double mine[TDM_PPF_COUNT_];
    double *all = calloc((size_t)S * TDM_PPF_COUNT_, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "pp summary: %d stages", S);
    tdm_rank_pp_figures(q, mine);
    tdm_comm *pcomm = q->mesh.host[TDM_MESH_PP];
    tdm_comm_set_label(pcomm, "pp summary");
    tdm_status st = tdm_comm_all_gather(pcomm, mine, all, TDM_PPF_COUNT_, TDM_DTYPE_FLOAT64);
    if (st == TDM_STATUS_OK && r->rank == 0) tdm_rank_pp_print(r, all, S);
    free(all);
    return st ? tdm_tool_rank_fail(r, "pp summary", st) : st;
}

/* Replica 0's stages gather the whole model on rank 0 (collective over
 * the pipeline; only root 0 is served). */
static tdm_status tdm_rank_pp_params(tdm_tool_rank *r, float *host, int root)
{
    tdm_tool_pp *q = r->w;
    TDM_REQUIRE(root == 0, TDM_STATUS_UNSUPPORTED,
                "pp: the whole model's parameters are gathered on rank 0 only");
    if (q->rep != 0) return TDM_STATUS_OK;
    if (q->tpn > 1) {
        tdm_ckpt_host h = {.params = host};
        return tdm_pptp_gather(&q->tp, q->p, NULL, r->rank == 0 ? &h : NULL, r->rank == 0);
    }
    return tdm_pp_gather_params(q->p, r->rank == 0 ? host : NULL, 0);
}

const tdm_tool_design tdm_tool_pp_design = {
    .dist = {.name = "pp", .caps = TDM_DIST_MPI | TDM_DIST_NCCL, .layout = tdm_rank_pp_layout,
             .setup = tdm_rank_pp_setup, .free = tdm_rank_pp_free, .ops = &tdm_rank_pp_ops},
    .unit = "pipeline stage", .save_alone = 0, .describe = tdm_rank_pp_describe,
    .params = tdm_rank_pp_params, .step = tdm_rank_pp_step, .finish = tdm_rank_pp_finish};
