/* tests/test_fsdp_join.c: uneven inputs in the sharded modes
 * (tdm_fsdp_opts.join, tdm_fsdp_join), as tests/test_ddp_join.c for DDP.
 * Ranks with 3, 5 and 8 batches (of 4, 6 and 5 samples) all finish, in
 * every sharding, and equal a single-device run over the same samples
 * with the same per-step averaging: step s's gradient is the mean, over
 * the ranks that still had a batch, of each one's mean-loss gradient. The
 * CNN (buffers broadcast at every forward) and a bf16 hook join too; the
 * joined rank shadows the others' no_sync micro-batches (FULL_SHARD's
 * backward gathers included); without the option join is refused and
 * nobody hangs. Forked ranks, bounded run time. */
#include <criterion/criterion.h>

#include "core/json.h"
#include "tests/fr_test_util.h"
#include "tests/test_fsdp_util.h"

/* the plan, as DDP's (tests/test_ddp_util.h) */
#define J_WORLD TDDP_JOIN_WORLD
#define J_STEPS TDDP_JOIN_STEPS
#define j_batches tddp_join_batches
#define j_size tddp_join_size
#define j_first tddp_join_first
#define J_MAX_ELEMS 4096

static tdm_dataset g_mlp, g_cnn;
static void setup(void)
{
    tf_cfg m = tf_cfg_default(), c = tf_cfg_default();
    c.model = 1;
    cr_assert_eq(tf_data(&g_mlp, &m, 256), TDM_STATUS_OK);
    cr_assert_eq(tf_data(&g_cnn, &c, 256), TDM_STATUS_OK);
}
static void teardown(void)
{
    tdm_data_free(&g_mlp);
    tdm_data_free(&g_cnn);
}
TestSuite(fsdp_join, .init = setup, .fini = teardown, .timeout = 240);

typedef struct j_shared {
    float params[J_WORLD][J_MAX_ELEMS];
    int64_t n_elem, shadowed[J_WORLD];
    int active[J_WORLD][J_STEPS];
    int status[J_WORLD];
    char err[J_WORLD][512];
} j_shared;

typedef struct j_arg {
    j_shared *sh;
    tdm_fsdp_sharding sharding;
    int join, cnn, scaled;   /* scaled: tdm_fsdp_forward_scaled with 1/(batch * world) */
    int double_step;         /* every step twice (a step without backward) */
    tdm_fsdp_comm_hook hook;
} j_arg;

static const tdm_dataset *j_data(int cnn) { return cnn ? &g_cnn : &g_mlp; }

static void j_spec(tdm_model_spec *s, int cnn)
{
    tf_cfg c = tf_cfg_default();
    c.model = cnn;
    tf_spec(s, &c);
}

