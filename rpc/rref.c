/* rpc/rref.c: remote references: the owner's table of objects with their
 * reference counts, served by five internal functions (create, addref,
 * fetch, call, release), and the handles that other ranks hold.
 * Arguments on the wire: create [u32 type length][type][args]; call
 * [u64 id][u32 method length][method][args]; the others [u64 id].
 * Not a distributed garbage collector: counts are explicit (clone,
 * release), and a dead holder's references are never released. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/rpc_impl.h"
#include "rpc/rref.h"

#define RREF_CREATE "tdm.rref.create"
#define RREF_ADDREF "tdm.rref.addref"
#define RREF_FETCH "tdm.rref.fetch"
#define RREF_CALL "tdm.rref.call"
#define RREF_RELEASE "tdm.rref.release"
#define RREF_MAX_TYPES 16

typedef struct rref_obj {
    uint64_t id;
    const tdm_rref_type *type;   /* borrowed */
    void *obj;
    int64_t refs;
    struct rref_obj *next;
} rref_obj;

struct tdm_rref_table {
    pthread_mutex_t mu;          /* the table; methods run on the server thread */
    const tdm_rref_type *types[RREF_MAX_TYPES];
    int n_types;
    rref_obj *objs;
    uint64_t next_id;
    int64_t live;
};

struct tdm_rref {
    tdm_rpc *rpc;                /* borrowed */
    int owner;
    uint64_t id;
};

int tdm_rref_owner(const tdm_rref *ref) { return ref->owner; }
uint64_t tdm_rref_id(const tdm_rref *ref) { return ref->id; }

static rref_obj *find_obj(struct tdm_rref_table *t, uint64_t id)
{
    for (rref_obj *o = t->objs; o; o = o->next)
        if (o->id == id) return o;
    return NULL;
}

static tdm_status read_id(tdm_rpc_req *req, uint64_t *id)
{
    if (req->nbytes < sizeof *id)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "%s: %zu bytes of arguments (expected an object id)",
                                req->name, req->nbytes);
    memcpy(id, req->args, sizeof *id);
    return TDM_STATUS_OK;
}

/* The object id names on this rank, or a failure naming it. */
static tdm_status lookup(tdm_rpc_req *req, uint64_t id, rref_obj **out)
{
    struct tdm_rref_table *t = req->rpc->rrefs;
    pthread_mutex_lock(&t->mu);
    rref_obj *o = find_obj(t, id);
    pthread_mutex_unlock(&t->mu);
    if (!o)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG,
                                "no object #%llu on rank %d: it was released (or never created)",
                                (unsigned long long)id, req->rpc->rank);
    *out = o;
    return TDM_STATUS_OK;
}

static tdm_status srv_create(tdm_rpc_req *req, void *ctx)
{
    struct tdm_rref_table *t = ctx;
    uint32_t tl = 0;
    if (req->nbytes < sizeof tl) return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create: no type name");
    memcpy(&tl, req->args, sizeof tl);
    if (tl == 0 || tl > TDM_RPC_NAME_MAX || req->nbytes < sizeof tl + tl)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create: a type name of %u bytes", tl);
    char name[TDM_RPC_NAME_MAX + 1];
    memcpy(name, (const uint8_t *)req->args + sizeof tl, tl);
    name[tl] = '\0';
    const tdm_rref_type *type = NULL;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->n_types; i++)
        if (!strcmp(t->types[i]->name, name)) type = t->types[i];
    pthread_mutex_unlock(&t->mu);
    if (!type)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create: no type '%s' is registered on rank %d",
                                name, req->rpc->rank);
    rref_obj *o = calloc(1, sizeof *o);
    if (!o) return tdm_rpc_req_fail(req, TDM_STATUS_OUT_OF_MEMORY, "create '%s': no memory", name);
    tdm_status st = type->create((const uint8_t *)req->args + sizeof tl + tl, req->nbytes - sizeof tl - tl,
                                 &o->obj);
    if (st != TDM_STATUS_OK) {
        free(o);
        return tdm_rpc_req_fail(req, st, "create '%s': %s", name, tdm_error_message());
    }
    uint64_t *out = NULL;
    st = tdm_rpc_req_reply(req, sizeof *out, (void **)&out);
    if (st != TDM_STATUS_OK) {
        type->destroy(o->obj);
        free(o);
        return st;
    }
    o->type = type;
    o->refs = 1;
    pthread_mutex_lock(&t->mu);
    o->id = ++t->next_id;
    o->next = t->objs;
    t->objs = o;
    t->live++;
    pthread_mutex_unlock(&t->mu);
    *out = o->id;
    return TDM_STATUS_OK;
}

