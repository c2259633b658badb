/* tests/test_ddp_util.h: shared helpers of the DDP tests: a result area
 * shared with forked ranks (an anonymous MAP_SHARED mapping: no /dev/shm
 * name), small models and data (an MLP, a CNN, or a GPT on text windows),
 * a DDP training run per rank, and the single-device reference.
 * Header-only (static) so that each test binary stays one file. */
#ifndef TDM_TESTS_TEST_DDP_UTIL_H
#define TDM_TESTS_TEST_DDP_UTIL_H

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
#include "ddp/spawn.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

#define TDDP_MAX_ELEMS (1 << 16)
#define TDDP_MAX_STEPS 64
#define TDDP_MAX_BUCKETS 16

typedef struct tddp_cfg {
    int cnn;
    const int *dims;         /* MLP widths (NULL: 20-16-12-5) */
    int ndims;
    int gpt;                 /* a small GPT on text windows (tddp_text) instead */
    int batch;               /* global batch */
    int steps;
    int no_overlap;
    size_t cap_bytes;        /* 0: default caps */
    size_t first_bytes;
    int cap_rank;            /* >= 0: this rank uses rank_cap_bytes instead */
    size_t rank_cap_bytes;
    int no_arena;            /* 1: no zero-copy arena: gradients are copied through the slots */
    int micro;               /* > 1: no_sync over this many micro-batches, then sync */
    int detach_layer;        /* > 0: in step 0, backward stops at this layer (the layers
                                below take no part: their grad-ready hook never fires)... */
    unsigned detach_ranks;   /* ...on these ranks (bit mask)... */
    int detach_micro;        /* ...in this micro-batch (-1: in every one) */
    int find_unused;
    int skip_backward_rank;  /* >= 0: this rank skips the backward of step 1 */
    int bad_layout_rank;     /* >= 0: this rank builds a different model */
    int seed_by_rank;        /* rank r initialises with seed 5 + r (DDP broadcasts rank 0's) */
    /* Optional: rank's device (NULL: cpu:<rank>), e.g. a CUDA emulator or
     * a GPU; and a gradient communicator built over the shm one (NULL: the
     * shm one), e.g. NCCL; the shm one is then DDP's host_comm. */
    tdm_status (*open_dev)(tdm_device **out, int rank);
    tdm_status (*make_comm)(tdm_comm **out, tdm_comm *boot, tdm_device *dev);
} tddp_cfg;

typedef struct tddp_shared {
    double loss[TDDP_MAX_STEPS];
    float grads0[TDDP_MAX_ELEMS];      /* rank 0's reduced gradients after step 0 */
    float grads0_r1[TDDP_MAX_ELEMS];   /* rank world-1's */
    float params[TDDP_MAX_ELEMS];      /* rank 0's parameters at the end */
    float params_r1[TDDP_MAX_ELEMS];   /* rank world-1's */
    int64_t n_elem;
    int n_buckets;             /* rank 0's plan at the end */
    int plan[TDDP_MAX_BUCKETS][2];     /* its buckets' first and last parameters */
    int plan_r1[TDDP_MAX_BUCKETS][2];  /* rank world-1's */
    int64_t plan_elems[TDDP_MAX_BUCKETS]; /* rank 0's buckets' lengths */
    int nb_step[TDDP_MAX_STEPS];       /* rank 0: buckets reduced by step s's backward */
    double overlapped[TDDP_MAX_STEPS]; /* rank 0: overlapped bytes after step s (cumulative) */
    double reduced[TDDP_MAX_STEPS];    /* rank 0: reduced bytes after step s (cumulative) */
    int zero_copy;
    int64_t timed_steps;       /* rank 0's tdm_ddp_times.steps */
    int launch_order_ok;       /* rank 0: buckets launched in bucket order, after ready */
    int status[8];
    char err[8][512];
} tddp_shared;

