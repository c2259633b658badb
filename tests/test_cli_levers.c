/* tests/test_cli_levers.c: `tandem train --mode single` with the memory
 * levers: --precision bf16 with --checkpoint-activations (its value
 * optional) and --clip-grad-norm trains the MLP and prints what is on,
 * the gradient norm and the planned and measured peaks (equal with
 * --no-eval); the GPT in fp16 prints its loss scale; an fp16 run resumed
 * from its checkpoint goes on from the saved loss scale and growth
 * tracker and ends on the uninterrupted run's bytes; --offload optimizer
 * runs on an emulated GPU; bad values and modes that do not take the
 * levers yet are refused with exit 2 and a message. */
#include <criterion/criterion.h>

#include "core/device.h"
#include "core/safetensors.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

TestSuite(cli_levers, .timeout = 240);

static void want(const cli_result *r, int code, const char *what)
{
    cr_assert_eq(r->code, code, "exit %d (want %d):\n%s", r->code, code, r->out);
    cr_assert(strstr(r->out, what), "no '%s' in:\n%s", what, r->out);
}

Test(cli_levers, mlp_bf16_checkpointed_and_clipped)
{
    cli_result *r = malloc(sizeof *r);
    const char *args[] = {"train", "--data", "synthetic", "--synthetic-size", "1024", "--epochs",
                          "1", "--no-eval", "--precision", "bf16", "--checkpoint-activations",
                          "--clip-grad-norm", "0.5", NULL};
    cli_run(r, args);
    want(r, 0, "memory levers: precision bf16, activation checkpointing (segments of 1), "
                 "gradient norm clipped to 0.5");
    want(r, 0, "grad norm ");
    double measured, planned;
    const char *p = strstr(r->out, "peak memory on cpu:0: ");
    cr_assert_not_null(p, "%s", r->out);
    cr_assert_eq(sscanf(p, "peak memory on cpu:0: %lf MiB measured (allocator), %lf MiB planned",
                        &measured, &planned), 2, "%s", p);
    cr_assert_eq(measured, planned, "%s", p);
    free(r);
}

Test(cli_levers, gpt_fp16_reports_its_loss_scale)
{
    cli_result *r = malloc(sizeof *r);
    const char *args[] = {"train", "--model", "gpt:1-32-2-16", "--epochs", "1", "--max-steps",
                          "4", "--batch", "4", "--precision", "fp16",
                          "--checkpoint-activations=1", NULL};
    cli_run(r, args);
    want(r, 0, "precision fp16 (dynamic loss scaling from 65536)");
    want(r, 0, "loss scale 65536 (0 steps skipped)");
    free(r);
}

/* The "loss_scale" metadata of the checkpoint at path (NULL: none). */
static char *ckpt_loss_scale(const char *path, char *buf, size_t n)
{
    tdm_st_file *f = NULL;
    cr_assert_eq(tdm_st_load_header(&f, path), TDM_STATUS_OK, "%s", tdm_error_message());
    const char *v = tdm_st_meta_get(f, "loss_scale");
    if (v) snprintf(buf, n, "%s", v);
    tdm_st_free(f);
    return v ? buf : NULL;
}

/* At batch 1 the MLP in fp16 overflows once in epoch 1 (the scale halves
 * to 32768) and again in epoch 2. Saved after epoch 1 and resumed, the
 * run goes on from 32768 and its growth tracker, not from 65536: its
 * checkpoint after epoch 2 is the uninterrupted run's, bytes and all
 * (the loss scaler's metadata included). */