static tdm_status srv_addref(tdm_rpc_req *req, void *ctx)
{
    struct tdm_rref_table *t = ctx;
    uint64_t id = 0;
    rref_obj *o = NULL;
    TDM_CHECK(read_id(req, &id));
    TDM_CHECK(lookup(req, id, &o));
    pthread_mutex_lock(&t->mu);
    o->refs++;
    pthread_mutex_unlock(&t->mu);
    return TDM_STATUS_OK;
}

static tdm_status srv_fetch(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    uint64_t id = 0;
    rref_obj *o = NULL;
    TDM_CHECK(read_id(req, &id));
    TDM_CHECK(lookup(req, id, &o));
    return o->type->fetch(o->obj, req);
}

static tdm_status srv_call(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    uint64_t id = 0;
    uint32_t ml = 0;
    rref_obj *o = NULL;
    TDM_CHECK(read_id(req, &id));
    const uint8_t *p = (const uint8_t *)req->args + sizeof id;
    size_t left = req->nbytes - sizeof id;
    if (left < sizeof ml) return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "call: no method name");
    memcpy(&ml, p, sizeof ml);
    if (ml == 0 || ml > TDM_RPC_NAME_MAX || left < sizeof ml + ml)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "call: a method name of %u bytes", ml);
    char method[TDM_RPC_NAME_MAX + 1];
    memcpy(method, p + sizeof ml, ml);
    method[ml] = '\0';
    TDM_CHECK(lookup(req, id, &o));
    for (int i = 0; i < TDM_RREF_MAX_METHODS && o->type->methods[i].name; i++) {
        if (strcmp(o->type->methods[i].name, method)) continue;
        /* the method sees its own arguments */
        req->args = p + sizeof ml + ml;
        req->nbytes = left - sizeof ml - ml;
        return o->type->methods[i].fn(o->obj, req);
    }
    return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "type '%s' has no method '%s'", o->type->name, method);
}

static tdm_status srv_release(tdm_rpc_req *req, void *ctx)
{
    struct tdm_rref_table *t = ctx;
    uint64_t id = 0;
    rref_obj *o = NULL;
    TDM_CHECK(read_id(req, &id));
    TDM_CHECK(lookup(req, id, &o));
    pthread_mutex_lock(&t->mu);
    rref_obj *dead = NULL;
    if (--o->refs == 0) {
        rref_obj **pp = &t->objs;
        while (*pp != o) pp = &(*pp)->next;
        *pp = o->next;
        t->live--;
        dead = o;
    }
    pthread_mutex_unlock(&t->mu);
    if (dead) {
        dead->type->destroy(dead->obj);
        free(dead);
    }
    return TDM_STATUS_OK;
}

