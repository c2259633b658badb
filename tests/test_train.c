/* tests/test_train.c: end-to-end learning on one host device through the
 * epoch loop (models/train.c): an MLP and a small CNN on the synthetic
 * dataset reach a loss threshold within a fixed step budget, and a short
 * run on the real Fashion-MNIST files (skipped when absent) brings the
 * loss well below ln 10 and the test accuracy well above chance; plus the
 * epoch loop's bookkeeping and tdm_evaluate's mode handling. CLI tests
 * live elsewhere. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tests/test_util.h"

static tdm_device *g_dev;
static void setup(void) { g_dev = tu_host(); }
static void teardown(void) { tdm_device_free(g_dev); }
TestSuite(train, .init = setup, .fini = teardown);

typedef struct losses {
    int64_t n;
    double v[4096];
} losses;

static void record(void *ctx, int64_t step, int64_t steps, double loss, double sps)
{
    (void)step;
    (void)steps;
    (void)sps;
    losses *l = ctx;
    if (l->n < 4096) l->v[l->n++] = loss;
}

static double tail_mean(const losses *l, int k)
{
    double s = 0.0;
    int64_t from = l->n > k ? l->n - k : 0;
    for (int64_t i = from; i < l->n; i++) s += l->v[i];
    return s / (double)(l->n - from);
}

/* Trains m for `epochs` epochs of at most max_steps; returns per-step losses. */
static void fit(tdm_model *m, tdm_optim *o, const tdm_dataset *d, int batch, int epochs,
                int64_t max_steps, losses *l)
{
    tdm_single s = {.model = m, .opt = o};
    for (int e = 0; e < epochs; e++) {
        tdm_epoch_stats es;
        TU_OK(tdm_train_epoch(d, &(tdm_train_epoch_opts){.batch = batch, .seed = 7, .epoch = e,
                                                         .max_steps = max_steps,
                                                         .step = tdm_single_step, .step_ctx = &s,
                                                         .progress = record, .progress_ctx = l},
                              &es));
        cr_assert(isfinite(es.loss_mean), "epoch %d: loss %g", e, es.loss_mean);
    }
    tdm_single_free(&s);
}

Test(train, mlp_learns_synthetic_data)
{
    tdm_dataset tr, te;
    TU_OK(tdm_data_synthetic(&tr, 2048, 1, 28, 28, 10, 3, 0));
    TU_OK(tdm_data_synthetic(&te, 512, 1, 28, 28, 10, 3, 1));
    static const int dims[] = {784, 64, 10};
    tdm_model *m;
    tdm_optim *o;
    TU_OK(tdm_mlp_init(&m, g_dev, dims, 3, 1));
    TU_OK(tdm_sgd_init(&o, m, 0.05f, 0.9f));
    double l0, a0, l1, a1;
    TU_OK(tdm_evaluate(m, &te, 256, &l0, &a0));
    losses *l = tu_malloc(sizeof *l);
    fit(m, o, &tr, 64, 2, 0, l); /* 2 x 32 steps */
    TU_OK(tdm_evaluate(m, &te, 256, &l1, &a1));
    double first = l->v[0], last = tail_mean(l, 8);
    fprintf(stderr, "mlp synthetic: step loss %.3f -> %.3f (last 8), test loss %.3f -> %.3f, "
            "accuracy %.3f -> %.3f\n", first, last, l0, l1, a0, a1);
    cr_assert(last < 0.3, "after %lld steps the training loss is %.3f (>= 0.3)", (long long)l->n, last);
    cr_assert(l1 < 0.5 && a1 > 0.85, "held-out loss %.3f accuracy %.3f", l1, a1);
    cr_assert(tdm_model_is_train(m), "tdm_evaluate did not restore training mode");
    /* an empty set has no mean: refused, not NaN */
    tdm_dataset none = te;
    none.n = 0;
    cr_assert_eq(tdm_evaluate(m, &none, 256, &l1, &a1), TDM_STATUS_INVALID_ARG);
    free(l);
    tdm_optim_free(o);
    tdm_model_free(m);
    tdm_data_free(&tr);
    tdm_data_free(&te);
}

Test(train, small_cnn_learns_synthetic_data)
{
    tdm_dataset tr, te;
    /* 28x28: at 12x12 the +-2 pixel shifts make the synthetic classes much
     * harder (held-out accuracy ~0.6 after 6 epochs), which tests the data,
     * not the model */
    TU_OK(tdm_data_synthetic(&tr, 512, 1, 28, 28, 4, 5, 0));
    TU_OK(tdm_data_synthetic(&te, 256, 1, 28, 28, 4, 5, 1));
    tdm_model_spec s;
    tdm_model_spec_cnn(&s);
    s.ch1 = 8;
    s.ch2 = 8;
    s.n_classes = 4;
    tdm_model *m;
    tdm_optim *o;
    TU_OK(tdm_model_init(&m, g_dev, &s, 2));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_ADAMW);
    oo.lr = 0.01f;
    TU_OK(tdm_optim_init(&o, m, &oo));
    losses *l = tu_malloc(sizeof *l);
    fit(m, o, &tr, 32, 3, 0, l); /* 48 steps */
    double l1, a1;
    tdm_model_set_train(m, 0);
    TU_OK(tdm_evaluate(m, &te, 100, &l1, &a1));
    cr_assert(!tdm_model_is_train(m), "tdm_evaluate did not restore eval mode");
    double first = l->v[0], last = tail_mean(l, 8);
    fprintf(stderr, "cnn synthetic: step loss %.3f -> %.3f, test loss %.3f accuracy %.3f\n", first,
            last, l1, a1);
    cr_assert(last < 0.3, "training loss %.3f after %lld steps", last, (long long)l->n);
    cr_assert(a1 > 0.85, "held-out accuracy %.3f (eval mode, running statistics)", a1);
    free(l);
    tdm_optim_free(o);
    tdm_model_free(m);
    tdm_data_free(&tr);
    tdm_data_free(&te);
}

