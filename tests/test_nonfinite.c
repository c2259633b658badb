/* tests/test_nonfinite.c: a run that goes bad stops clearly and never ruins
 * what was good. A NaN loss stops the epoch loop naming the step; a
 * checkpoint with a NaN or infinite value is neither written (the old file
 * stays) nor resumed from (the tensor and the count are named); checkpoint
 * metadata out of range (step INT64_MAX, epochs past 2^53 or past int64)
 * is refused instead of clamped or overflowed; and, end to end, `train
 * --lr 1000` in every mode stops with exit 1 leaving the last good
 * checkpoint byte for byte, and a checkpoint already at --epochs says
 * there is nothing to do. Not a test of the optimizers' numerics. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/safetensors.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tests/cli_util.h"
#include "tests/safety_util.h"
#include "tests/test_util.h"

static char g_dir[64];
static tdm_device *g_dev;

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "nonfinite");
    g_dev = tu_host();
}

static void teardown(void)
{
    tu_rmtree(g_dir);
    tdm_device_free(g_dev);
}

TestSuite(nonfinite, .init = setup, .fini = teardown, .timeout = 120);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

static void make(tdm_optim_kind kind, tdm_model **m, tdm_optim **o)
{
    static const int dims[] = {16, 8, 4};
    tdm_model_spec s;
    tdm_model_spec_mlp(&s, dims, 3);
    TU_OK(tdm_model_init(m, g_dev, &s, 1));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, kind);
    if (kind == TDM_OPTIM_SGD) oo.momentum = 0.9f;
    TU_OK(tdm_optim_init(o, *m, &oo));
}

static void assert_msg(const char *needle)
{
    cr_assert(strstr(tdm_error_message(), needle), "message '%s' lacks '%s'", tdm_error_message(),
              needle);
}

/* ---- the epoch loop ---------------------------------------------------- */

static tdm_status nan_at(void *ctx, const void *x, const int32_t *y, int batch, double *loss)
{
    (void)x;
    (void)y;
    (void)batch;
    int *c = ctx;
    *loss = ++c[0] == c[1] ? NAN : 1.0;
    return TDM_STATUS_OK;
}

Test(nonfinite, epoch_loop_stops_at_a_nan_loss_naming_the_step)
{
    tdm_dataset d;
    TU_OK(tdm_data_synthetic(&d, 100, 1, 2, 2, 2, 1, 0));
    int c[2] = {0, 4};
    tdm_epoch_stats es;
    /* epoch 2 (0-based) of 10 steps: its 4th step is step 24 of the run */
    tdm_train_epoch_opts eo = {.batch = 10, .seed = 1, .epoch = 2, .step = nan_at, .step_ctx = c};
    tdm_status st = tdm_train_epoch(&d, &eo, &es);
    cr_assert_eq(st, TDM_STATUS_NONFINITE, "%s (%s)", tdm_status_name(st), tdm_error_message());
    cr_assert_eq(c[0], 4, "the loop went on after the NaN: %d steps", c[0]);
    assert_msg("loss is NaN at step 24 (epoch 3, batch 4 of 10)");
    tdm_data_free(&d);
}

/* ---- checkpoints ------------------------------------------------------- */

static void set_param(tdm_model *m, int64_t at, float v)
{
    TU_OK(tdm_dev_copy_from_host(g_dev, tdm_model_params(m) + at, &v, sizeof v));
}

Test(nonfinite, a_checkpoint_is_never_overwritten_with_non_finite_values)
{
    for (int k = 0; k < 2; k++) {
        tdm_model *m;
        tdm_optim *o;
        make(k ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD, &m, &o);
        const char *p = tpath("good.safetensors");
        TU_OK(tdm_checkpoint_save(p, m, o, NULL));
        size_t n0 = 0, n1 = 0;
        char *before = su_slurp(p, &n0);
        const tdm_tensor_info *ti = tdm_model_param_info(m, 1);
        set_param(m, ti->offset, NAN);
        set_param(m, ti->offset + 1, INFINITY);
        tdm_status st = tdm_checkpoint_save(p, m, o, NULL);
        cr_assert_eq(st, TDM_STATUS_NONFINITE, "%s", tdm_error_message());
        assert_msg(ti->name);
        assert_msg("2 non-finite values");
        assert_msg("left as it was");
        char *after = su_slurp(p, &n1);
        cr_assert(n0 == n1 && !memcmp(before, after, n0), "the good checkpoint was replaced");
        free(before);
        free(after);
        /* optimizer state too */
        set_param(m, ti->offset, 0.0f);
        set_param(m, ti->offset + 1, 0.0f);
        float inf = -INFINITY;
        TU_OK(tdm_dev_copy_from_host(g_dev, tdm_optim_state(o, 0) + 3, &inf, sizeof inf));
        cr_assert_eq(tdm_checkpoint_save(p, m, o, NULL), TDM_STATUS_NONFINITE);
        assert_msg("optim.");
        assert_msg("1 non-finite value");
        tdm_optim_free(o);
        tdm_model_free(m);
    }
}

