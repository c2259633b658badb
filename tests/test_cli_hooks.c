/* tests/test_cli_hooks.c: the CLI of communication hooks: tandem train
 * --comm-hook (bad names and modes refused, bytes per step printed) and
 * tandem compare --comm-hook (its section, the bounded verdict, and that
 * the verdict catches a wrong rank even with fp16's rounding), and
 * tandem train --mode ddp --uneven (ranks with different step counts
 * finish through join); the same for the sharded modes (--mode fsdp
 * --comm-hook fp16|bf16, powersgd refused, --uneven in every sharding). */
#include <criterion/criterion.h>

#include "core/device.h"
#include "tests/cli_util.h"

Test(cli_hooks, train_comm_hook, .timeout = 200)
{
    static cli_result r;
    CLI(&r, "train", "--mode", "ddp", "--comm-hook", "fp8");
    expect(&r, 2, "--comm-hook 'fp8': expected allreduce, fp16, bf16 or powersgd");
    CLI(&r, "train", "--comm-hook", "bf16");
    expect(&r, 2, "--comm-hook bf16 applies to --mode ddp");
    CLI(&r, "train", "--mode", "ddp", "--powersgd-rank", "0");
    expect(&r, 2, "--powersgd-rank");
    const char *hooks[] = {"allreduce", "bf16", "powersgd"};
    for (int i = 0; i < 3; i++) {
        CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
            "--synthetic-size", "600", "--model", "mlp:784-32-10", "--batch", "60", "--epochs",
            "1", "--comm-hook", hooks[i], "--powersgd-start-step", "0", "--powersgd-rank", "2");
        expect(&r, 0, "test accuracy");
        char want[64];
        snprintf(want, sizeof want, "ddp comm hook %s: ", hooks[i]);
        const char *p = strstr(r.out, want);
        cr_assert(p, "%s", r.out);
        double bytes = 0, f32 = 0;
        cr_assert(sscanf(p + strlen(want), "%lf bytes all-reduced per step (float32 gradients: "
                         "%lf", &bytes, &f32) == 2, "%s", p);
        /* allreduce: the gradients and the 192-float check tail; bf16: half
         * of the gradients; powersgd rank 2: (n+m)*2 per matrix + vectors */
        if (i == 0) cr_assert_eq(bytes, f32 + 192 * 4);
        if (i == 1) cr_assert(bytes < 0.51 * f32 + 192 * 4 && bytes > 0.49 * f32, "%g", bytes);
        if (i == 2) cr_assert(bytes < 0.1 * f32, "%g of %g", bytes, f32);
    }
}

Test(cli_hooks, compare_comm_hook_bounded_verdict, .timeout = 300)
{
    static cli_result r;
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-64-10", "--steps", "8",
        "--warmup", "1", "--batch", "64", "--comm-hook", "fp16");
    expect(&r, 0, "Communication hook fp16");
    cr_assert(strstr(r.out, "hook verdict: the expected, bounded difference"), "%s", r.out);
    cr_assert(strstr(r.out, "(0.50x)"), "%s", r.out);
    /* a rank 1% off: far beyond fp16's rounding, caught by the bound */
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-64-10", "--steps", "8",
        "--warmup", "1", "--batch", "64", "--comm-hook", "fp16", "--perturb-rank", "1");
    expect(&r, 3, "BEYOND");
    CLI(&r, "compare", "--comm-hook", "int8");
    expect(&r, 2, "--comm-hook 'int8'");
}

/* --uneven: 101 samples over 3 ranks without padding are 34, 34, 33, in
 * batches of 99/3 = 33: rank 2 runs one step and shadows the second */
Test(cli_hooks, train_uneven_join, .timeout = 200)
{
    static cli_result r;
    CLI(&r, "train", "--uneven");
    expect(&r, 2, "--uneven applies to --mode ddp");
    CLI(&r, "train", "--mode", "ddp", "--uneven", "--grad-accum", "2");
    expect(&r, 2, "without --grad-accum");
    const char *hooks[] = {"allreduce", "bf16"};
    for (int i = 0; i < 2; i++) {
        CLI(&r, "train", "--mode", "ddp", "--device", "cpu:3", "--uneven", "--data", "synthetic",
            "--synthetic-size", "101", "--batch", "99", "--epochs", "2", "--model",
            "mlp:784-32-10", "--comm-hook", hooks[i]);
        expect(&r, 0, "steps per rank: 2 2 1 (shadowed after joining: 0 0 1)");
        cr_assert(strstr(r.out, "epoch 2/2"), "%s", r.out);
    }
    /* --save: every rank takes part in the checkpoint's collective (it
     * failed with a collective mismatch: rank 0 in the save's broadcast,
     * the others, which print and save nothing, in the epoch's barrier) */
    char ck[64];
    snprintf(ck, sizeof ck, "/tmp/tdm_cli_uneven_%d.st", (int)getpid());
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:3", "--uneven", "--data", "synthetic",
        "--synthetic-size", "101", "--batch", "99", "--epochs", "2", "--model",
        "mlp:784-32-10", "--no-eval", "--save", ck);
    unlink(ck);
    expect(&r, 0, "saved");
    cr_assert(strstr(r.out, "(epoch 2, step 4)"), "%s", r.out);
}

