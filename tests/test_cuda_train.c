/* tests/test_cuda_train.c: DataParallel and DDP on CUDA devices, against
 * one host device on the same global batches.
 *
 * - cuda_emu (cuda/ built, no GPU needed): the same runs on the CUDA
 *   emulator opened as an accelerator (tdm_cuda_emulator_open_accel: kind
 *   TDM_DEVICE_CUDA, host memory). DP then takes its accelerator paths:
 *   with every device active, replicate and reduce through the device
 *   group (emulated: host loops where GPUs use NCCL), with fewer, the
 *   per-device replicate through tdm_dev_copy_between (the backend's
 *   copy_peer) and the staged reduce on the output device; copy_to_host of
 *   the loss. DDP takes its input staging and device-side check tail, over
 *   the shm communicator (which can reduce in the emulator's host memory).
 *   What this does not test: CUDA itself, NCCL.
 * - cuda_gpu (one GPU is enough; skipped without, "no CUDA device: ..."):
 *   DP on a GPU and with 2-3 handles on one, DDP over 1-3 forked ranks on
 *   the GPUs there are (sharing one if need be) with an NCCL communicator
 *   bootstrapped over shm, peer copies, compare on the CLI;
 * - cuda_multi (2+ GPUs): DP through the NCCL group.
 * - cuda_nodev (no GPU): `tandem train --mode dp|ddp --device cuda...`
 *   exits 1 with one "no CUDA device: ...; use --device cpu:N" line and
 *   leaves no process or /dev/shm entry behind; so do `tandem compare`
 *   and `tandem bench` with --device cuda.
 *
 * Compiled in every build: cuda/ functions are weak references. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device_impl.h"   /* the backend's table: it has a copy_peer */
#include "cuda/cuda_weak.h"
#include "dp/dp.h"
#include "models/train.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/test_ddp_util.h"
#include "tests/test_util.h"

static tdm_status open_emu(tdm_device **out, int i) { return tdm_cuda_emulator_open_accel(out, i); }
static tdm_status open_gpu(tdm_device **out, int i) { return tdm_device_open(out, "cuda", i, 1); }
/* every handle on the one GPU (or emulated device) 0: DP's copies and
 * reduce across streams and threads, testable on a one-GPU machine */
static tdm_status open_emu_same(tdm_device **out, int i)
{
    (void)i;
    return tdm_cuda_emulator_open_accel(out, 0);
}
static tdm_status open_gpu_same(tdm_device **out, int i)
{
    (void)i;
    return tdm_device_open(out, "cuda", 0, 1);
}

/* ============================== DataParallel ============================== */

/* `steps` SGD (momentum) steps under DP over n devices from `open` and on
 * one host device, same seed, same batches: loss of every step, then the
 * master's gradients and parameters, within (atol, rtol). */
