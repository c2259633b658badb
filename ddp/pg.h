/* ddp/pg.h: the process group of a DDP program: the launcher's
 * environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, as torchrun
 * sets them), the group's timeout, and joining the shared-memory
 * communicator the launcher created. Not a rendezvous over the network:
 * one machine only. */
#ifndef TDM_DDP_PG_H
#define TDM_DDP_PG_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

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

/* The process group's timeout, as PyTorch's init_process_group(timeout=):
 * the deadline of every wait in its collectives; a rank that waits longer
 * for a peer fails naming it. In the environment it is TANDEM_TIMEOUT, in
 * seconds (`tandem launch --timeout` and `tandem train --timeout` set it
 * for their ranks); it applies where no timeout is given through the API.
 * Default: 300 s (the shm communicator's). */
#define TDM_DDP_ENV_TIMEOUT "TANDEM_TIMEOUT"
#define TDM_DDP_TIMEOUT_DEFAULT_MS 300000
#define TDM_DDP_TIMEOUT_MAX_S 604800   /* one week */

/* Parses a number of seconds ("600", "2.5") into ms. what names where the
 * text came from ("--timeout", "TANDEM_TIMEOUT") in the error: anything
 * but a number in [0.001, one week] is INVALID_ARG. */
tdm_status tdm_ddp_timeout_parse(const char *what, const char *text, int64_t *ms);
/* TANDEM_TIMEOUT in ms; 0 when it is unset or empty. */
tdm_status tdm_ddp_timeout_from_env(int64_t *ms);

typedef struct tdm_ddp_pg_opts {
    int64_t timeout_ms;   /* 0: TANDEM_TIMEOUT, else 300 s */
} tdm_ddp_pg_opts;

/* Reads the environment, joins the group (tdm_shm_comm_init_from_env)
 * with the timeout of opts (may be NULL) and tags log lines with the
 * rank. env may be NULL. */
tdm_status tdm_ddp_pg_init(tdm_comm **out, tdm_ddp_env *env, const tdm_ddp_pg_opts *opts);
/* tdm_ddp_pg_init with the default options. */
tdm_status tdm_ddp_pg_init_from_env(tdm_comm **out, tdm_ddp_env *env);

#ifdef __cplusplus
}
#endif

#endif
