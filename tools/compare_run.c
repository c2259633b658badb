/* tools/compare_run.c: runs one training mode of `tandem compare` - one
 * device, DP (dp/) or DDP (ddp/, forked ranks) - over the same global
 * batches from the same initial parameters, and records what it measured:
 * losses, step times, per-phase times per device or rank, DDP bucket
 * timings, parameters after the first and last step, memory. DDP ranks
 * write their records into a shared anonymous mapping the parent reads
 * after they exit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/device.h"
#include "ddp/ddp.h"
#include "dist/spawn.h"
#include "dp/dp.h"
#include "models/optim.h"
#include "models/train.h"
#include "tools/compare.h"
#include "tools/ddp_rank.h"
#include "tools/devices.h"
#include "tools/stats.h"

const char *tdm_cmp_mode_name(tdm_cmp_mode m)
{
    static const char *const n[] = {"single", "DP", "DDP", "FSDP", "ZeRO-2", "ZeRO-1"};
    return (unsigned)m < TDM_CMP_NMODES ? n[m] : "?";
}

void tdm_cmp_dev_name(const tdm_cmp_opts *o, int i, char *buf, size_t len)
{
    if (o->dl.kind == TDM_DEVICE_CUDA)
        snprintf(buf, len, "%s:%d", tdm_tool_cuda_emulated() ? "cuda-emu" : "cuda",
                 o->dl.index[i]);
    else
        snprintf(buf, len, "cpu:%d", i);
}

void tdm_cmp_dev_spec(const tdm_cmp_opts *o, int n, char *buf, size_t len)
{
    if (o->dl.kind != TDM_DEVICE_CUDA) {
        snprintf(buf, len, "cpu:%d", n);
        return;
    }
    size_t used = (size_t)snprintf(buf, len, "cuda:");
    for (int i = 0; i < n && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%d", i ? "," : "", o->dl.index[i]);
}

tdm_status tdm_cmp_alloc(tdm_cmp_result *r, tdm_cmp_mode mode, int n_dev, int steps,
                         int64_t param_elems)
{
    memset(r, 0, sizeof *r);
    r->mode = mode;
    r->n_dev = n_dev;
    r->steps = steps;
    r->param_elems = param_elems;
    r->ranks_agree = 1;
    r->loss = calloc((size_t)steps, sizeof(double));
    r->step_ms = calloc((size_t)steps, sizeof(double));
    r->step_t0_ms = calloc((size_t)steps, sizeof(double));
    r->phase = calloc((size_t)steps * n_dev, sizeof(tdm_phase_times));
    r->wall = calloc((size_t)steps, sizeof(tdm_phase_times));
    r->comm_ms = calloc((size_t)steps, sizeof(double));
    r->exposed_ms = calloc((size_t)steps, sizeof(double));
    r->bwd_t0_ms = calloc((size_t)steps, sizeof(double));
    r->params_first = calloc((size_t)param_elems, sizeof(float));
    r->params_last = calloc((size_t)param_elems, sizeof(float));
    if (!r->loss || !r->step_ms || !r->step_t0_ms || !r->phase || !r->wall || !r->comm_ms ||
        !r->exposed_ms || !r->bwd_t0_ms || !r->params_first || !r->params_last) {
        fprintf(stderr, "tandem compare: out of memory\n");
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "out of memory");
    }
    return TDM_STATUS_OK;
}

void tdm_cmp_result_free(tdm_cmp_result *r)
{
    free(r->loss);
    free(r->step_ms);
    free(r->step_t0_ms);
    free(r->phase);
    free(r->wall);
    free(r->comm_ms);
    free(r->exposed_ms);
    free(r->bwd_t0_ms);
    free(r->bucket);
    free(r->coll);
    free(r->params_first);
    free(r->params_last);
    memset(r, 0, sizeof *r);
}

static tdm_status tdm_cmp_fail(const char *what, tdm_status st)
{
    fprintf(stderr, "tandem compare: %s: %s\n", what, tdm_error_message());
    return st;
}

static tdm_status tdm_cmp_make(const tdm_cmp_opts *o, tdm_device *dev, tdm_model **m,
                               tdm_optim **opt)
{
    tdm_model_spec spec;
    tdm_optim_opts oo;
    TDM_CHECK(tdm_model_spec_parse(&spec, o->model));
    TDM_CHECK(tdm_model_init(m, dev, &spec, o->seed));
    tdm_optim_opts_default(&oo, strcmp(o->optim, "adamw") ? TDM_OPTIM_SGD : TDM_OPTIM_ADAMW);
    oo.lr = (float)o->lr;
    oo.weight_decay = (float)o->weight_decay;
    if (oo.kind == TDM_OPTIM_SGD) oo.momentum = (float)o->momentum;
    return tdm_optim_init(opt, *m, &oo);
}

void tdm_cmp_rows(const tdm_cmp_data *d, int step, int batch, int lo, int n, void *x,
                  int32_t *y)
{
    if (d->text.train.bytes)
        tdm_text_windows(&d->text.train, d->T, d->seed, step, lo, n, x, y);
    else
        tdm_data_gather(&d->train, d->order + (int64_t)step * batch + lo, n, x, y);
}

int64_t tdm_cmp_feat(const tdm_cmp_data *d)
{
    return d->text.train.bytes ? d->T : tdm_data_features(&d->train);
}

int64_t tdm_cmp_targets(const tdm_cmp_data *d) { return d->text.train.bytes ? d->T : 1; }

static void tdm_cmp_batch(const tdm_cmp_data *d, int step, int batch, void *x, int32_t *y)
{
    tdm_cmp_rows(d, step, batch, 0, batch, x, y);
}

static tdm_status tdm_cmp_params_out(tdm_model *m, float *dst)
{
    tdm_device *d = tdm_model_device(m);
    return tdm_dev_copy_to_host(d, dst, tdm_model_params(m),
                                (size_t)tdm_model_param_elems(m) * sizeof(float));
}

static void tdm_cmp_mem_model(tdm_cmp_memory *mem, tdm_model *m, size_t optim_bytes)
{
    tdm_model_memory mm;
    tdm_model_get_memory(m, &mm);
    mem->params = (double)mm.params;
    mem->grads = (double)mm.grads;
    mem->buffers = (double)mm.buffers;
    mem->activations = (double)mm.activations;
    mem->optim = (double)optim_bytes;
}

/* ---- one device ---- */

