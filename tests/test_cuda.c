/* tests/test_cuda.c: the CUDA backend and the NCCL communicator.
 *
 * Two halves:
 * - everywhere (no GPU, no driver, or no nvcc at build time): opening a
 *   CUDA device, parsing "cuda:0", creating an NCCL communicator or group
 *   and `tandem train --device cuda` all fail at once with
 *   TDM_STATUS_NO_DEVICE and one message that starts "no CUDA device" and
 *   carries CUDA's own error string;
 * - where a GPU exists: every CUDA kernel against the host backend on
 *   random inputs (|a-b| <= atol + rtol |ref|), cuBLAS gemm against host
 *   gemm for the four transpose combinations with padded leading
 *   dimensions, an MLP and a CNN forward+backward+SGD step on cuda:0 against
 *   cpu:0, and NCCL collectives with 1, 2 and 3 ranks on the GPUs there
 *   are (sharing one GPU on a one-GPU machine) and a killed rank caught by
 *   the watchdog (suite cuda_gpu); the DP group on 2+ GPUs (cuda_multi).
 *   Without a GPU these skip with "no CUDA device: ..."; the multi-rank
 *   tests' code also runs on the emulator, collectives over shm.
 *
 * Compiled in every build: the cuda/ functions are weak references, so
 * the file links when cuda/ is left out (no nvcc), and no CUDA header is
 * included (only cuda/ includes them). */
#include <criterion/criterion.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device_impl.h"   /* the backend's table: every entry filled */
#include "cuda/cuda_weak.h"
#include "models/model.h"
#include "models/optim.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tests/test_util.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"

/* An independent oracle for "CUDA's own error string": the runtime's
 * functions declared by hand (C ABI: cudaError_t is an int-sized enum),
 * weak so that a build without CUDA links. */
__attribute__((weak)) int cudaGetDeviceCount(int *count);
__attribute__((weak)) const char *cudaGetErrorString(int error);

/* ---- probing: is there a backend, a GPU, how many? ---- */

typedef struct cu_probe {
    int backend;      /* cuda/ linked in */
    int ngpu;         /* visible GPUs (0 on any error) */
    char why[768];    /* the error message when ngpu == 0 */
    char cuda_err[256]; /* cudaGetErrorString of cudaGetDeviceCount's error, or "" */
} cu_probe;

/* Runs in a child process: CUDA must not be initialised in a process that
 * later forks ranks that use CUDA (the multi-rank tests below). */
static void cu_probe_run(cu_probe *p)
{
    memset(p, 0, sizeof *p);
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        cu_probe q;
        memset(&q, 0, sizeof q);
        q.backend = tdm_device_cuda_linked();
        if (q.backend) {
            int n = 0;
            tdm_status st = tdm_device_cuda_count(&n);
            if (st == TDM_STATUS_OK) q.ngpu = n;
            snprintf(q.why, sizeof q.why, "%s",
                     st == TDM_STATUS_OK ? (n ? "" : "no CUDA device: none visible")
                                         : tdm_error_message());
            if (cudaGetDeviceCount && cudaGetErrorString) {
                int c = 0, e = cudaGetDeviceCount(&c);
                if (e != 0) snprintf(q.cuda_err, sizeof q.cuda_err, "%s", cudaGetErrorString(e));
            }
        } else {
            snprintf(q.why, sizeof q.why, "no CUDA device: CUDA backend not built (no nvcc)");
        }
        ssize_t w = write(fds[1], &q, sizeof q);
        _exit(w == (ssize_t)sizeof q ? 0 : 1);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t k;
    while (got < sizeof *p && (k = read(fds[0], (char *)p + got, sizeof *p - got)) > 0)
        got += (size_t)k;
    close(fds[0]);
    int ws;
    cr_assert(waitpid(pid, &ws, 0) == pid);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0 && got == sizeof *p, "CUDA probe failed");
}

/* Skips the test unless at least `need` GPUs exist. */
#define CU_NEED_GPUS(need, probe)                                                         \
    do {                                                                                  \
        cu_probe_run(probe);                                                              \
        if ((probe)->ngpu < (need)) {                                                     \
            if ((probe)->ngpu == 0)                                                       \
                cr_skip_test("%s", (probe)->why[0] ? (probe)->why : "no CUDA device");   \
            else                                                                          \
                cr_skip_test("needs %d CUDA devices, %d visible", (need), (probe)->ngpu); \
        }                                                                                 \
    } while (0)

/* Asserts st is NO_DEVICE with a message starting "no CUDA device" that
 * contains CUDA's own error string (when the probe has it). */
static void cu_expect_no_device(tdm_status st, const cu_probe *p, const char *what)
{
    const char *msg = tdm_error_message();
    cr_assert_eq(st, TDM_STATUS_NO_DEVICE, "%s: status %s (expected no device): %s", what,
                 tdm_status_name(st), msg);
    cr_assert(!strncmp(msg, "no CUDA device", 14), "%s: message '%s' does not start with "
              "'no CUDA device'", what, msg);
    if (p->cuda_err[0])
        cr_assert(strstr(msg, p->cuda_err), "%s: message '%s' lacks CUDA's error '%s'", what,
                  msg, p->cuda_err);
}

/* ======================= everywhere: failing cleanly ======================= */

Test(cuda_nodev, open_fails_with_cuda_error)
{
    cu_probe p;
    cu_probe_run(&p);
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: the failure path is not reachable");
    tdm_device *d = (tdm_device *)0x1;
    tdm_status st = tdm_device_open(&d, "cuda", 0, 0);
    cr_assert_null(d);
    cu_expect_no_device(st, &p, "tdm_device_open(cuda, 0)");
    cr_assert(strstr(tdm_error_message(), "--device cpu:N"), "no hint in '%s'",
              tdm_error_message());
    if (p.backend) {
        cr_assert(!cudaGetDeviceCount || p.cuda_err[0],
                  "the probe did not get CUDA's own error string");
        /* The same error every time, and for any index. */
        st = tdm_device_open(&d, "cuda", 3, 0);
        cu_expect_no_device(st, &p, "tdm_device_open(cuda, 3)");
        int n = 42;
        st = tdm_device_cuda_count(&n);
        cu_expect_no_device(st, &p, "count");
        cr_assert_eq(n, 0);
        cr_assert_not_null(tdm_cuda_device_count);
        st = tdm_cuda_device_count(&n);
        cu_expect_no_device(st, &p, "tdm_cuda_device_count");
    }
}

Test(cuda_nodev, device_list_parse_fails)
{
    cu_probe p;
    cu_probe_run(&p);
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: the failure path is not reachable");
    const char *specs[] = {"cuda", "cuda:0", "cuda:0,1", "cuda:1"};
    for (size_t i = 0; i < sizeof specs / sizeof *specs; i++) {
        tdm_device_list l;
        tdm_status st = tdm_device_list_parse(&l, specs[i]);
        cu_expect_no_device(st, &p, specs[i]);
    }
    /* Host specs are untouched by the CUDA backend. */
    tdm_device_list l;
    TU_OK(tdm_device_list_parse(&l, "cpu:3"));
    cr_assert_eq(l.count, 3);
}

Test(cuda_nodev, describe_reports_versions_and_error)
{
    cu_probe p;
    cu_probe_run(&p);
    if (!p.backend) cr_skip_test("CUDA backend not built (no nvcc)");
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: see cuda_gpu.describe");
    char buf[4096];
    tdm_status st = tdm_cuda_describe(buf, sizeof buf);
    cr_assert_eq(st, TDM_STATUS_NO_DEVICE, "status %s", tdm_status_name(st));
    cr_assert(strstr(buf, "CUDA runtime"), "%s", buf);
    cr_assert(strstr(buf, "NCCL"), "%s", buf);
    cr_assert(strstr(buf, "cuBLAS"), "%s", buf);
    cr_assert(strstr(buf, "no CUDA device"), "%s", buf);
    /* Truncation is safe and terminated. */
    char small[16];
    memset(small, 'x', sizeof small);
    (void)tdm_cuda_describe(small, sizeof small);
    cr_assert(memchr(small, '\0', sizeof small), "not terminated");
}

