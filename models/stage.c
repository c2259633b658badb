/* models/stage.c: pipeline layers of a spec, stage models (the MLP's and
 * CNN's crop of the whole model's tables; the GPT builds its own stage in
 * models/gpt.c), where a stage sits in the whole model's tables, and
 * activation sets. See models/stage.h. Not a pipeline: nothing here
 * sends, schedules or knows of ranks. */
#include "models/model_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/builder.h"
#include "models/gpt.h"

/* ---- the whole model's tables, without storage ---- */

static tdm_status tdm_stage_full_tables(const tdm_model_spec *spec, tdm_model **out)
{
    *out = NULL;
    tdm_model *m = calloc(1, sizeof *m);
    TDM_REQUIRE(m, TDM_STATUS_OUT_OF_MEMORY, "model: cannot allocate a table");
    m->spec = *spec;
    m->stage = (tdm_model_stage){.lo = 0, .hi = 1 << 20, .n = 1 << 20, .tied = -1,
                                 .tied_source = -1};
    if (spec->kind == TDM_MODEL_GPT) m->stage.hi = m->stage.n = spec->n_layer + 2;
    tdm_status st = tdm_model_build_tables(m);
    if (st != TDM_STATUS_OK) {
        if (m->vt) m->vt->free_ext(m);
        free(m);
        return st;
    }
    *out = m;
    return TDM_STATUS_OK;
}

static void tdm_stage_tables_free(tdm_model *m)
{
    if (!m) return;
    if (m->vt) m->vt->free_ext(m);
    free(m);
}

tdm_status tdm_model_spec_n_layers(const tdm_model_spec *s, int *n)
{
    TDM_REQUIRE(s && n, TDM_STATUS_INVALID_ARG, "model: NULL spec");
    if (s->kind == TDM_MODEL_GPT) {
        TDM_REQUIRE(s->n_layer >= 1 && s->n_layer <= TDM_GPT_MAX_LAYERS, TDM_STATUS_INVALID_ARG,
                    "gpt: %d blocks (1..%d)", s->n_layer, TDM_GPT_MAX_LAYERS);
        *n = s->n_layer + 2;
        return TDM_STATUS_OK;
    }
    tdm_model *t = NULL;
    TDM_CHECK(tdm_stage_full_tables(s, &t));
    *n = t->n_layers;
    tdm_stage_tables_free(t);
    return TDM_STATUS_OK;
}

/* A stage starting at layer `cut` of a whole model's table: 0 when
 * allowed, else the model file's line of the residual block the cut
 * falls in (a block's skip path stays inside one stage; a block whose
 * input is the stage's input is fine). */
static int tdm_stage_cut_line(const tdm_model *t, int cut)
{
    for (int r = cut; cut > 0 && r < t->n_layers; r++) {
        const tdm_layer *l = &t->layers[r];
        if (l->kind == TDM_LAYER_RES && l->skip < cut - 1) return l->line > 0 ? l->line : 1;
        /* a dropout mask is keyed on the model's input: the first stage's */
        if (l->kind == TDM_LAYER_DROPOUT) return l->line > 0 ? l->line : 1;
    }
    return 0;
}

tdm_status tdm_model_spec_check_stages(const tdm_model_spec *s)
{
    TDM_REQUIRE(s->kind != TDM_MODEL_GPT || !s->head_untied, TDM_STATUS_INVALID_ARG,
                "%s: a GPT with an untied head runs whole: it is not built for pipeline stages "
                "(write `lmhead tied`, or train it in single, dp, ddp or fsdp)", s->name);
    return TDM_STATUS_OK;
}

tdm_status tdm_model_spec_check_split(const tdm_model_spec *s, const int *first, int stages)
{
    if (s->kind != TDM_MODEL_SEQ) return TDM_STATUS_OK;
    tdm_model *t = NULL;
    TDM_CHECK(tdm_stage_full_tables(s, &t));
    int bad = 0, at = 0;
    for (int k = 1; k < stages && !bad; k++) bad = tdm_stage_cut_line(t, at = first[k]);
    tdm_stage_tables_free(t);
    TDM_REQUIRE(!bad, TDM_STATUS_INVALID_ARG,
                "pipeline: a stage starting at layer %d splits the residual block or comes before "
                "the dropout of %s line %d (a block stays within one stage; dropout stays in "
                "the first: pick another --split)", at, s->name, bad);
    return TDM_STATUS_OK;
}

