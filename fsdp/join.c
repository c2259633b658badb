/* fsdp/join.c: uneven inputs for the sharded modes (tdm_fsdp_opts.join,
 * tdm_fsdp_join; PyTorch's Join, as ddp/ddp.c's tdm_ddp_join). Every
 * training forward of a rank that still has data first counts, in one
 * int32 SUM over the host communicator, the ranks that still train and
 * those whose backward will synchronise; the loss gradient is averaged
 * over the ranks that train. A rank out of data calls tdm_fsdp_join and
 * answers the count with 0 at each of the others' forwards, then takes
 * part in what they do: the buffer broadcast and, in FULL_SHARD, every
 * all-gather of forward and backward (by running a zero sample with a
 * zero loss gradient, as fsdp/fsdp.c does for a rank without samples);
 * at a synchronised step, the reduce-scatters with zero gradients and
 * the optimizer step of its shards (whose all-gathers, in grad_op and
 * optimizer, are collective). When every rank has joined, the count is 0
 * everywhere and all leave together. */
#include "fsdp/fsdp_impl.h"

#include <stdio.h>

static tdm_status tdm_fsdp_join_count(tdm_fsdp *f)
{
    int32_t v[2] = {f->joined ? 0 : 1, !f->joined && f->sync};
    /* named, as every fsdp collective: a rank that never comes to the
     * count is found here by `tandem doctor` */
    tdm_comm_set_label(f->hcomm, "%s join count", tdm_fsdp_tag(f));
    tdm_status st = tdm_comm_all_reduce(f->hcomm, v, v, 2, TDM_DTYPE_INT32, TDM_REDOP_SUM);
    if (st) return tdm_error_prefix(st, "fsdp join: counting the ranks that still have data");
    /* every rank sees the same sums, so every rank fails here alike */
    TDM_REQUIRE(v[1] == 0 || v[1] == v[0], TDM_STATUS_INVALID_ARG,
                "fsdp join: %d of the %d ranks still training synchronise in this forward and "
                "the others are under no_sync; call tdm_fsdp_no_sync alike on every rank, "
                "before the forward", v[1], v[0]);
    f->n_active = v[0];
    f->join_sync = v[1] > 0;
    return TDM_STATUS_OK;
}

tdm_status tdm_fsdp_join_forward(tdm_fsdp *f, int train, int batch, int by_active, float *scale)
{
    if (train && f->world > 1 && !f->joined) TDM_CHECK(tdm_fsdp_join_count(f));
    if (by_active)
        *scale = batch > 0 ? 1.0f / ((float)batch * (float)f->n_active) : 0.0f;
    else if (f->n_active > 0 && f->n_active != f->world)
        /* a scale meant for every rank: the mean over those that contribute */
        *scale *= (float)f->world / (float)f->n_active;
    return TDM_STATUS_OK;
}

int tdm_fsdp_active_ranks(const tdm_fsdp *f) { return f->n_active; }

tdm_status tdm_fsdp_join(tdm_fsdp *f, tdm_optim *opt, int64_t *shadowed)
{
    TDM_REQUIRE(f->o.join, TDM_STATUS_INVALID_ARG,
                "fsdp join: construct FSDP with opts.join = 1 (every rank counts the ranks with "
                "data at each forward)");
    TDM_REQUIRE(f->sync, TDM_STATUS_INVALID_ARG,
                "fsdp join: called under no_sync; finish the accumulation first");
    TDM_REQUIRE(opt, TDM_STATUS_INVALID_ARG,
                "fsdp join: the optimizer is required: this rank owns shards of the parameters "
                "and optimizer state, and steps them with the others");
    int64_t n = 0;
    if (shadowed) *shadowed = 0;
    if (f->world == 1) return TDM_STATUS_OK;
    f->joined = 1;
    f->have_fwd = 0;
    tdm_status st = TDM_STATUS_OK;
    for (;;) {
        if ((st = tdm_fsdp_join_count(f))) break;
        if (f->n_active == 0) break;   /* every rank has joined: all leave here */
        if (!f->join_sync) {
            /* a no_sync micro-batch of the others: forward and backward
             * (FULL_SHARD's gathers, the buffer broadcast), zeros
             * accumulated; no reduce-scatter, no step */
            f->sync = 0;
            st = tdm_fsdp_forward_scaled(f, NULL, NULL, 0, 0.0f, NULL);
            if (st == TDM_STATUS_OK) st = tdm_fsdp_backward(f);
            f->sync = 1;
            if (st) break;
            continue;
        }
        /* one synchronised step of the others: zero contributions, this
         * rank's shard of their sum, and its optimizer step */
        if ((st = tdm_fsdp_zero_grad(f))) break;
        if ((st = tdm_fsdp_forward_scaled(f, NULL, NULL, 0, 0.0f, NULL))) break;
        if ((st = tdm_fsdp_backward(f))) break;
        if ((st = tdm_fsdp_step(f, opt))) break;
        n++;
    }
    /* a later epoch starts with every rank training again */
    f->joined = 0;
    f->n_active = f->world;
    if (shadowed) *shadowed = n;
    if (st) {
        tdm_error_prefix(st, "fsdp join: rank %d, after shadowing %lld step(s)", f->rank,
                         (long long)n);
        (void)tdm_comm_abort(f->comm, tdm_error_message());
        if (f->hcomm != f->comm) (void)tdm_comm_abort(f->hcomm, tdm_error_message());
    }
    return st;
}
