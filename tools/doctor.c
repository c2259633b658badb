/* tools/doctor.c: `tandem doctor DIR`: reads every rank's flight-recorder
 * dump (DIR/fr_rank_<R>.json, core/flight.h) and the launcher's summary
 * (DIR/launch.json) when present, and says in a few lines what went
 * wrong: the first collective at which ranks disagree and who called
 * what, which rank stopped first and where, the ranks that never entered
 * the collective the others waited in, and the last completed step. The
 * exit code is the verdict (tools/doctor.h). It only reads files; it is
 * not a live debugger (it never attaches to a process). */
#include "tools/doctor.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/json.h"
#include "core/safefile.h"
#include "shm/spawn.h"
#include "tools/tools.h"

#define TDM_DOC_MAX_RANKS 1024

typedef struct tdm_doc_entry {
    uint64_t seq, count;
    int64_t root, step;
    const char *coll, *dtype, *op, *label, *state, *status;
    uint64_t t_enq, t_start, t_end;
} tdm_doc_entry;

typedef struct tdm_doc_rank {
    int have;
    tdm_json *doc;
    int failed;
    const char *reason, *status, *trigger;
    int64_t last_step, pid;
    uint64_t next_seq, first_seq;   /* entries hold seqs [first_seq, next_seq) */
    int n;
    tdm_doc_entry *e;               /* (n), by seq */
    uint64_t last_activity;         /* latest time stamp of any entry */
} tdm_doc_rank;

typedef struct tdm_doc {
    int world;
    tdm_doc_rank *r;                /* (world) */
    tdm_json *summary;
    const char *cause;              /* summary's cause, or NULL */
} tdm_doc;

static const char *tdm_doc_str(const tdm_json *o, const char *k, const char *dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && v->type == TDM_JSON_STRING ? v->str : dflt;
}

static int64_t tdm_doc_int(const tdm_json *o, const char *k, int64_t dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && (v->type == TDM_JSON_INT || v->type == TDM_JSON_BOOL) ? v->i : dflt;
}

