/* tests/test_tp.c: tensor parallelism (tp/) against one device: N = 1,
 * 2, 4 tensor-parallel ranks (forked, over shm) and a dp=2 x tp=2 mesh on
 * 4, two MLPs (20-24-16-12-5: two column/row pairs; 20-32-16-5: one pair
 * and a replicated classifier) with SGD (momentum, weight decay) and a
 * GPT (gpt:2-16-4-8: attention split by heads, its MLP column/row;
 * LayerNorms, embeddings and the tied head replicated) with AdamW, a
 * batch of 56: the loss of every step and the whole model's parameters
 * (gathered) after 1 and after 30 steps.
 *
 * Bounds: a row-parallel layer adds its N partial products after their
 * gemms, where one device sums the same products inside one gemm, so the
 * results differ by float rounding and the steps carry it on. Measured
 * over every case below: the MLPs' parameters within 1.2e-7 (after 1 and
 * after 30 steps), losses within 5.4e-8; the GPT's parameters within
 * 6.9e-6 after 30 AdamW steps (lr 3e-3: AdamW's normalised step turns a
 * rounding of a small gradient into a step-sized change), losses within
 * 3.6e-8; N = 1: bit for bit, both. Checked: 1e-5 for the MLPs, 1e-4
 * for the GPT's parameters and losses, well below what a wrong step moves
 * (~lr), and N = 1 exactly equal.
 *
 * Also: step 0's whole gradient (gathered) within 1e-6 absolute of one
 * device's (measured: 5.3e-8; AdamW's normalised step would hide a
 * wrongly scaled gradient from the parameter check); the replicated
 * tensors' gradients are the same bits on every rank of the group (no
 * communication: identical inputs, identical kernels); the all-reduce
 * payload a step hands the communicator (per rank) is exactly the
 * plan's, and tdm_comm_traffic_ring_sent makes it 2(N-1)/N of that sent
 * under a ring; against one device's model (must_split, written out): a
 * group's split elements plus the replicated ones are one device's,
 * each rank's split ones 1/N of one device's tensors that must be
 * split; the allocator's bytes for parameters, gradients and optimizer
 * state are what the rank's layout needs; the plan's errors.
 *
 * Sequence parallelism (the GPT, check_sp): the same checks and bounds
 * (measured as without: parameters within 6.9e-6, losses 3.2e-8, step
 * 0's gradient 5.2e-8; N = 1 bit for bit), the communicator's count per
 * kind (reduce-scatters, all-gathers, the LayerNorms' all-reduce) the
 * plan's exactly and a ring's bytes for the stream those of the
 * all-reduces without, and the activation bytes the allocator hands
 * out dropping by exactly the predicted amount. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "dist/mesh.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/timeout_util.h"
#include "tp/tp.h"

#define B 56
#define STEPS 30
#define TOL 1e-5
#define GPT_TOL 1e-4
#define GRAD_TOL 1e-6   /* step 0's whole gradient, absolute (measured: 5.2e-8) */

static const int g_dims[2][5] = {{20, 24, 16, 12, 5}, {20, 32, 16, 5, 0}};
static const int g_ndims[2] = {5, 4};
#define GPT 2   /* the third model: gpt:2-16-4-8 */
/* the theoretical all-reduce volume of one step, per rank (tp/tp.h):
 * forward B * (each row layer's output), backward B * (each column
 * layer's input but fc1's): 24-16 pair and 12-5 pair: 56 * (16 + 5) +
 * 56 * 16 floats, 3 all-reduces; 32-16 pair: 56 * 16 floats, 1 */
static const int64_t g_bytes[2] = {(int64_t)56 * (16 + 5 + 16) * 4, (int64_t)56 * 16 * 4};
static const int g_calls[2] = {3, 1};

typedef struct out {
    int status[8];
    char err[8][512];
    double pdiff[8], ldiff[8], gdiff[8];
    int64_t split[8], repl[8], whole_split[8], n_elem[8];
    size_t alloc[8], act_alloc[8], optimizer[8];
    size_t setup[8];   /* every byte the allocator handed tdm_tp_init */
    size_t live[8];    /* the allocator's live bytes after the last step */
    size_t peak[8];    /* and its peak over the run */
    size_t grads[8];   /* the gradient bytes the rank keeps (tdm_tp_stats.grads) */
    int n_state;
    float pn[16384];   /* the whole model's parameters after the last step (gathered) */
} out;

typedef struct ref {
    int which, dp, accum;   /* accum: two forward_backward calls per step */
    int sp;                 /* sequence parallelism (the GPT) */
    int zero;               /* ZeRO-1 (1) or ZeRO-2 (2) over the dp dimension */
    double loss[STEPS];
    float p1[16384], pn[16384], g1[16384];   /* g1: step 0's gradient */
    int64_t n;
    int64_t must_split;   /* one device's elements of the tensors tp must split */
    int64_t elems;        /* one device's tensors' elements (param_elems less padding) */
} ref;

static ref g_ref;
static size_t g_act_alloc;   /* rank 0's activation bytes, by the allocator, of the last check */
static float g_pn[16384];    /* and the whole model's parameters after its last step */
static size_t g_optimizer[8];   /* and every rank's optimizer state bytes */
static int64_t g_n_elem[8];     /* its flat slice's elements */
static size_t g_live[8], g_peak[8], g_grads[8];   /* out's, of the last check */
static int g_n_state;           /* the optimizer's state buffers */

static void spec_of(int which, tdm_model_spec *s)
{
    if (which == GPT) tdm_model_spec_gpt(s, 2, 16, 4, 8);
    else tdm_model_spec_mlp(s, g_dims[which], g_ndims[which]);
}

static int in_of(const tdm_model_spec *s) { return s->kind == TDM_MODEL_GPT ? s->n_ctx : s->dims[0]; }
static int rows_of(const tdm_model_spec *s) { return s->kind == TDM_MODEL_GPT ? s->n_ctx : 1; }

