/* models/recompute.c: activation checkpointing of the MLP and CNN layer
 * chain (models/recompute.h), and the activation layout both models'
 * reserves allocate from: one list of buffers per batch, precision and
 * checkpointing, which models/plan.c sums without allocating. The GPT's
 * blocks are checkpointed in models/gpt.c through the same layout. Not
 * here: the layers' arithmetic (models/layers.c), the 16-bit casts
 * (models/precision.c). */
#include "models/model_impl.h"

#include <stdlib.h>
#include <string.h>

#include "models/builder.h"

#define TDM_ACT_ALIGN ((size_t)64)

static size_t tdm_act_round(size_t n) { return (n + TDM_ACT_ALIGN - 1) & ~(TDM_ACT_ALIGN - 1); }

void tdm_act_add(tdm_act_layout *lay, void **ptr, size_t nbytes, int layer, int arena,
                 size_t *arena_off)
{
    if (lay->n >= TDM_ACT_MAX_BUFS) {
        lay->n++;   /* counted, so that alloc refuses the layout */
        return;
    }
    tdm_act_buf *b = &lay->b[lay->n++];
    b->ptr = ptr;
    b->nbytes = nbytes;
    b->layer = layer;
    b->arena_off = -1;
    if (arena) {
        b->arena_off = (int64_t)*arena_off;
        *arena_off += tdm_act_round(nbytes);
        if (*arena_off > lay->arena_bytes) lay->arena_bytes = *arena_off;
    }
}

void tdm_act_free(tdm_model *m, tdm_act_layout **keep, void **arena)
{
    tdm_act_layout *lay = *keep;
    if (lay) {
        for (int i = 0; i < lay->n && i < TDM_ACT_MAX_BUFS; i++)
            if (lay->b[i].arena_off < 0) tdm_dev_free(m->dev, lay->b[i].got);
        free(lay);
        *keep = NULL;
    }
    if (arena) {
        tdm_dev_free(m->dev, *arena);
        *arena = NULL;
    }
}

tdm_status tdm_act_alloc(tdm_model *m, const tdm_act_layout *lay, tdm_act_layout **keep,
                         void **arena, size_t *bytes)
{
    *bytes = 0;
    TDM_REQUIRE(lay->n <= TDM_ACT_MAX_BUFS, TDM_STATUS_INTERNAL,
                "model: %d activation buffers (at most %d)", lay->n, TDM_ACT_MAX_BUFS);
    TDM_REQUIRE(!lay->arena_bytes || arena, TDM_STATUS_INTERNAL, "model: an arena with no place");
    tdm_act_free(m, keep, arena);
    *keep = malloc(sizeof **keep);
    TDM_REQUIRE(*keep, TDM_STATUS_OUT_OF_MEMORY, "model: cannot allocate its activation table");
    (*keep)->n = 0;
    (*keep)->arena_bytes = lay->arena_bytes;
    if (lay->arena_bytes) {
        TDM_CHECK(tdm_dev_alloc(m->dev, lay->arena_bytes, arena));
        *bytes += lay->arena_bytes;
    }
    for (int i = 0; i < lay->n; i++) {
        tdm_act_buf b = lay->b[i];
        if (b.arena_off >= 0) {
            *b.ptr = (char *)*arena + b.arena_off;
            b.got = NULL;
        } else {
            TDM_CHECK(tdm_dev_alloc(m->dev, b.nbytes, &b.got));
            *b.ptr = b.got;
            *bytes += b.nbytes;
        }
        (*keep)->b[(*keep)->n++] = b;   /* recorded once allocated: freed through it */
    }
    return TDM_STATUS_OK;
}

/* ---- the chain's units and segments ---- */

