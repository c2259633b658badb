/* core/safefile.c: opening files for reading and writing so that another
 * local user cannot redirect them and a FIFO cannot hang them; see
 * core/safefile.h for the rules. Linux-specific (O_TMPFILE, linkat through
 * /proc/self/fd, renameat); not a general file-system library. */
#include "core/safefile.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/timer.h"

/* Never writable by others; the umask may take away more. */
#define SF_FILE_MODE 0644
#define SF_DIR_MODE 0755
#define SF_TMP_TAG ".tdm-tmp."
/* ".<base>.tdm-tmp.<pid>.<16 hex>" must fit in NAME_MAX (255): the base
 * is cut to this many bytes in the temporary name. */
#define SF_TMP_BASE_MAX 200
/* Symbolic links followed from a target to the file it names, at most
 * (the kernel's own limit for a path, MAXSYMLINKS). */
#define SF_MAX_LINKS 40

const char *tdm_file_kind(mode_t m)
{
    if (S_ISREG(m)) return "a regular file";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISLNK(m)) return "a symbolic link";
    return "not a regular file";
}

static int sf_open_at(int dirfd, const char *p, int flags, mode_t mode)
{
    int fd;
    do fd = openat(dirfd, p, flags, mode); while (fd < 0 && errno == EINTR);
    return fd;
}

static int sf_clear_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
}

tdm_status tdm_file_write_all(int fd, const void *data, size_t nbytes, const char *path)
{
    const char *p = data;
    while (nbytes > 0) {
        ssize_t w = write(fd, p, nbytes > (1u << 30) ? (1u << 30) : nbytes);
        if (w < 0) {
            if (errno == EINTR) continue;
            return tdm_error_set(TDM_STATUS_IO, "%s: write failed: %s", path, strerror(errno));
        }
        p += w;
        nbytes -= (size_t)w;
    }
    return TDM_STATUS_OK;
}

/* ---- reading ------------------------------------------------------------ */

tdm_status tdm_file_open_read(const char *path, int *fd_out, size_t *nbytes)
{
    struct stat sb;
    *fd_out = -1;
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "empty file name");
    /* O_NONBLOCK: opening a FIFO with no writer would otherwise block
     * forever; it is refused below on fstat. */
    int fd = sf_open_at(AT_FDCWD, path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0);
    if (fd < 0) return tdm_error_set(TDM_STATUS_IO, "%s: %s", path, strerror(errno));
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return tdm_error_set(TDM_STATUS_IO, "%s: fstat failed: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tdm_error_set(TDM_STATUS_IO, "%s: is %s, not a regular file: give the path of "
                             "a file", path, tdm_file_kind(sb.st_mode));
    }
    if (sf_clear_nonblock(fd) != 0) {
        int e = errno;
        close(fd);
        return tdm_error_set(TDM_STATUS_IO, "%s: fcntl failed: %s", path, strerror(e));
    }
    if (nbytes) *nbytes = (size_t)sb.st_size;
    *fd_out = fd;
    return TDM_STATUS_OK;
}

/* ---- directories -------------------------------------------------------- */

static tdm_status sf_dir_check(int fd, const char *path, const char *what)
{
    struct stat sb;
    uid_t me = geteuid();
    if (fstat(fd, &sb) != 0)
        return tdm_error_set(TDM_STATUS_IO, "%s %s: fstat failed: %s", what, path,
                             strerror(errno));
    TDM_REQUIRE(S_ISDIR(sb.st_mode), TDM_STATUS_IO, "%s %s: is %s, not a directory", what,
                path, tdm_file_kind(sb.st_mode));
    TDM_REQUIRE(sb.st_uid == me || sb.st_uid == 0, TDM_STATUS_INVALID_ARG,
                "%s %s: the directory belongs to uid %u, not to you (uid %u) or root: its "
                "owner could replace or redirect the files tandem writes there; use a "
                "directory you own (a new one is created if the path does not exist)",
                what, path, (unsigned)sb.st_uid, (unsigned)me);
    TDM_REQUIRE(!(sb.st_mode & (S_IWGRP | S_IWOTH)), TDM_STATUS_INVALID_ARG,
                "%s %s: the directory is writable by %s (mode %04o): another user could plant "
                "a symlink or swap the files tandem writes there (sshd refuses such a ~/.ssh "
                "for the same reason); run 'chmod go-w %s' or use a directory only you can "
                "write", what, path, (sb.st_mode & S_IWOTH) ? "others" : "its group",
                (unsigned)(sb.st_mode & 07777), path);
    return TDM_STATUS_OK;
}

