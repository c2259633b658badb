/* tp/seq.c: a model file on the tensor-parallel MLP path. A file of
 * linear layers with elementwise layers between them (relu, gelu, tanh,
 * sigmoid, dropout; flatten, a no-op on the input's bytes) splits as the
 * built-in MLP: linear layers in column/row pairs, an odd last one
 * replicated. An elementwise layer after a column-parallel layer runs on
 * the rank's columns of its output (dropout's mask indexed by the
 * value's place in the whole vector, so every rank drops what one device
 * drops), after a row-parallel or replicated one on the whole output,
 * replicated. Any other layer is refused naming its line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/builder.h"
#include "tp/tp_impl.h"

/* Why the MLP path cannot run a layer of this kind. */
static const char *tdm_tp_refusal(tdm_model_op_kind k)
{
    switch (k) {
    case TDM_MODEL_OP_CONV:
        return "a convolution is not split by tensor parallelism (it splits linear layers)";
    case TDM_MODEL_OP_BATCHNORM:
        return "batchnorm normalises over the batch per channel, not value by value: it is "
               "not built for tensor parallelism";
    case TDM_MODEL_OP_LAYERNORM:
        return "layernorm normalises over all of a sample's features, which a column-parallel "
               "layer splits across the ranks: not built for tensor parallelism";
    case TDM_MODEL_OP_RES_OPEN:
    case TDM_MODEL_OP_RES_CLOSE:
        return "a residual block's sum is not built for tensor parallelism";
    case TDM_MODEL_OP_MAXPOOL:
    case TDM_MODEL_OP_AVGPOOL:
        return "pooling reads an image's planes; tensor parallelism splits linear layers";
    default:
        return "tensor parallelism splits linear layers with elementwise layers between them";
    }
}

static tdm_status tdm_tp_refuse(const tdm_model_spec *spec, const tdm_model_op *o,
                                const char *why)
{
    if (o->line > 0)
        return tdm_error_set(TDM_STATUS_USAGE, "%s line %d: `%s`: --mode tp cannot split it: %s",
                             spec->name, o->line, tdm_model_op_name(o->kind), why);
    return tdm_error_set(TDM_STATUS_USAGE, "%s layer %d (%s): --mode tp cannot split it: %s",
                         spec->name, (int)(o - spec->ops) + 1, tdm_model_op_name(o->kind), why);
}

