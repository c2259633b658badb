/* shm/segment.c: the shared segment's life: layout, creation (memfd or an
 * unlinked O_TMPFILE, space reserved with posix_fallocate), header
 * validation on attach, the group (parent side), joining (child side,
 * inherited fd, environment), the zero-copy arena, and the tdm_comm_ops
 * table of the shm backend.
 * Not the collectives (shm/coll.c) nor the waits (shm/wait.c). */
#include "shm/shm_impl.h"
#include "shm/spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/device.h"
#include "core/log.h"
#include "core/memavail.h"
#include "core/timer.h"

#define TDM_SHM_DEFAULT_SLOT (1u << 20)
#define TDM_SHM_DEFAULT_TIMEOUT_MS 300000
/* Largest message of the one-shot all_reduce by default. With two ranks on
 * two cores, rs-ag (half the copy-in and half the arithmetic per rank, one
 * more flag) is faster from about 700 bytes on; with more ranks than
 * cores, every extra flag may mean a sleep or a yield, and one-shot stays
 * ahead up to 4-8 KiB (docs/perf/shm.md). */
#define TDM_SHM_DEFAULT_ONE_SHOT (4u * 1024)
#define TDM_SHM_DEFAULT_ONE_SHOT_PAIR 512u
#define TDM_SHM_SPIN_NS (50u * 1000)
#define TDM_SHM_DEFAULT_STALL_MS 3000
#define TDM_SHM_MIN_STALL_MS 500
/* Bound on the header's core count (a sanity check of what it carries). */
#define TDM_SHM_MAX_CORES (1 << 16)

static size_t tdm_shm_round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

tdm_status tdm_shm_layout(int world, const tdm_shm_opts *opts, tdm_shm_header *h)
{
    TDM_REQUIRE(world >= 1 && world <= TDM_SHM_MAX_RANKS, TDM_STATUS_INVALID_ARG,
                "shm: world size %d out of range 1..%d", world, TDM_SHM_MAX_RANKS);
    size_t slot = opts && opts->slot_bytes ? opts->slot_bytes : TDM_SHM_DEFAULT_SLOT;
    TDM_REQUIRE(slot >= 4096 && slot <= (1u << 30), TDM_STATUS_INVALID_ARG,
                "shm: slot_bytes %zu out of range 4096..1 GiB", slot);
    slot = tdm_shm_round_up(slot, TDM_SHM_PAGE);
    /* bounded so that no size below can overflow (world * arena included) */
    size_t arena_max = ((size_t)1 << 40) / (size_t)world;
    TDM_REQUIRE(!opts || opts->arena_bytes <= arena_max, TDM_STATUS_INVALID_ARG,
                "shm: arena_bytes %zu too large for %d ranks (at most %zu)",
                opts ? opts->arena_bytes : (size_t)0, world, arena_max);
    size_t arena = opts ? tdm_shm_round_up(opts->arena_bytes, TDM_SHM_PAGE) : 0;
    memset(h, 0, sizeof *h);
    h->magic = TDM_SHM_MAGIC;
    h->version = TDM_SHM_VERSION;
    h->header_bytes = TDM_SHM_PAGE;
    h->world = world;
    h->nbuf = TDM_SHM_NBUF;
    h->ctrl_off = TDM_SHM_PAGE;
    h->ctrl_bytes = sizeof(tdm_shm_ctrl);
    h->reason_off = h->ctrl_off + tdm_shm_round_up((size_t)world * h->ctrl_bytes, TDM_SHM_PAGE);
    h->slot_off = h->reason_off +
                  tdm_shm_round_up((size_t)(world + 1) * TDM_SHM_REASON_BYTES, TDM_SHM_PAGE);
    h->slot_bytes = slot;
    h->p2p_off = h->slot_off + (size_t)world * TDM_SHM_NBUF * slot;
    h->p2p_bytes = world > 1 ? tdm_shm_round_up(2 * TDM_SHM_LINE + 2 * (TDM_SHM_P2P_HDR +
                                                TDM_SHM_P2P_BYTES), TDM_SHM_PAGE) : 0;
    h->arena_off = h->p2p_off + (size_t)world * world * h->p2p_bytes;
    h->arena_bytes = arena;
    h->total_bytes = h->arena_off + (size_t)world * arena;
    /* Decided once, here, and carried in the header: every rank must pick
     * the same algorithm for the same call, and decide whether to spin
     * from the same count of cores. The creator's affinity stands for the
     * group's unless told (children inherit it; see tdm_shm_opts.cores). */
    int cores = opts && opts->cores > 0 ? opts->cores : tdm_device_host_cores();
    TDM_REQUIRE(cores <= TDM_SHM_MAX_CORES, TDM_STATUS_INVALID_ARG,
                "shm: cores %d out of range 1..%d", cores, TDM_SHM_MAX_CORES);
    h->cores = cores;
    size_t one_shot = world == 2 && cores >= 2 ? TDM_SHM_DEFAULT_ONE_SHOT_PAIR
                                               : TDM_SHM_DEFAULT_ONE_SHOT;
    h->one_shot_max = opts && opts->one_shot_max_bytes ? opts->one_shot_max_bytes : one_shot;
    return TDM_STATUS_OK;
}