static tdm_json *tdm_doc_load(const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = -1;
    size_t nbytes = 0;
    if (tdm_file_open_read(path, &fd, &nbytes)) return NULL;
    char *buf = malloc(nbytes + 1);
    size_t got = 0;
    while (buf && got < nbytes) {
        ssize_t k = read(fd, buf + got, nbytes - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    tdm_json *doc = NULL;
    if (buf && got == nbytes && tdm_json_parse(&doc, buf, nbytes)) doc = NULL;
    free(buf);
    return doc;
}

tdm_json *tdm_doctor_load(const char *dir, const char *name) { return tdm_doc_load(dir, name); }

static int tdm_doc_cmp_seq(const void *a, const void *b)
{
    const tdm_doc_entry *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static void tdm_doc_take(tdm_doc_rank *r, tdm_json *doc)
{
    r->have = 1;
    r->doc = doc;
    r->failed = (int)tdm_doc_int(doc, "failed", 0);
    r->reason = tdm_doc_str(doc, "reason", "");
    r->status = tdm_doc_str(doc, "status", "ok");
    r->trigger = tdm_doc_str(doc, "trigger", "?");
    r->last_step = tdm_doc_int(doc, "last_step", 0);
    r->pid = tdm_doc_int(doc, "pid", 0);
    r->next_seq = (uint64_t)tdm_doc_int(doc, "next_seq", 0);
    const tdm_json *ents = tdm_json_get(doc, "entries");
    int n = ents && ents->type == TDM_JSON_ARRAY ? ents->n : 0;
    r->e = calloc((size_t)n + 1, sizeof *r->e);
    for (int i = 0; r->e && i < n; i++) {
        const tdm_json *o = &ents->items[i];
        tdm_doc_entry *e = &r->e[r->n++];
        e->seq = (uint64_t)tdm_doc_int(o, "seq", 0);
        e->count = (uint64_t)tdm_doc_int(o, "count", 0);
        e->root = tdm_doc_int(o, "root", -1);
        e->step = tdm_doc_int(o, "step", 0);
        e->coll = tdm_doc_str(o, "coll", "?");
        e->dtype = tdm_doc_str(o, "dtype", "?");
        e->op = tdm_doc_str(o, "op", "-");
        e->label = tdm_doc_str(o, "label", "");
        e->state = tdm_doc_str(o, "state", "?");
        e->status = tdm_doc_str(o, "status", "?");
        e->t_enq = (uint64_t)tdm_doc_int(o, "t_enqueue_ns", 0);
        e->t_start = (uint64_t)tdm_doc_int(o, "t_start_ns", 0);
        e->t_end = (uint64_t)tdm_doc_int(o, "t_end_ns", 0);
        uint64_t t = e->t_end > e->t_start ? e->t_end : e->t_start;
        if (e->t_enq > t) t = e->t_enq;
        if (t > r->last_activity) r->last_activity = t;
    }
    if (r->n) qsort(r->e, (size_t)r->n, sizeof *r->e, tdm_doc_cmp_seq);
    r->first_seq = r->n ? r->e[0].seq : r->next_seq;
}

static const tdm_doc_entry *tdm_doc_at(const tdm_doc_rank *r, uint64_t seq)
{
    if (!r->have || seq < r->first_seq || seq >= r->next_seq) return NULL;
    int lo = 0, hi = r->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (r->e[mid].seq == seq) return &r->e[mid];
        if (r->e[mid].seq < seq) lo = mid + 1; else hi = mid - 1;
    }
    return NULL;
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

static void tdm_doc_call_str(const tdm_doc_entry *e, char *out, size_t n)
{
    int len = snprintf(out, n, "%s(%s", e->coll, e->dtype);
    if (strcmp(e->op, "-")) len += snprintf(out + len, n - (size_t)len, ", %s", e->op);
    len += snprintf(out + len, n - (size_t)len, ", count=%" PRIu64, e->count);
    if (e->root >= 0) len += snprintf(out + len, n - (size_t)len, ", root=%" PRId64, e->root);
    len += snprintf(out + len, n - (size_t)len, ")");
    if (e->label[0]) snprintf(out + len, n - (size_t)len, " '%s'", e->label);
}

static void tdm_doc_free(tdm_doc *d)
{
    for (int i = 0; d->r && i < d->world; i++) {
        free(d->r[i].e);
        tdm_json_free(d->r[i].doc);
    }
    free(d->r);
    tdm_json_free(d->summary);
}

/* Loads DIR: returns the number of dumps read. */
static int tdm_doc_read(tdm_doc *d, const char *dir)
{
    memset(d, 0, sizeof *d);
    DIR *dp = opendir(dir);
    if (!dp) return -1;
    tdm_json *docs[TDM_DOC_MAX_RANKS] = {0};
    int maxr = -1, got = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        int r = -1, len = 0;
        /* fr_rank_<R>.json only: the first communicator of each rank */
        if (sscanf(de->d_name, "fr_rank_%d.json%n", &r, &len) != 1 ||
            len != (int)strlen(de->d_name) || r < 0 || r >= TDM_DOC_MAX_RANKS)
            continue;
        tdm_json *doc = tdm_doc_load(dir, de->d_name);
        if (!doc) {
            fprintf(stderr, "tandem doctor: %s/%s: not a readable dump (skipped)\n", dir,
                    de->d_name);
            continue;
        }
        tdm_json_free(docs[r]);
        docs[r] = doc;
        if (r > maxr) maxr = r;
        int64_t w = tdm_doc_int(doc, "world", 0);
        if (w > d->world && w <= TDM_DOC_MAX_RANKS) d->world = (int)w;
        got++;
    }
    closedir(dp);
    d->summary = tdm_doc_load(dir, TDM_DOCTOR_SUMMARY);
    if (d->summary) {
        int64_t w = tdm_doc_int(d->summary, "world", 0);
        if (w > d->world && w <= TDM_DOC_MAX_RANKS) d->world = (int)w;
        d->cause = tdm_doc_str(d->summary, "cause", NULL);
        if (d->cause && !d->cause[0]) d->cause = NULL;
    }
    if (maxr + 1 > d->world) d->world = maxr + 1;
    d->r = calloc((size_t)(d->world > 0 ? d->world : 1), sizeof *d->r);
    for (int r = 0; r <= maxr; r++) {
        if (!docs[r]) continue;
        if (d->r) tdm_doc_take(&d->r[r], docs[r]); else tdm_json_free(docs[r]);
    }
    return got;
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

/* Who the ranks' messages blame, and how: from "rank R (pid P) <what>". */
typedef struct tdm_doc_blame {
    int rank;                  /* -1: none found */
    tdm_doctor_verdict kind;
    char what[256];
} tdm_doc_blame;

static void tdm_doc_classify(const char *msg, tdm_doc_blame *b)
{
    b->rank = -1;
    b->kind = TDM_DOCTOR_FAILED;
    b->what[0] = 0;
    if (!msg) return;
    for (const char *p = strstr(msg, "rank "); p; p = strstr(p + 1, "rank ")) {
        int r, pid, len = 0;
        if (sscanf(p, "rank %d (pid %d)%n", &r, &pid, &len) != 2 || !len) continue;
        const char *w = p + len;
        while (*w == ' ') w++;
        if (!strncmp(w, "is stopped", 10) || !strncmp(w, "is frozen", 9))
            b->kind = TDM_DOCTOR_STALLED;
        else if (!strncmp(w, "was killed", 10) || !strncmp(w, "exited", 6) ||
                 !strncmp(w, "died", 4))
            b->kind = TDM_DOCTOR_DIED;
        else
            continue;
        b->rank = r;
        /* up to the first ';', newline or ':' outside parentheses */
        int depth = 0, k = 0;
        for (; w[k] && w[k] != ';' && w[k] != '\n'; k++) {
            if (w[k] == '(') depth++;
            else if (w[k] == ')' && depth > 0) depth--;
            else if (w[k] == ':' && depth == 0) break;
        }
        snprintf(b->what, sizeof b->what, "%.*s", k, w);
        return;
    }
    if (strstr(msg, "timed out")) b->kind = TDM_DOCTOR_STALLED;
}

static int tdm_doc_join(char *out, size_t n, const int *ranks, int k)
{
    int len = snprintf(out, n, "%s", k > 1 ? "ranks " : "rank ");
    for (int i = 0; i < k && len < (int)n; i++)
        len += snprintf(out + len, n - (size_t)len, "%s%d", i ? "," : "", ranks[i]);
    return len;
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
    tdm_doc_blame blame;                    /* 2 */
    uint64_t front;                         /* 3: the furthest next_seq */
    const tdm_doc_entry *waiting;           /* 3: the collective the others waited in */
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
 * compared: only two ranks take part). */
static void tdm_doc_first_mismatch(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int r = 0; r < g->W; r++) {
        if (!d->r[r].have) continue;
        if (d->r[r].first_seq < lo) lo = d->r[r].first_seq;
        if (d->r[r].next_seq > hi) hi = d->r[r].next_seq;
    }
    g->bad = -1;
    for (uint64_t s = lo; s < hi && g->bad < 0; s++) {
        const tdm_doc_entry *ref = NULL;
        for (int r = 0; r < g->W; r++) {
            const tdm_doc_entry *e = tdm_doc_at(&d->r[r], s);
            if (!e || !strcmp(e->coll, "send") || !strcmp(e->coll, "recv")) continue;
            if (!ref) ref = e;
            else if (!tdm_doc_same(ref, e)) { g->bad = (int64_t)s; break; }
        }
    }
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
        gl += (size_t)snprintf(groups + gl, gl < sizeof groups ? sizeof groups - gl : 0,
                               "%s%s called %s", gr->n ? "; " : "", who, call);
        if (gl > sizeof groups) gl = sizeof groups;
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
    for (int64_t p = g->bad - 1; p > (int64_t)rq->first_seq; p--) {
        const tdm_doc_entry *hp = tdm_doc_at(rq, (uint64_t)p);
        const tdm_doc_entry *hp0 = tdm_doc_at(rq, (uint64_t)p - 1);
        if (hp && hp0 && tdm_doc_same(e, hp)) return tdm_doc_same(m, hp0);
    }
    return 0;
}

/* 1. A DESYNC: the groups, the ranks that skipped a call, the odd one out. */
static void tdm_doc_desync(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    g->v = TDM_DOCTOR_DESYNC;
    tdm_doc_groups gr;
    tdm_doc_desync_groups(g, &gr);
    for (int k = 0; k < gr.n && k < TDM_DOC_GROUPS && gr.biggest >= 0; k++) {
        if (k == gr.biggest) continue;
        for (int r = 0; r < g->W; r++) {
            const tdm_doc_entry *e = tdm_doc_at(&d->r[r], (uint64_t)g->bad);
            if (e != gr.ref[k]) continue;
            for (int q = 0; q < g->W; q++) {
                const tdm_doc_entry *m = tdm_doc_at(&d->r[q], (uint64_t)g->bad);
                if (m != gr.ref[gr.biggest]) continue;
                if (tdm_doc_skipped(g, q, e, m)) {
                    char call[256];
                    tdm_doc_call_str(m, call, sizeof call);
                    tdm_doc_detail(g, "  rank %d skipped %s: it went on to the call that "
                                      "follows it\n", r, call);
                }
                break;
            }
        }
    }
    /* the odd one out: the first rank of the smallest group */
    int small = gr.biggest == 0 && gr.n > 1 ? 1 : 0;
    for (int k = 0; k < gr.n && k < TDM_DOC_GROUPS; k++)
        if (k != gr.biggest && gr.size[k] < gr.size[small]) small = k;
    for (int r = 0; r < g->W && g->desync_rank < 0; r++)
        if (tdm_doc_at(&d->r[r], (uint64_t)g->bad) == gr.ref[small]) g->desync_rank = r;
}

/* 2. How each rank ended, and who is blamed: the launcher's cause, else a
 * failed rank's reason, else a rank without a dump that ended by itself,
 * else (when something failed) the first rank without a dump. */
static void tdm_doc_find_blame(tdm_doc_diag *g)
{
    const tdm_doc *d = &g->d;
    char buf[sizeof g->blame.what];
    g->blame = (tdm_doc_blame){.rank = -1, .kind = TDM_DOCTOR_OK};
    if (d->cause) tdm_doc_classify(d->cause, &g->blame);
    for (int r = 0; r < g->W; r++) {
        if (!d->r[r].have) { g->missing[g->nmissing++] = r; continue; }
        if (!d->r[r].failed) continue;
        g->nfailed++;
        if (g->blame.rank < 0) {
            tdm_doc_blame b;
            tdm_doc_classify(d->r[r].reason, &b);
            if (b.rank >= 0 || g->blame.kind == TDM_DOCTOR_OK) g->blame = b;
        }
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
    if (g->blame.rank < 0 && g->nmissing > 0 && (g->nfailed > 0 || d->cause)) {
        g->blame.rank = g->missing[0];
        g->blame.kind = TDM_DOCTOR_DIED;
        snprintf(g->blame.what, sizeof g->blame.what,
                 "left no dump (killed, or stopped and then killed)");
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
    g->waiting = front_rank >= 0 ? tdm_doc_at(&d->r[front_rank], g->front - 1) : NULL;
    for (int r = 0; r < g->W; r++)
        for (int i = 0; d->r[r].have && i < d->r[r].n; i++)
            if (strcmp(d->r[r].e[i].state, "done")) {
                const tdm_doc_entry *w = g->waiting;
                if (!w || d->r[r].e[i].seq < w->seq || !strcmp(w->state, "done"))
                    g->waiting = &d->r[r].e[i];
                break;
            }
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
        }
    } else if (g->nfailed > 0 || d->cause) {
        int first = -1;
        for (int r = 0; r < g->W; r++)
            if (d->r[r].have && d->r[r].failed) { first = r; break; }
        tdm_doc_classify(first >= 0 ? d->r[first].reason : d->cause, &g->blame);
        g->v = g->blame.kind == TDM_DOCTOR_STALLED ? TDM_DOCTOR_STALLED : TDM_DOCTOR_FAILED;
        snprintf(g->verdict, sizeof g->verdict, "%s: %s%s",
                 g->v == TDM_DOCTOR_STALLED ? "STALLED" : "FAILED", first >= 0 ? "" : "launcher: ",
                 first >= 0 ? d->r[first].reason : d->cause);
        if (first >= 0) {
            size_t l = strlen(g->verdict);
            snprintf(g->verdict + l, sizeof g->verdict - l, " (rank %d)", first);
        }
    } else if (g->nmissing > 0) {
        char buf[512];
        g->v = TDM_DOCTOR_DIED;
        tdm_doc_join(buf, sizeof buf, g->missing, g->nmissing);
        snprintf(g->verdict, sizeof g->verdict,
                 "DIED: %s left no dump and no rank reported a failure", buf);
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
    if (fr->have && fr->n) {
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
            tdm_doc_detail(g, "  rank %d: no dump%s%s%s\n", r, end ? "; " : "", end ? end : "",
                           end && induced ? " (by the launcher's teardown)" : "");
        } else if (d->r[r].failed) {
            tdm_doc_detail(g, "  rank %d: %s: %s\n", r, d->r[r].status, d->r[r].reason);
        } else {
            tdm_doc_detail(g, "  rank %d: no failure recorded (dump: %s)\n", r, d->r[r].trigger);
        }
    }
    if (d->cause) tdm_doc_detail(g, "  launcher: %s\n", d->cause);
}

static const char *tdm_doc_end_of(void *ctx, int rank, int *induced, char *buf, size_t n)
{
    return tdm_doc_summary_end(ctx, rank, induced, buf, n);
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
        snprintf(g->verdict, sizeof g->verdict, "no flight-recorder dump in %s%s", dir,
                 got < 0 ? " (cannot open the directory)" : " (no fr_rank_<R>.json)");
        v = TDM_DOCTOR_UNREADABLE;
    } else {
        g->W = g->d.world;
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
        v = g->v;
    }
    if (out) fprintf(out, "verdict: %s\n%s", g->verdict, g->details);
    if (line) snprintf(line, n, "%s", g->verdict);
    tdm_doc_free(&g->d);
    free(g);
    return v;
}

/* JSON string for the summary (stdio is fine here: not a signal handler) */
static void tdm_doc_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

int tdm_doctor_write_summary(const char *dir, int world, const int *pid, const int *wstatus,
                             const int *induced, const char *cause)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TDM_DOCTOR_SUMMARY);
    tdm_file_out o;
    if (tdm_file_replace_open(&o, AT_FDCWD, path)) return -1;
    FILE *f = fdopen(dup(o.fd), "w");
    if (!f) { tdm_file_replace_abort(&o); return -1; }
    fprintf(f, "{\"version\":1,\"world\":%d,\"cause\":", world);
    tdm_doc_json_str(f, cause ? cause : "");
    fprintf(f, ",\"ranks\":[");
    for (int r = 0; pid && wstatus && r < world; r++) {
        char end[128] = "";
        int ws = pid[r] > 0 ? wstatus[r] : -1;
        if (ws >= 0) tdm_shm_wait_status_str(ws, end, sizeof end);
        else if (pid[r] > 0) snprintf(end, sizeof end, "still running");
        fprintf(f, "%s{\"rank\":%d,\"pid\":%d,\"wstatus\":%d,\"induced\":%s,\"end\":", r ? "," : "",
                r, pid[r], ws, induced && induced[r] ? "true" : "false");
        tdm_doc_json_str(f, end);
        fputc('}', f);
    }
    fprintf(f, "]}\n");
    int bad = fclose(f) != 0;
    if (bad) { tdm_file_replace_abort(&o); return -1; }
    return tdm_file_replace_commit(&o) ? -1 : 0;
}

void tdm_doctor_job_begin(tdm_doctor_job *j, const char *tool, const char *dir_hint)
{
    memset(j, 0, sizeof *j);
    j->tool = tool;
    const char *user = getenv("TANDEM_FR_DUMP");
    if (user && *user) {
        snprintf(j->dir, sizeof j->dir, "%s", user);
        j->on = 1;
        return;
    }
    if (dir_hint) {
        snprintf(j->dir, sizeof j->dir, "%s", dir_hint);
    } else {
        const char *tmp = getenv("TMPDIR");
        snprintf(j->dir, sizeof j->dir, "%s/tandem-fr-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(j->dir)) {
            fprintf(stderr, "%s: note: no flight-recorder dumps (mkdtemp %s: %s)\n", tool, j->dir,
                    strerror(errno));
            return;
        }
        j->created = 1;
    }
    j->on = 1;
    j->set_env = 1;
    setenv("TANDEM_FR_DUMP", j->dir, 1);
    if (!getenv("TANDEM_FR_DUMP_ON")) {
        setenv("TANDEM_FR_DUMP_ON", "failure", 1);
        j->set_on = 1;
    }
}

static void tdm_doctor_job_clean(tdm_doctor_job *j)
{
    DIR *dp = opendir(j->dir);
    if (!dp) return;
    struct dirent *de;
    int dfd = dirfd(dp);
    while ((de = readdir(dp))) {
        int r, len = 0;
        if ((sscanf(de->d_name, "fr_rank_%d%n", &r, &len) == 1 && len > 0) ||
            !strcmp(de->d_name, TDM_DOCTOR_SUMMARY))
            unlinkat(dfd, de->d_name, 0);
    }
    closedir(dp);
    rmdir(j->dir);   /* fails, keeping it, if anything else is there */
}

