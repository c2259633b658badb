/* rpc/rpc_tcp.c: the TCP transport of rpc/ (IPv4): a rendezvous at
 * MASTER_ADDR:MASTER_PORT, then one connection per pair of ranks.
 *
 * Set-up, bounded by tdm_rpc_opts.setup_ms:
 *   rank 0 listens at the rendezvous address; every other rank connects
 *   to it (retrying while nobody listens yet), listens on a port of its
 *   own and says HELLO (its rank, the world, its port); rank 0 answers
 *   each with the TABLE of every rank's address and port. That
 *   connection is the pair (0, k)'s. Rank k then connects to each rank
 *   1..k-1 (saying HELLO) and accepts ranks k+1..world-1: a connection
 *   completes in the listener's backlog before it is accepted, so the
 *   order never deadlocks.
 * Afterwards the listeners stay open and the reader thread accepts and
 * answers anything that connects: every rank is connected by then, so a
 * newcomer is turned away after its first 40 bytes (or at its first
 * malformed byte, or 10 s of silence), with a warning naming its address
 * and what was wrong; the endpoint goes on serving. A peer that sends a
 * malformed message is disconnected and taken for gone, and calls to it
 * fail naming what it sent.
 *
 * Not a general network server: no authentication, no TLS; a job's ports
 * belong to the job (tests use 127.0.0.1 only). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/log.h"
#include "core/timer.h"
#include "rpc/rpc_impl.h"

/* A newcomer (after set-up) gets this long to say something valid. */
#define RPC_TCP_NEWCOMER_MS 10000
/* Newcomers held at once; one more closes the oldest. */
#define RPC_TCP_MAX_NEWCOMERS 16
/* Bytes read at a time from one connection. */
#define RPC_TCP_READ_BYTES ((size_t)64 << 10)
/* Longest nap of a send waiting for a full socket buffer to drain
 * between looks at the stop flag. */
#define RPC_TCP_SEND_NAP_MS 50
/* Pause between connection attempts while nobody listens yet. */
#define RPC_TCP_RETRY_MS 20

typedef struct rpc_tcp_newcomer {
    int fd;
    uint8_t buf[sizeof(tdm_rpc_wire)];
    size_t have;
    uint64_t since_ns;
    char addr[64];
} rpc_tcp_newcomer;

typedef struct rpc_tcp {
    int listen_fd;
    int port;
    int fd[TDM_RPC_MAX_RANKS];          /* -1: none (self) */
    int broken[TDM_RPC_MAX_RANKS];      /* reader: stopped reading it */
    int wake[2];                        /* a pipe that ends the reader's poll */
    rpc_tcp_newcomer newc[RPC_TCP_MAX_NEWCOMERS];
    int n_newc;
    uint8_t *rbuf;
} rpc_tcp;

typedef struct rpc_tcp_entry {
    uint32_t addr;                      /* network order */
    uint32_t port;
} rpc_tcp_entry;

static void addr_str(const struct sockaddr_in *a, char *out, size_t n)
{
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    snprintf(out, n, "%s:%d", ip, ntohs(a->sin_port));
}

static void set_nodelay(int fd)
{
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int remaining_ms(uint64_t deadline_ns)
{
    uint64_t now = tdm_time_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now) / 1000000u;
    return ms > 1000000 ? 1000000 : (int)ms + 1;
}

/* Writes all of buf, or fails naming what. */
static tdm_status write_all(int fd, const void *buf, size_t n, const char *what)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc tcp: sending to %s: %s", what,
                                 k < 0 ? strerror(errno) : "connection closed");
        p += k;
        n -= (size_t)k;
    }
    return TDM_STATUS_OK;
}

