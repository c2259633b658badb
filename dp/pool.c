/* dp/pool.c: the DataParallel thread pool (see dp/pool.h): persistent
 * workers, one per slot but the caller's, driven by per-slot generation
 * counters; spin-then-futex waits. Not DP itself (dp/dp.c).
 *
 * Protocol, per slot s (one worker thread W, the driving caller C), with
 * gen the caller's round counter (64-bit, never wraps):
 *   C: writes the round's fn/ctx, then publishes go[s] = gen   (seq_cst)
 *   W: waits until go[s] > seen, runs fn, writes status/msg/ms,
 *      then publishes done[s] = gen                            (seq_cst)
 *   C: waits until done[s] >= gen for every active s.
 * The go store is the release that publishes fn/ctx and everything C did
 * before the round (pairs with W's acquire load of go); the done store is
 * the release that publishes the slot's results and everything fn wrote
 * (pairs with C's acquire load of done). Rounds chain these, so round k+1
 * sees everything every thread did in round k.
 *
 * The waits are core/wait_impl.h's (spin, then a private futex), with its
 * Dekker pairing between a publisher and a sleeper: each flag has one
 * waiter, W on go and C on done. */
#include "dp/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/log.h"
#include "core/timer.h"
#include "core/wait_impl.h"

#define TDM_DP_POOL_MSG_MAX 1024
/* Sleep granularity: idle workers re-check the stop flag, and a caller
 * waiting on a long replica logs a warning every TDM_DP_POOL_WARN_NS. */
#define TDM_DP_POOL_SLEEP_NS (200ull * 1000 * 1000)
#define TDM_DP_POOL_WARN_NS (30ull * 1000 * 1000 * 1000)
#define TDM_DP_POOL_AUTO_SPIN_US 50

typedef struct tdm_dp_pool_slot {
    /* caller -> worker; its own cache line so that the worker spinning on
     * it does not share a line with the done word the caller spins on. */
    _Alignas(64) tdm_wait_flag go;
    /* worker -> caller */
    _Alignas(64) tdm_wait_flag done;
    /* Written by the slot's thread before its done store, read by the
     * caller after its acquire of done. */
    tdm_status status;
    double ms;
    char msg[TDM_DP_POOL_MSG_MAX];
    /* Worker bookkeeping (caller only). */
    pthread_t thread;
    int started;
} tdm_dp_pool_slot;

typedef struct tdm_dp_pool_arg {
    tdm_dp_pool *pool;
    int slot;
} tdm_dp_pool_arg;

struct tdm_dp_pool {
    int n_slots;
    int caller_slot;
    int spin_us;
    uint64_t spin_ns;
    uint64_t gen;                 /* caller only */
    /* The round's work: written by the caller before the go stores. */
    tdm_dp_pool_fn fn;
    void *ctx;
    _Atomic int stop;             /* set before the final go store */
    tdm_dp_pool_arg args[TDM_DP_POOL_MAX_SLOTS];
    tdm_dp_pool_slot *slots;      /* n_slots, 64-byte aligned */
};

/* Sleeps that ended by timeout and then found the word changed: a publish
 * whose wake-up never came. The sleep slice bounds the cost of one, so
 * only this count (checked by the tests) makes a lost wake-up visible. */
static _Atomic uint64_t tdm_dp_lost_wakeups;

uint64_t tdm_dp_pool_lost_wakeups(void)
{
    return atomic_load_explicit(&tdm_dp_lost_wakeups, memory_order_relaxed);
}

/* Waits until f reaches target. Spins for spin_ns, then sleeps in bounded
 * slices. stop (may be NULL) ends the wait early; who_slot >= 0 names the
 * slot awaited in the long-wait warning. */
