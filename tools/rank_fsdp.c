/* tools/train_fsdp.c: `tandem train --mode fsdp --device cpu:N|cuda[:I,J..]
 * --sharding full|grad_op|optimizer`: forks N ranks (tdm_dist_spawn, as
 * --mode ddp does), each training through fsdp/ on its contiguous share
 * of every global batch (the same global batches as --mode single), with
 * only its shards of the parameters, gradients and optimizer state
 * persisting (docs/FSDP.md). Rank 0 prints progress, results and the
 * FSDP timing and memory summary; checkpoints are written by every rank
 * together after each epoch: the full form (gathered to rank 0, the very
 * file --mode single/dp/ddp write and read) or, with --save-sharded, one
 * file per rank plus an index. --resume takes either (an index is
 * recognised by its format line).
 *
 * With --device cuda[:I,J,..] each rank opens its GPU and shards over an
 * NCCL communicator bootstrapped over shm (tdm_tool_rank_nccl), the shm
 * one carrying the host collectives; emulated CUDA devices
 * (TANDEM_CUDA_EMULATOR) shard over shm. Under `tandem launch` it joins
 * the launched job instead of forking.
 *
 * --model gpt --mode fsdp is tools/train_text.c's, sharing the optimizer
 * and resume, checkpoint, timeout and report pieces below
 * (tools/train_modes.h).
 *
 * Test hook: TANDEM_DDP_TEST_KILL=R:S[:STOP] (as --mode ddp,
 * tools/elastic.h) makes rank R SIGKILL (SIGSTOP) itself before its
 * global step S, on the first attempt only, so that --max-restarts can
 * finish the run. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device.h"
#include "ddp/ddp.h"
#include "dist/pg.h"
#include "dist/spawn.h"
#include "fsdp/fsdp.h"
#include "models/accum.h"
#include "tools/ddp_rank.h"
#include "tools/devices.h"
#include "tools/elastic.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_train_fsdp_ctx {
    const tdm_train_args *a;
    int64_t timeout_ms;
    tdm_fsdp_sharding sharding;
    tdm_fsdp_comm_hook hook;   /* --comm-hook */
    tdm_model_spec spec;
    tdm_device_list dl;
    const tdm_dataset *train, *test;
} tdm_train_fsdp_ctx;

typedef struct tdm_train_fsdp_rank {
    tdm_fsdp *f;
    tdm_optim *opt;
    tdm_comm *comm;
    const char *save;
    const tdm_dataset *test;
    int sharded, rank, world;
    uint64_t seed;
    int64_t feat, steps, kill_step;   /* test hook: kill_sig before step kill_step */
    int kill_sig;
} tdm_train_fsdp_rank;

static tdm_status tdm_train_fsdp_fail(int rank, const char *what, tdm_status st)
{
    fprintf(stderr, "tandem train: rank %d: %s: %s\n", rank, what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return st;
}

static tdm_status tdm_train_fsdp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                      double *loss_mean)
{
    tdm_train_fsdp_rank *r = ctx;
    tdm_status st = TDM_STATUS_OK;
    int64_t lo64, hi64;
    tdm_dist_share(batch, r->rank, r->world, &lo64, &hi64);
    int lo = (int)lo64, hi = (int)hi64;
    double ls = 0.0;
    if (++r->steps == r->kill_step) tdm_elastic_test_fault_fire(r->rank, r->kill_sig, r->steps);
    TDM_TRY(tdm_fsdp_zero_grad(r->f));
    TDM_TRY(tdm_fsdp_forward_scaled(r->f, (const float *)x + (int64_t)lo * r->feat, y + lo,
                                    hi - lo, 1.0f / (float)batch, &ls));
    if (!isfinite(ls)) {
        /* as --mode ddp: stop the group now, naming the step and rank */
        char where[96];
        snprintf(where, sizeof where, "rank %d's %d sample%s of the batch of %d", r->rank,
                 hi - lo, hi - lo == 1 ? "" : "s", batch);
        return tdm_train_rank_diverged(r->comm, r->rank, tdm_optim_steps(r->opt) + 1, ls,
                                       where);
    }
    TDM_TRY(tdm_fsdp_backward(r->f));
    TDM_TRY(tdm_fsdp_step(r->f, r->opt));
    *loss_mean = tdm_fsdp_loss_sum(r->f) / batch;
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "rank %d", r->rank);
    tdm_comm_abort(r->comm, tdm_error_message());
    return st;
}

