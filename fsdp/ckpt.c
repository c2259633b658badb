/* fsdp/ckpt.c: checkpoints of a sharded model. The full state dict:
 * every unit's shards gathered to rank 0, which writes the file every
 * other mode writes (models/checkpoint.h); loading it at any N takes each
 * rank's slices. The sharded form: one safetensors file per rank with its
 * shards of every unit, and an index written last by rank 0 (model, unit
 * layout, world, step, the rank files' id, the replicated buffers); it
 * loads at the same N file for file, or at another N by taking the pieces
 * of the files each new shard overlaps. Not here: when to save (tools/). */
#include "fsdp/fsdp_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/safetensors.h"

#define TDM_FSDP_INDEX_FORMAT "tandem-fsdp-sharded-1"
#define TDM_FSDP_SHARD_FORMAT "tandem-fsdp-shard-1"

/* Every rank learns whether every rank succeeded, and why the first that
 * failed did (its message travels with the statuses). */
#define TDM_FSDP_MSG 256
static tdm_status tdm_fsdp_agree(tdm_fsdp *f, tdm_status mine, const char *what, const char *path)
{
    char msg[640];
    snprintf(msg, sizeof msg, "%s", mine ? tdm_error_message() : "");
    /* per rank: the status, then the message (int32 words) */
    size_t per = 1 + TDM_FSDP_MSG / 4;
    int32_t *all = calloc((size_t)f->world * per, sizeof *all);
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "fsdp: calloc");
    int32_t *own = all + (size_t)f->rank * per;
    own[0] = (int32_t)mine;
    /* the first TDM_FSDP_MSG - 1 bytes: what is cut is cut on purpose */
    memcpy(own + 1, msg, strnlen(msg, TDM_FSDP_MSG - 1));
    tdm_comm_set_label(f->hcomm, "%s checkpoint statuses", tdm_fsdp_tag(f));
    tdm_status st = tdm_comm_all_gather(f->hcomm, own, all, per, TDM_DTYPE_INT32);
    int bad = -1;
    for (int r = 0; st == TDM_STATUS_OK && r < f->world; r++)
        if (all[(size_t)r * per] && bad < 0) bad = r;
    tdm_status theirs = TDM_STATUS_OK;
    char why[TDM_FSDP_MSG] = "";
    if (bad >= 0) {
        theirs = (tdm_status)all[(size_t)bad * per];
        memcpy(why, all + (size_t)bad * per + 1, sizeof why);
        why[sizeof why - 1] = '\0';
    }
    free(all);
    TDM_CHECK(st);
    if (mine) return tdm_error_set(mine, "%s", msg);
    TDM_REQUIRE(bad < 0, theirs == TDM_STATUS_OK ? TDM_STATUS_PEER_FAILED : theirs,
                "fsdp: rank %d failed to %s %s: %s", bad, what, path, why);
    return TDM_STATUS_OK;
}


static tdm_status tdm_fsdp_check_opt(const tdm_fsdp *f, const tdm_optim *opt)
{
    TDM_REQUIRE(!opt || tdm_optim_n_elem(opt) == f->shard_elems, TDM_STATUS_INVALID_ARG,
                "fsdp checkpoint: the optimizer covers %lld elements, this rank's shard %lld: "
                "make it with tdm_fsdp_optim_init", opt ? (long long)tdm_optim_n_elem(opt) : 0LL,
                (long long)f->shard_elems);
    return TDM_STATUS_OK;
}

/* ---- the full state dict ---- */

