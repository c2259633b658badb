/* tests/test_det_gpu.c: --deterministic K's one-GPU kit test, through the
 * library (the CLI refuses a device named twice): one rank, and two DDP
 * ranks sharing the same device, each training with dist/det.h's step
 * over DDP's ops, write the same checkpoint bytes. On a real GPU the two
 * ranks share GPU 0 over NCCL (told they are different hosts,
 * cu_rank_gpu) with the tree over the shm group; the cuda_emu twin runs
 * the same code on the CUDA emulator (its collectives over shm), so that
 * it runs on every machine. The GPU test skips, saying why, where there is
 * no GPU; cuda/test-gpu.sh and the GPU bundle run it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "cuda/cuda_weak.h"
#include "ddp/ddp.h"
#include "dist/det.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

#define DG_K 8
#define DG_BATCH 32
#define DG_STEPS 6

typedef struct dg_arg {
    int ngpu;                 /* 0: the emulator */
    const char *model;
    char path[256];           /* rank 0's checkpoint */
} dg_arg;

static const char *dg_aborted(void *ctx) { return tdm_shm_comm_abort_reason(ctx); }

/* The inputs and labels of step `step`: the same on every rank and run. */
static void dg_batch(float *x, int32_t *y, int in, int step)
{
    uint32_t s = 2166136261u ^ (uint32_t)step;
    for (int i = 0; i < DG_BATCH; i++) {
        for (int j = 0; j < in; j++) {
            s = s * 1664525u + 1013904223u;
            x[i * in + j] = (float)(s >> 8) / 16777216.0f - 0.5f;
        }
        y[i] = (int32_t)((s >> 4) % 10);
    }
}

#define DG_TRY(expr)                                                                     \
    do {                                                                                \
        if ((st = (expr)) != TDM_STATUS_OK) {                                           \
            fprintf(stderr, "rank %d: %s: %s\n", rank, #expr, tdm_error_message());      \
            goto done;                                                                  \
        }                                                                               \
    } while (0)

/* One rank: its device (GPU 0, or emulated device 0: every rank the same
 * one), DDP over NCCL (the emulator: over the shm group), the tree over
 * the shm group, DG_STEPS steps, rank 0's checkpoint. */
static int dg_rank(tdm_comm *boot, void *arg)
{
    const dg_arg *a = arg;
    int rank = tdm_comm_rank(boot), world = tdm_comm_size(boot);
    tdm_status st = TDM_STATUS_OK;
    tdm_device *d = NULL;
    tdm_comm *c = NULL;
    tdm_model *m = NULL;
    tdm_ddp *ddp = NULL;
    tdm_optim *opt = NULL;
    tdm_dist_det det = {0};
    float *x = NULL;
    int32_t *y = NULL;
    if (a->ngpu == 0) {
        c = boot;
        DG_TRY(tdm_cuda_emulator_open_accel(&d, 0));
    } else {
        int gpu = cu_rank_gpu(rank, world, 1);   /* every rank on GPU 0 */
        DG_TRY(tdm_device_open(&d, "cuda", gpu, 0));
        tdm_nccl_opts no = {.timeout_ms = 120000, .abort_check = dg_aborted, .abort_ctx = boot};
        DG_TRY(tdm_comm_init_nccl_opts(&c, boot, gpu, &no));
    }
    tdm_model_spec spec;
    DG_TRY(tdm_model_spec_parse(&spec, a->model));
    DG_TRY(tdm_model_init(&m, d, &spec, 1));
    tdm_ddp_opts dopt = {.host_comm = c != boot ? boot : NULL};
    DG_TRY(tdm_ddp_init(&ddp, m, c, &dopt));
    tdm_optim_opts oo;
    tdm_optim_opts_named(&oo, "adamw", 1e-3, 0.01, 0.9, 0);
    DG_TRY(tdm_optim_init(&opt, m, &oo));
    int in = (int)tdm_model_in_features(m);
    tdm_dist_stepper s = {.ops = &tdm_ddp_dist_ops, .w = ddp, .opt = opt, .comm = boot,
                          .rank = rank, .world = world, .in_elems = in, .out_rows = 1};
    det = (tdm_dist_det){.ops = tdm_dist_det_stepper_ops(&s), .ctx = &s, .m = m,
                         .comm = world > 1 ? boot : NULL, .rank = rank, .world = world,
                         .K = DG_K, .in_elems = in, .out_rows = 1};
    DG_TRY(tdm_dist_det_init(&det));
    x = malloc((size_t)DG_BATCH * (size_t)in * sizeof *x);
    y = malloc(DG_BATCH * sizeof *y);
    if (!x || !y) {
        st = TDM_STATUS_OUT_OF_MEMORY;
        goto done;
    }
    for (int k = 0; k < DG_STEPS; k++) {
        double loss = 0.0;
        dg_batch(x, y, in, k);
        DG_TRY(tdm_dist_det_step(&det, x, y, DG_BATCH, &loss));
    }
    if (rank == 0) DG_TRY(tdm_checkpoint_save(a->path, m, opt, NULL));
done:
    free(x);
    free(y);
    tdm_dist_det_free(&det);
    tdm_optim_free(opt);
    tdm_ddp_free(ddp);
    tdm_model_free(m);
    if (c && c != boot) tdm_comm_free(c);
    tdm_device_free(d);
    return st == TDM_STATUS_OK ? 0 : 1;
}

/* One rank, then two on the same device: the same checkpoint bytes. */
static void dg_one_vs_two(int ngpu, const char *model)
{
    char dir[64];
    tu_mkdtemp(dir, sizeof dir, "detgpu");
    dg_arg one = {.ngpu = ngpu, .model = model}, two = one;
    snprintf(one.path, sizeof one.path, "%s/one.safetensors", dir);
    snprintf(two.path, sizeof two.path, "%s/two.safetensors", dir);
    tdm_shm_spawn_opts so = {.timeout_ms = 240000};
    cr_assert_eq(tdm_shm_spawn(1, dg_rank, &one, &so, NULL), TDM_STATUS_OK, "one rank: %s",
                 tdm_error_message());
    cr_assert_eq(tdm_shm_spawn(2, dg_rank, &two, &so, NULL), TDM_STATUS_OK, "two ranks: %s",
                 tdm_error_message());
    cr_assert(cli_same_file(one.path, two.path), "%s, %s: two ranks on one device differ from "
              "one rank with --deterministic %d", model, ngpu ? "GPU 0 over NCCL" : "emulator",
              DG_K);
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
    tu_rmtree(dir);
}

Test(cuda_gpu, det_two_nccl_ranks_on_one_gpu_same_bytes, .timeout = 600)
{
    NEED_GPUS(1);
    dg_one_vs_two(1, "mlp:784-24-10");
    dg_one_vs_two(1, "cnn");
}

Test(cuda_emu, det_two_ranks_on_one_emulated_device_same_bytes, .timeout = 300)
{
    CU_NEED_BACKEND();
    dg_one_vs_two(0, "mlp:784-24-10");
    dg_one_vs_two(0, "cnn");
}

/* The tree's top on the device (dist/det.h's dev_comm: NCCL on a GPU,
 * where it is the default), forced on host devices and on the emulator
 * by the test hook TANDEM_TEST_DET_DEV_COMM=1, in chunks that split the
 * losses' chunk: the bytes of the host path's one device. */
static void dg_dev_path(const char *device, const char *mode, const char *ref, const char *path)
{
    static cli_result r;
#define DEV_ARGS "--model", "cnn", "--data", "synthetic", "--synthetic-size", "1200", "--batch", \
                 "16", "--deterministic", "8", "--epochs", "1", "--max-steps", "6", "--no-eval", \
                 "--quiet"
    unsetenv("TANDEM_TEST_DET_DEV_COMM");
    CLI(&r, "train", "--device", device, DEV_ARGS, "--save", ref);
    expect(&r, 0, "epoch 1/1");
    setenv("TANDEM_TEST_DET_DEV_COMM", "1", 1);
    setenv("TANDEM_TEST_DET_CHUNK_ELEMS", "100000", 1);
    CLI(&r, "train", "--mode", mode, "--device", device[0] == 'c' && device[1] == 'p'
                                                      ? "cpu:2" : "cuda:0,1",
        DEV_ARGS, "--save", path);
    unsetenv("TANDEM_TEST_DET_DEV_COMM");
    unsetenv("TANDEM_TEST_DET_CHUNK_ELEMS");
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(ref, path), "%s %s: the tree's top on the device differs from one "
              "device's", mode, device);
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
#undef DEV_ARGS
}

