/* core/flight.c: the communicator flight recorder (core/flight.h): a ring
 * of relaxed-atomic entries written by the dispatcher (core/comm.c), and
 * an async-signal-safe JSON writer. It is not a backend and knows nothing
 * of shared memory, NCCL or MPI. */
#include "core/flight.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/safefile.h"
#include "core/timer.h"

/* The time stamps of the fast path. clock_gettime costs 20 ns where the
 * vDSO reads the TSC and several times that on machines where it does not
 * (90 ns measured on this project's build VM), against about 1 us for a
 * small shm all_reduce: two of them per call would be the recorder's whole
 * cost. On x86 the entries store raw TSC ticks (constant-rate on every CPU
 * of the last fifteen years) and the dump converts them to CLOCK_MONOTONIC
 * nanoseconds with the pair (ticks, ns) taken when the recorder was made
 * and the pair taken at the dump, the interval between them being the
 * run's length. Elsewhere the entries store nanoseconds directly. */
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
static inline uint64_t tdm_fr_ticks(void) { return __rdtsc(); }
#define TDM_FR_RAW_TICKS 1
#else
static inline uint64_t tdm_fr_ticks(void) { return tdm_time_ns(); }
#define TDM_FR_RAW_TICKS 0
#endif

#define TDM_FR_LABEL_WORDS (TDM_FR_LABEL_MAX / 8)
#define TDM_FR_MAX_LIVE 16       /* recorders SIGUSR1 can reach */
#define TDM_FR_NAME_MAX 96
#define TDM_FR_TMP_SUFFIX_MAX 32 /* a writer's number and ".tmp" */

/* One collective. Every field is a relaxed atomic so that the writer (a
 * signal handler, or another thread) may read while the issuing and the
 * progress threads write: on x86-64 and arm64 these are plain loads and
 * stores, the cost of the fast path is unchanged. */
typedef struct tdm_fr_entry {
    _Atomic uint64_t seq;
    _Atomic uint64_t count;
    _Atomic uint64_t t_enqueue, t_start, t_end;   /* tdm_fr_ticks(); 0: not yet */
    _Atomic int64_t step;
    _Atomic uint32_t desc;                        /* coll | dtype << 8 | op << 16 */
    _Atomic int32_t root;
    _Atomic int32_t state;                        /* tdm_fr_state */
    _Atomic int32_t status;                       /* tdm_status once ended */
    _Atomic uint64_t label[TDM_FR_LABEL_WORDS];   /* NUL-padded bytes */
} tdm_fr_entry;

struct tdm_fr {
    int rank, world, index;       /* index: slot in the live table */
    int job_rank;                 /* the rank in the job (a part's differs: tdm_fr_set_inner) */
    uint64_t group;               /* a split communicator's id (tdm_fr_set_group); 0: none */
    int *members, nmembers;       /* its ranks' job ranks; NULL: not a split's */
    const char *backend;          /* borrowed: static */
    uint64_t n;                   /* ring size */
    uint64_t tick0, ns0;          /* tdm_fr_ticks() and CLOCK_MONOTONIC ns at init */
    tdm_fr_entry *ring;
    /* Written only by the issuing thread (the one thread that issues a
     * communicator's calls, core/comm.h); read by the dump. */
    _Atomic uint64_t next_seq;
    _Atomic int64_t step;
    _Atomic uint64_t label[TDM_FR_LABEL_WORDS];   /* pending label of the next call */
    _Atomic int has_label;
    /* The first failure: claimed with a CAS on `failed`, then the text is
     * written and `reason_ready` released (the dump reads it only then). */
    _Atomic int failed;
    _Atomic int reason_ready;
    _Atomic int32_t fail_status;
    char reason[TDM_FR_REASON_MAX];
    _Atomic int dumps;            /* dumps written */
    _Atomic int in_dump;          /* writers running now (free waits for 0) */
    _Atomic uint64_t writer_seq;  /* numbers each writer's temporary file */
    /* The job the dump belongs to (TANDEM_JOB_ID, else what the backend
     * knows: the shm segment's id, the MPI job's agreed one); 0: none. So
     * that `tandem doctor` reads one job's dumps out of a reused
     * directory. */
    _Atomic uint64_t job;
    int dump_at_end;
    /* TANDEM_FR_DUMP, opened and checked once (core/safefile.h: ours or
     * root's, not writable by group or others, a symlink only if ours):
     * every dump is created and renamed relative to it, so the path can
     * not be swapped under the writer. -1: no dumps. */
    int dirfd;
    char name[TDM_FR_NAME_MAX];      /* fr_rank_<R>[.c<K>.pid<P>].json */
    char tmp_prefix[2 * TDM_FR_NAME_MAX];
};

