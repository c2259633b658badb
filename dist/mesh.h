/* dist/mesh.h: a device mesh: the ranks of a job laid out as
 * data-parallel x pipeline x tensor-parallel (dp x pp x tp), each rank's
 * coordinates, and one sub-communicator per dimension (the ranks that
 * differ only in that coordinate), made with tdm_comm_split.
 *
 * Layout, as torch's init_device_mesh(("dp", "pp", "tp")) row-major: tp
 * varies fastest, then pp, then dp:
 *     rank = (dp * PP + pp) * TP + tp
 * so a tensor-parallel group is consecutive ranks (one machine's, which
 * need the most bandwidth), a pipeline's stages come next, and the
 * data-parallel replicas are furthest apart. "dp=2,pp=2" on 4 ranks:
 * ranks 0,1 are replica 0's stages 0,1 and ranks 2,3 replica 1's; the dp
 * groups are {0,2} and {1,3}, the pp groups {0,1} and {2,3}.
 *
 * Shared by the designs that combine (pp/, tp/, DDP or FSDP on the dp
 * dimension); it knows nothing of any of them. Not rank start-up: the
 * world communicator comes from the caller. */
#ifndef TDM_DIST_MESH_H
#define TDM_DIST_MESH_H

#include <stddef.h>

#include "core/comm.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_mesh_dim {
    TDM_MESH_DP = 0,
    TDM_MESH_PP,
    TDM_MESH_TP,
    TDM_MESH_NDIMS
} tdm_mesh_dim;

/* The size of each dimension (>= 1). */
typedef struct tdm_mesh_shape {
    int size[TDM_MESH_NDIMS];
} tdm_mesh_shape;

/* "dp", "pp", "tp"; "?" when invalid. */
const char *tdm_mesh_dim_name(tdm_mesh_dim d);
/* Parses "dp=2,pp=2" (any order, each dimension at most once, missing
 * ones 1; "" or NULL: everything data-parallel). With world > 0 the
 * product must be world. One-line INVALID_ARG messages: "mesh 'dp=2,pp=3':
 * 6 ranks, but the job has 4". */
tdm_status tdm_mesh_parse(const char *text, int world, tdm_mesh_shape *out);
/* "dp=2 x pp=2 x tp=1" */
void tdm_mesh_shape_str(const tdm_mesh_shape *s, char *buf, size_t n);
/* The ranks of the shape. */
int tdm_mesh_shape_ranks(const tdm_mesh_shape *s);
/* The coordinates of rank and back (no communicator needed). */
void tdm_mesh_coords_of(const tdm_mesh_shape *s, int rank, int coord[TDM_MESH_NDIMS]);
int tdm_mesh_rank_at(const tdm_mesh_shape *s, const int coord[TDM_MESH_NDIMS]);

typedef struct tdm_mesh tdm_mesh;

/* Lays out world's ranks as shape (whose product must be world's size)
 * and splits world once per dimension. Collective over world. world is
 * borrowed: it must outlive the mesh. The dp and tp groups get world's
 * collective staging and zero-copy arena; the pp groups and any group of
 * one rank the split's p2p options (small slots, no arena: every call
 * still works). */
tdm_status tdm_mesh_init(tdm_mesh **out, tdm_comm *world, const tdm_mesh_shape *shape);
/* Frees the sub-communicators. NULL is a no-op. */
void tdm_mesh_free(tdm_mesh *m);

const tdm_mesh_shape *tdm_mesh_shape_of(const tdm_mesh *m);
int tdm_mesh_size(const tdm_mesh *m, tdm_mesh_dim d);
/* This rank's coordinate in d (its rank in tdm_mesh_comm(m, d)). */
int tdm_mesh_coord(const tdm_mesh *m, tdm_mesh_dim d);
/* The ranks that share every coordinate but d's, ranked by d's
 * coordinate (borrowed; a group of one when the dimension has size 1). */
tdm_comm *tdm_mesh_comm(tdm_mesh *m, tdm_mesh_dim d);
tdm_comm *tdm_mesh_world(tdm_mesh *m);
/* "rank 3 of dp=2 x pp=2 x tp=1 at dp 1, pp 1, tp 0" */
void tdm_mesh_describe(const tdm_mesh *m, char *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif
