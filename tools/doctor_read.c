/* tools/doctor_read.c: reading a job's flight-recorder dumps for `tandem
 * doctor` (tools/doctor_impl.h). The files are not trusted: a dump may be
 * truncated by a crash, damaged, written by another version, or planted
 * by someone else, and the doctor runs inside `tandem train`'s and
 * `tandem launch`'s failure summary, so a crash or hang here is theirs.
 * Every file is size-bounded before it is read, checked against the
 * recorder's shape (core/flight.c writes it) and left out, with a note,
 * when it does not fit; every string is cleaned of control characters.
 * Not the diagnosis (tools/doctor.c). */
#include "tools/doctor_impl.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/safefile.h"
#include "tools/doctor.h"

const char *tdm_doc_str(const tdm_json *o, const char *k, const char *dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && v->type == TDM_JSON_STRING ? v->str : dflt;
}

int64_t tdm_doc_int(const tdm_json *o, const char *k, int64_t dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && (v->type == TDM_JSON_INT || v->type == TDM_JSON_BOOL) ? v->i : dflt;
}

/* "an integer", "a string", ... for messages. */
static const char *tdm_doc_a(tdm_json_type t)
{
    switch (t) {
    case TDM_JSON_NULL: return "null";
    case TDM_JSON_BOOL: return "a boolean";
    case TDM_JSON_INT: return "an integer";
    case TDM_JSON_STRING: return "a string";
    case TDM_JSON_ARRAY: return "an array";
    default: return "an object";
    }
}

static void tdm_doc_note(tdm_doc *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tdm_doc_note(tdm_doc *d, const char *fmt, ...)
{
    if (d->nl >= sizeof d->notes - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(d->notes + d->nl, sizeof d->notes - d->nl, fmt, ap);
    va_end(ap);
    if (k > 0) d->nl += (size_t)k;
    if (d->nl > sizeof d->notes - 1) d->nl = sizeof d->notes - 1;
}

/* Replaces, in place, what a terminal would act on: C0 controls and DEL
 * (a newline would forge a line of the verdict, ESC starts a terminal
 * command) and the C1 controls U+0080..U+009F (0xC2 0x80..0x9F in UTF-8,
 * which some terminals obey too). The parser has checked the UTF-8. */
static void tdm_doc_clean_str(char *s)
{
    for (unsigned char *p = (unsigned char *)s; *p; p++) {
        if (*p < 0x20 || *p == 0x7f) *p = *p == '\t' || *p == '\n' || *p == '\r' ? ' ' : '?';
        else if (p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) p[0] = p[1] = '?';
    }
}

static void tdm_doc_clean(tdm_json *v, int depth)
{
    if (!v || depth > TDM_JSON_MAX_DEPTH) return;
    if (v->type == TDM_JSON_STRING && v->str) tdm_doc_clean_str(v->str);
    if (v->type == TDM_JSON_ARRAY || v->type == TDM_JSON_OBJECT)
        for (int i = 0; i < v->n; i++) tdm_doc_clean(&v->items[i], depth + 1);
}

/* DIR/name parsed, or NULL with *why set. *budget: bytes the directory
 * may still cost. */
static tdm_json *tdm_doc_load(const char *dir, const char *name, size_t *budget, char *why,
                              size_t wn)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path) {
        snprintf(why, wn, "path too long");
        return NULL;
    }
    int fd = -1;
    size_t nbytes = 0;
    if (tdm_file_open_read(path, &fd, &nbytes)) {
        snprintf(why, wn, "%.300s", tdm_error_message());
        return NULL;
    }
    if (nbytes > TDM_DOC_MAX_FILE_BYTES || nbytes > *budget) {
        close(fd);
        snprintf(why, wn, "%zu bytes, more than the %zu MiB %s", nbytes,
                 (nbytes > TDM_DOC_MAX_FILE_BYTES ? TDM_DOC_MAX_FILE_BYTES : *budget) >> 20,
                 nbytes > TDM_DOC_MAX_FILE_BYTES ? "a dump may have (not read)"
                                                 : "left for this directory's files (not read)");
        return NULL;
    }
    *budget -= nbytes;
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
    if (!buf) snprintf(why, wn, "out of memory for %zu bytes", nbytes);
    else if (got != nbytes) snprintf(why, wn, "read %zu of its %zu bytes", got, nbytes);
    else if (tdm_json_parse(&doc, buf, nbytes)) {
        doc = NULL;
        snprintf(why, wn, "%.300s (truncated or damaged)", tdm_error_message());
    }
    free(buf);
    if (doc) tdm_doc_clean(doc, 0);
    return doc;
}

