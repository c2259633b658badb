/* dp/dp.c: DataParallel over the devices of one process (see dp/dp.h):
 * replicas, the per-step buffers, replicate / scatter / parallel_apply /
 * gather / reduce as fork/join rounds of the thread pool (dp/pool.c), and
 * the whole training step with per-device, per-phase timings.
 * Not here: the pool's waits (dp/pool.c), the layers (models/), DDP.
 *
 * Every round is one phase, so a phase's wall-clock is exactly the round's
 * critical path; each device's thread times its own share. Rounds publish
 * everything the caller did before them and everything every thread did in
 * them (dp/pool.h), so no other synchronisation is needed here: between
 * rounds only the calling thread runs. */
#include "dp/dp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "dp/pool.h"
#include "models/precision.h"
#include "models/recompute.h"

struct tdm_dp {
    int n;                                   /* devices */
    int out;                                 /* output device position (holds the master) */
    int all_host;                            /* every device is a host device */
    tdm_device *dev[TDM_DP_MAX_DEVICES];     /* borrowed */
    tdm_model *rep[TDM_DP_MAX_DEVICES];      /* rep[out] = master (borrowed); others owned */
    tdm_dp_pool *pool;
    int in_features, n_classes;
    int out_elems;                           /* logits per sample: out_rows * n_classes */
    int out_rows;                            /* targets per sample (1; a GPT's T) */
    int64_t param_elems, buffer_elems;
    /* Step buffers, room for cap rows each: per device the input chunk and
     * (not on the output device) the logit-gradient chunk; on the output
     * device the gathered logits, their gradients and the labels. */
    int cap;
    float *x_chunk[TDM_DP_MAX_DEVICES];
    float *dy_chunk[TDM_DP_MAX_DEVICES];
    float *logits_all, *dlogits_all;
    int32_t *labels;
    float *stage;                            /* non-host reduce: param_elems on out */
    /* Accelerators with a collective group (CUDA: NCCL, through the hook
     * in core/device.h): replicate is a broadcast from the master and the
     * reduce a reduce-sum onto it when every device takes part; NULL (host
     * devices, emulators, builds without CUDA): staged copies. */
    tdm_dev_group *group;
    const float *logits[TDM_DP_MAX_DEVICES]; /* each replica's last forward output */
    tdm_dp_timings t;                        /* being filled */
    tdm_dp_timings last;                     /* of the last complete step */
};

void tdm_dp_opts_default(tdm_dp_opts *o)
{
    memset(o, 0, sizeof *o);
    o->output_device = 0;
    o->spin_us = -1;
}

/* ---- devices ---- */

tdm_status tdm_dp_devices_open(const char *spec, tdm_device **devices, int *n_out)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device_list list;
    int n = 0;
    *n_out = 0;
    TDM_CHECK(tdm_device_list_parse(&list, spec));
    TDM_REQUIRE(list.count >= 1, TDM_STATUS_NO_DEVICE, "device spec '%s': no device", spec);
    for (n = 0; n < list.count; n++)
        TDM_TRY(tdm_device_open(&devices[n], list.kind == TDM_DEVICE_CUDA ? "cuda" : "cpu",
                                list.index[n], 1));
    *n_out = n;
    return TDM_STATUS_OK;
fail:
    tdm_error_prefix(st, "device spec '%s'", spec);
    tdm_dp_devices_close(devices, n);
    return st;
}

void tdm_dp_devices_close(tdm_device **devices, int n)
{
    for (int i = 0; i < n; i++) {
        tdm_device_free(devices[i]);
        devices[i] = NULL;
    }
}

/* ---- rounds ---- */

static uint64_t tdm_dp_prefix_mask(int n)
{
    return n >= 64 ? ~UINT64_C(0) : (UINT64_C(1) << n) - 1;
}

/* Runs fn on the slots of mask as one phase: the round's wall-clock goes to
 * wall[phase], each slot's own time to device[slot][phase]. A failure comes
 * back as "replica i on device <name>: <message>". */
static tdm_status tdm_dp_round(tdm_dp *dp, tdm_phase phase, uint64_t mask, tdm_dp_pool_fn fn,
                               void *ctx)
{
    int failed = -1;
    uint64_t t0 = tdm_time_ns();
    tdm_status st = tdm_dp_pool_run(dp->pool, mask, fn, ctx, &failed);
    dp->t.wall.ms[phase] += tdm_time_ms_since(t0);
    for (int i = 0; i < dp->n; i++)
        if (mask >> i & 1) dp->t.device[i].ms[phase] += tdm_dp_pool_slot_ms(dp->pool, i);
    if (st != TDM_STATUS_OK && failed >= 0)
        return tdm_error_prefix(st, "replica %d on device %s", failed,
                                tdm_dev_name(dp->dev[failed]));
    return st;
}

static void tdm_dp_free_buffers(tdm_dp *dp)
{
    tdm_device *o = dp->dev[dp->out];
    for (int i = 0; i < dp->n; i++) {
        tdm_dev_free(dp->dev[i], dp->x_chunk[i]);
        tdm_dev_free(dp->dev[i], dp->dy_chunk[i]);
        dp->x_chunk[i] = dp->dy_chunk[i] = NULL;
    }
    tdm_dev_free(o, dp->logits_all);
    tdm_dev_free(o, dp->dlogits_all);
    tdm_dev_free(o, dp->labels);
    dp->logits_all = dp->dlogits_all = NULL;
    dp->labels = NULL;
    dp->cap = 0;
}

/* Room for a batch of `batch` rows: any one device may get all of them
 * (explicit chunk sizes), so every chunk buffer holds batch rows. */
