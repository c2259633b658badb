/* mpi/job.c: a rank's view of an MPI job (see mpi/job.h): the pretend
 * machines' transport, starting and joining, the map of ranks to
 * machines, and the communicators a tool picks between.
 * Not the communicators themselves: mpi/mpi_comm.c (MPI), mpi/hier.c
 * (shared memory + MPI), mpi/shm_named.c (shared memory by name). */
#include "mpi/job.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "core/flight.h"
#include "core/log.h"
#include "core/timer.h"
#include "mpi/job_impl.h"

static const char *const tdm_mpi_backend_names[TDM_MPI_BACKEND_COUNT_] = {
    [TDM_MPI_BACKEND_AUTO] = "auto", [TDM_MPI_BACKEND_SHM] = "shm",
    [TDM_MPI_BACKEND_MPI] = "mpi", [TDM_MPI_BACKEND_HIER] = "hier",
};

const char *tdm_mpi_backend_name(tdm_mpi_backend b)
{
    return (unsigned)b < TDM_MPI_BACKEND_COUNT_ ? tdm_mpi_backend_names[b] : "?";
}

/* TANDEM_PRETEND_MACHINES: "K" (TCP on lo) or "K:shm". */
static tdm_status tdm_mpi_pretend_parse(int *k, int *tcp)
{
    *k = 0;
    *tcp = 0;
    const char *e = getenv(TDM_MPI_ENV_PRETEND);
    if (!e || !*e) return TDM_STATUS_OK;
    char *end = NULL;
    errno = 0;
    long v = strtol(e, &end, 10);
    int ok = !errno && end != e && v >= 1 && v <= 4096;
    if (ok && !strcmp(end, ":shm")) {
        *k = (int)v;
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(ok && (!*end || !strcmp(end, ":tcp")), TDM_STATUS_INVALID_ARG,
                "%s='%s': expected K (pretend machines, MPI over TCP on lo between them) or "
                "K:shm (MPI keeps shared memory), K in 1..4096", TDM_MPI_ENV_PRETEND, e);
    *k = (int)v;
    *tcp = 1;
    return TDM_STATUS_OK;
}

/* Open MPI reads OMPI_MCA_* when MPI starts: TCP over lo only, as
 * between machines, and nothing else (ob1: the PML that uses the BTLs). */
static tdm_status tdm_mpi_pretend_transport(void)
{
    int inited = 0;
    MPI_Initialized(&inited);
    TDM_REQUIRE(!inited, TDM_STATUS_INVALID_ARG,
                "%s: MPI was started before tandem could choose its transport (TCP on lo); "
                "unset it, or let tandem start MPI", TDM_MPI_ENV_PRETEND);
    static const char *const vars[][2] = {
        {"OMPI_MCA_btl", "tcp,self"},
        {"OMPI_MCA_btl_tcp_if_include", "lo"},
        {"OMPI_MCA_btl_tcp_disable_family", "6"},
        {"OMPI_MCA_pml", "ob1"},
    };
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *was = getenv(vars[i][0]);
        if (was && strcmp(was, vars[i][1]))
            TDM_INFO(MPI, "pretend machines: %s='%s' replaced by '%s'", vars[i][0], was,
                     vars[i][1]);
        if (setenv(vars[i][0], vars[i][1], 1) != 0)
            return tdm_error_set(TDM_STATUS_SYSTEM, "setenv %s: %s", vars[i][0], strerror(errno));
    }
    /* without an explicit include, Open MPI excludes lo: drop an exclude
     * list the launcher may have passed, which would conflict */
    unsetenv("OMPI_MCA_btl_tcp_if_exclude");
    return TDM_STATUS_OK;
}

/* Every rank's (physical node, rank on it), then the pretend split:
 * machine keys (lowest rank of the node, part) numbered in rank order. */