static tdm_status tdm_cmp_run_single(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                                     tdm_cmp_result *r)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_single s = {0};
    int64_t feat = tdm_cmp_feat(data);
    float *x = malloc((size_t)o->batch * feat * sizeof(float));
    int32_t *y = malloc((size_t)o->batch * tdm_cmp_targets(data) * sizeof(int32_t));
    if (!x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "a batch of %d", o->batch);
        goto fail;
    }
    if ((st = tdm_tool_rank_device(&o->dl, 0, &dev)) || (st = tdm_cmp_make(o, dev, &m, &opt))) {
        tdm_cmp_fail("one device", st);
        goto fail;
    }
    TDM_TRY(tdm_cmp_alloc(r, TDM_CMP_SINGLE, 1, o->steps, tdm_model_param_elems(m)));
    if (o->nudge) {
        /* every other parameter one ulp up: the smallest change float can
         * make, to measure how far such a change carries over the run */
        float *p = r->params_last;
        TDM_TRY(tdm_cmp_params_out(m, p));
        for (int64_t j = 0; j < r->param_elems; j += 2) p[j] = nextafterf(p[j], INFINITY);
        TDM_TRY(tdm_dev_copy_from_host(dev, tdm_model_params(m), p,
                                         (size_t)r->param_elems * sizeof(float)));
    }
    s.model = m;
    s.opt = opt;
    uint64_t t_start = tdm_time_ns();
    for (int i = 0; i < o->steps; i++) {
        tdm_cmp_batch(data, i, o->batch, x, y);
        uint64_t t0 = tdm_time_ns();
        if ((st = tdm_single_step(&s, x, y, o->batch, &r->loss[i])) != TDM_STATUS_OK) {
            tdm_cmp_fail("one device step", st);
            goto fail;
        }
        r->step_ms[i] = (double)(tdm_time_ns() - t0) * 1e-6;
        r->step_t0_ms[i] = (double)(t0 - t_start) * 1e-6;
        memcpy(r->phase[i].ms, s.ms, sizeof s.ms);
        r->wall[i] = r->phase[i];
        if (i == 0) TDM_TRY(tdm_cmp_params_out(m, r->params_first));
    }
    TDM_TRY(tdm_cmp_params_out(m, r->params_last));
    tdm_cmp_mem_model(&r->mem[0], m, tdm_optim_state_bytes(opt));
    r->ok = 1;
fail:
    tdm_single_free(&s);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    free(x);
    free(y);
    return st;
}

/* ---- DataParallel ---- */

