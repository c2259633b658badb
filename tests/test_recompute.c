/* tests/test_recompute.c: activation checkpointing (models/recompute.h).
 * Ten single-device steps of the MLP, the CNN (three input channels, two
 * conv blocks with batchnorm) and the GPT with checkpointed segments of 1
 * and 2 units give bitwise the parameters, gradients, batchnorm running
 * statistics and losses of the same run without it, in FP32, BF16 and
 * FP16, on the host and on the CUDA emulator (no fused batchnorm+pool
 * there). The allocator's peak during the steps drops by the activations
 * of all but one segment's units, exactly as many bytes as the blocks'
 * tensors hold, so checkpointing keeps one block's activations plus the
 * block inputs. Bad settings are refused. */
#include <criterion/criterion.h>

#include "tests/lever_util.h"

TestSuite(recompute, .timeout = 240);

static void expect_same(lv_model k, const lv_cfg *a, const lv_cfg *b)
{
    lv_result r0, r1;
    lv_train(k, a, &r0);
    lv_train(k, b, &r1);
    const char *p = tdm_precision_name(a->prec);
    for (int i = 0; i < a->steps; i++)
        cr_assert(r0.loss[i] == r1.loss[i], "%s %s ckpt %d: loss of step %d %.9g vs %.9g",
                  lv_names[k], p, b->ckpt, i, r0.loss[i], r1.loss[i]);
    cr_assert(!memcmp(r0.grads, r1.grads, (size_t)r0.n_params * 4),
              "%s %s ckpt %d on %s: gradients differ", lv_names[k], p, b->ckpt,
              a->device ? a->device : "cpu");
    cr_assert(!memcmp(r0.params, r1.params, (size_t)r0.n_params * 4),
              "%s %s ckpt %d: parameters differ", lv_names[k], p, b->ckpt);
    cr_assert(!memcmp(r0.buffers, r1.buffers, (size_t)r0.n_buffers * 4),
              "%s %s ckpt %d: batchnorm running statistics differ", lv_names[k], p, b->ckpt);
    lv_free(&r0);
    lv_free(&r1);
}

static void same_bits_all(const char *device)
{
    static const tdm_precision precs[] = {TDM_PRECISION_FP32, TDM_PRECISION_BF16,
                                          TDM_PRECISION_FP16};
    for (int k = 0; k < LV_N_MODELS; k++)
        for (int p = 0; p < 3; p++)
            for (int n = 1; n <= 2; n++) {
                lv_cfg a = {.prec = precs[p], .steps = 10, .device = device};
                lv_cfg b = a;
                b.ckpt = n;
                expect_same((lv_model)k, &a, &b);
            }
}

Test(recompute, ten_steps_bitwise_equal_on_the_host) { same_bits_all("cpu"); }

Test(recompute, ten_steps_bitwise_equal_on_the_cuda_emulator)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    same_bits_all("cuda");
}

/* One GPT block's kept tensors, its output (res2) excluded, for B windows
 * of T (models/gpt_impl.h lists them). */
static size_t gpt_block_bytes(const tdm_model_spec *s, int B, tdm_precision p)
{
    size_t N = (size_t)B * s->n_ctx, C = s->n_embd, att = (size_t)B * s->n_head * s->n_ctx * s->n_ctx;
    size_t es = p == TDM_PRECISION_FP32 ? 4 : 2;
    /* ln_1, qkv, att, atty, ln_2, c_fc, gelu; res1 and the statistics float32 */
    return (N * C * (1 + 3 + 1 + 1 + 4 + 4)) * es + att * es + N * C * 4 + 4 * N * 4;
}

/* 64-byte allocations: a tensor's bytes rounded up as the allocator does */
#define SLACK(n_tensors) ((size_t)(n_tensors) * 64)

Test(recompute, gpt_keeps_one_blocks_activations_plus_the_block_inputs)
{
    for (int p = 0; p < 2; p++) {
        tdm_precision prec = p ? TDM_PRECISION_BF16 : TDM_PRECISION_FP32;
        tdm_model_spec s;
        lv_spec(LV_GPT, &s);
        lv_cfg a = {.prec = prec, .steps = 2}, b = a;
        b.ckpt = 1;
        lv_result r0, r1;
        lv_train(LV_GPT, &a, &r0);
        lv_train(LV_GPT, &b, &r1);
        size_t blk = gpt_block_bytes(&s, lv_batch(LV_GPT), prec), L = (size_t)s.n_layer;
        /* without: L blocks' tensors; with: one block's (the arena) and
         * every block's output (its successor's input), as without */
        size_t want = r0.act_peak - (L - 1) * blk;
        cr_assert(r1.act_peak <= want + SLACK(16) && r1.act_peak + SLACK(16 * L) >= want,
                  "%s: peak activations %zu with checkpointing, %zu without; one block holds "
                  "%zu: expected %zu", tdm_precision_name(prec), r1.act_peak, r0.act_peak, blk,
                  want);
        lv_free(&r0);
        lv_free(&r1);
    }
}

Test(recompute, cnn_and_mlp_keep_one_segment)
{
    /* CNN, segments of 1 conv block: without, each block keeps conv out,
     * bn out, the pooling's winners and its output; with, one block's
     * first three (the larger, the first) and every block's output */
    tdm_model_spec s;
    lv_spec(LV_CNN, &s);
    size_t B = (size_t)lv_batch(LV_CNN), hw = (size_t)s.in_h * s.in_w;
    size_t blk1 = B * hw * s.ch1 * 4 * 2 + B * hw / 4 * s.ch1 * 4;
    size_t blk2 = B * hw / 4 * s.ch2 * 4 * 2 + B * hw / 16 * s.ch2 * 4;
    lv_cfg a = {.steps = 2}, b = a;
    b.ckpt = 1;
    lv_result r0, r1;
    lv_train(LV_CNN, &a, &r0);
    lv_train(LV_CNN, &b, &r1);
    size_t big = blk1 > blk2 ? blk1 : blk2;
    size_t want = r0.act_peak - (blk1 + blk2) + big;
    cr_assert(r1.act_peak <= want + SLACK(8) && r1.act_peak + SLACK(8) >= want,
              "cnn: %zu with, %zu without, expected %zu", r1.act_peak, r0.act_peak, want);
    lv_free(&r0);
    lv_free(&r1);
    /* MLP 24-32-32-32-32-10 in segments of 2 linear layers: the outputs
     * of layers 1 and 3 (B x 32 each) go to one shared slot */
    lv_cfg c = {.steps = 2}, e = c;
    e.ckpt = 2;
    lv_train(LV_MLP, &c, &r0);
    lv_train(LV_MLP, &e, &r1);
    size_t lay = (size_t)lv_batch(LV_MLP) * 32 * 4;
    cr_assert_eq(r0.act_peak - r1.act_peak, lay, "mlp: %zu with, %zu without", r1.act_peak,
                 r0.act_peak);
    lv_free(&r0);
    lv_free(&r1);
}

Test(recompute, refuses_a_negative_segment)
{
    tdm_device *d = tu_host();
    tdm_model *m = NULL;
    tdm_model_spec s;
    lv_spec(LV_MLP, &s);
    TU_OK(tdm_model_init(&m, d, &s, 1));
    cr_assert_eq(tdm_model_set_checkpoint(m, -1), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "-1 units per segment"), "%s", tdm_error_message());
    cr_assert_eq(tdm_model_n_units(m), 5);
    tdm_model_free(m);
    tdm_device_free(d);
}
