/* models/builder.c: the C builder of layer-list models (models/builder.h):
 * the ops of a SEQ spec with their shapes inferred one by one, and the
 * model's layers and tensors built from them (tdm_seq_build, called by
 * models/model.c). Not here: the model file's text (models/model_file.c),
 * the new layers' math (models/layers_seq.c). */
#include "models/builder.h"

#include <stdio.h>
#include <string.h>

#include "models/model_impl.h"

static const char *const tdm_op_names[] = {
    [TDM_MODEL_OP_LINEAR] = "linear",   [TDM_MODEL_OP_CONV] = "conv",
    [TDM_MODEL_OP_BATCHNORM] = "batchnorm", [TDM_MODEL_OP_RELU] = "relu",
    [TDM_MODEL_OP_GELU] = "gelu",       [TDM_MODEL_OP_TANH] = "tanh",
    [TDM_MODEL_OP_SIGMOID] = "sigmoid", [TDM_MODEL_OP_MAXPOOL] = "maxpool",
    [TDM_MODEL_OP_AVGPOOL] = "avgpool", [TDM_MODEL_OP_FLATTEN] = "flatten",
    [TDM_MODEL_OP_RES_OPEN] = "residual {", [TDM_MODEL_OP_RES_CLOSE] = "}",
    [TDM_MODEL_OP_DROPOUT] = "dropout", [TDM_MODEL_OP_EMBEDDING] = "embedding",
    [TDM_MODEL_OP_POS_EMBEDDING] = "embedding positions",
    [TDM_MODEL_OP_LAYERNORM] = "layernorm", [TDM_MODEL_OP_ATTENTION] = "attention",
    [TDM_MODEL_OP_GPT_MLP] = "gptmlp",  [TDM_MODEL_OP_LM_HEAD] = "lmhead",
};

const char *tdm_model_op_name(tdm_model_op_kind kind)
{
    if ((unsigned)kind < sizeof tdm_op_names / sizeof tdm_op_names[0] && tdm_op_names[kind])
        return tdm_op_names[kind];
    return "?";
}

/* ---- the spec: ops and their shapes ---- */

void tdm_seq_shape_str(const tdm_seq_shape *sh, char *buf, size_t len)
{
    if (sh->seq == TDM_MODEL_SEQ_TOKENS) snprintf(buf, len, "%d tokens", sh->w);
    else if (sh->seq == TDM_MODEL_SEQ_ROWS)
        snprintf(buf, len, "%dx%d (positions x features)", sh->h, sh->w);
    else if (sh->flat) snprintf(buf, len, "%d features", sh->w);
    else snprintf(buf, len, "%dx%dx%d", sh->c, sh->h, sh->w);
}

tdm_seq_shape tdm_seq_cur(const tdm_model_spec *s)
{
    if (s->n_ops == 0)
        return (tdm_seq_shape){.c = s->in_c, .h = s->in_h, .w = s->in_w, .flat = s->in_flat,
                               .seq = s->in_tokens ? TDM_MODEL_SEQ_TOKENS : 0};
    const tdm_model_op *o = &s->ops[s->n_ops - 1];
    return (tdm_seq_shape){.c = o->c, .h = o->h, .w = o->w, .flat = o->flat, .seq = o->seq};
}

tdm_status tdm_seq_start(tdm_model_spec *s, int c, int h, int w, int flat)
{
    memset(s, 0, sizeof *s);
    s->kind = TDM_MODEL_SEQ;
    TDM_REQUIRE(c >= 1 && h >= 1 && w >= 1 && c <= TDM_MODEL_SEQ_MAX_DIM &&
                    h <= TDM_MODEL_SEQ_MAX_DIM && w <= TDM_MODEL_SEQ_MAX_DIM &&
                    (int64_t)c * h * w <= TDM_MODEL_SEQ_MAX_ELEMS,
                TDM_STATUS_INVALID_ARG,
                "model input %dx%dx%d: each size must be in [1, %d] and the sample at most "
                "%lld elements", c, h, w, TDM_MODEL_SEQ_MAX_DIM,
                (long long)TDM_MODEL_SEQ_MAX_ELEMS);
    s->in_c = c;
    s->in_h = h;
    s->in_w = w;
    s->in_flat = flat;
    snprintf(s->name, sizeof s->name, "seq");
    return TDM_STATUS_OK;
}

