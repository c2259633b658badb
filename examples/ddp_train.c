/* examples/ddp_train.c: a complete DDP training program written against
 * tandem's C API, for `tandem launch`:
 *
 *   make examples
 *   build/tandem launch -n 2 -- build/examples/ddp_train [epochs] [data-dir|synthetic] [ckpt]
 *
 * Each rank joins the process group the launcher created (its timeout:
 * `tandem launch --timeout S`, or TANDEM_TIMEOUT), trains its own replica
 * on its DistributedSampler share of the data, the ranks evaluate the
 * test set together (each a share of it), and rank 0 prints the loss and
 * the test accuracy and writes a checkpoint. It is the program sketched
 * in docs/DDP.md ("A user program") made real; the CLI's `train --mode
 * ddp` does the same with more options. Not a test fixture: a program to
 * copy from. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "core/device.h"
#include "ddp/ddp.h"
#include "dist/pg.h"
#include "dist/sampler.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

#define CHECK(expr)                                                              \
    do {                                                                         \
        tdm_status st_ = (expr);                                                 \
        if (st_ != TDM_STATUS_OK) {                                              \
            fprintf(stderr, "ddp_train: %s: %s\n", #expr, tdm_error_message()); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

int main(int argc, char **argv)
{
    int epochs = argc > 1 ? atoi(argv[1]) : 1;
    const char *data = argc > 2 ? argv[2] : "synthetic";
    const char *ckpt = argc > 3 ? argv[3] : "ddp_train.safetensors";
    const int batch = 64; /* per rank */
    if (epochs < 1) {
        fprintf(stderr, "usage: ddp_train [epochs >= 1] [data-dir|synthetic] [checkpoint]\n");
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
    const int dims[] = {784, 256, 10};
    tdm_model *m;
    CHECK(tdm_mlp_init(&m, dev, dims, 3, /*seed=*/1)); /* rank 0's copy wins anyway */
    tdm_ddp *ddp;
    CHECK(tdm_ddp_init(&ddp, m, comm, &(tdm_ddp_opts){.bucket_cap_mb = 25}));
    tdm_optim *opt;
    CHECK(tdm_sgd_init(&opt, m, 0.05f, 0.9f));

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
            CHECK(tdm_ddp_zero_grad(ddp));
            CHECK(tdm_ddp_forward(ddp, x, y, batch, &loss));
            CHECK(tdm_ddp_backward(ddp)); /* buckets all-reduced as they fill */
            CHECK(tdm_ddp_step(ddp, opt));
            loss_sum += loss * batch;
            seen += batch;
        }
        double acc = 0.0, test_loss = 0.0;
        CHECK(tdm_ddp_evaluate(ddp, &test, 500, &test_loss, &acc)); /* collective */
        if (env.rank == 0)
            printf("epoch %d: rank 0 train loss %.4f, test loss %.4f, test accuracy %.4f\n",
                   e + 1, loss_sum / (double)seen, test_loss, acc);
    }
    tdm_ckpt_info info = {.step = tdm_optim_steps(opt), .epoch = epochs, .seed = 1};
    CHECK(tdm_ddp_checkpoint_save(ddp, ckpt, opt, &info));
    if (env.rank == 0) printf("saved %s\n", ckpt);

    free(idx);
    free(x);
    free(y);
    tdm_optim_free(opt);
    tdm_ddp_free(ddp);
    tdm_model_free(m);
    tdm_device_free(dev);
    tdm_comm_free(comm);
    tdm_data_free(&train);
    tdm_data_free(&test);
    return 0;
}
