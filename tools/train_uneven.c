/* tools/train_uneven.c: `tandem train --mode ddp|fsdp --uneven`: every rank
 * trains on its own share of each epoch as a DistributedSampler without
 * padding gives it (samples r, r+N, r+2N, ... of the epoch's permutation:
 * the first n mod N ranks get one sample more), in local batches of
 * --batch / N, so ranks may run different numbers of steps. DDP (or FSDP)
 * is built with opts.join: each step averages the mean-loss gradients of
 * the ranks that still have a batch, and a rank out of data shadows the
 * others' steps (tdm_ddp_join, tdm_fsdp_join) until all are done - no
 * hang, no mismatch error. Not the global-batch split of the default mode
 * (tools/train_ddp.c, tools/train_fsdp.c), which equals single-device
 * training exactly. The loop is the same for both modes (tdm_train_uneven_run
 * with the mode's calls); DDP's calls are here, FSDP's in
 * tools/train_fsdp.c. --model gpt --mode ddp runs it too
 * (tools/train_text.c): its items are the windows of the epoch that the
 * default mode draws, ceil(bytes / T) of them, window k to rank k mod N. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/timer.h"
#include "ddp/ddp.h"
#include "models/train_text.h"
#include "tools/elastic.h"
#include "tools/train_modes.h"

/* The epoch's items: the training set's samples, or a gpt's windows: as
 * many as the training text holds bytes (ceil(n / T)), the ones the
 * default mode draws in order (window k is window k mod B of the epoch's
 * global step k / B, tdm_text_windows), so that its windows, too, are
 * the same stream split another way. */
static int64_t tdm_uneven_items(const tdm_train_uneven_ops *ops, const tdm_dataset *train)
{
    if (!ops->text) return train->n;
    return (ops->text->train->n + ops->text->T - 1) / ops->text->T;
}

/* Items idx[0..n) of epoch e into x, y. */
static void tdm_uneven_gather(const tdm_train_args *a, const tdm_train_uneven_ops *ops,
                              const tdm_dataset *train, int64_t e, const int64_t *idx, int n,
                              void *x, int32_t *y)
{
    const tdm_train_uneven_text *t = ops->text;
    if (!t) {
        tdm_data_gather(train, idx, n, x, y);
        return;
    }
    int64_t B = a->batch, full = tdm_train_text_steps_per_epoch(t->train, t->T, (int)B);
    for (int i = 0; i < n; i++)
        tdm_text_windows(t->train, t->T, (uint64_t)a->seed, e * full + idx[i] / B, idx[i] % B,
                         1, (int32_t *)x + (int64_t)i * t->T, y + (int64_t)i * t->T);
}

static void tdm_uneven_print_epoch(const tdm_train_args *a, const tdm_train_uneven_ops *ops,
                                   int64_t e, const double *sums, double secs, double tl,
                                   double acc)
{
    double sps = secs > 0 ? sums[1] / secs : 0.0, lm = sums[1] > 0 ? sums[0] / sums[1] : 0.0;
    if (ops->text) {
        printf("epoch %lld/%lld: train loss %.4f, %.0f windows/s = %.0f tokens/s (%.1f s)",
               (long long)e + 1, (long long)a->epochs, lm, sps, sps * ops->text->T, secs);
        if (!a->no_eval)
            printf(", val loss %.4f nats = %.3f bits per byte (bigram %.4f)", tl, tl / M_LN2,
                   ops->text->bigram);
        return;
    }
    printf("epoch %lld/%lld: train loss %.4f, %.0f samples/s (%.1f s)", (long long)e + 1,
           (long long)a->epochs, lm, sps, secs);
    if (!a->no_eval) printf(", test loss %.4f, test accuracy %.4f", tl, acc);
}

