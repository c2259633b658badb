/* tests/test_fsdp_hooks.c: fp16 / bf16 compression of the sharded modes'
 * reduce-scatters (tdm_fsdp_opts.comm_hook). For every sharding on 2 and
 * 3 ranks (shards padded, an uneven global batch) and units on both sides
 * of the shm slot size, the reduced gradient is bit for bit the 16-bit
 * rounding of the float32 rank-order sum of the ranks' rounded local
 * gradients (and without a hook, the float32 sum itself: the reference is
 * right), with half the bytes; training with a hook equals DDP with the
 * same hook bit for bit (no_sync accumulation included); powersgd and a
 * non-host device are refused saying why. */
#include <criterion/criterion.h>

#include "tests/test_fsdp_util.h"
#include "tests/timeout_util.h"

#define H_MAX_WORLD 3
#define H_MAX_ELEMS 40000
#define H_BATCH 23

static tdm_dataset g_data;
static void setup(void)
{
    tf_cfg c = tf_cfg_default();
    cr_assert_eq(tf_data(&g_data, &c, 256), TDM_STATUS_OK);
}
static void teardown(void) { tdm_data_free(&g_data); }
TestSuite(fsdp_hooks, .init = setup, .fini = teardown, .timeout = 240);

typedef struct h_shared {
    float local[H_MAX_WORLD][H_MAX_ELEMS];   /* each rank's local gradient (a plain model's) */
    float reduced[H_MAX_WORLD][H_MAX_ELEMS]; /* the gathered reduced gradient, per rank */
    double rs_bytes[H_MAX_WORLD], padded_elems;
    int64_t n_elem;
    int status[H_MAX_WORLD];
    char err[H_MAX_WORLD][512];
} h_shared;

typedef struct h_arg {
    h_shared *sh;
    const int *dims;
    int ndims;
    tdm_fsdp_sharding sharding;
    tdm_fsdp_comm_hook hook;
} h_arg;

/* One rank: its local gradient from a plain model on its share of the
 * batch (what FSDP's backward computes before the reduce-scatter, bit for
 * bit), then one FSDP backward with the hook and the gathered result. */
static int h_rank(tdm_comm *comm, void *p)
{
    h_arg *a = p;
    h_shared *sh = a->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL, *plain = NULL;
    tdm_fsdp *f = NULL;
    tdm_status st = TDM_STATUS_OK;
    tdm_model_spec spec;
    tdm_model_spec_mlp(&spec, a->dims, a->ndims);
    int64_t feat = tdm_data_features(&g_data);
    float *x = malloc((size_t)H_BATCH * (size_t)feat * sizeof *x);
    int32_t y[H_BATCH];
    int64_t perm[H_BATCH], lo, hi;
    for (int i = 0; i < H_BATCH; i++) perm[i] = 3 * i + 1;
    tdm_dist_share(H_BATCH, rank, world, &lo, &hi);
    if (!x) return 1;
    tdm_data_gather(&g_data, perm + lo, (int)(hi - lo), x, y);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&plain, dev, &spec, 5));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    int64_t n = tdm_model_param_elems(m);
    cr_assert(n <= H_MAX_ELEMS);
    /* the local gradient */
    const float *logits;
    double ls;
    TDM_TRY(tdm_model_zero_grad(plain));
    TDM_TRY(tdm_model_forward(plain, x, (int)(hi - lo), &logits));
    TDM_TRY(tdm_model_loss(plain, logits, y, (int)(hi - lo), 1.0f / H_BATCH, &ls,
                           tdm_model_loss_grad(plain)));
    TDM_TRY(tdm_model_backward(plain, tdm_model_loss_grad(plain)));
    memcpy(sh->local[rank], tdm_model_grads(plain), (size_t)n * sizeof(float));
    /* the same through FSDP with the hook */
    tdm_fsdp_opts o = {.sharding = a->sharding, .comm_hook = a->hook, .timeout_ms = 20000};
    TDM_TRY(tdm_fsdp_init(&f, m, comm, &o));
    TDM_TRY(tdm_fsdp_zero_grad(f));
    TDM_TRY(tdm_fsdp_forward_scaled(f, x, y, (int)(hi - lo), 1.0f / H_BATCH, NULL));
    TDM_TRY(tdm_fsdp_backward(f));
    memset(sh->reduced[rank], 0, sizeof sh->reduced[rank]);
    TDM_TRY(tdm_fsdp_gather_grads(f, sh->reduced[rank], -1));
    tdm_fsdp_times t;
    tdm_fsdp_get_times(f, &t);
    sh->rs_bytes[rank] = t.rs_bytes_total;
    if (rank == 0) {
        double padded = 0;
        for (int u = 0; u < tdm_fsdp_n_units(f); u++) {
            int64_t shard;
            tdm_fsdp_unit_info(f, u, NULL, NULL, NULL, NULL, &shard);
            padded += (double)(shard * world);
        }
        sh->padded_elems = padded;
        sh->n_elem = n;
    }
