/* pp/schedule.c: pipeline schedules as data (pp/pp.h): GPipe and 1F1B
 * (PipeDream-flush, as Megatron-LM's non-interleaved schedule and
 * torch.distributed.pipelining's Schedule1F1B order them), their text,
 * the activations each stage holds at once, a check of what the runtime
 * relies on, and a unit-time simulation (the bubble). Not the runtime
 * (pp/pp.c): nothing here computes or sends. */
#include "pp/pp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Bounds that keep every count and table in an int: the simulation's
 * tables hold S * M entries and count 2 * S * M actions. */
#define TDM_PP_MAX_STAGES 4096
#define TDM_PP_MAX_MICRO (1 << 20)
#define TDM_PP_MAX_ACTIONS (1 << 26)

static const char *const tdm_pp_schedule_names[TDM_PP_SCHEDULE_COUNT_] = {
    [TDM_PP_GPIPE] = "gpipe", [TDM_PP_1F1B] = "1f1b",
};

const char *tdm_pp_schedule_name(tdm_pp_schedule_kind k)
{
    return (unsigned)k < TDM_PP_SCHEDULE_COUNT_ ? tdm_pp_schedule_names[k] : "?";
}

tdm_status tdm_pp_schedule_parse(const char *text, tdm_pp_schedule_kind *out)
{
    for (int i = 0; text && i < TDM_PP_SCHEDULE_COUNT_; i++)
        if (!strcasecmp(text, tdm_pp_schedule_names[i])) {
            *out = (tdm_pp_schedule_kind)i;
            return TDM_STATUS_OK;
        }
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "unknown pipeline schedule '%s' (expected "
                         "gpipe or 1f1b)", text ? text : "(null)");
}

void tdm_pp_schedule_free(tdm_pp_schedule *s)
{
    if (!s) return;
    for (int i = 0; s->actions && i < s->stages; i++) free(s->actions[i]);
    free(s->actions);
    free(s->n_actions);
    free(s);
}

tdm_status tdm_pp_schedule_build(tdm_pp_schedule **out, tdm_pp_schedule_kind kind, int S, int M)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "pp schedule: out is NULL");
    *out = NULL;
    TDM_REQUIRE((unsigned)kind < TDM_PP_SCHEDULE_COUNT_, TDM_STATUS_INVALID_ARG,
                "pp schedule: unknown kind %d", (int)kind);
    TDM_REQUIRE(S >= 1 && S <= TDM_PP_MAX_STAGES, TDM_STATUS_INVALID_ARG,
                "pp schedule: %d stages (expected 1..%d)", S, TDM_PP_MAX_STAGES);
    TDM_REQUIRE(M >= 1 && M <= TDM_PP_MAX_MICRO, TDM_STATUS_INVALID_ARG,
                "pp schedule: %d micro-batches (expected 1..%d)", M, TDM_PP_MAX_MICRO);
    TDM_REQUIRE(2 * (int64_t)S * M <= TDM_PP_MAX_ACTIONS, TDM_STATUS_INVALID_ARG,
                "pp schedule: %d stages x %d micro-batches is %lld actions (at most %d)", S, M,
                2 * (long long)S * M, TDM_PP_MAX_ACTIONS);
    tdm_pp_schedule *s = calloc(1, sizeof *s);
    TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "pp schedule: calloc");
    s->kind = kind;
    s->stages = S;
    s->micro = M;
    s->n_actions = calloc((size_t)S, sizeof *s->n_actions);
    s->actions = calloc((size_t)S, sizeof *s->actions);
    if (!s->n_actions || !s->actions) goto oom;
    for (int st = 0; st < S; st++) {
        tdm_pp_action *a = calloc((size_t)(2 * M), sizeof *a);
        if (!a) goto oom;
        s->actions[st] = a;
        int n = 0;
        if (kind == TDM_PP_GPIPE) {
            for (int i = 0; i < M; i++) a[n++] = (tdm_pp_action){TDM_PP_FORWARD, i};
            for (int i = 0; i < M; i++) a[n++] = (tdm_pp_action){TDM_PP_BACKWARD, i};
        } else {
            /* warm-up: enough forwards that the last stage's first
             * backward can start as soon as it can; then one forward and
             * one backward; then the backwards left */
            int warm = S - st - 1 < M ? S - st - 1 : M;
            int f = 0, b = 0;
            for (; f < warm; f++) a[n++] = (tdm_pp_action){TDM_PP_FORWARD, f};
            for (; f < M; f++, b++) {
                a[n++] = (tdm_pp_action){TDM_PP_FORWARD, f};
                a[n++] = (tdm_pp_action){TDM_PP_BACKWARD, b};
            }
            for (; b < M; b++) a[n++] = (tdm_pp_action){TDM_PP_BACKWARD, b};
        }
        s->n_actions[st] = n;
    }
    *out = s;
    return TDM_STATUS_OK;