static tdm_optim_opts optim(void)
{
    tdm_optim_opts o;
    if (g_ref.which == GPT) {
        tdm_optim_opts_default(&o, TDM_OPTIM_ADAMW);
        o.lr = 3e-3f;
        return o;
    }
    tdm_optim_opts_default(&o, TDM_OPTIM_SGD);
    o.lr = 0.05f;
    o.momentum = 0.9f;
    o.weight_decay = 1e-4f;
    return o;
}

static void batch_of(const tdm_model_spec *s, int step, void *x, int32_t *y)
{
    tpp_batch(s, in_of(s), rows_of(s), s->kind == TDM_MODEL_GPT ? s->vocab : s->dims[s->ndims - 1],
              step, B, x, y);
}

/* The tensors tensor parallelism must split, written out: the MLPs'
 * column/row pairs (20-24-16-12-5: fc1-fc2 and fc3-fc4; 20-32-16-5:
 * fc1-fc2, fc3 replicated), a column layer's weight and bias, a row
 * layer's weight (its bias is added once, after the sum: replicated);
 * the GPT's attn.c_attn and mlp.c_fc (weight and bias), attn.c_proj and
 * mlp.c_proj (weight) of every block. */
static int must_split(int which, const char *name)
{
    static const char *const mlp[2][7] = {
        {"fc1.weight", "fc1.bias", "fc2.weight", "fc3.weight", "fc3.bias", "fc4.weight", NULL},
        {"fc1.weight", "fc1.bias", "fc2.weight", NULL}};
    static const char *const gpt[] = {".attn.c_attn.weight", ".attn.c_attn.bias",
                                      ".attn.c_proj.weight", ".mlp.c_fc.weight",
                                      ".mlp.c_fc.bias",      ".mlp.c_proj.weight", NULL};
    size_t n = strlen(name);
    if (which == GPT) {
        for (int i = 0; gpt[i]; i++)
            if (n > strlen(gpt[i]) && !strcmp(name + n - strlen(gpt[i]), gpt[i])) return 1;
        return 0;
    }
    for (int i = 0; mlp[which][i]; i++)
        if (!strcmp(name, mlp[which][i])) return 1;
    return 0;
}

/* One device, plain steps. */
static void ref_make(int which)
{
    tdm_model_spec spec;
    spec_of(which, &spec);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    g_ref.which = which;
    tdm_optim_opts oo = optim();
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, TPP_SEED), TDM_STATUS_OK);
    cr_assert_eq(tdm_optim_init(&opt, m, &oo), TDM_STATUS_OK);
    float x[B * 20];
    int32_t y[B * 8];
    g_ref.n = tdm_model_param_elems(m);
    g_ref.must_split = g_ref.elems = 0;
    for (int i = 0; i < tdm_model_n_params(m); i++)
        g_ref.elems += tdm_model_param_info(m, i)->n_elem;
    cr_assert(g_ref.elems <= g_ref.n && g_ref.elems > g_ref.n - 16 * tdm_model_n_params(m));
    for (int i = 0; i < tdm_model_n_params(m); i++)
        if (must_split(which, tdm_model_param_info(m, i)->name))
            g_ref.must_split += tdm_model_param_info(m, i)->n_elem;
    cr_assert(g_ref.must_split > 0);
    cr_assert(g_ref.n <= 16384, "%lld", (long long)g_ref.n);
    for (int s = 0; s < STEPS; s++) {
        batch_of(&spec, s, x, y);
        cr_assert_eq(tdm_model_zero_grad(m), TDM_STATUS_OK);
        cr_assert_eq(tdm_model_forward_backward(m, x, y, B, &g_ref.loss[s]), TDM_STATUS_OK,
                     "%s", tdm_error_message());
        cr_assert_eq(tdm_optim_step(opt), TDM_STATUS_OK);
        if (s == 0) memcpy(g_ref.p1, tdm_model_params(m), (size_t)g_ref.n * 4);
        if (s == 0) memcpy(g_ref.g1, tdm_model_grads(m), (size_t)g_ref.n * 4);
    }
    memcpy(g_ref.pn, tdm_model_params(m), (size_t)g_ref.n * 4);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
}

#define RFAIL(...)                                                                 \
    do {                                                                           \
        snprintf(o->err[r], sizeof o->err[r], __VA_ARGS__);                        \
        o->status[r] = 1;                                                          \
        rc = 1;                                                                    \
        goto done;                                                                 \
    } while (0)

/* The replicated tensors' gradients of every rank of the group equal
 * rank 0's, bit for bit. */
static int repl_grads_agree(tdm_tp *p, tdm_comm *comm, char *why, size_t n)
{
    int64_t e = tdm_tp_elems(p);
    int N = tdm_comm_size(comm);
    float *mine = malloc((size_t)e * 4), *all = malloc((size_t)e * 4 * (size_t)N);
    int ok = mine && all;
    if (ok) memcpy(mine, tdm_tp_grads(p), (size_t)e * 4);   /* a host device's memory */
    ok = ok && !tdm_comm_all_gather(comm, mine, all, (size_t)e, TDM_DTYPE_FLOAT32);
    for (int i = 0; ok && i < tdm_tp_n_tensors(p); i++) {
        tdm_tp_tensor_info t;
        tdm_tp_tensor_get(p, i, &t);
        for (int r = 1; ok && !t.split && r < N; r++)
            if (memcmp(all + t.offset, all + (int64_t)r * e + t.offset, (size_t)t.n_elem * 4)) {
                snprintf(why, n, "%s's gradient differs on rank %d",
                         tdm_model_param_info(tdm_tp_tables(p), t.whole_index)->name, r);
                ok = 0;
            }
    }
    free(mine);
    free(all);
    return ok;
}