tdm_status tdm_fsdp_save_full(tdm_fsdp *f, const char *path, tdm_optim *opt,
                              const tdm_ckpt_info *info)
{
    tdm_model *m = f->m;
    tdm_device *d = f->dev;
    TDM_CHECK(tdm_fsdp_check_opt(f, opt));
    tdm_status st = tdm_fsdp_settle_params(f, 0);
    if (st) return tdm_fsdp_fail(f, st);
    int root = f->rank == 0, ns = opt ? tdm_optim_n_state(opt) : 0;
    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    tdm_ckpt_host h = {.optim = opt ? tdm_optim_get_opts(opt) : NULL,
                       .steps = opt ? tdm_optim_steps(opt) : 0};
    tdm_status mine = TDM_STATUS_OK;
    char msg[640] = "";
    float *blk = NULL, *sstage = NULL;
    size_t nb = 0, snb = 0;
    /* shards or state in host memory go up to the device to be gathered */
    if (f->sdev != d || (opt && tdm_optim_device(opt) != d))
        st = tdm_fsdp_pool_get(f, (size_t)(f->max_padded / f->world) * sizeof(float), 0,
                               &sstage, &snb);
    if (st) return tdm_fsdp_fail(f, st);
    if (root) {
        h.params = calloc((size_t)pe, sizeof(float));
        h.buffers = calloc((size_t)(be > 0 ? be : 1), sizeof(float));
        for (int s = 0; s < ns; s++) h.state[s] = calloc((size_t)pe, sizeof(float));
        if (!h.params || !h.buffers || (ns > 0 && !h.state[0]) || (ns > 1 && !h.state[1]))
            mine = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                                 "fsdp: cannot stage %lld parameters on rank 0 to save %s",
                                 (long long)pe, path);
        if (!mine && be > 0)
            mine = tdm_dev_copy_to_host(d, h.buffers, tdm_model_buffers(m),
                                        (size_t)be * sizeof(float));
        st = tdm_fsdp_pool_get(f, (size_t)f->max_padded * sizeof(float), 0, &blk, &nb);
    }
    /* every rank takes part in every gather, whatever rank 0 could stage */
    for (int u = 0; st == TDM_STATUS_OK && u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        for (int k = 0; st == TDM_STATUS_OK && k <= ns; k++) {
            const float *send;
            st = tdm_fsdp_comm_src(f, k == 0 ? f->sdev : tdm_optim_device(opt),
                                   k == 0 ? tdm_fsdp_pshard(f, u)
                                          : tdm_optim_state(opt, k - 1) + x->shard_off,
                                   x->shard, sstage, &send);
            if (st) break;
            tdm_comm_set_label(f->comm, "%s checkpoint gather unit %d", tdm_fsdp_tag(f), u);
            st = tdm_comm_gather(f->comm, send, blk, (size_t)x->shard, TDM_DTYPE_FLOAT32, 0);
            float *dst = k == 0 ? h.params : h.state[k - 1];
            if (st == TDM_STATUS_OK && root && !mine)
                mine = tdm_dev_copy_to_host(d, dst + x->offset, blk,
                                            (size_t)x->n_elem * sizeof(float));
        }
    }
    tdm_fsdp_pool_put(f, sstage, snb);
    tdm_fsdp_pool_put(f, blk, nb);
    tdm_fsdp_pool_trim(f);
    if (st) return tdm_fsdp_fail(f, tdm_error_prefix(st, "fsdp: gathering %s", path));
    if (root && !mine) mine = tdm_checkpoint_save_host(path, m, &h, info);
    if (mine) snprintf(msg, sizeof msg, "%s", tdm_error_message());
    tdm_ckpt_host_free(&h);
    /* doubles as the barrier: nobody goes on before the file is in place */
    int32_t ok = mine == TDM_STATUS_OK;
    tdm_comm_set_label(f->hcomm, "%s checkpoint saved flag", tdm_fsdp_tag(f));
    TDM_CHECK(tdm_comm_broadcast(f->hcomm, &ok, &ok, 1, TDM_DTYPE_INT32, 0));
    if (mine) return tdm_error_set(mine, "%s", msg);
    TDM_REQUIRE(ok, TDM_STATUS_IO, "fsdp: rank 0 failed to save the checkpoint %s", path);
    return TDM_STATUS_OK;
}

/* Puts unit-layout values (src: the model's flat layout, host) into this
 * rank's places: the shard of each unit (zero beyond the unit), and for
 * SHARD_GRAD_OP and SHARD_OPTIM the full copy as well. */
static tdm_status tdm_fsdp_place(tdm_fsdp *f, const float *src, float *stage, float *shard_dst,
                                 tdm_device *dst_dev, int params)
{
    tdm_device *d = f->dev;
    for (int u = 0; u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        memset(stage, 0, (size_t)x->padded * sizeof(float));
        memcpy(stage, src + x->offset, (size_t)x->n_elem * sizeof(float));
        if (params && f->buf.pfull) {
            TDM_CHECK(tdm_dev_copy_from_host(d, f->buf.pfull + x->full_off, stage,
                                             (size_t)x->padded * sizeof(float)));
            continue;   /* its shard is a slice of the full copy */
        }
        float *dst = params ? tdm_fsdp_pshard(f, u) : shard_dst + x->shard_off;
        TDM_CHECK(tdm_dev_copy_from_host(dst_dev, dst, stage + (int64_t)f->rank * x->shard,
                                         (size_t)x->shard * sizeof(float)));
    }
    return TDM_STATUS_OK;
}

