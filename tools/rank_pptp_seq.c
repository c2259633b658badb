/* tools/rank_pptp_seq.c: sequence parallelism on a pipeline's
 * tensor-parallel GPT stages (tools/rank_pptp.h): the all-gathers and
 * reduce-scatters along the tokens that models/gpt.c asks for, over the
 * stage's tp group. */
#include "tools/rank_pptp.h"

#include "core/timer.h"

tdm_status tdm_pptp_check_seq(const tdm_model_spec *spec, int S, const int *first, int N)
{
    TDM_REQUIRE(spec->kind == TDM_MODEL_GPT, TDM_STATUS_USAGE,
                "--sequence-parallel on tensor-parallel stages applies to the GPT; --model %s "
                "has no sequence to split", spec->name);
    TDM_REQUIRE(spec->n_ctx % N == 0, TDM_STATUS_USAGE,
                "the GPT's context of %d tokens is not divisible by the %d tensor-parallel ranks "
                "of each stage (--sequence-parallel splits every window's tokens)",
                spec->n_ctx, N);
    /* pipeline layers: 0 the embeddings, 1..L the blocks, L + 1 the head */
    for (int s = 0; s < S; s++) {
        int lo = first[s], hi = s + 1 < S ? first[s + 1] : spec->n_layer + 2;
        int b0 = lo > 1 ? lo : 1, b1 = hi < spec->n_layer + 1 ? hi : spec->n_layer + 1;
        TDM_REQUIRE(b1 > b0, TDM_STATUS_USAGE,
                    "--sequence-parallel: stage %d (pipeline layers %d-%d) holds no "
                    "transformer block (the embeddings or the head alone run on whole "
                    "windows); give every stage a block with --split", s, lo, hi - 1);
    }
    return TDM_STATUS_OK;
}

void tdm_pptp_seq_plan(const tdm_model_spec *spec, int S, const int *first, int s, int rows,
                       int micro_size, int64_t *calls, int64_t *bytes, int64_t *ln_calls,
                       int64_t *ln_bytes)
{
    int L = spec->n_layer, lo = first[s], hi = s + 1 < S ? first[s + 1] : L + 2;
    int b0 = lo > 1 ? lo : 1, b1 = hi < L + 1 ? hi : L + 1, nb = b1 > b0 ? b1 - b0 : 0;
    /* the last stage gathers the stream before ln_f, and its top block's
     * output gradient is whole already (one gather fewer): even */
    int per_mb = 8 * nb - (lo == 0 && nb > 0) + (lo == 0);
    int mbs = rows > 0 && micro_size > 0 ? (rows + micro_size - 1) / micro_size : 0;
    *calls = (int64_t)per_mb * mbs;
    *bytes = (int64_t)per_mb * rows * spec->n_ctx * spec->n_embd * (int64_t)sizeof(float);
    *ln_calls = 2 * (int64_t)nb;
    *ln_bytes = *ln_calls * 2 * spec->n_embd * (int64_t)sizeof(float);
}

tdm_status tdm_pptp_seq(void *ctx, tdm_model_seq_op op, const float *src, float *dst, int64_t n,
                        int layer)
{
    tdm_pptp *q = ctx;
    uint64_t t0 = tdm_time_ns();
    size_t part = (size_t)(n / q->N);
    TDM_CHECK(tdm_dev_sync(q->dev));
    tdm_status st;
    if (op == TDM_MODEL_SEQ_GATHER) {
        tdm_comm_set_label(q->tdev, "pp-tp seq all-gather of the stage's layer %d", layer);
        st = tdm_comm_all_gather(q->tdev, src, dst, part, TDM_DTYPE_FLOAT32);
    } else {
        tdm_comm_set_label(q->tdev, "pp-tp seq reduce-scatter of the stage's layer %d", layer);
        st = tdm_comm_reduce_scatter(q->tdev, src, dst, part, TDM_DTYPE_FLOAT32,
                                     TDM_REDOP_SUM);
    }
    if (st) {
        tdm_error_prefix(st, "tensor-parallel rank %d of the stage: the sequence-parallel %s "
                         "of its layer %d", q->t,
                         op == TDM_MODEL_SEQ_GATHER ? "all-gather" : "reduce-scatter", layer);
        return st;
    }
    q->seq_calls++;
    q->seq_bytes += n * (int64_t)sizeof(float);
    q->seq_ms += tdm_time_ms_since(t0);
    return TDM_STATUS_OK;
}
