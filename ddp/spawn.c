/* ddp/spawn.c: forked ranks with the launcher's environment. */
#include "ddp/spawn.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "core/log.h"
#include "ddp/pg.h"

typedef struct tdm_ddp_spawn_ctx {
    tdm_ddp_spawn_fn fn;
    void *arg;
} tdm_ddp_spawn_ctx;

static int tdm_ddp_spawn_child(tdm_comm *comm, void *arg)
{
    const tdm_ddp_spawn_ctx *c = arg;
    int rank = tdm_comm_rank(comm);
    tdm_ddp_env_export(rank, tdm_comm_size(comm));
    tdm_log_set_rank(rank);
    return c->fn(comm, c->arg);
}

tdm_status tdm_ddp_spawn(int world, tdm_ddp_spawn_fn fn, void *arg,
                         const tdm_ddp_spawn_opts *opts, tdm_shm_spawn_result *res)
{
    TDM_REQUIRE(fn, TDM_STATUS_INVALID_ARG, "tdm_ddp_spawn: NULL function");
    tdm_ddp_spawn_opts o = opts ? *opts : (tdm_ddp_spawn_opts){0};
    tdm_shm_spawn_opts so = {.timeout_ms = o.timeout_ms, .grace_ms = o.grace_ms};
    so.shm.arena_bytes = o.arena_bytes;
    so.shm.timeout_ms = o.comm_timeout_ms;
    tdm_ddp_spawn_ctx c = {.fn = fn, .arg = arg};
    tdm_shm_spawn_result own = {0};
    tdm_shm_spawn_result *rr = res ? res : &own;
    tdm_status st = tdm_shm_spawn(world, tdm_ddp_spawn_child, &c, &so, rr);
    if (st != TDM_STATUS_PEER_FAILED) return st;
    /* The survivors of a killed rank notice its death (its pid is gone)
     * and exit with an error a moment later, sometimes before the parent
     * has reaped the dead one, so "first reaped" can name a survivor.
     * Name the root cause instead: a rank killed by a signal other than
     * the SIGTERM the clean-up sends. */
    for (int r = 0; r < world; r++) {
        int ws = rr->wstatus[r];
        if (!WIFSIGNALED(ws) || WTERMSIG(ws) == SIGTERM) continue;
        char why[128];
        tdm_shm_wait_status_str(ws, why, sizeof why);
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "rank %d (pid %d) %s", r,
                             (int)rr->pid[r], why);
    }
    return st;
}

