/* tools/elastic.c: the restart loop of `tandem launch --max-restarts K`
 * around one launch (tdm_launch_run_once), and the helpers `tandem train
 * --max-restarts` shares: attempt count, backoff, what a checkpoint holds.
 * Not a rendezvous: one machine, the same world size every attempt. */
#include "tools/elastic.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "models/checkpoint.h"
#include "tools/args.h"
#include "tools/doctor.h"
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

const char *tdm_elastic_run_begin(int restarts)
{
    const char *run = getenv(TDM_ELASTIC_ENV_RUN);
    /* without restarts nothing reads it: the files stay as they were */
    if ((!run || !*run) && !restarts) return NULL;
    if (!run || !*run) {
        uint64_t id = 0;
        if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            id = ((uint64_t)getpid() << 40) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 16);
        }
        char buf[24];
        snprintf(buf, sizeof buf, "%016llx", (unsigned long long)id);
        setenv(TDM_ELASTIC_ENV_RUN, buf, 1);
        run = getenv(TDM_ELASTIC_ENV_RUN);
    }
    tdm_checkpoint_set_run(run);
    return run;
}

int tdm_elastic_ours(const char *path, char *why, size_t n)
{
    const char *run = getenv(TDM_ELASTIC_ENV_RUN);
    tdm_st_file *f = NULL;
    if (why && n) why[0] = 0;
    if (!path || access(path, F_OK) != 0) {
        if (why && path) snprintf(why, n, "%s does not exist yet", path);
        return 0;
    }
    if (tdm_st_load(&f, path)) {
        if (why) snprintf(why, n, "%s is not a checkpoint: %s", path, tdm_error_message());
        return 0;
    }
    const char *theirs = tdm_st_meta_get(f, "run");
    int ours = run && *run && theirs && !strcmp(theirs, run);
    if (!ours && why)
        snprintf(why, n, "%s holds another run's checkpoint (%s%.24s), not one this job wrote",
                 path, theirs ? "run " : "no run id", theirs ? theirs : "");
    tdm_st_free(f);
    return ours;
}

/* Where a restart of `tandem train` resumes: save once this job wrote it,
 * else the user's own --resume, else the start; out says which and why. */
static const char *tdm_elastic_restart_from(const char *save, const char *user_resume, char *out,
                                            size_t n)
{
    char why[512] = "";
    if (save && tdm_elastic_ours(save, why, sizeof why)) {
        tdm_elastic_describe(save, out, n);
        return save;
    }
    char from[512];
    if (user_resume) {
        tdm_elastic_describe(user_resume, from, sizeof from);
        snprintf(out, n, "%s%s%s%s", from, why[0] ? " (" : "", why, why[0] ? ")" : "");
        return user_resume;
    }
    if (!save)
        snprintf(out, n, "from the start (no --save or --resume named)");
    else if (access(save, F_OK) == 0)
        snprintf(out, n, "from the start: %s (this job failed before its first save)", why);
    else
        snprintf(out, n, "from the start (this job failed before its first save to %s)", save);
    return NULL;
}

tdm_status tdm_elastic_train_forked(const char *mode, int world, tdm_ddp_spawn_fn fn, void *arg,
                                    const tdm_ddp_spawn_opts *so, long long max_restarts,
                                    const char *save, const char **resume)
{
    const char *user_resume = *resume;
    tdm_elastic_run_begin(max_restarts > 0);
    tdm_elastic_log failures = {0};
    for (int attempt = 0;; attempt++) {
        tdm_elastic_set_attempt(attempt);
        tdm_doctor_job frj;   /* the ranks' flight-recorder dumps */
        tdm_status bst = tdm_doctor_job_begin(&frj, "tandem train", NULL);
        if (bst) {
            tdm_elastic_log_free(&failures);
            return bst;
        }
        tdm_ddp_spawn_opts o = *so;
        o.on_settled = tdm_doctor_job_settled;
        o.settled_ctx = &frj;
        tdm_shm_spawn_result res;
        memset(&res, 0, sizeof res);   /* a spawn that failed early fills nothing */
        tdm_status st = tdm_ddp_spawn(world, fn, arg, &o, &res);
        if (st == TDM_STATUS_OK) {
            tdm_doctor_job_end(&frj, 0, world, NULL, NULL, NULL, NULL);
            tdm_elastic_log_free(&failures);
            return st;
        }
        char why[1024];
        snprintf(why, sizeof why, "%s", tdm_error_message());
        fprintf(stderr, "tandem train: %s: %s\n", mode, why);
        tdm_doctor_job_end(&frj, 1, world, res.pid, res.wstatus, NULL, why);
        tdm_error_set(st, "%s", why);   /* the doctor's reads replaced the message */
        /* a failure of a rank is restarted, not a signal to this process
         * (Ctrl-C reaches the ranks too: they die of it, and so do we) */
        if (st == TDM_STATUS_PEER_FAILED) tdm_elastic_log_add(&failures, why);
        if (attempt >= max_restarts || st != TDM_STATUS_PEER_FAILED) {
            if (st == TDM_STATUS_PEER_FAILED) tdm_elastic_log_used_up(&failures, "tandem train",
                                                                      max_restarts);
            tdm_elastic_log_free(&failures);
            tdm_error_set(st, "%s", why);
            return st;
        }
        char from[1024];
        *resume = tdm_elastic_restart_from(save, user_resume, from, sizeof from);
        int ms = tdm_elastic_backoff(attempt + 1);
        fprintf(stderr, "tandem train: restart %d of %lld after %d ms: %s; every rank starts "
                        "again %s\n", attempt + 1, max_restarts, ms, why, from);
        fflush(stdout);
    }
}

int64_t tdm_elastic_test_fault(int rank, int *sig)
{
    const char *env = getenv("TANDEM_DDP_TEST_KILL");
    int kr = -1;
    long long ks = 0;
    char how[8] = "";
    *sig = SIGKILL;
    if (!env || tdm_elastic_attempt() != 0 || sscanf(env, "%d:%lld:%7s", &kr, &ks, how) < 2 ||
        kr != rank || ks <= 0)
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
    /* the ranks learn --checkpoint on a restart, once this run wrote it */
    unsetenv(TDM_ELASTIC_ENV_RESUME);
    tdm_elastic_run_begin(max_restarts > 0);
    int rc;
    tdm_elastic_log failures = {0};
    for (int attempt = 0;; attempt++) {
        tdm_elastic_set_attempt(attempt);
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
        if (ckpt && tdm_elastic_ours(ckpt, why, sizeof why)) {
            setenv(TDM_ELASTIC_ENV_RESUME, ckpt, 1);
            tdm_elastic_describe(ckpt, from, sizeof from);
        } else if (ckpt) {
            unsetenv(TDM_ELASTIC_ENV_RESUME);
            snprintf(from, sizeof from, "from the start: %s (this job failed before its first "
                                        "save)", why);
        } else {
            snprintf(from, sizeof from, "(no --checkpoint named: each resumes from its own, "
                                        "tandem train from its --save once this job wrote it)");
        }
        int ms = tdm_elastic_backoff(attempt + 1);
        fprintf(stderr, "tandem launch: restart %d of %lld after %d ms: %s; every rank starts "
                        "again %s\n", attempt + 1, max_restarts, ms, tdm_elastic_cause, from);
    }
    tdm_elastic_log_free(&failures);
    free(rest);
    return rc;
}
