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
