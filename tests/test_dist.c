/* tests/test_dist.c: the floor every multi-process design shares (dist/):
 * the batch split and its staging, the cross-rank model and step checks,
 * and tdm_dist_run - forked ranks through a design's table (setup, run,
 * free in every rank, each with its device, its place in the design's
 * mesh, its role and the mesh's sub-communicators; the mesh itself is
 * tests/test_mesh.c's), a
 * layout that refuses the world, a failing rank that stops the group
 * naming itself, and restarts after a rank's failure. Forked ranks bound
 * their run time and leave nothing behind. */
#include <criterion/criterion.h>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dist/batch.h"
#include "dist/check.h"
#include "dist/mesh.h"
#include "dist/run.h"
#include "dist/spawn.h"
#include "tests/test_util.h"

/* ---- the batch ---- */

Test(dist, share_rows_cover_the_batch_in_rank_order)
{
    float x[13 * 3];
    int32_t y[13 * 2];
    for (int world = 1; world <= 16; world++) {
        int next = 0;
        for (int r = 0; r < world; r++) {
            const void *xs;
            const int32_t *ys;
            int n;
            tdm_dist_share_rows(x, y, 13, r, world, 3, 2, &xs, &ys, &n);
            cr_assert_eq((const float *)xs, x + next * 3, "world %d rank %d", world, r);
            cr_assert_eq(ys, y + next * 2);
            cr_assert(n == 13 / world || n == 13 / world + 1, "world %d rank %d: %d", world, r, n);
            next += n;
        }
        cr_assert_eq(next, 13);
    }
}

Test(dist, stage_on_a_host_device_and_the_zero_sample)
{
    tdm_device *dev = tu_host();
    tdm_model_spec spec;
    tdm_model *m = NULL;
    TU_OK(tdm_model_spec_parse(&spec, "mlp:6-5-4"));
    TU_OK(tdm_model_init(&m, dev, &spec, 7));
    tdm_train_stage s = {.dev = dev};
    float x[2 * 6] = {1, 2, 3};
    int32_t y[2] = {1, 3};
    const void *xd;
    const int32_t *yd;
    TU_OK(tdm_train_stage_batch(&s, m, x, y, 2, &xd, &yd));
    cr_assert_eq(xd, (const void *)x, "a host device reads the caller's batch");
    cr_assert_eq(yd, y);
    TU_OK(tdm_train_stage_dummy(&s, m, &xd, &yd));
    for (int i = 0; i < 6; i++) cr_assert_eq(((const float *)xd)[i], 0.0f);
    cr_assert_eq(yd[0], 0);
    double ls = 0.0;
    uint64_t t1 = 0;
    TU_OK(tdm_train_stage_batch(&s, m, x, y, 2, &xd, &yd));
    TU_OK(tdm_dist_forward_loss(&s, m, NULL, NULL, xd, yd, 2, 0.5f, &ls, &t1));
    cr_assert(t1 > 0 && ls > 0.0 && s.dlogits_bytes >= 2 * 4 * sizeof(float));
    /* the same loss as the model's own forward and loss */
    const float *logits;
    double ref = 0.0;
    TU_OK(tdm_model_forward(m, x, 2, &logits));
    TU_OK(tdm_model_loss(m, logits, y, 2, 1.0f, &ref, NULL));
    cr_assert_eq(ls, ref);
    tdm_train_stage_free(&s);
    cr_assert(!s.dummy_x && !s.dlogits && s.dev == dev);
    tdm_model_free(m);
    tdm_device_free(dev);
}

/* ---- the checks ---- */

