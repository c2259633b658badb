/* tools/compare_ranks.c: `tandem compare`'s multi-process modes - DDP and
 * the sharded ones (FSDP, ZeRO-2, ZeRO-1) - as one loop over a design's
 * table (tools/ranks.h) run by dist/run.h: forked ranks, or under an MPI
 * launcher the job's ranks over the communicator compare joined. Every
 * rank runs its share of the same global batches from the same initial
 * parameters and writes what it measured (losses, step times, phases,
 * the design's timeline: DDP's buckets, the sharded modes' collectives)
 * into one shared anonymous mapping the parent reads after they exit
 * (an MPI job's ranks share no memory: rank 0 gathers the records). Then
 * every rank gets the full final parameters and checks that they are
 * rank 0's bit for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ddp/ddp.h"
#include "dist/batch.h"
#include "tools/compare.h"
#include "tools/ranks.h"

/* timeline entries recorded per step (rank 0): DDP's buckets, the
 * sharded modes' all-gathers and reduce-scatters */
#define TDM_CMP_MAX_LINE 256
/* doubles per timeline entry: DDP ready, start, end (-1: not in that
 * step's plan); sharded kind (0 all-gather, 1 reduce-scatter, -1 none),
 * unit, start, end */
#define TDM_CMP_LINE_WIDTH 4

/* What the ranks write, in one shared anonymous mapping: the struct,
 * then the arrays at the offsets it holds (per rank and step: loss sum,
 * step ms, start, phases, communication span, exposed wait, DDP's
 * backward start; rank 0's timeline; the parameters after the first and
 * the last step). */
typedef struct tdm_cmp_shared {
    int world, steps, n_line;
    int64_t param_elems;
    double overlap_frac, prefetch_frac, bytes_per_step;
    int agree[TDM_CMP_MAX_DEV];
    tdm_cmp_memory mem[TDM_CMP_MAX_DEV];
    size_t off_loss, off_step, off_t0, off_phase, off_comm, off_exposed, off_bwd, off_line,
        off_first, off_last, total;
} tdm_cmp_shared;

#define TDM_CMP_AT(sh, off, type) ((type *)((char *)(sh) + (sh)->off))

typedef struct tdm_cmp_ranks {
    const tdm_cmp_opts *o;
    const tdm_cmp_data *data;
    tdm_cmp_mode mode;
    tdm_cmp_shared *sh;
    uint64_t t_start;
} tdm_cmp_ranks;

/* ---- what each design records ---- */

/* Step i of rank r: DDP's times and, on rank 0, its bucket timeline (the
 * plan changes after the first step, ddp.h: rebuilt in the order the
 * gradients became ready). */
static void tdm_cmp_record_ddp(tdm_cmp_shared *sh, const tdm_tool_rank *r, size_t k,
                               double *line)
{
    tdm_ddp_times t;
    tdm_ddp_get_times(r->w, &t);
    TDM_CMP_AT(sh, off_phase, tdm_phase_times)[k] = t.last;
    TDM_CMP_AT(sh, off_comm, double)[k] = t.comm_ms_last;
    TDM_CMP_AT(sh, off_exposed, double)[k] = t.last.ms[TDM_PHASE_ALLREDUCE_WAIT];
    int nb = t.n_buckets < TDM_CMP_MAX_LINE ? t.n_buckets : TDM_CMP_MAX_LINE;
    for (int j = 0; line && j < nb; j++) {
        const tdm_ddp_bucket_times *b = &t.buckets[j];
        memcpy(line + (size_t)j * TDM_CMP_LINE_WIDTH,
               (const double[3]){b->ready_ms, b->start_ms, b->end_ms}, 3 * sizeof(double));
    }
    if (line && nb > sh->n_line) sh->n_line = nb;
}

/* Step i of a sharded rank: its phases, the span and the exposed wait of
 * its collectives and, on rank 0, their timeline. */
static void tdm_cmp_record_fsdp(tdm_cmp_shared *sh, const tdm_tool_rank *r, size_t k,
                                double *line)
{
    tdm_fsdp_times t;
    tdm_fsdp_get_times(r->w, &t);
    TDM_CMP_AT(sh, off_phase, tdm_phase_times)[k] = t.last;
    double lo_ms = INFINITY, hi_ms = 0.0;
    for (int e = 0; e < t.n_events; e++) {
        if (t.events[e].start_ms < lo_ms) lo_ms = t.events[e].start_ms;
        if (t.events[e].end_ms > hi_ms) hi_ms = t.events[e].end_ms;
    }
    TDM_CMP_AT(sh, off_comm, double)[k] = t.n_events ? hi_ms - lo_ms : 0.0;
    TDM_CMP_AT(sh, off_exposed, double)[k] =
        t.last.ms[TDM_PHASE_ALLGATHER_WAIT] + t.last.ms[TDM_PHASE_REDUCE_SCATTER_WAIT];
    int nc = t.n_events < TDM_CMP_MAX_LINE ? t.n_events : TDM_CMP_MAX_LINE;
    for (int j = 0; line && j < nc; j++) {
        const tdm_fsdp_event *e = &t.events[j];
        memcpy(line + (size_t)j * TDM_CMP_LINE_WIDTH,
               (const double[4]){e->kind, e->unit, e->start_ms, e->end_ms}, 4 * sizeof(double));
    }
    if (line && nc > sh->n_line) sh->n_line = nc;
}

/* Rank 0 at the end: the share of the communication launched while
 * backward ran (and the prefetched share of the gathers), the bytes per
 * step. */
static void tdm_cmp_summary(tdm_cmp_shared *sh, const tdm_tool_rank *r, int sharded)
{
    if (sharded) {
        tdm_fsdp_times t;
        tdm_fsdp_get_times(r->w, &t);
        sh->prefetch_frac =
            t.ag_bytes_total > 0 ? t.ag_prefetched_bytes_total / t.ag_bytes_total : 0;
        sh->overlap_frac = t.rs_bytes_total > 0 ? t.rs_overlapped_bytes_total / t.rs_bytes_total
                                                : 0;
        sh->bytes_per_step = t.steps > 0 ? t.rs_bytes_total / (double)t.steps : 0.0;
        return;
    }
    tdm_ddp_times t;
    tdm_ddp_get_times(r->w, &t);
    sh->overlap_frac =
        t.reduced_bytes_total > 0 ? t.overlapped_bytes_total / t.reduced_bytes_total : 0.0;
    sh->bytes_per_step = t.steps > 0 ? t.reduced_bytes_total / (double)t.steps : 0.0;
}

/* What this rank holds. DDP: the replica's, and the communicator memory
 * beyond its gradients (shm: the rest of the arena; NCCL: its buckets
 * are the gradients; MPI, no zero-copy memory: its own buffers, not
 * counted). Sharded: shards plus the full copies its sharding keeps;
 * comm is the most its unit buffers (gathered parameters, full
 * gradients) held at once. */
static void tdm_cmp_memory_of(tdm_cmp_memory *cm, const tdm_tool_rank *r, int sharded)
{
    tdm_model_memory mm;
    tdm_model_get_memory(r->m, &mm);
    tdm_dev_mem_stats ms;
    if (tdm_dev_mem_query(tdm_model_device(r->m), &ms) == TDM_STATUS_OK)
        cm->peak = (double)ms.peak_bytes;
    cm->buffers = (double)mm.buffers;
    cm->activations = (double)mm.activations;
    if (sharded) {
        tdm_fsdp_memory fm;
        tdm_fsdp_get_memory(r->w, r->opt, &fm);
        cm->params = (double)(fm.shard_params + fm.full_params);
        cm->grads = (double)(fm.shard_grads + fm.full_grads);
        cm->optim = (double)fm.optim_state;
        cm->comm = (double)fm.units_peak;
        return;
    }
    cm->params = (double)mm.params;
    cm->grads = (double)mm.grads;
    cm->optim = (double)tdm_optim_state_bytes(r->opt);
    cm->comm = r->dist->dev_comm != r->dist->comm || !tdm_ddp_zero_copy(r->w)
                   ? 0.0
                   : (double)tdm_ddp_arena_bytes(tdm_model_param_elems(r->m)) - cm->grads;
    if (cm->comm < 0) cm->comm = 0;
}

/* ---- a rank ---- */

static tdm_status tdm_cmp_rank_fail(const tdm_tool_rank *r, int step)
{
    const tdm_cmp_ranks *c = r->b->tool;
    fprintf(stderr, "tandem compare: %s rank %d, step %d: %s\n", tdm_cmp_mode_name(c->mode),
            r->rank, step, tdm_error_message());
    return tdm_error_set(TDM_STATUS_PEER_FAILED, "compare: a %s rank failed",
                         tdm_cmp_mode_name(c->mode));
}

/* The steps, timed, each rank on its share of the global batch; after
 * the first step (outside its time) the parameters gathered to rank 0;
 * at the end every rank's full parameters against rank 0's. */
static tdm_status tdm_cmp_rank_run(void *ctx, tdm_dist_rank *d, void *self)
{
    const tdm_tool_build *b = ctx;
    const tdm_cmp_ranks *c = b->tool;
    const tdm_cmp_opts *o = c->o;
    const tdm_dist_ops *ops = b->design->dist.ops;
    tdm_cmp_shared *sh = c->sh;
    tdm_tool_rank *r = self;
    int rank = r->rank, world = r->world, sharded = tdm_cmp_is_sharded(c->mode);
    int64_t feat = tdm_cmp_feat(c->data), lo, hi;
    tdm_dist_share(o->batch, rank, world, &lo, &hi);
    int n = (int)(hi - lo);
    float *x = malloc((size_t)(n > 0 ? n : 1) * feat * sizeof(float));
    int32_t *y = malloc((size_t)(n > 0 ? n : 1) * tdm_cmp_targets(c->data) * sizeof(int32_t));
    float *mine = malloc((size_t)sh->param_elems * sizeof(float));
    tdm_status st = x && y && mine ? TDM_STATUS_OK
                                   : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "compare: rank %d: "
                                                   "a share of %d samples", rank, n);
    /* A deliberately wrong rank, to prove the verdict can fail: its share
     * of the loss gradient is 1% too large, so every rank's reduced
     * gradient is off. With --comm-hook only the hooked run is
     * perturbed, for the hook's bounded verdict to catch. */
    float scale = 1.0f / (float)o->batch *
                  (rank == o->perturb_rank && (!o->comm_hook || o->hooked) ? 1.01f : 1.0f);
    for (int i = 0; st == TDM_STATUS_OK && i < o->steps; i++) {
        /* this rank's share only (a gpt's rank draws its own windows) */
        if (n > 0) tdm_cmp_rows(c->data, i, o->batch, (int)lo, n, x, y);
        double loss_sum = 0.0;
        uint64_t t0 = tdm_time_ns();
        st = ops->zero_grad(r->w);
        if (st == TDM_STATUS_OK) st = ops->forward(r->w, x, y, n, scale, &loss_sum);
        uint64_t tb = tdm_time_ns();
        if (st == TDM_STATUS_OK) st = ops->backward(r->w);
        if (st == TDM_STATUS_OK) st = ops->step(r->w, r->opt);
        uint64_t t1 = tdm_time_ns();
        if (st == TDM_STATUS_OK && i == 0)
            st = b->design->params(r, rank == 0 ? TDM_CMP_AT(sh, off_first, float) : NULL, 0);
        if (st) return tdm_cmp_rank_fail(r, i + 1);
        size_t k = (size_t)i * (size_t)world + (size_t)rank;
        TDM_CMP_AT(sh, off_loss, double)[k] = loss_sum;
        TDM_CMP_AT(sh, off_step, double)[k] = (double)(t1 - t0) * 1e-6;
        TDM_CMP_AT(sh, off_t0, double)[k] = (double)(t0 - c->t_start) * 1e-6;
        TDM_CMP_AT(sh, off_bwd, double)[k] = (double)(tb - c->t_start) * 1e-6;
        double *line = rank == 0 ? TDM_CMP_AT(sh, off_line, double) +
                                       (size_t)i * TDM_CMP_MAX_LINE * TDM_CMP_LINE_WIDTH
                                 : NULL;
        /* entries past this step's own: DDP -1 (not in its plan), a
         * sharded mode's kind -1 (none) */
        for (int j = 0; line && j < TDM_CMP_MAX_LINE; j++)
            memcpy(line + (size_t)j * TDM_CMP_LINE_WIDTH,
                   sharded ? (const double[4]){-1.0, -1.0, 0.0, 0.0}
                           : (const double[4]){-1.0, -1.0, -1.0, 0.0},
                   4 * sizeof(double));
        if (sharded) tdm_cmp_record_fsdp(sh, r, k, line);
        else tdm_cmp_record_ddp(sh, r, k, line);
    }
    /* the final parameters on every rank: rank 0 publishes its own, the
     * others check theirs after a barrier */
    if (st == TDM_STATUS_OK) st = b->design->params(r, mine, -1);
    if (st == TDM_STATUS_OK && rank == 0) {
        memcpy(TDM_CMP_AT(sh, off_last, float), mine, (size_t)sh->param_elems * sizeof(float));
        tdm_cmp_summary(sh, r, sharded);
    }
    if (st == TDM_STATUS_OK) st = tdm_comm_barrier(d->comm);
    /* an MPI job's ranks share no memory: rank 0's parameters come over comm */
    if (st == TDM_STATUS_OK && d->start == TDM_DIST_START_GIVEN)
        st = tdm_comm_broadcast(d->comm, TDM_CMP_AT(sh, off_last, float),
                                TDM_CMP_AT(sh, off_last, float), (size_t)sh->param_elems,
                                TDM_DTYPE_FLOAT32, 0);
    if (st == TDM_STATUS_OK) {
        sh->agree[rank] = !memcmp(mine, TDM_CMP_AT(sh, off_last, float),
                                  (size_t)sh->param_elems * sizeof(float));
        tdm_cmp_memory_of(&sh->mem[rank], r, sharded);
    } else {
        fprintf(stderr, "tandem compare: %s rank %d: %s\n", tdm_cmp_mode_name(c->mode), rank,
                tdm_error_message());
    }
    free(x);
    free(y);
    free(mine);
    return st;
}

