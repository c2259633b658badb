/* mpi/split.c: tdm_comm_split's backend half for MPI: MPI_Comm_split on
 * the communicator's own MPI communicator (bounded by a watchdog: MPI
 * cannot bound it itself), wrapped like every MPI communicator, with the
 * parent's deadline and abort check. The hierarchical communicator
 * refuses to split, saying why. Not the communicator itself
 * (mpi/mpi_comm.c, mpi/hier.c). */
#include "mpi/mpi_impl.h"

#include <stdio.h>

tdm_status tdm_mpi_split(void *impl, const tdm_comm_split_info *in, tdm_comm **out)
{
    tdm_mpi_impl *c = impl;
    tdm_mpi_opts o = tdm_mpi_opts_resolve(NULL);
    MPI_Comm nc = MPI_COMM_NULL;
    tdm_mpi_guard g;
    tdm_mpi_guard_begin(&g, o.join_timeout_ms, "MPI_Comm_split #%d of %s (color %d, key %d)",
                        in->seq, c->what, in->color, in->key);
    int rc = MPI_Comm_split(c->comm, in->size > 0 ? in->color : MPI_UNDEFINED, in->key, &nc);
    tdm_mpi_guard_end(&g);
    if (rc != MPI_SUCCESS) {
        char msg[256];
        tdm_mpi_error_string(rc, msg, sizeof msg);
        return tdm_error_set(TDM_STATUS_SYSTEM, "%s: MPI_Comm_split (color %d): %s", c->what,
                             in->color, msg);
    }
    *out = NULL;
    if (nc == MPI_COMM_NULL) return TDM_STATUS_OK;
    int local = 0, cores = 0;
    TDM_CHECK(tdm_mpi_local_size(nc, o.join_timeout_ms, &local, &cores));
    /* the parent's deadline and abort check (the hierarchical
     * communicator's shm abort, when it made the parent) */
    o.timeout_ms = c->wait.timeout_ms;
    o.abort_check = c->wait.abort_check;
    o.abort_ctx = c->wait.abort_ctx;
    char what[48];
    snprintf(what, sizeof what, "mpi (split #%d, color %d)", in->seq, in->color);
    return tdm_mpi_comm_wrap(out, nc, local, cores, &o, what);
}

tdm_status tdm_mpi_hier_split(void *impl, const tdm_comm_split_info *in, tdm_comm **out)
{
    (void)impl;
    (void)in;
    *out = NULL;
    return tdm_error_set(TDM_STATUS_UNSUPPORTED,
                         "comm split: the hierarchical communicator (shm inside each machine, "
                         "MPI between) cannot be split: each group would need its own shm and "
                         "MPI parts; split an mpi communicator instead (--backend mpi)");
}
