/* tests/test_cuda_seq.c: the model-file layers' kernels (activations,
 * average pooling) on the CUDA backend against the host backend, and a
 * model file using every new layer (residual blocks, dropout) trained
 * three steps on the device under test against one host device.
 *
 * - cuda_emu (cuda/ built, no GPU needed): the CUDA emulator runs each
 *   kernel's functor, index decomposition included, as a host loop.
 * - cuda_gpu (skipped without a GPU): the same on cuda:0.
 *
 * Compiled in every build: the cuda/ functions are weak references. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_weak.h"
#include "models/builder.h"
#include "models/optim.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

static tdm_device *open_dut(int emu)
{
    tdm_device *d = NULL;
    if (emu) TU_OK(tdm_cuda_emulator_open(&d));
    else TU_OK(tdm_device_open(&d, "cuda", 0, 1));
    return d;
}

static float *up(tdm_device *d, const float *h, int64_t n)
{
    void *p = NULL;
    TU_OK(tdm_dev_alloc(d, (size_t)(n > 0 ? n : 1) * 4, &p));
    if (h && n) TU_OK(tdm_dev_copy_from_host(d, p, h, (size_t)n * 4));
    return p;
}

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

static void kernels_match_host(int emu)
{
    tdm_device *g = open_dut(emu), *c = tu_host();
    tdm_rng r = tu_rng(12);
    enum { N = 3001 };
    float *x = tu_malloc(N * 4), *dy = tu_malloc(N * 4), *y = tu_malloc(N * 4), *dx = tu_malloc(N * 4);
    tu_fill(&r, x, N, -4.0f, 4.0f);
    tu_fill(&r, dy, N, -1.0f, 1.0f);
    float *gx = up(g, x, N), *gdy = up(g, dy, N), *gy = up(g, NULL, N), *gdx = up(g, NULL, N);
    static const tdm_act acts[] = {TDM_ACT_RELU, TDM_ACT_GELU, TDM_ACT_TANH, TDM_ACT_SIGMOID};
    for (int a = 0; a < 4; a++) {
        TU_OK(tdm_dev_act_fwd(c, acts[a], x, y, N));
        TU_OK(tdm_dev_act_fwd(g, acts[a], gx, gy, N));
        cmp("act_fwd", g, gy, y, N, 1e-6, 1e-5);
        TU_OK(tdm_dev_act_bwd(c, acts[a], x, y, dy, dx, N));
        TU_OK(tdm_dev_act_bwd(g, acts[a], gx, gy, gdy, gdx, N));
        cmp("act_bwd", g, gdx, dx, N, 1e-6, 1e-5);
    }
    /* windows 2x2 (7x9: a row and a column past the last window), 3x3, and
     * a whole non-square plane */
    static const tdm_conv_geom geoms[] = {
        {.n = 3, .c = 2, .h = 7, .w = 9, .kh = 2, .kw = 2, .stride = 2, .oh = 3, .ow = 4},
        {.n = 2, .c = 3, .h = 6, .w = 6, .kh = 3, .kw = 3, .stride = 3, .oh = 2, .ow = 2},
        {.n = 4, .c = 2, .h = 5, .w = 3, .kh = 5, .kw = 3, .stride = 5, .oh = 1, .ow = 1},
    };
    for (size_t k = 0; k < sizeof geoms / sizeof geoms[0]; k++) {
        const tdm_conv_geom *q = &geoms[k];
        int64_t big = (int64_t)q->n * q->c * q->h * q->w, small = (int64_t)q->n * q->c * q->oh * q->ow;
        TU_OK(tdm_dev_avgpool_fwd(c, q, x, y));
        TU_OK(tdm_dev_avgpool_fwd(g, q, gx, gy));
        cmp("avgpool_fwd", g, gy, y, small, 1e-6, 1e-6);
        TU_OK(tdm_dev_avgpool_bwd(c, q, dy, dx));
        TU_OK(tdm_dev_memset_zero(g, gdx, (size_t)big * 4));
        TU_OK(tdm_dev_avgpool_bwd(g, q, gdy, gdx));
        cmp("avgpool_bwd", g, gdx, dx, big, 0, 0);
        cr_assert_lt(big, N);
    }
    tdm_dev_free(g, gx);
    tdm_dev_free(g, gdy);
    tdm_dev_free(g, gy);
    tdm_dev_free(g, gdx);
    free(x);
    free(dy);
    free(y);
    free(dx);
    tdm_device_free(g);
}

