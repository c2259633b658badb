/* tools/compare_tp.c: `tandem compare --modes ...,tp`: tensor
 * parallelism's section. The MLP (column/row-parallel pairs) or the GPT
 * (attention split by heads) split over the N devices (tp/tp.h, through tools/rank_tp.c's table
 * over dist/run.h: forked ranks) runs the same global batches from the
 * same initial parameters; each rank writes what it measured into one
 * shared anonymous mapping: its step times and phases (forward, the
 * forward all-reduces, loss, backward, the backward all-reduces, the
 * optimizer), its memory and the bytes its communicator counted; rank 0
 * the loss and the whole model's final parameters. Printed: the
 * throughput beside one device's (and DDP's), the phase table with the
 * tensor-parallel all-reduces as phases of their own (exposed: nothing
 * overlaps them), the equivalence verdict against one host device within
 * compare's bound after the last step, memory per rank, the all-reduce
 * payload handed to the communicator per step against the plan's and
 * what a ring algorithm sends for it (tdm_comm_traffic_ring_sent), and
 * the reading. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "dist/batch.h"
#include "models/optim.h"
#include "tools/compare.h"
#include "tools/compare_mesh.h"
#include "tools/ranks.h"
#include "tp/tp.h"

/* Row-parallel sums add in another order than one device's gemm, and
 * SGD carries the rounding on: the verdict is compare's bound after the
 * last step (tdm_cmp_mesh_within). On Fashion-MNIST's default MLP one
 * device started one ulp off ends 2.5e-5 away after 4 steps, and TP(2)
 * as far. */
/* forward, fwd all-reduce, loss, backward, bwd all-reduce, optimizer, and
 * with replicas the gradients' sum over the dp dimension */
#define TDM_CMP_TP_PHASES 7

typedef struct tdm_cmp_tp_shared {
    int N, steps;                        /* N: every rank (D * T) */
    int D, T;                            /* replicas (--mesh dp=D,tp=T) and the group's size */
    int sp;                              /* sequence parallelism (tp-sp) */
    int64_t param_elems;
    double mem[TDM_CMP_MAX_DEV][4];      /* params, grads, optimizer, activations */
    double split[TDM_CMP_MAX_DEV][2];    /* split elements, one device's */
    double bytes[TDM_CMP_MAX_DEV];       /* all-reduce (and, tp-sp, reduce-scatter and
                                            all-gather) payload bytes over the steps */
    double sent[TDM_CMP_MAX_DEV];        /* what a ring sends for them (ring_sent) */
    double calls[TDM_CMP_MAX_DEV];
    size_t off_loss, off_step, off_phase, off_params, total;
} tdm_cmp_tp_shared;


typedef struct tdm_cmp_tp_run {
    const tdm_cmp_opts *o;
    const tdm_cmp_data *data;
    tdm_cmp_tp_shared *sh;
} tdm_cmp_tp_run;

/* ---- a rank ---- */

