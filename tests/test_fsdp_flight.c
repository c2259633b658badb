/* tests/test_fsdp_flight.c: the flight recorder (core/flight.h) names the
 * collectives of sharded data parallel as it names DDP's buckets: after a
 * few steps of every sharding (MLP and GPT, 2 ranks) each rank's dump
 * (TANDEM_FR_DUMP) holds "<family> all_gather unit U" and "<family>
 * reduce_scatter unit U" for every unit, with the family fsdp (FULL_SHARD),
 * zero2 (SHARD_GRAD_OP) or zero1 (SHARD_OPTIM), and no collective without
 * a label; the reduce-scatters come in unit order from the last unit. */
#include <criterion/criterion.h>

#include "core/json.h"
#include "tests/fr_test_util.h"
#include "tests/test_fsdp_util.h"

static tdm_dataset g_mlp;
static void setup(void)
{
    tf_cfg m = tf_cfg_default();
    cr_assert_eq(tf_data(&g_mlp, &m, 512), TDM_STATUS_OK);
}
static void teardown(void) { tdm_data_free(&g_mlp); }
TestSuite(fsdp_flight, .init = setup, .fini = teardown, .timeout = 120);

static const char *str_of(const tdm_json *o, const char *k)
{
    const tdm_json *v = tdm_json_get(o, k);
    cr_assert(v && v->type == TDM_JSON_STRING, "no string '%s'", k);
    return v->str;
}

/* Runs cfg over 2 ranks with the recorder dumping to a fresh directory and
 * checks both ranks' dumps. */
static void check_labels(tf_cfg c, int n_units)
{
    static const char *const family[] = {"fsdp", "zero2", "zero1"};
    const char *fam = family[c.sharding];
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    tf_shared *sh = tf_shared_new();
    cr_assert(sh);
    tdm_status st = tf_spawn(2, &c, &g_mlp, sh, 60000);
    unsetenv("TANDEM_FR_DUMP");
    cr_assert_eq(st, TDM_STATUS_OK, "%s: %s / %s", fam, tdm_error_message(), sh->err[0]);
    cr_assert_eq(sh->n_units, n_units);
    for (int r = 0; r < 2; r++) {
        tdm_json *doc = fr_t_load(dir, r);
        cr_assert_not_null(doc, "%s: rank %d left no dump in %s", fam, r, dir);
        const tdm_json *e = tdm_json_get(doc, "entries");
        cr_assert(e && e->type == TDM_JSON_ARRAY);
        int ag[8] = {0}, rs[8] = {0}, last_rs = -1;
        for (int i = 0; i < e->n; i++) {
            const char *coll = str_of(&e->items[i], "coll"), *label = str_of(&e->items[i], "label");
            cr_expect(label[0], "%s rank %d: %s #%d has no label", fam, r, coll, i);
            char want[64];
            int is_ag = !strcmp(coll, "all_gather"), is_rs = !strcmp(coll, "reduce_scatter");
            for (int u = 0; u < n_units; u++) {
                snprintf(want, sizeof want, "%s all_gather unit %d", fam, u);
                if (is_ag && !strcmp(label, want)) ag[u]++;
                snprintf(want, sizeof want, "%s reduce_scatter unit %d", fam, u);
                if (is_rs && !strcmp(label, want)) {
                    /* unit order, from the last unit down, within a step */
                    cr_expect(last_rs < 0 || u == last_rs - 1 || (last_rs == 0 && u == n_units - 1),
                              "%s rank %d: reduce_scatter of unit %d after unit %d", fam, r, u,
                              last_rs);
                    last_rs = u;
                    rs[u]++;
                }
            }
            if (is_rs)
                cr_expect(strstr(label, "reduce_scatter unit"), "%s rank %d: reduce_scatter '%s'",
                          fam, r, label);
        }
        for (int u = 0; u < n_units; u++) {
            /* every step gathers each unit at least once (after the step,
             * or in forward; FULL_SHARD again in backward) */
            cr_expect(ag[u] >= c.steps, "%s rank %d: %d all_gathers labelled '%s all_gather unit "
                      "%d' (expected >= %d)", fam, r, ag[u], fam, u, c.steps);
            cr_expect_eq(rs[u], c.steps, "%s rank %d: %d reduce_scatters labelled '%s "
                         "reduce_scatter unit %d' (expected %d)", fam, r, rs[u], fam, u, c.steps);
        }
        tdm_json_free(doc);
    }
    tf_shared_free(sh);
    fr_t_rm_dir(dir);
}

Test(fsdp_flight, every_sharding_labels_its_collectives_by_unit)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++) {
        tf_cfg c = tf_cfg_default();
        c.sharding = (tdm_fsdp_sharding)s;
        c.steps = 2;
        check_labels(c, 3);   /* 20-16-12-5: a unit per linear layer */
    }
}

Test(fsdp_flight, the_gpt_tied_unit_is_labelled_as_any_other)
{
    for (int s = 0; s < TDM_FSDP_SHARDING_COUNT_; s++) {
        tf_cfg c = tf_cfg_default();
        c.model = 2;
        c.batch = 4;
        c.steps = 2;
        c.adamw = 1;
        c.sharding = (tdm_fsdp_sharding)s;
        check_labels(c, 4);   /* embeddings (wte tied to the head), 2 blocks, ln_f */
    }
}

/* ---- a failed launch leaves no label behind ----
 * The device's allocator fails one size on purpose (its backend table
 * wrapped, core/device_impl.h): the bf16 hook's 16-bit block of the last
 * unit, so that unit's reduce-scatter is never issued. The label set for
 * it must not stay pending and name the next collective of the
 * communicator (here a barrier after the failed backward), which would
 * send `tandem doctor` to a reduce-scatter that never ran. */
