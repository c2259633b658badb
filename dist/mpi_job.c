/* dist/mpi_job.c: a rank of an MPI launcher's job (see dist/mpi_job.h). */
#include "dist/mpi_job.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "mpi/mpi_weak.h"

/* mpi/ is optional: NULL where it is not built. */

static const char *const tdm_dist_mpi_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"};

int tdm_dist_mpi_launched(void) { return tdm_dist_mpi_launch_hint() != NULL; }

const char *tdm_dist_mpi_launch_hint(void)
{
    static char hint[96];
    for (size_t i = 0; i < sizeof tdm_dist_mpi_vars / sizeof tdm_dist_mpi_vars[0]; i++) {
        const char *v = getenv(tdm_dist_mpi_vars[i]);
        /* PMI-1/2 launchers set PMI_RANK and PMI_SIZE together */
        if (v && *v && (i != 2 || getenv("PMI_RANK"))) {
            snprintf(hint, sizeof hint, "%s=%s", tdm_dist_mpi_vars[i], v);
            return hint;
        }
    }
    return NULL;
}

int tdm_dist_mpi_built(void) { return tdm_mpi_job_init != NULL; }

tdm_status tdm_dist_mpi_missing(const char *what)
{
    return tdm_error_set(TDM_STATUS_UNSUPPORTED,
                         "%s: this tandem was built without MPI (Open MPI's development files "
                         "were not found): run `make deps` (it installs libopenmpi-dev and "
                         "openmpi-bin) and rebuild with `make`", what);
}

/* mpi/job.c has the same table, but builds without mpi/ parse too. */
const char *tdm_dist_backend_name(tdm_mpi_backend b)
{
    static const char *const names[TDM_MPI_BACKEND_COUNT_] = {
        [TDM_MPI_BACKEND_AUTO] = "auto", [TDM_MPI_BACKEND_SHM] = "shm",
        [TDM_MPI_BACKEND_MPI] = "mpi", [TDM_MPI_BACKEND_HIER] = "hier",
    };
    return (unsigned)b < TDM_MPI_BACKEND_COUNT_ ? names[b] : "?";
}

tdm_status tdm_dist_backend_parse(const char *s, tdm_mpi_backend *out)
{
    for (int b = 0; b < TDM_MPI_BACKEND_COUNT_; b++)
        if (!strcmp(s, tdm_dist_backend_name((tdm_mpi_backend)b))) {
            *out = (tdm_mpi_backend)b;
            return TDM_STATUS_OK;
        }
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "--backend '%s': expected auto, shm, mpi or hier",
                         s);
}

tdm_status tdm_dist_backend_choose(const char *text, int in_job, const char *cmd,
                                   tdm_mpi_backend *out)
{
    *out = TDM_MPI_BACKEND_AUTO;
    if (text) TDM_CHECK(tdm_dist_backend_parse(text, out));
    if (in_job || *out == TDM_MPI_BACKEND_AUTO || *out == TDM_MPI_BACKEND_SHM)
        return TDM_STATUS_OK;
    if (!tdm_dist_mpi_built()) return tdm_dist_mpi_missing("--backend mpi|hier");
    return tdm_error_set(TDM_STATUS_USAGE, "--backend %s runs between the ranks of an MPI job: "
                         "start them with `mpirun -np N tandem %s --backend %s ...` (or srun)",
                         text, cmd, text);
}

tdm_status tdm_dist_mpi_rank_init(tdm_dist_mpi_rank *r, tdm_mpi_backend b, tdm_dist_mpi_use use,
                                  int64_t timeout_ms, const tdm_shm_opts *shm)
{
    tdm_status st = TDM_STATUS_OK;
    memset(r, 0, sizeof *r);
    if (!tdm_dist_mpi_built()) {
        char what[128];
        snprintf(what, sizeof what, "started by an MPI launcher (%s)",
                 tdm_dist_mpi_launch_hint() ? tdm_dist_mpi_launch_hint() : "--backend mpi");
        return tdm_dist_mpi_missing(what);
    }
    tdm_mpi_opts mo = {.timeout_ms = timeout_ms};
    tdm_shm_opts so = shm ? *shm : (tdm_shm_opts){0};
    if (timeout_ms > 0 && !so.timeout_ms) so.timeout_ms = timeout_ms;
    TDM_TRY(tdm_mpi_job_init(&r->job, &mo));
    const tdm_mpi_topo *t = tdm_mpi_job_topo(r->job);
    tdm_log_set_rank(t->rank);
    r->backend = b == TDM_MPI_BACKEND_AUTO ? tdm_mpi_job_auto(r->job) : b;
    /* a mesh splits the communicator: hier's shm and MPI parts cannot be */
    if (b == TDM_MPI_BACKEND_AUTO && use == TDM_DIST_MPI_SPLIT &&
        r->backend == TDM_MPI_BACKEND_HIER)
        r->backend = TDM_MPI_BACKEND_MPI;
    TDM_TRY(tdm_mpi_job_comm(r->job, r->backend, &so, &r->comm));
    r->world = tdm_mpi_job_world(r->job);
    r->env = (tdm_dist_env){.rank = t->rank, .world_size = t->size, .local_rank = t->local_rank,
                           .local_world_size = t->local_size};
    snprintf(r->desc, sizeof r->desc, "%s, %d rank%s on %d %smachine%s%s",
             tdm_dist_backend_name(r->backend), t->size, t->size == 1 ? "" : "s", t->n_machines,
             t->pretend ? "pretend " : "", t->n_machines == 1 ? "" : "s",
             t->pretend ? (t->pretend_tcp ? " (MPI over TCP on lo)" : " (MPI over shared memory)")
                        : "");
    return TDM_STATUS_OK;
fail:
    tdm_dist_mpi_rank_free(r);
    /* a job that never formed (the thread level, say): MPI ends cleanly */
    if (tdm_mpi_finalize) tdm_mpi_finalize();
    return st;
}

/* The first of vars set and not empty, as an int; 0 when none is. */
static int tdm_dist_mpi_env_int(const char *const vars[3])
{
    for (size_t i = 0; i < 3; i++) {
        const char *v = vars[i] ? getenv(vars[i]) : NULL;
        if (v && *v) return atoi(v);
    }
    return 0;
}

int tdm_dist_mpi_env_rank(void)
{
    static const char *const vars[3] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"};
    return tdm_dist_mpi_env_int(vars);
}

int tdm_dist_mpi_env_world(void)
{
    static const char *const vars[3] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", NULL};
    return tdm_dist_mpi_env_int(vars);
}

void tdm_dist_mpi_rank_free(tdm_dist_mpi_rank *r)
{
    tdm_comm_free(r->comm);
    r->comm = NULL;
    if (r->job) tdm_mpi_job_free(r->job);
    r->job = NULL;
}

void tdm_dist_mpi_rank_end(tdm_dist_mpi_rank *r, tdm_status st)
{
    if (st && st != TDM_STATUS_USAGE && r->job && tdm_mpi_abort) {
        char why[96];
        snprintf(why, sizeof why, "rank %d failed (see its error above)", r->env.rank);
        tdm_mpi_abort(why);
    }
    tdm_dist_mpi_rank_free(r);
}
