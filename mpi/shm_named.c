/* mpi/shm_named.c: the shm communicator of one machine's ranks in an MPI
 * job. They are not children of one tandem process, so the segment cannot
 * be inherited: local rank 0 creates it by name in /dev/shm (shm_open,
 * O_CREAT | O_EXCL, mode 0600; the name carries the owner's uid, a job id
 * rank 0 of the job drew and broadcast over MPI, and the machine), tells
 * the others over MPI, and they open it by name, checking owner, mode and
 * the header (magic, version, layout, world, job id) before trusting it.
 * The last rank to attach unlinks the name at once (local rank 0 does
 * too once it sees them all), so that a crash afterwards leaves nothing
 * behind; only a crash during set-up can leave it. A rank that has not
 * attached within the join timeout is named, the name unlinked, and the
 * job aborted. From there on the communicator is shm's own, with every
 * protection it has (validated header, liveness and heartbeats, the group
 * abort flag, deadlines).
 * Not the segment itself (shm/segment.c) nor the MPI job (mpi/job.c). */
#include "mpi/job_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/timer.h"
#include "shm/shm_comm.h"

/* The shm communicator's ranks are the machine's local ones; its
 * messages ("rank 3 (pid ...) is stopped") name the job's ranks, which
 * tandem doctor and every other line use. */
static void tdm_mpi_shm_job_ranks(tdm_mpi_job *j, MPI_Comm machine, tdm_comm *comm)
{
    int ls = 0, names[TDM_SHM_MAX_RANKS], local[TDM_SHM_MAX_RANKS];
    MPI_Comm_size(machine, &ls);
    if (ls > TDM_SHM_MAX_RANKS) return;
    MPI_Group mg, wg;
    MPI_Comm_group(machine, &mg);
    MPI_Comm_group(((tdm_mpi_impl *)tdm_comm_impl(j->world))->comm, &wg);
    for (int l = 0; l < ls; l++) local[l] = l;
    if (MPI_Group_translate_ranks(mg, ls, local, wg, names) == MPI_SUCCESS)
        tdm_shm_comm_set_rank_names(comm, names);
    MPI_Group_free(&mg);
    MPI_Group_free(&wg);
}

tdm_status tdm_mpi_shm_named_comm(tdm_mpi_job *j, MPI_Comm machine,
                                  const struct tdm_shm_opts *shm_opts, tdm_comm **out)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_shm_group *g = NULL;
    int lr = 0, ls = 0;
    MPI_Comm_rank(machine, &lr);
    MPI_Comm_size(machine, &ls);
    uint64_t job = tdm_mpi_job_id(j);   /* agreed when the job formed (mpi/job.c) */
    /* The cores these ranks can use together decide the segment's spin
     * policy and one-shot default, written in its header by its creator:
     * the union of every local rank's affinity (gathered when the job
     * formed), not local rank 0's alone (one core under mpirun --bind-to
     * core). An explicit count stays. */
    tdm_shm_opts so = shm_opts ? *shm_opts : (tdm_shm_opts){0};
    if (so.cores <= 0) so.cores = j->machine_cores;
    shm_opts = &so;
    /* a job's machines are numbered; pretend ones share /dev/shm */
    j->n_segments++;
    char name[96];
    snprintf(name, sizeof name, "/tandem-%u-%016llx-m%d-%d", (unsigned)geteuid(),
             (unsigned long long)job, j->topo.machine, j->n_segments);
    /* local rank 0 creates, then tells the others: a status each (its
     * failure is theirs too, named) */
    int32_t made = 1;
    char why[512] = "";
    if (lr == 0) {
        st = tdm_shm_group_create_named(&g, name, ls, job, shm_opts);
        if (st != TDM_STATUS_OK) {
            made = 0;
            snprintf(why, sizeof why, "%s", tdm_error_message());
        }
    }
    tdm_mpi_waiter wt = {.timeout_ms = j->opts.join_timeout_ms};
    MPI_Request req;
    MPI_Ibcast(&made, 1, MPI_INT32_T, 0, machine, &req);
    tdm_mpi_wait_all(&wt, 1, &req, NULL, "mpi: waiting for local rank 0 to create the shared "
                     "segment");
    if (!made) {
        /* every local rank fails alike; rank 0 has the reason */
        if (lr == 0) return tdm_error_set(st, "%s", why);
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "local rank 0 could not create the shared "
                             "segment %s (see its error)", name);
    }
    st = tdm_shm_comm_attach_named(out, name, lr, ls, job, shm_opts);
    if (st == TDM_STATUS_OK) tdm_mpi_shm_job_ranks(j, machine, *out);
    if (lr != 0) return st;
    /* local rank 0: wait for every local rank to attach, then unlink */
    if (st == TDM_STATUS_OK) {
        uint64_t t0 = tdm_time_ns();
        int attached = 0;
        while ((attached = tdm_shm_group_attached(g)) < ls &&
               tdm_time_ns() - t0 < (uint64_t)j->opts.join_timeout_ms * 1000000u) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
        if (attached < ls) {
            char missing[256] = "";
            size_t used = 0;
            for (int r = 0; r < ls; r++) {
                if (tdm_shm_group_rank_attached(g, r)) continue;
                /* the job's rank of local rank r */
                int w = -1;
                for (int q = 0; q < j->topo.size; q++)
                    if (j->machine_of[q] == j->topo.machine && j->local_of[q] == r) w = q;
                int k = snprintf(missing + used, sizeof missing - used, "%srank %d (local rank %d)",
                                 used ? ", " : "", w, r);
                if (k > 0 && (size_t)k < sizeof missing - used) used += (size_t)k;
            }
            tdm_shm_unlink_named(name);
            tdm_mpi_abort_job("%s did not attach to this machine's shared segment within %lld ms "
                              "(TANDEM_MPI_JOIN_TIMEOUT_MS sets the bound)", missing,
                              (long long)j->opts.join_timeout_ms);
        }
    }
    /* attached everywhere (or failed here): the name has done its work */
    tdm_shm_unlink_named(name);
    tdm_shm_group_free(g);
    if (st == TDM_STATUS_OK)
        TDM_INFO(MPI, "shm segment %s: %d ranks attached, name unlinked", name, ls);
    return st;
}
