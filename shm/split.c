/* shm/split.c: sub-communicators of the shm backend (tdm_comm_split's
 * backend half) and what ties them to the job.
 *
 * A group's ranks share a new segment: its first rank creates it (a memfd,
 * sized like the parent's, fallocated) and tells the others, through an
 * all_gather over the parent, its pid, the descriptor and the header's job
 * id; each other member opens /proc/<pid>/fd/<fd> (the memfd itself, as
 * its creator holds it: no name anywhere, nothing to leave behind) and
 * attaches, checking the job id. A second all_gather over the parent
 * agrees on the outcome before the creator closes its descriptor, so
 * every rank returns the same status.
 *
 * A split communicator fails with the job: its waits also watch the job
 * communicator's abort word, and every abort it raises is raised on the
 * job's too (blaming the culprit's job rank), so a rank dying in a
 * pipeline's send stops the data-parallel peers as well. Its own waits
 * find a dead or stopped peer by /proc and heartbeats as the job's do
 * (its segment is not the one the parent process reports deaths into; the
 * job's abort, raised by that report, ends its waits just the same).
 * Not the collectives (shm/coll.c), not the waits (shm/wait.c). */
#include "shm/shm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"

/* Staging slots of a communicator made for send/recv (tdm_comm_split_opts.p2p):
 * the smallest the layout takes. */
#define TDM_SHM_SPLIT_P2P_SLOT 4096u
/* The one-shot defaults of shm/segment.c: a parent that used one of them
 * lets its sub-communicators pick theirs for their own size. */
#define TDM_SHM_SPLIT_ONE_SHOT_A 512u
#define TDM_SHM_SPLIT_ONE_SHOT_B 4096u

void tdm_shm_raise_comm(tdm_shm_impl *c, int culprit, tdm_status st, const char *fmt, ...)
{
    char reason[TDM_SHM_REASON_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    tdm_shm_raise(c->hdr, &c->geom, c->base, c->rank, &c->raising, culprit, st, "%s", reason);
    tdm_shm_impl *r = c->root;
    if (!r) return;
    int job_culprit = culprit >= 0 && culprit < c->world ? c->job_rank[culprit] : -1;
    tdm_shm_raise(r->hdr, &r->geom, r->base, r->rank, &r->raising, job_culprit, st, "%s", reason);
}

/* What a group's first rank tells the others, all-gathered (int64s). */
typedef struct tdm_shm_split_rec {
    int64_t status;            /* tdm_status of its creation */
    int64_t pid, fd;
    int64_t job_id;            /* the new header's (uint64 bits) */
} tdm_shm_split_rec;

/* Options of the new segment: the parent's, but sized for the group. */
static tdm_shm_opts tdm_shm_split_opts(const tdm_shm_impl *c, const tdm_comm_split_opts *so)
{
    tdm_shm_opts o = {0};
    o.slot_bytes = so->p2p ? TDM_SHM_SPLIT_P2P_SLOT : c->geom.slot_bytes;
    o.arena_bytes = so->arena_bytes ? so->arena_bytes : so->p2p ? 0 : c->geom.arena_bytes;
    o.timeout_ms = c->timeout_ms;
    o.cores = c->geom.cores;
    o.no_spin = !c->spin && c->world <= c->geom.cores;
    o.stall_ms = c->stall_ns ? (int64_t)(c->stall_ns / 1000000u) : -1;
    if (c->geom.one_shot_max != TDM_SHM_SPLIT_ONE_SHOT_A &&
        c->geom.one_shot_max != TDM_SHM_SPLIT_ONE_SHOT_B)
        o.one_shot_max_bytes = c->geom.one_shot_max;
    return o;
}

/* The creator's segment, opened by another process of the same user. */
static tdm_status tdm_shm_split_open(const tdm_shm_split_rec *rec, int *fd_out)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)rec->pid, (long long)rec->fd);
    int fd;
    do fd = open(path, O_RDWR | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm split: cannot open the group's segment "
                             "through %s: %s (the ranks must be processes of one user that "
                             "may read each other's /proc entries)", path, strerror(errno));
    *fd_out = fd;
    return TDM_STATUS_OK;
}

