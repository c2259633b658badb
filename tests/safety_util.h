/* tests/safety_util.h: a second local user for the file-safety tests. Where
 * the tests run as root, a forked child drops to "nobody" (setgroups,
 * setgid, setuid) and does what another user of the machine could do:
 * plant a symlink or a file where tandem is about to write. Elsewhere the
 * tests that need one are skipped. Also small file helpers. Header-only,
 * static functions only. */
#ifndef TDM_TESTS_SAFETY_UTIL_H
#define TDM_TESTS_SAFETY_UTIL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* uid and gid of "nobody" (65534 where there is no such entry). */
static inline void su_nobody(uid_t *uid, gid_t *gid)
{
    struct passwd *pw = getpwnam("nobody");
    *uid = pw ? pw->pw_uid : 65534;
    *gid = pw ? pw->pw_gid : 65534;
}

/* Skips the calling test unless it can act as a second user. */
#define SU_NEED_ROOT()                                                               \
    do {                                                                             \
        if (geteuid() != 0) cr_skip_test("needs root to act as a second local user"); \
    } while (0)

/* Runs fn(arg) in a child as nobody; returns its exit code (0: fn
 * returned 0). fn must not use Criterion asserts. */
static inline int su_as_nobody(int (*fn)(void *), void *arg)
{
    uid_t uid;
    gid_t gid;
    su_nobody(&uid, &gid);
    fflush(NULL);
    pid_t p = fork();
    cr_assert(p >= 0);
    if (p == 0) {
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0 || geteuid() != uid)
            _exit(90);
        _exit(fn(arg) ? 91 : 0);
    }
    int ws;
    cr_assert_eq(waitpid(p, &ws, 0), p);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

/* Whole file into a NUL-terminated buffer (caller frees); NULL if absent. */
static inline char *su_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    cr_assert_not_null(p);
    cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
    p[n] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return p;
}

static inline void su_write(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
}

/* Entries of dir other than . and .., names joined by ' ' into buf. */
static inline int su_entries(const char *dir, char *buf, size_t cap)
{
    DIR *d = opendir(dir);
    int n = 0;
    size_t len = 0;
    cr_assert_not_null(d, "%s: %s", dir, strerror(errno));
    if (cap) buf[0] = '\0';
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n++;
        if (len < cap)
            len += (size_t)snprintf(buf + len, cap - len, "%s%s", len ? " " : "", e->d_name);
    }
    closedir(d);
    return n;
}

#endif
