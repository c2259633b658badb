/* tests/test_cuda_emucheck.c: the CUDA emulator's pointer ownership checks
 * (cuda/emu_impl.h): what a GPU faults on (a host pointer given to a
 * kernel or cuBLAS, a device pointer on the host side of a copy, cuda:0's
 * memory used on cuda:1, a range past an allocation's end, a use after
 * free, a double free) fails on an emulated GPU with one line naming the
 * call, the pointer, its size and what it is, returned through the usual
 * status paths; what is legal goes through untouched.
 *
 * Compiled in every build: the cuda/ functions are weak references and
 * every test skips without the backend. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_weak.h"
#include "cuda/emu_impl.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

#pragma weak tdm_cuda_emu_check_memcpy
#pragma weak tdm_cuda_emu_ops_mismatch
#pragma weak tdm_cuda_emu_mem_quarantined
#pragma weak tdm_cuda_emu_mem_live

static tdm_device *emu(int index)
{
    tdm_device *d = NULL;
    TU_OK(tdm_cuda_emulator_open_accel(&d, index));
    return d;
}

static float *dalloc(tdm_device *d, size_t n_elem)
{
    void *p = NULL;
    TU_OK(tdm_dev_alloc(d, n_elem * sizeof(float), &p));
    TU_OK(tdm_dev_memset_zero(d, p, n_elem * sizeof(float)));
    return p;
}

/* st is the emulator's fault (TDM_STATUS_SYSTEM) and its message has
 * every one of the NULL-terminated parts. */
static void expect_fault(tdm_status st, ...)
{
    cr_assert_eq(st, TDM_STATUS_SYSTEM, "status %d (%s)", st, tdm_error_message());
    const char *msg = tdm_error_message();
    cr_assert(!strchr(msg, '\n'), "one line: %s", msg);
    va_list ap;
    va_start(ap, st);
    for (const char *part; (part = va_arg(ap, const char *));)
        cr_assert(strstr(msg, part), "'%s' not in: %s", part, msg);
    va_end(ap);
}

Test(emucheck, the_emulators_table_has_every_entry_of_the_gpus)
{
    CU_NEED_BACKEND();
    cr_assert_eq(tdm_cuda_emu_ops_mismatch(), 0);
}

Test(emucheck, a_kernel_given_host_memory_fails_like_an_illegal_address)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0);
    float *x = dalloc(d, 64);
    float host[64] = {0};
    char ptr[32];
    snprintf(ptr, sizeof ptr, "%p", (void *)host);
    expect_fault(tdm_dev_axpy(d, 64, 1.0f, x, host), "cuda-emu:0: axpy kernel: y = ", ptr,
                 "(256 bytes) is host memory, not memory of cuda-emu:0",
                 "cudaErrorIllegalAddress", NULL);
    expect_fault(tdm_dev_axpy(d, 64, 1.0f, host, x), "axpy kernel: x = ", NULL);
    /* cuBLAS's operands too, and a mixed-precision gemm's 16-bit ones */
    expect_fault(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, 8, 8, 8, 1.0f, x, 8, x, 8, 0.0f,
                              host, 8),
                 "cublasSgemm: C = ", "is host memory", NULL);
    uint16_t h16[64] = {0};
    expect_fault(tdm_dev_gemm_ex(d, TDM_TRANS_N, TDM_TRANS_N, 8, 8, 8, 1.0f, h16, 8, x, 8, 0.0f,
                                 x, 8, TDM_DTYPE_BFLOAT16),
                 "cublasGemmEx: A = ", "(128 bytes) is host memory", NULL);
    /* the legal calls still run and compute */
    TU_OK(tdm_dev_scale(d, 64, 2.0f, x));
    TU_OK(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, 8, 8, 8, 1.0f, x, 8, x, 8, 0.0f, x, 8));
    tdm_dev_free(d, x);
    tdm_device_free(d);
}

