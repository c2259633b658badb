/* tests/test_shm_live.c: what ranks and their parent say when a rank is
 * gone, stopped or busy, and who the failure summary blames: a rank that
 * exits 0 disturbs only ranks that wait for it; one that fails after
 * freeing its communicator is reported with its status; a stopped rank is
 * named by its missing heartbeat within seconds, a busy one is waited for;
 * a raiser killed mid-abort leaves a reason; the parent's summary names the
 * root cause by the rule of shm/spawn.h. Deaths, deadlines, mismatches and
 * the segment are in test_shm_fail.c. Each test bounds its time. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/timer.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/timeout_util.h"

/* --- a peer that leaves after a completed collective ------------------------ */

/* Rank 1 publishes its part of an all_gather and waits for rank 0's;
 * rank 0 arrives late, completes the all_gather (rank 1's part was
 * there), and exits with an error; its parent raises the group abort.
 * Rank 1 held its failure checks until then (the test hook: as a rank
 * descheduled after its spin on a loaded machine) - yet rank 0's part is
 * there, so its all_gather is complete and must succeed with the data
 * (it failed with "all_gather #0: rank 0 ... exited with code 1"). Seen
 * in DDP: ranks 0 and 1 found a layout mismatch after an all_gather and
 * exited; rank 2, still reading that all_gather, reported the exit
 * instead of the mismatch. */
typedef struct {
    _Atomic int status[2];
    int32_t got[2][2];
} late_shared;

static int late_checks_rank(tdm_comm *comm, void *arg)
{
    late_shared *sh = arg;
    int r = tdm_comm_rank(comm);
    if (r == 0) usleep(300 * 1000);   /* rank 1 waits for this rank: spin, then the hook */
    int32_t mine = 10 + r;
    tdm_status st = tdm_comm_all_gather(comm, &mine, sh->got[r], 1, TDM_DTYPE_INT32);
    atomic_store(&sh->status[r], st == TDM_STATUS_OK ? 1 : 2);
    if (st) fprintf(stderr, "rank %d: %s\n", r, tdm_error_message());
    return r == 0 ? 1 : (st ? 2 : 0);   /* rank 0 leaves with an error once done */
}

Test(shm_live, a_wait_whose_data_came_ignores_a_peer_that_left_after, .timeout = 60)
{
    late_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                           -1, 0);
    cr_assert(sh != MAP_FAILED);
    memset(sh, 0, sizeof *sh);
    setenv("TANDEM_SHM_TEST_LATE_CHECKS", "1", 1);
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = tu_scaled_ms(30000)},
                            .timeout_ms = tu_scaled_ms(30000), .grace_ms = tu_scaled_ms(10000)};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(2, late_checks_rank, sh, &o, &res);
    cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    cr_expect(strstr(tdm_error_message(), "rank 0 (pid"), "%s", tdm_error_message());
    cr_assert_eq(atomic_load(&sh->status[0]), 1, "rank 0's all_gather failed");
    cr_assert_eq(atomic_load(&sh->status[1]), 1, "rank 1's all_gather failed although rank 0's "
                 "part had come");
    cr_expect_eq(sh->got[1][0], 10);
    cr_expect_eq(sh->got[1][1], 11);
    cr_expect(WIFEXITED(res.wstatus[1]) && WEXITSTATUS(res.wstatus[1]) == 0);
    munmap(sh, sizeof *sh);
}

/* --- gone after arriving ------------------------------------------------- */

/* Rank 0 waits in a barrier for rank 1, which comes late, then frees its
 * communicator and exits 0. Rank 0's liveness check is paused (the test
 * hook) just before it looks for signs that rank 1 is gone, until the
 * parent has reported rank 1 ended, as a rank descheduled there on a
 * loaded machine would be. Rank 1 did its part: the barrier succeeds.
 * (Seen in CI: "rank 0 exited with code 0 before barrier #63 without
 * freeing its communicator" from a rank that had done both.) */
static int gone_after_arriving_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    if (r == 1) usleep(300 * 1000);
    tdm_status st = tdm_comm_barrier(comm);
    if (st) fprintf(stderr, "rank %d: %s\n", r, tdm_error_message());
    return st ? 1 : 0;
}

