/* tests/test_pp_cuda.c: pipeline stages on CUDA devices, through the CUDA
 * emulator (tdm_cuda_emulator_open_accel: kind TDM_DEVICE_CUDA, the CUDA
 * backend's kernels run as host loops, host memory), S = 2..3 stages over
 * shm, against one host device with gradient accumulation over the same
 * micro-batches: the stages take their accelerator paths (inputs and
 * targets staged to the device per micro-batch, receive buffers in device
 * memory, the tied embedding's sum on the device). What this does not
 * test: CUDA itself, NCCL.
 * pp_cuda_gpu (one GPU is enough; skipped without): 2 stages on the GPUs
 * there are (sharing one if need be) over an NCCL communicator
 * bootstrapped over shm, its links made by ncclCommSplit, against one host
 * device. Compiled in every build: cuda/ functions are weak references,
 * and the tests skip without the backend. */
#include <criterion/criterion.h>

#include "cuda/cuda_weak.h"
#include "shm/spawn.h"
#include "tests/cuda_test_util.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/timeout_util.h"

#define B 24
#define STEPS 5
#define M 4

typedef struct emu_arg {
    tpp_out *out;
    tpp_kind kind;
    tdm_pp_schedule_kind sched;
    const float *ref;        /* the parameters after STEPS */
} emu_arg;

static int emu_rank(tdm_comm *comm, void *argp)
{
    emu_arg *a = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(a->kind, &spec);
    int in = tpp_in_features(&spec), rows = tpp_out_rows(&spec), classes = tpp_classes(&spec);
    char *x = malloc((size_t)B * in * 4);
    int32_t *y = malloc((size_t)B * rows * sizeof *y);
    float *host = malloc(TPP_MAX_ELEMS * sizeof *host);
    tdm_pp_opts o = {.schedule = a->sched, .micro_batches = M, .seed = TPP_SEED,
                     .optim = tpp_optim(a->kind)};
    tdm_status st = tdm_cuda_emulator_open_accel(&dev, r);
    if (!st && tdm_dev_kind(dev) != TDM_DEVICE_CUDA)
        st = tdm_error_set(TDM_STATUS_INTERNAL, "the emulator is not an accelerator");
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    for (int s = 0; !st && s < STEPS; s++) {
        tpp_batch(&spec, in, rows, classes, s, B, x, y);
        st = tdm_pp_step(p, x, y, B, &a->out->loss[s]);
    }
    if (!st) {
        tdm_model *m = tdm_pp_model(p);
        tdm_model_stage_info si;
        tdm_model_get_stage(m, &si);
        st = tdm_dev_copy_to_host(dev, host, tdm_model_params(m),
                                  (size_t)tdm_model_param_elems(m) * 4);
        if (!st) {
            a->out->max_diff[r] = tpp_max_diff(host, a->ref + si.slice_offset, si.slice_elems);
            if (si.tied_param >= 0) {
                const tdm_tensor_info *t = tdm_model_param_info(m, si.tied_param);
                double d = tpp_max_diff(host + t->offset, a->ref, t->n_elem);
                if (d > a->out->max_diff[r]) a->out->max_diff[r] = d;
            }
        }
    }
    a->out->status[r] = st;
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    free(host);
    return st ? 3 : 0;
}

/* The emulator's kernels are the CUDA backend's, run on the host: their
 * reductions (LayerNorm, softmax) may be ordered as on a GPU rather than
 * as the host backend's, so the runs are held to agree within rounding
 * (losses 1e-5 + 1e-4 relative, as tests/test_cuda_train.c's DP and DDP
 * on the emulator; parameters 1e-5). Measured: the MLP and the CNN bit for
 * bit, the GPT within 6.4e-7 after 5 AdamW steps. */
static void check_emu(tpp_kind kind)
{
    CU_NEED_BACKEND();
    cr_assert_not_null(tdm_cuda_emulator_open_accel);
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    double ref_loss[STEPS];
    float *ref = malloc(TPP_MAX_ELEMS * sizeof *ref);
    int64_t n = 0;
    cr_assert_eq(tpp_reference(kind, M, B, STEPS, ref_loss, NULL, ref, &n), TDM_STATUS_OK);
    for (int S = 2; S <= 3; S++)
        for (int k = 0; k < TDM_PP_SCHEDULE_COUNT_; k++) {
            tpp_out *o = tpp_out_new();
            emu_arg a = {.out = o, .kind = kind, .sched = (tdm_pp_schedule_kind)k, .ref = ref};
            tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(90000)};
            tdm_status st = tdm_shm_spawn(S, emu_rank, &a, &so, NULL);
            cr_assert_eq(st, TDM_STATUS_OK, "%s S=%d %s: %s / %s / %s", tpp_kind_name(kind), S,
                         tdm_pp_schedule_name(a.sched), tdm_error_message(), o->err[0],
                         o->err[1]);
            for (int s = 0; s < STEPS; s++)
                cr_assert(fabs(o->loss[s] - ref_loss[s]) <= 1e-5 + 1e-4 * fabs(ref_loss[s]),
                          "%s S=%d step %d: loss %.9g vs host %.9g", tpp_kind_name(kind), S, s,
                          o->loss[s], ref_loss[s]);
            for (int r = 0; r < S; r++) {
                if (getenv("TANDEM_TEST_VERBOSE"))
                    fprintf(stderr, "%s S=%d %s stage %d: %g\n", tpp_kind_name(kind), S,
                            tdm_pp_schedule_name(a.sched), r, o->max_diff[r]);
                cr_assert_leq(o->max_diff[r], 1e-5, "%s S=%d %s stage %d: parameters %g from the "
                              "host's", tpp_kind_name(kind), S, tdm_pp_schedule_name(a.sched), r,
                              o->max_diff[r]);
            }
            tpp_out_free(o);
        }
    free(ref);
    cr_assert_eq(shm_t_segments_held(), before);
}

TestSuite(pp_cuda_emu, .timeout = 240);

Test(pp_cuda_emu, mlp_stages_on_emulated_gpus_equal_one_host_device) { check_emu(TPP_MLP); }
Test(pp_cuda_emu, cnn_stages_on_emulated_gpus_equal_one_host_device) { check_emu(TPP_CNN); }
Test(pp_cuda_emu, gpt_stages_on_emulated_gpus_equal_one_host_device) { check_emu(TPP_GPT); }

/* The optimizer's state offloaded to host memory (tdm_optim_opts.offload)
 * is refused by the pipeline on every stage: its checkpoints copy the
 * state with the stage's device, which on a GPU would hand host pointers
 * to cudaMemcpy as device memory (the emulator's copies would hide it). */
static int offload_rank(tdm_comm *comm, void *argp)
{
    tpp_out *out = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    tdm_pp_opts o = {.schedule = TDM_PP_1F1B, .micro_batches = 2, .seed = TPP_SEED,
                     .optim = tpp_optim(TPP_MLP)};
    o.optim.offload = TDM_OPTIM_OFFLOAD_HOST;
    tdm_status st = tdm_cuda_emulator_open_accel(&dev, r);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    out->status[r] = st;
    snprintf(out->err[r], sizeof out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    return 0;
}

Test(pp_cuda_emu, optimizer_offload_is_refused_on_every_stage)
{
    CU_NEED_BACKEND();
    cr_assert_not_null(tdm_cuda_emulator_open_accel);
    tpp_out *o = tpp_out_new();
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    tdm_shm_spawn(2, offload_rank, o, &so, NULL);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(o->status[r], TDM_STATUS_UNSUPPORTED, "stage %d: %s", r, o->err[r]);
        cr_assert(strstr(o->err[r], "optimizer offload is not supported by the pipeline"),
                  "stage %d: %s", r, o->err[r]);
    }
    tpp_out_free(o);
}

/* --- a GPU ------------------------------------------------------------------- */

typedef struct gpu_arg {
    tpp_out *out;
    int ngpu;
} gpu_arg;

static int gpu_rank(tdm_comm *boot, void *argp)
{
    gpu_arg *a = argp;
    int r = tdm_comm_rank(boot), S = tdm_comm_size(boot);
    int g = cu_rank_gpu(r, S, a->ngpu);
    tdm_device *dev = NULL;
    tdm_comm *nccl = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    float x[B * 20];
    int32_t y[B];
    tdm_pp_opts o = {.schedule = TDM_PP_1F1B, .micro_batches = M, .seed = TPP_SEED,
                     .optim = tpp_optim(TPP_MLP), .host_comm = boot};
    tdm_status st = tdm_device_open(&dev, "cuda", g, 1);
    if (!st) st = tdm_comm_init_nccl(&nccl, boot, g);
    if (!st) st = tdm_pp_init(&p, nccl, dev, &spec, &o);
    for (int s = 0; !st && s < STEPS; s++) {
        tpp_batch(&spec, 20, 1, 5, s, B, x, y);
        st = tdm_pp_step(p, x, y, B, &a->out->loss[s]);
    }
    a->out->status[r] = st;
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_comm_free(nccl);
    tdm_device_free(dev);
    return st ? 3 : 0;
}

TestSuite(pp_cuda_gpu, .timeout = 240);

/* GPU kernels sum in their own order (and cuBLAS may pick other
 * algorithms): losses within 1e-4 relative of the host's. */
Test(pp_cuda_gpu, two_stages_over_nccl_equal_one_host_device)
{
    CU_NEED_BACKEND();
    char why[512];
    int ngpu = cu_gpu_count(why, sizeof why);
    if (ngpu == 0) cr_skip_test("%s", why);
    double ref[STEPS];
    int64_t n = 0;
    cr_assert_eq(tpp_reference(TPP_MLP, M, B, STEPS, ref, NULL, NULL, &n), TDM_STATUS_OK);
    tpp_out *o = tpp_out_new();
    gpu_arg a = {.out = o, .ngpu = ngpu};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(120000)};
    tdm_status st = tdm_shm_spawn(2, gpu_rank, &a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s / %s / %s", tdm_error_message(), o->err[0], o->err[1]);
    for (int s = 0; s < STEPS; s++)
        cr_assert(fabs(o->loss[s] - ref[s]) <= 1e-5 + 1e-4 * fabs(ref[s]),
                  "step %d: loss %.9g vs host %.9g", s, o->loss[s], ref[s]);
    tpp_out_free(o);
}