Test(emucheck, memory_of_one_gpu_used_on_another_fails)
{
    CU_NEED_BACKEND();
    tdm_device *d0 = emu(0), *d1 = emu(1), *d0b = emu(0);
    float *x0 = dalloc(d0, 16), *x1 = dalloc(d1, 16);
    expect_fault(tdm_dev_axpy(d1, 16, 1.0f, x0, x1),
                 "cuda-emu:1: axpy kernel: x = ", "is memory of cuda-emu:0, not memory of cuda-emu:1",
                 NULL);
    expect_fault(tdm_dev_memset_zero(d1, x0, 64), "cudaMemsetAsync: p = ", NULL);
    /* a second handle on the same GPU shares its memory, as on a GPU */
    TU_OK(tdm_dev_axpy(d0b, 16, 1.0f, x0, x0));
    /* a peer copy names each side's device; swapped devices fail */
    TU_OK(tdm_dev_copy_between(d1, x1, d0, x0, 64));
    expect_fault(tdm_dev_copy_between(d0, x1, d1, x0, 64),
                 "cudaMemcpyPeerAsync (cuda-emu:1 -> cuda-emu:0): dst = ",
                 "is memory of cuda-emu:1, not memory of cuda-emu:0", NULL);
    /* a D2D copy on one GPU takes only that GPU's memory */
    expect_fault(tdm_dev_copy(d0, x0, x1, 64), "cudaMemcpyAsync (device to device): src = ",
                 NULL);
    tdm_dev_free(d0, x0);
    tdm_dev_free(d1, x1);
    tdm_device_free(d0b);
    tdm_device_free(d1);
    tdm_device_free(d0);
}

Test(emucheck, a_range_past_an_allocations_end_fails)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0);
    float *x = dalloc(d, 10);
    expect_fault(tdm_dev_scale(d, 11, 2.0f, x), "scale kernel: x = ", "(44 bytes)",
                 "runs 4 bytes past the end of a 40-byte block of cuda-emu:0", NULL);
    /* a view inside the block is fine; one that leaves it is not */
    TU_OK(tdm_dev_scale(d, 5, 2.0f, x + 5));
    expect_fault(tdm_dev_scale(d, 6, 2.0f, x + 5), "runs 4 bytes past the end", NULL);
    /* gemm's extents follow its leading dimensions: C is ldc x n */
    float *a = dalloc(d, 16);
    TU_OK(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, 4, 4, 4, 1.0f, a, 4, a, 4, 0.0f, a, 4));
    expect_fault(tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, 4, 4, 4, 1.0f, a, 4, a, 4, 0.0f, a, 5),
                 "cublasSgemm: C = ", "(76 bytes)", NULL);
    expect_fault(tdm_dev_gemm(d, TDM_TRANS_T, TDM_TRANS_N, 4, 4, 5, 1.0f, a, 5, a, 5, 0.0f, a, 4),
                 "cublasSgemm: A = ", NULL);
    tdm_dev_free(d, a);
    tdm_dev_free(d, x);
    tdm_device_free(d);
}

Test(emucheck, copies_check_each_side_by_their_kind)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0);
    float *x = dalloc(d, 8), *y = dalloc(d, 8);
    float host[8] = {1, 2, 3, 4, 5, 6, 7, 8}, back[8] = {0};
    TU_OK(tdm_dev_copy_from_host(d, x, host, sizeof host));
    TU_OK(tdm_dev_copy(d, y, x, sizeof host));
    TU_OK(tdm_dev_copy_to_host(d, back, y, sizeof back));
    cr_assert_arr_eq(back, host, sizeof host);
    /* each direction with its sides swapped or mixed */
    expect_fault(tdm_dev_copy_to_host(d, y, x, 32), "cudaMemcpyAsync (device to host): dst = ",
                 "is memory of cuda-emu:0, not host memory", NULL);
    expect_fault(tdm_dev_copy_to_host(d, back, host, 32),
                 "cudaMemcpyAsync (device to host): src = ", "is host memory", NULL);
    expect_fault(tdm_dev_copy_from_host(d, host, back, 32),
                 "cudaMemcpyAsync (host to device): dst = ", "is host memory", NULL);
    expect_fault(tdm_dev_copy_from_host(d, y, x, 32),
                 "cudaMemcpyAsync (host to device): src = ", "not host memory", NULL);
    expect_fault(tdm_dev_copy(d, y, host, 32), "cudaMemcpyAsync (device to device): src = ",
                 "is host memory", NULL);
    /* a host device's copy from an emulated GPU is that GPU's D2H */
    tdm_device *cpu = NULL;
    TU_OK(tdm_device_open(&cpu, "cpu", 0, 1));
    TU_OK(tdm_dev_copy_between(cpu, back, d, x, 32));
    expect_fault(tdm_dev_copy_between(cpu, y, d, x, 32), "(device to host): dst = ", NULL);
    tdm_device_free(cpu);
    tdm_dev_free(d, x);
    tdm_dev_free(d, y);
    tdm_device_free(d);
}

