/* tools/train_ranks.c: `tandem train --mode ddp|fsdp`, the image models
 * and --model gpt alike: the ranks of a design's table (tools/ranks.h:
 * DDP's, or the sharded modes') run by dist/run.h. Forked here, one per
 * device of --device (with --max-restarts, started again from the last
 * checkpoint after a rank's failure, the flight recorder's verdict said
 * after each failed attempt); or, under `tandem launch` or an MPI
 * launcher (--mode ddp, over --backend), this process is one rank of the
 * job, on its machine's device by local rank.
 *
 * Every rank trains on its part of each global batch (the same global
 * batches as --mode single: tdm_train_epoch_order, or a gpt's windows):
 * an image rank runs its contiguous share of the batch every rank
 * gathers, a gpt's rank draws its own windows, [r*B/W, (r+1)*B/W)
 * (tdm_dist_share), and the loss gradient is scaled by 1/B, so that the
 * gradients summed over the ranks are exactly the global batch's
 * mean-loss gradient even when W does not divide B (dist/step.h, which
 * also stops every rank at the step where one's loss is not finite).
 * Evaluation is spread over the ranks. Rank 0 speaks for the job: it
 * prints progress, results and the design's summary; a replicated design
 * (DDP) saves from rank 0 alone, a sharded one with every rank together.
 * --grad-accum accumulates under no_sync; --uneven trains each rank on
 * its own samples with join (tools/train_uneven.c). A rank that fails
 * says so and stops the group with its reason; a forked job's parent
 * names the root cause and exits 1.
 *
 * The memory levers (tools/train_levers.c) are set on every rank's model
 * and stepper.
 *
 * Test hooks: TANDEM_DDP_TEST_KILL=R:S[:STOP] makes rank R SIGKILL
 * (SIGSTOP) itself before its global step S (tdm_elastic_test_fault,
 * tools/elastic.h), on the first attempt only. TANDEM_TEST_GRAD_INF=R:S
 * makes rank R plant an infinity in the first element of the gradient
 * it holds after step S's backward (after DDP's all-reduce, in FSDP's
 * shard): with fp16's loss scaling every rank must skip step S. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/batch.h"
#include "dist/det.h"
#include "dist/run.h"
#include "dist/step.h"
#include "models/accum.h"
#include "tools/devices.h"
#include "tools/elastic.h"
#include "tools/ranks.h"
#include "tools/tools.h"
#include "tools/train_modes.h"
#include "tools/train_trace.h"

/* The job, shared by every rank (the ranks' dist ctx is its build). */
typedef struct tdm_train_job {
    tdm_tool_build b;                /* b.tool points back here */
    const tdm_train_args *a;
    const tdm_train_text_set *text;  /* a gpt's; NULL: the image models */
    const tdm_dataset *train, *test; /* images: loaded before forking, or by the rank */
    tdm_dataset own_train, own_test; /* a launched rank's */
    int said;                        /* a rank's callback said what failed */
} tdm_train_job;

/* A rank's own state beside its design's. */
typedef struct tdm_train_rank {
    tdm_train_args a;                /* rank 0's; the others quiet, without --save */
    const char *save;                /* --save, on every rank (collective saves) */
    tdm_dist_stepper s;
    tdm_dist_det det;                /* --deterministic K */
    int64_t kill_step;               /* test hook: kill_sig before step kill_step */
    int kill_sig;
    int64_t inf_step;                /* test hook: an inf planted after its backward */
    tdm_grad_scaler scaler;          /* fp16's (the stepper borrows it) */
} tdm_train_rank;

static void tdm_train_fault_hook(void *ctx, int64_t step)
{
    const tdm_tool_rank *r = ctx;
    const tdm_train_rank *t = r->tool;
    if (step == t->kill_step) tdm_elastic_test_fault_fire(r->rank, t->kill_sig, step);
}

/* TANDEM_TEST_DET_CHUNK_ELEMS=N: --deterministic's all-gather in chunks
 * of N floats per rank (0: the default), a test hook read only by
 * tests/test_det.c: small chunks cross every boundary on a small model. */
