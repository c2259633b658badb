/* rpc/rpc_fr.c: the RPC endpoint's flight recorder (core/flight.h), so
 * that when a job built on rpc/ fails or stalls, its dumps and `tandem
 * doctor` name the call left waiting. One recorder per endpoint, backend
 * "rpc", dumped beside the rank's communicator's as
 * fr_rank_<R>.c<K>.pid<P>.json (it never takes fr_rank_<R>.json). An
 * entry per call:
 *   made:   label "rpc call NAME #ID to R", coll send, root R, count the
 *           argument bytes; queued while the arguments are written,
 *           running once sent (waiting for the reply), done when the
 *           reply came (an error reply too: the call went through),
 *           failed when no reply will come (the callee died, left or
 *           stopped reading);
 *   served: label "rpc serve NAME #ID from R", coll recv, root R;
 *           queued when it arrived (behind other calls), running while
 *           its function runs, done once its reply is sent, failed when
 *           the reply could not be.
 * A timed-out wait, a peer lost and a failed call are the recorder's
 * failures: the first is dumped at once, and the record is dumped again
 * when the endpoint is freed (its last state). */
#include <stdio.h>
#include <string.h>

#include "core/flight.h"
#include "rpc/rpc_impl.h"

tdm_status tdm_rpc_fr_open(tdm_rpc *rpc)
{
    TDM_CHECK(tdm_fr_init(&rpc->fr, rpc->rank, rpc->world, "rpc"));
    /* the rank's communicator keeps fr_rank_<R>.json */
    if (rpc->fr) tdm_fr_set_inner(rpc->fr, rpc->rank);
    return TDM_STATUS_OK;
}

static uint64_t fr_begin(tdm_rpc *rpc, tdm_coll coll, const char *label, int peer, size_t n)
{
    if (!rpc->fr) return UINT64_MAX;
    tdm_comm_call k = {.coll = coll, .count = n, .dtype = TDM_DTYPE_FLOAT32, .root = peer};
    tdm_fr_set_label(rpc->fr, label);
    return tdm_fr_begin(rpc->fr, &k, TDM_FR_QUEUED);
}

uint64_t tdm_rpc_fr_call(tdm_rpc *rpc, const char *name, uint64_t id, int dst, size_t n)
{
    char label[TDM_RPC_NAME_MAX + 64];   /* the recorder keeps TDM_FR_LABEL_MAX - 1 bytes */
    snprintf(label, sizeof label, "rpc call %s #%llu to %d", name, (unsigned long long)id, dst);
    return fr_begin(rpc, TDM_COLL_SEND, label, dst, n);
}

uint64_t tdm_rpc_fr_serve(tdm_rpc *rpc, const uint8_t *name, uint32_t name_len, uint64_t id, int src,
                          size_t n)
{
    char shown[TDM_RPC_NAME_MAX + 1], label[TDM_RPC_NAME_MAX + 64];
    uint32_t k = 0;
    for (; k < name_len && k < TDM_RPC_NAME_MAX; k++)
        shown[k] = name[k] >= 32 && name[k] < 127 ? (char)name[k] : '?';
    shown[k] = '\0';
    snprintf(label, sizeof label, "rpc serve %s #%llu from %d", shown, (unsigned long long)id, src);
    return fr_begin(rpc, TDM_COLL_RECV, label, src, n);
}

void tdm_rpc_fr_start(tdm_rpc *rpc, uint64_t seq)
{
    if (rpc->fr && seq != UINT64_MAX) tdm_fr_start(rpc->fr, seq);
}

void tdm_rpc_fr_failure(tdm_rpc *rpc, tdm_status st, const char *why)
{
    if (!rpc->fr) return;
    rpc->fr_failed = 1;
    tdm_fr_note_failure(rpc->fr, st, why);
}

void tdm_rpc_fr_end(tdm_rpc *rpc, uint64_t seq, tdm_status st, const char *why)
{
    if (!rpc->fr || seq == UINT64_MAX) return;
    /* the reason first: tdm_fr_end would take this thread's message */
    if (st != TDM_STATUS_OK) tdm_rpc_fr_failure(rpc, st, why);
    tdm_fr_end(rpc->fr, seq, st);
}

void tdm_rpc_fr_dump_failed(tdm_rpc *rpc)
{
    if (rpc->fr && rpc->fr_failed) tdm_fr_dump(rpc->fr, "rpc endpoint freed after a failure");
}

void tdm_rpc_fr_close(tdm_rpc *rpc)
{
    if (!rpc->fr) return;
    tdm_fr_free(rpc->fr);
    rpc->fr = NULL;
}
