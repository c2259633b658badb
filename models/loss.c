/* models/loss.c: softmax cross-entropy over a batch on any device: the
 * per-row kernel runs on the device, the per-sample losses are summed on
 * the host in double so the reported loss does not depend on how a batch
 * was split. Not a layer: DP computes it on the output device over the
 * gathered logits, DDP and single-device on their own batch. */
#include <stdint.h>
#include <stdlib.h>

#include "models/model.h"

tdm_status tdm_model_loss(const tdm_model *m, const float *logits, const int32_t *labels,
                          int batch, float scale, double *loss_sum, float *dlogits)
{
    int rows = tdm_model_out_rows(m);
    TDM_REQUIRE(batch > 0 && (int64_t)batch * rows <= INT32_MAX, TDM_STATUS_INVALID_ARG,
                "loss: batch %d of %d rows each", batch, rows);
    if (rows == 1)
        return tdm_loss_softmax_xent(tdm_model_device(m), logits, labels, batch,
                                     tdm_model_n_classes(m), scale, loss_sum, dlogits);
    /* A sample's loss is the mean over its rows, so each row weighs
     * scale / rows and the sum over samples is the sum over rows / rows. */
    double s = 0.0;
    TDM_CHECK(tdm_loss_softmax_xent(tdm_model_device(m), logits, labels, batch * rows,
                                    tdm_model_n_classes(m), scale / (float)rows, &s, dlogits));
    if (loss_sum) *loss_sum = s / rows;
    return TDM_STATUS_OK;
}

tdm_status tdm_loss_softmax_xent(tdm_device *dev, const float *logits, const int32_t *labels,
                                 int batch, int classes, float scale, double *loss_sum,
                                 float *dlogits)
{
    TDM_REQUIRE(batch > 0 && classes > 0, TDM_STATUS_INVALID_ARG,
                "loss: batch %d and classes %d must be positive", batch, classes);
    tdm_status st = TDM_STATUS_OK;
    float *rows = NULL, *host = NULL;
    size_t nb = (size_t)batch * sizeof(float);
    /* the device's scratch, not an allocation per call: on a GPU that was
     * a cudaMalloc and a device-wide synchronising cudaFree every step */
    TDM_TRY(tdm_dev_scratch(dev, nb, (void **)&rows));
    TDM_TRY(tdm_dev_softmax_xent(dev, logits, labels, batch, classes, scale, rows, dlogits));
    if (tdm_dev_kind(dev) == TDM_DEVICE_HOST) {
        host = rows;
    } else {
        host = malloc(nb);
        if (!host) {
            st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate %zu bytes", nb);
            goto fail;
        }
        TDM_TRY(tdm_dev_copy_to_host(dev, host, rows, nb));
    }
    double s = 0.0;
    for (int i = 0; i < batch; i++) s += host[i];
    if (loss_sum) *loss_sum = s;
fail:
    if (host != rows) free(host);
    return st;
}
