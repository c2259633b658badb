/* tests/test_optim.c: SGD (plain, momentum, dampening, nesterov, weight
 * decay) and AdamW (decoupled weight decay, bias correction) over a model's
 * flat buffers (models/optim.c) against the update rules of PyTorch's
 * torch.optim.SGD and torch.optim.AdamW documentation, computed here in
 * double over several steps with changing gradients; literal hand-computed
 * first steps; state buffers; the cosine schedule; invalid options
 * refused. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "models/model.h"
#include "models/optim.h"
#include "tests/test_util.h"

static tdm_device *g_dev;
static void setup(void) { g_dev = tu_host(); }
static void teardown(void) { tdm_device_free(g_dev); }
TestSuite(optim, .init = setup, .fini = teardown);

static tdm_model *small_model(void)
{
    static const int dims[] = {5, 3, 2}; /* 15 + 3 + 6 + 2 elements, with padding */
    tdm_model *m = NULL;
    TU_OK(tdm_mlp_init(&m, g_dev, dims, 3, 1));
    return m;
}

/* Is element k of the flat buffer inside a tensor (not padding)? */
static int in_tensor(tdm_model *m, int64_t k)
{
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *t = tdm_model_param_info(m, i);
        if (k >= t->offset && k < t->offset + t->n_elem) return 1;
    }
    return 0;
}

/* Random parameters and, per step, random gradients inside the tensors
 * (padding keeps p = g = 0); the optimizer vs the double reference. */
static void run_sgd(const tdm_optim_opts *o, int steps, uint64_t seed, const char *what)
{
    tdm_model *m = small_model();
    int64_t n = tdm_model_param_elems(m);
    float *p = tdm_model_params(m), *g = tdm_model_grads(m);
    double *rp = tu_malloc((size_t)n * sizeof(double)), *rb = tu_malloc((size_t)n * sizeof(double));
    tdm_rng r = tu_rng(seed);
    for (int64_t k = 0; k < n; k++) {
        p[k] = in_tensor(m, k) ? tu_unif(&r, -1, 1) : 0.0f;
        rp[k] = p[k];
    }
    tdm_optim *opt = NULL;
    TU_OK(tdm_optim_init(&opt, m, o));
    cr_assert_eq(tdm_optim_n_state(opt), o->momentum != 0.0f ? 1 : 0, "%s: state count", what);
    if (o->momentum != 0.0f) cr_assert_str_eq(tdm_optim_state_name(opt, 0), "momentum");
    double worst = 0.0;
    for (int t = 0; t < steps; t++) {
        for (int64_t k = 0; k < n; k++) g[k] = in_tensor(m, k) ? tu_unif(&r, -1, 1) : 0.0f;
        TU_OK(tdm_optim_step(opt));
        cr_assert_eq(tdm_optim_steps(opt), t + 1);
        for (int64_t k = 0; k < n; k++) {
            /* torch.optim.SGD */
            double d = (double)g[k] + o->weight_decay * rp[k];
            if (o->momentum != 0.0f) {
                rb[k] = t == 0 ? d : o->momentum * rb[k] + (1.0 - o->dampening) * d;
                d = o->nesterov ? d + o->momentum * rb[k] : rb[k];
            }
            rp[k] -= o->lr * d;
            double e = fabs(p[k] - rp[k]) / (1e-6 + 1e-5 * fabs(rp[k]));
            worst = e > worst ? e : worst;
            cr_assert(e <= 1.0, "%s step %d: p[%lld] = %.9g, expected %.9g", what, t + 1,
                      (long long)k, (double)p[k], rp[k]);
            if (o->momentum != 0.0f)
                cr_assert(tu_close(tdm_optim_state(opt, 0)[k], rb[k], 1e-6, 1e-5),
                          "%s step %d: momentum[%lld] = %.9g, expected %.9g", what, t + 1,
                          (long long)k, (double)tdm_optim_state(opt, 0)[k], rb[k]);
            if (!in_tensor(m, k)) cr_assert(p[k] == 0.0f, "%s: padding changed", what);
        }
    }
    fprintf(stderr, "  sgd %-34s worst err/tol %.3f\n", what, worst);
    tdm_optim_free(opt);
    tdm_model_free(m);
    free(rp);
    free(rb);
}