static void dp_vs_host_group(tdm_status (*open)(tdm_device **, int), int n, int cnn, int batch,
                             int steps, double atol, double rtol, int same)
{
    tdm_dp_opts dpo;
    tdm_dp_opts_default(&dpo);
    dpo.allow_same_device = same;
    int group = n > 1 && !same;
    tdm_device *devs[TDM_DP_MAX_DEVICES] = {0}, *hd = NULL;
    tdm_model *m = NULL, *ref = NULL;
    tdm_optim *o = NULL, *oref = NULL;
    tdm_dp *dp = NULL;
    tdm_model_spec spec;
    tdm_dataset data;
    tddp_spec(&spec, cnn);
    cr_assert_eq(tddp_data(&data, cnn, (int64_t)batch * steps), TDM_STATUS_OK);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(open(&devs[i], i), TDM_STATUS_OK, "%s", tdm_error_message());
        cr_assert_eq(tdm_dev_kind(devs[i]), TDM_DEVICE_CUDA, "%s", tdm_dev_name(devs[i]));
    }
    cr_assert_eq(tdm_device_open(&hd, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&ref, hd, &spec, 42), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, devs[0], &spec, 42), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_sgd_init(&oref, ref, 0.05f, 0.9f), TDM_STATUS_OK);
    cr_assert_eq(tdm_sgd_init(&o, m, 0.05f, 0.9f), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_init(&dp, m, devs, n, &dpo), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_dp_uses_device_group(dp), group, "n=%d: device group %s", n,
                 tdm_dp_uses_device_group(dp) ? "used" : "not used");
    int64_t feat = tdm_data_features(&data), np = tdm_model_param_elems(m);
    float *x = malloc((size_t)batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)batch * sizeof *y);
    int64_t *idx = malloc((size_t)batch * sizeof *idx);
    float *g = malloc((size_t)np * sizeof *g), *p = malloc((size_t)np * sizeof *p);
    cr_assert(x && y && idx && g && p);
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < batch; i++) idx[i] = (int64_t)s * batch + i;
        tdm_data_gather(&data, idx, batch, x, y);
        double lref = 0, ldp = 0;
        cr_assert_eq(tdm_model_zero_grad(ref), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_forward_backward(ref, x, y, batch, &lref), TDM_STATUS_OK);
        cr_assert_eq(tdm_optim_step(oref), TDM_STATUS_OK);
        cr_assert_eq(tdm_dp_step(dp, o, x, y, batch, &ldp), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        cr_assert(fabs(ldp - lref) <= atol + rtol * fabs(lref),
                  "n=%d batch=%d step %d: loss %.8f vs host %.8f", n, batch, s, ldp, lref);
    }
    cr_assert_eq(tdm_dev_copy_to_host(devs[0], g, tdm_model_grads(m), (size_t)np * 4),
                 TDM_STATUS_OK);
    cr_assert_eq(tdm_dev_copy_to_host(devs[0], p, tdm_model_params(m), (size_t)np * 4),
                 TDM_STATUS_OK);
    int64_t at = 0;
    double r = tu_tol_ratio(g, tdm_model_grads(ref), np, atol, rtol, &at, NULL);
    cr_assert_leq(r, 1.0, "n=%d batch=%d: grad[%lld] %g vs host %g", n, batch, (long long)at,
                  g[at], tdm_model_grads(ref)[at]);
    r = tu_tol_ratio(p, tdm_model_params(ref), np, atol, rtol, &at, NULL);
    cr_assert_leq(r, 1.0, "n=%d batch=%d: param[%lld] %g vs host %g", n, batch, (long long)at,
                  p[at], tdm_model_params(ref)[at]);
    free(x);
    free(y);
    free(idx);
    free(g);
    free(p);
    tdm_dp_free(dp);
    tdm_optim_free(o);
    tdm_optim_free(oref);
    tdm_model_free(m);
    tdm_model_free(ref);
    tdm_device_free(hd);
    tdm_dp_devices_close(devs, n);
    tdm_data_free(&data);
}

/* DP over n distinct devices uses the device group when n > 1. */
static void dp_vs_host(tdm_status (*open)(tdm_device **, int), int n, int cnn, int batch,
                       int steps, double atol, double rtol)
{
    dp_vs_host_group(open, n, cnn, batch, steps, atol, rtol, 0);
}

Test(cuda_emu, dp_accelerator_paths_match_one_host_device, .timeout = 120)
{
    CU_NEED_BACKEND();
    const int batches[] = {1, 3, 8, 13};
    for (int n = 1; n <= 4; n++)
        for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++)
            dp_vs_host(open_emu, n, 0, batches[b], 2, 1e-5, 1e-4);
    /* a CNN (batchnorm buffers, conv kernels) on one emulated device */
    dp_vs_host(open_emu, 1, 1, 8, 2, 1e-5, 1e-4);
}

/* Two and three handles on one device (tdm_dp_opts.allow_same_device):
 * no device group (NCCL refuses two ranks of a process on one GPU), so
 * the per-device replicate, scatter, gather and staged reduce, each
 * replica's thread on its own handle (its own stream on a GPU). */
static void dp_handles_on_one_device(tdm_status (*open)(tdm_device **, int), double atol,
                                     double rtol)
{
    const int batches[] = {1, 7, 32};
    for (int n = 2; n <= 3; n++)
        for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++)
            dp_vs_host_group(open, n, 0, batches[b], 3, atol, rtol, 1);
}

