/* tests/test_ps.c: the parameter server (ps/) in forked ranks over rpc/:
 *  - sync gives, bit for bit, the step computed here in one process on
 *    the same global batch in the server's order (each worker's gradient
 *    of its share with the loss scaled by 1/B, summed in worker order,
 *    one optimizer step over the flat parameters), for 1-2 servers and 2-3
 *    workers (3..5 ranks), over shm and TCP;
 *  - bounded:0 gives the same bits; bounded:2 with worker 0 slow (a
 *    sleep per step): pushes 1..2 stale, pulls answered "not yet", the
 *    workers never more than 2 steps apart, staleness never above 2;
 *  - async applies every push (W per step), and its training loss falls;
 *  - a worker killed mid-run: async goes on with the others and finishes;
 *    sync stops, the server naming the worker.
 * The MLP is small (32-24-10) and the data synthetic. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/data.h"
#include "ps/ps.h"
#include "ps/ps_impl.h"
#include "shm/spawn.h"
#include "tests/timeout_util.h"

#define MAX_RANKS 8
#define MAX_ELEMS 4096
#define MAX_STEPS 64
#define BATCH 12
#define FEATURES 32

typedef struct ps_out {
    int status[MAX_RANKS];
    char err[MAX_RANKS][600];
    float params[MAX_ELEMS];          /* the servers' final shards */
    tdm_ps_server_stats stats[MAX_RANKS];
    int lost[MAX_RANKS];
    int64_t gathered_steps;           /* rank 0's tdm_ps_gather, when asked */
    volatile int gathered;
    double loss[MAX_RANKS][MAX_STEPS];
} ps_out;

typedef struct ps_case {
    int servers, workers, steps;
    tdm_rpc_transport tp;
    tdm_ps_sync_mode mode;
    int kill_worker;                  /* >= 0: this worker dies at step kill_step */
    int kill_step;
    int slow_worker;                  /* >= 0: this worker sleeps slow_us per step */
    int slow_us;
    int kill_between_pushes;          /* the killed worker pushes to server 0 only, then dies */
    int gather;                       /* rank 0 gathers after the wait (others wait for it) */
    ps_out *o;
} ps_case;

static const int dims[] = {FEATURES, 24, 10};

static int64_t tmo(void) { return tu_scaled_ms(60000); }

static void optim_opts(tdm_optim_opts *o) { tdm_optim_opts_named(o, "sgd", 0.05, 0.0, 0.9, 0); }

static tdm_status load(tdm_dataset *ds)
{
    return tdm_data_synthetic(ds, 96, 1, 4, 8, 10, 11, 0);
}

/* Step t's share of worker w: rows [*first, *first + *count). */
static void share(int t, int w, int W, int64_t n, int64_t *first, int *count)
{
    int b = BATCH / W;
    *first = ((int64_t)t * BATCH + (int64_t)w * b) % n;
    *count = b;
}

static int fail(ps_out *o, int r, int code, const char *what)
{
    snprintf(o->err[r], sizeof o->err[r], "%s: %s", what, tdm_error_message());
    o->status[r] = code;
    return code;
}

