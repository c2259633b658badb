/* core/status.h: status codes, the thread-local error message, and the
 * TDM_TRY / TDM_CHECK propagation macros used by every module.
 * Not a logging facility (see core/log.h): a status travels up to the
 * caller, and only tools/ turns it into a message and an exit code. */
#ifndef TDM_CORE_STATUS_H
#define TDM_CORE_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_status {
    TDM_STATUS_OK = 0,
    TDM_STATUS_INVALID_ARG,   /* caller passed something impossible */
    TDM_STATUS_OUT_OF_MEMORY,
    TDM_STATUS_IO,            /* open/read/write/fsync/rename failed */
    TDM_STATUS_FORMAT,        /* a file or segment is not what it claims */
    TDM_STATUS_SYSTEM,        /* a system or pthread call failed */
    TDM_STATUS_TIMEOUT,       /* a wait passed its deadline */
    TDM_STATUS_PEER_FAILED,   /* another rank died or aborted */
    TDM_STATUS_MISMATCH,      /* ranks disagree (collective, layout) */
    TDM_STATUS_ABORTED,       /* the group abort flag was raised */
    TDM_STATUS_UNSUPPORTED,   /* valid request this build cannot do */
    TDM_STATUS_NO_DEVICE,     /* the requested device does not exist */
    TDM_STATUS_INTERNAL,      /* a bug: an invariant did not hold */
    TDM_STATUS_NONFINITE,     /* a loss, gradient or parameter is NaN or infinite */
    /* the command line asks for something impossible: tools/ only (exit
     * code 2); the library reports a bad argument as INVALID_ARG and
     * tools/ decides which of those came from the command line */
    TDM_STATUS_USAGE,
    TDM_STATUS_COUNT_
} tdm_status;

/* "ok", "invalid argument", ... never NULL. */
const char *tdm_status_name(tdm_status s);

/* Longest message kept (with its NUL); longer ones are truncated. */
#define TDM_ERROR_MSG_MAX 1024

/* Records a formatted message for the calling thread and returns s, so
 * that `return tdm_error_set(TDM_STATUS_IO, "%s: %s", path, strerror(e));`
 * reads naturally. */
tdm_status tdm_error_set(tdm_status s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
tdm_status tdm_error_setv(tdm_status s, const char *fmt, va_list ap);

/* Puts "<prefix>: " in front of the current message (context added while
 * unwinding: "replica 1 on device cpu:1: <message>"). Returns s. */
tdm_status tdm_error_prefix(tdm_status s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The calling thread's last message; "" when none was set. */
const char *tdm_error_message(void);
/* Copies another thread's message into this thread (used by pools). */
void tdm_error_copy_from(const char *msg);
void tdm_error_clear(void);

/* Propagate a failure to the one `fail:` label of the function; the
 * function declares `tdm_status st = TDM_STATUS_OK;`. */
#define TDM_TRY(expr)                                                   \
    do {                                                                \
        tdm_status tdm_try_s_ = (expr);                                 \
        if (tdm_try_s_ != TDM_STATUS_OK) {                              \
            st = tdm_try_s_;                                            \
            goto fail;                                                  \
        }                                                               \
    } while (0)

/* Return at once on failure (functions with nothing to clean up). */
#define TDM_CHECK(expr)                                                 \
    do {                                                                \
        tdm_status tdm_chk_s_ = (expr);                                 \
        if (tdm_chk_s_ != TDM_STATUS_OK) return tdm_chk_s_;             \
    } while (0)

/* Fail with a message unless cond holds (argument validation). */
#define TDM_REQUIRE(cond, status, ...)                                  \
    do {                                                                \
        if (!(cond)) return tdm_error_set((status), __VA_ARGS__);       \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
