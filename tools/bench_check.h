/* tools/bench_check.h: the #wrong check of `tandem bench <collective>`:
 * the reference inputs (rank r's element j) and whether one output
 * element is the reduction of them. Header-only (static inline) so that
 * tests/test_bench_cuda.c tests the check itself, outside a benchmark. */
#ifndef TDM_TOOLS_BENCH_CHECK_H
#define TDM_TOOLS_BENCH_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"

/* Reference values: small integers, exact in every dtype (as in tests). */
static inline int64_t tdm_bench_ref_val(size_t j, int r, tdm_redop op)
{
    switch (op) {
    case TDM_REDOP_PROD: return (j + (size_t)r) % 3 == 0 ? 2 : 1;
    case TDM_REDOP_MIN: case TDM_REDOP_MAX: return (int64_t)((j * 31 + (size_t)r * 17) % 101) - 50;
    default: return (int64_t)((j * 7 + (size_t)r * 3) % 17) - 8;
    }
}

/* The exact reduction over n ranks of element j (AVG: the sum). */
static inline int64_t tdm_bench_ref(size_t j, int n, tdm_redop op)
{
    int64_t acc = tdm_bench_ref_val(j, 0, op);
    for (int r = 1; r < n; r++) {
        int64_t x = tdm_bench_ref_val(j, r, op);
        if (op == TDM_REDOP_PROD) acc *= x;
        else if (op == TDM_REDOP_MIN) acc = x < acc ? x : acc;
        else if (op == TDM_REDOP_MAX) acc = x > acc ? x : acc;
        else acc += x;
    }
    return acc;
}

/* Element i of b (dtype dt) against v, the exact reduction of the
 * reference inputs, or for AVG over avg_n ranks (avg_n > 0), v / avg_n. */
static inline int tdm_bench_check_equal(const void *b, size_t i, tdm_dtype dt, int64_t v,
                                        int avg_n)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32:
        return ((const float *)b)[i] == (avg_n ? (float)v / (float)avg_n : (float)v);
    case TDM_DTYPE_FLOAT64:
        return ((const double *)b)[i] == (avg_n ? (double)v / (double)avg_n : (double)v);
    case TDM_DTYPE_INT32:
        return ((const int32_t *)b)[i] == (int32_t)(avg_n ? v / avg_n : v);
    case TDM_DTYPE_BFLOAT16: case TDM_DTYPE_FLOAT16: {
        float want = avg_n ? (float)v / (float)avg_n : (float)v;
        return ((const uint16_t *)b)[i] == (dt == TDM_DTYPE_BFLOAT16 ? tdm_f32_to_bf16(want)
                                                                     : tdm_f32_to_f16(want));
    }
    default:
        return ((const int64_t *)b)[i] == (avg_n ? v / avg_n : v);
    }
}

#endif
