/* tests/test_model_init_param.c: tdm_model_init_param_host builds one
 * parameter tensor alone, from a model's tables only, with the values
 * tdm_model_init gives it in the whole model, bit for bit: every tensor
 * of the MLP, the CNN, the GPT and three model files (the GPT's layers,
 * residual blocks with batchnorm, LeNet-5), at two
 * seeds. (Tensor parallelism builds its slices this way, tensor by
 * tensor, instead of the whole model.) And the initial parameters
 * themselves, pinned by a hash: a change to initialisation (the
 * distribution, the scale, the RNG streams, the order of the tensors)
 * fails here, where it would otherwise pass every test that only
 * compares one initialisation with another. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "models/gpt.h"
#include "models/model.h"

static void same_as_init(const tdm_model_spec *spec, const char *what)
{
    static const uint64_t seeds[] = {1, 12345};
    tdm_device *dev = NULL;
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK, "%s", tdm_error_message());
    tdm_model *tables = NULL;
    cr_assert_eq(tdm_model_init_tables(&tables, spec), TDM_STATUS_OK, "%s", tdm_error_message());
    for (int s = 0; s < 2; s++) {
        tdm_model *m = NULL;
        cr_assert_eq(tdm_model_init(&m, dev, spec, seeds[s]), TDM_STATUS_OK, "%s",
                     tdm_error_message());
        const float *all = tdm_model_params(m);   /* a host device's memory */
        cr_assert_eq(tdm_model_n_params(m), tdm_model_n_params(tables));
        for (int i = 0; i < tdm_model_n_params(tables); i++) {
            const tdm_tensor_info *t = tdm_model_param_info(tables, i);
            float *p = malloc((size_t)t->n_elem * sizeof *p + 1);
            cr_assert(p);
            memset(p, 0x7f, (size_t)t->n_elem * sizeof *p);   /* not zero: the call fills all */
            tdm_model_init_param_host(tables, seeds[s], i, p);
            cr_assert(!memcmp(p, all + tdm_model_param_info(m, i)->offset,
                              (size_t)t->n_elem * sizeof *p),
                      "%s seed %llu: tensor %s differs from tdm_model_init's", what,
                      (unsigned long long)seeds[s], t->name);
            free(p);
        }
        tdm_model_free(m);
    }
    tdm_model_free(tables);
    tdm_device_free(dev);
}

Test(model_init_param, every_tensor_alone_is_the_whole_models)
{
    tdm_model_spec s;
    static const int dims[] = {20, 24, 16, 12, 5};
    tdm_model_spec_mlp(&s, dims, 5);
    same_as_init(&s, "mlp");
    tdm_model_spec_cnn(&s);
    same_as_init(&s, "cnn");
    tdm_model_spec_gpt(&s, 2, 16, 4, 8);
    same_as_init(&s, "gpt");
    static const char *const files[] = {"file:examples/models/gpt.tdm",
                                        "file:examples/models/resnet_small.tdm",
                                        "file:examples/models/lenet5.tdm"};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(tdm_model_spec_parse(&s, files[i]), TDM_STATUS_OK, "%s: %s", files[i],
                     tdm_error_message());
        same_as_init(&s, files[i]);
    }
}

/* FNV-1a, 64 bits, over the bytes of the floats (little-endian). */
static uint64_t fnv1a(const void *p, size_t nbytes)
{
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < nbytes; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* The goldens were produced by this test itself: run with every golden
 * set to 0, it fails printing each model's hash, which was copied here
 * (x86-64, gcc 12, glibc 2.36: the normals are Box-Muller through
 * glibc's logf, sqrtf and cosf, so another libm may round one of them
 * differently). Change one only for an intended change of
 * initialisation, and say so in the commit. */
Test(model_init_param, the_initial_parameters_are_pinned)
{
    static const uint64_t seed = 12345;
    static const int dims[] = {20, 24, 16, 12, 5};
    struct {
        const char *what;
        int64_t elems;
        uint64_t golden;
    } want[] = {{"mlp", 1200, 0x8d829c02a28cfdd7ull},
                {"cnn", 421744, 0x56f6e8eb28b2eaf8ull},
                {"gpt", 10816, 0xbdb336f019a59e46ull}};
    for (int k = 0; k < 3; k++) {
        tdm_model_spec s;
        if (k == 0) tdm_model_spec_mlp(&s, dims, 5);
        else if (k == 1) tdm_model_spec_cnn(&s);
        else tdm_model_spec_gpt(&s, 2, 16, 4, 8);
        tdm_device *dev = NULL;
        cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK, "%s", tdm_error_message());
        tdm_model *m = NULL;
        cr_assert_eq(tdm_model_init(&m, dev, &s, seed), TDM_STATUS_OK, "%s", tdm_error_message());
        int64_t n = tdm_model_param_elems(m);
        uint64_t h = fnv1a(tdm_model_params(m), (size_t)n * sizeof(float));
        cr_expect(n == want[k].elems && h == want[k].golden,
                  "%s at seed %llu: %lld parameters hashing to 0x%016llx, pinned: %lld, "
                  "0x%016llx", want[k].what, (unsigned long long)seed, (long long)n,
                  (unsigned long long)h, (long long)want[k].elems,
                  (unsigned long long)want[k].golden);
        tdm_model_free(m);
        tdm_device_free(dev);
    }
}
