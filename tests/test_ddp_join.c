/* tests/test_ddp_join.c: uneven inputs (tdm_ddp_opts.join, tdm_ddp_join).
 * Ranks with 3, 5 and 8 batches (of 4, 6 and 5 samples) all finish, hold
 * bitwise the same parameters, and equal a single-device run over the
 * same samples with the same per-step averaging: step s's gradient is the
 * mean, over the ranks that still had a batch, of each one's mean-loss
 * gradient (it failed with the world size as the divisor). Without join
 * the same run fails instead of hanging. Forked ranks, bounded run time. */
#include <criterion/criterion.h>

#include <signal.h>

#include "core/json.h"
#include "tests/fr_test_util.h"
#include "tests/test_ddp_util.h"
#include "tests/timeout_util.h"

/* the plan (tests/test_ddp_util.h, shared with tests/test_fsdp_join.c) */
#define J_WORLD TDDP_JOIN_WORLD
#define J_STEPS TDDP_JOIN_STEPS
#define j_batches tddp_join_batches
#define j_size tddp_join_size
#define j_first tddp_join_first

static tdm_dataset g_data, g_cnn;
static void setup(void)
{
    cr_assert_eq(tddp_data(&g_data, 0, 1024), TDM_STATUS_OK);
    cr_assert_eq(tddp_data(&g_cnn, 1, 256), TDM_STATUS_OK);
}
static void teardown(void)
{
    tdm_data_free(&g_data);
    tdm_data_free(&g_cnn);
}
TestSuite(ddp_join, .init = setup, .fini = teardown, .timeout = 120);

typedef struct j_shared {
    float params[J_WORLD][TDDP_MAX_ELEMS];
    int64_t n_elem, shadowed[J_WORLD];
    int active[J_WORLD][J_STEPS];
    double loss[J_STEPS];
    int status[J_WORLD];
    char err[J_WORLD][512];
} j_shared;

typedef struct j_arg {
    j_shared *sh;
    int join;
    int cnn;
    int scaled;   /* tdm_ddp_forward_scaled with 1/(batch * world) */
} j_arg;

static int j_rank(tdm_comm *comm, void *p)
{
    j_arg *a = p;
    j_shared *sh = a->sh;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_status st = TDM_STATUS_OK;
    tdm_model_spec spec;
    tddp_spec(&spec, a->cnn);
    const tdm_dataset *data = a->cnn ? &g_cnn : &g_data;
    int64_t feat = tdm_data_features(data);
    float x[8 * 64];
    int32_t y[8];
    cr_assert(feat * 8 <= (int64_t)(sizeof x / sizeof x[0]));
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_ddp_opts o = {.join = a->join, .timeout_ms = 20000, .bucket_cap_bytes = 512};
    TDM_TRY(tdm_ddp_init(&ddp, m, comm, &o));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    for (int s = 0; s < j_batches[rank]; s++) {
        int64_t idx[8];
        for (int i = 0; i < j_size[rank]; i++) idx[i] = j_first(rank, s) + i;
        tdm_data_gather(data, idx, j_size[rank], x, y);
        double lm = 0.0;
        TDM_TRY(tdm_ddp_zero_grad(ddp));
        if (a->scaled)
            TDM_TRY(tdm_ddp_forward_scaled(ddp, x, y, j_size[rank],
                                           1.0f / ((float)j_size[rank] * J_WORLD), &lm));
        else
            TDM_TRY(tdm_ddp_forward(ddp, x, y, j_size[rank], &lm));
        sh->active[rank][s] = tdm_ddp_active_ranks(ddp);
        TDM_TRY(tdm_ddp_backward(ddp));
        TDM_TRY(tdm_ddp_step(ddp, opt));
    }
    TDM_TRY(tdm_ddp_join(ddp, opt, &sh->shadowed[rank]));
    sh->n_elem = tdm_model_param_elems(m);
    memcpy(sh->params[rank], tdm_model_params(m), (size_t)sh->n_elem * 4);
fail:
    sh->status[rank] = st;
    if (st) snprintf(sh->err[rank], sizeof sh->err[rank], "%s", tdm_error_message());
    tdm_ddp_free(ddp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

static void j_check_uneven(int scaled)
{
    j_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                        -1, 0);
    cr_assert(sh != MAP_FAILED);
    memset(sh, 0, sizeof *sh);
    j_arg a = {.sh = sh, .join = 1, .scaled = scaled};
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    tdm_status st = tdm_dist_spawn(J_WORLD, j_rank, &a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s / %s / %s / %s", tdm_error_message(), sh->err[0],
                 sh->err[1], sh->err[2]);
    for (int r = 0; r < J_WORLD; r++) {
        cr_assert_eq(sh->shadowed[r], J_STEPS - j_batches[r], "rank %d shadowed %lld steps", r,
                     (long long)sh->shadowed[r]);
        for (int s = 0; s < j_batches[r]; s++) {
            int want = 0;
            for (int k = 0; k < J_WORLD; k++) want += j_batches[k] > s;
            cr_assert_eq(sh->active[r][s], want, "rank %d step %d: %d active", r, s,
                         sh->active[r][s]);
        }
        cr_assert(!memcmp(sh->params[r], sh->params[0], (size_t)sh->n_elem * 4),
                  "rank %d's parameters differ from rank 0's", r);
    }
    static float ref[TDDP_MAX_ELEMS];
    int64_t n = 0;
    tdm_model_spec spec;
    tddp_spec(&spec, 0);
    cr_assert_eq(tddp_join_reference(&spec, &g_data, ref, &n), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(n, sh->n_elem);
    int64_t at = 0;
    cr_assert(tddp_excess(sh->params[0], ref, n, 1e-6, 1e-5, &at) <= 0,
              "param[%lld] %.9g vs one device %.9g", (long long)at, sh->params[0][at], ref[at]);
    munmap(sh, sizeof *sh);
}

Test(ddp_join, uneven_ranks_finish_and_equal_one_device) { j_check_uneven(0); }

/* tdm_ddp_forward_scaled with a scale meant for every rank (1/(batch *
 * world)) averages over the ranks with data too: it failed (the scale
 * was taken as given, so the steps with fewer ranks were too small). */
Test(ddp_join, forward_scaled_averages_over_the_ranks_with_data)
{
    j_check_uneven(1);
}

/* Without opts.join, tdm_ddp_join is refused naming the option, and the
 * ranks still training fail (their peer left) instead of hanging. */
Test(ddp_join, join_without_the_option_is_refused_and_nobody_hangs)
{
    j_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                        -1, 0);
    cr_assert(sh != MAP_FAILED);
    memset(sh, 0, sizeof *sh);
    j_arg a = {.sh = sh, .join = 0};
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = tu_scaled_ms(5000)};
    tdm_status st = tdm_dist_spawn(J_WORLD, j_rank, &a, &so, NULL);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert(strstr(sh->err[0], "opts.join"), "rank 0: %s", sh->err[0]);
    cr_assert(sh->status[2] != 0, "rank 2 (8 batches) finished without its peers");
    munmap(sh, sizeof *sh);
}

