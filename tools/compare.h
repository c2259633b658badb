/* tools/compare.h: `tandem compare`'s internals shared between its files:
 * the options, the measured results of one mode, and the runners and
 * writers. compare.c drives and prints, compare_run.c runs the modes,
 * compare_out.c writes the trace, CSV and plots. Each returns a
 * tdm_status after saying what failed (tools/tools.h). */
#ifndef TDM_TOOLS_COMPARE_H
#define TDM_TOOLS_COMPARE_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "core/data.h"
#include "core/comm.h"
#include "core/device.h"
#include "core/status.h"
#include "core/text.h"
#include "core/timer.h"
#include "models/model.h"
#include "models/precision.h"

#define TDM_CMP_MAX_DEV 64
#define TDM_CMP_MAX_BUCKETS 256
/* The bound on one mode's run in child processes (DDP's and the sharded
 * modes' ranks, single and DP on GPUs): an hour, far above any run
 * --steps asks of the CLI's models, so it fires only on a run that hangs
 * in a way its process group's timeout cannot see. */
#define TDM_CMP_RUN_TIMEOUT_MS 3600000
/* compare's default global batch for a gpt: windows of its context */
#define TDM_CMP_GPT_BATCH 32
/* Steps left out of the timing figures unless --warmup says: the first
 * steps touch fresh memory and warm the caches; half of --steps when that
 * is fewer. */
#define TDM_CMP_DEFAULT_WARMUP 3

typedef enum tdm_cmp_mode {
    TDM_CMP_SINGLE = 0,
    TDM_CMP_DP,
    TDM_CMP_DDP,
    TDM_CMP_FSDP,    /* fsdp/ FULL_SHARD (ZeRO-3) */
    TDM_CMP_ZERO2,   /* fsdp/ SHARD_GRAD_OP */
    TDM_CMP_ZERO1,   /* fsdp/ sharded optimizer */
    TDM_CMP_NMODES
} tdm_cmp_mode;

typedef struct tdm_cmp_opts {
    const char *model, *device, *data, *optim, *trace, *plot, *csv, *sweep;
    const char *json;          /* --json FILE (NULL: none) */
    int n_dev;                 /* devices in --device */
    tdm_device_list dl;        /* --device parsed: host (cpu:0..N-1) or CUDA GPUs */
    int steps, warmup, batch;
    double lr, momentum, weight_decay;
    uint64_t seed;
    double bucket_cap_mb;
    int no_overlap;
    unsigned modes;            /* bit per tdm_cmp_mode run (--modes) */
    int perturb_rank;          /* test hook: -1 off */
    int nudge;                 /* single mode only: start from parameters one ulp
                                  off (the float-noise floor run) */
    const char *backend;       /* --backend (MPI jobs); NULL: auto */
    tdm_comm *ddp_comm;        /* an MPI job: DDP's ranks are its ranks, over this
                                  communicator (NULL: forked ranks) */
    const char *comm_hook;     /* --comm-hook (NULL or "allreduce": none) */
    const char *ps_servers;    /* --servers 1,2 (ps, ps-async); NULL: 1, and 2 from 4 devices */
    int powersgd_rank;
    int64_t powersgd_start_step;
    int hooked;                /* this DDP (or sharded) run registers comm_hook */
    int sync_bn;               /* --sync-bn: DDP's batchnorm over the whole global batch */
    /* --modes ...,pp (tools/compare_pp.c): stages (0: the devices),
     * micro-batches (0: 4), schedule (NULL: 1f1b) */
    int pp_stages, pp_micro;
    const char *pp_schedule;
    /* --mesh: the layout of the pp row (dp=D,pp=S, or dp=D,pp=S,tp=N:
     * tensor-parallel stages) or the tp row (dp=D,tp=N), checked against
     * --device; its sizes (1 where it does not name a dimension; all 0
     * without --mesh) */
    const char *mesh;
    int mesh_dp, mesh_pp, mesh_tp;
    /* the memory levers on every mode's model (docs/MEMORY.md; the pp
     * row's stages too, and the one-device reference of its verdict) */
    const char *precision_arg; /* --precision as given (NULL: fp32) */
    tdm_precision precision;
    int ckpt;                  /* --checkpoint-activations N; 0: off */
    double clip;               /* --clip-grad-norm X (the pp row and its reference only);
                                  0: off */
} tdm_cmp_opts;

