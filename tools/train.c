/* tools/train.c: `tandem train`, training one model on Fashion-MNIST or
 * synthetic data with one device (--mode single), DataParallel (--mode dp)
 * or DistributedDataParallel (--mode ddp), or a GPT on text in any of them
 * (tools/train_text.c). Here: the options (parse, then check and fill in
 * the defaults), the dispatch to a mode, the set-up steps every mode
 * shares (tools/train_modes.h) and --mode single. The epochs themselves:
 * tools/train_loop.c. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/npy.h"
#include "core/device.h"
#include "core/log.h"
#include "core/safefile.h"
#include "core/timer.h"
#include "core/text.h"
#include "ddp/hooks.h"
#include "dist/det.h"
#include "dist/run.h"
#include "fsdp/fsdp.h"
#include "models/accum.h"
#include "models/checkpoint.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/devices.h"
#include "tools/elastic.h"
#include "tools/ranks.h"
#include "tools/tools.h"
#include "tools/train_modes.h"

static void tdm_train_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem train [options]\n"
        "\n"
        "  --mode single|dp|ddp|fsdp|pp|tp|ps  one device, DataParallel\n"
        "                         (threads), DistributedDataParallel (processes),\n"
        "                         sharded data parallel (processes, see --sharding),\n"
        "                         a pipeline of the model's layers (processes, one\n"
        "                         stage each, see --stages), tensor parallel\n"
        "                         (processes, each a slice of every layer; the\n"
        "                         MLP, the GPT, model files of linear layers) or a\n"
        "                         parameter server (processes: see --servers; mlp\n"
        "                         only)                                      [single]\n"
        "  --model NAME           mlp (784-1024-1024-10), mlp:W0-W1-..-Wn, cnn, or\n"
        "                         gpt (a byte-level GPT, gpt:%d-%d-%d-%d) or gpt:L-D-H-T\n"
        "                         (L blocks, width D, H heads, context T), or\n"
        "                         file:PATH, a model file (docs/MODELS.md)     [mlp]\n"
        "  --device SPEC          single: cpu, cuda (GPU 0) or cuda:I; dp, ddp, fsdp, pp: cpu:N,\n"
        "                         cpu:I,J,.., cuda (every GPU) or cuda:I,J,.. [cpu]\n"
        "  --threads T            BLAS threads of a single host device       [1]\n"
        "  --epochs E             epochs to train (in all, when resuming)     [2]\n"
        "  --batch B              global batch size: images, or windows of T bytes\n"
        "                                                   [256; gpt: %d windows]\n"
        "  --grad-accum K         K micro-batches of B per optimizer step (the\n"
        "                         effective batch is K*B; in ddp the first K-1 run\n"
        "                         under no_sync); not with gpt                  [1]\n"
        "  --optim sgd|adamw      optimizer                      [sgd; gpt: adamw]\n"
        "  --lr LR                learning rate [sgd: 0.05, adamw: 0.001 (gpt: 0.002)]\n"
        "  --momentum M           SGD momentum                                [0.9]\n"
        "  --lr-schedule S        const, or cosine: lr decays to 0 over the run [const]\n"
        "  --nesterov             SGD with Nesterov momentum\n"
        "  --weight-decay WD      L2 (sgd) / decoupled (adamw)  [sgd: 0, adamw: 0.01]\n"
        "  --seed S               parameters and data order                   [1]\n"
        "  --data DIR|synthetic   IDX files (train-images-idx3-ubyte[.gz], ...)\n"
        "                         [/usr/share/datasets/fashion-mnist, or $TANDEM_DATA_DIR]\n"
        "  --data X.npy,Y.npy     NumPy arrays: inputs (n, ...) float32 or uint8,\n"
        "                         integer labels (n,) (docs/MODELS.md)\n"
        "  --val-data X.npy,Y.npy the validation set for --data X.npy,Y.npy\n"
        "                         [the last 10%% of --data's samples]\n"
        "  --data FILE|DIR        gpt: any file (bytes; the last 10%% validate) or a\n"
        "                         directory of fortune files (every 10th fortune\n"
        "                         validates)  [Debian's fortunes: %s,\n"
        "                         or $TANDEM_FORTUNES_DIR]\n"
        "  --synthetic-size N     training samples of the synthetic set      [12000]\n"
        "  --max-steps N          stop each epoch after N >= 1 steps (benchmarks) [all]\n"
        "  --save PATH            write a checkpoint (safetensors) after each epoch,\n"
        "                         atomically; the path is checked before training\n"
        "                         (a symlink of yours to a file: that file is written)\n"
        "  --resume PATH          continue from a checkpoint\n"
        "  --bucket-cap-mb MB     ddp, tp --sharding grad_op: gradient bucket size\n"
        "                         cap                                        [25]\n"
        "  --backend B            ddp, pp, tp under mpirun/srun: shm (shared memory, one\n"
        "                         machine), mpi (MPI), hier (shm inside each machine +\n"
        "                         MPI between them; ddp only) or auto (shm on one\n"
        "                         machine, else hier for ddp, mpi for pp, tp)  [auto]\n"
        "  --no-overlap           ddp: all-reduce after backward, not during it;\n"
        "                         fsdp: reduce-scatter after backward\n"
        "  --sharding S           fsdp (mlp, cnn, gpt): what each rank keeps only 1/N\n"
        "                         of:                                          [full]\n"
        "                         full      parameters, gradients, optimizer state\n"
        "                                   (PyTorch FSDP FULL_SHARD, DeepSpeed ZeRO-3)\n"
        "                         grad_op   gradients, optimizer state (FSDP\n"
        "                                   SHARD_GRAD_OP, ZeRO-2)\n"
        "                         optimizer optimizer state (ZeroRedundancyOptimizer,\n"
        "                                   ZeRO-1); the only one of --mode pp,\n"
        "                                   over --mesh dp=D,pp=S[,tp=N]'s dp\n"
        "                                   dimension (grad_op is refused: a\n"
        "                                   stage needs its whole gradients until\n"
        "                                   the last micro-batch)\n"
        "                         --mode tp over --mesh dp=D,tp=N's dp dimension\n"
        "                         (D >= 2): optimizer (ZeRO-1) or grad_op (ZeRO-2:\n"
        "                         a step holds the gradient shard and the buckets\n"
        "                         of --bucket-cap-mb backward is filling, each\n"
        "                         summed as backward completes it; with\n"
        "                         --grad-accum, all of them from the first\n"
        "                         micro-batch)\n"
        "                         (zero3, zero2, zero1 are accepted too)\n"
        "  --save-sharded         fsdp: --save writes one file per rank plus an index\n"
        "                         at PATH (for models too big to gather); without it\n"
        "                         --save writes the one file every mode reads\n"
        "  --sync-bn              ddp: SyncBatchNorm: batchnorm statistics over the\n"
        "                         whole global batch (all ranks), as on one device\n"
        "  --uneven               ddp, fsdp: each rank trains on its own samples (a\n"
        "                         sampler without padding; gpt: its own windows)\n"
        "                         in batches of B/N, so ranks may run different\n"
        "                         step counts; one out of data shadows the others\n"
        "                         (join) until all are done\n"
        "  --comm-hook H          ddp: allreduce (float32), fp16 or bf16 (rounded to\n"
        "                         16 bits: half the bytes), or powersgd (low-rank,\n"
        "                         error feedback); fsdp: fp16 or bf16 compress the\n"
        "                         reduce-scatters (no powersgd); all but allreduce\n"
        "                         need host devices                [allreduce]\n"
        "  --powersgd-rank R      powersgd: rank of the approximation          [4]\n"
        "  --powersgd-start-step S  powersgd: plain all-reduce for the first S\n"
        "                         optimizer steps (PyTorch's default is 1000)  [10]\n"
        "  --stages S             pp: pipeline stages, one device each    [the devices]\n"
        "  --microbatches M       pp: micro-batches per global batch (each of\n"
        "                         ceil(B/M) samples); one optimizer step per global\n"
        "                         batch: the step of --mode single --batch B/M\n"
        "                         --grad-accum M                                 [4]\n"
        "  --schedule S           pp: gpipe (every forward, then every backward) or\n"
        "                         1f1b (PipeDream-flush: at most S-s micro-batches'\n"
        "                         activations held on stage s)                [1f1b]\n"
        "  --split L1,L2,..       pp: the first pipeline layer of each stage (0 first;\n"
        "                         the MLP's linear layers, the CNN's layers, the GPT's\n"
        "                         embeddings, blocks and head)  [balanced by gemm flops]\n"
        "  --mesh dp=D,pp=S       pp: D pipeline replicas of S stages on D*S devices,\n"
        "                         their gradients summed by DDP over the dp dimension\n"
        "  --mesh dp=D,tp=N       tp: D replicas of a tensor-parallel group of N on\n"
        "                         D*N devices, gradients summed over the dp dimension\n"
        "  --sequence-parallel    tp, the GPT: Megatron's sequence parallelism: the\n"
        "                         LayerNorms and residual adds run on 1/N of the\n"
        "                         tokens, each all-reduce becomes a reduce-scatter and\n"
        "                         an all-gather along the tokens (the context must\n"
        "                         divide by N); also pp's tensor-parallel GPT stages\n"
        "                         (--mesh ...,pp=S,tp=N; fp32, no checkpointing)\n"
        "  --mesh dp=D,pp=S,tp=N  pp: as dp=D,pp=S with each stage's layers\n"
        "                         tensor-parallel over N devices (the MLP, the GPT,\n"
        "                         model files; D*S*N; --precision,\n"
        "                         --checkpoint-activations, --clip-grad-norm too)\n"
        "  --servers S            ps (mlp, gpt): the first S devices serve shards of the\n"
        "                         parameters and optimizer state; the others are\n"
        "                         workers                                        [1]\n"
        "  --ps-sync MODE         ps: sync (every step waits for every worker: DDP's\n"
        "                         step), bounded:K (a worker at most K steps ahead\n"
        "                         of the slowest; bounded:0 is sync) or async\n"
        "                         (HogWild: each push applied as it comes, one\n"
        "                         optimizer step per push; sgd only)          [sync]\n"
        "  --ps-transport shm|tcp ps: the RPC transport (tcp: loopback rendezvous at\n"
        "                         MASTER_ADDR, a port rank 0 picks)           [shm]\n"
        "  --timeout SECONDS      ddp, fsdp, pp, tp, ps: process-group timeout: a\n"
        "                         rank that waits longer for a peer in a\n"
        "                         collective fails, naming it [$TANDEM_TIMEOUT,\n"
        "                         else 60 for forked ranks,\n"
        "                         300 under tandem launch]\n"
        "  --max-restarts K       ddp, fsdp, pp: when a rank fails, stop the rest and start\n"
        "                         every rank again from the --save checkpoint, at\n"
        "                         most K times (docs/DEBUGGING.md)            [0]\n"
        "  --deterministic K      single, dp, ddp, fsdp, pp (tp: at a fixed tp size):\n"
        "                         the same bits on any number\n"
        "                         of devices: every global batch is cut into K virtual\n"
        "                         shards (K a power of two dividing --batch, divisible\n"
        "                         by the device count; pp: by the dp dimension, whose\n"
        "                         replicas' micro-batches are the K/D shards), each\n"
        "                         computed alone, and their gradients summed in one\n"
        "                         fixed binary tree; batchnorm per shard. A checkpoint\n"
        "                         resumes on any device count or mesh dividing K\n"
        "                         (docs/DETERMINISM.md)                     [off]\n"
        "  --min-devices M        ddp, fsdp with --deterministic and --max-restarts: a rank\n"
        "                         that keeps failing is left out and the job goes on\n"
        "                         from the last checkpoint on fewer devices (the most\n"
        "                         that divide K), never fewer than M           [off]\n"
                "  --precision P          fp32, bf16 or fp16: products in 16-bit with\n"
        "                         float32 sums, activations kept in 16 bits, master\n"
        "                         weights, gradients and optimizer float32; fp16 with\n"
        "                         dynamic loss scaling, the skip decided for every\n"
        "                         rank at once (docs/MEMORY.md)               [fp32]\n"
        "  --checkpoint-activations [all|N]  keep only the input of each\n"
        "                         segment of N blocks (gpt blocks, cnn conv blocks, mlp\n"
        "                         layers) and recompute it in backward; all = 1\n"
        "  --clip-grad-norm X     scale the gradients so that their global L2\n"
        "                         norm is at most X (torch's clip_grad_norm_); the\n"
        "                         last step's norm is printed with each epoch\n"
        "  --offload optimizer    --device cuda: optimizer state and step in\n"
        "                         host memory (ZeRO-Offload)\n"
        "  --offload params       --mode fsdp --sharding full, --device cuda:\n"
        "                         parameter and gradient shards, optimizer state\n"
        "                         and step in host memory; each unit's shard is\n"
        "                         copied up and all-gathered when used (FSDP's\n"
        "                         CPUOffload(offload_params=True))\n"
        "                         (these four: --mode single, dp, ddp, fsdp, pp\n"
        "                         and tp, pp's tensor-parallel stages too;\n"
        "                         --offload not with dp, pp or tp; tp:\n"
        "                         16-bit products only, activations kept float32,\n"
        "                         checkpointing per block or layer pair)\n"
        "  --no-eval              skip the test-set evaluation after each epoch\n"
        "                         (ddp spreads it over the ranks)\n"
        "  --quiet                only the per-epoch lines\n"
        "  --precise              the epoch line's losses (and accuracy) with 9\n"
        "                         significant digits, not 4 decimals\n"
        "  --json FILE            each epoch's figures for a program (loss, samples/s,\n"
        "                         seconds, evaluation), rewritten after every epoch\n"
        "                         (schema: docs/OUTPUTS.md); not with --uneven\n"
        "  --csv FILE             the same as CSV, one row per epoch\n"
        "  --trace FILE           a Chrome trace of the run (Perfetto, chrome://tracing):\n"
        "                         a track per process or rank with every step, its\n"
        "                         phases, evaluations and saves; not with --uneven\n"
        "\n"
        "A loss that turns NaN or infinite stops the run (exit 1) naming the step;\n"
        "a checkpoint with NaN or infinite values is never written nor resumed from.\n"
        "When a ddp or fsdp rank fails, the ranks' flight recorders are dumped (in\n"
        "$TANDEM_FR_DUMP, else a new $TMPDIR/tandem-fr-* directory, removed if no rank\n"
        "dumped; the newest 5 are kept) and the summary ends with tandem doctor's\n"
        "verdict (docs/DEBUGGING.md); a ps job's likewise, its RPC calls' recorders too.\n"
        "Before the model is built, the run's memory (parameters, gradients, optimizer\n"
        "state and activations of every replica, the ranks, shared memory) is checked\n"
        "against what this process can still take (MemAvailable, the memory cgroup's\n"
        "limit): a run that cannot fit is refused with the figures (docs/SECURITY.md).\n"
        "\n"
        "A gpt epoch draws as many bytes as the training text holds, in random\n"
        "windows; after each, the validation loss in nats and bits per byte is\n"
        "printed beside a bigram model's. tandem sample --resume CK generates text.\n"
        "\n"
        "--mode pp forks one stage per device: stage s holds a run of the model's\n"
        "layers and passes activations forward and their gradients back by send/recv\n"
        "(docs/PIPELINE.md); the checkpoint it writes is the whole model's, the file\n"
        "every mode reads, and it resumes from any mode's.\n"
        "\n"
        "--mode tp forks one rank per device: the MLP's linear layers pair up,\n"
        "the first column-parallel (output features split), the second\n"
        "row-parallel (input features split, partial outputs all-reduced); an odd\n"
        "last layer is replicated; a model file of linear layers does the same,\n"
        "its relu, gelu, tanh, sigmoid and dropout run on each rank's slice (any\n"
        "other layer is refused naming its line). The GPT's attention is split\n"
        "by heads and its MLP column/row (a GPT model file with a tied head\n"
        "too); LayerNorms and embeddings are replicated, or with\n"
        "--sequence-parallel the LayerNorms run on 1/N of the tokens\n"
        "(docs/TENSOR_PARALLEL.md). Its checkpoint is the whole model's, and it\n"
        "resumes from any mode's.\n"
        "\n"
        "--mode ddp, pp and tp fork one rank per device, or, started by an MPI\n"
        "launcher (mpirun -np N tandem train --mode ddp ..., srun), take their ranks\n"
        "from it (docs/MULTINODE.md).\n"
        "\n"
        "Exit codes: 0 ok, 1 runtime failure, 2 bad usage.\n",
        TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH, TDM_GPT_DEFAULT_HEADS,
        TDM_GPT_DEFAULT_CONTEXT, TDM_TRAIN_GPT_BATCH, TDM_TEXT_FORTUNES_DEFAULT_DIR);
}

/* The options as given; *help when --help asked for the usage. */
static tdm_status tdm_train_parse(int argc, char **argv, tdm_train_args *a, int *help)
{
    for (int i = 1; i < argc; i++) {
        TDM_ARGS_LOCALS
        TDM_ARGS_HELP(*help)
        const char *arg = argv[i];
        TDM_ARGS_STR("--mode", a->mode)
        TDM_ARGS_STR("--model", a->model)
        TDM_ARGS_STR("--device", a->device)
        TDM_ARGS_INT("--threads", 1, 256, a->threads)
        TDM_ARGS_INT("--epochs", 1, 100000, a->epochs)
        TDM_ARGS_INT("--batch", 1, 1 << 20, a->batch)
        TDM_ARGS_STR("--optim", a->optim)
        TDM_ARGS_FLOAT("--lr", 0.0, 1e3, a->lr)
        TDM_ARGS_FLOAT("--momentum", 0.0, 0.999999, a->momentum)
        TDM_ARGS_FLOAT("--weight-decay", 0.0, 1e3, a->weight_decay)
        TDM_ARGS_INT("--seed", 0, INT64_MAX, a->seed)
        TDM_ARGS_STR("--data", a->data)
        TDM_ARGS_STR("--val-data", a->val_data)
        TDM_ARGS_INT("--synthetic-size", 1, 1 << 26, a->synthetic_size)
        /* 0 would mean "every step" (the default): refused, not taken */
        TDM_ARGS_INT("--max-steps", 1, INT64_MAX, a->max_steps)
        TDM_ARGS_STR("--save", a->save)
        TDM_ARGS_STR("--json", a->json)
        TDM_ARGS_STR("--csv", a->csv)
        TDM_ARGS_STR("--trace", a->trace)
        TDM_ARGS_STR("--resume", a->resume)
        TDM_ARGS_STR("--lr-schedule", a->lr_schedule)
        TDM_ARGS_STR("--timeout", a->timeout)
        TDM_ARGS_STR("--sharding", a->sharding)
        TDM_ARGS_FLOAT("--bucket-cap-mb", 1e-6, 1 << 20, a->bucket_cap_mb)
        TDM_ARGS_INT("--max-restarts", 0, 1000, a->max_restarts)
        TDM_ARGS_STR("--backend", a->backend)
        TDM_ARGS_INT("--grad-accum", 1, 1 << 16, a->grad_accum)
        TDM_ARGS_STR("--comm-hook", a->comm_hook)
        TDM_ARGS_INT("--powersgd-rank", 1, 1 << 16, a->powersgd_rank)
        TDM_ARGS_INT("--powersgd-start-step", 0, INT64_MAX, a->powersgd_start_step)
        TDM_ARGS_INT("--stages", 1, 64, a->stages)
        TDM_ARGS_INT("--microbatches", 1, 1 << 16, a->microbatches)
        TDM_ARGS_STR("--schedule", a->schedule)
        TDM_ARGS_STR("--split", a->split)
        TDM_ARGS_STR("--mesh", a->mesh)
        TDM_ARGS_INT("--servers", 1, 63, a->servers)
        TDM_ARGS_STR("--ps-sync", a->ps_sync)
        TDM_ARGS_STR("--ps-transport", a->ps_transport)
        TDM_ARGS_INT("--deterministic", 1, TDM_DIST_DET_MAX_K, a->deterministic)
        TDM_ARGS_INT("--min-devices", 1, TDM_DIST_DET_MAX_K, a->min_devices)
        TDM_ARGS_STR("--precision", a->precision)
        TDM_CHECK(tdm_args_value(argc, argv, &i, "--offload", &v));
        if (v) {
            /* a second kind is refused by the levers' check */
            if (a->offload && strcmp(a->offload, v) && !a->offload_other)
                a->offload_other = a->offload;
            a->offload = v;
            continue;
        }
        TDM_ARGS_FLOAT("--clip-grad-norm", 1e-30, 1e30, a->clip_grad_norm)
        if (!strncmp(arg, "--checkpoint-activations", 24) && (arg[24] == '=' || !arg[24])) {
            /* the value is optional: all (every unit its own segment) */
            a->ckpt = arg[24] == '=' ? arg + 25
                      : i + 1 < argc && argv[i + 1][0] != '-' ? argv[++i] : "all";
            continue;
        }
        if (!strcmp(arg, "--nesterov")) { a->nesterov = 1; continue; }
        if (!strcmp(arg, "--no-eval")) { a->no_eval = 1; continue; }
        if (!strcmp(arg, "--quiet")) { a->quiet = 1; continue; }
        if (!strcmp(arg, "--precise")) { a->precise = 1; continue; }
        if (!strcmp(arg, "--no-overlap")) { a->no_overlap = 1; continue; }
        if (!strcmp(arg, "--save-sharded")) { a->save_sharded = 1; continue; }
        if (!strcmp(arg, "--uneven")) { a->uneven = 1; continue; }
        if (!strcmp(arg, "--sequence-parallel")) { a->sequence_parallel = 1; continue; }
        if (!strcmp(arg, "--sync-bn")) { a->sync_bn = 1; continue; }
        return tdm_tool_usage_error("tandem train: unknown option '%s' (see tandem train --help)\n",
                                    arg);
    }
    return TDM_STATUS_OK;
}

