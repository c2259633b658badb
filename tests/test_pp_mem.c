/* tests/test_pp_mem.c: what a pipeline stage holds and does besides the
 * numbers of tests/test_pp.c: peak activation memory measured from each
 * stage's allocator (1F1B at most min(M, S - s) micro-batches' worth on
 * stage s - at most S - and GPipe all M, for S = 2..4 and M = 1..8);
 * transfers that run while a stage computes (the overlap test); phase
 * timings and trace events that add up; evaluation through the pipeline
 * equal to one device's; the whole model gathered from the stages;
 * receive buffers in the links' zero-copy memory (tdm_pp_opts.batch)
 * giving the same steps. */
#include <criterion/criterion.h>

#include "core/data.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/timeout_util.h"

/* --- memory ------------------------------------------------------------------ */

/* An MLP whose activations dwarf the rest: 64 -> 512 -> 512 -> 512 -> 10
 * on micro-batches of 16. */
static void mem_spec(tdm_model_spec *s) { tdm_model_spec_mlp(s, (int[]){64, 512, 512, 512, 10}, 5); }

typedef struct mem_arg {
    tpp_out *out;        /* stats per rank, one (schedule, M) at a time */
    int M;
    tdm_pp_schedule_kind sched;
} mem_arg;

static int mem_rank(tdm_comm *comm, void *argp)
{
    mem_arg *a = argp;
    int r = tdm_comm_rank(comm), rc = 0;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    mem_spec(&spec);
    int Bg = 16 * a->M;
    float *x = malloc((size_t)Bg * 64 * sizeof *x);
    int32_t *y = malloc((size_t)Bg * sizeof *y);
    tdm_pp_opts o = {.schedule = a->sched, .micro_batches = a->M, .seed = 1,
                     .optim = tpp_optim(TPP_MLP)};
    if (!x || !y || tdm_device_open(&dev, "cpu", r, 1) || tdm_pp_init(&p, comm, dev, &spec, &o)) {
        snprintf(a->out->err[r], sizeof a->out->err[r], "set-up: %s", tdm_error_message());
        rc = 1;
        goto done;
    }
    tpp_batch(&spec, 64, 1, 10, 0, Bg, x, y);
    if (tdm_pp_step(p, x, y, Bg, NULL) || tdm_pp_step(p, x, y, Bg, NULL)) {
        snprintf(a->out->err[r], sizeof a->out->err[r], "step: %s", tdm_error_message());
        rc = 2;
        goto done;
    }
    tdm_pp_get_stats(p, &a->out->stats[r]);
done:
    a->out->status[r] = rc;
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    return rc;
}

Test(pp_mem, one_f_one_b_holds_at_most_s_micro_batches_gpipe_all_m, .timeout = 300)
{
    for (int S = 2; S <= 4; S++)
        for (int M = 1; M <= TPP_MAX_M; M++) {
            size_t peak[2][TPP_MAX_RANKS];
            for (int k = 0; k < 2; k++) {
                tpp_out *o = tpp_out_new();
                mem_arg a = {.out = o, .M = M, .sched = (tdm_pp_schedule_kind)k};
                tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
                tdm_status st = tdm_shm_spawn(S, mem_rank, &a, &so, NULL);
                cr_assert_eq(st, TDM_STATUS_OK, "S=%d M=%d %s: %s / %s", S, M,
                             tdm_pp_schedule_name(a.sched), tdm_error_message(), o->err[0]);
                for (int s = 0; s < S; s++) {
                    const tdm_pp_stats *t = &o->stats[s];
                    int hold = k == TDM_PP_GPIPE ? M : (S - s < M ? S - s : M);
                    /* input slots: one more than the sets on stages that
                     * receive, at most M */
                    int ins = s == 0 ? 0 : hold + 1 < M ? hold + 1 : M;
                    size_t held = (size_t)hold * t->act_set + (size_t)ins * t->act_input;
                    cr_assert_neq(t->peak_act, (size_t)-1, "the host allocator keeps accounts");
                    cr_assert_gt(t->act_set, 0);
                    cr_assert_eq(t->act_sets, hold, "S=%d M=%d %s stage %d: %d sets",
                                 S, M, tdm_pp_schedule_name(a.sched), s, t->act_sets);
                    cr_assert_eq(t->act_inputs, ins);
                    /* 1F1B: at most min(M, S) micro-batches' worth (a set and
                     * an input each) on every stage */
                    if (k == TDM_PP_1F1B)
                        cr_assert_leq(held, (size_t)(M < S ? M : S) * (t->act_set + t->act_input));
                    /* never more than that measured (a failure here on 1F1B
                     * is a stage holding more than S micro-batches) */
                    cr_assert_leq(t->peak_act, t->act_scratch + held,
                                  "S=%d M=%d %s stage %d: peak %zu > scratch %zu + %zu", S, M,
                                  tdm_pp_schedule_name(a.sched), s, t->peak_act, t->act_scratch,
                                  held);
                    /* and every set was live at once */
                    cr_assert_geq(t->peak_act, (size_t)hold * t->act_set,
                                  "S=%d M=%d %s stage %d: peak %zu < %d x %zu", S, M,
                                  tdm_pp_schedule_name(a.sched), s, t->peak_act, hold, t->act_set);
                    peak[k][s] = t->peak_act;
                }
                tpp_out_free(o);
            }
            /* with more micro-batches than stages 1F1B's first stage holds
             * less than GPipe's */
            if (M > S) cr_assert_lt(peak[TDM_PP_1F1B][0], peak[TDM_PP_GPIPE][0], "S=%d M=%d", S, M);
        }
}

