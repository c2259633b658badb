/* tests/test_cuda_xfer.c: asynchronous host copies (tdm_dev_copy_async,
 * tdm_dev_xfer_finish, core/device.h):
 * - a host device has no copy stream: the copy is done at once, every
 *   finish is a no-op; a copy of 0 bytes and a NULL handle are fine; an
 *   unknown direction is refused;
 * - the CUDA emulator models a copy stream's latest completion: nothing
 *   is copied until the handle is finished, in either direction and
 *   whatever the finish orders (a reader that skipped the finish sees
 *   the old bits), and tdm_cuda_emulator_xfers counts the copies not
 *   finished yet.
 * The GPU's copy stream (cuda/device_copy.c) is built, not run on a GPU. */
#include <criterion/criterion.h>

#include <string.h>

#include "core/device.h"
#include "cuda/cuda_weak.h"
#include "tests/test_util.h"

#define N 1000

static void fill(float *p, float base)
{
    for (int i = 0; i < N; i++) p[i] = base + (float)i;
}

Test(cuda_xfer, host_device_copies_at_once)
{
    tdm_device *h = tu_host();
    float src[N], dst[N];
    fill(src, 1.0f);
    static const tdm_dev_xfer_until until[] = {TDM_DEV_XFER_HOST, TDM_DEV_XFER_DEVICE,
                                               TDM_DEV_XFER_COMM};
    for (int dir = 0; dir < 2; dir++)
        for (int k = 0; k < 3; k++) {
            memset(dst, 0, sizeof dst);
            tdm_dev_xfer *x = NULL;
            TU_OK(tdm_dev_copy_async(h, (tdm_dev_xfer_dir)dir, dst, src, sizeof src, &x));
            cr_assert_not_null(x);
            cr_assert(!memcmp(dst, src, sizeof src), "dir %d: a host device copies at once",
                      dir);
            TU_OK(tdm_dev_xfer_finish(x, until[k]));
        }
    tdm_dev_xfer *x = NULL;
    TU_OK(tdm_dev_copy_async(h, TDM_DEV_XFER_TO_HOST, dst, src, 0, &x));
    TU_OK(tdm_dev_xfer_finish(x, TDM_DEV_XFER_HOST));
    TU_OK(tdm_dev_xfer_finish(NULL, TDM_DEV_XFER_HOST));
    cr_assert_eq(tdm_dev_copy_async(h, (tdm_dev_xfer_dir)7, dst, src, 4, &x),
                 TDM_STATUS_INVALID_ARG);
    cr_assert_null(x);
    cr_assert(strstr(tdm_error_message(), "direction 7"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dev_copy_async(h, TDM_DEV_XFER_TO_HOST, NULL, src, 4, &x),
                 TDM_STATUS_INVALID_ARG);
    cr_assert_null(x);
    tdm_device_free(h);
}

Test(cuda_xfer, emulator_copies_only_when_finished)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    tdm_device *e = NULL;
    TU_OK(tdm_cuda_emulator_open_accel(&e, 0));
    float *dev = NULL;
    TU_OK(tdm_dev_alloc(e, N * sizeof(float), (void **)&dev));
    float host[N], back[N];
    static const tdm_dev_xfer_until until[] = {TDM_DEV_XFER_HOST, TDM_DEV_XFER_DEVICE,
                                               TDM_DEV_XFER_COMM};
    for (int k = 0; k < 3; k++) {
        /* up: the device block keeps its old bits until the finish */
        fill(host, 10.0f * (float)(k + 1));
        TU_OK(tdm_dev_memset_zero(e, dev, N * sizeof(float)));
        tdm_dev_xfer *up = NULL;
        TU_OK(tdm_dev_copy_async(e, TDM_DEV_XFER_TO_DEVICE, dev, host, sizeof host, &up));
        cr_assert_eq(tdm_cuda_emulator_xfers(e), 1);
        TU_OK(tdm_dev_copy_to_host(e, back, dev, sizeof back));
        for (int i = 0; i < N; i++) cr_assert_eq(back[i], 0.0f, "k %d: copied before its finish", k);
        TU_OK(tdm_dev_xfer_finish(up, until[k]));
        cr_assert_eq(tdm_cuda_emulator_xfers(e), 0);
        TU_OK(tdm_dev_copy_to_host(e, back, dev, sizeof back));
        cr_assert(!memcmp(back, host, sizeof host), "k %d: the copy up after its finish", k);
        /* down: the host buffer keeps its old bits until the finish, and
         * the copy reads the source as it is then */
        memset(back, 0, sizeof back);
        tdm_dev_xfer *down = NULL;
        TU_OK(tdm_dev_copy_async(e, TDM_DEV_XFER_TO_HOST, back, dev, sizeof back, &down));
        for (int i = 0; i < N; i++) cr_assert_eq(back[i], 0.0f, "k %d: copied before its finish", k);
        TU_OK(tdm_dev_scale(e, N, 2.0f, dev));   /* touched too early: the copy sees it */
        TU_OK(tdm_dev_xfer_finish(down, until[k]));
        for (int i = 0; i < N; i++)
            cr_assert_eq(back[i], 2.0f * host[i], "k %d: element %d", k, i);
    }
    cr_assert_eq(tdm_cuda_emulator_xfers(e), 0);
    cr_assert_eq(tdm_cuda_emulator_xfers(NULL), -1);
    tdm_dev_free(e, dev);
    tdm_device_free(e);
}

/* On a GPU (skipped without one, and under the emulator): both
 * directions through the copy stream, each finish, pinned host memory;
 * the bits arrive. Run by the GPU bundle (cuda/cuda.mk). */
Test(cuda_xfer, gpu_copy_stream_moves_the_bits)
{
    if (!tdm_device_cuda_linked()) cr_skip_test("CUDA backend not built (no nvcc)");
    tdm_device *g = NULL;
    if (tdm_device_open(&g, "cuda", 0, 0) != TDM_STATUS_OK) cr_skip_test("no GPU");
    if (tdm_cuda_device_is_emulator(g)) {
        tdm_device_free(g);
        cr_skip_test("an emulated GPU (tested above)");
    }
    static float host[N], back[N];
    tdm_status pin = tdm_dev_host_pin(g, host, sizeof host);
    cr_assert(pin == TDM_STATUS_OK || pin == TDM_STATUS_UNSUPPORTED, "%s", tdm_error_message());
    float *dev = NULL;
    TU_OK(tdm_dev_alloc(g, N * sizeof(float), (void **)&dev));
    static const tdm_dev_xfer_until until[] = {TDM_DEV_XFER_HOST, TDM_DEV_XFER_DEVICE,
                                               TDM_DEV_XFER_COMM};
    for (int k = 0; k < 3; k++) {
        fill(host, 3.0f * (float)(k + 1));
        tdm_dev_xfer *x = NULL;
        TU_OK(tdm_dev_copy_async(g, TDM_DEV_XFER_TO_DEVICE, dev, host, sizeof host, &x));
        TU_OK(tdm_dev_xfer_finish(x, until[k]));
        if (until[k] == TDM_DEV_XFER_COMM) {   /* no collective here: wait on the host */
            TU_OK(tdm_dev_copy_async(g, TDM_DEV_XFER_TO_HOST, back, dev, 4, &x));
            TU_OK(tdm_dev_xfer_finish(x, TDM_DEV_XFER_HOST));   /* the stream is in order */
        }
        TU_OK(tdm_dev_scale(g, N, 2.0f, dev));
        memset(back, 0, sizeof back);
        TU_OK(tdm_dev_copy_async(g, TDM_DEV_XFER_TO_HOST, back, dev, sizeof back, &x));
        TU_OK(tdm_dev_xfer_finish(x, until[k] == TDM_DEV_XFER_DEVICE ? TDM_DEV_XFER_DEVICE
                                                                     : TDM_DEV_XFER_HOST));
        TU_OK(tdm_dev_sync(g));
        for (int i = 0; i < N; i++)
            cr_assert_eq(back[i], 2.0f * host[i], "finish %d: element %d", k, i);
    }
    tdm_dev_free(g, dev);
    if (pin == TDM_STATUS_OK) tdm_dev_host_unpin(g, host);
    tdm_device_free(g);
}
