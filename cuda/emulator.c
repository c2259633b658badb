/* cuda/emulator.c: the CUDA backend's emulator: devices with host memory
 * whose compute entries are the CUDA backend's own (cuda/device_cuda.c)
 * with exec.host set, so every kernel's functor, index decomposition
 * included, runs as a loop on the calling thread instead of a grid on a
 * GPU, and gemm is the host backend's (the same argument list). Host
 * tests run the GPU equivalence suites through it, and
 * TANDEM_CUDA_EMULATOR=N turns "cuda" devices into N of them for whole
 * programs (cuda/cuda.h). Needs no driver and makes no CUDA call. Not the
 * GPU device (cuda/device_cuda.c), not the hooks that choose between the
 * two (cuda/hooks.c). */
#include "cuda/cuda.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/log.h"
#include "cuda/device_cuda_impl.h"
#include "cuda/emu_impl.h"

int tdm_cuda_emulator_env(void)
{
    static int cached = -1;
    int n = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (n >= 0) return n;
    const char *v = getenv("TANDEM_CUDA_EMULATOR");
    n = 0;
    if (v && *v) {
        char *end;
        long x = strtol(v, &end, 10);
        if (*end || x < 1 || x > 64)
            fprintf(stderr, "tandem: TANDEM_CUDA_EMULATOR='%s' ignored: expected a device count "
                    "1..64\n", v);
        else
            n = (int)x;
    }
    __atomic_store_n(&cached, n, __ATOMIC_RELEASE);
    return n;
}

/* Memory is host memory: copies of every direction are memmove, sync has
 * nothing to wait for. Every allocation of an emulated GPU is entered in
 * cuda/emu_mem.c's table and every entry checks its pointers against it
 * first (what a GPU would fault on), then does the host's work. */
static tdm_status emu_alloc(tdm_device *d, size_t nbytes, void **out)
{
    __atomic_fetch_add(&tdm_cuda_impl(d)->emu_allocs, 1, __ATOMIC_RELAXED);
    TDM_CHECK(tdm_device_host_mem_alloc(d, nbytes, out));
    if (d->kind == TDM_DEVICE_HOST) return TDM_STATUS_OK; /* host memory by contract */
    tdm_status st = tdm_cuda_emu_mem_add(d, *out, nbytes);
    if (st) {
        tdm_device_host_mem_free(d, *out);
        *out = NULL;
    }
    return st;
}

static void emu_fault(tdm_device *d);

/* A bad free has no caller to fail to: it is logged and becomes d's
 * sticky fault, which every later call on d returns. */
static void emu_free(tdm_device *d, void *p)
{
    if (d->kind == TDM_DEVICE_HOST) {
        tdm_device_host_mem_free(d, p);
        return;
    }
    if (tdm_cuda_emu_mem_free(d, p)) emu_fault(d);
}

/* The last error becomes d's sticky fault (the first one stays). */
static void emu_fault(tdm_device *d)
{
    const char *msg = tdm_error_message();
    TDM_WARN(CUDA, "%s", msg);
    char *copy = strdup(msg);
    char *none = NULL;
    if (copy && !__atomic_compare_exchange_n(&tdm_cuda_impl(d)->emu_fault, &none, copy, 0,
                                             __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        free(copy); /* the first fault stays */
}

/* Memory a communicator allocated (tdm_comm_alloc: the shm segment,
 * standing in for NCCL's cudaMalloc) is this GPU's while adopted. */
static tdm_status emu_mem_adopt(tdm_device *d, void *p, size_t nbytes)
{
    if (d->kind == TDM_DEVICE_HOST) return TDM_STATUS_OK;
    return tdm_cuda_emu_mem_add(d, p, nbytes);
}

static void emu_mem_disown(tdm_device *d, void *p)
{
    if (d->kind == TDM_DEVICE_HOST) return;
    if (tdm_cuda_emu_mem_disown(d, p)) emu_fault(d);
}

static tdm_status emu_copy(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    TDM_CHECK(tdm_cuda_emu_check_memcpy(d, "cudaMemcpyAsync", dst, src, nbytes,
                                        TDM_CUDA_EMU_D2D, NULL));
    if (nbytes && dst != src) memmove(dst, src, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status emu_copy_to_host(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    TDM_CHECK(tdm_cuda_emu_check_memcpy(d, "cudaMemcpyAsync", dst, src, nbytes,
                                        TDM_CUDA_EMU_D2H, NULL));
    if (nbytes && dst != src) memmove(dst, src, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status emu_copy_from_host(tdm_device *d, void *dst, const void *src, size_t nbytes)
{
    TDM_CHECK(tdm_cuda_emu_check_memcpy(d, "cudaMemcpyAsync", dst, src, nbytes,
                                        TDM_CUDA_EMU_H2D, NULL));
    if (nbytes && dst != src) memmove(dst, src, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status emu_memset_zero(tdm_device *d, void *p, size_t nbytes)
{
    TDM_CUDA_EMU_CHECK(d, "cudaMemsetAsync", {"p", p, nbytes});
    if (nbytes) memset(p, 0, nbytes);
    return TDM_STATUS_OK;
}

static tdm_status emu_sync(tdm_device *d)
{
    if (d->kind == TDM_DEVICE_HOST) return TDM_STATUS_OK;
    return tdm_cuda_emu_sticky(d);
}

static tdm_status emu_copy_peer(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                const void *src, size_t nbytes)
{
    if (dst_dev->kind != TDM_DEVICE_HOST && src_dev->kind != TDM_DEVICE_HOST)
        TDM_CHECK(tdm_cuda_emu_check_peer(dst_dev, dst, src_dev, src, nbytes));
    if (nbytes && dst != src) memmove(dst, src, nbytes);
    return TDM_STATUS_OK;
}

/* Pinned memory: the emulator's memory is host memory, there is nothing
 * to pin (tdm_dev_host_pin: UNSUPPORTED, no message kept). */
static tdm_status emu_host_pin(tdm_device *d, void *p, size_t nbytes)
{
    (void)d;
    (void)p;
    (void)nbytes;
    return TDM_STATUS_UNSUPPORTED;
}

static void emu_host_unpin(tdm_device *d, void *p)
{
    (void)d;
    (void)p;
}

/* The copy stream, modelled: a copy is done only when its handle is
 * finished (tdm_dev_xfer_finish), the latest moment a GPU may do it, so
 * that a buffer read or written before its copy's finish gives other
 * bits in the tests rather than passing by luck; the copy itself is the
 * table's own host copy in its direction. */
typedef struct emu_xfer {
    tdm_dev_xfer_dir dir;
    void *dst;
    const void *src;
    size_t nbytes;
} emu_xfer;

static tdm_status emu_copy_async(tdm_device *d, tdm_dev_xfer_dir dir, void *dst,
                                 const void *src, size_t nbytes, void **xfer)
{
    emu_xfer *x = malloc(sizeof *x);
    TDM_REQUIRE(x, TDM_STATUS_OUT_OF_MEMORY, "%s: an asynchronous copy", d->name);
    *x = (emu_xfer){.dir = dir, .dst = dst, .src = src, .nbytes = nbytes};
    __atomic_fetch_add(&tdm_cuda_impl(d)->emu_xfers, 1, __ATOMIC_RELAXED);
    *xfer = x;
    return TDM_STATUS_OK;
}

static tdm_status emu_xfer_finish(tdm_device *d, void *xfer, tdm_dev_xfer_until until)
{
    emu_xfer *x = xfer;
    (void)until;   /* every order is met by copying now: the emulator's work is synchronous */
    const tdm_device_ops *o = d->ops;
    tdm_status st = x->dir == TDM_DEV_XFER_TO_DEVICE
                        ? o->copy_from_host(d, x->dst, x->src, x->nbytes)
                        : o->copy_to_host(d, x->dst, x->src, x->nbytes);
    __atomic_fetch_sub(&tdm_cuda_impl(d)->emu_xfers, 1, __ATOMIC_RELAXED);
    free(x);
    return st;
}

int64_t tdm_cuda_emulator_xfers(const tdm_device *d)
{
    if (!tdm_cuda_device_is_emulator(d)) return -1;
    return __atomic_load_n(&tdm_cuda_impl((tdm_device *)d)->emu_xfers, __ATOMIC_RELAXED);
}

/* --- the compute entries, checked ---------------------------------------------
 * Each is the CUDA backend's own entry (device_cuda.c) after a check that
 * every pointer it will touch lies wholly in a live allocation of this
 * GPU, with the extent core/device.h's argument list gives it (for
 * embed's wte, whose row count the call does not know, one row). */

#define EMU_F(n) ((size_t)(n) * sizeof(float))
#define EMU_I(n) ((size_t)(n) * sizeof(int32_t))

/* A column-major rows x cols matrix with leading dimension ld. */
static size_t emu_mat_bytes(int rows, int cols, int ld, size_t esz)
{
    if (rows <= 0 || cols <= 0) return 0;
    return ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * esz;
}

/* batch of them, stride elements apart */
static size_t emu_batch_bytes(size_t one, long long stride, int batch, size_t esz)
{
    if (!one || batch <= 0) return 0;
    return one + (size_t)(batch - 1) * (size_t)stride * esz;
}

#define EMU_GEMM_A(ta, m, k, lda, esz) \
    emu_mat_bytes((ta) == TDM_TRANS_N ? (m) : (k), (ta) == TDM_TRANS_N ? (k) : (m), lda, esz)
#define EMU_GEMM_B(tb, n, k, ldb, esz) \
    emu_mat_bytes((tb) == TDM_TRANS_N ? (k) : (n), (tb) == TDM_TRANS_N ? (n) : (k), ldb, esz)

/* x and dx of im2col / col2im: channel ci's images start ns*h*w apart */
static size_t emu_geom_x(const tdm_conv_geom *g)
{
    int ns = g->ns > 0 ? g->ns : g->n;
    if (g->c <= 0 || g->n <= 0) return 0;
    return EMU_F(((int64_t)(g->c - 1) * ns + g->n) * g->h * g->w);
}

static size_t emu_geom_col(const tdm_conv_geom *g)
{
    return EMU_F((int64_t)g->c * g->kh * g->kw * g->n * g->oh * g->ow);
}

static size_t emu_pool_in(const tdm_conv_geom *g)
{
    return EMU_F((int64_t)g->c * g->n * g->h * g->w);
}

static size_t emu_pool_out(const tdm_conv_geom *g)
{
    return (size_t)((int64_t)g->c * g->n * g->oh * g->ow);
}

static tdm_status emu_gemm(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                           float alpha, const float *a, int lda, const float *b, int ldb,
                           float beta, float *c, int ldc)
{
    TDM_CUDA_EMU_CHECK(d, "cublasSgemm", {"A", a, EMU_GEMM_A(ta, m, k, lda, 4)},
                       {"B", b, EMU_GEMM_B(tb, n, k, ldb, 4)}, {"C", c, emu_mat_bytes(m, n, ldc, 4)});
    return tdm_cuda_gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static tdm_status emu_gemm_strided_batched(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                           int n, int k, float alpha, const float *a, int lda,
                                           long long sa, const float *b, int ldb, long long sb,
                                           float beta, float *c, int ldc, long long sc,
                                           int batch)
{
    TDM_CUDA_EMU_CHECK(d, "cublasSgemmStridedBatched",
                       {"A", a, emu_batch_bytes(EMU_GEMM_A(ta, m, k, lda, 4), sa, batch, 4)},
                       {"B", b, emu_batch_bytes(EMU_GEMM_B(tb, n, k, ldb, 4), sb, batch, 4)},
                       {"C", c, emu_batch_bytes(emu_mat_bytes(m, n, ldc, 4), sc, batch, 4)});
    return tdm_cuda_gemm_strided_batched(d, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta,
                                         c, ldc, sc, batch);
}

static tdm_status emu_gemm_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m, int n, int k,
                              float alpha, const void *a, int lda, const void *b, int ldb,
                              float beta, float *c, int ldc, tdm_dtype in)
{
    size_t e = tdm_dtype_size(in);
    TDM_CUDA_EMU_CHECK(d, "cublasGemmEx", {"A", a, EMU_GEMM_A(ta, m, k, lda, e)},
                       {"B", b, EMU_GEMM_B(tb, n, k, ldb, e)}, {"C", c, emu_mat_bytes(m, n, ldc, 4)});
    return tdm_cuda_gemm_ex(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, in);
}

static tdm_status emu_gemm_strided_batched_ex(tdm_device *d, tdm_trans ta, tdm_trans tb, int m,
                                              int n, int k, float alpha, const void *a, int lda,
                                              long long sa, const void *b, int ldb,
                                              long long sb, float beta, float *c, int ldc,
                                              long long sc, int batch, tdm_dtype in)
{
    size_t e = tdm_dtype_size(in);
    TDM_CUDA_EMU_CHECK(d, "cublasGemmStridedBatchedEx",
                       {"A", a, emu_batch_bytes(EMU_GEMM_A(ta, m, k, lda, e), sa, batch, e)},
                       {"B", b, emu_batch_bytes(EMU_GEMM_B(tb, n, k, ldb, e), sb, batch, e)},
                       {"C", c, emu_batch_bytes(emu_mat_bytes(m, n, ldc, 4), sc, batch, 4)});
    return tdm_cuda_gemm_strided_batched_ex(d, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb,
                                            beta, c, ldc, sc, batch, in);
}

static tdm_status emu_bias_act(tdm_device *d, float *y, const float *bias, int64_t rows,
                               int cols, tdm_act act)
{
    TDM_CUDA_EMU_CHECK(d, "bias_act kernel", {"y", y, EMU_F(rows * cols)},
                       {"bias", bias, EMU_F(cols)});
    return tdm_cuda_bias_act(d, y, bias, rows, cols, act);
}

static tdm_status emu_relu_bwd(tdm_device *d, float *dy, const float *y, int64_t n)
{
    TDM_CUDA_EMU_CHECK(d, "relu_bwd kernel", {"dy", dy, EMU_F(n)}, {"y", y, EMU_F(n)});
    return tdm_cuda_relu_bwd(d, dy, y, n);
}

static tdm_status emu_softmax_xent(tdm_device *d, const float *logits, const int32_t *labels,
                                   int rows, int cols, float scale, float *loss_row,
                                   float *dlogits)
{
    int64_t rc = (int64_t)rows * cols;
    TDM_CUDA_EMU_CHECK(d, "softmax_xent kernel", {"logits", logits, EMU_F(rc)},
                       {"labels", labels, EMU_I(rows)}, {"loss_row", loss_row, EMU_F(rows)},
                       {"dlogits", dlogits, EMU_F(rc)});
    return tdm_cuda_softmax_xent(d, logits, labels, rows, cols, scale, loss_row, dlogits);
}

static tdm_status emu_axpy(tdm_device *d, int64_t n, float alpha, const float *x, float *y)
{
    TDM_CUDA_EMU_CHECK(d, "axpy kernel", {"x", x, EMU_F(n)}, {"y", y, EMU_F(n)});
    return tdm_cuda_axpy(d, n, alpha, x, y);
}

static tdm_status emu_scale(tdm_device *d, int64_t n, float alpha, float *x)
{
    TDM_CUDA_EMU_CHECK(d, "scale kernel", {"x", x, EMU_F(n)});
    return tdm_cuda_scale(d, n, alpha, x);
}

static tdm_status emu_im2col(tdm_device *d, const tdm_conv_geom *g, const float *x, float *col)
{
    TDM_CUDA_EMU_CHECK(d, "im2col kernel", {"x", x, emu_geom_x(g)}, {"col", col, emu_geom_col(g)});
    return tdm_cuda_im2col(d, g, x, col);
}

static tdm_status emu_col2im(tdm_device *d, const tdm_conv_geom *g, const float *col, float *dx)
{
    TDM_CUDA_EMU_CHECK(d, "col2im kernel", {"col", col, emu_geom_col(g)},
                       {"dx", dx, emu_geom_x(g)});
    return tdm_cuda_col2im(d, g, col, dx);
}

static tdm_status emu_maxpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x,
                                  float *y, int32_t *argmax)
{
    TDM_CUDA_EMU_CHECK(d, "maxpool_fwd kernel", {"x", x, emu_pool_in(g)},
                       {"y", y, EMU_F(emu_pool_out(g))}, {"argmax", argmax, EMU_I(emu_pool_out(g))});
    return tdm_cuda_maxpool_fwd(d, g, x, y, argmax);
}

static tdm_status emu_maxpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                                  const int32_t *argmax, float *dx)
{
    TDM_CUDA_EMU_CHECK(d, "maxpool_bwd kernel", {"dy", dy, EMU_F(emu_pool_out(g))},
                       {"argmax", argmax, EMU_I(emu_pool_out(g))}, {"dx", dx, emu_pool_in(g)});
    return tdm_cuda_maxpool_bwd(d, g, dy, argmax, dx);
}

static tdm_status emu_act_fwd(tdm_device *d, tdm_act act, const float *x, float *y, int64_t n)
{
    TDM_CUDA_EMU_CHECK(d, "act_fwd kernel", {"x", x, EMU_F(n)}, {"y", y, EMU_F(n)});
    return tdm_cuda_act_fwd(d, act, x, y, n);
}

static tdm_status emu_act_bwd(tdm_device *d, tdm_act act, const float *x, const float *y,
                              const float *dy, float *dx, int64_t n)
{
    TDM_CUDA_EMU_CHECK(d, "act_bwd kernel", {"x", x, EMU_F(n)}, {"y", y, EMU_F(n)},
                       {"dy", dy, EMU_F(n)}, {"dx", dx, EMU_F(n)});
    return tdm_cuda_act_bwd(d, act, x, y, dy, dx, n);
}

static tdm_status emu_avgpool_fwd(tdm_device *d, const tdm_conv_geom *g, const float *x, float *y)
{
    TDM_CUDA_EMU_CHECK(d, "avgpool_fwd kernel", {"x", x, emu_pool_in(g)},
                       {"y", y, EMU_F(emu_pool_out(g))});
    return tdm_cuda_avgpool_fwd(d, g, x, y);
}

static tdm_status emu_avgpool_bwd(tdm_device *d, const tdm_conv_geom *g, const float *dy,
                                  float *dx)
{
    TDM_CUDA_EMU_CHECK(d, "avgpool_bwd kernel", {"dy", dy, EMU_F(emu_pool_out(g))},
                       {"dx", dx, emu_pool_in(g)});
    return tdm_cuda_avgpool_bwd(d, g, dy, dx);
}

static tdm_status emu_bn_stats(tdm_device *d, const float *x, int ch, int64_t len, float *mean,
                               float *var)
{
    TDM_CUDA_EMU_CHECK(d, "bn_stats kernel", {"x", x, EMU_F(ch * len)}, {"mean", mean, EMU_F(ch)},
                       {"var", var, EMU_F(ch)});
    return tdm_cuda_bn_stats(d, x, ch, len, mean, var);
}

static tdm_status emu_bn_prep(tdm_device *d, int ch, float *mean, const float *var,
                              float *invstd, float *run_mean, float *run_var, float eps,
                              float momentum, int64_t len, int train)
{
    TDM_CUDA_EMU_CHECK(d, "bn_prep kernel", {"mean", mean, EMU_F(ch)}, {"var", var, EMU_F(ch)},
                       {"invstd", invstd, EMU_F(ch)}, {"run_mean", run_mean, EMU_F(ch)},
                       {"run_var", run_var, EMU_F(ch)});
    return tdm_cuda_bn_prep(d, ch, mean, var, invstd, run_mean, run_var, eps, momentum, len,
                            train);
}

static tdm_status emu_bn_fwd(tdm_device *d, const float *x, int ch, int64_t len,
                             const float *mean, const float *invstd, const float *gamma,
                             const float *beta, float *y)
{
    TDM_CUDA_EMU_CHECK(d, "bn_fwd kernel", {"x", x, EMU_F(ch * len)}, {"mean", mean, EMU_F(ch)},
                       {"invstd", invstd, EMU_F(ch)}, {"gamma", gamma, EMU_F(ch)},
                       {"beta", beta, EMU_F(ch)}, {"y", y, EMU_F(ch * len)});
    return tdm_cuda_bn_fwd(d, x, ch, len, mean, invstd, gamma, beta, y);
}

static tdm_status emu_bn_bwd(tdm_device *d, const float *x, const float *dy, int ch, int64_t len,
                             const float *mean, const float *invstd, const float *gamma,
                             float *dx, float *dgamma, float *dbeta, int train)
{
    TDM_CUDA_EMU_CHECK(d, "bn_bwd kernel", {"x", x, EMU_F(ch * len)}, {"dy", dy, EMU_F(ch * len)},
                       {"mean", mean, EMU_F(ch)}, {"invstd", invstd, EMU_F(ch)},
                       {"gamma", gamma, EMU_F(ch)}, {"dx", dx, EMU_F(ch * len)},
                       {"dgamma", dgamma, EMU_F(ch)}, {"dbeta", dbeta, EMU_F(ch)});
    return tdm_cuda_bn_bwd(d, x, dy, ch, len, mean, invstd, gamma, dx, dgamma, dbeta, train);
}

static tdm_status emu_cnhw_to_nchw(tdm_device *d, const float *x, float *y, int c, int n,
                                   int64_t f)
{
    TDM_CUDA_EMU_CHECK(d, "cnhw_to_nchw kernel", {"x", x, EMU_F(c * n * f)},
                       {"y", y, EMU_F(c * n * f)});
    return tdm_cuda_cnhw_to_nchw(d, x, y, c, n, f);
}

static tdm_status emu_nchw_to_cnhw(tdm_device *d, const float *x, float *y, int c, int n,
                                   int64_t f)
{
    TDM_CUDA_EMU_CHECK(d, "nchw_to_cnhw kernel", {"x", x, EMU_F(c * n * f)},
                       {"y", y, EMU_F(c * n * f)});
    return tdm_cuda_nchw_to_cnhw(d, x, y, c, n, f);
}

static tdm_status emu_sgd_step(tdm_device *d, int64_t n, float *param, const float *grad,
                               float *mom, float lr, float momentum, float dampening,
                               float weight_decay, int nesterov, int first_step)
{
    TDM_CUDA_EMU_CHECK(d, "sgd_step kernel", {"param", param, EMU_F(n)}, {"grad", grad, EMU_F(n)},
                       {"mom", mom, EMU_F(n)});
    return tdm_cuda_sgd_step(d, n, param, grad, mom, lr, momentum, dampening, weight_decay,
                             nesterov, first_step);
}

static tdm_status emu_adamw_step(tdm_device *d, int64_t n, float *param, const float *grad,
                                 float *m, float *v, float lr, float beta1, float beta2,
                                 float eps, float weight_decay, float bc1, float bc2)
{
    TDM_CUDA_EMU_CHECK(d, "adamw_step kernel", {"param", param, EMU_F(n)},
                       {"grad", grad, EMU_F(n)}, {"m", m, EMU_F(n)}, {"v", v, EMU_F(n)});
    return tdm_cuda_adamw_step(d, n, param, grad, m, v, lr, beta1, beta2, eps, weight_decay, bc1,
                               bc2);
}

static tdm_status emu_embed_fwd(tdm_device *d, const int32_t *tok, const float *wte,
                                const float *wpe, float *out, int B, int T, int C)
{
    int64_t bt = (int64_t)B * T;
    TDM_CUDA_EMU_CHECK(d, "embed_fwd kernel", {"tok", tok, EMU_I(bt)}, {"wte", wte, EMU_F(C)},
                       {"wpe", wpe, EMU_F((int64_t)T * C)}, {"out", out, EMU_F(bt * C)});
    return tdm_cuda_embed_fwd(d, tok, wte, wpe, out, B, T, C);
}

static tdm_status emu_embed_bwd(tdm_device *d, const int32_t *tok, const float *dout,
                                float *dwte, float *dwpe, int B, int T, int C)
{
    int64_t bt = (int64_t)B * T;
    TDM_CUDA_EMU_CHECK(d, "embed_bwd kernel", {"tok", tok, EMU_I(bt)},
                       {"dout", dout, EMU_F(bt * C)}, {"dwte", dwte, EMU_F(C)},
                       {"dwpe", dwpe, EMU_F((int64_t)T * C)});
    return tdm_cuda_embed_bwd(d, tok, dout, dwte, dwpe, B, T, C);
}

static tdm_status emu_layernorm_fwd(tdm_device *d, const float *x, const float *g,
                                    const float *b, float *out, float *mean, float *rstd,
                                    int64_t rows, int C, float eps)
{
    TDM_CUDA_EMU_CHECK(d, "layernorm_fwd kernel", {"x", x, EMU_F(rows * C)}, {"g", g, EMU_F(C)},
                       {"b", b, EMU_F(C)}, {"out", out, EMU_F(rows * C)},
                       {"mean", mean, EMU_F(rows)}, {"rstd", rstd, EMU_F(rows)});
    return tdm_cuda_layernorm_fwd(d, x, g, b, out, mean, rstd, rows, C, eps);
}

static tdm_status emu_layernorm_bwd(tdm_device *d, const float *x, const float *dout,
                                    const float *g, const float *mean, const float *rstd,
                                    float *dx, float *dg, float *db, int64_t rows, int C)
{
    TDM_CUDA_EMU_CHECK(d, "layernorm_bwd kernel", {"x", x, EMU_F(rows * C)},
                       {"dout", dout, EMU_F(rows * C)}, {"g", g, EMU_F(C)},
                       {"mean", mean, EMU_F(rows)}, {"rstd", rstd, EMU_F(rows)},
                       {"dx", dx, EMU_F(rows * C)}, {"dg", dg, EMU_F(C)}, {"db", db, EMU_F(C)});
    return tdm_cuda_layernorm_bwd(d, x, dout, g, mean, rstd, dx, dg, db, rows, C);
}

static tdm_status emu_gelu_fwd(tdm_device *d, const float *x, float *y, int64_t n)
{
    TDM_CUDA_EMU_CHECK(d, "gelu_fwd kernel", {"x", x, EMU_F(n)}, {"y", y, EMU_F(n)});
    return tdm_cuda_gelu_fwd(d, x, y, n);
}

static tdm_status emu_gelu_bwd(tdm_device *d, const float *x, const float *dy, float *dx,
                               int64_t n)
{
    TDM_CUDA_EMU_CHECK(d, "gelu_bwd kernel", {"x", x, EMU_F(n)}, {"dy", dy, EMU_F(n)},
                       {"dx", dx, EMU_F(n)});
    return tdm_cuda_gelu_bwd(d, x, dy, dx, n);
}

/* src or dst (B*T, ld) of which columns [off, off + H*hd) are touched */
static size_t emu_heads_wide(int ld, int off, int B, int T, int H, int hd)
{
    int64_t rows = (int64_t)B * T;
    if (rows <= 0 || H <= 0 || hd <= 0) return 0;
    return EMU_F((rows - 1) * ld + off + (int64_t)H * hd);
}

static tdm_status emu_heads_split(tdm_device *d, const float *src, int ld, int off, float *dst,
                                  int B, int T, int H, int hd)
{
    TDM_CUDA_EMU_CHECK(d, "heads_split kernel", {"src", src, emu_heads_wide(ld, off, B, T, H, hd)},
                       {"dst", dst, EMU_F((int64_t)B * T * H * hd)});
    return tdm_cuda_heads_split(d, src, ld, off, dst, B, T, H, hd);
}

static tdm_status emu_heads_merge(tdm_device *d, const float *src, float *dst, int ld, int off,
                                  int B, int T, int H, int hd)
{
    TDM_CUDA_EMU_CHECK(d, "heads_merge kernel", {"src", src, EMU_F((int64_t)B * T * H * hd)},
                       {"dst", dst, emu_heads_wide(ld, off, B, T, H, hd)});
    return tdm_cuda_heads_merge(d, src, dst, ld, off, B, T, H, hd);
}

static tdm_status emu_attn_softmax_fwd(tdm_device *d, float *att, int64_t rows, int T)
{
    TDM_CUDA_EMU_CHECK(d, "attn_softmax_fwd kernel", {"att", att, EMU_F(rows * T)});
    return tdm_cuda_attn_softmax_fwd(d, att, rows, T);
}

static tdm_status emu_attn_softmax_bwd(tdm_device *d, const float *p, float *dp, int64_t rows,
                                       int T)
{
    TDM_CUDA_EMU_CHECK(d, "attn_softmax_bwd kernel", {"p", p, EMU_F(rows * T)},
                       {"dp", dp, EMU_F(rows * T)});
    return tdm_cuda_attn_softmax_bwd(d, p, dp, rows, T);
}

static tdm_status emu_convert(tdm_device *d, void *dst, tdm_dtype dst_type, const void *src,
                              tdm_dtype src_type, int64_t n)
{
    TDM_CUDA_EMU_CHECK(d, "convert kernel", {"dst", dst, (size_t)n * tdm_dtype_size(dst_type)},
                       {"src", src, (size_t)n * tdm_dtype_size(src_type)});
    return tdm_cuda_convert(d, dst, dst_type, src, src_type, n);
}

static tdm_status emu_unscale_check(tdm_device *d, float *x, int64_t n, float inv_scale,
                                    float *found_inf)
{
    TDM_CUDA_EMU_CHECK(d, "unscale kernel", {"x", x, EMU_F(n)}, {"found_inf", found_inf, EMU_F(1)});
    return tdm_cuda_unscale_check(d, x, n, inv_scale, found_inf);
}

static tdm_status emu_sumsq(tdm_device *d, const float *x, int64_t n, double *partials)
{
    TDM_CUDA_EMU_CHECK(d, "sumsq kernel", {"x", x, EMU_F(n)},
                       {"partials", partials, (size_t)tdm_dev_sumsq_chunks(n) * sizeof(double)});
    return tdm_cuda_sumsq(d, x, n, partials);
}

int tdm_cuda_device_is_emulator(const tdm_device *d)
{
    return d && d->ops == &tdm_cuda_emu_ops;
}

int64_t tdm_cuda_emulator_allocs(const tdm_device *d)
{
    if (!tdm_cuda_device_is_emulator(d)) return -1;
    return __atomic_load_n(&tdm_cuda_impl((tdm_device *)d)->emu_allocs, __ATOMIC_RELAXED);
}

static void emu_close(tdm_device *d)
{
    tdm_cuda_dev *c = tdm_cuda_impl(d);
    if (!c) return;
    tdm_device_free(c->host);
    tdm_cuda_emu_sticky_clear(d);
    free(c);
    d->impl = NULL;
}

const tdm_device_ops tdm_cuda_emu_ops = {
    .alloc = emu_alloc,
    .free = emu_free,
    .copy = emu_copy,
    .copy_to_host = emu_copy_to_host,
    .copy_from_host = emu_copy_from_host,
    .memset_zero = emu_memset_zero,
    .sync = emu_sync,
    .close = emu_close,
    .copy_peer = emu_copy_peer,
    .host_pin = emu_host_pin,
    .host_unpin = emu_host_unpin,
    .copy_async = emu_copy_async,
    .xfer_finish = emu_xfer_finish,
    .mem_adopt = emu_mem_adopt,
    .mem_disown = emu_mem_disown,
    .gemm = emu_gemm, .bias_act = emu_bias_act, .relu_bwd = emu_relu_bwd,
    .softmax_xent = emu_softmax_xent, .axpy = emu_axpy, .scale = emu_scale,
    .im2col = emu_im2col, .col2im = emu_col2im, .maxpool_fwd = emu_maxpool_fwd,
    .maxpool_bwd = emu_maxpool_bwd, .act_fwd = emu_act_fwd, .act_bwd = emu_act_bwd,
    .avgpool_fwd = emu_avgpool_fwd, .avgpool_bwd = emu_avgpool_bwd, .bn_stats = emu_bn_stats,
    .bn_prep = emu_bn_prep, .bn_fwd = emu_bn_fwd, .bn_bwd = emu_bn_bwd,
    .cnhw_to_nchw = emu_cnhw_to_nchw, .nchw_to_cnhw = emu_nchw_to_cnhw,
    .sgd_step = emu_sgd_step, .adamw_step = emu_adamw_step,
    .gemm_strided_batched = emu_gemm_strided_batched, .embed_fwd = emu_embed_fwd,
    .embed_bwd = emu_embed_bwd, .layernorm_fwd = emu_layernorm_fwd,
    .layernorm_bwd = emu_layernorm_bwd, .gelu_fwd = emu_gelu_fwd, .gelu_bwd = emu_gelu_bwd,
    .heads_split = emu_heads_split, .heads_merge = emu_heads_merge,
    .attn_softmax_fwd = emu_attn_softmax_fwd, .attn_softmax_bwd = emu_attn_softmax_bwd,
    .gemm_ex = emu_gemm_ex, .gemm_strided_batched_ex = emu_gemm_strided_batched_ex,
    .convert = emu_convert, .unscale_check = emu_unscale_check, .sumsq = emu_sumsq,
};

/* Every compute entry the GPU's table has, the emulator's has (its own
 * list above could drift from TDM_CUDA_COMPUTE_OPS): the slots from gemm
 * on where one is set and the other is not, as a count
 * (tests/test_cuda_emucheck.c). */
int tdm_cuda_emu_ops_mismatch(void)
{
    typedef void (*slot)(void);
    size_t n = sizeof(tdm_device_ops) / sizeof(slot);
    int bad = 0;
    for (size_t i = offsetof(tdm_device_ops, gemm) / sizeof(slot); i < n; i++) {
        slot a, b;
        memcpy(&a, (const char *)&tdm_cuda_ops + i * sizeof(slot), sizeof a);
        memcpy(&b, (const char *)&tdm_cuda_emu_ops + i * sizeof(slot), sizeof b);
        bad += !a != !b;
    }
    return bad;
}

static tdm_status tdm_cuda_emulator_make(tdm_device **out, int index, tdm_device_kind kind);

tdm_status tdm_cuda_emulator_open(tdm_device **out)
{
    return tdm_cuda_emulator_make(out, 0, TDM_DEVICE_HOST);
}

tdm_status tdm_cuda_emulator_open_accel(tdm_device **out, int index)
{
    TDM_REQUIRE(index >= 0, TDM_STATUS_INVALID_ARG, "emulator index %d is negative", index);
    return tdm_cuda_emulator_make(out, index, TDM_DEVICE_CUDA);
}

static tdm_status tdm_cuda_emulator_make(tdm_device **out, int index, tdm_device_kind kind)
{
    tdm_status st = TDM_STATUS_OK;
    *out = NULL;
    tdm_device *d = calloc(1, sizeof *d);
    tdm_cuda_dev *c = calloc(1, sizeof *c);
    if (!d || !c) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "cannot allocate the CUDA emulator");
        goto fail;
    }
    TDM_TRY(tdm_device_open(&c->host, "cpu", 0, 1));
    c->exec.host = 1;
    d->ops = &tdm_cuda_emu_ops;
    d->kind = kind; /* its memory is host memory either way */
    d->index = index;
    d->threads = 1;
    d->impl = c;
    d->mem_counted = 1;
    if (kind == TDM_DEVICE_HOST) snprintf(d->name, sizeof d->name, "cuda-emu");
    else snprintf(d->name, sizeof d->name, "cuda-emu:%d", index);
    *out = d;
    return TDM_STATUS_OK;
fail:
    free(c);
    free(d);
    return st;
}
