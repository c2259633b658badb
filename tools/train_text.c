/* tools/train_text.c: `tandem train --model gpt[:L-D-H-T]`: a byte-level
 * language model on text (core/text.h: Debian's fortunes by default, or
 * --data FILE|DIR) with one device, DataParallel, DDP or sharded data
 * parallel (--mode fsdp --sharding full|grad_op|optimizer: fsdp/, ranks
 * as DDP's, each drawing its share of the windows; the tied token
 * embedding and output head live in one unit, docs/FSDP.md). Each epoch draws
 * as many bytes as the training split holds, in random windows; after it
 * the validation loss (nats and bits per byte, on the fixed evaluation
 * windows) is printed beside the bigram baseline's. The global batch is B
 * windows in every mode: DP scatters them over its devices, and DDP rank r
 * draws its share, windows [r*B/W, (r+1)*B/W) (tdm_ddp_share), itself (no
 * rank reads another's), with its loss gradient scaled by 1/B so the
 * summed gradients are the global batch's; evaluation is spread over the
 * ranks likewise. The epochs are tools/train_loop.c's, as for images;
 * with --uneven (DDP, FSDP) tools/train_uneven.c's, each rank drawing its
 * own windows and joining when it runs out. --comm-hook compresses DDP's
 * buckets or FSDP's reduce-scatters as for images.
 * Checkpoints hold the model (and optimizer); `tandem sample` reads them. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <math.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/text.h"
#include "ddp/ddp.h"
#include "ddp/pg.h"
#include "ddp/spawn.h"
#include "dp/dp.h"
#include "fsdp/fsdp.h"
#include "models/checkpoint.h"
#include "models/gpt.h"
#include "models/train_text.h"
#include "tools/ddp_rank.h"
#include "tools/devices.h"
#include "tools/elastic.h"
#include "tools/mpi_job.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

/* Evaluation windows (at most) and windows per evaluation forward. */
#define TDM_TEXT_EVAL_CAP 512
#define TDM_TEXT_EVAL_BATCH 32

typedef struct tdm_text_job {
    const tdm_train_args *a;
    tdm_model_spec spec;
    tdm_device_list dl;
    const tdm_text_corpus *corpus;
    double bigram;
    int64_t eval_count;
    int fsdp;                        /* --mode fsdp */
    tdm_fsdp_sharding sharding;
    int64_t timeout_ms;              /* DDP, FSDP: the process group's */
} tdm_text_job;

/* One process's run: its model and optimizer, and the mode's state. */
typedef struct tdm_text_proc {
    const tdm_text_job *j;
    tdm_model *m;
    tdm_optim *opt;
    int64_t start_epoch;
    int lo, hi;                      /* this process's windows of a global batch */
    tdm_dp *dp;                      /* DP */
    double dp_ms;                    /* DP: step time summed */
    tdm_phase_times dp_sum;
    int64_t dp_steps;
    tdm_ddp *ddp;                    /* DDP ranks */
    tdm_fsdp *f;                     /* FSDP ranks */
    const char *save;                /* FSDP: --save, written by every rank together */
    tdm_comm *comm;                  /* DDP, FSDP: the shm communicator */
    int rank, world, batch;
    int64_t steps, kill_step;        /* DDP test hook (tools/elastic.h): kill_sig */
    int kill_sig;                    /* before step kill_step */
} tdm_text_proc;

static void tdm_text_header(const tdm_text_job *j, const tdm_train_args *a, int64_t params,
                            const char *devices)
{
    char desc[64];
    tdm_model_spec_describe(&j->spec, desc, sizeof desc);
    int T = j->spec.n_ctx;
    printf("tandem train: mode %s, model %s (%lld parameters), %s\n", a->mode, desc,
           (long long)params, devices);
    printf("  data: %s: %lld training and %lld validation bytes\n", j->corpus->source,
           (long long)j->corpus->train.n, (long long)j->corpus->val.n);
    printf("  batch %lld windows of %d bytes (%lld tokens), %lld steps per epoch; %s lr %g",
           a->batch, T, a->batch * T,
           (long long)tdm_train_text_steps_per_epoch(&j->corpus->train, T, (int)a->batch), a->optim,
           a->lr);
    if (!strcmp(a->optim, "sgd"))
        printf(" momentum %g%s", a->momentum, a->nesterov ? " nesterov" : "");
    printf(" weight decay %g%s, seed %lld\n", a->weight_decay,
           strcmp(a->lr_schedule, "cosine") ? "" : ", cosine schedule", (long long)a->seed);
    printf("  baseline: a bigram model gets %.4f nats per byte (%.3f bits) on the %lld "
           "validation windows\n", j->bigram, j->bigram / M_LN2, (long long)j->eval_count);
    tdm_tool_print_emulated(stdout, a->device);
    fflush(stdout);
}

