/* tools/compare_pp.c: `tandem compare --modes ...,pp`: the pipeline's
 * section. A pipeline of --stages S (default: the devices) with
 * --microbatches M in --schedule's order runs the same global batches
 * from the same initial parameters (pipeline stages through
 * tools/rank_pp.c's table over dist/run.h: forked ranks); each stage
 * writes what it measured into one shared anonymous mapping: the loss,
 * its step times, its phases (forward, backward, loss, send and recv
 * waits, the bubble), every micro-batch's F and B (the trace's tracks),
 * its memory; rank 0 the whole model's final parameters. Printed: the
 * throughput beside one device's (and DDP's), the per-stage phase table
 * with the measured bubble beside the ideal (S-1)/(M+S-1), the
 * equivalence verdict against one host device training with
 * --grad-accum M on the same micro-batches (bit for bit for the MLP and
 * CNN on host devices; the GPT within the bound of its tied embedding's
 * rounding), the per-stage memory, and the reading. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "models/optim.h"
#include "pp/pp.h"
#include "tools/compare.h"
#include "tools/compare_mesh.h"
#include "tools/compare_json.h"
#include "tools/plan_peak.h"
#include "tools/rank_pptp.h"
#include "tools/ranks.h"

/* forward, backward, loss, recv, send, bubble, pipeline, and with replicas
 * DDP's gradient sync over the dp dimension, with tensor-parallel stages
 * their partial sums' all-reduces (inside forward and backward) */
#define TDM_CMP_PP_PHASES 9
#define TDM_CMP_PP_SYNC 7
#define TDM_CMP_PP_TPSUM 8

typedef struct tdm_cmp_pp_shared {
    int S, M, steps, n_ev;    /* n_ev: events per stage per step (2M) */
    int D, T, W;              /* replicas and tensor-parallel ranks per stage (--mesh
                                 dp=D,pp=S,tp=T) and ranks, D * S * T: the step times are
                                 every rank's, the rest replica 0's stages' (tp rank 0's) */
    double tp_calls[TDM_CMP_MAX_DEV], tp_bytes[TDM_CMP_MAX_DEV];   /* each stage's partial
                                                                      sums over the run */
    int64_t param_elems;
    int lo[TDM_CMP_MAX_DEV], hi[TDM_CMP_MAX_DEV];
    double mem[TDM_CMP_MAX_DEV][8];   /* params, grads, optimizer, peak act, sets, set bytes,
                                         the device's peak (the allocator's; -1: not kept),
                                         the planned peak (tools/plan_peak.h; -1: none) */
    double overlapped, transfers;
    double last_norm;         /* --clip-grad-norm: the last step's global norm, before clipping */
    int sched;                /* tdm_pp_schedule_kind */
    int verdict;              /* the section's: 1 within the bound, 0 not */
    size_t off_loss, off_step, off_t0, off_phase, off_ev, off_params, total;
} tdm_cmp_pp_shared;

typedef struct tdm_cmp_pp_run {
    const tdm_cmp_opts *o;
    const tdm_cmp_data *data;
    tdm_cmp_pp_shared *sh;
    uint64_t t_start;
} tdm_cmp_pp_run;

/* The last section's records, for the trace writer (tdm_cmp_pp_trace). */
static tdm_cmp_pp_shared *g_pp;

/* ---- a stage ---- */