fail:
    sh->status[rank] = st;
    if (st) snprintf(sh->err[rank], sizeof sh->err[rank], "%s", tdm_error_message());
    tdm_fsdp_free(f);
    tdm_model_free(m);
    tdm_model_free(plain);
    tdm_device_free(dev);
    free(x);
    return st ? 1 : 0;
}

static float h_round(tdm_fsdp_comm_hook h, float v)
{
    if (h == TDM_FSDP_HOOK_FP16) return tdm_f16_to_f32(tdm_f32_to_f16(v));
    if (h == TDM_FSDP_HOOK_BF16) return tdm_bf16_to_f32(tdm_f32_to_bf16(v));
    return v;
}

static void h_check(const int *dims, int ndims, int world, tdm_fsdp_sharding s,
                    tdm_fsdp_comm_hook hook)
{
    h_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                        -1, 0);
    cr_assert(sh != MAP_FAILED);
    memset(sh, 0, sizeof *sh);
    h_arg a = {.sh = sh, .dims = dims, .ndims = ndims, .sharding = s, .hook = hook};
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    tdm_status st = tdm_dist_spawn(world, h_rank, &a, &so, NULL);
    const char *what = tdm_fsdp_sharding_name(s), *hn = tdm_fsdp_comm_hook_name(hook);
    cr_assert_eq(st, TDM_STATUS_OK, "%s %s world %d: %s / %s / %s", what, hn, world,
                 tdm_error_message(), sh->err[0], sh->err[1]);
    int64_t n = sh->n_elem, wrong = 0, first = -1, rounded = 0;
    float first_want = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float acc = 0.0f, acc32 = 0.0f;   /* in rank order, as shm adds */
        for (int r = 0; r < world; r++) {
            acc += h_round(hook, sh->local[r][i]);
            acc32 += sh->local[r][i];
        }
        float want = h_round(hook, acc);
        if (memcmp(&want, &sh->reduced[0][i], 4)) {
            wrong++;
            if (first < 0) {
                first = i;
                first_want = want;
            }
        }
        rounded += memcmp(&want, &acc32, 4) != 0;
    }
    cr_assert_eq(wrong, 0, "%s %s world %d: %lld of %lld elements differ from the rounded sum "
                 "(first [%lld]: %.9g, want %.9g)", what, hn, world, (long long)wrong,
                 (long long)n, (long long)first, first >= 0 ? sh->reduced[0][first] : 0.0,
                 (double)first_want);
    /* not vacuous: the rounding changed most elements */
    if (hook != TDM_FSDP_HOOK_NONE)
        cr_assert(rounded > n / 2, "%s %s: only %lld of %lld elements rounded", what, hn,
                  (long long)rounded, (long long)n);
    for (int r = 0; r < world; r++) {
        cr_assert(!memcmp(sh->reduced[r], sh->reduced[0], (size_t)n * 4),
                  "rank %d gathered another gradient", r);
        cr_assert_eq(sh->rs_bytes[r], sh->padded_elems * (hook ? 2.0 : 4.0),
                     "%s %s rank %d: %g bytes reduce-scattered for %g elements", what, hn, r,
                     sh->rs_bytes[r], sh->padded_elems);
    }
    munmap(sh, sizeof *sh);
}

Test(fsdp_hooks, fp16_bf16_equal_a_reduce_scatter_of_the_rounded_values)
{
    static const int small[] = {20, 16, 12, 5};    /* 605 parameters in 3 units */
    static const int wide[] = {20, 1000, 7};       /* a unit of 21,000: many shm rounds */
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        for (int h = 0; h < TDM_FSDP_HOOK_COUNT_; h++) {
            for (int world = 2; world <= 3; world++)
                h_check(small, 4, world, (tdm_fsdp_sharding)s, (tdm_fsdp_comm_hook)h);
            if (h) h_check(wide, 3, 3, (tdm_fsdp_sharding)s, (tdm_fsdp_comm_hook)h);
        }
}