/* Copies src to dst with one tensor's values (from index 0) poisoned and
 * metadata key (if any) set to value. */
static void craft(const char *src, const char *dst, const char *poison, int n_nan, int n_inf,
                  const char *key, const char *value)
{
    tdm_st_file *f;
    TU_OK(tdm_st_load(&f, src));
    int n = tdm_st_count(f), nm = tdm_st_meta_count(f);
    tdm_st_tensor *t = tu_malloc((size_t)n * sizeof *t);
    tdm_st_meta *meta = tu_malloc((size_t)nm * sizeof *meta);
    float *copy = NULL;
    for (int i = 0; i < n; i++) {
        t[i] = *tdm_st_get(f, i);
        if (poison && !strcmp(t[i].name, poison)) {
            copy = tu_malloc(t[i].nbytes);
            memcpy(copy, t[i].data, t[i].nbytes);
            for (int k = 0; k < n_nan + n_inf; k++) copy[k] = k < n_nan ? NAN : INFINITY;
            t[i].data = copy;
        }
    }
    for (int i = 0; i < nm; i++) {
        meta[i] = *tdm_st_meta_at(f, i);
        if (key && !strcmp(meta[i].key, key)) meta[i].value = value;
    }
    cr_assert(!poison || copy, "no tensor '%s'", poison ? poison : "");
    TU_OK(tdm_st_save(dst, t, n, meta, nm));
    free(copy);
    free(t);
    free(meta);
    tdm_st_free(f);
}

Test(nonfinite, resume_refuses_non_finite_values_naming_tensor_and_count)
{
    tdm_model *m;
    tdm_optim *o;
    make(TDM_OPTIM_ADAMW, &m, &o);
    TU_OK(tdm_checkpoint_save(tpath("good"), m, o, NULL));
    const char *name = tdm_model_param_info(m, 2)->name;
    char state[128];
    snprintf(state, sizeof state, "optim.exp_avg_sq.%s", name);
    const char *which[] = {name, state};
    for (int i = 0; i < 2; i++) {
        craft(tpath("good"), tpath("bad"), which[i], 3, 2, NULL, NULL);
        size_t nb = (size_t)tdm_model_param_elems(m) * sizeof(float);
        float *snap = tu_malloc(nb);
        memcpy(snap, tdm_model_params(m), nb);
        tdm_status st = tdm_checkpoint_load(tpath("bad"), m, o, NULL);
        cr_assert_eq(st, TDM_STATUS_NONFINITE, "%s: %s (%s)", which[i], tdm_status_name(st),
                     tdm_error_message());
        char want[200];
        snprintf(want, sizeof want, "tensor '%s' holds 5 non-finite values", which[i]);
        assert_msg(want);
        assert_msg(tpath("bad"));
        cr_assert(!memcmp(snap, tdm_model_params(m), nb), "the model was changed");
        free(snap);
    }
    tdm_optim_free(o);
    tdm_model_free(m);
}

/* ---- step and epoch bounds ----------------------------------------------- */

/* AdamW's bias correction at step INT64_MAX computed steps + 1 in int64
 * (signed overflow, UBSan at models/optim.c) and went on. */
Test(nonfinite, optimizer_step_count_at_its_limit_is_refused)
{
    tdm_model *m;
    tdm_optim *o;
    make(TDM_OPTIM_ADAMW, &m, &o);
    size_t nb = (size_t)tdm_model_param_elems(m) * sizeof(float);
    float *snap = tu_malloc(nb);
    memcpy(snap, tdm_model_params(m), nb);
    tdm_optim_set_steps(o, INT64_MAX);
    tdm_status st = tdm_optim_step(o);
    cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "%s: %s", tdm_status_name(st), tdm_error_message());
    assert_msg("9223372036854775807");
    cr_assert(!memcmp(snap, tdm_model_params(m), nb));
    /* the last count it takes is still a normal step */
    tdm_optim_set_steps(o, TDM_OPTIM_MAX_STEPS - 1);
    TU_OK(tdm_optim_step(o));
    free(snap);
    tdm_optim_free(o);
    tdm_model_free(m);
}

