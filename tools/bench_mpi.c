/* tools/bench_mpi.c: `tandem bench <collective>` as the ranks of an MPI
 * job: every backend of --backend (shm, mpi, hier) and, with --peer mpi,
 * Open MPI's own blocking collective on the same buffers, size by size in
 * one run, so that their ratio is measured under the same load. Outside
 * an MPI launch it runs itself again under `mpirun -np N`. With --device
 * cuda the NCCL communicator's unique id is broadcast over MPI.
 * Not the measurement itself (tools/bench_coll.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/device.h"
#include "dist/mpi_job.h"
#include "mpi/mpi_weak.h"
#include "tools/bench_coll.h"

/* mpi/ is optional (dist/mpi_job.c checks that it is built first). */

/* Not under a launcher: the same command, under mpirun. */
static tdm_status bench_mpi_relaunch(const bench_cfg *cfg, int argc, char **argv)
{
    char self[4096], np[16];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        fprintf(stderr, "tandem bench: cannot find this program's path (/proc/self/exe) to run "
                        "it under mpirun; run `mpirun -np %d tandem bench ...` yourself\n",
                cfg->nranks);
        return TDM_STATUS_SYSTEM;
    }
    self[n] = '\0';
    snprintf(np, sizeof np, "%d", cfg->nranks);
    int cores = cfg->host_cores;
    const char **av = calloc((size_t)argc + 16, sizeof *av);
    if (!av) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "mpirun's arguments");
    int k = 0;
    av[k++] = "mpirun";
    av[k++] = "-np";
    av[k++] = np;
    /* one rank per core, as the forked benchmark pins them; more ranks
     * than cores: no binding (mpirun would refuse) */
    av[k++] = "--bind-to";
    av[k++] = cfg->bind && cfg->nranks <= cores ? "core" : "none";
    if (cfg->nranks > cores) av[k++] = "--oversubscribe";
    av[k++] = self;
    av[k++] = "bench";
    for (int i = 1; i < argc; i++) av[k++] = argv[i];
    av[k] = NULL;
    /* the ranks' header counts the cores as seen here, before mpirun binds
     * each rank to one */
    char ncores[16];
    snprintf(ncores, sizeof ncores, "%d", cores);
    setenv(TDM_BENCH_CORES_ENV, ncores, 1);
    /* Open MPI refuses to start as root unless told, twice: this is the
     * user's own command, run as they ran it */
    if (geteuid() == 0) {
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        printf("# running as root: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
               "set for mpirun (Open MPI refuses root otherwise)\n");
    }
    printf("# not started by an MPI launcher: running");
    for (int i = 0; i < k; i++) printf(" %s", av[i]);
    printf("\n");
    fflush(stdout);
    execvp("mpirun", (char *const *)av);
    fprintf(stderr, "tandem bench: --backend mpi|hier and --peer mpi run as an MPI job, but "
                    "mpirun could not be started: install Open MPI (`make deps` installs "
                    "openmpi-bin) or run under your MPI launcher\n");
    free(av);
    return TDM_STATUS_SYSTEM;
}

