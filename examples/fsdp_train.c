/* examples/fsdp_train.c: a complete sharded data parallel (FSDP / ZeRO-3)
 * training program written against tandem's C API, for `tandem launch`:
 *
 *   make examples
 *   build/tandem launch -n 2 -- build/examples/fsdp_train [epochs] [data-dir|synthetic] [ckpt]
 *
 * or, against an installed tandem (README, "Using the library"):
 *
 *   cc -std=c11 -o fsdp_train examples/fsdp_train.c $(pkg-config --cflags --libs tandem)
 *   tandem launch -n 2 -- ./fsdp_train 1 synthetic
 *
 * Each rank joins the launcher's process group, wraps its model in FSDP
 * (every rank keeps 1/N of the parameters, gradients and optimizer state;
 * a layer's parameters are all-gathered just before use, its gradients
 * reduce-scattered as backward produces them), trains on its
 * DistributedSampler share of the data, the ranks evaluate together, and
 * the checkpoint is gathered into the one safetensors file every mode
 * reads. The same program as examples/ddp_train.c, with tdm_fsdp_* in
 * place of tdm_ddp_* and the optimizer over the rank's shard: the CLI's
 * `train --mode fsdp` does the same with more options. Not a test
 * fixture: a program to copy from. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/device.h"
#include "dist/pg.h"
#include "dist/sampler.h"
#include "fsdp/fsdp.h"
#include "models/model.h"
#include "models/optim.h"

#define CHECK(expr)                                                               \
    do {                                                                          \
        tdm_status st_ = (expr);                                                  \
        if (st_ != TDM_STATUS_OK) {                                               \
            fprintf(stderr, "fsdp_train: %s: %s\n", #expr, tdm_error_message()); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

int main(int argc, char **argv)
{
    int epochs = argc > 1 ? atoi(argv[1]) : 1;
    const char *data = argc > 2 ? argv[2] : "synthetic";
    const char *ckpt = argc > 3 ? argv[3] : "fsdp_train.safetensors";
    const int batch = 64; /* per rank */
    if (epochs < 1) {
        fprintf(stderr, "usage: fsdp_train [epochs >= 1] [data-dir|synthetic] [checkpoint]\n");
        return 2;
    }

    tdm_dist_env env;
    tdm_comm *comm;
    CHECK(tdm_dist_pg_init_from_env(&comm, &env)); /* RANK, WORLD_SIZE, TANDEM_SHM_FD */

    tdm_dataset train, test;
    if (!strcmp(data, "synthetic")) {
        CHECK(tdm_data_synthetic(&train, 6000, 1, 28, 28, 10, 1234, 0));
        CHECK(tdm_data_synthetic(&test, 1000, 1, 28, 28, 10, 1234, 1));
    } else {
        CHECK(tdm_data_load_fashion_mnist(&train, data, 1));
        CHECK(tdm_data_load_fashion_mnist(&test, data, 0));
    }

    tdm_device *dev;
    CHECK(tdm_device_open(&dev, "cpu", env.local_rank, 1));
    const int dims[] = {784, 256, 256, 10};
    tdm_model *m;
    CHECK(tdm_mlp_init(&m, dev, dims, 4, /*seed=*/1)); /* rank 0's copy wins anyway */
    tdm_fsdp *fsdp;
    /* FULL_SHARD, one unit per layer (the zero options are the defaults) */
    CHECK(tdm_fsdp_init(&fsdp, m, comm, &(tdm_fsdp_opts){.sharding = TDM_FSDP_FULL_SHARD}));
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    oo.lr = 0.05f;
    oo.momentum = 0.9f;
    tdm_optim *opt; /* over this rank's shard only */
    CHECK(tdm_fsdp_optim_init(&opt, fsdp, &oo));

    tdm_dist_sampler sampler;
    CHECK(tdm_dist_sampler_init(&sampler, train.n, env.rank, env.world_size, 1, 1, 0));
    int64_t n_mine = tdm_dist_sampler_len(&sampler);
    int64_t *idx = malloc((size_t)n_mine * sizeof *idx);
    float *x = malloc((size_t)batch * 784 * sizeof(float));
    int32_t *y = malloc((size_t)batch * sizeof(int32_t));
    if (!idx || !x || !y) return 1;

    for (int e = 0; e < epochs; e++) {
        tdm_dist_sampler_set_epoch(&sampler, e);
        CHECK(tdm_dist_sampler_indices(&sampler, idx));
        double loss_sum = 0.0;
        int64_t seen = 0;
        /* every rank has the same number of samples, so the same steps */
        for (int64_t s = 0; s + batch <= n_mine; s += batch) {
            double loss;
            tdm_data_gather(&train, idx + s, batch, x, y);
            CHECK(tdm_fsdp_zero_grad(fsdp));
            CHECK(tdm_fsdp_forward(fsdp, x, y, batch, &loss)); /* gathers each layer */
            CHECK(tdm_fsdp_backward(fsdp)); /* reduce-scatters each layer's gradients */
            CHECK(tdm_fsdp_step(fsdp, opt)); /* steps this rank's shard */
            loss_sum += loss * batch;
            seen += batch;
        }
        double acc = 0.0, test_loss = 0.0;
        CHECK(tdm_fsdp_evaluate(fsdp, &test, 500, &test_loss, &acc)); /* collective */
        if (env.rank == 0)
            printf("epoch %d: rank 0 train loss %.4f, test loss %.4f, test accuracy %.4f\n",
                   e + 1, loss_sum / (double)seen, test_loss, acc);
    }
    /* what sharding saves: this rank's parameters, gradients and optimizer
     * state against a whole copy of them (one device, DDP's every rank) */
    tdm_fsdp_memory mem;
    tdm_fsdp_get_memory(fsdp, opt, &mem);
    double mib = 1024.0 * 1024.0;
    double whole = (double)tdm_model_param_elems(m) * sizeof(float) *
                   (2 + tdm_optim_kind_n_state(&oo));
    if (env.rank == 0)
        printf("rank 0 keeps %.2f MiB of parameters, gradients and optimizer state (a whole copy: "
               "%.2f MiB)\n", (double)(mem.shard_params + mem.shard_grads + mem.optim_state) / mib,
               whole / mib);
    tdm_ckpt_info info = {.step = tdm_optim_steps(opt), .epoch = epochs, .seed = 1};
    CHECK(tdm_fsdp_save_full(fsdp, ckpt, opt, &info)); /* gathered: one file, any mode reads it */
    if (env.rank == 0) printf("saved %s\n", ckpt);

    free(idx);
    free(x);
    free(y);
    tdm_optim_free(opt);
    tdm_fsdp_free(fsdp);
    tdm_model_free(m);
    tdm_device_free(dev);
    tdm_comm_free(comm);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return 0;
}
