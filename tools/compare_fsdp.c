/* tools/compare_fsdp.c: the sharded modes of `tandem compare` - FSDP
 * (FULL_SHARD, ZeRO-3), ZeRO-2 (SHARD_GRAD_OP) and ZeRO-1 (sharded
 * optimizer) through fsdp/, forked ranks as DDP's - and what compare says
 * about them: --modes, the all-gather / reduce-scatter lines under the
 * phase table, which pairs the verdict compares (and whether a sharded
 * mode equals DDP bit for bit), memory per rank, the trace's collective
 * track and the reading (what sharding saved, what it cost). Under an MPI
 * launcher the job's ranks run them over DDP's communicator instead of
 * forked ones. compare.c and compare_out.c call in here with one line
 * each. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/device.h"
#include "dist/spawn.h"
#include "fsdp/fsdp.h"
#include "models/optim.h"
#include "tools/compare.h"
#include "tools/ddp_rank.h"
#include "tools/devices.h"

/* collectives recorded per step in the trace (rank 0) */
#define TDM_CMP_MAX_COLL 256

int tdm_cmp_is_sharded(tdm_cmp_mode m)
{
    return m == TDM_CMP_FSDP || m == TDM_CMP_ZERO2 || m == TDM_CMP_ZERO1;
}

static tdm_fsdp_sharding tdm_cmp_sharding_of(tdm_cmp_mode m)
{
    return m == TDM_CMP_ZERO1 ? TDM_FSDP_SHARD_OPTIM
         : m == TDM_CMP_ZERO2 ? TDM_FSDP_SHARD_GRAD_OP : TDM_FSDP_FULL_SHARD;
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
        for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
            if (strlen(t[i].name) == n && !strncmp(p, t[i].name, n)) {
                *mask |= 1u << t[i].m;
                found = 1;
            }
        if (!found) {
            fprintf(stderr, "tandem compare: --modes '%s': '%.*s' is not a mode; choose from "
                            "single, dp, ddp, fsdp (zero3), zero2, zero1, comma-separated\n",
                    s, (int)n, p);
            return 0;
        }
        p += n;
        if (*p == ',') p++;
    }
    return 1;
}

/* ---- running a sharded mode (forked ranks, as DDP) ---- */

typedef struct tdm_cmp_fsdp_sh {
    int world, steps, n_coll;
    int64_t param_elems;
    double prefetch_frac, overlap_frac, rs_bytes_per_step;
    int agree[TDM_CMP_MAX_DEV];
    tdm_cmp_memory mem[TDM_CMP_MAX_DEV];
    size_t off_loss, off_step, off_t0, off_phase, off_comm, off_exposed, off_coll, off_first,
        off_last, total;
} tdm_cmp_fsdp_sh;

#define TDM_CMP_FAT(sh, off, type) ((type *)((char *)(sh) + (sh)->off))

typedef struct tdm_cmp_fsdp_arg {
    const tdm_cmp_opts *o;
    const tdm_cmp_data *data;
    tdm_cmp_mode mode;
    tdm_cmp_fsdp_sh *sh;
    uint64_t t_start;
} tdm_cmp_fsdp_arg;

static tdm_status tdm_cmp_fsdp_make(const tdm_cmp_opts *o, tdm_comm *comm, tdm_device *dev,
                                    tdm_cmp_mode mode, tdm_model **m, tdm_comm **nccl,
                                    tdm_fsdp **f, tdm_optim **opt)
{
    tdm_model_spec spec;
    TDM_CHECK(tdm_model_spec_parse(&spec, o->model));
    TDM_CHECK(tdm_model_init(m, dev, &spec, o->seed));
    TDM_CHECK(tdm_tool_rank_nccl(comm, dev, nccl));
    tdm_fsdp_opts fo = {.sharding = tdm_cmp_sharding_of(mode), .no_overlap = o->no_overlap,
                        .host_comm = *nccl ? comm : NULL};
    /* --comm-hook's second run (tools/compare_hook.c) */
    if (o->hooked && o->comm_hook) TDM_CHECK(tdm_fsdp_comm_hook_parse(o->comm_hook, &fo.comm_hook));
    TDM_CHECK(tdm_fsdp_init(f, *m, *nccl ? *nccl : comm, &fo));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, strcmp(o->optim, "adamw") ? TDM_OPTIM_SGD : TDM_OPTIM_ADAMW);
    oo.lr = (float)o->lr;
    oo.weight_decay = (float)o->weight_decay;
    if (oo.kind == TDM_OPTIM_SGD) oo.momentum = (float)o->momentum;
    return tdm_fsdp_optim_init(opt, *f, &oo);
}