Test(cuda_emu, det_tree_top_on_the_device_same_bytes, .timeout = 300)
{
    CU_NEED_BACKEND();
    char dir[64], ref[128], path[128];
    tu_mkdtemp(dir, sizeof dir, "detdev");
    snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
    snprintf(path, sizeof path, "%s/dev.safetensors", dir);
    dg_dev_path("cpu", "ddp", ref, path);
    dg_dev_path("cpu", "fsdp", ref, path);
    setenv("TANDEM_CUDA_EMULATOR", "2", 1);
    dg_dev_path("cuda", "ddp", ref, path);
    unsetenv("TANDEM_CUDA_EMULATOR");
    tu_rmtree(dir);
}

/* The same for the dp dimension of a mesh: a pipeline's replicas against
 * one device, tensor parallelism's against its group alone. */
Test(cuda_emu, det_mesh_tree_top_on_the_device_same_bytes, .timeout = 300)
{
    static cli_result r;
    char dir[64], ref[128], path[128];
    tu_mkdtemp(dir, sizeof dir, "detdevm");
    snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
    snprintf(path, sizeof path, "%s/dev.safetensors", dir);
#define MESH_ARGS "--model", "mlp:784-24-10", "--data", "synthetic", "--synthetic-size", "1200", \
                  "--batch", "32", "--deterministic", "8", "--epochs", "1", "--max-steps", "6", \
                  "--no-eval", "--quiet"
    CLI(&r, "train", MESH_ARGS, "--save", ref);
    expect(&r, 0, "epoch 1/1");
    setenv("TANDEM_TEST_DET_DEV_COMM", "1", 1);
    CLI(&r, "train", "--mode", "pp", "--device", "cpu:4", "--mesh", "dp=2,pp=2", MESH_ARGS,
        "--save", path);
    unsetenv("TANDEM_TEST_DET_DEV_COMM");
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(ref, path), "pp 2 x 2: the tree's top on the device differs");
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:2", MESH_ARGS, "--save", ref);
    expect(&r, 0, "epoch 1/1");
    setenv("TANDEM_TEST_DET_DEV_COMM", "1", 1);
    CLI(&r, "train", "--mode", "tp", "--device", "cpu:4", "--mesh", "dp=2,tp=2", MESH_ARGS,
        "--save", path);
    unsetenv("TANDEM_TEST_DET_DEV_COMM");
    expect(&r, 0, "epoch 1/1");
    cr_assert(cli_same_file(ref, path), "tp dp=2,tp=2: the tree's top on the device differs");
    cr_assert_eq(cli_shm_entries(), 0, "shared memory left behind");
#undef MESH_ARGS
    tu_rmtree(dir);
}