static int tp_rank(tdm_comm *world, void *arg)
{
    out *o = arg;
    int r = tdm_comm_rank(world), rc = 0, dp = g_ref.dp;
    tdm_device *dev = NULL;
    tdm_mesh *mesh = NULL;
    tdm_tp *p = NULL;
    tdm_model_spec spec;
    spec_of(g_ref.which, &spec);
    float *whole = calloc((size_t)g_ref.n, 4);
    float x[B * 20];
    int32_t y[B * 8];
    int in = in_of(&spec), rows = rows_of(&spec);
    if (tdm_device_open(&dev, "cpu", r, 1)) RFAIL("device: %s", tdm_error_message());
    tdm_mesh_shape shape = {.size = {dp, 1, tdm_comm_size(world) / dp}};
    if (tdm_mesh_init(&mesh, world, &shape)) RFAIL("mesh: %s", tdm_error_message());
    tdm_comm *comm = tdm_mesh_comm(mesh, TDM_MESH_TP), *dcomm = tdm_mesh_comm(mesh, TDM_MESH_DP);
    int N = tdm_comm_size(comm), rep = tdm_mesh_coord(mesh, TDM_MESH_DP);
    tdm_tp_opts to = {.seed = TPP_SEED, .optim = optim(), .grad_comm = dp > 1 ? dcomm : NULL,
                      .sequence_parallel = g_ref.sp,
                      .zero = g_ref.zero == 2 ? TDM_TP_ZERO_GRADS
                              : g_ref.zero    ? TDM_TP_ZERO_OPTIMIZER
                                              : TDM_TP_ZERO_NONE};
    tdm_dev_mem_stats m0, m1;
    if (tdm_dev_mem_query(dev, &m0)) RFAIL("mem query: %s", tdm_error_message());
    if (tdm_tp_init(&p, comm, dev, &spec, &to)) RFAIL("init: %s", tdm_error_message());
    if (tdm_dev_mem_query(dev, &m1)) RFAIL("mem query: %s", tdm_error_message());
    o->setup[r] = m1.live_bytes - m0.live_bytes;
    tdm_tp_stats st;
    tdm_tp_get_stats(p, &st);
    o->split[r] = st.split_elems;
    o->repl[r] = st.replicated_elems;
    o->whole_split[r] = st.whole_split_elems;
    o->n_elem[r] = tdm_tp_elems(p);
    o->alloc[r] = st.state_alloc_bytes;
    o->n_state = tdm_optim_n_state(tdm_tp_optim(p));
    o->optimizer[r] = st.optimizer;
    o->grads[r] = st.grads;
    int lo = B * rep / dp, hi = B * (rep + 1) / dp;
    for (int s = 0; s < STEPS; s++) {
        batch_of(&spec, s, x, y);
        tdm_comm_traffic t0, t1, d0, d1;
        tdm_comm_traffic_get(comm, &t0);
        tdm_comm_traffic_get(dcomm, &d0);
        double ls = 0.0;
        if (g_ref.accum) {
            /* gradient accumulation: the replica's share in two
             * micro-batches, then one step */
            int mid = (lo + hi) / 2;
            double l0 = 0.0, l1 = 0.0;
            if (tdm_tp_zero_grad(p) ||
                tdm_tp_forward_backward(p, x + lo * in, y + lo * rows, mid - lo, 1.0f / B, &l0) ||
                tdm_tp_forward_backward(p, x + mid * in, y + mid * rows, hi - mid, 1.0f / B,
                                        &l1) ||
                tdm_tp_optim_step(p))
                RFAIL("accumulated step %d: %s", s, tdm_error_message());
            ls = l0 + l1;
        } else if (tdm_tp_step_scaled(p, x + lo * in, y + lo * rows, hi - lo, 1.0f / B, &ls))
            RFAIL("step %d: %s", s, tdm_error_message());
        tdm_comm_traffic_get(comm, &t1);
        tdm_comm_traffic_get(dcomm, &d1);
        if (dp > 1) {
            /* the dp dimension, per step: the plain mesh all-reduces the
             * rank's n elements; ZeRO-1 reduce-scatters the gradients'
             * D chunks of c = ceil(n/D) and all-gathers the parameters'
             * (a ring sends 2(D-1)/D of the payload either way, but for
             * the padding: the plain mesh's bytes) */
            int64_t n4 = tdm_tp_elems(p) * 4, c4 = (tdm_tp_elems(p) + dp - 1) / dp * 4;
            int64_t db[TDM_COLL_COUNT_] = {0}, dc[TDM_COLL_COUNT_] = {0};
            if (g_ref.zero) {
                db[TDM_COLL_REDUCE_SCATTER] = db[TDM_COLL_ALL_GATHER] = c4 * dp;
                dc[TDM_COLL_REDUCE_SCATTER] = dc[TDM_COLL_ALL_GATHER] = 1;
            } else {
                db[TDM_COLL_ALL_REDUCE] = n4;
                dc[TDM_COLL_ALL_REDUCE] = 1;
            }
            for (int c = 0; c < TDM_COLL_COUNT_; c++)
                if (d1.bytes[c] - d0.bytes[c] != db[c] || d1.calls[c] - d0.calls[c] != dc[c])
                    RFAIL("step %d, the dp dimension: %s: %lld calls of %lld bytes counted, "
                          "expected %lld of %lld", s, tdm_coll_name((tdm_coll)c),
                          (long long)(d1.calls[c] - d0.calls[c]),
                          (long long)(d1.bytes[c] - d0.bytes[c]), (long long)dc[c],
                          (long long)db[c]);
            tdm_comm_traffic dd = {0};
            for (int c = 0; c < TDM_COLL_COUNT_; c++) dd.bytes[c] = d1.bytes[c] - d0.bytes[c];
            int64_t ring = tdm_comm_traffic_ring_sent(&dd, dp);
            if (ring != 2 * (dp - 1) * (g_ref.zero ? c4 * dp : n4) / dp)
                RFAIL("step %d, the dp dimension: a ring sends %lld bytes", s, (long long)ring);
        }
        if (dp > 1 && tdm_comm_all_reduce(dcomm, &ls, &ls, 1, TDM_DTYPE_FLOAT64, TDM_REDOP_SUM))
            RFAIL("loss: %s", tdm_error_message());
        double ld = fabs(ls / B - g_ref.loss[s]);
        if (ld > o->ldiff[r]) o->ldiff[r] = ld;
        if (N == 1 && ld != 0 && dp == 1) RFAIL("N=1 step %d: loss %.17g, one device %.17g", s,
                                                ls / B, g_ref.loss[s]);
        /* the communicator's count of this step: the plan's all-reduces */
        /* the GPT: per block 2 all-reduces of the stream forward and 2 of
         * it backward, (hi - lo) * T * C floats each; sequence parallel:
         * each all-reduce a reduce-scatter and an all-gather of the same
         * stream (4 of each per block), and one all-reduce of the
         * LayerNorms' gradients, 2 blocks x (ln_1, ln_2) x (weight,
         * bias) x C floats */
        int64_t stream = (int64_t)(hi - lo) * 8 * 16 * 4;
        int64_t want = N > 1 ? (g_ref.which == GPT ? 4 * 2 * stream
                                                   : g_bytes[g_ref.which] * (hi - lo) / B)
                             : 0;
        int calls = N > 1 ? (g_ref.which == GPT ? 8 : g_calls[g_ref.which]) : 0;
        int sp = g_ref.sp && N > 1;
        int64_t wb[TDM_COLL_COUNT_] = {0}, wc[TDM_COLL_COUNT_] = {0};
        wb[TDM_COLL_ALL_REDUCE] = sp ? 2 * 2 * 2 * 16 * 4 : want;
        wc[TDM_COLL_ALL_REDUCE] = sp ? 1 : calls;
        wb[TDM_COLL_REDUCE_SCATTER] = wb[TDM_COLL_ALL_GATHER] = sp ? want : 0;
        wc[TDM_COLL_REDUCE_SCATTER] = wc[TDM_COLL_ALL_GATHER] = sp ? calls : 0;
        tdm_comm_traffic plan;
        tdm_tp_step_traffic(&spec, N, hi - lo, g_ref.sp, &plan);
        for (int c = 0; c < TDM_COLL_COUNT_; c++) {
            int64_t db = t1.bytes[c] - t0.bytes[c], dc = t1.calls[c] - t0.calls[c];
            if (!g_ref.accum && (db != wb[c] || dc != wc[c]))
                RFAIL("step %d: %s: %lld calls of %lld bytes counted, the plan says %lld of "
                      "%lld", s, tdm_coll_name((tdm_coll)c), (long long)dc, (long long)db,
                      (long long)wc[c], (long long)wb[c]);
            if (plan.bytes[c] != wb[c] || plan.calls[c] != wc[c])
                RFAIL("tdm_tp_step_traffic: %s: %lld calls of %lld bytes, the test's plan %lld "
                      "of %lld", tdm_coll_name((tdm_coll)c), (long long)plan.calls[c],
                      (long long)plan.bytes[c], (long long)wc[c], (long long)wb[c]);
        }
        /* what a ring sends for the stream's payload: 2(N-1)/N of it per
         * rank, all-reduced or (sequence parallel) reduce-scattered and
         * all-gathered alike */
        tdm_comm_traffic ar = {0};
        for (int c = 0; c < TDM_COLL_COUNT_; c++)
            if (c != TDM_COLL_ALL_REDUCE || !sp) ar.bytes[c] = t1.bytes[c] - t0.bytes[c];
        int64_t ring = tdm_comm_traffic_ring_sent(&ar, N);
        if (!g_ref.accum && ring != 2 * (N - 1) * want / N)
            RFAIL("step %d: a ring sends %lld bytes for %lld of payload over %d ranks, expected "
                  "%lld", s, (long long)ring, (long long)want, N,
                  (long long)(2 * (N - 1) * want / N));
        if (tdm_tp_step_bytes(&spec, N, hi - lo) != want)
            RFAIL("tdm_tp_step_bytes %lld, the plan %lld",
                  (long long)tdm_tp_step_bytes(&spec, N, hi - lo), (long long)want);
        if (s == 0) {
            tdm_tp_stats as;
            tdm_tp_get_stats(p, &as);
            o->act_alloc[r] = as.act_alloc_bytes;
            /* the pre-run memory check's figures: what the rank holds */
            tdm_tp_rank_footprint fp;
            int held = g_ref.accum ? hi - (lo + hi) / 2 : hi - lo;   /* the largest call's */
            if (tdm_tp_footprint(&spec, N, held, g_ref.sp, &fp))
                RFAIL("footprint: %s", tdm_error_message());
            if (fp.elems != tdm_tp_elems(p) || fp.act_bytes != as.activations)
                RFAIL("footprint: %lld elements and %zu activation bytes, the rank holds %lld "
                      "and %zu", (long long)fp.elems, fp.act_bytes, (long long)tdm_tp_elems(p),
                      as.activations);
            /* against what the device's allocator handed out (64-byte
             * blocks): parameters, gradients and the optimizer state (of
             * ZeRO-1's chunk), and the activations, each allocation
             * rounded up by less than 64 bytes */
            size_t r64 = 63, chunk = g_ref.zero ? ((size_t)fp.elems + (size_t)dp - 1) / (size_t)dp
                                                : (size_t)fp.elems;
            /* ZeRO-1's parameters and gradients: dp chunks, the last
             * one padded */
            size_t flat = g_ref.zero ? chunk * (size_t)dp : (size_t)fp.elems;
            size_t gr = g_ref.zero == 2 ? chunk : flat;   /* ZeRO-2: the shard */
            size_t state = ((flat * 4 + r64) & ~r64) + ((gr * 4 + r64) & ~r64) +
                           (size_t)tdm_optim_n_state(tdm_tp_optim(p)) * ((chunk * 4 + r64) & ~r64);
            if (state != o->alloc[r])
                RFAIL("footprint: parameters, gradients and optimizer state of %zu bytes, the "
                      "allocator handed out %zu", state, o->alloc[r]);
            if (fp.act_allocs != as.act_allocs || as.act_alloc_bytes < fp.act_bytes ||
                as.act_alloc_bytes - fp.act_bytes > r64 * (size_t)fp.act_allocs)
                RFAIL("footprint: %zu activation bytes in %lld allocations, the allocator handed "
                      "out %zu in %lld", fp.act_bytes, (long long)fp.act_allocs,
                      as.act_alloc_bytes, (long long)as.act_allocs);
            /* the split tensors: 1/N of one device's (its tables, written
             * out by must_split) */
            if (fp.split_elems * N != g_ref.must_split)
                RFAIL("footprint: %lld split elements x %d ranks, one device's split tensors "
                      "%lld", (long long)fp.split_elems, N, (long long)g_ref.must_split);
        }
        char why[160];
        /* ZeRO-2 keeps no whole gradient between steps (its replicated
         * tensors' shards are summed over the dp dimension alike) */
        if (g_ref.zero == 2 && tdm_tp_grads(p))
            RFAIL("step %d: ZeRO-2 kept the whole gradient after the step", s);
        if (g_ref.zero != 2 && !repl_grads_agree(p, comm, why, sizeof why))
            RFAIL("step %d: %s", s, why);
        if (s == 0 && !g_ref.zero) {
            /* the whole gradient of step 0 against one device's: AdamW's
             * normalised step hides a wrongly scaled gradient from the
             * parameter check, this does not (ZeRO-1 sums only each
             * replica's chunk of it: its parameters are held to the
             * plain mesh's, bit for bit, by check_zero) */
            if (tdm_tp_gather_grads(p, whole, 0)) RFAIL("gather grads: %s", tdm_error_message());
            if (tdm_comm_rank(comm) == 0) o->gdiff[r] = tpp_max_diff(whole, g_ref.g1, g_ref.n);
        }
        if (s == 0 || s == STEPS - 1) {
            tdm_ckpt_host h = {.params = whole};
            if (tdm_tp_gather_state(p, &h, 0)) RFAIL("gather: %s", tdm_error_message());
            if (tdm_comm_rank(comm) == 0) {
                double d = tpp_max_diff(whole, s == 0 ? g_ref.p1 : g_ref.pn, g_ref.n);
                if (s == STEPS - 1 && r == 0) memcpy(o->pn, whole, (size_t)g_ref.n * 4);
                if (d > o->pdiff[r]) o->pdiff[r] = d;
                if (N == 1 && dp == 1 && d != 0) RFAIL("N=1: parameters differ by %g", d);
            }
        }
    }
    tdm_dev_mem_stats m2;
    if (tdm_dev_mem_query(dev, &m2)) RFAIL("mem query: %s", tdm_error_message());
    o->live[r] = m2.live_bytes;
    o->peak[r] = m2.peak_bytes;
done:
    tdm_tp_free(p);
    tdm_mesh_free(mesh);
    tdm_device_free(dev);
    free(whole);
    return rc;
}