void tdm_shm_geom_from(const tdm_shm_header *h, tdm_shm_geom *g)
{
    *g = (tdm_shm_geom){.world = h->world, .total = h->total_bytes,
                        .ctrl_off = h->ctrl_off, .ctrl_bytes = h->ctrl_bytes,
                        .reason_off = h->reason_off,
                        .slot_off = h->slot_off, .slot_bytes = h->slot_bytes,
                        .p2p_off = h->p2p_off, .p2p_bytes = h->p2p_bytes,
                        .arena_off = h->arena_off, .arena_bytes = h->arena_bytes,
                        .one_shot_max = h->one_shot_max, .cores = h->cores};
}

/* --- group (parent side) ------------------------------------------------- */

static tdm_status tdm_shm_open_backing(const tdm_shm_opts *opts, int *fd_out)
{
    int fd;
    if (opts && opts->shm_dir) {
        do fd = open(opts->shm_dir, O_TMPFILE | O_RDWR | O_EXCL | O_CLOEXEC, 0600);
        while (fd < 0 && errno == EINTR);
        if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
            /* No O_TMPFILE here: a named 0600 file, unlinked at once. */
            char path[4096];
            snprintf(path, sizeof path, "%s/tandem-%u-XXXXXX", opts->shm_dir, (unsigned)getuid());
            fd = mkostemp(path, O_CLOEXEC);
            if (fd >= 0) unlink(path);
        }
        if (fd < 0)
            return tdm_error_set(TDM_STATUS_SYSTEM, "shm: cannot create a segment in %s: %s",
                                 opts->shm_dir, strerror(errno));
    } else {
        fd = memfd_create("tandem-shm", MFD_CLOEXEC);
        if (fd < 0)
            return tdm_error_set(TDM_STATUS_SYSTEM, "shm: memfd_create: %s", strerror(errno));
    }
    *fd_out = fd;
    return TDM_STATUS_OK;
}

/* A segment on memfd or tmpfs takes memory: refuse one larger than what
 * is available, naming both, rather than reserve it and be OOM-killed
 * (a cgroup's limit is enforced by killing, not by failing fallocate). */
static tdm_status tdm_shm_check_memory(size_t total, int world, const tdm_shm_opts *opts)
{
    if (opts && opts->shm_dir) {
        struct statfs fs;
        if (statfs(opts->shm_dir, &fs) != 0 ||
            ((unsigned long)fs.f_type != TMPFS_MAGIC && (unsigned long)fs.f_type != RAMFS_MAGIC))
            return TDM_STATUS_OK;   /* a disk: posix_fallocate checks its space */
    }
    char src[1200];
    uint64_t avail = tdm_mem_available(src, sizeof src);
    if ((uint64_t)total <= avail) return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                         "shm: cannot reserve %zu bytes (%.1f MiB) for %d ranks: only %llu bytes "
                         "(%.1f MiB) of memory are available (%s); lower the zero-copy arena "
                         "(--arena-mb, arena_bytes), slot_bytes or the number of ranks",
                         total, (double)total / (1 << 20), world, (unsigned long long)avail,
                         (double)avail / (1 << 20), src);
}

tdm_status tdm_shm_group_create(tdm_shm_group **out, int world, const tdm_shm_opts *opts)
{
    return tdm_shm_group_create_at(out, world, opts, -1, NULL, 0);
}

