/* tests/test_shm_comm.c: results of the shm collectives against a
 * reference: every collective x op x dtype, 1..8 ranks (8 ranks on 2
 * cores), sizes 0, 1, primes and around every chunk and algorithm
 * boundary, in place and out of place; zero-copy buffers; send/recv; many
 * collectives back to back; asynchronous handles in order; argument
 * checks; ranks pinned to distinct cores decide as unpinned ones. Failure
 * handling is in test_shm_fail.c. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm_impl.h"   /* fake backends: tdm_comm_ops, tdm_comm_create */
#include "core/device.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"

/* The spawn deadlines and collective timeouts of the matrix and large
 * message tests bound a hang, they time nothing: stretched by
 * TANDEM_TEST_TIMEOUT_SCALE (tests/timeout_util.h), because 8 sanitized
 * ranks on 2 cores take several times longer than the plain build. */
#include "tests/timeout_util.h"
#include "tests/shm_test_util.h"

#define SMALL_SLOT (16 * 1024)
#define SMALL_ONE_SHOT 2048

typedef struct matrix_arg {
    tdm_coll coll;
    int all_ops;        /* reductions: every op; otherwise SUM values only */
    size_t slot_bytes, one_shot;
    const size_t *extra;  /* extra sizes (elements), 0-terminated */
} matrix_arg;

static size_t sizes_for(const matrix_arg *m, int world, size_t es, size_t *out)
{
    size_t n = 0;
    static const size_t fixed[] = {0, 1, 2, 3, 13, 61, 127, 1021};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) out[n++] = fixed[i];
    size_t slot = m->slot_bytes / es;
    size_t per = m->slot_bytes / (size_t)world / 64 * 64 / es;
    size_t os = m->one_shot / es;
    size_t marks[] = {os, slot, per, per * (size_t)world, 2 * slot};
    for (size_t i = 0; i < sizeof marks / sizeof marks[0]; i++) {
        if (marks[i] > 1) out[n++] = marks[i] - 1;
        out[n++] = marks[i];
        out[n++] = marks[i] + 1;
    }
    out[n++] = 3 * slot + 17;
    for (const size_t *e = m->extra; e && *e; e++) out[n++] = *e;
    return n;
}

static int matrix_rank(tdm_comm *comm, void *arg)
{
    const matrix_arg *m = arg;
    int w = tdm_comm_size(comm);
    int bad = 0;
    for (int dt = 0; dt < TDM_DTYPE_COUNT_; dt++) {
        size_t sizes[64];
        size_t ns = sizes_for(m, w, tdm_dtype_size((tdm_dtype)dt), sizes);
        for (size_t s = 0; s < ns; s++) {
            int op0, nops;
            shm_t_matrix_ops(m->all_ops, s, dt, &op0, &nops);
            for (int op = op0; op < op0 + nops; op++)
                for (int inplace = 0; inplace < 2; inplace++)
                    for (int root = 0; root < w; root += (w > 1 ? w - 1 : 1)) {
                        shm_t_case k = {.coll = m->coll, .dtype = (tdm_dtype)dt,
                                        .op = (tdm_redop)op, .count = sizes[s], .root = root,
                                        .inplace = inplace, .salt = (unsigned)(s * 3 + op)};
                        bad |= shm_t_run_case(comm, &k);
                        if (bad) return 1;
                        if (m->coll == TDM_COLL_ALL_REDUCE || m->coll == TDM_COLL_ALL_GATHER ||
                            m->coll == TDM_COLL_REDUCE_SCATTER)
                            break; /* no root */
                    }
        }
    }
    return bad;
}

static void run_matrix(tdm_coll coll, int all_ops, int max_world)
{
    matrix_arg m = {.coll = coll, .all_ops = all_ops, .slot_bytes = SMALL_SLOT,
                    .one_shot = SMALL_ONE_SHOT};
    for (int w = 1; w <= max_world; w++) {
        tdm_shm_spawn_opts o = {.shm = {.slot_bytes = SMALL_SLOT,
                                        .one_shot_max_bytes = SMALL_ONE_SHOT,
                                        .timeout_ms = tu_scaled_ms(20000)},
                                .timeout_ms = tu_scaled_ms(40000)};
        tdm_status st = tdm_shm_spawn(w, matrix_rank, &m, &o, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%s with %d ranks: %s", tdm_coll_name(coll), w,
                     tdm_error_message());
    }
}