static tdm_status tdm_cmp_pp_rank_run(void *ctx, tdm_dist_rank *d, void *self)
{
    const tdm_tool_build *b = ctx;
    const tdm_cmp_pp_run *c = b->tool;
    tdm_cmp_pp_shared *sh = c->sh;
    tdm_tool_rank *r = self;
    tdm_pp *p = tdm_tool_pp_of(r);
    int s = tdm_pp_stage(p), S = sh->S, B = c->o->batch;
    int rep0 = d->coord[TDM_MESH_DP] == 0 && d->coord[TDM_MESH_TP] == 0;
    double tp_ms0 = 0.0;
    /* the design's step: this replica's share of the global batch, DDP
     * over the replicas */
    tdm_dist_stepper stp = {.w = r->w, .opt = r->opt, .comm = d->comm, .rank = r->rank,
                            .world = r->world, .global_batch = B, .clip_norm = c->o->clip};
    float *x = NULL;
    int32_t *y = NULL;
    char who[32];
    snprintf(who, sizeof who, "pp stage %d", s);
    tdm_status st = tdm_cmp_batch_new(c->data, B, who, &x, &y);
    for (int i = 0; st == TDM_STATUS_OK && i < sh->steps; i++) {
        tdm_cmp_rows(c->data, i, B, 0, B, x, y);
        double loss = 0.0;
        uint64_t t0 = tdm_time_ns();
        st = b->design->step(&stp, x, y, B, &loss);
        uint64_t t1 = tdm_time_ns();
        if (st) break;
        size_t k = (size_t)i * (size_t)S + (size_t)s;
        if (r->rank == 0) TDM_CMP_SHARED_AT(sh, off_loss, double)[i] = loss;
        TDM_CMP_SHARED_AT(sh, off_step, double)[(size_t)i * (size_t)sh->W + (size_t)r->rank] =
            (double)(t1 - t0) * 1e-6;
        if (!rep0) continue;
        TDM_CMP_SHARED_AT(sh, off_t0, double)[k] = (double)(t0 - c->t_start) * 1e-6;
        tdm_pp_stats ps;
        tdm_pp_get_stats(p, &ps);
        const tdm_pp_phases *ph = &ps.last;
        int64_t calls, bytes;
        double tp_ms;
        tdm_tool_pp_tp_sums(r, &calls, &bytes, &tp_ms);
        double v[TDM_CMP_PP_PHASES] = {ph->forward, ph->backward, ph->loss, ph->recv_wait,
                                       ph->send_wait, ph->bubble, ph->pipeline,
                                       ph->grad_sync, tp_ms - tp_ms0};
        tp_ms0 = tp_ms;
        if (rep0) {
            sh->tp_calls[s] = (double)calls;
            sh->tp_bytes[s] = (double)bytes;
        }
        memcpy(TDM_CMP_SHARED_AT(sh, off_phase, double) + k * TDM_CMP_PP_PHASES, v, sizeof v);
        const tdm_pp_event *ev;
        int n;
        tdm_pp_trace(p, &ev, &n);
        double *out = TDM_CMP_SHARED_AT(sh, off_ev, double) + k * (size_t)sh->n_ev * 4;
        for (int e = 0; e < sh->n_ev; e++) {
            double row[4] = {-1, -1, 0, 0};
            if (e < n)
                memcpy(row, (double[4]){ev[e].op, ev[e].mb,
                                        (double)(ev[e].t0_ns - c->t_start) * 1e-6,
                                        (double)(ev[e].t1_ns - c->t_start) * 1e-6},
                       sizeof row);
            memcpy(out + (size_t)e * 4, row, sizeof row);
        }
    }
    if (st == TDM_STATUS_OK && r->rank == 0) sh->last_norm = stp.last_norm;
    /* the device's peak over the steps, before the parameters' gather */
    tdm_dev_mem_stats ms;
    double dev_peak = tdm_dev_mem_query(tdm_model_device(r->m), &ms) == TDM_STATUS_OK
                          ? (double)ms.peak_bytes : -1.0;
    size_t planned = 0;
    if (tdm_tool_plan_pp_rank(b, &d->shape, d->coord, tdm_dev_kind(tdm_model_device(r->m)), B,
                              1, c->o->clip > 0.0, &planned))
        tdm_error_clear();
    if (st == TDM_STATUS_OK)
        st = b->design->params(r, r->rank == 0 ? TDM_CMP_SHARED_AT(sh, off_params, float) : NULL,
                               0);
    if (st == TDM_STATUS_OK && !rep0) {
        /* replica 0's stages speak for the pipeline */
    } else if (st == TDM_STATUS_OK) {
        tdm_pp_stats ps;
        tdm_pp_get_stats(p, &ps);
        tdm_model_stage_info si;
        tdm_model_get_stage(tdm_pp_model(p), &si);
        sh->lo[s] = si.lo;
        sh->hi[s] = si.hi;
        double m[8] = {(double)ps.params, (double)ps.grads, (double)ps.optimizer,
                       ps.peak_act == (size_t)-1 ? -1.0 : (double)ps.peak_act, ps.act_sets,
                       (double)ps.act_set, dev_peak, planned ? (double)planned : -1.0};
        memcpy(sh->mem[s], m, sizeof m);
        if (s == 0) {
            sh->overlapped = (double)ps.overlapped;
            sh->transfers = (double)ps.transfers;
        }
    } else {
        fprintf(stderr, "tandem compare: pp stage %d of replica %d: %s\n", s,
                d->coord[TDM_MESH_DP], tdm_error_message());
    }
    free(x);
    free(y);
    return st;
}

static tdm_cmp_pp_shared tdm_cmp_pp_layout(int D, int S, int T, int M, int steps, int64_t pe)
{
    size_t n = (size_t)steps * (size_t)S;
    tdm_cmp_pp_shared lay = {.S = S, .M = M, .steps = steps, .n_ev = 2 * M, .param_elems = pe,
                             .D = D, .T = T, .W = D * S * T};
    size_t off = tdm_cmp_place_start(sizeof lay);
    lay.off_loss = tdm_cmp_place(&off, (size_t)steps * sizeof(double));
    lay.off_step = tdm_cmp_place(&off, (size_t)steps * (size_t)lay.W * sizeof(double));
    lay.off_t0 = tdm_cmp_place(&off, n * sizeof(double));
    lay.off_phase = tdm_cmp_place(&off, n * TDM_CMP_PP_PHASES * sizeof(double));
    lay.off_ev = tdm_cmp_place(&off, n * (size_t)lay.n_ev * 4 * sizeof(double));
    lay.off_params = tdm_cmp_place(&off, (size_t)pe * sizeof(float));
    lay.total = off;
    return lay;
}

/* Post-warm-up mean of phase f of stage s. */
static double tdm_cmp_pp_phase(const tdm_cmp_opts *o, const tdm_cmp_pp_shared *sh, int s, int f)
{
    int w = tdm_cmp_warm(o), n = 0;
    double sum = 0.0;
    for (int i = w; i < sh->steps; i++, n++)
        sum += TDM_CMP_SHARED_AT(sh, off_phase, double)[((size_t)i * (size_t)sh->S + (size_t)s) *
                                                    TDM_CMP_PP_PHASES + (size_t)f];
    return n ? sum / n : 0.0;
}

static void tdm_cmp_pp_print_phases(const tdm_cmp_opts *o, const tdm_model_spec *spec,
                                    const tdm_cmp_pp_shared *sh, double *bubble_mean)
{
    static const char *const name[TDM_CMP_PP_PHASES] = {"forward", "backward", "loss",
                                                         "recv wait", "send wait", "bubble",
                                                         "pipeline", "grad sync",
                                                         "tp sums"};
    printf("\npipeline phases (ms per step, mean over steps %d..%d%s; bubble = pipeline - "
           "forward - backward - loss: the time a stage waited on the pipeline, of which send "
           "and recv wait are the part blocked on a transfer%s):\n",
           tdm_cmp_warm(o) + 1, o->steps,
           sh->D > 1 || sh->T > 1 ? ", replica 0's stages (tp rank 0's)" : "",
           sh->D > 1 ? "; grad sync: DDP's sum over the dp dimension, begun with the last "
                       "micro-batch's backward" : "");
    if (sh->T > 1)
        printf("  (tp sums: the all-reduces of the stage's partial sums over its %d "
               "tensor-parallel ranks, inside forward and backward)\n", sh->T);
    printf("  %-12s", "");
    for (int s = 0; s < sh->S; s++) printf("   stage %-3d", s);
    printf("\n  %-12s", "layers");
    for (int s = 0; s < sh->S; s++) {
        char l[24];
        snprintf(l, sizeof l, "%d-%d", sh->lo[s], sh->hi[s] - 1);
        printf("  %10s", l);
    }
    printf("\n");
    for (int f = 0; f < TDM_CMP_PP_PHASES; f++) {
        if ((f == TDM_CMP_PP_SYNC && sh->D < 2) || (f == TDM_CMP_PP_TPSUM && sh->T < 2)) continue;
        printf("  %-12s", name[f]);
        for (int s = 0; s < sh->S; s++) printf("  %10.3f", tdm_cmp_pp_phase(o, sh, s, f));
        printf("\n");
    }
    double ideal = (double)(sh->S - 1) / (double)(sh->M + sh->S - 1), mean = 0.0;
    printf("  %-12s", "bubble share");
    for (int s = 0; s < sh->S; s++) {
        double pl = tdm_cmp_pp_phase(o, sh, s, 6), bu = tdm_cmp_pp_phase(o, sh, s, 5);
        double share = pl > 0 ? bu / pl : 0.0;
        mean += share / sh->S;
        printf("  %9.1f%%", 100.0 * share);
    }
    printf("\n  bubble: %.1f%% measured (mean over the stages) vs (S-1)/(M+S-1) = %.1f%% for "
           "S = %d, M = %d of a balanced pipeline whose transfers cost nothing\n",
           100.0 * mean, 100.0 * ideal, sh->S, sh->M);
    int rows = (o->batch + sh->D - 1) / sh->D, first[TDM_CMP_MAX_DEV];
    for (int s = 0; s < sh->S; s++) first[s] = sh->lo[s];
    for (int s = 0; sh->T > 1 && s < sh->S; s++) {
        int64_t calls = 0, bytes = 0;
        if (tdm_pptp_step_plan(spec, sh->S, first, sh->T, s, rows, (rows + sh->M - 1) / sh->M,
                               &calls, &bytes))
            calls = bytes = -1;
        printf("  stage %d's tp sums: %.1f all-reduces of %.0f bytes per step (counted by its "
               "tp communicator; the plan: %lld bytes in %lld; 0: its layers are replicated, no "
               "pair in the stage)\n", s, sh->tp_calls[s] / sh->steps,
               sh->tp_bytes[s] / sh->steps, (long long)bytes, (long long)calls);
    }
    *bubble_mean = mean;
}

