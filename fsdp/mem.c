/* fsdp/mem.c: the per-rank memory plan of FSDP, ZeRO-2 and ZeRO-1
 * (tdm_fsdp_plan_memory, fsdp/fsdp.h): models/plan.h's single-device plan
 * of the rank's model at its share of the batch, less the flat buffers
 * FSDP releases, plus the shards (or full copies) each sharding keeps,
 * the optimizer over the shard, the stage's loss gradient, and the pool
 * of gathered units and full gradients at its peak; and the set-up's own
 * peak (the model's flat buffers still there beside the new shards).
 * The units are laid out as fsdp/plan.c lays them out. Not here: the
 * unit plan of a live model (fsdp/plan.c), host memory. */
#include "fsdp/fsdp_impl.h"

#include <string.h>

#include "models/plan.h"

/* what the device allocator counts for a request (core/device.c) */
static size_t tdm_fsdp_mem_round(size_t n)
{
    size_t sz = (n + 63) & ~(size_t)63;
    return sz ? sz : 64;
}

static int64_t tdm_fsdp_mem_align(int64_t n)
{
    return (n + TDM_MODEL_ALIGN_ELEMS - 1) / TDM_MODEL_ALIGN_ELEMS * TDM_MODEL_ALIGN_ELEMS;
}

static size_t tdm_fsdp_mem_max(size_t a, size_t b) { return a > b ? a : b; }

/* ---- the pool, replayed ----
 * The pool's peak (fsdp/units.c) depends on the order its blocks are
 * asked for and given back: a block given back serves any later request
 * it is large enough for (best fit), and a request nothing fits frees
 * every kept block first. So the plan replays the hooks' decisions over
 * the model's parameter-use events for two steps (the first records the
 * unit order and prefetches nothing, the next follows it and prefetches
 * one unit ahead), with the pool's own rules, and takes the most it ever
 * held. Timing enters once: a reduce-scatter is taken to end at the
 * first poll of the hook call after the one that launched it (on a host
 * device it is still in flight when the next unit's gradient is asked
 * for). */

#define TDM_FSDP_SIM_MAX (2 * TDM_PLAN_MAX_LAYERS + 8)

typedef struct tdm_fsdp_sim {
    int full, nu;
    const size_t *bytes;          /* a unit's padded floats, in bytes */
    /* the pool */
    size_t cache[TDM_FSDP_POOL_CACHE];
    int n_cached;
    size_t live, peak;
    /* per unit */
    size_t pbuf[TDM_PLAN_MAX_LAYERS], gbuf[TDM_PLAN_MAX_LAYERS];
    int pending[TDM_PLAN_MAX_LAYERS], n_params[TDM_PLAN_MAX_LAYERS];
    int rs_call[TDM_PLAN_MAX_LAYERS];   /* the hook call that launched its reduce-scatter; -1 */
    int next_rs, call, cur_f, cur_b, prefetch;
    int order[2][TDM_FSDP_SIM_MAX], len[2], pos[2], broken[2];
} tdm_fsdp_sim;

static size_t tdm_fsdp_sim_get(tdm_fsdp_sim *s, size_t nbytes)
{
    int best = -1;
    for (int i = 0; i < s->n_cached; i++)
        if (s->cache[i] >= nbytes && (best < 0 || s->cache[i] < s->cache[best])) best = i;
    if (best >= 0) {
        size_t got = s->cache[best];
        s->cache[best] = s->cache[--s->n_cached];
        return got;
    }
    for (int i = 0; i < s->n_cached; i++) s->live -= tdm_fsdp_mem_round(s->cache[i]);
    s->n_cached = 0;
    s->live += tdm_fsdp_mem_round(nbytes);
    if (s->live > s->peak) s->peak = s->live;
    return nbytes;
}

static void tdm_fsdp_sim_put(tdm_fsdp_sim *s, size_t *blk)
{
    if (!*blk) return;
    if (s->n_cached < TDM_FSDP_POOL_CACHE) s->cache[s->n_cached++] = *blk;
    else s->live -= tdm_fsdp_mem_round(*blk);
    *blk = 0;
}

static void tdm_fsdp_sim_gather(tdm_fsdp_sim *s, int u)
{
    if (s->full && !s->pbuf[u]) s->pbuf[u] = tdm_fsdp_sim_get(s, s->bytes[u]);
}

static void tdm_fsdp_sim_release(tdm_fsdp_sim *s, int u)
{
    if (s->full) tdm_fsdp_sim_put(s, &s->pbuf[u]);
}

