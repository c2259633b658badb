/* tools/train_ddp.c: `tandem train --mode ddp --device cpu:N`: forks N
 * ranks (tdm_dist_spawn), each training its own replica through ddp/ on
 * its contiguous share of every global batch (the same global batches as
 * --mode single: tdm_train_epoch_order). Every rank evaluates its share
 * of the test set (tdm_ddp_evaluate); rank 0 prints progress, results and
 * the DDP timing summary and writes checkpoints; every rank that fails
 * says which rank it is and tells the group why (tdm_comm_abort), and the
 * parent names the root cause (the rule of shm/spawn.h) and exits 1.
 *
 * With --device cuda[:I,J,..] each rank opens its GPU and reduces its
 * buckets over NCCL in device memory, bootstrapped over the shm
 * communicator, which stays for the host-memory collectives and the
 * aborts (tools/ddp_rank.h).
 *
 * Under `tandem launch -n N -- tandem train --mode ddp ...` (TANDEM_SHM_FD
 * and WORLD_SIZE set) it does not fork: this process is one rank of the
 * launched job and joins it with tdm_dist_pg_init. Under an MPI launcher
 * (mpirun, srun; tools/mpi_job.h) likewise, over the communicator of
 * --backend (shm, mpi or hier); a GPU rank's NCCL communicator then gets
 * its unique id over that one, that is over MPI between machines.
 *
 * Test hook: TANDEM_DDP_TEST_KILL=R:S makes rank R SIGKILL itself before
 * its global step S (counted from 1 over the whole run), to test
 * fail-fast and checkpoint recovery end to end; R:S:STOP makes it stop
 * itself (SIGSTOP) there instead, to test stall detection
 * (tdm_elastic_test_fault, tools/elastic.h; the gpt's ranks have it too).
 *
 * Batch split: every rank gathers the global batch of B and
 * tdm_ddp_forward_global runs its share, samples [r*B/N, (r+1)*B/N)
 * (tdm_dist_share), with the loss gradient scaled by 1/B (not 1/B_r);
 * gradients are SUM-reduced, so the reduced gradient is exactly the
 * global batch's mean-loss gradient even when N does not divide B. */
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
#include "models/accum.h"
#include "models/checkpoint.h"
#include "tools/ddp_rank.h"
#include "tools/devices.h"
#include "tools/elastic.h"
#include "tools/mpi_job.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_train_ddp_ctx {
    const tdm_train_args *a;
    int64_t timeout_ms;          /* the process group's, as used */
    tdm_model_spec spec;
    tdm_device_list dl;
    const tdm_dataset *train, *test;
    const char *job_desc;    /* an MPI job: its backend and machines; NULL otherwise */
} tdm_train_ddp_ctx;

/* One rank's state, the context of its step, evaluation and hook. */
typedef struct tdm_train_ddp_rank {
    const tdm_train_ddp_ctx *c;
    tdm_train_args a;            /* rank 0's; the others' without --save, quiet */
    tdm_device *dev;
    tdm_model *m;
    tdm_optim *opt;
    tdm_ddp *ddp;
    tdm_comm *comm;              /* shm: aborts and epoch barriers (an NCCL abort reaches it too) */
    tdm_comm *nccl;              /* GPUs: the gradient communicator, bootstrapped over comm */
    int rank, world;
    int64_t start_epoch;
    int64_t steps, kill_step;    /* test hook: kill_sig before step kill_step */
    int kill_sig;
} tdm_train_ddp_rank;

