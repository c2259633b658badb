/* tests/test_outputs.c: the files compare and train write for programs
 * (docs/OUTPUTS.md): compare --json parses (core/json.h with reals) and
 * holds every mode with min <= median <= max throughput, phases, memory
 * per rank with persistent <= peak, the verdict with its bounds and
 * pairs, and the sweep; compare --csv names allreduce_span_ms and holds
 * the sweep's rows; train --json and --csv hold one record per epoch.
 * And the parser: reals only through tdm_json_parse_reals. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "tests/cli_util.h"

static char *out_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s is missing", path);
    static char buf[1 << 21];
    *len = fread(buf, 1, sizeof buf - 1, f);
    buf[*len] = 0;
    fclose(f);
    return buf;
}

static double num(const tdm_json *o, const char *key)
{
    const tdm_json *v = tdm_json_get(o, key);
    cr_assert_not_null(v, "no '%s'", key);
    cr_assert(v->type == TDM_JSON_REAL || v->type == TDM_JSON_INT, "'%s' is a %s", key,
              tdm_json_type_name(v->type));
    return v->d;
}

Test(outputs, json_parser_takes_reals_only_when_asked, .timeout = 30)
{
    tdm_json *v = NULL;
    const char *t = "{\"a\": 1.5e3, \"b\": -2, \"c\": 0.25}";
    cr_assert_neq(tdm_json_parse(&v, t, strlen(t)), TDM_STATUS_OK);
    cr_assert_eq(tdm_json_parse_reals(&v, t, strlen(t)), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_expect_eq(tdm_json_get(v, "a")->type, TDM_JSON_REAL);
    cr_expect_eq(tdm_json_get(v, "a")->d, 1500.0);
    cr_expect_eq(tdm_json_get(v, "b")->type, TDM_JSON_INT);
    cr_expect_eq(tdm_json_get(v, "b")->d, -2.0);
    cr_expect_eq(tdm_json_get(v, "c")->d, 0.25);
    tdm_json_free(v);
    const char *bad[] = {"1.", "1e", "-.5", "1.5e+", "01.5"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_neq(tdm_json_parse_reals(&v, bad[i], strlen(bad[i])), TDM_STATUS_OK, "%s",
                      bad[i]);
    }
}

Test(outputs, compare_json_and_csv, .timeout = 600)
{
    char dir[] = "/tmp/tdm_outputs_XXXXXX", json[64], csv[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(json, sizeof json, "%s/c.json", dir);
    snprintf(csv, sizeof csv, "%s/c.csv", dir);
    cli_result r;
    CLI(&r, "compare", "--modes", "single,dp,ddp,zero1", "--data", "synthetic", "--model",
        "mlp:784-64-10", "--batch", "64", "--steps", "5", "--warmup", "1", "--device", "cpu:2",
        "--sweep", "1,2", "--json", json, "--csv", csv);
    expect(&r, 0, "json: ");
    size_t len;
    char *text = out_slurp(json, &len);
    tdm_json *root = NULL;
    cr_assert_eq(tdm_json_parse_reals(&root, text, len), TDM_STATUS_OK, "%s\n%s",
                 tdm_error_message(), text);
    cr_expect_str_eq(tdm_json_get(root, "schema")->str, "tandem.compare/1");
    cr_expect_eq(num(tdm_json_get(root, "config"), "batch"), 64);
    const tdm_json *modes = tdm_json_get(root, "modes");
    cr_assert(modes && modes->type == TDM_JSON_ARRAY);
    cr_assert_eq(modes->n, 4, "%s", text);
    const char *names[] = {"single", "DP", "DDP", "ZeRO-1"};
    for (int k = 0; k < modes->n; k++) {
        const tdm_json *m = &modes->items[k];
        cr_expect_str_eq(tdm_json_get(m, "mode")->str, names[k]);
        const tdm_json *sps = tdm_json_get(m, "samples_per_s");
        double med = num(sps, "median"), mn = num(sps, "min"), mx = num(sps, "max");
        cr_expect(mn > 0 && mn <= med && med <= mx, "%s: %g %g %g", names[k], mn, med, mx);
        const tdm_json *ph = tdm_json_get(m, "phases_ms");
        cr_assert_not_null(ph);
        cr_expect(tdm_json_get(ph, "forward") && tdm_json_get(ph, "all-reduce (exposed)") &&
                  tdm_json_get(ph, "other (outside phases)"));
        const tdm_json *mem = tdm_json_get(m, "memory_bytes");
        cr_assert(mem && mem->type == TDM_JSON_ARRAY);
        cr_expect_eq(mem->n, (int)num(m, "devices"));
        for (int d = 0; d < mem->n; d++)
            cr_expect(num(&mem->items[d], "persistent") <= num(&mem->items[d], "peak") &&
                      num(&mem->items[d], "params") > 0);
        cr_expect_eq(tdm_json_get(m, "loss")->n, 5);
        if (!strcmp(names[k], "DDP")) cr_expect_gt(num(m, "bytes_per_step"), 0);
    }
    const tdm_json *v = tdm_json_get(root, "verdict");
    cr_assert_not_null(v);
    cr_expect_eq(tdm_json_get(v, "pass")->type, TDM_JSON_BOOL);
    cr_expect_eq(tdm_json_get(v, "pass")->i, 1);
    cr_expect_gt(num(v, "rtol_last"), 0);
    cr_expect_gt(tdm_json_get(v, "pairs")->n, 3);
    const tdm_json *sw = tdm_json_get(root, "sweep");
    cr_assert(sw && sw->n == 2, "%s", text);
    cr_expect_eq(num(&sw->items[1], "devices"), 2);
    cr_expect_gt(num(&sw->items[1], "ideal_samples_per_s"), 0);
    tdm_json_free(root);

    text = out_slurp(csv, &len);
    cr_expect(strstr(text, ",all_reduce_wait_ms,") && strstr(text, ",allreduce_span_ms,run\n"),
              "%.300s", text);
    int main_rows = 0, sweep_rows = 0;
    for (char *p = strchr(text, '\n'); p && p[1]; p = strchr(p + 1, '\n')) {
        char *e = strchr(p + 1, '\n');
        main_rows += e && !strncmp(e - 5, ",main", 5);
        sweep_rows += e && !strncmp(e - 6, ",sweep", 6);
    }
    cr_expect_eq(main_rows, 4 * 5);
    cr_expect_eq(sweep_rows, 2 * 2 * 5);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}

Test(outputs, train_json_and_csv_per_epoch, .timeout = 300)
{
    char dir[] = "/tmp/tdm_outputs_XXXXXX", json[64], csv[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(json, sizeof json, "%s/t.json", dir);
    snprintf(csv, sizeof csv, "%s/t.csv", dir);
    cli_result r;
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "512", "--model", "mlp:784-32-10", "--epochs", "3", "--json", json,
        "--csv", csv);
    expect(&r, 0, "epoch 3/3");
    size_t len;
    char *text = out_slurp(json, &len);
    tdm_json *root = NULL;
    cr_assert_eq(tdm_json_parse_reals(&root, text, len), TDM_STATUS_OK, "%s\n%s",
                 tdm_error_message(), text);
    cr_expect_str_eq(tdm_json_get(root, "schema")->str, "tandem.train/1");
    cr_expect_str_eq(tdm_json_get(tdm_json_get(root, "config"), "mode")->str, "ddp");
    const tdm_json *ep = tdm_json_get(root, "epochs");
    cr_assert(ep && ep->n == 3, "%s", text);
    for (int e = 0; e < 3; e++) {
        cr_expect_eq(num(&ep->items[e], "epoch"), e + 1);
        cr_expect_gt(num(&ep->items[e], "samples_per_s"), 0);
        double acc = num(&ep->items[e], "test_accuracy");
        cr_expect(acc >= 0 && acc <= 1);
        /* the epoch line's loss, printed to 4 decimals, is the record's */
        char line[32];
        snprintf(line, sizeof line, "epoch %d/3: train loss %.4f", e + 1,
                 num(&ep->items[e], "train_loss"));
        cr_expect(strstr(r.out, line), "no '%s':\n%s", line, r.out);
    }
    tdm_json_free(root);
    text = out_slurp(csv, &len);
    cr_expect(!strncmp(text, "epoch,train_loss,samples_per_s,seconds,test_loss,test_accuracy\n",
                       62), "%s", text);
    int rows = 0;
    for (char *p = text; (p = strchr(p, '\n')) && p[1]; p++) rows++;
    cr_expect_eq(rows, 3, "%s", text);
    CLI(&r, "train", "--mode", "ddp", "--uneven", "--json", json);
    expect(&r, 2, "--json, --csv and --trace do not apply to --uneven");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect(!cli_shm_entries());
}
