/* tools/train_trace.c: `tandem train --trace FILE`. See
 * tools/train_trace.h. */
#include "tools/train_trace.h"

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/safefile.h"
#include "tools/compare_json.h"

/* One event, as every rank sends it: four int64s. */
typedef struct tdm_train_trace_ev {
    int64_t t0_ns, dur_ns, index;
    int32_t kind, phase;
} tdm_train_trace_ev;
_Static_assert(sizeof(tdm_train_trace_ev) == 4 * sizeof(int64_t), "sent as 4 int64s");
#define TDM_TRAIN_TRACE_EV_I64 4

/* Clocks further apart than this between the ranks' first steps are
 * taken for different machines' */
#define TDM_TRAIN_TRACE_SKEW_NS (60ull * 1000 * 1000 * 1000)

struct tdm_train_trace {
    char *path;
    int rank, world;
    char track[48];
    tdm_train_trace_ev *ev;
    int64_t n, cap, dropped;
};

/* The phases in the order a step runs them (compare's order). */
static const tdm_phase tdm_train_trace_order[] = {
    TDM_PHASE_REPLICATE, TDM_PHASE_SCATTER,       TDM_PHASE_FORWARD,
    TDM_PHASE_GATHER,    TDM_PHASE_LOSS,          TDM_PHASE_BACKWARD,
    TDM_PHASE_REDUCE,    TDM_PHASE_ALLREDUCE_WAIT, TDM_PHASE_ALLGATHER_WAIT,
    TDM_PHASE_REDUCE_SCATTER_WAIT, TDM_PHASE_STEP,
};
#define TDM_TRAIN_TRACE_NORDER (int)(sizeof tdm_train_trace_order / sizeof tdm_train_trace_order[0])

tdm_status tdm_train_trace_new(tdm_train_trace **out, const char *path, int rank, int world,
                               const char *track)
{
    *out = NULL;
    tdm_train_trace *t = calloc(1, sizeof *t);
    TDM_REQUIRE(t, TDM_STATUS_OUT_OF_MEMORY, "--trace: out of memory");
    t->path = strdup(path);
    if (!t->path) {
        free(t);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "--trace: out of memory");
    }
    t->rank = rank;
    t->world = world;
    snprintf(t->track, sizeof t->track, "%s", track);
    *out = t;
    return TDM_STATUS_OK;
}

void tdm_train_trace_free(tdm_train_trace *t)
{
    if (!t) return;
    free(t->ev);
    free(t->path);
    free(t);
}

static void tdm_train_trace_add(tdm_train_trace *t, int kind, int phase, int64_t index,
                                uint64_t t0_ns, uint64_t t1_ns)
{
    if (!t) return;
    if (t->n == t->cap) {
        int64_t cap = t->cap ? 2 * t->cap : 1024;
        if (cap > TDM_TRAIN_TRACE_CAP) cap = TDM_TRAIN_TRACE_CAP;
        tdm_train_trace_ev *ev = cap > t->cap ? realloc(t->ev, (size_t)cap * sizeof *ev) : NULL;
        if (!ev) {
            t->dropped++;
            return;
        }
        t->ev = ev;
        t->cap = cap;
    }
    t->ev[t->n++] = (tdm_train_trace_ev){.t0_ns = (int64_t)t0_ns,
                                         .dur_ns = t1_ns > t0_ns ? (int64_t)(t1_ns - t0_ns) : 0,
                                         .index = index, .kind = kind, .phase = phase};
}

void tdm_train_trace_span(tdm_train_trace *t, tdm_train_trace_kind kind, int64_t index,
                          uint64_t t0_ns, uint64_t t1_ns)
{
    tdm_train_trace_add(t, (int)kind, 0, index, t0_ns, t1_ns);
}

void tdm_train_trace_step(tdm_train_trace *t, int64_t step, uint64_t t0_ns, uint64_t t1_ns,
                          const tdm_phase_times *ph)
{
    tdm_train_trace_add(t, TDM_TRAIN_TRACE_STEP, 0, step, t0_ns, t1_ns);
    uint64_t at = t0_ns;
    for (int q = 0; ph && q < TDM_TRAIN_TRACE_NORDER && at < t1_ns; q++) {
        tdm_phase p = tdm_train_trace_order[q];
        double ms = ph->ms[p];
        if (!(ms > 0.0)) continue;
        uint64_t end = at + (uint64_t)llround(ms * 1e6);
        if (end > t1_ns) end = t1_ns;
        tdm_train_trace_add(t, TDM_TRAIN_TRACE_PHASE, (int)p, step, at, end);
        at = end;
    }
}

