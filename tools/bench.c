/* tools/bench.c: `tandem bench`, the one dispatcher of the benchmarks:
 * `bench gemm`, `bench train` and `bench dp` by name, and every other
 * first argument (a collective, an option, --help) to the collective
 * benchmark, whose usage names the others. */
#include <string.h>

#include "tools/bench.h"
#include "tools/tools.h"

int tdm_tool_bench_main(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*fn)(int, char **);
    } named[] = {
        {"gemm", tdm_bench_gemm_main},
        {"train", tdm_bench_train_main},
        {"dp", tdm_bench_dp_main},
        {"rpc", tdm_bench_rpc_main},
    };
    for (size_t i = 0; argc > 1 && i < sizeof named / sizeof named[0]; i++)
        if (!strcmp(argv[1], named[i].name)) return named[i].fn(argc - 1, argv + 1);
    return tdm_bench_coll_main(argc, argv);
}
