/* tools/args.c: flag values, strictly parsed. */
#include "tools/args.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tdm_args_int(const char *flag, const char *val, long long lo, long long hi, long long *out)
{
    char *end;
    if (!val || !*val) {
        fprintf(stderr, "tandem: %s needs a value\n", flag);
        return 0;
    }
    errno = 0;
    long long v = strtoll(val, &end, 10);
    if (errno || end == val || *end) {
        fprintf(stderr, "tandem: %s: '%s' is not an integer\n", flag, val);
        return 0;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "tandem: %s: %lld is out of range [%lld, %lld]\n", flag, v, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

int tdm_args_float(const char *flag, const char *val, double lo, double hi, double *out)
{
    char *end;
    if (!val || !*val) {
        fprintf(stderr, "tandem: %s needs a value\n", flag);
        return 0;
    }
    errno = 0;
    double v = strtod(val, &end);
    if (errno || end == val || *end || !isfinite(v)) {
        fprintf(stderr, "tandem: %s: '%s' is not a finite number\n", flag, val);
        return 0;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "tandem: %s: %g is out of range [%g, %g]\n", flag, v, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

const char *tdm_args_value(int argc, char **argv, int *i, const char *flag)
{
    const char *a = argv[*i];
    size_t n = strlen(flag);
    if (strncmp(a, flag, n)) return NULL;
    const char *v = NULL;
    if (a[n] == '=') v = a + n + 1;
    else if (a[n] != '\0') return NULL;
    else if (*i + 1 < argc) v = argv[++*i];
    if (!v || !*v) {
        /* one line and the usage exit code, before anything is allocated */
        fprintf(stderr, "tandem: %s needs a value\n", flag);
        exit(2);
    }
    return v;
}
