/* tools/train_local.c: `tandem train --mode single|dp`, the image models
 * and --model gpt alike: one process, the model on one device (with
 * --threads BLAS threads) or DataParallel (dp/) with one thread per
 * device and the master model on the first device of the list. Prints
 * the usual per-epoch lines and, for DP, where a step spends its time
 * (wall-clock per phase, averaged over the run's steps). Both take the
 * memory levers (tools/train_levers.c). The ranks of --mode ddp
 * and fsdp are tools/train_ranks.c's. */
#include <stdio.h>
#include <string.h>

#include "core/device.h"
#include "core/timer.h"
#include "dist/det.h"
#include "dp/dp.h"
#include "models/accum.h"
#include "models/precision.h"
#include "models/train_text.h"
#include "tools/devices.h"
#include "tools/tools.h"
#include "tools/train_modes.h"
#include "tools/train_trace.h"

/* The process's run: its model and optimizer, DP's and its sums. */
typedef struct tdm_local {
    const tdm_train_text_set *text;  /* a gpt's; NULL: the image models */
    tdm_model *m;
    tdm_optim *opt;
    tdm_single single;
    tdm_dp *dp;
    tdm_phase_times sum;             /* DP: wall per phase, summed over the steps */
    double step_ms;
    int64_t steps;
    int eval_windows;                /* a gpt's windows per evaluation forward */
    int eval_rows;                   /* images per evaluation forward */
    const tdm_dataset *test;         /* images */
} tdm_local;

static void tdm_local_add(tdm_local *l, int step)
{
    const tdm_dp_timings *t = tdm_dp_last_timings(l->dp);
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) l->sum.ms[p] += t->wall.ms[p];
    l->step_ms += t->step_ms;
    l->steps += step;
}

/* --trace's phases: the last step's (DP's wall-clock, the critical path
 * over its devices). */
static int tdm_local_phases(void *ctx, tdm_phase_times *out)
{
    const tdm_local *l = ctx;
    if (l->dp) {
        *out = tdm_dp_last_timings(l->dp)->wall;
    } else {
        for (int p = 0; p < TDM_PHASE_COUNT_; p++) out->ms[p] = l->single.ms[p];
    }
    return 1;
}

static tdm_status tdm_local_dp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                    double *loss)
{
    tdm_local *l = ctx;
    TDM_CHECK(tdm_dp_step_levers(l->dp, &l->single, x, y, batch, loss));
    tdm_local_add(l, 1);
    return TDM_STATUS_OK;
}

/* --grad-accum: DP's micro-batch is tdm_dp_forward_backward_scaled,
 * which adds onto the master's gradients; the optimizer steps once. */
static tdm_status tdm_local_dp_zero(void *ctx)
{
    /* the master's gradients: the replica on the output device */
    return tdm_accum_single_ops.zero_grad(&((tdm_local *)ctx)->single);
}

static tdm_status tdm_local_dp_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                     float grad_scale, int index, int last, double *loss_sum)
{
    tdm_local *l = ctx;
    (void)index;
    (void)last;
    TDM_CHECK(tdm_dp_forward_backward_scaled(l->dp, x, y, batch, grad_scale, loss_sum));
    tdm_local_add(l, 0);
    return TDM_STATUS_OK;
}

static tdm_status tdm_local_dp_opt(void *ctx, double *loss_sum)
{
    tdm_local *l = ctx;
    TDM_CHECK(tdm_accum_single_ops.step(&l->single, loss_sum));   /* the master's */
    double ms = l->single.ms[TDM_PHASE_STEP];
    l->sum.ms[TDM_PHASE_STEP] += ms;
    l->step_ms += ms;
    l->steps++;
    return TDM_STATUS_OK;
}

static const tdm_accum_ops tdm_local_dp_accum_ops = {
    .zero_grad = tdm_local_dp_zero, .micro = tdm_local_dp_micro, .step = tdm_local_dp_opt};

/* The test set's loss and accuracy at the step's batch, through the
 * step's own buffers (single: its stage; DP: the output device's). */
static tdm_status tdm_local_eval_images(void *ctx, double *loss, double *acc)
{
    tdm_local *l = ctx;
    if (l->dp) return tdm_dp_evaluate(l->dp, l->test, l->eval_rows, loss, acc);
    return tdm_evaluate_staged(l->m, l->test, l->eval_rows, &l->single.stage, loss, acc);
}

/* A gpt's validation loss, on the fixed evaluation windows. */
static tdm_status tdm_local_eval_text(void *ctx, double *loss, double *acc)
{
    tdm_local *l = ctx;
    (void)acc;
    return tdm_train_text_evaluate(l->m, &l->text->corpus->val, TDM_TRAIN_TEXT_EVAL_CAP,
                                   l->eval_windows, loss);
}

