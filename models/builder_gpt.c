/* models/builder_gpt.c: the GPT's layers in the C builder and model files
 * (models/builder.h): a token input, the token and position embeddings,
 * layernorm, causal self-attention, the GPT's MLP and the output head,
 * with their shapes inferred one by one. A model that reads tokens is
 * the GPT's pre-LayerNorm arrangement, checked op by op as it is added
 * (each error names what may come next), and a finished one becomes the
 * TDM_MODEL_GPT spec it describes: it runs models/gpt.c's forward and
 * backward, tensor names and initialisation, so it trains bitwise as
 * `--model gpt:L-D-H-T` (and takes every design and memory lever the
 * built-in GPT takes). Not here: the other layers (models/builder.c),
 * the file's text (models/model_file.c). */
#include "models/builder.h"

#include <stdio.h>
#include <string.h>

#include "models/gpt.h"
#include "models/model_impl.h"

/* The GPT's limits (models/gpt.c's spec parser): context, width, heads. */
#define TDM_SEQ_GPT_MAX_CTX (1 << 16)
#define TDM_SEQ_GPT_MAX_WIDTH (1 << 16)
#define TDM_SEQ_GPT_MAX_HEADS (1 << 12)
/* The MLP's hidden width is this many times the model's. */
#define TDM_SEQ_GPT_MLP_RATIO 4

int tdm_seq_op_is_gpt(tdm_model_op_kind kind)
{
    return kind == TDM_MODEL_OP_EMBEDDING || kind == TDM_MODEL_OP_POS_EMBEDDING ||
           kind == TDM_MODEL_OP_LAYERNORM || kind == TDM_MODEL_OP_ATTENTION ||
           kind == TDM_MODEL_OP_GPT_MLP || kind == TDM_MODEL_OP_LM_HEAD;
}

static int tdm_seq_count(const tdm_model_spec *s, tdm_model_op_kind kind)
{
    int n = 0;
    for (int i = 0; i < s->n_ops; i++) n += s->ops[i].kind == kind;
    return n;
}

/* The first op of a kind, NULL when none. */
static const tdm_model_op *tdm_seq_first(const tdm_model_spec *s, tdm_model_op_kind kind)
{
    for (int i = 0; i < s->n_ops; i++)
        if (s->ops[i].kind == kind) return &s->ops[i];
    return NULL;
}

