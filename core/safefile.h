/* core/safefile.h: every path tandem opens for reading or writing goes
 * through here, so that another local user cannot redirect it and a
 * special file cannot hang it. tandem often runs as root on shared
 * machines; the rules (docs/SECURITY.md says how each is tested):
 *
 * - Reading: O_NONBLOCK, then fstat must say "regular file" before a byte
 *   is read (a FIFO or a device is refused at once instead of blocking).
 * - Whole files (checkpoints, traces, CSVs, plot data) are replaced
 *   atomically: the contents go to a temporary file in the target's
 *   directory that no one else can have planted (O_TMPFILE, or O_EXCL |
 *   O_NOFOLLOW under an unpredictable name), which is fsynced and renamed
 *   over the target, and the directory fsynced. A target that is not a
 *   regular file (directory, FIFO, device) is refused. A symlink at the
 *   target is judged by what it points to: a link of ours (or root's)
 *   that ends at a regular file is followed and that file replaced, the
 *   link kept; a link to anything else, a dangling one and another
 *   user's link are refused. The link itself is never replaced. A killed writer leaves no
 *   temporary file (O_TMPFILE has no name until the rename); the few
 *   microseconds between naming and renaming are covered by removing, on
 *   the next save, temporary files of ours whose writer is dead.
 * - Streams (per-rank logs, the debug log) are opened O_NOFOLLOW, and only
 *   a regular file owned by this user with one link is written to.
 * - A directory that several files go into (compare --plot, launch
 *   --log-dir) must be owned by this user (or root) and not writable by
 *   group or others, as ssh requires of ~/.ssh; then files are created
 *   relative to that directory's descriptor, so swapping the path after
 *   the check changes nothing.
 *
 * Not here: what goes in the files, and directories the caller does not
 * write into. */
#ifndef TDM_CORE_SAFEFILE_H
#define TDM_CORE_SAFEFILE_H

#include <stddef.h>
#include <sys/types.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "a regular file", "a directory", "a FIFO", "a character device", ...:
 * what a file of mode m is, for messages. */
const char *tdm_file_kind(mode_t m);

/* Opens path for reading: O_RDONLY | O_CLOEXEC | O_NOCTTY, refusing
 * (TDM_STATUS_IO, the message names the file type) anything but a regular
 * file, without blocking on a FIFO. *nbytes (may be NULL): its size. The
 * descriptor is blocking again when returned. */
tdm_status tdm_file_open_read(const char *path, int *fd_out, size_t *nbytes);

/* Opens (create != 0: creating it 0755 if absent) a directory that
 * several files will be written into, and checks it is safe: a directory,
 * owned by this user or root, not writable by group or others; if path
 * is a symbolic link, the link too must be owned by this user or root.
 * what names it in messages ("--plot"). *dirfd_out: O_RDONLY |
 * O_DIRECTORY | O_CLOEXEC, for tdm_file_open_write and
 * tdm_file_replace_open. TDM_STATUS_INVALID_ARG when unsafe (the message
 * says why and what to do), TDM_STATUS_IO when it cannot be opened. */
tdm_status tdm_dir_open_safe(const char *path, const char *what, int create, int *dirfd_out);

/* tdm_file_open_write's how. */
#define TDM_FILE_TRUNC 1
#define TDM_FILE_APPEND 2

/* Opens name (relative to dirfd; AT_FDCWD: a path) for writing, creating
 * it 0644 (less the umask) when absent: O_NOFOLLOW | O_CLOEXEC, and only
 * a regular file owned by this user with a single link; TDM_FILE_TRUNC
 * empties it after those checks, TDM_FILE_APPEND opens with O_APPEND. */
tdm_status tdm_file_open_write(int dirfd, const char *name, int how, int *fd_out);

/* A file being replaced atomically. Write the contents to fd, then
 * commit (or abort). */
typedef struct tdm_file_out {
    int fd;            /* write here */
    int dirfd;         /* the target's directory (owned) */
    int anon;          /* 1: an O_TMPFILE, named only at commit */
    char name[256];    /* the target's name in dirfd */
    char tmp[256];     /* the temporary file's name ("" while anon) */
    char *path;        /* as given, for messages (owned) */
} tdm_file_out;

/* Starts replacing path (relative to dirfd; AT_FDCWD: a path as usual).
 * Fails (TDM_STATUS_IO, with what to do) when the directory cannot be
 * opened or written, the name is too long for the file system, or path
 * exists and is not a regular file, nor a symlink of ours or root's that
 * leads to one (then that file is the one replaced). The file is created
 * 0644 less the umask: never writable by others. */
tdm_status tdm_file_replace_open(tdm_file_out *o, int dirfd, const char *path);
/* fsync, rename over the target, fsync the directory; closes everything.
 * On failure before the rename the target is untouched and the temporary
 * file gone; if only the directory fsync fails, the target already holds
 * the new contents (their rename may not be durable yet). */
tdm_status tdm_file_replace_commit(tdm_file_out *o);
/* Drops the temporary file; the target is untouched. Idempotent; a
 * zeroed, failed-to-open or already committed o is fine. */
void tdm_file_replace_abort(tdm_file_out *o);
/* What tdm_file_replace_open checks, and a temporary file made and
 * dropped, so that a bad path fails before hours of work (train --save,
 * compare --trace). Leaves nothing behind. */
tdm_status tdm_file_replace_check(int dirfd, const char *path);

/* write(2) until done, retrying EINTR; the message names path. */
tdm_status tdm_file_write_all(int fd, const void *data, size_t nbytes, const char *path);

#ifdef __cplusplus
}
#endif

#endif