/* ---- training: equal to DDP with the same hook ---- */

static void h_vs_ddp(tf_cfg c, int world)
{
    tf_shared *a = tf_shared_new(), *b = tf_shared_new();
    cr_assert(a && b);
    tf_cfg d = c;
    d.ddp = 1;
    cr_assert_eq(tf_spawn(world, &d, &g_data, a, 120000), TDM_STATUS_OK, "ddp: %s / %s",
                 tdm_error_message(), a->err[0]);
    cr_assert_eq(tf_spawn(world, &c, &g_data, b, 120000), TDM_STATUS_OK, "fsdp: %s / %s",
                 tdm_error_message(), b->err[0]);
    const char *what = tdm_fsdp_sharding_name(c.sharding);
    int64_t n = a->n_elem;
    cr_assert_eq(n, b->n_elem);
    for (int64_t i = 0; i < n; i++) {
        cr_assert(!memcmp(&a->grads0[i], &b->grads0[i], 4),
                  "%s %s world %d micro %d: gradient[%lld] %.9g (ddp) vs %.9g (fsdp)", what,
                  c.hook, world, c.micro, (long long)i, a->grads0[i], b->grads0[i]);
        cr_assert(!memcmp(&a->params[i], &b->params[i], 4),
                  "%s %s world %d micro %d: param[%lld] %.9g (ddp) vs %.9g (fsdp)", what, c.hook,
                  world, c.micro, (long long)i, a->params[i], b->params[i]);
    }
    for (int s = 0; s < c.steps; s++) cr_assert_eq(a->loss[s], b->loss[s]);
    tf_shared_free(a);
    tf_shared_free(b);
}

Test(fsdp_hooks, hooked_training_equals_ddp_with_the_same_hook)
{
    const char *hooks[] = {"fp16", "bf16"};
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        for (int h = 0; h < 2; h++)
            for (int micro = 1; micro <= 2; micro++) {
                tf_cfg c = tf_cfg_default();
                c.sharding = (tdm_fsdp_sharding)s;
                c.hook = hooks[h];
                c.steps = 6;
                c.batch = 23;
                c.micro = micro;
                h_vs_ddp(c, 3);
            }
}

/* Gradients that add up across synchronised backwards (no zero_grad in
 * between, no_sync micro-batches too): with a hook each backward's new
 * gradients are compressed once and added to the reduced gradient the
 * shard already holds, in every sharding alike. ZeRO-1 keeps that reduced
 * gradient in its owned slice of the full gradient, where backward adds
 * the new local gradients onto it; failed before: its reduce-scatter
 * rounded the already-reduced sum to 16 bits again at every step
 * (parameters off grad_op's by up to 9% of an element after 4 steps). */
Test(fsdp_hooks, accumulation_without_zero_grad_compresses_each_gradient_once)
{
    for (int micro = 1; micro <= 2; micro++) {
        tf_shared *a = tf_shared_new(), *b = tf_shared_new();
        cr_assert(a && b);
        tf_cfg c = tf_cfg_default();
        c.steps = 4;
        c.zero_once = 1;
        c.micro = micro;
        c.hook = "bf16";
        c.sharding = TDM_FSDP_SHARD_GRAD_OP;
        cr_assert_eq(tf_spawn(2, &c, &g_data, a, 120000), TDM_STATUS_OK, "%s", a->err[0]);
        c.sharding = TDM_FSDP_SHARD_OPTIM;
        cr_assert_eq(tf_spawn(2, &c, &g_data, b, 120000), TDM_STATUS_OK, "%s", b->err[0]);
        for (int64_t i = 0; i < a->n_elem; i++)
            cr_assert(!memcmp(&a->params[i], &b->params[i], 4),
                      "micro %d: param[%lld] %.9g (grad_op) vs %.9g (optimizer)", micro,
                      (long long)i, a->params[i], b->params[i]);
        tf_shared_free(a);
        tf_shared_free(b);
    }
}

/* ---- refusals ---- */

Test(fsdp_hooks, powersgd_and_unknown_hooks_are_refused)
{
    tdm_fsdp_comm_hook h = TDM_FSDP_HOOK_BF16;
    cr_assert_eq(tdm_fsdp_comm_hook_parse("powersgd", &h), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "PyTorch's FSDP offers only the fp16 and bf16 hooks"),
              "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "--mode ddp"), "%s", tdm_error_message());
    cr_assert_eq(tdm_fsdp_comm_hook_parse("int8", &h), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "expected fp16, bf16"), "%s", tdm_error_message());
    cr_assert_eq(tdm_fsdp_comm_hook_parse("allreduce", &h), TDM_STATUS_OK);
    cr_assert_eq(h, TDM_FSDP_HOOK_NONE);
    cr_assert_eq(tdm_fsdp_comm_hook_parse("bf16", &h), TDM_STATUS_OK);
    cr_assert_eq(h, TDM_FSDP_HOOK_BF16);
}

/* An out-of-range hook is refused at init, naming it, before the model
 * is touched (one rank). */
static char g_bad_msg[512];
static int g_bad_released = -1;
static int bad_rank(tdm_comm *comm, void *p)
{
    (void)p;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_fsdp *f = NULL;
    tdm_model_spec spec;
    tf_cfg c = tf_cfg_default();
    tf_spec(&spec, &c);
    int rc = 1;
    if (tdm_device_open(&dev, "cpu", 0, 1) || tdm_model_init(&m, dev, &spec, 5)) goto done;
    tdm_fsdp_opts o = {.comm_hook = (tdm_fsdp_comm_hook)7};
    if (tdm_fsdp_init(&f, m, comm, &o) == TDM_STATUS_INVALID_ARG) rc = 0;
    snprintf(g_bad_msg, sizeof g_bad_msg, "%s", tdm_error_message());
    g_bad_released = tdm_model_storage_released(m);
done:
    tdm_fsdp_free(f);
    tdm_model_free(m);
    tdm_device_free(dev);
    if (rc == 0 && (!strstr(g_bad_msg, "comm_hook 7") || g_bad_released)) rc = 2;
    if (rc) fprintf(stderr, "bad_rank: %s (released %d)\n", g_bad_msg, g_bad_released);
    return rc;
}

Test(fsdp_hooks, bad_hook_value_refused_at_init)
{
    tdm_dist_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000),
                             .comm_timeout_ms = tu_scaled_ms(10000)};
    cr_assert_eq(tdm_dist_spawn(1, bad_rank, NULL, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
}

/* A rank with another hook (or join) is named at construction, on every
 * rank, before any gradient is reduced in two formats. */
static char g_mm_msg[2][512];
static int mm_rank(tdm_comm *comm, void *p)
{
    (void)p;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_fsdp *f = NULL;
    tdm_model_spec spec;
    tf_cfg c = tf_cfg_default();
    tf_spec(&spec, &c);
    tdm_status st = TDM_STATUS_INTERNAL;
    if (tdm_device_open(&dev, "cpu", rank, 1) == TDM_STATUS_OK &&
        tdm_model_init(&m, dev, &spec, 5) == TDM_STATUS_OK) {
        tdm_fsdp_opts o = {.comm_hook = rank ? TDM_FSDP_HOOK_BF16 : TDM_FSDP_HOOK_NONE,
                           .timeout_ms = tu_scaled_ms(10000)};
        st = tdm_fsdp_init(&f, m, comm, &o);
    }
    snprintf(g_mm_msg[rank], sizeof g_mm_msg[rank], "%s", tdm_error_message());
    tdm_fsdp_free(f);
    tdm_model_free(m);
    tdm_device_free(dev);
    if (st != TDM_STATUS_MISMATCH) {
        fprintf(stderr, "rank %d: status %d: %s\n", rank, (int)st, g_mm_msg[rank]);
        return 1;
    }
    if (!strstr(g_mm_msg[rank], "comm hook allreduce, join off), rank 1 sharding full "
                                "(prefetch on, overlap on, comm hook bf16")) {
        fprintf(stderr, "rank %d: %s\n", rank, g_mm_msg[rank]);
        return 1;
    }
    return 0;
}

/* The float32 reduce-scatter is named as the user names it on the
 * command line and as DDP names its default (allreduce), not "none". */
Test(fsdp_hooks, a_rank_with_another_hook_is_named_at_init)
{
    cr_assert_str_eq(tdm_fsdp_comm_hook_name(TDM_FSDP_HOOK_NONE), "allreduce");
    tdm_dist_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000),
                             .comm_timeout_ms = tu_scaled_ms(10000)};
    cr_assert_eq(tdm_dist_spawn(2, mm_rank, NULL, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
}
