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

/* "fsdp join count", "zero2 join count": the count's flight-recorder label. */
static const char *tdm_fsdp_join_label(const tdm_fsdp *f, char *buf, size_t n)
{
    snprintf(buf, n, "%s join count", tdm_fsdp_tag(f));
    return buf;
}

tdm_status tdm_fsdp_join_forward(tdm_fsdp *f, int train, int batch, int by_active, float *scale)
{
    char label[32];
    if (train && f->world > 1 && !f->join.joined)
        TDM_CHECK(tdm_dist_join_count(&f->join, f->hcomm, f->pass.sync, "fsdp",
                                      tdm_fsdp_join_label(f, label, sizeof label)));
    *scale = tdm_dist_join_scale(&f->join, f->world, batch, by_active, *scale);
    return TDM_STATUS_OK;
}

int tdm_fsdp_active_ranks(const tdm_fsdp *f) { return f->join.n_active; }

/* One step of the others, as a rank without samples: a zero sample
 * through forward and backward (FULL_SHARD's gathers, the buffer
 * broadcast); sync, a synchronised step (zero contributions, this rank's
 * shard of their sum, and its optimizer step); else a no_sync
 * micro-batch (zeros accumulated; no reduce-scatter, no step). */
static tdm_status tdm_fsdp_shadow_step(void *w, tdm_optim *opt, int sync)
{
    tdm_fsdp *f = w;
    if (!sync) {
        f->pass.sync = 0;
        tdm_status st = tdm_fsdp_forward_scaled(f, NULL, NULL, 0, 0.0f, NULL);
        if (st == TDM_STATUS_OK) st = tdm_fsdp_backward(f);
        f->pass.sync = 1;
        return st;
    }
    TDM_CHECK(tdm_fsdp_zero_grad(f));
    TDM_CHECK(tdm_fsdp_forward_scaled(f, NULL, NULL, 0, 0.0f, NULL));
    TDM_CHECK(tdm_fsdp_backward(f));
    return tdm_fsdp_step(f, opt);
}

tdm_status tdm_fsdp_join(tdm_fsdp *f, tdm_optim *opt, int64_t *shadowed)
{
    TDM_REQUIRE(opt, TDM_STATUS_INVALID_ARG,
                "fsdp join: the optimizer is required: this rank owns shards of the parameters "
                "and optimizer state, and steps them with the others");
    char label[32];
    tdm_dist_shadow s = {.who = "fsdp", .label = tdm_fsdp_join_label(f, label, sizeof label),
                         .enabled = f->o.join, .sync = f->pass.sync, .fwd = &f->fwd,
                         .fn = tdm_fsdp_shadow_step, .w = f, .opt = opt};
    tdm_status st = tdm_dist_join_shadow(&f->join, f->hcomm, f->rank, f->world, &s, shadowed);
    if (st) {
        (void)tdm_comm_abort(f->comm, tdm_error_message());
        if (f->hcomm != f->comm) (void)tdm_comm_abort(f->hcomm, tdm_error_message());
    }
    return st;
}