static int j_rank(tdm_comm *comm, void *p)
{
    j_arg *a = p;
    j_shared *sh = a->sh;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_fsdp *f = NULL;
    tdm_status st = TDM_STATUS_OK;
    tdm_model_spec spec;
    j_spec(&spec, a->cnn);
    const tdm_dataset *data = j_data(a->cnn);
    float x[8 * 64];
    int32_t y[8];
    cr_assert(tdm_data_features(data) * 8 <= (int64_t)(sizeof x / sizeof x[0]));
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_fsdp_opts o = {.sharding = a->sharding, .join = a->join, .comm_hook = a->hook,
                       .timeout_ms = 20000};
    TDM_TRY(tdm_fsdp_init(&f, m, comm, &o));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    oo.lr = 0.05f;
    oo.momentum = 0.9f;
    TDM_TRY(tdm_fsdp_optim_init(&opt, f, &oo));
    for (int s = 0; s < j_batches[rank]; s++) {
        int64_t idx[8];
        for (int i = 0; i < j_size[rank]; i++) idx[i] = j_first(rank, s) + i;
        tdm_data_gather(data, idx, j_size[rank], x, y);
        TDM_TRY(tdm_fsdp_zero_grad(f));
        if (a->scaled)
            TDM_TRY(tdm_fsdp_forward_scaled(f, x, y, j_size[rank],
                                            1.0f / ((float)j_size[rank] * J_WORLD), NULL));
        else
            TDM_TRY(tdm_fsdp_forward(f, x, y, j_size[rank], NULL));
        sh->active[rank][s] = tdm_fsdp_active_ranks(f);
        TDM_TRY(tdm_fsdp_backward(f));
        TDM_TRY(tdm_fsdp_step(f, opt));
        if (a->double_step) TDM_TRY(tdm_fsdp_step(f, opt));
    }
    TDM_TRY(tdm_fsdp_join(f, opt, &sh->shadowed[rank]));
    sh->n_elem = tdm_model_param_elems(m);
    cr_assert(sh->n_elem <= J_MAX_ELEMS);
    TDM_TRY(tdm_fsdp_gather_params(f, sh->params[rank], -1));
fail:
    sh->status[rank] = st;
    if (st) snprintf(sh->err[rank], sizeof sh->err[rank], "%s", tdm_error_message());
    tdm_fsdp_free(f);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

static void j_check(j_arg a, double tol)
{
    j_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                        -1, 0);
    cr_assert(sh != MAP_FAILED);
    memset(sh, 0, sizeof *sh);
    a.sh = sh;
    a.join = 1;
    const char *what = tdm_fsdp_sharding_name(a.sharding);
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    tdm_status st = tdm_dist_spawn(J_WORLD, j_rank, &a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s: %s / %s / %s / %s", what, tdm_error_message(),
                 sh->err[0], sh->err[1], sh->err[2]);
    for (int r = 0; r < J_WORLD; r++) {
        cr_assert_eq(sh->shadowed[r], J_STEPS - j_batches[r], "%s: rank %d shadowed %lld steps",
                     what, r, (long long)sh->shadowed[r]);
        for (int s = 0; s < j_batches[r]; s++) {
            int want = 0;
            for (int k = 0; k < J_WORLD; k++) want += j_batches[k] > s;
            cr_assert_eq(sh->active[r][s], want, "%s: rank %d step %d: %d active", what, r, s,
                         sh->active[r][s]);
        }
        cr_assert(!memcmp(sh->params[r], sh->params[0], (size_t)sh->n_elem * 4),
                  "%s: rank %d's parameters differ from rank 0's", what, r);
    }
    static float ref[J_MAX_ELEMS];
    int64_t n = 0;
    tdm_model_spec spec;
    j_spec(&spec, a.cnn);
    cr_assert_eq(tddp_join_reference(&spec, j_data(a.cnn), ref, &n), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(n, sh->n_elem);
    int64_t at = 0;
    cr_assert(tf_excess(sh->params[0], ref, n, tol, 10 * tol, &at) <= 0,
              "%s (cnn %d, hook %s): param[%lld] %.9g vs one device %.9g", what, a.cnn,
              tdm_fsdp_comm_hook_name(a.hook), (long long)at, sh->params[0][at], ref[at]);
    munmap(sh, sizeof *sh);
}

Test(fsdp_join, uneven_ranks_finish_and_equal_one_device)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        j_check((j_arg){.sharding = (tdm_fsdp_sharding)s}, 1e-6);
}

/* tdm_fsdp_forward_scaled with a scale meant for every rank averages over
 * the ranks with data too. */
Test(fsdp_join, forward_scaled_averages_over_the_ranks_with_data)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        j_check((j_arg){.sharding = (tdm_fsdp_sharding)s, .scaled = 1}, 1e-6);
}

/* The CNN: the joined rank takes part in the buffer broadcasts (and, in
 * FULL_SHARD, runs its zero sample without learning statistics from it). */
Test(fsdp_join, cnn_with_buffers_joins)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        j_check((j_arg){.sharding = (tdm_fsdp_sharding)s, .cnn = 1}, 1e-5);
}

/* Join and a bf16 hook together: zero contributions compress to zeros;
 * within bf16's rounding of one device (8 significant bits per step). */
Test(fsdp_join, join_with_a_bf16_hook)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++)
        j_check((j_arg){.sharding = (tdm_fsdp_sharding)s, .hook = TDM_FSDP_HOOK_BF16}, 2e-3);
}

/* The flight recorder names every collective of a joined run, the count
 * of the ranks with data included: a rank that hangs while the others
 * shadow it is in "<family> join count" in `tandem doctor`, not in an
 * unlabelled all_reduce. Failed before: rank 0's dump held an all_reduce
 * with an empty label (the count's) at every training forward. */
