/* cuda/cuda.h: the public face of the CUDA backend, in plain C types (no
 * CUDA, cuBLAS or NCCL header is needed to include it):
 * - devices: the backend registers itself with core/device.c when it is
 *   linked in, so tdm_device_open(&d, "cuda", i, 0) and
 *   tdm_device_list_parse("cuda:0,1") just work; the functions below are
 *   for tools (`tandem info`) and for code that wants to probe first;
 * - the NCCL communicator behind core/comm.h (DDP: one process per GPU),
 *   its unique id exchanged over an existing communicator (shm);
 * - an NCCL group over several GPUs of one process (DP: replicate =
 *   broadcast from the master's GPU, gradient reduce-add = reduce to it).
 *
 * Only present in builds with nvcc (GNUmakefile includes cuda/cuda.mk);
 * code outside cuda/ that calls these must be built only then, or include
 * cuda/cuda_weak.h instead (every function a weak reference, NULL without
 * the backend). Everything fails with
 * TDM_STATUS_NO_DEVICE and "no CUDA device: <CUDA's error string>; ..."
 * where there is no driver or no GPU. See docs/CUDA.md. */
#ifndef TDM_CUDA_CUDA_H
#define TDM_CUDA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- devices ----------------------------------------------------------------- */

/* Visible GPUs. Without a driver or a device: TDM_STATUS_NO_DEVICE, *n = 0,
 * message "no CUDA device: <cudaGetErrorString> (<cudaGetErrorName> from
 * cudaGetDeviceCount); use --device cpu:N". No GPU but a working driver is
 * TDM_STATUS_OK with *n = 0. */
tdm_status tdm_cuda_device_count(int *n);
/* TDM_STATUS_OK when cuda:<index> exists; NO_DEVICE with a message that
 * starts "no CUDA device: " otherwise. */
tdm_status tdm_cuda_device_check(int index);

/* A host device ("cuda-emu", kind TDM_DEVICE_HOST, host memory) whose
 * compute entries are the CUDA backend's: each kernel's functor, with its
 * flat-index decomposition, runs as a loop on the calling thread instead
 * of a grid on a GPU; gemm is the host backend's. For tests: it checks the
 * CUDA kernels' index arithmetic and the backend's entry points on any
 * machine. Needs no driver. Free with tdm_device_free. */
tdm_status tdm_cuda_emulator_open(tdm_device **out);
/* The same emulator, but of kind TDM_DEVICE_CUDA and named
 * "cuda-emu:<index>": the layers above take their accelerator paths with
 * it (DP's per-device replicate and staged reduce, DDP's input staging,
 * copy_to_host of losses, core's staged cross-device copies), while its
 * memory stays host memory, so a shm communicator can reduce in it. Never
 * part of an NCCL group: tdm_dev_group_init over emulator devices gives an
 * emulated group (broadcast and rank-order sum as host loops) so that DP's
 * group path runs; two emulator devices copy through the backend's
 * copy_peer entry (a memmove). For tests. */
tdm_status tdm_cuda_emulator_open_accel(tdm_device **out, int index);
/* 1 when d is an emulator device (either kind): its memory is host memory
 * and no NCCL communicator can use it. */
int tdm_cuda_device_is_emulator(const tdm_device *d);
/* Calls of an emulator device's alloc entry so far (its allocation
 * accounting); -1 for any other device. For tests that a training step
 * allocates nothing: on a GPU each cudaMalloc costs and each cudaFree
 * synchronises the whole device. */
int64_t tdm_cuda_emulator_allocs(const tdm_device *d);
/* An emulator device's asynchronous copies started and not yet finished
 * (tdm_dev_copy_async: the emulator copies at the finish); -1 for any
 * other device. For tests that a design leaves none behind. */
int64_t tdm_cuda_emulator_xfers(const tdm_device *d);
/* 1 when d is a GPU whose gemm runs in TF32 tensor-op math
 * (TANDEM_CUDA_TF32=1 when it was opened), 0 for full FP32 or any other
 * device. */
int tdm_cuda_device_tf32(const tdm_device *d);

/* The emulator for whole programs: with TANDEM_CUDA_EMULATOR=N (1..64) in
 * the environment, the backend reports N "GPUs" and opening "cuda", i
 * gives tdm_cuda_emulator_open_accel(i) (named cuda-emu:<i>) without
 * touching CUDA, so `tandem train|compare|bench --device cuda...` run
 * their CUDA code paths on the host (DDP then reduces over shm, as NCCL
 * cannot use host memory). A test and teaching aid, never a GPU result:
 * every device name says cuda-emu. Returns N, or 0 when unset; an invalid
 * value is reported once on stderr and treated as unset. */
