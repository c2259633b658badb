/* tests/test_checkpoint.c: model checkpoints (models/checkpoint.c): bit-for-
 * bit round trips of parameters, buffers, SGD-momentum and AdamW state and
 * step/epoch/seed for the MLP and the CNN; refusals (other model, other
 * optimizer, a missing tensor, a wrong shape, not a checkpoint, unwritable
 * path) that name what is wrong and leave the model untouched; and resume
 * equivalence: 2 epochs == 1 epoch + save + load into a fresh model + 1
 * epoch, bit for bit. Not a test of the safetensors format itself. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/safetensors.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tests/test_util.h"

static char g_dir[64];
static tdm_device *g_dev;

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "ckpt");
    g_dev = tu_host();
}

static void teardown(void)
{
    tu_rmtree(g_dir);
    tdm_device_free(g_dev);
}

TestSuite(ckpt, .init = setup, .fini = teardown);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

static void spec_small_cnn(tdm_model_spec *s)
{
    tdm_model_spec_cnn(s);
    s->in_c = 1;
    s->in_h = 8;
    s->in_w = 8;
    s->ch1 = 4;
    s->ch2 = 6;
    s->n_classes = 4;
}

static void spec_small_mlp(tdm_model_spec *s)
{
    static const int dims[] = {64, 16, 4};
    tdm_model_spec_mlp(s, dims, 3);
}

static void make(const tdm_model_spec *s, tdm_optim_kind kind, uint64_t seed, tdm_model **m,
                 tdm_optim **o)
{
    TU_OK(tdm_model_init(m, g_dev, s, seed));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, kind);
    if (kind == TDM_OPTIM_SGD) {
        oo.lr = 0.05f;
        oo.momentum = 0.9f;
        oo.weight_decay = 1e-3f;
    } else {
        oo.lr = 0.01f;
    }
    TU_OK(tdm_optim_init(o, *m, &oo));
}

/* A few real steps so that parameters, running statistics and optimizer
 * state are all non-trivial. */
static void train_steps(tdm_model *m, tdm_optim *o, int steps, uint64_t seed)
{
    tdm_dataset d;
    TU_OK(tdm_data_synthetic(&d, 64, 1, 8, 8, 4, seed, 0));
    tdm_single s = {.model = m, .opt = o};
    tdm_epoch_stats es;
    TU_OK(tdm_train_epoch(&d, &(tdm_train_epoch_opts){.batch = 16, .seed = seed, .max_steps = steps,
                                                     .step = tdm_single_step, .step_ctx = &s},
                          &es));
    cr_assert_eq(es.steps, steps);
    tdm_single_free(&s);
    tdm_data_free(&d);
}

static void assert_same_state(tdm_model *a, tdm_optim *oa, tdm_model *b, tdm_optim *ob, const char *what)
{
    cr_assert_eq(tdm_model_param_elems(a), tdm_model_param_elems(b));
    cr_assert(memcmp(tdm_model_params(a), tdm_model_params(b),
                     (size_t)tdm_model_param_elems(a) * sizeof(float)) == 0,
              "%s: parameters differ", what);
    if (tdm_model_buffer_elems(a) > 0)
        cr_assert(memcmp(tdm_model_buffers(a), tdm_model_buffers(b),
                         (size_t)tdm_model_buffer_elems(a) * sizeof(float)) == 0,
                  "%s: buffers differ", what);
    if (!oa) return;
    cr_assert_eq(tdm_optim_n_state(oa), tdm_optim_n_state(ob));
    for (int s = 0; s < tdm_optim_n_state(oa); s++)
        cr_assert(memcmp(tdm_optim_state(oa, s), tdm_optim_state(ob, s),
                         (size_t)tdm_model_param_elems(a) * sizeof(float)) == 0,
                  "%s: optimizer state '%s' differs", what, tdm_optim_state_name(oa, s));
    cr_assert_eq(tdm_optim_steps(oa), tdm_optim_steps(ob), "%s: steps %lld vs %lld", what,
                 (long long)tdm_optim_steps(oa), (long long)tdm_optim_steps(ob));
}

