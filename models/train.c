/* models/train.c: epoch loop, single-device step, evaluation. */
#include "models/train.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/timer.h"
#include "models/clip.h"
#include "models/precision.h"

void tdm_train_epoch_order(int64_t *perm, int64_t n, uint64_t seed, int64_t epoch)
{
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_SHUFFLE + (uint64_t)epoch);
    tdm_rng_permutation(&r, perm, n);
}

tdm_status tdm_train_step_tally(const tdm_train_epoch_opts *o, tdm_epoch_stats *out, int64_t s,
                                int64_t steps, const void *x, const int32_t *y, int n,
                                int samples, uint64_t t0)
{
    double loss = 0.0;
    TDM_CHECK(o->step(o->step_ctx, x, y, n, &loss));
    if (!isfinite(loss))
        return tdm_error_set(TDM_STATUS_NONFINITE,
                             "loss is %s at step %" PRId64 " (epoch %" PRId64 ", batch %" PRId64
                             " of %" PRId64 "): training diverged (a lower learning rate may "
                             "help)", isnan(loss) ? "NaN" : loss > 0 ? "+inf" : "-inf",
                             o->epoch * steps + s + 1, o->epoch + 1, s + 1, steps);
    out->loss_mean += loss * samples;   /* the sum, until tdm_train_tally_end */
    out->steps++;
    out->samples += samples;
    double secs = (double)(tdm_time_ns() - t0) * 1e-9;
    if (o->progress)
        o->progress(o->progress_ctx, s + 1, steps, loss,
                    secs > 0 ? (double)out->samples / secs : 0);
    return TDM_STATUS_OK;
}

void tdm_train_tally_end(tdm_epoch_stats *out, uint64_t t0)
{
    out->seconds = (double)(tdm_time_ns() - t0) * 1e-9;
    out->loss_mean = out->samples ? out->loss_mean / (double)out->samples : 0.0;
    out->samples_per_s = out->seconds > 0 ? (double)out->samples / out->seconds : 0.0;
}

tdm_status tdm_train_epoch(const tdm_dataset *d, const tdm_train_epoch_opts *o,
                           tdm_epoch_stats *out)
{
    tdm_status st = TDM_STATUS_OK;
    int batch = o->batch;
    int64_t epoch = o->epoch;
    TDM_REQUIRE(batch > 0, TDM_STATUS_INVALID_ARG, "batch size %d must be positive", batch);
    TDM_REQUIRE(d && d->n > 0, TDM_STATUS_INVALID_ARG, "empty dataset");
    int64_t feat = tdm_data_features(d);
    int64_t *perm = malloc((size_t)d->n * sizeof *perm);
    float *x = malloc((size_t)batch * (size_t)feat * sizeof(float));
    int32_t *y = malloc((size_t)batch * sizeof(int32_t));
    memset(out, 0, sizeof *out);
    if (!perm || !x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a batch of %d", batch);
        goto fail;
    }
    tdm_train_epoch_order(perm, d->n, o->seed, epoch);
    int64_t steps = o->drop_last ? d->n / batch : (d->n + batch - 1) / batch;
    if (o->max_steps > 0 && o->max_steps < steps) steps = o->max_steps;
    uint64_t t0 = tdm_time_ns();
    for (int64_t s = 0; s < steps; s++) {
        int64_t start = s * batch;
        int b = (int)(d->n - start < batch ? d->n - start : batch);
        tdm_data_gather(d, perm + start, b, x, y);
        TDM_TRY(tdm_train_step_tally(o, out, s, steps, x, y, b, b, t0));
    }
    tdm_train_tally_end(out, t0);
fail:
    free(perm);
    free(x);
    free(y);
    return st;
}

tdm_status tdm_train_grad_norm(tdm_model *m, double *norm)
{
    tdm_device *dev = tdm_model_device(m);
    int64_t n = tdm_model_param_elems(m);
    float *g = malloc((size_t)(n > 0 ? n : 1) * sizeof *g);
    if (!g) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot stage %" PRId64 " gradients", n);
    tdm_status st = n > 0 ? tdm_dev_copy_to_host(dev, g, tdm_model_grads(m),
                                                 (size_t)n * sizeof *g)
                          : TDM_STATUS_OK;
    double sq = 0.0;
    for (int p = 0; st == TDM_STATUS_OK && p < tdm_model_n_params(m); p++) {
        const tdm_tensor_info *ti = tdm_model_param_info(m, p);
        int64_t bad = 0;
        for (int64_t i = 0; i < ti->n_elem; i++) {
            float v = g[ti->offset + i];
            if (!isfinite(v)) bad++;
            else sq += (double)v * (double)v;
        }
        if (bad)
            st = tdm_error_set(TDM_STATUS_NONFINITE, "the gradient of '%s' holds %" PRId64
                               " non-finite value%s (NaN or infinite) of %" PRId64, ti->name,
                               bad, bad == 1 ? "" : "s", ti->n_elem);
    }
    free(g);
    if (st == TDM_STATUS_OK && norm) *norm = sqrt(sq);
    return st;
}