static _Atomic(tdm_fr *) tdm_fr_live[TDM_FR_MAX_LIVE];
static _Atomic(tdm_fr *) tdm_fr_primary;   /* owner of the fr_rank_<R>.json name */
static atomic_int tdm_fr_sig_installed;
/* dump_all calls under way: tdm_fr_free waits for them after taking its
 * recorder out of the table, so none can be reading freed memory */
static atomic_int tdm_fr_walkers;

static const char *const tdm_fr_state_names[] = {
    [TDM_FR_EMPTY] = "empty", [TDM_FR_QUEUED] = "queued", [TDM_FR_RUNNING] = "running",
    [TDM_FR_DONE] = "done", [TDM_FR_FAILED] = "failed",
};

const char *tdm_fr_state_name(tdm_fr_state s)
{
    return (unsigned)s <= TDM_FR_FAILED ? tdm_fr_state_names[s] : "?";
}

static void tdm_fr_on_sigusr1(int sig)
{
    (void)sig;
    int e = errno;   /* a handler must leave errno as it found it */
    tdm_fr_dump_all("SIGUSR1");
    errno = e;
}

/* SIGUSR1 dumps only if nobody else wanted it: an application's own
 * handler (or SIG_IGN) is left alone. */
static void tdm_fr_install_signal(void)
{
    int expect = 0;
    if (!atomic_compare_exchange_strong(&tdm_fr_sig_installed, &expect, 1)) return;
    struct sigaction old;
    if (sigaction(SIGUSR1, NULL, &old) != 0 || old.sa_handler != SIG_DFL ||
        (old.sa_flags & SA_SIGINFO))
        return;
    struct sigaction sa = {.sa_handler = tdm_fr_on_sigusr1, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
}

/* The process's primary communicator dumps to fr_rank_<R>.json, the one
 * `tandem doctor` reads; any other (a sub-group, with its own numbering of
 * ranks) to fr_rank_<R>.c<K>.pid<P>.json. */
static void tdm_fr_name(tdm_fr *fr, int primary)
{
    if (primary) snprintf(fr->name, sizeof fr->name, "fr_rank_%d.json", fr->job_rank);
    else snprintf(fr->name, sizeof fr->name, "fr_rank_%d.c%d.pid%d.json", fr->job_rank, fr->index,
                  (int)getpid());
    /* the prefix of the writers' temporary files: each appends its own
     * number (tdm_fr_dump), so that two at once never share one */
    snprintf(fr->tmp_prefix, sizeof fr->tmp_prefix - TDM_FR_TMP_SUFFIX_MAX, ".%.64s.%d.",
             fr->name, (int)getpid());
}

void tdm_fr_set_inner(tdm_fr *fr, int job_rank)
{
    if (!fr) return;
    fr->job_rank = job_rank;
    if (fr->dirfd < 0) return;
    tdm_fr *expect = fr;
    atomic_compare_exchange_strong(&tdm_fr_primary, &expect, NULL);
    tdm_fr_name(fr, 0);
}

void tdm_fr_set_primary(tdm_fr *fr)
{
    if (!fr || fr->dirfd < 0) return;
    tdm_fr *was = atomic_exchange(&tdm_fr_primary, fr);
    if (was == fr) return;
    if (was) tdm_fr_name(was, 0);
    tdm_fr_name(fr, 1);
}

void tdm_fr_set_group(tdm_fr *fr, uint64_t id, const int *members, int n)
{
    if (!fr || !members || n <= 0 || fr->rank < 0 || fr->rank >= n) return;
    int *m = malloc((size_t)n * sizeof *m);
    if (!m) return;   /* the dumps then say less, nothing else changes */
    memcpy(m, members, (size_t)n * sizeof *m);
    free(fr->members);
    fr->members = m;
    fr->nmembers = n;
    fr->group = id ? id : 1;
    tdm_fr_set_inner(fr, members[fr->rank]);
}

uint64_t tdm_fr_group(const tdm_fr *fr) { return fr ? fr->group : 0; }

uint64_t tdm_fr_job_parse(const char *s)
{
    if (!s || !*s) return 0;
    /* 1..16 hex digits: the id itself; anything else: its FNV-1a hash */
    uint64_t v = 0, h = 1469598103934665603ull;
    int hex = strlen(s) <= 16;
    for (const char *p = s; *p; p++) {
        int d = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10
                : *p >= 'A' && *p <= 'F' ? *p - 'A' + 10 : -1;
        if (d < 0) hex = 0;
        else v = v << 4 | (uint64_t)d;
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    }
    v = hex ? v : h;
    return v ? v : 1;
}

void tdm_fr_set_job(tdm_fr *fr, uint64_t job)
{
    uint64_t none = 0;
    if (fr && job) atomic_compare_exchange_strong(&fr->job, &none, job);
}

tdm_status tdm_fr_init(tdm_fr **out, int rank, int world, const char *backend)
{
    *out = NULL;
    uint64_t n = TDM_FR_DEFAULT_SIZE;
    const char *s = getenv("TANDEM_FR_SIZE");
    if (s && *s) {
        char *end = NULL;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno || *end || v < 0 || v > TDM_FR_MAX_SIZE)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "TANDEM_FR_SIZE='%s': expected a number of entries from 0 "
                                 "(flight recorder off) to %d", s, TDM_FR_MAX_SIZE);
        n = (uint64_t)v;
    }
    if (n == 0) return TDM_STATUS_OK;
    tdm_fr *fr = calloc(1, sizeof *fr);
    tdm_fr_entry *ring = calloc(n, sizeof *ring);
    if (!fr || !ring) {
        free(fr);
        free(ring);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                             "flight recorder: %llu entries (TANDEM_FR_SIZE)", (unsigned long long)n);
    }
    fr->rank = rank;
    fr->job_rank = rank;
    fr->world = world;
    fr->backend = backend ? backend : "?";
    fr->n = n;
    fr->ring = ring;
    fr->index = -1;
    fr->tick0 = tdm_fr_ticks();
    fr->ns0 = tdm_time_ns();
    fr->dirfd = -1;
    atomic_init(&fr->job, tdm_fr_job_parse(getenv(TDM_FR_ENV_JOB)));
    const char *dir = getenv("TANDEM_FR_DUMP");
    if (dir && *dir) {
        /* the rule of --plot and --log-dir: a directory another user could
         * write to (or steer through a symlink of theirs) would let them
         * replace the dumps, and with them the diagnosis */
        tdm_status st = tdm_dir_open_safe(dir, "TANDEM_FR_DUMP", 1, &fr->dirfd);
        if (st == TDM_STATUS_INVALID_ARG) {
            free(ring);
            free(fr);
            return st;
        }
        if (st) TDM_WARN(CORE, "%s; no flight-recorder dumps", tdm_error_message());
    }
    for (int i = 0; i < TDM_FR_MAX_LIVE; i++) {
        tdm_fr *expect = NULL;
        if (atomic_compare_exchange_strong(&tdm_fr_live[i], &expect, fr)) { fr->index = i; break; }
    }
    const char *on = getenv("TANDEM_FR_DUMP_ON");
    fr->dump_at_end = !(on && !strcmp(on, "failure"));
    if (fr->dirfd >= 0) {
        tdm_fr *expect = NULL;
        tdm_fr_name(fr, atomic_compare_exchange_strong(&tdm_fr_primary, &expect, fr));
    }
    tdm_fr_install_signal();
    *out = fr;
    return TDM_STATUS_OK;
}

