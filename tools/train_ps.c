/* tools/train_ps.c: `tandem train --mode ps`: a parameter server (ps/)
 * over rpc/, its ranks run by dist/run.h like every multi-process mode
 * (forked, one per device of --device cpu:N). Ranks 0..S-1 (--servers S)
 * are servers, each owning a shard of the flat parameters and of the
 * optimizer state; the other N-S ranks are workers, each holding a
 * replica of the model. Every epoch visits the same global batches as
 * --mode single and ddp (tdm_train_epoch over tdm_train_epoch_order);
 * worker w takes rows [w*B/W, (w+1)*B/W) of each (tdm_dist_share_rows;
 * a gpt's worker draws those windows of each global batch itself,
 * tdm_train_text_epoch, as a DDP rank does),
 * pulls the parameters as fresh as --ps-sync needs, pushes its gradient
 * (the loss scaled by 1/B) to the servers, which sum and step (sync,
 * bounded:K) or step on each push (async).
 *
 * Rank 0 (server 0) speaks for the job: each worker reports its epoch's
 * loss sum and samples to it (tool.ps.report) and it prints the epoch's
 * line once every worker still alive has; after the last epoch it
 * gathers every server's shard of the parameters and optimizer state,
 * evaluates the test set (a gpt: the validation windows), writes --save (the one safetensors file every
 * mode reads) and prints each server's traffic per step and the
 * staleness of the gradients it applied. Other servers wait for rank 0
 * to release them (tool.ps.finish, whose reply carries their figures).
 *
 * Faults: in async mode a worker's death stops nobody (dist's
 * outlive_failures): the servers go on with the others, the job
 * finishes, and the CLI names the lost worker and exits 0, unless no
 * worker finished (exit 1). A worker whose step fails (a NaN loss, a
 * push refused) tells the servers why (tdm_ps_worker_fail) and the job
 * stops with that error in every mode, as DDP does. In sync and
 * bounded mode the servers stop, naming it; a server's death stops the
 * job with its name (dist's watch). Test hook: TANDEM_PS_TEST_KILL=
 * worker:W:S makes worker W SIGKILL itself before its step S (from 1),
 * server:I:S server I once it has applied S updates (server:I:S:STOP:
 * SIGSTOP instead: a server alive that serves nothing). A failed job's
 * flight-recorder dumps (the RPC endpoints' too, rpc/rpc_fr.c) end with
 * `tandem doctor`'s verdict, as DDP's (tools/elastic.c's watch).
 * TANDEM_PS_LOSS_LOG=DIR (what `tandem compare` sets, tools/compare_ps.c):
 * worker W writes DIR/ps_loss_w<W>.txt, a line per step: the step (from
 * 1) and the loss summed over its share; the shares' sums over B are the
 * global batch's mean loss.
 *
 * Not built: --model cnn, GPUs, --resume, --max-restarts,
 * --grad-accum, the memory levers. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "core/timer.h"
#include "dist/batch.h"
#include "dist/run.h"
#include "dist/timeout.h"
#include "models/checkpoint.h"
#include "models/train.h"
#include "models/train_text.h"
#include "ps/ps.h"
#include "rpc/rpc.h"
#include "tools/doctor.h"
#include "tools/elastic.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

#define PS_FN_REPORT "tool.ps.report"
#define PS_FN_FINISH "tool.ps.finish"
/* The evaluation batch (as the other modes'). */
#define PS_EVAL_BATCH 1000

typedef struct ps_report {
    int32_t worker, reserved;
    int64_t epoch;
    double loss_sum;
    int64_t samples;
    double seconds;
} ps_report;

/* What a server sends rank 0 when released. */
typedef struct ps_figures {
    tdm_ps_server_stats st;
    tdm_rpc_stats rpc;
} ps_figures;

/* Shared by the parent and (copied by fork) its ranks; `done` lives in
 * shared memory: the servers' verdict, read by the parent. */
