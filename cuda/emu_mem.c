/* cuda/emu_mem.c: the CUDA emulator's table of device allocations and the
 * ownership checks on it (cuda/emu_impl.h). On a GPU a host pointer given
 * to a kernel, a device pointer given to the host side of a copy, or
 * cuda:0's memory used on cuda:1 faults or corrupts; on the emulator all
 * of them are host memory and would silently work, so every emulated
 * allocation is entered here and every emulated entry looks its pointers
 * up. One process-wide table sorted by base address (binary search, under
 * one mutex: a few lookups per call, thousands of entries at most), plus a
 * FIFO quarantine of freed blocks, poisoned, that keeps their addresses
 * from being reused for a while so that a late use reads as one. Not the
 * entries that call the checks (cuda/emulator.c, cuda/emu_check.c). */
#include "cuda/emu_impl.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "cuda/device_cuda_impl.h"

/* Freed blocks kept before their memory goes back to malloc: enough for a
 * training step's worth of temporaries, bounded so that a long run's
 * memory stays close to what it uses. */
#define TDM_CUDA_EMU_QUARANTINE_BLOCKS 256
#define TDM_CUDA_EMU_QUARANTINE_BYTES ((size_t)64 << 20)
/* Freed memory reads as NaN (0xffffffff) to host code that bypasses the
 * checks. */
#define TDM_CUDA_EMU_POISON 0xff

typedef enum tdm_emu_state {
    TDM_EMU_LIVE = 0,
    TDM_EMU_FREED = 1, /* quarantined: still allocated, poisoned */
} tdm_emu_state;

typedef struct tdm_emu_range {
    uintptr_t base;
    size_t nbytes;
    int dev;              /* the GPU's index */
    tdm_emu_state state;
} tdm_emu_range;

static struct {
    pthread_mutex_t mu;
    tdm_emu_range *r; /* sorted by base; ranges never overlap */
    size_t n, cap, live;
    struct {
        void *p[TDM_CUDA_EMU_QUARANTINE_BLOCKS]; /* FIFO ring of freed bases */
        size_t head, n, nbytes;
    } q;
} tdm_emu_tab = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The last range whose base is <= p, or -1. Called under mu. */
static ptrdiff_t tdm_emu_find(uintptr_t p)
{
    size_t lo = 0, hi = tdm_emu_tab.n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (tdm_emu_tab.r[mid].base <= p) lo = mid + 1;
        else hi = mid;
    }
    return (ptrdiff_t)lo - 1;
}

static void tdm_emu_remove_at(size_t i)
{
    memmove(&tdm_emu_tab.r[i], &tdm_emu_tab.r[i + 1],
            (tdm_emu_tab.n - i - 1) * sizeof tdm_emu_tab.r[0]);
    tdm_emu_tab.n--;
}

/* A process forked while another thread holds mu would inherit it held
 * for good (DDP's ranks are forked from processes that may drive devices
 * from threads): fork takes it first and both sides release it. */
static void tdm_emu_fork_lock(void) { pthread_mutex_lock(&tdm_emu_tab.mu); }
static void tdm_emu_fork_unlock(void) { pthread_mutex_unlock(&tdm_emu_tab.mu); }
static void tdm_emu_fork_register(void)
{
    (void)pthread_atfork(tdm_emu_fork_lock, tdm_emu_fork_unlock, tdm_emu_fork_unlock);
}
static pthread_once_t tdm_emu_fork_once = PTHREAD_ONCE_INIT;

