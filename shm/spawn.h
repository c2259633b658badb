/* shm/spawn.h: run a function in N forked ranks joined by a shm
 * communicator, for tests and the collective benchmark. The parent
 * creates the segment, forks, watches the children with a time bound,
 * tells the group when one dies (so the others stop at once), stops the
 * rest (SIGTERM, then SIGKILL) after a failure, and names the root cause
 * (tdm_shm_watch, below, which `tandem launch` uses too). Children always _exit(): they never return into the
 * caller (a test framework, say).
 * Not a launcher for user programs (that one execs; see ddp/). */
#ifndef TDM_SHM_SPAWN_H
#define TDM_SHM_SPAWN_H

#include <stdint.h>
#include <sys/types.h>

#include "core/comm.h"
#include "shm/shm_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs in each child; its return value is the child's exit code
 * (0: success). The communicator is freed after it returns. */
typedef int (*tdm_shm_spawn_fn)(tdm_comm *comm, void *arg);

struct tdm_shm_watch;
/* See tdm_shm_spawn_opts.on_settled. */
typedef void (*tdm_shm_settled_fn)(const struct tdm_shm_watch *w, void *ctx);

typedef struct tdm_shm_spawn_opts {
    tdm_shm_opts shm;     /* segment and wait options */
    int64_t timeout_ms;   /* bound on the whole run; 0: 60000 */
    int64_t grace_ms;     /* after a failure, time the others get to exit
                             on their own before SIGTERM; 0: 3000 */
    /* Called once in the parent after a rank failed, as soon as every rank
     * still running is stopped (tdm_shm_watch_only_stopped): the ranks have
     * said (and dumped) all they can, so a diagnosis need not wait for the
     * grace period and the SIGKILL that end the stopped ones. The watch is
     * as it stands (the stopped ranks not ended). NULL: none. */
    tdm_shm_settled_fn on_settled;
    void *settled_ctx;
} tdm_shm_spawn_opts;

typedef struct tdm_shm_spawn_result {
    pid_t pid[TDM_SHM_MAX_RANKS];
    int wstatus[TDM_SHM_MAX_RANKS];   /* as from waitpid */
    int induced[TDM_SHM_MAX_RANKS];   /* 1: it ended after the parent began
                                         stopping ranks (SIGTERM, then SIGKILL):
                                         its end is the teardown's, not a cause */
    double elapsed_ms;
} tdm_shm_spawn_result;

/* TDM_STATUS_OK when every rank exited 0; otherwise the root cause by
 * the rule of tdm_shm_watch_blame (PEER_FAILED: "rank 2 (pid 4121) was
 * killed by signal 9 (Killed)", "rank 1 (pid 4120) is stopped ..."), or
 * TIMEOUT naming the ranks still running at opts.timeout_ms. opts and res
 * may be NULL. */
tdm_status tdm_shm_spawn(int world, tdm_shm_spawn_fn fn, void *arg,
                         const tdm_shm_spawn_opts *opts, tdm_shm_spawn_result *res);

/* --- naming the root cause: one rule for every parent of ranks -------------
 * tdm_shm_spawn, tdm_dist_spawn (through it), `tandem launch` and
 * `tandem train --mode ddp` all watch their ranks through this, so that
 * every failure summary names the same culprit:
 *
 *   the root cause is the first failure that the parent's own teardown
 *   did not cause, reported in the words of whoever saw it.
 *
 * The first failure anyone saw is the group abort (the first raiser wins:
 * a rank that failed and said why, a rank that saw a peer die, stop, time
 * out or call the wrong collective, or the parent reporting a rank's
 * failing exit); it is taken as it stood when the parent began stopping
 * ranks, so nothing the teardown causes can replace it. Its blamed rank
 * is named with how it ended when that end was its own (a failing exit
 * or a signal the parent did not send), followed by its own message when
 * it raised the abort itself; when its end was the teardown's (a stopped
 * rank SIGKILLed, a late one SIGTERMed) the message of whoever saw it
 * stands alone. Without an abort, the first rank that failed by itself;
 * without any, the parent's own reason for stopping (a time bound, a
 * signal it received). */
typedef struct tdm_shm_watch {
    tdm_shm_group *group;                 /* borrowed; may be NULL */
    int world;
    pid_t pid[TDM_SHM_MAX_RANKS];         /* 0: not started */
    int wstatus[TDM_SHM_MAX_RANKS];       /* as from waitpid, once ended */
    int ended[TDM_SHM_MAX_RANKS];         /* order in which ranks ended, from 1; 0: running */
    int induced[TDM_SHM_MAX_RANKS];       /* 1: ended after the parent signalled it */
    int n_ended;
    int stopping;                         /* the parent has signalled ranks */
    int stop_cause;                       /* 1: a rank's failure, 0: the parent's own reason */
    tdm_status stop_status;               /* the parent's own reason, if stop_cause == 0 */
    char stop_why[256];
    int aborted;                          /* the group abort, as of the first signal: */
    int abort_raiser, abort_culprit;      /* ranks (-1: the parent; none) */
    char abort_reason[512];
} tdm_shm_watch;

/* Culprits the rule found. */
typedef enum tdm_shm_cause {
    TDM_SHM_CAUSE_NONE = 0,    /* every rank exited 0 */
    TDM_SHM_CAUSE_RANK,        /* a rank failed (or was seen failing) */
    TDM_SHM_CAUSE_PARENT,      /* the parent stopped the job (time bound, signal) */
} tdm_shm_cause;

void tdm_shm_watch_init(tdm_shm_watch *w, tdm_shm_group *g, int world);
/* Rank's process is pid (also tells the group: liveness before it joins). */
void tdm_shm_watch_started(tdm_shm_watch *w, int rank, pid_t pid);
/* Rank's process ended (waitpid status): recorded, and reported to the
 * group (tdm_shm_group_mark_ended). Returns 1 when it is a failure. */
int tdm_shm_watch_ended(tdm_shm_watch *w, int rank, int wstatus);
/* Call before the parent sends its first signal to ranks. st and why: the
 * parent's own reason when it is one (a time bound, a signal received),
 * else TDM_STATUS_OK and NULL (stopping because a rank failed). Takes the
 * group abort as it stands: later raises are the teardown's doing. */
void tdm_shm_watch_stopping(tdm_shm_watch *w, tdm_status st, const char *why);
/* The number of ranks still running when every one of them is stopped
 * (SIGSTOP, job control or a debugger: /proc state T or t), else 0 (also
 * when none is running). A stopped process writes nothing until it is
 * continued or killed, so after a failure this says that every rank that
 * could still report (exit, dump its flight recorder) has done so. */
int tdm_shm_watch_only_stopped(const tdm_shm_watch *w);
/* TDM_STATUS_OK when nothing failed; else the root cause (rule above) as
 * the error message and status (PEER_FAILED for a rank). cause may be
 * NULL. */
tdm_status tdm_shm_watch_blame(const tdm_shm_watch *w, tdm_shm_cause *cause);

/* "was killed by signal 9 (Killed)", "exited with code 3": how a rank
 * ended, as every failure summary words it. */
void tdm_shm_wait_status_str(int wstatus, char *out, size_t n);

#ifdef __cplusplus
}
#endif

#endif