/* Reads exactly n bytes before the deadline. */
static tdm_status read_all(int fd, void *buf, size_t n, uint64_t deadline_ns, const char *what)
{
    uint8_t *p = buf;
    while (n > 0) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int r = poll(&pf, 1, remaining_ms(deadline_ns));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return tdm_error_set(TDM_STATUS_SYSTEM, "rpc tcp: poll: %s", strerror(errno));
        if (r == 0) return tdm_error_set(TDM_STATUS_TIMEOUT, "rpc tcp: %s: nothing within the set-up bound", what);
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc tcp: %s: %s", what,
                                 k < 0 ? strerror(errno) : "connection closed");
        p += k;
        n -= (size_t)k;
    }
    return TDM_STATUS_OK;
}

static tdm_status resolve(const char *host, int port, struct sockaddr_in *out)
{
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int e = getaddrinfo(host, NULL, &hints, &res);
    if (e || !res)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc tcp: MASTER_ADDR '%s': %s (an IPv4 address or host name)",
                             host, gai_strerror(e));
    memcpy(out, res->ai_addr, sizeof *out);
    out->sin_port = htons((uint16_t)port);
    freeaddrinfo(res);
    return TDM_STATUS_OK;
}

static tdm_status listen_on(const struct sockaddr_in *a, int *fd_out, int *port_out)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    TDM_REQUIRE(fd >= 0, TDM_STATUS_SYSTEM, "rpc tcp: socket: %s", strerror(errno));
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    char s[64];
    addr_str(a, s, sizeof s);
    if (bind(fd, (const struct sockaddr *)a, sizeof *a) || listen(fd, 128)) {
        int e = errno;
        close(fd);
        return tdm_error_set(TDM_STATUS_SYSTEM, "rpc tcp: listening at %s: %s%s", s, strerror(e),
                             e == EADDRINUSE ? " (another job holds MASTER_PORT: choose another)" : "");
    }
    struct sockaddr_in got;
    socklen_t len = sizeof got;
    getsockname(fd, (struct sockaddr *)&got, &len);
    *fd_out = fd;
    *port_out = ntohs(got.sin_port);
    return TDM_STATUS_OK;
}

/* Connects to a, retrying while refused, until the deadline. */
static tdm_status connect_to(const struct sockaddr_in *a, uint64_t deadline_ns, int *fd_out)
{
    char s[64];
    addr_str(a, s, sizeof s);
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        TDM_REQUIRE(fd >= 0, TDM_STATUS_SYSTEM, "rpc tcp: socket: %s", strerror(errno));
        int r;
        do r = connect(fd, (const struct sockaddr *)a, sizeof *a);
        while (r && errno == EINTR);
        if (r == 0) {
            set_nodelay(fd);
            *fd_out = fd;
            return TDM_STATUS_OK;
        }
        int e = errno;
        close(fd);
        if (e != ECONNREFUSED && e != ETIMEDOUT && e != ENETUNREACH && e != EAGAIN)
            return tdm_error_set(TDM_STATUS_SYSTEM, "rpc tcp: connecting to %s: %s", s, strerror(e));
        if (tdm_time_ns() >= deadline_ns)
            return tdm_error_set(TDM_STATUS_TIMEOUT, "rpc tcp: nobody listens at %s after the set-up bound (%s): "
                                 "is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on every rank?",
                                 s, strerror(e));
        usleep(RPC_TCP_RETRY_MS * 1000);
    }
}

static tdm_status send_hello(tdm_rpc *rpc, int fd, int port, const char *what)
{
    tdm_rpc_wire w;
    tdm_rpc_wire_fill(&w, TDM_RPC_KIND_HELLO, rpc->rank, port, (uint64_t)rpc->world, 0, 0);
    return write_all(fd, &w, sizeof w, what);
}

/* Checks a hello: FORMAT with the reason unless it is one from a rank in
 * [lo, hi] of this world. */