Test(dist, check_seq_names_the_rank_that_ran_another_step)
{
    double seq[4] = {6, 6, 5, 6};
    cr_assert_eq(tdm_dist_check_seq("ddp", seq, 2, 0, 6), TDM_STATUS_OK);
    cr_assert_eq(tdm_dist_check_seq("ddp", seq, 4, 1, 6), TDM_STATUS_MISMATCH);
    cr_assert(strstr(tdm_error_message(), "ddp: collective sequence mismatch: rank 2 reduced "
                                          "the gradients of its training forward #5 together "
                                          "with rank 1's forward #6"),
              "%s", tdm_error_message());
    tdm_tensor_info a = {.name = "fc1.weight", .ndim = 2, .shape = {4, 3}, .offset = 0};
    tdm_tensor_info b = a;
    cr_assert_eq(tdm_dist_tensor_hash(&a), tdm_dist_tensor_hash(&b));
    b.shape[1] = 2;
    cr_assert_neq(tdm_dist_tensor_hash(&a), tdm_dist_tensor_hash(&b));
    b = a;
    b.offset = 16;
    cr_assert_neq(tdm_dist_tensor_hash(&a), tdm_dist_tensor_hash(&b));
    b = a;
    b.name[2] = '2';
    cr_assert_neq(tdm_dist_tensor_hash(&a), tdm_dist_tensor_hash(&b));
}

/* What forked ranks report to the test. */
typedef struct dist_out {
    int status[4];
    char err[4][512];
    int64_t extra[4][8];
    int setup[4], run[4], freed[4], attempts;
    int dev_index[4], coord_pp[4], role[4], start[4], pp_size[4], pp_rank[4], dp_size[4];
    int resized_failed, resized_from, resized_to;
} dist_out;

static dist_out *dist_out_new(void)
{
    dist_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(o != MAP_FAILED);
    memset(o, 0, sizeof *o);
    return o;
}

/* Rank 2 builds a wider hidden layer: the check names it and its tensor. */
static int check_rank(tdm_comm *comm, void *arg)
{
    dist_out *o = arg;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model_spec spec;
    tdm_model *m = NULL;
    int64_t mine[2] = {10 + r, 20}, *all = NULL;
    (void)tdm_device_open(&dev, "cpu", 0, 1);
    (void)tdm_model_spec_parse(&spec, r == 2 && o->attempts ? "mlp:6-7-4" : "mlp:6-5-4");
    (void)tdm_model_init(&m, dev, &spec, 1);
    o->status[r] = tdm_dist_check_model(comm, m, "test", "test model check", mine, 2, &all);
    snprintf(o->err[r], sizeof o->err[r], "%s", tdm_error_message());
    for (int k = 0; all && k < 2 * tdm_comm_size(comm); k++) o->extra[r][k] = all[k];
    free(all);
    tdm_model_free(m);
    tdm_device_free(dev);
    return 0;
}

Test(dist, check_model_gives_back_the_designs_values_and_names_a_differing_tensor, .timeout = 60)
{
    dist_out *o = dist_out_new();
    tdm_dist_spawn_opts so = {.timeout_ms = 30000};
    TU_OK(tdm_dist_spawn(3, check_rank, o, &so, NULL));
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(o->status[r], TDM_STATUS_OK, "rank %d: %s", r, o->err[r]);
        for (int k = 0; k < 3; k++) {
            cr_assert_eq(o->extra[r][2 * k], 10 + k);
            cr_assert_eq(o->extra[r][2 * k + 1], 20);
        }
    }
    memset(o, 0, sizeof *o);
    o->attempts = 1;   /* rank 2 builds another model */
    TU_OK(tdm_dist_spawn(3, check_rank, o, &so, NULL));
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(o->status[r], TDM_STATUS_MISMATCH, "rank %d: %s", r, o->err[r]);
        cr_assert(strstr(o->err[r], "test: parameter 0 differs between ranks") &&
                      strstr(o->err[r], "rank 2's has 42"),
                  "rank %d: %s", r, o->err[r]);
    }
    munmap(o, sizeof *o);
}

/* ---- running a design's ranks ---- */

typedef struct toy_ctx {
    dist_out *o;
    int fail_rank;          /* -1: none */
    int fail_attempts;      /* attempts on which fail_rank fails */
    int want_world;         /* the layout refuses another world (0: any) */
    int fail_by_signal;     /* fail_rank SIGKILLs itself, and the others
                               do not stop on their own: the teardown
                               SIGTERMs them */
} toy_ctx;

/* A pipeline of every rank, rank 0 in a role of its own (as a parameter
 * server's server beside its workers). */
static tdm_status toy_layout(void *ctx, int world, int rank, tdm_mesh_shape *shape, int *role)
{
    const toy_ctx *c = ctx;
    TDM_REQUIRE(!c->want_world || world == c->want_world, TDM_STATUS_INVALID_ARG,
                "toy: needs %d ranks, not %d", c->want_world, world);
    *shape = (tdm_mesh_shape){.size = {1, world, 1}};
    if (rank >= 0) *role = rank == 0 ? 7 : 1;
    return TDM_STATUS_OK;
}

static tdm_status toy_setup(void *ctx, tdm_dist_rank *r, void **self)
{
    toy_ctx *c = ctx;
    int k = r->env.rank;
    c->o->setup[k]++;
    c->o->dev_index[k] = tdm_dev_index(r->dev);
    c->o->coord_pp[k] = r->coord[TDM_MESH_PP];
    c->o->role[k] = r->role;
    /* the mesh's groups, split over the process group before setup */
    c->o->pp_size[k] = tdm_comm_size(tdm_mesh_comm(r->mesh, TDM_MESH_PP));
    c->o->pp_rank[k] = tdm_comm_rank(tdm_mesh_comm(r->mesh, TDM_MESH_PP));
    c->o->dp_size[k] = tdm_comm_size(tdm_mesh_comm(r->mesh, TDM_MESH_DP));
    c->o->start[k] = r->start;
    *self = &c->o->run[k];
    return TDM_STATUS_OK;
}

static tdm_status toy_run(void *ctx, tdm_dist_rank *r, void *self)
{
    toy_ctx *c = ctx;
    (*(int *)self)++;
    int failing = c->fail_rank < r->env.world_size && tdm_dist_restart_count() < c->fail_attempts;
    if (failing && c->fail_by_signal) {
        if (r->env.rank == c->fail_rank) raise(SIGKILL);
        for (;;) pause();   /* deaf to the group's abort: the teardown's signal ends it */
    }
    if (r->env.rank == c->fail_rank && tdm_dist_restart_count() < c->fail_attempts)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "toy rank %d gives up", r->env.rank);
    /* a collective: the others wait here for a rank that failed */
    return tdm_comm_barrier(r->comm);
}

static void toy_free(void *ctx, void *self)
{
    toy_ctx *c = ctx;
    c->o->freed[(int *)self - c->o->run]++;
}

static const tdm_dist_design toy_design = {.name = "toy", .layout = toy_layout,
                                           .setup = toy_setup, .run = toy_run,
                                           .free = toy_free};

static void toy_restart(void *ctx, int attempt, long long max, int ms, const char *resume)
{
    dist_out *o = ctx;
    (void)max;
    (void)resume;
    cr_assert(ms >= 200);
    o->attempts = attempt;
}

Test(dist, run_forks_the_ranks_of_a_design_each_on_its_device, .timeout = 60)
{
    dist_out *o = dist_out_new();
    toy_ctx c = {.o = o, .fail_rank = -1};
    tdm_device_list dl;
    TU_OK(tdm_device_list_parse(&dl, "cpu:3"));
    tdm_dist_run_opts ro = {.devices = &dl, .run_timeout_ms = 30000};
    cr_assert_eq(tdm_dist_job_start(&toy_design, &ro), TDM_DIST_START_FORKED);
    TU_OK(tdm_dist_run(&toy_design, &c, &ro));
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(o->setup[r], 1, "rank %d", r);
        cr_assert_eq(o->run[r], 1, "rank %d", r);
        cr_assert_eq(o->freed[r], 1, "rank %d", r);
        cr_assert_eq(o->dev_index[r], r);
        cr_assert_eq(o->coord_pp[r], r);
        cr_assert_eq(o->pp_size[r], 3, "rank %d", r);
        cr_assert_eq(o->pp_rank[r], r, "rank %d", r);
        cr_assert_eq(o->dp_size[r], 1, "rank %d", r);
        cr_assert_eq(o->role[r], r == 0 ? 7 : 1);
        cr_assert_eq(o->start[r], TDM_DIST_START_FORKED);
    }
    /* the layout refuses the world before any rank starts */
    memset(o, 0, sizeof *o);
    c.want_world = 2;
    cr_assert_eq(tdm_dist_run(&toy_design, &c, &ro), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "toy: needs 2 ranks, not 3"), "%s",
              tdm_error_message());
    cr_assert_eq(o->setup[0] + o->setup[1] + o->setup[2], 0);
    munmap(o, sizeof *o);
}

