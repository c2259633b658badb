/* tests/test_offload.c: ZeRO-Offload of the optimizer (models/optim.h,
 * TDM_OPTIM_OFFLOAD_HOST) on the CUDA emulator: five steps of the MLP
 * with SGD (momentum) and of the GPT with AdamW, FP32 and BF16, give
 * bitwise the parameters of the same steps without offload; the
 * emulated device's allocator holds exactly the optimizer state's bytes
 * less (at rest and at its peak), the state lives on the optimizer's
 * host device; a checkpoint saved from an offloaded optimizer resumes
 * into a device-resident one with the same state; a host device is
 * refused with a message. */
#include <criterion/criterion.h>

#include "models/checkpoint.h"
#include "tests/lever_util.h"

TestSuite(offload, .timeout = 120);

typedef struct off_run {
    float *params, *state;
    int64_t n;
    size_t live, peak, state_bytes;
} off_run;

static void run(lv_model k, tdm_precision prec, int offload, off_run *out, const char *save)
{
    tdm_model_spec spec;
    lv_spec(k, &spec);
    tdm_device *d = lv_open("cuda");
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    TU_OK(tdm_model_init(&m, d, &spec, 7));
    TU_OK(tdm_model_set_precision(m, prec));
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, k == LV_GPT ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    if (k != LV_GPT) o.momentum = 0.9f;
    o.offload = offload ? TDM_OPTIM_OFFLOAD_HOST : TDM_OPTIM_OFFLOAD_NONE;
    TU_OK(tdm_optim_init(&opt, m, &o));
    cr_assert_eq(tdm_optim_device(opt) == d, !offload);
    tdm_dev_mem_stats ms;
    TU_OK(tdm_dev_mem_query(d, &ms));
    out->live = ms.live_bytes;
    tdm_single s = {.model = m, .opt = opt};
    int B = lv_batch(k);
    float *x = tu_malloc((size_t)B * tdm_model_in_features(m) * 4);
    int32_t *y = tu_malloc((size_t)B * tdm_model_out_rows(m) * 4);
    double loss;
    for (int i = 0; i < 5; i++) {
        lv_data(k, &spec, i, x, y);
        TU_OK(tdm_single_step(&s, x, y, B, &loss));
    }
    TU_OK(tdm_dev_mem_query(d, &ms));
    out->peak = ms.peak_bytes;
    out->n = tdm_model_param_elems(m);
    out->params = tu_malloc((size_t)out->n * 4);
    out->state = tu_malloc((size_t)out->n * 4);
    out->state_bytes = tdm_optim_state_bytes(opt);
    TU_OK(tdm_dev_copy_to_host(d, out->params, tdm_model_params(m), (size_t)out->n * 4));
    TU_OK(tdm_dev_copy_to_host(tdm_optim_device(opt), out->state, tdm_optim_state(opt, 0),
                               (size_t)out->n * 4));
    if (save) TU_OK(tdm_checkpoint_save(save, m, opt, NULL));
    free(x);
    free(y);
    tdm_single_free(&s);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(d);
}

Test(offload, same_bits_and_less_device_memory)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    lv_model ks[2] = {LV_MLP, LV_GPT};
    for (int i = 0; i < 2; i++)
        for (int p = 0; p < 2; p++) {
            tdm_precision prec = p ? TDM_PRECISION_BF16 : TDM_PRECISION_FP32;
            off_run a, b;
            run(ks[i], prec, 0, &a, NULL);
            run(ks[i], prec, 1, &b, NULL);
            const char *what = lv_names[ks[i]];
            cr_assert(!memcmp(a.params, b.params, (size_t)a.n * 4), "%s %s: parameters differ",
                      what, tdm_precision_name(prec));
            cr_assert(!memcmp(a.state, b.state, (size_t)a.n * 4), "%s: state differs", what);
            /* each state buffer is one allocation, rounded to 64 bytes */
            size_t per = ((size_t)a.n * 4 + 63) / 64 * 64, nst = a.state_bytes / ((size_t)a.n * 4);
            cr_assert_eq(a.live - b.live, nst * per, "%s: device holds %zu less, state is %zu",
                         what, a.live - b.live, nst * per);
            cr_assert_eq(a.peak - b.peak, nst * per, "%s: peak %zu less", what, a.peak - b.peak);
            free(a.params); free(a.state); free(b.params); free(b.state);
        }
}

Test(offload, checkpoint_round_trip)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "offload");
    const char *path = tu_tpath(dir, "ck.safetensors");
    off_run a;
    run(LV_MLP, TDM_PRECISION_FP32, 1, &a, path);
    /* load into a device-resident optimizer: its state is the offloaded one's */
    tdm_model_spec spec;
    lv_spec(LV_MLP, &spec);
    tdm_device *d = lv_open("cuda");
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    TU_OK(tdm_model_init(&m, d, &spec, 99));
    TU_OK(tdm_sgd_init(&opt, m, 0.01f, 0.9f));
    TU_OK(tdm_checkpoint_load(path, m, opt, NULL));
    float *st = tu_malloc((size_t)a.n * 4);
    TU_OK(tdm_dev_copy_to_host(d, st, tdm_optim_state(opt, 0), (size_t)a.n * 4));
    cr_assert(!memcmp(st, a.state, (size_t)a.n * 4));
    free(st);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(d);
    free(a.params);
    free(a.state);
    tu_rmtree(dir);
}

Test(offload, refused_on_a_host_device)
{
    tdm_device *d = tu_host();
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    lv_spec(LV_MLP, &spec);
    TU_OK(tdm_model_init(&m, d, &spec, 1));
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
    o.offload = TDM_OPTIM_OFFLOAD_HOST;
    cr_assert_eq(tdm_optim_init(&opt, m, &o), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "cpu:0's memory is host memory already"), "%s",
              tdm_error_message());
    tdm_model_free(m);
    tdm_device_free(d);
}