static tdm_status tdm_cmp_run_dp(const tdm_cmp_opts *o, const tdm_cmp_data *data, int n_dev,
                                 tdm_cmp_result *r)
{
    tdm_status st = TDM_STATUS_OK;
    int n = 0;
    char spec[TDM_DEVICE_LIST_MAX * 4 + 8];
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dp *dp = NULL;
    int64_t feat = tdm_cmp_feat(data);
    float *x = malloc((size_t)o->batch * feat * sizeof(float));
    int32_t *y = malloc((size_t)o->batch * tdm_cmp_targets(data) * sizeof(int32_t));
    tdm_cmp_dev_spec(o, n_dev, spec, sizeof spec);
    if (!x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "a batch of %d", o->batch);
        goto fail;
    }
    if ((st = tdm_dp_devices_open(spec, devs, &n)) || (st = tdm_cmp_make(o, devs[0], &m, &opt)) ||
        (st = tdm_dp_init(&dp, m, devs, n, NULL))) {
        tdm_cmp_fail("DP", st);
        goto fail;
    }
    TDM_TRY(tdm_cmp_alloc(r, TDM_CMP_DP, n, o->steps, tdm_model_param_elems(m)));
    uint64_t t_start = tdm_time_ns();
    for (int i = 0; i < o->steps; i++) {
        tdm_cmp_batch(data, i, o->batch, x, y);
        uint64_t t0 = tdm_time_ns();
        if ((st = tdm_dp_step(dp, opt, x, y, o->batch, &r->loss[i])) != TDM_STATUS_OK) {
            tdm_cmp_fail("DP step", st);
            goto fail;
        }
        r->step_ms[i] = (double)(tdm_time_ns() - t0) * 1e-6;
        r->step_t0_ms[i] = (double)(t0 - t_start) * 1e-6;
        const tdm_dp_timings *t = tdm_dp_last_timings(dp);
        for (int d = 0; d < n; d++) r->phase[(size_t)i * n + d] = t->device[d];
        r->wall[i] = t->wall;
        if (i == 0) TDM_TRY(tdm_cmp_params_out(m, r->params_first));
    }
    TDM_TRY(tdm_cmp_params_out(m, r->params_last));
    for (int d = 0; d < n; d++)
        tdm_cmp_mem_model(&r->mem[d], tdm_dp_replica(dp, d),
                          d == 0 ? tdm_optim_state_bytes(opt) : 0);
    /* the output device also holds the gathered logits and their gradient */
    r->mem[0].comm = 2.0 * o->batch * tdm_model_out_rows(m) * tdm_model_n_classes(m) *
                     sizeof(float);
    r->ok = 1;
fail:
    tdm_dp_free(dp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, n);
    free(x);
    free(y);
    return st;
}

/* ---- DistributedDataParallel ---- */

/* What the ranks write, in one shared anonymous mapping. */
typedef struct tdm_cmp_shared {
    int world, steps, n_buckets;
    int64_t param_elems;
    double overlap_bytes_frac, bytes_per_step;
    int agree[TDM_CMP_MAX_DEV];
    tdm_cmp_memory mem[TDM_CMP_MAX_DEV];
    size_t off_loss, off_step, off_t0, off_phase, off_comm, off_exposed, off_bwd, off_bucket,
        off_first, off_last, total;
} tdm_cmp_shared;

#define TDM_CMP_AT(sh, off, type) ((type *)((char *)(sh) + (sh)->off))

typedef struct tdm_cmp_ddp_arg {
    const tdm_cmp_opts *o;
    const tdm_cmp_data *data;
    tdm_cmp_shared *sh;
    uint64_t t_start;
} tdm_cmp_ddp_arg;

/* Step i's figures of this rank into the shared record: loss, times,
 * phases, and on rank 0 the bucket timeline (the plan changes after the
 * first step, ddp.h: rebuilt in the order gradients became ready; -1: no
 * such bucket). */
static void tdm_cmp_ddp_record(tdm_cmp_shared *sh, tdm_ddp *ddp, int i, int rank, int world,
                               double loss_sum, uint64_t t0, uint64_t tb, uint64_t t1,
                               uint64_t t_start)
{
    size_t k = (size_t)i * world + rank;
    TDM_CMP_AT(sh, off_loss, double)[k] = loss_sum;
    TDM_CMP_AT(sh, off_step, double)[k] = (double)(t1 - t0) * 1e-6;
    TDM_CMP_AT(sh, off_t0, double)[k] = (double)(t0 - t_start) * 1e-6;
    tdm_ddp_times t;
    tdm_ddp_get_times(ddp, &t);
    TDM_CMP_AT(sh, off_phase, tdm_phase_times)[k] = t.last;
    TDM_CMP_AT(sh, off_comm, double)[k] = t.comm_ms_last;
    TDM_CMP_AT(sh, off_exposed, double)[k] = t.last.ms[TDM_PHASE_ALLREDUCE_WAIT];
    TDM_CMP_AT(sh, off_bwd, double)[k] = (double)(tb - t_start) * 1e-6;
    if (rank != 0) return;
    int nb = t.n_buckets < TDM_CMP_MAX_BUCKETS ? t.n_buckets : TDM_CMP_MAX_BUCKETS;
    if (nb > sh->n_buckets) sh->n_buckets = nb;
    double *bucket = TDM_CMP_AT(sh, off_bucket, double);
    for (int j = 0; j < TDM_CMP_MAX_BUCKETS; j++) {
        double *e = bucket + ((size_t)i * TDM_CMP_MAX_BUCKETS + j) * 3;
        e[0] = j < nb ? t.buckets[j].ready_ms : -1.0;
        e[1] = j < nb ? t.buckets[j].start_ms : -1.0;
        e[2] = j < nb ? t.buckets[j].end_ms : -1.0;
    }
}

