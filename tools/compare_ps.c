/* tools/compare_ps.c: `tandem compare --modes ...,ps,ps-async`: the
 * parameter server's section. Each variant is a `tandem train --mode ps`
 * of this binary (tools/train_ps.c) over compare's model, data,
 * optimizer, seed and global batch, --steps steps: N-1 workers (N:
 * compare's devices) and each server count of --servers (1, and 2 from 4
 * devices), so W+S ranks. Read back from its output: the samples/s of
 * its epoch line, and per server the bytes it received and sent per step
 * and the staleness of the gradients it applied; from the workers'
 * TANDEM_PS_LOSS_LOG files, the global batch's loss at every step (async:
 * the shares of every worker's t-th step, on whatever parameters each
 * had pulled).
 * Printed beside DDP's throughput, the bytes each DDP rank all-reduces
 * per step and DDP's loss curve (when ddp ran), then the server sweep:
 * throughput and the busiest server's bytes per step against the servers,
 * with the reading (does one server saturate: did splitting it pay).
 * Not an equivalence verdict: tests/test_ps_cli.c checks sync against
 * DDP (byte for byte with 2 workers). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps/ps.h"
#include "tools/compare.h"

#define PS_CMP_ARGS 40
#define PS_CMP_MAX_SERVERS TDM_CMP_PS_MAX_SERVERS
/* Variants: sync, async. */
#define PS_CMP_VARIANTS 2

typedef struct ps_cmp_run {
    int ok;
    double sps, loss;
    int servers;
    double kib_in[PS_CMP_MAX_SERVERS], kib_out[PS_CMP_MAX_SERVERS];
    char stale[PS_CMP_MAX_SERVERS][160];
    double *curve;            /* [steps] the global batch's loss; NaN: not logged */
    char why[512];
} ps_cmp_run;

int tdm_cmp_ps_servers(const tdm_cmp_opts *o, int *out)
{
    if (!o->ps_servers) {
        out[0] = 1;
        if (o->n_dev < 4) return 1;
        out[1] = 2;
        return 2;
    }
    int n = 0;
    const char *p = o->ps_servers;
    while (*p) {
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > PS_CMP_MAX_SERVERS || n == PS_CMP_MAX_SERVERS) return -1;
        for (int i = 0; i < n; i++)
            if (out[i] == v) return -1;
        out[n++] = (int)v;
        if (*end == ',') end++;
        else if (*end) return -1;
        p = end;
    }
    return n;
}

/* The workers' TANDEM_PS_LOSS_LOG files in dir into r->curve (the sum
 * of the shares' loss sums over the global batch), then removed. */
static void ps_cmp_read_losses(const tdm_cmp_opts *o, const char *dir, int workers, ps_cmp_run *r)
{
    double *sum = calloc((size_t)o->steps, sizeof *sum);
    int *seen = calloc((size_t)o->steps, sizeof *seen);
    for (int w = 0; w < workers && sum && seen; w++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/ps_loss_w%d.txt", dir, w);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        long long step;
        double ls;
        while (fscanf(f, "%lld %lf", &step, &ls) == 2)
            if (step >= 1 && step <= o->steps) {
                sum[step - 1] += ls;
                seen[step - 1]++;
            }
        fclose(f);
        unlink(path);
    }
    r->curve = malloc((size_t)o->steps * sizeof *r->curve);
    for (int i = 0; r->curve && i < o->steps; i++)
        r->curve[i] = sum && seen && seen[i] == workers ? sum[i] / o->batch : NAN;
    free(sum);
    free(seen);
    rmdir(dir);
}

