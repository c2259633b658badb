/* tests/test_fsdp.c: sharded data parallel (fsdp/) against one device and
 * against DDP, on the shm communicator: every sharding strategy, 1 to 4
 * ranks, even and uneven global batches, MLP, CNN (batchnorm buffers) and
 * GPT (transformer blocks as units), one step and 50 steps, SGD with
 * momentum and AdamW, no_sync accumulation, a rank without samples, more
 * ranks than a unit has elements, and the layout check across ranks. */
#include <criterion/criterion.h>

#include <unistd.h>

#include "core/device_impl.h"
#include "core/timer.h"
#include "tests/test_fsdp_util.h"

static tdm_dataset g_mlp, g_cnn;

static void setup(void)
{
    tf_cfg m = tf_cfg_default(), c = tf_cfg_default();
    c.model = 1;
    cr_assert_eq(tf_data(&g_mlp, &m, 2000), TDM_STATUS_OK);
    cr_assert_eq(tf_data(&g_cnn, &c, 2000), TDM_STATUS_OK);
}

static void teardown(void)
{
    tdm_data_free(&g_mlp);
    tdm_data_free(&g_cnn);
}

TestSuite(fsdp, .init = setup, .fini = teardown, .timeout = 240);

static const tdm_dataset *data_of(const tf_cfg *c) { return c->model == 1 ? &g_cnn : &g_mlp; }

/* FSDP over `world` ranks vs one device: every step's loss, the reduced
 * gradient of step 0 and the final parameters within tolerance; every
 * rank bitwise the same. */
