/* models/model_info.c: what a model tells its callers without running:
 * its spec, shapes, tensors and flat storage, the train/eval switch, the
 * backward stop, and the bytes it holds or would hold for a batch (the
 * memory plan's and the designs' accounting) and its gemm work. The
 * building, freeing and the passes are models/model.c. */
#include "models/model_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"

/* ---- accessors ---- */

const tdm_model_spec *tdm_model_get_spec(const tdm_model *m) { return &m->spec; }
tdm_device *tdm_model_device(const tdm_model *m) { return m->dev; }
int tdm_model_in_features(const tdm_model *m)
{
    if (m->stage.lo > 0) return (int)tdm_model_stage_in_elems(m);
    if (m->spec.kind == TDM_MODEL_GPT) return m->spec.n_ctx;
    return m->spec.kind == TDM_MODEL_MLP ? m->spec.dims[0]
                                         : m->spec.in_c * m->spec.in_h * m->spec.in_w;
}
tdm_model_input tdm_model_input_dtype(const tdm_model *m)
{
    return m->spec.kind == TDM_MODEL_GPT && m->stage.lo == 0 ? TDM_MODEL_INPUT_TOKENS
                                                             : TDM_MODEL_INPUT_F32;
}
int tdm_model_n_classes(const tdm_model *m)
{
    if (m->spec.kind == TDM_MODEL_GPT) return m->spec.vocab;
    return m->spec.kind == TDM_MODEL_MLP ? m->spec.dims[m->spec.ndims - 1] : m->spec.n_classes;
}
int tdm_model_out_rows(const tdm_model *m)
{
    return m->spec.kind == TDM_MODEL_GPT ? m->spec.n_ctx : 1;
}
int tdm_model_n_params(const tdm_model *m) { return m->n_params; }
const tdm_tensor_info *tdm_model_param_info(const tdm_model *m, int i)
{
    return i >= 0 && i < m->n_params ? &m->params_info[i] : NULL;
}
int tdm_model_n_buffers(const tdm_model *m) { return m->n_buffers; }
const tdm_tensor_info *tdm_model_buffer_info(const tdm_model *m, int i)
{
    return i >= 0 && i < m->n_buffers ? &m->buffers_info[i] : NULL;
}
int tdm_model_n_layers(const tdm_model *m) { return m->n_layers; }
void tdm_model_layer_params(const tdm_model *m, int layer, int *first, int *last)
{
    const tdm_layer *l = &m->layers[layer];
    *first = l->p0;
    *last = l->p0 + l->np - 1;
}
float *tdm_model_params(tdm_model *m) { return m->params; }
float *tdm_model_grads(tdm_model *m) { return m->grads; }
float *tdm_model_buffers(tdm_model *m) { return m->buffers; }
int64_t tdm_model_param_elems(const tdm_model *m) { return m->param_elems; }
int64_t tdm_model_train_forwards(const tdm_model *m) { return m->n_train_fwd; }
void tdm_model_set_train_forwards(tdm_model *m, int64_t n) { m->n_train_fwd = n; }
int64_t tdm_model_buffer_elems(const tdm_model *m) { return m->buffer_elems; }
void tdm_model_set_train(tdm_model *m, int train) { m->train = train != 0; }
int tdm_model_is_train(const tdm_model *m) { return m->train; }
tdm_status tdm_model_set_backward_stop(tdm_model *m, int layer)
{
    TDM_REQUIRE(layer >= 0 && layer <= m->n_layers, TDM_STATUS_INVALID_ARG,
                "backward stop: layer %d out of range 0..%d", layer, m->n_layers);
    TDM_REQUIRE(!m->vt || layer == 0, TDM_STATUS_INVALID_ARG,
                "backward stop: not supported by this model (its backward is not a chain of "
                "layers)");
    m->bwd_stop = layer;
    return TDM_STATUS_OK;
}

/* What tdm_model_reserve allocates for `batch` samples (model.c's layers):
 * the same sums, without allocating. */