Test(shm_live, a_peer_gone_after_arriving_has_done_its_part, .timeout = 90)
{
    shm_t_adopt_orphans();
    setenv("TANDEM_SHM_TEST_GONE_PAUSE", "0", 1);
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = tu_scaled_ms(30000), .no_spin = 1},
                            .timeout_ms = tu_scaled_ms(40000)};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(2, gone_after_arriving_rank, NULL, &o, &res);
    unsetenv("TANDEM_SHM_TEST_GONE_PAUSE");
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    for (int r = 0; r < 2; r++)
        cr_expect(WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 0,
                  "rank %d: status 0x%x", r, res.wstatus[r]);
    cr_expect_eq(shm_t_segments_held(), 0, "a segment was left held");
}

/* --- gone: exit 0, free then fail ------------------------------------------ */

/* A rank that exits 0 without freeing its communicator has done nothing
 * wrong to ranks that never wait for it: two others keep talking
 * point-to-point (slowly, so that their waits sleep and check liveness).
 * Only a call that needs it fails, naming it and how it ended. */
static int exit0_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    if (tdm_comm_barrier(comm)) return 100;
    if (r == 2) _exit(0);   /* no tdm_comm_free */
    for (int i = 0; i < 8; i++) {
        int32_t v = i;
        tdm_status st;
        if (r == 0) {
            usleep(150 * 1000);
            st = tdm_comm_send(comm, &v, 1, TDM_DTYPE_INT32, 1);
        } else {
            st = tdm_comm_recv(comm, &v, 1, TDM_DTYPE_INT32, 0);
        }
        if (st) {
            fprintf(stderr, "rank %d: message %d: %s\n", r, i, tdm_error_message());
            return 101;
        }
    }
    int32_t x = 1;
    tdm_status st = tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    fprintf(stderr, "rank %d: %s\n", r, tdm_error_message());
    if (st != TDM_STATUS_PEER_FAILED) return 102;
    if (!strstr(tdm_error_message(), "rank 2 (pid")) return 103;
    if (!strstr(tdm_error_message(), "exited with code 0")) return 104;
    return 0;
}

Test(shm_live, rank_exiting_0_does_not_stop_unrelated_ranks, .timeout = 30)
{
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000, .no_spin = 1}, .timeout_ms = 25000};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(3, exit0_rank, NULL, &o, &res);
    cr_expect_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    for (int r = 0; r < 3; r++)
        cr_expect(WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 0,
                  "rank %d: status 0x%x", r, res.wstatus[r]);
}

/* The failure summary when a rank exits 0 mid-job: the ranks that needed
 * it fail (exit 1) naming it; the summary names it too, in their words,
 * not the first survivor that exited 1. */
static int exit0_midjob_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    int32_t x = 1;
    if (tdm_comm_barrier(comm)) return 140;
    if (r == 2) _exit(0);
    tdm_status st = tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    return st == TDM_STATUS_OK ? 0 : 1;
}

Test(shm_live, summary_names_a_rank_that_exited_0_mid_job, .timeout = 30)
{
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000}, .timeout_ms = 25000};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(3, exit0_midjob_rank, NULL, &o, &res);
    cr_expect_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    cr_expect(strstr(tdm_error_message(), "rank 2 (pid"), "%s", tdm_error_message());
    cr_expect(strstr(tdm_error_message(), "exited with code 0 before all_reduce #1"), "%s",
              tdm_error_message());
}

/* Rank 0 fails on its own and says why (as `tandem train` does when its
 * checkpoint cannot be written); the others fail because of it, and may
 * be reaped first. Every run names rank 0, in its own words. */
static int says_why_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    int32_t x = 1;
    if (tdm_comm_barrier(comm)) return 150;
    if (r == 0) {
        usleep(50 * 1000);
        tdm_comm_abort(comm, "saving checkpoint: No space left on device");
        usleep(100 * 1000);   /* the others exit first */
        return 1;
    }
    tdm_status st = tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    return st == TDM_STATUS_OK ? 0 : 1;
}

Test(shm_live, summary_names_the_rank_that_failed_first_in_its_words, .timeout = 60)
{
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000}, .timeout_ms = 25000};
    for (int i = 0; i < 3; i++) {
        tdm_status st = tdm_shm_spawn(4, says_why_rank, NULL, &o, NULL);
        cr_expect_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
        cr_expect(strstr(tdm_error_message(), "rank 0 (pid"), "run %d: %s", i,
                  tdm_error_message());
        cr_expect(strstr(tdm_error_message(), "exited with code 1: aborted by rank 0: saving "
                         "checkpoint: No space left on device"), "run %d: %s", i,
                  tdm_error_message());
    }
}