static void check(int which, int dp, int tp)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    ref_make(which);
    g_ref.dp = dp;
    int W = dp * tp;
    out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(o != MAP_FAILED);
    memset(o, 0, sizeof *o);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(120000)};
    tdm_status st = tdm_shm_spawn(W, tp_rank, o, &so, NULL);
    for (int r = 0; r < W; r++)
        cr_assert_eq(o->status[r], 0, "mlp %d dp=%d tp=%d rank %d: %s", which, dp, tp, r,
                     o->err[r]);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    double pd = 0, ld = 0, gd = 0;
    /* memory, against one device's model (not the tp layout): the
     * group's split elements plus the replicated ones (once) are one
     * device's elements, each rank's split ones 1/N of one device's
     * tensors that must be split */
    int64_t split_sum = 0;
    for (int r = 0; r < W; r++) split_sum += o->split[r];
    cr_assert_eq(split_sum / dp + o->repl[0], g_ref.elems, "a group holds %lld split + %lld "
                 "replicated elements, one device %lld", (long long)(split_sum / dp),
                 (long long)o->repl[0], (long long)g_ref.elems);
    for (int r = 0; r < W; r++) {
        cr_assert_eq(o->split[r] * tp, g_ref.must_split, "rank %d: %lld split elements, one "
                     "device's split tensors %lld / %d", r, (long long)o->split[r],
                     (long long)g_ref.must_split, tp);
        cr_assert_eq(o->repl[r], g_ref.elems - g_ref.must_split);
    }
    for (int r = 0; r < W; r++) {
        gd = o->gdiff[r] > gd ? o->gdiff[r] : gd;
        pd = o->pdiff[r] > pd ? o->pdiff[r] : pd;
        ld = o->ldiff[r] > ld ? o->ldiff[r] : ld;
        /* memory: the split tensors are 1/N of one device's, and the
         * allocator handed out what that layout needs (64-byte rounding) */
        cr_assert_eq(o->split[r] * tp, o->whole_split[r], "rank %d: %lld split elements of %lld",
                     r, (long long)o->split[r], (long long)o->whole_split[r]);
        cr_assert_eq(o->n_elem[r], o->split[r] + o->repl[r]);
        /* ZeRO-1: the optimizer's state for the replica's chunk only,
         * ceil(n / dp) elements; parameters and gradients dp such
         * chunks */
        size_t chunk = g_ref.zero ? ((size_t)o->n_elem[r] + (size_t)dp - 1) / (size_t)dp
                                  : (size_t)o->n_elem[r];
        size_t flat = g_ref.zero ? chunk * (size_t)dp : (size_t)o->n_elem[r];
        size_t gr = g_ref.zero == 2 ? chunk : flat;   /* ZeRO-2 keeps its gradient shard */
        cr_assert_eq(o->grads[r], gr * 4, "rank %d: %zu gradient bytes kept, %zu expected", r,
                     o->grads[r], gr * 4);
        size_t need = ((flat * 4 + 63) / 64 * 64) + ((gr * 4 + 63) / 64 * 64) +
                      (size_t)o->n_state * ((chunk * 4 + 63) / 64 * 64);
        cr_assert_eq(o->alloc[r], need, "rank %d: the allocator handed out %zu bytes for "
                     "parameters, gradients and optimizer state, the layout needs %zu", r,
                     o->alloc[r], need);
        /* and nothing else: the set-up holds no buffer beside them (a
         * ZeRO-1 staging copy of the parameters would cost more than the
         * sharded optimizer saves) */
        cr_assert_eq(o->setup[r], o->alloc[r], "rank %d (dp=%d, ZeRO-%d): tdm_tp_init "
                     "holds %zu bytes of the allocator's, parameters, gradients and optimizer "
                     "state %zu", r, dp, g_ref.zero, o->setup[r], o->alloc[r]);
    }
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "model %d dp=%d tp=%d sp=%d: parameters within %g, losses within %g, "
                "step 0's gradient within %g, activations %zu bytes\n", which, dp, tp, g_ref.sp,
                pd, ld, gd, o->act_alloc[0]);
    cr_assert(gd <= GRAD_TOL, "model %d dp=%d tp=%d: step 0's whole gradient within %g of one "
              "device's", which, dp, tp, gd);
    double tol = which == GPT ? GPT_TOL : TOL;
    cr_assert(pd <= tol && ld <= tol, "model %d dp=%d tp=%d: parameters within %g, losses "
              "within %g of one device", which, dp, tp, pd, ld);
    g_act_alloc = o->act_alloc[0];
    memcpy(g_pn, o->pn, sizeof g_pn);
    memcpy(g_optimizer, o->optimizer, sizeof g_optimizer);
    memcpy(g_n_elem, o->n_elem, sizeof g_n_elem);
    g_n_state = o->n_state;
    memcpy(g_live, o->live, sizeof g_live);
    memcpy(g_peak, o->peak, sizeof g_peak);
    memcpy(g_grads, o->grads, sizeof g_grads);
    munmap(o, sizeof *o);
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