tdm_status tdm_cuda_emu_mem_add(const tdm_device *d, void *p, size_t nbytes)
{
    uintptr_t b = (uintptr_t)p;
    tdm_status st = TDM_STATUS_OK;
    (void)pthread_once(&tdm_emu_fork_once, tdm_emu_fork_register);
    pthread_mutex_lock(&tdm_emu_tab.mu);
    if (tdm_emu_tab.n == tdm_emu_tab.cap) {
        size_t cap = tdm_emu_tab.cap ? 2 * tdm_emu_tab.cap : 256;
        tdm_emu_range *r = realloc(tdm_emu_tab.r, cap * sizeof *r);
        if (!r) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                               "%s: cannot grow the emulator's allocation table to %zu entries",
                               d->name, cap);
            goto done;
        }
        tdm_emu_tab.r = r;
        tdm_emu_tab.cap = cap;
    }
    /* malloc never hands out memory that is still allocated, and freed
     * blocks stay allocated while quarantined: no range overlaps p */
    size_t at = (size_t)(tdm_emu_find(b) + 1);
    memmove(&tdm_emu_tab.r[at + 1], &tdm_emu_tab.r[at],
            (tdm_emu_tab.n - at) * sizeof tdm_emu_tab.r[0]);
    tdm_emu_tab.r[at] = (tdm_emu_range){b, nbytes, d->index, TDM_EMU_LIVE};
    tdm_emu_tab.n++;
    tdm_emu_tab.live++;
done:
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return st;
}

tdm_status tdm_cuda_emu_mem_disown(tdm_device *d, void *p)
{
    tdm_status st = TDM_STATUS_OK;
    pthread_mutex_lock(&tdm_emu_tab.mu);
    ptrdiff_t i = tdm_emu_find((uintptr_t)p);
    if (i >= 0 && tdm_emu_tab.r[i].base == (uintptr_t)p &&
        tdm_emu_tab.r[i].state == TDM_EMU_LIVE && tdm_emu_tab.r[i].dev == d->index) {
        tdm_emu_remove_at((size_t)i);
        tdm_emu_tab.live--;
    } else {
        st = tdm_error_set(TDM_STATUS_SYSTEM, "%s: disowning %p: not the start of memory "
                           "this GPU allocated or adopted", d->name, p);
    }
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return st;
}

/* Gives the oldest quarantined blocks back to malloc. Called under mu. */
static void tdm_emu_quarantine_trim(void)
{
    while (tdm_emu_tab.q.n > 0 && (tdm_emu_tab.q.n >= TDM_CUDA_EMU_QUARANTINE_BLOCKS ||
                                   tdm_emu_tab.q.nbytes > TDM_CUDA_EMU_QUARANTINE_BYTES)) {
        void *p = tdm_emu_tab.q.p[tdm_emu_tab.q.head];
        tdm_emu_tab.q.head = (tdm_emu_tab.q.head + 1) % TDM_CUDA_EMU_QUARANTINE_BLOCKS;
        tdm_emu_tab.q.n--;
        ptrdiff_t i = tdm_emu_find((uintptr_t)p);
        if (i >= 0 && tdm_emu_tab.r[i].base == (uintptr_t)p) {
            tdm_emu_tab.q.nbytes -= tdm_emu_tab.r[i].nbytes;
            tdm_emu_remove_at((size_t)i);
        }
        tdm_device_host_mem_release(p);
    }
}

