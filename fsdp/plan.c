/* fsdp/plan.c: the unit plan (which layers form each unit, each unit's
 * flat buffer padded to a multiple of N and its shard, the offsets of the
 * shards in the rank's state) and its check across ranks (the same plan
 * and tensor layout on every rank, or a named error), both run once by
 * tdm_fsdp_init (fsdp/fsdp.c). */
#include "fsdp/fsdp_impl.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "dist/check.h"

/* ---- the unit plan ---- */

static int64_t tdm_fsdp_align(int64_t n)
{
    return (n + TDM_MODEL_ALIGN_ELEMS - 1) / TDM_MODEL_ALIGN_ELEMS * TDM_MODEL_ALIGN_ELEMS;
}

static int64_t tdm_fsdp_param_end(const tdm_model *m, int last)
{
    return last + 1 < tdm_model_n_params(m) ? tdm_model_param_info(m, last + 1)->offset
                                            : tdm_model_param_elems(m);
}

/* Units are runs of whole blocks (tdm_model_layer_block) with parameters:
 * one per block, or, with min_unit_elems, consecutive blocks grouped
 * until a unit holds that many elements. */
tdm_status tdm_fsdp_plan(tdm_fsdp *f)
{
    tdm_model *m = f->m;
    int nl = tdm_model_n_layers(m), n = f->n_params;
    f->u = calloc((size_t)n, sizeof *f->u);
    f->param_unit = calloc((size_t)n, sizeof *f->param_unit);
    f->pass.ready = calloc((size_t)n, 1);
    if (!f->u || !f->param_unit || !f->pass.ready)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: unit plan for %d parameters", n);
    int nu = 0, block = -1, prev_last = -1;
    for (int l = 0; l < nl; l++) {
        int first, last;
        tdm_model_layer_params(m, l, &first, &last);
        if (first > last) continue;
        TDM_REQUIRE(first == prev_last + 1, TDM_STATUS_INTERNAL,
                    "fsdp: layer %d's parameters start at %d, not after the previous layer's %d",
                    l, first, prev_last);
        prev_last = last;
        int b = tdm_model_layer_block(m, l);
        tdm_fsdp_unit *cur = nu ? &f->u[nu - 1] : NULL;
        int64_t cur_elems = cur ? tdm_fsdp_param_end(m, cur->last) -
                                      tdm_model_param_info(m, cur->first)->offset
                                : 0;
        if (cur && (b == block || cur_elems < f->o.min_unit_elems)) {
            cur->last = last;
        } else {
            f->u[nu++] = (tdm_fsdp_unit){.first = first, .last = last};
        }
        block = b;
    }
    TDM_REQUIRE(prev_last == n - 1, TDM_STATUS_INTERNAL,
                "fsdp: the layers own parameters 0..%d of %d", prev_last, n);
    f->nu = nu;
    int64_t so = 0, fo = 0;
    for (int u = 0; u < nu; u++) {
        tdm_fsdp_unit *x = &f->u[u];
        x->offset = tdm_model_param_info(m, x->first)->offset;
        x->n_elem = tdm_fsdp_param_end(m, x->last) - x->offset;
        x->shard = (x->n_elem + f->world - 1) / f->world;
        x->padded = x->shard * f->world;
        /* shards and full copies start 64-byte aligned, as tensors in the
         * flat buffer do: the same kernels see the same alignment */
        x->shard_off = so;
        x->full_off = fo;
        so = tdm_fsdp_align(so + x->shard);
        fo = tdm_fsdp_align(fo + x->padded);
        if (x->padded > f->max_padded) f->max_padded = x->padded;
        for (int p = x->first; p <= x->last; p++) f->param_unit[p] = u;
        x->ag_event = x->rs_event = -1;
    }
    f->shard_elems = so;
    f->full_elems = fo;
    return TDM_STATUS_OK;
}

/* ---- the layout check across ranks ---- */

/* The values gathered with the model check's counts (dist/check.h). */
enum { TDM_FSDP_SUM_NUNITS, TDM_FSDP_SUM_SHARDING, TDM_FSDP_SUM_PREFETCH, TDM_FSDP_SUM_OVERLAP,
       TDM_FSDP_SUM_HOOK, TDM_FSDP_SUM_JOIN, TDM_FSDP_SUM_N };
#define TDM_FSDP_UNIT_FIELDS 5

/* Rank r's units against rank 0's: the same parameters, offsets and
 * shards each (units <= parameters: n_params slots of every rank). */
