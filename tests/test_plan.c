/* tests/test_plan.c: the memory planner (models/plan.h) against the
 * allocator. For the MLP, the CNN and the GPT, in FP32, BF16 and FP16
 * (with loss scaling), without and with activation checkpointing
 * (segments of 1 and 2), with the gradient norm measured, on a host
 * device and on the CUDA emulator (whole-batch convolutions, input
 * staging, no float16 widening; with and without optimizer offload), the
 * planned peak is within 5% of the device's measured peak over two
 * training steps (it is exact here: the planner sums the model's own
 * layout); and a plan's activations shrink with checkpointing and
 * precision the way the models do. */
#include <criterion/criterion.h>

#include "models/plan.h"
#include "tests/lever_util.h"

TestSuite(plan, .timeout = 240);

/* The device's peak (from the moment it was opened) over two steps. */
static size_t measured_peak(lv_model k, tdm_precision prec, int ckpt, const char *device,
                            int offload)
{
    tdm_model_spec spec;
    lv_spec(k, &spec);
    tdm_device *d = lv_open(device);
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    TU_OK(tdm_model_init(&m, d, &spec, 7));
    TU_OK(tdm_model_set_precision(m, prec));
    TU_OK(tdm_model_set_checkpoint(m, ckpt));
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, k == LV_GPT ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    if (k != LV_GPT) o.momentum = 0.9f;
    o.offload = offload ? TDM_OPTIM_OFFLOAD_HOST : TDM_OPTIM_OFFLOAD_NONE;
    TU_OK(tdm_optim_init(&opt, m, &o));
    tdm_grad_scaler sc;
    TU_OK(tdm_grad_scaler_init(&sc, NULL));
    tdm_single s = {.model = m, .opt = opt, .measure_norm = 1,
                    .scaler = prec == TDM_PRECISION_FP16 ? &sc : NULL};
    int B = lv_batch(k);
    float *x = tu_malloc((size_t)B * tdm_model_in_features(m) * 4);
    int32_t *y = tu_malloc((size_t)B * tdm_model_out_rows(m) * 4);
    double loss;
    for (int i = 0; i < 2; i++) {
        lv_data(k, &spec, i, x, y);
        TU_OK(tdm_single_step(&s, x, y, B, &loss));
    }
    tdm_dev_mem_stats ms;
    TU_OK(tdm_dev_mem_query(d, &ms));
    free(x);
    free(y);
    tdm_single_free(&s);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(d);
    return ms.peak_bytes;
}

static void planned(lv_model k, tdm_precision prec, int ckpt, tdm_device_kind kind, int offload,
                    tdm_plan *p)
{
    tdm_model_spec spec;
    lv_spec(k, &spec);
    tdm_plan_opts o;
    tdm_plan_opts_default(&o, &spec, lv_batch(k));
    o.precision = prec;
    o.ckpt = ckpt;
    if (k != LV_GPT) o.optim.momentum = 0.9f;
    o.optim.offload = offload ? TDM_OPTIM_OFFLOAD_HOST : TDM_OPTIM_OFFLOAD_NONE;
    o.device = kind;
    o.loss_scaling = prec == TDM_PRECISION_FP16;
    o.grad_norm = 1;
    TU_OK(tdm_plan_single(&o, p));
}

static void check(const char *device, tdm_device_kind kind, int offload)
{
    for (int k = 0; k < LV_N_MODELS; k++)
        for (int p = 0; p < 3; p++)
            for (int c = 0; c <= 2; c++) {
                tdm_plan pl;
                planned((lv_model)k, (tdm_precision)p, c, kind, offload, &pl);
                size_t got = measured_peak((lv_model)k, (tdm_precision)p, c, device, offload);
                double err = ((double)pl.peak - (double)got) / (double)got;
                cr_assert(fabs(err) <= 0.05, "%s %s ckpt %d on %s%s: planned %zu, measured %zu "
                          "(%+.2f%%)", lv_names[k], tdm_precision_name((tdm_precision)p), c,
                          device, offload ? " (offload)" : "", pl.peak, got, 100 * err);
                /* the planner sums the very allocations: nothing missing */
                cr_assert_eq(pl.peak, got, "%s %s ckpt %d on %s: planned %zu, measured %zu",
                             lv_names[k], tdm_precision_name((tdm_precision)p), c, device,
                             pl.peak, got);
            }
}

Test(plan, within_5_percent_on_the_host) { check("cpu", TDM_DEVICE_HOST, 0); }

Test(plan, within_5_percent_on_the_cuda_emulator)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    check("cuda", TDM_DEVICE_CUDA, 0);
    check("cuda", TDM_DEVICE_CUDA, 1);
}

Test(plan, levers_move_the_right_parts)
{
    tdm_plan f, b, ck, off;
    planned(LV_GPT, TDM_PRECISION_FP32, 0, TDM_DEVICE_HOST, 0, &f);
    planned(LV_GPT, TDM_PRECISION_BF16, 0, TDM_DEVICE_HOST, 0, &b);
    planned(LV_GPT, TDM_PRECISION_FP32, 1, TDM_DEVICE_HOST, 0, &ck);
    planned(LV_GPT, TDM_PRECISION_FP32, 0, TDM_DEVICE_CUDA, 1, &off);
    cr_assert(b.activations < f.activations && b.params_low > 0 && f.params_low == 0);
    cr_assert_eq(b.params, f.params);
    cr_assert(ck.activations < f.activations && ck.arena > 0 && f.arena == 0);
    cr_assert_eq(off.optim, 0);
    cr_assert_eq(off.optim_host, f.optim + 2 * f.params);
    /* per layer: block 0's first layer holds its tensors without
     * checkpointing, nothing of its own with it (all in the arena) but
     * the block's output */
    cr_assert(f.layer_bytes[1] > ck.layer_bytes[1]);
    tdm_plan_opts o;
    tdm_model_spec s;
    lv_spec(LV_MLP, &s);
    tdm_plan_opts_default(&o, &s, 0);
    cr_assert_eq(tdm_plan_single(&o, &f), TDM_STATUS_INVALID_ARG);
}
