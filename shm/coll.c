/* shm/coll.c: the collectives of the shm backend, built from rounds.
 *
 * Every collective is a sequence of rounds, and every rank runs the same
 * rounds (their number depends only on what was called, which all ranks
 * check they agree on). A rank's progress is one counter, its epoch:
 * 3*round + phase, published when it has
 *   phase 1: written its input for the round into its staging slot,
 *   phase 2: written its reduced portion (reducing algorithms),
 *   phase 3: finished reading every peer's slot for the round.
 * Round g writes staging buffer g % NBUF, so before writing it a rank
 * waits for every peer to have finished round g - NBUF (phase 3). There
 * are no full barriers: ranks pipeline on these per-round flags.
 *
 * In the first round of each collective, every rank records what it
 * called (descriptor) before phase 1 and checks every peer's descriptor
 * after seeing its phase 1: a mismatch is an error, not a hang.
 * (Descriptors are double buffered by sequence number: a peer cannot
 * start collective s+2 before this rank has arrived at s+1, that is,
 * before it has finished checking s.)
 *
 * all_reduce algorithms:
 *   one-shot   every rank copies its input to its slot and reduces all
 *              slots into its output (small messages: one round, one
 *              wait per peer);
 *   rs-ag      per round of slot_bytes: copy in, each rank reduces its
 *              1/N portion of all slots (into its slot and its output),
 *              then copies every other rank's reduced portion out;
 *   rs-ag-zc   the buffer lives in the zero-copy arena at the same offset
 *              on every rank: reduce reads the peers' buffers directly,
 *              no copy in; a final wait keeps peers' buffers untouched
 *              until everyone has read them.
 * Point-to-point send/recv use a separate two-slot channel per ordered
 * pair of ranks, so they never disturb the collective rounds; a recv into
 * the zero-copy arena lets its sender write the payload in place.
 *
 * Not the waits (shm/wait.c) nor the arithmetic (shm/kernels.c). */
#include "shm/shm_impl.h"

#include <stdio.h>
#include <string.h>

#include "core/log.h"

#define TDM_SHM_ZC_PORTION (128u * 1024)   /* bytes per rank per zero-copy round */

static inline tdm_shm_flag *tdm_shm_flag_of(tdm_shm_impl *c, int r)
{
    return &tdm_shm_ctrl_of(c, r)->flag;
}

static inline void tdm_shm_publish(tdm_shm_impl *c, int phase)
{
    tdm_shm_flag_publish(tdm_shm_flag_of(c, c->rank), 3 * c->round + (uint64_t)phase);
}

/* Waits until peer's epoch reaches target. Epochs only grow, so a value
 * seen once (with acquire, pairing with the peer's publication) answers
 * every later wait for a smaller target without touching the peer's line:
 * a small collective's "has everyone finished round g-2" is answered by
 * what its previous collective saw. The common cases stay inline; the
 * out-of-line wait (spin, sleep, abort, liveness, deadline) runs only
 * when the peer is not there yet. */
static inline tdm_status tdm_shm_wait_peer(tdm_shm_impl *c, int peer, uint64_t target)
{
    if (c->peer_seen[peer] >= target) return TDM_STATUS_OK;
    tdm_shm_flag *f = tdm_shm_flag_of(c, peer);
    /* Acquire pairs with the seq_cst store in tdm_shm_flag_publish. */
    uint64_t v = atomic_load_explicit(&f->value, memory_order_acquire);
    if (v < target) {
        TDM_CHECK(tdm_shm_flag_wait(c, f, target, peer));
        v = target;
    }
    c->peer_seen[peer] = v;
    return TDM_STATUS_OK;
}

static inline tdm_status tdm_shm_wait_phase(tdm_shm_impl *c, int peer, int phase)
{
    return tdm_shm_wait_peer(c, peer, 3 * c->round + (uint64_t)phase);
}

static tdm_status tdm_shm_wait_all(tdm_shm_impl *c, uint64_t target)
{
    for (int p = 0; p < c->world; p++)
        if (p != c->rank) TDM_CHECK(tdm_shm_wait_peer(c, p, target));
    return TDM_STATUS_OK;
}

/* Before writing this round's staging buffer: every peer has finished the
 * round that last used it. */
static inline tdm_status tdm_shm_round_begin(tdm_shm_impl *c)
{
    if (c->round < TDM_SHM_NBUF) return TDM_STATUS_OK;
    return tdm_shm_wait_all(c, 3 * (c->round - TDM_SHM_NBUF) + 3);
}

static void tdm_shm_round_end(tdm_shm_impl *c)
{
    tdm_shm_publish(c, 3);
    c->round++;
}

