/* tools/rank_pptp.c: a pipeline's stages made tensor-parallel
 * (tools/rank_pptp.h). */
#include "tools/rank_pptp.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"
#include "models/stage.h"
#include "tools/rank_mesh.h"

tdm_status tdm_pptp_plan(const tdm_model_spec *spec, int S, const int *first, int N,
                         tdm_pptp_cut *cut, tdm_model_spec *narrow)
{
    *narrow = *spec;
    if (spec->kind == TDM_MODEL_GPT) {
        /* every stage's blocks split by heads and c_fc's rows; the
         * embeddings, LayerNorms and the tied head replicated */
        TDM_REQUIRE(spec->n_head % N == 0, TDM_STATUS_USAGE,
                    "the GPT's %d heads are not divisible by the %d tensor-parallel ranks of "
                    "each stage (attention is split by heads)", spec->n_head, N);
        memset(cut, 0, TDM_PPTP_MAX_LAYERS * sizeof *cut);
        narrow->tp_ranks = N;
        return TDM_STATUS_OK;
    }
    if (spec->kind == TDM_MODEL_SEQ) {
        tdm_model_partial kinds[TDM_PPTP_MAX_LAYERS];
        int n = 0;
        TDM_CHECK(tdm_model_spec_n_layers(spec, &n));
        TDM_REQUIRE(n <= TDM_PPTP_MAX_LAYERS, TDM_STATUS_USAGE,
                    "%s: %d pipeline layers, at most %d in tensor-parallel stages", spec->name,
                    n, TDM_PPTP_MAX_LAYERS);
        TDM_CHECK(tdm_model_spec_tp_stages(spec, first, S, N, kinds, n, narrow));
        for (int l = 0; l < n; l++)
            cut[l] = kinds[l] == TDM_MODEL_PARTIAL_IN    ? TDM_PPTP_COLUMN
                     : kinds[l] == TDM_MODEL_PARTIAL_OUT ? TDM_PPTP_ROW
                                                         : TDM_PPTP_REPLICATED;
        return TDM_STATUS_OK;
    }
    TDM_REQUIRE(spec->kind == TDM_MODEL_MLP, TDM_STATUS_USAGE,
                "--mesh with pp=%d and tp=%d: a pipeline of tensor-parallel stages is built for "
                "the MLP, the GPT and model files (the CNN's is not)", S, N);
    int L = spec->ndims - 1;
    for (int s = 0; s < S; s++) {
        int lo = first[s], hi = s + 1 < S ? first[s + 1] : L;
        for (int l = lo; l < hi; l += 2) {
            if (l + 1 >= hi) {
                cut[l] = TDM_PPTP_REPLICATED;   /* an odd last layer of the stage */
                break;
            }
            int w = spec->dims[l + 1];
            TDM_REQUIRE(w % N == 0, TDM_STATUS_USAGE,
                        "stage %d: layer fc%d's output width %d (fc%d's input) is not divisible "
                        "by the %d tensor-parallel ranks", s, l + 1, w, l + 2, N);
            cut[l] = TDM_PPTP_COLUMN;
            cut[l + 1] = TDM_PPTP_ROW;
            narrow->dims[l + 1] = w / N;
        }
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_pptp_step_plan(const tdm_model_spec *spec, int S, const int *first, int N, int s,
                              int rows, int micro_size, int64_t *calls, int64_t *bytes)
{
    tdm_pptp_cut cut[TDM_PPTP_MAX_LAYERS];
    tdm_model_spec narrow;
    *calls = *bytes = 0;
    if (N < 2) return TDM_STATUS_OK;
    TDM_CHECK(tdm_pptp_plan(spec, S, first, N, cut, &narrow));
    int n = 0;
    TDM_CHECK(tdm_model_spec_n_layers(spec, &n));
    int lo = first[s], hi = s + 1 < S ? first[s + 1] : n;
    int64_t per_sample = 0, per_mb = 0;
    /* pipeline layers of the GPT: 0 the embeddings, 1..L the blocks,
     * L + 1 the head */
    for (int l = lo; spec->kind == TDM_MODEL_GPT && l < hi; l++) {
        if (l < 1 || l > spec->n_layer) continue;
        per_mb += 4;
        per_sample += 4 * (int64_t)spec->n_ctx * spec->n_embd;
    }
    tdm_model *t = NULL;
    if (spec->kind != TDM_MODEL_GPT) TDM_CHECK(tdm_model_init_tables(&t, spec));
    /* the MLP's and a model file's: each split linear layer's weight
     * (out, in) */
    for (int i = 0; t && i < tdm_model_n_params(t); i++) {
        const tdm_tensor_info *w = tdm_model_param_info(t, i);
        int l = w->layer;
        if (w->ndim != 2 || l < lo || l >= hi) continue;
        if (cut[l] == TDM_PPTP_ROW) per_sample += w->shape[0];
        if (cut[l] == TDM_PPTP_COLUMN && l > 0) per_sample += w->shape[1];
        per_mb += cut[l] == TDM_PPTP_ROW || (cut[l] == TDM_PPTP_COLUMN && l > 0);
    }
    tdm_model_free(t);
    int mbs = rows > 0 && micro_size > 0 ? (rows + micro_size - 1) / micro_size : 0;
    *calls = per_mb * mbs;
    *bytes = per_sample * rows * (int64_t)sizeof(float);
    return TDM_STATUS_OK;
}

tdm_status tdm_pptp_init(tdm_pptp *q, const tdm_model_spec *spec, int S, const int *first,
                         int N, int t, tdm_comm *tdev, tdm_comm *thost, tdm_device *dev)
{
    memset(q, 0, sizeof *q);
    *q = (tdm_pptp){.N = N, .t = t, .tdev = tdev, .thost = thost, .dev = dev};
    TDM_CHECK(tdm_pptp_plan(spec, S, first, N, q->cut, &q->narrow));
    TDM_CHECK(tdm_model_init_tables(&q->whole, spec));
    return tdm_model_init_tables(&q->slim, &q->narrow);
}

void tdm_pptp_fini(tdm_pptp *q)
{
    tdm_model_free(q->whole);
    tdm_model_free(q->slim);
    q->whole = q->slim = NULL;
}

/* models/'s partial-sum callback: buf summed over the stage's group. */
static tdm_status tdm_pptp_sum(void *ctx, float *buf, int64_t n, int layer)
{
    tdm_pptp *q = ctx;
    uint64_t t0 = tdm_time_ns();
    TDM_CHECK(tdm_dev_sync(q->dev));
    tdm_comm_set_label(q->tdev, "pp-tp all-reduce of the stage's layer %d", layer);
    tdm_status st = tdm_comm_all_reduce(q->tdev, buf, buf, (size_t)n, TDM_DTYPE_FLOAT32,
                                        TDM_REDOP_SUM);
    if (st) {
        tdm_error_prefix(st, "tensor-parallel rank %d of the stage: the all-reduce of its "
                         "layer %d", q->t, layer);
        return st;
    }
    q->sums++;
    q->sum_bytes += n * (int64_t)sizeof(float);
    q->sum_ms += tdm_time_ms_since(t0);
    return TDM_STATUS_OK;
}

/* Tensor i's part of rank t: whole layout wi, narrow layout ni. The
 * narrow shape says the cut: fewer columns, a row-parallel weight;
 * fewer rows, a column-parallel weight or bias (the GPT's c_attn in its
 * q, k and v thirds: its heads' rows of each); the same, replicated. */
static void tdm_pptp_move_tensor(const tdm_tensor_info *wi, const tdm_tensor_info *ni, int t,
                                 float *whole, float *narrow, int out)
{
    float *w = whole + wi->offset, *n = narrow + ni->offset;
    size_t f = sizeof *w;
    if (wi->ndim == 2 && ni->shape[1] < wi->shape[1]) {
        /* the weight's columns [t*k, (t+1)*k) of every row */
        int64_t rows = wi->shape[0], in = wi->shape[1], k = ni->shape[1];
        for (int64_t o = 0; o < rows; o++) {
            float *a = w + o * in + (int64_t)t * k, *b = n + o * k;
            if (out) memcpy(a, b, (size_t)k * f);
            else memcpy(b, a, (size_t)k * f);
        }
        return;
    }
    int parts = 1;
    if (ni->shape[0] < wi->shape[0] && strstr(wi->name, "attn.c_attn.")) parts = 3;
    /* rows [t*r, (t+1)*r) of each part (contiguous: the row length is
     * the whole one's); the rest whole (one part of all its rows) */
    int64_t whole_part = wi->n_elem / parts, r = ni->n_elem / parts;
    int64_t at = ni->n_elem < wi->n_elem ? (int64_t)t * r : 0;
    for (int k = 0; k < parts; k++) {
        float *a = w + k * whole_part + at, *b = n + k * r;
        if (out) memcpy(a, b, (size_t)r * f);
        else memcpy(b, a, (size_t)r * f);
    }
}

static void tdm_pptp_move(const tdm_pptp *q, int t, int i, float *whole, float *narrow, int out)
{
    tdm_pptp_move_tensor(tdm_model_param_info(q->whole, i), tdm_model_param_info(q->slim, i), t,
                         whole, narrow, out);
}

void tdm_pptp_slice(const tdm_pptp *q, int t, const float *whole, float *narrow)
{
    for (int i = 0; i < tdm_model_n_params(q->whole); i++)
        tdm_pptp_move(q, t, i, (float *)whole, narrow, 0);
}

void tdm_pptp_unslice(const tdm_pptp *q, int t, const float *narrow, float *whole)
{
    for (int i = 0; i < tdm_model_n_params(q->whole); i++)
        tdm_pptp_move(q, t, i, whole, (float *)narrow, 1);
}

tdm_status tdm_pptp_load(tdm_pptp *q, tdm_pp *p, const tdm_ckpt_host *h)
{
    tdm_ckpt_host n;
    TDM_CHECK(tdm_tool_ckpt_host(q->slim, h->optim ? tdm_pp_optim(p) : NULL, &n));
    tdm_pptp_slice(q, q->t, h->params, n.params);
    for (int i = 0; h->optim && i < 2 && n.state[i]; i++)
        tdm_pptp_slice(q, q->t, h->state[i], n.state[i]);
    if (h->optim) n.optim = h->optim;
    n.steps = h->steps;
    tdm_status st = tdm_pp_load_state(p, &n);
    tdm_ckpt_host_free(&n);
    return st;
}

/* The stage's partial sums: the MLP's layers marked by the plan's cut;
 * the sliced GPT's spec says its own. */
static tdm_status tdm_pptp_mark(tdm_pptp *q, tdm_model *m)
{
    if (q->narrow.kind == TDM_MODEL_GPT) {
        TDM_CHECK(tdm_model_set_partial_sums(m, NULL, 0, tdm_pptp_sum, q));
        tdm_model_set_partial_rank(m, q->t);
        if (q->narrow.tp_seq) tdm_model_set_seq_parallel(m, tdm_pptp_seq, q);
        return TDM_STATUS_OK;
    }
    tdm_model_stage_info si;
    tdm_model_get_stage(m, &si);
    tdm_model_partial kinds[TDM_PPTP_MAX_LAYERS];
    int n = tdm_model_n_layers(m);
    TDM_REQUIRE(n == si.hi - si.lo && n <= TDM_PPTP_MAX_LAYERS, TDM_STATUS_INTERNAL,
                "tensor-parallel stage: %d layers for pipeline layers %d-%d", n, si.lo, si.hi - 1);
    for (int i = 0; i < n; i++)
        kinds[i] = q->cut[si.lo + i] == TDM_PPTP_COLUMN ? TDM_MODEL_PARTIAL_IN
                   : q->cut[si.lo + i] == TDM_PPTP_ROW  ? TDM_MODEL_PARTIAL_OUT
                                                         : TDM_MODEL_PARTIAL_NONE;
    TDM_CHECK(tdm_model_set_partial_sums(m, kinds, n, tdm_pptp_sum, q));
    tdm_model_set_partial_rank(m, q->t);
    return TDM_STATUS_OK;
}

tdm_status tdm_pptp_attach(tdm_pptp *q, tdm_pp *p, uint64_t seed)
{
    tdm_model *m = tdm_pp_model(p);
    TDM_CHECK(tdm_pptp_mark(q, m));
    /* this rank's slices of the initial parameters of its stage's layers
     * of the whole model (tdm_model_init_stage: the whole model's values
     * at the seed), so that the run starts where one device starts; only
     * the stage is built, not the whole model it slices nothing else of */
    tdm_model_stage_info si;
    tdm_model_get_stage(m, &si);
    tdm_device *host = NULL;
    tdm_model *whole = NULL;
    int64_t n = tdm_model_param_elems(m);
    float *narrow = malloc((size_t)(n > 0 ? n : 1) * sizeof *narrow);
    tdm_status st = narrow ? TDM_STATUS_OK
                           : tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp-tp: %lld parameters",
                                           (long long)n);
    if (!st) st = tdm_device_open(&host, "cpu", 0, 1);
    if (!st)
        st = tdm_model_init_stage(&whole, host, tdm_model_get_spec(q->whole), seed, si.lo, si.hi);
    if (!st && tdm_model_n_params(whole) != tdm_model_n_params(m))
        st = tdm_error_set(TDM_STATUS_INTERNAL, "pp-tp: the stage holds %d tensors, its whole "
                           "layers %d", tdm_model_n_params(m), tdm_model_n_params(whole));
    for (int i = 0; !st && i < tdm_model_n_params(m); i++) {
        const tdm_tensor_info *wi = tdm_model_param_info(whole, i);
        const tdm_tensor_info *ni = tdm_model_param_info(m, i);
        if (strcmp(wi->name, ni->name))
            st = tdm_error_set(TDM_STATUS_INTERNAL, "pp-tp: the stage's tensor %d is %s, its "
                               "whole layers' %s", i, ni->name, wi->name);
        else
            tdm_pptp_move_tensor(wi, ni, q->t, tdm_model_params(whole), narrow, 0);
    }
    if (!st)
        st = tdm_dev_copy_from_host(tdm_model_device(m), tdm_model_params(m), narrow,
                                    (size_t)n * sizeof *narrow);
    if (!st) st = tdm_dev_sync(tdm_model_device(m));
    tdm_dev_mem_stats ms;
    if (!st && tdm_dev_mem_query(host, &ms) == TDM_STATUS_OK)
        q->setup_host_bytes = ms.peak_bytes + (size_t)n * sizeof *narrow;
    free(narrow);
    tdm_model_free(whole);
    tdm_device_free(host);
    return st;
}

/* Stage 0's group: each rank's narrow arrays all-gathered, rank 0 puts
 * every rank's part into the whole layout. */
static tdm_status tdm_pptp_gather_tp(tdm_pptp *q, const float *narrow, float *all, float *whole,
                                     const char *what)
{
    int64_t n = tdm_model_param_elems(q->slim);
    tdm_comm_set_label(q->thost, "pp-tp gather of the %s", what);
    TDM_CHECK(tdm_comm_all_gather(q->thost, narrow, all, (size_t)n, TDM_DTYPE_FLOAT32));
    for (int t = 0; whole && t < q->N; t++) tdm_pptp_unslice(q, t, all + t * n, whole);
    return TDM_STATUS_OK;
}

/* TANDEM_TEST_PPTP_GATHER_FAIL=R: a test hook, read only by
 * tests/test_pp_tp_fail.c: rank R's gather fails before it sends
 * anything, as an allocation failing there would. A value that is not a
 * whole job rank fails every rank's gather saying so (atoi read "1x" as
 * rank 1 and "x" as rank 0). */
static tdm_status tdm_pptp_planted(const tdm_pptp *q, int first)
{
    const char *e = getenv("TANDEM_TEST_PPTP_GATHER_FAIL");
    if (!e) return TDM_STATUS_OK;
    char *end = NULL;
    errno = 0;
    long r = strtol(e, &end, 10);
    if (end == e || *end || errno || r < 0 || r > INT_MAX)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "TANDEM_TEST_PPTP_GATHER_FAIL='%s': "
                             "expected a job rank (a whole number from 0)", e);
    int rank = tdm_comm_job_rank(q->thost, q->t);
    if (r != rank) return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rank %d (%s tp rank %d): test hook: the "
                         "pp-tp gather fails", rank, first ? "stage 0's" : "a later stage's",
                         q->t);
}

