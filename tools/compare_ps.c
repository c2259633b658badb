/* tools/compare_ps.c: `tandem compare --modes ...,ps,ps-async`: the
 * parameter server's section. Each variant is a `tandem train --mode ps`
 * of this binary (tools/train_ps.c) over compare's model, data,
 * optimizer, seed and global batch, --steps steps, on compare's devices:
 * 1 server and N-1 workers, and with 4 devices or more also 2 servers.
 * Read back from its output: the samples/s of its epoch line, and per
 * server the bytes it received and sent per step and the staleness of the
 * gradients it applied. Printed beside DDP's throughput and the bytes each
 * DDP rank all-reduces per step (when ddp ran), with the reading: a
 * server takes in a gradient and sends out a copy of its shard per worker
 * per step, so its traffic grows with the workers while an all-reduce
 * rank's does not; servers split it.
 * Not an equivalence verdict: tests/test_ps_cli.c checks sync against
 * DDP (byte for byte with 2 workers). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps/ps.h"
#include "tools/compare.h"

#define PS_CMP_ARGS 40
#define PS_CMP_MAX_SERVERS 2

typedef struct ps_cmp_run {
    int ok;
    double sps, loss;
    int servers;
    double kib_in[PS_CMP_MAX_SERVERS], kib_out[PS_CMP_MAX_SERVERS];
    char stale[PS_CMP_MAX_SERVERS][160];
    char why[512];
} ps_cmp_run;

/* Runs this binary's train with argv; parses what it printed. */
static void ps_cmp_exec(const char *const *argv, ps_cmp_run *r)
{
    static char buf[1 << 16];
    memset(r, 0, sizeof *r);
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
    tdm_cmp_dev_spec(o, o->n_dev, dev, sizeof dev);
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
    if (o->data) {
        argv[a++] = "--data";
        argv[a++] = o->data;
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
}

int tdm_cmp_ps_section(const tdm_cmp_opts *o, const tdm_cmp_result *ddp, double ddp_sps)
{
    printf("\nparameter server (tandem train --mode ps over rpc/, %d devices: servers + workers)\n", o->n_dev);
    if (strcmp(o->model, "mlp") && strncmp(o->model, "mlp:", 4)) {
        printf("  skipped: --mode ps trains --model mlp only\n");
        return 1;
    }
    if (o->n_dev < 2 || o->dl.kind != TDM_DEVICE_HOST) {
        printf("  skipped: it needs 2 host devices or more (cpu:N), a server and a worker\n");
        return 1;
    }
    double ddp_kib = ddp && ddp->ok ? ddp->bytes_per_step / 1024.0 : -1;
    printf("  %-22s %10s %8s  %-8s %12s %12s  %s\n", "variant", "samples/s", "vs DDP", "server", "KiB in/step",
           "KiB out/step", "staleness (steps behind: pushes)");
    int failed = 0;
    for (int v = 0; v < 2; v++) {
        unsigned bit = v == 0 ? TDM_CMP_PS_BIT : TDM_CMP_PS_ASYNC_BIT;
        if (!(o->modes & bit)) continue;
        for (int servers = 1; servers <= PS_CMP_MAX_SERVERS && servers < o->n_dev; servers++) {
            if (servers == 2 && o->n_dev < 4) break;
            ps_cmp_run r;
            ps_cmp_train(o, v == 0 ? "sync" : "async", servers, &r);
            char name[64];
            snprintf(name, sizeof name, "%s, %d server%s", v == 0 ? "ps (sync)" : "ps-async", servers,
                     servers == 1 ? "" : "s");
            if (!r.ok) {
                printf("  %-22s failed: %s\n", name, r.why);
                failed = 1;
                continue;
            }
            for (int s = 0; s < r.servers; s++) {
                char vs[16] = "-";
                if (s == 0 && ddp_sps > 0) snprintf(vs, sizeof vs, "%.2fx", r.sps / ddp_sps);
                if (s == 0)
                    printf("  %-22s %10.0f %8s  %-8d %12.1f %12.1f  %s\n", name, r.sps, vs, s, r.kib_in[s],
                           r.kib_out[s], r.stale[s]);
                else
                    printf("  %-22s %10s %8s  %-8d %12.1f %12.1f  %s\n", "", "", "", s, r.kib_in[s], r.kib_out[s],
                           r.stale[s]);
            }
        }
    }
    if (ddp_kib > 0)
        printf("  DDP: %.0f samples/s, %.1f KiB all-reduced per rank per step\n", ddp_sps, ddp_kib);
    printf("  reading: a server takes in one gradient and sends out one copy of its shard per worker\n"
           "  per step, so its traffic grows with the workers (W x its shard each way) while a DDP\n"
           "  rank's all-reduce moves about twice the gradient whatever the ranks; more servers\n"
           "  split it. sync waits for the slowest worker every step (DDP's step; staleness 0);\n"
           "  async never waits, and pays in staleness (the steps a gradient's parameters were\n"
           "  behind when applied). More ranks than cores: the speeds are the scheduler's too.\n");
    return failed ? -1 : 1;
}
