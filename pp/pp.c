/* pp/pp.c: a pipeline stage's life: checking the configuration on every
 * stage, the split, the stage model and its optimizer, the link
 * communicators, the micro-batch buffers, the memory report, and
 * freeing. Running a step is pp/step.c; schedules pp/schedule.c; splits
 * pp/split.c; checkpoints pp/ckpt.c. */
#include "pp/pp_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "models/recompute.h"

/* What every stage must agree on, compared at init: the stage that
 * differs is named with the field. */
enum {
    TDM_PP_CFG_STAGES = 0, TDM_PP_CFG_MICRO, TDM_PP_CFG_SCHEDULE, TDM_PP_CFG_BALANCE,
    TDM_PP_CFG_SEED, TDM_PP_CFG_SPEC, TDM_PP_CFG_SPLIT, TDM_PP_CFG_OPTIM, TDM_PP_CFG_SYNC,
    TDM_PP_CFG_PRECISION, TDM_PP_CFG_CKPT, TDM_PP_CFG_COUNT_
};
static const char *const tdm_pp_cfg_names[TDM_PP_CFG_COUNT_] = {
    "stages", "micro-batches", "schedule", "balance", "seed", "model", "split", "optimizer",
    "gradient sync (data parallelism)", "precision", "activation checkpointing",
};

static uint64_t tdm_pp_fnv(const void *p, size_t n, uint64_t h)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

tdm_status tdm_pp_fail(tdm_pp *p, tdm_status st, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    p->failed = 1;
    tdm_error_prefix(st, "pp stage %d of %d: %s", p->s, p->S, what);
    /* the other stages may be waiting for this one */
    char why[TDM_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", tdm_error_message());
    (void)tdm_comm_abort(p->comm, why);
    if (p->hcomm != p->comm) (void)tdm_comm_abort(p->hcomm, why);
    tdm_error_set(st, "%s", why);
    return st;
}

static tdm_status tdm_pp_check_config(tdm_pp *p)
{
    tdm_status st = TDM_STATUS_OK;
    int64_t mine[TDM_PP_CFG_COUNT_] = {0};
    mine[TDM_PP_CFG_STAGES] = p->S;
    mine[TDM_PP_CFG_MICRO] = p->o.micro_batches;
    mine[TDM_PP_CFG_SCHEDULE] = p->o.schedule;
    mine[TDM_PP_CFG_BALANCE] = p->o.split ? -1 : (int64_t)p->o.balance;
    mine[TDM_PP_CFG_SEED] = (int64_t)p->o.seed;
    mine[TDM_PP_CFG_SPEC] = (int64_t)tdm_pp_fnv(&p->spec, sizeof p->spec, 0xcbf29ce484222325ull);
    mine[TDM_PP_CFG_SPLIT] = (int64_t)tdm_pp_fnv(p->first, (size_t)p->S * sizeof *p->first,
                                                 0xcbf29ce484222325ull);
    mine[TDM_PP_CFG_OPTIM] = (int64_t)tdm_pp_fnv(&p->o.optim, sizeof p->o.optim,
                                                 0xcbf29ce484222325ull);
    mine[TDM_PP_CFG_SYNC] = (p->o.grad_sync.begin != NULL) | (p->o.optim_step.fn != NULL) << 1 |
                            (p->o.shards.leaf != NULL) << 2 |
                            (p->o.grad_sync.empty != NULL) << 3;
    mine[TDM_PP_CFG_PRECISION] = p->o.precision;
    mine[TDM_PP_CFG_CKPT] = p->o.ckpt;
    int64_t *all = calloc((size_t)p->S * TDM_PP_CFG_COUNT_, sizeof *all);
    if (!all) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp: configuration check");
        (void)tdm_comm_abort(p->hcomm, tdm_error_message());
        return st;
    }
    tdm_comm_set_label(p->hcomm, "pp configuration check");
    st = tdm_comm_all_gather(p->hcomm, mine, all, TDM_PP_CFG_COUNT_, TDM_DTYPE_INT64);
    for (int r = 1; st == TDM_STATUS_OK && r < p->S; r++)
        for (int f = 0; f < TDM_PP_CFG_COUNT_; f++)
            if (all[r * TDM_PP_CFG_COUNT_ + f] != all[f]) {
                char who[48];
                st = tdm_error_set(TDM_STATUS_MISMATCH, "pp: stage %d (%s) was configured "
                                   "with another %s than stage 0 (%lld vs %lld)", r,
                                   tdm_comm_rank_str(p->comm, r, who, sizeof who),
                                   tdm_pp_cfg_names[f], (long long)all[r * TDM_PP_CFG_COUNT_ + f],
                                   (long long)all[f]);
                break;
            }
    free(all);
    return st;
}

