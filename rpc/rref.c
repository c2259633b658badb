/* rpc/rref.c: remote references: the owner's table of objects with their
 * reference counts, served by five internal functions (create, addref,
 * fetch, call, release), and the handles that other ranks hold.
 * Arguments on the wire: create [u64 id][u32 type length][type][args];
 * call [u64 id][u32 method length][method][args]; the others [u64 id].
 * The caller names a new object's id (its rank in the top bits, its own
 * count below): a create or clone whose wait times out then sends a drop
 * of that id, which the owner applies as a release when it arrives, or,
 * when it finds no such object yet, keeps as a tombstone that the create
 * consumes (rpc/ serves one caller's calls in order, so a drop follows
 * its create today; the tombstone keeps that from being a requirement).
 * Not a distributed garbage collector: counts are explicit (clone,
 * release), and a dead holder's references are never released. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/rpc_impl.h"
#include "rpc/rref.h"

#define RREF_CREATE "tdm.rref.create"
#define RREF_ADDREF "tdm.rref.addref"
#define RREF_FETCH "tdm.rref.fetch"
#define RREF_CALL "tdm.rref.call"
#define RREF_RELEASE "tdm.rref.release"
#define RREF_DROP "tdm.rref.drop"
/* A caller-made id: (caller rank + 1) << RREF_ID_RANK_SHIFT | its count. */
#define RREF_ID_RANK_SHIFT 40
#define RREF_MAX_TYPES 16

/* A drop that came before its create. */
typedef struct rref_tomb {
    uint64_t id;
    struct rref_tomb *next;
} rref_tomb;

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
    rref_tomb *tombs;
    uint64_t next_id;            /* this rank's count of the ids it named */
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

/* Takes id's tombstone (mu held): 1 when a drop came before. */
static int take_tomb(struct tdm_rref_table *t, uint64_t id)
{
    for (rref_tomb **pp = &t->tombs; *pp; pp = &(*pp)->next) {
        if ((*pp)->id != id) continue;
        rref_tomb *dead = *pp;
        *pp = dead->next;
        free(dead);
        return 1;
    }
    return 0;
}

static tdm_status srv_create(tdm_rpc_req *req, void *ctx)
{
    struct tdm_rref_table *t = ctx;
    uint64_t id = 0;
    uint32_t tl = 0;
    if (req->nbytes < sizeof id + sizeof tl)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create: no id and type name");
    memcpy(&id, req->args, sizeof id);
    const uint8_t *p = (const uint8_t *)req->args + sizeof id;
    size_t left = req->nbytes - sizeof id;
    memcpy(&tl, p, sizeof tl);
    if (tl == 0 || tl > TDM_RPC_NAME_MAX || left < sizeof tl + tl)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create: a type name of %u bytes", tl);
    char name[TDM_RPC_NAME_MAX + 1];
    memcpy(name, p + sizeof tl, tl);
    name[tl] = '\0';
    const tdm_rref_type *type = NULL;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->n_types; i++)
        if (!strcmp(t->types[i]->name, name)) type = t->types[i];
    int exists = find_obj(t, id) != NULL, dropped = exists ? 0 : take_tomb(t, id);
    pthread_mutex_unlock(&t->mu);
    if (!type)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create: no type '%s' is registered on rank %d",
                                name, req->rpc->rank);
    if (exists)
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "create '%s': object #%llu exists on rank %d", name,
                                (unsigned long long)id, req->rpc->rank);
    if (dropped)
        return tdm_rpc_req_fail(req, TDM_STATUS_TIMEOUT, "create '%s': object #%llu was dropped by its caller "
                                "(its wait timed out) before it was made", name, (unsigned long long)id);
    rref_obj *o = calloc(1, sizeof *o);
    if (!o) return tdm_rpc_req_fail(req, TDM_STATUS_OUT_OF_MEMORY, "create '%s': no memory", name);
    tdm_status st = type->create(p + sizeof tl + tl, left - sizeof tl - tl, &o->obj);
    if (st != TDM_STATUS_OK) {
        free(o);
        return tdm_rpc_req_fail(req, st, "create '%s': %s", name, tdm_error_message());
    }
    o->type = type;
    o->refs = 1;
    o->id = id;
    pthread_mutex_lock(&t->mu);
    o->next = t->objs;
    t->objs = o;
    t->live++;
    pthread_mutex_unlock(&t->mu);
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

/* One reference to o less (mu held); the object to destroy, if it was
 * the last. */
static rref_obj *unref(struct tdm_rref_table *t, rref_obj *o)
{
    if (--o->refs > 0) return NULL;
    rref_obj **pp = &t->objs;
    while (*pp != o) pp = &(*pp)->next;
    *pp = o->next;
    t->live--;
    return o;
}