#include "core/device_impl.h"

static size_t g_fail_bytes;
static const tdm_device_ops *g_real_ops;
static tdm_device_ops g_fail_ops;

static tdm_status fail_alloc(tdm_device *d, size_t nbytes, void **out)
{
    if (g_fail_bytes && nbytes == g_fail_bytes)
        return tdm_error_set(TDM_STATUS_OUT_OF_MEMORY, "test: injected failure to allocate "
                             "%zu bytes", nbytes);
    return g_real_ops->alloc(d, nbytes, out);
}

typedef struct lf_shared {
    int backward_st, barrier_st, dumped;
    char msg[512];
} lf_shared;

static int lf_rank(tdm_comm *comm, void *arg)
{
    lf_shared *sh = (lf_shared *)arg + tdm_comm_rank(comm);
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tf_cfg c = tf_cfg_default();
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_fsdp *f = NULL;
    tdm_optim *opt = NULL;
    tdm_model_spec spec;
    tdm_optim_opts oo;
    float x[24 * 20];
    int32_t y[24];
    int64_t perm[24];
    tdm_status st = TDM_STATUS_OK;
    tf_spec(&spec, &c);
    tf_optim_opts(&oo, &c);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    g_real_ops = dev->ops;
    g_fail_ops = *dev->ops;
    g_fail_ops.alloc = fail_alloc;
    dev->ops = &g_fail_ops;
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_fsdp_opts o = {.sharding = TDM_FSDP_SHARD_OPTIM, .comm_hook = TDM_FSDP_HOOK_BF16,
                       .timeout_ms = 20000};
    TDM_TRY(tdm_fsdp_init(&f, m, comm, &o));
    TDM_TRY(tdm_fsdp_optim_init(&opt, f, &oo));
    for (int i = 0; i < 24; i++) perm[i] = i;
    int lo = 12 * rank / world * 2, hi = 12 * (rank + 1) / world * 2;
    tdm_data_gather(&g_mlp, perm + lo, hi - lo, x, y);
    /* one good step first: whatever the model allocates once is there */
    TDM_TRY(tdm_fsdp_zero_grad(f));
    TDM_TRY(tdm_fsdp_forward_scaled(f, x, y, hi - lo, 1.0f / 24, NULL));
    TDM_TRY(tdm_fsdp_backward(f));
    TDM_TRY(tdm_fsdp_step(f, opt));
    int64_t shard = 0;
    tdm_fsdp_unit_info(f, tdm_fsdp_n_units(f) - 1, NULL, NULL, NULL, NULL, &shard);
    TDM_TRY(tdm_fsdp_zero_grad(f));
    TDM_TRY(tdm_fsdp_forward_scaled(f, x, y, hi - lo, 1.0f / 24, NULL));
    g_fail_bytes = (size_t)shard * (size_t)world * sizeof(uint16_t);
    sh->backward_st = tdm_fsdp_backward(f);
    g_fail_bytes = 0;
    snprintf(sh->msg, sizeof sh->msg, "%s", tdm_error_message());
    /* unlabelled: the failed backward aborted the communicator, so it
     * fails too, and is recorded with whatever label is pending */
    sh->barrier_st = tdm_comm_barrier(comm);
    sh->dumped = tdm_comm_fr_dump(comm, "test") == 0;
fail:
    if (st) snprintf(sh->msg, sizeof sh->msg, "set-up: %s", tdm_error_message());
    tdm_fsdp_free(f);
    tdm_optim_free(opt);
    tdm_model_free(m);
    if (dev) dev->ops = g_real_ops;
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(fsdp_flight, a_reduce_scatter_that_failed_to_launch_leaves_no_label)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    lf_shared *sh = mmap(NULL, 2 * sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
    cr_assert(sh != MAP_FAILED);
    memset(sh, 0, 2 * sizeof *sh);
    tdm_dist_spawn_opts so = {.timeout_ms = 60000, .comm_timeout_ms = 20000};
    (void)tdm_dist_spawn(2, lf_rank, sh, &so, NULL);
    unsetenv("TANDEM_FR_DUMP");
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(sh[r].backward_st, TDM_STATUS_OUT_OF_MEMORY, "rank %d: %s", r, sh[r].msg);
        cr_assert(strstr(sh[r].msg, "injected failure") &&
                      strstr(sh[r].msg, "reduce_scatter of unit 2"),
                  "rank %d: %s", r, sh[r].msg);
        cr_assert_neq(sh[r].barrier_st, TDM_STATUS_OK);
        cr_assert(sh[r].dumped, "rank %d wrote no dump", r);
        tdm_json *doc = fr_t_load(dir, r);
        cr_assert_not_null(doc);
        const tdm_json *e = tdm_json_get(doc, "entries");
        cr_assert(e && e->type == TDM_JSON_ARRAY && e->n > 0);
        const tdm_json *last = &e->items[e->n - 1];
        cr_assert_str_eq(str_of(last, "coll"), "barrier");
        cr_expect_str_eq(str_of(last, "label"), "",
                         "rank %d: the barrier after the failed launch is labelled '%s'", r,
                         str_of(last, "label"));
        for (int i = 0; i < e->n; i++) {
            const char *coll = str_of(&e->items[i], "coll"), *label = str_of(&e->items[i], "label");
            cr_expect(!strstr(label, "reduce_scatter") || !strcmp(coll, "reduce_scatter"),
                      "rank %d: %s #%d labelled '%s'", r, coll, i, label);
        }
        tdm_json_free(doc);
    }
    munmap(sh, 2 * sizeof *sh);
    fr_t_rm_dir(dir);
}
