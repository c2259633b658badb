/* tools/tools.h: the subcommands of the tandem CLI, one *_main per
 * subcommand, each in its own file under tools/. tools/tandem.c
 * dispatches on argv[1]. Only tools/ prints to the user or calls exit(). */
#ifndef TDM_TOOLS_H
#define TDM_TOOLS_H

/* Each returns the process exit code: 0 ok, 1 runtime failure, 2 usage;
 * compare also 3 (equivalence verdict failed), launch 128+S when it was
 * stopped by signal S (forwarded to the ranks). */
int tdm_tool_train_main(int argc, char **argv);   /* tools/train.c */
int tdm_tool_info_main(int argc, char **argv);    /* tools/info.c */
int tdm_tool_bench_main(int argc, char **argv);   /* tools/bench_coll.c */
int tdm_tool_launch_main(int argc, char **argv);  /* tools/launch.c */
/* `bench gemm` and `bench train` (tools/bench_models.c); argv[0] is the kind. */
int tdm_tool_bench_models_main(int argc, char **argv);
/* `bench dp` (tools/bench_dp.c); argv[0] is "dp". */
int tdm_tool_bench_dp_main(int argc, char **argv);
int tdm_tool_compare_main(int argc, char **argv); /* tools/compare.c */
int tdm_tool_sample_main(int argc, char **argv);  /* tools/sample.c */
int tdm_tool_doctor_main(int argc, char **argv);  /* tools/doctor.c: exit code = verdict */
int tdm_tool_selftest_main(int argc, char **argv);/* tools/selftest.c */

#endif