/* Join while the ranks still training accumulate under no_sync (two
 * micro-batches per optimizer step, the accumulation ddp.h documents):
 * rank 0 runs 2 steps, rank 1 one and then joins. The joined rank must
 * shadow only the others' synchronised step, not one per forward: it
 * failed with a collective mismatch ("rank 1 called all_gather ... but
 * rank 0 called all_reduce", found in review) when it ran a synchronised
 * backward and a step for each of rank 0's no_sync forwards. */
typedef struct {
    int status[2];
    int64_t shadowed[2];
    float p[2][64];
    char err[2][512];
} jns_shared;
static jns_shared *g_jns;

static int jns_rank(tdm_comm *comm, void *arg)
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
    tdm_ddp_opts o = {.join = 1, .timeout_ms = tu_scaled_ms(5000)};
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
    TDM_TRY(tdm_ddp_join(d, opt, &g_jns->shadowed[rank]));
    int64_t n = tdm_model_param_elems(m);
    memcpy(g_jns->p[rank], tdm_model_params(m), (size_t)(n < 64 ? n : 64) * sizeof(float));
fail:
    g_jns->status[rank] = st;
    if (st) snprintf(g_jns->err[rank], sizeof g_jns->err[rank], "%s", tdm_error_message());
    tdm_ddp_free(d);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(ddp_join, joined_rank_shadows_only_the_synchronised_steps_of_no_sync_accumulation)
{
    g_jns = mmap(NULL, sizeof *g_jns, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
                 0);
    cr_assert(g_jns != MAP_FAILED);
    memset(g_jns, 0, sizeof *g_jns);
    tdm_dist_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000),
                             .comm_timeout_ms = tu_scaled_ms(10000)};
    tdm_status st = tdm_dist_spawn(2, jns_rank, NULL, &so, NULL);
    cr_expect_eq(st, TDM_STATUS_OK, "spawn: %s", tdm_error_message());
    cr_expect_eq(g_jns->status[0], 0, "rank 0: %s", g_jns->err[0]);
    cr_expect_eq(g_jns->status[1], 0, "rank 1: %s", g_jns->err[1]);
    cr_expect_eq(g_jns->shadowed[0], 0);
    cr_expect_eq(g_jns->shadowed[1], 1, "rank 1 shadowed %lld steps of rank 0's 1 after it joined",
                 (long long)g_jns->shadowed[1]);
    cr_expect(!memcmp(g_jns->p[0], g_jns->p[1], sizeof g_jns->p[0]), "replicas differ");
    munmap(g_jns, sizeof *g_jns);
}

/* ---- the flight recorder names Join's collectives ---- */

/* The labels of rank r's dump in dir: every entry must have one (the
 * count of those labelled `want` in *n_want); returns the last entry's
 * label and state (copied). */
