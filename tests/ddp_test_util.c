/* tests/ddp_test_util.c: the DDP tests' helpers, declared and explained
 * in tests/test_ddp_util.h, compiled once and linked into every test
 * binary. No Criterion here: the TSan build's stand-in for Criterion is
 * header-only with its state per file (tddp_check_equiv, which asserts,
 * stays in the header for that reason). */
#define TDDP_NO_CRITERION
#include "tests/test_ddp_util.h"

tddp_shared *tddp_shared_new(void)
{
    void *p = mmap(NULL, sizeof(tddp_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) return NULL;
    memset(p, 0, sizeof(tddp_shared));
    return p;
}


void tddp_spec_dims(tdm_model_spec *s, int cnn, const int *dims, int ndims)
{
    if (!cnn && dims) {
        tdm_model_spec_mlp(s, dims, ndims);
        return;
    }
    if (cnn) {
        tdm_model_spec_cnn(s);
        s->in_c = 1; s->in_h = 8; s->in_w = 8;
        s->ch1 = 3; s->ch2 = 4; s->n_classes = 5;
    } else {
        int d[] = {20, 16, 12, 5};
        tdm_model_spec_mlp(s, d, 4);
    }
}


void tddp_word_text(uint8_t *bytes, size_t n, const char *const *words, int n_words,
                    uint64_t seed)
{
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_TEST);
    size_t k = 0;
    while (k < n) {
        const char *p = words[tdm_rng_below(&r, (uint64_t)n_words)];
        while (*p && k < n) bytes[k++] = (uint8_t)*p++;
    }
}

const tdm_text *tddp_text(void)
{
    static uint8_t bytes[4000];
    static tdm_text t = {.bytes = bytes, .n = sizeof bytes};
    static const char *const w[] = {"one ", "two ", "three ", "four\n", "five, ", "six. "};
    if (!bytes[0]) tddp_word_text(bytes, sizeof bytes, w, 6, 3);
    return &t;
}

/* ---- uneven inputs (join): the plan and its one-device reference ---- */

const int tddp_join_batches[TDDP_JOIN_WORLD] = {3, 5, 8};
const int tddp_join_size[TDDP_JOIN_WORLD] = {4, 6, 5};

int64_t tddp_join_first(int r, int s) { return ((int64_t)s * TDDP_JOIN_WORLD + r) * 8; }

tdm_status tddp_join_reference(const tdm_model_spec *spec, const tdm_dataset *data, float *out,
                               int64_t *n)
{
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_status st = TDM_STATUS_OK;
    float x[8 * 64];
    int32_t y[8];
    TDM_REQUIRE(tdm_data_features(data) * 8 <= (int64_t)(sizeof x / sizeof x[0]),
                TDM_STATUS_INVALID_ARG, "join reference: %lld features",
                (long long)tdm_data_features(data));
    TDM_TRY(tdm_device_open(&dev, "cpu", 0, 1));
    TDM_TRY(tdm_model_init(&m, dev, spec, 5));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    for (int s = 0; s < TDDP_JOIN_STEPS; s++) {
        int active = 0;
        for (int r = 0; r < TDDP_JOIN_WORLD; r++) active += tddp_join_batches[r] > s;
        TDM_TRY(tdm_model_zero_grad(m));
        for (int r = 0; r < TDDP_JOIN_WORLD; r++) {
            if (tddp_join_batches[r] <= s) continue;
            int b = tddp_join_size[r];
            int64_t idx[8];
            for (int i = 0; i < b; i++) idx[i] = tddp_join_first(r, s) + i;
            tdm_data_gather(data, idx, b, x, y);
            const float *logits;
            double ls;
            TDM_TRY(tdm_model_forward(m, x, b, &logits));
            float *dl = tdm_model_loss_grad(m);
            TDM_TRY(tdm_model_loss(m, logits, y, b, 1.0f / ((float)b * (float)active), &ls, dl));
            TDM_TRY(tdm_model_backward(m, dl));
        }
        TDM_TRY(tdm_optim_step(opt));
    }
    *n = tdm_model_param_elems(m);
    memcpy(out, tdm_model_params(m), (size_t)*n * sizeof(float));
fail:
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}


tdm_status tddp_data(tdm_dataset *d, int cnn, int64_t n)
{
    return cnn ? tdm_data_synthetic(d, n, 1, 8, 8, 5, 77, 0)
               : tdm_data_synthetic(d, n, 1, 4, 5, 5, 77, 0);
}


int tddp_rank_main(tdm_comm *comm, void *arg)
{
    tddp_run *run = arg;
    const tddp_cfg *c = run->cfg;
    tddp_shared *sh = run->sh;
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_comm *gcomm = NULL;   /* cfg->make_comm's, owned */
    tdm_model_spec spec;
    int64_t *perm = NULL;
    float *x = NULL;
    int32_t *y = NULL;
    tdm_status st = TDM_STATUS_OK;
    int64_t feat = c->gpt ? TDDP_GPT_T : tdm_data_features(run->data);
    int64_t rows = c->gpt ? TDDP_GPT_T : 1;   /* targets per sample */
    if (c->gpt) tddp_spec_gpt(&spec);
    else tddp_spec_dims(&spec, c->cnn, c->dims, c->ndims);
    if (c->bad_layout_rank == rank) spec.dims[2] = 13;
    if (c->open_dev) TDM_TRY(c->open_dev(&dev, rank));
    else TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5 + (c->seed_by_rank ? (uint64_t)rank : 0)));
    if (c->make_comm) TDM_TRY(c->make_comm(&gcomm, comm, dev));
    tdm_ddp_opts o = {.no_overlap = c->no_overlap,
                      .bucket_cap_bytes = c->cap_rank == rank ? c->rank_cap_bytes : c->cap_bytes,
                      .first_bucket_bytes = c->first_bytes,
                      .find_unused_parameters = c->find_unused, .timeout_ms = 20000,
                      .sync_bn = c->sync_bn,
                      .host_comm = gcomm ? comm : NULL};
    TDM_TRY(tdm_ddp_init(&ddp, m, gcomm ? gcomm : comm, &o));
    if (c->comm_hook) TDM_TRY(tdm_ddp_set_comm_hook(ddp, c->comm_hook, &c->psgd));
    if (c->user_hook) TDM_TRY(tdm_ddp_register_comm_hook(ddp, c->user_hook));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    sh->zero_copy = tdm_ddp_zero_copy(ddp);
    perm = malloc((size_t)(c->gpt ? 1 : run->data->n) * sizeof *perm);
    x = malloc((size_t)c->batch * (size_t)feat * sizeof *x);
    y = malloc((size_t)c->batch * (size_t)rows * sizeof *y);
    if (!perm || !x || !y) { st = TDM_STATUS_OUT_OF_MEMORY; goto fail; }
    if (!c->gpt) tdm_train_epoch_order(perm, run->data->n, 1, 0);
    int micro = c->micro > 1 ? c->micro : 1;
    for (int s = 0; s < c->steps; s++) {
        /* global batch s, split in `micro` micro-batches, each split by rank */
        const int64_t *gidx = c->gpt ? perm : perm + (int64_t)s * c->batch;
        double loss_sum = 0.0;
        TDM_TRY(tdm_ddp_zero_grad(ddp));
        for (int k = 0; k < micro; k++) {
            int mb0 = (int)((int64_t)k * c->batch / micro), mb1 = (int)((int64_t)(k + 1) * c->batch / micro);
            int mb = mb1 - mb0;
            int64_t lo64, hi64;
            tdm_dist_share(mb, rank, world, &lo64, &hi64);
            int lo = (int)lo64, hi = (int)hi64;
            if (c->gpt)
                tdm_text_windows(tddp_text(), TDDP_GPT_T, 1, s, mb0 + lo, hi - lo, (int32_t *)x, y);
            else
                tdm_data_gather(run->data, gidx + mb0 + lo, hi - lo, x, y);
            double ls = 0.0;
            tdm_ddp_no_sync(ddp, k + 1 < micro);
            TDM_TRY(tdm_ddp_forward_scaled(ddp, x, y, hi - lo, 1.0f / (float)c->batch, &ls));
            loss_sum += ls;
            int detach = c->detach_layer > 0 && ((c->detach_ranks >> rank) & 1) && s == 0 &&
                         (c->detach_micro < 0 || c->detach_micro == k);
            TDM_TRY(tdm_model_set_backward_stop(m, detach ? c->detach_layer : 0));
            if (c->skip_backward_rank == rank && s == 1) continue;
            TDM_TRY(tdm_ddp_backward(ddp));
        }
        (void)loss_sum;
        loss_sum = tdm_ddp_loss_sum(ddp);   /* all ranks' losses, with the gradients */
        if (rank == 0) sh->loss[s] = loss_sum / c->batch;
        if (s == 0 && tdm_model_param_elems(m) <= TDDP_MAX_ELEMS) {
            float *dst = rank == 0 ? sh->grads0 : rank == world - 1 ? sh->grads0_r1 : NULL;
            if (dst)
                TDM_TRY(tdm_dev_copy_to_host(dev, dst, tdm_model_grads(m),
                                             (size_t)tdm_model_param_elems(m) * 4));
        }
        TDM_TRY(tdm_ddp_step(ddp, opt));
        if (rank == 0 && s < TDDP_MAX_STEPS) {
            tdm_ddp_times t;
            tdm_ddp_get_times(ddp, &t);
            sh->nb_step[s] = t.n_buckets;
            sh->overlapped[s] = t.overlapped_bytes_total;
            sh->reduced[s] = t.reduced_bytes_total;
        }
    }
    if (rank == 0 || rank == world - 1) {
        int (*plan)[2] = rank == 0 ? sh->plan : sh->plan_r1;
        int nb = tdm_ddp_n_buckets(ddp);
        if (rank == 0) sh->n_buckets = nb;
        for (int b = 0; b < nb && b < TDDP_MAX_BUCKETS; b++)
            tdm_ddp_bucket_info(ddp, b, &plan[b][0], &plan[b][1], NULL,
                                rank == 0 ? &sh->plan_elems[b] : NULL);
    }
    if (rank == 0) {
        tdm_ddp_times t;
        tdm_ddp_get_times(ddp, &t);
        sh->timed_steps = t.steps;
        sh->launch_order_ok = t.n_buckets == tdm_ddp_n_buckets(ddp);
        for (int i = 0; i < t.n_buckets; i++) {
            const tdm_ddp_bucket_times *b = &t.buckets[i];
            if (b->start_ms < b->ready_ms || b->end_ms < b->start_ms) sh->launch_order_ok = 0;
            if (i > 0 && b->start_ms < t.buckets[i - 1].start_ms) sh->launch_order_ok = 0;
        }
    }
    if (tdm_model_param_elems(m) <= TDDP_MAX_ELEMS) {
        sh->n_elem = tdm_model_param_elems(m);
        float *dst = rank == 0 ? sh->params : rank == world - 1 ? sh->params_r1 : NULL;
        if (dst)
            TDM_TRY(tdm_dev_copy_to_host(dev, dst, tdm_model_params(m), (size_t)sh->n_elem * 4));
    }
fail:
    if (rank < 8) {
        sh->status[rank] = st;
        snprintf(sh->err[rank], sizeof sh->err[rank], "%s", st ? tdm_error_message() : "");
    }
    if (st) fprintf(stderr, "rank %d: %s\n", rank, tdm_error_message());
    free(perm);
    free(x);
    free(y);
    tdm_ddp_free(ddp);
    tdm_comm_free(gcomm);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}


tdm_status tddp_spawn(int world, const tddp_cfg *cfg, const tdm_dataset *data,
                             tddp_shared *sh, int64_t timeout_ms)
{
    tddp_run run = {.cfg = cfg, .data = data, .sh = sh};
    tdm_dist_spawn_opts o = {.timeout_ms = timeout_ms, .arena_bytes = cfg->no_arena ? 0 : 1 << 20,
                            .comm_timeout_ms = 20000};
    return tdm_dist_spawn(world, tddp_rank_main, &run, &o, NULL);
}


tdm_status tddp_reference(const tddp_cfg *c, const tdm_dataset *data, double *loss,
                                 float *grads0, float *params, int64_t *n_elem)
{
    tdm_status st = TDM_STATUS_OK;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    tdm_single single = {0};
    int64_t feat = c->gpt ? TDDP_GPT_T : tdm_data_features(data);
    int64_t rows = c->gpt ? TDDP_GPT_T : 1;
    int64_t *perm = malloc((size_t)(c->gpt ? 1 : data->n) * sizeof *perm);
    float *x = malloc((size_t)c->batch * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)c->batch * (size_t)rows * sizeof *y);
    if (c->gpt) tddp_spec_gpt(&spec);
    else tddp_spec_dims(&spec, c->cnn, c->dims, c->ndims);
    TDM_TRY(tdm_device_open(&dev, "cpu", 0, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    single.model = m;
    single.opt = opt;
    if (!c->gpt) tdm_train_epoch_order(perm, data->n, 1, 0);
    for (int s = 0; s < c->steps; s++) {
        if (c->gpt)
            tdm_text_windows(tddp_text(), TDDP_GPT_T, 1, s, 0, c->batch, (int32_t *)x, y);
        else
            tdm_data_gather(data, perm + (int64_t)s * c->batch, c->batch, x, y);
        TDM_TRY(tdm_single_step(&single, x, y, c->batch, &loss[s]));
        if (s == 0 && grads0)
            memcpy(grads0, tdm_model_grads(m), (size_t)tdm_model_param_elems(m) * 4);
    }
    *n_elem = tdm_model_param_elems(m);
    if (params) memcpy(params, tdm_model_params(m), (size_t)*n_elem * 4);
fail:
    free(perm);
    free(x);
    free(y);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st;
}


double tddp_excess(const float *a, const float *b, int64_t n, double atol, double rtol,
                          int64_t *where)
{
    double worst = -1e30;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]) - (atol + rtol * fabs((double)b[i]));
        if (e > worst) { worst = e; if (where) *where = i; }
    }
    return worst;
}


tddp_cfg tddp_cfg_default(void)
{
    return (tddp_cfg){.batch = 24, .steps = 1, .detach_micro = -1, .skip_backward_rank = -1,
                      .bad_layout_rank = -1, .cap_rank = -1};
}