tdm_status tdm_cuda_emu_mem_free(tdm_device *d, void *p)
{
    uintptr_t b = (uintptr_t)p;
    tdm_status st = TDM_STATUS_OK;
    pthread_mutex_lock(&tdm_emu_tab.mu);
    ptrdiff_t i = tdm_emu_find(b);
    tdm_emu_range *r = i >= 0 ? &tdm_emu_tab.r[i] : NULL;
    int inside = r && (b < r->base + r->nbytes || b == r->base);
    if (inside && r->base == b && r->state == TDM_EMU_LIVE && r->dev == d->index) {
        tdm_device_host_mem_uncount(d, p);
        memset(p, TDM_CUDA_EMU_POISON, r->nbytes);
        r->state = TDM_EMU_FREED;
        tdm_emu_tab.live--;
        size_t nb = r->nbytes;
        tdm_emu_quarantine_trim(); /* makes room in the ring (r may move) */
        size_t tail = (tdm_emu_tab.q.head + tdm_emu_tab.q.n) % TDM_CUDA_EMU_QUARANTINE_BLOCKS;
        tdm_emu_tab.q.p[tail] = p;
        tdm_emu_tab.q.n++;
        tdm_emu_tab.q.nbytes += nb;
        tdm_emu_quarantine_trim(); /* then keeps the bytes bounded */
        goto done;
    }
    /* cudaFree's answer to each of these is cudaErrorInvalidValue, or
     * worse: a block of someone else freed under them */
    if (!inside)
        st = tdm_error_set(TDM_STATUS_SYSTEM,
                           "%s: cudaFree(%p): not an allocation of any emulated GPU (host "
                           "memory, or freed long ago): an invalid free (cudaErrorInvalidValue)",
                           d->name, p);
    else if (r->state == TDM_EMU_FREED)
        st = tdm_error_set(TDM_STATUS_SYSTEM,
                           "%s: cudaFree(%p): double free of a %zu-byte block of cuda-emu:%d "
                           "freed before (cudaErrorInvalidValue)",
                           d->name, p, r->nbytes, r->dev);
    else if (r->base != b)
        st = tdm_error_set(TDM_STATUS_SYSTEM,
                           "%s: cudaFree(%p): %zu bytes into a %zu-byte block of cuda-emu:%d "
                           "at %p, not its start (cudaErrorInvalidValue)",
                           d->name, p, (size_t)(b - r->base), r->nbytes, r->dev,
                           (void *)r->base);
    else
        st = tdm_error_set(TDM_STATUS_SYSTEM,
                           "%s: cudaFree(%p): a %zu-byte block of cuda-emu:%d, freed through "
                           "%s: free it with the device that allocated it",
                           d->name, p, r->nbytes, r->dev, d->name);
done:
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return st;
}

/* What [p, p + nbytes) is, for the checks. */
typedef enum tdm_emu_what {
    TDM_EMU_HOST,     /* touches no range */
    TDM_EMU_INSIDE,   /* wholly inside range r */
    TDM_EMU_PAST_END, /* starts in r, ends past its end */
    TDM_EMU_INTO,     /* starts in host memory, runs into r */
} tdm_emu_what;

static tdm_emu_what tdm_emu_classify(uintptr_t p, size_t nbytes, tdm_emu_range *out)
{
    ptrdiff_t i = tdm_emu_find(p);
    if (i >= 0) {
        const tdm_emu_range *r = &tdm_emu_tab.r[i];
        if (p < r->base + r->nbytes) {
            *out = *r;
            return nbytes <= r->nbytes - (p - r->base) ? TDM_EMU_INSIDE : TDM_EMU_PAST_END;
        }
    }
    if ((size_t)(i + 1) < tdm_emu_tab.n && tdm_emu_tab.r[i + 1].base - p < nbytes) {
        *out = tdm_emu_tab.r[i + 1];
        return TDM_EMU_INTO;
    }
    return TDM_EMU_HOST;
}

/* "is host memory", "is memory of cuda-emu:0", ... for the messages. */
static void tdm_emu_describe(char *buf, size_t len, tdm_emu_what w, const tdm_emu_range *r,
                             uintptr_t p, size_t nbytes)
{
    const char *freed = r->state == TDM_EMU_FREED ? "freed " : "";
    switch (w) {
    case TDM_EMU_HOST: snprintf(buf, len, "is host memory"); break;
    case TDM_EMU_INSIDE:
        if (r->state == TDM_EMU_FREED)
            snprintf(buf, len, "is inside a %zu-byte block of cuda-emu:%d at %p that was freed "
                     "(use after free)", r->nbytes, r->dev, (void *)r->base);
        else
            snprintf(buf, len, "is memory of cuda-emu:%d", r->dev);
        break;
    case TDM_EMU_PAST_END:
        snprintf(buf, len, "runs %zu bytes past the end of a %s%zu-byte block of cuda-emu:%d "
                 "at %p", (size_t)(p + nbytes - (r->base + r->nbytes)), freed, r->nbytes,
                 r->dev, (void *)r->base);
        break;
    case TDM_EMU_INTO:
        snprintf(buf, len, "starts in host memory and runs into a %s%zu-byte block of "
                 "cuda-emu:%d at %p", freed, r->nbytes, r->dev, (void *)r->base);
        break;
    }
}

