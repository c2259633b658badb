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
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

tdm_doctor_verdict tdm_doctor_diagnose(const char *dir, FILE *out, char *line, size_t n)
{
    tdm_doc d;
    char verdict[1024] = "", buf[512];
    int got = tdm_doc_read(&d, dir);
    /* the launcher's summary alone still names who failed (a program
     * without a communicator, or one that died before making it) */
    if ((got <= 0 && !d.summary) || !d.r || d.world <= 0) {
        snprintf(verdict, sizeof verdict, "no flight-recorder dump in %s%s", dir,
                 got < 0 ? " (cannot open the directory)" : " (no fr_rank_<R>.json)");
        if (out) fprintf(out, "verdict: %s\n", verdict);
        if (line) snprintf(line, n, "%s", verdict);
        tdm_doc_free(&d);
        return TDM_DOCTOR_UNREADABLE;
    }
    int W = d.world;
    tdm_doctor_verdict v = TDM_DOCTOR_OK;
    char details[4096] = "";
    size_t dl = 0;
#define TDM_DOC_DETAIL(...) \
    (dl += (size_t)snprintf(details + dl, dl < sizeof details ? sizeof details - dl : 0, __VA_ARGS__), \
     dl = dl < sizeof details ? dl : sizeof details)

    /* 1. the first sequence number at which ranks disagree */
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int r = 0; r < W; r++) {
        if (!d.r[r].have) continue;
        if (d.r[r].first_seq < lo) lo = d.r[r].first_seq;
        if (d.r[r].next_seq > hi) hi = d.r[r].next_seq;
    }
    int64_t bad = -1;
    int desync_rank = -1;
    for (uint64_t s = lo; s < hi && bad < 0; s++) {
        const tdm_doc_entry *ref = NULL;
        for (int r = 0; r < W; r++) {
            const tdm_doc_entry *e = tdm_doc_at(&d.r[r], s);
            if (!e || !strcmp(e->coll, "send") || !strcmp(e->coll, "recv")) continue;
            if (!ref) ref = e;
            else if (!tdm_doc_same(ref, e)) { bad = (int64_t)s; break; }
        }
    }
    if (bad >= 0) {
        v = TDM_DOCTOR_DESYNC;
        /* group the ranks by what they called */
        int done[TDM_DOC_MAX_RANKS] = {0}, ngroups = 0, biggest = -1, bigsize = 0;
        const tdm_doc_entry *gref[8];
        int gsize[8];
        char groups[2048] = "";
        size_t gl = 0;
        for (int r = 0; r < W; r++) {
            const tdm_doc_entry *e = tdm_doc_at(&d.r[r], (uint64_t)bad);
            if (!e || done[r]) continue;
            int members[TDM_DOC_MAX_RANKS], k = 0;
            for (int q = r; q < W; q++) {
                const tdm_doc_entry *f = tdm_doc_at(&d.r[q], (uint64_t)bad);
                if (f && !done[q] && tdm_doc_same(e, f)) { members[k++] = q; done[q] = 1; }
            }
            char who[256], call[256];
            tdm_doc_join(who, sizeof who, members, k);
            tdm_doc_call_str(e, call, sizeof call);
            gl += (size_t)snprintf(groups + gl, gl < sizeof groups ? sizeof groups - gl : 0,
                                   "%s%s called %s", ngroups ? "; " : "", who, call);
            if (gl > sizeof groups) gl = sizeof groups;
            if (ngroups < 8) { gref[ngroups] = e; gsize[ngroups] = k; }
            if (k > bigsize) { bigsize = k; biggest = ngroups; }
            ngroups++;
        }
        snprintf(verdict, sizeof verdict, "DESYNC at collective #%" PRId64 ": %.900s", bad, groups);
        /* a rank that skipped a call: its #S is what the majority called at #S+1 */
        for (int g = 0; g < ngroups && g < 8 && biggest >= 0; g++) {
            if (g == biggest) continue;
            for (int r = 0; r < W; r++) {
                const tdm_doc_entry *e = tdm_doc_at(&d.r[r], (uint64_t)bad);
                if (e != gref[g]) continue;
                for (int q = 0; q < W; q++) {
                    const tdm_doc_entry *m = tdm_doc_at(&d.r[q], (uint64_t)bad);
                    if (m != gref[biggest]) continue;
                    /* rank r's call comes right after the majority's, either
                     * at #S+1 on the majority or earlier in its history */
                    const tdm_doc_entry *m1 = tdm_doc_at(&d.r[q], (uint64_t)bad + 1);
                    int skipped = m1 && tdm_doc_same(e, m1);
                    for (int64_t p = bad - 1; !skipped && p > (int64_t)d.r[q].first_seq; p--) {
                        const tdm_doc_entry *hp = tdm_doc_at(&d.r[q], (uint64_t)p);
                        const tdm_doc_entry *hp0 = tdm_doc_at(&d.r[q], (uint64_t)p - 1);
                        if (hp && hp0 && tdm_doc_same(e, hp)) {
                            skipped = tdm_doc_same(m, hp0);
                            break;
                        }
                    }
                    if (skipped) {
                        char call[256];
                        tdm_doc_call_str(m, call, sizeof call);
                        TDM_DOC_DETAIL("  rank %d skipped %s: it went on to the call that "
                                       "follows it\n", r, call);
                    }
                    break;
                }
            }
        }
        /* the odd one out: the first rank of the smallest group */
        int small = biggest == 0 && ngroups > 1 ? 1 : 0;
        for (int g = 0; g < ngroups && g < 8; g++)
            if (g != biggest && gsize[g] < gsize[small]) small = g;
        for (int r = 0; r < W && desync_rank < 0; r++)
            if (tdm_doc_at(&d.r[r], (uint64_t)bad) == gref[small]) desync_rank = r;
    }

    /* 2. how each rank ended, and who is blamed */
    int missing[TDM_DOC_MAX_RANKS], nmissing = 0, nfailed = 0;
    tdm_doc_blame blame = {.rank = -1, .kind = TDM_DOCTOR_OK};
    if (d.cause) tdm_doc_classify(d.cause, &blame);
    for (int r = 0; r < W; r++) {
        if (!d.r[r].have) { missing[nmissing++] = r; continue; }
        if (!d.r[r].failed) continue;
        nfailed++;
        if (blame.rank < 0) {
            tdm_doc_blame b;
            tdm_doc_classify(d.r[r].reason, &b);
            if (b.rank >= 0 || blame.kind == TDM_DOCTOR_OK) blame = b;
        }
    }
    for (int i = 0; i < nmissing && blame.rank < 0; i++) {
        int induced;
        const char *end = tdm_doc_summary_end(&d, missing[i], &induced, buf, sizeof buf);
        if (end && !induced) {
            blame.rank = missing[i];
            blame.kind = TDM_DOCTOR_DIED;
            snprintf(blame.what, sizeof blame.what, "%s", end);
        }
    }
    if (blame.rank < 0 && nmissing > 0 && (nfailed > 0 || d.cause)) {
        blame.rank = missing[0];
        blame.kind = TDM_DOCTOR_DIED;
        snprintf(blame.what, sizeof blame.what, "left no dump (killed, or stopped and then killed)");
    }

    /* 3. the frontier: the collective the ranks that went furthest are in */
    uint64_t front = 0;
    int front_rank = -1;
    for (int r = 0; r < W; r++)
        if (d.r[r].have && d.r[r].next_seq > front) { front = d.r[r].next_seq; front_rank = r; }
    const tdm_doc_entry *waiting = front_rank >= 0 ? tdm_doc_at(&d.r[front_rank], front - 1) : NULL;
    /* the first call of the furthest rank that did not complete */
    for (int r = 0; r < W; r++)
        for (int i = 0; d.r[r].have && i < d.r[r].n; i++)
            if (strcmp(d.r[r].e[i].state, "done")) {
                if (!waiting || d.r[r].e[i].seq < waiting->seq || !strcmp(waiting->state, "done"))
                    waiting = &d.r[r].e[i];
                break;
            }

    if (v == TDM_DOCTOR_OK && blame.rank >= 0) {
        v = blame.kind;
        char call[256] = "";
        if (waiting) tdm_doc_call_str(waiting, call, sizeof call);
        snprintf(verdict, sizeof verdict, "%s: rank %d %s",
                 v == TDM_DOCTOR_STALLED ? "STALLED" : v == TDM_DOCTOR_DIED ? "DIED" : "FAILED",
                 blame.rank, blame.what);
        if (waiting) {
            size_t l = strlen(verdict);
            snprintf(verdict + l, sizeof verdict - l, "; the others waited in %s #%" PRIu64, call,
                     waiting->seq);
        }
    } else if (v == TDM_DOCTOR_OK && (nfailed > 0 || d.cause)) {
        int first = -1;
        for (int r = 0; r < W; r++)
            if (d.r[r].have && d.r[r].failed) { first = r; break; }
        tdm_doc_classify(first >= 0 ? d.r[first].reason : d.cause, &blame);
        v = blame.kind == TDM_DOCTOR_STALLED ? TDM_DOCTOR_STALLED : TDM_DOCTOR_FAILED;
        snprintf(verdict, sizeof verdict, "%s: %s%s", v == TDM_DOCTOR_STALLED ? "STALLED" : "FAILED",
                 first >= 0 ? "" : "launcher: ", first >= 0 ? d.r[first].reason : d.cause);
        if (first >= 0) {
            size_t l = strlen(verdict);
            snprintf(verdict + l, sizeof verdict - l, " (rank %d)", first);
        }
    } else if (v == TDM_DOCTOR_OK && nmissing > 0) {
        v = TDM_DOCTOR_DIED;
        tdm_doc_join(buf, sizeof buf, missing, nmissing);
        snprintf(verdict, sizeof verdict, "DIED: %s left no dump and no rank reported a failure",
                 buf);
    } else if (v == TDM_DOCTOR_OK) {
        snprintf(verdict, sizeof verdict, "OK: %d rank(s) agree on %" PRIu64 " collective(s), "
                 "none failed", W, front);
    }

    /* 4. who stopped first and where */
    int first_rank = desync_rank >= 0 ? desync_rank : blame.rank;
    if (first_rank < 0) {
        uint64_t best = UINT64_MAX;
        uint64_t best_t = UINT64_MAX;
        for (int r = 0; r < W; r++)
            if (d.r[r].have && (d.r[r].next_seq < best ||
                                (d.r[r].next_seq == best && d.r[r].last_activity < best_t))) {
                best = d.r[r].next_seq;
                best_t = d.r[r].last_activity;
                first_rank = r;
            }
    }
    if (v != TDM_DOCTOR_OK && first_rank >= 0) {
        const tdm_doc_rank *fr = &d.r[first_rank];
        if (fr->have && fr->n) {
            const tdm_doc_entry *e = &fr->e[fr->n - 1];
            char call[256];
            tdm_doc_call_str(e, call, sizeof call);
            TDM_DOC_DETAIL("  %s: rank %d, in %s #%" PRIu64 " (%s, step %" PRId64 ")\n",
                           desync_rank >= 0 ? "odd one out" : "stopped first", first_rank, call,
                           e->seq, e->state, e->step);
        } else {
            int induced;
            const char *end = tdm_doc_summary_end(&d, first_rank, &induced, buf, sizeof buf);
            TDM_DOC_DETAIL("  stopped first: rank %d (%s), no flight record of its own\n",
                           first_rank, end ? end : blame.what[0] ? blame.what : "no dump");
        }
    }
    /* 5. ranks that never entered the collective the others are in */
    if (v != TDM_DOCTOR_OK && waiting) {
        int never[TDM_DOC_MAX_RANKS], k = 0, in[TDM_DOC_MAX_RANKS], m = 0;
        for (int r = 0; r < W; r++) {
            if (d.r[r].have && d.r[r].next_seq > waiting->seq) in[m++] = r;
            else never[k++] = r;
        }
        if (k > 0) {
            char who[256], inw[256], call[256];
            tdm_doc_join(who, sizeof who, never, k);
            tdm_doc_join(inw, sizeof inw, in, m);
            tdm_doc_call_str(waiting, call, sizeof call);
            TDM_DOC_DETAIL("  never entered %s #%" PRIu64 ": %s%s (%s did)\n", call, waiting->seq,
                           who, nmissing ? " (a rank without a dump counts as not entered)" : "",
                           inw);
        }
    }
    /* 6. the last completed step */
    int64_t smin = INT64_MAX, smax = INT64_MIN;
    for (int r = 0; r < W; r++) {
        if (!d.r[r].have) continue;
        if (d.r[r].last_step < smin) smin = d.r[r].last_step;
        if (d.r[r].last_step > smax) smax = d.r[r].last_step;
    }
    if (smin > smax) TDM_DOC_DETAIL("  last completed step: unknown (no dump)\n");
    else if (smin == smax) TDM_DOC_DETAIL("  last completed step: %" PRId64 " (every rank with a dump)\n", smin);
    else TDM_DOC_DETAIL("  last completed step: %" PRId64 " (some ranks reached %" PRId64 ")\n", smin, smax);
    for (int r = 0; r < W && v != TDM_DOCTOR_OK; r++) {
        if (!d.r[r].have) {
            int induced;
            const char *end = tdm_doc_summary_end(&d, r, &induced, buf, sizeof buf);
            TDM_DOC_DETAIL("  rank %d: no dump%s%s%s\n", r, end ? "; " : "", end ? end : "",
                           end && induced ? " (by the launcher's teardown)" : "");
        } else if (d.r[r].failed) {
            TDM_DOC_DETAIL("  rank %d: %s: %s\n", r, d.r[r].status, d.r[r].reason);
        } else {
            TDM_DOC_DETAIL("  rank %d: no failure recorded (dump: %s)\n", r, d.r[r].trigger);
        }
    }
    if (d.cause && v != TDM_DOCTOR_OK) TDM_DOC_DETAIL("  launcher: %s\n", d.cause);
#undef TDM_DOC_DETAIL
    if (out) fprintf(out, "verdict: %s\n%s", verdict, details);
    if (line) snprintf(line, n, "%s", verdict);
    tdm_doc_free(&d);
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
        if (pid[r] > 0) tdm_shm_wait_status_str(wstatus[r], end, sizeof end);
        fprintf(f, "%s{\"rank\":%d,\"pid\":%d,\"wstatus\":%d,\"induced\":%s,\"end\":", r ? "," : "",
                r, pid[r], pid[r] > 0 ? wstatus[r] : -1, induced && induced[r] ? "true" : "false");
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
    fprintf(stderr, "%s: doctor: %s\n%s: flight-recorder dumps in %s (tandem doctor %s for "
                    "the diagnosis)\n", j->tool, line, j->tool, j->dir, j->dir);
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
    return (int)tdm_doctor_diagnose(dir, stdout, NULL, 0);
}
