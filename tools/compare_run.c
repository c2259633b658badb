/* tools/compare_run.c: runs one training mode of `tandem compare` - one
 * device or DP (dp/) here, DDP and the sharded modes through
 * tools/compare_ranks.c - over the same global batches from the same
 * initial parameters, and records what it measured: losses, step times,
 * per-phase times per device, parameters after the first and last step,
 * memory. On GPUs one device and DP run in a child process. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/device.h"
#include "dist/run.h"
#include "dist/spawn.h"
#include "dp/dp.h"
#include "models/optim.h"
#include "models/train.h"
#include "models/recompute.h"
#include "tools/compare.h"
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

/* A result's per-step and parameter arrays (not the timelines, which
 * DDP and the sharded modes size themselves), in one order: what is
 * allocated, freed, and packed for a child process. */
#define TDM_CMP_ARRAYS 10
static int tdm_cmp_arrays(tdm_cmp_result *r, void **ptr[TDM_CMP_ARRAYS],
                          size_t bytes[TDM_CMP_ARRAYS])
{
    size_t steps = (size_t)r->steps, pe = (size_t)r->param_elems;
    int k = 0;
#define TDM_CMP_ARR(field, nbytes) (ptr[k] = (void **)&r->field, bytes[k] = (nbytes), k++)
    TDM_CMP_ARR(loss, steps * sizeof(double));
    TDM_CMP_ARR(step_ms, steps * sizeof(double));
    TDM_CMP_ARR(step_t0_ms, steps * sizeof(double));
    TDM_CMP_ARR(phase, steps * (size_t)r->n_dev * sizeof(tdm_phase_times));
    TDM_CMP_ARR(wall, steps * sizeof(tdm_phase_times));
    TDM_CMP_ARR(comm_ms, steps * sizeof(double));
    TDM_CMP_ARR(exposed_ms, steps * sizeof(double));
    TDM_CMP_ARR(bwd_t0_ms, steps * sizeof(double));
    TDM_CMP_ARR(params_first, pe * sizeof(float));
    TDM_CMP_ARR(params_last, pe * sizeof(float));
#undef TDM_CMP_ARR
    return k;
}

tdm_status tdm_cmp_alloc(tdm_cmp_result *r, tdm_cmp_mode mode, int n_dev, int steps,
                         int64_t param_elems)
{
    *r = (tdm_cmp_result){.mode = mode, .n_dev = n_dev, .steps = steps,
                          .param_elems = param_elems, .ranks_agree = 1};
    void **ptr[TDM_CMP_ARRAYS];
    size_t bytes[TDM_CMP_ARRAYS];
    int n = tdm_cmp_arrays(r, ptr, bytes), ok = 1;
    for (int k = 0; k < n; k++) ok &= (*ptr[k] = calloc(1, bytes[k] ? bytes[k] : 1)) != NULL;
    if (ok) return TDM_STATUS_OK;
    fprintf(stderr, "tandem compare: out of memory\n");
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "out of memory");
}

