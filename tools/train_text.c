/* tools/train_text.c: `tandem train --model gpt[:L-D-H-T]`: a byte-level
 * language model on text (core/text.h: Debian's fortunes by default, or
 * --data FILE|DIR) with one device, DataParallel or DDP. Each epoch draws
 * as many bytes as the training split holds, in random windows; after it
 * the validation loss (nats and bits per byte, on the fixed evaluation
 * windows) is printed beside the bigram baseline's. The global batch is B
 * windows in every mode: DP scatters them over its devices, and DDP rank r
 * draws windows [r*B/W, (r+1)*B/W) itself (no rank reads another's), with
 * its loss gradient scaled by 1/B so the summed gradients are the global
 * batch's; evaluation is spread over the ranks likewise. Checkpoints hold
 * the model (and optimizer); `tandem sample` reads them. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/text.h"
#include "ddp/ddp.h"
#include "ddp/pg.h"
#include "ddp/spawn.h"
#include "dp/dp.h"
#include "models/checkpoint.h"
#include "models/gpt.h"
#include "models/train_text.h"
#include "tools/devices.h"
#include "tools/mpi_job.h"
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
} tdm_text_job;

/* What one process's run needs: its share of each global batch, its
 * evaluation and the hook after each epoch (DDP's barrier). */
typedef struct tdm_text_proc {
    tdm_model *m;
    tdm_optim *opt;
    int lo, hi;                      /* this process's windows of a global batch */
    tdm_train_step_fn step;
    void *step_ctx;
    tdm_status (*eval)(struct tdm_text_proc *p, double *loss);
    int (*after)(struct tdm_text_proc *p);
    tdm_ddp *ddp;                    /* DDP ranks */
    tdm_comm *comm;                  /* DDP: the shm communicator */
    int rank, world;
    double dp_ms;                    /* DP: step time summed */
    tdm_phase_times dp_sum;
    int64_t dp_steps;
    tdm_dp *dp;
} tdm_text_proc;