tdm_status tdm_shm_group_create_at(tdm_shm_group **out, int world, const tdm_shm_opts *opts,
                                   int fd, const char *where, uint64_t job_id)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_shm_group *g = NULL;
    tdm_shm_header h;
    if (out) *out = NULL;
    st = out ? tdm_shm_layout(world, opts, &h)
             : tdm_error_set(TDM_STATUS_INVALID_ARG, "tdm_shm_group_create: out is NULL");
    if (st != TDM_STATUS_OK) {
        if (fd >= 0) close(fd);
        return st;
    }
    g = calloc(1, sizeof *g);
    if (!g) {
        if (fd >= 0) close(fd);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "shm: calloc");
    }
    g->fd = fd;
    g->base = MAP_FAILED;
    g->world = world;
    if (opts) g->opts = *opts;
    g->opts.shm_dir = NULL; /* borrowed string: not kept */
    g->total = h.total_bytes;
    tdm_shm_geom_from(&h, &g->geom);
    if (!where) where = opts && opts->shm_dir ? opts->shm_dir : "memfd (shared memory)";
    TDM_TRY(tdm_shm_check_memory(g->total, world, opts));
    if (g->fd < 0) TDM_TRY(tdm_shm_open_backing(opts, &g->fd));
    int rc;
    do rc = posix_fallocate(g->fd, 0, (off_t)g->total);
    while (rc == EINTR);
    if (rc) {
        st = tdm_error_set(rc == ENOSPC ? TDM_STATUS_OUT_OF_MEMORY : TDM_STATUS_SYSTEM,
                           "shm: cannot reserve %zu bytes (%.1f MiB) for %d ranks in %s: %s; "
                           "free space there or lower slot_bytes/arena_bytes",
                           g->total, (double)g->total / (1 << 20), world, where, strerror(rc));
        goto fail;
    }
    g->base = mmap(NULL, g->total, PROT_READ | PROT_WRITE, MAP_SHARED, g->fd, 0);
    if (g->base == MAP_FAILED) {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "shm: mmap of %zu bytes: %s", g->total,
                           strerror(errno));
        goto fail;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    h.job_id = job_id ? job_id : ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ tdm_time_ns();
    /* fallocate zeroed everything: flags, states, abort word start at 0. */
    memcpy(g->base, &h, offsetof(tdm_shm_header, abort_word));
    TDM_INFO(SHM, "segment: %zu bytes for %d ranks (slots %d x %zu, arena %zu per rank), %s",
             g->total, world, TDM_SHM_NBUF, (size_t)h.slot_bytes, (size_t)h.arena_bytes, where);
    *out = g;
    return TDM_STATUS_OK;
fail:
    tdm_shm_group_free(g);
    return st;
}

void tdm_shm_group_free(tdm_shm_group *g)
{
    if (!g) return;
    if (g->base != MAP_FAILED) munmap(g->base, g->total);
    if (g->fd >= 0) close(g->fd);
    free(g);
}

int tdm_shm_group_fd(const tdm_shm_group *g) { return g->fd; }
size_t tdm_shm_group_bytes(const tdm_shm_group *g) { return g->total; }

static tdm_shm_ctrl *tdm_shm_group_ctrl(tdm_shm_group *g, int rank)
{
    return tdm_shm_geom_ctrl(&g->geom, g->base, rank);
}

void tdm_shm_group_set_pid(tdm_shm_group *g, int rank, pid_t pid)
{
    if (!g || rank < 0 || rank >= g->world) return;
    atomic_store(&tdm_shm_group_ctrl(g, rank)->pid, (int32_t)pid);
}

