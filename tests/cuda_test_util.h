/* tests/cuda_test_util.h: what the CUDA test files share: no emulator
 * unless a test asks for it, skipping without the backend, and counting
 * the GPUs in a child process (so that CUDA stays uninitialised in the
 * test process, which may fork ranks that use it). */
#ifndef TDM_TESTS_CUDA_TEST_UTIL_H
#define TDM_TESTS_CUDA_TEST_UTIL_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/device.h"

/* The GPU tests need real GPUs and the no-device tests no GPU: an exported
 * TANDEM_CUDA_EMULATOR would turn "cuda" into emulated devices for both.
 * Cleared before any test forks; tests that want the emulator set it. */
__attribute__((constructor)) static void cu_no_emulator_by_default(void)
{
    unsetenv("TANDEM_CUDA_EMULATOR");
}

/* Skips the test when cuda/ is not linked in (no nvcc at build time). */
#define CU_NEED_BACKEND()                                                                 \
    do {                                                                                  \
        if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");  \
    } while (0)

/* Visible GPUs, counted in a child: CUDA must not be initialised in this
 * process before it forks ranks that use CUDA. why: the error when 0. */
static inline int cu_gpu_count(char *why, size_t len)
{
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        char buf[512] = "no CUDA device: CUDA backend not built (no nvcc)";
        int n = 0;
        if (tdm_device_cuda_linked()) {
            tdm_status st = tdm_device_cuda_count(&n);
            snprintf(buf, sizeof buf, "%s", st ? tdm_error_message()
                                               : "no CUDA device: none visible");
            if (st) n = 0;
        }
        ssize_t w = write(fds[1], &n, sizeof n);
        w += write(fds[1], buf, sizeof buf);
        _exit(w == (ssize_t)(sizeof n + sizeof buf) ? 0 : 1);
    }
    close(fds[1]);
    int n = 0;
    char buf[512] = "";
    cr_assert(read(fds[0], &n, sizeof n) == (ssize_t)sizeof n);
    size_t got = 0;
    ssize_t k;
    while (got < sizeof buf && (k = read(fds[0], buf + got, sizeof buf - got)) > 0)
        got += (size_t)k;
    close(fds[0]);
    int ws;
    cr_assert(waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    buf[sizeof buf - 1] = '\0';
    snprintf(why, len, "%s", buf);
    return n;
}

/* The GPU of rank `rank` of `world` when only ngpu GPUs exist: rank %
 * ngpu, so that the multi-rank tests run on a one-GPU machine. Call it in
 * the rank, before its first NCCL call: ranks that share a GPU must look
 * like different hosts to NCCL, which refuses two ranks of a
 * communicator on one GPU of one host ("Duplicate GPU detected"), so each
 * gets its own NCCL_HOSTID and they talk over loopback sockets
 * (NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1). */
static inline int cu_rank_gpu(int rank, int world, int ngpu)
{
    if (ngpu < 1) ngpu = 1;
    if (world > ngpu) {
        char id[64];
        snprintf(id, sizeof id, "tandem-test-rank-%d", rank);
        setenv("NCCL_HOSTID", id, 1);
        setenv("NCCL_SOCKET_IFNAME", "lo", 1);
        setenv("NCCL_IB_DISABLE", "1", 1);
    }
    return rank % ngpu;
}

#define NEED_GPUS(k)                                                                      \
    do {                                                                                  \
        char why_[512];                                                                   \
        int n_ = cu_gpu_count(why_, sizeof why_);                                            \
        if (n_ == 0) cr_skip_test("%s", why_);                                            \
        if (n_ < (k)) cr_skip_test("needs %d CUDA devices, %d visible", (k), n_);         \
    } while (0)


#endif
