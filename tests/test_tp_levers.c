/* tests/test_tp_levers.c: the memory levers of tensor parallelism
 * (tp/levers.c) against one device, N = 1, 2, 4 tensor-parallel ranks
 * and a dp=2 x tp=2 mesh (forked, over shm), the MLP 20-24-16-12-5 (SGD
 * with momentum) and the GPT gpt:2-16-4-8 (AdamW; also sequence
 * parallel), a batch of 56:
 * - clipping: each step's global gradient norm (split slices summed over
 *   the group, replicated tensors counted once, replica 0 only) equals
 *   one device's norm of the same step within NORM_TOL relative, and 10
 *   clipped steps end within test_tp.c's bounds of one device's clipped
 *   run (measured below); the norm costs exactly one all-reduce of one
 *   double on the job's communicator per step (its count and bytes), and
 *   it and the found-inf all-reduce are labelled in the flight recorder;
 *   under ZeRO-1 on the dp dimension (each replica holds its chunk's sum
 *   alone) too;
 * - precision: bf16 and fp16 (a scale from 2^16) products on tp=2 and
 *   dp=2 x tp=2 train the MLP and the GPT to within test_precision.c's
 *   0.04 of one device's fp32 mean loss over steps 6-10 (measured: MLP
 *   7.3e-4 bf16, 2.6e-4 fp16; GPT 4e-6), and not to fp32's very losses;
 * - activation checkpointing: a run with it ends on the very parameter
 *   bits of the same run without it (MLP and GPT, fp32 and bf16, tp=2,
 *   4, dp=2 x tp=2, sequence parallel), the allocator hands out fewer
 *   activation bytes on every rank, and the group's communicator counts
 *   the plan's collectives plus exactly tdm_tp_recompute_traffic's (the
 *   recomputed blocks' forward ones) every step; tdm_tp_footprint_ckpt
 *   (the pre-run memory check) counts the activation bytes the rank
 *   holds, with and without;
 * - loss scaling (a scaler over float32 products: the skip logic is the
 *   precision's business only through the scale): an inf planted in one
 *   rank's gradient at step 3 makes every rank of the job skip step 3
 *   (each rank's parameters bitwise those before it), the scale halves
 *   on all, and the later steps move on; a loss scale of 2^k with no
 *   inf is bitwise the run without a scaler (the scale and its inverse
 *   are exact).
 *
 * Bounds, measured over every case: norms within 1.4e-7 relative of one
 * device's (float rounding of the row-parallel sums feeding the
 * gradients; N = 1: 2.1e-16, the chunks cut elsewhere), checked at 1e-6;
 * parameters after 10 clipped steps within 3.0e-8 (MLP) and 4.6e-6
 * (GPT), checked at test_tp.c's 1e-5 and 1e-4. Both checks fail with the
 * replicated tensors counted on every rank of the group, or the squares
 * counted on every replica (checked). */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "dist/mesh.h"
#include "models/clip.h"
#include "models/precision.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"
#include "tp/tp.h"

#define B 56
#define STEPS 10
#define TOL 1e-5
#define GPT_TOL 1e-4
#define NORM_TOL 1e-6
#define MAXE 16384

enum { MLP = 0, GPT = 1 };

typedef struct lv_ref {
    int which, dp, sp;
    double clip;
    double norm[STEPS], loss[STEPS];
    float pn[MAXE];
    int64_t n;
} lv_ref;

static lv_ref g_ref;

typedef struct lv_out {
    int status[8];
    char err[8][512];
    double norm_diff[8], pdiff[8];
    float scale[8];
    int64_t skipped[8];
    double loss[STEPS];   /* rank 0: the global batch's mean loss */
    size_t act_alloc[8];  /* the allocator's activation bytes */
    float pn[MAXE];       /* rank 0: the whole model's parameters at the end */
} lv_out;

static void spec_of(int which, tdm_model_spec *s)
{
    static const int dims[] = {20, 24, 16, 12, 5};
    if (which == GPT) tdm_model_spec_gpt(s, 2, 16, 4, 8);
    else tdm_model_spec_mlp(s, dims, 5);
}

