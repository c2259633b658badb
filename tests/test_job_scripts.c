/* tests/test_job_scripts.c: the cluster job scripts users start from
 * (examples/pbs_ddp.sh, examples/slurm_ddp.sh) run `tandem train --mode
 * ddp` with the rank layout their scheduler's environment asks for. No
 * scheduler here: the test fakes one on this machine.
 *   PBS: PBS_NODEFILE names localhost once per slot; the script's mpirun
 *   starts that many ranks (with TANDEM_PRETEND_MACHINES=2, as two
 *   machines of consecutive ranks, MPI over TCP on lo between them).
 *   Slurm: SLURM_JOB_ID, SLURM_NTASKS, ... as sbatch sets them, and an
 *   `srun` on PATH (there is none here) that records its arguments and
 *   starts the command's ranks with mpirun, as srun --mpi=pmix would.
 * Each rank logs where it is ("job: rank R of N, machine M of K (rank L of
 * J there)", TANDEM_DEBUG=INFO TANDEM_DEBUG_SUBSYS=MPI); the test checks
 * every rank's line, the run's header and its checkpoint. Bounded and
 * leaving nothing behind (tests/mpi_test_util.h). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/mpi_test_util.h"
#include "tests/test_util.h"

static cli_result res;
static char dir[160];

static void remove_dir(void)
{
    tu_rmtree(dir);
    dir[0] = '\0';
}

static void write_file(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
    cr_assert_eq(chmod(path, mode), 0, "%s", path);
}

/* Runs `sh script` with env (NULL-terminated "NAME=value"), bounded. */
static void run_script(const char *script, const char *const *env)
{
    const char *args[] = {script, NULL};
    mpi_t_job j = {.np = 0, .exe = "sh", .args = args, .env = env, .timeout_s = 150};
    mpi_t_run(&res, &j);
}

/* Every rank r of n logged "job: rank r of n, machine r/per of machines"
 * and "(rank r%per of per there)". */
static void expect_layout(int n, int machines)
{
    int per = n / machines;
    for (int r = 0; r < n; r++) {
        char want[160];
        snprintf(want, sizeof want, "job: rank %d of %d, machine %d of %d", r, n, r / per,
                 machines);
        const char *at = strstr(res.out, want);
        cr_assert_not_null(at, "no rank %d of %d on machine %d of %d:\n%s", r, n, r / per,
                           machines, res.out);
        snprintf(want, sizeof want, "(rank %d of %d there)", r % per, per);
        const char *eol = strchr(at, '\n');
        const char *there = strstr(at, want);
        cr_assert(there && (!eol || there < eol), "rank %d: not %s on its machine:\n%s", r, want,
                  res.out);
    }
}

static const char *tandem_env(void)
{
    static char e[PATH_MAX + 8];
    char abs[PATH_MAX]; /* the scripts may change directory */
    cr_assert_not_null(realpath(cli_bin(), abs), "%s", cli_bin());
    snprintf(e, sizeof e, "TANDEM=%s", abs);
    return e;
}

#define TRAIN_ENV                                                                        \
    "TANDEM_DEBUG=INFO", "TANDEM_DEBUG_SUBSYS=MPI", "EPOCHS=1", "DATA=synthetic",        \
        "TANDEM_ARGS=--max-steps 3 --synthetic-size 1024 --batch 64 --no-eval --quiet", \
        "OMPI_MCA_oob_tcp_if_include=lo"

Test(job_scripts, pbs_runs_a_rank_per_nodefile_slot, .timeout = 200, .fini = remove_dir)
{
    MPI_T_NEED();
    tu_mkdtemp(dir, sizeof dir, "pbs");
    char nodefile[256], save[256], cwd[256];
    snprintf(nodefile, sizeof nodefile, "PBS_NODEFILE=%s/nodes", dir);
    snprintf(save, sizeof save, "SAVE=%s/ddp.safetensors", dir);
    snprintf(cwd, sizeof cwd, "PBS_O_WORKDIR=%s", dir);

    /* two slots on one node: two ranks there, over shared memory, each
     * bound to a core of its own */
    write_file(tu_tpath(dir, "nodes"), "localhost\nlocalhost\n", 0644);
    const char *env2[] = {tandem_env(), nodefile, save, cwd, TRAIN_ENV, NULL};
    run_script("examples/pbs_ddp.sh", env2);
    expect(&res, 0, "pbs_ddp.sh: 2 ranks on 1 node(s)");
    expect_layout(2, 1);
    expect(&res, 0, "2 MPI ranks on cpu (shm, 2 ranks on 1 machine");
    expect(&res, 0, "epoch 1/1: train loss");
    cr_assert_eq(access(tu_tpath(dir, "ddp.safetensors"), R_OK), 0, "no checkpoint:\n%s",
                 res.out);

    /* four slots as two machines of two consecutive ranks (--map-by slot),
     * unbound (four ranks, two cores): hier between the machines */
    write_file(tu_tpath(dir, "nodes"), "localhost\nlocalhost\nlocalhost\nlocalhost\n", 0644);
    const char *env4[] = {tandem_env(), nodefile, save, cwd, TRAIN_ENV, "BIND=none",
                          "TANDEM_PRETEND_MACHINES=2", NULL};
    run_script("examples/pbs_ddp.sh", env4);
    expect(&res, 0, "pbs_ddp.sh: 4 ranks on 1 node(s)");
    expect_layout(4, 2);
    expect(&res, 0, "4 MPI ranks on cpu (hier, 4 ranks on 2 pretend machines");
    cr_assert_eq(cli_shm_entries(), 0, "left a tandem entry in /dev/shm");
}

