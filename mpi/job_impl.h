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
};

/* MPI_Comm_split of the job's communicator, bounded by the watchdog. */
tdm_status tdm_mpi_job_split(tdm_mpi_job *j, int color, int key, MPI_Comm *out);

#endif
