/* tests/test_review_join.c (review): tdm_ddp_join while the ranks still
 * training accumulate gradients (no_sync micro-batches, the accumulation
 * ddp.h documents). PyTorch's join hook asks the others whether this
 * iteration syncs (_check_global_requires_backward_grad_sync); tandem's
 * joined rank runs a synchronised backward and an optimizer step for
 * every forward of the others, so its bucket all-reduce meets their next
 * join count: the group fails or the replicas diverge. */
#include <criterion/criterion.h>
#include <sys/mman.h>

#include "ddp/ddp.h"
#include "ddp/spawn.h"
#include "models/optim.h"
#include "tests/test_fsdp_util.h"

typedef struct {
    int status[2];
    float p[2][64];
} rj_shared;
static rj_shared *g_rj;

static int rj_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *d = NULL;
    tdm_model_spec spec;
    tdm_status st = TDM_STATUS_OK;
    int dims[] = {8, 6, 3};
    float x[4 * 8];
    int32_t y[4];
    for (int i = 0; i < 32; i++) x[i] = (float)((i * 7 + rank) % 11) * 0.1f;
    for (int i = 0; i < 4; i++) y[i] = i % 3;
    tdm_model_spec_mlp(&spec, dims, 3);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_ddp_opts o = {.join = 1, .timeout_ms = 5000};
    TDM_TRY(tdm_ddp_init(&d, m, comm, &o));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    TDM_TRY(tdm_optim_init(&opt, m, &oo));
    /* rank 0: 2 optimizer steps of 2 micro-batches; rank 1: 1 step */
    int steps = rank == 0 ? 2 : 1;
    for (int s = 0; s < steps; s++) {
        TDM_TRY(tdm_ddp_zero_grad(d));
        for (int k = 0; k < 2; k++) {
            tdm_ddp_no_sync(d, k == 0);
            TDM_TRY(tdm_ddp_forward(d, x + 16 * k, y + 2 * k, 2, NULL));
            TDM_TRY(tdm_ddp_backward(d));
        }
        TDM_TRY(tdm_ddp_step(d, opt));
    }
    TDM_TRY(tdm_ddp_join(d, opt, NULL));
    int64_t n = tdm_model_param_elems(m);
    memcpy(g_rj->p[rank], tdm_model_params(m), (size_t)(n < 64 ? n : 64) * sizeof(float));
fail:
    g_rj->status[rank] = st;
    if (st) fprintf(stderr, "rank %d: %s\n", rank, tdm_error_message());
    tdm_ddp_free(d);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(review_join, join_while_others_accumulate_under_no_sync, .timeout = 120)
{
    g_rj = mmap(NULL, sizeof *g_rj, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(g_rj != MAP_FAILED);
    memset(g_rj, 0, sizeof *g_rj);
    tdm_ddp_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 10000};
    tdm_status st = tdm_ddp_spawn(2, rj_rank, NULL, &so, NULL);
    cr_expect_eq(st, TDM_STATUS_OK, "spawn: %s", tdm_error_message());
    cr_expect_eq(g_rj->status[0], 0, "rank 0 failed");
    cr_expect_eq(g_rj->status[1], 0, "rank 1 failed");
    cr_expect(!memcmp(g_rj->p[0], g_rj->p[1], sizeof g_rj->p[0]), "replicas differ");
    munmap(g_rj, sizeof *g_rj);
}
