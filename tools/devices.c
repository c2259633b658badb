/* tools/devices.c: see tools/devices.h. */
#include "tools/devices.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/cuda_weak.h"

int tdm_tool_cuda_emulated(void)
{
    return tdm_cuda_emulator_env && tdm_device_cuda_linked() ? tdm_cuda_emulator_env() : 0;
}

void tdm_tool_print_emulated(FILE *f, const char *spec)
{
    int n = tdm_tool_cuda_emulated();
    if (n && spec && !strncmp(spec, "cuda", 4))
        fprintf(f, "  CUDA EMULATOR (TANDEM_CUDA_EMULATOR=%d): the cuda devices are emulated on "
                "the host (host memory, the CUDA kernels' code run as host loops, DDP reducing "
                "over the host communicator, not NCCL): not a GPU result\n", n);
}

int tdm_tool_device_is_gpu(const tdm_device *d)
{
    return d && tdm_dev_kind(d) == TDM_DEVICE_CUDA &&
           !(tdm_cuda_device_is_emulator && tdm_cuda_device_is_emulator(d));
}

int tdm_tool_device_tf32(const tdm_device *d)
{
    return tdm_cuda_device_tf32 && tdm_cuda_device_tf32(d);
}

tdm_status tdm_tool_parse_devices(tdm_device_list *dl, const char *spec, int forks)
{
    if (!forks || strncmp(spec, "cuda", 4) != 0 || tdm_tool_cuda_emulated())
        return tdm_device_list_parse(dl, spec);
    struct {
        tdm_status st;
        tdm_device_list dl;
        char msg[TDM_ERROR_MSG_MAX];
    } res;
    int fds[2];
    if (pipe(fds) != 0) return tdm_device_list_parse(dl, spec);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return tdm_device_list_parse(dl, spec);
    }
    if (pid == 0) {
        close(fds[0]);
        memset(&res, 0, sizeof res);
        res.st = tdm_device_list_parse(&res.dl, spec);
        snprintf(res.msg, sizeof res.msg, "%s", res.st ? tdm_error_message() : "");
        ssize_t w = write(fds[1], &res, sizeof res);
        _exit(w == (ssize_t)sizeof res ? 0 : 1);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t k;
    while (got < sizeof res && (k = read(fds[0], (char *)&res + got, sizeof res - got)) != 0) {
        if (k < 0) {
            if (errno == EINTR) continue;
            break;
        }
        got += (size_t)k;
    }
    close(fds[0]);
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {}
    if (got != sizeof res)
        return tdm_error_set(TDM_STATUS_SYSTEM, "checking --device '%s' in a child process "
                             "failed (wait status 0x%x)", spec, ws);
    *dl = res.dl;
    if (res.st) return tdm_error_set(res.st, "%s", res.msg);
    return TDM_STATUS_OK;
}

tdm_status tdm_tool_parse_one_device(tdm_device_list *dl, const char *spec)
{
    TDM_CHECK(tdm_device_list_parse(dl, spec));
    if (dl->kind == TDM_DEVICE_CUDA && !strcmp(spec, "cuda")) {
        dl->count = 1;
        dl->index[0] = 0;
    }
    return TDM_STATUS_OK;
}