static tdm_status tdm_dp_reserve(tdm_dp *dp, int batch)
{
    tdm_status st = TDM_STATUS_OK;
    if (batch <= dp->cap) return TDM_STATUS_OK;
    tdm_dp_free_buffers(dp);
    size_t rows = (size_t)batch;
    size_t x_nbytes = rows * (size_t)dp->in_features * sizeof(float);
    size_t y_nbytes = rows * (size_t)dp->out_elems * sizeof(float);
    tdm_device *o = dp->dev[dp->out];
    for (int i = 0; i < dp->n; i++) {
        TDM_TRY(tdm_dev_alloc(dp->dev[i], x_nbytes, (void **)&dp->x_chunk[i]));
        if (i != dp->out) TDM_TRY(tdm_dev_alloc(dp->dev[i], y_nbytes, (void **)&dp->dy_chunk[i]));
    }
    TDM_TRY(tdm_dev_alloc(o, y_nbytes, (void **)&dp->logits_all));
    TDM_TRY(tdm_dev_alloc(o, y_nbytes, (void **)&dp->dlogits_all));
    TDM_TRY(tdm_dev_alloc(o, rows * (size_t)dp->out_rows * sizeof(int32_t), (void **)&dp->labels));
    dp->cap = batch;
    return TDM_STATUS_OK;
fail:
    tdm_dp_free_buffers(dp);
    return tdm_error_prefix(st, "DataParallel: buffers for a batch of %d", batch);
}

/* ---- init / free ---- */

/* Defined before tdm_dp_init, whose fail path runs it on any prefix of
 * what it made. */
void tdm_dp_free(tdm_dp *dp)
{
    if (!dp) return;
    tdm_dp_pool_free(dp->pool);  /* first: no thread touches what follows */
    tdm_dp_free_buffers(dp);
    tdm_dev_group_free(dp->group);
    if (dp->stage) tdm_dev_free(dp->dev[dp->out], dp->stage);
    for (int i = 0; i < dp->n; i++)
        if (i != dp->out) tdm_model_free(dp->rep[i]);
    free(dp);
}

tdm_status tdm_dp_init(tdm_dp **out, tdm_model *master, tdm_device **devices, int n_devices,
                       const tdm_dp_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_dp_opts o;
    tdm_dp *dp = NULL;
    *out = NULL;
    if (opts) o = *opts;
    else tdm_dp_opts_default(&o);
    TDM_REQUIRE(master, TDM_STATUS_INVALID_ARG, "DataParallel: NULL master model");
    TDM_REQUIRE(n_devices >= 1, TDM_STATUS_INVALID_ARG,
                "DataParallel needs at least one device (got %d)", n_devices);
    TDM_REQUIRE(n_devices <= TDM_DP_MAX_DEVICES, TDM_STATUS_INVALID_ARG,
                "DataParallel: %d devices (at most %d)", n_devices, TDM_DP_MAX_DEVICES);
    TDM_REQUIRE(devices, TDM_STATUS_INVALID_ARG, "DataParallel: NULL device list");
    for (int i = 0; i < n_devices; i++) {
        TDM_REQUIRE(devices[i], TDM_STATUS_INVALID_ARG, "DataParallel: device %d is NULL", i);
        for (int j = 0; j < i; j++)
            TDM_REQUIRE(devices[j] != devices[i] &&
                            (tdm_dev_kind(devices[j]) != tdm_dev_kind(devices[i]) ||
                             tdm_dev_index(devices[j]) != tdm_dev_index(devices[i]) ||
                             (o.allow_same_device && tdm_dev_kind(devices[i]) != TDM_DEVICE_HOST)),
                        TDM_STATUS_INVALID_ARG,
                        "DataParallel: device %s is listed twice (positions %d and %d)",
                        tdm_dev_name(devices[i]), j, i);
    }
    TDM_REQUIRE(o.output_device >= 0 && o.output_device < n_devices, TDM_STATUS_INVALID_ARG,
                "DataParallel: output device %d is not in the device list (positions 0..%d)",
                o.output_device, n_devices - 1);
    tdm_device *md = tdm_model_device(master);
    tdm_device *od = devices[o.output_device];
    TDM_REQUIRE(md == od || (tdm_dev_kind(md) == tdm_dev_kind(od) &&
                             tdm_dev_index(md) == tdm_dev_index(od)),
                TDM_STATUS_INVALID_ARG,
                "DataParallel: the master model lives on %s but the output device is %s "
                "(position %d): build the master on the output device",
                tdm_dev_name(md), tdm_dev_name(od), o.output_device);

    dp = calloc(1, sizeof *dp);
    if (!dp) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "DataParallel: out of memory");
    dp->n = n_devices;
    dp->out = o.output_device;
    dp->all_host = 1;
    for (int i = 0; i < n_devices; i++) {
        dp->dev[i] = devices[i];
        if (tdm_dev_kind(devices[i]) != TDM_DEVICE_HOST) dp->all_host = 0;
    }
    dp->in_features = tdm_model_in_features(master);
    dp->n_classes = tdm_model_n_classes(master);
    dp->out_rows = tdm_model_out_rows(master);
    dp->out_elems = dp->out_rows * dp->n_classes;
    dp->param_elems = tdm_model_param_elems(master);
    dp->buffer_elems = tdm_model_buffer_elems(master);
    dp->rep[dp->out] = master;
    for (int i = 0; i < n_devices; i++) {
        if (i == dp->out) continue;
        st = tdm_model_clone(&dp->rep[i], master, devices[i]);
        if (st != TDM_STATUS_OK) {
            tdm_error_prefix(st, "DataParallel: replica %d on device %s", i,
                             tdm_dev_name(devices[i]));
            goto fail;
        }
    }
    if (!dp->all_host) {
        TDM_TRY(tdm_dev_alloc(od, (size_t)dp->param_elems * sizeof(float), (void **)&dp->stage));
        if (n_devices > 1) {
            st = tdm_dev_group_init(&dp->group, devices, n_devices);
            if (st != TDM_STATUS_OK) {
                /* still correct, only slower: every copy is staged */
                if (st != TDM_STATUS_UNSUPPORTED)
                    TDM_WARN(DP, "DataParallel: no device group (%s); replicate and reduce "
                             "copy device by device", tdm_error_message());
                tdm_error_clear();
                dp->group = NULL;
                st = TDM_STATUS_OK;
            }
        }
    }
    TDM_TRY(tdm_dp_pool_init(&dp->pool, n_devices, dp->out, o.spin_us));
    dp->t.n_devices = dp->last.n_devices = n_devices;
    TDM_INFO(DP, "DataParallel over %d devices, output %s, %lld parameters, pool spin %d us",
             n_devices, tdm_dev_name(od), (long long)dp->param_elems,
             tdm_dp_pool_spin_us(dp->pool));
    *out = dp;
    return TDM_STATUS_OK;
