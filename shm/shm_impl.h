/* shm/shm_impl.h: internals shared by shm/segment.c, shm/wait.c,
 * shm/coll.c and shm/kernels.c: the segment layout, the flags that ranks
 * wait on, and the per-process communicator state.
 * Not a public header: users include shm/shm_comm.h.
 *
 * Segment layout (offsets in the header, every region 4 KiB aligned):
 *
 *   header     one page: magic, version, sizes of every region, world,
 *              job id, the group abort word
 *   ctrl       per rank, two 64-byte lines: [progress flag + call
 *              descriptors] [pid + state + heartbeat], so that the hot flag
 *              never shares a line with anything another process writes often
 *   reasons    per rank and one for the parent, an abort reason each
 *   slots      per rank, NBUF staging buffers of slot_bytes
 *   p2p        per ordered pair (src, dst): a sent flag line, an ack flag
 *              line, two halves of P2P bytes, then the receiver's ready
 *              line (a zero-copy recv posted: shm/coll.c)
 *   arena      per rank, arena_bytes of zero-copy buffers
 */
#ifndef TDM_SHM_SHM_IMPL_H
#define TDM_SHM_SHM_IMPL_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "core/comm_impl.h"
#include "core/wait_impl.h"
#include "shm/shm_comm.h"

#define TDM_SHM_MAGIC 0x314d48534d444e54ull /* "TNDMSHM1" little endian */
#define TDM_SHM_VERSION 4u
#define TDM_SHM_LINE 64
#define TDM_SHM_PAGE 4096
#define TDM_SHM_NBUF 2            /* staging buffers per rank */
#define TDM_SHM_P2P_BYTES (64 * 1024) /* each of the two halves */
#define TDM_SHM_P2P_HDR 64        /* per half: message size, chunk index */
#define TDM_SHM_REASON_BYTES 512  /* one abort reason */

/* A word ranks wait on: a free-running 64-bit counter, written only by
 * its owner, waited on with core/wait_impl.h (spin, then a shared futex on its
 * low 32 bits; sleepers count themselves in `waiters`, so that the owner
 * makes a wake syscall only when someone sleeps). Part of the segment's
 * layout: TDM_SHM_VERSION covers it. */
typedef tdm_wait_flag tdm_shm_flag;
_Static_assert(sizeof(tdm_shm_flag) == 16, "the flag's layout is the segment's");

/* What a rank called, recorded before it arrives at a collective. */
typedef struct tdm_shm_desc {
    uint64_t seq;
    uint64_t count;
    int8_t coll, dtype, op, root;
    /* 0: private buffers; else 1 + the buffer's offset in the arena, in
     * elements (zero-copy reads peers at this rank's offset: all must match) */
    uint32_t zero_copy;
} tdm_shm_desc;

enum {
    TDM_SHM_STATE_EMPTY = 0,   /* not attached yet */
    TDM_SHM_STATE_ALIVE = 1,
    TDM_SHM_STATE_LEFT = 2,    /* freed its communicator */
    TDM_SHM_STATE_DEAD = 3,    /* failed, reported by the parent (wstatus) */
};

typedef struct tdm_shm_ctrl {
    /* line 0: written by the owner only (waiters by sleepers) */
    alignas(TDM_SHM_LINE) tdm_shm_flag flag;  /* epoch: 3*round + phase */
    tdm_shm_desc desc[2];                      /* by seq & 1 */
    /* line 1: liveness */
    alignas(TDM_SHM_LINE) _Atomic int32_t pid;
    _Atomic int32_t state;
    _Atomic int32_t wstatus;
    _Atomic int32_t ended;     /* 1: the parent reported its end (wstatus) */
    _Atomic uint64_t beat;     /* heartbeat: advanced by the rank's heartbeat thread */
    _Atomic int32_t in_call;   /* > 0: inside a collective (tdm_shm_run), where an abort
                                * reaches it; 0: computing between collectives */
} tdm_shm_ctrl;

_Static_assert(sizeof(tdm_shm_ctrl) == 2 * TDM_SHM_LINE, "ctrl is two lines");

