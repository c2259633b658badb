/* tests/test_model_partial.c: tensor parallelism's partial sums on a
 * model (tdm_model_set_partial_sums): the callback sees a row-parallel
 * layer's product before its bias and activation and a column-parallel
 * layer's input gradient, with their sizes; what it writes is what the
 * layer goes on with; a model without marks runs as before; bad marks
 * are refused; in bf16, fp16 and with activation checkpointing the same
 * sums run (a recomputed row layer's again); a sliced GPT calls it at its
 * four split layers per block. */
#include <criterion/criterion.h>

#include <string.h>

#include "core/device.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "models/stage.h"

#define B 3

typedef struct {
    int calls, layer[8];
    int64_t n[8];
    float scale;                /* the "sum": every element times scale */
} rec;

static tdm_status record(void *ctx, float *buf, int64_t n, int layer)
{
    rec *r = ctx;
    if (r->calls < 8) {
        r->layer[r->calls] = layer;
        r->n[r->calls] = n;
    }
    r->calls++;
    for (int64_t i = 0; i < n; i++) buf[i] *= r->scale;
    return TDM_STATUS_OK;
}

static tdm_model *mlp(tdm_device *dev)
{
    tdm_model *m = NULL;
    int dims[] = {6, 8, 4};
    cr_assert_eq(tdm_mlp_init(&m, dev, dims, 3, 7), TDM_STATUS_OK, "%s", tdm_error_message());
    return m;
}

static const float X[B * 6] = {0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f, 0.7f, 0.8f, -0.9f,
                               1.0f, 0.2f, 0.1f, -0.3f, 0.5f, 0.2f, 0.9f, -0.1f, 0.4f};
static const int32_t Y[B] = {1, 3, 0};

Test(model_partial, the_callback_sees_the_row_product_and_the_column_input_gradient)
{
    tdm_device *dev = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    tdm_model *a = mlp(dev), *b = mlp(dev);
    /* layer 0 row (forward product summed), layer 1 column (input
     * gradient summed); the identity sum: the plain model's numbers */
    tdm_model_partial kinds[2] = {TDM_MODEL_PARTIAL_OUT, TDM_MODEL_PARTIAL_IN};
    rec r = {.scale = 1.0f};
    cr_assert_eq(tdm_model_set_partial_sums(b, kinds, 2, record, &r), TDM_STATUS_OK);
    double la = 0, lb = 0;
    cr_assert_eq(tdm_model_forward_backward(a, X, Y, B, &la), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_forward_backward(b, X, Y, B, &lb), TDM_STATUS_OK);
    cr_assert_eq(r.calls, 2);
    cr_assert(r.layer[0] == 0 && r.n[0] == B * 8, "forward: layer %d, %lld", r.layer[0],
              (long long)r.n[0]);
    cr_assert(r.layer[1] == 1 && r.n[1] == B * 8, "backward: layer %d, %lld", r.layer[1],
              (long long)r.n[1]);
    cr_assert_eq(la, lb);
    int64_t n = tdm_model_param_elems(a);
    cr_assert_eq(memcmp(tdm_model_grads(a), tdm_model_grads(b), (size_t)n * 4), 0);
    /* what the callback writes is what the layer goes on with: twice
     * the product, another loss */
    r = (rec){.scale = 2.0f};
    cr_assert_eq(tdm_model_zero_grad(b), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_forward_backward(b, X, Y, B, &lb), TDM_STATUS_OK);
    cr_assert_neq(la, lb);
    /* cleared: the plain model again */
    cr_assert_eq(tdm_model_set_partial_sums(b, NULL, 0, NULL, NULL), TDM_STATUS_OK);
    r = (rec){.scale = 2.0f};
    cr_assert_eq(tdm_model_forward_backward(b, X, Y, B, &lb), TDM_STATUS_OK);
    cr_assert_eq(r.calls, 0);
    cr_assert_eq(la, lb);
    tdm_model_free(a);
    tdm_model_free(b);
    tdm_device_free(dev);
}

Test(model_partial, bad_marks_are_refused)
{
    tdm_device *dev = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    tdm_model *m = mlp(dev);
    rec r = {.scale = 1.0f};
    tdm_model_partial kinds[2] = {TDM_MODEL_PARTIAL_OUT, TDM_MODEL_PARTIAL_IN};
    cr_assert_eq(tdm_model_set_partial_sums(m, kinds, 1, record, &r), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "1 kinds for a model of 2 layers"), "%s",
                     tdm_error_message());
    tdm_model_free(m);
    tdm_device_free(dev);
}

