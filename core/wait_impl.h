/* core/wait_impl.h: one thread or process waiting for a counter that another
 * publishes: spin briefly, then sleep on a futex. dp/pool.c waits this way
 * between the threads of one process (a private futex), shm/wait.c between
 * processes that share a segment (a shared futex, the flag inside the
 * segment). This file is the mechanism and its memory-ordering contract;
 * the policy (how long to spin, when to yield, what ends a wait: deadline,
 * abort flag, a peer's death, a stop request) stays with each caller,
 * which composes tdm_wait_spin / tdm_wait_yield / tdm_wait_sleep.
 *
 * A flag is a free-running 64-bit counter written only by its owner;
 * waiters wait until it reaches a target (value >= target). Sleepers
 * futex-wait on its low 32 bits and count themselves in `waiters`, so that
 * the owner makes a wake syscall only when someone sleeps.
 *
 * Memory ordering, Dekker style between a publisher and a sleeper:
 *   publisher: store value (seq_cst)      ; load waiters (seq_cst)
 *   sleeper:   fetch_add waiters (seq_cst); load value (seq_cst); futex_wait
 * In the single total order of seq_cst operations, either the publisher's
 * waiters load sees the sleeper (and wakes it) or the sleeper's value load
 * sees the new value (and does not sleep). futex_wait also re-checks the
 * low 32 bits in the kernel, so a wake between the load and the sleep is
 * not lost. The value store is also the release that publishes the data
 * written before it; every waiter's load of the value is (at least)
 * acquire, so a waiter that sees the target sees that data.
 *
 * Linux-only (futex). Not a lock, not a queue: one owner per flag. Internal
 * (not installed): its flag is a C11 _Atomic layout inside shm's segment. */
#ifndef TDM_CORE_WAIT_IMPL_H
#define TDM_CORE_WAIT_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

/* Its layout is part of shm's segment (shm/shm_impl.h, TDM_SHM_VERSION):
 * change it only with that version. */
typedef struct tdm_wait_flag {
    _Atomic uint64_t value;
    _Atomic uint32_t waiters;
    uint32_t pad_;
} tdm_wait_flag;

/* Whether sleepers are threads of this process (a private futex, cheaper)
 * or other processes mapping the flag (a shared futex). */
typedef enum tdm_wait_scope {
    TDM_WAIT_PRIVATE = 0,
    TDM_WAIT_SHARED = 1,
} tdm_wait_scope;

static inline void tdm_wait_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* value >= target, with acquire: pairs with the seq_cst (release) store
 * in tdm_wait_publish. */
static inline int tdm_wait_reached(const tdm_wait_flag *f, uint64_t target)
{
    return atomic_load_explicit(&((tdm_wait_flag *)f)->value, memory_order_acquire) >= target;
}

/* Wakes every sleeper on f (a publish does this when there are any; an
 * abort that changes no value calls it directly). */
void tdm_wait_wake(tdm_wait_flag *f, tdm_wait_scope scope);

/* The owner sets the value: the seq_cst store publishes everything written
 * before it (pairs with the waiters' acquire loads) and is the publisher's
 * half of the Dekker pair with tdm_wait_sleep's fetch_add and load. */
static inline void tdm_wait_publish(tdm_wait_flag *f, uint64_t v, tdm_wait_scope scope)
{
    atomic_store_explicit(&f->value, v, memory_order_seq_cst);
    if (atomic_load_explicit(&f->waiters, memory_order_seq_cst) != 0) tdm_wait_wake(f, scope);
}

/* Spins (a pause instruction between loads) until f reaches target
 * (returns 1) or spin_ns have passed since t0 (tdm_time_ns(); returns 0).
 * The clock is read every 64 loads. Once yield_after_ns have passed, each
 * clock read is followed by a sched_yield, which costs little while the
 * core is ours alone and lets the publisher run when it shares our core
 * (UINT64_MAX: never yield). */
int tdm_wait_spin(const tdm_wait_flag *f, uint64_t target, uint64_t t0, uint64_t spin_ns,
                  uint64_t yield_after_ns);

/* sched_yield up to n times, checking f after each: for waiters that must
 * not spin (more threads than cores) but may give the publisher a chance
 * to run before paying for a sleep. Returns 1 when f reached target. */
int tdm_wait_yield(const tdm_wait_flag *f, uint64_t target, int n);

/* One sleep of at most nap_ns: the sleeper's half of the Dekker pair
 * (register in waiters, re-check the value, futex_wait). Returns 1 when f
 * has reached target afterwards, 0 otherwise (woken for another value, a
 * signal, or the nap ended); *timed_out (may be NULL) is 1 when the sleep
 * ended by its timeout, which together with a return of 1 is a publish
 * whose wake-up never came. Callers loop, checking their own ends of the
 * wait between sleeps. */
int tdm_wait_sleep(tdm_wait_flag *f, uint64_t target, uint64_t nap_ns, tdm_wait_scope scope,
                   int *timed_out);

#endif
