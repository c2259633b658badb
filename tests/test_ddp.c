/* tests/test_ddp.c: DDP against single-device training: equivalence with
 * 1..4 ranks (MLP, uneven batches, CNN with per-rank batchnorm), overlap on
 * and off bit for bit, no_sync, collective-sequence and layout mismatches,
 * evaluation spread over the ranks, the share of a global batch and
 * tdm_ddp_forward_global. Each test forks its ranks through
 * tdm_dist_spawn (bounded run time, nothing left behind). Bucket plans,
 * overlap on large buckets and unused parameters: test_ddp_reducer.c. */
#include <criterion/criterion.h>

#include "tests/test_ddp_util.h"

static tdm_dataset g_data;
static int g_cnn;

static void setup_mlp(void) { g_cnn = 0; cr_assert_eq(tddp_data(&g_data, 0, 4096), TDM_STATUS_OK); }
static void setup_cnn(void) { g_cnn = 1; cr_assert_eq(tddp_data(&g_data, 1, 1024), TDM_STATUS_OK); }
static void teardown(void) { tdm_data_free(&g_data); }

static int g_seed_by_rank;

static void check_equiv(int world, int batch, int steps, double gtol, double ptol)
{
    tddp_cfg c = tddp_cfg_default();
    c.seed_by_rank = g_seed_by_rank;
    c.cnn = g_cnn;
    c.batch = batch;
    c.steps = steps;
    tddp_check_equiv(&c, &g_data, world, 60000,
                     (tddp_tol){.loss_atol = 1e-5, .loss_rtol = 1e-4, .grad_atol = gtol,
                                .grad_rtol = 1e-4, .param_atol = ptol, .param_rtol = 1e-3});
}

TestSuite(ddp_mlp, .init = setup_mlp, .fini = teardown, .timeout = 120);

Test(ddp_mlp, one_step_equals_single_device_1_to_4_ranks)
{
    for (int w = 1; w <= 4; w++) check_equiv(w, 24, 1, 1e-6, 1e-6);
}

Test(ddp_mlp, construction_broadcasts_rank0_parameters)
{
    g_seed_by_rank = 1;   /* every other rank starts from different parameters */
    check_equiv(3, 24, 2, 1e-6, 1e-6);
    g_seed_by_rank = 0;
}

Test(ddp_mlp, uneven_global_batch)
{
    for (int w = 2; w <= 4; w++) check_equiv(w, 23, 2, 1e-6, 1e-6);
    check_equiv(3, 2, 1, 1e-6, 1e-6);   /* fewer samples than ranks: one rank has none */
}

Test(ddp_mlp, loss_curve_50_steps)
{
    check_equiv(2, 32, 50, 1e-5, 1e-4);
    check_equiv(4, 32, 50, 1e-5, 1e-4);
}

static void run_to(tddp_cfg *c, int world, tddp_shared *sh)
{
    memset(sh, 0, sizeof *sh);
    tdm_status st = tddp_spawn(world, c, &g_data, sh, 60000);
    cr_assert_eq(st, TDM_STATUS_OK, "%s / %s", tdm_error_message(), sh->err[0]);
}

/* tdm_dist_share: contiguous shares in rank order that cover [0, n), sizes
 * differing by at most one. */
Test(ddp_mlp, share_splits_n_contiguously_in_rank_order)
{
    for (int world = 1; world <= 9; world++) {
        for (int64_t n = 0; n <= 40; n++) {
            int64_t next = 0, smallest = n, largest = 0;
            for (int r = 0; r < world; r++) {
                int64_t lo, hi;
                tdm_dist_share(n, r, world, &lo, &hi);
                cr_assert_eq(lo, next, "n %lld world %d rank %d: starts at %lld, not %lld",
                             (long long)n, world, r, (long long)lo, (long long)next);
                cr_assert_geq(hi, lo);
                if (hi - lo < smallest) smallest = hi - lo;
                if (hi - lo > largest) largest = hi - lo;
                next = hi;
            }
            cr_assert_eq(next, n, "n %lld world %d: shares end at %lld", (long long)n, world,
                         (long long)next);
            cr_assert_leq(largest - smallest, 1, "n %lld world %d", (long long)n, world);
        }
    }
}

/* tdm_ddp_forward_global on the whole global batch computes what a rank
 * feeding only its own share to tdm_ddp_forward_scaled with 1/B computes
 * (the helpers' path, checked against one device above): bitwise. */