static int64_t tdm_train_det_chunk(void)
{
    const char *e = getenv("TANDEM_TEST_DET_CHUNK_ELEMS");
    long long n = e ? atoll(e) : 0;
    return n > 0 ? n : 0;
}

/* TANDEM_TEST_GRAD_INF=R:S: this rank's step to plant an inf after, or 0. */
static int64_t tdm_train_inf_step(int rank)
{
    const char *e = getenv("TANDEM_TEST_GRAD_INF");
    int r = -1;
    long long step = 0;
    if (!e || sscanf(e, "%d:%lld", &r, &step) != 2 || r != rank || step < 1) return 0;
    return step;
}

static void tdm_train_inf_hook(void *ctx, int64_t step, const tdm_dist_grads *g)
{
    const tdm_tool_rank *r = ctx;
    const tdm_train_rank *t = r->tool;
    float inf = INFINITY;
    for (int i = 0; step == t->inf_step && i < g->n_bufs; i++)
        if (g->n_elem[i] > 0) {
            fprintf(stderr, "tandem train: rank %d: test hook: an inf planted in its gradient "
                            "at step %lld\n", r->rank, (long long)step);
            (void)tdm_dev_copy_from_host(g->dev, g->bufs[i], &inf, sizeof inf);
            return;
        }
}

/* ---- after each epoch ---- */

/* Rank 0 saved its replica alone (the epoch loop's --save): the others
 * wait here until the file is in place. */
static tdm_status tdm_train_barrier(void *ctx, int64_t epoch)
{
    tdm_tool_rank *r = ctx;
    (void)epoch;
    tdm_status st = tdm_comm_barrier(r->dist->comm);
    return st ? tdm_tool_rank_fail(r, "end-of-epoch barrier", st) : st;
}

/* Every rank saves together (a sharded design; --uneven's). */
static tdm_status tdm_train_save(void *ctx, int64_t epoch)
{
    tdm_tool_rank *r = ctx;
    const tdm_train_rank *t = r->tool;
    const tdm_train_job *j = r->b->tool;
    if (!t->save) return TDM_STATUS_OK;
    tdm_ckpt_info info = {.step = tdm_optim_steps(r->opt), .epoch = epoch + 1,
                          .seed = (uint64_t)t->a.seed};
    if (t->s.scaler) {   /* a resumed run goes on from it (tools/train_levers.c) */
        info.loss_scale = t->s.scaler->scale;
        info.loss_scale_growth = t->s.scaler->growth_tracker;
    }
    const tdm_tool_design *design = r->b->design;
    tdm_status st = design->save ? design->save(r, t->save, &info)
                                 : design->dist.ops->save(r->w, t->save, r->opt, &info);
    if (st) return tdm_tool_rank_fail(r, "saving checkpoint", st);
    if (r->rank != 0 || t->a.quiet) return TDM_STATUS_OK;
    const char *form = design->save_form ? design->save_form(r) : NULL;
    printf("  saved %s (%s%sepoch %lld, step %lld)\n", t->save, form ? form : "",
           form ? ", " : "", (long long)epoch + 1, (long long)info.step);
    if (j->text && !r->b->save_sharded)
        printf("  tandem sample --resume %s%s%s\n", t->save,
               r->b->spec.head_untied ? " --model " : "", r->b->spec.head_untied ? t->a.model : "");
    return TDM_STATUS_OK;
}

/* ---- evaluation ---- */

static tdm_status tdm_train_eval_images(void *ctx, double *loss, double *acc)
{
    tdm_tool_rank *r = ctx;
    const tdm_train_job *j = r->b->tool;
    /* the replica's share of a step: the activations the step reserved */
    int rows = tdm_train_eval_rows(j->a, r->dist->shape.size[TDM_MESH_DP], TDM_TRAIN_EVAL_BATCH);
    return r->b->design->dist.ops->evaluate(r->w, j->test, rows, loss, acc);
}

