/* dist/spawn.c: forked ranks with the launcher's environment. */
#include "dist/spawn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "dist/pg.h"

typedef struct tdm_dist_spawn_ctx {
    tdm_dist_spawn_fn fn;
    void *arg;
} tdm_dist_spawn_ctx;

static int tdm_dist_spawn_child(tdm_comm *comm, void *arg)
{
    const tdm_dist_spawn_ctx *c = arg;
    int rank = tdm_comm_rank(comm);
    tdm_dist_env_export(rank, tdm_comm_size(comm));
    tdm_log_set_rank(rank);
    return c->fn(comm, c->arg);
}

tdm_status tdm_dist_spawn(int world, tdm_dist_spawn_fn fn, void *arg,
                         const tdm_dist_spawn_opts *opts, tdm_shm_spawn_result *res)
{
    TDM_REQUIRE(fn, TDM_STATUS_INVALID_ARG, "tdm_dist_spawn: NULL function");
    tdm_dist_spawn_opts o = opts ? *opts : (tdm_dist_spawn_opts){0};
    if (o.comm_timeout_ms <= 0) TDM_CHECK(tdm_dist_timeout_from_env(&o.comm_timeout_ms));
    tdm_shm_spawn_opts so = {.timeout_ms = o.timeout_ms, .grace_ms = o.grace_ms,
                             .on_settled = o.on_settled, .settled_ctx = o.settled_ctx,
                             .outlive_failures = o.outlive_failures};
    so.shm.arena_bytes = o.arena_bytes;
    so.shm.timeout_ms = o.comm_timeout_ms;
    tdm_dist_spawn_ctx c = {.fn = fn, .arg = arg};
    /* tdm_shm_spawn names the root cause of a failure (tdm_shm_watch_blame) */
    return tdm_shm_spawn(world, tdm_dist_spawn_child, &c, &so, res);
}

