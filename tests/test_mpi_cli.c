/* tests/test_mpi_cli.c: the tandem command as the ranks of an MPI job:
 * `bench <collective>` under mpirun (ranks from MPI, every backend and
 * Open MPI's own collective in one run, usage errors said once) and
 * outside it (it runs itself under mpirun); a build without MPI says how
 * to get it. Every run is bounded and leaves nothing behind
 * (tests/mpi_test_util.h). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/mpi_test_util.h"

static cli_result res;

static int count_of(const char *out, const char *s)
{
    int n = 0;
    for (const char *p = out; (p = strstr(p, s)); p += strlen(s)) n++;
    return n;
}

Test(mpi_cli, bench_outside_mpirun_runs_itself_under_it, .timeout = 180)
{
    MPI_T_NEED();
    const char *args[] = {"bench", "all_reduce", "-n", "2", "-b", "8", "-e", "4K", "-f", "8",
                          "-w", "2", "-i", "5", "--backend", "mpi", "--peer", "mpi", NULL};
    mpi_t_job j = {.np = 0, .exe = cli_bin(), .args = args, .timeout_s = 120};
    mpi_t_run(&res, &j);
    expect(&res, 0, "# not started by an MPI launcher: running mpirun -np 2");
    expect(&res, 0, "2 ranks (MPI job on 1 machine, backend mpi");
    /* 8, 64, 512, 4096: one row per size for the backend and one for MPI's own */
    cr_assert_eq(count_of(res.out, "| mpi     |"), 4, "%s", res.out);
    cr_assert_eq(count_of(res.out, "| mpi-own |"), 4, "%s", res.out);
    cr_assert(strstr(res.out, "MPI_Allreduce"), "%s", res.out);
    expect(&res, 0, "Out of bounds values : 0 OK");
}

Test(mpi_cli, bench_under_mpirun_takes_its_ranks_from_mpi, .timeout = 180)
{
    MPI_T_NEED();
    static const char *const colls[] = {"reduce_scatter", "all_gather", "broadcast", "reduce"};
    for (size_t c = 0; c < sizeof colls / sizeof colls[0]; c++) {
        const char *args[] = {"bench", colls[c], "-b", "24", "-e", "96K", "-f", "64",
                              "-d", "int64", "-r", "2", "-w", "1", "-i", "3",
                              "--backend", "mpi", NULL};
        mpi_t_job j = {.np = 3, .exe = cli_bin(), .args = args, .tcp = 1, .timeout_s = 120};
        mpi_t_run(&res, &j);
        expect(&res, 0, "3 ranks (MPI job on 1 machine, backend mpi");
        expect(&res, 0, "Out of bounds values : 0 OK");
        cr_assert(!strstr(res.out, "not started by an MPI launcher"), "%s", res.out);
    }
}

Test(mpi_cli, bench_usage_errors_under_mpirun_are_said_once, .timeout = 120)
{
    MPI_T_NEED();
    const char *args[] = {"bench", "all_reduce", "-n", "2", "--backend", "mpi", NULL};
    mpi_t_job j = {.np = 3, .exe = cli_bin(), .args = args, .timeout_s = 60};
    mpi_t_run(&res, &j);
    cr_assert_eq(res.code, 2, "exit %d:\n%s", res.code, res.out);
    cr_assert_eq(count_of(res.out, "-n 2: the MPI job has 3 ranks"), 1, "%s", res.out);
    const char *args2[] = {"bench", "reduce_scatter", "-b", "8", NULL};
    j.args = args2;
    mpi_t_run(&res, &j);
    cr_assert_eq(res.code, 2, "exit %d:\n%s", res.code, res.out);
    cr_assert_eq(count_of(res.out, "smallest size for reduce_scatter of float32 over 3 ranks is "
                                   "12 bytes"), 1, "%s", res.out);
}

Test(mpi_cli, bench_flags_are_checked, .timeout = 30)
{
    CLI(&res, "bench", "all_reduce", "--backend", "shm,tcp");
    expect(&res, 2, "--backend 'tcp': expected auto, shm, mpi or hier");
    CLI(&res, "bench", "all_reduce", "--backend", "mpi,mpi");
    expect(&res, 2, "names mpi twice");
    CLI(&res, "bench", "all_reduce", "--peer", "nccl");
    expect(&res, 2, "the only peer is mpi");
    CLI(&res, "bench", "all_reduce", "--backend", "mpi", "--zero-copy");
    expect(&res, 2, "--zero-copy applies to forked ranks over shm only");
    CLI(&res, "bench", "--help");
    expect(&res, 0, "--backend LIST");
}

Test(mpi_cli, without_mpi_the_backend_says_how_to_get_it, .timeout = 30)
{
    if (tdm_comm_init_mpi) cr_skip_test("this build has MPI");
    CLI(&res, "bench", "all_reduce", "--backend", "mpi");
    expect(&res, 1, "this tandem was built without MPI");
    expect(&res, 1, "make deps");
}
