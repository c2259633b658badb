/* tools/train_ddp.c: `tandem train --mode ddp --device cpu:N`: forks N
 * ranks (tdm_ddp_spawn), each training its own replica through ddp/ on
 * its contiguous share of every global batch (the same global batches as
 * --mode single: tdm_train_epoch_order). Every rank evaluates its share
 * of the test set (tdm_ddp_evaluate); rank 0 prints progress, results and
 * the DDP timing summary and writes checkpoints; every rank that fails says which rank it is
 * and tells the group why (tdm_comm_abort), and the parent names the root
 * cause (the rule of shm/spawn.h) and exits 1.
 *
 * With --device cuda[:I,J,..] each rank opens its GPU, builds an NCCL
 * communicator bootstrapped over the shm one (the unique id travels over
 * shm) and DDP reduces its buckets over NCCL in device memory; the shm
 * communicator stays for the host-memory collectives (layout check,
 * checkpoint flags, epoch barriers) and aborts. cuda/ is reached through
 * weak symbols, so builds without it link and refuse --device cuda.
 *
 * Under `tandem launch -n N -- tandem train --mode ddp ...` (TANDEM_SHM_FD
 * and WORLD_SIZE set) it does not fork: this process is one rank of the
 * launched job and joins it with tdm_ddp_pg_init_from_env. Under an MPI
 * launcher (mpirun, srun; tools/mpi_job.h) likewise, over the communicator
 * of --backend (shm, mpi or hier); a GPU rank's NCCL communicator then
 * gets its unique id over that one, that is over MPI between machines.
 *
 * Test hook: TANDEM_DDP_TEST_KILL=R:S makes rank R SIGKILL itself before
 * its global step S (counted from 1 over the whole run), to test
 * fail-fast and checkpoint recovery end to end; R:S:STOP makes it stop
 * itself (SIGSTOP) there instead, to test stall detection.
 *
 * Batch split: rank r gets samples [r*B/N, (r+1)*B/N) of each global batch
 * of B. Its loss gradient is scaled by 1/B (not 1/B_r) and gradients are
 * SUM-reduced, so the reduced gradient is exactly the global batch's
 * mean-loss gradient even when N does not divide B. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/log.h"
#include "ddp/ddp.h"
#include "ddp/pg.h"
#include "ddp/spawn.h"
#include "models/checkpoint.h"
#include "shm/shm_comm.h"
#include "tools/devices.h"
#include "tools/mpi_job.h"
#include "tools/train_modes.h"

typedef struct tdm_train_ddp_ctx {
    const tdm_train_args *a;
    int64_t timeout_ms;          /* the process group's, as used */
    tdm_model_spec spec;
    tdm_device_list dl;
    const tdm_dataset *train, *test;
    const char *job_desc;    /* an MPI job: its backend and machines; NULL otherwise */
} tdm_train_ddp_ctx;

typedef struct tdm_train_ddp_rank {
    tdm_ddp *ddp;
    tdm_optim *opt;
    tdm_comm *comm;
    int rank, world;
    int64_t feat;
    int64_t steps, kill_step;    /* test hook: kill_sig before step kill_step */
    int kill_sig;
} tdm_train_ddp_rank;

static void tdm_train_ddp_fail(int rank, const char *what, tdm_status st)
{
    fprintf(stderr, "tandem train: rank %d: %s: %s\n", rank, what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
}

static tdm_status tdm_train_ddp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                     double *loss_mean)
{
    tdm_train_ddp_rank *r = ctx;
    tdm_status st = TDM_STATUS_OK;
    int lo = (int)((int64_t)r->rank * batch / r->world);
    int hi = (int)((int64_t)(r->rank + 1) * batch / r->world);
    double ls = 0.0;
    if (++r->steps == r->kill_step) {
        fflush(stdout);
        raise(r->kill_sig);
    }
    TDM_TRY(tdm_ddp_zero_grad(r->ddp));
    TDM_TRY(tdm_ddp_forward_scaled(r->ddp, (const float *)x + (int64_t)lo * r->feat, y + lo, hi - lo,
                                   1.0f / (float)batch, &ls));
    if (!isfinite(ls)) {
        /* This rank's share went bad: it stops before the gradient
         * all-reduce and aborts the group with its reason, so every other
         * rank leaves that all-reduce at once, naming it ("all_reduce #N:
         * aborted by rank R: loss is NaN at step S ..."): all stop at the
         * same step without a collective of their own. */
        char why[256];
        snprintf(why, sizeof why, "loss is %s at step %lld (rank %d's %d sample%s of the batch "
                 "of %d): training diverged (a lower learning rate may help)",
                 isnan(ls) ? "NaN" : ls > 0 ? "+inf" : "-inf",
                 (long long)tdm_optim_steps(r->opt) + 1, r->rank, hi - lo,
                 hi - lo == 1 ? "" : "s", batch);
        tdm_comm_abort(r->comm, why);
        return tdm_error_set(TDM_STATUS_NONFINITE, "rank %d: %s", r->rank, why);
    }
    TDM_TRY(tdm_ddp_backward(r->ddp));
    TDM_TRY(tdm_ddp_step(r->ddp, r->opt));
    *loss_mean = tdm_ddp_loss_sum(r->ddp) / batch;   /* carried by the gradient all-reduce */
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "rank %d", r->rank);
    tdm_comm_abort(r->comm, tdm_error_message());
    return st;
}