/* Elements from tensor i to tensor j (exclusive) of a table: their
 * aligned sizes. */
static int64_t tdm_stage_span(const tdm_model *t, int i, int j)
{
    int64_t a = i < t->n_params ? t->params_info[i].offset : t->param_elems;
    int64_t b = j < t->n_params ? t->params_info[j].offset : t->param_elems;
    return b - a;
}

tdm_status tdm_model_spec_layer_costs(const tdm_model_spec *s, tdm_model_layer_cost *out, int n)
{
    int want = 0;
    TDM_CHECK(tdm_model_spec_n_layers(s, &want));
    TDM_REQUIRE(out && n == want, TDM_STATUS_INVALID_ARG,
                "model: %d layer costs asked for a model of %d layers", n, want);
    tdm_model *t = NULL;
    TDM_CHECK(tdm_stage_full_tables(s, &t));
    if (s->kind == TDM_MODEL_GPT) {
        double C = s->n_embd, T = s->n_ctx, V = s->vocab;
        int L = s->n_layer, per = 12;
        out[0] = (tdm_model_layer_cost){.param_elems = tdm_stage_span(t, 0, 2), .flops = 0.0};
        for (int l = 0; l < L; l++)
            out[1 + l] = (tdm_model_layer_cost){
                .param_elems = tdm_stage_span(t, 2 + per * l, 2 + per * (l + 1)),
                /* per position 12 C^2 + 2 T C multiply-adds (see gpt.c) */
                .flops = 3.0 * 2.0 * T * (12.0 * C * C + 2.0 * T * C)};
        out[L + 1] = (tdm_model_layer_cost){.param_elems = tdm_stage_span(t, 2 + per * L, t->n_params),
                                            .flops = 3.0 * 2.0 * T * C * V};
    } else {
        for (int i = 0; i < t->n_layers; i++) {
            const tdm_layer *l = &t->layers[i];
            double macs = 0.0;
            if (l->kind == TDM_LAYER_LINEAR) macs = (double)l->c * l->oc;
            else if (l->kind == TDM_LAYER_CONV)
                macs = (double)l->oc * l->c * l->k * l->k * l->oh * l->ow;
            out[i] = (tdm_model_layer_cost){.param_elems = tdm_stage_span(t, l->p0, l->p0 + l->np),
                                            .flops = 3.0 * 2.0 * macs,
                                            .no_cut = tdm_stage_cut_line(t, i) > 0};
        }
    }
    tdm_stage_tables_free(t);
    return TDM_STATUS_OK;
}

/* ---- tensor-parallel stages of a model file ---- */

/* Why a layer of this kind cannot run on a column-parallel slice. */
static const char *tdm_stage_tp_why(tdm_layer_kind k)
{
    switch (k) {
    case TDM_LAYER_LN:
        return "layernorm normalises over all of a sample's features, which the column-parallel "
               "layer splits across the ranks; gathering them first would leave nothing for the "
               "row-parallel layer to split (put it outside the pair)";
    case TDM_LAYER_BN:
        return "batchnorm's statistics are over whole channels";
    case TDM_LAYER_RES:
        return "a residual block's sum needs its whole input";
    default:
        return "only elementwise layers (relu, gelu, tanh, sigmoid, dropout) run on a "
               "column-parallel slice";
    }
}

