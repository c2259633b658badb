/* tp/buckets.c: ZeRO-2's gradient buckets over the dp dimension
 * (tdm_tp_opts.bucket_bytes > 0). The rank's flat gradient is cut, at
 * tensor boundaries, into buckets of consecutive tensors of at least
 * the cap's bytes (the last bucket also holds ZeRO's padding). A bucket's
 * buffer is allocated (zeroed) when backward first writes into it
 * (tdm_tp_grad_at) and, once every tensor in it has its final gradient
 * (tdm_tp_grads_done: backward walks the flat layout from its end; the
 * GPT's tied wte, written first and last, sits at its start), summed
 * over the dp dimension into the replica's shard and freed. A bucket
 * [lo, hi) spans one or more replicas' chunks of c floats: each piece
 * goes to its owner by one reduce (root: the owner; in place on the
 * others), whose sum combines the replicas in rank order 0..D-1 as the
 * reduce-scatter does (core/comm.h): the same bits as ZeRO-1, the same
 * D*c floats in all, in more calls. */
#include "tp/tp_impl.h"

#include <stdlib.h>

/* the host allocator's block (core/device_host.c): bucket bytes are
 * counted as it hands them out */
#define TDM_TP_ALLOC_GRAIN 64

tdm_status tdm_tp_buckets_init(tdm_tp *p, size_t cap_bytes)
{
    int64_t cap = (int64_t)(cap_bytes / sizeof(float));
    if (cap < 1) cap = 1;
    p->buckets = calloc((size_t)p->n_tensors + 1, sizeof *p->buckets);
    TDM_REQUIRE(p->buckets, TDM_STATUS_OUT_OF_MEMORY, "tp: %d gradient buckets", p->n_tensors);
    /* from the layout's end, the order backward completes it in: a
     * bucket closes once it holds cap elements (its lowest tensor the
     * last backward reaches), then reversed into flat order */
    int n = 0;
    int64_t hi = tdm_tp_flat_alloc(p);   /* ZeRO's padding in the last bucket */
    for (int i = p->n_tensors - 1; i >= 0; i--) {
        int64_t lo = p->tensors[i].off;
        if (hi - lo >= cap || i == 0) {
            p->buckets[n++] = (tdm_tp_bucket){.lo = i == 0 ? 0 : lo, .hi = hi};
            hi = lo;
        }
    }
    for (int a = 0, b = n - 1; a < b; a++, b--) {
        tdm_tp_bucket t = p->buckets[a];
        p->buckets[a] = p->buckets[b];
        p->buckets[b] = t;
    }
    p->n_buckets = p->next_bucket = n;
    p->stats.grads_in_step = 0;   /* measured: the most the buckets held at once */
    return TDM_STATUS_OK;
}

/* The bucket holding flat element off. */
static tdm_tp_bucket *tdm_tp_bucket_of(tdm_tp *p, int64_t off)
{
    int lo = 0, hi = p->n_buckets - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (p->buckets[mid].lo <= off) lo = mid;
        else hi = mid - 1;
    }
    return &p->buckets[lo];
}

static tdm_status tdm_tp_bucket_take(tdm_tp *p, tdm_tp_bucket *b)
{
    if (b->held) return TDM_STATUS_OK;
    size_t bytes = (size_t)(b->hi - b->lo) * sizeof(float);
    tdm_status st = p->dev ? tdm_dev_alloc_zero(p->dev, bytes, (void **)&b->buf)
                           : TDM_STATUS_OK;
    if (st) {
        tdm_error_prefix(st, "tp rank %d: ZeRO-2's gradient bucket of elements [%lld, %lld) "
                         "(%zu bytes)", p->rank, (long long)b->lo, (long long)b->hi, bytes);
        return st;
    }
    b->held = 1;
    p->zlive += (bytes + TDM_TP_ALLOC_GRAIN - 1) / TDM_TP_ALLOC_GRAIN * TDM_TP_ALLOC_GRAIN;
    if (p->zlive > p->stats.grads_in_step) p->stats.grads_in_step = p->zlive;
    return TDM_STATUS_OK;
}

static void tdm_tp_bucket_drop(tdm_tp *p, tdm_tp_bucket *b)
{
    if (!b->held) return;
    tdm_dev_free(p->dev, b->buf);
    b->buf = NULL;
    b->held = 0;
    size_t bytes = (size_t)(b->hi - b->lo) * sizeof(float);
    p->zlive -= (bytes + TDM_TP_ALLOC_GRAIN - 1) / TDM_TP_ALLOC_GRAIN * TDM_TP_ALLOC_GRAIN;
}

void tdm_tp_buckets_free(tdm_tp *p)
{
    for (int b = 0; b < p->n_buckets; b++) tdm_tp_bucket_drop(p, &p->buckets[b]);
    free(p->buckets);
    p->buckets = NULL;
    p->n_buckets = 0;
}

