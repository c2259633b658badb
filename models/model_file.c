/* models/model_file.c: the model file, a plain-text list of layers, one a
 * line, parsed into the builder's calls (models/builder.h); the grammar
 * and every layer are docs/MODELS.md's. Each error names the file, the
 * line, its text and what does not fit. Not here: shapes (the builder
 * infers them), the layers' math. */
#include "models/builder.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/safefile.h"

/* A model file is a few hundred bytes; anything past 1 MiB is not one. */
#define TDM_MODEL_FILE_MAX_BYTES ((size_t)1 << 20)
#define TDM_MODEL_LINE_MAX 256
#define TDM_MODEL_MAX_TOKENS 8

typedef struct tdm_mf_line {
    const char *file;
    int no;
    char text[TDM_MODEL_LINE_MAX];      /* the line as written, for messages */
    char buf[TDM_MODEL_LINE_MAX];       /* tokens, NUL-separated */
    char *tok[TDM_MODEL_MAX_TOKENS];
    int n;
} tdm_mf_line;

static tdm_status tdm_mf_err(const tdm_mf_line *l, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static tdm_status tdm_mf_err(const tdm_mf_line *l, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "%s:%d: `%s`: %s", l->file, l->no, l->text, msg);
}

/* A positive decimal integer no larger than max, nothing else. */
static tdm_status tdm_mf_int(const tdm_mf_line *l, const char *s, const char *what, int max,
                             int *out)
{
    long long v = 0;
    const char *p = s;
    if (!*p) return tdm_mf_err(l, "%s is missing", what);
    for (; *p; p++) {
        if (!isdigit((unsigned char)*p))
            return tdm_mf_err(l, "%s '%s' is not a positive integer", what, s);
        v = v * 10 + (*p - '0');
        if (v > max) return tdm_mf_err(l, "%s %s is too large (at most %d)", what, s, max);
    }
    *out = (int)v;
    return TDM_STATUS_OK;
}

/* "KxK" (square) or "K". */
static tdm_status tdm_mf_kernel(const tdm_mf_line *l, const char *s, int *k)
{
    char a[32];
    const char *x = strchr(s, 'x');
    if (!x) return tdm_mf_int(l, s, "kernel size", 64, k);
    size_t n = (size_t)(x - s);
    if (n == 0 || n >= sizeof a) return tdm_mf_err(l, "kernel '%s' is not KxK", s);
    memcpy(a, s, n);
    a[n] = 0;
    int k1 = 0, k2 = 0;
    TDM_CHECK(tdm_mf_int(l, a, "kernel height", 64, &k1));
    TDM_CHECK(tdm_mf_int(l, x + 1, "kernel width", 64, &k2));
    if (k1 != k2) return tdm_mf_err(l, "kernel %s is not square (only KxK kernels)", s);
    *k = k1;
    return TDM_STATUS_OK;
}

static tdm_status tdm_mf_input(tdm_model_spec *s, const tdm_mf_line *l)
{
    if (l->n >= 2 && !strcmp(l->tok[1], "tokens")) {
        int T = 0;
        if (l->n != 3) return tdm_mf_err(l, "expected `input tokens T` (a context of T tokens)");
        TDM_CHECK(tdm_mf_int(l, l->tok[2], "context", TDM_MODEL_SEQ_MAX_DIM, &T));
        if (tdm_model_seq_init_tokens(s, T) != TDM_STATUS_OK)
            return tdm_mf_err(l, "%s", tdm_error_message());
        return TDM_STATUS_OK;
    }
    if (l->n != 2)
        return tdm_mf_err(l, "expected `input CxHxW`, `input FEATURES` or `input tokens T`");
    int d[3] = {0, 0, 0}, nd = 0;
    char buf[TDM_MODEL_LINE_MAX];
    snprintf(buf, sizeof buf, "%s", l->tok[1]);
    for (char *p = buf, *q; p; p = q) {
        q = strchr(p, 'x');
        if (q) *q++ = 0;
        if (nd == 3) return tdm_mf_err(l, "input has more than 3 sizes (CxHxW)");
        TDM_CHECK(tdm_mf_int(l, p, "input size", TDM_MODEL_SEQ_MAX_DIM, &d[nd]));
        if (d[nd] < 1) return tdm_mf_err(l, "input size 0");
        nd++;
    }
    if (nd == 2) return tdm_mf_err(l, "input is CxHxW (3 sizes) or FEATURES (1), not HxW");
    tdm_status st = nd == 1 ? tdm_model_seq_init_flat(s, d[0]) : tdm_model_seq_init(s, d[0], d[1], d[2]);
    if (st != TDM_STATUS_OK) return tdm_mf_err(l, "%s", tdm_error_message());
    return TDM_STATUS_OK;
}

