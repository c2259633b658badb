/* tools/eval.c: `tandem eval --resume CK`: a checkpoint's loss on data,
 * without training. The model is rebuilt from the checkpoint's own
 * description (as tandem sample does) on one host device; images: the
 * test set's mean loss and accuracy (the numbers train's epoch line
 * prints as test loss and accuracy); a gpt: the validation windows' mean
 * loss in nats and bits per byte (train's val loss). Printed with 9
 * significant digits, to compare with another implementation;
 * --dump-logits FILE writes the raw logits of one batch (images) or one
 * window (gpt) with their inputs' targets, as text. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/npy.h"
#include "core/safetensors.h"
#include "core/text.h"
#include "models/checkpoint.h"
#include "models/train.h"
#include "models/train_text.h"
#include "tools/args.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

/* rows of --dump-logits for images (the test set's first samples) */
#define TDM_EVAL_DUMP_SAMPLES 8
#define TDM_EVAL_BATCH 1000

typedef struct tdm_eval_opts {
    const char *resume, *data, *mode, *dump, *model;
    long long synthetic_size, dump_n, batch;
    int help;
} tdm_eval_opts;

static void tdm_eval_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem eval --resume CK [--data FILE|DIR|synthetic] [--dump-logits FILE]\n"
        "\n"
        "The loss of a checkpoint (tandem train --save CK, any mode) on data, without\n"
        "training, on one host device. Images (mlp, cnn): the test set's mean loss and\n"
        "accuracy, as train's epoch line; a gpt: the validation windows' mean loss in\n"
        "nats and bits per byte, as train's val loss. Losses have 9 significant digits.\n"
        "\n"
        "  --resume CK            the checkpoint (required)\n"
        "  --model file:PATH      the model file the checkpoint was trained from\n"
        "                         (required for one; other models are named in the\n"
        "                         checkpoint)\n"
        "  --data FILE|DIR        as train's: Fashion-MNIST directory, synthetic, or\n"
        "                         text for a gpt                  [train's default]\n"
        "  --data X.npy,Y.npy     NumPy arrays: all of them are the test set\n"
        "  --synthetic-size N     with --data synthetic: the training set's size; the\n"
        "                         test set is N/6, as train's              [60000]\n"
        "  --batch B              images: samples per forward pass. The figures\n"
        "                         depend on it in the last digits (the products'\n"
        "                         shapes change their rounding): train evaluates at\n"
        "                         each replica's share of its --batch (at most %d),\n"
        "                         so pass that share to get train's digits   [%d]\n"
        "  --mode single          evaluation runs on one device (the figures do not\n"
        "                         depend on how the checkpoint was trained)  [single]\n"
        "  --dump-logits FILE     the logits of the first %d test samples (images) or\n"
        "                         of the first validation window (gpt), as text: one\n"
        "                         row per sample (per position), the target then the\n"
        "                         logits, for checking tandem against another\n"
        "                         implementation\n"
        "  --dump-samples N       rows of --dump-logits for images              [%d]\n"
        "\n"
        "Exit codes: 0 ok, 1 runtime failure, 2 bad usage.\n",
        TDM_EVAL_BATCH, TDM_EVAL_BATCH, TDM_EVAL_DUMP_SAMPLES, TDM_EVAL_DUMP_SAMPLES);
}

static tdm_status tdm_eval_parse(int argc, char **argv, tdm_eval_opts *o)
{
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_HELP(o->help)
        TDM_ARGS_STR("--resume", o->resume)
        TDM_ARGS_STR("--model", o->model)
        TDM_ARGS_STR("--data", o->data)
        TDM_ARGS_STR("--mode", o->mode)
        TDM_ARGS_STR("--dump-logits", o->dump)
        TDM_ARGS_INT("--synthetic-size", 1, 1LL << 30, o->synthetic_size)
        TDM_ARGS_INT("--dump-samples", 1, 1 << 16, o->dump_n)
        TDM_ARGS_INT("--batch", 1, 1 << 20, o->batch)
        return tdm_tool_usage_error("tandem eval: unknown option '%s' (see tandem eval "
                                    "--help)\n", argv[i]);
    }
    if (o->help) return TDM_STATUS_OK;
    if (!o->resume)
        return tdm_tool_usage_error("tandem eval: --resume CK is required (a checkpoint of "
                                    "tandem train --save CK)\n");
    if (strcmp(o->mode, "single"))
        return tdm_tool_usage_error("tandem eval: --mode '%s': evaluation runs on one device "
                                    "(--mode single); a checkpoint of any mode evaluates the "
                                    "same there\n", o->mode);
    return TDM_STATUS_OK;
}

