/* tests/test_mpi_split.c: tdm_comm_split under mpirun: the MPI
 * communicator's split (MPI_Comm_split) on 4 ranks over two pretend
 * machines (MPI over TCP on lo) - groups, ranks, job ranks, an undefined
 * color, collectives and send/recv on the groups - and a 2-stage pipeline
 * over it (its links split from it) equal to one device bit for bit; the
 * job's shm communicator splits too; the hierarchical one refuses with a
 * one-line reason on every rank. */
#include <criterion/criterion.h>

#include "mpi/mpi_weak.h"
#include "shm/shm_comm.h"
#include "tests/mpi_test_util.h"
#include "tests/test_pp_util.h"

static int w_bad(const char *what, tdm_status st, int r)
{
    fprintf(stderr, "rank %d: %s: %s: %s\n", r, what, tdm_status_name(st), tdm_error_message());
    return 1;
}

/* Groups of color r % 2, keys -r; then rank w - 1 undefined. */
static int check_groups(tdm_comm *c, const char *name)
{
    int r = tdm_comm_rank(c), w = tdm_comm_size(c);
    tdm_comm *sub = NULL;
    tdm_status st = tdm_comm_split(c, r % 2, -r, &sub);
    if (st) return w_bad(name, st, r);
    int n = (w - r % 2 + 1) / 2, me = 0;
    for (int q = r + 2; q < w; q += 2) me++;   /* higher ranks come first */
    if (tdm_comm_size(sub) != n || tdm_comm_rank(sub) != me) {
        fprintf(stderr, "rank %d: %s: rank %d of %d, expected %d of %d\n", r, name,
                tdm_comm_rank(sub), tdm_comm_size(sub), me, n);
        return 1;
    }
    int64_t v = r, want = 0;
    for (int q = r % 2; q < w; q += 2) want += q;
    for (int i = 0; i < n; i++)
        if (tdm_comm_job_rank(sub, i) != w - 1 - ((w - 1 - r % 2) % 2) - 2 * i) {
            fprintf(stderr, "rank %d: %s: job rank of %d is %d\n", r, name, i,
                    tdm_comm_job_rank(sub, i));
            return 1;
        }
    if ((st = tdm_comm_all_reduce(sub, &v, &v, 1, TDM_DTYPE_INT64, TDM_REDOP_SUM)))
        return w_bad(name, st, r);
    if (v != want) {
        fprintf(stderr, "rank %d: %s: sum %lld, want %lld\n", r, name, (long long)v,
                (long long)want);
        return 1;
    }
    /* send/recv inside the group: its rank 0 to its last */
    float x = (float)r;
    if (n > 1 && me == 0 && (st = tdm_comm_send(sub, &x, 1, TDM_DTYPE_FLOAT32, n - 1)))
        return w_bad(name, st, r);
    if (n > 1 && me == n - 1) {
        if ((st = tdm_comm_recv(sub, &x, 1, TDM_DTYPE_FLOAT32, 0))) return w_bad(name, st, r);
        if (x != (float)tdm_comm_job_rank(sub, 0)) return 1;
    }
    tdm_comm_free(sub);
    sub = (tdm_comm *)1;
    if ((st = tdm_comm_split(c, r == w - 1 ? TDM_COMM_SPLIT_UNDEFINED : 0, 0, &sub)))
        return w_bad(name, st, r);
    if ((r == w - 1) != (sub == NULL)) return 1;
    if (sub && tdm_comm_size(sub) != w - 1) return 1;
    tdm_comm_free(sub);
    return 0;
}

/* Two stages over c: the MLP, 1F1B, 4 micro-batches, 3 steps, losses equal
 * to one device with accumulation. */