/* Runs this binary's train with argv; parses what it printed. */
static void ps_cmp_exec(const char *const *argv, ps_cmp_run *r)
{
    static char buf[1 << 16];
    int ws = 0;
    if (tdm_cmp_run_self(argv, buf, sizeof buf, &ws) != 0) {
        snprintf(r->why, sizeof r->why, "%s", buf);
        return;
    }
    size_t len = strlen(buf);
    const char *e = strstr(buf, "epoch 1/1: train loss");
    if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0 && e &&
        sscanf(e, "epoch 1/1: train loss %lf, %lf samples/s", &r->loss, &r->sps) == 2) {
        for (int s = 0; s < PS_CMP_MAX_SERVERS; s++) {
            char key[32];
            snprintf(key, sizeof key, "  server %d: ", s);
            const char *l = strstr(buf, key);
            if (!l) break;
            if (sscanf(l + strlen(key), "%lf KiB in, %lf KiB out", &r->kib_in[s], &r->kib_out[s]) != 2) break;
            const char *st = strstr(l, "staleness");
            const char *nl = strchr(l, '\n');
            if (st && (!nl || st < nl))
                snprintf(r->stale[s], sizeof r->stale[s], "%.*s", (int)((nl ? nl : st + strlen(st)) - st - 10),
                         st + 10);
            r->servers = s + 1;
        }
        r->ok = r->servers > 0;
        if (r->ok) return;
    }
    while (len > 0 && buf[len - 1] == '\n') buf[--len] = '\0';
    const char *nl = strrchr(buf, '\n');
    snprintf(r->why, sizeof r->why, "%s", nl ? nl + 1 : buf);
}

static void ps_cmp_train(const tdm_cmp_opts *o, const char *sync, int servers, ps_cmp_run *r)
{
    const char *argv[PS_CMP_ARGS];
    char dev[64], steps[32], batch[32], lr[64], mom[64], wd[64], seed[32], srv[16];
    int a = 0;
    int workers = o->n_dev > 1 ? o->n_dev - 1 : 1;
    memset(r, 0, sizeof *r);
    /* the workers log their losses into a directory of ours */
    char dir[] = "/tmp/tandem-ps-loss-XXXXXX";
    int logged = mkdtemp(dir) != NULL;
    if (logged) setenv("TANDEM_PS_LOSS_LOG", dir, 1);
    tdm_cmp_dev_spec(o, workers + servers, dev, sizeof dev);
    snprintf(steps, sizeof steps, "%d", o->steps);
    snprintf(batch, sizeof batch, "%d", o->batch);
    snprintf(lr, sizeof lr, "%.17g", o->lr);
    snprintf(mom, sizeof mom, "%.17g", o->momentum);
    snprintf(wd, sizeof wd, "%.17g", o->weight_decay);
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)o->seed);
    snprintf(srv, sizeof srv, "%d", servers);
    argv[a++] = "tandem";
    argv[a++] = "train";
    argv[a++] = "--mode";
    argv[a++] = "ps";
    argv[a++] = "--device";
    argv[a++] = dev;
    argv[a++] = "--servers";
    argv[a++] = srv;
    argv[a++] = "--ps-sync";
    argv[a++] = sync;
    argv[a++] = "--model";
    argv[a++] = o->model;
    char synth[32];
    if (o->data) {
        argv[a++] = "--data";
        argv[a++] = o->data;
    }
    if (o->data && !strcmp(o->data, "synthetic")) {
        /* compare's synthetic set (tools/compare.c): the same samples in
         * the same order, so the loss curves line up with DDP's */
        snprintf(synth, sizeof synth, "%lld", (long long)o->batch * (o->steps < 50 ? o->steps : 50));
        argv[a++] = "--synthetic-size";
        argv[a++] = synth;
    }
    if (o->optim) {
        argv[a++] = "--optim";
        argv[a++] = o->optim;
    }
    if (o->lr >= 0) {
        argv[a++] = "--lr";
        argv[a++] = lr;
    }
    if (o->weight_decay >= 0) {
        argv[a++] = "--weight-decay";
        argv[a++] = wd;
    }
    argv[a++] = "--momentum";
    argv[a++] = mom;
    argv[a++] = "--seed";
    argv[a++] = seed;
    if (o->batch > 0) {
        argv[a++] = "--batch";
        argv[a++] = batch;
    }
    argv[a++] = "--epochs";
    argv[a++] = "1";
    argv[a++] = "--max-steps";
    argv[a++] = steps;
    argv[a++] = "--no-eval";
    argv[a] = NULL;
    ps_cmp_exec(argv, r);
    if (logged) {
        unsetenv("TANDEM_PS_LOSS_LOG");
        ps_cmp_read_losses(o, dir, workers, r);
    }
}

/* A curve's steps shown: the first, the last and about every fifth. */
static int ps_cmp_shown(const tdm_cmp_opts *o, int i)
{
    return i == 0 || i == o->steps - 1 || (i + 1) % (o->steps > 10 ? o->steps / 5 : 1) == 0;
}

