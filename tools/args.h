/* tools/args.h: strict parsing of numeric command-line values, shared by
 * the subcommands. Each returns 0 and prints a message naming the flag
 * when the value is not a number or is out of range. */
#ifndef TDM_TOOLS_ARGS_H
#define TDM_TOOLS_ARGS_H

#include <stdint.h>

int tdm_args_int(const char *flag, const char *val, long long lo, long long hi, long long *out);
int tdm_args_float(const char *flag, const char *val, double lo, double hi, double *out);
/* The value of a flag at argv[*i]: "--flag value" or "--flag=value";
 * NULL when argv[*i] is another flag. A missing or empty value prints
 * "tandem: <flag> needs a value" and exits 2 (flags are parsed before
 * anything is allocated). */
const char *tdm_args_value(int argc, char **argv, int *i, const char *flag);

/* A flag loop's cases (inside `for (i = 1; i < argc; i++)`, with locals
 * `const char *v; long long iv; double fv;`): store the flag's value in
 * dst and go to the next argument, or return 2 after a one-line message. */
#define TDM_ARGS_STR(name, dst)                                                  \
    if ((v = tdm_args_value(argc, argv, &i, name))) {                            \
        dst = v;                                                                 \
        continue;                                                                \
    }
#define TDM_ARGS_INT(name, lo, hi, dst)                                          \
    if ((v = tdm_args_value(argc, argv, &i, name))) {                            \
        if (!tdm_args_int(name, v, lo, hi, &iv)) return 2;                       \
        dst = iv;                                                                \
        continue;                                                                \
    }
#define TDM_ARGS_FLOAT(name, lo, hi, dst)                                        \
    if ((v = tdm_args_value(argc, argv, &i, name))) {                            \
        if (!tdm_args_float(name, v, lo, hi, &fv)) return 2;                     \
        dst = fv;                                                                \
        continue;                                                                \
    }

#endif