static tdm_status step_counter(void *ctx, const void *x, const int32_t *y, int batch, double *loss)
{
    (void)x;
    (void)y;
    int *c = ctx;
    c[0]++;
    c[1] += batch;
    c[2] = batch;
    *loss = 1.0;
    return TDM_STATUS_OK;
}

/* Step counts for drop_last / max_steps; every sample visited once per epoch. */
Test(train, epoch_loop_bookkeeping)
{
    tdm_dataset d;
    TU_OK(tdm_data_synthetic(&d, 103, 1, 2, 2, 2, 1, 0));
    struct { int batch, drop; int64_t max; int steps, samples, lastb; } c[] = {
        {10, 0, 0, 11, 103, 3}, {10, 1, 0, 10, 100, 10}, {10, 0, 4, 4, 40, 10},
        {103, 0, 0, 1, 103, 103}, {200, 0, 0, 1, 103, 103}, {200, 1, 0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        int cnt[3] = {0, 0, 0};
        tdm_epoch_stats es;
        TU_OK(tdm_train_epoch(&d, &(tdm_train_epoch_opts){.batch = c[i].batch, .seed = 1,
                                                          .drop_last = c[i].drop,
                                                          .max_steps = c[i].max,
                                                          .step = step_counter, .step_ctx = cnt},
                              &es));
        cr_assert(cnt[0] == c[i].steps && cnt[1] == c[i].samples && cnt[2] == c[i].lastb &&
                      es.steps == c[i].steps && es.samples == c[i].samples,
                  "batch %d drop %d max %lld: %d steps %d samples (last %d), expected %d %d (%d)",
                  c[i].batch, c[i].drop, (long long)c[i].max, cnt[0], cnt[1], cnt[2], c[i].steps,
                  c[i].samples, c[i].lastb);
    }
    /* the order is a permutation, different per epoch, same for same (seed, epoch) */
    int64_t p0[103], p1[103], p0b[103];
    tdm_train_epoch_order(p0, 103, 9, 0);
    tdm_train_epoch_order(p1, 103, 9, 1);
    tdm_train_epoch_order(p0b, 103, 9, 0);
    cr_assert(memcmp(p0, p0b, sizeof p0) == 0);
    cr_assert(memcmp(p0, p1, sizeof p0) != 0);
    int seen[103] = {0};
    for (int i = 0; i < 103; i++) {
        cr_assert(p0[i] >= 0 && p0[i] < 103 && !seen[p0[i]]);
        seen[p0[i]] = 1;
    }
    tdm_epoch_stats es;
    tdm_train_epoch_opts eo = {.batch = 0, .seed = 1, .step = step_counter, .step_ctx = seen};
    cr_assert_eq(tdm_train_epoch(&d, &eo, &es),
                 TDM_STATUS_INVALID_ARG);
    tdm_data_free(&d);
}

Test(train, fashion_mnist_short_run_learns)
{
    tdm_dataset tr, te;
    tdm_status st = tdm_data_load_fashion_mnist(&tr, NULL, 1);
    if (st == TDM_STATUS_IO) {
        char why[512];
        snprintf(why, sizeof why,
                 "Fashion-MNIST files not found (%s); install dataset-fashion-mnist or set "
                 "TANDEM_DATA_DIR", tdm_error_message());
        cr_skip_test("%s", why);
    }
    TU_OK(st);
    TU_OK(tdm_data_load_fashion_mnist(&te, NULL, 0));
    cr_assert(tr.n == 60000 && te.n == 10000, "sizes %lld / %lld", (long long)tr.n, (long long)te.n);
    static const int dims[] = {784, 128, 10};
    tdm_model *m;
    tdm_optim *o;
    TU_OK(tdm_mlp_init(&m, g_dev, dims, 3, 1));
    TU_OK(tdm_sgd_init(&o, m, 0.05f, 0.9f));
    losses *l = tu_malloc(sizeof *l);
    fit(m, o, &tr, 128, 1, 120, l);
    double first = l->v[0], last = tail_mean(l, 20), tl, ta;
    TU_OK(tdm_evaluate(m, &te, 500, &tl, &ta));
    fprintf(stderr, "fashion-mnist mlp 784-128-10, 120 steps of 128: loss %.3f -> %.3f (last 20), "
            "test loss %.3f, test accuracy %.3f\n", first, last, tl, ta);
    cr_assert(first > 1.5, "initial loss %.3f is not near ln 10", first);
    cr_assert(last < 0.8, "loss after 120 steps %.3f (>= 0.8; ln 10 = 2.303)", last);
    cr_assert(ta > 0.72, "test accuracy %.3f after 120 steps", ta);
    free(l);
    tdm_optim_free(o);
    tdm_model_free(m);
    tdm_data_free(&tr);
    tdm_data_free(&te);
}