Test(cuda_nodev, nccl_init_fails_one_rank)
{
    cu_probe p;
    cu_probe_run(&p);
    if (!p.backend) cr_skip_test("CUDA backend not built (no nvcc)");
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: see cuda_gpu.nccl_one_rank");
    tdm_comm *c = (tdm_comm *)0x1;
    tdm_status st = tdm_comm_init_nccl(&c, NULL, 0);
    cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "NULL bootstrap: %s", tdm_status_name(st));

    tdm_shm_group *g = NULL;
    tdm_comm *boot = NULL;
    TU_OK(tdm_shm_group_create(&g, 1, NULL));
    TU_OK(tdm_shm_comm_init(&boot, g, 0, NULL));
    c = (tdm_comm *)0x1;
    st = tdm_comm_init_nccl(&c, boot, 0);
    cr_assert_null(c);
    cu_expect_no_device(st, &p, "tdm_comm_init_nccl");
    cr_assert(strstr(tdm_error_message(), "NCCL communicator not created"), "%s",
              tdm_error_message());
    /* The bootstrap is still usable afterwards. */
    int32_t v = 5;
    TU_OK(tdm_comm_all_reduce(boot, &v, &v, 1, TDM_DTYPE_INT32, TDM_REDOP_SUM));
    cr_assert_eq(v, 5);
    tdm_comm_free(boot);
    tdm_shm_group_free(g);
}

static int cu_nodev_rank(tdm_comm *boot, void *arg)
{
    const cu_probe *p = arg;
    tdm_comm *c = NULL;
    tdm_nccl_opts o = {.timeout_ms = 60000};
    tdm_status st = tdm_comm_init_nccl_opts(&c, boot, tdm_comm_rank(boot), &o);
    const char *msg = tdm_error_message();
    int ok = st == TDM_STATUS_NO_DEVICE && c == NULL && !strncmp(msg, "no CUDA device", 14) &&
             (!p->cuda_err[0] || strstr(msg, p->cuda_err));
    if (!ok) fprintf(stderr, "rank %d: %s: %s\n", tdm_comm_rank(boot), tdm_status_name(st), msg);
    return ok ? 0 : 1;
}

Test(cuda_nodev, nccl_init_fails_on_every_rank_at_once)
{
    cu_probe p;
    cu_probe_run(&p);
    if (!p.backend) cr_skip_test("CUDA backend not built (no nvcc)");
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: the failure path is not reachable");
    for (int world = 2; world <= 3; world++) {
        tdm_shm_spawn_opts so = {.timeout_ms = 30000};
        tdm_shm_spawn_result res;
        tdm_status st = tdm_shm_spawn(world, cu_nodev_rank, &p, &so, &res);
        cr_assert_eq(st, TDM_STATUS_OK, "world %d: %s", world, tdm_error_message());
        /* Fail fast: no rank waits for the timeout (60 s here). */
        cr_assert_lt(res.elapsed_ms, 10000.0, "world %d took %.0f ms", world, res.elapsed_ms);
    }
}

Test(cuda_nodev, nccl_group_init_fails)
{
    cu_probe p;
    cu_probe_run(&p);
    if (!p.backend) cr_skip_test("CUDA backend not built (no nvcc)");
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: the failure path is not reachable");
    tdm_cuda_nccl_group *g = (tdm_cuda_nccl_group *)0x1;
    tdm_status st = tdm_cuda_nccl_group_init(&g, (const int[]){0, 1}, 2, NULL);
    cr_assert_null(g);
    cu_expect_no_device(st, &p, "tdm_cuda_nccl_group_init");
    st = tdm_cuda_nccl_group_init(&g, (const int[]){0}, 0, NULL);
    cr_assert_eq(st, TDM_STATUS_INVALID_ARG);
    tdm_cuda_nccl_group_free(NULL);
}

/* ---- the CLI ---- */

Test(cuda_nodev, cli_train_on_cuda_fails_with_one_message)
{
    cu_probe p;
    cu_probe_run(&p);
    if (p.ngpu > 0) cr_skip_test("a CUDA device exists: see cuda_gpu.cli_train");
    static cli_result r;
    cli_run(&r, (const char *const[]){"train", "--device", "cuda", "--data", "synthetic",
                                         NULL});
    cr_assert_eq(r.code, 1, "exit %d (expected 1):\n%s", r.code, r.out);
    cr_assert(strstr(r.out, "no CUDA device: "), "no message:\n%s", r.out);
    cr_assert(strstr(r.out, "use --device cpu:N"), "no hint:\n%s", r.out);
    if (p.cuda_err[0]) cr_assert(strstr(r.out, p.cuda_err), "lacks '%s':\n%s", p.cuda_err, r.out);
    /* One message: a single line of output. */
    cr_assert(strchr(r.out, '\n') == strrchr(r.out, '\n'), "more than one line:\n%s", r.out);

    cli_run(&r, (const char *const[]){"info", NULL});
    cr_assert_eq(r.code, 0, "info: exit %d:\n%s", r.code, r.out);
    if (p.backend) {
        cr_assert(strstr(r.out, "CUDA backend   yes"), "%s", r.out);
        cr_assert(strstr(r.out, "no CUDA device"), "%s", r.out);
    }
}

/* ========================= where a GPU exists ========================= */

typedef struct cu_pair {
    tdm_device *gpu, *cpu;
} cu_pair;

/* The device under test: cuda:0, or (emu) the emulator, which runs the
 * same CUDA kernels' functors as host loops. */
static cu_pair cu_open_pair(int emu)
{
    cu_pair p = {0};
    if (emu) {
        TU_OK(tdm_cuda_emulator_open(&p.gpu));
        cr_assert_str_eq(tdm_dev_name(p.gpu), "cuda-emu");
    } else {
        TU_OK(tdm_device_open(&p.gpu, "cuda", 0, 0));
        cr_assert_eq(tdm_dev_kind(p.gpu), TDM_DEVICE_CUDA);
        cr_assert_str_eq(tdm_dev_name(p.gpu), "cuda:0");
    }
    TU_OK(tdm_device_open(&p.cpu, "cpu", 0, 1));
    return p;
}

static void cu_close_pair(cu_pair *p)
{
    tdm_device_free(p->gpu);
    tdm_device_free(p->cpu);
}

/* A device buffer of nbytes, holding a copy of h when h is not NULL. */
static void *cu_up(tdm_device *d, const void *h, size_t nbytes)
{
    void *p = NULL;
    TU_OK(tdm_dev_alloc(d, nbytes ? nbytes : 4, &p));
    if (h && nbytes) TU_OK(tdm_dev_copy_from_host(d, p, h, nbytes));
    return p;
}

static void *cu_down(tdm_device *d, const void *p, size_t nbytes)
{
    void *h = tu_malloc(nbytes);
    TU_OK(tdm_dev_copy_to_host(d, h, p, nbytes));
    return h;
}

static float *cu_rand(tdm_rng *r, int64_t n, float lo, float hi)
{
    float *x = tu_malloc((size_t)n * sizeof *x);
    tu_fill(r, x, n, lo, hi);
    return x;
}

/* Compares a GPU buffer with a host reference buffer of n floats. */
static void cu_cmp(const char *what, tdm_device *gpu, const float *dev_p, const float *ref,
                   int64_t n, double atol, double rtol)
{
    float *got = cu_down(gpu, dev_p, (size_t)n * sizeof *got);
    for (int64_t i = 0; i < n; i++)
        cr_assert(tu_close(got[i], ref[i], atol, rtol), "%s[%lld]: cuda %.9g, host %.9g", what,
                  (long long)i, got[i], ref[i]);
    free(got);
}

static void cu_t_gemm_matches_host_all_transposes(int emu)
{
    cu_pair p = cu_open_pair(emu);
    tdm_rng rng = tu_rng(11);
    const int sizes[][3] = {{37, 29, 23}, {1, 17, 64}, {128, 96, 200}, {5, 1, 1}};
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int m = sizes[si][0], n = sizes[si][1], k = sizes[si][2];
                /* Stored column-major: A is lda x (ta ? m : k), etc., with padding. */
                int arows = ta ? k : m, acols = ta ? m : k;
                int brows = tb ? n : k, bcols = tb ? k : n;
                int lda = arows + 3, ldb = brows + 5, ldc = m + 2;
                int64_t na = (int64_t)lda * acols, nb = (int64_t)ldb * bcols,
                        nc = (int64_t)ldc * n;
                float *a = cu_rand(&rng, na, -1, 1), *b = cu_rand(&rng, nb, -1, 1);
                float *c = cu_rand(&rng, nc, -1, 1);
                float *da = cu_up(p.gpu, a, (size_t)na * 4), *db = cu_up(p.gpu, b, (size_t)nb * 4);
                float *dc = cu_up(p.gpu, c, (size_t)nc * 4);
                TU_OK(tdm_dev_gemm(p.gpu, ta ? TDM_TRANS_T : TDM_TRANS_N,
                                   tb ? TDM_TRANS_T : TDM_TRANS_N, m, n, k, 0.7f, da, lda, db,
                                   ldb, 0.3f, dc, ldc));
                TU_OK(tdm_dev_gemm(p.cpu, ta ? TDM_TRANS_T : TDM_TRANS_N,
                                   tb ? TDM_TRANS_T : TDM_TRANS_N, m, n, k, 0.7f, a, lda, b, ldb,
                                   0.3f, c, ldc));
                char what[64];
                snprintf(what, sizeof what, "gemm %dx%dx%d ta=%d tb=%d", m, n, k, ta, tb);
                /* The padding rows of C must be untouched too: compare all of it. */
                cu_cmp(what, p.gpu, dc, c, nc, 1e-5 * k, 1e-4);
                tdm_dev_free(p.gpu, da);
                tdm_dev_free(p.gpu, db);
                tdm_dev_free(p.gpu, dc);
                free(a);
                free(b);
                free(c);
            }
    /* The row-major helper the layers use goes through the same path. */
    float *a = cu_rand(&rng, 6 * 4, -1, 1), *b = cu_rand(&rng, 4 * 5, -1, 1);
    float c[30] = {0};
    float *da = cu_up(p.gpu, a, 96), *db = cu_up(p.gpu, b, 80), *dc = cu_up(p.gpu, c, 120);
    TU_OK(tdm_dev_gemm_rm(p.gpu, TDM_TRANS_N, TDM_TRANS_N, 6, 5, 4, 1.0f, da, db, 0.0f, dc));
    TU_OK(tdm_dev_gemm_rm(p.cpu, TDM_TRANS_N, TDM_TRANS_N, 6, 5, 4, 1.0f, a, b, 0.0f, c));
    cu_cmp("gemm_rm", p.gpu, dc, c, 30, 1e-5, 1e-5);
    tdm_dev_free(p.gpu, da);
    tdm_dev_free(p.gpu, db);
    tdm_dev_free(p.gpu, dc);
    free(a);
    free(b);
    cu_close_pair(&p);
}
Test(cuda_gpu, gemm_matches_host_all_transposes)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_gemm_matches_host_all_transposes(0);
}
/* No emulator variant: the emulator's gemm is the host's own, so it would
 * compare host sgemm with itself. The host mapping is tested in test_gemm. */

static void cu_t_memory_ops(int emu)
{
    cu_pair p = cu_open_pair(emu);
    /* Every entry of the device interface is filled (tdm_device_ops is all
     * function pointers, so an entry added to core/device_impl.h and forgotten
     * here shows up as a NULL slot). */
    typedef void (*cu_fn)(void);
    cu_fn slots[sizeof(tdm_device_ops) / sizeof(cu_fn)];
    _Static_assert(sizeof(tdm_device_ops) % sizeof(cu_fn) == 0, "ops are function pointers");
    memcpy(slots, p.gpu->ops, sizeof slots);
    for (size_t i = 0; i < sizeof slots / sizeof *slots; i++)
        cr_assert_not_null(slots[i], "%s: device op #%zu is NULL", tdm_dev_name(p.gpu), i);
    tdm_rng rng = tu_rng(3);
    const int64_t n = 100003;
    float *h = cu_rand(&rng, n, -5, 5);
    float *d1 = cu_up(p.gpu, h, (size_t)n * 4), *d2 = NULL;
    TU_OK(tdm_dev_alloc_zero(p.gpu, (size_t)n * 4, (void **)&d2));
    float *z = tu_malloc((size_t)n * 4);
    cu_cmp("alloc_zero", p.gpu, d2, z, n, 0, 0);
    TU_OK(tdm_dev_copy(p.gpu, d2 + 1, d1, (size_t)(n - 1) * 4));
    TU_OK(tdm_dev_sync(p.gpu));
    float *back = cu_down(p.gpu, d2, (size_t)n * 4);
    cr_assert_eq(back[0], 0.0f);
    cr_assert(!memcmp(back + 1, h, (size_t)(n - 1) * 4), "device copy differs");
    /* Between devices: host <-> cuda through the dispatcher. */
    float *hc = tu_malloc((size_t)n * 4);
    TU_OK(tdm_dev_copy_between(p.cpu, hc, p.gpu, d1, (size_t)n * 4));
    cr_assert(!memcmp(hc, h, (size_t)n * 4));
    TU_OK(tdm_dev_memset_zero(p.gpu, d1, (size_t)n * 4));
    cu_cmp("memset_zero", p.gpu, d1, z, n, 0, 0);
    /* Zero-byte allocations are real buffers. */
    void *e = NULL;
    TU_OK(tdm_dev_alloc(p.gpu, 0, &e));
    cr_assert_not_null(e);
    tdm_dev_free(p.gpu, e);
    if (!emu) {
        /* An impossible allocation fails with a message naming the device. */
        e = NULL;
        tdm_status st = tdm_dev_alloc(p.gpu, (size_t)1 << 50, &e);
        cr_assert_eq(st, TDM_STATUS_OUT_OF_MEMORY, "%s", tdm_status_name(st));
        cr_assert(strstr(tdm_error_message(), "cuda:0"), "%s", tdm_error_message());
    }
    tdm_dev_free(p.gpu, d1);
    tdm_dev_free(p.gpu, d2);
    free(h);
    free(z);
    free(back);
    free(hc);
    cu_close_pair(&p);
}
Test(cuda_gpu, memory_ops)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_memory_ops(0);
}
Test(cuda_emu, memory_ops)
{
    CU_NEED_BACKEND();
    cu_t_memory_ops(1);
}

static void cu_t_dense_kernels_match_host(int emu)
{
    cu_pair p = cu_open_pair(emu);
    tdm_device *g = p.gpu, *c = p.cpu;
    tdm_rng rng = tu_rng(5);
    const int shapes[][2] = {{1, 1}, {7, 13}, {65, 130}, {1000, 257}};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        int rows = shapes[si][0], cols = shapes[si][1];
        int64_t n = (int64_t)rows * cols;
        size_t nb = (size_t)n * 4;
        for (int relu = 0; relu < 2; relu++)
            for (int use_bias = 0; use_bias < 2; use_bias++) {
                float *y = cu_rand(&rng, n, -2, 2), *bias = cu_rand(&rng, cols, -1, 1);
                float *dy = cu_up(g, y, nb), *dbias = cu_up(g, bias, (size_t)cols * 4);
                TU_OK(tdm_dev_bias_act(g, dy, use_bias ? dbias : NULL, rows, cols,
                                       relu ? TDM_ACT_RELU : TDM_ACT_NONE));
                TU_OK(tdm_dev_bias_act(c, y, use_bias ? bias : NULL, rows, cols,
                                       relu ? TDM_ACT_RELU : TDM_ACT_NONE));
                cu_cmp("bias_act", g, dy, y, n, 1e-6, 1e-6);
                tdm_dev_free(g, dy);
                tdm_dev_free(g, dbias);
                free(y);
                free(bias);
            }
        /* relu_bwd, axpy, scale */
        float *y = cu_rand(&rng, n, -1, 1), *gy = cu_rand(&rng, n, -1, 1);
        float *dy = cu_up(g, y, nb), *dgy = cu_up(g, gy, nb);
        TU_OK(tdm_dev_relu_bwd(g, dgy, dy, n));
        TU_OK(tdm_dev_relu_bwd(c, gy, y, n));
        cu_cmp("relu_bwd", g, dgy, gy, n, 0, 0);
        TU_OK(tdm_dev_axpy(g, n, -0.37f, dy, dgy));
        TU_OK(tdm_dev_axpy(c, n, -0.37f, y, gy));
        cu_cmp("axpy", g, dgy, gy, n, 1e-6, 1e-6);
        TU_OK(tdm_dev_scale(g, n, 1.7f, dgy));
        TU_OK(tdm_dev_scale(c, n, 1.7f, gy));
        cu_cmp("scale", g, dgy, gy, n, 1e-6, 1e-6);
        tdm_dev_free(g, dy);
        tdm_dev_free(g, dgy);
        free(y);
        free(gy);

        /* softmax cross-entropy, with and without dlogits */
        float *z = cu_rand(&rng, n, -8, 8);
        int32_t *lab = tu_malloc((size_t)rows * 4);
        for (int r = 0; r < rows; r++) lab[r] = (int32_t)((r * 7 + 3) % cols);
        float *dz = cu_up(g, z, nb);
        int32_t *dlab = cu_up(g, lab, (size_t)rows * 4);
        float *loss = tu_malloc((size_t)rows * 4), *dl = tu_malloc(nb);
        float *dloss = NULL, *ddl = NULL;
        TU_OK(tdm_dev_alloc(g, (size_t)rows * 4, (void **)&dloss));
        TU_OK(tdm_dev_alloc(g, nb, (void **)&ddl));
        for (int with_d = 0; with_d < 2; with_d++) {
            float scale = 1.0f / (float)rows;
            TU_OK(tdm_dev_softmax_xent(g, dz, dlab, rows, cols, scale, dloss,
                                       with_d ? ddl : NULL));
            TU_OK(tdm_dev_softmax_xent(c, z, lab, rows, cols, scale, loss, with_d ? dl : NULL));
            cu_cmp("softmax_xent loss", g, dloss, loss, rows, 1e-5, 1e-5);
            if (with_d) cu_cmp("softmax_xent dlogits", g, ddl, dl, n, 1e-7, 1e-5);
        }
        /* A bad label fails like the host backend, naming the sample. */
        if (rows > 1) {
            lab[rows / 2] = cols;
            TU_OK(tdm_dev_copy_from_host(g, dlab, lab, (size_t)rows * 4));
            tdm_status st = tdm_dev_softmax_xent(g, dz, dlab, rows, cols, 1.0f, dloss, ddl);
            cr_assert_eq(st, TDM_STATUS_INVALID_ARG);
            char want[96];
            snprintf(want, sizeof want, "label %d of sample %d is outside [0, %d)", cols,
                     rows / 2, cols);
            cr_assert(strstr(tdm_error_message(), want), "'%s' lacks '%s'", tdm_error_message(),
                      want);
        }
        tdm_dev_free(g, dz);
        tdm_dev_free(g, dlab);
        tdm_dev_free(g, dloss);
        tdm_dev_free(g, ddl);
        free(z);
        free(lab);
        free(loss);
        free(dl);
    }
    cu_close_pair(&p);
}
Test(cuda_gpu, dense_kernels_match_host)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_dense_kernels_match_host(0);
}
Test(cuda_emu, dense_kernels_match_host)
{
    CU_NEED_BACKEND();
    cu_t_dense_kernels_match_host(1);
}