Test(cuda_emu, dp_handles_on_one_emulated_device_match_one_host_device, .timeout = 120)
{
    CU_NEED_BACKEND();
    dp_handles_on_one_device(open_emu_same, 1e-5, 1e-4);
}

Test(cuda_emu, copy_between_two_emulated_gpus_moves_the_bytes)
{
    CU_NEED_BACKEND();
    tdm_device *a = NULL, *b = NULL, *h = NULL;
    cr_assert_eq(open_emu(&a, 0), TDM_STATUS_OK);
    cr_assert_eq(open_emu(&b, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_device_open(&h, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_not_null(a->ops->copy_peer, "the CUDA backend has a peer copy");
    cr_assert_eq(a->ops, b->ops);
    float *pa = NULL, *pb = NULL;
    cr_assert_eq(tdm_dev_alloc(a, 1000 * sizeof(float), (void **)&pa), TDM_STATUS_OK);
    cr_assert_eq(tdm_dev_alloc(b, 1000 * sizeof(float), (void **)&pb), TDM_STATUS_OK);
    float src[1000], back[1000];
    for (int i = 0; i < 1000; i++) src[i] = (float)i - 0.5f;
    cr_assert_eq(tdm_dev_copy_between(a, pa, h, src, sizeof src), TDM_STATUS_OK);
    memset(pb, 0, 1000 * sizeof(float));
    /* an odd size and offset */
    cr_assert_eq(tdm_dev_copy_between(b, pb + 3, a, pa + 1, 997 * sizeof(float)), TDM_STATUS_OK);
    cr_assert_eq(tdm_dev_copy_between(h, back, b, pb, sizeof back), TDM_STATUS_OK);
    for (int i = 0; i < 3; i++) cr_assert_eq(back[i], 0.0f);
    for (int i = 3; i < 1000; i++) cr_assert_eq(back[i], src[i - 2], "element %d", i);
    tdm_dev_free(a, pa);
    tdm_dev_free(b, pb);
    tdm_device_free(a);
    tdm_device_free(b);
    tdm_device_free(h);
}

/* replicate and reduce over n emulated devices with `active` of them in
 * the step: all active goes through the device group, fewer through the
 * per-device copies and the staged reduce */
static void dp_emu_replicate_reduce(int n, int active)
{
    tdm_device *devs[4] = {0};
    tdm_model *m = NULL;
    tdm_dp *dp = NULL;
    tdm_model_spec spec;
    tddp_spec(&spec, 1);
    for (int i = 0; i < n; i++) cr_assert_eq(open_emu(&devs[i], i), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, devs[0], &spec, 7), TDM_STATUS_OK);
    cr_assert_eq(tdm_dp_init(&dp, m, devs, n, NULL), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert(tdm_dp_uses_device_group(dp));
    int64_t np = tdm_model_param_elems(m), nb = tdm_model_buffer_elems(m);
    cr_assert_gt(nb, 0);
    for (int64_t i = 0; i < np; i++) tdm_model_params(m)[i] = (float)i * 0.25f;
    for (int64_t i = 0; i < nb; i++) tdm_model_buffers(m)[i] = 1.0f + (float)i;
    for (int j = 1; j < n; j++)
        for (int64_t i = 0; i < np; i++) tdm_model_grads(tdm_dp_replica(dp, j))[i] = 3.0f;
    cr_assert_eq(tdm_dp_replicate(dp, active), TDM_STATUS_OK, "%s", tdm_error_message());
    for (int j = 1; j < active; j++) {
        tdm_model *r = tdm_dp_replica(dp, j);
        cr_assert(!memcmp(tdm_model_params(r), tdm_model_params(m), (size_t)np * 4), "replica %d", j);
        cr_assert(!memcmp(tdm_model_buffers(r), tdm_model_buffers(m), (size_t)nb * 4), "replica %d", j);
        for (int64_t i = 0; i < np; i++) cr_assert_eq(tdm_model_grads(r)[i], 0.0f);
    }
    /* reduce: master += each active replica, the idle ones left out */
    for (int64_t i = 0; i < np; i++) tdm_model_grads(m)[i] = 1.0f;
    for (int j = 1; j < n; j++)
        for (int64_t i = 0; i < np; i++)
            tdm_model_grads(tdm_dp_replica(dp, j))[i] = (float)((i + j) % 7);
    cr_assert_eq(tdm_dp_reduce_grads(dp, active), TDM_STATUS_OK, "%s", tdm_error_message());
    for (int64_t i = 0; i < np; i++) {
        float want = 1.0f;
        for (int j = 1; j < active; j++) want += (float)((i + j) % 7);
        cr_assert_eq(tdm_model_grads(m)[i], want, "n=%d active=%d grad[%lld]", n, active,
                     (long long)i);
    }
    tdm_dp_free(dp);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, n);
}

Test(cuda_emu, dp_accelerator_replicate_copies_buffers)
{
    CU_NEED_BACKEND();
    dp_emu_replicate_reduce(2, 2);   /* the device group */
    dp_emu_replicate_reduce(3, 3);
    dp_emu_replicate_reduce(3, 2);   /* copy_peer and the staged reduce */
    dp_emu_replicate_reduce(4, 1);
}

/* Device allocations per training step, through the emulator's
 * accounting: once the first steps have sized every buffer, a step must
 * allocate nothing, on one device or under DP (on a GPU each allocation is
 * a cudaMalloc, and each free a cudaFree that synchronises the device). */
static int64_t allocs_of(tdm_device *const *d, int n)
{
    int64_t a = 0;
    for (int i = 0; i < n; i++) a += tdm_cuda_emulator_allocs(d[i]);
    return a;
}

static void steady_step_allocates_nothing(int ndev, int cnn, int batch)
{
    tdm_device *devs[4] = {0};
    tdm_model *m = NULL;
    tdm_optim *o = NULL;
    tdm_dp *dp = NULL;
    tdm_single single = {0};
    tdm_model_spec spec;
    tdm_dataset data;
    tddp_spec(&spec, cnn);
    const int steps = 5, warm = 2;
    cr_assert_eq(tddp_data(&data, cnn, (int64_t)batch * steps), TDM_STATUS_OK);
    for (int i = 0; i < ndev; i++) cr_assert_eq(open_emu(&devs[i], i), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, devs[0], &spec, 3), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(tdm_sgd_init(&o, m, 0.05f, 0.9f), TDM_STATUS_OK);
    if (ndev > 1) cr_assert_eq(tdm_dp_init(&dp, m, devs, ndev, NULL), TDM_STATUS_OK);
    single.model = m;
    single.opt = o;
    int64_t feat = tdm_data_features(&data), idx[64], before = 0;
    float *x = malloc((size_t)batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)batch * sizeof *y);
    cr_assert(x && y && batch <= 64);
    for (int s = 0; s < steps; s++) {
        if (s == warm) before = allocs_of(devs, ndev);
        for (int i = 0; i < batch; i++) idx[i] = (int64_t)s * batch + i;
        tdm_data_gather(&data, idx, batch, x, y);
        double loss = 0;
        tdm_status st = dp ? tdm_dp_step(dp, o, x, y, batch, &loss)
                           : tdm_single_step(&single, x, y, batch, &loss);
        cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    }
    int64_t after = allocs_of(devs, ndev);
    cr_assert_eq(after, before, "%s on %d emulated device(s), batch %d: %lld device allocations "
                 "in %d steady steps (expected none)", cnn ? "cnn" : "mlp", ndev, batch,
                 (long long)(after - before), steps - warm);
    free(x);
    free(y);
    tdm_single_free(&single);
    tdm_dp_free(dp);
    tdm_optim_free(o);
    tdm_model_free(m);
    tdm_dp_devices_close(devs, ndev);
    tdm_data_free(&data);
}

Test(cuda_emu, a_steady_training_step_allocates_no_device_memory, .timeout = 60)
{
    CU_NEED_BACKEND();
    cr_assert_not_null(tdm_cuda_emulator_allocs);
    steady_step_allocates_nothing(1, 0, 16);
    steady_step_allocates_nothing(1, 1, 8);
    steady_step_allocates_nothing(2, 0, 16);   /* DP, the device group */
    steady_step_allocates_nothing(3, 0, 2);    /* DP, one device idle */
}

/* ================================== DDP =================================== */

static tdm_status ddp_open_emu(tdm_device **out, int rank) { return open_emu(out, rank); }
/* Ranks spread over the GPUs there are (ddp_world ranks over ddp_ngpu
 * GPUs, set before the ranks fork): on one GPU every rank shares it, NCCL
 * told they are different hosts (cu_rank_gpu). ddp_ngpu 0: the emulator,
 * every rank on cuda-emu:0. */
static int ddp_world, ddp_ngpu;
static tdm_status ddp_open_shared(tdm_device **out, int rank)
{
    int dev = cu_rank_gpu(rank, ddp_world, ddp_ngpu);
    return ddp_ngpu ? open_gpu(out, dev) : open_emu(out, dev);
}
static tdm_status ddp_make_nccl(tdm_comm **out, tdm_comm *boot, tdm_device *dev)
{
    tdm_nccl_opts o = {.timeout_ms = 60000};
    return tdm_comm_init_nccl_opts(out, boot, tdm_dev_index(dev), &o);
}

static void ddp_vs_host(int world, int cnn, int batch, int steps,
                        tdm_status (*open)(tdm_device **, int),
                        tdm_status (*make_comm)(tdm_comm **, tdm_comm *, tdm_device *),
                        double atol, double rtol)
{
    tdm_dataset data;
    cr_assert_eq(tddp_data(&data, cnn, cnn ? 1024 : 4096), TDM_STATUS_OK);
    tddp_cfg c = tddp_cfg_default();
    c.cnn = cnn;
    c.batch = batch;
    c.steps = steps;
    c.open_dev = open;
    c.make_comm = make_comm;
    tddp_check_equiv(&c, &data, world, 90000,
                     (tddp_tol){.loss_atol = atol, .loss_rtol = rtol, .grad_atol = atol,
                                .grad_rtol = rtol, .param_atol = atol, .param_rtol = 10 * rtol});
    tdm_data_free(&data);
}

Test(cuda_emu, ddp_accelerator_staging_matches_single_device, .timeout = 120)
{
    CU_NEED_BACKEND();
    for (int w = 1; w <= 3; w++) ddp_vs_host(w, 0, 23, 2, ddp_open_emu, NULL, 1e-6, 1e-4);
    ddp_vs_host(1, 1, 16, 2, ddp_open_emu, NULL, 1e-6, 1e-4);
    /* the one-GPU kit's placement: every rank on device 0 */
    ddp_ngpu = 0;
    for (ddp_world = 2; ddp_world <= 3; ddp_world++)
        ddp_vs_host(ddp_world, 0, 24, 2, ddp_open_shared, NULL, 1e-6, 1e-4);
}

/* ============================ where GPUs exist ============================ */

Test(cuda_gpu, dp_one_gpu_matches_host, .timeout = 300)
{
    NEED_GPUS(1);
    dp_vs_host(open_gpu, 1, 0, 13, 3, 1e-4, 1e-3);
    dp_vs_host(open_gpu, 1, 1, 16, 3, 1e-4, 1e-3);
}

Test(cuda_gpu, dp_handles_on_one_gpu_match_host, .timeout = 300)
{
    NEED_GPUS(1);
    dp_handles_on_one_device(open_gpu_same, 1e-4, 1e-3);
}

Test(cuda_multi, dp_gpus_nccl_group_match_host, .timeout = 300)
{
    NEED_GPUS(2);
    char why[512];
    int ngpu = cu_gpu_count(why, sizeof why);
    const int batches[] = {1, 7, 32};
    for (int n = 2; n <= (ngpu < 4 ? ngpu : 4); n++)
        for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++)
            dp_vs_host(open_gpu, n, 0, batches[b], 3, 1e-4, 1e-3);
}

