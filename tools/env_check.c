/* tools/env_check.c: the TANDEM_* environment variables that hold a number
 * or a directory, checked once when a command starts (tdm_tool_check_env,
 * tools/tools.h). The library reads them where they are used and, given
 * garbage, falls back to a default with a warning, or ignores them; from
 * the command line that would run a job with a bound nobody asked for, so
 * tandem refuses it here with one line saying the rule (exit 2). Not the
 * place of each variable's meaning: docs/DEBUGGING.md, docs/MULTINODE.md,
 * docs/SHM.md. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/flight.h"
#include "core/safefile.h"
#include "tools/tools.h"

/* The largest time any of the millisecond variables may give: a week.
 * Beyond that a bound is no bound, and the waits' nanosecond arithmetic
 * would come close to overflowing. */
#define TDM_ENV_MAX_MS (7LL * 24 * 3600 * 1000)
/* Spin and yield times (microseconds): ten seconds is far past useful. */
#define TDM_ENV_MAX_US (10LL * 1000 * 1000)

typedef struct tdm_env_int {
    const char *name;
    long long lo, hi;
    const char *what;      /* "milliseconds", ... (for the message) */
} tdm_env_int;

static const tdm_env_int tdm_env_ints[] = {
    {"TANDEM_MPI_TIMEOUT_MS", 1, TDM_ENV_MAX_MS, "milliseconds"},
    {"TANDEM_MPI_JOIN_TIMEOUT_MS", 1, TDM_ENV_MAX_MS, "milliseconds"},
    {"TANDEM_MPI_INIT_TIMEOUT_MS", 1, TDM_ENV_MAX_MS, "milliseconds"},
    {"TANDEM_NCCL_TIMEOUT_MS", 1, TDM_ENV_MAX_MS, "milliseconds"},
    /* 0 or negative: stall detection off (docs/SHM.md) */
    {"TANDEM_SHM_STALL_MS", -TDM_ENV_MAX_MS, TDM_ENV_MAX_MS,
     "milliseconds (0 or negative: off)"},
    {"TANDEM_MPI_SPIN_US", 0, TDM_ENV_MAX_US, "microseconds"},
    {"TANDEM_MPI_YIELD_US", 0, TDM_ENV_MAX_US, "microseconds"},
    {"TANDEM_SHM_SPIN_US", 0, TDM_ENV_MAX_US, "microseconds"},
    {"TANDEM_SHM_NT_BYTES", 0, 1LL << 40, "bytes"},
    {"TANDEM_FR_SIZE", 0, TDM_FR_MAX_SIZE, "flight-recorder entries (0: off)"},
    {"TANDEM_CUDA_EMULATOR", 1, 64, "emulated CUDA devices"},
    {"TANDEM_RESTART_COUNT", 0, 1000000, "restarts so far (set by tandem launch)"},
    {"TANDEM_TEST_MEM_LIMIT", 0, 1LL << 62, "bytes"},
    {"TANDEM_TEST_DEV_FAIL_AFTER", 0, 1LL << 62, "device calls before each fails"},
};

typedef struct tdm_env_word {
    const char *name;
    const char *words;     /* the values it takes, separated by '|' */
} tdm_env_word;

static const tdm_env_word tdm_env_words[] = {
    {"TANDEM_MPI_NB", "async|all|none"},
    {"TANDEM_MPI_THREAD_LEVEL", "single|funneled|serialized|multiple"},
};

static int tdm_env_word_ok(const char *v, const char *words)
{
    size_t n = strlen(v);
    for (const char *p = words; *p;) {
        size_t k = strcspn(p, "|");
        if (k == n && !strncmp(p, v, n)) return 1;
        p += k + (p[k] == '|');
    }
    return 0;
}

tdm_status tdm_tool_check_env(const char *tool)
{
    for (size_t i = 0; i < sizeof tdm_env_ints / sizeof tdm_env_ints[0]; i++) {
        const tdm_env_int *e = &tdm_env_ints[i];
        const char *v = getenv(e->name);
        if (!v || !*v) continue;
        char *end;
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end || x < e->lo || x > e->hi)
            return tdm_tool_usage_error("%s: %s='%s' is not a whole number of %s from %lld to "
                                        "%lld; fix it or unset it\n", tool, e->name, v, e->what,
                                        e->lo, e->hi);
    }
    for (size_t i = 0; i < sizeof tdm_env_words / sizeof tdm_env_words[0]; i++) {
        const char *v = getenv(tdm_env_words[i].name);
        if (v && *v && !tdm_env_word_ok(v, tdm_env_words[i].words))
            return tdm_tool_usage_error("%s: %s='%s': expected %s; fix it or unset it\n", tool,
                                        tdm_env_words[i].name, v, tdm_env_words[i].words);
    }
    /* the ranks' flight recorders dump into it (core/flight.h): a FIFO, a
     * device or a file there would lose every dump without a word */
    const char *dump = getenv("TANDEM_FR_DUMP");
    struct stat sb, lb;
    if (dump && *dump) {
        if (stat(dump, &sb) != 0)
            return tdm_tool_usage_error("%s: TANDEM_FR_DUMP=%s: %s; create the directory or "
                                        "unset it\n", tool, dump, strerror(errno));
        if (!S_ISDIR(sb.st_mode))
            return tdm_tool_usage_error("%s: TANDEM_FR_DUMP=%s: is %s%s, not a directory; name "
                                        "a directory or unset it\n", tool, dump,
                                        lstat(dump, &lb) == 0 && S_ISLNK(lb.st_mode)
                                            ? "a symbolic link to " : "",
                                        tdm_file_kind(sb.st_mode));
    }
    return TDM_STATUS_OK;
}
