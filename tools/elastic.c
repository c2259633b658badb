/* tools/elastic.c: the restart loop of `tandem launch --max-restarts K`
 * around one launch (tdm_launch_run_once), what `tandem train
 * --max-restarts` says around the restarts dist/run.c runs, what a
 * checkpoint holds, and the test fault hook. Not a rendezvous: one
 * machine, the same world size every attempt. */
#include "tools/elastic.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "tools/args.h"
#include "tools/doctor.h"
#include "tools/tools.h"

char tdm_elastic_cause[1024];

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
    if (tdm_st_load_header(&f, ckpt)) {   /* its epoch and step: never its data */
        snprintf(out, n, "from the start (%s is not a checkpoint: %s)", ckpt, tdm_error_message());
        return 0;
    }
    const char *ep = tdm_st_meta_get(f, "epoch"), *st = tdm_st_meta_get(f, "step");
    snprintf(out, n, "from %s (epoch %s, step %s)", ckpt, ep ? ep : "?", st ? st : "?");
    tdm_st_free(f);
    return 1;
}

/* ---- tandem train's forked ranks (dist/run.h's watch) ---- */

/* An unsafe TANDEM_FR_DUMP (tools/doctor.h) stops the run before any
 * rank starts: said, and USAGE. */
static tdm_status tdm_elastic_begin(void *ctx, int attempt)
{
    tdm_elastic_watch *w = ctx;
    (void)attempt;
    tdm_status st = tdm_doctor_job_begin(&w->frj, w->tool, NULL);
    if (st) tdm_elastic_log_free(&w->failures);
    return st;
}

static void tdm_elastic_settled(const tdm_shm_watch *sw, void *ctx)
{
    tdm_doctor_job_settled(sw, &((tdm_elastic_watch *)ctx)->frj);
}

static void tdm_elastic_end(void *ctx, tdm_status st, int world, const tdm_shm_spawn_result *res,
                            int last)
{
    tdm_elastic_watch *w = ctx;
    if (st == TDM_STATUS_OK) {
        tdm_doctor_job_end(&w->frj, 0, world, NULL, NULL, NULL, NULL);
        tdm_elastic_log_free(&w->failures);
        return;
    }
    snprintf(w->why, sizeof w->why, "%s", tdm_error_message());
    fprintf(stderr, "%s: %s: %s\n", w->tool, w->mode, w->why);
    for (int r = 0; w->has_shape && res && r < world; r++) {
        /* a stopped rank (the teardown's SIGKILL ended it) is named too */
        int stopped = r < TDM_SHM_MAX_RANKS && w->frj.stalled[r];
        if (!stopped && (!WIFSIGNALED(res->wstatus[r]) || WTERMSIG(res->wstatus[r]) == SIGTERM ||
                         res->induced[r]))
            continue;
        int c[TDM_MESH_NDIMS];
        char s[64], how[48];
        tdm_mesh_coords_of(&w->shape, r, c);
        tdm_mesh_shape_str(&w->shape, s, sizeof s);
        if (stopped) snprintf(how, sizeof how, "stopped");
        else snprintf(how, sizeof how, "killed by signal %d", WTERMSIG(res->wstatus[r]));
        fprintf(stderr, "%s: rank %d (%s) is at dp %d, pp %d, tp %d of the mesh %s\n", w->tool,
                r, how, c[TDM_MESH_DP], c[TDM_MESH_PP], c[TDM_MESH_TP], s);
    }
    tdm_doctor_job_end(&w->frj, 1, world, res->pid, res->wstatus, res->induced, w->why);
    if (st == TDM_STATUS_PEER_FAILED) tdm_elastic_log_add(&w->failures, w->why);
    if (!last) return;
    if (w->stop[0])
        fprintf(stderr, "%s: %s\n", w->tool, w->stop);
    else if (st == TDM_STATUS_PEER_FAILED)
        tdm_elastic_log_used_up(&w->failures, w->tool, w->max_restarts);
    tdm_elastic_log_free(&w->failures);
}

/* Where a restart of `tandem train` resumes (dist/run.c chose resume:
 * save once this job wrote it, else the user's own --resume, else the
 * start), and why not from save. */
static void tdm_elastic_restart_from(const char *save, const char *resume, char *out, size_t n)
{
    char why[512] = "", from[512];
    if (resume && save && !strcmp(resume, save)) {
        tdm_elastic_describe(save, out, n);
        return;
    }
    int ours = 0;
    if (save) (void)tdm_dist_restart_ours(save, &ours, why, sizeof why);  /* why says it */
    if (resume) {
        tdm_elastic_describe(resume, from, sizeof from);
        snprintf(out, n, "%s%s%s%s", from, why[0] ? " (" : "", why, why[0] ? ")" : "");
    } else if (!save) {
        snprintf(out, n, "from the start (no --save or --resume named)");
    } else if (access(save, F_OK) == 0) {
        snprintf(out, n, "from the start: %s (this job failed before its first save)", why);
    } else {
        snprintf(out, n, "from the start (this job failed before its first save to %s)", save);
    }
}