Test(ckpt, round_trip_bit_for_bit)
{
    for (int cnn = 0; cnn < 2; cnn++)
        for (int k = 0; k < 2; k++) {
            tdm_optim_kind kind = k ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD;
            tdm_model_spec s;
            if (cnn) spec_small_cnn(&s);
            else spec_small_mlp(&s);
            tdm_model *a, *b;
            tdm_optim *oa, *ob;
            make(&s, kind, 1, &a, &oa);
            train_steps(a, oa, 3, 5);
            const char *p = tpath(cnn ? "cnn.safetensors" : "mlp.safetensors");
            tdm_ckpt_info in = {.step = tdm_optim_steps(oa), .epoch = 7, .seed = 0xfeedbeefcafe1234ull};
            TU_OK(tdm_checkpoint_save(p, a, oa, &in));
            make(&s, kind, 2, &b, &ob); /* other initial values: the load must overwrite */
            tdm_ckpt_info out = {0};
            TU_OK(tdm_checkpoint_load(p, b, ob, &out));
            char what[64];
            snprintf(what, sizeof what, "%s + %s", cnn ? "cnn" : "mlp", k ? "adamw" : "sgd");
            assert_same_state(a, oa, b, ob, what);
            cr_assert(out.step == 3 && out.epoch == 7 && out.seed == in.seed,
                      "%s: info step %lld epoch %lld seed %llx", what, (long long)out.step,
                      (long long)out.epoch, (unsigned long long)out.seed);
            /* model only: no optimizer on either side */
            tdm_model *c;
            TU_OK(tdm_model_init(&c, g_dev, &s, 3));
            const char *p2 = tpath("model_only.safetensors");
            TU_OK(tdm_checkpoint_save(p2, a, NULL, NULL));
            TU_OK(tdm_checkpoint_load(p2, c, NULL, NULL));
            assert_same_state(a, NULL, c, NULL, "model only");
            /* and a model-only file cannot restore an optimizer */
            cr_assert_neq(tdm_checkpoint_load(p2, c, ob, NULL), TDM_STATUS_OK,
                          "%s: optimizer state loaded from a file without it", what);
            tdm_model_free(c);
            tdm_optim_free(oa);
            tdm_optim_free(ob);
            tdm_model_free(a);
            tdm_model_free(b);
        }
}

/* The optimizer's own step count (AdamW's bias correction) is kept as it
 * is, whatever the caller's info.step says: a library caller counting
 * steps its own way (micro-batches, steps since a restart) must not
 * change the optimizer's arithmetic on resume (it was restored from
 * info.step: 100 here). info.step itself comes back as given. */
Test(ckpt, the_optimizer_keeps_its_own_step_count)
{
    tdm_model_spec s;
    spec_small_mlp(&s);
    tdm_model *a, *b;
    tdm_optim *oa, *ob;
    make(&s, TDM_OPTIM_ADAMW, 1, &a, &oa);
    train_steps(a, oa, 3, 5);
    cr_assert_eq(tdm_optim_steps(oa), 3);
    const char *p = tpath("caller_steps.safetensors");
    tdm_ckpt_info in = {.step = 100, .epoch = 2, .seed = 9};
    TU_OK(tdm_checkpoint_save(p, a, oa, &in));
    make(&s, TDM_OPTIM_ADAMW, 2, &b, &ob);
    tdm_ckpt_info out = {0};
    TU_OK(tdm_checkpoint_load(p, b, ob, &out));
    cr_expect_eq(tdm_optim_steps(ob), 3, "the optimizer's step count became %lld",
                 (long long)tdm_optim_steps(ob));
    cr_expect_eq(out.step, 100);
    assert_same_state(a, oa, b, ob, "caller's own step count");
    tdm_optim_free(oa);
    tdm_optim_free(ob);
    tdm_model_free(a);
    tdm_model_free(b);
}

