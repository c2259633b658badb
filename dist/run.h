/* dist/run.h: running the ranks of a design. One entry, tdm_dist_run,
 * takes a design's table of callbacks and does everything around them
 * that no design should write again:
 *
 *   - how the ranks start: forked here, one per device of the job
 *     (torch.multiprocessing.spawn); or this process is one rank of a job
 *     `tandem launch` started (TANDEM_SHM_FD and WORLD_SIZE), or of an
 *     MPI launcher's job (mpirun, srun: dist/mpi_job.h); or one rank over
 *     a communicator the caller already holds;
 *   - the process group (its timeout, dist/timeout.h), each rank's device
 *     (its own, or its machine's by local rank), and on a GPU the NCCL
 *     communicator for device memory, bootstrapped over the group;
 *   - the design's mesh and each rank's place in it (dist/mesh.h);
 *   - failure: a rank whose callback fails aborts the group with its
 *     message, so every other rank leaves its next collective naming it;
 *     forked ranks are watched (shm/spawn.h: the root cause is named, the
 *     rest stopped, nothing left behind); an MPI job is ended with
 *     MPI_Abort;
 *   - the flight recorder's dumps and their diagnosis (the watch hooks,
 *     which the CLI fills with `tandem doctor`'s) and restarts: after a
 *     rank's failure every forked rank starts again, from the last
 *     checkpoint this run wrote, at most max_restarts times (torchrun's
 *     --max-restarts).
 *
 * The contract with a design (DDP and FSDP today; pipeline, tensor
 * parallel and a parameter server are written to it):
 *
 *   layout   optional. Says how the world's ranks are laid out: the mesh
 *            shape (dp x pp x tp, dist/mesh.h) and each rank's role (a
 *            parameter server's servers and workers; the design's own
 *            numbers). Called once with rank -1 before any rank starts,
 *            where it may refuse the world size (INVALID_ARG or USAGE,
 *            with a message: a pipeline of 4 stages on 6 ranks), then in
 *            every rank for its own role. dist then gives each rank its
 *            coordinates and the mesh's sub-communicators over r->comm
 *            (r->mesh: one per dimension, split collectively before
 *            setup). NULL: one flat data-parallel group (all along dp), no
 *            mesh made.
 *   setup    builds the rank: its model on r->dev, its wrapper over
 *            r->comm / r->dev_comm or the sub-communicators of r->mesh
 *            (a design that needs a dimension's group on device memory
 *            splits r->dev_comm likewise: tdm_mesh_init), its optimizer,
 *            a resumed checkpoint. Collective. What it makes is its own,
 *            in *self, even on failure (free runs either way).
 *   run      the rank's work (a training loop, a comparison): drives the
 *            design through its ops (below), collectively.
 *   free     frees *self. Called once, after run or a failed setup,
 *            before dist frees the device and the communicators.
 *   ops      optional per-step entry points (dist/step.h): the whole
 *            optimizer step over this rank's part of a global batch,
 *            evaluation, a checkpoint, and for data-parallel designs the
 *            pieces of a step (zero_grad, forward, backward, optimizer
 *            step, no_sync, join) from which dist/step.c builds steps,
 *            gradient accumulation and uneven inputs.
 *
 * Ownership: dist owns r->comm, r->dev_comm, r->mesh and r->dev (borrowed
 * by the design for the rank's life); the design owns self. Failure: a callback
 * returns a status with its message set (tdm_error_set); dist aborts the
 * group with that message (a callback may abort first, with words of its
 * own) and returns the status. Callbacks never exit(). */
#ifndef TDM_DIST_RUN_H
#define TDM_DIST_RUN_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/status.h"
#include "dist/mesh.h"
#include "dist/mpi_job.h"
#include "dist/pg.h"
#include "shm/spawn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How this process's ranks start. */
typedef enum tdm_dist_start {
    TDM_DIST_START_FORKED = 0,   /* tdm_dist_run forks one rank per device */
    TDM_DIST_START_LAUNCHED,     /* this process is a rank of a `tandem launch` job */
    TDM_DIST_START_MPI,          /* this process is a rank of an MPI launcher's job */
    TDM_DIST_START_GIVEN,        /* one rank over the caller's communicator (opts.comm) */
} tdm_dist_start;