/* The table, made (and its functions registered) on first use. */
static tdm_status table_get(tdm_rpc *rpc, struct tdm_rref_table **out)
{
    pthread_mutex_lock(&rpc->mu);
    struct tdm_rref_table *t = rpc->rrefs;
    pthread_mutex_unlock(&rpc->mu);
    if (t) {
        *out = t;
        return TDM_STATUS_OK;
    }
    t = calloc(1, sizeof *t);
    TDM_REQUIRE(t, TDM_STATUS_OUT_OF_MEMORY, "rref: no memory");
    pthread_mutex_init(&t->mu, NULL);
    pthread_mutex_lock(&rpc->mu);
    rpc->rrefs = t;
    pthread_mutex_unlock(&rpc->mu);
    TDM_CHECK(tdm_rpc_register(rpc, RREF_CREATE, srv_create, t));
    TDM_CHECK(tdm_rpc_register(rpc, RREF_ADDREF, srv_addref, t));
    TDM_CHECK(tdm_rpc_register(rpc, RREF_FETCH, srv_fetch, t));
    TDM_CHECK(tdm_rpc_register(rpc, RREF_CALL, srv_call, t));
    TDM_CHECK(tdm_rpc_register(rpc, RREF_RELEASE, srv_release, t));
    *out = t;
    return TDM_STATUS_OK;
}

void tdm_rref_table_free(tdm_rpc *rpc)
{
    struct tdm_rref_table *t = rpc->rrefs;
    if (!t) return;
    while (t->objs) {
        rref_obj *o = t->objs;
        t->objs = o->next;
        o->type->destroy(o->obj);
        free(o);
    }
    pthread_mutex_destroy(&t->mu);
    free(t);
    rpc->rrefs = NULL;
}

tdm_status tdm_rref_register_type(tdm_rpc *rpc, const tdm_rref_type *type)
{
    TDM_REQUIRE(rpc && type && type->name && type->create && type->fetch && type->destroy,
                TDM_STATUS_INVALID_ARG, "rref_register_type: a NULL name, create, fetch or destroy");
    TDM_REQUIRE(strlen(type->name) > 0 && strlen(type->name) <= TDM_RPC_NAME_MAX, TDM_STATUS_INVALID_ARG,
                "rref_register_type: name '%s' (1..%d bytes)", type->name, TDM_RPC_NAME_MAX);
    struct tdm_rref_table *t = NULL;
    TDM_CHECK(table_get(rpc, &t));
    tdm_status st = TDM_STATUS_OK;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->n_types; i++)
        if (!strcmp(t->types[i]->name, type->name))
            st = tdm_error_set(TDM_STATUS_INVALID_ARG, "rref_register_type: '%s' is registered already", type->name);
    if (st == TDM_STATUS_OK && t->n_types == RREF_MAX_TYPES)
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "rref_register_type: '%s': %d types already (the most)",
                           type->name, RREF_MAX_TYPES);
    if (st == TDM_STATUS_OK) t->types[t->n_types++] = type;
    pthread_mutex_unlock(&t->mu);
    return st;
}

static tdm_status new_handle(tdm_rpc *rpc, int owner, uint64_t id, tdm_rref **out)
{
    tdm_rref *r = malloc(sizeof *r);
    TDM_REQUIRE(r, TDM_STATUS_OUT_OF_MEMORY, "rref: no memory for a reference");
    r->rpc = rpc;
    r->owner = owner;
    r->id = id;
    *out = r;
    return TDM_STATUS_OK;
}

tdm_status tdm_rref_create(tdm_rpc *rpc, int owner, const char *type_name, const void *args,
                           size_t nbytes, int64_t timeout_ms, tdm_rref **out)
{
    *out = NULL;
    TDM_REQUIRE(rpc && type_name, TDM_STATUS_INVALID_ARG, "rref_create: NULL argument");
    uint32_t tl = (uint32_t)strlen(type_name);
    TDM_REQUIRE(tl > 0 && tl <= TDM_RPC_NAME_MAX, TDM_STATUS_INVALID_ARG, "rref_create: type name '%s'",
                type_name);
    size_t n = sizeof tl + tl + nbytes;
    uint8_t *buf = malloc(n);
    TDM_REQUIRE(buf, TDM_STATUS_OUT_OF_MEMORY, "rref_create: %zu bytes", n);
    memcpy(buf, &tl, sizeof tl);
    memcpy(buf + sizeof tl, type_name, tl);
    if (nbytes) memcpy(buf + sizeof tl + tl, args, nbytes);
    void *rep = NULL;
    size_t rn = 0;
    tdm_status st = tdm_rpc_call(rpc, owner, RREF_CREATE, buf, n, &rep, &rn, timeout_ms);
    free(buf);
    if (st == TDM_STATUS_OK && rn != sizeof(uint64_t))
        st = tdm_error_set(TDM_STATUS_FORMAT, "rref_create: a reply of %zu bytes (expected an id)", rn);
    uint64_t id = 0;
    if (st == TDM_STATUS_OK) memcpy(&id, rep, sizeof id);
    free(rep);
    TDM_CHECK(st);
    return new_handle(rpc, owner, id, out);
}

