/* core/timer.h: monotonic time and per-phase step timings.
 * A tdm_phase_times holds the milliseconds one step spent in each phase
 * on one device or rank; DP, DDP and the tools fill and print it. This is
 * not a tracer (the trace writer in tools/ records spans with timestamps). */
#ifndef TDM_CORE_TIMER_H
#define TDM_CORE_TIMER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t tdm_time_ns(void);
static inline double tdm_time_ms_since(uint64_t t0_ns)
{
    return (double)(tdm_time_ns() - t0_ns) * 1e-6;
}

typedef enum tdm_phase {
    TDM_PHASE_REPLICATE = 0,
    TDM_PHASE_SCATTER,
    TDM_PHASE_FORWARD,
    TDM_PHASE_GATHER,
    TDM_PHASE_LOSS,
    TDM_PHASE_BACKWARD,
    TDM_PHASE_REDUCE,          /* DP: reduce-add of replica gradients */
    TDM_PHASE_ALLREDUCE_WAIT,  /* DDP: exposed all-reduce at end of backward */
    TDM_PHASE_STEP,            /* optimizer */
    /* sharded data parallel (fsdp/): the part of all-gathers and
     * reduce-scatters the rank waited for (not hidden behind compute) */
    TDM_PHASE_ALLGATHER_WAIT,
    TDM_PHASE_REDUCE_SCATTER_WAIT,
    /* FSDP's parameter offload: issuing and finishing the copies between
     * host and device memory (their waits included) */
    TDM_PHASE_HOST_COPY,
    TDM_PHASE_COUNT_
} tdm_phase;

const char *tdm_phase_name(tdm_phase p);

typedef struct tdm_phase_times {
    double ms[TDM_PHASE_COUNT_];
} tdm_phase_times;

#ifdef __cplusplus
}
#endif

#endif
