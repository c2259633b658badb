/* tests/ckpt_diff_util.h: the largest difference between two checkpoints'
 * parameters (any mode's files of one model), for the CLI tests that
 * judge a design against one device within a float bound; two files the
 * same but for the loss scaler's metadata. Header-only. */
#ifndef TDM_TESTS_CKPT_DIFF_UTIL_H
#define TDM_TESTS_CKPT_DIFF_UTIL_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/safetensors.h"
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

/* The checkpoint's "loss_scale" metadata as a number (0: none). */
static inline double ckpt_loss_scale(const char *file)
{
    tdm_st_file *f = NULL;
    cr_assert_eq(tdm_st_load_header(&f, file), TDM_STATUS_OK, "%s", tdm_error_message());
    const char *v = tdm_st_meta_get(f, "loss_scale");
    double x = v ? strtod(v, NULL) : 0.0;
    tdm_st_free(f);
    return x;
}

/* 1 when the checkpoints hold the same tensors (names, shapes, bytes)
 * and the same metadata apart from the loss scaler's. */
static inline int same_but_loss_scaler(const char *a, const char *b)
{
    tdm_st_file *fa = NULL, *fb = NULL;
    cr_assert_eq(tdm_st_load(&fa, a), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_st_load(&fb, b), TDM_STATUS_OK, "%s", tdm_error_message());
    int same = tdm_st_count(fa) == tdm_st_count(fb);
    for (int i = 0; same && i < tdm_st_count(fa); i++) {
        const tdm_st_tensor *x = tdm_st_get(fa, i), *y = tdm_st_find(fb, x->name);
        same = y && x->dtype == y->dtype && x->nbytes == y->nbytes &&
               !memcmp(x->data, y->data, x->nbytes);
    }
    for (int pass = 0; pass < 2; pass++) {
        tdm_st_file *f = pass ? fb : fa, *g = pass ? fa : fb;
        for (int i = 0; same && i < tdm_st_meta_count(f); i++) {
            const tdm_st_meta *m = tdm_st_meta_at(f, i);
            if (!strncmp(m->key, "loss_scale", 10)) continue;
            const char *v = tdm_st_meta_get(g, m->key);
            same = v && !strcmp(v, m->value);
        }
    }
    tdm_st_free(fa);
    tdm_st_free(fb);
    return same;
}

#endif