/* ---- the mode ---- */

/* An MPI job: sums every rank's records onto rank 0's (each rank writes
 * only its own slots, rank 0 alone the rest, so a sum is a gather):
 * `doubles` per-rank figures, the ranks' agreement flags and memory rows. */
static tdm_status tdm_cmp_gather_records(tdm_comm *comm, double *per_rank, size_t doubles,
                                         int *agree, tdm_cmp_memory *mem)
{
    int32_t a[TDM_CMP_MAX_DEV];
    for (int k = 0; k < TDM_CMP_MAX_DEV; k++) a[k] = agree[k];
    tdm_status st = tdm_comm_reduce(comm, per_rank, per_rank, doubles, TDM_DTYPE_FLOAT64,
                                    TDM_REDOP_SUM, 0);
    if (st == TDM_STATUS_OK)
        st = tdm_comm_reduce(comm, a, a, TDM_CMP_MAX_DEV, TDM_DTYPE_INT32, TDM_REDOP_SUM, 0);
    if (st == TDM_STATUS_OK)
        st = tdm_comm_reduce(comm, mem, mem,
                             (size_t)TDM_CMP_MAX_DEV * (sizeof(tdm_cmp_memory) / sizeof(double)),
                             TDM_DTYPE_FLOAT64, TDM_REDOP_SUM, 0);
    for (int k = 0; k < TDM_CMP_MAX_DEV; k++) agree[k] = a[k];
    return st;
}


/* The mapping's layout for `steps` steps of `world` ranks. */
static tdm_cmp_shared tdm_cmp_layout(int world, int steps, int64_t pe)
{
    size_t S = (size_t)steps, W = (size_t)world;
    tdm_cmp_shared lay = {.world = world, .steps = steps, .param_elems = pe};
    size_t off = (sizeof lay + 63) & ~(size_t)63;
#define TDM_CMP_PLACE(field, bytes) (lay.field = off, off = (off + (bytes) + 63) & ~(size_t)63)
    TDM_CMP_PLACE(off_loss, S * W * sizeof(double));
    TDM_CMP_PLACE(off_step, S * W * sizeof(double));
    TDM_CMP_PLACE(off_t0, S * W * sizeof(double));
    TDM_CMP_PLACE(off_phase, S * W * sizeof(tdm_phase_times));
    TDM_CMP_PLACE(off_comm, S * W * sizeof(double));
    TDM_CMP_PLACE(off_exposed, S * W * sizeof(double));
    TDM_CMP_PLACE(off_bwd, S * W * sizeof(double));
    TDM_CMP_PLACE(off_line, S * TDM_CMP_MAX_LINE * TDM_CMP_LINE_WIDTH * sizeof(double));
    TDM_CMP_PLACE(off_first, (size_t)pe * sizeof(float));
    TDM_CMP_PLACE(off_last, (size_t)pe * sizeof(float));
#undef TDM_CMP_PLACE
    lay.total = off;
    return lay;
}

