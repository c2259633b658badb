/* ddp/hooks.c: the built-in communication hooks (see ddp/hooks.h):
 * float32 all-reduce, fp16 and bf16 compression, PowerSGD. Host memory
 * only: they read and write the bucket with the CPU. Not the Reducer's
 * side of hooks (ddp/reducer.c calls launch and wait). */
#include "ddp/hooks.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"

typedef enum { TDM_HOOK_F32, TDM_HOOK_FP16, TDM_HOOK_BF16, TDM_HOOK_POWERSGD } tdm_hook_kind;

/* PowerSGD's per-parameter state, made on first use. */
typedef struct tdm_psgd_param {
    int made, compress;
    int64_t n, m;                /* the matrix view: shape[0] x the rest */
    int r;
    float *q;                    /* m x r, row-major: the warm start */
    float *err;                  /* n x m: error feedback */
} tdm_psgd_param;

typedef struct tdm_hook_state {
    tdm_hook_kind kind;
    tdm_ddp_powersgd_opts po;
    int n_params;
    tdm_psgd_param *pp;
} tdm_hook_state;

/* One bucket in flight. */
typedef struct tdm_hook_work {
    tdm_comm_work *w;
    void *buf;                   /* compressed values, or PowerSGD's P and vectors */
    int64_t count;
    int plain;                   /* PowerSGD before start_step: float32 all-reduce in place */
} tdm_hook_work;

static void tdm_hook_work_free(tdm_hook_work *hw)
{
    if (!hw) return;
    tdm_comm_work_free(hw->w);
    free(hw->buf);
    free(hw);
}

static tdm_status tdm_hook_wait_work(tdm_ddp_hook_bucket *b, tdm_hook_work *hw)
{
    tdm_status st = tdm_comm_work_wait(hw->w, b->timeout_ms);
    if (st) tdm_error_prefix(st, "comm hook: bucket %d", b->index);
    return st;
}

/* ---- float32, fp16, bf16 ---- */

static tdm_status tdm_hook_plain_launch(tdm_ddp_hook_bucket *b, tdm_hook_work *hw)
{
    hw->plain = 1;
    b->bytes = (double)b->n_elem * 4.0;
    return tdm_comm_all_reduce_async(b->comm, b->grads, b->grads, (size_t)b->n_elem,
                                     TDM_DTYPE_FLOAT32, TDM_REDOP_SUM, &hw->w);
}

static tdm_status tdm_hook_half_launch(tdm_hook_state *s, tdm_ddp_hook_bucket *b,
                                       tdm_hook_work *hw)
{
    uint16_t *h = malloc((size_t)(b->n_elem > 0 ? b->n_elem : 1) * sizeof *h);
    TDM_REQUIRE(h, TDM_STATUS_OUT_OF_MEMORY, "comm hook: %lld 16-bit values",
                (long long)b->n_elem);
    hw->buf = h;
    hw->count = b->n_elem;
    int bf = s->kind == TDM_HOOK_BF16;
    for (int64_t i = 0; i < b->n_elem; i++)
        h[i] = bf ? tdm_f32_to_bf16(b->grads[i]) : tdm_f32_to_f16(b->grads[i]);
    b->bytes = (double)b->n_elem * 2.0;
    return tdm_comm_all_reduce_async(b->comm, h, h, (size_t)b->n_elem,
                                     bf ? TDM_DTYPE_BFLOAT16 : TDM_DTYPE_FLOAT16, TDM_REDOP_SUM,
                                     &hw->w);
}

static void tdm_hook_half_finish(tdm_hook_state *s, tdm_ddp_hook_bucket *b, tdm_hook_work *hw)
{
    const uint16_t *h = hw->buf;
    int bf = s->kind == TDM_HOOK_BF16;
    for (int64_t i = 0; i < b->n_elem; i++)
        b->grads[i] = bf ? tdm_bf16_to_f32(h[i]) : tdm_f16_to_f32(h[i]);
}

/* ---- PowerSGD ---- */

