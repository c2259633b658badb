/* rpc/rpc.h: remote procedure calls between the ranks of a job, in the
 * spirit of torch.distributed.rpc: a rank registers functions by name;
 * any rank calls one on any rank, synchronously or through a future (wait
 * with a timeout); an error raised by the callee comes back to the caller
 * with the callee's message; remote references (rpc/rref.h) name objects
 * that a rank owns.
 *
 * Transports: shared memory between the processes of one machine (a
 * segment of byte rings, one per ordered pair of ranks, bootstrapped over
 * a communicator), and TCP (a rendezvous at MASTER_ADDR:MASTER_PORT, then
 * one connection per pair of ranks). Each rank runs two threads: a reader
 * that drains every incoming channel (so that no sender ever waits on a
 * rank busy sending) and completes the futures of replies, and a server
 * that runs the calls that arrived, one at a time, in arrival order, and
 * sends their replies.
 *
 * What it is not: a general RPC system. Arguments and replies are bytes
 * (the caller and callee agree on their layout), a function runs on the
 * callee's server thread and must not make synchronous calls itself (it
 * would wait for its own server), and nothing is retried: a dead peer
 * fails every call to it, naming it. */
#ifndef TDM_RPC_RPC_H
#define TDM_RPC_RPC_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Longest function name, bytes without the NUL. */
#define TDM_RPC_NAME_MAX 63
/* Default bound on one message's arguments or reply (tdm_rpc_opts). */
#define TDM_RPC_DEFAULT_MAX_MSG_BYTES ((size_t)256 << 20)
/* Default bound on setting up the transport (all ranks must arrive). */
#define TDM_RPC_DEFAULT_SETUP_MS 60000
/* Default bound on a send to a peer that reads nothing (tdm_rpc_opts):
 * the process group's timeout of forked ranks (dist/timeout.h). */
#define TDM_RPC_DEFAULT_SEND_STALL_MS 60000
/* Most ranks an endpoint talks to. */
#define TDM_RPC_MAX_RANKS 64

typedef enum tdm_rpc_transport {
    TDM_RPC_SHM = 0,   /* shared memory; needs opts.comm to bootstrap */
    TDM_RPC_TCP,       /* TCP; rendezvous at opts.master_addr:master_port */
} tdm_rpc_transport;

typedef struct tdm_rpc_opts {
    tdm_rpc_transport transport;
    /* SHM: the job's communicator (borrowed; used only inside
     * tdm_rpc_init, to agree on the segment and learn the peers' pids).
     * TCP: optional; when given, rank and world come from it. */
    tdm_comm *comm;
    int rank, world;              /* TCP without comm */
    /* TCP rendezvous; NULL / 0: MASTER_ADDR / MASTER_PORT from the
     * environment (as torchrun's). Rank 0 listens there; every rank
     * listens on a port of its own, chosen by the system. */
    const char *master_addr;
    int master_port;
    size_t max_msg_bytes;         /* 0: TDM_RPC_DEFAULT_MAX_MSG_BYTES */
    int64_t setup_ms;             /* 0: TDM_RPC_DEFAULT_SETUP_MS */
    size_t ring_bytes;            /* SHM: bytes per ring; 0: 256 KiB */
    /* A send (a call's arguments, a reply) to a peer that takes no byte
     * for this long while the ring or the socket buffer is full fails
     * naming it ("rank 2 has not read for 60.0 s"): a peer alive but
     * stopped (SIGSTOP, a debugger) never blocks a caller or the serving
     * thread for longer. A message left half-written closes the channel
     * to that peer (it is taken for gone from then). 0:
     * TDM_RPC_DEFAULT_SEND_STALL_MS; a synchronous call with a shorter
     * timeout uses its timeout. */
    int64_t send_stall_ms;
} tdm_rpc_opts;

typedef struct tdm_rpc tdm_rpc;
typedef struct tdm_rpc_future tdm_rpc_future;

/* One incoming call, as a registered function sees it. The function sets
 * the reply with tdm_rpc_req_reply (none: an empty reply) or fails with
 * tdm_rpc_req_fail, whose message reaches the caller. */
typedef struct tdm_rpc_req {
    tdm_rpc *rpc;                 /* borrowed */
    int caller;                   /* the calling rank */
    const char *name;
    const void *args;             /* borrowed, valid during the call */
    size_t nbytes;
    /* the reply, owned by the endpoint */
    void *reply;
    size_t reply_nbytes;
    char err[512];
} tdm_rpc_req;

typedef tdm_status (*tdm_rpc_fn)(tdm_rpc_req *req, void *ctx);

