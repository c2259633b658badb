/* tools/train_text.c: `tandem train --model gpt[:L-D-H-T]`: a byte-level
 * language model on text (core/text.h: Debian's fortunes by default, or
 * --data FILE|DIR) with one device, DataParallel, DDP or sharded data
 * parallel (--mode fsdp --sharding full|grad_op|optimizer: fsdp/; the tied
 * token embedding and output head live in one unit, docs/FSDP.md). Each epoch draws
 * as many bytes as the training split holds, in random windows; after it
 * the validation loss (nats and bits per byte, on the fixed evaluation
 * windows) is printed beside the bigram baseline's. The global batch is B
 * windows in every mode: DP scatters them over its devices; the ranks of
 * DDP and FSDP are the image models' (tools/train_ranks.c), each drawing
 * its share of the windows itself (no rank reads another's). The epochs
 * are tools/train_loop.c's, and one device and DP tools/train_local.c's,
 * as for images: this file holds the text, its baseline and its header.
 * Checkpoints hold the model (and optimizer); `tandem sample` reads them. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/text.h"
#include "models/train_text.h"
#include "tools/devices.h"
#include "tools/ranks.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_text_job {
    const tdm_train_args *a;
    tdm_model_spec spec;
    tdm_train_text_set set;          /* the text, as the ranks see it too */
} tdm_text_job;

void tdm_train_text_header(const tdm_train_text_set *t, const tdm_model_spec *spec,
                           const tdm_train_args *a, int64_t params, const char *devices)
{
    char desc[64];
    tdm_model_spec_describe(spec, desc, sizeof desc);
    int T = t->T;
    printf("tandem train: mode %s, model %s (%lld parameters), %s\n", a->mode, desc,
           (long long)params, devices);
    printf("  data: %s: %lld training and %lld validation bytes\n", t->corpus->source,
           (long long)t->corpus->train.n, (long long)t->corpus->val.n);
    printf("  batch %lld windows of %d bytes (%lld tokens), %lld steps per epoch; %s lr %g",
           a->batch, T, a->batch * T,
           (long long)tdm_train_text_steps_per_epoch(&t->corpus->train, T, (int)a->batch), a->optim,
           a->lr);
    if (!strcmp(a->optim, "sgd"))
        printf(" momentum %g%s", a->momentum, a->nesterov ? " nesterov" : "");
    printf(" weight decay %g%s, seed %lld\n", a->weight_decay,
           strcmp(a->lr_schedule, "cosine") ? "" : ", cosine schedule", (long long)a->seed);
    printf("  baseline: a bigram model gets %.4f nats per byte (%.3f bits) on the %lld "
           "validation windows\n", t->bigram, t->bigram / M_LN2, (long long)t->eval_count);
    tdm_tool_print_emulated(stdout, a->device);
    fflush(stdout);
}

/* ---- the text and the baseline ---- */

/* The corpus, checked against the context, and the bigram baseline. */
static tdm_status tdm_text_load_job(tdm_text_job *j, tdm_text_corpus *corpus)
{
    const tdm_train_args *a = j->a;
    tdm_status st;
    if ((st = tdm_text_load(corpus, a->data)) != TDM_STATUS_OK)
        return tdm_train_fail("loading text", st);
    if ((st = tdm_text_check_context(corpus, j->spec.n_ctx)) != TDM_STATUS_OK) {
        tdm_train_fail("--model", st);
        tdm_text_free(corpus);
        return tdm_tool_usage(st);
    }
    if ((st = tdm_train_check_memory(a, &j->spec)) != TDM_STATUS_OK) {
        tdm_text_free(corpus);
        return st;
    }
    j->set = (tdm_train_text_set){.corpus = corpus, .T = j->spec.n_ctx};
    j->set.eval_count = tdm_text_eval_count(&corpus->val, j->spec.n_ctx, TDM_TRAIN_TEXT_EVAL_CAP);
    if ((st = tdm_text_bigram_loss(&corpus->train, &corpus->val, j->spec.n_ctx,
                                   TDM_TRAIN_TEXT_EVAL_CAP, &j->set.bigram)) != TDM_STATUS_OK) {
        tdm_train_fail("bigram baseline", st);
        tdm_text_free(corpus);
        return st;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_train_text_main(const tdm_train_args *a)
{
    tdm_text_job j = {.a = a};
    tdm_text_corpus corpus;
    tdm_status st;
    if ((st = tdm_model_spec_parse(&j.spec, a->model)) != TDM_STATUS_OK)
        return tdm_train_fail("--model", tdm_tool_usage(st));
    if (strcmp(a->mode, "single") && strcmp(a->mode, "dp") && strcmp(a->mode, "ddp") &&
        strcmp(a->mode, "fsdp") && strcmp(a->mode, "pp") && strcmp(a->mode, "tp") && strcmp(a->mode, "ps"))
        return tdm_tool_usage_error("tandem train: --mode '%s': expected single, dp, ddp, fsdp, "
                                    "pp, tp or ps\n", a->mode);
    if (a->data && !strcmp(a->data, "synthetic"))
        return tdm_tool_usage_error("tandem train: --data synthetic makes images; a gpt trains "
                                    "on text: --data FILE (any bytes) or a fortunes directory "
                                    "[default: Debian's fortunes in %s]\n",
                                    TDM_TEXT_FORTUNES_DEFAULT_DIR);
    TDM_CHECK(tdm_text_load_job(&j, &corpus));
    if (!strcmp(a->mode, "ddp"))
        st = tdm_train_run_ranks(a, &tdm_tool_ddp_design, &j.spec, &j.set);
    else if (!strcmp(a->mode, "fsdp"))
        st = tdm_train_run_ranks(a, &tdm_tool_fsdp_design, &j.spec, &j.set);
    else if (!strcmp(a->mode, "pp"))
        st = tdm_train_run_pp(a, &j.spec, &j.set);
    else if (!strcmp(a->mode, "tp"))
        st = tdm_train_run_ranks(a, &tdm_tool_tp_design, &j.spec, &j.set);
    else if (!strcmp(a->mode, "ps"))
        st = tdm_train_run_ps(a, &j.spec, &j.set);
    else
        st = tdm_train_run_local(a, &j.spec, &j.set);
    tdm_text_free(&corpus);
    return st;
}
