/* tools/compare_fsdp.c: what `tandem compare` says about the sharded
 * modes - FSDP (FULL_SHARD, ZeRO-3), ZeRO-2 (SHARD_GRAD_OP) and ZeRO-1
 * (sharded optimizer), run as DDP is (tools/compare_ranks.c): --modes, the
 * all-gather / reduce-scatter lines under the phase table, which pairs
 * the verdict compares (and whether a sharded mode equals DDP bit for
 * bit), memory per rank, the trace's collective track and the reading
 * (what sharding saved, what it cost). compare.c and compare_out.c call
 * in here with one line each. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/device.h"
#include "tools/compare.h"
#include "tools/devices.h"

int tdm_cmp_is_sharded(tdm_cmp_mode m)
{
    return m == TDM_CMP_FSDP || m == TDM_CMP_ZERO2 || m == TDM_CMP_ZERO1;
}

int tdm_cmp_parse_modes(const char *s, unsigned *mask)
{
    static const struct {
        const char *name;
        tdm_cmp_mode m;
    } t[] = {{"single", TDM_CMP_SINGLE}, {"dp", TDM_CMP_DP},       {"ddp", TDM_CMP_DDP},
             {"fsdp", TDM_CMP_FSDP},     {"zero3", TDM_CMP_FSDP},  {"zero2", TDM_CMP_ZERO2},
             {"zero1", TDM_CMP_ZERO1}};
    *mask = 1u << TDM_CMP_SINGLE;   /* the reference every figure is relative to */
    const char *p = s;
    while (*p) {
        size_t n = strcspn(p, ",");
        int found = 0;
        if (n == 2 && !strncmp(p, "pp", 2)) {
            *mask |= TDM_CMP_PP_BIT;
            found = 1;
        }
        if (n == 2 && !strncmp(p, "tp", 2)) {
            *mask |= TDM_CMP_TP_BIT;
            found = 1;
        }
        if (n == 5 && !strncmp(p, "tp-sp", 5)) {
            *mask |= TDM_CMP_TP_SP_BIT;
            found = 1;
        }
        if (n == 2 && !strncmp(p, "ps", 2)) {
            *mask |= TDM_CMP_PS_BIT;
            found = 1;
        }
        if (n == 8 && !strncmp(p, "ps-async", 8)) {
            *mask |= TDM_CMP_PS_ASYNC_BIT;
            found = 1;
        }
        for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
            if (strlen(t[i].name) == n && !strncmp(p, t[i].name, n)) {
                *mask |= 1u << t[i].m;
                found = 1;
            }
        if (!found) {
            fprintf(stderr, "tandem compare: --modes '%s': '%.*s' is not a mode; choose from "
                            "single, dp, ddp, fsdp (zero3), zero2, zero1, pp, tp, tp-sp, "
                            "ps, ps-async, comma-separated\n",
                    s, (int)n, p);
            return 0;
        }
        p += n;
        if (*p == ',') p++;
    }
    return 1;
}

/* ---- what compare prints ---- */

void tdm_cmp_fsdp_print_phases(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n)
{
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        if (!tdm_cmp_is_sharded(r->mode)) continue;
        double step, comm, exposed;
        tdm_cmp_means(o, r, &step, &comm, &exposed);
        printf("  %s collectives: %.2f ms per step from the first all-gather's start to the last "
               "reduce-scatter's end;\n  %.2f ms of it exposed (waited for); %.0f%% of the "
               "all-gathered bytes were prefetched, %.0f%% of the reduce-scattered bytes "
               "launched while backward still ran\n",
               tdm_cmp_mode_name(r->mode), comm, exposed, 100.0 * r->prefetch_frac,
               100.0 * r->overlap_bytes_frac);
    }
}

int tdm_cmp_fsdp_pairs(const int *ran, int (*pairs)[2], int max)
{
    int n = 0;
#define TDM_CMP_PAIR(a, b)                                         \
    do {                                                           \
        if (ran[a] && ran[b] && n < max) {                         \
            pairs[n][0] = (a);                                     \
            pairs[n][1] = (b);                                     \
            n++;                                                   \
        }                                                          \
    } while (0)
    for (int m = TDM_CMP_DP; m < TDM_CMP_NMODES; m++) TDM_CMP_PAIR(m, TDM_CMP_SINGLE);
    TDM_CMP_PAIR(TDM_CMP_DDP, TDM_CMP_DP);
    for (int m = TDM_CMP_FSDP; m < TDM_CMP_NMODES; m++) TDM_CMP_PAIR(m, TDM_CMP_DDP);
#undef TDM_CMP_PAIR
    return n;
}