tdm_status tdm_model_seq_init(tdm_model_spec *s, int c, int h, int w)
{
    return tdm_seq_start(s, c, h, w, 0);
}

tdm_status tdm_model_seq_init_flat(tdm_model_spec *s, int features)
{
    return tdm_seq_start(s, 1, 1, features, 1);
}

/* The stride of a 1x1 convolution that maps a bh x bw plane onto h x w
 * (a plane of n maps to (n - 1) / stride + 1), 0 when none does. */
static int tdm_seq_proj_stride(int bh, int bw, int h, int w)
{
    for (int st = 1; st <= bh && st <= bw; st++)
        if ((bh - 1) / st + 1 == h && (bw - 1) / st + 1 == w) return st;
    return 0;
}

/* The shape after op o on shape in, or an error naming both. */
static tdm_status tdm_seq_infer(const tdm_model_spec *s, const tdm_model_op *o,
                                const tdm_seq_shape *in, tdm_seq_shape *out)
{
    char sh[48];
    const char *name = tdm_model_op_name(o->kind);
    tdm_seq_shape_str(in, sh, sizeof sh);
    *out = *in;
    if (tdm_seq_op_is_gpt(o->kind) ||
        (in->seq && o->kind != TDM_MODEL_OP_RES_OPEN && o->kind != TDM_MODEL_OP_RES_CLOSE))
        return tdm_seq_infer_gpt(s, o, in, out);
    switch (o->kind) {
    case TDM_MODEL_OP_LINEAR:
        TDM_REQUIRE(in->flat, TDM_STATUS_INVALID_ARG,
                    "linear needs features, got an image of %s (add `flatten` before it)", sh);
        TDM_REQUIRE(o->n >= 1 && o->n <= TDM_MODEL_SEQ_MAX_DIM, TDM_STATUS_INVALID_ARG,
                    "linear: %d output features (expected 1..%d)", o->n, TDM_MODEL_SEQ_MAX_DIM);
        TDM_REQUIRE((int64_t)in->w * o->n <= TDM_MODEL_SEQ_MAX_ELEMS, TDM_STATUS_INVALID_ARG,
                    "linear: a %d x %d weight is more than %lld elements", o->n, in->w,
                    (long long)TDM_MODEL_SEQ_MAX_ELEMS);
        out->w = o->n;
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_CONV: {
        TDM_REQUIRE(!in->flat, TDM_STATUS_INVALID_ARG, "conv needs an image, got %s", sh);
        TDM_REQUIRE(o->n >= 1 && o->n <= TDM_MODEL_SEQ_MAX_DIM && o->k >= 1 && o->k <= 64 &&
                        o->stride >= 1 && o->stride <= 64 && o->pad >= 0 && o->pad < o->k,
                    TDM_STATUS_INVALID_ARG,
                    "conv: %d channels, kernel %d, stride %d, pad %d (expected channels "
                    "1..%d, kernel 1..64, stride 1..64, pad 0..kernel-1)",
                    o->n, o->k, o->stride, o->pad, TDM_MODEL_SEQ_MAX_DIM);
        int64_t hp = (int64_t)in->h + 2 * o->pad, wp = (int64_t)in->w + 2 * o->pad;
        TDM_REQUIRE(hp >= o->k && wp >= o->k, TDM_STATUS_INVALID_ARG,
                    "conv %dx%d pad %d does not fit an input of %s", o->k, o->k, o->pad, sh);
        out->c = o->n;
        out->h = (int)((hp - o->k) / o->stride + 1);
        out->w = (int)((wp - o->k) / o->stride + 1);
        TDM_REQUIRE((int64_t)in->c * o->k * o->k * o->n <= TDM_MODEL_SEQ_MAX_ELEMS &&
                        (int64_t)out->c * out->h * out->w <= TDM_MODEL_SEQ_MAX_ELEMS,
                    TDM_STATUS_INVALID_ARG, "conv: more than %lld elements in a sample or weight",
                    (long long)TDM_MODEL_SEQ_MAX_ELEMS);
        return TDM_STATUS_OK;
    }
    case TDM_MODEL_OP_BATCHNORM:
        TDM_REQUIRE(!in->flat, TDM_STATUS_INVALID_ARG,
                    "batchnorm normalises the channels of an image, got %s", sh);
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_RELU:
    case TDM_MODEL_OP_GELU:
    case TDM_MODEL_OP_TANH:
    case TDM_MODEL_OP_SIGMOID:
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_DROPOUT:
        TDM_REQUIRE(o->p >= 0.0f && o->p < 1.0f, TDM_STATUS_INVALID_ARG,
                    "dropout: probability %g (expected 0 <= p < 1)", (double)o->p);
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_MAXPOOL:
    case TDM_MODEL_OP_AVGPOOL:
        TDM_REQUIRE(!in->flat, TDM_STATUS_INVALID_ARG, "%s needs an image, got %s", name, sh);
        TDM_REQUIRE(o->k >= 1 && o->kw >= 1 && o->k <= in->h && o->kw <= in->w,
                    TDM_STATUS_INVALID_ARG, "%s: a %dx%d window does not fit an input of %s",
                    name, o->k, o->kw, sh);
        out->h = (in->h - o->k) / o->stride + 1;
        out->w = (in->w - o->kw) / o->stride + 1;
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_FLATTEN:
        out->flat = 1;
        out->w = (int)((int64_t)in->c * in->h * in->w);
        out->c = out->h = 1;
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_RES_OPEN:
        TDM_REQUIRE(s->n_open < TDM_MODEL_MAX_NEST, TDM_STATUS_INVALID_ARG,
                    "more than %d residual blocks open at once", TDM_MODEL_MAX_NEST);
        return TDM_STATUS_OK;
    case TDM_MODEL_OP_RES_CLOSE: {
        TDM_REQUIRE(s->n_open > 0, TDM_STATUS_INVALID_ARG,
                    "`}` closes no residual block (unbalanced braces)");
        int at = s->open[s->n_open - 1];
        TDM_REQUIRE(at < s->n_ops - 1, TDM_STATUS_INVALID_ARG, "empty residual block");
        const tdm_model_op *op = &s->ops[at];
        tdm_seq_shape bin = {.c = op->c, .h = op->h, .w = op->w, .flat = op->flat,
                             .seq = op->seq};
        char bs[48];
        tdm_seq_shape_str(&bin, bs, sizeof bs);
        if (!o->proj) {
            TDM_REQUIRE(bin.flat == in->flat && bin.seq == in->seq && bin.c == in->c &&
                            bin.h == in->h && bin.w == in->w, TDM_STATUS_INVALID_ARG,
                        "residual block: its input is %s but its output %s (close it with "
                        "`} proj` to add the input through a projection)", bs, sh);
            return TDM_STATUS_OK;
        }
        TDM_REQUIRE(bin.flat == in->flat && !in->seq, TDM_STATUS_INVALID_ARG,
                    "residual block: a projection maps images to images or features to "
                    "features, not %s to %s", bs, sh);
        TDM_REQUIRE(in->flat || tdm_seq_proj_stride(bin.h, bin.w, in->h, in->w) > 0,
                    TDM_STATUS_INVALID_ARG,
                    "residual block: no 1x1 convolution stride maps its input %s onto its "
                    "output %s", bs, sh);
        return TDM_STATUS_OK;
    }
    default:
        break;
    }
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "unknown layer kind %d", (int)o->kind);
}