static int in_of(const tdm_model_spec *s)
{
    return s->kind == TDM_MODEL_GPT ? s->n_ctx : s->dims[0];
}
static int rows_of(const tdm_model_spec *s) { return s->kind == TDM_MODEL_GPT ? s->n_ctx : 1; }
static int classes_of(const tdm_model_spec *s)
{
    return s->kind == TDM_MODEL_GPT ? s->vocab : s->dims[s->ndims - 1];
}

static tdm_optim_opts optim(int which)
{
    tdm_optim_opts o;
    if (which == GPT) {
        tdm_optim_opts_default(&o, TDM_OPTIM_ADAMW);
        o.lr = 3e-3f;
        return o;
    }
    tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
    o.lr = 0.05f;
    o.momentum = 0.9f;
    o.weight_decay = 1e-4f;
    return o;
}

/* One device: each step's norm before clipping, the parameters after. */
static void ref_make(int which, double clip)
{
    tdm_model_spec spec;
    spec_of(which, &spec);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_optim_opts oo = optim(which);
    g_ref.which = which;
    g_ref.clip = clip;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, TPP_SEED), TDM_STATUS_OK);
    cr_assert_eq(tdm_optim_init(&opt, m, &oo), TDM_STATUS_OK);
    static float x[B * 20];
    static int32_t y[B * 8];
    g_ref.n = tdm_model_param_elems(m);
    cr_assert(g_ref.n <= MAXE);
    for (int s = 0; s < STEPS; s++) {
        double loss = 0.0;
        tpp_batch(&spec, in_of(&spec), rows_of(&spec), classes_of(&spec), s, B, x, y);
        cr_assert_eq(tdm_model_zero_grad(m), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_forward_backward(m, x, y, B, &loss), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        g_ref.loss[s] = loss;
        cr_assert_eq(tdm_clip_grad_norm(m, clip, &g_ref.norm[s]), TDM_STATUS_OK);
        cr_assert_eq(tdm_optim_step(opt), TDM_STATUS_OK);
    }
    memcpy(g_ref.pn, tdm_model_params(m), (size_t)g_ref.n * 4);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
}

#define RFAIL(...)                                                                 \
    do {                                                                           \
        snprintf(o->err[r], sizeof o->err[r], __VA_ARGS__);                        \
        o->status[r] = 1;                                                          \
        rc = 1;                                                                    \
        goto done;                                                                 \
    } while (0)

/* The inf hook: rank g_inf_rank's gradient gets an inf after step
 * g_inf_step's sums. */
static int g_inf_rank = -1, g_inf_step, g_step_now, g_rank_now;

static void plant_inf(void *ctx, float *grads, int64_t n, tdm_device *dev)
{
    (void)ctx;
    float inf = INFINITY;
    if (g_rank_now == g_inf_rank && g_step_now == g_inf_step && n > 3)
        (void)tdm_dev_copy_from_host(dev, grads + 3, &inf, sizeof inf);
}

/* The ranks' run: clipped steps (and with scale_exp >= 0, a loss scaler
 * from 2^scale_exp); the norm and its one all-reduce checked each step. */
static int g_scale_exp = -1;
static tdm_precision g_prec = TDM_PRECISION_FP32;
static int g_ckpt;
static int g_zero;   /* ZeRO-1 (1) or ZeRO-2 (2) over the dp dimension */