tdm_status tdm_tool_bench_mpi(bench_cfg *cfg, int argc, char **argv)
{
    if (!tdm_dist_mpi_built()) {
        tdm_status st = tdm_dist_mpi_missing(tdm_dist_mpi_launched()
                                                 ? "tandem bench under an MPI launcher"
                                                 : "tandem bench --backend mpi|hier, --peer mpi");
        fprintf(stderr, "tandem bench: %s\n", tdm_error_message());
        return st;
    }
    if (!tdm_dist_mpi_launched()) return bench_mpi_relaunch(cfg, argc, argv);
    tdm_mpi_job *job = NULL;
    tdm_comm *comms[TDM_MPI_BACKEND_COUNT_] = {0};
    bench_target targets[TDM_MPI_BACKEND_COUNT_ + 1];
    int nt = 0;
    if (tdm_mpi_job_init(&job, NULL) != TDM_STATUS_OK) {
        char why[1200];
        snprintf(why, sizeof why, "tandem bench: %s", tdm_error_message());
        tdm_mpi_abort(why);
    }
    const tdm_mpi_topo *t = tdm_mpi_job_topo(job);
    /* usage errors: every rank sees the same, rank 0 says it, all exit 2 */
    const char *usage = NULL;
    char msg[256];
    if (cfg->nranks && cfg->nranks != t->size) {
        snprintf(msg, sizeof msg, "-n %d: the MPI job has %d ranks (omit -n under mpirun)",
                 cfg->nranks, t->size);
        usage = msg;
    }
    int nranks_given = cfg->nranks;
    cfg->nranks = t->size;
    if (!usage && !nranks_given && tdm_tool_bench_check_ranks(cfg, t->rank == 0)) {
        tdm_mpi_job_free(job);
        return TDM_STATUS_USAGE;
    }
    if (cfg->nbackends == 0) cfg->backends[cfg->nbackends++] = TDM_MPI_BACKEND_AUTO;
    for (int i = 0; i < cfg->nbackends; i++)
        if (cfg->backends[i] == TDM_MPI_BACKEND_AUTO) cfg->backends[i] = tdm_mpi_job_auto(job);
    for (int i = 0; i < cfg->nbackends && !usage; i++)
        if (cfg->backends[i] == TDM_MPI_BACKEND_SHM && t->n_machines > 1) {
            snprintf(msg, sizeof msg, "--backend shm: the ranks are on %d %smachines; shared "
                     "memory joins one machine's ranks (use hier or mpi)", t->n_machines,
                     t->pretend ? "pretend " : "");
            usage = msg;
        }
    if (cfg->cuda && (cfg->nbackends > 1 || cfg->peer) && !usage)
        usage = "--device cuda benchmarks NCCL (its unique id broadcast over MPI): no "
                "--backend list or --peer with it";
    if (cfg->cuda && !usage) {
        /* a rank's GPU is its rank on its machine's */
        if (t->rank >= TDM_DEVICE_LIST_MAX) {
            usage = "--device cuda: more ranks than tandem lists devices";
        } else {
            int idx = cfg->dl.index[cfg->dl.count == 1 ? 0 : t->local_rank % cfg->dl.count];
            cfg->dl.index[t->rank] = idx;
        }
    }
    if (usage) {
        if (t->rank == 0) fprintf(stderr, "tandem bench: %s\n", usage);
        tdm_mpi_job_free(job);
        return TDM_STATUS_USAGE;
    }
    tdm_shm_opts so = {.timeout_ms = 120000, .slot_bytes = cfg->slot_bytes,
                       .one_shot_max_bytes = cfg->one_shot_bytes};
    if (cfg->cuda) {
        targets[nt++] = (bench_target){.name = "nccl", .comm = tdm_mpi_job_world(job)};
    } else {
        for (int i = 0; i < cfg->nbackends; i++) {
            if (tdm_mpi_job_comm(job, cfg->backends[i], &so, &comms[i]) != TDM_STATUS_OK) {
                char why[1200];
                snprintf(why, sizeof why, "tandem bench: --backend %s: %s",
                         tdm_dist_backend_name(cfg->backends[i]), tdm_error_message());
                tdm_mpi_abort(why);
            }
            targets[nt++] = (bench_target){.name = tdm_dist_backend_name(cfg->backends[i]),
                                           .comm = comms[i]};
        }
        if (cfg->peer)
            targets[nt++] = (bench_target){.name = "mpi-own", .comm = tdm_mpi_job_world(job),
                                           .peer = 1};
    }
    char desc[200], list[64] = "";
    for (int i = 0; i < cfg->nbackends && !cfg->cuda; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? "," : "",
                 tdm_dist_backend_name(cfg->backends[i]));
    snprintf(desc, sizeof desc, "MPI job on %d %smachine%s%s, backend%s %s", t->n_machines,
             t->pretend ? "pretend " : "", t->n_machines == 1 ? "" : "s",
             t->pretend ? (t->pretend_tcp ? " (MPI over TCP on lo)" : " (MPI over shared memory)")
                        : "",
             cfg->nbackends > 1 ? "s" : "", cfg->cuda ? "nccl" : list);
    cfg->job_desc = desc;
    int rc = tdm_tool_bench_ranks(tdm_mpi_job_world(job), targets, nt, cfg);
    for (int i = 0; i < cfg->nbackends; i++) tdm_comm_free(comms[i]);
    tdm_mpi_job_free(job);
    return rc ? TDM_STATUS_INTERNAL : TDM_STATUS_OK;
}
