/* tests/test_pp_levers.c: the memory levers through a pipeline (pp/pp.h:
 * tdm_pp_opts.precision and .ckpt, tdm_pp_set_levers) against one device
 * with gradient accumulation over the same micro-batches and the same
 * levers (models/accum.h's single-device ops honour tdm_single's scaler
 * and clipping): 2 and 3 stages (forked ranks over shm), 3 micro-batches
 * of a global batch of 24 (the last shorter: 8, 8, 8 - and 26: 9, 9, 8),
 * 1F1B and GPipe, the MLP, the CNN and the GPT, in bf16, fp16 with loss
 * scaling, with activation checkpointing and with the gradient norm
 * clipped (low enough that every step clips).
 *
 * MLP and CNN: the losses of every step and the parameters after the
 * last step bit for bit one device's; the norm, summed per stage and
 * then over the stages, equal to one device's to 1e-12 relative (the
 * chunks of the sum are cut elsewhere; the clip coefficient, rounded to
 * float, comes out the same). GPT: within the bounds of tests/test_pp.c
 * (its tied embedding's gradient is summed in another order): measured
 * parameters within 4.9e-7 and losses within 6.5e-7 after 6 steps over
 * every case, the norm within 1e-5 relative; checked: 1e-4, 1e-5, 1e-5.
 * Every model trains with SGD and momentum here (lv_optim says why). Checkpointing changes no bit of a pipeline's run (every model,
 * fp32 and bf16). An inf planted in one stage's gradient makes every
 * stage skip that step: parameters bitwise those before it, the scale
 * halved on every stage, and the steps after it go on. The levers' two
 * all-reduces are labelled in the flight recorder. */
#include <criterion/criterion.h>
#include <dirent.h>

#include "models/clip.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

#define STEPS 6
#define M 3
#define GPT_PARAM_TOL 1e-4
#define GPT_LOSS_TOL 1e-5
#define NORM_RTOL 1e-12

typedef struct levers {
    tdm_precision prec;
    int ckpt;
    int fp16;             /* loss scaling */
    double clip;
} levers;

/* SGD with momentum for every model: AdamW turns the rounding noise of a
 * gradient that is zero analytically into lr-sized steps of either sign
 * (tests/test_pp_ddp.c), which the GPT's tied sum in another order would
 * show as differences of lr rather than of its rounding. */
static tdm_optim_opts lv_optim(tpp_kind k)
{
    (void)k;
    return tpp_optim(TPP_MLP);
}

typedef struct ref {
    double loss[STEPS], norm[STEPS];
    float scale[STEPS];
    float params[TPP_MAX_ELEMS];
    int64_t n;
} ref;

/* One device, M micro-batches of ceil(B / M), the same levers. */
static void reference(tpp_kind k, int B, const levers *lv, ref *out)
{
    tdm_model_spec spec;
    tpp_spec(k, &spec);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_optim_opts oo = lv_optim(k);
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, TPP_SEED), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_set_precision(m, lv->prec), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_set_checkpoint(m, lv->ckpt), TDM_STATUS_OK);
    cr_assert_eq(tdm_optim_init(&opt, m, &oo), TDM_STATUS_OK);
    tdm_grad_scaler sc;
    cr_assert_eq(tdm_grad_scaler_init(&sc, NULL), TDM_STATUS_OK);
    int in = tdm_model_in_features(m), rows = tdm_model_out_rows(m);
    int classes = tdm_model_n_classes(m);
    void *x = malloc((size_t)B * (size_t)in * 4);
    int32_t *y = malloc((size_t)B * (size_t)rows * sizeof *y);
    cr_assert(x && y);
    tdm_single single = {.model = m, .opt = opt, .scaler = lv->fp16 ? &sc : NULL,
                         .clip_norm = lv->clip};
    tdm_accum a = {.ops = &tdm_accum_single_ops, .ctx = &single, .micro = (B + M - 1) / M,
                   .in_features = in, .out_rows = rows};
    for (int s = 0; s < STEPS; s++) {
        tpp_batch(&spec, in, rows, classes, s, B, x, y);
        cr_assert_eq(tdm_accum_step(&a, x, y, B, &out->loss[s]), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        out->norm[s] = single.last_norm;
        out->scale[s] = sc.scale;
    }
    out->n = tdm_model_param_elems(m);
    memcpy(out->params, tdm_model_params(m), (size_t)out->n * 4);
    tdm_single_free(&single);
    free(x);
    free(y);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
}