int tdm_cmp_fsdp_print_bitwise(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n)
{
    const tdm_cmp_result *ddp = NULL;
    int ok = 1;
    for (int k = 0; k < n; k++)
        if (res[k]->mode == TDM_CMP_DDP) ddp = res[k];
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        if (!tdm_cmp_is_sharded(r->mode)) continue;
        if (!r->ranks_agree) {
            printf("  %s: ranks gathered different parameters -> FAIL\n", tdm_cmp_mode_name(r->mode));
            ok = 0;
        }
        if (!ddp || ddp->n_dev != r->n_dev) continue;
        if (o->sync_bn) {
            printf("  %s vs DDP: not compared bitwise: DDP ran SyncBatchNorm (--sync-bn), "
                   "%s does not\n", tdm_cmp_mode_name(r->mode), tdm_cmp_mode_name(r->mode));
            continue;
        }
        int64_t at = -1;
        for (int64_t j = 0; j < r->param_elems && at < 0; j++)
            if (memcmp(&r->params_last[j], &ddp->params_last[j], sizeof(float))) at = j;
        int gpu = o->dl.kind == TDM_DEVICE_CUDA && !tdm_tool_cuda_emulated();
        if (at < 0)
            printf("  %s vs DDP: bitwise the same parameters after step %d\n",
                   tdm_cmp_mode_name(r->mode), o->steps);
        else
            printf("  %s vs DDP: not bitwise the same (first at element %lld)%s\n",
                   tdm_cmp_mode_name(r->mode), (long long)at,
                   gpu ? ": NCCL's reduce-scatter and all-reduce may add in different orders"
                   : o->perturb_rank >= 0 ? ": a rank is perturbed" : "");
    }
    return ok;
}

/* total bytes of parameters + gradients + optimizer state of rank d */
static double tdm_cmp_pgo(const tdm_cmp_result *r, int d)
{
    return r->mem[d].params + r->mem[d].grads + r->mem[d].optim;
}

/* the rank's peak: every kind the memory table adds into its total */
static double tdm_cmp_peak(const tdm_cmp_result *r, int d)
{
    const tdm_cmp_memory *m = &r->mem[d];
    return m->params + m->grads + m->optim + m->buffers + m->activations + m->comm;
}

void tdm_cmp_fsdp_print_memory_note(tdm_cmp_result *const *res, int n)
{
    for (int k = 0; k < n; k++)
        if (tdm_cmp_is_sharded(res[k]->mode)) {
            printf("  FSDP / ZeRO ranks: params, grads and optimizer are what persists (the\n"
                   "  rank's shards, plus the full copies ZeRO-1 and ZeRO-2 keep); comm is the\n"
                   "  most that gathered units and full unit gradients held at once in a step.\n");
            return;
        }
}

void tdm_cmp_fsdp_reading(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                          const double *sps_of)
{
    const tdm_cmp_result *ddp = NULL;
    for (int k = 0; k < n; k++)
        if (res[k]->mode == TDM_CMP_DDP) ddp = res[k];
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        if (!tdm_cmp_is_sharded(r->mode)) continue;
        double mib = 1.0 / (1024.0 * 1024.0), mine = tdm_cmp_pgo(r, 0);
        double peak = tdm_cmp_peak(r, 0);
        double step, comm, exposed;
        tdm_cmp_means(o, r, &step, &comm, &exposed);
        /* the peak first: what a rank needs; then what persists between
         * steps, the figure sharding divides */
        printf("  %s peaks at %.2f MiB per rank", tdm_cmp_mode_name(r->mode), peak * mib);
        if (ddp && tdm_cmp_peak(ddp, 0) > 0)
            printf(" (%.2fx DDP's %.2f MiB)", peak / tdm_cmp_peak(ddp, 0),
                   tdm_cmp_peak(ddp, 0) * mib);
        printf(", with up to %.2f MiB of units during a step; it keeps %.2f MiB of parameters, "
               "gradients and optimizer state between steps", r->mem[0].comm * mib,
               mine * mib);
        if (ddp && tdm_cmp_pgo(ddp, 0) > 0)
            printf(" (%.2fx DDP's %.2f MiB), and runs at %.2fx DDP's speed",
                   mine / tdm_cmp_pgo(ddp, 0), tdm_cmp_pgo(ddp, 0) * mib,
                   sps_of[r->mode] / sps_of[TDM_CMP_DDP]);
        else
            printf(", and runs at %.2fx one device's speed", sps_of[r->mode] / sps_of[TDM_CMP_SINGLE]);
        printf("; it waits %.1f%% of each step for all-gathers and reduce-scatters.\n",
               step > 0 ? 100.0 * exposed / step : 0.0);
    }
}

/* The trace's collective track of a sharded mode (rank 0): all-gathers
 * and reduce-scatters as slices from issue to seen-complete, prefetched
 * or not. *first: whether nothing was written yet (the caller's comma). */
void tdm_cmp_fsdp_trace(FILE *f, int *first, int pid, const tdm_cmp_result *r,
                        long long (*us)(double))
{
    if (!tdm_cmp_is_sharded(r->mode)) return;
    fprintf(f, "%s\n  ", *first ? "" : ",");
    *first = 0;
    fprintf(f, "{\"ph\": \"M\", \"pid\": %d, \"tid\": 1000, \"name\": \"thread_name\", "
               "\"args\": {\"name\": \"rank 0 all-gather / reduce-scatter\"}}", pid);
    for (int i = 0; i < r->steps; i++)
        for (int j = 0; j < r->n_coll; j++) {
            const double *c = r->coll + ((size_t)i * r->n_coll + j) * 4;
            if (c[0] < 0.0 || c[3] <= c[2]) continue;
            double t0 = r->step_t0_ms[i] + c[2];
            long long dur = us(c[3] - c[2]);
            fprintf(f, ",\n  {\"ph\": \"X\", \"pid\": %d, \"tid\": 1000, \"name\": \"%s unit %d\", "
                       "\"cat\": \"comm\", \"ts\": %lld, \"dur\": %lld, \"args\": {\"step\": %d}}",
                    pid, c[0] == 0.0 ? "all-gather" : "reduce-scatter", (int)c[1], us(t0),
                    dur > 0 ? dur : 1, i + 1);
        }
}
