/* models/model.c: the model as callers see it: the layer graph of the
 * MLP and CNN, the flat parameter, gradient and buffer storage,
 * activations, and forward and backward walking the layers in order
 * (each layer's own math is models/layers.c). Specs are models/spec.c;
 * what the parallel designs install on a model (hooks, views, borrowed
 * storage) is models/model_hooks.c; the softmax cross-entropy lives in
 * models/loss.c; the GPT in models/gpt.c (through tdm_model_vt); stages
 * (a run of the layers) and activation sets models/stage.c; accessors
 * and memory accounting models/model_info.c. Not
 * here: optimizers (models/optim.c), checkpoints (models/checkpoint.c),
 * any parallelism. */
#include "models/model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/rng.h"
#include "models/recompute.h"

/* ---- building ---- */

static int64_t tdm_align_up(int64_t n)
{
    return (n + TDM_MODEL_ALIGN_ELEMS - 1) / TDM_MODEL_ALIGN_ELEMS * TDM_MODEL_ALIGN_ELEMS;
}

tdm_status tdm_model_add_tensor(tdm_model *m, int buffer, int layer, const char *name, int ndim,
                                const int64_t *shape)
{
    int *count = buffer ? &m->n_buffers : &m->n_params;
    int64_t *elems = buffer ? &m->buffer_elems : &m->param_elems;
    tdm_tensor_info *t = (buffer ? m->buffers_info : m->params_info) + *count;
    TDM_REQUIRE(*count < TDM_MODEL_MAX_TENSORS, TDM_STATUS_INVALID_ARG,
                "model has more than %d tensors", TDM_MODEL_MAX_TENSORS);
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->n_elem = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        t->n_elem *= shape[i];
    }
    t->offset = *elems;
    t->layer = layer;
    *elems = tdm_align_up(*elems + t->n_elem);
    (*count)++;
    return TDM_STATUS_OK;
}

tdm_layer *tdm_model_add_layer(tdm_model *m, tdm_layer_kind kind)
{
    tdm_layer *l = &m->layers[m->n_layers++];
    memset(l, 0, sizeof *l);
    l->kind = kind;
    l->p0 = m->n_params;
    l->b0 = m->n_buffers;
    l->block = m->n_layers - 1;
    return l;
}

static tdm_status tdm_model_linear(tdm_model *m, const char *name, int in, int out, int relu)
{
    char buf[TDM_MODEL_NAME_MAX];
    tdm_layer *l = tdm_model_add_layer(m, TDM_LAYER_LINEAR);
    int li = m->n_layers - 1;
    l->c = in;
    l->oc = out;
    l->relu = relu;
    l->in_elems = in;
    l->out_elems = out;
    snprintf(buf, sizeof buf, "%s.weight", name);
    TDM_CHECK(tdm_model_add_tensor(m, 0, li, buf, 2, (int64_t[]){out, in}));
    snprintf(buf, sizeof buf, "%s.bias", name);
    TDM_CHECK(tdm_model_add_tensor(m, 0, li, buf, 1, (int64_t[]){out}));
    l->np = 2;
    return TDM_STATUS_OK;
}

