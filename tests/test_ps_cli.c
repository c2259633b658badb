/* tests/test_ps_cli.c: `tandem train --mode ps` end to end (a small
 * MLP, a few steps):
 *  - sync with 2 workers writes the very checkpoint --mode ddp on 2
 *    ranks writes, byte for byte (the sum of two gradients is the same
 *    in any order), with 1 and 2 servers, and bounded:0 too;
 *  - sync with 3 workers (4 and 5 ranks) against ddp on 3 ranks: every
 *    parameter within compare's last-step bound (|a-b| <= 1e-4 +
 *    1e-3|b|): the server sums in worker order, the shm all-reduce in its
 *    own, so the bits may differ;
 *  - async and bounded:2 train and save a checkpoint;
 *  - a worker SIGKILLed in async: the job finishes (exit 0), names the
 *    worker, and its checkpoint loads; in sync the job stops (exit 1);
 *    a killed server stops the job naming it; async with no worker
 *    finished, or with a worker that failed (a NaN loss), exits 1;
 *  - a failed job's verdict names the RPC call left waiting (a SIGSTOPped
 *    server) and the rank killed with the last of its calls served (a
 *    SIGKILLed worker), in tandem train's summary and `tandem doctor`;
 *  - bad options get a one-line error and exit 2. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "tests/cli_util.h"

static char g_dir[64];

static char g_fr[96];

/* The flight-recorder dumps of failed jobs go to g_dir/fr (removed with
 * it), not to a $TMPDIR/tandem-fr-* directory left behind. */
static void setup_dir(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/tandem-ps-cli-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    snprintf(g_fr, sizeof g_fr, "%s/fr", g_dir);
    cr_assert_eq(mkdir(g_fr, 0700), 0);
    setenv("TANDEM_FR_DUMP", g_fr, 1);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
}

static void teardown_dir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
    unsetenv("TANDEM_FR_DUMP");
    unsetenv("TANDEM_FR_DUMP_ON");
}

static const char *path(char *buf, const char *name)
{
    snprintf(buf, 128, "%s/%s", g_dir, name);
    return buf;
}

#define SMALL "--model", "mlp:784-32-10", "--epochs", "2", "--max-steps", "12", "--batch", "48", \
              "--data", "synthetic", "--synthetic-size", "2000", "--no-eval"

static long file_size(const char *p)
{
    FILE *f = fopen(p, "rb");
    cr_assert_not_null(f, "%s", p);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

static int same_bytes(const char *a, const char *b)
{
    long n = file_size(a);
    if (n != file_size(b)) return 0;
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = 1;
    for (long i = 0; i < n && same; i++) same = fgetc(fa) == fgetc(fb);
    fclose(fa);
    fclose(fb);
    return same;
}

Test(ps_cli, sync_with_two_workers_is_ddp_byte_for_byte, .init = setup_dir, .fini = teardown_dir,
     .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    char ddp[128], ps[128];
    CLI(r, "train", "--mode", "ddp", "--device", "cpu:2", SMALL, "--save", path(ddp, "ddp.st"));
    expect(r, 0, "saved");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", SMALL, "--save", path(ps, "ps1.st"));
    expect(r, 0, "1 server, 2 workers");
    cr_assert(same_bytes(ddp, ps), "ps (1 server) and ddp checkpoints differ");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", "--servers", "2", SMALL, "--save",
        path(ps, "ps2.st"));
    expect(r, 0, "2 servers, 2 workers");
    cr_assert(same_bytes(ddp, ps), "ps (2 servers) and ddp checkpoints differ");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--ps-sync", "bounded:0", SMALL, "--save",
        path(ps, "psb0.st"));
    expect(r, 0, "bounded:0");
    cr_assert(same_bytes(ddp, ps), "ps bounded:0 and ddp checkpoints differ");
    cr_assert_eq(cli_shm_entries(), 0);
    free(r);
}

/* Every parameter of a within |a-b| <= atol + rtol|b| of b's. */
static void expect_close(const char *a, const char *b, double atol, double rtol)
{
    tdm_st_file *fa = NULL, *fb = NULL;
    cr_assert_eq(tdm_st_load(&fa, a), 0, "%s", tdm_error_message());
    cr_assert_eq(tdm_st_load(&fb, b), 0, "%s", tdm_error_message());
    int checked = 0;
    for (int i = 0; i < tdm_st_count(fb); i++) {
        const tdm_st_tensor *tb = tdm_st_get(fb, i);
        if (strncmp(tb->name, "optim", 5) == 0 || tb->dtype != TDM_ST_F32) continue;
        const tdm_st_tensor *ta = tdm_st_find(fa, tb->name);
        cr_assert_not_null(ta, "%s lacks %s", a, tb->name);
        cr_assert_eq(ta->nbytes, tb->nbytes);
        for (size_t k = 0; k < tb->nbytes / 4; k++) {
            float x, y;
            memcpy(&x, (const char *)ta->data + 4 * k, 4);
            memcpy(&y, (const char *)tb->data + 4 * k, 4);
            cr_assert(fabs((double)x - y) <= atol + rtol * fabs((double)y), "%s[%zu]: %.9g vs %.9g", tb->name,
                      k, x, y);
        }
        checked++;
    }
    cr_assert_gt(checked, 0);
    tdm_st_free(fa);
    tdm_st_free(fb);
}

Test(ps_cli, sync_with_three_workers_is_ddp_within_bounds, .init = setup_dir, .fini = teardown_dir,
     .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    char ddp[128], ps[128];
    CLI(r, "train", "--mode", "ddp", "--device", "cpu:3", SMALL, "--save", path(ddp, "ddp.st"));
    expect(r, 0, "saved");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", SMALL, "--save", path(ps, "ps1.st"));
    expect(r, 0, "1 server, 3 workers");
    expect_close(ps, ddp, 1e-4, 1e-3);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:5", "--servers", "2", "--ps-transport", "tcp", SMALL,
        "--save", path(ps, "ps2.st"));
    expect(r, 0, "rpc over tcp");
    expect_close(ps, ddp, 1e-4, 1e-3);
    free(r);
}

Test(ps_cli, async_and_bounded_train_and_save, .init = setup_dir, .fini = teardown_dir, .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    char ck[128];
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", "--ps-sync", "async", SMALL, "--save",
        path(ck, "a.st"));
    expect(r, 0, "staleness");
    cr_assert(strstr(r->out, "async"), "%s", r->out);
    CLI(r, "eval", "--resume", ck, "--data", "synthetic", "--synthetic-size", "2000");
    expect(r, 0, NULL);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", "--servers", "2", "--ps-sync", "bounded:2", SMALL);
    expect(r, 0, "bounded:2");
    /* no staleness above the bound in either server's histogram */
    cr_assert_null(strstr(r->out, " 3:"), "%s", r->out);
    free(r);
}

Test(ps_cli, a_killed_worker_async_goes_on_sync_stops, .init = setup_dir, .fini = teardown_dir,
     .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    char ck[128];
    setenv("TANDEM_PS_TEST_KILL", "worker:1:5", 1);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", "--ps-sync", "async", SMALL, "--save",
        path(ck, "k.st"));
    expect(r, 0, "worker 1 (rank 2)");
    cr_assert(strstr(r->out, "async training finished with the other workers"), "%s", r->out);
    cr_assert(strstr(r->out, "saved"), "%s", r->out);
    CLI(r, "eval", "--resume", ck, "--data", "synthetic", "--synthetic-size", "2000");
    expect(r, 0, NULL);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", SMALL);
    expect(r, 1, "rank 2");
    setenv("TANDEM_PS_TEST_KILL", "server:1:4", 1);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", "--servers", "2", "--ps-sync", "async", SMALL);
    expect(r, 1, "rank 1");
    cr_assert(strstr(r->out, "server 1"), "%s", r->out);
    unsetenv("TANDEM_PS_TEST_KILL");
    cr_assert_eq(cli_shm_entries(), 0);
    free(r);
}

/* A small gpt on the default text, a few steps (adamw, gpt's default). */
#define GPT "--model", "gpt:1-16-2-16", "--epochs", "1", "--max-steps", "6", "--batch", "12", "--seed", "3"

/* --model gpt: each worker draws its windows [w*B/W, (w+1)*B/W) of the
 * global batch as a DDP rank does; with 2 workers the very checkpoint of
 * ddp on 2 ranks (1 and 2 servers), with 3 and 4 workers within
 * compare's bound of ddp on as many ranks (the server sums in worker
 * order, the shm all-reduce in its own). N = 3..5, 1 and 2 servers. */