TestSuite(tp, .timeout = 600);

Test(tp, one_rank_is_one_device_bit_for_bit) { check(0, 1, 1); check(1, 1, 1); }
Test(tp, two_ranks_equal_one_device) { check(0, 1, 2); check(1, 1, 2); }
Test(tp, four_ranks_equal_one_device) { check(0, 1, 4); check(1, 1, 4); }
Test(tp, dp2_tp2_equals_one_device_on_the_global_batch) { check(0, 2, 2); check(1, 2, 2); }

/* Gradient accumulation on a dp x tp mesh: each replica's share in two
 * forward_backward calls, then tdm_tp_optim_step, equals one device's
 * step on the whole batch (the dp sum happens once per step). */
Test(tp, dp2_tp2_accumulated_micro_batches_equal_one_device)
{
    g_ref.accum = 1;
    check(1, 2, 2);
    g_ref.accum = 0;
}

Test(tp, gpt_split_by_heads_equals_one_device)
{
    check(GPT, 1, 1);
    check(GPT, 1, 2);
    check(GPT, 1, 4);
    check(GPT, 2, 2);
}

/* Sequence parallelism (the GPT): the same run with it and without;
 * check() holds it to one device within GPT_TOL (N = 1: bit for bit),
 * its traffic to the reduce-scatters and all-gathers of the stream plus
 * the LayerNorms' gradient sum, and every replicated gradient (the
 * LayerNorms' summed ones too) to the same bits on every rank. Here:
 * the activation bytes the allocator handed out drop by what the
 * stream's split predicts. Per rank of N, on the replica's B*T tokens:
 * res1 of every block, res2 of every block but the last (gathered
 * whole for ln_f), the stream's gradient: 2L tensors of B*T*C floats;
 * the LayerNorms' mean and rstd, 2 each per block but block 0's ln_1
 * (it runs on the whole, replicated embeddings): 4L-2 of B*T floats;
 * each held for B*T/N of the tokens instead of all of them. (Every
 * size is a multiple of 16 floats: the allocator's 64-byte rounding
 * adds nothing.) */