static tdm_status tdm_mpi_job_map(tdm_mpi_job *j)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_mpi_impl *w = tdm_comm_impl(j->world);
    int size = w->size, rank = w->rank;
    int32_t *all = NULL;
    uint64_t *masks = NULL;   /* every rank's affinity, TDM_MPI_MASK_WORDS each */
    MPI_Comm node = MPI_COMM_NULL;
    tdm_mpi_guard g;
    tdm_mpi_guard_begin(&g, j->opts.join_timeout_ms, "MPI_Comm_split_type (grouping the ranks "
                        "by machine)");
    int rc = MPI_Comm_split_type(w->comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    tdm_mpi_guard_end(&g);
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING];
        tdm_mpi_error_string(rc, s, sizeof s);
        return tdm_error_set(TDM_STATUS_SYSTEM, "mpi: MPI_Comm_split_type: %s", s);
    }
    int32_t mine[3] = {rank, 0, 0}; /* lowest rank of my node, my rank on it, node size */
    int nr = 0, ns = 0;
    MPI_Comm_rank(node, &nr);
    MPI_Comm_size(node, &ns);
    mine[1] = nr;
    mine[2] = ns;
    tdm_mpi_waiter wt = {.timeout_ms = j->opts.join_timeout_ms};
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, &mine[0], 1, MPI_INT32_T, MPI_MIN, node, &req);
    tdm_mpi_wait_all(&wt, 1, &req, NULL, "mpi: lowest rank of each machine");
    MPI_Comm_free(&node);
    all = calloc((size_t)size * 3, sizeof *all);
    masks = calloc((size_t)size * TDM_MPI_MASK_WORDS, sizeof *masks);
    j->machine_of = calloc((size_t)size, sizeof *j->machine_of);
    j->local_of = calloc((size_t)size, sizeof *j->local_of);
    if (!all || !masks || !j->machine_of || !j->local_of) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "mpi: job map for %d ranks", size);
        goto fail;
    }
    MPI_Iallgather(mine, 3, MPI_INT32_T, all, 3, MPI_INT32_T, w->comm, &req);
    tdm_mpi_wait_all(&wt, 1, &req, NULL, "mpi: the map of ranks to machines");
    /* Every rank's CPU affinity, here where every rank is known to take
     * part (a later collective would let one missing rank stall the
     * others before the segment's join can name it): the cores a machine's
     * ranks can use together are the union of theirs. */
    uint64_t me[TDM_MPI_MASK_WORDS];
    tdm_mpi_affinity_mask(me);
    MPI_Iallgather(me, TDM_MPI_MASK_WORDS, MPI_UINT64_T, masks, TDM_MPI_MASK_WORDS, MPI_UINT64_T,
                   w->comm, &req);
    tdm_mpi_wait_all(&wt, 1, &req, NULL, "mpi: the ranks' CPU affinity");
    /* part of a node of L ranks: node_rank * K / L (K capped at L), so
     * parts are consecutive node ranks and differ in size by one at most */
    int n_machines = 0;
    for (int r = 0; r < size; r++) j->machine_of[r] = -1;
    for (int r = 0; r < size; r++) {
        if (j->machine_of[r] >= 0) continue;
        int lo = all[3 * r], L = all[3 * r + 2];
        int k = j->topo.pretend > 0 ? (j->topo.pretend < L ? j->topo.pretend : L) : 1;
        int part = (int)((int64_t)all[3 * r + 1] * k / L);
        /* a new machine: every rank of the same node and part */
        int m = n_machines++, local = 0;
        for (int q = r; q < size; q++)
            if (all[3 * q] == lo && (int)((int64_t)all[3 * q + 1] * k / L) == part) {
                j->machine_of[q] = m;
                j->local_of[q] = local++;
            }
    }
    j->topo.n_machines = n_machines;
    j->topo.machine = j->machine_of[rank];
    j->topo.local_rank = j->local_of[rank];
    j->topo.local_size = 0;
    j->topo.uniform = 1;
    int first_size = -1;
    for (int m = 0; m < n_machines; m++) {
        int n = 0;
        for (int r = 0; r < size; r++) n += j->machine_of[r] == m;
        if (m == j->topo.machine) j->topo.local_size = n;
        if (first_size < 0) first_size = n;
        if (n != first_size) j->topo.uniform = 0;
    }
    j->node_size = ns;
    uint64_t node_u[TDM_MPI_MASK_WORDS] = {0}, machine_u[TDM_MPI_MASK_WORDS] = {0};
    for (int q = 0; q < size; q++)
        for (int i = 0; i < TDM_MPI_MASK_WORDS; i++) {
            uint64_t m = masks[(size_t)q * TDM_MPI_MASK_WORDS + i];
            if (all[3 * q] == all[3 * rank]) node_u[i] |= m;
            if (j->machine_of[q] == j->topo.machine) machine_u[i] |= m;
        }
    j->node_cores = tdm_mpi_mask_cores(node_u);
    j->machine_cores = tdm_mpi_mask_cores(machine_u);
