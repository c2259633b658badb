/* tests/test_builder_gpt.c: the GPT written as layers (models/builder_gpt.c):
 * a model file of tokens and the same calls in C give the built-in GPT's
 * spec with every shape inferred line by line; the model trains bitwise
 * as `--model gpt:L-D-H-T` (same tensor names, shapes, initial values,
 * losses and values after AdamW steps); examples/models/gpt.tdm is the
 * default GPT; an untied head (`lmhead`) has a weight of its own; every
 * layer that does not fit, and every line out of the
 * GPT's arrangement, is refused in one line naming the line. Gradients
 * against finite differences of a double reference: tests/test_gpt.c
 * (which runs a file-built GPT too). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "models/builder.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/stage.h"
#include "models/train.h"
#include "tests/test_util.h"

/* gpt:2-12-3-7 as a model file */
static const char g_small[] = "input tokens 7\n"
                              "embedding vocab 256 dim 12   # -> 7x12\n"
                              "embedding positions\n"
                              "residual {\n  layernorm\n  attention heads 3\n}\n"
                              "residual {\n  layernorm\n  gptmlp\n}\n"
                              "residual {\n  layernorm\n  attention heads 3\n}\n"
                              "residual {\n  layernorm\n  gptmlp\n}\n"
                              "layernorm\n"
                              "lmhead tied\n";

static void parse(tdm_model_spec *s, const char *text)
{
    TU_OK(tdm_model_seq_parse_text(s, "gpt.tdm", text, strlen(text)));
}

Test(builder_gpt, a_file_and_the_c_calls_give_the_builtin_spec)
{
    tdm_model_spec f, c, b;
    parse(&f, g_small);
    cr_assert_eq(f.kind, TDM_MODEL_GPT);
    cr_assert(f.n_layer == 2 && f.n_embd == 12 && f.n_head == 3 && f.n_ctx == 7 &&
                  f.vocab == 256 && f.n_classes == 256,
              "%d-%d-%d-%d vocab %d", f.n_layer, f.n_embd, f.n_head, f.n_ctx, f.vocab);
    /* each line's shape */
    cr_assert_eq(f.n_ops, 2 + 8 * 2 + 2);
    cr_assert(f.ops[0].seq == TDM_MODEL_SEQ_ROWS && f.ops[0].h == 7 && f.ops[0].w == 12);
    cr_assert_eq(f.ops[0].line, 2);
    cr_assert(f.ops[5].kind == TDM_MODEL_OP_RES_CLOSE && f.ops[5].h == 7 && f.ops[5].w == 12);
    cr_assert(f.ops[19].kind == TDM_MODEL_OP_LM_HEAD && f.ops[19].w == 256);
    char d1[64], d2[64];
    tdm_model_spec_describe(&f, d1, sizeof d1);
    cr_assert_str_eq(d1, "gpt:2-12-3-7");

    TU_OK(tdm_model_seq_init_tokens(&c, 7));
    TU_OK(tdm_model_seq_embedding(&c, 256, 12));
    TU_OK(tdm_model_seq_pos_embedding(&c));
    for (int l = 0; l < 2; l++) {
        TU_OK(tdm_model_seq_residual_open(&c));
        TU_OK(tdm_model_seq_layernorm(&c));
        TU_OK(tdm_model_seq_attention(&c, 3));
        TU_OK(tdm_model_seq_residual_close(&c, 0));
        TU_OK(tdm_model_seq_residual_open(&c));
        TU_OK(tdm_model_seq_layernorm(&c));
        TU_OK(tdm_model_seq_gptmlp(&c));
        TU_OK(tdm_model_seq_residual_close(&c, 0));
    }
    TU_OK(tdm_model_seq_layernorm(&c));
    TU_OK(tdm_model_seq_lmhead(&c, 1));
    TU_OK(tdm_model_seq_finish(&c));
    tdm_model_spec_describe(&c, d2, sizeof d2);
    cr_assert_str_eq(d2, "gpt:2-12-3-7");

    TU_OK(tdm_model_spec_parse(&b, "file:examples/models/gpt.tdm"));
    tdm_model_spec_describe(&b, d1, sizeof d1);
    snprintf(d2, sizeof d2, "gpt:%d-%d-%d-%d", TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH,
             TDM_GPT_DEFAULT_HEADS, TDM_GPT_DEFAULT_CONTEXT);
    cr_assert_str_eq(d1, d2, "examples/models/gpt.tdm is %s, the default GPT %s", d1, d2);
}