static void check_sp(int dp, int tp)
{
    check(GPT, dp, tp);
    size_t plain = g_act_alloc;
    g_ref.sp = 1;
    check(GPT, dp, tp);
    g_ref.sp = 0;
    size_t sp = g_act_alloc;
    int64_t L = 2, T = 8, C = 16, BT = (int64_t)(B / dp) * T;
    int64_t drop = (2 * L * BT * C + (4 * L - 2) * BT) * 4 * (tp - 1) / tp;
    cr_assert(plain > 0 && sp > 0, "the host allocator keeps no accounting");
    cr_assert_eq((int64_t)plain - (int64_t)sp, drop, "dp=%d tp=%d: activations %zu bytes "
                 "without sequence parallelism, %zu with: a drop of %lld, predicted %lld", dp, tp,
                 plain, sp, (long long)((int64_t)plain - (int64_t)sp), (long long)drop);
}

Test(tp, gpt_sequence_parallel_one_rank_is_one_device) { check_sp(1, 1); }
Test(tp, gpt_sequence_parallel_equals_one_device) { check_sp(1, 2); check_sp(1, 4); }
Test(tp, gpt_sequence_parallel_dp2_tp2) { check_sp(2, 2); }

/* Sequence parallelism under gradient accumulation: each micro-batch's
 * LayerNorm gradients are partial on every rank; their sum over the
 * group must happen once per optimizer step (after both
 * forward_backward calls), neither per micro-batch nor never. check()
 * holds the accumulated run to one device's step on the whole batch. */
