/* tools/tools.h: the subcommands of the tandem CLI, one *_main per
 * subcommand, each in its own file under tools/ (tools/tandem.c
 * dispatches on argv[1]), and the return convention they share. Only
 * tools/ prints to the user or calls exit().
 *
 * The convention: every helper under tools/ returns a tdm_status, having
 * said on stderr what failed; a value from the command line that cannot
 * work is TDM_STATUS_USAGE. A subcommand's *_main (and a forked rank's
 * function, whose return is its process's exit code) ends with
 * tdm_tool_exit(st), the one place where a status becomes an exit code. */
#ifndef TDM_TOOLS_H
#define TDM_TOOLS_H

#include "core/status.h"

/* The exit code of a status: TDM_STATUS_OK 0; TDM_STATUS_USAGE 2 (bad
 * usage); anything else 1 (a runtime failure, including no such device).
 * compare adds 3 (the equivalence verdict failed), launch 128+S (stopped
 * by signal S, forwarded to the ranks): verdicts, not statuses. */
int tdm_tool_exit(tdm_status st);
/* --powersgd-rank's default in train and compare: 4, not PyTorch's 1.
 * Measured (compare --comm-hook powersgd, mlp 784-1024-1024-10, SGD lr
 * 0.05 momentum 0.9, start step 10): rank 1 does not track float32 DDP
 * (loss 1.013 vs 0.662 after 30 steps, 0.779 vs 0.323 after 100, rising
 * after the switch), rank 2 trails (0.774, 0.467), rank 4 follows (0.721,
 * 0.343). docs/DDP_OPTIONS.md. */
#define TDM_POWERSGD_DEFAULT_RANK 4

/* "0.1.0 (git revision)": `tandem --version` and `tandem info` */
const char *tdm_tool_version(void);
/* st, a failure made TDM_STATUS_USAGE: the library refused a value that
 * came from the command line (its message is kept). */
tdm_status tdm_tool_usage(tdm_status st);
/* Prints the formatted line to stderr and returns TDM_STATUS_USAGE. */
tdm_status tdm_tool_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The TANDEM_* variables that hold a number or a directory
 * (tools/env_check.c), checked before any command runs: USAGE, after one
 * line "<tool>: NAME='value' ..." saying the rule, for a value the library
 * would otherwise replace by its default or ignore. */
tdm_status tdm_tool_check_env(const char *tool);

/* Each returns the process exit code (tdm_tool_exit and the verdicts above). */
int tdm_tool_train_main(int argc, char **argv);   /* tools/train.c */
int tdm_tool_sample_main(int argc, char **argv);  /* tools/sample.c */
int tdm_tool_eval_main(int argc, char **argv);    /* tools/eval.c */
int tdm_tool_compare_main(int argc, char **argv); /* tools/compare.c */
int tdm_tool_launch_main(int argc, char **argv);  /* tools/elastic.c: restarts around launch.c */
int tdm_tool_bench_main(int argc, char **argv);   /* tools/bench.c: every benchmark */
int tdm_tool_info_main(int argc, char **argv);    /* tools/info.c */
int tdm_tool_plan_main(int argc, char **argv);    /* tools/plan.c */
int tdm_tool_doctor_main(int argc, char **argv);  /* tools/doctor.c: exit code = verdict */
int tdm_tool_selftest_main(int argc, char **argv);/* tools/selftest.c */

#endif
