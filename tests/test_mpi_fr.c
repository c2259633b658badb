/* tests/test_mpi_fr.c: the flight recorder and `tandem doctor` for the
 * ranks of an MPI job (`mpirun ... tandem train --mode ddp --backend
 * mpi|hier`, MPI over TCP on loopback, hier on pretend machines): the
 * rank's record (fr_rank_<R>.json) is the training communicator's, not
 * the job's control one; a killed rank and a stopped rank each leave one
 * dump per survivor (MPI's abort dumps, and so does mpirun's SIGTERM to
 * the others) and the doctor names the job rank at fault, the collective
 * and the step; hier's messages name job ranks; a stopped rank under
 * --backend mpi is named by the job's heartbeats within seconds. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/json.h"
#include "mpi/job.h"
#include "mpi/mpi_weak.h"
#include "tests/cli_util.h"
#include "tests/mpi_test_util.h"
#include "tests/timeout_util.h"

static cli_result res;

/* A worker (an MPI rank of this binary): hier over the job; rank 1 is
 * busy (alive, its heartbeats going) for 60 s before its second
 * all_reduce, so that its peer across the machines waits for it in the
 * network part until the collective timeout. */
static int w_cross_late(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    tdm_mpi_job *job = NULL;
    tdm_comm *comm = NULL;
    tdm_status st = tdm_mpi_job_init(&job, NULL);
    if (!st) st = tdm_mpi_job_comm(job, TDM_MPI_BACKEND_HIER, NULL, &comm);
    if (st) {
        fprintf(stderr, "set-up: %s\n", tdm_error_message());
        return 1;
    }
    int r = tdm_comm_rank(comm);
    static float v[1000];
    for (int i = 0; i < 3; i++) {
        if (i == 1 && r == 1) sleep(60);
        if (tdm_comm_all_reduce(comm, v, v, 1000, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM)) {
            char why[1200];
            snprintf(why, sizeof why, "rank %d: %s", r, tdm_error_message());
            tdm_mpi_abort(why);
        }
    }
    tdm_comm_free(comm);
    tdm_mpi_job_free(job);
    return 0;
}

static const mpi_t_worker mf_workers[] = {{"cross_late", w_cross_late}};
MPI_T_WORKERS(mf_workers)

#define MF_TRAIN "train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "1024", \
                 "--batch", "64", "--model", "mlp:784-32-10", "--no-eval", "--quiet", "--epochs", \
                 "1"

static void mf_dir(char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/tdm_mpi_fr_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void mf_rm(const char *dir)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* dir/fr_rank_<r>.json parsed, or NULL when absent. */
static tdm_json *mf_load(const char *dir, int r)
{
    char path[256];
    snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, r);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    static char text[4 << 20];
    size_t n = fread(text, 1, sizeof text, f);
    fclose(f);
    tdm_json *doc = NULL;
    cr_assert_eq(tdm_json_parse(&doc, text, n), TDM_STATUS_OK, "%s does not parse", path);
    return doc;
}

/* How many of doc's entries carry a label starting with prefix. */
static int mf_labelled(const tdm_json *doc, const char *prefix)
{
    const tdm_json *e = tdm_json_get(doc, "entries");
    int n = 0;
    for (int i = 0; e && e->type == TDM_JSON_ARRAY && i < e->n; i++) {
        const tdm_json *l = tdm_json_get(&e->items[i], "label");
        n += l && l->type == TDM_JSON_STRING && !strncmp(l->str, prefix, strlen(prefix));
    }
    return n;
}

static const char *mf_str(const tdm_json *doc, const char *k)
{
    const tdm_json *v = tdm_json_get(doc, k);
    return v && v->type == TDM_JSON_STRING ? v->str : "";
}

/* A good run's end-of-run dumps: fr_rank_<R>.json of every rank is the
 * training communicator's (backend b, DDP's labelled collectives), and
 * the doctor reads it (it read the job's control communicator's: backend
 * mpi, 0 entries, "OK: 2 rank(s) agree on 0 collective(s)"). */
static void mf_good_run(const char *backend, int np, const char *pretend)
{
    char dir[64], fr_env[128], pr_env[64];
    mf_dir(dir, sizeof dir);
    snprintf(fr_env, sizeof fr_env, "TANDEM_FR_DUMP=%s", dir);
    snprintf(pr_env, sizeof pr_env, "TANDEM_PRETEND_MACHINES=%s", pretend ? pretend : "");
    const char *env[] = {fr_env, pretend ? pr_env : NULL, NULL};
    const char *args[] = {MF_TRAIN, "--backend", backend, NULL};
    mpi_t_job j = {.np = np, .exe = cli_bin(), .args = args, .env = env, .tcp = 1,
                   .timeout_s = 150};
    mpi_t_run(&res, &j);
    expect(&res, 0, NULL);
    for (int r = 0; r < np; r++) {
        tdm_json *doc = mf_load(dir, r);
        cr_assert_not_null(doc, "--backend %s: rank %d left no fr_rank_%d.json", backend, r, r);
        cr_expect_str_eq(mf_str(doc, "backend"), backend);
        cr_expect(mf_labelled(doc, "ddp bucket") > 0, "--backend %s: rank %d's record has no DDP "
                  "bucket (the control communicator's?)", backend, r);
        cr_expect_eq(strlen(mf_str(doc, "job")), 16, "no job id");
        tdm_json_free(doc);
    }
    CLI(&res, "doctor", dir);
    expect(&res, 0, "verdict: OK: ");
    cr_expect(!strstr(res.out, "agree on 0 collective"), "%s", res.out);
    mf_rm(dir);
}