static tdm_status tdm_model_build(tdm_model *m)
{
    const tdm_model_spec *s = &m->spec;
    char name[TDM_MODEL_NAME_MAX];
    if (s->kind == TDM_MODEL_GPT) return tdm_gpt_build(m);
    if (s->kind == TDM_MODEL_SEQ) return tdm_seq_build(m);
    if (s->kind == TDM_MODEL_MLP) {
        TDM_REQUIRE(s->ndims >= 2 && s->ndims <= TDM_MODEL_MAX_DIMS, TDM_STATUS_INVALID_ARG,
                    "an MLP needs 2 to %d widths (input ... output), got %d", TDM_MODEL_MAX_DIMS,
                    s->ndims);
        for (int i = 0; i + 1 < s->ndims; i++) {
            TDM_REQUIRE(s->dims[i] > 0 && s->dims[i + 1] > 0, TDM_STATUS_INVALID_ARG,
                        "MLP width %d is not positive", i);
            snprintf(name, sizeof name, "fc%d", i + 1);
            TDM_CHECK(tdm_model_linear(m, name, s->dims[i], s->dims[i + 1], i + 2 < s->ndims));
        }
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(s->kind == TDM_MODEL_CNN, TDM_STATUS_INVALID_ARG, "unknown model kind %d",
                (int)s->kind);
    TDM_REQUIRE(s->in_c > 0 && s->in_h >= 4 && s->in_w >= 4 && s->ch1 > 0 && s->ch2 > 0 &&
                    s->n_classes > 0 && s->fc_hidden >= 0,
                TDM_STATUS_INVALID_ARG, "CNN shape %dx%dx%d too small", s->in_c, s->in_h,
                s->in_w);
    int c = s->in_c, h = s->in_h, w = s->in_w;
    if (c > 1) {
        tdm_layer *l = tdm_model_add_layer(m, TDM_LAYER_TO_CNHW);
        l->c = l->oc = c;
        l->h = l->oh = h;
        l->w = l->ow = w;
        l->in_elems = l->out_elems = (int64_t)c * h * w;
    }
    const int chans[2] = {s->ch1, s->ch2};
    for (int b = 0; b < 2; b++) {
        int li = m->n_layers;
        tdm_layer *l = tdm_model_add_layer(m, TDM_LAYER_CONV);
        l->c = c; l->h = h; l->w = w;
        l->k = 3; l->stride = 1; l->pad = 1;
        l->oc = chans[b]; l->oh = h; l->ow = w;
        l->in_elems = (int64_t)c * h * w;
        l->out_elems = (int64_t)l->oc * h * w;
        snprintf(name, sizeof name, "conv%d.weight", b + 1);
        TDM_CHECK(tdm_model_add_tensor(m, 0, li, name, 4, (int64_t[]){chans[b], c, 3, 3}));
        l->np = 1;
        c = chans[b];

        li = m->n_layers;
        l = tdm_model_add_layer(m, TDM_LAYER_BN);
        l->c = l->oc = c; l->h = l->oh = h; l->w = l->ow = w;
        l->relu = 1;
        l->in_elems = l->out_elems = (int64_t)c * h * w;
        snprintf(name, sizeof name, "bn%d.weight", b + 1);
        TDM_CHECK(tdm_model_add_tensor(m, 0, li, name, 1, (int64_t[]){c}));
        snprintf(name, sizeof name, "bn%d.bias", b + 1);
        TDM_CHECK(tdm_model_add_tensor(m, 0, li, name, 1, (int64_t[]){c}));
        l->np = 2;
        snprintf(name, sizeof name, "bn%d.running_mean", b + 1);
        TDM_CHECK(tdm_model_add_tensor(m, 1, li, name, 1, (int64_t[]){c}));
        snprintf(name, sizeof name, "bn%d.running_var", b + 1);
        TDM_CHECK(tdm_model_add_tensor(m, 1, li, name, 1, (int64_t[]){c}));
        l->nb = 2;

        l = tdm_model_add_layer(m, TDM_LAYER_MAXPOOL);
        l->c = l->oc = c; l->h = h; l->w = w;
        l->k = 2; l->stride = 2; l->pad = 0;
        l->oh = h / 2; l->ow = w / 2;
        l->in_elems = (int64_t)c * h * w;
        l->out_elems = (int64_t)c * l->oh * l->ow;
        h /= 2;
        w /= 2;
    }
    tdm_layer *l = tdm_model_add_layer(m, TDM_LAYER_FLATTEN);
    l->c = l->oc = c; l->h = l->oh = h; l->w = l->ow = w;
    l->in_elems = l->out_elems = (int64_t)c * h * w;
    if (s->fc_hidden > 0) {
        TDM_CHECK(tdm_model_linear(m, "fc1", c * h * w, s->fc_hidden, 1));
        return tdm_model_linear(m, "fc2", s->fc_hidden, s->n_classes, 0);
    }
    return tdm_model_linear(m, "fc", c * h * w, s->n_classes, 0);
}

tdm_status tdm_model_build_tables(tdm_model *m)
{
    TDM_CHECK(tdm_model_build(m));
    if (!m->vt && (m->stage.lo > 0 || m->stage.hi < m->stage.n)) TDM_CHECK(tdm_model_crop(m));
    return TDM_STATUS_OK;
}

/* released: no flat parameter and gradient buffers (tdm_model_init_released) */
static tdm_status tdm_model_alloc_state(tdm_model *m, int released)
{
    tdm_status st = TDM_STATUS_OK;
    m->released = released;
    if (!released) {
        size_t nb = (size_t)m->param_elems * sizeof(float);
        TDM_TRY(tdm_dev_alloc_zero(m->dev, nb, (void **)&m->params));
        TDM_TRY(tdm_dev_alloc_zero(m->dev, nb, (void **)&m->grads_owned));
        m->grads = m->grads_owned;
    }
    if (m->buffer_elems)
        TDM_TRY(tdm_dev_alloc_zero(m->dev, (size_t)m->buffer_elems * sizeof(float),
                                   (void **)&m->buffers));
    TDM_TRY(tdm_model_bn_stats(m));
    return TDM_STATUS_OK;
fail:
    return st;
}

tdm_status tdm_model_bn_stats(tdm_model *m)
{
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        if (l->kind != TDM_LAYER_BN || l->mean) continue;
        size_t nb = (size_t)l->c * sizeof(float);
        TDM_CHECK(tdm_dev_alloc_zero(m->dev, nb, (void **)&l->mean));
        TDM_CHECK(tdm_dev_alloc_zero(m->dev, nb, (void **)&l->var));
        TDM_CHECK(tdm_dev_alloc_zero(m->dev, nb, (void **)&l->invstd));
    }
    return TDM_STATUS_OK;
}