/* --modes' bit for the pipeline, which runs in a section of its own
 * (tools/compare_pp.c) after the modes above. */
#define TDM_CMP_PP_BIT (1u << TDM_CMP_NMODES)
/* And tensor parallelism's (tools/compare_tp.c). */
#define TDM_CMP_TP_BIT (1u << (TDM_CMP_NMODES + 1))
/* --modes' bits for the parameter server's variants, which run as
 * `tandem train --mode ps` in a section of their own (tools/compare_ps.c) */
#define TDM_CMP_PS_BIT (1u << (TDM_CMP_NMODES + 2))
#define TDM_CMP_PS_ASYNC_BIT (1u << (TDM_CMP_NMODES + 3))
/* tp-sp: tensor parallelism with sequence parallelism (the GPT), a
 * second tp section */
#define TDM_CMP_TP_SP_BIT (1u << (TDM_CMP_NMODES + 4))

/* Bytes per device (or rank) by kind. */
typedef struct tdm_cmp_memory {
    double params, grads, optim, buffers, activations, comm;
    double peak;               /* the device allocator's peak over the run (bytes; 0: unknown) */
} tdm_cmp_memory;

/* The float-noise floor the verdicts allow beside their fixed bound: one
 * device started one ulp off, after the last step (tools/compare.c). */
#define TDM_CMP_FLOOR_FACTOR 10.0
typedef struct tdm_cmp_floor {
    double max_abs;    /* its largest parameter difference from one device's */
    double loss_rel;   /* its last loss's relative difference */
} tdm_cmp_floor;

typedef struct tdm_cmp_result {
    tdm_cmp_mode mode;
    int n_dev;
    int steps;
    int ok;                            /* the run finished */
    double *loss;                      /* [steps] global-batch mean loss */
    double *step_ms;                   /* [steps] wall per step */
    double *step_t0_ms;                /* [steps] start, ms since the run's start */
    tdm_phase_times *phase;            /* [steps * n_dev] per device/rank */
    tdm_phase_times *wall;             /* [steps] step's wall per phase (critical path) */
    double *comm_ms;                   /* [steps] DDP: first bucket start .. last end */
    double *exposed_ms;                /* [steps] DDP: all-reduce wait after backward */
    double *bwd_t0_ms;                 /* [steps] DDP rank 0: backward start */
    int n_buckets;                     /* the most any step had */
    double *bucket;                    /* [steps * n_buckets * 3] ready, start, end (rank 0,
                                          ms from backward start; -1: not in that step's
                                          plan, e.g. the first step's single bucket) */
    int64_t param_elems;
    float *params_first, *params_last; /* after step 1 and after the last step */
    int ranks_agree;                   /* DDP: every rank ended with rank 0's params */
    double overlap_bytes_frac;         /* DDP rank 0: share of gradient bytes whose
                                          all-reduce was launched during backward
                                          (sharded: reduce-scatter) */
    double prefetch_frac;              /* sharded rank 0: share of all-gathered bytes
                                          that were prefetched */
    int n_coll;                        /* sharded: collectives per step recorded */
    double *coll;                      /* [steps * n_coll * 4] rank 0: kind (0 all-gather,
                                          1 reduce-scatter, -1 none), unit, start, end
                                          (ms from the step's start) */
    double bytes_per_step;             /* DDP rank 0: bytes all-reduced per step (mean);
                                          sharded: bytes reduce-scattered */
    tdm_cmp_memory mem[TDM_CMP_MAX_DEV];
} tdm_cmp_result;