fail:
    free(all);
    free(masks);
    return st;
}

static void tdm_mpi_job_agree_id(tdm_mpi_job *j);

tdm_status tdm_mpi_job_init(tdm_mpi_job **out, const tdm_mpi_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "tdm_mpi_job_init: out is NULL");
    *out = NULL;
    int k = 0, tcp = 0;
    TDM_CHECK(tdm_mpi_pretend_parse(&k, &tcp));
    if (k > 0 && tcp) TDM_CHECK(tdm_mpi_pretend_transport());
    tdm_mpi_job *j = calloc(1, sizeof *j);
    TDM_REQUIRE(j, TDM_STATUS_OUT_OF_MEMORY, "mpi: calloc");
    j->opts = tdm_mpi_opts_resolve(opts);
    j->topo.pretend = k;
    j->topo.pretend_tcp = tcp;
    TDM_TRY(tdm_comm_init_mpi(&j->world, &j->opts));
    /* control traffic: the rank's flight record (fr_rank_<R>.json, what
     * tandem doctor reads) is the training communicator's, made next */
    tdm_comm_fr_set_inner(j->world, tdm_comm_rank(j->world));
    /* Control traffic only, often a rank waiting for rank 0's long work
     * (compare runs one device and DP there first): non-blocking calls,
     * whose waits sleep, rather than MPI's blocking ones, which spin. */
    ((tdm_mpi_impl *)tdm_comm_impl(j->world))->nb = TDM_MPI_NB_ALL;
    j->topo.rank = tdm_comm_rank(j->world);
    j->topo.size = tdm_comm_size(j->world);
    TDM_TRY(tdm_mpi_job_map(j));
    tdm_mpi_job_agree_id(j);
    /* every rank's heartbeats: a stopped or dead rank is named in
     * seconds, not found by the collective timeout */
    TDM_TRY(tdm_mpi_live_start(&j->live, j->opts.join_timeout_ms));
    TDM_INFO(MPI, "job: rank %d of %d, machine %d of %d%s (rank %d of %d there)",
             j->topo.rank, j->topo.size, j->topo.machine, j->topo.n_machines,
             k ? (tcp ? " (pretend, MPI over TCP on lo)" : " (pretend, MPI over shared memory)")
               : "", j->topo.local_rank, j->topo.local_size);
    *out = j;
    return TDM_STATUS_OK;
fail:
    tdm_mpi_job_free(j);
    return st;
}

void tdm_mpi_job_free(tdm_mpi_job *j)
{
    if (!j) return;
    tdm_mpi_live_stop(j->live);
    tdm_comm_free(j->world);
    free(j->machine_of);
    free(j->local_of);
    free(j);
    tdm_mpi_finalize();
}

/* Rank 0 draws the id (or takes TANDEM_JOB_ID's) and every rank learns
 * it: the job's segments are named by it, and every communicator's
 * flight-recorder dumps carry it (TANDEM_JOB_ID, exported here before
 * the job's other communicators are made), so that `tandem doctor` reads
 * this job's dumps only in a directory that others wrote to too. */
