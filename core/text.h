/* core/text.h: text for byte-level language models: loading (Debian's
 * fortunes, or any file), the fixed train/validation split, the random
 * training windows, the fixed evaluation windows, and a bigram baseline.
 *
 * Tokens are bytes (0..255): no tokenizer, any file is text.
 *
 * Fortunes (a directory of strfile text files, Debian's `fortunes`
 * package in /usr/share/games/fortunes): the regular files of the
 * directory whose names do not end in ".dat" (the strfile indexes; the
 * ".u8" names are symbolic links and are skipped too), read in byte order
 * of their names. A fortune is the text between lines holding only "%".
 * Cleaning: a backspace deletes the byte before it (the overstrike
 * underlining and bold of old fortunes), carriage returns and every other
 * control byte but newline and tab are dropped, leading blank lines and
 * trailing white space are trimmed, and empty fortunes are skipped. Each
 * fortune is followed by a blank line ("\n\n"), so the model sees where
 * one ends. Split: fortune k (counting from 0 over all files, in order)
 * goes to validation when k % 10 == 9, else to training - whole fortunes
 * on either side, every file represented in both.
 *
 * Any other file: its bytes as they are; the first 90% (floor of
 * 9n/10) train, the last 10% validate. The file is mapped read-only, not
 * copied (a large text takes address space, not memory; changing or
 * truncating the file while it is in use is not supported). Only a
 * regular file is read (core/safefile.h: a FIFO or a device is refused
 * at once, never waited on).
 *
 * Training windows: global step s draws `batch` windows; window j starts
 * at an offset drawn uniformly from [0, n - T - 1] by its own Philox
 * stream (seed, TDM_RNG_STREAM_TEXT + (s << 32) + j), so a window is a
 * function of (seed, step, j) alone. Its inputs are the T bytes from the
 * offset and its targets the T bytes one further. Under DDP rank r draws
 * windows [r*B/W, (r+1)*B/W) of each global batch of B itself, from
 * those streams: the global batch is the same B windows whatever the
 * number of ranks (the semantics of the image models' global batch), no
 * rank reads another's, and one device, DP and DDP train on the same
 * windows.
 *
 * Evaluation windows: the split cut into K = (n - 1) / T consecutive
 * windows (window k's inputs are bytes [kT, kT + T), its targets one
 * further: every target byte once); when K exceeds the cap, cap windows
 * evenly spaced among them (window i is number floor(i K / cap)). */
#ifndef TDM_CORE_TEXT_H
#define TDM_CORE_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Used when no path is given and TANDEM_FORTUNES_DIR is unset or empty. */
#define TDM_TEXT_FORTUNES_DEFAULT_DIR "/usr/share/games/fortunes"
/* The largest text loaded (bytes). */
#define TDM_TEXT_MAX_BYTES ((int64_t)1 << 31)

typedef struct tdm_text {
    uint8_t *bytes;      /* owned by the corpus */
    int64_t n;
    int mapped;          /* 1: bytes are a read-only mapping of the file */
} tdm_text;

typedef struct tdm_text_corpus {
    tdm_text train, val;
    int fortunes;        /* 1: cleaned fortunes; 0: a plain file */
    int64_t n_docs;      /* fortunes kept (0 for a plain file) */
    int n_files;
    char source[512];    /* what was loaded, for messages and headers */
    void *map;           /* a plain file: its mapping, which both splits point into */
    size_t map_nbytes;
} tdm_text_corpus;

/* path: a directory (fortunes), a file (its bytes), or NULL (the fortunes
 * in $TANDEM_FORTUNES_DIR, else TDM_TEXT_FORTUNES_DEFAULT_DIR). Errors:
 * TDM_STATUS_IO (cannot open or read; messages name the path and say
 * what to do), TDM_STATUS_FORMAT (empty, no fortunes, too large). On
 * failure *out is zeroed. */
tdm_status tdm_text_load(tdm_text_corpus *out, const char *path);
void tdm_text_free(tdm_text_corpus *c);   /* NULL ok, idempotent */

/* Both splits must hold a window of context T (T + 1 bytes); otherwise
 * TDM_STATUS_INVALID_ARG saying which split is how short and what to do. */
tdm_status tdm_text_check_context(const tdm_text_corpus *c, int T);

/* Windows [first, first + count) of global step `step` (see above) into
 * x and y, (count, T) int32 each. t->n must be >= T + 1. */
void tdm_text_windows(const tdm_text *t, int T, uint64_t seed, int64_t step, int64_t first,
                      int count, int32_t *x, int32_t *y);

/* The number of evaluation windows of context T (at most cap; cap <= 0:
 * no cap), and window i of them into x, y (T each). */
int64_t tdm_text_eval_count(const tdm_text *t, int T, int64_t cap);
void tdm_text_eval_window(const tdm_text *t, int T, int64_t count, int64_t i, int32_t *x,
                          int32_t *y);

/* The baseline a model must beat: a bigram model (next byte given the
 * previous one) counted on train with add-one smoothing,
 * P(b | a) = (count(a b) + 1) / (count(a) + 256), and its mean loss in
 * nats per byte on the evaluation windows of eval (the targets a model is
 * scored on with the same T and cap). */
tdm_status tdm_text_bigram_loss(const tdm_text *train, const tdm_text *eval, int T, int64_t cap,
                                double *loss);

#ifdef __cplusplus
}
#endif

#endif
