/* cuda/device_copy.c: a GPU's copy stream (tdm_dev_copy_async,
 * core/device.h): host<->device copies issued on a second stream of the
 * device, made at the first copy, so that they run beside the compute
 * stream's kernels instead of between them, with events to order them:
 * - a copy waits for an event recorded on the compute stream when it is
 *   issued (its destination may be a block that earlier work still reads
 *   or writes), then records an event of its own, the handle;
 * - finishing the handle: TDM_DEV_XFER_HOST synchronises that event (the
 *   host buffers are the caller's again), TDM_DEV_XFER_DEVICE makes the
 *   compute stream wait for it, TDM_DEV_XFER_COMM does nothing more:
 *   every collective the NCCL communicator issues is ordered after the
 *   copy stream as well as the compute stream (device_cuda.c's
 *   tdm_cuda_order_after_compute), so that a gather of a copied shard
 *   needs no compute-stream wait.
 * Asynchronous for pinned host memory (tdm_dev_host_pin); pageable memory
 * is staged by the driver. Every CUDA return code is checked. Built, not
 * run on a GPU: the emulator (cuda/emulator.c) models the same ordering
 * (copies happen at the finish), and the tests run through it. */
#include "cuda/device_cuda_impl.h"

#include "core/log.h"

static tdm_status tdm_cuda_copy_stream(tdm_device *d, cudaStream_t *out)
{
    tdm_cuda_dev *c = tdm_cuda_impl(d);
    if (!c->copy_stream) {
        cudaStream_t s = NULL;
        cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        if (e != cudaSuccess)
            return tdm_cuda_fail(d->name, "cudaStreamCreateWithFlags (the copy stream)", e);
        c->copy_stream = s;
        tdm_cuda_open_set_copy(c->stream, s);
    }
    *out = c->copy_stream;
    return TDM_STATUS_OK;
}

tdm_status tdm_cuda_copy_async(tdm_device *d, tdm_dev_xfer_dir dir, void *dst, const void *src,
                               size_t nbytes, void **xfer)
{
    *xfer = NULL;
    TDM_CHECK(tdm_cuda_enter(d));
    cudaStream_t cs = NULL;
    TDM_CHECK(tdm_cuda_copy_stream(d, &cs));
    int up = dir == TDM_DEV_XFER_TO_DEVICE;
    cudaEvent_t ready = NULL, done = NULL;
    int issued = 0;
    const char *what = "cudaEventCreateWithFlags (a copy's start)";
    cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (e == cudaSuccess) {
        what = "cudaEventRecord (the compute stream, before a copy)";
        e = cudaEventRecord(ready, tdm_cuda_impl(d)->stream);
    }
    if (e == cudaSuccess) {
        what = "cudaStreamWaitEvent (the copy stream after the compute stream)";
        e = cudaStreamWaitEvent(cs, ready, 0);
    }
    if (e == cudaSuccess) {
        what = up ? "cudaMemcpyAsync (host to device, copy stream)"
                  : "cudaMemcpyAsync (device to host, copy stream)";
        e = cudaMemcpyAsync(dst, src, nbytes, up ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                            cs);
        issued = e == cudaSuccess;
    }
    if (e == cudaSuccess) {
        what = "cudaEventCreateWithFlags (a copy's end)";
        e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    }
    if (e == cudaSuccess) {
        what = "cudaEventRecord (the copy stream)";
        e = cudaEventRecord(done, cs);
    }
    if (ready) tdm_cuda_warn(d->name, "cudaEventDestroy (a copy's start)", cudaEventDestroy(ready));
    if (e == cudaSuccess) {
        *xfer = (void *)done;
        return TDM_STATUS_OK;
    }
    tdm_status st = tdm_cuda_fail(d->name, what, e);
    if (done) tdm_cuda_warn(d->name, "cudaEventDestroy (a copy's end)", cudaEventDestroy(done));
    /* no handle goes back: a copy already in flight must end before the
     * caller takes its buffers back */
    if (issued)
        tdm_cuda_warn(d->name, "cudaStreamSynchronize (the copy stream, after a failure)",
                      cudaStreamSynchronize(cs));
    return st;
}

tdm_status tdm_cuda_xfer_finish(tdm_device *d, void *xfer, tdm_dev_xfer_until until)
{
    cudaEvent_t done = (cudaEvent_t)xfer;
    tdm_status st = tdm_cuda_enter(d);
    cudaError_t e = cudaSuccess;
    const char *what = "";
    if (st == TDM_STATUS_OK && until == TDM_DEV_XFER_HOST) {
        what = "cudaEventSynchronize (an asynchronous copy)";
        e = cudaEventSynchronize(done);
    } else if (st == TDM_STATUS_OK && until == TDM_DEV_XFER_DEVICE) {
        what = "cudaStreamWaitEvent (the compute stream after a copy)";
        e = cudaStreamWaitEvent(tdm_cuda_impl(d)->stream, done, 0);
    }
    /* TDM_DEV_XFER_COMM: the collectives join the copy stream themselves */
    cudaError_t e2 = cudaEventDestroy(done);
    if (st) return st;
    if (e != cudaSuccess) return tdm_cuda_fail(d->name, what, e);
    if (e2 != cudaSuccess)
        return tdm_cuda_fail(d->name, "cudaEventDestroy (an asynchronous copy)", e2);
    return TDM_STATUS_OK;
}

void tdm_cuda_copy_close(tdm_device *d)
{
    tdm_cuda_dev *c = tdm_cuda_impl(d);
    if (!c || !c->copy_stream) return;
    tdm_cuda_open_set_copy(c->stream, NULL);
    tdm_cuda_warn(d->name, "closing: cudaStreamSynchronize (the copy stream)",
                  cudaStreamSynchronize(c->copy_stream));
    tdm_cuda_warn(d->name, "closing: cudaStreamDestroy (the copy stream)",
                  cudaStreamDestroy(c->copy_stream));
    c->copy_stream = NULL;
}
