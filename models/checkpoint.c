/* models/checkpoint.c: a model's parameters, buffers and optimizer state
 * to and from a safetensors file (core/safetensors.c does the format and
 * the atomic write). Device memory is staged through one host copy of each
 * flat buffer. Not here: who writes (DDP's rank 0) and when. */
#include "models/checkpoint.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/safetensors.h"

#define TDM_CKPT_FORMAT "tandem-checkpoint-1"
#define TDM_CKPT_MAX_TENSORS 256

static char tdm_ckpt_run[TDM_CKPT_RUN_MAX];

void tdm_checkpoint_set_run(const char *run)
{
    snprintf(tdm_ckpt_run, sizeof tdm_ckpt_run, "%s", run ? run : "");
}

const char *tdm_checkpoint_run(void) { return tdm_ckpt_run; }

const char *tdm_checkpoint_optim_name(tdm_optim_kind k)
{
    return k == TDM_OPTIM_ADAMW ? "adamw" : "sgd";
}

int tdm_checkpoint_meta(tdm_st_meta *meta, tdm_ckpt_meta_text *t, const tdm_ckpt_info *info,
                        int64_t steps, const tdm_optim_opts *o)
{
    snprintf(t->step, sizeof t->step, "%" PRId64, info ? info->step : steps);
    snprintf(t->epoch, sizeof t->epoch, "%" PRId64, info ? info->epoch : 0);
    snprintf(t->seed, sizeof t->seed, "%" PRIu64, info ? info->seed : 0);
    int n = 0;
    meta[n++] = (tdm_st_meta){"step", t->step};
    meta[n++] = (tdm_st_meta){"epoch", t->epoch};
    meta[n++] = (tdm_st_meta){"seed", t->seed};
    if (o) {
        snprintf(t->lr, sizeof t->lr, "%.9g", (double)o->lr);
        snprintf(t->hyper, sizeof t->hyper,
                 "momentum=%.9g dampening=%.9g nesterov=%d weight_decay=%.9g beta1=%.9g "
                 "beta2=%.9g eps=%.9g", (double)o->momentum, (double)o->dampening, o->nesterov,
                 (double)o->weight_decay, (double)o->beta1, (double)o->beta2, (double)o->eps);
        meta[n++] = (tdm_st_meta){"optimizer", tdm_checkpoint_optim_name(o->kind)};
        meta[n++] = (tdm_st_meta){"lr", t->lr};
        meta[n++] = (tdm_st_meta){"optimizer_options", t->hyper};
        /* the optimizer's own count (AdamW's bias correction), apart from
         * the caller's step, which may count something else */
        snprintf(t->osteps, sizeof t->osteps, "%" PRId64, steps);
        meta[n++] = (tdm_st_meta){"optimizer_steps", t->osteps};
    }
    if (info && info->loss_scale > 0.0) {
        /* %.9g: a float's scale reads back as the same float */
        snprintf(t->loss_scale, sizeof t->loss_scale, "%.9g", info->loss_scale);
        snprintf(t->loss_scale_growth, sizeof t->loss_scale_growth, "%" PRId64,
                 info->loss_scale_growth);
        meta[n++] = (tdm_st_meta){"loss_scale", t->loss_scale};
        meta[n++] = (tdm_st_meta){"loss_scale_growth_tracker", t->loss_scale_growth};
    }
    if (tdm_ckpt_run[0]) meta[n++] = (tdm_st_meta){"run", tdm_ckpt_run};
    return n;
}

/* Non-finite values among n floats; *first: the index of the first. */
static int64_t tdm_ckpt_count_nonfinite(const float *v, int64_t n, int64_t *first)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i]) && bad++ == 0 && first) *first = i;
    return bad;
}

static tdm_status tdm_ckpt_stage(tdm_device *d, float **host, const float *dev, int64_t n)
{
    size_t nb = (size_t)(n > 0 ? n : 1) * sizeof(float);
    *host = calloc(1, nb);
    if (!*host) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate %zu bytes", nb);
    if (n > 0) return tdm_dev_copy_to_host(d, *host, dev, (size_t)n * sizeof(float));
    return TDM_STATUS_OK;
}

void tdm_ckpt_host_free(tdm_ckpt_host *h)
{
    free(h->params);
    free(h->buffers);
    free(h->state[0]);
    free(h->state[1]);
    *h = (tdm_ckpt_host){.optim = h->optim};
}