/* `embedding vocab V dim C` (either order) or `embedding positions`. */
static tdm_status tdm_mf_embedding(const tdm_mf_line *l, tdm_model_op *o)
{
    if (l->n == 2 && !strcmp(l->tok[1], "positions")) {
        o->kind = TDM_MODEL_OP_POS_EMBEDDING;
        return TDM_STATUS_OK;
    }
    if (l->n % 2 == 0 || l->n < 3)
        return tdm_mf_err(l, "expected `embedding vocab 256 dim WIDTH` or `embedding positions`");
    o->kind = TDM_MODEL_OP_EMBEDDING;
    for (int i = 1; i + 1 < l->n; i += 2) {
        if (!strcmp(l->tok[i], "vocab"))
            TDM_CHECK(tdm_mf_int(l, l->tok[i + 1], "vocabulary", TDM_MODEL_SEQ_MAX_DIM, &o->k));
        else if (!strcmp(l->tok[i], "dim"))
            TDM_CHECK(tdm_mf_int(l, l->tok[i + 1], "width", TDM_MODEL_SEQ_MAX_DIM, &o->n));
        else
            return tdm_mf_err(l, "unknown embedding option '%s' (vocab or dim)", l->tok[i]);
    }
    if (o->n == 0) return tdm_mf_err(l, "embedding: no width (`embedding vocab 256 dim WIDTH`)");
    return TDM_STATUS_OK;
}