/* The checks of --grad-accum, --comm-hook, --uneven and --sync-bn. */
static tdm_status tdm_train_check_ddp_next(const tdm_train_args *a, int gpt)
{
    if (a->comm_hook && !tdm_ddp_hook_known(a->comm_hook))
        return tdm_tool_usage_error("tandem train: --comm-hook '%s': expected allreduce, fp16, "
                                    "bf16 or powersgd\n", a->comm_hook);
    int sharded = !strcmp(a->mode, "fsdp");
    if (a->comm_hook && strcmp(a->comm_hook, "allreduce") && strcmp(a->mode, "ddp") && !sharded)
        return tdm_tool_usage_error("tandem train: --comm-hook %s applies to --mode ddp and fsdp: "
                                    "DDP's buckets and the sharded modes' reduce-scatters are "
                                    "what it compresses\n", a->comm_hook);
    if (a->comm_hook && sharded && !strcmp(a->comm_hook, "powersgd")) {
        tdm_fsdp_comm_hook h;
        (void)tdm_fsdp_comm_hook_parse(a->comm_hook, &h);
        return tdm_tool_usage_error("tandem train: --mode fsdp --comm-hook powersgd: %s\n",
                                    tdm_error_message());
    }
    if (a->sync_bn && (strcmp(a->mode, "ddp") || gpt || a->uneven))
        return tdm_tool_usage_error("tandem train: --sync-bn applies to --mode ddp (not with "
                                    "--uneven: a rank out of data cannot take part in the "
                                    "statistics)\n");
    if (a->sync_bn && strncmp(a->model, "cnn", 3))
        fprintf(stderr, "tandem train: note: --sync-bn changes nothing for --model %s (no "
                        "batchnorm)\n", a->model);
    if (a->uneven && ((strcmp(a->mode, "ddp") && !sharded) || a->grad_accum > 1 ||
                      strcmp(a->lr_schedule, "const")))
        return tdm_tool_usage_error("tandem train: --uneven applies to --mode ddp and fsdp, "
                                    "without --grad-accum and with --lr-schedule const\n");
    if (a->uneven && (a->json || a->csv || a->trace))
        return tdm_tool_usage_error("tandem train: --json, --csv and --trace do not apply to "
                                    "--uneven (its epochs are per rank); read its epoch "
                                    "lines\n");
    if (gpt && a->grad_accum > 1)
        return tdm_tool_usage_error("tandem train: --grad-accum is not supported with --model "
                                    "gpt yet; raise --batch instead\n");
    if (tdm_train_effective_batch(a) > (1 << 20))
        return tdm_tool_usage_error("tandem train: --batch %lld x --grad-accum %lld = %lld "
                                    "samples per step is more than %d; lower one of them\n",
                                    a->batch, a->grad_accum, tdm_train_effective_batch(a),
                                    1 << 20);
    return TDM_STATUS_OK;
}

