/* tp/tp.c: a tensor-parallel rank's plan, set-up and memory, and its
 * slices of the whole model's layout (initial parameters, checkpoints).
 * The step is tp/step.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tp/tp_impl.h"

static const char *const tdm_tp_split_names[] = {
    [TDM_TP_COLUMN] = "column", [TDM_TP_ROW] = "row", [TDM_TP_REPLICATED] = "replicated"};

const char *tdm_tp_split_name(tdm_tp_split s)
{
    return (unsigned)s <= TDM_TP_REPLICATED ? tdm_tp_split_names[s] : "?";
}

/* ---- the plan ---- */

tdm_status tdm_tp_plan(const tdm_model_spec *spec, int ranks, tdm_tp_split *split,
                       int *n_layers)
{
    TDM_REQUIRE(ranks >= 1, TDM_STATUS_USAGE, "tensor parallelism needs at least 1 rank, got %d",
                ranks);
    if (spec->kind == TDM_MODEL_GPT) {
        TDM_REQUIRE(!spec->head_untied, TDM_STATUS_USAGE,
                    "--mode tp splits the GPT with its head tied to the token embedding; %s has "
                    "an untied head", spec->name);
        TDM_CHECK(tdm_tp_gpt_plan(spec, ranks));
        *n_layers = 0;
        return TDM_STATUS_OK;
    }
    tdm_tp_shape sh;
    TDM_CHECK(tdm_tp_shape_of(spec, &sh));
    int L = sh.ndims - 1;
    TDM_REQUIRE(L >= 2 && L <= TDM_MODEL_MAX_DIMS, TDM_STATUS_USAGE,
                "tensor parallelism splits pairs of linear layers: %s has %d linear "
                "layer%s (give it a hidden layer, e.g. mlp:784-256-10)",
                spec->kind == TDM_MODEL_MLP ? "the MLP" : spec->name, L, L == 1 ? "" : "s");
    for (int l = 0; l < L; l++) {
        if (l % 2 == 1) {
            split[l] = TDM_TP_ROW;
            continue;
        }
        if (l + 1 == L) {
            split[l] = TDM_TP_REPLICATED;
            continue;
        }
        split[l] = TDM_TP_COLUMN;
        int w = sh.dims[l + 1];
        if (w % ranks && sh.line[l] > 0)
            return tdm_error_set(TDM_STATUS_USAGE, "%s line %d: layer fc%d's output width %d "
                                 "(fc%d's input) is not divisible by the %d tensor-parallel "
                                 "ranks", spec->name, sh.line[l], l + 1, w, l + 2, ranks);
        TDM_REQUIRE(w % ranks == 0, TDM_STATUS_USAGE,
                    "layer fc%d's output width %d (fc%d's input) is not divisible by the %d "
                    "tensor-parallel ranks", l + 1, w, l + 2, ranks);
    }
    *n_layers = L;
    return TDM_STATUS_OK;
}

int tdm_tp_step_allreduces(const tdm_model_spec *spec, int ranks)
{
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L = 0, n = 0;
    if (ranks < 2 || tdm_tp_plan(spec, ranks, split, &L)) return 0;
    if (spec->kind == TDM_MODEL_GPT) return 4 * spec->n_layer;
    for (int l = 0; l < L; l++)
        n += split[l] == TDM_TP_ROW || (split[l] == TDM_TP_COLUMN && l > 0);
    return n;
}

int64_t tdm_tp_step_bytes(const tdm_model_spec *spec, int ranks, int batch)
{
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L = 0;
    int64_t floats = 0;
    tdm_tp_shape sh;
    if (ranks < 2 || tdm_tp_plan(spec, ranks, split, &L)) return 0;
    /* the GPT: per block two all-reduces of the stream forward (after
     * attn.c_proj and mlp.c_proj) and two backward (c_attn's and c_fc's
     * input gradients) */
    if (spec->kind == TDM_MODEL_GPT)
        return (int64_t)4 * spec->n_layer * batch * spec->n_ctx * spec->n_embd *
               (int64_t)sizeof(float);
    tdm_tp_shape_of(spec, &sh);
    for (int l = 0; l < L; l++) {
        if (split[l] == TDM_TP_ROW) floats += (int64_t)batch * sh.dims[l + 1];
        if (split[l] == TDM_TP_COLUMN && l > 0) floats += (int64_t)batch * sh.dims[l];
    }
    return floats * (int64_t)sizeof(float);
}

tdm_status tdm_tp_check_seq(const tdm_model_spec *spec, int ranks)
{
    static const char *const kinds[] = {"mlp", "cnn", "gpt"};
    TDM_REQUIRE(spec->kind == TDM_MODEL_GPT, TDM_STATUS_USAGE,
                "--sequence-parallel applies to the GPT; the %s has no sequence",
                (unsigned)spec->kind <= TDM_MODEL_GPT ? kinds[spec->kind] : "model");
    TDM_REQUIRE(ranks >= 1 && spec->n_ctx % ranks == 0, TDM_STATUS_USAGE,
                "the GPT's context of %d tokens is not divisible by the %d tensor-parallel ranks "
                "(--sequence-parallel splits every window's tokens)", spec->n_ctx, ranks);
    return TDM_STATUS_OK;
}