static tdm_conv_geom cu_geom(int n, int ch, int h, int w, int k, int stride, int pad)
{
    tdm_conv_geom g = {.n = n, .c = ch, .h = h, .w = w, .kh = k, .kw = k, .stride = stride,
                       .pad = pad};
    g.oh = (h + 2 * pad - k) / stride + 1;
    g.ow = (w + 2 * pad - k) / stride + 1;
    return g;
}

static void cu_t_conv_pool_layout_kernels_match_host(int emu)
{
    cu_pair p = cu_open_pair(emu);
    tdm_device *g = p.gpu, *c = p.cpu;
    tdm_rng rng = tu_rng(7);
    const int convs[][7] = {
        /* n, c, h, w, k, stride, pad */
        {1, 1, 5, 5, 3, 1, 1}, {3, 2, 8, 7, 3, 1, 1}, {2, 3, 9, 9, 5, 2, 2},
        {4, 4, 6, 6, 2, 2, 0}, {5, 3, 28, 28, 3, 1, 1},
    };
    for (size_t ci = 0; ci < sizeof convs / sizeof *convs; ci++) {
        const int *v = convs[ci];
        tdm_conv_geom geo = cu_geom(v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
        int64_t nx = (int64_t)geo.c * geo.n * geo.h * geo.w;
        int64_t ncol = (int64_t)geo.c * geo.kh * geo.kw * geo.n * geo.oh * geo.ow;
        float *x = cu_rand(&rng, nx, -1, 1), *col = tu_malloc((size_t)ncol * 4);
        float *dx = cu_up(g, x, (size_t)nx * 4), *dcol = NULL;
        TU_OK(tdm_dev_alloc(g, (size_t)ncol * 4, (void **)&dcol));
        TU_OK(tdm_dev_im2col(g, &geo, dx, dcol));
        TU_OK(tdm_dev_im2col(c, &geo, x, col));
        cu_cmp("im2col", g, dcol, col, ncol, 0, 0);
        float *rc = cu_rand(&rng, ncol, -1, 1);
        TU_OK(tdm_dev_copy_from_host(g, dcol, rc, (size_t)ncol * 4));
        TU_OK(tdm_dev_col2im(g, &geo, dcol, dx));
        TU_OK(tdm_dev_col2im(c, &geo, rc, x));
        cu_cmp("col2im", g, dx, x, nx, 1e-5, 1e-5);
        if (geo.n >= 3) {
            /* images [1, n) as a chunk of the batch, in place (geo.ns):
             * image 0 of dx must stay as both sides left it */
            tdm_conv_geom gc = geo;
            gc.n = geo.n - 1;
            gc.ns = geo.n;
            int64_t plane = (int64_t)geo.h * geo.w;
            int64_t nc = ncol / geo.n * gc.n;
            float *xr = cu_rand(&rng, nx, -1, 1);
            TU_OK(tdm_dev_copy_from_host(g, dx, xr, (size_t)nx * 4));
            memcpy(x, xr, (size_t)nx * 4);
            TU_OK(tdm_dev_im2col(g, &gc, dx + plane, dcol));
            TU_OK(tdm_dev_im2col(c, &gc, x + plane, col));
            cu_cmp("im2col of a chunk", g, dcol, col, nc, 0, 0);
            TU_OK(tdm_dev_copy_from_host(g, dcol, rc, (size_t)nc * 4));
            TU_OK(tdm_dev_col2im(g, &gc, dcol, dx + plane));
            TU_OK(tdm_dev_col2im(c, &gc, rc, x + plane));
            cu_cmp("col2im of a chunk", g, dx, x, nx, 1e-5, 1e-5);
            free(xr);
        }
        tdm_dev_free(g, dx);
        tdm_dev_free(g, dcol);
        free(x);
        free(col);
        free(rc);
    }
    /* Max pooling (non-overlapping windows, no padding), layout transposes. */
    const int pools[][5] = {{1, 1, 4, 4, 2}, {3, 5, 28, 28, 2}, {2, 3, 9, 9, 3}, {2, 2, 7, 7, 2}};
    for (size_t pi = 0; pi < sizeof pools / sizeof *pools; pi++) {
        const int *v = pools[pi];
        tdm_conv_geom geo = cu_geom(v[0], v[1], v[2], v[3], v[4], v[4], 0);
        int64_t nx = (int64_t)geo.c * geo.n * geo.h * geo.w;
        int64_t ny = (int64_t)geo.c * geo.n * geo.oh * geo.ow;
        float *x = cu_rand(&rng, nx, -1, 1), *y = tu_malloc((size_t)ny * 4);
        int32_t *am = tu_malloc((size_t)ny * 4);
        float *dxp = cu_up(g, x, (size_t)nx * 4), *dyp = NULL;
        int32_t *dam = NULL;
        TU_OK(tdm_dev_alloc(g, (size_t)ny * 4, (void **)&dyp));
        TU_OK(tdm_dev_alloc(g, (size_t)ny * 4, (void **)&dam));
        TU_OK(tdm_dev_maxpool_fwd(g, &geo, dxp, dyp, dam));
        TU_OK(tdm_dev_maxpool_fwd(c, &geo, x, y, am));
        cu_cmp("maxpool_fwd", g, dyp, y, ny, 0, 0);
        int32_t *gam = cu_down(g, dam, (size_t)ny * 4);
        cr_assert(!memcmp(gam, am, (size_t)ny * 4), "maxpool argmax differs");
        float *gy = cu_rand(&rng, ny, -1, 1);
        TU_OK(tdm_dev_copy_from_host(g, dyp, gy, (size_t)ny * 4));
        TU_OK(tdm_dev_maxpool_bwd(g, &geo, dyp, dam, dxp));
        TU_OK(tdm_dev_maxpool_bwd(c, &geo, gy, am, x));
        cu_cmp("maxpool_bwd", g, dxp, x, nx, 0, 0);
        tdm_dev_free(g, dxp);
        tdm_dev_free(g, dyp);
        tdm_dev_free(g, dam);
        free(x);
        free(y);
        free(am);
        free(gam);
        free(gy);
    }
    const int lays[][3] = {{1, 1, 1}, {3, 5, 7}, {32, 17, 49}, {2, 64, 1}};
    for (size_t li = 0; li < sizeof lays / sizeof *lays; li++) {
        int ch = lays[li][0], n = lays[li][1];
        int64_t f = lays[li][2], tot = (int64_t)ch * n * f;
        float *x = cu_rand(&rng, tot, -1, 1), *y = tu_malloc((size_t)tot * 4);
        float *dxp = cu_up(g, x, (size_t)tot * 4), *dyp = NULL;
        TU_OK(tdm_dev_alloc(g, (size_t)tot * 4, (void **)&dyp));
        TU_OK(tdm_dev_cnhw_to_nchw(g, dxp, dyp, ch, n, f));
        TU_OK(tdm_dev_cnhw_to_nchw(c, x, y, ch, n, f));
        cu_cmp("cnhw_to_nchw", g, dyp, y, tot, 0, 0);
        TU_OK(tdm_dev_nchw_to_cnhw(g, dxp, dyp, ch, n, f));
        TU_OK(tdm_dev_nchw_to_cnhw(c, x, y, ch, n, f));
        cu_cmp("nchw_to_cnhw", g, dyp, y, tot, 0, 0);
        tdm_dev_free(g, dxp);
        tdm_dev_free(g, dyp);
        free(x);
        free(y);
    }
    cu_close_pair(&p);
}
Test(cuda_gpu, conv_pool_layout_kernels_match_host)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_conv_pool_layout_kernels_match_host(0);
}
Test(cuda_emu, conv_pool_layout_kernels_match_host)
{
    CU_NEED_BACKEND();
    cu_t_conv_pool_layout_kernels_match_host(1);
}