static void tdm_text_fail(int rank, const char *what, tdm_status st)
{
    if (rank >= 0)
        fprintf(stderr, "tandem train: rank %d: %s: %s\n", rank, what,
                tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    else
        tdm_train_fail(what, st);
}

static void tdm_text_header(const tdm_text_job *j, int64_t params, const char *devices)
{
    const tdm_train_args *a = j->a;
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

/* The epochs of one process (every mode). Prints, saves and evaluates
 * where rank 0 (or the only process) does. */
static int tdm_text_epochs(const tdm_text_job *j, tdm_text_proc *p, int64_t start_epoch)
{
    const tdm_train_args *a = j->a;
    int T = j->spec.n_ctx, B = (int)a->batch;
    int64_t full = tdm_train_text_steps_per_epoch(&j->corpus->train, T, B);
    int64_t per_epoch = a->max_steps > 0 && a->max_steps < full ? a->max_steps : full;
    tdm_train_sched sched = {.step = p->step, .ctx = p->step_ctx, .opt = p->opt,
                             .base_lr = a->lr, .total_steps = per_epoch * a->epochs,
                             .cosine = !strcmp(a->lr_schedule, "cosine")};
    tdm_progress pr = {.tty = isatty(STDERR_FILENO), .quiet = a->quiet, .epochs = a->epochs};
    for (int64_t e = start_epoch; e < a->epochs; e++) {
        tdm_epoch_stats es;
        pr.epoch = e;
        pr.last_tenth = -1;
        tdm_model_set_train(p->m, 1);
        /* global steps count whole epochs, so --max-steps and resuming draw
         * the windows an uninterrupted run of the same epochs draws */
        tdm_status st = tdm_train_text_steps(&j->corpus->train, T, B, (uint64_t)a->seed,
                                             e * full, per_epoch, p->lo, p->hi,
                                             tdm_train_sched_step, &sched, tdm_train_progress,
                                             &pr, &es);
        if (st != TDM_STATUS_OK) {
            if (pr.tty && !pr.quiet) fputs("\n", stderr);
            tdm_text_fail(p->ddp ? p->rank : -1, "training", st);
            return 0;
        }
        double vl = NAN;
        if (!a->no_eval && (st = p->eval(p, &vl)) != TDM_STATUS_OK) {
            tdm_text_fail(p->ddp ? p->rank : -1, "evaluation", st);
            return 0;
        }
        printf("epoch %lld/%lld: train loss %.4f, %.0f windows/s = %.0f tokens/s (%.1f s)",
               (long long)e + 1, (long long)a->epochs, es.loss_mean, es.samples_per_s,
               es.samples_per_s * T, es.seconds);
        if (!a->no_eval)
            printf(", val loss %.4f nats = %.3f bits per byte (bigram %.4f)", vl, vl / M_LN2,
                   j->bigram);
        printf("\n");
        fflush(stdout);
        if (a->save) {
            tdm_ckpt_info info = {.step = tdm_optim_steps(p->opt), .epoch = e + 1,
                                  .seed = (uint64_t)a->seed};
            st = tdm_checkpoint_save(a->save, p->m, p->opt, &info);
            if (st != TDM_STATUS_OK) {
                tdm_text_fail(p->ddp ? p->rank : -1, "saving checkpoint", st);
                return 0;
            }
            if (!a->quiet)
                printf("  saved %s (epoch %lld, step %lld); tandem sample --resume %s\n", a->save,
                       (long long)e + 1, (long long)info.step, a->save);
        }
        if (p->after && !p->after(p)) return 0;
    }
    return 1;
}

/* ---- one device and DP (one process) ---- */

typedef struct tdm_text_local {
    tdm_text_proc p;
    const tdm_text_job *j;
} tdm_text_local;

static tdm_status tdm_text_eval_here(tdm_text_proc *p, double *loss)
{
    const tdm_text_job *j = ((tdm_text_local *)p)->j;
    return tdm_train_text_evaluate(p->m, &j->corpus->val, TDM_TEXT_EVAL_CAP, TDM_TEXT_EVAL_BATCH,
                                   loss);
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

/* Model and optimizer on dev, and --resume. 0, or an exit code. */
static int tdm_text_make(const tdm_text_job *j, tdm_device *dev, tdm_model **m, tdm_optim **opt,
                         int64_t *start_epoch)
{
    tdm_status st;
    if ((st = tdm_model_init(m, dev, &j->spec, (uint64_t)j->a->seed)) != TDM_STATUS_OK) {
        tdm_train_fail("building model", st);
        return 1;
    }
    if (!tdm_train_make_optim(j->a, *m, opt)) return 1;
    if (!tdm_train_resume(j->a, *m, *opt, start_epoch)) return 1;
    return 0;
}

static int tdm_text_run_local(const tdm_text_job *j)
{
    const tdm_train_args *a = j->a;
    int dp = !strcmp(a->mode, "dp"), rc = 1, n = 0;
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    tdm_text_local L = {.j = j};
    tdm_text_proc *p = &L.p;
    tdm_single single = {0};
    tdm_status st;
    int64_t start_epoch = 0;
    char desc[128];
    if (dp) {
        if (a->threads != 1)
            fprintf(stderr, "tandem train: note: --threads applies to --mode single; each DP "
                            "device computes on one thread\n");
        if ((st = tdm_dp_devices_open(a->device, devs, &n)) != TDM_STATUS_OK) {
            tdm_train_fail("--device", st);
            return st == TDM_STATUS_INVALID_ARG ? 2 : 1;
        }
    } else {
        tdm_device_list dl;
        if ((st = tdm_device_list_parse(&dl, a->device)) != TDM_STATUS_OK) {
            tdm_train_fail("--device", st);
            return st == TDM_STATUS_NO_DEVICE ? 1 : 2;
        }
        if (dl.count != 1) {
            fprintf(stderr, "tandem train: --mode single uses one device, but '%s' names %d "
                            "(use --mode dp or --mode ddp for several)\n", a->device, dl.count);
            return 2;
        }
        if ((st = tdm_device_open(&devs[0], dl.kind == TDM_DEVICE_CUDA ? "cuda" : "cpu",
                                  dl.index[0], (int)a->threads)) != TDM_STATUS_OK) {
            tdm_train_fail("opening device", st);
            return 1;
        }
        n = 1;
    }
    if ((rc = tdm_text_make(j, devs[0], &p->m, &p->opt, &start_epoch))) goto done;
    rc = 1;
    p->lo = 0;
    p->hi = (int)a->batch;
    p->eval = tdm_text_eval_here;
    if (dp) {
        if ((st = tdm_dp_init(&p->dp, p->m, devs, n, NULL)) != TDM_STATUS_OK) {
            tdm_train_fail("DataParallel", st);
            goto done;
        }
        p->step = tdm_text_dp_step;
        p->step_ctx = p;
        snprintf(desc, sizeof desc, "DataParallel over %d device%s (%s), output device %s", n,
                 n > 1 ? "s" : "", a->device, devs[0]->name);
    } else {
        single.model = p->m;
        single.opt = p->opt;
        p->step = tdm_single_step;
        p->step_ctx = &single;
        snprintf(desc, sizeof desc, "device %s, %lld BLAS thread%s", devs[0]->name,
                 (long long)a->threads, a->threads > 1 ? "s" : "");
    }
    tdm_text_header(j, tdm_model_param_elems(p->m), desc);
    if (!tdm_text_epochs(j, p, start_epoch)) goto done;
    if (dp && p->dp_steps > 0) {
        double total = p->dp_ms / (double)p->dp_steps;
        printf("DP step, mean over %lld steps: %.2f ms\n", (long long)p->dp_steps, total);
        for (int k = 0; k < TDM_PHASE_COUNT_; k++) {
            if (k == TDM_PHASE_ALLREDUCE_WAIT) continue;
            double ms = p->dp_sum.ms[k] / (double)p->dp_steps;
            printf("  %-12s %8.2f ms  %5.1f%%\n", tdm_phase_name((tdm_phase)k), ms,
                   total > 0 ? 100.0 * ms / total : 0.0);
        }
    }
    rc = 0;
done:
    tdm_dp_free(p->dp);
    tdm_single_free(&single);
    tdm_optim_free(p->opt);
    tdm_model_free(p->m);
    tdm_dp_devices_close(devs, n);
    return rc;
}

/* ---- DDP ranks ---- */

typedef struct tdm_text_rank {
    tdm_text_proc p;
    const tdm_text_job *j;
    int batch;
} tdm_text_rank;

static tdm_status tdm_text_ddp_step(void *ctx, const void *x, const int32_t *y, int n,
                                    double *loss)
{
    tdm_text_rank *r = ctx;
    tdm_text_proc *p = &r->p;
    tdm_status st = TDM_STATUS_OK;
    double ls = 0.0;
    TDM_TRY(tdm_ddp_zero_grad(p->ddp));
    /* 1/B, not 1/n: the SUM over ranks is the global batch's mean gradient */
    TDM_TRY(tdm_ddp_forward_scaled(p->ddp, x, y, n, 1.0f / (float)r->batch, &ls));
    TDM_TRY(tdm_ddp_backward(p->ddp));
    TDM_TRY(tdm_ddp_step(p->ddp, p->opt));
    *loss = tdm_ddp_loss_sum(p->ddp) / r->batch;   /* carried by the gradient all-reduce */
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "rank %d", p->rank);
    tdm_comm_abort(p->comm, tdm_error_message());
    return st;
}

/* Rank r evaluates its share of the windows; the sums are added. */
static tdm_status tdm_text_eval_ddp(tdm_text_proc *p, double *loss)
{
    const tdm_text_job *j = ((tdm_text_rank *)p)->j;
    int64_t K = j->eval_count;
    int64_t lo = K * p->rank / p->world, hi = K * (p->rank + 1) / p->world;
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

static int tdm_text_ddp_after(tdm_text_proc *p)
{
    /* rank 0 has saved its checkpoint when it gets here */
    tdm_status st = tdm_comm_barrier(p->comm);
    if (st) tdm_text_fail(p->rank, "end-of-epoch barrier", st);
    return st == TDM_STATUS_OK;
}

static int tdm_text_rank_main(tdm_comm *comm, void *arg)
{
    const tdm_text_job *j = arg;
    tdm_train_args a = *j->a;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm), rc = 1;
    tdm_device *dev = NULL;
    tdm_comm *nccl = NULL;
    tdm_text_rank r = {.j = j, .batch = (int)a.batch};
    tdm_text_proc *p = &r.p;
    tdm_status st;
    if (rank != 0) {
        int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            close(fd);
        }
        a.save = NULL;
        a.quiet = 1;
    }
    tdm_text_job jr = *j;
    jr.a = &a;
    r.j = &jr;
    p->rank = rank;
    p->world = world;
    p->comm = comm;
    p->lo = (int)((int64_t)rank * a.batch / world);
    p->hi = (int)((int64_t)(rank + 1) * a.batch / world);
    if (p->hi <= p->lo) {
        fprintf(stderr, "tandem train: rank %d: a global batch of %lld windows leaves no window "
                        "to %d ranks; use --batch >= %d\n", rank, a.batch, world, world);
        rc = 2;
        goto done;
    }
    if ((st = tdm_tool_rank_device(&j->dl, rank, &dev))) {
        tdm_text_fail(rank, "opening device", st);
        goto done;
    }
    if ((st = tdm_model_init(&p->m, dev, &j->spec, (uint64_t)a.seed))) {
        tdm_text_fail(rank, "building model", st);
        goto done;
    }
    tdm_ddp_opts o = {.bucket_cap_mb = a.bucket_cap_mb > 0 ? (double)a.bucket_cap_mb : 0,
                      .no_overlap = a.no_overlap};
    if ((st = tdm_tool_rank_ddp(comm, dev, p->m, &o, &nccl, &p->ddp))) {
        tdm_text_fail(rank, "ddp set-up", st);
        goto done;
    }
    if (!tdm_train_make_optim(&a, p->m, &p->opt)) goto done;
    int64_t start_epoch = 0;
    if (a.resume) {
        tdm_ckpt_info info;
        if ((st = tdm_ddp_checkpoint_load(p->ddp, a.resume, p->opt, &info))) {
            tdm_text_fail(rank, "resuming", st);
            goto done;
        }
        start_epoch = info.epoch;
        tdm_train_print_resumed(a.resume, &info);
    }
    char desc[128];
    snprintf(desc, sizeof desc, "%d processes on %s (%s communicator%s)", world, j->a->device,
             tdm_comm_backend_name(nccl ? nccl : comm),
             tdm_ddp_zero_copy(p->ddp) ? ", zero-copy buckets" : "");
    if (rank == 0) tdm_text_header(&jr, tdm_model_param_elems(p->m), desc);
    p->step = tdm_text_ddp_step;
    p->step_ctx = &r;
    p->eval = tdm_text_eval_ddp;
    p->after = tdm_text_ddp_after;
    if (!tdm_text_epochs(&jr, p, start_epoch)) goto done;
    if (rank == 0) {
        tdm_ddp_times t;
        tdm_ddp_get_times(p->ddp, &t);
        if (t.steps > 0) {
            double k = (double)t.steps;
            printf("ddp (rank 0 of %d, %d bucket%s, per step): forward %.3f ms, loss %.3f ms, "
                   "backward %.3f ms, all-reduce exposed %.3f ms, optimizer %.3f ms\n", world,
                   t.n_buckets, t.n_buckets == 1 ? "" : "s", t.total.ms[TDM_PHASE_FORWARD] / k,
                   t.total.ms[TDM_PHASE_LOSS] / k, t.total.ms[TDM_PHASE_BACKWARD] / k,
                   t.total.ms[TDM_PHASE_ALLREDUCE_WAIT] / k, t.total.ms[TDM_PHASE_STEP] / k);
        }
    }
    rc = 0;
done:
    if (rc) tdm_comm_abort(comm, "rank failed");
    fflush(stdout);
    tdm_ddp_free(p->ddp);
    tdm_comm_free(nccl);
    tdm_optim_free(p->opt);
    tdm_model_free(p->m);
    tdm_device_free(dev);
    return rc;
}

static int tdm_text_run_ddp(tdm_text_job *j)
{
    const tdm_train_args *a = j->a;
    tdm_status st;
    if (a->threads != 1)
        fprintf(stderr, "tandem train: note: --threads applies to --mode single; each DDP rank "
                        "computes on one thread\n");
    int launched = getenv("TANDEM_SHM_FD") && getenv("WORLD_SIZE");
    /* an MPI launcher's ranks (tools/mpi_job.h): as train --mode ddp's */
    int mpi = !launched && tdm_tool_mpi_launched();
    tdm_mpi_backend backend = TDM_MPI_BACKEND_AUTO;
    if (a->backend && !tdm_tool_backend_parse("train", a->backend, &backend)) return 2;
    if (!mpi && backend != TDM_MPI_BACKEND_AUTO && backend != TDM_MPI_BACKEND_SHM) {
        fprintf(stderr, "tandem train: --backend %s runs between the ranks of an MPI job: start "
                "them with `mpirun -np N tandem train --mode ddp --backend %s ...`\n",
                a->backend, a->backend);
        return 2;
    }
    if ((st = tdm_tool_parse_devices(&j->dl, a->device, !launched && !mpi))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? 1 : 2;
    }
    if (launched || mpi) {
        tdm_comm *comm = NULL;
        tdm_ddp_env env;
        tdm_tool_mpi_rank mr = {0};
        if (mpi) {
            if ((st = tdm_tool_mpi_rank_init(&mr, backend, 0, NULL))) {
                fprintf(stderr, "tandem train: joining the MPI job: %s\n", tdm_error_message());
                return 1;
            }
            comm = mr.comm;
            env = mr.env;
        } else if ((st = tdm_ddp_pg_init_from_env(&comm, &env))) {
            fprintf(stderr, "tandem train: joining the launched job: %s\n", tdm_error_message());
            return 1;
        }
        int rc = 2;
        int per_machine = mpi ? env.local_world_size : env.world_size;
        if (j->dl.count != 1 && j->dl.count != per_machine && j->dl.count != env.world_size) {
            fprintf(stderr, "tandem train: rank %d: --device '%s' names %d devices but the job "
                            "has %d ranks%s\n", env.rank, a->device, j->dl.count, per_machine,
                    mpi ? " on this machine" : "");
            tdm_comm_abort(comm, "bad --device");
        } else if (a->batch < env.world_size) {
            /* every rank sees it: no abort needed, rank 0 says it */
            if (env.rank == 0)
                fprintf(stderr, "tandem train: --batch %lld is smaller than the %d ranks: each "
                        "rank needs at least one window of every global batch\n", a->batch,
                        env.world_size);
        } else {
            if (j->dl.count == 1) j->dl.index[0] = env.local_rank;
            else j->dl.index[0] = j->dl.index[env.local_rank % j->dl.count];
            j->dl.count = 1;
            rc = tdm_text_rank_main(comm, j);
        }
        if (mpi) tdm_tool_mpi_rank_end(&mr, rc);
        else tdm_comm_free(comm);
        return rc;
    }
    if (a->batch < j->dl.count) {
        fprintf(stderr, "tandem train: --batch %lld is smaller than the %d ranks: each rank "
                        "needs at least one window of every global batch\n", a->batch,
                j->dl.count);
        return 2;
    }
    /* the zero-copy arena's size, from a probe on a host device */
    tdm_device *dev = NULL;
    tdm_model *probe = NULL;
    if ((st = tdm_device_open(&dev, "cpu", 0, 1)) ||
        (st = tdm_model_init(&probe, dev, &j->spec, (uint64_t)a->seed))) {
        fprintf(stderr, "tandem train: building model: %s\n", tdm_error_message());
        tdm_device_free(dev);
        return 1;
    }
    tdm_ddp_spawn_opts so = {.timeout_ms = INT64_MAX / 2000000, .comm_timeout_ms = 60000,
                             .arena_bytes = tdm_tool_ddp_arena_bytes(
                                 &j->dl, tdm_model_param_elems(probe))};
    tdm_model_free(probe);
    tdm_device_free(dev);
    fflush(stdout);
    st = tdm_ddp_spawn(j->dl.count, tdm_text_rank_main, j, &so, NULL);
    if (st) {
        fprintf(stderr, "tandem train: ddp: %s\n", tdm_error_message());
        return 1;
    }
    return 0;
}

int tdm_train_text_main(const tdm_train_args *a)
{
    tdm_text_job j = {.a = a};
    tdm_text_corpus corpus;
    tdm_status st;
    int rc;
    if ((st = tdm_model_spec_parse(&j.spec, a->model)) != TDM_STATUS_OK) {
        tdm_train_fail("--model", st);
        return 2;
    }
    if (strcmp(a->mode, "single") && strcmp(a->mode, "dp") && strcmp(a->mode, "ddp")) {
        fprintf(stderr, "tandem train: --mode '%s': expected single, dp or ddp\n", a->mode);
        return 2;
    }
    if (a->data && !strcmp(a->data, "synthetic")) {
        fprintf(stderr, "tandem train: --data synthetic makes images; a gpt trains on text: "
                        "--data FILE (any bytes) or a fortunes directory [default: Debian's "
                        "fortunes in %s]\n", TDM_TEXT_FORTUNES_DEFAULT_DIR);
        return 2;
    }
    if ((st = tdm_text_load(&corpus, a->data)) != TDM_STATUS_OK) {
        tdm_train_fail("loading text", st);
        return 1;
    }
    if ((st = tdm_text_check_context(&corpus, j.spec.n_ctx)) != TDM_STATUS_OK) {
        tdm_train_fail("--model", st);
        tdm_text_free(&corpus);
        return 2;
    }
    j.corpus = &corpus;
    j.eval_count = tdm_text_eval_count(&corpus.val, j.spec.n_ctx, TDM_TEXT_EVAL_CAP);
    if ((st = tdm_text_bigram_loss(&corpus.train, &corpus.val, j.spec.n_ctx, TDM_TEXT_EVAL_CAP,
                                   &j.bigram)) != TDM_STATUS_OK) {
        tdm_train_fail("bigram baseline", st);
        tdm_text_free(&corpus);
        return 1;
    }
    rc = !strcmp(a->mode, "ddp") ? tdm_text_run_ddp(&j) : tdm_text_run_local(&j);
    tdm_text_free(&corpus);
    return rc;
}
