/* models/train_text.h: training a language model on text (core/text.h):
 * epochs of random windows handed to the same step functions the image
 * models use (models/train.h: the single-device step, tdm_dp_step, the
 * CLI's DDP rank steps in tools/), and the mean loss over the fixed
 * evaluation windows. Nothing here knows of
 * parallelism: a DDP rank asks for its share [lo, hi) of every global
 * batch and draws only those windows. */
#ifndef TDM_MODELS_TRAIN_TEXT_H
#define TDM_MODELS_TRAIN_TEXT_H

#include <stdint.h>

#include "core/text.h"
#include "models/model.h"
#include "models/train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An epoch draws about as many target bytes as the training split holds:
 * ceil(n / (batch * T)) steps. */
int64_t tdm_train_text_steps_per_epoch(const tdm_text *train, int T, int batch);

/* One epoch of text, o->epoch of a run whose epochs hold full =
 * tdm_train_text_steps_per_epoch(train, T, o->batch) global steps each:
 * global steps [epoch * full, epoch * full + n), n = full capped at
 * o->max_steps (so --max-steps and resuming draw the windows an
 * uninterrupted run of the same epochs draws). Step s draws the windows
 * of tdm_text_windows(train, T, o->seed, s, ...) and hands this
 * process's share, windows [lo, hi) of the global batch of o->batch
 * (0 <= lo < hi <= batch; the whole batch: 0, batch), to o->step, whose
 * loss is the global batch's mean (what every step function of
 * models/train.h, dp/ and tools/ returns). The statistics count global
 * windows. o->drop_last does not apply: every step draws a full batch. */
tdm_status tdm_train_text_epoch(const tdm_text *train, int T, int lo, int hi,
                                const tdm_train_epoch_opts *o, tdm_epoch_stats *out);

/* The sum over evaluation windows [lo, hi) of count (tdm_text_eval_count)
 * of each window's mean loss, with m (a GPT; context T = its n_ctx) in
 * eval mode, `batch` windows per forward. A DDP rank evaluates its share
 * and the sums are added; the mean is the total over count. */
tdm_status tdm_train_text_eval_sum(tdm_model *m, const tdm_text *text, int64_t count, int64_t lo,
                             int64_t hi, int batch, double *loss_sum);

/* Mean loss in nats per byte over the evaluation windows (at most cap)
 * of text. */
tdm_status tdm_train_text_evaluate(tdm_model *m, const tdm_text *text, int64_t cap, int batch,
                             double *loss_mean);

#ifdef __cplusplus
}
#endif

#endif