Test(job_scripts, pbs_outside_pbs_says_how_to_submit, .timeout = 60)
{
    const char *env[] = {"PBS_NODEFILE=", NULL};
    run_script("examples/pbs_ddp.sh", env);
    expect(&res, 2, "PBS_NODEFILE is not set: submit this script with qsub");
    const char *env2[] = {"PBS_NODEFILE=/nonexistent/nodes", NULL};
    run_script("examples/pbs_ddp.sh", env2);
    expect(&res, 1, "PBS_NODEFILE=/nonexistent/nodes: cannot read it");
}

/* srun as the test fakes it: its arguments, one a line, in $FAKE_SRUN_LOG;
 * then the command (what follows srun's own options) under mpirun, one
 * rank per task of --ntasks. */
static const char fake_srun[] =
    "#!/bin/sh\n"
    "printf '%s\\n' \"$@\" > \"$FAKE_SRUN_LOG\"\n"
    "n=$SLURM_NTASKS\n"
    "while [ $# -gt 0 ]; do\n"
    "  case $1 in --ntasks=*) n=${1#--ntasks=};; -*) ;; *) break;; esac\n"
    "  shift\n"
    "done\n"
    "exec mpirun -np \"$n\" --oversubscribe --bind-to none \"$@\"\n";

Test(job_scripts, slurm_runs_a_rank_per_task_through_srun, .timeout = 200, .fini = remove_dir)
{
    MPI_T_NEED();
    tu_mkdtemp(dir, sizeof dir, "slurm");
    write_file(tu_tpath(dir, "srun"), fake_srun, 0755);
    char path[4200], log[256], save[256];
    snprintf(path, sizeof path, "PATH=%s:%s", dir, getenv("PATH") ? getenv("PATH") : "/usr/bin");
    snprintf(log, sizeof log, "FAKE_SRUN_LOG=%s/srun.args", dir);
    snprintf(save, sizeof save, "SAVE=%s/ddp.safetensors", dir);
    const char *env[] = {tandem_env(), path, log, save, TRAIN_ENV, "SLURM_JOB_ID=4242",
                         "SLURM_NTASKS=3", "SLURM_JOB_NUM_NODES=1",
                         "SLURM_JOB_NODELIST=localhost", "SLURM_NTASKS_PER_NODE=3", NULL};
    run_script("examples/slurm_ddp.sh", env);
    expect(&res, 0, "slurm_ddp.sh: 3 ranks on 1 node(s) (localhost), job 4242");
    expect_layout(3, 1);
    expect(&res, 0, "3 MPI ranks on cpu (shm, 3 ranks on 1 machine");
    expect(&res, 0, "epoch 1/1: train loss");
    cr_assert_eq(access(tu_tpath(dir, "ddp.safetensors"), R_OK), 0, "no checkpoint:\n%s",
                 res.out);
    /* what the script asked of srun */
    static char args[4096];
    FILE *f = fopen(tu_tpath(dir, "srun.args"), "r");
    cr_assert_not_null(f, "srun was not run:\n%s", res.out);
    size_t n = fread(args, 1, sizeof args - 1, f);
    args[n] = '\0';
    fclose(f);
    const char *want[] = {"--mpi=pmix\n", "--ntasks=3\n", "--kill-on-bad-exit=1\n", "train\n",
                          "--mode\nddp\n", "--device\ncpu\n", "--epochs\n1\n"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(args, want[i]), "srun was not given `%s`:\n%s", want[i], args);
    cr_assert_eq(cli_shm_entries(), 0, "left a tandem entry in /dev/shm");
}

Test(job_scripts, slurm_outside_slurm_says_how_to_submit, .timeout = 60)
{
    const char *env[] = {"SLURM_JOB_ID=", "SLURM_NTASKS=", NULL};
    run_script("examples/slurm_ddp.sh", env);
    expect(&res, 2, "SLURM_JOB_ID or SLURM_NTASKS is not set: submit this script with sbatch");
    const char *env2[] = {"SLURM_JOB_ID=1", "SLURM_NTASKS=2", "PATH=/nonexistent", NULL};
    const char *args[] = {"examples/slurm_ddp.sh", NULL};
    mpi_t_job j = {.np = 0, .exe = "/bin/sh", .args = args, .env = env2, .timeout_s = 30};
    mpi_t_run(&res, &j);
    expect(&res, 1, "srun not found on PATH");
}