static tdm_status tdm_train_ddp_fail(int rank, const char *what, tdm_status st)
{
    fprintf(stderr, "tandem train: rank %d: %s: %s\n", rank, what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return st;
}

/* A loss that is not finite on this rank's share: it stops before the
 * gradient all-reduce and aborts the group with its reason, so every
 * other rank leaves that all-reduce at once, naming it ("all_reduce #N:
 * aborted by rank R: loss is NaN at step S ..."): all stop at the same
 * step without a collective of their own. */
static tdm_status tdm_train_ddp_nonfinite(tdm_train_ddp_rank *r, double ls, int batch)
{
    int64_t lo, hi;
    tdm_dist_share(batch, r->rank, r->world, &lo, &hi);
    char where[96];
    snprintf(where, sizeof where, "rank %d's %d sample%s of the batch of %d", r->rank,
             (int)(hi - lo), hi - lo == 1 ? "" : "s", batch);
    return tdm_train_rank_diverged(r->comm, r->rank, tdm_optim_steps(r->opt) + 1, ls, where);
}

static tdm_status tdm_train_ddp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                     double *loss_mean)
{
    tdm_train_ddp_rank *r = ctx;
    tdm_status st = TDM_STATUS_OK;
    double ls = 0.0;
    if (++r->steps == r->kill_step) tdm_elastic_test_fault_fire(r->rank, r->kill_sig, r->steps);
    TDM_TRY(tdm_ddp_zero_grad(r->ddp));
    TDM_TRY(tdm_ddp_forward_global(r->ddp, x, y, batch, &ls));
    if (!isfinite(ls)) return tdm_train_ddp_nonfinite(r, ls, batch);
    TDM_TRY(tdm_ddp_backward(r->ddp));
    TDM_TRY(tdm_ddp_step(r->ddp, r->opt));
    *loss_mean = tdm_ddp_loss_sum(r->ddp) / batch;   /* carried by the gradient all-reduce */
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "rank %d", r->rank);
    tdm_comm_abort(r->comm, tdm_error_message());
    return st;
}

/* --grad-accum: every micro-batch is a global one split over the ranks
 * (tdm_ddp_forward_global_scaled, gradient scale 1/(the effective
 * batch)); the first K-1 backwards run under no_sync, so only the last
 * one all-reduces, the sum of all K. */
static tdm_status tdm_train_ddp_zero(void *ctx)
{
    tdm_train_ddp_rank *r = ctx;
    if (++r->steps == r->kill_step) tdm_elastic_test_fault_fire(r->rank, r->kill_sig, r->steps);
    tdm_status st = tdm_ddp_zero_grad(r->ddp);
    if (st) {
        tdm_error_prefix(st, "rank %d", r->rank);
        tdm_comm_abort(r->comm, tdm_error_message());
    }
    return st;
}

static tdm_status tdm_train_ddp_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                      float grad_scale, int index, int last, double *loss_sum)
{
    tdm_train_ddp_rank *r = ctx;
    tdm_status st = TDM_STATUS_OK;
    TDM_TRY(tdm_ddp_forward_global_scaled(r->ddp, x, y, batch, grad_scale, loss_sum));
    if (!isfinite(*loss_sum)) {
        /* as in tdm_train_ddp_step: stop before the all-reduce, tell the group */
        char where[64];
        snprintf(where, sizeof where, "rank %d, micro-batch %d", r->rank, index + 1);
        return tdm_train_rank_diverged(r->comm, r->rank, tdm_optim_steps(r->opt) + 1, *loss_sum,
                                       where);
    }
    tdm_ddp_no_sync(r->ddp, !last);
    TDM_TRY(tdm_ddp_backward(r->ddp));
    return TDM_STATUS_OK;
fail:
    tdm_ddp_no_sync(r->ddp, 0);
    tdm_error_prefix(st, "rank %d", r->rank);
    tdm_comm_abort(r->comm, tdm_error_message());
    return st;
}

static tdm_status tdm_train_ddp_opt(void *ctx, double *loss_sum)
{
    tdm_train_ddp_rank *r = ctx;
    tdm_status st = tdm_ddp_step(r->ddp, r->opt);
    if (st) {
        tdm_error_prefix(st, "rank %d", r->rank);
        tdm_comm_abort(r->comm, tdm_error_message());
        return st;
    }
    *loss_sum = tdm_ddp_loss_sum(r->ddp);   /* every rank's, carried by the all-reduce */
    return TDM_STATUS_OK;
}

static const tdm_accum_ops tdm_train_ddp_accum_ops = {
    .zero_grad = tdm_train_ddp_zero, .micro = tdm_train_ddp_micro, .step = tdm_train_ddp_opt};

/* Every rank evaluates its share of the test set (tdm_ddp_evaluate): the
 * others never wait for rank 0 to evaluate alone, which on a large test
 * set could outlast the collective timeout of the barrier below. */
static tdm_status tdm_train_ddp_eval(void *ctx, double *loss_mean, double *accuracy)
{
    tdm_train_ddp_rank *r = ctx;
    return tdm_ddp_evaluate(r->ddp, r->c->test, 1000, loss_mean, accuracy);
}

