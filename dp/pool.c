/* dp/pool.c: the DataParallel thread pool (see dp/pool.h): persistent
 * workers, one per slot but the caller's, driven by per-slot generation
 * counters; spin-then-futex waits. Not DP itself (dp/dp.c).
 *
 * Protocol, per slot s (one worker thread W, the driving caller C):
 *   C: writes the round's fn/ctx, then store go[s] = gen       (seq_cst)
 *   W: waits until go[s] != seen, runs fn, writes status/msg/ms,
 *      then store done[s] = gen                                 (seq_cst)
 *   C: waits until done[s] == gen for every active s.
 * The go store is the release that publishes fn/ctx and everything C did
 * before the round (pairs with W's acquire load of go); the done store is
 * the release that publishes the slot's results and everything fn wrote
 * (pairs with C's acquire load of done). Rounds chain these, so round k+1
 * sees everything every thread did in round k.
 *
 * Sleeping, Dekker style (as shm/wait.c), for each word with one waiter:
 *   publisher: store word (seq_cst)   ; load sleeping (seq_cst) -> wake
 *   sleeper:   store sleeping=1 (seq_cst); load word (seq_cst); futex_wait
 * In the total order of seq_cst operations either the publisher sees the
 * sleeper's flag (and wakes it) or the sleeper sees the new word (and does
 * not sleep); futex_wait also re-checks the word in the kernel, so a wake
 * that lands between the load and the sleep is not lost. */
#include "dp/pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/device.h"
#include "core/log.h"
#include "core/timer.h"

#define TDM_DP_POOL_MSG_MAX 1024
/* Sleep granularity: idle workers re-check the stop flag, and a caller
 * waiting on a long replica logs a warning every TDM_DP_POOL_WARN_NS. */
#define TDM_DP_POOL_SLEEP_NS (200ull * 1000 * 1000)
#define TDM_DP_POOL_WARN_NS (30ull * 1000 * 1000 * 1000)
#define TDM_DP_POOL_AUTO_SPIN_US 50

typedef struct tdm_dp_pool_slot {
    /* caller -> worker; its own cache line so that the worker spinning on
     * it does not share a line with the done word the caller spins on. */
    _Alignas(64) _Atomic uint32_t go;
    _Atomic uint32_t go_sleeping;
    /* worker -> caller */
    _Alignas(64) _Atomic uint32_t done;
    _Atomic uint32_t done_sleeping;
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
    uint32_t gen;                 /* caller only */
    /* The round's work: written by the caller before the go stores. */
    tdm_dp_pool_fn fn;
    void *ctx;
    _Atomic int stop;             /* set before the final go store */
    tdm_dp_pool_arg args[TDM_DP_POOL_MAX_SLOTS];
    tdm_dp_pool_slot *slots;      /* n_slots, 64-byte aligned */
};

static inline void tdm_dp_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sleeps that ended by timeout and then found the word changed: a publish
 * whose wake-up never came. The sleep slice bounds the cost of one, so
 * only this count (checked by the tests) makes a lost wake-up visible. */
static _Atomic uint64_t tdm_dp_lost_wakeups;

uint64_t tdm_dp_pool_lost_wakeups(void)
{
    return atomic_load_explicit(&tdm_dp_lost_wakeups, memory_order_relaxed);
}

/* Returns 1 when the sleep timed out. */
static int tdm_dp_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t timeout_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ull),
                          .tv_nsec = (long)(timeout_ns % 1000000000ull)};
    /* EINTR, EAGAIN (word already changed) and ETIMEDOUT all mean: look
     * again; the callers loop. */
    long r = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, &ts, NULL, 0);
    return r == -1 && errno == ETIMEDOUT;
}

