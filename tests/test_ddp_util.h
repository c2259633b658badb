/* tests/test_ddp_util.h: shared helpers of the DDP tests: a result area
 * shared with forked ranks (an anonymous MAP_SHARED mapping: no /dev/shm
 * name), small models and data (an MLP, a CNN, or a GPT on text windows),
 * a DDP training run per rank, and the single-device reference.
 * Defined in tests/ddp_test_util.c, compiled once and linked into every
 * test binary. */
#ifndef TDM_TESTS_TEST_DDP_UTIL_H
#define TDM_TESTS_TEST_DDP_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/data.h"
#include "core/device.h"
#include "core/rng.h"
#include "core/text.h"
#include "ddp/ddp.h"
#include "dist/spawn.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

#define TDDP_MAX_ELEMS (1 << 16)
#define TDDP_MAX_STEPS 64
#define TDDP_MAX_BUCKETS 16

typedef struct tddp_cfg {
    int cnn;
    const int *dims;         /* MLP widths (NULL: 20-16-12-5) */
    int ndims;
    int gpt;                 /* a small GPT on text windows (tddp_text) instead */
    int batch;               /* global batch */
    int steps;
    int no_overlap;
    size_t cap_bytes;        /* 0: default caps */
    size_t first_bytes;
    int cap_rank;            /* >= 0: this rank uses rank_cap_bytes instead */
    size_t rank_cap_bytes;
    int no_arena;            /* 1: no zero-copy arena: gradients are copied through the slots */
    int micro;               /* > 1: no_sync over this many micro-batches, then sync */
    int detach_layer;        /* > 0: in step 0, backward stops at this layer (the layers
                                below take no part: their grad-ready hook never fires)... */
    unsigned detach_ranks;   /* ...on these ranks (bit mask)... */
    int detach_micro;        /* ...in this micro-batch (-1: in every one) */
    int find_unused;
    int skip_backward_rank;  /* >= 0: this rank skips the backward of step 1 */
    int bad_layout_rank;     /* >= 0: this rank builds a different model */
    int seed_by_rank;        /* rank r initialises with seed 5 + r (DDP broadcasts rank 0's) */
    /* Optional: rank's device (NULL: cpu:<rank>), e.g. a CUDA emulator or
     * a GPU; and a gradient communicator built over the shm one (NULL: the
     * shm one), e.g. NCCL; the shm one is then DDP's host_comm. */
    tdm_status (*open_dev)(tdm_device **out, int rank);
    tdm_status (*make_comm)(tdm_comm **out, tdm_comm *boot, tdm_device *dev);
    const char *comm_hook;   /* a built-in comm hook (tdm_ddp_set_comm_hook), NULL: none */
    tdm_ddp_powersgd_opts psgd;
    const tdm_ddp_comm_hook *user_hook;   /* registered with tdm_ddp_register_comm_hook */
    int sync_bn;             /* tdm_ddp_opts.sync_bn */
} tddp_cfg;

typedef struct tddp_shared {
    double loss[TDDP_MAX_STEPS];
    float grads0[TDDP_MAX_ELEMS];      /* rank 0's reduced gradients after step 0 */
    float grads0_r1[TDDP_MAX_ELEMS];   /* rank world-1's */
    float params[TDDP_MAX_ELEMS];      /* rank 0's parameters at the end */
    float params_r1[TDDP_MAX_ELEMS];   /* rank world-1's */
    int64_t n_elem;
    int n_buckets;             /* rank 0's plan at the end */
    int plan[TDDP_MAX_BUCKETS][2];     /* its buckets' first and last parameters */
    int plan_r1[TDDP_MAX_BUCKETS][2];  /* rank world-1's */
    int64_t plan_elems[TDDP_MAX_BUCKETS]; /* rank 0's buckets' lengths */
    int nb_step[TDDP_MAX_STEPS];       /* rank 0: buckets reduced by step s's backward */
    double overlapped[TDDP_MAX_STEPS]; /* rank 0: overlapped bytes after step s (cumulative) */
    double reduced[TDDP_MAX_STEPS];    /* rank 0: reduced bytes after step s (cumulative) */
    int zero_copy;
    int64_t timed_steps;       /* rank 0's tdm_ddp_times.steps */
    int launch_order_ok;       /* rank 0: buckets launched in bucket order, after ready */
    int status[8];
    char err[8][512];
} tddp_shared;

tddp_shared *tddp_shared_new(void);
static inline void tddp_shared_free(tddp_shared *s) { if (s) munmap(s, sizeof *s); }

void tddp_spec_dims(tdm_model_spec *s, int cnn, const int *dims, int ndims);

static inline void tddp_spec(tdm_model_spec *s, int cnn) { tddp_spec_dims(s, cnn, NULL, 0); }

/* The GPT's model and text: step s's global batch is windows 0..batch-1 of
 * tdm_text_windows(step s), a rank's share its slice of them. */
#define TDDP_GPT_T 12
static inline void tddp_spec_gpt(tdm_model_spec *s) { tdm_model_spec_gpt(s, 2, 16, 2, TDDP_GPT_T); }

