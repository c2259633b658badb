/* tools/compare_det.c: `tandem compare --deterministic K`: the same
 * training in every mode of --modes at every device count of --sweep,
 * each a `tandem train --deterministic K` run of this very binary that
 * saves its final checkpoint, and each again without --deterministic for
 * its throughput. The verdict is not a noise floor but bytes: every
 * checkpoint must equal one device's (cmp), "bitwise identical"; the cost
 * of determinism is each configuration's throughput against the default
 * mode's in the same run. The runs are whole processes, as a user's are
 * (their throughput is the epoch line's, every step counted). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tools/compare.h"
#include "tools/tools.h"

#define TDM_CMP_DET_ARGS 48

typedef struct tdm_cmp_det_run {
    double sps;            /* samples (windows) per second of the epoch line; <0: failed */
    char out[512];         /* the run's last line, when it failed */
} tdm_cmp_det_run;

int tdm_cmp_run_self(const char *const *argv, char *buf, size_t cap, int *wstatus)
{
    int fds[2];
    *wstatus = 0;
    buf[0] = '\0';
    if (pipe(fds) != 0) {
        snprintf(buf, cap, "pipe: %s", strerror(errno));
        return -1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(buf, cap, "fork: %s", strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv("/proc/self/exe", (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t k;
    /* read to the end (a child blocked on a full pipe would never exit);
     * past cap - 1 bytes the older half goes: the tail says how it ended */
    while ((k = read(fds[0], buf + len, cap - 1 - len)) != 0) {
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) break;
        len += (size_t)k;
        if (len == cap - 1) {
            memmove(buf, buf + len / 2, len - len / 2);
            len -= len / 2;
        }
    }
    buf[len] = '\0';
    close(fds[0]);
    while (waitpid(pid, wstatus, 0) < 0 && errno == EINTR) {}
    return 0;
}

/* Runs this binary with argv (NULL-terminated); *r its throughput. */
static void tdm_cmp_det_exec(const char *const *argv, tdm_cmp_det_run *r)
{
    static char buf[1 << 16];
    r->sps = -1.0;
    r->out[0] = '\0';
    int ws = 0;
    if (tdm_cmp_run_self(argv, buf, sizeof buf, &ws) != 0) {
        snprintf(r->out, sizeof r->out, "%s", buf);
        return;
    }
    size_t len = strlen(buf);
    const char *e = strstr(buf, "epoch 1/1: train loss");
    const char *c = e ? strchr(e, ',') : NULL;
    if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0 && c) {
        r->sps = strtod(c + 1, NULL);
        return;
    }
    /* the last non-empty line says why */
    while (len > 0 && buf[len - 1] == '\n') buf[--len] = '\0';
    const char *nl = strrchr(buf, '\n');
    snprintf(r->out, sizeof r->out, "%s", nl ? nl + 1 : buf);
}

/* One training run: mode m on n devices, with --deterministic K (0:
 * without), saving at save (NULL: nothing saved). */
static void tdm_cmp_det_train(const tdm_cmp_opts *o, tdm_cmp_mode m, int n, int K,
                              const char *save, tdm_cmp_det_run *r)
{
    const char *argv[TDM_CMP_DET_ARGS];
    char dev[32], steps[32], kk[32], batch[32], lr[64], mom[64], seed[32];
    int a = 0;
    snprintf(dev, sizeof dev, "cpu:%d", n);
    snprintf(steps, sizeof steps, "%d", o->steps);
    snprintf(kk, sizeof kk, "%d", K);
    snprintf(batch, sizeof batch, "%d", o->batch);
    snprintf(lr, sizeof lr, "%.17g", o->lr);
    snprintf(mom, sizeof mom, "%.17g", o->momentum);
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)o->seed);
    static const char *const mode_arg[TDM_CMP_NMODES] = {"single", "dp", "ddp", "fsdp", "fsdp",
                                                         "fsdp"};
    static const char *const sharding[TDM_CMP_NMODES] = {NULL, NULL, NULL, "full", "grad_op",
                                                         "optimizer"};
    argv[a++] = "tandem";
    argv[a++] = "train";
    argv[a++] = "--mode";
    argv[a++] = mode_arg[m];
    argv[a++] = "--device";
    argv[a++] = m == TDM_CMP_SINGLE ? "cpu" : dev;
    if (sharding[m]) {
        argv[a++] = "--sharding";
        argv[a++] = sharding[m];
    }
    argv[a++] = "--model";
    argv[a++] = o->model;
    if (o->data) {
        argv[a++] = "--data";
        argv[a++] = o->data;
    }
    if (o->optim) {   /* else train's default for the model, as compare's */
        argv[a++] = "--optim";
        argv[a++] = o->optim;
    }
    if (o->lr >= 0) {
        argv[a++] = "--lr";
        argv[a++] = lr;
    }
    argv[a++] = "--momentum";
    argv[a++] = mom;
    argv[a++] = "--seed";
    argv[a++] = seed;
    if (o->batch > 0) {
        argv[a++] = "--batch";
        argv[a++] = batch;
    }
    if (K) {
        argv[a++] = "--deterministic";
        argv[a++] = kk;
    }
    if (save) {
        argv[a++] = "--save";
        argv[a++] = save;
    }
    const char *const tail[] = {"--epochs", "1", "--max-steps", steps, "--no-eval", "--quiet"};
    for (size_t i = 0; i < sizeof tail / sizeof tail[0]; i++) argv[a++] = tail[i];
    argv[a] = NULL;
    tdm_cmp_det_exec(argv, r);
}

