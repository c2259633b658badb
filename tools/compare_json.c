/* tools/compare_json.c: `tandem compare --json FILE`, the run's results
 * for a program to read (schema in docs/OUTPUTS.md): the configuration,
 * per mode the throughput (median, min, max), step times, phase means
 * (the text table's names), memory per device or rank (persistent and
 * peak), bytes moved per step, the machine's other load, the loss curve;
 * the equivalence verdict with its bounds and pairs; the comm hook's
 * verdict; the sweep. Numbers that are not finite are null. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/safefile.h"
#include "core/device.h"
#include "tools/compare.h"
#include "tools/compare_json.h"
#include "tools/devices.h"
#include "tools/tools.h"

void tdm_json_put_num(FILE *f, double x)
{
    if (isfinite(x)) fprintf(f, "%.9g", x);
    else fputs("null", f);
}

void tdm_json_put_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static void tdm_cmp_json_stats(FILE *f, const char *key, double med, double mn, double mx)
{
    fprintf(f, "\"%s\": {\"median\": ", key);
    tdm_json_put_num(f, med);
    fputs(", \"min\": ", f);
    tdm_json_put_num(f, mn);
    fputs(", \"max\": ", f);
    tdm_json_put_num(f, mx);
    fputc('}', f);
}

static void tdm_cmp_json_mode(FILE *f, const tdm_cmp_opts *o, const tdm_cmp_result *r,
                              double other_cores)
{
    double med, mn, mx, mean;
    tdm_phase_times pm;
    tdm_cmp_step_stats(o, r, &med, &mn, &mx);
    tdm_cmp_means(o, r, &mean, NULL, NULL);
    tdm_cmp_phase_mean(o, r, &pm);
    fputs("    {\"mode\": ", f);
    tdm_json_put_str(f, tdm_cmp_mode_name(r->mode));
    fprintf(f, ", \"devices\": %d,\n      ", r->n_dev);
    tdm_cmp_json_stats(f, "samples_per_s", o->batch / med * 1e3, o->batch / mx * 1e3,
                       o->batch / mn * 1e3);
    fputs(",\n      ", f);
    tdm_cmp_json_stats(f, "step_ms", med, mn, mx);
    fputs(", \"step_ms_mean\": ", f);
    tdm_json_put_num(f, mean);
    fputs(",\n      \"phases_ms\": {", f);
    double sum = 0.0;
    for (int q = 0; q < tdm_cmp_n_phase_rows; q++) {
        double v = pm.ms[tdm_cmp_phase_rows[q]];
        sum += v;
        fprintf(f, "%s", q ? ", " : "");
        tdm_json_put_str(f, tdm_cmp_phase_label(tdm_cmp_phase_rows[q]));
        fputs(": ", f);
        tdm_json_put_num(f, v);
    }
    fputs(", \"other (outside phases)\": ", f);
    tdm_json_put_num(f, mean > sum ? mean - sum : 0.0);
    fputs("},\n      \"bytes_per_step\": ", f);
    tdm_json_put_num(f, r->mode == TDM_CMP_DDP || tdm_cmp_is_sharded(r->mode)
                            ? r->bytes_per_step : 0.0);
    fputs(", \"other_processes_cores\": ", f);
    tdm_json_put_num(f, other_cores >= 0 ? other_cores : NAN);
    fprintf(f, ", \"more_devices_than_cores\": %s,\n      \"memory_bytes\": [",
            r->n_dev > tdm_device_host_cores() &&
                    (o->dl.kind == TDM_DEVICE_HOST || tdm_tool_cuda_emulated())
                ? "true" : "false");
    for (int d = 0; d < r->n_dev; d++) {
        const tdm_cmp_memory *m = &r->mem[d];
        double persist = m->params + m->grads + m->optim + m->buffers;
        fprintf(f, "%s\n        {\"device\": %d, \"params\": %.0f, \"grads\": %.0f, "
                   "\"optimizer\": %.0f, \"buffers\": %.0f, \"activations\": %.0f, "
                   "\"comm\": %.0f, \"persistent\": %.0f, \"peak\": %.0f, "
                   "\"peak_measured\": %.0f, \"peak_planned\": ",
                d ? "," : "", d, m->params, m->grads, m->optim, m->buffers, m->activations,
                m->comm, persist, persist + m->activations + m->comm, m->peak);
        double pl = r->mode == TDM_CMP_DP && d > 0 ? -1.0   /* DP's other devices */
                                                   : tdm_cmp_planned_peak(o, r->mode, r->n_dev);
        if (pl >= 0) fprintf(f, "%.0f}", pl);
        else fputs("null}", f);
    }
    fputs("],\n      \"loss\": [", f);
    for (int i = 0; i < r->steps; i++) {
        fputs(i ? ", " : "", f);
        tdm_json_put_num(f, r->loss[i]);
    }
    fputs("]}", f);
}

