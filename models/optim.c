/* models/optim.c: SGD and AdamW as one fused device loop each over the
 * model's whole flat parameter buffer (padding included: its gradient is
 * zero, so padding stays zero under SGD and AdamW alike), on the model's
 * device or, offloaded, on a host device of the optimizer's own. */
#include "models/optim.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct tdm_optim {
    tdm_optim_opts opts;
    tdm_model *model;   /* borrowed; NULL for a flat optimizer */
    tdm_device *dev;    /* borrowed: the model's, or the flat optimizer's */
    int64_t n_elem;     /* elements of each state buffer */
    int64_t steps;
    tdm_optim_schedule schedule;
    double base_lr;          /* COSINE: the rate at step 0 */
    int64_t total_steps;     /* COSINE: where the rate reaches 0 */
    int n_state;
    float *state[2];        /* on sdev */
    /* ZeRO-Offload (opts.offload): the state, the update and the staged
     * parameters and gradients of a range live on a host device */
    tdm_device *sdev;       /* borrowed dev, or owned: the host device of an offload */
    int own_dev;            /* tdm_optim_init_host: dev (= sdev) is the optimizer's own */
    float *h_param, *h_grad; /* staging on sdev, h_elems each */
    int64_t h_elems;
    int skip;               /* tdm_optim_set_skip: steps leave everything as it is */
};

void tdm_optim_opts_default(tdm_optim_opts *o, tdm_optim_kind kind)
{
    memset(o, 0, sizeof *o);
    o->kind = kind;
    if (kind == TDM_OPTIM_ADAMW) {
        o->lr = 1e-3f;
        o->beta1 = 0.9f;
        o->beta2 = 0.999f;
        o->eps = 1e-8f;
        o->weight_decay = 0.01f;
    } else {
        o->lr = 0.01f;
    }
}

void tdm_optim_opts_named(tdm_optim_opts *o, const char *name, double lr, double weight_decay,
                          double momentum, int nesterov)
{
    tdm_optim_opts_default(o, strcmp(name, "adamw") ? TDM_OPTIM_SGD : TDM_OPTIM_ADAMW);
    o->lr = (float)lr;
    o->weight_decay = (float)weight_decay;
    if (o->kind != TDM_OPTIM_SGD) return;
    o->momentum = (float)momentum;
    o->nesterov = nesterov;
}

static tdm_status tdm_optim_check(const tdm_optim_opts *o)
{
    TDM_REQUIRE(o->kind == TDM_OPTIM_SGD || o->kind == TDM_OPTIM_ADAMW, TDM_STATUS_INVALID_ARG,
                "unknown optimizer kind %d", (int)o->kind);
    TDM_REQUIRE(o->offload == TDM_OPTIM_OFFLOAD_NONE || o->offload == TDM_OPTIM_OFFLOAD_HOST,
                TDM_STATUS_INVALID_ARG, "unknown optimizer offload %d", (int)o->offload);
    TDM_REQUIRE(isfinite(o->lr) && o->lr >= 0.0f, TDM_STATUS_INVALID_ARG,
                "learning rate %g must be finite and >= 0", (double)o->lr);
    TDM_REQUIRE(isfinite(o->weight_decay) && o->weight_decay >= 0.0f, TDM_STATUS_INVALID_ARG,
                "weight decay %g must be >= 0", (double)o->weight_decay);
    if (o->kind == TDM_OPTIM_SGD) {
        TDM_REQUIRE(o->momentum >= 0.0f && o->momentum < 1.0f, TDM_STATUS_INVALID_ARG,
                    "momentum %g must be in [0, 1)", (double)o->momentum);
        TDM_REQUIRE(!o->nesterov || (o->momentum > 0.0f && o->dampening == 0.0f),
                    TDM_STATUS_INVALID_ARG, "nesterov needs momentum > 0 and dampening 0");
    } else {
        TDM_REQUIRE(o->beta1 >= 0.0f && o->beta1 < 1.0f && o->beta2 >= 0.0f && o->beta2 < 1.0f,
                    TDM_STATUS_INVALID_ARG, "AdamW betas (%g, %g) must be in [0, 1)",
                    (double)o->beta1, (double)o->beta2);
        TDM_REQUIRE(o->eps > 0.0f, TDM_STATUS_INVALID_ARG, "AdamW eps must be > 0");
    }
    return TDM_STATUS_OK;
}