static void tdm_cmp_pp_print_memory(const tdm_cmp_pp_shared *sh, tdm_pp_schedule_kind k)
{
    const double mib = 1.0 / (1024.0 * 1024.0);
    printf("\npipeline memory per stage (MiB; peak activations measured from the allocator "
           "since set-up; peak: the device's, measured by its allocator over the run, and as "
           "tandem plan --mode pp plans it%s):\n",
           sh->D > 1 ? "; replica 0's stages" : "");
    printf("  %-8s %10s %10s %10s %12s %10s %10s %s\n", "stage", "params", "grads", "optimizer",
           "peak act", "peak", "planned", "(sets held at once)");
    for (int s = 0; s < sh->S; s++) {
        const double *m = sh->mem[s];
        char peak[24], dev[24], plan[24];
        if (m[3] < 0) snprintf(peak, sizeof peak, "%12s", "-");
        else snprintf(peak, sizeof peak, "%12.3f", m[3] * mib);
        if (m[6] < 0) snprintf(dev, sizeof dev, "%10s", "-");
        else snprintf(dev, sizeof dev, "%10.2f", m[6] * mib);
        if (m[7] < 0) snprintf(plan, sizeof plan, "%10s", "-");
        else snprintf(plan, sizeof plan, "%10.2f", m[7] * mib);
        printf("  %-8d %10.3f %10.3f %10.3f %s %s %s (%.0f of %.3f MiB; %s bounds it by %d)\n",
               s, m[0] * mib, m[1] * mib, m[2] * mib, peak, dev, plan, m[4], m[5] * mib,
               tdm_pp_schedule_name(k), k == TDM_PP_1F1B ? (sh->S - s < sh->M ? sh->S - s : sh->M)
                                                          : sh->M);
    }
}

/* "pp(2)", or with replicas "dp(2) x pp(2)". */
static void tdm_cmp_pp_label(const tdm_cmp_pp_shared *sh, char *buf, size_t n)
{
    int k = sh->D > 1 ? snprintf(buf, n, "dp(%d) x ", sh->D) : 0;
    if (k < 0 || (size_t)k >= n) return;
    k += snprintf(buf + k, n - (size_t)k, "pp(%d)", sh->S);
    if (sh->T > 1 && k > 0 && (size_t)k < n) snprintf(buf + k, n - (size_t)k, " x tp(%d)", sh->T);
}

/* Equivalence: every step's loss and the final parameters against one
 * host device with gradient accumulation over the same micro-batches. */
