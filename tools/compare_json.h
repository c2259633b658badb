/* tools/compare_json.h: the JSON result files of compare and train
 * (--json FILE; schema in docs/OUTPUTS.md). */
#ifndef TDM_TOOLS_COMPARE_JSON_H
#define TDM_TOOLS_COMPARE_JSON_H

#include <stdio.h>

#include "tools/compare.h"

/* A JSON number ("%.9g"), or null when x is not finite. */
void tdm_json_put_num(FILE *f, double x);
/* A JSON string, escaped. */
void tdm_json_put_str(FILE *f, const char *s);

/* What compare decided, beside the results. */
typedef struct tdm_cmp_report {
    int verdict;                       /* 1: PASS */
    double atol_first, rtol_first, atol_last, rtol_last, loss_rtol, floor_factor;
    double floor_max_abs, floor_loss_rel;   /* the float-noise floor measured */
    int n_pairs;
    int pairs[16][2];                  /* modes compared, a vs b */
    int pair_ok[16];
    const char *hook;                  /* --comm-hook run (NULL: none) */
    int hook_pass;
    const double *other_cores;         /* by mode: other processes' CPU (-1 unknown) */
    const tdm_cmp_sweep_point *sweep;
    int n_sweep;
} tdm_cmp_report;

/* The whole document into f (TDM_STATUS_IO when a write failed). */
tdm_status tdm_cmp_write_json(FILE *f, const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                              const tdm_cmp_report *rep);

tdm_status tdm_cmp_write_json_file(const char *path, const tdm_cmp_opts *o,
                                   tdm_cmp_result *const *res, int n, const tdm_cmp_report *rep);
/* path replaced atomically (core/safefile.h) by what body writes; a
 * failure is said as "<tool>: --json <path>: why". */
tdm_status tdm_json_write_file(const char *path, const char *tool,
                               tdm_status (*body)(FILE *f, const void *ctx), const void *ctx);

#endif