/* A gpt's validation loss: rank r evaluates its share of the windows,
 * the sums are added. Every rank runs as many forwards as the largest
 * share needs: a sharded design's gathers are collective (a rank whose
 * share is done takes part with none); a replica's forwards are local. */
static tdm_status tdm_train_eval_text(void *ctx, double *loss, double *acc)
{
    tdm_tool_rank *r = ctx;
    const tdm_train_text_set *t = ((const tdm_train_job *)r->b->tool)->text;
    (void)acc;
    /* the data-parallel replicas share the windows (every rank of a
     * replica, as a pipeline's stages, runs the same ones), each forward
     * at most the replica's share of a step */
    int rep = r->dist->coord[TDM_MESH_DP], reps = r->dist->shape.size[TDM_MESH_DP];
    int T = t->T, EB = tdm_train_eval_rows(((const tdm_train_job *)r->b->tool)->a, reps,
                                           TDM_TRAIN_TEXT_EVAL_BATCH);
    int64_t K = t->eval_count, lo, hi;
    tdm_dist_share(K, rep, reps, &lo, &hi);
    int64_t most = (K + reps - 1) / reps, nb = (most + EB - 1) / EB;
    size_t bytes = (size_t)EB * (size_t)T * sizeof(int32_t);
    int32_t *x = malloc(bytes), *y = malloc(bytes);
    double s = 0.0;
    tdm_status st = x && y ? TDM_STATUS_OK
                           : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "text evaluation: malloc");
    for (int64_t b = 0; st == TDM_STATUS_OK && b < nb; b++) {
        int64_t w0 = lo + b * EB, k = hi - w0 < EB ? hi - w0 : EB;
        if (k < 0) k = 0;
        for (int64_t i = 0; i < k; i++)
            tdm_text_eval_window(&t->corpus->val, T, K, w0 + i, x + i * T, y + i * T);
        double ls = 0.0;
        st = r->b->design->dist.ops->eval_loss(r->w, x, y, (int)k, &ls);
        s += ls;
    }
    free(x);
    free(y);
    if (st != TDM_STATUS_OK) {
        /* the others are about to wait for this rank's sum */
        tdm_error_prefix(st, "rank %d evaluating windows %lld..%lld", r->rank, (long long)lo,
                         (long long)hi - 1);
        tdm_comm_abort(r->dist->comm, tdm_error_message());
        return st;
    }
    TDM_CHECK(tdm_comm_all_reduce(r->dist->comm, &s, &s, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    *loss = s / (double)K;
    return TDM_STATUS_OK;
}

/* ---- a rank ---- */

static void tdm_train_rank_free(void *ctx, void *self)
{
    const tdm_tool_build *b = ctx;
    tdm_tool_rank *r = self;
    tdm_train_rank *t = r ? r->tool : NULL;
    /* the det state's device blocks are freed through the rank's model
     * (tdm_det_dev): before the design frees the model (ASan: a
     * heap-use-after-free on the device-comm path) */
    if (t) tdm_dist_det_free(&t->det);
    b->design->dist.free(ctx, self);
    free(t);
}

/* --deterministic K with a pipeline, whose micro-batches are its virtual
 * shards: an epoch's short last batch must give each shard a sample too.
 * USAGE with the message. */
static tdm_status tdm_train_det_last(const tdm_train_job *j, const tdm_train_args *a)
{
    int64_t left = a->deterministic && j->b.design == &tdm_tool_pp_design && j->train && !j->text
                       ? j->train->n % a->batch : 0;
    if (!left || left >= a->deterministic) return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_USAGE, "--deterministic %lld --mode %s: each epoch ends on "
                         "a batch of %lld samples, fewer than the K virtual shards (one per "
                         "micro-batch); pick a --batch that leaves at least K or none",
                         a->deterministic, a->mode, (long long)left);
}

/* Rank 0 speaks for the job: the others write nothing to stdout, save
 * nothing alone and show no progress. Then a launched rank's data, and
 * the design's rank. */