tdm_status tdm_shm_split(void *impl, const tdm_comm_split_info *in, tdm_comm **out)
{
    tdm_shm_impl *c = impl;
    tdm_status st = TDM_STATUS_OK, mine = TDM_STATUS_OK;
    tdm_shm_group *g = NULL;
    tdm_comm *sub = NULL;
    int size = tdm_comm_size(in->parent);
    tdm_shm_split_rec *recs = calloc((size_t)size, sizeof *recs);
    int32_t *oks = calloc((size_t)size, sizeof *oks);
    char msg[TDM_ERROR_MSG_MAX] = "";
    *out = NULL;
    if (!recs || !oks) {
        free(recs);
        free(oks);
        tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "shm split: cannot allocate %d records", size);
        (void)tdm_comm_abort(in->parent, tdm_error_message());
        return TDM_STATUS_OUT_OF_MEMORY;
    }
    tdm_shm_opts o = tdm_shm_split_opts(c, in->opts);

    /* 1. each group's first rank makes the segment */
    tdm_shm_split_rec rec = {0};
    if (in->size > 0 && in->rank == 0) {
        mine = tdm_shm_group_create_at(&g, in->size, &o, -1, NULL, 0);
        if (mine == TDM_STATUS_OK) {
            rec.pid = (int64_t)getpid();
            rec.fd = tdm_shm_group_fd(g);
            rec.job_id = (int64_t)((const tdm_shm_header *)g->base)->job_id;
        } else {
            snprintf(msg, sizeof msg, "%s", tdm_error_message());
        }
        rec.status = mine;
    }
    tdm_comm_set_label(in->parent, "comm split: shm segments");
    TDM_TRY(tdm_comm_all_gather(in->parent, &rec, recs, sizeof rec / sizeof(int64_t),
                                TDM_DTYPE_INT64));

    /* 2. every member attaches (the first through its own descriptor) */
    if (in->size > 0 && mine == TDM_STATUS_OK) {
        const tdm_shm_split_rec *lead = &recs[in->members[0]];
        if (lead->status != TDM_STATUS_OK) {
            tdm_status ls = lead->status > 0 && lead->status < TDM_STATUS_COUNT_
                                ? (tdm_status)lead->status : TDM_STATUS_INTERNAL;
            char who[48];
            mine = tdm_error_set(ls, "shm split: %s, the first rank of color %d, could not "
                                 "create the group's segment (%s; see its error)",
                                 tdm_comm_rank_str(in->parent, in->members[0], who, sizeof who),
                                 in->color, tdm_status_name(ls));
        } else if (g) {
            mine = tdm_shm_attach_fd_job(&sub, tdm_shm_group_fd(g), in->rank, in->size, &o,
                                         (uint64_t)lead->job_id);
        } else {
            int fd = -1;
            mine = tdm_shm_split_open(lead, &fd);
            if (mine == TDM_STATUS_OK) {
                mine = tdm_shm_attach_fd_job(&sub, fd, in->rank, in->size, &o,
                                             (uint64_t)lead->job_id);
                close(fd);   /* the mapping holds the segment */
            }
        }
        if (mine != TDM_STATUS_OK && !msg[0]) snprintf(msg, sizeof msg, "%s", tdm_error_message());
    }

    /* 3. the outcome, agreed: the creators may close their descriptors */
    int32_t ok = mine;
    tdm_comm_set_label(in->parent, "comm split: joined");
    TDM_TRY(tdm_comm_all_gather(in->parent, &ok, oks, 1, TDM_DTYPE_INT32));
    for (int r = 0; r < size; r++) {
        if (oks[r] == TDM_STATUS_OK) continue;
        if (mine != TDM_STATUS_OK) {
            st = tdm_error_set(mine, "%s", msg);
        } else {
            char who[48];
            tdm_status rs = oks[r] > 0 && oks[r] < TDM_STATUS_COUNT_ ? (tdm_status)oks[r]
                                                                     : TDM_STATUS_INTERNAL;
            st = tdm_error_set(rs, "shm split: %s could not join its sub-communicator (%s; "
                               "see its error)", tdm_comm_rank_str(in->parent, r, who, sizeof who),
                               tdm_status_name(rs));
        }
        goto fail;
    }
    if (sub) {
        tdm_shm_impl *s = tdm_comm_impl(sub);
        s->root = c->root ? c->root : c;
        for (int i = 0; i < in->size; i++) s->job_rank[i] = in->job_ranks[i];
    }
    *out = sub;
    sub = NULL;
fail:
    tdm_comm_free(sub);
    tdm_shm_group_free(g);
    free(recs);
    free(oks);
    return st;
}