/* The result from the ranks' records: rank 0's view of each step, every
 * rank's phases, the timeline (DDP's buckets, or the collectives). */
static tdm_status tdm_cmp_result_of(const tdm_cmp_ranks *c, const tdm_cmp_shared *sh,
                                    tdm_cmp_result *r)
{
    size_t S = (size_t)sh->steps, W = (size_t)sh->world;
    int sharded = tdm_cmp_is_sharded(c->mode);
    TDM_CHECK(tdm_cmp_alloc(r, c->mode, sh->world, sh->steps, sh->param_elems));
    const double *loss = TDM_CMP_AT(sh, off_loss, double);
    const tdm_phase_times *phase = TDM_CMP_AT(sh, off_phase, tdm_phase_times);
    for (size_t i = 0; i < S; i++) {
        double l = 0.0;
        for (size_t k = 0; k < W; k++) l += loss[i * W + k];
        r->loss[i] = l / c->o->batch;
        r->step_ms[i] = TDM_CMP_AT(sh, off_step, double)[i * W];   /* rank 0's view */
        r->step_t0_ms[i] = TDM_CMP_AT(sh, off_t0, double)[i * W];
        for (size_t k = 0; k < W; k++) r->phase[i * W + k] = phase[i * W + k];
        r->wall[i] = phase[i * W];
        r->comm_ms[i] = TDM_CMP_AT(sh, off_comm, double)[i * W];
        r->exposed_ms[i] = TDM_CMP_AT(sh, off_exposed, double)[i * W];
        if (!sharded) r->bwd_t0_ms[i] = TDM_CMP_AT(sh, off_bwd, double)[i * W];
    }
    int n = sh->n_line, width = sharded ? 4 : 3;
    double *line = calloc(S * (size_t)(n > 0 ? n : 1) * (size_t)width, sizeof(double));
    TDM_REQUIRE(line, TDM_STATUS_OUT_OF_MEMORY, "compare: a timeline of %d entries", n);
    for (size_t i = 0; i < S; i++)
        for (int j = 0; j < n; j++)
            memcpy(line + (i * (size_t)n + (size_t)j) * (size_t)width,
                   TDM_CMP_AT(sh, off_line, double) +
                       (i * TDM_CMP_MAX_LINE + (size_t)j) * TDM_CMP_LINE_WIDTH,
                   (size_t)width * sizeof(double));
    if (sharded) {
        r->n_coll = n;
        r->coll = line;
    } else {
        r->n_buckets = n;
        r->bucket = line;
    }
    r->prefetch_frac = sh->prefetch_frac;
    r->overlap_bytes_frac = sh->overlap_frac;
    r->bytes_per_step = sh->bytes_per_step;
    memcpy(r->params_first, TDM_CMP_AT(sh, off_first, float),
           (size_t)sh->param_elems * sizeof(float));
    memcpy(r->params_last, TDM_CMP_AT(sh, off_last, float),
           (size_t)sh->param_elems * sizeof(float));
    for (int k = 0; k < sh->world; k++) {
        r->ranks_agree &= sh->agree[k];
        r->mem[k] = sh->mem[k];
    }
    r->ok = 1;
    return TDM_STATUS_OK;
}