/* A rank that frees its communicator and then fails (here: its function
 * returns 7; tdm_shm_spawn frees the communicator, then exits 7) is
 * reported to the rank waiting for it with its exit status. */
static int free_then_fail_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    if (tdm_comm_barrier(comm)) return 110;
    if (r == 1) return 7;
    int32_t x = 1;
    tdm_status st = tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    fprintf(stderr, "rank %d: %s\n", r, tdm_error_message());
    if (st != TDM_STATUS_PEER_FAILED) return 111;
    if (!strstr(tdm_error_message(), "rank 1 (pid")) return 112;
    if (!strstr(tdm_error_message(), "exited with code 7")) return 113;
    return 0;
}

Test(shm_live, rank_failing_after_free_is_reported_with_its_status, .timeout = 30)
{
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000}, .timeout_ms = 25000};
    tdm_shm_spawn_result res;
    for (int world = 2; world <= 3; world++) {
        tdm_status st = tdm_shm_spawn(world, free_then_fail_rank, NULL, &o, &res);
        cr_expect_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
        cr_expect(strstr(tdm_error_message(), "exited with code 7"), "%s", tdm_error_message());
        for (int r = 0; r < world; r += 2)
            cr_expect(WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 0,
                      "%d ranks: rank %d: status 0x%x", world, r, res.wstatus[r]);
    }
}

/* --- a stopped rank: the heartbeat names it -------------------------------
 * Each rank's heartbeat thread advances a counter that does not depend on
 * what the rank's own threads do: a process stopped by SIGSTOP (or a
 * debugger) stops it, a busy one does not. Waits use it to tell the two
 * apart long before the collective deadline. */

static void *stop_self_later(void *arg)
{
    (void)arg;
    usleep(200 * 1000);
    kill(getpid(), SIGSTOP);   /* the whole process, mid-collective */
    return NULL;
}

static int stopped_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    static float buf[1 << 18];   /* 1 MiB: several rounds per all_reduce */
    pthread_t t;
    if (r == 1 && pthread_create(&t, NULL, stop_self_later, NULL)) return 120;
    uint64_t t0 = tdm_time_ns();
    for (int it = 0;; it++) {
        tdm_status st = tdm_comm_all_reduce(comm, buf, buf, 1 << 18, TDM_DTYPE_FLOAT32,
                                            TDM_REDOP_SUM);
        if (st == TDM_STATUS_OK) continue;
        const char *m = tdm_error_message();
        fprintf(stderr, "rank %d after %.0f ms: %s\n", r, tdm_time_ms_since(t0), m);
        if (!strstr(m, "rank 1 (pid")) return 121;
        if (!strstr(m, "is stopped")) return 122;      /* not "timed out" */
        if (!strstr(m, "no heartbeat for")) return 123;
        return 42;   /* right: fail as a rank would, so that the parent stops rank 1 */
    }
}

Test(shm_live, stopped_rank_is_named_by_its_heartbeat, .timeout = 60)
{
    /* a 40 s deadline: a "timed out" answer would come far too late for
     * the test's bound, and says the wrong thing */
    /* the grace: both survivors must see the stop and exit 42 on their own
     * before the teardown signals them (1 s could cut one off, as in
     * tests/fr_test_util.h) */
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 40000, .stall_ms = tu_scaled_ms(2000)},
                            .timeout_ms = 45000, .grace_ms = tu_scaled_ms(3000)};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(3, stopped_rank, NULL, &o, &res);
    cr_expect_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    /* the summary: rank 1, stopped; not the SIGKILL of the clean-up, and
     * not the survivors' exits */
    cr_expect(strstr(tdm_error_message(), "rank 1 (pid"), "%s", tdm_error_message());
    cr_expect(strstr(tdm_error_message(), "is stopped"), "%s", tdm_error_message());
    cr_expect(!strstr(tdm_error_message(), "signal 9"), "%s", tdm_error_message());
    cr_expect(WIFSIGNALED(res.wstatus[1]) && WTERMSIG(res.wstatus[1]) == SIGKILL);
    for (int r = 0; r < 3; r += 2)
        cr_expect(WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 42,
                  "rank %d: status 0x%x", r, res.wstatus[r]);
    cr_expect(res.elapsed_ms < 30000, "%.0f ms", res.elapsed_ms);
}

/* A rank busy outside any collective for longer than the heartbeat bound
 * (but less than the deadline) is alive: it is waited for. One busy for
 * longer than the deadline is reported as alive but late, not stopped. */
