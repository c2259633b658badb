/* tests/lever_util.h: what the tests of the memory levers share
 * (test_recompute.c, test_precision.c, test_plan.c, test_offload.c):
 * small MLP, CNN and GPT specs, deterministic batches, a training run of
 * a few single-device steps with a chosen precision, checkpointing,
 * clipping and loss scaling, and its results copied to the host. Static
 * functions only. */
#ifndef TDM_TESTS_LEVER_UTIL_H
#define TDM_TESTS_LEVER_UTIL_H

#include "core/data.h"
#include "models/gpt.h"
#include "models/optim.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "models/train.h"
#include "tests/test_util.h"

typedef enum lv_model { LV_MLP = 0, LV_CNN, LV_GPT, LV_N_MODELS } lv_model;
static const char *const lv_names[LV_N_MODELS] = {"mlp", "cnn", "gpt"};

/* MLP 24-32-32-32-32-10 (5 units); a CNN over 3x8x8 images (to_cnhw, two
 * conv blocks of 4 and 6 channels, fc 16, 5 classes); gpt:3-32-4-16. */
static inline void lv_spec(lv_model k, tdm_model_spec *s)
{
    if (k == LV_MLP) {
        static const int dims[] = {24, 32, 32, 32, 32, 10};
        tdm_model_spec_mlp(s, dims, 6);
    } else if (k == LV_CNN) {
        tdm_model_spec_cnn(s);
        s->in_c = 3;
        s->in_h = s->in_w = 8;
        s->ch1 = 4;
        s->ch2 = 6;
        s->fc_hidden = 16;
        s->n_classes = 5;
    } else {
        tdm_model_spec_gpt(s, 3, 32, 4, 16);
    }
}

static inline int lv_batch(lv_model k) { return k == LV_GPT ? 4 : 16; }

/* Batch s of a run: inputs and targets, the same on every call. */
static inline void lv_data(lv_model k, const tdm_model_spec *spec, int s, float *x, int32_t *y)
{
    int B = lv_batch(k);
    tdm_rng r = tu_rng(1000 + (uint64_t)s);
    if (k == LV_GPT) {
        int32_t *t = (int32_t *)x;
        /* a learnable text: each byte the previous plus a small step */
        for (int b = 0; b < B; b++) {
            int32_t v = (int32_t)(tdm_rng_u32(&r) & 255);
            for (int i = 0; i < spec->n_ctx; i++) {
                t[b * spec->n_ctx + i] = v;
                v = (v + 1 + (int32_t)(tdm_rng_u32(&r) % 3)) & 255;
                y[b * spec->n_ctx + i] = v;
            }
        }
        return;
    }
    int c, h, w, classes;
    tdm_model_spec_sample_shape(spec, &c, &h, &w, &classes);
    int feat = c * h * w;
    for (int b = 0; b < B; b++) {
        int32_t label = (int32_t)(tdm_rng_u32(&r) % (uint32_t)classes);
        y[b] = label;
        for (int i = 0; i < feat; i++)
            x[b * feat + i] = tu_unif(&r, -1.0f, 1.0f) + (i % classes == label ? 1.5f : 0.0f);
    }
}

typedef struct lv_cfg {
    tdm_precision prec;
    int ckpt;
    int steps;
    double clip;                 /* > 0: clip the gradient norm */
    int scaler;                  /* fp16's loss scaling */
    const char *device;          /* "cpu" (default) or "cuda" (the emulator) */
} lv_cfg;

typedef struct lv_result {
    float *params, *grads, *buffers;
    int64_t n_params, n_buffers;
    double loss[64];             /* per step */
    double norm[64];
    size_t act_peak;             /* allocator peak during the steps minus what was live before */
    size_t peak, base;           /* allocator: peak during the steps; live after building */
    tdm_model_memory mem;
} lv_result;

static inline void lv_free(lv_result *r)
{
    free(r->params);
    free(r->grads);
    free(r->buffers);
}

static inline tdm_device *lv_open(const char *device)
{
    tdm_device *d = NULL;
    if (!device || !strcmp(device, "cpu")) return tu_host();
    setenv("TANDEM_CUDA_EMULATOR", "1", 1);
    TU_OK(tdm_device_open(&d, "cuda", 0, 1));
    return d;
}

/* cfg->steps single-device steps of model k (seed 7): AdamW for the GPT,
 * SGD with momentum for the others. */
static inline void lv_train(lv_model k, const lv_cfg *cfg, lv_result *out)
{
    memset(out, 0, sizeof *out);
    tdm_model_spec spec;
    lv_spec(k, &spec);
    tdm_device *d = lv_open(cfg->device);
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    TU_OK(tdm_model_init(&m, d, &spec, 7));
    TU_OK(tdm_model_set_precision(m, cfg->prec));
    TU_OK(tdm_model_set_checkpoint(m, cfg->ckpt));
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, k == LV_GPT ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    if (k != LV_GPT) {
        o.lr = 0.05f;
        o.momentum = 0.9f;
    } else {
        o.lr = 3e-3f;
    }
    TU_OK(tdm_optim_init(&opt, m, &o));
    tdm_grad_scaler sc;
    tdm_single s = {.model = m, .opt = opt, .clip_norm = cfg->clip, .measure_norm = 1};
    if (cfg->scaler) {
        TU_OK(tdm_grad_scaler_init(&sc, NULL));
        s.scaler = &sc;
    }
    int B = lv_batch(k), feat = tdm_model_in_features(m), rows = tdm_model_out_rows(m);
    float *x = tu_malloc((size_t)B * feat * 4);
    int32_t *y = tu_malloc((size_t)B * rows * 4);
    tdm_dev_mem_stats ms;
    cr_assert_eq(tdm_dev_mem_query(d, &ms), TDM_STATUS_OK);
    out->base = ms.live_bytes;
    tdm_dev_mem_reset_peak(d);
    for (int i = 0; i < cfg->steps && i < 64; i++) {
        lv_data(k, &spec, i, x, y);
        TU_OK(tdm_single_step(&s, x, y, B, &out->loss[i]));
        out->norm[i] = s.last_norm;
    }
    cr_assert_eq(tdm_dev_mem_query(d, &ms), TDM_STATUS_OK);
    out->peak = ms.peak_bytes;
    tdm_model_get_memory(m, &out->mem);
    /* what the steps added on top of the model, optimizer and levers */
    out->n_params = tdm_model_param_elems(m);
    out->n_buffers = tdm_model_buffer_elems(m);
    out->params = tu_malloc((size_t)out->n_params * 4);
    out->grads = tu_malloc((size_t)out->n_params * 4);
    out->buffers = tu_malloc((size_t)(out->n_buffers + 1) * 4);
    TU_OK(tdm_dev_copy_to_host(d, out->params, tdm_model_params(m), (size_t)out->n_params * 4));
    TU_OK(tdm_dev_copy_to_host(d, out->grads, tdm_model_grads(m), (size_t)out->n_params * 4));
    if (out->n_buffers)
        TU_OK(tdm_dev_copy_to_host(d, out->buffers, tdm_model_buffers(m),
                                   (size_t)out->n_buffers * 4));
    out->act_peak = out->peak - out->base;
    free(x);
    free(y);
    tdm_single_free(&s);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(d);
}

#endif