/* --mode fsdp: bf16 halves the bytes reduce-scattered; --uneven joins in
 * every sharding (101 samples over 3 ranks in batches of 33, as above);
 * powersgd and non-host devices are refused saying why. */
Test(cli_hooks, fsdp_comm_hook_and_uneven, .timeout = 300)
{
    static cli_result r;
    CLI(&r, "train", "--mode", "fsdp", "--comm-hook", "powersgd");
    expect(&r, 2, "PyTorch's FSDP offers only the fp16 and bf16 hooks");
    CLI(&r, "train", "--mode", "fsdp", "--uneven", "--grad-accum", "2");
    expect(&r, 2, "without --grad-accum");
    const char *shard[] = {"full", "grad_op", "optimizer"};
    for (int i = 0; i < 3; i++) {
        CLI(&r, "train", "--mode", "fsdp", "--sharding", shard[i], "--device", "cpu:3",
            "--uneven", "--data", "synthetic", "--synthetic-size", "101", "--batch", "99",
            "--epochs", "2", "--model", "mlp:784-32-10", "--comm-hook", i == 1 ? "fp16" : "bf16");
        expect(&r, 0, "steps per rank: 2 2 1 (shadowed after joining: 0 0 1)");
        cr_assert(strstr(r.out, "epoch 2/2"), "%s", r.out);
        const char *want = i == 1 ? "fsdp comm hook fp16: " : "fsdp comm hook bf16: ";
        const char *p = strstr(r.out, want);
        cr_assert(p, "%s", r.out);
        double bytes = 0, f32 = 0;
        cr_assert(sscanf(p + strlen(want), "%lf bytes reduce-scattered per step (float32 "
                         "gradients: %lf", &bytes, &f32) == 2, "%s", p);
        cr_assert_eq(bytes * 2, f32, "%s", p);
    }
    /* compare: each sharded mode with the hook, against hooked DDP */
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-64-10", "--steps", "6",
        "--warmup", "1", "--batch", "64", "--modes", "ddp,fsdp,zero1", "--comm-hook", "bf16");
    expect(&r, 0, "sharded modes with bf16 (each against DDP with bf16)");
    const char *p = strstr(r.out, "sharded modes with bf16");
    cr_assert(p, "%s", r.out);
    const char *fz = strstr(p, "FSDP     "), *z1 = strstr(p, "ZeRO-1   ");
    cr_assert(fz && z1 && strstr(fz, "bitwise DDP's -> within") &&
              strstr(z1, "bitwise DDP's -> within"), "%s", r.out);
    cr_assert(strstr(r.out, "hook verdict: the expected, bounded difference"), "%s", r.out);
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-64-10", "--steps", "2",
        "--warmup", "1", "--batch", "64", "--modes", "ddp,zero2", "--comm-hook", "powersgd",
        "--powersgd-start-step", "0");
    cr_assert(strstr(r.out, "not run: PowerSGD is not defined for a reduce-scatter"), "%s",
              r.out);
    if (tdm_device_cuda_linked()) {
        cr_assert_eq(setenv("TANDEM_CUDA_EMULATOR", "2", 1), 0);
        CLI(&r, "train", "--mode", "fsdp", "--device", "cuda:0,1", "--data", "synthetic",
            "--synthetic-size", "256", "--batch", "64", "--epochs", "1", "--model",
            "mlp:784-32-10", "--comm-hook", "bf16");
        unsetenv("TANDEM_CUDA_EMULATOR");
        cr_assert_neq(r.code, 0, "%s", r.out);
        cr_assert(strstr(r.out, "comm hook bf16 runs on host devices only"), "%s", r.out);
    }
}

/* --sync-bn: compare checks the CNN's DDP against one device (it says it
 * cannot without), and train runs it */
Test(cli_hooks, sync_bn, .timeout = 300)
{
    static cli_result r;
    CLI(&r, "train", "--sync-bn");
    expect(&r, 2, "--sync-bn applies to --mode ddp");
    CLI(&r, "compare", "--data", "synthetic", "--model", "cnn", "--steps", "4", "--warmup", "1",
        "--batch", "30", "--device", "cpu:3", "--sync-bn");
    expect(&r, 0, "with --sync-bn: the same tolerance as the MLP's");
    const char *p = strstr(r.out, "DDP vs single  step 1");
    cr_assert(p && strstr(p, "-> PASS"), "%s", r.out);
    /* compare's default modes include FSDP, which --sync-bn does not change */
    cr_assert(strstr(r.out, "FSDP vs DDP    not expected to match: --sync-bn is DDP's"), "%s",
              r.out);
    cr_assert(strstr(r.out, "verdict: PASS"), "%s", r.out);
    CLI(&r, "compare", "--data", "synthetic", "--model", "cnn", "--steps", "2", "--warmup", "1",
        "--batch", "30", "--device", "cpu:3");
    expect(&r, 0, "DDP vs single  not expected to match");
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--model", "cnn", "--sync-bn",
        "--data", "synthetic", "--synthetic-size", "256", "--batch", "64", "--epochs", "1");
    expect(&r, 0, "test accuracy");
}