typedef struct ps_job {
    const tdm_train_args *a;
    tdm_model_spec spec;
    tdm_dataset train, test;          /* the image models' */
    const tdm_train_text_set *text;   /* a gpt's; NULL: the image models */
    tdm_ps_sync_mode mode;
    tdm_rpc_transport tp;
    tdm_optim_opts optim;
    int servers, workers;
    int kill_worker, kill_server;     /* test hook; -1: none */
    int kill_sig;                     /* SIGKILL, or SIGSTOP (server:I:S:STOP) */
    int64_t kill_step;
    struct ps_shared {
        int servers_ok;           /* every server finished its work */
        char lost[512];           /* the workers async lost, as rank 0 saw them */
        char failed[600];         /* why a server stopped, as the first saw it */
    } *shared;
} ps_job;

typedef struct ps_epoch {
    double loss_sum, seconds;
    int64_t samples;
    int reports;
    int printed;
} ps_epoch;

typedef struct ps_rank {
    ps_job *j;
    tdm_dist_rank *d;
    int rank;
    tdm_model *m;
    tdm_rpc *rpc;
    tdm_ps_server *srv;
    tdm_ps_worker *wk;
    tdm_ps_layout l;
    /* rank 0: the epochs' reports */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ps_epoch *ep;
    int reported[TDM_RPC_MAX_RANKS];   /* per worker: epochs reported */
    /* other servers: released by rank 0 */
    int finished;
    /* a worker's tally of the epoch */
    double loss_sum;
    int64_t samples, steps;
    FILE *loss_log;                   /* TANDEM_PS_LOSS_LOG's file; NULL: none */
} ps_rank;

/* ---- rank 0's epoch lines ---- */

/* Prints every epoch all live workers have reported (mu held). */
static void ps_print_ready(ps_rank *p, int final)
{
    const tdm_train_args *a = p->j->a;
    for (int64_t e = 0; e < a->epochs; e++) {
        ps_epoch *ep = &p->ep[e];
        if (ep->printed) continue;
        int alive = 0;
        for (int w = 0; w < p->l.workers; w++) {
            char why[160];
            if (p->reported[w] > e || tdm_rpc_peer_alive(p->rpc, p->l.servers + w, why, sizeof why)) alive++;
        }
        if (ep->reports < alive && !final) return;
        if (ep->reports == 0) return;
        double sps = ep->seconds > 0 ? (double)ep->samples / ep->seconds : 0;
        char rate[96];
        if (p->j->text)   /* a gpt's unit: windows of T tokens */
            snprintf(rate, sizeof rate, "%.0f windows/s = %.0f tokens/s", sps, sps * p->j->text->T);
        else
            snprintf(rate, sizeof rate, "%.0f samples/s", sps);
        printf("epoch %lld/%lld: train loss %.4f, %s (%.1f s)%s\n", (long long)e + 1, (long long)a->epochs,
               ep->loss_sum / (double)ep->samples, rate, ep->seconds,
               ep->reports < p->l.workers ? " (without the lost workers)" : "");
        fflush(stdout);
        ep->printed = 1;
    }
}

static tdm_status ps_fn_report(tdm_rpc_req *req, void *ctx)
{
    ps_rank *p = ctx;
    ps_report r;
    if (req->nbytes != sizeof r) return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "report: %zu bytes", req->nbytes);
    memcpy(&r, req->args, sizeof r);
    if (r.worker < 0 || r.worker >= p->l.workers || r.epoch < 0 || r.epoch >= p->j->a->epochs)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "report: worker %d epoch %lld", r.worker,
                                (long long)r.epoch);
    pthread_mutex_lock(&p->mu);
    ps_epoch *ep = &p->ep[r.epoch];
    ep->loss_sum += r.loss_sum;
    ep->samples += r.samples;
    if (r.seconds > ep->seconds) ep->seconds = r.seconds;
    ep->reports++;
    p->reported[r.worker] = (int)r.epoch + 1;
    ps_print_ready(p, 0);
    pthread_mutex_unlock(&p->mu);
    return TDM_STATUS_OK;
}