/* The devices of --mode dp, or the one device of --mode single (with
 * --threads BLAS threads; a bare "cuda" is GPU 0, as PyTorch's). */
static tdm_status tdm_local_devices(const tdm_train_args *a, int dp, tdm_device **devs, int *n)
{
    tdm_device_list dl;
    tdm_status st;
    if (dp) {
        tdm_train_note_threads(a, "DP device");
        if ((st = tdm_dp_devices_open(a->device, devs, n)) != TDM_STATUS_OK)
            return tdm_train_fail("--device",
                                  st == TDM_STATUS_INVALID_ARG ? tdm_tool_usage(st) : st);
        return TDM_STATUS_OK;
    }
    if ((st = tdm_tool_parse_one_device(&dl, a->device)) != TDM_STATUS_OK)
        return tdm_train_fail("--device", st == TDM_STATUS_NO_DEVICE ? st : tdm_tool_usage(st));
    if (dl.count != 1)
        return tdm_tool_usage_error("tandem train: --mode single uses one device, but '%s' "
                                    "names %d (use --mode dp or --mode ddp for several)\n",
                                    a->device, dl.count);
    if ((st = tdm_device_open(&devs[0], dl.kind == TDM_DEVICE_CUDA ? "cuda" : "cpu", dl.index[0],
                              (int)a->threads)) != TDM_STATUS_OK)
        return tdm_train_fail("opening device", st);
    *n = 1;
    return TDM_STATUS_OK;
}

/* The data (images), the model on dev, its optimizer, --resume. */
static tdm_status tdm_local_setup(const tdm_train_args *a, const tdm_model_spec *spec,
                                  tdm_device *dev, tdm_local *l, tdm_dataset *train,
                                  tdm_dataset *test, tdm_ckpt_info *resumed)
{
    tdm_status st;
    if (!l->text) TDM_CHECK(tdm_train_load_data(a, spec, train, test));
    if ((st = tdm_model_init(&l->m, dev, spec, (uint64_t)a->seed)) != TDM_STATUS_OK)
        return tdm_train_fail("building model", st);
    if (!l->text) TDM_CHECK(tdm_train_check_features(train, l->m));
    TDM_CHECK(tdm_train_make_optim(a, l->m, &l->opt));
    return tdm_train_resume(a, l->m, l->opt, resumed);
}

