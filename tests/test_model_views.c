/* tests/test_model_views.c: what models/ and core/ offer sharded data
 * parallel, tested without it: per-tensor storage views (a model whose
 * flat buffers were released computes bitwise what the original does when
 * its tensors are read through views), parameter-use events (their order,
 * for the MLP, the CNN and the GPT), the error when a tensor has no
 * storage, the optimizer stepped over ranges of a shard (bitwise the
 * whole-model step, SGD with momentum and AdamW), the checkpoint written
 * from host arrays (the same bytes as from the model), and the device
 * allocator's accounting. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/data.h"
#include "models/checkpoint.h"
#include "models/gpt.h"
#include "models/model.h"
#include "models/optim.h"
#include "tests/test_util.h"

static tdm_device *g_dev;
static void setup(void) { g_dev = tu_host(); }
static void teardown(void) { tdm_device_free(g_dev); }
TestSuite(model_views, .init = setup, .fini = teardown);

static tdm_model *make(int kind, uint64_t seed)
{
    tdm_model_spec s;
    if (kind == 0) {
        static const int dims[] = {12, 9, 7, 4};
        tdm_model_spec_mlp(&s, dims, 4);
    } else if (kind == 1) {
        tdm_model_spec_cnn(&s);
        s.in_h = s.in_w = 8;
        s.ch1 = 3;
        s.ch2 = 4;
        s.n_classes = 4;
    } else {
        tdm_model_spec_gpt(&s, 2, 8, 2, 6);
    }
    tdm_model *m = NULL;
    TU_OK(tdm_model_init(&m, g_dev, &s, seed));
    return m;
}

static void batch_of(const tdm_model *m, int B, float *x, int32_t *y)
{
    tdm_rng r = tu_rng(11);
    int F = tdm_model_in_features(m), rows = tdm_model_out_rows(m), C = tdm_model_n_classes(m);
    for (int i = 0; i < B * F; i++) {
        if (tdm_model_input_dtype(m) == TDM_MODEL_INPUT_TOKENS)
            ((int32_t *)x)[i] = (int32_t)tdm_rng_below(&r, (uint64_t)C);
        else
            x[i] = tu_unif(&r, -1, 1);
    }
    for (int i = 0; i < B * rows; i++) y[i] = (int32_t)tdm_rng_below(&r, (uint64_t)C);
}

/* ---- views ---- */

/* Each unit of views is one block: its tensors live in a buffer of their
 * own (a copy of that range of the flat buffer). */
typedef struct viewer {
    tdm_model *m;
    float *pbuf[64], *gbuf[64];
    int n_events;
    int ev_use[256], ev_first[256], ev_last[256];
} viewer;

static tdm_status on_use(void *ctx, tdm_model *m, tdm_model_use use, int first, int last)
{
    viewer *v = ctx;
    (void)m;
    if (v->n_events < 256) {
        v->ev_use[v->n_events] = use;
        v->ev_first[v->n_events] = first;
        v->ev_last[v->n_events] = last;
    }
    v->n_events++;
    return TDM_STATUS_OK;
}

