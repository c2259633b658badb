/* models/plan.c: the single-device memory planner (models/plan.h). It
 * builds the model's skeleton (layers and tables, no memory), lays its
 * activations out with the model's own layout functions, and adds every
 * other allocation a training step makes, each rounded as the device
 * allocator rounds it. */
#include "models/plan.h"

#include <stdlib.h>
#include <string.h>

#include "models/builder.h"
#include "models/model_impl.h"
#include "models/stage.h"

/* What the host allocator (core/device.c) counts for a request: 64-byte
 * multiples, at least 64. */
static size_t tdm_plan_round(size_t n)
{
    size_t sz = (n + 63) & ~(size_t)63;
    return sz ? sz : 64;
}

void tdm_plan_opts_default(tdm_plan_opts *o, const tdm_model_spec *spec, int batch)
{
    memset(o, 0, sizeof *o);
    o->spec = *spec;
    o->batch = batch;
    tdm_optim_opts_default(&o->optim, spec->kind == TDM_MODEL_GPT ? TDM_OPTIM_ADAMW
                                                                  : TDM_OPTIM_SGD);
    o->device = TDM_DEVICE_HOST;
    o->threads = 1;
}

static size_t tdm_plan_max(size_t a, size_t b) { return a > b ? a : b; }

/* The float16 widening buffer of a host device (core/device_host.c): the
 * largest sum of the two operands' spans over the products of one step,
 * in elements. The spans follow each product's column-major arguments. */
static size_t tdm_plan_widen(const tdm_model *m, int batch)
{
    size_t w = 0, B = (size_t)batch;
    if (m->spec.kind == TDM_MODEL_GPT) {
        size_t C = m->spec.n_embd, T = m->spec.n_ctx, H = m->spec.n_head, V = m->spec.vocab;
        size_t N = B * T, hd = C / H;
        /* a pipeline stage's: its blocks' products, the head's on the last */
        int L = m->spec.n_layer, blocks = m->stage.lo <= L && m->stage.hi > 1;
        int head = m->stage.hi == m->stage.n;
        const size_t lin[4][2] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}};
        for (int i = 0; blocks && i < 4; i++) {
            size_t in = lin[i][0], out = lin[i][1];
            w = tdm_plan_max(w, in * (out + N));   /* forward */
            w = tdm_plan_max(w, N * (in + out));   /* dW */
            w = tdm_plan_max(w, out * (in + N));   /* dx */
        }
        if (head) {
            w = tdm_plan_max(w, C * (V + N));
            w = tdm_plan_max(w, N * (C + V));
            w = tdm_plan_max(w, V * (C + N));
        }
        if (!blocks) return w;
        /* a window's heads read out of qkv (row stride 3C) or the merged
         * (N, C) gradient (row stride C), probabilities H T T */
        size_t s3 = hd * (H - 1) + 3 * C * (T - 1) + hd, s1 = hd * (H - 1) + C * (T - 1) + hd;
        size_t att = H * T * T;
        w = tdm_plan_max(w, 2 * s3);
        w = tdm_plan_max(w, s3 + att);
        w = tdm_plan_max(w, s3 + s1);
        w = tdm_plan_max(w, s1 + att);
        return w;
    }
    int first = 0;
    while (first < m->n_layers - 1 && m->layers[first].np == 0) first++;
    for (int i = 0; i < m->n_layers; i++) {
        const tdm_layer *l = &m->layers[i];
        int din = i > first || m->stage.input_grad;   /* a later stage's sends its dx */
        if (l->kind == TDM_LAYER_LINEAR) {
            size_t c = l->c, oc = l->oc;
            w = tdm_plan_max(w, c * (oc + B));
            w = tdm_plan_max(w, B * (c + oc));
            if (din) w = tdm_plan_max(w, oc * (c + B));
        } else if (tdm_layer_convs(l)) {
            size_t per = (size_t)l->oh * l->ow, cn = (size_t)l->chunk * per, np = B * per;
            size_t kk = (size_t)l->c * l->k * l->k, oc = l->oc;
            w = tdm_plan_max(w, kk * (cn + oc));
            w = tdm_plan_max(w, cn * kk + np * (oc - 1) + cn);
            if (din) w = tdm_plan_max(w, np * (oc - 1) + cn + kk * oc);
        }
    }
    return w;
}