static int busy_rank(tdm_comm *comm, void *arg)
{
    int busy_ms = *(const int *)arg;
    int r = tdm_comm_rank(comm);
    int32_t x = 1;
    if (tdm_comm_barrier(comm)) return 130;
    if (r == 1) {
        volatile uint64_t sink = 0;
        uint64_t t0 = tdm_time_ns();
        while (tdm_time_ms_since(t0) < busy_ms) sink += 1;   /* computing, not waiting */
    }
    tdm_status st = tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    if (st == TDM_STATUS_OK) return x == 3 ? 0 : 131;
    fprintf(stderr, "rank %d: %s\n", r, tdm_error_message());
    if (r == 1) return 0;   /* it learns of the others' timeout */
    if (st != TDM_STATUS_TIMEOUT) return 132;
    if (!strstr(tdm_error_message(), "waiting for rank 1")) return 133;
    if (!strstr(tdm_error_message(), "alive")) return 134;
    return 0;
}

/* The stall bound must not fire on the busy rank (nor on the others, whose
 * heartbeat threads a loaded machine may leave unscheduled for a while),
 * and the deadline of the second run, meant to fire on rank 1, bounds the
 * first barrier too: both are stretched under the sanitizers, and rank 1
 * stays busy 2.5 s past them. */
Test(shm_live, busy_rank_is_waited_for_and_named_alive_at_the_deadline, .timeout = 90)
{
    int bound_ms = tu_scaled_ms(1500);
    int busy_ms = bound_ms + 2500;   /* > stall_ms, < timeout_ms: success */
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000, .stall_ms = bound_ms},
                            .timeout_ms = 40000};
    tdm_status st = tdm_shm_spawn(3, busy_rank, &busy_ms, &o, NULL);
    cr_expect_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());

    o.shm.timeout_ms = bound_ms;   /* < busy_ms: the deadline, naming it alive */
    st = tdm_shm_spawn(3, busy_rank, &busy_ms, &o, NULL);
    cr_expect_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
}

/* --- abort publication ----------------------------------------------------- */

/* A rank killed in the middle of raising the abort (after it would have
 * claimed the word, before the reason was out) must not leave the group
 * claimed and silent: a watchdog polling tdm_shm_comm_abort_reason (the
 * NCCL communicator's) still sees a reason naming it. The hook makes
 * rank 1 die at that point. */
static int die_in_raise_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    if (tdm_comm_barrier(comm)) return 90;
    if (r == 1) {
        setenv("TANDEM_SHM_TEST_DIE_IN_RAISE", "1", 1);
        tdm_comm_abort(comm, "never published");
        return 91;   /* not reached: the hook killed us */
    }
    if (r == 0) {
        int32_t x = 1;
        tdm_status st = tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM);
        fprintf(stderr, "rank 0: %s\n", tdm_error_message());
        if (st == TDM_STATUS_OK || !strstr(tdm_error_message(), "rank 1")) return 92;
    }
    /* rank 2 only watches, as the NCCL watchdog does (rank 0 too, after) */
    const char *why = NULL;
    uint64_t t0 = tdm_time_ns();
    while (!(why = tdm_shm_comm_abort_reason(comm)) && tdm_time_ms_since(t0) < 8000)
        usleep(10 * 1000);
    fprintf(stderr, "rank %d: abort reason after %.0f ms: %s\n", r, tdm_time_ms_since(t0),
            why ? why : "(none)");
    if (!why) return 93;
    if (!strstr(why, "rank 1 (pid")) return 94;
    return 0;
}

Test(shm_live, raiser_dying_mid_abort_leaves_a_reason, .timeout = 30)
{
    tdm_shm_spawn_opts o = {.shm = {.timeout_ms = 20000}, .timeout_ms = 25000,
                            .grace_ms = 12000};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(3, die_in_raise_rank, NULL, &o, &res);
    cr_expect_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
    cr_expect(strstr(tdm_error_message(), "rank 1 (pid"), "%s", tdm_error_message());
    cr_expect(WIFSIGNALED(res.wstatus[1]) && WTERMSIG(res.wstatus[1]) == SIGKILL,
              "rank 1: 0x%x", res.wstatus[1]);
    for (int r = 0; r < 3; r += 2)
        cr_expect(WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 0,
                  "rank %d: status 0x%x", r, res.wstatus[r]);
}
