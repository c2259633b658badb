/* dp/pool.h: the DataParallel thread pool: one persistent thread per
 * device slot, created once, that runs one function on a chosen set of
 * slots at once and joins (a fork/join "round"). dp/dp.c builds
 * replicate, scatter, parallel_apply, gather and the reduce on it.
 *
 * The calling thread runs one slot itself (caller_slot: in DP, the output
 * device that holds the master model) instead of idling while the workers
 * compute: with n devices the process then has exactly n compute threads,
 * so DP(2) on a 2-core machine fills both cores and nothing sleeps on the
 * critical path; the caller is also the thread that runs the loss and the
 * optimizer on that device between rounds, so it stays its device's
 * thread throughout the step.
 *
 * Waits (worker waiting for work, caller waiting for workers) spin
 * briefly with a pause instruction and then sleep on a futex; they do not
 * spin at all when the pool has more threads than the machine has cores
 * (a spinner would steal the core of a thread that is doing the work).
 * Waking a sleeping thread costs tens of microseconds; a spinning one
 * notices a flag in well under a microsecond.
 *
 * Not a general task scheduler: no queues, no work stealing, one round at
 * a time, driven by one thread (the pool is not safe to drive from two
 * threads at once). Linux-only (futex). */
#ifndef TDM_DP_POOL_H
#define TDM_DP_POOL_H

#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* At most 64 slots: a round's active set is a 64-bit mask. */
#define TDM_DP_POOL_MAX_SLOTS 64

typedef struct tdm_dp_pool tdm_dp_pool;

/* Runs on slot `slot`'s thread; returns a status and leaves a message in
 * that thread's error buffer on failure (the pool copies it over). */
typedef tdm_status (*tdm_dp_pool_fn)(void *ctx, int slot);

/* n_slots threads' worth of work, 1..TDM_DP_POOL_MAX_SLOTS; caller_slot in
 * [0, n_slots) is run inline by the caller, the others get a thread each.
 * spin_us: microseconds a wait spins before it sleeps; < 0 chooses
 * (50 us when n_slots <= tdm_device_host_cores(), else 0). */
tdm_status tdm_dp_pool_init(tdm_dp_pool **out, int n_slots, int caller_slot, int spin_us);
/* Stops and joins the workers. NULL is a no-op. */
void tdm_dp_pool_free(tdm_dp_pool *p);

int tdm_dp_pool_n_slots(const tdm_dp_pool *p);
int tdm_dp_pool_spin_us(const tdm_dp_pool *p);

/* Runs fn(ctx, i) for every slot i whose bit is set in mask, at once, and
 * returns when all of them have returned. If any failed, returns the
 * status of the lowest failing slot with that slot's message copied into
 * the caller's error buffer, and sets *failed_slot (may be NULL) to it
 * (-1 when all succeeded). The pool is usable again afterwards.
 * Happens-before: everything the caller did before the call is visible to
 * every fn, and everything every fn did is visible to the caller after. */
tdm_status tdm_dp_pool_run(tdm_dp_pool *p, uint64_t mask, tdm_dp_pool_fn fn, void *ctx,
                           int *failed_slot);

/* Milliseconds slot i spent inside fn during the last round it ran in. */
double tdm_dp_pool_slot_ms(const tdm_dp_pool *p, int slot);
/* Process-wide count of waits whose wake-up never came (they ended at the
 * 200 ms sleep slice instead): 0 unless the publish/sleep pairing is
 * broken, or, rarely, a publish lands in the instant a full slice ends
 * (only possible in a wait already 200 ms long). */
uint64_t tdm_dp_pool_lost_wakeups(void);

#ifdef __cplusplus
}
#endif

#endif
