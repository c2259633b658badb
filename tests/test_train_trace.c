/* tests/test_train_trace.c: `tandem train --trace FILE` (tools/train_trace.h).
 * In every mode the file parses as JSON, names the run, has one track per
 * process or rank, each with one "step N" slice per optimizer step (N
 * from 1, in order, not overlapping), the phases the mode measures inside
 * their step, and each epoch's evaluation; DDP's tracks show the exposed
 * all-reduce wait in every step, FSDP's their phases (its exposed waits
 * may be 0, hidden behind compute: no slice then). Under mpirun on
 * pretend machines the file says each rank has its own clock. Bad uses
 * fail before any training: --trace with --uneven, and a path that
 * cannot take a file. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/json.h"
#include "tests/cli_util.h"
#include "tests/mpi_test_util.h"

static char g_dir[] = "/tmp/tdm_train_trace_XXXXXX";

static void setup(void) { cr_assert_not_null(mkdtemp(g_dir)); }
static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    cr_expect_eq(system(cmd), 0);
}

TestSuite(train_trace, .init = setup, .fini = teardown);

static tdm_json *trace_load(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s is missing", path);
    static char buf[1 << 22];
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    tdm_json *root = NULL;
    cr_assert_eq(tdm_json_parse_reals(&root, buf, len), TDM_STATUS_OK, "%s", tdm_error_message());
    return root;
}

static double num(const tdm_json *o, const char *key)
{
    const tdm_json *v = tdm_json_get(o, key);
    cr_assert(v && (v->type == TDM_JSON_REAL || v->type == TDM_JSON_INT), "no number '%s'", key);
    return v->d;
}

/* Checks the trace of a run of `steps` optimizer steps and `epochs`
 * evaluated epochs on `tracks` tracks; phase: a phase every step of every
 * track must have (NULL: none). */
static void trace_check(const char *path, const char *process, int tracks, int steps,
                        int epochs, const char *phase)
{
    tdm_json *root = trace_load(path);
    const tdm_json *ev = tdm_json_get(root, "traceEvents");
    cr_assert(ev && ev->type == TDM_JSON_ARRAY);
    int named = 0, seen_tracks = 0;
    for (int tid = 0; tid < tracks; tid++) {
        int n_steps = 0, n_eval = 0, n_phase = 0;
        double step_lo = -1, step_hi = -1, last_end = -1;
        for (int i = 0; i < ev->n; i++) {
            const tdm_json *e = &ev->items[i];
            const char *ph = tdm_json_get(e, "ph")->str;
            const tdm_json *t = tdm_json_get(e, "tid");
            const char *name = tdm_json_get(e, "name")->str;
            if (!strcmp(ph, "M")) {
                if (!t && !strcmp(name, "process_name") && tid == 0) {
                    named = 1;
                    cr_expect(strstr(tdm_json_get(tdm_json_get(e, "args"), "name")->str,
                                     process), "process name lacks '%s'", process);
                }
                if (t && t->i == tid) seen_tracks++;
                continue;
            }
            if (!t || t->i != tid) continue;
            double ts = num(e, "ts"), dur = num(e, "dur");
            cr_expect(ts >= 0 && dur >= 0, "%s: ts %g dur %g", name, ts, dur);
            const char *cat = tdm_json_get(e, "cat")->str;
            if (!strcmp(cat, "step")) {
                n_steps++;
                char want[32];
                snprintf(want, sizeof want, "step %d", n_steps);
                cr_expect_str_eq(name, want, "track %d's steps out of order", tid);
                cr_expect(ts >= last_end - 1e-3, "track %d: %s starts before the last ended",
                          tid, name);
                step_lo = ts;
                step_hi = ts + dur;
                last_end = step_hi;
            } else if (!strcmp(cat, "phase")) {
                cr_expect(ts >= step_lo - 1e-3 && ts + dur <= step_hi + 1e-3,
                          "track %d: phase %s [%g, %g] outside its step [%g, %g]", tid, name, ts,
                          ts + dur, step_lo, step_hi);
                if (phase && !strcmp(name, phase)) n_phase++;
            } else if (strstr(name, "evaluation")) {
                n_eval++;
            }
        }
        cr_expect_eq(n_steps, steps, "track %d: %d steps, expected %d", tid, n_steps, steps);
        cr_expect_eq(n_eval, epochs, "track %d: %d evaluations, expected %d", tid, n_eval,
                     epochs);
        if (phase)
            cr_expect_eq(n_phase, steps, "track %d: '%s' in %d of %d steps", tid, phase, n_phase,
                         steps);
    }
    cr_expect(named, "no process_name");
    cr_expect_eq(seen_tracks, tracks);
    tdm_json_free(root);
}

/* otherData.clock's words */
static void trace_clock(const char *path, const char *want)
{
    tdm_json *root = trace_load(path);
    const tdm_json *o = tdm_json_get(root, "otherData");
    const tdm_json *c = o ? tdm_json_get(o, "clock") : NULL;
    cr_assert(c && c->type == TDM_JSON_STRING, "no otherData.clock");
    cr_expect(strstr(c->str, want), "clock '%s' lacks '%s'", c->str, want);
    tdm_json_free(root);
}

static void trace_run(const char *mode, const char *device, const char *path)
{
    cli_result r;
    CLI(&r, "train", "--mode", mode, "--device", device, "--data", "synthetic",
        "--synthetic-size", "600", "--batch", "100", "--epochs", "2", "--max-steps", "3",
        "--trace", path);
    expect(&r, 0, "trace: ");
    cr_expect(strstr(r.out, path), "the trace line does not name %s:\n%s", path, r.out);
}

Test(train_trace, single_and_dp, .timeout = 120)
{
    char path[96];
    snprintf(path, sizeof path, "%s/single.json", g_dir);
    trace_run("single", "cpu", path);
    trace_check(path, "--mode single", 1, 6, 2, "backward");
    snprintf(path, sizeof path, "%s/dp.json", g_dir);
    trace_run("dp", "cpu:2", path);
    trace_check(path, "--mode dp", 1, 6, 2, "backward");
}

Test(train_trace, ddp_and_fsdp_ranks, .timeout = 240)
{
    char path[96];
    snprintf(path, sizeof path, "%s/ddp.json", g_dir);
    trace_run("ddp", "cpu:2", path);
    trace_check(path, "--mode ddp, 2 ranks", 2, 6, 2, "all-reduce wait");
    trace_clock(path, "one for every rank (one machine)");
    snprintf(path, sizeof path, "%s/fsdp.json", g_dir);
    trace_run("fsdp", "cpu:2", path);
    trace_check(path, "--mode fsdp, 2 ranks", 2, 6, 2, "forward");
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

/* Ranks on two pretend machines under mpirun: their clocks are taken to
 * differ, each track counts from the start's barrier, and the file says
 * so. */
Test(train_trace, ranks_on_several_machines_keep_their_own_clocks, .timeout = 240)
{
    MPI_T_NEED();
    char path[96];
    snprintf(path, sizeof path, "%s/mpi.json", g_dir);
    const char *args[] = {"train", "--mode", "ddp", "--device", "cpu:2", "--backend", "mpi",
                          "--data", "synthetic", "--synthetic-size", "600", "--batch", "100",
                          "--epochs", "1", "--max-steps", "2", "--trace", path, NULL};
    const char *env[] = {"TANDEM_PRETEND_MACHINES=2:shm", NULL};
    mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .env = env, .timeout_s = 180};
    static cli_result r;
    mpi_t_run(&r, &j);
    expect(&r, 0, "trace: ");
    trace_check(path, "--mode ddp, 2 ranks", 2, 2, 1, "all-reduce wait");
    trace_clock(path, "each rank's own CLOCK_MONOTONIC (the ranks are on several machines)");
}

Test(train_trace, pipeline_ranks_have_steps, .timeout = 240)
{
    char path[96];
    snprintf(path, sizeof path, "%s/pp.json", g_dir);
    trace_run("pp", "cpu:2", path);
    trace_check(path, "--mode pp, 2 ranks", 2, 6, 2, NULL);
}

Test(train_trace, bad_uses_fail_before_training, .timeout = 60)
{
    cli_result r;
    char path[96];
    snprintf(path, sizeof path, "%s/u.json", g_dir);
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic", "--uneven",
        "--trace", path);
    expect(&r, 2, "--trace do not apply to --uneven");
    cr_expect(access(path, F_OK) != 0, "a trace was written");
    /* a directory where the file should go */
    CLI(&r, "train", "--data", "synthetic", "--trace", g_dir);
    expect(&r, 2, "--trace:");
    cr_expect(!strstr(r.out, "epoch 1/"), "trained before refusing:\n%s", r.out);
}