/* Two and three ranks over NCCL, on the GPUs there are (on one GPU, all
 * sharing it); a CNN on one rank. */
Test(cuda_gpu, ddp_nccl_ranks_match_single_device, .timeout = 300)
{
    NEED_GPUS(1);
    char why[512];
    ddp_ngpu = cu_gpu_count(why, sizeof why);
    for (ddp_world = 2; ddp_world <= 3; ddp_world++) {
        ddp_vs_host(ddp_world, 0, 24, 3, ddp_open_shared, ddp_make_nccl, 1e-4, 1e-3);
        ddp_vs_host(ddp_world, 0, 23, 2, ddp_open_shared, ddp_make_nccl, 1e-4, 1e-3);
    }
    ddp_world = 1;
    ddp_vs_host(1, 1, 16, 3, ddp_open_shared, ddp_make_nccl, 1e-4, 1e-3);
}

/* copy_peer: after work already issued on the source, before work issued
 * on either device afterwards (events both ways, no host wait). Large
 * buffers so that a missing order would show. Between two GPUs, or two
 * handles (streams) on one. */
Test(cuda_gpu, peer_copy_is_ordered_both_ways, .timeout = 120)
{
    NEED_GPUS(1);
    char why[512];
    int ngpu = cu_gpu_count(why, sizeof why);
    tdm_device *a = NULL, *b = NULL;
    cr_assert_eq(open_gpu(&a, 0), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert_eq(open_gpu(&b, ngpu > 1 ? 1 : 0), TDM_STATUS_OK, "%s", tdm_error_message());
    const int64_t n = (int64_t)16 << 20;
    float *pa = NULL, *pb = NULL, *h = malloc((size_t)n * sizeof *h);
    cr_assert_not_null(h);
    cr_assert_eq(tdm_dev_alloc(a, (size_t)n * 4, (void **)&pa), TDM_STATUS_OK);
    cr_assert_eq(tdm_dev_alloc(b, (size_t)n * 4, (void **)&pb), TDM_STATUS_OK);
    for (int64_t i = 0; i < n; i++) h[i] = (float)(i % 1000);
    cr_assert_eq(tdm_dev_copy_from_host(a, pa, h, (size_t)n * 4), TDM_STATUS_OK);
    for (int rep = 0; rep < 3; rep++) {
        cr_assert_eq(tdm_dev_scale(a, n, 2.0f, pa), TDM_STATUS_OK);       /* before: seen */
        cr_assert_eq(tdm_dev_memset_zero(b, pb, (size_t)n * 4), TDM_STATUS_OK);
        cr_assert_eq(tdm_dev_copy_between(b, pb, a, pa, (size_t)n * 4), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        cr_assert_eq(tdm_dev_scale(a, n, 0.5f, pa), TDM_STATUS_OK);       /* after: not seen */
        cr_assert_eq(tdm_dev_copy_to_host(b, h, pb, (size_t)n * 4), TDM_STATUS_OK);
        for (int64_t i = 0; i < n; i++)
            cr_assert_eq(h[i], 2.0f * (float)(i % 1000), "rep %d: [%lld] = %g", rep, (long long)i,
                         h[i]);
        cr_assert_eq(tdm_dev_copy_to_host(a, h, pa, (size_t)n * 4), TDM_STATUS_OK);
        for (int64_t i = 0; i < n; i += 4099) cr_assert_eq(h[i], (float)(i % 1000));
    }
    tdm_dev_free(a, pa);
    tdm_dev_free(b, pb);
    tdm_device_free(a);
    tdm_device_free(b);
    free(h);
}

Test(cuda_gpu, cli_compare_on_gpus_passes, .timeout = 600)
{
    NEED_GPUS(1);
    char why[512];
    int ngpu = cu_gpu_count(why, sizeof why);
    static cli_result r;
    CLI(&r, "compare", "--device", ngpu >= 2 ? "cuda:0,1" : "cuda:0", "--data", "synthetic",
        "--model", "mlp:784-256-10", "--steps", "8", "--warmup", "2", "--batch", "128");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "DDP's gradients over NCCL"), "%s", r.out);
    CLI(&r, "compare", "--device", "cuda:0", "--data", "synthetic", "--model", "cnn",
        "--steps", "4", "--warmup", "1", "--batch", "32");
    expect(&r, 0, "verdict: PASS");
}