static int lv_rank(tdm_comm *world, void *arg)
{
    lv_out *o = arg;
    int r = tdm_comm_rank(world), rc = 0, dp = g_ref.dp;
    tdm_device *dev = NULL;
    tdm_mesh *mesh = NULL;
    tdm_tp *p = NULL;
    tdm_comm *job = NULL;
    tdm_model_spec spec;
    spec_of(g_ref.which, &spec);
    float *whole = calloc((size_t)g_ref.n, 4), *before = NULL;
    static float x[B * 20];
    static int32_t y[B * 8];
    int in = in_of(&spec), rows = rows_of(&spec);
    g_rank_now = r;
    if (tdm_device_open(&dev, "cpu", r, 1)) RFAIL("device: %s", tdm_error_message());
    tdm_mesh_shape shape = {.size = {dp, 1, tdm_comm_size(world) / dp}};
    if (tdm_mesh_init(&mesh, world, &shape)) RFAIL("mesh: %s", tdm_error_message());
    if (tdm_comm_split(world, 0, r, &job)) RFAIL("job split: %s", tdm_error_message());
    tdm_comm *comm = tdm_mesh_comm(mesh, TDM_MESH_TP), *dcomm = tdm_mesh_comm(mesh, TDM_MESH_DP);
    int rep = tdm_mesh_coord(mesh, TDM_MESH_DP);
    tdm_tp_opts to = {.seed = TPP_SEED, .optim = optim(g_ref.which),
                      .grad_comm = dp > 1 ? dcomm : NULL, .sequence_parallel = g_ref.sp,
                      .precision = g_prec, .ckpt = g_ckpt,
                      .zero = g_zero == 2 ? TDM_TP_ZERO_GRADS
                              : g_zero    ? TDM_TP_ZERO_OPTIMIZER
                                          : TDM_TP_ZERO_NONE};
    if (tdm_tp_init(&p, comm, dev, &spec, &to)) RFAIL("init: %s", tdm_error_message());
    tdm_grad_scaler sc;
    tdm_grad_scaler_opts so;
    tdm_grad_scaler_opts_default(&so);
    if (g_scale_exp >= 0) so.init_scale = ldexpf(1.0f, g_scale_exp);
    if (tdm_grad_scaler_init(&sc, &so)) RFAIL("scaler: %s", tdm_error_message());
    tdm_tp_levers lv = {.scaler = g_scale_exp >= 0 ? &sc : NULL, .clip_norm = g_ref.clip,
                        .comm = job, .replica = rep, .after_backward = plant_inf};
    tdm_tp_set_levers(p, &lv);
    int64_t ne = tdm_tp_elems(p);
    before = malloc((size_t)ne * 4);
    if (!before) RFAIL("malloc");
    int lo = B * rep / dp, hi = B * (rep + 1) / dp;
    for (int s = 0; s < STEPS; s++) {
        g_step_now = s + 1;
        tpp_batch(&spec, in, rows, classes_of(&spec), s, B, x, y);
        memcpy(before, tdm_tp_params(p), (size_t)ne * 4);   /* a host device's memory */
        tdm_comm_traffic t0, t1, g0, g1;
        tdm_comm_traffic_get(job, &t0);
        tdm_comm_traffic_get(comm, &g0);
        double ls = 0.0;
        if (tdm_tp_step_scaled(p, x + lo * in, y + lo * rows, hi - lo, 1.0f / B, &ls))
            RFAIL("step %d: %s", s + 1, tdm_error_message());
        tdm_comm_traffic_get(job, &t1);
        tdm_comm_traffic_get(comm, &g1);
        /* the group's collectives: the plan's, and with checkpointing
         * the recomputed blocks' forward ones besides, exactly */
        tdm_comm_traffic plan, re;
        tdm_tp_step_traffic(&spec, tdm_comm_size(comm), hi - lo, g_ref.sp, &plan);
        tdm_tp_recompute_traffic(&spec, tdm_comm_size(comm), hi - lo, g_ref.sp, &re);
        for (int c = 0; c < TDM_COLL_COUNT_; c++) {
            int64_t wc = plan.calls[c] + (g_ckpt ? re.calls[c] : 0);
            int64_t wb = plan.bytes[c] + (g_ckpt ? re.bytes[c] : 0);
            if (g1.calls[c] - g0.calls[c] != wc || g1.bytes[c] - g0.bytes[c] != wb)
                RFAIL("step %d: %s: the group counted %lld calls of %lld bytes, expected %lld of "
                      "%lld", s + 1, tdm_coll_name((tdm_coll)c),
                      (long long)(g1.calls[c] - g0.calls[c]),
                      (long long)(g1.bytes[c] - g0.bytes[c]), (long long)wc, (long long)wb);
        }
        if (dp > 1 && tdm_comm_all_reduce(dcomm, &ls, &ls, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM))
            RFAIL("loss: %s", tdm_error_message());
        if (r == 0) o->loss[s] = ls / B;
        tdm_tp_stats st;
        tdm_tp_get_stats(p, &st);
        /* the job's communicator: the norm's one double (and the
         * scaler's one float), nothing else */
        int64_t calls = t1.calls[TDM_COLL_ALL_REDUCE] - t0.calls[TDM_COLL_ALL_REDUCE];
        int64_t bytes = t1.bytes[TDM_COLL_ALL_REDUCE] - t0.bytes[TDM_COLL_ALL_REDUCE];
        int norm = g_ref.clip > 0.0 && !st.last_skipped;
        int64_t want_calls = (g_scale_exp >= 0) + norm;
        int64_t want_bytes = (g_scale_exp >= 0 ? 4 : 0) + (norm ? 8 : 0);
        if (calls != want_calls || bytes != want_bytes)
            RFAIL("step %d: the job's communicator counted %lld all-reduces of %lld bytes, the "
                  "levers need %lld of %lld", s + 1, (long long)calls, (long long)bytes,
                  (long long)want_calls, (long long)want_bytes);
        int skip_here = g_inf_rank >= 0 && s + 1 == g_inf_step;
        if (st.last_skipped != skip_here)
            RFAIL("step %d: skipped %d, expected %d", s + 1, st.last_skipped, skip_here);
        if (skip_here && memcmp(before, tdm_tp_params(p), (size_t)ne * 4))
            RFAIL("step %d was skipped but the parameters changed", s + 1);
        if (!skip_here && !memcmp(before, tdm_tp_params(p), (size_t)ne * 4))
            RFAIL("step %d did not move the parameters", s + 1);
        if (norm && g_inf_rank < 0) {
            double d = fabs(st.last_norm - g_ref.norm[s]) / g_ref.norm[s];
            if (d > o->norm_diff[r]) o->norm_diff[r] = d;
        }
    }
    tdm_ckpt_host h = {.params = whole};
    if (tdm_tp_gather_state(p, &h, 0)) RFAIL("gather: %s", tdm_error_message());
    if (tdm_comm_rank(comm) == 0) o->pdiff[r] = tpp_max_diff(whole, g_ref.pn, g_ref.n);
    if (r == 0) memcpy(o->pn, whole, (size_t)g_ref.n * 4);
    {
        tdm_tp_stats as;
        tdm_tp_get_stats(p, &as);
        o->act_alloc[r] = as.act_alloc_bytes;
        /* the pre-run memory check's count, checkpointing included */
        tdm_tp_rank_footprint fp;
        if (tdm_tp_footprint_ckpt(&spec, tdm_comm_size(comm), hi - lo, g_ref.sp, g_ckpt, &fp))
            RFAIL("footprint: %s", tdm_error_message());
        if (fp.act_bytes != as.activations || fp.elems != ne)
            RFAIL("footprint (checkpointing %d): %zu activation bytes and %lld elements, the "
                  "rank holds %zu and %lld", g_ckpt, fp.act_bytes, (long long)fp.elems,
                  as.activations, (long long)ne);
    }
    o->scale[r] = sc.scale;
    tdm_tp_stats st;
    tdm_tp_get_stats(p, &st);
    o->skipped[r] = st.skipped;
done:
    tdm_tp_free(p);
    tdm_comm_free(job);
    tdm_mesh_free(mesh);
    tdm_device_free(dev);
    free(whole);
    free(before);
    return rc;
}

