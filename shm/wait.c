/* shm/wait.c: how ranks wait for each other: publish a counter, wait for
 * a peer's counter to reach a target (spin briefly, then yield, then sleep
 * on a shared futex), and the failure paths of every wait: the group
 * abort (raised in one step), a dead, departed or stopped peer (liveness
 * from the parent's reports, /proc and each rank's heartbeat thread),
 * deadline.
 * Not the collectives (shm/coll.c) and not the segment (shm/segment.c);
 * the spin, yield and futex sleep themselves, and their memory-ordering
 * pairing (publisher: store value, load waiters; sleeper: fetch_add
 * waiters, load value, futex_wait; all seq_cst), are core/wait_impl.h's, with
 * a shared futex: sleepers are other processes. */
#include "shm/shm_impl.h"
#include "shm/spawn.h"

#include <errno.h>
#include <stdlib.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/proc.h"
#include "core/timer.h"
#include "core/wait_impl.h"

#define TDM_SHM_SLEEP_NS (100ull * 1000 * 1000)   /* liveness check period */
#define TDM_SHM_YIELDS 16
#define TDM_SHM_PURE_SPIN_NS (5u * 1000)

static char *tdm_shm_reason_slot(const tdm_shm_geom *g, const uint8_t *base, int slot)
{
    return (char *)(base + g->reason_off + (size_t)slot * TDM_SHM_REASON_BYTES);
}

int tdm_shm_abort_get(const tdm_shm_header *h, const tdm_shm_geom *g, const uint8_t *base,
                      tdm_shm_abort_info *out)
{
    /* Acquire pairs with the release CAS in tdm_shm_raise: the reason in
     * the slot the word names was written before the word. */
    uint64_t w = atomic_load_explicit(&((tdm_shm_header *)h)->abort_word, memory_order_acquire);
    if (!w) return 0;
    int slot = (int)((w >> 16) & 0xff) - 1, culprit = (int)((w >> 24) & 0xff) - 1;
    tdm_status st = (tdm_status)(w & 0xffff);
    /* The word is in shared memory: decode it defensively. */
    if (st <= TDM_STATUS_OK || st >= TDM_STATUS_COUNT_) st = TDM_STATUS_ABORTED;
    out->status = st;
    out->raiser = slot >= 0 && slot < g->world ? slot : -1;
    out->culprit = culprit >= 0 && culprit < g->world ? culprit : -1;
    out->reason = slot >= 0 && slot <= g->world ? tdm_shm_reason_slot(g, base, slot)
                                                : "(unreadable abort word)";
    return 1;
}

void tdm_shm_raise(tdm_shm_header *h, const tdm_shm_geom *g, uint8_t *base, int slot,
                   _Atomic int *raising, int culprit, tdm_status st, const char *fmt, ...)
{
    /* One writer of this process's slot at a time (a rank's own thread and
     * its progress thread may both fail at once). The loser waits for the
     * word, which the winner is about to publish, so that its caller's
     * tdm_shm_check_abort sees a status. */
    int idle = 0;
    if (atomic_load(&h->abort_word) || !atomic_compare_exchange_strong(raising, &idle, 1)) {
        uint64_t t0 = tdm_time_ns();
        while (!atomic_load_explicit(&h->abort_word, memory_order_acquire) &&
               tdm_time_ns() - t0 < 1000000000ull) {
            struct timespec ts = {.tv_nsec = 1000000};
            nanosleep(&ts, NULL);
        }
        return;
    }
    /* The slot is ours and unpublished while the word is 0: a published
     * slot is never written again, because the word never returns to 0. */
    char *reason = tdm_shm_reason_slot(g, base, slot);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, TDM_SHM_REASON_BYTES, fmt, ap);
    va_end(ap);
    /* Test hook (tests/test_shm_fail.c): die between writing the reason
     * and publishing it, where a raiser killed at the worst moment would. */
    const char *die = getenv("TANDEM_SHM_TEST_DIE_IN_RAISE");
    if (die && *die == '1') raise(SIGKILL);
    uint64_t none = 0;
    /* Release pairs with the acquire load in tdm_shm_abort_get. */
    int won = atomic_compare_exchange_strong_explicit(
        &h->abort_word, &none, TDM_SHM_ABORT_WORD(st, slot, culprit), memory_order_acq_rel,
        memory_order_acquire);
    atomic_store(raising, 0);
    if (!won) return;
    for (int r = 0; r < g->world; r++)
        tdm_wait_wake(&tdm_shm_geom_ctrl(g, base, r)->flag, TDM_WAIT_SHARED);
    TDM_INFO(SHM, "group abort raised: %s", reason);
}