/* --- overlap, phases, trace ------------------------------------------------------ */

typedef struct ovl_arg {
    tpp_out *out;
    tdm_pp_schedule_kind sched;
} ovl_arg;

#define OVL_B 256
#define OVL_M 8

/* 256 -> 1024 -> 1024 -> 10 on micro-batches of 32: 128 KiB activations,
 * as long to send as a layer takes to compute. */
static int ovl_rank(tdm_comm *comm, void *argp)
{
    ovl_arg *a = argp;
    int r = tdm_comm_rank(comm), rc = 0;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tdm_model_spec_mlp(&spec, (int[]){256, 1024, 1024, 10}, 4);
    float *x = malloc((size_t)OVL_B * 256 * sizeof *x);
    int32_t *y = malloc((size_t)OVL_B * sizeof *y);
    tdm_pp_opts o = {.schedule = a->sched, .micro_batches = OVL_M, .seed = 1,
                     .optim = tpp_optim(TPP_MLP)};
    if (!x || !y || tdm_device_open(&dev, "cpu", r, 1) || tdm_pp_init(&p, comm, dev, &spec, &o)) {
        rc = 1;
        goto done;
    }
    tpp_batch(&spec, 256, 1, 10, 0, OVL_B, x, y);
    for (int s = 0; s < 3 && !rc; s++)
        if (tdm_pp_step(p, x, y, OVL_B, NULL)) rc = 2;
    if (rc) goto done;
    tdm_pp_get_stats(p, &a->out->stats[r]);
    /* the trace: one F and one B per micro-batch, in the schedule's order */
    const tdm_pp_event *ev;
    int n;
    tdm_pp_trace(p, &ev, &n);
    tdm_pp_schedule *s = NULL;
    if (n != 2 * OVL_M || tdm_pp_schedule_build(&s, a->sched, 2, OVL_M)) rc = 3;
    for (int i = 0; !rc && i < n; i++)
        if (ev[i].op != s->actions[r][i].op || ev[i].mb != s->actions[r][i].mb ||
            ev[i].t1_ns < ev[i].t0_ns || (i && ev[i].t0_ns < ev[i - 1].t1_ns))
            rc = 4;
    tdm_pp_schedule_free(s);
done:
    if (rc) snprintf(a->out->err[r], sizeof a->out->err[r], "rc %d: %s", rc, tdm_error_message());
    a->out->status[r] = rc;
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    return rc;
}

/* Fails if send/recv never runs while a stage computes: transfers that
 * were in flight when a forward or backward began and had completed by its
 * end are counted on each stage (a synchronous transfer is never in
 * flight at a compute's start). */
