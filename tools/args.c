/* tools/args.c: flag values, strictly parsed (see tools/args.h). */
#include "tools/args.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static tdm_status tdm_args_bad(const char *fmt, const char *flag, const char *val)
{
    fprintf(stderr, fmt, flag, val);
    return TDM_STATUS_USAGE;
}

static tdm_status tdm_args_missing(const char *flag)
{
    fprintf(stderr, "tandem: %s needs a value\n", flag);
    return TDM_STATUS_USAGE;
}

tdm_status tdm_args_int(const char *flag, const char *val, long long lo, long long hi,
                        long long *out)
{
    char *end;
    if (!val || !*val) return tdm_args_missing(flag);
    errno = 0;
    long long v = strtoll(val, &end, 10);
    if (errno || end == val || *end)
        return tdm_args_bad("tandem: %s: '%s' is not an integer\n", flag, val);
    if (v < lo || v > hi) {
        fprintf(stderr, "tandem: %s: %lld is out of range [%lld, %lld]\n", flag, v, lo, hi);
        return TDM_STATUS_USAGE;
    }
    *out = v;
    return TDM_STATUS_OK;
}

tdm_status tdm_args_float(const char *flag, const char *val, double lo, double hi, double *out)
{
    char *end;
    if (!val || !*val) return tdm_args_missing(flag);
    errno = 0;
    double v = strtod(val, &end);
    if (errno || end == val || *end || !isfinite(v))
        return tdm_args_bad("tandem: %s: '%s' is not a finite number\n", flag, val);
    if (v < lo || v > hi) {
        fprintf(stderr, "tandem: %s: %g is out of range [%g, %g]\n", flag, v, lo, hi);
        return TDM_STATUS_USAGE;
    }
    *out = v;
    return TDM_STATUS_OK;
}

tdm_status tdm_args_value(int argc, char **argv, int *i, const char *flag, const char **v)
{
    const char *a = argv[*i];
    size_t n = strlen(flag);
    *v = NULL;
    if (strncmp(a, flag, n)) return TDM_STATUS_OK;
    if (a[n] == '=') *v = a + n + 1;
    else if (a[n] != '\0') return TDM_STATUS_OK;
    else if (*i + 1 < argc) *v = argv[++*i];
    if (!*v || !**v) {
        *v = NULL;
        return tdm_args_missing(flag);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_args_value2(int argc, char **argv, int *i, const char *flag, const char *lflag,
                           const char **v)
{
    TDM_CHECK(tdm_args_value(argc, argv, i, flag, v));
    if (*v) return TDM_STATUS_OK;
    return tdm_args_value(argc, argv, i, lflag, v);
}