Test(model_views, released_model_through_views_is_bitwise_the_original)
{
    for (int kind = 0; kind < 3; kind++) {
        tdm_model *a = make(kind, 3), *b = make(kind, 3);
        int64_t pe = tdm_model_param_elems(a);
        int B = 5, F = tdm_model_in_features(a), rows = tdm_model_out_rows(a);
        float *x = tu_malloc((size_t)B * F * 4);
        int32_t *y = tu_malloc((size_t)B * rows * 4);
        batch_of(a, B, x, y);
        /* b's tensors move into per-layer copies; then its flat buffers go */
        viewer v = {.m = b};
        int nl = tdm_model_n_layers(b), nv = 0;
        for (int l = 0; l < nl; l++) {
            int f, la;
            tdm_model_layer_params(b, l, &f, &la);
            if (f > la) continue;
            const tdm_tensor_info *t0 = tdm_model_param_info(b, f), *t1 = tdm_model_param_info(b, la);
            int64_t n = t1->offset + t1->n_elem - t0->offset;
            v.pbuf[nv] = tu_malloc((size_t)n * 4);
            v.gbuf[nv] = tu_malloc((size_t)n * 4);
            memcpy(v.pbuf[nv], tdm_model_params(b) + t0->offset, (size_t)n * 4);
            TU_OK(tdm_model_set_param_view(b, f, la, v.pbuf[nv]));
            TU_OK(tdm_model_set_grad_view(b, f, la, v.gbuf[nv]));
            nv++;
        }
        TU_OK(tdm_model_release_storage(b));
        cr_assert_null(tdm_model_params(b));
        cr_assert_null(tdm_model_grads(b));
        tdm_model_set_use_hook(b, on_use, &v);
        double la_ = 0, lb = 0;
        TU_OK(tdm_model_forward_backward(a, x, y, B, &la_));
        TU_OK(tdm_model_forward_backward(b, x, y, B, &lb));
        cr_assert_eq(memcmp(&la_, &lb, sizeof la_), 0, "kind %d: loss %.9g vs %.9g", kind, la_, lb);
        /* every gradient, read through b's views, equals a's bit for bit */
        for (int i = 0; i < tdm_model_n_params(a); i++) {
            const tdm_tensor_info *t = tdm_model_param_info(a, i);
            int l = t->layer, k = 0;
            for (int j = 0; j < l; j++) {
                int f, la;
                tdm_model_layer_params(b, j, &f, &la);
                k += f <= la;
            }
            int f, lz;
            tdm_model_layer_params(b, l, &f, &lz);
            const float *g = v.gbuf[k] + (t->offset - tdm_model_param_info(b, f)->offset);
            cr_assert_eq(memcmp(g, tdm_model_grads(a) + t->offset, (size_t)t->n_elem * 4), 0,
                         "kind %d: gradient of %s differs", kind, t->name);
        }
        cr_assert_gt(v.n_events, 0);
        /* zero_grad of a released model zeroes the views */
        TU_OK(tdm_model_zero_grad(b));
        for (int k = 0; k < nv; k++) cr_assert_eq(v.gbuf[k][0], 0.0f);
        (void)pe;
        TU_OK(tdm_model_restore_storage(b));
        cr_assert_not_null(tdm_model_params(b));
        tdm_model_free(a);
        tdm_model_free(b);
        for (int k = 0; k < nv; k++) {
            free(v.pbuf[k]);
            free(v.gbuf[k]);
        }
        free(x);
        free(y);
    }
}

Test(model_views, use_events_come_before_each_use_in_order)
{
    /* MLP 12-9-7-4: three linear layers of parameters (0,1) (2,3) (4,5) */
    tdm_model *m = make(0, 1);
    viewer v = {.m = m};
    tdm_model_set_use_hook(m, on_use, &v);
    float x[3 * 12];
    int32_t y[3];
    batch_of(m, 3, x, y);
    TU_OK(tdm_model_forward_backward(m, x, y, 3, NULL));
    static const int want[6][3] = {{0, 0, 1}, {0, 2, 3}, {0, 4, 5},
                                   {1, 4, 5}, {1, 2, 3}, {1, 0, 1}};
    cr_assert_eq(v.n_events, 6);
    for (int i = 0; i < 6; i++)
        cr_assert(v.ev_use[i] == want[i][0] && v.ev_first[i] == want[i][1] &&
                      v.ev_last[i] == want[i][2],
                  "event %d: use %d params %d..%d", i, v.ev_use[i], v.ev_first[i], v.ev_last[i]);
    tdm_model_free(m);

    /* GPT with 2 blocks: embeddings, block 0, block 1, ln_f, the head's wte;
     * backward: the head's wte, ln_f, block 1, block 0, the embeddings */
    m = make(2, 1);
    v = (viewer){.m = m};
    tdm_model_set_use_hook(m, on_use, &v);
    int32_t tok[3 * 6], tgt[3 * 6];
    batch_of(m, 3, (float *)tok, tgt);
    TU_OK(tdm_model_forward_backward(m, tok, tgt, 3, NULL));
    /* the embeddings' backward reads neither table: a grads-only use (2) */
    static const int gw[10][3] = {{0, 0, 1},  {0, 2, 13},  {0, 14, 25}, {0, 26, 27}, {0, 0, 0},
                                  {1, 0, 0},  {1, 26, 27}, {1, 14, 25}, {1, 2, 13},  {2, 0, 1}};
    cr_assert_eq(v.n_events, 10);
    for (int i = 0; i < 10; i++)
        cr_assert(v.ev_use[i] == gw[i][0] && v.ev_first[i] == gw[i][1] && v.ev_last[i] == gw[i][2],
                  "gpt event %d: use %d params %d..%d", i, v.ev_use[i], v.ev_first[i],
                  v.ev_last[i]);
    /* blocks: embeddings 0, the two blocks 1 and 2, ln_f and head 3 */
    int nl = tdm_model_n_layers(m);
    cr_assert_eq(tdm_model_layer_block(m, 0), 0);
    cr_assert_eq(tdm_model_layer_block(m, 1), 1);
    cr_assert_eq(tdm_model_layer_block(m, 6), 1);
    cr_assert_eq(tdm_model_layer_block(m, 7), 2);
    cr_assert_eq(tdm_model_layer_block(m, nl - 2), 3);
    cr_assert_eq(tdm_model_layer_block(m, nl - 1), 3);
    tdm_model_free(m);
}