typedef struct tdm_shm_header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    uint64_t total_bytes;
    uint64_t ctrl_off, ctrl_bytes;    /* per rank */
    uint64_t reason_off;              /* world + 1 reasons of TDM_SHM_REASON_BYTES */
    uint64_t slot_off, slot_bytes;    /* per buffer; NBUF per rank */
    uint64_t p2p_off, p2p_bytes;      /* per ordered pair */
    uint64_t arena_off, arena_bytes;  /* per rank */
    uint64_t one_shot_max;
    int32_t world;
    int32_t nbuf;
    int32_t cores;                    /* the ranks' cores together (tdm_shm_opts.cores) */
    int32_t reserved;
    uint64_t job_id;
    /* Group abort, published in one step: a raiser first writes its reason
     * in its own reason slot (rank r: slot r; the parent: slot world),
     * which nobody reads until it is published, then CASes abort_word from
     * 0 to the encoding below (release; readers load it with acquire
     * before reading the slot it names). A raiser that dies before its CAS
     * has claimed nothing; once set, the word never changes and neither
     * does the slot it names (its owner writes it only while the word is 0). */
    alignas(TDM_SHM_LINE) _Atomic uint64_t abort_word;
} tdm_shm_header;

/* abort_word: bits 0-15 the status, 16-23 1 + the raiser's slot, 24-31
 * 1 + the rank the raiser blames (0: none, e.g. a mismatch). */
#define TDM_SHM_ABORT_WORD(st, slot, culprit)                                  \
    ((uint64_t)(uint16_t)(st) | ((uint64_t)((slot) + 1) << 16) |                \
     ((uint64_t)((culprit) + 1) << 24))

_Static_assert(sizeof(tdm_shm_header) <= TDM_SHM_PAGE, "header fits a page");

/* The segment's geometry, in private memory: filled from a private
 * snapshot of the header once it has been validated (attach) or from the
 * layout just computed (create). Nothing after that reads offsets, sizes
 * or world from the shared header, which any process holding the segment
 * could rewrite. */
typedef struct tdm_shm_geom {
    int world;
    size_t total;
    size_t ctrl_off, ctrl_bytes;
    size_t reason_off;
    size_t slot_off, slot_bytes;
    size_t p2p_off, p2p_bytes;
    size_t arena_off, arena_bytes;
    size_t one_shot_max;
    int cores;
} tdm_shm_geom;

struct tdm_shm_group {
    int fd;
    int world;
    void *base;
    size_t total;
    tdm_shm_geom geom;
    tdm_shm_opts opts;
    _Atomic int raising;       /* this process is writing the parent's reason slot */
};

typedef struct tdm_shm_impl {
    tdm_shm_header *hdr;       /* shared: only the abort word and job id are read */
    tdm_shm_geom geom;         /* private, validated: every offset comes from here */
    uint8_t *base;
    size_t total;
    int unmap;                 /* 1: this communicator mapped it (attach) */
    int rank, world;
    int64_t timeout_ms;
    int spin;                  /* spin before sleeping (world <= the group's cores) */
    int spin_async;            /* ... also on the progress thread (2 x world <= cores) */
    int spin_now;              /* the policy of the call in progress */
    uint64_t spin_ns;
    uint64_t round;            /* rounds completed (all collectives) */
    uint64_t peer_seen[TDM_SHM_MAX_RANKS]; /* highest epoch seen of each peer */
    uint64_t seq;              /* collectives issued */
    uint64_t p2p_sent[TDM_SHM_MAX_RANKS];  /* chunks sent to each peer */
    uint64_t p2p_recvd[TDM_SHM_MAX_RANKS]; /* chunks received from each */
    uint64_t p2p_msgs[TDM_SHM_MAX_RANKS];  /* messages, for error text */
    uint64_t p2p_nsend[TDM_SHM_MAX_RANKS]; /* messages sent to each peer */
    uint64_t p2p_nrecv[TDM_SHM_MAX_RANKS]; /* messages received from each */
    size_t arena_used;
    const char *algo;          /* last algorithm, for tdm_comm_last_algo */
    const char *logged_algo[TDM_COLL_COUNT_]; /* last one logged, per collective */
    /* the call in progress, for error messages */
    const char *cur_name;
    uint64_t cur_seq;
    uint64_t next_live_ns;
    uint64_t unsure_since_ns[TDM_SHM_MAX_RANKS]; /* peer gone or left, status awaited since */
    /* Stall detection (tdm_shm_opts.stall_ms): what this rank last saw of
     * each awaited peer's heartbeat, and when it last saw it advance. */
    uint64_t stall_ns;         /* 0: off */
    uint64_t beat_seen[TDM_SHM_MAX_RANKS];
    uint64_t beat_seen_ns[TDM_SHM_MAX_RANKS];
    /* This rank's heartbeat thread */
    pthread_t hb_thread;
    pthread_mutex_t hb_mu;
    pthread_cond_t hb_cv;
    int hb_running, hb_stop;
    _Atomic int raising;       /* a thread of this rank is writing its reason slot */
    /* Test hook (TANDEM_SHM_TEST_LATE_CHECKS=<rank>, tests/test_shm_live.c):
     * this rank's waits, once their spin is over, hold their failure
     * checks until the group abort is raised, as a rank descheduled there
     * on a loaded machine would. */
    int test_late_checks;
    /* Test hook (TANDEM_SHM_TEST_GONE_PAUSE=<rank>, tests/test_shm_live.c):
     * the first time this rank's liveness check has read how the peer it
     * waits for stands, it waits (30 s at most) until the parent has
     * reported that peer ended before acting on what it read, as a rank
     * descheduled just there on a loaded machine would. */
    int test_gone_pause;
    tdm_status failed;         /* sticky: once a call failed, all fail */
    char failed_msg[256];      /* its message */
    /* A communicator split from another (shm/split.c): the job's
     * communicator (the one never split; borrowed, it outlives this one),
     * whose abort stops this one's waits and which every abort raised here
     * raises too, so that a failure anywhere stops the whole job; and each
     * rank's job rank, for messages. root NULL, job_rank the identity: the
     * job's own communicator. */
    struct tdm_shm_impl *root;
    int job_rank[TDM_SHM_MAX_RANKS];
    /* 1: this communicator is a part of a larger job (one machine's ranks
     * in MPI's hier, tdm_shm_comm_set_rank_names): its messages name
     * ranks by job_rank alone, as every other line of the job does */
    int named_by_job;
} tdm_shm_impl;