void tdm_shm_group_mark_ended(tdm_shm_group *g, int rank, int wstatus)
{
    if (!g || rank < 0 || rank >= g->world) return;
    tdm_shm_ctrl *k = tdm_shm_group_ctrl(g, rank);
    int32_t state = atomic_load(&k->state);
    int failed = !(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
    if (failed) {
        /* A failure, even after freeing its communicator: the group stops.
         * Raised before the state changes, so that a peer that sees DEAD
         * finds this reason (with its detail) already published. */
        char why[128];
        tdm_shm_wait_status_str(wstatus, why, sizeof why);
        tdm_shm_raise(g->base, &g->geom, g->base, g->world, &g->raising, rank,
                      TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s%s", rank,
                      (int)atomic_load(&k->pid), why,
                      state == TDM_SHM_STATE_LEFT ? " after freeing its communicator" : "");
    }
    /* The release stores pair with the acquire loads in
     * tdm_shm_check_peers: wstatus is visible with `ended` and the state.
     * An exit 0 only records the end: whoever waits for the rank later
     * learns it is gone, and how; nobody else is disturbed. */
    atomic_store_explicit(&k->wstatus, wstatus, memory_order_relaxed);
    atomic_store_explicit(&k->ended, 1, memory_order_release);
    if (failed) atomic_store_explicit(&k->state, TDM_SHM_STATE_DEAD, memory_order_release);
}

tdm_status tdm_shm_group_export_env(tdm_shm_group *g)
{
    TDM_REQUIRE(g, TDM_STATUS_INVALID_ARG, "tdm_shm_group_export_env: group is NULL");
    int flags = fcntl(g->fd, F_GETFD);
    if (flags < 0 || fcntl(g->fd, F_SETFD, flags & ~FD_CLOEXEC) < 0)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: fcntl(F_SETFD) on fd %d: %s", g->fd,
                             strerror(errno));
    char buf[32];
    snprintf(buf, sizeof buf, "%d", g->fd);
    if (setenv(TDM_SHM_ENV_FD, buf, 1) != 0)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: setenv: %s", strerror(errno));
    return TDM_STATUS_OK;
}

void tdm_shm_comm_set_rank_names(tdm_comm *comm, const int *names)
{
    if (!comm || !names || strcmp(tdm_comm_backend_name(comm), "shm") != 0) return;
    tdm_shm_impl *c = tdm_comm_impl(comm);
    for (int r = 0; r < c->world; r++) c->job_rank[r] = names[r];
    c->named_by_job = 1;
}

/* --- the backend ---------------------------------------------------------- */

static tdm_status tdm_shm_abort_op(void *impl, const char *reason)
{
    tdm_shm_impl *c = impl;
    /* on a split communicator the reason also stops the job (its root),
     * whose ranks read it "by job rank": the raiser is named by job rank
     * there and here, never by its rank in the split (rank 0 of a
     * pipeline's replica 1 is not the job's rank 0) */
    if (c->root && !c->named_by_job)
        tdm_shm_raise_rank(c, c->rank, TDM_STATUS_ABORTED, "aborted by job rank %d: %s",
                           c->job_rank[c->rank], reason);
    else
        tdm_shm_raise_rank(c, c->rank, TDM_STATUS_ABORTED, "aborted by rank %d: %s",
                           tdm_shm_name(c, c->rank), reason);
    return TDM_STATUS_OK;
}

static const char *tdm_shm_last_algo(void *impl) { return ((tdm_shm_impl *)impl)->algo; }

static tdm_status tdm_shm_alloc_op(void *impl, size_t nbytes, void **ptr)
{
    tdm_shm_impl *c = impl;
    size_t n = tdm_shm_round_up(nbytes ? nbytes : 1, TDM_SHM_LINE);
    TDM_REQUIRE(n <= c->geom.arena_bytes - c->arena_used, TDM_STATUS_OUT_OF_MEMORY,
                "shm: zero-copy arena exhausted: %zu bytes requested, %zu of %zu left "
                "(raise opts.arena_bytes)", nbytes, (size_t)(c->geom.arena_bytes - c->arena_used),
                (size_t)c->geom.arena_bytes);
    *ptr = tdm_shm_arena_of(c, c->rank) + c->arena_used;
    c->arena_used += n;
    return TDM_STATUS_OK;
}

static void tdm_shm_destroy(void *impl)
{
    tdm_shm_impl *c = impl;
    if (!c) return;
    tdm_shm_heartbeat_stop(c);
    tdm_shm_ctrl *k = tdm_shm_ctrl_of(c, c->rank);
    int32_t alive = TDM_SHM_STATE_ALIVE;
    atomic_compare_exchange_strong(&k->state, &alive, TDM_SHM_STATE_LEFT);
    /* A peer waiting on us learns we left at its next liveness check;
     * wake it now rather than in 100 ms. */
    tdm_shm_flag_publish(&k->flag, atomic_load(&k->flag.value));
    if (c->unmap) munmap(c->base, c->total);
    free(c);
}

static const tdm_comm_ops tdm_shm_ops = {
    .name = "shm",
    .run = tdm_shm_run,
    .abort = tdm_shm_abort_op,
    .last_algo = tdm_shm_last_algo,
    .alloc = tdm_shm_alloc_op,
    .destroy = tdm_shm_destroy,
    .half_types = 1,
    .split = tdm_shm_split,
};

