/* tests/test_compare_plot.c: compare --plot's gnuplot script and data say
 * what a reader needs, checked on their text (pixels are hard to test):
 * every loss curve has a positive width (six modes: the 4th and later
 * used to be 0 or negative) and its own dash; each phase its own colour;
 * phases.dat's legend holds only phases some mode has, named as in the
 * text table; throughput and scaling carry min <= median <= max and the
 * ideal line; memory.dat's persistent part is at most its peak. And the
 * report's load warnings and the sharded headline (peak first). */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/device.h"
#include "tests/cli_util.h"

static char *cp_slurp(const char *dir, const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s is missing", path);
    static char bufs[6][1 << 16];
    static int next;
    char *buf = bufs[next++ % 6];
    size_t n = fread(buf, 1, sizeof bufs[0] - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* The script's block that draws `png`: from its `set output` to the next. */
static void cp_block(const char *script, const char *png, char *out, size_t len)
{
    char key[64];
    snprintf(key, sizeof key, "set output '%s'", png);
    const char *a = strstr(script, key);
    cr_assert_not_null(a, "no %s in the script:\n%s", png, script);
    const char *b = strstr(a + 1, "set output");
    size_t n = b ? (size_t)(b - a) : strlen(a);
    snprintf(out, len, "%.*s", (int)n, a);
}

Test(compare_plot, six_modes_every_curve_colour_and_legend_entry_shows, .timeout = 600)
{
    char dir[] = "/tmp/tdm_cplot_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    cli_result r;
    CLI(&r, "compare", "--modes", "single,dp,ddp,fsdp,zero2,zero1", "--data", "synthetic",
        "--model", "mlp:784-64-10", "--batch", "64", "--steps", "5", "--warmup", "1",
        "--device", "cpu:2", "--sweep", "1,3", "--plot", dir);
    expect(&r, 0, "verdict: PASS");
    const char *script = cp_slurp(dir, "plots.gp");
    static char block[16384];

    /* loss: six curves, widths > 0 and strictly decreasing, distinct dashes */
    cp_block(script, "loss.png", block, sizeof block);
    int curves = 0, dashes[16];
    double last_lw = 1e9;
    for (const char *p = block; (p = strstr(p, "'loss.dat' using 1:")); p++) {
        const char *lw = strstr(p, " lw ");
        const char *dt = strstr(p, " dashtype ");
        cr_assert(lw && dt, "%s", block);
        double w = strtod(lw + 4, NULL);
        cr_expect_gt(w, 0.0, "curve %d has width %g:\n%s", curves + 1, w, block);
        cr_expect_lt(w, last_lw, "curve %d is not narrower than the one under it", curves + 1);
        last_lw = w;
        dashes[curves] = atoi(dt + 10);
        for (int i = 0; i < curves; i++) cr_expect_neq(dashes[i], dashes[curves]);
        curves++;
    }
    cr_expect_eq(curves, 6, "%s", block);

    /* phases: one colour each, distinct; the legend is phases.dat's header */
    cp_block(script, "phases.png", block, sizeof block);
    char colours[32][16];
    int nc = 0;
    for (const char *p = block; (p = strstr(p, "lc rgb '")); p++) {
        cr_assert_lt(nc, 32);
        snprintf(colours[nc], sizeof colours[nc], "%.7s", p + 8);
        for (int i = 0; i < nc; i++)
            cr_expect(strcmp(colours[i], colours[nc]), "phases %d and %d share %s:\n%s", i, nc,
                      colours[nc], block);
        nc++;
    }
    const char *phases = cp_slurp(dir, "phases.dat");
    int header_cols = 0;
    for (const char *p = phases; *p && *p != '\n'; p++) header_cols += *p == '"';
    header_cols /= 2;
    cr_expect_eq(nc, header_cols, "a colour per legend entry:\n%s\n%s", block, phases);
    /* each legend name is a row of the text table, and some mode has it */
    const char *p = strchr(phases, '"');
    for (int col = 0; p && p < strchr(phases, '\n'); col++) {
        char name[64];
        const char *e = strchr(p + 1, '"');
        snprintf(name, sizeof name, "%.*s", (int)(e - p - 1), p + 1);
        char row[80];
        snprintf(row, sizeof row, "\n  %s ", name);
        cr_expect(strstr(r.out, row), "legend entry '%s' is not a row of the table", name);
        if (strcmp(name, "other (outside phases)")) {
            /* the column has a value above zero in some mode's row */
            int some = 0;
            for (const char *line = strchr(phases, '\n'); line && line[1];
                 line = strchr(line + 1, '\n')) {
                const char *c = strchr(line + 2, '"') + 1;   /* after the mode's name */
                double v = 0;
                for (int k = 0; k <= col; k++) v = strtod(c, (char **)&c);
                some |= v > 0;
            }
            cr_expect(some, "legend entry '%s' is in no mode", name);
        }
        p = strchr(e + 1, '"');
    }
    /* DP's replicate and the sharded modes' all-gather are there (those modes ran) */
    cr_expect(strstr(phases, "\"replicate\"") && strstr(phases, "\"all-gather (exposed)\""),
              "%s", phases);

    /* throughput and scaling: min <= median <= max; the ideal line */
    const char *tp = cp_slurp(dir, "throughput.dat");
    int rows = 0;
    for (const char *line = strchr(tp, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        double med, mn, mx;
        cr_assert_eq(sscanf(strchr(line + 2, '"') + 1, "%lf %lf %lf", &med, &mn, &mx), 3, "%s",
                     tp);
        cr_expect(mn <= med && med <= mx, "%s", tp);
        rows++;
    }
    cr_expect_eq(rows, 6, "%s", tp);
    cp_block(script, "throughput.png", block, sizeof block);
    cr_expect(strstr(block, "yerrorbars"), "%s", block);
    cp_block(script, "scaling.png", block, sizeof block);
    cr_expect(strstr(block, "yerrorlines") && strstr(block, "ideal"), "%s", block);
    const char *sc = cp_slurp(dir, "scaling.dat");
    int dev;
    double v[7];
    const char *line2 = strchr(sc, '\n') + 1;
    cr_assert_eq(sscanf(line2, "%d %lf %lf %lf %lf %lf %lf %lf", &dev, &v[0], &v[1], &v[2],
                        &v[3], &v[4], &v[5], &v[6]), 8, "%s", sc);
    cr_expect(v[1] <= v[0] && v[0] <= v[2] && v[4] <= v[3] && v[3] <= v[5], "%s", sc);

    /* memory: a row per device or rank, persistent <= peak */
    const char *mem = cp_slurp(dir, "memory.dat");
    int mrows = 0;
    for (const char *line = strchr(mem, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        double m[8];
        const char *c = strchr(line + 2, '"') + 1;
        cr_assert_eq(sscanf(c, "%lf %lf %lf %lf %lf %lf %lf %lf", &m[0], &m[1], &m[2], &m[3],
                            &m[4], &m[5], &m[6], &m[7]), 8, "%s", mem);
        cr_expect(m[6] <= m[7] + 1e-9 && m[7] > 0, "%s", mem);
        mrows++;
    }
    cr_expect_eq(mrows, 1 + 5 * 2, "%s", mem);
    if (system("command -v gnuplot >/dev/null 2>&1") == 0)
        cr_expect(strstr(r.out, "memory.png, scaling.png"), "%s", r.out);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}

/* The report says what the machine did meanwhile: two busy loops make
 * every mode's run "busy", and more devices than cores is said too; the
 * sharded headline gives the peak before the persistent state. */
/* Two processes that spin until killed (alarm: never past the test). */
static void cp_busy_start(pid_t busy[2])
{
    for (int i = 0; i < 2; i++) {
        busy[i] = fork();
        cr_assert(busy[i] >= 0);
        if (busy[i] == 0) {
            alarm(600);   /* never outlives the test */
            for (volatile unsigned long x = 0;; x++) {}
        }
    }
}

static void cp_busy_stop(pid_t busy[2])
{
    for (int i = 0; i < 2; i++) {
        kill(busy[i], SIGKILL);
        waitpid(busy[i], NULL, 0);
    }
}

/* Single's run must outlast tdm_cmp_load_min_window() (0.2 s on 2 CPUs)
 * by far on any machine, or its load is rightly not measurable: 30 steps
 * of a 1.8M-parameter MLP take over a second here. */
Test(compare_plot, busy_or_oversubscribed_runs_are_flagged_and_peak_comes_first,
     .timeout = 600)
{
    pid_t busy[2];
    cp_busy_start(busy);
    char dev[16];
    int cores = tdm_device_host_cores();
    snprintf(dev, sizeof dev, "cpu:%d", cores + 1);
    cli_result r;
    CLI(&r, "compare", "--modes", "single,ddp,fsdp", "--data", "synthetic", "--model",
        "mlp:784-1024-1024-10", "--batch", "192", "--steps", "30", "--warmup", "1", "--device",
        dev);
    cp_busy_stop(busy);
    expect(&r, 0, "verdict: PASS");
    char want[96];
    snprintf(want, sizeof want, "warning: DDP(%d): %d devices on %d cores share them", cores + 1,
             cores + 1, cores);
    cr_expect(strstr(r.out, want), "no '%s':\n%s", want, r.out);
    cr_expect(strstr(r.out, "warning: single(1): other processes used "), "%s", r.out);
    const char *peak = strstr(r.out, "FSDP peaks at ");
    const char *keeps = peak ? strstr(peak, "it keeps ") : NULL;
    cr_expect(peak && keeps && strstr(peak, "x DDP's") < keeps, "%s", r.out);
    cr_expect(!cli_shm_entries());
}

/* A mode that runs for a few milliseconds spans a clock tick or two of
 * /proc/stat: its load used to read "4.50 cores' worth (of 2)". Whatever
 * the load, no figure says others used more cores than the machine has
 * (a run too short to tell says nothing). Five short compares under two
 * busy loops: before the fix one in three printed such a figure. */
Test(compare_plot, a_short_mode_never_reports_more_load_than_the_machine_has, .timeout = 600)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    pid_t busy[2];
    cp_busy_start(busy);
    for (int rep = 0; rep < 5; rep++) {
        cli_result r;
        CLI(&r, "compare", "--modes", "single,ddp", "--data", "synthetic", "--model",
            "mlp:784-64-10", "--batch", "64", "--steps", "4", "--warmup", "1", "--device",
            "cpu:2");
        cr_assert_eq(r.code, 0, "%s", r.out);
        for (const char *p = strstr(r.out, "other processes used "); p;
             p = strstr(p + 1, "other processes used ")) {
            double used = atof(p + strlen("other processes used "));
            cr_expect(used <= (double)cpus, "others used more than the %ld CPUs there are:\n%s",
                      cpus, r.out);
        }
    }
    cp_busy_stop(busy);
    cr_expect(!cli_shm_entries());
}
