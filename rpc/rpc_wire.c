/* rpc/rpc_wire.c: the wire format's checks (rpc/rpc_impl.h) and the
 * transports' names: what every endpoint and transport agree on. */
#include <string.h>

#include "rpc/rpc_impl.h"

const char *tdm_rpc_transport_name(tdm_rpc_transport t)
{
    return t == TDM_RPC_TCP ? "tcp" : t == TDM_RPC_SHM ? "shm" : "?";
}

tdm_status tdm_rpc_transport_parse(const char *s, tdm_rpc_transport *out)
{
    if (s && !strcmp(s, "shm")) { *out = TDM_RPC_SHM; return TDM_STATUS_OK; }
    if (s && !strcmp(s, "tcp")) { *out = TDM_RPC_TCP; return TDM_STATUS_OK; }
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "rpc: unknown transport '%s' (expected shm or tcp)",
                         s ? s : "(null)");
}

void tdm_rpc_wire_fill(tdm_rpc_wire *w, tdm_rpc_kind kind, int src, int32_t status,
                       uint64_t id, uint32_t name_len, uint64_t body_len)
{
    memset(w, 0, sizeof *w);
    w->magic = TDM_RPC_MAGIC;
    w->version = TDM_RPC_VERSION;
    w->kind = (uint16_t)kind;
    w->src = src;
    w->status = status;
    w->id = id;
    w->name_len = name_len;
    w->body_len = body_len;
}

tdm_status tdm_rpc_wire_check(const tdm_rpc *rpc, const tdm_rpc_wire *w, int expect_src)
{
    if (w->magic != TDM_RPC_MAGIC)
        return tdm_error_set(TDM_STATUS_FORMAT, "bad magic 0x%08x (expected 0x%08x): not a tandem RPC message",
                             w->magic, TDM_RPC_MAGIC);
    if (w->version != TDM_RPC_VERSION)
        return tdm_error_set(TDM_STATUS_FORMAT, "protocol version %u (this build speaks %u)",
                             w->version, TDM_RPC_VERSION);
    if (w->kind < TDM_RPC_KIND_CALL || w->kind >= TDM_RPC_KIND_COUNT_)
        return tdm_error_set(TDM_STATUS_FORMAT, "unknown message kind %u", w->kind);
    if (w->src < 0 || w->src >= rpc->world || (expect_src >= 0 && w->src != expect_src))
        return tdm_error_set(TDM_STATUS_FORMAT, "message says it is from rank %d (expected %d of world %d)",
                             w->src, expect_src, rpc->world);
    if (w->reserved != 0)
        return tdm_error_set(TDM_STATUS_FORMAT, "reserved field is %u (expected 0)", w->reserved);
    if (w->body_len > rpc->max_msg + TDM_RPC_NAME_MAX)
        return tdm_error_set(TDM_STATUS_FORMAT, "body of %llu bytes, over the limit of %zu",
                             (unsigned long long)w->body_len, rpc->max_msg);
    if (w->name_len > TDM_RPC_NAME_MAX || w->name_len > w->body_len)
        return tdm_error_set(TDM_STATUS_FORMAT, "name of %u bytes (at most %d, within a body of %llu)",
                             w->name_len, TDM_RPC_NAME_MAX, (unsigned long long)w->body_len);
    if (w->kind == TDM_RPC_KIND_CALL && w->name_len == 0)
        return tdm_error_set(TDM_STATUS_FORMAT, "a call without a function name");
    if (w->kind == TDM_RPC_KIND_REPLY && (w->status < 0 || w->status >= TDM_STATUS_COUNT_))
        return tdm_error_set(TDM_STATUS_FORMAT, "reply with status %d (not a status)", w->status);
    if (w->kind == TDM_RPC_KIND_HELLO || w->kind == TDM_RPC_KIND_TABLE)
        return tdm_error_set(TDM_STATUS_FORMAT, "a %s after the connection was set up",
                             w->kind == TDM_RPC_KIND_HELLO ? "hello" : "table");
    return TDM_STATUS_OK;
}
