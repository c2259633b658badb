/* rpc/rpc_shm.c: the shared-memory transport of rpc/: one segment per
 * job, one byte ring per ordered pair of ranks, a doorbell per rank.
 *
 * Layout (every region 64-byte aligned):
 *   header      magic, version, world, ring bytes, total bytes
 *   ranks       per rank, two lines: [doorbell] [pid, state]
 *   rings       per ordered pair (src, dst): [head: bytes written, by src]
 *               [tail: bytes read, by dst] then ring_bytes of data
 *
 * A message is a byte stream through its ring: the sender copies as much
 * as fits, publishes the head and rings the receiver's doorbell; the
 * receiver's reader thread copies what is there into its decoder and
 * publishes the tail, which the sender sleeps on when the ring is full.
 * So a message of any size passes through a ring of any size.
 *
 * The segment is a memfd, with no name anywhere (as shm/split.c's):
 * rank 0 creates it (space reserved with posix_fallocate so that a full
 * shared memory fails here and not with a SIGBUS later), broadcasts its
 * pid and descriptor over the job's communicator, every other rank opens
 * /proc/<pid>/fd/<fd>, and rank 0 keeps its descriptor until all have
 * mapped it: nothing can be left behind, whatever way the job ends, even
 * a rank killed during set-up.
 *
 * A peer is gone when its process no longer exists (or is a zombie), or
 * when it marked itself as left. Not a collective transport: the
 * communicators of shm/ do collectives. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/proc.h"
#include "core/timer.h"
#include "core/wait_impl.h"
#include "rpc/rpc_impl.h"

#define RPC_SHM_MAGIC 0x314d4853435052ull /* "RPCSHM1" */
#define RPC_SHM_VERSION 1u
#define RPC_SHM_LINE 64
/* Default bytes per ring: 64 rings of 8 ranks take 16 MiB; a message
 * larger than a ring streams through it. */
#define RPC_SHM_DEFAULT_RING ((size_t)256 << 10)
/* Longest sleep of a sender on a full ring between liveness checks. */
#define RPC_SHM_SEND_NAP_NS 2000000ull

enum { RPC_SHM_ALIVE = 1, RPC_SHM_LEFT = 2 };

typedef struct rpc_shm_header {
    uint64_t magic;
    uint32_t version;
    int32_t world;
    uint64_t ring_bytes;
    uint64_t total_bytes;
} rpc_shm_header;

typedef struct rpc_shm_rank {
    alignas(RPC_SHM_LINE) tdm_wait_flag doorbell;  /* bumped by every sender (fetch_add) */
    alignas(RPC_SHM_LINE) _Atomic int32_t pid;
    _Atomic int32_t state;
} rpc_shm_rank;

typedef struct rpc_shm_ring {
    alignas(RPC_SHM_LINE) tdm_wait_flag head;      /* bytes written: the sender's */
    alignas(RPC_SHM_LINE) tdm_wait_flag tail;      /* bytes read: the receiver's */
    /* set by the sender that gave up on a half-written message (the
     * receiver read nothing for the send's bound): never cleared */
    alignas(RPC_SHM_LINE) _Atomic int32_t abandoned;
} rpc_shm_ring;

typedef struct rpc_shm {
    uint8_t *base;
    size_t total, ring_bytes;
    int world;
    rpc_shm_rank *ranks;
    pid_t pid[TDM_RPC_MAX_RANKS];
} rpc_shm;

static size_t ring_stride(size_t ring_bytes)
{
    return sizeof(rpc_shm_ring) + ring_bytes;
}

static rpc_shm_ring *ring_at(rpc_shm *s, int src, int dst)
{
    size_t off = RPC_SHM_LINE * 2 + (size_t)s->world * sizeof(rpc_shm_rank) +
                 ((size_t)src * (size_t)s->world + (size_t)dst) * ring_stride(s->ring_bytes);
    return (rpc_shm_ring *)(s->base + off);
}

static uint8_t *ring_data(rpc_shm *s, rpc_shm_ring *r)
{
    (void)s;
    return (uint8_t *)(r + 1);
}