static void check_single(const tf_cfg *c, int world, double gtol, double ptol)
{
    static double ref_loss[TF_MAX_STEPS];
    static float ref_g[TF_MAX_ELEMS], ref_p[TF_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tf_reference(c, data_of(c), ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    tf_shared *sh = tf_shared_new();
    cr_assert(sh);
    tdm_status st = tf_spawn(world, c, data_of(c), sh, 120000);
    const char *what = tdm_fsdp_sharding_name(c->sharding);
    cr_assert_eq(st, TDM_STATUS_OK, "%s world %d batch %d: %s / rank 0: %s / rank 1: %s", what,
                 world, c->batch, tdm_error_message(), sh->err[0], sh->err[1]);
    cr_assert_eq(sh->n_elem, n);
    for (int s = 0; s < c->steps; s++)
        cr_assert(fabs(sh->loss[s] - ref_loss[s]) <= 1e-5 + 1e-4 * fabs(ref_loss[s]),
                  "%s world %d batch %d step %d: loss %.8f vs one device %.8f", what, world,
                  c->batch, s, sh->loss[s], ref_loss[s]);
    int64_t at = 0;
    cr_assert(tf_excess(sh->grads0, ref_g, n, gtol, gtol, &at) <= 0,
              "%s world %d batch %d: grad[%lld] %g vs %g", what, world, c->batch, (long long)at,
              sh->grads0[at], ref_g[at]);
    cr_assert(tf_excess(sh->params, ref_p, n, ptol, ptol, &at) <= 0,
              "%s world %d batch %d: param[%lld] %g vs %g", what, world, c->batch,
              (long long)at, sh->params[at], ref_p[at]);
    cr_assert(world == 1 || !memcmp(sh->grads0, sh->grads0_r1, (size_t)n * 4));
    cr_assert(world == 1 || !memcmp(sh->params, sh->params_r1, (size_t)n * 4));
    tf_shared_free(sh);
}

/* The same configuration through DDP and through FSDP: bitwise equal
 * gradients of step 0, losses and final parameters. */
static void check_ddp_bitwise(tf_cfg c, int world)
{
    tf_shared *a = tf_shared_new(), *b = tf_shared_new();
    cr_assert(a && b);
    tf_cfg d = c;
    d.ddp = 1;
    cr_assert_eq(tf_spawn(world, &d, data_of(&c), a, 120000), TDM_STATUS_OK, "ddp: %s / %s",
                 tdm_error_message(), a->err[0]);
    cr_assert_eq(tf_spawn(world, &c, data_of(&c), b, 120000), TDM_STATUS_OK, "fsdp: %s / %s",
                 tdm_error_message(), b->err[0]);
    const char *what = tdm_fsdp_sharding_name(c.sharding);
    cr_assert_eq(b->unended_ag, 0, "%s world %d: %d all-gather(s) of the last step never "
                 "ended", what, world, b->unended_ag);
    int64_t n = a->n_elem, at = -1;
    for (int64_t i = 0; i < n && at < 0; i++)
        if (memcmp(&a->grads0[i], &b->grads0[i], 4)) at = i;
    cr_assert(at < 0, "%s world %d model %d: gradient[%lld] %.9g (ddp) vs %.9g (fsdp)", what,
              world, c.model, (long long)at, a->grads0[at], b->grads0[at]);
    for (int64_t i = 0; i < n && at < 0; i++)
        if (memcmp(&a->params[i], &b->params[i], 4)) at = i;
    cr_assert(at < 0, "%s world %d model %d: parameter[%lld] %.9g (ddp) vs %.9g (fsdp)", what,
              world, c.model, (long long)at, a->params[at], b->params[at]);
    /* DDP carries each rank's loss sum through its float all-reduce in two
     * halves (about 48 bits), FSDP as a double: the same to 1e-12 */
    for (int s = 0; s < c.steps; s++)
        cr_assert(fabs(a->loss[s] - b->loss[s]) <= 1e-12 * fabs(a->loss[s]),
                  "%s world %d: step %d loss %.17g vs %.17g", what, world, s, a->loss[s],
                  b->loss[s]);
    tf_shared_free(a);
    tf_shared_free(b);
}

Test(fsdp, one_step_every_sharding_equals_one_device_1_to_4_ranks)
{
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++)
        for (int w = 1; w <= 4; w++) {
            tf_cfg c = tf_cfg_default();
            c.sharding = (tdm_fsdp_sharding)sh;
            check_single(&c, w, 1e-6, 1e-6);
            c.batch = 23;   /* uneven shares */
            check_single(&c, w, 1e-6, 1e-6);
        }
}

/* With batchnorm, N > 1 ranks normalise over their own samples (as DDP
 * and PyTorch without SyncBatchNorm do): the CNN equals one device at
 * N = 1 and DDP, bit for bit, at every N. */
Test(fsdp, cnn_with_batchnorm_every_sharding)
{
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++) {
        tf_cfg c = tf_cfg_default();
        c.model = 1;
        c.batch = 15;
        c.steps = 2;
        c.sharding = (tdm_fsdp_sharding)sh;
        check_single(&c, 1, 1e-6, 1e-6);
        for (int w = 2; w <= 4; w++) check_ddp_bitwise(c, w);
    }
}

Test(fsdp, fifty_steps_every_sharding_mlp_and_cnn)
{
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++) {
        tf_cfg c = tf_cfg_default();
        c.batch = 31;
        c.steps = 50;
        c.sharding = (tdm_fsdp_sharding)sh;
        check_single(&c, 3, 1e-5, 1e-4);
        c.model = 1;
        c.batch = 15;
        check_single(&c, 1, 1e-5, 1e-4);
        check_ddp_bitwise(c, 2);
    }
}

Test(fsdp, every_sharding_equals_ddp_bit_for_bit_on_shm)
{
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++) {
        tf_cfg c = tf_cfg_default();
        c.sharding = (tdm_fsdp_sharding)sh;
        c.steps = 4;
        check_ddp_bitwise(c, 2);
        c.batch = 23;
        check_ddp_bitwise(c, 3);
        c.model = 1;
        c.batch = 13;
        check_ddp_bitwise(c, 2);
        c.model = 0;
        c.adamw = 1;
        check_ddp_bitwise(c, 4);
    }
}