static void tdm_dp_wait(tdm_wait_flag *f, uint64_t target, uint64_t spin_ns, _Atomic int *stop,
                        int who_slot)
{
    /* acquire: pairs with the seq_cst (release) store of tdm_wait_publish. */
    if (tdm_wait_reached(f, target)) return;
    uint64_t t0 = tdm_time_ns();
    if (spin_ns && tdm_wait_spin(f, target, t0, spin_ns, UINT64_MAX)) return;
    uint64_t next_warn = t0 + TDM_DP_POOL_WARN_NS;
    for (;;) {
        /* acquire: pairs with the release store of stop in
         * tdm_dp_pool_free, made before the go publish that wakes us. */
        if (stop && atomic_load_explicit(stop, memory_order_acquire)) return;
        int timed_out;
        if (tdm_wait_sleep(f, target, TDM_DP_POOL_SLEEP_NS, TDM_WAIT_PRIVATE, &timed_out)) {
            if (timed_out) atomic_fetch_add_explicit(&tdm_dp_lost_wakeups, 1, memory_order_relaxed);
            return;
        }
        if (who_slot >= 0 && tdm_time_ns() >= next_warn) {
            /* No deadline on compute: a replica cannot die on its own
             * (a crash ends the process), so a long wait is a slow or
             * stuck fn; say so rather than fail a correct long step. */
            TDM_WARN(DP, "still waiting for thread pool slot %d after %.0f s", who_slot,
                     (double)(tdm_time_ns() - t0) * 1e-9);
            next_warn += TDM_DP_POOL_WARN_NS;
        }
    }
}

static void tdm_dp_pool_exec(tdm_dp_pool *p, int s)
{
    tdm_dp_pool_slot *slot = &p->slots[s];
    tdm_error_clear();
    uint64_t t0 = tdm_time_ns();
    tdm_status st = p->fn(p->ctx, s);
    slot->ms = tdm_time_ms_since(t0);
    slot->status = st;
    if (st != TDM_STATUS_OK)
        snprintf(slot->msg, sizeof slot->msg, "%s", tdm_error_message());
    else
        slot->msg[0] = '\0';
}

static void *tdm_dp_pool_worker(void *argp)
{
    tdm_dp_pool_arg *arg = argp;
    tdm_dp_pool *p = arg->pool;
    int s = arg->slot;
    tdm_dp_pool_slot *slot = &p->slots[s];
    uint64_t seen = 0;
    for (;;) {
        tdm_dp_wait(&slot->go, seen + 1, p->spin_ns, &p->stop, -1);
        /* acquire: pairs with the release store of stop in
         * tdm_dp_pool_free, made before the final go store. */
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        /* The round's gen (rounds without this slot skip values); go stays
         * there until the caller has seen this round's done. */
        seen = atomic_load_explicit(&slot->go.value, memory_order_acquire);
        tdm_dp_pool_exec(p, s);
        tdm_wait_publish(&slot->done, seen, TDM_WAIT_PRIVATE);
    }
    return NULL;
}

/* Defined before tdm_dp_pool_init, whose fail path runs it on any prefix
 * of what it made. */
void tdm_dp_pool_free(tdm_dp_pool *p)
{
    if (!p) return;
    /* release: pairs with the workers' acquire load of stop after their
     * go wait; the go store below wakes them. */
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    p->gen++;
    for (int s = 0; s < p->n_slots; s++)
        if (p->slots[s].started) tdm_wait_publish(&p->slots[s].go, p->gen, TDM_WAIT_PRIVATE);
    for (int s = 0; s < p->n_slots; s++) {
        if (!p->slots[s].started) continue;
        int ret = pthread_join(p->slots[s].thread, NULL);
        if (ret != 0) TDM_WARN(DP, "thread pool: pthread_join slot %d: %s", s, strerror(ret));
    }
    free(p->slots);
    free(p);
}