int tdm_optim_kind_n_state(const tdm_optim_opts *opts)
{
    return opts->kind == TDM_OPTIM_ADAMW ? 2 : (opts->momentum != 0.0f ? 1 : 0);
}

const char *tdm_optim_kind_state_name(tdm_optim_kind kind, int i)
{
    if (kind == TDM_OPTIM_SGD) return i == 0 ? "momentum" : NULL;
    return i == 0 ? "exp_avg" : i == 1 ? "exp_avg_sq" : NULL;
}

static tdm_status tdm_optim_new(tdm_optim **out, tdm_model *m, tdm_device *d, int64_t n_elem,
                                const tdm_optim_opts *opts)
{
    *out = NULL;
    TDM_CHECK(tdm_optim_check(opts));
    TDM_REQUIRE(n_elem >= 0, TDM_STATUS_INVALID_ARG, "optimizer over %lld elements",
                (long long)n_elem);
    tdm_optim *o = calloc(1, sizeof *o);
    if (!o) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate an optimizer");
    o->opts = *opts;
    o->model = m;
    o->dev = d;
    o->sdev = d;
    o->n_elem = n_elem;
    o->n_state = tdm_optim_kind_n_state(opts);
    tdm_status st = TDM_STATUS_OK;
    if (opts->offload == TDM_OPTIM_OFFLOAD_HOST) {
        o->sdev = NULL;
        if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
            st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                               "optimizer offload: %s's memory is host memory already; offload "
                               "is for accelerators (cuda)", tdm_dev_name(d));
            goto fail;
        }
        TDM_TRY(tdm_device_open(&o->sdev, "cpu", 0, 1));
    }
    size_t nb = (size_t)(n_elem > 0 ? n_elem : 1) * sizeof(float);
    for (int i = 0; i < o->n_state; i++)
        TDM_TRY(tdm_dev_alloc_zero(o->sdev, nb, (void **)&o->state[i]));
    *out = o;
    return TDM_STATUS_OK;
fail:
    tdm_optim_free(o);
    return st;
}

tdm_status tdm_optim_init(tdm_optim **out, tdm_model *m, const tdm_optim_opts *opts)
{
    return tdm_optim_new(out, m, tdm_model_device(m), tdm_model_param_elems(m), opts);
}

tdm_status tdm_optim_init_flat(tdm_optim **out, tdm_device *dev, int64_t n_elem,
                               const tdm_optim_opts *opts)
{
    *out = NULL;
    TDM_REQUIRE(dev, TDM_STATUS_INVALID_ARG, "optimizer: NULL device");
    return tdm_optim_new(out, NULL, dev, n_elem, opts);
}

tdm_status tdm_optim_init_host(tdm_optim **out, int64_t n_elem, const tdm_optim_opts *opts)
{
    *out = NULL;
    tdm_device *h = NULL;
    tdm_optim_opts o = *opts;
    o.offload = TDM_OPTIM_OFFLOAD_NONE;   /* it is host memory already */
    TDM_CHECK(tdm_device_open(&h, "cpu", 0, 1));
    tdm_status st = tdm_optim_new(out, NULL, h, n_elem, &o);
    if (st) {
        tdm_device_free(h);
        return st;
    }
    (*out)->own_dev = 1;
    return TDM_STATUS_OK;
}

tdm_status tdm_sgd_init(tdm_optim **out, tdm_model *m, float lr, float momentum)
{
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
    o.lr = lr;
    o.momentum = momentum;
    return tdm_optim_init(out, m, &o);
}

void tdm_optim_free(tdm_optim *o)
{
    if (!o) return;
    if (o->sdev) {
        for (int i = 0; i < o->n_state; i++) tdm_dev_free(o->sdev, o->state[i]);
        tdm_dev_free(o->sdev, o->h_param);
        tdm_dev_free(o->sdev, o->h_grad);
    }
    if (o->sdev != o->dev || o->own_dev) tdm_device_free(o->sdev);
    free(o);
}

