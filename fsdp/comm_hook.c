/* fsdp/comm_hook.c: fp16 / bf16 compression of the sharded modes'
 * gradient reduce-scatters (tdm_fsdp_opts.comm_hook, docs/FSDP.md):
 * each unit's full local gradient is rounded to 16 bits into a block of
 * the unit pool, reduce-scattered in place as 16-bit values (half the
 * bytes of float32), and this rank's slice of the result is widened into
 * the place the float32 reduce-scatter writes. fsdp/units.c launches and
 * finishes the unit's collective as without a hook; only the buffer and
 * the dtype differ. The rounding runs on the CPU: host devices only, as
 * DDP's hooks (ddp/hooks.c). */
#include "fsdp/fsdp_impl.h"

#include <string.h>

const char *tdm_fsdp_comm_hook_name(tdm_fsdp_comm_hook h)
{
    /* the float32 default as the command line and DDP name it
     * (--comm-hook allreduce, tdm_ddp_comm_hook_name), not "none" */
    static const char *const n[] = {"allreduce", "fp16", "bf16"};
    return (unsigned)h < TDM_FSDP_HOOK_COUNT_ ? n[h] : "?";
}

tdm_status tdm_fsdp_comm_hook_parse(const char *text, tdm_fsdp_comm_hook *out)
{
    static const struct {
        const char *name;
        tdm_fsdp_comm_hook h;
    } t[] = {{"none", TDM_FSDP_HOOK_NONE},
             {"allreduce", TDM_FSDP_HOOK_NONE},
             {"fp16", TDM_FSDP_HOOK_FP16},
             {"bf16", TDM_FSDP_HOOK_BF16}};
    for (size_t i = 0; text && i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(text, t[i].name)) {
            *out = t[i].h;
            return TDM_STATUS_OK;
        }
    if (text && !strcmp(text, "powersgd"))
        return tdm_error_set(TDM_STATUS_INVALID_ARG,
                             "comm hook powersgd is not defined for the sharded modes: PowerSGD "
                             "all-reduces low-rank factors of each whole gradient matrix and "
                             "keeps every rank's full local error between steps, while a "
                             "reduce-scatter leaves each rank only its shard (PyTorch's FSDP "
                             "offers only the fp16 and bf16 hooks for sharded strategies); use "
                             "fp16 or bf16, or --mode ddp for powersgd");
    return tdm_error_set(TDM_STATUS_INVALID_ARG,
                         "unknown fsdp comm hook '%s': expected fp16, bf16, or allreduce (also "
                         "none: float32, no compression)", text ? text : "(null)");
}

tdm_fsdp_comm_hook tdm_fsdp_get_comm_hook(const tdm_fsdp *f) { return f->o.comm_hook; }

tdm_status tdm_fsdp_hook_check(const tdm_fsdp_opts *o, tdm_model *m)
{
    if (!o || o->comm_hook == TDM_FSDP_HOOK_NONE) return TDM_STATUS_OK;
    TDM_REQUIRE((unsigned)o->comm_hook < TDM_FSDP_HOOK_COUNT_, TDM_STATUS_INVALID_ARG,
                "fsdp: comm_hook %d is not one of TDM_FSDP_HOOK_NONE, TDM_FSDP_HOOK_FP16, "
                "TDM_FSDP_HOOK_BF16", (int)o->comm_hook);
    tdm_device *d = tdm_model_device(m);
    TDM_REQUIRE(tdm_dev_kind(d) == TDM_DEVICE_HOST, TDM_STATUS_UNSUPPORTED,
                "fsdp: comm hook %s runs on host devices only (the model is on %s): the "
                "gradients are rounded to 16 bits by the CPU; leave the hook out on GPUs",
                tdm_fsdp_comm_hook_name(o->comm_hook), tdm_dev_name(d));
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_hook_launch(tdm_fsdp *f, int u, const float *full)
{
    tdm_fsdp_unit *x = &f->u[u];
    int bf = f->o.comm_hook == TDM_FSDP_HOOK_BF16;
    float *blk = NULL;
    size_t got = 0;
    tdm_fsdp_hook_release(f, u);   /* one a failed step left (its collective has ended) */
    /* from the pool, so that the unit memory figures count it */
    TDM_CHECK(tdm_fsdp_pool_get(f, (size_t)x->padded * sizeof(uint16_t), 0, &blk, &got));
    uint16_t *h = (uint16_t *)blk;
    for (int64_t i = 0; i < x->padded; i++)
        h[i] = bf ? tdm_f32_to_bf16(full[i]) : tdm_f32_to_f16(full[i]);
    x->hook_buf = h;
    x->hook_bytes = got;
    /* labelled last, right before the call: a label set before the block
     * was allocated stayed pending when the allocation failed and named
     * the communicator's next collective */
    tdm_comm_set_label(f->comm, "%s reduce_scatter unit %d", tdm_fsdp_tag(f), u);
    /* in place: this rank's slice of the block receives the sum */
    tdm_status st = tdm_comm_reduce_scatter_async(
        f->comm, h, h + (int64_t)f->rank * x->shard, (size_t)x->shard,
        bf ? TDM_DTYPE_BFLOAT16 : TDM_DTYPE_FLOAT16, TDM_REDOP_SUM, &x->rs);
    if (st) tdm_fsdp_hook_release(f, u);   /* nothing was submitted */
    return st;
}

void tdm_fsdp_hook_finish(tdm_fsdp *f, int u)
{
    tdm_fsdp_unit *x = &f->u[u];
    if (!x->hook_buf) return;
    int bf = f->o.comm_hook == TDM_FSDP_HOOK_BF16;
    const uint16_t *h = x->hook_buf + (int64_t)f->rank * x->shard;
    float *dst;
    if (f->o.sharding == TDM_FSDP_SHARD_OPTIM)
        dst = f->buf.gfull + x->full_off + (int64_t)f->rank * x->shard;
    else
        dst = x->rs_tmp ? x->rs_tmp : f->buf.gshard + x->shard_off;
    for (int64_t i = 0; i < x->shard; i++)
        dst[i] = bf ? tdm_bf16_to_f32(h[i]) : tdm_f16_to_f32(h[i]);
    tdm_fsdp_hook_release(f, u);
}

void tdm_fsdp_hook_release(tdm_fsdp *f, int u)
{
    tdm_fsdp_unit *x = &f->u[u];
    tdm_fsdp_pool_put(f, (float *)x->hook_buf, x->hook_bytes);
    x->hook_buf = NULL;
    x->hook_bytes = 0;
}