Test(pp_mem, transfers_run_while_stages_compute, .timeout = 120)
{
    for (int k = 0; k < 2; k++) {
        tpp_out *o = tpp_out_new();
        ovl_arg a = {.out = o, .sched = (tdm_pp_schedule_kind)k};
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
        tdm_status st = tdm_shm_spawn(2, ovl_rank, &a, &so, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%s: %s / %s / %s", tdm_pp_schedule_name(a.sched),
                     tdm_error_message(), o->err[0], o->err[1]);
        int64_t overlapped = o->stats[0].overlapped + o->stats[1].overlapped;
        if (getenv("TANDEM_TEST_VERBOSE"))
            fprintf(stderr, "%s: %lld of %lld transfers overlapped; bubble %.2f/%.2f ms\n",
                    tdm_pp_schedule_name(a.sched), (long long)overlapped,
                    (long long)(o->stats[0].transfers + o->stats[1].transfers),
                    o->stats[0].last.bubble, o->stats[0].last.pipeline);
        for (int q = 0; getenv("TANDEM_TEST_VERBOSE") && q < 2; q++)
            fprintf(stderr, "  stage %d: overlapped %lld F %.2f B %.2f recv %.2f send %.2f bubble %.2f\n", q,
                    (long long)o->stats[q].overlapped, o->stats[q].last.forward, o->stats[q].last.backward,
                    o->stats[q].last.recv_wait, o->stats[q].last.send_wait, o->stats[q].last.bubble);
        cr_assert_gt(overlapped, 0, "%s: no transfer ran while a stage computed (%lld "
                     "transfers)", tdm_pp_schedule_name(a.sched),
                     (long long)(o->stats[0].transfers + o->stats[1].transfers));
        for (int s = 0; s < 2; s++) {
            const tdm_pp_phases *ph = &o->stats[s].last;
            /* 3 steps x 8 micro-batches, each F and B sending or receiving */
            cr_assert_eq(o->stats[s].transfers, 3 * 2 * OVL_M);
            cr_assert_gt(ph->forward, 0);
            cr_assert_gt(ph->backward, 0);
            cr_assert_leq(ph->forward + ph->backward + ph->loss + ph->bubble, ph->pipeline + 1e-6);
            cr_assert_leq(ph->recv_wait + ph->send_wait, ph->bubble + 1e-3,
                          "stage %d: waits %.3f + %.3f ms outside the bubble %.3f ms", s,
                          ph->recv_wait, ph->send_wait, ph->bubble);
            cr_assert_leq(ph->pipeline + ph->tied + ph->step, ph->total + 1e-6);
            cr_assert_eq(o->stats[s].steps, 3);
        }
        /* the last stage computes the loss; the first never waits for an
         * activation */
        cr_assert_gt(o->stats[1].last.loss, 0);
        cr_assert_eq(o->stats[0].last.loss, 0);
        tpp_out_free(o);
    }
}

/* --- evaluation and gathering ---------------------------------------------------- */

typedef struct eval_arg {
    tpp_out *out;
    const tdm_dataset *data;
    int cnn;
} eval_arg;

#define EVAL_M 4
#define EVAL_MICRO 5

/* Trains 3 steps, evaluates the dataset in batches of M x 5 (micro-batches
 * of 5), gathers the whole model on stage 0. */
static int eval_rank(tdm_comm *comm, void *argp)
{
    eval_arg *a = argp;
    int r = tdm_comm_rank(comm), rc = 0;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(a->cnn ? TPP_CNN : TPP_MLP, &spec);
    if (!a->cnn) tdm_model_spec_mlp(&spec, (int[]){64, 24, 16, 12, 5}, 5);
    int feat = tpp_in_features(&spec);
    float *x = malloc((size_t)24 * feat * sizeof *x);
    int32_t *y = malloc(24 * sizeof *y);
    tdm_pp_opts o = {.schedule = TDM_PP_1F1B, .micro_batches = EVAL_M, .seed = TPP_SEED,
                     .optim = tpp_optim(TPP_MLP)};
    if (!x || !y || tdm_device_open(&dev, "cpu", r, 1) || tdm_pp_init(&p, comm, dev, &spec, &o)) {
        rc = 1;
        goto done;
    }
    for (int s = 0; s < 3 && !rc; s++) {
        int64_t idx[24];
        for (int i = 0; i < 24; i++) idx[i] = (s * 24 + i) % a->data->n;
        tdm_data_gather(a->data, idx, 24, x, y);
        if (tdm_pp_step(p, x, y, 24, &a->out->loss[s])) rc = 2;
    }
    double loss = 0, acc = 0;
    if (!rc && tdm_pp_evaluate(p, a->data, EVAL_M * EVAL_MICRO, &loss, &acc)) rc = 3;
    a->out->max_diff[r] = loss;
    a->out->loss_diff[r] = acc;
    if (!rc && tdm_pp_gather_params(p, r == 0 ? a->out->params : NULL, 0)) rc = 4;
done:
    if (rc) snprintf(a->out->err[r], sizeof a->out->err[r], "rc %d: %s", rc, tdm_error_message());
    a->out->status[r] = rc;
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    return rc;
}