/* The one line every failed check gives, in the words of a GPU's fault. */
static tdm_status tdm_emu_fail(const tdm_device *d, const char *call, const char *arg,
                               const void *p, size_t nbytes, tdm_emu_what w,
                               const tdm_emu_range *r, const char *want)
{
    char what[256];
    tdm_emu_describe(what, sizeof what, w, r, (uintptr_t)p, nbytes);
    return tdm_error_set(TDM_STATUS_SYSTEM,
                         "%s: %s: %s = %p (%zu bytes) %s, not %s: on a GPU an illegal "
                         "address (cudaErrorIllegalAddress)",
                         d->name, call, arg, p, nbytes, what, want);
}

/* Called under mu. */
static tdm_status tdm_emu_check_dev_locked(const tdm_device *d, const char *call,
                                           const char *arg, const void *p, size_t nbytes)
{
    if (!p || !nbytes) return TDM_STATUS_OK;
    tdm_emu_range r = {0};
    tdm_emu_what w = tdm_emu_classify((uintptr_t)p, nbytes, &r);
    if (w == TDM_EMU_INSIDE && r.state == TDM_EMU_LIVE && r.dev == d->index)
        return TDM_STATUS_OK;
    char want[64];
    snprintf(want, sizeof want, "memory of %s", d->name);
    return tdm_emu_fail(d, call, arg, p, nbytes, w, &r, want);
}

/* Host memory: not inside any emulated block, live or quarantined. */
static tdm_status tdm_emu_check_host_locked(const tdm_device *d, const char *call,
                                            const char *arg, const void *p, size_t nbytes)
{
    if (!p || !nbytes) return TDM_STATUS_OK;
    tdm_emu_range r = {0};
    tdm_emu_what w = tdm_emu_classify((uintptr_t)p, nbytes, &r);
    if (w == TDM_EMU_HOST) return TDM_STATUS_OK;
    return tdm_emu_fail(d, call, arg, p, nbytes, w, &r, "host memory");
}

tdm_status tdm_cuda_emu_sticky(tdm_device *d)
{
    const char *f = __atomic_load_n(&tdm_cuda_impl(d)->emu_fault, __ATOMIC_ACQUIRE);
    if (!f) return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_SYSTEM, "%s (an earlier fault on this device; every call "
                         "fails after it, as after a GPU's sticky error)", f);
}

void tdm_cuda_emu_sticky_clear(tdm_device *d)
{
    free(__atomic_exchange_n(&tdm_cuda_impl(d)->emu_fault, NULL, __ATOMIC_ACQ_REL));
}

tdm_status tdm_cuda_emu_check_args(tdm_device *d, const char *call,
                                   const tdm_cuda_emu_arg *args, int n_args)
{
    if (d->kind == TDM_DEVICE_HOST) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_emu_sticky(d));
    tdm_status st = TDM_STATUS_OK;
    pthread_mutex_lock(&tdm_emu_tab.mu);
    for (int i = 0; i < n_args && !st; i++)
        st = tdm_emu_check_dev_locked(d, call, args[i].name, args[i].p, args[i].nbytes);
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return st;
}

static const char *const tdm_emu_kind_name[] = {
    [TDM_CUDA_EMU_H2H] = "host to host",     [TDM_CUDA_EMU_H2D] = "host to device",
    [TDM_CUDA_EMU_D2H] = "device to host",   [TDM_CUDA_EMU_D2D] = "device to device",
    [TDM_CUDA_EMU_DEFAULT] = "default",
};

/* One side of a cudaMemcpyDefault: host memory, or inside a live block of
 * any GPU; 1 when device memory. Called under mu. */
static tdm_status tdm_emu_side_default(const tdm_device *d, const char *call, const char *arg,
                                       const void *p, size_t nbytes, int *is_dev)
{
    tdm_emu_range r = {0};
    tdm_emu_what w = tdm_emu_classify((uintptr_t)p, nbytes, &r);
    *is_dev = w != TDM_EMU_HOST;
    if (w == TDM_EMU_HOST || (w == TDM_EMU_INSIDE && r.state == TDM_EMU_LIVE))
        return TDM_STATUS_OK;
    return tdm_emu_fail(d, call, arg, p, nbytes, w, &r, "host memory or one live block");
}