static tdm_status ps_fn_finish(tdm_rpc_req *req, void *ctx)
{
    ps_rank *p = ctx;
    ps_figures *f = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, sizeof *f, (void **)&f));
    memset(f, 0, sizeof *f);
    tdm_ps_server_get_stats(p->srv, &f->st);
    tdm_rpc_get_stats(p->rpc, &f->rpc);
    pthread_mutex_lock(&p->mu);
    p->finished = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return TDM_STATUS_OK;
}

/* ---- set-up ---- */

static void ps_rank_free(void *ctx, void *self)
{
    (void)ctx;
    ps_rank *p = self;
    if (!p) return;
    tdm_rpc_free(p->rpc);   /* its threads stop before what they use goes */
    if (p->loss_log) fclose(p->loss_log);
    tdm_ps_server_free(p->srv);
    tdm_ps_worker_free(p->wk);
    tdm_model_free(p->m);
    free(p->ep);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static tdm_status ps_rank_setup(void *ctx, tdm_dist_rank *d, void **self)
{
    ps_job *j = ctx;
    ps_rank *p = calloc(1, sizeof *p);
    TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", d->env.rank);
    *self = p;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->j = j;
    p->d = d;
    p->rank = d->env.rank;
    tdm_dist_silence(p->rank, NULL);
    p->ep = calloc((size_t)j->a->epochs, sizeof *p->ep);
    TDM_REQUIRE(p->ep, TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", p->rank);
    TDM_CHECK(tdm_model_init(&p->m, d->dev, &j->spec, (uint64_t)j->a->seed));
    /* a peer that stops reading fails a send after the process group's
     * timeout, as a collective would */
    tdm_rpc_opts ro = {.transport = j->tp, .comm = d->comm, .setup_ms = d->timeout_ms,
                       .send_stall_ms = d->timeout_ms};
    TDM_CHECK(tdm_rpc_init(&p->rpc, &ro));
    p->l = (tdm_ps_layout){.servers = j->servers, .workers = j->workers,
                           .n_elem = tdm_model_param_elems(p->m)};
    if (p->rank < j->servers) {
        TDM_CHECK(tdm_ps_server_init(&p->srv, p->rpc, d->dev, &p->l, &j->mode, &j->optim,
                                     tdm_model_params(p->m)));
        if (p->rank == 0) TDM_CHECK(tdm_rpc_register(p->rpc, PS_FN_REPORT, ps_fn_report, p));
        else TDM_CHECK(tdm_rpc_register(p->rpc, PS_FN_FINISH, ps_fn_finish, p));
    } else {
        TDM_CHECK(tdm_ps_worker_init(&p->wk, p->rpc, p->m, &p->l, &j->mode, d->timeout_ms));
    }
    return tdm_rpc_barrier(p->rpc, d->timeout_ms);
}

/* ---- a worker ---- */

static tdm_status ps_worker_step(void *ctx, const void *x, const int32_t *y, int batch, double *loss_mean)
{
    ps_rank *p = ctx;
    const void *xs = NULL;
    const int32_t *ys = NULL;
    int n = 0;
    int w = p->rank - p->l.servers;
    if (w == p->j->kill_worker && p->steps + 1 == p->j->kill_step) {
        fprintf(stderr, "tandem train: worker %d (rank %d): test hook: SIGKILL before step %lld\n", w, p->rank,
                (long long)p->steps + 1);
        raise(SIGKILL);
    }
    int global = batch;
    if (p->j->text) {
        /* a gpt's worker drew its own windows of the global batch */
        xs = x;
        ys = y;
        n = batch;
        global = (int)p->j->a->batch;
    } else {
        tdm_dist_share_rows(x, y, batch, w, p->l.workers, tdm_model_in_features(p->m), tdm_model_out_rows(p->m),
                            &xs, &ys, &n);
    }
    double loss_sum = 0;
    TDM_CHECK(tdm_ps_worker_step(p->wk, xs, ys, n, global, &loss_sum));
    p->loss_sum += loss_sum;
    p->samples += n;
    p->steps++;
    if (p->loss_log) fprintf(p->loss_log, "%lld %.17g\n", (long long)p->steps, loss_sum);
    /* the epoch loop checks a finite loss: this share's mean */
    *loss_mean = n ? loss_sum / n : 0.0;
    return TDM_STATUS_OK;
}

static tdm_status ps_run_worker(ps_rank *p)
{
    const tdm_train_args *a = p->j->a;
    int w = p->rank - p->l.servers;
    const char *log = getenv("TANDEM_PS_LOSS_LOG");
    if (log && *log) {
        char path[4096];
        snprintf(path, sizeof path, "%s/ps_loss_w%d.txt", log, w);
        p->loss_log = fopen(path, "w");
        if (!p->loss_log)
            return tdm_error_set(TDM_STATUS_IO, "worker %d: TANDEM_PS_LOSS_LOG: %s: %s", w, path, strerror(errno));
    }
    for (int64_t e = 0; e < a->epochs; e++) {
        p->loss_sum = 0;
        p->samples = 0;
        uint64_t t0 = tdm_time_ns();
        tdm_train_epoch_opts eo = {.batch = (int)a->batch, .seed = (uint64_t)a->seed, .epoch = e,
                                   .max_steps = a->max_steps, .step = ps_worker_step, .step_ctx = p};
        tdm_epoch_stats es;
        tdm_status st;
        if (p->j->text) {
            int64_t lo, hi;
            tdm_dist_share(a->batch, w, p->l.workers, &lo, &hi);
            st = tdm_train_text_epoch(&p->j->text->corpus->train, p->j->text->T, (int)lo, (int)hi, &eo, &es);
        } else {
            st = tdm_train_epoch(&p->j->train, &eo, &es);
        }
        if (st != TDM_STATUS_OK) {
            /* the servers stop the job with this error: a worker that
             * just leaves would read as a killed one, which async outlives */
            char why[400];
            snprintf(why, sizeof why, "%s", tdm_error_message());
            tdm_ps_worker_fail(p->wk, why);
            return tdm_error_set(st, "%s", why);
        }
        ps_report r = {.worker = w, .epoch = e, .loss_sum = p->loss_sum, .samples = p->samples,
                       .seconds = (double)(tdm_time_ns() - t0) / 1e9};
        TDM_CHECK(tdm_rpc_call(p->rpc, 0, PS_FN_REPORT, &r, sizeof r, NULL, NULL, p->d->timeout_ms));
    }
    return tdm_ps_worker_done(p->wk);
}

/* ---- rank 0 after training ---- */

static void ps_print_server(int s, const ps_figures *f, int64_t steps)
{
    double per = steps > 0 ? (double)steps : 1.0;
    printf("  server %d: %.1f KiB in, %.1f KiB out per step (%lld pushes, %lld pulls, %lld too early); "
           "staleness", s, (double)f->rpc.bytes_recv / per / 1024.0, (double)f->rpc.bytes_sent / per / 1024.0,
           (long long)f->st.pushes, (long long)f->st.pulls, (long long)f->st.pulls_early);
    for (int b = 0; b < TDM_PS_STALE_BUCKETS; b++)
        if (f->st.stale[b])
            printf(" %s%d:%lld", b == TDM_PS_STALE_BUCKETS - 1 ? ">=" : "", b, (long long)f->st.stale[b]);
    printf("\n");
}

static tdm_status ps_finish_rank0(ps_rank *p)
{
    const tdm_train_args *a = p->j->a;
    int64_t timeout = p->d->timeout_ms;
    int64_t n = p->l.n_elem;
    tdm_ckpt_host h = {.optim = &p->j->optim};
    int ns = tdm_optim_kind_n_state(&p->j->optim);
    h.params = malloc((size_t)n * sizeof(float));
    for (int i = 0; i < ns; i++) h.state[i] = malloc((size_t)n * sizeof(float));
    tdm_status st = TDM_STATUS_OK;
    if (!h.params || (ns > 0 && !h.state[0]) || (ns > 1 && !h.state[1])) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rank 0: no memory for the gathered state");
        goto done;
    }
    TDM_TRY(tdm_ps_gather(p->rpc, &p->l, h.params, h.state, ns, &h.steps, timeout));
    memcpy(tdm_model_params(p->m), h.params, (size_t)n * sizeof(float));
    if (!a->no_eval && p->j->text) {
        double loss = 0;
        const tdm_train_text_set *t = p->j->text;
        TDM_TRY(tdm_train_text_evaluate(p->m, &t->corpus->val, t->eval_count, TDM_TRAIN_TEXT_EVAL_BATCH, &loss));
        printf("validation loss %.4f nats per byte (%.3f bits; a bigram model: %.4f)\n", loss, loss / log(2.0),
               t->bigram);
    } else if (!a->no_eval) {
        double loss = 0, acc = 0;
        TDM_TRY(tdm_evaluate(p->m, &p->j->test, PS_EVAL_BATCH, &loss, &acc));
        printf("test loss %.4f, test accuracy %.4f\n", loss, acc);
    }
    if (a->save) {
        h.buffers = tdm_model_buffer_elems(p->m) ? tdm_model_buffers(p->m) : NULL;
        tdm_ckpt_info info = {.step = h.steps, .epoch = a->epochs, .seed = (uint64_t)a->seed};
        TDM_TRY(tdm_checkpoint_save_host(a->save, p->m, &h, &info));
        printf("  saved %s (epoch %lld, step %lld)\n", a->save, (long long)a->epochs, (long long)h.steps);
    }
    {
        char mode[32];
        printf("ps: %d server%s, %d worker%s, %s, rpc over %s\n", p->l.servers, p->l.servers == 1 ? "" : "s",
               p->l.workers, p->l.workers == 1 ? "" : "s", tdm_ps_sync_str(&p->j->mode, mode, sizeof mode),
               tdm_rpc_transport_name(p->j->tp));
        int64_t steps = p->j->mode.kind == TDM_PS_ASYNC ? h.steps / (p->l.workers ? p->l.workers : 1) : h.steps;
        ps_figures f;
        memset(&f, 0, sizeof f);
        tdm_ps_server_get_stats(p->srv, &f.st);
        tdm_rpc_get_stats(p->rpc, &f.rpc);
        ps_print_server(0, &f, steps);
        for (int s = 1; s < p->l.servers; s++) {
            void *rep = NULL;
            size_t rn = 0;
            TDM_TRY(tdm_rpc_call(p->rpc, s, PS_FN_FINISH, NULL, 0, &rep, &rn, timeout));
            if (rn == sizeof f) {
                memcpy(&f, rep, sizeof f);
                ps_print_server(s, &f, steps);
            }
            free(rep);
        }
    }
done:
fail:
    tdm_ckpt_host_free(&h);
    return st;
}

/* ---- the rank's work ---- */

static tdm_status ps_rank_run(void *ctx, tdm_dist_rank *d, void *self)
{
    ps_job *j = ctx;
    ps_rank *p = self;
    (void)d;
    if (p->wk) return ps_run_worker(p);
    int lost = 0;
    char why[512];
    if (p->rank == j->kill_server) {
        /* the test hook: watch the updates, then die */
        tdm_ps_server_stats s;
        do {
            tdm_ps_server_get_stats(p->srv, &s);
            if (s.version >= j->kill_step) {
                fprintf(stderr, "tandem train: server %d (rank %d): test hook: %s after %lld updates\n",
                        p->rank, p->rank, j->kill_sig == SIGSTOP ? "SIGSTOP" : "SIGKILL", (long long)s.version);
                raise(j->kill_sig);
            }
            nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        } while (s.workers_done < p->l.workers);
    }
    tdm_status ws = tdm_ps_server_wait(p->srv, -1, &lost, why, sizeof why);
    if (ws != TDM_STATUS_OK) {
        /* the parent names this cause, not only the first rank that died */
        if (!j->shared->failed[0])
            snprintf(j->shared->failed, sizeof j->shared->failed, "%s", tdm_error_message());
        return ws;
    }
    if (p->rank != 0) {
        /* rank 0 gathers this shard, then releases it */
        pthread_mutex_lock(&p->mu);
        while (!p->finished) {
            char w0[160];
            if (!tdm_rpc_peer_alive(p->rpc, 0, w0, sizeof w0)) {
                pthread_mutex_unlock(&p->mu);
                return tdm_error_set(TDM_STATUS_PEER_FAILED, "server %d: rank 0 %s", p->rank, w0);
            }
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&p->cv, &p->mu, &ts);
        }
        pthread_mutex_unlock(&p->mu);
        return TDM_STATUS_OK;
    }
    pthread_mutex_lock(&p->mu);
    ps_print_ready(p, 1);
    pthread_mutex_unlock(&p->mu);
    if (lost) snprintf(j->shared->lost, sizeof j->shared->lost, "%s", why);
    TDM_CHECK(ps_finish_rank0(p));
    j->shared->servers_ok = 1;
    return TDM_STATUS_OK;
}