/* ========================= CLI, without a GPU ============================= */

/* Parent pid of pid from /proc/pid/stat (0 when gone). */
static pid_t parent_of(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    char state = 0;
    int ppid = 0;
    if (!p || sscanf(p + 1, " %c %d", &state, &ppid) != 2) return 0;
    return (pid_t)ppid;
}

/* Processes still running `tandem ... <marker> ...` below this test
 * process. Others' tandem runs (another test binary of a parallel
 * `make test`, a user's job) are not this test's leftovers; this test's
 * own orphans are still found, since expect_no_device_cli makes it their
 * subreaper. */
static int count_procs_with(const char *marker)
{
    int n = 0;
    pid_t self = getpid();
    DIR *d = opendir("/proc");
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char path[300], buf[4096];
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%s/cmdline", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        for (size_t i = 0; i < len; i++)
            if (!buf[i]) buf[i] = ' ';
        buf[len] = '\0';
        if (!strstr(buf, cli_bin()) || !strstr(buf, marker)) continue;
        pid_t p = (pid_t)atoi(e->d_name);
        for (int depth = 0; p > 1 && depth < 64; depth++) {
            p = parent_of(p);
            if (p == self) {
                n++;
                break;
            }
        }
    }
    closedir(d);
    return n;
}

static void expect_no_device_cli(const char *mode, const char *device)
{
    static cli_result r;
    /* ranks orphaned by the CLI are reparented here, where count_procs_with
     * sees them */
    cr_assert_eq(prctl(PR_SET_CHILD_SUBREAPER, 1), 0, "prctl: %s", strerror(errno));
    int shm0 = cli_shm_entries();
    CLI(&r, "train", "--mode", mode, "--device", device, "--data", "synthetic", "--epochs", "1");
    expect(&r, 1, "no CUDA device: ");
    cr_assert(strstr(r.out, "use --device cpu:N"), "--mode %s: no hint:\n%s", mode, r.out);
    cr_assert(strchr(r.out, '\n') == strrchr(r.out, '\n'), "--mode %s: more than one line:\n%s",
              mode, r.out);
    cr_assert_eq(cli_shm_entries(), shm0, "--mode %s left a /dev/shm entry", mode);
    cr_assert_eq(count_procs_with(device), 0, "--mode %s --device %s left processes", mode,
                 device);
}

