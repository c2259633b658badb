/* tests/test_ddp_reducer.c: the Reducer's bucket plan and overlap. The
 * plan equals PyTorch's compute_bucket_assignment_by_size on hand-computed
 * cases (first-bucket cap included), for the plan rebuilt after the first
 * step in the order gradients became ready and for find_unused_parameters'
 * construction plan; the rebuilt plan is used from the second step on, and
 * a rank whose rebuilt plan differs is named. On a model large enough for
 * the pipelined and the zero-copy all-reduce (buckets > 4 KiB), bytes are
 * reduced while backward runs with overlap on, none with it off, and the
 * parameters are bit-identical either way. find_unused_parameters finds
 * a layer whose backward did not run and reduces its zeros, and never
 * zeroes what no_sync accumulated. Each test forks its ranks through
 * tdm_dist_spawn (bounded run time, nothing left behind). */
#include <criterion/criterion.h>

#include "tests/test_ddp_util.h"

static tdm_dataset g_data;

static void setup(void) { cr_assert_eq(tddp_data(&g_data, 0, 4096), TDM_STATUS_OK); }
static void teardown(void) { tdm_data_free(&g_data); }

TestSuite(ddp_reducer, .init = setup, .fini = teardown, .timeout = 120);

static void run_to(tddp_cfg *c, int world, tddp_shared *sh)
{
    memset(sh, 0, sizeof *sh);
    tdm_status st = tddp_spawn(world, c, &g_data, sh, 60000);
    cr_assert_eq(st, TDM_STATUS_OK, "%s / %s", tdm_error_message(), sh->err[0]);
}

/* A plan: nb buckets, each {first, last} parameter. */
typedef struct plan_case {
    size_t cap, first;
    int nb;
    int b[6][2];
} plan_case;

static void check_plan(const plan_case *pc, const tddp_shared *sh, const char *what)
{
    cr_assert_eq(sh->n_buckets, pc->nb, "%s, cap %zu first %zu: %d buckets, expected %d", what,
                 pc->cap, pc->first, sh->n_buckets, pc->nb);
    for (int b = 0; b < pc->nb; b++) {
        cr_assert(sh->plan[b][0] == pc->b[b][0] && sh->plan[b][1] == pc->b[b][1],
                  "%s, cap %zu first %zu: bucket %d holds parameters %d..%d, expected %d..%d",
                  what, pc->cap, pc->first, b, sh->plan[b][0], sh->plan[b][1], pc->b[b][0],
                  pc->b[b][1]);
        cr_assert(sh->plan_r1[b][0] == sh->plan[b][0] && sh->plan_r1[b][1] == sh->plan[b][1],
                  "%s: the last rank's bucket %d differs from rank 0's", what, b);
    }
}

/* MLP 20-16-12-5: parameters 0..5 are fc1.weight (1280 bytes), fc1.bias
 * (64), fc2.weight (768), fc2.bias (48), fc3.weight (240), fc3.bias (20).
 * Backward finishes fc3, fc2, fc1, so gradients become ready in the order
 * 5 4 3 2 1 0. PyTorch's rule over that order: add the parameter, close
 * the bucket once it holds >= the limit (first_bucket_bytes for the first
 * bucket closed, clamped to the cap; the cap after it). */
Test(ddp_reducer, rebuilt_plan_is_pytorchs_rule_over_the_ready_order)
{
    static const plan_case cases[] = {
        /* every parameter reaches the cap alone: one bucket each */
        {4, 0, 6, {{5, 5}, {4, 4}, {3, 3}, {2, 2}, {1, 1}, {0, 0}}},
        {20, 0, 6, {{5, 5}, {4, 4}, {3, 3}, {2, 2}, {1, 1}, {0, 0}}},
        /* 20+240 reaches 260 exactly; 48+768 and 64+1280 pass it (the old
         * rule closed before passing the cap: 5 buckets) */
        {260, 0, 3, {{4, 5}, {2, 3}, {0, 1}}},
        /* 20+240+48 = 308 >= 300; 768 alone; 64+1280 */
        {300, 0, 3, {{3, 5}, {2, 2}, {0, 1}}},
        /* a first-bucket cap above the cap is clamped to it */
        {300, 5000, 3, {{3, 5}, {2, 2}, {0, 1}}},
        /* first bucket closes at 100 (20+240), the rest at 1000: 48+768+64+1280 */
        {1000, 100, 2, {{4, 5}, {0, 3}}},
        /* first cap clamped to 1000: 20+240+48+768 = 1076, then 64+1280 */
        {1000, 0, 2, {{2, 5}, {0, 1}}},
        /* first bucket is fc3.bias alone, the rest under the cap */
        {1 << 30, 20, 2, {{5, 5}, {0, 4}}},
        {1 << 30, 0, 1, {{0, 5}}},
    };
    tddp_shared *sh = tddp_shared_new();
    double ref_loss[TDDP_MAX_STEPS];
    static float ref_g[TDDP_MAX_ELEMS], ref_p[TDDP_MAX_ELEMS];
    int64_t n = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tddp_cfg c = tddp_cfg_default();
        c.steps = 3;
        c.cap_bytes = cases[i].cap;
        c.first_bytes = cases[i].first;
        run_to(&c, 3, sh);
        check_plan(&cases[i], sh, "rebuilt");
        /* the first step reduced one bucket; the rebuilt plan from step 2 on */
        cr_assert_eq(sh->nb_step[0], 1, "cap %zu: first step used %d buckets", cases[i].cap,
                     sh->nb_step[0]);
        for (int s = 1; s < c.steps; s++)
            cr_assert_eq(sh->nb_step[s], cases[i].nb, "cap %zu: step %d used %d buckets",
                         cases[i].cap, s + 1, sh->nb_step[s]);
        cr_assert(sh->zero_copy);
        cr_assert_eq(tddp_reference(&c, &g_data, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK);
        cr_assert(tddp_excess(sh->params, ref_p, n, 1e-6, 1e-4, NULL) <= 0, "cap %zu",
                  cases[i].cap);
    }
    tddp_shared_free(sh);
}

/* With find_unused_parameters PyTorch plans once, at construction, walking
 * the parameters in definition order (0 1 2 3 4 5) and reversing the
 * groups, so the first-bucket cap applies to the first layer's parameters,
 * which are reduced last; it never rebuilds. */
Test(ddp_reducer, find_unused_plan_walks_definition_order_and_is_kept)
{
    static const plan_case cases[] = {
        {4, 0, 6, {{5, 5}, {4, 4}, {3, 3}, {2, 2}, {1, 1}, {0, 0}}},
        /* 1280 >= 260; 64+768; 48+240; 20 left open */
        {260, 0, 4, {{5, 5}, {3, 4}, {1, 2}, {0, 0}}},
        /* 1280 >= 100 (first); 64+768+48+240 = 1120 >= 1000; 20 left open */
        {1000, 100, 3, {{5, 5}, {1, 4}, {0, 0}}},
        {1 << 30, 0, 1, {{0, 5}}},
    };
    tddp_shared *sh = tddp_shared_new();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tddp_cfg c = tddp_cfg_default();
        c.steps = 3;
        c.find_unused = 1;
        c.cap_bytes = cases[i].cap;
        c.first_bytes = cases[i].first;
        run_to(&c, 2, sh);
        check_plan(&cases[i], sh, "find_unused_parameters");
        for (int s = 0; s < c.steps; s++)
            cr_assert_eq(sh->nb_step[s], cases[i].nb, "cap %zu: step %d used %d buckets",
                         cases[i].cap, s + 1, sh->nb_step[s]);
    }
    tddp_shared_free(sh);
}

Test(ddp_reducer, rebuilt_plan_that_differs_names_the_rank)
{
    tddp_shared *sh = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.steps = 3;
    c.cap_bytes = 260;       /* 3 buckets */
    c.cap_rank = 2;
    c.rank_cap_bytes = 4;    /* 6 buckets on rank 2 */
    tdm_status st = tddp_spawn(3, &c, &g_data, sh, 30000);
    cr_assert_neq(st, TDM_STATUS_OK);
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(sh->status[r], TDM_STATUS_MISMATCH, "rank %d: %s", r, sh->err[r]);
        cr_assert(strstr(sh->err[r], "rank 2 planned 6"), "rank %d: %s", r, sh->err[r]);
        cr_assert(strstr(sh->err[r], "rebuilt"), "rank %d: %s", r, sh->err[r]);
    }
    /* the first step (one bucket everywhere) went through */
    cr_assert_eq(sh->nb_step[0], 1);
    tddp_shared_free(sh);
}

/* ---- overlap on a model with buckets past the one-shot size ---- */

/* MLP 20-96-96-96-5, cap 16 KiB: ready order fc4.bias, fc4.weight,
 * fc3.bias, fc3.weight (39188 bytes) | fc2 (37248) | fc1 (8064): three
 * buckets, each above the shm communicator's one-shot limit (512 B for
 * two ranks, 4 KiB otherwise), so
 * they go through the zero-copy reduce-scatter/all-gather (gradients in
 * the arena) or the pipelined copy through the slots (no arena). */
static const int k_big[] = {20, 96, 96, 96, 5};

static tddp_cfg big_cfg(int no_arena, int no_overlap)
{
    tddp_cfg c = tddp_cfg_default();
    c.dims = k_big;
    c.ndims = 5;
    c.batch = 32;
    c.steps = 4;
    c.cap_bytes = 16384;
    c.no_arena = no_arena;
    c.no_overlap = no_overlap;
    return c;
}