const char *tdm_cmp_mode_name(tdm_cmp_mode m);

/* --deterministic K (tools/compare_det.c): every mode of o->modes at each
 * of the n_counts device counts (single once), each a `tandem train
 * --deterministic K` of this binary and a default one; prints the table
 * and the verdict; *identical 1 when every final checkpoint held one
 * device's bytes. Says what failed. */
tdm_status tdm_cmp_det_main(const tdm_cmp_opts *o, int K, const int *counts, int n_counts,
                            int *identical);

/* The i-th device of --device: "cpu:3", "cuda:1" ("cuda-emu:1" under the
 * CUDA emulator). */
void tdm_cmp_dev_name(const tdm_cmp_opts *o, int i, char *buf, size_t len);
/* The first n devices of --device as a device spec: "cpu:2", "cuda:0,1". */
void tdm_cmp_dev_spec(const tdm_cmp_opts *o, int n, char *buf, size_t len);

/* The global batches: rows of the dataset for step s are
 * order[s * batch .. +batch); for a gpt (text set), windows 0..batch-1 of
 * tdm_text_windows(text, T, seed, s). A DDP rank draws only its share
 * (tdm_dist_share) of either. */
typedef struct tdm_cmp_data {
    tdm_dataset train;
    int64_t *order;
    int64_t n_order;
    tdm_text_corpus text;   /* a gpt's (text.train.bytes set) */
    int T;
    uint64_t seed;
} tdm_cmp_data;

/* Samples [lo, lo + n) of step s's global batch of `batch` into x (n
 * samples of the model's input dtype) and y (their targets). */
void tdm_cmp_rows(const tdm_cmp_data *d, int step, int batch, int lo, int n, void *x,
                  int32_t *y);
/* Input elements (4 bytes each) and targets per sample. */
int64_t tdm_cmp_feat(const tdm_cmp_data *d);
int64_t tdm_cmp_targets(const tdm_cmp_data *d);

/* Runs one mode over opts->steps global batches on the first n_dev
 * devices of --device (single: the first). Fills r (allocated by the
 * callee; free with tdm_cmp_result_free). On failure a message is printed.
 * On CUDA devices single and DP run in a child process, so that this
 * process never initialises CUDA and can still fork DDP's ranks (a
 * process that has used CUDA cannot hand it to forked children). */
tdm_status tdm_cmp_run(const tdm_cmp_opts *o, const tdm_cmp_data *data, tdm_cmp_mode mode,
                       int n_dev, tdm_cmp_result *r);
/* Parameters of o's model (a probe on a host device); 0 on failure. */
int64_t tdm_cmp_param_elems(const tdm_cmp_opts *o);
void tdm_cmp_result_free(tdm_cmp_result *r);
/* r's arrays for a run of `steps` on n_dev devices (0 on failure, said). */
tdm_status tdm_cmp_alloc(tdm_cmp_result *r, tdm_cmp_mode mode, int n_dev, int steps,
                         int64_t param_elems);

/* ---- sharded modes (tools/compare_fsdp.c) ---- */
int tdm_cmp_is_sharded(tdm_cmp_mode m);
/* --modes single,dp,ddp,fsdp,zero2,zero1 into a bit mask (single always
 * runs: the reference); 0 with a message on a bad name. */
int tdm_cmp_parse_modes(const char *s, unsigned *mask);
/* DDP or a sharded mode on `world` ranks (tools/compare_ranks.c). */
tdm_status tdm_cmp_run_ranks(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                             tdm_cmp_mode mode, int world, tdm_cmp_result *r);
void tdm_cmp_fsdp_print_phases(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n);
/* The verdict's pairs among the modes that ran (ran[mode]): each vs
 * single, DDP vs DP, each sharded mode vs DDP. */
int tdm_cmp_fsdp_pairs(const int *ran, int (*pairs)[2], int max);
/* Sharded modes vs DDP bit for bit, and their ranks' agreement; 0 when
 * ranks disagree. */