/* o's key k as an integer in [lo, hi] into *v (absent: dflt, unless
 * required). 0 when fine, else why says what is wrong. */
static int tdm_doc_get_int(const tdm_json *o, const char *k, int64_t lo, int64_t hi, int required,
                           int64_t dflt, int64_t *v, char *why, size_t wn)
{
    const tdm_json *x = tdm_json_get(o, k);
    if (!x) {
        if (required) snprintf(why, wn, "no \"%s\"", k);
        *v = dflt;
        return required ? -1 : 0;
    }
    if (x->type != TDM_JSON_INT && x->type != TDM_JSON_BOOL) {
        snprintf(why, wn, "\"%s\" is %s, not a number", k, tdm_doc_a(x->type));
        return -1;
    }
    if (x->i < lo || x->i > hi) {
        snprintf(why, wn, "\"%s\" is %lld, outside %lld..%lld", k, (long long)x->i,
                 (long long)lo, (long long)hi);
        return -1;
    }
    *v = x->i;
    return 0;
}

static int tdm_doc_get_str(const tdm_json *o, const char *k, const char *dflt, const char **v,
                           char *why, size_t wn)
{
    const tdm_json *x = tdm_json_get(o, k);
    *v = dflt;
    if (!x) return 0;
    if (x->type != TDM_JSON_STRING) {
        snprintf(why, wn, "\"%s\" is %s, not a string", k, tdm_doc_a(x->type));
        return -1;
    }
    *v = x->str;
    return 0;
}

