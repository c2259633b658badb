/* tests/test_gpt_parallel.c: the GPT under DataParallel and DDP against
 * one device on the same global batches of text windows, as the MLP's
 * tests do: DP over 1..3 devices with even, uneven and idle chunks; DDP
 * over 1..3 ranks (tests/test_ddp_util.h's check) with an uneven split,
 * and with buckets so small that every parameter group is its own - the
 * tied token embedding, whose gradient is complete only at the end of
 * backward, must still be reduced with its final value - and overlap on
 * and off giving the same bits. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dp/dp.h"
#include "tests/test_ddp_util.h"
#include "tests/test_util.h"

TestSuite(gpt_parallel, .timeout = 180);

static const tddp_tol g_tol = {.loss_atol = 1e-6, .loss_rtol = 1e-5, .grad_atol = 1e-6,
                               .grad_rtol = 1e-4, .param_atol = 1e-6, .param_rtol = 1e-4};

Test(gpt_parallel, ddp_equals_one_device_1_to_3_ranks)
{
    for (int w = 1; w <= 3; w++) {
        tddp_cfg c = tddp_cfg_default();
        c.gpt = 1;
        c.batch = 7;   /* 7 windows over 2 or 3 ranks: uneven shares */
        c.steps = 2;
        tddp_check_equiv(&c, NULL, w, 60000, g_tol);
    }
}

Test(gpt_parallel, ddp_small_buckets_overlap_on_and_off)
{
    for (int no_overlap = 0; no_overlap < 2; no_overlap++) {
        tddp_cfg c = tddp_cfg_default();
        c.gpt = 1;
        c.batch = 6;
        c.steps = 2;
        c.cap_bytes = 2048;     /* 7 buckets from step 2 on (PyTorch's rule) */
        c.first_bytes = 1024;
        c.no_overlap = no_overlap;
        tddp_check_equiv(&c, NULL, 2, 60000, g_tol);
    }
    /* and the buckets really were many, and launched in order */
    tddp_shared *sh = tddp_shared_new();
    cr_assert(sh);
    tddp_cfg c = tddp_cfg_default();
    c.gpt = 1;
    c.batch = 4;
    c.steps = 2;            /* step 1 reduces one bucket; the plan is rebuilt for step 2 */
    c.cap_bytes = 2048;
    c.first_bytes = 1024;
    cr_assert_eq(tddp_spawn(2, &c, NULL, sh, 60000), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_gt(sh->n_buckets, 5, "%d buckets", sh->n_buckets);
    cr_assert(sh->launch_order_ok);
    tddp_shared_free(sh);
}

Test(gpt_parallel, dp_equals_one_device)
{
    static const int batches[] = {1, 2, 5, 6};
    tdm_model_spec spec;
    tddp_spec_gpt(&spec);
    const tdm_text *text = tddp_text();
    for (int n = 1; n <= 3; n++)
        for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
            int B = batches[bi], T = TDDP_GPT_T;
            tdm_device *devs[TDM_DP_MAX_DEVICES], *ref_dev = tu_host();
            int nd = 0;
            char specs[16];
            snprintf(specs, sizeof specs, "cpu:%d", n);
            TU_OK(tdm_dp_devices_open(specs, devs, &nd));
            tdm_model *ref = NULL, *m = NULL;
            TU_OK(tdm_model_init(&ref, ref_dev, &spec, 9));
            TU_OK(tdm_model_init(&m, devs[0], &spec, 9));
            tdm_optim *oref = NULL, *odp = NULL;
            TU_OK(tdm_sgd_init(&oref, ref, 0.1f, 0.9f));
            TU_OK(tdm_sgd_init(&odp, m, 0.1f, 0.9f));
            tdm_dp *dp = NULL;
            TU_OK(tdm_dp_init(&dp, m, devs, nd, NULL));
            int32_t *x = tu_malloc((size_t)B * T * 4), *y = tu_malloc((size_t)B * T * 4);
            tdm_single single = {.model = ref, .opt = oref};
            for (int s = 0; s < 2; s++) {
                tdm_text_windows(text, T, 1, s, 0, B, x, y);
                double lr_, ld;
                TU_OK(tdm_single_step(&single, x, y, B, &lr_));
                TU_OK(tdm_dp_step(dp, odp, x, y, B, &ld));
                cr_assert(fabs(ld - lr_) <= 1e-6 + 1e-5 * fabs(lr_),
                          "%d devices batch %d step %d: loss %.8f vs %.8f", n, B, s, ld, lr_);
            }
            int64_t pe = tdm_model_param_elems(m), at = 0;
            double r = tu_tol_ratio(tdm_model_grads(m), tdm_model_grads(ref), pe, 1e-6, 1e-4,
                                    &at, NULL);
            cr_assert(r <= 1.0, "%d devices batch %d: grad[%lld] %g vs %g", n, B,
                      (long long)at, tdm_model_grads(m)[at], tdm_model_grads(ref)[at]);
            r = tu_tol_ratio(tdm_model_params(m), tdm_model_params(ref), pe, 1e-6, 1e-4, &at,
                             NULL);
            cr_assert(r <= 1.0, "%d devices batch %d: param[%lld]", n, B, (long long)at);
            free(x);
            free(y);
            tdm_single_free(&single);
            tdm_dp_free(dp);
            tdm_optim_free(oref);
            tdm_optim_free(odp);
            tdm_model_free(ref);
            tdm_model_free(m);
            tdm_dp_devices_close(devs, nd);
            tdm_device_free(ref_dev);
        }
}

/* DP refuses bad targets before any device work, naming the sample. */
Test(gpt_parallel, dp_refuses_targets_outside_the_vocabulary)
{
    tdm_model_spec spec;
    tddp_spec_gpt(&spec);
    tdm_device *devs[TDM_DP_MAX_DEVICES];
    int nd = 0;
    TU_OK(tdm_dp_devices_open("cpu:2", devs, &nd));
    tdm_model *m = NULL;
    TU_OK(tdm_model_init(&m, devs[0], &spec, 9));
    tdm_optim *o = NULL;
    TU_OK(tdm_sgd_init(&o, m, 0.1f, 0.9f));
    tdm_dp *dp = NULL;
    TU_OK(tdm_dp_init(&dp, m, devs, nd, NULL));
    int32_t x[2 * TDDP_GPT_T] = {0}, y[2 * TDDP_GPT_T] = {0};
    y[TDDP_GPT_T + 3] = 300;
    double l;
    cr_assert_eq(tdm_dp_step(dp, o, x, y, 2, &l), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "label 300 of sample 1"), "%s", tdm_error_message());
    x[5] = 256;
    y[TDDP_GPT_T + 3] = 0;
    cr_assert_eq(tdm_dp_step(dp, o, x, y, 2, &l), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "token 256"), "%s", tdm_error_message());
    tdm_dp_free(dp);
    tdm_optim_free(o);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, nd);
}