/* A model of pipeline layers [lo, hi) of spec (lo = hi = -1: all of
 * them); released: without its flat parameter and gradient buffers. */
static tdm_status tdm_model_new(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                                int lo, int hi, int released)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    TDM_REQUIRE(dev && spec, TDM_STATUS_INVALID_ARG, "model: NULL device or spec");
    int n = 0;
    TDM_CHECK(tdm_model_spec_n_layers(spec, &n));
    if (lo < 0) {
        lo = 0;
        hi = n;
    }
    TDM_REQUIRE(lo >= 0 && lo < hi && hi <= n, TDM_STATUS_INVALID_ARG,
                "model: layers [%d, %d) are not a non-empty range of its %d", lo, hi, n);
    tdm_model *m = calloc(1, sizeof *m);
    if (!m) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a model");
    m->spec = *spec;
    m->dev = dev;
    m->dev_kind = tdm_dev_kind(dev);
    m->dev_threads = tdm_dev_threads(dev);
    m->train = 1;
    m->stage = (tdm_model_stage){.lo = lo, .hi = hi, .n = n, .tied = -1, .tied_source = -1,
                                 .input_grad = lo > 0};
    TDM_TRY(tdm_model_build_tables(m));
    if (!m->vt) tdm_model_chain_units(m);
    if (lo > 0 || hi < n) TDM_TRY(tdm_model_stage_place(m));
    else m->stage.n_slice = m->n_params, m->stage.slice_elems = m->param_elems;
    TDM_TRY(tdm_model_alloc_state(m, released));
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        if (l->in_elems > m->max_elems) m->max_elems = l->in_elems;
        if (l->out_elems > m->max_elems) m->max_elems = l->out_elems;
    }
    *out = m;
    return TDM_STATUS_OK;
fail:
    tdm_model_free(m);
    return st;
}

tdm_status tdm_model_init_tables(tdm_model **out, const tdm_model_spec *spec)
{
    return tdm_model_skeleton(out, spec, TDM_DEVICE_HOST, 1);
}

tdm_status tdm_model_skeleton(tdm_model **out, const tdm_model_spec *spec, tdm_device_kind kind,
                              int threads)
{
    return tdm_model_skeleton_range(out, spec, kind, threads, -1, -1);
}

tdm_status tdm_model_skeleton_range(tdm_model **out, const tdm_model_spec *spec,
                                    tdm_device_kind kind, int threads, int lo, int hi)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    int n = 0;
    TDM_CHECK(tdm_model_spec_n_layers(spec, &n));
    if (lo < 0) {
        lo = 0;
        hi = n;
    }
    TDM_REQUIRE(lo >= 0 && lo < hi && hi <= n, TDM_STATUS_INVALID_ARG,
                "model: layers [%d, %d) are not a non-empty range of its %d", lo, hi, n);
    tdm_model *m = calloc(1, sizeof *m);
    if (!m) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a model");
    m->spec = *spec;
    m->dev_kind = kind;
    m->dev_threads = threads > 0 ? threads : 1;
    m->train = 1;
    m->stage = (tdm_model_stage){.lo = lo, .hi = hi, .n = n, .tied = -1, .tied_source = -1,
                                 .input_grad = lo > 0};
    TDM_TRY(tdm_model_build_tables(m));
    if (!m->vt) tdm_model_chain_units(m);
    if (lo > 0 || hi < n) TDM_TRY(tdm_model_stage_place(m));
    else m->stage.n_slice = m->n_params, m->stage.slice_elems = m->param_elems;
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        if (l->in_elems > m->max_elems) m->max_elems = l->in_elems;
        if (l->out_elems > m->max_elems) m->max_elems = l->out_elems;
    }
    *out = m;
    return TDM_STATUS_OK;
fail:
    tdm_model_free(m);
    return st;
}