static int tdm_cmp_fsdp_rank(tdm_comm *comm, void *argp)
{
    tdm_cmp_fsdp_arg *a = argp;
    const tdm_cmp_opts *o = a->o;
    tdm_cmp_fsdp_sh *sh = a->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm), rc = 1;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_fsdp *f = NULL;
    tdm_comm *nccl = NULL;
    int64_t feat = tdm_cmp_feat(a->data);
    int lo = (int)((int64_t)rank * o->batch / world);
    int b = (int)((int64_t)(rank + 1) * o->batch / world) - lo;
    float *x = malloc((size_t)(b > 0 ? b : 1) * feat * sizeof(float));
    int32_t *y = malloc((size_t)(b > 0 ? b : 1) * tdm_cmp_targets(a->data) * sizeof(int32_t));
    float *mine = malloc((size_t)sh->param_elems * sizeof(float));
    const char *name = tdm_cmp_mode_name(a->mode);
    if (!x || !y || !mine) goto done;
    if (tdm_tool_rank_device(&o->dl, rank, &dev) != TDM_STATUS_OK ||
        tdm_cmp_fsdp_make(o, comm, dev, a->mode, &m, &nccl, &f, &opt) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: %s rank %d: %s\n", name, rank, tdm_error_message());
        goto done;
    }
    float scale = 1.0f / (float)o->batch * (rank == o->perturb_rank ? 1.01f : 1.0f);
    size_t W = (size_t)world;
    for (int i = 0; i < o->steps; i++) {
        if (b > 0) tdm_cmp_rows(a->data, i, o->batch, lo, b, x, y);
        double loss_sum = 0.0;
        uint64_t t0 = tdm_time_ns();
        tdm_status st = tdm_fsdp_zero_grad(f);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_forward_scaled(f, x, y, b, scale, &loss_sum);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_backward(f);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_step(f, opt);
        uint64_t t1 = tdm_time_ns();
        /* after step 1 every rank takes part in gathering the parameters
         * to rank 0 (outside the timed step) */
        if (st == TDM_STATUS_OK && i == 0)
            st = tdm_fsdp_gather_params(f, rank == 0 ? TDM_CMP_FAT(sh, off_first, float) : NULL, 0);
        if (st != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: %s rank %d, step %d: %s\n", name, rank, i + 1,
                    tdm_error_message());
            goto done;
        }
        size_t k = (size_t)i * W + (size_t)rank;
        TDM_CMP_FAT(sh, off_loss, double)[k] = loss_sum;
        TDM_CMP_FAT(sh, off_step, double)[k] = (double)(t1 - t0) * 1e-6;
        TDM_CMP_FAT(sh, off_t0, double)[k] = (double)(t0 - a->t_start) * 1e-6;
        tdm_fsdp_times t;
        tdm_fsdp_get_times(f, &t);
        TDM_CMP_FAT(sh, off_phase, tdm_phase_times)[k] = t.last;
        double lo_ms = INFINITY, hi_ms = 0.0;
        for (int e = 0; e < t.n_events; e++) {
            if (t.events[e].start_ms < lo_ms) lo_ms = t.events[e].start_ms;
            if (t.events[e].end_ms > hi_ms) hi_ms = t.events[e].end_ms;
        }
        TDM_CMP_FAT(sh, off_comm, double)[k] = t.n_events ? hi_ms - lo_ms : 0.0;
        TDM_CMP_FAT(sh, off_exposed, double)[k] =
            t.last.ms[TDM_PHASE_ALLGATHER_WAIT] + t.last.ms[TDM_PHASE_REDUCE_SCATTER_WAIT];
        if (rank == 0) {
            int nc = t.n_events < TDM_CMP_MAX_COLL ? t.n_events : TDM_CMP_MAX_COLL;
            if (nc > sh->n_coll) sh->n_coll = nc;
            for (int j = 0; j < TDM_CMP_MAX_COLL; j++) {
                double *c = TDM_CMP_FAT(sh, off_coll, double) + ((size_t)i * TDM_CMP_MAX_COLL + j) * 4;
                c[0] = j < nc ? t.events[j].kind : -1.0;
                c[1] = j < nc ? t.events[j].unit : -1.0;
                c[2] = j < nc ? t.events[j].start_ms : 0.0;
                c[3] = j < nc ? t.events[j].end_ms : 0.0;
            }
        }
    }
    /* the final parameters, gathered from the shards to every rank: rank
     * 0 publishes them, the others check theirs after a barrier */
    if (tdm_fsdp_gather_params(f, mine, -1) != TDM_STATUS_OK) goto done;
    if (rank == 0) {
        memcpy(TDM_CMP_FAT(sh, off_last, float), mine, (size_t)sh->param_elems * sizeof(float));
        tdm_fsdp_times t;
        tdm_fsdp_get_times(f, &t);
        sh->prefetch_frac = t.ag_bytes_total > 0 ? t.ag_prefetched_bytes_total / t.ag_bytes_total : 0;
        sh->overlap_frac = t.rs_bytes_total > 0 ? t.rs_overlapped_bytes_total / t.rs_bytes_total : 0;
        sh->rs_bytes_per_step = t.steps > 0 ? t.rs_bytes_total / (double)t.steps : 0.0;
    }
    if (tdm_comm_barrier(comm) != TDM_STATUS_OK) goto done;
    /* an MPI job's ranks share no memory: rank 0's parameters come over comm */
    if (o->ddp_comm &&
        tdm_comm_broadcast(comm, TDM_CMP_FAT(sh, off_last, float), TDM_CMP_FAT(sh, off_last, float),
                           (size_t)sh->param_elems, TDM_DTYPE_FLOAT32, 0) != TDM_STATUS_OK)
        goto done;
    sh->agree[rank] = !memcmp(mine, TDM_CMP_FAT(sh, off_last, float),
                              (size_t)sh->param_elems * sizeof(float));
    /* what this rank holds: shards plus the full copies its sharding
     * keeps (params, grads); comm: the most its unit buffers (gathered
     * parameters, full gradients) held at once */
    tdm_fsdp_memory fm;
    tdm_model_memory mm;
    tdm_fsdp_get_memory(f, opt, &fm);
    tdm_model_get_memory(m, &mm);
    tdm_cmp_memory *cm = &sh->mem[rank];
    cm->params = (double)(fm.shard_params + fm.full_params);
    cm->grads = (double)(fm.shard_grads + fm.full_grads);
    cm->optim = (double)fm.optim_state;
    cm->buffers = (double)mm.buffers;
    cm->activations = (double)mm.activations;
    cm->comm = (double)fm.units_peak;
    rc = 0;