/* 1 when the files hold the same bytes. */
static int tdm_cmp_det_same(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        int ca = getc(fa), cb = getc(fb);
        if (ca != cb) same = 0;
        if (ca == EOF || cb == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

tdm_status tdm_cmp_det_main(const tdm_cmp_opts *o, int K, const int *counts, int n_counts,
                            int *identical)
{
    char dir[] = "/tmp/tandem-det-XXXXXX", ref[64], path[64];
    *identical = 0;
    if (o->dl.kind == TDM_DEVICE_CUDA)
        return tdm_tool_usage_error("tandem compare: --deterministic compares host devices in "
                                    "this build (tandem train --deterministic runs on GPUs)\n");
    for (int i = 0; i < n_counts; i++)
        if (K % counts[i] != 0 || (o->batch > 0 && o->batch % K != 0))
            return tdm_tool_usage_error("tandem compare: --deterministic %d: every device count "
                                        "must divide K (not %d) and K the batch\n", K, counts[i]);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "tandem compare: mkdtemp %s: %s\n", dir, strerror(errno));
        return TDM_STATUS_IO;
    }
    snprintf(ref, sizeof ref, "%s/single.safetensors", dir);
    snprintf(path, sizeof path, "%s/run.safetensors", dir);
    printf("tandem compare --deterministic %d: model %s, %d steps per run; each checkpoint "
           "against one device's, byte for byte\n", K, o->model, o->steps);
    printf("  %-7s %7s  %15s  %14s  %6s  %s\n", "mode", "devices", "deterministic/s",
           "default/s", "ratio", "final checkpoint");
    tdm_status st = TDM_STATUS_OK;
    int all = 1, runs = 0;
    for (int m = 0; m < TDM_CMP_NMODES && st == TDM_STATUS_OK; m++) {
        if (!(o->modes & (1u << m))) continue;
        for (int i = 0; i < (m == TDM_CMP_SINGLE ? 1 : n_counts); i++) {
            int n = m == TDM_CMP_SINGLE ? 1 : counts[i];
            tdm_cmp_det_run det, def;
            tdm_cmp_det_train(o, (tdm_cmp_mode)m, n, K, m == TDM_CMP_SINGLE ? ref : path, &det);
            if (det.sps < 0) {
                fprintf(stderr, "tandem compare: %s on %d device%s with --deterministic %d "
                        "failed: %s\n", tdm_cmp_mode_name((tdm_cmp_mode)m), n, n == 1 ? "" : "s",
                        K, det.out);
                st = TDM_STATUS_PEER_FAILED;
                break;
            }
            tdm_cmp_det_train(o, (tdm_cmp_mode)m, n, 0, NULL, &def);
            int same = m == TDM_CMP_SINGLE || tdm_cmp_det_same(ref, path);
            all &= same;
            runs++;
            char ratio[16] = "-", dsps[32] = "failed";
            if (def.sps > 0) {
                snprintf(ratio, sizeof ratio, "%.2f", det.sps / def.sps);
                snprintf(dsps, sizeof dsps, "%.0f", def.sps);
            }
            printf("  %-7s %7d  %15.0f  %14s  %6s  %s\n", tdm_cmp_mode_name((tdm_cmp_mode)m), n,
                   det.sps, dsps, ratio,
                   m == TDM_CMP_SINGLE ? "the reference" : same ? "bitwise identical"
                                                                : "DIFFERS");
            fflush(stdout);
        }
    }
    unlink(ref);
    unlink(path);
    rmdir(dir);
    if (st) return st;
    *identical = all;
    printf("verdict: %s across %d runs (device counts and modes) with --deterministic %d\n",
           all ? "bitwise identical" : "NOT identical", runs, K);
    return TDM_STATUS_OK;
}
