/* tools/doctor.c: `tandem doctor DIR`: reads every rank's flight-recorder
 * dump (DIR/fr_rank_<R>.json, core/flight.h) and the launcher's summary
 * (DIR/launch.json) when present, and says in a few lines what went
 * wrong: the first collective at which ranks disagree and who called
 * what, which rank stopped first and where, the ranks that never entered
 * the collective the others waited in, and the last completed step. The
 * exit code is the verdict (tools/doctor.h). It only reads files; it is
 * not a live debugger (it never attaches to a process). */
#include "tools/doctor.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "core/safefile.h"
#include "shm/spawn.h"
#include "tools/doctor_impl.h"
#include "tools/tools.h"

/* A string being built in a fixed buffer: appends stop at its end
 * (truncating), never past it, whatever the dumps hold. */
typedef struct tdm_doc_buf {
    char *p;
    size_t n, len;
} tdm_doc_buf;

static void tdm_doc_add(tdm_doc_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tdm_doc_add(tdm_doc_buf *b, const char *fmt, ...)
{
    if (!b->n || b->len >= b->n - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p + b->len, b->n - b->len, fmt, ap);
    va_end(ap);
    if (k > 0) b->len += (size_t)k;
    if (b->len > b->n - 1) b->len = b->n - 1;
}

static const tdm_doc_entry *tdm_doc_at(const tdm_doc_rank *r, uint64_t seq)
{
    if (!r->have || seq < r->first_seq || seq >= r->next_seq) return NULL;
    int lo = 0, hi = r->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (r->e[mid].seq == seq) return &r->e[mid];
        if (r->e[mid].seq < seq) lo = mid + 1; else hi = mid - 1;
    }
    return NULL;
}