static int tdm_cmp_pp_verdict(const tdm_cmp_opts *o, const tdm_model_spec *spec,
                              const tdm_cmp_pp_shared *sh, const double *ref_loss,
                              const float *ref_p, const tdm_cmp_floor *floor)
{
    const float *p = TDM_CMP_SHARED_AT(sh, off_params, float);
    const double *loss = TDM_CMP_SHARED_AT(sh, off_loss, double);
    int64_t n = sh->param_elems, diff = 0;
    double ld = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&p[i], &ref_p[i], sizeof *p)) diff++;
    for (int i = 0; i < o->steps; i++)
        if (fabs(loss[i] - ref_loss[i]) > ld) ld = fabs(loss[i] - ref_loss[i]);
    int host = o->dl.kind == TDM_DEVICE_HOST, gpt = spec->kind == TDM_MODEL_GPT;
    int K = sh->M * sh->D;   /* the replicas' micro-batches, in order: one device's */
    char who[48];
    tdm_cmp_pp_label(sh, who, sizeof who);
    char lev[96] = "";
    if (o->precision != TDM_PRECISION_FP32 || o->ckpt || o->clip > 0.0)
        snprintf(lev, sizeof lev, ", both with precision %s%s%s", tdm_precision_name(o->precision),
                 o->ckpt ? ", checkpointing" : "", o->clip > 0.0 ? ", clipping" : "");
    printf("\npipeline equivalence (vs one host device, --grad-accum %d over the same "
           "micro-batches of %d%s):\n", K, (o->batch + K - 1) / K, lev);
    if (o->clip > 0.0)
        printf("  %s's global gradient norm at the last step: %.6g, clipped to %g%s\n", who,
               sh->last_norm, o->clip, sh->last_norm > o->clip ? "" : " (below it: unchanged)");
    if (host && !gpt && sh->D == 1 && sh->T == 1) {
        int ok = diff == 0 && ld == 0.0;
        printf("  %s: %lld of %lld parameters differ, largest loss difference %.3g over %d "
               "steps -> %s (bit for bit expected: the same micro-batches added in the same "
               "order)\n", who, (long long)diff, (long long)n, ld, o->steps,
               ok ? "BITWISE IDENTICAL" : "FAIL");
        return ok;
    }
    /* not bit for bit: compare's bound after the last step, as every
     * other row that is not */
    tdm_cmp_within w;
    int ok = tdm_cmp_mesh_within(p, ref_p, n, loss, ref_loss, o->steps, floor, &w);
    printf("  %s: largest parameter difference %.3g (%.2f of the allowed atol %.0e + rtol %.0e "
           "|b|), loss rel %.3g (bound %.0e) -> %s (%s)\n", who, w.max_diff, w.worst,
           TDM_CMP_MESH_ATOL, TDM_CMP_MESH_RTOL, w.loss_rel, TDM_CMP_MESH_LOSS,
           ok ? "PASS" : "FAIL",
           sh->T > 1 ? "the stages' row-parallel products are sums of the tensor-parallel ranks' "
                       "partial products, added in another order than one device's gemm"
           : sh->D > 1 ? "DDP adds each replica's sum of its micro-batches' gradients, one device "
                         "all of them in one sequence: the same additions in another order"
           : gpt ? "the GPT's tied embedding: its two shares add in another order than on one "
                   "device"
                 : "devices that are not the reference's host");
    if (w.by_floor)
        printf("  past the fixed bound but within %.1fx the float-noise floor (one device "
               "started one ulp off ends %.2e away)\n", w.floor_x, floor->max_abs);
    return ok;
}

/* ---- the section ---- */

/* Runs D replicas of a pipeline of S stages (--mesh dp=D,pp=S; D = 1:
 * one pipeline) over the global batches: its records, in a shared
 * mapping (NULL on failure, said). */
static tdm_cmp_pp_shared *tdm_cmp_pp_go(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                                        const tdm_model_spec *spec, int D, int S, int T,
                                        int M, tdm_pp_schedule_kind kind)
{
    int64_t pe = tdm_cmp_param_elems(o);
    tdm_tool_build b = {.design = &tdm_tool_pp_design, .cmd = "tandem compare", .seed = o->seed,
                        .pp = {.stages = S, .micro = M, .schedule = kind, .batch = o->batch,
                               .mesh = D > 1 || T > 1 ? o->mesh : NULL},
                        .precision = o->precision, .ckpt = o->ckpt};
    b.spec = *spec;
    tdm_optim_opts_named(&b.optim, o->optim, o->lr, o->weight_decay, o->momentum, 0);
    tdm_cmp_pp_shared lay = tdm_cmp_pp_layout(D, S, T, M, o->steps, pe);
    tdm_cmp_pp_shared *sh = tdm_cmp_map_shared(lay.total);
    if (!sh) return NULL;
    *sh = lay;
    tdm_cmp_pp_run c = {.o = o, .data = data, .sh = sh, .t_start = tdm_time_ns()};
    b.tool = &c;
    tdm_status st = tdm_cmp_mesh_run(o, &b, tdm_cmp_pp_rank_run, D * S * T);
    if (st) {
        fprintf(stderr, "tandem compare: pp: %s\n", tdm_error_message());
        munmap(sh, lay.total);
        return NULL;
    }
    return sh;
}