/* What every rank builds, from compare's options. */
static tdm_status tdm_cmp_build(const tdm_cmp_opts *o, tdm_cmp_mode mode, tdm_tool_build *b)
{
    int sharded = tdm_cmp_is_sharded(mode);
    *b = (tdm_tool_build){.design = sharded ? &tdm_tool_fsdp_design : &tdm_tool_ddp_design,
                          .cmd = "tandem compare", .seed = o->seed, .no_overlap = o->no_overlap,
                          .bucket_cap_mb = o->bucket_cap_mb, .sync_bn = o->sync_bn,
                          /* --comm-hook's second run (tools/compare_hook.c) */
                          .comm_hook = o->hooked ? o->comm_hook : NULL,
                          .powersgd = {.rank = o->powersgd_rank,
                                       .start_step = o->powersgd_start_step, .seed = o->seed},
                          .sharding = mode == TDM_CMP_ZERO1   ? TDM_FSDP_SHARD_OPTIM
                                      : mode == TDM_CMP_ZERO2 ? TDM_FSDP_SHARD_GRAD_OP
                                                              : TDM_FSDP_FULL_SHARD};
    TDM_CHECK(tdm_model_spec_parse(&b->spec, o->model));
    tdm_optim_opts_named(&b->optim, o->optim, o->lr, o->weight_decay, o->momentum, 0);
    b->precision = o->precision;
    b->ckpt = o->ckpt;
    return TDM_STATUS_OK;
}

tdm_status tdm_cmp_run_ranks(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                             tdm_cmp_mode mode, int world, tdm_cmp_result *r)
{
    const char *name = tdm_cmp_mode_name(mode);
    int64_t pe = tdm_cmp_param_elems(o);
    tdm_tool_build b;
    tdm_status st;
    if (pe <= 0 || (st = tdm_cmp_build(o, mode, &b))) {
        fprintf(stderr, "tandem compare: %s: %s\n", name, tdm_error_message());
        return TDM_STATUS_INVALID_ARG;
    }
    tdm_cmp_shared lay = tdm_cmp_layout(world, o->steps, pe);
    tdm_cmp_shared *sh = mmap(NULL, lay.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                              -1, 0);
    if (sh == MAP_FAILED) {
        perror("tandem compare: mmap");
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "compare: mmap of %zu bytes", lay.total);
    }
    *sh = lay;
    tdm_cmp_ranks c = {.o = o, .data = data, .mode = mode, .sh = sh, .t_start = tdm_time_ns()};
    b.tool = &c;
    tdm_dist_design d = b.design->dist;
    d.run = tdm_cmp_rank_run;
    /* the process group's timeout: TANDEM_TIMEOUT, else the default */
    tdm_dist_run_opts ro = {.devices = &o->dl, .spec = o->device, .world = world,
                            .run_timeout_ms = TDM_CMP_RUN_TIMEOUT_MS};
    if (!(st = tdm_dist_timeout_from_env(&ro.timeout_ms)) && !ro.timeout_ms)
        ro.timeout_ms = TDM_DIST_TIMEOUT_DEFAULT_MS;
    if (!tdm_cmp_is_sharded(mode)) ro.arena_bytes = tdm_tool_ddp_arena_bytes(&o->dl, pe);
    if (o->ddp_comm) {
        /* an MPI job: this process is one rank, over the job's --backend
         * communicator; rank 0 gathers the others' records (their slots
         * are zero elsewhere, so a sum is a gather) */
        ro.comm = o->ddp_comm;
        ro.env = (tdm_dist_env){.rank = tdm_comm_rank(o->ddp_comm),
                                .world_size = tdm_comm_size(o->ddp_comm)};
    }
    fflush(stdout);
    if (st == TDM_STATUS_OK) st = tdm_dist_run(&d, &b, &ro);
    if (st == TDM_STATUS_OK && o->ddp_comm)
        st = tdm_cmp_gather_records(o->ddp_comm, TDM_CMP_AT(sh, off_loss, double),
                                    (sh->off_line - sh->off_loss) / sizeof(double), sh->agree,
                                    sh->mem);
    if (st) fprintf(stderr, "tandem compare: %s: %s\n", name, tdm_error_message());
    else if (o->ddp_comm && tdm_comm_rank(o->ddp_comm) != 0) r->ok = 1;   /* rank 0 reports */
    else st = tdm_cmp_result_of(&c, sh, r);
    munmap(sh, lay.total);
    return st;
}
