/* tests/test_rref.c: remote references over both transports, in forked
 * ranks: every rank creates an accumulator on every rank, calls its
 * methods, fetches copies, clones and releases references; the owners'
 * counts prove that nothing leaks once every reference is released, and a
 * call through a released reference is refused by its owner with a clear
 * error while the object another reference holds lives on; a create and
 * a clone whose waits time out leave no object on the owner. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rpc/rref.h"
#include "shm/spawn.h"
#include "tests/timeout_util.h"

#define WORLD 4

typedef struct rref_out {
    int status[WORLD];
    char err[WORLD][600];
    int64_t live_after[WORLD];
    int64_t destroyed[WORLD];
} rref_out;

static rref_out *g_out;   /* the child's view of the shared results */
static int g_rank;

static int fail(rref_out *o, int r, int code, const char *what)
{
    snprintf(o->err[r], sizeof o->err[r], "%s: %s", what, tdm_error_message());
    o->status[r] = code;
    return code;
}

static int64_t tmo(void) { return tu_scaled_ms(30000); }

/* an accumulator: a double and the count of adds */
typedef struct acc {
    double sum;
    int64_t adds;
} acc;

static tdm_status acc_create(const void *args, size_t nbytes, void **obj)
{
    acc *a = calloc(1, sizeof *a);
    TDM_REQUIRE(a, TDM_STATUS_OUT_OF_MEMORY, "acc: no memory");
    if (nbytes == sizeof(double)) memcpy(&a->sum, args, sizeof(double));
    *obj = a;
    return TDM_STATUS_OK;
}

static tdm_status acc_fetch(void *obj, tdm_rpc_req *req)
{
    void *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, sizeof(acc), &out));
    memcpy(out, obj, sizeof(acc));
    return TDM_STATUS_OK;
}

static void acc_destroy(void *obj)
{
    g_out->destroyed[g_rank]++;
    free(obj);
}

static tdm_status acc_add(void *obj, tdm_rpc_req *req)
{
    acc *a = obj;
    if (req->nbytes != sizeof(double))
        return tdm_rpc_req_fail(req, TDM_STATUS_INVALID_ARG, "add: %zu bytes (expected a double)", req->nbytes);
    double v;
    memcpy(&v, req->args, sizeof v);
    a->sum += v;
    a->adds++;
    double *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, sizeof *out, (void **)&out));
    *out = a->sum;
    return TDM_STATUS_OK;
}

static const tdm_rref_type acc_type = {
    .name = "acc",
    .create = acc_create,
    .fetch = acc_fetch,
    .destroy = acc_destroy,
    .methods = {{"add", acc_add}, {NULL, NULL}},
};

