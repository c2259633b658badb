/* tools/train_dp.c: `tandem train --mode dp`: one process, one thread per
 * device (dp/), the master model on the first device of the list. Prints
 * the usual per-epoch lines and, at the end, where a DP step spends its
 * time (wall-clock per phase, averaged over the run's steps). */
#include <stdio.h>
#include <string.h>

#include "core/device.h"
#include "core/timer.h"
#include "dp/dp.h"
#include "models/accum.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_train_dp_ctx {
    tdm_dp *dp;
    tdm_optim *opt;
    tdm_phase_times sum;
    double step_ms;
    int64_t steps;
} tdm_train_dp_ctx;

static tdm_status tdm_train_dp_step(void *ctx, const void *x, const int32_t *y, int batch,
                                    double *loss)
{
    tdm_train_dp_ctx *c = ctx;
    TDM_CHECK(tdm_dp_step(c->dp, c->opt, x, y, batch, loss));
    const tdm_dp_timings *t = tdm_dp_last_timings(c->dp);
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) c->sum.ms[p] += t->wall.ms[p];
    c->step_ms += t->step_ms;
    c->steps++;
    return TDM_STATUS_OK;
}

/* --grad-accum: DP's micro-batch is tdm_dp_forward_backward_scaled,
 * which adds onto the master's gradients; the optimizer steps once. */
static tdm_status tdm_train_dp_zero(void *ctx)
{
    tdm_train_dp_ctx *c = ctx;
    return tdm_model_zero_grad(tdm_dp_replica(c->dp, tdm_dp_output_device(c->dp)));
}

static tdm_status tdm_train_dp_micro(void *ctx, const void *x, const int32_t *y, int batch,
                                     float grad_scale, int index, int last, double *loss_sum)
{
    tdm_train_dp_ctx *c = ctx;
    (void)index;
    (void)last;
    TDM_CHECK(tdm_dp_forward_backward_scaled(c->dp, x, y, batch, grad_scale, loss_sum));
    const tdm_dp_timings *t = tdm_dp_last_timings(c->dp);
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) c->sum.ms[p] += t->wall.ms[p];
    c->step_ms += t->step_ms;
    return TDM_STATUS_OK;
}

static tdm_status tdm_train_dp_opt(void *ctx, double *loss_sum)
{
    tdm_train_dp_ctx *c = ctx;
    (void)loss_sum;
    uint64_t t0 = tdm_time_ns();
    TDM_CHECK(tdm_optim_step(c->opt));
    TDM_CHECK(tdm_dev_sync(tdm_model_device(tdm_dp_replica(c->dp, tdm_dp_output_device(c->dp)))));
    double ms = tdm_time_ms_since(t0);
    c->sum.ms[TDM_PHASE_STEP] += ms;
    c->step_ms += ms;
    c->steps++;
    return TDM_STATUS_OK;
}

static const tdm_accum_ops tdm_train_dp_accum_ops = {
    .zero_grad = tdm_train_dp_zero, .micro = tdm_train_dp_micro, .step = tdm_train_dp_opt};

tdm_status tdm_train_run_dp(const tdm_train_args *a)
{
    int n = 0;
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    tdm_model_spec spec;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dp *dp = NULL;
    tdm_dataset train = {0}, test = {0};
    tdm_train_dp_ctx ctx = {0};
    tdm_train_run r = {0};
    tdm_status st;
    if ((st = tdm_model_spec_parse(&spec, a->model)) != TDM_STATUS_OK)
        return tdm_train_fail("--model", tdm_tool_usage(st));
    tdm_train_note_threads(a, "DP device");
    if ((st = tdm_dp_devices_open(a->device, devs, &n)) != TDM_STATUS_OK)
        return tdm_train_fail("--device", st == TDM_STATUS_INVALID_ARG ? tdm_tool_usage(st) : st);
    TDM_TRY(tdm_train_setup(a, &spec, devs[0], &train, &test, &m, &opt, &r.start_epoch));
    if ((st = tdm_dp_init(&dp, m, devs, n, NULL)) != TDM_STATUS_OK) {
        tdm_train_fail("DataParallel", st);
        goto fail;
    }
    if (a->batch < n)
        fprintf(stderr, "tandem train: note: batch %lld is smaller than %d devices: DP splits "
                        "it into %lld chunks of 1 and leaves the other devices idle, as "
                        "torch.nn.DataParallel does\n", a->batch, n, a->batch);
    char desc[96];
    snprintf(desc, sizeof desc, "DataParallel over %d device%s (%s), output device %s", n,
             n > 1 ? "s" : "", a->device, tdm_dev_name(devs[0]));
    tdm_train_print_header(a, &spec, &train, &test, tdm_model_param_elems(m), desc);
    ctx.dp = dp;
    ctx.opt = opt;
    r.m = m;
    r.opt = opt;
    tdm_accum acc = {.ops = &tdm_train_dp_accum_ops, .ctx = &ctx, .micro = (int)a->batch,
                     .in_features = tdm_model_in_features(m), .out_rows = tdm_model_out_rows(m)};
    r.step = a->grad_accum > 1 ? tdm_accum_step : tdm_train_dp_step;
    r.step_ctx = a->grad_accum > 1 ? (void *)&acc : (void *)&ctx;
    r.train = &train;
    r.test = &test;
    TDM_TRY(tdm_train_epochs(a, &r));
    tdm_train_print_dp_phases(&ctx.sum, ctx.step_ms, ctx.steps);
fail:
    tdm_dp_free(dp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, n);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return st;
}
