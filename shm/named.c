/* shm/named.c: segments created and joined by name, for ranks that are not
 * children of one process (an MPI job's ranks on one machine; mpi/ agrees
 * on the name). The name lives in /dev/shm (shm_open) only between
 * creation and the moment every rank has attached: the creator unlinks it
 * then, so that a crash later leaves nothing behind. Creating refuses an
 * existing name (O_EXCL) and makes the file 0600; attaching refuses a
 * symbolic link (shm_open's O_NOFOLLOW), a file that is not regular, not
 * this user's or not mode 0600, and a segment whose header (magic,
 * version, layout, world) is wrong or whose job id is not the one agreed.
 * After that the communicator is the same as a forked rank's.
 * Not the segment's layout, validation or joining (shm/segment.c). */
#include "shm/shm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/log.h"

/* "/name": one component, no other slash, short enough for /dev/shm. */
static tdm_status tdm_shm_name_check(const char *name)
{
    TDM_REQUIRE(name && name[0] == '/' && name[1] && !strchr(name + 1, '/') &&
                    strlen(name) < 200,
                TDM_STATUS_INVALID_ARG, "shm: segment name '%s' must be '/' and one component "
                "of fewer than 200 characters", name ? name : "(null)");
    return TDM_STATUS_OK;
}

tdm_status tdm_shm_group_create_named(tdm_shm_group **out, const char *name, int world,
                                      uint64_t job_id, const tdm_shm_opts *opts)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "tdm_shm_group_create_named: out is NULL");
    *out = NULL;
    TDM_CHECK(tdm_shm_name_check(name));
    int fd;
    do fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    while (fd < 0 && errno == EINTR);
    if (fd < 0 && errno == EEXIST)
        return tdm_error_set(TDM_STATUS_MISMATCH, "shm: /dev/shm%s already exists: another job "
                             "uses this name (or one that crashed before every rank attached "
                             "left it: remove it if no such job runs)", name);
    if (fd < 0)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: shm_open(%s, O_CREAT | O_EXCL): %s", name,
                             strerror(errno));
    /* exactly 0600 whatever the umask: the check on attach expects it */
    if (fchmod(fd, 0600) != 0) {
        tdm_status st = tdm_error_set(TDM_STATUS_SYSTEM, "shm: fchmod(/dev/shm%s, 0600): %s",
                                      name, strerror(errno));
        close(fd);
        shm_unlink(name);
        return st;
    }
    char where[256];
    snprintf(where, sizeof where, "/dev/shm%s", name);
    tdm_status st = tdm_shm_group_create_at(out, world, opts, fd, where, job_id);
    if (st != TDM_STATUS_OK) {
        /* ours, half made: nobody may find it */
        char keep[TDM_ERROR_MSG_MAX];
        snprintf(keep, sizeof keep, "%s", tdm_error_message());
        shm_unlink(name);
        tdm_error_set(st, "%s", keep);
    }
    return st;
}

tdm_status tdm_shm_comm_attach_named(tdm_comm **out, const char *name, int rank, int world,
                                     uint64_t job_id, const tdm_shm_opts *opts)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "tdm_shm_comm_attach_named: out is NULL");
    *out = NULL;
    TDM_CHECK(tdm_shm_name_check(name));
    TDM_REQUIRE(job_id != 0, TDM_STATUS_INVALID_ARG, "shm: attaching to %s needs the job id "
                "its creator wrote", name);
    int fd;
    /* glibc's shm_open adds O_NOFOLLOW: a symbolic link is refused */
    do fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return tdm_error_set(errno == ENOENT ? TDM_STATUS_PEER_FAILED : TDM_STATUS_SYSTEM,
                             "shm: cannot open /dev/shm%s: %s%s", name, strerror(errno),
                             errno == ENOENT ? " (its creator has not made it, or removed it)"
                                             : "");
    struct stat sb;
    tdm_status st = TDM_STATUS_OK;
    if (fstat(fd, &sb) != 0)
        st = tdm_error_set(TDM_STATUS_SYSTEM, "shm: fstat of /dev/shm%s: %s", name,
                           strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = tdm_error_set(TDM_STATUS_FORMAT, "shm: /dev/shm%s is not a regular file: refusing "
                           "it", name);
    else if (sb.st_uid != geteuid())
        st = tdm_error_set(TDM_STATUS_MISMATCH, "shm: /dev/shm%s belongs to uid %u, not to this "
                           "user (uid %u): refusing it", name, (unsigned)sb.st_uid,
                           (unsigned)geteuid());
    else if ((sb.st_mode & 07777) != 0600)
        st = tdm_error_set(TDM_STATUS_MISMATCH, "shm: /dev/shm%s has mode %04o, not 0600 (other "
                           "users could read or write it): refusing it", name,
                           (unsigned)(sb.st_mode & 07777));
    if (st == TDM_STATUS_OK) st = tdm_shm_attach_fd_job(out, fd, rank, world, opts, job_id);
    /* mapped (or refused): the descriptor is not needed any more */
    close(fd);
    if (st != TDM_STATUS_OK) {
        tdm_error_prefix(st, "attaching to /dev/shm%s as rank %d", name, rank);
        return st;
    }
    /* The last rank to attach removes the name at once, before any rank
     * can get past its first collective (which needs them all): a crash
     * from there on leaves nothing. (The creator removes it too, and on
     * the join timeout.) */
    const tdm_shm_impl *c = tdm_comm_impl(*out);
    int attached = 0;
    for (int r = 0; r < world; r++)
        attached += atomic_load_explicit(&tdm_shm_ctrl_of(c, r)->state, memory_order_acquire) !=
                    TDM_SHM_STATE_EMPTY;
    if (attached == world && shm_unlink(name) != 0 && errno != ENOENT)
        TDM_WARN(SHM, "shm_unlink(%s): %s", name, strerror(errno));
    return TDM_STATUS_OK;
}

int tdm_shm_group_rank_attached(const tdm_shm_group *g, int rank)
{
    if (!g || rank < 0 || rank >= g->world) return 0;
    const tdm_shm_ctrl *k = tdm_shm_geom_ctrl(&g->geom, g->base, rank);
    return atomic_load_explicit(&k->state, memory_order_acquire) != TDM_SHM_STATE_EMPTY;
}

int tdm_shm_group_attached(const tdm_shm_group *g)
{
    int n = 0;
    for (int r = 0; g && r < g->world; r++) n += tdm_shm_group_rank_attached(g, r);
    return n;
}

tdm_status tdm_shm_unlink_named(const char *name)
{
    TDM_CHECK(tdm_shm_name_check(name));
    if (shm_unlink(name) != 0 && errno != ENOENT)
        return tdm_error_set(TDM_STATUS_SYSTEM, "shm: shm_unlink(%s): %s", name, strerror(errno));
    return TDM_STATUS_OK;
}