/* The rank messages say for rank r of c: the job's on a part of a job
 * (named_by_job), else its own. */
static inline int tdm_shm_name(const tdm_shm_impl *c, int r)
{
    return c->named_by_job && r >= 0 && r < c->world ? c->job_rank[r] : r;
}

/* How messages name rank r of c with its pid: "rank 3 (pid 4121)", or on a
 * split communicator "rank 1 (job rank 3, pid 4121)". Returns buf. */
static inline const char *tdm_shm_who(const tdm_shm_impl *c, int r, int pid, char *buf, size_t n)
{
    if (c->root && r >= 0 && r < c->world)
        snprintf(buf, n, "rank %d (job rank %d, pid %d)", r, c->job_rank[r], pid);
    else
        snprintf(buf, n, "rank %d (pid %d)", tdm_shm_name(c, r), pid);
    return buf;
}

static inline tdm_shm_ctrl *tdm_shm_geom_ctrl(const tdm_shm_geom *g, uint8_t *base, int r)
{
    return (tdm_shm_ctrl *)(base + g->ctrl_off + (size_t)r * g->ctrl_bytes);
}
static inline tdm_shm_ctrl *tdm_shm_ctrl_of(const tdm_shm_impl *c, int r)
{
    return tdm_shm_geom_ctrl(&c->geom, c->base, r);
}
static inline uint8_t *tdm_shm_slot_of(const tdm_shm_impl *c, int r, uint64_t round)
{
    return c->base + c->geom.slot_off +
           ((size_t)r * TDM_SHM_NBUF + (size_t)(round % TDM_SHM_NBUF)) * c->geom.slot_bytes;
}
static inline uint8_t *tdm_shm_p2p_of(const tdm_shm_impl *c, int src, int dst)
{
    return c->base + c->geom.p2p_off + ((size_t)src * c->world + (size_t)dst) * c->geom.p2p_bytes;
}
static inline uint8_t *tdm_shm_arena_of(const tdm_shm_impl *c, int r)
{
    return c->base + c->geom.arena_off + (size_t)r * c->geom.arena_bytes;
}

/* segment.c */
/* tdm_shm_group_create on fd (owned from now on, closed on failure; -1:
 * a memfd or opts' directory), where names the backing in messages (NULL:
 * opts'), job_id is the header's (0: drawn here). */
tdm_status tdm_shm_group_create_at(tdm_shm_group **out, int world, const tdm_shm_opts *opts,
                                   int fd, const char *where, uint64_t job_id);
/* tdm_shm_comm_attach_fd, refusing a segment whose header's job id is not
 * expect_job (0: any). */
tdm_status tdm_shm_attach_fd_job(tdm_comm **out, int fd, int rank, int world,
                                 const tdm_shm_opts *opts, uint64_t expect_job);
