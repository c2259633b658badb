/* dist/mesh.h: where a rank sits in its design: its coordinates in a
 * device mesh of dp x pp x tp ranks (data-parallel replicas, pipeline
 * stages, tensor-parallel slices) and its role (a parameter server's
 * server or worker, a design's own numbering otherwise). A design says
 * both through its layout callback (dist/run.h); dist gives each rank
 * its place, and the colour and key under which the rank joins the
 * sub-communicator of each dimension (the ranks that share every other
 * coordinate), for the communicator's split. Not a communicator: the
 * design makes its own sub-communicators from these. */
#ifndef TDM_DIST_MESH_H
#define TDM_DIST_MESH_H

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_dist_dim {
    TDM_DIST_DIM_DP = 0,   /* replicas: the same layers, different data */
    TDM_DIST_DIM_PP,       /* pipeline stages: consecutive runs of layers */
    TDM_DIST_DIM_TP,       /* tensor-parallel slices of every split layer */
    TDM_DIST_DIM_COUNT_
} tdm_dist_dim;

/* The mesh: size[d] ranks along dimension d; their product is the world.
 * Rank numbering is row-major with tp fastest: rank = (dp * PP + pp) *
 * TP + tp, so that a tensor-parallel group (the most traffic) is a run of
 * consecutive ranks, on one machine when the ranks of a machine are. */
typedef struct tdm_dist_mesh {
    int size[TDM_DIST_DIM_COUNT_];
} tdm_dist_mesh;

/* A rank's place: its coordinates and the design's role for it. */
typedef struct tdm_dist_place {
    int coord[TDM_DIST_DIM_COUNT_];
    int role;      /* the design's own (0 unless its layout says) */
} tdm_dist_place;

/* world ranks all along dp (pure data parallelism: DDP, FSDP). */
tdm_dist_mesh tdm_dist_mesh_flat(int world);
/* dp x pp x tp; INVALID_ARG naming the sizes when one is below 1 or
 * their product is not world. */
tdm_status tdm_dist_mesh_init(tdm_dist_mesh *mesh, int dp, int pp, int tp, int world);
int tdm_dist_mesh_world(const tdm_dist_mesh *mesh);
/* Rank's coordinates (role 0). rank must be in [0, world). */
tdm_dist_place tdm_dist_mesh_place(const tdm_dist_mesh *mesh, int rank);
/* The rank with these coordinates. */
int tdm_dist_mesh_rank(const tdm_dist_mesh *mesh, const int coord[TDM_DIST_DIM_COUNT_]);
/* The sub-communicator along dim that rank belongs to: the ranks sharing
 * its other coordinates have the same *color (0..world/size[dim]-1), and
 * *key, its coordinate along dim, orders them (rank key of the split). */
void tdm_dist_mesh_split(const tdm_dist_mesh *mesh, int rank, tdm_dist_dim dim, int *color,
                         int *key);

#ifdef __cplusplus
}
#endif

#endif