/* tdm_fsdp_order_step: the unit expected next, or -1 */
static int tdm_fsdp_sim_order(tdm_fsdp_sim *s, int k, int entry)
{
    int p = ++s->pos[k];
    if (!s->prefetch) {
        if (s->len[k] < TDM_FSDP_SIM_MAX) s->order[k][s->len[k]++] = entry;
        return -1;
    }
    if (s->broken[k] || p >= s->len[k] || s->order[k][p] != entry) {
        s->broken[k] = 1;
        return -1;
    }
    return p + 1 < s->len[k] ? s->order[k][p + 1] : -1;
}

static void tdm_fsdp_sim_finish_rs(tdm_fsdp_sim *s, int u)
{
    s->rs_call[u] = -1;
    tdm_fsdp_sim_put(s, &s->gbuf[u]);
}

static void tdm_fsdp_sim_poll(tdm_fsdp_sim *s)
{
    for (int u = 0; u < s->nu; u++)
        if (s->rs_call[u] >= 0 && s->rs_call[u] < s->call) tdm_fsdp_sim_finish_rs(s, u);
    s->call++;
}

static void tdm_fsdp_sim_forward(tdm_fsdp_sim *s, int u)
{
    if (u != s->cur_f) {
        if (s->cur_f >= 0) tdm_fsdp_sim_release(s, s->cur_f);
        int next = tdm_fsdp_sim_order(s, 0, u);
        s->cur_f = u;
        tdm_fsdp_sim_gather(s, u);
        if (next >= 0 && next != u) tdm_fsdp_sim_gather(s, next);
    }
    s->call++;   /* a forward use polls too; no reduce-scatter is in flight */
}

/* a backward use of units lo..hi (params: they are read) */
static void tdm_fsdp_sim_use(tdm_fsdp_sim *s, int lo, int hi, int params)
{
    int prev = s->cur_b;
    if (prev >= 0 && (prev < lo || prev > hi) && s->pending[prev] > 0)
        tdm_fsdp_sim_release(s, prev);
    for (int u = lo; u <= hi; u++) {
        if (u != s->cur_b) {
            int next = tdm_fsdp_sim_order(s, 1, params ? u : u + s->nu);
            s->cur_b = u;
            if (params) tdm_fsdp_sim_gather(s, u);
            if (next >= 0 && next < s->nu && next != u) tdm_fsdp_sim_gather(s, next);
        } else if (params) {
            tdm_fsdp_sim_gather(s, u);
        }
        if (!s->gbuf[u]) {
            for (;;) {   /* at most one earlier full gradient in flight */
                int n = 0, oldest = -1;
                for (int k = s->nu - 1; k >= 0; k--)
                    if (s->rs_call[k] >= 0) {
                        if (oldest < 0) oldest = k;
                        n++;
                    }
                if (n <= 1) break;
                tdm_fsdp_sim_finish_rs(s, oldest);
            }
            s->gbuf[u] = tdm_fsdp_sim_get(s, s->bytes[u]);
        }
    }
    tdm_fsdp_sim_poll(s);
}

/* a grad-ready hook over n parameters of unit u */
static void tdm_fsdp_sim_hook(tdm_fsdp_sim *s, int u, int n)
{
    s->pending[u] -= n;
    if (s->pending[u] <= 0) {
        s->pending[u] = 0;
        tdm_fsdp_sim_release(s, u);
    }
    while (s->next_rs >= 0 && s->pending[s->next_rs] == 0) s->rs_call[s->next_rs--] = s->call;
    tdm_fsdp_sim_poll(s);
}

static void tdm_fsdp_sim_backward_begin(tdm_fsdp_sim *s)
{
    for (int u = 0; u < s->nu; u++) {
        s->pending[u] = s->n_params[u];
        s->rs_call[u] = -1;
    }
    s->next_rs = s->nu - 1;
    s->cur_b = -1;
    s->pos[1] = -1;
}

static void tdm_fsdp_sim_backward_end(tdm_fsdp_sim *s)
{
    for (int u = 0; u < s->nu; u++)
        if (s->pending[u] > 0) {
            s->pending[u] = 0;
            tdm_fsdp_sim_release(s, u);
        }
    while (s->next_rs >= 0) s->rs_call[s->next_rs--] = s->call;
    for (int u = s->nu - 1; u >= 0; u--) tdm_fsdp_sim_finish_rs(s, u);
    for (int u = 0; u < s->nu; u++) tdm_fsdp_sim_release(s, u);
    for (int i = 0; i < s->n_cached; i++) s->live -= tdm_fsdp_mem_round(s->cache[i]);
    s->n_cached = 0;
}

/* One step's events. unit[k], seg[k]: player k's unit and checkpoint
 * segment (-1: none); np[k]: its parameters. */
