/* fsdp/det.c: what --deterministic K (dist/det.h) needs of the sharded
 * modes: the local gradient that no_sync backwards left in the units'
 * full gradient buffers, read out in the model's flat layout, and a
 * reduced gradient, summed by dist's tree instead of a reduce-scatter,
 * written into this rank's gradient shards. Not a collective: the tree
 * over the ranks is dist's. */
#include <string.h>

#include "fsdp/fsdp_impl.h"

tdm_status tdm_fsdp_local_grads(tdm_fsdp *f, float *host)
{
    TDM_REQUIRE(f && host, TDM_STATUS_INVALID_ARG, "fsdp local_grads: NULL argument");
    memset(host, 0, (size_t)tdm_model_param_elems(f->m) * sizeof(float));
    for (int u = 0; u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        /* a unit whose backward did not run (no samples) holds zeros */
        const float *src = f->o.sharding == TDM_FSDP_SHARD_OPTIM ? f->buf.gfull + x->full_off
                                                                 : x->gbuf;
        TDM_REQUIRE(!x->rs, TDM_STATUS_INVALID_ARG, "fsdp local_grads: unit %d is being "
                    "reduce-scattered (read the local gradients after a no_sync backward)", u);
        if (src)
            TDM_CHECK(tdm_dev_copy_to_host(f->dev, host + x->offset, src,
                                           (size_t)x->n_elem * sizeof(float)));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_set_grads(tdm_fsdp *f, const float *host)
{
    TDM_REQUIRE(f && host, TDM_STATUS_INVALID_ARG, "fsdp set_grads: NULL argument");
    /* drops the local full gradients, zeroes the shards (and their
     * padding past the unit's end) */
    TDM_CHECK(tdm_fsdp_zero_grad(f));
    for (int u = 0; u < f->nu; u++) {
        const tdm_fsdp_unit *x = &f->u[u];
        int64_t lo = (int64_t)f->rank * x->shard, n = x->n_elem - lo;
        if (n > x->shard) n = x->shard;
        if (n > 0)
            TDM_CHECK(tdm_dev_copy_from_host(f->sdev, tdm_fsdp_gshard(f, u),
                                             host + x->offset + lo,
                                             (size_t)n * sizeof(float)));
    }
    f->grad.zero = 0;
    return TDM_STATUS_OK;
}