static void check_eval(int cnn)
{
    tdm_dataset data;
    /* 60 samples of 1x8x8 in 5 classes: three evaluation batches of 20 */
    cr_assert_eq(tdm_data_synthetic(&data, 60, 1, 8, 8, 5, 77, 0), TDM_STATUS_OK);
    tdm_model_spec spec;
    tpp_spec(cnn ? TPP_CNN : TPP_MLP, &spec);
    if (!cnn) tdm_model_spec_mlp(&spec, (int[]){64, 24, 16, 12, 5}, 5);
    /* one device: the same 3 steps with accumulation over micro-batches of
     * 6, then evaluation in batches of 5 (the pipeline's micro-batches) */
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, TPP_SEED), TDM_STATUS_OK);
    tdm_optim_opts oo = tpp_optim(TPP_MLP);
    cr_assert_eq(tdm_optim_init(&opt, m, &oo), TDM_STATUS_OK);
    tdm_single single = {.model = m, .opt = opt};
    tdm_accum acc = {.ops = &tdm_accum_single_ops, .ctx = &single, .micro = 6,
                     .in_features = 64, .out_rows = 1};
    float x[24 * 64];
    int32_t y[24];
    double ref_loss[3];
    for (int s = 0; s < 3; s++) {
        int64_t idx[24];
        for (int i = 0; i < 24; i++) idx[i] = (s * 24 + i) % data.n;
        tdm_data_gather(&data, idx, 24, x, y);
        cr_assert_eq(tdm_accum_step(&acc, x, y, 24, &ref_loss[s]), TDM_STATUS_OK);
    }
    double ref_eval = 0, ref_acc = 0;
    cr_assert_eq(tdm_evaluate(m, &data, EVAL_MICRO, &ref_eval, &ref_acc), TDM_STATUS_OK);
    for (int S = 2; S <= 3; S++) {
        tpp_out *o = tpp_out_new();
        eval_arg a = {.out = o, .data = &data, .cnn = cnn};
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
        tdm_status st = tdm_shm_spawn(S, eval_rank, &a, &so, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "S=%d: %s / %s / %s", S, tdm_error_message(), o->err[0],
                     o->err[1]);
        for (int s = 0; s < 3; s++) cr_assert_eq(o->loss[s], ref_loss[s], "S=%d step %d", S, s);
        /* every stage reports one device's evaluation (its batches are the
         * pipeline's micro-batches: the same logits; the double sums of
         * their losses are grouped by evaluation batch there, so within
         * 1e-12) */
        for (int r = 0; r < S; r++) {
            cr_assert(fabs(o->max_diff[r] - ref_eval) <= 1e-12 * fabs(ref_eval),
                      "S=%d stage %d: eval loss %.17g vs %.17g", S, r, o->max_diff[r], ref_eval);
            cr_assert_eq(o->loss_diff[r], ref_acc, "S=%d stage %d: accuracy", S, r);
        }
        cr_assert(!memcmp(o->params, tdm_model_params(m), (size_t)tdm_model_param_elems(m) * 4),
                  "S=%d: the gathered model differs from one device's", S);
        tpp_out_free(o);
    }
    tdm_single_free(&single);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    tdm_data_free(&data);
}

Test(pp_mem, mlp_evaluation_and_gather_equal_one_device, .timeout = 120) { check_eval(0); }
Test(pp_mem, cnn_evaluation_and_gather_equal_one_device, .timeout = 120) { check_eval(1); }

/* --- zero-copy links ---------------------------------------------------------- */

#define ZB 24
#define ZSTEPS 4

typedef struct zc_arg {
    tpp_out *out;
    tdm_pp_schedule_kind sched;
} zc_arg;

static int zc_rank(tdm_comm *comm, void *argp)
{
    zc_arg *a = argp;
    int r = tdm_comm_rank(comm), rc = 0;
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    float x[ZB * 20];
    int32_t y[ZB];
    tdm_pp_opts o = {.schedule = a->sched, .micro_batches = 4, .seed = TPP_SEED,
                     .optim = tpp_optim(TPP_MLP), .batch = ZB};
    if (tdm_device_open(&dev, "cpu", r, 1) || tdm_pp_init(&p, comm, dev, &spec, &o)) rc = 1;
    for (int s = 0; !rc && s < ZSTEPS; s++) {
        tpp_batch(&spec, 20, 1, 5, s, ZB, x, y);
        if (tdm_pp_step(p, x, y, ZB, &a->out->loss[s])) rc = 2;
    }
    if (!rc) tdm_pp_get_stats(p, &a->out->stats[r]);
    if (rc) snprintf(a->out->err[r], sizeof a->out->err[r], "rc %d: %s", rc, tdm_error_message());
    a->out->status[r] = rc;
    tdm_pp_free(p);
    tdm_device_free(dev);
    return rc;
}

Test(pp_mem, zero_copy_links_give_the_same_steps, .timeout = 60)
{
    double ref[ZSTEPS];
    int64_t n = 0;
    cr_assert_eq(tpp_reference(TPP_MLP, 4, ZB, ZSTEPS, ref, NULL, NULL, &n), TDM_STATUS_OK);
    for (int k = 0; k < 2; k++) {
        tpp_out *o = tpp_out_new();
        zc_arg a = {.out = o, .sched = (tdm_pp_schedule_kind)k};
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
        tdm_status st = tdm_shm_spawn(3, zc_rank, &a, &so, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%s / %s", tdm_error_message(), o->err[1]);
        for (int s = 0; s < ZSTEPS; s++) cr_assert_eq(o->loss[s], ref[s], "step %d", s);
        for (int r = 0; r < 3; r++)
            cr_assert(o->stats[r].zero_copy, "stage %d kept its receive buffers private", r);
        tpp_out_free(o);
    }
}