/* What the ranks report (MAP_SHARED). */
typedef struct lv_out {
    int status[TPP_MAX_RANKS];
    char err[TPP_MAX_RANKS][640];
    double loss[TPP_MAX_RANKS][STEPS], norm[TPP_MAX_RANKS][STEPS];
    float scale[TPP_MAX_RANKS][STEPS];
    int skipped[TPP_MAX_RANKS][STEPS];
    float params[TPP_MAX_ELEMS];      /* the stages' slices, at their whole-model offsets */
    float before[TPP_MAX_ELEMS];      /* the same, before the planted step */
    size_t peak_act[TPP_MAX_RANKS];
    size_t act_set[TPP_MAX_RANKS];    /* one micro-batch's activation set, the largest */
} lv_out;

typedef struct lv_arg {
    lv_out *out;
    tpp_kind kind;
    tdm_pp_schedule_kind sched;
    int B;
    levers lv;
    int inf_stage, inf_step;          /* inf_step > 0: the hook plants there */
} lv_arg;

static void plant_inf(void *ctx, tdm_model *m, int64_t step)
{
    const lv_arg *a = ctx;
    if (step != a->inf_step) return;
    float inf = INFINITY;
    tdm_dev_copy_from_host(tdm_model_device(m), tdm_model_grads(m), &inf, sizeof inf);
}

#define RFAIL(...)                                                                     \
    do {                                                                               \
        snprintf(a->out->err[r], sizeof a->out->err[r], __VA_ARGS__);                  \
        a->out->status[r] = 1;                                                         \
        rc = 1;                                                                        \
        goto done;                                                                     \
    } while (0)

static int lv_rank(tdm_comm *comm, void *argp)
{
    lv_arg *a = argp;
    int r = tdm_comm_rank(comm), rc = 0;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(a->kind, &spec);
    int in = tpp_in_features(&spec), rows = tpp_out_rows(&spec), classes = tpp_classes(&spec);
    void *x = malloc((size_t)a->B * (size_t)in * 4);
    int32_t *y = malloc((size_t)a->B * (size_t)rows * sizeof *y);
    tdm_grad_scaler sc;
    if (!x || !y) RFAIL("malloc");
    if (tdm_device_open(&dev, "cpu", r, 1)) RFAIL("device: %s", tdm_error_message());
    tdm_pp_opts o = {.schedule = a->sched, .micro_batches = M, .seed = TPP_SEED,
                     .optim = lv_optim(a->kind), .precision = a->lv.prec, .ckpt = a->lv.ckpt};
    if (tdm_pp_init(&p, comm, dev, &spec, &o)) RFAIL("init: %s", tdm_error_message());
    if (tdm_grad_scaler_init(&sc, NULL)) RFAIL("scaler: %s", tdm_error_message());
    tdm_pp_levers l = {.scaler = a->lv.fp16 ? &sc : NULL, .clip_norm = a->lv.clip,
                       .norm_counted = 1};
    if (a->inf_step > 0 && r == a->inf_stage) {
        l.after_backward = plant_inf;
        l.ctx = a;
    }
    tdm_pp_set_levers(p, &l);
    tdm_model *m = tdm_pp_model(p);
    tdm_model_stage_info si;
    tdm_model_get_stage(m, &si);
    for (int s = 0; s < STEPS; s++) {
        if (s + 1 == a->inf_step)
            memcpy(a->out->before + si.slice_offset, tdm_model_params(m),
                   (size_t)si.slice_elems * 4);
        tpp_batch(&spec, in, rows, classes, s, a->B, x, y);
        if (tdm_pp_step(p, x, y, a->B, &a->out->loss[r][s]))
            RFAIL("step %d: %s", s, tdm_error_message());
        tdm_pp_stats st;
        tdm_pp_get_stats(p, &st);
        a->out->norm[r][s] = st.last_norm;
        a->out->skipped[r][s] = st.last_skipped;
        a->out->scale[r][s] = sc.scale;
        if (s + 1 == a->inf_step &&
            memcmp(a->out->before + si.slice_offset, tdm_model_params(m),
                   (size_t)si.slice_elems * 4))
            RFAIL("stage %d: the skipped step %d changed its parameters", r, s + 1);
    }
    memcpy(a->out->params + si.slice_offset, tdm_model_params(m), (size_t)si.slice_elems * 4);
    tdm_pp_stats st;
    tdm_pp_get_stats(p, &st);
    a->out->peak_act[r] = st.peak_act;
    a->out->act_set[r] = st.act_set;
done:
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    return rc;
}

/* Runs S stages; returns the out area (the caller frees it). */
static lv_out *run_pp(tpp_kind k, int S, tdm_pp_schedule_kind sched, int B, const levers *lv,
                      int inf_stage, int inf_step)
{
    lv_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(o != MAP_FAILED);
    memset(o, 0, sizeof *o);
    lv_arg a = {.out = o, .kind = k, .sched = sched, .B = B, .lv = *lv,
                .inf_stage = inf_stage, .inf_step = inf_step};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(240000)};
    tdm_status st = tdm_shm_spawn(S, lv_rank, &a, &so, NULL);
    for (int r = 0; r < S; r++)
        cr_assert_eq(o->status[r], 0, "%s S=%d stage %d: %s", tpp_kind_name(k), S, r, o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s S=%d: %s", tpp_kind_name(k), S, tdm_error_message());
    return o;
}