Test(cuda_nodev, cli_dp_ddp_compare_bench_on_cuda_fail_with_one_message, .timeout = 60)
{
    char why[512];
    if (cu_gpu_count(why, sizeof why) > 0) cr_skip_test("a CUDA device exists");
    expect_no_device_cli("dp", "cuda:0,1");
    expect_no_device_cli("dp", "cuda");
    expect_no_device_cli("ddp", "cuda");
    expect_no_device_cli("ddp", "cuda:0,1");
    /* compare and bench refuse CUDA devices the same way */
    static cli_result r;
    CLI(&r, "compare", "--device", "cuda:0", "--steps", "2");
    expect(&r, 1, "no CUDA device: ");
    cr_assert(strchr(r.out, '\n') == strrchr(r.out, '\n'), "compare: more than one line:\n%s",
              r.out);
    CLI(&r, "bench", "all_reduce", "--device", "cuda");
    expect(&r, 1, "no CUDA device: ");
    cr_assert(strchr(r.out, '\n') == strrchr(r.out, '\n'), "bench: more than one line:\n%s",
              r.out);
}

/* ================== CLI on emulated GPUs (TANDEM_CUDA_EMULATOR) ============ */

/* The CLI's CUDA code paths (device lists, compare's child processes, DP's
 * device group, DDP's device staging) on emulated devices: host memory,
 * CUDA kernels' code as host loops, DDP over shm where GPUs use NCCL. */