/* A failed step: the message names the rank, and the group is stopped. */
static tdm_status tdm_train_fsdp_abort(tdm_train_fsdp_rank *r, tdm_status st)
{
    tdm_error_prefix(st, "rank %d", r->rank);
    tdm_comm_abort(r->comm, tdm_error_message());
    return st;
}

/* --grad-accum: as DDP's (tools/train_ddp.c): every micro-batch is a
 * global one split over the ranks, its loss gradient scaled by 1/(the
 * effective batch); the first K-1 backwards run under no_sync, so the
 * unit gradients add up locally and only the last backward
 * reduce-scatters, the sum of all K. */
static tdm_status tdm_train_fsdp_zero(void *ctx)
{
    tdm_train_fsdp_rank *r = ctx;
    if (++r->steps == r->kill_step) tdm_elastic_test_fault_fire(r->rank, r->kill_sig, r->steps);
    tdm_status st = tdm_fsdp_zero_grad(r->f);
    if (st) return tdm_train_fsdp_abort(r, st);
    return st;
}

static tdm_status tdm_train_fsdp_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                       float grad_scale, int index, int last, double *loss_sum)
{
    tdm_train_fsdp_rank *r = ctx;
    tdm_status st = TDM_STATUS_OK;
    int64_t lo64, hi64;
    tdm_dist_share(batch, r->rank, r->world, &lo64, &hi64);
    int lo = (int)lo64, hi = (int)hi64;
    TDM_TRY(tdm_fsdp_forward_scaled(r->f, (const float *)x + (int64_t)lo * r->feat, y + lo,
                                    hi - lo, grad_scale, loss_sum));
    if (!isfinite(*loss_sum)) {
        char where[64];
        snprintf(where, sizeof where, "rank %d, micro-batch %d", r->rank, index + 1);
        return tdm_train_rank_diverged(r->comm, r->rank, tdm_optim_steps(r->opt) + 1, *loss_sum,
                                       where);
    }
    tdm_fsdp_no_sync(r->f, !last);
    TDM_TRY(tdm_fsdp_backward(r->f));
    return TDM_STATUS_OK;
fail:
    tdm_fsdp_no_sync(r->f, 0);
    return tdm_train_fsdp_abort(r, st);
}

static tdm_status tdm_train_fsdp_opt(void *ctx, double *loss_sum)
{
    tdm_train_fsdp_rank *r = ctx;
    tdm_status st = tdm_fsdp_step(r->f, r->opt);
    if (st) return tdm_train_fsdp_abort(r, st);
    *loss_sum = tdm_fsdp_loss_sum(r->f);   /* every rank's, reduced with the gradients */
    return TDM_STATUS_OK;
}

static const tdm_accum_ops tdm_train_fsdp_accum_ops = {
    .zero_grad = tdm_train_fsdp_zero, .micro = tdm_train_fsdp_micro, .step = tdm_train_fsdp_opt};

static tdm_status tdm_train_fsdp_eval(void *ctx, double *loss_mean, double *accuracy)
{
    tdm_train_fsdp_rank *r = ctx;
    return tdm_fsdp_evaluate(r->f, r->test, 1000, loss_mean, accuracy);
}

tdm_status tdm_train_fsdp_save(tdm_fsdp *f, tdm_optim *opt, const char *path, int sharded,
                               int64_t epoch, uint64_t seed, int rank)
{
    if (!path) return TDM_STATUS_OK;
    tdm_ckpt_info info = {.step = tdm_optim_steps(opt), .epoch = epoch + 1, .seed = seed};
    tdm_status st = sharded ? tdm_fsdp_save_sharded(f, path, opt, &info)
                            : tdm_fsdp_save_full(f, path, opt, &info);
    if (st) return tdm_train_fsdp_fail(rank, "saving checkpoint", st);
    if (rank == 0)
        printf("  saved %s (%s, epoch %lld, step %lld)\n", path,
               sharded ? "sharded: a file per rank plus this index" : "full", (long long)epoch + 1,
               (long long)info.step);
    return TDM_STATUS_OK;
}