tdm_status tdm_dir_open_safe(const char *path, const char *what, int create, int *dirfd_out)
{
    tdm_status st = TDM_STATUS_OK;
    struct stat l1, l2;
    *dirfd_out = -1;
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "%s: empty directory name", what);
    if (create && mkdir(path, SF_DIR_MODE) != 0 && errno != EEXIST)
        return tdm_error_set(TDM_STATUS_IO, "%s %s: cannot create the directory: %s", what,
                             path, strerror(errno));
    int fd = sf_open_at(AT_FDCWD, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0 && (errno == ELOOP || errno == ENOTDIR) && lstat(path, &l1) == 0 &&
        S_ISLNK(l1.st_mode)) {
        /* A link is followed only if it is ours (or root's), and only if it
         * is still the same link once the directory is open. */
        TDM_REQUIRE(l1.st_uid == geteuid() || l1.st_uid == 0, TDM_STATUS_INVALID_ARG,
                    "%s %s: is a symbolic link that belongs to uid %u, not to you (uid %u) or "
                    "root: refusing to follow it; give the real directory", what, path,
                    (unsigned)l1.st_uid, (unsigned)geteuid());
        fd = sf_open_at(AT_FDCWD, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
        if (fd >= 0 && (lstat(path, &l2) != 0 || l2.st_ino != l1.st_ino ||
                        l2.st_dev != l1.st_dev)) {
            close(fd);
            return tdm_error_set(TDM_STATUS_INVALID_ARG, "%s %s: the symbolic link changed "
                                 "while it was opened: refusing it", what, path);
        }
    }
    if (fd < 0 && errno == ENOTDIR && stat(path, &l2) == 0)
        return tdm_error_set(TDM_STATUS_IO, "%s %s: is %s%s, not a directory", what, path,
                             lstat(path, &l1) == 0 && S_ISLNK(l1.st_mode) ? "a symbolic link to "
                                                                          : "",
                             tdm_file_kind(l2.st_mode));
    if (fd < 0)
        return tdm_error_set(TDM_STATUS_IO, "%s %s: %s", what, path, strerror(errno));
    TDM_TRY(sf_dir_check(fd, path, what));
    *dirfd_out = fd;
    return TDM_STATUS_OK;
fail:
    close(fd);
    return st;
}

/* ---- streams ------------------------------------------------------------ */

tdm_status tdm_file_open_write(int dirfd, const char *name, int how, int *fd_out)
{
    struct stat sb;
    *fd_out = -1;
    TDM_REQUIRE(name && *name, TDM_STATUS_INVALID_ARG, "empty file name");
    int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
    if (how & TDM_FILE_APPEND) flags |= O_APPEND;
    int fd = sf_open_at(dirfd, name, flags, SF_FILE_MODE);
    if (fd < 0) {
        int e = errno;
        if ((e == ELOOP || e == ENXIO || e == EISDIR) && fstatat(dirfd, name, &sb,
                                                                  AT_SYMLINK_NOFOLLOW) == 0)
            return tdm_error_set(TDM_STATUS_IO, "%s: is %s, not a regular file: refusing to "
                                 "write to it (remove it or choose another name)", name,
                                 tdm_file_kind(sb.st_mode));
        return tdm_error_set(TDM_STATUS_IO, "%s: %s", name, strerror(e));
    }
    const char *why = NULL;
    if (fstat(fd, &sb) != 0) why = strerror(errno);
    else if (!S_ISREG(sb.st_mode)) why = tdm_file_kind(sb.st_mode);
    else if (sb.st_uid != geteuid()) why = "a file that belongs to another user";
    else if (sb.st_nlink != 1) why = "a file with several hard links";
    if (why) {
        close(fd);
        return tdm_error_set(TDM_STATUS_IO, "%s: is %s: refusing to write to it (remove it "
                             "or choose another name)", name, why);
    }
    if (((how & TDM_FILE_TRUNC) && ftruncate(fd, 0) != 0) || sf_clear_nonblock(fd) != 0) {
        int e = errno;
        close(fd);
        return tdm_error_set(TDM_STATUS_IO, "%s: %s", name, strerror(e));
    }
    *fd_out = fd;
    return TDM_STATUS_OK;
}

/* ---- atomic replacement ------------------------------------------------- */

