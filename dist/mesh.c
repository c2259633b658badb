/* dist/mesh.c: a rank's place in a dp x pp x tp mesh (see dist/mesh.h). */
#include "dist/mesh.h"

tdm_dist_mesh tdm_dist_mesh_flat(int world)
{
    return (tdm_dist_mesh){.size = {[TDM_DIST_DIM_DP] = world, [TDM_DIST_DIM_PP] = 1,
                                    [TDM_DIST_DIM_TP] = 1}};
}

tdm_status tdm_dist_mesh_init(tdm_dist_mesh *mesh, int dp, int pp, int tp, int world)
{
    TDM_REQUIRE(dp >= 1 && pp >= 1 && tp >= 1 && (long long)dp * pp * tp == world,
                TDM_STATUS_INVALID_ARG,
                "mesh: dp %d x pp %d x tp %d is not the %d ranks of the job; choose sizes whose "
                "product is the number of ranks", dp, pp, tp, world);
    *mesh = (tdm_dist_mesh){.size = {[TDM_DIST_DIM_DP] = dp, [TDM_DIST_DIM_PP] = pp,
                                     [TDM_DIST_DIM_TP] = tp}};
    return TDM_STATUS_OK;
}

int tdm_dist_mesh_world(const tdm_dist_mesh *mesh)
{
    int w = 1;
    for (int d = 0; d < TDM_DIST_DIM_COUNT_; d++) w *= mesh->size[d];
    return w;
}

tdm_dist_place tdm_dist_mesh_place(const tdm_dist_mesh *mesh, int rank)
{
    tdm_dist_place p = {.role = 0};
    /* row-major, the last dimension (tp) fastest */
    for (int d = TDM_DIST_DIM_COUNT_ - 1; d >= 0; d--) {
        p.coord[d] = rank % mesh->size[d];
        rank /= mesh->size[d];
    }
    return p;
}

int tdm_dist_mesh_rank(const tdm_dist_mesh *mesh, const int coord[TDM_DIST_DIM_COUNT_])
{
    int r = 0;
    for (int d = 0; d < TDM_DIST_DIM_COUNT_; d++) r = r * mesh->size[d] + coord[d];
    return r;
}

void tdm_dist_mesh_split(const tdm_dist_mesh *mesh, int rank, tdm_dist_dim dim, int *color,
                         int *key)
{
    tdm_dist_place p = tdm_dist_mesh_place(mesh, rank);
    *key = p.coord[dim];
    /* the other coordinates, row-major, with dim left out */
    int c = 0;
    for (int d = 0; d < TDM_DIST_DIM_COUNT_; d++)
        if (d != (int)dim) c = c * mesh->size[d] + p.coord[d];
    *color = c;
}