Test(ps_cli, gpt_sync_is_ddp, .init = setup_dir, .fini = teardown_dir, .timeout = 300)
{
    cli_result *r = malloc(sizeof *r);
    char ddp[128], ps[128];
    CLI(r, "train", "--mode", "ddp", "--device", "cpu:2", GPT, "--save", path(ddp, "ddp2.st"));
    expect(r, 0, "saved");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", GPT, "--save", path(ps, "ps3.st"));
    expect(r, 0, "gpt, --mode ps: 1 server, 2 workers");
    cr_assert(strstr(r->out, "validation loss"), "%s", r->out);
    cr_assert(same_bytes(ddp, ps), "gpt: ps (1 server, 2 workers) and ddp checkpoints differ");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", "--servers", "2", GPT, "--save", path(ps, "ps4s2.st"));
    expect(r, 0, "2 servers, 2 workers");
    cr_assert(same_bytes(ddp, ps), "gpt: ps (2 servers, 2 workers) and ddp checkpoints differ");
    CLI(r, "train", "--mode", "ddp", "--device", "cpu:3", GPT, "--save", path(ddp, "ddp3.st"));
    expect(r, 0, "saved");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", GPT, "--save", path(ps, "ps4.st"));
    expect(r, 0, "1 server, 3 workers");
    expect_close(ps, ddp, 1e-4, 1e-3);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:5", "--servers", "2", GPT, "--save", path(ps, "ps5s2.st"));
    expect(r, 0, "2 servers, 3 workers");
    expect_close(ps, ddp, 1e-4, 1e-3);
    CLI(r, "train", "--mode", "ddp", "--device", "cpu:4", GPT, "--save", path(ddp, "ddp4.st"));
    expect(r, 0, "saved");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:5", GPT, "--save", path(ps, "ps5.st"));
    expect(r, 0, "1 server, 4 workers");
    expect_close(ps, ddp, 1e-4, 1e-3);
    cr_assert_eq(cli_shm_entries(), 0);
    free(r);
}

/* async: a worker that fails (not killed) stops the job with its own
 * error, and a job in which no worker finished fails */
Test(ps_cli, async_fails_when_no_worker_finished_or_one_failed, .init = setup_dir, .fini = teardown_dir,
     .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    setenv("TANDEM_PS_TEST_KILL", "worker:0:1", 1);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:2", "--ps-sync", "async", SMALL);
    unsetenv("TANDEM_PS_TEST_KILL");
    expect(r, 1, "no worker finished");
    cr_assert(strstr(r->out, "worker 0 (rank 1)"), "%s", r->out);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--ps-sync", "async", "--lr", "1000", SMALL);
    expect(r, 1, "training diverged");
    cr_assert(strstr(r->out, "worker"), "%s", r->out);
    cr_assert_null(strstr(r->out, "async training finished"), "%s", r->out);
    cr_assert_eq(cli_shm_entries(), 0);
    free(r);
}

/* The doctor on RPC calls: a server SIGSTOPped after 3 updates leaves
 * the workers' calls unanswered until their --timeout; a worker
 * SIGKILLed before its step 5 is the root cause, named with its last
 * call a server served. Each verdict comes in tandem train's summary
 * and from `tandem doctor` on the dumps. */
Test(ps_cli, doctor_names_the_rpc_call_and_the_rank, .init = setup_dir, .fini = teardown_dir, .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    char cmd[256];
    setenv("TANDEM_PS_TEST_KILL", "server:0:3:STOP", 1);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--timeout", "5", SMALL);
    const char *stalled = "for the reply to ps.p";
    expect(r, 1, "tandem train: doctor: STALLED: rank ");
    cr_assert(strstr(r->out, stalled), "%s", r->out);
    cr_assert(strstr(r->out, "from rank 0, which never served it: rank 0 was stopped or frozen"), "%s", r->out);
    CLI(r, "doctor", g_fr);
    expect(r, 5, "verdict: STALLED: rank ");
    cr_assert(strstr(r->out, "from rank 0, which never served it"), "%s", r->out);
    cr_assert(strstr(r->out, "  rpc: rank "), "every call not answered is listed:\n%s", r->out);
    snprintf(cmd, sizeof cmd, "rm -f %s/*", g_fr);
    cr_assert_eq(system(cmd), 0);
    setenv("TANDEM_PS_TEST_KILL", "worker:1:5", 1);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:4", SMALL);
    const char *died = "DIED: rank 2 was killed by signal 9 (Killed); the last of its RPC calls served: ps.p";
    expect(r, 1, died);
    CLI(r, "doctor", g_fr);
    expect(r, 4, died);
    unsetenv("TANDEM_PS_TEST_KILL");
    cr_assert_eq(cli_shm_entries(), 0);
    free(r);
}