tdm_status tdm_train_uneven_run(const tdm_train_args *a, const tdm_train_uneven_ops *ops,
                                tdm_comm *comm, const tdm_dataset *train,
                                const tdm_dataset *test, int64_t start_epoch)
{
    tdm_model *m = ops->m;
    void *ctx = ops->ctx;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    int b = (int)(a->batch / world > 0 ? a->batch / world : 1);
    /* per item: x's 4-byte values (floats or tokens) and y's labels */
    int64_t feat = ops->text ? ops->text->T : tdm_data_features(train);
    int64_t ys = ops->text ? ops->text->T : 1;
    int64_t items = tdm_uneven_items(ops, train);
    int64_t *perm = ops->text ? NULL : malloc((size_t)items * sizeof *perm);
    int64_t *idx = malloc((size_t)b * sizeof *idx);
    void *x = malloc((size_t)b * (size_t)feat * 4);
    int32_t *y = malloc((size_t)b * (size_t)ys * sizeof *y);
    int64_t *counts = calloc((size_t)world * 2, sizeof *counts);
    /* the test hook (tools/elastic.h), here for every mode: the modes'
     * own step calls, which fire it otherwise, are not this loop's */
    int kill_sig = 0;
    int64_t kill_step = tdm_elastic_test_fault(rank, &kill_sig), taken = 0;
    tdm_status st = TDM_STATUS_OK;
    if ((!perm && !ops->text) || !idx || !x || !y || !counts) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rank %d: --uneven: batches of %d", rank,
                           b);
        goto fail;
    }
    if (rank == 0)
        printf("  uneven inputs: each rank takes its own %s (no padding) in batches of "
               "%d; a rank out of data shadows the others (join)\n",
               ops->text ? "windows" : "samples", b);
    for (int64_t e = start_epoch; e < a->epochs; e++) {
        if (perm) tdm_train_epoch_order(perm, items, (uint64_t)a->seed, e);
        int64_t mine = items > rank ? (items - rank + world - 1) / world : 0;
        int64_t steps = (mine + b - 1) / b;
        if (a->max_steps > 0 && steps > a->max_steps) steps = a->max_steps;
        double sums[2] = {0.0, 0.0};   /* loss sum, samples */
        uint64_t t0 = tdm_time_ns();
        tdm_model_set_train(m, 1);
        for (int64_t s = 0; s < steps; s++) {
            int n = (int)(mine - s * b < b ? mine - s * b : b);
            for (int i = 0; i < n; i++) {
                int64_t k = rank + (s * b + i) * world;
                idx[i] = perm ? perm[k] : k;
            }
            tdm_uneven_gather(a, ops, train, e, idx, n, x, y);
            if (++taken == kill_step) tdm_elastic_test_fault_fire(rank, kill_sig, taken);
            double lm = 0.0;
            if ((st = ops->zero_grad(ctx)) || (st = ops->forward(ctx, x, y, n, &lm))) goto fail;
            if (!isfinite(lm)) {
                st = tdm_error_set(TDM_STATUS_NONFINITE, "loss is %s at rank %d's step %lld of "
                                   "epoch %lld: training diverged (a lower learning rate may "
                                   "help)", isnan(lm) ? "NaN" : "infinite", rank,
                                   (long long)s + 1, (long long)e + 1);
                goto fail;
            }
            if ((st = ops->backward_step(ctx))) goto fail;
            sums[0] += lm * n;
            sums[1] += n;
        }
        int64_t shadowed = 0;
        if ((st = ops->join(ctx, &shadowed))) goto fail;
        double secs = (double)(tdm_time_ns() - t0) * 1e-9;
        int64_t own[2] = {steps, shadowed};
        if ((st = tdm_comm_all_reduce(comm, sums, sums, 2, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM)) ||
            (st = tdm_comm_all_gather(comm, own, counts, 2, TDM_DTYPE_INT64)))
            goto fail;
        double tl = NAN, acc = NAN;
        if (!a->no_eval) {
            st = ops->text ? ops->text->eval(ops->text->eval_ctx, &tl, &acc)
                           : ops->evaluate(ctx, test, &tl, &acc);
            if (st) goto fail;
        }
        tdm_uneven_print_epoch(a, ops, e, sums, secs, tl, acc);
        printf("\n  steps per rank:");
        for (int r = 0; r < world; r++) printf(" %lld", (long long)counts[2 * r]);
        printf(" (shadowed after joining:");
        for (int r = 0; r < world; r++) printf(" %lld", (long long)counts[2 * r + 1]);
        printf(")\n");
        fflush(stdout);
        if (ops->save && (st = ops->save(ctx, e))) goto fail;
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

/* ---- DDP's calls ---- */

typedef struct tdm_uneven_ddp {
    const tdm_train_args *a;
    tdm_ddp *ddp;
    tdm_optim *opt;
    const char *save;   /* the job's --save, on every rank */
} tdm_uneven_ddp;

static tdm_status tdm_uneven_ddp_zero(void *ctx) { return tdm_ddp_zero_grad(((tdm_uneven_ddp *)ctx)->ddp); }

static tdm_status tdm_uneven_ddp_forward(void *ctx, const void *x, const int32_t *y, int n,
                                         double *loss_mean)
{
    return tdm_ddp_forward(((tdm_uneven_ddp *)ctx)->ddp, x, y, n, loss_mean);
}

static tdm_status tdm_uneven_ddp_backward_step(void *ctx)
{
    tdm_uneven_ddp *u = ctx;
    TDM_CHECK(tdm_ddp_backward(u->ddp));
    return tdm_ddp_step(u->ddp, u->opt);
}

static tdm_status tdm_uneven_ddp_join(void *ctx, int64_t *shadowed)
{
    tdm_uneven_ddp *u = ctx;
    return tdm_ddp_join(u->ddp, u->opt, shadowed);
}

static tdm_status tdm_uneven_ddp_eval(void *ctx, const tdm_dataset *test, double *loss_mean,
                                      double *accuracy)
{
    return tdm_ddp_evaluate(((tdm_uneven_ddp *)ctx)->ddp, test, 1000, loss_mean, accuracy);
}

static tdm_status tdm_uneven_ddp_save(void *ctx, int64_t epoch)
{
    tdm_uneven_ddp *u = ctx;
    /* collective: the ranks that print nothing have no a->save, but they
     * take part (it failed with a collective mismatch: rank 0 in the save's
     * broadcast, the others in the end-of-epoch barrier) */
    if (!u->save) return TDM_STATUS_OK;
    tdm_ckpt_info info = {.step = tdm_optim_steps(u->opt), .epoch = epoch + 1,
                          .seed = (uint64_t)u->a->seed};
    TDM_CHECK(tdm_ddp_checkpoint_save(u->ddp, u->save, u->opt, &info));
    if (u->a->save && !u->a->quiet)
        printf("  saved %s (epoch %lld, step %lld)\n", u->save, (long long)epoch + 1,
               (long long)info.step);
    return TDM_STATUS_OK;
}

tdm_status tdm_train_uneven_epochs(const tdm_train_args *a, tdm_ddp *ddp, tdm_optim *opt,
                                   tdm_comm *comm, const tdm_dataset *train,
                                   const tdm_dataset *test, const tdm_train_uneven_text *text,
                                   const char *save, int64_t start_epoch)
{
    tdm_uneven_ddp u = {.a = a, .ddp = ddp, .opt = opt, .save = save};
    tdm_train_uneven_ops ops = {.ctx = &u, .m = tdm_ddp_model(ddp), .text = text,
                                .zero_grad = tdm_uneven_ddp_zero,
                                .forward = tdm_uneven_ddp_forward,
                                .backward_step = tdm_uneven_ddp_backward_step,
                                .join = tdm_uneven_ddp_join, .evaluate = tdm_uneven_ddp_eval,
                                .save = tdm_uneven_ddp_save};
    return tdm_train_uneven_run(a, &ops, comm, train, test, start_epoch);
}
