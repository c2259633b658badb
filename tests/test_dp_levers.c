/* tests/test_dp_levers.c: the memory levers under DataParallel (dp/):
 * the replicas take the master's precision and activation checkpointing
 * (set before or after tdm_dp_init), and tdm_dp_step_levers adds fp16's
 * loss scaling and gradient clipping on the master's summed gradients:
 * - checkpointing (segments of 1 and 2) changes no bit of 10 DP steps
 *   (losses, the last gradients, the parameters), MLP, CNN and GPT, fp32
 *   and bf16, over 2 and 3 host devices;
 * - a precision set on the master after tdm_dp_init reaches every
 *   replica: the run is bitwise the one set before, and not fp32's;
 * - an inf planted in replica 1's gradient at step 3 (its grad-ready
 *   hook) makes the step skipped as a whole: the loss scale halves, the
 *   parameters are bitwise those after step 2, and the run goes on;
 * - the clipped norm equals one device's on the same global batches
 *   within float bounds (MLP, GPT), at 2 and 3 devices, and clips. */
#include <criterion/criterion.h>

#include <math.h>
#include <string.h>

#include "dp/dp.h"
#include "models/builder.h"
#include "tests/lever_util.h"

TestSuite(dp_levers, .timeout = 240);

typedef struct dl_cfg {
    lv_model k;
    int n_dev;
    tdm_precision prec;
    int ckpt;
    int steps;
    double clip;
    int scaler;
    int late;          /* 1: the levers set on the master after tdm_dp_init */
    int inf_step;      /* > 0: replica 1 plants an inf in its gradient at this step */
} dl_cfg;

typedef struct dl_result {
    lv_result r;
    double scale;
    int64_t skipped;
    int skipped_at[64];
    tdm_precision replica_prec;
} dl_result;

typedef struct dl_plant {
    int step, at;      /* the step the hook plants at; the step running */
    int planted;
} dl_plant;

/* replica 1's grad-ready hook: an inf in the gradient it just wrote */
static void dl_plant_hook(void *ctx, tdm_model *m, int first, int last)
{
    dl_plant *p = ctx;
    (void)last;
    if (p->at != p->step || p->planted) return;
    tdm_model_grads(m)[tdm_model_param_info(m, first)->offset] = INFINITY;
    p->planted = 1;
}

static void dl_train(const dl_cfg *c, dl_result *out)
{
    memset(out, 0, sizeof *out);
    tdm_model_spec spec;
    lv_spec(c->k, &spec);
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    int n = 0;
    char dspec[16];
    snprintf(dspec, sizeof dspec, "cpu:%d", c->n_dev);
    TU_OK(tdm_dp_devices_open(dspec, devs, &n));
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dp *dp = NULL;
    TU_OK(tdm_model_init(&m, devs[0], &spec, 7));
    if (!c->late) {
        TU_OK(tdm_model_set_precision(m, c->prec));
        TU_OK(tdm_model_set_checkpoint(m, c->ckpt));
    }
    TU_OK(tdm_dp_init(&dp, m, devs, n, NULL));
    if (c->late) {
        TU_OK(tdm_model_set_precision(m, c->prec));
        TU_OK(tdm_model_set_checkpoint(m, c->ckpt));
    }
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, c->k == LV_GPT ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    if (c->k != LV_GPT) {
        o.lr = 0.05f;
        o.momentum = 0.9f;
    } else {
        o.lr = 3e-3f;
    }
    TU_OK(tdm_optim_init(&opt, m, &o));
    tdm_grad_scaler sc;
    tdm_single s = {.model = m, .opt = opt, .clip_norm = c->clip, .measure_norm = 1};
    if (c->scaler) {
        TU_OK(tdm_grad_scaler_init(&sc, NULL));
        s.scaler = &sc;
    }
    dl_plant plant = {.step = c->inf_step};
    if (c->inf_step) tdm_model_set_grad_hook(tdm_dp_replica(dp, 1), dl_plant_hook, &plant);
    int B = lv_batch(c->k), feat = tdm_model_in_features(m), rows = tdm_model_out_rows(m);
    float *x = tu_malloc((size_t)B * feat * 4);
    int32_t *y = tu_malloc((size_t)B * rows * 4);
    for (int i = 0; i < c->steps && i < 64; i++) {
        plant.at = i + 1;
        lv_data(c->k, &spec, i, x, y);
        TU_OK(tdm_dp_step_levers(dp, &s, x, y, B, &out->r.loss[i]));
        out->r.norm[i] = s.last_norm;
        out->skipped_at[i] = s.last_skipped;
    }
    cr_assert(!c->inf_step || plant.planted, "the hook planted nothing");
    out->replica_prec = tdm_model_precision(tdm_dp_replica(dp, n - 1));
    if (c->scaler) {
        out->scale = tdm_grad_scaler_scale(&sc);
        out->skipped = sc.skipped;
    }
    lv_result *r = &out->r;
    r->n_params = tdm_model_param_elems(m);
    r->params = tu_malloc((size_t)r->n_params * 4);
    r->grads = tu_malloc((size_t)r->n_params * 4);
    memcpy(r->params, tdm_model_params(m), (size_t)r->n_params * 4);
    memcpy(r->grads, tdm_model_grads(m), (size_t)r->n_params * 4);
    free(x);
    free(y);
    tdm_dp_free(dp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, n);
}