tdm_status tdm_model_seq_add(tdm_model_spec *s, const tdm_model_op *op)
{
    TDM_REQUIRE(s && op && s->kind == TDM_MODEL_SEQ, TDM_STATUS_INVALID_ARG,
                "model builder: not a builder spec (start with tdm_model_seq_init)");
    TDM_REQUIRE(s->n_ops < TDM_MODEL_MAX_OPS, TDM_STATUS_INVALID_ARG,
                "model has more than %d layers", TDM_MODEL_MAX_OPS);
    tdm_model_op o = *op;
    if (s->in_tokens) TDM_CHECK(tdm_seq_gpt_next(s, &o));
    if (o.kind == TDM_MODEL_OP_MAXPOOL || o.kind == TDM_MODEL_OP_AVGPOOL) {
        if (o.kw == 0) o.kw = o.k;
        o.stride = o.k;
    }
    tdm_seq_shape in = tdm_seq_cur(s), out;
    TDM_CHECK(tdm_seq_infer(s, &o, &in, &out));
    o.c = out.c;
    o.h = out.h;
    o.w = out.w;
    o.flat = out.flat;
    o.seq = out.seq;
    if (o.kind == TDM_MODEL_OP_RES_CLOSE) s->n_open--;
    s->ops[s->n_ops] = o;
    if (o.kind == TDM_MODEL_OP_RES_OPEN) s->open[s->n_open++] = s->n_ops;
    s->n_ops++;
    if (out.flat) s->n_classes = out.w;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_seq_linear(tdm_model_spec *s, int out_features)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_LINEAR, .n = out_features});
}

