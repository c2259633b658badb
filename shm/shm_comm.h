/* shm/shm_comm.h: the shared-memory communicator: N processes of one
 * machine run the collectives of core/comm.h through one shared segment.
 *
 * Two ways in:
 * - forked ranks: the parent calls tdm_shm_group_create() (creates the
 *   segment, reserves its space, writes its header), forks, and each child
 *   calls tdm_shm_comm_init(). The parent reports how each child ended
 *   with tdm_shm_group_mark_ended() and releases the group with
 *   tdm_shm_group_free() (shm/spawn.h does all of this for you);
 * - exec'd ranks (a launcher): the launcher creates the group, calls
 *   tdm_shm_group_export_env() before exec, and each rank calls
 *   tdm_shm_comm_init_from_env(), which reads RANK, WORLD_SIZE and
 *   TANDEM_SHM_FD.
 *
 * The segment is a memfd (no name anywhere) or, when opts.shm_dir is set,
 * an unlinked O_TMPFILE in that directory: nothing is ever left behind.
 * A third way, for ranks no process forked: a segment created and joined
 * by name, unlinked once every rank has attached (below).
 * See docs/SHM.md for the layout, algorithms, waits and failure handling.
 * This header is not the collective API itself: use core/comm.h on the
 * tdm_comm this returns. */
#ifndef TDM_SHM_SHM_COMM_H
#define TDM_SHM_SHM_COMM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/comm.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_SHM_ENV_FD "TANDEM_SHM_FD"
#define TDM_SHM_MAX_RANKS 64

typedef struct tdm_shm_opts {
    /* Directory for the segment (an unlinked O_TMPFILE there, e.g. a
     * tmpfs); NULL: an anonymous memfd. */
    const char *shm_dir;
    /* Bytes of each rank's staging area (two of them per rank, double
     * buffered); 0: 1 MiB. Rounded to 4 KiB. */
    size_t slot_bytes;
    /* Bytes of each rank's zero-copy arena (tdm_shm_comm_alloc); 0: none. */
    size_t arena_bytes;
    /* Deadline of every wait in ms; 0: 300000 (5 minutes). */
    int64_t timeout_ms;
    /* Messages up to this many bytes use the one-shot all_reduce; 0: the
     * default (512 bytes for two ranks when the group has two cores or
     * more, see `cores`, else 4 KiB); SIZE_MAX: always one-shot (as far
     * as it fits). */
    size_t one_shot_max_bytes;
    /* Cores the group's ranks can run on together: the union of their CPU
     * affinity masks. It decides whether waits spin (ranks <= cores) and
     * the one-shot default, and is written in the header, so that every
     * rank decides alike. 0: the creating process's affinity, which forked
     * and launched ranks inherit (a rank that narrows its own affinity
     * later, e.g. pinning itself to one core of it, does not change what
     * the group can use). Ranks that are not children of the creator
     * (mpirun --bind-to core pins each to its own core) must say: mpi/
     * gathers the union over MPI when the job forms. */
    int cores;
    /* 1: never spin, always sleep (tests of the futex path). */
    int no_spin;
    /* A peer being waited for whose heartbeat has not advanced for this
     * many ms is reported stopped (SIGSTOP, a debugger) or frozen instead
     * of being waited for until timeout_ms. 0: TANDEM_SHM_STALL_MS from
     * the environment, else 3000; negative: never (waits run to the
     * deadline). At least 500. */
    int64_t stall_ms;
} tdm_shm_opts;

typedef struct tdm_shm_group tdm_shm_group;

/* Parent side: creates and reserves the segment for `world` ranks. Fails
 * at once, naming the bytes needed, if the backing store is too small. */
tdm_status tdm_shm_group_create(tdm_shm_group **out, int world, const tdm_shm_opts *opts);
/* Unmaps and closes. NULL is a no-op. */
void tdm_shm_group_free(tdm_shm_group *g);
/* Parent side: rank's process ended with waitpid status `wstatus`. A
 * failure (a signal or a non-zero exit, freed communicator or not) marks
 * it dead and raises the group abort so that the other ranks stop at
 * once. An exit 0 only records it: a rank waiting for it later fails
 * naming it ("exited with code 0 before all_reduce #5 without freeing its
 * communicator"); ranks that do not need it go on. */
void tdm_shm_group_mark_ended(tdm_shm_group *g, int rank, int wstatus);
/* Records rank's pid before the child has attached, so that liveness
 * checks cover a rank that dies before tdm_shm_comm_init. */