/* --uneven (tools/train_uneven.c): each rank's own samples, opts.join */
static tdm_status tdm_train_fsdp_u_zero(void *ctx)
{
    return tdm_fsdp_zero_grad(((tdm_train_fsdp_rank *)ctx)->f);
}

static tdm_status tdm_train_fsdp_u_forward(void *ctx, const void *x, const int32_t *y, int n,
                                           double *loss_mean)
{
    return tdm_fsdp_forward(((tdm_train_fsdp_rank *)ctx)->f, x, y, n, loss_mean);
}

static tdm_status tdm_train_fsdp_u_backward_step(void *ctx)
{
    tdm_train_fsdp_rank *r = ctx;
    TDM_CHECK(tdm_fsdp_backward(r->f));
    return tdm_fsdp_step(r->f, r->opt);
}

static tdm_status tdm_train_fsdp_u_join(void *ctx, int64_t *shadowed)
{
    tdm_train_fsdp_rank *r = ctx;
    return tdm_fsdp_join(r->f, r->opt, shadowed);
}

static tdm_status tdm_train_fsdp_u_eval(void *ctx, const tdm_dataset *test, double *loss_mean,
                                        double *accuracy)
{
    return tdm_fsdp_evaluate(((tdm_train_fsdp_rank *)ctx)->f, test, 1000, loss_mean, accuracy);
}

static tdm_status tdm_train_fsdp_after(void *ctx, int64_t epoch);

/* After each epoch every rank saves together (the full form gathers to
 * rank 0; the sharded form writes a file per rank). */
static tdm_status tdm_train_fsdp_after(void *ctx, int64_t epoch)
{
    tdm_train_fsdp_rank *r = ctx;
    return tdm_train_fsdp_save(r->f, r->opt, r->save, r->sharded, epoch, r->seed, r->rank);
}

/* 1 when path holds a sharded checkpoint's index (its format line). */
static int tdm_train_fsdp_is_index(const char *path)
{
    /* the format sits in the safetensors header's metadata, whose length
     * grows with the units listed there: read up to 1 MiB of it */
    size_t cap = 1 << 20;
    char *buf = malloc(cap + 1);
    FILE *fp = buf ? fopen(path, "rb") : NULL;
    if (!fp) {
        free(buf);
        return 0;
    }
    size_t n = fread(buf, 1, cap, fp);
    fclose(fp);
    buf[n] = 0;
    for (size_t i = 0; i < n; i++)
        if (!buf[i]) buf[i] = ' ';
    int found = strstr(buf, "tandem-fsdp-sharded-") != NULL;
    free(buf);
    return found;
}