static tdm_status hello_check(const tdm_rpc *rpc, const tdm_rpc_wire *w, int lo, int hi)
{
    if (w->magic != TDM_RPC_MAGIC)
        return tdm_error_set(TDM_STATUS_FORMAT, "bad magic 0x%08x (expected 0x%08x): not a tandem RPC peer",
                             w->magic, TDM_RPC_MAGIC);
    if (w->version != TDM_RPC_VERSION)
        return tdm_error_set(TDM_STATUS_FORMAT, "protocol version %u (this build speaks %u)", w->version,
                             TDM_RPC_VERSION);
    if (w->kind != TDM_RPC_KIND_HELLO)
        return tdm_error_set(TDM_STATUS_FORMAT, "message kind %u before a hello", w->kind);
    if (w->id != (uint64_t)rpc->world)
        return tdm_error_set(TDM_STATUS_FORMAT, "a peer of a world of %llu (this one: %d)",
                             (unsigned long long)w->id, rpc->world);
    if (w->src < lo || w->src > hi)
        return tdm_error_set(TDM_STATUS_FORMAT, "says it is rank %d (expected %d..%d)", w->src, lo, hi);
    if (w->status <= 0 || w->status > 65535 || w->name_len || w->body_len || w->reserved)
        return tdm_error_set(TDM_STATUS_FORMAT, "a malformed hello (port %d, body %llu)", w->status,
                             (unsigned long long)w->body_len);
    return TDM_STATUS_OK;
}

/* Accepts until every rank in [lo, hi] has said hello (set-up only);
 * strangers are turned away. ports/addrs: filled per rank (may be NULL). */
static tdm_status accept_ranks(tdm_rpc *rpc, int lo, int hi, uint64_t deadline_ns, rpc_tcp_entry *table)
{
    rpc_tcp *t = rpc->tp;
    int want = hi - lo + 1;
    while (want > 0) {
        struct pollfd pf = {.fd = t->listen_fd, .events = POLLIN};
        int r = poll(&pf, 1, remaining_ms(deadline_ns));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return tdm_error_set(TDM_STATUS_TIMEOUT,
                                 "rpc tcp: rank %d: %d of ranks %d..%d never connected within the set-up bound "
                                 "(%lld ms)", rpc->rank, want, lo, hi, (long long)tdm_rpc_setup_ms(rpc));
        struct sockaddr_in a;
        socklen_t len = sizeof a;
        int fd = accept4(t->listen_fd, (struct sockaddr *)&a, &len, SOCK_CLOEXEC);
        if (fd < 0) continue;
        char who[64];
        addr_str(&a, who, sizeof who);
        tdm_rpc_wire w;
        /* a stranger gets little of the bound: the ranks must not wait on it */
        uint64_t dl = tdm_time_ns() + 2000000000ull;
        tdm_status st = read_all(fd, &w, sizeof w, dl < deadline_ns ? dl : deadline_ns, who);
        if (st == TDM_STATUS_OK) st = hello_check(rpc, &w, lo, hi);
        if (st == TDM_STATUS_OK && t->fd[w.src] >= 0)
            st = tdm_error_set(TDM_STATUS_FORMAT, "rank %d is connected already", w.src);
        if (st != TDM_STATUS_OK) {
            TDM_WARN(CORE, "rpc tcp: rank %d: turned away a connection from %s: %s", rpc->rank, who,
                     tdm_error_message());
            close(fd);
            continue;
        }
        set_nodelay(fd);
        t->fd[w.src] = fd;
        if (table) {
            table[w.src].addr = a.sin_addr.s_addr;
            table[w.src].port = (uint32_t)w.status;
        }
        want--;
    }
    return TDM_STATUS_OK;
}

/* --- the reader --------------------------------------------------------- */

static void newcomer_drop(rpc_tcp *t, int i)
{
    close(t->newc[i].fd);
    t->newc[i] = t->newc[--t->n_newc];
}