tdm_status tdm_model_spec_tp_stages(const tdm_model_spec *s, const int *first, int stages, int N,
                                    tdm_model_partial *kinds, int n, tdm_model_spec *narrow)
{
    TDM_REQUIRE(s->kind == TDM_MODEL_SEQ && N >= 1 && stages >= 1, TDM_STATUS_INVALID_ARG,
                "tensor-parallel stages: a model file's spec, %d stages of %d ranks", stages, N);
    tdm_model *t = NULL;
    TDM_CHECK(tdm_stage_full_tables(s, &t));
    tdm_status st = TDM_STATUS_OK;
    static const char *const what = "pipeline of tensor-parallel stages";
    char cut[TDM_MODEL_MAX_OPS] = {0};   /* per op: 1, its output width divided by N */
    int *pair = NULL;                      /* per layer: the row layer of the pair whose
                                              slice its output is; -1 whole */
    if (n != t->n_layers)
        st = tdm_error_set(TDM_STATUS_INTERNAL, "%s: %d kinds for %d layers", what, n,
                           t->n_layers);
    if (!st && !(pair = malloc((size_t)(n > 0 ? n : 1) * sizeof *pair)))
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: %d layers' pairs", what, n);
    for (int i = 0; i < n && !st; i++) {
        kinds[i] = TDM_MODEL_PARTIAL_NONE;
        pair[i] = -1;
    }
    for (int k = 0; k < stages && !st; k++) {
        int lo = first[k], hi = k + 1 < stages ? first[k + 1] : n, col = -1;
        for (int i = lo; i < hi && !st; i++) {
            const tdm_layer *l = &t->layers[i];
            int linear = l->kind == TDM_LAYER_LINEAR;
            if (col >= 0 && linear) {
                kinds[i] = TDM_MODEL_PARTIAL_OUT;
                for (int c = col; c < i; c++) pair[c] = i;
                col = -1;
            } else if (col >= 0 && l->kind != TDM_LAYER_ACT && l->kind != TDM_LAYER_DROPOUT) {
                st = tdm_error_set(TDM_STATUS_USAGE, "%s line %d: `%s` stands between the "
                                   "column-parallel linear of line %d and its row-parallel "
                                   "linear: a %s cannot split it: %s", s->name, l->line,
                                   tdm_model_op_name(s->ops[l->op].kind), t->layers[col].line,
                                   what, tdm_stage_tp_why(l->kind));
            } else if (col < 0 && linear) {
                int j = i + 1;
                while (j < hi && t->layers[j].kind != TDM_LAYER_LINEAR) j++;
                if (j == hi) continue;   /* the stage's odd last linear layer: whole */
                if (l->oc % N)
                    st = tdm_error_set(TDM_STATUS_USAGE, "%s line %d: stage %d: linear %d's "
                                       "output width (line %d's input) is not divisible by the "
                                       "%d tensor-parallel ranks", s->name, l->line, k, l->oc,
                                       t->layers[j].line, N);
                kinds[i] = TDM_MODEL_PARTIAL_IN;
                cut[l->op] = 1;
                col = i;
            }
        }
    }
    /* a residual block opened inside a pair adds the column layer's
     * slice, not its whole input, through its skip path */
    for (int i = 0; i < n && !st; i++) {
        const tdm_layer *l = &t->layers[i];
        if (l->kind != TDM_LAYER_RES || l->skip < 0 || pair[l->skip] < 0) continue;
        int c = l->skip;
        while (c > 0 && pair[c - 1] == pair[l->skip]) c--;
        st = tdm_error_set(TDM_STATUS_USAGE, "%s line %d: `residual {` opens between the "
                           "column-parallel linear of line %d and its row-parallel linear of "
                           "line %d: a %s cannot split it: the block's skip path needs its "
                           "whole input (open the block after the pair)", s->name, l->line,
                           t->layers[c].line, t->layers[pair[l->skip]].line, what);
    }
    if (!st) {
        /* the spec again, each column layer 1/N as wide (shapes inferred anew) */
        *narrow = *s;
        narrow->n_ops = narrow->n_open = 0;
        for (int i = 0; i < s->n_ops && !st; i++) {
            tdm_model_op o = s->ops[i];
            if (cut[i]) o.n /= N;
            st = tdm_model_seq_add(narrow, &o);
        }
        if (!st) st = tdm_model_seq_finish(narrow);
    }
    free(pair);
    tdm_stage_tables_free(t);
    return st;
}

/* ---- stages ---- */