static int tdm_cmp_ddp_rank(tdm_comm *comm, void *argp)
{
    tdm_cmp_ddp_arg *a = argp;
    const tdm_cmp_opts *o = a->o;
    tdm_cmp_shared *sh = a->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm), rc = 1;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_comm *nccl = NULL;   /* GPUs: the gradient communicator, bootstrapped over comm */
    int64_t feat = tdm_cmp_feat(a->data);
    int64_t lo, hi;
    tdm_dist_share(o->batch, rank, world, &lo, &hi);
    int b = (int)(hi - lo);
    float *x = malloc((size_t)(b > 0 ? b : 1) * feat * sizeof(float));
    int32_t *y = malloc((size_t)(b > 0 ? b : 1) * tdm_cmp_targets(a->data) * sizeof(int32_t));
    float *mine = NULL;
    tdm_ddp_opts dopts = {.bucket_cap_mb = o->bucket_cap_mb, .no_overlap = o->no_overlap,
                          .sync_bn = o->sync_bn};
    if (!x || !y) goto done;
    if (tdm_tool_rank_device(&o->dl, rank, &dev) != TDM_STATUS_OK ||
        tdm_cmp_make(o, dev, &m, &opt) != TDM_STATUS_OK ||
        tdm_tool_rank_ddp(comm, dev, m, &dopts, &nccl, &ddp) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: DDP rank %d: %s\n", rank, tdm_error_message());
        goto done;
    }
    /* A deliberately wrong rank, to prove the verdict can fail: its share
     * of the loss gradient is 1% too large, so every rank's all-reduced
     * gradient is off. */
    if (o->hooked && o->comm_hook) {
        tdm_ddp_powersgd_opts po = {.rank = o->powersgd_rank,
                                    .start_step = o->powersgd_start_step, .seed = o->seed};
        if (tdm_ddp_set_comm_hook(ddp, o->comm_hook, &po) != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: DDP rank %d: %s\n", rank, tdm_error_message());
            goto done;
        }
    }
    /* with --comm-hook only the hooked run is perturbed, for the hook's
     * bounded verdict to catch */
    float scale = 1.0f / (float)o->batch *
                  (rank == o->perturb_rank && (!o->comm_hook || o->hooked) ? 1.01f : 1.0f);
    for (int i = 0; i < o->steps; i++) {
        /* this rank's share only (a gpt's rank draws its own windows) */
        if (b > 0) tdm_cmp_rows(a->data, i, o->batch, (int)lo, b, x, y);
        double loss_sum = 0.0;
        uint64_t t0 = tdm_time_ns();
        tdm_status st = tdm_ddp_zero_grad(ddp);
        if (st == TDM_STATUS_OK) st = tdm_ddp_forward_scaled(ddp, x, y, b, scale, &loss_sum);
        uint64_t tb = tdm_time_ns();
        if (st == TDM_STATUS_OK) st = tdm_ddp_backward(ddp);
        if (st == TDM_STATUS_OK) st = tdm_ddp_step(ddp, opt);
        if (st != TDM_STATUS_OK) {
            fprintf(stderr, "tandem compare: DDP rank %d, step %d: %s\n", rank, i + 1,
                        tdm_error_message());
            goto done;
        }
        uint64_t t1 = tdm_time_ns();
        tdm_cmp_ddp_record(sh, ddp, i, rank, world, loss_sum, t0, tb, t1, a->t_start);
        if (rank == 0 && i == 0 &&
            tdm_cmp_params_out(m, TDM_CMP_AT(sh, off_first, float)) != TDM_STATUS_OK)
            goto done;
    }
    /* rank 0 publishes its final parameters; the others check theirs
     * against them after a barrier */
    if (rank == 0) {
        tdm_ddp_times t;
        tdm_ddp_get_times(ddp, &t);
        sh->overlap_bytes_frac =
            t.reduced_bytes_total > 0 ? t.overlapped_bytes_total / t.reduced_bytes_total : 0.0;
        sh->bytes_per_step = t.steps > 0 ? t.reduced_bytes_total / (double)t.steps : 0.0;
        if (tdm_cmp_params_out(m, TDM_CMP_AT(sh, off_last, float)) != TDM_STATUS_OK) goto done;
    }
    if (tdm_comm_barrier(comm) != TDM_STATUS_OK) goto done;
    /* an MPI job's ranks share no memory: rank 0's parameters come over comm */
    if (o->ddp_comm &&
        tdm_comm_broadcast(comm, TDM_CMP_AT(sh, off_last, float), TDM_CMP_AT(sh, off_last, float),
                           (size_t)sh->param_elems, TDM_DTYPE_FLOAT32, 0) != TDM_STATUS_OK)
        goto done;
    mine = malloc((size_t)sh->param_elems * sizeof(float));
    if (!mine || tdm_cmp_params_out(m, mine) != TDM_STATUS_OK) goto done;
    sh->agree[rank] = !memcmp(mine, TDM_CMP_AT(sh, off_last, float),
                              (size_t)sh->param_elems * sizeof(float));
    tdm_cmp_mem_model(&sh->mem[rank], m, tdm_optim_state_bytes(opt));
    /* shm: the rest of the arena; NCCL: its buckets are the gradients;
     * MPI (no zero-copy memory): its own buffers, not counted */
    sh->mem[rank].comm = nccl || !tdm_ddp_zero_copy(ddp)
                             ? 0.0
                             : (double)tdm_ddp_arena_bytes(sh->param_elems) - sh->mem[rank].grads;
    if (sh->mem[rank].comm < 0) sh->mem[rank].comm = 0;
    rc = 0;
