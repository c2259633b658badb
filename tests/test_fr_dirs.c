/* tests/test_fr_dirs.c: the $TMPDIR/tandem-fr-* directories that failed
 * ddp/fsdp/launch jobs make for their flight-recorder dumps do not pile
 * up. One that no rank dumped into is removed (the summary line still
 * gives the verdict); one that holds dumps is kept and named, and only the
 * newest 5 (TDM_DOCTOR_KEEP_DIRS, tools/doctor.h) of this user's stay, none younger than a
 * minute removed, none holding anything but tandem's files touched.
 * Before: every failed run left its directory (55 failed runs, 55
 * directories). */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "frdirs");
    setenv("TMPDIR", g_dir, 1);
    unsetenv("TANDEM_FR_DUMP");
    unsetenv("TANDEM_FR_DUMP_ON");
}

static void teardown(void)
{
    unsetenv("TMPDIR");
    unsetenv("TANDEM_FR_SIZE");
    tu_rmtree(g_dir);
}

TestSuite(frdirs, .init = setup, .fini = teardown, .timeout = 180);

#define DIVERGE "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic", \
                "--synthetic-size", "512", "--batch", "64", "--model", "mlp:784-16-10", \
                "--epochs", "2", "--lr", "1000", "--quiet", "--no-eval"

/* The names in g_dir that start with prefix, counted (and the first kept). */
static int count(const char *prefix, char *first, size_t n)
{
    int k = 0;
    DIR *d = opendir(g_dir);
    cr_assert_not_null(d);
    for (struct dirent *e; (e = readdir(d));)
        if (!strncmp(e->d_name, prefix, strlen(prefix))) {
            if (!k && first) snprintf(first, n, "%s", e->d_name);
            k++;
        }
    closedir(d);
    return k;
}

Test(frdirs, a_failed_job_with_no_dump_leaves_no_directory)
{
    static cli_result r;
    /* the recorder off: a diverging ddp run dumps nothing */
    setenv("TANDEM_FR_SIZE", "0", 1);
    CLI(&r, DIVERGE);
    expect(&r, 1, "loss is NaN at step");
    cr_assert(!strstr(r.out, "flight-recorder dumps in"), "%s", r.out);
    cr_assert_eq(count("tandem-fr-", NULL, 0), 0, "a directory with no dump was left");
    unsetenv("TANDEM_FR_SIZE");
    /* ranks that never dump (not tandem programs): the verdict still
     * comes from the launcher's summary */
    CLI(&r, "launch", "-n", "2", "--", "false");
    expect(&r, 1, "tandem launch: doctor: DIED: ");
    cr_assert(!strstr(r.out, "flight-recorder dumps in"), "%s", r.out);
    cr_assert_eq(count("tandem-fr-", NULL, 0), 0, "a directory with no dump was left");
    /* with dumps: kept and named */
    CLI(&r, DIVERGE);
    expect(&r, 1, "flight-recorder dumps in ");
    char name[256];
    cr_assert_eq(count("tandem-fr-", name, sizeof name), 1);
    char path[400];
    snprintf(path, sizeof path, "%s/%s/fr_rank_0.json", g_dir, name);
    cr_assert_eq(access(path, F_OK), 0, "no dump in %s", name);
}

/* A fake earlier job's directory, its time `age_s` seconds ago; extra: a
 * file of the user's inside, which makes it not ours to remove. */
static void fake(const char *name, int age_s, const char *extra)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    cr_assert_eq(mkdir(path, 0700), 0, "%s", path);
    /* a mesh job's: a split communicator's dump too (core/flight.h) */
    const char *files[] = {"fr_rank_0.json", "fr_rank_1.c3.pid4242.json", "launch.json", extra};
    for (int i = 0; i < 4 && files[i]; i++) {
        char f[320];
        snprintf(f, sizeof f, "%s/%s", path, files[i]);
        FILE *fp = fopen(f, "w");
        cr_assert_not_null(fp);
        fputs("{}\n", fp);
        fclose(fp);
    }
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= age_s;
    t[1] = t[0];
    cr_assert_eq(utimensat(AT_FDCWD, path, t, 0), 0);
}

static int exists(const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    return access(path, F_OK) == 0;
}

Test(frdirs, only_the_newest_few_are_kept)
{
    /* eight earlier failures, an hour old and older */
    char name[32];
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof name, "tandem-fr-old00%d", i);
        fake(name, 3600 + 60 * i, NULL);
    }
    fake("tandem-fr-young0", 5, NULL);               /* may still be read */
    fake("tandem-fr-mynote", 7200, "notes.txt");     /* holds something of the user's */
    fake("tandem-fr-longer-name", 7200, NULL);       /* not a name tandem makes */
    static cli_result r;
    CLI(&r, DIVERGE);
    expect(&r, 1, "flight-recorder dumps in ");
    /* kept: the new one, the young one and the 3 newest old ones (5),
     * the user's and the odd name; gone: the 5 oldest */
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof name, "tandem-fr-old00%d", i);
        cr_assert_eq(exists(name), i < 3, "%s %s", name, i < 3 ? "was removed" : "was kept");
    }
    cr_assert(exists("tandem-fr-young0"), "a directory a minute old was removed");
    cr_assert(exists("tandem-fr-mynote/notes.txt"), "the user's file was removed");
    cr_assert(exists("tandem-fr-longer-name"), "a name tandem does not make was removed");
    cr_assert_eq(count("tandem-fr-", NULL, 0), 7, "%s", r.out);
}