tdm_status tdm_shm_check_abort(tdm_shm_impl *c)
{
    tdm_shm_abort_info a;
    if (tdm_shm_abort_get(c->hdr, &c->geom, c->base, &a)) {
        c->failed = a.status;
        /* bounded: the slot is shared memory, its terminator not guaranteed */
        return tdm_error_set(a.status, "%s #%llu: %.*s; stopping", c->cur_name,
                             (unsigned long long)c->cur_seq, TDM_SHM_REASON_BYTES - 1, a.reason);
    }
    /* a split communicator stops with the job: its ranks are numbered
     * there by job rank */
    const tdm_shm_impl *r = c->root;
    if (!r || !tdm_shm_abort_get(r->hdr, &r->geom, r->base, &a)) return TDM_STATUS_OK;
    c->failed = a.status;
    return tdm_error_set(a.status, "%s #%llu: the job was aborted (ranks by job rank): %.*s; "
                         "stopping", c->cur_name, (unsigned long long)c->cur_seq,
                         TDM_SHM_REASON_BYTES - 1, a.reason);
}

const char *tdm_shm_comm_abort_reason(const tdm_comm *comm)
{
    if (!comm || strcmp(tdm_comm_backend_name(comm), "shm") != 0) return NULL;
    const tdm_shm_impl *c = tdm_comm_impl(comm);
    tdm_shm_abort_info a;
    return tdm_shm_abort_get(c->hdr, &c->geom, c->base, &a) ? a.reason : NULL;
}

/* What /proc says about pid: 1 when it is gone (*wstatus: how it ended
 * when that can still be read, a zombie's exit_code, field 52 of
 * /proc/pid/stat, in waitpid's format; else -1); 0 while it runs (*state:
 * its state letter, R, S, D, T (stopped), t (traced), or '?'). */
static int tdm_shm_proc(pid_t pid, int *wstatus, char *state)
{
    *wstatus = -1;
    *state = '?';
    if (pid <= 0) return 0;
    if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
    /* A dead child that its parent has not reaped yet still answers
     * kill(pid, 0): look for the zombie state in /proc. */
    char buf[1024];
    const char *p = tdm_proc_stat(pid, buf, sizeof buf);
    if (!p) return errno == ENOENT;
    *state = p[0];
    if (p[0] != 'Z' && p[0] != 'X') return 0;
    /* p is field 3 (the state), exit_code field 52 */
    const char *q = p;
    for (int field = 3; field < 52 && q; field++) {
        q = strchr(q, ' ');
        if (q) q++;
    }
    if (q && *q >= '0' && *q <= '9') *wstatus = atoi(q);
    return 1;
}

/* How peer r ended, for a rank that needed it: wstatus as reported by the
 * parent or read from the zombie (-1: unknown), state its last state. */
