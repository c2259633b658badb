/* tests/test_review_fsdp.c (review): docs/FSDP.md's memory table says a
 * FULL_SHARD step adds at most 2 units' full parameters + 2 units' full
 * gradients. With the GPT's tied head (wte used at the end of forward and
 * first in backward) unit 0 stays gathered, with a live full gradient,
 * for the whole backward, so the pool holds 3 of each. */
#include <criterion/criterion.h>
#include <sys/mman.h>

#include "tests/test_fsdp_util.h"

typedef struct {
    size_t peak[2], max_unit[2]; long long elems; int nu;
    int status[2];
} rv_shared;
static rv_shared *g_rv;

static int rv_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_fsdp *f = NULL;
    tdm_model_spec spec;
    tdm_status st = TDM_STATUS_OK;
    int32_t x[2 * TF_GPT_T], y[2 * TF_GPT_T];
    for (int i = 0; i < 2 * TF_GPT_T; i++) {
        x[i] = (i * 7 + rank) % 40;
        y[i] = (i * 5 + 1) % 40;
    }
    tdm_model_spec_gpt(&spec, 2, 16, 2, TF_GPT_T);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_fsdp_opts o = {.sharding = TDM_FSDP_FULL_SHARD, .timeout_ms = 20000};
    TDM_TRY(tdm_fsdp_init(&f, m, comm, &o));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    TDM_TRY(tdm_fsdp_optim_init(&opt, f, &oo));
    for (int s = 0; s < 3; s++) {
        TDM_TRY(tdm_fsdp_zero_grad(f));
        TDM_TRY(tdm_fsdp_forward(f, x, y, 2, NULL));
        TDM_TRY(tdm_fsdp_backward(f));
        TDM_TRY(tdm_fsdp_step(f, opt));
    }
    tdm_fsdp_memory fm;
    tdm_fsdp_get_memory(f, opt, &fm);
    g_rv->peak[rank] = fm.units_peak;
    g_rv->max_unit[rank] = fm.max_unit_bytes;
    g_rv->elems = tdm_model_param_elems(m);
    g_rv->nu = tdm_fsdp_n_units(f);
fail:
    g_rv->status[rank] = st;
    if (st) fprintf(stderr, "rank %d: %s\n", rank, tdm_error_message());
    tdm_fsdp_free(f);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(review_fsdp, gpt_full_shard_pool_peak_within_documented_bound, .timeout = 120)
{
    g_rv = mmap(NULL, sizeof *g_rv, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(g_rv != MAP_FAILED);
    memset(g_rv, 0, sizeof *g_rv);
    tdm_ddp_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    tdm_status st = tdm_ddp_spawn(2, rv_rank, NULL, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(g_rv->status[r], 0);
        /* docs/FSDP.md: 2 units' full parameters + 2 units' full gradients */
        cr_expect_leq(g_rv->peak[r], 4 * g_rv->max_unit[r],
                      "rank %d: pool peak %zu bytes > 4 x largest unit %zu bytes (%d units, the whole model %lld bytes)", r,
                      g_rv->peak[r], g_rv->max_unit[r], g_rv->nu, g_rv->elems * 4);
    }
    munmap(g_rv, sizeof *g_rv);
}