int tdm_cmp_fsdp_print_bitwise(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n);
void tdm_cmp_fsdp_print_memory_note(tdm_cmp_result *const *res, int n);
void tdm_cmp_fsdp_reading(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                          const double *sps_of);
void tdm_cmp_fsdp_trace(FILE *f, int *first, int pid, const tdm_cmp_result *r,
                        long long (*us)(double));

/* Median, min and max of the post-warm-up step times. */
void tdm_cmp_step_stats(const tdm_cmp_opts *o, const tdm_cmp_result *r, double *med,
                        double *min, double *max);
/* Means over the post-warm-up steps of the step time, and (DDP; may be
 * NULL) of the communication span and its exposed part. */
void tdm_cmp_means(const tdm_cmp_opts *o, const tdm_cmp_result *r, double *step, double *comm,
                   double *exposed);
/* Mean per-phase wall over post-warm-up steps. */
void tdm_cmp_phase_mean(const tdm_cmp_opts *o, const tdm_cmp_result *r, tdm_phase_times *out);

/* --comm-hook: runs DDP with the hook and prints its section beside the
 * uncompressed DDP run `plain` (tools/compare_hook.c). 1: within the
 * expected bound, 0: beyond it, -1: the run failed (message printed). */
int tdm_cmp_hook_section(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                         const tdm_model_spec *spec, const tdm_cmp_result *plain);

/* The pipeline's section (tools/compare_pp.c): runs pp over the same
 * global batches and prints its throughput beside single's (and DDP's:
 * ddp may be NULL), its per-stage phases and bubble, its equivalence
 * verdict against one host device with gradient accumulation over the
 * same micro-batches, its per-stage memory and the reading. 1: the
 * verdict holds, 0: it does not, -1: the run failed (said). */
int tdm_cmp_pp_section(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                       const tdm_model_spec *spec, const tdm_cmp_result *single,
                       const tdm_cmp_result *ddp, const tdm_cmp_floor *floor);
/* The parameter server's section (tools/compare_ps.c): ps (sync) and
 * ps-async as --modes asks, N-1 workers with each server count of
 * --servers (1, and 2 on 4 devices or more): samples/s beside DDP's
 * (ddp_sps, <= 0: none), each server's bytes in and out per step beside
 * DDP's all-reduced bytes per rank (ddp may be NULL), the staleness
 * histogram, the loss curves against DDP's, the server sweep and its
 * reading. 1: ran (or skipped, said), -1: a run failed (said), -2: a bad
 * --servers (said; usage). */
int tdm_cmp_ps_section(const tdm_cmp_opts *o, const tdm_cmp_result *ddp, double ddp_sps);
/* The most servers --servers may ask for. */
#define TDM_CMP_PS_MAX_SERVERS 4
/* --servers' counts into out (at most TDM_CMP_PS_MAX_SERVERS): how many;
 * -1 when it is not a list of 1..TDM_CMP_PS_MAX_SERVERS. NULL --servers:
 * the default (1, and 2 from 4 devices). */
int tdm_cmp_ps_servers(const tdm_cmp_opts *o, int *out);
/* --sweep with pp: the samples/s of a pipeline of S stages (the median
 * post-warm-up step); < 0 when the run failed (said). */
double tdm_cmp_pp_sweep_sps(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                            const tdm_model_spec *spec, int S);
/* Tensor parallelism's section (tools/compare_tp.c): the MLP split over
 * the N devices runs the same global batches; its throughput beside
 * single's (and DDP's: ddp may be NULL), the phases with the
 * tensor-parallel all-reduces, the verdict against one host device within
 * compare's bound after the last step, memory and bytes per rank against the
 * plan's. 1: the verdict holds, 0: it does not, -1: the run failed
 * (said). */