tdm_status tdm_seq_infer_gpt(const tdm_model_spec *s, const tdm_model_op *o,
                             const tdm_seq_shape *in, tdm_seq_shape *out)
{
    char sh[64];
    const char *name = tdm_model_op_name(o->kind);
    tdm_seq_shape_str(in, sh, sizeof sh);
    *out = *in;
    if (!tdm_seq_op_is_gpt(o->kind))
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "%s does not take %s (a token model's layers are embedding, "
                             "layernorm, attention, gptmlp, lmhead and residual blocks)", name,
                             sh);
    if (o->kind == TDM_MODEL_OP_EMBEDDING) {
        TDM_REQUIRE(in->seq == TDM_MODEL_SEQ_TOKENS, TDM_STATUS_INVALID_ARG,
                    "embedding reads token ids, got %s (start the model with `input tokens T`)",
                    sh);
        TDM_REQUIRE(o->k > 0, TDM_STATUS_INVALID_ARG,
                    "embedding: no vocabulary (write `embedding vocab %d dim WIDTH`)",
                    TDM_GPT_VOCAB);
        TDM_REQUIRE(o->k == TDM_GPT_VOCAB, TDM_STATUS_INVALID_ARG,
                    "embedding: vocabulary %d, but tandem's token models read bytes: the "
                    "vocabulary is %d", o->k, TDM_GPT_VOCAB);
        TDM_REQUIRE(o->n >= 1 && o->n <= TDM_SEQ_GPT_MAX_WIDTH, TDM_STATUS_INVALID_ARG,
                    "embedding: width %d (expected 1..%d)", o->n, TDM_SEQ_GPT_MAX_WIDTH);
        out->seq = TDM_MODEL_SEQ_ROWS;
        out->c = 1;
        out->h = in->w;
        out->w = o->n;
        out->flat = 0;
        TDM_REQUIRE((int64_t)out->h * out->w * TDM_SEQ_GPT_MLP_RATIO <= TDM_MODEL_SEQ_MAX_ELEMS,
                    TDM_STATUS_INVALID_ARG,
                    "embedding: %d positions of width %d make more than %lld elements a "
                    "sample in the MLP", out->h, out->w, (long long)TDM_MODEL_SEQ_MAX_ELEMS);
        return TDM_STATUS_OK;
    }
    if (o->kind == TDM_MODEL_OP_LAYERNORM && !in->seq) {
        /* a model of images or features: each sample's vector */
        TDM_REQUIRE(in->flat, TDM_STATUS_INVALID_ARG,
                    "layernorm normalises a vector of features (or a token model's rows), got "
                    "an image of %s (add `flatten` before it)", sh);
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(in->seq == TDM_MODEL_SEQ_ROWS, TDM_STATUS_INVALID_ARG,
                "%s works on the (positions x features) rows of a token model, got %s (start "
                "the model with `input tokens T` and `embedding vocab %d dim WIDTH`)", name, sh,
                TDM_GPT_VOCAB);
    int T = in->h, C = in->w;
    switch (o->kind) {
    case TDM_MODEL_OP_ATTENTION: {
        TDM_REQUIRE(o->n >= 1 && o->n <= TDM_SEQ_GPT_MAX_HEADS, TDM_STATUS_INVALID_ARG,
                    "attention: %d heads (expected 1..%d)", o->n, TDM_SEQ_GPT_MAX_HEADS);
        TDM_REQUIRE(C % o->n == 0, TDM_STATUS_INVALID_ARG,
                    "attention: %d heads do not divide the width %d (each head gets "
                    "width/heads features: pick heads that divide it)", o->n, C);
        const tdm_model_op *first = tdm_seq_first(s, TDM_MODEL_OP_ATTENTION);
        TDM_REQUIRE(!first || first->n == o->n, TDM_STATUS_INVALID_ARG,
                    "attention: %d heads, but the first block's (line %d) has %d: every block "
                    "has the same heads", o->n, first ? first->line : 0, first ? first->n : 0);
        TDM_REQUIRE((int64_t)o->n * T * T <= TDM_MODEL_SEQ_MAX_ELEMS, TDM_STATUS_INVALID_ARG,
                    "attention: %d heads over %d positions make more than %lld scores a sample",
                    o->n, T, (long long)TDM_MODEL_SEQ_MAX_ELEMS);
        return TDM_STATUS_OK;
    }
    case TDM_MODEL_OP_LM_HEAD:
        out->w = TDM_GPT_VOCAB;
        return TDM_STATUS_OK;
    default:
        return TDM_STATUS_OK;   /* positions, layernorm, gptmlp keep the shape */
    }
}

/* What may follow the ops so far in the GPT's arrangement: up to two
 * kinds (-1: none), and their words. */
static void tdm_seq_gpt_expect(const tdm_model_spec *s, int *k1, int *k2, const char **what)
{
    int prev = s->n_ops ? (int)s->ops[s->n_ops - 1].kind : -1;
    int odd = tdm_seq_count(s, TDM_MODEL_OP_RES_CLOSE) % 2;
    *k1 = *k2 = -1;
    switch (prev) {
    case -1:
        *k1 = TDM_MODEL_OP_EMBEDDING;
        *what = "the token embedding `embedding vocab 256 dim WIDTH`";
        return;
    case TDM_MODEL_OP_EMBEDDING:
        *k1 = TDM_MODEL_OP_POS_EMBEDDING;
        *what = "`embedding positions` (the learned positions)";
        return;
    case TDM_MODEL_OP_POS_EMBEDDING:
        *k1 = TDM_MODEL_OP_RES_OPEN;
        *what = "`residual {` (the first block's attention)";
        return;
    case TDM_MODEL_OP_RES_OPEN:
        *k1 = TDM_MODEL_OP_LAYERNORM;
        *what = "`layernorm` (each block normalises its input first)";
        return;
    case TDM_MODEL_OP_LAYERNORM:
        if (s->n_open == 0) {
            *k1 = TDM_MODEL_OP_LM_HEAD;
            *what = "`lmhead tied` or `lmhead` (the output head after the final layernorm)";
        } else if (!odd) {
            *k1 = TDM_MODEL_OP_ATTENTION;
            *what = "`attention heads H` (a block's first residual is its attention)";
        } else {
            *k1 = TDM_MODEL_OP_GPT_MLP;
            *what = "`gptmlp` (a block's second residual is its MLP)";
        }
        return;
    case TDM_MODEL_OP_ATTENTION:
    case TDM_MODEL_OP_GPT_MLP:
        *k1 = TDM_MODEL_OP_RES_CLOSE;
        *what = "`}` (the end of the residual)";
        return;
    case TDM_MODEL_OP_RES_CLOSE:
        *k1 = TDM_MODEL_OP_RES_OPEN;
        if (odd) {
            *what = "`residual {` (the block's MLP)";
        } else {
            *k2 = TDM_MODEL_OP_LAYERNORM;
            *what = "`residual {` (the next block) or `layernorm` (the final one)";
        }
        return;
    default:
        *what = "nothing: `lmhead` ends the model";
        return;
    }
}