Test(ddp_reducer, overlap_reduces_during_backward_on_pipelined_and_zero_copy_paths)
{
    tddp_shared *on = tddp_shared_new(), *off = tddp_shared_new();
    double ref_loss[TDDP_MAX_STEPS];
    static float ref_g[TDDP_MAX_ELEMS], ref_p[TDDP_MAX_ELEMS];
    int64_t n = 0;
    tddp_cfg rc = big_cfg(0, 0);
    cr_assert_eq(tddp_reference(&rc, &g_data, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK);
    for (int w = 2; w <= 3; w++) {
        for (int no_arena = 0; no_arena <= 1; no_arena++) {
            const char *path = no_arena ? "pipelined (copying)" : "zero-copy";
            tddp_cfg c = big_cfg(no_arena, 0);
            run_to(&c, w, on);
            c.no_overlap = 1;
            run_to(&c, w, off);
            cr_assert_eq(on->zero_copy, !no_arena, "%s: zero_copy %d", path, on->zero_copy);
            cr_assert_eq(on->n_buckets, 3, "%s: %d buckets", path, on->n_buckets);
            for (int b = 0; b < 3; b++)
                cr_assert_gt(on->plan_elems[b] * 4, 4096, "%s: bucket %d has %lld bytes", path, b,
                             (long long)on->plan_elems[b] * 4);
            /* the first step's single bucket is reduced after backward; from
             * the second on, buckets 0 and 1 while backward runs */
            int last = c.steps - 1;
            double per_step = (double)(on->plan_elems[0] + on->plan_elems[1]) * 4.0;
            cr_assert_eq(on->overlapped[0], 0.0, "%s", path);
            cr_assert_eq(on->overlapped[last], per_step * last,
                         "world %d, %s, overlap on: %.0f bytes reduced during backward, "
                         "expected %.0f", w, path, on->overlapped[last], per_step * last);
            cr_assert_eq(off->overlapped[last], 0.0, "world %d, %s, overlap off: %.0f bytes",
                         w, path, off->overlapped[last]);
            cr_assert_eq(on->reduced[last], off->reduced[last]);
            cr_assert(on->reduced[last] > on->overlapped[last]);
            /* same collectives on the same data: the same bits */
            cr_assert(!memcmp(on->params, off->params, (size_t)n * 4), "world %d, %s", w, path);
            cr_assert(!memcmp(on->grads0, off->grads0, (size_t)n * 4), "world %d, %s", w, path);
            cr_assert(!memcmp(on->params, on->params_r1, (size_t)n * 4), "world %d, %s", w, path);
            for (int s = 0; s < c.steps; s++)
                cr_assert(fabs(on->loss[s] - ref_loss[s]) <= 1e-5 + 1e-4 * fabs(ref_loss[s]),
                          "world %d, %s, step %d: loss %.8f vs one device %.8f", w, path, s,
                          on->loss[s], ref_loss[s]);
            int64_t at = 0;
            cr_assert(tddp_excess(on->params, ref_p, n, 1e-6, 1e-3, &at) <= 0,
                      "world %d, %s: param[%lld] %g vs one device %g", w, path, (long long)at,
                      on->params[at], ref_p[at]);
        }
    }
    tddp_shared_free(on);
    tddp_shared_free(off);
}

/* ---- unused parameters ---- */

/* MLP 20-16-12-5 as above; layer 0 is fc1 (parameters 0 and 1, elements
 * 0..335 of the flat buffer with padding), fc2.weight starts at 336.
 * Stopping backward at layer 1 leaves fc1 out of the step: its gradient
 * is not touched and its grad-ready hook does not fire. */
#define FC1_ELEMS 336

Test(ddp_reducer, backward_stop_leaves_the_layers_below_out)
{
    tdm_device *dev;
    tdm_model *m;
    tdm_model_spec spec;
    tddp_spec(&spec, 0);
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, 5), TDM_STATUS_OK);
    int64_t n = tdm_model_param_elems(m);
    float *full = malloc((size_t)n * 4);
    double l;
    cr_assert_eq(tdm_model_forward_backward(m, g_data.x, g_data.y, 24, &l), TDM_STATUS_OK);
    memcpy(full, tdm_model_grads(m), (size_t)n * 4);
    cr_assert_eq(tdm_model_zero_grad(m), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_set_backward_stop(m, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_forward_backward(m, g_data.x, g_data.y, 24, &l), TDM_STATUS_OK);
    const float *g = tdm_model_grads(m);
    for (int64_t i = 0; i < FC1_ELEMS; i++) cr_assert_eq(g[i], 0.0f, "fc1 grad [%lld]", (long long)i);
    cr_assert(!memcmp(g + FC1_ELEMS, full + FC1_ELEMS, (size_t)(n - FC1_ELEMS) * 4));
    cr_assert_eq(tdm_model_set_backward_stop(m, 4), TDM_STATUS_INVALID_ARG);
    free(full);
    tdm_model_free(m);
    tdm_device_free(dev);
}

/* find_unused_parameters finds fc1 unused from the step itself (its hook
 * did not fire) and reduces that rank's gradient as it stands: zeros. */