static void lv_free(lv_out *o) { munmap(o, sizeof *o); }

static const char *lv_name(const levers *lv, char *buf, size_t n)
{
    snprintf(buf, n, "%s%s ckpt %d clip %g", tdm_precision_name(lv->prec),
             lv->fp16 ? " (scaled)" : "", lv->ckpt, lv->clip);
    return buf;
}

static void check_levers(tpp_kind k, const levers *lv, int S, tdm_pp_schedule_kind sched, int B)
{
    static ref rf;
    char name[96];
    lv_name(lv, name, sizeof name);
    reference(k, B, lv, &rf);
    lv_out *o = run_pp(k, S, sched, B, lv, -1, 0);
    int gpt = k == TPP_GPT;
    double pd = tpp_max_diff(o->params, rf.params, rf.n), ld = 0;
    for (int r = 0; r < S; r++)
        for (int s = 0; s < STEPS; s++) {
            double d = fabs(o->loss[r][s] - rf.loss[s]);
            if (d > ld) ld = d;
            cr_assert(gpt || o->loss[r][s] == rf.loss[s], "%s %s S=%d stage %d step %d: loss "
                      "%.17g, one device %.17g", tpp_kind_name(k), name, S, r, s + 1,
                      o->loss[r][s], rf.loss[s]);
            cr_assert_eq(o->scale[r][s], rf.scale[s], "%s %s: stage %d's loss scale at step %d",
                         tpp_kind_name(k), name, r, s + 1);
            if (lv->clip > 0)
                cr_assert(fabs(o->norm[r][s] - rf.norm[s]) <=
                              (gpt ? 1e-5 : NORM_RTOL) * rf.norm[s] && rf.norm[s] > lv->clip,
                          "%s %s S=%d stage %d step %d: norm %.17g, one device %.17g (clip %g)",
                          tpp_kind_name(k), name, S, r, s + 1, o->norm[r][s], rf.norm[s],
                          lv->clip);
        }
    if (gpt)
        cr_assert(getenv("TANDEM_TEST_MEASURE") || (pd <= GPT_PARAM_TOL && ld <= GPT_LOSS_TOL), "gpt %s S=%d: parameters within "
                  "%g, losses within %g of one device", name, S, pd, ld);
    else
        cr_assert(pd == 0, "%s %s S=%d %s B=%d: parameters differ from one device's by %g",
                  tpp_kind_name(k), name, S, tdm_pp_schedule_name(sched), B, pd);
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "%s %s S=%d: parameters within %g, losses within %g\n",
                tpp_kind_name(k), name, S, pd, ld);
    lv_free(o);
}

static void check_model(tpp_kind k, double clip)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    const levers cases[] = {
        {.prec = TDM_PRECISION_BF16},
        {.prec = TDM_PRECISION_FP16, .fp16 = 1},
        {.prec = TDM_PRECISION_FP32, .ckpt = 1},
        {.prec = TDM_PRECISION_FP32, .clip = clip},
        {.prec = TDM_PRECISION_BF16, .ckpt = 2, .clip = clip},
        {.prec = TDM_PRECISION_FP16, .fp16 = 1, .ckpt = 1, .clip = clip},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        check_levers(k, &cases[i], 2, i % 2 ? TDM_PP_GPIPE : TDM_PP_1F1B, 24);
        if (i >= 4) check_levers(k, &cases[i], 3, TDM_PP_1F1B, 26);
    }
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

TestSuite(pp_levers, .timeout = 600);

Test(pp_levers, mlp_equals_one_device_with_the_same_levers) { check_model(TPP_MLP, 0.05); }
Test(pp_levers, cnn_equals_one_device_with_the_same_levers) { check_model(TPP_CNN, 0.05); }
Test(pp_levers, gpt_equals_one_device_up_to_the_tied_embedding) { check_model(TPP_GPT, 0.1); }

/* Checkpointing recomputes each micro-batch's stage forward in its
 * backward: the same bits as without, and fewer activation bytes. */
