/* tools/ddp_rank.c: see tools/ddp_rank.h. cuda/ is reached through a
 * weak symbol, so builds without the CUDA backend link and refuse GPUs. */
#include "tools/ddp_rank.h"

#include <stdio.h>
#include <stdlib.h>

#include "dist/pg.h"
#include "shm/shm_comm.h"
#include "tools/devices.h"
#include "cuda/cuda_weak.h"

/* NCCL's watchdog polls this: the shm group's abort (a rank that failed
 * or died, or the parent stopping the job) stops a rank blocked in NCCL
 * at once instead of at the deadline. */
static const char *tdm_tool_shm_aborted(void *ctx) { return tdm_shm_comm_abort_reason(ctx); }

tdm_status tdm_tool_rank_nccl(tdm_comm *shm, tdm_device *dev, tdm_comm **nccl)
{
    *nccl = NULL;
    if (!tdm_tool_device_is_gpu(dev)) return TDM_STATUS_OK;
    if (!tdm_comm_init_nccl_opts)
        return tdm_error_set(TDM_STATUS_NO_DEVICE, "no CUDA device: this build of tandem has "
                             "no CUDA backend; use --device cpu:N");
    /* Collective over shm; a rank that failed before it aborts shm, so
     * the others' bootstrap fails at once. */
    tdm_nccl_opts no = {.abort_check = tdm_tool_shm_aborted, .abort_ctx = shm};
    /* the process group's timeout (TANDEM_TIMEOUT, which tandem launch and
     * train --timeout set) bounds NCCL's waits too, unless the NCCL-only
     * TANDEM_NCCL_TIMEOUT_MS says otherwise */
    if (!getenv("TANDEM_NCCL_TIMEOUT_MS")) TDM_CHECK(tdm_dist_timeout_from_env(&no.timeout_ms));
    return tdm_comm_init_nccl_opts(nccl, shm, tdm_dev_index(dev), &no);
}

tdm_status tdm_tool_rank_device(const tdm_device_list *dl, int rank, tdm_device **dev)
{
    return tdm_device_open(dev, dl->kind == TDM_DEVICE_CUDA ? "cuda" : "cpu",
                           dl->index[dl->count == 1 ? 0 : rank], 1);
}

tdm_status tdm_tool_rank_ddp(tdm_comm *shm, tdm_device *dev, tdm_model *m,
                             const tdm_ddp_opts *opts, tdm_comm **nccl, tdm_ddp **ddp)
{
    *ddp = NULL;
    TDM_CHECK(tdm_tool_rank_nccl(shm, dev, nccl));
    tdm_ddp_opts o = opts ? *opts : (tdm_ddp_opts){0};
    o.host_comm = *nccl ? shm : NULL;
    return tdm_ddp_init(ddp, m, *nccl ? *nccl : shm, &o);
}

size_t tdm_tool_ddp_arena_bytes(const tdm_device_list *dl, int64_t param_elems)
{
    if (dl->kind == TDM_DEVICE_CUDA && !tdm_tool_cuda_emulated()) return 0;
    return tdm_ddp_arena_bytes(param_elems);
}

void tdm_tool_print_ddp_times(const tdm_ddp *ddp, int world, int overlap)
{
    tdm_ddp_times t;
    tdm_ddp_get_times(ddp, &t);
    if (t.steps == 0) return;
    double n = (double)t.steps, step_ms = 0;
    for (int i = 0; i < TDM_PHASE_COUNT_; i++) step_ms += t.total.ms[i];
    double exposed = t.total.ms[TDM_PHASE_ALLREDUCE_WAIT];
    printf("ddp (rank 0 of %d, %d bucket%s, per step): forward %.3f ms, loss %.3f ms, backward "
           "%.3f ms, all-reduce exposed %.3f ms, optimizer %.3f ms\n",
           world, t.n_buckets, t.n_buckets == 1 ? "" : "s", t.total.ms[TDM_PHASE_FORWARD] / n,
           t.total.ms[TDM_PHASE_LOSS] / n, t.total.ms[TDM_PHASE_BACKWARD] / n, exposed / n,
           t.total.ms[TDM_PHASE_STEP] / n);
    if (!overlap) return;
    double share = t.reduced_bytes_total > 0
                       ? 100.0 * t.overlapped_bytes_total / t.reduced_bytes_total : 0.0;
    printf("ddp communication: exposed (not overlapped) %.3f ms per step = %.1f%% of the step; "
           "overlap: %.1f%% of the gradient bytes were all-reduced while backward ran\n",
           exposed / n, step_ms > 0 ? 100.0 * exposed / step_ms : 0.0, share);
}
