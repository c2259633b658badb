/* core/status.c: status names and the per-thread error message buffer.
 * Messages are thread-local so worker threads (DP pool, DDP comm thread)
 * never race on them; pools copy a worker's message to the caller. */
#include "core/status.h"

#include <stdio.h>
#include <string.h>


static _Thread_local char tdm_error_buf[TDM_ERROR_MSG_MAX];

static const char *const tdm_status_names[TDM_STATUS_COUNT_] = {
    [TDM_STATUS_OK] = "ok",
    [TDM_STATUS_INVALID_ARG] = "invalid argument",
    [TDM_STATUS_OUT_OF_MEMORY] = "out of memory",
    [TDM_STATUS_IO] = "i/o error",
    [TDM_STATUS_FORMAT] = "bad format",
    [TDM_STATUS_SYSTEM] = "system error",
    [TDM_STATUS_TIMEOUT] = "timeout",
    [TDM_STATUS_PEER_FAILED] = "peer failed",
    [TDM_STATUS_MISMATCH] = "mismatch between ranks",
    [TDM_STATUS_ABORTED] = "aborted",
    [TDM_STATUS_UNSUPPORTED] = "unsupported",
    [TDM_STATUS_NO_DEVICE] = "no such device",
    [TDM_STATUS_INTERNAL] = "internal error",
    [TDM_STATUS_NONFINITE] = "non-finite value",
    [TDM_STATUS_USAGE] = "bad usage",
};

const char *tdm_status_name(tdm_status s)
{
    if ((unsigned)s >= TDM_STATUS_COUNT_ || !tdm_status_names[s])
        return "unknown status";
    return tdm_status_names[s];
}

tdm_status tdm_error_setv(tdm_status s, const char *fmt, va_list ap)
{
    vsnprintf(tdm_error_buf, sizeof tdm_error_buf, fmt, ap);
    return s;
}

tdm_status tdm_error_set(tdm_status s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    tdm_error_setv(s, fmt, ap);
    va_end(ap);
    return s;
}

tdm_status tdm_error_prefix(tdm_status s, const char *fmt, ...)
{
    char prefix[256];
    char old[TDM_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, tdm_error_buf, sizeof old);
    const char *rest = old[0] ? old : tdm_status_name(s);
    /* "<prefix>: <old message>", cut at the buffer's end (intended). */
    size_t n = strlen(prefix);
    if (n > TDM_ERROR_MSG_MAX - 3) n = TDM_ERROR_MSG_MAX - 3;
    memcpy(tdm_error_buf, prefix, n);
    tdm_error_buf[n++] = ':';
    tdm_error_buf[n++] = ' ';
    size_t m = strlen(rest);
    if (m > TDM_ERROR_MSG_MAX - 1 - n) m = TDM_ERROR_MSG_MAX - 1 - n;
    memcpy(tdm_error_buf + n, rest, m);
    tdm_error_buf[n + m] = '\0';
    return s;
}

const char *tdm_error_message(void) { return tdm_error_buf; }

void tdm_error_copy_from(const char *msg)
{
    if (msg == tdm_error_buf) return;
    snprintf(tdm_error_buf, sizeof tdm_error_buf, "%s", msg ? msg : "");
}

void tdm_error_clear(void) { tdm_error_buf[0] = '\0'; }
