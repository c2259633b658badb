/* dist/mesh.c: the device mesh (dist/mesh.h): parsing a shape, the
 * rank <-> coordinates layout, and one tdm_comm_split per dimension.
 * Not rank start-up and not any design's use of the dimensions. */
#include "dist/mesh.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const tdm_mesh_names[TDM_MESH_NDIMS] = {
    [TDM_MESH_DP] = "dp", [TDM_MESH_PP] = "pp", [TDM_MESH_TP] = "tp",
};

/* Largest size of one dimension: bounds the product below INT_MAX. */
#define TDM_MESH_MAX_SIZE 4096

struct tdm_mesh {
    tdm_comm *world;                      /* borrowed */
    tdm_mesh_shape shape;
    int coord[TDM_MESH_NDIMS];
    tdm_comm *comm[TDM_MESH_NDIMS];       /* owned */
};

const char *tdm_mesh_dim_name(tdm_mesh_dim d)
{
    return (unsigned)d < TDM_MESH_NDIMS ? tdm_mesh_names[d] : "?";
}

int tdm_mesh_shape_ranks(const tdm_mesh_shape *s)
{
    int n = 1;
    for (int d = 0; d < TDM_MESH_NDIMS; d++) n *= s->size[d];
    return n;
}

void tdm_mesh_shape_str(const tdm_mesh_shape *s, char *buf, size_t n)
{
    snprintf(buf, n, "dp=%d x pp=%d x tp=%d", s->size[TDM_MESH_DP], s->size[TDM_MESH_PP],
             s->size[TDM_MESH_TP]);
}

tdm_status tdm_mesh_parse(const char *text, int world, tdm_mesh_shape *out)
{
    tdm_mesh_shape s = {.size = {1, 1, 1}};
    int seen[TDM_MESH_NDIMS] = {0};
    const char *p = text ? text : "";
    while (*p) {
        int d = -1;
        for (int i = 0; i < TDM_MESH_NDIMS; i++)
            if (!strncmp(p, tdm_mesh_names[i], 2) && p[2] == '=') d = i;
        TDM_REQUIRE(d >= 0, TDM_STATUS_INVALID_ARG,
                    "mesh '%s': expected dp=N, pp=N or tp=N separated by commas at '%s'", text, p);
        TDM_REQUIRE(!seen[d], TDM_STATUS_INVALID_ARG, "mesh '%s': %s given twice", text,
                    tdm_mesh_names[d]);
        seen[d] = 1;
        char *end;
        long v = strtol(p + 3, &end, 10);
        TDM_REQUIRE(end != p + 3 && v >= 1 && v <= TDM_MESH_MAX_SIZE, TDM_STATUS_INVALID_ARG,
                    "mesh '%s': %s must be an integer in [1, %d]", text, tdm_mesh_names[d],
                    TDM_MESH_MAX_SIZE);
        s.size[d] = (int)v;
        p = end;
        if (*p == ',' && p[1]) p++;
        else TDM_REQUIRE(!*p, TDM_STATUS_INVALID_ARG,
                         "mesh '%s': unexpected '%c' (dimensions are separated by ',')", text, *p);
    }
    long long n = (long long)s.size[0] * s.size[1] * s.size[2];
    TDM_REQUIRE(n <= INT_MAX, TDM_STATUS_INVALID_ARG, "mesh '%s': %lld ranks is too many", text, n);
    TDM_REQUIRE(world <= 0 || n == world, TDM_STATUS_INVALID_ARG,
                "mesh '%s': %lld ranks (dp x pp x tp), but the job has %d", text ? text : "", n,
                world);
    *out = s;
    return TDM_STATUS_OK;
}

void tdm_mesh_coords_of(const tdm_mesh_shape *s, int rank, int coord[TDM_MESH_NDIMS])
{
    coord[TDM_MESH_TP] = rank % s->size[TDM_MESH_TP];
    rank /= s->size[TDM_MESH_TP];
    coord[TDM_MESH_PP] = rank % s->size[TDM_MESH_PP];
    coord[TDM_MESH_DP] = rank / s->size[TDM_MESH_PP];
}

