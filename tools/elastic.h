/* tools/elastic.h: elastic restarts (torchrun's --max-restarts) for
 * `tandem launch` and `tandem train --mode ddp`: when a rank fails, the
 * whole job is stopped and every rank started again from the last complete
 * checkpoint, at most K times. docs/DEBUGGING.md says what counts as a
 * failure and how the backoff grows. */
#ifndef TDM_TOOLS_ELASTIC_H
#define TDM_TOOLS_ELASTIC_H

#include <stddef.h>
#include <stdint.h>

#include "dist/run.h"
#include "tools/doctor.h"

/* The root cause of the attempt that just failed, as its summary worded
 * it (set by launch and train; quoted by the restart line). */
extern char tdm_elastic_cause[1024];

/* "from ck.safetensors (epoch 1, step 32)", or "from the start (ck does
 * not exist yet)", or "from the start (no checkpoint named)". Returns 1
 * when ckpt exists and holds a checkpoint. */
int tdm_elastic_describe(const char *ckpt, char *out, size_t n);

/* What each attempt of a restarted job died of (tools/elastic_log.c),
 * for the line that ends it when the restarts run out. */
typedef struct tdm_elastic_log {
    char **cause;    /* owned */
    int n, cap;
} tdm_elastic_log;
/* The first and the last this many attempts are listed; the rest counted. */
#define TDM_ELASTIC_LOG_SHOWN 3
/* Records the cause of the attempt that just failed (a copy). */
void tdm_elastic_log_add(tdm_elastic_log *l, const char *cause);
/* "<tool>: the K restarts are used up, every attempt failed: attempt 1:
 * ...; attempt 2: ..." on stderr, one line (nothing when max_restarts is 0:
 * no restart was asked for). */
void tdm_elastic_log_used_up(const tdm_elastic_log *l, const char *tool, long long max_restarts);
void tdm_elastic_log_free(tdm_elastic_log *l);

/* What `tandem train` says around its forked ranks (dist/run.h's watch):
 * the ranks' flight-recorder dumps and the doctor's verdict
 * (tools/doctor.h: as soon as the ranks that can report have, and the
 * summary), "<tool>: <mode>: <root cause>" after a failed attempt, and
 * the line of each restart (where the ranks start again from). */
typedef struct tdm_elastic_watch {
    tdm_dist_watch dist;   /* the hooks; dist.ctx is this struct */
    const char *tool;      /* "tandem train" */
    const char *mode;      /* "ddp" */
    const char *save;      /* the ranks' --save: the restart line says why a restart
                              does not resume from it (another run's, or none yet) */
    tdm_doctor_job frj;
    char why[1024];        /* the last attempt's root cause */
    tdm_elastic_log failures;   /* every attempt's, for the line when restarts run out */
    long long max_restarts;
    long long min_devices, divides;   /* --min-devices, --deterministic (resize lines) */
    char stop[512];        /* a resize that cannot be: said instead of "used up" */
    /* the job's mesh (has_shape): a rank killed by a signal is named
     * with its coordinates */
    tdm_mesh_shape shape;
    int has_shape;
} tdm_elastic_watch;
void tdm_elastic_watch_init(tdm_elastic_watch *w, const char *tool, const char *mode,
                            long long max_restarts);

/* Test hook of tandem train's DDP ranks: TANDEM_DDP_TEST_KILL=R:S makes
 * rank R SIGKILL itself before its step S (counted from 1 over the run),
 * R:S:STOP stop itself (SIGSTOP) there, R:S:ALWAYS SIGKILL itself there
 * on every attempt (a rank that keeps failing: elastic resize); else
 * that a restarted job can finish. The step for `rank` (0: none) and the
 * signal. */
int64_t tdm_elastic_test_fault(int rank, int *sig);
/* Fires it: says so on stderr ("test fault", the moment
 * tools/fault_latency.sh measures from), then raises sig. */
void tdm_elastic_test_fault_fire(int rank, int sig, int64_t step);

/* `tandem launch` without restarts (tools/launch.c). */
int tdm_launch_run_once(int argc, char **argv);

#endif
