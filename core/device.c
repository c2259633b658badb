/* core/device.c: opening and freeing devices, their names, parsing device
 * lists, the scratch buffer, the CUDA backend's registration and the
 * device groups it provides. The tdm_dev_* dispatchers over the ops table
 * are core/device_ops.c; the backends are core/device_host.c and cuda/. */
#include "core/device_impl.h"

#include <ctype.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"

/* Set by the CUDA backend's constructor when it is linked in. */
const tdm_device_cuda_hooks *tdm_device_cuda = NULL;

int tdm_device_host_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static tdm_status tdm_device_cuda_missing(void)
{
    return tdm_error_set(TDM_STATUS_NO_DEVICE,
                         "no CUDA device: this build of tandem has no CUDA backend "
                         "(nvcc was not found when it was built); use --device cpu:N");
}

int tdm_device_cuda_linked(void) { return tdm_device_cuda != NULL; }

tdm_status tdm_device_cuda_count(int *n)
{
    *n = 0;
    if (!tdm_device_cuda) return tdm_device_cuda_missing();
    return tdm_device_cuda->count(n);
}

tdm_status tdm_device_open(tdm_device **out, const char *kind, int index, int threads)
{
    *out = NULL;
    TDM_REQUIRE(index >= 0, TDM_STATUS_INVALID_ARG, "device index %d is negative", index);
    if (!strcmp(kind, "cpu") || !strcmp(kind, "host")) {
        TDM_CHECK(tdm_device_host_open(out, index, threads));
    } else if (!strcmp(kind, "cuda")) {
        if (!tdm_device_cuda) return tdm_device_cuda_missing();
        TDM_CHECK(tdm_device_cuda->open(out, index));
    } else {
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "unknown device kind '%s' (expected cpu or cuda)", kind);
    }
    TDM_INFO(DEVICE, "opened %s (threads %d)", (*out)->name, (*out)->threads);
    return TDM_STATUS_OK;
}

const char *tdm_dev_name(const tdm_device *d) { return d->name; }
tdm_device_kind tdm_dev_kind(const tdm_device *d) { return d->kind; }
int tdm_dev_index(const tdm_device *d) { return d->index; }
int tdm_dev_threads(const tdm_device *d) { return d->threads; }

void tdm_device_free(tdm_device *d)
{
    if (!d) return;
    if (d->scratch) d->ops->free(d, d->scratch);
    if (d->ops && d->ops->close) d->ops->close(d);
    free(d);
}

static int tdm_device_parse_int(const char **p, int *v)
{
    const char *s = *p;
    if (!isdigit((unsigned char)*s)) return 0;
    long x = 0;
    while (isdigit((unsigned char)*s)) {
        x = x * 10 + (*s - '0');
        if (x > 1000000) return 0;
        s++;
    }
    *v = (int)x;
    *p = s;
    return 1;
}