#define NEED_EMULATOR(n)                                                                  \
    do {                                                                                  \
        CU_NEED_BACKEND();                                                                   \
        cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", #n, 1), 0);                          \
    } while (0)

Test(cuda_emu_cli, train_every_mode_on_emulated_gpus, .timeout = 120)
{
    NEED_EMULATOR(2);
    static cli_result r;
    const char *modes[][2] = {{"single", "cuda:1"}, {"dp", "cuda"}, {"ddp", "cuda:0,1"}};
    for (int i = 0; i < 3; i++) {
        CLI(&r, "train", "--mode", modes[i][0], "--device", modes[i][1], "--data", "synthetic",
            "--model", "mlp:784-64-10", "--epochs", "1", "--quiet");
        expect(&r, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)");
        cr_assert(strstr(r.out, "test accuracy"), "%s:\n%s", modes[i][0], r.out);
    }
    CLI(&r, "train", "--mode", "single", "--device", "cuda:1", "--data", "synthetic", "--model",
        "mlp:784-64-10", "--epochs", "1", "--quiet");
    cr_assert(strstr(r.out, "device cuda-emu:1"), "%s", r.out);
    /* a GPU the emulator does not have */
    CLI(&r, "train", "--mode", "dp", "--device", "cuda:0,2", "--data", "synthetic");
    cr_assert_neq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "cuda:2"), "%s", r.out);
}

