/* tests/test_examples.c: the example DDP program (examples/ddp_train.c)
 * builds against the public API and trains when started by `tandem
 * launch`, as a user would run it; its checkpoint then loads in
 * single-device mode. */
#include <criterion/criterion.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>

#include "core/device.h"
#include "models/checkpoint.h"
#include "tests/cli_util.h"

Test(examples, ddp_train_under_launch, .timeout = 120)
{
    static cli_result r;
    char bin[1024], ckpt[] = "/tmp/tandem-example-XXXXXX", path[1100];
    snprintf(bin, sizeof bin, "%s", cli_bin());
    snprintf(path, sizeof path, "%s/examples/ddp_train", dirname(bin));
    cr_assert(mkdtemp(ckpt));
    char out[1100];
    snprintf(out, sizeof out, "%s/ddp.safetensors", ckpt);
    CLI(&r, "launch", "-n", "2", "--", path, "1", "synthetic", out);
    expect(&r, 0, "[rank 0] epoch 1:");
    cr_assert(strstr(r.out, "test accuracy"), "%s", r.out);
    cr_assert_eq(cli_shm_entries(), 0, "left a tandem entry in /dev/shm");

    /* the DDP checkpoint loads into a single-device model of the same shape */
    tdm_device *dev;
    tdm_model *m;
    const int dims[] = {784, 256, 10};
    cr_assert(tdm_device_open(&dev, "cpu", 0, 1) == TDM_STATUS_OK);
    cr_assert(tdm_mlp_init(&m, dev, dims, 3, 99) == TDM_STATUS_OK);
    tdm_ckpt_info info;
    cr_assert(tdm_checkpoint_load(out, m, NULL, &info) == TDM_STATUS_OK, "%s",
              tdm_error_message());
    cr_assert_eq(info.epoch, 1);
    cr_assert_gt(info.step, 0);
    tdm_model_free(m);
    tdm_device_free(dev);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", ckpt);
    cr_assert(system(cmd) == 0);
}