/* The median post-warm-up step's samples/s. */
static double tdm_cmp_pp_sps(const tdm_cmp_opts *o, const tdm_cmp_pp_shared *sh, double *med)
{
    *med = tdm_cmp_slowest_median(o, TDM_CMP_SHARED_AT(sh, off_step, double), sh->steps, sh->W);
    return *med > 0 ? o->batch / *med * 1e3 : 0.0;
}

double tdm_cmp_pp_sweep_sps(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                            const tdm_model_spec *spec, int S)
{
    tdm_pp_schedule_kind kind = TDM_PP_1F1B;
    if (o->pp_schedule) (void)tdm_pp_schedule_parse(o->pp_schedule, &kind);   /* checked */
    tdm_cmp_pp_shared *sh = tdm_cmp_pp_go(o, data, spec, 1, S, 1,
                                          o->pp_micro > 0 ? o->pp_micro : 4, kind);
    if (!sh) return -1.0;
    double med, sps = tdm_cmp_pp_sps(o, sh, &med);
    munmap(sh, sh->total);
    return sps;
}

int tdm_cmp_pp_section(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                       const tdm_model_spec *spec, const tdm_cmp_result *single,
                       const tdm_cmp_result *ddp, const tdm_cmp_floor *floor)
{
    int S = o->pp_stages > 0 ? o->pp_stages : o->n_dev, M = o->pp_micro > 0 ? o->pp_micro : 4;
    int D = o->mesh_pp > 1 ? o->mesh_dp : 1, rows = (o->batch + D - 1) / D;
    int T = o->mesh_pp > 1 && o->mesh_tp > 1 ? o->mesh_tp : 1;
    tdm_pp_schedule_kind kind = TDM_PP_1F1B;
    if (o->pp_schedule) (void)tdm_pp_schedule_parse(o->pp_schedule, &kind);   /* checked */
    char rep[40] = "", tps[64] = "";
    if (D > 1) snprintf(rep, sizeof rep, "dp(%d) x ", D);
    if (T > 1) snprintf(tps, sizeof tps, " x tp(%d) (each stage tensor-parallel)", T);
    printf("\nPipeline: %spp(%d)%s, %s, %d micro-batches of %d%s\n  running pp...\n", rep, S,
           tps, tdm_pp_schedule_name(kind), M, (rows + M - 1) / M, D > 1 ? " per replica" : "");
    tdm_cmp_pp_shared *sh = tdm_cmp_pp_go(o, data, spec, D, S, T, M, kind);
    if (!sh) return -1;
    int64_t pe = sh->param_elems;
    double *ref_loss = calloc((size_t)o->steps, sizeof *ref_loss);
    float *ref_p = malloc((size_t)(pe > 0 ? pe : 1) * sizeof *ref_p);
    tdm_status st = ref_loss && ref_p ? TDM_STATUS_OK
                                      : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                                                      "compare: pp reference");
    if (!st) st = tdm_cmp_reference(o, data, spec, D * M, ref_loss, ref_p);
    int verdict = -1;
    if (st) {
        fprintf(stderr, "tandem compare: pp: %s\n", tdm_error_message());
    } else {
        double med;
        (void)tdm_cmp_pp_sps(o, sh, &med);
        char what[80], lab[48];
        tdm_cmp_pp_label(sh, lab, sizeof lab);
        snprintf(what, sizeof what, "%s %s M=%d", lab, tdm_pp_schedule_name(kind), M);
        tdm_cmp_mesh_speed(o, "pipeline", "stage", what, med, single, ddp);
        double bubble = 0.0;
        tdm_cmp_pp_print_phases(o, spec, sh, &bubble);
        verdict = tdm_cmp_pp_verdict(o, spec, sh, ref_loss, ref_p, floor);
        tdm_cmp_pp_print_memory(sh, kind);
        double ideal = (double)(S - 1) / (double)(M + S - 1);
        printf("\npipeline reading: each stage computes its layers of every micro-batch; with "
               "%d stages and %d micro-batches a balanced pipeline idles (S-1)/(M+S-1) = %.0f%% "
               "of a step filling and draining, measured %.0f%% here%s. More micro-batches "
               "shrink the bubble (M=%d: %.0f%%) at the cost of smaller gemms; 1F1B holds at "
               "most S-s micro-batches' activations on stage s, GPipe all M. %d of %.0f "
               "transfers completed while stage 0 computed.\n", S, M, 100.0 * ideal,
               100.0 * bubble,
               bubble > ideal + 0.05 ? " (above it: unequal stages, transfers and the "
                                       "per-action overhead of small micro-batches)"
                                     : "",
               4 * M, 100.0 * (S - 1) / (4.0 * M + S - 1), (int)sh->overlapped, sh->transfers);
    }
    free(ref_loss);
    free(ref_p);
    if (g_pp) munmap(g_pp, g_pp->total);
    g_pp = NULL;
    sh->sched = (int)kind;
    sh->verdict = verdict;
    if (verdict >= 0) g_pp = sh;
    else munmap(sh, sh->total);
    return verdict;
}

