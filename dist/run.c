/* dist/run.c: running the ranks of a design (see dist/run.h): how they
 * start (forked, launched, an MPI job's, or over a given communicator),
 * each rank's device and communicators, its life through the design's
 * callbacks, the abort of the group on failure, and the restarts of
 * forked ranks. cuda/ and mpi/ are reached through weak symbols: a build
 * without them links and refuses GPUs and MPI jobs with a message. */
#include "dist/run.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "cuda/cuda_weak.h"
#include "dist/spawn.h"
#include "models/checkpoint.h"
#include "shm/shm_comm.h"

/* ---- a rank's output ---- */

void tdm_dist_silence(int rank, int *err_fd)
{
    if (err_fd) *err_fd = -1;
    if (rank == 0) return;
    int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (err_fd) {
        *err_fd = dup(STDERR_FILENO);
        dup2(fd, STDERR_FILENO);
    }
    dup2(fd, STDOUT_FILENO);
    close(fd);
}

void tdm_dist_unsilence(int *err_fd)
{
    if (*err_fd < 0) return;
    dup2(*err_fd, STDERR_FILENO);
    close(*err_fd);
    *err_fd = -1;
}

/* ---- restarts ---- */

int tdm_dist_restart_count(void)
{
    const char *s = getenv(TDM_DIST_ENV_RESTARTS);
    int v = s ? atoi(s) : 0;
    return v > 0 ? v : 0;
}

void tdm_dist_restart_count_set(int attempt)
{
    char buf[16];
    snprintf(buf, sizeof buf, "%d", attempt);
    setenv(TDM_DIST_ENV_RESTARTS, buf, 1);
}

const char *tdm_dist_run_id_begin(int restarts)
{
    const char *run = getenv(TDM_DIST_ENV_RUN);
    if ((!run || !*run) && !restarts) return NULL;
    if (!run || !*run) {
        uint64_t id = 0;
        if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            id = ((uint64_t)getpid() << 40) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 16);
        }
        char buf[24];
        snprintf(buf, sizeof buf, "%016llx", (unsigned long long)id);
        setenv(TDM_DIST_ENV_RUN, buf, 1);
        run = getenv(TDM_DIST_ENV_RUN);
    }
    tdm_checkpoint_set_run(run);
    return run;
}