static int tdm_doc_cmp_seq(const void *a, const void *b)
{
    const tdm_doc_entry *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* One entry of rank r's dump; 0 when it fits the recorder's shape. */
static int tdm_doc_take_entry(const tdm_json *o, int64_t next, tdm_doc_entry *e, char *why,
                              size_t wn)
{
    int64_t seq = 0, count = 0, root = -1, step = 0, t0 = 0, t1 = 0, t2 = 0;
    if (o->type != TDM_JSON_OBJECT) {
        snprintf(why, wn, "an entry is %s, not an object", tdm_doc_a(o->type));
        return -1;
    }
    if (tdm_doc_get_int(o, "seq", 0, next - 1, 1, 0, &seq, why, wn) ||
        tdm_doc_get_int(o, "count", 0, TDM_DOC_MAX_COUNT, 0, 0, &count, why, wn) ||
        tdm_doc_get_int(o, "root", -1, TDM_DOC_MAX_RANKS - 1, 0, -1, &root, why, wn) ||
        tdm_doc_get_int(o, "step", -TDM_DOC_MAX_COUNT, TDM_DOC_MAX_COUNT, 0, 0, &step, why, wn) ||
        tdm_doc_get_int(o, "t_enqueue_ns", 0, INT64_MAX, 0, 0, &t0, why, wn) ||
        tdm_doc_get_int(o, "t_start_ns", 0, INT64_MAX, 0, 0, &t1, why, wn) ||
        tdm_doc_get_int(o, "t_end_ns", 0, INT64_MAX, 0, 0, &t2, why, wn) ||
        tdm_doc_get_str(o, "coll", "?", &e->coll, why, wn) ||
        tdm_doc_get_str(o, "dtype", "?", &e->dtype, why, wn) ||
        tdm_doc_get_str(o, "op", "-", &e->op, why, wn) ||
        tdm_doc_get_str(o, "label", "", &e->label, why, wn) ||
        tdm_doc_get_str(o, "state", "?", &e->state, why, wn) ||
        tdm_doc_get_str(o, "status", "?", &e->status, why, wn)) {
        size_t l = strlen(why);
        snprintf(why + l, wn - l, " in entry #%lld", (long long)seq);
        return -1;
    }
    e->seq = (uint64_t)seq;
    e->count = (uint64_t)count;
    e->root = root;
    e->step = step;
    e->t_enq = (uint64_t)t0;
    e->t_start = (uint64_t)t1;
    e->t_end = (uint64_t)t2;
    return 0;
}

/* Checks doc as the dump of rank `file_rank` and takes it into r; 0 when
 * it fits (r then owns doc), else why says what does not. */
static int tdm_doc_take(tdm_doc_rank *r, tdm_json *doc, int file_rank, char *why, size_t wn)
{
    int64_t version = 0, rank = 0, world = 0, next = 0, failed = 0, last_step = 0, pid = 0;
    if (doc->type != TDM_JSON_OBJECT) {
        snprintf(why, wn, "%s, not a flight-recorder dump (an object)", tdm_doc_a(doc->type));
        return -1;
    }
    const tdm_json *ents = tdm_json_get(doc, "entries");
    if (tdm_doc_get_int(doc, "version", 1, 1, 1, 0, &version, why, wn) ||
        tdm_doc_get_int(doc, "rank", 0, TDM_DOC_MAX_RANKS - 1, 1, 0, &rank, why, wn) ||
        tdm_doc_get_int(doc, "world", 1, TDM_DOC_MAX_RANKS, 1, 0, &world, why, wn) ||
        tdm_doc_get_int(doc, "next_seq", 0, TDM_DOC_MAX_COUNT, 1, 0, &next, why, wn) ||
        tdm_doc_get_int(doc, "failed", 0, 1, 0, 0, &failed, why, wn) ||
        tdm_doc_get_int(doc, "last_step", -TDM_DOC_MAX_COUNT, TDM_DOC_MAX_COUNT, 0, 0, &last_step,
                        why, wn) ||
        tdm_doc_get_int(doc, "pid", 0, INT32_MAX, 0, 0, &pid, why, wn) ||
        tdm_doc_get_str(doc, "reason", "", &r->reason, why, wn) ||
        tdm_doc_get_str(doc, "status", "ok", &r->status, why, wn) ||
        tdm_doc_get_str(doc, "trigger", "?", &r->trigger, why, wn))
        return -1;
    if (rank != file_rank) {
        snprintf(why, wn, "it says rank %lld, not %d", (long long)rank, file_rank);
        return -1;
    }
    if (rank >= world) {
        snprintf(why, wn, "rank %lld of a world of %lld", (long long)rank, (long long)world);
        return -1;
    }
    if (!ents || ents->type != TDM_JSON_ARRAY) {
        snprintf(why, wn, "\"entries\" is %s, not an array", ents ? tdm_doc_a(ents->type) : "missing");
        return -1;
    }
    if ((int64_t)ents->n > next) {
        snprintf(why, wn, "%d entries but next_seq %lld", ents->n, (long long)next);
        return -1;
    }
    tdm_doc_entry *e = calloc((size_t)ents->n + 1, sizeof *e);
    if (!e) {
        snprintf(why, wn, "out of memory for %d entries", ents->n);
        return -1;
    }
    for (int i = 0; i < ents->n; i++)
        if (tdm_doc_take_entry(&ents->items[i], next, &e[i], why, wn)) {
            free(e);
            return -1;
        }
    if (ents->n) qsort(e, (size_t)ents->n, sizeof *e, tdm_doc_cmp_seq);
    for (int i = 1; i < ents->n; i++)
        if (e[i].seq == e[i - 1].seq) {
            snprintf(why, wn, "entry #%llu appears twice", (unsigned long long)e[i].seq);
            free(e);
            return -1;
        }
    r->have = 1;
    r->doc = doc;
    r->failed = (int)failed;
    r->last_step = last_step;
    r->pid = pid;
    r->next_seq = (uint64_t)next;
    r->e = e;
    r->n = ents->n;
    r->first_seq = r->n ? e[0].seq : r->next_seq;
    r->last_activity = 0;
    for (int i = 0; i < r->n; i++) {
        uint64_t t = e[i].t_end > e[i].t_start ? e[i].t_end : e[i].t_start;
        if (e[i].t_enq > t) t = e[i].t_enq;
        if (t > r->last_activity) r->last_activity = t;
    }
    return 0;
}

/* launch.json: an object with a world in range, a string cause and an
 * array of ranks (each checked where it is read); else left out. */
static tdm_json *tdm_doc_take_summary(tdm_doc *d, const char *dir, size_t *budget)
{
    char why[512];
    tdm_json *s = tdm_doc_load(dir, TDM_DOCTOR_SUMMARY, budget, why, sizeof why);
    if (!s) {
        if (access(dir, F_OK) == 0) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", dir, TDM_DOCTOR_SUMMARY);
            if (access(path, F_OK) == 0)
                tdm_doc_note(d, "  note: %s: not read: %s\n", TDM_DOCTOR_SUMMARY, why);
        }
        return NULL;
    }
    int64_t w = 0;
    const char *cause = NULL;
    const tdm_json *ranks = tdm_json_get(s, "ranks");
    if (s->type != TDM_JSON_OBJECT)
        snprintf(why, sizeof why, "%s, not an object", tdm_doc_a(s->type));
    else if (!tdm_doc_get_int(s, "world", 1, TDM_DOC_MAX_RANKS, 1, 0, &w, why, sizeof why) &&
             !tdm_doc_get_str(s, "cause", "", &cause, why, sizeof why) &&
             (!ranks || ranks->type == TDM_JSON_ARRAY))
        return s;
    else if (ranks && ranks->type != TDM_JSON_ARRAY)
        snprintf(why, sizeof why, "\"ranks\" is %s, not an array", tdm_doc_a(ranks->type));
    tdm_doc_note(d, "  note: %s: not used: %s\n", TDM_DOCTOR_SUMMARY, why);
    d->skipped++;
    tdm_json_free(s);
    return NULL;
}

