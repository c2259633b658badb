/* tests/test_file_safety.c: the file rules end to end, through the CLI:
 * compare --plot refuses directories others can write or own, feeds
 * gnuplot its script through a descriptor and reports a gnuplot that
 * failed or wrote nothing; --trace and --csv write through a symlink of
 * ours to a regular file (keeping the link) and refuse one to a FIFO; launch --log-dir refuses unsafe directories and
 * symlinked logs; train checks --save before training and refuses FIFOs as
 * --save, --resume and data files at once; TANDEM_DEBUG_FILE does not
 * follow a symlink; install.sh does not write through a symlink in the
 * prefix. Unit tests of core/safefile are in test_safefile.c. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/safety_util.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "fsafe");
    cr_assert_eq(chmod(g_dir, 0755), 0);
}
static void teardown(void) { tu_rmtree(g_dir); }

TestSuite(fsafe, .init = setup, .fini = teardown, .timeout = 90);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

static void mkdir_mode(const char *p, mode_t mode)
{
    cr_assert_eq(mkdir(p, 0700), 0, "%s: %s", p, strerror(errno));
    cr_assert_eq(chmod(p, mode), 0);
}

static void assert_file_is(const char *path, const char *text)
{
    char *s = su_slurp(path, NULL);
    cr_assert_not_null(s, "%s is gone", path);
    cr_assert_str_eq(s, text, "%s was changed", path);
    free(s);
}

#define COMPARE_ARGS "compare", "--data", "synthetic", "--model", "mlp:784-16-10", "--device", \
                     "cpu:2", "--batch", "32", "--steps", "3", "--warmup", "1"

/* ---- compare ------------------------------------------------------------ */

/* Before the fix compare used any existing directory, whoever owned it:
 * another user could swap plots.gp and run commands as root. */
Test(fsafe, compare_plot_refuses_directories_others_can_write)
{
    static cli_result r;
    char d[128];
    snprintf(d, sizeof d, "%s/plots", g_dir);
    mkdir_mode(d, 0777);
    CLI(&r, COMPARE_ARGS, "--plot", d);
    expect(&r, 2, "--plot");
    cr_assert(strstr(r.out, "writable by others (mode 0777)"), "%s", r.out);
    cr_assert(strstr(r.out, "chmod go-w"), "%s", r.out);
    cr_assert(!strstr(r.out, "Throughput"), "ran before refusing:\n%s", r.out);
    cr_assert_eq(su_entries(d, NULL, 0), 0);
    if (geteuid() == 0) {
        uid_t nobody;
        gid_t ngid;
        su_nobody(&nobody, &ngid);
        cr_assert_eq(chmod(d, 0755), 0);
        cr_assert_eq(chown(d, nobody, ngid), 0);
        CLI(&r, COMPARE_ARGS, "--plot", d);
        expect(&r, 2, "belongs to uid");
    }
}

static void fake_gnuplot(const char *body)
{
    char bin[128], path[200], text[512];
    snprintf(bin, sizeof bin, "%s/bin", g_dir);
    mkdir(bin, 0755);
    snprintf(path, sizeof path, "%s/gnuplot", bin);
    snprintf(text, sizeof text, "#!/bin/sh\necho \"args: $#\" > \"%s/gnuplot.log\"\n"
             "cat >> \"%s/gnuplot.log\"\n%s\n", g_dir, g_dir, body);
    su_write(path, text);
    cr_assert_eq(chmod(path, 0755), 0);
    char env[4096];
    snprintf(env, sizeof env, "%s:%s", bin, getenv("PATH") ? getenv("PATH") : "/usr/bin:/bin");
    setenv("PATH", env, 1);
}

/* gnuplot gets its script on stdin (a descriptor of ours), not as a path
 * in the directory; a gnuplot that fails, or exits 0 without writing the
 * charts, is reported (exit 1), not followed by "plots: ...png". Before:
 * "gnuplot plots.gp" (args: 1), and the exit-0 case printed the PNG paths. */
Test(fsafe, compare_gnuplot_reads_a_pipe_and_its_failure_is_reported)
{
    static cli_result r;
    char d[128];
    snprintf(d, sizeof d, "%s/plots", g_dir);
    fake_gnuplot("exit 0");
    CLI(&r, COMPARE_ARGS, "--plot", d);
    expect(&r, 1, "gnuplot exited 0 but did not write loss.png");
    cr_assert(!strstr(r.out, "plots: "), "%s", r.out);
    char *log = su_slurp(tpath("gnuplot.log"), NULL);
    cr_assert_not_null(log, "the fake gnuplot did not run:\n%s", r.out);
    cr_assert(!strncmp(log, "args: 0\n", 8), "gnuplot was given a path: %s", log);
    cr_assert(strstr(log, "set output 'loss.png'"), "no script on stdin: %s", log);
    free(log);
    /* the script is still written for the user, as the data files are */
    cr_assert_eq(access(tu_tpath(d, "plots.gp"), R_OK), 0);
    cr_assert_eq(access(tu_tpath(d, "loss.dat"), R_OK), 0);

    fake_gnuplot("echo 'line 3: undefined variable' >&2; exit 3");
    CLI(&r, COMPARE_ARGS, "--plot", d);
    expect(&r, 1, "gnuplot failed (exit 3)");
    cr_assert(strstr(r.out, "undefined variable"), "%s", r.out);
    cr_assert(!strstr(r.out, "plots: "), "%s", r.out);
}