Test(optim, sgd_matches_pytorch_rules)
{
    struct {
        float lr, mom, damp, wd;
        int nesterov;
        const char *what;
    } cfg[] = {
        {0.1f, 0.0f, 0.0f, 0.0f, 0, "plain"},
        {0.05f, 0.9f, 0.0f, 0.0f, 0, "momentum 0.9"},
        {0.05f, 0.8f, 0.3f, 0.0f, 0, "momentum 0.8 dampening 0.3"},
        {0.05f, 0.9f, 0.0f, 0.0f, 1, "nesterov 0.9"},
        {0.1f, 0.0f, 0.0f, 0.2f, 0, "weight decay 0.2"},
        {0.03f, 0.7f, 0.1f, 0.05f, 0, "momentum+dampening+wd"},
        {0.03f, 0.9f, 0.0f, 0.1f, 1, "nesterov+wd"},
    };
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++) {
        tdm_optim_opts o;
        tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
        o.lr = cfg[i].lr;
        o.momentum = cfg[i].mom;
        o.dampening = cfg[i].damp;
        o.weight_decay = cfg[i].wd;
        o.nesterov = cfg[i].nesterov;
        run_sgd(&o, 6, 200 + i, cfg[i].what);
    }
}

/* Hand-computed: p = 1, g = 0.5 twice, lr 0.1, momentum 0.9:
 * step 1: buf = 0.5, p = 0.95; step 2: buf = 0.9*0.5 + 0.5 = 0.95,
 * p = 0.95 - 0.095 = 0.855. With nesterov: step 1 d = 0.5 + 0.45 = 0.95,
 * p = 0.905; step 2 buf = 0.95, d = 0.5 + 0.855 = 1.355, p = 0.7695. */
Test(optim, sgd_hand_computed)
{
    for (int nest = 0; nest < 2; nest++) {
        tdm_model *m = small_model();
        tdm_optim_opts o;
        tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
        o.lr = 0.1f;
        o.momentum = 0.9f;
        o.nesterov = nest;
        tdm_optim *opt = NULL;
        TU_OK(tdm_optim_init(&opt, m, &o));
        tdm_model_params(m)[0] = 1.0f;
        tdm_model_grads(m)[0] = 0.5f;
        TU_OK(tdm_optim_step(opt));
        cr_assert_float_eq(tdm_model_params(m)[0], nest ? 0.905f : 0.95f, 1e-6, "step 1: %g",
                           (double)tdm_model_params(m)[0]);
        TU_OK(tdm_optim_step(opt));
        cr_assert_float_eq(tdm_model_params(m)[0], nest ? 0.7695f : 0.855f, 1e-6, "step 2: %g",
                           (double)tdm_model_params(m)[0]);
        tdm_optim_free(opt);
        tdm_model_free(m);
    }
}