tdm_status tdm_model_crop(tdm_model *m)
{
    int lo = m->stage.lo, hi = m->stage.hi;
    TDM_REQUIRE(!m->vt && hi <= m->n_layers, TDM_STATUS_INTERNAL,
                "model: crop of layers [%d, %d) of %d", lo, hi, m->n_layers);
    int bad = tdm_stage_cut_line(m, lo), bad_cut = lo;
    if (!bad && hi < m->n_layers) bad = tdm_stage_cut_line(m, hi), bad_cut = hi;
    TDM_REQUIRE(!bad, TDM_STATUS_INVALID_ARG,
                "pipeline: a stage starting at layer %d splits the residual block or comes before "
                "the dropout of %s line %d (a block stays within one stage; dropout stays in "
                "the first: pick another --split)", bad_cut, m->spec.name, bad);
    int p0 = m->layers[lo].p0, p1 = hi < m->n_layers ? m->layers[hi].p0 : m->n_params;
    int b0 = m->layers[lo].b0, b1 = hi < m->n_layers ? m->layers[hi].b0 : m->n_buffers;
    int64_t e0 = p0 < m->n_params ? m->params_info[p0].offset : m->param_elems;
    int64_t e1 = p1 < m->n_params ? m->params_info[p1].offset : m->param_elems;
    int64_t f0 = b0 < m->n_buffers ? m->buffers_info[b0].offset : m->buffer_elems;
    int64_t f1 = b1 < m->n_buffers ? m->buffers_info[b1].offset : m->buffer_elems;
    memmove(m->layers, m->layers + lo, (size_t)(hi - lo) * sizeof m->layers[0]);
    m->n_layers = hi - lo;
    for (int i = 0; i < m->n_layers; i++) {
        m->layers[i].p0 -= p0;
        m->layers[i].b0 -= b0;
        m->layers[i].block = i;
        if (m->layers[i].kind == TDM_LAYER_RES) m->layers[i].skip -= lo;
    }
    memmove(m->params_info, m->params_info + p0, (size_t)(p1 - p0) * sizeof m->params_info[0]);
    for (int i = 0; i < p1 - p0; i++) {
        m->params_info[i].offset -= e0;
        m->params_info[i].layer -= lo;
    }
    memmove(m->buffers_info, m->buffers_info + b0, (size_t)(b1 - b0) * sizeof m->buffers_info[0]);
    for (int i = 0; i < b1 - b0; i++) {
        m->buffers_info[i].offset -= f0;
        m->buffers_info[i].layer -= lo;
    }
    m->n_params = p1 - p0;
    m->n_buffers = b1 - b0;
    m->param_elems = e1 - e0;
    m->buffer_elems = f1 - f0;
    m->stage.p_base = p0;
    m->stage.b_base = b0;
    m->stage.n_slice = m->n_params;
    return TDM_STATUS_OK;
}

static int tdm_stage_same(const tdm_tensor_info *a, const tdm_tensor_info *b)
{
    if (strcmp(a->name, b->name) || a->ndim != b->ndim || a->n_elem != b->n_elem) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

tdm_status tdm_model_stage_place(tdm_model *m)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_model *t = NULL;
    TDM_CHECK(tdm_stage_full_tables(&m->spec, &t));
    tdm_model_stage *g = &m->stage;
    int p1 = g->p_base + g->n_slice;
    TDM_REQUIRE(p1 <= t->n_params, TDM_STATUS_INTERNAL, "model: stage tensors past the table");
    g->elem_base = g->p_base < t->n_params ? t->params_info[g->p_base].offset : t->param_elems;
    g->slice_elems = tdm_stage_span(t, g->p_base, p1);
    g->buf_base = g->b_base < t->n_buffers ? t->buffers_info[g->b_base].offset : t->buffer_elems;
    for (int i = 0; i < g->n_slice; i++) {
        const tdm_tensor_info *a = &m->params_info[i], *b = &t->params_info[g->p_base + i];
        if (!tdm_stage_same(a, b) || a->offset != b->offset - g->elem_base) {
            st = tdm_error_set(TDM_STATUS_INTERNAL, "model: stage tensor %d '%s' at %lld is not "
                               "the whole model's '%s' at %lld - %lld", i, a->name,
                               (long long)a->offset, b->name, (long long)b->offset,
                               (long long)g->elem_base);
            goto fail;
        }
    }
    for (int i = 0; i < m->n_buffers; i++) {
        const tdm_tensor_info *a = &m->buffers_info[i], *b = &t->buffers_info[g->b_base + i];
        if (!tdm_stage_same(a, b) || a->offset != b->offset - g->buf_base) {
            st = tdm_error_set(TDM_STATUS_INTERNAL, "model: stage buffer %d '%s' is not the "
                               "whole model's '%s'", i, a->name, b->name);
            goto fail;
        }
    }
    if (g->tied >= 0) {
        const tdm_tensor_info *a = &m->params_info[g->tied], *b = &t->params_info[g->tied_source];
        g->tied_offset = b->offset;
        if (a->n_elem != b->n_elem || a->offset != g->slice_elems) {
            st = tdm_error_set(TDM_STATUS_INTERNAL, "model: tied copy '%s' does not follow the "
                               "slice or differs from '%s'", a->name, b->name);
            goto fail;
        }
    }
fail:
    tdm_stage_tables_free(t);
    return st;
}