static lv_out *run(int dp, int tp)
{
    g_ref.dp = dp;
    lv_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(o != MAP_FAILED);
    memset(o, 0, sizeof *o);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(120000)};
    tdm_status st = tdm_shm_spawn(dp * tp, lv_rank, o, &so, NULL);
    for (int r = 0; r < dp * tp; r++)
        cr_assert_eq(o->status[r], 0, "model %d dp=%d tp=%d rank %d: %s", g_ref.which, dp, tp, r,
                     o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    return o;
}

static void check_clip(int which, int dp, int tp, int sp)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    /* small enough to clip every step (measured norms 0.3 .. 2) */
    ref_make(which, which == GPT ? 0.1 : 0.05);
    g_ref.sp = sp;
    g_inf_rank = -1;
    g_scale_exp = -1;
    lv_out *o = run(dp, tp);
    double nd = 0.0, pd = 0.0;
    for (int r = 0; r < dp * tp; r++) {
        nd = o->norm_diff[r] > nd ? o->norm_diff[r] : nd;
        pd = o->pdiff[r] > pd ? o->pdiff[r] : pd;
    }
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "model %d dp=%d tp=%d sp=%d: norms within %g relative, parameters "
                "within %g\n", which, dp, tp, sp, nd, pd);
    cr_assert(nd <= NORM_TOL, "model %d dp=%d tp=%d sp=%d: the norm is %g (relative) off one "
              "device's", which, dp, tp, sp, nd);
    double tol = which == GPT ? GPT_TOL : TOL;
    cr_assert(pd <= tol, "model %d dp=%d tp=%d sp=%d: clipped parameters within %g of one "
              "device's", which, dp, tp, sp, pd);
    munmap(o, sizeof *o);
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

