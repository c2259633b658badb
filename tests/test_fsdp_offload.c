/* tests/test_fsdp_offload.c: FSDP's parameter offload
 * (TDM_FSDP_OFFLOAD_PARAMS, `tandem train --offload params`) on
 * CUDA-emulated devices (shm carries the collectives):
 * - the MLP (SGD with momentum) and the GPT (AdamW), 3 steps at N = 1, 2
 *   and 4: per-step losses, the reduced gradient of the first and last
 *   steps and the final parameters bitwise those of the same run without
 *   offload; rank 0's device allocator holds exactly the parameter
 *   shard, the gradient shard and the optimizer state's bytes less
 *   (each one allocation of the shard's floats, rounded up to 64 bytes),
 *   between steps and at the steps' peak;
 * - gradients kept across steps (no zero_grad between them: the host
 *   shard adds the new slice) and no_sync micro-batches: bitwise;
 * - the set-up: the device never holds the model (built without flat
 *   buffers, its units drawn on the host): its peak is the plan's
 *   init_peak; the copies on the emulated copy stream are all finished;
 * - refusals: a host device, grad_op and optimizer shardings, a model
 *   built without flat buffers but not offloaded, naming why;
 *   no pinned memory on a host device or the emulator (UNSUPPORTED);
 * - the CLI: the checkpoint of `train --offload params` is the bytes of
 *   the run without it (cmp) with the same loss lines, its resume (from
 *   the full and the sharded form) ends on the uninterrupted run's
 *   bytes, --clip-grad-norm prints the same norm, the plan printed beside
 *   the measured peak is within 5% of it; bad combinations are one-line
 *   usage errors (tests/test_cli_levers.c);
 *   the GPT's checkpoint at 1 and 2 ranks in fp32, at 2 in bf16 and
 *   fp16, the same bytes with and without. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "tests/cli_util.h"
#include "tests/test_fsdp_util.h"
#include "tests/test_util.h"

TestSuite(fsdp_offload, .timeout = 300);

__attribute__((weak)) tdm_status tdm_cuda_emulator_open_accel(tdm_device **out, int index);

static tdm_status open_emu(tdm_device **out, int rank)
{
    return tdm_cuda_emulator_open_accel(out, rank);
}

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

/* One run of cfg at N ranks into a fresh shared area (the caller frees). */
static tf_shared *run(tf_cfg *c, int world, tdm_fsdp_offload off)
{
    tf_shared *sh = tf_shared_new();
    cr_assert_not_null(sh);
    tdm_dataset data = {0};
    if (c->model != 2) TU_OK(tf_data(&data, c, 256));
    c->offload = off;
    tdm_status st = tf_spawn(world, c, &data, sh, 120000);
    for (int r = 0; r < world && r < 8; r++)
        cr_assert_eq(sh->status[r], 0, "rank %d (offload %d): %s", r, (int)off, sh->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    tdm_data_free(&data);
    return sh;
}

static void same_run(const tf_shared *a, const tf_shared *b, int steps, const char *what)
{
    cr_assert_gt(a->n_elem, 0, "%s: no parameters recorded", what);
    size_t nb = (size_t)a->n_elem * sizeof(float);
    cr_assert(!memcmp(a->loss, b->loss, (size_t)steps * sizeof(double)),
              "%s: losses differ (step 0: %.9g vs %.9g)", what, a->loss[0], b->loss[0]);
    cr_assert(!memcmp(a->grads0, b->grads0, nb), "%s: first step's gradients differ", what);
    cr_assert(!memcmp(a->grads_last, b->grads_last, nb), "%s: last gradients differ", what);
    cr_assert(!memcmp(a->params, b->params, nb), "%s: final parameters differ", what);
    cr_assert(!memcmp(a->params_r1, b->params_r1, nb), "%s: last rank's parameters differ",
              what);
}

static void compare_at(int model, int world)
{
    tf_cfg c = tf_cfg_default();
    c.model = model;
    c.adamw = model == 2;
    c.steps = 3;
    c.batch = model == 2 ? 8 : 24;
    c.open_dev = open_emu;
    tf_shared *plain = run(&c, world, TDM_FSDP_OFFLOAD_NONE);
    tf_shared *off = run(&c, world, TDM_FSDP_OFFLOAD_PARAMS);
    char what[64];
    snprintf(what, sizeof what, "%s at N=%d", model == 2 ? "gpt" : "mlp", world);
    same_run(plain, off, c.steps, what);
    /* the copies on the (emulated) copy stream were all finished */
    cr_assert_eq(off->xfers_left, 0, "%s: %lld copies never finished", what,
                 (long long)off->xfers_left);
    tf_shared_free(plain);
    tf_shared_free(off);
    /* The bytes: with the reduce-scatters after backward, so that the
     * full gradients alive at once do not depend on when a collective
     * is seen complete (overlapped, the peak moves by a unit's block
     * from run to run, offloaded or not). */
    c.no_overlap = 1;
    plain = run(&c, world, TDM_FSDP_OFFLOAD_NONE);
    off = run(&c, world, TDM_FSDP_OFFLOAD_PARAMS);
    same_run(plain, off, c.steps, what);
    /* the parameter shard, the gradient shard and each state buffer:
     * one allocation of shard_elems floats each */
    cr_assert_eq(plain->shard_elems, off->shard_elems);
    size_t one = round64((size_t)plain->shard_elems * sizeof(float));
    size_t drop = (size_t)(2 + plain->n_state) * one;
    cr_assert_eq(plain->n_state, model == 2 ? 2 : 1, "%s: %d state buffers", what,
                 plain->n_state);
    cr_assert_gt(off->live_between, 0);
    cr_assert_eq(plain->live_between - off->live_between, drop,
                 "%s: between steps the device holds %zu bytes less, expected %zu (2 + %d "
                 "buffers of %zu)", what, plain->live_between - off->live_between, drop,
                 plain->n_state, one);
    cr_assert_eq(plain->step_peak - off->step_peak, drop,
                 "%s: the steps' peak is %zu bytes lower (%zu vs %zu), expected %zu", what,
                 plain->step_peak - off->step_peak, plain->step_peak, off->step_peak, drop);
    tf_shared_free(plain);
    tf_shared_free(off);
}

Test(fsdp_offload, mlp_bitwise_and_exact_device_bytes)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    for (int w = 1; w <= 4; w *= 2) compare_at(0, w);
}