/* On any refusal the live model keeps its values. */
static float *snapshot(tdm_model *m)
{
    size_t nb = (size_t)tdm_model_param_elems(m) * sizeof(float);
    float *s = tu_malloc(nb);
    memcpy(s, tdm_model_params(m), nb);
    return s;
}

static void assert_refused(tdm_status st, tdm_status want, const char *needle1, const char *needle2,
                           const char *what)
{
    cr_assert_eq(st, want, "%s: status %s, expected %s (%s)", what, tdm_status_name(st),
                 tdm_status_name(want), tdm_error_message());
    cr_assert(strstr(tdm_error_message(), needle1), "%s: message '%s' does not name '%s'", what,
              tdm_error_message(), needle1);
    if (needle2)
        cr_assert(strstr(tdm_error_message(), needle2), "%s: message '%s' does not name '%s'",
                  what, tdm_error_message(), needle2);
}

Test(ckpt, other_model_or_optimizer_refused)
{
    tdm_model_spec s1, s2, s3;
    spec_small_mlp(&s1);
    static const int dims[] = {64, 17, 4};
    tdm_model_spec_mlp(&s2, dims, 3);
    spec_small_cnn(&s3);
    tdm_model *a, *b, *c;
    tdm_optim *oa, *ob, *oc;
    make(&s1, TDM_OPTIM_SGD, 1, &a, &oa);
    make(&s2, TDM_OPTIM_SGD, 1, &b, &ob);
    make(&s3, TDM_OPTIM_SGD, 1, &c, &oc);
    const char *p = tpath("a.safetensors");
    TU_OK(tdm_checkpoint_save(p, a, oa, NULL));
    float *sb = snapshot(b), *sc = snapshot(c);
    assert_refused(tdm_checkpoint_load(p, b, ob, NULL), TDM_STATUS_MISMATCH, "mlp 64-16-4",
                   "mlp 64-17-4", "mlp of other width");
    assert_refused(tdm_checkpoint_load(p, c, oc, NULL), TDM_STATUS_MISMATCH, "mlp 64-16-4", "cnn",
                   "cnn from an mlp checkpoint");
    cr_assert(memcmp(sb, tdm_model_params(b), (size_t)tdm_model_param_elems(b) * 4) == 0);
    cr_assert(memcmp(sc, tdm_model_params(c), (size_t)tdm_model_param_elems(c) * 4) == 0);
    /* same model, other optimizer kind */
    tdm_model *d;
    tdm_optim *od;
    make(&s1, TDM_OPTIM_ADAMW, 9, &d, &od);
    float *sd = snapshot(d);
    assert_refused(tdm_checkpoint_load(p, d, od, NULL), TDM_STATUS_MISMATCH, "sgd", "adamw",
                   "adamw from an sgd checkpoint");
    cr_assert(memcmp(sd, tdm_model_params(d), (size_t)tdm_model_param_elems(d) * 4) == 0,
              "a refused load changed the model");
    free(sb);
    free(sc);
    free(sd);
    tdm_optim_free(oa);
    tdm_optim_free(ob);
    tdm_optim_free(oc);
    tdm_optim_free(od);
    tdm_model_free(a);
    tdm_model_free(b);
    tdm_model_free(c);
    tdm_model_free(d);
}

/* Re-writes the checkpoint at src to dst through tdm_st_save, dropping the
 * tensor `drop` and/or giving `reshape` the shape {1, n_elem}. */