/* What a rank is given. */
typedef struct tdm_dist_rank {
    tdm_dist_start start;
    tdm_dist_env env;            /* rank, world, and the rank on its machine */
    tdm_comm *comm;              /* the process group over every rank: host memory, any
                                    collective, the aborts; borrowed */
    tdm_comm *dev_comm;          /* collectives on device memory: NCCL on a GPU (with
                                    TDM_DIST_NCCL), else comm; borrowed */
    tdm_device *dev;             /* this rank's device; borrowed */
    int64_t timeout_ms;          /* the process group's timeout, as used */
    const char *job_desc;        /* an MPI job: "mpi, 4 ranks on 2 machines"; else NULL */
    tdm_mesh_shape shape;        /* the design's layout (none: world x 1 x 1, all dp) */
    int coord[TDM_MESH_NDIMS];   /* this rank's coordinates in shape */
    int role;                    /* the design's role for this rank (0 unless its layout
                                    says) */
    tdm_mesh *mesh;              /* with a layout: a sub-communicator per dimension over
                                    comm; NULL without one; borrowed */
} tdm_dist_rank;

typedef struct tdm_dist_ops tdm_dist_ops;   /* dist/step.h */

/* Design capabilities (tdm_dist_design.caps). */
enum {
    TDM_DIST_MPI = 1u << 0,      /* can run as the ranks of an MPI launcher's job */
    TDM_DIST_NCCL = 1u << 1,     /* a GPU rank's device collectives go over NCCL */
};

typedef struct tdm_dist_design {
    const char *name;            /* "ddp", "fsdp": said in the job's messages */
    unsigned caps;               /* TDM_DIST_MPI | TDM_DIST_NCCL */
    tdm_status (*layout)(void *ctx, int world, int rank, tdm_mesh_shape *shape, int *role);
    tdm_status (*setup)(void *ctx, tdm_dist_rank *r, void **self);
    tdm_status (*run)(void *ctx, tdm_dist_rank *r, void *self);
    void (*free)(void *ctx, void *self);
    const tdm_dist_ops *ops;
} tdm_dist_design;

/* What happens around forked ranks, for the caller to report: the CLI's
 * flight-recorder dumps and their verdict (tools/doctor.h), and the lines
 * it prints. Every entry may be NULL. */
typedef struct tdm_dist_watch {
    void *ctx;
    /* before an attempt's ranks start (attempt 0, then each restart); a
     * failure (its message said by the hook) ends the run with that
     * status before any rank starts */
    tdm_status (*begin)(void *ctx, int attempt);
    /* a failed attempt's teardown, once every rank still running is
     * stopped (shm/spawn.h's settled hook) */
    tdm_shm_settled_fn settled;
    /* after the attempt: st (its message set), the ranks' pids and wait
     * statuses; last: no restart follows (the run ends with st) */
    void (*end)(void *ctx, tdm_status st, int world, const tdm_shm_spawn_result *res,
                int last);
    /* before restart `attempt` (1..), after backoff_ms; resume: where the
     * ranks resume from (NULL: the start) */
    void (*restart)(void *ctx, int attempt, long long max_restarts, int backoff_ms,
                    const char *resume);
    /* elastic resize (opts.min_world): rank `failed` failed on two
     * attempts in a row; the next runs on `to` ranks instead of `from`
     * without its device, or (to == 0) none can: left ranks were left,
     * below opts.min_world, and the run ends. May be NULL. */
    void (*resize)(void *ctx, int failed, int from, int to, int left);
} tdm_dist_watch;

