/* tests/test_fsdp_util.h: shared helpers of the sharded data parallel
 * tests: a result area shared with forked ranks (an anonymous MAP_SHARED
 * mapping: no /dev/shm name), small models and data (MLP, CNN, GPT on text
 * windows), one training run per rank in FSDP or in DDP (the same batches,
 * seeds and optimizer), and the single-device reference. Header-only
 * (static) so that each test binary stays one file. */
#ifndef TDM_TESTS_TEST_FSDP_UTIL_H
#define TDM_TESTS_TEST_FSDP_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/data.h"
#include "core/device.h"
#include "core/rng.h"
#include "core/text.h"
#include "ddp/ddp.h"
#include "dist/spawn.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "models/train.h"
#include "tests/test_ddp_util.h"

/* the emulator's count of unfinished copies, where cuda/ is linked */
__attribute__((weak)) int64_t tdm_cuda_emulator_xfers(const tdm_device *d);

#define TF_MAX_ELEMS (1 << 16)
#define TF_MAX_STEPS 64
#define TF_GPT_T 10

typedef struct tf_cfg {
    int model;               /* 0 MLP (dims, or 20-16-12-5), 1 CNN, 2 GPT */
    const int *dims;
    int ndims;
    int batch, steps;        /* global batch */
    int ddp;                 /* 1: this run is DDP, not FSDP */
    tdm_fsdp_sharding sharding;
    int no_prefetch, no_overlap;
    int64_t min_unit_elems;
    int adamw;
    int micro;               /* > 1: no_sync over this many micro-batches */
    int zero_once;           /* 1: zero_grad before the first step only: gradients add up
                              * across synchronised backwards */
    int double_step;         /* 1: the optimizer steps twice after each backward (the
                              * second with the same gradients, as PyTorch allows) */
    int bad_layout_rank;     /* >= 0: this rank groups units differently */
    int bad_options_rank;    /* >= 0: this rank prefetches where the others do not */
    int seed_by_rank;
    int gpt_layers;          /* the GPT's blocks (0: 2) */
    int ckpt;                /* activation checkpointing: units per segment (0: none) */
    tdm_precision prec;      /* the model's precision (0: fp32) */
    const char *hook;        /* comm hook (fp16, bf16): DDP's, or fsdp's opts.comm_hook */
    tdm_status (*open_dev)(tdm_device **out, int rank);
    /* optional: the communicator FSDP shards over (NCCL), bootstrapped
     * over the shm one, which then carries the host collectives */
    tdm_status (*make_comm)(tdm_comm **out, tdm_comm *boot, tdm_device *dev);
    tdm_fsdp_offload offload;   /* FSDP's opts.offload */
} tf_cfg;

typedef struct tf_shared {
    double loss[TF_MAX_STEPS];
    float grads0[TF_MAX_ELEMS];      /* rank 0: the reduced gradient of step 0 */
    float grads0_r1[TF_MAX_ELEMS];   /* rank world-1's */
    float grads_last[TF_MAX_ELEMS];  /* rank 0: the reduced gradient of the last step */
    float params[TF_MAX_ELEMS];      /* rank 0: the parameters at the end */
    float params_r1[TF_MAX_ELEMS];
    int64_t n_elem;
    int n_units;
    int unended_ag;                  /* rank 0: all-gathers of its last timeline never seen
                                      * to end, after the final parameters were gathered */
    /* rank 0's device allocator: bytes live at the start of the last step
     * (between steps), the most live during the steps' forwards,
     * backwards and optimizer steps (the test's own gathers left out);
     * its shard's elements and the optimizer's state buffers */
    size_t live_between, step_peak;
    /* rank 0's device allocator at its most from the device's opening
     * to the optimizer's (the set-up: model, shards, optimizer) */
    size_t setup_peak;
    /* rank 0 on an emulated device: its asynchronous copies never
     * finished after the run (offload), -1 elsewhere */
    int64_t xfers_left;
    int64_t shard_elems;
    int n_state;
    int status[8];
    char err[8][512];
} tf_shared;