tdm_status tdm_checkpoint_save_host(const char *path, const tdm_model *m, const tdm_ckpt_host *h,
                                    const tdm_ckpt_info *info)
{
    tdm_status st = TDM_STATUS_OK;
    int np = tdm_model_n_params(m), nbuf = tdm_model_n_buffers(m);
    const tdm_optim_opts *o = h->optim;
    int nstate = o ? tdm_optim_kind_n_state(o) : 0;
    tdm_st_tensor *t = NULL;
    char (*names)[96] = NULL;
    int nt = 0;
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "checkpoint: empty path");
    int total = np + nbuf + nstate * np;
    t = calloc((size_t)total, sizeof *t);
    names = calloc((size_t)total, sizeof *names);
    if (!t || !names) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a checkpoint table");
        goto fail;
    }
    for (int group = 0; group < 2 + nstate; group++) {
        int n = group == 1 ? nbuf : np;
        for (int i = 0; i < n; i++) {
            const tdm_tensor_info *ti = group == 1 ? tdm_model_buffer_info(m, i)
                                                   : tdm_model_param_info(m, i);
            const float *base = group == 0 ? h->params : group == 1 ? h->buffers
                                                                    : h->state[group - 2];
            if (group >= 2)
                snprintf(names[nt], sizeof names[nt], "optim.%s.%s",
                         tdm_optim_kind_state_name(o->kind, group - 2), ti->name);
            else
                snprintf(names[nt], sizeof names[nt], "%s", ti->name);
            t[nt].name = names[nt];
            t[nt].dtype = TDM_ST_F32;
            t[nt].ndim = ti->ndim;
            for (int k = 0; k < ti->ndim; k++) t[nt].shape[k] = ti->shape[k];
            t[nt].data = base + ti->offset;
            t[nt].nbytes = (size_t)ti->n_elem * sizeof(float);
            nt++;
        }
    }
    /* A NaN or an infinity anywhere means the run went bad: the file
     * already at path (the last good checkpoint) must survive it. The scan
     * is one pass over the host copy the write needs anyway. */
    for (int i = 0; i < nt; i++) {
        int64_t n = (int64_t)(t[i].nbytes / sizeof(float)), first = 0;
        int64_t bad = tdm_ckpt_count_nonfinite(t[i].data, n, &first);
        if (bad) {
            float v = ((const float *)t[i].data)[first];
            st = tdm_error_set(TDM_STATUS_NONFINITE,
                               "refusing to save %s: tensor '%s' holds %" PRId64 " non-finite "
                               "value%s (NaN or infinite) of %" PRId64 ", the first at index %"
                               PRId64 " (%s); the file at %s was left as it was", path,
                               t[i].name, bad, bad == 1 ? "" : "s", n, first,
                               isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf", path);
            goto fail;
        }
    }
    char model_desc[160];
    tdm_ckpt_meta_text mt;
    tdm_model_spec_describe(tdm_model_get_spec(m), model_desc, sizeof model_desc);
    tdm_st_meta meta[2 + TDM_CKPT_META_MAX] = {{"format", TDM_CKPT_FORMAT}, {"model", model_desc}};
    int nmeta = 2 + tdm_checkpoint_meta(meta + 2, &mt, info, o ? h->steps : 0, o);
    TDM_TRY(tdm_st_save(path, t, nt, meta, nmeta));
fail:
    free(t);
    free(names);
    return st;
}

tdm_status tdm_checkpoint_save(const char *path, tdm_model *m, tdm_optim *opt,
                               const tdm_ckpt_info *info)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *d = tdm_model_device(m);
    int nstate = opt ? tdm_optim_n_state(opt) : 0;
    tdm_ckpt_host h = {.optim = opt ? tdm_optim_get_opts(opt) : NULL,
                       .steps = opt ? tdm_optim_steps(opt) : 0};
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "checkpoint: empty path");
    TDM_REQUIRE(tdm_model_params(m), TDM_STATUS_INVALID_ARG,
                "checkpoint: the model's flat buffers were released (its parameters are "
                "sharded): save through their owner");
    TDM_TRY(tdm_ckpt_stage(d, &h.params, tdm_model_params(m), tdm_model_param_elems(m)));
    TDM_TRY(tdm_ckpt_stage(d, &h.buffers, tdm_model_buffers(m), tdm_model_buffer_elems(m)));
    for (int s = 0; s < nstate; s++)
        TDM_TRY(tdm_ckpt_stage(tdm_optim_device(opt), &h.state[s], tdm_optim_state(opt, s),
                               tdm_model_param_elems(m)));
    TDM_TRY(tdm_checkpoint_save_host(path, m, &h, info));
