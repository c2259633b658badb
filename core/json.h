/* core/json.h: a small strict JSON parser producing a tree, for file
 * headers such as safetensors' (core/safetensors.c).
 *
 * It accepts RFC 8259 JSON with two deliberate limits: numbers must be
 * integers that fit in int64_t (no fraction or exponent), and strings may
 * not contain U+0000 (they are handed out as C strings). Strings must be
 * valid UTF-8; \uXXXX escapes, surrogate pairs included, become UTF-8.
 * Nesting is limited to TDM_JSON_MAX_DEPTH. It is not a JSON writer, and
 * not meant for large documents (one allocation per value). */
#ifndef TDM_CORE_JSON_H
#define TDM_CORE_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_JSON_MAX_DEPTH 64

typedef enum tdm_json_type {
    TDM_JSON_NULL = 0,
    TDM_JSON_BOOL,
    TDM_JSON_INT,
    TDM_JSON_STRING,
    TDM_JSON_ARRAY,
    TDM_JSON_OBJECT,
    TDM_JSON_REAL,          /* a number with a fraction or exponent (tdm_json_parse_reals) */
} tdm_json_type;

typedef struct tdm_json {
    tdm_json_type type;
    int64_t i;              /* INT value; BOOL: 0 or 1 */
    double d;               /* REAL value; INT: the same as i */
    char *str;              /* STRING value, NUL-terminated */
    size_t str_len;         /* STRING length in bytes */
    int n;                  /* ARRAY/OBJECT: number of items */
    struct tdm_json *items; /* ARRAY/OBJECT: (n) values, in document order */
    char **keys;            /* OBJECT: (n) keys, in document order */
} tdm_json;

/* Parses text[0..nbytes) as exactly one JSON value, surrounded by optional
 * whitespace. On failure sets a message "invalid JSON at byte N: why"
 * and returns TDM_STATUS_FORMAT (TDM_STATUS_OUT_OF_MEMORY if malloc
 * failed); *out is then NULL. Duplicate object keys are kept: the caller
 * decides whether they matter (tdm_json_find_duplicate). */
tdm_status tdm_json_parse(tdm_json **out, const char *text, size_t nbytes);
/* The same, where numbers may also have a fraction and an exponent
 * (TDM_JSON_REAL; integers stay TDM_JSON_INT): for tandem's own result
 * files (compare --json), not for untrusted headers. */
tdm_status tdm_json_parse_reals(tdm_json **out, const char *text, size_t nbytes);
void tdm_json_free(tdm_json *v);   /* NULL ok */

/* The value of key in an object, NULL if absent or v is not an object
 * (the first one if the key is duplicated). */
const tdm_json *tdm_json_get(const tdm_json *obj, const char *key);
/* Index of the first key of obj that equals an earlier key, -1 if none. */
int tdm_json_find_duplicate(const tdm_json *obj);
/* "null", "bool", "integer", "string", "array", "object". */
const char *tdm_json_type_name(tdm_json_type t);

#ifdef __cplusplus
}
#endif

#endif
