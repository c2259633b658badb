/* dist/check.c: the cross-rank checks of dist/check.h. */
#include "dist/check.h"

#include <stdlib.h>
#include <string.h>

uint64_t tdm_dist_hash(const void *p, size_t n, uint64_t h)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

uint64_t tdm_dist_tensor_hash(const tdm_tensor_info *t)
{
    uint64_t h = tdm_dist_hash(t->name, strlen(t->name), TDM_DIST_HASH_SEED);
    h = tdm_dist_hash(&t->ndim, sizeof t->ndim, h);
    h = tdm_dist_hash(t->shape, sizeof t->shape[0] * (size_t)t->ndim, h);
    h = tdm_dist_hash(&t->offset, sizeof t->offset, h);
    return h;
}

/* The counts gathered first, before the design's extra values. */
enum { TDM_DIST_CNT_NPARAMS, TDM_DIST_CNT_PELEMS, TDM_DIST_CNT_NBUF, TDM_DIST_CNT_BELEMS,
       TDM_DIST_CNT_N };

static const tdm_tensor_info *tdm_dist_tensor(const tdm_model *m, int i)
{
    int np = tdm_model_n_params(m);
    return i < np ? tdm_model_param_info(m, i) : tdm_model_buffer_info(m, i - np);
}

/* Rank k's counts against rank 0's. */
static tdm_status tdm_dist_check_counts(const char *who, const int64_t *a, const int64_t *b,
                                        int k)
{
    /* equal counts: the per-tensor comparison names the tensor */
    if (a[TDM_DIST_CNT_NPARAMS] == b[TDM_DIST_CNT_NPARAMS] &&
        a[TDM_DIST_CNT_NBUF] == b[TDM_DIST_CNT_NBUF])
        return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_MISMATCH,
                         "%s: model layout differs between ranks: rank 0 has %lld parameter "
                         "tensors (%lld elements) and %lld buffers (%lld elements), rank %d has "
                         "%lld (%lld) and %lld (%lld); every rank must build the same model",
                         who, (long long)a[0], (long long)a[1], (long long)a[2], (long long)a[3],
                         k, (long long)b[0], (long long)b[1], (long long)b[2], (long long)b[3]);
}

tdm_status tdm_dist_check_model(tdm_comm *comm, const tdm_model *m, const char *who,
                                const char *label, const int64_t *extra, int n_extra,
                                int64_t **all_extra)
{
    tdm_status st = TDM_STATUS_OK;
    int W = tdm_comm_size(comm), rank = tdm_comm_rank(comm);
    int np = tdm_model_n_params(m), nt = np + tdm_model_n_buffers(m);
    int per = TDM_DIST_CNT_N + n_extra;
    int64_t *all = calloc((size_t)W * (size_t)per, sizeof *all), *tens = NULL;
    if (all_extra) *all_extra = NULL;
    TDM_REQUIRE(all, TDM_STATUS_OUT_OF_MEMORY, "%s: model check of %d ranks", who, W);
    int64_t *own = all + (size_t)rank * per;
    own[TDM_DIST_CNT_NPARAMS] = np;
    own[TDM_DIST_CNT_PELEMS] = tdm_model_param_elems(m);
    own[TDM_DIST_CNT_NBUF] = tdm_model_n_buffers(m);
    own[TDM_DIST_CNT_BELEMS] = tdm_model_buffer_elems(m);
    if (n_extra > 0) memcpy(own + TDM_DIST_CNT_N, extra, (size_t)n_extra * sizeof *extra);
    tdm_comm_set_label(comm, "%s (counts)", label);
    TDM_TRY(tdm_comm_all_gather(comm, own, all, (size_t)per, TDM_DTYPE_INT64));
    for (int k = 1; k < W; k++) TDM_TRY(tdm_dist_check_counts(who, all, all + (size_t)k * per, k));
    /* Same counts everywhere: compare per tensor (hash, n_elem). */
    tens = calloc((size_t)W * (size_t)nt * 2, sizeof *tens);
    if (!tens) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: model check of %d tensors", who, nt);
        goto fail;
    }
    own = tens + (size_t)rank * nt * 2;
    for (int i = 0; i < nt; i++) {
        const tdm_tensor_info *t = tdm_dist_tensor(m, i);
        own[2 * i] = (int64_t)tdm_dist_tensor_hash(t);
        own[2 * i + 1] = t->n_elem;
    }
    tdm_comm_set_label(comm, "%s (tensors)", label);
    TDM_TRY(tdm_comm_all_gather(comm, own, tens, (size_t)nt * 2, TDM_DTYPE_INT64));
    for (int k = 1; k < W; k++) {
        for (int i = 0; i < nt; i++) {
            const int64_t *a = tens + 2 * i, *b = tens + ((size_t)k * nt + i) * 2;
            if (a[0] == b[0] && a[1] == b[1]) continue;
            int is_p = i < np;
            st = tdm_error_set(TDM_STATUS_MISMATCH,
                               "%s: %s %d differs between ranks: rank 0's has %lld elements, "
                               "rank %d's has %lld (name, shape or offset differ; here, on rank "
                               "%d, it is '%s'); every rank must build the same model",
                               who, is_p ? "parameter" : "buffer", is_p ? i : i - np,
                               (long long)a[1], k, (long long)b[1], rank,
                               tdm_dist_tensor(m, i)->name);
            goto fail;
        }
    }
    if (all_extra && n_extra > 0) {
        /* every rank's extra values, packed */
        for (int k = 0; k < W; k++)
            memmove(all + (size_t)k * n_extra, all + (size_t)k * per + TDM_DIST_CNT_N,
                    (size_t)n_extra * sizeof *all);
        *all_extra = all;
        all = NULL;
    }
fail:
    free(all);
    free(tens);
    return st;
}

tdm_status tdm_dist_check_seq(const char *who, const double *seq, int world, int rank,
                              double mine)
{
    for (int k = 0; k < world; k++) {
        if (seq[k] == mine) continue;
        return tdm_error_set(TDM_STATUS_MISMATCH,
                             "%s: collective sequence mismatch: rank %d reduced the gradients "
                             "of its training forward #%.0f together with rank %d's forward "
                             "#%.0f (a rank skipped a backward or ran a different number of "
                             "steps)", who, k, seq[k], rank, mine);
    }
    return TDM_STATUS_OK;
}
