/* models/model_hooks.c: what the parallel designs install on a model
 * without the model knowing why: the grad-ready hook (DDP's buckets),
 * SyncBatchNorm's statistics callback and its sample-less passes (a
 * joined rank), borrowed gradient storage, per-tensor views of parameters
 * and gradients with released flat buffers, and parameter-use events
 * (FSDP's gathers). Not here: the layer graph, forward and backward
 * (models/model.c). */
#include "models/model_impl.h"

#include <string.h>

void tdm_model_set_sync_bn(tdm_model *m, tdm_model_allsum_fn fn, void *ctx)
{
    m->sync_bn = fn;
    m->sync_bn_ctx = ctx;
}

tdm_status tdm_model_set_partial_sums(tdm_model *m, const tdm_model_partial *kinds, int n,
                                      tdm_model_partial_fn fn, void *ctx)
{
    /* the sliced GPT: its spec says which layers are split */
    int gpt = m->spec.kind == TDM_MODEL_GPT && m->spec.tp_ranks > 1;
    TDM_REQUIRE(!fn || (gpt ? !kinds : kinds && n == m->n_layers && !m->vt),
                TDM_STATUS_INVALID_ARG, "partial sums: %d kinds for a model of %d layers%s", n,
                m->n_layers, gpt ? " (a sliced GPT takes none: its spec says them)"
                             : m->vt ? " (a model with its own forward: not supported)" : "");
    for (int i = 0; fn && kinds && i < n; i++)
        TDM_REQUIRE(kinds[i] == TDM_MODEL_PARTIAL_NONE || m->layers[i].kind == TDM_LAYER_LINEAR,
                    TDM_STATUS_INVALID_ARG, "partial sums: layer %d is not a linear layer", i);
    for (int i = 0; i < m->n_layers; i++)
        m->layers[i].partial = fn && kinds ? kinds[i] : TDM_MODEL_PARTIAL_NONE;
    m->partial = fn;
    m->partial_ctx = ctx;
    return TDM_STATUS_OK;
}

void tdm_model_set_partial_rank(tdm_model *m, int rank)
{
    int open = 0;   /* after a column-parallel layer, before its row-parallel one */
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        if (l->partial == TDM_MODEL_PARTIAL_IN) open = 1;
        else if (l->partial == TDM_MODEL_PARTIAL_OUT) open = 0;
        else if (l->kind == TDM_LAYER_DROPOUT) l->j0 = open ? (int64_t)rank * l->out_elems : 0;
    }
}

tdm_status tdm_model_sync_bn_forward_empty(tdm_model *m)
{
    TDM_REQUIRE(m->sync_bn && m->train && !m->vt, TDM_STATUS_INVALID_ARG,
                "SyncBatchNorm without samples: needs a batchnorm model in training mode with "
                "the statistics callback set");
    /* no activations to go back through, as after a failed forward */
    m->batch = 0;
    TDM_CHECK(tdm_model_bn_stats(m));
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        if (l->kind != TDM_LAYER_BN) continue;
        TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_FORWARD, l->p0, l->p0 + l->np - 1));
        TDM_CHECK(tdm_syncbn_forward(m, l, NULL, 0));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_model_sync_bn_backward_empty(tdm_model *m)
{
    TDM_REQUIRE(m->sync_bn && m->train && !m->vt, TDM_STATUS_INVALID_ARG,
                "SyncBatchNorm without samples: needs a batchnorm model in training mode with "
                "the statistics callback set");
    /* the layers and hooks in tdm_model_backward's order, so that the
     * statistics sums and the buckets the hook launches interleave on
     * the communicator as on the replicas with samples */
    for (int i = m->n_layers - 1; i >= m->bwd_stop; i--) {
        tdm_layer *l = &m->layers[i];
        if (l->np > 0)
            TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, l->p0, l->p0 + l->np - 1));
        if (l->kind == TDM_LAYER_BN) TDM_CHECK(tdm_syncbn_backward(m, l, NULL, NULL, 0));
        if (l->np > 0 && m->hook) m->hook(m->hook_ctx, m, l->p0, l->p0 + l->np - 1);
    }
    return TDM_STATUS_OK;
}

int tdm_model_n_batchnorm(const tdm_model *m)
{
    int n = 0;
    for (int i = 0; i < m->n_layers; i++) n += m->layers[i].kind == TDM_LAYER_BN;
    return n;
}

void tdm_model_set_grad_hook(tdm_model *m, tdm_grad_ready_fn fn, void *ctx)
{
    m->hook = fn;
    m->hook_ctx = ctx;
}