tdm_doctor_verdict tdm_doctor_job_end(tdm_doctor_job *j, int failed, int world, const int *pid,
                                      const int *wstatus, const int *induced, const char *cause)
{
    if (!j->on) return TDM_DOCTOR_OK;
    /* the next job (a restart) picks its own directory */
    if (j->set_env) unsetenv("TANDEM_FR_DUMP");
    if (j->set_on) unsetenv("TANDEM_FR_DUMP_ON");
    if (!failed) {
        if (j->created) tdm_doctor_job_clean(j);
        return TDM_DOCTOR_OK;
    }
    tdm_doctor_write_summary(j->dir, world, pid, wstatus, induced, cause);
    char line[1024];
    tdm_doctor_verdict v = tdm_doctor_diagnose(j->dir, NULL, line, sizeof line);
    /* the verdict printed while the teardown ran stands unless the ends
     * of the stopped ranks changed it */
    if (!j->early_done)
        fprintf(stderr, "%s: doctor: %s\n", j->tool, line);
    else if (strcmp(line, j->early))
        fprintf(stderr, "%s: doctor (after the teardown): %s\n", j->tool, line);
    if (j->created && tdm_doctor_dir_dumps(j->dir) == 0) {
        /* no rank dumped (none got as far, or the recorder is off): a
         * directory of ours with nothing to diagnose is not left behind */
        tdm_doctor_dir_remove(j->dir);
        return v;
    }
    fprintf(stderr, "%s: flight-recorder dumps in %s (tandem doctor %s for the diagnosis)\n",
            j->tool, j->dir, j->dir);
    if (j->created) {
        /* one directory per failed job: only the newest few stay */
        char parent[sizeof j->dir];
        snprintf(parent, sizeof parent, "%s", j->dir);
        char *slash = strrchr(parent, '/');
        if (slash && slash != parent) *slash = '\0';
        if (slash) tdm_doctor_dirs_prune(slash == parent ? "/" : parent);
    }
    return v;
}

