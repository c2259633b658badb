/* tools/train.c: `tandem train`, training one model on Fashion-MNIST or
 * synthetic data with one device (--mode single), DataParallel (--mode dp)
 * or DistributedDataParallel (--mode ddp). Prints a progress bar on a
 * terminal (plain lines otherwise), the loss, samples/s and test accuracy
 * after each epoch; saves and resumes checkpoints. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/data.h"
#include "core/device.h"
#include "core/log.h"
#include "core/safefile.h"
#include "core/timer.h"
#include "core/text.h"
#include "models/checkpoint.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "tools/args.h"
#include "tools/tools.h"
#include "tools/devices.h"
#include "tools/mpi_job.h"
#include "tools/train_modes.h"

static void tdm_train_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem train [options]\n"
        "\n"
        "  --mode single|dp|ddp   one device, DataParallel (threads) or\n"
        "                         DistributedDataParallel (processes)    [single]\n"
        "  --model NAME           mlp (784-1024-1024-10), mlp:W0-W1-..-Wn, cnn, or\n"
        "                         gpt (a byte-level GPT, gpt:%d-%d-%d-%d) or gpt:L-D-H-T\n"
        "                         (L blocks, width D, H heads, context T)      [mlp]\n"
        "  --device SPEC          single: cpu, cuda (GPU 0) or cuda:I; dp, ddp: cpu:N,\n"
        "                         cpu:I,J,.., cuda (every GPU) or cuda:I,J,.. [cpu]\n"
        "  --threads T            BLAS threads of a single host device       [1]\n"
        "  --epochs E             epochs to train (in all, when resuming)     [2]\n"
        "  --batch B              global batch size: images, or windows of T bytes\n"
        "                                                   [256; gpt: %d windows]\n"
        "  --optim sgd|adamw      optimizer                      [sgd; gpt: adamw]\n"
        "  --lr LR                learning rate [sgd: 0.05, adamw: 0.001 (gpt: 0.002)]\n"
        "  --momentum M           SGD momentum                                [0.9]\n"
        "  --lr-schedule S        const, or cosine: lr decays to 0 over the run [const]\n"
        "  --nesterov             SGD with Nesterov momentum\n"
        "  --weight-decay WD      L2 (sgd) / decoupled (adamw)  [sgd: 0, adamw: 0.01]\n"
        "  --seed S               parameters and data order                   [1]\n"
        "  --data DIR|synthetic   IDX files (train-images-idx3-ubyte[.gz], ...)\n"
        "                         [/usr/share/datasets/fashion-mnist, or $TANDEM_DATA_DIR]\n"
        "  --data FILE|DIR        gpt: any file (bytes; the last 10%% validate) or a\n"
        "                         directory of fortune files (every 10th fortune\n"
        "                         validates)  [Debian's fortunes: %s,\n"
        "                         or $TANDEM_FORTUNES_DIR]\n"
        "  --synthetic-size N     training samples of the synthetic set      [12000]\n"
        "  --max-steps N          stop each epoch after N steps (benchmarks)  [all]\n"
        "  --save PATH            write a checkpoint (safetensors) after each epoch,\n"
        "                         atomically; the path is checked before training\n"
        "  --resume PATH          continue from a checkpoint\n"
        "  --bucket-cap-mb MB     ddp: gradient bucket size cap              [25]\n"
        "  --backend B            ddp under mpirun/srun: shm (shared memory, one machine),\n"
        "                         mpi (MPI), hier (shm inside each machine + MPI between\n"
        "                         them) or auto (shm on one machine, hier otherwise)  [auto]\n"
        "  --no-overlap           ddp: all-reduce after backward, not during it\n"
        "  --timeout SECONDS      ddp: process-group timeout: a rank that waits\n"
        "                         longer for a peer in a collective fails, naming\n"
        "                         it [$TANDEM_TIMEOUT, else 60 for forked ranks,\n"
        "                         300 under tandem launch]\n"
        "  --no-eval              skip the test-set evaluation after each epoch\n"
        "                         (ddp spreads it over the ranks)\n"
        "  --quiet                only the per-epoch lines\n"
        "\n"
        "A loss that turns NaN or infinite stops the run (exit 1) naming the step;\n"
        "a checkpoint with NaN or infinite values is never written nor resumed from.\n"
        "\n"
        "A gpt epoch draws as many bytes as the training text holds, in random\n"
        "windows; after each, the validation loss in nats and bits per byte is\n"
        "printed beside a bigram model's. tandem sample --resume CK generates text.\n"
        "\n"
        "--mode ddp forks one rank per device, or, started by an MPI launcher\n"
        "(mpirun -np N tandem train --mode ddp ..., srun), takes its ranks from it\n"
        "(docs/MULTINODE.md).\n"
        "\n"
        "Exit codes: 0 ok, 1 runtime failure, 2 bad usage.\n",
        TDM_GPT_DEFAULT_LAYERS, TDM_GPT_DEFAULT_WIDTH, TDM_GPT_DEFAULT_HEADS,
        TDM_GPT_DEFAULT_CONTEXT, TDM_TRAIN_GPT_BATCH, TDM_TEXT_FORTUNES_DEFAULT_DIR);
}

void tdm_train_fail(const char *what, tdm_status st)
{
    fprintf(stderr, "tandem train: %s: %s\n", what,
            tdm_error_message()[0] ? tdm_error_message() : tdm_status_name(st));
}

void tdm_train_progress(void *ctx, int64_t step, int64_t steps, double loss, double sps)
{
    tdm_progress *p = ctx;
    if (p->quiet) return;
    if (p->tty) {
        int width = 30, filled = (int)(width * step / steps);
        fprintf(stderr, "\r  epoch %lld/%lld [", (long long)p->epoch + 1, (long long)p->epochs);
        for (int i = 0; i < width; i++) fputc(i < filled ? '=' : (i == filled ? '>' : ' '), stderr);
        fprintf(stderr, "] %lld/%lld loss %.4f  %.0f samples/s   ", (long long)step,
                (long long)steps, loss, sps);
        if (step == steps) fputs("\r\033[K", stderr);
        fflush(stderr);
    } else {
        int64_t tenth = step * 10 / steps;
        if (tenth != p->last_tenth && (tenth < 10)) {
            printf("  epoch %lld/%lld step %lld/%lld loss %.4f %.0f samples/s\n",
                   (long long)p->epoch + 1, (long long)p->epochs, (long long)step,
                   (long long)steps, loss, sps);
            fflush(stdout);
        }
        p->last_tenth = tenth;
    }
}

int tdm_tool_train_main(int argc, char **argv)
{
    tdm_train_args a = {
        .mode = "single", .model = "mlp", .device = "cpu", .threads = 1, .epochs = 2,
        .batch = 0, .optim = NULL, .lr = -1, .momentum = 0.9, .weight_decay = -1, .seed = 1,
        .data = NULL, .synthetic_size = 12000, .max_steps = 0, .lr_schedule = "const",
    };
    for (int i = 1; i < argc; i++) {
        const char *v;
        long long iv;
        double fv;
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            tdm_train_usage(stdout);
            return 0;
        }
        TDM_ARGS_STR("--mode", a.mode)
        TDM_ARGS_STR("--model", a.model)
        TDM_ARGS_STR("--device", a.device)
        TDM_ARGS_INT("--threads", 1, 256, a.threads)
        TDM_ARGS_INT("--epochs", 1, 100000, a.epochs)
        TDM_ARGS_INT("--batch", 1, 1 << 20, a.batch)
        TDM_ARGS_STR("--optim", a.optim)
        TDM_ARGS_FLOAT("--lr", 0.0, 1e3, a.lr)
        TDM_ARGS_FLOAT("--momentum", 0.0, 0.999999, a.momentum)
        TDM_ARGS_FLOAT("--weight-decay", 0.0, 1e3, a.weight_decay)
        TDM_ARGS_INT("--seed", 0, INT64_MAX, a.seed)
        TDM_ARGS_STR("--data", a.data)
        TDM_ARGS_INT("--synthetic-size", 1, 1 << 26, a.synthetic_size)
        TDM_ARGS_INT("--max-steps", 0, INT64_MAX, a.max_steps)
        TDM_ARGS_STR("--save", a.save)
        TDM_ARGS_STR("--resume", a.resume)
        TDM_ARGS_STR("--lr-schedule", a.lr_schedule)
        TDM_ARGS_STR("--timeout", a.timeout)
        TDM_ARGS_INT("--bucket-cap-mb", 0, 1 << 20, a.bucket_cap_mb)
        TDM_ARGS_STR("--backend", a.backend)
        if (!strcmp(arg, "--nesterov")) { a.nesterov = 1; continue; }
        if (!strcmp(arg, "--no-eval")) { a.no_eval = 1; continue; }
        if (!strcmp(arg, "--quiet")) { a.quiet = 1; continue; }
        if (!strcmp(arg, "--no-overlap")) { a.no_overlap = 1; continue; }
        fprintf(stderr, "tandem train: unknown option '%s' (see tandem train --help)\n", arg);
        return 2;
    }
    /* a language model trains with AdamW on windows of text; the image
     * models with SGD on batches of 256 images */
    int gpt = !strncmp(a.model, "gpt", 3);
    if (!a.optim) a.optim = gpt ? "adamw" : "sgd";
    if (!a.batch) a.batch = gpt ? TDM_TRAIN_GPT_BATCH : 256;
    if (strcmp(a.optim, "sgd") && strcmp(a.optim, "adamw")) {
        fprintf(stderr, "tandem train: --optim '%s': expected sgd or adamw\n", a.optim);
        return 2;
    }
    if (strcmp(a.lr_schedule, "const") && strcmp(a.lr_schedule, "cosine")) {
        fprintf(stderr, "tandem train: --lr-schedule '%s': expected const or cosine\n",
                a.lr_schedule);
        return 2;
    }
    if (a.save) {
        /* a path that cannot take a checkpoint fails now, not after the
         * first epoch; nothing is left behind by the check */
        tdm_status st = tdm_file_replace_check(AT_FDCWD, a.save);
        if (st != TDM_STATUS_OK) {
            fprintf(stderr, "tandem train: --save: %s\n", tdm_error_message());
            return 2;
        }
    }
    /* a small GPT learns faster at 2e-3 than at AdamW's usual 1e-3
     * (docs/GPT.md) */
    if (a.lr < 0) a.lr = strcmp(a.optim, "sgd") ? (gpt ? 2e-3 : 1e-3) : 0.05;
    if (a.weight_decay < 0) a.weight_decay = strcmp(a.optim, "sgd") ? 0.01 : 0.0;
    if (a.timeout && strcmp(a.mode, "ddp"))
        fprintf(stderr, "tandem train: note: --timeout applies to --mode ddp (the process "
                        "group's collectives); --mode %s has none\n", a.mode);
    if (a.backend && strcmp(a.mode, "ddp")) {
        fprintf(stderr, "tandem train: --backend applies to --mode ddp\n");
        return 2;
    }
    /* N copies of one model trained side by side are never what was meant */
    const char *mpi_n = getenv("OMPI_COMM_WORLD_SIZE");
    if (!mpi_n) mpi_n = getenv("PMI_SIZE");
    if (strcmp(a.mode, "ddp") && mpi_n && atoi(mpi_n) > 1) {
        fprintf(stderr, "tandem train: started by an MPI launcher with %s ranks, but --mode %s "
                "would train %s independent copies: use --mode ddp\n", mpi_n, a.mode, mpi_n);
        return 2;
    }
    if (gpt) return tdm_train_text_main(&a);
    if (!strcmp(a.mode, "single")) return tdm_train_run_single(&a);
    if (!strcmp(a.mode, "dp")) return tdm_train_run_dp ? tdm_train_run_dp(&a) : tdm_train_mode_absent("dp");
    if (!strcmp(a.mode, "ddp")) return tdm_train_run_ddp ? tdm_train_run_ddp(&a) : tdm_train_mode_absent("ddp");
    fprintf(stderr, "tandem train: --mode '%s': expected single, dp or ddp\n", a.mode);
    return 2;
}