/* The epoch loop's view of a process: the text, its share, and the rest
 * filled in by the mode. */
static tdm_train_run tdm_text_run(const tdm_text_proc *p)
{
    const tdm_text_job *j = p->j;
    return (tdm_train_run){.m = p->m, .opt = p->opt, .start_epoch = p->start_epoch,
                           .text = &j->corpus->train, .T = j->spec.n_ctx, .lo = p->lo,
                           .hi = p->hi, .bigram = j->bigram};
}

/* ---- one device and DP (one process) ---- */

static tdm_status tdm_text_eval_here(void *ctx, double *loss, double *acc)
{
    tdm_text_proc *p = ctx;
    (void)acc;
    return tdm_train_text_evaluate(p->m, &p->j->corpus->val, TDM_TEXT_EVAL_CAP,
                                   TDM_TEXT_EVAL_BATCH, loss);
}

static tdm_status tdm_text_dp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                   double *loss)
{
    tdm_text_proc *p = ctx;
    TDM_CHECK(tdm_dp_step(p->dp, p->opt, x, y, batch, loss));
    const tdm_dp_timings *t = tdm_dp_last_timings(p->dp);
    for (int k = 0; k < TDM_PHASE_COUNT_; k++) p->dp_sum.ms[k] += t->wall.ms[k];
    p->dp_ms += t->step_ms;
    p->dp_steps++;
    return TDM_STATUS_OK;
}

/* The devices of --mode dp, or the one device of --mode single. */
static tdm_status tdm_text_open_devices(const tdm_train_args *a, int dp, tdm_device **devs,
                                        int *n)
{
    tdm_status st;
    if (dp) {
        tdm_train_note_threads(a, "DP device");
        if ((st = tdm_dp_devices_open(a->device, devs, n)) != TDM_STATUS_OK)
            return tdm_train_fail("--device",
                                  st == TDM_STATUS_INVALID_ARG ? tdm_tool_usage(st) : st);
        return TDM_STATUS_OK;
    }
    tdm_device_list dl;
    if ((st = tdm_device_list_parse(&dl, a->device)) != TDM_STATUS_OK)
        return tdm_train_fail("--device", st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st));
    if (dl.count != 1)
        return tdm_tool_usage_error("tandem train: --mode single uses one device, but '%s' "
                                    "names %d (use --mode dp or --mode ddp for several)\n",
                                    a->device, dl.count);
    if ((st = tdm_device_open(&devs[0], dl.kind == TDM_DEVICE_CUDA ? "cuda" : "cpu",
                              dl.index[0], (int)a->threads)) != TDM_STATUS_OK)
        return tdm_train_fail("opening device", st);
    *n = 1;
    return TDM_STATUS_OK;
}

/* Model and optimizer on dev, and --resume. */
static tdm_status tdm_text_make(tdm_text_proc *p, tdm_device *dev)
{
    const tdm_train_args *a = p->j->a;
    tdm_status st;
    if ((st = tdm_model_init(&p->m, dev, &p->j->spec, (uint64_t)a->seed)) != TDM_STATUS_OK)
        return tdm_train_fail("building model", st);
    TDM_CHECK(tdm_train_make_optim(a, p->m, &p->opt));
    return tdm_train_resume(a, p->m, p->opt, &p->start_epoch);
}

