/* models/spec.c: model specs: the built-in MLP and CNN, parsing
 * `--model mlp:784-1024-10 | cnn | gpt:L-D-H-T`, describing a spec in
 * words. Not here: building a model from a spec (models/model.c). */
#include "models/model_impl.h"

#include "models/builder.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tdm_model_spec_mlp(tdm_model_spec *s, const int *dims, int ndims)
{
    static const int def[] = {784, 1024, 1024, 10};
    memset(s, 0, sizeof *s);
    s->kind = TDM_MODEL_MLP;
    if (!dims) {
        dims = def;
        ndims = 4;
    }
    if (ndims < 2 || ndims > TDM_MODEL_MAX_DIMS) {
        s->ndims = ndims; /* invalid: tdm_model_init refuses it, naming the count */
        return;
    }
    s->ndims = ndims;
    for (int i = 0; i < ndims; i++) s->dims[i] = dims[i];
    s->n_classes = dims[ndims - 1];
    s->in_c = 1;
    s->in_h = 1;
    s->in_w = dims[0];
}

void tdm_model_spec_cnn(tdm_model_spec *s)
{
    memset(s, 0, sizeof *s);
    s->kind = TDM_MODEL_CNN;
    s->in_c = 1;
    s->in_h = 28;
    s->in_w = 28;
    s->n_classes = 10;
    s->ch1 = 32;
    s->ch2 = 64;
    s->fc_hidden = 128;
}

tdm_status tdm_model_spec_parse(tdm_model_spec *s, const char *text)
{
    TDM_REQUIRE(text && *text, TDM_STATUS_INVALID_ARG,
                "empty model name (expected mlp, cnn or gpt)");
    if (!strncmp(text, "gpt", 3)) return tdm_gpt_spec_parse(s, text);
    if (!strncmp(text, "file:", 5)) return tdm_model_seq_load(s, text + 5);
    if (!strcmp(text, "cnn")) {
        tdm_model_spec_cnn(s);
        return TDM_STATUS_OK;
    }
    if (!strcmp(text, "mlp")) {
        tdm_model_spec_mlp(s, NULL, 0);
        return TDM_STATUS_OK;
    }
    if (!strncmp(text, "mlp:", 4)) {
        int dims[TDM_MODEL_MAX_DIMS], n = 0;
        const char *p = text + 4;
        while (*p) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p || v < 1 || v > 1 << 20)
                return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                     "model '%s': widths must be integers in [1, %d], "
                                     "e.g. mlp:784-1024-1024-10", text, 1 << 20);
            TDM_REQUIRE(n < TDM_MODEL_MAX_DIMS, TDM_STATUS_INVALID_ARG,
                        "model '%s': at most %d widths", text, TDM_MODEL_MAX_DIMS);
            dims[n++] = (int)v;
            p = end;
            if (*p == '-' && p[1]) p++;
            else if (*p)
                return tdm_error_set(TDM_STATUS_INVALID_ARG,
                                     "model '%s': unexpected '%c' (widths are separated by '-')",
                                     text, *p);
        }
        TDM_REQUIRE(n >= 2, TDM_STATUS_INVALID_ARG,
                    "model '%s': need at least an input and an output width", text);
        tdm_model_spec_mlp(s, dims, n);
        return TDM_STATUS_OK;
    }
    return tdm_error_set(TDM_STATUS_INVALID_ARG,
                         "unknown model '%s' (expected mlp, mlp:W0-W1-...-Wn, cnn, gpt, "
                         "gpt:L-D-H-T or file:PATH)", text);
}

void tdm_model_spec_sample_shape(const tdm_model_spec *s, int *c, int *h, int *w, int *classes)
{
    *c = s->in_c;
    *h = s->in_h;
    *w = s->in_w;
    if (s->kind == TDM_MODEL_MLP && s->dims[0] == 784) {
        *c = 1;
        *h = 28;
        *w = 28;
    }
    *classes = s->n_classes;
}

void tdm_model_spec_describe(const tdm_model_spec *s, char *buf, size_t len)
{
    if (s->kind == TDM_MODEL_GPT) {
        tdm_gpt_spec_describe(s, buf, len);
        return;
    }
    if (s->kind == TDM_MODEL_SEQ) {
        if (s->in_flat) snprintf(buf, len, "%s (%d -> %d)", s->name, s->in_w, s->n_classes);
        else
            snprintf(buf, len, "%s (%dx%dx%d -> %d)", s->name, s->in_c, s->in_h, s->in_w,
                     s->n_classes);
        return;
    }
    if (s->kind == TDM_MODEL_CNN) {
        if (s->fc_hidden > 0)
            snprintf(buf, len,
                     "cnn %dx%dx%d-[conv%d-bn-relu-pool]-[conv%d-bn-relu-pool]-fc%d-fc%d",
                     s->in_c, s->in_h, s->in_w, s->ch1, s->ch2, s->fc_hidden, s->n_classes);
        else
            snprintf(buf, len, "cnn %dx%dx%d-[conv%d-bn-relu-pool]-[conv%d-bn-relu-pool]-fc%d",
                     s->in_c, s->in_h, s->in_w, s->ch1, s->ch2, s->n_classes);
        return;
    }
    size_t o = (size_t)snprintf(buf, len, "mlp ");
    for (int i = 0; i < s->ndims && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%d", i ? "-" : "", s->dims[i]);
}
