/* cuda/emulator.c: the CUDA backend's emulator: devices with host memory
 * whose compute entries are the CUDA backend's own (cuda/device_cuda.c)
 * with exec.host set, so every kernel's functor, index decomposition
 * included, runs as a loop on the calling thread instead of a grid on a
 * GPU, and gemm is the host backend's (the same argument list). Host
 * tests run the GPU equivalence suites through it, and
 * TANDEM_CUDA_EMULATOR=N turns "cuda" devices into N of them for whole
 * programs (cuda/cuda.h). Needs no driver and makes no CUDA call. Not the
 * GPU device (cuda/device_cuda.c), not the hooks that choose between the
 * two (cuda/hooks.c). */
#include "cuda/cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device_cuda_impl.h"

int tdm_cuda_emulator_env(void)
{
    static int cached = -1;
    int n = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (n >= 0) return n;
    const char *v = getenv("TANDEM_CUDA_EMULATOR");
    n = 0;
    if (v && *v) {
        char *end;
        long x = strtol(v, &end, 10);
        if (*end || x < 1 || x > 64)
            fprintf(stderr, "tandem: TANDEM_CUDA_EMULATOR='%s' ignored: expected a device count "
                    "1..64\n", v);
        else
            n = (int)x;
    }
    __atomic_store_n(&cached, n, __ATOMIC_RELEASE);
    return n;
}

/* Memory is host memory: copies of every direction are memmove, sync has
 * nothing to wait for. */
static tdm_status emu_alloc(tdm_device *d, size_t nbytes, void **out)
{
    __atomic_fetch_add(&tdm_cuda_impl(d)->emu_allocs, 1, __ATOMIC_RELAXED);
    return tdm_device_host_mem_alloc(d, nbytes, out);
}

static void emu_free(tdm_device *d, void *p)
{
    tdm_device_host_mem_free(d, p);
}