tdm_status tdm_model_seq_conv(tdm_model_spec *s, int out_channels, int k, int stride, int pad)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_CONV, .n = out_channels,
                                                .k = k, .stride = stride, .pad = pad});
}

tdm_status tdm_model_seq_batchnorm(tdm_model_spec *s)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_BATCHNORM});
}

tdm_status tdm_model_seq_act(tdm_model_spec *s, tdm_model_op_kind kind)
{
    TDM_REQUIRE(kind == TDM_MODEL_OP_RELU || kind == TDM_MODEL_OP_GELU ||
                    kind == TDM_MODEL_OP_TANH || kind == TDM_MODEL_OP_SIGMOID,
                TDM_STATUS_INVALID_ARG, "model builder: %s is not an activation",
                tdm_model_op_name(kind));
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = kind});
}

tdm_status tdm_model_seq_pool(tdm_model_spec *s, tdm_model_op_kind kind, int k)
{
    TDM_REQUIRE(kind == TDM_MODEL_OP_MAXPOOL || kind == TDM_MODEL_OP_AVGPOOL,
                TDM_STATUS_INVALID_ARG, "model builder: %s is not a pooling",
                tdm_model_op_name(kind));
    TDM_REQUIRE(k >= 1, TDM_STATUS_INVALID_ARG, "%s: window %d (expected >= 1)",
                tdm_model_op_name(kind), k);
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = kind, .k = k, .kw = k});
}

tdm_status tdm_model_seq_avgpool_global(tdm_model_spec *s)
{
    TDM_REQUIRE(s && s->kind == TDM_MODEL_SEQ, TDM_STATUS_INVALID_ARG,
                "model builder: not a builder spec (start with tdm_model_seq_init)");
    tdm_seq_shape in = tdm_seq_cur(s);
    TDM_REQUIRE(!in.flat, TDM_STATUS_INVALID_ARG,
                "avgpool global needs an image, got %d features", in.w);
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_AVGPOOL, .k = in.h,
                                                .kw = in.w});
}

tdm_status tdm_model_seq_dropout(tdm_model_spec *s, float p)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_DROPOUT, .p = p});
}

tdm_status tdm_model_seq_flatten(tdm_model_spec *s)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_FLATTEN});
}

tdm_status tdm_model_seq_residual_open(tdm_model_spec *s)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_RES_OPEN});
}

tdm_status tdm_model_seq_residual_close(tdm_model_spec *s, int proj)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_RES_CLOSE, .proj = proj != 0});
}

tdm_status tdm_model_seq_finish(tdm_model_spec *s)
{
    TDM_REQUIRE(s && s->kind == TDM_MODEL_SEQ, TDM_STATUS_INVALID_ARG,
                "model builder: not a builder spec (start with tdm_model_seq_init)");
    if (s->in_tokens && s->n_open == 0) return tdm_seq_gpt_finish(s);
    if (s->n_open > 0) {
        const tdm_model_op *o = &s->ops[s->open[s->n_open - 1]];
        if (o->line)
            return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                 "the residual block opened on line %d is never closed "
                                 "(unbalanced braces)", o->line);
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "%d residual block(s) never closed", s->n_open);
    }
    int params = 0;
    for (int i = 0; i < s->n_ops; i++) {
        tdm_model_op_kind k = s->ops[i].kind;
        params |= k == TDM_MODEL_OP_LINEAR || k == TDM_MODEL_OP_CONV ||
                  k == TDM_MODEL_OP_BATCHNORM || k == TDM_MODEL_OP_LAYERNORM || (k == TDM_MODEL_OP_RES_CLOSE && s->ops[i].proj);
    }
    TDM_REQUIRE(params, TDM_STATUS_INVALID_ARG, "the model has no layer with parameters");
    tdm_seq_shape out = tdm_seq_cur(s);
    char sh[48];
    tdm_seq_shape_str(&out, sh, sizeof sh);
    TDM_REQUIRE(out.flat && out.w >= 2, TDM_STATUS_INVALID_ARG,
                "the model's output is %s: it must be a vector of at least 2 class scores "
                "(end with `flatten` and `linear N`)", sh);
    s->n_classes = out.w;
    return TDM_STATUS_OK;
}