static tdm_status tdm_text_run_local(const tdm_text_job *j)
{
    const tdm_train_args *a = j->a;
    int dp = !strcmp(a->mode, "dp"), n = 0;
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    tdm_text_proc p = {.j = j, .lo = 0, .hi = (int)a->batch};
    tdm_single single = {0};
    char desc[128];
    tdm_status st;
    TDM_CHECK(tdm_text_open_devices(a, dp, devs, &n));
    TDM_TRY(tdm_text_make(&p, devs[0]));
    tdm_train_run r = tdm_text_run(&p);
    r.eval = tdm_text_eval_here;
    r.eval_ctx = &p;
    if (dp) {
        if ((st = tdm_dp_init(&p.dp, p.m, devs, n, NULL)) != TDM_STATUS_OK) {
            tdm_train_fail("DataParallel", st);
            goto fail;
        }
        r.step = tdm_text_dp_step;
        r.step_ctx = &p;
        snprintf(desc, sizeof desc, "DataParallel over %d device%s (%s), output device %s", n,
                 n > 1 ? "s" : "", a->device, tdm_dev_name(devs[0]));
    } else {
        single.model = p.m;
        single.opt = p.opt;
        r.step = tdm_single_step;
        r.step_ctx = &single;
        snprintf(desc, sizeof desc, "device %s, %lld BLAS thread%s", tdm_dev_name(devs[0]),
                 (long long)a->threads, a->threads > 1 ? "s" : "");
    }
    tdm_text_header(j, a, tdm_model_param_elems(p.m), desc);
    TDM_TRY(tdm_train_epochs(a, &r));
    if (dp) tdm_train_print_dp_phases(&p.dp_sum, p.dp_ms, p.dp_steps);
fail:
    tdm_dp_free(p.dp);
    tdm_single_free(&single);
    tdm_optim_free(p.opt);
    tdm_model_free(p.m);
    tdm_dp_devices_close(devs, n);
    return st;
}

/* ---- DDP ranks ---- */

static tdm_status tdm_text_fail(int rank, const char *what, tdm_status st)
{
    fprintf(stderr, "tandem train: rank %d: %s: %s\n", rank, what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return st;
}

/* This rank's share of the windows gave a loss that is not finite: as
 * the image models' ranks (tools/train_ddp.c), it stops before the
 * gradient collectives and aborts the group with the reason, so every
 * rank stops at the same step, the others naming this one. */
static tdm_status tdm_text_diverged(tdm_text_proc *p, double ls, int n)
{
    char where[96];
    snprintf(where, sizeof where, "rank %d's %d window%s of the batch of %d", p->rank, n,
             n == 1 ? "" : "s", p->batch);
    return tdm_train_rank_diverged(p->comm, p->rank, tdm_optim_steps(p->opt) + 1, ls, where);
}

static tdm_status tdm_text_ddp_step(void *ctx, const void *x, const int32_t *y, int n,
                                    double *loss)
{
    tdm_text_proc *p = ctx;
    tdm_status st = TDM_STATUS_OK;
    double ls = 0.0;
    if (++p->steps == p->kill_step) tdm_elastic_test_fault_fire(p->rank, p->kill_sig, p->steps);
    TDM_TRY(tdm_ddp_zero_grad(p->ddp));
    /* 1/B, not 1/n: the SUM over ranks is the global batch's mean gradient */
    TDM_TRY(tdm_ddp_forward_scaled(p->ddp, x, y, n, 1.0f / (float)p->batch, &ls));
    if (!isfinite(ls)) return tdm_text_diverged(p, ls, n);
    TDM_TRY(tdm_ddp_backward(p->ddp));
    TDM_TRY(tdm_ddp_step(p->ddp, p->opt));
    *loss = tdm_ddp_loss_sum(p->ddp) / p->batch;   /* carried by the gradient all-reduce */
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "rank %d", p->rank);
    tdm_comm_abort(p->comm, tdm_error_message());
    return st;
}

