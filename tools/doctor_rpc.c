/* tools/doctor_rpc.c: `tandem doctor`'s verdict on a job built on rpc/
 * (the parameter server): which call was left waiting, on whom, and why
 * that rank did not answer. Each rank's RPC endpoint dumps a recorder of
 * its own (backend "rpc", fr_rank_<R>.c<K>.pid<P>.json; rpc/rpc_fr.c):
 * an entry per call made ("rpc call ps.push #17 to 0": queued while its
 * arguments were written, running while it waited for the reply, done,
 * failed) and per call served ("rpc serve ps.push #17 from 2": queued
 * behind others, running while its function ran, done once replied).
 * The call left waiting first (the earliest not answered) is matched with
 * its callee's serve entry: queued (the callee's server was on another
 * call), running (its function never returned), done (the reply was lost),
 * absent (never received), or no dump at all (how the callee ended, from
 * the launcher's summary). A rank killed outright (a signal the teardown
 * did not send) is the root cause before any call it left unanswered, and
 * is named with the last of its calls another rank served. */
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "tools/doctor.h"

#define TDM_DOC_RPC_MAX_RANKS 1024

typedef struct tdm_doc_rpc_ent {
    int call;                  /* 1: a call made, 0: one served */
    char name[64];
    unsigned long long id;
    int peer;                  /* the callee of a call, the caller of a serve */
    char state[16];
    uint64_t t_enq, t_start, t_end;
} tdm_doc_rpc_ent;

typedef struct tdm_doc_rpc_rank {
    tdm_doc_rpc_ent *e;
    int n, cap;
    int dumped;
    uint64_t dump_ns;
    char reason[512];          /* its record's first failure; "" none */
} tdm_doc_rpc_rank;

static const char *tdm_doc_rpc_str(const tdm_json *o, const char *k, const char *dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && v->type == TDM_JSON_STRING ? v->str : dflt;
}

static int64_t tdm_doc_rpc_int(const tdm_json *o, const char *k, int64_t dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && (v->type == TDM_JSON_INT || v->type == TDM_JSON_BOOL) ? v->i : dflt;
}

static void tdm_doc_rpc_take(tdm_doc_rpc_rank *r, const tdm_json *doc)
{
    r->dumped = 1;
    r->dump_ns = (uint64_t)tdm_doc_rpc_int(doc, "dump_mono_ns", 0);
    if (tdm_doc_rpc_int(doc, "failed", 0))
        snprintf(r->reason, sizeof r->reason, "%s", tdm_doc_rpc_str(doc, "reason", ""));
    const tdm_json *ents = tdm_json_get(doc, "entries");
    int n = ents && ents->type == TDM_JSON_ARRAY ? ents->n : 0;
    for (int i = 0; i < n; i++) {
        const tdm_json *o = &ents->items[i];
        const char *label = tdm_doc_rpc_str(o, "label", "");
        tdm_doc_rpc_ent x = {0};
        if (sscanf(label, "rpc call %63s #%llu to %d", x.name, &x.id, &x.peer) == 3) x.call = 1;
        else if (sscanf(label, "rpc serve %63s #%llu from %d", x.name, &x.id, &x.peer) != 3) continue;
        /* a peer out of any job (a damaged dump): not an index */
        if (x.peer < 0 || x.peer >= TDM_DOC_RPC_MAX_RANKS) continue;
        snprintf(x.state, sizeof x.state, "%s", tdm_doc_rpc_str(o, "state", "?"));
        x.t_enq = (uint64_t)tdm_doc_rpc_int(o, "t_enqueue_ns", 0);
        x.t_start = (uint64_t)tdm_doc_rpc_int(o, "t_start_ns", 0);
        x.t_end = (uint64_t)tdm_doc_rpc_int(o, "t_end_ns", 0);
        if (r->n == r->cap) {
            int cap = r->cap ? 2 * r->cap : 256;
            tdm_doc_rpc_ent *ne = realloc(r->e, (size_t)cap * sizeof *ne);
            if (!ne) return;
            r->e = ne;
            r->cap = cap;
        }
        r->e[r->n++] = x;
    }
}

/* Seconds from t to the end of e (its end, else the dump). */
static double tdm_doc_rpc_secs(const tdm_doc_rpc_rank *r, const tdm_doc_rpc_ent *e, uint64_t t)
{
    uint64_t end = e->t_end ? e->t_end : r->dump_ns;
    return end > t && t ? (double)(end - t) / 1e9 : 0.0;
}

