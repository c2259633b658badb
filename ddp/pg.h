/* ddp/pg.h: the process group of a DDP program: the launcher's
 * environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, as torchrun
 * sets them) and joining the shared-memory communicator the launcher
 * created. Not a rendezvous over the network: one machine only. */
#ifndef TDM_DDP_PG_H
#define TDM_DDP_PG_H

#include "core/comm.h"
#include "core/status.h"

typedef struct tdm_ddp_env {
    int rank, local_rank, world_size, local_world_size;
} tdm_ddp_env;

/* Sets the variables for a rank of a one-machine job of `world` ranks
 * (what tandem launch and tdm_ddp_spawn give every rank). */
void tdm_ddp_env_export(int rank, int world);

/* Reads the variables; LOCAL_RANK defaults to RANK and LOCAL_WORLD_SIZE to
 * WORLD_SIZE. Fails (INVALID_ARG, naming the variable) when RANK or
 * WORLD_SIZE is missing or not an integer in range. */
tdm_status tdm_ddp_env_from_environ(tdm_ddp_env *env);

/* Reads the environment, joins the group (tdm_shm_comm_init_from_env)
 * and tags log lines with the rank. env may be NULL. */
tdm_status tdm_ddp_pg_init_from_env(tdm_comm **out, tdm_ddp_env *env);

#endif