fail:
    tdm_dp_free(dp);
    return st;
}

int tdm_dp_n_devices(const tdm_dp *dp) { return dp->n; }
int tdm_dp_output_device(const tdm_dp *dp) { return dp->out; }
tdm_device *tdm_dp_device(const tdm_dp *dp, int i)
{
    return i >= 0 && i < dp->n ? dp->dev[i] : NULL;
}
int tdm_dp_uses_device_group(const tdm_dp *dp) { return dp->group != NULL; }

tdm_model *tdm_dp_replica(const tdm_dp *dp, int i)
{
    return i >= 0 && i < dp->n ? dp->rep[i] : NULL;
}
const tdm_dp_timings *tdm_dp_last_timings(const tdm_dp *dp) { return &dp->last; }

/* ---- slices ---- */

/* Slice `rank` of `n` over n_elem floats, in whole 64-byte lines so that no
 * two threads write one line. */
static void tdm_dp_slice(int64_t n_elem, int rank, int n, int64_t *lo, int64_t *hi)
{
    int64_t lines = (n_elem + 15) / 16;
    *lo = lines * rank / n * 16;
    *hi = lines * (rank + 1) / n * 16;
    if (*hi > n_elem) *hi = n_elem;
    if (*lo > *hi) *lo = *hi;
}

/* Host rounds that split a flat buffer over threads: every thread of the
 * step (mask, plus the output device's) takes one slice. */
typedef struct tdm_dp_slice_ctx {
    tdm_dp *dp;
    uint64_t replicas;    /* replicas other than the master to work on */
    int zero_master;      /* replicate: also zero the master's gradients */
    int n_threads;
    int rank[TDM_DP_MAX_DEVICES];   /* slot -> slice index */
} tdm_dp_slice_ctx;

static uint64_t tdm_dp_slice_setup(tdm_dp *dp, uint64_t mask, tdm_dp_slice_ctx *c)
{
    memset(c, 0, sizeof *c);
    c->dp = dp;
    c->replicas = mask & ~(UINT64_C(1) << dp->out);
    uint64_t threads = mask | UINT64_C(1) << dp->out;
    for (int i = 0; i < dp->n; i++)
        if (threads >> i & 1) c->rank[i] = c->n_threads++;
    return threads;
}

/* ---- replicate ---- */

/* Accelerators: each device's thread copies the master onto its replica. */
static tdm_status tdm_dp_replicate_task(void *ctx, int i)
{
    tdm_dp *dp = ctx;
    tdm_status st = TDM_STATUS_OK;
    if (i == dp->out) return TDM_STATUS_OK;   /* the master is its own replica */
    tdm_model *m = dp->rep[i], *src = dp->rep[dp->out];
    tdm_device *d = dp->dev[i], *sd = dp->dev[dp->out];
    TDM_TRY(tdm_dev_copy_between(d, tdm_model_params(m), sd, tdm_model_params(src),
                                 (size_t)dp->param_elems * sizeof(float)));
    TDM_TRY(tdm_dev_copy_between(d, tdm_model_buffers(m), sd, tdm_model_buffers(src),
                                 (size_t)dp->buffer_elems * sizeof(float)));
    TDM_TRY(tdm_model_zero_grad(m));
    return TDM_STATUS_OK;
fail:
    return tdm_error_prefix(st, "replicate");
}

/* With a device group: the broadcast has refreshed the replicas; each
 * device's thread zeroes its own replica's gradients on its own stream. */
static tdm_status tdm_dp_zero_replica_task(void *ctx, int i)
{
    tdm_dp *dp = ctx;
    if (i == dp->out) return TDM_STATUS_OK;
    tdm_status st = tdm_model_zero_grad(dp->rep[i]);
    return st == TDM_STATUS_OK ? st : tdm_error_prefix(st, "replicate: zero_grad");
}

/* Group broadcast of the master's flat parameter and buffer buffers to
 * every replica, from the calling thread (the group is driven by one
 * thread), timed as replicate on the output device. */
static tdm_status tdm_dp_replicate_group(tdm_dp *dp)
{
    tdm_status st = TDM_STATUS_OK;
    float *bufs[TDM_DP_MAX_DEVICES];
    uint64_t t0 = tdm_time_ns();
    for (int i = 0; i < dp->n; i++) bufs[i] = tdm_model_params(dp->rep[i]);
    TDM_TRY(tdm_dev_group_broadcast(dp->group, bufs, (size_t)dp->param_elems, dp->out));
    if (dp->buffer_elems > 0) {
        for (int i = 0; i < dp->n; i++) bufs[i] = tdm_model_buffers(dp->rep[i]);
        TDM_TRY(tdm_dev_group_broadcast(dp->group, bufs, (size_t)dp->buffer_elems, dp->out));
    }
fail:
    dp->t.wall.ms[TDM_PHASE_REPLICATE] += tdm_time_ms_since(t0);
    dp->t.device[dp->out].ms[TDM_PHASE_REPLICATE] += tdm_time_ms_since(t0);
    if (st != TDM_STATUS_OK) return tdm_error_prefix(st, "replicate: broadcast from %s",
                                                     tdm_dev_name(dp->dev[dp->out]));
    return st;
}