/* q's entry serving call #id of rank r; NULL: none in its record. */
static const tdm_doc_rpc_ent *tdm_doc_rpc_served(const tdm_doc_rpc_rank *q, int r, unsigned long long id)
{
    for (int i = q->n - 1; i >= 0; i--)
        if (!q->e[i].call && q->e[i].peer == r && q->e[i].id == id) return &q->e[i];
    return NULL;
}

/* What q's server thread was on: its serve entry still running. */
static const tdm_doc_rpc_ent *tdm_doc_rpc_busy(const tdm_doc_rpc_rank *q)
{
    for (int i = q->n - 1; i >= 0; i--)
        if (!q->e[i].call && !strcmp(q->e[i].state, "running")) return &q->e[i];
    return NULL;
}

/* A rank killed outright (not by the teardown, not stopped): the first. */
static int tdm_doc_rpc_killed(int world, tdm_doctor_end_fn end_of, void *ctx, char *end, size_t n)
{
    for (int r = 0; end_of && r < world; r++) {
        int induced = 0;
        const char *e = end_of(ctx, r, &induced, end, n);
        if (e && !induced && !strncmp(e, "was killed", 10)) {
            if (e != end) snprintf(end, n, "%s", e);
            return r;
        }
    }
    return -1;
}

/* How the callee q of a call left waiting answered it (or did not). */
static tdm_doctor_verdict tdm_doc_rpc_why(const tdm_doc_rpc_rank *rk, int r, const tdm_doc_rpc_ent *x,
                                          tdm_doctor_end_fn end_of, void *ctx, char *how, size_t n)
{
    int q = x->peer;
    const tdm_doc_rpc_rank *qr = &rk[q];
    const tdm_doc_rpc_ent *s = qr->dumped ? tdm_doc_rpc_served(qr, r, x->id) : NULL;
    if (s && !strcmp(s->state, "queued")) {
        const tdm_doc_rpc_ent *b = tdm_doc_rpc_busy(qr);
        int k = snprintf(how, n, "which had it queued, not served, for %.1f s", tdm_doc_rpc_secs(qr, s, s->t_enq));
        if (b && k > 0 && (size_t)k < n)
            snprintf(how + k, n - (size_t)k, " (its server was still on %s #%llu from rank %d, for %.1f s)",
                     b->name, b->id, b->peer, tdm_doc_rpc_secs(qr, b, b->t_start));
        return TDM_DOCTOR_STALLED;
    }
    if (s && !strcmp(s->state, "running")) {
        snprintf(how, n, "which has been serving it for %.1f s (its function has not returned)",
                 tdm_doc_rpc_secs(qr, s, s->t_start));
        return TDM_DOCTOR_STALLED;
    }
    if (s && !strcmp(s->state, "done")) {
        snprintf(how, n, "which served it and sent the reply: the reply never arrived");
        return TDM_DOCTOR_FAILED;
    }
    if (s && !strcmp(s->state, "failed")) {
        snprintf(how, n, "which served it but could not send the reply%s%s", qr->reason[0] ? ": " : "",
                 qr->reason);
        return TDM_DOCTOR_FAILED;
    }
    int induced = 0;
    char buf[256];
    const char *end = end_of ? end_of(ctx, q, &induced, buf, sizeof buf) : NULL;
    const char *what = qr->dumped ? "which never received it" : "which never served it";
    if (end && !induced && !strncmp(end, "was killed", 10)) {
        snprintf(how, n, "%s: rank %d %s", what, q, end);
        return TDM_DOCTOR_DIED;
    }
    if (end && induced) {
        snprintf(how, n, "%s: rank %d was stopped or frozen (no dump; the teardown ended it)", what, q);
        return TDM_DOCTOR_STALLED;
    }
    if (end) {
        snprintf(how, n, "%s: rank %d %s%s%s", what, q, end, qr->reason[0] ? ": " : "", qr->reason);
        return TDM_DOCTOR_FAILED;
    }
    snprintf(how, n, "%s: rank %d %s", what, q,
             qr->dumped ? "served other calls (a lost message?)" : "left no dump (stopped, frozen or gone)");
    return TDM_DOCTOR_STALLED;
}

