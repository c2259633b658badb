/* rpc/rref.h: remote references (torch.distributed.rpc's RRef) on top of
 * rpc/rpc.h: an object lives on the rank that owns it; other ranks hold
 * references to it, through which they fetch a copy of it or call a
 * method on the owner. The owner counts the references to each object
 * and frees it when the last is released; a call through a reference
 * released already is refused by the owner with a clear error (never a
 * use after free).
 *
 * What it is not: references are not passed between ranks implicitly
 * (tdm_rref_clone makes another one on the same rank), and a reference
 * held by a rank that dies is not released: its object lives as long as
 * the owner's endpoint. */
#ifndef TDM_RPC_RREF_H
#define TDM_RPC_RREF_H

#include <stddef.h>
#include <stdint.h>

#include "rpc/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_RREF_MAX_METHODS 16

/* A method: runs on the owner's server thread (calls to one endpoint run
 * one at a time) with the object and the request; replies as any
 * registered function does (tdm_rpc_req_reply, tdm_rpc_req_fail). */
typedef tdm_status (*tdm_rref_method_fn)(void *obj, tdm_rpc_req *req);

typedef struct tdm_rref_method {
    const char *name;
    tdm_rref_method_fn fn;
} tdm_rref_method;

/* A type of object a rank can own. */
typedef struct tdm_rref_type {
    const char *name;                       /* at most TDM_RPC_NAME_MAX bytes */
    /* builds the object from the creator's arguments */
    tdm_status (*create)(const void *args, size_t nbytes, void **obj);
    /* its copy, for tdm_rref_fetch: into the reply */
    tdm_status (*fetch)(void *obj, tdm_rpc_req *req);
    void (*destroy)(void *obj);
    tdm_rref_method methods[TDM_RREF_MAX_METHODS];  /* ended by a NULL name */
} tdm_rref_type;

typedef struct tdm_rref tdm_rref;

/* Makes type known on this rank (borrowed: it outlives the endpoint).
 * Every rank that may own objects of it registers it, before the calls. */
tdm_status tdm_rref_register_type(tdm_rpc *rpc, const tdm_rref_type *type);

/* Creates an object of type_name on rank owner (this rank too) from
 * args; *out is the first reference to it. This rank names the object's
 * id, so a create (or a clone) whose wait times out leaves nothing
 * behind: it sends the owner a drop of that reference, applied whenever
 * the create arrives. */
tdm_status tdm_rref_create(tdm_rpc *rpc, int owner, const char *type_name, const void *args,
                           size_t nbytes, int64_t timeout_ms, tdm_rref **out);
/* Another reference to the same object (the owner counts it). */
tdm_status tdm_rref_clone(const tdm_rref *ref, int64_t timeout_ms, tdm_rref **out);
/* A copy of the object (type->fetch), malloc'd, the caller frees. */
tdm_status tdm_rref_fetch(const tdm_rref *ref, void **copy, size_t *nbytes, int64_t timeout_ms);
/* Calls method on the owner with the object. */
tdm_status tdm_rref_call(const tdm_rref *ref, const char *method, const void *args, size_t nbytes,
                         void **reply, size_t *reply_nbytes, int64_t timeout_ms);
/* Releases the reference (the owner frees the object at the last one)
 * and frees the handle, whatever the owner answers. NULL: OK. */
tdm_status tdm_rref_release(tdm_rref *ref, int64_t timeout_ms);

int tdm_rref_owner(const tdm_rref *ref);
uint64_t tdm_rref_id(const tdm_rref *ref);

/* The owner's counts: objects alive on this rank, and the references to
 * one of them (0: none, or no such object). */
int64_t tdm_rref_live_objects(tdm_rpc *rpc);
int64_t tdm_rref_refcount(tdm_rpc *rpc, uint64_t id);

#ifdef __cplusplus
}
#endif

#endif
