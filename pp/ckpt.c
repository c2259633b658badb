/* pp/ckpt.c: a pipeline's checkpoints: the whole model's state (its
 * parameters, buffers, optimizer state and step count, in the whole
 * model's flat layout) gathered on one stage from every stage's slice, so
 * that it writes the very file every mode writes
 * (tdm_checkpoint_save_host), and each stage's slice taken from a whole
 * model's state read from any mode's file. Not the file format
 * (models/checkpoint.c) and not the command line. */
#include "pp/pp_impl.h"

#include <stdlib.h>
#include <string.h>

/* One kind of state: n floats at dev_src (device memory), which are the
 * whole model's [off, off + n), to full + off on root. Stages send in
 * stage order over the host communicator. */
static tdm_status tdm_pp_gather_one(tdm_pp *p, const float *dev_src, int64_t n, int64_t off,
                                    float *full, int root, const char *what)
{
    tdm_status st = TDM_STATUS_OK;
    float *mine = malloc((size_t)(n ? n : 1) * sizeof *mine);
    if (!mine) {
        st = tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "pp gather: %lld floats", (long long)n);
        goto fail;
    }
    if (n) TDM_TRY(tdm_dev_copy_to_host(p->dev, mine, dev_src, (size_t)n * sizeof *mine));
    for (int r = 0; r < p->S; r++) {
        int64_t meta[2] = {off, n};
        if (r == p->s && r == root) {
            memcpy(full + off, mine, (size_t)n * sizeof *mine);
        } else if (r == p->s) {
            tdm_comm_set_label(p->hcomm, "pp gather %s of stage %d", what, r);
            TDM_TRY(tdm_comm_send(p->hcomm, meta, 2, TDM_DTYPE_INT64, root));
            if (n) TDM_TRY(tdm_comm_send(p->hcomm, mine, (size_t)n, TDM_DTYPE_FLOAT32, root));
        } else if (p->s == root) {
            tdm_comm_set_label(p->hcomm, "pp gather %s of stage %d", what, r);
            TDM_TRY(tdm_comm_recv(p->hcomm, meta, 2, TDM_DTYPE_INT64, r));
            if (meta[1])
                TDM_TRY(tdm_comm_recv(p->hcomm, full + meta[0], (size_t)meta[1],
                                      TDM_DTYPE_FLOAT32, r));
        }
    }
fail:
    free(mine);
    if (st) return tdm_pp_fail(p, st, "gathering the %s", what);
    return st;
}

/* Whether the root can take a gather (ok on the root; the others pass 1),
 * agreed before anything is sent: a gather the root refuses is refused on
 * every stage, and leaves no message queued for the next one. */
static tdm_status tdm_pp_gather_agree(tdm_pp *p, int ok, int root, const char *what)
{
    int32_t v = ok;
    tdm_comm_set_label(p->hcomm, "pp gather: root ready");
    tdm_status st = tdm_comm_broadcast(p->hcomm, &v, &v, 1, TDM_DTYPE_INT32, root);
    if (st) return tdm_pp_fail(p, st, "gathering");
    TDM_REQUIRE(v, TDM_STATUS_INVALID_ARG, "pp gather: %s %s; nothing was sent",
                p->s == root ? "the root (this stage) has no" : "the root stage has no", what);
    return TDM_STATUS_OK;
}

tdm_status tdm_pp_gather_params(tdm_pp *p, float *full, int root)
{
    TDM_REQUIRE(root >= 0 && root < p->S, TDM_STATUS_INVALID_ARG,
                "pp gather: root %d out of range (%d stages)", root, p->S);
    TDM_CHECK(tdm_pp_gather_agree(p, p->s != root || full, root, "a buffer"));
    return tdm_pp_gather_one(p, tdm_model_params(p->m), p->info.slice_elems,
                             p->info.slice_offset, full, root, "parameters");
}