tdm_status tdm_shm_comm_tuning(const tdm_comm *comm, tdm_shm_tuning *out)
{
    TDM_REQUIRE(comm && out && !strcmp(tdm_comm_backend_name(comm), tdm_shm_ops.name),
                TDM_STATUS_INVALID_ARG, "tdm_shm_comm_tuning: not an shm communicator");
    const tdm_shm_impl *c = tdm_comm_impl(comm);
    *out = (tdm_shm_tuning){.cores = c->geom.cores, .spin = c->spin, .spin_async = c->spin_async,
                            .one_shot_max_bytes = c->geom.one_shot_max};
    return TDM_STATUS_OK;
}

tdm_status tdm_shm_comm_alloc(tdm_comm *comm, size_t nbytes, void **ptr)
{
    return tdm_comm_alloc(comm, nbytes, ptr);
}

/* Checks the header of a mapping of `size` bytes before any offset in it
 * is used. */
static tdm_status tdm_shm_validate(const tdm_shm_header *h, size_t size, int world)
{
    TDM_REQUIRE(size >= TDM_SHM_PAGE, TDM_STATUS_FORMAT,
                "shm: segment of %zu bytes is smaller than its header (%d bytes)", size,
                TDM_SHM_PAGE);
    TDM_REQUIRE(h->magic == TDM_SHM_MAGIC, TDM_STATUS_FORMAT,
                "shm: bad magic 0x%016llx (expected 0x%016llx): not a tandem segment",
                (unsigned long long)h->magic, (unsigned long long)TDM_SHM_MAGIC);
    TDM_REQUIRE(h->version == TDM_SHM_VERSION, TDM_STATUS_FORMAT,
                "shm: segment version %u, this build speaks version %u", h->version,
                TDM_SHM_VERSION);
    TDM_REQUIRE(h->world == world, TDM_STATUS_MISMATCH,
                "shm: segment was made for %d ranks, but WORLD_SIZE is %d", h->world, world);
    TDM_REQUIRE(h->total_bytes == size, TDM_STATUS_FORMAT,
                "shm: header says %llu bytes but the segment has %zu",
                (unsigned long long)h->total_bytes, size);
    /* Recompute the layout from the header's own parameters: any offset
     * that does not match is refused. */
    TDM_REQUIRE(h->cores >= 1 && h->cores <= TDM_SHM_MAX_CORES, TDM_STATUS_FORMAT,
                "shm: header says the ranks have %d cores (expected 1..%d)", (int)h->cores,
                TDM_SHM_MAX_CORES);
    tdm_shm_opts o = {.slot_bytes = h->slot_bytes, .arena_bytes = h->arena_bytes,
                      .one_shot_max_bytes = h->one_shot_max, .cores = h->cores};
    tdm_shm_header want;
    TDM_REQUIRE(tdm_shm_layout(world, &o, &want) == TDM_STATUS_OK, TDM_STATUS_FORMAT,
                "shm: header has impossible sizes (slot %llu bytes)",
                (unsigned long long)h->slot_bytes);
    TDM_REQUIRE(h->header_bytes == want.header_bytes && h->nbuf == want.nbuf &&
                    h->ctrl_off == want.ctrl_off && h->ctrl_bytes == want.ctrl_bytes &&
                    h->reason_off == want.reason_off &&
                    h->slot_off == want.slot_off && h->p2p_off == want.p2p_off &&
                    h->p2p_bytes == want.p2p_bytes && h->arena_off == want.arena_off &&
                    h->total_bytes == want.total_bytes,
                TDM_STATUS_FORMAT,
                "shm: header layout does not match its sizes (built by another version?)");
    return TDM_STATUS_OK;
}