TestSuite(tp_levers, .timeout = 600);

Test(tp_levers, the_clipped_norm_is_one_devices_at_1_2_and_4_ranks)
{
    for (int which = MLP; which <= GPT; which++) {
        check_clip(which, 1, 1, 0);
        check_clip(which, 1, 2, 0);
        check_clip(which, 1, 4, 0);
    }
}

Test(tp_levers, the_clipped_norm_is_one_devices_on_dp2_tp2)
{
    check_clip(MLP, 2, 2, 0);
    check_clip(GPT, 2, 2, 0);
}

/* ZeRO-1's reduce-scatter leaves each replica its chunk's sum alone:
 * every replica counts its chunk. */
Test(tp_levers, the_clipped_norm_is_one_devices_under_zero1)
{
    g_zero = 1;
    check_clip(MLP, 2, 2, 0);
    check_clip(GPT, 2, 2, 0);
    check_clip(GPT, 2, 2, 1);
    g_zero = 0;
}

/* ZeRO-2: the levers read the replica's gradient shard (its chunk's
 * sum, the whole gradient released): the norm counts each chunk once,
 * clipping scales the shard, and an inf planted in one rank's shard
 * (the test hook gets the shard) skips the step on every rank. */
Test(tp_levers, the_clipped_norm_is_one_devices_under_zero2)
{
    g_zero = 2;
    check_clip(MLP, 2, 2, 0);
    check_clip(GPT, 2, 2, 0);
    check_clip(GPT, 2, 2, 1);
    g_zero = 0;
}

Test(tp_levers, the_clipped_norm_is_one_devices_with_sequence_parallelism)
{
    check_clip(GPT, 1, 2, 1);
    check_clip(GPT, 2, 2, 1);
}

/* A scaler of 2^10 with no inf: the scaled gradient unscaled is the same
 * bits (powers of two), so the run is the plain clipped one's; and an inf
 * planted in one rank's gradient at step 3 skips step 3 everywhere. */
static void check_skip(int which, int dp, int tp, int inf_rank)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    ref_make(which, which == GPT ? 0.1 : 0.05);
    g_ref.sp = 0;
    g_scale_exp = 10;
    g_inf_rank = inf_rank;
    g_inf_step = 3;
    lv_out *o = run(dp, tp);
    for (int r = 0; r < dp * tp; r++) {
        cr_assert_eq(o->skipped[r], inf_rank >= 0, "rank %d skipped %lld steps", r,
                     (long long)o->skipped[r]);
        cr_assert_eq(o->scale[r], inf_rank >= 0 ? 512.0f : 1024.0f, "rank %d: scale %g", r,
                     (double)o->scale[r]);
    }
    if (inf_rank < 0)
        for (int r = 0; r < dp * tp; r += tp)
            cr_assert(o->pdiff[r] <= (which == GPT ? GPT_TOL : TOL), "scaled run: %g",
                      o->pdiff[r]);
    munmap(o, sizeof *o);
    g_inf_rank = -1;
    g_scale_exp = -1;
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

Test(tp_levers, a_loss_scale_without_inf_changes_nothing)
{
    check_skip(MLP, 1, 2, -1);
    check_skip(GPT, 2, 2, -1);
}

Test(tp_levers, an_inf_in_one_ranks_gradient_makes_every_rank_skip)
{
    check_skip(MLP, 1, 2, 1);
    check_skip(MLP, 2, 2, 3);   /* replica 1's second tensor-parallel rank */
    check_skip(GPT, 2, 2, 2);   /* replica 1's first */
    check_skip(GPT, 1, 4, 0);
}