static size_t layout_total(int world, size_t ring_bytes)
{
    return RPC_SHM_LINE * 2 + (size_t)world * sizeof(rpc_shm_rank) +
           (size_t)world * (size_t)world * ring_stride(ring_bytes);
}

/* The state letter of pid's process in /proc (R, S, T, Z, ...); 0 when
 * it cannot be read. */
static char pid_state(pid_t pid)
{
    char buf[256];
    const char *p = tdm_proc_stat(pid, buf, sizeof buf);
    return p ? p[0] : 0;
}

/* 1 when pid's process is gone or a zombie. */
static int pid_gone(pid_t pid, char *why, size_t n)
{
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) {
        snprintf(why, n, "died (process %d no longer exists)", (int)pid);
        return 1;
    }
    char st = pid_state(pid);
    if (st == 'Z' || st == 'X') {
        snprintf(why, n, "died (process %d has exited)", (int)pid);
        return 1;
    }
    return 0;
}

static int shm_peer_gone(tdm_rpc *rpc, int dst, char *why, size_t n)
{
    rpc_shm *s = rpc->tp;
    int gone = 0;
    if (atomic_load_explicit(&s->ranks[dst].state, memory_order_acquire) == RPC_SHM_LEFT) {
        snprintf(why, n, "has left (its RPC endpoint was freed)");
        gone = 1;
    } else {
        char tmp[128];
        gone = pid_gone(s->pid[dst], tmp, sizeof tmp);
        if (gone) snprintf(why, n, "(pid %d) %s", (int)s->pid[dst], tmp);
    }
    if (!gone) return 0;
    /* what it wrote before it went is still to be read: gone once the
     * reader has drained its ring (tail is published after dispatch) */
    rpc_shm_ring *r = ring_at(s, dst, rpc->rank);
    return atomic_load_explicit(&r->head.value, memory_order_acquire) ==
           atomic_load_explicit(&r->tail.value, memory_order_acquire);
}

static void ring_doorbell(rpc_shm *s, int dst)
{
    /* seq_cst: the publisher's half of tdm_wait_sleep's Dekker pair (the
     * reader registers in waiters, then re-reads the value) */
    tdm_wait_flag *d = &s->ranks[dst].doorbell;
    atomic_fetch_add_explicit(&d->value, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&d->waiters, memory_order_seq_cst) != 0) tdm_wait_wake(d, TDM_WAIT_SHARED);
}

/* Fails the send: dst took no byte for stall_ns. */
static tdm_status stalled(rpc_shm *s, int dst, uint64_t stall_ns)
{
    char st = pid_state(s->pid[dst]);
    return tdm_error_set(TDM_STATUS_TIMEOUT, "rank %d has not read for %.1f s (pid %d%s)", dst,
                         (double)stall_ns / 1e9, (int)s->pid[dst],
                         st == 'T' || st == 't' ? ", stopped: SIGSTOP or a debugger" : ", alive");
}