static tdm_status fail_use(void *ctx, tdm_model *m, tdm_model_use use, int first, int last)
{
    (void)ctx;
    (void)m;
    (void)last;
    if (use == TDM_MODEL_USE_FORWARD && first == 2)
        return tdm_error_set(TDM_STATUS_PEER_FAILED, "use hook: gather of unit 1 failed");
    return TDM_STATUS_OK;
}

Test(model_views, missing_storage_and_hook_errors_stop_the_pass)
{
    tdm_model *m = make(0, 1);
    float x[2 * 12];
    int32_t y[2];
    batch_of(m, 2, x, y);
    tdm_model_set_use_hook(m, fail_use, NULL);
    const float *logits;
    cr_assert_eq(tdm_model_forward(m, x, 2, &logits), TDM_STATUS_PEER_FAILED);
    cr_assert(strstr(tdm_error_message(), "unit 1"), "%s", tdm_error_message());
    tdm_model_set_use_hook(m, NULL, NULL);
    TU_OK(tdm_model_release_storage(m));
    cr_assert_eq(tdm_model_forward(m, x, 2, &logits), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "'fc1.weight' has no storage"), "%s",
              tdm_error_message());
    /* what needs the flat buffers refuses clearly */
    tdm_model *c = NULL;
    cr_assert_eq(tdm_model_clone(&c, m, g_dev), TDM_STATUS_INVALID_ARG);
    tdm_optim *o = NULL;
    TU_OK(tdm_sgd_init(&o, m, 0.1f, 0.0f));
    cr_assert_eq(tdm_optim_step(o), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_checkpoint_save("/nonexistent/x", m, NULL, NULL), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_model_set_param_view(m, 4, 9, NULL), TDM_STATUS_INVALID_ARG);
    tdm_optim_free(o);
    tdm_model_free(m);
}

/* ---- the optimizer over ranges ---- */

Test(model_views, optimizer_over_shard_ranges_is_bitwise_the_whole_step)
{
    for (int kind = 0; kind < 3; kind++) {
        tdm_optim_opts oo;
        tdm_optim_opts_default(&oo, kind == 2 ? TDM_OPTIM_ADAMW : TDM_OPTIM_SGD);
        if (kind == 0) oo.momentum = 0.9f;
        if (kind == 1) {
            oo.momentum = 0.8f;
            oo.nesterov = 1;
            oo.weight_decay = 0.01f;
        }
        tdm_model *m = make(0, 4);
        int64_t n = tdm_model_param_elems(m);
        tdm_optim *whole = NULL, *part = NULL;
        TU_OK(tdm_optim_init(&whole, m, &oo));
        /* the shard: elements [a, b) of the flat buffer, stepped in 3 ranges */
        int64_t a = 7, b = n - 5, len = b - a;
        TU_OK(tdm_optim_init_flat(&part, g_dev, len, &oo));
        cr_assert_eq(tdm_optim_n_elem(part), len);
        float *p = tu_malloc((size_t)len * 4), *g = tu_malloc((size_t)len * 4);
        memcpy(p, tdm_model_params(m) + a, (size_t)len * 4);
        tdm_rng r = tu_rng(5);
        for (int step = 0; step < 4; step++) {
            tu_fill(&r, tdm_model_grads(m), n, -1, 1);
            memcpy(g, tdm_model_grads(m) + a, (size_t)len * 4);
            TU_OK(tdm_optim_step(whole));
            int64_t c1 = len / 3, c2 = 2 * len / 3;
            tdm_optim_range rr[3] = {{p, g, 0, c1}, {p + c1, g + c1, c1, c2 - c1},
                                     {p + c2, g + c2, c2, len - c2}};
            TU_OK(tdm_optim_step_ranges(part, rr, 3));
            cr_assert_eq(tdm_optim_steps(part), step + 1);
            cr_assert_eq(memcmp(p, tdm_model_params(m) + a, (size_t)len * 4), 0,
                         "optimizer kind %d step %d: the shard differs", kind, step);
        }
        tdm_optim_range bad = {p, g, len - 2, 5};
        cr_assert_eq(tdm_optim_step_ranges(part, &bad, 1), TDM_STATUS_INVALID_ARG);
        cr_assert_eq(tdm_optim_step(part), TDM_STATUS_INVALID_ARG);
        free(p);
        free(g);
        tdm_optim_free(whole);
        tdm_optim_free(part);
        tdm_model_free(m);
    }
}

/* ---- checkpoints from host arrays ---- */

