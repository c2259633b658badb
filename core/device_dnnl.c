/* core/device_dnnl.c: bfloat16 matrix products on a host device through
 * oneDNN's matmul primitive (Debian's libdnnl, built with OpenMP): brgemm
 * kernels that use AVX512-BF16 (or AMX) where the CPU has them, with
 * float32 accumulation. Debian's OpenBLAS exports no sbgemm.
 *
 * A column-major product C = alpha op(A) op(B) + beta C is the row-major
 * product C^T = op(B)^T op(A)^T, which is oneDNN's src x weights = dst
 * with every operand described by its strides (no copy): src op(B)^T is
 * (n, k), weights op(A)^T is (k, m), dst C^T is (n, m) with row stride
 * ldc; alpha is an output scale, beta a sum post-op. Batched products
 * add a leading batch dimension with the given strides.
 *
 * A primitive is made once per shape (strides, alpha, beta, threads
 * included) and kept, with its three memory objects, in a small table;
 * a call then only swaps the data pointers and executes. oneDNN's own
 * scratchpad is the library's (not in the device's accounting, like
 * cuBLAS's workspace). libdnnl is loaded on the first call (dlopen), not
 * linked. Not here: float16 (oneDNN 2.6 has no half matmul
 * without AVX512-FP16; core/device_host.c widens halfs to float32), the
 * dispatcher's checks (core/device_mixed.c). */
#include "core/dnnl_impl.h"

#include <dlfcn.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Distinct shapes a model's step uses: a GPT of L blocks about 25 (and
 * as many again for a short last batch); beyond this the oldest entry is
 * replaced. */
#define TDM_DNNL_CACHE 96

typedef struct tdm_dnnl_key {
    int ta, tb, m, n, k, lda, ldb, ldc, batch, threads;
    long long sa, sb, sc;
    float alpha, beta;
} tdm_dnnl_key;

typedef struct tdm_dnnl_entry {
    tdm_dnnl_key key;
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, dst;
} tdm_dnnl_entry;

struct tdm_dnnl {
    dnnl_engine_t eng;
    dnnl_stream_t stream;
    int n, next;          /* entries used; the one to replace when full */
    tdm_dnnl_entry e[TDM_DNNL_CACHE];
    char impl[64];
};

/* ---- loading oneDNN at need ----
 * Most processes never run a bfloat16 product: libdnnl (40 MB) and the
 * OpenMP runtime it brings are loaded on the first one, not mapped into
 * every process (as cuBLAS and NCCL are, cuda/cuda_libs.c). The compiler
 * checks each pointer against dnnl.h's own prototype. */
#define TDM_DNNL_FNS(X)                                                                        \
    X(dnnl_engine_create) \
    X(dnnl_engine_destroy) \
    X(dnnl_matmul_desc_init) \
    X(dnnl_memory_create) \
    X(dnnl_memory_desc_init_by_strides) \
    X(dnnl_memory_destroy) \
    X(dnnl_memory_set_data_handle) \
    X(dnnl_post_ops_append_sum) \
    X(dnnl_post_ops_create) \
    X(dnnl_post_ops_destroy) \
    X(dnnl_primitive_attr_create) \
    X(dnnl_primitive_attr_destroy) \
    X(dnnl_primitive_attr_set_output_scales) \
    X(dnnl_primitive_attr_set_post_ops) \
    X(dnnl_primitive_create) \
    X(dnnl_primitive_desc_create) \
    X(dnnl_primitive_desc_destroy) \
    X(dnnl_primitive_desc_query) \
    X(dnnl_primitive_destroy) \
    X(dnnl_primitive_execute) \
    X(dnnl_stream_create) \
    X(dnnl_stream_destroy) \
    X(dnnl_stream_wait) \
    X(omp_get_max_threads) X(omp_set_num_threads)

#define TDM_DNNL_PTR(f) __typeof__(&f) f;
static struct {
    TDM_DNNL_FNS(TDM_DNNL_PTR)
} tdm_dn;
#define DN(f) (tdm_dn.f)

static pthread_once_t tdm_dnnl_once = PTHREAD_ONCE_INIT;
static char tdm_dnnl_error[512];