oom:
    tdm_pp_schedule_free(s);
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp schedule: %d stages x %d micro-batches",
                         S, M);
}

const char *tdm_pp_schedule_format(const tdm_pp_schedule *s, int stage, char *buf, size_t n)
{
    size_t o = 0;
    if (n) buf[0] = '\0';
    for (int i = 0; i < s->n_actions[stage] && o + 1 < n; i++) {
        const tdm_pp_action *a = &s->actions[stage][i];
        int w = snprintf(buf + o, n - o, "%s%c%d", i ? " " : "",
                         a->op == TDM_PP_FORWARD ? 'F' : 'B', a->mb);
        if (w < 0) break;
        o += (size_t)w < n - o ? (size_t)w : n - o - 1;
    }
    return buf;
}

int tdm_pp_schedule_in_flight(const tdm_pp_schedule *s, int stage)
{
    int live = 0, most = 0;
    for (int i = 0; i < s->n_actions[stage]; i++) {
        live += s->actions[stage][i].op == TDM_PP_FORWARD ? 1 : -1;
        if (live > most) most = live;
    }
    return most;
}

tdm_status tdm_pp_schedule_check(const tdm_pp_schedule *s)
{
    for (int st = 0; st < s->stages; st++) {
        int nf = 0, nb = 0;
        TDM_REQUIRE(s->n_actions[st] == 2 * s->micro, TDM_STATUS_INVALID_ARG,
                    "pp schedule: stage %d has %d actions for %d micro-batches", st,
                    s->n_actions[st], s->micro);
        for (int i = 0; i < s->n_actions[st]; i++) {
            const tdm_pp_action *a = &s->actions[st][i];
            if (a->op == TDM_PP_FORWARD) {
                TDM_REQUIRE(a->mb == nf, TDM_STATUS_INVALID_ARG,
                            "pp schedule: stage %d runs F%d where F%d is due", st, a->mb, nf);
                nf++;
            } else {
                TDM_REQUIRE(a->mb == nb && nb < nf, TDM_STATUS_INVALID_ARG,
                            "pp schedule: stage %d runs B%d where B%d is due (after F%d)", st,
                            a->mb, nb, nf - 1);
                nb++;
            }
        }
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_schedule_simulate(const tdm_pp_schedule *s, int *makespan, double *idle)
{
    int S = s->stages, M = s->micro;
    TDM_CHECK(tdm_pp_schedule_check(s));
    /* end time of each stage's F and B of each micro-batch; -1: not yet */
    int *fend = malloc((size_t)S * (size_t)M * sizeof *fend);
    int *bend = malloc((size_t)S * (size_t)M * sizeof *bend);
    int *next = calloc((size_t)S, sizeof *next), *clock = calloc((size_t)S, sizeof *clock);
    tdm_status st = TDM_STATUS_OK;
    if (!fend || !bend || !next || !clock) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp schedule: simulation");
        goto done;
    }
    for (int i = 0; i < S * M; i++) fend[i] = bend[i] = -1;
    /* rounds: each stage runs its next action when its input is there;
     * a round in which no stage can move means the schedule deadlocks */
    for (int left = 2 * S * M; left > 0;) {
        int moved = 0;
        for (int k = 0; k < S; k++) {
            if (next[k] == s->n_actions[k]) continue;
            const tdm_pp_action *a = &s->actions[k][next[k]];
            int ready;
            if (a->op == TDM_PP_FORWARD) ready = k == 0 ? 0 : fend[(k - 1) * M + a->mb];
            else ready = k == S - 1 ? fend[k * M + a->mb] : bend[(k + 1) * M + a->mb];
            if (ready < 0) continue;
            int start = ready > clock[k] ? ready : clock[k];
            clock[k] = start + 1;
            (a->op == TDM_PP_FORWARD ? fend : bend)[k * M + a->mb] = clock[k];
            next[k]++;
            left--;
            moved = 1;
        }
        if (!moved) {
            st = tdm_error_set(TDM_STATUS_INVALID_ARG, "pp schedule: %s with %d stages and %d "
                               "micro-batches deadlocks", tdm_pp_schedule_name(s->kind), S, M);
            goto done;
        }
    }
    int end = 0;
    for (int k = 0; k < S; k++)
        if (clock[k] > end) end = clock[k];
    *makespan = end;
    /* every stage is busy 2M units of the makespan */
    *idle = (double)(end - 2 * M) / end;
done:
    free(fend);
    free(bend);
    free(next);
    free(clock);
    return st;
}
