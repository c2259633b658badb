/* tools/train_npy.c: `--data X.npy,Y.npy` and `--val-data X.npy,Y.npy`
 * for train and eval: NumPy arrays (core/npy.h) as the training and
 * validation sets, checked against the model (features per sample,
 * labels below its class count) with one line per problem. Not the .npy
 * format (core/npy.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/npy.h"
#include "models/builder.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

/* Without --val-data, this share of --data's samples (the last ones)
 * validates, as a gpt's text does. */
#define TDM_NPY_VAL_PERCENT 10

/* The samples [from, n) of d moved into a new set *out; d keeps [0, from). */
static tdm_status tdm_npy_split_tail(tdm_dataset *d, int64_t from, tdm_dataset *out)
{
    int64_t f = tdm_data_features(d), n = d->n - from;
    *out = *d;
    out->n = n;
    out->x = malloc((size_t)(n * f) * sizeof(float));
    out->y = malloc((size_t)n * sizeof(int32_t));
    if (!out->x || !out->y) {
        free(out->x);
        free(out->y);
        memset(out, 0, sizeof *out);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a validation split");
    }
    memcpy(out->x, d->x + from * f, (size_t)(n * f) * sizeof(float));
    memcpy(out->y, d->y + from, (size_t)n * sizeof(int32_t));
    d->n = from;
    return TDM_STATUS_OK;
}

static tdm_status tdm_npy_fits(const char *what, const tdm_dataset *d, const tdm_model_spec *spec)
{
    int c, h, w, classes;
    tdm_model_spec_sample_shape(spec, &c, &h, &w, &classes);
    int64_t want = (int64_t)spec->in_c * spec->in_h * spec->in_w;
    if (tdm_data_features(d) != want)
        return tdm_error_set(TDM_STATUS_USAGE, "%s: %lld values per sample (%dx%dx%d) but the "
                             "model reads %lld", what, (long long)tdm_data_features(d), d->c,
                             d->h, d->w, (long long)want);
    int top = d->n_classes - 1;
    if (top >= classes)
        return tdm_error_set(TDM_STATUS_USAGE, "%s: label %d but the model has %d classes "
                             "(0..%d)", what, top, classes, classes - 1);
    return TDM_STATUS_OK;
}

tdm_status tdm_train_check_seq(const tdm_train_args *a, const tdm_model_spec *spec)
{
    if (tdm_model_spec_lever_op(spec) < 0) return TDM_STATUS_OK;
    if ((a->precision && strcmp(a->precision, "fp32")) || a->ckpt) {
        char why[512];
        tdm_model_spec_lever_refusal(spec, why, sizeof why);
        return tdm_tool_usage_error("tandem train: --model %s: %s (leave out --precision and "
                                    "--checkpoint-activations)\n", a->model, why);
    }
    return TDM_STATUS_OK;
}

int tdm_train_model_is_gpt(const char *model)
{
    if (!strncmp(model, "gpt", 3)) return 1;
    if (strncmp(model, "file:", 5)) return 0;
    tdm_model_spec s;
    if (tdm_model_spec_parse(&s, model) != TDM_STATUS_OK) {
        tdm_error_clear();
        return 0;
    }
    return s.kind == TDM_MODEL_GPT;
}

tdm_status tdm_train_load_npy(const tdm_train_args *a, const tdm_model_spec *spec,
                              tdm_dataset *train, tdm_dataset *test)
{
    tdm_status st = TDM_STATUS_OK;
    const char *what = "--data";
    memset(train, 0, sizeof *train);
    memset(test, 0, sizeof *test);
    TDM_TRY(tdm_data_load_npy(train, a->data));
    TDM_TRY(tdm_npy_fits(a->data, train, spec));
    if (a->val_data) {
        what = "--val-data";
        TDM_TRY(tdm_data_load_npy(test, a->val_data));
        TDM_TRY(tdm_npy_fits(a->val_data, test, spec));
    } else {
        int64_t n_val = train->n * TDM_NPY_VAL_PERCENT / 100;
        if (n_val < 1 || n_val >= train->n) {
            st = tdm_error_set(TDM_STATUS_USAGE, "%s: %lld samples leave none to validate on "
                               "(give --val-data X.npy,Y.npy)", a->data, (long long)train->n);
            goto fail;
        }
        TDM_TRY(tdm_npy_split_tail(train, train->n - n_val, test));
    }
    /* tdm_train_check_memory says why itself */
    if ((st = tdm_train_check_memory(a, spec)) != TDM_STATUS_OK) {
        tdm_data_free(train);
        tdm_data_free(test);
        return st;
    }
    return TDM_STATUS_OK;
fail:
    if (st != TDM_STATUS_OK && tdm_error_message()[0])
        fprintf(stderr, "tandem train: %s: %s\n", what, tdm_error_message());
    tdm_data_free(train);
    tdm_data_free(test);
    return st == TDM_STATUS_FORMAT || st == TDM_STATUS_INVALID_ARG ? TDM_STATUS_USAGE : st;
}
