/* tests/test_ddp_hooks.c: DDP communication hooks (ddp/hooks.h). fp16 and
 * bf16 give bit for bit the 16-bit rounding of the float32 rank-order sum
 * of the ranks' rounded values, over 2..4 ranks and buckets on both sides
 * of the shm one-shot size, with half the bytes; PowerSGD's error
 * feedback makes the running mean of its outputs on a fixed gradient
 * converge to the uncompressed sum (and without error feedback it does
 * not), vectors pass exact; the float32 hook through the hook path
 * (check tail reduced apart) gives bitwise the parameters of no hook;
 * DDP training with fp16/bf16/powersgd stays within the bound the
 * compression allows of one device; a user hook with state sees every
 * bucket, and one that fails on one rank fails every rank with its
 * message. */
#include <criterion/criterion.h>

#include "tests/test_ddp_util.h"

static tdm_dataset g_data;
static void setup(void) { cr_assert_eq(tddp_data(&g_data, 0, 4096), TDM_STATUS_OK); }
static void teardown(void) { tdm_data_free(&g_data); }
TestSuite(ddp_hooks, .init = setup, .fini = teardown, .timeout = 180);

/* ---- fp16 / bf16 against the rounded all-reduce, bit for bit ---- */

typedef struct half_res {
    int64_t wrong[8];
    double bytes[8];
    int status[8];
    char err[8][256];
} half_res;

typedef struct half_arg {
    const char *hook;
    int64_t n;
    half_res *res;
} half_arg;

/* Rank r's value i: spread over many binades, signs mixed, some that
 * overflow fp16 or fall below its normal range. */
static float half_value(int r, int64_t i)
{
    tdm_rng g;
    tdm_rng_init(&g, 1000 + (uint64_t)r, TDM_RNG_STREAM_TEST + (uint64_t)i);
    float v = tdm_rng_normal(&g) * ldexpf(1.0f, (int)tdm_rng_below(&g, 30) - 20);
    if (i % 97 == 5) v = 70000.0f * (r + 1);   /* fp16 overflows */
    return v;
}

static int half_rank(tdm_comm *comm, void *p)
{
    half_arg *a = p;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_ddp_comm_hook h = {0};
    tdm_status st = TDM_STATUS_OK;
    int bf = !strcmp(a->hook, "bf16");
    float *g = malloc((size_t)a->n * sizeof *g);
    if (!g) return 1;
    for (int64_t i = 0; i < a->n; i++) g[i] = half_value(rank, i);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    tdm_model_spec spec;
    tddp_spec(&spec, 0);
    TDM_TRY(tdm_model_init(&m, dev, &spec, 1));   /* the hook asks for its device only */
    TDM_TRY(tdm_ddp_hook_builtin_init(&h, a->hook, NULL));
    tdm_ddp_hook_bucket b = {.index = 0, .grads = g, .n_elem = a->n, .model = m, .comm = comm,
                             .timeout_ms = 20000};
    TDM_TRY(h.launch(h.state, &b));
    TDM_TRY(h.wait(h.state, &b));
    int64_t wrong = 0;
    for (int64_t i = 0; i < a->n; i++) {
        float acc = 0.0f;   /* the rounded values, summed in float32 in rank order */
        for (int k = 0; k < world; k++) {
            float v = half_value(k, i);
            acc += bf ? tdm_bf16_to_f32(tdm_f32_to_bf16(v)) : tdm_f16_to_f32(tdm_f32_to_f16(v));
        }
        float want = bf ? tdm_bf16_to_f32(tdm_f32_to_bf16(acc))
                        : tdm_f16_to_f32(tdm_f32_to_f16(acc));
        if (memcmp(&want, &g[i], 4)) wrong++;
    }
    a->res->wrong[rank] = wrong;
    a->res->bytes[rank] = b.bytes;
fail:
    a->res->status[rank] = st;
    if (st) snprintf(a->res->err[rank], sizeof a->res->err[rank], "%s", tdm_error_message());
    tdm_ddp_hook_builtin_free(&h);
    tdm_model_free(m);
    tdm_device_free(dev);
    free(g);
    return st ? 1 : 0;
}