int tdm_model_global_param(const tdm_model *m, int i)
{
    if (i == m->stage.tied) return m->stage.tied_source;
    return m->stage.p_base + i;
}

tdm_status tdm_model_init_stage(tdm_model **out, tdm_device *dev, const tdm_model_spec *spec,
                                uint64_t seed, int lo, int hi)
{
    TDM_REQUIRE(out, TDM_STATUS_INVALID_ARG, "model stage: out is NULL");
    *out = NULL;
    TDM_REQUIRE(lo >= 0 && hi > lo, TDM_STATUS_INVALID_ARG,
                "model stage: layers [%d, %d) are not a non-empty range", lo, hi);
    return tdm_model_init_range(out, dev, spec, seed, lo, hi);
}

/* A GPT's stream per window between stages: its T x C, or under
 * sequence parallelism the rank's 1/tp_ranks of the tokens. */
static int64_t tdm_model_gpt_stream(const tdm_model *m)
{
    const tdm_model_spec *s = &m->spec;
    int64_t n = (int64_t)s->n_ctx * s->n_embd;
    return s->tp_ranks > 1 && s->tp_seq ? n / s->tp_ranks : n;
}

int64_t tdm_model_stage_in_elems(const tdm_model *m)
{
    if (m->spec.kind == TDM_MODEL_GPT)
        return m->stage.lo == 0 ? m->spec.n_ctx : tdm_model_gpt_stream(m);
    return m->layers[0].in_elems;
}

int64_t tdm_model_stage_out_elems(const tdm_model *m)
{
    if (m->spec.kind == TDM_MODEL_GPT)
        return m->stage.hi == m->stage.n ? (int64_t)m->spec.n_ctx * m->spec.vocab
                                         : tdm_model_gpt_stream(m);
    return m->layers[m->n_layers - 1].out_elems;
}

void tdm_model_get_stage(const tdm_model *m, tdm_model_stage_info *out)
{
    const tdm_model_stage *g = &m->stage;
    *out = (tdm_model_stage_info){
        .lo = g->lo, .hi = g->hi, .n_layers = g->n, .is_first = g->lo == 0,
        .is_last = g->hi == g->n, .param_first = g->p_base, .n_slice_params = g->n_slice,
        .slice_offset = g->elem_base, .slice_elems = g->slice_elems,
        .buffer_offset = g->buf_base, .tied_param = g->tied, .tied_source = g->tied_source,
        .tied_source_offset = g->tied_offset,
        .in_elems = tdm_model_stage_in_elems(m), .out_elems = tdm_model_stage_out_elems(m)};
}

tdm_status tdm_model_stage_forward(tdm_model *m, const void *x, int batch, const float **y)
{
    return tdm_model_forward(m, x, batch, y);
}

tdm_status tdm_model_stage_backward(tdm_model *m, const float *dy, const float **dx)
{
    TDM_CHECK(tdm_model_backward(m, dy));
    if (dx) *dx = m->input_grad;
    return TDM_STATUS_OK;
}

const float *tdm_model_input_grad(const tdm_model *m) { return m->input_grad; }

/* ---- activation sets ---- */

/* A parked set: the model-level counts, and for the MLP and CNN each
 * layer's pointers (the GPT parks its own, in gpt.c). */
typedef struct tdm_stage_set {
    int cap, batch;
    size_t bytes;
    float **out, **mean, **var, **invstd;   /* per layer */
    int32_t **argmax;
    const float **in;
    void **out16;                           /* per layer: 16-bit precisions */
    const void **in16;
    void *x16, *arena;                      /* the set's rounded input, checkpoint arena */
    struct tdm_act_layout *act;             /* and its layout (models/recompute.c) */
    uint64_t *drop_keys;                    /* its forward's dropout keys (owned while parked) */
    int drop_cap;
} tdm_stage_set;

static void tdm_stage_set_release(tdm_stage_set *s)
{
    free(s->out);
    free(s->drop_keys);
    memset(s, 0, sizeof *s);
}

