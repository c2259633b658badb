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

/* |tdm_bench_ref_val| for SUM and AVG is at most 8. */
#define TDM_BENCH_REF_SUM_MAX_ABS 8

/* Unit roundoff u of a floating-point dtype: a rounding moves a value by
 * at most u times its magnitude. */
static inline double tdm_bench_unit_roundoff(tdm_dtype dt)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT64: return 0x1p-53;
    case TDM_DTYPE_BFLOAT16: return 0x1p-8;
    case TDM_DTYPE_FLOAT16: return 0x1p-11;
    default: return 0x1p-24;
    }
}

/* Whether got is an average of n reference inputs whose exact sum is v,
 * as the op is defined for floating-point data. shm computes the sum
 * (exact for these inputs) divided by n, but NCCL's AVG is PreMulSum:
 * each input times the scalar 1/n rounded to the type, summed in the
 * algorithm's order (NCCL src/enqueue.cc, hostToDevRedOp), so its result
 * is not (float)v / n for n = 3, 5, 6, 7 (where 1/n is inexact). Bound:
 * the scalar and each product add a rounding each (2u |x_i| / n), a sum
 * of n terms in any order n-1 more on partial sums of at most
 * sum|x_i| / n, and storing the result one more (Higham, Accuracy and
 * Stability of Numerical Algorithms, ch. 4): within (n + 2) u sum|x_i|/n,
 * bounded by (n + 3) u * 8. A missing rank or a sum instead of a mean is
 * off by at least 1/n, far outside it. */
static inline int tdm_bench_avg_close(double got, int64_t v, int n, tdm_dtype dt)
{
    double mean = (double)v / n;
    double tol = (double)(n + 3) * tdm_bench_unit_roundoff(dt) * TDM_BENCH_REF_SUM_MAX_ABS;
    double err = got - mean;
    return err <= tol && -err <= tol;
}

/* Element i of b (dtype dt) against v, the exact reduction of the
 * reference inputs, or for AVG over avg_n ranks (avg_n > 0) their mean:
 * the truncated quotient for integers (as both backends define it), the
 * mean within tdm_bench_avg_close's bound for floating-point types. */
static inline int tdm_bench_check_equal(const void *b, size_t i, tdm_dtype dt, int64_t v,
                                        int avg_n)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32:
        if (avg_n) return tdm_bench_avg_close(((const float *)b)[i], v, avg_n, dt);
        return ((const float *)b)[i] == (float)v;
    case TDM_DTYPE_FLOAT64:
        if (avg_n) return tdm_bench_avg_close(((const double *)b)[i], v, avg_n, dt);
        return ((const double *)b)[i] == (double)v;
    case TDM_DTYPE_INT32:
        return ((const int32_t *)b)[i] == (int32_t)(avg_n ? v / avg_n : v);
    case TDM_DTYPE_BFLOAT16: case TDM_DTYPE_FLOAT16: {
        uint16_t h = ((const uint16_t *)b)[i];
        if (avg_n)
            return tdm_bench_avg_close(dt == TDM_DTYPE_BFLOAT16 ? tdm_bf16_to_f32(h)
                                                                : tdm_f16_to_f32(h),
                                       v, avg_n, dt);
        return h == (dt == TDM_DTYPE_BFLOAT16 ? tdm_f32_to_bf16((float)v)
                                              : tdm_f32_to_f16((float)v));
    }
    default:
        return ((const int64_t *)b)[i] == (avg_n ? v / avg_n : v);
    }
}

#endif