/* The trace: one track per stage, each micro-batch's F and B. */
void tdm_cmp_pp_trace(FILE *f, int *first, int pid, long long (*us)(double))
{
    const tdm_cmp_pp_shared *sh = g_pp;
    if (!sh) return;
#define TDM_PP_EV(...)                                                                        \
    do {                                                                                      \
        fprintf(f, "%s\n  ", *first ? "" : ",");                                              \
        *first = 0;                                                                           \
        fprintf(f, __VA_ARGS__);                                                              \
    } while (0)
    TDM_PP_EV("{\"ph\": \"M\", \"pid\": %d, \"name\": \"process_name\", \"args\": {\"name\": "
              "\"pp (%d stages, %d micro-batches)\"}}", pid, sh->S, sh->M);
    for (int s = 0; s < sh->S; s++) {
        TDM_PP_EV("{\"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"name\": \"thread_name\", "
                  "\"args\": {\"name\": \"stage %d\"}}", pid, s, s);
        for (int i = 0; i < sh->steps; i++) {
            const double *e = TDM_CMP_SHARED_AT(sh, off_ev, double) +
                              ((size_t)i * (size_t)sh->S + (size_t)s) * (size_t)sh->n_ev * 4;
            for (int k = 0; k < sh->n_ev; k++, e += 4) {
                if (e[0] < 0) continue;
                long long d = us(e[3]) - us(e[2]);
                TDM_PP_EV("{\"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"name\": \"%c%d\", "
                          "\"ts\": %lld, \"dur\": %lld, \"args\": {\"step\": %d}}", pid, s,
                          e[0] == TDM_PP_FORWARD ? 'F' : 'B', (int)e[1], us(e[2]),
                          d > 0 ? d : 1, i + 1);
            }
        }
    }
#undef TDM_PP_EV
}

/* --json's "pipeline": the layout, the verdict and every stage's memory
 * as the text table has it (replica 0's stages), the allocator's peak
 * beside tandem plan's. */
void tdm_cmp_pp_json(FILE *f)
{
    const tdm_cmp_pp_shared *sh = g_pp;
    if (!sh) return;
    fprintf(f, ",\n  \"pipeline\": {\"stages\": %d, \"replicas\": %d, \"tp\": %d, "
               "\"micro_batches\": %d, \"schedule\": ", sh->S, sh->D, sh->T, sh->M);
    tdm_json_put_str(f, tdm_pp_schedule_name((tdm_pp_schedule_kind)sh->sched));
    fprintf(f, ", \"pass\": %s,\n    \"memory_bytes\": [", sh->verdict == 1 ? "true" : "false");
    for (int s = 0; s < sh->S; s++) {
        const double *m = sh->mem[s];
        fprintf(f, "%s\n      {\"stage\": %d, \"layers\": [%d, %d], \"params\": %.0f, "
                   "\"grads\": %.0f, \"optimizer\": %.0f, \"peak_activations\": ",
                s ? "," : "", s, sh->lo[s], sh->hi[s] - 1, m[0], m[1], m[2]);
        tdm_json_put_num(f, m[3] >= 0 ? m[3] : NAN);
        fputs(", \"peak_measured\": ", f);
        tdm_json_put_num(f, m[6] >= 0 ? m[6] : NAN);
        fputs(", \"peak_planned\": ", f);
        tdm_json_put_num(f, m[7] >= 0 ? m[7] : NAN);
        fputc('}', f);
    }
    fputs("]}", f);
}