typedef struct global_out {
    float params[TDDP_MAX_ELEMS];
    int64_t n;
    double loss[4];
    int status[4];
} global_out;

typedef struct global_arg {
    int batch, steps;
    global_out *out;
} global_arg;

static int global_rank(tdm_comm *comm, void *argp)
{
    global_arg *a = argp;
    int rank = tdm_comm_rank(comm);
    tdm_status st = TDM_STATUS_OK;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_model_spec spec;
    tddp_spec(&spec, 0);
    int64_t feat = tdm_data_features(&g_data);
    int64_t *perm = malloc((size_t)g_data.n * sizeof *perm);
    float *x = malloc((size_t)a->batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)a->batch * sizeof *y);
    if (!perm || !x || !y) { st = TDM_STATUS_OUT_OF_MEMORY; goto fail; }
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_ddp_opts o = {.timeout_ms = 20000};
    TDM_TRY(tdm_ddp_init(&ddp, m, comm, &o));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    tdm_train_epoch_order(perm, g_data.n, 1, 0);
    for (int s = 0; s < a->steps; s++) {
        tdm_data_gather(&g_data, perm + (int64_t)s * a->batch, a->batch, x, y);
        double ls = 0.0;
        TDM_TRY(tdm_ddp_zero_grad(ddp));
        TDM_TRY(tdm_ddp_forward_global(ddp, x, y, a->batch, &ls));
        TDM_TRY(tdm_ddp_backward(ddp));
        TDM_TRY(tdm_ddp_step(ddp, opt));
        if (rank == 0 && s < 4) a->out->loss[s] = tdm_ddp_loss_sum(ddp) / a->batch;
    }
    if (rank == 0) {
        a->out->n = tdm_model_param_elems(m);
        memcpy(a->out->params, tdm_model_params(m), (size_t)a->out->n * sizeof(float));
    }
fail:
    if (rank < 4) a->out->status[rank] = st;
    tdm_ddp_free(ddp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    free(perm);
    free(x);
    free(y);
    return st ? 1 : 0;
}