/* Before a load: the optimizer fits, and what is gathered now (about to
 * be stale) is released. *ns: the optimizer's state tensors (0: none). */
static tdm_status tdm_fsdp_load_begin(tdm_fsdp *f, tdm_optim *opt, int *ns)
{
    TDM_CHECK(tdm_fsdp_check_opt(f, opt));
    *ns = opt ? tdm_optim_n_state(opt) : 0;
    tdm_status st = tdm_fsdp_settle_params(f, 1);
    return st ? tdm_fsdp_fail(f, st) : st;
}

tdm_status tdm_fsdp_load_full(tdm_fsdp *f, const char *path, tdm_optim *opt,
                              tdm_ckpt_info *info)
{
    int ns;
    TDM_CHECK(tdm_fsdp_load_begin(f, opt, &ns));
    tdm_model *m = f->m;
    tdm_status st = TDM_STATUS_OK;
    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    tdm_ckpt_host h = {.optim = opt ? tdm_optim_get_opts(opt) : NULL};
    tdm_ckpt_info got = {0};
    float *stage = NULL;
    tdm_status mine = TDM_STATUS_OK;
    h.params = calloc((size_t)pe, sizeof(float));
    h.buffers = calloc((size_t)(be > 0 ? be : 1), sizeof(float));
    stage = calloc((size_t)f->max_padded, sizeof(float));
    for (int s = 0; s < ns; s++) h.state[s] = calloc((size_t)pe, sizeof(float));
    if (!h.params || !h.buffers || !stage || (ns > 0 && !h.state[0]) || (ns > 1 && !h.state[1]))
        mine = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: cannot stage %s (%lld parameters)",
                             path, (long long)pe);
    if (!mine) mine = tdm_checkpoint_load_host(path, m, &h, &got);
    /* nothing is overwritten unless every rank read the file */
    st = tdm_fsdp_agree(f, mine, "load the checkpoint", path);
    if (st == TDM_STATUS_OK) st = tdm_fsdp_place(f, h.params, stage, NULL, f->sdev, 1);
    for (int s = 0; st == TDM_STATUS_OK && s < ns; s++)
        st = tdm_fsdp_place(f, h.state[s], stage, tdm_optim_state(opt, s),
                            tdm_optim_device(opt), 0);
    if (st == TDM_STATUS_OK && be > 0)
        st = tdm_dev_copy_from_host(f->dev, tdm_model_buffers(m), h.buffers,
                                    (size_t)be * sizeof(float));
    if (st == TDM_STATUS_OK && opt) tdm_optim_set_steps(opt, h.steps);
    if (st == TDM_STATUS_OK && info) *info = got;
    tdm_ckpt_host_free(&h);
    free(stage);
    return st;
}

/* ---- the sharded form ---- */

/* "first-last@offset+n_elem" per unit, ';'-separated: the layout a
 * sharded checkpoint is tied to (the shard size follows from N). */
static char *tdm_fsdp_units_text(const tdm_fsdp *f)
{
    size_t cap = (size_t)f->nu * 64 + 1;
    char *s = malloc(cap);
    if (!s) return NULL;
    size_t o = 0;
    s[0] = '\0';
    for (int u = 0; u < f->nu; u++)
        o += (size_t)snprintf(s + o, cap - o, "%s%d-%d@%lld+%lld", u ? ";" : "", f->u[u].first,
                              f->u[u].last, (long long)f->u[u].offset,
                              (long long)f->u[u].n_elem);
    return s;
}

static void tdm_fsdp_rank_path(char *out, size_t n, const char *path, const char *id, int r, int w)
{
    snprintf(out, n, "%s.%s.rank%d-of-%d", path, id, r, w);
}

static tdm_status tdm_fsdp_finite(const char *file, const char *name, const float *v, int64_t n)
{
    int64_t bad = 0, first = 0;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i]) && bad++ == 0) first = i;
    TDM_REQUIRE(bad == 0, TDM_STATUS_NONFINITE,
                "%s: tensor '%s' holds %" PRId64 " non-finite value%s (NaN or infinite) of %"
                PRId64 ", the first at index %" PRId64, file, name, bad, bad == 1 ? "" : "s", n,
                first);
    return TDM_STATUS_OK;
}