void tdm_tp_step_traffic(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                         tdm_comm_traffic *out)
{
    memset(out, 0, sizeof *out);
    if (!seq_par || spec->kind != TDM_MODEL_GPT || ranks < 2 ||
        tdm_tp_check_seq(spec, ranks) || tdm_tp_gpt_plan(spec, ranks)) {
        out->calls[TDM_COLL_ALL_REDUCE] = tdm_tp_step_allreduces(spec, ranks);
        out->bytes[TDM_COLL_ALL_REDUCE] = tdm_tp_step_bytes(spec, ranks, batch);
        return;
    }
    int64_t L = spec->n_layer, f = (int64_t)sizeof(float);
    int64_t stream = (int64_t)batch * spec->n_ctx * spec->n_embd * f;
    out->calls[TDM_COLL_REDUCE_SCATTER] = out->calls[TDM_COLL_ALL_GATHER] = 4 * L;
    out->bytes[TDM_COLL_REDUCE_SCATTER] = out->bytes[TDM_COLL_ALL_GATHER] = 4 * L * stream;
    out->calls[TDM_COLL_ALL_REDUCE] = L > 0;
    out->bytes[TDM_COLL_ALL_REDUCE] = 4 * L * spec->n_embd * f;
}

void tdm_tp_recompute_traffic(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                              tdm_comm_traffic *out)
{
    memset(out, 0, sizeof *out);
    if (spec->kind != TDM_MODEL_GPT || ranks < 2 || spec->n_layer < 2) return;
    int64_t k = spec->n_layer - 1;
    int64_t stream = (int64_t)batch * spec->n_ctx * spec->n_embd * (int64_t)sizeof(float);
    if (seq_par && !tdm_tp_check_seq(spec, ranks)) {
        out->calls[TDM_COLL_REDUCE_SCATTER] = 2 * k;
        out->calls[TDM_COLL_ALL_GATHER] = 2 * k - 1;
    } else {
        out->calls[TDM_COLL_ALL_REDUCE] = 2 * k;
    }
    for (int c = 0; c < TDM_COLL_COUNT_; c++) out->bytes[c] = out->calls[c] * stream;
}

/* tdm_tp_opts.ckpt: 0 or 1; the MLP path without elementwise layers
 * between its linear ones (the column layers' outputs are recomputed
 * from their inputs by one gemm and its fused relu). */
static tdm_status tdm_tp_check_ckpt(const tdm_tp *p)
{
    TDM_REQUIRE(p->ckpt == 0 || p->ckpt == 1, TDM_STATUS_USAGE,
                "tensor parallelism checkpoints every GPT block or MLP layer pair "
                "(--checkpoint-activations, or 1); segments of %d are not built for tp", p->ckpt);
    if (!p->ckpt || p->spec.kind == TDM_MODEL_GPT) return TDM_STATUS_OK;
    for (int l = 0; l < p->n_layers; l++)
        TDM_REQUIRE(p->layers[l].split != TDM_TP_COLUMN || p->shape.n_post[l + 1] == 0,
                    TDM_STATUS_USAGE,
                    "--checkpoint-activations with --mode tp runs on the MLP and the GPT; this "
                    "model file has elementwise layers (dropout, activations) after a "
                    "column-parallel layer, which tp does not recompute");
    return TDM_STATUS_OK;
}

/* ---- slices ---- */

void tdm_tp_add_tensor(tdm_tp *p, int wp, tdm_tp_cut cut, int parts, int64_t rows, int64_t cols)
{
    int64_t whole = rows * cols, n = cut == TDM_TP_CUT_REPL ? whole : whole / p->size;
    p->tensors[p->n_tensors++] = (tdm_tp_tensor){.wp = wp, .cut = cut, .parts = parts,
                                                 .rows = rows, .cols = cols, .off = p->n_elem,
                                                 .n_elem = n};
    p->n_elem += n;
    if (cut == TDM_TP_CUT_REPL) {
        p->stats.replicated_elems += n;
    } else {
        p->stats.split_elems += n;
        p->stats.whole_split_elems += whole;
    }
}

/* Rank r's slice of t between the whole array w and the rank's l; out:
 * 1 copies whole -> local, 0 local -> whole. */
static void tdm_tp_cut_copy(const tdm_tp *p, const tdm_tp_tensor *t, int r, float *w, float *l,
                            int out)
{
    size_t f = sizeof(float);
    if (t->cut == TDM_TP_CUT_REPL) {
        if (out) memcpy(l, w, (size_t)t->n_elem * f);
        else memcpy(w, l, (size_t)t->n_elem * f);
        return;
    }
    if (t->cut == TDM_TP_CUT_ROWS) {
        int64_t block = t->rows / t->parts, k = block / p->size;
        for (int q = 0; q < t->parts; q++) {
            float *wq = w + (q * block + (int64_t)r * k) * t->cols, *lq = l + q * k * t->cols;
            if (out) memcpy(lq, wq, (size_t)(k * t->cols) * f);
            else memcpy(wq, lq, (size_t)(k * t->cols) * f);
        }
        return;
    }
    int64_t k = t->cols / p->size;
    for (int64_t o = 0; o < t->rows; o++) {
        float *wo = w + o * t->cols + (int64_t)r * k, *lo = l + o * k;
        if (out) memcpy(lo, wo, (size_t)k * f);
        else memcpy(wo, lo, (size_t)k * f);
    }
}