tdm_status tdm_cuda_emu_check_memcpy(tdm_device *d, const char *call, void *dst,
                                     const void *src, size_t nbytes,
                                     tdm_cuda_emu_copy_kind kind,
                                     tdm_cuda_emu_copy_kind *inferred)
{
    if (d->kind == TDM_DEVICE_HOST) return TDM_STATUS_OK;
    TDM_CHECK(tdm_cuda_emu_sticky(d));
    if (!nbytes) return TDM_STATUS_OK;
    char where[96];
    snprintf(where, sizeof where, "%s (%s)", call,
             tdm_emu_kind_name[kind <= TDM_CUDA_EMU_DEFAULT ? kind : TDM_CUDA_EMU_DEFAULT]);
    tdm_status st = TDM_STATUS_OK;
    int dst_dev = 0, src_dev = 0;
    pthread_mutex_lock(&tdm_emu_tab.mu);
    switch (kind) {
    case TDM_CUDA_EMU_H2H:
        st = tdm_emu_check_host_locked(d, where, "dst", dst, nbytes);
        if (!st) st = tdm_emu_check_host_locked(d, where, "src", src, nbytes);
        break;
    case TDM_CUDA_EMU_H2D:
        st = tdm_emu_check_dev_locked(d, where, "dst", dst, nbytes);
        if (!st) st = tdm_emu_check_host_locked(d, where, "src", src, nbytes);
        dst_dev = 1;
        break;
    case TDM_CUDA_EMU_D2H:
        st = tdm_emu_check_host_locked(d, where, "dst", dst, nbytes);
        if (!st) st = tdm_emu_check_dev_locked(d, where, "src", src, nbytes);
        src_dev = 1;
        break;
    case TDM_CUDA_EMU_D2D:
        st = tdm_emu_check_dev_locked(d, where, "dst", dst, nbytes);
        if (!st) st = tdm_emu_check_dev_locked(d, where, "src", src, nbytes);
        dst_dev = src_dev = 1;
        break;
    default:
        st = tdm_emu_side_default(d, where, "dst", dst, nbytes, &dst_dev);
        if (!st) st = tdm_emu_side_default(d, where, "src", src, nbytes, &src_dev);
        break;
    }
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    if (inferred)
        *inferred = dst_dev ? (src_dev ? TDM_CUDA_EMU_D2D : TDM_CUDA_EMU_H2D)
                            : (src_dev ? TDM_CUDA_EMU_D2H : TDM_CUDA_EMU_H2H);
    return st;
}

tdm_status tdm_cuda_emu_check_peer(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                   const void *src, size_t nbytes)
{
    TDM_CHECK(tdm_cuda_emu_sticky(dst_dev));
    TDM_CHECK(tdm_cuda_emu_sticky(src_dev));
    if (!nbytes) return TDM_STATUS_OK;
    char where[160];
    snprintf(where, sizeof where, "cudaMemcpyPeerAsync (%s -> %s)", src_dev->name,
             dst_dev->name);
    pthread_mutex_lock(&tdm_emu_tab.mu);
    tdm_status st = tdm_emu_check_dev_locked(dst_dev, where, "dst", dst, nbytes);
    if (!st) st = tdm_emu_check_dev_locked(src_dev, where, "src", src, nbytes);
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return st;
}

size_t tdm_cuda_emu_mem_live(void)
{
    pthread_mutex_lock(&tdm_emu_tab.mu);
    size_t n = tdm_emu_tab.live;
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return n;
}

size_t tdm_cuda_emu_mem_quarantined(void)
{
    pthread_mutex_lock(&tdm_emu_tab.mu);
    size_t n = tdm_emu_tab.q.n;
    pthread_mutex_unlock(&tdm_emu_tab.mu);
    return n;
}