/* ---- the file ---- */

static const char *tdm_train_trace_name(const tdm_train_trace_ev *e, char *buf, size_t n)
{
    switch ((tdm_train_trace_kind)e->kind) {
    case TDM_TRAIN_TRACE_STEP: snprintf(buf, n, "step %lld", (long long)e->index); break;
    case TDM_TRAIN_TRACE_PHASE: snprintf(buf, n, "%s", tdm_phase_name((tdm_phase)e->phase)); break;
    case TDM_TRAIN_TRACE_EVAL: snprintf(buf, n, "evaluation (epoch %lld)", (long long)e->index); break;
    case TDM_TRAIN_TRACE_SAVE: snprintf(buf, n, "save (epoch %lld)", (long long)e->index); break;
    case TDM_TRAIN_TRACE_AFTER:
        snprintf(buf, n, "end of epoch %lld (wait or collective save)", (long long)e->index);
        break;
    default: snprintf(buf, n, "?"); break;
    }
    return buf;
}

static const char *tdm_train_trace_cat(int kind)
{
    return kind == TDM_TRAIN_TRACE_STEP ? "step" : kind == TDM_TRAIN_TRACE_PHASE ? "phase" : "epoch";
}

typedef struct tdm_train_trace_file {
    const tdm_train_trace *t;
    const tdm_train_trace_ev *all;   /* world x stride events */
    const int64_t *count;            /* per rank */
    int64_t stride;
    const int64_t *origin;           /* per rank: subtracted from its timestamps */
    const char *process;
    int aligned;                     /* 1: each rank at its own first step */
} tdm_train_trace_file;

static tdm_status tdm_train_trace_body(FILE *f, const void *ctx)
{
    const tdm_train_trace_file *c = ctx;
    fputs("{\"displayTimeUnit\": \"ms\", \"otherData\": {\"clock\": ", f);
    tdm_json_put_str(f, c->aligned ? "each rank's own, its track starting at its first step "
                                     "(the ranks' clocks differ: several machines)"
                                   : "CLOCK_MONOTONIC, one for every rank");
    fputs("}, \"traceEvents\": [\n  {\"ph\": \"M\", \"pid\": 1, \"name\": \"process_name\", "
          "\"args\": {\"name\": ", f);
    tdm_json_put_str(f, c->process);
    fputs("}}", f);
    for (int r = 0; r < c->t->world; r++) {
        char track[64];
        if (c->t->world > 1) snprintf(track, sizeof track, "rank %d", r);
        else snprintf(track, sizeof track, "%s", c->t->track);
        fprintf(f, ",\n  {\"ph\": \"M\", \"pid\": 1, \"tid\": %d, \"name\": \"thread_name\", "
                   "\"args\": {\"name\": ", r);
        tdm_json_put_str(f, track);
        fputs("}}", f);
        for (int64_t i = 0; i < c->count[r]; i++) {
            const tdm_train_trace_ev *e = &c->all[(size_t)r * (size_t)c->stride + (size_t)i];
            char name[80];
            fprintf(f, ",\n  {\"ph\": \"X\", \"pid\": 1, \"tid\": %d, \"name\": ", r);
            tdm_json_put_str(f, tdm_train_trace_name(e, name, sizeof name));
            fprintf(f, ", \"cat\": \"%s\", \"ts\": %.3f, \"dur\": %.3f, \"args\": {\"%s\": %lld}}",
                    tdm_train_trace_cat(e->kind), (double)(e->t0_ns - c->origin[r]) * 1e-3,
                    (double)e->dur_ns * 1e-3,
                    e->kind == TDM_TRAIN_TRACE_STEP || e->kind == TDM_TRAIN_TRACE_PHASE ? "step"
                                                                                       : "epoch",
                    (long long)e->index);
        }
    }
    fputs("\n]}\n", f);
    return ferror(f) ? TDM_STATUS_IO : TDM_STATUS_OK;
}

/* Rank 0: the origins (the earliest event of all, or each rank's own when
 * their clocks differ) and the file. */
