/* tests/test_pp_ddp.c: data parallelism over pipelines on a device mesh:
 * dp=2 x pp=2 on 4 forked ranks, each replica's pipeline running its half
 * of the global batch in M micro-batches (1/B_global loss scale), DDP's
 * Reducer (unchanged: tdm_ddp_sync_begin/_end around the last
 * micro-batch's backward) all-reducing each stage's gradients over the dp
 * group: the same training as one device on the same global batches,
 * within DDP's bounds (tests/test_ddp.c's: losses 1e-5 + 1e-4 relative,
 * parameters 1e-6 + 1e-3 relative), for the MLP and the GPT (its tied
 * embedding summed after the dp all-reduce), GPipe and 1F1B, with SGD
 * (momentum 0.9) as the DDP tests use: AdamW turns the rounding noise of
 * a gradient that is zero analytically (attention's key bias) into
 * lr-sized steps of either sign, which no other summation order can
 * match at DDP's bound. Both replicas of a stage hold bitwise the same
 * parameters. And a rank killed
 * in one replica stops the other replica's ranks too, naming it. */
#include <criterion/criterion.h>
#include <signal.h>
#include <unistd.h>

#include "core/timer.h"
#include "ddp/ddp.h"
#include "dist/batch.h"
#include "dist/mesh.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/timeout_util.h"

#define GB 24          /* the global batch */
#define STEPS 8
#define M 3

typedef struct mix_out {
    int status[4];
    char err[4][768];
    double loss[4][STEPS];
    float params[4][TPP_MAX_ELEMS];   /* each rank's slice, at its whole-model offset */
    int64_t off[4], n[4];
    double fail_ms[4], kill_ms;
} mix_out;

typedef struct mix_arg {
    mix_out *out;
    tpp_kind kind;
    tdm_pp_schedule_kind sched;
    int victim;                       /* >= 0: this rank dies before step 3 */
    int gb;                           /* the global batch */
} mix_arg;

static tdm_optim_opts mix_optim(void) { return tpp_optim(TPP_MLP); }

static tdm_status sync_begin(void *ctx) { return tdm_ddp_sync_begin(*(tdm_ddp **)ctx, 0.0); }
static tdm_status sync_end(void *ctx, tdm_status st)
{
    return tdm_ddp_sync_end(*(tdm_ddp **)ctx, st);
}
static tdm_status sync_empty(void *ctx) { return tdm_ddp_sync_empty(*(tdm_ddp **)ctx); }

static int mix_rank(tdm_comm *comm, void *argp)
{
    mix_arg *a = argp;
    int r = tdm_comm_rank(comm);
    tdm_mesh *mesh = NULL;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_ddp *ddp = NULL;
    tdm_model_spec spec;
    tpp_spec(a->kind, &spec);
    int in = tpp_in_features(&spec), rows = tpp_out_rows(&spec), classes = tpp_classes(&spec);
    int gb = a->gb;
    char *x = malloc((size_t)gb * in * 4);
    int32_t *y = malloc((size_t)gb * rows * sizeof *y);
    tdm_mesh_shape shape;
    tdm_status st = tdm_mesh_parse("dp=2,pp=2", tdm_comm_size(comm), &shape);
    if (!st) st = tdm_mesh_init(&mesh, comm, &shape);
    if (!st) st = tdm_device_open(&dev, "cpu", r, 1);
    tdm_pp_opts o = {.schedule = a->sched, .micro_batches = M, .seed = TPP_SEED,
                     .optim = mix_optim(),
                     .grad_sync = {.begin = sync_begin, .end = sync_end,
                                   .empty = sync_empty, .ctx = &ddp}};
    if (!st) st = tdm_pp_init(&p, tdm_mesh_comm(mesh, TDM_MESH_PP), dev, &spec, &o);
    tdm_comm *dp = st ? NULL : tdm_mesh_comm(mesh, TDM_MESH_DP);
    tdm_ddp_opts dopt = {.timeout_ms = tu_scaled_ms(20000)};
    if (!st) st = tdm_ddp_init(&ddp, tdm_pp_model(p), dp, &dopt);
    int d = st ? 0 : tdm_comm_rank(dp);
    for (int s = 0; !st && s < STEPS; s++) {
        if (r == a->victim && s == 3) {
            a->out->kill_ms = (double)tdm_time_ns() * 1e-6;
            raise(SIGKILL);
        }
        tpp_batch(&spec, in, rows, classes, s, gb, x, y);
        int64_t lo, hi;
        tdm_dist_share(gb, d, 2, &lo, &hi);
        double ls = 0.0;
        st = tdm_pp_step_scaled(p, x + lo * in * 4, y + lo * rows, (int)(hi - lo),
                                1.0f / (float)gb, &ls);
        /* the global batch's loss: the two replicas' sums */
        if (!st) st = tdm_comm_all_reduce(dp, &ls, &ls, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM);
        a->out->loss[r][s] = ls / gb;
    }
    if (!st) {
        tdm_model_stage_info si;
        tdm_model_get_stage(tdm_pp_model(p), &si);
        a->out->off[r] = si.slice_offset;
        a->out->n[r] = si.slice_elems;
        memcpy(a->out->params[r], tdm_model_params(tdm_pp_model(p)), (size_t)si.slice_elems * 4);
    }
    a->out->fail_ms[r] = (double)tdm_time_ns() * 1e-6;
    a->out->status[r] = st;
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_ddp_free(ddp);
    tdm_pp_free(p);
    tdm_mesh_free(mesh);
    tdm_device_free(dev);
    free(x);
    free(y);
    return st ? 3 : 0;
}

static mix_out *out_new(void)
{
    mix_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    memset(o, 0, sizeof *o);
    return o;
}