Test(cli_levers, fp16_resume_goes_on_from_the_saved_loss_scaler)
{
    cli_result *r = malloc(sizeof *r);
    char dir[128], straight[192], first[192], resumed[192], scale[32];
    tu_mkdtemp(dir, sizeof dir, "lv16");
    snprintf(straight, sizeof straight, "%s", tu_tpath(dir, "straight"));
    snprintf(first, sizeof first, "%s", tu_tpath(dir, "first"));
    snprintf(resumed, sizeof resumed, "%s", tu_tpath(dir, "resumed"));
    setenv("TANDEM_RUN_ID", "levers-fp16-resume", 1);   /* the same "run" in every file */
#define FP16_RUN "train", "--data", "synthetic", "--synthetic-size", "1200", "--batch", "1", \
                 "--model", "mlp:784-8-10", "--lr", "0.002", "--no-eval", "--quiet", \
                 "--precision", "fp16"
    const char *a[] = {FP16_RUN, "--epochs", "2", "--save", straight, NULL};
    cli_run(r, a);
    want(r, 0, "epoch 2/2");
    const char *b[] = {FP16_RUN, "--epochs", "1", "--save", first, NULL};
    cli_run(r, b);
    want(r, 0, "loss scale 32768 (1 step skipped)");
    cr_assert_str_eq(ckpt_loss_scale(first, scale, sizeof scale), "32768");
    const char *c[] = {FP16_RUN, "--epochs", "2", "--resume", first, "--save", resumed, NULL};
    cli_run(r, c);
    unsetenv("TANDEM_RUN_ID");
    want(r, 0, "precision fp16 (dynamic loss scaling from 32768)");
    cr_assert(cli_same_file(straight, resumed),
              "the resumed fp16 run differs from the uninterrupted one (loss scale %s, "
              "uninterrupted %s)", ckpt_loss_scale(resumed, scale, sizeof scale),
              ckpt_loss_scale(straight, dir, sizeof dir));
#undef FP16_RUN
    tu_rmtree(dir);
    free(r);
}

Test(cli_levers, offload_on_an_emulated_gpu)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    setenv("TANDEM_CUDA_EMULATOR", "1", 1);
    cli_result *r = malloc(sizeof *r);
    const char *args[] = {"train", "--data", "synthetic", "--synthetic-size", "512", "--epochs",
                          "1", "--device", "cuda", "--offload", "optimizer", "--no-eval", NULL};
    cli_run(r, args);
    unsetenv("TANDEM_CUDA_EMULATOR");
    want(r, 0, "optimizer offloaded to host memory");
    want(r, 0, "peak memory on cuda-emu:0");
    free(r);
}

Test(cli_levers, refuses_what_it_cannot_do)
{
    static const struct { const char *args[10]; const char *msg; } cases[] = {
        {{"train", "--precision", "fp8"}, "--precision: precision 'fp8': expected fp32, bf16 or fp16"},
        {{"train", "--checkpoint-activations", "0"}, "--checkpoint-activations '0': expected all"},
        {{"train", "--offload", "params"}, "--device cpu is host memory already"},
        {{"train", "--offload", "params", "--mode", "ddp", "--device", "cuda:0,1"},
         "runs with --mode fsdp (--sharding full), not --mode ddp"},
        {{"train", "--offload", "params", "--mode", "fsdp", "--sharding", "grad_op", "--device",
          "cuda:0,1"}, "--sharding grad_op (SHARD_GRAD_OP, ZeRO-2) keeps full parameters on the "
          "device (use --offload optimizer)"},
        {{"train", "--offload", "params", "--mode", "fsdp", "--sharding", "zero1", "--device",
          "cuda:0,1"}, "--sharding zero1 (ZeroRedundancyOptimizer, ZeRO-1) keeps full parameters"},
        /* an unknown sharding is named as such, not as one that keeps full parameters */
        {{"train", "--offload", "params", "--mode", "fsdp", "--sharding", "zero9", "--device",
          "cuda:0,1"}, "--sharding: unknown sharding 'zero9'"},
        {{"train", "--offload", "gpu"}, "--offload 'gpu': expected optimizer or params"},
        {{"train", "--offload", "optimizer"}, "is host memory already"},
        {{"train", "--offload", "optimizer", "--mode", "dp", "--device", "cuda:0,1"},
         "not with --mode dp"},
        {{"train", "--offload", "optimizer", "--mode", "pp", "--device", "cuda:0,1"},
         "not with --mode pp"},
        {{"train", "--offload", "optimizer", "--mode", "tp", "--device", "cuda:0,1"},
         "--mode tp does not support --offload"},
        {{"train", "--precision", "fp16", "--grad-accum", "2", "--mode", "ddp", "--device",
          "cpu:2"}, "not supported with --grad-accum"},
        {{"train", "--clip-grad-norm", "-1"}, "--clip-grad-norm"},
    };
    cli_result *r = malloc(sizeof *r);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cli_run(r, cases[i].args);
        want(r, 2, cases[i].msg);
    }
    free(r);
}
