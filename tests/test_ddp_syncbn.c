/* tests/test_ddp_syncbn.c: SyncBatchNorm (tdm_ddp_opts.sync_bn,
 * tdm_model_set_sync_bn): DDP's CNN on 1..4 ranks, even and uneven
 * shares of the global batch, equals one device on the whole batch with
 * the MLP's tolerance (losses, gradients, parameters and the running
 * statistics, which follow the parameters through every step). Without
 * sync_bn the same check fails (each rank normalises with its own
 * shard's statistics). A rank without samples (a short last batch) takes
 * part with zero sums and a count of 0. */
#include <criterion/criterion.h>

#include "tests/test_ddp_util.h"

static tdm_dataset g_data;
static void setup(void) { cr_assert_eq(tddp_data(&g_data, 1, 1024), TDM_STATUS_OK); }
static void teardown(void) { tdm_data_free(&g_data); }
TestSuite(ddp_syncbn, .init = setup, .fini = teardown, .timeout = 180);

static const tddp_tol mlp_tol = {.loss_atol = 1e-5, .loss_rtol = 1e-4, .grad_atol = 1e-5,
                                 .grad_rtol = 1e-4, .param_atol = 1e-4, .param_rtol = 1e-3};

Test(ddp_syncbn, cnn_equals_one_device_on_the_whole_batch)
{
    for (int w = 1; w <= 4; w++) {
        tddp_cfg c = tddp_cfg_default();
        c.cnn = 1;
        c.sync_bn = 1;
        c.batch = w == 3 ? 23 : 24;   /* 3 ranks: shares of 7, 8, 8 */
        c.steps = 5;
        c.cap_bytes = 256;            /* buckets launched while backward runs */
        tddp_check_equiv(&c, &g_data, w, 60000, mlp_tol);
    }
}

/* The control: without sync_bn the per-shard statistics differ from the
 * whole batch's, far beyond the tolerance. */
Test(ddp_syncbn, without_it_the_cnn_differs)
{
    tddp_shared *sh = tddp_shared_new();
    cr_assert(sh);
    tddp_cfg c = tddp_cfg_default();
    c.cnn = 1;
    c.steps = 1;
    static float ref_g[TDDP_MAX_ELEMS];
    double ref_loss[1];
    int64_t n = 0;
    cr_assert_eq(tddp_reference(&c, &g_data, ref_loss, ref_g, NULL, &n), TDM_STATUS_OK);
    cr_assert_eq(tddp_spawn(2, &c, &g_data, sh, 60000), TDM_STATUS_OK, "%s", sh->err[0]);
    cr_assert(tddp_excess(sh->grads0, ref_g, n, mlp_tol.grad_atol, mlp_tol.grad_rtol, NULL) > 0,
              "per-rank batchnorm matched the whole batch's: the check cannot fail");
    tddp_shared_free(sh);
}

/* A short last global batch leaves a rank without samples: as PyTorch's
 * SyncBatchNorm, that rank still takes part in every statistics sum with
 * zero sums and a count of 0 (it failed: "rank 0 has no samples in this
 * step" and the group stopped). Batch 2 on 3 ranks: rank 0 has none in
 * every step, and the group equals one device on the 2 samples. */
Test(ddp_syncbn, a_rank_without_samples_takes_part_and_equals_one_device)
{
    tddp_cfg c = tddp_cfg_default();
    c.cnn = 1;
    c.sync_bn = 1;
    c.batch = 2;   /* 3 ranks: shares of 0, 1, 1 */
    c.steps = 3;
    c.cap_bytes = 256;   /* buckets launched between the statistics sums */
    tddp_check_equiv(&c, &g_data, 3, 60000, mlp_tol);
}

/* On accelerators the statistics are staged through the host: the same
 * check on emulated CUDA devices (host memory behind the device
 * interface, copies through copy_to_host/copy_from_host), where cuda/ is
 * built. */
__attribute__((weak)) tdm_status tdm_cuda_emulator_open_accel(tdm_device **out, int index);

static tdm_status open_emu(tdm_device **out, int rank)
{
    return tdm_cuda_emulator_open_accel(out, rank);
}

Test(ddp_syncbn, staged_through_the_host_on_emulated_accelerators)
{
    if (!tdm_cuda_emulator_open_accel) cr_skip_test("cuda/ not built");
    for (int w = 1; w <= 3; w += 2) {
        tddp_cfg c = tddp_cfg_default();
        c.cnn = 1;
        c.sync_bn = 1;
        c.batch = 23;
        c.steps = 3;
        c.open_dev = open_emu;
        tddp_check_equiv(&c, &g_data, w, 60000, mlp_tol);
    }
}
