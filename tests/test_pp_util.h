/* tests/test_pp_util.h: shared helpers of the pipeline tests (header only,
 * static functions): small models (an MLP, a CNN, a GPT), their
 * deterministic batches, the one-device reference with gradient
 * accumulation over the same micro-batches (models/accum.h), a result area
 * shared with forked ranks, and a rank that trains through tdm_pp and
 * compares its slice with the reference. Used by tests/test_pp*.c. */
#ifndef TDM_TESTS_TEST_PP_UTIL_H
#define TDM_TESTS_TEST_PP_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/device.h"
#include "core/rng.h"
#include "models/accum.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/stage.h"
#include "models/train.h"
#include "pp/pp.h"

#define TPP_MAX_RANKS 8
#define TPP_MAX_ELEMS (1 << 17)
#define TPP_MAX_STEPS 32
#define TPP_MAX_M 8

typedef enum tpp_kind { TPP_MLP = 0, TPP_CNN, TPP_GPT } tpp_kind;

static inline const char *tpp_kind_name(tpp_kind k)
{
    return k == TPP_MLP ? "mlp" : k == TPP_CNN ? "cnn" : "gpt";
}

static inline void tpp_spec(tpp_kind k, tdm_model_spec *s)
{
    if (k == TPP_MLP) {
        tdm_model_spec_mlp(s, (int[]){20, 24, 16, 12, 5}, 5);
    } else if (k == TPP_CNN) {
        tdm_model_spec_cnn(s);
        s->in_c = 1;
        s->in_h = s->in_w = 8;
        s->ch1 = 4;
        s->ch2 = 6;
        s->fc_hidden = 12;
        s->n_classes = 5;
    } else {
        tdm_model_spec_gpt(s, 2, 16, 2, 8);
    }
}

/* 4-byte input elements and target rows per sample of the whole model. */
static inline int tpp_in_features(const tdm_model_spec *s)
{
    if (s->kind == TDM_MODEL_GPT) return s->n_ctx;
    return s->kind == TDM_MODEL_MLP ? s->dims[0] : s->in_c * s->in_h * s->in_w;
}
static inline int tpp_out_rows(const tdm_model_spec *s)
{
    return s->kind == TDM_MODEL_GPT ? s->n_ctx : 1;
}
static inline int tpp_classes(const tdm_model_spec *s)
{
    return s->kind == TDM_MODEL_GPT ? s->vocab
           : s->kind == TDM_MODEL_MLP ? s->dims[s->ndims - 1] : s->n_classes;
}

static inline tdm_optim_opts tpp_optim(tpp_kind k)
{
    tdm_optim_opts o;
    if (k == TPP_GPT) {
        tdm_optim_opts_default(&o, TDM_OPTIM_ADAMW);
        o.lr = 3e-3f;
    } else {
        tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
        o.lr = 0.05f;
        o.momentum = 0.9f;
        o.weight_decay = 1e-4f;
    }
    return o;
}

/* Step `step`'s global batch of B samples: normal features (or tokens),
 * targets in range. */
static inline void tpp_batch(const tdm_model_spec *s, int in, int rows, int classes, int step,
                             int B, void *x, int32_t *y)
{
    tdm_rng r;
    tdm_rng_init(&r, 1000 + (uint64_t)step, 3);
    for (int i = 0; i < B * in; i++) {
        if (s->kind == TDM_MODEL_GPT) ((int32_t *)x)[i] = (int32_t)(tdm_rng_u64(&r) % 256);
        else ((float *)x)[i] = tdm_rng_normal(&r);
    }
    for (int i = 0; i < B * rows; i++) y[i] = (int32_t)(tdm_rng_u64(&r) % (uint64_t)classes);
}

#define TPP_SEED 9

/* One device, gradient accumulation over ceil(B / M)-sample micro-batches:
 * losses of every step, parameters after step 1 and after `steps`. */
static inline tdm_status tpp_reference_opt(tpp_kind k, int M, int B, int steps,
                                           tdm_optim_opts oo, double *loss, float *p1, float *pn,
                                           int64_t *n_elem)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_model_spec spec;
    tpp_spec(k, &spec);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    void *x = NULL;
    int32_t *y = NULL;
    TDM_TRY(tdm_device_open(&dev, "cpu", 0, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, TPP_SEED));
    TDM_TRY(tdm_optim_init(&opt, m, &oo));
    int in = tdm_model_in_features(m), rows = tdm_model_out_rows(m);
    int classes = tdm_model_n_classes(m);
    x = malloc((size_t)B * (size_t)in * 4);
    y = malloc((size_t)B * (size_t)rows * sizeof *y);
    if (!x || !y) { st = TDM_STATUS_OUT_OF_MEMORY; goto fail; }
    tdm_single single = {.model = m, .opt = opt};
    tdm_accum a = {.ops = &tdm_accum_single_ops, .ctx = &single, .micro = (B + M - 1) / M,
                   .in_features = in, .out_rows = rows};
    for (int s = 0; s < steps; s++) {
        tpp_batch(&spec, in, rows, classes, s, B, x, y);
        TDM_TRY(tdm_accum_step(&a, x, y, B, &loss[s]));
        if (s == 0 && p1) memcpy(p1, tdm_model_params(m), (size_t)tdm_model_param_elems(m) * 4);
    }
    *n_elem = tdm_model_param_elems(m);
    if (pn) memcpy(pn, tdm_model_params(m), (size_t)*n_elem * 4);
    tdm_single_free(&single);
fail:
    free(x);
    free(y);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}

static inline tdm_status tpp_reference(tpp_kind k, int M, int B, int steps, double *loss,
                                       float *p1, float *pn, int64_t *n_elem)
{
    return tpp_reference_opt(k, M, B, steps, tpp_optim(k), loss, p1, pn, n_elem);
}

/* What ranks report, in a MAP_SHARED area. */
typedef struct tpp_out {
    int status[TPP_MAX_RANKS];
    char err[TPP_MAX_RANKS][640];
    double max_diff[TPP_MAX_RANKS];    /* parameters vs the reference (GPT) */
    double loss_diff[TPP_MAX_RANKS];
    tdm_pp_stats stats[TPP_MAX_RANKS];
    float params[TPP_MAX_ELEMS];       /* a gathered whole model */
    double loss[TPP_MAX_STEPS];
} tpp_out;

static inline tpp_out *tpp_out_new(void)
{
    tpp_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (o == MAP_FAILED) return NULL;
    memset(o, 0, sizeof *o);
    return o;
}

static inline void tpp_out_free(tpp_out *o) { if (o) munmap(o, sizeof *o); }

/* Largest |a - b| over n floats. */
static inline double tpp_max_diff(const float *a, const float *b, int64_t n)
{
    double w = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > w || d != d) w = d != d ? INFINITY : d;
    }
    return w;
}

#endif
