/* tests/test_compare.c: `tandem compare`, the main job, end to end on
 * synthetic data: all three modes run and the equivalence verdict passes;
 * a deliberately wrong DDP rank makes it fail (the check can fail); the
 * trace is valid JSON with the expected tracks and spans; the CSV parses;
 * with gnuplot installed the charts are non-empty PNG files; bad usage
 * gets clear messages. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/json.h"
#include "tests/cli_util.h"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert(buf && fread(buf, 1, (size_t)n, f) == (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static int count_events(const tdm_json *ev, const char *ph, int pid, const char *name_prefix)
{
    int n = 0;
    for (int i = 0; i < ev->n; i++) {
        const tdm_json *e = &ev->items[i];
        const tdm_json *p = tdm_json_get(e, "ph"), *id = tdm_json_get(e, "pid"),
                       *nm = tdm_json_get(e, "name");
        if (!p || strcmp(p->str, ph) || !id || (pid && id->i != pid) || !nm) continue;
        if (strncmp(nm->str, name_prefix, strlen(name_prefix))) continue;
        n++;
    }
    return n;
}

Test(compare, three_modes_agree_and_outputs_are_well_formed, .timeout = 240)
{
    static cli_result r;
    char dir[] = "/tmp/tandem-cmp-XXXXXX";
    cr_assert(mkdtemp(dir));
    char trace[256], csv[256], plot[256], cmd[400];
    snprintf(trace, sizeof trace, "%s/trace.json", dir);
    snprintf(csv, sizeof csv, "%s/run.csv", dir);
    snprintf(plot, sizeof plot, "%s/plots", dir);
    const int steps = 8;
    /* the three replicated modes (FSDP's part: tests/test_fsdp_cli.c) */
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-48-10", "--device", "cpu:3",
        "--batch", "50", "--steps", "8", "--warmup", "2", "--bucket-cap-mb", "0.001",
        "--trace", trace, "--csv", csv, "--plot", plot, "--modes", "single,dp,ddp");
    expect(&r, 0, "verdict: PASS");
    /* every section is there */
    const char *sections[] = {"Throughput", "Where the time goes", "Equivalence",
                              "Memory per device", "Reading", "DP vs single", "DDP vs single",
                              "DDP vs DP", "all-reduce (exposed)"};
    for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++)
        cr_assert(strstr(r.out, sections[i]), "output lacks '%s':\n%s", sections[i], r.out);

    /* trace: valid JSON, a process per mode, a track per device, spans */
    size_t len;
    char *text = slurp(trace, &len);
    tdm_json *root = NULL;
    cr_assert(tdm_json_parse(&root, text, len) == TDM_STATUS_OK, "trace is not valid JSON: %s",
              tdm_error_message());
    const tdm_json *ev = tdm_json_get(root, "traceEvents");
    cr_assert(ev && ev->type == TDM_JSON_ARRAY);
    cr_assert_eq(count_events(ev, "M", 0, "process_name"), 3);
    /* single: 1 track; DP: 3; DDP: 3 ranks + the communication track */
    cr_assert_eq(count_events(ev, "M", 1, "thread_name"), 1);
    cr_assert_eq(count_events(ev, "M", 2, "thread_name"), 3);
    cr_assert_eq(count_events(ev, "M", 3, "thread_name"), 4);
    /* a forward span per step per device or rank */
    cr_assert_eq(count_events(ev, "X", 1, "forward"), steps);
    cr_assert_eq(count_events(ev, "X", 2, "forward"), steps * 3);
    cr_assert_eq(count_events(ev, "X", 3, "forward"), steps * 3);
    cr_assert_eq(count_events(ev, "X", 2, "replicate"), steps * 3);
    cr_assert_eq(count_events(ev, "X", 2, "reduce-add"), steps * 3);
    /* several buckets (a 1 KiB cap: fc2, then fc1) from the second step on,
     * after one bucket in the first (ddp.h): ready marks and spans */
    int ready = count_events(ev, "i", 3, "bucket "), spans = count_events(ev, "X", 3, "all-reduce bucket");
    cr_assert_eq(ready, 1 + 2 * (steps - 1), "bucket ready marks: %d", ready);
    cr_assert_eq(spans, ready, "%d bucket spans for %d ready marks", spans, ready);
    tdm_json_free(root);
    free(text);

    /* CSV: header + steps rows per mode, same column count on every line */
    text = slurp(csv, &len);
    int lines = 0, cols0 = -1;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        int cols = 1;
        for (char *c = line; *c; c++) cols += *c == ',';
        if (cols0 < 0) {
            cols0 = cols;
            cr_assert(!strncmp(line, "mode,devices,step,loss,step_ms", 30), "%s", line);
        } else {
            cr_assert_eq(cols, cols0, "line %d has %d columns, header %d: %s", lines, cols, cols0, line);
            char mode[16];
            int dev, step;
            double loss;
            cr_assert_eq(sscanf(line, "%15[^,],%d,%d,%lf", mode, &dev, &step, &loss), 4, "%s", line);
            cr_assert(loss > 0.0 && loss < 10.0);
        }
        lines++;
    }
    cr_assert_eq(lines, 1 + 3 * steps);
    free(text);

    /* plots, when gnuplot is installed */
    if (system("command -v gnuplot >/dev/null 2>&1") == 0) {
        const char *pngs[] = {"loss.png", "throughput.png", "phases.png"};
        for (int i = 0; i < 3; i++) {
            char p[300];
            snprintf(p, sizeof p, "%s/%s", plot, pngs[i]);
            char *png = slurp(p, &len);
            cr_assert(len > 1000, "%s is only %zu bytes", p, len);
            cr_assert(!memcmp(png, "\x89PNG\r\n\x1a\n", 8), "%s is not a PNG", p);
            free(png);
        }
    } else {
        cr_assert(strstr(r.out, "gnuplot is not installed"), "%s", r.out);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert(system(cmd) == 0);
}

/* The verdict of the equivalence line that starts with `label`: 1 when it
 * ends "-> PASS", 0 for "-> FAIL"; fails the test when the line or its
 * verdict is missing. */
static int pair_passes(const char *out, const char *label)
{
    char key[64];
    snprintf(key, sizeof key, "  %s ", label);
    const char *line = strstr(out, key);
    cr_assert_not_null(line, "no '%s' line:\n%s", label, out);
    const char *end = strchr(line, '\n');
    size_t len = end ? (size_t)(end - line) : strlen(line);
    char buf[512];
    snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
    if (strstr(buf, "-> PASS")) return 1;
    cr_assert(strstr(buf, "-> FAIL"), "'%s' line has no verdict: %s", label, buf);
    return 0;
}

Test(compare, a_wrong_rank_fails_the_verdict, .timeout = 240)
{
    static cli_result r;
    CLI(&r, "compare", "--data", "synthetic", "--model", "mlp:784-32-10", "--device", "cpu:2",
        "--batch", "32", "--steps", "4", "--perturb-rank", "1");
    expect(&r, 3, "verdict: FAIL");
    cr_assert(!pair_passes(r.out, "DDP vs single"), "%s", r.out);
    cr_assert(!pair_passes(r.out, "DDP vs DP"), "%s", r.out);
    /* DP is untouched and still agrees with one device */
    cr_assert(pair_passes(r.out, "DP vs single"), "%s", r.out);
}

Test(compare, cnn_batchnorm_semantics, .timeout = 240)
{
    static cli_result r;
    CLI(&r, "compare", "--data", "synthetic", "--model", "cnn", "--device", "cpu:2", "--batch",
        "8", "--steps", "3", "--warmup", "1");
    expect(&r, 0, "verdict: PASS");
    /* single vs DP/DDP differ by design; DP and DDP normalise the same chunks */
    cr_assert(strstr(r.out, "not expected to match: batchnorm"), "%s", r.out);
    cr_assert(pair_passes(r.out, "DDP vs DP"), "%s", r.out);
}

Test(compare, bad_usage, .timeout = 60)
{
    static cli_result r;
    CLI(&r, "compare", "--model", "transformer");
    expect(&r, 2, "unknown model 'transformer'");
    CLI(&r, "compare", "--device", "cpu:0");
    expect(&r, 2, "need at least one device");
    CLI(&r, "compare", "--device", "cpu:4", "--batch", "3", "--data", "synthetic");
    expect(&r, 2, "--batch 3 is smaller than the 4 devices");
    CLI(&r, "compare", "--trace", "/nonexistent-dir/t.json", "--data", "synthetic");
    expect(&r, 2, "--trace: /nonexistent-dir/t.json: cannot open its directory");
    CLI(&r, "compare", "--plot", "/nonexistent-dir/plots", "--data", "synthetic");
    expect(&r, 2, "--plot /nonexistent-dir/plots: cannot create");
    CLI(&r, "compare", "--sweep", "1,x");
    expect(&r, 2, "--sweep '1,x'");
    CLI(&r, "compare", "--steps", "0");
    expect(&r, 2, "out of range");
    CLI(&r, "compare", "--help");
    expect(&r, 0, "--trace FILE");
}