/* --deterministic K: what can honour one fixed order of the sums. The
 * device count is checked where it is known (tools/train_ranks.c). */
static tdm_status tdm_train_check_det(const tdm_train_args *a)
{
    if (a->min_devices && (!a->deterministic || !a->max_restarts ||
                           (strcmp(a->mode, "ddp") && strcmp(a->mode, "fsdp"))))
        return tdm_tool_usage_error("tandem train: --min-devices applies to --mode ddp and fsdp "
                                    "with --deterministic and --max-restarts (only then does a "
                                    "run go on, bit for bit, on fewer devices)\n");
    if (!a->deterministic) return TDM_STATUS_OK;
    int K = (int)a->deterministic;
    if (strcmp(a->mode, "single") && strcmp(a->mode, "dp") && strcmp(a->mode, "ddp") &&
        strcmp(a->mode, "fsdp") && strcmp(a->mode, "pp") && strcmp(a->mode, "tp"))
        return tdm_tool_usage_error("tandem train: --deterministic is not supported with --mode "
                                    "%s yet (single, dp, ddp, fsdp, pp and tp honour the fixed "
                                    "order)\n", a->mode);
    if ((a->precision && strcmp(a->precision, "fp32")) || a->ckpt || a->clip_grad_norm > 0.0 ||
        a->offload)
        return tdm_tool_usage_error("tandem train: --deterministic is not supported with "
                                    "--precision, --checkpoint-activations, --clip-grad-norm or "
                                    "--offload yet\n");
    if (a->uneven || a->sync_bn || (a->comm_hook && strcmp(a->comm_hook, "allreduce")))
        return tdm_tool_usage_error("tandem train: --deterministic cannot honour the fixed order "
                                    "with %s\n", a->uneven ? "--uneven (ranks train on their own "
                                    "samples)" : a->sync_bn ? "--sync-bn (batchnorm statistics are "
                                    "per virtual shard)" : "--comm-hook (the tree is the only "
                                    "gradient reduction)");
    if (tdm_dist_det_check(K, 1, a->batch))
        return tdm_tool_usage_error("tandem train: %s%s\n", tdm_error_message(),
                                    a->grad_accum > 1 ? " (with --grad-accum: the micro-batch "
                                    "--batch)" : "");
    return TDM_STATUS_OK;
}