/* Rank r evaluates its share of the windows; the sums are added. */
static tdm_status tdm_text_eval_ddp(void *ctx, double *loss, double *acc)
{
    tdm_text_proc *p = ctx;
    const tdm_text_job *j = p->j;
    (void)acc;
    int64_t K = j->eval_count, lo, hi;
    tdm_ddp_share(K, p->rank, p->world, &lo, &hi);
    double s = 0.0;
    tdm_status st =
        tdm_train_text_eval_sum(p->m, &j->corpus->val, K, lo, hi, TDM_TEXT_EVAL_BATCH, &s);
    if (st != TDM_STATUS_OK) {
        /* the others are about to wait for this rank's sum */
        tdm_error_prefix(st, "rank %d evaluating windows %lld..%lld", p->rank, (long long)lo,
                         (long long)hi - 1);
        tdm_comm_abort(p->comm, tdm_error_message());
        return st;
    }
    TDM_CHECK(tdm_comm_all_reduce(p->comm, &s, &s, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    *loss = s / (double)K;
    return TDM_STATUS_OK;
}

static tdm_status tdm_text_ddp_after(void *ctx, int64_t epoch)
{
    tdm_text_proc *p = ctx;
    (void)epoch;
    /* rank 0 has saved its checkpoint when it gets here */
    tdm_status st = tdm_comm_barrier(p->comm);
    if (st) tdm_text_fail(p->rank, "end-of-epoch barrier", st);
    return st;
}

/* ---- FSDP ranks: the DDP ranks' data flow, through fsdp/ ---- */

static tdm_status tdm_text_fsdp_step(void *ctx, const void *x, const int32_t *y, int n,
                                     double *loss)
{
    tdm_text_proc *p = ctx;
    tdm_status st = TDM_STATUS_OK;
    double ls = 0.0;
    if (++p->steps == p->kill_step) tdm_elastic_test_fault_fire(p->rank, p->kill_sig, p->steps);
    TDM_TRY(tdm_fsdp_zero_grad(p->f));
    TDM_TRY(tdm_fsdp_forward_scaled(p->f, x, y, n, 1.0f / (float)p->batch, &ls));
    if (!isfinite(ls)) return tdm_text_diverged(p, ls, n);
    TDM_TRY(tdm_fsdp_backward(p->f));
    TDM_TRY(tdm_fsdp_step(p->f, p->opt));
    *loss = tdm_fsdp_loss_sum(p->f) / p->batch;   /* reduced with the end-of-backward check */
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "rank %d", p->rank);
    tdm_comm_abort(p->comm, tdm_error_message());
    return st;
}

/* As tdm_text_eval_ddp, but every rank runs as many forwards as the
 * largest share needs (FULL_SHARD's gathers are collective: a rank whose
 * share is done takes part with none). */
static tdm_status tdm_text_eval_fsdp(void *ctx, double *loss, double *acc)
{
    tdm_text_proc *p = ctx;
    const tdm_text_job *j = p->j;
    (void)acc;
    int T = j->spec.n_ctx, EB = TDM_TEXT_EVAL_BATCH;
    int64_t K = j->eval_count, lo, hi;
    tdm_ddp_share(K, p->rank, p->world, &lo, &hi);
    int64_t most = (K + p->world - 1) / p->world, nb = (most + EB - 1) / EB;
    size_t bytes = (size_t)EB * (size_t)T * sizeof(int32_t);
    int32_t *x = malloc(bytes), *y = malloc(bytes);
    double s = 0.0;
    tdm_status st = x && y ? TDM_STATUS_OK
                           : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "text evaluation: malloc");
    for (int64_t b = 0; st == TDM_STATUS_OK && b < nb; b++) {
        int64_t w0 = lo + b * EB, k = hi - w0 < EB ? hi - w0 : EB;
        if (k < 0) k = 0;
        for (int64_t i = 0; i < k; i++)
            tdm_text_eval_window(&j->corpus->val, T, K, w0 + i, x + i * T, y + i * T);
        double ls = 0.0;
        st = tdm_fsdp_eval_loss(p->f, x, y, (int)k, &ls);
        s += ls;
    }
    free(x);
    free(y);
    if (st != TDM_STATUS_OK) {
        tdm_error_prefix(st, "rank %d evaluating windows %lld..%lld", p->rank, (long long)lo,
                         (long long)hi - 1);
        tdm_comm_abort(p->comm, tdm_error_message());
        return st;
    }
    TDM_CHECK(tdm_comm_all_reduce(p->comm, &s, &s, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM));
    *loss = s / (double)K;
    return TDM_STATUS_OK;
}

/* Every rank saves together after each epoch (the full form gathers to
 * rank 0, which `tandem sample` and every mode read). */
static tdm_status tdm_text_fsdp_after(void *ctx, int64_t epoch)
{
    tdm_text_proc *p = ctx;
    tdm_status st = tdm_train_fsdp_save(p->f, p->opt, p->save, p->j->a->save_sharded, epoch,
                                        (uint64_t)p->j->a->seed, p->rank);
    if (st == TDM_STATUS_OK && p->save && p->rank == 0 && !p->j->a->save_sharded)
        printf("  tandem sample --resume %s\n", p->save);
    return st;
}

/* --uneven (tools/train_uneven.c): FSDP's calls, as tools/train_fsdp.c's
 * for the image models */
static tdm_status tdm_text_fsdp_u_zero(void *ctx)
{
    return tdm_fsdp_zero_grad(((tdm_text_proc *)ctx)->f);
}