static void tdm_elastic_restart(void *ctx, int attempt, long long max_restarts, int backoff_ms,
                                const char *resume)
{
    tdm_elastic_watch *w = ctx;
    char from[1200];
    tdm_elastic_restart_from(w->save, resume, from, sizeof from);
    fprintf(stderr, "%s: restart %d of %lld after %d ms: %s; every rank starts again %s\n",
            w->tool, attempt, max_restarts, backoff_ms, w->why, from);
    fflush(stdout);
}

/* --min-devices: the job goes on with fewer ranks, or cannot. */
static void tdm_elastic_resize(void *ctx, int failed, int from, int to, int left)
{
    tdm_elastic_watch *w = ctx;
    if (to == 0) {
        snprintf(w->stop, sizeof w->stop, "rank %d failed on two attempts in a row; without its "
                 "device %d device%s are left, and the most of them that divide --deterministic "
                 "%lld is below --min-devices %lld: stopping", failed, left, left == 1 ? "" : "s",
                 w->divides, w->min_devices);
        return;
    }
    fprintf(stderr, "%s: rank %d failed on two attempts in a row: going on without its device, "
            "on %d devices instead of %d (the most of the %d left that divide --deterministic "
            "%lld), from the last checkpoint, bit for bit\n", w->tool, failed, to, from, left,
            w->divides);
}

void tdm_elastic_watch_init(tdm_elastic_watch *w, const char *tool, const char *mode,
                            long long max_restarts)
{
    memset(w, 0, sizeof *w);
    w->tool = tool;
    w->mode = mode;
    w->max_restarts = max_restarts;
    w->dist = (tdm_dist_watch){.ctx = w, .begin = tdm_elastic_begin,
                               .settled = tdm_elastic_settled, .end = tdm_elastic_end,
                               .restart = tdm_elastic_restart, .resize = tdm_elastic_resize};
}

int64_t tdm_elastic_test_fault(int rank, int *sig)
{
    const char *env = getenv("TANDEM_DDP_TEST_KILL");
    int kr = -1;
    long long ks = 0;
    char how[8] = "";
    *sig = SIGKILL;
    if (!env || sscanf(env, "%d:%lld:%7s", &kr, &ks, how) < 2 || kr != rank || ks <= 0 ||
        (tdm_dist_restart_count() != 0 && strcmp(how, "ALWAYS")))
        return 0;
    *sig = strcmp(how, "STOP") ? SIGKILL : SIGSTOP;
    return ks;
}

void tdm_elastic_test_fault_fire(int rank, int sig, int64_t step)
{
    fflush(stdout);
    fprintf(stderr, "tandem train: rank %d: test fault: %s before step %lld\n", rank,
            sig == SIGSTOP ? "SIGSTOP" : "SIGKILL", (long long)step);
    raise(sig);
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
                (v && tdm_args_int("--max-restarts", v, 0, TDM_DIST_RESTARTS_MAX, &max_restarts) !=
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
    /* the ranks learn --checkpoint on a restart, once this run wrote it */
    unsetenv(TDM_DIST_ENV_RESUME);
    tdm_dist_run_id_begin(max_restarts > 0);
    int rc;
    tdm_elastic_log failures = {0};
    for (int attempt = 0;; attempt++) {
        tdm_dist_restart_count_set(attempt);
        tdm_elastic_cause[0] = 0;
        rc = tdm_launch_run_once(n, rest);
        /* only a rank's failure is restarted: not success, bad usage, or
         * a signal the launcher received (Ctrl-C, SIGTERM) */
        int rank_failed = rc == 1 && tdm_elastic_cause[0];
        if (rank_failed) tdm_elastic_log_add(&failures, tdm_elastic_cause);
        if (rank_failed && attempt >= max_restarts)
            tdm_elastic_log_used_up(&failures, "tandem launch", max_restarts);
        if (!rank_failed || attempt >= max_restarts) break;
        char from[1024], why[512];
        int ours = 0;
        if (ckpt && tdm_dist_restart_ours(ckpt, &ours, why, sizeof why)) {
            fprintf(stderr, "tandem launch: not restarting: %s\n", why);
            break;
        }
        if (ours) {
            setenv(TDM_DIST_ENV_RESUME, ckpt, 1);
            tdm_elastic_describe(ckpt, from, sizeof from);
        } else if (ckpt) {
            unsetenv(TDM_DIST_ENV_RESUME);
            snprintf(from, sizeof from, "from the start: %s (this job failed before its first "
                                        "save)", why);
        } else {
            snprintf(from, sizeof from, "(no --checkpoint named: each resumes from its own, "
                                        "tandem train from its --save once this job wrote it)");
        }
        int ms = tdm_dist_backoff(attempt + 1);
        fprintf(stderr, "tandem launch: restart %d of %lld after %d ms: %s; every rank starts "
                        "again %s\n", attempt + 1, max_restarts, ms, tdm_elastic_cause, from);
    }
    tdm_elastic_log_free(&failures);
    free(rest);
    return rc;
}
