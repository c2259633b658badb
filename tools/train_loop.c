/* tools/train_loop.c: the epoch loop of `tandem train`, the one every
 * mode (single, DP, DDP ranks) and model (images, a GPT on text) runs:
 * the learning-rate schedule on the optimizer, each epoch with its
 * progress line, evaluation, the epoch's line, the checkpoint, and the
 * mode's hook after the epoch. What differs between modes comes in a
 * tdm_train_run (tools/train_modes.h): the step, the evaluation, the
 * hook; what differs between images and text is the data, the epoch's
 * line and the saved line. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/timer.h"
#include "dist/step.h"
#include "models/checkpoint.h"
#include "models/precision.h"
#include "models/train_text.h"
#include "tools/train_modes.h"
#include "tools/train_trace.h"

/* The progress line: a bar on a terminal, else a line every tenth of the
 * epoch; a tdm_train_progress_fn over a tdm_progress. */
typedef struct tdm_progress {
    int tty, quiet;
    int64_t epoch, epochs;
    int64_t last_tenth;
    int64_t T;   /* a gpt's window in tokens (0: images): the same unit as the epoch's line */
} tdm_progress;

/* "N samples/s", or for text "N windows/s = M tokens/s" as the epoch's line */
static void tdm_progress_rate(FILE *f, const tdm_progress *p, double sps)
{
    if (p->T > 0) fprintf(f, "%.0f windows/s = %.0f tokens/s", sps, sps * (double)p->T);
    else fprintf(f, "%.0f samples/s", sps);
}

static void tdm_train_progress(void *ctx, int64_t step, int64_t steps, double loss, double sps)
{
    tdm_progress *p = ctx;
    if (p->quiet) return;
    if (p->tty) {
        int width = 30, filled = (int)(width * step / steps);
        fprintf(stderr, "\r  epoch %lld/%lld [", (long long)p->epoch + 1, (long long)p->epochs);
        for (int i = 0; i < width; i++) fputc(i < filled ? '=' : (i == filled ? '>' : ' '), stderr);
        fprintf(stderr, "] %lld/%lld loss %.4f  ", (long long)step, (long long)steps, loss);
        tdm_progress_rate(stderr, p, sps);
        fputs("   ", stderr);
        if (step == steps) fputs("\r\033[K", stderr);
        fflush(stderr);
    } else {
        int64_t tenth = step * 10 / steps;
        if (tenth != p->last_tenth && (tenth < 10)) {
            printf("  epoch %lld/%lld step %lld/%lld loss %.4f ", (long long)p->epoch + 1,
                   (long long)p->epochs, (long long)step, (long long)steps, loss);
            tdm_progress_rate(stdout, p, sps);
            printf("\n");
            fflush(stdout);
        }
        p->last_tenth = tenth;
    }
}

/* Steps per epoch: the global batches of the training set (windows of
 * text), --max-steps at most. */
static int64_t tdm_train_epoch_steps(const tdm_train_args *a, const tdm_train_run *r)
{
    int64_t full = r->text ? tdm_train_text_steps_per_epoch(&r->text->corpus->train, r->text->T,
                                                            (int)a->batch)
                           : (r->train->n + tdm_train_effective_batch(a) - 1) /
                                 tdm_train_effective_batch(a);
    return a->max_steps > 0 && a->max_steps < full ? a->max_steps : full;
}

/* Test hook, read nowhere else and not for users: TANDEM_TEST_SLOWDOWN=F
 * (1 < F <= 100) makes every step take F times as long (it sleeps F - 1
 * times the step's own time after it): the planted slowdown that
 * tests/test_selftest.c's baseline gate must catch. */
#define TDM_TRAIN_SLOWDOWN_ENV "TANDEM_TEST_SLOWDOWN"

typedef struct tdm_train_slow {
    tdm_train_step_fn step;
    void *ctx;
    double factor;
} tdm_train_slow;