static tdm_status tdm_text_fsdp_u_forward(void *ctx, const void *x, const int32_t *y, int n,
                                          double *loss_mean)
{
    return tdm_fsdp_forward(((tdm_text_proc *)ctx)->f, x, y, n, loss_mean);
}

static tdm_status tdm_text_fsdp_u_backward_step(void *ctx)
{
    tdm_text_proc *p = ctx;
    TDM_CHECK(tdm_fsdp_backward(p->f));
    return tdm_fsdp_step(p->f, p->opt);
}

static tdm_status tdm_text_fsdp_u_join(void *ctx, int64_t *shadowed)
{
    tdm_text_proc *p = ctx;
    return tdm_fsdp_join(p->f, p->opt, shadowed);
}

static tdm_status tdm_text_fsdp_setup(tdm_text_proc *p, const tdm_train_args *a,
                                      tdm_device *dev, tdm_comm **nccl)
{
    tdm_status st;
    if ((st = tdm_tool_rank_nccl(p->comm, dev, nccl)))
        return tdm_text_fail(p->rank, "NCCL set-up", st);
    tdm_fsdp_opts o = {.sharding = p->j->sharding, .no_overlap = a->no_overlap,
                       .join = a->uneven, .host_comm = *nccl ? p->comm : NULL};
    /* checked by tandem train's argument checks: fp16 or bf16 */
    if (a->comm_hook && (st = tdm_fsdp_comm_hook_parse(a->comm_hook, &o.comm_hook)))
        return tdm_text_fail(p->rank, "--comm-hook", st);
    if ((st = tdm_fsdp_init(&p->f, p->m, *nccl ? *nccl : p->comm, &o)))
        return tdm_text_fail(p->rank, "fsdp set-up", st);
    return tdm_train_fsdp_optim_resume(a, p->f, p->rank, &p->opt, &p->start_epoch);
}

/* The rank's device, replica, Reducer and optimizer, and --resume; a is
 * this rank's arguments (rank 0's, or without --save and quiet). */
static tdm_status tdm_text_rank_setup(tdm_text_proc *p, const tdm_train_args *a,
                                      tdm_device **dev, tdm_comm **nccl)
{
    const tdm_text_job *j = p->j;
    tdm_status st;
    if ((st = tdm_tool_rank_device(&j->dl, p->rank, dev)))
        return tdm_text_fail(p->rank, "opening device", st);
    if ((st = tdm_model_init(&p->m, *dev, &j->spec, (uint64_t)a->seed)))
        return tdm_text_fail(p->rank, "building model", st);
    if (j->fsdp) return tdm_text_fsdp_setup(p, a, *dev, nccl);
    tdm_ddp_opts o = {.bucket_cap_mb = a->bucket_cap_mb > 0 ? (double)a->bucket_cap_mb : 0,
                      .no_overlap = a->no_overlap, .join = a->uneven};
    if ((st = tdm_tool_rank_ddp(p->comm, *dev, p->m, &o, nccl, &p->ddp)))
        return tdm_text_fail(p->rank, "ddp set-up", st);
    if (a->comm_hook) {
        /* as the image models' (tools/train_ddp.c) */
        tdm_ddp_powersgd_opts po = {.rank = (int)a->powersgd_rank,
                                    .start_step = a->powersgd_start_step,
                                    .seed = (uint64_t)a->seed};
        if ((st = tdm_ddp_set_comm_hook(p->ddp, a->comm_hook, &po)))
            return tdm_text_fail(p->rank, "--comm-hook", st);
    }
    TDM_CHECK(tdm_train_make_optim(a, p->m, &p->opt));
    if (!a->resume) return TDM_STATUS_OK;
    tdm_ckpt_info info;
    if ((st = tdm_ddp_checkpoint_load(p->ddp, a->resume, p->opt, &info)))
        return tdm_text_fail(p->rank, "resuming", st);
    p->start_epoch = info.epoch;
    tdm_train_print_resumed(a->resume, &info);
    return TDM_STATUS_OK;
}