static void tdm_dp_futex_wake(_Atomic uint32_t *word)
{
    (void)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void tdm_dp_publish(_Atomic uint32_t *word, _Atomic uint32_t *sleeping, uint32_t v)
{
    /* seq_cst store: the release that publishes the round (go) or the
     * slot's results (done); Dekker pair with the sleeper's flag store
     * and word load in tdm_dp_wait. */
    atomic_store_explicit(word, v, memory_order_seq_cst);
    if (atomic_load_explicit(sleeping, memory_order_seq_cst)) tdm_dp_futex_wake(word);
}

/* Waits until (*word == value) == want_equal. Spins for spin_ns, then
 * sleeps in bounded slices. stop (may be NULL) ends the wait early;
 * who_slot >= 0 names the slot awaited in the long-wait warning.
 * Returns the last value seen. */
static uint32_t tdm_dp_wait(_Atomic uint32_t *word, _Atomic uint32_t *sleeping, uint32_t value,
                            int want_equal, uint64_t spin_ns, _Atomic int *stop,
                            int who_slot)
{
    /* acquire: pairs with the seq_cst (release) store in tdm_dp_publish. */
    uint32_t v = atomic_load_explicit(word, memory_order_acquire);
    if ((v == value) == want_equal) return v;
    uint64_t t0 = 0;
    if (spin_ns) {
        t0 = tdm_time_ns();
        for (unsigned i = 1;; i++) {
            tdm_dp_cpu_relax();
            v = atomic_load_explicit(word, memory_order_acquire);
            if ((v == value) == want_equal) return v;
            /* reading the clock costs ~20 ns: every 32 pauses is enough */
            if ((i & 31) == 0 && tdm_time_ns() - t0 >= spin_ns) break;
        }
    } else {
        t0 = tdm_time_ns();
    }
    uint64_t next_warn = t0 + TDM_DP_POOL_WARN_NS;
    for (;;) {
        atomic_store_explicit(sleeping, 1, memory_order_seq_cst);
        v = atomic_load_explicit(word, memory_order_seq_cst);
        if ((v == value) == want_equal) break;
        if (stop && atomic_load_explicit(stop, memory_order_acquire)) break;
        int timed_out = tdm_dp_futex_wait(word, v, TDM_DP_POOL_SLEEP_NS);
        atomic_store_explicit(sleeping, 0, memory_order_relaxed);
        v = atomic_load_explicit(word, memory_order_acquire);
        if ((v == value) == want_equal) {
            if (timed_out) atomic_fetch_add_explicit(&tdm_dp_lost_wakeups, 1, memory_order_relaxed);
            return v;
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
    atomic_store_explicit(sleeping, 0, memory_order_relaxed);
    return v;
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
    uint32_t seen = 0;
    for (;;) {
        seen = tdm_dp_wait(&slot->go, &slot->go_sleeping, seen, 0, p->spin_ns, &p->stop, -1);
        /* acquire: pairs with the release store of stop in
         * tdm_dp_pool_free, made before the final go store. */
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        tdm_dp_pool_exec(p, s);
        tdm_dp_publish(&slot->done, &slot->done_sleeping, seen);
    }
    return NULL;
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
        atomic_init(&p->slots[s].go, 0);
        atomic_init(&p->slots[s].go_sleeping, 0);
        atomic_init(&p->slots[s].done, 0);
        atomic_init(&p->slots[s].done_sleeping, 0);
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

void tdm_dp_pool_free(tdm_dp_pool *p)
{
    if (!p) return;
    /* release: pairs with the workers' acquire load of stop after their
     * go wait; the go store below wakes them. */
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    p->gen++;
    for (int s = 0; s < p->n_slots; s++)
        if (p->slots[s].started) tdm_dp_publish(&p->slots[s].go, &p->slots[s].go_sleeping, p->gen);
    for (int s = 0; s < p->n_slots; s++) {
        if (!p->slots[s].started) continue;
        int ret = pthread_join(p->slots[s].thread, NULL);
        if (ret != 0) TDM_WARN(DP, "thread pool: pthread_join slot %d: %s", s, strerror(ret));
    }
    free(p->slots);
    free(p);
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
    uint32_t gen = ++p->gen;
    for (int s = 0; s < p->n_slots; s++)
        if (s != p->caller_slot && (mask >> s & 1))
            tdm_dp_publish(&p->slots[s].go, &p->slots[s].go_sleeping, gen);
    if (mask >> p->caller_slot & 1) tdm_dp_pool_exec(p, p->caller_slot);
    for (int s = 0; s < p->n_slots; s++) {
        if (s == p->caller_slot || !(mask >> s & 1)) continue;
        tdm_dp_wait(&p->slots[s].done, &p->slots[s].done_sleeping, gen, 1, p->spin_ns, NULL, s);
    }
    for (int s = 0; s < p->n_slots; s++) {
        if (!(mask >> s & 1) || p->slots[s].status == TDM_STATUS_OK) continue;
        if (failed_slot) *failed_slot = s;
        tdm_error_copy_from(p->slots[s].msg);
        return p->slots[s].status;
    }
    return TDM_STATUS_OK;
}