Test(fsdp_join, every_collective_of_a_joined_run_is_labelled)
{
    static const char *const family[] = {"fsdp", "zero2", "zero1"};
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++) {
        char dir[64];
        fr_t_dump_dir(dir, sizeof dir);
        j_check((j_arg){.sharding = (tdm_fsdp_sharding)s}, 1e-6);
        unsetenv("TANDEM_FR_DUMP");
        for (int r = 0; r < J_WORLD; r++) {
            tdm_json *doc = fr_t_load(dir, r);
            cr_assert_not_null(doc, "%s: rank %d left no dump in %s", family[s], r, dir);
            const tdm_json *e = tdm_json_get(doc, "entries");
            cr_assert(e && e->type == TDM_JSON_ARRAY);
            int counts = 0;
            char want[64];
            snprintf(want, sizeof want, "%s join count", family[s]);
            for (int i = 0; i < e->n; i++) {
                const tdm_json *c = tdm_json_get(&e->items[i], "coll");
                const tdm_json *l = tdm_json_get(&e->items[i], "label");
                cr_assert(c && c->type == TDM_JSON_STRING && l && l->type == TDM_JSON_STRING);
                cr_expect(l->str[0], "%s rank %d: %s #%d has no label", family[s], r, c->str, i);
                counts += !strcmp(l->str, want);
            }
            /* the recorder keeps the last entries: some counts are among them */
            cr_expect(counts > 0, "%s rank %d: no '%s' in the dump", family[s], r, want);
            tdm_json_free(doc);
        }
        fr_t_rm_dir(dir);
    }
}

/* Without opts.join, tdm_fsdp_join is refused naming the option, and the
 * ranks still training fail (their peer left) instead of hanging. */
Test(fsdp_join, join_without_the_option_is_refused_and_nobody_hangs)
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

/* A second tdm_fsdp_step without a backward while a rank has joined: in
 * grad_op and optimizer each step all-gathers, and the joined rank
 * shadows one step per backward, so the second step's gathers have no
 * partner. It is refused on the ranks that still train, naming the
 * cause, and the communicator aborted so that the joined rank fails at
 * once too. (Before: mismatched collectives, an all_gather against the
 * joined rank's count, which shm names and NCCL would wait on until the
 * timeout.) */
Test(fsdp_join, a_step_without_backward_while_a_rank_has_joined_is_refused)
{
    for (int sh_i = 1; sh_i < TDM_FSDP_SHARDING_COUNT_; sh_i++) {
        j_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        cr_assert(sh != MAP_FAILED);
        memset(sh, 0, sizeof *sh);
        j_arg a = {.sh = sh, .join = 1, .double_step = 1,
                   .sharding = (tdm_fsdp_sharding)sh_i};
        tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = tu_scaled_ms(30000)};
        tdm_status st = tdm_dist_spawn(J_WORLD, j_rank, &a, &so, NULL);
        cr_assert_neq(st, TDM_STATUS_OK);
        cr_assert(strstr(sh->err[2], "without a backward"), "sharding %d, rank 2: %s", sh_i,
                  sh->err[2]);
        munmap(sh, sizeof *sh);
    }
}

/* Join while the ranks still training accumulate under no_sync (two
 * micro-batches per optimizer step): rank 0 runs 3 steps, rank 1 one and
 * then joins. The joined rank shadows both micro-batches of each of rank
 * 0's steps (in FULL_SHARD the no_sync backward gathers parameters too)
 * and steps only after the synchronised one; the result equals one
 * device running the same micro-batches with the same averaging (both
 * ranks' in step 0, rank 0's alone after). */
typedef struct {
    int status[2];
    int64_t shadowed[2];
    float p[2][J_MAX_ELEMS];
    int64_t n;
    char err[2][512];
} jns_shared;

typedef struct {
    jns_shared *sh;
    tdm_fsdp_sharding sharding;
} jns_arg;

static void jns_data(int rank, float *x, int32_t *y)
{
    for (int i = 0; i < 32; i++) x[i] = (float)((i * 7 + rank) % 11) * 0.1f;
    for (int i = 0; i < 4; i++) y[i] = i % 3;
}

static void jns_spec(tdm_model_spec *spec)
{
    static const int dims[] = {8, 6, 3};
    tdm_model_spec_mlp(spec, dims, 3);
}

/* One device: step s, micro-batch k: each active rank's 2 samples, scaled
 * by 1/(2 * active ranks) (tdm_fsdp_forward's mean over them). */