/* ---- the command ---- */

/* tools/elastic.c's watch (the flight-recorder dumps and the doctor's
 * verdict of a failed job), except that an async job that lost a worker
 * and finished is no failure: its dumps are removed as a good run's. The
 * elastic watch comes first: the hooks' ctx is either. */
typedef struct ps_watch {
    tdm_elastic_watch w;
    void (*elastic_end)(void *ctx, tdm_status st, int world, const tdm_shm_spawn_result *res, int last);
    const ps_job *j;
} ps_watch;

static void ps_watch_end(void *ctx, tdm_status st, int world, const tdm_shm_spawn_result *res, int last)
{
    ps_watch *pw = ctx;
    if (st != TDM_STATUS_OK && pw->j->mode.kind == TDM_PS_ASYNC && pw->j->shared->servers_ok) {
        tdm_doctor_job_end(&pw->w.frj, 0, world, NULL, NULL, NULL, NULL);
        return;
    }
    pw->elastic_end(ctx, st, world, res, last);
}

static tdm_status ps_check(const tdm_train_args *a, ps_job *j, const tdm_device_list *dl)
{
    if (strcmp(a->model, "mlp") && strncmp(a->model, "mlp:", 4) && !j->text)
        return tdm_tool_usage_error("tandem train: --mode ps trains --model mlp or gpt (the CNN's batchnorm "
                                    "buffers would differ per worker)\n");
    if (a->resume || a->max_restarts || a->grad_accum > 1 || a->deterministic || a->uneven || a->sync_bn ||
        a->precision || a->ckpt || a->offload || a->clip_grad_norm > 0 || a->comm_hook)
        return tdm_tool_usage_error("tandem train: --mode ps takes none of --resume, --max-restarts, "
                                    "--grad-accum, --deterministic, --uneven, --sync-bn, --comm-hook and the "
                                    "memory levers\n");
    if (tdm_ps_sync_parse(a->ps_sync ? a->ps_sync : "sync", &j->mode))
        return tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
    if (j->mode.kind == TDM_PS_ASYNC && a->optim && !strcmp(a->optim, "adamw"))
        return tdm_tool_usage_error("tandem train: --optim adamw with --ps-sync async would take a whole Adam "
                                    "step (and its weight decay) per push, W per global step: use --optim sgd, "
                                    "or --ps-sync sync or bounded:K\n");
    if (tdm_rpc_transport_parse(a->ps_transport ? a->ps_transport : "shm", &j->tp))
        return tdm_tool_usage_error("tandem train: --ps-transport: %s\n", tdm_error_message());
    j->servers = a->servers > 0 ? (int)a->servers : 1;
    if (dl->kind != TDM_DEVICE_HOST)
        return tdm_tool_usage_error("tandem train: --mode ps runs on host devices (cpu:N), not %s\n",
                                    a->device);
    if (dl->count < j->servers + 1)
        return tdm_tool_usage_error("tandem train: --servers %d needs at least %d devices (the servers and "
                                    "a worker); --device %s has %d\n", j->servers, j->servers + 1, a->device,
                                    dl->count);
    j->workers = dl->count - j->servers;
    if (a->batch < j->workers)
        return tdm_tool_usage_error("tandem train: --batch %lld is smaller than the %d workers: each needs a "
                                    "sample of every global batch\n", a->batch, j->workers);
    return TDM_STATUS_OK;
}

