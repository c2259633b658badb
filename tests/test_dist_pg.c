/* tests/test_dist_pg.c: the process group's timeout (PyTorch's
 * init_process_group(timeout=)): parsing, the API value, TANDEM_TIMEOUT
 * and their precedence in tdm_dist_pg_init and tdm_dist_spawn (a rank that
 * waits for a stalled peer fails after exactly that timeout, which the
 * shm communicator's message states), and the --timeout flags of
 * `tandem launch` and `tandem train --mode ddp`, bad values included.
 * Forked ranks bound their run time and leave nothing behind. */
#include <criterion/criterion.h>

#include <signal.h>
#include <sys/mman.h>

#include "dist/pg.h"
#include "dist/spawn.h"
#include "shm/shm_comm.h"
#include "tests/cli_util.h"

Test(dist_pg, timeout_parse_takes_seconds_and_refuses_the_rest)
{
    struct { const char *text; int64_t ms; } good[] = {
        {"600", 600000}, {"2.5", 2500}, {"0.001", 1}, {"604800", 604800000LL}, {"1e2", 100000},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        int64_t ms = -1;
        cr_assert_eq(tdm_dist_timeout_parse("--timeout", good[i].text, &ms), TDM_STATUS_OK, "%s",
                     good[i].text);
        cr_assert_eq(ms, good[i].ms, "'%s': %lld ms", good[i].text, (long long)ms);
    }
    const char *bad[] = {"", "0", "-1", "abc", "5s", "nan", "inf", "1e9", "0.0001", " 5 "};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int64_t ms = 7;
        cr_assert_eq(tdm_dist_timeout_parse("--timeout", bad[i], &ms), TDM_STATUS_INVALID_ARG,
                     "'%s' accepted", bad[i]);
        cr_assert_eq(ms, 7, "'%s' changed the output", bad[i]);
        char want[64];
        snprintf(want, sizeof want, "--timeout '%s'", bad[i]);
        cr_assert(strstr(tdm_error_message(), want) && strstr(tdm_error_message(), "seconds"),
                  "%s", tdm_error_message());
    }
    int64_t ms = 7;
    cr_assert_eq(unsetenv(TDM_DIST_ENV_TIMEOUT), 0);
    cr_assert_eq(tdm_dist_timeout_from_env(&ms), TDM_STATUS_OK);
    cr_assert_eq(ms, 0);
    cr_assert_eq(setenv(TDM_DIST_ENV_TIMEOUT, "12", 1), 0);
    cr_assert_eq(tdm_dist_timeout_from_env(&ms), TDM_STATUS_OK);
    cr_assert_eq(ms, 12000);
    cr_assert_eq(setenv(TDM_DIST_ENV_TIMEOUT, "soon", 1), 0);
    cr_assert_eq(tdm_dist_timeout_from_env(&ms), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "TANDEM_TIMEOUT='soon'"), "%s", tdm_error_message());
}

/* ---- a rank waiting for a stalled peer ---- */

typedef struct pg_out {
    int status[2];
    char err[2][512];
    volatile int done;       /* rank 0 has its result: the stalled rank may go */
} pg_out;

static pg_out *pg_out_new(void)
{
    pg_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    memset(o, 0, sizeof *o);
    return o;
}

/* Rank 1 takes no part in the barrier until rank 0 has given up on it
 * (bounded: 30 s), then leaves without calling it. */
static int stall_or_wait(tdm_comm *comm, pg_out *o)
{
    int rank = tdm_comm_rank(comm);
    if (rank == 1) {
        for (int i = 0; i < 3000 && !o->done; i++) usleep(10000);
        return 0;
    }
    tdm_status st = tdm_comm_barrier(comm);
    o->status[0] = st;
    snprintf(o->err[0], sizeof o->err[0], "%s", st ? tdm_error_message() : "");
    o->done = 1;
    return 0;
}

/* Exec'd ranks' way in, without the exec: the parent creates the group
 * and exports its fd as a launcher does; each child sets RANK and
 * WORLD_SIZE and joins with tdm_dist_pg_init. */
static void run_pg(int64_t api_ms, const char *env, pg_out *o)
{
    tdm_shm_group *g = NULL;
    cr_assert_eq(tdm_shm_group_create(&g, 2, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_shm_group_export_env(g), TDM_STATUS_OK);
    pid_t pid[2];
    for (int r = 0; r < 2; r++) {
        pid[r] = fork();
        cr_assert(pid[r] >= 0);
        if (pid[r] == 0) {
            alarm(60);
            tdm_dist_env_export(r, 2);
            if (env) setenv(TDM_DIST_ENV_TIMEOUT, env, 1);
            else unsetenv(TDM_DIST_ENV_TIMEOUT);
            tdm_comm *comm = NULL;
            tdm_dist_pg_opts po = {.timeout_ms = api_ms};
            tdm_status st = tdm_dist_pg_init(&comm, NULL, &po);
            if (st) {
                o->status[r] = st;
                snprintf(o->err[r], sizeof o->err[r], "%s", tdm_error_message());
                if (r == 0) o->done = 1;
                _exit(1);
            }
            int rc = stall_or_wait(comm, o);
            tdm_comm_free(comm);
            _exit(rc);
        }
        tdm_shm_group_set_pid(g, r, pid[r]);
    }
    for (int r = 0; r < 2; r++) {
        int ws;
        cr_assert_eq(waitpid(pid[r], &ws, 0), pid[r]);
    }
    tdm_shm_group_free(g);
}

Test(dist_pg, pg_init_timeout_from_the_api_then_the_environment, .timeout = 60)
{
    struct { int64_t api_ms; const char *env; const char *want; } cases[] = {
        {1000, NULL, "after 1000 ms"},
        {0, "1.25", "after 1250 ms"},
        {1000, "600", "after 1000 ms"},   /* the API's value wins */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pg_out *o = pg_out_new();
        run_pg(cases[i].api_ms, cases[i].env, o);
        cr_assert_eq(o->status[0], TDM_STATUS_TIMEOUT, "case %zu: %s", i, o->err[0]);
        cr_assert(strstr(o->err[0], cases[i].want) && strstr(o->err[0], "rank 1"),
                  "case %zu: expected '%s' naming rank 1: %s", i, cases[i].want, o->err[0]);
        munmap(o, sizeof *o);
    }
    /* a bad TANDEM_TIMEOUT: every rank refuses to join, naming it */
    pg_out *o = pg_out_new();
    run_pg(0, "ten", o);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(o->status[r], TDM_STATUS_INVALID_ARG, "rank %d: %s", r, o->err[r]);
        cr_assert(strstr(o->err[r], "TANDEM_TIMEOUT='ten'"), "rank %d: %s", r, o->err[r]);
    }
    munmap(o, sizeof *o);
}

