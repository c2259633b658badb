/* tools/args.h: strict parsing of numeric command-line values, shared by
 * the subcommands. Each returns 0 and prints a message naming the flag
 * when the value is not a number or is out of range. */
#ifndef TDM_TOOLS_ARGS_H
#define TDM_TOOLS_ARGS_H

#include <stdint.h>

int tdm_args_int(const char *flag, const char *val, long long lo, long long hi, long long *out);
int tdm_args_float(const char *flag, const char *val, double lo, double hi, double *out);
/* The value of a flag at argv[*i]: "--flag value" or "--flag=value". */
const char *tdm_args_value(int argc, char **argv, int *i, const char *flag);

#endif