int tdm_train_mode_absent(const char *mode)
{
    fprintf(stderr, "tandem train: --mode %s is not built into this tandem yet\n", mode);
    return 2;
}

/* ---- shared set-up ---- */

int tdm_train_load_data(const tdm_train_args *a, const tdm_model_spec *spec, tdm_dataset *train,
                        tdm_dataset *test)
{
    tdm_status st;
    int synthetic = a->data && !strcmp(a->data, "synthetic");
    memset(train, 0, sizeof *train);
    memset(test, 0, sizeof *test);
    if (synthetic) {
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
        tdm_data_free(train);
        tdm_data_free(test);
        return 0;
    }
    return 1;
}

int tdm_train_check_features(const tdm_dataset *train, const tdm_model *m)
{
    if (tdm_data_features(train) == tdm_model_in_features(m)) return 1;
    fprintf(stderr, "tandem train: the data has %lld features per sample but the model "
                    "expects %d\n", (long long)tdm_data_features(train),
            tdm_model_in_features(m));
    return 0;
}

int tdm_train_resume(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                     int64_t *start_epoch)
{
    tdm_ckpt_info info;
    *start_epoch = 0;
    if (!a->resume) return 1;
    tdm_status st = tdm_checkpoint_load(a->resume, m, opt, &info);
    if (st != TDM_STATUS_OK) {
        tdm_train_fail("resuming", st);
        return 0;
    }
    *start_epoch = info.epoch;
    tdm_train_print_resumed(a->resume, &info);
    return 1;
}

