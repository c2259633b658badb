/* tests/test_fsdp_ckpt.c: checkpoints of sharded data parallel. The full
 * form is the file every mode writes (FSDP's loads into one device, one
 * device's into FSDP at another N); resuming from it, or from the sharded
 * form (a file per rank plus an index), gives bitwise the parameters of an
 * uninterrupted run; the sharded form reshards to another N; a file of
 * another model, a missing tensor, a missing rank file and another unit
 * layout are refused, naming what differs, on every rank. */
#include <criterion/criterion.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "models/checkpoint.h"
#include "tests/test_fsdp_util.h"
#include "tests/test_util.h"

static tdm_dataset g_data;
static char g_dir[64];

static void setup(void)
{
    tf_cfg c = tf_cfg_default();
    cr_assert_eq(tf_data(&g_data, &c, 600), TDM_STATUS_OK);
    tu_mkdtemp(g_dir, sizeof g_dir, "fsdpck");
}

static void teardown(void)
{
    tdm_data_free(&g_data);
    tu_rmtree(g_dir);
}

TestSuite(fsdp_ckpt, .init = setup, .fini = teardown, .timeout = 240);

typedef struct ck_cfg {
    tf_cfg base;                 /* model, batch, sharding, optimizer */
    const char *load_full, *load_sharded;
    int first_step, steps;       /* data steps first_step .. first_step + steps - 1 */
    const char *save_full, *save_sharded;
    int64_t info_step;           /* > 0: the step the caller saves with (else the optimizer's) */
} ck_cfg;

typedef struct ck_shared {
    float params[TF_MAX_ELEMS];
    int64_t n_elem, opt_steps, info_step;
    int status[8];
    char err[8][512];
} ck_shared;

typedef struct ck_run {
    const ck_cfg *cfg;
    ck_shared *sh;
} ck_run;