/* This stage's outcome st, all-gathered: st itself here (its message
 * kept), or the first other stage's failure, named, on the others. */
static tdm_status tdm_pp_agree(tdm_pp *p, tdm_status st)
{
    char msg[TDM_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", st ? tdm_error_message() : "");
    int32_t mine = st, *all = calloc((size_t)p->S, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "pp: %d statuses", p->S);
    tdm_comm_set_label(p->hcomm, "pp stages built");
    tdm_status cs = tdm_comm_all_gather(p->hcomm, &mine, all, 1, TDM_DTYPE_INT32);
    tdm_status out = cs;
    if (!cs && st) out = tdm_error_set(st, "%s", msg);
    for (int r = 0; !cs && !st && r < p->S; r++)
        if (all[r]) {
            tdm_status rs = all[r] > 0 && all[r] < TDM_STATUS_COUNT_ ? (tdm_status)all[r]
                                                                     : TDM_STATUS_INTERNAL;
            out = tdm_error_set(rs, "pp: stage %d could not build its model and optimizer (%s; "
                                "see its error)", r, tdm_status_name(rs));
            break;
        }
    free(all);
    return out;
}

/* Bytes of receive buffers this stage will want in its links' shared
 * memory for a global batch of o.batch (0: none): its input slots (the
 * schedule's in-flight count or evaluation's 2, plus one) and its two
 * gradient buffers, each rounded to the allocator's 64 bytes. */
static void tdm_pp_link_needs(tdm_pp *p, int64_t need[2])
{
    need[0] = need[1] = 0;
    if (p->o.batch < 1 || !p->host) return;
    int M = p->o.micro_batches, micro = (p->o.batch + M - 1) / M;
    tdm_pp_schedule *s = NULL;
    if (tdm_pp_schedule_build(&s, p->o.schedule, p->S, M)) return;
    int fl = tdm_pp_schedule_in_flight(s, p->s);
    tdm_pp_schedule_free(s);
    p->buf.plan_in = (fl > 2 ? fl : 2) + 1;
    int64_t in_b = ((int64_t)micro * p->info.in_elems * 4 + 63) / 64 * 64;
    int64_t out_b = ((int64_t)micro * p->info.out_elems * 4 + 63) / 64 * 64;
    if (p->s > 0) need[0] = p->buf.plan_in * in_b;
    if (p->s + 1 < p->S) need[1] = 2 * out_b;
}

/* The lanes: every stage splits the same number of times (the pipeline's
 * size decides it), then takes its own. With o.batch, each lane's
 * zero-copy memory is the largest need of the stages (all-gathered: the
 * creator of a lane's segment sizes it for everyone). */
static tdm_status tdm_pp_links(tdm_pp *p)
{
    int S = p->S, s = p->s, n = S == 1 ? 0 : S == 2 ? 2 : 4;
    int64_t need[2], most[2] = {0, 0};
    tdm_pp_link_needs(p, need);
    if (p->o.batch > 0 && n > 0) {
        int64_t *all = calloc((size_t)S * 2, sizeof *all);
        TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "pp: link sizes");
        tdm_comm_set_label(p->hcomm, "pp link sizes");
        tdm_status st = tdm_comm_all_gather(p->hcomm, need, all, 2, TDM_DTYPE_INT64);
        for (int r = 0; !st && r < S; r++)
            for (int d = 0; d < 2; d++)
                if (all[2 * r + d] > most[d]) most[d] = all[2 * r + d];
        free(all);
        TDM_CHECK(st);
    }
    int gl = TDM_PP_GRAD_LANE(S);
    for (int k = 0; k < n; k++) {
        tdm_comm_split_opts so = {.p2p = 1, .arena_bytes = (size_t)most[k < gl ? 0 : 1]};
        tdm_comm_set_label(p->comm, "pp link %d", k);
        TDM_CHECK(tdm_comm_split_ex(p->comm, 0, s, &so, &p->link.lane[k]));
    }
    if (s + 1 < S) {
        p->link.act_out = p->link.lane[s % 2];
        p->link.grad_in = p->link.lane[gl + s % 2];
    }
    if (s > 0) {
        p->link.act_in = p->link.lane[(s - 1) % 2];
        p->link.grad_out = p->link.lane[gl + (s - 1) % 2];
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_init(tdm_pp **out, tdm_comm *comm, tdm_device *dev, const tdm_model_spec *spec,
                       const tdm_pp_opts *opts)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(out && comm && dev && spec && opts, TDM_STATUS_INVALID_ARG,
                "pp: communicator, device, spec and options are required");
    *out = NULL;
    TDM_REQUIRE(opts->micro_batches >= 1, TDM_STATUS_INVALID_ARG,
                "pp: %d micro-batches (expected at least 1)", opts->micro_batches);
    TDM_REQUIRE((unsigned)opts->schedule < TDM_PP_SCHEDULE_COUNT_, TDM_STATUS_INVALID_ARG,
                "pp: unknown schedule %d", (int)opts->schedule);
    TDM_REQUIRE(!opts->grad_sync.begin == !opts->grad_sync.end &&
                    (!opts->grad_sync.empty || opts->grad_sync.begin),
                TDM_STATUS_INVALID_ARG, "pp: grad_sync needs both begin and end (and empty "
                "only with them)");
    TDM_REQUIRE(!opts->shards.leaf == !opts->shards.reduce &&
                    !opts->shards.leaf == !opts->shards.cut &&
                    !(opts->shards.leaf && opts->grad_sync.begin),
                TDM_STATUS_INVALID_ARG, "pp: shards needs cut, leaf and reduce, and no "
                "grad_sync (the shards' sum is the only gradient reduction)");
    /* pp/ckpt.c gathers and loads the optimizer's state with the stage's
     * device, which host-offloaded state is not */
    TDM_REQUIRE(opts->optim.offload == TDM_OPTIM_OFFLOAD_NONE, TDM_STATUS_UNSUPPORTED,
                "pp: optimizer offload is not supported by the pipeline (its stages hold only "
                "their own layers' state already)");
    int S = tdm_comm_size(comm), n = 0;
    TDM_REQUIRE(!opts->host_comm || (tdm_comm_size(opts->host_comm) == S &&
                                     tdm_comm_rank(opts->host_comm) == tdm_comm_rank(comm)),
                TDM_STATUS_INVALID_ARG, "pp: the host communicator is rank %d of %d, the "
                "pipeline's rank %d of %d", opts->host_comm ? tdm_comm_rank(opts->host_comm) : -1,
                opts->host_comm ? tdm_comm_size(opts->host_comm) : -1, tdm_comm_rank(comm), S);
    TDM_CHECK(tdm_model_spec_n_layers(spec, &n));
    tdm_pp *p = calloc(1, sizeof *p);
    TDM_REQUIRE(p, TDM_STATUS_OUT_OF_MEMORY, "pp: calloc");
    p->comm = comm;
    p->hcomm = opts->host_comm ? opts->host_comm : comm;
    p->dev = dev;
    p->S = S;
    p->s = tdm_comm_rank(comm);
    p->spec = *spec;
    p->o = *opts;
    p->o.host_comm = NULL;   /* kept as hcomm */
    p->n_layers = n;
    p->host = tdm_dev_kind(dev) == TDM_DEVICE_HOST;
    p->first = calloc((size_t)S, sizeof *p->first);
    if (!p->first) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp: calloc");
        goto fail;
    }
    if (opts->split) {
        memcpy(p->first, opts->split, (size_t)S * sizeof *p->first);
        TDM_TRY(tdm_pp_split_check(p->first, S, n));
    } else {
        TDM_TRY(tdm_pp_split_balance(spec, S, opts->balance, p->first));
    }
    p->o.split = NULL;
    /* every stage agrees before anyone builds (a stage that got other
     * options is named, not left to mismatch in a transfer) */
    TDM_TRY(tdm_pp_check_config(p));
    int lo = p->first[p->s], hi = p->s + 1 < S ? p->first[p->s + 1] : n;
    st = tdm_model_init_stage(&p->m, dev, spec, opts->seed, lo, hi);
    if (!st) st = tdm_model_set_precision(p->m, opts->precision);
    if (!st) st = tdm_model_set_checkpoint(p->m, opts->ckpt);
    if (!st && !opts->optim_step.fn) st = tdm_optim_init(&p->opt, p->m, &opts->optim);
    /* every stage learns whether every other built its part before the
     * links' splits, which would wait for a stage that gave up */
    TDM_TRY(tdm_pp_agree(p, st));
    tdm_model_get_stage(p->m, &p->info);
    TDM_TRY(tdm_pp_links(p));
    for (int k = 0; k < 2; k++) p->buf.gin_owner[k] = -1;
    tdm_dev_mem_stats ms;
    p->stats.mem_ok = tdm_dev_mem_query(dev, &ms) == TDM_STATUS_OK;
    if (p->stats.mem_ok) {
        tdm_dev_mem_reset_peak(dev);
        p->stats.mem_base = ms.live_bytes;
    }
    char split[128];
    TDM_INFO(CORE, "pp stage %d of %d: layers %d..%d of %d (split %s), %s, %d micro-batch(es)",
             p->s, S, lo, hi - 1, n, tdm_pp_split_str(p->first, S, split, sizeof split),
             tdm_pp_schedule_name(opts->schedule), opts->micro_batches);
    *out = p;
    return TDM_STATUS_OK;
fail:
    tdm_pp_free(p);
    return st;
}