/* ---- a batch on the device ---- */

tdm_status tdm_train_stage_batch(tdm_train_stage *s, const tdm_model *m, const void *x,
                                 const int32_t *y, int batch, const void **xd,
                                 const int32_t **yd)
{
    s->dev = tdm_model_device(m);
    if (tdm_dev_kind(s->dev) == TDM_DEVICE_HOST) {
        *xd = x;
        *yd = y;
        return TDM_STATUS_OK;
    }
    /* 4-byte inputs of either dtype (models/model.h); out_rows targets per sample */
    size_t feat = (size_t)tdm_model_in_features(m), rows = (size_t)tdm_model_out_rows(m);
    if (batch > s->cap) {
        tdm_dev_free(s->dev, s->x);
        tdm_dev_free(s->dev, s->y);
        s->x = NULL;
        s->y = NULL;
        s->cap = 0;
        TDM_CHECK(tdm_dev_alloc(s->dev, (size_t)batch * feat * sizeof(float), &s->x));
        TDM_CHECK(tdm_dev_alloc(s->dev, (size_t)batch * rows * sizeof(int32_t), (void **)&s->y));
        s->cap = batch;
    }
    TDM_CHECK(tdm_dev_copy_from_host(s->dev, s->x, x, (size_t)batch * feat * sizeof(float)));
    TDM_CHECK(tdm_dev_copy_from_host(s->dev, s->y, y, (size_t)batch * rows * sizeof(int32_t)));
    *xd = s->x;
    *yd = s->y;
    return TDM_STATUS_OK;
}

tdm_status tdm_train_stage_dummy(tdm_train_stage *s, const tdm_model *m, const void **xd,
                                 const int32_t **yd)
{
    s->dev = tdm_model_device(m);
    if (!s->dummy_x) {
        size_t feat = (size_t)tdm_model_in_features(m), rows = (size_t)tdm_model_out_rows(m);
        TDM_CHECK(tdm_dev_alloc_zero(s->dev, feat * sizeof(float), &s->dummy_x));
        TDM_CHECK(tdm_dev_alloc_zero(s->dev, rows * sizeof(int32_t), (void **)&s->dummy_y));
    }
    *xd = s->dummy_x;
    *yd = s->dummy_y;
    return TDM_STATUS_OK;
}

tdm_status tdm_train_stage_dlogits(tdm_train_stage *s, size_t nbytes)
{
    if (nbytes <= s->dlogits_bytes) return TDM_STATUS_OK;
    tdm_dev_free(s->dev, s->dlogits);
    s->dlogits = NULL;
    s->dlogits_bytes = 0;
    TDM_CHECK(tdm_dev_alloc(s->dev, nbytes, (void **)&s->dlogits));
    s->dlogits_bytes = nbytes;
    return TDM_STATUS_OK;
}

void tdm_train_stage_free(tdm_train_stage *s)
{
    if (!s->dev) return;
    tdm_dev_free(s->dev, s->x);
    tdm_dev_free(s->dev, s->y);
    tdm_dev_free(s->dev, s->dlogits);
    tdm_dev_free(s->dev, s->dummy_x);
    tdm_dev_free(s->dev, s->dummy_y);
    *s = (tdm_train_stage){.dev = s->dev};
}

tdm_status tdm_single_finish(tdm_single *s)
{
    tdm_model *m = s->model;
    int found_inf = 0;
    if (s->scaler)
        TDM_CHECK(tdm_grad_scaler_unscale(s->scaler, tdm_model_device(m), tdm_model_grads(m),
                                          tdm_model_param_elems(m), &found_inf));
    if (!found_inf && (s->clip_norm > 0.0 || s->measure_norm))
        TDM_CHECK(tdm_clip_grad_norm(m, s->clip_norm, &s->last_norm));
    if (!found_inf) TDM_CHECK(tdm_optim_step(s->opt));
    if (s->scaler) tdm_grad_scaler_update(s->scaler, found_inf);
    s->last_skipped = found_inf;
    return TDM_STATUS_OK;
}