Test(fsdp_offload, gpt_bitwise_and_exact_device_bytes)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    for (int w = 1; w <= 4; w *= 2) compare_at(2, w);
}

/* The set-up: with offload the model is built without flat buffers
 * (tdm_model_init_released) and its units are drawn and scattered in
 * host memory, so rank 0's device allocator never holds the model at
 * set-up: its peak there is exactly the plan's init_peak (the buffers and
 * 16-bit weights: none for these float32 models) and at most the steps'
 * peak; without offload the set-up holds at least the whole model's
 * parameters and gradients. The MLP and the GPT at N = 1, 2, 4, and the
 * GPT in bf16 (its 16-bit weight copy is the set-up's one device block). */
static void setup_at(int model, int world, tdm_precision prec)
{
    tf_cfg c = tf_cfg_default();
    c.model = model;
    c.adamw = model == 2;
    c.steps = 2;
    c.batch = model == 2 ? 8 : 24;
    c.no_overlap = 1;
    c.prec = prec;
    c.open_dev = open_emu;
    tf_shared *plain = run(&c, world, TDM_FSDP_OFFLOAD_NONE);
    tf_shared *off = run(&c, world, TDM_FSDP_OFFLOAD_PARAMS);
    char what[64];
    snprintf(what, sizeof what, "%s%s at N=%d", model == 2 ? "gpt" : "mlp",
             prec == TDM_PRECISION_BF16 ? " bf16" : "", world);
    same_run(plain, off, c.steps, what);
    tdm_model_spec spec;
    tf_spec(&spec, &c);
    tdm_plan_opts o;
    tdm_plan_opts_default(&o, &spec, c.batch / world);
    tf_optim_opts(&o.optim, &c);
    o.precision = prec;
    o.device = TDM_DEVICE_CUDA;
    o.offload = TDM_PLAN_OFFLOAD_PARAMS;
    tdm_fsdp_mem_plan mp;
    TU_OK(tdm_fsdp_plan_memory(&o, world, TDM_FSDP_FULL_SHARD, 0, &mp));
    cr_assert_eq(off->setup_peak, mp.init_peak,
                 "%s: the set-up's device peak is %zu bytes, planned %zu", what, off->setup_peak,
                 mp.init_peak);
    cr_assert_leq(off->setup_peak, off->step_peak, "%s: set-up %zu above the steps' %zu", what,
                  off->setup_peak, off->step_peak);
    size_t model_bytes = 2 * round64((size_t)plain->n_elem * sizeof(float));
    cr_assert_geq(plain->setup_peak, model_bytes, "%s: without offload the set-up held %zu", what,
                  plain->setup_peak);
    cr_assert_lt(off->setup_peak + model_bytes, plain->setup_peak + 1, "%s: %zu vs %zu", what,
                 off->setup_peak, plain->setup_peak);
    tf_shared_free(plain);
    tf_shared_free(off);
}

Test(fsdp_offload, setup_never_holds_the_model_on_the_device)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    for (int w = 1; w <= 4; w *= 2) {
        setup_at(0, w, TDM_PRECISION_FP32);
        setup_at(2, w, TDM_PRECISION_FP32);
    }
    setup_at(2, 2, TDM_PRECISION_BF16);
}

/* Gradients that add up across synchronised backwards (the host shard
 * adds each new slice) and no_sync micro-batches. */
Test(fsdp_offload, accumulated_gradients_bitwise)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    for (int k = 0; k < 2; k++) {
        tf_cfg c = tf_cfg_default();
        c.steps = 3;
        c.open_dev = open_emu;
        if (k == 0) c.zero_once = 1;
        else c.micro = 3;
        tf_shared *plain = run(&c, 2, TDM_FSDP_OFFLOAD_NONE);
        tf_shared *off = run(&c, 2, TDM_FSDP_OFFLOAD_PARAMS);
        same_run(plain, off, c.steps, k == 0 ? "zero_grad once" : "no_sync micro-batches");
        tf_shared_free(plain);
        tf_shared_free(off);
    }
}

/* Rank 0 of 1: FSDP with parameter offload on a host device (err[0]),
 * and with grad_op and optimizer on an emulated one (err[1], err[2]);
 * status[k] the status each init returned. */
static int refuse_main(tdm_comm *comm, void *arg)
{
    tf_shared *sh = arg;
    tdm_model_spec spec;
    tf_cfg c = tf_cfg_default();
    tf_spec(&spec, &c);
    for (int k = 0; k < 3; k++) {
        tdm_device *d = NULL;
        tdm_model *m = NULL;
        tdm_fsdp *f = NULL;
        tdm_status st = k == 0 ? tdm_device_open(&d, "cpu", 0, 1)
                               : tdm_cuda_emulator_open_accel(&d, 0);
        if (st == TDM_STATUS_OK) st = tdm_model_init(&m, d, &spec, 1);
        tdm_fsdp_opts o = {.sharding = k == 0 ? TDM_FSDP_FULL_SHARD : (tdm_fsdp_sharding)k,
                           .offload = TDM_FSDP_OFFLOAD_PARAMS};
        if (st == TDM_STATUS_OK) st = tdm_fsdp_init(&f, m, comm, &o);
        sh->status[k] = st;
        snprintf(sh->err[k], sizeof sh->err[k], "%s", st ? tdm_error_message() : "");
        tdm_fsdp_free(f);
        tdm_model_free(m);
        tdm_device_free(d);
        if (!tdm_device_cuda_linked()) break;
    }
    /* status[3]: a model built without flat buffers, sharded without
     * offload (nothing would hold its parameters) */
    tdm_device *d = NULL;
    tdm_model *m = NULL;
    tdm_fsdp *f = NULL;
    tdm_status st = tdm_device_open(&d, "cpu", 0, 1);
    if (st == TDM_STATUS_OK) st = tdm_model_init_released(&m, d, &spec, 1);
    if (st == TDM_STATUS_OK) st = tdm_fsdp_init(&f, m, comm, NULL);
    sh->status[3] = st;
    snprintf(sh->err[3], sizeof sh->err[3], "%s", st ? tdm_error_message() : "");
    tdm_fsdp_free(f);
    tdm_model_free(m);
    tdm_device_free(d);
    return 0;
}

Test(fsdp_offload, refused_where_it_has_nothing_to_offload)
{
    tf_shared *sh = tf_shared_new();
    cr_assert_not_null(sh);
    tdm_dist_spawn_opts o = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    TU_OK(tdm_dist_spawn(1, refuse_main, sh, &o, NULL));
    cr_assert_eq(sh->status[0], TDM_STATUS_INVALID_ARG, "%s", sh->err[0]);
    cr_assert(strstr(sh->err[0], "cpu:0's memory is host memory already"), "%s", sh->err[0]);
    for (int k = 1; k < 3 && tdm_device_cuda_linked(); k++) {
        cr_assert_eq(sh->status[k], TDM_STATUS_INVALID_ARG, "%s", sh->err[k]);
        cr_assert(strstr(sh->err[k], "keeps full parameters on the device"), "%s", sh->err[k]);
    }
    cr_assert_eq(sh->status[3], TDM_STATUS_INVALID_ARG, "%s", sh->err[3]);
    cr_assert(strstr(sh->err[3], "tdm_model_init_released, which only parameter offload"), "%s",
              sh->err[3]);
    tf_shared_free(sh);
}

