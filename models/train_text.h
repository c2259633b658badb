/* models/train_text.h: training a language model on text (core/text.h):
 * epochs of random windows handed to the same step functions the image
 * models use (single device here, DP in dp/, DDP ranks in ddp/), and the
 * mean loss over the fixed evaluation windows. Nothing here knows of
 * parallelism: a DDP rank asks for its share [lo, hi) of every global
 * batch and draws only those windows. */
#ifndef TDM_MODELS_TRAIN_TEXT_H
#define TDM_MODELS_TRAIN_TEXT_H

#include <stdint.h>

#include "core/text.h"
#include "models/model.h"
#include "models/train.h"

/* An epoch draws about as many target bytes as the training split holds:
 * ceil(n / (batch * T)) steps. */
int64_t tdm_train_text_steps_per_epoch(const tdm_text *train, int T, int batch);

/* Global steps [first_step, first_step + steps): step s draws the windows
 * of tdm_text_windows(train, T, seed, s, ...) and hands this process's
 * share, windows [lo, hi) of the global batch of `batch` (0 <= lo < hi <=
 * batch; the whole batch: 0, batch), to step(ctx, x, y, hi - lo, &loss),
 * whose loss is the global batch's mean (what every step function of
 * models/train.h, dp/ and tools/ returns). The statistics count global
 * windows. */
tdm_status tdm_train_text_steps(const tdm_text *train, int T, int batch, uint64_t seed,
                                int64_t first_step, int64_t steps, int lo, int hi,
                                tdm_train_step_fn step, void *step_ctx,
                                tdm_train_progress_fn progress, void *progress_ctx,
                                tdm_epoch_stats *out);

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

#endif