done:
    /* stop the other ranks at once (one blocked in NCCL polls this flag)
     * instead of at the parent's grace period */
    if (rc) tdm_comm_abort(comm, "compare: a DDP rank failed");
    tdm_ddp_free(ddp);
    tdm_comm_free(nccl);   /* before comm, which bootstrapped it */
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    free(x);
    free(y);
    free(mine);
    return rc;
}

/* The model's parameter count, from a probe on a host device (this
 * process must not touch CUDA); 0 on failure (message kept). */
int64_t tdm_cmp_param_elems(const tdm_cmp_opts *o)
{
    tdm_model_spec spec;
    tdm_model *probe = NULL;
    tdm_device *dev = NULL;
    int64_t pe = 0;
    if (tdm_model_spec_parse(&spec, o->model) == TDM_STATUS_OK &&
        tdm_device_open(&dev, "cpu", 0, 1) == TDM_STATUS_OK &&
        tdm_model_init(&probe, dev, &spec, o->seed) == TDM_STATUS_OK)
        pe = tdm_model_param_elems(probe);
    tdm_model_free(probe);
    tdm_device_free(dev);
    return pe;
}

/* An MPI job: sums every rank's records onto rank 0's (each rank writes
 * only its own slots, rank 0 alone the rest, so a sum is a gather):
 * `doubles` per-rank figures, the ranks' agreement flags and memory rows.
 * Used by DDP's column and the sharded modes'. */
tdm_status tdm_cmp_gather_records(tdm_comm *comm, double *per_rank, size_t doubles, int *agree,
                                  tdm_cmp_memory *mem)
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

