/* tests/test_model_stage.c: stage models (models/stage.h) against the whole
 * model, for the MLP, a CNN and a GPT, over every way of cutting them into
 * 2..4 stages: each stage's parameters are the whole model's slice (and
 * the GPT's tied copy is wte); the stages chained forward give the whole
 * model's logits bit for bit; backward from the same logits' gradient
 * gives each stage the whole model's gradient slice bit for bit (the
 * GPT's wte: the first stage's share plus the last stage's, within the
 * rounding of the other summation order, stated below); several
 * micro-batches kept in activation sets and gone back through in order
 * accumulate what the whole model accumulates micro-batch by micro-batch,
 * bit for bit. Also: layer counts and costs, bad ranges, set memory. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/rng.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/stage.h"

#define MAXS 4

static tdm_device *g_dev;

static void setup(void) { cr_assert_eq(tdm_device_open(&g_dev, "cpu", 0, 1), TDM_STATUS_OK); }
static void teardown(void) { tdm_device_free(g_dev); }

TestSuite(model_stage, .init = setup, .fini = teardown, .timeout = 120);

static void spec_of(int kind, tdm_model_spec *s)
{
    if (kind == 0) {
        tdm_model_spec_mlp(s, (int[]){20, 16, 12, 8, 5}, 5);
    } else if (kind == 1) {
        tdm_model_spec_cnn(s);
        s->in_c = 1;
        s->in_h = s->in_w = 8;
        s->ch1 = 4;
        s->ch2 = 6;
        s->fc_hidden = 8;
        s->n_classes = 5;
    } else {
        tdm_model_spec_gpt(s, 3, 16, 2, 8);
    }
}

/* Inputs and targets for `batch` samples of spec. */
static void data_of(const tdm_model_spec *s, int batch, uint64_t seed, void *x, int32_t *y,
                    int in, int rows, int classes)
{
    tdm_rng r;
    tdm_rng_init(&r, seed, 7);
    for (int i = 0; i < batch * in; i++) {
        if (s->kind == TDM_MODEL_GPT) ((int32_t *)x)[i] = (int32_t)(tdm_rng_u64(&r) % 256);
        else ((float *)x)[i] = tdm_rng_normal(&r);
    }
    for (int i = 0; i < batch * rows; i++) y[i] = (int32_t)(tdm_rng_u64(&r) % (uint64_t)classes);
}

/* Every cut of n layers into S non-empty runs: first[0] = 0 < ... < n. */
static int next_cut(int *first, int S, int n)
{
    for (int i = S - 1; i >= 1; i--) {
        if (first[i] + 1 <= n - (S - i)) {
            first[i]++;
            for (int j = i + 1; j < S; j++) first[j] = first[j - 1] + 1;
            return 1;
        }
    }
    return 0;
}

/* The largest |a - b| over n floats. */
static double max_diff(const float *a, const float *b, int64_t n)
{
    double w = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > w) w = d;
    }
    return w;
}

/* Checks one cut of spec into S stages over `micro` micro-batches of B
 * samples (each in its own activation set, backward in order after all
 * forwards, as GPipe runs them) against the whole model running
 * forward/backward per micro-batch. */
