/* tools/rank_mesh.c: the plumbing the mesh designs' CLI tables share
 * (tools/rank_mesh.h). */
#include "tools/rank_mesh.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/batch.h"

tdm_status tdm_tool_mesh_parse(const tdm_tool_build *b, int world, const tdm_mesh_shape *dflt,
                               tdm_mesh_shape *shape)
{
    if (!b->pp.mesh) {
        *shape = *dflt;
        return TDM_STATUS_OK;
    }
    if (tdm_mesh_parse(b->pp.mesh, world, shape) == TDM_STATUS_OK) return TDM_STATUS_OK;
    char why[TDM_ERROR_MSG_MAX];   /* copied: the message is rewritten */
    snprintf(why, sizeof why, "%s", tdm_error_message());
    return tdm_error_set(TDM_STATUS_USAGE, "--mesh: %s", why);
}

tdm_status tdm_tool_mesh_rank_new(const tdm_tool_build *b, tdm_dist_rank *d, size_t wsize,
                                  void **self)
{
    tdm_tool_rank *r = calloc(1, sizeof *r);
    tdm_tool_mesh *mm = calloc(1, wsize);
    if (!r || !mm) {
        free(r);
        free(mm);
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "rank %d: calloc", d->env.rank);
    }
    *self = r;
    *r = (tdm_tool_rank){.b = b, .dist = d, .rank = d->env.rank, .world = d->env.world_size,
                         .w = mm};
    mm->rank = d->env.rank;
    for (int k = 0; k < TDM_MESH_NDIMS; k++) {
        mm->coord[k] = d->coord[k];
        mm->size[k] = d->shape.size[k];
        mm->host[k] = mm->dev[k] = tdm_mesh_comm(d->mesh, (tdm_mesh_dim)k);
    }
    if (d->dev_comm == d->comm) return TDM_STATUS_OK;
    /* on a GPU the design's device collectives run over NCCL (the device
     * communicator's own mesh), its host collectives over the group's */
    tdm_status st = tdm_mesh_init(&mm->dev_mesh, d->dev_comm, &d->shape);
    if (st) return tdm_tool_rank_fail(r, "device mesh", st);
    for (int k = 0; k < TDM_MESH_NDIMS; k++)
        mm->dev[k] = tdm_mesh_comm(mm->dev_mesh, (tdm_mesh_dim)k);
    return TDM_STATUS_OK;
}

void tdm_tool_mesh_fini(tdm_tool_mesh *mm)
{
    if (!mm) return;
    tdm_mesh_free(mm->dev_mesh);
    mm->dev_mesh = NULL;
}

tdm_status tdm_tool_mesh_step(tdm_dist_stepper *s, const tdm_tool_mesh *mm, int in_elems,
                              int out_rows, tdm_tool_mesh_step_fn fn, void *ctx, const char *who,
                              const char *label, const void *x, const int32_t *y, int batch,
                              double *loss_mean)
{
    int rep = mm->coord[TDM_MESH_DP], reps = mm->size[TDM_MESH_DP];
    s->begun++;
    if (s->before) s->before(s->before_ctx, s->begun);
    /* images: x, y hold the global batch, of which this replica runs its
     * share; a GPT's: only this replica's windows (drawn alike by every
     * rank of the replica) of a global batch of s->global_batch */
    int global = s->own_rows ? s->global_batch : batch;
    int64_t lo = 0, hi = batch;
    if (!s->own_rows) tdm_dist_share(batch, rep, reps, &lo, &hi);
    const char *xs = (const char *)x + lo * in_elems * 4;
    const int32_t *ys = y + lo * out_rows;
    double ls = 0.0;
    TDM_CHECK(fn(ctx, xs, ys, (int)(hi - lo), 1.0f / (float)global, &ls));
    char where[128];
    snprintf(where, sizeof where, "the global batch of %d, seen by %s of replica %d", global,
             who, rep);
    return tdm_dist_replicas_loss(s->comm, mm->host[TDM_MESH_DP], mm->loss_summed ? 1 : reps,
                                  s->rank, label, ls,
                                  global, tdm_optim_steps(s->opt), where, loss_mean);
}

