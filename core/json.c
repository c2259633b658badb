/* core/json.c: the strict recursive-descent JSON parser declared in
 * core/json.h. Errors carry the byte offset of the problem. It is not a
 * general-purpose JSON library: no floating-point numbers, no writer, no
 * streaming. */
#include "core/json.h"

#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct json_parser {
    const unsigned char *s;
    size_t len;
    size_t pos;
    int reals;   /* tdm_json_parse_reals: fractions and exponents allowed */
} json_parser;

static tdm_status json_err(const json_parser *p, const char *why)
{
    return tdm_error_set(TDM_STATUS_FORMAT, "invalid JSON at byte %zu: %s",
                         p->pos, why);
}

static tdm_status json_oom(void)
{
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY,
                         "out of memory while parsing JSON");
}

static void json_skip_ws(json_parser *p)
{
    while (p->pos < p->len) {
        unsigned char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static void json_clear(tdm_json *v)
{
    if (!v) return;
    for (int k = 0; k < v->n; k++) {
        if (v->items) json_clear(&v->items[k]);
        if (v->keys) free(v->keys[k]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    memset(v, 0, sizeof *v);
}

void tdm_json_free(tdm_json *v)
{
    json_clear(v);
    free(v);
}

static int json_hex4(const unsigned char *h, unsigned *out)
{
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        unsigned char c = h[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* Length of the valid UTF-8 sequence at s[0..avail), 0 if invalid
 * (overlong forms, surrogates and code points above U+10FFFF rejected). */
static size_t json_utf8_len(const unsigned char *s, size_t avail)
{
    unsigned char c = s[0];
    size_t n;
    unsigned cp, min;
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) { n = 2; cp = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { n = 3; cp = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { n = 4; cp = c & 0x07; min = 0x10000; }
    else return 0;
    if (n > avail) return 0;
    for (size_t k = 1; k < n; k++) {
        if ((s[k] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return n;
}

static size_t json_put_utf8(char *d, unsigned cp)
{
    if (cp < 0x80) { d[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        d[0] = (char)(0xC0 | (cp >> 6));
        d[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        d[0] = (char)(0xE0 | (cp >> 12));
        d[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        d[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    d[0] = (char)(0xF0 | (cp >> 18));
    d[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    d[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    d[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parses a string starting at the opening quote. The decoded text is never
 * longer than the source, so one allocation of the source span suffices. */
static tdm_status json_parse_string(json_parser *p, char **out, size_t *out_len)
{
    size_t start = ++p->pos, end = start;
    while (end < p->len && p->s[end] != '"') {
        if (p->s[end] == '\\') end++;
        end++;
    }
    if (end >= p->len) return json_err(p, "unterminated string");
    char *d = malloc(end - start + 1);
    if (!d) return json_oom();
    size_t n = 0;
    while (p->pos < end) {
        unsigned char c = p->s[p->pos];
        if (c < 0x20) {
            free(d);
            return json_err(p, "control character in string (escape it)");
        }
        if (c != '\\') {
            size_t k = json_utf8_len(p->s + p->pos, end - p->pos);
            if (k == 0) {
                free(d);
                return json_err(p, "invalid UTF-8 in string");
            }
            memcpy(d + n, p->s + p->pos, k);
            n += k;
            p->pos += k;
            continue;
        }
        unsigned char e = p->s[p->pos + 1];
        const char *simple = NULL;
        switch (e) {
        case '"': simple = "\""; break;
        case '\\': simple = "\\"; break;
        case '/': simple = "/"; break;
        case 'b': simple = "\b"; break;
        case 'f': simple = "\f"; break;
        case 'n': simple = "\n"; break;
        case 'r': simple = "\r"; break;
        case 't': simple = "\t"; break;
        default: break;
        }
        if (simple) {
            d[n++] = simple[0];
            p->pos += 2;
            continue;
        }
        unsigned cp, lo;
        if (e != 'u' || p->pos + 6 > end || json_hex4(p->s + p->pos + 2, &cp)) {
            free(d);
            return json_err(p, "invalid escape in string");
        }
        p->pos += 6;
        if (cp >= 0xDC00 && cp <= 0xDFFF) {
            free(d);
            return json_err(p, "unpaired low surrogate in \\u escape");
        }
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (p->pos + 6 > end || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u' ||
                json_hex4(p->s + p->pos + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
                free(d);
                return json_err(p, "unpaired high surrogate in \\u escape");
            }
            p->pos += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        if (cp == 0) {
            free(d);
            return json_err(p, "\\u0000 in string is not supported");
        }
        n += json_put_utf8(d + n, cp);
    }
    p->pos = end + 1;
    d[n] = '\0';
    *out = d;
    if (out_len) *out_len = n;
    return TDM_STATUS_OK;
}

/* *real: set when a fraction or exponent follows (only with p->reals;
 * the caller then parses the whole number as a real). */
static tdm_status json_parse_int(json_parser *p, int64_t *out, int *real)
{
    int neg = 0;
    if (p->s[p->pos] == '-') { neg = 1; p->pos++; }
    if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9')
        return json_err(p, "expected a digit");
    if (p->s[p->pos] == '0' && p->pos + 1 < p->len &&
        p->s[p->pos + 1] >= '0' && p->s[p->pos + 1] <= '9')
        return json_err(p, "leading zero in number");
    /* Accumulate as a negative number so INT64_MIN fits. */
    int64_t v = 0;
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
        int dgt = p->s[p->pos] - '0';
        if (v < (INT64_MIN + dgt) / 10) return json_err(p, "integer out of range");
        v = v * 10 - dgt;
        p->pos++;
    }
    if (p->pos < p->len && (p->s[p->pos] == '.' || p->s[p->pos] == 'e' ||
                            p->s[p->pos] == 'E'))
    {
        if (!p->reals) return json_err(p, "only integers are supported");
        *real = 1;
        return TDM_STATUS_OK;
    }
    if (!neg) {
        if (v == INT64_MIN) return json_err(p, "integer out of range");
        v = -v;
    }
    *out = v;
    return TDM_STATUS_OK;
}

/* The fraction and exponent after an integer part (RFC 8259's grammar),
 * then the whole number from start, as a double. */
static int json_digits(json_parser *p)
{
    size_t from = p->pos;
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
    return p->pos > from;
}

static tdm_status json_parse_real(json_parser *p, size_t start, double *out)
{
    if (p->pos < p->len && p->s[p->pos] == '.') {
        p->pos++;
        if (!json_digits(p)) return json_err(p, "expected a digit after '.'");
    }
    if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        p->pos++;
        if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
        if (!json_digits(p)) return json_err(p, "expected a digit in the exponent");
    }
    char buf[64];
    size_t n = p->pos - start;
    if (n >= sizeof buf) return json_err(p, "number too long");
    memcpy(buf, p->s + start, n);
    buf[n] = '\0';
    *out = strtod(buf, NULL);
    if (!isfinite(*out)) return json_err(p, "number out of range");
    return TDM_STATUS_OK;
}

static int json_grow(tdm_json *v, int *cap, int with_keys)
{
    if (v->n < *cap) return 0;
    int ncap = *cap ? *cap * 2 : 4;
    tdm_json *items = realloc(v->items, (size_t)ncap * sizeof *items);
    if (!items) return -1;
    v->items = items;
    if (with_keys) {
        char **keys = realloc(v->keys, (size_t)ncap * sizeof *keys);
        if (!keys) return -1;
        v->keys = keys;
    }
    *cap = ncap;
    return 0;
}

static tdm_status json_parse_value(json_parser *p, tdm_json *v, int depth);

static tdm_status json_parse_container(json_parser *p, tdm_json *v, int depth)
{
    int is_obj = p->s[p->pos] == '{';
    char close = is_obj ? '}' : ']';
    int cap = 0;
    v->type = is_obj ? TDM_JSON_OBJECT : TDM_JSON_ARRAY;
    if (depth >= TDM_JSON_MAX_DEPTH) return json_err(p, "nesting too deep");
    p->pos++;
    json_skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        return TDM_STATUS_OK;
    }
    for (;;) {
        char *key = NULL;
        json_skip_ws(p);
        if (is_obj) {
            if (p->pos >= p->len || p->s[p->pos] != '"')
                return json_err(p, "expected a string key");
            TDM_CHECK(json_parse_string(p, &key, NULL));
            json_skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') {
                free(key);
                return json_err(p, "expected ':' after key");
            }
            p->pos++;
        }
        if (json_grow(v, &cap, is_obj)) {
            free(key);
            return json_oom();
        }
        tdm_json *item = &v->items[v->n];
        memset(item, 0, sizeof *item);
        if (is_obj) v->keys[v->n] = key;
        v->n++;   /* counted now so that json_clear frees a partial item */
        TDM_CHECK(json_parse_value(p, item, depth + 1));
        json_skip_ws(p);
        if (p->pos >= p->len)
            return json_err(p, is_obj ? "unterminated object" : "unterminated array");
        if (p->s[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->s[p->pos] == close) {
            p->pos++;
            return TDM_STATUS_OK;
        }
        return json_err(p, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int json_literal(json_parser *p, const char *lit)
{
    size_t n = strlen(lit);
    if (p->len - p->pos < n || memcmp(p->s + p->pos, lit, n) != 0) return 0;
    p->pos += n;
    return 1;
}

static tdm_status json_parse_value(json_parser *p, tdm_json *v, int depth)
{
    json_skip_ws(p);
    if (p->pos >= p->len) return json_err(p, "unexpected end of text");
    unsigned char c = p->s[p->pos];
    if (c == '{' || c == '[') return json_parse_container(p, v, depth);
    if (c == '"') {
        v->type = TDM_JSON_STRING;
        return json_parse_string(p, &v->str, &v->str_len);
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        size_t start = p->pos;
        v->type = TDM_JSON_INT;
        int real = 0;
        tdm_status st = json_parse_int(p, &v->i, &real);
        if (st != TDM_STATUS_OK || !real) {
            v->d = (double)v->i;
            return st;
        }
        v->type = TDM_JSON_REAL;
        return json_parse_real(p, start, &v->d);
    }
    if (json_literal(p, "true")) { v->type = TDM_JSON_BOOL; v->i = 1; return TDM_STATUS_OK; }
    if (json_literal(p, "false")) { v->type = TDM_JSON_BOOL; v->i = 0; return TDM_STATUS_OK; }
    if (json_literal(p, "null")) { v->type = TDM_JSON_NULL; return TDM_STATUS_OK; }
    if (c >= 0x21 && c <= 0x7e) {
        char why[40];
        snprintf(why, sizeof why, "unexpected character '%c'", c);
        return json_err(p, why);
    }
    return json_err(p, "unexpected character");
}

static tdm_status json_parse_all(tdm_json **out, const char *text, size_t nbytes, int reals)
{
    tdm_status st = TDM_STATUS_OK;
    json_parser p = { .s = (const unsigned char *)text, .len = nbytes, .pos = 0,
                      .reals = reals };
    tdm_json *v = calloc(1, sizeof *v);
    *out = NULL;
    if (!v) return json_oom();
    TDM_TRY(json_parse_value(&p, v, 0));
    json_skip_ws(&p);
    if (p.pos != p.len) {
        st = json_err(&p, "unexpected text after the value");
        goto fail;
    }
    *out = v;
    return TDM_STATUS_OK;
fail:
    tdm_json_free(v);
    return st;
}

tdm_status tdm_json_parse(tdm_json **out, const char *text, size_t nbytes)
{
    return json_parse_all(out, text, nbytes, 0);
}

tdm_status tdm_json_parse_reals(tdm_json **out, const char *text, size_t nbytes)
{
    return json_parse_all(out, text, nbytes, 1);
}

const tdm_json *tdm_json_get(const tdm_json *obj, const char *key)
{
    if (!obj || obj->type != TDM_JSON_OBJECT) return NULL;
    for (int k = 0; k < obj->n; k++)
        if (strcmp(obj->keys[k], key) == 0) return &obj->items[k];
    return NULL;
}

typedef struct json_key_ref {
    const char *key;
    int index;
} json_key_ref;

static int json_key_cmp(const void *a, const void *b)
{
    const json_key_ref *x = a, *y = b;
    int c = strcmp(x->key, y->key);
    if (c) return c;
    return (x->index > y->index) - (x->index < y->index);
}

int tdm_json_find_duplicate(const tdm_json *obj)
{
    if (!obj || obj->type != TDM_JSON_OBJECT || obj->n < 2) return -1;
    json_key_ref *refs = malloc((size_t)obj->n * sizeof *refs);
    int dup = -1;
    if (!refs) {
        /* Quadratic fallback rather than a wrong answer. */
        for (int k = 1; k < obj->n && dup < 0; k++)
            for (int j = 0; j < k; j++)
                if (strcmp(obj->keys[j], obj->keys[k]) == 0) { dup = k; break; }
        return dup;
    }
    for (int k = 0; k < obj->n; k++) refs[k] = (json_key_ref){ obj->keys[k], k };
    qsort(refs, (size_t)obj->n, sizeof *refs, json_key_cmp);
    for (int k = 1; k < obj->n; k++)
        if (strcmp(refs[k - 1].key, refs[k].key) == 0 && (dup < 0 || refs[k].index < dup))
            dup = refs[k].index;
    free(refs);
    return dup;
}

const char *tdm_json_type_name(tdm_json_type t)
{
    switch (t) {
    case TDM_JSON_NULL: return "null";
    case TDM_JSON_BOOL: return "bool";
    case TDM_JSON_INT: return "integer";
    case TDM_JSON_REAL: return "number";
    case TDM_JSON_STRING: return "string";
    case TDM_JSON_ARRAY: return "array";
    case TDM_JSON_OBJECT: return "object";
    }
    return "unknown";
}