/* Ends a collective made of a single round without publishing phase 3 (one
 * cache-line transfer less per small all_reduce or barrier). Safe because
 * the next round is the first of the next collective, where every rank
 * waits for every peer's phase 1 before going on, and a rank publishes
 * phase 1 of round g+1 only after finishing round g: any wait for
 * "phase 3 of round g" (>= 3g+3) is met by that later value (3g+4). */
static void tdm_shm_round_skip_end(tdm_shm_impl *c)
{
    c->round++;
}

static int tdm_shm_coll_reduces(int coll)
{
    return coll == TDM_COLL_REDUCE || coll == TDM_COLL_ALL_REDUCE ||
           coll == TDM_COLL_REDUCE_SCATTER;
}

static int tdm_shm_coll_rooted(int coll)
{
    return coll == TDM_COLL_BROADCAST || coll == TDM_COLL_REDUCE || coll == TDM_COLL_GATHER ||
           coll == TDM_COLL_SCATTER;
}

static void tdm_shm_desc_str(const tdm_shm_desc *d, char *out, size_t n)
{
    int len = snprintf(out, n, "%s(", tdm_coll_name((tdm_coll)d->coll));
    if (d->coll != TDM_COLL_BARRIER)
        len += snprintf(out + len, n - (size_t)len, "%s, count=%llu",
                        tdm_dtype_name((tdm_dtype)d->dtype), (unsigned long long)d->count);
    if (tdm_shm_coll_reduces(d->coll))
        len += snprintf(out + len, n - (size_t)len, ", op=%s", tdm_redop_name((tdm_redop)d->op));
    if (tdm_shm_coll_rooted(d->coll))
        len += snprintf(out + len, n - (size_t)len, ", root=%d", d->root);
    if (d->zero_copy)
        len += snprintf(out + len, n - (size_t)len, ", zero-copy buffer at arena element %lu",
                        (unsigned long)(d->zero_copy - 1));
    snprintf(out + len, n - (size_t)len, ")");
}

static int tdm_shm_desc_equal(const tdm_shm_desc *a, const tdm_shm_desc *b)
{
    if (a->seq != b->seq || a->coll != b->coll) return 0;
    if (a->coll == TDM_COLL_BARRIER) return 1;
    if (a->dtype != b->dtype || a->count != b->count || a->zero_copy != b->zero_copy) return 0;
    if (tdm_shm_coll_reduces(a->coll) && a->op != b->op) return 0;
    if (tdm_shm_coll_rooted(a->coll) && a->root != b->root) return 0;
    return 1;
}

/* First round of a collective, part 1: record what this rank called. */
static void tdm_shm_describe(tdm_shm_impl *c, const tdm_comm_call *k, uint32_t zero_copy)
{
    tdm_shm_desc *d = &tdm_shm_ctrl_of(c, c->rank)->desc[c->seq & 1];
    d->seq = c->seq;
    d->count = k->count;
    d->coll = (int8_t)k->coll;
    d->dtype = (int8_t)k->dtype;
    d->op = (int8_t)k->op;
    d->root = (int8_t)k->root;
    d->zero_copy = zero_copy;
}

/* First round, part 2 (after publishing phase 1): wait for every peer's
 * phase 1 and compare descriptors. The acquire in the wait pairs with the
 * peer's publication, which follows its descriptor write. */
static tdm_status tdm_shm_arrive_check(tdm_shm_impl *c)
{
    const tdm_shm_desc *mine = &tdm_shm_ctrl_of(c, c->rank)->desc[c->seq & 1];
    for (int p = 0; p < c->world; p++) {
        if (p == c->rank) continue;
        TDM_CHECK(tdm_shm_wait_phase(c, p, 1));
        const tdm_shm_desc *d = &tdm_shm_ctrl_of(c, p)->desc[c->seq & 1];
        /* Bytewise equal (describe writes every field) implies equal; the
         * field-by-field rule only decides the rest. */
        if (!memcmp(mine, d, sizeof *d) || tdm_shm_desc_equal(mine, d)) continue;
        char a[160], b[160];
        tdm_shm_desc_str(mine, a, sizeof a);
        tdm_shm_desc_str(d, b, sizeof b);
        if (d->seq != mine->seq)
            snprintf(b + strlen(b), sizeof b - strlen(b), " as its collective #%llu",
                     (unsigned long long)d->seq);
        tdm_shm_raise_rank(c, -1, TDM_STATUS_MISMATCH,
                      "collective #%llu: rank %d called %s but rank %d called %s",
                      (unsigned long long)c->seq, tdm_shm_name(c, c->rank), a, tdm_shm_name(c, p), b);
        c->failed = TDM_STATUS_MISMATCH;
        return tdm_error_set(TDM_STATUS_MISMATCH,
                             "collective #%llu: rank %d called %s but rank %d called %s",
                             (unsigned long long)c->seq, tdm_shm_name(c, c->rank), a, tdm_shm_name(c, p), b);
    }
    return TDM_STATUS_OK;
}