/* Every rank evaluates its share of the test set (tdm_ddp_evaluate): the
 * others never wait for rank 0 to evaluate alone, which on a large test
 * set could outlast the collective timeout of the barrier below. */
static tdm_status tdm_train_ddp_eval(void *ctx, tdm_model *m, const tdm_dataset *test,
                                     double *loss_mean, double *accuracy)
{
    tdm_train_ddp_rank *r = ctx;
    (void)m;
    return tdm_ddp_evaluate(r->ddp, test, 1000, loss_mean, accuracy);
}

static int tdm_train_ddp_after(void *ctx, int64_t epoch)
{
    tdm_train_ddp_rank *r = ctx;
    (void)epoch;
    /* rank 0 has saved its checkpoint when it gets here */
    tdm_status st = tdm_comm_barrier(r->comm);
    if (st) tdm_train_ddp_fail(r->rank, "end-of-epoch barrier", st);
    return st == TDM_STATUS_OK;
}

static void tdm_train_ddp_report(tdm_ddp *ddp, int world)
{
    tdm_ddp_times t;
    tdm_ddp_get_times(ddp, &t);
    if (t.steps == 0) return;
    double n = (double)t.steps, step_ms = 0;
    for (int i = 0; i < TDM_PHASE_COUNT_; i++) step_ms += t.total.ms[i];
    double exposed = t.total.ms[TDM_PHASE_ALLREDUCE_WAIT];
    double share = t.reduced_bytes_total > 0
                       ? 100.0 * t.overlapped_bytes_total / t.reduced_bytes_total : 0.0;
    printf("ddp (rank 0 of %d, %d bucket%s, per step): forward %.3f ms, loss %.3f ms, backward "
           "%.3f ms, all-reduce exposed %.3f ms, optimizer %.3f ms\n",
           world, t.n_buckets, t.n_buckets == 1 ? "" : "s", t.total.ms[TDM_PHASE_FORWARD] / n,
           t.total.ms[TDM_PHASE_LOSS] / n, t.total.ms[TDM_PHASE_BACKWARD] / n, exposed / n,
           t.total.ms[TDM_PHASE_STEP] / n);
    printf("ddp communication: exposed (not overlapped) %.3f ms per step = %.1f%% of the step; "
           "overlap: %.1f%% of the gradient bytes were all-reduced while backward ran\n",
           exposed / n, step_ms > 0 ? 100.0 * exposed / step_ms : 0.0, share);
}

/* NCCL's watchdog polls this: the shm group's abort (a rank that failed
 * or died, or the parent stopping the job) stops a rank blocked in NCCL at
 * once instead of at the deadline. */