static tdm_status tdm_psgd_param_make(tdm_hook_state *s, tdm_model *m, int p)
{
    tdm_psgd_param *pp = &s->pp[p];
    if (pp->made) return TDM_STATUS_OK;
    const tdm_tensor_info *t = tdm_model_param_info(m, p);
    pp->made = 1;
    if (t->ndim < 2) return TDM_STATUS_OK;
    pp->n = t->shape[0];
    pp->m = t->n_elem / t->shape[0];
    int64_t r = s->po.rank > 0 ? s->po.rank : 1;
    if (r > pp->n) r = pp->n;
    if (r > pp->m) r = pp->m;
    pp->r = (int)r;
    /* compress only when the factors are smaller than the matrix */
    if ((pp->n + pp->m) * r >= pp->n * pp->m) return TDM_STATUS_OK;
    pp->q = malloc((size_t)(pp->m * r) * sizeof *pp->q);
    pp->err = calloc((size_t)(pp->n * pp->m), sizeof *pp->err);
    TDM_REQUIRE(pp->q && pp->err, TDM_STATUS_OUT_OF_MEMORY, "powersgd: state of '%s'", t->name);
    tdm_rng g;
    tdm_rng_init(&g, s->po.seed, TDM_RNG_STREAM_INIT + (uint64_t)p);
    for (int64_t i = 0; i < pp->m * r; i++) pp->q[i] = tdm_rng_normal(&g);
    pp->compress = 1;
    return TDM_STATUS_OK;
}

/* The bucket's compressed parameters' P (n x r each, in parameter order),
 * then its uncompressed elements (in parameter order, padding skipped). */
static tdm_status tdm_psgd_launch(tdm_hook_state *s, tdm_ddp_hook_bucket *b, tdm_hook_work *hw)
{
    int64_t np = 0, nv = 0;
    for (int p = b->first_param; p <= b->last_param; p++) {
        TDM_CHECK(tdm_psgd_param_make(s, b->model, p));
        const tdm_psgd_param *pp = &s->pp[p];
        if (pp->compress) np += pp->n * pp->r;
        else nv += tdm_model_param_info(b->model, p)->n_elem;
    }
    float *buf = malloc((size_t)(np + nv > 0 ? np + nv : 1) * sizeof *buf);
    TDM_REQUIRE(buf, TDM_STATUS_OUT_OF_MEMORY, "powersgd: %lld floats", (long long)(np + nv));
    hw->buf = buf;
    hw->count = np + nv;
    int64_t po = 0, vo = np, qbytes = 0;
    for (int p = b->first_param; p <= b->last_param; p++) {
        const tdm_tensor_info *t = tdm_model_param_info(b->model, p);
        tdm_psgd_param *pp = &s->pp[p];
        float *g = b->grads + (t->offset - b->offset);
        if (!pp->compress) {
            memcpy(buf + vo, g, (size_t)t->n_elem * sizeof *g);
            vo += t->n_elem;
            continue;
        }
        int64_t n = pp->n, m = pp->m, r = pp->r;
        if (!s->po.no_error_feedback)
            for (int64_t i = 0; i < n * m; i++) g[i] += pp->err[i];   /* M = grad + error */
        if (s->po.no_warm_start) {
            tdm_rng rg;
            tdm_rng_init(&rg, s->po.seed + (uint64_t)b->step + 1,
                         TDM_RNG_STREAM_INIT + (uint64_t)p);
            for (int64_t i = 0; i < m * r; i++) pp->q[i] = tdm_rng_normal(&rg);
        }
        float *P = buf + po;   /* P = M Q: (n x m)(m x r) */
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < r; j++) {
                double acc = 0.0;
                for (int64_t k = 0; k < m; k++) acc += (double)g[i * m + k] * pp->q[k * r + j];
                P[i * r + j] = (float)acc;
            }
        po += n * r;
        qbytes += m * r * 4;
    }
    b->bytes = (double)(np + nv) * 4.0 + (double)qbytes;
    return tdm_comm_all_reduce_async(b->comm, buf, buf, (size_t)hw->count, TDM_DTYPE_FLOAT32,
                                     TDM_REDOP_SUM, &hw->w);
}

/* Gram-Schmidt on the r columns of P (n x r, row-major), in double; a
 * column that vanishes stays zero. */
static void tdm_psgd_orthonormalise(float *P, int64_t n, int64_t r)
{
    for (int64_t j = 0; j < r; j++) {
        for (int64_t k = 0; k < j; k++) {
            double d = 0.0;
            for (int64_t i = 0; i < n; i++) d += (double)P[i * r + j] * P[i * r + k];
            for (int64_t i = 0; i < n; i++) P[i * r + j] -= (float)(d * P[i * r + k]);
        }
        double nn = 0.0;
        for (int64_t i = 0; i < n; i++) nn += (double)P[i * r + j] * P[i * r + j];
        double inv = nn > 1e-30 ? 1.0 / sqrt(nn) : 0.0;
        for (int64_t i = 0; i < n; i++) P[i * r + j] = (float)(P[i * r + j] * inv);
    }
}

static tdm_status tdm_psgd_finish(tdm_hook_state *s, tdm_ddp_hook_bucket *b, tdm_hook_work *hw)
{
    float *buf = hw->buf;
    int64_t nq = 0, np = 0;
    for (int p = b->first_param; p <= b->last_param; p++)
        if (s->pp[p].compress) {
            nq += s->pp[p].m * s->pp[p].r;
            np += s->pp[p].n * s->pp[p].r;
        }
    float *qbuf = malloc((size_t)(nq > 0 ? nq : 1) * sizeof *qbuf);
    TDM_REQUIRE(qbuf, TDM_STATUS_OUT_OF_MEMORY, "powersgd: %lld floats", (long long)nq);
    tdm_status st = TDM_STATUS_OK;
    int64_t po = 0, qo = 0, vo = np;
    for (int p = b->first_param; p <= b->last_param; p++) {
        const tdm_tensor_info *t = tdm_model_param_info(b->model, p);
        tdm_psgd_param *pp = &s->pp[p];
        float *g = b->grads + (t->offset - b->offset);
        if (!pp->compress) {
            memcpy(g, buf + vo, (size_t)t->n_elem * sizeof *g);
            vo += t->n_elem;
            continue;
        }
        int64_t n = pp->n, m = pp->m, r = pp->r;
        float *P = buf + po, *Q = qbuf + qo;
        tdm_psgd_orthonormalise(P, n, r);
        for (int64_t k = 0; k < m; k++)   /* Q = M^T P: (m x n)(n x r) */
            for (int64_t j = 0; j < r; j++) {
                double acc = 0.0;
                for (int64_t i = 0; i < n; i++) acc += (double)g[i * m + k] * P[i * r + j];
                Q[k * r + j] = (float)acc;
            }
        po += n * r;
        qo += m * r;
    }
    if (nq > 0) {
        tdm_comm_work *w = NULL;
        tdm_comm_set_label(b->comm, "ddp bucket %d (comm hook powersgd Q)", b->index);
        st = tdm_comm_all_reduce_async(b->comm, qbuf, qbuf, (size_t)nq, TDM_DTYPE_FLOAT32,
                                       TDM_REDOP_SUM, &w);
        if (st == TDM_STATUS_OK) st = tdm_comm_work_wait(w, b->timeout_ms);
        tdm_comm_work_free(w);
        if (st) {
            tdm_error_prefix(st, "powersgd: bucket %d: all-reduce of Q", b->index);
            goto fail;
        }
    }
    float inv_world = 1.0f / (float)tdm_comm_size(b->comm);
    po = 0;
    qo = 0;
    for (int p = b->first_param; p <= b->last_param; p++) {
        tdm_psgd_param *pp = &s->pp[p];
        if (!pp->compress) continue;
        const tdm_tensor_info *t = tdm_model_param_info(b->model, p);
        float *g = b->grads + (t->offset - b->offset);
        int64_t n = pp->n, m = pp->m, r = pp->r;
        const float *P = buf + po, *Q = qbuf + qo;
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < m; k++) {
                float a = 0.0f;   /* (P Q^T)[i][k], r terms */
                for (int64_t j = 0; j < r; j++) a += P[i * r + j] * Q[k * r + j];
                /* this rank's share of what the sum's approximation missed */
                if (!s->po.no_error_feedback) pp->err[i * m + k] = g[i * m + k] - a * inv_world;
                g[i * m + k] = a;
            }
        memcpy(pp->q, Q, (size_t)(m * r) * sizeof *Q);   /* warm start */
        po += n * r;
        qo += m * r;
    }
fail:
    free(qbuf);
    return st;
}

/* ---- the hook's two entry points ---- */