static void craft(const char *src, const char *dst, const char *drop, const char *reshape)
{
    tdm_st_file *f;
    TU_OK(tdm_st_load(&f, src));
    int n = tdm_st_count(f), nt = 0;
    tdm_st_tensor *t = tu_malloc((size_t)n * sizeof *t);
    for (int i = 0; i < n; i++) {
        const tdm_st_tensor *x = tdm_st_get(f, i);
        if (drop && !strcmp(x->name, drop)) continue;
        t[nt] = *x;
        if (reshape && !strcmp(x->name, reshape)) {
            int64_t e = 1;
            for (int k = 0; k < x->ndim; k++) e *= x->shape[k];
            t[nt].ndim = 2;
            t[nt].shape[0] = 1;
            t[nt].shape[1] = e;
        }
        nt++;
    }
    int nm = tdm_st_meta_count(f);
    tdm_st_meta *meta = tu_malloc((size_t)(nm > 0 ? nm : 1) * sizeof *meta);
    for (int i = 0; i < nm; i++) meta[i] = *tdm_st_meta_at(f, i);
    TU_OK(tdm_st_save(dst, t, nt, meta, nm));
    free(t);
    free(meta);
    tdm_st_free(f);
}

Test(ckpt, missing_or_misshapen_tensor_refused_by_name)
{
    for (int cnn = 0; cnn < 2; cnn++) {
        tdm_model_spec s;
        if (cnn) spec_small_cnn(&s);
        else spec_small_mlp(&s);
        tdm_model *a, *b;
        tdm_optim *oa, *ob;
        make(&s, TDM_OPTIM_ADAMW, 1, &a, &oa);
        make(&s, TDM_OPTIM_ADAMW, 2, &b, &ob);
        train_steps(b, ob, 1, 3);
        const char *p = tpath("good.safetensors"), *q = tpath("bad.safetensors");
        TU_OK(tdm_checkpoint_save(p, a, oa, NULL));
        float *sb = snapshot(b);
        const char *names[] = {cnn ? "conv2.weight" : "fc1.bias", cnn ? "bn1.running_var" : "fc2.weight",
                               cnn ? "optim.exp_avg_sq.bn2.bias" : "optim.exp_avg.fc1.weight"};
        for (int i = 0; i < 3; i++) {
            char what[96];
            craft(p, q, names[i], NULL);
            snprintf(what, sizeof what, "%s checkpoint without %s", cnn ? "cnn" : "mlp", names[i]);
            assert_refused(tdm_checkpoint_load(q, b, ob, NULL), TDM_STATUS_FORMAT, names[i], NULL, what);
            craft(p, q, NULL, names[i]);
            snprintf(what, sizeof what, "%s checkpoint with %s reshaped", cnn ? "cnn" : "mlp", names[i]);
            assert_refused(tdm_checkpoint_load(q, b, ob, NULL), TDM_STATUS_FORMAT, names[i], "shape", what);
            cr_assert(memcmp(sb, tdm_model_params(b), (size_t)tdm_model_param_elems(b) * 4) == 0,
                      "%s: the refused load changed the model", what);
            cr_assert_eq(tdm_optim_steps(ob), 1, "%s: the refused load changed the step count", what);
        }
        /* the unmodified file still loads */
        TU_OK(tdm_checkpoint_load(p, b, ob, NULL));
        free(sb);
        tdm_optim_free(oa);
        tdm_optim_free(ob);
        tdm_model_free(a);
        tdm_model_free(b);
    }
}

Test(ckpt, not_a_checkpoint_and_unwritable_path)
{
    tdm_model_spec s;
    spec_small_mlp(&s);
    tdm_model *a;
    tdm_optim *oa;
    make(&s, TDM_OPTIM_SGD, 1, &a, &oa);
    /* a valid safetensors file that is not a tandem checkpoint */
    float v = 1.0f;
    tdm_st_tensor t = {.name = "x", .dtype = TDM_ST_F32, .ndim = 1, .shape = {1}, .data = &v, .nbytes = 4};
    const char *p = tpath("plain.safetensors");
    TU_OK(tdm_st_save(p, &t, 1, NULL, 0));
    assert_refused(tdm_checkpoint_load(p, a, oa, NULL), TDM_STATUS_FORMAT, "not a tandem checkpoint",
                   NULL, "plain safetensors file");
    /* missing file */
    tdm_status st = tdm_checkpoint_load(tpath("nope.safetensors"), a, oa, NULL);
    cr_assert_eq(st, TDM_STATUS_IO, "missing file: %s (%s)", tdm_status_name(st), tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "nope.safetensors"), "message: %s", tdm_error_message());
    /* unwritable: a directory that does not exist, and a path that is a directory */
    const char *bad[] = {tpath("no/such/dir/c.safetensors"), g_dir};
    for (int i = 0; i < 2; i++) {
        st = tdm_checkpoint_save(bad[i], a, oa, NULL);
        cr_assert_neq(st, TDM_STATUS_OK, "saving to %s succeeded", bad[i]);
        cr_assert(strlen(tdm_error_message()) > 0, "saving to %s: no message", bad[i]);
    }
    cr_assert_eq(tdm_checkpoint_save("", a, oa, NULL), TDM_STATUS_INVALID_ARG);
    tdm_optim_free(oa);
    tdm_model_free(a);
}