static tdm_status tdm_train_ddp_after(void *ctx, int64_t epoch)
{
    tdm_train_ddp_rank *r = ctx;
    (void)epoch;
    /* rank 0 has saved its checkpoint when it gets here */
    tdm_status st = tdm_comm_barrier(r->comm);
    if (st) tdm_train_ddp_fail(r->rank, "end-of-epoch barrier", st);
    return st;
}

/* Rank 0 speaks for the job: the others write nothing to stdout, save
 * nothing and show no progress. */
static void tdm_train_ddp_quiet_rank(tdm_train_ddp_rank *r)
{
    if (r->rank == 0) return;
    int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        close(fd);
    }
    r->a.save = NULL;
    r->a.quiet = 1;
}

/* TANDEM_DDP_TEST_KILL=R:S[:STOP] (see the top of this file). */
static void tdm_train_ddp_test_hook(tdm_train_ddp_rank *r)
{
    r->kill_step = tdm_elastic_test_fault(r->rank, &r->kill_sig);
}

/* The rank's device, replica, Reducer and optimizer, and --resume (every
 * rank loads the checkpoint: tdm_ddp_checkpoint_load). */
static tdm_status tdm_train_ddp_rank_setup(tdm_train_ddp_rank *r)
{
    const tdm_train_ddp_ctx *c = r->c;
    tdm_status st;
    if ((st = tdm_tool_rank_device(&c->dl, r->rank, &r->dev)))
        return tdm_train_ddp_fail(r->rank, "opening device", st);
    if ((st = tdm_model_init(&r->m, r->dev, &c->spec, (uint64_t)r->a.seed)))
        return tdm_train_ddp_fail(r->rank, "building model", st);
    /* the forked path checked on a probe; a launched rank checks here */
    TDM_CHECK(tdm_train_check_features(c->train, r->m));
    tdm_ddp_opts o = {.bucket_cap_mb = r->a.bucket_cap_mb > 0 ? (double)r->a.bucket_cap_mb : 0,
                      .no_overlap = r->a.no_overlap, .join = r->a.uneven,
                      .sync_bn = r->a.sync_bn};
    if ((st = tdm_tool_rank_ddp(r->comm, r->dev, r->m, &o, &r->nccl, &r->ddp)))
        return tdm_train_ddp_fail(r->rank, "ddp set-up", st);
    if (r->a.comm_hook) {
        tdm_ddp_powersgd_opts po = {.rank = (int)r->a.powersgd_rank,
                                    .start_step = r->a.powersgd_start_step,
                                    .seed = (uint64_t)r->a.seed};
        if ((st = tdm_ddp_set_comm_hook(r->ddp, r->a.comm_hook, &po)))
            return tdm_train_ddp_fail(r->rank, "--comm-hook", st);
    }
    TDM_CHECK(tdm_train_make_optim(&r->a, r->m, &r->opt));
    if (!r->a.resume) return TDM_STATUS_OK;
    tdm_ckpt_info info;
    if ((st = tdm_ddp_checkpoint_load(r->ddp, r->a.resume, r->opt, &info)))
        return tdm_train_ddp_fail(r->rank, "resuming", st);
    r->start_epoch = info.epoch;
    tdm_train_print_resumed(r->a.resume, &info);
    return TDM_STATUS_OK;
}