static inline tddp_shared *tddp_shared_new(void)
{
    void *p = mmap(NULL, sizeof(tddp_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) return NULL;
    memset(p, 0, sizeof(tddp_shared));
    return p;
}
static inline void tddp_shared_free(tddp_shared *s) { if (s) munmap(s, sizeof *s); }

static inline void tddp_spec_dims(tdm_model_spec *s, int cnn, const int *dims, int ndims)
{
    if (!cnn && dims) {
        tdm_model_spec_mlp(s, dims, ndims);
        return;
    }
    if (cnn) {
        tdm_model_spec_cnn(s);
        s->in_c = 1; s->in_h = 8; s->in_w = 8;
        s->ch1 = 3; s->ch2 = 4; s->n_classes = 5;
    } else {
        int d[] = {20, 16, 12, 5};
        tdm_model_spec_mlp(s, d, 4);
    }
}

static inline void tddp_spec(tdm_model_spec *s, int cnn) { tddp_spec_dims(s, cnn, NULL, 0); }

/* The GPT's model and text: step s's global batch is windows 0..batch-1 of
 * tdm_text_windows(step s), a rank's share its slice of them. */
#define TDDP_GPT_T 12
static inline void tddp_spec_gpt(tdm_model_spec *s) { tdm_model_spec_gpt(s, 2, 16, 2, TDDP_GPT_T); }

static inline const tdm_text *tddp_text(void)
{
    static uint8_t bytes[4000];
    static tdm_text t = {.bytes = bytes, .n = sizeof bytes};
    static const char *const w[] = {"one ", "two ", "three ", "four\n", "five, ", "six. "};
    if (!bytes[0]) {
        tdm_rng r;
        tdm_rng_init(&r, 3, TDM_RNG_STREAM_TEST);
        size_t n = 0;
        while (n < sizeof bytes) {
            const char *p = w[tdm_rng_below(&r, 6)];
            while (*p && n < sizeof bytes) bytes[n++] = (uint8_t)*p++;
        }
    }
    return &t;
}

static inline tdm_status tddp_data(tdm_dataset *d, int cnn, int64_t n)
{
    return cnn ? tdm_data_synthetic(d, n, 1, 8, 8, 5, 77, 0)
               : tdm_data_synthetic(d, n, 1, 4, 5, 5, 77, 0);
}

typedef struct tddp_run {
    const tddp_cfg *cfg;
    const tdm_dataset *data;
    tddp_shared *sh;
} tddp_run;

/* One rank's training run; records into sh; returns 0 on success. */
static inline int tddp_rank_main(tdm_comm *comm, void *arg)
{
    tddp_run *run = arg;
    const tddp_cfg *c = run->cfg;
    tddp_shared *sh = run->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_comm *gcomm = NULL;   /* cfg->make_comm's, owned */
    tdm_model_spec spec;
    int64_t *perm = NULL;
    float *x = NULL;
    int32_t *y = NULL;
    tdm_status st = TDM_STATUS_OK;
    int64_t feat = c->gpt ? TDDP_GPT_T : tdm_data_features(run->data);
    int64_t rows = c->gpt ? TDDP_GPT_T : 1;   /* targets per sample */
    if (c->gpt) tddp_spec_gpt(&spec);
    else tddp_spec_dims(&spec, c->cnn, c->dims, c->ndims);
    if (c->bad_layout_rank == rank) spec.dims[2] = 13;
    if (c->open_dev) TDM_TRY(c->open_dev(&dev, rank));
    else TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5 + (c->seed_by_rank ? (uint64_t)rank : 0)));
    if (c->make_comm) TDM_TRY(c->make_comm(&gcomm, comm, dev));
    tdm_ddp_opts o = {.no_overlap = c->no_overlap,
                      .bucket_cap_bytes = c->cap_rank == rank ? c->rank_cap_bytes : c->cap_bytes,
                      .first_bucket_bytes = c->first_bytes,
                      .find_unused_parameters = c->find_unused, .timeout_ms = 20000,
                      .host_comm = gcomm ? comm : NULL};
    TDM_TRY(tdm_ddp_init(&ddp, m, gcomm ? gcomm : comm, &o));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    sh->zero_copy = tdm_ddp_zero_copy(ddp);
    perm = malloc((size_t)(c->gpt ? 1 : run->data->n) * sizeof *perm);
    x = malloc((size_t)c->batch * (size_t)feat * sizeof *x);
    y = malloc((size_t)c->batch * (size_t)rows * sizeof *y);
    if (!perm || !x || !y) { st = TDM_STATUS_OUT_OF_MEMORY; goto fail; }
    if (!c->gpt) tdm_train_epoch_order(perm, run->data->n, 1, 0);
    int micro = c->micro > 1 ? c->micro : 1;
    for (int s = 0; s < c->steps; s++) {
        /* global batch s, split in `micro` micro-batches, each split by rank */
        const int64_t *gidx = c->gpt ? perm : perm + (int64_t)s * c->batch;
        double loss_sum = 0.0;
        TDM_TRY(tdm_ddp_zero_grad(ddp));
        for (int k = 0; k < micro; k++) {
            int mb0 = (int)((int64_t)k * c->batch / micro), mb1 = (int)((int64_t)(k + 1) * c->batch / micro);
            int mb = mb1 - mb0;
            int64_t lo64, hi64;
            tdm_ddp_share(mb, rank, world, &lo64, &hi64);
            int lo = (int)lo64, hi = (int)hi64;
            if (c->gpt)
                tdm_text_windows(tddp_text(), TDDP_GPT_T, 1, s, mb0 + lo, hi - lo, (int32_t *)x, y);
            else
                tdm_data_gather(run->data, gidx + mb0 + lo, hi - lo, x, y);
            double ls = 0.0;
            tdm_ddp_no_sync(ddp, k + 1 < micro);
            TDM_TRY(tdm_ddp_forward_scaled(ddp, x, y, hi - lo, 1.0f / (float)c->batch, &ls));
            loss_sum += ls;
            int detach = c->detach_layer > 0 && ((c->detach_ranks >> rank) & 1) && s == 0 &&
                         (c->detach_micro < 0 || c->detach_micro == k);
            TDM_TRY(tdm_model_set_backward_stop(m, detach ? c->detach_layer : 0));
            if (c->skip_backward_rank == rank && s == 1) continue;
            TDM_TRY(tdm_ddp_backward(ddp));
        }
        (void)loss_sum;
        loss_sum = tdm_ddp_loss_sum(ddp);   /* all ranks' losses, with the gradients */
        if (rank == 0) sh->loss[s] = loss_sum / c->batch;
        if (s == 0 && tdm_model_param_elems(m) <= TDDP_MAX_ELEMS) {
            float *dst = rank == 0 ? sh->grads0 : rank == world - 1 ? sh->grads0_r1 : NULL;
            if (dst)
                TDM_TRY(tdm_dev_copy_to_host(dev, dst, tdm_model_grads(m),
                                             (size_t)tdm_model_param_elems(m) * 4));
        }
        TDM_TRY(tdm_ddp_step(ddp, opt));
        if (rank == 0 && s < TDDP_MAX_STEPS) {
            tdm_ddp_times t;
            tdm_ddp_get_times(ddp, &t);
            sh->nb_step[s] = t.n_buckets;
            sh->overlapped[s] = t.overlapped_bytes_total;
            sh->reduced[s] = t.reduced_bytes_total;
        }
    }
    if (rank == 0 || rank == world - 1) {
        int (*plan)[2] = rank == 0 ? sh->plan : sh->plan_r1;
        int nb = tdm_ddp_n_buckets(ddp);
        if (rank == 0) sh->n_buckets = nb;
        for (int b = 0; b < nb && b < TDDP_MAX_BUCKETS; b++)
            tdm_ddp_bucket_info(ddp, b, &plan[b][0], &plan[b][1], NULL,
                                rank == 0 ? &sh->plan_elems[b] : NULL);
    }
    if (rank == 0) {
        tdm_ddp_times t;
        tdm_ddp_get_times(ddp, &t);
        sh->timed_steps = t.steps;
        sh->launch_order_ok = t.n_buckets == tdm_ddp_n_buckets(ddp);
        for (int i = 0; i < t.n_buckets; i++) {
            const tdm_ddp_bucket_times *b = &t.buckets[i];
            if (b->start_ms < b->ready_ms || b->end_ms < b->start_ms) sh->launch_order_ok = 0;
            if (i > 0 && b->start_ms < t.buckets[i - 1].start_ms) sh->launch_order_ok = 0;
        }
    }
    if (tdm_model_param_elems(m) <= TDDP_MAX_ELEMS) {
        sh->n_elem = tdm_model_param_elems(m);
        float *dst = rank == 0 ? sh->params : rank == world - 1 ? sh->params_r1 : NULL;
        if (dst)
            TDM_TRY(tdm_dev_copy_to_host(dev, dst, tdm_model_params(m), (size_t)sh->n_elem * 4));
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
    tdm_ddp_free(ddp);
    tdm_comm_free(gcomm);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

static inline tdm_status tddp_spawn(int world, const tddp_cfg *cfg, const tdm_dataset *data,
                             tddp_shared *sh, int64_t timeout_ms)
{
    tddp_run run = {.cfg = cfg, .data = data, .sh = sh};
    tdm_ddp_spawn_opts o = {.timeout_ms = timeout_ms, .arena_bytes = cfg->no_arena ? 0 : 1 << 20,
                            .comm_timeout_ms = 20000};
    return tdm_ddp_spawn(world, tddp_rank_main, &run, &o, NULL);
}

/* Single-device reference: losses, gradients after step 0, final params. */
static inline tdm_status tddp_reference(const tddp_cfg *c, const tdm_dataset *data, double *loss,
                                 float *grads0, float *params, int64_t *n_elem)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    tdm_single single = {0};
    int64_t feat = c->gpt ? TDDP_GPT_T : tdm_data_features(data);
    int64_t rows = c->gpt ? TDDP_GPT_T : 1;
    int64_t *perm = malloc((size_t)(c->gpt ? 1 : data->n) * sizeof *perm);
    float *x = malloc((size_t)c->batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)c->batch * (size_t)rows * sizeof *y);
    if (c->gpt) tddp_spec_gpt(&spec);
    else tddp_spec_dims(&spec, c->cnn, c->dims, c->ndims);
    TDM_TRY(tdm_device_open(&dev, "cpu", 0, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    single.model = m;
    single.opt = opt;
    if (!c->gpt) tdm_train_epoch_order(perm, data->n, 1, 0);
    for (int s = 0; s < c->steps; s++) {
        if (c->gpt)
            tdm_text_windows(tddp_text(), TDDP_GPT_T, 1, s, 0, c->batch, (int32_t *)x, y);
        else
            tdm_data_gather(data, perm + (int64_t)s * c->batch, c->batch, x, y);
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
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}

/* Largest |a-b| - (atol + rtol|b|) over n; <= 0 means all within. */
static inline double tddp_excess(const float *a, const float *b, int64_t n, double atol, double rtol,
                          int64_t *where)
{
    double worst = -1e30;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]) - (atol + rtol * fabs((double)b[i]));
        if (e > worst) { worst = e; if (where) *where = i; }
    }
    return worst;
}