typedef struct tdm_dist_run_opts {
    /* The devices: forked ranks take one each (rank r: index[r], or the
     * one listed device for every rank); a launched or MPI rank takes its
     * machine's by local rank (the one listed, with index local_rank; else
     * index[local_rank % count]). spec is --device as given (messages). */
    const tdm_device_list *devices;
    const char *spec;
    int64_t timeout_ms;          /* the process group's; 0: TANDEM_TIMEOUT, else
                                    TDM_DIST_FORKED_TIMEOUT_MS forked, else
                                    TDM_DIST_TIMEOUT_DEFAULT_MS */
    /* forked */
    int world;                   /* ranks; 0: one per device of the list */
    int64_t run_timeout_ms;      /* bound on the whole run; 0: TDM_DIST_RUN_UNBOUNDED_MS */
    size_t arena_bytes;          /* shm arena per rank (zero-copy gradients; also an MPI
                                    job's shm segment) */
    /* 1: a forked rank's failure stops no other rank (shm/spawn.h's
     * outlive_failures): a design whose ranks go on without a lost one
     * (a parameter server's asynchronous workers); the run still fails,
     * naming it, once the others have ended */
    int outlive_failures;
    long long max_restarts;      /* restarts after a rank's failure (PEER_FAILED) */
    /* Elastic resize of forked ranks: when the same rank (the lowest one
     * killed by a signal the teardown did not send) fails on two attempts
     * in a row, the next attempt leaves its device out and runs on the
     * most ranks that are at most those left and divide world_divides (a
     * power of two: --deterministic's K), never fewer than min_world
     * (else the run ends). min_world 0: never. */
    int min_world;
    int world_divides;
    const char *save;            /* a checkpoint the ranks write: once this run wrote it
                                    (tdm_dist_restart_ours), a restart resumes from it */
    const char **resume;         /* set to save before such a restart (the ranks read it);
                                    else left as the caller's (the start when NULL) */
    const tdm_dist_watch *watch; /* may be NULL */
    /* an MPI job */
    tdm_mpi_backend backend;     /* the communicator over its ranks (AUTO: shm on one
                                    machine, hier on several; mpi for a design with
                                    a layout, whose mesh splits it) */
    /* TDM_DIST_START_GIVEN: this process is rank env.rank of comm's group */
    tdm_comm *comm;
    tdm_dist_env env;
    const char *job_desc;
} tdm_dist_run_opts;

/* How tdm_dist_run will start design d's ranks here: GIVEN with
 * opts->comm, LAUNCHED under `tandem launch`, MPI under an MPI launcher
 * when the design can, FORKED otherwise. */
tdm_dist_start tdm_dist_job_start(const tdm_dist_design *d, const tdm_dist_run_opts *o);

/* The process group's timeout of o for a start (o->timeout_ms, else
 * TANDEM_TIMEOUT, else the default of that start); INVALID_ARG when
 * TANDEM_TIMEOUT is malformed. */
tdm_status tdm_dist_job_timeout(const tdm_dist_run_opts *o, tdm_dist_start start,
                                int64_t *timeout_ms);

/* Runs d's ranks (see the top of this file). ctx is passed to every
 * callback. Forked: returns OK when every rank succeeded, else the last
 * attempt's root cause (PEER_FAILED for a rank's failure) with its
 * message. Otherwise: this rank's status (its message set). */
tdm_status tdm_dist_run(const tdm_dist_design *d, void *ctx, const tdm_dist_run_opts *o);

/* The pieces of a rank tdm_dist_run uses, for code that runs one outside
 * it (tests, benchmarks). Rank `rank`'s device from devices (above; one
 * BLAS thread). */
tdm_status tdm_dist_rank_device(const tdm_device_list *devices, int rank, tdm_device **dev);
/* tdm_device_list_parse, but when forks is set and spec names CUDA GPUs,
 * in a short-lived child: counting GPUs initialises CUDA, and a process
 * that has initialised CUDA cannot hand it to forked children (the ranks
 * tdm_dist_run forks). The result (the status, message and list) comes
 * back unchanged. */