void tdm_tp_slice(const tdm_tp *p, int r, const float *whole, float *local)
{
    for (int i = 0; i < p->n_tensors; i++) {
        const tdm_tp_tensor *t = &p->tensors[i];
        tdm_tp_cut_copy(p, t, r, (float *)whole + tdm_model_param_info(p->tables, t->wp)->offset,
                        local + t->off, 1);
    }
}

/* Replicated tensors come from rank 0's slice (every rank holds the same). */
void tdm_tp_unslice(const tdm_tp *p, const float *locals, float *whole)
{
    for (int r = 0; r < p->size; r++)
        for (int i = 0; i < p->n_tensors; i++) {
            const tdm_tp_tensor *t = &p->tensors[i];
            if (t->cut == TDM_TP_CUT_REPL && r != 0) continue;
            tdm_tp_cut_copy(p, t, r, whole + tdm_model_param_info(p->tables, t->wp)->offset,
                            (float *)locals + (int64_t)r * p->n_elem + t->off, 0);
        }
}

/* ---- set-up ---- */

/* The rank's layers and flat layout (no padding: the slices of a split
 * tensor are exactly 1/N of it). */
static void tdm_tp_layout(tdm_tp *p, const tdm_tp_split *split)
{
    p->max_width = p->shape.dims[0];
    for (int l = 0; l < p->n_layers; l++) {
        tdm_tp_layer *L = &p->layers[l];
        int in = p->shape.dims[l], out = p->shape.dims[l + 1];
        *L = (tdm_tp_layer){.split = split[l], .in = in, .out = out, .lin = in, .lout = out,
                            .relu = p->shape.relu[l], .wp = 2 * l, .bp = 2 * l + 1};
        if (L->split == TDM_TP_COLUMN) L->lout = out / p->size;
        if (L->split == TDM_TP_ROW) L->lin = in / p->size;
        L->b_elems = L->lout;
        L->w_off = p->n_elem;
        tdm_tp_cut wc = L->split == TDM_TP_COLUMN ? TDM_TP_CUT_ROWS
                      : L->split == TDM_TP_ROW    ? TDM_TP_CUT_COLS
                                                  : TDM_TP_CUT_REPL;
        tdm_tp_add_tensor(p, L->wp, wc, 1, out, in);
        L->b_off = p->n_elem;
        tdm_tp_add_tensor(p, L->bp, L->split == TDM_TP_COLUMN ? TDM_TP_CUT_ROWS : TDM_TP_CUT_REPL,
                          1, out, 1);
        if (out > p->max_width) p->max_width = out;
    }
}

/* The configuration words of every rank of comm against rank 0's: a
 * rank that differs is named. Collective over comm whatever came
 * before (prior: an earlier check's failure, kept). */
static tdm_status tdm_tp_check_over(tdm_comm *comm, const char *group, const int64_t *mine,
                                    int n, const char *const *names, tdm_status prior)
{
    int size = tdm_comm_size(comm);
    int64_t *all = calloc((size_t)size * (size_t)n, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "tp: configuration check");
    tdm_comm_set_label(comm, "tp configuration check");
    tdm_status st = tdm_comm_all_gather(comm, mine, all, (size_t)n, TDM_DTYPE_INT64);
    for (int r = 1; !prior && st == TDM_STATUS_OK && r < size; r++)
        for (int f = 0; f < n; f++)
            if (all[r * n + f] != all[f]) {
                st = tdm_error_set(TDM_STATUS_MISMATCH, "tp: rank %d of the %s was configured "
                                   "with another %s than rank 0", r, group, names[f]);
                break;
            }
    free(all);
    return prior ? prior : st;
}

/* Every rank of the job the same model, seed, optimizer and group size:
 * the tensor-parallel group, then (with grad_comm) the dp dimension, so
 * that replicas configured apart are refused too. Both all-gathers run on
 * every rank whatever the first found (no rank is left waiting). */