tdm_status tdm_tool_mesh_eval_loss(tdm_tool_mesh_eval_fn fn, void *ctx, int says, const void *x,
                                   const int32_t *y, int n, double *loss_sum)
{
    double ls = 0.0;
    int64_t correct = 0;
    *loss_sum = 0.0;
    if (n == 0) return TDM_STATUS_OK;   /* every rank of the replica has the same n */
    TDM_CHECK(fn(ctx, x, y, n, &ls, &correct));
    if (says) *loss_sum = ls;
    return TDM_STATUS_OK;
}

static float *tdm_tool_ckpt_floats(int64_t n)
{
    return calloc((size_t)(n > 0 ? n : 1), sizeof(float));
}

tdm_status tdm_tool_ckpt_host(const tdm_model *tables, const tdm_optim *opt, tdm_ckpt_host *h)
{
    memset(h, 0, sizeof *h);
    int64_t n = tdm_model_param_elems(tables), nb = tdm_model_buffer_elems(tables);
    h->params = tdm_tool_ckpt_floats(n);
    TDM_REQUIRE(h->params, TDM_STATUS_OUT_OF_MEMORY, "checkpoint: %lld floats", (long long)n);
    if (nb) {
        h->buffers = tdm_tool_ckpt_floats(nb);
        TDM_REQUIRE(h->buffers, TDM_STATUS_OUT_OF_MEMORY, "checkpoint: %lld floats",
                    (long long)nb);
    }
    if (!opt) return TDM_STATUS_OK;
    h->optim = tdm_optim_get_opts(opt);
    for (int i = 0; i < tdm_optim_n_state(opt); i++) {
        h->state[i] = tdm_tool_ckpt_floats(n);
        TDM_REQUIRE(h->state[i], TDM_STATUS_OUT_OF_MEMORY, "checkpoint: %lld floats",
                    (long long)n);
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_tool_mesh_save(const tdm_tool_mesh *mm, tdm_comm *group, int root,
                              const tdm_model *tables, tdm_optim *opt, tdm_tool_gather_fn fn,
                              void *ctx, const char *path, const tdm_ckpt_info *info)
{
    if (mm->coord[TDM_MESH_DP] != 0) return TDM_STATUS_OK;
    tdm_ckpt_host h;
    memset(&h, 0, sizeof h);
    tdm_status st = root ? tdm_tool_ckpt_host(tables, opt, &h) : TDM_STATUS_OK;
    if (st) {
        tdm_comm_abort(group, tdm_error_message());
    } else if (root) {
        st = fn(ctx, &h, 1);
    } else {
        tdm_ckpt_host mine = {.optim = opt ? tdm_optim_get_opts(opt) : NULL};
        st = fn(ctx, &mine, 0);
    }
    if (st == TDM_STATUS_OK && root) st = tdm_checkpoint_save_host(path, tables, &h, info);
    tdm_ckpt_host_free(&h);
    return st;
}

tdm_status tdm_tool_mesh_load(const tdm_model *tables, tdm_optim *opt, tdm_tool_load_fn fn,
                              void *ctx, const char *path, tdm_ckpt_info *info)
{
    tdm_ckpt_host h;
    tdm_status st = tdm_tool_ckpt_host(tables, opt, &h);
    if (st == TDM_STATUS_OK) st = tdm_checkpoint_load_host(path, tables, &h, info);
    if (st == TDM_STATUS_OK) st = fn(ctx, &h);
    tdm_ckpt_host_free(&h);
    return st;
}

void tdm_tool_mesh_replicas_str(const tdm_tool_mesh *mm, const char *how, char *buf, size_t n)
{
    int reps = mm->size[TDM_MESH_DP];
    if (reps > 1) snprintf(buf, n, ", x %d replicas (%s)", reps, how);
    else if (n) buf[0] = '\0';
}