static tdm_status tdm_train_rank_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    tdm_tool_build *b = ctx;
    tdm_train_job *j = b->tool;
    int rank = d->env.rank, world = d->shape.size[TDM_MESH_DP];   /* replicas */
    tdm_train_rank *t = calloc(1, sizeof *t);
    TDM_REQUIRE(t, TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", rank);
    t->a = *j->a;
    t->save = t->a.save;
    if (!b->design->save_alone) t->a.save = NULL;   /* the epoch loop's save is one process's */
    tdm_dist_silence(rank, NULL);
    if (rank != 0) {
        t->a.save = NULL;
        t->a.quiet = 1;
        t->a.json = t->a.csv = NULL;   /* rank 0 writes the run's records */
    }
    tdm_status st = TDM_STATUS_OK;
    if (j->text && t->a.batch < world) {
        /* every rank sees it: rank 0 says it */
        if (rank == 0)
            fprintf(stderr, "tandem train: --batch %lld is smaller than the %d ranks: each "
                    "rank needs at least one window of every global batch\n", t->a.batch, world);
        st = tdm_error_set(TDM_STATUS_USAGE, "--batch %lld is smaller than the %d ranks",
                           t->a.batch, world);
    } else if (t->a.deterministic && !b->design->step &&
               tdm_dist_det_check((int)t->a.deterministic, world, t->a.batch)) {
        if (rank == 0) fprintf(stderr, "tandem train: %s\n", tdm_error_message());
        st = TDM_STATUS_USAGE;
    } else if (!j->text && !j->train) {
        st = tdm_train_load_data(j->a, &b->spec, &j->own_train, &j->own_test);
        j->train = &j->own_train;
        j->test = &j->own_test;
    }
    if (st == TDM_STATUS_OK && tdm_train_det_last(j, &t->a)) {
        if (rank == 0) fprintf(stderr, "tandem train: %s\n", tdm_error_message());
        st = TDM_STATUS_USAGE;
    }
    if (st == TDM_STATUS_OK) st = b->design->dist.setup(ctx, d, self);
    tdm_tool_rank *r = *self;
    if (r) r->tool = t;
    else free(t);
    /* the forked path checked on a probe; a launched rank checks here (a
     * pipeline's first stage: the others take activations) */
    tdm_model_stage_info si = {.is_first = 1};
    if (r && r->m) tdm_model_get_stage(r->m, &si);
    if (st == TDM_STATUS_OK && !j->text && si.is_first)
        st = tdm_train_check_features(j->train, r->m);
    j->said = st != TDM_STATUS_OK;
    return st;
}

/* The header line's devices: "2 processes on cpu:2 (shm communicator,
 * zero-copy buckets, timeout 60 s)". */
static void tdm_train_rank_header(const tdm_tool_rank *r, const tdm_train_job *j)
{
    const tdm_dist_rank *d = r->dist;
    char on[400] = "", note[64] = "", desc[640];
    if (r->b->design->describe) r->b->design->describe(r, on, sizeof on, note, sizeof note);
    const char *backend = tdm_comm_backend_name(d->dev_comm);
    if (d->job_desc)
        snprintf(desc, sizeof desc, "%d MPI ranks on %s%s (%s; gradients over %s%s, timeout %g "
                 "s)", r->world, j->a->device, on, d->job_desc, backend, note,
                 (double)d->timeout_ms / 1000.0);
    else
        snprintf(desc, sizeof desc, "%d processes on %s%s (%s communicator%s, timeout %g s)",
                 r->world, j->a->device, on, backend, note, (double)d->timeout_ms / 1000.0);
    const tdm_train_rank *t = r->tool;
    int64_t params = r->model_params ? r->model_params : tdm_model_param_elems(r->m);
    if (j->text)
        tdm_train_text_header(j->text, &r->b->spec, &t->a, params, desc);
    else
        tdm_train_print_header(&t->a, &r->b->spec, j->train, j->test, params, desc);
}