static void tdm_shm_ended_str(const tdm_shm_impl *c, int32_t state, int wstatus, char *why,
                              size_t n)
{
    char how[128];
    if (wstatus < 0) {
        snprintf(why, n, "%s before %s #%llu (exit status unknown: its parent did not report "
                 "it)", state == TDM_SHM_STATE_LEFT ? "left the group (freed its communicator) "
                 "and ended" : "ended", c->cur_name, (unsigned long long)c->cur_seq);
        return;
    }
    tdm_shm_wait_status_str(wstatus, how, sizeof how);
    if (!(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0))
        snprintf(why, n, "%s%s", how, state == TDM_SHM_STATE_LEFT ? " after freeing its "
                 "communicator" : "");
    else if (state == TDM_SHM_STATE_LEFT)
        snprintf(why, n, "left the group (freed its communicator and %s) before %s #%llu", how,
                 c->cur_name, (unsigned long long)c->cur_seq);
    else if (state == TDM_SHM_STATE_EMPTY)
        snprintf(why, n, "%s before joining the group", how);
    else
        snprintf(why, n, "%s before %s #%llu without freeing its communicator", how,
                 c->cur_name, (unsigned long long)c->cur_seq);
}

/* --- heartbeat ----------------------------------------------------------- */

static void *tdm_shm_heartbeat_main(void *arg)
{
    tdm_shm_impl *c = arg;
    tdm_shm_ctrl *k = tdm_shm_ctrl_of(c, c->rank);
    pthread_mutex_lock(&c->hb_mu);
    while (!c->hb_stop) {
        /* Only this thread writes it; readers compare values, nothing is
         * published through it: relaxed. */
        atomic_fetch_add_explicit(&k->beat, 1, memory_order_relaxed);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + TDM_SHM_BEAT_NS;
        ts.tv_sec = (time_t)(t / 1000000000ull);
        ts.tv_nsec = (long)(t % 1000000000ull);
        pthread_cond_timedwait(&c->hb_cv, &c->hb_mu, &ts);
    }
    pthread_mutex_unlock(&c->hb_mu);
    return NULL;
}

tdm_status tdm_shm_heartbeat_start(tdm_shm_impl *c)
{
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (!rc) rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!rc) rc = pthread_cond_init(&c->hb_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc) return tdm_error_set(TDM_STATUS_SYSTEM, "shm: heartbeat: pthread_cond_init: %s",
                                 strerror(rc));
    if ((rc = pthread_mutex_init(&c->hb_mu, NULL))) {
        pthread_cond_destroy(&c->hb_cv);
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: heartbeat: pthread_mutex_init: %s",
                             strerror(rc));
    }
    /* The thread takes no signals: they stay with the program's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&c->hb_thread, NULL, tdm_shm_heartbeat_main, c);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        pthread_mutex_destroy(&c->hb_mu);
        pthread_cond_destroy(&c->hb_cv);
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: heartbeat: pthread_create: %s",
                             strerror(rc));
    }
    c->hb_running = 1;
    return TDM_STATUS_OK;
}

void tdm_shm_heartbeat_stop(tdm_shm_impl *c)
{
    if (!c->hb_running) return;
    pthread_mutex_lock(&c->hb_mu);
    c->hb_stop = 1;
    pthread_cond_signal(&c->hb_cv);
    pthread_mutex_unlock(&c->hb_mu);
    pthread_join(c->hb_thread, NULL);
    pthread_mutex_destroy(&c->hb_mu);
    pthread_cond_destroy(&c->hb_cv);
    c->hb_running = 0;
}

/* 1 when the awaited peer r, alive as a process (/proc state pstate), has
 * made no sign of life for stall_ns: its heartbeat has not advanced (or,
 * before it has one, /proc shows it stopped). why says which case. */