/* The learning-rate schedule (tdm_optim_set_schedule) at this step: once
 * per step, before its updates (of the model, or of every range). */
static void tdm_optim_apply_schedule(tdm_optim *o)
{
    if (o->schedule != TDM_OPTIM_SCHEDULE_COSINE) return;
    double t = (double)o->steps / (double)o->total_steps;
    if (t > 1.0) t = 1.0;
    o->opts.lr = (float)(o->base_lr * 0.5 * (1.0 + cos(M_PI * t)));
}

/* The update of one range, at step count o->steps (not counted here),
 * on the state's device. */
static tdm_status tdm_optim_update_on(tdm_optim *o, const tdm_optim_range *r)
{
    tdm_device *d = o->sdev;
    const tdm_optim_opts *p = &o->opts;
    if (r->n_elem == 0) return TDM_STATUS_OK;
    float *s0 = o->n_state > 0 ? o->state[0] + r->state_offset : NULL;
    if (p->kind == TDM_OPTIM_SGD)
        return tdm_dev_sgd_step(d, r->n_elem, r->param, r->grad, s0, p->lr, p->momentum,
                                p->dampening, p->weight_decay, p->nesterov, o->steps == 0);
    double t = (double)o->steps + 1.0;
    float bc1 = (float)(1.0 - pow(p->beta1, t));
    float bc2 = (float)(1.0 - pow(p->beta2, t));
    return tdm_dev_adamw_step(d, r->n_elem, r->param, r->grad, s0, o->state[1] + r->state_offset,
                              p->lr, p->beta1, p->beta2, p->eps, p->weight_decay, bc1, bc2);
}

/* ZeRO-Offload's step of one range: gradients and parameters down to
 * host staging, the update there, parameters back up. */
static tdm_status tdm_optim_update(tdm_optim *o, const tdm_optim_range *r)
{
    if (o->sdev == o->dev) return tdm_optim_update_on(o, r);
    if (r->n_elem == 0) return TDM_STATUS_OK;
    size_t nb = (size_t)r->n_elem * sizeof(float);
    if (r->n_elem > o->h_elems) {
        tdm_dev_free(o->sdev, o->h_param);
        tdm_dev_free(o->sdev, o->h_grad);
        o->h_param = o->h_grad = NULL;
        o->h_elems = 0;
        TDM_CHECK(tdm_dev_alloc(o->sdev, nb, (void **)&o->h_param));
        TDM_CHECK(tdm_dev_alloc(o->sdev, nb, (void **)&o->h_grad));
        o->h_elems = r->n_elem;
    }
    TDM_CHECK(tdm_dev_copy_to_host(o->dev, o->h_grad, r->grad, nb));
    TDM_CHECK(tdm_dev_copy_to_host(o->dev, o->h_param, r->param, nb));
    tdm_optim_range h = {.param = o->h_param, .grad = o->h_grad, .state_offset = r->state_offset,
                         .n_elem = r->n_elem};
    TDM_CHECK(tdm_optim_update_on(o, &h));
    return tdm_dev_copy_from_host(o->dev, r->param, o->h_param, nb);
}

static tdm_status tdm_optim_check_steps(const tdm_optim *o)
{
    /* steps + 1 must neither overflow int64 nor stop being exact as the
     * double that AdamW's bias correction raises the betas to. */
    TDM_REQUIRE(o->steps >= 0 && o->steps < TDM_OPTIM_MAX_STEPS, TDM_STATUS_INVALID_ARG,
                "optimizer: step count %" PRId64 " is outside [0, 2^53): refusing to step (a "
                "corrupt checkpoint?)", o->steps);
    return TDM_STATUS_OK;
}

tdm_status tdm_optim_step(tdm_optim *o)
{
    tdm_model *m = o->model;
    TDM_REQUIRE(m, TDM_STATUS_INVALID_ARG,
                "optimizer: this one covers a shard, not a model: step it with "
                "tdm_optim_step_ranges");
    TDM_CHECK(tdm_optim_check_steps(o));
    if (o->skip) return TDM_STATUS_OK;
    tdm_optim_apply_schedule(o);
    tdm_optim_range r = {.param = tdm_model_params(m), .grad = tdm_model_grads(m),
                         .state_offset = 0, .n_elem = tdm_model_param_elems(m)};
    TDM_REQUIRE(r.param && r.grad, TDM_STATUS_INVALID_ARG,
                "optimizer: the model's flat buffers were released (its parameters live in "
                "views): step its owner's shard instead");
    TDM_CHECK(tdm_optim_update(o, &r));
    o->steps++;
    return TDM_STATUS_OK;
}