tdm_status tdm_pp_gather_state(tdm_pp *p, tdm_ckpt_host *h, int root)
{
    TDM_REQUIRE(root >= 0 && root < p->S, TDM_STATUS_INVALID_ARG,
                "pp gather: root %d out of range (%d stages)", root, p->S);
    /* every stage runs the same gathers: the root's h decides which, so
     * the others learn it first, with whether the root can take them */
    int32_t want[3] = {p->s != root || (h && h->params), h && h->buffers, h && h->optim};
    tdm_comm_set_label(p->hcomm, "pp gather: what");
    tdm_status st = tdm_comm_broadcast(p->hcomm, want, want, 3, TDM_DTYPE_INT32, root);
    if (st) return tdm_pp_fail(p, st, "gathering the state");
    TDM_REQUIRE(want[0], TDM_STATUS_INVALID_ARG,
                "pp gather: %s no host arrays for the state; nothing was sent",
                p->s == root ? "the root (this stage) has" : "the root stage has");
    int me = p->s == root;
    TDM_CHECK(tdm_pp_gather_one(p, tdm_model_params(p->m), p->info.slice_elems,
                                p->info.slice_offset, me ? h->params : NULL, root, "parameters"));
    if (want[1])
        TDM_CHECK(tdm_pp_gather_one(p, tdm_model_buffers(p->m), tdm_model_buffer_elems(p->m),
                                    p->info.buffer_offset, me ? h->buffers : NULL, root,
                                    "buffers"));
    if (want[2]) {
        for (int i = 0; i < tdm_optim_n_state(p->opt); i++)
            TDM_CHECK(tdm_pp_gather_one(p, tdm_optim_state(p->opt, i), p->info.slice_elems,
                                        p->info.slice_offset, me ? h->state[i] : NULL, root,
                                        tdm_optim_state_name(p->opt, i)));
        if (me) h->steps = tdm_optim_steps(p->opt);
    }
    return TDM_STATUS_OK;
}

/* dst (device, n floats) = src (host). */
static tdm_status tdm_pp_put(tdm_pp *p, float *dst, const float *src, int64_t n)
{
    return n ? tdm_dev_copy_from_host(p->dev, dst, src, (size_t)n * sizeof *src) : TDM_STATUS_OK;
}

tdm_status tdm_pp_load_state(tdm_pp *p, const tdm_ckpt_host *h)
{
    TDM_REQUIRE(h && h->params, TDM_STATUS_INVALID_ARG, "pp load: no parameters to load");
    const tdm_model_stage_info *si = &p->info;
    const tdm_tensor_info *tied = si->tied_param >= 0 ? tdm_model_param_info(p->m, si->tied_param)
                                                      : NULL;
    TDM_CHECK(tdm_pp_put(p, tdm_model_params(p->m), h->params + si->slice_offset,
                         si->slice_elems));
    if (tied)
        TDM_CHECK(tdm_pp_put(p, tdm_model_params(p->m) + tied->offset,
                             h->params + si->tied_source_offset, tied->n_elem));
    if (h->buffers)
        TDM_CHECK(tdm_pp_put(p, tdm_model_buffers(p->m), h->buffers + si->buffer_offset,
                             tdm_model_buffer_elems(p->m)));
    if (h->optim) {
        const tdm_optim_opts *mine = tdm_optim_get_opts(p->opt);
        TDM_REQUIRE(h->optim->kind == mine->kind, TDM_STATUS_MISMATCH,
                    "pp load: the state is of another optimizer (kind %d, this stage's %d)",
                    (int)h->optim->kind, (int)mine->kind);
        for (int i = 0; i < tdm_optim_n_state(p->opt); i++) {
            float *s = tdm_optim_state(p->opt, i);
            TDM_CHECK(tdm_pp_put(p, s, h->state[i] + si->slice_offset, si->slice_elems));
            if (tied)
                TDM_CHECK(tdm_pp_put(p, s + tied->offset, h->state[i] + si->tied_source_offset,
                                     tied->n_elem));
        }
        tdm_optim_set_steps(p->opt, h->steps);
    }
    return tdm_dev_sync(p->dev);
}
