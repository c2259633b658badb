/* models/gpt_generate.c: text generation from a whole GPT (models/gpt.h):
 * sampling the next token from the last position's logits, one forward
 * over the last T tokens per new token. Not the model (models/gpt.c). */
#include "models/gpt.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "models/model_impl.h"

tdm_status tdm_gpt_generate(tdm_model *m, const int32_t *prompt, int n_prompt, int n_new,
                            float temperature, uint64_t seed, int32_t *out,
                            void (*emit)(void *ctx, int32_t token), void *emit_ctx)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(m && m->spec.kind == TDM_MODEL_GPT, TDM_STATUS_INVALID_ARG,
                "generate: not a GPT model");
    TDM_REQUIRE(prompt && n_prompt >= 1 && n_new >= 0, TDM_STATUS_INVALID_ARG,
                "generate: the prompt needs at least one token (got %d) and n_new >= 0 (%d)",
                n_prompt, n_new);
    TDM_REQUIRE(temperature >= 0.0f && isfinite(temperature), TDM_STATUS_INVALID_ARG,
                "generate: temperature %g must be finite and >= 0", (double)temperature);
    tdm_device *d = tdm_model_device(m);
    int T = m->spec.n_ctx, V = m->spec.vocab, was_train = m->train;
    int64_t total = (int64_t)n_prompt + n_new;
    int32_t *seq = malloc((size_t)total * sizeof(int32_t));
    float *row = malloc((size_t)V * sizeof(float));
    double *p = malloc((size_t)V * sizeof(double));
    int32_t *dtok = NULL;
    if (!seq || !row || !p) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "generate: out of memory");
        goto fail;
    }
    if (tdm_dev_kind(d) != TDM_DEVICE_HOST)
        TDM_TRY(tdm_dev_alloc(d, (size_t)T * sizeof(int32_t), (void **)&dtok));
    memcpy(seq, prompt, (size_t)n_prompt * sizeof(int32_t));
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_SAMPLE);
    m->train = 0;
    for (int64_t n = n_prompt; n < total; n++) {
        int ctx = n < T ? (int)n : T;
        const int32_t *window = seq + n - ctx;
        const float *logits;
        if (dtok) {
            TDM_TRY(tdm_dev_copy_from_host(d, dtok, window, (size_t)ctx * sizeof(int32_t)));
            window = dtok;
        }
        TDM_TRY(tdm_gpt_forward_seq(m, window, 1, ctx, &logits));
        TDM_TRY(tdm_dev_copy_to_host(d, row, logits + (int64_t)(ctx - 1) * V,
                                     (size_t)V * sizeof(float)));
        int best = 0;
        for (int j = 1; j < V; j++)
            if (row[j] > row[best]) best = j;
        int tok = best;
        if (temperature > 0.0f) {
            /* softmax(z / temperature), shifted by the max, in double */
            double sum = 0.0;
            for (int j = 0; j < V; j++) {
                p[j] = exp(((double)row[j] - row[best]) / temperature);
                sum += p[j];
            }
            double u = (double)(tdm_rng_u64(&r) >> 11) * 0x1.0p-53 * sum, acc = 0.0;
            tok = V - 1;
            for (int j = 0; j < V; j++) {
                acc += p[j];
                if (u < acc) {
                    tok = j;
                    break;
                }
            }
        }
        seq[n] = tok;
        if (out) out[n - n_prompt] = tok;
        if (emit) emit(emit_ctx, tok);
    }
fail:
    m->train = was_train;
    tdm_dev_free(d, dtok);
    free(seq);
    free(row);
    free(p);
    return st;
}
