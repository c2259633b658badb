/* core/npy.h: NumPy .npy arrays (format versions 1.0, 2.0 and 3.0,
 * https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html)
 * read whole into memory, every header field checked: the magic, the
 * version, the header length and its terminating newline, the dict's
 * keys (descr, fortran_order, shape; each exactly once, nothing else),
 * the dtype (little-endian or byte-order-free integers and float32),
 * C order, the shape (each size an integer, the element count and byte
 * size overflow-checked) and the file's exact length (truncation and
 * trailing bytes are errors). Messages name the file and the field.
 *
 * And datasets from a pair of them: inputs (n, ...) of float32 or uint8
 * and integer labels (n,). Not here: .npz archives, pickled object
 * arrays, big-endian data. */
#ifndef TDM_CORE_NPY_H
#define TDM_CORE_NPY_H

#include <stddef.h>
#include <stdint.h>

#include "core/data.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_NPY_MAX_DIMS 8
/* Largest array file read (bytes): 16 GiB. */
#define TDM_NPY_MAX_BYTES ((uint64_t)1 << 34)

typedef enum tdm_npy_dtype {
    TDM_NPY_F4 = 0,     /* '<f4' float32 */
    TDM_NPY_U1,         /* '|u1' uint8 */
    TDM_NPY_I1,         /* '|i1' int8 */
    TDM_NPY_I2,         /* '<i2' */
    TDM_NPY_U2,         /* '<u2' */
    TDM_NPY_I4,         /* '<i4' */
    TDM_NPY_I8,         /* '<i8' */
} tdm_npy_dtype;

typedef struct tdm_npy {
    tdm_npy_dtype dtype;
    size_t itemsize;
    int ndim;
    int64_t shape[TDM_NPY_MAX_DIMS];
    int64_t n_elem;
    void *data;         /* n_elem * itemsize bytes, owned */
} tdm_npy;

/* Reads path (TDM_STATUS_IO: cannot open or read; TDM_STATUS_FORMAT: not
 * a .npy file tandem reads, the message says which field and why). On
 * failure *out is zeroed. */
tdm_status tdm_npy_load(tdm_npy *out, const char *path);
/* The same from bytes in memory (name: what messages call it). */
tdm_status tdm_npy_parse(tdm_npy *out, const char *name, const void *bytes, size_t nbytes);
void tdm_npy_free(tdm_npy *a);   /* NULL ok, idempotent */
/* Element i as a 64-bit integer (integer dtypes). */
int64_t tdm_npy_int(const tdm_npy *a, int64_t i);

/* A dataset from "X.npy,Y.npy": X (n, ...) float32 (taken as is) or
 * uint8 (p / 255, then standardised with Fashion-MNIST's mean and
 * standard deviation, as the IDX loader does), Y (n,) integers >= 0.
 * Images: X of (n, c, h, w) or (n, h, w) (c = 1); other shapes are
 * vectors (c = h = 1, w = the product of X's other sizes). n_classes is
 * the largest label + 1 (at least 2). */
tdm_status tdm_data_load_npy(tdm_dataset *out, const char *pair);
/* 1 when a --data value names a pair of .npy files. */
int tdm_data_is_npy(const char *data);

#ifdef __cplusplus
}
#endif

#endif