static tdm_status tdm_text_rank_run(tdm_text_proc *p, const tdm_train_args *a, tdm_device **dev,
                                    tdm_comm **nccl)
{
    int64_t lo, hi;
    tdm_ddp_share(a->batch, p->rank, p->world, &lo, &hi);
    p->lo = (int)lo;
    p->hi = (int)hi;
    if (p->hi <= p->lo)
        return tdm_tool_usage_error("tandem train: rank %d: a global batch of %lld windows "
                                    "leaves no window to %d ranks; use --batch >= %d\n",
                                    p->rank, a->batch, p->world, p->world);
    TDM_CHECK(tdm_text_rank_setup(p, a, dev, nccl));
    char desc[200];
    const char *backend = tdm_comm_backend_name(*nccl ? *nccl : p->comm);
    if (p->f)
        snprintf(desc, sizeof desc, "%d processes on %s, sharding %s (%s communicator)",
                 p->world, p->j->a->device, tdm_fsdp_sharding_describe(p->j->sharding),
                 backend);
    else
        snprintf(desc, sizeof desc, "%d processes on %s (%s communicator%s)", p->world,
                 p->j->a->device, backend,
                 tdm_ddp_zero_copy(p->ddp) ? ", zero-copy buckets" : "");
    if (p->rank == 0) tdm_text_header(p->j, a, tdm_model_param_elems(p->m), desc);
    tdm_train_run r = tdm_text_run(p);
    r.step = p->f ? tdm_text_fsdp_step : tdm_text_ddp_step;
    r.step_ctx = p;
    r.eval = p->f ? tdm_text_eval_fsdp : tdm_text_eval_ddp;
    r.eval_ctx = p;
    r.after = p->f ? tdm_text_fsdp_after : tdm_text_ddp_after;
    r.after_ctx = p;
    tdm_train_uneven_text ut = {.train = r.text, .T = r.T, .bigram = r.bigram,
                                .eval = r.eval, .eval_ctx = p};
    if (a->uneven && p->f) {
        /* each rank its own windows, join (tools/train_uneven.c); every
         * rank saves together after each epoch, as without --uneven */
        tdm_train_uneven_ops uo = {.ctx = p, .m = p->m, .text = &ut,
                                   .zero_grad = tdm_text_fsdp_u_zero,
                                   .forward = tdm_text_fsdp_u_forward,
                                   .backward_step = tdm_text_fsdp_u_backward_step,
                                   .join = tdm_text_fsdp_u_join, .save = tdm_text_fsdp_after};
        TDM_CHECK(tdm_train_uneven_run(a, &uo, p->comm, NULL, NULL, p->start_epoch));
    } else if (a->uneven) {
        /* every rank takes part in the save, rank 0 writes */
        TDM_CHECK(tdm_train_uneven_epochs(a, p->ddp, p->opt, p->comm, NULL, NULL, &ut,
                                          p->j->a->save, p->start_epoch));
    } else {
        TDM_CHECK(tdm_train_epochs(a, &r));
    }
    if (p->rank == 0 && p->f) {
        tdm_train_fsdp_report(p->f, p->opt, p->world);
    } else if (p->rank == 0) {
        tdm_tool_print_ddp_times(p->ddp, p->world, 0);
        tdm_ddp_times t;
        tdm_ddp_get_times(p->ddp, &t);
        if (t.steps > 0)
            printf("ddp comm hook %s: %.0f bytes all-reduced per step (float32 gradients: "
                   "%.0f)\n", tdm_ddp_comm_hook_name(p->ddp),
                   t.reduced_bytes_total / (double)t.steps,
                   (double)tdm_model_param_elems(p->m) * 4.0);
    }
    return TDM_STATUS_OK;
}

/* One rank, forked or launched, over the shm process group comm. */
static tdm_status tdm_text_rank_main(tdm_comm *comm, const tdm_text_job *j)
{
    tdm_train_args a = *j->a;
    tdm_device *dev = NULL;
    tdm_comm *nccl = NULL;
    tdm_text_proc p = {.j = j, .comm = comm, .rank = tdm_comm_rank(comm),
                       .world = tdm_comm_size(comm), .batch = (int)a.batch};
    if (j->fsdp) {
        /* every rank writes its part together after each epoch */
        p.save = a.save;
        a.save = NULL;
    }
    if (p.rank != 0) {
        /* rank 0 speaks for the job */
        int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            close(fd);
        }
        a.save = NULL;
        a.quiet = 1;
    }
    p.kill_step = tdm_elastic_test_fault(p.rank, &p.kill_sig);
    tdm_status st = tdm_text_rank_run(&p, &a, &dev, &nccl);
    if (st) tdm_comm_abort(comm, "rank failed");
    fflush(stdout);
    tdm_ddp_free(p.ddp);
    tdm_fsdp_free(p.f);
    tdm_comm_free(nccl);   /* before comm, which bootstrapped it */
    tdm_optim_free(p.opt);
    tdm_model_free(p.m);
    tdm_device_free(dev);
    return st;
}