void tdm_train_fsdp_report(tdm_fsdp *f, tdm_optim *opt, int world)
{
    tdm_fsdp_times t;
    tdm_fsdp_get_times(f, &t);
    if (t.steps == 0) return;
    double n = (double)t.steps;
    printf("fsdp %s (rank 0 of %d, %d unit%s, per step): forward %.3f ms, loss %.3f ms, "
           "backward %.3f ms, all-gather exposed %.3f ms, reduce-scatter exposed %.3f ms, "
           "optimizer %.3f ms\n",
           tdm_fsdp_sharding_describe(tdm_fsdp_get_sharding(f)), world, tdm_fsdp_n_units(f),
           tdm_fsdp_n_units(f) == 1 ? "" : "s", t.total.ms[TDM_PHASE_FORWARD] / n,
           t.total.ms[TDM_PHASE_LOSS] / n, t.total.ms[TDM_PHASE_BACKWARD] / n,
           t.total.ms[TDM_PHASE_ALLGATHER_WAIT] / n, t.total.ms[TDM_PHASE_REDUCE_SCATTER_WAIT] / n,
           t.total.ms[TDM_PHASE_STEP] / n);
    printf("fsdp communication: %.1f%% of the all-gathered bytes were prefetched, %.1f%% of the "
           "reduce-scattered bytes were launched during backward\n",
           t.ag_bytes_total > 0 ? 100.0 * t.ag_prefetched_bytes_total / t.ag_bytes_total : 0.0,
           t.rs_bytes_total > 0 ? 100.0 * t.rs_overlapped_bytes_total / t.rs_bytes_total : 0.0);
    int64_t padded = 0;
    for (int u = 0; u < tdm_fsdp_n_units(f); u++) {
        int64_t shard;
        tdm_fsdp_unit_info(f, u, NULL, NULL, NULL, NULL, &shard);
        padded += shard * world;
    }
    printf("fsdp comm hook %s: %.0f bytes reduce-scattered per step (float32 gradients: %.0f)\n",
           tdm_fsdp_comm_hook_name(tdm_fsdp_get_comm_hook(f)), t.rs_bytes_total / n,
           (double)padded * 4.0);
    tdm_fsdp_memory mm;
    tdm_fsdp_get_memory(f, opt, &mm);
    double mib = 1.0 / (1024.0 * 1024.0);
    printf("fsdp memory (rank 0): shards %.2f MiB parameters + %.2f MiB gradients + %.2f MiB "
           "optimizer state, full copies %.2f MiB parameters + %.2f MiB gradients, unit "
           "buffers at most %.2f MiB at once\n",
           (double)mm.shard_params * mib, (double)mm.shard_grads * mib,
           (double)mm.optim_state * mib, (double)mm.full_params * mib,
           (double)mm.full_grads * mib, (double)mm.units_peak * mib);
}

/* The rank's device, model, shards and optimizer, and --resume (every
 * rank reads the checkpoint and keeps its shards). */
static tdm_status tdm_train_fsdp_setup(const tdm_train_fsdp_ctx *c, tdm_train_args *a,
                                       tdm_comm *comm, tdm_train_fsdp_rank *r, tdm_device **dev,
                                       tdm_model **m, tdm_comm **nccl, int64_t *start_epoch)
{
    tdm_status st;
    int rank = r->rank;
    if ((st = tdm_tool_rank_device(&c->dl, rank, dev)))
        return tdm_train_fsdp_fail(rank, "opening device", st);
    if ((st = tdm_model_init(m, *dev, &c->spec, (uint64_t)a->seed)))
        return tdm_train_fsdp_fail(rank, "building model", st);
    TDM_CHECK(tdm_train_check_features(c->train, *m));
    if ((st = tdm_tool_rank_nccl(comm, *dev, nccl)))
        return tdm_train_fsdp_fail(rank, "NCCL set-up", st);
    tdm_fsdp_opts o = {.sharding = c->sharding, .no_overlap = a->no_overlap,
                       .comm_hook = c->hook, .join = a->uneven, .host_comm = *nccl ? comm : NULL};
    if ((st = tdm_fsdp_init(&r->f, *m, *nccl ? *nccl : comm, &o)))
        return tdm_train_fsdp_fail(rank, "fsdp set-up", st);
    return tdm_train_fsdp_optim_resume(a, r->f, rank, &r->opt, start_epoch);
}

tdm_status tdm_train_fsdp_optim_resume(const tdm_train_args *a, tdm_fsdp *f, int rank,
                                       tdm_optim **opt, int64_t *start_epoch)
{
    tdm_status st;
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, strcmp(a->optim, "sgd") ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    oo.lr = (float)a->lr;
    oo.weight_decay = (float)a->weight_decay;
    if (oo.kind == TDM_OPTIM_SGD) {
        oo.momentum = (float)a->momentum;
        oo.nesterov = a->nesterov;
    }
    if ((st = tdm_fsdp_optim_init(opt, f, &oo)))
        return tdm_train_fsdp_fail(rank, "optimizer", st);
    *start_epoch = 0;
    if (!a->resume) return TDM_STATUS_OK;
    tdm_ckpt_info info;
    st = tdm_train_fsdp_is_index(a->resume) ? tdm_fsdp_load_sharded(f, a->resume, *opt, &info)
                                            : tdm_fsdp_load_full(f, a->resume, *opt, &info);
    if (st) return tdm_train_fsdp_fail(rank, "resuming", st);
    *start_epoch = info.epoch;
    if (rank == 0) tdm_train_print_resumed(a->resume, &info);
    return TDM_STATUS_OK;
}

