/* tests/test_mesh.c: the device mesh (dist/mesh.h): parsing shapes and their
 * one-line errors, the rank <-> coordinates layout, each dimension's
 * sub-communicator on 4 and 8 forked ranks (ranks, job ranks, collectives
 * along every dimension, send/recv along pp), and DDP's Reducer, unchanged,
 * on the dp sub-communicators of a dp=2 x pp=2 mesh: each dp group trains
 * as one device does on the same global batches. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "dist/mesh.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_ddp_util.h"
#include "tests/timeout_util.h"

Test(mesh, parse_shapes_and_errors)
{
    tdm_mesh_shape s;
    cr_assert_eq(tdm_mesh_parse("dp=2,pp=2", 4, &s), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert(s.size[TDM_MESH_DP] == 2 && s.size[TDM_MESH_PP] == 2 && s.size[TDM_MESH_TP] == 1);
    cr_assert_eq(tdm_mesh_parse("pp=4", 4, &s), TDM_STATUS_OK);
    cr_assert(s.size[TDM_MESH_DP] == 1 && s.size[TDM_MESH_PP] == 4);
    cr_assert_eq(tdm_mesh_parse("tp=2,dp=3,pp=1", 0, &s), TDM_STATUS_OK);
    cr_assert_eq(tdm_mesh_shape_ranks(&s), 6);
    cr_assert_eq(tdm_mesh_parse("", 3, &s), TDM_STATUS_INVALID_ARG);   /* 1 rank, not 3 */
    cr_assert_eq(tdm_mesh_parse(NULL, 1, &s), TDM_STATUS_OK);
    static const struct { const char *text, *msg; int world; } bad[] = {
        {"dp=2,pp=3", "6 ranks (dp x pp x tp), but the job has 4", 4},
        {"dp=2,dp=2", "dp given twice", 4},
        {"xp=2", "expected dp=N, pp=N or tp=N", 2},
        {"dp=0", "dp must be an integer in [1, 4096]", 0},
        {"dp=2,", "unexpected ','", 2},
        {"dp=2;pp=1", "unexpected ';'", 2},
        {"pp=", "pp must be an integer", 0},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(tdm_mesh_parse(bad[i].text, bad[i].world, &s), TDM_STATUS_INVALID_ARG,
                     "%s", bad[i].text);
        cr_assert(strstr(tdm_error_message(), bad[i].msg), "%s: %s", bad[i].text,
                  tdm_error_message());
        cr_assert(!strchr(tdm_error_message(), '\n'));
    }
}

Test(mesh, layout_round_trips_tp_fastest)
{
    tdm_mesh_shape s = {.size = {2, 3, 2}};
    for (int r = 0; r < 12; r++) {
        int c[TDM_MESH_NDIMS];
        tdm_mesh_coords_of(&s, r, c);
        cr_assert_eq(tdm_mesh_rank_at(&s, c), r);
        cr_assert_eq(c[TDM_MESH_TP], r % 2);
        cr_assert_eq(c[TDM_MESH_PP], (r / 2) % 3);
        cr_assert_eq(c[TDM_MESH_DP], r / 6);
    }
}

typedef struct mesh_out {
    int status[8];
    char err[8][256];
} mesh_out;

/* Each rank: coordinates as the layout says; each dimension's
 * communicator holds the ranks that differ only there, in coordinate
 * order (checked through job ranks and an all_gather), and an all_reduce
 * along each sums those ranks; along pp a send/recv chain. */