static const char *tdm_doc_rpc_word(tdm_doctor_verdict v)
{
    return v == TDM_DOCTOR_DIED ? "DIED" : v == TDM_DOCTOR_STALLED ? "STALLED" : "FAILED";
}

int tdm_doctor_rpc(const char *dir, tdm_doctor_end_fn end_of, void *ctx, tdm_doctor_verdict *v, char *line,
                   size_t n, char *detail, size_t dn)
{
    detail[0] = '\0';
    DIR *dp = opendir(dir);
    if (!dp) return 0;
    tdm_doc_rpc_rank *rk = calloc(TDM_DOC_RPC_MAX_RANKS, sizeof *rk);
    if (!rk) {
        closedir(dp);
        return 0;
    }
    int world = 0, found = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        int r = -1;
        if (sscanf(de->d_name, "fr_rank_%d", &r) != 1 || !strstr(de->d_name, ".json")) continue;
        tdm_json *doc = tdm_doctor_load(dir, de->d_name);
        if (!doc) continue;
        /* the job rank is in the dump (the endpoint's recorder is inner) */
        int64_t jr = tdm_doc_rpc_int(doc, "rank", -1);
        int64_t w = tdm_doc_rpc_int(doc, "world", 0);
        if (!strcmp(tdm_doc_rpc_str(doc, "backend", ""), "rpc") && jr >= 0 && jr < TDM_DOC_RPC_MAX_RANKS) {
            tdm_doc_rpc_take(&rk[jr], doc);
            if (jr + 1 > world) world = (int)jr + 1;
            if (w > world && w <= TDM_DOC_RPC_MAX_RANKS) world = (int)w;
        }
        tdm_json_free(doc);
    }
    closedir(dp);
    /* the call left waiting first, over every rank's record */
    int wr = -1;
    const tdm_doc_rpc_ent *x = NULL;
    size_t dl = 0;
    for (int r = 0; r < world; r++)
        for (int i = 0; i < rk[r].n; i++) {
            const tdm_doc_rpc_ent *e = &rk[r].e[i];
            if (!e->call || !strcmp(e->state, "done") || !e->t_enq) continue;
            if (dl + 1 < dn)
                dl += (size_t)snprintf(detail + dl, dn - dl, "  rpc: rank %d's call %s #%llu to rank %d: %s, "
                                       "%.1f s\n", r, e->name, e->id, e->peer,
                                       !strcmp(e->state, "running") ? "sent, no reply" : e->state,
                                       tdm_doc_rpc_secs(&rk[r], e, e->t_enq));
            if (dl >= dn) dl = dn - 1;
            if (!x || e->t_enq < x->t_enq) {
                x = e;
                wr = r;
            }
        }
    char end[256];
    int killed = tdm_doc_rpc_killed(world, end_of, ctx, end, sizeof end);
    if (killed >= 0 && (!x || x->peer != killed)) {
        /* a rank killed outright: the root cause, with the last of its
         * calls served (a killed rank could not dump its own) */
        const tdm_doc_rpc_ent *last = NULL;
        int by = -1;
        for (int r = 0; r < world; r++)
            for (int i = 0; i < rk[r].n; i++) {
                const tdm_doc_rpc_ent *e = &rk[r].e[i];
                if (!e->call && e->peer == killed && (!last || e->t_enq > last->t_enq)) {
                    last = e;
                    by = r;
                }
            }
        *v = TDM_DOCTOR_DIED;
        if (last)
            snprintf(line, n, "DIED: rank %d %s; the last of its RPC calls served: %s #%llu by rank %d (%s)",
                     killed, end, last->name, last->id, by, last->state);
        else
            snprintf(line, n, "DIED: rank %d %s; no rank served an RPC call of it", killed, end);
        found = 1;
    } else if (x) {
        char how[700];
        *v = tdm_doc_rpc_why(rk, wr, x, end_of, ctx, how, sizeof how);
        snprintf(line, n, "%s: rank %d waited %.1f s for the reply to %s #%llu from rank %d, %s",
                 tdm_doc_rpc_word(*v), wr, tdm_doc_rpc_secs(&rk[wr], x, x->t_enq), x->name, x->id, x->peer, how);
        found = 1;
    }
    for (int r = 0; r < TDM_DOC_RPC_MAX_RANKS; r++) free(rk[r].e);
    free(rk);
    return found;
}
