/* tools/ranks.h: the CLI's table of each multi-process design (DDP in
 * tools/rank_ddp.c, the sharded modes in tools/rank_fsdp.c) over
 * dist/run.h's entry: how a rank of the design is built from the command
 * line's options (its model, wrapper, optimizer, a resumed checkpoint),
 * its per-step ops (dist/step.h), and what the CLI prints of it. `tandem
 * train` (tools/train_ranks.c) and `tandem compare`
 * (tools/compare_ranks.c) each run any design through one loop of
 * their own; neither knows which design it runs. The ops are the
 * design's own (tdm_ddp_dist_ops, tdm_fsdp_dist_ops) over the rank's
 * wrapper w and optimizer. */
#ifndef TDM_TOOLS_RANKS_H
#define TDM_TOOLS_RANKS_H

#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "ddp/hooks.h"
#include "dist/run.h"
#include "dist/step.h"
#include "fsdp/fsdp.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"
#include "pp/pp.h"
#include "tp/tp.h"
#include "models/precision.h"

typedef struct tdm_tool_design tdm_tool_design;

/* What every rank builds, filled by the tool from its options. */
typedef struct tdm_tool_build {
    const tdm_tool_design *design;
    const char *cmd;             /* "tandem train": the messages' prefix */
    tdm_model_spec spec;
    uint64_t seed;
    tdm_optim_opts optim;        /* optim.offload: --offload optimizer */
    /* the memory levers on every rank's model (docs/MEMORY.md) */
    tdm_precision precision;
    int ckpt;                    /* units per recomputed segment; 0: off */
    const char *resume;          /* a checkpoint every rank loads (full, or FSDP's sharded
                                    index); NULL: none */
    int no_overlap;              /* communication after backward, not during it */
    int join;                    /* uneven inputs (dist/join.h) */
    int deterministic;           /* --deterministic K (dist/det.h); 0: off */
    /* DDP */
    double bucket_cap_mb;        /* 0: 25 */
    int sync_bn;
    const char *comm_hook;       /* DDP's or FSDP's by name; NULL: none */
    tdm_ddp_powersgd_opts powersgd;
    /* FSDP */
    tdm_fsdp_sharding sharding;
    int save_sharded;            /* ops.save writes a file per rank plus an index */
    tdm_fsdp_offload offload;    /* --offload params: the shards in host memory */
    /* pipeline (tools/rank_pp.c) */
    struct {
        int stages;              /* 0: the device count over the mesh's dp */
        int micro;               /* micro-batches per global batch (>= 1) */
        tdm_pp_schedule_kind schedule;
        const char *split;       /* --split L1,L2,..; NULL: balanced */
        const char *mesh;        /* --mesh dp=D,pp=S; NULL: pp over every rank */
        int batch;               /* the global batch (sizes the links' zero-copy memory) */
        int zero1;               /* --sharding optimizer: ZeRO-1 over the dp dimension */
    } pp;
    /* tensor parallelism (tools/rank_tp.c) */
    struct {
        int seq_par;             /* --sequence-parallel (tp/tp.h) */
        /* --sharding over the dp dimension: 0 none, 1 optimizer (ZeRO-1),
         * 2 grad_op (ZeRO-2) */
        int zero;
    } tp;
    /* the tool's own context, for the callbacks it composes around the
     * design's (dist/run.h's ctx is this struct) */
    void *tool;
} tdm_tool_build;

/* A rank of any design, the self of its callbacks and ops. */
typedef struct tdm_tool_rank {
    const tdm_tool_build *b;
    tdm_dist_rank *dist;         /* borrowed: comm, device, rank */
    int rank, world;
    tdm_model *m;
    tdm_optim *opt;
    void *w;                     /* the design's wrapper (tdm_ddp, tdm_fsdp) */
    int64_t start_epoch;         /* epochs the resumed checkpoint had done */
    tdm_ckpt_info resumed;       /* what it said (all zero: none) */
    int64_t model_params;        /* the whole model's parameters when m is a part of it
                                    (a pipeline stage); 0: m's */
    void *tool;                  /* the tool's per-rank state */
} tdm_tool_rank;

