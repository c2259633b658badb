/* tools/args.h: strict parsing of command-line values, shared by the
 * subcommands. Each function prints a one-line message naming the flag
 * and returns TDM_STATUS_USAGE when the value is missing, not a number or
 * out of range (flags are parsed before anything is allocated). */
#ifndef TDM_TOOLS_ARGS_H
#define TDM_TOOLS_ARGS_H

#include <stdint.h>
#include <string.h>

#include "core/status.h"

tdm_status tdm_args_int(const char *flag, const char *val, long long lo, long long hi,
                        long long *out);
tdm_status tdm_args_float(const char *flag, const char *val, double lo, double hi, double *out);
/* The value of flag at argv[*i]: "--flag value" (*i moves to the value)
 * or "--flag=value"; *v = NULL when argv[*i] is something else. A missing
 * or empty value: "tandem: <flag> needs a value", TDM_STATUS_USAGE. */
tdm_status tdm_args_value(int argc, char **argv, int *i, const char *flag, const char **v);
/* The same for a flag with a short and a long name ("-n", "--nranks"). */
tdm_status tdm_args_value2(int argc, char **argv, int *i, const char *flag, const char *lflag,
                           const char **v);

/* A flag loop's cases (inside `for (i = 1; i < argc; i++)` of a function
 * returning tdm_status, after TDM_ARGS_LOCALS): store the flag's value
 * in dst and go to the next argument, or return the usage status after a
 * one-line message. */
#define TDM_ARGS_LOCALS                                                          \
    const char *v;                                                               \
    long long iv;                                                                \
    double fv;                                                                   \
    (void)iv;                                                                    \
    (void)fv;
/* --help or -h: sets flag and ends the parse (the caller prints the help). */
#define TDM_ARGS_HELP(flag)                                                      \
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {                 \
        flag = 1;                                                                \
        return TDM_STATUS_OK;                                                    \
    }
#define TDM_ARGS_STR(name, dst)                                                  \
    TDM_CHECK(tdm_args_value(argc, argv, &i, name, &v));                         \
    if (v) {                                                                     \
        dst = v;                                                                 \
        continue;                                                                \
    }
#define TDM_ARGS_INT(name, lo, hi, dst)                                          \
    TDM_CHECK(tdm_args_value(argc, argv, &i, name, &v));                         \
    if (v) {                                                                     \
        TDM_CHECK(tdm_args_int(name, v, lo, hi, &iv));                           \
        dst = iv;                                                                \
        continue;                                                                \
    }
#define TDM_ARGS_FLOAT(name, lo, hi, dst)                                        \
    TDM_CHECK(tdm_args_value(argc, argv, &i, name, &v));                         \
    if (v) {                                                                     \
        TDM_CHECK(tdm_args_float(name, v, lo, hi, &fv));                         \
        dst = fv;                                                                \
        continue;                                                                \
    }

#endif