/* Rank 0 of 1 on an emulated device: tdm_fsdp_step given an optimizer
 * whose parameter pointers are on the wrong side. k 0: offloaded shards
 * (host memory) and a ZeRO-Offload optimizer made on the model's device
 * (its state on the host, but it copies the ranges from the device: a
 * GPU would read host pointers as device ones); k 1: device shards and a
 * host optimizer (tdm_optim_init_host: the CPU would read device
 * pointers). status[k] what the step returned, err[k] its message. */
static int mismatch_main(tdm_comm *comm, void *arg)
{
    tf_shared *sh = arg;
    tdm_model_spec spec;
    tf_cfg c = tf_cfg_default();
    tf_spec(&spec, &c);
    for (int k = 0; k < 2; k++) {
        tdm_device *d = NULL;
        tdm_model *m = NULL;
        tdm_fsdp *f = NULL;
        tdm_optim *opt = NULL;
        tdm_optim_opts oo;
        tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
        tdm_status st = tdm_cuda_emulator_open_accel(&d, 0);
        if (st == TDM_STATUS_OK) st = tdm_model_init(&m, d, &spec, 1);
        tdm_fsdp_opts o = {.offload = k == 0 ? TDM_FSDP_OFFLOAD_PARAMS : TDM_FSDP_OFFLOAD_NONE};
        if (st == TDM_STATUS_OK) st = tdm_fsdp_init(&f, m, comm, &o);
        oo.offload = TDM_OPTIM_OFFLOAD_HOST;
        if (st == TDM_STATUS_OK)
            st = k == 0 ? tdm_optim_init_flat(&opt, d, tdm_fsdp_shard_elems(f), &oo)
                        : tdm_optim_init_host(&opt, tdm_fsdp_shard_elems(f), &oo);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_zero_grad(f);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_step(f, opt);
        sh->status[k] = st;
        snprintf(sh->err[k], sizeof sh->err[k], "%s", st ? tdm_error_message() : "");
        tdm_optim_free(opt);
        tdm_fsdp_free(f);
        tdm_model_free(m);
        tdm_device_free(d);
    }
    return 0;
}

Test(fsdp_offload, step_refuses_an_optimizer_on_the_other_side)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    tf_shared *sh = tf_shared_new();
    cr_assert_not_null(sh);
    tdm_dist_spawn_opts o = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    TU_OK(tdm_dist_spawn(1, mismatch_main, sh, &o, NULL));
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(sh->status[k], TDM_STATUS_INVALID_ARG, "case %d: status %d: %s", k,
                     (int)sh->status[k], sh->err[k]);
        cr_assert(strstr(sh->err[k], "make it with tdm_fsdp_optim_init"), "%s", sh->err[k]);
    }
    tf_shared_free(sh);
}

/* The host shards are pinned where the device's backend has pinned
 * memory (a GPU: cudaHostRegister); a host device and the emulator have
 * none, and say so without a message, the memory used as it is. */
Test(fsdp_offload, pinning_is_unsupported_without_a_gpu)
{
    float buf[64];
    tdm_device *h = tu_host();
    cr_assert_eq(tdm_dev_host_pin(h, buf, sizeof buf), TDM_STATUS_UNSUPPORTED);
    tdm_dev_host_unpin(h, buf);
    tdm_device_free(h);
    if (!tdm_device_cuda_linked()) return;
    tdm_device *e = NULL;
    TU_OK(tdm_cuda_emulator_open_accel(&e, 0));
    cr_assert_eq(tdm_dev_host_pin(e, buf, sizeof buf), TDM_STATUS_UNSUPPORTED);
    tdm_dev_host_unpin(e, buf);
    tdm_device_free(e);
}

/* ---- the CLI ---- */

#define IMG "train", "--data", "synthetic", "--synthetic-size", "768", "--batch", "64", \
            "--model", "mlp:784-48-24-10", "--no-eval", "--precise", "--mode", "fsdp", \
            "--device", "cuda", "--precision", "fp32"

static cli_result g_r;

static void ok(const char *what)
{
    cr_assert_eq(g_r.code, 0, "%s: exit %d:\n%s", what, g_r.code, g_r.out);
}

/* The lines holding key, joined (the epochs' loss lines). */
static void lines_with(const char *key, char *out, size_t n)
{
    out[0] = 0;
    for (const char *p = strstr(g_r.out, key); p; p = strstr(p + 1, key)) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        /* the throughput differs from run to run: up to the comma */
        const char *c = memchr(p, ',', len);
        if (c) len = (size_t)(c - p);
        strncat(out, p, len < n - strlen(out) - 2 ? len : 0);
        strcat(out, "\n");
    }
}

static double after(const char *key)
{
    const char *p = strstr(g_r.out, key);
    cr_assert_not_null(p, "no '%s' in:\n%s", key, g_r.out);
    return strtod(p + strlen(key), NULL);
}

Test(fsdp_offload, cli_checkpoint_losses_resume_and_plan)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    char dir[128], plain[192], off[192], first[192], resumed[192], lp[2048], lo[2048];
    tu_mkdtemp(dir, sizeof dir, "fsoff");
    snprintf(plain, sizeof plain, "%s", tu_tpath(dir, "plain"));
    snprintf(off, sizeof off, "%s", tu_tpath(dir, "off"));
    snprintf(first, sizeof first, "%s", tu_tpath(dir, "first"));
    snprintf(resumed, sizeof resumed, "%s", tu_tpath(dir, "resumed"));
    setenv("TANDEM_CUDA_EMULATOR", "2", 1);
    setenv("TANDEM_RUN_ID", "fsdp-offload-cli", 1);   /* the same "run" in each file */
    CLI(&g_r, IMG, "--epochs", "2", "--save", plain);
    ok("fsdp");
    lines_with("train loss", lp, sizeof lp);
    double peak_plain = after("peak memory on rank 0's cuda-emu:0: ");
    char trace[192];
    snprintf(trace, sizeof trace, "%s", tu_tpath(dir, "trace.json"));
    CLI(&g_r, IMG, "--epochs", "2", "--save", off, "--offload", "params", "--trace", trace);
    ok("fsdp --offload params");
    /* the copies between host and device are a phase of their own */
    FILE *tf = fopen(trace, "r");
    cr_assert_not_null(tf, "no trace %s", trace);
    static char tbuf[1 << 20];
    size_t tn = fread(tbuf, 1, sizeof tbuf - 1, tf);
    fclose(tf);
    tbuf[tn] = 0;
    cr_assert(strstr(tbuf, "\"name\": \"host copy\"") || strstr(tbuf, "\"name\":\"host copy\""),
              "no host copy phase in the trace:\n%.2000s", tbuf);
    cr_assert(strstr(tbuf, "all-gather wait") || strstr(tbuf, "forward"), "%.500s", tbuf);
    cr_assert(strstr(g_r.out, "parameter and gradient shards and the optimizer (its state and "
                              "step) offloaded to host memory"), "%s", g_r.out);
    cr_assert(strstr(g_r.out, "fsdp memory (rank 0): shards (in host memory)"), "%s", g_r.out);
    cr_assert(strstr(g_r.out, "fsdp offload (rank 0, per step): host copy "), "%s", g_r.out);
    lines_with("train loss", lo, sizeof lo);
    cr_assert(lp[0] && !strcmp(lp, lo), "loss lines differ:\n%s---\n%s", lp, lo);
    cr_assert(cli_same_file(plain, off), "the offloaded run's checkpoint differs");
    /* 19568 floats of shard per rank (3 units of 784-48-24-10 over 2
     * ranks): parameters, gradients, SGD momentum leave the device (at
     * least: an overlapped step's peak moves with the collectives'
     * timing; the exact drop is asserted above, without overlap) */
    double peak_off = after("peak memory on rank 0's cuda-emu:0: ");
    double planned = after("MiB measured (allocator), ");
    cr_assert(peak_plain - peak_off >= 3 * 19568 * 4 / 1048576.0 - 0.011,
              "peak %g MiB, offloaded %g", peak_plain, peak_off);
    cr_assert(fabs(planned - peak_off) <= 0.05 * peak_off, "planned %g MiB, measured %g",
              planned, peak_off);
    CLI(&g_r, "plan", "--model", "mlp:784-48-24-10", "--batch", "64", "--mode", "fsdp",
        "--device", "cuda", "--offload", "params");
    ok("plan --offload params");
    cr_assert(strstr(g_r.out, "shards and optimizer offloaded"), "%s", g_r.out);
    double plan = after("peak per device: ");
    cr_assert(fabs(plan - peak_off) <= 0.05 * peak_off, "tandem plan %g MiB, measured %g",
              plan, peak_off);
    cr_assert(after("host: shards, state ") > 0.2, "%s", g_r.out);
    /* the set-up holds nothing of the float32 model on the device */
    cr_assert_eq(after("set-up peak"), 0.0, "%s", g_r.out);
    /* resumed after epoch 1, offloaded: the uninterrupted run's bytes */
    CLI(&g_r, IMG, "--epochs", "1", "--save", first, "--offload", "params");
    ok("first epoch");
    CLI(&g_r, IMG, "--epochs", "2", "--resume", first, "--save", resumed, "--offload", "params");
    ok("resumed");
    cr_assert(cli_same_file(off, resumed), "the resumed offloaded run differs");
    /* and from the sharded form (each rank's file from its host shards) */
    CLI(&g_r, IMG, "--epochs", "1", "--save", first, "--save-sharded", "--offload", "params");
    ok("first epoch, sharded");
    CLI(&g_r, IMG, "--epochs", "2", "--resume", first, "--save", resumed, "--offload", "params");
    ok("resumed from the sharded form");
    cr_assert(cli_same_file(off, resumed), "the offloaded run resumed from shards differs");
    /* the global norm over host shards: the same as over device shards */
    char np[128], no[128];
    CLI(&g_r, IMG, "--epochs", "1", "--clip-grad-norm", "0.5");
    ok("clip");
    lines_with("grad norm ", np, sizeof np);
    CLI(&g_r, IMG, "--epochs", "1", "--clip-grad-norm", "0.5", "--offload", "params");
    ok("clip offloaded");
    lines_with("grad norm ", no, sizeof no);
    cr_assert(np[0] && !strcmp(np, no), "norms differ:\n%s---\n%s", np, no);
    unsetenv("TANDEM_RUN_ID");
    unsetenv("TANDEM_CUDA_EMULATOR");
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}