static tdm_status ring_write(tdm_rpc *rpc, int dst, const uint8_t *p, size_t n, uint64_t stall_ns,
                             uint64_t deadline_ns, size_t *sent)
{
    rpc_shm *s = rpc->tp;
    rpc_shm_ring *r = ring_at(s, rpc->rank, dst);
    uint8_t *data = ring_data(s, r);
    /* only this rank writes head (under the endpoint's send lock for dst) */
    uint64_t head = atomic_load_explicit(&r->head.value, memory_order_relaxed);
    uint64_t seen_tail = UINT64_MAX, since = 0;
    while (n > 0) {
        /* acquire: pairs with the reader's publish of tail, after which
         * the bytes it read may be overwritten */
        uint64_t tail = atomic_load_explicit(&r->tail.value, memory_order_acquire);
        size_t space = s->ring_bytes - (size_t)(head - tail);
        if (space == 0) {
            char why[160];
            if (atomic_load_explicit(&rpc->stopping, memory_order_acquire))
                return tdm_error_set(TDM_STATUS_ABORTED, "rpc: rank %d is shutting down", rpc->rank);
            if (shm_peer_gone(rpc, dst, why, sizeof why))
                return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc: send to rank %d: it %s", dst, why);
            /* the bound runs from the last byte dst took */
            uint64_t now = tdm_time_ns();
            if (tail != seen_tail) {
                seen_tail = tail;
                since = now;
            } else if (now - since >= stall_ns) {
                return stalled(s, dst, stall_ns);
            }
            if (now >= deadline_ns)
                return tdm_error_set(TDM_STATUS_TIMEOUT, "rank %d has not read the message within the call's "
                                     "timeout (%zu bytes of it taken)", dst, *sent);
            tdm_wait_sleep(&r->tail, tail + 1, RPC_SHM_SEND_NAP_NS, TDM_WAIT_SHARED, NULL);
            continue;
        }
        size_t k = n < space ? n : space;
        size_t at = (size_t)(head % s->ring_bytes);
        size_t first = s->ring_bytes - at < k ? s->ring_bytes - at : k;
        memcpy(data + at, p, first);
        if (k > first) memcpy(data, p + first, k - first);
        head += k;
        p += k;
        n -= k;
        *sent += k;
        /* release: the bytes above before the head that announces them
         * (pairs with the reader's acquire load of head) */
        atomic_store_explicit(&r->head.value, head, memory_order_release);
        ring_doorbell(s, dst);
    }
    return TDM_STATUS_OK;
}

static tdm_status shm_send(tdm_rpc *rpc, int dst, const void *a, size_t na, const void *b, size_t nb,
                           uint64_t stall_ns, uint64_t deadline_ns, size_t *sent)
{
    rpc_shm *s = rpc->tp;
    *sent = 0;
    if (atomic_load_explicit(&s->ranks[dst].state, memory_order_acquire) == RPC_SHM_LEFT)
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc: send to rank %d: it has left", dst);
    TDM_CHECK(ring_write(rpc, dst, a, na, stall_ns, deadline_ns, sent));
    if (nb) TDM_CHECK(ring_write(rpc, dst, b, nb, stall_ns, deadline_ns, sent));
    return TDM_STATUS_OK;
}

static void shm_abandon(tdm_rpc *rpc, int dst)
{
    rpc_shm *s = rpc->tp;
    /* release: after the bytes written (the receiver reads the flag
     * before it reads any) */
    atomic_store_explicit(&ring_at(s, rpc->rank, dst)->abandoned, 1, memory_order_release);
    ring_doorbell(s, dst);
}