static void jns_reference(float *out, int64_t *n)
{
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    jns_spec(&spec);
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, 5), TDM_STATUS_OK);
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    cr_assert_eq(tdm_optim_init(&opt, m, &oo), TDM_STATUS_OK);
    for (int s = 0; s < 3; s++) {
        int active = s == 0 ? 2 : 1;
        cr_assert_eq(tdm_model_zero_grad(m), TDM_STATUS_OK);
        for (int k = 0; k < 2; k++)
            for (int r = 0; r < active; r++) {
                float x[32];
                int32_t y[4];
                jns_data(r, x, y);
                const float *logits;
                double ls;
                cr_assert_eq(tdm_model_forward(m, x + 16 * k, 2, &logits), TDM_STATUS_OK);
                float *dl = tdm_model_loss_grad(m);
                cr_assert_eq(tdm_model_loss(m, logits, y + 2 * k, 2, 1.0f / (2.0f * (float)active),
                                            &ls, dl), TDM_STATUS_OK);
                cr_assert_eq(tdm_model_backward(m, dl), TDM_STATUS_OK);
            }
        cr_assert_eq(tdm_optim_step(opt), TDM_STATUS_OK);
    }
    *n = tdm_model_param_elems(m);
    memcpy(out, tdm_model_params(m), (size_t)*n * 4);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
}

static int jns_rank(tdm_comm *comm, void *arg)
{
    jns_arg *a = arg;
    jns_shared *sh = a->sh;
    int rank = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_fsdp *f = NULL;
    tdm_model_spec spec;
    tdm_status st = TDM_STATUS_OK;
    float x[4 * 8];
    int32_t y[4];
    jns_data(rank, x, y);
    jns_spec(&spec);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_fsdp_opts o = {.sharding = a->sharding, .join = 1, .timeout_ms = tu_scaled_ms(5000)};
    TDM_TRY(tdm_fsdp_init(&f, m, comm, &o));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    TDM_TRY(tdm_fsdp_optim_init(&opt, f, &oo));
    int steps = rank == 0 ? 3 : 1;
    for (int s = 0; s < steps; s++) {
        TDM_TRY(tdm_fsdp_zero_grad(f));
        for (int k = 0; k < 2; k++) {
            tdm_fsdp_no_sync(f, k == 0);
            TDM_TRY(tdm_fsdp_forward(f, x + 16 * k, y + 2 * k, 2, NULL));
            TDM_TRY(tdm_fsdp_backward(f));
        }
        TDM_TRY(tdm_fsdp_step(f, opt));
    }
    TDM_TRY(tdm_fsdp_join(f, opt, &sh->shadowed[rank]));
    sh->n = tdm_model_param_elems(m);
    TDM_TRY(tdm_fsdp_gather_params(f, sh->p[rank], -1));
fail:
    sh->status[rank] = st;
    if (st) snprintf(sh->err[rank], sizeof sh->err[rank], "%s", tdm_error_message());
    tdm_fsdp_free(f);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(fsdp_join, joined_rank_shadows_no_sync_micro_batches)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++) {
        jns_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        cr_assert(sh != MAP_FAILED);
        memset(sh, 0, sizeof *sh);
        jns_arg a = {.sh = sh, .sharding = (tdm_fsdp_sharding)s};
        tdm_dist_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000),
                                 .comm_timeout_ms = tu_scaled_ms(10000)};
        tdm_status st = tdm_dist_spawn(2, jns_rank, &a, &so, NULL);
        cr_assert_eq(st, TDM_STATUS_OK, "%s: %s / %s / %s", tdm_fsdp_sharding_name(a.sharding),
                     tdm_error_message(), sh->err[0], sh->err[1]);
        cr_assert_eq(sh->shadowed[0], 0);
        cr_assert_eq(sh->shadowed[1], 2, "rank 1 shadowed %lld synchronised steps",
                     (long long)sh->shadowed[1]);
        cr_assert(!memcmp(sh->p[0], sh->p[1], (size_t)sh->n * 4));
        static float ref[J_MAX_ELEMS];
        int64_t n = 0, at = 0;
        jns_reference(ref, &n);
        cr_assert_eq(n, sh->n);
        cr_assert(tf_excess(sh->p[0], ref, n, 1e-6, 1e-5, &at) <= 0,
                  "%s: param[%lld] %.9g vs one device %.9g", tdm_fsdp_sharding_name(a.sharding),
                  (long long)at, sh->p[0][at], ref[at]);
        munmap(sh, sizeof *sh);
    }
}
