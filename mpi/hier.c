/* mpi/hier.c: the hierarchical communicator ("hier"): shared memory
 * inside each machine, MPI between machines.
 *
 * all_reduce of n elements on machines of L ranks each:
 *   1. reduce-scatter inside the machine (shm): local rank l ends with
 *      the machine's sum of shard l (n/L elements);
 *   2. all-reduce of shard l across machines (MPI), by the ranks with
 *      local rank l on every machine: L all-reduces in parallel, each
 *      rank carrying its own shard, so every rank's link works;
 *   3. all-gather inside the machine (shm).
 * The n mod L elements left over are all-reduced inside the machine and
 * then across it (every local rank alike: they are few). When machines
 * hold different numbers of ranks the shards would not line up: reduce to
 * local rank 0, MPI all-reduce between those, broadcast inside the
 * machine. AVG sums and divides once at the end; the 16-bit floats are
 * widened to float32 for the whole pipeline and rounded once, as shm
 * does.
 *
 * Order of reduction: within a machine shm's rank order, across machines
 * MPI's. So the result is bitwise shm's on one machine, and with one rank
 * per machine on two machines (a + b either way), not otherwise.
 *
 * The other collectives run over MPI as they are, on a communicator over
 * every rank (world rank order).
 *
 * On one machine (every rank there, no pretend split) every collective is
 * the shm communicator's own, handed over as it is: no reduce-scatter /
 * all-gather around an empty cross-machine step, bitwise shm.
 *
 * Not here: making the machine's shared segment (mpi/shm_named.c), the
 * map of ranks to machines (mpi/job.c). */
#include "mpi/job_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "shm/shm_comm.h"

typedef struct tdm_hier_impl {
    tdm_comm *local;          /* owned: this machine's ranks over shm */
    tdm_comm *cross;          /* owned, MPI: uniform: the ranks of this local rank on every
                                 machine; else the machines' local rank 0 (NULL on others) */
    tdm_comm *world;          /* owned, MPI: every rank, for what goes to MPI as it is */
    int rank, size, local_rank, local_size, n_machines, uniform;
    char algo[80];
    int algo_is_local;        /* the last call was shm's: algo is "shm:" + its algorithm */
    void *scratch;            /* float32 staging of the 16-bit floats */
    size_t scratch_bytes;
} tdm_hier_impl;

static tdm_status tdm_hier_inner(tdm_hier_impl *h, tdm_comm *c, tdm_coll coll, const void *send,
                                 void *recv, size_t n, tdm_dtype dt, tdm_redop op, int root,
                                 int async)
{
    (void)h;
    tdm_comm_call k = {.coll = coll, .sendbuf = send, .recvbuf = recv, .count = n, .dtype = dt,
                       .op = op, .root = root};
    /* the shm part's messages name the job's ranks (mpi/shm_named.c) */
    return tdm_comm_run_inner(c, &k, async);
}

/* send -> recv, n elements, op not AVG; the three steps (or the leaders'). */
static tdm_status tdm_hier_pipeline(tdm_hier_impl *h, const char *send, char *recv, size_t n,
                                    tdm_dtype dt, tdm_redop op, int async)
{
    size_t es = tdm_dtype_size(dt);
    if (!h->uniform) {
        TDM_CHECK(tdm_hier_inner(h, h->local, TDM_COLL_REDUCE, send, recv, n, dt, op, 0, async));
        if (h->cross)
            TDM_CHECK(tdm_hier_inner(h, h->cross, TDM_COLL_ALL_REDUCE, recv, recv, n, dt, op, -1,
                                     async));
        TDM_CHECK(tdm_hier_inner(h, h->local, TDM_COLL_BROADCAST, recv, recv, n, dt, op, 0, async));
        snprintf(h->algo, sizeof h->algo, "shm-reduce/%s/shm-bcast",
                 h->cross ? tdm_comm_last_algo(h->cross) : "-");
        return TDM_STATUS_OK;
    }
    size_t L = (size_t)h->local_size, blk = n / L, main = blk * L, tail = n - main;
    char *mine = recv + (size_t)h->local_rank * blk * es;
    if (blk) {
        TDM_CHECK(tdm_hier_inner(h, h->local, TDM_COLL_REDUCE_SCATTER, send, mine, blk, dt, op, -1,
                                 async));
        TDM_CHECK(tdm_hier_inner(h, h->cross, TDM_COLL_ALL_REDUCE, mine, mine, blk, dt, op, -1,
                                 async));
        TDM_CHECK(tdm_hier_inner(h, h->local, TDM_COLL_ALL_GATHER, mine, recv, blk, dt, op, -1,
                                 async));
        snprintf(h->algo, sizeof h->algo, "shm-rs/%s/shm-ag", tdm_comm_last_algo(h->cross));
    }
    if (tail) {
        TDM_CHECK(tdm_hier_inner(h, h->local, TDM_COLL_ALL_REDUCE, send + main * es, recv + main * es,
                                 tail, dt, op, -1, async));
        TDM_CHECK(tdm_hier_inner(h, h->cross, TDM_COLL_ALL_REDUCE, recv + main * es,
                                 recv + main * es, tail, dt, op, -1, async));
        if (!blk) snprintf(h->algo, sizeof h->algo, "shm-ar/%s", tdm_comm_last_algo(h->cross));
    }
    return TDM_STATUS_OK;
}

