/* pp/split.c: which layers each pipeline stage holds: checking and
 * parsing an explicit split (the first layer of each stage), and the
 * balanced default (the contiguous cut whose costliest stage costs least:
 * linear partitioning by dynamic programming over the layers' costs,
 * tdm_model_spec_layer_costs). Not the stages themselves (pp/pp.c). */
#include "pp/pp.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *tdm_pp_split_str(const int *first, int stages, char *buf, size_t n)
{
    size_t o = 0;
    if (n) buf[0] = '\0';
    for (int s = 0; s < stages && o + 1 < n; s++) {
        int w = snprintf(buf + o, n - o, "%s%d", s ? "," : "", first[s]);
        if (w < 0) break;
        o += (size_t)w < n - o ? (size_t)w : n - o - 1;
    }
    return buf;
}

tdm_status tdm_pp_split_check(const int *first, int stages, int n_layers)
{
    TDM_REQUIRE(stages >= 1, TDM_STATUS_INVALID_ARG, "pipeline: %d stages (expected >= 1)",
                stages);
    TDM_REQUIRE(stages <= n_layers, TDM_STATUS_INVALID_ARG,
                "pipeline: more stages (%d) than layers (%d): each stage needs at least one "
                "layer", stages, n_layers);
    char text[256];
    tdm_pp_split_str(first, stages, text, sizeof text);
    TDM_REQUIRE(first[0] == 0, TDM_STATUS_INVALID_ARG,
                "split %s: stage 0 must start at layer 0 (each number is the first layer of a "
                "stage)", text);
    for (int s = 1; s < stages; s++) {
        TDM_REQUIRE(first[s] >= 0 && first[s] < n_layers, TDM_STATUS_INVALID_ARG,
                    "split %s: stage %d starts at layer %d, out of range (the model has %d "
                    "layers, 0..%d)", text, s, first[s], n_layers, n_layers - 1);
        TDM_REQUIRE(first[s] > first[s - 1], TDM_STATUS_INVALID_ARG,
                    "split %s: stage %d starts at layer %d, not after stage %d's first layer %d "
                    "(the first layers must increase)", text, s, first[s], s - 1, first[s - 1]);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_split_parse(const char *text, int stages, int n_layers, int *first)
{
    const char *p = text ? text : "";
    int n = 0;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        TDM_REQUIRE(end != p && v >= -1000000 && v <= 1000000, TDM_STATUS_INVALID_ARG,
                    "split '%s': expected the first layer of each stage, e.g. 0,3,5", text);
        TDM_REQUIRE(n < stages, TDM_STATUS_INVALID_ARG,
                    "split '%s' names more than the pipeline's %d stages", text, stages);
        first[n++] = (int)v;
        p = end;
        if (*p == ',' && p[1]) p++;
        else TDM_REQUIRE(!*p, TDM_STATUS_INVALID_ARG,
                         "split '%s': unexpected '%c' (layers are separated by ',')", text, *p);
    }
    TDM_REQUIRE(n == stages, TDM_STATUS_INVALID_ARG,
                "split '%s' names %d stage(s), but the pipeline has %d", text ? text : "", n,
                stages);
    return tdm_pp_split_check(first, stages, n_layers);
}

tdm_status tdm_pp_split_balance(const tdm_model_spec *spec, int stages, tdm_pp_balance b,
                                int *first)
{
    int n = 0;
    TDM_CHECK(tdm_model_spec_n_layers(spec, &n));
    TDM_REQUIRE(stages >= 1 && stages <= n, TDM_STATUS_INVALID_ARG,
                "pipeline: more stages (%d) than layers (%d): each stage needs at least one "
                "layer", stages, n);
    tdm_status st = TDM_STATUS_OK;
    tdm_model_layer_cost *c = calloc((size_t)n, sizeof *c);
    double *pre = calloc((size_t)n + 1, sizeof *pre);
    /* best[k][j]: the least largest cost of cutting layers [0, j) into k
     * stages; from[k][j]: where the k-th stage starts in that cut */
    double *best = malloc((size_t)(stages + 1) * (size_t)(n + 1) * sizeof *best);
    int *from = malloc((size_t)(stages + 1) * (size_t)(n + 1) * sizeof *from);
    if (!c || !pre || !best || !from) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pipeline: split of %d layers", n);
        goto done;
    }
    TDM_TRY(tdm_model_spec_layer_costs(spec, c, n));
    for (int i = 0; i < n; i++)
        pre[i + 1] = pre[i] + (b == TDM_PP_BALANCE_PARAMS ? (double)c[i].param_elems : c[i].flops);
#define BEST(k, j) best[(size_t)(k) * (size_t)(n + 1) + (size_t)(j)]
#define FROM(k, j) from[(size_t)(k) * (size_t)(n + 1) + (size_t)(j)]
    for (int k = 0; k <= stages; k++)
        for (int j = 0; j <= n; j++) BEST(k, j) = DBL_MAX;
    BEST(0, 0) = 0.0;
    for (int k = 1; k <= stages; k++)
        for (int j = k; j <= n; j++)
            for (int i = k - 1; i < j; i++) {
                if (BEST(k - 1, i) == DBL_MAX || (i > 0 && c[i].no_cut)) continue;
                double cost = pre[j] - pre[i];
                double worst = cost > BEST(k - 1, i) ? cost : BEST(k - 1, i);
                /* strictly better only: ties keep the earliest cut */
                if (worst < BEST(k, j)) {
                    BEST(k, j) = worst;
                    FROM(k, j) = i;
                }
            }
    if (BEST(stages, n) == DBL_MAX) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG,
                           "pipeline: %d stages cannot be cut between the model's residual "
                           "blocks (a block stays within one stage): use fewer stages", stages);
        goto done;
    }
    for (int k = stages, j = n; k >= 1; k--) {
        first[k - 1] = FROM(k, j);
        j = FROM(k, j);
    }
#undef BEST
#undef FROM
    st = tdm_pp_split_check(first, stages, n);
done:
fail:
    free(c);
    free(pre);
    free(best);
    free(from);
    return st;
}