static tdm_status tdm_shm_join(tdm_comm **out, void *base, size_t total, int unmap, int rank,
                               int world, const tdm_shm_opts *opts, uint64_t expect_job)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_shm_impl *c = NULL;
    /* Validate a private snapshot, then keep what was validated: the
     * shared header may change under us (another process writes it), so
     * neither the checks nor any later access reads its layout again. */
    tdm_shm_header snap = {0};
    tdm_shm_geom geom;
    if (total >= TDM_SHM_PAGE) memcpy(&snap, base, offsetof(tdm_shm_header, abort_word));
    TDM_TRY(tdm_shm_validate(&snap, total, world));
    /* a segment found by name must be this job's, not one of the same name */
    if (expect_job && snap.job_id != expect_job) {
        st = tdm_error_set(TDM_STATUS_MISMATCH, "shm: the segment belongs to job %016llx, not "
                           "to this job (%016llx)", (unsigned long long)snap.job_id,
                           (unsigned long long)expect_job);
        goto fail;
    }
    tdm_shm_geom_from(&snap, &geom);
    if (rank < 0 || rank >= world) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "shm: rank %d out of range 0..%d", rank,
                           world - 1);
        goto fail;
    }
    c = calloc(1, sizeof *c);
    if (!c) { st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "shm: calloc"); goto fail; }
    c->hdr = base;
    c->geom = geom;
    c->base = base;
    c->total = total;
    c->unmap = unmap;
    c->rank = rank;
    c->world = world;
    for (int r = 0; r < world; r++) c->job_rank[r] = r;
    c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : TDM_SHM_DEFAULT_TIMEOUT_MS;
    /* Spin only while the ranks fit the cores they can use together (the
     * header's, the same for every rank): not this process's affinity,
     * which is one core for a rank pinned to its own (mpirun --bind-to
     * core), where spinning is exactly right. */
    c->spin = !(opts && opts->no_spin) && world <= geom.cores;
    /* An asynchronous call waits on the progress thread while the rank's
     * own thread computes: two busy threads per rank. */
    c->spin_async = c->spin && 2 * world <= geom.cores;
    c->spin_now = c->spin;
    c->spin_ns = TDM_SHM_SPIN_NS;
    c->algo = "none";
    /* Tuning knob for measurements (docs/perf/shm.md), not an interface. */
    const char *nt = getenv("TANDEM_SHM_NT_BYTES");
    if (nt && *nt) tdm_shm_nt_threshold = (size_t)strtoull(nt, NULL, 10);
    const char *spin = getenv("TANDEM_SHM_SPIN_US");
    if (spin && *spin) c->spin_ns = (uint64_t)strtoull(spin, NULL, 10) * 1000;
    c->cur_name = "init";
    const char *late = getenv("TANDEM_SHM_TEST_LATE_CHECKS");
    c->test_late_checks = late && *late && atoi(late) == rank;
    const char *gone = getenv("TANDEM_SHM_TEST_GONE_PAUSE");
    c->test_gone_pause = gone && *gone && atoi(gone) == rank;
    int64_t stall_ms = opts ? opts->stall_ms : 0;
    const char *stall = getenv("TANDEM_SHM_STALL_MS");
    if (!stall_ms && stall && *stall) {
        char *end;
        errno = 0;
        long long v = strtoll(stall, &end, 10);
        if (errno || *end) {
            st = tdm_error_set(TDM_STATUS_INVALID_ARG, "shm: TANDEM_SHM_STALL_MS='%s' is not "
                               "an integer (ms; 0 or negative: no stall detection)", stall);
            goto fail;
        }
        stall_ms = v > 0 ? v : -1;
    }
    if (!stall_ms) stall_ms = TDM_SHM_DEFAULT_STALL_MS;
    if (stall_ms > 0 && stall_ms < TDM_SHM_MIN_STALL_MS) stall_ms = TDM_SHM_MIN_STALL_MS;
    c->stall_ns = stall_ms > 0 ? (uint64_t)stall_ms * 1000000ull : 0;
    tdm_shm_ctrl *k = tdm_shm_ctrl_of(c, rank);
    /* claim the rank atomically: two processes joining as the same rank
     * must not both succeed */
    int32_t state = TDM_SHM_STATE_EMPTY;
    if (!atomic_compare_exchange_strong(&k->state, &state, TDM_SHM_STATE_ALIVE)) {
        st = tdm_error_set(TDM_STATUS_MISMATCH, "shm: rank %d already joined this segment "
                           "(pid %d)", rank, (int)atomic_load(&k->pid));
        goto fail;
    }
    atomic_store(&k->pid, (int32_t)getpid());
    /* Peers read a beat of 0 as "no heartbeat" and never call this rank
     * stopped on its account; without the thread it stays 0. */
    if (world > 1 && tdm_shm_heartbeat_start(c) != TDM_STATUS_OK)
        TDM_WARN(SHM, "rank %d: %s; peers will not tell if this rank stops", rank,
                 tdm_error_message());
    TDM_INFO(SHM, "rank %d of %d joined (job %016llx, %d cores, %s waits, one-shot <= %zu "
             "bytes)", rank, world, (unsigned long long)snap.job_id, geom.cores,
             c->spin ? "spinning" : "sleeping", geom.one_shot_max);
    TDM_CHECK(tdm_comm_create(out, &tdm_shm_ops, c, rank, world));
    tdm_comm_fr_set_job(*out, snap.job_id);   /* unless TANDEM_JOB_ID named the job */
    return TDM_STATUS_OK;
