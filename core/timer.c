/* core/timer.c: monotonic clock and phase names. */
#include "core/timer.h"

#include <time.h>

uint64_t tdm_time_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char *tdm_phase_name(tdm_phase p)
{
    static const char *const names[TDM_PHASE_COUNT_] = {
        [TDM_PHASE_REPLICATE] = "replicate",
        [TDM_PHASE_SCATTER] = "scatter",
        [TDM_PHASE_FORWARD] = "forward",
        [TDM_PHASE_GATHER] = "gather",
        [TDM_PHASE_LOSS] = "loss",
        [TDM_PHASE_BACKWARD] = "backward",
        [TDM_PHASE_REDUCE] = "reduce-add",
        [TDM_PHASE_ALLREDUCE_WAIT] = "all-reduce wait",
        [TDM_PHASE_STEP] = "optimizer",
        [TDM_PHASE_ALLGATHER_WAIT] = "all-gather wait",
        [TDM_PHASE_REDUCE_SCATTER_WAIT] = "reduce-scatter wait",
        [TDM_PHASE_HOST_COPY] = "host copy",
    };
    return (unsigned)p < TDM_PHASE_COUNT_ ? names[p] : "?";
}