static tdm_status tdm_fsdp_verify_units(const int64_t *tab, int per, int nu0, int nur, int r)
{
    for (int u = 0; u < nu0 || u < nur; u++) {
        const int64_t *a = tab + TDM_FSDP_UNIT_FIELDS * u;
        const int64_t *b = tab + (size_t)r * per + TDM_FSDP_UNIT_FIELDS * u;
        if (u < nu0 && u < nur && !memcmp(a, b, TDM_FSDP_UNIT_FIELDS * sizeof *a)) continue;
        if (u >= nu0 || u >= nur)
            return tdm_error_set(TDM_STATUS_MISMATCH,
                                 "fsdp: shard layout differs between ranks: rank 0 has %d "
                                 "unit(s), rank %d has %d (unit %d exists on one only); use "
                                 "the same unit options (min_unit_elems) on every rank", nu0, r,
                                 nur, u);
        return tdm_error_set(TDM_STATUS_MISMATCH,
                             "fsdp: shard layout of unit %d differs between ranks: rank "
                             "0's holds parameters %lld..%lld (%lld elements at offset "
                             "%lld, shards of %lld), rank %d's holds %lld..%lld (%lld at "
                             "%lld, shards of %lld); use the same model and unit options "
                             "on every rank", u, (long long)a[0], (long long)a[1],
                             (long long)a[3], (long long)a[2], (long long)a[4], r,
                             (long long)b[0], (long long)b[1], (long long)b[3],
                             (long long)b[2], (long long)b[4]);
    }
    return TDM_STATUS_OK;
}

/* A rank's options, as the mismatch message says them. */
static void tdm_fsdp_describe_options(const int64_t *v, char *buf, size_t n)
{
    snprintf(buf, n, "sharding %s (prefetch %s, overlap %s, comm hook %s, join %s)",
             tdm_fsdp_sharding_name((tdm_fsdp_sharding)v[TDM_FSDP_SUM_SHARDING]),
             v[TDM_FSDP_SUM_PREFETCH] ? "off" : "on", v[TDM_FSDP_SUM_OVERLAP] ? "off" : "on",
             tdm_fsdp_comm_hook_name((tdm_fsdp_comm_hook)v[TDM_FSDP_SUM_HOOK]),
             v[TDM_FSDP_SUM_JOIN] ? "on" : "off");
}

/* Rank r's options against rank 0's: the collectives must match. */
static tdm_status tdm_fsdp_verify_options(const int64_t *a, const int64_t *b, int r)
{
    if (!memcmp(a + TDM_FSDP_SUM_SHARDING, b + TDM_FSDP_SUM_SHARDING,
                (TDM_FSDP_SUM_N - TDM_FSDP_SUM_SHARDING) * sizeof *a))
        return TDM_STATUS_OK;
    char oa[160], ob[160];
    tdm_fsdp_describe_options(a, oa, sizeof oa);
    tdm_fsdp_describe_options(b, ob, sizeof ob);
    return tdm_error_set(TDM_STATUS_MISMATCH, "fsdp: options differ between ranks: rank 0 runs "
                         "%s, rank %d %s; the collectives would not match", oa, r, ob);
}

tdm_status tdm_fsdp_verify(tdm_fsdp *f)
{
    tdm_status st = TDM_STATUS_OK;
    int W = f->world;
    int64_t mine[TDM_FSDP_SUM_N] = {
        [TDM_FSDP_SUM_NUNITS] = f->nu, [TDM_FSDP_SUM_SHARDING] = f->o.sharding,
        [TDM_FSDP_SUM_PREFETCH] = f->o.no_prefetch, [TDM_FSDP_SUM_OVERLAP] = f->o.no_overlap,
        [TDM_FSDP_SUM_HOOK] = f->o.comm_hook, [TDM_FSDP_SUM_JOIN] = !!f->o.join};
    int64_t *all = NULL, *tab = NULL;
    char label[64];
    snprintf(label, sizeof label, "%s layout check", tdm_fsdp_tag(f));
    TDM_CHECK(tdm_dist_check_model(f->hcomm, f->m, "fsdp", label, mine, TDM_FSDP_SUM_N, &all));
    /* the same tensors everywhere: then the same units */
    int per = TDM_FSDP_UNIT_FIELDS * f->n_params;   /* units <= parameters */
    tab = calloc((size_t)W * (size_t)per, sizeof *tab);
    if (!tab) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "fsdp: unit check of %d ranks", W);
        goto fail;
    }
    for (int u = 0; u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        int64_t *v = tab + (size_t)f->rank * per + TDM_FSDP_UNIT_FIELDS * u;
        v[0] = x->first;
        v[1] = x->last;
        v[2] = x->offset;
        v[3] = x->n_elem;
        v[4] = x->shard;
    }
    tdm_comm_set_label(f->hcomm, "%s (units)", label);
    TDM_TRY(tdm_comm_all_gather(f->hcomm, tab + (size_t)f->rank * per, tab, (size_t)per,
                                TDM_DTYPE_INT64));
    for (int r = 1; r < W; r++) {
        const int64_t *a = all, *b = all + (size_t)r * TDM_FSDP_SUM_N;
        TDM_TRY(tdm_fsdp_verify_units(tab, per, (int)a[TDM_FSDP_SUM_NUNITS],
                                      (int)b[TDM_FSDP_SUM_NUNITS], r));
        TDM_TRY(tdm_fsdp_verify_options(a, b, r));
    }
fail:
    free(all);
    free(tab);
    return st;
}