static void check_cut(const tdm_model_spec *spec, const int *first, int S, int n, int micro,
                      int B)
{
    tdm_model *full = NULL, *st[MAXS] = {0};
    cr_assert_eq(tdm_model_init(&full, g_dev, spec, 11), TDM_STATUS_OK, "%s", tdm_error_message());
    for (int s = 0; s < S; s++)
        cr_assert_eq(tdm_model_init_stage(&st[s], g_dev, spec, 11, first[s],
                                          s + 1 < S ? first[s + 1] : n),
                     TDM_STATUS_OK, "%s", tdm_error_message());
    int in = tdm_model_in_features(full), rows = tdm_model_out_rows(full);
    int C = tdm_model_n_classes(full);
    int gpt = spec->kind == TDM_MODEL_GPT;
    char cut[64];
    int o = 0;
    for (int s = 0; s < S; s++) o += snprintf(cut + o, sizeof cut - (size_t)o, "%d,", first[s]);

    /* parameters: slices of the whole model's */
    const float *fp = tdm_model_params(full);
    int64_t total = 0;
    for (int s = 0; s < S; s++) {
        tdm_model_stage_info si;
        tdm_model_get_stage(st[s], &si);
        cr_assert(!memcmp(tdm_model_params(st[s]), fp + si.slice_offset,
                          (size_t)si.slice_elems * 4), "cut %s stage %d: parameters", cut, s);
        total += si.slice_elems;
        cr_assert_eq(si.is_first, s == 0);
        cr_assert_eq(si.is_last, s == S - 1);
        if (si.tied_param >= 0) {
            const tdm_tensor_info *t = tdm_model_param_info(st[s], si.tied_param);
            cr_assert(gpt && s == S - 1 && S > 1);
            cr_assert(!memcmp(tdm_model_params(st[s]) + t->offset, fp, (size_t)t->n_elem * 4));
        }
    }
    cr_assert_eq(total, tdm_model_param_elems(full), "cut %s: slices cover the model", cut);

    /* micro-batches: the whole model, one after the other */
    size_t xb = (size_t)B * (size_t)in * 4;
    char *x = malloc(xb * (size_t)micro);
    int32_t *y = malloc((size_t)B * (size_t)rows * (size_t)micro * sizeof *y);
    float *dl = malloc((size_t)B * (size_t)rows * (size_t)C * 4);
    float *ref_logits = malloc((size_t)B * (size_t)rows * (size_t)C * 4 * (size_t)micro);
    cr_assert(x && y && dl && ref_logits);
    data_of(spec, B * micro, 3, x, y, in, rows, C);
    cr_assert_eq(tdm_model_zero_grad(full), TDM_STATUS_OK);
    for (int k = 0; k < micro; k++) {
        const float *lg;
        double ls;
        cr_assert_eq(tdm_model_forward(full, x + (size_t)k * xb, B, &lg), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        memcpy(ref_logits + (size_t)k * B * rows * C, lg, (size_t)B * rows * C * 4);
        cr_assert_eq(tdm_model_loss(full, lg, y + (size_t)k * B * rows, B, 1.0f / (B * micro),
                                    &ls, tdm_model_loss_grad(full)), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_backward(full, tdm_model_loss_grad(full)), TDM_STATUS_OK);
    }

    /* the stages: every forward (set k), then every backward in order */
    for (int s = 0; s < S; s++) cr_assert_eq(tdm_model_zero_grad(st[s]), TDM_STATUS_OK);
    for (int k = 0; k < micro; k++) {
        const void *cur = x + (size_t)k * xb;
        for (int s = 0; s < S; s++) {
            const float *out;
            cr_assert_eq(tdm_model_select_act_set(st[s], k), TDM_STATUS_OK);
            cr_assert_eq(tdm_model_stage_forward(st[s], cur, B, &out), TDM_STATUS_OK, "%s",
                         tdm_error_message());
            cur = out;
        }
        cr_assert(!memcmp(cur, ref_logits + (size_t)k * B * rows * C, (size_t)B * rows * C * 4),
                  "cut %s micro-batch %d: logits differ", cut, k);
    }
    for (int k = 0; k < micro; k++) {
        tdm_model *last = st[S - 1];
        cr_assert_eq(tdm_model_select_act_set(last, k), TDM_STATUS_OK);
        const float *lg = ref_logits + (size_t)k * B * rows * C;
        double ls;
        cr_assert_eq(tdm_model_loss(last, lg, y + (size_t)k * B * rows, B, 1.0f / (B * micro),
                                    &ls, dl), TDM_STATUS_OK);
        const float *dy = dl;
        for (int s = S - 1; s >= 0; s--) {
            const float *dx;
            cr_assert_eq(tdm_model_select_act_set(st[s], k), TDM_STATUS_OK);
            cr_assert_eq(tdm_model_stage_backward(st[s], dy, &dx), TDM_STATUS_OK, "%s",
                         tdm_error_message());
            cr_assert_eq(dx == NULL, s == 0);
            dy = dx;
        }
    }
    const float *fg = tdm_model_grads(full);
    for (int s = 0; s < S; s++) {
        tdm_model_stage_info si;
        tdm_model_get_stage(st[s], &si);
        const float *sg = tdm_model_grads(st[s]);
        int64_t skip0 = 0, skip1 = 0;
        if (gpt && s == 0 && S > 1) {
            /* wte: below */
            const tdm_tensor_info *t = tdm_model_param_info(st[0], 0);
            skip0 = t->offset;
            skip1 = t->offset + t->n_elem;
        }
        cr_assert(!memcmp(sg, fg + si.slice_offset, (size_t)skip0 * 4) &&
                      !memcmp(sg + skip1, fg + si.slice_offset + skip1,
                              (size_t)(si.slice_elems - skip1) * 4),
                  "cut %s stage %d: gradients differ", cut, s);
    }
    if (gpt && S > 1) {
        /* wte's gradient: the whole model adds the head's share, then the
         * embedding's rows, micro-batch after micro-batch; the stages
         * hold the embedding's rows (first) and the head's (last) of all
         * micro-batches apart, summed as first + last: the same terms in
         * another order, so equal up to rounding of sums of O(1e-3)
         * terms (7.5e-9 measured here): |diff| <= 1e-6 */
        tdm_model_stage_info si;
        tdm_model_get_stage(st[S - 1], &si);
        const tdm_tensor_info *t = tdm_model_param_info(st[S - 1], si.tied_param);
        float *sum = malloc((size_t)t->n_elem * 4);
        for (int64_t i = 0; i < t->n_elem; i++)
            sum[i] = tdm_model_grads(st[0])[i] + tdm_model_grads(st[S - 1])[t->offset + i];
        double d = max_diff(sum, fg, t->n_elem);
        cr_assert(d <= 1e-6, "cut %s: wte gradient differs by %g", cut, d);
        free(sum);
    }
    free(x);
    free(y);
    free(dl);
    free(ref_logits);
    for (int s = 0; s < S; s++) tdm_model_free(st[s]);
    tdm_model_free(full);
}

static void check_all_cuts(int kind, int micro, int B)
{
    tdm_model_spec spec;
    spec_of(kind, &spec);
    int n = 0;
    cr_assert_eq(tdm_model_spec_n_layers(&spec, &n), TDM_STATUS_OK);
    for (int S = 2; S <= MAXS && S <= n; S++) {
        int first[MAXS];
        for (int s = 0; s < S; s++) first[s] = s;
        do check_cut(&spec, first, S, n, micro, B);
        while (next_cut(first, S, n));
    }
}

Test(model_stage, mlp_every_cut_equals_the_whole_model) { check_all_cuts(0, 3, 4); }
Test(model_stage, cnn_every_cut_equals_the_whole_model) { check_all_cuts(1, 3, 3); }
Test(model_stage, gpt_every_cut_equals_the_whole_model) { check_all_cuts(2, 2, 2); }

Test(model_stage, layer_counts_and_costs)
{
    static const int want[3] = {4, 9, 5};
    for (int kind = 0; kind < 3; kind++) {
        tdm_model_spec spec;
        spec_of(kind, &spec);
        int n = 0;
        cr_assert_eq(tdm_model_spec_n_layers(&spec, &n), TDM_STATUS_OK);
        cr_assert_eq(n, want[kind]);
        tdm_model_layer_cost c[16];
        cr_assert_eq(tdm_model_spec_layer_costs(&spec, c, n), TDM_STATUS_OK);
        tdm_model *m = NULL;
        cr_assert_eq(tdm_model_init(&m, g_dev, &spec, 1), TDM_STATUS_OK);
        int64_t sum = 0;
        double flops = 0;
        for (int i = 0; i < n; i++) {
            sum += c[i].param_elems;
            flops += c[i].flops;
        }
        cr_assert_eq(sum, tdm_model_param_elems(m), "kind %d", kind);
        double f, b;
        tdm_model_gemm_flops(m, &f, &b);
        /* the costs count forward + backward as 3 forwards; the model's
         * backward skips the first layer's input gradient */
        cr_assert(flops >= f + b - 1e-9 && flops <= 3.0 * f + 1e-9, "kind %d: %g vs %g + %g",
                  kind, flops, f, b);
        tdm_model_free(m);
        cr_assert_eq(tdm_model_spec_layer_costs(&spec, c, n + 1), TDM_STATUS_INVALID_ARG);
    }
    /* the MLP: layer i has its weight and bias */
    tdm_model_spec s;
    spec_of(0, &s);
    tdm_model_layer_cost c[4];
    cr_assert_eq(tdm_model_spec_layer_costs(&s, c, 4), TDM_STATUS_OK);
    cr_assert_eq(c[0].param_elems, 16 * 20 + 16);
    cr_assert(fabs(c[3].flops - 6.0 * 8 * 5) < 1e-9);
}

Test(model_stage, bad_ranges_are_refused)
{
    tdm_model_spec spec;
    spec_of(0, &spec);
    tdm_model *m = NULL;
    static const int bad[][2] = {{-1, 2}, {2, 2}, {3, 1}, {0, 5}, {4, 5}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(tdm_model_init_stage(&m, g_dev, &spec, 1, bad[i][0], bad[i][1]),
                     TDM_STATUS_INVALID_ARG, "[%d, %d)", bad[i][0], bad[i][1]);
        cr_assert_null(m);
    }
}

/* Each activation set holds its own forward: bytes grow by one set's
 * worth per set used, and sets come back as they were left. */
Test(model_stage, activation_sets_hold_their_own_forwards)
{
    for (int kind = 0; kind < 3; kind++) {
        tdm_model_spec spec;
        spec_of(kind, &spec);
        tdm_model *m = NULL;
        cr_assert_eq(tdm_model_init_stage(&m, g_dev, &spec, 1, 1, 3), TDM_STATUS_OK);
        int64_t in = tdm_model_stage_in_elems(m), out = tdm_model_stage_out_elems(m);
        float *x = calloc((size_t)(4 * in), 4);
        float *keep = malloc((size_t)(4 * out) * 4);
        for (int64_t i = 0; i < 4 * in; i++) x[i] = (float)(i % 7) * 0.1f;
        size_t sets, scratch, one = 0;
        const float *y, *y0 = NULL;
        for (int k = 0; k < 3; k++) {
            cr_assert_eq(tdm_model_select_act_set(m, k), TDM_STATUS_OK);
            cr_assert_eq(tdm_model_stage_forward(m, x, 4, &y), TDM_STATUS_OK, "%s",
                         tdm_error_message());
            if (k == 0) {
                memcpy(keep, y, (size_t)(4 * out) * 4);
                y0 = y;
            }
            tdm_model_act_bytes(m, &sets, &scratch);
            if (k == 0) one = sets;
            cr_assert_eq(sets, (size_t)(k + 1) * one, "kind %d set %d", kind, k);
            x[0] += 1.0f;   /* the next forward differs */
        }
        cr_assert_gt(one, 0);
        cr_assert_eq(tdm_model_select_act_set(m, 0), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_act_set(m), 0);
        tdm_model_stage_info si;
        tdm_model_get_stage(m, &si);
        cr_assert(si.lo == 1 && si.hi == 3 && !si.is_first);
        /* set 0's output is still its forward's: the others wrote elsewhere */
        cr_assert(!memcmp(y0, keep, (size_t)(4 * out) * 4), "kind %d: set 0 overwritten", kind);
        cr_assert_eq(tdm_model_select_act_set(m, TDM_MODEL_MAX_ACT_SETS), TDM_STATUS_INVALID_ARG);
        tdm_model_memory mem;
        tdm_model_get_memory(m, &mem);
        cr_assert_eq(mem.activations, 3 * one + scratch);
        free(x);
        free(keep);
        tdm_model_free(m);
    }
}