/* Per-layer arrays of a parked set: one allocation. */
static tdm_status tdm_stage_set_arrays(tdm_stage_set *s, int n)
{
    if (s->out) return TDM_STATUS_OK;
    void **p = calloc((size_t)n * 8, sizeof *p);
    TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "model: activation set of %d layers", n);
    s->out = (float **)p;
    s->mean = (float **)(p + n);
    s->var = (float **)(p + 2 * n);
    s->invstd = (float **)(p + 3 * n);
    s->argmax = (int32_t **)(p + 4 * n);
    s->in = (const float **)(p + 5 * n);
    s->out16 = p + 6 * n;
    s->in16 = (const void **)(p + 7 * n);
    return TDM_STATUS_OK;
}

tdm_status tdm_model_select_act_set(tdm_model *m, int k)
{
    TDM_REQUIRE(k >= 0 && k < TDM_MODEL_MAX_ACT_SETS, TDM_STATUS_INVALID_ARG,
                "model: activation set %d out of range 0..%d", k, TDM_MODEL_MAX_ACT_SETS - 1);
    if (k == m->set && m->n_sets > k) return TDM_STATUS_OK;
    if (k >= m->n_sets) {
        tdm_stage_set *s = realloc(m->sets, (size_t)(k + 1) * sizeof *s);
        TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "model: %d activation sets", k + 1);
        memset(s + m->n_sets, 0, (size_t)(k + 1 - m->n_sets) * sizeof *s);
        m->sets = s;
        m->n_sets = k + 1;
    }
    tdm_stage_set *sets = m->sets, *cur = &sets[m->set], *next = &sets[k];
    if (!m->vt) {
        TDM_CHECK(tdm_stage_set_arrays(cur, m->n_layers));
        TDM_CHECK(tdm_stage_set_arrays(next, m->n_layers));
    }
    /* park the current set */
    cur->cap = m->cap;
    cur->batch = m->batch;
    cur->bytes = m->set_bytes;
    cur->x16 = m->x16;
    cur->arena = m->arena;
    cur->act = m->act_set;
    cur->drop_keys = m->drop_keys;
    cur->drop_cap = m->drop_cap;
    for (int i = 0; !m->vt && i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        cur->out[i] = l->out;
        cur->mean[i] = l->mean;
        cur->var[i] = l->var;
        cur->invstd[i] = l->invstd;
        cur->argmax[i] = l->argmax;
        cur->in[i] = l->in;
        cur->out16[i] = l->out16;
        cur->in16[i] = l->in16;
    }
    if (m->vt) TDM_CHECK(m->vt->select_set(m, k));
    /* and bring set k */
    for (int i = 0; !m->vt && i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        l->out = next->out[i];
        l->mean = next->mean[i];
        l->var = next->var[i];
        l->invstd = next->invstd[i];
        l->argmax = next->argmax[i];
        l->in = next->in[i];
        l->out16 = next->out16[i];
        l->in16 = next->in16[i];
    }
    if (!m->vt) {
        m->x16 = next->x16;
        m->arena = next->arena;
        m->act_set = next->act;
    }
    m->drop_keys = next->drop_keys;   /* the model owns the current set's keys */
    m->drop_cap = next->drop_cap;
    next->drop_keys = NULL;
    next->drop_cap = 0;
    m->act_bytes = m->act_bytes - m->set_bytes + next->bytes;
    m->cap = next->cap;
    m->batch = next->batch;
    m->set_bytes = next->bytes;
    m->set = k;
    return TDM_STATUS_OK;
}

int tdm_model_act_set(const tdm_model *m) { return m->set; }
size_t tdm_model_act_set_bytes(const tdm_model *m) { return m->set_bytes; }

void tdm_model_act_bytes(const tdm_model *m, size_t *sets, size_t *scratch)
{
    if (m->vt && m->ext) {
        m->vt->act_bytes(m, sets, scratch);
        return;
    }
    const tdm_stage_set *s = m->sets;
    size_t total = m->set_bytes;
    for (int k = 0; k < m->n_sets; k++)
        if (k != m->set) total += s[k].bytes;
    *sets = total;
    *scratch = m->act_bytes - m->set_bytes;
}

void tdm_model_free_sets(tdm_model *m)
{
    tdm_stage_set *s = m->sets;
    for (int k = 0; k < m->n_sets; k++) tdm_stage_set_release(&s[k]);
    free(m->sets);
    m->sets = NULL;
    m->n_sets = 0;
    m->set = 0;
}
