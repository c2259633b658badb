/* tools/train_uneven.c: `tandem train --mode ddp|fsdp --uneven`: every rank
 * trains on its own share of each epoch as a DistributedSampler without
 * padding gives it (samples r, r+N, r+2N, ... of the epoch's permutation:
 * the first n mod N ranks get one sample more), in local batches of
 * --batch / N, so ranks may run different numbers of steps. DDP (or FSDP)
 * is built with opts.join: each step averages the mean-loss gradients of
 * the ranks that still have a batch, and a rank out of data shadows the
 * others' steps (tdm_ddp_join, tdm_fsdp_join) until all are done - no
 * hang, no mismatch error. Not the global-batch split of the default mode
 * (tools/train_ranks.c over dist/step.c), which equals single-device
 * training exactly. The loop is the same for every design: it calls the
 * design's ops (dist/step.h) through tools/train_ranks.c. --model gpt
 * runs it too: its items are the windows of the epoch that the default
 * mode draws, ceil(bytes / T) of them, window k to rank k mod N. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/timer.h"
#include "dist/step.h"
#include "models/train_text.h"
#include "tools/elastic.h"
#include "tools/train_modes.h"

/* The epoch's items: the training set's samples, or a gpt's windows: as
 * many as the training text holds bytes (ceil(n / T)), the ones the
 * default mode draws in order (window k is window k mod B of the epoch's
 * global step k / B, tdm_text_windows), so that its windows, too, are
 * the same stream split another way. */
static int64_t tdm_uneven_items(const tdm_train_uneven *u)
{
    if (!u->text) return u->train->n;
    return (u->text->corpus->train.n + u->text->T - 1) / u->text->T;
}

/* Items idx[0..n) of epoch e into x, y. */
static void tdm_uneven_gather(const tdm_train_args *a, const tdm_train_uneven *u, int64_t e,
                              const int64_t *idx, int n, void *x, int32_t *y)
{
    const tdm_train_text_set *t = u->text;
    if (!t) {
        tdm_data_gather(u->train, idx, n, x, y);
        return;
    }
    const tdm_text *text = &t->corpus->train;
    int64_t B = a->batch, full = tdm_train_text_steps_per_epoch(text, t->T, (int)B);
    for (int i = 0; i < n; i++)
        tdm_text_windows(text, t->T, (uint64_t)a->seed, e * full + idx[i] / B, idx[i] % B, 1,
                         (int32_t *)x + (int64_t)i * t->T, y + (int64_t)i * t->T);
}

static void tdm_uneven_print_epoch(const tdm_train_args *a, const tdm_train_uneven *u, int64_t e,
                                   const double *sums, double secs, double tl, double acc)
{
    double sps = secs > 0 ? sums[1] / secs : 0.0, lm = sums[1] > 0 ? sums[0] / sums[1] : 0.0;
    if (u->text) {
        printf("epoch %lld/%lld: train loss %.4f, %.0f windows/s = %.0f tokens/s (%.1f s)",
               (long long)e + 1, (long long)a->epochs, lm, sps, sps * u->text->T, secs);
        if (!a->no_eval)
            printf(", val loss %.4f nats = %.3f bits per byte (bigram %.4f)", tl, tl / M_LN2,
                   u->text->bigram);
        return;
    }
    printf("epoch %lld/%lld: train loss %.4f, %.0f samples/s (%.1f s)", (long long)e + 1,
           (long long)a->epochs, lm, sps, secs);
    if (!a->no_eval) printf(", test loss %.4f, test accuracy %.4f", tl, acc);
}