int tdm_mesh_rank_at(const tdm_mesh_shape *s, const int coord[TDM_MESH_NDIMS])
{
    return (coord[TDM_MESH_DP] * s->size[TDM_MESH_PP] + coord[TDM_MESH_PP]) *
               s->size[TDM_MESH_TP] + coord[TDM_MESH_TP];
}

tdm_status tdm_mesh_init(tdm_mesh **out, tdm_comm *world, const tdm_mesh_shape *shape)
{
    tdm_status st = TDM_STATUS_OK;
    TDM_REQUIRE(out && world && shape, TDM_STATUS_INVALID_ARG, "mesh: NULL argument");
    *out = NULL;
    for (int d = 0; d < TDM_MESH_NDIMS; d++)
        TDM_REQUIRE(shape->size[d] >= 1, TDM_STATUS_INVALID_ARG, "mesh: %s has size %d",
                    tdm_mesh_names[d], shape->size[d]);
    char buf[64];
    tdm_mesh_shape_str(shape, buf, sizeof buf);
    TDM_REQUIRE(tdm_mesh_shape_ranks(shape) == tdm_comm_size(world), TDM_STATUS_INVALID_ARG,
                "mesh %s: %d ranks, but the communicator has %d", buf,
                tdm_mesh_shape_ranks(shape), tdm_comm_size(world));
    tdm_mesh *m = calloc(1, sizeof *m);
    TDM_REQUIRE(m, TDM_STATUS_OUT_OF_MEMORY, "mesh: calloc");
    m->world = world;
    m->shape = *shape;
    tdm_mesh_coords_of(shape, tdm_comm_rank(world), m->coord);
    /* dimension d's group: every coordinate but d's is the same; its
     * color is this rank's position with d's coordinate set to 0, its key
     * d's coordinate */
    for (int d = 0; d < TDM_MESH_NDIMS; d++) {
        int c[TDM_MESH_NDIMS];
        memcpy(c, m->coord, sizeof c);
        c[d] = 0;
        /* shared memory where the dimension's use needs it: dp's (and
         * tp's) collectives reduce in the parent's zero-copy arena; a
         * pipeline's links and a group of one carry little (p2p: small
         * slots, no arena) */
        tdm_comm_split_opts so = {.p2p = d == TDM_MESH_PP || shape->size[d] == 1};
        tdm_comm_set_label(world, "mesh: %s groups", tdm_mesh_names[d]);
        st = tdm_comm_split_ex(world, tdm_mesh_rank_at(shape, c), m->coord[d], &so, &m->comm[d]);
        if (st != TDM_STATUS_OK) {
            tdm_error_prefix(st, "mesh %s: the %s groups", buf, tdm_mesh_names[d]);
            goto fail;
        }
    }
    *out = m;
    return TDM_STATUS_OK;
fail:
    tdm_mesh_free(m);
    return st;
}

void tdm_mesh_free(tdm_mesh *m)
{
    if (!m) return;
    for (int d = TDM_MESH_NDIMS - 1; d >= 0; d--) tdm_comm_free(m->comm[d]);
    free(m);
}

const tdm_mesh_shape *tdm_mesh_shape_of(const tdm_mesh *m) { return &m->shape; }
int tdm_mesh_size(const tdm_mesh *m, tdm_mesh_dim d) { return m->shape.size[d]; }
int tdm_mesh_coord(const tdm_mesh *m, tdm_mesh_dim d) { return m->coord[d]; }
tdm_comm *tdm_mesh_comm(tdm_mesh *m, tdm_mesh_dim d) { return m->comm[d]; }
tdm_comm *tdm_mesh_world(tdm_mesh *m) { return m->world; }

void tdm_mesh_describe(const tdm_mesh *m, char *buf, size_t n)
{
    char s[64];
    tdm_mesh_shape_str(&m->shape, s, sizeof s);
    snprintf(buf, n, "rank %d of %s at dp %d, pp %d, tp %d", tdm_comm_rank(m->world), s,
             m->coord[TDM_MESH_DP], m->coord[TDM_MESH_PP], m->coord[TDM_MESH_TP]);
}