Test(mpi_fr, the_training_communicators_record_is_the_ranks_mpi, .timeout = 200)
{
    MPI_T_NEED();
    mf_good_run("mpi", 2, NULL);
}

Test(mpi_fr, the_training_communicators_record_is_the_ranks_hier, .timeout = 200)
{
    MPI_T_NEED();
    mf_good_run("hier", 4, "2");
}

/* A faulty run (TANDEM_DDP_TEST_KILL=fault): every rank but `faulty`
 * leaves its dump with DDP's labelled collectives; r gets the doctor's
 * output. extra: one more "NAME=value" (or NULL). */
static void mf_fault_run(cli_result *r, const char *backend, int np, const char *pretend,
                         const char *fault, int faulty, const char *extra)
{
    char dir[64], fr_env[128], pr_env[64], kill_env[64];
    mf_dir(dir, sizeof dir);
    snprintf(fr_env, sizeof fr_env, "TANDEM_FR_DUMP=%s", dir);
    snprintf(kill_env, sizeof kill_env, "TANDEM_DDP_TEST_KILL=%s", fault);
    snprintf(pr_env, sizeof pr_env, "TANDEM_PRETEND_MACHINES=%s", pretend ? pretend : "");
    const char *env[8] = {fr_env, kill_env, "TANDEM_FR_DUMP_ON=failure"};
    int n = 3;
    if (extra) env[n++] = extra;
    if (pretend) env[n++] = pr_env;
    env[n] = NULL;
    const char *args[] = {MF_TRAIN, "--backend", backend, NULL};
    mpi_t_job j = {.np = np, .exe = cli_bin(), .args = args, .env = env, .tcp = 1,
                   .timeout_s = 120};
    mpi_t_run(&res, &j);
    cr_assert_neq(res.code, 0, "the fault went unnoticed:\n%s", res.out);
    for (int q = 0; q < np; q++) {
        if (q == faulty) continue;
        tdm_json *doc = mf_load(dir, q);
        cr_assert_not_null(doc, "--backend %s, fault %s: rank %d left no dump; mpirun said:\n%s",
                           backend, fault, q, res.out);
        cr_expect(mf_labelled(doc, "ddp bucket") > 0, "--backend %s: rank %d's dump has no DDP "
                  "bucket", backend, q);
        tdm_json_free(doc);
    }
    CLI(r, "doctor", dir);
    mf_rm(dir);
}

/* A killed rank under --backend mpi: MPI's abort (an error, a timeout)
 * and mpirun's SIGTERM to the survivors now dump; the doctor names the
 * dead rank, the collective and the step (the directory was empty: "no
 * flight-recorder dump"). */
Test(mpi_fr, a_killed_rank_leaves_a_dump_per_survivor_mpi, .timeout = 200)
{
    MPI_T_NEED();
    cli_result r;
    mf_fault_run(&r, "mpi", 2, NULL, "1:3", 1, NULL);
    expect(&r, 4, "verdict: DIED: rank 1 ");
    expect(&r, 4, "the others waited in all_reduce(float32, sum, count=");
    expect(&r, 4, "'ddp bucket ");
    expect(&r, 4, ": rank 1 (a rank without a dump counts as not entered) (rank 0 did)");
    expect(&r, 4, "last completed step: 2 (every rank with a dump)");
}

/* A stopped rank found by the collective timeout (4 s; the job's
 * heartbeats off): the rank that timed out dumps before MPI_Abort. */
Test(mpi_fr, a_timed_out_wait_dumps_before_the_abort_mpi, .timeout = 200)
{
    MPI_T_NEED();
    cli_result r;
    char tmo[64];
    snprintf(tmo, sizeof tmo, "TANDEM_TIMEOUT=%d", 4 * tu_timeout_scale());   /* seconds */
    setenv("TANDEM_MPI_STALL_MS", "0", 1);   /* mpirun passes it on */
    mf_fault_run(&r, "mpi", 2, NULL, "1:3:STOP", 1, tmo);
    expect(&r, 5, "verdict: STALLED: ");
    expect(&r, 5, "did not complete within ");
}

/* hier on two pretend machines of two ranks: job rank 3 is local rank 1
 * of machine 1. Its machine's shm part names it by the job's rank, and
 * so do the doctor and every line (they said "rank 1 (pid ...) is
 * stopped ... (shm's ranks 0..1 on this machine are the job's ranks 2,
 * 3)", and the doctor blamed rank 1, a healthy rank of machine 0). */
Test(mpi_fr, hier_names_the_jobs_rank_stopped, .timeout = 200)
{
    MPI_T_NEED();
    cli_result r;
    char stall[32];
    snprintf(stall, sizeof stall, "%d", tu_scaled_ms(1500));
    setenv("TANDEM_SHM_STALL_MS", stall, 1);   /* mpirun passes it on */
    mf_fault_run(&r, "hier", 4, "2", "3:3:STOP", 3, NULL);
    cr_expect(strstr(res.out, "rank 3 (pid ") && strstr(res.out, "is stopped"), "%s", res.out);
    cr_expect(!strstr(res.out, "rank 1 (pid ") && !strstr(res.out, "shm's ranks"), "%s",
              res.out);
    expect(&r, 5, "verdict: STALLED: rank 3 is stopped (process state T: SIGSTOP or job "
                  "control); the others waited in ");
    expect(&r, 5, "'ddp bucket ");
    expect(&r, 5, "last completed step: 2");
}

Test(mpi_fr, hier_names_the_jobs_rank_killed, .timeout = 200)
{
    MPI_T_NEED();
    cli_result r;
    mf_fault_run(&r, "hier", 4, "2", "3:3", 3, NULL);
    expect(&r, 4, "verdict: DIED: rank 3 ");
    expect(&r, 4, "the others waited in all_reduce(float32, sum, count=");
    expect(&r, 4, "last completed step: 2");
}

/* A stopped rank under --backend mpi, with the default 300 s collective
 * timeout: the job's heartbeats name it within seconds (it was found
 * after 300 s, "a peer died, stalled or issued a different call", without
 * its name; mpirun's 60 s bound here would end that first), and the
 * doctor says which rank, where and after which step. */
Test(mpi_fr, a_stopped_rank_is_named_by_the_jobs_heartbeats_mpi, .timeout = 200)
{
    MPI_T_NEED();
    cli_result r;
    char stall[64];
    tu_scaled_env(stall, sizeof stall, "TANDEM_MPI_STALL_MS", 3000);
    char dir[64], fr_env[128];
    mf_dir(dir, sizeof dir);
    snprintf(fr_env, sizeof fr_env, "TANDEM_FR_DUMP=%s", dir);
    const char *env[] = {fr_env, "TANDEM_DDP_TEST_KILL=1:3:STOP", "TANDEM_FR_DUMP_ON=failure",
                         stall, NULL};
    const char *args[] = {MF_TRAIN, "--backend", "mpi", NULL};
    mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .env = env, .tcp = 1,
                   .timeout_s = 60};
    mpi_t_run(&res, &j);
    cr_assert_neq(res.code, 0, "%s", res.out);
    cr_expect(strstr(res.out, "rank 1 (pid ") &&
              strstr(res.out, "is stopped (process state T: SIGSTOP or job control): no "
                              "heartbeat for "), "%s", res.out);
    tdm_json *doc = mf_load(dir, 0);
    cr_assert_not_null(doc, "rank 0 left no dump:\n%s", res.out);
    tdm_json_free(doc);
    CLI(&r, "doctor", dir);
    expect(&r, 5, "verdict: STALLED: rank 1 is stopped (process state T: SIGSTOP or job "
                  "control); the others waited in all_reduce(float32, sum, count=");
    expect(&r, 5, "'ddp bucket ");
    expect(&r, 5, "last completed step: 2");
    mf_rm(dir);
}

/* hier's network part times out waiting for a busy rank on the other
 * machine: its message names the job's rank ("on rank 3 of 4"), not its
 * own in the part (it said "on rank 1 of 2"). */
Test(mpi_fr, hier_network_part_says_the_jobs_rank, .timeout = 200)
{
    MPI_T_NEED();
    char tmo[64];
    const char *env[] = {tu_scaled_env(tmo, sizeof tmo, "TANDEM_MPI_TIMEOUT_MS", 3000),
                         "TANDEM_PRETEND_MACHINES=2", NULL};
    mpi_t_job j = {.np = 4, .worker = "cross_late", .env = env, .tcp = 1, .timeout_s = 90};
    mpi_t_run(&res, &j);
    cr_assert_neq(res.code, 0, "%s", res.out);
    cr_expect(strstr(res.out, "hier (between machines): all_reduce #"), "%s", res.out);
    cr_expect(strstr(res.out, " of 4 did not complete within"), "%s", res.out);
    cr_expect(!strstr(res.out, " of 2 did not complete within"), "%s", res.out);
}