void tdm_model_init_param_host(const tdm_model *m, uint64_t seed, int i, float *p)
{
    const tdm_tensor_info *t = &m->params_info[i];
    memset(p, 0, (size_t)t->n_elem * sizeof *p);
    if (m->vt) {
        m->vt->init_param(m, seed, i, p);
        return;
    }
    const tdm_layer *l = &m->layers[t->layer];
    int is_weight = strstr(t->name, ".weight") != NULL;
    if (l->kind == TDM_LAYER_BN || l->kind == TDM_LAYER_LN) {
        float v = is_weight ? 1.0f : 0.0f;
        for (int64_t j = 0; j < t->n_elem; j++) p[j] = v;
    } else if (is_weight) {
        /* He et al. 2015: std sqrt(2/fan_in) keeps relu activations'
         * variance constant; the output layer (no relu) uses 1/fan_in. */
        int64_t fan_in = t->n_elem / t->shape[0];
        int followed_by_relu = l->relu || l->kind == TDM_LAYER_CONV;
        float std = sqrtf((followed_by_relu ? 2.0f : 1.0f) / (float)fan_in);
        tdm_rng r;
        tdm_rng_init(&r, seed, TDM_RNG_STREAM_INIT + (uint64_t)tdm_model_global_param(m, i));
        for (int64_t j = 0; j < t->n_elem; j++) p[j] = std * tdm_rng_normal(&r);
    }
    /* biases stay 0 */
}

static tdm_status tdm_model_fill_host(tdm_model *m, uint64_t seed)
{
    tdm_status st = TDM_STATUS_OK;
    float *hp = calloc((size_t)m->param_elems, sizeof(float));
    float *hb = calloc((size_t)(m->buffer_elems ? m->buffer_elems : 1), sizeof(float));
    if (!hp || !hb) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate initial parameters");
        goto fail;
    }
    for (int i = 0; !m->released && i < m->n_params; i++)
        tdm_model_init_param_host(m, seed, i, hp + m->params_info[i].offset);
    for (int i = 0; i < m->n_buffers; i++) {
        const tdm_tensor_info *t = &m->buffers_info[i];
        float v = strstr(t->name, "running_var") ? 1.0f : 0.0f;
        for (int64_t j = 0; j < t->n_elem; j++) hb[t->offset + j] = v;
    }
    if (!m->released)
        TDM_TRY(tdm_dev_copy_from_host(m->dev, m->params, hp,
                                       (size_t)m->param_elems * sizeof(float)));
    if (m->buffer_elems)
        TDM_TRY(tdm_dev_copy_from_host(m->dev, m->buffers, hb,
                                       (size_t)m->buffer_elems * sizeof(float)));
fail:
    free(hp);
    free(hb);
    return st;
}