static void check_mix(tpp_kind kind, int gb)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    /* one device, plain steps on the global batch */
    double ref_loss[STEPS];
    static float ref_p[TPP_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tpp_reference_opt(kind, 1, gb, STEPS, mix_optim(), ref_loss, NULL, ref_p, &n),
                 TDM_STATUS_OK);
    for (int k = 0; k < TDM_PP_SCHEDULE_COUNT_; k++) {
        mix_out *o = out_new();
        mix_arg a = {.out = o, .kind = kind, .sched = (tdm_pp_schedule_kind)k, .victim = -1,
                     .gb = gb};
        /* the dp groups' arena takes DDP's gradients (zero-copy) */
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(90000),
                                 .shm = {.arena_bytes = 2 * tdm_ddp_arena_bytes(n)}};
        tdm_status st = tdm_shm_spawn(4, mix_rank, &a, &so, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%s %s: %s / %s / %s / %s / %s", tpp_kind_name(kind),
                     tdm_pp_schedule_name(a.sched), tdm_error_message(), o->err[0], o->err[1],
                     o->err[2], o->err[3]);
        for (int r = 0; r < 4; r++) {
            for (int s = 0; s < STEPS; s++)
                cr_assert(fabs(o->loss[r][s] - ref_loss[s]) <= 1e-5 + 1e-4 * fabs(ref_loss[s]),
                          "%s rank %d step %d: loss %.9g vs one device %.9g",
                          tpp_kind_name(kind), r, s, o->loss[r][s], ref_loss[s]);
            for (int64_t i = 0; i < o->n[r]; i++) {
                double ref = ref_p[o->off[r] + i], got = o->params[r][i];
                cr_assert(fabs(got - ref) <= 1e-6 + 1e-3 * fabs(ref),
                          "%s %s rank %d: parameter %lld is %.9g, one device %.9g",
                          tpp_kind_name(kind), tdm_pp_schedule_name(a.sched), r,
                          (long long)(o->off[r] + i), got, ref);
            }
        }
        /* mesh ranks 0, 2 are stage 0 of replicas 0, 1; 1, 3 stage 1 */
        for (int s = 0; s < 2; s++) {
            cr_assert_eq(o->n[s], o->n[s + 2]);
            cr_assert(!memcmp(o->params[s], o->params[s + 2], (size_t)o->n[s] * 4),
                      "stage %d differs between the replicas", s);
        }
        cr_assert_eq(o->n[0] + o->n[1], n);
        munmap(o, sizeof *o);
    }
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

TestSuite(pp_ddp, .timeout = 240);

Test(pp_ddp, mlp_dp2_pp2_equals_one_device) { check_mix(TPP_MLP, GB); }
Test(pp_ddp, gpt_dp2_pp2_equals_one_device) { check_mix(TPP_GPT, GB); }

/* A global batch of 1: replica 1's share is empty in every step; its
 * stages run no micro-batch (batch 0) and join DDP's sum with a zero
 * gradient (grad_sync.empty: tdm_ddp_sync_empty), the GPT's tied sum and
 * the optimizer step, and end with replica 0's parameters bit for bit. */
Test(pp_ddp, an_empty_replica_joins_the_step_with_a_zero_gradient)
{
    check_mix(TPP_MLP, 1);
    check_mix(TPP_GPT, 1);
}

/* Without grad_sync.empty (or without replicas) batch 0 is refused on
 * the stage, with the pipeline aborted so its peers stop too. */
static int empty_refused_rank(tdm_comm *comm, void *argp)
{
    char *msg = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    tdm_pp_opts o = {.micro_batches = 1, .seed = TPP_SEED, .optim = mix_optim()};
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    if (!st) st = tdm_pp_step(p, NULL, NULL, 0, NULL);
    if (r == 0) snprintf(msg, 512, "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    return st == TDM_STATUS_INVALID_ARG ? 0 : 3;
}

Test(pp_ddp, batch_0_without_an_empty_sync_is_refused)
{
    char *msg = mmap(NULL, 512, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(msg, MAP_FAILED);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000), .shm = {.arena_bytes = 1 << 20}};
    cr_assert_eq(tdm_shm_spawn(2, empty_refused_rank, msg, &so, NULL), TDM_STATUS_OK, "%s / %s",
                 tdm_error_message(), msg);
    cr_assert(strstr(msg, "batch 0 (expected at least 1; an empty share of a global batch "
                          "needs grad_sync.empty"), "%s", msg);
    munmap(msg, 512);
}

/* Rank 3 (replica 1's stage 1) dies: its pipeline neighbour and its dp
 * peer see it, and so does replica 0's stage 0 (rank 0), which shares no
 * communicator of its own with it but the job. */
Test(pp_ddp, killed_rank_stops_both_replicas)
{
    mix_out *o = out_new();
    mix_arg a = {.out = o, .kind = TPP_MLP, .sched = TDM_PP_1F1B, .victim = 3};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000), .shm = {.arena_bytes = 1 << 20}};
    tdm_status st = tdm_shm_spawn(4, mix_rank, &a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    for (int r = 0; r < 3; r++) {
        cr_assert_neq(o->status[r], TDM_STATUS_OK, "rank %d did not stop", r);
        cr_assert(strstr(o->err[r], "rank 3 (pid") || strstr(o->err[r], "job rank 3, pid"),
                  "rank %d: %s", r, o->err[r]);
        cr_assert_lt(o->fail_ms[r] - o->kill_ms, tu_scaled_ms(5000), "rank %d took %.0f ms", r,
                     o->fail_ms[r] - o->kill_ms);
    }
    munmap(o, sizeof *o);
}