/* Steps of AdamW on random windows: the same table, then the same losses
 * and values bit for bit. */
static void same_training(const tdm_model_spec *a, const tdm_model_spec *b, int B, int steps)
{
    tdm_device *d = tu_host();
    tdm_model *m[2] = {NULL, NULL};
    tdm_optim *o[2] = {NULL, NULL};
    tdm_single s[2];
    const tdm_model_spec *sp[2] = {a, b};
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_ADAMW);
    oo.lr = 3e-3f;
    for (int k = 0; k < 2; k++) {
        TU_OK(tdm_model_init(&m[k], d, sp[k], 7));
        TU_OK(tdm_optim_init(&o[k], m[k], &oo));
        s[k] = (tdm_single){.model = m[k], .opt = o[k]};
    }
    cr_assert_eq(tdm_model_n_params(m[0]), tdm_model_n_params(m[1]));
    for (int i = 0; i < tdm_model_n_params(m[0]); i++) {
        const tdm_tensor_info *x = tdm_model_param_info(m[0], i), *y = tdm_model_param_info(m[1], i);
        cr_assert_str_eq(x->name, y->name);
        cr_assert(x->n_elem == y->n_elem && x->offset == y->offset, "%s", x->name);
    }
    int64_t pe = tdm_model_param_elems(m[0]);
    cr_assert_eq(pe, tdm_model_param_elems(m[1]));
    cr_assert(!memcmp(tdm_model_params(m[0]), tdm_model_params(m[1]), (size_t)pe * 4),
              "initial values differ");
    int T = tdm_model_in_features(m[0]);
    int32_t *tok = tu_malloc((size_t)B * T * 4), *tgt = tu_malloc((size_t)B * T * 4);
    tdm_rng r = tu_rng(99);
    for (int st = 0; st < steps; st++) {
        for (int64_t i = 0; i < (int64_t)B * T; i++) {
            tok[i] = (int32_t)tdm_rng_below(&r, 256);
            tgt[i] = (int32_t)tdm_rng_below(&r, 256);
        }
        double loss[2];
        for (int k = 0; k < 2; k++) TU_OK(tdm_single_step(&s[k], tok, tgt, B, &loss[k]));
        cr_assert(loss[0] == loss[1], "step %d: loss %.17g vs %.17g", st, loss[0], loss[1]);
        cr_assert(!memcmp(tdm_model_params(m[0]), tdm_model_params(m[1]), (size_t)pe * 4),
                  "step %d: the values differ", st);
    }
    free(tok);
    free(tgt);
    for (int k = 0; k < 2; k++) {
        tdm_single_free(&s[k]);
        tdm_optim_free(o[k]);
        tdm_model_free(m[k]);
    }
    tdm_device_free(d);
}

Test(builder_gpt, trains_bitwise_as_the_builtin_gpt, .timeout = 120)
{
    tdm_model_spec f, b;
    parse(&f, g_small);
    tdm_model_spec_gpt(&b, 2, 12, 3, 7);
    same_training(&f, &b, 3, 4);
}

/* `lmhead` alone: a head of its own, lm_head.weight, last in the table;
 * described by its file; trains (the same steps as the tied one, other
 * values). */