tdm_status tdm_model_init(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                          uint64_t seed)
{
    tdm_model *m = NULL;
    TDM_CHECK(tdm_model_new(&m, dev, spec, -1, -1, 0));
    m->seed = seed;
    tdm_status st = tdm_model_fill_host(m, seed);
    if (st != TDM_STATUS_OK) {
        tdm_model_free(m);
        return st;
    }
    char desc[128];
    tdm_model_spec_describe(spec, desc, sizeof desc);
    TDM_INFO(MODEL, "%s on %s: %d parameter tensors, %lld floats; %d buffers", desc,
             tdm_dev_name(dev), m->n_params, (long long)m->param_elems, m->n_buffers);
    *out = m;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_init_range(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                                uint64_t seed, int lo, int hi)
{
    tdm_model *m = NULL;
    TDM_CHECK(tdm_model_new(&m, dev, spec, lo, hi, 0));
    m->seed = seed;
    tdm_status st = tdm_model_fill_host(m, seed);
    if (st != TDM_STATUS_OK) {
        tdm_model_free(m);
        return st;
    }
    *out = m;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_init_released(tdm_model **out, tdm_device *dev,
                                   const tdm_model_spec *spec, uint64_t seed)
{
    tdm_model *m = NULL;
    TDM_CHECK(tdm_model_new(&m, dev, spec, -1, -1, 1));
    m->seed = seed;
    tdm_status st = tdm_model_fill_host(m, seed);   /* its buffers */
    if (st != TDM_STATUS_OK) {
        tdm_model_free(m);
        return st;
    }
    *out = m;
    return TDM_STATUS_OK;
}

uint64_t tdm_model_seed(const tdm_model *m) { return m->seed; }

tdm_status tdm_mlp_init(tdm_model **out, tdm_device *dev, const int *dims, int ndims,
                        uint64_t seed)
{
    tdm_model_spec s;
    tdm_model_spec_mlp(&s, dims, ndims);
    return tdm_model_init(out, dev, &s, seed);
}

tdm_status tdm_cnn_init(tdm_model **out, tdm_device *dev, uint64_t seed)
{
    tdm_model_spec s;
    tdm_model_spec_cnn(&s);
    return tdm_model_init(out, dev, &s, seed);
}

tdm_status tdm_model_clone(tdm_model **out, const tdm_model *src, tdm_device *dev)
{
    tdm_model *m = NULL;
    TDM_REQUIRE(!src->released, TDM_STATUS_INVALID_ARG,
                "model clone: the source's parameters live in views (its storage was "
                "released): nothing to copy from");
    TDM_CHECK(tdm_model_new(&m, dev, &src->spec, src->stage.lo, src->stage.hi, 0));
    tdm_status st = tdm_dev_copy_between(dev, m->params, src->dev, src->params,
                                         (size_t)m->param_elems * sizeof(float));
    if (st == TDM_STATUS_OK && m->buffer_elems)
        st = tdm_dev_copy_between(dev, m->buffers, src->dev, src->buffers,
                                  (size_t)m->buffer_elems * sizeof(float));
    if (st != TDM_STATUS_OK) {
        tdm_model_free(m);
        return st;
    }
    m->train = src->train;
    m->conv_chunk = src->conv_chunk;
    m->seed = src->seed;
    m->n_train_fwd = src->n_train_fwd;
    st = tdm_model_set_precision(m, src->lev.prec);
    if (st == TDM_STATUS_OK) st = tdm_model_set_checkpoint(m, src->lev.ckpt);
    if (st != TDM_STATUS_OK) {
        tdm_model_free(m);
        return st;
    }
    *out = m;
    return TDM_STATUS_OK;
}

void tdm_model_free_set(tdm_model *m)
{
    tdm_device *d = m->dev;
    /* the outputs (or their 16-bit copies), winners, rounded input and
     * arena, as the set's layout allocated them */
    tdm_act_free(m, &m->act_set, &m->arena);
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        tdm_dev_free(d, l->mean);
        tdm_dev_free(d, l->var);
        tdm_dev_free(d, l->invstd);
        l->out = l->mean = l->var = l->invstd = NULL;   /* 16-bit precisions: pointed at f32s */
        l->argmax = NULL;
        l->out16 = NULL;
        l->in = NULL;
        l->in16 = NULL;
    }
    m->x16 = NULL;
    m->act_bytes -= m->set_bytes;
    m->set_bytes = 0;
    m->cap = 0;
    m->batch = 0;
}

void tdm_model_free_scratch(tdm_model *m)
{
    tdm_device *d = m->dev;
    (void)d;
    for (int i = 0; i < m->n_layers; i++) m->layers[i].chunk = 0;
    tdm_act_free(m, &m->act_scratch, NULL);   /* dbuf, col, ones, dlogits, the 16-bit ones */
    m->dbuf[0] = m->dbuf[1] = m->col = m->ones = m->dlogits = NULL;
    m->f32s[0] = m->f32s[1] = NULL;
    m->d16 = m->col16 = NULL;
    m->scratch_cap = 0;
    m->act_bytes = m->set_bytes;
    m->input_grad = NULL;
}

/* Every set's activations and the scratch (the sets themselves stay). */
static void tdm_model_free_activations(tdm_model *m)
{
    if (m->vt) {
        m->vt->free_activations(m);
        return;
    }
    int cur = m->set;
    for (int k = 0; k < m->n_sets; k++) {
        if (tdm_model_select_act_set(m, k) != TDM_STATUS_OK) continue;
        tdm_model_free_set(m);
    }
    (void)tdm_model_select_act_set(m, cur);
    tdm_model_free_set(m);
    tdm_model_free_scratch(m);
}

void tdm_model_free(tdm_model *m)
{
    if (!m) return;
    tdm_model_free_activations(m);
    tdm_model_free_sets(m);
    if (m->vt) m->vt->free_ext(m);
    tdm_dev_free(m->dev, m->lev.wlow);
    tdm_dev_free(m->dev, m->params);
    tdm_dev_free(m->dev, m->grads_owned);
    tdm_dev_free(m->dev, m->buffers);
    free(m->drop_keys);
    free(m);
}

/* A host core's col chunk. The chunk's im2col matrix, the gemms' output
 * columns and OpenBLAS's packed panels share the core's L2, so that im2col
 * writes, the gemms read and col2im reads cache instead of memory. Of 32
 * KiB to 2 MiB, 32-128 KiB ran the default CNN fastest on a core with 1
 * MiB of L2 (interleaved runs, docs/PERFORMANCE.md): 4 images a chunk for
 * conv1 (9 x 784 floats of col each), 1 for conv2 (288 x 196). */
#define TDM_MODEL_CONV_CHUNK_BYTES ((size_t)128 * 1024)

/* Images per chunk of conv layer l at batch `batch`: what
 * tdm_model_set_conv_chunk asked for, else as many as keep the chunk's
 * col within TDM_MODEL_CONV_CHUNK_BYTES per BLAS thread on a host device
 * (at least one image), and the whole batch on other devices, where one
 * large kernel beats many small ones and memory is not the limit. */
int tdm_model_conv_chunk(const tdm_model *m, const tdm_layer *l, int batch)
{
    size_t nb;
    if (m->conv_chunk > 0) {
        nb = (size_t)m->conv_chunk;
    } else if (m->dev_kind != TDM_DEVICE_HOST) {
        nb = (size_t)batch;
    } else {
        size_t per_image = (size_t)l->c * l->k * l->k * l->oh * l->ow * sizeof(float);
        nb = TDM_MODEL_CONV_CHUNK_BYTES * (size_t)m->dev_threads / per_image;
        if (nb < 1) nb = 1;
    }
    return nb < (size_t)batch ? (int)nb : batch;
}

/* The scratch every activation set shares (backward's ping-pong buffers,
 * the convolutions' column chunk, ones, the loss gradient), grown to
 * `batch` samples. The conv chunk follows the largest batch seen, as
 * before there were sets: a model that saw one batch size runs the same
 * chunks in every set. */
static tdm_status tdm_model_reserve_scratch(tdm_model *m, int batch)
{
    if (batch <= m->scratch_cap) return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    tdm_device *d = m->dev;
    tdm_act_layout *set = NULL, *scr = NULL;
    size_t bytes = 0;
    tdm_model_free_scratch(m);
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        if (tdm_layer_convs(l)) l->chunk = tdm_model_conv_chunk(m, l, batch);
    }
    set = malloc(sizeof *set);
    scr = malloc(sizeof *scr);
    if (!set || !scr) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate an activation layout");
        goto fail;
    }
    tdm_model_chain_layout(m, batch, set, scr);
    TDM_TRY(tdm_act_alloc(m, scr, &m->act_scratch, NULL, &bytes));
    size_t nb = (size_t)batch * sizeof(float);
    {
        float *h = malloc(nb);
        if (!h) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate %zu bytes", nb);
            goto fail;
        }
        for (int i = 0; i < batch; i++) h[i] = 1.0f;
        st = tdm_dev_copy_from_host(d, m->ones, h, nb);
        free(h);
        TDM_TRY(st);
    }
    free(set);
    free(scr);
    m->scratch_cap = batch;
    m->act_bytes = m->set_bytes + bytes;
    return TDM_STATUS_OK;