/* Sets up this rank's endpoint: every rank of the job calls it (the
 * transport connects all of them). Registering functions before calls
 * arrive is the caller's business (register, then synchronize with
 * tdm_rpc_barrier). */
tdm_status tdm_rpc_init(tdm_rpc **out, const tdm_rpc_opts *opts);
/* Stops the threads and closes the transport. Calls pending on this rank
 * fail; peers see this rank leave (their calls to it fail, naming it).
 * NULL is a no-op. */
void tdm_rpc_free(tdm_rpc *rpc);

int tdm_rpc_rank(const tdm_rpc *rpc);
int tdm_rpc_world(const tdm_rpc *rpc);
const char *tdm_rpc_transport_name(tdm_rpc_transport t);
/* "shm" or "tcp" -> *out; anything else: INVALID_ARG. */
tdm_status tdm_rpc_transport_parse(const char *s, tdm_rpc_transport *out);

/* Registers fn under name (at most TDM_RPC_NAME_MAX bytes; registering a
 * name twice is INVALID_ARG). ctx is borrowed. */
tdm_status tdm_rpc_register(tdm_rpc *rpc, const char *name, tdm_rpc_fn fn, void *ctx);

/* Calls name on rank dst with args, waits at most timeout_ms (< 0: no
 * bound, but a dead or departed callee still ends the wait). The reply
 * (malloc'd, the caller frees; NULL when empty) goes to *reply and its
 * size to *reply_nbytes (both may be NULL to drop it). Errors: the
 * callee's (its status and "rank 1: <its message>"), INVALID_ARG (no such
 * function on the callee, arguments over max_msg_bytes), PEER_FAILED (the
 * callee died or left, or took no byte of the arguments for the shorter
 * of timeout_ms and opts.send_stall_ms with part of them sent: "rank 1
 * has not read for 1.0 s"), TIMEOUT (no reply in time, or that stall
 * before any byte went). */
tdm_status tdm_rpc_call(tdm_rpc *rpc, int dst, const char *name, const void *args,
                        size_t nbytes, void **reply, size_t *reply_nbytes, int64_t timeout_ms);
/* Sends the call and returns with a future once the arguments are
 * written (a message larger than the ring or the socket buffer streams
 * while the callee reads; one that reads nothing fails the future after
 * opts.send_stall_ms, naming it). */
tdm_status tdm_rpc_call_async(tdm_rpc *rpc, int dst, const char *name, const void *args,
                              size_t nbytes, tdm_rpc_future **out);
/* Waits for the reply (as tdm_rpc_call). TIMEOUT leaves the future
 * pending, to wait again; any other result completes it, and the reply is
 * handed over once. */
tdm_status tdm_rpc_future_wait(tdm_rpc_future *f, int64_t timeout_ms, void **reply,
                               size_t *reply_nbytes);
/* 1 when the reply (or the failure) has arrived. */
int tdm_rpc_future_done(const tdm_rpc_future *f);
/* Frees the future; a reply still on its way is dropped when it arrives.
 * NULL is a no-op. */
void tdm_rpc_future_free(tdm_rpc_future *f);

/* For registered functions: the reply buffer (nbytes, owned by the
 * endpoint, sent after the function returns) into *out. */
tdm_status tdm_rpc_req_reply(tdm_rpc_req *req, size_t nbytes, void **out);
/* For registered functions: records a message for the caller and
 * returns st (not OK). */
tdm_status tdm_rpc_req_fail(tdm_rpc_req *req, tdm_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Every rank waits until every rank has called it (rank 0 counts the
 * arrivals, then releases them all), bounded by timeout_ms (< 0: none). */
tdm_status tdm_rpc_barrier(tdm_rpc *rpc, int64_t timeout_ms);

/* Traffic of this endpoint so far: bytes and messages sent and received
 * (headers included), and calls served. */
typedef struct tdm_rpc_stats {
    uint64_t bytes_sent, bytes_recv;
    uint64_t msgs_sent, msgs_recv;
    uint64_t calls_served;
} tdm_rpc_stats;
void tdm_rpc_get_stats(const tdm_rpc *rpc, tdm_rpc_stats *out);

/* 1 when rank is up as far as this endpoint knows (it has not left, its
 * process exists, its connection is open); else 0 and why (n bytes). */
int tdm_rpc_peer_alive(tdm_rpc *rpc, int rank, char *why, size_t n);

/* TCP: the port this rank listens on (rank 0: the rendezvous port); 0
 * for SHM. */
int tdm_rpc_port(const tdm_rpc *rpc);

#ifdef __cplusplus
}
#endif

#endif