Test(ddp_mlp, forward_global_equals_own_share_scaled_bitwise)
{
    static const int cases[][3] = {{2, 24, 3}, {3, 23, 3}, {4, 23, 2}, {3, 2, 2}};
    tddp_shared *sh = tddp_shared_new();
    global_out *out = mmap(NULL, sizeof *out, PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(sh && out != MAP_FAILED);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int world = cases[k][0];
        memset(out, 0, sizeof *out);
        global_arg a = {.batch = cases[k][1], .steps = cases[k][2], .out = out};
        tdm_dist_spawn_opts so = {.timeout_ms = 60000, .arena_bytes = 1 << 20,
                                 .comm_timeout_ms = 20000};
        cr_assert_eq(tdm_dist_spawn(world, global_rank, &a, &so, NULL), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        tddp_cfg c = tddp_cfg_default();
        c.batch = a.batch;
        c.steps = a.steps;
        run_to(&c, world, sh);
        cr_assert_eq(out->n, sh->n_elem);
        cr_assert(!memcmp(out->params, sh->params, (size_t)out->n * sizeof(float)),
                  "world %d batch %d: forward_global's parameters differ", world, a.batch);
        for (int s = 0; s < a.steps; s++)
            cr_assert_eq(out->loss[s], sh->loss[s], "world %d batch %d step %d", world, a.batch,
                         s);
    }
    munmap(out, sizeof *out);
    tddp_shared_free(sh);
}

Test(ddp_mlp, overlap_on_and_off_bit_identical)
{
    tddp_shared *a = tddp_shared_new(), *b = tddp_shared_new();
    for (int w = 2; w <= 4; w++) {
        tddp_cfg c = tddp_cfg_default();
        c.steps = 5;
        c.cap_bytes = 300;    /* 3 buckets from the second step on (test_ddp_reducer.c) */
        run_to(&c, w, a);
        c.no_overlap = 1;
        run_to(&c, w, b);
        cr_assert_gt(a->n_buckets, 2);
        cr_assert_eq(a->timed_steps, 5);
        cr_assert(a->launch_order_ok, "buckets not launched in order after becoming ready");
        cr_assert(b->launch_order_ok);
        cr_assert(!memcmp(a->params, b->params, (size_t)a->n_elem * 4), "world %d", w);
        cr_assert(!memcmp(a->grads0, b->grads0, (size_t)a->n_elem * 4), "world %d", w);
        cr_assert(!memcmp(a->loss, b->loss, sizeof a->loss), "world %d", w);
    }
    tddp_shared_free(a);
    tddp_shared_free(b);
}

Test(ddp_mlp, no_sync_accumulation_equals_large_batch)
{
    tddp_shared *a = tddp_shared_new(), *b = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.batch = 32;
    c.steps = 3;
    run_to(&c, 2, a);
    c.micro = 4;           /* 3 no_sync micro-batches + 1 synchronised */
    run_to(&c, 2, b);
    cr_assert(tddp_excess(b->grads0, a->grads0, a->n_elem, 1e-6, 1e-4, NULL) <= 0);
    cr_assert(tddp_excess(b->params, a->params, a->n_elem, 1e-6, 1e-4, NULL) <= 0);
    for (int s = 0; s < 3; s++) cr_assert(fabs(a->loss[s] - b->loss[s]) < 1e-5);
    tddp_shared_free(a);
    tddp_shared_free(b);
}

Test(ddp_mlp, skipped_backward_is_a_mismatch_not_a_hang)
{
    tddp_shared *sh = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.steps = 4;
    c.skip_backward_rank = 1;
    tdm_status st = tddp_spawn(3, &c, &g_data, sh, 30000);
    cr_assert_neq(st, TDM_STATUS_OK);
    for (int r = 0; r < 3; r++) {
        cr_assert_neq(sh->status[r], TDM_STATUS_OK, "rank %d did not fail", r);
        cr_assert(strstr(sh->err[r], "mismatch") || strstr(sh->err[r], "rank 1"), "rank %d: %s",
                  r, sh->err[r]);
    }
    cr_assert(strstr(sh->err[0], "rank 1"), "%s", sh->err[0]);
    tddp_shared_free(sh);
}

Test(ddp_mlp, different_layout_fails_at_construction)
{
    tddp_shared *sh = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.bad_layout_rank = 2;
    tdm_status st = tddp_spawn(3, &c, &g_data, sh, 30000);
    cr_assert_neq(st, TDM_STATUS_OK);
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(sh->status[r], TDM_STATUS_MISMATCH, "rank %d: %s", r, sh->err[r]);
        cr_assert(strstr(sh->err[r], "rank 2"), "rank %d: %s", r, sh->err[r]);
    }
    cr_assert(strstr(sh->err[2], "fc2"), "%s", sh->err[2]);
    tddp_shared_free(sh);
}

/* ---- CNN: batchnorm normalises with each rank's own statistics ---- */

TestSuite(ddp_cnn, .init = setup_cnn, .fini = teardown, .timeout = 120);

/* DDP's gradient is sum_r (B_r / B) g_r, where g_r is the single-device
 * gradient (mean loss) of rank r's shard alone: per-rank batchnorm. */
Test(ddp_cnn, gradient_is_weighted_mean_of_per_shard_gradients)
{
    tdm_model_spec spec;
    tddp_spec(&spec, 1);
    int64_t feat = tdm_data_features(&g_data);
    for (int w = 1; w <= 4; w++) {
        for (int batch = 16; batch <= 17; batch++) {
            tddp_cfg c = tddp_cfg_default();
            c.cnn = 1;
            c.batch = batch;
            tddp_shared *sh = tddp_shared_new();
            tdm_status st = tddp_spawn(w, &c, &g_data, sh, 60000);
            cr_assert_eq(st, TDM_STATUS_OK, "%s / %s", tdm_error_message(), sh->err[0]);
            int64_t *perm = malloc((size_t)g_data.n * sizeof *perm);
            float *x = malloc((size_t)batch * feat * 4);
            int32_t *y = malloc((size_t)batch * 4);
            tdm_train_epoch_order(perm, g_data.n, 1, 0);
            tdm_device *dev;
            cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
            int64_t n = sh->n_elem;
            double *expect = calloc((size_t)n, sizeof *expect);
            for (int r = 0; r < w; r++) {
                int64_t lo, hi;
                tdm_dist_share(batch, r, w, &lo, &hi);
                if (hi == lo) continue;
                tdm_model *m;
                cr_assert_eq(tdm_model_init(&m, dev, &spec, 5), TDM_STATUS_OK);
                tdm_model_set_train(m, 1);
                tdm_data_gather(&g_data, perm + lo, (int)(hi - lo), x, y);
                double l;
                cr_assert_eq(tdm_model_forward_backward(m, x, y, (int)(hi - lo), &l), TDM_STATUS_OK);
                const float *g = tdm_model_grads(m);
                for (int64_t i = 0; i < n; i++) expect[i] += (double)(hi - lo) / batch * g[i];
                tdm_model_free(m);
            }
            for (int64_t i = 0; i < n; i++)
                cr_assert(fabs(sh->grads0[i] - expect[i]) <= 1e-5 + 1e-4 * fabs(expect[i]),
                          "world %d batch %d grad[%lld]: %g vs %g", w, batch, (long long)i,
                          sh->grads0[i], expect[i]);
            if (w > 1) cr_assert(!memcmp(sh->params, sh->params_r1, (size_t)n * 4));
            free(expect);
            free(perm);
            free(x);
            free(y);
            tdm_device_free(dev);
            tddp_shared_free(sh);
        }
    }
}

