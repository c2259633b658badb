/* tests/test_accum.c: gradient accumulation (models/accum.h, tandem train
 * --grad-accum K): K micro-batches of B, the gradients summed with the
 * loss gradient scaled by 1/(K*B), then one optimizer step, equal one
 * step on the K*B samples - single-device through the library, and
 * single, DP and DDP (the first K-1 micro-batches under no_sync) through
 * the CLI against the single-device run on the effective batch, short
 * last batches included. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/device.h"
#include "models/accum.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tests/cli_util.h"

/* Parameters after `steps` steps over batches of `batch` samples of d, with
 * micro-batches of `micro` (0: tdm_single_step on the whole batch). */
static void acc_train(const tdm_dataset *d, int cnn, int batch, int micro, int steps, float *out,
                      int64_t *n_out, double *losses)
{
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    if (cnn) {
        tdm_model_spec_cnn(&spec);
        spec.in_c = 1; spec.in_h = 8; spec.in_w = 8; spec.ch1 = 3; spec.ch2 = 4;
        spec.n_classes = 5;
    } else {
        int dims[] = {20, 16, 12, 5};
        tdm_model_spec_mlp(&spec, dims, 4);
    }
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, 5), TDM_STATUS_OK);
    cr_assert_eq(tdm_sgd_init(&opt, m, 0.05f, 0.9f), TDM_STATUS_OK);
    tdm_single single = {.model = m, .opt = opt};
    tdm_accum acc = {.ops = &tdm_accum_single_ops, .ctx = &single, .micro = micro,
                     .in_features = tdm_model_in_features(m), .out_rows = 1};
    int64_t feat = tdm_data_features(d);
    int64_t *perm = malloc((size_t)d->n * sizeof *perm);
    float *x = malloc((size_t)batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)batch * sizeof *y);
    cr_assert(perm && x && y);
    tdm_train_epoch_order(perm, d->n, 1, 0);
    for (int s = 0; s < steps; s++) {
        tdm_data_gather(d, perm + (int64_t)s * batch, batch, x, y);
        tdm_status st = micro ? tdm_accum_step(&acc, x, y, batch, &losses[s])
                              : tdm_single_step(&single, x, y, batch, &losses[s]);
        cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    }
    *n_out = tdm_model_param_elems(m);
    memcpy(out, tdm_model_params(m), (size_t)*n_out * sizeof *out);
    if (micro) cr_assert_eq(acc.micro_steps, (int64_t)steps * ((batch + micro - 1) / micro));
    free(perm);
    free(x);
    free(y);
    tdm_single_free(&single);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
}

/* |a-b| <= atol + rtol*|b| everywhere */
static void acc_close(const float *a, const float *b, int64_t n, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        cr_assert(fabsf(a[i] - b[i]) <= 2e-6f + 2e-5f * fabsf(b[i]),
                  "%s: param[%lld] %.9g vs one step on the whole batch %.9g", what,
                  (long long)i, a[i], b[i]);
}

Test(accum, single_device_equals_one_step_on_the_whole_batch, .timeout = 60)
{
    static float ref[1 << 16], got[1 << 16];
    for (int cnn = 0; cnn <= 1; cnn++) {
        tdm_dataset d;
        cr_assert_eq(cnn ? tdm_data_synthetic(&d, 400, 1, 8, 8, 5, 77, 0)
                         : tdm_data_synthetic(&d, 400, 1, 4, 5, 5, 77, 0), TDM_STATUS_OK);
        /* batch 24 in micro-batches of 6 (K = 4), of 5 (5,5,5,5,4: a
         * short last one), of 24 (K = 1) and of 1 (24 single samples) */
        const int micros[] = {6, 5, 24, 1};
        double lref[4], lgot[4];
        int64_t n = 0, n2 = 0;
        acc_train(&d, cnn, 24, 0, 4, ref, &n, lref);
        for (size_t i = 0; i < sizeof micros / sizeof micros[0]; i++) {
            acc_train(&d, cnn, 24, micros[i], 4, got, &n2, lgot);
            cr_assert_eq(n, n2);
            char what[64];
            snprintf(what, sizeof what, "%s, micro-batches of %d", cnn ? "cnn" : "mlp",
                     micros[i]);
            /* the CNN's batchnorm normalises each micro-batch with its own
             * statistics (as in PyTorch): only K = 1 equals it there */
            if (cnn && micros[i] != 24) continue;
            acc_close(got, ref, n, what);
            for (int s = 0; s < 4; s++)
                cr_assert(fabs(lgot[s] - lref[s]) <= 1e-5 * fabs(lref[s]), "%s step %d: loss "
                          "%.8f vs %.8f", what, s, lgot[s], lref[s]);
        }
        tdm_data_free(&d);
    }
}

/* tandem train --save's checkpoint, loaded into the MLP it holds. */
static void acc_load(const char *path, float *out, int64_t *n)
{
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_model_spec spec;
    cr_assert_eq(tdm_model_spec_parse(&spec, "mlp:784-24-10"), TDM_STATUS_OK);
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, 1), TDM_STATUS_OK);
    tdm_ckpt_info info;
    cr_assert_eq(tdm_checkpoint_load(path, m, NULL, &info), TDM_STATUS_OK, "%s: %s", path,
                 tdm_error_message());
    *n = tdm_model_param_elems(m);
    memcpy(out, tdm_model_params(m), (size_t)*n * sizeof *out);
    tdm_model_free(m);
    tdm_device_free(dev);
}

Test(accum, cli_every_mode_equals_single_device_on_the_effective_batch, .timeout = 240)
{
    static cli_result r;
    static float ref[1 << 17], got[1 << 17];
    char dir[] = "/tmp/tandem-accum-XXXXXX";
    cr_assert(mkdtemp(dir));
    char refck[256], ck[256];
    snprintf(refck, sizeof refck, "%s/ref.safetensors", dir);
    snprintf(ck, sizeof ck, "%s/acc.safetensors", dir);
    /* 300 samples in effective batches of 64: four full steps, then 44
     * samples (micro-batches of 16, 16, 12) */
    CLI(&r, "train", "--data", "synthetic", "--synthetic-size", "300", "--model",
        "mlp:784-24-10", "--batch", "64", "--epochs", "1", "--no-eval", "--save", refck);
    expect(&r, 0, "epoch 1/1");
    int64_t n = 0, n2 = 0;
    acc_load(refck, ref, &n);
    const char *modes[][2] = {{"single", "cpu"}, {"dp", "cpu:2"}, {"ddp", "cpu:2"},
                              {"ddp", "cpu:3"}, {"fsdp", "cpu:2"}, {"fsdp", "cpu:3"}};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        CLI(&r, "train", "--mode", modes[i][0], "--device", modes[i][1], "--data", "synthetic",
            "--synthetic-size", "300", "--model", "mlp:784-24-10", "--batch", "16",
            "--grad-accum", "4", "--epochs", "1", "--no-eval", "--save", ck);
        expect(&r, 0, "effective batch 64");
        cr_assert(strstr(r.out, "4 micro-batches of 16"), "%s", r.out);
        acc_load(ck, got, &n2);
        cr_assert_eq(n, n2);
        char what[64];
        snprintf(what, sizeof what, "--mode %s --device %s", modes[i][0], modes[i][1]);
        acc_close(got, ref, n, what);
    }
    CLI(&r, "train", "--grad-accum", "0");
    expect(&r, 2, "--grad-accum");
    CLI(&r, "train", "--model", "gpt", "--grad-accum", "2");
    expect(&r, 2, "--grad-accum is not supported with --model gpt");
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert(system(cmd) == 0);
}