void tdm_shm_group_set_pid(tdm_shm_group *g, int rank, pid_t pid);
/* For launchers: clears close-on-exec on the segment fd and sets
 * TANDEM_SHM_FD in this process's environment (RANK and WORLD_SIZE are
 * the launcher's to set per child). */
tdm_status tdm_shm_group_export_env(tdm_shm_group *g);
int tdm_shm_group_fd(const tdm_shm_group *g);
size_t tdm_shm_group_bytes(const tdm_shm_group *g);

/* Child side, after fork: joins the group as `rank`. opts may be NULL
 * (the group's options are used; timeout_ms and no_spin may differ per
 * rank). */
tdm_status tdm_shm_comm_init(tdm_comm **out, tdm_shm_group *g, int rank,
                             const tdm_shm_opts *opts);
/* Joins through an inherited fd: maps it and validates the header
 * (magic, version, sizes, world) before trusting any offset. */
tdm_status tdm_shm_comm_attach_fd(tdm_comm **out, int fd, int rank, int world,
                                  const tdm_shm_opts *opts);
/* Exec'd ranks: RANK, WORLD_SIZE, TANDEM_SHM_FD from the environment. */
tdm_status tdm_shm_comm_init_from_env(tdm_comm **out, const tdm_shm_opts *opts);

/* Ranks that are not children of one process (an MPI job's ranks on one
 * machine; mpi/shm_named.c agrees on the name and the job id): one creates
 * the segment by name in /dev/shm - O_EXCL, mode 0600, the header's job id
 * job_id - and every rank (the creator too) attaches by name, which
 * refuses a symbolic link, a file that is not regular, not this user's or
 * not 0600, and a header that is wrong or of another job. The last rank
 * to attach unlinks the name (before anyone can pass a first collective),
 * and the creator does once tdm_shm_group_attached() reaches world (or
 * gives up), so that nothing is left after a crash. name: "/" and one
 * component. */
tdm_status tdm_shm_group_create_named(tdm_shm_group **out, const char *name, int world,
                                      uint64_t job_id, const tdm_shm_opts *opts);
tdm_status tdm_shm_comm_attach_named(tdm_comm **out, const char *name, int rank, int world,
                                     uint64_t job_id, const tdm_shm_opts *opts);
/* Ranks that have attached to g so far (whether still alive or not), and
 * whether rank r has. */
int tdm_shm_group_attached(const tdm_shm_group *g);
int tdm_shm_group_rank_attached(const tdm_shm_group *g, int rank);
/* Removes the name (no error when it is already gone). */
tdm_status tdm_shm_unlink_named(const char *name);

/* What a communicator decided from the group's cores (tests, logs):
 * whether its waits spin (synchronous calls; asynchronous ones, waited on
 * the progress thread), and its one-shot limit. */
typedef struct tdm_shm_tuning {
    int cores;                 /* the group's, from the header */
    int spin, spin_async;
    size_t one_shot_max_bytes;
} tdm_shm_tuning;
/* TDM_STATUS_INVALID_ARG when comm is not an shm communicator. */
tdm_status tdm_shm_comm_tuning(const tdm_comm *comm, tdm_shm_tuning *out);

/* Zero-copy memory: nbytes (rounded up to 64) from this rank's arena, at
 * the same offset on every rank, so all ranks must allocate the same
 * sizes in the same order. all_reduce on such a buffer (in place) reads
 * the peers' buffers directly. Freed with the communicator. */
tdm_status tdm_shm_comm_alloc(tdm_comm *comm, size_t nbytes, void **ptr);

/* The group's abort reason once any rank (or the parent) has raised the
 * abort flag, NULL until then; also NULL for a communicator that is not
 * shm. One atomic load: cheap enough for a watchdog to poll (the NCCL
 * communicator's abort_check, so that a rank blocked in NCCL stops as soon
 * as the shm group is aborted). */
const char *tdm_shm_comm_abort_reason(const tdm_comm *comm);
/* The ranks this communicator's messages name: names[r] for its rank r
 * (world entries), when its ranks are a part of a larger job (MPI's hier:
 * one machine's ranks), so that "rank 3 (pid ...) is stopped" is the
 * job's rank 3. Default: its own ranks. Every rank of the group must set
 * the same table, before its first collective. No-op for another
 * backend. */
void tdm_shm_comm_set_rank_names(tdm_comm *comm, const int *names);

#ifdef __cplusplus
}
#endif

#endif