static int tdm_train_ddp_rank_main(tdm_comm *comm, void *arg)
{
    const tdm_train_ddp_ctx *c = arg;
    tdm_train_args a = *c->a;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_comm *nccl = NULL;       /* CUDA: the gradient communicator; comm bootstraps it */
    tdm_status st;
    int rc = 1;
    if (rank != 0) {
        int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            close(fd);
        }
        a.save = NULL;
        a.quiet = 1;
    }
    if ((st = tdm_tool_rank_device(&c->dl, rank, &dev))) {
        tdm_train_ddp_fail(rank, "opening device", st);
        goto done;
    }
    if ((st = tdm_model_init(&m, dev, &c->spec, (uint64_t)a.seed))) {
        tdm_train_ddp_fail(rank, "building model", st);
        goto done;
    }
    /* the forked path checked on a probe; a launched rank checks here */
    if (!tdm_train_check_features(c->train, m)) {
        rc = 2;
        goto done;
    }
    tdm_ddp_opts o = {.bucket_cap_mb = a.bucket_cap_mb > 0 ? (double)a.bucket_cap_mb : 0,
                      .no_overlap = a.no_overlap};
    if ((st = tdm_tool_rank_ddp(comm, dev, m, &o, &nccl, &ddp))) {
        tdm_train_ddp_fail(rank, "ddp set-up", st);
        goto done;
    }
    if (!tdm_train_make_optim(&a, m, &opt)) goto done;
    int64_t start_epoch = 0;
    if (a.resume) {
        tdm_ckpt_info info;
        if ((st = tdm_ddp_checkpoint_load(ddp, a.resume, opt, &info))) {
            tdm_train_ddp_fail(rank, "resuming", st);
            goto done;
        }
        start_epoch = info.epoch;
        tdm_train_print_resumed(a.resume, &info);
    }
    char devdesc[256];
    if (c->job_desc)
        snprintf(devdesc, sizeof devdesc, "%d MPI ranks on %s (%s; gradients over %s%s, "
                 "timeout %g s)", world, c->a->device, c->job_desc,
                 tdm_comm_backend_name(nccl ? nccl : comm),
                 tdm_ddp_zero_copy(ddp) ? ", zero-copy buckets" : "",
                 (double)c->timeout_ms / 1000.0);
    else
        snprintf(devdesc, sizeof devdesc, "%d processes on %s (%s communicator%s, timeout %g s)",
                 world, c->a->device, tdm_comm_backend_name(nccl ? nccl : comm),
                 tdm_ddp_zero_copy(ddp) ? ", zero-copy buckets" : "",
                 (double)c->timeout_ms / 1000.0);
    if (rank == 0)
        tdm_train_print_header(&a, &c->spec, c->train, c->test, tdm_model_param_elems(m), devdesc);
    /* r.comm: aborts and epoch barriers (shm; an NCCL abort reaches it too) */
    tdm_train_ddp_rank r = {.ddp = ddp, .opt = opt, .comm = comm, .rank = rank, .world = world,
                            .feat = tdm_data_features(c->train)};
    const char *kill_env = getenv("TANDEM_DDP_TEST_KILL");
    int kr = -1;
    long long ks = 0;
    char how[8] = "";
    if (kill_env && sscanf(kill_env, "%d:%lld:%7s", &kr, &ks, how) >= 2 && kr == rank) {
        r.kill_step = ks;
        r.kill_sig = strcmp(how, "STOP") ? SIGKILL : SIGSTOP;
    }
    if (!tdm_train_epochs(&a, m, opt, c->train, c->test, tdm_train_ddp_step, &r, start_epoch,
                          tdm_train_ddp_eval, &r, tdm_train_ddp_after, &r))
        goto done;
    if (rank == 0) tdm_train_ddp_report(ddp, world);
    rc = 0;
done:
    if (rc) {
        /* The group learns why in this rank's words (the step's own abort,
         * if any, was first); the parent's failure summary quotes them. */
        char why[400];
        snprintf(why, sizeof why, "%s", tdm_error_message()[0] ? tdm_error_message()
                                                               : "rank failed");
        tdm_comm_abort(comm, why);
    }
    fflush(stdout);
    tdm_ddp_free(ddp);
    tdm_comm_free(nccl);   /* before comm, which bootstrapped it */
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return rc;
}