/* The index of seq in r's entries, or of the first entry after it. */
static int tdm_doc_index(const tdm_doc_rank *r, uint64_t seq)
{
    int lo = 0, hi = r->n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (r->e[mid].seq < seq) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* What must agree between ranks: collective, dtype, op, count, root. */
static int tdm_doc_same(const tdm_doc_entry *a, const tdm_doc_entry *b)
{
    /* labels too when both ranks gave one: the same code labels the same
     * call alike, and two buckets of one size differ only by label */
    return !strcmp(a->coll, b->coll) && !strcmp(a->dtype, b->dtype) && !strcmp(a->op, b->op) &&
           a->count == b->count && a->root == b->root &&
           (!a->label[0] || !b->label[0] || !strcmp(a->label, b->label));
}

/* "all_reduce(float32, sum, count=48) 'ddp bucket 1'"; each string cut
 * to what the recorder can write (its label: 47 bytes), so that a
 * damaged dump cannot crowd out the rest of the line. */
void tdm_doc_call_str(const tdm_doc_entry *e, char *out, size_t n)
{
    tdm_doc_buf b = {out, n, 0};
    out[0] = 0;
    tdm_doc_add(&b, "%.24s(%.24s", e->coll, e->dtype);
    if (strcmp(e->op, "-")) tdm_doc_add(&b, ", %.24s", e->op);
    tdm_doc_add(&b, ", count=%" PRIu64, e->count);
    if (e->root >= 0) tdm_doc_add(&b, ", root=%" PRId64, e->root);
    tdm_doc_add(&b, ")");
    if (e->label[0]) tdm_doc_add(&b, " '%.64s'", e->label);
}

/* The summary's word on rank r: "was killed by signal 9 (Killed)", or
 * NULL when it has none or the rank exited 0. *induced: the launcher's
 * own teardown ended it. */
static const char *tdm_doc_summary_end(const tdm_doc *d, int r, int *induced, char *buf, size_t n)
{
    *induced = 0;
    const tdm_json *ranks = d->summary ? tdm_json_get(d->summary, "ranks") : NULL;
    if (!ranks || ranks->type != TDM_JSON_ARRAY || r >= ranks->n) return NULL;
    const tdm_json *o = &ranks->items[r];
    int64_t ws = tdm_doc_int(o, "wstatus", -1);
    if (ws < 0 || (WIFEXITED((int)ws) && WEXITSTATUS((int)ws) == 0)) return NULL;
    *induced = (int)tdm_doc_int(o, "induced", 0);
    tdm_shm_wait_status_str((int)ws, buf, n);
    return buf;
}

/* 1 when the summary says rank r was stalled: still running, with no dump
 * and no exit of its own, when the others had ended (a stopped or frozen
 * process; whatever ended it later was the teardown). */
static int tdm_doc_summary_stalled(const tdm_doc *d, int r)
{
    const tdm_json *ranks = d->summary ? tdm_json_get(d->summary, "ranks") : NULL;
    if (!ranks || ranks->type != TDM_JSON_ARRAY || r >= ranks->n) return 0;
    const tdm_json *o = &ranks->items[r];
    const tdm_json *v = o->type == TDM_JSON_OBJECT ? tdm_json_get(o, "stalled") : NULL;
    return v && v->type == TDM_JSON_BOOL && v->i;
}

/* Who the ranks' messages blame, and how: from "rank R (pid P) <what>". */
typedef struct tdm_doc_blame {
    int rank;                  /* -1: none found */
    tdm_doctor_verdict kind;
    char what[256];
} tdm_doc_blame;

/* Whom msg blames: the first "rank R (pid P) <how>" with R one of the
 * job's W ranks (a message naming another is not this job's word). */
static void tdm_doc_classify(const char *msg, int W, tdm_doc_blame *b)
{
    b->rank = -1;
    b->kind = TDM_DOCTOR_FAILED;
    b->what[0] = 0;
    if (!msg) return;
    for (const char *p = strstr(msg, "rank "); p; p = strstr(p + 1, "rank ")) {
        int r, pid, len = 0, part;
        /* "rank R (pid P)", or on a communicator split from the job's
         * "rank r (job rank R, pid P)": R is the job's */
        if (sscanf(p, "rank %d (job rank %d, pid %d)%n", &part, &r, &pid, &len) != 3 &&
            (len = 0, sscanf(p, "rank %d (pid %d)%n", &r, &pid, &len) != 2))
            continue;
        if (!len || r < 0 || r >= W) continue;
        const char *w = p + len;
        while (*w == ' ') w++;
        /* the deadline's word on the awaited peer (shm/wait.c) */
        static const char beat[] = ", whose heartbeat has not advanced";
        if (!strncmp(w, beat, sizeof beat - 1)) {
            b->kind = TDM_DOCTOR_STALLED;
            b->rank = r;
            snprintf(b->what, sizeof b->what, "was not heard from: the others timed out "
                     "waiting for it, its heartbeat standing still (stopped, frozen or starved "
                     "of CPU)");
            return;
        }
        if (!strncmp(w, "is stopped", 10) || !strncmp(w, "is frozen", 9))
            b->kind = TDM_DOCTOR_STALLED;
        else if (!strncmp(w, "was killed", 10) || !strncmp(w, "exited", 6) ||
                 !strncmp(w, "died", 4) || !strncmp(w, "ended", 5))
            b->kind = TDM_DOCTOR_DIED;
        else
            continue;
        b->rank = r;
        /* up to the first ';', newline or ':' outside parentheses */
        int depth = 0, k = 0;
        for (; w[k] && w[k] != ';' && w[k] != '\n' && k < (int)sizeof b->what - 1; k++) {
            if (w[k] == '(') depth++;
            else if (w[k] == ')' && depth > 0) depth--;
            else if (w[k] == ':' && depth == 0) break;
        }
        snprintf(b->what, sizeof b->what, "%.*s", k, w);
        return;
    }
    if (strstr(msg, "timed out") || strstr(msg, "did not complete within"))
        b->kind = TDM_DOCTOR_STALLED;
}

/* "rank 3" / "ranks 0,2", cut at n. */
static void tdm_doc_join(char *out, size_t n, const int *ranks, int k)
{
    tdm_doc_buf b = {out, n, 0};
    out[0] = 0;
    tdm_doc_add(&b, "%s", k > 1 ? "ranks " : "rank ");
    for (int i = 0; i < k && b.len < n - 1; i++) tdm_doc_add(&b, "%s%d", i ? "," : "", ranks[i]);
}

/* --- the diagnosis, phase by phase ---------------------------------------------
 * 1. the first seq at which ranks disagree (DESYNC), 2. how each rank ended
 * and whom the messages blame, 3. the frontier (the collective the others
 * waited in), then the verdict line, 4. who stopped first and where, 5. who
 * never entered the frontier's collective, 6. the last completed step and
 * each rank's end. Each phase reads the dumps and what earlier ones found. */

/* The ranks' calls at the first disagreeing seq, grouped by what they
 * called (at most 8 groups kept). */
#define TDM_DOC_GROUPS 8
typedef struct tdm_doc_groups {
    const tdm_doc_entry *ref[TDM_DOC_GROUPS];
    int size[TDM_DOC_GROUPS];
    int n, biggest;
} tdm_doc_groups;

typedef struct tdm_doc_diag {
    tdm_doc d;
    int W;
    tdm_doctor_verdict v;
    char verdict[1024];
    char details[4096];
    size_t dl;
    int64_t bad;                            /* 1: first disagreeing seq; -1: none */
    int desync_rank;                        /* 1: the odd one out; -1: none */
    int missing[TDM_DOC_MAX_RANKS], nmissing, nfailed;   /* 2 */
    int nterm;                              /* 2: dumps of ranks ended from outside */
    tdm_doc_blame blame;                    /* 2 */
    uint64_t front;                         /* 3: the furthest next_seq */
    const tdm_doc_entry *waiting;           /* 3: the collective the others waited in */
    const char *dir;
} tdm_doc_diag;

static void tdm_doc_detail(tdm_doc_diag *g, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void tdm_doc_detail(tdm_doc_diag *g, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(g->details + g->dl, g->dl < sizeof g->details ? sizeof g->details - g->dl : 0,
                      fmt, ap);
    va_end(ap);
    if (k > 0) g->dl += (size_t)k;
    if (g->dl > sizeof g->details) g->dl = sizeof g->details;
}

/* 1. The first seq at which two ranks' calls differ (send/recv are not
 * compared: only two ranks take part). Every rank's entries, sorted by
 * seq, then compared within each seq: the work is bounded by the entries
 * the dumps hold, whatever numbers they claim. */
typedef struct tdm_doc_ref {
    uint64_t seq;
    const tdm_doc_entry *e;
} tdm_doc_ref;

static int tdm_doc_cmp_ref(const void *a, const void *b)
{
    const tdm_doc_ref *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static void tdm_doc_first_mismatch(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    size_t total = 0, k = 0;
    g->bad = -1;
    for (int r = 0; r < g->W; r++) total += d->r[r].have ? (size_t)d->r[r].n : 0;
    tdm_doc_ref *all = calloc(total + 1, sizeof *all);
    if (!all) return;
    for (int r = 0; r < g->W; r++)
        for (int i = 0; d->r[r].have && i < d->r[r].n; i++) {
            const tdm_doc_entry *e = &d->r[r].e[i];
            if (!strcmp(e->coll, "send") || !strcmp(e->coll, "recv")) continue;
            all[k++] = (tdm_doc_ref){e->seq, e};
        }
    /* qsort is not stable, but any member of a seq's group is a fine
     * reference: the group disagrees if any two differ from each other,
     * and then some member differs from any chosen one */
    if (k) qsort(all, k, sizeof *all, tdm_doc_cmp_ref);
    for (size_t i = 0, j; i < k && g->bad < 0; i = j) {
        for (j = i + 1; j < k && all[j].seq == all[i].seq; j++)
            if (!tdm_doc_same(all[i].e, all[j].e)) g->bad = (int64_t)all[i].seq;
    }
    free(all);
}

/* 1. The ranks grouped by what they called at seq bad, and the verdict
 * line that lists the groups. */
static void tdm_doc_desync_groups(tdm_doc_diag *g, tdm_doc_groups *gr)
{
    const tdm_doc *d = &g->d;
    int done[TDM_DOC_MAX_RANKS] = {0}, bigsize = 0;
    char groups[2048] = "";
    size_t gl = 0;
    gr->n = 0;
    gr->biggest = -1;
    for (int r = 0; r < g->W; r++) {
        const tdm_doc_entry *e = tdm_doc_at(&d->r[r], (uint64_t)g->bad);
        if (!e || done[r]) continue;
        int members[TDM_DOC_MAX_RANKS], k = 0;
        for (int q = r; q < g->W; q++) {
            const tdm_doc_entry *f = tdm_doc_at(&d->r[q], (uint64_t)g->bad);
            if (f && !done[q] && tdm_doc_same(e, f)) { members[k++] = q; done[q] = 1; }
        }
        char who[256], call[256];
        tdm_doc_join(who, sizeof who, members, k);
        tdm_doc_call_str(e, call, sizeof call);
        if (gl < sizeof groups - 1) {
            gl += (size_t)snprintf(groups + gl, sizeof groups - gl, "%s%s called %s",
                                   gr->n ? "; " : "", who, call);
            if (gl > sizeof groups - 1) gl = sizeof groups - 1;
        }
        if (gr->n < TDM_DOC_GROUPS) { gr->ref[gr->n] = e; gr->size[gr->n] = k; }
        if (k > bigsize) { bigsize = k; gr->biggest = gr->n; }
        gr->n++;
    }
    snprintf(g->verdict, sizeof g->verdict, "DESYNC at collective #%" PRId64 ": %.900s", g->bad,
             groups);
}

/* 1. Did rank r (whose call at bad is e) skip the call that rank q of the
 * majority (whose call there is m) made? Its call is the one that comes
 * right after the majority's: at bad+1 on q, or earlier in q's history. */
static int tdm_doc_skipped(const tdm_doc_diag *g, int q, const tdm_doc_entry *e,
                           const tdm_doc_entry *m)
{
    const tdm_doc_rank *rq = &g->d.r[q];
    const tdm_doc_entry *m1 = tdm_doc_at(rq, (uint64_t)g->bad + 1);
    if (m1 && tdm_doc_same(e, m1)) return 1;
    /* back through q's history, entry by entry (not seq by seq: a damaged
     * dump's numbers must not set the work) */
    for (int i = tdm_doc_index(rq, (uint64_t)g->bad) - 1; i > 0; i--) {
        const tdm_doc_entry *hp = &rq->e[i], *hp0 = &rq->e[i - 1];
        if (hp0->seq + 1 == hp->seq && tdm_doc_same(e, hp)) return tdm_doc_same(m, hp0);
    }
    return 0;
}

/* 1. "  rank R called: #5 ..., #6 ..., #7 ... (failed)": rank r's last
 * calls up to the first mismatch (and one after it, if it went on). */
#define TDM_DOC_CALLS_SHOWN 3
static void tdm_doc_calls_upto(tdm_doc_diag *g, int r)
{
    const tdm_doc_rank *rr = &g->d.r[r];
    int at = tdm_doc_index(rr, (uint64_t)g->bad);
    int lo = at - (TDM_DOC_CALLS_SHOWN - 1) > 0 ? at - (TDM_DOC_CALLS_SHOWN - 1) : 0;
    int hi = at + 1 < rr->n ? at + 1 : rr->n - 1;
    char line[1024];
    tdm_doc_buf b = {line, sizeof line, 0};
    line[0] = 0;
    for (int i = lo; i <= hi; i++) {
        char call[256];
        tdm_doc_call_str(&rr->e[i], call, sizeof call);
        tdm_doc_add(&b, "%s#%" PRIu64 " %s", i > lo ? ", " : "", rr->e[i].seq, call);
        if (strcmp(rr->e[i].state, "done")) tdm_doc_add(&b, " (%.16s)", rr->e[i].state);
    }
    tdm_doc_detail(g, "    rank %d called: %s\n", r, line);
}

/* 1. A DESYNC: the groups, the ranks that skipped a call, the odd one out. */
static void tdm_doc_desync(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    g->v = TDM_DOCTOR_DESYNC;
    tdm_doc_groups gr;
    tdm_doc_desync_groups(g, &gr);
    /* A tie between the biggest groups (one rank against one: the common
     * `if rank == 0:` bug) has no majority: an extra call on one side and
     * a skipped one on the other leave the same records, so no side is
     * named; each group's calls up to the mismatch are shown instead. */
    int ties = 0;
    for (int k = 0; k < gr.n && k < TDM_DOC_GROUPS && gr.biggest >= 0; k++)
        ties += gr.size[k] == gr.size[gr.biggest];
    for (int k = 0; k < gr.n && k < TDM_DOC_GROUPS && gr.biggest >= 0; k++) {
        if (k == gr.biggest) continue;
        for (int r = 0; r < g->W; r++) {
            const tdm_doc_entry *e = tdm_doc_at(&d->r[r], (uint64_t)g->bad);
            if (e != gr.ref[k]) continue;
            for (int q = 0; q < g->W; q++) {
                const tdm_doc_entry *m = tdm_doc_at(&d->r[q], (uint64_t)g->bad);
                if (m != gr.ref[gr.biggest]) continue;
                char call[256];
                if (tdm_doc_skipped(g, q, e, m)) {
                    tdm_doc_call_str(m, call, sizeof call);
                    if (ties > 1)
                        tdm_doc_detail(g, "  either rank %d skipped %s, or rank %d called it "
                                          "where the others did not\n", r, call, q);
                    else
                        tdm_doc_detail(g, "  rank %d skipped %s: it went on to the call that "
                                          "follows it\n", r, call);
                } else if (ties > 1 && tdm_doc_skipped(g, r, m, e)) {
                    tdm_doc_call_str(e, call, sizeof call);
                    tdm_doc_detail(g, "  either rank %d skipped %s, or rank %d called it where "
                                      "the others did not\n", q, call, r);
                }
                break;
            }
        }
    }
    if (ties > 1) {
        tdm_doc_detail(g, "  no majority (%d rank%s against %d): the records cannot tell which "
                          "side went wrong (one called a collective the other did not, or "
                          "skipped one); their calls:\n", gr.size[gr.biggest],
                       gr.size[gr.biggest] > 1 ? "s" : "", gr.size[gr.biggest]);
        for (int k = 0; k < gr.n && k < TDM_DOC_GROUPS; k++)
            for (int r = 0; r < g->W; r++)
                if (tdm_doc_at(&d->r[r], (uint64_t)g->bad) == gr.ref[k]) {
                    tdm_doc_calls_upto(g, r);
                    break;
                }
        return;
    }
    /* the odd one out: the first rank of the smallest group */
    int small = gr.biggest == 0 && gr.n > 1 ? 1 : 0;
    for (int k = 0; k < gr.n && k < TDM_DOC_GROUPS; k++)
        if (k != gr.biggest && gr.size[k] < gr.size[small]) small = k;
    for (int r = 0; r < g->W && g->desync_rank < 0; r++)
        if (tdm_doc_at(&d->r[r], (uint64_t)g->bad) == gr.ref[small]) g->desync_rank = r;
}

/* A dump written because the process was ended from outside (SIGTERM
 * from mpirun after another rank's death, or from the user; "job abort":
 * another rank of an MPI job asked for it before ending the job), not by
 * a failure of its own. */
static int tdm_doc_ended_from_outside(const tdm_doc_rank *r)
{
    return !r->failed && (!strcmp(r->trigger, "SIGTERM") || !strcmp(r->trigger, "SIGINT") ||
                          !strcmp(r->trigger, "job abort") || !strcmp(r->trigger, "exit"));
}

/* 2. How each rank ended, and who is blamed: the launcher's cause, else a
 * failed rank's reason, else a rank without a dump that ended by itself,
 * else (when something failed) the first rank without a dump. */
static void tdm_doc_find_blame(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    char buf[sizeof g->blame.what];
    g->blame = (tdm_doc_blame){.rank = -1, .kind = TDM_DOCTOR_OK};
    if (d->cause) tdm_doc_classify(d->cause, g->W, &g->blame);
    for (int r = 0; r < g->W; r++) {
        if (!d->r[r].have) { g->missing[g->nmissing++] = r; continue; }
        if (!d->r[r].failed) {
            g->nterm += tdm_doc_ended_from_outside(&d->r[r]);
            continue;
        }
        g->nfailed++;
        if (g->blame.rank < 0) {
            tdm_doc_blame b;
            tdm_doc_classify(d->r[r].reason, g->W, &b);
            if (b.rank >= 0 || g->blame.kind == TDM_DOCTOR_OK) g->blame = b;
        }
    }
    /* a rank that never ended by itself while the others did: stopped or
     * frozen, however the teardown ended it after */
    for (int i = 0; i < g->nmissing && (g->blame.rank < 0 || g->blame.kind == TDM_DOCTOR_DIED);
         i++) {
        if (!tdm_doc_summary_stalled(d, g->missing[i])) continue;
        /* a rank that exited after its dump said why (the abort that
         * followed a timeout waiting, through others, for the stopped
         * one: the launcher saw its exit first) did not die of itself */
        if (g->blame.rank >= 0 && g->blame.rank != g->missing[i] &&
            (g->blame.rank >= g->W || !d->r[g->blame.rank].have))
            continue;
        g->blame.rank = g->missing[i];
        g->blame.kind = TDM_DOCTOR_STALLED;
        snprintf(g->blame.what, sizeof g->blame.what, "was stopped or frozen: it left no dump "
                 "and did not end by itself while the others did");
    }
    for (int i = 0; i < g->nmissing && g->blame.rank < 0; i++) {
        int induced;
        const char *end = tdm_doc_summary_end(d, g->missing[i], &induced, buf, sizeof buf);
        if (end && !induced) {
            g->blame.rank = g->missing[i];
            g->blame.kind = TDM_DOCTOR_DIED;
            snprintf(g->blame.what, sizeof g->blame.what, "%s", end);
        }
    }
    /* a rank without a dump, while the others failed or were ended from
     * outside (mpirun's SIGTERM after a rank's death): it is the one that
     * died (a SIGKILLed rank cannot write) */
    if (g->blame.rank < 0 && g->nmissing > 0 && (g->nfailed > 0 || d->cause || g->nterm > 0)) {
        /* the failed ranks' word was a timeout (tdm_doc_classify: STALLED
         * with no rank named): the missing rank was alive and did not take
         * part, and the teardown ended it after (mpirun's SIGKILL can come
         * before a stopped rank, sent SIGCONT and SIGTERM, dumps) */
        int waited = g->blame.kind == TDM_DOCTOR_STALLED;
        g->blame.rank = g->missing[0];
        g->blame.kind = waited ? TDM_DOCTOR_STALLED : TDM_DOCTOR_DIED;
        snprintf(g->blame.what, sizeof g->blame.what, "%s",
                 waited ? "left no dump, and the others timed out waiting for it: stopped or "
                          "frozen (the teardown ended it after)"
                        : "left no dump (killed, or stopped and then killed)");
    }
}

/* 3. The frontier: the collective the ranks that went furthest are in, or
 * the first one that did not complete. */
static void tdm_doc_frontier(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    int front_rank = -1;
    g->front = 0;
    for (int r = 0; r < g->W; r++)
        if (d->r[r].have && d->r[r].next_seq > g->front) {
            g->front = d->r[r].next_seq;
            front_rank = r;
        }
    /* A collective that completed on any rank was entered by every rank
     * (each waits for every other's arrival), so the ranks that stopped
     * stopped after the last one completed anywhere: the collective the
     * others waited in is the one after it, as any rank recorded it. Not
     * a rank's first unfinished entry: a rank that was slow to finish
     * collective #6 while a peer died may have failed it (its data was
     * complete, the peer had entered #7's predecessor and left), although
     * another rank had already entered #7. (send and recv involve two
     * ranks only: they prove nothing of the others.) */
    int64_t done = -1;
    for (int r = 0; r < g->W; r++)
        for (int i = d->r[r].have ? d->r[r].n - 1 : -1; i >= 0; i--)
            if (!strcmp(d->r[r].e[i].state, "done") && strcmp(d->r[r].e[i].coll, "send") &&
                strcmp(d->r[r].e[i].coll, "recv")) {
                if ((int64_t)d->r[r].e[i].seq > done) done = (int64_t)d->r[r].e[i].seq;
                break;
            }
    g->waiting = NULL;
    for (int r = 0; r < g->W; r++) {
        const tdm_doc_entry *e = tdm_doc_at(&d->r[r], (uint64_t)(done + 1));
        /* prefer a rank that was still in it (its state says how it ended) */
        if (e && (!g->waiting || !strcmp(g->waiting->state, "done"))) g->waiting = e;
    }
    if (g->waiting) return;
    /* nothing recorded after the last completed collective: the last call
     * of the rank that went furthest, or the first that did not complete */
    g->waiting = front_rank >= 0 ? tdm_doc_at(&d->r[front_rank], g->front - 1) : NULL;
    for (int r = 0; r < g->W; r++)
        for (int i = 0; d->r[r].have && i < d->r[r].n; i++)
            if (strcmp(d->r[r].e[i].state, "done")) {
                const tdm_doc_entry *w = g->waiting;
                if (!w || d->r[r].e[i].seq < w->seq || !strcmp(w->state, "done"))
                    g->waiting = &d->r[r].e[i];
                break;
            }
    /* a collective every rank completed is not one they waited in (nor
     * one a rank never entered): a job that went on to train on
     * communicators split from this one (tools/doctor_sub.c) */
    if (g->waiting && !strcmp(g->waiting->state, "done")) g->waiting = NULL;
}

/* The verdict line, unless phase 1 made it: the blamed rank, a failure
 * without one, ranks without a dump, or OK. */
static void tdm_doc_verdict(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    if (g->v != TDM_DOCTOR_OK) return;
    if (g->blame.rank >= 0) {
        g->v = g->blame.kind;
        snprintf(g->verdict, sizeof g->verdict, "%s: rank %d %s",
                 g->v == TDM_DOCTOR_STALLED ? "STALLED" : g->v == TDM_DOCTOR_DIED ? "DIED"
                                                                                 : "FAILED",
                 g->blame.rank, g->blame.what);
        if (g->waiting) {
            char call[256];
            tdm_doc_call_str(g->waiting, call, sizeof call);
            size_t l = strlen(g->verdict);
            snprintf(g->verdict + l, sizeof g->verdict - l, "; the others waited in %s #%" PRIu64,
                     call, g->waiting->seq);
        } else {
            char sub[512];
            size_t l = strlen(g->verdict);
            if (tdm_doc_sub_wait(g->dir, g->d.job[0] ? g->d.job : NULL, g->blame.rank, sub, sizeof sub))
                snprintf(g->verdict + l, sizeof g->verdict - l, "; the others waited in %s", sub);
        }
    } else if (g->nfailed > 0 || d->cause) {
        int first = -1;
        for (int r = 0; r < g->W; r++)
            if (d->r[r].have && d->r[r].failed) { first = r; break; }
        tdm_doc_classify(first >= 0 ? d->r[first].reason : d->cause, g->W, &g->blame);
        g->v = g->blame.kind == TDM_DOCTOR_STALLED ? TDM_DOCTOR_STALLED : TDM_DOCTOR_FAILED;
        /* a wait that timed out names no one; the records may: a rank
         * whose record stops before the collective the others waited in
         * is the one they waited for */
        int late = -1;
        for (int r = 0; g->v == TDM_DOCTOR_STALLED && g->waiting && r < g->W && late < 0; r++)
            if (d->r[r].have && d->r[r].next_seq <= g->waiting->seq) late = r;
        if (late >= 0) {
            char call[256];
            tdm_doc_call_str(g->waiting, call, sizeof call);
            snprintf(g->verdict, sizeof g->verdict, "STALLED: rank %d never entered %s #%" PRIu64
                     " (its record stops before it); the others waited for it: %.600s%s", late,
                     call, g->waiting->seq, first >= 0 ? d->r[first].reason : d->cause,
                     first >= 0 ? "" : " (launcher)");
            g->blame.rank = late;
            return;
        }
        snprintf(g->verdict, sizeof g->verdict, "%s: %s%s",
                 g->v == TDM_DOCTOR_STALLED ? "STALLED" : "FAILED", first >= 0 ? "" : "launcher: ",
                 first >= 0 ? d->r[first].reason : d->cause);
        if (first >= 0) {
            size_t l = strlen(g->verdict);
            snprintf(g->verdict + l, sizeof g->verdict - l, " (rank %d)", first);
        }
    } else if (g->nterm > 0) {
        char buf[512];
        int ended[TDM_DOC_MAX_RANKS], k = 0;
        for (int r = 0; r < g->W; r++)
            if (d->r[r].have && tdm_doc_ended_from_outside(&d->r[r])) ended[k++] = r;
        tdm_doc_join(buf, sizeof buf, ended, k);
        g->v = TDM_DOCTOR_FAILED;
        snprintf(g->verdict, sizeof g->verdict, "FAILED: %s %s ended by a signal from outside "
                 "(%s: mpirun after a failure elsewhere, or the user) and no rank reported a "
                 "failure", buf, k > 1 ? "were" : "was", d->r[ended[0]].trigger);
    } else if (g->nmissing > 0) {
        char buf[512];
        g->v = TDM_DOCTOR_DIED;
        tdm_doc_join(buf, sizeof buf, g->missing, g->nmissing);
        int unusable = 0;
        for (int i = 0; i < g->nmissing; i++) unusable |= d->r[g->missing[i]].unusable;
        snprintf(g->verdict, sizeof g->verdict,
                 "DIED: %s left no %sdump and no rank reported a failure", buf,
                 unusable ? "usable " : "");
    } else {
        snprintf(g->verdict, sizeof g->verdict, "OK: %d rank(s) agree on %" PRIu64
                 " collective(s), none failed", g->W, g->front);
    }
}

/* 4. Who stopped first and where: the odd one out, the blamed rank, else
 * the rank with the shortest record (ties: the one quiet longest). */
static void tdm_doc_first_stop(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    /* a desync without a majority names no one (phase 1 said why) */
    if (g->v == TDM_DOCTOR_DESYNC && g->desync_rank < 0) return;
    int first_rank = g->desync_rank >= 0 ? g->desync_rank : g->blame.rank;
    if (first_rank < 0) {
        uint64_t best = UINT64_MAX, best_t = UINT64_MAX;
        for (int r = 0; r < g->W; r++)
            if (d->r[r].have && (d->r[r].next_seq < best ||
                                 (d->r[r].next_seq == best && d->r[r].last_activity < best_t))) {
                best = d->r[r].next_seq;
                best_t = d->r[r].last_activity;
                first_rank = r;
            }
    }
    if (g->v == TDM_DOCTOR_OK || first_rank < 0) return;
    const tdm_doc_rank *fr = &d->r[first_rank];
    char sub[512];
    if (fr->have && fr->n && !strcmp(fr->e[fr->n - 1].state, "done") &&
        tdm_doc_sub_stop(g->dir, g->d.job[0] ? g->d.job : NULL, first_rank, sub, sizeof sub)) {
        /* its first communicator ended with the splits: it stopped in one
         * of those (tools/doctor_sub.c) */
        tdm_doc_detail(g, "  %s: rank %d, in %s\n",
                       g->desync_rank >= 0 ? "odd one out" : "stopped first", first_rank, sub);
    } else if (fr->have && fr->n) {
        const tdm_doc_entry *e = &fr->e[fr->n - 1];
        char call[256];
        tdm_doc_call_str(e, call, sizeof call);
        tdm_doc_detail(g, "  %s: rank %d, in %s #%" PRIu64 " (%s, step %" PRId64 ")\n",
                       g->desync_rank >= 0 ? "odd one out" : "stopped first", first_rank, call,
                       e->seq, e->state, e->step);
    } else {
        char buf[512];
        int induced;
        const char *end = tdm_doc_summary_end(d, first_rank, &induced, buf, sizeof buf);
        if (tdm_doc_summary_stalled(d, first_rank))   /* its SIGKILL was the teardown's */
            end = "stopped or frozen; the launcher's teardown killed it after";
        tdm_doc_detail(g, "  stopped first: rank %d (%s), no flight record of its own\n",
                       first_rank, end ? end : g->blame.what[0] ? g->blame.what : "no dump");
    }
}

/* 5. The ranks that never entered the collective the others are in. */
static void tdm_doc_never_entered(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    if (g->v == TDM_DOCTOR_OK || !g->waiting) return;
    int never[TDM_DOC_MAX_RANKS], k = 0, in[TDM_DOC_MAX_RANKS], m = 0;
    for (int r = 0; r < g->W; r++) {
        if (d->r[r].have && d->r[r].next_seq > g->waiting->seq) in[m++] = r;
        else never[k++] = r;
    }
    if (k == 0) return;
    char who[256], inw[256], call[256];
    tdm_doc_join(who, sizeof who, never, k);
    tdm_doc_join(inw, sizeof inw, in, m);
    tdm_doc_call_str(g->waiting, call, sizeof call);
    tdm_doc_detail(g, "  never entered %s #%" PRIu64 ": %s%s (%s did)\n", call, g->waiting->seq,
                   who, g->nmissing ? " (a rank without a dump counts as not entered)" : "", inw);
}

/* 6. The last completed step (the lowest over the dumps), then each rank's
 * own end and the launcher's cause. */
static void tdm_doc_steps_and_ends(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    int64_t smin = INT64_MAX, smax = INT64_MIN;
    for (int r = 0; r < g->W; r++) {
        if (!d->r[r].have) continue;
        if (d->r[r].last_step < smin) smin = d->r[r].last_step;
        if (d->r[r].last_step > smax) smax = d->r[r].last_step;
    }
    if (smin > smax)
        tdm_doc_detail(g, "  last completed step: unknown (no dump)\n");
    else if (smin == smax)
        tdm_doc_detail(g, "  last completed step: %" PRId64 " (every rank with a dump)\n", smin);
    else
        tdm_doc_detail(g, "  last completed step: %" PRId64 " (some ranks reached %" PRId64 ")\n",
                       smin, smax);
    if (g->v == TDM_DOCTOR_OK) return;
    for (int r = 0; r < g->W; r++) {
        if (!d->r[r].have) {
            char buf[512];
            int induced;
            const char *end = tdm_doc_summary_end(d, r, &induced, buf, sizeof buf);
            tdm_doc_detail(g, "  rank %d: no %sdump%s%s%s\n", r,
                           d->r[r].unusable ? "usable " : "", end ? "; " : "", end ? end : "",
                           end && induced ? " (by the launcher's teardown)" : "");
        } else if (d->r[r].failed) {
            tdm_doc_detail(g, "  rank %d: %s: %s\n", r, d->r[r].status, d->r[r].reason);
        } else {
            tdm_doc_detail(g, "  rank %d: no failure recorded (dump: %s)\n", r, d->r[r].trigger);
        }
    }
    if (d->cause) tdm_doc_detail(g, "  launcher: %s\n", d->cause);
}

/* A stalled rank's end, whatever it was, was the teardown's. */
static const char *tdm_doc_end_of(void *ctx, int rank, int *induced, char *buf, size_t n)
{
    const char *end = tdm_doc_summary_end(ctx, rank, induced, buf, n);
    if (end && tdm_doc_summary_stalled(ctx, rank)) *induced = 1;
    return end;
}

/* A pipeline's transfers left waiting: its verdict (who never sent what)
 * replaces the collectives' one, which stays among the details. */
static void tdm_doc_pipeline(tdm_doc_diag *g, const char *dir)
{
    char line[sizeof g->verdict];
    tdm_doctor_verdict v;
    if (!tdm_doctor_pipeline(dir, tdm_doc_end_of, &g->d, &v, line, sizeof line)) return;
    if (v == TDM_DOCTOR_FAILED && (g->v == TDM_DOCTOR_DIED || g->v == TDM_DOCTOR_STALLED)) {
        /* the stage that never sent failed of another's death: that one */
        tdm_doc_detail(g, "  pipeline: %s\n", line);
        return;
    }
    tdm_doc_detail(g, "  collectives: %s\n", g->verdict);
    snprintf(g->verdict, sizeof g->verdict, "%s", line);
    g->v = v;
}

/* An RPC job's calls (the parameter server's): their verdict replaces
 * the collectives' one (a ps job's few collectives are its set-up). */
static void tdm_doc_rpc(tdm_doc_diag *g, const char *dir)
{
    char line[sizeof g->verdict], det[1024];
    tdm_doctor_verdict v;
    if (!tdm_doctor_rpc(dir, tdm_doc_end_of, &g->d, &v, line, sizeof line, det, sizeof det)) return;
    tdm_doc_detail(g, "  collectives: %s\n%s", g->verdict, det);
    snprintf(g->verdict, sizeof g->verdict, "%s", line);
    g->v = v;
}

tdm_doctor_verdict tdm_doctor_diagnose(const char *dir, FILE *out, char *line, size_t n)
{
    tdm_doc_diag *g = calloc(1, sizeof *g);
    if (!g) {
        if (out) fprintf(out, "verdict: out of memory\n");
        if (line) snprintf(line, n, "out of memory");
        return TDM_DOCTOR_UNREADABLE;
    }
    int got = tdm_doc_read(&g->d, dir);
    tdm_doctor_verdict v;
    /* the launcher's summary alone still names who failed (a program
     * without a communicator, or one that died before making it) */
    if ((got <= 0 && !g->d.summary) || !g->d.r || g->d.world <= 0) {
        if (got < 0)
            snprintf(g->verdict, sizeof g->verdict, "no flight-recorder dump in %s (cannot open "
                     "the directory)", dir);
        else if (g->d.skipped)
            snprintf(g->verdict, sizeof g->verdict, "no flight-recorder dump in %s (%d file(s) "
                     "not usable, below)", dir, g->d.skipped);
        else
            snprintf(g->verdict, sizeof g->verdict, "no flight-recorder dump in %s (no "
                     "fr_rank_<R>.json)", dir);
        v = TDM_DOCTOR_UNREADABLE;
    } else {
        g->W = g->d.world;
        g->dir = dir;
        g->v = TDM_DOCTOR_OK;
        g->desync_rank = -1;
        tdm_doc_first_mismatch(g);
        if (g->bad >= 0) tdm_doc_desync(g);
        tdm_doc_find_blame(g);
        tdm_doc_frontier(g);
        tdm_doc_verdict(g);
        tdm_doc_first_stop(g);
        tdm_doc_never_entered(g);
        tdm_doc_steps_and_ends(g);
        tdm_doc_pipeline(g, dir);
        tdm_doc_rpc(g, dir);
        v = g->v;
    }
    if (out) fprintf(out, "verdict: %s\n%s%s", g->verdict, g->details, g->d.notes);
    if (line) snprintf(line, n, "%s", g->verdict);
    tdm_doc_free(&g->d);
    free(g);
    return v;
}

static void tdm_doctor_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem doctor DIR\n"
        "\n"
        "Reads the flight-recorder dumps of a job (DIR/fr_rank_<R>.json, written when\n"
        "TANDEM_FR_DUMP=DIR, and by tandem launch / tandem train on a failure) and the\n"
        "launcher's summary (DIR/launch.json) when present, and prints the diagnosis:\n"
        "the first collective at which ranks disagree and who called what, which rank\n"
        "stopped first and where, ranks that never entered the collective the others\n"
        "waited in, and the last completed step. See docs/DEBUGGING.md.\n"
        "\n"
        "Exit codes (the verdict): 0 OK, 1 no readable dump, 2 bad usage, 3 DESYNC,\n"
        "4 DIED (a rank was killed or exited non-zero), 5 STALLED (a rank stopped or\n"
        "froze, or a wait timed out), 6 FAILED (a rank's own error or an abort).\n");
}

int tdm_tool_doctor_main(int argc, char **argv)
{
    const char *dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tdm_doctor_usage(stdout);
            return 0;
        }
        if (argv[i][0] == '-' || dir) {
            fprintf(stderr, "tandem doctor: unexpected argument '%s' (see tandem doctor --help)\n",
                    argv[i]);
            return 2;
        }
        dir = argv[i];
    }
    if (!dir) {
        tdm_doctor_usage(stderr);
        return 2;
    }
    struct stat sb, lb;
    if (stat(dir, &sb) == 0 && !S_ISDIR(sb.st_mode)) {
        /* a FIFO, a device or a file: not "no dump in it" */
        fprintf(stderr, "tandem doctor: %s: is %s%s, not a directory: give the directory the "
                        "dumps are in\n", dir,
                lstat(dir, &lb) == 0 && S_ISLNK(lb.st_mode) ? "a symbolic link to " : "",
                tdm_file_kind(sb.st_mode));
        return 2;
    }
    return (int)tdm_doctor_diagnose(dir, stdout, NULL, 0);
}