static int ps_rank(tdm_comm *comm, void *arg)
{
    ps_case *k = arg;
    ps_out *o = k->o;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_rpc *rpc = NULL;
    tdm_dataset ds = {0};
    if (tdm_device_open(&dev, "cpu", 0, 1) || tdm_mlp_init(&m, dev, dims, 3, 5) || load(&ds))
        return fail(o, r, 1, "setup");
    tdm_rpc_opts ro = {.transport = k->tp, .comm = comm, .setup_ms = tmo()};
    if (tdm_rpc_init(&rpc, &ro)) return fail(o, r, 2, "rpc");
    tdm_ps_layout l = {.servers = k->servers, .workers = k->workers, .n_elem = tdm_model_param_elems(m)};
    if (r < k->servers) {
        tdm_ps_server *s = NULL;
        tdm_optim_opts oo;
        optim_opts(&oo);
        if (tdm_ps_server_init(&s, rpc, dev, &l, &k->mode, &oo, tdm_model_params(m)))
            return fail(o, r, 3, "server");
        if (tdm_rpc_barrier(rpc, tmo())) return fail(o, r, 4, "barrier");
        if (tdm_ps_server_wait(s, tmo(), &o->lost[r], NULL, 0)) return fail(o, r, 5, "server wait");
        if (k->gather && r == 0) {
            static float all[MAX_ELEMS];
            if (tdm_ps_gather(rpc, &l, all, NULL, 0, &o->gathered_steps, tmo())) return fail(o, r, 11, "gather");
            __atomic_store_n(&o->gathered, 1, __ATOMIC_RELEASE);
        }
        while (k->gather && !__atomic_load_n(&o->gathered, __ATOMIC_ACQUIRE)) usleep(1000);
        int64_t lo, hi;
        const float *p = tdm_ps_server_params(s, &lo, &hi);
        memcpy(o->params + lo, p, (size_t)(hi - lo) * sizeof(float));
        tdm_ps_server_get_stats(s, &o->stats[r]);
        tdm_rpc_free(rpc);
        tdm_ps_server_free(s);
    } else {
        int w = r - k->servers;
        tdm_ps_worker *pw = NULL;
        if (tdm_ps_worker_init(&pw, rpc, m, &l, &k->mode, tmo())) return fail(o, r, 6, "worker");
        if (tdm_rpc_barrier(rpc, tmo())) return fail(o, r, 7, "barrier");
        for (int t = 0; t < k->steps; t++) {
            if (w == k->kill_worker && t == k->kill_step && k->kill_between_pushes) {
                /* its step's push reaches server 0 only (server.c's wire) */
                int64_t lo, hi;
                tdm_ps_shard(&l, 0, &lo, &hi);
                size_t nb = sizeof(tdm_ps_push_hdr) + (size_t)(hi - lo) * sizeof(float);
                uint8_t *msg = calloc(1, nb);
                tdm_ps_push_hdr h = {.worker = w, .clock = t, .version_used = 0};
                memcpy(msg, &h, sizeof h);
                if (!msg || tdm_rpc_call(rpc, 0, "ps.push", msg, nb, NULL, NULL, tmo())) return fail(o, r, 10, "push");
                free(msg);
                raise(SIGKILL);
            }
            if (w == k->kill_worker && t == k->kill_step) raise(SIGKILL);
            if (w == k->slow_worker && k->slow_us > 0) usleep((useconds_t)k->slow_us);
            int64_t first;
            int count;
            share(t, w, k->workers, ds.n, &first, &count);
            if (tdm_ps_worker_step(pw, ds.x + first * FEATURES, ds.y + first, count, BATCH, &o->loss[r][t]))
                return fail(o, r, 8, "step");
        }
        if (tdm_ps_worker_done(pw)) return fail(o, r, 9, "done");
        tdm_ps_worker_free(pw);
        tdm_rpc_free(rpc);
    }
    tdm_model_free(m);
    tdm_device_free(dev);
    tdm_data_free(&ds);
    o->status[r] = 0;
    return 0;
}

/* The sync step of the servers, in one process: the reference. */
static void reference(int W, int steps, float *out, int64_t *n_out)
{
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dataset ds = {0};
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), 0);
    cr_assert_eq(tdm_mlp_init(&m, dev, dims, 3, 5), 0);
    cr_assert_eq(load(&ds), 0);
    int64_t n = tdm_model_param_elems(m);
    cr_assert_leq(n, MAX_ELEMS);
    tdm_optim_opts oo;
    optim_opts(&oo);
    cr_assert_eq(tdm_optim_init_flat(&opt, dev, n, &oo), 0);
    float *P = malloc((size_t)n * sizeof *P), *acc = malloc((size_t)n * sizeof *acc);
    memcpy(P, tdm_model_params(m), (size_t)n * sizeof *P);
    for (int t = 0; t < steps; t++) {
        for (int w = 0; w < W; w++) {
            int64_t first;
            int count;
            double loss;
            share(t, w, W, ds.n, &first, &count);
            memcpy(tdm_model_params(m), P, (size_t)n * sizeof *P);
            cr_assert_eq(tdm_model_zero_grad(m), 0);
            const float *logits = NULL;
            float *dl = NULL;
            cr_assert_eq(tdm_model_forward(m, ds.x + first * FEATURES, count, &logits), 0);
            dl = tdm_model_loss_grad(m);
            cr_assert_eq(tdm_model_loss(m, logits, ds.y + first, count, 1.0f / BATCH, &loss, dl), 0);
            cr_assert_eq(tdm_model_backward(m, dl), 0);
            const float *g = tdm_model_grads(m);
            if (w == 0) memcpy(acc, g, (size_t)n * sizeof *acc);
            else
                for (int64_t i = 0; i < n; i++) acc[i] += g[i];
        }
        tdm_optim_range rg = {.param = P, .grad = acc, .state_offset = 0, .n_elem = n};
        cr_assert_eq(tdm_optim_step_ranges(opt, &rg, 1), 0);
    }
    memcpy(out, P, (size_t)n * sizeof *P);
    *n_out = n;
    free(P);
    free(acc);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    tdm_data_free(&ds);
}

static ps_out *shared_out(void)
{
    ps_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    memset(o, 0, sizeof *o);
    return o;
}

