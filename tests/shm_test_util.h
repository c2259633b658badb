/* tests/shm_test_util.h: helpers for the shm communicator tests (defined
 * in tests/shm_test_util.c). Input values are small integers, so that
 * every reduction is exact in every dtype and results can be compared
 * with ==; the reference is computed there, independently of
 * shm/kernels.c. They run inside forked ranks: they report with fprintf,
 * never cr_assert. */
#ifndef TDM_TESTS_SHM_TEST_UTIL_H
#define TDM_TESTS_SHM_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"

/* Value of element j on rank r for op (exact sums/products in float32). */
int64_t shm_t_val(size_t j, int r, tdm_redop op, unsigned salt);
/* buf[i] = v in dtype dt. */
void shm_t_store(void *buf, size_t i, tdm_dtype dt, int64_t v);
/* 1 when buf[i] equals the value v would have after reduction op over
 * world ranks (v is the exact integer SUM/PROD/MIN/MAX result). */
int shm_t_equal(const void *buf, size_t i, tdm_dtype dt, tdm_redop op, int64_t v, int world);
/* Exact reduction of shm_t_val(j, 0..world-1) (AVG: the sum). */
int64_t shm_t_ref(size_t j, int world, tdm_redop op, unsigned salt);

typedef struct shm_t_case {
    tdm_coll coll;
    tdm_dtype dtype;
    tdm_redop op;
    size_t count;
    int root;
    int inplace;
    unsigned salt;
} shm_t_case;

/* The reduction ops one matrix size runs: every op (op_count 5, first 0),
 * or, when TANDEM_TEST_MATRIX=rotate-ops (make asan and make tsan set it),
 * one op per size, rotating with the size's and dtype's index, so every
 * op's kernel still runs on every dtype and every size class is hit, at a
 * fifth of the cases. The sanitizers look for memory errors and races,
 * which depend on the sizes and the algorithm, not on which of the
 * element-wise ops a kernel applies; `make test` runs every op on every
 * size. */
void shm_t_matrix_ops(int all_ops, size_t size_index, int dtype, int *first, int *op_count);

/* "all_reduce(float32, op=sum, count=7, root=0, in-place)" */
void shm_t_case_str(const shm_t_case *k, char *out, size_t n);
/* Runs one collective on this rank and checks its result against the
 * reference. Returns 0 when right; prints the first wrong element. */
int shm_t_run_case(tdm_comm *comm, const shm_t_case *k);

/* --- leaked segments ------------------------------------------------------
 * A segment is a memfd ("memfd:tandem-shm") or an unlinked file in
 * opts.shm_dir: it never has a name in /dev/shm, so counting names there
 * proves nothing. What can leak is a process that still holds it: this
 * process (a group never freed) or a descendant (a rank, or a rank's own
 * child, left running). shm_t_segments_held() counts the descriptors and
 * mappings of segments held by this process and its live descendants.
 * Call shm_t_adopt_orphans() before starting the job: a leaked grandchild
 * whose parent exited is then re-parented to this process (a child
 * subreaper) instead of init, and stays countable. */

void shm_t_adopt_orphans(void);
/* Segment descriptors and mappings held by this process and every live
 * descendant. 0 after a job means nothing of it was leaked. */
int shm_t_segments_held(void);

#endif