static void run_adamw(const tdm_optim_opts *o, int steps, uint64_t seed, const char *what)
{
    tdm_model *m = small_model();
    int64_t n = tdm_model_param_elems(m);
    float *p = tdm_model_params(m), *g = tdm_model_grads(m);
    double *rp = tu_malloc((size_t)n * sizeof(double));
    double *rm = tu_malloc((size_t)n * sizeof(double)), *rv = tu_malloc((size_t)n * sizeof(double));
    tdm_rng r = tu_rng(seed);
    for (int64_t k = 0; k < n; k++) {
        p[k] = in_tensor(m, k) ? tu_unif(&r, -1, 1) : 0.0f;
        rp[k] = p[k];
    }
    tdm_optim *opt = NULL;
    TU_OK(tdm_optim_init(&opt, m, o));
    cr_assert_eq(tdm_optim_n_state(opt), 2);
    cr_assert_str_eq(tdm_optim_state_name(opt, 0), "exp_avg");
    cr_assert_str_eq(tdm_optim_state_name(opt, 1), "exp_avg_sq");
    double worst = 0.0;
    for (int t = 1; t <= steps; t++) {
        /* gradients of varied magnitude, some tiny (eps matters), some 0 */
        for (int64_t k = 0; k < n; k++)
            g[k] = in_tensor(m, k) ? (k % 5 == 0 ? 0.0f : tu_unif(&r, -1, 1) * (k % 3 ? 1.0f : 1e-4f))
                                   : 0.0f;
        TU_OK(tdm_optim_step(opt));
        double bc1 = 1.0 - pow(o->beta1, t), bc2 = 1.0 - pow(o->beta2, t);
        for (int64_t k = 0; k < n; k++) {
            /* torch.optim.AdamW */
            rp[k] *= 1.0 - (double)o->lr * o->weight_decay;
            rm[k] = o->beta1 * rm[k] + (1.0 - o->beta1) * g[k];
            rv[k] = o->beta2 * rv[k] + (1.0 - o->beta2) * (double)g[k] * g[k];
            rp[k] -= o->lr * (rm[k] / bc1) / (sqrt(rv[k] / bc2) + o->eps);
            double e = fabs(p[k] - rp[k]) / (1e-6 + 1e-5 * fabs(rp[k]));
            worst = e > worst ? e : worst;
            cr_assert(e <= 1.0, "%s step %d: p[%lld] = %.9g, expected %.9g (g %g)", what, t,
                      (long long)k, (double)p[k], rp[k], (double)g[k]);
            cr_assert(tu_close(tdm_optim_state(opt, 0)[k], rm[k], 1e-7, 1e-5), "%s: exp_avg[%lld]",
                      what, (long long)k);
            cr_assert(tu_close(tdm_optim_state(opt, 1)[k], rv[k], 1e-9, 1e-5), "%s: exp_avg_sq[%lld]",
                      what, (long long)k);
            if (!in_tensor(m, k)) cr_assert(p[k] == 0.0f, "%s: padding changed", what);
        }
    }
    fprintf(stderr, "  adamw %-32s worst err/tol %.3f\n", what, worst);
    tdm_optim_free(opt);
    tdm_model_free(m);
    free(rp);
    free(rm);
    free(rv);
}

Test(optim, adamw_matches_pytorch_rules)
{
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, TDM_OPTIM_ADAMW);
    cr_assert(o.lr == 1e-3f && o.beta1 == 0.9f && o.beta2 == 0.999f && o.eps == 1e-8f &&
                  o.weight_decay == 0.01f,
              "AdamW defaults differ from PyTorch's");
    run_adamw(&o, 8, 300, "defaults");
    o.lr = 0.05f;
    o.weight_decay = 0.1f;
    run_adamw(&o, 8, 301, "lr 0.05 wd 0.1");
    o.beta1 = 0.5f;
    o.beta2 = 0.9f;
    o.eps = 1e-3f;
    o.weight_decay = 0.0f;
    run_adamw(&o, 8, 302, "betas (0.5, 0.9) eps 1e-3 wd 0");
}

/* Hand-computed first step: m = 0.1 g, v = 0.001 g^2, the bias corrections
 * undo both, so p = p (1 - lr wd) - lr g / (|g| + eps):
 * p = 1, g = 0.5, lr 0.1, wd 0.01: 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.899. */