struct tdm_tool_design {
    /* name, caps; setup builds a tdm_tool_rank (ctx: the tdm_tool_build)
     * and free frees it; run is the tool's; ops the design's */
    tdm_dist_design dist;
    const char *unit;            /* "DDP rank": the --threads note */
    /* 1: rank 0's replica is the whole model and saves alone, the others
     * wait at the end-of-epoch barrier; 0: every rank takes part in the
     * save (ops.save) */
    int save_alone;
    /* The header's words: after the devices (on: ", sharding full (FSDP
     * FULL_SHARD, ZeRO stage 3)") and after the communicator (note: ",
     * zero-copy buckets"). */
    void (*describe)(const tdm_tool_rank *r, char *on, size_t n_on, char *note, size_t n_note);
    /* Rank 0's summary after training: where the step went; overlap 1
     * adds the share of communication hidden behind backward. */
    void (*report)(const tdm_tool_rank *r, int overlap);
    /* The checkpoint every rank takes part in (NULL: the ops' save), and
     * the form it writes, for the "saved" line: NULL (the one form),
     * "full", "sharded: a file per rank plus this index". */
    tdm_status (*save)(tdm_tool_rank *r, const char *path, const tdm_ckpt_info *info);
    const char *(*save_form)(const tdm_tool_rank *r);
    /* The full parameters into host (every rank when root < 0, else
     * root's; collective where they are sharded). */
    tdm_status (*params)(tdm_tool_rank *r, float *host, int root);
    /* A design whose step is not dist/step.h's (a pipeline's schedule):
     * the optimizer step, a tdm_train_step_fn over the rank's
     * tdm_dist_stepper (its w the design's wrapper). NULL: tdm_dist_step. */
    tdm_train_step_fn step;
    /* --grad-accum's micro-batches and step over the rank's
     * tdm_dist_stepper (its w the design's wrapper), for a design with a
     * step of its own. NULL: tdm_dist_accum_ops (the dist ops'). */
    const tdm_accum_ops *accum;
    /* Collective, on every rank after a successful run, before rank 0's
     * report (a pipeline gathers every stage's figures). May be NULL. */
    tdm_status (*finish)(tdm_tool_rank *r);
    /* The last step's phases on this rank (train --trace); 0 when none.
     * May be NULL. */
    int (*phases)(const tdm_tool_rank *r, tdm_phase_times *out);
};

extern const tdm_tool_design tdm_tool_ddp_design;
extern const tdm_tool_design tdm_tool_fsdp_design;
extern const tdm_tool_design tdm_tool_pp_design;
extern const tdm_tool_design tdm_tool_tp_design;

/* A tensor-parallel job's checks before any rank starts (tools/rank_tp.c):
 * --mesh (dp and tp only; none: tp over every rank) against the world's
 * ranks and the plan of the model (tp/tp.h). One-line USAGE messages.
 * *shape: the mesh. */
tdm_status tdm_tool_tp_check(const tdm_tool_build *b, int world, tdm_mesh_shape *shape);
/* A tensor-parallel rank's figures (r of tdm_tool_tp_design). */
void tdm_tool_tp_stats(const tdm_tool_rank *r, tdm_tp_stats *out);

/* A pipeline job's checks before any rank starts (tools/rank_pp.c): the
 * mesh against the world's ranks, --stages, --split against the model's
 * layers. One line on stderr prefixed by b->cmd and USAGE when they
 * cannot work. *shape: the mesh. */
tdm_status tdm_tool_pp_check(const tdm_tool_build *b, int world, tdm_mesh_shape *shape);
/* A pipeline rank's stage (r of tdm_tool_pp_design). */
tdm_pp *tdm_tool_pp_of(const tdm_tool_rank *r);
/* Its stage's tensor-parallel partial sums so far (--mesh with tp=N > 1;
 * all 0 without): the all-reduces and their payload bytes as the stage's
 * tp communicator counted them (tdm_comm_traffic_get), and their ms. */
void tdm_tool_pp_tp_sums(const tdm_tool_rank *r, int64_t *calls, int64_t *bytes, double *ms);
/* The shm arena a pipeline job over dl needs: DDP's over the dp
 * dimension's replicas (none without one). */
size_t tdm_tool_pp_arena_bytes(const tdm_tool_build *b, const tdm_device_list *dl, int world,
                               int64_t param_elems);

/* The shm arena a DDP job over dl needs for zero-copy gradients of
 * param_elems floats: none on GPUs (their buckets live in NCCL memory). */
size_t tdm_tool_ddp_arena_bytes(const tdm_device_list *dl, int64_t param_elems);

/* What every table's setup begins with: a rank into *self (ctx: the
 * tdm_tool_build), its model built on d's device. */
tdm_status tdm_tool_rank_new(void *ctx, tdm_dist_rank *d, void **self);
/* What every table's setup ends with: --resume through the ops' load
 * (every rank reads the checkpoint), the epochs it had done. */
tdm_status tdm_tool_rank_resume(tdm_tool_rank *r);
/* What every table's free ends with: the optimizer, the model, r (the
 * table frees its wrapper first). */
void tdm_tool_rank_free(tdm_tool_rank *r);
/* "tandem <tool>: rank R: <what>: <message>" on stderr; returns st. */
tdm_status tdm_tool_rank_fail(const tdm_tool_rank *r, const char *what, tdm_status st);

#endif