/* ---- resume equivalence ---- */

typedef struct run {
    tdm_model *m;
    tdm_optim *o;
    tdm_single s;
} run;

static void run_open(run *r, const tdm_model_spec *s, tdm_optim_kind kind, uint64_t seed)
{
    make(s, kind, seed, &r->m, &r->o);
    r->s = (tdm_single){.model = r->m, .opt = r->o};
}

static void run_close(run *r)
{
    tdm_single_free(&r->s);
    tdm_optim_free(r->o);
    tdm_model_free(r->m);
}

static void run_epoch(run *r, const tdm_dataset *d, int batch, int64_t epoch, int64_t max_steps)
{
    tdm_epoch_stats es;
    TU_OK(tdm_train_epoch(d, &(tdm_train_epoch_opts){.batch = batch, .seed = 42, .epoch = epoch,
                                                    .max_steps = max_steps,
                                                    .step = tdm_single_step, .step_ctx = &r->s},
                          &es));
    cr_assert(es.steps > 0 && isfinite(es.loss_mean));
}

static void resume_case(const tdm_model_spec *s, tdm_optim_kind kind, int64_t n, int batch,
                        int64_t max_steps, const char *what)
{
    tdm_dataset d;
    TU_OK(tdm_data_synthetic(&d, n, 1, 8, 8, 4, 11, 0));
    /* A: two epochs straight */
    run a;
    run_open(&a, s, kind, 5);
    run_epoch(&a, &d, batch, 0, max_steps);
    run_epoch(&a, &d, batch, 1, max_steps);
    /* B: one epoch, save, a fresh model and optimizer (other seed), load, epoch 1 */
    run b;
    run_open(&b, s, kind, 5);
    run_epoch(&b, &d, batch, 0, max_steps);
    const char *p = tpath("resume.safetensors");
    tdm_ckpt_info info = {.step = tdm_optim_steps(b.o), .epoch = 1, .seed = 42};
    TU_OK(tdm_checkpoint_save(p, b.m, b.o, &info));
    run_close(&b);
    run c;
    run_open(&c, s, kind, 999);
    tdm_ckpt_info got;
    TU_OK(tdm_checkpoint_load(p, c.m, c.o, &got));
    cr_assert_eq(got.epoch, 1);
    run_epoch(&c, &d, batch, got.epoch, max_steps);
    assert_same_state(a.m, a.o, c.m, c.o, what);
    run_close(&a);
    run_close(&c);
    tdm_data_free(&d);
}

Test(ckpt, resume_equals_uninterrupted_training)
{
    tdm_model_spec mlp, cnn;
    spec_small_mlp(&mlp);
    spec_small_cnn(&cnn);
    /* 200 samples, batch 32: 6 full batches and a short one of 8 */
    resume_case(&mlp, TDM_OPTIM_SGD, 200, 32, 0, "mlp sgd-momentum resume");
    resume_case(&mlp, TDM_OPTIM_ADAMW, 200, 32, 0, "mlp adamw resume");
    resume_case(&cnn, TDM_OPTIM_SGD, 64, 16, 2, "cnn sgd-momentum resume");
    resume_case(&cnn, TDM_OPTIM_ADAMW, 64, 16, 2, "cnn adamw resume");
}