/* Host devices share one address space: thread t copies slice t of the
 * master's parameters and buffers onto every replica and zeroes slice t of
 * their gradients. Same bytes as one copy per replica, spread over all the
 * step's threads instead of leaving the master's idle. */
static tdm_status tdm_dp_replicate_slice_task(void *ctx, int i)
{
    tdm_dp_slice_ctx *c = ctx;
    tdm_dp *dp = c->dp;
    tdm_status st = TDM_STATUS_OK;
    tdm_model *src = dp->rep[dp->out];
    int64_t plo, phi, blo, bhi;
    tdm_dp_slice(dp->param_elems, c->rank[i], c->n_threads, &plo, &phi);
    tdm_dp_slice(dp->buffer_elems, c->rank[i], c->n_threads, &blo, &bhi);
    if (c->zero_master) {
        tdm_device *od = dp->dev[dp->out];
        TDM_TRY(tdm_dev_memset_zero(od, tdm_model_grads(src) + plo,
                                    (size_t)(phi - plo) * sizeof(float)));
    }
    for (int j = 0; j < dp->n; j++) {
        if (!(c->replicas >> j & 1)) continue;
        tdm_model *m = dp->rep[j];
        tdm_device *d = dp->dev[j];
        TDM_TRY(tdm_dev_copy(d, tdm_model_params(m) + plo, tdm_model_params(src) + plo,
                             (size_t)(phi - plo) * sizeof(float)));
        TDM_TRY(tdm_dev_copy(d, tdm_model_buffers(m) + blo, tdm_model_buffers(src) + blo,
                             (size_t)(bhi - blo) * sizeof(float)));
        TDM_TRY(tdm_dev_memset_zero(d, tdm_model_grads(m) + plo,
                                    (size_t)(phi - plo) * sizeof(float)));
    }
    return TDM_STATUS_OK;
fail:
    return tdm_error_prefix(st, "replicate");
}

/* zero_master: also zero the master's gradients (tdm_dp_step's
 * optimizer.zero_grad), sliced over the same threads instead of on the
 * caller alone while the others wait; timed as part of replicate. */
static tdm_status tdm_dp_replicate_mask(tdm_dp *dp, uint64_t mask, int zero_master)
{
    tdm_model *master = dp->rep[dp->out];
    /* plain fields, written before the round publishes them */
    for (int j = 0; j < dp->n; j++)
        if ((mask >> j & 1) && j != dp->out)
            tdm_model_set_train(dp->rep[j], tdm_model_is_train(master));
    if (!dp->all_host) {
        if (zero_master) TDM_CHECK(tdm_model_zero_grad(master));
        /* A collective needs every rank: the group only when all take part. */
        if (dp->group && mask == tdm_dp_prefix_mask(dp->n)) {
            TDM_CHECK(tdm_dp_replicate_group(dp));
            return tdm_dp_round(dp, TDM_PHASE_REPLICATE, mask, tdm_dp_zero_replica_task, dp);
        }
        return tdm_dp_round(dp, TDM_PHASE_REPLICATE, mask, tdm_dp_replicate_task, dp);
    }
    tdm_dp_slice_ctx c;
    uint64_t threads = tdm_dp_slice_setup(dp, mask, &c);
    c.zero_master = zero_master;
    if (!c.replicas && !zero_master) return TDM_STATUS_OK;
    return tdm_dp_round(dp, TDM_PHASE_REPLICATE, threads, tdm_dp_replicate_slice_task, &c);
}

tdm_status tdm_dp_replicate(tdm_dp *dp, int n_active)
{
    TDM_REQUIRE(n_active >= 1 && n_active <= dp->n, TDM_STATUS_INVALID_ARG,
                "replicate: %d active replicas (expected 1..%d)", n_active, dp->n);
    return tdm_dp_replicate_mask(dp, tdm_dp_prefix_mask(n_active), 0);
}

/* ---- scatter ---- */

tdm_status tdm_dp_scatter_sizes(int batch, int n_devices, const int *explicit_sizes,
                                int *sizes_out, int *n_chunks_out)
{
    TDM_REQUIRE(batch >= 1, TDM_STATUS_INVALID_ARG,
                "scatter: batch %d (a batch needs at least one sample)", batch);
    TDM_REQUIRE(n_devices >= 1 && n_devices <= TDM_DP_MAX_DEVICES, TDM_STATUS_INVALID_ARG,
                "scatter: %d devices (expected 1..%d)", n_devices, TDM_DP_MAX_DEVICES);
    int n_chunks = 0;
    if (explicit_sizes) {
        int64_t sum = 0;
        for (int i = 0; i < n_devices; i++) {
            TDM_REQUIRE(explicit_sizes[i] >= 0, TDM_STATUS_INVALID_ARG,
                        "scatter: chunk size %d for device %d is negative", explicit_sizes[i], i);
            sum += explicit_sizes[i];
        }
        TDM_REQUIRE(sum == batch, TDM_STATUS_INVALID_ARG,
                    "scatter: chunk sizes sum to %lld but the batch has %d rows",
                    (long long)sum, batch);
        for (int i = 0; i < n_devices; i++) {
            sizes_out[i] = explicit_sizes[i];
            n_chunks += explicit_sizes[i] > 0;
        }
    } else {
        /* torch.chunk: size = ceil(N/n); ceil(N/size) chunks, last short. */
        int size = (batch + n_devices - 1) / n_devices;
        int left = batch;
        for (int i = 0; i < n_devices; i++) {
            sizes_out[i] = left < size ? left : size;
            left -= sizes_out[i];
            n_chunks += sizes_out[i] > 0;
        }
    }
    if (n_chunks_out) *n_chunks_out = n_chunks;
    return TDM_STATUS_OK;
}