void tdm_train_print_resumed(const char *path, const tdm_ckpt_info *info)
{
    printf("resumed %s: epoch %lld, step %lld\n", path, (long long)info->epoch,
           (long long)info->step);
}

int tdm_train_make_optim(const tdm_train_args *a, tdm_model *m, tdm_optim **opt)
{
    tdm_optim_opts o;
    tdm_optim_opts_default(&o, strcmp(a->optim, "sgd") ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
    o.lr = (float)a->lr;
    o.weight_decay = (float)a->weight_decay;
    if (o.kind == TDM_OPTIM_SGD) {
        o.momentum = (float)a->momentum;
        o.nesterov = a->nesterov;
    }
    tdm_status st = tdm_optim_init(opt, m, &o);
    if (st != TDM_STATUS_OK) {
        tdm_train_fail("optimizer", st);
        return 0;
    }
    return 1;
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
           a->data && !strcmp(a->data, "synthetic") ? "synthetic" : "Fashion-MNIST",
           (long long)train->n, (long long)test->n, (long long)a->batch, a->optim, a->lr);
    if (!strcmp(a->optim, "sgd")) printf(" momentum %g%s", a->momentum, a->nesterov ? " nesterov" : "");
    printf(" weight decay %g%s, seed %lld\n", a->weight_decay,
           strcmp(a->lr_schedule, "cosine") ? "" : ", cosine schedule", (long long)a->seed);
    tdm_tool_print_emulated(stdout, a->device);
    fflush(stdout);
}

tdm_status tdm_train_sched_step(void *p, const void *x, const int32_t *y, int batch,
                                double *loss)
{
    tdm_train_sched *s = p;
    if (s->cosine) {
        double t = (double)tdm_optim_steps(s->opt) / (double)s->total_steps;
        if (t > 1.0) t = 1.0;
        tdm_optim_set_lr(s->opt, (float)(s->base_lr * 0.5 * (1.0 + cos(M_PI * t))));
    }
    return s->step(s->ctx, x, y, batch, loss);
}

/* After a failure: what --save holds now, so nobody wonders whether the
 * failed run replaced it. */
static void tdm_train_note_kept(const tdm_train_args *a, int64_t saved_epoch)
{
    if (!a->save || access(a->save, F_OK) != 0) return;
    if (saved_epoch > 0)
        fprintf(stderr, "tandem train: %s was left as it was: it holds epoch %lld, the last "
                        "good one\n", a->save, (long long)saved_epoch);
    else
        fprintf(stderr, "tandem train: %s was left as it was\n", a->save);
}

int tdm_train_epochs(const tdm_train_args *a, tdm_model *m, tdm_optim *opt,
                     const tdm_dataset *train, const tdm_dataset *test, tdm_train_step_fn step,
                     void *step_ctx, int64_t start_epoch, tdm_train_eval_fn eval,
                     void *eval_ctx, tdm_train_after_epoch_fn after, void *after_ctx)
{
    int64_t per_epoch = (train->n + a->batch - 1) / a->batch;
    if (a->max_steps > 0 && a->max_steps < per_epoch) per_epoch = a->max_steps;
    tdm_train_sched sched = {.step = step, .ctx = step_ctx, .opt = opt, .base_lr = a->lr,
                             .total_steps = per_epoch * a->epochs,
                             .cosine = !strcmp(a->lr_schedule, "cosine")};
    step = tdm_train_sched_step;
    step_ctx = &sched;
    tdm_progress p = {.tty = isatty(STDERR_FILENO), .quiet = a->quiet, .epochs = a->epochs,
                      .last_tenth = -1};
    if (start_epoch >= a->epochs) {
        printf("tandem train: the checkpoint has %lld epoch%s done and --epochs %lld asks for "
               "no more: nothing to do (raise --epochs to train further)\n",
               (long long)start_epoch, start_epoch == 1 ? "" : "s", a->epochs);
        fflush(stdout);
        return 1;
    }
    int64_t saved_epoch = -1;   /* the last epoch this run saved */
    for (int64_t e = start_epoch; e < a->epochs; e++) {
        tdm_epoch_stats es;
        p.epoch = e;
        p.last_tenth = -1;
        tdm_model_set_train(m, 1);
        tdm_status st = tdm_train_epoch(train, (int)a->batch, (uint64_t)a->seed, e, 0,
                                        a->max_steps, step, step_ctx, tdm_train_progress, &p, &es);
        if (st != TDM_STATUS_OK) {
            if (p.tty && !p.quiet) fputs("\n", stderr);
            tdm_train_fail("training", st);
            tdm_train_note_kept(a, saved_epoch);
            return 0;
        }
        double tl = NAN, acc = NAN;
        if (!a->no_eval) {
            st = eval ? eval(eval_ctx, m, test, &tl, &acc) : tdm_evaluate(m, test, 1000, &tl, &acc);
            if (st != TDM_STATUS_OK) {
                tdm_train_fail("evaluation", st);
                return 0;
            }
        }
        printf("epoch %lld/%lld: train loss %.4f, %.0f samples/s (%.1f s)", (long long)e + 1,
               (long long)a->epochs, es.loss_mean, es.samples_per_s, es.seconds);
        if (!a->no_eval) printf(", test loss %.4f, test accuracy %.4f", tl, acc);
        printf("\n");
        fflush(stdout);
        if (a->save) {
            tdm_ckpt_info info = {.step = tdm_optim_steps(opt), .epoch = e + 1,
                                  .seed = (uint64_t)a->seed};
            /* the last step's gradients: finite, or the run went bad (the
             * parameters are checked by the save itself) */
            double gnorm = 0.0;
            st = tdm_train_grad_norm(m, &gnorm);
            if (st == TDM_STATUS_OK) st = tdm_checkpoint_save(a->save, m, opt, &info);
            else tdm_error_prefix(st, "step %lld: refusing to save %s",
                                  (long long)info.step, a->save);
            if (st != TDM_STATUS_OK) {
                tdm_train_fail("saving checkpoint", st);
                tdm_train_note_kept(a, saved_epoch);
                return 0;
            }
            saved_epoch = e + 1;
            if (!a->quiet) printf("  saved %s (epoch %lld, step %lld)\n", a->save,
                                  (long long)e + 1, (long long)info.step);
        }
        if (after && !after(after_ctx, e)) return 0;
    }
    return 1;
}