static tdm_status tdm_hook_launch_kind(tdm_hook_state *s, tdm_ddp_hook_bucket *b,
                                       tdm_hook_work *hw)
{
    TDM_REQUIRE(tdm_dev_kind(tdm_model_device(b->model)) == TDM_DEVICE_HOST, TDM_STATUS_UNSUPPORTED,
                "comm hook %s: runs on host devices only (the model is on %s); use the "
                "default all-reduce on GPUs",
                s->kind == TDM_HOOK_FP16 ? "fp16" : s->kind == TDM_HOOK_BF16 ? "bf16" : "powersgd",
                tdm_dev_name(tdm_model_device(b->model)));
    switch (s->kind) {
    case TDM_HOOK_F32: return tdm_hook_plain_launch(b, hw);
    case TDM_HOOK_FP16:
    case TDM_HOOK_BF16: return tdm_hook_half_launch(s, b, hw);
    case TDM_HOOK_POWERSGD:
        if (b->step < s->po.start_step) return tdm_hook_plain_launch(b, hw);
        if (!s->pp) {
            s->n_params = tdm_model_n_params(b->model);
            s->pp = calloc((size_t)s->n_params, sizeof *s->pp);
            TDM_REQUIRE(s->pp, TDM_STATUS_OUT_OF_MEMORY, "powersgd: state of %d parameters",
                        s->n_params);
        }
        return tdm_psgd_launch(s, b, hw);
    }
    return TDM_STATUS_INTERNAL;
}

static tdm_status tdm_hook_launch(void *state, tdm_ddp_hook_bucket *b)
{
    tdm_hook_work *hw = calloc(1, sizeof *hw);
    TDM_REQUIRE(hw, TDM_STATUS_OUT_OF_MEMORY, "comm hook: calloc");
    tdm_status st = tdm_hook_launch_kind(state, b, hw);
    if (st) {
        /* nothing was submitted: no wait will come for it */
        tdm_hook_work_free(hw);
        b->work = NULL;
        return st;
    }
    b->work = hw;
    return TDM_STATUS_OK;
}

static tdm_status tdm_hook_wait(void *state, tdm_ddp_hook_bucket *b)
{
    tdm_hook_state *s = state;
    tdm_hook_work *hw = b->work;
    tdm_status st = TDM_STATUS_OK;
    if (!hw || !hw->w) {
        st = tdm_error_set(TDM_STATUS_INTERNAL, "comm hook: bucket %d was not launched",
                           b->index);
        goto done;
    }
    if ((st = tdm_hook_wait_work(b, hw))) goto done;
    if (hw->plain) goto done;
    if (s->kind == TDM_HOOK_POWERSGD) st = tdm_psgd_finish(s, b, hw);
    else tdm_hook_half_finish(s, b, hw);
done:
    tdm_hook_work_free(hw);
    b->work = NULL;
    return st;
}

static void tdm_hook_state_free(void *state)
{
    tdm_hook_state *s = state;
    if (!s) return;
    for (int p = 0; p < s->n_params; p++) {
        free(s->pp[p].q);
        free(s->pp[p].err);
    }
    free(s->pp);
    free(s);
}

static const char *const tdm_hook_names[] = {"allreduce", "fp16", "bf16", "powersgd"};

int tdm_ddp_hook_known(const char *name)
{
    for (int k = 0; k < 4; k++)
        if (name && !strcmp(name, tdm_hook_names[k])) return 1;
    return 0;
}

tdm_status tdm_ddp_hook_builtin_init(tdm_ddp_comm_hook *out, const char *name,
                                     const tdm_ddp_powersgd_opts *popts)
{
    int kind = -1;
    for (int k = 0; k < 4; k++)
        if (name && !strcmp(name, tdm_hook_names[k])) kind = k;
    TDM_REQUIRE(kind >= 0, TDM_STATUS_INVALID_ARG,
                "comm hook '%s': expected allreduce, fp16, bf16 or powersgd", name ? name : "");
    TDM_REQUIRE(!popts || (popts->rank >= 0 && popts->start_step >= 0), TDM_STATUS_INVALID_ARG,
                "powersgd: rank %d and start step %lld must not be negative", popts->rank,
                (long long)popts->start_step);
    tdm_hook_state *s = calloc(1, sizeof *s);
    TDM_REQUIRE(s, TDM_STATUS_OUT_OF_MEMORY, "comm hook: calloc");
    s->kind = (tdm_hook_kind)kind;
    if (popts) s->po = *popts;
    *out = (tdm_ddp_comm_hook){.name = tdm_hook_names[kind], .state = s,
                               .launch = tdm_hook_launch, .wait = tdm_hook_wait,
                               .free = tdm_hook_state_free};
    return TDM_STATUS_OK;
}

void tdm_ddp_hook_builtin_free(tdm_ddp_comm_hook *h)
{
    if (!h) return;
    if (h->free) h->free(h->state);
    memset(h, 0, sizeof *h);
}
