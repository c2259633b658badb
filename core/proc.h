/* core/proc.h: another process as /proc/PID/stat tells it (its state
 * letter, its exit code once a zombie, its CPU time), read in one place
 * for the liveness checks of shm/, rpc/ and mpi/ and the launcher's
 * teardown. Linux only. */
#ifndef TDM_CORE_PROC_H
#define TDM_CORE_PROC_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Reads /proc/pid/stat into buf (cap bytes, at least 64) and returns its
 * fields after the command name (which may itself hold spaces and
 * parentheses), the state letter first: "S 1 2 ...", field 3 of proc(5)
 * onwards. NULL when it cannot be read, errno set: ENOENT when there is no
 * such process, EIO when the line is empty or malformed, else open's or
 * read's. */
const char *tdm_proc_stat(pid_t pid, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
