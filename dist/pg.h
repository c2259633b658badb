/* dist/pg.h: the process group of a multi-process program: the
 * launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
 * as torchrun sets them), whether this process is a rank of a job that
 * `tandem launch` started, and joining the shared-memory communicator the
 * launcher created, with the group's timeout (dist/timeout.h). Not a
 * rendezvous over the network: one machine only (an MPI launcher's jobs
 * are dist/run.h's). */
#ifndef TDM_DIST_PG_H
#define TDM_DIST_PG_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "dist/timeout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_dist_env {
    int rank, local_rank, world_size, local_world_size;
} tdm_dist_env;

/* Sets the variables for a rank of a one-machine job of `world` ranks
 * (what tandem launch and tdm_dist_spawn give every rank). */
void tdm_dist_env_export(int rank, int world);

/* 1 when this process is a rank of a job `tandem launch` started: the
 * launcher's segment (TANDEM_SHM_FD) and WORLD_SIZE are in the
 * environment. Reads the environment only. */
int tdm_dist_launched(void);

/* Reads the variables; LOCAL_RANK defaults to RANK and LOCAL_WORLD_SIZE to
 * WORLD_SIZE. Fails (INVALID_ARG, naming the variable) when RANK or
 * WORLD_SIZE is missing or not an integer in range. */
tdm_status tdm_dist_env_from_environ(tdm_dist_env *env);

typedef struct tdm_dist_pg_opts {
    int64_t timeout_ms;   /* 0: TANDEM_TIMEOUT, else TDM_DIST_TIMEOUT_DEFAULT_MS */
} tdm_dist_pg_opts;

/* Reads the environment, joins the group (tdm_shm_comm_init_from_env)
 * with the timeout of opts (may be NULL) and tags log lines with the
 * rank. env may be NULL. */
tdm_status tdm_dist_pg_init(tdm_comm **out, tdm_dist_env *env, const tdm_dist_pg_opts *opts);
/* tdm_dist_pg_init with the default options. */
tdm_status tdm_dist_pg_init_from_env(tdm_comm **out, tdm_dist_env *env);

#ifdef __cplusplus
}
#endif

#endif