typedef struct tdm_dp_copy_ctx {
    tdm_dp *dp;
    tdm_device *other_dev;   /* scatter: source (NULL: host); gather: unused */
    const float *src;        /* scatter: the whole batch */
    float *dst;              /* gather: the whole batch on the output device */
    const float *const *chunk_src;   /* gather */
    float *const *chunk_dst;         /* scatter */
    const int *sizes;
    int64_t row_elems;
    int64_t offset[TDM_DP_MAX_DEVICES];   /* first row of each chunk */
} tdm_dp_copy_ctx;

/* Checks the chunk sizes (>= 0, a buffer for each non-empty chunk),
 * sets the row offsets, the mask of non-empty chunks and their total. */
static tdm_status tdm_dp_chunks(tdm_dp_copy_ctx *c, int n, const char *op,
                                const void *const *bufs, const char *buf_name, uint64_t *mask,
                                int64_t *total)
{
    int64_t off = 0;
    *mask = 0;
    for (int i = 0; i < n; i++) {
        TDM_REQUIRE(c->sizes[i] >= 0 && (c->sizes[i] == 0 || bufs[i]), TDM_STATUS_INVALID_ARG,
                    "%s: chunk %d has size %d%s%s", op, i, c->sizes[i],
                    c->sizes[i] > 0 ? " but no " : "", c->sizes[i] > 0 ? buf_name : "");
        c->offset[i] = off;
        off += c->sizes[i];
        if (c->sizes[i] > 0) *mask |= UINT64_C(1) << i;
    }
    *total = off;
    return TDM_STATUS_OK;
}

static tdm_status tdm_dp_scatter_task(void *ctx, int i)
{
    tdm_dp_copy_ctx *c = ctx;
    tdm_dp *dp = c->dp;
    tdm_device *d = dp->dev[i];
    const float *src = c->src + c->offset[i] * c->row_elems;
    float *dst = c->chunk_dst[i];
    size_t nbytes = (size_t)c->sizes[i] * (size_t)c->row_elems * sizeof(float);
    tdm_status st;
    if (dst == src && c->other_dev == d) return TDM_STATUS_OK;   /* already in place */
    if (c->other_dev) st = tdm_dev_copy_between(d, dst, c->other_dev, src, nbytes);
    else st = tdm_dev_copy_from_host(d, dst, src, nbytes);
    if (st != TDM_STATUS_OK) return tdm_error_prefix(st, "scatter of %d rows", c->sizes[i]);
    return TDM_STATUS_OK;
}

tdm_status tdm_dp_scatter(tdm_dp *dp, tdm_device *src_dev, const float *x, int batch,
                          int64_t row_elems, const int *sizes, float *const *chunks)
{
    TDM_REQUIRE(batch >= 1, TDM_STATUS_INVALID_ARG, "scatter: batch %d must be positive", batch);
    TDM_REQUIRE(x && sizes && chunks && row_elems >= 1, TDM_STATUS_INVALID_ARG,
                "scatter: NULL input, sizes or chunks, or row of %lld elements",
                (long long)row_elems);
    tdm_dp_copy_ctx c = {.dp = dp, .other_dev = src_dev, .src = x, .chunk_dst = chunks,
                         .sizes = sizes, .row_elems = row_elems};
    uint64_t mask = 0;
    int64_t total = 0;
    TDM_CHECK(tdm_dp_chunks(&c, dp->n, "scatter", (const void *const *)chunks, "destination",
                            &mask, &total));
    TDM_REQUIRE(total == batch, TDM_STATUS_INVALID_ARG,
                "scatter: chunk sizes sum to %lld but the batch has %d rows", (long long)total,
                batch);
    return tdm_dp_round(dp, TDM_PHASE_SCATTER, mask, tdm_dp_scatter_task, &c);
}

/* ---- gather ---- */

static tdm_status tdm_dp_gather_task(void *ctx, int i)
{
    tdm_dp_copy_ctx *c = ctx;
    tdm_dp *dp = c->dp;
    float *dst = c->dst + c->offset[i] * c->row_elems;
    const float *src = c->chunk_src[i];
    size_t nbytes = (size_t)c->sizes[i] * (size_t)c->row_elems * sizeof(float);
    if (dst == src && i == dp->out) return TDM_STATUS_OK;
    tdm_status st = tdm_dev_copy_between(dp->dev[dp->out], dst, dp->dev[i], src, nbytes);
    if (st != TDM_STATUS_OK)
        return tdm_error_prefix(st, "gather of %d rows to %s", c->sizes[i],
                                tdm_dev_name(dp->dev[dp->out]));
    return TDM_STATUS_OK;
}

tdm_status tdm_dp_gather(tdm_dp *dp, const float *const *chunks, const int *sizes,
                         int64_t row_elems, float *out)
{
    TDM_REQUIRE(chunks && sizes && out && row_elems >= 1, TDM_STATUS_INVALID_ARG,
                "gather: NULL chunks, sizes or output, or row of %lld elements",
                (long long)row_elems);
    tdm_dp_copy_ctx c = {.dp = dp, .dst = out, .chunk_src = chunks, .sizes = sizes,
                         .row_elems = row_elems};
    uint64_t mask = 0;
    int64_t total = 0;
    TDM_CHECK(tdm_dp_chunks(&c, dp->n, "gather", (const void *const *)chunks, "source", &mask,
                            &total));
    TDM_REQUIRE(total >= 1, TDM_STATUS_INVALID_ARG, "gather: all chunks are empty");
    return tdm_dp_round(dp, TDM_PHASE_GATHER, mask, tdm_dp_gather_task, &c);
}

/* ---- parallel_apply ---- */