static int tdm_shm_stalled(tdm_shm_impl *c, int r, const tdm_shm_ctrl *k, char pstate,
                           uint64_t now, char *why, size_t n)
{
    uint64_t b = atomic_load_explicit(&((tdm_shm_ctrl *)k)->beat, memory_order_relaxed);
    int stopped = pstate == 'T' || pstate == 't';
    int progressing = b ? b != c->beat_seen[r] : !stopped;
    if (progressing || !c->beat_seen_ns[r]) {
        c->beat_seen[r] = b;
        c->beat_seen_ns[r] = now;
        return 0;
    }
    if (!c->stall_ns || now - c->beat_seen_ns[r] < c->stall_ns) return 0;
    double s = (double)(now - c->beat_seen_ns[r]) * 1e-9;
    const char *what = pstate == 'T' ? "is stopped (process state T: SIGSTOP or job control)"
                       : pstate == 't' ? "is stopped by a debugger (process state t)"
                                       : "is frozen";
    int len = snprintf(why, n, "%s: no heartbeat for %.1f s in %s #%llu", what, s, c->cur_name,
                       (unsigned long long)c->cur_seq);
    if (!stopped && len > 0 && (size_t)len < n)
        snprintf(why + len, n - (size_t)len, " (process state %c)", pstate);
    return 1;
}

/* A heartbeat seen advancing within this long is current (the thread
 * beats every TDM_SHM_BEAT_NS). */
#define TDM_SHM_BEAT_CURRENT_NS (10 * TDM_SHM_BEAT_NS)

/* For the deadline's message: is the awaited peer alive? How long its
 * heartbeat has stood still is counted from this rank's first look at it
 * in this wait at the latest (tdm_shm_stalled keeps beat_seen_ns): a
 * beat that stopped before the wait began shows as stopped since then. */
static void tdm_shm_alive_str(const tdm_shm_impl *c, int peer, uint64_t now, char *out,
                              size_t n)
{
    const tdm_shm_ctrl *k = tdm_shm_ctrl_of(c, peer);
    uint64_t b = atomic_load_explicit(&((tdm_shm_ctrl *)k)->beat, memory_order_relaxed);
    if (!b) {
        snprintf(out, n, "which has no heartbeat (has it joined?)");
    } else if (c->beat_seen_ns[peer] && now - c->beat_seen_ns[peer] < TDM_SHM_BEAT_CURRENT_NS) {
        snprintf(out, n, "which is alive (its heartbeat is current) but has not arrived: it is "
                 "busy, slow or waiting elsewhere; raise the timeout if that is expected");
    } else if (c->beat_seen_ns[peer]) {
        snprintf(out, n, "whose heartbeat has not advanced for %.1f s: it is stopped, frozen or "
                 "starved of CPU", (double)(now - c->beat_seen_ns[peer]) * 1e-9);
    } else {
        snprintf(out, n, "whose heartbeat has stopped");
    }
}

/* The test hook's pause (tdm_shm_impl.test_gone_pause): until the
 * parent has reported peer k ended, 30 s at most; once per rank. It sits
 * after every read the liveness check acts on, so that a check deciding
 * from reads made before the peer ended is caught whatever their order. */
static void tdm_shm_test_gone(tdm_shm_impl *c, const tdm_shm_ctrl *k)
{
    c->test_gone_pause = 0;
    for (int i = 0; i < 30000 && !atomic_load(&((tdm_shm_ctrl *)k)->ended); i++) {
        struct timespec ts = {.tv_nsec = 1000000};
        nanosleep(&ts, NULL);
    }
}

#define TDM_SHM_STATUS_GRACE_NS (1000ull * 1000 * 1000)

/* Fails (and raises the group flag) if a peer that matters is gone.
 * `peer` is the rank being waited for: for it, being gone in any way is
 * an error, reported with how it ended. For the others only a known
 * failure is (the parent reported it dead, or its zombie shows a failing
 * status): a rank that exited 0 or left concerns only whoever waits for
 * it, and ranks that never do (point-to-point between others) go on.
 * When a gone peer's status is not known yet (its parent reaped it and is
 * about to report it; or it left and is still running, perhaps about to
 * fail), the peer is given TDM_SHM_STATUS_GRACE_NS to tell, so that the
 * message says how it ended rather than "gone".
 * A peer that published what we wait for and then left or died has done
 * its part of this collective: the flag is read again after its state, so
 * that a publish-then-leave between our last look at the flag and this
 * check is not mistaken for a failure (the next wait will notice). */