static void tdm_fsdp_sim_step(tdm_fsdp_sim *s, const tdm_plan_opts *o, const tdm_plan *p,
                              const int *unit, const int *seg)
{
    int n = p->n_players, gpt = o->spec.kind == TDM_MODEL_GPT;
    s->cur_f = -1;
    s->pos[0] = -1;
    for (int k = 0; k < n; k++) tdm_fsdp_sim_forward(s, unit[k]);
    if (gpt) tdm_fsdp_sim_forward(s, 0);   /* the tied head reads the token embedding */
    tdm_fsdp_sim_backward_begin(s);
    if (gpt) {
        int L = o->spec.n_layer, N = o->ckpt, lnf = unit[n - 1];
        tdm_fsdp_sim_use(s, 0, 0, 1);            /* the head's share of wte */
        tdm_fsdp_sim_use(s, lnf, lnf, 1);
        tdm_fsdp_sim_hook(s, lnf, s->n_params[lnf]);
        for (int l = L - 1; l >= 0; l--) {
            int u = l + 1;
            tdm_fsdp_sim_use(s, u, u, 1);
            if (N > 0 && (l % N == N - 1 || l == L - 1)) tdm_fsdp_sim_use(s, l - l % N + 1, u, 1);
            /* six hooks, the block's parameters final at the last */
            for (int h = 0; h < 5; h++) tdm_fsdp_sim_hook(s, u, 0);
            tdm_fsdp_sim_hook(s, u, s->n_params[u]);
        }
        tdm_fsdp_sim_use(s, 0, 0, 0);            /* the embeddings only add into it */
        tdm_fsdp_sim_hook(s, 0, s->n_params[0]);
    } else {
        /* a CNN segment ends with a pooling: its recomputation comes
         * before the batchnorm's own use, unless the two run fused
         * (fp32 on a host device: the batchnorm's use comes first) */
        int range_first = o->spec.kind == TDM_MODEL_CNN &&
                          (o->precision != TDM_PRECISION_FP32 || o->device != TDM_DEVICE_HOST);
        for (int k = n - 1; k >= 0; k--) {
            int u = unit[k];
            int seg_end = o->ckpt > 0 && seg[k] >= 0 && (k == n - 1 || seg[k + 1] != seg[k]);
            int lo = k;
            while (seg_end && lo > 0 && seg[lo - 1] == seg[k]) lo--;
            if (seg_end && range_first) tdm_fsdp_sim_use(s, unit[lo], u, 1);
            tdm_fsdp_sim_use(s, u, u, 1);
            if (seg_end && !range_first) tdm_fsdp_sim_use(s, unit[lo], u, 1);
            tdm_fsdp_sim_hook(s, u, p->player_np[k]);
        }
    }
    tdm_fsdp_sim_backward_end(s);
}

static size_t tdm_fsdp_mem_pool(const tdm_plan_opts *o, const tdm_plan *p, int full, int nu,
                                const size_t *bytes, const int *unit, const int *seg)
{
    static tdm_fsdp_sim sim;   /* large; the planner is not reentrant-critical */
    tdm_fsdp_sim *s = &sim;
    memset(s, 0, sizeof *s);
    s->full = full;
    s->nu = nu;
    s->bytes = bytes;
    for (int k = 0; k < p->n_players; k++) s->n_params[unit[k]] += p->player_np[k];
    for (int step = 0; step < 2; step++) {
        s->prefetch = step > 0 && full;
        tdm_fsdp_sim_step(s, o, p, unit, seg);
    }
    return s->peak;
}