static void jfr_labels(const char *dir, int r, const char *want, int *n_want, char *last_label,
                       char *last_state, size_t cap)
{
    tdm_json *doc = fr_t_load(dir, r);
    cr_assert_not_null(doc, "rank %d left no dump in %s", r, dir);
    const tdm_json *e = tdm_json_get(doc, "entries");
    cr_assert(e && e->type == TDM_JSON_ARRAY && e->n > 0, "rank %d: no entries", r);
    *n_want = 0;
    for (int i = 0; i < e->n; i++) {
        const tdm_json *c = tdm_json_get(&e->items[i], "coll");
        const tdm_json *l = tdm_json_get(&e->items[i], "label");
        const tdm_json *s = tdm_json_get(&e->items[i], "state");
        cr_assert(c && c->type == TDM_JSON_STRING && l && l->type == TDM_JSON_STRING && s &&
                  s->type == TDM_JSON_STRING);
        cr_expect(l->str[0], "rank %d: %s #%d has no label", r, c->str, i);
        *n_want += !strcmp(l->str, want);
        if (i == e->n - 1) {
            snprintf(last_label, cap, "%s", l->str);
            snprintf(last_state, cap, "%s", s->str);
        }
    }
    tdm_json_free(doc);
}

/* Every collective of a joined run has a label, the count of the ranks
 * with data ("ddp join count") and, for the CNN, the buffer broadcasts
 * that a joined rank shadows ("ddp broadcast buffers") included. Failed
 * before: the count's all_reduce and the broadcasts had an empty label. */
Test(ddp_join, every_collective_of_a_joined_run_is_labelled)
{
    for (int cnn = 0; cnn < 2; cnn++) {
        char dir[64];
        fr_t_dump_dir(dir, sizeof dir);
        j_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        cr_assert(sh != MAP_FAILED);
        memset(sh, 0, sizeof *sh);
        j_arg a = {.sh = sh, .join = 1, .cnn = cnn};
        tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
        tdm_status st = tdm_dist_spawn(J_WORLD, j_rank, &a, &so, NULL);
        unsetenv("TANDEM_FR_DUMP");
        cr_assert_eq(st, TDM_STATUS_OK, "cnn %d: %s / %s / %s / %s", cnn, tdm_error_message(),
                     sh->err[0], sh->err[1], sh->err[2]);
        for (int r = 0; r < J_WORLD; r++) {
            char last[128], state[128];
            int counts = 0, bcasts = 0;
            jfr_labels(dir, r, "ddp join count", &counts, last, state, sizeof last);
            /* each rank counts at each of its forwards and each shadowed
             * step, and all leave at the same last count */
            cr_expect_eq(counts, J_STEPS + 1, "cnn %d rank %d: %d 'ddp join count' entries",
                         cnn, r, counts);
            if (cnn) {
                jfr_labels(dir, r, "ddp broadcast buffers", &bcasts, last, state, sizeof last);
                cr_expect(bcasts >= J_STEPS, "cnn %d rank %d: %d 'ddp broadcast buffers'", cnn,
                          r, bcasts);
            }
        }
        munmap(sh, sizeof *sh);
        fr_t_rm_dir(dir);
    }
}

/* A rank stuck in Join's count is named by its dump: rank 1 runs one step
 * and joins; rank 0 dies (SIGKILL) after its first step, so rank 1 waits
 * in the count until the group learns of the death. Rank 1's dump ends in
 * the all_reduce labelled "ddp join count", not done: what `tandem
 * doctor` quotes ("the others waited in all_reduce(int32, sum, count=2)
 * 'ddp join count'"). Failed before: that entry's label was empty. */
static int jst_rank(tdm_comm *comm, void *arg)
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
    float x[2 * 8];
    int32_t y[2] = {0, 2};
    for (int i = 0; i < 16; i++) x[i] = (float)((i * 5 + rank) % 7) * 0.1f;
    tdm_model_spec_mlp(&spec, dims, 3);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_ddp_opts o = {.join = 1, .timeout_ms = 60000};
    TDM_TRY(tdm_ddp_init(&d, m, comm, &o));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.0f));
    TDM_TRY(tdm_ddp_zero_grad(d));
    TDM_TRY(tdm_ddp_forward(d, x, y, 2, NULL));
    TDM_TRY(tdm_ddp_backward(d));
    TDM_TRY(tdm_ddp_step(d, opt));
    if (rank == 0) raise(SIGKILL);   /* before its second forward's count */
    st = tdm_ddp_join(d, opt, NULL);  /* fails: its peer died */
fail:
    tdm_ddp_free(d);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(ddp_join, a_rank_stuck_in_the_join_count_is_named_by_its_dump)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    /* the death is seen by the spawner at once: no timeout is waited for */
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 60000};
    tdm_status st = tdm_dist_spawn(2, jst_rank, NULL, &so, NULL);
    unsetenv("TANDEM_FR_DUMP");
    cr_assert_neq(st, TDM_STATUS_OK, "rank 0 was killed, yet the job succeeded");
    char last[128], state[128];
    int counts = 0;
    jfr_labels(dir, 1, "ddp join count", &counts, last, state, sizeof last);
    cr_expect_str_eq(last, "ddp join count", "rank 1's last collective is '%s' (%s)", last,
                     state);
    cr_expect(strcmp(state, "done"), "rank 1's join count completed without rank 0");
    /* its first forward counted too */
    cr_expect_eq(counts, 2, "%d 'ddp join count' entries", counts);
    fr_t_rm_dir(dir);
}