static void newcomer_read(tdm_rpc *rpc, int i)
{
    rpc_tcp *t = rpc->tp;
    rpc_tcp_newcomer *c = &t->newc[i];
    ssize_t k = recv(c->fd, c->buf + c->have, sizeof c->buf - c->have, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (k <= 0) {
        TDM_INFO(CORE, "rpc tcp: rank %d: a connection from %s closed after %zu bytes", rpc->rank, c->addr,
                 c->have);
        newcomer_drop(t, i);
        return;
    }
    c->have += (size_t)k;
    /* the magic alone tells a stranger: no need to wait for 40 bytes */
    uint32_t magic = 0;
    memcpy(&magic, c->buf, c->have < 4 ? c->have : 4);
    int bad_magic = c->have >= 4 && magic != TDM_RPC_MAGIC;
    if (c->have < sizeof c->buf && !bad_magic) return;
    tdm_rpc_wire w;
    memset(&w, 0, sizeof w);
    memcpy(&w, c->buf, c->have);
    tdm_status st = hello_check(rpc, &w, 0, rpc->world - 1);
    if (st == TDM_STATUS_OK)
        st = tdm_error_set(TDM_STATUS_FORMAT, "says it is rank %d, which is connected already", w.src);
    TDM_WARN(CORE, "rpc tcp: rank %d: turned away a connection from %s: %s", rpc->rank, c->addr,
             tdm_error_message());
    (void)st;
    newcomer_drop(t, i);
}

static void tcp_pump(tdm_rpc *rpc, int nap_ms)
{
    rpc_tcp *t = rpc->tp;
    struct pollfd pf[2 + TDM_RPC_MAX_RANKS + RPC_TCP_MAX_NEWCOMERS];
    int who[2 + TDM_RPC_MAX_RANKS + RPC_TCP_MAX_NEWCOMERS];   /* >= 0 rank; -1 wake; -2 listener; -3-i newcomer */
    int n = 0;
    pf[n] = (struct pollfd){.fd = t->wake[0], .events = POLLIN};
    who[n++] = -1;
    pf[n] = (struct pollfd){.fd = t->listen_fd, .events = POLLIN};
    who[n++] = -2;
    for (int r = 0; r < rpc->world; r++) {
        if (t->fd[r] < 0 || t->broken[r]) continue;
        pf[n] = (struct pollfd){.fd = t->fd[r], .events = POLLIN};
        who[n++] = r;
    }
    uint64_t now = tdm_time_ns();
    for (int i = t->n_newc - 1; i >= 0; i--)
        if (now - t->newc[i].since_ns > (uint64_t)RPC_TCP_NEWCOMER_MS * 1000000u) {
            TDM_WARN(CORE, "rpc tcp: rank %d: turned away a connection from %s: silent for %d ms", rpc->rank,
                     t->newc[i].addr, RPC_TCP_NEWCOMER_MS);
            newcomer_drop(t, i);
        }
    for (int i = 0; i < t->n_newc; i++) {
        pf[n] = (struct pollfd){.fd = t->newc[i].fd, .events = POLLIN};
        who[n++] = -3 - i;
    }
    int r = poll(pf, (nfds_t)n, nap_ms);
    if (r <= 0) return;
    int newc_ready[RPC_TCP_MAX_NEWCOMERS], n_ready = 0;
    for (int i = 0; i < n; i++) {
        if (!pf[i].revents) continue;
        if (who[i] == -1) {
            char buf[64];
            while (read(t->wake[0], buf, sizeof buf) > 0) {}
        } else if (who[i] == -2) {
            struct sockaddr_in a;
            socklen_t len = sizeof a;
            int fd = accept4(t->listen_fd, (struct sockaddr *)&a, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd < 0) continue;
            if (t->n_newc == RPC_TCP_MAX_NEWCOMERS) {
                TDM_WARN(CORE, "rpc tcp: rank %d: %d connections wait to say hello; the oldest (%s) is closed",
                         rpc->rank, RPC_TCP_MAX_NEWCOMERS, t->newc[0].addr);
                newcomer_drop(t, 0);
            }
            rpc_tcp_newcomer *c = &t->newc[t->n_newc++];
            memset(c, 0, sizeof *c);
            c->fd = fd;
            c->since_ns = tdm_time_ns();
            addr_str(&a, c->addr, sizeof c->addr);
        } else if (who[i] >= 0) {
            int src = who[i];
            ssize_t k = recv(t->fd[src], t->rbuf, RPC_TCP_READ_BYTES, MSG_DONTWAIT);
            if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (k <= 0) {
                char why[160];
                snprintf(why, sizeof why, "closed its connection (%s): it died or left",
                         k < 0 ? strerror(errno) : "end of stream");
                t->broken[src] = 1;
                tdm_rpc_peer_lost(rpc, src, TDM_RPC_PEER_GONE, why);
                continue;
            }
            if (tdm_rpc_feed(rpc, src, t->rbuf, (size_t)k) != TDM_STATUS_OK) {
                /* lost first: a call failing on the closed socket then
                 * names what the peer sent */
                t->broken[src] = 1;
                tdm_rpc_peer_lost(rpc, src, TDM_RPC_PEER_GONE, tdm_error_message());
                shutdown(t->fd[src], SHUT_RDWR);
            }
        } else {
            newc_ready[n_ready++] = -3 - who[i];
        }
    }
    /* highest index first: dropping one moves the last into its place */
    for (int a = 0; a < n_ready; a++)
        for (int b = a + 1; b < n_ready; b++)
            if (newc_ready[b] > newc_ready[a]) {
                int tmp = newc_ready[a];
                newc_ready[a] = newc_ready[b];
                newc_ready[b] = tmp;
            }
    for (int a = 0; a < n_ready; a++)
        if (newc_ready[a] < t->n_newc) newcomer_read(rpc, newc_ready[a]);
}

/* Writes all of buf to dst's connection, waiting at most stall_ns after
 * the last byte the socket took (the peer's receive buffer and this
 * one's send buffer full: it reads nothing). */
static tdm_status send_bounded(tdm_rpc *rpc, int dst, const uint8_t *p, size_t n, uint64_t stall_ns,
                               uint64_t deadline_ns, size_t *sent)
{
    rpc_tcp *t = rpc->tp;
    uint64_t since = tdm_time_ns();
    while (n > 0) {
        ssize_t k = send(t->fd[dst], p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            *sent += (size_t)k;
            since = tdm_time_ns();
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
            return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc tcp: sending to rank %d: %s", dst,
                                 k < 0 ? strerror(errno) : "connection closed");
        if (atomic_load_explicit(&rpc->stopping, memory_order_acquire))
            return tdm_error_set(TDM_STATUS_ABORTED, "rpc: rank %d is shutting down", rpc->rank);
        uint64_t now = tdm_time_ns();
        if (now - since >= stall_ns)
            return tdm_error_set(TDM_STATUS_TIMEOUT, "rank %d has not read for %.1f s (its connection "
                                 "takes nothing: stopped, or too busy to read?)", dst, (double)stall_ns / 1e9);
        if (now >= deadline_ns)
            return tdm_error_set(TDM_STATUS_TIMEOUT, "rank %d has not read the message within the call's "
                                 "timeout (%zu bytes of it taken by its connection)", dst, *sent);
        /* short naps: a shutdown is seen soon */
        uint64_t left_ms = (stall_ns - (now - since)) / 1000000u + 1;
        struct pollfd pf = {.fd = t->fd[dst], .events = POLLOUT};
        (void)poll(&pf, 1, left_ms < RPC_TCP_SEND_NAP_MS ? (int)left_ms : RPC_TCP_SEND_NAP_MS);
    }
    return TDM_STATUS_OK;
}

static tdm_status tcp_send(tdm_rpc *rpc, int dst, const void *a, size_t na, const void *b, size_t nb,
                           uint64_t stall_ns, uint64_t deadline_ns, size_t *sent)
{
    *sent = 0;
    TDM_CHECK(send_bounded(rpc, dst, a, na, stall_ns, deadline_ns, sent));
    if (nb) TDM_CHECK(send_bounded(rpc, dst, b, nb, stall_ns, deadline_ns, sent));
    return TDM_STATUS_OK;
}

static void tcp_abandon(tdm_rpc *rpc, int dst)
{
    rpc_tcp *t = rpc->tp;
    /* the peer reads the part written, then the end of the stream; this
     * rank's reader sees the end too and stops reading it */
    shutdown(t->fd[dst], SHUT_RDWR);
}

static int tcp_peer_gone(tdm_rpc *rpc, int dst, char *why, size_t n)
{
    /* the reader sees a connection end (the kernel closes a dead
     * process's sockets) and reports it */
    (void)rpc;
    (void)dst;
    (void)why;
    (void)n;
    return 0;
}

static void tcp_wake(tdm_rpc *rpc)
{
    rpc_tcp *t = rpc->tp;
    if (t && t->wake[1] >= 0) {
        ssize_t k = write(t->wake[1], "x", 1);
        (void)k;
    }
}

static void tcp_close(tdm_rpc *rpc)
{
    rpc_tcp *t = rpc->tp;
    if (!t) return;
    for (int r = 0; r < TDM_RPC_MAX_RANKS; r++)
        if (t->fd[r] >= 0) close(t->fd[r]);
    for (int i = 0; i < t->n_newc; i++) close(t->newc[i].fd);
    if (t->listen_fd >= 0) close(t->listen_fd);
    if (t->wake[0] >= 0) close(t->wake[0]);
    if (t->wake[1] >= 0) close(t->wake[1]);
    free(t->rbuf);
    free(t);
    rpc->tp = NULL;
}

static const tdm_rpc_tp_ops tcp_ops = {
    .name = "tcp",
    .send = tcp_send,
    .abandon = tcp_abandon,
    .pump = tcp_pump,
    .peer_gone = tcp_peer_gone,
    .wake = tcp_wake,
    .close = tcp_close,
};

int tdm_rpc_port(const tdm_rpc *rpc)
{
    if (rpc->ops != &tcp_ops) return 0;
    return ((const rpc_tcp *)rpc->tp)->port;
}

tdm_status tdm_rpc_tcp_open(tdm_rpc *rpc)
{
    tdm_status st = TDM_STATUS_OK;
    rpc_tcp *t = calloc(1, sizeof *t);
    TDM_REQUIRE(t, TDM_STATUS_OUT_OF_MEMORY, "rpc tcp: no memory");
    t->listen_fd = -1;
    t->wake[0] = t->wake[1] = -1;
    for (int r = 0; r < TDM_RPC_MAX_RANKS; r++) t->fd[r] = -1;
    rpc->tp = t;
    rpc->ops = &tcp_ops;
    t->rbuf = malloc(RPC_TCP_READ_BYTES);
    TDM_REQUIRE(t->rbuf, TDM_STATUS_OUT_OF_MEMORY, "rpc tcp: no memory");
    if (pipe2(t->wake, O_CLOEXEC | O_NONBLOCK))
        return tdm_error_set(TDM_STATUS_SYSTEM, "rpc tcp: pipe: %s", strerror(errno));
    uint64_t deadline = tdm_time_ns() + (uint64_t)tdm_rpc_setup_ms(rpc) * 1000000u;

    const char *host = rpc->opts.master_addr ? rpc->opts.master_addr : getenv("MASTER_ADDR");
    if (!host || !*host) host = "127.0.0.1";
    int port = rpc->opts.master_port;
    if (port == 0 && getenv("MASTER_PORT")) {
        char *end = NULL;
        long v = strtol(getenv("MASTER_PORT"), &end, 10);
        if (!end || *end || v <= 0 || v > 65535)
            return tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc tcp: MASTER_PORT='%s' is not a port (1..65535)",
                                 getenv("MASTER_PORT"));
        port = (int)v;
    }
    if (port == 0 && !rpc->opts.comm && rpc->world > 1)
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "rpc tcp: no rendezvous port: set MASTER_PORT (and MASTER_ADDR) on every rank");
    if (port < 0 || port > 65535)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc tcp: rendezvous port %d (1..65535)", port);
    struct sockaddr_in master;
    TDM_CHECK(resolve(host, port, &master));
    if (rpc->rank == 0) {
        /* port 0 with a communicator: the system picks, and the others
         * learn it below */
        st = listen_on(&master, &t->listen_fd, &t->port);
    }
    if (rpc->opts.comm) {
        int64_t v[2] = {st == TDM_STATUS_OK ? t->port : -1, st == TDM_STATUS_OK ? 0 : 1};
        char msg[TDM_ERROR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", tdm_error_message());
        TDM_CHECK(tdm_comm_broadcast(rpc->opts.comm, v, v, 2, TDM_DTYPE_INT64, 0));
        if (st != TDM_STATUS_OK) return tdm_error_set(st, "%s", msg);
        if (v[1]) return tdm_error_set(TDM_STATUS_PEER_FAILED, "rpc tcp: rank 0 could not listen at %s:%d", host, port);
        master.sin_port = htons((uint16_t)v[0]);
    }
    TDM_CHECK(st);
    if (rpc->world == 1) return TDM_STATUS_OK;

    rpc_tcp_entry table[TDM_RPC_MAX_RANKS];
    memset(table, 0, sizeof table);
    if (rpc->rank == 0) {
        table[0].addr = master.sin_addr.s_addr;
        table[0].port = (uint32_t)t->port;
        TDM_CHECK(accept_ranks(rpc, 1, rpc->world - 1, deadline, table));
        tdm_rpc_wire w;
        size_t body = (size_t)rpc->world * sizeof(rpc_tcp_entry);
        tdm_rpc_wire_fill(&w, TDM_RPC_KIND_TABLE, 0, 0, (uint64_t)rpc->world, 0, body);
        for (int r = 1; r < rpc->world; r++) {
            char what[32];
            snprintf(what, sizeof what, "rank %d", r);
            TDM_CHECK(write_all(t->fd[r], &w, sizeof w, what));
            TDM_CHECK(write_all(t->fd[r], table, body, what));
        }
        return TDM_STATUS_OK;
    }
    TDM_CHECK(connect_to(&master, deadline, &t->fd[0]));
    struct sockaddr_in self;
    socklen_t len = sizeof self;
    getsockname(t->fd[0], (struct sockaddr *)&self, &len);
    self.sin_port = 0;
    TDM_CHECK(listen_on(&self, &t->listen_fd, &t->port));
    TDM_CHECK(send_hello(rpc, t->fd[0], t->port, "rank 0"));
    tdm_rpc_wire w;
    TDM_CHECK(read_all(t->fd[0], &w, sizeof w, deadline, "rank 0's table"));
    size_t body = (size_t)rpc->world * sizeof(rpc_tcp_entry);
    if (w.magic != TDM_RPC_MAGIC || w.kind != TDM_RPC_KIND_TABLE || w.body_len != body ||
        w.id != (uint64_t)rpc->world)
        return tdm_error_set(TDM_STATUS_FORMAT, "rpc tcp: rank %d: rank 0's answer is not a table for world %d "
                             "(kind %u, world %llu): is MASTER_PORT another job's?",
                             rpc->rank, rpc->world, w.kind, (unsigned long long)w.id);
    TDM_CHECK(read_all(t->fd[0], table, body, deadline, "rank 0's table"));
    for (int r = 1; r < rpc->rank; r++) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = table[r].addr,
                                .sin_port = htons((uint16_t)table[r].port)};
        char what[32];
        snprintf(what, sizeof what, "rank %d", r);
        TDM_CHECK(connect_to(&a, deadline, &t->fd[r]));
        TDM_CHECK(send_hello(rpc, t->fd[r], t->port, what));
    }
    if (rpc->rank + 1 < rpc->world) TDM_CHECK(accept_ranks(rpc, rpc->rank + 1, rpc->world - 1, deadline, NULL));
    return TDM_STATUS_OK;
}