typedef struct tdm_dp_apply_ctx {
    tdm_dp *dp;
    tdm_dp_apply_fn fn;
    void *ctx;
} tdm_dp_apply_ctx;

static tdm_status tdm_dp_apply_task(void *ctx, int i)
{
    tdm_dp_apply_ctx *a = ctx;
    return a->fn(a->ctx, i, a->dp->rep[i], a->dp->dev[i]);
}

tdm_status tdm_dp_parallel_apply(tdm_dp *dp, int n_active, tdm_dp_apply_fn fn, void *ctx)
{
    TDM_REQUIRE(fn, TDM_STATUS_INVALID_ARG, "parallel_apply: NULL function");
    TDM_REQUIRE(n_active >= 1 && n_active <= dp->n, TDM_STATUS_INVALID_ARG,
                "parallel_apply: %d active replicas (expected 1..%d)", n_active, dp->n);
    tdm_dp_apply_ctx a = {.dp = dp, .fn = fn, .ctx = ctx};
    /* Timed as forward: that is what users mostly apply. */
    return tdm_dp_round(dp, TDM_PHASE_FORWARD, tdm_dp_prefix_mask(n_active), tdm_dp_apply_task,
                        &a);
}

/* ---- reduce ---- */

static tdm_status tdm_dp_reduce_task(void *ctx, int i)
{
    tdm_dp_slice_ctx *c = ctx;
    tdm_dp *dp = c->dp;
    int64_t lo, hi;
    tdm_dp_slice(dp->param_elems, c->rank[i], c->n_threads, &lo, &hi);
    if (lo >= hi) return TDM_STATUS_OK;
    tdm_device *od = dp->dev[dp->out];
    float *acc = tdm_model_grads(dp->rep[dp->out]) + lo;
    for (int j = 0; j < dp->n; j++) {
        if (!(c->replicas >> j & 1)) continue;
        /* Host devices share one address space: the master's device adds
         * the replica's slice in place, no staging copy. */
        tdm_status st = tdm_dev_axpy(od, hi - lo, 1.0f, tdm_model_grads(dp->rep[j]) + lo, acc);
        if (st != TDM_STATUS_OK)
            return tdm_error_prefix(st, "reduce of replica %d's gradients [%lld, %lld)", j,
                                    (long long)lo, (long long)hi);
    }
    return TDM_STATUS_OK;
}

/* master grads += grads of every replica in mask but the master. */
static tdm_status tdm_dp_reduce_mask(tdm_dp *dp, uint64_t mask)
{
    tdm_status st = TDM_STATUS_OK;
    uint64_t replicas = mask & ~(UINT64_C(1) << dp->out);
    if (!replicas) return TDM_STATUS_OK;
    if (dp->all_host) {
        /* Every thread of the step (and the master's) takes one slice. */
        tdm_dp_slice_ctx c;
        uint64_t threads = tdm_dp_slice_setup(dp, mask, &c);
        return tdm_dp_round(dp, TDM_PHASE_REDUCE, threads, tdm_dp_reduce_task, &c);
    }
    /* Accelerators: stage each replica's gradients on the output device
     * and add them there, from the calling thread (device streams are not
     * shared between threads). */
    uint64_t t0 = tdm_time_ns();
    tdm_device *od = dp->dev[dp->out];
    float *acc = tdm_model_grads(dp->rep[dp->out]);
    if (dp->group && mask == tdm_dp_prefix_mask(dp->n)) {
        /* in place on the master: master += every replica's gradients */
        const float *send[TDM_DP_MAX_DEVICES];
        for (int j = 0; j < dp->n; j++) send[j] = tdm_model_grads(dp->rep[j]);
        TDM_TRY(tdm_dev_group_reduce_sum(dp->group, send, acc, (size_t)dp->param_elems,
                                         dp->out));
        replicas = 0;   /* all reduced */
    }
    for (int j = 0; j < dp->n; j++) {
        if (!(replicas >> j & 1)) continue;
        TDM_TRY(tdm_dev_copy_between(od, dp->stage, dp->dev[j], tdm_model_grads(dp->rep[j]),
                                     (size_t)dp->param_elems * sizeof(float)));
        TDM_TRY(tdm_dev_axpy(od, dp->param_elems, 1.0f, dp->stage, acc));
    }
fail:
    dp->t.wall.ms[TDM_PHASE_REDUCE] += tdm_time_ms_since(t0);
    dp->t.device[dp->out].ms[TDM_PHASE_REDUCE] += tdm_time_ms_since(t0);
    if (st != TDM_STATUS_OK) return tdm_error_prefix(st, "reduce onto %s", tdm_dev_name(od));
    return st;
}

tdm_status tdm_dp_reduce_grads(tdm_dp *dp, int n_active)
{
    TDM_REQUIRE(n_active >= 1 && n_active <= dp->n, TDM_STATUS_INVALID_ARG,
                "reduce: %d active replicas (expected 1..%d)", n_active, dp->n);
    return tdm_dp_reduce_mask(dp, tdm_dp_prefix_mask(n_active));
}

/* ---- forward and backward rounds of a step ---- */

typedef struct tdm_dp_step_ctx {
    tdm_dp *dp;
    const int *sizes;
    int64_t offset[TDM_DP_MAX_DEVICES];
} tdm_dp_step_ctx;

/* Replica r takes the master's memory levers (precision, activation
 * checkpointing), set on the master before or after tdm_dp_init; on r's
 * own thread, as its activations are dropped and allocated there. Each
 * call is a no-op when r has them already. */
static tdm_status tdm_dp_follow_levers(tdm_model *r, const tdm_model *master)
{
    TDM_CHECK(tdm_model_set_precision(r, tdm_model_precision(master)));
    return tdm_model_set_checkpoint(r, tdm_model_checkpoint(master));
}