/* One rank, forked or launched, over the shm process group comm. */
static tdm_status tdm_train_fsdp_rank_main(tdm_comm *comm, const tdm_train_fsdp_ctx *c)
{
    tdm_train_args a = *c->a;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_comm *nccl = NULL;
    if (rank != 0) {
        int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            close(fd);
        }
        a.quiet = 1;
    }
    tdm_train_fsdp_rank r = {.comm = comm, .rank = rank, .world = world, .save = a.save,
                             .test = c->test, .sharded = a.save_sharded,
                             .seed = (uint64_t)a.seed, .feat = tdm_data_features(c->train)};
    a.save = NULL;   /* the epoch loop's save is single-process; ours is collective */
    int64_t start_epoch = 0;
    tdm_status st = tdm_train_fsdp_setup(c, &a, comm, &r, &dev, &m, &nccl, &start_epoch);
    if (st == TDM_STATUS_OK) {
        char devdesc[200];
        snprintf(devdesc, sizeof devdesc, "%d processes on %s, sharding %s (%s communicator, "
                 "timeout %g s)", world, c->a->device, tdm_fsdp_sharding_describe(c->sharding),
                 tdm_comm_backend_name(nccl ? nccl : comm), (double)c->timeout_ms / 1000.0);
        if (rank == 0)
            tdm_train_print_header(&a, &c->spec, c->train, c->test, tdm_model_param_elems(m),
                                   devdesc);
        r.kill_step = tdm_elastic_test_fault(rank, &r.kill_sig);
        tdm_train_run run = {.m = m, .opt = r.opt, .start_epoch = start_epoch,
                             .step = tdm_train_fsdp_step, .step_ctx = &r, .train = c->train,
                             .test = c->test, .eval = tdm_train_fsdp_eval, .eval_ctx = &r,
                             .after = tdm_train_fsdp_after, .after_ctx = &r};
        tdm_accum acc = {.ops = &tdm_train_fsdp_accum_ops, .ctx = &r, .micro = (int)a.batch,
                         .in_features = tdm_model_in_features(m),
                         .out_rows = tdm_model_out_rows(m)};
        if (a.grad_accum > 1) {
            run.step = tdm_accum_step;
            run.step_ctx = &acc;
        }
        tdm_train_uneven_ops uo = {.ctx = &r, .m = m, .zero_grad = tdm_train_fsdp_u_zero,
                                   .forward = tdm_train_fsdp_u_forward,
                                   .backward_step = tdm_train_fsdp_u_backward_step,
                                   .join = tdm_train_fsdp_u_join, .evaluate = tdm_train_fsdp_u_eval,
                                   .save = tdm_train_fsdp_after};
        st = a.uneven ? tdm_train_uneven_run(&a, &uo, comm, c->train, c->test, start_epoch)
                      : tdm_train_epochs(&a, &run);
        if (st == TDM_STATUS_OK && rank == 0) tdm_train_fsdp_report(r.f, r.opt, world);
    }
    if (st) {
        char why[400];
        snprintf(why, sizeof why, "%s", tdm_error_message()[0] ? tdm_error_message()
                                                               : "rank failed");
        tdm_comm_abort(comm, why);
    }
    fflush(stdout);
    tdm_fsdp_free(r.f);
    tdm_comm_free(nccl);   /* before comm, which bootstrapped it */
    tdm_optim_free(r.opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}

/* A forked rank: its process's exit code. */
static int tdm_train_fsdp_forked_rank(tdm_comm *comm, void *arg)
{
    return tdm_tool_exit(tdm_train_fsdp_rank_main(comm, arg));
}

