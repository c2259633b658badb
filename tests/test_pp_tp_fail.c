/* tests/test_pp_tp_fail.c: a rank of a pipeline of tensor-parallel
 * stages (`--mesh pp=S,tp=N`, tools/rank_pptp.c) whose checkpoint
 * gather fails stops every rank at once, naming itself: stage 0's tp
 * peers (which wait for it in the gather over their group) and the later
 * stages (which send to stage 0) leave with its reason, not a timeout of
 * their own, exit 1, nothing left behind. Planted through the test hook
 * TANDEM_TEST_PPTP_GATHER_FAIL=R (rank R's gather fails before it sends
 * anything): in `train --save`, on every rank of pp=2 x tp=2, and in
 * `compare`, which gathers the parameters the same way. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/mpi_test_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

#define HOOK "TANDEM_TEST_PPTP_GATHER_FAIL"
#define MLP "--model", "mlp:20-24-16-12-5"
#define SYN "--data", "synthetic", "--synthetic-size", "200"

static char g_dir[64];

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "pp_tp_fail");
    setenv("TMPDIR", g_dir, 1);   /* the flight-recorder dumps */
}
static void teardown(void)
{
    unsetenv(HOOK);
    unsetenv("TMPDIR");
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

TestSuite(pp_tp_fail, .init = setup, .fini = teardown, .timeout = 240);

/* Every "aborted by [job ]rank N: ..." that carries the hook's message
 * names rank, and at least one does. */
static int aborts_name(const char *out, int rank)
{
    int seen = 0;
    for (const char *p = strstr(out, "aborted by "); p; p = strstr(p + 1, "aborted by ")) {
        const char *q = p + strlen("aborted by ");
        if (!strncmp(q, "job ", 4)) q += 4;
        int n = -1;
        if (sscanf(q, "rank %d: ", &n) != 1) continue;
        const char *eol = strchr(q, '\n'), *next = strstr(q, "aborted by ");
        const char *hook = strstr(q, "test hook");
        if (!hook || (eol && hook > eol) || (next && hook > next)) continue;
        if (n != rank) return 0;
        seen = 1;
    }
    return seen;
}

static void stopped_at_once(const cli_result *r, int rank, int64_t ms, const char *what)
{
    char said[96];
    snprintf(said, sizeof said, "rank %d (", rank);
    cr_assert_eq(r->code, 1, "%s, rank %d: exit %d:\n%s", what, rank, r->code, r->out);
    cr_assert(strstr(r->out, said) && strstr(r->out, "test hook: the pp-tp gather fails"),
              "%s, rank %d: the cause is not named:\n%s", what, rank, r->out);
    cr_assert(aborts_name(r->out, rank), "%s: an abort names another rank than %d, or none "
              "names it:\n%s", what, rank, r->out);
    cr_assert(!strstr(r->out, "did not complete within"), "%s: %s", what, r->out);
    /* a peer left waiting would stop at the collectives' timeout (300 s
     * in train, 60 s in compare) and say "did not complete within"; the
     * bound is well under either unscaled */
    cr_assert_lt(ms, tu_scaled_ms(20000), "%s, rank %d: the run took %lld ms to stop:\n%s",
                 what, rank, (long long)ms, r->out);
}

Test(pp_tp_fail, a_failed_save_gather_stops_every_rank)
{
    static cli_result r;
    char ck[128], rank[8];
    snprintf(ck, sizeof ck, "%s/x.safetensors", g_dir);
    for (int R = 0; R < 4; R++) {
        snprintf(rank, sizeof rank, "%d", R);
        setenv(HOOK, rank, 1);
        int64_t t0 = mpi_t_now_ms();
        CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2", MLP, SYN,
            "--batch", "32", "--epochs", "1", "--max-steps", "2", "--timeout", "300", "--quiet",
            "--save", ck);
        unsetenv(HOOK);
        stopped_at_once(&r, R, mpi_t_now_ms() - t0, "train --save");
        cr_assert_neq(access(ck, F_OK), 0, "rank %d: a checkpoint was written", R);
    }
}

Test(pp_tp_fail, a_failed_parameter_gather_stops_compare)
{
    static cli_result r;
    static const int ranks[] = {1, 3};
    for (int i = 0; i < 2; i++) {
        char rank[8];
        snprintf(rank, sizeof rank, "%d", ranks[i]);
        setenv(HOOK, rank, 1);
        int64_t t0 = mpi_t_now_ms();
        CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2",
            MLP, "--data", "synthetic", "--steps", "3");
        unsetenv(HOOK);
        stopped_at_once(&r, ranks[i], mpi_t_now_ms() - t0, "compare");
    }
}

/* The hook's value is a whole job rank: one it cannot read fails the run
 * saying so, instead of planting the failure on whichever rank atoi
 * makes of it ("1x" was rank 1, "x" rank 0). */
Test(pp_tp_fail, a_malformed_hook_value_is_refused)
{
    static cli_result r;
    static const char *const bad[] = {"1x", "x", "-1", ""};
    for (int i = 0; i < 4; i++) {
        setenv(HOOK, bad[i], 1);
        CLI(&r, "compare", "--modes", "single,pp", "--device", "cpu:4", "--mesh", "pp=2,tp=2",
            MLP, "--data", "synthetic", "--steps", "3");
        unsetenv(HOOK);
        char want[96];
        snprintf(want, sizeof want, "%s='%s': expected a job rank", HOOK, bad[i]);
        cr_assert_eq(r.code, 1, "'%s': exit %d:\n%s", bad[i], r.code, r.out);
        cr_assert(strstr(r.out, want), "'%s': not refused:\n%s", bad[i], r.out);
        cr_assert(!strstr(r.out, "test hook: the pp-tp gather fails"), "'%s': planted:\n%s",
                  bad[i], r.out);
    }
}