int tdm_model_spec_lever_op(const tdm_model_spec *s)
{
    if (s->kind != TDM_MODEL_SEQ) return -1;
    for (int i = 0; i < s->n_ops; i++) {
        tdm_model_op_kind k = s->ops[i].kind;
        tdm_model_op_kind prev = i > 0 ? s->ops[i - 1].kind : TDM_MODEL_OP_RELU;
        int fused_relu = k == TDM_MODEL_OP_RELU &&
                         (prev == TDM_MODEL_OP_LINEAR || prev == TDM_MODEL_OP_BATCHNORM);
        if (k != TDM_MODEL_OP_LINEAR && k != TDM_MODEL_OP_CONV && k != TDM_MODEL_OP_BATCHNORM &&
            k != TDM_MODEL_OP_MAXPOOL && k != TDM_MODEL_OP_FLATTEN && !fused_relu)
            return i;
    }
    return -1;
}

void tdm_model_spec_lever_refusal(const tdm_model_spec *s, char *buf, size_t len)
{
    int i = tdm_model_spec_lever_op(s);
    if (i < 0) {
        snprintf(buf, len, "%s", "");
        return;
    }
    const tdm_model_op *o = &s->ops[i];
    char where[32] = "";
    if (o->line) snprintf(where, sizeof where, " (line %d)", o->line);
    snprintf(buf, len, "%s's `%s`%s runs in float32 with its activations kept: 16-bit "
             "precision and activation checkpointing take a model file of the built-in MLP's "
             "and CNN's layers (linear, conv, batchnorm, relu right after a linear or "
             "batchnorm, maxpool, flatten)", s->name, tdm_model_op_name(o->kind), where);
}

int tdm_model_spec_has_batchnorm(const tdm_model_spec *s)
{
    if (s->kind == TDM_MODEL_CNN) return 1;
    if (s->kind != TDM_MODEL_SEQ) return 0;
    for (int i = 0; i < s->n_ops; i++)
        if (s->ops[i].kind == TDM_MODEL_OP_BATCHNORM) return 1;
    return 0;
}

/* ---- the model's layers ---- */

typedef struct tdm_seq_counts {
    int fc, conv, bn, res, ln;
} tdm_seq_counts;

static tdm_layer *tdm_seq_layer(tdm_model *m, tdm_layer_kind kind, const tdm_seq_shape *in,
                                const tdm_seq_shape *out)
{
    tdm_layer *l = tdm_model_add_layer(m, kind);
    l->c = in->c;
    l->h = in->h;
    l->w = in->w;
    l->oc = out->c;
    l->oh = out->h;
    l->ow = out->w;
    l->in_elems = (int64_t)in->c * in->h * in->w;
    l->out_elems = (int64_t)out->c * out->h * out->w;
    l->skip = -1;
    return l;
}

static tdm_status tdm_seq_param(tdm_model *m, int buffer, const char *pre, int idx,
                                const char *what, int ndim, const int64_t *shape)
{
    char name[TDM_MODEL_NAME_MAX];
    snprintf(name, sizeof name, "%s%d.%s", pre, idx, what);
    return tdm_model_add_tensor(m, buffer, m->n_layers - 1, name, ndim, shape);
}

/* Images move between layers in CNHW (channel-major: a batch is one gemm
 * and batchnorm's rows are contiguous); the model's input is NCHW, the
 * same bytes when C = 1. The first image layer past the input reorders
 * it once. */
static tdm_status tdm_seq_need_cnhw(tdm_model *m, const tdm_seq_shape *sh, int *cnhw)
{
    if (*cnhw || sh->flat) return TDM_STATUS_OK;
    *cnhw = 1;
    if (sh->c == 1) return TDM_STATUS_OK;
    TDM_REQUIRE(m->n_layers < TDM_MODEL_MAX_LAYERS, TDM_STATUS_INVALID_ARG,
                "model has more than %d layers", TDM_MODEL_MAX_LAYERS);
    tdm_seq_layer(m, TDM_LAYER_TO_CNHW, sh, sh);
    return TDM_STATUS_OK;
}