static tdm_status emu_copy(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    (void)d;
    if (nbytes && dst != src) memmove(dst, src, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status emu_memset_zero(tdm_device *d, void *p, size_t nbytes)
{
    (void)d;
    if (nbytes) memset(p, 0, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status emu_sync(tdm_device *d)
{
    (void)d;
    return TDM_STATUS_OK;
}

static tdm_status emu_copy_peer(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                const void *src, size_t nbytes)
{
    (void)src_dev;
    return emu_copy(dst_dev, dst, src, nbytes);
}

/* Pinned memory: the emulator's memory is host memory, there is nothing
 * to pin (tdm_dev_host_pin: UNSUPPORTED, no message kept). */
static tdm_status emu_host_pin(tdm_device *d, void *p, size_t nbytes)
{
    (void)d;
    (void)p;
    (void)nbytes;
    return TDM_STATUS_UNSUPPORTED;
}

static void emu_host_unpin(tdm_device *d, void *p)
{
    (void)d;
    (void)p;
}

/* The copy stream, modelled: a copy is done only when its handle is
 * finished (tdm_dev_xfer_finish), the latest moment a GPU may do it, so
 * that a buffer read or written before its copy's finish gives other
 * bits in the tests rather than passing by luck; the copy itself is the
 * table's own host copy in its direction. */
typedef struct emu_xfer {
    tdm_dev_xfer_dir dir;
    void *dst;
    const void *src;
    size_t nbytes;
} emu_xfer;

static tdm_status emu_copy_async(tdm_device *d, tdm_dev_xfer_dir dir, void *dst,
                                 const void *src, size_t nbytes, void **xfer)
{
    emu_xfer *x = malloc(sizeof *x);
    TDM_REQUIRE(x, TDM_STATUS_OUT_OF_MEMORY, "%s: an asynchronous copy", d->name);
    *x = (emu_xfer){.dir = dir, .dst = dst, .src = src, .nbytes = nbytes};
    __atomic_fetch_add(&tdm_cuda_impl(d)->emu_xfers, 1, __ATOMIC_RELAXED);
    *xfer = x;
    return TDM_STATUS_OK;
}

static tdm_status emu_xfer_finish(tdm_device *d, void *xfer, tdm_dev_xfer_until until)
{
    emu_xfer *x = xfer;
    (void)until;   /* every order is met by copying now: the emulator's work is synchronous */
    const tdm_device_ops *o = d->ops;
    tdm_status st = x->dir == TDM_DEV_XFER_TO_DEVICE
                        ? o->copy_from_host(d, x->dst, x->src, x->nbytes)
                        : o->copy_to_host(d, x->dst, x->src, x->nbytes);
    __atomic_fetch_sub(&tdm_cuda_impl(d)->emu_xfers, 1, __ATOMIC_RELAXED);
    free(x);
    return st;
}

int64_t tdm_cuda_emulator_xfers(const tdm_device *d)
{
    if (!tdm_cuda_device_is_emulator(d)) return -1;
    return __atomic_load_n(&tdm_cuda_impl((tdm_device *)d)->emu_xfers, __ATOMIC_RELAXED);
}

int tdm_cuda_device_is_emulator(const tdm_device *d)
{
    return d && d->ops == &tdm_cuda_emu_ops;
}

int64_t tdm_cuda_emulator_allocs(const tdm_device *d)
{
    if (!tdm_cuda_device_is_emulator(d)) return -1;
    return __atomic_load_n(&tdm_cuda_impl((tdm_device *)d)->emu_allocs, __ATOMIC_RELAXED);
}

static void emu_close(tdm_device *d)
{
    tdm_cuda_dev *c = tdm_cuda_impl(d);
    if (!c) return;
    tdm_device_free(c->host);
    free(c);
    d->impl = NULL;
}

const tdm_device_ops tdm_cuda_emu_ops = {
    .alloc = emu_alloc,
    .free = emu_free,
    .copy = emu_copy,
    .copy_to_host = emu_copy,
    .copy_from_host = emu_copy,
    .memset_zero = emu_memset_zero,
    .sync = emu_sync,
    .close = emu_close,
    .copy_peer = emu_copy_peer,
    .host_pin = emu_host_pin,
    .host_unpin = emu_host_unpin,
    .copy_async = emu_copy_async,
    .xfer_finish = emu_xfer_finish,
    TDM_CUDA_COMPUTE_OPS,
};

static tdm_status tdm_cuda_emulator_make(tdm_device **out, int index, tdm_device_kind kind);

tdm_status tdm_cuda_emulator_open(tdm_device **out)
{
    return tdm_cuda_emulator_make(out, 0, TDM_DEVICE_HOST);
}

tdm_status tdm_cuda_emulator_open_accel(tdm_device **out, int index)
{
    TDM_REQUIRE(index >= 0, TDM_STATUS_INVALID_ARG, "emulator index %d is negative", index);
    return tdm_cuda_emulator_make(out, index, TDM_DEVICE_CUDA);
}

static tdm_status tdm_cuda_emulator_make(tdm_device **out, int index, tdm_device_kind kind)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    tdm_device *d = calloc(1, sizeof *d);
    tdm_cuda_dev *c = calloc(1, sizeof *c);
    if (!d || !c) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate the CUDA emulator");
        goto fail;
    }
    TDM_TRY(tdm_device_open(&c->host, "cpu", 0, 1));
    c->exec.host = 1;
    d->ops = &tdm_cuda_emu_ops;
    d->kind = kind; /* its memory is host memory either way */
    d->index = index;
    d->threads = 1;
    d->impl = c;
    d->mem_counted = 1;
    if (kind == TDM_DEVICE_HOST) snprintf(d->name, sizeof d->name, "cuda-emu");
    else snprintf(d->name, sizeof d->name, "cuda-emu:%d", index);
    *out = d;
    return TDM_STATUS_OK;
fail:
    free(c);
    free(d);
    return st;
}
