/* tests/test_cli_levers.c: `tandem train --mode single` with the memory
 * levers: --precision bf16 with --checkpoint-activations (its value
 * optional) and --clip-grad-norm trains the MLP and prints what is on,
 * the gradient norm and the planned and measured peaks (equal with
 * --no-eval); the GPT in fp16 prints its loss scale; --offload optimizer
 * runs on an emulated GPU; bad values and modes that do not take the
 * levers yet are refused with exit 2 and a message. */
#include <criterion/criterion.h>

#include "core/device.h"
#include "tests/cli_util.h"

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
    static const struct { const char *args[8]; const char *msg; } cases[] = {
        {{"train", "--precision", "fp8"}, "--precision: precision 'fp8': expected fp32, bf16 or fp16"},
        {{"train", "--checkpoint-activations", "0"}, "--checkpoint-activations '0': expected all"},
        {{"train", "--offload", "params"}, "not built yet"},
        {{"train", "--offload", "optimizer"}, "is host memory already"},
        {{"train", "--offload", "optimizer", "--mode", "dp", "--device", "cuda:0,1"},
         "not yet with --mode dp"},
        {{"train", "--precision", "bf16", "--mode", "pp", "--device", "cpu:2"},
         "not yet with --mode pp"},
        {{"train", "--precision", "fp16", "--grad-accum", "2"}, "not supported with --grad-accum"},
        {{"train", "--clip-grad-norm", "-1"}, "--clip-grad-norm"},
    };
    cli_result *r = malloc(sizeof *r);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cli_run(r, cases[i].args);
        want(r, 2, cases[i].msg);
    }
    free(r);
}