static uint64_t sf_random64(void)
{
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) == (ssize_t)sizeof r) return r;
    /* No entropy yet (early boot): names must only be unlikely to clash;
     * O_EXCL | O_NOFOLLOW keeps a guessed one harmless. */
    static uint64_t ctr;
    r = tdm_time_ns() ^ ((uint64_t)getpid() << 32) ^ (++ctr * 0x9e3779b97f4a7c15ull);
    return r * 0xbf58476d1ce4e5b9ull;
}

/* ".<base, cut>.tdm-tmp." */
static void sf_tmp_prefix(char *buf, size_t cap, const char *base)
{
    snprintf(buf, cap, ".%.*s" SF_TMP_TAG, SF_TMP_BASE_MAX, base);
}

static void sf_tmp_name(tdm_file_out *o)
{
    char pre[SF_TMP_BASE_MAX + 16];
    sf_tmp_prefix(pre, sizeof pre, o->name);
    snprintf(o->tmp, sizeof o->tmp, "%s%d.%016llx", pre, (int)getpid(),
             (unsigned long long)sf_random64());
}

/* Temporary files of ours for this target whose writer is dead: left by a
 * process killed between naming its file and renaming it (or, without
 * O_TMPFILE, while writing). Only regular files owned by this user are
 * removed; a live writer's file is left alone. */
static void sf_remove_stale(int dirfd, const char *base)
{
    char pre[256];
    sf_tmp_prefix(pre, sizeof pre, base);
    size_t plen = strlen(pre);
    int dfd = dup(dirfd);
    if (dfd < 0) return;
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return;
    }
    rewinddir(d);
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, pre, plen) != 0) continue;
        const char *p = e->d_name + plen;
        char *end;
        long pid = strtol(p, &end, 10);
        if (end == p || *end != '.' || pid <= 0 || strlen(end + 1) != 16 ||
            strspn(end + 1, "0123456789abcdef") != 16)
            continue;
        struct stat sb;
        if (fstatat(dirfd, e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(sb.st_mode) ||
            sb.st_uid != geteuid())
            continue;
        if (pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        unlinkat(dirfd, e->d_name, 0);
    }
    closedir(d);
}

/* O_TMPFILE is used only where the file can be named afterwards:
 * linkat(AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH, so /proc/self/fd must
 * be there for the usual case. */
static int sf_can_link_anon(void) { return access("/proc/self/fd", X_OK) == 0; }

/* The target o->dirfd/o->name is a symbolic link (*sb, from lstat): it is
 * judged by what it points to. Only a link of ours or root's is followed
 * (another user's, planted in a directory we share, could point anywhere),
 * link by link, so that every link on the way passes the same test; what
 * it ends at must be a regular file, which then becomes the target:
 * o->dirfd is that file's directory and o->name its name there, *sb its
 * lstat. The link itself is never replaced (as root, `--save /dev/stdin`
 * would otherwise replace the system's /dev/stdin). */