/* This rank's file: its shard of every unit's parameters and optimizer
 * state, host-staged. */
static tdm_status tdm_fsdp_write_rank_file(tdm_fsdp *f, const char *file, tdm_optim *opt,
                                           const char *id, const char *units, const char *model)
{
    int ns = opt ? tdm_optim_n_state(opt) : 0, nt = f->nu * (1 + ns);
    tdm_status st = TDM_STATUS_OK;
    float *host = calloc((size_t)(f->shard_elems ? f->shard_elems : 1) * (size_t)(1 + ns),
                         sizeof(float));
    tdm_st_tensor *t = calloc((size_t)nt, sizeof *t);
    char (*names)[64] = calloc((size_t)nt, sizeof *names);
    if (!host || !t || !names) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: staging %s", file);
        goto fail;
    }
    int k = 0;
    for (int s = 0; s <= ns; s++) {
        float *base = host + (size_t)s * (size_t)f->shard_elems;
        for (int u = 0; u < f->nu; u++) {
            const tdm_fsdp_unit *x = &f->u[u];
            const float *src = s == 0 ? tdm_fsdp_pshard(f, u)
                                      : tdm_optim_state(opt, s - 1) + x->shard_off;
            TDM_TRY(tdm_dev_copy_to_host(s == 0 ? f->sdev : tdm_optim_device(opt),
                                         base + x->shard_off, src,
                                         (size_t)x->shard * sizeof(float)));
            if (s == 0) snprintf(names[k], sizeof names[k], "unit%d.params", u);
            else
                snprintf(names[k], sizeof names[k], "unit%d.optim.%s", u,
                         tdm_optim_state_name(opt, s - 1));
            TDM_TRY(tdm_fsdp_finite(file, names[k], base + x->shard_off, x->shard));
            t[k] = (tdm_st_tensor){.name = names[k], .dtype = TDM_ST_F32, .ndim = 1,
                                   .shape = {x->shard}, .data = base + x->shard_off,
                                   .nbytes = (size_t)x->shard * sizeof(float)};
            k++;
        }
    }
    char rank[16], world[16];
    snprintf(rank, sizeof rank, "%d", f->rank);
    snprintf(world, sizeof world, "%d", f->world);
    tdm_st_meta meta[] = {{"format", TDM_FSDP_SHARD_FORMAT}, {"model", model}, {"id", id},
                          {"rank", rank}, {"world", world}, {"units", units}};
    TDM_TRY(tdm_st_save(file, t, nt, meta, (int)(sizeof meta / sizeof meta[0])));
fail:
    free(host);
    free(t);
    free(names);
    return st;
}

static tdm_status tdm_fsdp_write_index(tdm_fsdp *f, const char *path, tdm_optim *opt,
                                       const tdm_ckpt_info *info, const char *id,
                                       const char *units, const char *model)
{
    tdm_model *m = f->m;
    tdm_device *d = f->dev;
    int nbuf = tdm_model_n_buffers(m);
    int64_t be = tdm_model_buffer_elems(m);
    tdm_status st = TDM_STATUS_OK;
    float *hb = calloc((size_t)(be > 0 ? be : 1), sizeof(float));
    tdm_st_tensor *t = calloc((size_t)(nbuf > 0 ? nbuf : 1), sizeof *t);
    if (!hb || !t) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: staging %s", path);
        goto fail;
    }
    if (be > 0)
        TDM_TRY(tdm_dev_copy_to_host(d, hb, tdm_model_buffers(m), (size_t)be * sizeof(float)));
    for (int i = 0; i < nbuf; i++) {
        const tdm_tensor_info *ti = tdm_model_buffer_info(m, i);
        t[i] = (tdm_st_tensor){.name = ti->name, .dtype = TDM_ST_F32, .ndim = ti->ndim,
                               .data = hb + ti->offset, .nbytes = (size_t)ti->n_elem * 4};
        for (int j = 0; j < ti->ndim; j++) t[i].shape[j] = ti->shape[j];
    }
    char world[16];
    tdm_ckpt_meta_text mt;
    snprintf(world, sizeof world, "%d", f->world);
    tdm_st_meta meta[6 + TDM_CKPT_META_MAX] = {
        {"format", TDM_FSDP_INDEX_FORMAT}, {"model", model}, {"id", id},
        {"world", world}, {"units", units}, {"sharding", tdm_fsdp_sharding_name(f->o.sharding)}};
    int nmeta = 6 + tdm_checkpoint_meta(meta + 6, &mt, info, opt ? tdm_optim_steps(opt) : 0,
                                        opt ? tdm_optim_get_opts(opt) : NULL);
    TDM_TRY(tdm_st_save(path, t, nbuf, meta, nmeta));