static void shm_pump(tdm_rpc *rpc, int nap_ms)
{
    rpc_shm *s = rpc->tp;
    tdm_wait_flag *bell = &s->ranks[rpc->rank].doorbell;
    uint64_t rung = atomic_load_explicit(&bell->value, memory_order_acquire);
    int got = 0;
    for (int src = 0; src < s->world; src++) {
        if (src == rpc->rank || rpc->dec[src].broken) continue;
        rpc_shm_ring *r = ring_at(s, src, rpc->rank);
        /* acquire, before head: an abandoned ring's last head is seen */
        int abandoned = atomic_load_explicit(&r->abandoned, memory_order_acquire);
        /* acquire: pairs with the sender's release store of head */
        uint64_t head = atomic_load_explicit(&r->head.value, memory_order_acquire);
        uint64_t tail = atomic_load_explicit(&r->tail.value, memory_order_relaxed);
        if (abandoned) {
            /* the messages sent whole are delivered (as a TCP stream's
             * before its end); what is left ends mid-message */
            if (head != tail) {
                size_t n = (size_t)(head - tail), at = (size_t)(tail % s->ring_bytes);
                size_t first = s->ring_bytes - at < n ? s->ring_bytes - at : n;
                if (tdm_rpc_feed(rpc, src, ring_data(s, r) + at, first) == TDM_STATUS_OK && n > first)
                    (void)tdm_rpc_feed(rpc, src, ring_data(s, r), n - first);
                tdm_wait_publish(&r->tail, head, TDM_WAIT_SHARED);
            }
            rpc->dec[src].broken = 1;
            tdm_rpc_peer_lost(rpc, src, TDM_RPC_PEER_GONE,
                              "gave up on a message to this rank, which had not read for its send bound "
                              "(was this process stopped?): its channel is closed");
            continue;
        }
        if (head == tail) continue;
        got = 1;
        uint8_t *data = ring_data(s, r);
        size_t n = (size_t)(head - tail);
        size_t at = (size_t)(tail % s->ring_bytes);
        size_t first = s->ring_bytes - at < n ? s->ring_bytes - at : n;
        tdm_status st = tdm_rpc_feed(rpc, src, data + at, first);
        if (st == TDM_STATUS_OK && n > first) st = tdm_rpc_feed(rpc, src, data, n - first);
        /* release: done reading before the sender may overwrite (pairs
         * with its acquire load of tail); wakes a sender asleep on it */
        tdm_wait_publish(&r->tail, head, TDM_WAIT_SHARED);
        if (st != TDM_STATUS_OK) tdm_rpc_peer_lost(rpc, src, TDM_RPC_PEER_GONE, tdm_error_message());
    }
    if (!got && !atomic_load_explicit(&rpc->stopping, memory_order_acquire))
        tdm_wait_sleep(bell, rung + 1, (uint64_t)nap_ms * 1000000ull, TDM_WAIT_SHARED, NULL);
}

static void shm_wake(tdm_rpc *rpc)
{
    ring_doorbell(rpc->tp, rpc->rank);
}

static void shm_close(tdm_rpc *rpc)
{
    rpc_shm *s = rpc->tp;
    if (!s) return;
    if (s->base) {
        atomic_store_explicit(&s->ranks[rpc->rank].state, RPC_SHM_LEFT, memory_order_release);
        for (int r = 0; r < s->world; r++)
            if (r != rpc->rank) ring_doorbell(s, r);
        munmap(s->base, s->total);
    }
    free(s);
    rpc->tp = NULL;
}

static const tdm_rpc_tp_ops shm_ops = {
    .name = "shm",
    .send = shm_send,
    .abandon = shm_abandon,
    .pump = shm_pump,
    .peer_gone = shm_peer_gone,
    .wake = shm_wake,
    .close = shm_close,
};

/* Every rank's verdict on a step of the set-up: fails on all when one
 * failed (the MAX of the ranks' codes). */