static tdm_status tdm_train_trace_emit(tdm_train_trace *t, const tdm_train_trace_ev *all,
                                       const int64_t *count, int64_t stride, int64_t dropped,
                                       const char *process)
{
    int64_t *origin = calloc((size_t)t->world, sizeof *origin);
    TDM_REQUIRE(origin, TDM_STATUS_OUT_OF_MEMORY, "--trace: out of memory");
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int r = 0; r < t->world; r++) {
        origin[r] = count[r] ? all[(size_t)r * (size_t)stride].t0_ns : 0;
        for (int64_t i = 0; i < count[r]; i++) {
            int64_t v = all[(size_t)r * (size_t)stride + (size_t)i].t0_ns;
            if (v < origin[r]) origin[r] = v;
        }
        if (!count[r]) continue;
        if (origin[r] < lo) lo = origin[r];
        if (origin[r] > hi) hi = origin[r];
    }
    int aligned = lo != INT64_MAX && (uint64_t)(hi - lo) > TDM_TRAIN_TRACE_SKEW_NS;
    for (int r = 0; r < t->world && !aligned; r++) origin[r] = lo == INT64_MAX ? 0 : lo;
    tdm_train_trace_file c = {.t = t, .all = all, .count = count, .stride = stride,
                              .origin = origin, .process = process, .aligned = aligned};
    tdm_status st = tdm_json_write_file(t->path, "tandem train", tdm_train_trace_body, &c);
    free(origin);
    if (st != TDM_STATUS_OK) return st;
    int64_t total = 0;
    for (int r = 0; r < t->world; r++) total += count[r];
    printf("trace: %s (%lld events", t->path, (long long)total);
    if (dropped) printf("; %lld more past the %d each process keeps were left out",
                        (long long)dropped, TDM_TRAIN_TRACE_CAP);
    printf("; open in https://ui.perfetto.dev or chrome://tracing)\n");
    fflush(stdout);
    return TDM_STATUS_OK;
}

tdm_status tdm_train_trace_write(tdm_train_trace *t, tdm_comm *comm, const char *process)
{
    if (!t) return TDM_STATUS_OK;
    if (!comm || t->world == 1) {
        int64_t count = t->n;
        return tdm_train_trace_emit(t, t->ev, &count, t->n, t->dropped, process);
    }
    /* counts and drops of every rank, then the events to rank 0, each
     * rank's padded to the longest */
    int64_t mine[2] = {t->n, t->dropped};
    int64_t *cd = calloc((size_t)t->world * 2, sizeof *cd);
    TDM_REQUIRE(cd, TDM_STATUS_OUT_OF_MEMORY, "--trace: out of memory");
    tdm_status st = tdm_comm_all_gather(comm, mine, cd, 2, TDM_DTYPE_INT64);
    int64_t stride = 0, dropped = 0;
    int64_t *count = calloc((size_t)t->world, sizeof *count);
    if (!count && st == TDM_STATUS_OK)
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "--trace: out of memory");
    for (int r = 0; st == TDM_STATUS_OK && r < t->world; r++) {
        count[r] = cd[2 * r];
        dropped += cd[2 * r + 1];
        if (count[r] > stride) stride = count[r];
    }
    free(cd);
    if (st != TDM_STATUS_OK) {
        free(count);
        return st;
    }
    if (!stride) stride = 1;
    tdm_train_trace_ev *send = calloc((size_t)stride, sizeof *send);
    tdm_train_trace_ev *all = t->rank == 0 ? calloc((size_t)stride * (size_t)t->world,
                                                    sizeof *all) : NULL;
    if (send && t->n) memcpy(send, t->ev, (size_t)t->n * sizeof *send);
    if (!send || (t->rank == 0 && !all)) {
        /* the others are in the gather already: stop them, naming why */
        char why[96];
        snprintf(why, sizeof why, "--trace: rank %d has no memory for its %lld events", t->rank,
                 (long long)stride);
        (void)tdm_comm_abort(comm, why);
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s", why);
    } else {
        st = tdm_comm_gather(comm, send, all, (size_t)(stride * TDM_TRAIN_TRACE_EV_I64),
                             TDM_DTYPE_INT64, 0);
    }
    if (st == TDM_STATUS_OK && t->rank == 0)
        st = tdm_train_trace_emit(t, all, count, stride, dropped, process);
    free(send);
    free(all);
    free(count);
    return st;
}