static void tdm_dnnl_load(void)
{
    const char *file = getenv("TANDEM_DNNL_LIB");
    if (!file || !*file) file = "libdnnl.so.2";
    void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(tdm_dnnl_error, sizeof tdm_dnnl_error,
                 "cannot load oneDNN (%s): %s (its bfloat16 kernels: apt-get install "
                 "libdnnl2, or TANDEM_DNNL_LIB=/path/libdnnl.so.2)", file, dlerror());
        return;
    }
#define TDM_DNNL_SYM(f)                                                                  \
    if (!tdm_dnnl_error[0] && !(*(void **)&tdm_dn.f = dlsym(h, #f)))                     \
        snprintf(tdm_dnnl_error, sizeof tdm_dnnl_error, "%s has no %s: %s", file, #f,    \
                 "a oneDNN 2.x library is needed");
    TDM_DNNL_FNS(TDM_DNNL_SYM)
#undef TDM_DNNL_SYM
    /* the handle stays open for the life of the process */
}

static tdm_status tdm_dnnl_ready(const char *dev)
{
    pthread_once(&tdm_dnnl_once, tdm_dnnl_load);
    if (tdm_dnnl_error[0])
        return tdm_error_set(TDM_STATUS_UNSUPPORTED, "%s: %s", dev, tdm_dnnl_error);
    return TDM_STATUS_OK;
}

static const char *tdm_dnnl_status_name(dnnl_status_t s)
{
    switch (s) {
    case dnnl_out_of_memory: return "out of memory";
    case dnnl_invalid_arguments: return "invalid arguments";
    case dnnl_unimplemented: return "unimplemented (no kernel for this shape or CPU)";
    case dnnl_runtime_error: return "runtime error";
    default: return "error";
    }
}

static tdm_status tdm_dnnl_fail(const char *dev, const char *what, dnnl_status_t s)
{
    /* no kernel for this CPU or shape: UNSUPPORTED, which the host
     * backend answers by widening to float32 */
    return tdm_error_set(s == dnnl_out_of_memory ? TDM_STATUS_OUT_OF_MEMORY
                         : s == dnnl_unimplemented ? TDM_STATUS_UNSUPPORTED
                                                   : TDM_STATUS_SYSTEM,
                         "%s: oneDNN %s: %s (dnnl_status %d)", dev, what,
                         tdm_dnnl_status_name(s), (int)s);
}

#define TDM_DNNL_TRY(dev, what, call)                                  \
    do {                                                               \
        dnnl_status_t tdm_dn_s_ = (call);                              \
        if (tdm_dn_s_ != dnnl_success) {                               \
            st = tdm_dnnl_fail((dev), (what), tdm_dn_s_);              \
            goto fail;                                                 \
        }                                                              \
    } while (0)

static void tdm_dnnl_entry_free(tdm_dnnl_entry *e)
{
    if (e->prim) DN(dnnl_primitive_destroy)(e->prim);
    if (e->src) DN(dnnl_memory_destroy)(e->src);
    if (e->wei) DN(dnnl_memory_destroy)(e->wei);
    if (e->dst) DN(dnnl_memory_destroy)(e->dst);
    memset(e, 0, sizeof *e);
}

void tdm_dnnl_free(tdm_dnnl *x)
{
    if (!x) return;
    for (int i = 0; i < x->n; i++) tdm_dnnl_entry_free(&x->e[i]);
    if (x->stream) DN(dnnl_stream_destroy)(x->stream);
    if (x->eng) DN(dnnl_engine_destroy)(x->eng);
    free(x);
}

const char *tdm_dnnl_impl(const tdm_dnnl *x) { return x ? x->impl : ""; }

static tdm_status tdm_dnnl_open(tdm_dnnl **out, const char *dev)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_dnnl *x = calloc(1, sizeof *x);
    if (!x) return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "%s: oneDNN state", dev);
    TDM_DNNL_TRY(dev, "engine", DN(dnnl_engine_create)(&x->eng, dnnl_cpu, 0));
    TDM_DNNL_TRY(dev, "stream", DN(dnnl_stream_create)(&x->stream, x->eng, dnnl_stream_default_flags));
    *out = x;
    return TDM_STATUS_OK;
fail:
    tdm_dnnl_free(x);
    return st;
}