static void tdm_pp_free_buffers(tdm_pp *p)
{
    for (int k = 0; k < p->buf.n; k++) {
        if (p->buf.in && !(p->buf.in_shared && p->buf.in_shared[k]))
            tdm_dev_free(p->dev, p->buf.in[k]);
        tdm_dev_free(p->dev, p->buf.x ? p->buf.x[k] : NULL);
    }
    free(p->buf.in_shared);
    p->buf.in_shared = NULL;
    free(p->buf.in);
    free(p->buf.x);
    free(p->buf.out);
    free(p->buf.owner);
    free(p->run.act_recv);
    free(p->run.act_send);
    p->buf.in = NULL;
    p->buf.x = NULL;
    p->buf.out = NULL;
    p->buf.owner = NULL;
    p->run.act_recv = p->run.act_send = NULL;
    for (int k = 0; k < 2; k++) {
        if (!p->buf.gin_shared[k]) tdm_dev_free(p->dev, p->buf.gin[k]);
        p->buf.gin[k] = NULL;
        p->buf.gin_shared[k] = 0;
    }
    tdm_dev_free(p->dev, p->buf.y);
    p->buf.y = NULL;
    p->buf.cap = p->buf.n = p->buf.n_in = 0;
}

void tdm_pp_free(tdm_pp *p)
{
    if (!p) return;
    tdm_pp_drain(p);
    /* the links drain anything still queued before the buffers go */
    for (int k = 0; k < TDM_PP_MAX_LANES; k++) tdm_comm_free(p->link.lane[k]);
    tdm_pp_free_buffers(p);
    tdm_pp_shards_free(p);
    tdm_dev_free(p->dev, p->buf.tied);
    tdm_pp_schedule_free(p->sched);
    tdm_optim_free(p->opt);
    tdm_model_free(p->m);
    free(p->stats.ev);
    free(p->stats.pending);
    free(p->first);
    free(p);
}