tdm_status tdm_train_uneven_run(const tdm_train_args *a, const tdm_train_uneven *u)
{
    const tdm_dist_ops *ops = u->ops;
    void *w = u->w;
    tdm_comm *comm = u->comm;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    int b = (int)(a->batch / world > 0 ? a->batch / world : 1);
    /* per item: x's 4-byte values (floats or tokens) and y's labels */
    int64_t feat = u->text ? u->text->T : tdm_data_features(u->train);
    int64_t ys = u->text ? u->text->T : 1;
    int64_t items = tdm_uneven_items(u);
    int64_t *perm = u->text ? NULL : malloc((size_t)items * sizeof *perm);
    int64_t *idx = malloc((size_t)b * sizeof *idx);
    void *x = malloc((size_t)b * (size_t)feat * 4);
    int32_t *y = malloc((size_t)b * (size_t)ys * sizeof *y);
    int64_t *counts = calloc((size_t)world * 2, sizeof *counts);
    /* the test hook (tools/elastic.h), here for every mode: the modes'
     * own step calls, which fire it otherwise, are not this loop's */
    int kill_sig = 0;
    int64_t kill_step = tdm_elastic_test_fault(rank, &kill_sig), taken = 0;
    tdm_status st = TDM_STATUS_OK;
    if ((!perm && !u->text) || !idx || !x || !y || !counts) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rank %d: --uneven: batches of %d", rank,
                           b);
        goto fail;
    }
    if (rank == 0)
        printf("  uneven inputs: each rank takes its own %s (no padding) in batches of "
               "%d; a rank out of data shadows the others (join)\n",
               u->text ? "windows" : "samples", b);
    for (int64_t e = u->start_epoch; e < a->epochs; e++) {
        if (perm) tdm_train_epoch_order(perm, items, (uint64_t)a->seed, e);
        int64_t mine = items > rank ? (items - rank + world - 1) / world : 0;
        int64_t steps = (mine + b - 1) / b;
        if (a->max_steps > 0 && steps > a->max_steps) steps = a->max_steps;
        double sums[2] = {0.0, 0.0};   /* loss sum, samples */
        uint64_t t0 = tdm_time_ns();
        tdm_model_set_train(u->m, 1);
        for (int64_t s = 0; s < steps; s++) {
            int n = (int)(mine - s * b < b ? mine - s * b : b);
            for (int i = 0; i < n; i++) {
                int64_t k = rank + (s * b + i) * world;
                idx[i] = perm ? perm[k] : k;
            }
            tdm_uneven_gather(a, u, e, idx, n, x, y);
            if (++taken == kill_step) tdm_elastic_test_fault_fire(rank, kill_sig, taken);
            double lm = 0.0;
            if ((st = ops->zero_grad(w)) || (st = ops->forward_mean(w, x, y, n, &lm)))
                goto fail;
            if (!isfinite(lm)) {
                st = tdm_error_set(TDM_STATUS_NONFINITE, "loss is %s at rank %d's step %lld of "
                                   "epoch %lld: training diverged (a lower learning rate may "
                                   "help)", isnan(lm) ? "NaN" : "infinite", rank,
                                   (long long)s + 1, (long long)e + 1);
                goto fail;
            }
            if ((st = ops->backward(w)) || (st = ops->step(w, u->opt))) goto fail;
            sums[0] += lm * n;
            sums[1] += n;
        }
        int64_t shadowed = 0;
        if ((st = ops->join(w, u->opt, &shadowed))) goto fail;
        double secs = (double)(tdm_time_ns() - t0) * 1e-9;
        int64_t own[2] = {steps, shadowed};
        if ((st = tdm_comm_all_reduce(comm, sums, sums, 2, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM)) ||
            (st = tdm_comm_all_gather(comm, own, counts, 2, TDM_DTYPE_INT64)))
            goto fail;
        double tl = NAN, acc = NAN;
        if (!a->no_eval) {
            st = u->eval ? u->eval(u->ctx, &tl, &acc)
                         : ops->evaluate(w, u->test,
                                          tdm_train_eval_rows(a, world, TDM_TRAIN_EVAL_BATCH),
                                          &tl, &acc);
            if (st) goto fail;
        }
        tdm_uneven_print_epoch(a, u, e, sums, secs, tl, acc);
        printf("\n  steps per rank:");
        for (int r = 0; r < world; r++) printf(" %lld", (long long)counts[2 * r]);
        printf(" (shadowed after joining:");
        for (int r = 0; r < world; r++) printf(" %lld", (long long)counts[2 * r + 1]);
        printf(")\n");
        fflush(stdout);
        if (u->save && (st = u->save(u->ctx, e))) goto fail;
        if ((st = tdm_comm_barrier(comm))) goto fail;
    }
fail:
    if (st) {
        fprintf(stderr, "tandem train: rank %d: training (--uneven): %s\n", rank,
                tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
        tdm_comm_abort(comm, tdm_error_message());
    }
    free(perm);
    free(idx);
    free(x);
    free(y);
    free(counts);
    return st;
}
