/* mpi/job.h: one rank's view of a job started by an MPI launcher: its
 * rank, its machine and its rank on that machine, and the communicators a
 * tool picks between:
 *   shm   shared memory, every rank on one machine (a segment created and
 *         joined by name, see mpi/shm_named.c);
 *   mpi   MPI between every pair of ranks (mpi/mpi_comm.h);
 *   hier  shared memory inside each machine + MPI between machines
 *         (mpi/hier.c).
 * Plain C types only (no mpi.h). Tools reach these through weak symbols.
 *
 * Pretend machines (tests, and measuring the hierarchical algorithms on
 * one machine): TANDEM_PRETEND_MACHINES=K splits the ranks of each
 * machine into K consecutive groups that the job treats as machines. MPI
 * traffic then runs over TCP on the loopback interface only, as between
 * real machines: before MPI starts, the job sets Open MPI's
 * OMPI_MCA_btl=tcp,self, OMPI_MCA_btl_tcp_if_include=lo,
 * OMPI_MCA_btl_tcp_disable_family=6 and OMPI_MCA_pml=ob1 (whatever they
 * were). TANDEM_PRETEND_MACHINES=K:shm keeps MPI's shared-memory transport
 * (what the algorithms cost when the "network" is memory). */
#ifndef TDM_MPI_JOB_H
#define TDM_MPI_JOB_H

#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "mpi/mpi_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_MPI_ENV_PRETEND "TANDEM_PRETEND_MACHINES"

typedef enum tdm_mpi_backend {
    TDM_MPI_BACKEND_AUTO = 0,  /* shm on one machine, hier on several */
    TDM_MPI_BACKEND_SHM,
    TDM_MPI_BACKEND_MPI,
    TDM_MPI_BACKEND_HIER,
    TDM_MPI_BACKEND_COUNT_
} tdm_mpi_backend;

/* "auto", "shm", "mpi", "hier". */
const char *tdm_mpi_backend_name(tdm_mpi_backend b);

typedef struct tdm_mpi_topo {
    int rank, size;              /* MPI_COMM_WORLD's */
    int machine, n_machines;     /* machines numbered by their lowest rank */
    int local_rank, local_size;  /* on this machine */
    int pretend;                 /* K of TANDEM_PRETEND_MACHINES; 0: real machines */
    int pretend_tcp;             /* 1: MPI over TCP on lo between pretend machines */
    int uniform;                 /* 1: every machine has local_size ranks */
} tdm_mpi_topo;

typedef struct tdm_mpi_job tdm_mpi_job;

/* Starts MPI (tdm_mpi_init, after setting the pretend transport), joins
 * (bounded: rank 0 names ranks that never arrive), and learns which
 * ranks share a machine (MPI_COMM_TYPE_SHARED, then the pretend split).
 * Collective. opts may be NULL. */
tdm_status tdm_mpi_job_init(tdm_mpi_job **out, const tdm_mpi_opts *opts);
/* Frees the job's own communicator and finalises MPI (if tandem started
 * it). Every communicator from tdm_mpi_job_comm must be freed first.
 * NULL is a no-op. */
void tdm_mpi_job_free(tdm_mpi_job *job);
const tdm_mpi_topo *tdm_mpi_job_topo(const tdm_mpi_job *job);
/* The backend AUTO stands for in this job. */
tdm_mpi_backend tdm_mpi_job_auto(const tdm_mpi_job *job);
/* The id in the names of this job's shared segments (rank 0 draws it
 * when the first one is made, see mpi/shm_named.c); 0 before. */
uint64_t tdm_mpi_job_segment_id(const tdm_mpi_job *job);
/* The job's own MPI communicator over every rank (control traffic, the
 * benchmark's reference); owned by the job. Its calls are always MPI's
 * non-blocking ones, so that a rank waiting long in one sleeps. */
tdm_comm *tdm_mpi_job_world(tdm_mpi_job *job);

/* A new communicator of backend b over every rank of the job (AUTO:
 * tdm_mpi_job_auto). Collective. shm_opts (may be NULL) sizes the shared
 * segments of shm and hier. Fails with a message saying why when b
 * cannot serve this job (shm across machines). */
struct tdm_shm_opts;
tdm_status tdm_mpi_job_comm(tdm_mpi_job *job, tdm_mpi_backend b,
                            const struct tdm_shm_opts *shm_opts, tdm_comm **out);

#ifdef __cplusplus
}
#endif

#endif
