/* models/mem_plan.c: a run's memory plan and its check (models/mem_plan.h). */
#include "models/mem_plan.h"

#include <stdio.h>

#include "core/memavail.h"

void tdm_mem_plan_compute(const tdm_mem_plan_in *in, tdm_mem_plan *out)
{
    uint64_t N = in->replicas > 0 ? (uint64_t)in->replicas : 1;
    uint64_t procs = in->processes > 0 ? (uint64_t)in->processes : 1;
    uint64_t P = (uint64_t)(in->model.param_elems + in->model.buffer_elems) * sizeof(float);
    uint64_t G = (uint64_t)in->model.param_elems * sizeof(float);
    uint64_t O = (uint64_t)in->optim_states * (uint64_t)in->model.param_elems * sizeof(float);
    uint64_t U = (uint64_t)in->model.largest_param_elems * sizeof(float);
    *out = (tdm_mem_plan){.params = P, .grads = G, .optim = O,
                          .activations = in->model.act_bytes};
    switch (in->shard) {
    case TDM_MEM_SHARD_FULL:
        out->params = (P + N - 1) / N + 2 * U;
        out->grads = (G + N - 1) / N;
        out->optim = (O + N - 1) / N;
        break;
    case TDM_MEM_SHARD_GRAD_OP:
        out->grads = (G + N - 1) / N;
        out->optim = (O + N - 1) / N;
        break;
    case TDM_MEM_SHARD_OPTIMIZER:
        out->optim = (O + N - 1) / N;
        break;
    case TDM_MEM_SHARD_NONE:
        break;
    }
    if (!in->on_host) out->params = out->grads = out->optim = out->activations = 0;
    out->total = N * (out->params + out->grads + out->activations) + procs * out->optim +
                 (uint64_t)(in->forks > 0 ? in->forks : 0) * TDM_MEM_PLAN_FORK_BYTES +
                 in->data_bytes + in->shared_bytes;
}

tdm_status tdm_mem_plan_model(const tdm_plan_opts *o, tdm_model_footprint *out)
{
    tdm_plan p;
    TDM_CHECK(tdm_plan_single(o, &p));
    size_t running = p.buffer_elems ? ((size_t)p.buffer_elems * sizeof(float) + 63) / 64 * 64 : 0;
    *out = (tdm_model_footprint){.param_elems = p.param_elems, .buffer_elems = p.buffer_elems,
                                 .largest_param_elems = p.largest_param_elems,
                                 .act_bytes = p.peak - p.params - p.grads - p.optim - running};
    return TDM_STATUS_OK;
}

static double tdm_mem_mib(uint64_t b) { return (double)b / (1 << 20); }

tdm_status tdm_mem_plan_check(const tdm_mem_plan_in *in, const tdm_mem_plan *p)
{
    char src[1200];
    uint64_t avail = tdm_mem_available(src, sizeof src);
    if (p->total <= avail) return TDM_STATUS_OK;
    char terms[512];
    int N = in->replicas > 0 ? in->replicas : 1, procs = in->processes > 0 ? in->processes : 1;
    int len = snprintf(terms, sizeof terms,
                       "%d replica%s x (parameters %.1f + gradients %.1f + activations %.1f MiB) "
                       "+ %d x optimizer state %.1f MiB", N, N == 1 ? "" : "s",
                       tdm_mem_mib(p->params), tdm_mem_mib(p->grads), tdm_mem_mib(p->activations),
                       procs, tdm_mem_mib(p->optim));
    if (in->forks > 0 && len > 0 && (size_t)len < sizeof terms)
        len += snprintf(terms + len, sizeof terms - (size_t)len, " + %d rank process%s x %.0f MiB",
                        in->forks, in->forks == 1 ? "" : "es",
                        tdm_mem_mib(TDM_MEM_PLAN_FORK_BYTES));
    if (in->data_bytes && len > 0 && (size_t)len < sizeof terms)
        len += snprintf(terms + len, sizeof terms - (size_t)len, " + data %.1f MiB",
                        tdm_mem_mib(in->data_bytes));
    if (in->shared_bytes && len > 0 && (size_t)len < sizeof terms)
        snprintf(terms + len, sizeof terms - (size_t)len, " + shared memory %.1f MiB",
                 tdm_mem_mib(in->shared_bytes));
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                         "this run needs at least %.1f MiB of memory but %.1f MiB are available "
                         "(%s): %s (the formula: docs/SECURITY.md); lower --batch or the model's "
                         "size, use fewer devices, or shard it (--mode fsdp)",
                         tdm_mem_mib(p->total), tdm_mem_mib(avail), src, terms);
}
