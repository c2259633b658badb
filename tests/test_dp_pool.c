/* tests/test_dp_pool.c: the DataParallel thread pool (dp/pool.c) on its
 * own, without models: no lost wake-ups over many back-to-back rounds
 * (spinning and sleeping waits, fewer and more threads than cores, rounds
 * that skip slots), errors from any slot with the pool usable afterwards,
 * and the join: a round returns only when every slot has returned. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "dp/pool.h"
#include "core/device.h"

typedef struct count_ctx {
    long calls[TDM_DP_POOL_MAX_SLOTS];   /* each touched by its slot's thread only */
    int fail_slot;                       /* -1: none */
    int fail_slot2;
    int sleep_others_ms;
    _Atomic int finished;                /* slots that reached the end of fn */
} count_ctx;

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static tdm_status count_fn(void *ctx, int slot)
{
    count_ctx *c = ctx;
    c->calls[slot]++;
    if (slot == c->fail_slot || slot == c->fail_slot2) {
        atomic_fetch_add(&c->finished, 1);
        return tdm_error_set(TDM_STATUS_IO, "slot %d failed on purpose", slot);
    }
    if (c->sleep_others_ms) sleep_ms(c->sleep_others_ms);
    atomic_fetch_add(&c->finished, 1);
    return TDM_STATUS_OK;
}

/* rounds back-to-back; every slot's count must equal the rounds it was in */
static void run_many(int n_slots, int caller_slot, int spin_us, int rounds, int random_masks)
{
    tdm_dp_pool *p;
    uint64_t lost0 = tdm_dp_pool_lost_wakeups();
    cr_assert_eq(tdm_dp_pool_init(&p, n_slots, caller_slot, spin_us), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    count_ctx c = {.fail_slot = -1, .fail_slot2 = -1};
    long expect[TDM_DP_POOL_MAX_SLOTS] = {0};
    uint64_t x = 88172645463325252ull;
    for (int r = 0; r < rounds; r++) {
        uint64_t mask = ~UINT64_C(0);
        if (random_masks) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;   /* xorshift64 */
            mask = x;
        }
        for (int s = 0; s < n_slots; s++) expect[s] += mask >> s & 1;
        int failed = 7;
        cr_assert_eq(tdm_dp_pool_run(p, mask, count_fn, &c, &failed), TDM_STATUS_OK);
        cr_assert_eq(failed, -1);
    }
    for (int s = 0; s < n_slots; s++)
        cr_assert_eq(c.calls[s], expect[s], "slot %d ran %ld times, expected %ld (n=%d spin=%d)",
                     s, c.calls[s], expect[s], n_slots, spin_us);
    tdm_dp_pool_free(p);
    /* a lost wake-up only costs a sleep slice, so count them */
    cr_assert_eq(tdm_dp_pool_lost_wakeups(), lost0, "%llu lost wake-ups (n=%d spin=%d)",
                 (unsigned long long)(tdm_dp_pool_lost_wakeups() - lost0), n_slots, spin_us);
}

Test(dp_pool, many_rounds_spinning)
{
    run_many(2, 0, 50, 20000, 0);
}

Test(dp_pool, many_rounds_sleeping)
{
    /* spin 0: every wait goes through the futex, the path taken when
     * threads outnumber cores */
    run_many(3, 0, 0, 5000, 0);
}

Test(dp_pool, many_rounds_oversubscribed_auto)
{
    /* 6 threads on this machine's cores: auto chooses no spin when they
     * outnumber the cores */
    run_many(6, 2, -1, 3000, 0);
}

Test(dp_pool, many_rounds_random_masks)
{
    run_many(4, 1, 20, 5000, 1);
    run_many(4, 3, 0, 2000, 1);
}

Test(dp_pool, auto_spin_follows_cores)
{
    tdm_dp_pool *p;
    cr_assert_eq(tdm_dp_pool_init(&p, 64, 0, -1), TDM_STATUS_OK);
    if (tdm_device_host_cores() < 64)
        cr_assert_eq(tdm_dp_pool_spin_us(p), 0, "64 threads must not spin on %d cores",
                     tdm_device_host_cores());
    else
        cr_assert_gt(tdm_dp_pool_spin_us(p), 0, "64 threads fit %d cores: spin",
                     tdm_device_host_cores());
    tdm_dp_pool_free(p);
    cr_assert_eq(tdm_dp_pool_init(&p, 1, 0, -1), TDM_STATUS_OK);
    cr_assert_gt(tdm_dp_pool_spin_us(p), 0, "one thread fits any machine: spin");
    tdm_dp_pool_free(p);
}

Test(dp_pool, error_after_all_stopped_then_usable)
{
    tdm_dp_pool *p;
    cr_assert_eq(tdm_dp_pool_init(&p, 4, 0, -1), TDM_STATUS_OK);
    count_ctx c = {.fail_slot = 2, .fail_slot2 = -1, .sleep_others_ms = 30};
    int failed = -1;
    tdm_error_clear();
    tdm_status st = tdm_dp_pool_run(p, ~UINT64_C(0), count_fn, &c, &failed);
    cr_assert_eq(st, TDM_STATUS_IO);
    cr_assert_eq(failed, 2);
    cr_assert_str_eq(tdm_error_message(), "slot 2 failed on purpose");
    /* the failing slot returned at once, the others slept 30 ms: the round
     * must still have waited for every one of them */
    cr_assert_eq(atomic_load(&c.finished), 4);

    /* the lowest failing slot wins, including the caller's own */
    c = (count_ctx){.fail_slot = 3, .fail_slot2 = 0};
    atomic_init(&c.finished, 0);
    st = tdm_dp_pool_run(p, ~UINT64_C(0), count_fn, &c, &failed);
    cr_assert_eq(st, TDM_STATUS_IO);
    cr_assert_eq(failed, 0);
    cr_assert_str_eq(tdm_error_message(), "slot 0 failed on purpose");

    /* and the pool runs the next round fine */
    c = (count_ctx){.fail_slot = -1, .fail_slot2 = -1};
    atomic_init(&c.finished, 0);
    cr_assert_eq(tdm_dp_pool_run(p, ~UINT64_C(0), count_fn, &c, &failed), TDM_STATUS_OK);
    cr_assert_eq(failed, -1);
    for (int s = 0; s < 4; s++) cr_assert_eq(c.calls[s], 1);
    tdm_dp_pool_free(p);
}

Test(dp_pool, bad_arguments)
{
    tdm_dp_pool *p = (tdm_dp_pool *)1;
    cr_assert_eq(tdm_dp_pool_init(&p, 0, 0, -1), TDM_STATUS_INVALID_ARG);
    cr_assert_null(p);
    cr_assert_eq(tdm_dp_pool_init(&p, 65, 0, -1), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_dp_pool_init(&p, 2, 2, -1), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "caller slot 2"));
    tdm_dp_pool_free(NULL);
}

Test(dp_pool, free_without_rounds)
{
    for (int i = 0; i < 20; i++) {
        tdm_dp_pool *p;
        cr_assert_eq(tdm_dp_pool_init(&p, 3, i % 3, i % 2 ? 0 : 30), TDM_STATUS_OK);
        tdm_dp_pool_free(p);
    }
}