Test(ddp_hooks, fp16_bf16_equal_an_all_reduce_of_the_rounded_values)
{
    half_res *res = mmap(NULL, sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
    cr_assert(res != MAP_FAILED);
    const char *hooks[] = {"fp16", "bf16"};
    const int64_t sizes[] = {37, 3000, 40000};   /* one-shot, and the pipelined path */
    for (int hi = 0; hi < 2; hi++)
        for (int world = 2; world <= 4; world++)
            for (int si = 0; si < 3; si++) {
                memset(res, 0, sizeof *res);
                half_arg a = {.hook = hooks[hi], .n = sizes[si], .res = res};
                tdm_dist_spawn_opts o = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
                tdm_status st = tdm_dist_spawn(world, half_rank, &a, &o, NULL);
                cr_assert_eq(st, TDM_STATUS_OK, "%s world %d n %lld: %s / %s", hooks[hi], world,
                             (long long)sizes[si], tdm_error_message(), res->err[0]);
                for (int r = 0; r < world; r++) {
                    cr_assert_eq(res->wrong[r], 0, "%s, %d ranks, %lld values: rank %d has %lld "
                                 "values that differ from the rounded all-reduce", hooks[hi],
                                 world, (long long)sizes[si], r, (long long)res->wrong[r]);
                    cr_assert_eq(res->bytes[r], 2.0 * (double)sizes[si]);
                }
            }
    munmap(res, sizeof *res);
}

/* ---- PowerSGD's error feedback on a fixed gradient ---- */

#define PS_STEPS 1000
typedef struct ps_res {
    double rel_err[2][PS_STEPS];   /* [feedback off/on][t]: |mean of outputs - sum| / |sum| */
    double vec_err[2];             /* largest |output - sum| over the vectors */
    double bytes[2], plain_bytes;
    int status[8];
    char err[8][256];
} ps_res;

typedef struct ps_arg {
    ps_res *res;
} ps_arg;

static float ps_grad(int r, int64_t i)
{
    tdm_rng g;
    tdm_rng_init(&g, 77 + (uint64_t)r, TDM_RNG_STREAM_TEST + (uint64_t)i);
    return tdm_rng_normal(&g) * 0.01f;
}

static int ps_rank(tdm_comm *comm, void *p)
{
    ps_arg *a = p;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_status st = TDM_STATUS_OK;
    tdm_ddp_comm_hook h = {0};
    float *g = NULL, *target = NULL;
    double *sum = NULL;
    int dims[] = {40, 32, 24, 5};
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_mlp_init(&m, dev, dims, 4, 1));
    int64_t n = tdm_model_param_elems(m);
    g = malloc((size_t)n * sizeof *g);
    target = calloc((size_t)n, sizeof *target);
    sum = calloc((size_t)n, sizeof *sum);
    if (!g || !target || !sum) { st = TDM_STATUS_OUT_OF_MEMORY; goto fail; }
    for (int64_t i = 0; i < n; i++)
        for (int k = 0; k < world; k++) target[i] += ps_grad(k, i);
    for (int fb = 0; fb <= 1; fb++) {
        tdm_ddp_powersgd_opts po = {.rank = 1, .start_step = 1, .seed = 3,
                                    .no_error_feedback = !fb};
        TDM_TRY(tdm_ddp_hook_builtin_init(&h, "powersgd", &po));
        memset(sum, 0, (size_t)n * sizeof *sum);
        for (int t = 0; t <= PS_STEPS; t++) {
            for (int64_t i = 0; i < n; i++) g[i] = ps_grad(rank, i);
            tdm_ddp_hook_bucket b = {.grads = g, .n_elem = n, .first_param = 0,
                                     .last_param = tdm_model_n_params(m) - 1, .model = m,
                                     .comm = comm, .step = t, .timeout_ms = 20000};
            TDM_TRY(h.launch(h.state, &b));
            TDM_TRY(h.wait(h.state, &b));
            if (t == 0) {   /* before start_step: the plain float32 sum */
                a->res->plain_bytes = b.bytes;
                continue;
            }
            a->res->bytes[fb] = b.bytes;
            double num = 0.0, den = 0.0;
            for (int pi = 0; pi < tdm_model_n_params(m); pi++) {
                const tdm_tensor_info *ti = tdm_model_param_info(m, pi);
                for (int64_t i = ti->offset; i < ti->offset + ti->n_elem; i++) {
                    sum[i] += g[i];
                    if (ti->ndim < 2) {
                        double e = fabs((double)g[i] - target[i]);
                        if (e > a->res->vec_err[fb]) a->res->vec_err[fb] = e;
                        continue;
                    }
                    double d = sum[i] / t - target[i];
                    num += d * d;
                    den += (double)target[i] * target[i];
                }
            }
            if (rank == 0) a->res->rel_err[fb][t - 1] = sqrt(num / den);
        }
        tdm_ddp_hook_builtin_free(&h);
    }
fail:
    a->res->status[rank] = st;
    if (st) snprintf(a->res->err[rank], sizeof a->res->err[rank], "%s", tdm_error_message());
    tdm_ddp_hook_builtin_free(&h);
    free(g);
    free(target);
    free(sum);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(ddp_hooks, powersgd_error_feedback_converges_on_a_fixed_gradient)
{
    ps_res *res = mmap(NULL, sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                       -1, 0);
    cr_assert(res != MAP_FAILED);
    memset(res, 0, sizeof *res);
    ps_arg a = {.res = res};
    tdm_dist_spawn_opts o = {.timeout_ms = 120000, .comm_timeout_ms = 20000};
    cr_assert_eq(tdm_dist_spawn(2, ps_rank, &a, &o, NULL), TDM_STATUS_OK, "%s / %s",
                 tdm_error_message(), res->err[0]);
    double *on = res->rel_err[1], *off = res->rel_err[0];
    /* one step: a rank-1 approximation of random matrices misses most */
    cr_assert(on[0] > 0.3, "first step's error %.3f: not compressing?", on[0]);
    /* with error feedback what was missed comes back later: the mean of
     * the outputs approaches the uncompressed sum (about 1/t) */
    cr_assert(on[PS_STEPS - 1] < 0.05 * on[0] && on[PS_STEPS - 1] < 0.03,
              "error feedback: relative error %.4f after %d steps (%.4f after 1)",
              on[PS_STEPS - 1], PS_STEPS, on[0]);
    /* once the error has stopped growing, the rest is 1/t: halving per
     * doubling of t (0.958, 0.249 at 64, 0.131 at 128, 0.032 at 512 here) */
    cr_assert(on[PS_STEPS - 1] < 0.6 * on[PS_STEPS / 2 - 1], "%.4f at %d, %.4f at %d",
              on[PS_STEPS - 1], PS_STEPS, on[PS_STEPS / 2 - 1], PS_STEPS / 2);
    /* without it the same rank-1 part is sent every step: no progress */
    cr_assert(off[PS_STEPS - 1] > 0.5 * off[0], "no feedback: %.4f after %d steps, %.4f after 1",
              off[PS_STEPS - 1], PS_STEPS, off[0]);
    /* biases travel uncompressed: exactly the float32 sum of two values */
    cr_assert(res->vec_err[1] == 0.0 && res->vec_err[0] == 0.0, "vectors off by %g / %g",
              res->vec_err[1], res->vec_err[0]);
    cr_assert(res->bytes[1] < 0.3 * res->plain_bytes, "powersgd moved %.0f bytes, plain %.0f",
              res->bytes[1], res->plain_bytes);
    munmap(res, sizeof *res);
}

/* ---- hooks inside DDP training ---- */

Test(ddp_hooks, float32_hook_path_is_bitwise_the_default)
{
    tddp_shared *a = tddp_shared_new(), *b = tddp_shared_new();
    cr_assert(a && b);
    tddp_cfg c = tddp_cfg_default();
    c.steps = 4;
    c.cap_bytes = 512;   /* several buckets: hooks launched during backward */
    cr_assert_eq(tddp_spawn(3, &c, &g_data, a, 60000), TDM_STATUS_OK, "%s", a->err[0]);
    tdm_ddp_comm_hook h;
    cr_assert_eq(tdm_ddp_hook_builtin_init(&h, "allreduce", NULL), TDM_STATUS_OK);
    c.user_hook = &h;
    cr_assert_eq(tddp_spawn(3, &c, &g_data, b, 60000), TDM_STATUS_OK, "%s", b->err[0]);
    cr_assert(a->n_buckets > 1, "%d buckets", a->n_buckets);
    cr_assert(!memcmp(a->params, b->params, (size_t)a->n_elem * 4));
    for (int s = 0; s < c.steps; s++) cr_assert_eq(a->loss[s], b->loss[s]);
    cr_assert(b->overlapped[c.steps - 1] > 0, "no bucket was launched during backward");
    /* every bucket after backward (no_overlap), and find_unused's plan */
    for (int k = 0; k < 2; k++) {
        tddp_cfg c2 = c;
        c2.no_overlap = k == 0;
        c2.find_unused = k == 1;
        memset(b, 0, sizeof *b);
        cr_assert_eq(tddp_spawn(3, &c2, &g_data, b, 60000), TDM_STATUS_OK, "%s", b->err[0]);
        cr_assert(!memcmp(a->params, b->params, (size_t)a->n_elem * 4), "%s",
                  k ? "find_unused" : "no_overlap");
    }
    tdm_ddp_hook_builtin_free(&h);
    tddp_shared_free(a);
    tddp_shared_free(b);
}

/* fp16/bf16/powersgd training against one device: the bound is what the
 * compression allows (see docs/DDP.md), far above float32's tolerance and
 * far below a wrong reduction (a missing rank's share moves parameters by
 * ~1e-2 here). */
Test(ddp_hooks, compressed_training_stays_within_its_bound)
{
    const char *hooks[] = {"fp16", "bf16", "powersgd"};
    const double tol[] = {2e-4, 2e-3, 2e-2};
    for (int i = 0; i < 3; i++) {
        tddp_cfg c = tddp_cfg_default();
        c.steps = 3;
        c.cap_bytes = 512;
        c.comm_hook = hooks[i];
        c.psgd = (tdm_ddp_powersgd_opts){.rank = 2, .start_step = 1};
        tddp_check_equiv(&c, &g_data, 2, 60000,
                         (tddp_tol){.loss_atol = tol[i], .loss_rtol = tol[i],
                                    .grad_atol = 1e3, .grad_rtol = 0,   /* step 0 */
                                    .param_atol = tol[i], .param_rtol = tol[i]});
    }
}

/* A user hook with state: float32 all-reduce, counting buckets; one that
 * fails on rank 1 at its second synchronised backward. */
typedef struct user_state {
    int calls, fail_rank, fail_step;
    tdm_comm_work *w[64];
} user_state;

static tdm_status user_launch(void *p, tdm_ddp_hook_bucket *b)
{
    user_state *s = p;
    s->calls++;
    if (tdm_comm_rank(b->comm) == s->fail_rank && b->step == s->fail_step)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "user hook says no to bucket %d", b->index);
    b->bytes = (double)b->n_elem * 4;
    return tdm_comm_all_reduce_async(b->comm, b->grads, b->grads, (size_t)b->n_elem,
                                     TDM_DTYPE_FLOAT32, TDM_REDOP_SUM, &s->w[b->index]);
}

