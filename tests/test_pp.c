/* tests/test_pp.c: pipeline parallelism (pp/) against one device with
 * gradient accumulation over the same micro-batches (models/accum.h): for
 * S = 2..4 stages (forked ranks over shm), M = 1..8 micro-batches of a
 * global batch of 56 (every M cuts it into M micro-batches, the last
 * shorter for M = 3, 5, 6), GPipe and 1F1B, the MLP, a CNN (batchnorm)
 * and a GPT: the loss of every step and the parameters after 1 and after
 * 30 steps.
 *
 * MLP and CNN: bit for bit (the micro-batches, the kernels and the order
 * in which their gradients add are one device's). GPT: the token
 * embedding's gradient is the first stage's share plus the last stage's
 * (Megatron's tied embeddings), where one device adds them micro-batch
 * by micro-batch: the same terms in another order, so wte's gradient
 * differs by rounding (7.5e-9 in tests/test_model_stage.c) and the rest
 * follows through the steps. Measured over every case below: parameters
 * within 2.5e-6 after 30 AdamW steps (lr 3e-3), losses within 2.8e-8.
 * The bounds checked are 1e-4 and 1e-5: the rounding, not a different
 * step (a wrong step moves parameters by ~lr). The two copies of wte stay
 * bitwise equal.
 */
#include <criterion/criterion.h>

#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/timeout_util.h"

#define B 56
#define STEPS 30
#define GPT_PARAM_TOL 1e-4
#define GPT_LOSS_TOL 1e-5

/* The references, computed in the parent before the ranks fork. */
typedef struct refs {
    tpp_kind kind;
    int64_t n;
    double loss[TPP_MAX_M + 1][STEPS];
    float *p1[TPP_MAX_M + 1], *pn[TPP_MAX_M + 1];
} refs;

static refs g_ref;

static void refs_make(tpp_kind k)
{
    g_ref.kind = k;
    for (int M = 1; M <= TPP_MAX_M; M++) {
        g_ref.p1[M] = malloc(TPP_MAX_ELEMS * sizeof(float));
        g_ref.pn[M] = malloc(TPP_MAX_ELEMS * sizeof(float));
        cr_assert(g_ref.p1[M] && g_ref.pn[M]);
        cr_assert_eq(tpp_reference(k, M, B, STEPS, g_ref.loss[M], g_ref.p1[M], g_ref.pn[M],
                                   &g_ref.n),
                     TDM_STATUS_OK, "%s", tdm_error_message());
    }
}

static void refs_free(void)
{
    for (int M = 1; M <= TPP_MAX_M; M++) {
        free(g_ref.p1[M]);
        free(g_ref.pn[M]);
    }
}

typedef struct train_arg {
    tpp_out *out;
} train_arg;

#define RFAIL(...)                                                                     \
    do {                                                                               \
        snprintf(a->out->err[r], sizeof a->out->err[r], __VA_ARGS__);                  \
        a->out->status[r] = 1;                                                         \
        rc = 1;                                                                        \
        goto done;                                                                     \
    } while (0)

/* Compares this stage's slice (and tied copy) with the reference. Returns
 * the largest difference; *where the first index of the slice that
 * differs (-1: none). */
static double slice_diff(tdm_pp *p, const float *ref, int64_t *where)
{
    tdm_model *m = tdm_pp_model(p);
    tdm_model_stage_info si;
    tdm_model_get_stage(m, &si);
    const float *mine = tdm_model_params(m);
    double worst = tpp_max_diff(mine, ref + si.slice_offset, si.slice_elems);
    *where = -1;
    for (int64_t i = 0; i < si.slice_elems; i++)
        if (memcmp(&mine[i], &ref[si.slice_offset + i], 4)) {
            *where = i;
            break;
        }
    if (si.tied_param >= 0) {
        const tdm_tensor_info *t = tdm_model_param_info(m, si.tied_param);
        double d = tpp_max_diff(mine + t->offset, ref, t->n_elem);
        if (d > worst) worst = d;
    }
    return worst;
}