Test(shm_comm, all_reduce_matrix, .timeout = 240) { run_matrix(TDM_COLL_ALL_REDUCE, 1, 8); }
Test(shm_comm, reduce_matrix, .timeout = 240) { run_matrix(TDM_COLL_REDUCE, 1, 8); }
Test(shm_comm, reduce_scatter_matrix, .timeout = 240) { run_matrix(TDM_COLL_REDUCE_SCATTER, 1, 8); }
Test(shm_comm, all_gather_matrix, .timeout = 240) { run_matrix(TDM_COLL_ALL_GATHER, 0, 8); }
Test(shm_comm, gather_matrix, .timeout = 240) { run_matrix(TDM_COLL_GATHER, 0, 8); }
Test(shm_comm, scatter_matrix, .timeout = 240) { run_matrix(TDM_COLL_SCATTER, 0, 8); }
Test(shm_comm, broadcast_matrix, .timeout = 240) { run_matrix(TDM_COLL_BROADCAST, 0, 8); }

/* Default layout (1 MiB slots; one-shot up to 512 B for 2 ranks, 128
 * floats, and 4 KiB for 3, 1024 floats) and large messages. */
static int large_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    static const size_t counts[] = {127, 128, 129, 1023, 1024, 1025, 8191, 8192, 8193,
                                    262143, 262144 + 7, 16u << 20};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        for (int inplace = 0; inplace < 2; inplace++) {
            shm_t_case k = {.coll = TDM_COLL_ALL_REDUCE, .dtype = TDM_DTYPE_FLOAT32,
                            .op = TDM_REDOP_SUM, .count = counts[i], .inplace = inplace,
                            .salt = (unsigned)i};
            if (shm_t_run_case(comm, &k)) return 1;
        }
    shm_t_case k = {.coll = TDM_COLL_ALL_GATHER, .dtype = TDM_DTYPE_INT32, .count = 1u << 20};
    if (shm_t_run_case(comm, &k)) return 1;
    k = (shm_t_case){.coll = TDM_COLL_REDUCE_SCATTER, .dtype = TDM_DTYPE_INT64,
                     .op = TDM_REDOP_MAX, .count = 300001};
    if (shm_t_run_case(comm, &k)) return 1;
    return 0;
}

Test(shm_comm, large_messages, .timeout = 240)
{
    for (int w = 2; w <= 3; w++) {
        tdm_shm_spawn_opts o = {.timeout_ms = tu_scaled_ms(50000)};
        tdm_status st = tdm_shm_spawn(w, large_rank, NULL, &o, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%d ranks: %s", w, tdm_error_message());
    }
}

/* Zero-copy: buffers from the arena, all_reduce in place reads peers. */
static int zero_copy_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm), w = tdm_comm_size(comm);
    float *buf;
    size_t cap = (size_t)3 << 20;
    if (tdm_shm_comm_alloc(comm, cap * sizeof(float), (void **)&buf)) return 3;
    static const size_t counts[] = {1, 100, 8191, 8192, 8193, 65536 * 3 + 5, (size_t)3 << 20};
    for (int op = 0; op < TDM_REDOP_COUNT_; op++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            size_t n = counts[c];
            for (size_t i = 0; i < n; i++) buf[i] = (float)shm_t_val(i, r, (tdm_redop)op, (unsigned)c);
            tdm_status st = tdm_comm_all_reduce(comm, buf, buf, n, TDM_DTYPE_FLOAT32, (tdm_redop)op);
            if (st) { fprintf(stderr, "zc: %s\n", tdm_error_message()); return 1; }
            if (n * 4 > 4096 && strcmp(tdm_comm_last_algo(comm), "rs-ag-zc") != 0) {
                fprintf(stderr, "zc: count %zu used %s\n", n, tdm_comm_last_algo(comm));
                return 1;
            }
            for (size_t i = 0; i < n; i++)
                if (!shm_t_equal(buf, i, TDM_DTYPE_FLOAT32, (tdm_redop)op,
                                 shm_t_ref(i, w, (tdm_redop)op, (unsigned)c), w)) {
                    fprintf(stderr, "zc rank %d: op %d count %zu: wrong at %zu\n", r, op, n, i);
                    return 1;
                }
        }
    return 0;
}