Test(tp_levers, an_inf_in_one_ranks_gradient_shard_makes_every_rank_skip_under_zero2)
{
    g_zero = 2;
    check_skip(MLP, 2, 2, 3);
    check_skip(GPT, 2, 2, -1);
    check_skip(GPT, 2, 2, 1);
    g_zero = 0;
}

/* BF16 and FP16 (a loss scale from 2^16) products over tp: the mean loss
 * of steps 6-10 within test_precision.c's 0.04 of one device's fp32 run
 * (measured below), and not fp32's losses (the products did round). */
static void check_prec(int which, int dp, int tp, tdm_precision prec)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    ref_make(which, 0.0);
    g_ref.sp = 0;
    g_inf_rank = -1;
    g_prec = prec;
    g_scale_exp = prec == TDM_PRECISION_FP16 ? 16 : -1;
    lv_out *o = run(dp, tp);
    double a = 0.0, b = 0.0;
    int same = 1;
    for (int s = 5; s < STEPS; s++) {
        a += o->loss[s] / (STEPS - 5);
        b += g_ref.loss[s] / (STEPS - 5);
    }
    for (int s = 0; s < STEPS; s++) same &= o->loss[s] == g_ref.loss[s];
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "model %d dp=%d tp=%d %s: mean loss %.6f, fp32 one device %.6f\n", which,
                dp, tp, tdm_precision_name(prec), a, b);
    cr_assert(fabs(a - b) <= 0.04, "model %d dp=%d tp=%d %s: mean loss %.4f, fp32 %.4f", which,
              dp, tp, tdm_precision_name(prec), a, b);
    cr_assert(!same, "model %d dp=%d tp=%d %s: the losses are fp32's bits", which, dp, tp,
              tdm_precision_name(prec));
    munmap(o, sizeof *o);
    g_prec = TDM_PRECISION_FP32;
    g_scale_exp = -1;
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

Test(tp_levers, bf16_and_fp16_train_within_the_precision_bound_of_fp32)
{
    for (int which = MLP; which <= GPT; which++) {
        check_prec(which, 1, 2, TDM_PRECISION_BF16);
        check_prec(which, 1, 2, TDM_PRECISION_FP16);
        check_prec(which, 2, 2, TDM_PRECISION_BF16);
        check_prec(which, 2, 2, TDM_PRECISION_FP16);
    }
}

/* Activation checkpointing: the same run with and without it ends on
 * the same parameter bits (fp32 and bf16, clipped), the allocator hands
 * out fewer activation bytes on every rank, and the group's
 * communicator counts the plan's collectives plus exactly the
 * recomputed blocks' forward ones (checked every step in lv_rank). */
static void check_ckpt(int which, int dp, int tp, int sp, tdm_precision prec)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    ref_make(which, which == GPT ? 0.1 : 0.05);
    g_ref.sp = sp;
    g_inf_rank = -1;
    g_prec = prec;
    static float plain[MAXE];
    size_t act[8];
    g_ckpt = 0;
    lv_out *o = run(dp, tp);
    memcpy(plain, o->pn, (size_t)g_ref.n * 4);
    memcpy(act, o->act_alloc, sizeof act);
    munmap(o, sizeof *o);
    g_ckpt = 1;
    o = run(dp, tp);
    g_ckpt = 0;
    g_prec = TDM_PRECISION_FP32;
    cr_assert(!memcmp(plain, o->pn, (size_t)g_ref.n * 4), "model %d dp=%d tp=%d sp=%d %s: "
              "checkpointing changed the parameters", which, dp, tp, sp,
              tdm_precision_name(prec));
    for (int r = 0; r < dp * tp; r++) {
        if (getenv("TANDEM_TEST_VERBOSE") && r == 0)
            fprintf(stderr, "model %d dp=%d tp=%d sp=%d %s: activations %zu -> %zu bytes\n",
                    which, dp, tp, sp, tdm_precision_name(prec), act[r], o->act_alloc[r]);
        cr_assert(o->act_alloc[r] > 0 && o->act_alloc[r] < act[r], "rank %d: activations %zu "
                  "bytes checkpointed, %zu without", r, o->act_alloc[r], act[r]);
    }
    munmap(o, sizeof *o);
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

