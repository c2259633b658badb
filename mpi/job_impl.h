/* mpi/job_impl.h: the job's state, shared by mpi/job.c and the files
 * that build communicators from it (mpi/hier.c, mpi/shm_named.c).
 * Includes mpi.h through mpi/mpi_impl.h: internal to mpi/. */
#ifndef TDM_MPI_JOB_IMPL_H
#define TDM_MPI_JOB_IMPL_H

#include "mpi/job.h"
#include "mpi/mpi_impl.h"

struct tdm_mpi_job {
    tdm_mpi_opts opts;         /* resolved */
    tdm_mpi_topo topo;
    tdm_comm *world;           /* owned: MPI, every rank (control traffic) */
    int *machine_of;           /* per world rank */
    int *local_of;             /* per world rank: its rank on its machine */
    int node_size;             /* ranks on this physical machine (spin policy) */
    int node_cores;            /* the cores they can use together (their affinity's union) */
    int machine_cores;         /* the same for this (pretend) machine's ranks: its shm segment */
    uint64_t job_id;           /* names this job's segments; 0: not agreed yet */
    int n_segments;            /* segments named so far (each name once) */
    tdm_mpi_live *live;        /* owned: the ranks' heartbeats (mpi/live.c); NULL: off */
};

/* The job's 64-bit id, drawn by rank 0 (TANDEM_JOB_ID's when set) and
 * agreed when the job formed: it names the job's shared segments and is
 * every flight-recorder dump's "job". */
uint64_t tdm_mpi_job_id(tdm_mpi_job *j);

/* MPI_Comm_split of the job's communicator, bounded by the watchdog. */
tdm_status tdm_mpi_job_split(tdm_mpi_job *j, int color, int key, MPI_Comm *out);

/* mpi/shm_named.c: an shm communicator over the ranks of `machine` (an
 * MPI communicator of one machine's ranks, in local rank order; borrowed),
 * through a segment created and joined by name. Collective over machine. */
tdm_status tdm_mpi_shm_named_comm(tdm_mpi_job *j, MPI_Comm machine,
                                  const struct tdm_shm_opts *shm_opts, tdm_comm **out);
/* mpi/hier.c: the hierarchical communicator over every rank of the job. */
tdm_status tdm_mpi_hier_comm(tdm_mpi_job *j, const struct tdm_shm_opts *shm_opts,
                             tdm_comm **out);

#endif