/* The epochs: the global batch's steps (or --grad-accum's, or
 * --uneven's), evaluation, the saves; then rank 0's summary. */
/* --trace: the design's phases of the rank's last step. */
static int tdm_train_rank_phases(void *ctx, tdm_phase_times *out)
{
    const tdm_tool_rank *r = ctx;
    return r->b->design->phases(r, out);
}

/* --trace: every rank's events to rank 0, which writes the file. */
static tdm_status tdm_train_rank_trace(const tdm_tool_rank *r, const tdm_dist_rank *d,
                                       tdm_train_trace *trace)
{
    char process[96];
    snprintf(process, sizeof process, "tandem train --mode %s, %d ranks", r->b->design->dist.name,
             d->env.world_size);
    tdm_status st = tdm_train_trace_write(trace, d->comm, process);
    if (st != TDM_STATUS_OK) tdm_tool_rank_fail(r, "--trace", st);
    return st;
}

static tdm_status tdm_train_rank_run(void *ctx, tdm_dist_rank *d, void *self)
{
    tdm_tool_build *b = ctx;
    tdm_train_job *j = b->tool;
    tdm_tool_rank *r = self;
    tdm_train_rank *t = r->tool;
    const tdm_tool_design *design = b->design;
    const tdm_train_args *a = &t->a;
    tdm_train_trace *trace = NULL;
    if (r->rank == 0) tdm_train_rank_header(r, j);
    t->kill_step = tdm_elastic_test_fault(r->rank, &t->kill_sig);
    int64_t lo = 0, hi = a->batch;
    if (j->text)
        tdm_dist_share(a->batch, d->coord[TDM_MESH_DP], d->shape.size[TDM_MESH_DP], &lo, &hi);
    t->s = (tdm_dist_stepper){.ops = design->dist.ops, .w = r->w, .opt = r->opt, .comm = d->comm,
                              .rank = r->rank, .world = r->world,
                              .in_elems = tdm_model_in_features(r->m),
                              .out_rows = tdm_model_out_rows(r->m), .own_rows = j->text != NULL,
                              .global_batch = (int)a->batch,
                              .unit = j->text ? "window" : NULL,
                              .before = tdm_train_fault_hook, .before_ctx = r};
    t->inf_step = tdm_train_inf_step(r->rank);
    if (t->inf_step) t->s.after_backward = tdm_train_inf_hook;
    TDM_CHECK(tdm_train_levers_rank(a, r, &t->s, &t->scaler));
    tdm_train_eval_fn eval = j->text ? tdm_train_eval_text : tdm_train_eval_images;
    tdm_status st;
    if (a->uneven) {
        tdm_train_uneven u = {.ops = design->dist.ops, .w = r->w, .opt = r->opt, .m = r->m,
                              .comm = d->comm,
                              .train = j->train, .test = j->test, .text = j->text,
                              .eval = j->text ? eval : NULL, .save = tdm_train_save, .ctx = r,
                              .start_epoch = r->start_epoch};
        st = tdm_train_uneven_run(a, &u);
    } else {
        tdm_train_run run = {.m = r->m, .opt = r->opt, .start_epoch = r->start_epoch,
                             .step = design->step ? design->step : tdm_dist_step,
                             .step_ctx = &t->s, .train = j->train,
                             .test = j->test, .eval = eval, .eval_ctx = r,
                             .after = design->save_alone ? tdm_train_barrier : tdm_train_save,
                             .after_ctx = r, .text = j->text, .lo = (int)lo, .hi = (int)hi,
                             .ranks = &t->s};
        tdm_accum acc = {.ops = design->accum ? design->accum : &tdm_dist_accum_ops,
                         .ctx = &t->s, .micro = (int)a->batch,
                         .in_features = tdm_model_in_features(r->m),
                         .out_rows = tdm_model_out_rows(r->m)};
        if (a->grad_accum > 1) {
            run.step = tdm_accum_step;
            run.step_ctx = &acc;
        }
        t->det = (tdm_dist_det){.ops = tdm_dist_det_stepper_ops(&t->s), .ctx = &t->s, .m = r->m,
                                .comm = d->comm, .rank = r->rank, .world = r->world,
                                .K = (int)a->deterministic, .in_elems = t->s.in_elems,
                                .out_rows = t->s.out_rows, .own_rows = t->s.own_rows,
                                .global_batch = (int)a->batch,
                                .micro = a->grad_accum > 1 ? (int)a->batch : 0,
                                .before = tdm_train_fault_hook, .before_ctx = r,
                                .chunk_elems = tdm_train_det_chunk(),
                                .dev_comm = tdm_train_det_dev_comm(d->comm, d->dev_comm)};
        st = TDM_STATUS_OK;
        /* a design with a step of its own (a pipeline) runs the tree itself */
        int det = a->deterministic && !design->step;
        if (det && (st = tdm_dist_det_init(&t->det)) != TDM_STATUS_OK)
            tdm_tool_rank_fail(r, "--deterministic", st);
        run.step = det ? tdm_dist_det_step : run.step;
        run.step_ctx = det ? (void *)&t->det : run.step_ctx;
        if (st == TDM_STATUS_OK && a->trace) {
            char track[32];
            snprintf(track, sizeof track, "rank %d", d->env.rank);
            st = tdm_train_trace_new(&trace, a->trace, d->env.rank, d->env.world_size, track);
            /* one clock when every rank is on this machine */
            if (st == TDM_STATUS_OK)
                st = tdm_train_trace_start(trace, d->comm,
                                           d->env.local_world_size == d->env.world_size);
            if (st != TDM_STATUS_OK) tdm_tool_rank_fail(r, "--trace", st);
            run.trace = trace;
            /* a step's phases are its own only with one pass per step */
            if (design->phases && a->grad_accum <= 1 && !a->deterministic) {
                run.phases = tdm_train_rank_phases;
                run.phases_ctx = r;
            }
        }
        if (st == TDM_STATUS_OK) st = tdm_train_epochs(a, &run);
    }
    if (st == TDM_STATUS_OK && design->finish) st = design->finish(r);
    if (st == TDM_STATUS_OK && trace) st = tdm_train_rank_trace(r, d, trace);
    tdm_train_trace_free(trace);
    j->said = st != TDM_STATUS_OK;
    if (st == TDM_STATUS_OK && r->rank == 0 && design->report) design->report(r, !j->text);
    if (st == TDM_STATUS_OK) tdm_train_levers_rank_report(a, r);
    return st;
}

