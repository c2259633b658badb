/* tools/bench.h: the benchmarks behind `tandem bench` (tools/bench.c
 * dispatches on its first argument). Each takes the arguments after
 * "bench" (argv[0] is the benchmark's name, or the first option of a
 * collective benchmark) and returns the process exit code. Figures for
 * docs/PERFORMANCE.md and docs/perf/; nothing here is a test. */
#ifndef TDM_TOOLS_BENCH_H
#define TDM_TOOLS_BENCH_H

/* `bench <collective>`: nccl-tests' columns (tools/bench_coll.c). */
int tdm_bench_coll_main(int argc, char **argv);
/* `bench gemm`: the sgemm ceiling of one device (tools/bench_models.c). */
int tdm_bench_gemm_main(int argc, char **argv);
/* `bench train`: single-device training throughput (tools/bench_models.c). */
int tdm_bench_train_main(int argc, char **argv);
/* `bench dp`: one device against DataParallel (tools/bench_dp.c). */
int tdm_bench_dp_main(int argc, char **argv);
/* `bench rpc`: rpc/'s round trip over shm and TCP beside a plain TCP
 * ping-pong (tools/bench_rpc.c). */
int tdm_bench_rpc_main(int argc, char **argv);

#endif