static tdm_status sf_follow(tdm_file_out *o, const char *path, struct stat *sb)
{
    struct stat to;
    uid_t me = geteuid();
    /* what the whole chain ends at, as the kernel resolves it (a /proc
     * magic link such as /dev/stdin's leads to a pipe or a terminal) */
    if (fstatat(o->dirfd, o->name, &to, 0) != 0)
        return tdm_error_set(TDM_STATUS_IO, "%s: is a symbolic link to a path that does not "
                             "exist (%s): refusing to replace the link; give the path of a "
                             "file", path, strerror(errno));
    TDM_REQUIRE(S_ISREG(to.st_mode), TDM_STATUS_IO,
                "%s: is a symbolic link to %s, not to a regular file: refusing to write "
                "through it or to replace the link; give the path of a file", path,
                tdm_file_kind(to.st_mode));
    for (int hops = 0; S_ISLNK(sb->st_mode); hops++) {
        TDM_REQUIRE(hops < SF_MAX_LINKS, TDM_STATUS_IO,
                    "%s: more than %d symbolic links: give the path of the file", path,
                    SF_MAX_LINKS);
        TDM_REQUIRE(sb->st_uid == me || sb->st_uid == 0, TDM_STATUS_IO,
                    "%s: is (or leads through) a symbolic link that belongs to uid %u, not to "
                    "you (uid %u) or root: refusing to follow it or to replace it; give the "
                    "real path of the file", path, (unsigned)sb->st_uid, (unsigned)me);
        char target[4096];
        ssize_t n = readlinkat(o->dirfd, o->name, target, sizeof target - 1);
        if (n < 0)
            return tdm_error_set(TDM_STATUS_IO, "%s: cannot read the symbolic link %s: %s",
                                 path, o->name, strerror(errno));
        TDM_REQUIRE((size_t)n < sizeof target - 1, TDM_STATUS_IO,
                    "%s: symbolic link target too long", path);
        target[n] = '\0';
        char *slash = strrchr(target, '/');
        const char *base = slash ? slash + 1 : target;
        size_t blen = strlen(base);
        TDM_REQUIRE(blen > 0 && blen < sizeof o->name && strcmp(base, ".") && strcmp(base, ".."),
                    TDM_STATUS_IO, "%s: is a symbolic link to '%s', which names a directory, "
                    "not a file", path, target);
        int dfd;
        if (!slash) dfd = sf_open_at(o->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
        else {
            if (slash == target) slash[1] = '\0';   /* "/name": the root directory */
            else *slash = '\0';
            dfd = sf_open_at(target[0] == '/' ? AT_FDCWD : o->dirfd, target,
                             O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
        }
        if (dfd < 0)
            return tdm_error_set(TDM_STATUS_IO, "%s: cannot open the directory its symbolic "
                                 "link leads to: %s", path, strerror(errno));
        close(o->dirfd);
        o->dirfd = dfd;
        memcpy(o->name, base, blen + 1);
        if (fstatat(o->dirfd, o->name, sb, AT_SYMLINK_NOFOLLOW) != 0)
            return tdm_error_set(TDM_STATUS_IO, "%s: its symbolic link leads to %s, which "
                                 "cannot be looked at: %s; give the path of a file", path,
                                 o->name, strerror(errno));
    }
    /* the links moved while we followed them: the result must be the file
     * the kernel resolved above */
    TDM_REQUIRE(sb->st_dev == to.st_dev && sb->st_ino == to.st_ino, TDM_STATUS_IO,
                "%s: its symbolic links changed while they were followed: refusing them", path);
    return TDM_STATUS_OK;
}

static tdm_status sf_split(tdm_file_out *o, int dirfd, const char *path)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t blen = strlen(base);
    TDM_REQUIRE(blen > 0 && strcmp(base, ".") && strcmp(base, ".."), TDM_STATUS_IO,
                "%s: names a directory, not a file", path);
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else {
        size_t dlen = (size_t)(slash - path);
        TDM_REQUIRE(dlen < sizeof dir, TDM_STATUS_IO, "%s: path too long", path);
        memcpy(dir, path, dlen);
        dir[dlen] = '\0';
    }
    o->dirfd = sf_open_at(dirfd, dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (o->dirfd < 0)
        return tdm_error_set(TDM_STATUS_IO, "%s: cannot open its directory %s: %s", path, dir,
                             strerror(errno));
    long name_max = fpathconf(o->dirfd, _PC_NAME_MAX);
    if (name_max <= 0 || name_max > 255) name_max = 255;
    TDM_REQUIRE(blen <= (size_t)name_max && blen < sizeof o->name, TDM_STATUS_IO,
                "%s: the file name is %zu bytes, longer than the %ld this file system allows: "
                "choose a shorter name", path, blen, name_max);
    memcpy(o->name, base, blen + 1);
    struct stat sb, db;
    if (fstatat(o->dirfd, o->name, &sb, AT_SYMLINK_NOFOLLOW) != 0) return TDM_STATUS_OK;
    if (S_ISLNK(sb.st_mode)) TDM_CHECK(sf_follow(o, path, &sb));
    TDM_REQUIRE(S_ISREG(sb.st_mode), TDM_STATUS_IO,
                "%s: exists and is %s, not a regular file: refusing to replace it; give the "
                "path of a file", path, tdm_file_kind(sb.st_mode));
    /* In a sticky directory (/tmp) only the file's or the directory's owner
     * may replace it: say so now rather than when the rename fails. */
    uid_t me = geteuid();
    TDM_REQUIRE(me == 0 || sb.st_uid == me || fstat(o->dirfd, &db) != 0 ||
                    !(db.st_mode & S_ISVTX) || db.st_uid == me, TDM_STATUS_IO,
                "%s: exists, belongs to uid %u and is in a sticky directory: you (uid %u) "
                "cannot replace it; choose another name", path, (unsigned)sb.st_uid,
                (unsigned)me);
    return TDM_STATUS_OK;
}

tdm_status tdm_file_replace_open(tdm_file_out *o, int dirfd, const char *path)
{
    tdm_status st = TDM_STATUS_OK;
    memset(o, 0, sizeof *o);
    o->fd = -1;
    o->dirfd = -1;
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "empty file name");
    /* from here on tdm_file_replace_abort cleans up */
    if (!(o->path = strdup(path)))
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
    TDM_TRY(sf_split(o, dirfd, path));
    sf_remove_stale(o->dirfd, o->name);
    if (sf_can_link_anon()) {
        o->fd = sf_open_at(o->dirfd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, SF_FILE_MODE);
        if (o->fd >= 0) {
            o->anon = 1;
            return TDM_STATUS_OK;
        }
        /* EOPNOTSUPP/EISDIR/EINVAL: a file system without O_TMPFILE;
         * anything else (EACCES, EROFS, ENOSPC) is the real answer. */
        if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
            st = tdm_error_set(TDM_STATUS_IO, "%s: cannot create a file in its directory: %s",
                               path, strerror(errno));
            goto fail;
        }
    }
    for (int tries = 0; o->fd < 0 && tries < 16; tries++) {
        sf_tmp_name(o);
        o->fd = sf_open_at(o->dirfd, o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                                                 O_CLOEXEC | O_NOCTTY, SF_FILE_MODE);
        if (o->fd < 0 && errno != EEXIST) break;
    }
    if (o->fd < 0) {
        st = tdm_error_set(TDM_STATUS_IO, "%s: cannot create a file in its directory: %s",
                           path, strerror(errno));
        o->tmp[0] = '\0';
        goto fail;
    }
    return TDM_STATUS_OK;
fail:
    tdm_file_replace_abort(o);
    return st;
}

