/* tools/elastic.h: elastic restarts (torchrun's --max-restarts) for
 * `tandem launch` and `tandem train --mode ddp`: when a rank fails, the
 * whole job is stopped and every rank started again from the last complete
 * checkpoint, at most K times. docs/DEBUGGING.md says what counts as a
 * failure and how the backoff grows. */
#ifndef TDM_TOOLS_ELASTIC_H
#define TDM_TOOLS_ELASTIC_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/spawn.h"

/* Exported to every rank: how many restarts came before this attempt
 * (0 on the first), as TORCHELASTIC_RESTART_COUNT; and the checkpoint
 * the ranks should resume from on a restart (launch --checkpoint). */
#define TDM_ELASTIC_ENV_COUNT "TANDEM_RESTART_COUNT"
#define TDM_ELASTIC_ENV_RESUME "TANDEM_RESUME"
/* The run every attempt of one `tandem train` or `tandem launch` belongs
 * to, exported to the ranks and written in their checkpoints ("run",
 * models/checkpoint.h): a restart resumes only from a checkpoint with
 * this id, never from one another run left at the same path. Drawn at
 * the start when restarts are asked for, unless already set (tests that
 * compare two runs' files byte for byte set one for both). */
#define TDM_ELASTIC_ENV_RUN "TANDEM_RUN_ID"
#define TDM_ELASTIC_MAX 1000

/* The root cause of the attempt that just failed, as its summary worded
 * it (set by launch and train; quoted by the restart line). */
extern char tdm_elastic_cause[1024];

/* Exported TANDEM_RESTART_COUNT (0 when unset or malformed). */
int tdm_elastic_attempt(void);
/* Sets TANDEM_RESTART_COUNT for the next attempt's ranks. */
void tdm_elastic_set_attempt(int attempt);
/* Sleeps before restart number `attempt` (1..): 200 ms, doubled each
 * time, at most 5 s. Returns the milliseconds slept. */
int tdm_elastic_backoff(int attempt);
/* "from ck.safetensors (epoch 1, step 32)", or "from the start (ck does
 * not exist yet)", or "from the start (no checkpoint named)". Returns 1
 * when ckpt exists and holds a checkpoint. */
int tdm_elastic_describe(const char *ckpt, char *out, size_t n);

/* This process's run (TANDEM_RUN_ID): the one set, else drawn and
 * exported when restarts are asked for (without them no run id is
 * written, and the checkpoints are the bytes they always were), and
 * given to models/checkpoint.h for every checkpoint saved from here on.
 * Returns it, NULL when none. */
const char *tdm_elastic_run_begin(int restarts);
/* 1 when path holds a checkpoint written by this run (its "run" is
 * TANDEM_RUN_ID's); else 0 and, when why is given, what is there. */
int tdm_elastic_ours(const char *path, char *why, size_t n);

/* The forked ranks of `tandem train --mode ddp|fsdp` (images and gpt;
 * mode names the summary line "tandem train: MODE: ..."), with
 * restarts: runs world ranks of fn(comm, arg) (tdm_ddp_spawn with so)
 * with their flight-recorder dumps (tools/doctor.h: the verdict as soon
 * as the ranks that can report have, and the summary), and after a
 * rank's failure (PEER_FAILED: not a signal to this process) starts every
 * rank again, at most max_restarts times, from save once this job has
 * written it (its run id, tdm_elastic_ours; *resume, which the ranks read
 * through arg, is set to it), else from the caller's *resume (the user's
 * --resume), else from the start; the restart line says which, and why
 * not save when it holds another run's checkpoint.
 * Returns the last attempt's status, its message set. */
tdm_status tdm_elastic_train_forked(const char *mode, int world, tdm_ddp_spawn_fn fn, void *arg,
                                    const tdm_ddp_spawn_opts *so, long long max_restarts,
                                    const char *save, const char **resume);

/* Test hook of tandem train's DDP ranks: TANDEM_DDP_TEST_KILL=R:S makes
 * rank R SIGKILL itself before its step S (counted from 1 over the run),
 * R:S:STOP stop itself (SIGSTOP) there; on the first attempt only, so
 * that a restarted job can finish. The step for `rank` (0: none) and the
 * signal. */
int64_t tdm_elastic_test_fault(int rank, int *sig);
/* Fires it: says so on stderr ("test fault", the moment
 * tools/fault_latency.sh measures from), then raises sig. */
void tdm_elastic_test_fault_fire(int rank, int sig, int64_t step);

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

/* `tandem launch` without restarts (tools/launch.c). */
int tdm_launch_run_once(int argc, char **argv);

#endif