static inline tddp_cfg tddp_cfg_default(void)
{
    return (tddp_cfg){.batch = 24, .steps = 1, .detach_micro = -1, .skip_backward_rank = -1,
                      .bad_layout_rank = -1, .cap_rank = -1};
}

/* Tolerances |a-b| <= atol + rtol |ref| of an equivalence check. */
typedef struct tddp_tol {
    double loss_atol, loss_rtol, grad_atol, grad_rtol, param_atol, param_rtol;
} tddp_tol;

/* DDP over `world` ranks against one device on the same batches (cfg's
 * steps): the loss of every step, rank 0's gradients after the last
 * backward and its final parameters within tol, and every rank holding
 * bitwise the same gradients and parameters. */
static inline void tddp_check_equiv(const tddp_cfg *c, const tdm_dataset *data, int world,
                                    int64_t timeout_ms, tddp_tol tol)
{
    tddp_shared *sh = tddp_shared_new();
    cr_assert(sh);
    double ref_loss[TDDP_MAX_STEPS];
    static float ref_g[TDDP_MAX_ELEMS], ref_p[TDDP_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tddp_reference(c, data, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    tdm_status st = tddp_spawn(world, c, data, sh, timeout_ms);
    cr_assert_eq(st, TDM_STATUS_OK, "world %d batch %d: %s / rank 0: %s / rank 1: %s", world,
                 c->batch, tdm_error_message(), sh->err[0], sh->err[1]);
    cr_assert_eq(sh->n_elem, n);
    for (int s = 0; s < c->steps; s++)
        cr_assert(fabs(sh->loss[s] - ref_loss[s]) <= tol.loss_atol + tol.loss_rtol * fabs(ref_loss[s]),
                  "world %d batch %d step %d: loss %.8f vs one device %.8f", world, c->batch, s,
                  sh->loss[s], ref_loss[s]);
    int64_t at = 0;
    cr_assert(tddp_excess(sh->grads0, ref_g, n, tol.grad_atol, tol.grad_rtol, &at) <= 0,
              "world %d batch %d: grad[%lld] %g vs %g", world, c->batch, (long long)at,
              sh->grads0[at], ref_g[at]);
    cr_assert(tddp_excess(sh->params, ref_p, n, tol.param_atol, tol.param_rtol, &at) <= 0,
              "world %d batch %d: param[%lld] %g vs %g", world, c->batch, (long long)at,
              sh->params[at], ref_p[at]);
    /* every rank holds bitwise the same gradients and parameters */
    cr_assert(world == 1 || !memcmp(sh->grads0, sh->grads0_r1, (size_t)n * 4));
    cr_assert(world == 1 || !memcmp(sh->params, sh->params_r1, (size_t)n * 4));
    tddp_shared_free(sh);
}

#endif
