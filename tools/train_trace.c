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

struct tdm_train_trace {
    char *path;
    int rank, world;
    char track[48];
    tdm_train_trace_ev *ev;
    int64_t n, cap, dropped;
    int one_clock;        /* every rank on this machine's clock (tdm_train_trace_start) */
    int64_t sync_ns;      /* this rank's clock right after the start's barrier */
};

/* The phases in the order a step runs them (compare's order). */
static const tdm_phase tdm_train_trace_order[] = {
    TDM_PHASE_REPLICATE, TDM_PHASE_SCATTER,       TDM_PHASE_FORWARD,
    TDM_PHASE_GATHER,    TDM_PHASE_LOSS,          TDM_PHASE_BACKWARD,
    TDM_PHASE_REDUCE,    TDM_PHASE_ALLREDUCE_WAIT, TDM_PHASE_ALLGATHER_WAIT,
    TDM_PHASE_REDUCE_SCATTER_WAIT, TDM_PHASE_HOST_COPY, TDM_PHASE_STEP,
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
    int aligned;                     /* 1: each rank at its own sync point */
} tdm_train_trace_file;

static tdm_status tdm_train_trace_body(FILE *f, const void *ctx)
{
    const tdm_train_trace_file *c = ctx;
    fputs("{\"displayTimeUnit\": \"ms\", \"otherData\": {\"clock\": ", f);
    tdm_json_put_str(f, c->aligned ? "each rank's own CLOCK_MONOTONIC (the ranks are on several "
                                     "machines), 0 where every rank left the barrier before "
                                     "the first epoch"
                                   : "CLOCK_MONOTONIC, one for every rank (one machine)");
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

/* Rank 0: the origins (the earliest event of all on one clock, else each
 * rank's sync point) and the file. sync: per rank, its clock right after
 * the start's barrier (NULL: one clock). */
static tdm_status tdm_train_trace_emit(tdm_train_trace *t, const tdm_train_trace_ev *all,
                                       const int64_t *count, int64_t stride, int64_t dropped,
                                       const int64_t *sync, const char *process)
{
    int64_t *origin = calloc((size_t)t->world, sizeof *origin);
    TDM_REQUIRE(origin, TDM_STATUS_OUT_OF_MEMORY, "--trace: out of memory");
    int64_t lo = INT64_MAX;
    for (int r = 0; r < t->world; r++)
        for (int64_t i = 0; i < count[r]; i++) {
            int64_t v = all[(size_t)r * (size_t)stride + (size_t)i].t0_ns;
            if (v < lo) lo = v;
        }
    for (int r = 0; r < t->world; r++) origin[r] = sync ? sync[r] : lo == INT64_MAX ? 0 : lo;
    tdm_train_trace_file c = {.t = t, .all = all, .count = count, .stride = stride,
                              .origin = origin, .process = process, .aligned = sync != NULL};
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

tdm_status tdm_train_trace_start(tdm_train_trace *t, tdm_comm *comm, int one_clock)
{
    if (!t) return TDM_STATUS_OK;
    t->one_clock = one_clock || !comm || t->world == 1;
    if (!t->one_clock) TDM_CHECK(tdm_comm_barrier(comm));
    t->sync_ns = (int64_t)tdm_time_ns();
    return TDM_STATUS_OK;
}

/* A rank short of memory while the others are in (or on their way to)
 * the trace's collectives: stops them, naming why. */
static tdm_status tdm_train_trace_oom(const tdm_train_trace *t, tdm_comm *comm, int64_t what)
{
    char why[112];
    snprintf(why, sizeof why, "--trace: rank %d has no memory for %lld events' exchange",
             t->rank, (long long)what);
    (void)tdm_comm_abort(comm, why);
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s", why);
}

tdm_status tdm_train_trace_write(tdm_train_trace *t, tdm_comm *comm, const char *process)
{
    if (!t) return TDM_STATUS_OK;
    if (!comm || t->world == 1) {
        int64_t count = t->n;
        return tdm_train_trace_emit(t, t->ev, &count, t->n, t->dropped, NULL, process);
    }
    /* counts, drops and sync points of every rank, then the events to
     * rank 0, each rank's padded to the longest */
    enum { TDM_TT_N = 0, TDM_TT_DROPPED, TDM_TT_SYNC, TDM_TT_HEAD };
    int64_t mine[TDM_TT_HEAD] = {t->n, t->dropped, t->sync_ns};
    int64_t *head = calloc((size_t)t->world * TDM_TT_HEAD, sizeof *head);
    int64_t *count = calloc((size_t)t->world, sizeof *count);
    int64_t *sync = calloc((size_t)t->world, sizeof *sync);
    tdm_train_trace_ev *send = NULL, *all = NULL;
    int64_t stride = 0, dropped = 0;
    tdm_status st;
    if (!head || !count || !sync) {
        st = tdm_train_trace_oom(t, comm, t->n);
        goto done;
    }
    st = tdm_comm_all_gather(comm, mine, head, TDM_TT_HEAD, TDM_DTYPE_INT64);
    if (st != TDM_STATUS_OK) goto done;
    for (int r = 0; r < t->world; r++) {
        count[r] = head[TDM_TT_HEAD * r + TDM_TT_N];
        dropped += head[TDM_TT_HEAD * r + TDM_TT_DROPPED];
        sync[r] = head[TDM_TT_HEAD * r + TDM_TT_SYNC];
        if (count[r] > stride) stride = count[r];
    }
    if (!stride) stride = 1;
    send = calloc((size_t)stride, sizeof *send);
    all = t->rank == 0 ? calloc((size_t)stride * (size_t)t->world, sizeof *all) : NULL;
    if (!send || (t->rank == 0 && !all)) {
        st = tdm_train_trace_oom(t, comm, stride);
        goto done;
    }
    if (t->n) memcpy(send, t->ev, (size_t)t->n * sizeof *send);
    st = tdm_comm_gather(comm, send, all, (size_t)(stride * TDM_TRAIN_TRACE_EV_I64),
                         TDM_DTYPE_INT64, 0);
    if (st == TDM_STATUS_OK && t->rank == 0)
        st = tdm_train_trace_emit(t, all, count, stride, dropped, t->one_clock ? NULL : sync,
                                  process);
done:
    free(head);
    free(sync);
    free(send);
    free(all);
    free(count);
    return st;
}