Test(ddp_cnn, one_rank_equals_single_device_and_overlap_bitwise)
{
    check_equiv(1, 16, 3, 1e-6, 1e-6);
    tddp_shared *a = tddp_shared_new(), *b = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.cnn = 1;
    c.batch = 16;
    c.steps = 3;
    c.cap_bytes = 200;
    run_to(&c, 3, a);
    c.no_overlap = 1;
    run_to(&c, 3, b);
    cr_assert(!memcmp(a->params, b->params, (size_t)a->n_elem * 4));
    tddp_shared_free(a);
    tddp_shared_free(b);
}

/* ---- evaluation spread over the ranks ---- */

typedef struct eval_out {
    double loss[4], acc[4];        /* tdm_ddp_evaluate on each rank (float per-row
                                      losses summed in other groups: 1e-6 relative) */
    double loss2[4], acc2[4];      /* on a 2-sample set (fewer rows than ranks) */
    double ref_loss, ref_acc;      /* rank 0 alone, tdm_evaluate on the whole set */
    double ref_loss2, ref_acc2;
    int ok[4];
} eval_out;

static int eval_rank(tdm_comm *comm, void *arg)
{
    eval_out *out = arg;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_model_spec spec;
    tddp_spec(&spec, 1);
    if (tdm_device_open(&dev, "cpu", rank, 1) || tdm_model_init(&m, dev, &spec, 5) ||
        tdm_sgd_init(&opt, m, 0.05f, 0.9f) || tdm_ddp_init(&ddp, m, comm, NULL))
        return 1;
    /* two steps on this rank's own rows: the running statistics differ */
    int64_t feat = tdm_data_features(&g_data);
    for (int s = 0; s < 2; s++) {
        const float *x = g_data.x + (int64_t)(rank * 64 + s * 16) * feat;
        const int32_t *y = g_data.y + rank * 64 + s * 16;
        double l;
        if (tdm_ddp_zero_grad(ddp) || tdm_ddp_forward(ddp, x, y, 16, &l) ||
            tdm_ddp_backward(ddp) || tdm_ddp_step(ddp, opt))
            return 2;
    }
    /* and off on the other ranks: evaluation must use rank 0's */
    if (rank != 0)
        for (int64_t i = 0; i < tdm_model_buffer_elems(m); i++) tdm_model_buffers(m)[i] = 7.0f;
    if (tdm_ddp_evaluate(ddp, &g_data, 100, &out->loss[rank], &out->acc[rank])) return 3;
    tdm_dataset two = g_data;
    two.n = 2;
    if (tdm_ddp_evaluate(ddp, &two, 100, &out->loss2[rank], &out->acc2[rank])) return 4;
    if (rank == 0 && (tdm_evaluate(m, &g_data, 1000, &out->ref_loss, &out->ref_acc) ||
                      tdm_evaluate(m, &two, 1000, &out->ref_loss2, &out->ref_acc2)))
        return 5;
    out->ok[rank] = world;
    tdm_ddp_free(ddp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return 0;
}

Test(ddp_cnn, evaluate_spread_over_ranks_equals_rank0_alone)
{
    eval_out *out = mmap(NULL, sizeof *out, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
    cr_assert_neq(out, MAP_FAILED);
    memset(out, 0, sizeof *out);
    tdm_dist_spawn_opts so = {.timeout_ms = 60000};
    cr_assert_eq(tdm_dist_spawn(3, eval_rank, out, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert(out->ref_acc > 0.0 && out->ref_loss > 0.0);
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(out->ok[r], 3);
        cr_assert(fabs(out->loss[r] - out->ref_loss) <= 1e-6 * out->ref_loss,
                  "rank %d: loss %.12f vs rank 0 alone %.12f", r, out->loss[r], out->ref_loss);
        cr_assert(fabs(out->acc[r] - out->ref_acc) <= 1e-12, "rank %d: accuracy %.12f vs %.12f",
                  r, out->acc[r], out->ref_acc);
        cr_assert(fabs(out->loss2[r] - out->ref_loss2) <= 1e-6 * out->ref_loss2,
                  "rank %d, 2 rows: loss %.12f vs %.12f", r, out->loss2[r], out->ref_loss2);
        cr_assert(fabs(out->acc2[r] - out->ref_acc2) <= 1e-12);
    }
    munmap(out, sizeof *out);
}

/* forward -> evaluate -> backward: evaluation ran forwards on the same
 * model, so the training forward's activations are gone; backward must
 * be refused (it read the evaluation's activations: a heap-buffer-overflow
 * under ASan when the last evaluation chunk outgrew the batch, silently
 * wrong gradients otherwise), and a new forward must make it work again. */
typedef struct eval_bwd_out {
    int refused[4], recovered[4];
    double loss_sum[4], last_loss[4];   /* tdm_ddp_loss_sum; the last forward's loss sum */
    char err[4][512];
} eval_bwd_out;

static int eval_bwd_rank(tdm_comm *comm, void *arg)
{
    eval_bwd_out *out = arg;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_ddp *ddp = NULL;
    tdm_model_spec spec;
    tddp_spec(&spec, 0);
    if (tdm_device_open(&dev, "cpu", rank, 1) || tdm_model_init(&m, dev, &spec, 5) ||
        tdm_ddp_init(&ddp, m, comm, NULL))
        return 1;
    int64_t feat = tdm_data_features(&g_data);
    const float *x = g_data.x + (int64_t)rank * 8 * feat;
    const int32_t *y = g_data.y + rank * 8;
    double l, el, ea;
    /* 4096 rows over 2 ranks in chunks of 100: the last chunk has 48 rows,
     * more than the 8 of the training forward */
    for (int sync = 1; sync >= 0; sync--) {
        tdm_ddp_no_sync(ddp, !sync);
        if (tdm_ddp_zero_grad(ddp) || tdm_ddp_forward(ddp, x, y, 8, &l)) return 2;
        if (tdm_ddp_evaluate(ddp, &g_data, 100, &el, &ea)) return 3;
        tdm_status st = tdm_ddp_backward(ddp);
        if (st == TDM_STATUS_INVALID_ARG) out->refused[rank]++;
        snprintf(out->err[rank], sizeof out->err[rank], "%s", st ? tdm_error_message() : "");
    }
    tdm_ddp_no_sync(ddp, 0);
    if (tdm_ddp_zero_grad(ddp) || tdm_ddp_forward(ddp, x, y, 8, &l)) return 4;
    if (tdm_ddp_backward(ddp) == TDM_STATUS_OK) out->recovered[rank] = 1;
    out->loss_sum[rank] = tdm_ddp_loss_sum(ddp);
    out->last_loss[rank] = l * 8;
    tdm_ddp_free(ddp);
    tdm_model_free(m);
    tdm_device_free(dev);
    return 0;
}

Test(ddp_mlp, backward_after_evaluate_is_refused)
{
    eval_bwd_out *out = mmap(NULL, sizeof *out, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(out, MAP_FAILED);
    memset(out, 0, sizeof *out);
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .arena_bytes = 1 << 20};
    cr_assert_eq(tdm_dist_spawn(2, eval_bwd_rank, out, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(out->refused[r], 2, "rank %d: backward after evaluate accepted (%d of 2 "
                     "refused; last: '%s')", r, out->refused[r], out->err[r]);
        cr_assert(strstr(out->err[r], "tdm_ddp_evaluate") && strstr(out->err[r], "forward"),
                  "rank %d: %s", r, out->err[r]);
        cr_assert(out->recovered[r], "rank %d: a new forward did not make backward work", r);
        /* the invalidated forwards' losses were never reduced: not counted */
        double want = out->last_loss[0] + out->last_loss[1];
        cr_assert(fabs(out->loss_sum[r] - want) <= 1e-5 * want, "rank %d: loss sum %.9g, the "
                  "reduced forwards' %.9g", r, out->loss_sum[r], want);
    }
    munmap(out, sizeof *out);
}
