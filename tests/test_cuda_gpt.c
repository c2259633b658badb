/* tests/test_cuda_gpt.c: the GPT's kernels and model on the CUDA backend
 * against the host backend.
 *
 * - cuda_emu (cuda/ built, no GPU needed): the CUDA emulator runs every
 *   new kernel's functor (index decomposition included) as a host loop,
 *   and its strided-batched gemm; each against the host backend at odd
 *   shapes; then the whole GPT (three training steps), DP over emulated
 *   accelerators and DDP ranks on emulated accelerators against one host
 *   device.
 * - cuda_gpu (skipped without a GPU): the same kernels and model on cuda:0
 *   (cublasSgemmStridedBatched, the grid-stride kernels).
 *
 * Compiled in every build: the cuda/ functions are weak references. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_weak.h"
#include "dp/dp.h"
#include "models/gpt.h"
#include "tests/cuda_test_util.h"
#include "tests/test_ddp_util.h"
#include "tests/test_util.h"

static tdm_status open_emu(tdm_device **out, int i) { return tdm_cuda_emulator_open_accel(out, i); }

static tdm_device *open_dut(int emu)
{
    tdm_device *d = NULL;
    if (emu) TU_OK(tdm_cuda_emulator_open(&d));
    else TU_OK(tdm_device_open(&d, "cuda", 0, 1));
    return d;
}

static void *up(tdm_device *d, const void *h, size_t nbytes)
{
    void *p = NULL;
    TU_OK(tdm_dev_alloc(d, nbytes ? nbytes : 4, &p));
    if (h && nbytes) TU_OK(tdm_dev_copy_from_host(d, p, h, nbytes));
    return p;
}

/* Device buffer dv (n floats) against host ref within (atol, rtol). */
static void cmp(const char *what, tdm_device *d, const float *dv, const float *ref, int64_t n,
                double atol, double rtol)
{
    float *h = tu_malloc((size_t)n * 4);
    TU_OK(tdm_dev_copy_to_host(d, h, dv, (size_t)n * 4));
    int64_t at = 0;
    double r = tu_tol_ratio(h, ref, n, atol, rtol, &at, NULL);
    cr_assert(r <= 1.0, "%s on %s: [%lld] %.9g vs host %.9g", what, tdm_dev_name(d), (long long)at,
              h[at], ref[at]);
    free(h);
}

static float *rnd(tdm_rng *r, int64_t n, float lo, float hi)
{
    float *p = tu_malloc((size_t)n * 4);
    tu_fill(r, p, n, lo, hi);
    return p;
}