/* ---- the job ---- */

/* The parent's checks before forking: the data (loaded here, checked on
 * a probe model) and, for the zero-copy arena, the parameter count. */
static tdm_status tdm_train_ranks_forked(tdm_train_job *j, tdm_dist_run_opts *o)
{
    const tdm_train_args *a = j->a;
    int64_t param_elems = 0;
    int replicas = o->devices->count;
    if (j->b.design == &tdm_tool_pp_design) {
        tdm_mesh_shape shape;
        if (tdm_tool_pp_check(&j->b, o->devices->count, &shape))
            return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
        replicas = shape.size[TDM_MESH_DP];
    }
    if (j->b.design == &tdm_tool_tp_design) {
        tdm_mesh_shape shape;
        if (tdm_tool_tp_check(&j->b, o->devices->count, &shape))
            return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
        replicas = shape.size[TDM_MESH_DP];
    }
    if (j->text && a->batch < replicas)
        return tdm_tool_usage_error("tandem train: --batch %lld is smaller than the %d %s: "
                                    "each needs at least one window of every global batch\n",
                                    a->batch, replicas,
                                    replicas == o->devices->count ? "ranks"
                                                                  : "pipeline replicas");
    TDM_CHECK(tdm_train_load_and_probe(a, &j->b.spec, j->text ? NULL : &j->own_train,
                                       &j->own_test, &param_elems));
    if (!j->text) {
        j->train = &j->own_train;
        j->test = &j->own_test;
    }
    if (tdm_train_det_last(j, a))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if (j->b.design == &tdm_tool_ddp_design)
        o->arena_bytes = tdm_tool_ddp_arena_bytes(o->devices, param_elems);
    if (j->b.design == &tdm_tool_pp_design)
        o->arena_bytes = tdm_tool_pp_arena_bytes(&j->b, o->devices, o->devices->count,
                                                 param_elems);
    return TDM_STATUS_OK;
}