tdm_status tdm_pptp_gather(tdm_pptp *q, tdm_pp *p, const tdm_optim *opt, tdm_ckpt_host *h,
                           int root)
{
    int first = tdm_pp_stage(p) == 0;
    tdm_ckpt_host n;
    memset(&n, 0, sizeof n);
    float *all = NULL;
    int64_t ne = tdm_model_param_elems(q->slim);
    tdm_status st = tdm_pptp_planted(q, first);
    if (!st && first) st = tdm_tool_ckpt_host(q->slim, opt, &n);
    if (!st && first) {
        all = malloc((size_t)(ne > 0 ? ne : 1) * (size_t)q->N * sizeof *all);
        if (!all)
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp-tp gather: %lld floats",
                               (long long)(ne * q->N));
    }
    if (st) {
        /* the other stages are about to send theirs here */
        tdm_comm_abort(q->phost, tdm_error_message());
        goto done;
    }
    /* each tp index's pipeline onto its stage 0, in the narrow layout */
    if ((st = tdm_pp_gather_state(p, first ? &n : NULL, 0))) goto done;
    if (!first) goto done;
    if ((st = tdm_pptp_gather_tp(q, n.params, all, root ? h->params : NULL, "parameters")))
        goto fail;
    for (int i = 0; opt && i < tdm_optim_n_state(opt); i++)
        if ((st = tdm_pptp_gather_tp(q, n.state[i], all, root ? h->state[i] : NULL,
                                     tdm_optim_state_name(opt, i))))
            goto fail;
    if (root) h->steps = n.steps;
    goto done;
fail:
    tdm_comm_abort(q->thost, tdm_error_message());
done:
    free(all);
    tdm_ckpt_host_free(&n);
    return st;
}