Test(optim, adamw_hand_computed_first_step)
{
    tdm_model *m = small_model();
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, TDM_OPTIM_ADAMW);
    o.lr = 0.1f;
    tdm_optim *opt = NULL;
    TU_OK(tdm_optim_init(&opt, m, &o));
    tdm_model_params(m)[0] = 1.0f;
    tdm_model_grads(m)[0] = 0.5f;
    tdm_model_params(m)[1] = -2.0f;
    tdm_model_grads(m)[1] = -3.0f;
    TU_OK(tdm_optim_step(opt));
    cr_assert_float_eq(tdm_model_params(m)[0], 0.899f, 1e-6, "p0 = %.9g", (double)tdm_model_params(m)[0]);
    /* -2 * 0.999 + 0.1 = -1.898 */
    cr_assert_float_eq(tdm_model_params(m)[1], -1.898f, 1e-6, "p1 = %.9g", (double)tdm_model_params(m)[1]);
    tdm_optim_free(opt);
    tdm_model_free(m);
}

/* Resuming: set_steps restores the bias-correction / first-step position. */
Test(optim, set_steps_and_lr)
{
    tdm_model *m = small_model();
    tdm_optim *opt = NULL;
    TU_OK(tdm_sgd_init(&opt, m, 0.5f, 0.9f));
    tdm_model_params(m)[0] = 1.0f;
    tdm_model_grads(m)[0] = 1.0f;
    tdm_optim_state(opt, 0)[0] = 2.0f;
    tdm_optim_set_steps(opt, 3); /* not the first step: buf = 0.9*2 + 1 = 2.8 */
    tdm_optim_set_lr(opt, 0.1f);
    TU_OK(tdm_optim_step(opt));
    cr_assert_float_eq(tdm_optim_state(opt, 0)[0], 2.8f, 1e-6);
    cr_assert_float_eq(tdm_model_params(m)[0], 1.0f - 0.28f, 1e-6, "p = %g", (double)tdm_model_params(m)[0]);
    cr_assert_eq(tdm_optim_steps(opt), 4);
    tdm_optim_free(opt);
    tdm_model_free(m);
}

/* The cosine schedule: step k runs at base * (1 + cos(pi min(k/K, 1))) / 2,
 * computed in double and rounded once, from the step count (a resumed run
 * continues it); SGD without momentum moves p by exactly -lr * g. */
static float cosine_lr(double base, int64_t k, int64_t total)
{
    double t = (double)k / (double)total;
    if (t > 1.0) t = 1.0;
    return (float)(base * 0.5 * (1.0 + cos(M_PI * t)));
}

Test(optim, cosine_schedule_by_step_count)
{
    tdm_model *m = small_model();
    tdm_optim *opt = NULL;
    TU_OK(tdm_sgd_init(&opt, m, 0.5f, 0.0f));
    TU_OK(tdm_optim_set_schedule(opt, TDM_OPTIM_SCHEDULE_COSINE, 0.05, 10));
    for (int64_t k = 0; k < 13; k++) {
        if (k == 6) tdm_optim_set_steps(opt, 8);   /* resumed from a checkpoint of step 8 */
        int64_t at = tdm_optim_steps(opt);
        float want = cosine_lr(0.05, at, 10);
        tdm_model_params(m)[0] = 1.0f;
        tdm_model_grads(m)[0] = 1.0f;
        TU_OK(tdm_optim_step(opt));
        cr_assert_eq(tdm_optim_get_opts(opt)->lr, want, "step %lld: lr %.9g, want %.9g",
                     (long long)at, (double)tdm_optim_get_opts(opt)->lr, (double)want);
        cr_assert_eq(tdm_model_params(m)[0], 1.0f - want, "step %lld: p = %.9g",
                     (long long)at, (double)tdm_model_params(m)[0]);
    }
    cr_assert_eq(tdm_optim_get_opts(opt)->lr, 0.0f, "past total_steps the rate stays 0");
    /* const: the base rate, every step */
    TU_OK(tdm_optim_set_schedule(opt, TDM_OPTIM_SCHEDULE_CONST, 0.25, 0));
    TU_OK(tdm_optim_step(opt));
    cr_assert_eq(tdm_optim_get_opts(opt)->lr, 0.25f);
    cr_assert_eq(tdm_optim_set_schedule(opt, TDM_OPTIM_SCHEDULE_COSINE, 0.1, 0),
                 TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_optim_set_schedule(opt, TDM_OPTIM_SCHEDULE_COSINE, NAN, 10),
                 TDM_STATUS_INVALID_ARG);
    tdm_optim_free(opt);
    tdm_model_free(m);
}