/* What every rank builds, from the arguments. */
static tdm_status tdm_train_ranks_build(tdm_train_job *j, const tdm_tool_design *design,
                                        const tdm_model_spec *spec)
{
    const tdm_train_args *a = j->a;
    tdm_tool_build *b = &j->b;
    *b = (tdm_tool_build){.design = design, .cmd = "tandem train", .seed = (uint64_t)a->seed,
                          .resume = a->resume, .no_overlap = a->no_overlap, .join = a->uneven,
                          .bucket_cap_mb = a->bucket_cap_mb > 0 ? a->bucket_cap_mb : 0,
                          .sync_bn = a->sync_bn, .comm_hook = a->comm_hook,
                          .powersgd = {.rank = (int)a->powersgd_rank,
                                       .start_step = a->powersgd_start_step,
                                       .seed = (uint64_t)a->seed},
                          .save_sharded = a->save_sharded, .tool = j,
                          .deterministic = (int)a->deterministic};
    if (spec) b->spec = *spec;
    else if (tdm_model_spec_parse(&b->spec, a->model))
        return tdm_tool_usage_error("tandem train: --model: %s\n", tdm_error_message());
    tdm_optim_opts_named(&b->optim, a->optim, a->lr, a->weight_decay, a->momentum, a->nesterov);
    b->pp.stages = (int)a->stages;
    b->pp.micro = (int)a->microbatches;
    b->pp.split = a->split;
    b->pp.mesh = a->mesh;
    b->tp.seq_par = a->sequence_parallel;
    /* checked: "optimizer" or "grad_op" (tdm_train_check_tp) */
    tdm_fsdp_sharding tsh = TDM_FSDP_SHARD_OPTIM;
    if (design == &tdm_tool_tp_design && a->sharding &&
        tdm_fsdp_sharding_parse(a->sharding, &tsh) == TDM_STATUS_OK)
        b->tp.zero = tsh == TDM_FSDP_SHARD_GRAD_OP ? 2 : 1;
    b->pp.batch = (int)a->batch;
    b->pp.zero1 = design == &tdm_tool_pp_design && a->sharding;   /* checked: "optimizer" */
    if (a->schedule && tdm_pp_schedule_parse(a->schedule, &b->pp.schedule))
        return tdm_tool_usage_error("tandem train: --schedule: %s\n", tdm_error_message());
    tdm_train_levers_build(a, b);
    if (design != &tdm_tool_fsdp_design) return TDM_STATUS_OK;
    tdm_fsdp_comm_hook hook;
    if (tdm_fsdp_sharding_parse(a->sharding ? a->sharding : "full", &b->sharding))
        return tdm_tool_usage_error("tandem train: --sharding: %s\n", tdm_error_message());
    if (a->comm_hook && tdm_fsdp_comm_hook_parse(a->comm_hook, &hook))
        return tdm_tool_usage_error("tandem train: --comm-hook: %s\n", tdm_error_message());
    if (a->bucket_cap_mb > 0)
        fprintf(stderr, "tandem train: note: --bucket-cap-mb applies to --mode ddp; FSDP "
                        "communicates per unit (a layer with parameters)\n");
    return TDM_STATUS_OK;
}

tdm_status tdm_train_run_ranks(const tdm_train_args *a, const tdm_tool_design *design,
                               const tdm_model_spec *spec, const tdm_train_text_set *text)
{
    tdm_train_job j = {.a = a, .text = text};
    tdm_device_list dl;
    tdm_status st;
    TDM_CHECK(tdm_train_ranks_build(&j, design, spec));
    tdm_train_note_threads(a, design->unit);
    /* The process group's timeout: --timeout, else TANDEM_TIMEOUT, else
     * the start's default (dist/timeout.h). The flag is also exported as
     * TANDEM_TIMEOUT, so that the ranks' NCCL communicators get it too. */
    tdm_elastic_watch w;
    tdm_dist_run_opts o = {.devices = &dl, .spec = a->device, .max_restarts = a->max_restarts,
                           .save = a->save, .resume = &j.b.resume, .watch = &w.dist,
                           .min_world = (int)a->min_devices,
                           .world_divides = (int)a->deterministic};
    if (a->timeout && tdm_dist_timeout_parse("--timeout", a->timeout, &o.timeout_ms))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if (a->timeout) setenv(TDM_DIST_ENV_TIMEOUT, a->timeout, 1);
    tdm_dist_design d = design->dist;
    d.setup = tdm_train_rank_setup;
    d.run = tdm_train_rank_run;
    d.free = tdm_train_rank_free;
    tdm_dist_start start = tdm_dist_job_start(&d, &o);
    int64_t timeout_ms;
    if (tdm_dist_job_timeout(&o, start, &timeout_ms))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if ((st = tdm_dist_backend_choose(a->backend, start == TDM_DIST_START_MPI,
                                      design == &tdm_tool_pp_design   ? "train --mode pp"
                                      : design == &tdm_tool_tp_design ? "train --mode tp"
                                                                      : "train --mode ddp",
                                      &o.backend))) {
        fprintf(stderr, "tandem train: %s\n", tdm_error_message());
        return st == TDM_STATUS_UNSUPPORTED ? st : TDM_STATUS_USAGE;
    }
    /* a mesh (pp, tp) splits the job's communicator into its groups */
    if (start == TDM_DIST_START_MPI && o.backend == TDM_MPI_BACKEND_HIER && design->dist.layout)
        return tdm_tool_usage_error("tandem train: --backend hier: --mode %s splits its ranks "
                                    "into the groups of a mesh, which the hierarchical "
                                    "communicator cannot be split into: use --backend mpi (the "
                                    "default on several machines)\n", design->dist.name);
    if ((st = tdm_dist_parse_devices(&dl, a->device, start == TDM_DIST_START_FORKED))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    if (start == TDM_DIST_START_FORKED && a->deterministic && !design->step &&
        tdm_dist_det_check((int)a->deterministic, dl.count, a->batch))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if (start == TDM_DIST_START_FORKED) {
        /* a refusal after the data loaded frees it (ASan: leaked) */
        if ((st = tdm_train_ranks_forked(&j, &o))) {
            tdm_data_free(&j.own_train);
            tdm_data_free(&j.own_test);
            return st;
        }
        tdm_elastic_watch_init(&w, "tandem train", design->dist.name, a->max_restarts);
        w.min_devices = a->min_devices;
        w.divides = a->deterministic;
        w.save = a->save;
        /* a mesh's failed rank is named with its coordinates too */
        tdm_mesh_shape shape;
        if ((design == &tdm_tool_tp_design && !tdm_tool_tp_check(&j.b, dl.count, &shape)) ||
            (design == &tdm_tool_pp_design && !tdm_tool_pp_check(&j.b, dl.count, &shape))) {
            w.shape = shape;
            w.has_shape = 1;
        }
        fflush(stdout);
    }
    st = tdm_dist_run(&d, &j.b, &o);
    /* a launched rank's failure in the job's plumbing (joining, its
     * device) is said here; the ranks' own were said where they failed,
     * and a forked job's by the watch */
    if (st && start != TDM_DIST_START_FORKED && !j.said)
        fprintf(stderr, "tandem train: %s\n", tdm_error_message());
    tdm_data_free(&j.own_train);
    tdm_data_free(&j.own_test);
    return st;
}