static tdm_status tdm_train_slow_step(void *ctx, const void *x, const int32_t *y, int batch,
                                      double *loss)
{
    const tdm_train_slow *s = ctx;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = s->step(s->ctx, x, y, batch, loss);
    double extra_ns = (double)(tdm_time_ns() - t0) * (s->factor - 1.0);
    struct timespec ts = {.tv_sec = (time_t)(extra_ns / 1e9),
                          .tv_nsec = (long)fmod(extra_ns, 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    return st;
}

static double tdm_train_slowdown(void)
{
    const char *v = getenv(TDM_TRAIN_SLOWDOWN_ENV);
    double f = v ? strtod(v, NULL) : 0.0;
    return f > 1.0 && f <= 100.0 ? f : 0.0;
}

/* --trace: each step's span and phases into the run's recorder. */
typedef struct tdm_train_traced {
    tdm_train_step_fn step;
    void *ctx;
    const tdm_train_run *r;
} tdm_train_traced;

static tdm_status tdm_train_traced_step(void *ctx, const void *x, const int32_t *y, int batch,
                                        double *loss)
{
    const tdm_train_traced *s = ctx;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = s->step(s->ctx, x, y, batch, loss);
    uint64_t t1 = tdm_time_ns();
    tdm_phase_times ph;
    int have = st == TDM_STATUS_OK && s->r->phases && s->r->phases(s->r->phases_ctx, &ph);
    tdm_train_trace_step(s->r->trace, tdm_optim_steps(s->r->opt), t0, t1, have ? &ph : NULL);
    return st;
}

static tdm_status tdm_train_one_epoch(const tdm_train_args *a, const tdm_train_run *r,
                                      int64_t e, tdm_progress *p, tdm_epoch_stats *es)
{
    /* one step per effective batch (--grad-accum micro-batches of --batch) */
    tdm_train_epoch_opts o = {.batch = (int)tdm_train_effective_batch(a),
                              .seed = (uint64_t)a->seed, .epoch = e,
                              .max_steps = a->max_steps, .step = r->step,
                              .step_ctx = r->step_ctx, .progress = tdm_train_progress,
                              .progress_ctx = p};
    tdm_train_slow slow = {.step = r->step, .ctx = r->step_ctx, .factor = tdm_train_slowdown()};
    if (slow.factor > 0) {
        o.step = tdm_train_slow_step;
        o.step_ctx = &slow;
    }
    tdm_train_traced traced = {.step = o.step, .ctx = o.step_ctx, .r = r};
    if (r->trace) {
        o.step = tdm_train_traced_step;
        o.step_ctx = &traced;
    }
    tdm_model_set_train(r->m, 1);
    if (r->text)
        return tdm_train_text_epoch(&r->text->corpus->train, r->text->T, r->lo, r->hi, &o, es);
    return tdm_train_epoch(r->train, &o, es);
}

static tdm_status tdm_train_evaluate(const tdm_train_run *r, double *loss, double *acc)
{
    if (r->eval) return r->eval(r->eval_ctx, loss, acc);
    return tdm_evaluate(r->m, r->test, TDM_TRAIN_EVAL_BATCH, loss, acc);
}

int tdm_train_eval_rows(const tdm_train_args *a, int replicas, int cap)
{
    long long n = replicas > 0 ? replicas : 1;
    long long rows = a->batch / n;   /* the smallest replica's share */
    return rows < 1 ? 1 : rows < cap ? (int)rows : cap;
}

static void tdm_train_print_epoch(const tdm_train_args *a, const tdm_train_run *r, int64_t e,
                                  const tdm_epoch_stats *es, double loss, double acc)
{
    /* --precise: 9 significant digits, to compare with another
     * implementation (tandem eval prints those too) */
    const char *lf = a->precise ? "%.9g" : "%.4f";
    printf("epoch %lld/%lld: train loss ", (long long)e + 1, (long long)a->epochs);
    printf(lf, es->loss_mean);
    if (r->text) {
        printf(", %.0f windows/s = %.0f tokens/s (%.1f s)", es->samples_per_s,
               es->samples_per_s * r->text->T, es->seconds);
        if (!a->no_eval) {
            printf(", val loss ");
            printf(lf, loss);
            printf(" nats = ");
            printf(a->precise ? "%.9g" : "%.3f", loss / M_LN2);
            printf(" bits per byte (bigram %.4f)", r->text->bigram);
        }
    } else {
        printf(", %.0f samples/s (%.1f s)", es->samples_per_s, es->seconds);
        if (!a->no_eval) {
            printf(", test loss ");
            printf(lf, loss);
            printf(", test accuracy ");
            printf(lf, acc);
        }
    }
    tdm_train_levers_epoch(r);
    printf("\n");
    fflush(stdout);
}

/* --save after epoch e: the last step's gradients must be finite, or the
 * run went bad (the parameters are checked by the save itself). */
static tdm_status tdm_train_save(const tdm_train_args *a, const tdm_train_run *r, int64_t e)
{
    tdm_ckpt_info info = {.step = tdm_optim_steps(r->opt), .epoch = e + 1,
                          .seed = (uint64_t)a->seed};
    const tdm_grad_scaler *sc = r->single ? r->single->scaler
                                : r->ranks ? r->ranks->scaler : NULL;
    if (sc) {   /* a resumed run goes on from it (tools/train_levers.c) */
        info.loss_scale = sc->scale;
        info.loss_scale_growth = sc->growth_tracker;
    }
    double gnorm = 0.0;
    tdm_status st = tdm_train_grad_norm(r->m, &gnorm);
    if (st == TDM_STATUS_OK) st = tdm_checkpoint_save(a->save, r->m, r->opt, &info);
    else tdm_error_prefix(st, "step %lld: refusing to save %s", (long long)info.step, a->save);
    if (st != TDM_STATUS_OK) return st;
    if (a->quiet) return TDM_STATUS_OK;
    printf("  saved %s (epoch %lld, step %lld)", a->save, (long long)e + 1, (long long)info.step);
    if (r->text)
        printf("; tandem sample --resume %s%s%s", a->save,
               tdm_model_get_spec(r->m)->head_untied ? " --model " : "",
               tdm_model_get_spec(r->m)->head_untied ? a->model : "");
    printf("\n");
    return TDM_STATUS_OK;
}

/* After a failure: what --save holds now, so nobody wonders whether the
 * failed run replaced it. */
static void tdm_train_note_kept(const tdm_train_args *a, int64_t saved_epoch)
{
    if (!a->save || access(a->save, F_OK) != 0) return;
    if (saved_epoch > 0)
        fprintf(stderr, "tandem train: %s was left as it was: it holds epoch %lld, the last "
                        "good one\n", a->save, (long long)saved_epoch);
    else
        fprintf(stderr, "tandem train: %s was left as it was\n", a->save);
}

tdm_status tdm_train_epochs(const tdm_train_args *a, const tdm_train_run *r)
{
    int cosine = !strcmp(a->lr_schedule, "cosine");
    tdm_status st = tdm_optim_set_schedule(
        r->opt, cosine ? TDM_OPTIM_SCHEDULE_COSINE : TDM_OPTIM_SCHEDULE_CONST, a->lr,
        tdm_train_epoch_steps(a, r) * a->epochs);
    if (st != TDM_STATUS_OK) return tdm_train_fail("--lr-schedule", st);
    if (r->start_epoch >= a->epochs) {
        printf("tandem train: the checkpoint has %lld epoch%s done and --epochs %lld asks for "
               "no more: nothing to do (raise --epochs to train further)\n",
               (long long)r->start_epoch, r->start_epoch == 1 ? "" : "s", a->epochs);
        fflush(stdout);
        return TDM_STATUS_OK;
    }
    tdm_progress p = {.tty = isatty(STDERR_FILENO), .quiet = a->quiet, .epochs = a->epochs,
                      .T = r->text ? r->text->T : 0};
    int64_t saved_epoch = -1;   /* the last epoch this run saved */
    for (int64_t e = r->start_epoch; e < a->epochs; e++) {
        tdm_epoch_stats es;
        p.epoch = e;
        p.last_tenth = -1;
        if ((st = tdm_train_one_epoch(a, r, e, &p, &es)) != TDM_STATUS_OK) {
            if (p.tty && !p.quiet) fputs("\n", stderr);
            tdm_train_fail("training", st);
            tdm_train_note_kept(a, saved_epoch);
            return st;
        }
        double loss = NAN, acc = NAN;
        uint64_t t0 = tdm_time_ns();
        if (!a->no_eval && (st = tdm_train_evaluate(r, &loss, &acc)) != TDM_STATUS_OK)
            return tdm_train_fail("evaluation", st);
        if (!a->no_eval) tdm_train_trace_span(r->trace, TDM_TRAIN_TRACE_EVAL, e + 1, t0,
                                              tdm_time_ns());
        tdm_train_print_epoch(a, r, e, &es, loss, acc);
        if ((st = tdm_train_out_epoch(a, r->text ? r->text->T : 0, e + 1, es.loss_mean,
                                      es.samples_per_s, es.seconds, loss,
                                      r->text ? loss / M_LN2 : acc)) != TDM_STATUS_OK)
            return st;
        if (a->save) {
            t0 = tdm_time_ns();
            if ((st = tdm_train_save(a, r, e)) != TDM_STATUS_OK) {
                tdm_train_fail("saving checkpoint", st);
                tdm_train_note_kept(a, saved_epoch);
                return st;
            }
            saved_epoch = e + 1;
            tdm_train_trace_span(r->trace, TDM_TRAIN_TRACE_SAVE, e + 1, t0, tdm_time_ns());
        }
        t0 = tdm_time_ns();
        if (r->after && (st = r->after(r->after_ctx, e)) != TDM_STATUS_OK) return st;
        if (r->after) tdm_train_trace_span(r->trace, TDM_TRAIN_TRACE_AFTER, e + 1, t0,
                                           tdm_time_ns());
    }
    return TDM_STATUS_OK;
}