void tdm_fr_free(tdm_fr *fr)
{
    if (!fr) return;
    if (fr->dump_at_end || atomic_load(&fr->failed)) tdm_fr_dump(fr, "end");
    if (fr->index >= 0) atomic_store(&tdm_fr_live[fr->index], NULL);
    tdm_fr *expect = fr;
    atomic_compare_exchange_strong(&tdm_fr_primary, &expect, NULL);
    /* A SIGUSR1 dump that picked this recorder before it left the table
     * may still be writing (on another thread): let it finish. */
    while (atomic_load(&fr->in_dump) > 0 || atomic_load(&tdm_fr_walkers) > 0) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (fr->dirfd >= 0) close(fr->dirfd);
    free(fr->members);
    free(fr->ring);
    free(fr);
}

static void tdm_fr_copy_label(_Atomic uint64_t *dst, const _Atomic uint64_t *src)
{
    for (int i = 0; i < TDM_FR_LABEL_WORDS; i++)
        atomic_store_explicit(&dst[i], atomic_load_explicit(&src[i], memory_order_relaxed),
                              memory_order_relaxed);
}

uint64_t tdm_fr_begin(tdm_fr *fr, const tdm_comm_call *k, tdm_fr_state state)
{
    uint64_t seq = atomic_load_explicit(&fr->next_seq, memory_order_relaxed);
    tdm_fr_entry *e = &fr->ring[seq % fr->n];
    uint64_t now = tdm_fr_ticks();
    /* mark the slot as being rewritten before its fields change */
    atomic_store_explicit(&e->state, TDM_FR_EMPTY, memory_order_relaxed);
    atomic_store_explicit(&e->seq, seq, memory_order_relaxed);
    atomic_store_explicit(&e->count, (uint64_t)k->count, memory_order_relaxed);
    atomic_store_explicit(&e->desc, (uint32_t)k->coll | (uint32_t)k->dtype << 8 |
                                        (uint32_t)k->op << 16, memory_order_relaxed);
    atomic_store_explicit(&e->root, k->root, memory_order_relaxed);
    atomic_store_explicit(&e->step, atomic_load_explicit(&fr->step, memory_order_relaxed),
                          memory_order_relaxed);
    atomic_store_explicit(&e->t_enqueue, now, memory_order_relaxed);
    atomic_store_explicit(&e->t_start, state == TDM_FR_RUNNING ? now : 0, memory_order_relaxed);
    atomic_store_explicit(&e->t_end, 0, memory_order_relaxed);
    atomic_store_explicit(&e->status, 0, memory_order_relaxed);
    if (atomic_load_explicit(&fr->has_label, memory_order_relaxed)) {
        tdm_fr_copy_label(e->label, fr->label);
        atomic_store_explicit(&fr->has_label, 0, memory_order_relaxed);
    } else if (atomic_load_explicit(&e->label[0], memory_order_relaxed)) {
        for (int i = 0; i < TDM_FR_LABEL_WORDS; i++)
            atomic_store_explicit(&e->label[i], 0, memory_order_relaxed);
    }
    atomic_store_explicit(&e->state, state, memory_order_relaxed);
    atomic_store_explicit(&fr->next_seq, seq + 1, memory_order_relaxed);
    return seq;
}