Test(pp_levers, checkpointing_changes_no_bit)
{
    const tpp_kind kinds[] = {TPP_MLP, TPP_CNN, TPP_GPT};
    for (int i = 0; i < 3; i++)
        for (int prec = 0; prec < 2; prec++) {
            levers off = {.prec = prec ? TDM_PRECISION_BF16 : TDM_PRECISION_FP32};
            levers on = off;
            on.ckpt = 1;
            lv_out *a = run_pp(kinds[i], 2, TDM_PP_GPIPE, 24, &off, -1, 0);
            lv_out *b = run_pp(kinds[i], 2, TDM_PP_GPIPE, 24, &on, -1, 0);
            cr_assert(!memcmp(a->params, b->params, sizeof a->params) &&
                      !memcmp(a->loss, b->loss, sizeof a->loss),
                      "%s %s: checkpointing changed the run", tpp_kind_name(kinds[i]),
                      tdm_precision_name(off.prec));
            if (getenv("TANDEM_TEST_VERBOSE"))
                fprintf(stderr, "%s %s: activation sets %zu/%zu bytes without, %zu/%zu with\n",
                        tpp_kind_name(kinds[i]), tdm_precision_name(off.prec), a->act_set[0],
                        a->act_set[1], b->act_set[0], b->act_set[1]);
            /* the GPT's first stage holds its embeddings and a block: with
             * segments of 1 block a micro-batch keeps the block's input
             * and one recompute buffer */
            for (int r = 0; r < 2; r++)
                cr_assert(b->act_set[r] <= a->act_set[r], "%s stage %d: a set of %zu bytes "
                          "with checkpointing, %zu without", tpp_kind_name(kinds[i]), r,
                          b->act_set[r], a->act_set[r]);
            if (kinds[i] == TPP_GPT)
                cr_assert(b->act_set[0] < a->act_set[0], "gpt stage 0: no fewer bytes kept");
            lv_free(a);
            lv_free(b);
        }
}

/* An inf planted in stage 1's gradient at step 3 (after its backwards):
 * every stage skips step 3 (its parameters bitwise unchanged, checked by
 * the ranks) and halves the scale; the other steps are taken. */
Test(pp_levers, an_inf_in_one_stage_skips_the_step_on_every_stage)
{
    shm_t_adopt_orphans();
    levers lv = {.prec = TDM_PRECISION_FP16, .fp16 = 1, .clip = 0.05};
    for (int S = 2; S <= 3; S++) {
        lv_out *o = run_pp(TPP_MLP, S, TDM_PP_1F1B, 24, &lv, 1, 3);
        for (int r = 0; r < S; r++)
            for (int s = 0; s < STEPS; s++) {
                cr_assert_eq(o->skipped[r][s], s == 2, "S=%d stage %d step %d: skipped %d", S,
                             r, s + 1, o->skipped[r][s]);
                cr_assert_eq(o->scale[r][s], s < 2 ? 65536.0f : 32768.0f,
                             "S=%d stage %d step %d: scale %g", S, r, s + 1,
                             (double)o->scale[r][s]);
            }
        cr_assert(memcmp(o->params, o->before, sizeof o->params),
                  "the steps after the skipped one were not taken");
        lv_free(o);
    }
}

/* The levers' two all-reduces are labelled in the flight recorder of the
 * communicator they run on (here a job communicator of their own, split
 * after TANDEM_FR_DUMP is set, so that its recorder dumps when freed). */
static int fr_rank(tdm_comm *comm, void *argp)
{
    setenv("TANDEM_FR_DUMP", (const char *)argp, 1);
    unsetenv("TANDEM_FR_DUMP_ON");
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_comm *job = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    float x[8 * 20];
    int32_t y[8];
    tpp_batch(&spec, 20, 1, 5, 0, 8, x, y);
    tdm_pp_opts o = {.schedule = TDM_PP_GPIPE, .micro_batches = 2, .seed = TPP_SEED,
                     .optim = lv_optim(TPP_MLP), .precision = TDM_PRECISION_FP16};
    tdm_grad_scaler sc;
    tdm_status st = tdm_grad_scaler_init(&sc, NULL);
    if (!st) st = tdm_comm_split(comm, 0, r, &job);
    if (!st) st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    if (!st) {
        tdm_pp_levers l = {.scaler = &sc, .clip_norm = 0.05, .comm = job, .norm_counted = 1};
        tdm_pp_set_levers(p, &l);
        st = tdm_pp_step(p, x, y, 8, NULL);
    }
    tdm_pp_free(p);
    tdm_comm_free(job);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(pp_levers, the_levers_collectives_are_labelled_in_the_flight_recorder)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "tdm_pplv_fr");
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    cr_assert_eq(tdm_shm_spawn(2, fr_rank, dir, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    static char all[1 << 20];
    cr_assert_geq(tu_read_dir(dir, all, sizeof all), 0, "cannot read %s", dir);
    cr_assert(strstr(all, "grad scaler found inf"), "no found-inf all-reduce in %s", dir);
    cr_assert(strstr(all, "pp clip grad norm over every stage and replica"),
              "no norm all-reduce in %s", dir);
    tu_rmtree(dir);
}
