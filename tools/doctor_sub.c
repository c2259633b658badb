/* tools/doctor_sub.c: `tandem doctor` on the communicators split from a
 * job's first one (core/comm_split.c: dist/mesh.h's dp, pp and tp groups,
 * on which the mesh designs train while the first communicator, after the
 * splits, carries nothing). Each is dumped beside the rank's first
 * (fr_rank_<R>.c<K>.pid<P>.json) with its id and its members' job ranks
 * ("comm", "members"): the collective a rank was still in there, the
 * earliest to have started, is the one the ranks waited in. Send and recv
 * are the pipeline's (tools/doctor_pp.c). */
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "tools/doctor.h"
#include "tools/doctor_impl.h"

/* 1 when job rank r is one of doc's members. */
static int tdm_doc_sub_member(const tdm_json *doc, int r)
{
    const tdm_json *m = tdm_json_get(doc, "members");
    for (int i = 0; m && m->type == TDM_JSON_ARRAY && i < m->n; i++)
        if (m->items[i].type == TDM_JSON_INT && m->items[i].i == r) return 1;
    return 0;
}

/* The earliest-started first call not done of the split dumps of job:
 * of rank's own (only >= 0: sends and receives too), else of the others
 * of a communicator blamed belongs to (blamed -1: any). */
static int tdm_doc_sub_scan(const char *dir, const char *job, int blamed, int only, char *out,
                            size_t n)
{
    DIR *dp = opendir(dir);
    if (!dp) return 0;
    uint64_t best_t = UINT64_MAX;
    int found = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        int r = -1, len = 0;
        if (sscanf(de->d_name, "fr_rank_%d%n", &r, &len) != 1 || r < 0 ||
            !strcmp(de->d_name + len, ".json") || !strstr(de->d_name + len, ".json") ||
            strstr(de->d_name + len, ".tmp"))
            continue;
        tdm_json *doc = tdm_doctor_load(dir, de->d_name);
        const tdm_json *ents = doc ? tdm_json_get(doc, "entries") : NULL;
        const tdm_json *mem = doc ? tdm_json_get(doc, "members") : NULL;
        int me = doc ? (int)tdm_doc_int(doc, "rank", -1) : -1;
        /* a split's dump of this job, of a communicator the blamed rank
         * belongs to, not the blamed rank's own (the others waited) */
        if (!ents || ents->type != TDM_JSON_ARRAY || !mem || mem->type != TDM_JSON_ARRAY ||
            (job && strcmp(tdm_doc_str(doc, "job", ""), job)) || (only >= 0 && me != only) ||
            (only < 0 && (me == blamed || (blamed >= 0 && !tdm_doc_sub_member(doc, blamed))))) {
            tdm_json_free(doc);
            continue;
        }
        for (int i = 0; i < ents->n; i++) {
            const tdm_json *o = &ents->items[i];
            const char *coll = tdm_doc_str(o, "coll", "?"), *state = tdm_doc_str(o, "state", "?");
            if (!strcmp(state, "done") ||
                (only < 0 && (!strcmp(coll, "send") || !strcmp(coll, "recv"))))
                continue;
            int64_t ts = tdm_doc_int(o, "t_start_ns", 0);
            if (ts <= 0) ts = tdm_doc_int(o, "t_enqueue_ns", 0);
            if (ts <= 0 || (uint64_t)ts >= best_t) break;   /* the first not done, only */
            best_t = (uint64_t)ts;
            found = 1;
            tdm_doc_entry e = {
                .seq = (uint64_t)tdm_doc_int(o, "seq", 0),
                .count = (uint64_t)tdm_doc_int(o, "count", 0),
                .root = tdm_doc_int(o, "root", -1),
                .coll = coll, .dtype = tdm_doc_str(o, "dtype", "?"),
                .op = tdm_doc_str(o, "op", "-"), .label = tdm_doc_str(o, "label", ""),
            };
            char call[256], who[160];
            tdm_doc_call_str(&e, call, sizeof call);
            size_t wl = 0;
            who[0] = 0;
            for (int k = 0; k < mem->n && wl < sizeof who - 1; k++) {
                int w = snprintf(who + wl, sizeof who - wl, "%s%lld", k ? "," : "",
                                 (long long)mem->items[k].i);
                if (w > 0) wl += (size_t)w;
            }
            snprintf(out, n, "%s #%" PRIu64 " of the communicator of ranks %.120s (split from "
                     "the job's; rank %d: %.16s)", call, e.seq, who, me, state);
            break;
        }
        tdm_json_free(doc);
    }
    closedir(dp);
    return found;
}

int tdm_doc_sub_wait(const char *dir, const char *job, int blamed, char *out, size_t n)
{
    return tdm_doc_sub_scan(dir, job, blamed, -1, out, n);
}

int tdm_doc_sub_stop(const char *dir, const char *job, int rank, char *out, size_t n)
{
    return rank >= 0 && tdm_doc_sub_scan(dir, job, -1, rank, out, n);
}