tdm_status tdm_train_run_ps(const tdm_train_args *a, const tdm_model_spec *spec, const tdm_train_text_set *text)
{
    ps_job j = {.a = a, .text = text, .kill_worker = -1, .kill_server = -1, .kill_sig = SIGKILL};
    tdm_device_list dl;
    tdm_status st;
    if (spec) j.spec = *spec;
    else if (tdm_model_spec_parse(&j.spec, a->model))
        return tdm_tool_usage_error("tandem train: --model: %s\n", tdm_error_message());
    if ((st = tdm_dist_parse_devices(&dl, a->device, 1))) {
        fprintf(stderr, "tandem train: --device: %s\n", tdm_error_message());
        return st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st);
    }
    TDM_CHECK(ps_check(a, &j, &dl));
    tdm_optim_opts_named(&j.optim, a->optim, a->lr, a->weight_decay, a->momentum, a->nesterov);
    const char *kill = getenv("TANDEM_PS_TEST_KILL");
    long long ks = 0;
    int who = -1;
    if (kill && sscanf(kill, "worker:%d:%lld", &who, &ks) == 2 && ks >= 1) j.kill_worker = who;
    else if (kill && sscanf(kill, "server:%d:%lld", &who, &ks) == 2 && ks >= 1) j.kill_server = who;
    if (kill && j.kill_server >= 0 && strstr(kill, ":STOP")) j.kill_sig = SIGSTOP;
    j.kill_step = ks;
    TDM_CHECK(tdm_train_load_and_probe(a, &j.spec, text ? NULL : &j.train, text ? NULL : &j.test, NULL));
    j.shared = mmap(NULL, sizeof *j.shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (j.shared == MAP_FAILED) {
        tdm_data_free(&j.train);
        tdm_data_free(&j.test);
        return tdm_train_fail("mmap", tdm_error_set(TDM_STATUS_SYSTEM, "shared memory for the job's verdict"));
    }
    memset(j.shared, 0, sizeof *j.shared);
    char mode[32];
    printf("tandem train: %s, --mode ps: %d server%s, %d worker%s (%s), %s over %s\n", text ? "gpt" : "mlp",
           j.servers, j.servers == 1 ? "" : "s", j.workers, j.workers == 1 ? "" : "s", a->device,
           tdm_ps_sync_str(&j.mode, mode, sizeof mode), tdm_rpc_transport_name(j.tp));
    fflush(stdout);
    tdm_dist_design d = {.name = "ps", .setup = ps_rank_setup, .run = ps_rank_run, .free = ps_rank_free};
    ps_watch pw;
    tdm_elastic_watch_init(&pw.w, "tandem train", "ps", 0);
    pw.elastic_end = pw.w.dist.end;
    pw.w.dist.end = ps_watch_end;
    pw.j = &j;
    tdm_dist_run_opts o = {.devices = &dl, .spec = a->device, .watch = &pw.w.dist,
                           .outlive_failures = j.mode.kind == TDM_PS_ASYNC};
    if (a->timeout && tdm_dist_timeout_parse("--timeout", a->timeout, &o.timeout_ms)) {
        st = tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
        goto done;
    }
    st = tdm_dist_run(&d, &j, &o);
    if (st != TDM_STATUS_OK && j.mode.kind == TDM_PS_ASYNC && j.shared->servers_ok) {
        /* a lost worker is a property of the design, not a failure */
        fprintf(stderr, "tandem train: %s; async training finished with the other workers\n",
                j.shared->lost[0] ? j.shared->lost : tdm_error_message());
        st = TDM_STATUS_OK;
    } else if (st != TDM_STATUS_OK && j.shared->failed[0] && !strstr(tdm_error_message(), j.shared->failed)) {
        /* the watch said the run's error ("tandem train: ps: ...") */
        fprintf(stderr, "tandem train: %s (%s)\n", j.shared->failed, tdm_error_message());
    }
done:
    munmap(j.shared, sizeof *j.shared);
    tdm_data_free(&j.train);
    tdm_data_free(&j.test);
    return st;
}
