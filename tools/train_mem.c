/* tools/train_mem.c: `tandem train`'s memory check before a run starts
 * (models/mem_plan.h): the plan of the mode, model, devices, batch and
 * optimizer the arguments ask for, against the memory this process can
 * still take. A process that tandem forks its ranks from checks the whole
 * job; a rank started by `tandem launch` or an MPI launcher checks its
 * own share (the others are separate processes it cannot see). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "fsdp/fsdp.h"
#include "models/mem_plan.h"
#include "dist/mesh.h"
#include "dist/mpi_job.h"
#include "dist/timeout.h"
#include "tools/ranks.h"
#include "tools/train_modes.h"
#include "tp/tp.h"

/* The plan's input from the arguments; 0 when they are not the kind the
 * mode's own checks accept (then those checks speak). */
static int tdm_train_mem_in(const tdm_train_args *a, const tdm_model_spec *spec,
                            tdm_mem_plan_in *in, tdm_device_list *dl)
{
    memset(in, 0, sizeof *in);
    int single = !strcmp(a->mode, "single"), dp = !strcmp(a->mode, "dp");
    int fsdp = !strcmp(a->mode, "fsdp");
    if (tdm_device_list_parse(dl, single && !strcmp(a->device, "cpu") ? "cpu:1" : a->device))
        return 0;
    int n = dl->count > 0 ? dl->count : 1;
    int launched = tdm_dist_launched() || tdm_dist_mpi_launched();
    int world = n;
    if (launched && !single && !dp) {
        /* one rank of a job: its own share */
        const char *w = getenv("WORLD_SIZE");
        world = w && atoi(w) > 0 ? atoi(w) : 1;
        n = 1;
    }
    in->replicas = single ? 1 : n;
    in->processes = single || dp ? 1 : n;
    in->forks = single || dp || launched ? 0 : n;
    in->on_host = dl->kind == TDM_DEVICE_HOST;
    in->optim_states = strcmp(a->optim, "sgd") ? 2 : a->momentum > 0 ? 1 : 0;
    in->shard = TDM_MEM_SHARD_NONE;
    if (fsdp) {
        tdm_fsdp_sharding sh = TDM_FSDP_FULL_SHARD;
        if (a->sharding && tdm_fsdp_sharding_parse(a->sharding, &sh)) return 0;
        in->shard = sh == TDM_FSDP_FULL_SHARD      ? TDM_MEM_SHARD_FULL
                    : sh == TDM_FSDP_SHARD_GRAD_OP ? TDM_MEM_SHARD_GRAD_OP
                                                   : TDM_MEM_SHARD_OPTIMIZER;
    }
    /* each replica runs its share of every (micro-)batch */
    int parts = single ? 1 : world;
    int batch = (int)((a->batch + parts - 1) / parts);
    if (!strcmp(a->mode, "pp")) {
        /* a pipeline's stages hold the whole model once per replica
         * (each stage its layers' parameters, gradients and optimizer
         * state), and each stage the activations of the micro-batches
         * between their forward and backward: all M under GPipe, at most
         * S - s under 1F1B (S - s <= S: the plan takes S on every stage) */
        tdm_mesh_shape sh;
        const char *sched = a->schedule ? a->schedule : "1f1b";
        if (tdm_mesh_parse(a->mesh, 0, &sh)) return 0;
        int S = a->mesh ? sh.size[TDM_MESH_PP] : a->stages > 0 ? (int)a->stages : world;
        int reps = S > 0 && world % S == 0 ? world / S : 1;
        /* --deterministic K: a replica's K/D virtual shards */
        long long M = a->microbatches > 0 ? a->microbatches
                      : a->deterministic > 0 && a->deterministic >= reps
                          ? a->deterministic / reps : 4;
        long long rows = (a->batch + reps - 1) / reps, micro = (rows + M - 1) / M;
        long long held = !strcmp(sched, "gpipe") || M < S ? M : S;
        in->replicas = reps;
        in->processes = reps;
        batch = (int)(micro * held);
    }
    /* tensor parallelism: every rank a process of its own holding its
     * slices (tdm_tp_footprint: the set-up's layout and activations,
     * counted, with checkpointing's shared buffers) for its replica's
     * share of the batch; float32 throughout (tp's precision rounds the
     * products' operands only: their buffer is not counted, so the plan
     * stays a lower bound) */
    tdm_tp_rank_footprint tfp = {0};
    int tp = !strcmp(a->mode, "tp");
    if (tp) {
        tdm_mesh_shape sh = {.size = {1, 1, world}};
        if (a->mesh && tdm_mesh_parse(a->mesh, world, &sh)) return 0;
        int D = sh.size[TDM_MESH_DP];
        batch = (int)((a->batch + D - 1) / D);
        int ckpt = a->ckpt ? 1 : 0;   /* tp checkpoints every block (checked) */
        if (tdm_tp_footprint_ckpt(spec, sh.size[TDM_MESH_TP], batch > 0 ? batch : 1,
                                  a->sequence_parallel, ckpt, &tfp))
            return 0;
        /* ZeRO-1 over the dp dimension divides the optimizer by D; the
         * formula's optimizer shard divides by every rank: a smaller
         * figure, so the plan stays a lower bound */
        in->shard = a->sharding ? TDM_MEM_SHARD_OPTIMIZER : TDM_MEM_SHARD_NONE;
    }
    /* a replica's figures: the device planner's, with the run's levers */
    tdm_plan_opts po;
    tdm_plan_opts_default(&po, spec, batch > 0 ? batch : 1);
    if (a->precision && tdm_precision_parse(a->precision, &po.precision)) return 0;
    if (tp) po.precision = TDM_PRECISION_FP32;   /* above */
    po.ckpt = !a->ckpt ? 0 : !strcmp(a->ckpt, "all") ? 1 : atoi(a->ckpt);
    tdm_optim_opts_named(&po.optim, a->optim, a->lr, a->weight_decay, a->momentum, a->nesterov);
    int params = a->offload && !strcmp(a->offload, "params");
    po.optim.offload = a->offload && !params && dl->kind != TDM_DEVICE_HOST
                           ? TDM_OPTIM_OFFLOAD_HOST : TDM_OPTIM_OFFLOAD_NONE;
    po.device = dl->kind;
    po.threads = a->threads > 0 ? (int)a->threads : 1;
    po.loss_scaling = po.precision == TDM_PRECISION_FP16;
    po.grad_norm = a->clip_grad_norm > 0.0;
    if (po.ckpt < 0 || tdm_mem_plan_model(&po, &in->model) != TDM_STATUS_OK) return 0;
    if (tp) {
        in->model.param_elems = tfp.elems;
        in->model.largest_param_elems = tfp.largest_elems;
        in->model.act_bytes = tfp.act_bytes;
    }
    return 1;
}

tdm_status tdm_train_check_memory(const tdm_train_args *a, const tdm_model_spec *spec)
{
    tdm_mem_plan_in in;
    tdm_device_list dl;
    /* the model's own errors are for the mode's set-up to report */
    if (!tdm_train_mem_in(a, spec, &in, &dl)) return TDM_STATUS_OK;
    if (!strcmp(a->mode, "ddp") && in.processes > 1 && in.on_host)
        in.shared_bytes = tdm_tool_ddp_arena_bytes(&dl, in.model.param_elems);
    tdm_mem_plan p;
    tdm_mem_plan_compute(&in, &p);
    tdm_status st = tdm_mem_plan_check(&in, &p);
    if (st != TDM_STATUS_OK) tdm_train_fail("memory", st);
    return st;
}
