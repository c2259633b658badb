/* tools/rank_mesh.h: what the CLI tables of the mesh designs (a pipeline,
 * tools/rank_pp.c; tensor parallelism, tools/rank_tp.c) share around
 * their own calls: --mesh parsed into a one-line usage error, a rank and
 * its wrapper allocated, each mesh dimension's host and device
 * communicators (on a GPU the device ones come from a mesh over the NCCL
 * communicator), this replica's rows of a global batch and the step's
 * end over the dp dimension, the loss sum said once per replica, and the
 * one whole-model checkpoint: host arrays in the whole model's layout,
 * gathered on replica 0's root and written there, or read by every rank
 * which keeps its part. Knows nothing of pp/ or tp/: each table passes
 * its design's calls. */
#ifndef TDM_TOOLS_RANK_MESH_H
#define TDM_TOOLS_RANK_MESH_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/status.h"
#include "dist/mesh.h"
#include "dist/run.h"
#include "dist/step.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/optim.h"
#include "tools/ranks.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A rank's place in the mesh and its communicators. */
typedef struct tdm_tool_mesh {
    tdm_mesh *dev_mesh;                  /* a GPU's: the mesh over the device communicator
                                            (owned); NULL on host devices */
    tdm_comm *host[TDM_MESH_NDIMS];      /* each dimension's host communicator (borrowed) */
    tdm_comm *dev[TDM_MESH_NDIMS];       /* its device communicator: host[d] on host
                                            devices, dev_mesh's on a GPU (borrowed) */
    int coord[TDM_MESH_NDIMS], size[TDM_MESH_NDIMS];
    int rank;                            /* in the job */
    /* 1: the design's step returns the global batch's loss sum already
     * (--deterministic's tree carries every replica's): not summed again
     * over the dp dimension. Set by the design. */
    int loss_summed;
} tdm_tool_mesh;

/* b's --mesh parsed against world's ranks (USAGE "--mesh: <why>"), or
 * *dflt without --mesh, into *shape. */
tdm_status tdm_tool_mesh_parse(const tdm_tool_build *b, int world, const tdm_mesh_shape *dflt,
                               tdm_mesh_shape *shape);

/* A rank of a mesh design: the tdm_tool_rank into *self (what setup
 * returns; free runs either way) with w a zeroed wrapper of wsize bytes
 * that begins with its tdm_tool_mesh, filled from d (the device mesh
 * made on a GPU). On failure the message is said as tdm_tool_rank_fail
 * says it. */
tdm_status tdm_tool_mesh_rank_new(const tdm_tool_build *b, tdm_dist_rank *d, size_t wsize,
                                  void **self);
/* Frees the device mesh (the wrapper itself is the table's). */
void tdm_tool_mesh_fini(tdm_tool_mesh *mm);

/* A design's step over n of this replica's samples (x, y in host
 * memory), its loss gradient scaled by grad_scale; *loss_sum the sum of
 * the replica's per-sample losses. */
typedef tdm_status (*tdm_tool_mesh_step_fn)(void *ctx, const void *x, const int32_t *y, int n,
                                            float grad_scale, double *loss_sum);

/* One optimizer step of a global batch (a design table's step over the
 * rank's tdm_dist_stepper s): the before hook; this replica's share of
 * the batch (or, with s->own_rows, the rows it drew) through fn, the
 * loss gradient scaled by 1/B_global so that the sum over the replicas
 * is the global batch's mean-loss gradient; then the loss over the dp
 * dimension (tdm_dist_replicas_loss, labelled label; who names the rank
 * in a divergence: "pipeline stage 1"). in_elems and out_rows: 4-byte
 * inputs and target rows per sample. */
tdm_status tdm_tool_mesh_step(tdm_dist_stepper *s, const tdm_tool_mesh *mm, int in_elems,
                              int out_rows, tdm_tool_mesh_step_fn fn, void *ctx, const char *who,
                              const char *label, const void *x, const int32_t *y, int batch,
                              double *loss_mean);

/* A forward of n samples in eval mode: their loss sum and correct count. */
typedef tdm_status (*tdm_tool_mesh_eval_fn)(void *ctx, const void *x, const int32_t *y, int n,
                                            double *loss_sum, int64_t *correct);
/* The ops' eval_loss of a replica whose ranks all see the same n
 * samples: *loss_sum is fn's on the rank that says it (says: 1), 0
 * elsewhere, so that a sum over every rank counts each replica's once. */
tdm_status tdm_tool_mesh_eval_loss(tdm_tool_mesh_eval_fn fn, void *ctx, int says, const void *x,
                                   const int32_t *y, int n, double *loss_sum);

/* Zeroed host arrays in tables' layout for the whole model's state:
 * parameters, buffers (when it has any) and, with opt, its state (h->optim
 * set). Free with tdm_ckpt_host_free. */
tdm_status tdm_tool_ckpt_host(const tdm_model *tables, const tdm_optim *opt, tdm_ckpt_host *h);

/* Gathers the whole model's state over a replica's ranks into h on its
 * root (root: 1 there; elsewhere h holds nothing but optim, set when the
 * rank has optimizer state to send). Collective over the replica. */
typedef tdm_status (*tdm_tool_gather_fn)(void *ctx, tdm_ckpt_host *h, int root);
/* Takes this rank's part of the whole model's state in h. Local. */
typedef tdm_status (*tdm_tool_load_fn)(void *ctx, const tdm_ckpt_host *h);

/* The file every mode writes: replica 0 (dp coordinate 0) gathers (fn)
 * its state on its root (root: 1 on the one rank that writes), which
 * writes it with tables' names and shapes; the other replicas return at
 * once. A root that cannot allocate aborts group (the others are about
 * to send to it). */
tdm_status tdm_tool_mesh_save(const tdm_tool_mesh *mm, tdm_comm *group, int root,
                              const tdm_model *tables, tdm_optim *opt, tdm_tool_gather_fn fn,
                              void *ctx, const char *path, const tdm_ckpt_info *info);
/* Any mode's file, read by every rank into host arrays in tables'
 * layout, of which fn keeps its part. */
tdm_status tdm_tool_mesh_load(const tdm_model *tables, tdm_optim *opt, tdm_tool_load_fn fn,
                              void *ctx, const char *path, tdm_ckpt_info *info);

/* ", x D replicas (<how>)" into buf when the mesh has D > 1 replicas,
 * else "". */
void tdm_tool_mesh_replicas_str(const tdm_tool_mesh *mm, const char *how, char *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif
