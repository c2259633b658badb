/* core/device_ops.c: the tdm_dev_* dispatchers over a device's ops table
 * (core/device_impl.h): one per entry, plus what the table does not have:
 * gemm's argument checks and its row-major and batched forms, zeroed
 * allocation, copies between devices. Callers outside the backends reach
 * the table only through these. Not the backends (core/device_host.c,
 * cuda/), not opening devices (core/device.c). */
#include "core/device_impl.h"

#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"

/* --- memory --------------------------------------------------------------- */

tdm_status tdm_dev_alloc(tdm_device *d, size_t nbytes, void **out)
{
    return d->ops->alloc(d, nbytes, out);
}

void tdm_dev_free(tdm_device *d, void *p)
{
    if (p) d->ops->free(d, p);
}

tdm_status tdm_dev_host_pin(tdm_device *d, void *p, size_t nbytes)
{
    if (!d->ops->host_pin || !p || !nbytes) return TDM_STATUS_UNSUPPORTED;
    return d->ops->host_pin(d, p, nbytes);
}

void tdm_dev_host_unpin(tdm_device *d, void *p)
{
    if (p && d->ops->host_unpin) d->ops->host_unpin(d, p);
}

struct tdm_dev_xfer {
    tdm_device *d;
    void *impl;               /* the backend's; NULL: nothing left to do */
};

tdm_status tdm_dev_copy_async(tdm_device *d, tdm_dev_xfer_dir dir, void *dst, const void *src,
                              size_t nbytes, tdm_dev_xfer **out)
{
    *out = NULL;
    TDM_REQUIRE(dir == TDM_DEV_XFER_TO_DEVICE || dir == TDM_DEV_XFER_TO_HOST,
                TDM_STATUS_INVALID_ARG, "%s: asynchronous copy direction %d", d->name, (int)dir);
    TDM_REQUIRE(!nbytes || (dst && src), TDM_STATUS_INVALID_ARG,
                "%s: asynchronous copy of %zu bytes from %p to %p", d->name, nbytes, src, dst);
    tdm_dev_xfer *x = calloc(1, sizeof *x);
    TDM_REQUIRE(x, TDM_STATUS_OUT_OF_MEMORY, "%s: an asynchronous copy's handle", d->name);
    x->d = d;
    tdm_status st = TDM_STATUS_OK;
    if (nbytes && d->ops->copy_async)
        st = d->ops->copy_async(d, dir, dst, src, nbytes, &x->impl);
    else if (nbytes)   /* no copy stream: at once */
        st = dir == TDM_DEV_XFER_TO_DEVICE ? d->ops->copy_from_host(d, dst, src, nbytes)
                                           : d->ops->copy_to_host(d, dst, src, nbytes);
    if (st) {
        free(x);
        return st;
    }
    *out = x;
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_xfer_finish(tdm_dev_xfer *x, tdm_dev_xfer_until until)
{
    if (!x) return TDM_STATUS_OK;
    tdm_status st = TDM_STATUS_OK;
    if (x->impl) st = x->d->ops->xfer_finish(x->d, x->impl, until);
    free(x);
    return st;
}

tdm_status tdm_dev_copy(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    return d->ops->copy(d, dst, src, nbytes);
}

tdm_status tdm_dev_copy_to_host(tdm_device *d, void *host_dst, const void *src, size_t nbytes)
{
    return d->ops->copy_to_host(d, host_dst, src, nbytes);
}

tdm_status tdm_dev_copy_from_host(tdm_device *d, void *dst, const void *host_src,
                                  size_t nbytes)
{
    return d->ops->copy_from_host(d, dst, host_src, nbytes);
}

tdm_status tdm_dev_memset_zero(tdm_device *d, void *p, size_t nbytes)
{
    return d->ops->memset_zero(d, p, nbytes);
}

tdm_status tdm_dev_sync(tdm_device *d) { return d->ops->sync(d); }

tdm_status tdm_dev_alloc_zero(tdm_device *d, size_t nbytes, void **out)
{
    TDM_CHECK(d->ops->alloc(d, nbytes, out));
    tdm_status st = d->ops->memset_zero(d, *out, nbytes);
    if (st != TDM_STATUS_OK) {
        d->ops->free(d, *out);
        *out = NULL;
    }
    return st;
}

tdm_status tdm_dev_copy_between(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                const void *src, size_t nbytes)
{
    if (nbytes == 0) return TDM_STATUS_OK;
    if (dst_dev->kind == TDM_DEVICE_HOST && src_dev->kind == TDM_DEVICE_HOST)
        return dst_dev->ops->copy(dst_dev, dst, src, nbytes);
    if (dst_dev == src_dev) return dst_dev->ops->copy(dst_dev, dst, src, nbytes);
    if (dst_dev->kind == TDM_DEVICE_HOST)
        return src_dev->ops->copy_to_host(src_dev, dst, src, nbytes);
    if (src_dev->kind == TDM_DEVICE_HOST)
        return dst_dev->ops->copy_from_host(dst_dev, dst, src, nbytes);
    if (dst_dev->ops == src_dev->ops && dst_dev->ops->copy_peer)
        return dst_dev->ops->copy_peer(dst_dev, dst, src_dev, src, nbytes);
    /* two accelerators without a peer copy: stage through the host. */
    void *tmp = malloc(nbytes);
    if (!tmp) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot stage %zu bytes", nbytes);
    tdm_status st = src_dev->ops->copy_to_host(src_dev, tmp, src, nbytes);
    if (st == TDM_STATUS_OK) st = dst_dev->ops->copy_from_host(dst_dev, dst, tmp, nbytes);
    free(tmp);
    return st;
}

/* --- gemm ------------------------------------------------------------------ */

/* cuBLAS's rules: the stored A is lda x (ta==N ? k : m), B is
 * ldb x (tb==N ? n : k), C is ldc x n, all column-major. */
static tdm_status tdm_dev_gemm_check(tdm_trans ta, tdm_trans tb, int m, int n, int k, int lda,
                                     int ldb, int ldc)
{
    int arows = ta == TDM_TRANS_N ? m : k;
    int brows = tb == TDM_TRANS_N ? k : n;
    TDM_REQUIRE(m >= 0 && n >= 0 && k >= 0, TDM_STATUS_INVALID_ARG,
                "gemm: negative size m=%d n=%d k=%d", m, n, k);
    TDM_REQUIRE(lda >= (arows > 1 ? arows : 1), TDM_STATUS_INVALID_ARG,
                "gemm: lda=%d < %d", lda, arows);
    TDM_REQUIRE(ldb >= (brows > 1 ? brows : 1), TDM_STATUS_INVALID_ARG,
                "gemm: ldb=%d < %d", ldb, brows);
    TDM_REQUIRE(ldc >= (m > 1 ? m : 1), TDM_STATUS_INVALID_ARG, "gemm: ldc=%d < %d", ldc, m);
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_gemm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                        float alpha, const float *a, int lda, const float *b, int ldb,
                        float beta, float *c, int ldc)
{
    TDM_CHECK(tdm_dev_gemm_check(ta, tb, m, n, k, lda, ldb, ldc));
    if (m == 0 || n == 0) return TDM_STATUS_OK;
    return d->ops->gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

tdm_status tdm_dev_gemm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n,
                                        int k, float alpha, const float *a, int lda,
                                        long long stride_a, const float *b, int ldb,
                                        long long stride_b, float beta, float *c, int ldc,
                                        long long stride_c, int batch)
{
    TDM_CHECK(tdm_dev_gemm_check(ta, tb, m, n, k, lda, ldb, ldc));
    TDM_REQUIRE(batch >= 0 && stride_a >= 0 && stride_b >= 0 && stride_c >= 0,
                TDM_STATUS_INVALID_ARG,
                "batched gemm: batch %d and strides %lld, %lld, %lld must not be negative", batch,
                stride_a, stride_b, stride_c);
    if (m == 0 || n == 0 || batch == 0) return TDM_STATUS_OK;
    if (d->ops->gemm_strided_batched)
        return d->ops->gemm_strided_batched(d, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                                            stride_b, beta, c, ldc, stride_c, batch);
    for (int i = 0; i < batch; i++)
        TDM_CHECK(d->ops->gemm(d, ta, tb, m, n, k, alpha, a + i * stride_a, lda,
                               b + i * stride_b, ldb, beta, c + i * stride_c, ldc));
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_gemm_rm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                           float alpha, const float *a, const float *b, float beta, float *c)
{
    /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
     * row-major buffer read column-major is its transpose; so pass B first
     * with its own flag and leading dimensions of the stored row length. */
    int lda_rm = ta == TDM_TRANS_N ? k : m; /* stored A is (m,k) or (k,m) */
    int ldb_rm = tb == TDM_TRANS_N ? n : k; /* stored B is (k,n) or (n,k) */
    return tdm_dev_gemm(d, tb, ta, n, m, k, alpha, b, ldb_rm > 0 ? ldb_rm : 1, a,
                        lda_rm > 0 ? lda_rm : 1, beta, c, n > 0 ? n : 1);
}

tdm_status tdm_dev_gemm_rm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                           int n, int k, float alpha, const float *a,
                                           long long stride_a, const float *b,
                                           long long stride_b, float beta, float *c,
                                           long long stride_c, int batch)
{
    /* as tdm_dev_gemm_rm, for every matrix of the batch */
    int lda_rm = ta == TDM_TRANS_N ? k : m;
    int ldb_rm = tb == TDM_TRANS_N ? n : k;
    return tdm_dev_gemm_strided_batched(d, tb, ta, n, m, k, alpha, b, ldb_rm > 0 ? ldb_rm : 1,
                                        stride_b, a, lda_rm > 0 ? lda_rm : 1, stride_a, beta, c,
                                        n > 0 ? n : 1, stride_c, batch);
}