static void cu_t_batchnorm_kernels_match_host(int emu)
{
    cu_pair p = cu_open_pair(emu);
    tdm_device *g = p.gpu, *c = p.cpu;
    tdm_rng rng = tu_rng(9);
    const int cases[][2] = {{1, 1}, {1, 2}, {4, 37}, {32, 8 * 14 * 14}, {3, 100000}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        int ch = cases[ci][0];
        int64_t len = cases[ci][1], tot = ch * len;
        size_t cb = (size_t)ch * 4, tb = (size_t)tot * 4;
        float *x = cu_rand(&rng, tot, -3, 5), *dy = cu_rand(&rng, tot, -1, 1);
        float *gamma = cu_rand(&rng, ch, 0.5f, 1.5f), *beta = cu_rand(&rng, ch, -1, 1);
        float *rm = cu_rand(&rng, ch, -1, 1), *rv = cu_rand(&rng, ch, 0.5f, 2);
        float *dgm = cu_rand(&rng, ch, -1, 1), *dbt = cu_rand(&rng, ch, -1, 1);
        float *mean = tu_malloc(cb), *var = tu_malloc(cb), *istd = tu_malloc(cb);
        float *y = tu_malloc(tb), *dx = tu_malloc(tb);
        float *g_x = cu_up(g, x, tb), *g_dy = cu_up(g, dy, tb), *g_gamma = cu_up(g, gamma, cb);
        float *g_beta = cu_up(g, beta, cb), *g_rm = cu_up(g, rm, cb), *g_rv = cu_up(g, rv, cb);
        float *g_dgm = cu_up(g, dgm, cb), *g_dbt = cu_up(g, dbt, cb);
        float *g_mean = cu_up(g, NULL, cb), *g_var = cu_up(g, NULL, cb);
        float *g_istd = cu_up(g, NULL, cb), *g_y = cu_up(g, NULL, tb), *g_dx = cu_up(g, NULL, tb);
        for (int train = 1; train >= 0; train--) {
            if (train) {
                TU_OK(tdm_dev_bn_stats(g, g_x, ch, len, g_mean, g_var));
                TU_OK(tdm_dev_bn_stats(c, x, ch, len, mean, var));
                cu_cmp("bn_stats mean", g, g_mean, mean, ch, 1e-6, 1e-5);
                cu_cmp("bn_stats var", g, g_var, var, ch, 1e-6, 1e-5);
                /* Continue from identical statistics on both sides. */
                TU_OK(tdm_dev_copy_from_host(g, g_mean, mean, cb));
                TU_OK(tdm_dev_copy_from_host(g, g_var, var, cb));
            }
            TU_OK(tdm_dev_bn_prep(g, ch, g_mean, g_var, g_istd, g_rm, g_rv, 1e-5f, 0.1f, len,
                                  train));
            TU_OK(tdm_dev_bn_prep(c, ch, mean, var, istd, rm, rv, 1e-5f, 0.1f, len, train));
            cu_cmp("bn_prep mean", g, g_mean, mean, ch, 1e-6, 1e-6);
            cu_cmp("bn_prep invstd", g, g_istd, istd, ch, 1e-6, 1e-5);
            cu_cmp("bn_prep run_mean", g, g_rm, rm, ch, 1e-6, 1e-6);
            cu_cmp("bn_prep run_var", g, g_rv, rv, ch, 1e-6, 1e-5);
            TU_OK(tdm_dev_bn_fwd(g, g_x, ch, len, g_mean, g_istd, g_gamma, g_beta, g_y));
            TU_OK(tdm_dev_bn_fwd(c, x, ch, len, mean, istd, gamma, beta, y));
            cu_cmp("bn_fwd", g, g_y, y, tot, 1e-5, 1e-5);
            for (int with_dx = 0; with_dx < 2; with_dx++) {
                TU_OK(tdm_dev_bn_bwd(g, g_x, g_dy, ch, len, g_mean, g_istd, g_gamma,
                                     with_dx ? g_dx : NULL, g_dgm, g_dbt, train));
                TU_OK(tdm_dev_bn_bwd(c, x, dy, ch, len, mean, istd, gamma, with_dx ? dx : NULL,
                                     dgm, dbt, train));
                cu_cmp("bn_bwd dgamma", g, g_dgm, dgm, ch, 1e-4, 1e-4);
                cu_cmp("bn_bwd dbeta", g, g_dbt, dbt, ch, 1e-4, 1e-4);
                if (with_dx) cu_cmp("bn_bwd dx", g, g_dx, dx, tot, 1e-5, 1e-4);
            }
        }
        float *all[] = {x, dy, gamma, beta, rm, rv, dgm, dbt, mean, var, istd, y, dx};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++) free(all[i]);
        float *gall[] = {g_x, g_dy, g_gamma, g_beta, g_rm, g_rv, g_dgm, g_dbt, g_mean, g_var,
                         g_istd, g_y, g_dx};
        for (size_t i = 0; i < sizeof gall / sizeof *gall; i++) tdm_dev_free(g, gall[i]);
    }
    cu_close_pair(&p);
}
Test(cuda_gpu, batchnorm_kernels_match_host)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_batchnorm_kernels_match_host(0);
}
Test(cuda_emu, batchnorm_kernels_match_host)
{
    CU_NEED_BACKEND();
    cu_t_batchnorm_kernels_match_host(1);
}

static void cu_t_optimizer_kernels_match_host(int emu)
{
    cu_pair p = cu_open_pair(emu);
    tdm_device *g = p.gpu, *c = p.cpu;
    tdm_rng rng = tu_rng(13);
    const int64_t ns[] = {1, 255, 257, 300001};
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
        int64_t n = ns[ni];
        size_t nb = (size_t)n * 4;
        float *par = cu_rand(&rng, n, -1, 1), *grad = cu_rand(&rng, n, -1, 1);
        float *m = cu_rand(&rng, n, -0.1f, 0.1f), *v = cu_rand(&rng, n, 0, 0.01f);
        float *gp = cu_up(g, par, nb), *gg = cu_up(g, grad, nb), *gm = cu_up(g, m, nb),
              *gv = cu_up(g, v, nb);
        /* SGD: plain, momentum first/later step, dampening, nesterov, wd. */
        const float cfg[][4] = {{0, 0, 0, 0}, {0.9f, 0, 0, 1e-3f}, {0.9f, 0.1f, 0, 0},
                                {0.9f, 0, 1, 1e-2f}};
        for (size_t k = 0; k < sizeof cfg / sizeof *cfg; k++)
            for (int first = 1; first >= 0; first--) {
                TU_OK(tdm_dev_sgd_step(g, n, gp, gg, gm, 0.05f, cfg[k][0], cfg[k][1], cfg[k][3],
                                       (int)cfg[k][2], first));
                TU_OK(tdm_dev_sgd_step(c, n, par, grad, m, 0.05f, cfg[k][0], cfg[k][1],
                                       cfg[k][3], (int)cfg[k][2], first));
                cu_cmp("sgd param", g, gp, par, n, 1e-6, 1e-5);
                cu_cmp("sgd momentum", g, gm, m, n, 1e-6, 1e-5);
            }
        for (int t = 1; t <= 3; t++) {
            float bc1 = 1.0f - powf(0.9f, (float)t), bc2 = 1.0f - powf(0.999f, (float)t);
            TU_OK(tdm_dev_adamw_step(g, n, gp, gg, gm, gv, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f,
                                     bc1, bc2));
            TU_OK(tdm_dev_adamw_step(c, n, par, grad, m, v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f,
                                     bc1, bc2));
            cu_cmp("adamw param", g, gp, par, n, 1e-6, 1e-5);
            cu_cmp("adamw m", g, gm, m, n, 1e-7, 1e-5);
            cu_cmp("adamw v", g, gv, v, n, 1e-9, 1e-5);
        }
        tdm_dev_free(g, gp);
        tdm_dev_free(g, gg);
        tdm_dev_free(g, gm);
        tdm_dev_free(g, gv);
        free(par);
        free(grad);
        free(m);
        free(v);
    }
    cu_close_pair(&p);
}
Test(cuda_gpu, optimizer_kernels_match_host)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_optimizer_kernels_match_host(0);
}
Test(cuda_emu, optimizer_kernels_match_host)
{
    CU_NEED_BACKEND();
    cu_t_optimizer_kernels_match_host(1);
}