/* --trace and --csv at a symlink of ours: judged by what it points to.
 * To a regular file: that file is written, the link kept (before: fopen
 * ("w") followed it; then the link was replaced); to a FIFO or a device:
 * refused before the run, without blocking, the link kept. */
Test(fsafe, compare_trace_and_csv_write_through_our_links_to_files_only)
{
    static cli_result r;
    su_write(tpath("trace-file"), "old\n");
    su_write(tpath("csv-file"), "old\n");
    cr_assert_eq(symlink(tpath("trace-file"), tpath("trace.json")), 0);
    cr_assert_eq(symlink("csv-file", tpath("run.csv")), 0);
    CLI(&r, COMPARE_ARGS, "--trace", tpath("trace.json"), "--csv", tpath("run.csv"));
    expect(&r, 0, "Throughput");
    struct stat sb;
    const char *links[] = {"trace.json", "run.csv"}, *files[] = {"trace-file", "csv-file"};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(lstat(tpath(links[i]), &sb), 0);
        cr_assert(S_ISLNK(sb.st_mode), "%s was replaced", links[i]);
        cr_assert_eq(lstat(tpath(files[i]), &sb), 0);
        cr_assert(S_ISREG(sb.st_mode) && sb.st_size > 100, "%s holds %lld bytes", files[i],
                  (long long)sb.st_size);
    }
    /* a FIFO, directly or through a link, is refused before the run */
    cr_assert_eq(mkfifo(tpath("fifo"), 0600), 0);
    cr_assert_eq(symlink(tpath("fifo"), tpath("fifo-link")), 0);
    CLI(&r, COMPARE_ARGS, "--csv", tpath("fifo"));
    expect(&r, 2, "a FIFO, not a regular file");
    CLI(&r, COMPARE_ARGS, "--trace", tpath("fifo-link"));
    expect(&r, 2, "is a symbolic link to a FIFO");
    cr_assert_eq(lstat(tpath("fifo-link"), &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode));
}

/* ---- launch ------------------------------------------------------------- */

/* Before: any existing directory was used, and rank_N.log was opened
 * O_CREAT | O_TRUNC through a symlink (truncating root's file). */
Test(fsafe, launch_log_dir_refuses_unsafe_directories_and_symlinked_logs)
{
    static cli_result r;
    char d[128];
    snprintf(d, sizeof d, "%s/logs", g_dir);
    mkdir_mode(d, 0777);
    CLI(&r, "launch", "-n", "2", "--log-dir", d, "--", "sh", "-c", "echo hi");
    expect(&r, 2, "writable by others");
    cr_assert_eq(su_entries(d, NULL, 0), 0);
    cr_assert_eq(chmod(d, 0755), 0);
    su_write(tpath("victim"), "precious\n");
    su_write(tu_tpath(d, "rank_0.log"), "last run\n");
    cr_assert_eq(symlink(tpath("victim"), tu_tpath(d, "rank_1.log")), 0);
    CLI(&r, "launch", "-n", "2", "--log-dir", d, "--", "sh", "-c", "echo hi");
    expect(&r, 2, "rank_1.log: is a symbolic link");
    assert_file_is(tpath("victim"), "precious\n");
    /* nothing was started, and the last run's logs were kept */
    assert_file_is(tu_tpath(d, "rank_0.log"), "last run\n");
    cr_assert_eq(unlink(tu_tpath(d, "rank_1.log")), 0);
    CLI(&r, "launch", "-n", "2", "--log-dir", d, "--", "sh", "-c", "echo hi $RANK");
    expect(&r, 0, NULL);
    assert_file_is(tu_tpath(d, "rank_1.log"), "hi 1\n");
    if (geteuid() == 0) {
        uid_t nobody;
        gid_t ngid;
        su_nobody(&nobody, &ngid);
        cr_assert_eq(chown(d, nobody, ngid), 0);
        CLI(&r, "launch", "-n", "2", "--log-dir", d, "--", "sh", "-c", "echo hi");
        expect(&r, 2, "belongs to uid");
    }
}

/* ---- train -------------------------------------------------------------- */

#define TRAIN_ARGS "train", "--data", "synthetic", "--synthetic-size", "600", "--model", \
                   "mlp:784-16-10", "--epochs", "1"

/* Bad --save paths fail before the first epoch (before: after it, and a
 * FIFO was silently replaced by the checkpoint). */