static tdm_status tdm_tp_check_config(tdm_tp *p, const tdm_tp_opts *o)
{
    enum { CFG_SIZE = 0, CFG_SEED, CFG_SPEC, CFG_OPTIM, CFG_GRAD, CFG_SEQ, CFG_ZERO, CFG_PREC,
           CFG_CKPT, CFG_COUNT_ };
    static const char *const names[] = {"group size", "seed", "model", "optimizer",
                                        "dp gradient sum", "sequence parallelism", "ZeRO",
                                        "precision", "activation checkpointing"};
    uint64_t h = 0xcbf29ce484222325ull, g = h;
    const unsigned char *s = (const unsigned char *)&p->spec;
    for (size_t i = 0; i < sizeof p->spec; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    s = (const unsigned char *)&o->optim;
    for (size_t i = 0; i < sizeof o->optim; i++) g = (g ^ s[i]) * 0x100000001b3ull;
    int64_t mine[CFG_COUNT_] = {p->size, (int64_t)o->seed, (int64_t)h, (int64_t)g,
                                o->grad_comm != NULL, p->seq_par, p->zero, p->prec,
                                p->ckpt};
    tdm_status st = tdm_tp_check_over(p->hcomm, "tensor-parallel group", mine, CFG_COUNT_,
                                      names, TDM_STATUS_OK);
    if (p->gcomm && tdm_comm_size(p->gcomm) > 1)
        st = tdm_tp_check_over(p->gcomm, "dp dimension (another replica)", mine, CFG_COUNT_,
                               names, st);
    return st;
}

/* This rank's slices of the whole model of the seed onto p->params:
 * each whole tensor built alone on the host (its values those
 * tdm_model_init gives it) and cut, so that the rank never holds more of
 * the whole model than its largest tensor. */
static tdm_status tdm_tp_init_params(tdm_tp *p, uint64_t seed)
{
    int64_t big = 1;
    for (int i = 0; i < p->n_tensors; i++) {
        int64_t n = tdm_model_param_info(p->tables, p->tensors[i].wp)->n_elem;
        if (n > big) big = n;
    }
    float *hw = malloc((size_t)big * sizeof(float));
    float *hl = malloc((size_t)(p->n_elem > 0 ? p->n_elem : 1) * sizeof(float));
    tdm_status st = hw && hl ? TDM_STATUS_OK
                             : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "tp: the initial "
                                             "parameters (%lld floats of the rank's, %lld of "
                                             "its largest tensor)", (long long)p->n_elem,
                                             (long long)big);
    for (int i = 0; !st && i < p->n_tensors; i++) {
        const tdm_tp_tensor *t = &p->tensors[i];
        tdm_model_init_param_host(p->tables, seed, t->wp, hw);
        tdm_tp_cut_copy(p, t, p->rank, hw, hl + t->off, 1);
    }
    if (!st)
        st = tdm_dev_copy_from_host(p->dev, p->params, hl, (size_t)p->n_elem * sizeof(float));
    free(hw);
    free(hl);
    return st;
}

