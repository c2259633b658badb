/* dist/check.h: the checks every multi-process design runs across its
 * ranks, so that a rank built or driven differently is named instead of
 * silently averaged with the others: at construction, that every rank
 * holds the same model (one hash of each tensor's name, shape and offset,
 * the designs' own plans hashed the same way), and at the end of each
 * synchronised step, that every rank reduced the gradients of the same
 * training forward. Not the designs' plans themselves (ddp/'s buckets,
 * fsdp/'s units): they pass their own values through. */
#ifndef TDM_DIST_CHECK_H
#define TDM_DIST_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* FNV-1a (64 bits) over n bytes, continuing from h: the one hash of the
 * checks (start from TDM_DIST_HASH_SEED). Not cryptographic: it tells
 * honest differences apart. */
#define TDM_DIST_HASH_SEED 1469598103934665603ull

uint64_t tdm_dist_hash(const void *p, size_t n, uint64_t h);
/* A tensor's name, shape and offset in its flat buffer. */
uint64_t tdm_dist_tensor_hash(const tdm_tensor_info *t);

/* The model check of a design's construction, collective over comm:
 * every rank has as many parameter and buffer tensors, and each tensor
 * the same hash and size as rank 0's, else MISMATCH naming the rank and
 * the tensor ("ddp: parameter 2 differs between ranks: rank 0's has 192
 * elements, rank 1's has 160 (...; here, on rank 1, it is 'fc1.bias'); every
 * rank must build the same model"). who prefixes the messages ("ddp");
 * label the flight recorder's labels of its two collectives ("<label>
 * (counts)", "<label> (tensors)"). extra: n_extra values of the design's
 * own (a plan's hash, its options) gathered with the counts, in the same
 * collective; *all_extra (NULL: not wanted; else the caller frees it)
 * receives every rank's, rank r's at r * n_extra, for the design to
 * compare after the tensors agree. */
tdm_status tdm_dist_check_model(tdm_comm *comm, const tdm_model *m, const char *who,
                                const char *label, const int64_t *extra, int n_extra,
                                int64_t **all_extra);

/* The end of a synchronised step: seq[r] is the count of training
 * forwards rank r had run when it reduced this step's gradients (each
 * rank writes its own slot of one SUM, zeros elsewhere), mine this
 * rank's. MISMATCH naming the first rank whose count differs ("<who>:
 * collective sequence mismatch: rank 1 reduced the gradients of its
 * training forward #5 together with rank 0's forward #6 ..."): a rank
 * that skipped a backward, or ran an extra step, is named at the end of
 * that same step. */
tdm_status tdm_dist_check_seq(const char *who, const double *seq, int world, int rank,
                              double mine);

#ifdef __cplusplus
}
#endif

#endif