int tdm_train_setup(const tdm_train_args *a, const tdm_model_spec *spec, tdm_device *dev,
                    tdm_dataset *train, tdm_dataset *test, tdm_model **m, tdm_optim **opt,
                    int64_t *start_epoch)
{
    tdm_status st;
    *start_epoch = 0;
    if (!tdm_train_load_data(a, spec, train, test)) return 1;
    if ((st = tdm_model_init(m, dev, spec, (uint64_t)a->seed)) != TDM_STATUS_OK) {
        tdm_train_fail("building model", st);
        return 1;
    }
    if (!tdm_train_check_features(train, *m)) return 2;
    if (!tdm_train_make_optim(a, *m, opt)) return 1;
    if (!tdm_train_resume(a, *m, *opt, start_epoch)) return 1;
    return 0;
}

int tdm_train_run_single(const tdm_train_args *a)
{
    int rc = 1;
    tdm_model_spec spec;
    tdm_device_list dl;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_dataset train = {0}, test = {0};
    tdm_single single = {0};
    tdm_status st;
    if ((st = tdm_model_spec_parse(&spec, a->model)) != TDM_STATUS_OK) {
        tdm_train_fail("--model", st);
        return 2;
    }
    if ((st = tdm_tool_parse_one_device(&dl, a->device)) != TDM_STATUS_OK) {
        tdm_train_fail("--device", st);
        return st == TDM_STATUS_NO_DEVICE ? 1 : 2;
    }
    if (dl.count != 1) {
        fprintf(stderr, "tandem train: --mode single uses one device, but '%s' names %d "
                        "(use --mode dp or --mode ddp for several)\n", a->device, dl.count);
        return 2;
    }
    if ((st = tdm_device_open(&dev, dl.kind == TDM_DEVICE_CUDA ? "cuda" : "cpu", dl.index[0],
                              (int)a->threads)) != TDM_STATUS_OK) {
        tdm_train_fail("opening device", st);
        return 1;
    }
    int64_t start_epoch = 0;
    if ((rc = tdm_train_setup(a, &spec, dev, &train, &test, &m, &opt, &start_epoch))) goto done;
    rc = 1;
    char devdesc[64];
    snprintf(devdesc, sizeof devdesc, "device %s, %lld BLAS thread%s", dev->name,
             (long long)a->threads, a->threads > 1 ? "s" : "");
    tdm_train_print_header(a, &spec, &train, &test, tdm_model_param_elems(m), devdesc);
    single.model = m;
    single.opt = opt;
    if (tdm_train_epochs(a, m, opt, &train, &test, tdm_single_step, &single, start_epoch, NULL,
                         NULL, NULL, NULL))
        rc = 0;
done:
    tdm_single_free(&single);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return rc;
}