int tdm_pp_stage(const tdm_pp *p) { return p->s; }
int tdm_pp_stages(const tdm_pp *p) { return p->S; }
tdm_model *tdm_pp_model(tdm_pp *p) { return p->m; }
tdm_optim *tdm_pp_optim(tdm_pp *p) { return p->opt; }
const int *tdm_pp_split(const tdm_pp *p) { return p->first; }

/* A receive buffer of nbytes: in link's zero-copy memory when it has
 * room (*shared = 1), else the device's. */
static tdm_status tdm_pp_recv_buffer(tdm_pp *p, tdm_comm *link, size_t nbytes, void **out,
                                     int *shared)
{
    *shared = 0;
    if (p->o.batch > 0 && p->host && link && tdm_comm_alloc(link, nbytes, out) == TDM_STATUS_OK) {
        *shared = 1;
        return TDM_STATUS_OK;
    }
    tdm_error_clear();
    return tdm_dev_alloc(p->dev, nbytes, out);
}

tdm_status tdm_pp_buffers(tdm_pp *p, int micro, int sets, int n_in)
{
    if (p->s > 0 && n_in < p->buf.plan_in && !p->buf.n) n_in = p->buf.plan_in;
    int slots = sets > n_in ? sets : n_in;
    if (micro <= p->buf.cap && slots <= p->buf.n && n_in <= p->buf.n_in) return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    if (micro < p->buf.cap) micro = p->buf.cap;
    if (slots < p->buf.n) slots = p->buf.n;
    if (n_in < p->buf.n_in) n_in = p->buf.n_in;
    if (sets < p->buf.n) sets = p->buf.n;
    tdm_pp_free_buffers(p);
    size_t in_b = (size_t)micro * (size_t)p->info.in_elems * 4;
    size_t out_b = (size_t)micro * (size_t)p->info.out_elems * 4;
    p->buf.in = calloc((size_t)slots, sizeof *p->buf.in);
    p->buf.x = calloc((size_t)slots, sizeof *p->buf.x);
    p->buf.out = calloc((size_t)slots, sizeof *p->buf.out);
    p->buf.owner = calloc((size_t)slots, sizeof *p->buf.owner);
    p->run.act_recv = calloc((size_t)slots, sizeof *p->run.act_recv);
    p->run.act_send = calloc((size_t)slots, sizeof *p->run.act_send);
    p->buf.in_shared = calloc((size_t)slots, 1);
    if (!p->buf.in || !p->buf.x || !p->buf.out || !p->buf.owner || !p->run.act_recv ||
        !p->run.act_send || !p->buf.in_shared) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp: %d micro-batch buffers", slots);
        goto fail;
    }
    p->buf.n = slots;
    p->buf.n_in = n_in;
    p->buf.input_bytes = 0;
    p->buf.scratch_bytes = 0;
    for (int k = 0; k < slots; k++) p->buf.owner[k] = -1;
    for (int k = 0; p->s > 0 && k < n_in; k++) {
        int sh = 0;
        TDM_TRY(tdm_pp_recv_buffer(p, p->link.act_in, in_b, (void **)&p->buf.in[k], &sh));
        p->buf.in_shared[k] = (unsigned char)sh;
    }
    for (int k = 0; p->s == 0 && !p->host && k < sets; k++)
        TDM_TRY(tdm_dev_alloc(p->dev, in_b, &p->buf.x[k]));
    if (p->s > 0 || !p->host) p->buf.input_bytes = in_b;
    if (p->s + 1 < p->S) {
        for (int k = 0; k < 2; k++)
            TDM_TRY(tdm_pp_recv_buffer(p, p->link.grad_in, out_b, (void **)&p->buf.gin[k],
                                       &p->buf.gin_shared[k]));
        p->buf.scratch_bytes += 2 * out_b;
    }
    if (p->s + 1 == p->S) {
        size_t rows = (size_t)micro * (size_t)tdm_model_out_rows(p->m);
        if (!p->host) {
            TDM_TRY(tdm_dev_alloc(p->dev, rows * sizeof(int32_t), (void **)&p->buf.y));
            p->buf.scratch_bytes += rows * sizeof(int32_t);
        }
        /* the loss's per-row values live in the device's scratch
         * (tdm_dev_scratch: at least 256 bytes, 64-byte granules) */
        size_t lb = rows * sizeof(float) > 256 ? rows * sizeof(float) : 256;
        p->buf.scratch_bytes += (lb + 63) / 64 * 64;
    }
    p->buf.cap = micro;
    for (int k = 0; k < 2; k++) p->buf.gin_owner[k] = -1;
    return TDM_STATUS_OK;