static inline tf_shared *tf_shared_new(void)
{
    void *p = mmap(NULL, sizeof(tf_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) return NULL;
    memset(p, 0, sizeof(tf_shared));
    return p;
}
static inline void tf_shared_free(tf_shared *s) { if (s) munmap(s, sizeof *s); }

static inline void tf_spec(tdm_model_spec *s, const tf_cfg *c)
{
    if (c->model == 2) {
        tdm_model_spec_gpt(s, c->gpt_layers ? c->gpt_layers : 2, 16, 2, TF_GPT_T);
    } else if (c->model == 1) {
        tdm_model_spec_cnn(s);
        s->in_h = s->in_w = 8;
        s->ch1 = 3;
        s->ch2 = 4;
        s->n_classes = 5;
    } else if (c->dims) {
        tdm_model_spec_mlp(s, c->dims, c->ndims);
    } else {
        int d[] = {20, 16, 12, 5};
        tdm_model_spec_mlp(s, d, 4);
    }
}

static inline const tdm_text *tf_text(void)
{
    static uint8_t bytes[3000];
    static tdm_text t = {.bytes = bytes, .n = sizeof bytes};
    static const char *const w[] = {"alpha ", "beta ", "gamma\n", "delta, ", "eps. "};
    if (!bytes[0]) tddp_word_text(bytes, sizeof bytes, w, 5, 4);
    return &t;
}

/* Data for the MLP (20 features) or the CNN (1x8x8); `in` features. */
static inline tdm_status tf_data(tdm_dataset *d, const tf_cfg *c, int64_t n)
{
    if (c->model == 1) return tdm_data_synthetic(d, n, 1, 8, 8, 5, 77, 0);
    int in = c->dims ? c->dims[0] : 20;
    return tdm_data_synthetic(d, n, 1, 1, in, c->dims ? c->dims[c->ndims - 1] : 5, 77, 0);
}

static inline void tf_optim_opts(tdm_optim_opts *o, const tf_cfg *c)
{
    tdm_optim_opts_default(o, c->adamw ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    if (!c->adamw) {
        o->lr = 0.05f;
        o->momentum = 0.9f;
    }
}

/* Global batch s, its slice [lo, hi) for a rank (a micro-batch's share). */
static inline void tf_batch(const tf_cfg *c, const tdm_dataset *data, const int64_t *perm, int s,
                            int lo, int hi, float *x, int32_t *y)
{
    if (c->model == 2)
        tdm_text_windows(tf_text(), TF_GPT_T, 1, s, lo, hi - lo, (int32_t *)x, y);
    else
        tdm_data_gather(data, perm + (int64_t)s * c->batch + lo, hi - lo, x, y);
}

typedef struct tf_run {
    const tf_cfg *cfg;
    const tdm_dataset *data;
    tf_shared *sh;
} tf_run;

/* One rank's run (FSDP or DDP); records into sh; returns 0 on success. */
static inline int tf_rank_main(tdm_comm *comm, void *arg)
{
    tf_run *run = arg;
    const tf_cfg *c = run->cfg;
    tf_shared *sh = run->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_fsdp *f = NULL;
    tdm_ddp *ddp = NULL;
    tdm_comm *dcomm = NULL;
    tdm_model_spec spec;
    int64_t *perm = NULL;
    float *x = NULL, *hbuf = NULL;
    int32_t *y = NULL;
    tdm_dev_mem_stats ms;
    tdm_status st = TDM_STATUS_OK;
    int64_t feat = c->model == 2 ? TF_GPT_T : tdm_data_features(run->data);
    int64_t rows = c->model == 2 ? TF_GPT_T : 1;
    tf_spec(&spec, c);
    if (c->open_dev) TDM_TRY(c->open_dev(&dev, rank));
    else TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    uint64_t seed = 5 + (c->seed_by_rank ? (uint64_t)rank : 0);
    /* offload: built without flat buffers, as the CLI builds it (fsdp
     * draws the units on the host) */
    if (c->offload == TDM_FSDP_OFFLOAD_PARAMS && !c->ddp)
        TDM_TRY(tdm_model_init_released(&m, dev, &spec, seed));
    else
        TDM_TRY(tdm_model_init(&m, dev, &spec, seed));
    TDM_TRY(tdm_model_set_precision(m, c->prec));
    TDM_TRY(tdm_model_set_checkpoint(m, c->ckpt));
    if (c->make_comm) TDM_TRY(c->make_comm(&dcomm, comm, dev));
    int64_t n_elem = tdm_model_param_elems(m);
    tdm_optim_opts oo;
    tf_optim_opts(&oo, c);
    if (c->ddp) {
        tdm_ddp_opts o = {.timeout_ms = 20000};
        TDM_TRY(tdm_ddp_init(&ddp, m, comm, &o));
        if (c->hook) TDM_TRY(tdm_ddp_set_comm_hook(ddp, c->hook, NULL));
        TDM_TRY(tdm_optim_init(&opt, m, &oo));
    } else {
        tdm_fsdp_opts o = {.sharding = c->sharding,
                           .no_prefetch = c->bad_options_rank == rank ? !c->no_prefetch
                                                                      : c->no_prefetch,
                           .no_overlap = c->no_overlap, .timeout_ms = 20000,
                           .min_unit_elems = c->bad_layout_rank == rank ? 1 << 20
                                                                         : c->min_unit_elems,
                           .host_comm = dcomm ? comm : NULL, .offload = c->offload};
        if (c->hook) TDM_TRY(tdm_fsdp_comm_hook_parse(c->hook, &o.comm_hook));
        TDM_TRY(tdm_fsdp_init(&f, m, dcomm ? dcomm : comm, &o));
        TDM_TRY(tdm_fsdp_optim_init(&opt, f, &oo));
        if (rank == 0) {
            sh->n_units = tdm_fsdp_n_units(f);
            sh->shard_elems = tdm_fsdp_shard_elems(f);
        }
    }
    if (rank == 0) sh->n_state = tdm_optim_n_state(opt);
    if (rank == 0 && tdm_dev_mem_query(dev, &ms) == TDM_STATUS_OK) sh->setup_peak = ms.peak_bytes;
    tdm_dev_mem_reset_peak(dev);
    perm = malloc((size_t)(c->model == 2 ? 1 : run->data->n) * sizeof *perm);
    x = malloc((size_t)c->batch * (size_t)feat * sizeof *x + 4);
    y = malloc((size_t)c->batch * (size_t)rows * sizeof *y + 4);
    hbuf = malloc((size_t)n_elem * sizeof *hbuf);
    if (!perm || !x || !y || !hbuf) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "test: malloc");
        goto fail;
    }
    if (c->model != 2) tdm_train_epoch_order(perm, run->data->n, 1, 0);
    int micro = c->micro > 1 ? c->micro : 1;
    for (int s = 0; s < c->steps; s++) {
        if (rank == 0 && s == c->steps - 1 && tdm_dev_mem_query(dev, &ms) == TDM_STATUS_OK)
            sh->live_between = ms.live_bytes;
        if (!c->zero_once || s == 0)
            TDM_TRY(ddp ? tdm_ddp_zero_grad(ddp) : tdm_fsdp_zero_grad(f));
        for (int k = 0; k < micro; k++) {
            int mb0 = (int)((int64_t)k * c->batch / micro);
            int mb = (int)((int64_t)(k + 1) * c->batch / micro) - mb0;
            int lo = mb0 + (int)((int64_t)rank * mb / world);
            int hi = mb0 + (int)((int64_t)(rank + 1) * mb / world);
            tf_batch(c, run->data, perm, s, lo, hi, x, y);
            float scale = 1.0f / (float)c->batch;
            if (ddp) {
                tdm_ddp_no_sync(ddp, k + 1 < micro);
                TDM_TRY(tdm_ddp_forward_scaled(ddp, x, y, hi - lo, scale, NULL));
                TDM_TRY(tdm_ddp_backward(ddp));
            } else {
                tdm_fsdp_no_sync(f, k + 1 < micro);
                TDM_TRY(tdm_fsdp_forward_scaled(f, x, y, hi - lo, scale, NULL));
                TDM_TRY(tdm_fsdp_backward(f));
            }
        }
        double ls = ddp ? tdm_ddp_loss_sum(ddp) : tdm_fsdp_loss_sum(f);
        if (rank == 0 && s < TF_MAX_STEPS) sh->loss[s] = ls / c->batch;
        if ((s == 0 || s == c->steps - 1) && n_elem <= TF_MAX_ELEMS) {
            if (rank == 0 && tdm_dev_mem_query(dev, &ms) == TDM_STATUS_OK &&
                ms.peak_bytes > sh->step_peak)
                sh->step_peak = ms.peak_bytes;
            float *dst = rank == 0 ? sh->grads0 : rank == world - 1 ? sh->grads0_r1 : NULL;
            if (s > 0) dst = rank == 0 ? sh->grads_last : NULL;
            if (ddp) {
                if (dst)
                    TDM_TRY(tdm_dev_copy_to_host(dev, dst, tdm_model_grads(m),
                                                   (size_t)n_elem * 4));
            } else {
                TDM_TRY(tdm_fsdp_gather_grads(f, hbuf, -1));
                if (dst) memcpy(dst, hbuf, (size_t)n_elem * 4);
            }
            tdm_dev_mem_reset_peak(dev);   /* the test's gather is not the step's */
        }
        TDM_TRY(ddp ? tdm_ddp_step(ddp, opt) : tdm_fsdp_step(f, opt));
        if (c->double_step) TDM_TRY(ddp ? tdm_ddp_step(ddp, opt) : tdm_fsdp_step(f, opt));
    }
    if (rank == 0 && tdm_dev_mem_query(dev, &ms) == TDM_STATUS_OK && ms.peak_bytes > sh->step_peak)
        sh->step_peak = ms.peak_bytes;
    if (n_elem <= TF_MAX_ELEMS) {
        sh->n_elem = n_elem;
        float *dst = rank == 0 ? sh->params : rank == world - 1 ? sh->params_r1 : NULL;
        if (ddp) {
            if (dst) TDM_TRY(tdm_dev_copy_to_host(dev, dst, tdm_model_params(m), (size_t)n_elem * 4));
        } else {
            TDM_TRY(tdm_fsdp_gather_params(f, hbuf, -1));
            if (dst) memcpy(dst, hbuf, (size_t)n_elem * 4);
        }
    }
    if (rank == 0) sh->xfers_left = tdm_cuda_emulator_xfers ? tdm_cuda_emulator_xfers(dev) : -1;
    if (f && rank == 0) {
        /* every gather has been waited for by now (gather_params settles
         * the ones a step launched): each one's event has an end */
        tdm_fsdp_times t;
        tdm_fsdp_get_times(f, &t);
        for (int i = 0; i < t.n_events; i++)
            if (t.events[i].kind == 0 && t.events[i].end_ms < 0) sh->unended_ag++;
    }
fail:
    if (rank < 8) {
        sh->status[rank] = st;
        snprintf(sh->err[rank], sizeof sh->err[rank], "%s", st ? tdm_error_message() : "");
    }
    if (st) fprintf(stderr, "rank %d: %s\n", rank, tdm_error_message());
    free(perm);
    free(x);
    free(y);
    free(hbuf);
    tdm_ddp_free(ddp);
    tdm_fsdp_free(f);
    tdm_comm_free(dcomm);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

static inline tdm_status tf_spawn(int world, const tf_cfg *cfg, const tdm_dataset *data,
                                  tf_shared *sh, int64_t timeout_ms)
{
    tf_run run = {.cfg = cfg, .data = data, .sh = sh};
    tdm_dist_spawn_opts o = {.timeout_ms = timeout_ms, .comm_timeout_ms = 20000};
    return tdm_dist_spawn(world, tf_rank_main, &run, &o, NULL);
}

/* One device: losses, gradient after step 0, final parameters. */
static inline tdm_status tf_reference(const tf_cfg *c, const tdm_dataset *data, double *loss,
                                      float *grads0, float *params, int64_t *n_elem)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    tdm_single single = {0};
    int64_t feat = c->model == 2 ? TF_GPT_T : tdm_data_features(data);
    int64_t rows = c->model == 2 ? TF_GPT_T : 1;
    int64_t *perm = malloc((size_t)(c->model == 2 ? 1 : data->n) * sizeof *perm);
    float *x = malloc((size_t)c->batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)c->batch * (size_t)rows * sizeof *y);
    tf_spec(&spec, c);
    tdm_optim_opts oo;
    tf_optim_opts(&oo, c);
    TDM_TRY(tdm_device_open(&dev, "cpu", 0, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    TDM_TRY(tdm_optim_init(&opt, m, &oo));
    single.model = m;
    single.opt = opt;
    if (c->model != 2) tdm_train_epoch_order(perm, data->n, 1, 0);
    for (int s = 0; s < c->steps; s++) {
        tf_batch(c, data, perm, s, 0, c->batch, x, y);
        TDM_TRY(tdm_single_step(&single, x, y, c->batch, &loss[s]));
        if (s == 0 && grads0)
            memcpy(grads0, tdm_model_grads(m), (size_t)tdm_model_param_elems(m) * 4);
    }
    *n_elem = tdm_model_param_elems(m);
    if (params) memcpy(params, tdm_model_params(m), (size_t)*n_elem * 4);
fail:
    free(perm);
    free(x);
    free(y);
    tdm_single_free(&single);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}

/* Largest |a-b| - (atol + rtol|b|) over n; <= 0 means all within. */
static inline double tf_excess(const float *a, const float *b, int64_t n, double atol,
                               double rtol, int64_t *where)
{
    double worst = -1e30;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]) - (atol + rtol * fabs((double)b[i]));
        if (e > worst) {
            worst = e;
            if (where) *where = i;
        }
    }
    return worst;
}

static inline tf_cfg tf_cfg_default(void)
{
    return (tf_cfg){.batch = 24, .steps = 1, .bad_layout_rank = -1, .bad_options_rank = -1};
}

#endif
