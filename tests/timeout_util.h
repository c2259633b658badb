/* tests/timeout_util.h: bounds in tests that must not fire on healthy
 * progress (header only, static functions, no Criterion: usable in forked
 * ranks and in MPI workers too).
 *
 * A test's time bounds are of two kinds:
 *  - a bound the test expects to fire (a rank that never joins, a stalled
 *    rank): it must not also bound a healthy phase before it (process
 *    start, set-up, a first collective), or a slow machine fires it there
 *    and the verdict names the wrong call or the wrong rank;
 *  - a bound that must not fire (a deadline on healthy ranks, the time a
 *    healthy rank needs to get somewhere): generous, and stretched by
 *    TANDEM_TEST_TIMEOUT_SCALE, which `make asan` sets to 4 and `make tsan`
 *    to 10, because sanitized ranks, several to a core on a 2-core CI
 *    machine, run several times slower than the plain build. A hang still
 *    ends, only later.
 * Where one bound is both (the deadline that fires also bounds the healthy
 * collectives before it), it is scaled: it then fires later, not wrongly. */
#ifndef TDM_TESTS_TIMEOUT_UTIL_H
#define TDM_TESTS_TIMEOUT_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* TANDEM_TEST_TIMEOUT_SCALE: 1 unless set to 2..20. */
static inline int tu_timeout_scale(void)
{
    const char *e = getenv("TANDEM_TEST_TIMEOUT_SCALE");
    int k = e ? atoi(e) : 1;
    return k > 1 && k <= 20 ? k : 1;
}

/* ms stretched by TANDEM_TEST_TIMEOUT_SCALE. */
static inline int tu_scaled_ms(int ms)
{
    return ms * tu_timeout_scale();
}

/* "NAME=<ms scaled>" into buf (for a child's environment or setenv). */
static inline const char *tu_scaled_env(char *buf, size_t n, const char *name, int ms)
{
    snprintf(buf, n, "%s=%d", name, tu_scaled_ms(ms));
    return buf;
}

#endif