fail:
    free(hb);
    free(t);
    return st;
}

/* The id and world of the index at path, when there is a valid one. */
static int tdm_fsdp_old_index(const char *path, char *id, size_t n, int *world)
{
    tdm_st_file *f = NULL;
    if (access(path, F_OK) != 0 || tdm_st_load(&f, path) != TDM_STATUS_OK) {
        tdm_error_clear();
        return 0;
    }
    const char *fmt = tdm_st_meta_get(f, "format"), *i = tdm_st_meta_get(f, "id");
    const char *w = tdm_st_meta_get(f, "world");
    int ok = fmt && !strcmp(fmt, TDM_FSDP_INDEX_FORMAT) && i && w && strlen(i) < n &&
             !strchr(i, '/') && atoi(w) > 0 && atoi(w) <= TDM_FSDP_MAX_RANKS;
    if (ok) {
        snprintf(id, n, "%s", i);
        *world = atoi(w);
    }
    tdm_st_free(f);
    return ok;
}

tdm_status tdm_fsdp_save_sharded(tdm_fsdp *f, const char *path, tdm_optim *opt,
                                 const tdm_ckpt_info *info)
{
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "fsdp checkpoint: empty path");
    TDM_CHECK(tdm_fsdp_check_opt(f, opt));
    tdm_status st = tdm_fsdp_settle_params(f, 0);
    if (st) return tdm_fsdp_fail(f, st);
    /* one id per save, from rank 0: the new rank files never overwrite
     * those the current index names */
    int64_t idv = f->rank == 0 ? (int64_t)(tdm_time_ns() ^ ((uint64_t)getpid() << 40)) : 0;
    tdm_comm_set_label(f->hcomm, "%s checkpoint id", tdm_fsdp_tag(f));
    TDM_CHECK(tdm_comm_broadcast(f->hcomm, &idv, &idv, 1, TDM_DTYPE_INT64, 0));
    char id[20], file[1024], model[160];
    snprintf(id, sizeof id, "%016" PRIx64, (uint64_t)idv);
    tdm_model_spec_describe(tdm_model_get_spec(f->m), model, sizeof model);
    char *units = tdm_fsdp_units_text(f);
    TDM_REQUIRE(units, TDM_STATUS_OUT_OF_MEMORY, "fsdp: units text");
    tdm_fsdp_rank_path(file, sizeof file, path, id, f->rank, f->world);
    tdm_status mine = tdm_fsdp_write_rank_file(f, file, opt, id, units, model);
    st = tdm_fsdp_agree(f, mine, "write its shard file for", path);
    if (st) {
        if (!mine) (void)unlink(file);   /* an index will never name it */
        free(units);
        return st;
    }
    char old_id[20] = "";
    int old_world = 0, had_old = 0;
    if (f->rank == 0) {
        had_old = tdm_fsdp_old_index(path, old_id, sizeof old_id, &old_world);
        mine = tdm_fsdp_write_index(f, path, opt, info, id, units, model);
    }
    free(units);
    st = tdm_fsdp_agree(f, mine, "write the checkpoint index", path);
    if (st) {
        (void)unlink(file);
        return st;
    }
    /* the new index is in place: the files of the one it replaced go */
    int32_t old[2] = {had_old, old_world};
    char oid[20];
    memcpy(oid, old_id, sizeof oid);
    tdm_comm_set_label(f->hcomm, "%s checkpoint old index", tdm_fsdp_tag(f));
    TDM_CHECK(tdm_comm_broadcast(f->hcomm, old, old, 2, TDM_DTYPE_INT32, 0));
    tdm_comm_set_label(f->hcomm, "%s checkpoint old index id", tdm_fsdp_tag(f));
    TDM_CHECK(tdm_comm_broadcast(f->hcomm, oid, oid, sizeof oid / 4, TDM_DTYPE_INT32, 0));
    oid[sizeof oid - 1] = '\0';
    if (old[0] && strcmp(oid, id)) {
        for (int r = f->rank; r < old[1]; r += f->world) {
            tdm_fsdp_rank_path(file, sizeof file, path, oid, r, old[1]);
            (void)unlink(file);
        }
    }
    return TDM_STATUS_OK;
}