Test(optim, invalid_options_refused)
{
    tdm_model *m = small_model();
    struct {
        tdm_optim_kind kind;
        float lr, mom, damp, wd, b1, b2, eps;
        int nesterov;
        const char *why;
    } bad[] = {
        {TDM_OPTIM_SGD, -0.1f, 0, 0, 0, 0, 0, 0, 0, "negative lr"},
        {TDM_OPTIM_SGD, NAN, 0, 0, 0, 0, 0, 0, 0, "NaN lr"},
        {TDM_OPTIM_SGD, INFINITY, 0, 0, 0, 0, 0, 0, 0, "infinite lr"},
        {TDM_OPTIM_SGD, 0.1f, 1.0f, 0, 0, 0, 0, 0, 0, "momentum 1"},
        {TDM_OPTIM_SGD, 0.1f, 1.5f, 0, 0, 0, 0, 0, 0, "momentum 1.5"},
        {TDM_OPTIM_SGD, 0.1f, -0.1f, 0, 0, 0, 0, 0, 0, "negative momentum"},
        {TDM_OPTIM_SGD, 0.1f, NAN, 0, 0, 0, 0, 0, 0, "NaN momentum"},
        {TDM_OPTIM_SGD, 0.1f, 0.0f, 0, 0, 0, 0, 0, 1, "nesterov without momentum"},
        {TDM_OPTIM_SGD, 0.1f, 0.9f, 0.5f, 0, 0, 0, 0, 1, "nesterov with dampening"},
        {TDM_OPTIM_SGD, 0.1f, 0.9f, 0, -0.01f, 0, 0, 0, 0, "negative weight decay"},
        {TDM_OPTIM_ADAMW, -1e-3f, 0, 0, 0, 0.9f, 0.999f, 1e-8f, 0, "AdamW negative lr"},
        {TDM_OPTIM_ADAMW, 1e-3f, 0, 0, 0, 1.0f, 0.999f, 1e-8f, 0, "AdamW beta1 1"},
        {TDM_OPTIM_ADAMW, 1e-3f, 0, 0, 0, 0.9f, 1.0f, 1e-8f, 0, "AdamW beta2 1"},
        {TDM_OPTIM_ADAMW, 1e-3f, 0, 0, 0, 0.9f, 0.999f, 0.0f, 0, "AdamW eps 0"},
        {TDM_OPTIM_ADAMW, 1e-3f, 0, 0, -1.0f, 0.9f, 0.999f, 1e-8f, 0, "AdamW negative wd"},
        {(tdm_optim_kind)7, 1e-3f, 0, 0, 0, 0.9f, 0.999f, 1e-8f, 0, "unknown kind"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tdm_optim_opts o = {.kind = bad[i].kind, .lr = bad[i].lr, .momentum = bad[i].mom,
                            .dampening = bad[i].damp, .weight_decay = bad[i].wd,
                            .beta1 = bad[i].b1, .beta2 = bad[i].b2, .eps = bad[i].eps,
                            .nesterov = bad[i].nesterov};
        tdm_optim *opt = (tdm_optim *)&o; /* must be reset to NULL */
        tdm_status st = tdm_optim_init(&opt, m, &o);
        cr_expect_eq(st, TDM_STATUS_INVALID_ARG, "%s accepted (status %s)", bad[i].why,
                     tdm_status_name(st));
        cr_expect_null(opt, "%s: *out not NULL on failure", bad[i].why);
        if (st == TDM_STATUS_OK) tdm_optim_free(opt);
    }
    tdm_model_free(m);
}