/* Runs k; returns spawn's status (asserts every rank but the killed one
 * succeeded unless expect_fail). */
static tdm_status run(ps_case *k, tdm_shm_spawn_result *res)
{
    int world = k->servers + k->workers;
    memset(k->o, 0, sizeof *k->o);
    for (int r = 0; r < world; r++) k->o->status[r] = -1;
    /* async survives a lost worker: the others are not stopped */
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(120000), .grace_ms = tu_scaled_ms(60000),
                             .outlive_failures = k->mode.kind == TDM_PS_ASYNC};
    return tdm_shm_spawn(world, ps_rank, k, &so, res);
}

static void expect_ok(ps_case *k, tdm_status st)
{
    char mode[32];
    for (int r = 0; r < k->servers + k->workers; r++)
        cr_assert_eq(k->o->status[r], 0, "%s S=%d W=%d rank %d: %s", tdm_ps_sync_str(&k->mode, mode, sizeof mode),
                     k->servers, k->workers, r, k->o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
}

static void expect_reference(ps_case *k)
{
    static float ref[MAX_ELEMS];
    int64_t n = 0;
    reference(k->workers, k->steps, ref, &n);
    char mode[32];
    for (int64_t i = 0; i < n; i++)
        cr_assert(memcmp(&ref[i], &k->o->params[i], sizeof(float)) == 0,
                  "%s S=%d W=%d: parameter %lld is %.9g, the reference %.9g",
                  tdm_ps_sync_str(&k->mode, mode, sizeof mode), k->servers, k->workers, (long long)i,
                  k->o->params[i], ref[i]);
    for (int s = 0; s < k->servers; s++) {
        cr_assert_eq(k->o->stats[s].version, k->steps);
        cr_assert_eq(k->o->stats[s].pushes, (int64_t)k->steps * k->workers);
    }
}

Test(ps, sync_is_the_reference_step_bit_for_bit, .timeout = 240)
{
    ps_case k = {.steps = 6, .tp = TDM_RPC_SHM, .kill_worker = -1, .slow_worker = -1, .o = shared_out()};
    static const int sw[][2] = {{1, 2}, {2, 2}, {1, 3}, {2, 3}};
    for (size_t i = 0; i < sizeof sw / sizeof sw[0]; i++) {
        k.servers = sw[i][0];
        k.workers = sw[i][1];
        expect_ok(&k, run(&k, NULL));
        expect_reference(&k);
        for (int s = 0; s < k.servers; s++) cr_assert_eq(k.o->stats[s].stale[0], k.steps * k.workers);
    }
    k.tp = TDM_RPC_TCP;
    expect_ok(&k, run(&k, NULL));
    expect_reference(&k);
    munmap(k.o, sizeof *k.o);
}

Test(ps, bounded_0_is_sync_and_bounded_k_keeps_its_bound, .timeout = 240)
{
    ps_case k = {.servers = 2, .workers = 3, .steps = 8, .tp = TDM_RPC_SHM, .kill_worker = -1, .slow_worker = -1,
                 .o = shared_out()};
    cr_assert_eq(tdm_ps_sync_parse("bounded:0", &k.mode), 0);
    expect_ok(&k, run(&k, NULL));
    expect_reference(&k);
    for (int s = 0; s < k.servers; s++) cr_assert_eq(k.o->stats[s].clock_gap_max, 0, "server %d", s);
    /* worker 0 slow: the others run ahead as far as the bound lets them,
     * and no further */
    const int K = 2;
    cr_assert_eq(tdm_ps_sync_parse("bounded:2", &k.mode), 0);
    k.steps = 12;
    k.slow_worker = 0;
    k.slow_us = 50000;
    expect_ok(&k, run(&k, NULL));
    for (int s = 0; s < k.servers; s++) {
        int64_t total = 0, stale_in_bound = 0;
        for (int b = 0; b < TDM_PS_STALE_BUCKETS; b++) {
            total += k.o->stats[s].stale[b];
            if (b >= 1 && b <= K) stale_in_bound += k.o->stats[s].stale[b];
            if (b > K) cr_assert_eq(k.o->stats[s].stale[b], 0, "server %d: staleness %d", s, b);
        }
        cr_assert_eq(total, k.steps * k.workers);
        cr_assert_eq(k.o->stats[s].version, k.steps);
        cr_assert_gt(stale_in_bound, 0, "server %d: no push 1..%d stale with a slow worker", s, K);
        cr_assert_gt(k.o->stats[s].pulls_early, 0, "server %d: no pull answered 'not yet'", s);
        cr_assert_leq(k.o->stats[s].clock_gap_max, K, "server %d: workers %lld steps apart", s,
                      (long long)k.o->stats[s].clock_gap_max);
    }
    for (int64_t i = 0; i < 1042; i++) cr_assert(isfinite(k.o->params[i]));
    munmap(k.o, sizeof *k.o);
}

Test(ps, async_applies_every_push_and_trains, .timeout = 240)
{
    ps_case k = {.servers = 2, .workers = 3, .steps = 40, .tp = TDM_RPC_SHM, .kill_worker = -1, .slow_worker = -1,
                 .o = shared_out()};
    cr_assert_eq(tdm_ps_sync_parse("async", &k.mode), 0);
    expect_ok(&k, run(&k, NULL));
    double first = 0, last = 0;
    for (int w = 0; w < k.workers; w++)
        for (int t = 0; t < 5; t++) {
            first += k.o->loss[k.servers + w][t];
            last += k.o->loss[k.servers + w][k.steps - 1 - t];
        }
    cr_assert_lt(last, first * 0.8, "async loss %.4f -> %.4f", first / 15, last / 15);
    for (int s = 0; s < k.servers; s++) {
        cr_assert_eq(k.o->stats[s].version, k.steps * k.workers);
        int64_t total = 0;
        for (int b = 0; b < TDM_PS_STALE_BUCKETS; b++) total += k.o->stats[s].stale[b];
        cr_assert_eq(total, k.steps * k.workers);
    }
    munmap(k.o, sizeof *k.o);
}

Test(ps, async_goes_on_without_a_killed_worker, .timeout = 240)
{
    ps_case k = {.servers = 1, .workers = 3, .steps = 12, .tp = TDM_RPC_SHM, .kill_worker = 1, .kill_step = 4,
                 .slow_worker = -1, .o = shared_out()};
    cr_assert_eq(tdm_ps_sync_parse("async", &k.mode), 0);
    tdm_shm_spawn_result res;
    tdm_status st = run(&k, &res);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert(WIFSIGNALED(res.wstatus[2]) && WTERMSIG(res.wstatus[2]) == SIGKILL);
    for (int r = 0; r < 4; r++)
        if (r != 2) cr_assert_eq(k.o->status[r], 0, "rank %d: %s", r, k.o->err[r]);
    cr_assert_eq(k.o->lost[0], 1);
    /* the two others' pushes and the dead one's first four */
    cr_assert_eq(k.o->stats[0].pushes, 2 * k.steps + 4);
    munmap(k.o, sizeof *k.o);
}

Test(ps, sync_stops_naming_a_killed_worker, .timeout = 240)
{
    ps_case k = {.servers = 1, .workers = 2, .steps = 12, .tp = TDM_RPC_SHM, .kill_worker = 1, .kill_step = 3,
                 .slow_worker = -1, .o = shared_out()};
    tdm_shm_spawn_result res;
    tdm_status st = run(&k, &res);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert_eq(k.o->status[0], 5, "the server: %s", k.o->err[0]);
    cr_assert(strstr(k.o->err[0], "worker 1 (rank 2)"), "%s", k.o->err[0]);
    cr_assert(strstr(k.o->err[0], "stopping"), "%s", k.o->err[0]);
    munmap(k.o, sizeof *k.o);
}

/* A worker killed between its pushes to two servers leaves server 0 a
 * push ahead: the gathered step count (the checkpoint's) counts only the
 * pushes every server took, the same whichever shard is asked first. */
Test(ps, async_gathered_steps_count_pushes_every_server_took, .timeout = 240)
{
    ps_case k = {.servers = 2, .workers = 2, .steps = 6, .tp = TDM_RPC_SHM, .kill_worker = 1, .kill_step = 3,
                 .kill_between_pushes = 1, .gather = 1, .slow_worker = -1, .o = shared_out()};
    cr_assert_eq(tdm_ps_sync_parse("async", &k.mode), 0);
    tdm_shm_spawn_result res;
    tdm_status st = run(&k, &res);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert(WIFSIGNALED(res.wstatus[3]) && WTERMSIG(res.wstatus[3]) == SIGKILL);
    for (int r = 0; r < 3; r++) cr_assert_eq(k.o->status[r], 0, "rank %d: %s", r, k.o->err[r]);
    /* server 0 took 6 + 4 pushes, server 1 6 + 3 */
    cr_assert_eq(k.o->stats[0].pushes, 10);
    cr_assert_eq(k.o->stats[1].pushes, 9);
    cr_assert_eq(k.o->gathered_steps, 9, "gathered %lld steps (the pushes both servers took: 9)",
                 (long long)k.o->gathered_steps);
    munmap(k.o, sizeof *k.o);
}
