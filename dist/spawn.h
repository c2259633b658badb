/* dist/spawn.h: run a function in N forked ranks joined by a shm
 * communicator (torch.multiprocessing.spawn for C): tests and
 * `tandem train --mode ddp`. Each rank gets RANK, LOCAL_RANK, WORLD_SIZE
 * and LOCAL_WORLD_SIZE in its environment and log lines tagged with its
 * rank. Wraps shm/spawn.h (fork, watch, fail fast, name the root cause,
 * stop the rest, leave nothing behind). For exec'd user
 * programs use `tandem launch` (tools/launch.c). */
#ifndef TDM_DIST_SPAWN_H
#define TDM_DIST_SPAWN_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "shm/spawn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*tdm_dist_spawn_fn)(tdm_comm *comm, void *arg);

typedef struct tdm_dist_spawn_opts {
    int64_t timeout_ms;       /* bound on the whole run; 0: shm/spawn.h's 60 s */
    int64_t grace_ms;         /* after a failure, before SIGTERM; 0: 3000 */
    int64_t comm_timeout_ms;  /* deadline of every collective wait (the process group's
                                 timeout); 0: TANDEM_TIMEOUT, else the shm default (300 s) */
    size_t arena_bytes;       /* zero-copy arena per rank (DDP gradients: tdm_ddp_arena_bytes,
                                 ddp/ddp.h); 0: none */
    tdm_shm_settled_fn on_settled;   /* as in tdm_shm_spawn_opts; NULL: none */
    void *settled_ctx;
    int outlive_failures;     /* as in tdm_shm_spawn_opts */
} tdm_dist_spawn_opts;

/* Returns OK when every rank exited 0, else the root cause by the rule of
 * tdm_shm_watch_blame (shm/spawn.h): "rank 2 (pid 4121) was killed by
 * signal 9 (Killed)", "rank 1 (pid 4120) is stopped ...". opts, res may be
 * NULL. */
tdm_status tdm_dist_spawn(int world, tdm_dist_spawn_fn fn, void *arg,
                         const tdm_dist_spawn_opts *opts, tdm_shm_spawn_result *res);

#ifdef __cplusplus
}
#endif

#endif