Test(builder_gpt, an_untied_head_has_a_weight_of_its_own, .timeout = 120)
{
    char text[sizeof g_small];
    snprintf(text, sizeof text, "%s", g_small);
    char *tied = strstr(text, "lmhead tied");
    cr_assert_not_null(tied);
    strcpy(tied, "lmhead\n");
    tdm_model_spec s;
    TU_OK(tdm_model_seq_parse_text(&s, "untied.tdm", text, strlen(text)));
    cr_assert(s.kind == TDM_MODEL_GPT && s.head_untied);
    char d[96];
    tdm_model_spec_describe(&s, d, sizeof d);
    cr_assert_str_eq(d, "file:untied.tdm (gpt:2-12-3-7, untied head)");
    tdm_model *m = NULL, *t = NULL;
    tdm_model_spec ts;
    tdm_model_spec_gpt(&ts, 2, 12, 3, 7);
    TU_OK(tdm_model_init(&m, tu_host(), &s, 1));
    TU_OK(tdm_model_init(&t, tu_host(), &ts, 1));
    int n = tdm_model_n_params(m);
    cr_assert_eq(n, tdm_model_n_params(t) + 1);
    const tdm_tensor_info *h = tdm_model_param_info(m, n - 1);
    cr_assert_str_eq(h->name, "lm_head.weight");
    cr_assert(h->ndim == 2 && h->shape[0] == 256 && h->shape[1] == 12);
    /* every other tensor starts as the tied model's */
    for (int i = 0; i < n - 1; i++) {
        const tdm_tensor_info *a = tdm_model_param_info(m, i), *b = tdm_model_param_info(t, i);
        cr_assert_str_eq(a->name, b->name);
        cr_assert(!memcmp(tdm_model_params(m) + a->offset, tdm_model_params(t) + b->offset,
                          (size_t)a->n_elem * 4), "%s", a->name);
    }
    /* the head is announced by the grad-ready hook at the head, first */
    int first, last;
    tdm_model_layer_params(m, tdm_model_n_layers(m) - 1, &first, &last);
    cr_assert(first == n - 1 && last == n - 1, "the head layer owns tensors %d..%d", first, last);
    /* a pipeline stage of it is not built */
    tdm_model *st = NULL;
    cr_assert_neq(tdm_model_init_stage(&st, tu_host(), &s, 1, 0, 2), TDM_STATUS_OK);
    cr_assert(strstr(tdm_error_message(), "untied head runs whole"), "%s", tdm_error_message());
    tdm_model_free(m);
    tdm_model_free(t);
    /* the C call */
    tdm_model_spec c;
    TU_OK(tdm_model_seq_init_tokens(&c, 7));
    TU_OK(tdm_model_seq_embedding(&c, 256, 12));
    TU_OK(tdm_model_seq_pos_embedding(&c));
    TU_OK(tdm_model_seq_residual_open(&c));
    TU_OK(tdm_model_seq_layernorm(&c));
    TU_OK(tdm_model_seq_attention(&c, 3));
    TU_OK(tdm_model_seq_residual_close(&c, 0));
    TU_OK(tdm_model_seq_residual_open(&c));
    TU_OK(tdm_model_seq_layernorm(&c));
    TU_OK(tdm_model_seq_gptmlp(&c));
    TU_OK(tdm_model_seq_residual_close(&c, 0));
    TU_OK(tdm_model_seq_layernorm(&c));
    TU_OK(tdm_model_seq_lmhead(&c, 0));
    TU_OK(tdm_model_seq_finish(&c));
    cr_assert(c.head_untied && c.n_layer == 1);
}

static void refused(const char *text, const char *want)
{
    tdm_model_spec s;
    tdm_status st = tdm_model_seq_parse_text(&s, "bad.tdm", text, strlen(text));
    cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "accepted: %s", text);
    cr_assert(strstr(tdm_error_message(), want), "message '%s' lacks '%s'", tdm_error_message(),
              want);
    cr_assert(!strchr(tdm_error_message(), '\n'), "more than one line: %s", tdm_error_message());
}

#define HEAD "input tokens 8\nembedding vocab 256 dim 12\nembedding positions\n"
#define ATT(h) "residual {\nlayernorm\nattention heads " #h "\n}\n"
#define MLP "residual {\nlayernorm\ngptmlp\n}\n"