tdm_status tdm_dist_restart_ours(const char *path, int *ours, char *why, size_t n)
{
    const char *run = getenv(TDM_DIST_ENV_RUN);
    tdm_st_file *f = NULL;
    *ours = 0;
    if (why && n) why[0] = 0;
    if (!path || access(path, F_OK) != 0) {
        if (why && path) snprintf(why, n, "%s does not exist yet", path);
        return TDM_STATUS_OK;
    }
    /* the header only: a checkpoint larger than memory is still ours */
    tdm_status st = tdm_st_load_header(&f, path);
    if (st == TDM_STATUS_FORMAT) {
        if (why) snprintf(why, n, "%s is not a checkpoint: %s", path, tdm_error_message());
        return TDM_STATUS_OK;
    }
    if (st) {
        /* a file that cannot be read is not proof that it is not ours */
        tdm_error_prefix(st, "cannot tell whether %s is this run's checkpoint", path);
        if (why) snprintf(why, n, "%s", tdm_error_message());
        return st;
    }
    const char *theirs = tdm_st_meta_get(f, "run");
    *ours = run && *run && theirs && !strcmp(theirs, run);
    if (!*ours && why)
        snprintf(why, n, "%s holds another run's checkpoint (%s%.24s), not one this job wrote",
                 path, theirs ? "run " : "no run id", theirs ? theirs : "");
    tdm_st_free(f);
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_restart_resume(const char *save, const char **resume)
{
    int ours = 0;
    *resume = NULL;
    if (tdm_dist_restart_count() == 0) return TDM_STATUS_OK;
    const char *ck = getenv(TDM_DIST_ENV_RESUME);
    if (!ck || !*ck) ck = save;
    if (!ck) return TDM_STATUS_OK;
    TDM_CHECK(tdm_dist_restart_ours(ck, &ours, NULL, 0));
    if (ours) *resume = ck;
    return TDM_STATUS_OK;
}

int tdm_dist_backoff(int attempt)
{
    int ms = 200;
    for (int i = 1; i < attempt && ms < 5000; i++) ms *= 2;
    if (ms > 5000) ms = 5000;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
    return ms;
}

/* ---- a rank's device and communicators ---- */

tdm_status tdm_dist_rank_device(const tdm_device_list *devices, int rank, tdm_device **dev)
{
    return tdm_device_open(dev, devices->kind == TDM_DEVICE_CUDA ? "cuda" : "cpu",
                           devices->index[devices->count == 1 ? 0 : rank], 1);
}

int tdm_dist_device_is_gpu(const tdm_device *dev)
{
    return dev && tdm_dev_kind(dev) == TDM_DEVICE_CUDA &&
           !(tdm_cuda_device_is_emulator && tdm_cuda_device_is_emulator(dev));
}

tdm_status tdm_dist_parse_devices(tdm_device_list *dl, const char *spec, int forks)
{
    if (!forks || strncmp(spec, "cuda", 4) != 0 ||
        (tdm_cuda_emulator_env && tdm_device_cuda_linked() && tdm_cuda_emulator_env()))
        return tdm_device_list_parse(dl, spec);
    struct {
        tdm_status st;
        tdm_device_list dl;
        char msg[TDM_ERROR_MSG_MAX];
    } res;
    int fds[2];
    if (pipe(fds) != 0) return tdm_device_list_parse(dl, spec);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return tdm_device_list_parse(dl, spec);
    }
    if (pid == 0) {
        close(fds[0]);
        memset(&res, 0, sizeof res);
        res.st = tdm_device_list_parse(&res.dl, spec);
        snprintf(res.msg, sizeof res.msg, "%s", res.st ? tdm_error_message() : "");
        ssize_t w = write(fds[1], &res, sizeof res);
        _exit(w == (ssize_t)sizeof res ? 0 : 1);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t k;
    while (got < sizeof res && (k = read(fds[0], (char *)&res + got, sizeof res - got)) != 0) {
        if (k < 0) {
            if (errno == EINTR) continue;
            break;
        }
        got += (size_t)k;
    }
    close(fds[0]);
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {}
    if (got != sizeof res)
        return tdm_error_set(TDM_STATUS_SYSTEM, "checking --device '%s' in a child process "
                             "failed (wait status 0x%x)", spec, ws);
    *dl = res.dl;
    if (res.st) return tdm_error_set(res.st, "%s", res.msg);
    return TDM_STATUS_OK;
}

/* NCCL's watchdog polls this: the shm group's abort (a rank that failed
 * or died, or the parent stopping the job) stops a rank blocked in NCCL
 * at once instead of at the deadline. */
static const char *tdm_dist_group_aborted(void *ctx) { return tdm_shm_comm_abort_reason(ctx); }

tdm_status tdm_dist_gpu_comm(tdm_comm *group, tdm_device *dev, tdm_comm **nccl)
{
    *nccl = NULL;
    if (!tdm_dist_device_is_gpu(dev)) return TDM_STATUS_OK;
    if (!tdm_comm_init_nccl_opts)
        return tdm_error_set(TDM_STATUS_NO_DEVICE, "no CUDA device: this build of tandem has "
                             "no CUDA backend; use --device cpu:N");
    /* Collective over the group; a rank that failed before it aborts the
     * group, so the others' bootstrap fails at once. */
    tdm_nccl_opts no = {.abort_check = tdm_dist_group_aborted, .abort_ctx = group};
    /* the process group's timeout (TANDEM_TIMEOUT, which tandem launch and
     * train --timeout set) bounds NCCL's waits too, unless the NCCL-only
     * TANDEM_NCCL_TIMEOUT_MS says otherwise */
    if (!getenv("TANDEM_NCCL_TIMEOUT_MS")) TDM_CHECK(tdm_dist_timeout_from_env(&no.timeout_ms));
    return tdm_comm_init_nccl_opts(nccl, group, tdm_dev_index(dev), &no);
}

/* ---- the start and the timeout ---- */

tdm_dist_start tdm_dist_job_start(const tdm_dist_design *d, const tdm_dist_run_opts *o)
{
    if (o->comm) return TDM_DIST_START_GIVEN;
    if (tdm_dist_launched()) return TDM_DIST_START_LAUNCHED;
    if (d->caps & TDM_DIST_MPI && tdm_dist_mpi_launched()) return TDM_DIST_START_MPI;
    return TDM_DIST_START_FORKED;
}

tdm_status tdm_dist_job_timeout(const tdm_dist_run_opts *o, tdm_dist_start start,
                                int64_t *timeout_ms)
{
    *timeout_ms = o->timeout_ms;
    if (*timeout_ms <= 0) TDM_CHECK(tdm_dist_timeout_from_env(timeout_ms));
    if (*timeout_ms <= 0)
        *timeout_ms = start == TDM_DIST_START_FORKED ? TDM_DIST_FORKED_TIMEOUT_MS
                                                     : TDM_DIST_TIMEOUT_DEFAULT_MS;
    return TDM_STATUS_OK;
}

/* ---- one rank ---- */

typedef struct tdm_dist_job {
    const tdm_dist_design *d;
    void *ctx;
    const tdm_dist_run_opts *o;
    tdm_dist_start start;
    int64_t timeout_ms;
} tdm_dist_job;

/* The design's layout: the mesh shape, this rank's role (rank -1: the
 * job's check before any rank starts). No layout: all along dp. */
static tdm_status tdm_dist_layout(const tdm_dist_job *j, int world, int rank,
                                  tdm_mesh_shape *shape, int *role)
{
    *shape = (tdm_mesh_shape){.size = {world, 1, 1}};
    *role = 0;
    if (!j->d->layout) return TDM_STATUS_OK;
    TDM_CHECK(j->d->layout(j->ctx, world, rank, shape, role));
    char s[64];
    tdm_mesh_shape_str(shape, s, sizeof s);
    TDM_REQUIRE(tdm_mesh_shape_ranks(shape) == world, TDM_STATUS_INVALID_ARG,
                "%s: its layout %s holds %d ranks, but the job has %d", j->d->name, s,
                tdm_mesh_shape_ranks(shape), world);
    return TDM_STATUS_OK;
}

/* The place of r in the design's layout, and with a layout the mesh's
 * sub-communicators over r->comm (collective). */
static tdm_status tdm_dist_rank_place(const tdm_dist_job *j, tdm_dist_rank *r)
{
    TDM_CHECK(tdm_dist_layout(j, r->env.world_size, r->env.rank, &r->shape, &r->role));
    tdm_mesh_coords_of(&r->shape, r->env.rank, r->coord);
    return j->d->layout ? tdm_mesh_init(&r->mesh, r->comm, &r->shape) : TDM_STATUS_OK;
}

/* The device of a rank: its own of the job's list (forked, given), or
 * its machine's by local rank (launched, an MPI job's), the list checked
 * against the ranks first (USAGE when it fits neither). */
static tdm_status tdm_dist_rank_open(const tdm_dist_job *j, tdm_dist_rank *r)
{
    const tdm_device_list *dl = j->o->devices;
    if (j->start == TDM_DIST_START_FORKED || j->start == TDM_DIST_START_GIVEN)
        return tdm_dist_rank_device(dl, r->env.rank, &r->dev);
    int mpi = j->start == TDM_DIST_START_MPI;
    /* devices are per machine: one for all, or one per rank on it */
    int per_machine = mpi ? r->env.local_world_size : r->env.world_size;
    if (dl->count != 1 && dl->count != per_machine && dl->count != r->env.world_size)
        return tdm_error_set(TDM_STATUS_USAGE, "rank %d: --device '%s' names %d devices but the "
                             "job has %d ranks%s", r->env.rank, j->o->spec ? j->o->spec : "?",
                             dl->count, per_machine, mpi ? " on this machine" : "");
    tdm_device_list mine = *dl;
    mine.index[0] = dl->count == 1 ? r->env.local_rank : dl->index[r->env.local_rank % dl->count];
    mine.count = 1;
    return tdm_dist_rank_device(&mine, 0, &r->dev);
}

/* A rank over comm: its device and NCCL communicator, then the design's
 * setup, run and free; on failure the group is aborted with the message. */
static tdm_status tdm_dist_rank_main(const tdm_dist_job *j, tdm_comm *comm,
                                     const tdm_dist_env *env, const char *job_desc)
{
    const tdm_dist_design *d = j->d;
    tdm_dist_rank r = {.start = j->start, .env = *env, .comm = comm, .dev_comm = comm,
                       .timeout_ms = j->timeout_ms, .job_desc = job_desc};
    tdm_comm *nccl = NULL;
    void *self = NULL;
    int set_up = 0;
    tdm_status st = tdm_dist_rank_open(j, &r);
    if (st && st != TDM_STATUS_USAGE) tdm_error_prefix(st, "rank %d: opening device", env->rank);
    if (st == TDM_STATUS_OK) st = tdm_dist_rank_place(j, &r);
    if (st == TDM_STATUS_OK && d->caps & TDM_DIST_NCCL) {
        st = tdm_dist_gpu_comm(comm, r.dev, &nccl);
        if (st) tdm_error_prefix(st, "rank %d: NCCL set-up", env->rank);
        if (nccl) r.dev_comm = nccl;
    }
    if (st == TDM_STATUS_OK) {
        set_up = 1;
        st = d->setup(j->ctx, &r, &self);
    }
    if (st == TDM_STATUS_OK) st = d->run(j->ctx, &r, self);
    if (st) {
        /* The group learns why in this rank's words (a callback's own
         * abort, if any, was first); a parent's failure summary quotes
         * them. */
        char why[400];
        snprintf(why, sizeof why, "%s", tdm_error_message()[0] ? tdm_error_message()
                                                               : "rank failed");
        (void)tdm_comm_abort(comm, why);
        tdm_error_set(st, "%s", why);
    }
    fflush(stdout);
    if (set_up && d->free) d->free(j->ctx, self);
    tdm_mesh_free(r.mesh);
    tdm_comm_free(nccl);   /* before comm, which bootstrapped it */
    tdm_device_free(r.dev);
    return st;
}

/* ---- the starts ---- */

/* A rank of a `tandem launch` job: joins its group. */
static tdm_status tdm_dist_run_launched(const tdm_dist_job *j)
{
    tdm_comm *comm = NULL;
    tdm_dist_env env;
    tdm_dist_pg_opts po = {.timeout_ms = j->timeout_ms};
    tdm_status st = tdm_dist_pg_init(&comm, &env, &po);
    if (st) return tdm_error_prefix(st, "joining the launched job");
    st = tdm_dist_rank_main(j, comm, &env, NULL);
    tdm_comm_free(comm);
    return st;
}

/* A rank of an MPI launcher's job: joins it, over the backend's
 * communicator; a runtime failure ends the whole job (MPI_Abort). */
static tdm_status tdm_dist_run_mpi(const tdm_dist_job *j)
{
    tdm_dist_mpi_rank mr = {0};
    tdm_shm_opts so = {.arena_bytes = j->o->arena_bytes};
    tdm_status st = tdm_dist_mpi_rank_init(&mr, j->o->backend,
                                           j->d->layout ? TDM_DIST_MPI_SPLIT : TDM_DIST_MPI_WHOLE,
                                           j->timeout_ms, &so);
    if (st) return tdm_error_prefix(st, "joining the MPI job");
    st = tdm_dist_rank_main(j, mr.comm, &mr.env, mr.desc);
    char msg[TDM_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", st ? tdm_error_message() : "");
    tdm_dist_mpi_rank_end(&mr, st);
    if (st) tdm_error_set(st, "%s", msg);
    return st;
}

/* A forked rank's exit code: 0, 2 for a usage error, else 1 (as the
 * CLI's); the parent names the root cause from it. */
static int tdm_dist_forked_rank(tdm_comm *comm, void *arg)
{
    const tdm_dist_job *j = arg;
    tdm_dist_env env = {.rank = tdm_comm_rank(comm), .world_size = tdm_comm_size(comm),
                        .local_rank = tdm_comm_rank(comm),
                        .local_world_size = tdm_comm_size(comm)};
    tdm_status st = tdm_dist_rank_main(j, comm, &env, NULL);
    return st == TDM_STATUS_OK ? 0 : st == TDM_STATUS_USAGE ? 2 : 1;
}

/* The rank an attempt lost: the lowest one that ended by a signal of its
 * own (its SIGKILL, a crash), never one the teardown's SIGTERM or
 * SIGKILL ended (a healthy survivor too slow to stop); -1 when none. */
static int tdm_dist_culprit(const tdm_shm_spawn_result *res, int world)
{
    for (int r = 0; r < world; r++)
        if (res->pid[r] > 0 && WIFSIGNALED(res->wstatus[r]) && !res->induced[r]) return r;
    return -1;
}

/* The most ranks, at most left, that divide divides (a power of two). */
static int tdm_dist_fit_world(int left, int divides)
{
    int to = 1;
    while (to * 2 <= left && divides % (to * 2) == 0) to *= 2;
    return to;
}

/* world forked ranks, attempt after attempt while a rank's failure may
 * be restarted (on fewer ranks, with opts.min_world). */
static tdm_status tdm_dist_run_forked(const tdm_dist_job *j0, int world)
{
    const tdm_dist_run_opts *o = j0->o;
    const tdm_dist_watch *w = o->watch;
    tdm_device_list dl = *o->devices;   /* a resize leaves the failed rank's device out */
    tdm_dist_run_opts oo = *o;
    oo.devices = &dl;
    tdm_dist_job jj = *j0;
    jj.o = &oo;
    const tdm_dist_job *j = &jj;
    tdm_mesh_shape shape;
    int role, last_culprit = -1;
    TDM_CHECK(tdm_dist_layout(j, world, -1, &shape, &role));
    tdm_dist_run_id_begin(o->max_restarts > 0);
    for (int attempt = 0;; attempt++) {
        tdm_dist_restart_count_set(attempt);
        if (w && w->begin) TDM_CHECK(w->begin(w->ctx, attempt));
        tdm_dist_spawn_opts so = {
            .timeout_ms = o->run_timeout_ms > 0 ? o->run_timeout_ms : TDM_DIST_RUN_UNBOUNDED_MS,
            .comm_timeout_ms = j->timeout_ms, .arena_bytes = o->arena_bytes,
            .on_settled = w ? w->settled : NULL, .settled_ctx = w ? w->ctx : NULL,
            .outlive_failures = o->outlive_failures};
        tdm_shm_spawn_result res;
        memset(&res, 0, sizeof res);   /* a spawn that failed early fills nothing */
        fflush(stdout);
        tdm_status st = tdm_dist_spawn(world, tdm_dist_forked_rank, (void *)j, &so, &res);
        char why[TDM_ERROR_MSG_MAX];
        snprintf(why, sizeof why, "%s", st ? tdm_error_message() : "");
        /* the same rank lost twice in a row: resize, or stop */
        int culprit = st == TDM_STATUS_PEER_FAILED ? tdm_dist_culprit(&res, world) : -1;
        int resize = o->min_world > 0 && culprit >= 0 && culprit == last_culprit;
        int left = world - 1, to = resize ? tdm_dist_fit_world(left, o->world_divides) : world;
        int too_few = resize && to < o->min_world;
        /* a rank's failure is restarted, not a signal to this process
         * (Ctrl-C reaches the ranks too: they die of it, and so do we) */
        int last = st != TDM_STATUS_PEER_FAILED || attempt >= o->max_restarts || too_few;
        if (too_few && !(attempt >= o->max_restarts) && w && w->resize)
            w->resize(w->ctx, culprit, world, 0, left);   /* said at the end */
        if (w && w->end) w->end(w->ctx, st, world, &res, last);
        if (st == TDM_STATUS_OK) return st;
        tdm_error_set(st, "%s", why);   /* the watch's reads may have replaced it */
        if (last) return st;
        last_culprit = culprit;
        if (resize) {
            if (w && w->resize) w->resize(w->ctx, culprit, world, to, left);
            if (dl.count > 1) {
                for (int r = culprit; r + 1 < dl.count; r++) dl.index[r] = dl.index[r + 1];
                dl.count--;
            }
            world = to;
            last_culprit = -1;
            TDM_CHECK(tdm_dist_layout(j, world, -1, &shape, &role));
        }
        /* from save once this run wrote it, never from another run's file
         * at the same path; else from where the caller's ranks began */
        if (o->save && o->resume) {
            int ours = 0;
            TDM_CHECK(tdm_dist_restart_ours(o->save, &ours, NULL, 0));
            if (ours) *o->resume = o->save;
        }
        int ms = tdm_dist_backoff(attempt + 1);
        if (w && w->restart)
            w->restart(w->ctx, attempt + 1, o->max_restarts, ms, o->resume ? *o->resume : NULL);
        tdm_error_set(st, "%s", why);
    }
}

tdm_status tdm_dist_run(const tdm_dist_design *d, void *ctx, const tdm_dist_run_opts *o)
{
    TDM_REQUIRE(d && d->setup && d->run && o && o->devices, TDM_STATUS_INVALID_ARG,
                "tdm_dist_run: a design with setup and run, and devices, are required");
    tdm_dist_job j = {.d = d, .ctx = ctx, .o = o, .start = tdm_dist_job_start(d, o)};
    TDM_CHECK(tdm_dist_job_timeout(o, j.start, &j.timeout_ms));
    switch (j.start) {
    case TDM_DIST_START_GIVEN: return tdm_dist_rank_main(&j, o->comm, &o->env, o->job_desc);
    case TDM_DIST_START_LAUNCHED: return tdm_dist_run_launched(&j);
    case TDM_DIST_START_MPI: return tdm_dist_run_mpi(&j);
    default: return tdm_dist_run_forked(&j, o->world > 0 ? o->world : o->devices->count);
    }
}