tdm_status tdm_fsdp_plan_memory(const tdm_plan_opts *o, int world, tdm_fsdp_sharding sharding,
                                int64_t min_unit_elems, tdm_fsdp_mem_plan *out)
{
    memset(out, 0, sizeof *out);
    TDM_REQUIRE(world >= 1 && world <= TDM_FSDP_MAX_RANKS, TDM_STATUS_INVALID_ARG,
                "fsdp plan: %d ranks (expected 1..%d)", world, TDM_FSDP_MAX_RANKS);
    TDM_REQUIRE((unsigned)sharding < TDM_FSDP_SHARDING_COUNT_, TDM_STATUS_INVALID_ARG,
                "fsdp plan: sharding %d", (int)sharding);
    int off = o->offload == TDM_PLAN_OFFLOAD_PARAMS;
    TDM_REQUIRE(!off || sharding == TDM_FSDP_FULL_SHARD, TDM_STATUS_INVALID_ARG,
                "fsdp plan: parameter offload keeps FULL_SHARD's shards in host memory; %s "
                "keeps full parameters on the device", tdm_fsdp_sharding_describe(sharding));
    TDM_REQUIRE(!off || o->device != TDM_DEVICE_HOST, TDM_STATUS_INVALID_ARG,
                "fsdp plan: parameter offload is for accelerators (cuda): a host device's "
                "memory is host memory already");
    tdm_plan *p = &out->model;
    TDM_CHECK(tdm_plan_single(o, p));
    TDM_REQUIRE(p->n_players > 0 && p->n_players < TDM_PLAN_MAX_LAYERS, TDM_STATUS_INVALID_ARG,
                "fsdp plan: %d layers with parameters (expected 1..%d)", p->n_players,
                TDM_PLAN_MAX_LAYERS - 1);
    /* the units, as tdm_fsdp_plan groups them */
    static const int max_units = TDM_PLAN_MAX_LAYERS;
    size_t blk[TDM_PLAN_MAX_LAYERS];
    int seg[TDM_PLAN_MAX_LAYERS], unit[TDM_PLAN_MAX_LAYERS];
    int64_t uoff = 0, uend = 0, so = 0, fo = 0, max_padded = 0;
    int nu = 0, block = -1;
    int gpt = o->spec.kind == TDM_MODEL_GPT;
    for (int k = 0; k <= p->n_players && nu < max_units; k++) {
        int b = k < p->n_players ? p->player_block[k] : -2;
        int extend = k < p->n_players && nu > 0 &&
                     (b == block || uend - uoff < min_unit_elems);
        if (k < p->n_players) unit[k] = extend ? nu - 1 : nu;
        if (k < p->n_players) seg[k] = -1;
        if (k < p->n_players && o->ckpt > 0 && gpt && b >= 1 && b <= o->spec.n_layer)
            seg[k] = (b - 1) / o->ckpt;
        if (k < p->n_players && o->ckpt > 0 && !gpt && p->player_unit[k] >= 0)
            seg[k] = p->player_unit[k] / o->ckpt;
        if (k < p->n_players && extend) {
            uend = p->player_end[k];
            block = b;
            continue;
        }
        if (nu > 0) {   /* the unit [uoff, uend) is complete */
            int64_t n = uend - uoff, shard = (n + world - 1) / world, padded = shard * world;
            blk[nu - 1] = (size_t)padded * sizeof(float);
            so = tdm_fsdp_mem_align(so + shard);
            fo = tdm_fsdp_mem_align(fo + padded);
            if (padded > max_padded) max_padded = padded;
        }
        if (k == p->n_players) break;
        nu++;
        uoff = p->player_off[k];
        uend = p->player_end[k];
        block = b;
    }
    out->n_units = nu;
    out->shard_elems = so;
    out->full_elems = fo;
    size_t sb = tdm_fsdp_mem_round((size_t)(so ? so : 1) * sizeof(float));
    size_t fb = tdm_fsdp_mem_round((size_t)(fo ? fo : 1) * sizeof(float));
    switch (sharding) {
    case TDM_FSDP_FULL_SHARD: out->shards = 2 * sb; break;
    case TDM_FSDP_SHARD_GRAD_OP: out->shards = fb + sb; break;
    default: out->shards = 2 * fb; break;
    }
    if (o->optim.offload == TDM_OPTIM_OFFLOAD_NONE)
        out->optim = (size_t)tdm_optim_kind_n_state(&o->optim) * sb;
    /* offload: both shards and the state over them in host memory (the
     * host device's allocator rounds as the device's does) */
    if (off) {
        out->host = out->shards + (size_t)tdm_optim_kind_n_state(&o->optim) * sb;
        out->shards = out->optim = 0;
    }
    out->comm = tdm_fsdp_mem_round((size_t)o->batch * (size_t)p->out_rows *
                                   (size_t)p->n_classes * sizeof(float));
    if (sharding != TDM_FSDP_SHARD_OPTIM)
        out->gathered = tdm_fsdp_mem_pool(o, p, sharding == TDM_FSDP_FULL_SHARD, nu, blk, unit,
                                          seg);
    /* the running statistics stay; the per-batch ones come with the
     * first forward */
    size_t running = p->buffer_elems ? tdm_fsdp_mem_round((size_t)p->buffer_elems * 4) : 0;
    out->step_peak = out->shards + out->optim + out->comm + out->gathered + p->buffers +
                     p->params_low + p->activations + p->act_scratch + p->step_scratch;
    /* set-up: the model's flat buffers until they are released, the new
     * shards beside them, FULL_SHARD's staging block for the scatter */
    out->init_peak = p->params + p->grads + running + p->params_low + out->shards +
                     (sharding == TDM_FSDP_FULL_SHARD
                          ? tdm_fsdp_mem_round((size_t)max_padded * sizeof(float)) : 0);
    /* offload: the model is built without flat buffers
     * (tdm_model_init_released) and its units drawn and scattered in
     * host memory: the device holds its buffers and 16-bit weights only */
    if (off) out->init_peak = running + p->params_low;
    out->peak = tdm_fsdp_mem_max(out->init_peak, out->step_peak);
    return TDM_STATUS_OK;
}