tdm_status tdm_seq_gpt_next(const tdm_model_spec *s, const tdm_model_op *o)
{
    int k1, k2;
    const char *what = "";
    tdm_seq_gpt_expect(s, &k1, &k2, &what);
    if ((int)o->kind != k1 && (int)o->kind != k2)
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "a model of tokens is the GPT's arrangement (docs/MODELS.md): "
                             "expected %s here, not %s", what, tdm_model_op_name(o->kind));
    TDM_REQUIRE(o->kind != TDM_MODEL_OP_RES_CLOSE || !o->proj, TDM_STATUS_INVALID_ARG,
                "a transformer block keeps its width: close it with `}`, not `} proj`");
    return TDM_STATUS_OK;
}

tdm_status tdm_seq_gpt_finish(tdm_model_spec *s)
{
    const tdm_model_op *last = s->n_ops ? &s->ops[s->n_ops - 1] : NULL;
    if (!last || last->kind != TDM_MODEL_OP_LM_HEAD) {
        int k1, k2;
        const char *what = "";
        tdm_seq_gpt_expect(s, &k1, &k2, &what);
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "the model of tokens ends too early: expected %s (it ends with "
                             "`layernorm` and `lmhead tied` or `lmhead`)", what);
    }
    int L = tdm_seq_count(s, TDM_MODEL_OP_RES_CLOSE) / 2;
    TDM_REQUIRE(L >= 1 && L <= TDM_GPT_MAX_LAYERS, TDM_STATUS_INVALID_ARG,
                "the model has %d transformer blocks (expected 1..%d)", L, TDM_GPT_MAX_LAYERS);
    const tdm_model_op *emb = tdm_seq_first(s, TDM_MODEL_OP_EMBEDDING);
    const tdm_model_op *att = tdm_seq_first(s, TDM_MODEL_OP_ATTENTION);
    s->kind = TDM_MODEL_GPT;
    s->n_layer = L;
    s->n_embd = emb->n;
    s->n_head = att->n;
    s->n_ctx = s->in_w;
    s->vocab = emb->k;
    s->n_classes = emb->k;
    s->head_untied = last->proj;
    return TDM_STATUS_OK;
}

/* ---- the builder's calls ---- */

tdm_status tdm_model_seq_init_tokens(tdm_model_spec *s, int context)
{
    TDM_REQUIRE(s && context >= 1 && context <= TDM_SEQ_GPT_MAX_CTX, TDM_STATUS_INVALID_ARG,
                "model input: a context of %d tokens (expected 1..%d)", context,
                TDM_SEQ_GPT_MAX_CTX);
    TDM_CHECK(tdm_seq_start(s, 1, 1, context, 0));
    s->in_tokens = 1;
    return TDM_STATUS_OK;
}

tdm_status tdm_model_seq_embedding(tdm_model_spec *s, int vocab, int width)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_EMBEDDING, .k = vocab,
                                                .n = width});
}

tdm_status tdm_model_seq_pos_embedding(tdm_model_spec *s)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_POS_EMBEDDING});
}

tdm_status tdm_model_seq_layernorm(tdm_model_spec *s)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_LAYERNORM});
}

tdm_status tdm_model_seq_attention(tdm_model_spec *s, int heads)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_ATTENTION, .n = heads});
}

tdm_status tdm_model_seq_gptmlp(tdm_model_spec *s)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_GPT_MLP});
}

tdm_status tdm_model_seq_lmhead(tdm_model_spec *s, int tied)
{
    return tdm_model_seq_add(s, &(tdm_model_op){.kind = TDM_MODEL_OP_LM_HEAD, .proj = !tied});
}