static tdm_status tdm_train_ddp_rank_run(tdm_train_ddp_rank *r)
{
    const tdm_train_ddp_ctx *c = r->c;
    TDM_CHECK(tdm_train_ddp_rank_setup(r));
    char devdesc[256];
    if (c->job_desc)
        snprintf(devdesc, sizeof devdesc, "%d MPI ranks on %s (%s; gradients over %s%s, "
                 "timeout %g s)", r->world, c->a->device, c->job_desc,
                 tdm_comm_backend_name(r->nccl ? r->nccl : r->comm),
                 tdm_ddp_zero_copy(r->ddp) ? ", zero-copy buckets" : "",
                 (double)c->timeout_ms / 1000.0);
    else
        snprintf(devdesc, sizeof devdesc, "%d processes on %s (%s communicator%s, timeout %g s)",
                 r->world, c->a->device, tdm_comm_backend_name(r->nccl ? r->nccl : r->comm),
                 tdm_ddp_zero_copy(r->ddp) ? ", zero-copy buckets" : "",
                 (double)c->timeout_ms / 1000.0);
    if (r->rank == 0)
        tdm_train_print_header(&r->a, &c->spec, c->train, c->test, tdm_model_param_elems(r->m),
                               devdesc);
    tdm_train_ddp_test_hook(r);
    tdm_train_run run = {.m = r->m, .opt = r->opt, .start_epoch = r->start_epoch,
                         .step = tdm_train_ddp_step, .step_ctx = r, .train = c->train,
                         .test = c->test, .eval = tdm_train_ddp_eval, .eval_ctx = r,
                         .after = tdm_train_ddp_after, .after_ctx = r};
    tdm_accum acc = {.ops = &tdm_train_ddp_accum_ops, .ctx = r, .micro = (int)r->a.batch,
                     .in_features = tdm_model_in_features(r->m),
                     .out_rows = tdm_model_out_rows(r->m)};
    if (r->a.grad_accum > 1) {
        run.step = tdm_accum_step;
        run.step_ctx = &acc;
    }
    if (r->a.uneven)
        TDM_CHECK(tdm_train_uneven_epochs(&r->a, r->ddp, r->opt, r->comm, c->train, c->test,
                                          NULL, c->a->save, r->start_epoch));
    else
        TDM_CHECK(tdm_train_epochs(&r->a, &run));
    if (r->rank == 0) {
        tdm_tool_print_ddp_times(r->ddp, r->world, 1);
        tdm_ddp_times t;
        tdm_ddp_get_times(r->ddp, &t);
        if (t.steps > 0)
            printf("ddp comm hook %s: %.0f bytes all-reduced per step (float32 gradients: "
                   "%.0f)\n", tdm_ddp_comm_hook_name(r->ddp),
                   t.reduced_bytes_total / (double)t.steps,
                   (double)tdm_model_param_elems(r->m) * 4.0);
    }
    return TDM_STATUS_OK;
}

/* One rank, forked or launched, over the shm process group comm. */
static tdm_status tdm_train_ddp_rank_main(tdm_comm *comm, const tdm_train_ddp_ctx *c)
{
    tdm_train_ddp_rank r = {.c = c, .a = *c->a, .comm = comm, .rank = tdm_comm_rank(comm),
                            .world = tdm_comm_size(comm)};
    tdm_train_ddp_quiet_rank(&r);
    tdm_status st = tdm_train_ddp_rank_run(&r);
    if (st) {
        /* The group learns why in this rank's words (the step's own abort,
         * if any, was first); the parent's failure summary quotes them. */
        char why[400];
        snprintf(why, sizeof why, "%s", tdm_error_message()[0] ? tdm_error_message()
                                                               : "rank failed");
        tdm_comm_abort(comm, why);
    }
    fflush(stdout);
    tdm_ddp_free(r.ddp);
    tdm_comm_free(r.nccl);   /* before comm, which bootstrapped it */
    tdm_optim_free(r.opt);
    tdm_model_free(r.m);
    tdm_device_free(r.dev);
    return st;
}

/* A forked rank: its process's exit code. */
static int tdm_train_ddp_forked_rank(tdm_comm *comm, void *arg)
{
    return tdm_tool_exit(tdm_train_ddp_rank_main(comm, arg));
}

/* One rank of a job started by tandem launch: joins it, loads the data
 * and runs. */
static tdm_status tdm_train_ddp_launched(tdm_train_ddp_ctx *c, int mpi, tdm_mpi_backend backend)
{
    const tdm_train_args *a = c->a;
    tdm_comm *comm = NULL;
    tdm_dist_env env;
    tdm_tool_mpi_rank mr = {0};
    tdm_dataset train = {0}, test = {0};
    tdm_dist_pg_opts po = {.timeout_ms = c->timeout_ms};
    tdm_status st;
    if (mpi) {
        if ((st = tdm_tool_mpi_rank_init(&mr, backend, c->timeout_ms, NULL))) {
            fprintf(stderr, "tandem train: joining the MPI job: %s\n", tdm_error_message());
            return st;
        }
        comm = mr.comm;
        env = mr.env;
    } else if ((st = tdm_dist_pg_init(&comm, &env, &po))) {
        fprintf(stderr, "tandem train: joining the launched job: %s\n", tdm_error_message());
        return st;
    }
    /* devices are per machine: one for all, or one per rank on it */
    int per_machine = mpi ? env.local_world_size : env.world_size;
    if (c->dl.count != 1 && c->dl.count != per_machine && c->dl.count != env.world_size) {
        st = tdm_tool_usage_error("tandem train: rank %d: --device '%s' names %d devices but "
                                  "the job has %d ranks%s\n", env.rank, a->device, c->dl.count,
                                  per_machine, mpi ? " on this machine" : "");
        tdm_comm_abort(comm, "bad --device");
        goto done;
    }
    if (c->dl.count == 1) c->dl.index[0] = env.local_rank;
    else c->dl.index[0] = c->dl.index[env.local_rank % c->dl.count];
    c->dl.count = 1;
    if ((st = tdm_train_load_data(a, &c->spec, &train, &test))) {
        tdm_comm_abort(comm, "loading data failed");
        goto done;
    }
    c->train = &train;
    c->test = &test;
    c->job_desc = mpi ? mr.desc : NULL;
    st = tdm_train_ddp_rank_main(comm, c);
done:
    if (mpi) tdm_tool_mpi_rank_end(&mr, tdm_tool_exit(st));
    else tdm_comm_free(comm);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}