void tdm_model_chain_units(tdm_model *m)
{
    /* a model file without convolutions is cut as the MLP, one with them
     * as the CNN (tdm_model_spec_lever_op: nothing else reaches here) */
    int u = -1, mlp = m->spec.kind == TDM_MODEL_MLP;
    if (m->spec.kind == TDM_MODEL_SEQ) {
        mlp = 1;
        for (int i = 0; i < m->n_layers; i++) mlp &= m->layers[i].kind != TDM_LAYER_CONV;
    }
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        /* a conv block (conv, bn, pool) in the CNN; every linear layer in
         * the MLP; the CNN's linear layers and layout changes stay out */
        int starts = l->kind == TDM_LAYER_CONV || (mlp && l->kind == TDM_LAYER_LINEAR);
        int member = starts || l->kind == TDM_LAYER_BN || l->kind == TDM_LAYER_MAXPOOL;
        if (starts) u++;
        l->unit = member ? u : -1;
    }
    m->lev.n_units = u + 1;
    int N = m->lev.ckpt;
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        int next_unit = i + 1 < m->n_layers ? m->layers[i + 1].unit : -1;
        int unit_ends = l->unit >= 0 && next_unit != l->unit;
        l->seg_last = unit_ends && N > 0 &&
                      (l->unit % N == N - 1 || l->unit == m->lev.n_units - 1);
    }
}

/* 1 when layer l's activations live in the arena: inside a checkpointed
 * segment and not the one output the segment keeps. */
static int tdm_chain_in_arena(const tdm_model *m, const tdm_layer *l)
{
    return m->lev.ckpt > 0 && l->unit >= 0 && !l->seg_last;
}

void tdm_model_chain_layout(tdm_model *m, int batch, tdm_act_layout *set,
                            tdm_act_layout *scratch)
{
    size_t es = tdm_dtype_size(m->lev.adt), off = 0, col_max = 0, B = (size_t)batch;
    int low = tdm_model_low(m), last = m->n_layers - 1;
    memset(set, 0, sizeof *set);
    memset(scratch, 0, sizeof *scratch);
    int seg = -1;
    for (int i = 0; i < m->n_layers; i++) {
        tdm_layer *l = &m->layers[i];
        size_t out = B * (size_t)l->out_elems;
        if (l->kind == TDM_LAYER_LN) out += 2 * B;   /* its means and rstds */
        /* every segment's inner activations start at the arena's start */
        if (m->lev.ckpt > 0 && l->unit >= 0 && l->unit / m->lev.ckpt != seg) {
            seg = l->unit / m->lev.ckpt;
            off = 0;
        }
        if (!low || i == last)
            tdm_act_add(set, (void **)&l->out, out * sizeof(float), i,
                        i != last && tdm_chain_in_arena(m, l), &off);
        else   /* l->out is a ping-pong buffer of the forward (f32s) */
            tdm_act_add(set, &l->out16, out * es, i, tdm_chain_in_arena(m, l), &off);
        if (l->kind == TDM_LAYER_RES)   /* the skip path's gradient, kept through the block */
            tdm_act_add(scratch, (void **)&l->skipg, B * (size_t)l->skip_elems * sizeof(float),
                        i, 0, &off);
        if (tdm_layer_convs(l)) {
            size_t nb = (size_t)l->c * l->k * l->k * (size_t)l->chunk * l->oh * l->ow * sizeof(float);
            if (nb > col_max) col_max = nb;
        } else if (l->kind == TDM_LAYER_MAXPOOL) {
            /* the pooling's winners are recomputed with its segment */
            tdm_act_add(set, (void **)&l->argmax, out * sizeof(int32_t), i,
                        m->lev.ckpt > 0 && l->unit >= 0, &off);
        }
    }
    if (low) tdm_act_add(set, &m->x16, B * (size_t)m->layers[0].in_elems * es, -1, 0, &off);
    size_t nmax = B * (size_t)m->max_elems;
    tdm_act_add(scratch, (void **)&m->dbuf[0], nmax * sizeof(float), -1, 0, &off);
    tdm_act_add(scratch, (void **)&m->dbuf[1], nmax * sizeof(float), -1, 0, &off);
    if (col_max) tdm_act_add(scratch, (void **)&m->col, col_max, -1, 0, &off);
    tdm_act_add(scratch, (void **)&m->ones, B * sizeof(float), -1, 0, &off);
    if (m->stage.hi == m->stage.n)   /* the loss gradient: only where the logits are */
        tdm_act_add(scratch, (void **)&m->dlogits,
                    B * (size_t)tdm_model_n_classes(m) * sizeof(float), -1, 0, &off);
    if (!low) return;
    tdm_act_add(scratch, (void **)&m->f32s[0], nmax * sizeof(float), -1, 0, &off);
    tdm_act_add(scratch, (void **)&m->f32s[1], nmax * sizeof(float), -1, 0, &off);
    tdm_act_add(scratch, &m->d16, nmax * es, -1, 0, &off);
    if (col_max) tdm_act_add(scratch, &m->col16, col_max / sizeof(float) * es, -1, 0, &off);
}