/* A round's opening: wait for the staging buffer, describe (first round),
 * run fill() on the own slot, publish phase 1, check (first round). */
#define TDM_SHM_ROUND_OPEN(c, k, first, zc, ...)                             \
    do {                                                                      \
        TDM_CHECK(tdm_shm_round_begin(c));                                    \
        if (first) tdm_shm_describe((c), (k), (zc));                          \
        __VA_ARGS__;                                                          \
        tdm_shm_publish((c), 1);                                              \
        if (first) TDM_CHECK(tdm_shm_arrive_check(c));                        \
    } while (0)

static void tdm_shm_set_algo(tdm_shm_impl *c, const char *algo, const tdm_comm_call *k)
{
    if (c->logged_algo[k->coll] != algo) {
        c->logged_algo[k->coll] = algo;
        TDM_INFO(SHM, "rank %d: %s #%llu (%zu x %s): algorithm %s", c->rank,
                 tdm_coll_name(k->coll), (unsigned long long)c->seq, k->count,
                 tdm_dtype_name(k->dtype), algo);
    }
    c->algo = algo;
}

/* Elements per rank-portion of a round, a multiple of 64 bytes. */
static size_t tdm_shm_portion_elems(size_t bytes, int world, size_t es)
{
    size_t per = bytes / (size_t)world / TDM_SHM_LINE * TDM_SHM_LINE;
    return per / es;
}

/* --- all_reduce and reduce ------------------------------------------------- */

static tdm_status tdm_shm_one_shot(tdm_shm_impl *c, const tdm_comm_call *k, int all,
                                   size_t nbytes)
{
    uint8_t *mine = tdm_shm_slot_of(c, c->rank, c->round);
    TDM_SHM_ROUND_OPEN(c, k, 1, 0, memcpy(mine, k->sendbuf, nbytes));
    if (all || c->rank == k->root) {
        const void *srcs[TDM_SHM_MAX_RANKS];
        for (int p = 0; p < c->world; p++) srcs[p] = tdm_shm_slot_of(c, p, c->round);
        tdm_shm_reduce_into(k->recvbuf, srcs, c->world, k->count, k->dtype, k->op);
    }
    tdm_shm_round_skip_end(c);
    return TDM_STATUS_OK;
}

/* A round of n elements is split in portions of `per` (whole cache lines),
 * one per rank: rank q owns [*lo, *hi), empty past the end. */
static size_t tdm_shm_portion_len(size_t n, int world, size_t line)
{
    return ((n + (size_t)world - 1) / (size_t)world + line - 1) / line * line;
}