fail:
    tdm_ckpt_host_free(&h);
    return st;
}

/* strtoll alone clamped "99999999999999999999" to INT64_MAX and took
 * it; a seed is a u64 written with PRIu64, which strtoll would clamp from
 * 2^63 on. */
tdm_status tdm_checkpoint_meta_uint(const tdm_st_file *f, const char *key, uint64_t max,
                                    uint64_t *out)
{
    const char *v = tdm_st_meta_get(f, key);
    char *end;
    TDM_REQUIRE(v, TDM_STATUS_FORMAT, "%s: metadata has no '%s'", tdm_st_path(f), key);
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    TDM_REQUIRE(end != v && *end == '\0' && v[0] >= '0' && v[0] <= '9', TDM_STATUS_FORMAT,
                "%s: metadata '%s' = '%s' is not a non-negative integer", tdm_st_path(f), key, v);
    TDM_REQUIRE(errno != ERANGE && x <= max, TDM_STATUS_FORMAT,
                "%s: metadata '%s' = '%s' is out of range (at most %" PRIu64 "): a corrupt "
                "checkpoint?", tdm_st_path(f), key, v, max);
    *out = x;
    return TDM_STATUS_OK;
}

tdm_status tdm_checkpoint_meta_scaler(const tdm_st_file *f, tdm_ckpt_info *info)
{
    info->loss_scale = 0.0;
    info->loss_scale_growth = 0;
    const char *v = tdm_st_meta_get(f, "loss_scale");
    if (!v) return TDM_STATUS_OK;
    char *end;
    errno = 0;
    double scale = strtod(v, &end);
    TDM_REQUIRE(end != v && *end == '\0' && errno != ERANGE && isfinite(scale) && scale > 0.0 &&
                    scale <= FLT_MAX,
                TDM_STATUS_FORMAT, "%s: metadata 'loss_scale' = '%s' is not a positive finite "
                "float: a corrupt checkpoint?", tdm_st_path(f), v);
    uint64_t growth = 0;
    TDM_CHECK(tdm_checkpoint_meta_uint(f, "loss_scale_growth_tracker", TDM_CKPT_MAX_COUNT,
                                       &growth));
    info->loss_scale = scale;
    info->loss_scale_growth = (int64_t)growth;
    return TDM_STATUS_OK;
}

tdm_status tdm_checkpoint_optim_steps(const tdm_st_file *f, uint64_t step, uint64_t *out)
{
    if (!tdm_st_meta_get(f, "optimizer_steps")) {
        *out = step;
        return TDM_STATUS_OK;
    }
    return tdm_checkpoint_meta_uint(f, "optimizer_steps", TDM_CKPT_MAX_COUNT, out);
}

/* Reads tensor ti into dst (staging) and refuses NaN or infinite values:
 * resuming from them would only train on NaN. */
static tdm_status tdm_ckpt_read_finite(const tdm_st_file *f, const char *name,
                                       const tdm_tensor_info *ti, float *dst)
{
    int64_t first = 0;
    TDM_CHECK(tdm_st_read(f, name, TDM_ST_F32, ti->ndim, ti->shape, dst));
    int64_t bad = tdm_ckpt_count_nonfinite(dst, ti->n_elem, &first);
    TDM_REQUIRE(bad == 0, TDM_STATUS_NONFINITE,
                "%s: tensor '%s' holds %" PRId64 " non-finite value%s (NaN or infinite) of %"
                PRId64 ", the first at index %" PRId64 ": the checkpoint was saved from a run "
                "that had gone bad; resume from an earlier one", tdm_st_path(f), name, bad,
                bad == 1 ? "" : "s", ti->n_elem, first);
    return TDM_STATUS_OK;
}