void tdm_fr_start(tdm_fr *fr, uint64_t seq)
{
    tdm_fr_entry *e = &fr->ring[seq % fr->n];
    if (atomic_load_explicit(&e->seq, memory_order_relaxed) != seq) return;   /* overwritten */
    atomic_store_explicit(&e->t_start, tdm_fr_ticks(), memory_order_relaxed);
    atomic_store_explicit(&e->state, TDM_FR_RUNNING, memory_order_relaxed);
}

void tdm_fr_end(tdm_fr *fr, uint64_t seq, tdm_status st)
{
    tdm_fr_entry *e = &fr->ring[seq % fr->n];
    if (atomic_load_explicit(&e->seq, memory_order_relaxed) == seq) {
        atomic_store_explicit(&e->t_end, tdm_fr_ticks(), memory_order_relaxed);
        atomic_store_explicit(&e->status, (int32_t)st, memory_order_relaxed);
        atomic_store_explicit(&e->state, st ? TDM_FR_FAILED : TDM_FR_DONE, memory_order_relaxed);
    }
    if (st) tdm_fr_note_failure(fr, st, tdm_error_message());
}

void tdm_fr_set_label(tdm_fr *fr, const char *label)
{
    char buf[TDM_FR_LABEL_WORDS * 8] = {0};
    size_t n = label ? strlen(label) : 0;
    if (n > sizeof buf - 1) n = sizeof buf - 1;
    if (n) memcpy(buf, label, n);
    for (int i = 0; i < TDM_FR_LABEL_WORDS; i++) {
        uint64_t w;
        memcpy(&w, buf + 8 * i, 8);
        atomic_store_explicit(&fr->label[i], w, memory_order_relaxed);
    }
    atomic_store_explicit(&fr->has_label, n > 0, memory_order_relaxed);
}

