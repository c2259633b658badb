/* tools/doctor_pp.c: `tandem doctor`'s verdict on a pipeline job (pp/):
 * who never sent what. The stages' links are communicators of their own,
 * each dumped beside the rank's first (fr_rank_<R>.c<K>.pid<P>.json), and
 * every transfer on them is labelled "pp send act mb 3 stage 0->1" /
 * "pp recv grad mb 0 stage 2->1". A stage that failed to receive waited
 * on the stage that should have sent; if that one was itself waiting on
 * a recv, the chain is followed to the stage that was not: the root
 * cause, named with what it never sent and how it ended (killed, stopped,
 * its own failure). Each link's dump names its two ranks in the job
 * ("members", core/flight.h): the sender is the receiver's peer there,
 * whatever the mesh (with tensor-parallel stages a stage's ranks are not
 * consecutive: dist/mesh.h). A dump without them (an older recorder) is
 * read with the layout of a pipeline alone, rank = dp * S + stage. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>

#include "core/json.h"
#include "tools/doctor.h"

#define TDM_DOC_PP_MAX_RANKS 1024

typedef struct tdm_doc_pp_xfer {
    int send;                  /* 1: send, 0: recv */
    char kind[8];              /* "act", "grad" */
    int mb, from, to;
    int peer;                  /* the link's other rank in the job; -1: unknown */
    int done;                  /* state "done" */
    int64_t step;
    uint64_t t_start;
    char status[32];
} tdm_doc_pp_xfer;

typedef struct tdm_doc_pp_rank {
    tdm_doc_pp_xfer *x;
    int n, cap;
    int dumped;                /* any dump of this rank was read */
    int failed;                /* its first communicator's dump says it failed */
    char reason[512];
} tdm_doc_pp_rank;

static int tdm_doc_pp_add(tdm_doc_pp_rank *r, const tdm_doc_pp_xfer *x)
{
    if (r->n == r->cap) {
        int cap = r->cap ? 2 * r->cap : 64;
        tdm_doc_pp_xfer *nx = realloc(r->x, (size_t)cap * sizeof *nx);
        if (!nx) return -1;
        r->x = nx;
        r->cap = cap;
    }
    r->x[r->n++] = *x;
    return 0;
}

static const char *tdm_doc_pp_str(const tdm_json *o, const char *k, const char *dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && v->type == TDM_JSON_STRING ? v->str : dflt;
}

static int64_t tdm_doc_pp_int(const tdm_json *o, const char *k, int64_t dflt)
{
    const tdm_json *v = tdm_json_get(o, k);
    return v && (v->type == TDM_JSON_INT || v->type == TDM_JSON_BOOL) ? v->i : dflt;
}

/* One dump of rank r: its pipeline transfers; the first communicator's
 * (main) also says whether and why the rank failed. */
static void tdm_doc_pp_take(tdm_doc_pp_rank *r, int rank, const tdm_json *doc, int main)
{
    r->dumped = 1;
    /* a link's members (core/flight.h): the rank at its other end */
    const tdm_json *mem = tdm_json_get(doc, "members");
    int peer = -1;
    for (int i = 0; mem && mem->type == TDM_JSON_ARRAY && mem->n == 2 && i < 2; i++)
        if (mem->items[i].type == TDM_JSON_INT && mem->items[i].i != rank &&
            mem->items[i].i >= 0 && mem->items[i].i < TDM_DOC_PP_MAX_RANKS)
            peer = (int)mem->items[i].i;
    if (main && tdm_doc_pp_int(doc, "failed", 0)) {
        r->failed = 1;
        snprintf(r->reason, sizeof r->reason, "%s", tdm_doc_pp_str(doc, "reason", ""));
    }
    const tdm_json *ents = tdm_json_get(doc, "entries");
    int n = ents && ents->type == TDM_JSON_ARRAY ? ents->n : 0;
    for (int i = 0; i < n; i++) {
        const tdm_json *o = &ents->items[i];
        const char *label = tdm_doc_pp_str(o, "label", "");
        char op[8] = "", kind[8] = "";
        tdm_doc_pp_xfer x = {0};
        if (sscanf(label, "pp %7s %7s mb %d stage %d->%d", op, kind, &x.mb, &x.from, &x.to) !=
                5 ||
            (strcmp(op, "send") && strcmp(op, "recv")))
            continue;
        x.send = !strcmp(op, "send");
        x.peer = peer;
        snprintf(x.kind, sizeof x.kind, "%s", kind);
        x.done = !strcmp(tdm_doc_pp_str(o, "state", ""), "done");
        x.step = tdm_doc_pp_int(o, "step", 0);
        x.t_start = (uint64_t)tdm_doc_pp_int(o, "t_start_ns", 0);
        snprintf(x.status, sizeof x.status, "%s", tdm_doc_pp_str(o, "status", "?"));
        if (tdm_doc_pp_add(r, &x)) return;
    }
}