Test(tp, gpt_sequence_parallel_accumulated_micro_batches_equal_one_device)
{
    g_ref.sp = 1;
    g_ref.accum = 1;
    check(GPT, 1, 2);
    check(GPT, 2, 2);
    g_ref.accum = 0;
    g_ref.sp = 0;
}

/* ZeRO-1 on the dp dimension of a dp x tp mesh: the plain dp x tp
 * run's parameters bit for bit after 30 steps (SGD with momentum on the
 * MLPs, AdamW on the GPT; each element steps from its own gradient and
 * state wherever it lies, and the shm communicator adds the replicas in
 * rank order in the reduce-scatter as in the all-reduce), and each
 * rank's optimizer state 1/dp of the plain run's (a chunk of
 * ceil(n/dp) of the rank's n elements; check() holds the allocator's
 * bytes to it, and the set-up to nothing more). 20-32-16-5's slice has
 * an odd element count on each rank of tp=2, and 1285 elements on
 * dp=3 x tp=1: the last chunk is padded.
 *
 * ZeRO-2 the same, its gradients sharded too: the same bits again (the
 * same reduce-scatter, into the kept shard instead of in place), the
 * same bytes over the dp dimension (check() counts them for both), the
 * gradient bytes the rank keeps 1/dp of ZeRO-1's (its chunk of c floats,
 * ZeRO-1's dp*c: check() holds the allocator's set-up bytes to them),
 * and the allocator's live bytes after the last step lower than ZeRO-1's
 * by exactly the whole gradient less the shard (both 64-byte rounded):
 * the whole gradient is not kept between steps. */
static void check_zero(int which, int dp, int tp)
{
    static float plain[16384];
    size_t opt_plain[8], live1[8], peak1[8], grads1[8];
    check(which, dp, tp);
    memcpy(plain, g_pn, sizeof plain);
    memcpy(opt_plain, g_optimizer, sizeof opt_plain);
    for (int z = 1; z <= 2; z++) {
        g_ref.zero = z;
        check(which, dp, tp);
        g_ref.zero = 0;
        cr_assert(!memcmp(plain, g_pn, (size_t)g_ref.n * 4), "model %d dp=%d tp=%d: ZeRO-%d "
                  "differs from the plain dp x tp run by %g", which, dp, tp, z,
                  tpp_max_diff(plain, g_pn, g_ref.n));
        cr_assert(g_n_state == (which == GPT ? 2 : 1));   /* AdamW: m, v; SGD: momentum */
        for (int r = 0; r < dp * tp; r++) {
            size_t n = (size_t)g_n_elem[r], s = (size_t)g_n_state * 4, D = (size_t)dp;
            size_t c = (n + D - 1) / D;
            cr_assert_eq(opt_plain[r], s * n, "rank %d: %zu optimizer bytes without ZeRO", r,
                         opt_plain[r]);
            cr_assert_eq(g_optimizer[r], s * c, "rank %d: %zu optimizer bytes with ZeRO-%d "
                         "over %d replicas for %zu elements", r, g_optimizer[r], z, dp, n);
            if (z == 1) continue;
            cr_assert_eq(g_grads[r] * D, grads1[r], "rank %d: ZeRO-2 keeps %zu gradient "
                         "bytes, ZeRO-1 %zu over %d replicas", r, g_grads[r], grads1[r], dp);
            size_t whole = (c * D * 4 + 63) / 64 * 64, shard = (c * 4 + 63) / 64 * 64;
            cr_assert_eq(live1[r] - g_live[r], whole - shard, "rank %d: after the last step "
                         "the allocator holds %zu bytes under ZeRO-1, %zu under ZeRO-2: %zu "
                         "apart, the whole gradient less the shard is %zu", r, live1[r],
                         g_live[r], live1[r] - g_live[r], whole - shard);
            if (getenv("TANDEM_TEST_VERBOSE"))
                fprintf(stderr, "model %d dp=%d tp=%d rank %d: live after the steps ZeRO-1 %zu, "
                        "ZeRO-2 %zu bytes; peak ZeRO-1 %zu, ZeRO-2 %zu bytes\n", which, dp,
                        tp, r, live1[r], g_live[r], peak1[r], g_peak[r]);
        }
        memcpy(live1, g_live, sizeof live1);
        memcpy(peak1, g_peak, sizeof peak1);
        memcpy(grads1, g_grads, sizeof grads1);
    }
}

Test(tp, zero1_and_zero2_on_the_dp_dimension_are_dp_x_tp_bit_for_bit)
{
    check_zero(0, 2, 2);
    check_zero(1, 2, 2);
    check_zero(GPT, 2, 2);
}

Test(tp, zero1_and_zero2_over_three_replicas_pad_the_last_chunk)
{
    check_zero(1, 3, 1);
    check_zero(0, 3, 2);
}

/* ZeRO-2 under gradient accumulation: the whole gradient lives from the
 * zeroing over both micro-batches to the one reduce-scatter (summing
 * each micro-batch over the replicas would add in another order); the
 * same bits as ZeRO-1's accumulated run, which check() holds to one
 * device within the bound. */
Test(tp, zero2_accumulated_micro_batches_are_zero1s_bit_for_bit)
{
    static float z1[16384];
    g_ref.accum = 1;
    g_ref.zero = 1;
    check(1, 2, 2);
    memcpy(z1, g_pn, sizeof z1);
    g_ref.zero = 2;
    check(GPT, 2, 2);
    check(1, 2, 2);
    g_ref.zero = 0;
    g_ref.accum = 0;
    cr_assert(!memcmp(z1, g_pn, (size_t)g_ref.n * 4), "accumulated ZeRO-2 differs from ZeRO-1 "
              "by %g", tpp_max_diff(z1, g_pn, g_ref.n));
}