static void tdm_mpi_job_agree_id(tdm_mpi_job *j)
{
    uint64_t id = 0;
    tdm_mpi_impl *w = tdm_comm_impl(j->world);
    if (w->rank == 0) {
        id = tdm_fr_job_parse(getenv(TDM_FR_ENV_JOB));
        if (!id && getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
            id = ((uint64_t)getpid() << 32) ^ tdm_time_ns();
    }
    MPI_Request req;
    MPI_Ibcast(&id, 1, MPI_UINT64_T, 0, w->comm, &req);
    tdm_mpi_waiter wt = {.timeout_ms = j->opts.join_timeout_ms};
    tdm_mpi_wait_all(&wt, 1, &req, NULL, "mpi: agreeing on the job id");
    j->job_id = id ? id : 1;
    char hex[24];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)j->job_id);
    setenv(TDM_FR_ENV_JOB, hex, 1);
    tdm_comm_fr_set_job(j->world, j->job_id);
}

uint64_t tdm_mpi_job_id(tdm_mpi_job *j) { return j->job_id; }

const tdm_mpi_topo *tdm_mpi_job_topo(const tdm_mpi_job *j) { return &j->topo; }
tdm_comm *tdm_mpi_job_world(tdm_mpi_job *j) { return j->world; }
uint64_t tdm_mpi_job_segment_id(const tdm_mpi_job *j) { return j->job_id; }

tdm_mpi_backend tdm_mpi_job_auto(const tdm_mpi_job *j)
{
    return j->topo.n_machines == 1 ? TDM_MPI_BACKEND_SHM : TDM_MPI_BACKEND_HIER;
}

/* A new MPI communicator over the ranks with the same color, ordered by
 * key (MPI_Comm_split, bounded by the watchdog). */
tdm_status tdm_mpi_job_split(tdm_mpi_job *j, int color, int key, MPI_Comm *out)
{
    tdm_mpi_impl *w = tdm_comm_impl(j->world);
    tdm_mpi_guard g;
    tdm_mpi_guard_begin(&g, j->opts.join_timeout_ms, "MPI_Comm_split");
    int rc = MPI_Comm_split(w->comm, color, key, out);
    tdm_mpi_guard_end(&g);
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING];
        tdm_mpi_error_string(rc, s, sizeof s);
        return tdm_error_set(TDM_STATUS_SYSTEM, "mpi: MPI_Comm_split: %s", s);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_mpi_job_comm(tdm_mpi_job *j, tdm_mpi_backend b,
                            const struct tdm_shm_opts *shm_opts, tdm_comm **out)
{
    TDM_REQUIRE(j && out, TDM_STATUS_INVALID_ARG, "tdm_mpi_job_comm: NULL argument");
    *out = NULL;
    if (b == TDM_MPI_BACKEND_AUTO) b = tdm_mpi_job_auto(j);
    switch (b) {
    case TDM_MPI_BACKEND_MPI: {
        /* a duplicate of the job's: its own traffic, its own progress */
        tdm_mpi_impl *w = tdm_comm_impl(j->world);
        MPI_Comm dup = MPI_COMM_NULL;
        MPI_Request req;
        MPI_Comm_idup(w->comm, &dup, &req);
        tdm_mpi_waiter wt = {.timeout_ms = j->opts.join_timeout_ms};
        tdm_mpi_wait_all(&wt, 1, &req, NULL, "mpi: MPI_Comm_idup");
        return tdm_mpi_comm_wrap(out, dup, j->node_size, j->node_cores, &j->opts, "mpi");
    }
    case TDM_MPI_BACKEND_SHM: {
        TDM_REQUIRE(j->topo.n_machines == 1, TDM_STATUS_INVALID_ARG,
                    "--backend shm: the job's %d ranks are on %d %smachines, and shared memory "
                    "joins the ranks of one machine only; use --backend hier (shared memory "
                    "inside each machine, MPI between them) or mpi", j->topo.size,
                    j->topo.n_machines, j->topo.pretend ? "pretend " : "");
        tdm_mpi_impl *w = tdm_comm_impl(j->world);
        return tdm_mpi_shm_named_comm(j, w->comm, shm_opts, out);
    }
    case TDM_MPI_BACKEND_HIER:
        return tdm_mpi_hier_comm(j, shm_opts, out);
    default:
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "tdm_mpi_job_comm: backend %d", (int)b);
    }
}
