/* tests/test_fsdp_recompute.c: activation checkpointing under sharded
 * data parallel. A recomputed segment of N > 1 checkpoint units spans
 * several FSDP units, whose parameters must all be gathered while the
 * segment's forward runs again: 10 steps of FSDP (full shard, and ZeRO-2
 * and ZeRO-1 alongside) with segments of 2 and 4 units give bitwise the
 * gradients (first and last step), losses and parameters of the same run
 * without checkpointing, on the MLP (one unit per linear layer), the CNN
 * (conv blocks with batchnorm) and the GPT (one unit per block, the tied
 * head), in fp32 and bf16, at 2 and 3 ranks. */
#include <criterion/criterion.h>

#include "tests/test_fsdp_util.h"

static tdm_dataset g_mlp, g_cnn;

/* MLP 20-16-16-16-16-12-5: six linear layers, six units */
static const int g_dims[] = {20, 16, 16, 16, 16, 12, 5};

static void setup(void)
{
    tf_cfg m = tf_cfg_default(), c = tf_cfg_default();
    m.dims = g_dims;
    m.ndims = 7;
    c.model = 1;
    cr_assert_eq(tf_data(&g_mlp, &m, 600), TDM_STATUS_OK);
    cr_assert_eq(tf_data(&g_cnn, &c, 600), TDM_STATUS_OK);
}

static void teardown(void)
{
    tdm_data_free(&g_mlp);
    tdm_data_free(&g_cnn);
}

TestSuite(fsdp_recompute, .init = setup, .fini = teardown, .timeout = 300);

static const char *const g_model_names[] = {"mlp", "cnn", "gpt"};

static tf_cfg cfg_of(int model, tdm_fsdp_sharding sh, tdm_precision prec)
{
    tf_cfg c = tf_cfg_default();
    c.model = model;
    c.sharding = sh;
    c.prec = prec;
    c.steps = 10;
    if (model == 0) {
        c.dims = g_dims;
        c.ndims = 7;
    }
    if (model == 1) c.batch = 14;
    if (model == 2) {
        c.gpt_layers = 4;
        c.batch = 6;
        c.adamw = 1;
    }
    return c;
}

static int64_t first_diff(const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof a[i])) return i;
    return -1;
}

/* c without checkpointing and with segments of `ckpt` units, over
 * `world` ranks: bitwise the same run. */
static void check_same_bits(tf_cfg c, int ckpt, int world)
{
    const tdm_dataset *data = c.model == 1 ? &g_cnn : &g_mlp;
    tf_shared *a = tf_shared_new(), *b = tf_shared_new();
    cr_assert(a && b);
    const char *what = tdm_fsdp_sharding_name(c.sharding);
    const char *model = g_model_names[c.model];
    const char *prec = tdm_precision_name(c.prec);
    c.ckpt = 0;
    cr_assert_eq(tf_spawn(world, &c, data, a, 120000), TDM_STATUS_OK, "%s %s %s: %s / %s",
                 what, model, prec, tdm_error_message(), a->err[0]);
    c.ckpt = ckpt;
    cr_assert_eq(tf_spawn(world, &c, data, b, 120000), TDM_STATUS_OK,
                 "%s %s %s, segments of %d: %s / %s", what, model, prec, ckpt,
                 tdm_error_message(), b->err[0]);
    int64_t n = a->n_elem, at;
    cr_assert(n > 0 && n == b->n_elem);
    for (int s = 0; s < c.steps; s++)
        cr_assert(!memcmp(&a->loss[s], &b->loss[s], sizeof a->loss[s]),
                  "%s %s %s world %d, segments of %d: step %d loss %.17g vs %.17g without", what,
                  model, prec, world, ckpt, s, b->loss[s], a->loss[s]);
    at = first_diff(a->grads0, b->grads0, n);
    cr_assert(at < 0, "%s %s %s world %d, segments of %d: step 0 gradient[%lld] %.9g vs %.9g "
              "without", what, model, prec, world, ckpt, (long long)at, b->grads0[at],
              a->grads0[at]);
    at = first_diff(a->grads_last, b->grads_last, n);
    cr_assert(at < 0, "%s %s %s world %d, segments of %d: step %d gradient[%lld] %.9g vs %.9g "
              "without", what, model, prec, world, ckpt, c.steps - 1, (long long)at,
              b->grads_last[at], a->grads_last[at]);
    at = first_diff(a->params, b->params, n);
    cr_assert(at < 0, "%s %s %s world %d, segments of %d: parameter[%lld] %.9g vs %.9g "
              "without", what, model, prec, world, ckpt, (long long)at, b->params[at],
              a->params[at]);
    tf_shared_free(a);
    tf_shared_free(b);
}

Test(fsdp_recompute, full_shard_segments_of_2_and_4_change_no_bit)
{
    for (int model = 0; model < 3; model++)
        for (int ckpt = 2; ckpt <= 4; ckpt += 2)
            check_same_bits(cfg_of(model, TDM_FSDP_FULL_SHARD, TDM_PRECISION_FP32), ckpt, 2);
}

Test(fsdp_recompute, full_shard_in_bf16_at_3_ranks)
{
    for (int model = 0; model < 3; model++)
        check_same_bits(cfg_of(model, TDM_FSDP_FULL_SHARD, TDM_PRECISION_BF16), 2, 3);
}

Test(fsdp_recompute, zero2_and_zero1_segments_of_2)
{
    for (int model = 0; model < 3; model++) {
        check_same_bits(cfg_of(model, TDM_FSDP_SHARD_GRAD_OP, TDM_PRECISION_FP32), 2, 2);
        check_same_bits(cfg_of(model, TDM_FSDP_SHARD_OPTIM, TDM_PRECISION_FP32), 2, 2);
    }
}

/* Without prefetching, every unit is gathered on use alone: the segment's
 * units gathered for the recomputation must still all be present. */
Test(fsdp_recompute, full_shard_without_prefetch_or_overlap)
{
    for (int model = 0; model < 3; model++) {
        tf_cfg c = cfg_of(model, TDM_FSDP_FULL_SHARD, TDM_PRECISION_FP32);
        c.no_prefetch = 1;
        c.no_overlap = 1;
        check_same_bits(c, 2, 2);
        c.no_overlap = 0;
        c.micro = 2;   /* no_sync backwards keep the full gradients */
        check_same_bits(c, 3, 2);
    }
}