fail:
    if (c) free(c);
    if (unmap) munmap(base, total);
    return st;
}

tdm_status tdm_shm_comm_init(tdm_comm **out, tdm_shm_group *g, int rank,
                             const tdm_shm_opts *opts)
{
    TDM_REQUIRE(out && g, TDM_STATUS_INVALID_ARG, "tdm_shm_comm_init: NULL argument");
    *out = NULL;
    tdm_shm_opts o = g->opts;
    if (opts) {
        if (opts->timeout_ms) o.timeout_ms = opts->timeout_ms;
        if (opts->stall_ms) o.stall_ms = opts->stall_ms;
        o.no_spin = opts->no_spin;
    }
    return tdm_shm_join(out, g->base, g->total, 0, rank, g->world, &o, 0);
}

tdm_status tdm_shm_comm_attach_fd(tdm_comm **out, int fd, int rank, int world,
                                  const tdm_shm_opts *opts)
{
    return tdm_shm_attach_fd_job(out, fd, rank, world, opts, 0);
}

tdm_status tdm_shm_attach_fd_job(tdm_comm **out, int fd, int rank, int world,
                                 const tdm_shm_opts *opts, uint64_t expect_job)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "tdm_shm_comm_attach_fd: out is NULL");
    *out = NULL;
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: fstat of fd %d: %s", fd, strerror(errno));
    size_t size = (size_t)sb.st_size;
    TDM_REQUIRE(size >= TDM_SHM_PAGE, TDM_STATUS_FORMAT,
                "shm: fd %d holds %zu bytes, less than a segment header (%d bytes)", fd, size,
                TDM_SHM_PAGE);
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: mmap of fd %d (%zu bytes): %s", fd, size,
                             strerror(errno));
    return tdm_shm_join(out, base, size, 1, rank, world, opts, expect_job);
}

static tdm_status tdm_shm_env_int(const char *name, int lo, int hi, int *out)
{
    const char *s = getenv(name);
    TDM_REQUIRE(s && *s, TDM_STATUS_INVALID_ARG,
                "shm: %s is not set (start ranks with `tandem launch`)", name);
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    TDM_REQUIRE(!errno && !*end && v >= lo && v <= hi, TDM_STATUS_INVALID_ARG,
                "shm: %s='%s' is not an integer in %d..%d", name, s, lo, hi);
    *out = (int)v;
    return TDM_STATUS_OK;
}

tdm_status tdm_shm_comm_init_from_env(tdm_comm **out, const tdm_shm_opts *opts)
{
    int world = 0, rank = 0, fd = -1;
    TDM_CHECK(tdm_shm_env_int("WORLD_SIZE", 1, TDM_SHM_MAX_RANKS, &world));
    TDM_CHECK(tdm_shm_env_int("RANK", 0, world - 1, &rank));
    TDM_CHECK(tdm_shm_env_int(TDM_SHM_ENV_FD, 0, 1 << 20, &fd));
    int flags = fcntl(fd, F_GETFD);
    TDM_REQUIRE(flags >= 0, TDM_STATUS_INVALID_ARG,
                "shm: %s=%d is not an open file descriptor in this process (was it "
                "closed on exec?)", TDM_SHM_ENV_FD, fd);
    TDM_CHECK(tdm_shm_comm_attach_fd(out, fd, rank, world, opts));
    /* The launcher cleared close-on-exec so that this rank could inherit
     * the segment; restore it, so that programs this rank runs in turn
     * (a shell, a data loader) never get write access to the group. */
    if (!(flags & FD_CLOEXEC) && fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0)
        TDM_WARN(SHM, "fcntl(F_SETFD, FD_CLOEXEC) on %s=%d: %s", TDM_SHM_ENV_FD, fd,
                 strerror(errno));
    return TDM_STATUS_OK;
}
