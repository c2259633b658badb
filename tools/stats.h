/* tools/stats.h: the one median the subcommands report. */
#ifndef TDM_TOOLS_STATS_H
#define TDM_TOOLS_STATS_H

/* Sorts v[0..n) ascending in place and returns its median (the mean of
 * the middle two when n is even); NAN when n <= 0. */
double tdm_tool_median(double *v, int n);

#endif