Test(emucheck, cudaMemcpyDefault_infers_each_side_from_the_pointer)
{
    CU_NEED_BACKEND();
    tdm_device *d0 = emu(0), *d1 = emu(1);
    float *x0 = dalloc(d0, 8), *x1 = dalloc(d1, 8);
    float host[8], host2[8];
    struct {
        void *dst;
        const void *src;
        tdm_cuda_emu_copy_kind want;
    } cases[] = {
        {host, host2, TDM_CUDA_EMU_H2H},
        {x0, host, TDM_CUDA_EMU_H2D},
        {host, x1, TDM_CUDA_EMU_D2H},
        {x0, x1, TDM_CUDA_EMU_D2D}, /* unified addressing: any GPU's memory */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tdm_cuda_emu_copy_kind got = TDM_CUDA_EMU_DEFAULT;
        TU_OK(tdm_cuda_emu_check_memcpy(d1, "cudaMemcpy", cases[i].dst, cases[i].src, 32,
                                        TDM_CUDA_EMU_DEFAULT, &got));
        cr_assert_eq(got, cases[i].want, "case %zu: kind %d, expected %d", i, got,
                     cases[i].want);
    }
    /* what no kind makes legal: past the end, freed */
    expect_fault(tdm_cuda_emu_check_memcpy(d1, "cudaMemcpy", host, x0, 36,
                                           TDM_CUDA_EMU_DEFAULT, NULL),
                 "cudaMemcpy (default): src = ", "runs 4 bytes past the end", NULL);
    tdm_dev_free(d1, x1);
    expect_fault(tdm_cuda_emu_check_memcpy(d0, "cudaMemcpy", x1, host, 32,
                                           TDM_CUDA_EMU_DEFAULT, NULL),
                 "use after free", NULL);
    tdm_dev_free(d0, x0);
    tdm_device_free(d1);
    tdm_device_free(d0);
}

Test(emucheck, use_after_free_is_named_and_freed_memory_is_poisoned)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0);
    float *x = dalloc(d, 32), *y = dalloc(d, 32);
    tdm_dev_free(d, x);
    expect_fault(tdm_dev_axpy(d, 32, 1.0f, x, y), "axpy kernel: x = ",
                 "is inside a 128-byte block of cuda-emu:0", "that was freed (use after free)",
                 NULL);
    expect_fault(tdm_dev_copy_to_host(d, (float[32]){0}, x + 4, 16), "use after free", NULL);
    /* host code that reads it anyway gets NaN, not the old values */
    uint32_t bits;
    memcpy(&bits, &x[3], sizeof bits);
    cr_assert_eq(bits, 0xffffffffu);
    /* the device stays usable: a use after free fails that call only */
    TU_OK(tdm_dev_scale(d, 32, 2.0f, y));
    tdm_dev_free(d, y);
    tdm_device_free(d);
}

Test(emucheck, a_double_free_is_reported_and_sticks_to_the_device, .init = cr_redirect_stderr)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0), *other = emu(1);
    float *x = dalloc(d, 8), *y = dalloc(d, 8), *z = dalloc(other, 8);
    tdm_dev_free(d, x);
    tdm_dev_free(d, x); /* no crash: the block is left alone */
    char want[160];
    snprintf(want, sizeof want, "cudaFree(%p): double free of a 32-byte block of cuda-emu:0",
             (void *)x);
    /* every later call on the device fails with it, as a sticky error */
    expect_fault(tdm_dev_scale(d, 8, 1.0f, y), want, "an earlier fault on this device", NULL);
    expect_fault(tdm_dev_sync(d), want, NULL);
    /* other devices go on */
    TU_OK(tdm_dev_scale(other, 8, 1.0f, z));
    fflush(stderr);
    cr_assert_stderr_neq_str("");
    tdm_dev_free(other, z);
    tdm_dev_free(d, y);
    tdm_device_free(other);
    tdm_device_free(d);
}

