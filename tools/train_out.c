/* tools/train_out.c: `tandem train --json FILE` and `--csv FILE`: one
 * record per epoch (the epoch's line), the file rewritten whole after
 * each epoch (core/safefile.h), so that a run that stops keeps what it
 * did. Only the process that prints the epoch lines writes them (rank 0).
 * Schema and columns: docs/OUTPUTS.md. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/safefile.h"
#include "tools/compare_json.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

typedef struct tdm_train_rec {
    int64_t epoch;
    double train_loss, samples_per_s, seconds, eval_loss, eval_metric;
} tdm_train_rec;

/* this process's epochs so far */
static tdm_train_rec *tdm_train_recs;
static int64_t tdm_train_nrecs, tdm_train_caprecs;

typedef struct tdm_train_out_ctx {
    const tdm_train_args *a;
    int64_t T;   /* a gpt's window (0: images) */
} tdm_train_out_ctx;

static tdm_status tdm_train_json_body(FILE *f, const void *ctx)
{
    const tdm_train_out_ctx *c = ctx;
    const tdm_train_args *a = c->a;
    fputs("{\"schema\": \"tandem.train/1\", \"tandem\": ", f);
    tdm_json_put_str(f, tdm_tool_version());
    fputs(",\n  \"config\": {\"mode\": ", f);
    tdm_json_put_str(f, a->mode);
    fputs(", \"model\": ", f);
    tdm_json_put_str(f, a->model);
    fputs(", \"device\": ", f);
    tdm_json_put_str(f, a->device);
    fputs(", \"optim\": ", f);
    tdm_json_put_str(f, a->optim);
    fputs(", \"lr\": ", f);
    tdm_json_put_num(f, a->lr);
    fprintf(f, ", \"batch\": %lld, \"epochs\": %lld, \"seed\": %lld, \"window_tokens\": %lld, "
               "\"data\": ", a->batch, a->epochs, a->seed, (long long)c->T);
    tdm_json_put_str(f, a->data ? a->data : "default");
    fputs("},\n  \"epochs\": [", f);
    for (int64_t i = 0; i < tdm_train_nrecs; i++) {
        const tdm_train_rec *r = &tdm_train_recs[i];
        fprintf(f, "%s\n    {\"epoch\": %lld, \"train_loss\": ", i ? "," : "",
                (long long)r->epoch);
        tdm_json_put_num(f, r->train_loss);
        fprintf(f, ", \"%s\": ", c->T ? "windows_per_s" : "samples_per_s");
        tdm_json_put_num(f, r->samples_per_s);
        if (c->T) {
            fputs(", \"tokens_per_s\": ", f);
            tdm_json_put_num(f, r->samples_per_s * (double)c->T);
        }
        fputs(", \"seconds\": ", f);
        tdm_json_put_num(f, r->seconds);
        fprintf(f, ", \"%s\": ", c->T ? "val_loss" : "test_loss");
        tdm_json_put_num(f, r->eval_loss);
        fprintf(f, ", \"%s\": ", c->T ? "val_bits_per_byte" : "test_accuracy");
        tdm_json_put_num(f, r->eval_metric);
        fputc('}', f);
    }
    fputs("]\n}\n", f);
    return ferror(f) ? TDM_STATUS_IO : TDM_STATUS_OK;
}

static tdm_status tdm_train_csv(const tdm_train_args *a, int64_t T)
{
    tdm_file_out out;
    if (tdm_file_replace_open(&out, AT_FDCWD, a->csv) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem train: --csv %s: %s\n", a->csv, tdm_error_message());
        return TDM_STATUS_IO;
    }
    int fd = dup(out.fd);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        tdm_file_replace_abort(&out);
        fprintf(stderr, "tandem train: --csv %s: %s\n", a->csv, strerror(errno));
        return TDM_STATUS_IO;
    }
    fprintf(f, "epoch,train_loss,%s,seconds,%s\n", T ? "windows_per_s,tokens_per_s"
                                                     : "samples_per_s",
            T ? "val_loss,val_bits_per_byte" : "test_loss,test_accuracy");
    for (int64_t i = 0; i < tdm_train_nrecs; i++) {
        const tdm_train_rec *r = &tdm_train_recs[i];
        fprintf(f, "%lld,%.9g,%.2f", (long long)r->epoch, r->train_loss, r->samples_per_s);
        if (T) fprintf(f, ",%.2f", r->samples_per_s * (double)T);
        /* no evaluation (--no-eval): empty fields */
        fprintf(f, ",%.3f,", r->seconds);
        if (isfinite(r->eval_loss)) fprintf(f, "%.9g", r->eval_loss);
        fputc(',', f);
        if (isfinite(r->eval_metric)) fprintf(f, "%.9g", r->eval_metric);
        fputc('\n', f);
    }
    if (fclose(f) != 0 || tdm_file_replace_commit(&out) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem train: --csv %s: write failed\n", a->csv);
        return TDM_STATUS_IO;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_train_out_epoch(const tdm_train_args *a, int64_t T, int64_t epoch,
                               double train_loss, double samples_per_s, double seconds,
                               double eval_loss, double eval_metric)
{
    if (!a->json && !a->csv) return TDM_STATUS_OK;
    if (tdm_train_nrecs == tdm_train_caprecs) {
        int64_t cap = tdm_train_caprecs ? 2 * tdm_train_caprecs : 16;
        tdm_train_rec *r = realloc(tdm_train_recs, (size_t)cap * sizeof *r);
        TDM_REQUIRE(r, TDM_STATUS_OUT_OF_MEMORY, "--json/--csv: %lld epochs", (long long)cap);
        tdm_train_recs = r;
        tdm_train_caprecs = cap;
    }
    tdm_train_recs[tdm_train_nrecs++] = (tdm_train_rec){
        .epoch = epoch, .train_loss = train_loss, .samples_per_s = samples_per_s,
        .seconds = seconds, .eval_loss = eval_loss, .eval_metric = eval_metric};
    tdm_train_out_ctx c = {.a = a, .T = T};
    if (a->json) TDM_CHECK(tdm_json_write_file(a->json, "tandem train", tdm_train_json_body, &c));
    if (a->csv) TDM_CHECK(tdm_train_csv(a, T));
    return TDM_STATUS_OK;
}