void tdm_fr_set_step(tdm_fr *fr, int64_t step)
{
    atomic_store_explicit(&fr->step, step, memory_order_relaxed);
}

void tdm_fr_note_failure(tdm_fr *fr, tdm_status st, const char *why)
{
    int expect = 0;
    if (atomic_compare_exchange_strong(&fr->failed, &expect, 1)) {
        snprintf(fr->reason, sizeof fr->reason, "%s", why && *why ? why : tdm_status_name(st));
        atomic_store(&fr->fail_status, (int32_t)st);
        /* release: the dump reads reason only after it acquires this */
        atomic_store_explicit(&fr->reason_ready, 1, memory_order_release);
        tdm_fr_dump(fr, "failure");
    }
}

/* --- the async-signal-safe writer ------------------------------------------
 * Everything below uses only a stack buffer and write(2): no stdio, no
 * malloc, no locks (signal-safety(7)). */

typedef struct tdm_fr_out {
    int fd, err;
    size_t len;
    char buf[4096];
} tdm_fr_out;

static void tdm_fr_flush(tdm_fr_out *o)
{
    size_t off = 0;
    while (off < o->len && !o->err) {
        ssize_t w = write(o->fd, o->buf + off, o->len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { o->err = 1; break; }
        off += (size_t)w;
    }
    o->len = 0;
}

static void tdm_fr_put(tdm_fr_out *o, const char *s, size_t n)
{
    while (n > 0) {
        if (o->len == sizeof o->buf) tdm_fr_flush(o);
        size_t k = sizeof o->buf - o->len;
        if (k > n) k = n;
        memcpy(o->buf + o->len, s, k);
        o->len += k;
        s += k;
        n -= k;
    }
}

static void tdm_fr_puts(tdm_fr_out *o, const char *s) { tdm_fr_put(o, s, strlen(s)); }

static void tdm_fr_put_u64(tdm_fr_out *o, uint64_t v)
{
    char d[24];
    int i = sizeof d;
    do { d[--i] = (char)('0' + v % 10); v /= 10; } while (v);
    tdm_fr_put(o, d + i, sizeof d - (size_t)i);
}

/* 16 hex digits; nothing for 0 (no job id). */
static void tdm_fr_put_hex(tdm_fr_out *o, uint64_t v)
{
    static const char hex[] = "0123456789abcdef";
    if (!v) return;
    char d[16];
    for (int i = 15; i >= 0; i--, v >>= 4) d[i] = hex[v & 15];
    tdm_fr_put(o, d, 16);
}

static void tdm_fr_put_i64(tdm_fr_out *o, int64_t v)
{
    if (v < 0) {
        tdm_fr_put(o, "-", 1);
        tdm_fr_put_u64(o, (uint64_t)0 - (uint64_t)v);
    } else {
        tdm_fr_put_u64(o, (uint64_t)v);
    }
}

/* A JSON string: quotes, backslashes and control bytes escaped; bytes
 * >= 0x80 passed through (labels and messages are ASCII or UTF-8). */
static void tdm_fr_put_str(tdm_fr_out *o, const char *s, size_t max)
{
    static const char hex[] = "0123456789abcdef";
    tdm_fr_put(o, "\"", 1);
    for (size_t i = 0; i < max && s[i]; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            tdm_fr_put(o, e, 2);
        } else if (c < 0x20) {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            tdm_fr_put(o, e, 6);
        } else {
            tdm_fr_put(o, (const char *)&c, 1);
        }
    }
    tdm_fr_put(o, "\"", 1);
}

static uint64_t tdm_fr_clock(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);   /* async-signal-safe (POSIX.1-2008) */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ticks -> CLOCK_MONOTONIC ns: ns0 + (t - tick0) * ns_per_tick (double
 * arithmetic is async-signal-safe). 0 stays 0: not reached yet. */