Test(cuda_emu, seq_kernels_match_host)
{
    CU_NEED_BACKEND();
    kernels_match_host(1);
}

Test(cuda_gpu, seq_kernels_match_host, .timeout = 120)
{
    NEED_GPUS(1);
    kernels_match_host(0);
}

/* Three SGD steps of a model file on the device under test and on the
 * host: losses and parameters within float tolerance. */
static void model_matches_host(int emu)
{
    static const char *txt = "input 3x8x8\n"
                             "conv 3x3 4 pad 1\nbatchnorm\nrelu\n"
                             "residual {\n conv 3x3 4 pad 1\n batchnorm\n gelu\n}\n"
                             "dropout 0.25\n"
                             "residual {\n conv 3x3 6 stride 2 pad 1\n tanh\n} proj\n"
                             "avgpool 2\nsigmoid\navgpool global\nflatten\nlinear 5\n";
    tdm_model_spec s;
    TU_OK(tdm_model_seq_parse_text(&s, "dut.tdm", txt, strlen(txt)));
    tdm_device *g = open_dut(emu), *c = tu_host();
    tdm_model *mc = NULL, *mg = NULL;
    TU_OK(tdm_model_init(&mc, c, &s, 4));
    TU_OK(tdm_model_init(&mg, g, &s, 4));
    enum { B = 6 };
    int F = tdm_model_in_features(mc);
    float *x = tu_malloc((size_t)B * F * 4);
    int32_t y[B];
    tdm_rng r = tu_rng(5);
    int64_t pe = tdm_model_param_elems(mc);
    float *hp = tu_malloc((size_t)pe * 4), *gp = tu_malloc((size_t)pe * 4);
    float *hg = tu_malloc((size_t)pe * 4);
    void *gxd = up(g, NULL, (int64_t)B * F), *gyd = up(g, NULL, B);
    for (int step = 0; step < 3; step++) {
        tu_fill(&r, x, (int64_t)B * F, -1.0f, 1.0f);
        for (int i = 0; i < B; i++) y[i] = (int32_t)tdm_rng_below(&r, 5);
        TU_OK(tdm_dev_copy_from_host(g, gxd, x, (size_t)B * F * 4));
        TU_OK(tdm_dev_copy_from_host(g, gyd, y, sizeof y));
        double lc = 0, lg = 0;
        TU_OK(tdm_model_zero_grad(mc));
        TU_OK(tdm_model_zero_grad(mg));
        TU_OK(tdm_model_forward_backward(mc, x, y, B, &lc));
        TU_OK(tdm_model_forward_backward(mg, gxd, gyd, B, &lg));
        cr_assert(tu_close(lg, lc, 1e-5, 1e-5), "step %d: loss %.9g vs host %.9g", step, lg, lc);
        cmp("gradients", g, tdm_model_grads(mg), tdm_model_grads(mc), pe, 1e-5, 1e-3);
        /* the same SGD step on both */
        memcpy(hg, tdm_model_grads(mc), (size_t)pe * 4);
        float *p = tdm_model_params(mc);
        for (int64_t i = 0; i < pe; i++) p[i] -= 0.1f * hg[i];
        TU_OK(tdm_dev_copy_to_host(g, gp, tdm_model_params(mg), (size_t)pe * 4));
        TU_OK(tdm_dev_copy_to_host(g, hg, tdm_model_grads(mg), (size_t)pe * 4));
        for (int64_t i = 0; i < pe; i++) gp[i] -= 0.1f * hg[i];
        TU_OK(tdm_dev_copy_from_host(g, tdm_model_params(mg), gp, (size_t)pe * 4));
    }
    memcpy(hp, tdm_model_params(mc), (size_t)pe * 4);
    cmp("parameters after 3 steps", g, tdm_model_params(mg), hp, pe, 1e-5, 1e-4);
    tdm_dev_free(g, gxd);
    tdm_dev_free(g, gyd);
    free(x);
    free(hp);
    free(gp);
    free(hg);
    tdm_model_free(mc);
    tdm_model_free(mg);
    tdm_device_free(g);
}

Test(cuda_emu, seq_model_matches_host)
{
    CU_NEED_BACKEND();
    model_matches_host(1);
}

Test(cuda_gpu, seq_model_matches_host, .timeout = 120)
{
    NEED_GPUS(1);
    model_matches_host(0);
}