tdm_status tdm_optim_step_ranges(tdm_optim *o, const tdm_optim_range *ranges, int n_ranges)
{
    TDM_CHECK(tdm_optim_check_steps(o));
    if (o->skip) return TDM_STATUS_OK;
    tdm_optim_apply_schedule(o);
    TDM_REQUIRE(n_ranges >= 0 && (n_ranges == 0 || ranges), TDM_STATUS_INVALID_ARG,
                "optimizer: %d ranges", n_ranges);
    for (int i = 0; i < n_ranges; i++) {
        const tdm_optim_range *r = &ranges[i];
        TDM_REQUIRE(r->n_elem >= 0 && r->state_offset >= 0 &&
                        r->state_offset <= o->n_elem - r->n_elem &&
                        (r->n_elem == 0 || (r->param && r->grad)),
                    TDM_STATUS_INVALID_ARG,
                    "optimizer: range %d ([%lld, +%lld) of the state) is outside its %lld "
                    "elements or has no buffers", i, (long long)r->state_offset,
                    (long long)r->n_elem, (long long)o->n_elem);
        TDM_CHECK(tdm_optim_update(o, r));
    }
    o->steps++;
    return TDM_STATUS_OK;
}

int64_t tdm_optim_n_elem(const tdm_optim *o) { return o->n_elem; }

int64_t tdm_optim_steps(const tdm_optim *o) { return o->steps; }
void tdm_optim_set_steps(tdm_optim *o, int64_t steps) { o->steps = steps; }
void tdm_optim_set_lr(tdm_optim *o, float lr) { o->opts.lr = lr; }

tdm_status tdm_optim_set_schedule(tdm_optim *o, tdm_optim_schedule kind, double base_lr,
                                  int64_t total_steps)
{
    TDM_REQUIRE(kind == TDM_OPTIM_SCHEDULE_CONST || kind == TDM_OPTIM_SCHEDULE_COSINE,
                TDM_STATUS_INVALID_ARG, "unknown learning-rate schedule %d", (int)kind);
    TDM_REQUIRE(isfinite(base_lr) && base_lr >= 0.0, TDM_STATUS_INVALID_ARG,
                "learning rate %g must be finite and >= 0", base_lr);
    TDM_REQUIRE(kind == TDM_OPTIM_SCHEDULE_CONST || total_steps > 0, TDM_STATUS_INVALID_ARG,
                "a cosine schedule needs a positive number of steps (got %lld)",
                (long long)total_steps);
    o->schedule = kind;
    o->base_lr = base_lr;
    o->total_steps = total_steps;
    if (kind == TDM_OPTIM_SCHEDULE_CONST) o->opts.lr = (float)base_lr;
    return TDM_STATUS_OK;
}
const tdm_optim_opts *tdm_optim_get_opts(const tdm_optim *o) { return &o->opts; }
int tdm_optim_n_state(const tdm_optim *o) { return o->n_state; }

const char *tdm_optim_state_name(const tdm_optim *o, int i)
{
    if (i < 0 || i >= o->n_state) return NULL;
    return tdm_optim_kind_state_name(o->opts.kind, i);
}

float *tdm_optim_state(tdm_optim *o, int i)
{
    return i >= 0 && i < o->n_state ? o->state[i] : NULL;
}

tdm_device *tdm_optim_device(const tdm_optim *o) { return o->sdev; }

tdm_device *tdm_optim_param_device(const tdm_optim *o) { return o->dev; }

size_t tdm_optim_state_bytes(const tdm_optim *o)
{
    return (size_t)o->n_state * (size_t)o->n_elem * sizeof(float);
}

void tdm_optim_set_skip(tdm_optim *o, int skip) { o->skip = skip != 0; }
int tdm_optim_skipping(const tdm_optim *o) { return o->skip; }