static int ck_rank(tdm_comm *comm, void *arg)
{
    ck_run *run = arg;
    const ck_cfg *c = run->cfg;
    ck_shared *sh = run->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_fsdp *f = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    int64_t perm[600];
    float *x = NULL, *h = NULL;
    int32_t *y = NULL;
    tdm_status st = TDM_STATUS_OK;
    tf_spec(&spec, &c->base);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_fsdp_opts o = {.sharding = c->base.sharding, .min_unit_elems = c->base.min_unit_elems,
                       .timeout_ms = 20000};
    TDM_TRY(tdm_fsdp_init(&f, m, comm, &o));
    tdm_optim_opts oo;
    tf_optim_opts(&oo, &c->base);
    TDM_TRY(tdm_fsdp_optim_init(&opt, f, &oo));
    tdm_ckpt_info info = {0};
    if (c->load_full) TDM_TRY(tdm_fsdp_load_full(f, c->load_full, opt, &info));
    if (c->load_sharded) TDM_TRY(tdm_fsdp_load_sharded(f, c->load_sharded, opt, &info));
    sh->info_step = info.step;
    int64_t feat = c->base.model == 2 ? TF_GPT_T : tdm_data_features(&g_data);
    x = malloc((size_t)c->base.batch * (size_t)feat * 4);
    y = malloc((size_t)c->base.batch * TF_GPT_T * 4);
    h = malloc((size_t)tdm_model_param_elems(m) * 4);
    tdm_train_epoch_order(perm, g_data.n, 1, 0);
    for (int s = c->first_step; s < c->first_step + c->steps; s++) {
        int lo = (int)((int64_t)rank * c->base.batch / world);
        int hi = (int)((int64_t)(rank + 1) * c->base.batch / world);
        tf_batch(&c->base, &g_data, perm, s, lo, hi, x, y);
        TDM_TRY(tdm_fsdp_zero_grad(f));
        TDM_TRY(tdm_fsdp_forward_scaled(f, x, y, hi - lo, 1.0f / (float)c->base.batch, NULL));
        TDM_TRY(tdm_fsdp_backward(f));
        TDM_TRY(tdm_fsdp_step(f, opt));
    }
    tdm_ckpt_info out = {.step = c->info_step > 0 ? c->info_step : tdm_optim_steps(opt),
                         .epoch = 0, .seed = 5};
    if (c->save_full) TDM_TRY(tdm_fsdp_save_full(f, c->save_full, opt, &out));
    if (c->save_sharded) TDM_TRY(tdm_fsdp_save_sharded(f, c->save_sharded, opt, &out));
    TDM_TRY(tdm_fsdp_gather_params(f, h, 0));
    if (rank == 0) {
        sh->n_elem = tdm_model_param_elems(m);
        memcpy(sh->params, h, (size_t)sh->n_elem * 4);
        sh->opt_steps = tdm_optim_steps(opt);
    }
fail:
    if (rank < 8) {
        sh->status[rank] = st;
        snprintf(sh->err[rank], sizeof sh->err[rank], "%s", st ? tdm_error_message() : "");
    }
    free(x);
    free(y);
    free(h);
    tdm_fsdp_free(f);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

static ck_shared *ck_new(void)
{
    ck_shared *p = mmap(NULL, sizeof(ck_shared), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(p != MAP_FAILED);
    memset(p, 0, sizeof *p);
    return p;
}

static tdm_status ck_spawn(int world, const ck_cfg *c, ck_shared *sh)
{
    ck_run run = {.cfg = c, .sh = sh};
    tdm_dist_spawn_opts o = {.timeout_ms = 120000, .comm_timeout_ms = 20000};
    return tdm_dist_spawn(world, ck_rank, &run, &o, NULL);
}

static void ck_ok(int world, const ck_cfg *c, ck_shared *sh, const char *what)
{
    tdm_status st = ck_spawn(world, c, sh);
    cr_assert_eq(st, TDM_STATUS_OK, "%s: %s / rank 0: %s / rank 1: %s", what, tdm_error_message(),
                 sh->err[0], sh->err[1]);
}

static const char *P(const char *name) { return tu_tpath(g_dir, name); }

Test(fsdp_ckpt, resume_is_bit_exact_in_both_forms_every_sharding)
{
    for (int shd = 0; shd < TDM_FSDP_SHARDING_COUNT_; shd++) {
        for (int adamw = 0; adamw < 2; adamw++) {
            ck_cfg c = {.base = tf_cfg_default(), .steps = 6};
            c.base.sharding = (tdm_fsdp_sharding)shd;
            c.base.adamw = adamw;
            c.base.batch = 23;
            ck_shared *ref = ck_new(), *a = ck_new(), *b = ck_new(), *d = ck_new();
            ck_ok(3, &c, ref, "uninterrupted");
            char full[256], shard[256];
            snprintf(full, sizeof full, "%s", P("full.safetensors"));
            snprintf(shard, sizeof shard, "%s", P("sharded.index"));
            ck_cfg c1 = c;
            c1.steps = 3;
            c1.save_full = full;
            c1.save_sharded = shard;
            ck_ok(3, &c1, a, "first half");
            ck_cfg c2 = c;
            c2.first_step = 3;
            c2.steps = 3;
            c2.load_full = full;
            ck_ok(3, &c2, b, "resumed from the full form");
            ck_cfg c3 = c2;
            c3.load_full = NULL;
            c3.load_sharded = shard;
            ck_ok(3, &c3, d, "resumed from the sharded form");
            cr_assert_eq(b->info_step, 3);
            cr_assert_eq(b->opt_steps, 6);
            cr_assert_eq(d->opt_steps, 6);
            cr_assert(!memcmp(ref->params, b->params, (size_t)ref->n_elem * 4),
                      "%s adamw %d: resumed (full form) differs", tdm_fsdp_sharding_name(c.base.sharding),
                      adamw);
            cr_assert(!memcmp(ref->params, d->params, (size_t)ref->n_elem * 4),
                      "%s adamw %d: resumed (sharded form) differs",
                      tdm_fsdp_sharding_name(c.base.sharding), adamw);
            munmap(ref, sizeof *ref);
            munmap(a, sizeof *a);
            munmap(b, sizeof *b);
            munmap(d, sizeof *d);
        }
    }
}

/* A caller's own step count (100) is saved and returned as the caller's,
 * and the optimizer resumes with its own (2: AdamW's bias correction), in
 * both forms; it was restored from the caller's. */
Test(fsdp_ckpt, the_optimizer_keeps_its_own_step_count)
{
    ck_cfg c = {.base = tf_cfg_default(), .steps = 2, .info_step = 100};
    c.base.adamw = 1;
    char full[256], shard[256];
    snprintf(full, sizeof full, "%s", P("steps.safetensors"));
    snprintf(shard, sizeof shard, "%s", P("steps.index"));
    c.save_full = full;
    c.save_sharded = shard;
    ck_shared *a = ck_new(), *b = ck_new(), *d = ck_new();
    ck_ok(2, &c, a, "saved");
    ck_cfg c2 = {.base = c.base, .steps = 0, .load_full = full};
    ck_ok(2, &c2, b, "loaded (full form)");
    ck_cfg c3 = {.base = c.base, .steps = 0, .load_sharded = shard};
    ck_ok(2, &c3, d, "loaded (sharded form)");
    cr_expect_eq(b->info_step, 100);
    cr_expect_eq(d->info_step, 100);
    cr_expect_eq(b->opt_steps, 2, "full form: the optimizer resumed at step %lld",
                 (long long)b->opt_steps);
    cr_expect_eq(d->opt_steps, 2, "sharded form: the optimizer resumed at step %lld",
                 (long long)d->opt_steps);
    munmap(a, sizeof *a);
    munmap(b, sizeof *b);
    munmap(d, sizeof *d);
}

static void expect_meta(const char *path, const char *key, const char *want)
{
    tdm_st_file *f = NULL;
    cr_assert_eq(tdm_st_load(&f, path), TDM_STATUS_OK, "%s: %s", path, tdm_error_message());
    const char *v = tdm_st_meta_get(f, key);
    if (want) cr_expect(v && !strcmp(v, want), "%s: '%s' is '%s', not '%s'", path, key,
                        v ? v : "(none)", want);
    else cr_expect(!v, "%s: '%s' is '%s' with no run set", path, key, v ? v : "");
    tdm_st_free(f);
}

/* The full file and the sharded form's index carry the same metadata
 * (tdm_checkpoint_meta): the caller's step, the optimizer's own count,
 * and the run the process belongs to (tdm_checkpoint_set_run, inherited
 * by the forked ranks), which a restart checks; none without a run. */
Test(fsdp_ckpt, both_forms_carry_the_step_counts_and_the_run)
{
    ck_cfg c = {.base = tf_cfg_default(), .steps = 2, .info_step = 100};
    c.base.adamw = 1;
    for (int with_run = 1; with_run >= 0; with_run--) {
        char full[256], shard[256];
        snprintf(full, sizeof full, "%s/run%d.safetensors", g_dir, with_run);
        snprintf(shard, sizeof shard, "%s/run%d.index", g_dir, with_run);
        c.save_full = full;
        c.save_sharded = shard;
        tdm_checkpoint_set_run(with_run ? "00000000000000c3" : NULL);
        ck_shared *a = ck_new();
        ck_ok(2, &c, a, "saved");
        for (int form = 0; form < 2; form++) {
            const char *p = form ? shard : full;
            expect_meta(p, "step", "100");
            expect_meta(p, "optimizer_steps", "2");
            expect_meta(p, "run", with_run ? "00000000000000c3" : NULL);
        }
        munmap(a, sizeof *a);
    }
    tdm_checkpoint_set_run(NULL);
}

Test(fsdp_ckpt, full_form_is_the_file_every_mode_reads_at_any_n)
{
    char full[256], back[256];
    snprintf(full, sizeof full, "%s", P("any.safetensors"));
    snprintf(back, sizeof back, "%s", P("back.safetensors"));
    /* FSDP (full, 4 ranks) writes; one device reads it */
    ck_cfg c = {.base = tf_cfg_default(), .steps = 2, .save_full = full};
    ck_shared *a = ck_new(), *b = ck_new();
    ck_ok(4, &c, a, "fsdp save");
    tdm_device *dev = tu_host();
    tdm_model *m = NULL;
    tdm_optim *o = NULL;
    tdm_model_spec spec;
    tf_spec(&spec, &c.base);
    TU_OK(tdm_model_init(&m, dev, &spec, 99));
    tdm_optim_opts oo;
    tf_optim_opts(&oo, &c.base);
    TU_OK(tdm_optim_init(&o, m, &oo));
    tdm_ckpt_info info;
    TU_OK(tdm_checkpoint_load(full, m, o, &info));
    cr_assert_eq(info.step, 2);
    cr_assert_eq(tdm_optim_steps(o), 2);
    cr_assert(!memcmp(tdm_model_params(m), a->params, (size_t)a->n_elem * 4));
    /* one device writes it back; FSDP grad_op at 3 ranks reads it */
    TU_OK(tdm_checkpoint_save(back, m, o, &info));
    ck_cfg r = {.base = tf_cfg_default(), .load_full = back};
    r.base.sharding = TDM_FSDP_SHARD_GRAD_OP;
    ck_ok(3, &r, b, "fsdp load at another N");
    cr_assert(!memcmp(b->params, a->params, (size_t)a->n_elem * 4));
    cr_assert_eq(b->opt_steps, 2);
    tdm_optim_free(o);
    tdm_model_free(m);
    tdm_device_free(dev);
    munmap(a, sizeof *a);
    munmap(b, sizeof *b);
}

Test(fsdp_ckpt, sharded_form_reshards_to_another_n)
{
    char shard[256], f2[256], f3[256];
    snprintf(shard, sizeof shard, "%s", P("re.index"));
    snprintf(f2, sizeof f2, "%s", P("re2.safetensors"));
    snprintf(f3, sizeof f3, "%s", P("re3.safetensors"));
    ck_cfg c = {.base = tf_cfg_default(), .steps = 2, .save_sharded = shard, .save_full = f2};
    c.base.adamw = 1;
    ck_shared *a = ck_new(), *b = ck_new();
    ck_ok(2, &c, a, "save at 2");
    for (int w = 1; w <= 4; w++) {
        ck_cfg r = {.base = c.base, .load_sharded = shard, .save_full = f3};
        ck_ok(w, &r, b, "load at another N");
        cr_assert(!memcmp(b->params, a->params, (size_t)a->n_elem * 4), "world %d", w);
        /* optimizer state too: the full files written at 2 and at w are
         * the same bytes */
        tdm_st_file *x = NULL, *y = NULL;
        TU_OK(tdm_st_load(&x, f2));
        TU_OK(tdm_st_load(&y, f3));
        cr_assert_eq(tdm_st_count(x), tdm_st_count(y));
        for (int i = 0; i < tdm_st_count(x); i++) {
            const tdm_st_tensor *tx = tdm_st_get(x, i), *ty = tdm_st_find(y, tdm_st_get(x, i)->name);
            cr_assert(ty && tx->nbytes == ty->nbytes && !memcmp(tx->data, ty->data, tx->nbytes),
                      "world %d: tensor %s differs", w, tx->name);
        }
        tdm_st_free(x);
        tdm_st_free(y);
    }
    munmap(a, sizeof *a);
    munmap(b, sizeof *b);
}

static void ck_refused(int world, const ck_cfg *c, const char *needle)
{
    ck_shared *s = ck_new();
    cr_assert_neq(ck_spawn(world, c, s), TDM_STATUS_OK, "loaded what it should refuse");
    for (int r = 0; r < world; r++)
        cr_assert(strstr(s->err[r], needle), "rank %d: '%s' lacks '%s'", r, s->err[r], needle);
    munmap(s, sizeof *s);
}

Test(fsdp_ckpt, wrong_files_are_refused_naming_what_differs)
{
    char full[256], shard[256], bad[256];
    snprintf(full, sizeof full, "%s", P("w.safetensors"));
    snprintf(shard, sizeof shard, "%s", P("w.index"));
    snprintf(bad, sizeof bad, "%s", P("partial.safetensors"));
    ck_cfg c = {.base = tf_cfg_default(), .steps = 1, .save_full = full, .save_sharded = shard};
    ck_shared *a = ck_new();
    ck_ok(2, &c, a, "save");
    /* another model */
    static const int dims[] = {20, 8, 5};
    ck_cfg o = {.base = tf_cfg_default(), .load_full = full};
    o.base.dims = dims;
    o.base.ndims = 3;
    ck_refused(2, &o, "checkpoint is of model 'mlp 20-16-12-5'");
    o.load_full = NULL;
    o.load_sharded = shard;
    ck_refused(2, &o, "checkpoint is of model 'mlp 20-16-12-5'");
    /* the same model's file with a tensor missing: named */
    tdm_st_file *src = NULL;
    TU_OK(tdm_st_load(&src, full));
    tdm_st_tensor t[64];
    tdm_st_meta meta[16];
    int nt = 0;
    for (int i = 0; i < tdm_st_count(src); i++)
        if (strcmp(tdm_st_get(src, i)->name, "fc2.weight")) t[nt++] = *tdm_st_get(src, i);
    for (int i = 0; i < tdm_st_meta_count(src); i++) meta[i] = *tdm_st_meta_at(src, i);
    TU_OK(tdm_st_save(bad, t, nt, meta, tdm_st_meta_count(src)));
    tdm_st_free(src);
    ck_cfg p = {.base = tf_cfg_default(), .load_full = bad};
    ck_refused(3, &p, "fc2.weight");
    /* another unit layout, for the sharded form */
    ck_cfg u = {.base = tf_cfg_default(), .load_sharded = shard};
    u.base.min_unit_elems = 300;
    ck_refused(2, &u, "unit 1 differs");
    /* a rank file gone: named, on every rank */
    tdm_st_file *ix = NULL;
    TU_OK(tdm_st_load(&ix, shard));
    char gone[512];
    snprintf(gone, sizeof gone, "%s.%s.rank1-of-2", shard, tdm_st_meta_get(ix, "id"));
    tdm_st_free(ix);
    cr_assert_eq(unlink(gone), 0, "%s", gone);
    ck_cfg g = {.base = tf_cfg_default(), .load_sharded = shard};
    ck_refused(2, &g, "rank1-of-2");
    munmap(a, sizeof *a);
}

Test(fsdp_ckpt, a_new_sharded_save_replaces_the_old_files)
{
    char shard[256];
    snprintf(shard, sizeof shard, "%s", P("rot.index"));
    ck_cfg c = {.base = tf_cfg_default(), .steps = 1, .save_sharded = shard};
    ck_shared *a = ck_new();
    ck_ok(3, &c, a, "first save");
    ck_cfg c2 = {.base = tf_cfg_default(), .load_sharded = shard, .first_step = 1, .steps = 1,
                 .save_sharded = shard};
    ck_ok(2, &c2, a, "second save at 2 ranks");
    /* the index and the two new rank files: nothing else */
    int files = 0;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls %s | grep -c '^rot.index'", g_dir);
    FILE *p = popen(cmd, "r");
    cr_assert(p && fscanf(p, "%d", &files) == 1);
    pclose(p);
    cr_assert_eq(files, 3, "%d files named rot.index*", files);
    munmap(a, sizeof *a);
}