const tdm_text *tddp_text(void);

/* n bytes of words drawn uniformly with the test stream of seed: the
 * made-up texts of the GPT tests (tddp_text, test_fsdp_util.h's tf_text). */
void tddp_word_text(uint8_t *bytes, size_t n, const char *const *words, int n_words,
                    uint64_t seed);

/* Uneven inputs (tests/test_ddp_join.c, tests/test_fsdp_join.c): rank r
 * runs tddp_join_batches[r] batches of tddp_join_size[r] samples (3, 5, 8
 * batches of 4, 6, 5), its batch s being samples tddp_join_first(r, s)
 * onwards. tddp_join_reference: one device (seed 5, SGD lr 0.05 momentum
 * 0.9) where step s accumulates every rank that still has a batch, each
 * scaled by 1/(its batch * the number of such ranks); the parameters
 * after TDDP_JOIN_STEPS steps into out (*n of them). */
#define TDDP_JOIN_WORLD 3
#define TDDP_JOIN_STEPS 8
extern const int tddp_join_batches[TDDP_JOIN_WORLD], tddp_join_size[TDDP_JOIN_WORLD];
int64_t tddp_join_first(int r, int s);
tdm_status tddp_join_reference(const tdm_model_spec *spec, const tdm_dataset *data, float *out,
                               int64_t *n);

tdm_status tddp_data(tdm_dataset *d, int cnn, int64_t n);

typedef struct tddp_run {
    const tddp_cfg *cfg;
    const tdm_dataset *data;
    tddp_shared *sh;
} tddp_run;

/* One rank's training run; records into sh; returns 0 on success. */
int tddp_rank_main(tdm_comm *comm, void *arg);

tdm_status tddp_spawn(int world, const tddp_cfg *cfg, const tdm_dataset *data,
                             tddp_shared *sh, int64_t timeout_ms);

/* Single-device reference: losses, gradients after step 0, final params. */
tdm_status tddp_reference(const tddp_cfg *c, const tdm_dataset *data, double *loss,
                                 float *grads0, float *params, int64_t *n_elem);

/* Largest |a-b| - (atol + rtol|b|) over n; <= 0 means all within. */
double tddp_excess(const float *a, const float *b, int64_t n, double atol, double rtol,
                          int64_t *where);

tddp_cfg tddp_cfg_default(void);

/* Tolerances |a-b| <= atol + rtol |ref| of an equivalence check. */
typedef struct tddp_tol {
    double loss_atol, loss_rtol, grad_atol, grad_rtol, param_atol, param_rtol;
} tddp_tol;

/* DDP over `world` ranks against one device on the same batches (cfg's
 * steps): the loss of every step, rank 0's gradients after the last
 * backward and its final parameters within tol, and every rank holding
 * bitwise the same gradients and parameters. */
/* Not in tests/ddp_test_util.c (which defines TDDP_NO_CRITERION): it
 * asserts, and the TSan build's header-only Criterion stand-in defines
 * main and keeps its state per file. */
#ifndef TDDP_NO_CRITERION
#include <criterion/criterion.h>
static inline void tddp_check_equiv(const tddp_cfg *c, const tdm_dataset *data, int world,
                                    int64_t timeout_ms, tddp_tol tol)
{
    tddp_shared *sh = tddp_shared_new();
    cr_assert(sh);
    double ref_loss[TDDP_MAX_STEPS];
    static float ref_g[TDDP_MAX_ELEMS], ref_p[TDDP_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tddp_reference(c, data, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    tdm_status st = tddp_spawn(world, c, data, sh, timeout_ms);
    cr_assert_eq(st, TDM_STATUS_OK, "world %d batch %d: %s / rank 0: %s / rank 1: %s", world,
                 c->batch, tdm_error_message(), sh->err[0], sh->err[1]);
    cr_assert_eq(sh->n_elem, n);
    for (int s = 0; s < c->steps; s++)
        cr_assert(fabs(sh->loss[s] - ref_loss[s]) <= tol.loss_atol + tol.loss_rtol * fabs(ref_loss[s]),
                  "world %d batch %d step %d: loss %.8f vs one device %.8f", world, c->batch, s,
                  sh->loss[s], ref_loss[s]);
    int64_t at = 0;
    cr_assert(tddp_excess(sh->grads0, ref_g, n, tol.grad_atol, tol.grad_rtol, &at) <= 0,
              "world %d batch %d: grad[%lld] %g vs %g", world, c->batch, (long long)at,
              sh->grads0[at], ref_g[at]);
    cr_assert(tddp_excess(sh->params, ref_p, n, tol.param_atol, tol.param_rtol, &at) <= 0,
              "world %d batch %d: param[%lld] %g vs %g", world, c->batch, (long long)at,
              sh->params[at], ref_p[at]);
    /* every rank holds bitwise the same gradients and parameters */
    cr_assert(world == 1 || !memcmp(sh->grads0, sh->grads0_r1, (size_t)n * 4));
    cr_assert(world == 1 || !memcmp(sh->params, sh->params_r1, (size_t)n * 4));
    tddp_shared_free(sh);
}
#endif

#endif