/* --- the layers' kernels ------------------------------------------------------ */

tdm_status tdm_dev_bias_act(tdm_device *d, float *y, const float *bias, int64_t rows, int cols,
                            tdm_act act)
{
    return d->ops->bias_act(d, y, bias, rows, cols, act);
}

tdm_status tdm_dev_relu_bwd(tdm_device *d, float *dy, const float *y, int64_t n_elem)
{
    return d->ops->relu_bwd(d, dy, y, n_elem);
}

tdm_status tdm_dev_softmax_xent(tdm_device *d, const float *logits, const int32_t *labels,
                                int rows, int cols, float scale, float *loss_row,
                                float *dlogits)
{
    return d->ops->softmax_xent(d, logits, labels, rows, cols, scale, loss_row, dlogits);
}

tdm_status tdm_dev_axpy(tdm_device *d, int64_t n_elem, float alpha, const float *x, float *y)
{
    return d->ops->axpy(d, n_elem, alpha, x, y);
}

tdm_status tdm_dev_scale(tdm_device *d, int64_t n_elem, float alpha, float *x)
{
    return d->ops->scale(d, n_elem, alpha, x);
}

/* A chunk's batch stride must hold the chunk: ns < n would make images of
 * one channel overlap the next channel's. */
static tdm_status tdm_dev_check_ns(const char *what, const tdm_conv_geom *g)
{
    TDM_REQUIRE(g->ns == 0 || g->ns >= g->n, TDM_STATUS_INVALID_ARG,
                "%s: batch stride ns %d is smaller than the chunk's %d images (0 means the "
                "whole batch)", what, g->ns, g->n);
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_im2col(tdm_device *d, const tdm_conv_geom *g, const float *x, float *col)
{
    TDM_CHECK(tdm_dev_check_ns("im2col", g));
    return d->ops->im2col(d, g, x, col);
}

tdm_status tdm_dev_col2im(tdm_device *d, const tdm_conv_geom *g, const float *col, float *dx)
{
    TDM_CHECK(tdm_dev_check_ns("col2im", g));
    return d->ops->col2im(d, g, col, dx);
}

tdm_status tdm_dev_maxpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y,
                               int32_t *argmax)
{
    return d->ops->maxpool_fwd(d, g, x, y, argmax);
}

tdm_status tdm_dev_maxpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                               const int32_t *argmax, float *dx)
{
    return d->ops->maxpool_bwd(d, g, dy, argmax, dx);
}

tdm_status tdm_dev_bn_stats(tdm_device *d, const float *x, int channels, int64_t len,
                            float *mean, float *var)
{
    return d->ops->bn_stats(d, x, channels, len, mean, var);
}

tdm_status tdm_dev_bn_prep(tdm_device *d, int channels, float *mean, const float *var,
                           float *invstd, float *run_mean, float *run_var, float eps,
                           float momentum, int64_t len, int train)
{
    return d->ops->bn_prep(d, channels, mean, var, invstd, run_mean, run_var, eps, momentum, len,
                           train);
}

tdm_status tdm_dev_bn_fwd(tdm_device *d, const float *x, int channels, int64_t len,
                          const float *mean, const float *invstd, const float *gamma,
                          const float *beta, float *y)
{
    return d->ops->bn_fwd(d, x, channels, len, mean, invstd, gamma, beta, y);
}

tdm_status tdm_dev_bn_bwd(tdm_device *d, const float *x, const float *dy, int channels,
                          int64_t len, const float *mean, const float *invstd,
                          const float *gamma, float *dx, float *dgamma, float *dbeta, int train)
{
    return d->ops->bn_bwd(d, x, dy, channels, len, mean, invstd, gamma, dx, dgamma, dbeta,
                          train);
}

tdm_status tdm_dev_cnhw_to_nchw(tdm_device *d, const float *x, float *y, int c, int n,
                                int64_t f)
{
    return d->ops->cnhw_to_nchw(d, x, y, c, n, f);
}

tdm_status tdm_dev_nchw_to_cnhw(tdm_device *d, const float *x, float *y, int c, int n,
                                int64_t f)
{
    return d->ops->nchw_to_cnhw(d, x, y, c, n, f);
}

/* --- transformer kernels ----------------------------------------------------- */

int tdm_dev_has_transformer(const tdm_device *d)
{
    const tdm_device_ops *o = d->ops;
    return o->embed_fwd && o->embed_bwd && o->layernorm_fwd && o->layernorm_bwd && o->gelu_fwd &&
           o->gelu_bwd && o->heads_split && o->heads_merge && o->attn_softmax_fwd &&
           o->attn_softmax_bwd;
}

tdm_status tdm_dev_embed_fwd(tdm_device *d, const int32_t *tok, const float *wte,
                             const float *wpe, float *out, int B, int T, int C)
{
    return d->ops->embed_fwd(d, tok, wte, wpe, out, B, T, C);
}

tdm_status tdm_dev_embed_bwd(tdm_device *d, const int32_t *tok, const float *dout, float *dwte,
                             float *dwpe, int B, int T, int C)
{
    return d->ops->embed_bwd(d, tok, dout, dwte, dwpe, B, T, C);
}

tdm_status tdm_dev_layernorm_fwd(tdm_device *d, const float *x, const float *g, const float *b,
                                 float *out, float *mean, float *rstd, int64_t rows, int C,
                                 float eps)
{
    return d->ops->layernorm_fwd(d, x, g, b, out, mean, rstd, rows, C, eps);
}

tdm_status tdm_dev_layernorm_bwd(tdm_device *d, const float *x, const float *dout,
                                 const float *g, const float *mean, const float *rstd, float *dx,
                                 float *dg, float *db, int64_t rows, int C)
{
    return d->ops->layernorm_bwd(d, x, dout, g, mean, rstd, dx, dg, db, rows, C);
}

tdm_status tdm_dev_gelu_fwd(tdm_device *d, const float *x, float *y, int64_t n_elem)
{
    return d->ops->gelu_fwd(d, x, y, n_elem);
}

tdm_status tdm_dev_gelu_bwd(tdm_device *d, const float *x, const float *dy, float *dx,
                            int64_t n_elem)
{
    return d->ops->gelu_bwd(d, x, dy, dx, n_elem);
}

tdm_status tdm_dev_heads_split(tdm_device *d, const float *src, int ld, int off, float *dst,
                               int B, int T, int H, int hd)
{
    return d->ops->heads_split(d, src, ld, off, dst, B, T, H, hd);
}

tdm_status tdm_dev_heads_merge(tdm_device *d, const float *src, float *dst, int ld, int off,
                               int B, int T, int H, int hd)
{
    return d->ops->heads_merge(d, src, dst, ld, off, B, T, H, hd);
}

tdm_status tdm_dev_attn_softmax_fwd(tdm_device *d, float *att, int64_t rows, int T)
{
    return d->ops->attn_softmax_fwd(d, att, rows, T);
}