typedef struct tdm_fr_conv {
    uint64_t tick0, ns0;
    double ns_per_tick;
} tdm_fr_conv;

static uint64_t tdm_fr_ns(const tdm_fr_conv *c, uint64_t t)
{
    if (!t) return 0;
    double d = ((double)t - (double)c->tick0) * c->ns_per_tick;
    return (uint64_t)((double)c->ns0 + d);
}

static void tdm_fr_put_entry(tdm_fr_out *o, const tdm_fr_entry *e, uint64_t seq,
                             const tdm_fr_conv *cv)
{
    uint32_t desc = atomic_load_explicit(&e->desc, memory_order_relaxed);
    int state = atomic_load_explicit(&e->state, memory_order_relaxed);
    tdm_coll coll = (tdm_coll)(desc & 0xff);
    char label[TDM_FR_LABEL_WORDS * 8 + 1];
    for (int i = 0; i < TDM_FR_LABEL_WORDS; i++) {
        uint64_t w = atomic_load_explicit(&e->label[i], memory_order_relaxed);
        memcpy(label + 8 * i, &w, 8);
    }
    label[sizeof label - 1] = 0;
    tdm_fr_puts(o, "{\"seq\":");
    tdm_fr_put_u64(o, seq);
    tdm_fr_puts(o, ",\"coll\":");
    tdm_fr_put_str(o, tdm_coll_name(coll), 32);
    tdm_fr_puts(o, ",\"dtype\":");
    tdm_fr_put_str(o, coll == TDM_COLL_BARRIER ? "-" : tdm_dtype_name((tdm_dtype)((desc >> 8) & 0xff)), 32);
    tdm_fr_puts(o, ",\"op\":");
    int reduces = coll == TDM_COLL_ALL_REDUCE || coll == TDM_COLL_REDUCE ||
                  coll == TDM_COLL_REDUCE_SCATTER;
    tdm_fr_put_str(o, reduces ? tdm_redop_name((tdm_redop)((desc >> 16) & 0xff)) : "-", 32);
    tdm_fr_puts(o, ",\"count\":");
    tdm_fr_put_u64(o, atomic_load_explicit(&e->count, memory_order_relaxed));
    tdm_fr_puts(o, ",\"root\":");
    tdm_fr_put_i64(o, atomic_load_explicit(&e->root, memory_order_relaxed));
    tdm_fr_puts(o, ",\"label\":");
    tdm_fr_put_str(o, label, sizeof label);
    tdm_fr_puts(o, ",\"step\":");
    tdm_fr_put_i64(o, atomic_load_explicit(&e->step, memory_order_relaxed));
    tdm_fr_puts(o, ",\"state\":");
    tdm_fr_put_str(o, tdm_fr_state_name((tdm_fr_state)state), 16);
    tdm_fr_puts(o, ",\"status\":");
    tdm_fr_put_str(o, tdm_status_name((tdm_status)atomic_load_explicit(&e->status, memory_order_relaxed)), 32);
    tdm_fr_puts(o, ",\"t_enqueue_ns\":");
    tdm_fr_put_u64(o, tdm_fr_ns(cv, atomic_load_explicit(&e->t_enqueue, memory_order_relaxed)));
    tdm_fr_puts(o, ",\"t_start_ns\":");
    tdm_fr_put_u64(o, tdm_fr_ns(cv, atomic_load_explicit(&e->t_start, memory_order_relaxed)));
    tdm_fr_puts(o, ",\"t_end_ns\":");
    tdm_fr_put_u64(o, tdm_fr_ns(cv, atomic_load_explicit(&e->t_end, memory_order_relaxed)));
    tdm_fr_puts(o, "}");
}

/* This writer's temporary file: the prefix made at init, then a number
 * of its own (by hand: async-signal-safe) and ".tmp". */
static void tdm_fr_tmp_name(tdm_fr *fr, char *out)
{
    size_t n = strlen(fr->tmp_prefix);
    memcpy(out, fr->tmp_prefix, n);
    uint64_t k = atomic_fetch_add(&fr->writer_seq, 1);
    char d[24];
    int i = sizeof d;
    do { d[--i] = (char)('0' + k % 10); k /= 10; } while (k);
    memcpy(out + n, d + i, sizeof d - (size_t)i);
    n += sizeof d - (size_t)i;
    memcpy(out + n, ".tmp", 5);
}