/* One job's dumps out of a directory that several jobs wrote to (a fixed
 * TANDEM_FR_DUMP, a restarted launch's --log-dir): the summary's job
 * when there is one, else the job of the newest dump (dump_real_ns);
 * the others are left out with a note. Dumps without a job id (an older
 * recorder) count as one job of their own. */
static void tdm_doc_pick_job(tdm_doc *d, tdm_json **docs, char *present, int maxr)
{
    const char *want = d->summary ? tdm_doc_str(d->summary, "job", NULL) : NULL;
    if (!want) {
        int64_t newest = -1;
        for (int r = 0; r <= maxr; r++) {
            if (!docs[r] || docs[r]->type != TDM_JSON_OBJECT) continue;
            int64_t t = tdm_doc_int(docs[r], "dump_real_ns", 0);
            if (t > newest) {
                newest = t;
                want = tdm_doc_str(docs[r], "job", "");
            }
        }
    }
    if (!want) return;
    snprintf(d->job, sizeof d->job, "%s", want);
    for (int r = 0; r <= maxr; r++) {
        if (!docs[r] || docs[r]->type != TDM_JSON_OBJECT) continue;
        const char *job = tdm_doc_str(docs[r], "job", "");
        if (!strcmp(job, d->job)) continue;
        tdm_doc_note(d, "  note: fr_rank_%d.json: not used: a dump of another job (job %.20s, "
                     "not %.20s)\n", r, job[0] ? job : "without an id",
                     d->job[0] ? d->job : "without an id");
        d->skipped++;
        d->other_job++;
        tdm_json_free(docs[r]);
        docs[r] = NULL;
        present[r] = 0;   /* not this job's: its rank did not leave it */
    }
}