tdm_status tdm_dev_attn_softmax_bwd(tdm_device *d, const float *p, float *dp, int64_t rows,
                                    int T)
{
    return d->ops->attn_softmax_bwd(d, p, dp, rows, T);
}

/* --- optimizers -------------------------------------------------------------- */

tdm_status tdm_dev_sgd_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                            float *mom, float lr, float momentum, float dampening,
                            float weight_decay, int nesterov, int first_step)
{
    return d->ops->sgd_step(d, n_elem, param, grad, mom, lr, momentum, dampening, weight_decay,
                            nesterov, first_step);
}

tdm_status tdm_dev_adamw_step(tdm_device *d, int64_t n_elem, float *param, const float *grad,
                              float *m, float *v, float lr, float beta1, float beta2, float eps,
                              float weight_decay, float bias_corr1, float bias_corr2)
{
    return d->ops->adamw_step(d, n_elem, param, grad, m, v, lr, beta1, beta2, eps, weight_decay,
                              bias_corr1, bias_corr2);
}

/* --- activations and average pooling: the table's, else the kernels on
 * the host (a host device's memory is the host's; any other device's is
 * staged through host copies: correct everywhere, fast on the host) --- */

static void tdm_ops_act_fwd(tdm_act act, const float *x, float *y, int64_t n_elem)
{
    for (int64_t i = 0; i < n_elem; i++) tdm_k_act_fwd(i, (int)act, x, y);
}

static void tdm_ops_act_bwd(tdm_act act, const float *x, const float *y, const float *dy,
                            float *dx, int64_t n_elem)
{
    for (int64_t i = 0; i < n_elem; i++) tdm_k_act_bwd(i, (int)act, x, y, dy, dx);
}

static void tdm_ops_avgpool(const tdm_conv_geom *gp, const float *in, float *out, int bwd)
{
    const tdm_conv_geom g = *gp;
    int64_t planes = (int64_t)g.c * g.n, i = 0;
    if (bwd) memset(out, 0, (size_t)(planes * g.h * g.w) * sizeof(float));
    for (int64_t p = 0; p < planes; p++)
        for (int oy = 0; oy < g.oh; oy++)
            for (int ox = 0; ox < g.ow; ox++, i++) {
                if (bwd) tdm_k_avgpool_bwd(i, p, oy, ox, g, in, out);
                else tdm_k_avgpool_fwd(i, p, oy, ox, g, in, out);
            }
}

/* Host copies of up to three device arrays of n_in[k] floats (NULL
 * entries stay NULL) and an output of n_out floats. */
typedef struct tdm_ops_stage {
    float *in[3], *out;
} tdm_ops_stage;

static void tdm_ops_stage_free(tdm_ops_stage *s)
{
    for (int k = 0; k < 3; k++) free(s->in[k]);
    free(s->out);
}

static tdm_status tdm_ops_stage_in(tdm_device *d, tdm_ops_stage *s, const float *const src[3],
                                   const int64_t n_in[3], int64_t n_out)
{
    memset(s, 0, sizeof *s);
    for (int k = 0; k < 3; k++) {
        if (!src[k]) continue;
        size_t nb = (size_t)n_in[k] * sizeof(float);
        s->in[k] = malloc(nb ? nb : 1);
        TDM_REQUIRE(s->in[k], TDM_STATUS_OUT_OF_MEMORY, "device staging: cannot allocate %zu "
                    "bytes", nb);
        TDM_CHECK(tdm_dev_copy_to_host(d, s->in[k], src[k], nb));
    }
    s->out = malloc((size_t)(n_out ? n_out : 1) * sizeof(float));
    TDM_REQUIRE(s->out, TDM_STATUS_OUT_OF_MEMORY, "device staging: cannot allocate %lld floats",
                (long long)n_out);
    return TDM_STATUS_OK;
}