/* The recv rank r was waiting on: its earliest started one not done. */
static const tdm_doc_pp_xfer *tdm_doc_pp_stuck(const tdm_doc_pp_rank *r)
{
    const tdm_doc_pp_xfer *best = NULL;
    for (int i = 0; i < r->n; i++) {
        const tdm_doc_pp_xfer *x = &r->x[i];
        if (x->send || x->done) continue;
        if (!best || x->t_start < best->t_start) best = x;
    }
    return best;
}

/* Did rank r complete the send matching the recv w? */
static int tdm_doc_pp_sent(const tdm_doc_pp_rank *r, const tdm_doc_pp_xfer *w)
{
    for (int i = 0; i < r->n; i++) {
        const tdm_doc_pp_xfer *x = &r->x[i];
        if (x->send && x->done && x->mb == w->mb && x->from == w->from && x->to == w->to &&
            x->step == w->step && !strcmp(x->kind, w->kind))
            return 1;
    }
    return 0;
}

/* The rank that should have sent receiver w its recv x: the link's other
 * member, as its dump says; without one (an older recorder), by the
 * layout of a pipeline without tensor-parallel stages. */
static int tdm_doc_pp_sender(int w, const tdm_doc_pp_xfer *x)
{
    return x->peer >= 0 ? x->peer : w + (x->from - x->to);
}

/* 1 when the chain of waits from stuck rank w ends at a rank that was
 * not waiting (within the ranks there are), 0 when it comes back to one
 * of its own. */
static int tdm_doc_pp_chain_ends(const tdm_doc_pp_rank *rk, int w, int *end)
{
    int seen[TDM_DOC_PP_MAX_RANKS] = {0};
    for (;;) {
        const tdm_doc_pp_xfer *x = tdm_doc_pp_stuck(&rk[w]);
        seen[w] = 1;
        int q = tdm_doc_pp_sender(w, x);
        *end = q;
        if (q < 0 || q >= TDM_DOC_PP_MAX_RANKS) return 1;
        if (seen[q]) return 0;
        if (!tdm_doc_pp_stuck(&rk[q])) return 1;
        w = q;
    }
}

