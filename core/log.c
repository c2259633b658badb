/* core/log.c: TANDEM_DEBUG logging. The configuration is parsed on first
 * use (once, under a mutex; tdm_log_reset makes the next use parse it
 * again); each line is formatted into one buffer and written
 * with a single write(2) so lines from threads and ranks do not mix. */
#include "core/log.h"

#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <fcntl.h>

#include "core/safefile.h"

static const char *const tdm_log_subsys_names[TDM_LOG_SUBSYS_COUNT_] = {
    [TDM_LOG_CORE] = "CORE", [TDM_LOG_DEVICE] = "DEVICE",
    [TDM_LOG_MODEL] = "MODEL", [TDM_LOG_DATA] = "DATA",
    [TDM_LOG_DP] = "DP", [TDM_LOG_DDP] = "DDP", [TDM_LOG_SHM] = "SHM",
    [TDM_LOG_CUDA] = "CUDA", [TDM_LOG_TOOL] = "TOOL", [TDM_LOG_MPI] = "MPI",
    [TDM_LOG_FSDP] = "FSDP",
};
static const char *const tdm_log_level_names[] = {
    "NONE", "WARN", "INFO", "TRACE",
};

/* -1: not parsed yet. Relaxed is enough: the parse is idempotent and every
 * thread computes the same value from the same environment. */
static atomic_int tdm_log_level_cur = -1;
static atomic_uint tdm_log_subsys_mask;
static atomic_int tdm_log_fd = 2;
static atomic_int tdm_log_rank = -1;

static void tdm_log_parse(void)
{
    int level = TDM_LOG_LEVEL_WARN;
    const char *lv = getenv("TANDEM_DEBUG");
    if (lv && *lv) {
        if (!strcasecmp(lv, "INFO")) level = TDM_LOG_LEVEL_INFO;
        else if (!strcasecmp(lv, "TRACE")) level = TDM_LOG_LEVEL_TRACE;
        else if (!strcasecmp(lv, "NONE") || !strcasecmp(lv, "OFF")) level = TDM_LOG_LEVEL_NONE;
        else level = TDM_LOG_LEVEL_WARN;
    }
    unsigned mask = (1u << TDM_LOG_SUBSYS_COUNT_) - 1;
    const char *ss = getenv("TANDEM_DEBUG_SUBSYS");
    if (ss && *ss) {
        int invert = ss[0] == '^';
        unsigned sel = 0;
        char buf[256];
        snprintf(buf, sizeof buf, "%s", ss + invert);
        for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
             tok = strtok_r(NULL, ",", &save)) {
            while (isspace((unsigned char)*tok)) tok++;
            if (!strcasecmp(tok, "ALL")) sel = mask;
            for (int i = 0; i < TDM_LOG_SUBSYS_COUNT_; i++)
                if (!strcasecmp(tok, tdm_log_subsys_names[i])) sel |= 1u << i;
        }
        mask = invert ? (mask & ~sel) : sel;
    }
    const char *file = getenv("TANDEM_DEBUG_FILE");
    if (file && *file) {
        char path[512];
        size_t o = 0;
        for (const char *p = file; *p && o + 16 < sizeof path; p++) {
            if (p[0] == '%' && p[1] == 'p') {
                o += (size_t)snprintf(path + o, sizeof path - o, "%d", (int)getpid());
                p++;
            } else {
                path[o++] = *p;
            }
        }
        path[o] = '\0';
        /* core/safefile.h: no symlink followed, only a regular file of
         * ours. Parsing may happen inside a caller's error path: its
         * message is kept. */
        char saved[TDM_ERROR_MSG_MAX];
        snprintf(saved, sizeof saved, "%s", tdm_error_message());
        int fd = -1;
        if (tdm_file_open_write(AT_FDCWD, path, TDM_FILE_APPEND, &fd) == TDM_STATUS_OK) {
            int old = atomic_exchange(&tdm_log_fd, fd);
            if (old > 2) close(old);
        } else {
            char line[TDM_ERROR_MSG_MAX + 64];
            int n = snprintf(line, sizeof line, "tandem: TANDEM_DEBUG_FILE: %s; logging to "
                             "stderr\n", tdm_error_message());
            if (n > 0) {
                ssize_t w = write(STDERR_FILENO, line,
                                  (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
                (void)w;   /* nowhere left to report a failure */
            }
        }
        tdm_error_copy_from(saved);
    }
    atomic_store_explicit(&tdm_log_subsys_mask, mask, memory_order_relaxed);
    atomic_store_explicit(&tdm_log_level_cur, level, memory_order_release);
}

int tdm_log_enabled(tdm_log_level level, tdm_log_subsys subsys)
{
    int cur = atomic_load_explicit(&tdm_log_level_cur, memory_order_relaxed);
    if (cur < 0) {
        /* first use: one thread parses (and opens the log file) */
        static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&mu);
        if (atomic_load_explicit(&tdm_log_level_cur, memory_order_acquire) < 0) tdm_log_parse();
        pthread_mutex_unlock(&mu);
        cur = atomic_load_explicit(&tdm_log_level_cur, memory_order_relaxed);
    }
    if ((int)level > cur) return 0;
    unsigned mask = atomic_load_explicit(&tdm_log_subsys_mask, memory_order_relaxed);
    return (mask >> subsys) & 1u;
}

void tdm_log_set_rank(int rank)
{
    atomic_store_explicit(&tdm_log_rank, rank, memory_order_relaxed);
}

void tdm_log_reset(void)
{
    int fd = atomic_exchange(&tdm_log_fd, 2);
    if (fd > 2) close(fd);
    atomic_store(&tdm_log_level_cur, -1);
}

void tdm_log_write(tdm_log_level level, tdm_log_subsys subsys, const char *fmt, ...)
{
    char line[2048];
    int n;
    int rank = atomic_load_explicit(&tdm_log_rank, memory_order_relaxed);
    if (rank >= 0)
        n = snprintf(line, sizeof line, "tandem %d [rank %d] %s %s: ", (int)getpid(), rank,
                     tdm_log_subsys_names[subsys], tdm_log_level_names[level]);
    else
        n = snprintf(line, sizeof line, "tandem %d %s %s: ", (int)getpid(),
                     tdm_log_subsys_names[subsys], tdm_log_level_names[level]);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(atomic_load_explicit(&tdm_log_fd, memory_order_relaxed), line, (size_t)n);
    (void)w; /* a lost debug line is not worth failing over */
}