Test(shm_comm, zero_copy_all_reduce, .timeout = 60)
{
    for (int w = 2; w <= 4; w += 2) {
        tdm_shm_spawn_opts o = {.shm = {.arena_bytes = (size_t)13 << 20}, .timeout_ms = 50000};
        tdm_status st = tdm_shm_spawn(w, zero_copy_rank, NULL, &o, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%d ranks: %s", w, tdm_error_message());
    }
}

/* Thousands of small collectives back to back, each checked, mixed sizes. */
static int back_to_back_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm), w = tdm_comm_size(comm);
    int64_t buf[700];
    for (int it = 0; it < 3000; it++) {
        size_t n = (it % 7 == 0) ? 700 : 1 + (size_t)(it % 5);
        for (size_t i = 0; i < n; i++) buf[i] = it * 1000 + r * 10 + (int64_t)i;
        if (tdm_comm_all_reduce(comm, buf, buf, n, TDM_DTYPE_INT64, TDM_REDOP_SUM)) {
            fprintf(stderr, "b2b: %s\n", tdm_error_message());
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            int64_t want = (int64_t)w * (it * 1000 + (int64_t)i) + 10 * (int64_t)w * (w - 1) / 2;
            if (buf[i] != want) {
                fprintf(stderr, "b2b rank %d it %d: [%zu] = %lld want %lld\n", r, it, i,
                        (long long)buf[i], (long long)want);
                return 1;
            }
        }
        if (it % 500 == 0 && tdm_comm_barrier(comm)) return 1;
    }
    return 0;
}

Test(shm_comm, back_to_back, .timeout = 60)
{
    static const int worlds[] = {2, 4, 8};
    for (int i = 0; i < 3; i++) {
        tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000}, .timeout_ms = 40000};
        tdm_status st = tdm_shm_spawn(worlds[i], back_to_back_rank, NULL, &o, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%d ranks: %s", worlds[i], tdm_error_message());
    }
}

/* Futex path only (no spinning), 4 ranks. */
Test(shm_comm, back_to_back_sleeping, .timeout = 60)
{
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000, .no_spin = 1}, .timeout_ms = 40000};
    tdm_status st = tdm_shm_spawn(4, back_to_back_rank, NULL, &o, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
}

/* Asynchronous all_reduces complete in order, with a synchronous call
 * issued behind them. */
static int async_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    enum { NW = 64, N = 5000 };
    int w = tdm_comm_size(comm), r = tdm_comm_rank(comm);
    static int32_t bufs[NW][N];
    tdm_comm_work *works[NW];
    for (int j = 0; j < NW; j++) {
        for (int i = 0; i < N; i++) bufs[j][i] = j + r + i;
        if (tdm_comm_all_reduce_async(comm, bufs[j], bufs[j], (size_t)(j % 3 ? N : 3),
                                      TDM_DTYPE_INT32, TDM_REDOP_SUM, &works[j]))
            return 1;
    }
    int32_t one = r;
    if (tdm_comm_all_reduce(comm, &one, &one, 1, TDM_DTYPE_INT32, TDM_REDOP_MAX)) return 1;
    if (one != w - 1) return 2;
    int done = 0;
    if (tdm_comm_work_test(works[NW - 1], &done) || !done) return 3; /* completed in order */
    for (int j = 0; j < NW; j++) {
        if (tdm_comm_work_wait(works[j], 10000)) {
            fprintf(stderr, "async %d: %s\n", j, tdm_error_message());
            return 4;
        }
        tdm_comm_work_free(works[j]);
        int n = j % 3 ? N : 3;
        for (int i = 0; i < n; i++)
            if (bufs[j][i] != w * (j + i) + w * (w - 1) / 2) return 5;
    }
    return 0;
}

Test(shm_comm, async_in_order, .timeout = 60)
{
    for (int w = 1; w <= 4; w++) {
        tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000}, .timeout_ms = 30000};
        tdm_status st = tdm_shm_spawn(w, async_rank, NULL, &o, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%d ranks: %s", w, tdm_error_message());
    }
}

/* A work that is still running: wait(timeout) says TIMEOUT and the work
 * stays valid; test() says not done; later it completes. Rank 1 joins the
 * call only once rank 0 has seen it running (a shared flag), not after a
 * fixed 400 ms that a loaded machine could spend before rank 0 even
 * starts. */
static int async_slow_peer_rank(tdm_comm *comm, void *arg)
{
    atomic_int *seen = arg;
    int r = tdm_comm_rank(comm);
    int32_t x = r + 1;
    if (r == 1) {
        for (int t = 0; !atomic_load(seen) && t < tu_scaled_ms(10000); t += 5) usleep(5000);
        return tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM) || x != 3;
    }
    tdm_comm_work *w = NULL;
    if (tdm_comm_all_reduce_async(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM, &w)) return 1;
    int done = 1;
    int rc = 0;
    if (tdm_comm_work_test(w, &done) || done) rc = 2;
    else if (tdm_comm_work_wait(w, 50) != TDM_STATUS_TIMEOUT) rc = 3;
    else if (!strstr(tdm_error_message(), "still running")) rc = 4;
    atomic_store(seen, 1);
    if (rc) return rc;
    if (tdm_comm_work_wait(w, tu_scaled_ms(10000)) != TDM_STATUS_OK) return 5;
    if (tdm_comm_work_test(w, &done) || !done) return 6;
    tdm_comm_work_free(w);
    return x == 3 ? 0 : 7;
}

Test(shm_comm, async_wait_timeout, .timeout = 30)
{
    atomic_int *seen = mmap(NULL, sizeof *seen, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(seen != MAP_FAILED);
    atomic_init(seen, 0);
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 10000}, .timeout_ms = 20000};
    tdm_status st = tdm_shm_spawn(2, async_slow_peer_rank, seen, &o, NULL);
    munmap(seen, sizeof *seen);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
}

/* send/recv between pairs, sizes across the channel's chunking. */
static int p2p_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm), w = tdm_comm_size(comm);
    int peer = r ^ 1;
    if (peer >= w) return 0;
    static const size_t counts[] = {0, 1, 16383, 16384, 16385, 100000};
    static int32_t buf[100000];
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
        for (int dir = 0; dir < 2; dir++) {
            size_t n = counts[c];
            int sender = (r & 1) == dir;
            if (sender) {
                for (size_t i = 0; i < n; i++) buf[i] = (int32_t)(i * 3 + (size_t)r + c);
                if (tdm_comm_send(comm, buf, n, TDM_DTYPE_INT32, peer)) return 1;
            } else {
                memset(buf, 0, sizeof buf);
                if (tdm_comm_recv(comm, buf, n, TDM_DTYPE_INT32, peer)) return 2;
                for (size_t i = 0; i < n; i++)
                    if (buf[i] != (int32_t)(i * 3 + (size_t)peer + c)) return 3;
            }
        }
    /* collectives still work after point-to-point traffic */
    if (w % 2 == 0) {
        int32_t x = 1;
        if (tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM) || x != w) return 4;
    }
    return 0;
}

Test(shm_comm, send_recv, .timeout = 30)
{
    for (int w = 2; w <= 4; w += 2) {
        tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 10000}, .timeout_ms = 20000};
        tdm_status st = tdm_shm_spawn(w, p2p_rank, NULL, &o, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%d ranks: %s", w, tdm_error_message());
    }
}

/* A backend that does not declare the 16-bit types never sees them. */
static int fake_runs;
static tdm_status fake_run(void *impl, const tdm_comm_call *k)
{
    (void)impl; (void)k;
    fake_runs++;
    return TDM_STATUS_OK;
}
static tdm_status fake_abort(void *impl, const char *reason) { (void)impl; (void)reason; return TDM_STATUS_OK; }
static void fake_destroy(void *impl) { (void)impl; }

Test(shm_comm, half_types_need_backend_support, .timeout = 10)
{
    static const tdm_comm_ops fake = {.name = "fake", .run = fake_run, .abort = fake_abort,
                                      .destroy = fake_destroy};
    tdm_comm *comm = NULL;
    static int dummy;
    cr_assert_eq(tdm_comm_create(&comm, &fake, &dummy, 0, 2), TDM_STATUS_OK);
    uint16_t x[4] = {0};
    cr_expect_eq(tdm_comm_all_reduce(comm, x, x, 4, TDM_DTYPE_BFLOAT16, TDM_REDOP_SUM),
                 TDM_STATUS_UNSUPPORTED);
    cr_expect(strstr(tdm_error_message(), "the fake backend does not support bfloat16"), "%s",
              tdm_error_message());
    cr_expect_eq(tdm_comm_broadcast(comm, x, x, 4, TDM_DTYPE_FLOAT16, 0), TDM_STATUS_UNSUPPORTED);
    cr_expect_eq(fake_runs, 0);
    cr_expect_eq(tdm_comm_all_reduce(comm, x, x, 2, TDM_DTYPE_INT32, TDM_REDOP_SUM), TDM_STATUS_OK);
    cr_expect_eq(fake_runs, 1);
    cr_expect_str_eq(tdm_comm_last_algo(comm), "default");
    tdm_comm_free(comm);
}

/* The optional prepare hook runs on the issuing thread before a queued
 * call's submission returns, and its token reaches run; direct calls
 * carry none. (NCCL records the compute stream there.) */
static pthread_t prep_thread;
static int prep_calls, prep_fail, tok_runs, direct_runs;
static tdm_status tok_prepare(void *impl, tdm_comm_call *k)
{
    (void)impl;
    if (prep_fail) return tdm_error_set(TDM_STATUS_SYSTEM, "prepare refused");
    prep_thread = pthread_self();
    k->token = &prep_calls;
    prep_calls++;
    return TDM_STATUS_OK;
}
static tdm_status tok_run(void *impl, const tdm_comm_call *k)
{
    (void)impl;
    if (k->token == &prep_calls) tok_runs++;
    else if (!k->token) direct_runs++;
    else return tdm_error_set(TDM_STATUS_SYSTEM, "unexpected token");
    return TDM_STATUS_OK;
}

Test(shm_comm, prepare_hook_runs_on_the_issuing_thread, .timeout = 10)
{
    static const tdm_comm_ops ops = {.name = "tok", .run = tok_run, .abort = fake_abort,
                                     .destroy = fake_destroy, .prepare = tok_prepare};
    tdm_comm *comm = NULL;
    static int dummy;
    cr_assert_eq(tdm_comm_create(&comm, &ops, &dummy, 0, 2), TDM_STATUS_OK);
    int32_t x[4] = {0};
    cr_assert_eq(tdm_comm_all_reduce(comm, x, x, 4, TDM_DTYPE_INT32, TDM_REDOP_SUM), TDM_STATUS_OK);
    cr_expect_eq(prep_calls, 0, "a direct call is not prepared");
    cr_expect_eq(direct_runs, 1);
    tdm_comm_work *w[3];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(tdm_comm_all_reduce_async(comm, x, x, 4, TDM_DTYPE_INT32, TDM_REDOP_SUM,
                                               &w[i]), TDM_STATUS_OK);
        cr_expect_eq(prep_calls, i + 1, "prepared before the submission returned");
        cr_expect(pthread_equal(prep_thread, pthread_self()), "prepared on the issuing thread");
    }
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(tdm_comm_work_wait(w[i], 5000), TDM_STATUS_OK, "%s", tdm_error_message());
        tdm_comm_work_free(w[i]);
    }
    cr_expect_eq(tok_runs, 3, "every token reached run");
    prep_fail = 1;
    tdm_comm_work *bad = NULL;
    cr_expect_eq(tdm_comm_all_reduce_async(comm, x, x, 4, TDM_DTYPE_INT32, TDM_REDOP_SUM, &bad),
                 TDM_STATUS_SYSTEM);
    cr_expect(strstr(tdm_error_message(), "prepare refused"), "%s", tdm_error_message());
    cr_expect_null(bad);
    cr_expect_eq(tok_runs + direct_runs, 4, "a refused call never runs");
    tdm_comm_free(comm);
}

/* Argument checks of the dispatcher, on a one-rank communicator. */
Test(shm_comm, argument_checks, .timeout = 10)
{
    tdm_shm_group *g = NULL;
    tdm_comm *comm = NULL;
    cr_assert_eq(tdm_shm_group_create(&g, 1, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_shm_comm_init(&comm, g, 0, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    float x[4] = {1, 2, 3, 4}, y[4];
    cr_expect_eq(tdm_comm_all_reduce(comm, NULL, y, 4, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM),
                 TDM_STATUS_INVALID_ARG);
    cr_expect(strstr(tdm_error_message(), "sendbuf is NULL"), "%s", tdm_error_message());
    cr_expect_eq(tdm_comm_all_reduce(comm, x, NULL, 4, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM),
                 TDM_STATUS_INVALID_ARG);
    cr_expect_eq(tdm_comm_all_reduce(comm, NULL, NULL, 0, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM),
                 TDM_STATUS_OK);
    cr_expect_eq(tdm_comm_broadcast(comm, x, y, 4, TDM_DTYPE_FLOAT32, 1), TDM_STATUS_INVALID_ARG);
    cr_expect(strstr(tdm_error_message(), "root 1 out of range"), "%s", tdm_error_message());
    cr_expect_eq(tdm_comm_all_reduce(comm, x, y, 4, (tdm_dtype)99, TDM_REDOP_SUM),
                 TDM_STATUS_INVALID_ARG);
    cr_expect(strstr(tdm_error_message(), "invalid dtype 99"), "%s", tdm_error_message());
    cr_expect_eq(tdm_comm_all_reduce(comm, x, y, 4, TDM_DTYPE_FLOAT32, (tdm_redop)-1),
                 TDM_STATUS_INVALID_ARG);
    cr_expect_eq(tdm_comm_send(comm, x, 4, TDM_DTYPE_FLOAT32, 0), TDM_STATUS_INVALID_ARG);
    cr_expect_eq(tdm_comm_all_reduce(comm, x, y, 4, TDM_DTYPE_FLOAT32, TDM_REDOP_AVG),
                 TDM_STATUS_OK);
    cr_expect(y[3] == 4.0f);
    tdm_comm_work *wk = NULL;
    cr_expect_eq(tdm_comm_all_reduce_async(comm, NULL, y, 4, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM, &wk),
                 TDM_STATUS_INVALID_ARG);
    cr_expect_null(wk);
    void *p = NULL;
    cr_expect_eq(tdm_comm_alloc(comm, 64, &p), TDM_STATUS_OUT_OF_MEMORY); /* no arena */
    tdm_dtype dt;
    tdm_redop op;
    cr_expect_eq(tdm_dtype_parse("double", &dt), TDM_STATUS_OK);
    cr_expect_eq(dt, TDM_DTYPE_FLOAT64);
    cr_expect_eq(tdm_redop_parse("avg", &op), TDM_STATUS_OK);
    cr_expect_eq(op, TDM_REDOP_AVG);
    cr_expect_eq(tdm_redop_parse("mean", &op), TDM_STATUS_INVALID_ARG);
    /* 16-bit conversions: known bit patterns, rounding to nearest even */
    cr_expect_eq(tdm_f32_to_bf16(1.0f), 0x3f80);
    cr_expect_eq(tdm_f32_to_bf16(-2.0f), 0xc000);
    cr_expect_eq(tdm_f32_to_bf16(1.00390625f), 0x3f80);       /* tie, to even */
    cr_expect_eq(tdm_f32_to_bf16(1.01171875f), 0x3f82);       /* tie, to even (up) */
    cr_expect(tdm_bf16_to_f32(0x3fc0) == 1.5f);
    cr_expect_eq(tdm_f32_to_f16(1.0f), 0x3c00);
    cr_expect_eq(tdm_f32_to_f16(65504.0f), 0x7bff);
    cr_expect_eq(tdm_f32_to_f16(65520.0f), 0x7c00);           /* rounds to inf */
    cr_expect_eq(tdm_f32_to_f16(0x1p-24f), 0x0001);           /* smallest subnormal */
    cr_expect_eq(tdm_f32_to_f16(1.5f * 0x1p-24f), 0x0002);    /* subnormal ties to even */
    cr_expect_eq(tdm_f32_to_f16(2.5f * 0x1p-24f), 0x0002);
    cr_expect_eq(tdm_f32_to_f16(0x1p-26f), 0x0000);
    cr_expect_eq(tdm_f32_to_f16(-0.0f), 0x8000);
    cr_expect_eq(tdm_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);    /* tie, to even */
    cr_expect_eq(tdm_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
    cr_expect(tdm_f16_to_f32(0x0001) == 0x1p-24f);
    cr_expect(tdm_f16_to_f32(0xc000) == -2.0f);
    cr_expect(tdm_f16_to_f32(0x3555) == 0.333251953125f);  /* 0.25 * (1 + 341/1024) */
    for (uint32_t h = 0; h < 0x7c00; h++)   /* every finite half round-trips */
        if (tdm_f32_to_f16(tdm_f16_to_f32((uint16_t)h)) != h) {
            cr_expect(0, "half 0x%04x does not round-trip", h);
            break;
        }
    cr_expect_eq(tdm_dtype_parse("bf16", &dt), TDM_STATUS_OK);
    cr_expect_eq(dt, TDM_DTYPE_BFLOAT16);
    cr_expect_eq(tdm_dtype_size(TDM_DTYPE_FLOAT16), 2);
    tdm_comm_free(comm);
    tdm_comm_free(NULL);
    tdm_shm_group_free(g);
    tdm_shm_group_free(NULL);
}

/* --- what the ranks decide from the cores they have ---------------------- */

/* Joins g as rank r, pinned first to the r-th core of this process's
 * affinity when pin, and writes what the communicator decided to out[r];
 * returns the child's exit code (0: ok). */
static int tuning_child(tdm_shm_group *g, int r, int pin, tdm_shm_tuning *out)
{
    if (pin) {
        cpu_set_t all, one;
        if (sched_getaffinity(0, sizeof all, &all) != 0) return 70;
        CPU_ZERO(&one);
        for (int c = 0, seen = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &all) && seen++ == r) CPU_SET(c, &one);
        if (CPU_COUNT(&one) != 1 || sched_setaffinity(0, sizeof one, &one) != 0) return 71;
        if (tdm_device_host_cores() != 1) return 72;   /* it is pinned: it sees one core */
    }
    tdm_comm *comm = NULL;
    tdm_shm_opts o = {.timeout_ms = 20000};
    if (tdm_shm_comm_init(&comm, g, r, &o)) return 73;
    int bad = tdm_shm_comm_tuning(comm, &out[r]) != TDM_STATUS_OK;
    /* and it still computes */
    shm_t_case k = {.coll = TDM_COLL_ALL_REDUCE, .dtype = TDM_DTYPE_FLOAT32, .op = TDM_REDOP_SUM,
                    .count = 1000};
    if (!bad) bad = shm_t_run_case(comm, &k) ? 74 : 0;
    tdm_comm_free(comm);
    return bad;
}

/* world ranks forked from one group (made here, unpinned), each pinned
 * to its own core or not; out[r] gets rank r's decisions. */
static void tuning_job(int world, int pin, tdm_shm_tuning *out)
{
    tdm_shm_tuning *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                              -1, 0);
    cr_assert(sh != MAP_FAILED);
    tdm_shm_group *g = NULL;
    cr_assert_eq(tdm_shm_group_create(&g, world, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    pid_t pids[8];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        cr_assert(pids[r] >= 0);
        if (pids[r] == 0) _exit(tuning_child(g, r, pin, sh));
        tdm_shm_group_set_pid(g, r, pids[r]);
    }
    for (int r = 0; r < world; r++) {
        int ws = 0;
        cr_assert_eq(waitpid(pids[r], &ws, 0), pids[r]);
        tdm_shm_group_mark_ended(g, r, ws);
        cr_expect(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "rank %d (%s) ended with status 0x%x",
                  r, pin ? "pinned" : "unpinned", ws);
    }
    tdm_shm_group_free(g);
    memcpy(out, sh, (size_t)world * sizeof *out);
    munmap(sh, 4096);
}

/* Ranks pinned each to a distinct core (what mpirun --bind-to core does)
 * see one core each through sched_getaffinity, yet together they have
 * one core per rank: they must spin and choose the same one-shot limit
 * as unpinned ranks do, not fall back to the policy for ranks that share
 * one core. */
Test(shm_comm, pinned_ranks_decide_as_unpinned_ones, .timeout = 60)
{
    int cores = tdm_device_host_cores();
    if (cores < 2) cr_skip_test("this process may use %d core: pinning 2 ranks to distinct "
                                "cores needs 2", cores);
    int world = cores < 4 ? cores : 4;
    tdm_shm_tuning free_[8], pinned[8];
    tuning_job(world, 0, free_);
    tuning_job(world, 1, pinned);
    for (int r = 0; r < world; r++) {
        cr_expect_eq(free_[r].cores, cores, "rank %d: %d cores, this process has %d", r,
                     free_[r].cores, cores);
        cr_expect_eq(free_[r].spin, 1, "unpinned rank %d of %d on %d cores does not spin", r,
                     world, cores);
        cr_expect_eq(pinned[r].cores, free_[r].cores, "rank %d: pinned %d cores, unpinned %d", r,
                     pinned[r].cores, free_[r].cores);
        cr_expect_eq(pinned[r].spin, free_[r].spin, "rank %d: pinned spin %d, unpinned %d", r,
                     pinned[r].spin, free_[r].spin);
        cr_expect_eq(pinned[r].spin_async, free_[r].spin_async,
                     "rank %d: pinned spin_async %d, unpinned %d", r, pinned[r].spin_async,
                     free_[r].spin_async);
        cr_expect_eq(pinned[r].one_shot_max_bytes, free_[r].one_shot_max_bytes,
                     "rank %d: pinned one-shot %zu, unpinned %zu", r,
                     pinned[r].one_shot_max_bytes, free_[r].one_shot_max_bytes);
    }
    /* what the header carries decides, for every rank alike */
    tdm_shm_group *g = NULL;
    tdm_shm_opts one = {.cores = 1};
    cr_assert_eq(tdm_shm_group_create(&g, 2, &one), TDM_STATUS_OK, "%s", tdm_error_message());
    tdm_comm *comm = NULL;
    tdm_shm_tuning t;
    cr_assert_eq(tdm_shm_comm_init(&comm, g, 0, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_shm_comm_tuning(comm, &t), TDM_STATUS_OK);
    cr_expect(t.cores == 1 && !t.spin && !t.spin_async && t.one_shot_max_bytes == 4096,
              "2 ranks told 1 core: cores %d spin %d/%d one-shot %zu", t.cores, t.spin,
              t.spin_async, t.one_shot_max_bytes);
    tdm_comm_free(comm);
    tdm_shm_group_free(g);
    cr_expect_eq(tdm_shm_comm_tuning(NULL, &t), TDM_STATUS_INVALID_ARG);
}
