/* models/optim.c: SGD and AdamW as one fused device loop each over the
 * model's whole flat parameter buffer (padding included: its gradient is
 * zero, so padding stays zero under SGD and AdamW alike). */
#include "models/optim.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct tdm_optim {
    tdm_optim_opts opts;
    tdm_model *model;   /* borrowed */
    int64_t steps;
    tdm_optim_schedule schedule;
    double base_lr;          /* COSINE: the rate at step 0 */
    int64_t total_steps;     /* COSINE: where the rate reaches 0 */
    int n_state;
    float *state[2];
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

static tdm_status tdm_optim_check(const tdm_optim_opts *o)
{
    TDM_REQUIRE(o->kind == TDM_OPTIM_SGD || o->kind == TDM_OPTIM_ADAMW, TDM_STATUS_INVALID_ARG,
                "unknown optimizer kind %d", (int)o->kind);
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

tdm_status tdm_optim_init(tdm_optim **out, tdm_model *m, const tdm_optim_opts *opts)
{
    *out = NULL;
    TDM_CHECK(tdm_optim_check(opts));
    tdm_optim *o = calloc(1, sizeof *o);
    if (!o) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate an optimizer");
    o->opts = *opts;
    o->model = m;
    o->n_state = opts->kind == TDM_OPTIM_ADAMW ? 2 : (opts->momentum != 0.0f ? 1 : 0);
    tdm_device *d = tdm_model_device(m);
    size_t nb = (size_t)tdm_model_param_elems(m) * sizeof(float);
    for (int i = 0; i < o->n_state; i++) {
        tdm_status st = tdm_dev_alloc_zero(d, nb, (void **)&o->state[i]);
        if (st != TDM_STATUS_OK) {
            tdm_optim_free(o);
            return st;
        }
    }
    *out = o;
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
    for (int i = 0; i < o->n_state; i++) tdm_dev_free(tdm_model_device(o->model), o->state[i]);
    free(o);
}

tdm_status tdm_optim_step(tdm_optim *o)
{
    tdm_model *m = o->model;
    tdm_device *d = tdm_model_device(m);
    const tdm_optim_opts *p = &o->opts;
    int64_t n = tdm_model_param_elems(m);
    /* steps + 1 must neither overflow int64 nor stop being exact as the
     * double that AdamW's bias correction raises the betas to. */
    TDM_REQUIRE(o->steps >= 0 && o->steps < TDM_OPTIM_MAX_STEPS, TDM_STATUS_INVALID_ARG,
                "optimizer: step count %" PRId64 " is outside [0, 2^53): refusing to step (a "
                "corrupt checkpoint?)", o->steps);
    if (o->schedule == TDM_OPTIM_SCHEDULE_COSINE) {
        double t = (double)o->steps / (double)o->total_steps;
        if (t > 1.0) t = 1.0;
        o->opts.lr = (float)(o->base_lr * 0.5 * (1.0 + cos(M_PI * t)));
    }
    if (p->kind == TDM_OPTIM_SGD) {
        TDM_CHECK(tdm_dev_sgd_step(d, n, tdm_model_params(m), tdm_model_grads(m), o->state[0],
                                   p->lr, p->momentum, p->dampening, p->weight_decay,
                                   p->nesterov, o->steps == 0));
    } else {
        double t = (double)o->steps + 1.0;
        float bc1 = (float)(1.0 - pow(p->beta1, t));
        float bc2 = (float)(1.0 - pow(p->beta2, t));
        TDM_CHECK(tdm_dev_adamw_step(d, n, tdm_model_params(m), tdm_model_grads(m), o->state[0],
                                     o->state[1], p->lr, p->beta1, p->beta2, p->eps,
                                     p->weight_decay, bc1, bc2));
    }
    o->steps++;
    return TDM_STATUS_OK;
}

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
    if (o->opts.kind == TDM_OPTIM_SGD) return "momentum";
    return i == 0 ? "exp_avg" : "exp_avg_sq";
}

float *tdm_optim_state(tdm_optim *o, int i)
{
    return i >= 0 && i < o->n_state ? o->state[i] : NULL;
}

size_t tdm_optim_state_bytes(const tdm_optim *o)
{
    return (size_t)o->n_state * (size_t)tdm_model_param_elems(o->model) * sizeof(float);
}