tdm_status tdm_shm_layout(int world, const tdm_shm_opts *opts, tdm_shm_header *out);
/* The geometry of a header that tdm_shm_layout built or that was validated. */
void tdm_shm_geom_from(const tdm_shm_header *h, tdm_shm_geom *out);

/* wait.c */
/* Publish v on f (owner only): release store, wake sleepers if any.
 * Pairs with the acquire/seq_cst loads in tdm_shm_flag_wait (core/wait_impl.h):
 * every write to the slots before this store is visible to a waiter that
 * sees v. */
static inline void tdm_shm_flag_publish(tdm_shm_flag *f, uint64_t v)
{
    tdm_wait_publish(f, v, TDM_WAIT_SHARED);
}
/* Wait until f >= target, where f belongs to rank `peer` (named in
 * errors). Fails on group abort, a dead or departed peer, or deadline. */
tdm_status tdm_shm_flag_wait(tdm_shm_impl *c, tdm_shm_flag *f, uint64_t target, int peer);
/* Raise the group abort (the first raiser wins) and wake everyone. slot:
 * the raiser's reason slot (its rank, or world for the parent); raising:
 * that slot's writer lock in this process; culprit: the rank the reason
 * blames, or -1. */
void tdm_shm_raise(tdm_shm_header *h, const tdm_shm_geom *g, uint8_t *base, int slot,
                   _Atomic int *raising, int culprit, tdm_status st, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
/* A rank's raise: its own slot; on a split communicator also the job's
 * (shm/split.c), blaming the culprit's job rank. */
void tdm_shm_raise_comm(tdm_shm_impl *c, int culprit, tdm_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define tdm_shm_raise_rank(c, culprit, st, ...) tdm_shm_raise_comm((c), (culprit), (st), __VA_ARGS__)

/* The group abort as published, decoded. */
typedef struct tdm_shm_abort_info {
    tdm_status status;         /* TDM_STATUS_OK: not raised */
    int raiser;                /* the rank that raised it, -1: the parent */
    int culprit;               /* the rank it blames, -1: none */
    const char *reason;        /* in the segment; never changes once raised */
} tdm_shm_abort_info;
/* 1 and *out filled when the abort has been raised, else 0. */
int tdm_shm_abort_get(const tdm_shm_header *h, const tdm_shm_geom *g, const uint8_t *base,
                      tdm_shm_abort_info *out);
/* TDM_STATUS_OK, or the group's abort status with this call's message
 * (on a split communicator, the job's abort too). */
tdm_status tdm_shm_check_abort(tdm_shm_impl *c);
/* This rank's heartbeat: a thread that advances ctrl.beat every
 * TDM_SHM_BEAT_NS whatever the rank's own threads do, so that a stopped
 * process (all its threads stopped) is told from a busy one. */
#define TDM_SHM_BEAT_NS (100ull * 1000 * 1000)
tdm_status tdm_shm_heartbeat_start(tdm_shm_impl *c);
void tdm_shm_heartbeat_stop(tdm_shm_impl *c);

/* split.c */
/* The backend's tdm_comm_ops.split: a new segment per group, made by the
 * group's first rank and joined by the others through the parent. */
tdm_status tdm_shm_split(void *impl, const tdm_comm_split_info *info, tdm_comm **out);

/* coll.c */
tdm_status tdm_shm_run(void *impl, const tdm_comm_call *call);

/* kernels.c */
/* dst0 (and dst1 when not NULL) = srcs[0] op srcs[1] op ... in order;
 * AVG divides the sum by nsrc. Any dst may alias any src. */
void tdm_shm_reduce(void *dst0, void *dst1, const void *const *srcs, int nsrc, size_t n,
                    tdm_dtype dt, tdm_redop op);
/* The same for one destination that overlaps no source (the one-shot
 * path: sources in the slots, the destination in the caller's memory);
 * small messages, one pass per source. */
void tdm_shm_reduce_into(void *dst, const void *const *srcs, int nsrc, size_t n, tdm_dtype dt,
                         tdm_redop op);
/* memcpy, with non-temporal stores for large copies whose destination is
 * not read again soon. */
void tdm_shm_copy_nt(void *dst, const void *src, size_t nbytes);
/* Messages of at least this many bytes copy their portions out with
 * non-temporal stores (tdm_shm_copy_nt); TANDEM_SHM_NT_BYTES sets it. */
extern size_t tdm_shm_nt_threshold;

#endif
