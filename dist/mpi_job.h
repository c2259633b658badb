/* dist/mpi_job.h: a rank of an MPI launcher's job (mpirun, srun):
 * noticing the launcher, naming and parsing the communicator backends
 * (--backend), and one rank's job and communicator, as dist/run.h starts
 * it for `train --mode ddp` and as `compare` and `bench <collective>`
 * join one. mpi/ is reached through weak symbols (mpi/mpi_weak.h): a
 * build without MPI's development files links, notices the launch all
 * the same, and says how to get MPI. */
#ifndef TDM_DIST_MPI_JOB_H
#define TDM_DIST_MPI_JOB_H

#include "core/comm.h"
#include "core/status.h"
#include "dist/pg.h"
#include "mpi/job.h"
#include "shm/shm_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when an MPI launcher started this process: Open MPI's mpirun
 * (OMPI_COMM_WORLD_SIZE), a PMIx launcher such as `srun --mpi=pmix`
 * (PMIX_RANK), or a PMI-1/2 one such as MPICH's or `srun --mpi=pmi2`
 * (PMI_RANK and PMI_SIZE). Reads the environment only. */
int tdm_dist_mpi_launched(void);
/* "OMPI_COMM_WORLD_SIZE=4" or the like: what gave the launch away. */
const char *tdm_dist_mpi_launch_hint(void);
/* 1 when mpi/ is built into this binary. */
int tdm_dist_mpi_built(void);
/* TDM_STATUS_UNSUPPORTED with "<what>: this tandem was built without MPI
 * ...: run `make deps` (libopenmpi-dev, openmpi-bin) and rebuild". */
tdm_status tdm_dist_mpi_missing(const char *what);

/* "auto", "shm", "mpi", "hier". */
const char *tdm_dist_backend_name(tdm_mpi_backend b);
/* --backend: "auto", "shm", "mpi" or "hier"; INVALID_ARG, its message
 * naming s, when it is none of them. */
tdm_status tdm_dist_backend_parse(const char *s, tdm_mpi_backend *out);

/* --backend as given (NULL: auto) for a job that is (in_job) or is not
 * an MPI launcher's: parsed into *out; outside an MPI job only auto and
 * shm mean anything, and mpi or hier are refused: UNSUPPORTED where mpi/
 * is not built (tdm_dist_mpi_missing), else USAGE saying how to start the
 * ranks ("start them with `mpirun -np N tandem <cmd> --backend mpi ...`
 * (or srun)"). A name that is no backend is INVALID_ARG. */
tdm_status tdm_dist_backend_choose(const char *text, int in_job, const char *cmd,
                                   tdm_mpi_backend *out);

/* One rank of an MPI job. */
typedef struct tdm_dist_mpi_rank {
    tdm_mpi_job *job;
    tdm_comm *comm;             /* the backend's communicator over every rank */
    tdm_comm *world;            /* the job's own (control: its waits sleep); borrowed */
    tdm_mpi_backend backend;    /* the one picked (never AUTO) */
    tdm_dist_env env;           /* rank, world, and the rank on its machine */
    char desc[128];             /* "mpi, 4 ranks on 2 machines (pretend, TCP on lo)" */
} tdm_dist_mpi_rank;

/* What the ranks do with the job's communicator: use it whole, or split
 * it into groups (a design's mesh), which the hierarchical communicator
 * cannot be split into: there AUTO picks mpi, not hier, on several
 * machines. */
typedef enum tdm_dist_mpi_use {
    TDM_DIST_MPI_WHOLE = 0,
    TDM_DIST_MPI_SPLIT,
} tdm_dist_mpi_use;

/* Starts the job and builds backend b's communicator (collective; log
 * lines are tagged with the rank), AUTO resolved for use. timeout_ms
 * bounds every wait of the communicator (0: the defaults,
 * TANDEM_MPI_TIMEOUT_MS or 300 s); shm may be NULL. */
tdm_status tdm_dist_mpi_rank_init(tdm_dist_mpi_rank *r, tdm_mpi_backend b, tdm_dist_mpi_use use,
                                  int64_t timeout_ms, const tdm_shm_opts *shm);
/* This rank in the job, and the job's ranks, from the launcher's
 * environment (before MPI starts); 0 when none says. */
int tdm_dist_mpi_env_rank(void);
int tdm_dist_mpi_env_world(void);
/* Frees the communicator, then the job (MPI_Finalize). */
void tdm_dist_mpi_rank_free(tdm_dist_mpi_rank *r);
/* The end of a rank whose work ended with st: a runtime failure (this
 * rank's alone perhaps, while others wait for it, maybe on another
 * machine) ends the job with MPI_Abort; otherwise (OK, or a usage error
 * every rank met alike) tdm_dist_mpi_rank_free. */
void tdm_dist_mpi_rank_end(tdm_dist_mpi_rank *r, tdm_status st);

#ifdef __cplusplus
}
#endif

#endif