fail:
    free(set);
    free(scr);
    tdm_model_free_scratch(m);
    return st;
}

/* Grows the current set's activations to hold `batch` samples (the set's
 * part of the layout: models/recompute.c), and the scratch. */
static tdm_status tdm_model_reserve(tdm_model *m, int batch)
{
    TDM_CHECK(tdm_model_reserve_scratch(m, batch));
    TDM_CHECK(tdm_model_bn_stats(m));
    if (batch <= m->cap) return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    tdm_act_layout *set = NULL, *scr = NULL;
    tdm_model_free_set(m);
    TDM_TRY(tdm_model_bn_stats(m));
    set = malloc(sizeof *set);
    scr = malloc(sizeof *scr);
    if (!set || !scr) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate an activation layout");
        goto fail;
    }
    tdm_model_chain_layout(m, batch, set, scr);
    size_t bytes = 0;
    TDM_TRY(tdm_act_alloc(m, set, &m->act_set, &m->arena, &bytes));
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].kind == TDM_LAYER_BN) bytes += 3 * (size_t)m->layers[i].c * sizeof(float);
    free(set);
    free(scr);
    m->cap = batch;
    m->set_bytes = bytes;
    m->act_bytes += bytes;
    return TDM_STATUS_OK;
fail:
    free(set);
    free(scr);
    tdm_model_free_set(m);
    return st;
}

void tdm_model_drop_activations(tdm_model *m)
{
    tdm_model_free_activations(m);
    m->batch = 0;
}

/* 16-bit precisions: the forward's outputs go to the scratch's ping-pong
 * buffers (bound at each pass: the scratch may have grown since). */
static void tdm_model_bind_low(tdm_model *m)
{
    if (!tdm_model_low(m)) return;
    for (int i = 0; i + 1 < m->n_layers; i++) m->layers[i].out = m->f32s[i & 1];
}

/* ---- settings ---- */