/* The op of a line (not `input`), into o. */
static tdm_status tdm_mf_op(const tdm_mf_line *l, tdm_model_op *o, int *global)
{
    const char *w = l->tok[0];
    int n = l->n;
    memset(o, 0, sizeof *o);
    o->line = l->no;
    *global = 0;
    if (!strcmp(w, "linear")) {
        if (n != 2) return tdm_mf_err(l, "expected `linear OUT_FEATURES`");
        o->kind = TDM_MODEL_OP_LINEAR;
        return tdm_mf_int(l, l->tok[1], "output features", TDM_MODEL_SEQ_MAX_DIM, &o->n);
    }
    if (!strcmp(w, "conv")) {
        if (n < 3 || n % 2 == 0)
            return tdm_mf_err(l, "expected `conv KxK CHANNELS [stride S] [pad P]`");
        o->kind = TDM_MODEL_OP_CONV;
        o->stride = 1;
        TDM_CHECK(tdm_mf_kernel(l, l->tok[1], &o->k));
        TDM_CHECK(tdm_mf_int(l, l->tok[2], "channels", TDM_MODEL_SEQ_MAX_DIM, &o->n));
        for (int i = 3; i + 1 < n; i += 2) {
            if (!strcmp(l->tok[i], "stride"))
                TDM_CHECK(tdm_mf_int(l, l->tok[i + 1], "stride", 64, &o->stride));
            else if (!strcmp(l->tok[i], "pad"))
                TDM_CHECK(tdm_mf_int(l, l->tok[i + 1], "pad", 64, &o->pad));
            else
                return tdm_mf_err(l, "unknown conv option '%s' (stride or pad)", l->tok[i]);
        }
        return TDM_STATUS_OK;
    }
    static const struct { const char *name; tdm_model_op_kind kind; } plain[] = {
        {"batchnorm", TDM_MODEL_OP_BATCHNORM}, {"relu", TDM_MODEL_OP_RELU},
        {"gelu", TDM_MODEL_OP_GELU},           {"tanh", TDM_MODEL_OP_TANH},
        {"sigmoid", TDM_MODEL_OP_SIGMOID},     {"flatten", TDM_MODEL_OP_FLATTEN},
        {"layernorm", TDM_MODEL_OP_LAYERNORM}, {"gptmlp", TDM_MODEL_OP_GPT_MLP},
    };
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        if (strcmp(w, plain[i].name)) continue;
        if (n != 1) return tdm_mf_err(l, "%s takes no arguments", w);
        o->kind = plain[i].kind;
        return TDM_STATUS_OK;
    }
    if (!strcmp(w, "maxpool") || !strcmp(w, "avgpool")) {
        o->kind = w[0] == 'm' ? TDM_MODEL_OP_MAXPOOL : TDM_MODEL_OP_AVGPOOL;
        if (n != 2) return tdm_mf_err(l, "expected `%s K`%s", w,
                                      w[0] == 'a' ? " or `avgpool global`" : "");
        if (w[0] == 'a' && !strcmp(l->tok[1], "global")) {
            *global = 1;
            return TDM_STATUS_OK;
        }
        TDM_CHECK(tdm_mf_int(l, l->tok[1], "window", TDM_MODEL_SEQ_MAX_DIM, &o->k));
        if (o->k < 1) return tdm_mf_err(l, "window 0");
        o->kw = o->k;
        return TDM_STATUS_OK;
    }
    if (!strcmp(w, "dropout")) {
        if (n != 2) return tdm_mf_err(l, "expected `dropout P` (0 <= P < 1)");
        char *end = NULL;
        errno = 0;
        double p = strtod(l->tok[1], &end);
        if (end == l->tok[1] || *end || errno || !(p >= 0.0 && p < 1.0))
            return tdm_mf_err(l, "dropout probability '%s' is not a number in [0, 1)",
                              l->tok[1]);
        o->kind = TDM_MODEL_OP_DROPOUT;
        o->p = (float)p;
        return TDM_STATUS_OK;
    }
    if (!strcmp(w, "embedding")) return tdm_mf_embedding(l, o);
    if (!strcmp(w, "attention")) {
        if (n != 3 || strcmp(l->tok[1], "heads"))
            return tdm_mf_err(l, "expected `attention heads H`");
        o->kind = TDM_MODEL_OP_ATTENTION;
        return tdm_mf_int(l, l->tok[2], "heads", TDM_MODEL_SEQ_MAX_DIM, &o->n);
    }
    if (!strcmp(w, "lmhead")) {
        if (n > 2 || (n == 2 && strcmp(l->tok[1], "tied")))
            return tdm_mf_err(l, "expected `lmhead tied` (the head reads the token embedding) "
                                 "or `lmhead` (a weight of its own)");
        o->kind = TDM_MODEL_OP_LM_HEAD;
        o->proj = n == 1;   /* untied */
        return TDM_STATUS_OK;
    }
    if (!strcmp(w, "residual")) {
        if (n != 2 || strcmp(l->tok[1], "{"))
            return tdm_mf_err(l, "expected `residual {` (the block ends with `}` or `} proj`)");
        o->kind = TDM_MODEL_OP_RES_OPEN;
        return TDM_STATUS_OK;
    }
    if (!strcmp(w, "}")) {
        if (n > 2 || (n == 2 && strcmp(l->tok[1], "proj")))
            return tdm_mf_err(l, "expected `}` or `} proj`");
        o->kind = TDM_MODEL_OP_RES_CLOSE;
        o->proj = n == 2;
        return TDM_STATUS_OK;
    }
    if (!strcmp(w, "input")) return tdm_mf_err(l, "`input` must be the first layer line");
    return tdm_mf_err(l, "unknown layer '%s' (expected input, linear, conv, batchnorm, relu, gelu, "
                         "tanh, sigmoid, maxpool, avgpool, flatten, dropout, residual {, }, "
                         "embedding, layernorm, attention, gptmlp, lmhead)", w);
}

/* Splits line text (len bytes, no newline) into tokens; 0 tokens: blank
 * or a comment. `residual{` and `}proj` split at the brace. */