static tdm_status tdm_cmp_run_ddp(const tdm_cmp_opts *o, const tdm_cmp_data *data, int world,
                                  tdm_cmp_result *r)
{
    tdm_status st = TDM_STATUS_OK;
    int64_t pe = tdm_cmp_param_elems(o);
    if (pe <= 0) return tdm_cmp_fail("DDP", TDM_STATUS_INVALID_ARG);
    size_t S = (size_t)o->steps, W = (size_t)world;
    tdm_cmp_shared lay = {.world = world, .steps = o->steps, .param_elems = pe};
    size_t off = (sizeof lay + 63) & ~(size_t)63;
#define TDM_CMP_PLACE(field, bytes) (lay.field = off, off = (off + (bytes) + 63) & ~(size_t)63)
    TDM_CMP_PLACE(off_loss, S * W * sizeof(double));
    TDM_CMP_PLACE(off_step, S * W * sizeof(double));
    TDM_CMP_PLACE(off_t0, S * W * sizeof(double));
    TDM_CMP_PLACE(off_phase, S * W * sizeof(tdm_phase_times));
    TDM_CMP_PLACE(off_comm, S * W * sizeof(double));
    TDM_CMP_PLACE(off_exposed, S * W * sizeof(double));
    TDM_CMP_PLACE(off_bwd, S * W * sizeof(double));
    TDM_CMP_PLACE(off_bucket, S * TDM_CMP_MAX_BUCKETS * 3 * sizeof(double));
    TDM_CMP_PLACE(off_first, (size_t)pe * sizeof(float));
    TDM_CMP_PLACE(off_last, (size_t)pe * sizeof(float));
    lay.total = off;
    tdm_cmp_shared *sh = mmap(NULL, lay.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                              -1, 0);
    if (sh == MAP_FAILED) {
        perror("tandem compare: mmap");
        return TDM_STATUS_OUT_OF_MEMORY;
    }
    *sh = lay;
    tdm_cmp_ddp_arg arg = {.o = o, .data = data, .sh = sh, .t_start = tdm_time_ns()};
    tdm_dist_spawn_opts so = {.timeout_ms = TDM_CMP_RUN_TIMEOUT_MS,
                             .arena_bytes = tdm_tool_ddp_arena_bytes(&o->dl, pe)};
    fflush(stdout);
    if (o->ddp_comm) {
        /* an MPI job: this process is one rank; rank 0 gathers the others'
         * records (their slots are zero elsewhere, so a sum is a gather) */
        if (tdm_cmp_ddp_rank(o->ddp_comm, &arg) != 0) st = TDM_STATUS_INTERNAL;
        if (st == TDM_STATUS_OK) st = tdm_cmp_gather_records(
            o->ddp_comm, TDM_CMP_AT(sh, off_loss, double),
            (sh->off_bucket - sh->off_loss) / sizeof(double), sh->agree, sh->mem);
        if (st != TDM_STATUS_OK) {
            tdm_cmp_fail("DDP", st);
            goto fail;
        }
        if (tdm_comm_rank(o->ddp_comm) != 0) {
            r->ok = 1;   /* rank 0 reports */
            goto fail;   /* st is OK: the cleanup only */
        }
    } else if ((st = tdm_dist_spawn(world, tdm_cmp_ddp_rank, &arg, &so, NULL)) != TDM_STATUS_OK) {
        tdm_cmp_fail("DDP", st);
        goto fail;
    }
    TDM_TRY(tdm_cmp_alloc(r, TDM_CMP_DDP, world, o->steps, pe));
    const double *loss = TDM_CMP_AT(sh, off_loss, double);
    const double *step = TDM_CMP_AT(sh, off_step, double);
    const double *t0s = TDM_CMP_AT(sh, off_t0, double);
    const tdm_phase_times *phase = TDM_CMP_AT(sh, off_phase, tdm_phase_times);
    for (size_t i = 0; i < S; i++) {
        double l = 0.0;
        for (size_t k = 0; k < W; k++) l += loss[i * W + k];
        r->loss[i] = l / o->batch;
        r->step_ms[i] = step[i * W];          /* rank 0's view of the step */
        r->step_t0_ms[i] = t0s[i * W];
        for (size_t k = 0; k < W; k++) r->phase[i * W + k] = phase[i * W + k];
        r->wall[i] = phase[i * W];
        r->comm_ms[i] = TDM_CMP_AT(sh, off_comm, double)[i * W];
        r->exposed_ms[i] = TDM_CMP_AT(sh, off_exposed, double)[i * W];
        r->bwd_t0_ms[i] = TDM_CMP_AT(sh, off_bwd, double)[i * W];
    }
    r->n_buckets = sh->n_buckets;
    r->overlap_bytes_frac = sh->overlap_bytes_frac;
    r->bytes_per_step = sh->bytes_per_step;
    r->bucket = calloc(S * (size_t)(r->n_buckets > 0 ? r->n_buckets : 1) * 3, sizeof(double));
    if (!r->bucket) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "bucket timeline");
        goto fail;
    }
    for (size_t i = 0; i < S; i++)
        memcpy(r->bucket + i * (size_t)r->n_buckets * 3,
               TDM_CMP_AT(sh, off_bucket, double) + i * TDM_CMP_MAX_BUCKETS * 3,
               (size_t)r->n_buckets * 3 * sizeof(double));
    memcpy(r->params_first, TDM_CMP_AT(sh, off_first, float), (size_t)pe * sizeof(float));
    memcpy(r->params_last, TDM_CMP_AT(sh, off_last, float), (size_t)pe * sizeof(float));
    for (int k = 0; k < world; k++) {
        r->ranks_agree &= sh->agree[k];
        r->mem[k] = sh->mem[k];
    }
    r->ok = 1;