Test(ddp_reducer, find_unused_parameters_detects_a_layer_left_out)
{
    tddp_shared *sh = tddp_shared_new(), *ref = tddp_shared_new();
    tddp_shared *other = tddp_shared_new(), *z = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.cap_bytes = 100;
    c.find_unused = 1;
    run_to(&c, 2, ref);
    c.detach_layer = 1;
    c.detach_ranks = 2;      /* fc1 takes no part on rank 1 */
    run_to(&c, 2, sh);
    c.detach_ranks = 1;      /* on rank 0 */
    run_to(&c, 2, other);
    c.detach_ranks = 3;      /* on both */
    run_to(&c, 2, z);
    int64_t n = ref->n_elem;
    for (int64_t i = 0; i < FC1_ELEMS; i++) cr_assert_eq(z->grads0[i], 0.0f);
    cr_assert(!memcmp(z->grads0 + FC1_ELEMS, ref->grads0 + FC1_ELEMS,
                      (size_t)(n - FC1_ELEMS) * 4), "the used parameters' gradients changed");
    /* each rank's share alone: rank 0's (rank 1 unused) plus rank 1's
     * (rank 0 unused) is the full gradient, so a wrong scale, a doubled
     * or a garbage share fails */
    int differs = 0;
    for (int64_t i = 0; i < FC1_ELEMS; i++) {
        double sum = (double)sh->grads0[i] + other->grads0[i], want = ref->grads0[i];
        differs |= sh->grads0[i] != ref->grads0[i];
        cr_assert(fabs(sum - want) <= 1e-6 + 1e-4 * fabs(want),
                  "fc1 grad [%lld]: shares %g + %g != %g", (long long)i, sh->grads0[i],
                  other->grads0[i], ref->grads0[i]);
    }
    cr_assert(differs);
    cr_assert(!memcmp(sh->grads0, sh->grads0_r1, (size_t)n * 4), "ranks disagree");
    /* without the option: that backward fails on every rank, naming fc1 */
    c.find_unused = 0;
    c.detach_ranks = 2;
    memset(sh, 0, sizeof *sh);
    tdm_status st = tddp_spawn(2, &c, &g_data, sh, 30000);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert(strstr(sh->err[1], "fc1.weight"), "rank 1: %s", sh->err[1]);
    cr_assert(strstr(sh->err[1], "find_unused_parameters"), "rank 1: %s", sh->err[1]);
    cr_assert_neq(sh->status[0], TDM_STATUS_OK, "rank 0 should fail too");
    tddp_shared_free(sh);
    tddp_shared_free(ref);
    tddp_shared_free(other);
    tddp_shared_free(z);
}

/* A parameter used in a no_sync micro-batch and unused (on every rank) in
 * the synchronised one: what no_sync accumulated is reduced, not zeroed.
 * Global batch 24 in two micro-batches of 12, loss gradient scaled by
 * 1/24: fc1's reduced gradient is half the mean-loss gradient of the
 * first 12 rows; every other parameter's is the full batch's. */
Test(ddp_reducer, find_unused_never_zeroes_what_no_sync_accumulated)
{
    tddp_shared *sh = tddp_shared_new();
    tddp_cfg c = tddp_cfg_default();
    c.micro = 2;
    c.find_unused = 1;
    c.detach_layer = 1;
    c.detach_ranks = 3;
    c.detach_micro = 1;      /* the synchronised micro-batch */
    run_to(&c, 2, sh);
    double ref_loss[TDDP_MAX_STEPS];
    static float ref_g[TDDP_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tddp_reference(&c, &g_data, ref_loss, ref_g, NULL, &n), TDM_STATUS_OK);
    /* the first 12 rows of the first global batch, on one device */
    tdm_device *dev;
    tdm_model *m;
    tdm_model_spec spec;
    tddp_spec(&spec, 0);
    int64_t feat = tdm_data_features(&g_data), *perm = malloc((size_t)g_data.n * 8);
    float *x = malloc((size_t)12 * feat * 4);
    int32_t *y = malloc(12 * 4);
    tdm_train_epoch_order(perm, g_data.n, 1, 0);
    tdm_data_gather(&g_data, perm, 12, x, y);
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, 5), TDM_STATUS_OK);
    double l;
    cr_assert_eq(tdm_model_forward_backward(m, x, y, 12, &l), TDM_STATUS_OK);
    const float *g12 = tdm_model_grads(m);
    int nonzero = 0;
    for (int64_t i = 0; i < n; i++) {
        double want = i < FC1_ELEMS ? 0.5 * g12[i] : ref_g[i];
        nonzero |= i < FC1_ELEMS && sh->grads0[i] != 0.0f;
        cr_assert(fabs(sh->grads0[i] - want) <= 1e-6 + 1e-4 * fabs(want),
                  "grad [%lld] (%s): %g, expected %g", (long long)i,
                  i < FC1_ELEMS ? "fc1, accumulated under no_sync" : "used", sh->grads0[i],
                  want);
    }
    cr_assert(nonzero, "fc1's accumulated gradient was zeroed");
    tdm_model_free(m);
    tdm_device_free(dev);
    free(perm);
    free(x);
    free(y);
    tddp_shared_free(sh);
}