static tdm_status tdm_mf_split(tdm_mf_line *l, const char *text, size_t len)
{
    l->n = 0;
    size_t shown = len < sizeof l->text - 1 ? len : sizeof l->text - 1;
    for (size_t i = 0; i < shown; i++)
        l->text[i] = isprint((unsigned char)text[i]) ? text[i] : '?';
    l->text[shown] = 0;
    if (len >= TDM_MODEL_LINE_MAX)
        return tdm_mf_err(l, "line longer than %d characters", TDM_MODEL_LINE_MAX - 1);
    size_t o = 0;
    for (size_t i = 0; i < len && text[i] != '#';) {
        unsigned char ch = (unsigned char)text[i];
        if (ch == ' ' || ch == '\t' || ch == '\r') {
            i++;
            continue;
        }
        if (!isprint(ch)) return tdm_mf_err(l, "byte 0x%02x is not text", ch);
        if (l->n == TDM_MODEL_MAX_TOKENS) return tdm_mf_err(l, "too many words");
        l->tok[l->n++] = l->buf + o;
        if (ch == '{' || ch == '}') {
            l->buf[o++] = (char)ch;
            i++;
        } else {
            while (i < len && text[i] != '#' && text[i] != '{' && text[i] != '}' &&
                   isgraph((unsigned char)text[i]))
                l->buf[o++] = text[i++];
        }
        l->buf[o++] = 0;
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_model_seq_parse_text(tdm_model_spec *s, const char *name, const char *text,
                                    size_t len)
{
    tdm_mf_line *l = calloc(1, sizeof *l);
    TDM_REQUIRE(l, TDM_STATUS_OUT_OF_MEMORY, "cannot allocate a line buffer");
    tdm_status st = TDM_STATUS_OK;
    int have_input = 0, last = 0;
    l->file = name;
    memset(s, 0, sizeof *s);
    for (size_t p = 0; p < len;) {
        const char *nl = memchr(text + p, '\n', len - p);
        size_t n = nl ? (size_t)(nl - (text + p)) : len - p;
        l->no++;
        TDM_TRY(tdm_mf_split(l, text + p, n));
        p += n + (nl ? 1 : 0);
        if (l->n == 0) continue;
        last = l->no;
        if (!have_input) {
            if (strcmp(l->tok[0], "input")) {
                st = tdm_mf_err(l, "a model file starts with `input CxHxW`, `input FEATURES` "
                                   "or `input tokens T`");
                goto fail;
            }
            TDM_TRY(tdm_mf_input(s, l));
            have_input = 1;
            continue;
        }
        tdm_model_op o;
        int global = 0;
        TDM_TRY(tdm_mf_op(l, &o, &global));
        st = global ? tdm_model_seq_avgpool_global(s) : tdm_model_seq_add(s, &o);
        if (st == TDM_STATUS_OK && global) s->ops[s->n_ops - 1].line = l->no;
        if (st != TDM_STATUS_OK) {
            st = tdm_mf_err(l, "%s", tdm_error_message());
            goto fail;
        }
    }
    if (!have_input) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "%s: no layers (a model file starts with "
                           "`input CxHxW` or `input FEATURES`)", name);
        goto fail;
    }
    st = tdm_model_seq_finish(s);
    if (st != TDM_STATUS_OK) {
        char msg[TDM_ERROR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", tdm_error_message());
        st = tdm_error_set(st, "%s:%d: %s", name, last, msg);
        goto fail;
    }
    snprintf(s->name, sizeof s->name, "file:%s", name);
fail:
    free(l);
    return st;
}

tdm_status tdm_model_seq_load(tdm_model_spec *s, const char *path)
{
    int fd = -1;
    size_t nbytes = 0;
    char *buf = NULL;
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(path && *path, TDM_STATUS_INVALID_ARG, "model file: empty path (file:PATH)");
    TDM_TRY(tdm_file_open_read(path, &fd, &nbytes));
    if (nbytes > TDM_MODEL_FILE_MAX_BYTES) {
        st = tdm_error_set(TDM_STATUS_INVALID_ARG, "%s: %zu bytes is not a model file (at most "
                           "%zu)", path, nbytes, TDM_MODEL_FILE_MAX_BYTES);
        goto fail;
    }
    buf = malloc(nbytes + 1);
    if (!buf) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes", path, nbytes);
        goto fail;
    }
    size_t got = 0;
    while (got < nbytes) {
        ssize_t r = read(fd, buf + got, nbytes - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            st = tdm_error_set(TDM_STATUS_IO, "%s: read failed: %s", path,
                               r < 0 ? strerror(errno) : "file shrank while read");
            goto fail;
        }
        got += (size_t)r;
    }
    /* the base name keeps messages short and the spec the same bytes on
     * every rank, wherever the file was given from */
    const char *base = strrchr(path, '/');
    st = tdm_model_seq_parse_text(s, base ? base + 1 : path, buf, nbytes);
    if (st != TDM_STATUS_OK && base) {
        char msg[TDM_ERROR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", tdm_error_message());
        st = tdm_error_set(st, "%.*s/%s", (int)(base - path), path, msg);
    }
fail:
    if (fd >= 0) close(fd);
    free(buf);
    return st;
}