static tdm_status tdm_cmp_tp_rank_run(void *ctx, tdm_dist_rank *d, void *self)
{
    const tdm_tool_build *b = ctx;
    const tdm_cmp_tp_run *c = b->tool;
    tdm_cmp_tp_shared *sh = c->sh;
    tdm_tool_rank *r = self;
    tdm_dist_stepper s = {.w = r->w, .opt = r->opt, .comm = d->comm, .rank = r->rank,
                          .world = r->world, .global_batch = c->o->batch};
    int k = r->rank, B = c->o->batch;
    float *x = NULL;
    int32_t *y = NULL;
    char who[32];
    snprintf(who, sizeof who, "tp rank %d", k);
    tdm_status st = tdm_cmp_batch_new(c->data, B, who, &x, &y);
    tdm_comm *tc = tdm_mesh_comm(d->mesh, TDM_MESH_TP);
    tdm_comm_traffic t0, t1;
    tdm_comm_traffic_get(tc, &t0);
    tdm_tp_stats prev = {0};
    for (int i = 0; st == TDM_STATUS_OK && i < sh->steps; i++) {
        tdm_cmp_rows(c->data, i, B, 0, B, x, y);
        double loss = 0.0;
        uint64_t a = tdm_time_ns();
        st = b->design->step(&s, x, y, B, &loss);
        uint64_t e = tdm_time_ns();
        if (st) break;
        size_t at = (size_t)i * (size_t)sh->N + (size_t)k;
        if (k == 0) TDM_CMP_SHARED_AT(sh, off_loss, double)[i] = loss;
        TDM_CMP_SHARED_AT(sh, off_step, double)[at] = (double)(e - a) * 1e-6;
        tdm_tp_stats ts;
        tdm_tool_tp_stats(r, &ts);
        double v[TDM_CMP_TP_PHASES] = {
            ts.sum.forward - prev.sum.forward, ts.sum.fwd_allreduce - prev.sum.fwd_allreduce,
            ts.sum.loss - prev.sum.loss, ts.sum.backward - prev.sum.backward,
            ts.sum.bwd_allreduce - prev.sum.bwd_allreduce, ts.sum.step - prev.sum.step,
            ts.sum.grad_sync - prev.sum.grad_sync};
        memcpy(TDM_CMP_SHARED_AT(sh, off_phase, double) + at * TDM_CMP_TP_PHASES, v, sizeof v);
        prev = ts;
    }
    tdm_comm_traffic_get(tc, &t1);
    if (st == TDM_STATUS_OK)
        st = b->design->params(r, k == 0 ? TDM_CMP_SHARED_AT(sh, off_params, float) : NULL, 0);
    if (st == TDM_STATUS_OK) {
        tdm_tp_stats ts;
        tdm_tool_tp_stats(r, &ts);
        double m[4] = {(double)ts.params, (double)ts.grads, (double)ts.optimizer,
                       (double)ts.activations};
        memcpy(sh->mem[k], m, sizeof m);
        sh->split[k][0] = (double)ts.split_elems;
        sh->split[k][1] = (double)ts.whole_split_elems;
        /* all-reduces, and (sequence parallel) reduce-scatters and
         * all-gathers */
        tdm_comm_traffic ar = {0};
        sh->bytes[k] = sh->calls[k] = 0;
        for (int kind = 0; kind < TDM_COLL_COUNT_; kind++) {
            if (kind != TDM_COLL_ALL_REDUCE && kind != TDM_COLL_REDUCE_SCATTER &&
                kind != TDM_COLL_ALL_GATHER)
                continue;
            ar.bytes[kind] = t1.bytes[kind] - t0.bytes[kind];
            sh->bytes[k] += (double)ar.bytes[kind];
            sh->calls[k] += (double)(t1.calls[kind] - t0.calls[kind]);
        }
        sh->sent[k] = (double)tdm_comm_traffic_ring_sent(&ar, tdm_comm_size(tc));
    } else {
        fprintf(stderr, "tandem compare: tp rank %d: %s\n", k, tdm_error_message());
    }
    free(x);
    free(y);
    return st;
}

static tdm_cmp_tp_shared tdm_cmp_tp_layout(int D, int T, int steps, int64_t pe)
{
    int N = D * T;
    size_t n = (size_t)steps * (size_t)N;
    tdm_cmp_tp_shared lay = {.N = N, .D = D, .T = T, .steps = steps, .param_elems = pe};
    size_t off = tdm_cmp_place_start(sizeof lay);
    lay.off_loss = tdm_cmp_place(&off, (size_t)steps * sizeof(double));
    lay.off_step = tdm_cmp_place(&off, n * sizeof(double));
    lay.off_phase = tdm_cmp_place(&off, n * TDM_CMP_TP_PHASES * sizeof(double));
    lay.off_params = tdm_cmp_place(&off, (size_t)pe * sizeof(float));
    lay.total = off;
    return lay;
}

/* ---- printing ---- */

static double tdm_cmp_tp_mean(const tdm_cmp_opts *o, const tdm_cmp_tp_shared *sh, int k, int f)
{
    int n = 0;
    double sum = 0.0;
    for (int i = tdm_cmp_warm(o); i < sh->steps; i++, n++) {
        size_t at = (size_t)i * (size_t)sh->N + (size_t)k;
        sum += f < 0 ? TDM_CMP_SHARED_AT(sh, off_step, double)[at]
                     : TDM_CMP_SHARED_AT(sh, off_phase, double)[at * TDM_CMP_TP_PHASES + (size_t)f];
    }
    return n ? sum / n : 0.0;
}