/* One model on each device from the same seed: forward+backward on the
 * same batch, then an SGD step (momentum; nesterov when `nesterov`);
 * loss, logits, gradients, parameters and buffers agree. SGD, not AdamW:
 * AdamW's normalised update turns a rounding-level difference in a
 * near-zero gradient into a difference of up to lr, which would force a
 * tolerance too loose to test anything; the AdamW kernel itself is
 * compared exactly above. */
static void cu_model_check(int emu, const tdm_model_spec *spec, int batch, int nesterov)
{
    cu_pair p = cu_open_pair(emu);
    tdm_model *mg = NULL, *mc = NULL;
    TU_OK(tdm_model_init(&mg, p.gpu, spec, 21));
    TU_OK(tdm_model_init(&mc, p.cpu, spec, 21));
    int64_t pe = tdm_model_param_elems(mc);
    cr_assert_eq(pe, tdm_model_param_elems(mg));
    cu_cmp("initial params", p.gpu, tdm_model_params(mg), tdm_model_params(mc), pe, 0, 0);

    int in = tdm_model_in_features(mc), classes = tdm_model_n_classes(mc);
    tdm_rng rng = tu_rng(99);
    float *x = cu_rand(&rng, (int64_t)batch * in, -1, 1);
    int32_t *y = tu_malloc((size_t)batch * 4);
    for (int i = 0; i < batch; i++) y[i] = (int32_t)((i * 5 + 1) % classes);
    float *gx = cu_up(p.gpu, x, (size_t)batch * in * 4);
    int32_t *gy = cu_up(p.gpu, y, (size_t)batch * 4);

    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_SGD);
    oo.lr = 0.05f;
    oo.momentum = 0.9f;
    oo.nesterov = nesterov;
    oo.weight_decay = 1e-4f;
    tdm_optim *og = NULL, *oc = NULL;
    TU_OK(tdm_optim_init(&og, mg, &oo));
    TU_OK(tdm_optim_init(&oc, mc, &oo));
    for (int step = 0; step < 3; step++) {
        double lg = 0, lc = 0;
        TU_OK(tdm_model_zero_grad(mg));
        TU_OK(tdm_model_zero_grad(mc));
        TU_OK(tdm_model_forward_backward(mg, gx, gy, batch, &lg));
        TU_OK(tdm_model_forward_backward(mc, x, y, batch, &lc));
        cr_assert(tu_close(lg, lc, 1e-5, 1e-4), "step %d: loss cuda %.9g host %.9g", step, lg,
                  lc);
        const float *lgp = NULL, *lcp = NULL;
        TU_OK(tdm_model_forward(mg, gx, batch, &lgp));
        TU_OK(tdm_model_forward(mc, x, batch, &lcp));
        cu_cmp("logits", p.gpu, lgp, lcp, (int64_t)batch * classes, 1e-4, 1e-3);
        cu_cmp("grads", p.gpu, tdm_model_grads(mg), tdm_model_grads(mc), pe, 1e-4, 1e-3);
        TU_OK(tdm_optim_step(og));
        TU_OK(tdm_optim_step(oc));
        cu_cmp("params after step", p.gpu, tdm_model_params(mg), tdm_model_params(mc), pe, 1e-5,
               1e-3);
        int64_t be = tdm_model_buffer_elems(mc);
        if (be) cu_cmp("buffers", p.gpu, tdm_model_buffers(mg), tdm_model_buffers(mc), be, 1e-5,
                       1e-3);
    }
    TU_OK(tdm_dev_sync(p.gpu));
    tdm_optim_free(og);
    tdm_optim_free(oc);
    tdm_dev_free(p.gpu, gx);
    tdm_dev_free(p.gpu, gy);
    free(x);
    free(y);
    tdm_model_free(mg);
    tdm_model_free(mc);
    cu_close_pair(&p);
}

static void cu_t_mlp_matches_host(int emu)
{
    static const int dims[] = {64, 48, 33, 10};
    tdm_model_spec s;
    tdm_model_spec_mlp(&s, dims, 4);
    cu_model_check(emu, &s, 37, 0);
    cu_model_check(emu, &s, 8, 1);
}
Test(cuda_gpu, mlp_matches_host)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_mlp_matches_host(0);
}
Test(cuda_emu, mlp_matches_host)
{
    CU_NEED_BACKEND();
    cu_t_mlp_matches_host(1);
}

static void cu_t_cnn_matches_host(int emu)
{
    tdm_model_spec s;
    tdm_model_spec_cnn(&s);
    s.in_c = 1;
    s.in_h = 12;
    s.in_w = 12;
    s.ch1 = 6;
    s.ch2 = 10;
    s.n_classes = 5;
    cu_model_check(emu, &s, 9, 0);
    tdm_model_spec_cnn(&s); /* the default 1x28x28 -> 32 -> 64 -> 10 */
    cu_model_check(emu, &s, 16, 1);
}
Test(cuda_gpu, cnn_matches_host)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_t_cnn_matches_host(0);
}
Test(cuda_emu, cnn_matches_host)
{
    CU_NEED_BACKEND();
    cu_t_cnn_matches_host(1);
}

Test(cuda_gpu, describe)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    char buf[8192];
    TU_OK(tdm_cuda_describe(buf, sizeof buf));
    cr_assert(strstr(buf, "cuda:0"), "%s", buf);
    cr_assert(strstr(buf, "compute capability"), "%s", buf);
    cr_assert(strstr(buf, "NCCL"), "%s", buf);
    if (pr.ngpu > 1) cr_assert(strstr(buf, "peer access"), "%s", buf);
}