/* Replica 1 of a dp=2 x tp=2 mesh given another seed than replica 0:
 * every rank's init fails with the same one-line message naming the
 * seed (the dp dimension is checked too), and nobody hangs. */
static int seed_rank(tdm_comm *world, void *arg)
{
    out *o = arg;
    int r = tdm_comm_rank(world), rc = 0;
    tdm_device *dev = NULL;
    tdm_mesh *mesh = NULL;
    tdm_tp *p = NULL;
    tdm_model_spec spec;
    spec_of(1, &spec);
    if (tdm_device_open(&dev, "cpu", r, 1)) RFAIL("device: %s", tdm_error_message());
    tdm_mesh_shape shape = {.size = {2, 1, 2}};
    if (tdm_mesh_init(&mesh, world, &shape)) RFAIL("mesh: %s", tdm_error_message());
    int rep = tdm_mesh_coord(mesh, TDM_MESH_DP);
    tdm_tp_opts to = {.seed = TPP_SEED + (uint64_t)rep, .optim = optim(),
                      .grad_comm = tdm_mesh_comm(mesh, TDM_MESH_DP)};
    tdm_status st = tdm_tp_init(&p, tdm_mesh_comm(mesh, TDM_MESH_TP), dev, &spec, &to);
    o->status[r] = (int)st;
    snprintf(o->err[r], sizeof o->err[r], "%s", st ? tdm_error_message() : "");
done:
    tdm_tp_free(p);
    tdm_mesh_free(mesh);
    tdm_device_free(dev);
    return rc;
}

Test(tp, replicas_with_another_seed_are_refused_on_every_rank)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    g_ref.which = 1;
    out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(o != MAP_FAILED);
    memset(o, 0, sizeof *o);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
    tdm_status st = tdm_shm_spawn(4, seed_rank, o, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    for (int r = 0; r < 4; r++) {
        cr_assert_eq(o->status[r], TDM_STATUS_MISMATCH, "rank %d: status %d: %s", r,
                     o->status[r], o->err[r]);
        cr_assert_str_eq(o->err[r], "tp: rank 1 of the dp dimension (another replica) was "
                         "configured with another seed than rank 0", "rank %d", r);
    }
    munmap(o, sizeof *o);
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

Test(tp, plan_refuses_what_it_cannot_split)
{
    tdm_model_spec s;
    tdm_tp_split sp[TDM_MODEL_MAX_DIMS];
    int L;
    tdm_model_spec_mlp(&s, (int[]){784, 100, 10}, 3);
    cr_assert_eq(tdm_tp_plan(&s, 3, sp, &L), TDM_STATUS_USAGE);
    /* the texts tp/tp.h quotes, exactly */
    cr_assert_str_eq(tdm_error_message(), "layer fc1's output width 100 (fc2's input) is not "
                     "divisible by the 3 tensor-parallel ranks");
    cr_assert_eq(tdm_tp_plan(&s, 4, sp, &L), TDM_STATUS_OK);
    cr_assert(L == 2 && sp[0] == TDM_TP_COLUMN && sp[1] == TDM_TP_ROW);
    tdm_model_spec_mlp(&s, (int[]){784, 64, 32, 10}, 4);
    cr_assert_eq(tdm_tp_plan(&s, 2, sp, &L), TDM_STATUS_OK);
    cr_assert(L == 3 && sp[2] == TDM_TP_REPLICATED);
    tdm_model_spec_mlp(&s, (int[]){784, 10}, 2);
    cr_assert_eq(tdm_tp_plan(&s, 2, sp, &L), TDM_STATUS_USAGE);
    cr_assert_eq(tdm_tp_check_seq(&s, 2), TDM_STATUS_USAGE);
    cr_assert_str_eq(tdm_error_message(),
                     "--sequence-parallel applies to the GPT; the mlp has no sequence");
    tdm_model_spec_cnn(&s);
    cr_assert_eq(tdm_tp_plan(&s, 2, sp, &L), TDM_STATUS_USAGE);
    cr_assert_str_eq(tdm_error_message(),
                     "--mode tp supports the MLP, the GPT and model files of linear layers; "
                     "the cnn is not supported");
    tdm_model_spec_gpt(&s, 2, 16, 4, 8);
    cr_assert_eq(tdm_tp_plan(&s, 3, sp, &L), TDM_STATUS_USAGE);
    cr_assert_str_eq(tdm_error_message(), "the GPT's 4 heads are not divisible by the 3 "
                     "tensor-parallel ranks (attention is split by heads)");
    cr_assert_eq(tdm_tp_plan(&s, 4, sp, &L), TDM_STATUS_OK);
    cr_assert_eq(tdm_tp_check_seq(&s, 4), TDM_STATUS_OK);
    tdm_model_spec_gpt(&s, 2, 16, 4, 12);
    cr_assert_eq(tdm_tp_check_seq(&s, 4), TDM_STATUS_OK);
    cr_assert_eq(tdm_tp_check_seq(&s, 5), TDM_STATUS_USAGE);
    cr_assert_str_eq(tdm_error_message(), "the GPT's context of 12 tokens is not divisible by "
                     "the 5 tensor-parallel ranks (--sequence-parallel splits every window's "
                     "tokens)");
    tdm_model_spec_gpt(&s, 2, 16, 4, 8);
    cr_assert_eq(tdm_tp_step_bytes(&s, 4, 3), (int64_t)4 * 2 * 3 * 8 * 16 * 4);
    tdm_model_spec_mlp(&s, (int[]){20, 24, 16, 12, 5}, 5);
    cr_assert_eq(tdm_tp_step_bytes(&s, 2, B), g_bytes[0]);
    cr_assert_eq(tdm_tp_step_allreduces(&s, 2), 3);
    cr_assert_eq(tdm_tp_step_bytes(&s, 1, B), 0);
}