tdm_status tdm_dp_pool_init(tdm_dp_pool **out, int n_slots, int caller_slot, int spin_us)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    TDM_REQUIRE(n_slots >= 1 && n_slots <= TDM_DP_POOL_MAX_SLOTS, TDM_STATUS_INVALID_ARG,
                "thread pool: %d slots (expected 1..%d)", n_slots, TDM_DP_POOL_MAX_SLOTS);
    TDM_REQUIRE(caller_slot >= 0 && caller_slot < n_slots, TDM_STATUS_INVALID_ARG,
                "thread pool: caller slot %d outside 0..%d", caller_slot, n_slots - 1);
    tdm_dp_pool *p = calloc(1, sizeof *p);
    if (!p) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "thread pool: out of memory");
    p->n_slots = n_slots;
    p->caller_slot = caller_slot;
    if (spin_us < 0) spin_us = n_slots <= tdm_device_host_cores() ? TDM_DP_POOL_AUTO_SPIN_US : 0;
    p->spin_us = spin_us;
    p->spin_ns = (uint64_t)spin_us * 1000u;
    atomic_init(&p->stop, 0);
    size_t nbytes = (size_t)n_slots * sizeof(tdm_dp_pool_slot);
    p->slots = aligned_alloc(64, (nbytes + 63) / 64 * 64);
    if (!p->slots) {
        free(p);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "thread pool: out of memory");
    }
    memset(p->slots, 0, nbytes);
    for (int s = 0; s < n_slots; s++) {
        atomic_init(&p->slots[s].go.value, 0);
        atomic_init(&p->slots[s].go.waiters, 0);
        atomic_init(&p->slots[s].done.value, 0);
        atomic_init(&p->slots[s].done.waiters, 0);
    }
    for (int s = 0; s < n_slots; s++) {
        if (s == caller_slot) continue;
        p->args[s] = (tdm_dp_pool_arg){.pool = p, .slot = s};
        int ret = pthread_create(&p->slots[s].thread, NULL, tdm_dp_pool_worker, &p->args[s]);
        if (ret != 0) {
            st = tdm_error_set(TDM_STATUS_SYSTEM, "thread pool: pthread_create for slot %d: %s",
                               s, strerror(ret));
            goto fail;
        }
        p->slots[s].started = 1;
    }
    TDM_INFO(DP, "thread pool: %d slots (caller runs slot %d), spin %d us, %d cores", n_slots,
             caller_slot, spin_us, tdm_device_host_cores());
    *out = p;
    return TDM_STATUS_OK;
fail:
    tdm_dp_pool_free(p);
    return st;
}

int tdm_dp_pool_n_slots(const tdm_dp_pool *p) { return p->n_slots; }
int tdm_dp_pool_spin_us(const tdm_dp_pool *p) { return p->spin_us; }

double tdm_dp_pool_slot_ms(const tdm_dp_pool *p, int slot)
{
    return slot >= 0 && slot < p->n_slots ? p->slots[slot].ms : 0.0;
}

tdm_status tdm_dp_pool_run(tdm_dp_pool *p, uint64_t mask, tdm_dp_pool_fn fn, void *ctx,
                           int *failed_slot)
{
    if (failed_slot) *failed_slot = -1;
    TDM_REQUIRE(fn, TDM_STATUS_INVALID_ARG, "thread pool: NULL function");
    if (p->n_slots < 64) mask &= (UINT64_C(1) << p->n_slots) - 1;
    if (!mask) return TDM_STATUS_OK;
    p->fn = fn;
    p->ctx = ctx;
    uint64_t gen = ++p->gen;
    /* seq_cst stores: the release that publishes the round (fn, ctx and
     * everything before) to each worker's acquire of go. */
    for (int s = 0; s < p->n_slots; s++)
        if (s != p->caller_slot && (mask >> s & 1))
            tdm_wait_publish(&p->slots[s].go, gen, TDM_WAIT_PRIVATE);
    if (mask >> p->caller_slot & 1) tdm_dp_pool_exec(p, p->caller_slot);
    for (int s = 0; s < p->n_slots; s++) {
        if (s == p->caller_slot || !(mask >> s & 1)) continue;
        tdm_dp_wait(&p->slots[s].done, gen, p->spin_ns, NULL, s);
    }
    for (int s = 0; s < p->n_slots; s++) {
        if (!(mask >> s & 1) || p->slots[s].status == TDM_STATUS_OK) continue;
        if (failed_slot) *failed_slot = s;
        tdm_error_copy_from(p->slots[s].msg);
        return p->slots[s].status;
    }
    return TDM_STATUS_OK;
}