/* The defaults that depend on the model and the optimizer, and the checks
 * that need no data: a language model trains with AdamW on windows of
 * text, the image models with SGD on batches of 256 images. */
static tdm_status tdm_train_check_args(tdm_train_args *a)
{
    int gpt = tdm_train_model_is_gpt(a->model);
    if (!a->optim) a->optim = gpt ? "adamw" : "sgd";
    if (!a->batch) a->batch = gpt ? TDM_TRAIN_GPT_BATCH : 256;
    if (strcmp(a->optim, "sgd") && strcmp(a->optim, "adamw"))
        return tdm_tool_usage_error("tandem train: --optim '%s': expected sgd or adamw\n",
                                    a->optim);
    if (strcmp(a->lr_schedule, "const") && strcmp(a->lr_schedule, "cosine"))
        return tdm_tool_usage_error("tandem train: --lr-schedule '%s': expected const or "
                                    "cosine\n", a->lr_schedule);
    /* a path that cannot take a checkpoint fails now, not after the first
     * epoch; nothing is left behind by the check */
    if (a->save && tdm_file_replace_check(AT_FDCWD, a->save) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem train: --save: %s\n", tdm_error_message());
    if (a->trace && tdm_file_replace_check(AT_FDCWD, a->trace) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem train: --trace: %s\n", tdm_error_message());
    /* a small GPT learns faster at 2e-3 than at AdamW's usual 1e-3
     * (docs/GPT.md) */
    if (a->lr < 0) a->lr = strcmp(a->optim, "sgd") ? (gpt ? 2e-3 : 1e-3) : 0.05;
    if (a->weight_decay < 0) a->weight_decay = strcmp(a->optim, "sgd") ? 0.01 : 0.0;
    int ranks = !strcmp(a->mode, "ddp") || !strcmp(a->mode, "fsdp") || !strcmp(a->mode, "pp") ||
                !strcmp(a->mode, "tp");
    if (a->timeout && !ranks && strcmp(a->mode, "ps"))
        fprintf(stderr, "tandem train: note: --timeout applies to --mode ddp, fsdp, pp, tp and ps "
                        "(the process group's collectives, ps's calls); --mode %s has none\n",
                a->mode);
    if ((a->sharding || a->save_sharded) && strcmp(a->mode, "fsdp") && strcmp(a->mode, "pp") &&
        strcmp(a->mode, "tp"))
        return tdm_tool_usage_error("tandem train: --sharding and --save-sharded apply to "
                                    "--mode fsdp, not --mode %s\n", a->mode);
    if (a->max_restarts && !ranks)
        return tdm_tool_usage_error("tandem train: --max-restarts applies to --mode ddp, fsdp "
                                    "and pp (ranks that can fail one by one)\n");
    TDM_CHECK(tdm_train_check_tp(a));
    TDM_CHECK(tdm_train_check_pp(a, gpt));
    if ((a->servers || a->ps_sync || a->ps_transport) && strcmp(a->mode, "ps"))
        return tdm_tool_usage_error("tandem train: --servers, --ps-sync and --ps-transport apply to "
                                    "--mode ps, not --mode %s\n", a->mode);
    if (a->max_restarts && (tdm_dist_launched() || tdm_dist_mpi_launched()))
        fprintf(stderr, "tandem train: note: --max-restarts restarts the ranks tandem train forks "
                        "itself; these ranks were started by a launcher, which restarts them: "
                        "`tandem launch --max-restarts K` (under mpirun or srun, rerun the job "
                        "with --resume)\n");
    /* started by tandem launch with restarts: its run's id goes into our
     * checkpoints (forked ranks get it from tdm_dist_run) */
    tdm_dist_run_id_begin(0);
    /* restarted by tandem launch --max-restarts: from the launcher's
     * --checkpoint, else our own --save, once this run wrote it */
    if (!a->resume) TDM_CHECK(tdm_dist_restart_resume(a->save, &a->resume));
    if (a->backend && strcmp(a->mode, "ddp") && strcmp(a->mode, "pp") && strcmp(a->mode, "tp"))
        return tdm_tool_usage_error("tandem train: --backend applies to --mode ddp, pp and "
                                    "tp\n");
    TDM_CHECK(tdm_train_check_ddp_next(a, gpt));
    TDM_CHECK(tdm_train_check_det(a));
    TDM_CHECK(tdm_train_levers_check(a));
    /* N copies of one model trained side by side are never what was meant */
    int mpi_n = tdm_dist_mpi_env_world();
    if (strcmp(a->mode, "ddp") && strcmp(a->mode, "pp") && strcmp(a->mode, "tp") && mpi_n > 1)
        return tdm_tool_usage_error("tandem train: started by an MPI launcher with %d ranks, but "
                                    "--mode %s would train %d independent copies: use --mode "
                                    "ddp, pp or tp\n", mpi_n, a->mode, mpi_n);
    return TDM_STATUS_OK;
}

static tdm_status tdm_train_dispatch(const tdm_train_args *a)
{
    if (!strcmp(a->mode, "ps") && !tdm_train_model_is_gpt(a->model)) return tdm_train_run_ps(a, NULL, NULL);
    if (tdm_train_model_is_gpt(a->model)) return tdm_train_text_main(a);
    if (!strcmp(a->mode, "single") || !strcmp(a->mode, "dp"))
        return tdm_train_run_local(a, NULL, NULL);
    if (!strcmp(a->mode, "ddp")) return tdm_train_run_ranks(a, &tdm_tool_ddp_design, NULL, NULL);
    if (!strcmp(a->mode, "fsdp"))
        return tdm_train_run_ranks(a, &tdm_tool_fsdp_design, NULL, NULL);
    if (!strcmp(a->mode, "pp")) return tdm_train_run_pp(a, NULL, NULL);
    if (!strcmp(a->mode, "tp")) return tdm_train_run_tp(a);
    return tdm_tool_usage_error("tandem train: --mode '%s': expected single, dp, ddp, fsdp, pp, "
                                "tp or ps\n", a->mode);
}

int tdm_tool_train_main(int argc, char **argv)
{
    tdm_train_args a = {
        .mode = "single", .model = "mlp", .device = "cpu", .threads = 1, .epochs = 2,
        .batch = 0, .optim = NULL, .lr = -1, .momentum = 0.9, .weight_decay = -1, .seed = 1,
        .data = NULL, .synthetic_size = 12000, .max_steps = 0, .lr_schedule = "const",
        .grad_accum = 1, .powersgd_rank = TDM_POWERSGD_DEFAULT_RANK, .powersgd_start_step = 10,
    };
    int help = 0;
    tdm_status st = tdm_train_parse(argc, argv, &a, &help);
    if (st == TDM_STATUS_OK && help) {
        tdm_train_usage(stdout);
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    if (st == TDM_STATUS_OK) st = tdm_train_check_args(&a);
    if (st == TDM_STATUS_OK) st = tdm_train_dispatch(&a);
    return tdm_tool_exit(st);
}

/* ---- set-up steps every mode shares ---- */

tdm_status tdm_train_fail(const char *what, tdm_status st)
{
    fprintf(stderr, "tandem train: %s: %s\n", what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
    return st;
}

void tdm_train_note_threads(const tdm_train_args *a, const char *unit)
{
    if (a->threads != 1)
        fprintf(stderr, "tandem train: note: --threads applies to --mode single; each %s "
                        "computes on one thread\n", unit);
}

tdm_status tdm_train_load_data(const tdm_train_args *a, const tdm_model_spec *spec,
                               tdm_dataset *train, tdm_dataset *test)
{
    tdm_status st;
    int synthetic = a->data && !strcmp(a->data, "synthetic");
    memset(train, 0, sizeof *train);
    memset(test, 0, sizeof *test);
    TDM_CHECK(tdm_train_check_seq(a, spec));
    if (tdm_data_is_npy(a->data)) {
        return tdm_train_load_npy(a, spec, train, test);
    } else if (synthetic) {
        int c, h, w, classes;
        tdm_model_spec_sample_shape(spec, &c, &h, &w, &classes);
        st = tdm_data_synthetic(train, a->synthetic_size, c, h, w, classes, 1234, 0);
        if (st == TDM_STATUS_OK)
            st = tdm_data_synthetic(test, a->synthetic_size / 6 > 0 ? a->synthetic_size / 6 : 1,
                                    c, h, w, classes, 1234, 1);
    } else {
        st = tdm_data_load_fashion_mnist(train, a->data, 1);
        if (st == TDM_STATUS_OK) st = tdm_data_load_fashion_mnist(test, a->data, 0);
    }
    if (st != TDM_STATUS_OK) {
        tdm_train_fail("loading data", st);
    } else if ((st = tdm_train_check_memory(a, spec)) != TDM_STATUS_OK) {
        /* said: the run would not fit */
    }
    if (st != TDM_STATUS_OK) {
        tdm_data_free(train);
        tdm_data_free(test);
    }
    return st;
}

tdm_status tdm_train_check_features(const tdm_dataset *train, const tdm_model *m)
{
    if (tdm_data_features(train) == tdm_model_in_features(m)) return TDM_STATUS_OK;
    return tdm_tool_usage_error("tandem train: the data has %lld features per sample but the "
                                "model expects %d\n", (long long)tdm_data_features(train),
                                tdm_model_in_features(m));
}

tdm_status tdm_train_resume(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                            tdm_ckpt_info *resumed)
{
    memset(resumed, 0, sizeof *resumed);
    if (!a->resume) return TDM_STATUS_OK;
    tdm_status st = tdm_checkpoint_load(a->resume, m, opt, resumed);
    if (st != TDM_STATUS_OK) return tdm_train_fail("resuming", st);
    tdm_train_print_resumed(a->resume, resumed);
    return TDM_STATUS_OK;
}

void tdm_train_print_resumed(const char *path, const tdm_ckpt_info *info)
{
    printf("resumed %s: epoch %lld, step %lld\n", path, (long long)info->epoch,
           (long long)info->step);
}

tdm_status tdm_train_make_optim(const tdm_train_args *a, tdm_model *m, tdm_optim **opt)
{
    tdm_optim_opts o;
    tdm_optim_opts_named(&o, a->optim, a->lr, a->weight_decay, a->momentum, a->nesterov);
    if (a->offload) o.offload = TDM_OPTIM_OFFLOAD_HOST;   /* --offload optimizer */
    tdm_status st = tdm_optim_init(opt, m, &o);
    if (st != TDM_STATUS_OK) return tdm_train_fail("optimizer", st);
    return TDM_STATUS_OK;
}

void tdm_train_print_header(const tdm_train_args *a, const tdm_model_spec *spec,
                            const tdm_dataset *train, const tdm_dataset *test, int64_t params,
                            const char *devices)
{
    char desc[160];
    tdm_model_spec_describe(spec, desc, sizeof desc);
    printf("tandem train: mode %s, model %s (%lld parameters), %s\n", a->mode, desc,
           (long long)params, devices);
    printf("  data: %s (%lld train, %lld test), batch %lld, %s lr %g", 
           a->data && !strcmp(a->data, "synthetic") ? "synthetic"
           : tdm_data_is_npy(a->data)               ? a->data
                                                    : "Fashion-MNIST",
           (long long)train->n, (long long)test->n, (long long)a->batch, a->optim, a->lr);
    if (!strcmp(a->optim, "sgd")) printf(" momentum %g%s", a->momentum, a->nesterov ? " nesterov" : "");
    printf(" weight decay %g%s, seed %lld\n", a->weight_decay,
           strcmp(a->lr_schedule, "cosine") ? "" : ", cosine schedule", (long long)a->seed);
    if (a->grad_accum > 1)
        printf("  gradient accumulation: %lld micro-batches of %lld per optimizer step, "
               "effective batch %lld\n", a->grad_accum, a->batch, tdm_train_effective_batch(a));
    tdm_tool_print_emulated(stdout, a->device);
    fflush(stdout);
}

void tdm_train_print_dp_phases(const tdm_phase_times *sum, double step_ms, int64_t steps)
{
    if (steps <= 0) return;
    double total = step_ms / (double)steps;
    printf("DP step, mean over %lld steps: %.2f ms\n", (long long)steps, total);
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
        if (p == TDM_PHASE_ALLREDUCE_WAIT) continue;
        double ms = sum->ms[p] / (double)steps;
        printf("  %-12s %8.2f ms  %5.1f%%\n", tdm_phase_name((tdm_phase)p), ms,
               total > 0 ? 100.0 * ms / total : 0.0);
    }
}

tdm_status tdm_train_load_and_probe(const tdm_train_args *a, const tdm_model_spec *spec,
                                    tdm_dataset *train, tdm_dataset *test,
                                    int64_t *param_elems)
{
    tdm_device *dev = NULL;
    tdm_model *probe = NULL;
    tdm_status st;
    if (train) TDM_CHECK(tdm_train_load_data(a, spec, train, test));
    if ((st = tdm_device_open(&dev, "cpu", 0, 1)) ||
        (st = tdm_model_init(&probe, dev, spec, (uint64_t)a->seed)))
        fprintf(stderr, "tandem train: building model: %s\n", tdm_error_message());
    else if (train) st = tdm_train_check_features(train, probe);
    if (st == TDM_STATUS_OK && param_elems) *param_elems = tdm_model_param_elems(probe);
    tdm_model_free(probe);
    tdm_device_free(dev);
    if (st && train) {
        tdm_data_free(train);
        tdm_data_free(test);
    }
    return st;
}