/* One rank of a job started by tandem launch. */
static tdm_status tdm_train_fsdp_launched(tdm_train_fsdp_ctx *c)
{
    const tdm_train_args *a = c->a;
    tdm_comm *comm = NULL;
    tdm_dist_env env;
    tdm_dataset train = {0}, test = {0};
    tdm_dist_pg_opts po = {.timeout_ms = c->timeout_ms};
    tdm_status st = tdm_dist_pg_init(&comm, &env, &po);
    if (st) {
        fprintf(stderr, "tandem train: joining the launched job: %s\n", tdm_error_message());
        return st;
    }
    if (c->dl.count != 1 && c->dl.count != env.world_size) {
        st = tdm_tool_usage_error("tandem train: rank %d: --device '%s' names %d devices but "
                                  "the job has %d ranks\n", env.rank, a->device, c->dl.count,
                                  env.world_size);
        tdm_comm_abort(comm, "bad --device");
        goto done;
    }
    if (c->dl.count == 1) c->dl.index[0] = env.local_rank;
    if ((st = tdm_train_load_data(a, &c->spec, &train, &test))) {
        tdm_comm_abort(comm, "loading data failed");
        goto done;
    }
    c->train = &train;
    c->test = &test;
    st = tdm_train_fsdp_rank_main(comm, c);
done:
    tdm_comm_free(comm);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}

/* N forked ranks; a probe model on a host device checks the data first
 * (a mismatch is said once, as usage). */
static tdm_status tdm_train_fsdp_forked(tdm_train_fsdp_ctx *c)
{
    tdm_dataset train = {0}, test = {0};
    tdm_status st;
    TDM_CHECK(tdm_train_load_and_probe(c->a, &c->spec, &train, &test, NULL));
    c->train = &train;
    c->test = &test;
    tdm_dist_spawn_opts so = {.timeout_ms = TDM_DIST_RUN_UNBOUNDED_MS, .comm_timeout_ms = c->timeout_ms};
    fflush(stdout);
    /* the ranks' flight-recorder dumps and the doctor's verdict, and
     * --max-restarts, as DDP's; a restart resumes from the checkpoint the
     * ranks write after each epoch (full or sharded): a copy of the
     * arguments whose resume changes */
    const tdm_train_args *given = c->a;
    tdm_train_args ar = *given;
    c->a = &ar;
    st = tdm_elastic_train_forked("fsdp", c->dl.count, tdm_train_fsdp_forked_rank, c, &so,
                                  ar.max_restarts, ar.save, &ar.resume);
    c->a = given;
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}

tdm_status tdm_train_pg_timeout(const tdm_train_args *a, int launched, int64_t *timeout_ms)
{
    int64_t t = 0;
    if (a->timeout ? tdm_dist_timeout_parse("--timeout", a->timeout, &t)
                   : tdm_dist_timeout_from_env(&t))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if (a->timeout) setenv(TDM_DIST_ENV_TIMEOUT, a->timeout, 1);
    *timeout_ms = t ? t : launched ? TDM_DIST_TIMEOUT_DEFAULT_MS : TDM_DIST_FORKED_TIMEOUT_MS;
    return TDM_STATUS_OK;
}

tdm_status tdm_train_run_fsdp(const tdm_train_args *a)
{
    tdm_train_fsdp_ctx c = {.a = a};
    tdm_status st;
    if ((st = tdm_fsdp_sharding_parse(a->sharding ? a->sharding : "full", &c.sharding)))
        return tdm_tool_usage_error("tandem train: --sharding: %s\n", tdm_error_message());
    if (a->comm_hook && (st = tdm_fsdp_comm_hook_parse(a->comm_hook, &c.hook)))
        return tdm_tool_usage_error("tandem train: --comm-hook: %s\n", tdm_error_message());
    if ((st = tdm_model_spec_parse(&c.spec, a->model)))
        return tdm_tool_usage_error("tandem train: --model: %s\n", tdm_error_message());
    tdm_train_note_threads(a, "FSDP rank");
    if (a->bucket_cap_mb)
        fprintf(stderr, "tandem train: note: --bucket-cap-mb applies to --mode ddp; FSDP "
                        "communicates per unit (a layer with parameters)\n");
    int launched = tdm_dist_launched();
    TDM_CHECK(tdm_train_pg_timeout(a, launched, &c.timeout_ms));
    if ((st = tdm_tool_parse_devices(&c.dl, a->device, !launched))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    return launched ? tdm_train_fsdp_launched(&c) : tdm_train_fsdp_forked(&c);
}