Test(fsdp, gpt_blocks_as_units_equal_one_device_and_ddp)
{
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++) {
        tf_cfg c = tf_cfg_default();
        c.model = 2;
        c.batch = 6;
        c.steps = 3;
        c.adamw = 1;
        c.sharding = (tdm_fsdp_sharding)sh;
        check_single(&c, 2, 1e-5, 1e-5);
        check_ddp_bitwise(c, 3);
    }
    /* embeddings, 2 blocks, ln_f: 4 units */
    tf_cfg c = tf_cfg_default();
    c.model = 2;
    c.batch = 4;
    tf_shared *sh = tf_shared_new();
    cr_assert_eq(tf_spawn(2, &c, &g_mlp, sh, 60000), TDM_STATUS_OK, "%s", sh->err[0]);
    cr_assert_eq(sh->n_units, 4);
    tf_shared_free(sh);
}

Test(fsdp, no_sync_accumulation_equals_ddp_bitwise)
{
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++) {
        tf_cfg c = tf_cfg_default();
        c.sharding = (tdm_fsdp_sharding)sh;
        c.micro = 3;
        c.steps = 3;
        check_ddp_bitwise(c, 2);
        c.model = 1;
        c.batch = 18;
        check_ddp_bitwise(c, 3);
    }
}

/* zero_grad only before the first step: each step's gradient is the sum
 * of every step's so far. full and grad_op add each reduce-scatter onto
 * the shard; optimizer reduce-scatters its full gradient in place, which
 * leaves this rank's local gradients outside its slice: they must be
 * cleared before the next backward adds onto them (tdm_fsdp_clear_stale),
 * or the next reduce-scatter counts them again. The three agree within
 * float reassociation (they add in different orders). */
Test(fsdp, gradients_add_up_across_synchronised_backwards_without_zero_grad)
{
    static float ref[TF_MAX_ELEMS];
    static double ref_loss[TF_MAX_STEPS];
    for (int world = 2; world <= 3; world++) {
        int64_t n = 0;
        for (int sh = TDM_FSDP_SHARDING_COUNT_ - 1; sh >= 0; sh--) {
            tf_cfg c = tf_cfg_default();
            c.sharding = (tdm_fsdp_sharding)sh;
            c.steps = 3;
            c.zero_once = 1;
            tf_shared *s = tf_shared_new();
            cr_assert(s);
            cr_assert_eq(tf_spawn(world, &c, &g_mlp, s, 60000), TDM_STATUS_OK, "%s", s->err[0]);
            if (sh == TDM_FSDP_SHARDING_COUNT_ - 1) {
                n = s->n_elem;
                memcpy(ref, s->params, (size_t)n * 4);
                memcpy(ref_loss, s->loss, sizeof ref_loss);
            } else {
                int64_t at = 0;
                cr_assert(tf_excess(s->params, ref, n, 1e-6, 1e-5, &at) <= 0,
                          "world %d: %s param[%lld] %g vs optimizer's %g", world,
                          tdm_fsdp_sharding_name(c.sharding), (long long)at, s->params[at],
                          ref[at]);
                for (int k = 0; k < c.steps; k++)
                    cr_assert(fabs(s->loss[k] - ref_loss[k]) <= 1e-6 + 1e-5 * fabs(ref_loss[k]));
            }
            tf_shared_free(s);
        }
    }
}

Test(fsdp, a_rank_without_samples_still_takes_part)
{
    /* 2 samples over 3 ranks: rank 0 has none (FULL_SHARD runs the model on
     * a zero sample so as to join the gathers; batchnorm statistics must
     * not learn from it) */
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++) {
        tf_cfg c = tf_cfg_default();
        c.sharding = (tdm_fsdp_sharding)sh;
        c.batch = 2;
        c.steps = 2;
        check_single(&c, 3, 1e-6, 1e-6);
        c.model = 1;
        c.batch = 3;
        check_ddp_bitwise(c, 4);
    }
}

Test(fsdp, grouped_units_and_no_prefetch_no_overlap_change_nothing)
{
    tf_cfg c = tf_cfg_default();
    c.steps = 3;
    c.min_unit_elems = 300;   /* fc1 + fc2 together, fc3 alone */
    check_ddp_bitwise(c, 2);
    c.min_unit_elems = 0;
    c.no_prefetch = 1;
    c.no_overlap = 1;
    check_ddp_bitwise(c, 3);
    tf_shared *sh = tf_shared_new();
    c.min_unit_elems = 300;
    cr_assert_eq(tf_spawn(2, &c, &g_mlp, sh, 60000), TDM_STATUS_OK, "%s", sh->err[0]);
    cr_assert_eq(sh->n_units, 2);
    tf_shared_free(sh);
}