int tdm_train_run_ddp(const tdm_train_args *a)
{
    tdm_train_ddp_ctx c = {.a = a};
    tdm_dataset train = {0}, test = {0};
    tdm_device *dev = NULL;
    tdm_model *probe = NULL;
    tdm_status st;
    int rc = 1;
    if ((st = tdm_model_spec_parse(&c.spec, a->model))) {
        fprintf(stderr, "tandem train: --model: %s\n", tdm_error_message());
        return 2;
    }
    if (a->threads != 1)
        fprintf(stderr, "tandem train: note: --threads applies to --mode single; each DDP "
                        "rank computes on one thread\n");
    /* The process group's timeout: --timeout, else TANDEM_TIMEOUT, else
     * 60 s for forked ranks (300 s, pg.h's default, for launched ones).
     * The flag is also exported as TANDEM_TIMEOUT, so that the ranks'
     * NCCL communicators (tools/devices.c) get it too. */
    int64_t timeout_ms = 0;
    if (a->timeout ? tdm_ddp_timeout_parse("--timeout", a->timeout, &timeout_ms)
                   : tdm_ddp_timeout_from_env(&timeout_ms)) {
        fprintf(stderr, "tandem train: %s\n", tdm_error_message());
        return 2;
    }
    if (a->timeout) setenv(TDM_DDP_ENV_TIMEOUT, a->timeout, 1);
    int launched = getenv("TANDEM_SHM_FD") && getenv("WORLD_SIZE");
    int mpi = !launched && tdm_tool_mpi_launched();
    tdm_mpi_backend backend = TDM_MPI_BACKEND_AUTO;
    if (a->backend && !tdm_tool_backend_parse("train", a->backend, &backend)) return 2;
    if (!mpi && backend != TDM_MPI_BACKEND_AUTO && backend != TDM_MPI_BACKEND_SHM) {
        if (!tdm_tool_mpi_built()) {
            tdm_tool_mpi_missing("--backend mpi|hier");
            fprintf(stderr, "tandem train: %s\n", tdm_error_message());
            return 1;
        }
        fprintf(stderr, "tandem train: --backend %s runs between the ranks of an MPI job: start "
                "them with `mpirun -np N tandem train --mode ddp --backend %s ...` (or srun)\n",
                a->backend, a->backend);
        return 2;
    }
    c.timeout_ms = timeout_ms ? timeout_ms : launched || mpi ? TDM_DDP_TIMEOUT_DEFAULT_MS : 60000;
    if ((st = tdm_tool_parse_devices(&c.dl, a->device, !launched && !mpi))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? 1 : 2;
    }
    if (launched || mpi) {
        /* one rank of a launched job */
        tdm_comm *comm = NULL;
        tdm_ddp_env env;
        tdm_tool_mpi_rank mr = {0};
        tdm_ddp_pg_opts po = {.timeout_ms = c.timeout_ms};
        if (mpi) {
            if ((st = tdm_tool_mpi_rank_init(&mr, backend, c.timeout_ms, NULL))) {
                fprintf(stderr, "tandem train: joining the MPI job: %s\n", tdm_error_message());
                return 1;
            }
            comm = mr.comm;
            env = mr.env;
        } else if ((st = tdm_ddp_pg_init(&comm, &env, &po))) {
            fprintf(stderr, "tandem train: joining the launched job: %s\n", tdm_error_message());
            return 1;
        }
        /* devices are per machine: one for all, or one per rank on it */
        int per_machine = mpi ? env.local_world_size : env.world_size;
        if (c.dl.count != 1 && c.dl.count != per_machine && c.dl.count != env.world_size) {
            fprintf(stderr, "tandem train: rank %d: --device '%s' names %d devices but the job "
                            "has %d ranks%s\n", env.rank, a->device, c.dl.count, per_machine,
                    mpi ? " on this machine" : "");
            tdm_comm_abort(comm, "bad --device");
            rc = 2;
            goto launched_done;
        }
        if (c.dl.count == 1) c.dl.index[0] = env.local_rank;
        else c.dl.index[0] = c.dl.index[env.local_rank % c.dl.count];
        c.dl.count = 1;
        if (!tdm_train_load_data(a, &c.spec, &train, &test)) {
            tdm_comm_abort(comm, "loading data failed");
            rc = 1;
            goto launched_done;
        }
        c.train = &train;
        c.test = &test;
        c.job_desc = mpi ? mr.desc : NULL;
        rc = tdm_train_ddp_rank_main(comm, &c);
launched_done:
        if (mpi) tdm_tool_mpi_rank_end(&mr, rc);
        else tdm_comm_free(comm);
        tdm_data_free(&train);
        tdm_data_free(&test);
        return rc;
    }
    if (!tdm_train_load_data(a, &c.spec, &train, &test)) return 1;
    /* a probe replica: feature check and the size of the zero-copy arena */
    if ((st = tdm_device_open(&dev, "cpu", 0, 1)) ||
        (st = tdm_model_init(&probe, dev, &c.spec, (uint64_t)a->seed))) {
        fprintf(stderr, "tandem train: building model: %s\n", tdm_error_message());
        goto done;
    }
    if (!tdm_train_check_features(&train, probe)) {
        rc = 2;
        goto done;
    }
    tdm_ddp_spawn_opts so = {.timeout_ms = INT64_MAX / 2000000, .comm_timeout_ms = c.timeout_ms,
                             .arena_bytes = tdm_tool_ddp_arena_bytes(
                                 &c.dl, tdm_model_param_elems(probe))};
    tdm_model_free(probe);
    probe = NULL;
    c.train = &train;
    c.test = &test;
    fflush(stdout);
    st = tdm_ddp_spawn(c.dl.count, tdm_train_ddp_rank_main, &c, &so, NULL);
    if (st) {
        fprintf(stderr, "tandem train: ddp: %s\n", tdm_error_message());
        goto done;
    }
    rc = 0;
done:
    tdm_model_free(probe);
    tdm_device_free(dev);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return rc;
}