tdm_status tdm_dev_act_fwd(tdm_device *d, tdm_act act, const float *x, float *y, int64_t n_elem)
{
    TDM_REQUIRE(act >= TDM_ACT_RELU && act <= TDM_ACT_SIGMOID, TDM_STATUS_INVALID_ARG,
                "act_fwd: unknown activation %d", (int)act);
    if (d->ops->act_fwd) return d->ops->act_fwd(d, act, x, y, n_elem);
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
        tdm_ops_act_fwd(act, x, y, n_elem);
        return TDM_STATUS_OK;
    }
    tdm_ops_stage s;
    tdm_status st = tdm_ops_stage_in(d, &s, (const float *const[3]){x, NULL, NULL},
                                     (const int64_t[3]){n_elem, 0, 0}, n_elem);
    if (st == TDM_STATUS_OK) {
        tdm_ops_act_fwd(act, s.in[0], s.out, n_elem);
        st = tdm_dev_copy_from_host(d, y, s.out, (size_t)n_elem * sizeof(float));
    }
    tdm_ops_stage_free(&s);
    return st;
}

tdm_status tdm_dev_act_bwd(tdm_device *d, tdm_act act, const float *x, const float *y,
                           const float *dy, float *dx, int64_t n_elem)
{
    TDM_REQUIRE(act >= TDM_ACT_RELU && act <= TDM_ACT_SIGMOID, TDM_STATUS_INVALID_ARG,
                "act_bwd: unknown activation %d", (int)act);
    if (d->ops->act_bwd) return d->ops->act_bwd(d, act, x, y, dy, dx, n_elem);
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
        tdm_ops_act_bwd(act, x, y, dy, dx, n_elem);
        return TDM_STATUS_OK;
    }
    tdm_ops_stage s;
    tdm_status st = tdm_ops_stage_in(d, &s, (const float *const[3]){x, y, dy},
                                     (const int64_t[3]){n_elem, n_elem, n_elem}, n_elem);
    if (st == TDM_STATUS_OK) {
        tdm_ops_act_bwd(act, s.in[0], s.in[1], s.in[2], s.out, n_elem);
        st = tdm_dev_copy_from_host(d, dx, s.out, (size_t)n_elem * sizeof(float));
    }
    tdm_ops_stage_free(&s);
    return st;
}

static tdm_status tdm_dev_avgpool_check(const tdm_conv_geom *g)
{
    /* windows that do not overlap (backward writes each input once) and fit */
    TDM_REQUIRE(g->kh > 0 && g->kw > 0 && g->oh > 0 && g->ow > 0 && g->stride >= g->kh &&
                    (g->ow == 1 || g->stride >= g->kw) &&
                    (int64_t)(g->oh - 1) * g->stride + g->kh <= g->h &&
                    (int64_t)(g->ow - 1) * g->stride + g->kw <= g->w,
                TDM_STATUS_INVALID_ARG, "avgpool: window %dx%d stride %d does not fit %dx%d -> %dx%d",
                g->kh, g->kw, g->stride, g->h, g->w, g->oh, g->ow);
    return TDM_STATUS_OK;
}

static tdm_status tdm_dev_avgpool(tdm_device *d, const tdm_conv_geom *g, const float *in,
                                  float *out, int bwd)
{
    if (tdm_dev_kind(d) == TDM_DEVICE_HOST) {
        tdm_ops_avgpool(g, in, out, bwd);
        return TDM_STATUS_OK;
    }
    int64_t planes = (int64_t)g->c * g->n, big = planes * g->h * g->w, small = planes * g->oh * g->ow;
    tdm_ops_stage s;
    tdm_status st = tdm_ops_stage_in(d, &s, (const float *const[3]){in, NULL, NULL},
                                     (const int64_t[3]){bwd ? small : big, 0, 0},
                                     bwd ? big : small);
    if (st == TDM_STATUS_OK) {
        tdm_ops_avgpool(g, s.in[0], s.out, bwd);
        st = tdm_dev_copy_from_host(d, out, s.out, (size_t)(bwd ? big : small) * sizeof(float));
    }
    tdm_ops_stage_free(&s);
    return st;
}

tdm_status tdm_dev_avgpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y)
{
    TDM_CHECK(tdm_dev_avgpool_check(g));
    if (d->ops->avgpool_fwd) return d->ops->avgpool_fwd(d, g, x, y);
    return tdm_dev_avgpool(d, g, x, y, 0);
}

tdm_status tdm_dev_avgpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy, float *dx)
{
    TDM_CHECK(tdm_dev_avgpool_check(g));
    if (d->ops->avgpool_bwd) return d->ops->avgpool_bwd(d, g, dy, dx);
    return tdm_dev_avgpool(d, g, dy, dx, 1);
}