Test(dist, a_failing_rank_stops_the_group_and_a_restart_finishes, .timeout = 90)
{
    dist_out *o = dist_out_new();
    toy_ctx c = {.o = o, .fail_rank = 1, .fail_attempts = 1000};
    tdm_device_list dl;
    TU_OK(tdm_device_list_parse(&dl, "cpu:3"));
    tdm_dist_watch w = {.ctx = o, .restart = toy_restart};
    tdm_dist_run_opts ro = {.devices = &dl, .run_timeout_ms = 30000, .timeout_ms = 20000,
                            .watch = &w};
    cr_assert_eq(tdm_dist_run(&toy_design, &c, &ro), TDM_STATUS_PEER_FAILED);
    cr_assert(strstr(tdm_error_message(), "rank 1") &&
                  strstr(tdm_error_message(), "toy rank 1 gives up"),
              "%s", tdm_error_message());
    for (int r = 0; r < 3; r++) cr_assert_eq(o->freed[r], 1, "rank %d: free after a failure", r);
    cr_assert_eq(o->attempts, 0, "no restart was asked for");
    /* fails on the first attempt only: one restart finishes the job */
    memset(o, 0, sizeof *o);
    c.fail_attempts = 1;
    ro.max_restarts = 2;
    TU_OK(tdm_dist_run(&toy_design, &c, &ro));
    cr_assert_eq(o->attempts, 1);
    for (int r = 0; r < 3; r++) cr_assert_eq(o->run[r], 2, "rank %d ran again", r);
    munmap(o, sizeof *o);
    unsetenv(TDM_DIST_ENV_RESTARTS);
}

static void toy_resize(void *ctx, int failed, int from, int to, int left)
{
    dist_out *o = ctx;
    (void)left;
    o->resized_failed = failed;
    o->resized_from = from;
    o->resized_to = to;
}

/* Rank 2 of 3 dies by SIGKILL on two attempts in a row; ranks 0 and 1 do
 * not stop on their own and are SIGTERMed by the teardown. The rank lost
 * is 2, not the lowest rank that ended by a signal (0, by the teardown's):
 * the resize leaves device 2 out, and the two healthy devices finish. */
Test(dist, resize_drops_the_rank_that_died_not_one_the_teardown_killed, .timeout = 90)
{
    dist_out *o = dist_out_new();
    toy_ctx c = {.o = o, .fail_rank = 2, .fail_attempts = 2, .fail_by_signal = 1};
    tdm_device_list dl;
    TU_OK(tdm_device_list_parse(&dl, "cpu:3"));
    tdm_dist_watch w = {.ctx = o, .restart = toy_restart, .resize = toy_resize};
    tdm_dist_run_opts ro = {.devices = &dl, .run_timeout_ms = 60000, .timeout_ms = 20000,
                            .watch = &w, .max_restarts = 2, .min_world = 1};
    o->resized_failed = -1;
    TU_OK(tdm_dist_run(&toy_design, &c, &ro));
    cr_assert_eq(o->attempts, 2);
    cr_assert_eq(o->resized_failed, 2, "the resize dropped rank %d, not rank 2 (the one that "
                 "died of SIGKILL)", o->resized_failed);
    cr_assert_eq(o->resized_from, 3);
    cr_assert_eq(o->resized_to, 2);
    cr_assert_eq(o->dev_index[0], 0, "rank 0 kept device cpu:0");
    cr_assert_eq(o->dev_index[1], 1, "rank 1 kept device cpu:1");
    munmap(o, sizeof *o);
    unsetenv(TDM_DIST_ENV_RESTARTS);
}

/* A checkpoint of `data_nbytes` zero bytes (one U8 tensor) whose "run"
 * metadata is run; sparse, so a terabyte costs no disk. */
static void write_sparse_checkpoint(const char *path, const char *run, uint64_t data_nbytes)
{
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"run\":\"%s\"},\"w\":{\"dtype\":"
                     "\"U8\",\"shape\":[%llu],\"data_offsets\":[0,%llu]}}", run,
                     (unsigned long long)data_nbytes, (unsigned long long)data_nbytes);
    while (n % 8) hdr[n++] = ' ';
    unsigned char len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (unsigned char)((uint64_t)n >> (8 * k));
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, len8, 8), 8);
    cr_assert_eq(write(fd, hdr, (size_t)n), n);
    cr_assert_eq(ftruncate(fd, (off_t)(8 + (uint64_t)n + data_nbytes)), 0);
    close(fd);
}