static void tdm_shm_portion(int q, size_t per, size_t n, size_t *lo, size_t *hi)
{
    *lo = (size_t)q * per < n ? (size_t)q * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* Copies a reduced portion out: non-temporal stores for big messages
 * (one pass, not read again soon), memcpy otherwise. */
static void tdm_shm_copy_out(void *dst, const void *src, size_t nbytes, int big)
{
    if (big) tdm_shm_copy_nt(dst, src, nbytes);
    else memcpy(dst, src, nbytes);
}

/* Reduce-scatter + all-gather (all = 1) or + gather to root (all = 0),
 * through the staging slots, one slot_bytes round at a time. */
static tdm_status tdm_shm_rs_ag(tdm_shm_impl *c, const tdm_comm_call *k, int all)
{
    size_t es = tdm_dtype_size(k->dtype);
    size_t per_max = tdm_shm_portion_elems(c->geom.slot_bytes, c->world, es);
    size_t round_elems = per_max * (size_t)c->world;
    size_t line = TDM_SHM_LINE / es;
    const uint8_t *send = k->sendbuf;
    uint8_t *recv = (all || c->rank == k->root) ? k->recvbuf : NULL;
    int big = k->count * es >= tdm_shm_nt_threshold;
    for (size_t off = 0, first = 1; first || off < k->count; off += round_elems, first = 0) {
        size_t n = k->count - off < round_elems ? k->count - off : round_elems;
        size_t per = tdm_shm_portion_len(n, c->world, line);
        uint8_t *mine = tdm_shm_slot_of(c, c->rank, c->round);
        size_t lo, hi;
        tdm_shm_portion(c->rank, per, n, &lo, &hi);
        /* Peers read every portion of my input but mine, which I reduce
         * straight from the caller's buffer: copy in all but [lo, hi). */
        TDM_SHM_ROUND_OPEN(c, k, first, 0,
            memcpy(mine, send + off * es, lo * es);
            memcpy(mine + hi * es, send + (off + hi) * es, (n - hi) * es));
        if (!first) TDM_CHECK(tdm_shm_wait_all(c, 3 * c->round + 1));
        const void *srcs[TDM_SHM_MAX_RANKS];
        for (int p = 0; p < c->world; p++) srcs[p] = tdm_shm_slot_of(c, p, c->round) + lo * es;
        srcs[c->rank] = send + (off + lo) * es;
        if (hi > lo)
            tdm_shm_reduce(mine + lo * es, recv ? recv + (off + lo) * es : NULL, srcs, c->world,
                           hi - lo, k->dtype, k->op);
        tdm_shm_publish(c, 2);
        if (recv) {
            for (int q = 0; q < c->world; q++) {
                if (q == c->rank) continue;
                size_t qlo, qhi;
                tdm_shm_portion(q, per, n, &qlo, &qhi);
                if (qhi == qlo) continue;
                TDM_CHECK(tdm_shm_wait_phase(c, q, 2));
                const uint8_t *src = tdm_shm_slot_of(c, q, c->round) + qlo * es;
                tdm_shm_copy_out(recv + (off + qlo) * es, src, (qhi - qlo) * es, big);
            }
        }
        tdm_shm_round_end(c);
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_rs_ag_zc(tdm_shm_impl *c, const tdm_comm_call *k, size_t arena_off)
{
    size_t es = tdm_dtype_size(k->dtype);
    size_t per_max = TDM_SHM_ZC_PORTION / es;
    size_t round_elems = per_max * (size_t)c->world;
    size_t line = TDM_SHM_LINE / es;
    uint8_t *buf = k->recvbuf;
    int big = k->count * es >= tdm_shm_nt_threshold;
    uint8_t *peer[TDM_SHM_MAX_RANKS];
    for (int p = 0; p < c->world; p++) peer[p] = tdm_shm_arena_of(c, p) + arena_off;
    for (size_t off = 0, first = 1; first || off < k->count; off += round_elems, first = 0) {
        size_t n = k->count - off < round_elems ? k->count - off : round_elems;
        size_t per = tdm_shm_portion_len(n, c->world, line);
        /* Inputs are in place from the start: only the first round waits
         * for every peer's arrival. */
        TDM_SHM_ROUND_OPEN(c, k, first, (uint32_t)(arena_off / es + 1), (void)0);
        size_t lo, hi;
        tdm_shm_portion(c->rank, per, n, &lo, &hi);
        const void *srcs[TDM_SHM_MAX_RANKS];
        for (int p = 0; p < c->world; p++) srcs[p] = peer[p] + (off + lo) * es;
        if (hi > lo)
            tdm_shm_reduce(buf + (off + lo) * es, NULL, srcs, c->world, hi - lo, k->dtype, k->op);
        tdm_shm_publish(c, 2);
        for (int q = 0; q < c->world; q++) {
            if (q == c->rank) continue;
            size_t qlo, qhi;
            tdm_shm_portion(q, per, n, &qlo, &qhi);
            if (qhi == qlo) continue;
            /* q's portion of my buffer was q's input until q's phase 2. */
            TDM_CHECK(tdm_shm_wait_phase(c, q, 2));
            tdm_shm_copy_out(buf + (off + qlo) * es, peer[q] + (off + qlo) * es, (qhi - qlo) * es,
                             big);
        }
        tdm_shm_round_end(c);
    }
    /* Peers read my buffer until their last phase 3: the caller may not
     * write it before then. */
    return tdm_shm_wait_all(c, 3 * c->round);
}

/* Offset of [p, p+nbytes) in this rank's arena, or SIZE_MAX if outside
 * (or not describable in a descriptor: element-aligned, < 2^32 - 1). */
static size_t tdm_shm_arena_offset(tdm_shm_impl *c, const void *p, size_t nbytes, size_t es)
{
    const uint8_t *a = tdm_shm_arena_of(c, c->rank), *b = p;
    if (!c->geom.arena_bytes || b < a || b + nbytes > a + c->arena_used) return SIZE_MAX;
    size_t off = (size_t)(b - a);
    if (off % es || off / es >= UINT32_MAX - 1) return SIZE_MAX;
    return off;
}

static tdm_status tdm_shm_all_reduce(tdm_shm_impl *c, const tdm_comm_call *k, int all)
{
    size_t nbytes = k->count * tdm_dtype_size(k->dtype);
    if (nbytes <= c->geom.one_shot_max && nbytes <= c->geom.slot_bytes) {
        tdm_shm_set_algo(c, "one-shot", k);
        return tdm_shm_one_shot(c, k, all, nbytes);
    }
    size_t zoff = SIZE_MAX;
    if (all && k->sendbuf == k->recvbuf)
        zoff = tdm_shm_arena_offset(c, k->recvbuf, nbytes, tdm_dtype_size(k->dtype));
    if (zoff != SIZE_MAX) {
        tdm_shm_set_algo(c, "rs-ag-zc", k);
        return tdm_shm_rs_ag_zc(c, k, zoff);
    }
    tdm_shm_set_algo(c, "rs-ag", k);
    return tdm_shm_rs_ag(c, k, all);
}

/* --- data movement ---------------------------------------------------------- */

static tdm_status tdm_shm_reduce_scatter(tdm_shm_impl *c, const tdm_comm_call *k)
{
    size_t es = tdm_dtype_size(k->dtype);
    size_t sec = tdm_shm_portion_elems(c->geom.slot_bytes, c->world, es);
    const uint8_t *send = k->sendbuf;
    uint8_t *recv = k->recvbuf;
    tdm_shm_set_algo(c, "direct", k);
    for (size_t off = 0, first = 1; first || off < k->count; off += sec, first = 0) {
        size_t n = k->count - off < sec ? k->count - off : sec;
        uint8_t *mine = tdm_shm_slot_of(c, c->rank, c->round);
        /* Peer q reads only portion q of my slot; my own portion I reduce
         * straight from the caller's buffer (as rs_ag does): staging it
         * too cost a copy of 1/N of the input every call. */
        TDM_SHM_ROUND_OPEN(c, k, first, 0,
            for (int q = 0; q < c->world; q++)
                if (q != c->rank)
                    memcpy(mine + (size_t)q * sec * es, send + ((size_t)q * k->count + off) * es,
                           n * es));
        if (!first) TDM_CHECK(tdm_shm_wait_all(c, 3 * c->round + 1));
        const void *srcs[TDM_SHM_MAX_RANKS];
        for (int p = 0; p < c->world; p++)
            srcs[p] = tdm_shm_slot_of(c, p, c->round) + (size_t)c->rank * sec * es;
        /* in place (recv inside send) is fine: tdm_shm_reduce reads every
         * source of a block before it writes the block */
        srcs[c->rank] = send + ((size_t)c->rank * k->count + off) * es;
        if (n) tdm_shm_reduce(recv + off * es, NULL, srcs, c->world, n, k->dtype, k->op);
        tdm_shm_round_end(c);
    }
    return TDM_STATUS_OK;
}

/* all_gather (root < 0) and gather (only root receives). */
static tdm_status tdm_shm_gather(tdm_shm_impl *c, const tdm_comm_call *k, int root)
{
    size_t es = tdm_dtype_size(k->dtype);
    size_t chunk = c->geom.slot_bytes / es;
    const uint8_t *send = k->sendbuf;
    uint8_t *recv = (root < 0 || root == c->rank) ? k->recvbuf : NULL;
    tdm_shm_set_algo(c, "direct", k);
    for (size_t off = 0, first = 1; first || off < k->count; off += chunk, first = 0) {
        size_t n = k->count - off < chunk ? k->count - off : chunk;
        uint8_t *mine = tdm_shm_slot_of(c, c->rank, c->round);
        TDM_SHM_ROUND_OPEN(c, k, first, 0, memcpy(mine, send + off * es, n * es));
        if (recv) {
            uint8_t *own = recv + ((size_t)c->rank * k->count + off) * es;
            if (own != send + off * es) memmove(own, send + off * es, n * es);
            for (int q = 0; q < c->world; q++) {
                if (q == c->rank) continue;
                TDM_CHECK(tdm_shm_wait_phase(c, q, 1));
                memcpy(recv + ((size_t)q * k->count + off) * es, tdm_shm_slot_of(c, q, c->round),
                       n * es);
            }
        }
        tdm_shm_round_end(c);
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_broadcast(tdm_shm_impl *c, const tdm_comm_call *k)
{
    size_t es = tdm_dtype_size(k->dtype);
    size_t chunk = c->geom.slot_bytes / es;
    int root = k->root, me_root = c->rank == root;
    const uint8_t *send = k->sendbuf;
    uint8_t *recv = k->recvbuf;
    tdm_shm_set_algo(c, "direct", k);
    for (size_t off = 0, first = 1; first || off < k->count; off += chunk, first = 0) {
        size_t n = k->count - off < chunk ? k->count - off : chunk;
        uint8_t *mine = tdm_shm_slot_of(c, c->rank, c->round);
        TDM_SHM_ROUND_OPEN(c, k, first, 0,
            if (me_root) {
                memcpy(mine, send + off * es, n * es);
                if (recv && recv != send) memcpy(recv + off * es, send + off * es, n * es);
            });
        if (!me_root) {
            TDM_CHECK(tdm_shm_wait_phase(c, root, 1));
            memcpy(recv + off * es, tdm_shm_slot_of(c, root, c->round), n * es);
        }
        tdm_shm_round_end(c);
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_scatter(tdm_shm_impl *c, const tdm_comm_call *k)
{
    size_t es = tdm_dtype_size(k->dtype);
    size_t sec = tdm_shm_portion_elems(c->geom.slot_bytes, c->world, es);
    int root = k->root, me_root = c->rank == root;
    const uint8_t *send = k->sendbuf;
    uint8_t *recv = k->recvbuf;
    tdm_shm_set_algo(c, "direct", k);
    for (size_t off = 0, first = 1; first || off < k->count; off += sec, first = 0) {
        size_t n = k->count - off < sec ? k->count - off : sec;
        uint8_t *mine = tdm_shm_slot_of(c, c->rank, c->round);
        TDM_SHM_ROUND_OPEN(c, k, first, 0,
            if (me_root) {
                for (int q = 0; q < c->world; q++) {
                    const uint8_t *src = send + ((size_t)q * k->count + off) * es;
                    if (q != root) memcpy(mine + (size_t)q * sec * es, src, n * es);
                    else if (recv + off * es != src) memmove(recv + off * es, src, n * es);
                }
            });
        if (!me_root) {
            TDM_CHECK(tdm_shm_wait_phase(c, root, 1));
            memcpy(recv + off * es, tdm_shm_slot_of(c, root, c->round) + (size_t)c->rank * sec * es,
                   n * es);
        }
        tdm_shm_round_end(c);
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_barrier(tdm_shm_impl *c, const tdm_comm_call *k)
{
    tdm_shm_set_algo(c, "flags", k);
    TDM_SHM_ROUND_OPEN(c, k, 1, 0, (void)0);
    tdm_shm_round_skip_end(c);
    return TDM_STATUS_OK;
}

/* --- point to point -------------------------------------------------------- */

/* A channel (blk): the sent flag, the ack flag (a line each), then two
 * halves of header + payload; chunk t uses half t % 2; then the
 * receiver's ready line.
 *
 * Zero copy: a recv into this rank's arena (tdm_comm_alloc) first posts
 * its buffer on the ready line (offset and size, then the message's
 * number, released); a sender that finds its message's number there, and
 * the size it sends, copies the payload straight into the receiver's
 * buffer and sends a header marked direct in one chunk: one copy instead
 * of two, and no chunk-by-chunk exchange. A sender that looked before the
 * recv was posted (or a recv outside the arena) uses the chunks, which
 * the receiver reads either way. */
#define TDM_SHM_P2P_DIRECT (1ull << 63)   /* header bit: the payload is in place */

typedef struct tdm_shm_p2p_ready {
    _Atomic uint64_t msg;      /* 1 + the message whose buffer is posted */
    uint64_t off, bytes;       /* in the receiver's arena */
} tdm_shm_p2p_ready;

#define TDM_SHM_P2P_READY_OFF (2 * TDM_SHM_LINE + 2 * (TDM_SHM_P2P_HDR + TDM_SHM_P2P_BYTES))
_Static_assert(TDM_SHM_P2P_READY_OFF % TDM_SHM_PAGE + TDM_SHM_LINE <= TDM_SHM_PAGE,
               "the ready line fits the channel's last page (the layout is unchanged)");

static uint8_t *tdm_shm_p2p_half(uint8_t *blk, uint64_t t)
{
    return blk + 2 * TDM_SHM_LINE + (t % 2) * (TDM_SHM_P2P_HDR + TDM_SHM_P2P_BYTES);
}

static tdm_shm_p2p_ready *tdm_shm_p2p_ready_of(uint8_t *blk)
{
    return (tdm_shm_p2p_ready *)(blk + TDM_SHM_P2P_READY_OFF);
}

/* The receiver's posted buffer for message msg of nbytes, or NULL. */
static uint8_t *tdm_shm_p2p_direct(tdm_shm_impl *c, uint8_t *blk, int peer, uint64_t msg,
                                   size_t nbytes)
{
    tdm_shm_p2p_ready *rd = tdm_shm_p2p_ready_of(blk);
    /* Acquire pairs with the receiver's release store of msg, made after
     * off and bytes. */
    if (!nbytes || atomic_load_explicit(&rd->msg, memory_order_acquire) != msg + 1) return NULL;
    uint64_t off = rd->off, bytes = rd->bytes;   /* shared memory: read once, then checked */
    if (bytes != nbytes || off > c->geom.arena_bytes || nbytes > c->geom.arena_bytes - off)
        return NULL;
    return tdm_shm_arena_of(c, peer) + off;
}

static tdm_status tdm_shm_send(tdm_shm_impl *c, const tdm_comm_call *k)
{
    int peer = k->root;
    size_t nbytes = k->count * tdm_dtype_size(k->dtype);
    uint8_t *blk = tdm_shm_p2p_of(c, c->rank, peer);
    tdm_shm_flag *sent = (tdm_shm_flag *)blk, *ack = (tdm_shm_flag *)(blk + TDM_SHM_LINE);
    const uint8_t *src = k->sendbuf;
    uint64_t msg = c->p2p_nsend[peer]++;
    uint8_t *dst = tdm_shm_p2p_direct(c, blk, peer, msg, nbytes);
    size_t off = 0;
    do {
        size_t m = nbytes - off < TDM_SHM_P2P_BYTES ? nbytes - off : TDM_SHM_P2P_BYTES;
        uint64_t t = c->p2p_sent[peer];
        /* Half t % 2 is free once the receiver has consumed chunk t - 2. */
        if (t >= 2) TDM_CHECK(tdm_shm_flag_wait(c, ack, t - 1, peer));
        uint8_t *half = tdm_shm_p2p_half(blk, t);
        if (dst) {
            memcpy(dst, src, nbytes);
            *(uint64_t *)half = nbytes | TDM_SHM_P2P_DIRECT;
            m = nbytes;
        } else {
            *(uint64_t *)half = nbytes;
            memcpy(half + TDM_SHM_P2P_HDR, src + off, m);
        }
        tdm_shm_flag_publish(sent, t + 1);   /* pairs with the recv's wait */
        c->p2p_sent[peer] = t + 1;
        off += m;
    } while (off < nbytes);
    c->algo = dst ? "p2p-direct" : "p2p";
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_recv(tdm_shm_impl *c, const tdm_comm_call *k)
{
    int peer = k->root;
    size_t nbytes = k->count * tdm_dtype_size(k->dtype);
    uint8_t *blk = tdm_shm_p2p_of(c, peer, c->rank);
    tdm_shm_flag *sent = (tdm_shm_flag *)blk, *ack = (tdm_shm_flag *)(blk + TDM_SHM_LINE);
    uint8_t *dst = k->recvbuf;
    uint64_t msg = c->p2p_nrecv[peer]++;
    size_t zoff = nbytes ? tdm_shm_arena_offset(c, dst, nbytes, 1) : SIZE_MAX;
    if (zoff != SIZE_MAX) {
        tdm_shm_p2p_ready *rd = tdm_shm_p2p_ready_of(blk);
        rd->off = zoff;
        rd->bytes = nbytes;
        /* Release pairs with the sender's acquire in tdm_shm_p2p_direct. */
        atomic_store_explicit(&rd->msg, msg + 1, memory_order_release);
    }
    size_t off = 0;
    int direct = 0;
    do {
        size_t m = nbytes - off < TDM_SHM_P2P_BYTES ? nbytes - off : TDM_SHM_P2P_BYTES;
        uint64_t t = c->p2p_recvd[peer];
        TDM_CHECK(tdm_shm_flag_wait(c, sent, t + 1, peer));
        const uint8_t *half = tdm_shm_p2p_half(blk, t);
        uint64_t head = *(const uint64_t *)half, theirs = head & ~TDM_SHM_P2P_DIRECT;
        direct = (head & TDM_SHM_P2P_DIRECT) != 0;
        if (theirs != nbytes || (direct && (off || zoff == SIZE_MAX))) {
            tdm_shm_raise_rank(c, -1, TDM_STATUS_MISMATCH,
                          "recv #%llu on rank %d from rank %d: expected %zu bytes, rank %d "
                          "sent %llu", (unsigned long long)c->cur_seq, tdm_shm_name(c, c->rank),
                          tdm_shm_name(c, peer), nbytes, tdm_shm_name(c, peer), (unsigned long long)theirs);
            return tdm_error_set(TDM_STATUS_MISMATCH,
                                 "recv #%llu from rank %d: expected %zu bytes (%s, count=%zu) "
                                 "but rank %d sent %llu bytes", (unsigned long long)c->cur_seq,
                                 tdm_shm_name(c, peer), nbytes, tdm_dtype_name(k->dtype), k->count,
                                 tdm_shm_name(c, peer), (unsigned long long)theirs);
        }
        if (direct) m = nbytes;   /* already in place */
        else memcpy(dst + off, half + TDM_SHM_P2P_HDR, m);
        tdm_shm_flag_publish(ack, t + 1);    /* pairs with the send's wait */
        c->p2p_recvd[peer] = t + 1;
        off += m;
    } while (off < nbytes);
    c->algo = direct ? "p2p-direct" : "p2p";
    return TDM_STATUS_OK;
}

/* --- one rank ------------------------------------------------------------- */

static tdm_status tdm_shm_local(tdm_shm_impl *c, const tdm_comm_call *k)
{
    size_t nbytes = k->count * tdm_dtype_size(k->dtype);
    c->algo = "local";
    if (k->coll == TDM_COLL_BARRIER || !nbytes) return TDM_STATUS_OK;
    if (k->coll == TDM_COLL_SEND || k->coll == TDM_COLL_RECV)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "%s: no peer in a group of one",
                             tdm_coll_name(k->coll));
    if (k->recvbuf && k->recvbuf != k->sendbuf) memmove(k->recvbuf, k->sendbuf, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_run_call(tdm_shm_impl *c, const tdm_comm_call *k);

/* The call, counted in this rank's in_call while it runs: a parent that
 * stops a failed job tells a rank that will see the abort within its
 * collective from one computing, which will not until its next one
 * (shm/spawn.c). Relaxed: a hint, read by polling. */
tdm_status tdm_shm_run(void *impl, const tdm_comm_call *k)
{
    tdm_shm_impl *c = impl;
    tdm_shm_ctrl *me = tdm_shm_ctrl_of(c, c->rank);
    atomic_fetch_add_explicit(&me->in_call, 1, memory_order_relaxed);
    tdm_status st = tdm_shm_run_call(c, k);
    atomic_fetch_sub_explicit(&me->in_call, 1, memory_order_relaxed);
    return st;
}

static tdm_status tdm_shm_run_call(tdm_shm_impl *c, const tdm_comm_call *k)
{
    tdm_status st = TDM_STATUS_OK;
    int p2p = k->coll == TDM_COLL_SEND || k->coll == TDM_COLL_RECV;
    c->cur_name = tdm_coll_name(k->coll);
    c->cur_seq = p2p ? c->p2p_msgs[k->root]++ : c->seq;
    c->spin_now = k->async ? c->spin_async : c->spin;
    /* A call that failed may have left this rank part-way through a
     * collective's rounds: nothing after it can be trusted, even when no
     * group abort was raised (its raiser may have died before publishing). */
    if (c->failed)
        return tdm_error_set(c->failed, "shm: %s: this communicator failed earlier (%s); "
                             "create a new one", c->cur_name, c->failed_msg);
    st = tdm_shm_check_abort(c);
    if (st != TDM_STATUS_OK) goto done; /* before any round: the sequence stays */
    if (c->world == 1) {
        st = tdm_shm_local(c, k);
    } else {
        switch (k->coll) {
        case TDM_COLL_ALL_REDUCE: st = tdm_shm_all_reduce(c, k, 1); break;
        case TDM_COLL_REDUCE: st = tdm_shm_all_reduce(c, k, 0); break;
        case TDM_COLL_REDUCE_SCATTER: st = tdm_shm_reduce_scatter(c, k); break;
        case TDM_COLL_ALL_GATHER: st = tdm_shm_gather(c, k, -1); break;
        case TDM_COLL_GATHER: st = tdm_shm_gather(c, k, k->root); break;
        case TDM_COLL_BROADCAST: st = tdm_shm_broadcast(c, k); break;
        case TDM_COLL_SCATTER: st = tdm_shm_scatter(c, k); break;
        case TDM_COLL_BARRIER: st = tdm_shm_barrier(c, k); break;
        case TDM_COLL_SEND: st = tdm_shm_send(c, k); break;
        case TDM_COLL_RECV: st = tdm_shm_recv(c, k); break;
        default:
            st = tdm_error_set(TDM_STATUS_INVALID_ARG, "shm: collective %d", (int)k->coll);
        }
    }
    if (!p2p) c->seq++;
done:
    if (st != TDM_STATUS_OK) {
        if (!c->failed) c->failed = st;
        if (!c->failed_msg[0])
            snprintf(c->failed_msg, sizeof c->failed_msg, "%s", tdm_error_message());
    }
    return st;
}