int tdm_fr_dump(tdm_fr *fr, const char *reason)
{
    if (!fr || fr->dirfd < 0) return -1;
    atomic_fetch_add(&fr->in_dump, 1);
    int rc = -1;
    tdm_fr_out o;
    o.err = 0;
    o.len = 0;
    /* Two writers at once (a failure on one thread and SIGUSR1 on
     * another, or SIGUSR1 landing inside this thread's own dump) each
     * write a temporary file of their own, numbered here, and rename it
     * into place: the file read is always one complete dump, the later
     * rename's. (One shared name let the nested writer truncate and
     * rename the file the interrupted one was still writing.) */
    char tmp[2 * TDM_FR_NAME_MAX];
    tdm_fr_tmp_name(fr, tmp);
    /* openat and renameat: async-signal-safe (POSIX.1-2008) */
    o.fd = openat(fr->dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (o.fd < 0) goto out;
    uint64_t next = atomic_load_explicit(&fr->next_seq, memory_order_relaxed);
    uint64_t first = next > fr->n ? next - fr->n : 0;
    int failed = atomic_load_explicit(&fr->reason_ready, memory_order_acquire);
    uint64_t mono = tdm_fr_clock(CLOCK_MONOTONIC);
    tdm_fr_conv cv = {.tick0 = fr->tick0, .ns0 = fr->ns0, .ns_per_tick = 1.0};
    uint64_t tick1 = tdm_fr_ticks();
    if (TDM_FR_RAW_TICKS && tick1 > fr->tick0 && mono > fr->ns0)
        cv.ns_per_tick = (double)(mono - fr->ns0) / (double)(tick1 - fr->tick0);
    tdm_fr_puts(&o, "{\"version\":1,\"rank\":");
    tdm_fr_put_i64(&o, fr->job_rank);
    if (fr->job_rank != fr->rank || fr->members) {   /* a part: its own numbering too */
        tdm_fr_puts(&o, ",\"comm_rank\":");
        tdm_fr_put_i64(&o, fr->rank);
    }
    tdm_fr_puts(&o, ",\"world\":");
    tdm_fr_put_i64(&o, fr->world);
    if (fr->members) {   /* a split's: which communicator, and its ranks in the job */
        tdm_fr_puts(&o, ",\"comm\":\"");
        tdm_fr_put_hex(&o, fr->group);
        tdm_fr_puts(&o, "\",\"members\":[");
        for (int i = 0; i < fr->nmembers; i++) {
            if (i) tdm_fr_puts(&o, ",");
            tdm_fr_put_i64(&o, fr->members[i]);
        }
        tdm_fr_puts(&o, "]");
    }
    tdm_fr_puts(&o, ",\"pid\":");
    tdm_fr_put_i64(&o, (int64_t)getpid());
    tdm_fr_puts(&o, ",\"job\":\"");
    tdm_fr_put_hex(&o, atomic_load(&fr->job));
    tdm_fr_puts(&o, "\",\"backend\":");
    tdm_fr_put_str(&o, fr->backend, 64);
    tdm_fr_puts(&o, ",\"trigger\":");
    tdm_fr_put_str(&o, reason ? reason : "request", 64);
    tdm_fr_puts(&o, ",\"failed\":");
    tdm_fr_puts(&o, failed ? "true" : "false");
    tdm_fr_puts(&o, ",\"status\":");
    tdm_fr_put_str(&o, tdm_status_name(failed ? (tdm_status)atomic_load(&fr->fail_status) : TDM_STATUS_OK), 32);
    tdm_fr_puts(&o, ",\"reason\":");
    tdm_fr_put_str(&o, failed ? fr->reason : "", sizeof fr->reason);
    tdm_fr_puts(&o, ",\"last_step\":");
    tdm_fr_put_i64(&o, atomic_load_explicit(&fr->step, memory_order_relaxed));
    tdm_fr_puts(&o, ",\"ring_size\":");
    tdm_fr_put_u64(&o, fr->n);
    tdm_fr_puts(&o, ",\"next_seq\":");
    tdm_fr_put_u64(&o, next);
    tdm_fr_puts(&o, ",\"dump_mono_ns\":");
    tdm_fr_put_u64(&o, mono);
    tdm_fr_puts(&o, ",\"dump_real_ns\":");
    tdm_fr_put_u64(&o, tdm_fr_clock(CLOCK_REALTIME));
    tdm_fr_puts(&o, ",\"entries\":[\n");
    int any = 0;
    for (uint64_t s = first; s < next; s++) {
        const tdm_fr_entry *e = &fr->ring[s % fr->n];
        if (atomic_load_explicit(&e->seq, memory_order_relaxed) != s) continue;   /* rewritten */
        if (any) tdm_fr_puts(&o, ",\n");
        tdm_fr_put_entry(&o, e, s, &cv);
        any = 1;
    }
    tdm_fr_puts(&o, "\n]}\n");
    tdm_fr_flush(&o);
    if (close(o.fd) != 0) o.err = 1;
    if (!o.err && renameat(fr->dirfd, tmp, fr->dirfd, fr->name) == 0) {
        rc = 0;
        atomic_fetch_add(&fr->dumps, 1);
    } else {
        unlinkat(fr->dirfd, tmp, 0);
    }
out:
    atomic_fetch_sub(&fr->in_dump, 1);
    return rc;
}

void tdm_fr_fail_all(tdm_status st, const char *why)
{
    atomic_fetch_add(&tdm_fr_walkers, 1);
    for (int i = 0; i < TDM_FR_MAX_LIVE; i++) {
        tdm_fr *fr = atomic_load(&tdm_fr_live[i]);
        if (!fr) continue;
        /* the calls in flight end here, as the process does */
        uint64_t next = atomic_load_explicit(&fr->next_seq, memory_order_relaxed);
        uint64_t first = next > fr->n ? next - fr->n : 0;
        for (uint64_t q = next; q-- > first;) {
            tdm_fr_entry *e = &fr->ring[q % fr->n];
            int32_t state = atomic_load_explicit(&e->state, memory_order_relaxed);
            if (state == TDM_FR_DONE || state == TDM_FR_FAILED) break;
            if (atomic_load_explicit(&e->seq, memory_order_relaxed) != q) continue;
            atomic_store_explicit(&e->t_end, tdm_fr_ticks(), memory_order_relaxed);
            atomic_store_explicit(&e->status, (int32_t)st, memory_order_relaxed);
            atomic_store_explicit(&e->state, TDM_FR_FAILED, memory_order_relaxed);
        }
        tdm_fr_note_failure(fr, st, why);
    }
    atomic_fetch_sub(&tdm_fr_walkers, 1);
}

/* The signals installed by tdm_fr_dump_on_signal (one bit each). */
static atomic_uint tdm_fr_term_sigs;

static void tdm_fr_on_term(int sig)
{
    /* every recorder dumps as it stands, then the signal does what it
     * would have done (the default action: the process ends by it) */
    tdm_fr_dump_all(sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "signal");
    signal(sig, SIG_DFL);
    raise(sig);
}

void tdm_fr_dump_on_signal(int sig)
{
    unsigned bit = 1u << (sig & 31);
    if (atomic_fetch_or(&tdm_fr_term_sigs, bit) & bit) return;
    struct sigaction old;
    if (sigaction(sig, NULL, &old) != 0 || old.sa_handler != SIG_DFL ||
        (old.sa_flags & SA_SIGINFO))
        return;   /* the application's own handler (or SIG_IGN) stays */
    struct sigaction sa = {.sa_handler = tdm_fr_on_term, .sa_flags = SA_RESETHAND};
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

int tdm_fr_dump_all(const char *reason)
{
    int n = 0;
    atomic_fetch_add(&tdm_fr_walkers, 1);
    for (int i = 0; i < TDM_FR_MAX_LIVE; i++) {
        tdm_fr *fr = atomic_load(&tdm_fr_live[i]);
        if (fr && tdm_fr_dump(fr, reason) == 0) n++;
    }
    atomic_fetch_sub(&tdm_fr_walkers, 1);
    return n;
}