Test(builder_gpt, every_layer_that_does_not_fit_is_refused_naming_its_line)
{
    refused("input tokens 8\nembedding dim 12\n",
            "bad.tdm:2: `embedding dim 12`: embedding: no vocabulary");
    refused("input tokens 8\nembedding vocab 300 dim 12\n", "vocabulary 300");
    refused("input tokens 8\nembedding vocab 256\n", "embedding: no width");
    refused("input tokens 8\nembedding vocab 256 dim 12 size 3\n", "unknown embedding option");
    refused(HEAD ATT(5), "bad.tdm:6: `attention heads 5`: attention: 5 heads do not divide the "
                         "width 12");
    refused(HEAD ATT(0), "attention: 0 heads (expected 1..");
    refused(HEAD "residual {\nlayernorm\nattention 3\n", "expected `attention heads H`");
    refused(HEAD ATT(3) MLP ATT(4), "bad.tdm:14: `attention heads 4`: attention: 4 heads, but "
                                    "the first block's (line 6) has 3");
    refused(HEAD ATT(3) MLP "layernorm\nlmhead shared\n", "expected `lmhead tied`");
    refused(HEAD "residual {\nlayernorm\nattention heads 3\n} proj\n",
            "bad.tdm:7: `} proj`: a transformer block keeps its width");
    refused(HEAD ATT(3) "linear 10\n", "bad.tdm:8: `linear 10`: a model of tokens is the GPT's "
                                       "arrangement (docs/MODELS.md): expected `residual {` (the "
                                       "block's MLP) here, not linear");
    refused(HEAD ATT(3) "residual {\nlayernorm\nattention heads 3\n",
            "expected `gptmlp` (a block's second residual is its MLP) here, not attention");
    refused(HEAD "layernorm\n", "expected `residual {` (the first block's attention)");
    refused(HEAD ATT(3) MLP "layernorm\n",
            "bad.tdm:12: the model of tokens ends too early: expected `lmhead tied`");
    refused(HEAD, "ends too early");
    refused(HEAD "residual {\nlayernorm\n",
            "the residual block opened on line 4 is never closed");
    refused(HEAD ATT(3) MLP "layernorm\nlmhead tied\nlayernorm\n",
            "bad.tdm:14: `layernorm`: a model of tokens is the GPT's arrangement "
            "(docs/MODELS.md): expected nothing: `lmhead` ends the model");
    refused("input tokens 8\nattention heads 2\n", "expected the token embedding");
    refused("input tokens 0\n", "a context of 0 tokens (expected 1..65536)");
    refused("input tokens 70000\n", "a context of 70000 tokens");
    refused("input tokens\n", "expected `input tokens T`");
    refused("input 4 4\n", "expected `input CxHxW`, `input FEATURES` or `input tokens T`");
    /* the GPT's layers outside a model of tokens, and the others inside one */
    refused("input 1x4x4\nlayernorm\nflatten\nlinear 2\n",
            "bad.tdm:2: `layernorm`: layernorm normalises a vector of features (or a token "
            "model's rows), got an image of 1x4x4 (add `flatten` before it)");
    refused("input 4\nembedding vocab 256 dim 4\nlinear 2\n",
            "embedding reads token ids, got 4 features");
    refused("input 1x4x4\nattention heads 2\n", "got 1x4x4");
    refused("input 4\ngptmlp\n", "gptmlp works on the (positions x features) rows");
    refused("input 4\nlmhead tied\n", "lmhead works on the");
    refused("input 4\nembedding positions\n", "embedding positions works on the");
    refused("input 4\nlinear 4\nlayernorm extra\n", "layernorm takes no arguments");
}

Test(builder_gpt, c_calls_refuse_what_does_not_fit_and_keep_the_spec)
{
    tdm_model_spec s;
    TU_OK(tdm_model_seq_init_tokens(&s, 5));
    cr_assert_eq(tdm_model_seq_layernorm(&s), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(s.n_ops, 0);
    cr_assert_eq(tdm_model_seq_embedding(&s, 0, 8), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "no vocabulary"), "%s", tdm_error_message());
    TU_OK(tdm_model_seq_embedding(&s, 256, 8));
    TU_OK(tdm_model_seq_pos_embedding(&s));
    TU_OK(tdm_model_seq_residual_open(&s));
    TU_OK(tdm_model_seq_layernorm(&s));
    cr_assert_eq(tdm_model_seq_attention(&s, 3), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "3 heads do not divide the width 8"), "%s",
              tdm_error_message());
    cr_assert_eq(s.n_ops, 4);
    TU_OK(tdm_model_seq_attention(&s, 2));
    cr_assert_eq(tdm_model_seq_finish(&s), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "never closed"), "%s", tdm_error_message());
    TU_OK(tdm_model_seq_residual_close(&s, 0));
    cr_assert_eq(tdm_model_seq_finish(&s), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "ends too early: expected `residual {` (the block's "
                                          "MLP)"), "%s", tdm_error_message());
    /* a linear, a conv: not in a model of tokens */
    cr_assert_eq(tdm_model_seq_linear(&s, 4), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_model_seq_lmhead(&s, 0), TDM_STATUS_INVALID_ARG);
}
