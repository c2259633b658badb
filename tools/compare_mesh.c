/* tools/compare_mesh.c: what compare's mesh design sections share
 * (tools/compare_mesh.h). */
#include "tools/compare_mesh.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "dist/timeout.h"
#include "models/accum.h"
#include "models/optim.h"
#include "models/precision.h"
#include "models/recompute.h"
#include "models/train.h"

void *tdm_cmp_map_shared(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) return p;
    perror("tandem compare: mmap");
    return NULL;
}

size_t tdm_cmp_place_start(size_t header) { return (header + 63) & ~(size_t)63; }

size_t tdm_cmp_place(size_t *off, size_t bytes)
{
    size_t at = *off;
    *off = (at + bytes + 63) & ~(size_t)63;
    return at;
}

tdm_status tdm_cmp_mesh_run(const tdm_cmp_opts *o, tdm_tool_build *b,
                            tdm_status (*run)(void *ctx, tdm_dist_rank *d, void *self),
                            int world)
{
    tdm_dist_design d = b->design->dist;
    d.run = run;
    tdm_dist_run_opts ro = {.devices = &o->dl, .spec = o->device, .world = world,
                            .run_timeout_ms = TDM_CMP_RUN_TIMEOUT_MS};
    /* a pipeline's replicas: DDP's zero-copy gradients over the dp
     * dimension, as tandem train gives them (tools/rank_pp.c) */
    if (b->design == &tdm_tool_pp_design)
        ro.arena_bytes = tdm_tool_pp_arena_bytes(b, &o->dl, world, tdm_cmp_param_elems(o));
    tdm_error_clear();
    TDM_CHECK(tdm_dist_timeout_from_env(&ro.timeout_ms));
    if (!ro.timeout_ms) ro.timeout_ms = TDM_DIST_TIMEOUT_DEFAULT_MS;
    fflush(stdout);
    return tdm_dist_run(&d, b, &ro);
}

tdm_status tdm_cmp_batch_new(const tdm_cmp_data *d, int B, const char *who, float **x,
                             int32_t **y)
{
    *x = malloc((size_t)B * (size_t)tdm_cmp_feat(d) * sizeof(float));
    *y = malloc((size_t)B * (size_t)tdm_cmp_targets(d) * sizeof(int32_t));
    if (*x && *y) return TDM_STATUS_OK;
    return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "compare: %s: a batch of %d", who, B);
}

tdm_status tdm_cmp_reference(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                             const tdm_model_spec *spec, int micro, double *loss,
                             float *params)
{
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_single one = {0};
    int B = o->batch;
    float *x = NULL;
    int32_t *y = NULL;
    tdm_optim_opts oo;
    tdm_optim_opts_named(&oo, o->optim, o->lr, o->weight_decay, o->momentum, 0);
    tdm_status st = tdm_cmp_batch_new(data, B, "the one-device reference", &x, &y);
    if (!st) st = tdm_device_open(&dev, "cpu", 0, 1);
    if (!st) st = tdm_model_init(&m, dev, spec, o->seed);
    /* the levers of the row it is the reference of */
    if (!st) st = tdm_model_set_precision(m, o->precision);
    if (!st) st = tdm_model_set_checkpoint(m, o->ckpt);
    if (!st) st = tdm_optim_init(&opt, m, &oo);
    one = (tdm_single){.model = m, .opt = opt, .clip_norm = o->clip};
    tdm_accum a = {.ops = &tdm_accum_single_ops, .ctx = &one,
                   .micro = micro > 0 ? (B + micro - 1) / micro : B,
                   .in_features = m ? tdm_model_in_features(m) : 0,
                   .out_rows = m ? tdm_model_out_rows(m) : 0};
    for (int i = 0; !st && i < o->steps; i++) {
        tdm_cmp_rows(data, i, B, 0, B, x, y);
        if (micro > 0) {
            st = tdm_accum_step(&a, x, y, B, &loss[i]);
            continue;
        }
        st = tdm_model_zero_grad(m);
        if (!st) st = tdm_model_forward_backward(m, x, y, B, &loss[i]);
        if (!st) st = tdm_optim_step(opt);
    }
    if (!st) memcpy(params, tdm_model_params(m), (size_t)tdm_model_param_elems(m) * 4);
    if (m) tdm_single_free(&one);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    free(x);
    free(y);
    return st;
}

int tdm_cmp_warm(const tdm_cmp_opts *o) { return o->warmup < o->steps ? o->warmup : 0; }

double tdm_cmp_slowest_median(const tdm_cmp_opts *o, const double *step_ms, int steps,
                              int ranks)
{
    int n = 0;
    double *t = malloc((size_t)(steps > 0 ? steps : 1) * sizeof *t);
    if (!t) return 0.0;
    for (int i = tdm_cmp_warm(o); i < steps; i++) {
        double most = 0.0;
        for (int k = 0; k < ranks; k++) {
            double v = step_ms[(size_t)i * (size_t)ranks + (size_t)k];
            most = v > most ? v : most;
        }
        int j = n++;
        for (; j > 0 && t[j - 1] > most; j--) t[j] = t[j - 1];
        t[j] = most;
    }
    double med = n ? (n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2])) : 0.0;
    free(t);
    return med;
}

void tdm_cmp_mesh_speed(const tdm_cmp_opts *o, const char *design, const char *unit,
                        const char *what, double med, const tdm_cmp_result *single,
                        const tdm_cmp_result *ddp)
{
    double s1 = 0, lo = 0, hi = 0, sd = 0;
    tdm_cmp_step_stats(o, single, &s1, &lo, &hi);
    if (ddp && ddp->ok) tdm_cmp_step_stats(o, ddp, &sd, &lo, &hi);
    printf("\n%s throughput (median step over steps %d..%d; a step is the slowest %s's):\n"
           "  %s: %.3f ms/step = %.0f samples/s = %.2fx one device (%.0f samples/s)", design,
           tdm_cmp_warm(o) + 1, o->steps, unit, what, med, med > 0 ? o->batch / med * 1e3 : 0.0,
           s1 > 0 && med > 0 ? s1 / med : 0.0, s1 > 0 ? o->batch / s1 * 1e3 : 0.0);
    if (sd > 0 && med > 0) printf(", %.2fx DDP(%d)", sd / med, ddp->n_dev);
    printf("\n");
}

int tdm_cmp_mesh_within(const float *p, const float *ref_p, int64_t n, const double *loss,
                        const double *ref_loss, int steps, const tdm_cmp_floor *fl,
                        tdm_cmp_within *w)
{
    *w = (tdm_cmp_within){0};
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)p[i] - (double)ref_p[i]);
        double ratio = d / (TDM_CMP_MESH_ATOL + TDM_CMP_MESH_RTOL * fabs((double)ref_p[i]));
        if (!(d <= w->max_diff)) w->max_diff = d;
        if (!(ratio <= w->worst)) w->worst = ratio;
    }
    for (int i = 0; i < steps; i++) {
        double d = fabs(loss[i] - ref_loss[i]) / fabs(ref_loss[i]);
        if (!(d <= w->loss_rel)) w->loss_rel = d;
    }
    if (w->worst <= 1.0 && w->loss_rel <= TDM_CMP_MESH_LOSS) return 1;
    if (!fl || !(fl->max_abs > 0.0)) return 0;
    w->floor_x = w->max_diff / fl->max_abs;
    w->by_floor = w->floor_x <= TDM_CMP_FLOOR_FACTOR &&
                  w->loss_rel <= TDM_CMP_FLOOR_FACTOR * fl->loss_rel + TDM_CMP_MESH_LOSS;
    return w->by_floor;
}