tdm_status tdm_tp_grad_at(tdm_tp *p, int64_t off, float **g)
{
    if (!p->buckets) {
        *g = p->grads + off;
        return TDM_STATUS_OK;
    }
    tdm_tp_bucket *b = tdm_tp_bucket_of(p, off);
    TDM_CHECK(tdm_tp_bucket_take(p, b));
    *g = p->dev ? b->buf + (off - b->lo) : NULL;
    return TDM_STATUS_OK;
}

/* Bucket b's sum over the dp dimension into the owners' shards, piece
 * by piece in ascending order, then its buffer freed. */
static tdm_status tdm_tp_bucket_reduce(tdm_tp *p, tdm_tp_bucket *b)
{
    int64_t c = p->zchunk;
    TDM_CHECK(tdm_tp_bucket_take(p, b));   /* nothing written: a zero gradient */
    if (!p->dev) {
        tdm_tp_bucket_drop(p, b);
        return TDM_STATUS_OK;
    }
    TDM_CHECK(tdm_dev_sync(p->dev));
    for (int64_t a = b->lo; a < b->hi;) {
        int owner = (int)(a / c);
        int64_t e = (int64_t)(owner + 1) * c < b->hi ? (int64_t)(owner + 1) * c : b->hi;
        float *src = b->buf + (a - b->lo);
        float *dst = owner == p->zrep ? p->gshard + (a - (int64_t)owner * c) : src;
        tdm_comm_set_label(p->gcomm, "tp zero2 reduce of gradient bucket [%lld, %lld) to "
                           "replica %d over the dp dimension", (long long)a, (long long)e, owner);
        tdm_status st = tdm_comm_reduce(p->gcomm, src, dst, (size_t)(e - a), TDM_DTYPE_FLOAT32,
                                        TDM_REDOP_SUM, owner);
        if (st) {
            tdm_error_prefix(st, "tp rank %d: ZeRO-2's reduce of gradient elements [%lld, "
                             "%lld) to replica %d over the dp dimension (replica %d)", p->rank,
                             (long long)a, (long long)e, owner, p->zrep);
            return st;
        }
        a = e;
    }
    tdm_tp_bucket_drop(p, b);
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_grads_done(tdm_tp *p, int64_t from)
{
    if (!p->buckets || !p->flush_bwd) return TDM_STATUS_OK;
    while (p->next_bucket > 0 && p->buckets[p->next_bucket - 1].lo >= from) {
        TDM_CHECK(tdm_tp_bucket_reduce(p, &p->buckets[p->next_bucket - 1]));
        p->next_bucket--;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_buckets_flush(tdm_tp *p)
{
    while (p->next_bucket > 0) {
        TDM_CHECK(tdm_tp_bucket_reduce(p, &p->buckets[p->next_bucket - 1]));
        p->next_bucket--;
    }
    p->next_bucket = p->n_buckets;   /* the next step's */
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_buckets_zero(tdm_tp *p)
{
    for (int b = 0; b < p->n_buckets; b++)
        if (p->buckets[b].held)
            TDM_CHECK(tdm_dev_memset_zero(p->dev, p->buckets[b].buf,
                                          (size_t)(p->buckets[b].hi - p->buckets[b].lo) *
                                              sizeof(float)));
    p->next_bucket = p->n_buckets;
    return TDM_STATUS_OK;
}

tdm_status tdm_tp_zero2_bucket_bytes(const tdm_model_spec *spec, int ranks, int reps,
                                     size_t cap_bytes, size_t *held)
{
    *held = 0;
    TDM_REQUIRE(reps >= 2 && cap_bytes > 0, TDM_STATUS_INVALID_ARG,
                "tp: ZeRO-2's buckets over %d replicas with a cap of %zu bytes", reps, cap_bytes);
    tdm_tp *p;
    TDM_CHECK(tdm_tp_dry_new(spec, ranks, 0, 0, &p));
    p->zero = TDM_TP_ZERO_GRADS;
    p->zreps = reps;
    p->zchunk = (p->n_elem + reps - 1) / reps;
    tdm_status st = tdm_tp_buckets_init(p, cap_bytes);
    /* one step's backward, in its order of first writes and completions */
    p->flush_bwd = 1;
    if (!st && p->gpt) st = tdm_tp_gpt_grads_replay(p);
    for (int l = p->n_layers - 1; !st && !p->gpt && l >= 0; l--) {
        float *g;
        st = tdm_tp_grad_at(p, p->layers[l].w_off, &g);
        if (!st) st = tdm_tp_grad_at(p, p->layers[l].b_off, &g);
        if (!st) st = tdm_tp_grads_done(p, p->layers[l].w_off);
    }
    if (!st) st = tdm_tp_buckets_flush(p);
    *held = p->stats.grads_in_step;
    tdm_tp_dry_free(p);
    return st;
}