static tdm_status tdm_tp_add_post(const tdm_model_spec *spec, tdm_tp_shape *out, int slot,
                                  const tdm_model_op *o)
{
    if (out->n_post[slot] == TDM_TP_MAX_POST)
        return tdm_tp_refuse(spec, o, "more than 8 elementwise layers in a row are not built");
    tdm_model_op_kind k = o->kind;
    out->post[slot][out->n_post[slot]++] = (tdm_tp_post){
        .kind = k, .p = o->p, .op = (int)(o - spec->ops),
        .act = k == TDM_MODEL_OP_RELU   ? TDM_ACT_RELU
               : k == TDM_MODEL_OP_GELU ? TDM_ACT_GELU
               : k == TDM_MODEL_OP_TANH ? TDM_ACT_TANH
                                        : TDM_ACT_SIGMOID};
    if (k == TDM_MODEL_OP_DROPOUT) out->dropout = 1;
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_shape_of(const tdm_model_spec *spec, tdm_tp_shape *out)
{
    static const char *const kinds[] = {"mlp", "cnn", "gpt"};
    memset(out, 0, sizeof *out);
    if (spec->kind == TDM_MODEL_MLP) {
        out->ndims = spec->ndims;
        for (int i = 0; i < spec->ndims && i < TDM_MODEL_MAX_DIMS; i++) {
            out->dims[i] = spec->dims[i];
            out->relu[i] = i + 2 < spec->ndims;
        }
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(spec->kind == TDM_MODEL_SEQ, TDM_STATUS_USAGE,
                "--mode tp supports the MLP, the GPT and model files of linear layers; the %s "
                "is not supported",
                (unsigned)spec->kind <= TDM_MODEL_GPT ? kinds[spec->kind] : "model");
    out->dims[0] = spec->in_c * spec->in_h * spec->in_w;
    out->ndims = 1;
    int fuse = 0;   /* the op before was a linear layer a relu may join */
    for (int i = 0; i < spec->n_ops; i++) {
        const tdm_model_op *o = &spec->ops[i];
        int slot = out->ndims - 1, was = fuse;
        fuse = 0;
        switch (o->kind) {
        case TDM_MODEL_OP_LINEAR:
            if (out->ndims == TDM_MODEL_MAX_DIMS)
                return tdm_tp_refuse(spec, o, "more than 15 linear layers are not built");
            out->line[slot] = o->line;
            out->dims[out->ndims++] = o->w;
            fuse = 1;
            break;
        case TDM_MODEL_OP_RELU:
            if (was) {   /* fused into the linear layer, as one device runs it */
                out->relu[slot - 1] = 1;
                break;
            }
            /* fall through */
        case TDM_MODEL_OP_GELU:
        case TDM_MODEL_OP_TANH:
        case TDM_MODEL_OP_SIGMOID:
        case TDM_MODEL_OP_DROPOUT:
            TDM_CHECK(tdm_tp_add_post(spec, out, slot, o));
            break;
        case TDM_MODEL_OP_FLATTEN:
            break;   /* the input's bytes are each sample's (C, H, W) values already */
        default:
            return tdm_tp_refuse(spec, o, tdm_tp_refusal(o->kind));
        }
    }
    return TDM_STATUS_OK;
}

/* Dropout of B rows of w values (columns [j0, j0 + w) of each sample's
 * vector) from src into dst on the device, through the host where the
 * device is not the host's memory. */
static tdm_status tdm_tp_drop(tdm_tp *p, const tdm_tp_post *q, int B, int w, int64_t j0,
                              int train, const float *src, float *dst)
{
    size_t nb = (size_t)B * (size_t)w * sizeof(float);
    if (!train || q->p == 0.0f)
        return src == dst ? TDM_STATUS_OK : tdm_dev_copy(p->dev, dst, src, nb);
    if (tdm_dev_kind(p->dev) == TDM_DEVICE_HOST) {
        tdm_model_drop_cols(p->drop_keys, q->op, q->p, B, j0, w, src, dst);
        return TDM_STATUS_OK;
    }
    float *h = malloc(nb ? nb : 1);
    TDM_REQUIRE(h, TDM_STATUS_OUT_OF_MEMORY, "tp: dropout cannot stage %zu bytes", nb);
    tdm_status st = tdm_dev_copy_to_host(p->dev, h, src, nb);
    if (!st) {
        tdm_model_drop_cols(p->drop_keys, q->op, q->p, B, j0, w, h, h);
        st = tdm_dev_copy_from_host(p->dev, dst, h, nb);
    }
    free(h);
    return st;
}

tdm_status tdm_tp_post_forward(tdm_tp *p, int slot, int B, int w, int64_t j0, int train,
                               const float **cur)
{
    for (int k = 0; k < p->shape.n_post[slot]; k++) {
        const tdm_tp_post *q = &p->shape.post[slot][k];
        float *out = q->out ? q->out : (float *)*cur;
        if (q->kind == TDM_MODEL_OP_DROPOUT)
            TDM_CHECK(tdm_tp_drop(p, q, B, w, j0, train, *cur, out));
        else
            TDM_CHECK(tdm_dev_act_fwd(p->dev, q->act, *cur, out, (int64_t)B * w));
        *cur = out;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_post_backward(tdm_tp *p, int slot, int B, int w, int64_t j0,
                                const float *in0, float *dout)
{
    for (int k = p->shape.n_post[slot] - 1; k >= 0; k--) {
        const tdm_tp_post *q = &p->shape.post[slot][k];
        const float *in = k ? p->shape.post[slot][k - 1].out : in0;
        if (q->kind == TDM_MODEL_OP_DROPOUT)
            TDM_CHECK(tdm_tp_drop(p, q, B, w, j0, 1, dout, dout));
        else
            TDM_CHECK(tdm_dev_act_bwd(p->dev, q->act, in, q->out, dout, dout, (int64_t)B * w));
    }
    return TDM_STATUS_OK;
}

int64_t tdm_tp_train_forwards(const tdm_tp *p) { return p->n_train_fwd; }
void tdm_tp_set_train_forwards(tdm_tp *p, int64_t n) { p->n_train_fwd = n; }

tdm_status tdm_tp_drop_keys(tdm_tp *p, const void *x, int B)
{
    if (!p->shape.dropout) return TDM_STATUS_OK;
    tdm_model_drop_keys_host(p->seed, p->n_train_fwd, x,
                             (size_t)p->shape.dims[0] * sizeof(float), B, p->drop_keys);
    p->n_train_fwd++;
    return TDM_STATUS_OK;
}