/* A forked rank: its process's exit code. */
static int tdm_text_forked_rank(tdm_comm *comm, void *arg)
{
    return tdm_tool_exit(tdm_text_rank_main(comm, arg));
}

/* One rank of a job started by tandem launch. */
static tdm_status tdm_text_launched(tdm_text_job *j, int mpi, tdm_mpi_backend backend)
{
    const tdm_train_args *a = j->a;
    tdm_comm *comm = NULL;
    tdm_ddp_env env;
    tdm_tool_mpi_rank mr = {0};
    tdm_status st;
    if (mpi) {
        /* an MPI launcher's ranks (tools/mpi_job.h): as train --mode ddp's */
        if ((st = tdm_tool_mpi_rank_init(&mr, backend, 0, NULL))) {
            fprintf(stderr, "tandem train: joining the MPI job: %s\n", tdm_error_message());
            return st;
        }
        comm = mr.comm;
        env = mr.env;
    } else if ((st = tdm_ddp_pg_init_from_env(&comm, &env))) {
        fprintf(stderr, "tandem train: joining the launched job: %s\n", tdm_error_message());
        return st;
    }
    int per_machine = mpi ? env.local_world_size : env.world_size;
    if (j->dl.count != 1 && j->dl.count != per_machine && j->dl.count != env.world_size) {
        st = tdm_tool_usage_error("tandem train: rank %d: --device '%s' names %d devices but "
                                  "the job has %d ranks%s\n", env.rank, a->device, j->dl.count,
                                  per_machine, mpi ? " on this machine" : "");
        tdm_comm_abort(comm, "bad --device");
    } else if (a->batch < env.world_size) {
        /* every rank sees it: no abort needed, rank 0 says it */
        st = TDM_STATUS_USAGE;
        if (env.rank == 0)
            fprintf(stderr, "tandem train: --batch %lld is smaller than the %d ranks: each "
                    "rank needs at least one window of every global batch\n", a->batch,
                    env.world_size);
    } else {
        if (j->dl.count == 1) j->dl.index[0] = env.local_rank;
        else j->dl.index[0] = j->dl.index[env.local_rank % j->dl.count];
        j->dl.count = 1;
        st = tdm_text_rank_main(comm, j);
    }
    if (mpi) tdm_tool_mpi_rank_end(&mr, tdm_tool_exit(st));
    else tdm_comm_free(comm);
    return st;
}

/* N forked ranks; the zero-copy arena's size from a probe on a host
 * device. */
static tdm_status tdm_text_forked(tdm_text_job *j)
{
    const tdm_train_args *a = j->a;
    tdm_status st;
    if (a->batch < j->dl.count)
        return tdm_tool_usage_error("tandem train: --batch %lld is smaller than the %d ranks: "
                                    "each rank needs at least one window of every global "
                                    "batch\n", a->batch, j->dl.count);
    tdm_device *dev = NULL;
    tdm_model *probe = NULL;
    if ((st = tdm_device_open(&dev, "cpu", 0, 1)) ||
        (st = tdm_model_init(&probe, dev, &j->spec, (uint64_t)a->seed))) {
        fprintf(stderr, "tandem train: building model: %s\n", tdm_error_message());
        tdm_device_free(dev);
        return st;
    }
    /* FSDP's collectives do not use the zero-copy arena */
    tdm_ddp_spawn_opts so = {.timeout_ms = INT64_MAX / 2000000,
                             .comm_timeout_ms = j->timeout_ms,
                             .arena_bytes = j->fsdp ? 0 : tdm_tool_ddp_arena_bytes(
                                 &j->dl, tdm_model_param_elems(probe))};
    tdm_model_free(probe);
    tdm_device_free(dev);
    fflush(stdout);
    /* a restart resumes from the checkpoint: a copy whose resume changes */
    const tdm_train_args *given = j->a;
    tdm_train_args ar = *given;
    j->a = &ar;
    st = tdm_elastic_train_forked(j->fsdp ? "fsdp" : "ddp", j->dl.count, tdm_text_forked_rank, j, &so, ar.max_restarts,
                                  ar.save, &ar.resume);
    j->a = given;
    return st;
}

