/* shm/spawn.h: run a function in N forked ranks joined by a shm
 * communicator, for tests and the collective benchmark. The parent
 * creates the segment, forks, watches the children with a time bound,
 * tells the group when one dies (so the others stop at once), stops the
 * rest (SIGTERM, then SIGKILL) after a failure, and names the first rank
 * that failed. Children always _exit(): they never return into the
 * caller (a test framework, say).
 * Not a launcher for user programs (that one execs; see ddp/). */
#ifndef TDM_SHM_SPAWN_H
#define TDM_SHM_SPAWN_H

#include <stdint.h>
#include <sys/types.h>

#include "core/comm.h"
#include "shm/shm_comm.h"

/* Runs in each child; its return value is the child's exit code
 * (0: success). The communicator is freed after it returns. */
typedef int (*tdm_shm_spawn_fn)(tdm_comm *comm, void *arg);

typedef struct tdm_shm_spawn_opts {
    tdm_shm_opts shm;     /* segment and wait options */
    int64_t timeout_ms;   /* bound on the whole run; 0: 60000 */
    int64_t grace_ms;     /* after a failure, time the others get to exit
                             on their own before SIGTERM; 0: 3000 */
} tdm_shm_spawn_opts;

typedef struct tdm_shm_spawn_result {
    pid_t pid[TDM_SHM_MAX_RANKS];
    int wstatus[TDM_SHM_MAX_RANKS];   /* as from waitpid */
    double elapsed_ms;
} tdm_shm_spawn_result;

/* TDM_STATUS_OK when every rank exited 0; otherwise PEER_FAILED naming
 * the rank that caused it: one killed by a signal other than the clean-up's
 * SIGTERM if any ("rank 2 (pid 4121) was killed by signal 9 (Killed)"),
 * else the first that failed; or TIMEOUT naming the ranks still running. opts and res
 * may be NULL. */
tdm_status tdm_shm_spawn(int world, tdm_shm_spawn_fn fn, void *arg,
                         const tdm_shm_spawn_opts *opts, tdm_shm_spawn_result *res);

/* "was killed by signal 9 (Killed)", "exited with code 3": how a rank
 * ended, as every failure summary words it. */
void tdm_shm_wait_status_str(int wstatus, char *out, size_t n);

#endif
