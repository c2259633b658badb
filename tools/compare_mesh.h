/* tools/compare_mesh.h: what the sections of the mesh designs in `tandem
 * compare` (the pipeline's, tools/compare_pp.c; tensor parallelism's,
 * tools/compare_tp.c) share: the shared mapping their forked ranks write
 * their records into, the run of the design's ranks under compare's
 * bounds, a rank's batch buffers, the one-host-device reference they are
 * judged against, the step time of a design whose step is its slowest
 * rank's, and the throughput lines. */
#ifndef TDM_TOOLS_COMPARE_MESH_H
#define TDM_TOOLS_COMPARE_MESH_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "dist/run.h"
#include "models/model.h"
#include "tools/compare.h"
#include "tools/ranks.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A zeroed anonymous mapping of bytes shared with forked ranks; NULL
 * (said on stderr) when mmap fails. Free with munmap. */
void *tdm_cmp_map_shared(size_t bytes);
/* Laying out records after a header of `header` bytes: the first offset
 * (64-byte aligned), then each field's offset, *off advanced past its
 * bytes (aligned). */
size_t tdm_cmp_place_start(size_t header);
size_t tdm_cmp_place(size_t *off, size_t bytes);
#define TDM_CMP_SHARED_AT(sh, off, type) ((type *)((char *)(sh) + (sh)->off))

/* design b's ranks over the first `world` devices of --device, each
 * running run (b->tool its context), under compare's bound on a run and
 * the process group's timeout (TANDEM_TIMEOUT_MS or dist's default).
 * Returns dist's status, its message set (not said). */
tdm_status tdm_cmp_mesh_run(const tdm_cmp_opts *o, tdm_tool_build *b,
                            tdm_status (*run)(void *ctx, tdm_dist_rank *d, void *self),
                            int world);
/* A global batch of B samples' buffers for a rank (who: "pp stage 1"). */
tdm_status tdm_cmp_batch_new(const tdm_cmp_data *d, int B, const char *who, float **x,
                             int32_t **y);
/* One host device over o's global batches from o's seed: plain steps
 * (micro <= 0) or --grad-accum micro over micro-batches of
 * ceil(B/micro), with o's levers (precision, checkpointing, clipping:
 * those of the row it is the reference of). loss[step] and the final
 * parameters (params: the model's elements). */
tdm_status tdm_cmp_reference(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                             const tdm_model_spec *spec, int micro, double *loss,
                             float *params);
/* The first step the timing figures count (0-based). */
int tdm_cmp_warm(const tdm_cmp_opts *o);
/* The median post-warm-up step time of a design whose step is its
 * slowest rank's: step_ms[i * ranks + k] is rank k's step i. */
double tdm_cmp_slowest_median(const tdm_cmp_opts *o, const double *step_ms, int steps,
                              int ranks);
/* "\n<design> throughput (median step over steps a..b; a step is the
 * slowest <unit>'s):\n  <what>: X ms/step = Y samples/s = Zx one device
 * (W samples/s)[, Vx DDP(N)]\n" (ddp may be NULL). */
void tdm_cmp_mesh_speed(const tdm_cmp_opts *o, const char *design, const char *unit,
                        const char *what, double med, const tdm_cmp_result *single,
                        const tdm_cmp_result *ddp);

/* The bound a row that is not bit for bit is judged by, compare's after
 * its last step (tools/compare.c): every parameter within atol + rtol |b|
 * of one device's, every step's loss within rel of one device's. */
#define TDM_CMP_MESH_ATOL 1e-4
#define TDM_CMP_MESH_RTOL 1e-3
#define TDM_CMP_MESH_LOSS 1e-3
typedef struct tdm_cmp_within {
    double max_diff;   /* the largest |a - b| over the parameters */
    double worst;      /* the largest |a - b| / (atol + rtol |b|): <= 1 passes */
    double loss_rel;   /* the largest |loss - ref| / |ref| over the steps */
    double floor_x;    /* max_diff over the floor's (0: no floor) */
    int by_floor;      /* past the bound, passed within the floor */
} tdm_cmp_within;
/* Judges n parameters and `steps` losses against one device's: within the
 * bound, or (as compare's other verdicts) within TDM_CMP_FLOOR_FACTOR
 * times the float-noise floor fl (NULL: none); returns 1 when within
 * (NaN fails), w->by_floor set when only the floor let it pass. */
int tdm_cmp_mesh_within(const float *p, const float *ref_p, int64_t n, const double *loss,
                        const double *ref_loss, int steps, const tdm_cmp_floor *fl,
                        tdm_cmp_within *w);

#ifdef __cplusplus
}
#endif

#endif
