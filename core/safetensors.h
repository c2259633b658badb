/* core/safetensors.h: reading and writing the safetensors file format
 * (https://github.com/huggingface/safetensors): named tensors plus an
 * optional string-to-string metadata map.
 *
 * Layout: an 8-byte little-endian u64 N; N bytes of UTF-8 JSON mapping
 * tensor name -> {"dtype", "shape", "data_offsets": [begin, end]} and an
 * optional "__metadata__" object of strings; then the data section, the
 * tensors' little-endian bytes, contiguous and without gaps, offsets
 * relative to the start of the data section. Written headers are padded
 * with spaces so that the data section starts 8-byte aligned.
 *
 * This module is generic: it knows nothing of models or optimisers
 * (checkpoint naming lives with the callers). It assumes a little-endian
 * host and does no byte swapping. Loading reads the whole file into
 * memory (tdm_st_load_header: its header only); it is not meant for files
 * larger than memory. */
#ifndef TDM_CORE_SAFETENSORS_H
#define TDM_CORE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_ST_MAX_DIMS 8
/* Headers longer than this are refused (the reference implementation's
 * limit is 100 MB as well). */
#define TDM_ST_MAX_HEADER_NBYTES (100u * 1000u * 1000u)

typedef enum tdm_st_dtype {
    TDM_ST_F64 = 0,
    TDM_ST_F32,
    TDM_ST_F16,
    TDM_ST_BF16,
    TDM_ST_I64,
    TDM_ST_I32,
    TDM_ST_I16,
    TDM_ST_I8,
    TDM_ST_U64,
    TDM_ST_U32,
    TDM_ST_U16,
    TDM_ST_U8,
    TDM_ST_BOOL,
    TDM_ST_DTYPE_COUNT_
} tdm_st_dtype;

/* "F32", "I64", ... as spelled in the file; "?" for an invalid value. */
const char *tdm_st_dtype_name(tdm_st_dtype dt);
/* Bytes per element; 0 for an invalid value. */
size_t tdm_st_dtype_size(tdm_st_dtype dt);

typedef struct tdm_st_tensor {
    const char *name;               /* borrowed */
    tdm_st_dtype dtype;
    int ndim;                       /* 0..TDM_ST_MAX_DIMS; 0 is a scalar */
    int64_t shape[TDM_ST_MAX_DIMS];
    const void *data;               /* borrowed; (nbytes); in a loaded
                                       file possibly unaligned: copy it
                                       with tdm_st_read or memcpy */
    size_t nbytes;                  /* product(shape) * dtype size */
} tdm_st_tensor;

typedef struct tdm_st_meta {
    const char *key;                /* borrowed */
    const char *value;              /* borrowed */
} tdm_st_meta;

/* Writes the tensors (in this order) and metadata to path atomically,
 * through tdm_file_replace_open (core/safefile.h): a temporary file in
 * the same directory that no other user can have planted, fsynced,
 * renamed over path, and the directory fsynced. On a failure before the
 * rename the temporary file is gone and a previous file at path is
 * intact; if only the final directory fsync fails, path already holds
 * the new, complete file (its rename may not yet be durable). A path that
 * exists and is neither a regular file nor a symlink (a directory, a
 * FIFO, a device) is refused; a symlink is replaced, not written through.
 * Refuses (TDM_STATUS_INVALID_ARG) empty or duplicate names, the name
 * "__metadata__", duplicate metadata keys, ndim outside 0..8, negative
 * dimensions, and nbytes that does not match the shape and dtype.
 * meta may be NULL when n_meta is 0. */
tdm_status tdm_st_save(const char *path, const tdm_st_tensor *tensors, int n_tensors,
                       const tdm_st_meta *meta, int n_meta);

/* A loaded, fully validated file. */
typedef struct tdm_st_file tdm_st_file;

/* Reads and validates the whole file (a regular file: a FIFO or a device
 * is refused without blocking): header length bounds, strict JSON,
 * known dtypes, shapes, offsets consistent with shapes, tensors covering
 * the data section exactly with no overlap, gap or trailing byte, unique
 * names, string-valued metadata. Errors name the file and, where one is
 * involved, the tensor; TDM_STATUS_FORMAT for content, TDM_STATUS_IO for
 * system errors. */
tdm_status tdm_st_load(tdm_st_file **out, const char *path);
/* Reads the 8-byte length and the JSON header only, never the data
 * section (memory: the header's size, whatever the file's): the same
 * checks of the length, the JSON and the metadata as tdm_st_load, but
 * the tensors are neither read nor checked, and tdm_st_count is 0. For
 * reading a checkpoint's metadata (its run id, its step) cheaply. */
tdm_status tdm_st_load_header(tdm_st_file **out, const char *path);
void tdm_st_free(tdm_st_file *f);   /* NULL ok */

/* The path given to tdm_st_load. */
const char *tdm_st_path(const tdm_st_file *f);
/* Tensors in header order, 0 <= i < tdm_st_count(f). */
int tdm_st_count(const tdm_st_file *f);
const tdm_st_tensor *tdm_st_get(const tdm_st_file *f, int i);
/* NULL if absent. */
const tdm_st_tensor *tdm_st_find(const tdm_st_file *f, const char *name);
/* Metadata, in header order; value NULL if absent. */
int tdm_st_meta_count(const tdm_st_file *f);
const tdm_st_meta *tdm_st_meta_at(const tdm_st_file *f, int i);
const char *tdm_st_meta_get(const tdm_st_file *f, const char *key);

/* Copies tensor `name` into dst after checking that it exists with this
 * dtype and shape (ndim entries); dst holds product(shape) elements.
 * Errors (TDM_STATUS_FORMAT) name the file, the tensor and what differs:
 * "ckpt.safetensors: tensor 'fc1.weight' has shape [1024, 784], expected
 * [512, 784]". */
tdm_status tdm_st_read(const tdm_st_file *f, const char *name, tdm_st_dtype dtype,
                       int ndim, const int64_t *shape, void *dst);

#ifdef __cplusplus
}
#endif

#endif
