/* core/wait.c: the spin, yield and futex sleep of core/wait_impl.h (see there
 * for the memory-ordering pairing). Not a waiting policy: dp/pool.c and
 * shm/wait.c decide how long to spin and what ends a wait. */
#include "core/wait_impl.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/timer.h"

/* The futex word: the low 32 bits of the 64-bit value, which sit first in
 * memory on a little-endian machine and last on a big-endian one. */
static uint32_t *tdm_wait_word(tdm_wait_flag *f)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)&f->value + 1;
#else
    return (uint32_t *)&f->value;
#endif
}

void tdm_wait_wake(tdm_wait_flag *f, tdm_wait_scope scope)
{
    int op = scope == TDM_WAIT_SHARED ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE;
    (void)syscall(SYS_futex, tdm_wait_word(f), op, INT_MAX, NULL, NULL, 0);
}

int tdm_wait_spin(const tdm_wait_flag *f, uint64_t target, uint64_t t0, uint64_t spin_ns,
                  uint64_t yield_after_ns)
{
    for (unsigned i = 1;; i++) {
        if (tdm_wait_reached(f, target)) return 1;
        if ((i & 63) == 0) {
            /* reading the clock costs ~20 ns: every 64 loads is enough */
            uint64_t dt = tdm_time_ns() - t0;
            if (dt >= spin_ns) return 0;
            if (dt >= yield_after_ns) sched_yield();
        } else {
            tdm_wait_cpu_relax();
        }
    }
}

int tdm_wait_yield(const tdm_wait_flag *f, uint64_t target, int n)
{
    for (int i = 0; i < n; i++) {
        sched_yield();
        if (tdm_wait_reached(f, target)) return 1;
    }
    return 0;
}

int tdm_wait_sleep(tdm_wait_flag *f, uint64_t target, uint64_t nap_ns, tdm_wait_scope scope,
                   int *timed_out)
{
    if (timed_out) *timed_out = 0;
    /* The sleeper's half of the Dekker pair (core/wait_impl.h): register, then
     * load the value, both seq_cst, against the publisher's store, then
     * load of waiters. */
    atomic_fetch_add_explicit(&f->waiters, 1, memory_order_seq_cst);
    uint64_t v = atomic_load_explicit(&f->value, memory_order_seq_cst);
    if (v >= target) {
        atomic_fetch_sub_explicit(&f->waiters, 1, memory_order_relaxed);
        return 1;
    }
    struct timespec ts = {.tv_sec = (time_t)(nap_ns / 1000000000ull),
                          .tv_nsec = (long)(nap_ns % 1000000000ull)};
    int op = scope == TDM_WAIT_SHARED ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE;
    /* EINTR, EAGAIN (the word already changed) and ETIMEDOUT all mean:
     * look again, below and in the caller's loop. */
    long r = syscall(SYS_futex, tdm_wait_word(f), op, (uint32_t)v, &ts, NULL, 0);
    int to = r == -1 && errno == ETIMEDOUT;
    atomic_fetch_sub_explicit(&f->waiters, 1, memory_order_relaxed);
    if (timed_out) *timed_out = to;
    return tdm_wait_reached(f, target);
}