static void dl_same_bits(const dl_result *a, const dl_result *b, int steps, const char *what)
{
    cr_assert_eq(a->r.n_params, b->r.n_params);
    for (int i = 0; i < steps; i++)
        cr_assert(!memcmp(&a->r.loss[i], &b->r.loss[i], sizeof a->r.loss[i]),
                  "%s: step %d loss %.17g vs %.17g", what, i + 1, a->r.loss[i], b->r.loss[i]);
    for (int64_t j = 0; j < a->r.n_params; j++) {
        cr_assert(!memcmp(&a->r.grads[j], &b->r.grads[j], 4), "%s: gradient[%lld] %.9g vs %.9g",
                  what, (long long)j, a->r.grads[j], b->r.grads[j]);
        cr_assert(!memcmp(&a->r.params[j], &b->r.params[j], 4),
                  "%s: parameter[%lld] %.9g vs %.9g", what, (long long)j, a->r.params[j],
                  b->r.params[j]);
    }
}

Test(dp_levers, checkpointing_changes_no_bit)
{
    static const tdm_precision precs[] = {TDM_PRECISION_FP32, TDM_PRECISION_BF16};
    for (int k = 0; k < LV_N_MODELS; k++)
        for (int p = 0; p < 2; p++)
            for (int nd = 2; nd <= 3; nd++) {
                dl_cfg c = {.k = (lv_model)k, .n_dev = nd, .prec = precs[p], .steps = 10};
                dl_result base, ck;
                dl_train(&c, &base);
                cr_assert_eq(base.replica_prec, precs[p]);
                for (int n = 1; n <= 2; n++) {
                    c.ckpt = n;
                    dl_train(&c, &ck);
                    char what[96];
                    snprintf(what, sizeof what, "%s %s DP(%d), segments of %d", lv_names[k],
                             tdm_precision_name(precs[p]), nd, n);
                    dl_same_bits(&ck, &base, c.steps, what);
                    lv_free(&ck.r);
                }
                lv_free(&base.r);
            }
}

Test(dp_levers, levers_set_after_init_reach_every_replica)
{
    for (int k = 0; k < LV_N_MODELS; k++) {
        dl_cfg c = {.k = (lv_model)k, .n_dev = 2, .prec = TDM_PRECISION_BF16, .ckpt = 1,
                    .steps = 4};
        dl_result before, after, fp32;
        dl_train(&c, &before);
        c.late = 1;
        dl_train(&c, &after);
        cr_assert_eq(after.replica_prec, TDM_PRECISION_BF16, "%s", lv_names[k]);
        dl_same_bits(&after, &before, c.steps, lv_names[k]);
        c.prec = TDM_PRECISION_FP32;
        c.ckpt = 0;
        dl_train(&c, &fp32);
        cr_assert(memcmp(fp32.r.params, after.r.params, (size_t)fp32.r.n_params * 4),
                  "%s: bf16 trained bitwise as fp32 did", lv_names[k]);
        lv_free(&before.r);
        lv_free(&after.r);
        lv_free(&fp32.r);
    }
}

Test(dp_levers, an_inf_in_one_replica_skips_the_step_on_all)
{
    for (int k = 0; k < LV_N_MODELS; k++) {
        dl_cfg c = {.k = (lv_model)k, .n_dev = 2, .prec = TDM_PRECISION_FP16, .scaler = 1,
                    .steps = 2};
        dl_result two, skip, five;
        dl_train(&c, &two);
        cr_assert_eq(two.scale, 65536.0);
        cr_assert_eq(two.skipped, 0);
        c.steps = 3;
        c.inf_step = 3;
        dl_train(&c, &skip);
        cr_assert_eq(skip.scale, 32768.0, "%s: scale %g", lv_names[k], skip.scale);
        cr_assert_eq(skip.skipped, 1);
        cr_assert(skip.skipped_at[2] && !skip.skipped_at[0] && !skip.skipped_at[1]);
        cr_assert(!memcmp(two.r.params, skip.r.params, (size_t)two.r.n_params * 4),
                  "%s: the skipped step changed the master's parameters", lv_names[k]);
        /* and training goes on from there */
        c.steps = 5;
        dl_train(&c, &five);
        cr_assert_eq(five.skipped, 1);
        cr_assert(!five.skipped_at[3] && !five.skipped_at[4]);
        cr_assert(memcmp(five.r.params, skip.r.params, (size_t)two.r.n_params * 4));
        for (int i = 0; i < 5; i++) cr_assert(isfinite(five.r.loss[i]));
        lv_free(&two.r);
        lv_free(&skip.r);
        lv_free(&five.r);
    }
}