static void kernels_match_host(int emu)
{
    tdm_device *g = open_dut(emu), *c = tu_host();
    tdm_rng r = tu_rng(5);
    int B = 3, T = 7, H = 3, hd = 5, C = H * hd, V = 11;
    int64_t N = (int64_t)B * T, NC = N * C;
    /* embedding, tokens repeating */
    int32_t *tok = tu_malloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) tok[i] = (int32_t)tdm_rng_below(&r, 4);
    float *wte = rnd(&r, (int64_t)V * C, -1, 1), *wpe = rnd(&r, (int64_t)T * C, -1, 1);
    float *out = tu_malloc((size_t)NC * 4), *dout = rnd(&r, NC, -1, 1);
    float *dwte = tu_malloc((size_t)V * C * 4), *dwpe = tu_malloc((size_t)T * C * 4);
    int32_t *gtok = up(g, tok, (size_t)N * 4);
    float *gwte = up(g, wte, (size_t)V * C * 4), *gwpe = up(g, wpe, (size_t)T * C * 4);
    float *gout = up(g, NULL, (size_t)NC * 4), *gdout = up(g, dout, (size_t)NC * 4);
    float *gdwte = up(g, NULL, (size_t)V * C * 4), *gdwpe = up(g, NULL, (size_t)T * C * 4);
    TU_OK(tdm_dev_embed_fwd(c, tok, wte, wpe, out, B, T, C));
    TU_OK(tdm_dev_embed_fwd(g, gtok, gwte, gwpe, gout, B, T, C));
    cmp("embed_fwd", g, gout, out, NC, 0, 0);
    TU_OK(tdm_dev_memset_zero(c, dwte, (size_t)V * C * 4));
    TU_OK(tdm_dev_memset_zero(c, dwpe, (size_t)T * C * 4));
    TU_OK(tdm_dev_memset_zero(g, gdwte, (size_t)V * C * 4));
    TU_OK(tdm_dev_memset_zero(g, gdwpe, (size_t)T * C * 4));
    TU_OK(tdm_dev_embed_bwd(c, tok, dout, dwte, dwpe, B, T, C));
    TU_OK(tdm_dev_embed_bwd(g, gtok, gdout, gdwte, gdwpe, B, T, C));
    cmp("embed_bwd wte", g, gdwte, dwte, (int64_t)V * C, 1e-6, 1e-6);
    cmp("embed_bwd wpe", g, gdwpe, dwpe, (int64_t)T * C, 1e-6, 1e-6);

    /* LayerNorm forward and backward (adds) */
    float *x = rnd(&r, NC, -3, 3), *lg = rnd(&r, C, 0.5f, 1.5f), *lb = rnd(&r, C, -1, 1);
    float *mean = tu_malloc((size_t)N * 4), *rstd = tu_malloc((size_t)N * 4);
    float *dx = rnd(&r, NC, -1, 1), *dg = rnd(&r, C, -1, 1), *db = rnd(&r, C, -1, 1);
    float *gx = up(g, x, (size_t)NC * 4), *glg = up(g, lg, (size_t)C * 4), *glb = up(g, lb, (size_t)C * 4);
    float *gmean = up(g, NULL, (size_t)N * 4), *grstd = up(g, NULL, (size_t)N * 4);
    float *gdx = up(g, dx, (size_t)NC * 4), *gdg = up(g, dg, (size_t)C * 4), *gdb = up(g, db, (size_t)C * 4);
    TU_OK(tdm_dev_layernorm_fwd(c, x, lg, lb, out, mean, rstd, N, C, 1e-5f));
    TU_OK(tdm_dev_layernorm_fwd(g, gx, glg, glb, gout, gmean, grstd, N, C, 1e-5f));
    cmp("layernorm_fwd", g, gout, out, NC, 1e-6, 1e-5);
    cmp("layernorm_fwd rstd", g, grstd, rstd, N, 1e-6, 1e-5);
    TU_OK(tdm_dev_layernorm_bwd(c, x, dout, lg, mean, rstd, dx, dg, db, N, C));
    TU_OK(tdm_dev_layernorm_bwd(g, gx, gdout, glg, gmean, grstd, gdx, gdg, gdb, N, C));
    cmp("layernorm_bwd dx", g, gdx, dx, NC, 1e-6, 1e-5);
    cmp("layernorm_bwd dg", g, gdg, dg, C, 1e-5, 1e-5);
    cmp("layernorm_bwd db", g, gdb, db, C, 1e-5, 1e-5);

    /* GELU, backward in place */
    TU_OK(tdm_dev_gelu_fwd(c, x, out, NC));
    TU_OK(tdm_dev_gelu_fwd(g, gx, gout, NC));
    cmp("gelu_fwd", g, gout, out, NC, 1e-6, 1e-5);
    memcpy(dx, dout, (size_t)NC * 4);
    TU_OK(tdm_dev_copy(g, gdx, gdout, (size_t)NC * 4));
    TU_OK(tdm_dev_gelu_bwd(c, x, dx, dx, NC));
    TU_OK(tdm_dev_gelu_bwd(g, gx, gdx, gdx, NC));
    cmp("gelu_bwd", g, gdx, dx, NC, 1e-6, 1e-5);

    /* heads split and merge at an offset of a 3C-wide row */
    float *qkv = rnd(&r, 3 * NC, -1, 1), *hq = tu_malloc((size_t)NC * 4);
    float *gqkv = up(g, qkv, (size_t)(3 * NC) * 4), *ghq = up(g, NULL, (size_t)NC * 4);
    TU_OK(tdm_dev_heads_split(c, qkv, 3 * C, C, hq, B, T, H, hd));
    TU_OK(tdm_dev_heads_split(g, gqkv, 3 * C, C, ghq, B, T, H, hd));
    cmp("heads_split", g, ghq, hq, NC, 0, 0);
    TU_OK(tdm_dev_heads_merge(c, hq, qkv, 3 * C, 2 * C, B, T, H, hd));
    TU_OK(tdm_dev_heads_merge(g, ghq, gqkv, 3 * C, 2 * C, B, T, H, hd));
    cmp("heads_merge", g, gqkv, qkv, 3 * NC, 0, 0);

    /* causal softmax forward and backward */
    int64_t rows = (int64_t)B * H * T, TT = rows * T;
    float *att = rnd(&r, TT, -4, 4), *datt = rnd(&r, TT, -1, 1);
    float *gatt = up(g, att, (size_t)TT * 4), *gdatt = up(g, datt, (size_t)TT * 4);
    TU_OK(tdm_dev_attn_softmax_fwd(c, att, rows, T));
    TU_OK(tdm_dev_attn_softmax_fwd(g, gatt, rows, T));
    cmp("attn_softmax_fwd", g, gatt, att, TT, 1e-7, 1e-5);
    TU_OK(tdm_dev_attn_softmax_bwd(c, att, datt, rows, T));
    TU_OK(tdm_dev_attn_softmax_bwd(g, gatt, gdatt, rows, T));
    cmp("attn_softmax_bwd", g, gdatt, datt, TT, 1e-7, 1e-5);

    /* strided-batched gemm: the attention's shapes, both transposes */
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            long long s = (long long)T * hd;
            float *A = rnd(&r, s * B * H, -1, 1), *Bm = rnd(&r, s * B * H, -1, 1);
            float *Cm = rnd(&r, TT, -1, 1);
            float *gA = up(g, A, (size_t)(s * B * H) * 4), *gB = up(g, Bm, (size_t)(s * B * H) * 4);
            float *gC = up(g, Cm, (size_t)TT * 4);
            /* C (T, T) = op(A) op(B): A, B are (T, hd) or (hd, T) row-major */
            int k = hd;
            TU_OK(tdm_dev_gemm_rm_strided_batched(c, ta ? TDM_TRANS_T : TDM_TRANS_N,
                                                  tb ? TDM_TRANS_N : TDM_TRANS_T, T, T, k, 0.5f,
                                                  A, s, Bm, s, 0.25f, Cm, (long long)T * T,
                                                  B * H));
            TU_OK(tdm_dev_gemm_rm_strided_batched(g, ta ? TDM_TRANS_T : TDM_TRANS_N,
                                                  tb ? TDM_TRANS_N : TDM_TRANS_T, T, T, k, 0.5f,
                                                  gA, s, gB, s, 0.25f, gC, (long long)T * T,
                                                  B * H));
            cmp("gemm_strided_batched", g, gC, Cm, TT, 1e-5, 1e-4);
            tdm_dev_free(g, gA); tdm_dev_free(g, gB); tdm_dev_free(g, gC);
            free(A); free(Bm); free(Cm);
        }
    TU_OK(tdm_dev_sync(g));
    void *gall[] = {gtok, gwte, gwpe, gout, gdout, gdwte, gdwpe, gx, glg, glb, gmean, grstd,
                    gdx, gdg, gdb, gqkv, ghq, gatt, gdatt};
    for (size_t i = 0; i < sizeof gall / sizeof gall[0]; i++) tdm_dev_free(g, gall[i]);
    void *hall[] = {tok, wte, wpe, out, dout, dwte, dwpe, x, lg, lb, mean, rstd, dx, dg, db, qkv,
                    hq, att, datt};
    for (size_t i = 0; i < sizeof hall / sizeof hall[0]; i++) free(hall[i]);
    tdm_device_free(g);
    tdm_device_free(c);
}

