/* tools/elastic.c: the restart loop of `tandem launch --max-restarts K`
 * around one launch (tdm_launch_run_once), and the helpers `tandem train
 * --max-restarts` shares: attempt count, backoff, what a checkpoint holds.
 * Not a rendezvous: one machine, the same world size every attempt. */
#include "tools/elastic.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "tools/args.h"
#include "tools/tools.h"

char tdm_elastic_cause[1024];

int tdm_elastic_attempt(void)
{
    const char *s = getenv(TDM_ELASTIC_ENV_COUNT);
    int v = s ? atoi(s) : 0;
    return v > 0 ? v : 0;
}

void tdm_elastic_set_attempt(int attempt)
{
    char buf[16];
    snprintf(buf, sizeof buf, "%d", attempt);
    setenv(TDM_ELASTIC_ENV_COUNT, buf, 1);
}

int tdm_elastic_backoff(int attempt)
{
    int ms = 200;
    for (int i = 1; i < attempt && ms < 5000; i++) ms *= 2;
    if (ms > 5000) ms = 5000;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
    return ms;
}

int tdm_elastic_describe(const char *ckpt, char *out, size_t n)
{
    if (!ckpt) {
        snprintf(out, n, "from the start (no checkpoint named)");
        return 0;
    }
    if (access(ckpt, F_OK) != 0) {
        snprintf(out, n, "from the start (%s does not exist yet)", ckpt);
        return 0;
    }
    tdm_st_file *f = NULL;
    if (tdm_st_load(&f, ckpt)) {
        snprintf(out, n, "from the start (%s is not a checkpoint: %s)", ckpt, tdm_error_message());
        return 0;
    }
    const char *ep = tdm_st_meta_get(f, "epoch"), *st = tdm_st_meta_get(f, "step");
    snprintf(out, n, "from %s (epoch %s, step %s)", ckpt, ep ? ep : "?", st ? st : "?");
    tdm_st_free(f);
    return 1;
}

/* Takes --max-restarts K and --checkpoint PATH out of the launcher's own
 * options (before the program), leaving the rest for one launch. */
int tdm_tool_launch_main(int argc, char **argv)
{
    long long max_restarts = 0;
    const char *ckpt = NULL;
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    if (!rest) return 1;
    int n = 0, in_prog = 0;
    for (int i = 0; i < argc; i++) {
        const char *v;
        if (i > 0 && !in_prog) {
            if (!strcmp(argv[i], "--") || argv[i][0] != '-') in_prog = 1;
            else if (!strcmp(argv[i], "-n") || !strcmp(argv[i], "--nproc") ||
                     !strcmp(argv[i], "--log-dir") || !strcmp(argv[i], "--arena-mb") ||
                     !strcmp(argv[i], "--grace-ms") || !strcmp(argv[i], "--timeout")) {
                rest[n++] = argv[i];                      /* an option and its value */
                if (i + 1 < argc) rest[n++] = argv[++i];
                continue;
            }
            int at = i;
            if (tdm_args_value(argc, argv, &i, "--max-restarts", &v) != TDM_STATUS_OK ||
                (v && tdm_args_int("--max-restarts", v, 0, TDM_ELASTIC_MAX, &max_restarts) !=
                          TDM_STATUS_OK)) {
                free(rest);
                return tdm_tool_exit(TDM_STATUS_USAGE);
            }
            if (v) continue;
            i = at;
            if (tdm_args_value(argc, argv, &i, "--checkpoint", &v) != TDM_STATUS_OK) {
                free(rest);
                return tdm_tool_exit(TDM_STATUS_USAGE);
            }
            if (v) {
                ckpt = v;
                continue;
            }
            i = at;
        }
        rest[n++] = argv[i];
    }
    rest[n] = NULL;
    if (ckpt) setenv(TDM_ELASTIC_ENV_RESUME, ckpt, 1);
    int rc;
    for (int attempt = 0;; attempt++) {
        tdm_elastic_set_attempt(attempt);
        tdm_elastic_cause[0] = 0;
        rc = tdm_launch_run_once(n, rest);
        /* only a rank's failure is restarted: not success, bad usage, or
         * a signal the launcher received (Ctrl-C, SIGTERM) */
        if (rc != 1 || attempt >= max_restarts || !tdm_elastic_cause[0]) break;
        char from[512];
        if (ckpt) tdm_elastic_describe(ckpt, from, sizeof from);
        else snprintf(from, sizeof from, "(no --checkpoint named: each resumes from its own, "
                                         "tandem train from its --save)");
        int ms = tdm_elastic_backoff(attempt + 1);
        fprintf(stderr, "tandem launch: restart %d of %lld after %d ms: %s; every rank starts "
                        "again %s\n", attempt + 1, max_restarts, ms, tdm_elastic_cause, from);
    }
    free(rest);
    return rc;
}