/* Whether a checkpoint is this run's is read from its header: a
 * checkpoint larger than memory (a sparse terabyte: loading it whole
 * cannot be allocated) is still this run's, so a restart resumes from it
 * rather than from step 0; one that cannot be read at all is an error, not
 * "another run's". */
Test(dist, restart_ours_reads_the_header_and_an_unreadable_file_is_an_error)
{
    char dir[] = "/tmp/tdm_dist_ours_XXXXXX", big[64], other[64], sub[64];
    cr_assert(mkdtemp(dir));
    snprintf(big, sizeof big, "%s/big.safetensors", dir);
    snprintf(other, sizeof other, "%s/other.safetensors", dir);
    snprintf(sub, sizeof sub, "%s/sub", dir);
    write_sparse_checkpoint(big, "run-a", (uint64_t)1 << 40);
    write_sparse_checkpoint(other, "run-b", 16);
    cr_assert_eq(mkdir(sub, 0700), 0);
    cr_assert_eq(setenv(TDM_DIST_ENV_RUN, "run-a", 1), 0);
    char why[512];
    int ours = -1;
    tdm_status st = tdm_dist_restart_ours(big, &ours, why, sizeof why);
    cr_expect_eq(st, TDM_STATUS_OK, "%s", why);
    cr_expect_eq(ours, 1, "a 1 TiB checkpoint of this run taken for not ours: %s", why);
    TU_OK(tdm_dist_restart_ours(other, &ours, why, sizeof why));
    cr_expect_eq(ours, 0);
    cr_expect(strstr(why, "holds another run's checkpoint (run run-b)"), "%s", why);
    /* a directory where the checkpoint should be: cannot be read */
    st = tdm_dist_restart_ours(sub, &ours, why, sizeof why);
    cr_expect_eq(st, TDM_STATUS_IO, "%s", why);
    cr_expect_eq(ours, 0);
    cr_expect(strstr(why, "cannot tell whether") && strstr(why, "not a regular file"), "%s", why);
    /* a restarted rank resumes from it, and stops on the unreadable one */
    tdm_dist_restart_count_set(1);
    const char *resume = NULL;
    TU_OK(tdm_dist_restart_resume(big, &resume));
    cr_expect(resume && !strcmp(resume, big));
    cr_expect_eq(tdm_dist_restart_resume(sub, &resume), TDM_STATUS_IO);
    cr_expect_null(resume);
    unsetenv(TDM_DIST_ENV_RESTARTS);
    unsetenv(TDM_DIST_ENV_RUN);
    unlink(big);
    unlink(other);
    rmdir(sub);
    rmdir(dir);
}

Test(dist, run_starts_as_a_launched_rank_under_tandem_launch)
{
    tdm_device_list dl;
    TU_OK(tdm_device_list_parse(&dl, "cpu:2"));
    tdm_dist_run_opts ro = {.devices = &dl};
    cr_assert_eq(setenv("TANDEM_SHM_FD", "9", 1), 0);
    cr_assert_eq(tdm_dist_job_start(&toy_design, &ro), TDM_DIST_START_FORKED,
                 "TANDEM_SHM_FD without WORLD_SIZE is no launched job");
    cr_assert_eq(setenv("WORLD_SIZE", "2", 1), 0);
    cr_assert(tdm_dist_launched());
    cr_assert_eq(tdm_dist_job_start(&toy_design, &ro), TDM_DIST_START_LAUNCHED);
    int64_t ms = 0;
    TU_OK(tdm_dist_job_timeout(&ro, TDM_DIST_START_LAUNCHED, &ms));
    cr_assert_eq(ms, TDM_DIST_TIMEOUT_DEFAULT_MS);
    TU_OK(tdm_dist_job_timeout(&ro, TDM_DIST_START_FORKED, &ms));
    cr_assert_eq(ms, TDM_DIST_FORKED_TIMEOUT_MS);
    unsetenv("TANDEM_SHM_FD");
    unsetenv("WORLD_SIZE");
}