static int train_rank(tdm_comm *comm, void *argp)
{
    train_arg *a = argp;
    int r = tdm_comm_rank(comm), S = tdm_comm_size(comm), rc = 0;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(g_ref.kind, &spec);
    int gpt = g_ref.kind == TPP_GPT;
    void *x = NULL;
    int32_t *y = NULL;
    if (tdm_device_open(&dev, "cpu", r, 1)) RFAIL("device: %s", tdm_error_message());
    for (int sched = 0; sched < TDM_PP_SCHEDULE_COUNT_; sched++)
        for (int M = 1; M <= TPP_MAX_M; M++) {
            tdm_pp_opts o = {.schedule = (tdm_pp_schedule_kind)sched, .micro_batches = M,
                             .seed = TPP_SEED, .optim = tpp_optim(g_ref.kind)};
            const char *sn = tdm_pp_schedule_name(o.schedule);
            if (tdm_pp_init(&p, comm, dev, &spec, &o))
                RFAIL("%s M=%d: init: %s", sn, M, tdm_error_message());
            tdm_model *m = tdm_pp_model(p);
            int in = tpp_in_features(&spec), rows = tpp_out_rows(&spec);
            int classes = tpp_classes(&spec);
            if (!x) x = malloc((size_t)B * (size_t)in * 4);
            if (!y) y = malloc((size_t)B * (size_t)rows * sizeof *y);
            for (int s = 0; s < STEPS; s++) {
                double loss;
                tpp_batch(&spec, in, rows, classes, s, B, x, y);
                if (tdm_pp_step(p, x, y, B, &loss))
                    RFAIL("%s M=%d step %d: %s", sn, M, s, tdm_error_message());
                double ld = fabs(loss - g_ref.loss[M][s]);
                if (ld > a->out->loss_diff[r]) a->out->loss_diff[r] = ld;
                if (!gpt && loss != g_ref.loss[M][s])
                    RFAIL("%s M=%d step %d: loss %.17g, one device %.17g", sn, M, s, loss,
                          g_ref.loss[M][s]);
                if (s == 0 || s == STEPS - 1) {
                    int64_t at;
                    double d = slice_diff(p, s == 0 ? g_ref.p1[M] : g_ref.pn[M], &at);
                    if (d > a->out->max_diff[r]) a->out->max_diff[r] = d;
                    if (!gpt && at >= 0) {
                        tdm_model_stage_info si;
                        tdm_model_get_stage(m, &si);
                        RFAIL("%s M=%d after %d step(s): stage %d parameter %lld (whole model "
                              "%lld) is %.9g, one device %.9g", sn, M, s + 1, r, (long long)at,
                              (long long)(si.slice_offset + at), tdm_model_params(m)[at],
                              (s == 0 ? g_ref.p1[M] : g_ref.pn[M])[si.slice_offset + at]);
                    }
                }
            }
            /* the two copies of the GPT's wte are one */
            if (gpt) {
                tdm_model_stage_info si;
                tdm_model_get_stage(m, &si);
                const tdm_tensor_info *t = tdm_model_param_info(m, r == 0 ? 0 : si.tied_param);
                if (r == 0) memcpy(a->out->params, tdm_model_params(m), (size_t)t->n_elem * 4);
                if (tdm_comm_barrier(comm)) RFAIL("barrier: %s", tdm_error_message());
                if (r == S - 1 &&
                    memcmp(a->out->params, tdm_model_params(m) + t->offset, (size_t)t->n_elem * 4))
                    RFAIL("%s M=%d: the last stage's wte copy differs from the first's", sn, M);
                if (tdm_comm_barrier(comm)) RFAIL("barrier: %s", tdm_error_message());
            }
            tdm_pp_get_stats(p, &a->out->stats[r]);
            tdm_pp_free(p);
            p = NULL;
        }
done:
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    return rc;
}

static void check_model(tpp_kind k)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    refs_make(k);
    for (int S = 2; S <= 4; S++) {
        tpp_out *o = tpp_out_new();
        cr_assert(o);
        train_arg a = {.out = o};
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(240000)};
        tdm_status st = tdm_shm_spawn(S, train_rank, &a, &so, NULL);
        for (int r = 0; r < S; r++)
            cr_assert_eq(o->status[r], 0, "%s S=%d stage %d: %s", tpp_kind_name(k), S, r,
                         o->err[r]);
        cr_assert_eq(st, TDM_STATUS_OK, "%s S=%d: %s", tpp_kind_name(k), S, tdm_error_message());
        double pd = 0, ld = 0;
        for (int r = 0; r < S; r++) {
            if (o->max_diff[r] > pd) pd = o->max_diff[r];
            if (o->loss_diff[r] > ld) ld = o->loss_diff[r];
        }
        if (k == TPP_GPT) {
            cr_assert(pd <= GPT_PARAM_TOL && ld <= GPT_LOSS_TOL,
                      "gpt S=%d: parameters within %g, losses within %g of one device", S, pd, ld);
            cr_assert(pd > 0, "gpt S=%d: bitwise: the stated rounding no longer happens; "
                      "tighten this test", S);
        } else {
            cr_assert(pd == 0 && ld == 0);
        }
        if (getenv("TANDEM_TEST_VERBOSE"))
            fprintf(stderr, "%s S=%d: parameters within %g, losses within %g\n", tpp_kind_name(k),
                    S, pd, ld);
        tpp_out_free(o);
    }
    refs_free();
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

TestSuite(pp, .timeout = 600);

Test(pp, mlp_equals_one_device_with_accumulation) { check_model(TPP_MLP); }
Test(pp, cnn_equals_one_device_with_accumulation) { check_model(TPP_CNN); }
Test(pp, gpt_equals_one_device_up_to_the_tied_embedding) { check_model(TPP_GPT); }