void tdm_cmp_result_free(tdm_cmp_result *r)
{
    void **ptr[TDM_CMP_ARRAYS];
    size_t bytes[TDM_CMP_ARRAYS];
    int n = tdm_cmp_arrays(r, ptr, bytes);
    for (int k = 0; k < n; k++) free(*ptr[k]);
    free(r->bucket);
    free(r->coll);
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
    TDM_CHECK(tdm_model_set_precision(*m, o->precision));
    TDM_CHECK(tdm_model_set_checkpoint(*m, o->ckpt));
    tdm_optim_opts_named(&oo, o->optim, o->lr, o->weight_decay, o->momentum, 0);
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

/* ---- one device and DataParallel (one process) ---- */

/* Single: the first device of --device; DP: the first n_dev. */
static tdm_status tdm_cmp_run_local(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                                    tdm_cmp_mode mode, int n_dev, tdm_cmp_result *r)
{
    tdm_status st = TDM_STATUS_OK;
    int dp = mode == TDM_CMP_DP, n = 0;
    const char *what = dp ? "DP" : "one device";
    char spec[TDM_DEVICE_LIST_MAX * 4 + 8];
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0};
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dp *dpp = NULL;
    tdm_single s = {0};
    int64_t feat = tdm_cmp_feat(data);
    float *x = malloc((size_t)o->batch * feat * sizeof(float));
    int32_t *y = malloc((size_t)o->batch * tdm_cmp_targets(data) * sizeof(int32_t));
    if (!x || !y) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "a batch of %d", o->batch);
        goto fail;
    }
    tdm_cmp_dev_spec(o, n_dev, spec, sizeof spec);
    if (dp) st = tdm_dp_devices_open(spec, devs, &n);
    else if (!(st = tdm_dist_rank_device(&o->dl, 0, &devs[0]))) n = 1;
    if (st == TDM_STATUS_OK) st = tdm_cmp_make(o, devs[0], &m, &opt);
    if (st == TDM_STATUS_OK && dp) st = tdm_dp_init(&dpp, m, devs, n, NULL);
    if (st) {
        tdm_cmp_fail(what, st);
        goto fail;
    }
    TDM_TRY(tdm_cmp_alloc(r, mode, n, o->steps, tdm_model_param_elems(m)));
    if (o->nudge) {
        /* every other parameter one ulp up: the smallest change float can
         * make, to measure how far such a change carries over the run */
        float *p = r->params_last;
        TDM_TRY(tdm_cmp_params_out(m, p));
        for (int64_t j = 0; j < r->param_elems; j += 2) p[j] = nextafterf(p[j], INFINITY);
        TDM_TRY(tdm_dev_copy_from_host(devs[0], tdm_model_params(m), p,
                                         (size_t)r->param_elems * sizeof(float)));
    }
    s.model = m;
    s.opt = opt;
    uint64_t t_start = tdm_time_ns();
    for (int i = 0; i < o->steps; i++) {
        tdm_cmp_batch(data, i, o->batch, x, y);
        uint64_t t0 = tdm_time_ns();
        st = dp ? tdm_dp_step(dpp, opt, x, y, o->batch, &r->loss[i])
                : tdm_single_step(&s, x, y, o->batch, &r->loss[i]);
        if (st != TDM_STATUS_OK) {
            tdm_cmp_fail(dp ? "DP step" : "one device step", st);
            goto fail;
        }
        r->step_ms[i] = (double)(tdm_time_ns() - t0) * 1e-6;
        r->step_t0_ms[i] = (double)(t0 - t_start) * 1e-6;
        if (dp) {
            const tdm_dp_timings *t = tdm_dp_last_timings(dpp);
            for (int d = 0; d < n; d++) r->phase[(size_t)i * n + d] = t->device[d];
            r->wall[i] = t->wall;
        } else {
            memcpy(r->phase[i].ms, s.ms, sizeof s.ms);
            r->wall[i] = r->phase[i];
        }
        if (i == 0) TDM_TRY(tdm_cmp_params_out(m, r->params_first));
    }
    TDM_TRY(tdm_cmp_params_out(m, r->params_last));
    for (int d = 0; d < n; d++)
        tdm_cmp_mem_model(&r->mem[d], dp ? tdm_dp_replica(dpp, d) : m,
                          d == 0 ? tdm_optim_state_bytes(opt) : 0);
    for (int d = 0; d < n; d++) {
        tdm_dev_mem_stats ms;
        if (tdm_dev_mem_query(devs[d], &ms) == TDM_STATUS_OK) r->mem[d].peak = (double)ms.peak_bytes;
    }
    /* DP's output device also holds the gathered logits and their gradient */
    if (dp)
        r->mem[0].comm = 2.0 * o->batch * tdm_model_out_rows(m) * tdm_model_n_classes(m) *
                         sizeof(float);
    r->ok = 1;
fail:
    tdm_dp_free(dpp);
    tdm_single_free(&s);
    tdm_optim_free(opt);
    tdm_model_free(m);
    if (dp) tdm_dp_devices_close(devs, n);
    else tdm_device_free(devs[0]);
    free(x);
    free(y);
    return st;
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

static tdm_status tdm_cmp_run_here(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                                   tdm_cmp_mode mode, int n_dev, tdm_cmp_result *r)
{
    memset(r, 0, sizeof *r);
    switch (mode) {
    case TDM_CMP_SINGLE:
    case TDM_CMP_DP: return tdm_cmp_run_local(o, data, mode, n_dev, r);
    default: return tdm_cmp_run_ranks(o, data, mode, n_dev, r);
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

/* The mapping: the result struct, then its arrays, 64-byte aligned. */
static size_t tdm_cmp_iso_bytes(size_t steps, int n_dev, size_t pe)
{
    tdm_cmp_result r = {.steps = (int)steps, .n_dev = n_dev, .param_elems = (int64_t)pe};
    void **ptr[TDM_CMP_ARRAYS];
    size_t bytes[TDM_CMP_ARRAYS], total = (sizeof r + 63) & ~(size_t)63;
    int k = tdm_cmp_arrays(&r, ptr, bytes);
    for (int i = 0; i < k; i++) total += (bytes[i] + 63) & ~(size_t)63;
    return total;
}

/* copy_in: mapping -> r's arrays (parent); else r's arrays -> mapping. */
static void tdm_cmp_iso_copy(tdm_cmp_result *r, unsigned char *sh, int copy_in)
{
    void **ptr[TDM_CMP_ARRAYS];
    size_t bytes[TDM_CMP_ARRAYS], off = (sizeof *r + 63) & ~(size_t)63;
    int k = tdm_cmp_arrays(r, ptr, bytes);
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
    tdm_cmp_iso_copy(&r, a->sh, 0);
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
    tdm_cmp_iso_copy(r, a.sh, 1);
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