static tdm_status tdm_dp_forward_task(void *ctx, int i)
{
    tdm_dp_step_ctx *s = ctx;
    tdm_dp *dp = s->dp;
    tdm_status st = TDM_STATUS_OK;
    if (i != dp->out) st = tdm_dp_follow_levers(dp->rep[i], dp->rep[dp->out]);
    if (st != TDM_STATUS_OK) return tdm_error_prefix(st, "the master's memory levers");
    st = tdm_model_forward(dp->rep[i], dp->x_chunk[i], s->sizes[i], &dp->logits[i]);
    if (st != TDM_STATUS_OK) return tdm_error_prefix(st, "forward of %d rows", s->sizes[i]);
    return TDM_STATUS_OK;
}

static tdm_status tdm_dp_backward_task(void *ctx, int i)
{
    tdm_dp_step_ctx *s = ctx;
    tdm_dp *dp = s->dp;
    /* The output device reads its rows of the gradient in place. */
    const float *dy = i == dp->out ? dp->dlogits_all + s->offset[i] * dp->out_elems
                                   : dp->dy_chunk[i];
    tdm_status st = tdm_model_backward(dp->rep[i], dy);
    if (st != TDM_STATUS_OK) return tdm_error_prefix(st, "backward of %d rows", s->sizes[i]);
    return TDM_STATUS_OK;
}

static void tdm_dp_timings_reset(tdm_dp *dp, int batch, const int *sizes)
{
    memset(&dp->t, 0, sizeof dp->t);
    dp->t.n_devices = dp->n;
    dp->t.batch = batch;
    for (int i = 0; i < dp->n; i++) {
        dp->t.chunk[i] = sizes[i];
        dp->t.n_active += sizes[i] > 0;
    }
}

static tdm_status tdm_dp_fb(tdm_dp *dp, const void *x, const int32_t *y, int batch,
                            const int *chunk_sizes, int zero_master, float grad_scale,
                            double *loss_sum_out)
{
    tdm_status st = TDM_STATUS_OK;
    int sizes[TDM_DP_MAX_DEVICES];
    int n_chunks;
    uint64_t t_step = tdm_time_ns();
    TDM_REQUIRE(batch >= 1, TDM_STATUS_INVALID_ARG,
                "DataParallel step: batch %d (a batch needs at least one sample)", batch);
    TDM_REQUIRE(x && y, TDM_STATUS_INVALID_ARG, "DataParallel step: NULL inputs or labels");
    for (int64_t r = 0; r < (int64_t)batch * dp->out_rows; r++)
        TDM_REQUIRE(y[r] >= 0 && y[r] < dp->n_classes, TDM_STATUS_INVALID_ARG,
                    "DataParallel step: label %d of sample %lld is outside 0..%d", (int)y[r],
                    (long long)(r / dp->out_rows), dp->n_classes - 1);
    TDM_CHECK(tdm_dp_scatter_sizes(batch, dp->n, chunk_sizes, sizes, &n_chunks));
    TDM_CHECK(tdm_dp_reserve(dp, batch));
    tdm_dp_timings_reset(dp, batch, sizes);

    tdm_dp_step_ctx s = {.dp = dp, .sizes = sizes};
    uint64_t active = 0;
    int64_t off = 0;
    for (int i = 0; i < dp->n; i++) {
        s.offset[i] = off;
        off += sizes[i];
        if (sizes[i] > 0) active |= UINT64_C(1) << i;
    }
    const int C = dp->out_elems;   /* logit elements per sample */
    tdm_device *od = dp->dev[dp->out];

    /* replicate: only the devices that get rows (PyTorch replicates onto
     * device_ids[:len(inputs)]). */
    TDM_TRY(tdm_dp_replicate_mask(dp, active, zero_master));
    /* inputs of either dtype are 4-byte elements that scatter only copies */
    TDM_TRY(tdm_dp_scatter(dp, NULL, (const float *)x, batch, dp->in_features, sizes,
                           dp->x_chunk));
    TDM_TRY(tdm_dp_round(dp, TDM_PHASE_FORWARD, active, tdm_dp_forward_task, &s));
    /* a replica left idle (fewer rows than devices) ran no forward: it
     * takes the count of those that ran one, so that its dropout masks
     * stay those one device draws */
    int64_t fwd = 0;
    for (int i = 0; i < dp->n; i++)
        if ((active >> i) & 1) {
            int64_t f = tdm_model_train_forwards(dp->rep[i]);
            if (f > fwd) fwd = f;
        }
    for (int i = 0; i < dp->n; i++) tdm_model_set_train_forwards(dp->rep[i], fwd);
    TDM_TRY(tdm_dp_gather(dp, dp->logits, sizes, C, dp->logits_all));

    /* loss over the whole batch on the output device: mean, so scale 1/B
     * (gradient accumulation passes 1/(the effective batch)) */
    uint64_t t0 = tdm_time_ns();
    double loss_sum = 0.0;
    TDM_TRY(tdm_dev_copy_from_host(od, dp->labels, y,
                                   (size_t)batch * dp->out_rows * sizeof(int32_t)));
    TDM_TRY(tdm_model_loss(dp->rep[dp->out], dp->logits_all, dp->labels, batch,
                           grad_scale, &loss_sum, dp->dlogits_all));
    double loss_ms = tdm_time_ms_since(t0);
    dp->t.wall.ms[TDM_PHASE_LOSS] += loss_ms;
    dp->t.device[dp->out].ms[TDM_PHASE_LOSS] += loss_ms;

    /* the backward of gather is a scatter of the logit gradients */
    float *dy_dst[TDM_DP_MAX_DEVICES];
    for (int i = 0; i < dp->n; i++)
        dy_dst[i] = i == dp->out ? dp->dlogits_all + s.offset[i] * C : dp->dy_chunk[i];
    TDM_TRY(tdm_dp_scatter(dp, od, dp->dlogits_all, batch, C, sizes, dy_dst));
    TDM_TRY(tdm_dp_round(dp, TDM_PHASE_BACKWARD, active, tdm_dp_backward_task, &s));
    /* the backward of replicate is a reduce-add onto the master */
    TDM_TRY(tdm_dp_reduce_mask(dp, active));

    if (loss_sum_out) *loss_sum_out = loss_sum;
    dp->t.step_ms = tdm_time_ms_since(t_step);
    dp->last = dp->t;
    return TDM_STATUS_OK;
fail:
    return st;
}