/* Parses the unit layout text and compares it with this run's. */
static tdm_status tdm_fsdp_check_units(const tdm_fsdp *f, const char *file, const char *text)
{
    const char *p = text;
    for (int u = 0; u < f->nu; u++) {
        long long a, b, o, n;
        int used = 0;
        TDM_REQUIRE(p && sscanf(p, "%lld-%lld@%lld+%lld%n", &a, &b, &o, &n, &used) == 4,
                    TDM_STATUS_MISMATCH,
                    "%s: the checkpoint has fewer units than this run's %d (unit %d missing): "
                    "build the model with the same unit options", file, f->nu, u);
        const tdm_fsdp_unit *x = &f->u[u];
        TDM_REQUIRE(a == x->first && b == x->last && o == x->offset && n == x->n_elem,
                    TDM_STATUS_MISMATCH,
                    "%s: unit %d differs: the checkpoint's holds parameters %lld..%lld (%lld "
                    "elements at offset %lld), this run's %d..%d (%lld at %lld): build the "
                    "model with the same unit options, or load a full checkpoint", file, u, a,
                    b, n, o, x->first, x->last, (long long)x->n_elem, (long long)x->offset);
        p += used;
        if (*p == ';') p++;
    }
    TDM_REQUIRE(*p == '\0', TDM_STATUS_MISMATCH,
                "%s: the checkpoint has more units than this run's %d: build the model with the "
                "same unit options", file, f->nu);
    return TDM_STATUS_OK;
}

/* Fills this rank's shards (stage: (1 + ns) * shard_elems floats, host)
 * from the rank files of a save by W ranks: for each unit the elements
 * [r s', (r+1) s') of this run's shard come from the old ranks whose
 * shards [q s, (q+1) s) overlap them. */
static tdm_status tdm_fsdp_read_shards(tdm_fsdp *f, const char *path, const char *id, int W,
                                       const char *units, const char *model, tdm_optim *opt,
                                       float *stage)
{
    int ns = opt ? tdm_optim_n_state(opt) : 0;
    tdm_status st = TDM_STATUS_OK;
    char file[1024], name[64];
    float *tmp = NULL;
    tdm_st_file *sf = NULL;
    for (int q = 0; q < W && st == TDM_STATUS_OK; q++) {
        int needed = 0;
        for (int u = 0; u < f->nu && !needed; u++) {
            const tdm_fsdp_unit *x = &f->u[u];
            int64_t s_old = (x->n_elem + W - 1) / W;
            int64_t lo = (int64_t)f->rank * x->shard, hi = lo + x->shard;
            if (hi > x->n_elem) hi = x->n_elem;
            needed = lo < hi && q * s_old < hi && (q + 1) * s_old > lo;
        }
        if (!needed) continue;
        tdm_fsdp_rank_path(file, sizeof file, path, id, q, W);
        TDM_TRY(tdm_st_load(&sf, file));
        const char *fmt = tdm_st_meta_get(sf, "format"), *fid = tdm_st_meta_get(sf, "id");
        const char *fm = tdm_st_meta_get(sf, "model"), *fu = tdm_st_meta_get(sf, "units");
        const char *fr = tdm_st_meta_get(sf, "rank");
        if (!fmt || strcmp(fmt, TDM_FSDP_SHARD_FORMAT) || !fid || strcmp(fid, id) || !fm ||
            strcmp(fm, model) || !fu || strcmp(fu, units) || !fr || atoi(fr) != q) {
            st = tdm_error_set(TDM_STATUS_FORMAT,
                               "%s: not the shard file of rank %d that the index %s names (id "
                               "%s, model %s): the checkpoint is incomplete or mixed with "
                               "another save", file, q, path, fid ? fid : "(none)",
                               fm ? fm : "(none)");
            goto fail;
        }
        for (int u = 0; u < f->nu; u++) {
            const tdm_fsdp_unit *x = &f->u[u];
            int64_t s_old = (x->n_elem + W - 1) / W;
            int64_t lo = (int64_t)f->rank * x->shard, hi = lo + x->shard;
            int64_t a = q * s_old > lo ? q * s_old : lo;
            int64_t b = (q + 1) * s_old < hi ? (q + 1) * s_old : hi;
            if (b > x->n_elem) b = x->n_elem;
            if (a >= b) continue;
            free(tmp);
            tmp = malloc((size_t)s_old * sizeof(float));
            if (!tmp) {
                st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: staging %s", file);
                goto fail;
            }
            for (int s = 0; s <= ns; s++) {
                if (s == 0) snprintf(name, sizeof name, "unit%d.params", u);
                else
                    snprintf(name, sizeof name, "unit%d.optim.%s", u,
                             tdm_optim_state_name(opt, s - 1));
                TDM_TRY(tdm_st_read(sf, name, TDM_ST_F32, 1, &s_old, tmp));
                TDM_TRY(tdm_fsdp_finite(file, name, tmp, s_old));
                float *dst = stage + (size_t)s * (size_t)f->shard_elems + x->shard_off;
                memcpy(dst + (a - lo), tmp + (a - q * s_old), (size_t)(b - a) * sizeof(float));
            }
        }
        tdm_st_free(sf);
        sf = NULL;
    }
fail:
    tdm_st_free(sf);
    free(tmp);
    return st;
}