/* One device from "cuda" means GPU 0, as PyTorch's "cuda" does, also when
 * there are several (the command docs/CUDA.md gives a GPU machine); a
 * list of several GPUs is still refused where one device runs. */
Test(cuda_emu_cli, single_device_cuda_means_gpu_0_on_a_machine_with_two, .timeout = 120)
{
    NEED_EMULATOR(2);
    static cli_result r;
    CLI(&r, "train", "--device", "cuda", "--data", "synthetic", "--model", "mlp:784-32-10",
        "--epochs", "1", "--max-steps", "3", "--no-eval", "--quiet");
    expect(&r, 0, "device cuda-emu:0,");
    CLI(&r, "train", "--mode", "single", "--device", "cuda:0,1", "--data", "synthetic");
    expect(&r, 2, "--mode single uses one device, but 'cuda:0,1' names 2");
    /* bench gemm and bench train share the one-device rule */
    CLI(&r, "bench", "train", "--device", "cuda", "--model", "mlp:784-64-10", "--batch", "32",
        "--steps", "5");
    expect(&r, 0, "one device: cuda-emu:0 (emulated");
}

Test(cuda_emu_cli, compare_on_emulated_gpus_passes_and_catches_a_bad_rank, .timeout = 180)
{
    NEED_EMULATOR(3);
    static cli_result r;
    CLI(&r, "compare", "--device", "cuda:0,2", "--data", "synthetic", "--model", "mlp:784-64-10",
        "--steps", "6", "--warmup", "1", "--batch", "64", "--sweep", "1,2");
    expect(&r, 0, "verdict: PASS");
    cr_assert(strstr(r.out, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=3)"), "%s", r.out);
    cr_assert(strstr(r.out, "one device (cuda-emu:0) vs DP and DDP on 2 GPUs (cuda:0,2"), "%s",
              r.out);
    cr_assert(strstr(r.out, "DP cuda-emu:2"), "memory table names the second GPU:\n%s", r.out);
    cr_assert(strstr(r.out, "Scaling"), "%s", r.out);
    CLI(&r, "compare", "--device", "cuda:0,1", "--data", "synthetic", "--model", "mlp:784-64-10",
        "--steps", "4", "--warmup", "1", "--batch", "64", "--perturb-rank", "1");
    expect(&r, 3, "verdict: FAIL");
    /* a sweep wider than the GPUs listed */
    CLI(&r, "compare", "--device", "cuda:0,1", "--data", "synthetic", "--sweep", "1,3");
    expect(&r, 2, "--sweep 3: --device cuda:0,1 names only 2 GPUs");
}