Test(tp_levers, checkpointing_changes_no_bit_and_holds_fewer_activations)
{
    check_ckpt(MLP, 1, 2, 0, TDM_PRECISION_FP32);
    check_ckpt(MLP, 2, 2, 0, TDM_PRECISION_BF16);
    check_ckpt(GPT, 1, 2, 0, TDM_PRECISION_FP32);
    check_ckpt(GPT, 1, 4, 0, TDM_PRECISION_BF16);
    check_ckpt(GPT, 2, 2, 0, TDM_PRECISION_FP32);
    check_ckpt(GPT, 1, 2, 1, TDM_PRECISION_FP32);
    check_ckpt(GPT, 2, 2, 1, TDM_PRECISION_BF16);
}

Test(tp_levers, checkpointing_refuses_segments_and_recomputed_elementwise_layers)
{
    tdm_model_spec spec;
    spec_of(MLP, &spec);
    tdm_comm_traffic re;
    tdm_tp_recompute_traffic(&spec, 2, 8, 0, &re);
    for (int c = 0; c < TDM_COLL_COUNT_; c++)
        cr_assert_eq(re.calls[c], 0, "the MLP recomputes without communication");
    spec_of(GPT, &spec);   /* 2 blocks: block 0 recomputed */
    tdm_tp_recompute_traffic(&spec, 2, 8, 0, &re);
    cr_assert_eq(re.calls[TDM_COLL_ALL_REDUCE], 2);
    cr_assert_eq(re.bytes[TDM_COLL_ALL_REDUCE], 2 * 8 * 8 * 16 * 4);
    tdm_tp_recompute_traffic(&spec, 2, 8, 1, &re);
    cr_assert_eq(re.calls[TDM_COLL_REDUCE_SCATTER], 2);
    cr_assert_eq(re.calls[TDM_COLL_ALL_GATHER], 1);
    tdm_tp_recompute_traffic(&spec, 1, 8, 0, &re);
    cr_assert_eq(re.calls[TDM_COLL_ALL_REDUCE], 0, "one rank: no collectives");
}

/* The levers' two all-reduces are labelled in the flight recorder of the
 * communicator they run on (here a job communicator of their own, split
 * after TANDEM_FR_DUMP is set, so that its recorder dumps when freed). */
static int fr_rank(tdm_comm *world, void *argp)
{
    setenv("TANDEM_FR_DUMP", (const char *)argp, 1);
    unsetenv("TANDEM_FR_DUMP_ON");
    int r = tdm_comm_rank(world);
    tdm_device *dev = NULL;
    tdm_tp *p = NULL;
    tdm_comm *job = NULL;
    tdm_model_spec spec;
    spec_of(MLP, &spec);
    static float x[8 * 20];
    static int32_t y[8];
    tpp_batch(&spec, 20, 1, 5, 0, 8, x, y);
    tdm_tp_opts o = {.seed = TPP_SEED, .optim = optim(MLP), .precision = TDM_PRECISION_FP16};
    tdm_grad_scaler sc;
    tdm_grad_scaler_opts so;
    tdm_grad_scaler_opts_default(&so);
    so.init_scale = 1024.0f;   /* 2^16 overflows this step's fp16 operands: a skip, no norm */
    tdm_status st = tdm_grad_scaler_init(&sc, &so);
    if (!st) st = tdm_comm_split(world, 0, r, &job);
    if (!st) st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_tp_init(&p, world, dev, &spec, &o);
    if (!st) {
        tdm_tp_levers l = {.scaler = &sc, .clip_norm = 0.05, .comm = job};
        tdm_tp_set_levers(p, &l);
        st = tdm_tp_step_scaled(p, x, y, 8, 1.0f / 8, NULL);
    }
    tdm_tp_free(p);
    tdm_comm_free(job);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(tp_levers, the_levers_collectives_are_labelled_in_the_flight_recorder)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "tdm_tplv_fr");
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    cr_assert_eq(tdm_shm_spawn(2, fr_rank, dir, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    static char all[1 << 20];
    cr_assert_geq(tu_read_dir(dir, all, sizeof all), 0, "cannot read %s", dir);
    tu_rmtree(dir);
    cr_assert(strstr(all, "grad scaler found inf"), "no found-inf all-reduce in the dumps");
    cr_assert(strstr(all, "tp clip grad norm over the group and replicas"),
              "no norm all-reduce in the dumps");
}