static size_t tdm_model_layers_act_bytes(const tdm_model *m, int batch)
{
    size_t bytes = 0, col_max = 0;
    for (int i = 0; i < m->n_layers; i++) {
        const tdm_layer *l = &m->layers[i];
        bytes += (size_t)batch * (size_t)l->out_elems * sizeof(float);
        if (l->kind == TDM_LAYER_LN)   /* its means and rstds, in the output's buffer */
            bytes += 2 * (size_t)batch * sizeof(float);
        if (l->kind == TDM_LAYER_RES)
            bytes += (size_t)batch * (size_t)l->skip_elems * sizeof(float);
        if (tdm_layer_convs(l)) {
            size_t nb = (size_t)l->c * l->k * l->k * (size_t)tdm_model_conv_chunk(m, l, batch) *
                        l->oh * l->ow * sizeof(float);
            if (nb > col_max) col_max = nb;
        } else if (l->kind == TDM_LAYER_MAXPOOL) {
            bytes += (size_t)batch * (size_t)l->out_elems * sizeof(int32_t);
        } else if (l->kind == TDM_LAYER_BN) {
            bytes += 3 * (size_t)l->c * sizeof(float);   /* the set's mean, var, invstd */
        }
    }
    bytes += 2 * (size_t)batch * (size_t)m->max_elems * sizeof(float) + col_max;
    bytes += (size_t)batch * (size_t)tdm_model_n_classes(m) * sizeof(float) +
             (size_t)batch * sizeof(float);   /* dlogits, ones */
    return bytes;
}

tdm_status tdm_model_spec_footprint(const tdm_model_spec *spec, tdm_device *dev, int batch,
                                    tdm_model_footprint *out)
{
    tdm_status st = TDM_STATUS_OK;
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(spec && dev && batch >= 1, TDM_STATUS_INVALID_ARG,
                "model footprint: a spec, a device and a batch >= 1");
    /* the layers and the tensor table only: tdm_model_build_tables allocates no
     * parameters, gradients or activations */
    tdm_model *m = calloc(1, sizeof *m);
    if (!m) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a model");
    m->spec = *spec;
    m->dev = dev;
    m->dev_kind = tdm_dev_kind(dev);
    m->dev_threads = tdm_dev_threads(dev);
    m->train = 1;
    int n = 0;
    TDM_TRY(tdm_model_spec_n_layers(spec, &n));
    /* the whole model: every pipeline layer, as tdm_model_new makes it */
    m->stage = (tdm_model_stage){.lo = 0, .hi = n, .n = n, .tied = -1, .tied_source = -1};
    TDM_TRY(tdm_model_build_tables(m));
    for (int i = 0; i < m->n_layers; i++) {
        const tdm_layer *l = &m->layers[i];
        if (l->in_elems > m->max_elems) m->max_elems = l->in_elems;
        if (l->out_elems > m->max_elems) m->max_elems = l->out_elems;
    }
    for (int p = 0; p < m->n_params; p++)
        if (m->params_info[p].n_elem > out->largest_param_elems)
            out->largest_param_elems = m->params_info[p].n_elem;
    out->param_elems = m->param_elems;
    out->buffer_elems = m->buffer_elems;
    out->act_bytes = spec->kind == TDM_MODEL_GPT ? tdm_gpt_act_bytes(m, batch)
                                                 : tdm_model_layers_act_bytes(m, batch);
fail:
    tdm_model_free(m);
    return st;
}

void tdm_model_get_memory(const tdm_model *m, tdm_model_memory *out)
{
    out->params = m->released ? 0 : (size_t)m->param_elems * sizeof(float);
    out->grads = out->params;
    out->buffers = (size_t)m->buffer_elems * sizeof(float);
    size_t sets = 0, scratch = 0;
    tdm_model_act_bytes(m, &sets, &scratch);
    out->activations = sets + scratch;
    out->params_low = m->lev.wlow ? (size_t)m->param_elems * tdm_dtype_size(m->lev.adt) : 0;
}

void tdm_model_gemm_flops(const tdm_model *m, double *fwd, double *bwd)
{
    if (m->vt) {
        m->vt->gemm_flops(m, fwd, bwd);
        return;
    }
    double f = 0.0, b = 0.0;
    int first = 1;
    for (int i = 0; i < m->n_layers; i++) {
        const tdm_layer *l = &m->layers[i];
        double macs;
        if (l->kind == TDM_LAYER_LINEAR) macs = (double)l->c * l->oc;
        else if (tdm_layer_convs(l)) macs = (double)l->oc * l->c * l->k * l->k * l->oh * l->ow;
        else if (l->kind == TDM_LAYER_RES && l->proj) macs = (double)l->c * l->oc;
        else continue;
        f += 2.0 * macs;
        b += 2.0 * macs * (first ? 1.0 : 2.0);
        first = 0;
    }
    *fwd = f;
    *bwd = b;
}