done:
    if (rc) tdm_comm_abort(comm, "compare: a sharded rank failed");
    tdm_fsdp_free(f);
    tdm_comm_free(nccl);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    free(x);
    free(y);
    free(mine);
    return rc;
}

tdm_status tdm_cmp_run_fsdp(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                            tdm_cmp_mode mode, int world, tdm_cmp_result *r)
{
    const char *name = tdm_cmp_mode_name(mode);
    int64_t pe = tdm_cmp_param_elems(o);
    if (pe <= 0) {
        fprintf(stderr, "tandem compare: %s: %s\n", name, tdm_error_message());
        return TDM_STATUS_INVALID_ARG;
    }
    size_t S = (size_t)o->steps, W = (size_t)world;
    tdm_cmp_fsdp_sh lay = {.world = world, .steps = o->steps, .param_elems = pe};
    size_t off = (sizeof lay + 63) & ~(size_t)63;
#define TDM_CMP_FPLACE(field, bytes) (lay.field = off, off = (off + (bytes) + 63) & ~(size_t)63)
    TDM_CMP_FPLACE(off_loss, S * W * sizeof(double));
    TDM_CMP_FPLACE(off_step, S * W * sizeof(double));
    TDM_CMP_FPLACE(off_t0, S * W * sizeof(double));
    TDM_CMP_FPLACE(off_phase, S * W * sizeof(tdm_phase_times));
    TDM_CMP_FPLACE(off_comm, S * W * sizeof(double));
    TDM_CMP_FPLACE(off_exposed, S * W * sizeof(double));
    TDM_CMP_FPLACE(off_coll, S * TDM_CMP_MAX_COLL * 4 * sizeof(double));
    TDM_CMP_FPLACE(off_first, (size_t)pe * sizeof(float));
    TDM_CMP_FPLACE(off_last, (size_t)pe * sizeof(float));
#undef TDM_CMP_FPLACE
    lay.total = off;
    tdm_cmp_fsdp_sh *sh = mmap(NULL, lay.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                               -1, 0);
    if (sh == MAP_FAILED) {
        perror("tandem compare: mmap");
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "compare: mmap of %zu bytes", lay.total);
    }
    *sh = lay;
    tdm_cmp_fsdp_arg arg = {.o = o, .data = data, .mode = mode, .sh = sh,
                            .t_start = tdm_time_ns()};
    tdm_dist_spawn_opts so = {.timeout_ms = TDM_CMP_RUN_TIMEOUT_MS};
    tdm_status st;
    fflush(stdout);
    if (o->ddp_comm) {
        /* an MPI job: this process is one rank, over the job's --backend
         * communicator as DDP's; rank 0 gathers the others' records */
        st = tdm_cmp_fsdp_rank(o->ddp_comm, &arg) != 0 ? TDM_STATUS_INTERNAL : TDM_STATUS_OK;
        if (st == TDM_STATUS_OK) st = tdm_cmp_gather_records(
            o->ddp_comm, TDM_CMP_FAT(sh, off_loss, double),
            (sh->off_coll - sh->off_loss) / sizeof(double), sh->agree, sh->mem);
        if (st != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: %s: %s\n", name,
                    st == TDM_STATUS_INTERNAL ? "a rank failed (see its error above)"
                                              : tdm_error_message());
            goto done;
        }
        if (tdm_comm_rank(o->ddp_comm) != 0) {
            r->ok = 1;   /* rank 0 reports */
            goto done;
        }
    } else if ((st = tdm_dist_spawn(world, tdm_cmp_fsdp_rank, &arg, &so, NULL)) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: %s: %s\n", name, tdm_error_message());
        goto done;
    }
    if ((st = tdm_cmp_alloc(r, mode, world, o->steps, pe)) != TDM_STATUS_OK) goto done;
    const double *loss = TDM_CMP_FAT(sh, off_loss, double);
    const tdm_phase_times *phase = TDM_CMP_FAT(sh, off_phase, tdm_phase_times);
    for (size_t i = 0; i < S; i++) {
        double l = 0.0;
        for (size_t k = 0; k < W; k++) l += loss[i * W + k];
        r->loss[i] = l / o->batch;
        r->step_ms[i] = TDM_CMP_FAT(sh, off_step, double)[i * W];
        r->step_t0_ms[i] = TDM_CMP_FAT(sh, off_t0, double)[i * W];
        for (size_t k = 0; k < W; k++) r->phase[i * W + k] = phase[i * W + k];
        r->wall[i] = phase[i * W];
        r->comm_ms[i] = TDM_CMP_FAT(sh, off_comm, double)[i * W];
        r->exposed_ms[i] = TDM_CMP_FAT(sh, off_exposed, double)[i * W];
    }
    r->n_coll = sh->n_coll;
    r->coll = calloc(S * (size_t)(r->n_coll > 0 ? r->n_coll : 1) * 4, sizeof(double));
    if (!r->coll) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "compare: out of memory");
        goto done;
    }
    for (size_t i = 0; i < S; i++)
        memcpy(r->coll + i * (size_t)r->n_coll * 4,
               TDM_CMP_FAT(sh, off_coll, double) + i * TDM_CMP_MAX_COLL * 4,
               (size_t)r->n_coll * 4 * sizeof(double));
    r->prefetch_frac = sh->prefetch_frac;
    r->overlap_bytes_frac = sh->overlap_frac;
    r->bytes_per_step = sh->rs_bytes_per_step;
    memcpy(r->params_first, TDM_CMP_FAT(sh, off_first, float), (size_t)pe * sizeof(float));
    memcpy(r->params_last, TDM_CMP_FAT(sh, off_last, float), (size_t)pe * sizeof(float));
    for (int k = 0; k < world; k++) {
        r->ranks_agree &= sh->agree[k];
        r->mem[k] = sh->mem[k];
    }
    r->ok = 1;
done:
    munmap(sh, lay.total);
    return st;
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
        double step, comm, exposed;
        tdm_cmp_means(o, r, &step, &comm, &exposed);
        printf("  %s keeps %.2f MiB of parameters, gradients and optimizer state per rank (plus "
               "up to %.2f MiB of units during a step)", tdm_cmp_mode_name(r->mode), mine * mib,
               r->mem[0].comm * mib);
        if (ddp && tdm_cmp_pgo(ddp, 0) > 0)
            printf(", %.2fx DDP's %.2f MiB, and runs at %.2fx DDP's speed", mine / tdm_cmp_pgo(ddp, 0),
                   tdm_cmp_pgo(ddp, 0) * mib, sps_of[r->mode] / sps_of[TDM_CMP_DDP]);
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