Test(cuda_emu, gpt_kernels_match_host)
{
    CU_NEED_BACKEND();
    kernels_match_host(1);
}

Test(cuda_gpu, gpt_kernels_match_host, .timeout = 120)
{
    NEED_GPUS(1);
    kernels_match_host(0);
}

/* Three AdamW steps of a GPT on the device under test and on the host. */
static void model_matches_host(int emu)
{
    tdm_device *g = open_dut(emu), *c = tu_host();
    tdm_model_spec s;
    tdm_model_spec_gpt(&s, 2, 24, 3, 13);
    tdm_model *mg = NULL, *mc = NULL;
    TU_OK(tdm_model_init(&mg, g, &s, 4));
    TU_OK(tdm_model_init(&mc, c, &s, 4));
    int B = 3, T = 13;
    int32_t *x = tu_malloc((size_t)B * T * 4), *y = tu_malloc((size_t)B * T * 4);
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_ADAMW);
    oo.lr = 3e-3f;
    tdm_optim *og = NULL, *oc = NULL;
    TU_OK(tdm_optim_init(&og, mg, &oo));
    TU_OK(tdm_optim_init(&oc, mc, &oo));
    tdm_single sg = {.model = mg, .opt = og}, sc = {.model = mc, .opt = oc};
    int64_t pe = tdm_model_param_elems(mc);
    for (int step = 0; step < 3; step++) {
        tdm_text_windows(tddp_text(), T, 2, step, 0, B, x, y);
        double lg = 0, lc = 0;
        /* host inputs: the single step stages them to the device */
        TU_OK(tdm_single_step(&sg, x, y, B, &lg));
        TU_OK(tdm_single_step(&sc, x, y, B, &lc));
        cr_assert(tu_close(lg, lc, 1e-5, 1e-5), "step %d: loss %s %.9g host %.9g", step,
                  tdm_dev_name(g), lg, lc);
        cmp("grads", g, tdm_model_grads(mg), tdm_model_grads(mc), pe, 1e-5, 1e-3);
        cmp("params", g, tdm_model_params(mg), tdm_model_params(mc), pe, 1e-5, 1e-4);
    }
    /* generation reads the device's logits the same way */
    int32_t a[12], b[12];
    TU_OK(tdm_gpt_generate(mg, x, 5, 12, 0.0f, 1, a, NULL, NULL));
    TU_OK(tdm_gpt_generate(mc, x, 5, 12, 0.0f, 1, b, NULL, NULL));
    cr_assert(!memcmp(a, b, sizeof a), "greedy text differs between %s and the host",
              tdm_dev_name(g));
    /* a token outside the vocabulary is caught on the device too */
    int32_t bad[13] = {0};
    bad[7] = 999;
    int32_t *gbad = up(g, bad, sizeof bad);
    const float *lgp;
    cr_assert_eq(tdm_model_forward(mg, gbad, 1, &lgp), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "token 999 at position 7"), "%s", tdm_error_message());
    tdm_dev_free(g, gbad);
    tdm_single_free(&sg);
    tdm_single_free(&sc);
    tdm_optim_free(og);
    tdm_optim_free(oc);
    tdm_model_free(mg);
    tdm_model_free(mc);
    free(x);
    free(y);
    tdm_device_free(g);
    tdm_device_free(c);
}