/* PyTorch lets optimizer.step() run without a backward before it; the
 * second step then applies the same gradients again. In grad_op and
 * optimizer the first step leaves every unit's parameter all-gather in
 * flight (into the full copy, reading this rank's slice of it): the
 * second must wait for those before stepping the slice again and
 * gathering it anew, and then equal DDP stepping twice, bit for bit.
 * Before the fix it stepped the slice under the running gather and
 * started a second gather over the first's handle, which leaked: its
 * event in the step's timeline never got an end (check_ddp_bitwise
 * counts those). */
Test(fsdp, a_second_step_without_backward_equals_ddp_stepping_twice)
{
    static const int dims[] = {20, 192, 192, 5};
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh++)
        for (int adamw = 0; adamw <= 1; adamw++) {
            tf_cfg c = tf_cfg_default();
            c.dims = dims;
            c.ndims = 4;
            c.sharding = (tdm_fsdp_sharding)sh;
            c.steps = 3;
            c.adamw = adamw;
            c.double_step = 1;
            check_ddp_bitwise(c, 2 + adamw);
        }
}

Test(fsdp, more_ranks_than_a_unit_has_elements)
{
    /* units of 17 and 32 elements (alignment included) over 18 ranks:
     * shards of one and two elements, padding everywhere */
    static const int dims[] = {2, 1, 2};
    tf_cfg c = tf_cfg_default();
    c.dims = dims;
    c.ndims = 3;
    c.batch = 36;
    c.steps = 2;
    tdm_dataset d;
    cr_assert_eq(tf_data(&d, &c, 200), TDM_STATUS_OK);
    double ref_loss[TF_MAX_STEPS];
    static float ref_g[TF_MAX_ELEMS], ref_p[TF_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tf_reference(&c, &d, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK);
    for (int sh = 0; sh < TDM_FSDP_SHARDING_COUNT_; sh += 2) {
        c.sharding = (tdm_fsdp_sharding)sh;
        tf_shared *r = tf_shared_new();
        cr_assert_eq(tf_spawn(18, &c, &d, r, 120000), TDM_STATUS_OK, "%s / %s",
                     tdm_error_message(), r->err[0]);
        int64_t at = 0;
        cr_assert(tf_excess(r->params, ref_p, n, 1e-6, 1e-6, &at) <= 0, "param[%lld]",
                  (long long)at);
        tf_shared_free(r);
    }
    tdm_data_free(&d);
}

Test(fsdp, different_unit_layout_is_named_at_construction)
{
    tf_cfg c = tf_cfg_default();
    c.bad_layout_rank = 1;
    tf_shared *sh = tf_shared_new();
    tdm_status st = tf_spawn(3, &c, &g_mlp, sh, 60000);
    cr_assert_neq(st, TDM_STATUS_OK);
    for (int r = 0; r < 3; r++) {
        cr_assert_neq(sh->status[r], TDM_STATUS_OK, "rank %d went on", r);
        cr_assert(strstr(sh->err[r], "rank 1"), "rank %d: %s", r, sh->err[r]);
        cr_assert(strstr(sh->err[r], "unit"), "rank %d: %s", r, sh->err[r]);
    }
    tf_shared_free(sh);
}

/* Rank 0 cannot stage the parameters it scatters (or, with full copies,
 * broadcasts) at construction: the others are told at once (the abort,
 * with rank 0's reason), not after the communicator's timeout (120 s
 * here; they waited for it before). */
static tdm_status tfx_copy_fails(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    (void)d;
    (void)dst;
    (void)src;
    return tdm_error_set(TDM_STATUS_IO, "injected copy failure of %zu bytes", nbytes);
}

static tdm_device_ops tfx_ops;

static tdm_status tfx_open_failing_rank0(tdm_device **out, int rank)
{
    TDM_CHECK(tdm_device_open(out, "cpu", rank, 1));
    if (rank == 0) {
        tfx_ops = *(*out)->ops;
        tfx_ops.copy = tfx_copy_fails;
        (*out)->ops = &tfx_ops;
    }
    return TDM_STATUS_OK;
}

/* Rank 0 stays (a caller that handles the error and goes on, or a rank
 * whose exit its peers cannot see, as under MPI) until the others have
 * ended. */
static int tfx_rank(tdm_comm *comm, void *arg)
{
    tf_run *run = arg;
    int rc = tf_rank_main(comm, arg);
    if (tdm_comm_rank(comm) == 0)
        for (int i = 0; i < 1500 && !(run->sh->err[1][0] && run->sh->err[2][0]); i++)
            usleep(100 * 1000);
    return rc;
}

Test(fsdp, rank_0_failing_to_stage_the_parameters_stops_the_others_at_once)
{
    for (int shd = 0; shd < 2; shd++) {
        tf_cfg c = tf_cfg_default();
        c.sharding = shd ? TDM_FSDP_SHARD_GRAD_OP : TDM_FSDP_FULL_SHARD;
        c.open_dev = tfx_open_failing_rank0;
        tf_shared *sh = tf_shared_new();
        tf_run run = {.cfg = &c, .data = &g_mlp, .sh = sh};
        tdm_dist_spawn_opts o = {.timeout_ms = 240000, .comm_timeout_ms = 120000};
        uint64_t t0 = tdm_time_ns();
        tdm_status st = tdm_dist_spawn(3, tfx_rank, &run, &o, NULL);
        double ms = tdm_time_ms_since(t0);
        cr_assert_neq(st, TDM_STATUS_OK);
        cr_expect(ms < 60000, "%s: the others waited %.0f ms", tdm_fsdp_sharding_name(c.sharding),
                  ms);
        for (int r = 0; r < 3; r++)
            cr_expect(strstr(sh->err[r], "injected copy failure"), "%s: rank %d: %s",
                      tdm_fsdp_sharding_name(c.sharding), r, sh->err[r]);
        tf_shared_free(sh);
    }
}

/* Options that change the collectives (here: rank 2 does not prefetch)
 * are named at construction, with both ranks' settings. */
Test(fsdp, different_options_are_named_at_construction)
{
    tf_cfg c = tf_cfg_default();
    c.bad_options_rank = 2;
    tf_shared *sh = tf_shared_new();
    tdm_status st = tf_spawn(3, &c, &g_mlp, sh, 60000);
    cr_assert_neq(st, TDM_STATUS_OK);
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(sh->status[r], TDM_STATUS_MISMATCH, "rank %d: %s", r, sh->err[r]);
        cr_assert(strstr(sh->err[r], "options differ between ranks: rank 0 runs sharding full "
                                     "(prefetch on, overlap on, comm hook allreduce, join off), "
                                     "rank 2 sharding full (prefetch off"),
                  "rank %d: %s", r, sh->err[r]);
    }
    tf_shared_free(sh);
}

Test(fsdp, sharding_names_say_both_families)
{
    tdm_fsdp_sharding s;
    static const struct {
        const char *n;
        tdm_fsdp_sharding s;
    } t[] = {{"full", TDM_FSDP_FULL_SHARD},     {"zero3", TDM_FSDP_FULL_SHARD},
             {"grad_op", TDM_FSDP_SHARD_GRAD_OP}, {"zero2", TDM_FSDP_SHARD_GRAD_OP},
             {"optimizer", TDM_FSDP_SHARD_OPTIM}, {"zero1", TDM_FSDP_SHARD_OPTIM}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        cr_assert_eq(tdm_fsdp_sharding_parse(t[i].n, &s), TDM_STATUS_OK);
        cr_assert_eq(s, t[i].s);
    }
    cr_assert_eq(tdm_fsdp_sharding_parse("zero4", &s), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "FULL_SHARD") && strstr(tdm_error_message(), "ZeRO-1"),
              "%s", tdm_error_message());
    cr_assert(strstr(tdm_fsdp_sharding_describe(TDM_FSDP_SHARD_GRAD_OP), "ZeRO stage 2"));
}