static int groups_rank(tdm_comm *comm, void *argp)
{
    const tdm_mesh_shape *shape = argp;
    int r = tdm_comm_rank(comm);
    tdm_mesh *m = NULL;
    int rc = 0;
    if (tdm_mesh_init(&m, comm, shape)) return 1;
    int c[TDM_MESH_NDIMS];
    tdm_mesh_coords_of(shape, r, c);
    for (int d = 0; d < TDM_MESH_NDIMS && !rc; d++) {
        tdm_comm *dc = tdm_mesh_comm(m, (tdm_mesh_dim)d);
        if (tdm_mesh_coord(m, (tdm_mesh_dim)d) != c[d] || tdm_comm_rank(dc) != c[d] ||
            tdm_comm_size(dc) != shape->size[d]) {
            rc = 2;
            break;
        }
        int64_t want = 0, v = r;
        for (int i = 0; i < shape->size[d]; i++) {
            int q[TDM_MESH_NDIMS];
            memcpy(q, c, sizeof q);
            q[d] = i;
            int jr = tdm_mesh_rank_at(shape, q);
            want += jr;
            if (tdm_comm_job_rank(dc, i) != jr) rc = 3;
        }
        if (tdm_comm_all_reduce(dc, &v, &v, 1, TDM_DTYPE_INT64, TDM_REDOP_SUM) || v != want)
            rc = 4;
    }
    tdm_comm *pp = tdm_mesh_comm(m, TDM_MESH_PP);
    int s = tdm_comm_rank(pp), n = tdm_comm_size(pp);
    float x = (float)r;
    if (!rc && s > 0 && (tdm_comm_recv(pp, &x, 1, TDM_DTYPE_FLOAT32, s - 1) ||
                         x != (float)(r - shape->size[TDM_MESH_TP])))
        rc = 5;
    x = (float)r;
    if (!rc && s + 1 < n && tdm_comm_send(pp, &x, 1, TDM_DTYPE_FLOAT32, s + 1)) rc = 6;
    tdm_mesh_free(m);
    return rc;
}

static void run_groups(const char *text, int world)
{
    tdm_mesh_shape s;
    cr_assert_eq(tdm_mesh_parse(text, world, &s), TDM_STATUS_OK, "%s", tdm_error_message());
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
    cr_assert_eq(tdm_shm_spawn(world, groups_rank, &s, &so, NULL), TDM_STATUS_OK, "%s: %s",
                 text, tdm_error_message());
}

Test(mesh, sub_communicators_per_dimension, .timeout = 120)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    run_groups("dp=2,pp=2", 4);
    run_groups("pp=4", 4);
    run_groups("dp=2,pp=2,tp=2", 8);
    run_groups("dp=4,tp=2", 8);
    cr_assert_eq(shm_t_segments_held(), before);
}

/* --- DDP on the dp dimension ------------------------------------------------ */

typedef struct ddp_mesh_arg {
    tddp_cfg cfg;
    const tdm_dataset *data;
    tddp_shared *sh[2];   /* one per pp coordinate: each dp group records its own */
} ddp_mesh_arg;

static int ddp_rank(tdm_comm *comm, void *argp)
{
    ddp_mesh_arg *a = argp;
    tdm_mesh_shape s = {.size = {2, 2, 1}};
    tdm_mesh *m = NULL;
    if (tdm_mesh_init(&m, comm, &s)) return 1;
    tddp_run run = {.cfg = &a->cfg, .data = a->data,
                    .sh = a->sh[tdm_mesh_coord(m, TDM_MESH_PP)]};
    int rc = tddp_rank_main(tdm_mesh_comm(m, TDM_MESH_DP), &run);
    tdm_mesh_free(m);
    return rc;
}