tdm_status tdm_model_set_grad_storage(tdm_model *m, float *grads)
{
    size_t nb = (size_t)m->param_elems * sizeof(float);
    TDM_REQUIRE(!m->released, TDM_STATUS_INVALID_ARG,
                "model: gradient storage was released (views in use): cannot %s it",
                grads ? "replace" : "give back");
    if (!grads) {
        if (m->grads != m->grads_owned)
            TDM_CHECK(tdm_dev_copy(m->dev, m->grads_owned, m->grads, nb));
        m->grads = m->grads_owned;
        return TDM_STATUS_OK;
    }
    TDM_CHECK(tdm_dev_copy(m->dev, grads, m->grads, nb));
    m->grads = grads;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_zero_grad(tdm_model *m)
{
    if (!m->released)
        return tdm_dev_memset_zero(m->dev, m->grads, (size_t)m->param_elems * sizeof(float));
    for (int i = 0; i < m->n_params; i++)
        if (m->gview[i])
            TDM_CHECK(tdm_dev_memset_zero(m->dev, m->gview[i],
                                               (size_t)m->params_info[i].n_elem * sizeof(float)));
    return TDM_STATUS_OK;
}

/* ---- views, storage and parameter-use events ---- */

static tdm_status tdm_model_view_range(const tdm_model *m, int first, int last, const char *what)
{
    TDM_REQUIRE(first >= 0 && last < m->n_params && first <= last, TDM_STATUS_INVALID_ARG,
                "model: %s view of parameters %d..%d, but the model has 0..%d", what, first,
                last, m->n_params - 1);
    return TDM_STATUS_OK;
}

/* Points view[first..last] into base, each tensor at its offset from the
 * range's first (NULL: back to the flat buffers). */
static tdm_status tdm_model_set_view(tdm_model *m, float **view, int first, int last,
                                     float *base, const char *what)
{
    TDM_CHECK(tdm_model_view_range(m, first, last, what));
    int64_t o0 = m->params_info[first].offset;
    for (int i = first; i <= last; i++)
        view[i] = base ? base + (m->params_info[i].offset - o0) : NULL;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_set_param_view(tdm_model *m, int first, int last, float *base)
{
    return tdm_model_set_view(m, m->pview, first, last, base, "parameter");
}

tdm_status tdm_model_set_grad_view(tdm_model *m, int first, int last, float *base)
{
    return tdm_model_set_view(m, m->gview, first, last, base, "gradient");
}

tdm_status tdm_model_release_storage(tdm_model *m)
{
    if (m->released) return TDM_STATUS_OK;
    TDM_REQUIRE(m->grads == m->grads_owned, TDM_STATUS_INVALID_ARG,
                "model: cannot release storage while its gradients are borrowed "
                "(tdm_model_set_grad_storage): give them back first");
    tdm_dev_free(m->dev, m->params);
    tdm_dev_free(m->dev, m->grads_owned);
    m->params = m->grads = m->grads_owned = NULL;
    m->released = 1;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_restore_storage(tdm_model *m)
{
    size_t nb = (size_t)m->param_elems * sizeof(float);
    if (m->released) {
        float *p = NULL, *g = NULL;
        tdm_status st = tdm_dev_alloc_zero(m->dev, nb, (void **)&p);
        if (st == TDM_STATUS_OK) st = tdm_dev_alloc_zero(m->dev, nb, (void **)&g);
        if (st != TDM_STATUS_OK) {
            tdm_dev_free(m->dev, p);
            return tdm_error_prefix(st, "model: restoring its flat buffers");
        }
        m->params = p;
        m->grads = m->grads_owned = g;
        m->released = 0;
    }
    memset(m->pview, 0, sizeof m->pview);
    memset(m->gview, 0, sizeof m->gview);
    return TDM_STATUS_OK;
}

int tdm_model_storage_released(const tdm_model *m) { return m->released; }

int tdm_model_has_views(const tdm_model *m)
{
    for (int i = 0; i < m->n_params; i++)
        if (m->pview[i] || m->gview[i]) return 1;
    return 0;
}

void tdm_model_set_use_hook(tdm_model *m, tdm_param_use_fn fn, void *ctx)
{
    m->use_hook = fn;
    m->use_ctx = ctx;
}

tdm_status tdm_model_raise_use(tdm_model *m, tdm_model_use use, int first, int last)
{
    if (m->use_hook) TDM_CHECK(m->use_hook(m->use_ctx, m, use, first, last));
    for (int i = first; i <= last; i++) {
        int no_p = use != TDM_MODEL_USE_BACKWARD_GRADS && !tdm_model_pdata(m, i);
        int no_g = use != TDM_MODEL_USE_FORWARD && !tdm_model_gdata(m, i);
        if (no_p || no_g)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "model: %s of parameter '%s' has no storage at its %s (the "
                                 "flat buffers were released and no view was set)",
                                 no_p ? "the value" : "the gradient", m->params_info[i].name,
                                 use == TDM_MODEL_USE_FORWARD ? "forward" : "backward");
    }
    return TDM_STATUS_OK;
}

int tdm_model_layer_block(const tdm_model *m, int layer)
{
    return layer >= 0 && layer < m->n_layers ? m->layers[layer].block : -1;
}