static int rref_rank(tdm_comm *comm, void *arg)
{
    tdm_rpc_transport tp = *(tdm_rpc_transport *)arg;
    rref_out *o = g_out;
    int r = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    g_rank = r;
    tdm_rpc *rpc = NULL;
    tdm_rpc_opts opts = {.transport = tp, .comm = comm, .setup_ms = tmo()};
    if (tdm_rpc_init(&rpc, &opts)) return fail(o, r, 1, "init");
    if (tdm_rref_register_type(rpc, &acc_type)) return fail(o, r, 2, "register");
    if (tdm_rref_register_type(rpc, &acc_type) != TDM_STATUS_INVALID_ARG) return fail(o, r, 3, "twice");
    if (tdm_rpc_barrier(rpc, tmo())) return fail(o, r, 4, "barrier");
    for (int owner = 0; owner < world; owner++) {
        double start = 100.0 * r;
        tdm_rref *a = NULL, *b = NULL;
        if (tdm_rref_create(rpc, owner, "acc", &start, sizeof start, tmo(), &a)) return fail(o, r, 5, "create");
        for (int i = 1; i <= 5; i++) {
            double v = i, *sum = NULL;
            size_t n = 0;
            if (tdm_rref_call(a, "add", &v, sizeof v, (void **)&sum, &n, tmo()) || n != sizeof(double))
                return fail(o, r, 6, "add");
            free(sum);
        }
        if (tdm_rref_clone(a, tmo(), &b)) return fail(o, r, 7, "clone");
        uint64_t id = tdm_rref_id(a);
        /* the first reference released: the object lives on through b */
        if (tdm_rref_release(a, tmo())) return fail(o, r, 8, "release a");
        acc *copy = NULL;
        size_t n = 0;
        if (tdm_rref_fetch(b, (void **)&copy, &n, tmo()) || n != sizeof(acc)) return fail(o, r, 9, "fetch");
        if (copy->sum != start + 15.0 || copy->adds != 5) {
            snprintf(o->err[r], sizeof o->err[r], "owner %d: sum %g adds %lld", owner, copy->sum,
                     (long long)copy->adds);
            return o->status[r] = 10;
        }
        free(copy);
        tdm_status st = tdm_rref_call(b, "mul", NULL, 0, NULL, NULL, tmo());
        if (st != TDM_STATUS_INVALID_ARG || !strstr(tdm_error_message(), "type 'acc' has no method 'mul'"))
            return fail(o, r, 11, "unknown method");
        if (tdm_rref_release(b, tmo())) return fail(o, r, 12, "release b");
        /* a stale id: the owner refuses it (no use after free) */
        uint64_t stale = id;
        st = tdm_rpc_call(rpc, owner, "tdm.rref.fetch", &stale, sizeof stale, NULL, NULL, tmo());
        if (st != TDM_STATUS_INVALID_ARG || !strstr(tdm_error_message(), "was released"))
            return fail(o, r, 13, "a released object was still served");
    }
    tdm_rref *none = NULL;
    if (tdm_rref_create(rpc, r, "nope", NULL, 0, tmo(), &none) != TDM_STATUS_INVALID_ARG ||
        !strstr(tdm_error_message(), "no type 'nope'"))
        return fail(o, r, 14, "an unknown type");
    if (tdm_rpc_barrier(rpc, tmo())) return fail(o, r, 15, "barrier 2");
    o->live_after[r] = tdm_rref_live_objects(rpc);
    tdm_rpc_free(rpc);
    o->status[r] = 0;
    return 0;
}

static void run_on(tdm_rpc_transport tp)
{
    g_out = mmap(NULL, sizeof *g_out, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(g_out, MAP_FAILED);
    memset(g_out, 0, sizeof *g_out);
    for (int r = 0; r < WORLD; r++) g_out->status[r] = -1;
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000), .grace_ms = tu_scaled_ms(20000)};
    tdm_status st = tdm_shm_spawn(WORLD, rref_rank, &tp, &so, NULL);
    for (int r = 0; r < WORLD; r++) {
        cr_assert_eq(g_out->status[r], 0, "rank %d: %s", r, g_out->err[r]);
        cr_assert_eq(g_out->live_after[r], 0, "rank %d owns %lld objects after every release", r,
                     (long long)g_out->live_after[r]);
        /* each rank made one object on every rank: each owner destroyed
         * WORLD, at the last release, before its endpoint was freed */
        cr_assert_eq(g_out->destroyed[r], WORLD, "rank %d destroyed %lld", r, (long long)g_out->destroyed[r]);
    }
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    munmap(g_out, sizeof *g_out);
}

Test(rref, lifetimes_counted_by_the_owner_shm, .timeout = 120) { run_on(TDM_RPC_SHM); }
Test(rref, lifetimes_counted_by_the_owner_tcp, .timeout = 120) { run_on(TDM_RPC_TCP); }

/* A create and a clone whose waits time out leave nothing on the owner
 * once every handle the caller got is released: the caller names the
 * object's id, and a timed-out create or clone sends its release. */
typedef struct slow_out {
    int st_create, st_clone, status[2];
    int64_t live;
    char err[2][600];
} slow_out;

static slow_out *g_slow;

static tdm_status slow_create(const void *args, size_t nbytes, void **obj)
{
    (void)args;
    (void)nbytes;
    usleep(300000);   /* the caller's 50 ms wait times out */
    *obj = malloc(8);
    TDM_REQUIRE(*obj, TDM_STATUS_OUT_OF_MEMORY, "slow: no memory");
    return TDM_STATUS_OK;
}

