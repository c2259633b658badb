/* cuda/hooks.c: the CUDA backend as core/device.c sees it
 * (tdm_device_cuda_hooks, core/device_impl.h): count and open, which give
 * emulator devices instead of GPUs under TANDEM_CUDA_EMULATOR, and
 * DataParallel's device group (NCCL over GPUs, host loops over emulator
 * devices). The constructor that registers this table is in
 * cuda/device_cuda.c, the object the installed pkg-config file makes the
 * linker keep (tools/install.sh); referencing tdm_cuda_hooks from there
 * keeps this one too. */
#include "cuda/cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device_cuda_impl.h"
#include "cuda/emu_impl.h"

static tdm_status tdm_cuda_hook_count(int *n)
{
    int emu = tdm_cuda_emulator_env();
    if (emu) {
        *n = emu;
        return TDM_STATUS_OK;
    }
    return tdm_cuda_device_count(n);
}

static tdm_status tdm_cuda_hook_open(tdm_device **out, int index)
{
    int emu = tdm_cuda_emulator_env();
    if (!emu) return tdm_cuda_gpu_open(out, index);
    *out = NULL;
    if (index < 0 || index >= emu)
        return tdm_error_set(TDM_STATUS_NO_DEVICE,
                             "no CUDA device: cuda:%d does not exist (TANDEM_CUDA_EMULATOR=%d "
                             "emulates cuda:0..%d); use --device cuda:0..%d or cpu:N", index, emu,
                             emu - 1, emu - 1);
    return tdm_cuda_emulator_open_accel(out, index);
}

/* DataParallel's group (core/device.h): the NCCL group of cuda/nccl_group.c
 * over real GPUs, or, over emulator devices (host memory), an emulated
 * group whose broadcast and sum are host loops, so that DP's group path
 * (which buffers, which root, in place) is tested without a GPU. A mix of
 * the two, or other devices, is UNSUPPORTED: DP then stages copies. */
typedef struct tdm_cuda_group {
    tdm_cuda_nccl_group *nccl; /* NULL: emulated */
    int n;
    tdm_device *devs[TDM_DEVICE_LIST_MAX]; /* borrowed: the emulated group's, for its checks */
} tdm_cuda_group;

/* The emulated group's ownership check: bufs[i] is n_elem floats of
 * devs[i]'s memory, as NCCL requires of each rank's buffer. */
static tdm_status tdm_cuda_group_check(const tdm_cuda_group *g, const char *call,
                                       const char *arg, int i, const float *p, size_t n_elem)
{
    char name[48];
    snprintf(name, sizeof name, "%s (rank %d)", arg, i);
    TDM_CUDA_EMU_CHECK(g->devs[i], call, {name, p, n_elem * sizeof(float)});
    return TDM_STATUS_OK;
}

static tdm_status tdm_cuda_hook_group_init(void **out, tdm_device *const *devs, int n)
{
    int idx[TDM_DEVICE_LIST_MAX], emu = 0;
    *out = NULL;
    if (n > TDM_DEVICE_LIST_MAX) return TDM_STATUS_UNSUPPORTED;
    for (int i = 0; i < n; i++) {
        if (devs[i]->ops == &tdm_cuda_emu_ops) emu++;
        else if (devs[i]->ops != &tdm_cuda_ops) return TDM_STATUS_UNSUPPORTED;
        idx[i] = devs[i]->index;
    }
    if (emu && emu != n) return TDM_STATUS_UNSUPPORTED;
    /* Two handles on one GPU (a test of DP's copies on a one-GPU machine):
     * NCCL refuses two ranks of one process on one GPU ("Duplicate GPU
     * detected"), so DP stages through the per-device copies instead; the
     * emulated group refuses them too, so the emulator takes that path. */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (idx[i] == idx[j]) return TDM_STATUS_UNSUPPORTED;
    tdm_cuda_group *g = calloc(1, sizeof *g);
    TDM_REQUIRE(g, TDM_STATUS_OUT_OF_MEMORY, "device group: out of memory");
    g->n = n;
    for (int i = 0; i < n; i++) g->devs[i] = devs[i];
    if (!emu) {
        tdm_status st = tdm_cuda_nccl_group_init(&g->nccl, idx, n, NULL);
        if (st) {
            free(g);
            return st;
        }
    }
    *out = g;
    return TDM_STATUS_OK;
}

static void tdm_cuda_hook_group_free(void *gp)
{
    tdm_cuda_group *g = gp;
    if (!g) return;
    tdm_cuda_nccl_group_free(g->nccl);
    free(g);
}

static tdm_status tdm_cuda_hook_group_broadcast(void *gp, float *const *bufs, size_t n_elem,
                                                int root)
{
    tdm_cuda_group *g = gp;
    TDM_REQUIRE(root >= 0 && root < g->n, TDM_STATUS_INVALID_ARG,
                "device group broadcast: root %d of %d", root, g->n);
    if (g->nccl)
        return tdm_cuda_nccl_group_broadcast(g->nccl, (void *const *)bufs, n_elem,
                                             TDM_DTYPE_FLOAT32, root);
    for (int i = 0; i < g->n; i++)
        TDM_CHECK(tdm_cuda_group_check(g, "ncclBroadcast (emulated group)", "buf", i, bufs[i],
                                       n_elem));
    for (int i = 0; i < g->n; i++)
        if (i != root && n_elem && bufs[i] != bufs[root])
            memcpy(bufs[i], bufs[root], n_elem * sizeof(float));
    return TDM_STATUS_OK;
}

static tdm_status tdm_cuda_hook_group_reduce_sum(void *gp, const float *const *sendbufs,
                                                 float *recvbuf, size_t n_elem, int root)
{
    tdm_cuda_group *g = gp;
    TDM_REQUIRE(root >= 0 && root < g->n, TDM_STATUS_INVALID_ARG,
                "device group reduce: root %d of %d", root, g->n);
    if (g->nccl)
        return tdm_cuda_nccl_group_reduce(g->nccl, (const void *const *)sendbufs, recvbuf,
                                          n_elem, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM, root);
    for (int i = 0; i < g->n; i++)
        TDM_CHECK(tdm_cuda_group_check(g, "ncclReduce (emulated group)", "sendbuf", i,
                                       sendbufs[i], n_elem));
    TDM_CHECK(tdm_cuda_group_check(g, "ncclReduce (emulated group)", "recvbuf", root, recvbuf,
                                   n_elem));
    /* rank order per element, every input read before the output is
     * written: in place (recvbuf == sendbufs[root]) is safe */
    for (size_t j = 0; j < n_elem; j++) {
        float acc = sendbufs[0][j];
        for (int i = 1; i < g->n; i++) acc += sendbufs[i][j];
        recvbuf[j] = acc;
    }
    return TDM_STATUS_OK;
}

const tdm_device_cuda_hooks tdm_cuda_hooks = {
    .open = tdm_cuda_hook_open,
    .count = tdm_cuda_hook_count,
    .group_init = tdm_cuda_hook_group_init,
    .group_free = tdm_cuda_hook_group_free,
    .group_broadcast = tdm_cuda_hook_group_broadcast,
    .group_reduce_sum = tdm_cuda_hook_group_reduce_sum,
};