static tdm_status tdm_text_run_ddp(tdm_text_job *j)
{
    const tdm_train_args *a = j->a;
    tdm_status st;
    tdm_train_note_threads(a, j->fsdp ? "FSDP rank" : "DDP rank");
    int launched = getenv("TANDEM_SHM_FD") && getenv("WORLD_SIZE");
    /* --timeout, else TANDEM_TIMEOUT, else 60 s forked (as the image
     * models' ranks) */
    TDM_CHECK(tdm_train_pg_timeout(a, launched, &j->timeout_ms));
    /* an MPI launcher's ranks (tools/mpi_job.h): as train --mode ddp's
     * (--mode fsdp, as for images, runs forked or under tandem launch) */
    int mpi = !launched && !j->fsdp && tdm_tool_mpi_launched();
    tdm_mpi_backend backend = TDM_MPI_BACKEND_AUTO;
    if (a->backend) TDM_CHECK(tdm_tool_backend_parse("train", a->backend, &backend));
    if (!mpi && backend != TDM_MPI_BACKEND_AUTO && backend != TDM_MPI_BACKEND_SHM)
        return tdm_tool_usage_error("tandem train: --backend %s runs between the ranks of an MPI "
                                    "job: start them with `mpirun -np N tandem train --mode ddp "
                                    "--backend %s ...`\n", a->backend, a->backend);
    if ((st = tdm_tool_parse_devices(&j->dl, a->device, !launched && !mpi))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    return launched || mpi ? tdm_text_launched(j, mpi, backend) : tdm_text_forked(j);
}

/* ---- the text and the baseline ---- */

/* The corpus, checked against the context, and the bigram baseline. */
static tdm_status tdm_text_load_job(tdm_text_job *j, tdm_text_corpus *corpus)
{
    const tdm_train_args *a = j->a;
    tdm_status st;
    if ((st = tdm_text_load(corpus, a->data)) != TDM_STATUS_OK)
        return tdm_train_fail("loading text", st);
    if ((st = tdm_text_check_context(corpus, j->spec.n_ctx)) != TDM_STATUS_OK) {
        tdm_train_fail("--model", st);
        tdm_text_free(corpus);
        return tdm_tool_usage(st);
    }
    if ((st = tdm_train_check_memory(a, &j->spec)) != TDM_STATUS_OK) {
        tdm_text_free(corpus);
        return st;
    }
    j->corpus = corpus;
    j->eval_count = tdm_text_eval_count(&corpus->val, j->spec.n_ctx, TDM_TEXT_EVAL_CAP);
    if ((st = tdm_text_bigram_loss(&corpus->train, &corpus->val, j->spec.n_ctx,
                                   TDM_TEXT_EVAL_CAP, &j->bigram)) != TDM_STATUS_OK) {
        tdm_train_fail("bigram baseline", st);
        tdm_text_free(corpus);
        return st;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_train_text_main(const tdm_train_args *a)
{
    tdm_text_job j = {.a = a};
    tdm_text_corpus corpus;
    tdm_status st;
    if ((st = tdm_model_spec_parse(&j.spec, a->model)) != TDM_STATUS_OK)
        return tdm_train_fail("--model", tdm_tool_usage(st));
    if (strcmp(a->mode, "single") && strcmp(a->mode, "dp") && strcmp(a->mode, "ddp") &&
        strcmp(a->mode, "fsdp"))
        return tdm_tool_usage_error("tandem train: --mode '%s': expected single, dp, ddp or "
                                    "fsdp\n", a->mode);
    j.fsdp = !strcmp(a->mode, "fsdp");
    if (j.fsdp &&
        tdm_fsdp_sharding_parse(a->sharding ? a->sharding : "full", &j.sharding) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem train: --sharding: %s\n", tdm_error_message());
    if (a->data && !strcmp(a->data, "synthetic"))
        return tdm_tool_usage_error("tandem train: --data synthetic makes images; a gpt trains "
                                    "on text: --data FILE (any bytes) or a fortunes directory "
                                    "[default: Debian's fortunes in %s]\n",
                                    TDM_TEXT_FORTUNES_DEFAULT_DIR);
    TDM_CHECK(tdm_text_load_job(&j, &corpus));
    st = !strcmp(a->mode, "ddp") || j.fsdp ? tdm_text_run_ddp(&j) : tdm_text_run_local(&j);
    tdm_text_free(&corpus);
    return st;
}
