/* tools/devices.c: see tools/devices.h. */
#include "tools/devices.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/cuda.h"
#include "ddp/pg.h"
#include "ddp/spawn.h"
#include "shm/shm_comm.h"

/* cuda/cuda.h declares plain C types only; its functions are weak here:
 * NULL in builds without the CUDA backend. */
__attribute__((weak)) tdm_status tdm_comm_init_nccl_opts(tdm_comm **out, tdm_comm *bootstrap,
                                                         int device_index,
                                                         const tdm_nccl_opts *opts);
__attribute__((weak)) int tdm_cuda_emulator_env(void);
__attribute__((weak)) int tdm_cuda_device_is_emulator(const tdm_device *d);
__attribute__((weak)) int tdm_cuda_device_tf32(const tdm_device *d);

int tdm_tool_cuda_emulated(void)
{
    return tdm_cuda_emulator_env && tdm_device_cuda ? tdm_cuda_emulator_env() : 0;
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
    return d && d->kind == TDM_DEVICE_CUDA &&
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

static const char *tdm_tool_shm_aborted(void *ctx) { return tdm_shm_comm_abort_reason(ctx); }

tdm_status tdm_tool_rank_nccl(tdm_comm *shm, tdm_device *dev, tdm_comm **nccl)
{
    *nccl = NULL;
    if (!tdm_tool_device_is_gpu(dev)) return TDM_STATUS_OK;
    if (!tdm_comm_init_nccl_opts)
        return tdm_error_set(TDM_STATUS_NO_DEVICE, "no CUDA device: this build of tandem has "
                             "no CUDA backend; use --device cpu:N");
    /* Collective over shm; a rank that failed before it aborts shm, so
     * the others' bootstrap fails at once. */
    tdm_nccl_opts no = {.abort_check = tdm_tool_shm_aborted, .abort_ctx = shm};
    /* the process group's timeout (TANDEM_TIMEOUT, which tandem launch and
     * train --timeout set) bounds NCCL's waits too, unless the NCCL-only
     * TANDEM_NCCL_TIMEOUT_MS says otherwise */
    if (!getenv("TANDEM_NCCL_TIMEOUT_MS")) TDM_CHECK(tdm_ddp_timeout_from_env(&no.timeout_ms));
    return tdm_comm_init_nccl_opts(nccl, shm, dev->index, &no);
}

tdm_status tdm_tool_rank_device(const tdm_device_list *dl, int rank, tdm_device **dev)
{
    return tdm_device_open(dev, dl->kind == TDM_DEVICE_CUDA ? "cuda" : "cpu",
                           dl->index[dl->count == 1 ? 0 : rank], 1);
}

tdm_status tdm_tool_rank_ddp(tdm_comm *shm, tdm_device *dev, tdm_model *m,
                             const tdm_ddp_opts *opts, tdm_comm **nccl, tdm_ddp **ddp)
{
    *ddp = NULL;
    TDM_CHECK(tdm_tool_rank_nccl(shm, dev, nccl));
    tdm_ddp_opts o = opts ? *opts : (tdm_ddp_opts){0};
    o.host_comm = *nccl ? shm : NULL;
    return tdm_ddp_init(ddp, m, *nccl ? *nccl : shm, &o);
}

size_t tdm_tool_ddp_arena_bytes(const tdm_device_list *dl, int64_t param_elems)
{
    if (dl->kind == TDM_DEVICE_CUDA && !tdm_tool_cuda_emulated()) return 0;
    return tdm_ddp_arena_bytes(param_elems);
}
