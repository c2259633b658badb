/* core/proc.c: /proc/PID/stat (see core/proc.h). */
#include "core/proc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

const char *tdm_proc_stat(pid_t pid, char *buf, size_t cap)
{
    if (pid <= 0 || cap < 64) {
        errno = EINVAL;
        return NULL;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    ssize_t n;
    do n = read(fd, buf, cap - 1); while (n < 0 && errno == EINTR);
    int err = errno;
    close(fd);
    if (n < 0) {
        errno = err;
        return NULL;
    }
    buf[n] = '\0';
    /* the command name is in parentheses and may hold ")": the last one
     * ends it */
    const char *p = n > 0 ? strrchr(buf, ')') : NULL;
    if (!(p && p[1] == ' ' && p[2])) {
        errno = EIO;
        return NULL;
    }
    return p + 2;
}