Test(emucheck, freeing_what_the_device_did_not_allocate_is_reported, .init = cr_redirect_stderr)
{
    CU_NEED_BACKEND();
    struct {
        const char *what;
        int kind; /* 0 host, 1 middle of a block, 2 another GPU's block */
    } cases[] = {{"not an allocation of any emulated GPU", 0},
                 {"4 bytes into a 32-byte block of cuda-emu:0", 1},
                 {"a 32-byte block of cuda-emu:1, freed through cuda-emu:0", 2}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tdm_device *d = emu(0), *other = emu(1);
        float *x = dalloc(d, 8), *z = dalloc(other, 8);
        float *host = malloc(32);
        cr_assert(host);
        float *bad = cases[i].kind == 0 ? host : cases[i].kind == 1 ? x + 1 : z;
        tdm_dev_free(d, bad);
        expect_fault(tdm_dev_sync(d), cases[i].what, NULL);
        free(host);
        tdm_dev_free(other, z); /* still live: the bad free left it alone */
        TU_OK(tdm_dev_sync(other));
        tdm_dev_free(d, x);
        tdm_device_free(other);
        tdm_device_free(d);
    }
}

Test(emucheck, the_quarantine_is_bounded)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0);
    size_t live0 = tdm_cuda_emu_mem_live();
    for (int i = 0; i < 600; i++) {
        float *x = dalloc(d, 4);
        tdm_dev_free(d, x);
        cr_assert_leq(tdm_cuda_emu_mem_quarantined(), 256);
    }
    cr_assert_eq(tdm_cuda_emu_mem_live(), live0);
    tdm_dev_mem_stats ms;
    TU_OK(tdm_dev_mem_query(d, &ms));
    cr_assert_eq(ms.live_bytes, 0, "freed blocks are off the count at once: %zu",
                 ms.live_bytes);
    tdm_device_free(d);
}

Test(emucheck, adopted_memory_is_the_devices_until_disowned)
{
    CU_NEED_BACKEND();
    tdm_device *d = emu(0);
    float *comm_mem = calloc(16, sizeof(float)); /* a communicator's tdm_comm_alloc */
    cr_assert(comm_mem);
    expect_fault(tdm_dev_scale(d, 16, 2.0f, comm_mem), "is host memory", NULL);
    TU_OK(tdm_dev_mem_adopt(d, comm_mem, 16 * sizeof(float)));
    TU_OK(tdm_dev_scale(d, 16, 2.0f, comm_mem));
    tdm_dev_mem_disown(d, comm_mem);
    expect_fault(tdm_dev_scale(d, 16, 2.0f, comm_mem), "is host memory", NULL);
    free(comm_mem);
    tdm_device_free(d);
}

Test(emucheck, the_emulated_group_takes_each_ranks_own_memory)
{
    CU_NEED_BACKEND();
    tdm_device *devs[2] = {emu(0), emu(1)};
    tdm_dev_group *g = NULL;
    TU_OK(tdm_dev_group_init(&g, devs, 2));
    float *b0 = dalloc(devs[0], 8), *b1 = dalloc(devs[1], 8);
    TU_OK(tdm_dev_group_broadcast(g, (float *[]){b0, b1}, 8, 0));
    TU_OK(tdm_dev_group_reduce_sum(g, (const float *[]){b0, b1}, b0, 8, 0));
    expect_fault(tdm_dev_group_broadcast(g, (float *[]){b0, b0}, 8, 0),
                 "cuda-emu:1: ncclBroadcast (emulated group): buf (rank 1) = ",
                 "is memory of cuda-emu:0", NULL);
    expect_fault(tdm_dev_group_reduce_sum(g, (const float *[]){b0, b1}, b1, 8, 0),
                 "ncclReduce (emulated group): recvbuf (rank 0) = ", NULL);
    tdm_dev_group_free(g);
    tdm_dev_free(devs[0], b0);
    tdm_dev_free(devs[1], b1);
    tdm_device_free(devs[1]);
    tdm_device_free(devs[0]);
}

Test(emucheck, the_host_kind_emulator_takes_host_memory)
{
    CU_NEED_BACKEND();
    tdm_device *d = NULL;
    TU_OK(tdm_cuda_emulator_open(&d));
    float host[16] = {1};
    TU_OK(tdm_dev_scale(d, 16, 2.0f, host));
    cr_assert_eq(host[0], 2.0f);
    tdm_device_free(d);
}