tdm_status tdm_checkpoint_load_host(const char *path, const tdm_model *m, tdm_ckpt_host *h,
                                    tdm_ckpt_info *info)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_st_file *f = NULL;
    TDM_TRY(tdm_st_load(&f, path));
    const char *fmt = tdm_st_meta_get(f, "format");
    if (!fmt || strcmp(fmt, TDM_CKPT_FORMAT)) {
        st = tdm_error_set(TDM_STATUS_FORMAT,
                           "%s: not a tandem checkpoint (metadata format '%s', expected '%s')",
                           path, fmt ? fmt : "(none)", TDM_CKPT_FORMAT);
        goto fail;
    }
    char want[160];
    tdm_model_spec_describe(tdm_model_get_spec(m), want, sizeof want);
    const char *have = tdm_st_meta_get(f, "model");
    if (!have || strcmp(have, want)) {
        st = tdm_error_set(TDM_STATUS_MISMATCH,
                           "%s: checkpoint is of model '%s' but this run builds '%s'", path,
                           have ? have : "(none)", want);
        goto fail;
    }
    for (int i = 0; i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *ti = tdm_model_param_info(m, i);
        TDM_TRY(tdm_ckpt_read_finite(f, ti->name, ti, h->params + ti->offset));
    }
    for (int i = 0; i < tdm_model_n_buffers(m); i++) {
        const tdm_tensor_info *ti = tdm_model_buffer_info(m, i);
        TDM_TRY(tdm_ckpt_read_finite(f, ti->name, ti, h->buffers + ti->offset));
    }
    uint64_t step = 0, epoch = 0, seed = 0;
    TDM_TRY(tdm_checkpoint_meta_uint(f, "step", TDM_CKPT_MAX_COUNT, &step));
    TDM_TRY(tdm_checkpoint_meta_uint(f, "epoch", TDM_CKPT_MAX_COUNT, &epoch));
    TDM_TRY(tdm_checkpoint_meta_uint(f, "seed", UINT64_MAX, &seed));
    if (h->optim) {
        const char *ok = tdm_st_meta_get(f, "optimizer");
        const char *wantk = tdm_checkpoint_optim_name(h->optim->kind);
        if (!ok || strcmp(ok, wantk)) {
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "%s: checkpoint holds %s optimizer state but this run uses %s",
                               path, ok ? ok : "no", wantk);
            goto fail;
        }
        for (int s = 0; s < tdm_optim_kind_n_state(h->optim); s++) {
            for (int i = 0; i < tdm_model_n_params(m); i++) {
                const tdm_tensor_info *ti = tdm_model_param_info(m, i);
                char name[96];
                snprintf(name, sizeof name, "optim.%s.%s",
                         tdm_optim_kind_state_name(h->optim->kind, s), ti->name);
                TDM_TRY(tdm_ckpt_read_finite(f, name, ti, h->state[s] + ti->offset));
            }
        }
        uint64_t osteps = 0;
        TDM_TRY(tdm_checkpoint_optim_steps(f, step, &osteps));
        h->steps = (int64_t)osteps;
    }
    tdm_ckpt_info got = {.step = (int64_t)step, .epoch = (int64_t)epoch, .seed = seed};
    TDM_TRY(tdm_checkpoint_meta_scaler(f, &got));
    if (info) *info = got;
fail:
    tdm_st_free(f);
    return st;
}

tdm_status tdm_checkpoint_load(const char *path, tdm_model *m, tdm_optim *opt,
                               tdm_ckpt_info *info)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *d = tdm_model_device(m);
    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    tdm_ckpt_host h = {.optim = opt ? tdm_optim_get_opts(opt) : NULL};
    tdm_ckpt_info got = {0};
    TDM_REQUIRE(tdm_model_params(m), TDM_STATUS_INVALID_ARG,
                "checkpoint: the model's flat buffers were released (its parameters are "
                "sharded): load through their owner");
    h.params = calloc((size_t)pe, sizeof(float));
    h.buffers = calloc((size_t)(be > 0 ? be : 1), sizeof(float));
    if (!h.params || !h.buffers) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate checkpoint staging");
        goto fail;
    }
    for (int s = 0; opt && s < tdm_optim_n_state(opt); s++) {
        h.state[s] = calloc((size_t)pe, sizeof(float));
        if (!h.state[s]) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate optimizer staging");
            goto fail;
        }
    }
    TDM_TRY(tdm_checkpoint_load_host(path, m, &h, &got));
    /* Everything validated: only now overwrite the live model. */
    TDM_TRY(tdm_dev_copy_from_host(d, tdm_model_params(m), h.params, (size_t)pe * sizeof(float)));
    if (be > 0)
        TDM_TRY(tdm_dev_copy_from_host(d, tdm_model_buffers(m), h.buffers,
                                       (size_t)be * sizeof(float)));
    if (opt) {
        for (int s = 0; s < tdm_optim_n_state(opt); s++)
            TDM_TRY(tdm_dev_copy_from_host(tdm_optim_device(opt), tdm_optim_state(opt, s),
                                           h.state[s], (size_t)pe * sizeof(float)));
        tdm_optim_set_steps(opt, h.steps);
    }
    if (info) *info = got;
fail:
    tdm_ckpt_host_free(&h);
    return st;
}