Test(ps_cli, bad_options_say_why, .timeout = 60)
{
    cli_result *r = malloc(sizeof *r);
    CLI(r, "train", "--mode", "ps", "--device", "cpu:2", "--servers", "2", SMALL);
    expect(r, 2, "--servers 2 needs at least 3 devices");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--ps-sync", "fast", SMALL);
    expect(r, 2, "expected sync, async or bounded:K");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--ps-transport", "udp", SMALL);
    expect(r, 2, "unknown transport 'udp'");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--ps-sync", "async", "--optim", "adamw", SMALL);
    expect(r, 2, "--optim adamw with --ps-sync async");
    CLI(r, "train", "--mode", "ddp", "--device", "cpu:2", "--servers", "1", SMALL);
    expect(r, 2, "apply to --mode ps");
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--model", "cnn", "--epochs", "1");
    expect(r, 2, "--mode ps trains --model mlp");
    /* a gpt's default optimizer is adamw */
    CLI(r, "train", "--mode", "ps", "--device", "cpu:3", "--model", "gpt", "--ps-sync", "async", "--epochs", "1");
    expect(r, 2, "--optim adamw with --ps-sync async");
    free(r);
}

Test(ps_cli, compare_prints_the_servers_rows_curves_and_sweep, .timeout = 240)
{
    cli_result *r = malloc(sizeof *r);
    CLI(r, "compare", "--modes", "ddp,ps,ps-async", "--device", "cpu:3", "--model", "mlp:784-32-10", "--steps",
        "6", "--batch", "48", "--data", "synthetic");
    expect(r, 0, "ps (sync), 1 server");
    cr_assert(strstr(r->out, "ps-async, 1 server"), "%s", r->out);
    cr_assert(strstr(r->out, "KiB all-reduced per rank per step"), "%s", r->out);
    /* sync: every gradient applied fresh */
    const char *row = strstr(r->out, "ps (sync), 1 server");
    const char *nl = strchr(row, '\n');
    const char *z = strstr(row, " 0:12");
    cr_assert(z && z < nl, "sync row: %.*s", (int)(nl - row), row);
    /* the loss curves: sync's is DDP's (the same batches, DDP's step) */
    const char *c = strstr(r->out, "loss curve (step: ddp / ps (sync), 1 server / ps-async, 1 server):\n");
    cr_assert_not_null(c, "%s", r->out);
    double d1, p1, a1;
    const char *s1 = strstr(c, "    1: ");
    cr_assert(s1 && sscanf(s1, "    1: %lf / %lf / %lf;", &d1, &p1, &a1) == 3, "%s", c);
    cr_assert_eq(d1, p1, "step 1: ddp %.4f, ps %.4f", d1, p1);
    const char *s6 = strstr(c, " 6: ");
    cr_assert(s6 && sscanf(s6, " 6: %lf / %lf / %lf;", &d1, &p1, &a1) == 3, "%s", c);
    cr_assert(fabs(d1 - p1) <= 1e-4, "step 6: ddp %.4f, ps %.4f", d1, p1);
    /* the server sweep: N-1 workers with 1 and 2 servers */
    CLI(r, "compare", "--modes", "ps", "--device", "cpu:3", "--model", "mlp:784-32-10", "--steps", "4", "--batch",
        "48", "--data", "synthetic", "--servers", "1,2");
    expect(r, 0, "server sweep (2 workers");
    cr_assert(strstr(r->out, "ps (sync), 2 servers"), "%s", r->out);
    cr_assert(strstr(r->out, "sweep reading: 1 server moved"), "%s", r->out);
    CLI(r, "compare", "--modes", "ps", "--device", "cpu:3", "--servers", "0,9", "--data", "synthetic");
    expect(r, 2, "--servers '0,9': expected server counts like 1,2");
    CLI(r, "compare", "--modes", "ps", "--device", "cpu:2", "--model", "cnn", "--steps", "2", "--data",
        "synthetic");
    expect(r, 0, "skipped: --mode ps trains --model mlp only");
    free(r);
}