Test(nonfinite, checkpoint_step_and_epoch_out_of_range_are_refused)
{
    tdm_model *m;
    tdm_optim *o;
    make(TDM_OPTIM_ADAMW, &m, &o);
    tdm_ckpt_info in = {.step = 5, .epoch = 2, .seed = 1};
    TU_OK(tdm_checkpoint_save(tpath("good"), m, o, &in));
    struct { const char *key, *value, *phrase; } c[] = {
        {"step", "9223372036854775807", "'step' = '9223372036854775807' is out of range"},
        {"step", "99999999999999999999", "'step' = '99999999999999999999' is out of range"},
        {"epoch", "99999999999999999999", "'epoch' = '99999999999999999999' is out of range"},
        {"epoch", "9007199254740993", "'epoch' = '9007199254740993' is out of range"},
        {"epoch", "-1", "not a non-negative integer"},
        {"epoch", "12abc", "not a non-negative integer"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        craft(tpath("good"), tpath("bad"), NULL, 0, 0, c[i].key, c[i].value);
        tdm_ckpt_info out = {0};
        tdm_status st = tdm_checkpoint_load(tpath("bad"), m, o, &out);
        cr_assert_eq(st, TDM_STATUS_FORMAT, "%s=%s: %s, epoch %lld step %lld (%s)", c[i].key,
                     c[i].value, tdm_status_name(st), (long long)out.epoch, (long long)out.step,
                     tdm_error_message());
        assert_msg(c[i].phrase);
    }
    tdm_optim_free(o);
    tdm_model_free(m);
}

/* ---- end to end ---------------------------------------------------------- */

#define TRAIN_ARGS "train", "--data", "synthetic", "--synthetic-size", "1200", "--batch", "64", \
                   "--model", "mlp:784-16-10"

/* A good epoch saved; then lr 1000 diverges to NaN in the next epoch. Before
 * the fix every mode trained on ("train loss nan", exit 0) and replaced the
 * checkpoint with NaN weights. */
static void diverge(const char *mode, const char *device)
{
    static cli_result r;
    char ckpt[128];
    snprintf(ckpt, sizeof ckpt, "%s/%s.safetensors", g_dir, mode);
    CLI(&r, TRAIN_ARGS, "--mode", mode, "--device", device, "--epochs", "1", "--save", ckpt);
    expect(&r, 0, "saved");
    size_t n0 = 0, n1 = 0;
    char *good = su_slurp(ckpt, &n0);
    CLI(&r, TRAIN_ARGS, "--mode", mode, "--device", device, "--epochs", "4", "--lr", "1000",
        "--resume", ckpt, "--save", ckpt);
    expect(&r, 1, "loss is NaN at step ");
    if (strcmp(mode, "ddp") != 0) cr_assert(strstr(r.out, "(epoch 2, batch "), "%s", r.out);
    cr_assert(!strstr(r.out, "epoch 2/4:"), "epoch 2 was reported as done:\n%s", r.out);
    cr_assert(strstr(r.out, "left as it was"), "%s", r.out);
    char *after = su_slurp(ckpt, &n1);
    cr_assert(n0 == n1 && !memcmp(good, after, n0), "%s: the good checkpoint was replaced", mode);
    free(good);
    free(after);
}

/* --mode fsdp in each sharding (before: the same checks held only for
 * single, dp and ddp; these passed too, and are here so that every mode
 * stays covered) */
static void diverge_fsdp(const char *sharding)
{
    static cli_result r;
    char ckpt[128];
    snprintf(ckpt, sizeof ckpt, "%s/fsdp-%s.safetensors", g_dir, sharding);
    CLI(&r, TRAIN_ARGS, "--mode", "fsdp", "--sharding", sharding, "--device", "cpu:2",
        "--epochs", "1", "--save", ckpt);
    expect(&r, 0, "saved");
    size_t n0 = 0, n1 = 0;
    char *good = su_slurp(ckpt, &n0);
    CLI(&r, TRAIN_ARGS, "--mode", "fsdp", "--sharding", sharding, "--device", "cpu:2",
        "--epochs", "4", "--lr", "1000", "--resume", ckpt, "--save", ckpt);
    expect(&r, 1, "loss is NaN at step ");
    cr_assert(!strstr(r.out, "epoch 2/4:"), "epoch 2 was reported as done:\n%s", r.out);
    char *after = su_slurp(ckpt, &n1);
    cr_assert(n0 == n1 && !memcmp(good, after, n0), "fsdp %s: the good checkpoint was replaced",
              sharding);
    free(good);
    free(after);
}

/* --model gpt: a good epoch saved, then lr 1000 until the loss is not
 * finite. Before the fix every mode printed "train loss -nan" each epoch
 * and exited 0. */
static void diverge_gpt(const char *mode, const char *device, const char *sharding)
{
    static cli_result r;
    char ckpt[128], text[128];
    snprintf(text, sizeof text, "%s/words.txt", g_dir);
    cli_write_words(text);
    snprintf(ckpt, sizeof ckpt, "%s/gpt-%s-%s.safetensors", g_dir, mode, sharding);
    const char *shard_flag = strcmp(mode, "fsdp") ? "--seed" : "--sharding";
    const char *shard_val = strcmp(mode, "fsdp") ? "1" : sharding;
#define GPT_ARGS "train", "--model", "gpt:1-16-2-16", "--data", text, "--batch", "8", \
                 "--max-steps", "5", "--mode", mode, "--device", device, shard_flag, shard_val
    CLI(&r, GPT_ARGS, "--epochs", "1", "--save", ckpt);
    expect(&r, 0, "saved");
    CLI(&r, GPT_ARGS, "--epochs", "8", "--lr", "1000", "--resume", ckpt, "--save", ckpt);
    expect(&r, 1, "training diverged");
    cr_assert(strstr(r.out, "loss is NaN at step ") || strstr(r.out, "loss is +inf at step ") ||
              strstr(r.out, "loss is -inf at step "), "%s", r.out);
    if (!strcmp(mode, "single") || !strcmp(mode, "dp"))
        cr_assert(strstr(r.out, "(epoch "), "%s", r.out);
    cr_assert(!strstr(r.out, "nan,") && !strstr(r.out, "8/8:"),
              "a NaN loss was printed as an epoch's result:\n%s", r.out);
    /* what --save holds is a good checkpoint (epochs before the loss went
     * bad may have been saved: their values were finite) */
    CLI(&r, GPT_ARGS, "--epochs", "1", "--resume", ckpt);
#undef GPT_ARGS
    expect(&r, 0, "nothing to do");
}

Test(nonfinite, lr_1000_stops_fsdp_full) { diverge_fsdp("full"); }
Test(nonfinite, lr_1000_stops_fsdp_grad_op) { diverge_fsdp("grad_op"); }
Test(nonfinite, lr_1000_stops_fsdp_optimizer) { diverge_fsdp("optimizer"); }
Test(nonfinite, lr_1000_stops_gpt_single) { diverge_gpt("single", "cpu", ""); }
Test(nonfinite, lr_1000_stops_gpt_dp) { diverge_gpt("dp", "cpu:2", ""); }
Test(nonfinite, lr_1000_stops_gpt_ddp) { diverge_gpt("ddp", "cpu:2", ""); }
Test(nonfinite, lr_1000_stops_gpt_fsdp_full) { diverge_gpt("fsdp", "cpu:2", "full"); }
Test(nonfinite, lr_1000_stops_gpt_fsdp_grad_op) { diverge_gpt("fsdp", "cpu:2", "grad_op"); }
Test(nonfinite, lr_1000_stops_gpt_fsdp_optimizer) { diverge_gpt("fsdp", "cpu:2", "optimizer"); }

Test(nonfinite, lr_1000_stops_single) { diverge("single", "cpu"); }
Test(nonfinite, lr_1000_stops_dp) { diverge("dp", "cpu:2"); }
Test(nonfinite, lr_1000_stops_ddp_on_every_rank)
{
    diverge("ddp", "cpu:2");
    /* batch 1 on 2 ranks: rank 0's share is empty, only rank 1's loss goes
     * NaN; rank 1 aborts the group and rank 0 leaves its all-reduce naming
     * it, at the same step */
    static cli_result r;
    CLI(&r, TRAIN_ARGS, "--mode", "ddp", "--device", "cpu:2", "--batch", "1", "--epochs", "1",
        "--lr", "1000", "--quiet");
    expect(&r, 1, "rank 1: loss is NaN at step ");
    cr_assert(strstr(r.out, "rank 0: ") && strstr(r.out, "aborted by rank 1: loss is NaN at step"),
              "%s", r.out);
}

Test(nonfinite, cli_refuses_a_nan_checkpoint_and_says_when_nothing_is_left_to_do)
{
    static cli_result r;
    const char *ckpt = tpath("run.safetensors");
    CLI(&r, TRAIN_ARGS, "--epochs", "1", "--save", ckpt);
    expect(&r, 0, "saved");
    craft(ckpt, tpath("nan.safetensors"), "fc2.bias", 1, 0, NULL, NULL);
    const char *modes[][2] = {{"single", "cpu"}, {"ddp", "cpu:2"}};
    for (int i = 0; i < 2; i++) {
        CLI(&r, TRAIN_ARGS, "--mode", modes[i][0], "--device", modes[i][1], "--epochs", "2",
            "--resume", tpath("nan.safetensors"));
        expect(&r, 1, "tensor 'fc2.bias' holds 1 non-finite value");
        cr_assert(!strstr(r.out, "epoch 2/2"), "%s", r.out);
        /* a checkpoint that already has --epochs epochs: said, exit 0 */
        CLI(&r, TRAIN_ARGS, "--mode", modes[i][0], "--device", modes[i][1], "--epochs", "1",
            "--resume", ckpt);
        expect(&r, 0, "nothing to do");
        cr_assert(strstr(r.out, "--epochs 1"), "%s", r.out);
    }
}