void tdm_file_replace_abort(tdm_file_out *o)
{
    /* path is set first by tdm_file_replace_open and cleared last here: a
     * zeroed struct (fd 0) is not mistaken for an open one */
    if (!o || !o->path) return;
    if (o->fd >= 0) close(o->fd);
    if (o->tmp[0] && o->dirfd >= 0) unlinkat(o->dirfd, o->tmp, 0);
    if (o->dirfd >= 0) close(o->dirfd);
    free(o->path);
    memset(o, 0, sizeof *o);
    o->fd = -1;
    o->dirfd = -1;
}

/* Gives an O_TMPFILE its temporary name. */
static int sf_link_anon(tdm_file_out *o)
{
    for (int tries = 0; tries < 16; tries++) {
        sf_tmp_name(o);
        if (linkat(o->fd, "", o->dirfd, o->tmp, AT_EMPTY_PATH) == 0) return 0;
        if (errno == ENOENT || errno == EPERM) {
            char proc[64];
            snprintf(proc, sizeof proc, "/proc/self/fd/%d", o->fd);
            if (linkat(AT_FDCWD, proc, o->dirfd, o->tmp, AT_SYMLINK_FOLLOW) == 0) return 0;
        }
        if (errno != EEXIST) break;
    }
    o->tmp[0] = '\0';
    return -1;
}

tdm_status tdm_file_replace_commit(tdm_file_out *o)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(o && o->path && o->fd >= 0 && o->dirfd >= 0, TDM_STATUS_INVALID_ARG,
                "tdm_file_replace_commit: nothing open");
    int r;
    do r = fsync(o->fd); while (r != 0 && errno == EINTR);
    if (r != 0) {
        st = tdm_error_set(TDM_STATUS_IO, "%s: fsync failed: %s", o->path, strerror(errno));
        goto fail;
    }
    if (o->anon && sf_link_anon(o) != 0) {
        st = tdm_error_set(TDM_STATUS_IO, "%s: cannot name the new file in its directory: %s",
                           o->path, strerror(errno));
        goto fail;
    }
    if (renameat(o->dirfd, o->tmp, o->dirfd, o->name) != 0) {
        st = tdm_error_set(TDM_STATUS_IO, "%s: rename of the new file over it failed: %s",
                           o->path, strerror(errno));
        goto fail;
    }
    o->tmp[0] = '\0';
    /* Some file systems refuse fsync on directories (EINVAL); the rename
     * is then as durable as they make it. */
    do r = fsync(o->dirfd); while (r != 0 && errno == EINTR);
    if (r != 0 && errno != EINVAL && errno != EROFS)
        st = tdm_error_set(TDM_STATUS_IO, "%s: fsync of its directory failed: %s", o->path,
                           strerror(errno));
fail:
    tdm_file_replace_abort(o);
    return st;
}

tdm_status tdm_file_replace_check(int dirfd, const char *path)
{
    tdm_file_out o;
    TDM_CHECK(tdm_file_replace_open(&o, dirfd, path));
    tdm_file_replace_abort(&o);
    return TDM_STATUS_OK;
}