/* The busiest server's bytes per step, in and out, and all servers'. */
static void ps_cmp_bytes(const ps_cmp_run *r, double *busiest, double *total)
{
    *busiest = *total = 0;
    for (int s = 0; s < r->servers; s++) {
        double b = r->kib_in[s] + r->kib_out[s];
        if (b > *busiest) *busiest = b;
        *total += b;
    }
}

static void ps_cmp_name(int v, int servers, char *buf, size_t n)
{
    snprintf(buf, n, "%s, %d server%s", v == 0 ? "ps (sync)" : "ps-async", servers, servers == 1 ? "" : "s");
}

/* The loss curves: DDP's (when it ran) and every variant's. */
static void ps_cmp_curves(const tdm_cmp_opts *o, const tdm_cmp_result *ddp, ps_cmp_run runs[][PS_CMP_MAX_SERVERS],
                          const int *counts, int nc)
{
    printf("  loss curve (step: %s", ddp && ddp->ok ? "ddp" : "");
    int first = !(ddp && ddp->ok);
    for (int v = 0; v < PS_CMP_VARIANTS; v++)
        for (int i = 0; i < nc; i++) {
            if (!runs[v][i].ok) continue;
            char name[64];
            ps_cmp_name(v, counts[i], name, sizeof name);
            printf("%s%s", first ? "" : " / ", name);
            first = 0;
        }
    printf("):\n   ");
    for (int t = 0; t < o->steps; t++) {
        if (!ps_cmp_shown(o, t)) continue;
        printf(" %d:", t + 1);
        first = 1;
        if (ddp && ddp->ok) {
            printf(" %.4f", ddp->loss[t]);
            first = 0;
        }
        for (int v = 0; v < PS_CMP_VARIANTS; v++)
            for (int i = 0; i < nc; i++) {
                if (!runs[v][i].ok) continue;
                double l = runs[v][i].curve ? runs[v][i].curve[t] : NAN;
                printf("%s%s", first ? " " : " / ", "");
                if (isnan(l)) printf("-");
                else printf("%.4f", l);
                first = 0;
            }
        printf(";");
    }
    printf("\n");
}

/* The server sweep: throughput and bytes per server against the servers,
 * and whether one server saturates. */
static void ps_cmp_sweep(int workers, ps_cmp_run runs[][PS_CMP_MAX_SERVERS], const int *counts, int nc,
                         const tdm_cmp_opts *o)
{
    printf("  server sweep (%d worker%s; ranks = workers + servers%s):\n", workers, workers == 1 ? "" : "s",
           o->dl.kind == TDM_DEVICE_HOST ? ", more ranks than cores on a small machine" : "");
    printf("  %-22s %8s %10s %12s %20s %16s\n", "variant", "servers", "samples/s", "vs 1st row",
           "busiest server KiB", "all servers KiB");
    for (int v = 0; v < PS_CMP_VARIANTS; v++) {
        const ps_cmp_run *base = NULL;
        for (int i = 0; i < nc; i++) {
            const ps_cmp_run *r = &runs[v][i];
            if (!r->ok) continue;
            if (!base) base = r;
            double busy, total;
            ps_cmp_bytes(r, &busy, &total);
            printf("  %-22s %8d %10.0f %11.2fx %15.1f/step %11.1f/step\n", v == 0 ? "ps (sync)" : "ps-async",
                   counts[i], r->sps, base->sps > 0 ? r->sps / base->sps : 0.0, busy, total);
        }
    }
    /* the reading, from sync's rows: did more servers pay? */
    const ps_cmp_run *lo = NULL, *hi = NULL;
    int slo = 0, shi = 0;
    for (int i = 0; i < nc; i++) {
        const ps_cmp_run *r = &runs[0][i];
        if (!r->ok) continue;
        if (!lo || counts[i] < slo) { lo = r; slo = counts[i]; }
        if (!hi || counts[i] > shi) { hi = r; shi = counts[i]; }
    }
    if (!lo || lo == hi || lo->sps <= 0) return;
    double bl, tl, bh, th, gain = hi->sps / lo->sps;
    ps_cmp_bytes(lo, &bl, &tl);
    ps_cmp_bytes(hi, &bh, &th);
    printf("  sweep reading: %d server%s moved %.1f KiB per step through the busiest one, %d moved %.1f;\n",
           slo, slo == 1 ? "" : "s", bl, shi, bh);
    if (gain >= 1.1)
        printf("  samples/s rose %.2fx: with %d server%s the server saturates here, and splitting it pays.\n",
               gain, slo, slo == 1 ? "" : "s");
    else
        printf("  samples/s changed %.2fx: %d server%s did not saturate here (the workers' compute and the\n"
               "  cores bound the step; a larger model or more workers put the load on the server).\n",
               gain, slo, slo == 1 ? "" : "s");
}