static tdm_status agree(tdm_rpc *rpc, tdm_status mine, const char *what)
{
    int64_t v = mine != TDM_STATUS_OK ? (int64_t)rpc->rank + 1 : 0;
    char msg[TDM_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", tdm_error_message());
    TDM_CHECK(tdm_comm_all_reduce(rpc->opts.comm, &v, &v, 1, TDM_DTYPE_INT64, TDM_REDOP_MAX));
    if (mine != TDM_STATUS_OK) return tdm_error_set(mine, "%s", msg);
    if (v) return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc shm: rank %d failed to %s", (int)v - 1, what);
    return TDM_STATUS_OK;
}

tdm_status tdm_rpc_shm_open(tdm_rpc *rpc)
{
    tdm_status st = TDM_STATUS_OK, mine = TDM_STATUS_OK;
    int fd = -1;
    rpc_shm *s = calloc(1, sizeof *s);
    TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "rpc shm: no memory");
    rpc->tp = s;
    rpc->ops = &shm_ops;
    s->world = rpc->world;
    s->ring_bytes = rpc->opts.ring_bytes ? rpc->opts.ring_bytes : RPC_SHM_DEFAULT_RING;
    s->ring_bytes = (s->ring_bytes + RPC_SHM_LINE - 1) / RPC_SHM_LINE * RPC_SHM_LINE;
    s->total = layout_total(s->world, s->ring_bytes);
    /* rank 0's pid and descriptor: the others open /proc/<pid>/fd/<fd> */
    int64_t where[2] = {(int64_t)getpid(), -1};
    if (rpc->rank == 0) {
        fd = memfd_create("tandem-rpc", MFD_CLOEXEC);
        if (fd < 0) {
            mine = tdm_error_set(TDM_STATUS_SYSTEM, "rpc shm: memfd_create: %s", strerror(errno));
        } else {
            where[1] = fd;
            int e = ftruncate(fd, (off_t)s->total) ? errno : posix_fallocate(fd, 0, (off_t)s->total);
            if (e)
                mine = tdm_error_set(TDM_STATUS_SYSTEM,
                                     "rpc shm: reserving %zu bytes for the RPC segment: %s (is shared memory "
                                     "full? a smaller ring: tdm_rpc_opts.ring_bytes)", s->total, strerror(e));
        }
    }
    TDM_TRY(agree(rpc, mine, "create the RPC segment"));
    TDM_TRY(tdm_comm_broadcast(rpc->opts.comm, where, where, 2, TDM_DTYPE_INT64, 0));
    if (rpc->rank != 0) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)where[0], (long long)where[1]);
        do fd = open(path, O_RDWR | O_CLOEXEC);
        while (fd < 0 && errno == EINTR);
        if (fd < 0) {
            mine = tdm_error_set(TDM_STATUS_SYSTEM, "rpc shm: cannot open rank 0's segment through %s: %s (the "
                                 "ranks must be processes of one user that may read each other's /proc "
                                 "entries)", path, strerror(errno));
        } else {
            struct stat sb;
            if (fstat(fd, &sb) || (size_t)sb.st_size != s->total)
                mine = tdm_error_set(TDM_STATUS_FORMAT, "rpc shm: %s is %lld bytes (expected %zu)", path,
                                     (long long)sb.st_size, s->total);
        }
    }
    if (mine == TDM_STATUS_OK) {
        void *p = mmap(NULL, s->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) mine = tdm_error_set(TDM_STATUS_SYSTEM, "rpc shm: mmap %zu bytes: %s", s->total, strerror(errno));
        else {
            s->base = p;
            s->ranks = (rpc_shm_rank *)(s->base + RPC_SHM_LINE * 2);
            if (rpc->rank == 0) {
                rpc_shm_header *h = (rpc_shm_header *)s->base;
                h->version = RPC_SHM_VERSION;
                h->world = s->world;
                h->ring_bytes = s->ring_bytes;
                h->total_bytes = s->total;
                /* the magic last: the others check it after the agreement below */
                h->magic = RPC_SHM_MAGIC;
            }
        }
    }
    /* rank 0's descriptor stays open until every rank has opened its own */
    TDM_TRY(agree(rpc, mine, "map the RPC segment"));
    if (fd >= 0) close(fd);
    fd = -1;
    {
        const rpc_shm_header *h = (const rpc_shm_header *)s->base;
        if (h->magic != RPC_SHM_MAGIC || h->version != RPC_SHM_VERSION || h->world != s->world ||
            h->ring_bytes != s->ring_bytes || h->total_bytes != s->total)
            mine = tdm_error_set(TDM_STATUS_FORMAT,
                                 "rpc shm: segment header (magic 0x%llx, version %u, world %d, ring %llu) "
                                 "is not this job's (world %d, ring %zu)",
                                 (unsigned long long)h->magic, h->version, h->world,
                                 (unsigned long long)h->ring_bytes, s->world, s->ring_bytes);
    }
    atomic_store_explicit(&s->ranks[rpc->rank].pid, (int32_t)getpid(), memory_order_release);
    atomic_store_explicit(&s->ranks[rpc->rank].state, RPC_SHM_ALIVE, memory_order_release);
    TDM_TRY(agree(rpc, mine, "check the RPC segment"));
    for (int r = 0; r < s->world; r++)
        s->pid[r] = (pid_t)atomic_load_explicit(&s->ranks[r].pid, memory_order_acquire);
    return TDM_STATUS_OK;
fail:
    if (fd >= 0) close(fd);
    return st;
}
