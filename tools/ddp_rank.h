/* tools/ddp_rank.h: what every DDP rank of the CLI sets up the same way
 * (train --mode ddp, its GPT path, compare's DDP runs): its device, its
 * gradient communicator (NCCL on a GPU, bootstrapped over the shm process
 * group; the shm group itself elsewhere), its Reducer, and the shm arena
 * a job needs. The process group itself comes from dist/pg.h (a launched
 * rank) or dist/spawn.h (forked ranks). */
#ifndef TDM_TOOLS_DDP_RANK_H
#define TDM_TOOLS_DDP_RANK_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/device.h"
#include "ddp/ddp.h"

/* A DDP rank's gradient communicator: on a GPU, an NCCL communicator
 * bootstrapped over shm (collective: every rank calls this) whose watchdog
 * also stops when the shm group aborts; *nccl = NULL on host and emulated
 * devices (they reduce over shm). */
tdm_status tdm_tool_rank_nccl(tdm_comm *shm, tdm_device *dev, tdm_comm **nccl);

/* DDP rank `rank`'s device from dl: dl.index[rank] (or the one listed
 * device for every rank), one BLAS thread. */
tdm_status tdm_tool_rank_device(const tdm_device_list *dl, int rank, tdm_device **dev);

/* A DDP rank's Reducer over m: tdm_tool_rank_nccl, then tdm_ddp_init with
 * the gradients on NCCL (and host collectives on shm) on a GPU, on shm
 * otherwise. Collective. The caller frees *ddp, then *nccl, then shm. */
tdm_status tdm_tool_rank_ddp(tdm_comm *shm, tdm_device *dev, tdm_model *m,
                             const tdm_ddp_opts *opts, tdm_comm **nccl, tdm_ddp **ddp);

/* The shm arena a DDP job over dl needs for zero-copy gradients of
 * param_elems floats: none on GPUs (their buckets live in NCCL memory). */
size_t tdm_tool_ddp_arena_bytes(const tdm_device_list *dl, int64_t param_elems);

/* Rank 0's summary of where a DDP step went (tdm_ddp_get_times): the mean
 * per-step phases, and with overlap set a second line with the exposed
 * share of the step and the overlapped share of the gradient bytes.
 * Nothing before the first synchronised step. */
void tdm_tool_print_ddp_times(const tdm_ddp *ddp, int world, int overlap);

#endif
