/* mpi/mpi_weak.h: mpi/job.h and mpi/mpi_comm.h for code that must also
 * link in builds without MPI (tools/, tests/): every function they
 * declare, made a weak reference, so that where mpi/ is not linked (MPI's
 * development files were not found, or MPI=0) each one is NULL and the
 * caller tests it before calling:
 *
 *     if (tdm_mpi_library_version) tdm_mpi_library_version(buf, sizeof buf);
 *
 * The same arrangement as cuda/cuda_weak.h. Never include it in mpi/
 * itself: it would make the definitions weak. A function added to job.h
 * or mpi_comm.h is added here too. */
#ifndef TDM_MPI_MPI_WEAK_H
#define TDM_MPI_MPI_WEAK_H

#include "mpi/job.h"
#include "mpi/mpi_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#pragma weak tdm_comm_init_mpi
#pragma weak tdm_mpi_abort
#pragma weak tdm_mpi_backend_name
#pragma weak tdm_mpi_finalize
#pragma weak tdm_mpi_init
#pragma weak tdm_mpi_job_auto
#pragma weak tdm_mpi_job_comm
#pragma weak tdm_mpi_job_free
#pragma weak tdm_mpi_job_init
#pragma weak tdm_mpi_job_segment_id
#pragma weak tdm_mpi_job_topo
#pragma weak tdm_mpi_job_world
#pragma weak tdm_mpi_library_version
#pragma weak tdm_mpi_peer_run

#ifdef __cplusplus
}
#endif

#endif
