/* tools/bench_coll.h: what the two halves of `tandem bench <collective>`
 * share: the configuration parsed by tools/bench_coll.c and the
 * per-rank benchmark loop, which tools/bench_coll.c runs in forked ranks
 * over shm (or NCCL) and tools/bench_mpi.c in the ranks of an MPI job
 * over each backend asked for (and Open MPI's own collectives, the peer). */
#ifndef TDM_TOOLS_BENCH_COLL_H
#define TDM_TOOLS_BENCH_COLL_H

#include <stddef.h>

#include "core/comm.h"
#include "core/device.h"
#include "mpi/job.h"

typedef struct bench_cfg {
    tdm_coll coll;
    int nranks;
    size_t min_bytes, max_bytes;
    double factor;
    tdm_dtype dtype;
    tdm_redop op;
    int root;
    int warmup, iters;
    int zero_copy;
    size_t memcpy_bytes;
    size_t slot_bytes;
    size_t one_shot_bytes;
    int bind;
    int host_cores;          /* cores this job may use, counted before any pinning
                              * (bench_host_cores) */
    const char *device;      /* --device as given (NULL: not given) */
    tdm_device_list dl;      /* CUDA: rank r runs on cuda:<dl.index[r]> */
    int cuda;                /* ranks on CUDA devices (or emulated ones) */
    /* MPI (tools/bench_mpi.c) */
    tdm_mpi_backend backends[TDM_MPI_BACKEND_COUNT_]; /* --backend, in order */
    int nbackends;           /* 0: --backend not given (shm) */
    int peer;                /* --peer mpi: Open MPI's own collectives too */
    int table;               /* print the backend column (several rows a size) */
    const char *job_desc;    /* the MPI job, for the header; NULL: forked ranks */
    /* the command line as parsed (tools/bench_coll.c) */
    int help, have_coll, nranks_set;
    const char *shm_flag;    /* the last shm-only flag given (NULL: none) */
} bench_cfg;

/* The job's cores, for the header: counted before a rank is pinned. An
 * MPI rank (mpirun binds it before it starts) reads what the relaunch
 * counted (TDM_BENCH_CORES_ENV), else the machine's online CPUs. */
#define TDM_BENCH_CORES_ENV "TANDEM_BENCH_HOST_CORES"
int bench_host_cores(void);

/* One communicator benchmarked; peer: its calls go to MPI's blocking
 * collectives (tdm_mpi_peer_run) instead. */
typedef struct bench_target {
    const char *name;
    tdm_comm *comm;
    int peer;
} bench_target;

/* The benchmark in one rank: ctl carries the barriers and the reduction
 * of the times; every target runs every size, in turn. Returns the
 * rank's exit code (0, or 1 on a failure or a wrong element). */
int tdm_tool_bench_ranks(tdm_comm *ctl, bench_target *targets, int ntargets,
                         const bench_cfg *cfg);

/* -r and -b against the number of ranks: TDM_STATUS_USAGE when wrong
 * (after a message when say is set). */
tdm_status tdm_tool_bench_check_ranks(const bench_cfg *cfg, int say);

/* tools/bench_mpi.c: runs the benchmark as (or, outside one, under) an
 * MPI job; argv is the bench command line, for the relaunch. A wrong
 * element is TDM_STATUS_INTERNAL (the rows and the summary said which). */
tdm_status tdm_tool_bench_mpi(bench_cfg *cfg, int argc, char **argv);

#endif
