/* tests/test_clip.c: gradient clipping (models/clip.h). The norm of a
 * model's gradients equals the double-precision norm computed here; the
 * clipped gradients are the gradients times (float)(max / (norm + 1e-6))
 * when that is below 1 and untouched otherwise (torch's
 * clip_grad_norm_); a NaN or an infinity is refused with nothing scaled.
 * Across N = 1..4 forked ranks that each hold a contiguous shard of the
 * same gradient, tdm_clip_grad_norm_comm gives every rank the one-device
 * norm within 4 double ulps and the one-device clipped values within one
 * float ulp, through one all-reduce labelled "clip grad norm" in the
 * flight recorder (read back from the ranks' dumps, with the loss
 * scaler's "grad scaler found inf"). */
#include <criterion/criterion.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "models/clip.h"
#include "shm/shm_comm.h"
#include "tests/lever_util.h"

TestSuite(clip, .timeout = 120);

/* A GPT's gradients after one backward, on the host. */
static tdm_model *model_with_grads(tdm_device *d)
{
    tdm_model_spec s;
    lv_spec(LV_GPT, &s);
    tdm_model *m = NULL;
    TU_OK(tdm_model_init(&m, d, &s, 7));
    int B = lv_batch(LV_GPT);
    float *x = tu_malloc((size_t)B * s.n_ctx * 4);
    int32_t *y = tu_malloc((size_t)B * s.n_ctx * 4);
    lv_data(LV_GPT, &s, 0, x, y);
    double loss;
    TU_OK(tdm_model_zero_grad(m));
    TU_OK(tdm_model_forward_backward(m, x, y, B, &loss));
    free(x);
    free(y);
    return m;
}

static double ref_norm(const float *g, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)g[i] * g[i];
    return sqrt(s);
}

Test(clip, one_device_norm_and_scaling)
{
    tdm_device *d = tu_host();
    tdm_model *m = model_with_grads(d);
    int64_t n = tdm_model_param_elems(m);
    float *g = tu_malloc((size_t)n * 4);
    memcpy(g, tdm_model_grads(m), (size_t)n * 4);
    double ref = ref_norm(g, n), norm = 0.0;
    /* measure only, then a bound above the norm: nothing changes */
    TU_OK(tdm_clip_grad_norm(m, 0.0, &norm));
    cr_assert(tu_close(norm, ref, 0, 1e-13), "norm %.17g vs %.17g", norm, ref);
    TU_OK(tdm_clip_grad_norm(m, 2.0 * ref, &norm));
    cr_assert(!memcmp(g, tdm_model_grads(m), (size_t)n * 4), "clipped below the bound");
    /* a bound of a quarter of the norm scales every element */
    double max = ref / 4.0;
    TU_OK(tdm_clip_grad_norm(m, max, &norm));
    float coef = (float)(max / (norm + 1e-6));
    const float *c = tdm_model_grads(m);
    for (int64_t i = 0; i < n; i++) cr_assert_eq(c[i], g[i] * coef, "element %lld", (long long)i);
    double after = ref_norm(c, n);
    cr_assert(tu_close(after, max, 0, 1e-6), "norm after clipping %.9g, bound %.9g", after, max);
    /* a NaN: refused, nothing scaled */
    memcpy(g, c, (size_t)n * 4);
    tdm_model_grads(m)[5] = NAN;
    g[5] = NAN;
    cr_assert_eq(tdm_clip_grad_norm(m, max / 10.0, &norm), TDM_STATUS_NONFINITE);
    cr_assert(strstr(tdm_error_message(), "gradient norm is NaN"), "%s", tdm_error_message());
    cr_assert(!memcmp(g, tdm_model_grads(m), (size_t)n * 4));
    free(g);
    tdm_model_free(m);
    tdm_device_free(d);
}

typedef struct shard_out {
    double norm;
    int status;
    char err[256];
} shard_out;

