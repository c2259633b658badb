/* tools/train_trace.h: `tandem train --trace FILE`, a Chrome trace-event
 * JSON of the run (open it in https://ui.perfetto.dev or chrome://tracing):
 * one track per process of the job (the one device or DataParallel's
 * process; each rank of a multi-process mode), with every optimizer step
 * as a slice, inside it the phases the mode measures (forward, loss,
 * backward, the exposed all-reduce / all-gather / reduce-scatter wait,
 * the optimizer step), and each epoch's evaluation, checkpoint and
 * end-of-epoch wait. The phases come as durations (core/timer.h) and are
 * laid end to end from the step's start, as compare's trace lays them:
 * communication hidden behind backward is not shown apart.
 *
 * Every process records in memory (at most TDM_TRAIN_TRACE_CAP events,
 * the rest counted and said); at the end the ranks gather their events to
 * rank 0 over the job's communicator, and rank 0 writes FILE (replaced
 * atomically, core/safefile.h). Timestamps are CLOCK_MONOTONIC: one
 * clock when every rank is on this machine (0 at the job's first event);
 * for ranks on several machines (an MPI job), each rank's time from the
 * moment it left a barrier before the first epoch, which the file says:
 * the machines' clocks differ, the barrier's exit is the one moment they
 * share (within its own skew). */
#ifndef TDM_TOOLS_TRAIN_TRACE_H
#define TDM_TOOLS_TRAIN_TRACE_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "core/timer.h"

#define TDM_TRAIN_TRACE_CAP (1 << 18)

typedef enum tdm_train_trace_kind {
    TDM_TRAIN_TRACE_STEP = 0,
    TDM_TRAIN_TRACE_PHASE,        /* a phase of the step (ev.phase) */
    TDM_TRAIN_TRACE_EVAL,
    TDM_TRAIN_TRACE_SAVE,
    TDM_TRAIN_TRACE_AFTER,        /* the end-of-epoch hook: a wait or a collective save */
    TDM_TRAIN_TRACE_KINDS_
} tdm_train_trace_kind;

typedef struct tdm_train_trace tdm_train_trace;

/* The last step's phases into *out; 0 when the mode measured none. */
typedef int (*tdm_train_phases_fn)(void *ctx, tdm_phase_times *out);

/* A recorder for the process that is rank `rank` of `world` (0 of 1 for
 * one process), writing path at the end; track names its track ("rank
 * 3", "device cpu:0"), at most 47 bytes kept. */
tdm_status tdm_train_trace_new(tdm_train_trace **t, const char *path, int rank, int world,
                               const char *track);
void tdm_train_trace_free(tdm_train_trace *t);

/* Before the first epoch: with one_clock 0 (ranks on several machines)
 * a barrier over comm, collective, and this rank's sync point after it;
 * nothing to agree on otherwise (comm may be NULL). */
tdm_status tdm_train_trace_start(tdm_train_trace *t, tdm_comm *comm, int one_clock);

/* A slice [t0_ns, t1_ns) of kind (not PHASE) in step/epoch `index`. */
void tdm_train_trace_span(tdm_train_trace *t, tdm_train_trace_kind kind, int64_t index,
                          uint64_t t0_ns, uint64_t t1_ns);
/* Optimizer step `step` over [t0_ns, t1_ns), with its phases when ph is
 * not NULL (laid end to end from t0_ns, none past t1_ns). */
void tdm_train_trace_step(tdm_train_trace *t, int64_t step, uint64_t t0_ns, uint64_t t1_ns,
                          const tdm_phase_times *ph);

/* Writes the file: comm NULL for a single process; else collective over
 * comm (every rank calls it, the recorders' world its size), rank 0
 * writes. process names the run ("tandem train --mode ddp, 4 ranks").
 * On rank 0, prints "trace: FILE (...)" when written. */
tdm_status tdm_train_trace_write(tdm_train_trace *t, tdm_comm *comm, const char *process);

#endif