/* Parameters, gradients and optimizer, measured by the allocator. */
static tdm_status tdm_tp_alloc_state(tdm_tp *p, const tdm_optim_opts *optim)
{
    tdm_dev_mem_stats a, b;
    int measured = tdm_dev_mem_query(p->dev, &a) == TDM_STATUS_OK;
    size_t bytes = (size_t)tdm_tp_flat_alloc(p) * sizeof(float);
    size_t gbytes = p->zero == TDM_TP_ZERO_GRADS ? (size_t)p->zchunk * sizeof(float) : bytes;
    TDM_CHECK(tdm_dev_alloc_zero(p->dev, bytes, (void **)&p->params));
    /* ZeRO-2: the gradient shard only (the whole gradient is the step's) */
    TDM_CHECK(tdm_dev_alloc_zero(p->dev, gbytes, p->zero == TDM_TP_ZERO_GRADS
                                                     ? (void **)&p->gshard
                                                     : (void **)&p->grads));
    /* ZeRO-1 and 2: state for the replica's chunk only */
    TDM_CHECK(tdm_optim_init_flat(&p->opt, p->dev, p->zero ? p->zchunk : p->n_elem, optim));
    if (measured && tdm_dev_mem_query(p->dev, &b) == TDM_STATUS_OK)
        p->stats.state_alloc_bytes = b.live_bytes - a.live_bytes;
    p->stats.params = bytes;
    p->stats.grads = gbytes;
    p->stats.grads_in_step = p->zero == TDM_TP_ZERO_GRADS ? bytes : 0;
    p->stats.optimizer = tdm_optim_state_bytes(p->opt);
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_grads_take(tdm_tp *p)
{
    size_t bytes = (size_t)tdm_tp_flat_alloc(p) * sizeof(float);
    if (p->zero == TDM_TP_ZERO_GRADS && !p->grads) {
        tdm_status st = tdm_dev_alloc_zero(p->dev, bytes, (void **)&p->grads);
        if (st)
            tdm_error_prefix(st, "tp rank %d: ZeRO-2's whole gradient of the step (%zu bytes)",
                             p->rank, bytes);
        return st;
    }
    /* the padding too: an in-place reduce-scatter may leave scratch there */
    return tdm_dev_memset_zero(p->dev, p->grads, bytes);
}

void tdm_tp_grads_release(tdm_tp *p)
{
    if (p->zero != TDM_TP_ZERO_GRADS) return;
    tdm_dev_free(p->dev, p->grads);
    p->grads = NULL;
}

void tdm_tp_grads_summed(tdm_tp *p, float **g, int64_t *n)
{
    int64_t lo, k;
    if (p->zero != TDM_TP_ZERO_GRADS) {
        *g = p->grads;
        *n = p->n_elem;
        return;
    }
    tdm_tp_zero_range(p, &lo, &k);
    *g = p->gshard;
    *n = k;
}

/* Every rank's outcome of its set-up: this rank's st, or the first other
 * rank's failure, named (nobody waits for a rank that gave up). */
static tdm_status tdm_tp_agree(tdm_tp *p, tdm_status st)
{
    int32_t mine = (int32_t)st, *all = calloc((size_t)p->size, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "tp: set-up");
    char msg[TDM_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", st ? tdm_error_message() : "");
    tdm_comm_set_label(p->hcomm, "tp set-up outcome");
    tdm_status cs = tdm_comm_all_gather(p->hcomm, &mine, all, 1, TDM_DTYPE_INT32);
    tdm_status out = cs ? cs : st;
    for (int r = 0; !cs && !st && r < p->size; r++)
        if (all[r]) {
            out = tdm_error_set((tdm_status)all[r], "tp: rank %d of the tensor-parallel group "
                                "failed its set-up", r);
            break;
        }
    if (st && !cs) tdm_error_set(st, "%s", msg);
    free(all);
    return out;
}

tdm_status tdm_tp_init(tdm_tp **out, tdm_comm *comm, tdm_device *dev, const tdm_model_spec *spec,
                       const tdm_tp_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L = 0;
    TDM_CHECK(tdm_tp_plan(spec, tdm_comm_size(comm), split, &L));
    if (opts->sequence_parallel) TDM_CHECK(tdm_tp_check_seq(spec, tdm_comm_size(comm)));
    tdm_tp *p = calloc(1, sizeof *p);
    TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "tp: calloc");
    *p = (tdm_tp){.comm = comm, .hcomm = opts->host_comm ? opts->host_comm : comm,
                  .gcomm = opts->grad_comm, .dev = dev, .rank = tdm_comm_rank(comm),
                  .size = tdm_comm_size(comm), .spec = *spec, .n_layers = L,
                  .seq_par = opts->sequence_parallel && tdm_comm_size(comm) > 1,
                  .zero = opts->zero, .seed = opts->seed, .prec = opts->precision,
                  .ckpt = opts->ckpt};
    if (spec->kind != TDM_MODEL_GPT) TDM_TRY(tdm_tp_shape_of(spec, &p->shape));
    if (p->zero) {
        if (!p->gcomm || tdm_comm_size(p->gcomm) < 2) {
            st = tdm_error_set(TDM_STATUS_USAGE, "tp: ZeRO-%d shards the %s over the dp "
                               "dimension, which needs at least 2 replicas (--mesh dp=D,tp=N "
                               "with D >= 2)", p->zero == TDM_TP_ZERO_GRADS ? 2 : 1,
                               p->zero == TDM_TP_ZERO_GRADS ? "gradients and optimizer"
                                                            : "optimizer");
            goto fail;
        }
        p->zrep = tdm_comm_rank(p->gcomm);
        p->zreps = tdm_comm_size(p->gcomm);
    }
    if (spec->kind == TDM_MODEL_GPT && !tdm_dev_has_transformer(dev)) {
        st = tdm_error_set(TDM_STATUS_UNSUPPORTED, "tp: device %s has no transformer kernels",
                           tdm_dev_name(dev));
        goto fail;
    }
    TDM_TRY(tdm_model_init_tables(&p->tables, spec));
    if (spec->kind == TDM_MODEL_GPT) TDM_TRY(tdm_tp_gpt_layout(p));
    else tdm_tp_layout(p, split);
    TDM_TRY(tdm_tp_check_ckpt(p));
    if (p->zero) p->zchunk = (p->n_elem + p->zreps - 1) / p->zreps;
    st = tdm_tp_check_config(p, opts);
    if (!st) st = tdm_tp_alloc_state(p, &opts->optim);
    if (!st && p->zero == TDM_TP_ZERO_GRADS && opts->bucket_bytes > 0 && !p->seq_par)
        st = tdm_tp_buckets_init(p, opts->bucket_bytes);
    if (!st) st = tdm_tp_init_params(p, opts->seed);
    TDM_TRY(tdm_tp_agree(p, st));
    *out = p;
    return TDM_STATUS_OK;
fail:
    tdm_tp_free(p);
    return st;
}

static void tdm_tp_free_acts(tdm_tp *p)
{
    for (int l = 0; l < p->n_layers; l++) {
        if (p->layers[l].act != p->ckpt_act) tdm_dev_free(p->dev, p->layers[l].act);
        p->layers[l].act = NULL;
        for (int k = 0; k < p->shape.n_post[l + 1]; k++) {
            tdm_dev_free(p->dev, p->shape.post[l + 1][k].out);
            p->shape.post[l + 1][k].out = NULL;
        }
    }
    free(p->drop_keys);
    p->drop_keys = NULL;
    tdm_dev_free(p->dev, p->x);
    tdm_dev_free(p->dev, p->y);
    tdm_dev_free(p->dev, p->ones);
    tdm_dev_free(p->dev, p->dbuf[0]);
    tdm_dev_free(p->dev, p->dbuf[1]);
    tdm_dev_free(p->dev, p->ckpt_act);
    p->ckpt_act = NULL;
    free(p->host_logits);
    p->x = p->ones = p->dbuf[0] = p->dbuf[1] = p->host_logits = NULL;
    p->y = NULL;
    p->cap = 0;
    p->stats.activations = 0;
    p->stats.act_allocs = 0;
}

void tdm_tp_free(tdm_tp *p)
{
    if (!p) return;
    tdm_tp_free_acts(p);
    tdm_tp_gpt_free(p);
    tdm_dev_free(p->dev, p->low);
    tdm_optim_free(p->opt);
    tdm_dev_free(p->dev, p->params);
    tdm_dev_free(p->dev, p->grads);
    tdm_dev_free(p->dev, p->gshard);
    tdm_tp_buckets_free(p);
    tdm_model_free(p->tables);
    free(p);
}

/* n bytes of activations into *out, counted into *bytes; without a
 * device (tdm_tp_footprint) only counted. */
static tdm_status tdm_tp_act(tdm_tp *p, size_t n, void **out, size_t *bytes)
{
    *bytes += n;
    *out = NULL;
    p->stats.act_allocs++;
    return p->dev ? tdm_dev_alloc(p->dev, n, out) : TDM_STATUS_OK;
}

static tdm_status tdm_tp_reserve_mlp(tdm_tp *p, int B)
{
    size_t f = sizeof(float), bytes = 0, b = (size_t)B, widest = 0;
    /* activation checkpointing: the column layers share one output */
    for (int l = 0; p->ckpt && l < p->n_layers; l++)
        if (p->layers[l].split == TDM_TP_COLUMN && (size_t)p->layers[l].lout > widest)
            widest = (size_t)p->layers[l].lout;
    if (widest) TDM_CHECK(tdm_tp_act(p, b * widest * f, (void **)&p->ckpt_act, &bytes));
    for (int l = 0; l < p->n_layers; l++) {
        size_t n = b * (size_t)p->layers[l].lout * f;
        if (widest && p->layers[l].split == TDM_TP_COLUMN) {
            p->layers[l].act = p->ckpt_act;
            continue;
        }
        TDM_CHECK(tdm_tp_act(p, n, (void **)&p->layers[l].act, &bytes));
        for (int k = 0; k < p->shape.n_post[l + 1]; k++)
            TDM_CHECK(tdm_tp_act(p, n, (void **)&p->shape.post[l + 1][k].out, &bytes));
    }
    TDM_CHECK(tdm_tp_act(p, b * (size_t)p->shape.dims[0] * f, (void **)&p->x, &bytes));
    TDM_CHECK(tdm_tp_act(p, b * sizeof(int32_t), (void **)&p->y, &bytes));
    TDM_CHECK(tdm_tp_act(p, b * f, (void **)&p->ones, &bytes));
    TDM_CHECK(tdm_tp_act(p, b * (size_t)p->max_width * f, (void **)&p->dbuf[0], &bytes));
    TDM_CHECK(tdm_tp_act(p, b * (size_t)p->max_width * f, (void **)&p->dbuf[1], &bytes));
    p->stats.activations = bytes;
    if (!p->dev) return TDM_STATUS_OK;
    float *ones = malloc(b * f);
    TDM_REQUIRE(ones, TDM_STATUS_OUT_OF_MEMORY, "tp: %d floats", B);
    for (int i = 0; i < B; i++) ones[i] = 1.0f;
    tdm_status st = tdm_dev_copy_from_host(p->dev, p->ones, ones, b * f);
    free(ones);
    TDM_CHECK(st);
    p->host_logits = malloc(b * (size_t)p->shape.dims[p->n_layers] * f);
    TDM_REQUIRE(p->host_logits, TDM_STATUS_OUT_OF_MEMORY, "tp: logits of %d samples", B);
    if (p->shape.dropout) {
        p->drop_keys = malloc(b * sizeof *p->drop_keys);
        TDM_REQUIRE(p->drop_keys, TDM_STATUS_OUT_OF_MEMORY, "tp: dropout keys of %d samples", B);
    }
    p->cap = B;
    return TDM_STATUS_OK;
}

/* Activations for B samples, their bytes measured by the allocator
 * (what it handed out, as tdm_tp_alloc_state measures the state). */
tdm_status tdm_tp_reserve(tdm_tp *p, int B)
{
    if (B <= p->cap) return TDM_STATUS_OK;
    tdm_tp_free_acts(p);
    tdm_dev_mem_stats a, b;
    int measured = tdm_dev_mem_query(p->dev, &a) == TDM_STATUS_OK;
    TDM_CHECK(p->gpt ? tdm_tp_gpt_reserve(p, B) : tdm_tp_reserve_mlp(p, B));
    p->stats.act_alloc_bytes = measured && tdm_dev_mem_query(p->dev, &b) == TDM_STATUS_OK
                                   ? b.live_bytes - a.live_bytes
                                   : 0;
    return TDM_STATUS_OK;
}

int tdm_tp_rank(const tdm_tp *p) { return p->rank; }
int tdm_tp_size(const tdm_tp *p) { return p->size; }
tdm_optim *tdm_tp_optim(tdm_tp *p) { return p->opt; }
const tdm_model *tdm_tp_tables(const tdm_tp *p) { return p->tables; }
tdm_tp_split tdm_tp_layer_split(const tdm_tp *p, int l) { return p->layers[l].split; }
int tdm_tp_n_layers(const tdm_tp *p) { return p->n_layers; }
float *tdm_tp_params(tdm_tp *p) { return p->params; }
float *tdm_tp_grads(tdm_tp *p) { return p->grads; }
int64_t tdm_tp_elems(const tdm_tp *p) { return p->n_elem; }
void tdm_tp_get_stats(const tdm_tp *p, tdm_tp_stats *out) { *out = p->stats; }
int tdm_tp_n_tensors(const tdm_tp *p) { return p->n_tensors; }
void tdm_tp_tensor_get(const tdm_tp *p, int i, tdm_tp_tensor_info *out)
{
    const tdm_tp_tensor *t = &p->tensors[i];
    *out = (tdm_tp_tensor_info){.whole_index = t->wp, .split = t->cut != TDM_TP_CUT_REPL,
                                .offset = t->off, .n_elem = t->n_elem};
}

/* ---- what a rank will take ---- */

tdm_status tdm_tp_footprint(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                            tdm_tp_rank_footprint *out)
{
    return tdm_tp_footprint_ckpt(spec, ranks, batch, seq_par, 0, out);
}

tdm_status tdm_tp_dry_new(const tdm_model_spec *spec, int ranks, int seq_par, int ckpt,
                          tdm_tp **out)
{
    tdm_tp_split split[TDM_MODEL_MAX_DIMS];
    int L = 0;
    *out = NULL;
    TDM_CHECK(tdm_tp_plan(spec, ranks, split, &L));
    if (seq_par) TDM_CHECK(tdm_tp_check_seq(spec, ranks));
    tdm_tp *p = calloc(1, sizeof *p);
    TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "tp footprint: calloc");
    *p = (tdm_tp){.size = ranks, .spec = *spec, .n_layers = L, .seq_par = seq_par && ranks > 1,
                  .ckpt = ckpt};
    tdm_status st = spec->kind == TDM_MODEL_GPT ? TDM_STATUS_OK : tdm_tp_shape_of(spec, &p->shape);
    if (!st) st = tdm_model_init_tables(&p->tables, spec);
    if (!st && spec->kind == TDM_MODEL_GPT) st = tdm_tp_gpt_layout(p);
    else if (!st) tdm_tp_layout(p, split);
    if (st) tdm_tp_dry_free(p);
    else *out = p;
    return st;
}