tdm_status tdm_single_step(void *ctx, const void *x, const int32_t *y, int batch,
                           double *loss_mean)
{
    tdm_single *s = ctx;
    tdm_model *m = s->model;
    tdm_device *dev = tdm_model_device(m);
    const void *xd;
    const float *logits;
    const int32_t *yd;
    double loss_sum = 0.0;
    uint64_t t0 = tdm_time_ns(), t1, t2, t3;
    TDM_CHECK(tdm_train_stage_batch(&s->stage, m, x, y, batch, &xd, &yd));
    TDM_CHECK(tdm_model_zero_grad(m));
    TDM_CHECK(tdm_model_forward(m, xd, batch, &logits));
    t1 = tdm_time_ns();
    float *dlogits = tdm_model_loss_grad(m);
    /* loss scaling: the scale times 1/B, one rounding (exact for the
     * scaler's powers of two) */
    float lscale = s->scaler ? tdm_grad_scaler_scale(s->scaler) : 1.0f;
    TDM_CHECK(tdm_model_loss(m, logits, yd, batch, lscale / (float)batch, &loss_sum, dlogits));
    t2 = tdm_time_ns();
    TDM_CHECK(tdm_model_backward(m, dlogits));
    t3 = tdm_time_ns();
    TDM_CHECK(tdm_single_finish(s));
    TDM_CHECK(tdm_dev_sync(dev));
    uint64_t t4 = tdm_time_ns();
    memset(s->ms, 0, sizeof s->ms);
    s->ms[TDM_PHASE_FORWARD] = (double)(t1 - t0) * 1e-6;
    s->ms[TDM_PHASE_LOSS] = (double)(t2 - t1) * 1e-6;
    s->ms[TDM_PHASE_BACKWARD] = (double)(t3 - t2) * 1e-6;
    s->ms[TDM_PHASE_STEP] = (double)(t4 - t3) * 1e-6;
    if (loss_mean) *loss_mean = loss_sum / batch;
    return TDM_STATUS_OK;
}

void tdm_single_free(tdm_single *s)
{
    if (s) tdm_train_stage_free(&s->stage);
}

tdm_status tdm_evaluate_batch(tdm_model *m, const void *xd, const int32_t *yd, const int32_t *y,
                              int b, double *loss_sum, int64_t *correct)
{
    const float *logits;
    double ls = 0.0;
    int64_t c = 0;
    TDM_CHECK(tdm_model_forward(m, xd, b, &logits));
    TDM_CHECK(tdm_loss_softmax_xent(tdm_model_device(m), logits, yd, b, tdm_model_n_classes(m),
                                    1.0f, &ls, NULL));
    TDM_CHECK(tdm_model_count_correct(m, y, b, &c));
    *loss_sum += ls;
    *correct += c;
    return TDM_STATUS_OK;
}

tdm_status tdm_evaluate_staged(tdm_model *m, const tdm_dataset *d, int batch,
                               tdm_train_stage *stage, double *loss_mean, double *accuracy)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(batch > 0, TDM_STATUS_INVALID_ARG, "batch size %d must be positive", batch);
    TDM_REQUIRE(d && d->n > 0, TDM_STATUS_INVALID_ARG, "evaluate: empty dataset");
    TDM_REQUIRE(tdm_model_out_rows(m) == 1 && tdm_model_input_dtype(m) == TDM_MODEL_INPUT_F32,
                TDM_STATUS_INVALID_ARG,
                "evaluate: an image dataset needs a classifier (one label per sample); a GPT "
                "is evaluated on text (tdm_train_text_evaluate)");
    int64_t feat = tdm_data_features(d);
    int was_train = tdm_model_is_train(m);
    TDM_REQUIRE(feat == tdm_model_in_features(m), TDM_STATUS_INVALID_ARG,
                "dataset has %lld features per sample but the model expects %d",
                (long long)feat, tdm_model_in_features(m));
    tdm_model_set_train(m, 0);
    double loss = 0.0;
    int64_t correct = 0;
    for (int64_t start = 0; start < d->n; start += batch) {
        int b = (int)(d->n - start < batch ? d->n - start : batch);
        const void *xd;
        const int32_t *yd;
        TDM_TRY(tdm_train_stage_batch(stage, m, d->x + start * feat, d->y + start, b, &xd,
                                      &yd));
        TDM_TRY(tdm_evaluate_batch(m, xd, yd, d->y + start, b, &loss, &correct));
    }
    if (loss_mean) *loss_mean = loss / (double)d->n;
    if (accuracy) *accuracy = (double)correct / (double)d->n;
fail:
    tdm_model_set_train(m, was_train);
    return st;
}

tdm_status tdm_evaluate(tdm_model *m, const tdm_dataset *d, int batch, double *loss_mean,
                        double *accuracy)
{
    tdm_train_stage stage = {0};
    tdm_status st = tdm_evaluate_staged(m, d, batch, &stage, loss_mean, accuracy);
    tdm_train_stage_free(&stage);
    return st;
}