int tdm_doc_read(tdm_doc *d, const char *dir)
{
    memset(d, 0, sizeof *d);
    DIR *dp = opendir(dir);
    if (!dp) return -1;
    tdm_json **docs = calloc(TDM_DOC_MAX_RANKS, sizeof *docs);
    char *present = calloc(TDM_DOC_MAX_RANKS, 1);   /* a file named for the rank */
    if (!docs || !present) {
        free(docs);
        free(present);
        closedir(dp);
        return -1;
    }
    size_t budget = TDM_DOC_MAX_TOTAL_BYTES;
    int maxr = -1, got = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        int r = -1, len = 0;
        /* fr_rank_<R>.json only: the rank's primary communicator */
        if (sscanf(de->d_name, "fr_rank_%d.json%n", &r, &len) != 1 ||
            len != (int)strlen(de->d_name) || r < 0 || r >= TDM_DOC_MAX_RANKS)
            continue;
        char why[512];
        present[r] = 1;
        if (r > maxr) maxr = r;
        tdm_json *doc = tdm_doc_load(dir, de->d_name, &budget, why, sizeof why);
        if (!doc) {
            tdm_doc_note(d, "  note: fr_rank_%d.json: not read: %s\n", r, why);
            d->skipped++;
            continue;
        }
        docs[r] = doc;
    }
    closedir(dp);
    d->summary = tdm_doc_take_summary(d, dir, &budget);
    tdm_doc_pick_job(d, docs, present, maxr);
    if (d->summary) {
        d->world = (int)tdm_doc_int(d->summary, "world", 0);
        d->cause = tdm_doc_str(d->summary, "cause", NULL);
        if (d->cause && !d->cause[0]) d->cause = NULL;
    } else {
        /* the world most dumps agree on (the recorder writes the same on
         * every rank of a job) */
        int best = 0, best_n = 0;
        for (int r = 0; r <= maxr; r++) {
            int64_t w = docs[r] ? tdm_doc_int(docs[r], "world", 0) : 0;
            if (w < 1 || w > TDM_DOC_MAX_RANKS) continue;
            int n = 0;
            for (int q = 0; q <= maxr; q++) n += docs[q] && tdm_doc_int(docs[q], "world", 0) == w;
            if (n > best_n || (n == best_n && w > best)) { best = (int)w; best_n = n; }
        }
        d->world = best;
    }
    if (d->world <= 0) d->world = maxr + 1 > 0 ? maxr + 1 : 0;
    d->r = calloc((size_t)(d->world > 0 ? d->world : 1), sizeof *d->r);
    for (int r = 0; r <= maxr; r++) {
        if (!docs[r]) continue;
        char why[512] = "";
        int64_t w = tdm_doc_int(docs[r], "world", 0);
        if (!d->r) {
            tdm_json_free(docs[r]);
        } else if (docs[r]->type == TDM_JSON_OBJECT && w >= 1 && w <= TDM_DOC_MAX_RANKS &&
                   w != d->world) {
            tdm_doc_note(d, "  note: fr_rank_%d.json: not used: a dump of a job of %lld rank(s), "
                         "this one has %d\n", r, (long long)w, d->world);
            d->skipped++;
            tdm_json_free(docs[r]);
        } else if (r >= d->world) {
            tdm_doc_note(d, "  note: fr_rank_%d.json: not used: rank %d of a job of %d rank(s)\n",
                         r, r, d->world);
            d->skipped++;
            tdm_json_free(docs[r]);
        } else if (tdm_doc_take(&d->r[r], docs[r], r, why, sizeof why)) {
            tdm_doc_note(d, "  note: fr_rank_%d.json: not used: %s\n", r, why);
            d->skipped++;
            tdm_json_free(docs[r]);
        } else {
            got++;
        }
    }
    for (int r = 0; d->r && r < d->world && r <= maxr; r++)
        d->r[r].unusable = present[r] && !d->r[r].have;
    free(docs);
    free(present);
    return got;
}

void tdm_doc_free(tdm_doc *d)
{
    for (int i = 0; d->r && i < d->world; i++) {
        free(d->r[i].e);
        tdm_json_free(d->r[i].doc);
    }
    free(d->r);
    tdm_json_free(d->summary);
    memset(d, 0, sizeof *d);
}

/* For the pipeline's reading (tools/doctor_pp.c): one file of DIR, with
 * the same checks and cleaning as the dumps read above, NULL when it
 * cannot be read. */
tdm_json *tdm_doctor_load(const char *dir, const char *name)
{
    size_t budget = TDM_DOC_MAX_TOTAL_BYTES;
    char why[256];
    return tdm_doc_load(dir, name, &budget, why, sizeof why);
}