Test(mesh, ddp_reducer_on_the_dp_groups_equals_one_device, .timeout = 180)
{
    tdm_dataset data;
    cr_assert_eq(tddp_data(&data, 0, 2048), TDM_STATUS_OK);
    ddp_mesh_arg a = {.cfg = tddp_cfg_default(), .data = &data};
    a.cfg.batch = 24;
    a.cfg.steps = 5;
    for (int i = 0; i < 2; i++) a.sh[i] = tddp_shared_new();
    double ref_loss[TDDP_MAX_STEPS];
    static float ref_g[TDDP_MAX_ELEMS], ref_p[TDDP_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tddp_reference(&a.cfg, &data, ref_loss, ref_g, ref_p, &n), TDM_STATUS_OK);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(90000),
                             .shm = {.arena_bytes = tdm_ddp_arena_bytes(n)}};
    tdm_status st = tdm_shm_spawn(4, ddp_rank, &a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s / %s / %s", tdm_error_message(), a.sh[0]->err[0],
                 a.sh[1]->err[0]);
    for (int g = 0; g < 2; g++) {
        tddp_shared *sh = a.sh[g];
        cr_assert_eq(sh->n_elem, n);
        /* the Reducer used the dp group's zero-copy arena */
        cr_assert(sh->zero_copy, "group %d copied its gradients", g);
        for (int s = 0; s < a.cfg.steps; s++)
            cr_assert(fabs(sh->loss[s] - ref_loss[s]) <= 1e-5 + 1e-4 * fabs(ref_loss[s]),
                      "group %d step %d: loss %.8f vs %.8f", g, s, sh->loss[s], ref_loss[s]);
        int64_t at = 0;
        cr_assert(tddp_excess(sh->grads0, ref_g, n, 1e-6, 1e-4, &at) <= 0, "group %d grad[%lld]",
                  g, (long long)at);
        cr_assert(tddp_excess(sh->params, ref_p, n, 1e-6, 1e-3, &at) <= 0,
                  "group %d param[%lld]", g, (long long)at);
        cr_assert(!memcmp(sh->params, sh->params_r1, (size_t)n * 4));
        tddp_shared_free(sh);
    }
    tdm_data_free(&data);
}

/* The mesh's groups take the shared memory their use needs: the dp
 * dimension (DDP's buckets, FSDP's shards) the parent's zero-copy arena,
 * the pipeline's links and a group of one rank a small segment without
 * one. Before, every dimension got the parent's arena: dp=2,pp=2 over a
 * 64 MiB arena mapped 266 MiB on rank 0 before the mesh and 597 MiB
 * after (about 4x the shared memory over the job). */
static long long mesh_memfd_bytes(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    long long total = 0;
    unsigned long seen[64];
    int ns = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (!strstr(line, "tandem")) continue;
        unsigned long a, b, off, ino;
        char perm[8], dev[16];
        if (sscanf(line, "%lx-%lx %7s %lx %15s %lu", &a, &b, perm, &off, dev, &ino) != 6) continue;
        int dup = 0;
        for (int i = 0; i < ns; i++) dup |= seen[i] == ino;
        if (dup) continue;
        if (ns < 64) seen[ns++] = ino;
        total += (long long)(b - a);
    }
    if (f) fclose(f);
    return total;
}

static int arena_rank(tdm_comm *comm, void *argp)
{
    long long *out = argp;
    long long before = mesh_memfd_bytes();
    tdm_mesh_shape s;
    tdm_mesh *m = NULL;
    tdm_status st = tdm_mesh_parse("dp=2,pp=2", 4, &s);
    if (!st) st = tdm_mesh_init(&m, comm, &s);
    long long after = mesh_memfd_bytes();
    if (tdm_comm_rank(comm) == 0) {
        out[0] = before;
        out[1] = after;
    }
    tdm_mesh_free(m);
    return st ? 3 : 0;
}

Test(mesh, groups_take_an_arena_only_where_data_parallel_needs_it, .timeout = 120)
{
    long long *out = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(out, MAP_FAILED);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000), .shm = {.arena_bytes = 64u << 20}};
    cr_assert_eq(tdm_shm_spawn(4, arena_rank, out, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    /* the dp group's segment: two ranks' arenas, half the job's; the
     * others a few slots each */
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "shared memory: %lld MiB before, %lld MiB after\n", out[0] >> 20, out[1] >> 20);
    cr_assert(out[1] - out[0] <= out[0] * 6 / 10,
              "rank 0 maps %lld MiB of shared memory before the mesh, %lld MiB after",
              out[0] >> 20, out[1] >> 20);
    munmap(out, 4096);
}