static int spawn_rank(tdm_comm *comm, void *arg) { return stall_or_wait(comm, arg); }

Test(dist_pg, spawn_takes_TANDEM_TIMEOUT_when_no_timeout_is_given, .timeout = 60)
{
    pg_out *o = pg_out_new();
    cr_assert_eq(setenv(TDM_DIST_ENV_TIMEOUT, "1.5", 1), 0);
    tdm_dist_spawn_opts so = {.timeout_ms = 30000};
    cr_assert_eq(tdm_dist_spawn(2, spawn_rank, o, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(o->status[0], TDM_STATUS_TIMEOUT, "%s", o->err[0]);
    cr_assert(strstr(o->err[0], "after 1500 ms"), "%s", o->err[0]);
    /* an explicit comm_timeout_ms wins */
    memset(o, 0, sizeof *o);
    so.comm_timeout_ms = 800;
    cr_assert_eq(tdm_dist_spawn(2, spawn_rank, o, &so, NULL), TDM_STATUS_OK);
    cr_assert(strstr(o->err[0], "after 800 ms"), "%s", o->err[0]);
    /* a bad value is refused before any rank starts */
    memset(o, 0, sizeof *o);
    so.comm_timeout_ms = 0;
    cr_assert_eq(setenv(TDM_DIST_ENV_TIMEOUT, "-2", 1), 0);
    cr_assert_eq(tdm_dist_spawn(2, spawn_rank, o, &so, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "TANDEM_TIMEOUT='-2'"), "%s", tdm_error_message());
    cr_assert_eq(o->done, 0, "a rank ran");
    munmap(o, sizeof *o);
}

/* ---- the CLI ---- */

Test(dist_pg, cli_timeout_flags_refuse_bad_values, .timeout = 60)
{
    static cli_result r;
    unsetenv(TDM_DIST_ENV_TIMEOUT);
    const char *bad[] = {"0", "abc", "-5", "1e9"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char want[64];
        snprintf(want, sizeof want, "--timeout '%s': expected a number of seconds", bad[i]);
        CLI(&r, "launch", "-n", "1", "--timeout", bad[i], "--", "true");
        expect(&r, 2, want);
        CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--timeout", bad[i]);
        expect(&r, 2, want);
    }
    cr_assert_eq(setenv(TDM_DIST_ENV_TIMEOUT, "later", 1), 0);
    CLI(&r, "launch", "-n", "1", "--", "true");
    expect(&r, 2, "TANDEM_TIMEOUT='later'");
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2");
    expect(&r, 2, "TANDEM_TIMEOUT='later'");
    /* the flag overrides the environment */
    CLI(&r, "launch", "-n", "1", "--timeout", "2.5", "--", "sh", "-c", "echo T=$TANDEM_TIMEOUT");
    expect(&r, 0, "[rank 0] T=2.5");
    unsetenv(TDM_DIST_ENV_TIMEOUT);
    CLI(&r, "launch", "--help");
    expect(&r, 0, "--timeout SECONDS");
    CLI(&r, "train", "--help");
    expect(&r, 0, "--timeout SECONDS");
}

Test(dist_pg, cli_timeout_reaches_the_ranks, .timeout = 120)
{
    static cli_result r;
    unsetenv(TDM_DIST_ENV_TIMEOUT);
    /* forked ranks: the flag, else 60 s (a run that must succeed: not a
     * bound a loaded machine's set-up could reach, as 2 s could) */
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "512", "--max-steps", "1", "--epochs", "1", "--no-eval",
        "--timeout", "45");
    expect(&r, 0, "timeout 45 s)");
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "512", "--max-steps", "1", "--epochs", "1", "--no-eval");
    expect(&r, 0, "timeout 60 s)");
    /* launched ranks: 300 s, or the launcher's --timeout */
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), "train", "--mode", "ddp", "--device", "cpu",
        "--data", "synthetic", "--synthetic-size", "512", "--max-steps", "1", "--epochs", "1",
        "--no-eval");
    expect(&r, 0, "timeout 300 s)");
    /* end to end: rank 1 never joins; rank 0's first collective gives up
     * after the launcher's 1.5 s, naming it, and the launcher stops it */
    CLI(&r, "launch", "-n", "2", "--timeout", "1.5", "--", "sh", "-c",
        "if [ \"$RANK\" = 1 ]; then exec sleep 30; fi; exec \"$0\" train --mode ddp --device cpu "
        "--data synthetic --synthetic-size 512 --max-steps 1 --epochs 1 --no-eval",
        cli_bin());
    expect(&r, 1, "timed out after 1500 ms");
    cr_assert(strstr(r.out, "waiting for rank 1"), "%s", r.out);
}