/* An operand's descriptor: (batch,) rows x cols with the given strides;
 * the batch dimension only when there is more than one matrix. */
static dnnl_status_t tdm_dnnl_md(dnnl_memory_desc_t *md, int batch, long long bstride,
                                 int rows, int cols, long long rs, long long cs,
                                 dnnl_data_type_t dt)
{
    if (batch > 1) {
        dnnl_dims_t d = {batch, rows, cols}, s = {bstride, rs, cs};
        return DN(dnnl_memory_desc_init_by_strides)(md, 3, d, dt, s);
    }
    dnnl_dims_t d = {rows, cols}, s = {rs, cs};
    return DN(dnnl_memory_desc_init_by_strides)(md, 2, d, dt, s);
}

static tdm_status tdm_dnnl_make(tdm_dnnl *x, const char *dev, const tdm_dnnl_key *key,
                                tdm_dnnl_entry *e)
{
    tdm_status st = TDM_STATUS_OK;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_memory_desc_t src, wei, dst;
    memset(e, 0, sizeof *e);
    e->key = *key;
    /* src = op(B)^T (n, k): B stored column-major with ldb is, read
     * row-major, B^T with row stride ldb; op(B)^T is that, or its
     * transpose. Likewise weights = op(A)^T (k, m); dst = C^T (n, m). */
    long long s_rs = key->tb == TDM_TRANS_N ? key->ldb : 1, s_cs = key->tb == TDM_TRANS_N ? 1 : key->ldb;
    long long w_rs = key->ta == TDM_TRANS_N ? key->lda : 1, w_cs = key->ta == TDM_TRANS_N ? 1 : key->lda;
    TDM_DNNL_TRY(dev, "src descriptor",
                 tdm_dnnl_md(&src, key->batch, key->sb, key->n, key->k, s_rs, s_cs, dnnl_bf16));
    TDM_DNNL_TRY(dev, "weights descriptor",
                 tdm_dnnl_md(&wei, key->batch, key->sa, key->k, key->m, w_rs, w_cs, dnnl_bf16));
    TDM_DNNL_TRY(dev, "dst descriptor",
                 tdm_dnnl_md(&dst, key->batch, key->sc, key->n, key->m, key->ldc, 1, dnnl_f32));
    dnnl_matmul_desc_t md;
    TDM_DNNL_TRY(dev, "matmul descriptor", DN(dnnl_matmul_desc_init)(&md, &src, &wei, NULL, &dst));
    TDM_DNNL_TRY(dev, "attributes", DN(dnnl_primitive_attr_create)(&attr));
    if (key->alpha != 1.0f)
        TDM_DNNL_TRY(dev, "output scale",
                     DN(dnnl_primitive_attr_set_output_scales)(attr, 1, 0, &key->alpha));
    if (key->beta != 0.0f) {
        TDM_DNNL_TRY(dev, "post-ops", DN(dnnl_post_ops_create)(&po));
        TDM_DNNL_TRY(dev, "sum post-op", DN(dnnl_post_ops_append_sum)(po, key->beta));
        TDM_DNNL_TRY(dev, "post-ops", DN(dnnl_primitive_attr_set_post_ops)(attr, po));
    }
    TDM_DNNL_TRY(dev, "matmul primitive descriptor",
                 DN(dnnl_primitive_desc_create)(&pd, &md, attr, x->eng, NULL));
    const char *impl = NULL;
    if (DN(dnnl_primitive_desc_query)(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl)
        snprintf(x->impl, sizeof x->impl, "%s", impl);
    TDM_DNNL_TRY(dev, "matmul primitive", DN(dnnl_primitive_create)(&e->prim, pd));
    TDM_DNNL_TRY(dev, "memory", DN(dnnl_memory_create)(&e->src, &src, x->eng, DNNL_MEMORY_NONE));
    TDM_DNNL_TRY(dev, "memory", DN(dnnl_memory_create)(&e->wei, &wei, x->eng, DNNL_MEMORY_NONE));
    TDM_DNNL_TRY(dev, "memory", DN(dnnl_memory_create)(&e->dst, &dst, x->eng, DNNL_MEMORY_NONE));
fail:
    if (pd) DN(dnnl_primitive_desc_destroy)(pd);
    if (po) DN(dnnl_post_ops_destroy)(po);
    if (attr) DN(dnnl_primitive_attr_destroy)(attr);
    if (st != TDM_STATUS_OK) tdm_dnnl_entry_free(e);
    return st;
}

static tdm_status tdm_dnnl_entry_for(tdm_dnnl *x, const char *dev, const tdm_dnnl_key *key,
                                     tdm_dnnl_entry **out)
{
    for (int i = 0; i < x->n; i++)
        if (!memcmp(&x->e[i].key, key, sizeof *key)) {
            *out = &x->e[i];
            return TDM_STATUS_OK;
        }
    int slot = x->n < TDM_DNNL_CACHE ? x->n : x->next;
    if (x->n < TDM_DNNL_CACHE) {
        x->n++;
    } else {
        tdm_dnnl_entry_free(&x->e[slot]);
        x->next = (x->next + 1) % TDM_DNNL_CACHE;
    }
    tdm_status st = tdm_dnnl_make(x, dev, key, &x->e[slot]);
    if (st != TDM_STATUS_OK) {
        /* leave no hole: the last entry moves into the slot */
        if (slot != x->n - 1) x->e[slot] = x->e[x->n - 1];
        memset(&x->e[x->n - 1], 0, sizeof x->e[0]);
        x->n--;
        return st;
    }
    *out = &x->e[slot];
    return TDM_STATUS_OK;
}

tdm_status tdm_dnnl_gemm_bf16(tdm_dnnl **xp, const char *dev, int threads, tdm_trans ta,
                              tdm_trans tb, int m, int n, int k, float alpha, const void *a,
                              int lda, long long stride_a, const void *b, int ldb,
                              long long stride_b, float beta, float *c, int ldc,
                              long long stride_c, int batch)
{
    tdm_status st = TDM_STATUS_OK;
    /* oneDNN's batch strides must be those of a real batch; a batch
     * reusing one operand (stride 0) runs as single products */
    if (batch > 1 && (stride_a == 0 || stride_b == 0 || stride_c == 0)) {
        const uint16_t *a16 = a, *b16 = b;
        for (int i = 0; i < batch; i++)
            TDM_CHECK(tdm_dnnl_gemm_bf16(xp, dev, threads, ta, tb, m, n, k, alpha,
                                         a16 + i * stride_a, lda, 0, b16 + i * stride_b, ldb, 0,
                                         beta, c + i * stride_c, ldc, 0, 1));
        return TDM_STATUS_OK;
    }
    TDM_CHECK(tdm_dnnl_ready(dev));
    if (!*xp) TDM_CHECK(tdm_dnnl_open(xp, dev));
    tdm_dnnl *x = *xp;
    /* the OpenMP thread count is the calling thread's own setting */
    if (DN(omp_get_max_threads)() != threads) DN(omp_set_num_threads)(threads);
    tdm_dnnl_key key;
    memset(&key, 0, sizeof key);   /* compared with memcmp: no stray padding bytes */
    key.ta = ta;
    key.tb = tb;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.batch = batch;
    key.threads = threads;
    key.sa = batch > 1 ? stride_a : 0;
    key.sb = batch > 1 ? stride_b : 0;
    key.sc = batch > 1 ? stride_c : 0;
    key.alpha = alpha;
    key.beta = beta;
    tdm_dnnl_entry *e;
    TDM_CHECK(tdm_dnnl_entry_for(x, dev, &key, &e));
    TDM_DNNL_TRY(dev, "set src", DN(dnnl_memory_set_data_handle)(e->src, (void *)b));
    TDM_DNNL_TRY(dev, "set weights", DN(dnnl_memory_set_data_handle)(e->wei, (void *)a));
    TDM_DNNL_TRY(dev, "set dst", DN(dnnl_memory_set_data_handle)(e->dst, c));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, e->src}, {DNNL_ARG_WEIGHTS, e->wei},
                               {DNNL_ARG_DST, e->dst}};
    TDM_DNNL_TRY(dev, "matmul", DN(dnnl_primitive_execute)(e->prim, x->stream, 3, args));
    TDM_DNNL_TRY(dev, "stream wait", DN(dnnl_stream_wait)(x->stream));
fail:
    return st;
}