static int shard_rank(tdm_shm_group *g, int r, int world, const float *grads, int64_t n,
                      double max, float *clipped, shard_out *out)
{
    tdm_comm *comm = NULL;
    tdm_device *d = NULL;
    tdm_shm_opts so = {.timeout_ms = 30000};
    if (tdm_shm_comm_init(&comm, g, r, &so) || tdm_device_open(&d, "cpu", 0, 1)) goto fail;
    /* rank r's shard: [lo, hi), uneven on purpose */
    int64_t lo = n * r / world, hi = n * (r + 1) / world;
    float *mine = malloc((size_t)(hi - lo + 1) * 4);
    memcpy(mine, grads + lo, (size_t)(hi - lo) * 4);
    /* two buffers per rank: the shard cut once more */
    int64_t half = (hi - lo) / 3, counts[2] = {half, hi - lo - half};
    float *bufs[2] = {mine, mine + half};
    if (tdm_clip_grad_norm_comm(comm, d, bufs, counts, 2, max, &out->norm)) goto fail;
    int found = r == world - 1;
    if (tdm_grad_scaler_sync_found_inf(comm, d, &found) || !found) goto fail;
    memcpy(clipped + lo, mine, (size_t)(hi - lo) * 4);
    free(mine);
    tdm_device_free(d);
    tdm_comm_free(comm);
    return 0;
fail:
    snprintf(out->err, sizeof out->err, "%s", tdm_error_message());
    return 1;
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = tu_malloc(1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

Test(clip, shards_give_the_one_device_norm)
{
    tdm_device *d = tu_host();
    tdm_model *m = model_with_grads(d);
    int64_t n = tdm_model_param_elems(m);
    float *g = tu_malloc((size_t)n * 4);
    memcpy(g, tdm_model_grads(m), (size_t)n * 4);
    double norm1;
    TU_OK(tdm_clip_grad_norm(m, 0.0, &norm1));
    double max = norm1 / 3.0;
    TU_OK(tdm_clip_grad_norm(m, max, &norm1));
    const float *ref = tdm_model_grads(m);
    size_t shared = (size_t)n * 4 + 4 * sizeof(shard_out);
    char *mem = mmap(NULL, shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(mem != MAP_FAILED);
    float *clipped = (float *)mem;
    shard_out *outs = (shard_out *)(mem + (size_t)n * 4);
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "clip");
    setenv("TANDEM_FR_DUMP", dir, 1);
    for (int world = 1; world <= 4; world++) {
        memset(mem, 0, shared);
        tdm_shm_group *grp = NULL;
        TU_OK(tdm_shm_group_create(&grp, world, NULL));
        pid_t pids[4];
        for (int r = 0; r < world; r++) {
            pids[r] = fork();
            cr_assert(pids[r] >= 0);
            if (pids[r] == 0) {
                alarm(60);
                _exit(shard_rank(grp, r, world, g, n, max, clipped, &outs[r]));
            }
            tdm_shm_group_set_pid(grp, r, pids[r]);
        }
        for (int r = 0; r < world; r++) {
            int ws;
            cr_assert_eq(waitpid(pids[r], &ws, 0), pids[r]);
            tdm_shm_group_mark_ended(grp, r, ws);
            cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "N=%d rank %d: %s", world, r,
                      outs[r].err);
        }
        tdm_shm_group_free(grp);
        for (int r = 0; r < world; r++)
            cr_assert(fabs(outs[r].norm - norm1) <= 4 * 0x1p-52 * norm1,
                      "N=%d rank %d: norm %.17g, one device %.17g", world, r, outs[r].norm, norm1);
        for (int64_t i = 0; i < n; i++)
            cr_assert(fabsf(clipped[i] - ref[i]) <= fabsf(ref[i]) * 0x1p-23f,
                      "N=%d element %lld: %.9g vs %.9g", world, (long long)i, clipped[i], ref[i]);
        char *dump = read_file(tu_tpath(dir, "fr_rank_0.json"));
        cr_assert_not_null(dump, "N=%d: no flight-recorder dump in %s", world, dir);
        cr_assert(strstr(dump, "clip grad norm") && strstr(dump, "grad scaler found inf"),
                  "N=%d: the labels are missing from the dump", world);
        free(dump);
    }
    unsetenv("TANDEM_FR_DUMP");
    tu_rmtree(dir);
    munmap(mem, shared);
    free(g);
    tdm_model_free(m);
    tdm_device_free(d);
}