tdm_status tdm_fsdp_load_sharded(tdm_fsdp *f, const char *path, tdm_optim *opt,
                                 tdm_ckpt_info *info)
{
    int ns;
    TDM_CHECK(tdm_fsdp_load_begin(f, opt, &ns));
    tdm_model *m = f->m;
    tdm_device *d = f->dev;
    tdm_status st = TDM_STATUS_OK;
    int64_t be = tdm_model_buffer_elems(m), step = 0, epoch = 0, osteps = 0;
    uint64_t seed = 0;
    tdm_ckpt_info scaler = {0};   /* its loss scaler's fields */
    tdm_st_file *idx = NULL;
    char model[160], *units = tdm_fsdp_units_text(f);
    float *stage = calloc((size_t)(f->shard_elems ? f->shard_elems : 1) * (size_t)(1 + ns),
                          sizeof(float));
    float *hb = calloc((size_t)(be > 0 ? be : 1), sizeof(float));
    tdm_status mine = TDM_STATUS_OK;
    tdm_model_spec_describe(tdm_model_get_spec(m), model, sizeof model);
    if (!units || !stage || !hb) {
        mine = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: staging %s", path);
        goto agree;
    }
    if ((mine = tdm_st_load(&idx, path))) goto agree;
    const char *fmt = tdm_st_meta_get(idx, "format"), *im = tdm_st_meta_get(idx, "model");
    const char *id = tdm_st_meta_get(idx, "id"), *w = tdm_st_meta_get(idx, "world");
    const char *ok = tdm_st_meta_get(idx, "optimizer");
    if (!fmt || strcmp(fmt, TDM_FSDP_INDEX_FORMAT)) {
        mine = tdm_error_set(TDM_STATUS_FORMAT,
                             "%s: not a sharded checkpoint index (format '%s', expected '%s'); "
                             "a full checkpoint loads with tdm_fsdp_load_full", path,
                             fmt ? fmt : "(none)", TDM_FSDP_INDEX_FORMAT);
        goto agree;
    }
    if (!im || strcmp(im, model)) {
        mine = tdm_error_set(TDM_STATUS_MISMATCH,
                             "%s: checkpoint is of model '%s' but this run builds '%s'", path,
                             im ? im : "(none)", model);
        goto agree;
    }
    int W = w ? atoi(w) : 0;
    if (W < 1 || W > TDM_FSDP_MAX_RANKS || !id || strchr(id, '/') || strlen(id) > 16) {
        mine = tdm_error_set(TDM_STATUS_FORMAT, "%s: bad world '%s' or id in the index", path,
                             w ? w : "(none)");
        goto agree;
    }
    if ((mine = tdm_fsdp_check_units(f, path, tdm_st_meta_get(idx, "units")
                                                  ? tdm_st_meta_get(idx, "units") : "")))
        goto agree;
    const char *want = opt ? tdm_checkpoint_optim_name(tdm_optim_get_opts(opt)->kind) : NULL;
    if (opt && (!ok || strcmp(ok, want))) {
        mine = tdm_error_set(TDM_STATUS_MISMATCH,
                             "%s: checkpoint holds %s optimizer state but this run uses %s", path,
                             ok ? ok : "no", want);
        goto agree;
    }
    uint64_t count;
    if ((mine = tdm_checkpoint_meta_uint(idx, "step", TDM_CKPT_MAX_COUNT, &count))) goto agree;
    step = (int64_t)count;
    if ((mine = tdm_checkpoint_optim_steps(idx, count, &count))) goto agree;
    osteps = (int64_t)count;
    if ((mine = tdm_checkpoint_meta_uint(idx, "epoch", TDM_CKPT_MAX_COUNT, &count))) goto agree;
    epoch = (int64_t)count;
    const char *sv = tdm_st_meta_get(idx, "seed");
    seed = sv ? strtoull(sv, NULL, 10) : 0;
    if ((mine = tdm_checkpoint_meta_scaler(idx, &scaler))) goto agree;
    for (int i = 0; i < tdm_model_n_buffers(m) && !mine; i++) {
        const tdm_tensor_info *ti = tdm_model_buffer_info(m, i);
        mine = tdm_st_read(idx, ti->name, TDM_ST_F32, ti->ndim, ti->shape, hb + ti->offset);
        if (!mine) mine = tdm_fsdp_finite(path, ti->name, hb + ti->offset, ti->n_elem);
    }
    if (!mine) mine = tdm_fsdp_read_shards(f, path, id, W, units, model, opt, stage);
agree:
    st = tdm_fsdp_agree(f, mine, "load the sharded checkpoint", path);
    for (int u = 0; st == TDM_STATUS_OK && u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        for (int s = 0; st == TDM_STATUS_OK && s <= ns; s++) {
            float *dst = s == 0 ? tdm_fsdp_pshard(f, u)
                                : tdm_optim_state(opt, s - 1) + x->shard_off;
            st = tdm_dev_copy_from_host(s == 0 ? f->sdev : tdm_optim_device(opt), dst,
                                        stage + (size_t)s * (size_t)f->shard_elems +
                                            x->shard_off,
                                        (size_t)x->shard * sizeof(float));
        }
    }
    if (st == TDM_STATUS_OK && be > 0)
        st = tdm_dev_copy_from_host(d, tdm_model_buffers(m), hb, (size_t)be * sizeof(float));
    /* grad_op and optimizer keep full parameters: every rank's new shard
     * into every rank's copy */
    for (int u = 0; st == TDM_STATUS_OK && f->buf.pfull && u < f->nu; u++) {
        f->u[u].params = TDM_FSDP_PARAMS_ABSENT;
        st = tdm_fsdp_issue_gather(f, u, 0);
    }
    if (st == TDM_STATUS_OK && f->buf.pfull) st = tdm_fsdp_settle_params(f, 0);
    if (st == TDM_STATUS_OK && opt) tdm_optim_set_steps(opt, osteps);
    if (st == TDM_STATUS_OK && info)
        *info = (tdm_ckpt_info){.step = step, .epoch = epoch, .seed = seed,
                                .loss_scale = scaler.loss_scale,
                                .loss_scale_growth = scaler.loss_scale_growth};
    tdm_st_free(idx);
    free(units);
    free(stage);
    free(hb);
    return st;
}

/* 1 when path holds a sharded checkpoint's index: its format line sits
 * in the safetensors header's metadata, whose length grows with the
 * units listed there (read up to 1 MiB of it; a full checkpoint is not
 * read further). */
static int tdm_fsdp_is_index(const char *path)
{
    size_t cap = 1 << 20;
    char *buf = malloc(cap + 1);
    FILE *fp = buf ? fopen(path, "rb") : NULL;
    if (!fp) {
        free(buf);
        return 0;
    }
    size_t n = fread(buf, 1, cap, fp);
    fclose(fp);
    buf[n] = 0;
    for (size_t i = 0; i < n; i++)
        if (!buf[i]) buf[i] = ' ';
    /* any version: tdm_fsdp_load_sharded names one it cannot read */
    int found = strstr(buf, "tandem-fsdp-sharded-") != NULL;
    free(buf);
    return found;
}

tdm_status tdm_fsdp_load(tdm_fsdp *f, const char *path, tdm_optim *opt, tdm_ckpt_info *info)
{
    return tdm_fsdp_is_index(path) ? tdm_fsdp_load_sharded(f, path, opt, info)
                                   : tdm_fsdp_load_full(f, path, opt, info);
}