/* In bf16 and fp16, and with activation checkpointing, the callback sees
 * the same calls (a recomputed row layer's once more), and the identity
 * sum leaves the run of the unmarked model's bits. */
Test(model_partial, sixteen_bit_and_checkpointed_layers_sum_their_partials_too)
{
    static const tdm_precision prec[] = {TDM_PRECISION_BF16, TDM_PRECISION_FP16,
                                         TDM_PRECISION_FP32};
    tdm_device *dev = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    for (int k = 0; k < 3; k++) {
        int ck = prec[k] == TDM_PRECISION_FP32;   /* fp32: checkpointed instead */
        tdm_model *a = mlp(dev), *b = mlp(dev);
        tdm_model_partial kinds[2] = {TDM_MODEL_PARTIAL_OUT, TDM_MODEL_PARTIAL_IN};
        rec r = {.scale = 1.0f};
        cr_assert_eq(tdm_model_set_partial_sums(b, kinds, 2, record, &r), TDM_STATUS_OK);
        for (int j = 0; j < 2; j++) {
            tdm_model *m = j ? b : a;
            cr_assert_eq(tdm_model_set_precision(m, prec[k]), TDM_STATUS_OK, "%s",
                         tdm_error_message());
            cr_assert_eq(tdm_model_set_checkpoint(m, ck), TDM_STATUS_OK, "%s",
                         tdm_error_message());
        }
        double la = 0, lb = 0;
        cr_assert_eq(tdm_model_forward_backward(a, X, Y, B, &la), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        cr_assert_eq(tdm_model_forward_backward(b, X, Y, B, &lb), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        /* the forward's row sum, the column layer's input gradient, and
         * checkpointed the row layer's forward again when backward
         * reaches it */
        cr_assert_eq(r.calls, ck ? 3 : 2, "precision %d: %d calls", (int)prec[k], r.calls);
        cr_assert(r.layer[0] == 0 && r.layer[1] == 1 && (!ck || r.layer[2] == 0), "%d %d %d",
                  r.layer[0], r.layer[1], r.layer[2]);
        cr_assert_eq(la, lb);
        int64_t n = tdm_model_param_elems(a);
        cr_assert_eq(memcmp(tdm_model_grads(a), tdm_model_grads(b), (size_t)n * 4), 0);
        /* what the callback writes is what the layers go on with */
        r = (rec){.scale = 2.0f};
        cr_assert_eq(tdm_model_zero_grad(b), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_forward_backward(b, X, Y, B, &lb), TDM_STATUS_OK);
        cr_assert_neq(la, lb);
        tdm_model_free(a);
        tdm_model_free(b);
    }
    tdm_device_free(dev);
}

/* A GPT of tp_ranks 2 holds one rank's slices (heads 1 of 2: c_attn
 * (3C/2, C)); it runs only with the callback set, which it calls 4 times
 * per block with B*T*C floats: forward after attn.c_proj and mlp.c_proj
 * (logical layers 3 and 6 of block 0), backward with c_fc's and c_attn's
 * input gradients (5 and 2). */
Test(model_partial, a_sliced_gpt_sums_four_partial_products_per_block)
{
    enum { L = 2, C = 8, H = 2, T = 4, NB = 2 };
    tdm_device *dev = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    tdm_model_spec s;
    tdm_model_spec_gpt(&s, L, C, H, T);
    s.tp_ranks = 2;
    tdm_model *m = NULL;
    cr_assert_eq(tdm_model_init(&m, dev, &s, 3), TDM_STATUS_OK, "%s", tdm_error_message());
    const tdm_tensor_info *w = tdm_model_param_info(m, 4);
    cr_assert_str_eq(w->name, "transformer.h.0.attn.c_attn.weight");
    cr_assert(w->shape[0] == 3 * C / 2 && w->shape[1] == C, "%lld x %lld",
              (long long)w->shape[0], (long long)w->shape[1]);
    int32_t tok[NB * T], y[NB * T];
    for (int i = 0; i < NB * T; i++) {
        tok[i] = (i * 37) % 256;
        y[i] = (i * 11 + 5) % 256;
    }
    double l = 0;
    cr_assert_eq(tdm_model_forward_backward(m, tok, y, NB, &l), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "tensor-parallel slice (1/2)"), "%s",
              tdm_error_message());
    rec r = {.scale = 1.0f};
    tdm_model_partial kinds[1] = {TDM_MODEL_PARTIAL_NONE};
    cr_assert_eq(tdm_model_set_partial_sums(m, kinds, 1, record, &r), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_model_set_partial_sums(m, NULL, 0, record, &r), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_forward_backward(m, tok, y, NB, &l), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    static const int want[8] = {3, 6, 9, 12, 11, 8, 5, 2};
    cr_assert_eq(r.calls, 8);
    for (int i = 0; i < 8; i++)
        cr_assert(r.layer[i] == want[i] && r.n[i] == NB * T * C, "call %d: layer %d, %lld", i,
                  r.layer[i], (long long)r.n[i]);
    tdm_model_free(m);
    tdm_device_free(dev);
}

/* Sequence parallelism's collectives faked on one rank (tp rank 0 of
 * 2): a gather copies the rank's part into every part, a reduce-scatter
 * keeps the rank's part. The numbers mean nothing; the calls and the
 * memory are what is checked. */
typedef struct {
    int gathers, scatters;
} seq_rec;

static tdm_status fake_seq(void *ctx, tdm_model_seq_op op, const float *src, float *dst,
                           int64_t n, int layer)
{
    seq_rec *r = ctx;
    (void)layer;
    if (op == TDM_MODEL_SEQ_GATHER) {
        r->gathers++;
        for (int k = 0; k < 2; k++) memmove(dst + k * (n / 2), src, (size_t)(n / 2) * 4);
    } else {
        r->scatters++;
        memmove(dst, src, (size_t)(n / 2) * 4);
    }
    return TDM_STATUS_OK;
}

/* The whole GPT of 2 blocks as one sequence-parallel slice (tp 2): per
 * block 4 gathers (ln_1's output but block 0's, which reads the whole
 * embeddings; ln_2's; the stream's gradient twice, but once in the top
 * block, whose output gradient is whole) and 4 reduce-scatters, 1 gather
 * for ln_f and 1 for the embeddings' gradient, 2 LayerNorm gradient sums
 * a block; and the activation set drops by exactly the
 * rows it no longer keeps: per block res1 (N - N/2 rows of C), ln_2's
 * statistics (2 of N - N/2), res2 but the top block's (gathered whole for
 * ln_f), ln_1's statistics but block 0's (whole). */
Test(model_partial, a_sequence_parallel_gpt_slice_keeps_its_rows_only)
{
    enum { L = 2, C = 16, H = 2, T = 32, NB = 2, N = NB * T, NL = N / 2 };
    tdm_device *dev = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    int32_t tok[NB * T], y[NB * T];
    for (int i = 0; i < NB * T; i++) {
        tok[i] = (i * 37) % 256;
        y[i] = (i * 11 + 5) % 256;
    }
    size_t set[2];
    for (int sp = 0; sp < 2; sp++) {
        tdm_model_spec s;
        tdm_model_spec_gpt(&s, L, C, H, T);
        s.tp_ranks = 2;
        s.tp_seq = sp;
        tdm_model *m = NULL;
        cr_assert_eq(tdm_model_init(&m, dev, &s, 3), TDM_STATUS_OK, "%s", tdm_error_message());
        rec r = {.scale = 1.0f};
        seq_rec q = {0};
        cr_assert_eq(tdm_model_set_partial_sums(m, NULL, 0, record, &r), TDM_STATUS_OK);
        tdm_model_set_partial_rank(m, 0);
        double l = 0;
        if (sp) {
            cr_assert_eq(tdm_model_forward_backward(m, tok, y, NB, &l), TDM_STATUS_INVALID_ARG);
            cr_assert(strstr(tdm_error_message(), "with its collectives set"), "%s",
                      tdm_error_message());
            tdm_model_set_seq_parallel(m, fake_seq, &q);
        }
        cr_assert_eq(tdm_model_forward_backward(m, tok, y, NB, &l), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        cr_assert_eq(tdm_model_seq_sum_grads(m), TDM_STATUS_OK);
        if (sp) {
            cr_assert(q.gathers == 4 * L - 2 + 2 && q.scatters == 4 * L, "%d gathers, %d "
                      "reduce-scatters", q.gathers, q.scatters);
            cr_assert_eq(r.calls, 2 * L, "the LayerNorms' sums only: %d", r.calls);
        } else {
            cr_assert_eq(q.gathers + q.scatters, 0);
            cr_assert_eq(r.calls, 4 * L);
        }
        set[sp] = tdm_model_act_set_bytes(m);
        tdm_model_free(m);
    }
    size_t drop = (size_t)(N - NL) * 4 * (L * C + L * 2 + (L - 1) * C + (L - 1) * 2);
    cr_assert_eq(set[0] - set[1], drop, "set %zu without, %zu with: %zu less, predicted %zu",
                 set[0], set[1], set[0] - set[1], drop);
    tdm_device_free(dev);
}
