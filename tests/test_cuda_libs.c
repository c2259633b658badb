/* tests/test_cuda_libs.c: the CUDA libraries are loaded when a CUDA
 * device asks for them (cuda/cuda_libs.c), never at program start: a
 * host-only `tandem` process (--help, train on cpu devices, the emulator)
 * maps no libcudart, libcublas or libnccl; `tandem info` and a GPU do
 * (the control that shows the check can see them); --device cuda without
 * a GPU still fails with one "no CUDA device" line; a library that cannot
 * be loaded is named with the reason.
 *
 * How a short-lived process is caught alive: its stdout and stderr are a
 * pipe filled to the brim before it starts, and the test reads
 * /proc/<pid>/maps, then drains a little, then reads the maps again, until
 * the pipe closes. The child blocks in every write, the last one (stdio's
 * flush at exit) after everything it loaded, so the samples cover its
 * whole run. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/device.h"
#include "tests/cli_util.h"
#include "tests/cuda_test_util.h"

/* The libraries the check looks for (libcublas also matches libcublasLt). */
static const char *const cl_libs[] = {"libcudart", "libcublas", "libnccl"};
#define CL_NLIBS 3
#define CL_DRAIN_BYTES 256

typedef struct cl_run {
    int code;                  /* exit code, or 128 + signal */
    int mapped[CL_NLIBS];      /* seen in /proc/<pid>/maps at some sample */
    int samples;               /* maps read while the process was alive */
    char out[65536];           /* its output, without the filler */
} cl_run;

static void cl_sample(pid_t pid, cl_run *r)
{
    char path[64], line[4096];
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return;
    int lines = 0;
    while (fgets(line, sizeof line, f)) {
        lines++;
        for (int i = 0; i < CL_NLIBS; i++)
            if (strstr(line, cl_libs[i])) r->mapped[i] = 1;
    }
    fclose(f);
    if (lines) r->samples++;   /* a zombie's maps are empty */
}

/* Runs tandem with args (NULL-terminated) and `env` ("NAME=value" or
 * NULL) as described at the top. */
static void cl_run_tandem(cl_run *r, const char *env, const char *const *args)
{
    memset(r, 0, sizeof *r);
    int fds[2];
    cr_assert(pipe(fds) == 0);
    /* fill the pipe: every write of the child blocks until we read */
    cr_assert(fcntl(fds[1], F_SETFL, O_NONBLOCK) == 0);
    static const char fill[4096];
    size_t filler = 0;
    for (;;) {
        ssize_t k = write(fds[1], fill, sizeof fill);
        if (k > 0) { filler += (size_t)k; continue; }
        if (k < 0 && errno == EAGAIN) {
            /* a page may be partly free: fill it byte by byte */
            if (write(fds[1], fill, 1) == 1) { filler++; continue; }
            break;
        }
        cr_assert_fail("filling the pipe: %s", strerror(errno));
    }
    cr_assert(fcntl(fds[1], F_SETFL, 0) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        const char *argv[32];
        int n = 0;
        argv[n++] = cli_bin();
        for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
        argv[n] = NULL;
        if (env) putenv((char *)env);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        alarm(120);   /* bounds a hung child */
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t got = 0, len = 0;
    char buf[CL_DRAIN_BYTES];
    for (;;) {
        cl_sample(pid, r);
        ssize_t k = read(fds[0], buf, sizeof buf);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        for (ssize_t i = 0; i < k; i++, got++)
            if (got >= filler && len < sizeof r->out - 1) r->out[len++] = buf[i];
    }
    r->out[len] = '\0';
    close(fds[0]);
    int ws;
    cr_assert(waitpid(pid, &ws, 0) == pid);
    r->code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    cr_assert_gt(r->samples, 0, "the process was never seen alive");
}

#define CL_RUN(r, env, ...) cl_run_tandem((r), (env), (const char *const[]){__VA_ARGS__, NULL})

static void cl_expect_none(const cl_run *r, const char *what)
{
    for (int i = 0; i < CL_NLIBS; i++)
        cr_assert(!r->mapped[i], "%s mapped %s (%d samples of /proc/<pid>/maps); output:\n%s",
                  what, cl_libs[i], r->samples, r->out);
}

Test(cuda_libs, help_maps_no_cuda_library, .timeout = 60)
{
    static cl_run r;
    CL_RUN(&r, NULL, "--help");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "usage"), "%s", r.out);
    cl_expect_none(&r, "tandem --help");
}

Test(cuda_libs, host_training_maps_no_cuda_library, .timeout = 120)
{
    static cl_run r;
    CL_RUN(&r, NULL, "train", "--data", "synthetic", "--device", "cpu", "--epochs", "1",
           "--max-steps", "3", "--model", "mlp:784-32-10");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "train loss"), "%s", r.out);
    cl_expect_none(&r, "tandem train --device cpu");
    CL_RUN(&r, NULL, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
           "--epochs", "1", "--max-steps", "3", "--model", "mlp:784-32-10");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cl_expect_none(&r, "tandem train --mode ddp --device cpu:2");
}

/* The emulator's "GPUs" are host memory and host loops: no CUDA library
 * either, though the run goes through the CUDA backend's code. */
Test(cuda_libs, emulated_gpus_map_no_cuda_library, .timeout = 120)
{
    CU_NEED_BACKEND();
    static cl_run r;
    CL_RUN(&r, "TANDEM_CUDA_EMULATOR=1", "train", "--data", "synthetic", "--device", "cuda",
           "--epochs", "1", "--max-steps", "3", "--model", "mlp:784-32-10");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "EMULATOR"), "%s", r.out);
    cl_expect_none(&r, "tandem train on an emulated GPU");
}

/* The control: `tandem info` asks for the libraries' versions, so it
 * loads cuBLAS and NCCL, and the same sampling sees them. */
Test(cuda_libs, info_loads_cublas_and_nccl_and_says_from_where, .timeout = 60)
{
    CU_NEED_BACKEND();
    static cl_run r;
    CL_RUN(&r, NULL, "info");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(r.mapped[1] && r.mapped[2], "tandem info: libcublas %s, libnccl %s in its maps "
              "(%d samples); output:\n%s", r.mapped[1] ? "seen" : "not seen",
              r.mapped[2] ? "seen" : "not seen", r.samples, r.out);
    cr_assert(!r.mapped[0], "libcudart is linked statically, yet a libcudart was mapped:\n%s",
              r.out);
    cr_assert(strstr(r.out, "libnccl.so.2)"), "no NCCL path in:\n%s", r.out);
    cr_assert(strstr(r.out, "libcublas.so."), "no cuBLAS path in:\n%s", r.out);
}

Test(cuda_libs, a_library_that_cannot_be_loaded_is_named_with_the_reason, .timeout = 60)
{
    CU_NEED_BACKEND();
    static cl_run r;
    CL_RUN(&r, "TANDEM_NCCL_LIB=/nonexistent/libnccl.so.2", "info");
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "NCCL           not loaded: cannot load NCCL "
                            "(/nonexistent/libnccl.so.2 from TANDEM_NCCL_LIB): "),
              "%s", r.out);
    cr_assert(strstr(r.out, "No such file or directory"), "%s", r.out);
    cr_assert(!r.mapped[2], "%s", r.out);
    cr_assert(r.mapped[1], "cuBLAS should still load:\n%s", r.out);
    /* a file that is not a library */
    CL_RUN(&r, "TANDEM_CUBLAS_LIB=/etc/hostname", "info");
    cr_assert(strstr(r.out, "cuBLAS         not loaded: cannot load cuBLAS (/etc/hostname from "
                            "TANDEM_CUBLAS_LIB): "), "%s", r.out);
}

/* --device cuda: without a GPU, the one clear line, and nothing loaded
 * (counting fails first); with one, cuBLAS is loaded for it. */
Test(cuda_libs, cuda_device_fails_clearly_without_a_gpu_and_loads_cublas_with_one,
     .timeout = 120)
{
    CU_NEED_BACKEND();
    char why[512];
    int ngpu = cu_gpu_count(why, sizeof why);
    static cl_run r;
    CL_RUN(&r, NULL, "train", "--data", "synthetic", "--device", "cuda", "--epochs", "1",
           "--max-steps", "3", "--model", "mlp:784-32-10");
    if (ngpu == 0) {
        cr_assert_eq(r.code, 1, "%s", r.out);
        cr_assert(strstr(r.out, "tandem train: --device: no CUDA device: "), "%s", r.out);
        cr_assert(strchr(r.out, '\n') == r.out + strlen(r.out) - 1, "not one line:\n%s", r.out);
        cl_expect_none(&r, "tandem train --device cuda without a GPU");
    } else {
        cr_assert_eq(r.code, 0, "%s", r.out);
        cr_assert(r.mapped[1], "trained on a GPU without mapping libcublas?\n%s", r.out);
    }
}
