/* tests/test_tp_mpi.c: `tandem train --mode tp` as the ranks of an MPI
 * launcher, on one machine (MPI's TCP transport on lo only; the last
 * test on 2 pretend machines): mpirun -np 4 over --backend shm and over
 * --backend mpi, and `tandem launch -n 4`, write the checkpoint the
 * forked ranks write, byte for byte (but tp over 4 ranks over MPI
 * itself, within 1e-5: see same_everywhere): tp over 4 ranks (the MLP), the
 * dp=2 x tp=2 mesh plain and with ZeRO-1 and 2 (the dp dimension's
 * reduce-scatter and all-gather over MPI), and the GPT split by heads on
 * dp=2 x tp=2; and the memory levers (fp16, bf16, clipping, checkpointing)
 * on dp=2 x tp=2. Skipped where MPI is not built or mpirun is missing. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/ckpt_diff_util.h"
#include "tests/cli_util.h"
#include "tests/mpi_test_util.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "tp_mpi"); }
static void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(tp_mpi, .init = setup, .fini = teardown, .timeout = 300);

#define TP_ARGS_MAX 32

/* The job's arguments (after "train"), NULL-terminated, into argv[1..]
 * with "train" first; --save PATH appended. */
static int job_argv(const char **argv, const char *const *job, const char *save)
{
    int n = 0;
    argv[n++] = "train";
    for (int i = 0; job[i] && n < TP_ARGS_MAX - 3; i++) argv[n++] = job[i];
    argv[n++] = "--save";
    argv[n++] = save;
    argv[n] = NULL;
    return n;
}

/* job forked, under tandem launch -n 4 and under mpirun -np 4 (shm and
 * mpi backends): every checkpoint the forked one's bytes; the header of
 * the MPI runs says so. But over --backend mpi with groups of more than
 * two ranks (mpi_tol > 0): Open MPI's all-reduce adds 4 ranks' partial
 * sums in another order than the shm communicator, so there the file is
 * held to mpi_tol of the forked one's (model names the layout). */
static void same_everywhere(const char *const *job, const char *what, const char *header,
                            const char *model, double mpi_tol)
{
    static cli_result r;
    char forked[128], other[128];
    const char *argv[TP_ARGS_MAX], *largv[TP_ARGS_MAX + 4];
    snprintf(forked, sizeof forked, "%s/forked.safetensors", g_dir);
    snprintf(other, sizeof other, "%s/other.safetensors", g_dir);
    unlink(forked);
    int n = job_argv(argv, job, forked);
    (void)n;
    cli_run(&r, argv);
    expect(&r, 0, "epoch 1/1");
    unlink(other);
    largv[0] = "launch";
    largv[1] = "-n";
    largv[2] = "4";
    largv[3] = "--";
    largv[4] = cli_bin();
    n = job_argv(largv + 5, job, other) + 5;
    (void)n;
    cli_run(&r, largv);
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(forked, other), "%s: tandem launch -n 4 wrote other bytes", what);
    static const char *const backends[] = {"shm", "mpi"};
    for (int b = 0; b < 2; b++) {
        unlink(other);
        const char *args[TP_ARGS_MAX + 2];
        int k = job_argv(args, job, other);
        args[k++] = "--backend";
        args[k++] = backends[b];
        args[k] = NULL;
        mpi_t_job j = {.np = 4, .exe = cli_bin(), .args = args, .tcp = 1, .timeout_s = 120};
        mpi_t_run(&r, &j);
        expect(&r, 0, header);
        if (b == 1 && mpi_tol > 0) {
            double d = ck_diff_of(model, forked, other);
            if (getenv("TANDEM_TEST_VERBOSE"))
                fprintf(stderr, "%s: mpirun --backend mpi within %g of the forked run\n", what, d);
            cr_assert(d <= mpi_tol, "%s: mpirun --backend mpi ends %g from the forked run", what,
                      d);
            continue;
        }
        cr_assert(cli_same_file(forked, other), "%s: mpirun --backend %s wrote other bytes:\n%s",
                  what, backends[b], r.out);
    }
}

#define MLP "--model", "mlp:20-24-16-12-5", "--data", "synthetic", "--synthetic-size", "200", \
            "--batch", "32", "--epochs", "1", "--quiet"

Test(tp_mpi, mlp_tp4_and_dp2_tp2_write_the_forked_runs_checkpoint)
{
    MPI_T_NEED();
    static const char *const tp4[] = {"--mode", "tp", "--device", "cpu:4", MLP, NULL};
    same_everywhere(tp4, "tp 4", "4 MPI ranks on cpu:4, tensor parallel over 4 ranks",
                    "mlp:20-24-16-12-5", 1e-5);
    static const char *const mesh[] = {"--mode", "tp", "--device", "cpu:4", "--mesh",
                                       "dp=2,tp=2", MLP, NULL};
    same_everywhere(mesh, "dp=2,tp=2", "4 MPI ranks on cpu:4, tensor parallel over 2 ranks",
                    NULL, 0);
    static const char *const zero[] = {"--mode", "tp", "--device", "cpu:4", "--mesh",
                                       "dp=2,tp=2", "--sharding", "optimizer", MLP, NULL};
    same_everywhere(zero, "dp=2,tp=2 ZeRO-1", "4 MPI ranks on cpu:4, tensor parallel over 2",
                    NULL, 0);
    /* ZeRO-2: MPI's reduce-scatter into the kept shard (out of place) */
    static const char *const zero2[] = {"--mode", "tp", "--device", "cpu:4", "--mesh",
                                        "dp=2,tp=2", "--sharding", "grad_op", MLP, NULL};
    same_everywhere(zero2, "dp=2,tp=2 ZeRO-2", "4 MPI ranks on cpu:4, tensor parallel over 2",
                    NULL, 0);
}

Test(tp_mpi, gpt_dp2_tp2_writes_the_forked_runs_checkpoint)
{
    MPI_T_NEED();
    char text[128];
    snprintf(text, sizeof text, "%s/text.txt", g_dir);
    cli_write_words(text);
    const char *const gpt[] = {"--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2",
                               "--model", "gpt:2-16-2-8", "--data", text, "--batch", "8",
                               "--epochs", "1", "--max-steps", "4", "--quiet", NULL};
    same_everywhere(gpt, "gpt dp=2,tp=2", "4 MPI ranks on cpu:4", NULL, 0);
}

/* Two pretend machines (TANDEM_PRETEND_MACHINES=2, MPI over TCP on lo):
 * without --backend (auto), a job on several machines would take the
 * hierarchical communicator, which a mesh cannot be split into; tp's
 * mesh runs over MPI itself and writes the forked run's checkpoint. An
 * explicit --backend hier is refused with one line naming --backend
 * mpi, exit 2, before any rank starts training. */
Test(tp_mpi, two_machines_without_backend_run_over_mpi)
{
    MPI_T_NEED();
    static cli_result r;
    char forked[128], other[128];
    snprintf(forked, sizeof forked, "%s/forked.safetensors", g_dir);
    snprintf(other, sizeof other, "%s/other.safetensors", g_dir);
    static const char *const job[] = {"--mode", "tp", "--device", "cpu:4", "--mesh",
                                      "dp=2,tp=2", MLP, NULL};
    const char *argv[TP_ARGS_MAX];
    job_argv(argv, job, forked);
    cli_run(&r, argv);
    expect(&r, 0, "epoch 1/1");
    static const char *const two[] = {"TANDEM_PRETEND_MACHINES=2", NULL};
    job_argv(argv, job, other);
    mpi_t_job j = {.np = 4, .exe = cli_bin(), .args = argv, .env = two, .tcp = 1,
                   .timeout_s = 120};
    mpi_t_run(&r, &j);
    expect(&r, 0, "(mpi, 4 ranks on 2 pretend machines");
    cr_assert(cli_same_file(forked, other), "auto on 2 machines wrote other bytes:\n%s", r.out);
    int k = job_argv(argv, job, other);
    argv[k++] = "--backend";
    argv[k++] = "hier";
    argv[k] = NULL;
    mpi_t_run(&r, &j);
    cr_assert_neq(r.code, 0, "--backend hier ran:\n%s", r.out);
    cr_assert(strstr(r.out, "--backend hier") && strstr(r.out, "use --backend mpi") &&
              !strstr(r.out, "MPI job aborted"), "--backend hier: not refused up front:\n%s",
              r.out);
}

/* The memory levers (tests/test_cli_levers_tp.c) under the launchers: the
 * found-inf flag and the norm over the job's communicator (MPI's with
 * --backend mpi), checkpointing's recomputed collectives over the
 * group's. */
Test(tp_mpi, the_levers_write_the_forked_runs_checkpoint)
{
    MPI_T_NEED();
    static const char *const mesh[] = {"--mode", "tp", "--device", "cpu:4", "--mesh",
                                       "dp=2,tp=2", MLP, "--precision", "fp16",
                                       "--clip-grad-norm", "0.05", "--checkpoint-activations",
                                       NULL};
    same_everywhere(mesh, "dp=2,tp=2 fp16 clipped checkpointed",
                    "4 MPI ranks on cpu:4, tensor parallel over 2 ranks", NULL, 0);
    static const char *const zero[] = {"--mode", "tp", "--device", "cpu:4", "--mesh",
                                       "dp=2,tp=2", "--sharding", "optimizer", MLP,
                                       "--precision", "bf16", "--clip-grad-norm", "0.05", NULL};
    same_everywhere(zero, "dp=2,tp=2 ZeRO-1 bf16 clipped",
                    "4 MPI ranks on cpu:4, tensor parallel over 2", NULL, 0);
}