fail:
    munmap(sh, lay.total);
    return st;
}

static tdm_status tdm_cmp_run_here(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                                   tdm_cmp_mode mode, int n_dev, tdm_cmp_result *r)
{
    memset(r, 0, sizeof *r);
    switch (mode) {
    case TDM_CMP_SINGLE: return tdm_cmp_run_single(o, data, r);
    case TDM_CMP_DP: return tdm_cmp_run_dp(o, data, n_dev, r);
    case TDM_CMP_DDP: return tdm_cmp_run_ddp(o, data, n_dev, r);
    default: return tdm_cmp_run_fsdp(o, data, mode, n_dev, r);
    }
}

/* ---- single or DP in a child process (CUDA devices) ---- */

/* The child's result, packed into one shared anonymous mapping: the
 * struct (its pointers meaningless there), then the per-step arrays and
 * the parameters. Single and DP have no buckets. */
typedef struct tdm_cmp_iso {
    const tdm_cmp_opts *o;
    const tdm_cmp_data *data;
    tdm_cmp_mode mode;
    int n_dev;
    size_t steps, param_elems;
    unsigned char *sh;
} tdm_cmp_iso;

/* What each array of a result holds, in packing order: pointer and bytes. */
static int tdm_cmp_iso_arrays(tdm_cmp_result *r, size_t steps, int n_dev, size_t pe,
                              void **ptr[10], size_t bytes[10])
{
    int k = 0;
#define TDM_CMP_ARR(field, nbytes) (ptr[k] = (void **)&r->field, bytes[k] = (nbytes), k++)
    TDM_CMP_ARR(loss, steps * sizeof(double));
    TDM_CMP_ARR(step_ms, steps * sizeof(double));
    TDM_CMP_ARR(step_t0_ms, steps * sizeof(double));
    TDM_CMP_ARR(phase, steps * (size_t)n_dev * sizeof(tdm_phase_times));
    TDM_CMP_ARR(wall, steps * sizeof(tdm_phase_times));
    TDM_CMP_ARR(comm_ms, steps * sizeof(double));
    TDM_CMP_ARR(exposed_ms, steps * sizeof(double));
    TDM_CMP_ARR(bwd_t0_ms, steps * sizeof(double));
    TDM_CMP_ARR(params_first, pe * sizeof(float));
    TDM_CMP_ARR(params_last, pe * sizeof(float));
#undef TDM_CMP_ARR
    return k;
}

static size_t tdm_cmp_iso_bytes(size_t steps, int n_dev, size_t pe)
{
    tdm_cmp_result r;
    void **ptr[10];
    size_t bytes[10], total = (sizeof r + 63) & ~(size_t)63;
    int k = tdm_cmp_iso_arrays(&r, steps, n_dev, pe, ptr, bytes);
    for (int i = 0; i < k; i++) total += (bytes[i] + 63) & ~(size_t)63;
    return total;
}

/* copy_in: mapping -> r's arrays (parent); else r's arrays -> mapping. */
static void tdm_cmp_iso_copy(tdm_cmp_result *r, unsigned char *sh, size_t steps, int n_dev,
                             size_t pe, int copy_in)
{
    void **ptr[10];
    size_t bytes[10], off = (sizeof *r + 63) & ~(size_t)63;
    int k = tdm_cmp_iso_arrays(r, steps, n_dev, pe, ptr, bytes);
    for (int i = 0; i < k; i++) {
        if (copy_in) memcpy(*ptr[i], sh + off, bytes[i]);
        else memcpy(sh + off, *ptr[i], bytes[i]);
        off += (bytes[i] + 63) & ~(size_t)63;
    }
}

static int tdm_cmp_iso_child(tdm_comm *comm, void *argp)
{
    (void)comm;
    tdm_cmp_iso *a = argp;
    tdm_cmp_result r;
    if (tdm_cmp_run_here(a->o, a->data, a->mode, a->n_dev, &r) != TDM_STATUS_OK) return 1;
    if (r.n_dev != a->n_dev || (size_t)r.steps != a->steps ||
        (size_t)r.param_elems != a->param_elems || r.n_buckets != 0) {
        fprintf(stderr, "tandem compare: %s result of an unexpected shape\n",
                tdm_cmp_mode_name(a->mode));
        tdm_cmp_result_free(&r);
        return 1;
    }
    memcpy(a->sh, &r, sizeof r);
    tdm_cmp_iso_copy(&r, a->sh, a->steps, a->n_dev, a->param_elems, 0);
    tdm_cmp_result_free(&r);
    return 0;
}

