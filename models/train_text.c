/* models/train_text.c: text epochs and evaluation (see models/train_text.h). */
#include "models/train_text.h"

#include <stdlib.h>
#include <string.h>

#include "core/timer.h"

int64_t tdm_train_text_steps_per_epoch(const tdm_text *train, int T, int batch)
{
    int64_t per = (int64_t)T * batch;
    return per > 0 ? (train->n + per - 1) / per : 0;
}

tdm_status tdm_train_text_epoch(const tdm_text *train, int T, int lo, int hi,
                                const tdm_train_epoch_opts *o, tdm_epoch_stats *out)
{
    tdm_status st = TDM_STATUS_OK;
    int batch = o->batch;
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(T >= 1 && train->n >= (int64_t)T + 1, TDM_STATUS_INVALID_ARG,
                "text training: %lld bytes cannot hold a window of %d", (long long)train->n, T);
    TDM_REQUIRE(batch >= 1 && lo >= 0 && lo < hi && hi <= batch, TDM_STATUS_INVALID_ARG,
                "text training: share [%d, %d) of a batch of %d", lo, hi, batch);
    int64_t full = tdm_train_text_steps_per_epoch(train, T, batch);
    int64_t first_step = o->epoch * full;
    int64_t steps = o->max_steps > 0 && o->max_steps < full ? o->max_steps : full;
    int n = hi - lo;
    int32_t *x = malloc((size_t)n * T * sizeof(int32_t));
    int32_t *y = malloc((size_t)n * T * sizeof(int32_t));
    if (!x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "text training: a batch of %d windows", n);
        goto fail;
    }
    uint64_t t0 = tdm_time_ns();
    for (int64_t s = 0; s < steps; s++) {
        tdm_text_windows(train, T, o->seed, first_step + s, lo, n, x, y);
        /* the global batch's windows: the loss is every rank's mean */
        TDM_TRY(tdm_train_step_tally(o, out, s, steps, x, y, n, batch, t0));
    }
    tdm_train_tally_end(out, t0);
fail:
    free(x);
    free(y);
    return st;
}

tdm_status tdm_train_text_eval_sum(tdm_model *m, const tdm_text *text, int64_t count, int64_t lo,
                             int64_t hi, int batch, double *loss_sum)
{
    tdm_status st = TDM_STATUS_OK;
    int T = tdm_model_in_features(m);
    *loss_sum = 0.0;
    TDM_REQUIRE(tdm_model_input_dtype(m) == TDM_MODEL_INPUT_TOKENS, TDM_STATUS_INVALID_ARG,
                "text evaluation needs a language model (gpt)");
    TDM_REQUIRE(batch >= 1 && lo >= 0 && lo <= hi && hi <= count &&
                    count <= tdm_text_eval_count(text, T, 0),
                TDM_STATUS_INVALID_ARG, "text evaluation: windows [%lld, %lld) of %lld",
                (long long)lo, (long long)hi, (long long)count);
    tdm_device *dev = tdm_model_device(m);
    int host = tdm_dev_kind(dev) == TDM_DEVICE_HOST, was_train = tdm_model_is_train(m);
    size_t nb = (size_t)batch * T * sizeof(int32_t);
    int32_t *x = malloc(nb), *y = malloc(nb), *xd = NULL, *yd = NULL;
    if (!x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "text evaluation: out of memory");
        goto fail;
    }
    if (!host) {
        TDM_TRY(tdm_dev_alloc(dev, nb, (void **)&xd));
        TDM_TRY(tdm_dev_alloc(dev, nb, (void **)&yd));
    }
    tdm_model_set_train(m, 0);
    for (int64_t w = lo; w < hi; w += batch) {
        int b = (int)(hi - w < batch ? hi - w : batch);
        for (int i = 0; i < b; i++)
            tdm_text_eval_window(text, T, count, w + i, x + (int64_t)i * T, y + (int64_t)i * T);
        const float *logits;
        double ls = 0.0;
        if (!host) {
            TDM_TRY(tdm_dev_copy_from_host(dev, xd, x, (size_t)b * T * sizeof(int32_t)));
            TDM_TRY(tdm_dev_copy_from_host(dev, yd, y, (size_t)b * T * sizeof(int32_t)));
        }
        TDM_TRY(tdm_model_forward(m, host ? x : xd, b, &logits));
        TDM_TRY(tdm_model_loss(m, logits, host ? y : yd, b, 1.0f, &ls, NULL));
        *loss_sum += ls;
    }
fail:
    tdm_model_set_train(m, was_train);
    if (xd) tdm_dev_free(dev, xd);
    if (yd) tdm_dev_free(dev, yd);
    free(x);
    free(y);
    return st;
}

tdm_status tdm_train_text_evaluate(tdm_model *m, const tdm_text *text, int64_t cap, int batch,
                             double *loss_mean)
{
    int64_t count = tdm_text_eval_count(text, tdm_model_in_features(m), cap);
    TDM_REQUIRE(count > 0, TDM_STATUS_INVALID_ARG,
                "text evaluation: %lld bytes hold no window of %d", (long long)text->n,
                tdm_model_in_features(m));
    double s = 0.0;
    TDM_CHECK(tdm_train_text_eval_sum(m, text, count, 0, count, batch, &s));
    *loss_mean = s / (double)count;
    return TDM_STATUS_OK;
}
