/* core/data.h: in-memory image classification datasets: IDX files
 * (MNIST / Fashion-MNIST, gzip or plain), a deterministic synthetic
 * dataset, and gathering a batch of samples by index.
 *
 * Inputs are stored normalised, as float (n, c*h*w) row-major with
 * channel-major images (c, h, w). IDX pixels p in 0..255 become
 *     x = (p / 255 - TDM_DATA_FMNIST_MEAN) / TDM_DATA_FMNIST_STD
 * with the Fashion-MNIST training-set mean and standard deviation, so that
 * inputs are roughly zero-mean and unit-variance. Synthetic samples are
 * generated at about that scale directly.
 *
 * Not a data loader with threads or prefetching: batching order (shuffle
 * per epoch) and sharding belong to the training loop, which calls
 * tdm_data_gather with its indices. */
#ifndef TDM_CORE_DATA_H
#define TDM_CORE_DATA_H

#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_DATA_FMNIST_MEAN 0.2860f
#define TDM_DATA_FMNIST_STD 0.3530f
/* IDX label files hold classes 0..9 (MNIST and Fashion-MNIST). */
#define TDM_DATA_IDX_CLASSES 10
/* Used when dir is NULL and TANDEM_DATA_DIR is unset or empty
 * (Debian package dataset-fashion-mnist). */
#define TDM_DATA_FMNIST_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"

typedef struct tdm_dataset {
    int64_t n;              /* samples */
    int c, h, w;            /* image shape; features = c*h*w */
    int n_classes;
    float *x;               /* (n, c*h*w), normalised; owned */
    int32_t *y;             /* (n,) in [0, n_classes); owned */
} tdm_dataset;

/* Features per sample: c*h*w. */
int64_t tdm_data_features(const tdm_dataset *d);

/* Loads an IDX image file (magic 0x00000803: u8, 3 dims n x rows x cols)
 * and its IDX label file (magic 0x00000801: u8, 1 dim n), each gzip
 * compressed or plain (detected from the content). Validates magic,
 * dtype, non-zero sane dimensions (rows*cols <= 2^20, n <= 2^28), the
 * exact file length (truncation and trailing bytes are errors), equal
 * counts, and labels < TDM_DATA_IDX_CLASSES. The result has c = 1,
 * n_classes = 10. TDM_STATUS_IO for open/read errors, TDM_STATUS_FORMAT
 * for content errors; messages name the file. On failure *out is zeroed. */
tdm_status tdm_data_load_idx(tdm_dataset *out, const char *images_path,
                             const char *labels_path);

/* Fashion-MNIST from dir (NULL: $TANDEM_DATA_DIR if set and non-empty,
 * else TDM_DATA_FMNIST_DEFAULT_DIR): train != 0 loads the 60000-sample
 * training set ("train-*"), train == 0 the 10000-sample test set
 * ("t10k-*"). Each file is looked for as "<name>.gz", then "<name>". */
tdm_status tdm_data_load_fashion_mnist(tdm_dataset *out, const char *dir, int train);

/* A deterministic, learnable synthetic dataset. Each class has a smooth
 * prototype image (a sum of random 2-D Gaussian blobs per channel, made
 * zero-mean unit-variance), a function of seed only. Sample i of a split
 * is the prototype of its class, scaled by a random amplitude and shifted
 * by up to 2 pixels, plus Gaussian pixel noise; its values are a function
 * of (seed, split, i) only, so any sharding or prefix of the data sees the
 * same samples. Labels are balanced: every block of n_classes consecutive
 * samples holds each class once, in a random order. split 0 (train) and 1
 * (test) draw different samples of the same classes. Sizes: n >= 0,
 * c, h, w >= 1 with c*h*w <= 2^20, 2 <= n_classes <= 1024. */
tdm_status tdm_data_synthetic(tdm_dataset *out, int64_t n, int c, int h, int w,
                              int n_classes, uint64_t seed, int split);

void tdm_data_free(tdm_dataset *d);   /* NULL ok, idempotent: zeroes *d */

/* Copies samples idx[0..count) of d into contiguous x (count, c*h*w) and
 * y (count); y may be NULL. Indices must lie in [0, d->n) (asserted). */
void tdm_data_gather(const tdm_dataset *d, const int64_t *idx, int64_t count, float *x,
                     int32_t *y);

#ifdef __cplusplus
}
#endif

#endif