tdm_status tdm_model_set_conv_chunk(tdm_model *m, int images)
{
    TDM_REQUIRE(images >= 0, TDM_STATUS_INVALID_ARG,
                "conv chunk: %d images (expected >= 1, or 0 for the default)", images);
    if (m->vt || images == m->conv_chunk) {
        m->conv_chunk = images;
        return TDM_STATUS_OK;
    }
    /* the chunk sizes the scratch, fixed when it is reserved */
    tdm_model_free_activations(m);
    m->conv_chunk = images;
    return TDM_STATUS_OK;
}

/* ---- forward ---- */

tdm_status tdm_model_forward(tdm_model *m, const void *x, int batch, const float **logits)
{
    TDM_REQUIRE(batch > 0, TDM_STATUS_INVALID_ARG, "forward: batch %d must be positive", batch);
    TDM_REQUIRE(x, TDM_STATUS_INVALID_ARG, "forward: NULL input");
    /* until this forward succeeds there are no activations to go back
     * through (a failed reserve frees them) */
    m->batch = 0;
    if (m->vt) return m->vt->forward(m, x, batch, logits);
    TDM_CHECK(tdm_model_reserve(m, batch));
    TDM_CHECK(tdm_seq_drop_keys(m, x, batch));
    tdm_model_bind_low(m);
    const float *cur = x;
    if (tdm_model_low(m)) {
        /* the input rounded as every activation is; layer 0 reads it
         * from the ping-pong buffer before its own output's */
        int64_t n = (int64_t)batch * m->layers[0].in_elems;
        TDM_CHECK(tdm_dev_convert(m->dev, m->x16, m->lev.adt, x, TDM_DTYPE_FLOAT32, n));
        TDM_CHECK(tdm_dev_convert(m->dev, m->f32s[1], TDM_DTYPE_FLOAT32, m->x16, m->lev.adt, n));
        cur = m->f32s[1];
    }
    TDM_CHECK(tdm_model_run_layers(m, 0, m->n_layers - 1, cur, batch));
    m->batch = batch;
    if (logits) *logits = m->layers[m->n_layers - 1].out;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_run_layers(tdm_model *m, int first, int last, const float *cur, int batch)
{
    int low = tdm_model_low(m);
    for (int i = first; i <= last; i++) {
        tdm_layer *l = &m->layers[i];
        if (l->np > 0 && !m->lev.recomputing) {
            TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, l->p0, l->p0 + l->np - 1));
            TDM_CHECK(tdm_model_cast_params(m, l->p0, l->p0 + l->np - 1));
        }
        if (i < last && tdm_model_pair_fuses(m, i)) {
            /* the pooling has no parameters: no use event of its own */
            TDM_CHECK(tdm_model_pair_forward(m, l, l + 1, cur, batch));
            cur = (++l)->out;
            i++;
            continue;
        }
        if (low) l->in16 = i == 0 ? m->x16 : m->layers[i - 1].out16;
        TDM_CHECK(tdm_model_layer_forward(m, l, cur, batch));
        if (low && i + 1 < m->n_layers)
            TDM_CHECK(tdm_model_round(m, l->out, l->out16, (int64_t)batch * l->out_elems));
        cur = l->out;
    }
    return TDM_STATUS_OK;
}

/* 16-bit precisions: before layer i's backward, the float32 values its
 * forward read and wrote, widened from what it kept, back in the buffers
 * its forward used (l->in: the other ping-pong buffer; l->out: its own),
 * where the layer kinds that read them look. */
static tdm_status tdm_model_restore_low(tdm_model *m, int i, int B)
{
    tdm_layer *l = &m->layers[i];
    int need_in = l->kind == TDM_LAYER_CONV || l->kind == TDM_LAYER_BN;
    int need_out = i + 1 < m->n_layers && (l->relu || l->kind == TDM_LAYER_BN);
    if (need_in) {
        float *x = m->f32s[(i + 1) & 1];
        TDM_CHECK(tdm_dev_convert(m->dev, x, TDM_DTYPE_FLOAT32, l->in16, m->lev.adt,
                                  (int64_t)B * l->in_elems));
        l->in = x;
    }
    if (need_out)
        TDM_CHECK(tdm_dev_convert(m->dev, l->out, TDM_DTYPE_FLOAT32, l->out16, m->lev.adt,
                                  (int64_t)B * l->out_elems));
    return TDM_STATUS_OK;
}

/* ---- backward ---- */