static void *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = tu_malloc(*n);
    cr_assert_eq(fread(p, 1, *n, f), *n);
    fclose(f);
    return p;
}

Test(model_views, checkpoint_from_host_arrays_is_the_same_file)
{
    char dir[64];
    tu_mkdtemp(dir, sizeof dir, "views");
    tdm_model *m = make(1, 2);
    tdm_optim_opts oo;
    tdm_optim_opts_default(&oo, TDM_OPTIM_ADAMW);
    tdm_optim *o = NULL;
    TU_OK(tdm_optim_init(&o, m, &oo));
    float x[3 * 64];
    int32_t y[3];
    batch_of(m, 3, x, y);
    TU_OK(tdm_model_forward_backward(m, x, y, 3, NULL));
    TU_OK(tdm_optim_step(o));
    tdm_ckpt_info info = {.step = 1, .epoch = 0, .seed = 2};
    char a[512], b[512];
    snprintf(a, sizeof a, "%s", tu_tpath(dir, "a.safetensors"));
    snprintf(b, sizeof b, "%s", tu_tpath(dir, "b.safetensors"));
    TU_OK(tdm_checkpoint_save(a, m, o, &info));
    tdm_ckpt_host h = {.params = tdm_model_params(m), .buffers = tdm_model_buffers(m),
                       .optim = &oo, .state = {tdm_optim_state(o, 0), tdm_optim_state(o, 1)},
                       .steps = 1};
    TU_OK(tdm_checkpoint_save_host(b, m, &h, &info));
    size_t na, nb;
    void *fa = slurp(a, &na), *fb = slurp(b, &nb);
    cr_assert(na == nb && !memcmp(fa, fb, na), "the two files differ");
    /* and back into host arrays */
    int64_t pe = tdm_model_param_elems(m), be = tdm_model_buffer_elems(m);
    tdm_ckpt_host r = {.params = tu_malloc((size_t)pe * 4), .buffers = tu_malloc((size_t)be * 4),
                       .optim = &oo,
                       .state = {tu_malloc((size_t)pe * 4), tu_malloc((size_t)pe * 4)}};
    tdm_ckpt_info got;
    TU_OK(tdm_checkpoint_load_host(b, m, &r, &got));
    cr_assert_eq(r.steps, 1);
    cr_assert_eq(memcmp(r.params, tdm_model_params(m), (size_t)pe * 4), 0);
    cr_assert_eq(memcmp(r.state[1], tdm_optim_state(o, 1), (size_t)pe * 4), 0);
    free(fa);
    free(fb);
    free(r.params);
    free(r.buffers);
    free(r.state[0]);
    free(r.state[1]);
    tdm_optim_free(o);
    tdm_model_free(m);
    tu_rmtree(dir);
}

/* ---- the allocator's accounting ---- */

Test(model_views, host_allocator_counts_live_and_peak_bytes)
{
    tdm_device *d = tu_host();
    tdm_dev_mem_stats s0, s;
    TU_OK(tdm_dev_mem_query(d, &s0));
    void *a = NULL, *b = NULL;
    TU_OK(tdm_dev_alloc(d, 1000, &a));   /* rounded to 1024 */
    TU_OK(tdm_dev_alloc(d, 64, &b));
    TU_OK(tdm_dev_mem_query(d, &s));
    cr_assert_eq(s.live_bytes - s0.live_bytes, 1088);
    cr_assert_eq(s.allocs - s0.allocs, 2);
    tdm_dev_free(d, a);
    TU_OK(tdm_dev_mem_query(d, &s));
    cr_assert_eq(s.live_bytes - s0.live_bytes, 64);
    cr_assert_geq(s.peak_bytes - s0.live_bytes, 1088);
    tdm_dev_mem_reset_peak(d);
    TU_OK(tdm_dev_mem_query(d, &s));
    cr_assert_eq(s.peak_bytes, s.live_bytes);
    tdm_dev_free(d, b);
    /* a model's parameters and gradients, measured */
    tdm_dev_mem_stats before, after;
    TU_OK(tdm_dev_mem_query(d, &before));
    tdm_model *m = NULL;
    static const int dims[] = {30, 20, 10};
    TU_OK(tdm_mlp_init(&m, d, dims, 3, 1));
    TU_OK(tdm_dev_mem_query(d, &after));
    size_t pb = (size_t)tdm_model_param_elems(m) * 4;
    cr_assert_eq(after.live_bytes - before.live_bytes, 2 * ((pb + 63) / 64 * 64));
    TU_OK(tdm_model_release_storage(m));
    TU_OK(tdm_dev_mem_query(d, &after));
    cr_assert_eq(after.live_bytes, before.live_bytes);
    tdm_model_free(m);
    tdm_device_free(d);
}
