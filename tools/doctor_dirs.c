/* tools/doctor_dirs.c: the $TMPDIR/tandem-fr-* directories that tandem
 * train and tandem launch make for a failed job's flight-recorder dumps
 * (tools/doctor.h): whether one holds a dump at all, and keeping only the
 * newest few. Only directories tandem made are touched: a name of the
 * mkdtemp form, owned by this user, holding nothing but dumps and the
 * launcher's summary; never the user's TANDEM_FR_DUMP or --log-dir. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tools/doctor.h"

/* "tandem-fr-" and mkdtemp's six characters */
#define TDM_FR_DIR_PREFIX "tandem-fr-"
#define TDM_FR_DIR_SUFFIX_LEN 6

/* A file tandem writes into a dump directory: a rank's dump
 * (fr_rank_<R>.json, or its temporary .tmp), one of its other
 * communicators' (fr_rank_<R>.c<K>.pid<P>.json: a mesh's groups, a
 * pipeline's links) or the launcher's summary. */
static int tdm_fr_dir_ours(const char *name, int *is_dump)
{
    int r, k, pid, len = 0;
    *is_dump = 0;
    if (sscanf(name, "fr_rank_%d%n", &r, &len) == 1 && len > 0 &&
        (!strcmp(name + len, ".json") || !strcmp(name + len, ".json.tmp"))) {
        *is_dump = !strcmp(name + len, ".json");
        return 1;
    }
    len = 0;
    if (sscanf(name, "fr_rank_%d.c%d.pid%d.json%n", &r, &k, &pid, &len) == 3 &&
        len == (int)strlen(name))
        return 1;
    return !strcmp(name, TDM_DOCTOR_SUMMARY);
}

/* Dumps in dir (at dirfd), and whether everything there is ours. */
static void tdm_fr_dir_scan(int dirfd, int *dumps, int *only_ours)
{
    *dumps = 0;
    *only_ours = 1;
    int fd = dup(dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        *only_ours = 0;
        return;
    }
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        int is_dump;
        struct stat sb;
        if (!tdm_fr_dir_ours(e->d_name, &is_dump) ||
            fstatat(dirfd, e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(sb.st_mode))
            *only_ours = 0;
        else
            *dumps += is_dump;
    }
    closedir(d);
}

/* Removes what tandem wrote in dir, then dir itself when that empties it. */
static int tdm_fr_dir_remove(int parentfd, const char *name)
{
    int fd = openat(parentfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    int dfd = dup(fd);
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    for (struct dirent *e; d && (e = readdir(d));) {
        int is_dump;
        if (tdm_fr_dir_ours(e->d_name, &is_dump)) unlinkat(fd, e->d_name, 0);
    }
    if (d) closedir(d);
    else if (dfd >= 0) close(dfd);
    close(fd);
    return unlinkat(parentfd, name, AT_REMOVEDIR);
}

int tdm_doctor_dir_dumps(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return 0;
    int dumps, only;
    tdm_fr_dir_scan(fd, &dumps, &only);
    close(fd);
    return dumps;
}

int tdm_doctor_dir_remove(const char *dir)
{
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    const char *name = dir;
    if (slash) {
        *slash = '\0';
        name = slash + 1;
        if (slash == parent) snprintf(parent, sizeof parent, "/");
    } else {
        snprintf(parent, sizeof parent, ".");
    }
    int pfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pfd < 0) return -1;
    int rc = tdm_fr_dir_remove(pfd, name);
    close(pfd);
    return rc;
}

typedef struct tdm_fr_dir_age {
    char name[64];
    struct timespec mtime;
} tdm_fr_dir_age;

static int tdm_fr_dir_newer_first(const void *a, const void *b)
{
    const struct timespec *x = &((const tdm_fr_dir_age *)a)->mtime;
    const struct timespec *y = &((const tdm_fr_dir_age *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec > y->tv_sec ? -1 : 1;
    return x->tv_nsec > y->tv_nsec ? -1 : x->tv_nsec < y->tv_nsec;
}

int tdm_doctor_dirs_prune(const char *tmpdir)
{
    int pfd = open(tmpdir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pfd < 0) return 0;
    int dfd = dup(pfd);
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0) close(dfd);
        close(pfd);
        return 0;
    }
    tdm_fr_dir_age *all = NULL;
    int n = 0, cap = 0, removed = 0;
    uid_t me = geteuid();
    size_t plen = strlen(TDM_FR_DIR_PREFIX);
    for (struct dirent *e; (e = readdir(d));) {
        struct stat sb;
        if (strncmp(e->d_name, TDM_FR_DIR_PREFIX, plen) ||
            strlen(e->d_name) != plen + TDM_FR_DIR_SUFFIX_LEN ||
            fstatat(pfd, e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(sb.st_mode) ||
            sb.st_uid != me)
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            tdm_fr_dir_age *p = realloc(all, (size_t)cap * sizeof *p);
            if (!p) break;
            all = p;
        }
        snprintf(all[n].name, sizeof all[n].name, "%s", e->d_name);
        all[n++].mtime = sb.st_mtim;
    }
    closedir(d);
    if (n > TDM_DOCTOR_KEEP_DIRS) qsort(all, (size_t)n, sizeof *all, tdm_fr_dir_newer_first);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = TDM_DOCTOR_KEEP_DIRS; i < n; i++) {
        /* a job that failed a moment ago may still be read by whoever ran it */
        if (now.tv_sec - all[i].mtime.tv_sec < TDM_DOCTOR_KEEP_YOUNG_S) continue;
        int fd = openat(pfd, all[i].name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) continue;
        int dumps, only;
        tdm_fr_dir_scan(fd, &dumps, &only);
        close(fd);
        if (only && tdm_fr_dir_remove(pfd, all[i].name) == 0) removed++;
    }
    free(all);
    close(pfd);
    return removed;
}