/* N forked ranks on the devices of --device. A probe replica on a host
 * device checks that the data fits the model and sizes the zero-copy
 * arena. */
static tdm_status tdm_train_ddp_forked(tdm_train_ddp_ctx *c)
{
    const tdm_train_args *a = c->a;
    tdm_dataset train = {0}, test = {0};
    int64_t param_elems = 0;
    tdm_status st;
    TDM_CHECK(tdm_train_load_and_probe(a, &c->spec, &train, &test, &param_elems));
    tdm_dist_spawn_opts so = {.timeout_ms = TDM_DIST_RUN_UNBOUNDED_MS, .comm_timeout_ms = c->timeout_ms,
                             .arena_bytes = tdm_tool_ddp_arena_bytes(&c->dl, param_elems)};
    c->train = &train;
    c->test = &test;
    fflush(stdout);
    /* a restart resumes from the checkpoint: a copy whose resume changes */
    tdm_train_args ar = *a;
    c->a = &ar;
    st = tdm_elastic_train_forked("ddp", c->dl.count, tdm_train_ddp_forked_rank, c, &so,
                                  a->max_restarts, a->save, &ar.resume);
    c->a = a;
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}

tdm_status tdm_train_run_ddp(const tdm_train_args *a)
{
    tdm_train_ddp_ctx c = {.a = a};
    tdm_status st;
    if ((st = tdm_model_spec_parse(&c.spec, a->model)))
        return tdm_tool_usage_error("tandem train: --model: %s\n", tdm_error_message());
    tdm_train_note_threads(a, "DDP rank");
    /* The process group's timeout: --timeout, else TANDEM_TIMEOUT, else
     * 60 s for forked ranks (300 s, pg.h's default, for launched ones).
     * The flag is also exported as TANDEM_TIMEOUT, so that the ranks'
     * NCCL communicators (tools/ddp_rank.c) get it too. */
    int64_t timeout_ms = 0;
    if (a->timeout ? tdm_dist_timeout_parse("--timeout", a->timeout, &timeout_ms)
                   : tdm_dist_timeout_from_env(&timeout_ms))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if (a->timeout) setenv(TDM_DIST_ENV_TIMEOUT, a->timeout, 1);
    int launched = tdm_dist_launched();
    int mpi = !launched && tdm_tool_mpi_launched();
    tdm_mpi_backend backend = TDM_MPI_BACKEND_AUTO;
    if (a->backend) TDM_CHECK(tdm_tool_backend_parse("train", a->backend, &backend));
    if (!mpi && backend != TDM_MPI_BACKEND_AUTO && backend != TDM_MPI_BACKEND_SHM) {
        if (!tdm_tool_mpi_built()) {
            st = tdm_tool_mpi_missing("--backend mpi|hier");
            fprintf(stderr, "tandem train: %s\n", tdm_error_message());
            return st;
        }
        return tdm_tool_usage_error("tandem train: --backend %s runs between the ranks of an MPI "
                                    "job: start them with `mpirun -np N tandem train --mode ddp "
                                    "--backend %s ...` (or srun)\n", a->backend, a->backend);
    }
    c.timeout_ms = timeout_ms ? timeout_ms : launched || mpi ? TDM_DIST_TIMEOUT_DEFAULT_MS : TDM_DIST_FORKED_TIMEOUT_MS;
    if ((st = tdm_tool_parse_devices(&c.dl, a->device, !launched && !mpi))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    return launched || mpi ? tdm_train_ddp_launched(&c, mpi, backend) : tdm_train_ddp_forked(&c);
}