tdm_status tdm_dist_parse_devices(tdm_device_list *dl, const char *spec, int forks);
/* 1 when dev is a GPU (a CUDA device that is not emulated). */
int tdm_dist_device_is_gpu(const tdm_device *dev);
/* The NCCL communicator of a GPU rank, bootstrapped over the shm group
 * (collective; its watchdog stops when the group aborts; the group's
 * timeout, TANDEM_TIMEOUT, bounds it unless TANDEM_NCCL_TIMEOUT_MS says
 * otherwise). *nccl = NULL on host and emulated devices, which reduce
 * over the group itself. */
tdm_status tdm_dist_gpu_comm(tdm_comm *group, tdm_device *dev, tdm_comm **nccl);

/* Rank 0 speaks for the job: on any other rank stdout goes to
 * /dev/null, and with err_fd stderr too, its old descriptor kept in
 * *err_fd (-1 when nothing was kept) for tdm_dist_unsilence. */
void tdm_dist_silence(int rank, int *err_fd);
/* stderr back from *err_fd (nothing when it is -1); *err_fd = -1. */
void tdm_dist_unsilence(int *err_fd);

/* Elastic restarts: TANDEM_RESTART_COUNT, exported to every rank, is how
 * many restarts came before this attempt (TORCHELASTIC_RESTART_COUNT);
 * TANDEM_RESUME, the checkpoint the ranks resume from on a restart
 * (tandem launch --checkpoint). */
#define TDM_DIST_ENV_RESTARTS "TANDEM_RESTART_COUNT"
#define TDM_DIST_ENV_RESUME "TANDEM_RESUME"
#define TDM_DIST_RESTARTS_MAX 1000
/* TANDEM_RUN_ID: the run every attempt of one `tandem train` or `tandem
 * launch` belongs to, exported to the ranks and written in their
 * checkpoints ("run", models/checkpoint.h): a restart resumes only from a
 * checkpoint with this id, never from one another run left at the same
 * path. Tests that compare two runs' files byte for byte set one for
 * both. */
#define TDM_DIST_ENV_RUN "TANDEM_RUN_ID"

/* This attempt's TANDEM_RESTART_COUNT (0 when unset or malformed). */
int tdm_dist_restart_count(void);
/* Sets it for the next attempt's ranks. */
void tdm_dist_restart_count_set(int attempt);
/* This process's run: TANDEM_RUN_ID when set, else one drawn and
 * exported when restarts are asked for (without them nothing reads it: no
 * run id is written, and the checkpoints are the bytes they always were);
 * given to tdm_checkpoint_set_run for every checkpoint saved from here
 * on (forked ranks inherit it). Returns it, NULL when none. */
const char *tdm_dist_run_id_begin(int restarts);
/* *ours = 1 when path holds a checkpoint this run wrote (its "run"
 * metadata is TANDEM_RUN_ID's); else 0 and, when why is given, what is
 * there instead ("ck does not exist yet", "ck is not a checkpoint: ...",
 * "ck holds another run's checkpoint (run ...), not one this job
 * wrote"). Reads the file's header only. A file that exists but cannot
 * be read (TDM_STATUS_IO, TDM_STATUS_OUT_OF_MEMORY) is an error, its
 * message also in why: never taken for "not ours", which would restart
 * the job from the start. */
tdm_status tdm_dist_restart_ours(const char *path, int *ours, char *why, size_t n);
/* What a rank restarted by a launcher (tandem launch --max-restarts)
 * resumes from when it was given nothing to resume: *resume = NULL on the
 * first attempt; then TANDEM_RESUME (the launcher's --checkpoint), else
 * save (the rank's own checkpoint), once this run wrote it
 * (tdm_dist_restart_ours: never another run's file at the same path;
 * its errors are returned). */
tdm_status tdm_dist_restart_resume(const char *save, const char **resume);
/* Sleeps before restart `attempt` (1..): 200 ms doubled each time, at
 * most 5 s (a rank that fails at once does not spin the machine; a
 * transient fault is retried soon). Returns the ms slept. */
int tdm_dist_backoff(int attempt);

#ifdef __cplusplus
}
#endif

#endif