tdm_status tdm_train_run_local(const tdm_train_args *a, const tdm_model_spec *spec,
                               const tdm_train_text_set *text)
{
    int dp = !strcmp(a->mode, "dp"), n = 0;
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    tdm_model_spec own;
    tdm_dataset train = {0}, test = {0};
    tdm_local l = {.text = text};
    tdm_grad_scaler scaler;
    tdm_ckpt_info resumed;
    tdm_train_run r = {.train = &train, .test = &test};
    tdm_dist_det det = {0};
    tdm_train_det_dp *ddet = NULL;
    tdm_train_trace *trace = NULL;
    char desc[160];
    tdm_status st;
    if (!spec && (st = tdm_model_spec_parse(&own, a->model)) != TDM_STATUS_OK)
        return tdm_train_fail("--model", tdm_tool_usage(st));
    if (!spec) spec = &own;
    TDM_CHECK(tdm_local_devices(a, dp, devs, &n));
    TDM_TRY(tdm_local_setup(a, spec, devs[0], &l, &train, &test, &resumed));
    r.start_epoch = resumed.epoch;
    l.single = (tdm_single){.model = l.m, .opt = l.opt};
    tdm_accum acc = {.ops = &tdm_accum_single_ops, .ctx = &l.single, .micro = (int)a->batch,
                     .in_features = tdm_model_in_features(l.m),
                     .out_rows = tdm_model_out_rows(l.m)};
    r.m = l.m;
    r.opt = l.opt;
    r.step = tdm_single_step;
    r.step_ctx = &l.single;
    snprintf(desc, sizeof desc, "device %s, %lld BLAS thread%s", tdm_dev_name(devs[0]),
             (long long)a->threads, a->threads > 1 ? "s" : "");
    if (dp) {
        if ((st = tdm_dp_init(&l.dp, l.m, devs, n, NULL)) != TDM_STATUS_OK) {
            tdm_train_fail("DataParallel", st);
            goto fail;
        }
        if (a->batch < n)
            fprintf(stderr, "tandem train: note: batch %lld is smaller than %d devices: DP "
                            "splits it into %lld chunks of 1 and leaves the other devices idle, "
                            "as torch.nn.DataParallel does\n", a->batch, n, a->batch);
        snprintf(desc, sizeof desc, "DataParallel over %d device%s (%s), output device %s", n,
                 n > 1 ? "s" : "", a->device, tdm_dev_name(devs[0]));
        acc.ops = &tdm_local_dp_accum_ops;
        acc.ctx = &l;
        r.step = tdm_local_dp_step;
        r.step_ctx = &l;
    }
    if (a->grad_accum > 1) {
        r.step = tdm_accum_step;
        r.step_ctx = &acc;
    }
    /* --deterministic K: the K virtual shards one after the other, their
     * gradients summed in the tree every device count sums them in */
    det = (tdm_dist_det){.ops = &tdm_dist_det_single_ops, .ctx = &l.single, .m = l.m,
                        .rank = 0, .world = 1, .K = (int)a->deterministic,
                        .in_elems = tdm_model_in_features(l.m),
                        .out_rows = tdm_model_out_rows(l.m),
                        .micro = a->grad_accum > 1 ? (int)a->batch : 0};
    if (a->deterministic && dp) {
        if ((st = tdm_dist_det_check(det.K, n, a->batch)) != TDM_STATUS_OK) {
            tdm_tool_usage_error("tandem train: %s\n", tdm_error_message());
            goto fail;
        }
        if ((st = tdm_train_det_dp_init(&ddet, l.dp, &l.single, det.K, det.micro, det.in_elems,
                                        det.out_rows)) != TDM_STATUS_OK) {
            tdm_train_fail("--deterministic", st);
            goto fail;
        }
        r.step = tdm_train_det_dp_step;
        r.step_ctx = ddet;
        snprintf(desc + strlen(desc), sizeof desc - strlen(desc), ", deterministic over %d "
                 "virtual shards", det.K);
    } else if (a->deterministic) {
        if ((st = tdm_dist_det_init(&det)) != TDM_STATUS_OK) {
            tdm_train_fail("--deterministic", st);
            goto fail;
        }
        r.step = tdm_dist_det_step;
        r.step_ctx = &det;
        snprintf(desc + strlen(desc), sizeof desc - strlen(desc), ", deterministic over %d "
                 "virtual shards", det.K);
    }
    /* evaluation in the step's (DP: the master's chunk's) batch: no
     * larger activations than the step's */
    l.eval_rows = tdm_train_eval_rows(a, dp ? n : 1, TDM_TRAIN_EVAL_BATCH);
    l.test = &test;
    r.eval = tdm_local_eval_images;
    r.eval_ctx = &l;
    l.eval_windows = tdm_train_eval_rows(a, dp ? n : 1, TDM_TRAIN_TEXT_EVAL_BATCH);
    if (text) {
        r = (tdm_train_run){.m = r.m, .opt = r.opt, .start_epoch = r.start_epoch, .step = r.step,
                            .step_ctx = r.step_ctx, .text = text, .lo = 0, .hi = (int)a->batch,
                            .eval = tdm_local_eval_text, .eval_ctx = &l};
        tdm_train_text_header(text, spec, a, tdm_model_param_elems(l.m), desc);
    } else {
        tdm_train_print_header(a, spec, &train, &test, tdm_model_param_elems(l.m), desc);
    }
    /* the memory levers (tools/train_levers.c): on the model (DP's
     * master, whose replicas follow it) and its step */
    TDM_TRY(tdm_train_levers_apply(a, l.m, &l.single, &scaler, &resumed));
    r.single = &l.single;
    if (a->trace) {
        char track[48];
        if (dp) snprintf(track, sizeof track, "DataParallel, %d devices (wall)", n);
        else snprintf(track, sizeof track, "device %s", tdm_dev_name(devs[0]));
        TDM_TRY(tdm_train_trace_new(&trace, a->trace, 0, 1, track));
        r.trace = trace;
        /* a step's phases are its own only with one pass per step */
        if (a->grad_accum <= 1 && !a->deterministic) {
            r.phases = tdm_local_phases;
            r.phases_ctx = &l;
        }
    }
    TDM_TRY(tdm_train_epochs(a, &r));
    if (trace) {
        char process[64];
        snprintf(process, sizeof process, "tandem train --mode %s", a->mode);
        if ((st = tdm_train_trace_write(trace, NULL, process)) != TDM_STATUS_OK) {
            tdm_train_fail("--trace", st);
            goto fail;
        }
    }
    if (dp) tdm_train_print_dp_phases(&l.sum, l.step_ms, l.steps);
    tdm_train_levers_report(a, l.m);
fail:
    tdm_train_trace_free(trace);
    tdm_dist_det_free(&det);
    tdm_train_det_dp_free(ddet);
    tdm_dp_free(l.dp);
    tdm_single_free(&l.single);
    tdm_optim_free(l.opt);
    tdm_model_free(l.m);
    tdm_dp_devices_close(devs, n);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}