static tdm_status tdm_shm_check_peers(tdm_shm_impl *c, int peer, tdm_shm_flag *f,
                                      uint64_t target, uint64_t now)
{
    for (int r = 0; r < c->world; r++) {
        if (r == c->rank) continue;
        tdm_shm_ctrl *k = tdm_shm_ctrl_of(c, r);
        char why[256];
        int unsure = 0;
        /* First the signs that the peer is gone (the parent's report, its
         * process), then its state and flag: a peer that publishes, frees
         * its communicator and exits between a look at its flag and the
         * look at its process must not pass for one that never came (nor
         * for one that never joined, by a state read before it did).
         * Acquire on `ended` pairs with the parent's release, which follows
         * the peer's end; a process seen ended through /proc has made all
         * its stores, and the fence orders the loads below after that look.
         * Acquire on state pairs with the release store of LEFT in
         * segment.c, which follows the peer's last publish. */
        int ended = atomic_load_explicit(&k->ended, memory_order_acquire);
        pid_t pid = atomic_load_explicit(&k->pid, memory_order_relaxed);
        int ws = -1;
        char pstate = '?';
        int gone = ended || tdm_shm_proc(pid, &ws, &pstate);
        atomic_thread_fence(memory_order_seq_cst);
        int32_t state = atomic_load_explicit(&k->state, memory_order_acquire);
        if (r == peer && atomic_load_explicit(&f->value, memory_order_acquire) >= target)
            continue;
        /* the hook pauses here, between what was read and what is made
         * of it: the peer may end meanwhile, as on a loaded machine */
        if (r == peer && c->test_gone_pause) tdm_shm_test_gone(c, k);
        if (!pid) pid = atomic_load_explicit(&k->pid, memory_order_relaxed);   /* for the message */
        if (state == TDM_SHM_STATE_DEAD) {
            tdm_shm_ended_str(c, state, atomic_load(&k->wstatus), why, sizeof why);
        } else if (r != peer) {
            /* only a failure shown by its zombie (no parent reports it) */
            if (ended || state == TDM_SHM_STATE_LEFT || !gone || ws < 0 ||
                (WIFEXITED(ws) && WEXITSTATUS(ws) == 0))
                continue;
            tdm_shm_ended_str(c, state, ws, why, sizeof why);
        } else if (ended) {
            tdm_shm_ended_str(c, state, atomic_load(&k->wstatus), why, sizeof why);
        } else if (gone) {
            unsure = ws < 0;   /* reaped: wait for the parent's report */
            tdm_shm_ended_str(c, state, ws, why, sizeof why);
        } else if (state == TDM_SHM_STATE_LEFT) {
            unsure = 1;        /* left, still running: ending (and how?) or staying */
            snprintf(why, sizeof why, "left the group (freed its communicator) before %s #%llu",
                     c->cur_name, (unsigned long long)c->cur_seq);
        } else if (!tdm_shm_stalled(c, r, k, pstate, now, why, sizeof why)) {
            c->unsure_since_ns[r] = 0;
            continue;
        }
        if (unsure) {
            if (!c->unsure_since_ns[r]) c->unsure_since_ns[r] = now;
            if (now - c->unsure_since_ns[r] < TDM_SHM_STATUS_GRACE_NS) continue;
        }
        char who[64];
        tdm_shm_who(c, r, (int)pid, who, sizeof who);
        tdm_shm_raise_rank(c, r, TDM_STATUS_PEER_FAILED, "%s %s", who, why);
        tdm_status st = tdm_shm_check_abort(c);
        return st ? st : tdm_error_set(TDM_STATUS_PEER_FAILED, "%s #%llu: %s %s; stopping",
                                       c->cur_name, (unsigned long long)c->cur_seq, who, why);
    }
    return TDM_STATUS_OK;
}