tdm_status tdm_rref_clone(const tdm_rref *ref, int64_t timeout_ms, tdm_rref **out)
{
    *out = NULL;
    TDM_CHECK(tdm_rpc_call(ref->rpc, ref->owner, RREF_ADDREF, &ref->id, sizeof ref->id, NULL, NULL, timeout_ms));
    return new_handle(ref->rpc, ref->owner, ref->id, out);
}

tdm_status tdm_rref_fetch(const tdm_rref *ref, void **copy, size_t *nbytes, int64_t timeout_ms)
{
    return tdm_rpc_call(ref->rpc, ref->owner, RREF_FETCH, &ref->id, sizeof ref->id, copy, nbytes, timeout_ms);
}

tdm_status tdm_rref_call(const tdm_rref *ref, const char *method, const void *args, size_t nbytes,
                         void **reply, size_t *reply_nbytes, int64_t timeout_ms)
{
    TDM_REQUIRE(method, TDM_STATUS_INVALID_ARG, "rref_call: NULL method");
    uint32_t ml = (uint32_t)strlen(method);
    TDM_REQUIRE(ml > 0 && ml <= TDM_RPC_NAME_MAX, TDM_STATUS_INVALID_ARG, "rref_call: method name '%s'", method);
    size_t n = sizeof ref->id + sizeof ml + ml + nbytes;
    uint8_t *buf = malloc(n);
    TDM_REQUIRE(buf, TDM_STATUS_OUT_OF_MEMORY, "rref_call: %zu bytes", n);
    memcpy(buf, &ref->id, sizeof ref->id);
    memcpy(buf + sizeof ref->id, &ml, sizeof ml);
    memcpy(buf + sizeof ref->id + sizeof ml, method, ml);
    if (nbytes) memcpy(buf + sizeof ref->id + sizeof ml + ml, args, nbytes);
    tdm_status st = tdm_rpc_call(ref->rpc, ref->owner, RREF_CALL, buf, n, reply, reply_nbytes, timeout_ms);
    free(buf);
    return st;
}

tdm_status tdm_rref_release(tdm_rref *ref, int64_t timeout_ms)
{
    if (!ref) return TDM_STATUS_OK;
    tdm_status st =
        tdm_rpc_call(ref->rpc, ref->owner, RREF_RELEASE, &ref->id, sizeof ref->id, NULL, NULL, timeout_ms);
    free(ref);
    return st;
}

int64_t tdm_rref_live_objects(tdm_rpc *rpc)
{
    struct tdm_rref_table *t = NULL;
    if (table_get(rpc, &t) != TDM_STATUS_OK) return -1;
    pthread_mutex_lock(&t->mu);
    int64_t n = t->live;
    pthread_mutex_unlock(&t->mu);
    return n;
}

int64_t tdm_rref_refcount(tdm_rpc *rpc, uint64_t id)
{
    struct tdm_rref_table *t = NULL;
    if (table_get(rpc, &t) != TDM_STATUS_OK) return -1;
    pthread_mutex_lock(&t->mu);
    rref_obj *o = find_obj(t, id);
    int64_t n = o ? o->refs : 0;
    pthread_mutex_unlock(&t->mu);
    return n;
}