tdm_status tdm_cmp_write_json(FILE *f, const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                              const tdm_cmp_report *rep)
{
    fputs("{\"schema\": \"tandem.compare/1\", \"tandem\": ", f);
    tdm_json_put_str(f, tdm_tool_version());
    fputs(",\n  \"config\": {\"model\": ", f);
    tdm_json_put_str(f, o->model);
    fputs(", \"device\": ", f);
    tdm_json_put_str(f, o->device);
    fprintf(f, ", \"devices\": %d, \"cores\": %d, \"batch\": %d, \"steps\": %d, "
               "\"warmup\": %d, \"optim\": ", o->n_dev, tdm_device_host_cores(), o->batch,
            o->steps, o->warmup);
    tdm_json_put_str(f, o->optim);
    fputs(", \"lr\": ", f);
    tdm_json_put_num(f, o->lr);
    fputs(", \"data\": ", f);
    tdm_json_put_str(f, o->data ? o->data : "default");
    fprintf(f, ", \"seed\": %llu},\n  \"modes\": [\n", (unsigned long long)o->seed);
    for (int k = 0; k < n; k++) {
        tdm_cmp_json_mode(f, o, res[k], rep->other_cores[res[k]->mode]);
        fputs(k + 1 < n ? ",\n" : "\n", f);
    }
    fprintf(f, "  ],\n  \"verdict\": {\"pass\": %s, \"atol_first\": %g, \"rtol_first\": %g, "
               "\"atol_last\": %g, \"rtol_last\": %g, \"loss_rtol\": %g, \"floor_factor\": %g, "
               "\"floor_max_abs\": ", rep->verdict ? "true" : "false", rep->atol_first,
            rep->rtol_first, rep->atol_last, rep->rtol_last, rep->loss_rtol, rep->floor_factor);
    tdm_json_put_num(f, rep->floor_max_abs);
    fputs(", \"floor_loss_rel\": ", f);
    tdm_json_put_num(f, rep->floor_loss_rel);
    fputs(",\n    \"pairs\": [", f);
    for (int q = 0; q < rep->n_pairs; q++) {
        fprintf(f, "%s{\"a\": ", q ? ", " : "");
        tdm_json_put_str(f, tdm_cmp_mode_name((tdm_cmp_mode)rep->pairs[q][0]));
        fputs(", \"b\": ", f);
        tdm_json_put_str(f, tdm_cmp_mode_name((tdm_cmp_mode)rep->pairs[q][1]));
        fprintf(f, ", \"pass\": %s}", rep->pair_ok[q] ? "true" : "false");
    }
    fputs("]}", f);
    if (rep->hook) {
        fputs(",\n  \"comm_hook\": {\"name\": ", f);
        tdm_json_put_str(f, rep->hook);
        fprintf(f, ", \"pass\": %s}", rep->hook_pass ? "true" : "false");
    }
    tdm_cmp_pp_json(f);
    fputs(",\n  \"sweep\": [", f);
    int first = 1;
    for (int i = 0; i < rep->n_sweep; i++) {
        const tdm_cmp_sweep_point *s = &rep->sweep[i];
        if (s->dp[0] <= 0) continue;
        fprintf(f, "%s\n    {\"devices\": %d, ", first ? "" : ",", s->devices);
        first = 0;
        tdm_cmp_json_stats(f, "dp_samples_per_s", s->dp[0], s->dp[1], s->dp[2]);
        fputs(", ", f);
        tdm_cmp_json_stats(f, "ddp_samples_per_s", s->ddp[0], s->ddp[1], s->ddp[2]);
        fputs(", \"ideal_samples_per_s\": ", f);
        tdm_json_put_num(f, s->ideal);
        fputc('}', f);
    }
    fputs("]\n}\n", f);
    return ferror(f) ? TDM_STATUS_IO : TDM_STATUS_OK;
}

tdm_status tdm_json_write_file(const char *path, const char *tool,
                               tdm_status (*body)(FILE *f, const void *ctx), const void *ctx)
{
    tdm_file_out out;
    if (tdm_file_replace_open(&out, AT_FDCWD, path) != TDM_STATUS_OK) {
        fprintf(stderr, "%s: --json %s: %s\n", tool, path, tdm_error_message());
        return TDM_STATUS_IO;
    }
    int fd = dup(out.fd);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        fprintf(stderr, "%s: --json %s: %s\n", tool, path, strerror(errno));
        if (fd >= 0) close(fd);
        tdm_file_replace_abort(&out);
        return TDM_STATUS_IO;
    }
    tdm_status st = body(f, ctx);
    if (fclose(f) != 0 || st != TDM_STATUS_OK) {
        fprintf(stderr, "%s: --json %s: write failed: %s\n", tool, path, strerror(errno));
        tdm_file_replace_abort(&out);
        return TDM_STATUS_IO;
    }
    if (tdm_file_replace_commit(&out) != TDM_STATUS_OK) {
        fprintf(stderr, "%s: --json %s: %s\n", tool, path, tdm_error_message());
        return TDM_STATUS_IO;
    }
    return TDM_STATUS_OK;
}

typedef struct tdm_cmp_json_ctx {
    const tdm_cmp_opts *o;
    tdm_cmp_result *const *res;
    int n;
    const tdm_cmp_report *rep;
} tdm_cmp_json_ctx;

static tdm_status tdm_cmp_json_body(FILE *f, const void *ctx)
{
    const tdm_cmp_json_ctx *c = ctx;
    return tdm_cmp_write_json(f, c->o, c->res, c->n, c->rep);
}

tdm_status tdm_cmp_write_json_file(const char *path, const tdm_cmp_opts *o,
                                   tdm_cmp_result *const *res, int n, const tdm_cmp_report *rep)
{
    tdm_cmp_json_ctx c = {.o = o, .res = res, .n = n, .rep = rep};
    return tdm_json_write_file(path, "tandem compare", tdm_cmp_json_body, &c);
}