Test(cuda_gpu, nccl_one_rank)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    tdm_shm_group *sg = NULL;
    tdm_comm *boot = NULL, *c = NULL;
    TU_OK(tdm_shm_group_create(&sg, 1, NULL));
    TU_OK(tdm_shm_comm_init(&boot, sg, 0, NULL));
    tdm_device *d = NULL;
    TU_OK(tdm_device_open(&d, "cuda", 0, 0));
    tdm_nccl_opts o = {.timeout_ms = 20000};
    TU_OK(tdm_comm_init_nccl_opts(&c, boot, 0, &o));
    cr_assert_str_eq(tdm_comm_backend_name(c), "nccl");
    float h[1000];
    for (int i = 0; i < 1000; i++) h[i] = (float)i;
    float *buf = cu_up(d, h, sizeof h);
    /* Ordered after the compute stream: a scale enqueued just before. */
    TU_OK(tdm_dev_scale(d, 1000, 2.0f, buf));
    TU_OK(tdm_comm_all_reduce(c, buf, buf, 1000, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM));
    float *back = cu_down(d, buf, sizeof h);
    for (int i = 0; i < 1000; i++) cr_assert_eq(back[i], 2.0f * (float)i, "[%d] %g", i, back[i]);
    TU_OK(tdm_comm_barrier(c));
    /* Asynchronous path through the dispatcher. */
    tdm_comm_work *w = NULL;
    TU_OK(tdm_comm_all_reduce_async(c, buf, buf, 1000, TDM_DTYPE_FLOAT32, TDM_REDOP_AVG, &w));
    TU_OK(tdm_comm_work_wait(w, 20000));
    tdm_comm_work_free(w);
    float *avg = cu_down(d, buf, sizeof h); /* AVG over one rank is the identity */
    for (int i = 0; i < 1000; i++) cr_assert_eq(avg[i], 2.0f * (float)i, "avg [%d] %g", i, avg[i]);
    free(avg);
    /* comm-allocated memory, filled and read back around a broadcast */
    void *cm = NULL;
    TU_OK(tdm_comm_alloc(c, 4096, &cm));
    int32_t ci[1024], co[1024];
    for (int i = 0; i < 1024; i++) ci[i] = i * 3 - 7;
    TU_OK(tdm_dev_copy_from_host(d, cm, ci, sizeof ci));
    TU_OK(tdm_comm_broadcast(c, cm, cm, 1024, TDM_DTYPE_INT32, 0));
    TU_OK(tdm_dev_copy_to_host(d, co, cm, sizeof co));
    cr_assert(!memcmp(ci, co, sizeof ci), "broadcast over comm memory changed it");
    /* After abort every call fails at once with the reason. */
    TU_OK(tdm_comm_abort(c, "test abort"));
    tdm_status st = tdm_comm_all_reduce(c, buf, buf, 10, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
    cr_assert_eq(st, TDM_STATUS_ABORTED, "%s", tdm_status_name(st));
    cr_assert(strstr(tdm_error_message(), "test abort"), "%s", tdm_error_message());
    st = tdm_comm_barrier(c);
    cr_assert_eq(st, TDM_STATUS_ABORTED);
    free(back);
    tdm_dev_free(d, buf);
    tdm_comm_free(c);
    tdm_device_free(d);
    tdm_comm_free(boot);
    tdm_shm_group_free(sg);
}

/* Multi-rank runs, on as many GPUs as there are (rank r on GPU r % ngpu:
 * two or three ranks share one GPU on a one-GPU machine, NCCL told they
 * are different hosts, see cu_rank_gpu), or with ngpu 0 on emulated
 * devices whose collectives go over shm (NCCL cannot use host memory):
 * the same test code, run on every machine. */
typedef struct cu_ranks_arg {
    int ngpu;                 /* 0: the emulator */
    int victim;               /* the killed-rank test: the rank that dies */
    struct cu_ranks_shared *sh;
} cu_ranks_arg;

typedef struct cu_ranks_shared {
    int status[8];            /* the survivors' failed call */
    char msg[8][512];
} cu_ranks_shared;

static const char *cu_shm_aborted(void *ctx) { return tdm_shm_comm_abort_reason(ctx); }

#define RK_OK(expr)                                                                      \
    do {                                                                                \
        tdm_status s_ = (expr);                                                         \
        if (s_ != TDM_STATUS_OK) {                                                      \
            fprintf(stderr, "rank %d: %s: %s\n", rank, #expr, tdm_error_message());      \
            return 1;                                                                   \
        }                                                                               \
    } while (0)

/* The rank's device and its collectives' communicator: NCCL on a GPU
 * (stopping when the shm group aborts, as DDP's ranks do), the bootstrap
 * (shm) itself on the emulator. */
static tdm_status cu_rank_setup(tdm_comm *boot, const cu_ranks_arg *a, int64_t timeout_ms,
                                tdm_device **d, tdm_comm **c)
{
    int rank = tdm_comm_rank(boot), world = tdm_comm_size(boot);
    *d = NULL;
    *c = NULL;
    if (a->ngpu == 0) {
        *c = boot;
        return tdm_cuda_emulator_open_accel(d, 0);
    }
    int gpu = cu_rank_gpu(rank, world, a->ngpu);
    TDM_CHECK(tdm_device_open(d, "cuda", gpu, 0));
    tdm_nccl_opts o = {.timeout_ms = timeout_ms, .abort_check = cu_shm_aborted,
                       .abort_ctx = boot};
    return tdm_comm_init_nccl_opts(c, boot, gpu, &o);
}

static void cu_rank_teardown(tdm_comm *boot, tdm_device *d, tdm_comm *c)
{
    if (c != boot) tdm_comm_free(c);
    tdm_device_free(d);
}

/* Every collective against values computed here. */
static int cu_nccl_rank(tdm_comm *boot, void *arg)
{
    const cu_ranks_arg *a = arg;
    int rank = tdm_comm_rank(boot), world = tdm_comm_size(boot);
    tdm_device *d = NULL;
    tdm_comm *c = NULL;
    int bad = 0;
    RK_OK(cu_rank_setup(boot, a, 30000, &d, &c));
    const size_t n = 4099;
    size_t nb = n * (size_t)world * sizeof(float);
    float *h = malloc(nb), *hr = malloc(nb);
    float *buf = NULL, *out = NULL;
    RK_OK(tdm_dev_alloc(d, nb, (void **)&buf));
    RK_OK(tdm_dev_alloc(d, nb, (void **)&out));
    for (size_t i = 0; i < n * (size_t)world; i++) h[i] = (float)((i * 3 + (size_t)rank) % 11);
    /* all_reduce SUM and MAX */
    RK_OK(tdm_dev_copy_from_host(d, buf, h, n * 4));
    RK_OK(tdm_comm_all_reduce(c, buf, out, n, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM));
    RK_OK(tdm_dev_copy_to_host(d, hr, out, n * 4));
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < world; r++) want += (float)((i * 3 + (size_t)r) % 11);
        bad += hr[i] != want;
    }
    RK_OK(tdm_comm_all_reduce(c, buf, out, n, TDM_DTYPE_FLOAT32, TDM_REDOP_MAX));
    RK_OK(tdm_dev_copy_to_host(d, hr, out, n * 4));
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < world; r++) {
            float v = (float)((i * 3 + (size_t)r) % 11);
            want = v > want ? v : want;
        }
        bad += hr[i] != want;
    }
    /* broadcast from the last rank */
    RK_OK(tdm_comm_broadcast(c, buf, out, n, TDM_DTYPE_FLOAT32, world - 1));
    RK_OK(tdm_dev_copy_to_host(d, hr, out, n * 4));
    for (size_t i = 0; i < n; i++) bad += hr[i] != (float)((i * 3 + (size_t)(world - 1)) % 11);
    /* all_gather: block r is rank r's first n */
    RK_OK(tdm_comm_all_gather(c, buf, out, n, TDM_DTYPE_FLOAT32));
    RK_OK(tdm_dev_copy_to_host(d, hr, out, nb));
    for (int r = 0; r < world; r++)
        for (size_t i = 0; i < n; i++) bad += hr[(size_t)r * n + i] != (float)((i * 3 + (size_t)r) % 11);
    /* reduce_scatter over world*n inputs */
    RK_OK(tdm_dev_copy_from_host(d, buf, h, nb));
    RK_OK(tdm_comm_reduce_scatter(c, buf, out, n, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM));
    RK_OK(tdm_dev_copy_to_host(d, hr, out, n * 4));
    for (size_t i = 0; i < n; i++) {
        size_t j = (size_t)rank * n + i;
        float want = 0;
        for (int r = 0; r < world; r++) want += (float)((j * 3 + (size_t)r) % 11);
        bad += hr[i] != want;
    }
    /* gather to 0, scatter from 0, send/recv 0 -> 1 */
    RK_OK(tdm_comm_gather(c, buf, out, n, TDM_DTYPE_FLOAT32, 0));
    if (rank == 0) {
        RK_OK(tdm_dev_copy_to_host(d, hr, out, nb));
        for (int r = 0; r < world; r++)
            for (size_t i = 0; i < n; i++)
                bad += hr[(size_t)r * n + i] != (float)((i * 3 + (size_t)r) % 11);
    }
    RK_OK(tdm_comm_scatter(c, buf, out, n, TDM_DTYPE_FLOAT32, 0));
    RK_OK(tdm_dev_copy_to_host(d, hr, out, n * 4));
    for (size_t i = 0; i < n; i++) bad += hr[i] != (float)((((size_t)rank * n + i) * 3) % 11);
    if (rank == 0) RK_OK(tdm_comm_send(c, buf, n, TDM_DTYPE_FLOAT32, 1));
    if (rank == 1) {
        RK_OK(tdm_comm_recv(c, out, n, TDM_DTYPE_FLOAT32, 0));
        RK_OK(tdm_dev_copy_to_host(d, hr, out, n * 4));
        for (size_t i = 0; i < n; i++) bad += hr[i] != (float)((i * 3) % 11);
    }
    RK_OK(tdm_comm_barrier(c));
    if (bad) fprintf(stderr, "rank %d: %d wrong values\n", rank, bad);
    free(h);
    free(hr);
    tdm_dev_free(d, buf);
    tdm_dev_free(d, out);
    cu_rank_teardown(boot, d, c);
    return bad ? 1 : 0;
}