tdm_status tdm_dp_forward_backward(tdm_dp *dp, const void *x, const int32_t *y, int batch,
                                   const int *chunk_sizes, double *loss_mean)
{
    double ls = 0.0;
    TDM_CHECK(tdm_dp_fb(dp, x, y, batch, chunk_sizes, 0, batch > 0 ? 1.0f / (float)batch : 0.0f,
                        &ls));
    if (loss_mean) *loss_mean = ls / batch;
    return TDM_STATUS_OK;
}

tdm_status tdm_dp_forward_backward_scaled(tdm_dp *dp, const void *x, const int32_t *y,
                                          int batch, float grad_scale, double *loss_sum)
{
    return tdm_dp_fb(dp, x, y, batch, NULL, 0, grad_scale, loss_sum);
}

tdm_status tdm_dp_step(tdm_dp *dp, tdm_optim *opt, const void *x, const int32_t *y, int batch,
                       double *loss_mean)
{
    TDM_REQUIRE(opt, TDM_STATUS_INVALID_ARG, "DataParallel step: NULL optimizer");
    tdm_single s = {.model = dp->rep[dp->out], .opt = opt};
    return tdm_dp_step_levers(dp, &s, x, y, batch, loss_mean);
}

tdm_status tdm_dp_step_levers(tdm_dp *dp, tdm_single *s, const void *x, const int32_t *y,
                              int batch, double *loss_mean)
{
    TDM_REQUIRE(s && s->opt && s->model == dp->rep[dp->out], TDM_STATUS_INVALID_ARG,
                "DataParallel step: %s", !s || !s->opt ? "NULL optimizer"
                                                       : "the levers' model is not the master");
    uint64_t t0 = tdm_time_ns();
    /* optimizer.zero_grad() on the master, done inside the replicate
     * round by all the step's threads (so timed as replicate); fp16's
     * loss scale times 1/B, one rounding, as on one device */
    float lscale = s->scaler ? tdm_grad_scaler_scale(s->scaler) : 1.0f;
    double ls = 0.0;
    TDM_CHECK(tdm_dp_fb(dp, x, y, batch, NULL, 1, batch > 0 ? lscale / (float)batch : 0.0f,
                        &ls));
    if (loss_mean) *loss_mean = ls / batch;
    uint64_t t1 = tdm_time_ns();
    /* The master holds the sum of every replica's gradients: an inf or
     * NaN in any of them is in the sum (non-finite values absorb under
     * addition), so one check there decides the skip for all replicas,
     * and the next replicate hands every replica the same parameters. */
    TDM_CHECK(tdm_single_finish(s));
    /* an accelerator's optimizer kernels are only queued: wait, so that
     * the step (and its timing) ends when the master is updated, as the
     * single-device step and DDP's do */
    if (!dp->all_host) TDM_CHECK(tdm_dev_sync(dp->dev[dp->out]));
    double step_ms = tdm_time_ms_since(t1);
    dp->last.wall.ms[TDM_PHASE_STEP] += step_ms;
    dp->last.device[dp->out].ms[TDM_PHASE_STEP] += step_ms;
    dp->last.step_ms = tdm_time_ms_since(t0);
    return TDM_STATUS_OK;
}

tdm_status tdm_dp_evaluate(tdm_dp *dp, const tdm_dataset *d, int batch, double *loss_mean,
                           double *accuracy)
{
    tdm_model *m = dp->rep[dp->out];
    tdm_device *od = dp->dev[dp->out];
    TDM_REQUIRE(batch > 0 && d && d->n > 0 && tdm_data_features(d) == dp->in_features &&
                    dp->out_rows == 1, TDM_STATUS_INVALID_ARG,
                "DataParallel evaluate: batch %d of a dataset of %lld samples of %lld features "
                "(the model: %d, one label each)", batch, d ? (long long)d->n : 0LL,
                d ? (long long)tdm_data_features(d) : 0LL, dp->in_features);
    TDM_CHECK(tdm_dp_reserve(dp, batch));
    tdm_status st = TDM_STATUS_OK;
    int was_train = tdm_model_is_train(m), host = tdm_dev_kind(od) == TDM_DEVICE_HOST;
    int64_t feat = dp->in_features, correct = 0;
    double loss = 0.0;
    tdm_model_set_train(m, 0);
    for (int64_t lo = 0; lo < d->n && !st; lo += batch) {
        int b = (int)(d->n - lo < batch ? d->n - lo : batch);
        const float *x = d->x + lo * feat;
        const int32_t *y = d->y + lo;
        if (!host) {
            st = tdm_dev_copy_from_host(od, dp->x_chunk[dp->out], x,
                                        (size_t)b * (size_t)feat * sizeof(float));
            if (!st) st = tdm_dev_copy_from_host(od, dp->labels, y, (size_t)b * sizeof(int32_t));
        }
        if (!st)
            st = tdm_evaluate_batch(m, host ? (const void *)x : dp->x_chunk[dp->out],
                                    host ? y : dp->labels, y, b, &loss, &correct);
    }
    tdm_model_set_train(m, was_train);
    if (st) return st;
    if (loss_mean) *loss_mean = loss / (double)d->n;
    if (accuracy) *accuracy = (double)correct / (double)d->n;
    return TDM_STATUS_OK;
}
