/* tests/ckpt_diff_util.h: the largest difference between two checkpoints'
 * parameters (any mode's files of one model), for the CLI tests that
 * judge a design against one device within a float bound. Header-only. */
#ifndef TDM_TESTS_CKPT_DIFF_UTIL_H
#define TDM_TESTS_CKPT_DIFF_UTIL_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/device.h"
#include "models/checkpoint.h"
#include "models/model.h"

/* Both files load into model (a spec string); their steps must be equal.
 * TANDEM_TEST_VERBOSE prints the difference. */
static inline double ck_diff_of(const char *model, const char *a, const char *b)
{
    tdm_model_spec s;
    cr_assert_eq(tdm_model_spec_parse(&s, model), TDM_STATUS_OK);
    tdm_device *dev = NULL;
    tdm_model *ma = NULL, *mb = NULL;
    tdm_ckpt_info ia, ib;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&ma, dev, &s, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&mb, dev, &s, 2), TDM_STATUS_OK);
    cr_assert_eq(tdm_checkpoint_load(a, ma, NULL, &ia), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_checkpoint_load(b, mb, NULL, &ib), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(ia.step, ib.step, "%s at step %lld, %s at %lld", a, (long long)ia.step, b,
                 (long long)ib.step);
    double w = 0.0;
    const float *pa = tdm_model_params(ma), *pb = tdm_model_params(mb);
    for (int64_t i = 0; i < tdm_model_param_elems(ma); i++) {
        double d = fabs((double)pa[i] - (double)pb[i]);
        if (!(d <= w)) w = d;
    }
    tdm_model_free(ma);
    tdm_model_free(mb);
    tdm_device_free(dev);
    if (getenv("TANDEM_TEST_VERBOSE")) fprintf(stderr, "%s vs %s: %g\n", a, b, w);
    return w;
}

#endif