void tdm_tp_dry_free(tdm_tp *p)
{
    if (!p) return;
    tdm_tp_gpt_free(p);   /* nothing was allocated on a device */
    free(p->buckets);
    tdm_model_free(p->tables);
    free(p);
}

tdm_status tdm_tp_footprint_ckpt(const tdm_model_spec *spec, int ranks, int batch, int seq_par,
                                 int ckpt, tdm_tp_rank_footprint *out)
{
    memset(out, 0, sizeof *out);
    /* rank 0's layout and activations without a device (every rank's
     * slices have the same sizes): the set-up's and tdm_tp_reserve's own
     * code, counting instead of allocating */
    tdm_tp *p;
    TDM_CHECK(tdm_tp_dry_new(spec, ranks, seq_par, ckpt, &p));
    tdm_status st = batch >= 1 ? TDM_STATUS_OK
                               : tdm_error_set(TDM_STATUS_INVALID_ARG,
                                               "tp footprint: a batch of %d", batch);
    if (!st) st = p->gpt ? tdm_tp_gpt_reserve(p, batch) : tdm_tp_reserve_mlp(p, batch);
    if (!st) {
        out->elems = p->n_elem;
        out->act_bytes = p->stats.activations;
        out->act_allocs = p->stats.act_allocs;
        out->split_elems = p->stats.split_elems;
        /* the products tdm_tp_gemm runs in a step (tp/step.c's; the
         * recomputed ones are the forward's again) */
        tdm_tp_low_max low = {0};
        if (p->gpt) tdm_tp_gpt_low(p, batch, &low);
        for (int l = 0; !p->gpt && l < p->n_layers; l++)
            tdm_tp_linear_note(&low, batch, p->layers[l].lin, p->layers[l].lout, l > 0);
        out->low_bytes = low.bytes;
        out->wide_elems = low.wide;
        for (int i = 0; i < p->n_tensors; i++)
            if (p->tensors[i].n_elem > out->largest_elems)
                out->largest_elems = p->tensors[i].n_elem;
    }
    tdm_tp_dry_free(p);
    return st;
}