int tdm_cuda_emulator_env(void);

/* Writes lines for `tandem info` into buf ("  <label padded to 15><value>\n"):
 * CUDA runtime and driver versions, NCCL and cuBLAS versions, then each
 * GPU (name, memory, compute capability, SMs, PCI id) and the peer-access
 * matrix. Without a device the versions are written, then the error line,
 * and the status is TDM_STATUS_NO_DEVICE. Truncates to len. */
tdm_status tdm_cuda_describe(char *buf, size_t len);

/* --- NCCL communicator (one rank per process) --------------------------------- */

typedef struct tdm_nccl_opts {
    /* Bound on every wait (communicator creation, each collective,
     * finalisation) in ms; past it the NCCL communicator is aborted and
     * the call returns TDM_STATUS_TIMEOUT. 0: $TANDEM_NCCL_TIMEOUT_MS, or
     * 300000 (5 minutes). */
    int64_t timeout_ms;
    /* 1: do not forward abort() to the bootstrap communicator. */
    int no_bootstrap_abort;
    /* Optional, polled by the watchdog on every check while a call waits
     * (keep it cheap: an atomic load). A non-NULL return is a reason to
     * stop: the NCCL communicator is aborted and the call fails with
     * TDM_STATUS_PEER_FAILED and that reason. DDP can pass a function that
     * reads the shm group's abort flag / liveness, so that a rank that
     * died mid-collective stops the others at once instead of at the
     * deadline. */
    const char *(*abort_check)(void *ctx);
    void *abort_ctx;
} tdm_nccl_opts;

/* Creates an NCCL communicator with bootstrap's ranks and size on GPU
 * cuda:<device_index> of this process. Collective over bootstrap: every
 * rank calls it. First the ranks all-gather whether their GPU is usable
 * (so a rank without one makes every rank fail at once, naming it, rather
 * than hang), then rank 0 makes the ncclUniqueId and broadcasts it over
 * bootstrap (no TCP rendezvous on one node), then each rank creates a
 * non-blocking NCCL communicator and waits for it with a deadline.
 *
 * bootstrap is borrowed and must outlive the result: abort() of the NCCL
 * communicator also aborts bootstrap so that the other ranks stop too.
 * Buffers passed to the collectives are device memory of that GPU (from
 * tdm_dev_alloc on a "cuda" device, or tdm_comm_alloc). Collectives are
 * ordered after the work already enqueued on the compute stream of the
 * tdm_device open on that GPU in this process, and complete (on the GPU)
 * before the call returns. opts may be NULL. */
tdm_status tdm_comm_init_nccl(tdm_comm **out, tdm_comm *bootstrap, int device_index);
tdm_status tdm_comm_init_nccl_opts(tdm_comm **out, tdm_comm *bootstrap, int device_index,
                                   const tdm_nccl_opts *opts);

/* --- NCCL group over several GPUs of one process (DataParallel) ------------- */

typedef struct tdm_cuda_nccl_group tdm_cuda_nccl_group;

/* One NCCL rank per GPU: rank i is cuda:<devices[i]>. The non-blocking
 * equivalent of ncclCommInitAll (ncclCommInitRankConfig per GPU inside one
 * ncclGroupStart/End), waited for with opts' deadline. opts may be NULL. */
tdm_status tdm_cuda_nccl_group_init(tdm_cuda_nccl_group **out, const int *devices, int ndev,
                                    const tdm_nccl_opts *opts);
/* NULL is a no-op. */
void tdm_cuda_nccl_group_free(tdm_cuda_nccl_group *g);
int tdm_cuda_nccl_group_size(const tdm_cuda_nccl_group *g);

/* bufs[i]: count elements on GPU i. After the call every bufs[i] holds
 * bufs[root]'s contents (DP's replicate: root = the master's rank). */
tdm_status tdm_cuda_nccl_group_broadcast(tdm_cuda_nccl_group *g, void *const *bufs, size_t count,
                                         tdm_dtype dtype, int root);
/* recvbuf (on GPU root) = op over i of sendbufs[i]; recvbuf may be
 * sendbufs[root] (in place). DP's gradient reduce-add: SUM to rank 0. */
tdm_status tdm_cuda_nccl_group_reduce(tdm_cuda_nccl_group *g, const void *const *sendbufs,
                                      void *recvbuf, size_t count, tdm_dtype dtype,
                                      tdm_redop op, int root);
/* In place: every bufs[i] = op over j of bufs[j]. */
tdm_status tdm_cuda_nccl_group_all_reduce(tdm_cuda_nccl_group *g, void *const *bufs,
                                          size_t count, tdm_dtype dtype, tdm_redop op);

#ifdef __cplusplus
}
#endif

#endif
