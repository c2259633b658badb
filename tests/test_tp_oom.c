/* tests/test_tp_oom.c: tensor parallelism's set-up on a device that
 * runs out of memory. TANDEM_TEST_DEV_FAIL_AFTER=K (core/device_host.c)
 * makes a host device fail every allocation and host-to-device copy
 * after its first K. For every K from 0 until the run fits, one rank
 * builds its tp state on such a device and takes a step (which reserves
 * the activations); a failure must say the device ran out of memory, and
 * after tdm_tp_free the device's allocator must hold nothing: no buffer
 * leaked, none freed twice (a second free drops the live bytes below
 * what was handed out, and glibc aborts on it). The MLP and the GPT. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "shm/spawn.h"
#include "tests/test_pp_util.h"
#include "tests/timeout_util.h"
#include "tp/tp.h"

#define OOM_ENV "TANDEM_TEST_DEV_FAIL_AFTER"
#define OOM_B 4            /* samples (windows) of the step */
#define OOM_MAX_K 4000
#define OOM_SCRATCH (1 << 20)   /* bytes: more than either model's step asks of it */     /* far more fallible calls than either model's set-up makes */

typedef struct oom_out {
    int k;                 /* in: the device's calls before it fails */
    int gpt;               /* in: the GPT (else the MLP) */
    int status;            /* out: 0 when the rank's checks held */
    int fit;               /* out: 1 when set-up and step succeeded */
    char err[512];
} oom_out;

static const int g_mlp[] = {12, 16, 8, 5};

static void oom_spec(int gpt, tdm_model_spec *s)
{
    if (gpt) tdm_model_spec_gpt(s, 2, 16, 4, 8);
    else tdm_model_spec_mlp(s, g_mlp, 4);
}

#define OFAIL(...)                                                  \
    do {                                                            \
        snprintf(o->err, sizeof o->err, __VA_ARGS__);               \
        o->status = 1;                                              \
        goto done;                                                  \
    } while (0)

static int oom_rank(tdm_comm *world, void *arg)
{
    oom_out *o = arg;
    o->status = 0;   /* reached: the checks below say otherwise */
    tdm_device *dev = NULL;
    tdm_tp *p = NULL;
    tdm_model_spec spec;
    oom_spec(o->gpt, &spec);
    char k[32];
    snprintf(k, sizeof k, "%d", o->k);
    setenv(OOM_ENV, k, 1);
    tdm_status st = tdm_device_open(&dev, "cpu", 0, 1);
    unsetenv(OOM_ENV);   /* the host device tp builds the whole model on fails nowhere */
    if (st) OFAIL("device: %s", tdm_error_message());
    /* the device's own scratch (kept until tdm_device_free), taken first
     * and large enough that the step does not grow it: what is live
     * after tdm_tp_free must be that alone */
    void *scratch;
    if (tdm_dev_scratch(dev, OOM_SCRATCH, &scratch)) goto done;   /* K = 0: nothing of tp's */
    tdm_dev_mem_stats m0, m;
    if (tdm_dev_mem_query(dev, &m0)) OFAIL("mem query: %s", tdm_error_message());
    tdm_tp_opts to = {.seed = 7};
    tdm_optim_opts_default(&to.optim, o->gpt ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    st = tdm_tp_init(&p, world, dev, &spec, &to);
    if (!st) {
        int in = o->gpt ? spec.n_ctx : spec.dims[0], rows = o->gpt ? spec.n_ctx : 1;
        int classes = o->gpt ? spec.vocab : spec.dims[spec.ndims - 1];
        float x[OOM_B * 16];
        int32_t y[OOM_B * 8];
        double loss = 0;
        tpp_batch(&spec, in, rows, classes, 0, OOM_B, x, y);
        st = tdm_tp_step_scaled(p, x, y, OOM_B, 1.0f / OOM_B, &loss);
    }
    if (st && (st != TDM_STATUS_OUT_OF_MEMORY || !strstr(tdm_error_message(), OOM_ENV)))
        OFAIL("K=%d: status %d, not the device's out-of-memory: %s", o->k, (int)st,
              tdm_error_message());
    o->fit = st == TDM_STATUS_OK;
    tdm_tp_free(p);
    p = NULL;
    if (tdm_dev_mem_query(dev, &m)) OFAIL("mem query: %s", tdm_error_message());
    if (m.live_bytes != m0.live_bytes)
        OFAIL("K=%d (%s): the allocator holds %zu bytes after tdm_tp_free, %zu before "
              "tdm_tp_init (a leak, or a buffer freed twice)", o->k, st ? "failed" : "fit",
              m.live_bytes, m0.live_bytes);
done:
    tdm_tp_free(p);
    tdm_device_free(dev);
    return o->status;
}

/* Every K from 0 until the set-up and a step fit; returns that K. */
static int oom_sweep(int gpt)
{
    oom_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    int k = 0;
    for (; k < OOM_MAX_K; k++) {
        memset(o, 0, sizeof *o);
        o->k = k;
        o->gpt = gpt;
        o->status = -1;   /* a rank that dies before reporting */
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
        tdm_status st = tdm_shm_spawn(1, oom_rank, o, &so, NULL);
        cr_assert_eq(o->status, 0, "%s K=%d: %s (spawn: %s)", gpt ? "gpt" : "mlp", k,
                     o->status < 0 ? "the rank died (a double free aborts)" : o->err,
                     st ? tdm_error_message() : "ok");
        cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
        if (o->fit) break;
    }
    munmap(o, sizeof *o);
    cr_assert_lt(k, OOM_MAX_K, "the set-up never fit");
    return k;
}

Test(tp_oom, mlp_every_failure_point_frees_once)
{
    int k = oom_sweep(0);
    cr_assert_gt(k, 5, "the sweep reached only %d device calls", k);
}

Test(tp_oom, gpt_every_failure_point_frees_once)
{
    /* the reserve's last steps (the ones copied to the device, the
     * host logits) come after its tokens, targets and ones are handed
     * to tp/tp.c: failing there freed those three twice */
    int k = oom_sweep(1);
    cr_assert_gt(k, 40, "the sweep reached only %d device calls", k);
}