int tdm_cmp_ps_section(const tdm_cmp_opts *o, const tdm_cmp_result *ddp, double ddp_sps)
{
    int workers = o->n_dev > 1 ? o->n_dev - 1 : 1;
    printf("\nparameter server (tandem train --mode ps over rpc/: %d workers and the servers, a rank each)\n",
           workers);
    if (strcmp(o->model, "mlp") && strncmp(o->model, "mlp:", 4)) {
        printf("  skipped: --mode ps trains --model mlp only\n");
        return 1;
    }
    if (o->n_dev < 2 || o->dl.kind != TDM_DEVICE_HOST) {
        printf("  skipped: it needs 2 host devices or more (cpu:N), a server and a worker\n");
        return 1;
    }
    int counts[PS_CMP_MAX_SERVERS];
    int nc = tdm_cmp_ps_servers(o, counts);
    if (nc <= 0) {
        printf("  --servers '%s': expected server counts like 1,2 (each 1..%d)\n", o->ps_servers,
               PS_CMP_MAX_SERVERS);
        return -2;
    }
    double ddp_kib = ddp && ddp->ok ? ddp->bytes_per_step / 1024.0 : -1;
    printf("  %-22s %10s %8s  %-8s %12s %12s  %s\n", "variant", "samples/s", "vs DDP", "server", "KiB in/step",
           "KiB out/step", "staleness (steps behind: pushes)");
    int failed = 0;
    ps_cmp_run runs[PS_CMP_VARIANTS][PS_CMP_MAX_SERVERS];
    memset(runs, 0, sizeof runs);
    for (int v = 0; v < PS_CMP_VARIANTS; v++) {
        unsigned bit = v == 0 ? TDM_CMP_PS_BIT : TDM_CMP_PS_ASYNC_BIT;
        if (!(o->modes & bit)) continue;
        for (int i = 0; i < nc; i++) {
            ps_cmp_run *r = &runs[v][i];
            ps_cmp_train(o, v == 0 ? "sync" : "async", counts[i], r);
            char name[64];
            ps_cmp_name(v, counts[i], name, sizeof name);
            if (!r->ok) {
                printf("  %-22s failed: %s\n", name, r->why);
                failed = 1;
                continue;
            }
            for (int s = 0; s < r->servers; s++) {
                char vs[16] = "-";
                if (s == 0 && ddp_sps > 0) snprintf(vs, sizeof vs, "%.2fx", r->sps / ddp_sps);
                if (s == 0)
                    printf("  %-22s %10.0f %8s  %-8d %12.1f %12.1f  %s\n", name, r->sps, vs, s, r->kib_in[s],
                           r->kib_out[s], r->stale[s]);
                else
                    printf("  %-22s %10s %8s  %-8d %12.1f %12.1f  %s\n", "", "", "", s, r->kib_in[s],
                           r->kib_out[s], r->stale[s]);
            }
        }
    }
    if (ddp_kib > 0)
        printf("  DDP: %.0f samples/s, %.1f KiB all-reduced per rank per step\n", ddp_sps, ddp_kib);
    ps_cmp_curves(o, ddp, runs, counts, nc);
    if (nc > 1) ps_cmp_sweep(workers, runs, counts, nc, o);
    printf("  reading: a server takes in one gradient and sends out one copy of its shard per worker\n"
           "  per step, so its traffic grows with the workers (W x its shard each way) while a DDP\n"
           "  rank's all-reduce moves about twice the gradient whatever the ranks; more servers\n"
           "  split it. sync waits for the slowest worker every step (DDP's step, DDP's loss curve;\n"
           "  staleness 0); async never waits, and pays in staleness (the steps a gradient's\n"
           "  parameters were behind when applied) and in its curve. More ranks than cores: the\n"
           "  speeds are the scheduler's too.\n");
    for (int v = 0; v < PS_CMP_VARIANTS; v++)
        for (int i = 0; i < nc; i++) free(runs[v][i].curve);
    return failed ? -1 : 1;
}
