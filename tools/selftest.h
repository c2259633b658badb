/* tools/selftest.h: what the parts of `tandem selftest` share
 * (tools/selftest.c: the cases, the runner and the report;
 * tools/selftest_coll.c: the collectives check; tools/selftest_runs.c:
 * the checks that run this binary: compare, checkpoint, a killed rank,
 * throughput). Internal to the tool. */
#ifndef TDM_TOOLS_SELFTEST_H
#define TDM_TOOLS_SELFTEST_H

#include <stddef.h>

#include "core/device.h"

#define TDM_ST_MAX_CASES 16
#define TDM_ST_OUT_MAX (1 << 16)
#define TDM_ST_EXIT_NOTHING_CHECKED 77

typedef struct tdm_st_case {
    const char *name;
    int failed, skipped;
    double secs;
    char figures[512];
    char message[1024];
} tdm_st_case;

typedef struct tdm_st {
    const char *device, *self, *baseline, *save_baseline;
    const char *only;       /* --only: comma-separated checks (NULL: all) */
    char tmp[256];
    int quick, world, cuda;
    tdm_device_list dl;   /* --device, parsed */
    tdm_st_case c[TDM_ST_MAX_CASES];
    int n;
    double samples_per_s;   /* the throughput check's median */
    double spread;          /* its windows' (max - min) / median */
} tdm_st;

/* Optional: the moments (seconds since the start) at which two strings
 * first appeared in the output; < 0 when they did not. */
typedef struct tdm_st_marks {
    const char *a, *b;
    double at_a, at_b;
} tdm_st_marks;

/* The throughput gate's windows, model and tolerance (the usage text
 * states them; tools/selftest_runs.c says how they combine). */
#define TDM_ST_WINDOWS 6
#define TDM_ST_WINDOWS_QUICK 4
#define TDM_ST_WINDOW_SAMPLES "16384"
#define TDM_ST_WINDOW_MODEL "mlp:784-256-10"
#define TDM_ST_TOL_FLOOR 0.15
#define TDM_ST_TOL_SPREAD_K 2.0
#define TDM_ST_TOL_MAX 0.40

/* A case begins (its name printed), ends (its seconds), fails (the first
 * reason stands), is skipped (the reason), adds to its figures. */
tdm_st_case *tdm_st_begin(tdm_st *t, const char *name);
void tdm_st_end(tdm_st_case *c);
void tdm_st_fail(tdm_st_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void tdm_st_skip(tdm_st_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void tdm_st_fig(tdm_st_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Runs this binary with args (NULL-terminated) and env (NAME=VALUE
 * strings, NULL-terminated; may be NULL), output captured into out,
 * killed after secs. Returns the exit code, 128+S for a signal, -1 when
 * it could not run, 124 when it ran past the bound. */
int tdm_st_exec_marked(const tdm_st *t, int secs, const char *const *env, char *out, size_t cap,
                       double *elapsed, tdm_st_marks *marks, const char *const *args);
int tdm_st_exec(const tdm_st *t, int secs, const char *const *env, char *out, size_t cap,
                double *elapsed, const char *const *args);
/* The last line of out that contains key (for messages). */
void tdm_st_line(const char *out, const char *key, char *dst, size_t n);

/* The checks (tools/selftest_coll.c, tools/selftest_runs.c). */
void tdm_st_collectives(tdm_st *t);
void tdm_st_compare(tdm_st *t);
void tdm_st_checkpoint(tdm_st *t);
void tdm_st_killed_rank(tdm_st *t);
void tdm_st_throughput(tdm_st *t);

#endif
