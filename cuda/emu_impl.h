/* cuda/emu_impl.h: the CUDA emulator's pointer ownership checks
 * (cuda/emu_mem.c): a table of every emulated device allocation (base,
 * size, device index, live or freed) and the checks that every entry of
 * an emulated GPU runs on the pointers it is given, so that a host
 * pointer handed to a kernel, a device pointer handed to the host side of
 * a copy, memory of cuda:0 used on cuda:1, a range past an allocation's
 * end, a use after free or a double free fails on the emulator as it
 * would on a GPU (cudaErrorIllegalAddress, cudaErrorInvalidValue) instead
 * of silently working on host memory. Plain C types only; internal to
 * cuda/ (and to tests, which check the checks). Not the emulator's entries
 * themselves (cuda/emulator.c, cuda/emu_check.c). */
#ifndef TDM_CUDA_EMU_IMPL_H
#define TDM_CUDA_EMU_IMPL_H

#include <stddef.h>

#include "core/device_impl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A copy's direction, cudaMemcpyKind's values; DEFAULT is
 * cudaMemcpyDefault, which infers each side from the pointer (unified
 * addressing). */
typedef enum tdm_cuda_emu_copy_kind {
    TDM_CUDA_EMU_H2H = 0,
    TDM_CUDA_EMU_H2D = 1,
    TDM_CUDA_EMU_D2H = 2,
    TDM_CUDA_EMU_D2D = 3,
    TDM_CUDA_EMU_DEFAULT = 4,
} tdm_cuda_emu_copy_kind;

/* One pointer argument of a call: its name in the message, and the bytes
 * the call reads or writes from it (0, or p NULL: not used, not checked). */
typedef struct tdm_cuda_emu_arg {
    const char *name;
    const void *p;
    size_t nbytes;
} tdm_cuda_emu_arg;

/* Registers [p, p + nbytes) as a live allocation of d's GPU (d->index). */
tdm_status tdm_cuda_emu_mem_add(const tdm_device *d, void *p, size_t nbytes);
/* Takes [p, p + nbytes), registered by tdm_cuda_emu_mem_add (the
 * emulator's mem_adopt of memory it did not allocate), off the table
 * without freeing it. Anything else: TDM_STATUS_SYSTEM, one line. */
tdm_status tdm_cuda_emu_mem_disown(tdm_device *d, void *p);
/* Frees an allocation of d (tdm_device_host_mem_alloc'd by d): its range
 * is poisoned (every byte 0xff, a NaN for floats) and kept, quarantined,
 * so that a later use is reported as a use after free; the oldest
 * quarantined blocks go back to malloc past TDM_CUDA_EMU_QUARANTINE_*.
 * A pointer that is not the base of a live allocation of d's GPU (a double
 * free, host memory, another GPU's memory, the middle of a block) is left
 * alone and reported: TDM_STATUS_SYSTEM, one line. */
tdm_status tdm_cuda_emu_mem_free(tdm_device *d, void *p);

/* Each args[i] must lie wholly inside one live allocation of d's GPU: what
 * a kernel, a cuBLAS call or a collective on d may touch. Returns
 * TDM_STATUS_OK at once for a host-kind emulator (tdm_cuda_emulator_open:
 * its memory is host memory by contract), and d's sticky fault, if any,
 * first. call: the entry's name, for the message. */
tdm_status tdm_cuda_emu_check_args(tdm_device *d, const char *call,
                                   const tdm_cuda_emu_arg *args, int n_args);
#define TDM_CUDA_EMU_CHECK(d, call, ...)                                                  \
    do {                                                                                  \
        const tdm_cuda_emu_arg tdm_emu_a_[] = {__VA_ARGS__};                              \
        TDM_CHECK(tdm_cuda_emu_check_args((d), (call), tdm_emu_a_,                        \
                                          (int)(sizeof tdm_emu_a_ / sizeof tdm_emu_a_[0]))); \
    } while (0)

/* A copy of nbytes issued on d: kind says which side is device memory (of
 * d's GPU for H2D, D2H and D2D on d; for D2D between two GPUs use
 * tdm_cuda_emu_check_peer) and which is host memory (not inside any
 * emulated allocation, live or quarantined). DEFAULT takes each side for
 * what it is (any GPU's live allocation, or host memory), as
 * cudaMemcpyDefault does, and fails only where a side is freed memory or
 * straddles an allocation's end. *inferred (may be NULL) receives the
 * kind the pointers say. */
tdm_status tdm_cuda_emu_check_memcpy(tdm_device *d, const char *call, void *dst,
                                     const void *src, size_t nbytes,
                                     tdm_cuda_emu_copy_kind kind,
                                     tdm_cuda_emu_copy_kind *inferred);
/* dst (dst_dev's GPU) = src (src_dev's GPU). */
tdm_status tdm_cuda_emu_check_peer(tdm_device *dst_dev, void *dst, tdm_device *src_dev,
                                   const void *src, size_t nbytes);

/* d's sticky fault (a bad free: it has no caller to fail to): once set,
 * every later checked call on d returns it, as a GPU context's sticky
 * error does. TDM_STATUS_OK when none. */
tdm_status tdm_cuda_emu_sticky(tdm_device *d);
/* Forgets d's sticky fault (emulator close). */
void tdm_cuda_emu_sticky_clear(tdm_device *d);

/* Compute slots of the device interface (gemm and after) the GPU's table
 * fills and the emulator's does not, or the reverse (0 when they agree). */
int tdm_cuda_emu_ops_mismatch(void);

/* Live allocations in the table, and quarantined (freed, kept) blocks. */
size_t tdm_cuda_emu_mem_live(void);
size_t tdm_cuda_emu_mem_quarantined(void);

#ifdef __cplusplus
}
#endif

#endif