Test(dp_levers, the_clipped_norm_is_one_devices)
{
    /* not the CNN: its batchnorm normalises each replica's chunk alone, so
     * its gradients are other ones than one device's by design */
    static const lv_model models[] = {LV_MLP, LV_GPT};
    for (int q = 0; q < 2; q++) {
        lv_model k = models[q];
        lv_cfg sc = {.prec = TDM_PRECISION_FP32, .steps = 6, .clip = 0.5};
        lv_result one;
        lv_train(k, &sc, &one);
        for (int nd = 2; nd <= 3; nd++) {
            dl_cfg c = {.k = k, .n_dev = nd, .steps = 6, .clip = 0.5};
            dl_result d;
            dl_train(&c, &d);
            for (int i = 0; i < c.steps; i++) {
                cr_assert(fabs(d.r.norm[i] - one.norm[i]) <= 1e-5 * one.norm[i],
                          "%s DP(%d) step %d: norm %.9g vs one device %.9g", lv_names[k], nd,
                          i + 1, d.r.norm[i], one.norm[i]);
            }
            lv_free(&d.r);
        }
        cr_assert(one.norm[0] > sc.clip, "%s: norm %g: the clipping never acts", lv_names[k],
                  one.norm[0]);
        lv_free(&one);
    }
}

/* ---- dropout's masks under DP ----
 * A step with fewer rows than devices leaves a replica idle: it ran no
 * forward, and its count of training forwards (what dropout's masks are
 * keyed on) fell behind; every later sample it got drew another mask
 * than on one device (0.444 apart after batches 1, 2, 2). */
static const char *k_drop_model = "input 8\nlinear 16\ndropout 0.5\nlinear 3\n";

static void drop_run(int use_dp, const int *bs, int nsteps, float *out, int64_t *np)
{
    tdm_model_spec s;
    TU_OK(tdm_model_seq_parse_text(&s, "t", k_drop_model, strlen(k_drop_model)));
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    int n = 0;
    TU_OK(tdm_dp_devices_open("cpu:2", devs, &n));
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dp *dp = NULL;
    TU_OK(tdm_model_init(&m, devs[0], &s, 7));
    tdm_model_set_train(m, 1);
    if (use_dp) TU_OK(tdm_dp_init(&dp, m, devs, n, NULL));
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
    o.lr = 0.5f;
    TU_OK(tdm_optim_init(&opt, m, &o));
    float x[4 * 8];
    int32_t y[4];
    int off = 0;
    for (int st = 0; st < nsteps; st++) {
        int B = bs[st];
        for (int i = 0; i < B; i++) {
            y[i] = (off + i) % 3;
            for (int j = 0; j < 8; j++) x[i * 8 + j] = sinf((float)((off + i) * 8 + j));
        }
        off += B;
        if (use_dp) {
            TU_OK(tdm_dp_step(dp, opt, x, y, B, NULL));
        } else {
            TU_OK(tdm_model_zero_grad(m));
            TU_OK(tdm_model_forward_backward(m, x, y, B, NULL));
            TU_OK(tdm_optim_step(opt));
        }
    }
    *np = tdm_model_param_elems(m);
    memcpy(out, tdm_model_params(m), (size_t)*np * sizeof(float));
    tdm_optim_free(opt);
    tdm_dp_free(dp);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, n);
}

static double drop_diff(const int *bs, int k)
{
    static float a[4096], b[4096];
    int64_t na, nb;
    drop_run(0, bs, k, a, &na);
    drop_run(1, bs, k, b, &nb);
    cr_assert_eq(na, nb);
    double w = 0;
    for (int64_t i = 0; i < na; i++) w = fmax(w, fabs((double)a[i] - (double)b[i]));
    return w;
}

Test(dp_levers, dropout_masks_survive_an_idle_replica)
{
    const int even[] = {2, 2, 2}, odd[] = {1, 2, 2};
    double de = drop_diff(even, 3), dd = drop_diff(odd, 3);
    cr_expect(de < 1e-5, "DP differs from one device: %g", de);
    cr_expect(dd < 1e-5, "DP differs from one device after an idle replica: %g", dd);
}