static tdm_status user_wait(void *p, tdm_ddp_hook_bucket *b)
{
    user_state *s = p;
    tdm_status st = tdm_comm_work_wait(s->w[b->index], b->timeout_ms);
    tdm_comm_work_free(s->w[b->index]);
    s->w[b->index] = NULL;
    return st;
}

Test(ddp_hooks, user_hook_with_state_and_its_failure_on_every_rank)
{
    tddp_shared *a = tddp_shared_new(), *b = tddp_shared_new();
    cr_assert(a && b);
    user_state us = {.fail_rank = -1};
    tdm_ddp_comm_hook h = {.name = "counting", .state = &us, .launch = user_launch,
                           .wait = user_wait};
    tddp_cfg c = tddp_cfg_default();
    c.steps = 3;
    c.cap_bytes = 512;
    cr_assert_eq(tddp_spawn(2, &c, &g_data, a, 60000), TDM_STATUS_OK, "%s", a->err[0]);
    c.user_hook = &h;
    cr_assert_eq(tddp_spawn(2, &c, &g_data, b, 60000), TDM_STATUS_OK, "%s", b->err[0]);
    cr_assert(!memcmp(a->params, b->params, (size_t)a->n_elem * 4));
    /* the failing one */
    us.fail_rank = 1;
    us.fail_step = 1;
    memset(b, 0, sizeof *b);
    tdm_status st = tddp_spawn(3, &c, &g_data, b, 60000);
    cr_assert_neq(st, TDM_STATUS_OK);
    for (int r = 0; r < 3; r++)
        cr_assert(b->status[r] != 0 && strstr(b->err[r], "user hook says no"),
                  "rank %d: status %d, '%s'", r, b->status[r], b->err[r]);
    cr_assert(strstr(b->err[1], "comm hook 'counting'"), "%s", b->err[1]);
    tddp_shared_free(a);
    tddp_shared_free(b);
}