/* The device scratch through one step (models/plan.h): the loss rows,
 * the scaler's flag, the norm's partial sums. */
size_t tdm_plan_scratch_peak(const size_t *needs, int n)
{
    size_t cur = 0, peak = 0;
    for (int i = 0; i < n; i++) {
        if (cur && needs[i] <= cur) continue;
        size_t want = needs[i] > 2 * cur ? needs[i] : 2 * cur;
        if (want < 256) want = 256;
        size_t during = tdm_plan_round(want) + (cur ? tdm_plan_round(cur) : 0);
        peak = tdm_plan_max(peak, during);
        cur = want;
    }
    return peak;
}

tdm_status tdm_plan_single(const tdm_plan_opts *o, tdm_plan *out)
{
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(o->batch > 0 && o->ckpt >= 0, TDM_STATUS_INVALID_ARG,
                "plan: batch %d and checkpoint segment %d", o->batch, o->ckpt);
    TDM_REQUIRE(o->optim.offload == TDM_OPTIM_OFFLOAD_NONE || o->device != TDM_DEVICE_HOST,
                TDM_STATUS_INVALID_ARG, "plan: optimizer offload is for accelerators");
    if ((o->precision != TDM_PRECISION_FP32 || o->ckpt > 0) &&
        tdm_model_spec_lever_op(&o->spec) >= 0) {
        char why[512];
        tdm_model_spec_lever_refusal(&o->spec, why, sizeof why);
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "plan: %s (no --precision or "
                             "--checkpoint-activations)", why);
    }
    tdm_model *m = NULL;
    tdm_act_layout *lay = NULL, *scr = NULL;
    tdm_status st = TDM_STATUS_OK;
    TDM_TRY(tdm_model_skeleton_range(&m, &o->spec, o->device, o->threads,
                                     o->stage_hi > 0 ? o->stage_lo : -1, o->stage_hi));
    m->conv_chunk = o->conv_chunk;
    m->lev.prec = o->precision;
    m->lev.adt = tdm_precision_dtype(o->precision);
    m->lev.ckpt = o->ckpt;
    if (!m->vt) tdm_model_chain_units(m);
    size_t es = tdm_dtype_size(m->lev.adt), pe = (size_t)m->param_elems, B = (size_t)o->batch;
    int low = tdm_model_low(m);

    out->params = tdm_plan_round(pe * sizeof(float));
    out->grads = out->params;
    out->buffers = m->buffer_elems ? tdm_plan_round((size_t)m->buffer_elems * sizeof(float)) : 0;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].kind == TDM_LAYER_BN)   /* mean, var, invstd */
            out->buffers += 3 * tdm_plan_round((size_t)m->layers[i].c * sizeof(float));
    out->params_low = low ? tdm_plan_round(pe * es) : 0;
    size_t state = (size_t)tdm_optim_kind_n_state(&o->optim) *
                   tdm_plan_round((pe > 0 ? pe : 1) * sizeof(float));
    if (o->optim.offload == TDM_OPTIM_OFFLOAD_HOST)
        out->optim_host = state + 2 * tdm_plan_round(pe * sizeof(float));
    else
        out->optim = state;

    lay = malloc(sizeof *lay);
    scr = malloc(sizeof *scr);
    if (!lay || !scr) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "plan: cannot allocate a layout");
        goto fail;
    }
    if (m->vt) {
        m->vt->layout(m, o->batch, lay, scr);
    } else {
        for (int i = 0; i < m->n_layers; i++)
            if (tdm_layer_convs(&m->layers[i]))
                m->layers[i].chunk = tdm_model_conv_chunk(m, &m->layers[i], o->batch);
        tdm_model_chain_layout(m, o->batch, lay, scr);
    }
    if (lay->n > TDM_ACT_MAX_BUFS || scr->n > TDM_ACT_MAX_BUFS) {
        st = tdm_error_set(TDM_STATUS_INTERNAL, "plan: %d + %d activation buffers (at most %d)",
                           lay->n, scr->n, TDM_ACT_MAX_BUFS);
        goto fail;
    }
    out->n_layers = m->n_layers < TDM_PLAN_MAX_LAYERS ? m->n_layers : TDM_PLAN_MAX_LAYERS;
    for (int i = 0; i < lay->n; i++) {
        const tdm_act_buf *b = &lay->b[i];
        if (b->arena_off >= 0) continue;
        size_t nb = tdm_plan_round(b->nbytes);
        out->act_set += nb;
        if (b->layer < 0) {
            out->act_scratch += nb;   /* the set's rounded input */
        } else {
            out->activations += nb;
            if (b->layer < out->n_layers) out->layer_bytes[b->layer] += nb;
        }
    }
    for (int i = 0; i < scr->n; i++) out->act_scratch += tdm_plan_round(scr->b[i].nbytes);
    out->arena = lay->arena_bytes ? tdm_plan_round(lay->arena_bytes) : 0;
    out->activations += out->arena;
    out->act_set += out->arena;

    size_t rows = (size_t)tdm_model_out_rows(m), needs[3];
    int n_needs = 0, stage = o->stage_hi > 0;
    /* a pipeline stage: the loss only on the last; the norm over its slice */
    if (!stage || m->stage.hi == m->stage.n)
        needs[n_needs++] = (o->loss_batch > 0 ? (size_t)o->loss_batch : B) * rows * sizeof(float);
    if (o->loss_scaling) needs[n_needs++] = sizeof(float);
    if (o->grad_norm)
        needs[n_needs++] = (size_t)tdm_dev_sumsq_chunks(stage ? m->stage.slice_elems
                                                               : (int64_t)pe) * sizeof(double);
    out->step_scratch = tdm_plan_scratch_peak(needs, n_needs);
    if (o->device == TDM_DEVICE_HOST && m->lev.adt == TDM_DTYPE_FLOAT16)
        out->step_scratch += tdm_plan_round(tdm_plan_widen(m, o->batch) * sizeof(float));
    out->in_elems = tdm_model_stage_in_elems(m);
    out->out_elems = tdm_model_stage_out_elems(m);
    out->slice_elems = m->stage.slice_elems;
    if (o->device != TDM_DEVICE_HOST && !stage)   /* tdm_single's input staging */
        out->step_scratch += tdm_plan_round(B * (size_t)tdm_model_in_features(m) * sizeof(float)) +
                             tdm_plan_round(B * rows * sizeof(int32_t));
    out->param_elems = m->param_elems;
    for (int i = 0; i < m->n_params; i++)
        if (m->params_info[i].n_elem > out->largest_param_elems)
            out->largest_param_elems = m->params_info[i].n_elem;
    out->buffer_elems = m->buffer_elems;
    out->out_rows = (int)rows;
    out->n_classes = tdm_model_n_classes(m);
    for (int i = 0; i < m->n_layers && out->n_players < TDM_PLAN_MAX_LAYERS; i++) {
        const tdm_layer *l = &m->layers[i];
        if (l->np <= 0) continue;
        int last = l->p0 + l->np - 1, k = out->n_players++;
        out->player_block[k] = l->block;
        out->player_unit[k] = m->vt ? -1 : l->unit;
        out->player_np[k] = l->np;
        out->player_off[k] = m->params_info[l->p0].offset;
        out->player_end[k] = last + 1 < m->n_params ? m->params_info[last + 1].offset
                                                    : m->param_elems;
    }
    out->peak = out->params + out->grads + out->buffers + out->params_low + out->optim +
                out->activations + out->act_scratch + out->step_scratch;
fail:
    free(lay);
    free(scr);
    tdm_model_free(m);
    return st;
}