/* ---- the public settings ---- */

tdm_status tdm_model_set_checkpoint(tdm_model *m, int units_per_segment)
{
    TDM_REQUIRE(units_per_segment >= 0, TDM_STATUS_INVALID_ARG,
                "activation checkpointing: %d units per segment (expected 0 for none, or >= 1)",
                units_per_segment);
    if (units_per_segment == m->lev.ckpt) return TDM_STATUS_OK;
    if (units_per_segment > 0 && tdm_model_spec_lever_op(&m->spec) >= 0) {
        char why[512];
        tdm_model_spec_lever_refusal(&m->spec, why, sizeof why);
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "activation checkpointing: %s (leave "
                             "--checkpoint-activations out)", why);
    }
    tdm_model_drop_activations(m);
    m->lev.ckpt = units_per_segment;
    if (!m->vt) tdm_model_chain_units(m);
    return TDM_STATUS_OK;
}

int tdm_model_checkpoint(const tdm_model *m) { return m->lev.ckpt; }
int tdm_model_n_units(const tdm_model *m) { return m->lev.n_units; }
int tdm_model_layer_unit(const tdm_model *m, int layer)
{
    return layer >= 0 && layer < m->n_layers ? m->layers[layer].unit : -1;
}

/* ---- recomputation ---- */

tdm_status tdm_model_chain_recompute(tdm_model *m, int i, int batch)
{
    int N = m->lev.ckpt, seg = m->layers[i].unit / N, first = i;
    while (first > 0 && m->layers[first - 1].unit >= 0 && m->layers[first - 1].unit / N == seg)
        first--;
    /* The parameters of every layer of the segment are needed now, and
     * stay needed until each layer's own backward: one event over the
     * whole range (models/recompute.h), so that a sharded model gathers
     * them together. One event per layer read as backward leaving each
     * layer in turn, and FSDP freed the units it left before the
     * segment's forward had read them. */
    int p_lo = -1, p_hi = -1;
    for (int j = first; j <= i; j++) {
        const tdm_layer *l = &m->layers[j];
        if (l->np <= 0) continue;
        if (p_lo < 0) p_lo = l->p0;
        p_hi = l->p0 + l->np - 1;
    }
    if (p_lo >= 0) TDM_CHECK(tdm_model_raise_use(m, TDM_MODEL_USE_BACKWARD, p_lo, p_hi));
    const float *x = m->layers[first].in;
    if (tdm_model_low(m)) {
        /* the forward read the rounded input from the other ping-pong
         * buffer: widen it back there */
        const void *in16 = first == 0 ? m->x16 : m->layers[first - 1].out16;
        float *dst = m->f32s[(first + 1) & 1];
        TDM_CHECK(tdm_dev_convert(m->dev, dst, TDM_DTYPE_FLOAT32, in16, m->lev.adt,
                                  (int64_t)batch * m->layers[first].in_elems));
        x = dst;
    }
    m->lev.recomputing = 1;
    tdm_status st = tdm_model_run_layers(m, first, i, x, batch);
    m->lev.recomputing = 0;
    return st;
}