tdm_status tdm_model_backward(tdm_model *m, const float *dlogits)
{
    TDM_REQUIRE(m->batch > 0, TDM_STATUS_INVALID_ARG, "backward called before forward");
    TDM_REQUIRE(dlogits, TDM_STATUS_INVALID_ARG, "backward: NULL dlogits");
    if (m->vt) return m->vt->backward(m, dlogits);
    int B = m->batch;
    tdm_device *d = m->dev;
    int cur = 0;
    m->input_grad = NULL;
    tdm_model_bind_low(m);
    TDM_CHECK(tdm_dev_copy(d, m->dbuf[0], dlogits,
                           (size_t)B * (size_t)m->layers[m->n_layers - 1].out_elems *
                               sizeof(float)));
    /* the input gradient of the first layer with parameters and of the
     * layers before it (input reshuffles) is never needed, nor that of
     * the layer backward stops at; a stage after the first needs its
     * input's (it is the previous stage's output gradient) */
    int first = 0;
    while (first < m->n_layers - 1 && m->layers[first].np == 0) first++;
    if (first < m->bwd_stop) first = m->bwd_stop;
    if (m->stage.input_grad && m->bwd_stop == 0) first = -1;
    for (int i = m->n_layers - 1; i >= m->bwd_stop; i--) {
        tdm_layer *l = &m->layers[i];
        float *din = i > first ? m->dbuf[1 - cur] : NULL;
        if (din && i - 1 >= m->bwd_stop && tdm_model_pair_fuses(m, i - 1)) {
            /* pooling i and batchnorm i - 1 together: the pooling's input
             * gradient in dbuf[1 - cur], the batchnorm's back in dbuf[cur],
             * as two steps of this loop would leave them */
            tdm_layer *bn = l - 1;
            float *bn_din = i - 1 > first ? m->dbuf[cur] : NULL;
            TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, bn->p0, bn->p0 + bn->np - 1));
            if (l->seg_last && m->lev.ckpt > 0) TDM_CHECK(tdm_model_chain_recompute(m, i, B));
            TDM_CHECK(tdm_model_pair_backward(m, bn, l, m->dbuf[cur], din, bn_din, B));
            TDM_CHECK(tdm_seq_skip_add(m, i - 1, bn_din, B));
            if (m->hook) m->hook(m->hook_ctx, m, bn->p0, bn->p0 + bn->np - 1);
            i--;
            continue;
        }
        if (l->np > 0)
            TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, l->p0, l->p0 + l->np - 1));
        if (l->seg_last && m->lev.ckpt > 0) TDM_CHECK(tdm_model_chain_recompute(m, i, B));
        if (tdm_model_low(m)) TDM_CHECK(tdm_model_restore_low(m, i, B));
        TDM_CHECK(tdm_model_layer_backward(m, l, m->dbuf[cur], din, B));
        TDM_CHECK(tdm_seq_skip_add(m, i, din, B));
        if (l->np > 0 && m->hook) m->hook(m->hook_ctx, m, l->p0, l->p0 + l->np - 1);
        cur = 1 - cur;
    }
    if (m->stage.input_grad && m->bwd_stop == 0) m->input_grad = m->dbuf[cur];
    return TDM_STATUS_OK;
}

float *tdm_model_loss_grad(tdm_model *m) { return m->dlogits; }

tdm_status tdm_model_forward_backward(tdm_model *m, const void *x, const int32_t *y, int batch,
                                      double *loss_mean)
{
    const float *logits;
    double loss_sum = 0.0;
    TDM_CHECK(tdm_model_forward(m, x, batch, &logits));
    TDM_CHECK(tdm_model_loss(m, logits, y, batch, 1.0f / (float)batch, &loss_sum, m->dlogits));
    TDM_CHECK(tdm_model_backward(m, m->dlogits));
    if (loss_mean) *loss_mean = loss_sum / batch;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_count_correct(tdm_model *m, const int32_t *y_host, int batch,
                                   int64_t *correct)
{
    TDM_REQUIRE(batch > 0 && batch <= m->batch, TDM_STATUS_INVALID_ARG,
                "count_correct: batch %d but the last forward had %d", batch, m->batch);
    int C = tdm_model_n_classes(m);
    int64_t rows = (int64_t)batch * tdm_model_out_rows(m);
    size_t nb = (size_t)rows * C * sizeof(float);
    float *h = malloc(nb);
    if (!h) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate %zu bytes", nb);
    const float *logits = m->vt ? m->vt->last_logits(m) : m->layers[m->n_layers - 1].out;
    tdm_status st = tdm_dev_copy_to_host(m->dev, h, logits, nb);
    int64_t n = 0;
    for (int64_t r = 0; st == TDM_STATUS_OK && r < rows; r++) {
        int best = 0;
        for (int c = 1; c < C; c++)
            if (h[(size_t)r * C + c] > h[(size_t)r * C + best]) best = c;
        n += best == y_host[r];
    }
    free(h);
    *correct = n;
    return st;
}
