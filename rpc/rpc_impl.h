/* rpc/rpc_impl.h: internals shared by rpc/rpc.c (endpoint, futures,
 * decoding, threads) and its transports (rpc/rpc_shm.c, rpc/rpc_tcp.c):
 * the wire format and the transport interface.
 * Not a public header: users include rpc/rpc.h. */
#ifndef TDM_RPC_RPC_IMPL_H
#define TDM_RPC_RPC_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "rpc/rpc.h"

/* Every message, on every transport: this header, then body_len bytes
 * (the function's name, name_len bytes without a NUL, then the
 * arguments, the reply, or the error text). Host byte order: both ends
 * run the same build on the same kind of machine (tested on loopback). */
#define TDM_RPC_MAGIC 0x43505254u /* "TRPC" */
#define TDM_RPC_VERSION 1u

typedef enum tdm_rpc_kind {
    TDM_RPC_KIND_CALL = 1,    /* id: the caller's call id */
    TDM_RPC_KIND_REPLY,       /* status: OK (body: the reply) or the error (body: text) */
    TDM_RPC_KIND_BYE,         /* the sender is leaving: calls to it fail from now */
    TDM_RPC_KIND_HELLO,       /* TCP: id = world, status = the sender's listen port */
    TDM_RPC_KIND_TABLE,       /* TCP: rank 0 -> all: world x (IPv4, port) */
    TDM_RPC_KIND_COUNT_
} tdm_rpc_kind;

typedef struct tdm_rpc_wire {
    uint32_t magic;
    uint16_t version;
    uint16_t kind;            /* tdm_rpc_kind */
    int32_t src;              /* the sending rank */
    int32_t status;           /* REPLY: a tdm_status; HELLO: a port */
    uint64_t id;
    uint32_t name_len;
    uint32_t reserved;        /* 0 */
    uint64_t body_len;        /* name_len + the payload */
} tdm_rpc_wire;
_Static_assert(sizeof(tdm_rpc_wire) == 40, "the wire header is 40 bytes");

/* One message being read from one source (bytes arrive in pieces). */
typedef struct tdm_rpc_decoder {
    uint8_t hdr[sizeof(tdm_rpc_wire)];
    size_t hdr_have;
    uint8_t *body;            /* malloc'd once the header is valid */
    size_t body_have;
    int broken;               /* a malformed message: nothing more is read */
} tdm_rpc_decoder;

/* A transport: functions called by rpc/rpc.c. */
typedef struct tdm_rpc_tp_ops {
    const char *name;
    /* Writes a then b to dst, whole, or fails: PEER_FAILED when dst is
     * gone, TIMEOUT ("rank D has not read for X s") when dst takes no
     * byte for stall_ns while some wait to be written (a peer alive but
     * stopped: SIGSTOP, a debugger, a reader stuck), or at deadline_ns
     * (tdm_time_ns(); UINT64_MAX: none: a synchronous call's timeout, which
     * a peer taking a trickle would outlast). *sent: the bytes of
     * a and b written before it returned (> 0 on a failure: the channel
     * holds part of a message; the caller abandons it). Called with the
     * endpoint's send lock for dst held. */
    tdm_status (*send)(tdm_rpc *rpc, int dst, const void *a, size_t na, const void *b,
                       size_t nb, uint64_t stall_ns, uint64_t deadline_ns, size_t *sent);
    /* The channel to dst holds part of a message that will never be
     * completed: closes it, so that dst, if it reads again, stops there
     * and takes this rank for gone instead of decoding garbage. */
    void (*abandon)(tdm_rpc *rpc, int dst);
    /* The reader thread: waits at most nap_ms for incoming bytes and
     * hands them to tdm_rpc_feed; reports a gone peer with
     * tdm_rpc_peer_lost. */
    void (*pump)(tdm_rpc *rpc, int nap_ms);
    /* 1 when dst is known gone (why: what is known); checked by waits. */
    int (*peer_gone)(tdm_rpc *rpc, int dst, char *why, size_t n);
    /* Ends a pump in progress (shutdown). */
    void (*wake)(tdm_rpc *rpc);
    void (*close)(tdm_rpc *rpc);
} tdm_rpc_tp_ops;

typedef struct tdm_rpc_msg {
    tdm_rpc_wire w;
    uint64_t fr_seq;          /* a call: its serve entry in the flight recorder */
    uint8_t *body;
    struct tdm_rpc_msg *next;
} tdm_rpc_msg;

typedef struct tdm_rpc_fn_entry {
    char name[TDM_RPC_NAME_MAX + 1];
    tdm_rpc_fn fn;
    void *ctx;                /* borrowed */
} tdm_rpc_fn_entry;

#define TDM_RPC_MAX_FNS 64

typedef enum tdm_rpc_peer_state {
    TDM_RPC_PEER_UP = 0,
    TDM_RPC_PEER_LEFT,        /* said BYE */
    TDM_RPC_PEER_GONE,        /* died, closed its connection, or sent garbage */
} tdm_rpc_peer_state;