Test(fsafe, train_checks_save_before_training)
{
    static cli_result r;
    char name[300], path[400];
    memset(name, 'c', 256);
    name[256] = '\0';
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    CLI(&r, TRAIN_ARGS, "--save", path);
    expect(&r, 2, "longer than the 255 this file system allows");
    cr_assert(!strstr(r.out, "epoch 1/1"), "%s", r.out);
    cr_assert_eq(mkfifo(tpath("fifo"), 0600), 0);
    CLI(&r, TRAIN_ARGS, "--save", tpath("fifo"));
    expect(&r, 2, "a FIFO, not a regular file");
    cr_assert(!strstr(r.out, "epoch 1/1"), "%s", r.out);
    struct stat sb;
    cr_assert_eq(lstat(tpath("fifo"), &sb), 0);
    cr_assert(S_ISFIFO(sb.st_mode));
    /* a name of 250 bytes is fine (its temporary name used to be too long) */
    memset(name, 'c', 250);
    name[250] = '\0';
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    CLI(&r, TRAIN_ARGS, "--save", path);
    expect(&r, 0, "saved");
    cr_assert_eq(su_entries(g_dir, NULL, 0), 2, "something was left behind");
}

/* A FIFO as --resume or as a data file: exit 1 at once (before: blocked in
 * open() forever). */
Test(fsafe, train_refuses_fifo_inputs_without_blocking, .timeout = 30)
{
    static cli_result r;
    cr_assert_eq(mkfifo(tpath("fifo"), 0600), 0);
    CLI(&r, TRAIN_ARGS, "--resume", tpath("fifo"));
    expect(&r, 1, "a FIFO, not a regular file");
    char d[128];
    snprintf(d, sizeof d, "%s/data", g_dir);
    mkdir_mode(d, 0755);
    const char *names[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
    for (int i = 0; i < 4; i++) cr_assert_eq(mkfifo(tu_tpath(d, names[i]), 0600), 0);
    CLI(&r, "train", "--data", d, "--model", "mlp:784-16-10", "--epochs", "1");
    expect(&r, 1, "train-images-idx3-ubyte: is a FIFO, not a regular file");
}

/* ---- the debug log ------------------------------------------------------ */

Test(fsafe, debug_log_file_does_not_follow_a_symlink)
{
    static cli_result r;
    su_write(tpath("victim"), "precious\n");
    cr_assert_eq(symlink(tpath("victim"), tpath("debug.log")), 0);
    setenv("TANDEM_DEBUG", "INFO", 1);
    setenv("TANDEM_DEBUG_FILE", tpath("debug.log"), 1);
    CLI(&r, TRAIN_ARGS);
    expect(&r, 0, "TANDEM_DEBUG_FILE");
    cr_assert(strstr(r.out, "symbolic link"), "%s", r.out);
    assert_file_is(tpath("victim"), "precious\n");
    /* a file of ours is appended to */
    setenv("TANDEM_DEBUG_FILE", tpath("own.log"), 1);
    CLI(&r, TRAIN_ARGS);
    expect(&r, 0, NULL);
    size_t len = 0;
    free(su_slurp(tpath("own.log"), &len));
    cr_assert_gt(len, 0);
}

/* ---- install ------------------------------------------------------------ */

/* install.sh wrote tandem.pc with "cat >", following a symlink planted in
 * the prefix. */
Test(fsafe, install_does_not_write_through_symlinks, .timeout = 120)
{
    const char *bin = getenv("TANDEM_BIN");
    char build[4096], cmd[8192];
    snprintf(build, sizeof build, "%s", bin && *bin ? bin : "build/tandem");
    char *bdir = dirname(build);
    char prefix[128], pc[160];
    snprintf(prefix, sizeof prefix, "%s/usr", g_dir);
    snprintf(pc, sizeof pc, "%s/lib/pkgconfig", prefix);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", pc);
    cr_assert_eq(system(cmd), 0);
    su_write(tpath("victim"), "precious\n");
    cr_assert_eq(symlink(tpath("victim"), tu_tpath(pc, "tandem.pc")), 0);
    cr_assert_eq(symlink(tpath("victim"), tu_tpath(prefix, "lib/libtandem.a")), 0);
    snprintf(cmd, sizeof cmd, "sh tools/install.sh '%s' '%s' >/dev/null 2>&1", bdir, prefix);
    cr_assert_eq(system(cmd), 0, "%s failed", cmd);
    assert_file_is(tpath("victim"), "precious\n");
    struct stat sb;
    cr_assert_eq(lstat(tu_tpath(pc, "tandem.pc"), &sb), 0);
    cr_assert(S_ISREG(sb.st_mode), "tandem.pc is still a link");
    cr_assert_eq(lstat(tu_tpath(prefix, "lib/libtandem.a"), &sb), 0);
    cr_assert(S_ISREG(sb.st_mode), "libtandem.a is still a link");
    /* a directory of the prefix that others can write is refused */
    cr_assert_eq(chmod(pc, 0777), 0);
    snprintf(cmd, sizeof cmd, "sh tools/install.sh '%s' '%s' 2>&1", bdir, prefix);
    FILE *p = popen(cmd, "r");
    char out[4096] = "";
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int ws = pclose(p);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) != 0, "installed into a world-writable directory");
    cr_assert(strstr(out, "writable by others"), "%s", out);
}