/* The spec a checkpoint was written for, from its metadata. */
static tdm_status tdm_eval_spec(const char *path, const char *given, tdm_model_spec *spec,
                                char *desc, size_t len)
{
    tdm_st_file *f = NULL;
    TDM_CHECK(tdm_st_load(&f, path));
    const char *model = tdm_st_meta_get(f, "model");
    tdm_status st = TDM_STATUS_OK;
    if (!model) {
        st = tdm_error_set(TDM_STATUS_FORMAT, "%s: no model in its metadata: not a tandem "
                           "checkpoint", path);
    } else {
        /* the metadata holds the description ("mlp 784-128-10", the
         * CNN's layers, "gpt:L-D-H-T"): the --model text that builds it,
         * checked by describing the parsed spec again */
        char text[256], again[256];
        if (!strncmp(model, "file:", 5) && !given)
            st = tdm_error_set(TDM_STATUS_INVALID_ARG, "%s was trained from the model file "
                               "'%s': give it as --model file:PATH", path, model);
        if (st) {
            tdm_st_free(f);
            return st;
        }
        if (given) snprintf(text, sizeof text, "%s", given);
        else if (!strncmp(model, "mlp ", 4)) snprintf(text, sizeof text, "mlp:%s", model + 4);
        else if (!strncmp(model, "cnn ", 4)) snprintf(text, sizeof text, "cnn");
        else snprintf(text, sizeof text, "%s", model);
        snprintf(desc, len, "%s", model);
        st = tdm_model_spec_parse(spec, text);
        if (st == TDM_STATUS_OK) {
            tdm_model_spec_describe(spec, again, sizeof again);
            if (strcmp(again, model) && given)
                st = tdm_error_set(TDM_STATUS_INVALID_ARG, "it was trained as '%s', but --model "
                                   "%s is '%s'", model, given, again);
            else if (strcmp(again, model))
                st = tdm_error_set(TDM_STATUS_FORMAT, "model '%s': this tandem builds no such "
                                   "model (its nearest is '%s')", model, again);
        }
        if (st) tdm_error_prefix(st, "%s", path);
    }
    tdm_st_free(f);
    return st;
}

static tdm_status tdm_eval_dump(const tdm_eval_opts *o, const char *desc, const float *logits,
                                const int32_t *targets, int rows, int classes, const char *what)
{
    FILE *f = fopen(o->dump, "w");
    if (!f)
        return tdm_error_set(TDM_STATUS_IO, "--dump-logits %s: cannot write it", o->dump);
    fprintf(f, "# tandem eval --dump-logits: checkpoint %s, model %s, %s\n"
               "# one row per %s: the target, then the %d logits (float32, %%.9g)\n",
            o->resume, desc, what, classes > 0 ? "row of logits" : "row", classes);
    for (int r = 0; r < rows; r++) {
        fprintf(f, "%d", targets[r]);
        for (int c = 0; c < classes; c++) fprintf(f, " %.9g", logits[(size_t)r * classes + c]);
        fputc('\n', f);
    }
    if (fclose(f) != 0)
        return tdm_error_set(TDM_STATUS_IO, "--dump-logits %s: write failed", o->dump);
    printf("logits: %s (%d rows of %d)\n", o->dump, rows, classes);
    return TDM_STATUS_OK;
}

static tdm_status tdm_eval_images(const tdm_eval_opts *o, tdm_model *m,
                                  const tdm_model_spec *spec, const char *desc)
{
    /* train's loader (and its memory check) with train's one-device defaults */
    tdm_train_args a = {.data = o->data, .val_data = tdm_data_is_npy(o->data) ? o->data : NULL, .synthetic_size = o->synthetic_size,
                        .batch = o->batch ? o->batch : TDM_EVAL_BATCH, .mode = "single", .device = "cpu",
                        .model = desc, .optim = "sgd", .threads = 1, .grad_accum = 1};
    tdm_dataset train, test;
    TDM_CHECK(tdm_train_load_data(&a, spec, &train, &test));
    tdm_status st = TDM_STATUS_OK;
    float *x = NULL;
    int32_t *y = NULL;
    int64_t *idx = NULL;
    if (tdm_data_features(&test) != tdm_model_in_features(m)) {
        st = tdm_tool_usage_error("tandem eval: the data has %lld features per sample but the "
                                  "model expects %d\n", (long long)tdm_data_features(&test),
                                  tdm_model_in_features(m));
        goto fail;
    }
    double loss = 0, acc = 0;
    if ((st = tdm_evaluate(m, &test, (int)a.batch, &loss, &acc))) goto fail;
    printf("test set (%lld samples): loss %.9g, accuracy %.9g\n", (long long)test.n, loss, acc);
    if (o->dump) {
        int n = (int)(o->dump_n < test.n ? o->dump_n : test.n);
        int64_t feat = tdm_data_features(&test);
        x = malloc((size_t)(n * feat) * sizeof *x);
        y = malloc((size_t)n * sizeof *y);
        idx = malloc((size_t)n * sizeof *idx);
        if (!x || !y || !idx) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "--dump-logits: %d samples", n);
            goto fail;
        }
        for (int i = 0; i < n; i++) idx[i] = i;
        tdm_data_gather(&test, idx, n, x, y);
        const float *logits = NULL;
        tdm_model_set_train(m, 0);
        if ((st = tdm_model_forward(m, x, n, &logits))) goto fail;
        char what[96];
        snprintf(what, sizeof what, "test samples 0..%d in eval mode", n - 1);
        st = tdm_eval_dump(o, desc, logits, y, n, tdm_model_n_classes(m), what);
    }