/* ---- checkpoints ---- */

/* A rank-layout device buffer gathered into the whole layout on root. */
static tdm_status tdm_tp_gather_buf(tdm_tp *p, const float *dev_buf, float *whole, int root,
                                    const char *what)
{
    size_t bytes = (size_t)p->n_elem * sizeof(float);
    float *mine = malloc(bytes);
    float *all = p->rank == root ? malloc(bytes * (size_t)p->size) : NULL;
    tdm_status st = mine && (all || p->rank != root)
                        ? TDM_STATUS_OK
                        : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "tp: gathering %s", what);
    if (!st) st = tdm_dev_copy_to_host(p->dev, mine, dev_buf, bytes);
    if (st) {
        /* the others are about to wait in the gather */
        tdm_comm_abort(p->hcomm, tdm_error_message());
    } else {
        tdm_comm_set_label(p->hcomm, "tp gather of the %s", what);
        st = tdm_comm_gather(p->hcomm, mine, all, (size_t)p->n_elem, TDM_DTYPE_FLOAT32, root);
    }
    if (!st && all) tdm_tp_unslice(p, all, whole);
    free(mine);
    free(all);
    return st;
}

int64_t tdm_tp_flat_alloc(const tdm_tp *p)
{
    return p->zero ? p->zchunk * p->zreps : p->n_elem;
}

void tdm_tp_zero_range(const tdm_tp *p, int64_t *lo, int64_t *k)
{
    *lo = (int64_t)p->zrep * p->zchunk;
    *k = *lo >= p->n_elem ? 0 : p->n_elem - *lo < p->zchunk ? p->n_elem - *lo : p->zchunk;
}