/* Two and three ranks on the GPUs there are (on one GPU: all of them). */
Test(cuda_gpu, nccl_ranks_every_collective, .timeout = 240)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_ranks_arg a = {.ngpu = pr.ngpu, .victim = -1};
    tdm_shm_spawn_opts so = {.timeout_ms = 100000};
    for (int world = 2; world <= 3; world++)
        cr_assert_eq(tdm_shm_spawn(world, cu_nccl_rank, &a, &so, NULL), TDM_STATUS_OK,
                     "%d ranks on %d GPU(s): %s", world, pr.ngpu, tdm_error_message());
}

Test(cuda_emu, ranks_every_collective_on_one_emulated_device, .timeout = 60)
{
    CU_NEED_BACKEND();
    cu_ranks_arg a = {.ngpu = 0, .victim = -1};
    for (int world = 2; world <= 3; world++)
        TU_OK(tdm_shm_spawn(world, cu_nccl_rank, &a, NULL, NULL));
}

/* A rank SIGKILLed between two collectives: the others, blocked in the
 * second (in NCCL kernels waiting for it on a GPU), must be stopped by
 * their watchdog (the shm group's liveness, polled through abort_check,
 * or NCCL's own error) and fail on their own, well before the NCCL
 * deadline, with a reason; the spawn names the dead rank. */
static int cu_kill_rank(tdm_comm *boot, void *arg)
{
    const cu_ranks_arg *a = arg;
    int rank = tdm_comm_rank(boot);
    tdm_device *d = NULL;
    tdm_comm *c = NULL;
    float *buf = NULL;
    RK_OK(cu_rank_setup(boot, a, 120000, &d, &c));
    RK_OK(tdm_dev_alloc_zero(d, 4096 * sizeof(float), (void **)&buf));
    RK_OK(tdm_comm_all_reduce(c, buf, buf, 4096, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM));
    if (rank == a->victim) raise(SIGKILL);
    tdm_status st = TDM_STATUS_OK;
    for (int i = 0; i < 100 && st == TDM_STATUS_OK; i++)
        st = tdm_comm_all_reduce(c, buf, buf, 4096, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
    a->sh->status[rank] = (int)st;
    snprintf(a->sh->msg[rank], sizeof a->sh->msg[rank], "%s", tdm_error_message());
    tdm_dev_free(d, buf);
    cu_rank_teardown(boot, d, c);
    return st == TDM_STATUS_OK ? 2 : 0;
}

static void cu_killed_rank_is_caught(int ngpu, int world)
{
    cu_ranks_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(sh, MAP_FAILED);
    memset(sh, 0, sizeof *sh);
    cu_ranks_arg a = {.ngpu = ngpu, .victim = 1, .sh = sh};
    /* grace: the survivors must stop by themselves, long before SIGTERM */
    tdm_shm_spawn_opts so = {.timeout_ms = 150000, .grace_ms = 60000};
    tdm_shm_spawn_result res;
    tdm_status st = tdm_shm_spawn(world, cu_kill_rank, &a, &so, &res);
    cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%d ranks: %s: %s", world, tdm_status_name(st),
                 tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "rank 1") && strstr(tdm_error_message(), "signal 9"),
              "the dead rank is not named: %s", tdm_error_message());
    for (int r = 0; r < world; r++) {
        if (r == a.victim) continue;
        cr_assert(WIFEXITED(res.wstatus[r]) && WEXITSTATUS(res.wstatus[r]) == 0,
                  "%d ranks: survivor %d did not stop on its own (wait status 0x%x)", world, r,
                  res.wstatus[r]);
        cr_assert(sh->status[r] != TDM_STATUS_OK && sh->status[r] != TDM_STATUS_TIMEOUT,
                  "%d ranks: survivor %d: %s: %s", world, r,
                  tdm_status_name((tdm_status)sh->status[r]), sh->msg[r]);
        cr_log_info("%d ranks, survivor %d: %s", world, r, sh->msg[r]);
    }
    munmap(sh, sizeof *sh);
}

Test(cuda_gpu, nccl_killed_rank_is_caught_by_the_watchdog, .timeout = 300)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    cu_killed_rank_is_caught(pr.ngpu, 2);
    cu_killed_rank_is_caught(pr.ngpu, 3);
}

Test(cuda_emu, killed_rank_is_caught_on_one_emulated_device, .timeout = 60)
{
    CU_NEED_BACKEND();
    cu_killed_rank_is_caught(0, 3);
}

#undef RK_OK

/* Needs two GPUs: NCCL refuses two ranks of one process on one GPU. */
Test(cuda_multi, nccl_group_broadcast_reduce)
{
    cu_probe pr;
    CU_NEED_GPUS(2, &pr);
    int ndev = pr.ngpu > 4 ? 4 : pr.ngpu;
    int devs[4];
    tdm_device *d[4];
    float *buf[4];
    const size_t n = 10007;
    float *h = tu_malloc(n * 4), *hr = tu_malloc(n * 4);
    for (int i = 0; i < ndev; i++) {
        devs[i] = i;
        TU_OK(tdm_device_open(&d[i], "cuda", i, 0));
        for (size_t j = 0; j < n; j++) h[j] = (float)((j + (size_t)i * 7) % 13);
        buf[i] = cu_up(d[i], h, n * 4);
    }
    tdm_cuda_nccl_group *g = NULL;
    TU_OK(tdm_cuda_nccl_group_init(&g, devs, ndev, NULL));
    /* reduce-add to 0, in place */
    TU_OK(tdm_cuda_nccl_group_reduce(g, (const void *const *)buf, buf[0], n, TDM_DTYPE_FLOAT32,
                                     TDM_REDOP_SUM, 0));
    TU_OK(tdm_dev_copy_to_host(d[0], hr, buf[0], n * 4));
    for (size_t j = 0; j < n; j++) {
        float want = 0;
        for (int i = 0; i < ndev; i++) want += (float)((j + (size_t)i * 7) % 13);
        cr_assert_eq(hr[j], want, "reduce [%zu]", j);
    }
    /* replicate from 0 */
    TU_OK(tdm_cuda_nccl_group_broadcast(g, (void *const *)buf, n, TDM_DTYPE_FLOAT32, 0));
    for (int i = 0; i < ndev; i++) {
        float *b = cu_down(d[i], buf[i], n * 4);
        cr_assert(!memcmp(b, hr, n * 4), "broadcast to cuda:%d differs", i);
        free(b);
    }
    /* all_reduce MAX on fresh, different data per GPU (after the broadcast
     * every buffer is equal, which a no-op would pass) */
    for (int i = 0; i < ndev; i++) {
        for (size_t j = 0; j < n; j++) h[j] = (float)((j * 5 + (size_t)i * 3) % 17);
        TU_OK(tdm_dev_copy_from_host(d[i], buf[i], h, n * 4));
    }
    TU_OK(tdm_cuda_nccl_group_all_reduce(g, (void *const *)buf, n, TDM_DTYPE_FLOAT32,
                                         TDM_REDOP_MAX));
    for (int i = 0; i < ndev; i++) {
        float *b = cu_down(d[i], buf[i], n * 4);
        for (size_t j = 0; j < n; j++) {
            float want = 0;
            for (int k = 0; k < ndev; k++) {
                float v = (float)((j * 5 + (size_t)k * 3) % 17);
                want = v > want ? v : want;
            }
            cr_assert_eq(b[j], want, "all_reduce max on cuda:%d [%zu]", i, j);
        }
        free(b);
    }
    tdm_cuda_nccl_group_free(g);
    for (int i = 0; i < ndev; i++) {
        tdm_dev_free(d[i], buf[i]);
        tdm_device_free(d[i]);
    }
    free(h);
    free(hr);
}

Test(cuda_gpu, cli_train)
{
    cu_probe pr;
    CU_NEED_GPUS(1, &pr);
    static cli_result r;
    cli_run(&r, (const char *const[]){"train", "--device", "cuda", "--data", "synthetic",
                                         "--epochs", "1", NULL});
    cr_assert_eq(r.code, 0, "exit %d:\n%s", r.code, r.out);
}