static int check_pipeline(tdm_comm *c)
{
    int r = tdm_comm_rank(c);
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    double ref[3];
    int64_t n = 0;
    if (tpp_reference(TPP_MLP, 4, 16, 3, ref, NULL, NULL, &n)) return w_bad("reference", 1, r);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_pp_opts o = {.schedule = TDM_PP_1F1B, .micro_batches = 4, .seed = TPP_SEED,
                     .optim = tpp_optim(TPP_MLP)};
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, c, dev, &spec, &o);
    float x[16 * 20];
    int32_t y[16];
    for (int s = 0; !st && s < 3; s++) {
        double loss;
        tpp_batch(&spec, 20, 1, 5, s, 16, x, y);
        st = tdm_pp_step(p, x, y, 16, &loss);
        if (!st && loss != ref[s]) {
            fprintf(stderr, "rank %d: pipeline over mpi: step %d loss %.17g, one device %.17g\n",
                    r, s, loss, ref[s]);
            st = TDM_STATUS_MISMATCH;
        }
    }
    tdm_pp_free(p);
    tdm_device_free(dev);
    return st ? w_bad("pipeline over mpi", st, r) : 0;
}

static int w_split(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    tdm_mpi_job *job = NULL;
    tdm_status st = tdm_mpi_job_init(&job, NULL);
    if (st) return w_bad("tdm_mpi_job_init", st, -1);
    int r = tdm_mpi_job_topo(job)->rank, bad = 0;
    tdm_shm_opts so = {.timeout_ms = 60000};
    tdm_comm *mpi = NULL, *hier = NULL;
    if ((st = tdm_mpi_job_comm(job, TDM_MPI_BACKEND_MPI, &so, &mpi))) return w_bad("mpi", st, r);
    bad |= check_groups(mpi, "mpi");
    /* a pipeline of the first two ranks (its own split of the job) */
    tdm_comm *two = NULL;
    if ((st = tdm_comm_split(mpi, r < 2 ? 0 : TDM_COMM_SPLIT_UNDEFINED, r, &two)))
        return w_bad("split of two", st, r);
    if (two) bad |= check_pipeline(two);
    tdm_comm_free(two);
    if ((st = tdm_mpi_job_comm(job, TDM_MPI_BACKEND_HIER, &so, &hier))) return w_bad("hier", st, r);
    tdm_comm *sub = (tdm_comm *)1;
    st = tdm_comm_split(hier, 0, r, &sub);
    if (st != TDM_STATUS_UNSUPPORTED || sub ||
        !strstr(tdm_error_message(), "the hierarchical communicator") ||
        strchr(tdm_error_message(), '\n')) {
        fprintf(stderr, "rank %d: hier split gave %s: %s\n", r, tdm_status_name(st),
                tdm_error_message());
        bad = 1;
    }
    tdm_comm_free(hier);
    tdm_comm_free(mpi);
    tdm_mpi_job_free(job);
    if (!bad && r == 0) printf("split ok\n");
    return bad;
}

static int w_split_shm(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    tdm_mpi_job *job = NULL;
    tdm_status st = tdm_mpi_job_init(&job, NULL);
    if (st) return w_bad("tdm_mpi_job_init", st, -1);
    int r = tdm_mpi_job_topo(job)->rank, bad = 0;
    tdm_shm_opts so = {.timeout_ms = 60000};
    tdm_comm *shm = NULL;
    if ((st = tdm_mpi_job_comm(job, TDM_MPI_BACKEND_SHM, &so, &shm))) return w_bad("shm", st, r);
    bad |= check_groups(shm, "shm");
    tdm_comm_free(shm);
    tdm_mpi_job_free(job);
    if (!bad && r == 0) printf("split shm ok\n");
    return bad;
}

static const mpi_t_worker workers[] = {{"split", w_split}, {"split_shm", w_split_shm}};
MPI_T_WORKERS(workers)

static cli_result res;

Test(mpi_split, mpi_groups_pipeline_and_hier_refusal, .timeout = 180)
{
    MPI_T_NEED();
    const char *env[] = {"TANDEM_PRETEND_MACHINES=2", NULL};
    mpi_t_job j = {.np = 4, .worker = "split", .env = env};
    mpi_t_run(&res, &j);
    expect(&res, 0, "split ok");
}

Test(mpi_split, shm_of_an_mpi_job_splits, .timeout = 120)
{
    MPI_T_NEED();
    mpi_t_job j = {.np = 4, .worker = "split_shm"};
    mpi_t_run(&res, &j);
    expect(&res, 0, "split shm ok");
}