tdm_status tdm_device_list_parse(tdm_device_list *out, const char *spec)
{
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(spec && *spec, TDM_STATUS_INVALID_ARG, "empty device spec (expected cpu, cpu:N, cpu:0,1 or cuda[:0,1])");
    const char *p = spec;
    int cuda = 0;
    if (!strncmp(p, "cpu", 3)) p += 3;
    else if (!strncmp(p, "cuda", 4)) { p += 4; cuda = 1; }
    else
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "device spec '%s': expected cpu, cpu:N, cpu:I,J,... or cuda[:I,J,...]", spec);
    out->kind = cuda ? TDM_DEVICE_CUDA : TDM_DEVICE_HOST;
    int available = -1;
    if (cuda) {
        if (!tdm_device_cuda) return tdm_device_cuda_missing();
        TDM_CHECK(tdm_device_cuda->count(&available));
        if (available <= 0)
            return tdm_error_set(TDM_STATUS_NO_DEVICE, "no CUDA device visible; use --device cpu:N");
    }
    if (*p == '\0') {
        /* "cpu": one host device; "cuda": every visible GPU. */
        out->count = cuda ? available : 1;
        if (out->count > TDM_DEVICE_LIST_MAX) out->count = TDM_DEVICE_LIST_MAX;
        for (int i = 0; i < out->count; i++) out->index[i] = i;
        return TDM_STATUS_OK;
    }
    if (*p != ':')
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "device spec '%s': expected ':' after '%s'",
                             spec, cuda ? "cuda" : "cpu");
    p++;
    int first;
    if (!tdm_device_parse_int(&p, &first))
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "device spec '%s': expected a number after ':'", spec);
    if (*p == '\0' && !cuda) {
        /* cpu:N means N host devices cpu:0..N-1 */
        TDM_REQUIRE(first >= 1, TDM_STATUS_INVALID_ARG,
                    "device spec '%s': need at least one device", spec);
        TDM_REQUIRE(first <= TDM_DEVICE_LIST_MAX, TDM_STATUS_INVALID_ARG,
                    "device spec '%s': at most %d host devices", spec, TDM_DEVICE_LIST_MAX);
        out->count = first;
        for (int i = 0; i < first; i++) out->index[i] = i;
        return TDM_STATUS_OK;
    }
    /* an explicit list: I,J,K */
    out->index[out->count++] = first;
    while (*p == ',') {
        p++;
        int v;
        if (!tdm_device_parse_int(&p, &v))
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "device spec '%s': expected a number after ','", spec);
        TDM_REQUIRE(out->count < TDM_DEVICE_LIST_MAX, TDM_STATUS_INVALID_ARG,
                    "device spec '%s': too many devices (max %d)", spec, TDM_DEVICE_LIST_MAX);
        out->index[out->count++] = v;
    }
    if (*p != '\0')
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "device spec '%s': unexpected '%s'", spec, p);
    for (int i = 0; i < out->count; i++) {
        for (int j = 0; j < i; j++)
            TDM_REQUIRE(out->index[i] != out->index[j], TDM_STATUS_INVALID_ARG,
                        "device spec '%s': device %d listed twice", spec, out->index[i]);
        if (cuda && out->index[i] >= available)
            return tdm_error_set(TDM_STATUS_NO_DEVICE,
                                 "device spec '%s': cuda:%d does not exist (%d visible)", spec,
                                 out->index[i], available);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_scratch(tdm_device *d, size_t nbytes, void **out)
{
    if (nbytes > d->scratch_nbytes || !d->scratch) {
        /* at least double: a batch that grows a little at a time (the
         * last, smaller batch of an epoch never shrinks it) reallocates
         * O(log) times, not every step */
        size_t want = nbytes > 2 * d->scratch_nbytes ? nbytes : 2 * d->scratch_nbytes;
        if (want < 256) want = 256;
        void *p = NULL;
        TDM_CHECK(d->ops->alloc(d, want, &p));
        if (d->scratch) d->ops->free(d, d->scratch);
        d->scratch = p;
        d->scratch_nbytes = want;
    }
    *out = d->scratch;
    return TDM_STATUS_OK;
}

struct tdm_dev_group {
    void *impl;   /* the backend's */
    int n;
};

tdm_status tdm_dev_group_init(tdm_dev_group **out, tdm_device *const *devs, int n)
{
    *out = NULL;
    TDM_REQUIRE(devs && n >= 1, TDM_STATUS_INVALID_ARG, "device group: %d devices", n);
    for (int i = 0; i < n; i++)
        if (!devs[i] || devs[i]->kind != TDM_DEVICE_CUDA) return TDM_STATUS_UNSUPPORTED;
    if (!tdm_device_cuda || !tdm_device_cuda->group_init || !tdm_device_cuda->group_free ||
        !tdm_device_cuda->group_broadcast || !tdm_device_cuda->group_reduce_sum)
        return TDM_STATUS_UNSUPPORTED;
    tdm_dev_group *g = calloc(1, sizeof *g);
    TDM_REQUIRE(g, TDM_STATUS_OUT_OF_MEMORY, "device group: out of memory");
    tdm_status st = tdm_device_cuda->group_init(&g->impl, devs, n);
    if (st != TDM_STATUS_OK) {
        free(g);
        return st;
    }
    g->n = n;
    *out = g;
    return TDM_STATUS_OK;
}

void tdm_dev_group_free(tdm_dev_group *g)
{
    if (!g) return;
    tdm_device_cuda->group_free(g->impl);
    free(g);
}

tdm_status tdm_dev_group_broadcast(tdm_dev_group *g, float *const *bufs, size_t n_elem,
                                   int root)
{
    TDM_REQUIRE(bufs && root >= 0 && root < g->n, TDM_STATUS_INVALID_ARG,
                "device group broadcast: root %d of %d", root, g->n);
    if (n_elem == 0) return TDM_STATUS_OK;
    return tdm_device_cuda->group_broadcast(g->impl, bufs, n_elem, root);
}

tdm_status tdm_dev_group_reduce_sum(tdm_dev_group *g, const float *const *sendbufs,
                                    float *recvbuf, size_t n_elem, int root)
{
    TDM_REQUIRE(sendbufs && recvbuf && root >= 0 && root < g->n, TDM_STATUS_INVALID_ARG,
                "device group reduce: root %d of %d", root, g->n);
    if (n_elem == 0) return TDM_STATUS_OK;
    return tdm_device_cuda->group_reduce_sum(g->impl, sendbufs, recvbuf, n_elem, root);
}

/* ---- the allocator's own accounting (host-memory backends) ---- */

/* Each block starts 64 bytes before the pointer handed out, where its
 * size is kept, so that free can take it off the count. */
#define TDM_DEV_MEM_HEADER 64

tdm_status tdm_device_host_mem_alloc(tdm_device *d, size_t nbytes, void **out)
{
    size_t sz = (nbytes + 63) & ~(size_t)63;
    if (sz == 0) sz = 64;
    char *p = sz <= SIZE_MAX - TDM_DEV_MEM_HEADER ? aligned_alloc(64, sz + TDM_DEV_MEM_HEADER)
                                                  : NULL;
    if (!p)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes", d->name,
                             nbytes);
    memcpy(p, &sz, sizeof sz);
    size_t live = __atomic_add_fetch(&d->mem_live, sz, __ATOMIC_RELAXED);
    size_t peak = __atomic_load_n(&d->mem_peak, __ATOMIC_RELAXED);
    while (live > peak &&
           !__atomic_compare_exchange_n(&d->mem_peak, &peak, live, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    __atomic_add_fetch(&d->mem_allocs, 1, __ATOMIC_RELAXED);
    *out = p + TDM_DEV_MEM_HEADER;
    return TDM_STATUS_OK;
}

void tdm_device_host_mem_uncount(tdm_device *d, void *ptr)
{
    if (!ptr) return;
    size_t sz;
    memcpy(&sz, (char *)ptr - TDM_DEV_MEM_HEADER, sizeof sz);
    __atomic_sub_fetch(&d->mem_live, sz, __ATOMIC_RELAXED);
}

void tdm_device_host_mem_release(void *ptr)
{
    if (ptr) free((char *)ptr - TDM_DEV_MEM_HEADER);
}

void tdm_device_host_mem_free(tdm_device *d, void *ptr)
{
    tdm_device_host_mem_uncount(d, ptr);
    tdm_device_host_mem_release(ptr);
}

tdm_status tdm_dev_mem_query(const tdm_device *d, tdm_dev_mem_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!d->mem_counted) return TDM_STATUS_UNSUPPORTED;
    out->live_bytes = __atomic_load_n(&d->mem_live, __ATOMIC_RELAXED);
    out->peak_bytes = __atomic_load_n(&d->mem_peak, __ATOMIC_RELAXED);
    out->allocs = __atomic_load_n(&d->mem_allocs, __ATOMIC_RELAXED);
    return TDM_STATUS_OK;
}

void tdm_dev_mem_reset_peak(tdm_device *d)
{
    __atomic_store_n(&d->mem_peak, __atomic_load_n(&d->mem_live, __ATOMIC_RELAXED),
                     __ATOMIC_RELAXED);
}