static tdm_status tdm_cmp_run_isolated(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                                       tdm_cmp_mode mode, int n_dev, tdm_cmp_result *r)
{
    tdm_status st = TDM_STATUS_OK;
    int64_t pe = tdm_cmp_param_elems(o);
    if (pe <= 0) return tdm_cmp_fail(tdm_cmp_mode_name(mode), TDM_STATUS_INVALID_ARG);
    if (mode == TDM_CMP_SINGLE) n_dev = 1;
    tdm_cmp_iso a = {.o = o, .data = data, .mode = mode, .n_dev = n_dev,
                     .steps = (size_t)o->steps, .param_elems = (size_t)pe};
    size_t total = tdm_cmp_iso_bytes(a.steps, n_dev, a.param_elems);
    a.sh = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (a.sh == MAP_FAILED) {
        perror("tandem compare: mmap");
        return TDM_STATUS_OUT_OF_MEMORY;
    }
    tdm_dist_spawn_opts so = {.timeout_ms = TDM_CMP_RUN_TIMEOUT_MS};
    fflush(stdout);
    if ((st = tdm_dist_spawn(1, tdm_cmp_iso_child, &a, &so, NULL)) != TDM_STATUS_OK) {
        tdm_cmp_fail(tdm_cmp_mode_name(mode), st);
        goto fail;
    }
    tdm_cmp_result hdr;
    memcpy(&hdr, a.sh, sizeof hdr);
    TDM_TRY(tdm_cmp_alloc(r, mode, n_dev, o->steps, pe));
    tdm_cmp_iso_copy(r, a.sh, a.steps, n_dev, a.param_elems, 1);
    memcpy(r->mem, hdr.mem, sizeof r->mem);
    r->ranks_agree = hdr.ranks_agree;
    r->overlap_bytes_frac = hdr.overlap_bytes_frac;
    r->ok = hdr.ok;
    if (!hdr.ok) st = tdm_error_set(TDM_STATUS_INTERNAL, "%s: no result", tdm_cmp_mode_name(mode));
fail:
    munmap(a.sh, total);
    return st;
}

tdm_status tdm_cmp_run(const tdm_cmp_opts *o, const tdm_cmp_data *data, tdm_cmp_mode mode,
                       int n_dev, tdm_cmp_result *r)
{
    memset(r, 0, sizeof *r);
    if (o->dl.kind == TDM_DEVICE_CUDA && mode != TDM_CMP_DDP && !tdm_cmp_is_sharded(mode))
        return tdm_cmp_run_isolated(o, data, mode, n_dev, r);
    return tdm_cmp_run_here(o, data, mode, n_dev, r);
}

/* The first step counted in the figures (the warm-up left out, unless the
 * run is no longer than it). */
static int tdm_cmp_first_timed(const tdm_cmp_opts *o, const tdm_cmp_result *r)
{
    return o->warmup < r->steps ? o->warmup : 0;
}

void tdm_cmp_means(const tdm_cmp_opts *o, const tdm_cmp_result *r, double *step, double *comm,
                   double *exposed)
{
    int w = tdm_cmp_first_timed(o, r);
    double s = 0.0, c = 0.0, e = 0.0;
    for (int i = w; i < r->steps; i++) {
        s += r->step_ms[i];
        c += r->comm_ms[i];
        e += r->exposed_ms[i];
    }
    int n = r->steps - w;
    *step = s / n;
    if (comm) *comm = c / n;
    if (exposed) *exposed = e / n;
}

void tdm_cmp_step_stats(const tdm_cmp_opts *o, const tdm_cmp_result *r, double *med, double *min,
                        double *max)
{
    int w = tdm_cmp_first_timed(o, r);
    int n = r->steps - w;
    double *t = malloc((size_t)n * sizeof(double));
    if (!t || n <= 0) {
        *med = *min = *max = NAN;
        free(t);
        return;
    }
    memcpy(t, r->step_ms + w, (size_t)n * sizeof(double));
    *med = tdm_tool_median(t, n);  /* sorts t */
    *min = t[0];
    *max = t[n - 1];
    free(t);
}

void tdm_cmp_phase_mean(const tdm_cmp_opts *o, const tdm_cmp_result *r, tdm_phase_times *out)
{
    int w = tdm_cmp_first_timed(o, r);
    memset(out, 0, sizeof *out);
    for (int i = w; i < r->steps; i++)
        for (int p = 0; p < TDM_PHASE_COUNT_; p++) out->ms[p] += r->wall[i].ms[p];
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) out->ms[p] /= (r->steps - w);
}