fail:
    tdm_pp_free_buffers(p);
    return st;
}

/* ---- reports ---- */

void tdm_pp_get_stats(const tdm_pp *p, tdm_pp_stats *out)
{
    memset(out, 0, sizeof *out);
    out->stage = p->s;
    out->stages = p->S;
    out->micro_batches = p->run.n_mb ? p->run.n_mb : p->o.micro_batches;
    out->micro_size = p->run.micro;
    out->last = p->stats.last;
    out->sum = p->stats.sum;
    out->steps = p->stats.steps;
    tdm_model_memory mm;
    tdm_model_get_memory(p->m, &mm);
    out->params = mm.params;
    out->grads = mm.grads;
    out->buffers = mm.buffers;
    out->optimizer = p->opt ? tdm_optim_state_bytes(p->opt) : 0;
    size_t sets = 0, scratch = 0;
    tdm_model_act_bytes(p->m, &sets, &scratch);
    out->act_sets = p->sched ? tdm_pp_schedule_in_flight(p->sched, p->s) : 0;
    out->act_set = p->stats.set_bytes;
    out->act_input = p->buf.input_bytes;
    out->act_inputs = p->run.n_in;
    out->zero_copy = (p->buf.in_shared && p->buf.n && p->buf.in_shared[0]) || p->buf.gin_shared[0];
    out->act_scratch = scratch + p->buf.scratch_bytes;
    out->peak_act = (size_t)-1;
    tdm_dev_mem_stats ms;
    if (p->stats.mem_ok && tdm_dev_mem_query(p->dev, &ms) == TDM_STATUS_OK)
        out->peak_act = ms.peak_bytes > p->stats.mem_base ? ms.peak_bytes - p->stats.mem_base : 0;
    out->overlapped = p->stats.overlapped;
    out->transfers = p->stats.transfers;
    out->last_norm = p->lev.last_norm;
    out->last_skipped = p->lev.last_skipped;
    out->skipped = p->lev.skipped;
}

void tdm_pp_trace(const tdm_pp *p, const tdm_pp_event **events, int *n)
{
    *events = p->stats.ev;
    *n = p->stats.n_ev;
}