fail:
    free(x);
    free(y);
    free(idx);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}

static tdm_status tdm_eval_text(const tdm_eval_opts *o, tdm_model *m,
                                const tdm_model_spec *spec, const char *desc)
{
    tdm_text_corpus corpus;
    int T = spec->n_ctx;
    TDM_CHECK(tdm_text_load(&corpus, o->data));
    tdm_status st = tdm_text_check_context(&corpus, T);
    int32_t *x = NULL, *y = NULL;
    if (st) {
        st = tdm_tool_usage(st);
        goto fail;
    }
    int64_t count = tdm_text_eval_count(&corpus.val, T, TDM_TRAIN_TEXT_EVAL_CAP);
    double loss = 0;
    if ((st = tdm_train_text_evaluate(m, &corpus.val, TDM_TRAIN_TEXT_EVAL_CAP, 16, &loss)))
        goto fail;
    printf("validation text (%lld windows of %d bytes): loss %.9g nats = %.9g bits per byte\n",
           (long long)count, T, loss, loss / M_LN2);
    if (o->dump) {
        x = malloc((size_t)T * sizeof *x);
        y = malloc((size_t)T * sizeof *y);
        if (!x || !y) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "--dump-logits: a window of %d", T);
            goto fail;
        }
        tdm_text_eval_window(&corpus.val, T, count, 0, x, y);
        const float *logits = NULL;
        tdm_model_set_train(m, 0);
        if ((st = tdm_model_forward(m, x, 1, &logits))) goto fail;
        st = tdm_eval_dump(o, desc, logits, y, T, tdm_model_n_classes(m),
                           "validation window 0, one row per position (the target is the "
                           "next byte)");
    }
fail:
    free(x);
    free(y);
    tdm_text_free(&corpus);
    return st;
}

static tdm_status tdm_eval_run(const tdm_eval_opts *o)
{
    tdm_model_spec spec;
    char desc[256];
    tdm_status st = tdm_eval_spec(o->resume, o->model, &spec, desc, sizeof desc);
    if (st) {
        fprintf(stderr, "tandem eval: --resume: %s\n", tdm_error_message());
        return st == TDM_STATUS_INVALID_ARG ? TDM_STATUS_USAGE : st;
    }
    if (spec.kind == TDM_MODEL_GPT && o->batch)
        return tdm_tool_usage_error("tandem eval: --batch applies to images; a gpt's "
                                    "validation windows are evaluated as train evaluates "
                                    "them\n");
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_ckpt_info info;
    if ((st = tdm_device_open(&dev, "cpu", 0, 1)) || (st = tdm_model_init(&m, dev, &spec, 1)) ||
        (st = tdm_checkpoint_load(o->resume, m, NULL, &info))) {
        fprintf(stderr, "tandem eval: %s\n", tdm_error_message());
        goto done;
    }
    printf("tandem eval: %s (model %s, epoch %lld, step %lld), one host device\n", o->resume,
           desc, (long long)info.epoch, (long long)info.step);
    fflush(stdout);
    st = spec.kind == TDM_MODEL_GPT ? tdm_eval_text(o, m, &spec, desc)
                                    : tdm_eval_images(o, m, &spec, desc);
    if (st && st != TDM_STATUS_USAGE) fprintf(stderr, "tandem eval: %s\n", tdm_error_message());
done:
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}

int tdm_tool_eval_main(int argc, char **argv)
{
    tdm_eval_opts o = {.mode = "single", .synthetic_size = 60000,
                       .dump_n = TDM_EVAL_DUMP_SAMPLES};
    tdm_status st = tdm_eval_parse(argc, argv, &o);
    if (st == TDM_STATUS_OK && o.help) {
        tdm_eval_usage(stdout);
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK) st = tdm_eval_run(&o);
    return tdm_tool_exit(st);
}