void tdm_doctor_job_settled(const tdm_shm_watch *w, void *job)
{
    tdm_doctor_job *j = job;
    if (!j->on || j->early_done) return;
    int ws[TDM_SHM_MAX_RANKS], stopped[TDM_SHM_MAX_RANKS], ns = 0;
    for (int r = 0; r < w->world; r++) {
        ws[r] = w->ended[r] ? w->wstatus[r] : -1;
        if (w->pid[r] > 0 && !w->ended[r]) stopped[ns++] = r;
    }
    char cause[1024] = "";
    if (tdm_shm_watch_blame(w, NULL) != TDM_STATUS_OK)
        snprintf(cause, sizeof cause, "%s", tdm_error_message());
    tdm_doctor_write_summary(j->dir, w->world, w->pid, ws, w->induced, cause[0] ? cause : NULL);
    tdm_doctor_diagnose(j->dir, NULL, j->early, sizeof j->early);
    j->early_done = 1;
    char who[256];
    tdm_doc_join(who, sizeof who, stopped, ns);
    fprintf(stderr, "%s: doctor: %s\n%s: %s %s stopped (no dump, no exit of %s own): the "
                    "teardown kills %s after its grace period\n", j->tool, j->early, j->tool,
            who, ns > 1 ? "are" : "is", ns > 1 ? "their" : "its", ns > 1 ? "them" : "it");
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