static tdm_status srv_release(tdm_rpc_req *req, void *ctx)
{
    struct tdm_rref_table *t = ctx;
    uint64_t id = 0;
    rref_obj *o = NULL;
    TDM_CHECK(read_id(req, &id));
    TDM_CHECK(lookup(req, id, &o));
    pthread_mutex_lock(&t->mu);
    rref_obj *dead = unref(t, o);
    pthread_mutex_unlock(&t->mu);
    if (dead) {
        dead->type->destroy(dead->obj);
        free(dead);
    }
    return TDM_STATUS_OK;
}

/* A timed-out create or clone's reference: released, or, when the object
 * is not there yet, a tombstone its create will find. */
static tdm_status srv_drop(tdm_rpc_req *req, void *ctx)
{
    struct tdm_rref_table *t = ctx;
    uint64_t id = 0;
    TDM_CHECK(read_id(req, &id));
    rref_tomb *tomb = malloc(sizeof *tomb);
    pthread_mutex_lock(&t->mu);
    rref_obj *o = find_obj(t, id), *dead = NULL;
    if (o) {
        dead = unref(t, o);
    } else if (tomb) {
        tomb->id = id;
        tomb->next = t->tombs;
        t->tombs = tomb;
        tomb = NULL;
    }
    pthread_mutex_unlock(&t->mu);
    if (dead) {
        dead->type->destroy(dead->obj);
        free(dead);
    }
    if (tomb && !o) return tdm_rpc_req_fail(req, TDM_STATUS_OUT_OF_MEMORY, "drop #%llu: no memory",
                                            (unsigned long long)id);
    free(tomb);
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
    TDM_CHECK(tdm_rpc_register(rpc, RREF_DROP, srv_drop, t));
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
    while (t->tombs) {
        rref_tomb *d = t->tombs;
        t->tombs = d->next;
        free(d);
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

/* After a create or clone timed out: its reference dropped on the owner
 * whenever the call arrives (not waited for: the owner may be busy). */
static tdm_status send_drop(tdm_rpc *rpc, int owner, uint64_t id, tdm_status st)
{
    char msg[TDM_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", tdm_error_message());
    tdm_rpc_future *f = NULL;
    if (tdm_rpc_call_async(rpc, owner, RREF_DROP, &id, sizeof id, &f) == TDM_STATUS_OK) tdm_rpc_future_free(f);
    return tdm_error_set(st, "%s", msg);   /* the timeout's message, whatever the drop's send did */
}

tdm_status tdm_rref_create(tdm_rpc *rpc, int owner, const char *type_name, const void *args,
                           size_t nbytes, int64_t timeout_ms, tdm_rref **out)
{
    *out = NULL;
    TDM_REQUIRE(rpc && type_name, TDM_STATUS_INVALID_ARG, "rref_create: NULL argument");
    uint32_t tl = (uint32_t)strlen(type_name);
    TDM_REQUIRE(tl > 0 && tl <= TDM_RPC_NAME_MAX, TDM_STATUS_INVALID_ARG, "rref_create: type name '%s'",
                type_name);
    struct tdm_rref_table *t = NULL;
    TDM_CHECK(table_get(rpc, &t));
    pthread_mutex_lock(&t->mu);
    uint64_t id = ((uint64_t)(rpc->rank + 1) << RREF_ID_RANK_SHIFT) | ++t->next_id;
    pthread_mutex_unlock(&t->mu);
    size_t n = sizeof id + sizeof tl + tl + nbytes;
    uint8_t *buf = malloc(n);
    TDM_REQUIRE(buf, TDM_STATUS_OUT_OF_MEMORY, "rref_create: %zu bytes", n);
    memcpy(buf, &id, sizeof id);
    memcpy(buf + sizeof id, &tl, sizeof tl);
    memcpy(buf + sizeof id + sizeof tl, type_name, tl);
    if (nbytes) memcpy(buf + sizeof id + sizeof tl + tl, args, nbytes);
    tdm_status st = tdm_rpc_call(rpc, owner, RREF_CREATE, buf, n, NULL, NULL, timeout_ms);
    free(buf);
    if (st == TDM_STATUS_TIMEOUT) st = send_drop(rpc, owner, id, st);
    TDM_CHECK(st);
    return new_handle(rpc, owner, id, out);
}

tdm_status tdm_rref_clone(const tdm_rref *ref, int64_t timeout_ms, tdm_rref **out)
{
    *out = NULL;
    tdm_status st =
        tdm_rpc_call(ref->rpc, ref->owner, RREF_ADDREF, &ref->id, sizeof ref->id, NULL, NULL, timeout_ms);
    /* rpc/ serves one caller's calls in order: the drop follows the addref */
    if (st == TDM_STATUS_TIMEOUT) st = send_drop(ref->rpc, ref->owner, ref->id, st);
    TDM_CHECK(st);
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