#define TDM_HIER_DIVIDE(T, D)                                                 \
    do {                                                                      \
        T *p_ = x;                                                            \
        for (size_t i = 0; i < n; i++) p_[i] = p_[i] / (D);                   \
    } while (0)

/* AVG = SUM / size, as shm/kernels.c divides. */
static void tdm_hier_divide(void *x, size_t n, tdm_dtype dt, int d)
{
    switch (dt) {
    case TDM_DTYPE_FLOAT32: TDM_HIER_DIVIDE(float, (float)d); break;
    case TDM_DTYPE_FLOAT64: TDM_HIER_DIVIDE(double, (double)d); break;
    case TDM_DTYPE_INT32: TDM_HIER_DIVIDE(int32_t, d); break;
    case TDM_DTYPE_INT64: TDM_HIER_DIVIDE(int64_t, d); break;
    default: break;
    }
}

static tdm_status tdm_hier_all_reduce(tdm_hier_impl *h, const tdm_comm_call *k)
{
    if (k->count == 0) return TDM_STATUS_OK;
    tdm_redop op = k->op == TDM_REDOP_AVG ? TDM_REDOP_SUM : k->op;
    if (k->dtype != TDM_DTYPE_BFLOAT16 && k->dtype != TDM_DTYPE_FLOAT16) {
        TDM_CHECK(tdm_hier_pipeline(h, k->sendbuf, k->recvbuf, k->count, k->dtype, op, k->async));
        if (k->op == TDM_REDOP_AVG) tdm_hier_divide(k->recvbuf, k->count, k->dtype, h->size);
        return TDM_STATUS_OK;
    }
    /* 16-bit floats: float32 all the way, one rounding at the end */
    size_t need = k->count * sizeof(float);
    if (need > h->scratch_bytes) {
        void *s = realloc(h->scratch, need);
        TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "hier: cannot allocate %zu bytes of scratch",
                    need);
        h->scratch = s;
        h->scratch_bytes = need;
    }
    float *f = h->scratch;
    const uint16_t *src = k->sendbuf;
    int bf = k->dtype == TDM_DTYPE_BFLOAT16;
    for (size_t i = 0; i < k->count; i++) f[i] = bf ? tdm_bf16_to_f32(src[i]) : tdm_f16_to_f32(src[i]);
    TDM_CHECK(tdm_hier_pipeline(h, (const char *)f, (char *)f, k->count, TDM_DTYPE_FLOAT32, op,
                                k->async));
    if (k->op == TDM_REDOP_AVG) tdm_hier_divide(f, k->count, TDM_DTYPE_FLOAT32, h->size);
    uint16_t *dst = k->recvbuf;
    for (size_t i = 0; i < k->count; i++) dst[i] = bf ? tdm_f32_to_bf16(f[i]) : tdm_f32_to_f16(f[i]);
    return TDM_STATUS_OK;
}

static tdm_status tdm_hier_run(void *impl, const tdm_comm_call *k)
{
    tdm_hier_impl *h = impl;
    if (h->n_machines == 1) {
        /* One machine: every collective is shm's own, bit for bit, with no
         * split around a cross-machine step that has nobody to talk to
         * (shm's ranks are the job's there: roots and peers need no
         * mapping). The name is composed only when asked for. */
        h->algo_is_local = 1;
        return tdm_comm_run_inner(h->local, k, k->async);
    }
    h->algo_is_local = 0;
    if (k->coll == TDM_COLL_ALL_REDUCE) return tdm_hier_all_reduce(h, k);
    /* the others over MPI as they are (roots and peers are world ranks) */
    TDM_CHECK(tdm_comm_run_inner(h->world, k, k->async));
    snprintf(h->algo, sizeof h->algo, "%s", tdm_comm_last_algo(h->world));
    return TDM_STATUS_OK;
}

static tdm_status tdm_hier_abort(void *impl, const char *reason)
{
    tdm_hier_impl *h = impl;
    /* this machine's ranks learn the reason through the segment first;
     * MPI's abort then ends the job everywhere */
    (void)tdm_comm_abort(h->local, reason);
    return tdm_comm_abort(h->world, reason);
}