static void tdm_cmp_tp_print(const tdm_cmp_opts *o, const tdm_model_spec *spec,
                             const tdm_cmp_tp_shared *sh)
{
    static const char *const name[TDM_CMP_TP_PHASES] = {"forward", "fwd all-reduce", "loss",
                                                         "backward", "bwd all-reduce",
                                                         "optimizer", "dp grad sum"};
    const double mib = 1.0 / (1024.0 * 1024.0);
    printf("\ntensor-parallel phases (ms per step, mean over steps %d..%d; the all-reduces are "
           "exposed: the next layer needs their result):\n  %-16s", tdm_cmp_warm(o) + 1,
           o->steps, "");
    for (int k = 0; k < sh->N; k++) printf("    rank %-3d", k);
    printf("\n");
    for (int f = 0; f < TDM_CMP_TP_PHASES - (sh->D > 1 ? 0 : 1); f++) {
        printf("  %-16s", name[f]);
        for (int k = 0; k < sh->N; k++) printf("  %10.3f", tdm_cmp_tp_mean(o, sh, k, f));
        printf("\n");
    }
    printf("  %-16s", "step");
    for (int k = 0; k < sh->N; k++) printf("  %10.3f", tdm_cmp_tp_mean(o, sh, k, -1));
    printf("\n\ntensor-parallel memory and communication per rank (MiB; split tensors: the "
           "rank's elements of one device's%s):\n",
           sh->D > 1 ? "; the all-reduces of its group over its replica's share of the batch"
                     : "");
    for (int k = 0; k < sh->N; k++) {
        int64_t lo = 0, hi = o->batch;
        tdm_dist_share(o->batch, k / sh->T, sh->D, &lo, &hi);
        tdm_comm_traffic pt;
        tdm_tp_step_traffic(spec, sh->T, (int)(hi - lo), sh->sp, &pt);
        int64_t plan = 0, plan_calls = 0;
        for (int c = 0; c < TDM_COLL_COUNT_; c++) {
            plan += pt.bytes[c];
            plan_calls += pt.calls[c];
        }
        printf("  rank %d: params %.3f, grads %.3f, optimizer %.3f, activations %.3f; split "
               "tensors %.0f of %.0f elements; %s payload handed to the communicator "
               "%.0f bytes per step in %.1f calls (the plan: %lld bytes in %lld), which a ring "
               "algorithm sends as %.0f bytes per step\n", k,
               sh->mem[k][0] * mib, sh->mem[k][1] * mib, sh->mem[k][2] * mib,
               sh->mem[k][3] * mib, sh->split[k][0], sh->split[k][1],
               pt.calls[TDM_COLL_REDUCE_SCATTER] ? "reduce-scatter, all-gather and all-reduce"
                                                 : "all-reduce",
               sh->bytes[k] / sh->steps, sh->calls[k] / sh->steps, (long long)plan,
               (long long)plan_calls, sh->sent[k] / sh->steps);
    }
}

/* "tp(2)", or with replicas "dp(2) x tp(2)"; tp-sp(2) with sequence
 * parallelism. */
static void tdm_cmp_tp_label(const tdm_cmp_tp_shared *sh, char *buf, size_t n)
{
    const char *tag = sh->sp ? "tp-sp" : "tp";
    if (sh->D > 1) snprintf(buf, n, "dp(%d) x %s(%d)", sh->D, tag, sh->T);
    else snprintf(buf, n, "%s(%d)", tag, sh->T);
}

static int tdm_cmp_tp_verdict(const tdm_cmp_opts *o, const tdm_cmp_tp_shared *sh,
                              const double *ref_loss, const float *ref_p,
                              const tdm_cmp_floor *floor)
{
    const float *p = TDM_CMP_SHARED_AT(sh, off_params, float);
    const double *loss = TDM_CMP_SHARED_AT(sh, off_loss, double);
    tdm_cmp_within w;
    int ok = tdm_cmp_mesh_within(p, ref_p, sh->param_elems, loss, ref_loss, o->steps, floor, &w);
    char who[40];
    tdm_cmp_tp_label(sh, who, sizeof who);
    printf("\ntensor-parallel equivalence (vs one host device on the same batches, |a-b| <= "
           "atol %.0e + rtol %.0e |b|, losses within rel %.0e): %s: largest parameter "
           "difference %.3g (%.2f of the allowed), loss rel %.3g over %d steps -> %s "
           "(row-parallel sums add the ranks' partial products in another order than one "
           "device's gemm%s: float rounding, not bit for bit)\n", TDM_CMP_MESH_ATOL,
           TDM_CMP_MESH_RTOL, TDM_CMP_MESH_LOSS, who, w.max_diff, w.worst, w.loss_rel, o->steps,
           ok ? "PASS" : "FAIL", sh->D > 1 ? ", and the replicas' gradients are summed" : "");
    if (w.by_floor)
        printf("  past the fixed bound but within %.1fx the float-noise floor (one device "
               "started one ulp off ends %.2e away)\n", w.floor_x, floor->max_abs);
    return ok;
}

/* ---- the section ---- */

int tdm_cmp_tp_section(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                       const tdm_model_spec *spec, const tdm_cmp_result *single,
                       const tdm_cmp_result *ddp, int seq_par,
                       const tdm_cmp_floor *floor)
{
    int tp_row = o->mesh_tp > 1 && o->mesh_pp <= 1;   /* --mesh dp=D,tp=N */
    int T = tp_row ? o->mesh_tp : o->n_dev, D = tp_row ? o->mesh_dp : 1;
    int64_t pe = tdm_cmp_param_elems(o);
    char rep[40] = "";
    if (D > 1) snprintf(rep, sizeof rep, "dp(%d) x ", D);
    const char *tag = seq_par ? "tp-sp" : "tp";
    printf("\nTensor parallel: %s%s(%d), %s%s\n  running %s...\n", rep, tag, T,
           spec->kind == TDM_MODEL_GPT ? "the GPT's attention split by heads, its MLP column/row"
                                       : "the MLP's layers as column/row-parallel pairs",
           seq_par ? "; sequence parallel: LayerNorms and residual adds on 1/N of the tokens, "
                     "reduce-scatters and all-gathers along them"
                   : "", tag);
    tdm_tool_build b = {.design = &tdm_tool_tp_design, .cmd = "tandem compare", .seed = o->seed,
                        .pp = {.mesh = tp_row ? o->mesh : NULL}, .tp = {.seq_par = seq_par},
                        .ckpt = o->ckpt};   /* precision: fp32 (tdm_cmp_check_levers) */
    b.spec = *spec;
    tdm_optim_opts_named(&b.optim, o->optim, o->lr, o->weight_decay, o->momentum, 0);
    tdm_cmp_tp_shared lay = tdm_cmp_tp_layout(D, T, o->steps, pe);
    lay.sp = seq_par;
    tdm_cmp_tp_shared *sh = tdm_cmp_map_shared(lay.total);
    if (!sh) return -1;
    *sh = lay;
    tdm_cmp_tp_run c = {.o = o, .data = data, .sh = sh};
    b.tool = &c;
    tdm_status st = tdm_cmp_mesh_run(o, &b, tdm_cmp_tp_rank_run, D * T);
    double *ref_loss = calloc((size_t)o->steps, sizeof *ref_loss);
    float *ref_p = malloc((size_t)(pe > 0 ? pe : 1) * sizeof *ref_p);
    if (!st && (!ref_loss || !ref_p))
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "compare: tp reference");
    if (!st) st = tdm_cmp_reference(o, data, spec, 0, ref_loss, ref_p);
    int verdict = -1;
    if (st) {
        fprintf(stderr, "tandem compare: tp: %s\n", tdm_error_message());
    } else {
        double med = tdm_cmp_slowest_median(o, TDM_CMP_SHARED_AT(sh, off_step, double), sh->steps,
                                            sh->N);
        char what[40];
        tdm_cmp_tp_label(sh, what, sizeof what);
        tdm_cmp_mesh_speed(o, "tensor-parallel", "rank", what, med, single, ddp);
        tdm_cmp_tp_print(o, spec, sh);
        verdict = tdm_cmp_tp_verdict(o, sh, ref_loss, ref_p, floor);
        printf("\ntensor-parallel reading: each rank computes 1/%d of every split layer's "
               "gemms, so compute per rank drops by about %d; in exchange every step "
               "all-reduces activations (the bytes above: the MLP's batch x width floats per "
               "pair and direction, the GPT's batch x context x width floats four times per "
               "block), on the critical path. Where the gemms are small or the link slow, the all-reduces "
               "dominate and DDP (one gradient all-reduce per step, overlapped with backward) "
               "wins; TP pays off when a layer's weights are too large for one device or the "
               "gemms are large beside the activations moved.\n", T, T);
    }
    free(ref_loss);
    free(ref_p);
    munmap(sh, sh->total);
    return verdict;
}