/* The test hook's pause (tdm_shm_impl.test_late_checks): until the
 * group abort is raised, 30 s at most. */
static void tdm_shm_test_late(tdm_shm_impl *c)
{
    tdm_shm_abort_info a;
    for (int i = 0; i < 30000 && !tdm_shm_abort_get(c->hdr, &c->geom, c->base, &a); i++) {
        struct timespec ts = {.tv_nsec = 1000000};
        nanosleep(&ts, NULL);
    }
}

/* Every failure path below looks at the flag first: a wait whose peer has
 * published what it waits for has what it needs, whatever happened since
 * (the peer may have finished the collective, left and been reported
 * failed, raising the group abort, while this rank was descheduled after
 * its last look). Only a wait still missing its data fails, so a peer
 * that leaves after a completed collective cannot turn the others'
 * completed work into a failure. */
tdm_status tdm_shm_flag_wait(tdm_shm_impl *c, tdm_shm_flag *f, uint64_t target, int peer)
{
    if (tdm_wait_reached(f, target)) return TDM_STATUS_OK;

    uint64_t t0 = tdm_time_ns();
    /* Pure spinning while a peer on another core is about to answer;
     * then spinning with sched_yield, which costs little when the core is
     * ours alone and lets the peer run when it shares our core (other
     * jobs on the machine, load balancing). Ranks that outnumber the
     * cores only yield a few times before sleeping. */
    if (c->spin_now ? tdm_wait_spin(f, target, t0, c->spin_ns, TDM_SHM_PURE_SPIN_NS)
                    : tdm_wait_yield(f, target, TDM_SHM_YIELDS))
        return TDM_STATUS_OK;
    if (c->test_late_checks) tdm_shm_test_late(c);
    if (tdm_wait_reached(f, target)) return TDM_STATUS_OK;
    TDM_CHECK(tdm_shm_check_abort(c));

    uint64_t deadline = t0 + (uint64_t)c->timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = tdm_time_ns();
        if (now >= c->next_live_ns) {
            if (tdm_wait_reached(f, target)) return TDM_STATUS_OK;
            TDM_CHECK(tdm_shm_check_peers(c, peer, f, target, now));
            c->next_live_ns = now + TDM_SHM_SLEEP_NS;
        }
        if (now >= deadline) {
            if (tdm_wait_reached(f, target)) return TDM_STATUS_OK;
            tdm_shm_ctrl *k = tdm_shm_ctrl_of(c, peer);
            char me[64], who[64];
            if (c->root) snprintf(me, sizeof me, "rank %d (job rank %d)", c->rank,
                                  c->job_rank[c->rank]);
            else snprintf(me, sizeof me, "rank %d", tdm_shm_name(c, c->rank));
            tdm_shm_who(c, peer, (int)atomic_load(&k->pid), who, sizeof who);
            char alive[160];
            tdm_shm_alive_str(c, peer, now, alive, sizeof alive);
            tdm_shm_raise_rank(c, peer, TDM_STATUS_TIMEOUT,
                          "%s timed out after %lld ms in %s #%llu waiting for %s, %s", me,
                          (long long)c->timeout_ms, c->cur_name, (unsigned long long)c->cur_seq,
                          who, alive);
            tdm_status st = tdm_shm_check_abort(c);
            return st ? st : tdm_error_set(TDM_STATUS_TIMEOUT, "%s #%llu: timed out waiting "
                                           "for %s", c->cur_name,
                                           (unsigned long long)c->cur_seq, who);
        }
        uint64_t left = deadline - now;
        if (tdm_wait_sleep(f, target, left < TDM_SHM_SLEEP_NS ? left : TDM_SHM_SLEEP_NS,
                           TDM_WAIT_SHARED, NULL))
            return TDM_STATUS_OK;
        if (tdm_wait_reached(f, target)) return TDM_STATUS_OK;
        TDM_CHECK(tdm_shm_check_abort(c));
    }
}