int tdm_doctor_pipeline(const char *dir, tdm_doctor_end_fn end_of, void *ctx,
                        tdm_doctor_verdict *v, char *line, size_t n)
{
    DIR *dp = opendir(dir);
    if (!dp) return 0;
    tdm_doc_pp_rank *rk = calloc(TDM_DOC_PP_MAX_RANKS, sizeof *rk);
    if (!rk) {
        closedir(dp);
        return 0;
    }
    int world = 0, found = 0;
    /* a sub-communicator's dump is named by its rank there (a stage's
     * link: the stage): the process's pid gives its job rank, from its
     * first communicator's dump or the launcher's summary */
    int64_t pid_of[TDM_DOC_PP_MAX_RANKS] = {0};
    tdm_json *sum = tdm_doctor_load(dir, TDM_DOCTOR_SUMMARY);
    const tdm_json *ranks = sum ? tdm_json_get(sum, "ranks") : NULL;
    for (int i = 0; ranks && ranks->type == TDM_JSON_ARRAY && i < ranks->n; i++) {
        int64_t r = tdm_doc_pp_int(&ranks->items[i], "rank", -1);
        if (r >= 0 && r < TDM_DOC_PP_MAX_RANKS)
            pid_of[r] = tdm_doc_pp_int(&ranks->items[i], "pid", 0);
    }
    tdm_json_free(sum);
    struct dirent *de;
    for (int pass = 0; pass < 2; pass++) {
        rewinddir(dp);
        while ((de = readdir(dp))) {
            int r = -1, len = 0;
            if (sscanf(de->d_name, "fr_rank_%d%n", &r, &len) != 1 || r < 0 ||
                r >= TDM_DOC_PP_MAX_RANKS || !strstr(de->d_name, ".json"))
                continue;
            int main = !strcmp(de->d_name + len, ".json");
            if (main != (pass == 0)) continue;
            tdm_json *doc = tdm_doctor_load(dir, de->d_name);
            if (!doc) continue;
            int64_t pid = tdm_doc_pp_int(doc, "pid", 0);
            if (main && pid > 0) pid_of[r] = pid;
            if (!main) {
                /* the job rank of this pid, else (no dump, no summary) r */
                for (int q = 0; q < TDM_DOC_PP_MAX_RANKS; q++)
                    if (pid > 0 && pid_of[q] == pid) { r = q; break; }
            }
            tdm_doc_pp_take(&rk[r], r, doc, main);
            tdm_json_free(doc);
            if (r + 1 > world) world = r + 1;
        }
    }
    closedir(dp);
    /* the first waiting receiver, by rank, whose chain of waits ends at a
     * stage that was not waiting (one without a dump first); else the first (the stages of one
     * replica may wait for each other once an abort from another replica
     * of a mesh has stopped them) */
    int w = -1, ends = -1;
    for (int r = 0; r < world; r++) {
        if (!tdm_doc_pp_stuck(&rk[r])) continue;
        if (w < 0) w = r;
        int end;
        if (!tdm_doc_pp_chain_ends(rk, r, &end)) continue;
        /* a chain that ends at a rank without a dump (killed, stopped)
         * before one that ends at a rank that failed and said why: that
         * one may have been waiting elsewhere (a dp or tp group's
         * collective) on the rank without one */
        if (end >= 0 && end < TDM_DOC_PP_MAX_RANKS && !rk[end].dumped) {
            ends = r;
            break;
        }
        if (ends < 0) ends = r;
    }
    if (ends >= 0) w = ends;
    if (w >= 0) {
        /* follow the chain of waits to a stage that was not waiting */
        int seen[TDM_DOC_PP_MAX_RANKS] = {0}, chain[TDM_DOC_PP_MAX_RANKS], k = 0;
        const tdm_doc_pp_xfer *x = tdm_doc_pp_stuck(&rk[w]);
        int q = tdm_doc_pp_sender(w, x);
        seen[w] = 1;
        chain[k++] = w;
        while (q >= 0 && q < TDM_DOC_PP_MAX_RANKS && !seen[q] && tdm_doc_pp_stuck(&rk[q])) {
            seen[q] = 1;
            chain[k++] = q;
            w = q;
            x = tdm_doc_pp_stuck(&rk[w]);
            q = tdm_doc_pp_sender(w, x);
        }
        found = 1;
        int induced = 0;
        char endbuf[256];
        const char *end = q >= 0 && end_of ? end_of(ctx, q, &induced, endbuf, sizeof endbuf)
                                           : NULL;
        char how[700];
        if (q < 0 || q >= TDM_DOC_PP_MAX_RANKS) {
            *v = TDM_DOCTOR_FAILED;
            snprintf(how, sizeof how, "no such rank (the receiver's label names stage %d)",
                     x->from);
        } else if (seen[q]) {
            *v = TDM_DOCTOR_STALLED;
            snprintf(how, sizeof how, "it was itself waiting for stage %d (rank %d): the stages "
                     "wait for each other", x->to, w);
        } else if (tdm_doc_pp_sent(&rk[q], x)) {
            *v = TDM_DOCTOR_FAILED;
            snprintf(how, sizeof how, "it did send it; the receive ended %s", x->status);
        } else if (rk[q].failed && (!end || !strncmp(end, "exited", 6))) {
            /* it stopped of an error of its own (or another's abort) */
            *v = TDM_DOCTOR_FAILED;
            snprintf(how, sizeof how, "it failed: %s", rk[q].reason);
        } else if (end && !induced) {
            *v = TDM_DOCTOR_DIED;
            snprintf(how, sizeof how, "it %s", end);
        } else {
            *v = TDM_DOCTOR_STALLED;
            snprintf(how, sizeof how, "it %s", end ? "was stopped or frozen (no dump; the "
                                                     "teardown ended it)"
                                                   : rk[q].dumped ? "stopped sending"
                                                                  : "left no dump (stopped, "
                                                                    "frozen or gone)");
        }
        int off = snprintf(line, n, "%s: stage %d (rank %d) never sent %s mb %d to stage %d "
                           "(rank %d): %s",
                           *v == TDM_DOCTOR_DIED ? "DIED" : *v == TDM_DOCTOR_STALLED ? "STALLED"
                                                                                   : "FAILED",
                           x->from, q, x->kind, x->mb, x->to, w, how);
        if (seen[q] || tdm_doc_pp_sent(&rk[q], x))
            off = snprintf(line, n, "%s: stage %d (rank %d) waited for %s mb %d from stage %d "
                           "(rank %d): %s",
                           *v == TDM_DOCTOR_STALLED ? "STALLED" : "FAILED", x->to, w, x->kind,
                           x->mb, x->from, q, how);
        /* who else waited behind it */
        for (int i = k - 2; i >= 0 && off > 0 && (size_t)off < n; i--) {
            const tdm_doc_pp_xfer *y = tdm_doc_pp_stuck(&rk[chain[i]]);
            off += snprintf(line + off, n - (size_t)off, "%s stage %d (rank %d) waited for its "
                            "%s mb %d", i == k - 2 ? "; behind it," : ",", y->to, chain[i],
                            y->kind, y->mb);
        }
    }
    for (int r = 0; r < TDM_DOC_PP_MAX_RANKS; r++) free(rk[r].x);
    free(rk);
    return found;
}