#define GPT "train", "--model", "gpt:2-32-2-16", "--epochs", "2", "--max-steps", "3", \
            "--batch", "4", "--no-eval", "--precise", "--mode", "fsdp"

/* The GPT at N = 1 and 2 in fp32, and at N = 2 in bf16 and fp16 (its
 * loss scaler's unscale and found-inf over the host shards): the same
 * checkpoint bytes and loss lines with and without offload. */
Test(fsdp_offload, cli_gpt_checkpoints_equal)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    char dir[128], plain[192], off[192], lp[2048], lo[2048];
    tu_mkdtemp(dir, sizeof dir, "fsoffg");
    snprintf(plain, sizeof plain, "%s", tu_tpath(dir, "plain"));
    snprintf(off, sizeof off, "%s", tu_tpath(dir, "off"));
    setenv("TANDEM_RUN_ID", "fsdp-offload-gpt", 1);
    static const struct { const char *n, *dev, *prec; } runs[] = {
        {"1", "cuda:0", "fp32"}, {"2", "cuda:0,1", "fp32"}, {"2", "cuda:0,1", "bf16"},
        {"2", "cuda:0,1", "fp16"}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        setenv("TANDEM_CUDA_EMULATOR", runs[i].n, 1);
        CLI(&g_r, GPT, "--device", runs[i].dev, "--precision", runs[i].prec, "--save", plain);
        ok(runs[i].prec);
        lines_with("train loss", lp, sizeof lp);
        CLI(&g_r, GPT, "--device", runs[i].dev, "--precision", runs[i].prec, "--save", off,
            "--offload", "params");
        ok(runs[i].prec);
        lines_with("train loss", lo, sizeof lo);
        cr_assert(lp[0] && !strcmp(lp, lo), "%s on %s: loss lines differ:\n%s---\n%s",
                  runs[i].prec, runs[i].dev, lp, lo);
        cr_assert(cli_same_file(plain, off), "%s on %s: the offloaded checkpoint differs",
                  runs[i].prec, runs[i].dev);
    }
    unsetenv("TANDEM_RUN_ID");
    unsetenv("TANDEM_CUDA_EMULATOR");
    tu_rmtree(dir);
    cr_assert_eq(cli_shm_entries(), 0);
}