/* ZeRO-1 and 2: optimizer state i's chunks all-gathered over the dp dimension
 * into *whole (zreps * zchunk on dev, allocated here; the rank's flat
 * layout in its first n_elem). */
static tdm_status tdm_tp_zero_unshard(tdm_tp *p, int i, float **whole)
{
    size_t c = (size_t)p->zchunk;
    tdm_status st = tdm_dev_alloc_zero(p->dev, c * (size_t)p->zreps * sizeof(float),
                                       (void **)whole);
    if (!st)
        st = tdm_dev_copy(p->dev, *whole + (size_t)p->zrep * c, tdm_optim_state(p->opt, i),
                          c * sizeof(float));
    if (!st) st = tdm_dev_sync(p->dev);
    if (!st) {
        tdm_comm_set_label(p->gcomm, "tp zero1 gather of the %s over the dp dimension",
                           tdm_optim_state_name(p->opt, i));
        st = tdm_comm_all_gather(p->gcomm, *whole + (size_t)p->zrep * c, *whole, c,
                                 TDM_DTYPE_FLOAT32);
    }
    if (st) {
        /* the other replicas are in (or about to enter) the gather */
        tdm_error_prefix(st, "tp rank %d: ZeRO's gather of the %s (replica %d)", p->rank,
                         tdm_optim_state_name(p->opt, i), p->zrep);
        tdm_comm_abort(p->gcomm, tdm_error_message());
    }
    return st;
}

tdm_status tdm_tp_zero_join_gather(tdm_tp *p)
{
    for (int i = 0; p->zero && i < tdm_optim_n_state(p->opt); i++) {
        float *whole = NULL;
        tdm_status st = tdm_tp_zero_unshard(p, i, &whole);
        tdm_dev_free(p->dev, whole);
        TDM_CHECK(st);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_gather_state(tdm_tp *p, tdm_ckpt_host *h, int root)
{
    TDM_CHECK(tdm_tp_gather_buf(p, p->params, h ? h->params : NULL, root, "parameters"));
    if (!h || !h->optim) {
        if (h) h->steps = tdm_optim_steps(p->opt);
        return TDM_STATUS_OK;
    }
    for (int i = 0; i < tdm_optim_n_state(p->opt); i++) {
        float *whole = NULL;
        tdm_status st = p->zero ? tdm_tp_zero_unshard(p, i, &whole) : TDM_STATUS_OK;
        /* the group's others are about to wait in the gather over it */
        if (st) tdm_comm_abort(p->hcomm, tdm_error_message());
        if (!st)
            st = tdm_tp_gather_buf(p, whole ? whole : tdm_optim_state(p->opt, i), h->state[i],
                                   root, tdm_optim_state_name(p->opt, i));
        tdm_dev_free(p->dev, whole);
        TDM_CHECK(st);
    }
    h->steps = tdm_optim_steps(p->opt);
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_gather_grads(tdm_tp *p, float *whole, int root)
{
    TDM_REQUIRE(p->zero != TDM_TP_ZERO_GRADS, TDM_STATUS_UNSUPPORTED,
                "tp: ZeRO-2 keeps only the replica's shard of the gradient between steps: "
                "there is no whole gradient to gather");
    return tdm_tp_gather_buf(p, p->grads, whole, root, "gradients");
}

/* A whole-layout host array's slice onto a rank-layout device buffer:
 * all n_elem of it, or (chunk: ZeRO's optimizer state) the replica's
 * chunk of it. */
static tdm_status tdm_tp_load_buf(tdm_tp *p, const float *whole, float *dev_buf, int chunk)
{
    size_t bytes = (size_t)p->n_elem * sizeof(float);
    float *mine = malloc(bytes);
    TDM_REQUIRE(mine, TDM_STATUS_OUT_OF_MEMORY, "tp: loading %zu bytes", bytes);
    tdm_tp_slice(p, p->rank, whole, mine);
    int64_t lo = 0, k = p->n_elem;
    if (chunk) tdm_tp_zero_range(p, &lo, &k);
    tdm_status st = k ? tdm_dev_copy_from_host(p->dev, dev_buf, mine + lo,
                                               (size_t)k * sizeof(float))
                      : TDM_STATUS_OK;
    free(mine);
    return st;
}

tdm_status tdm_tp_load_state(tdm_tp *p, const tdm_ckpt_host *h)
{
    TDM_CHECK(tdm_tp_load_buf(p, h->params, p->params, 0));
    if (!h->optim) return TDM_STATUS_OK;
    TDM_REQUIRE(tdm_optim_n_state(p->opt) == tdm_optim_kind_n_state(h->optim),
                TDM_STATUS_MISMATCH, "tp: the checkpoint's optimizer keeps %d state buffers, "
                "this run's %d", tdm_optim_kind_n_state(h->optim), tdm_optim_n_state(p->opt));
    for (int i = 0; i < tdm_optim_n_state(p->opt); i++)
        TDM_CHECK(tdm_tp_load_buf(p, h->state[i], tdm_optim_state(p->opt, i),
                                  p->zero != TDM_TP_ZERO_NONE));
    tdm_optim_set_steps(p->opt, h->steps);
    return TDM_STATUS_OK;
}