Test(cuda_emu, gpt_model_matches_host)
{
    CU_NEED_BACKEND();
    model_matches_host(1);
}

Test(cuda_gpu, gpt_model_matches_host, .timeout = 120)
{
    NEED_GPUS(1);
    model_matches_host(0);
}

/* DP over emulated accelerators (staged replicate and reduce, or the
 * emulated group) and DDP ranks on emulated accelerators (input staging,
 * device-side loss), against one host device on the same windows. */
Test(cuda_emu, gpt_dp_and_ddp_on_emulated_accelerators, .timeout = 180)
{
    CU_NEED_BACKEND();
    tdm_model_spec spec;
    tddp_spec_gpt(&spec);
    for (int n = 2; n <= 3; n++) {
        tdm_device *devs[TDM_DP_MAX_DEVICES] = {0}, *hd = tu_host();
        for (int i = 0; i < n; i++) TU_OK(open_emu(&devs[i], i));
        tdm_model *m = NULL, *ref = NULL;
        TU_OK(tdm_model_init(&m, devs[0], &spec, 9));
        TU_OK(tdm_model_init(&ref, hd, &spec, 9));
        tdm_optim *o = NULL, *oref = NULL;
        TU_OK(tdm_sgd_init(&o, m, 0.1f, 0.9f));
        TU_OK(tdm_sgd_init(&oref, ref, 0.1f, 0.9f));
        tdm_dp *dp = NULL;
        TU_OK(tdm_dp_init(&dp, m, devs, n, NULL));
        int B = 5, T = TDDP_GPT_T;
        int32_t x[5 * TDDP_GPT_T], y[5 * TDDP_GPT_T];
        tdm_single single = {.model = ref, .opt = oref};
        for (int s = 0; s < 2; s++) {
            tdm_text_windows(tddp_text(), T, 1, s, 0, B, x, y);
            double l1, l2;
            TU_OK(tdm_dp_step(dp, o, x, y, B, &l1));
            TU_OK(tdm_single_step(&single, x, y, B, &l2));
            cr_assert(tu_close(l1, l2, 1e-6, 1e-5), "%d emulated devices step %d: %.8f vs %.8f",
                      n, s, l1, l2);
        }
        int64_t pe = tdm_model_param_elems(ref);
        cmp("DP params", devs[0], tdm_model_params(m), tdm_model_params(ref), pe, 1e-6, 1e-4);
        tdm_single_free(&single);
        tdm_dp_free(dp);
        tdm_optim_free(o);
        tdm_optim_free(oref);
        tdm_model_free(m);
        tdm_model_free(ref);
        for (int i = 0; i < n; i++) tdm_device_free(devs[i]);
        tdm_device_free(hd);
    }
    tddp_cfg c = tddp_cfg_default();
    c.gpt = 1;
    c.batch = 5;
    c.steps = 2;
    c.open_dev = open_emu;
    tddp_check_equiv(&c, NULL, 2, 60000,
                     (tddp_tol){.loss_atol = 1e-6, .loss_rtol = 1e-5, .grad_atol = 1e-6,
                                .grad_rtol = 1e-4, .param_atol = 1e-6, .param_rtol = 1e-4});
}