struct tdm_rpc {
    int rank, world;
    tdm_rpc_opts opts;
    size_t max_msg;
    uint64_t send_stall_ns;   /* opts.send_stall_ms, resolved */
    const tdm_rpc_tp_ops *ops;
    void *tp;                 /* the transport's state */
    /* everything below under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* a future completed, a call queued, a barrier moved */
    struct {
        tdm_rpc_fn_entry fns[TDM_RPC_MAX_FNS];
        int n;
    } reg;
    struct {
        uint64_t next_id;
        tdm_rpc_future *pending;   /* list */
    } calls;
    struct {
        tdm_rpc_msg *head, *tail;  /* calls waiting for the server */
        int serving;               /* the server is running one */
    } queue;
    struct {
        tdm_rpc_peer_state state[TDM_RPC_MAX_RANKS];
        char why[TDM_RPC_MAX_RANKS][400];
    } peers;
    struct {
        uint64_t arrived;          /* rank 0: arrivals counted */
        uint64_t released;         /* every rank: barriers released */
        uint64_t entered;          /* barriers this rank entered */
    } barrier;
    tdm_rpc_stats stats;
    /* The flight recorder of the endpoint (core/flight.h, backend "rpc";
     * NULL: off): an entry per call made ("rpc call NAME #ID to R") and
     * per call served ("rpc serve NAME #ID from R"). Entries are begun
     * under mu (the recorder has one issuer at a time). */
    struct tdm_fr *fr;
    _Atomic int fr_failed;    /* a failure was noted: dumped again when freed */
    struct tdm_rref_table *rrefs;  /* rpc/rref.c: objects owned here; NULL: none yet */
    /* threads */
    pthread_t reader, server;
    int reader_running, server_running;
    _Atomic int stopping;
    pthread_mutex_t send_mu[TDM_RPC_MAX_RANKS];
    tdm_rpc_decoder dec[TDM_RPC_MAX_RANKS];
};

/* Transports' constructors: fill rpc->ops and rpc->tp. */
tdm_status tdm_rpc_shm_open(tdm_rpc *rpc);
tdm_status tdm_rpc_tcp_open(tdm_rpc *rpc);

/* Bytes from src for the decoder; complete messages are dispatched.
 * FORMAT (message set) when they are not a valid message: the transport
 * stops reading src and reports it lost. */
tdm_status tdm_rpc_feed(tdm_rpc *rpc, int src, const void *buf, size_t n);
/* Checks a header as it arrives (also the TCP hello): FORMAT with the
 * reason when it is not one this endpoint accepts. */
tdm_status tdm_rpc_wire_check(const tdm_rpc *rpc, const tdm_rpc_wire *w, int expect_src);
/* src is gone (why: for the messages of the calls it fails). */
void tdm_rpc_peer_lost(tdm_rpc *rpc, int src, tdm_rpc_peer_state state, const char *why);
/* A wire header for kind. */
void tdm_rpc_wire_fill(tdm_rpc_wire *w, tdm_rpc_kind kind, int src, int32_t status,
                       uint64_t id, uint32_t name_len, uint64_t body_len);
/* rpc/rref.c: frees the objects still owned (tdm_rpc_free, after the
 * threads have stopped). */
void tdm_rref_table_free(tdm_rpc *rpc);
/* rpc/barrier.c: registers the barrier's two functions (tdm_rpc_init). */
tdm_status tdm_rpc_barrier_register(tdm_rpc *rpc);
/* rpc/rpc_fr.c: the endpoint's flight recorder (rpc->fr). The begins
 * are called with mu held; UINT64_MAX: no entry (the recorder is off). */
tdm_status tdm_rpc_fr_open(tdm_rpc *rpc);
uint64_t tdm_rpc_fr_call(tdm_rpc *rpc, const char *name, uint64_t id, int dst, size_t n);
uint64_t tdm_rpc_fr_serve(tdm_rpc *rpc, const uint8_t *name, uint32_t name_len, uint64_t id, int src,
                          size_t n);
void tdm_rpc_fr_start(tdm_rpc *rpc, uint64_t seq);
/* done (OK) or failed (st, why: the dump's reason when it is the first) */
void tdm_rpc_fr_end(tdm_rpc *rpc, uint64_t seq, tdm_status st, const char *why);
/* a failure that is no entry's (a timed-out wait, a peer lost) */
void tdm_rpc_fr_failure(tdm_rpc *rpc, tdm_status st, const char *why);
/* dumps the record as it stands when a failure was noted (tdm_rpc_free,
 * before it fails the calls still pending) */
void tdm_rpc_fr_dump_failed(tdm_rpc *rpc);
void tdm_rpc_fr_close(tdm_rpc *rpc);
/* The time bound for the transport's setup. */
int64_t tdm_rpc_setup_ms(const tdm_rpc *rpc);

#endif