static tdm_status slow_fetch(void *obj, tdm_rpc_req *req)
{
    void *out = NULL;
    (void)obj;
    return tdm_rpc_req_reply(req, 0, &out);
}

static tdm_status slow_method(void *obj, tdm_rpc_req *req)
{
    (void)obj;
    (void)req;
    usleep(300000);
    return TDM_STATUS_OK;
}

static const tdm_rref_type g_slow_type = {.name = "slow", .create = slow_create, .fetch = slow_fetch,
                                          .destroy = free, .methods = {{"sleep", slow_method}}};

static int slow_fail(int r, int code, const char *what)
{
    snprintf(g_slow->err[r], sizeof g_slow->err[r], "%s: %s", what, tdm_error_message());
    g_slow->status[r] = code;
    return code;
}

static int slow_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    tdm_rpc *rpc = NULL;
    tdm_rpc_opts ro = {.transport = TDM_RPC_SHM, .comm = comm, .setup_ms = tmo()};
    if (tdm_rpc_init(&rpc, &ro)) return slow_fail(r, 1, "init");
    if (tdm_rref_register_type(rpc, &g_slow_type)) return slow_fail(r, 2, "register");
    if (tdm_rpc_barrier(rpc, tmo())) return slow_fail(r, 3, "barrier");
    if (r == 0) {
        tdm_rref *a = NULL, *b = NULL, *c = NULL;
        g_slow->st_create = tdm_rref_create(rpc, 1, "slow", NULL, 0, 50, &a);
        if (a) return slow_fail(r, 4, "a timed-out create returned a handle");
        if (tdm_rref_create(rpc, 1, "slow", NULL, 0, tmo(), &b)) return slow_fail(r, 5, "create");
        /* a method occupies the owner 300 ms: the clone behind it times out */
        /* (rref.c's wire: [u64 id][u32 method length][method]) */
        tdm_rpc_future *f = NULL;
        uint64_t id = tdm_rref_id(b);
        uint32_t ml = 5;
        uint8_t buf[sizeof id + sizeof ml + 5];
        memcpy(buf, &id, sizeof id);
        memcpy(buf + sizeof id, &ml, sizeof ml);
        memcpy(buf + sizeof id + sizeof ml, "sleep", 5);
        if (tdm_rpc_call_async(rpc, 1, "tdm.rref.call", buf, sizeof buf, &f)) return slow_fail(r, 6, "call");
        g_slow->st_clone = tdm_rref_clone(b, 50, &c);
        if (c) return slow_fail(r, 7, "a timed-out clone returned a handle");
        if (tdm_rpc_future_wait(f, tmo(), NULL, NULL)) return slow_fail(r, 8, "sleep");
        tdm_rpc_future_free(f);
        if (tdm_rref_release(b, tmo())) return slow_fail(r, 9, "release");
    }
    if (tdm_rpc_barrier(rpc, tmo())) return slow_fail(r, 10, "barrier");
    if (r == 1) g_slow->live = tdm_rref_live_objects(rpc);
    if (tdm_rpc_barrier(rpc, tmo())) return slow_fail(r, 11, "barrier");
    tdm_rpc_free(rpc);
    g_slow->status[r] = 0;
    return 0;
}

Test(rref, timed_out_create_and_clone_leak_nothing, .timeout = 120)
{
    g_slow = mmap(NULL, sizeof *g_slow, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(g_slow, MAP_FAILED);
    memset(g_slow, 0, sizeof *g_slow);
    g_slow->status[0] = g_slow->status[1] = -1;
    g_slow->live = -1;
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000), .grace_ms = tu_scaled_ms(20000)};
    tdm_status st = tdm_shm_spawn(2, slow_rank, NULL, &so, NULL);
    for (int r = 0; r < 2; r++) cr_assert_eq(g_slow->status[r], 0, "rank %d: %s", r, g_slow->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(g_slow->st_create, TDM_STATUS_TIMEOUT);
    cr_assert_eq(g_slow->st_clone, TDM_STATUS_TIMEOUT);
    cr_assert_eq(g_slow->live, 0, "the owner holds %lld objects after every handle was released",
                 (long long)g_slow->live);
    munmap(g_slow, sizeof *g_slow);
}