static const char *tdm_hier_last_algo(void *impl)
{
    tdm_hier_impl *h = impl;
    if (h->algo_is_local)
        snprintf(h->algo, sizeof h->algo, "shm:%s", tdm_comm_last_algo(h->local));
    return h->algo;
}

static tdm_status tdm_hier_alloc(void *impl, size_t nbytes, void **ptr)
{
    return tdm_comm_alloc(((tdm_hier_impl *)impl)->local, nbytes, ptr);
}

static void tdm_hier_destroy(void *impl)
{
    tdm_hier_impl *h = impl;
    if (!h) return;
    tdm_comm_free(h->cross);
    tdm_comm_free(h->world);
    tdm_comm_free(h->local);
    free(h->scratch);
    free(h);
}

static const tdm_comm_ops tdm_hier_ops = {
    .name = "hier",
    .run = tdm_hier_run,
    .abort = tdm_hier_abort,
    .last_algo = tdm_hier_last_algo,
    .alloc = tdm_hier_alloc,
    .destroy = tdm_hier_destroy,
    .half_types = 1,
    .split = tdm_mpi_hier_split,
};

/* The shm group's abort reason: a local rank that died or failed stops a
 * rank blocked on the network too. */
static const char *tdm_hier_local_aborted(void *ctx) { return tdm_shm_comm_abort_reason(ctx); }

tdm_status tdm_mpi_hier_comm(tdm_mpi_job *j, const struct tdm_shm_opts *shm_opts,
                             tdm_comm **out)
{
    tdm_status st = TDM_STATUS_OK;
    const tdm_mpi_topo *t = &j->topo;
    MPI_Comm machine = MPI_COMM_NULL, cross = MPI_COMM_NULL;
    tdm_hier_impl *h = calloc(1, sizeof *h);
    TDM_REQUIRE(h, TDM_STATUS_OUT_OF_MEMORY, "hier: calloc");
    h->rank = t->rank;
    h->size = t->size;
    h->local_rank = t->local_rank;
    h->local_size = t->local_size;
    h->n_machines = t->n_machines;
    h->uniform = t->uniform;
    snprintf(h->algo, sizeof h->algo, "none");
    /* every rank takes part in every split, in the same order (n_machines
     * is the same everywhere: one machine has no cross-machine part) */
    TDM_TRY(tdm_mpi_job_split(j, t->machine, t->local_rank, &machine));
    TDM_TRY(tdm_mpi_shm_named_comm(j, machine, shm_opts, &h->local));
    int color = t->uniform ? t->local_rank : t->local_rank == 0 ? 0 : MPI_UNDEFINED;
    if (t->n_machines > 1) TDM_TRY(tdm_mpi_job_split(j, color, t->machine, &cross));
    if (cross != MPI_COMM_NULL) {
        tdm_mpi_opts o = j->opts;
        o.abort_check = tdm_hier_local_aborted;
        o.abort_ctx = h->local;
        MPI_Comm c = cross;
        cross = MPI_COMM_NULL;   /* owned by the wrapper from here, even on failure */
        TDM_TRY(tdm_mpi_comm_wrap(&h->cross, c, j->node_size, j->node_cores, &o,
                                  "hier (between machines)"));
        /* its messages say the job's rank, as every other line does */
        tdm_mpi_impl *ci = tdm_comm_impl(h->cross);
        ci->job_rank = t->rank;
        ci->job_size = t->size;
    }
    TDM_TRY(tdm_mpi_job_comm(j, TDM_MPI_BACKEND_MPI, NULL, &h->world));
    /* the parts' flight records are not the rank's: the hier one is */
    tdm_comm_fr_set_inner(h->local, t->rank);
    tdm_comm_fr_set_inner(h->cross, t->rank);   /* NULL-safe */
    tdm_comm_fr_set_inner(h->world, t->rank);
    MPI_Comm_free(&machine);
    TDM_INFO(MPI, "hier: rank %d of %d, local rank %d of %d on machine %d of %d, %s", t->rank,
             t->size, t->local_rank, t->local_size, t->machine, t->n_machines,
             t->n_machines == 1 ? "every collective over shm"
             : t->uniform     ? "shards across machines in parallel"
                              : "leaders across machines");
    return tdm_comm_create(out, &tdm_hier_ops, h, t->rank, t->size);
fail:
    if (machine != MPI_COMM_NULL) MPI_Comm_free(&machine);
    if (cross != MPI_COMM_NULL) MPI_Comm_free(&cross);
    tdm_hier_destroy(h);
    return st;
}