int tdm_cmp_tp_section(const tdm_cmp_opts *o, const tdm_cmp_data *data,
                       const tdm_model_spec *spec, const tdm_cmp_result *single,
                       const tdm_cmp_result *ddp, int seq_par,
                       const tdm_cmp_floor *floor);
/* Its trace events (a process of one track per stage, each micro-batch's
 * F and B), after the other modes'; nothing when it did not run. */
void tdm_cmp_pp_trace(FILE *f, int *first, int pid, long long (*us)(double));
/* --json: the pipeline's object (",\n  \"pipeline\": {...}": its layout,
 * verdict and per-stage memory, measured and planned); nothing when it
 * did not run. */
void tdm_cmp_pp_json(FILE *f);

/* Writers (tools/compare_out.c); on failure a message is printed. */
tdm_status tdm_cmp_write_trace(const char *path, const tdm_cmp_opts *o,
                               tdm_cmp_result *const *res, int n);
/* res[0..n_main) are the modes' runs (run "main"), res[n_main..n) the
 * sweep's (run "sweep"); columns in docs/OUTPUTS.md. */
tdm_status tdm_cmp_write_csv(const char *path, const tdm_cmp_opts *o, tdm_cmp_result *const *res,
                             int n_main, int n);
/* --sweep: one device count's samples/s, each {median, min, max} (from
 * the post-warm-up steps' median, max and min time); dp[0] <= 0: skipped. */
typedef struct tdm_cmp_sweep_point {
    int devices;
    double dp[3], ddp[3];
    double ideal;   /* one device's median x devices */
} tdm_cmp_sweep_point;
/* --plot DIR (tools/compare_plot.c): data files, plots.gp and the charts. */
tdm_status tdm_cmp_write_plots(const char *dir, const tdm_cmp_opts *o,
                               tdm_cmp_result *const *res, int n,
                               const tdm_cmp_sweep_point *sweep, int n_sweep);
/* The phase table's rows, in order, and their names (the text table's,
 * the charts' and the JSON's). */
extern const tdm_phase tdm_cmp_phase_rows[];
extern const int tdm_cmp_n_phase_rows;
const char *tdm_cmp_phase_label(tdm_phase p);
/* The machine's load during a run (tools/compare_load.c): samples before
 * and after; the other processes' CPU between them in cores' worth (-1:
 * not measurable: no /proc/stat, or a window shorter than
 * tdm_cmp_load_min_window(), too short for /proc/stat's clock ticks to
 * tell the load within TDM_CMP_LOAD_ERR cores). Bench dp uses it too. */
typedef struct tdm_cmp_load {
    double busy_s, self_s, wall_s;
    int valid;
} tdm_cmp_load;
/* other processes using this many cores' worth during a mode: "busy" */
#define TDM_CMP_BUSY_CORES 0.25
/* the most error a reported load may carry, in cores */
#define TDM_CMP_LOAD_ERR 0.1
void tdm_cmp_load_sample(tdm_cmp_load *c);
double tdm_cmp_load_min_window(void);
double tdm_cmp_load_other(const tdm_cmp_load *a, const tdm_cmp_load *b);
/* Warnings for the modes that ran on a busy or oversubscribed machine;
 * 1 when any was printed. other_of: by mode. */
int tdm_cmp_load_print(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                       const double *other_of);
/* tools/compare_mem.c: the planned peak of mode's device (rank 0's), in
 * bytes, for the configuration compare runs; -1 where it is not planned
 * (DP). */
double tdm_cmp_planned_peak(const tdm_cmp_opts *o, tdm_cmp_mode mode, int n_dev);

/* Runs this binary with argv (NULL-terminated), its stdout and stderr
 * into buf (cap bytes, the tail kept when more come), to its end: 0 and
 * its wait status in *wstatus, or -1 with why in buf (pipe, fork). Used
 * where compare runs `tandem train` as a child (compare_det.c,
 * compare_ps.c). */
int tdm_cmp_run_self(const char *const *argv, char *buf, size_t cap, int *wstatus);

#endif