tdm_status tdm_seq_build(tdm_model *m)
{
    const tdm_model_spec *s = &m->spec;
    TDM_REQUIRE(s->n_ops >= 1 && s->n_ops <= TDM_MODEL_MAX_OPS && s->n_open == 0,
                TDM_STATUS_INVALID_ARG,
                "model: an unfinished builder spec (%d layers, %d blocks open): call "
                "tdm_model_seq_finish", s->n_ops, s->n_open);
    tdm_seq_counts n = {0};
    tdm_seq_shape cur = {.c = s->in_c, .h = s->in_h, .w = s->in_w, .flat = s->in_flat};
    int cnhw = s->in_flat, fuse = -1;     /* fuse: a linear or batchnorm a relu may join */
    int open[TDM_MODEL_MAX_NEST], open_line[TDM_MODEL_MAX_NEST], n_open = 0;
    tdm_seq_shape open_sh[TDM_MODEL_MAX_NEST];
    for (int i = 0; i < s->n_ops; i++) {
        const tdm_model_op *o = &s->ops[i];
        tdm_seq_shape out = {.c = o->c, .h = o->h, .w = o->w, .flat = o->flat};
        TDM_REQUIRE(m->n_layers + 2 < TDM_MODEL_MAX_LAYERS, TDM_STATUS_INVALID_ARG,
                    "model has more than %d layers", TDM_MODEL_MAX_LAYERS);
        int li = m->n_layers, first_new = m->n_layers, next_fuse = -1;
        tdm_layer *l;
        switch (o->kind) {
        case TDM_MODEL_OP_LINEAR:
            l = tdm_seq_layer(m, TDM_LAYER_LINEAR, &cur, &out);
            l->c = cur.w;
            l->oc = out.w;
            n.fc++;
            TDM_CHECK(tdm_seq_param(m, 0, "fc", n.fc, "weight", 2, (int64_t[]){out.w, cur.w}));
            TDM_CHECK(tdm_seq_param(m, 0, "fc", n.fc, "bias", 1, (int64_t[]){out.w}));
            l->np = 2;
            next_fuse = li;
            break;
        case TDM_MODEL_OP_CONV:
            TDM_CHECK(tdm_seq_need_cnhw(m, &cur, &cnhw));
            l = tdm_seq_layer(m, TDM_LAYER_CONV, &cur, &out);
            l->k = o->k;
            l->stride = o->stride;
            l->pad = o->pad;
            n.conv++;
            TDM_CHECK(tdm_seq_param(m, 0, "conv", n.conv, "weight", 4,
                                    (int64_t[]){out.c, cur.c, o->k, o->k}));
            l->np = 1;
            break;
        case TDM_MODEL_OP_BATCHNORM:
            TDM_CHECK(tdm_seq_need_cnhw(m, &cur, &cnhw));
            l = tdm_seq_layer(m, TDM_LAYER_BN, &cur, &out);
            li = m->n_layers - 1;
            n.bn++;
            TDM_CHECK(tdm_seq_param(m, 0, "bn", n.bn, "weight", 1, (int64_t[]){cur.c}));
            TDM_CHECK(tdm_seq_param(m, 0, "bn", n.bn, "bias", 1, (int64_t[]){cur.c}));
            TDM_CHECK(tdm_seq_param(m, 1, "bn", n.bn, "running_mean", 1, (int64_t[]){cur.c}));
            TDM_CHECK(tdm_seq_param(m, 1, "bn", n.bn, "running_var", 1, (int64_t[]){cur.c}));
            l->np = 2;
            l->nb = 2;
            next_fuse = li;
            break;
        case TDM_MODEL_OP_RELU:
            /* joins the linear or batchnorm just before it (the built-in
             * models' fused relu, the same bits), unless a residual block
             * opened or closed in between (its input is the unfused output) */
            if (fuse >= 0 && !m->layers[fuse].relu) {
                m->layers[fuse].relu = 1;
                break;
            }
            /* fall through */
        case TDM_MODEL_OP_GELU:
        case TDM_MODEL_OP_TANH:
        case TDM_MODEL_OP_SIGMOID:
            l = tdm_seq_layer(m, TDM_LAYER_ACT, &cur, &out);
            l->act = o->kind == TDM_MODEL_OP_RELU   ? TDM_ACT_RELU
                     : o->kind == TDM_MODEL_OP_GELU ? TDM_ACT_GELU
                     : o->kind == TDM_MODEL_OP_TANH ? TDM_ACT_TANH
                                                    : TDM_ACT_SIGMOID;
            break;
        case TDM_MODEL_OP_LAYERNORM:
            /* features only (the builder checked): (B, c) rows */
            l = tdm_seq_layer(m, TDM_LAYER_LN, &cur, &out);
            l->c = l->oc = cur.w;
            l->h = l->w = l->oh = l->ow = 1;
            n.ln++;
            TDM_CHECK(tdm_seq_param(m, 0, "ln", n.ln, "weight", 1, (int64_t[]){cur.w}));
            TDM_CHECK(tdm_seq_param(m, 0, "ln", n.ln, "bias", 1, (int64_t[]){cur.w}));
            l->np = 2;
            break;
        case TDM_MODEL_OP_MAXPOOL:
        case TDM_MODEL_OP_AVGPOOL:
            TDM_CHECK(tdm_seq_need_cnhw(m, &cur, &cnhw));
            l = tdm_seq_layer(m, o->kind == TDM_MODEL_OP_MAXPOOL ? TDM_LAYER_MAXPOOL
                                                                 : TDM_LAYER_AVGPOOL,
                              &cur, &out);
            l->k = o->k;
            l->kw = o->kw;
            l->stride = o->stride;
            break;
        case TDM_MODEL_OP_DROPOUT:
            /* its mask indexes each sample's values in (C, H, W) order,
             * whatever the layout: the element's channel and plane */
            TDM_CHECK(tdm_seq_need_cnhw(m, &cur, &cnhw));
            l = tdm_seq_layer(m, TDM_LAYER_DROPOUT, &cur, &out);
            if (cur.flat) {
                l->c = l->oc = 1;
                l->h = l->oh = 1;
            }
            l->p = o->p;
            l->op = i;
            break;
        case TDM_MODEL_OP_FLATTEN:
            /* CNHW back to each sample's (C, H, W) order; an input never
             * reordered, or a single channel, is that order already */
            if (!cur.flat && cnhw && cur.c > 1) {
                l = tdm_seq_layer(m, TDM_LAYER_FLATTEN, &cur, &cur);
            }
            cnhw = 1;
            break;
        case TDM_MODEL_OP_RES_OPEN:
            TDM_CHECK(tdm_seq_need_cnhw(m, &cur, &cnhw));
            open_sh[n_open] = cur;
            open_line[n_open] = o->line;
            open[n_open++] = m->n_layers - 1;
            break;
        case TDM_MODEL_OP_RES_CLOSE: {
            TDM_REQUIRE(n_open > 0, TDM_STATUS_INVALID_ARG, "model: unbalanced residual block");
            tdm_seq_shape bin = open_sh[--n_open];
            TDM_REQUIRE(open[n_open] < m->n_layers - 1, TDM_STATUS_INVALID_ARG,
                        "model: a residual block with no layer inside");
            l = tdm_seq_layer(m, TDM_LAYER_RES, &bin, &out);
            l->skip = open[n_open];
            l->skip_elems = l->in_elems;
            l->in_elems = l->out_elems;
            l->proj = o->proj;
            n.res++;
            if (o->proj && !out.flat) {
                l->k = 1;
                l->pad = 0;
                l->stride = tdm_seq_proj_stride(bin.h, bin.w, out.h, out.w);
                TDM_CHECK(tdm_seq_param(m, 0, "res", n.res, "proj.weight", 4,
                                        (int64_t[]){out.c, bin.c, 1, 1}));
                l->np = 1;
            } else if (o->proj) {
                l->c = bin.w;
                l->oc = out.w;
                TDM_CHECK(tdm_seq_param(m, 0, "res", n.res, "proj.weight", 2,
                                        (int64_t[]){out.w, bin.w}));
                TDM_CHECK(tdm_seq_param(m, 0, "res", n.res, "proj.bias", 1, (int64_t[]){out.w}));
                l->np = 2;
            }
            break;
        }
        default:   /* the GPT's layers: a finished spec of them is a TDM_MODEL_GPT */
            return tdm_error_set(TDM_STATUS_INVALID_ARG, "model: %s outside a model of tokens",
                                 tdm_model_op_name(o->kind));
        }
        for (int j = first_new; j < m->n_layers; j++) {
            m->layers[j].line = o->kind == TDM_MODEL_OP_RES_CLOSE ? open_line[n_open] : o->line;
            m->layers[j].op = i;
        }
        fuse = next_fuse;
        cur = out;
    }
    TDM_REQUIRE(m->n_layers >= 1 && cur.flat, TDM_STATUS_INVALID_ARG,
                "model: its output is not a vector of class scores");
    return TDM_STATUS_OK;
}
