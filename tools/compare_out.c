/* tools/compare_out.c: what `tandem compare` writes besides its tables:
 * a Chrome trace-event JSON (Perfetto, chrome://tracing), a CSV of the raw
 * per-step figures (the charts are tools/compare_plot.c). Spans of a step are laid out from the measured
 * phase durations in the order the phases run (each phase of DP is a
 * fork/join round, so its devices start it together); DDP's bucket spans
 * use the Reducer's own timestamps. Every file is replaced atomically
 * through core/safefile.h. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include "core/safefile.h"
#include "tools/compare.h"

static const tdm_phase tdm_cmp_order[] = {
    TDM_PHASE_REPLICATE, TDM_PHASE_SCATTER, TDM_PHASE_FORWARD, TDM_PHASE_GATHER,
    TDM_PHASE_LOSS,      TDM_PHASE_BACKWARD, TDM_PHASE_REDUCE, TDM_PHASE_ALLREDUCE_WAIT,
    TDM_PHASE_ALLGATHER_WAIT, TDM_PHASE_REDUCE_SCATTER_WAIT, TDM_PHASE_STEP,
};
#define TDM_CMP_NORDER (int)(sizeof tdm_cmp_order / sizeof tdm_cmp_order[0])

/* An output file, replaced atomically (core/safefile.h): written through
 * a FILE, committed on close. */
typedef struct tdm_cmp_file {
    FILE *f;
    tdm_file_out out;
    char shown[4200];   /* the path as messages name it */
} tdm_cmp_file;

static tdm_status tdm_cmp_open(tdm_cmp_file *cf, int dirfd, const char *dir, const char *name)
{
    int fd = -1;
    cf->f = NULL;
    snprintf(cf->shown, sizeof cf->shown, "%s%s%s", dir ? dir : "", dir ? "/" : "", name);
    if (tdm_file_replace_open(&cf->out, dirfd, name) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: cannot write %s: %s\n", cf->shown, tdm_error_message());
        return TDM_STATUS_IO;
    }
    if ((fd = dup(cf->out.fd)) < 0 || !(cf->f = fdopen(fd, "w"))) {
        fprintf(stderr, "tandem compare: cannot write %s: %s\n", cf->shown, strerror(errno));
        if (fd >= 0) close(fd);
        tdm_file_replace_abort(&cf->out);
        return TDM_STATUS_IO;
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_cmp_close(tdm_cmp_file *cf)
{
    int bad = ferror(cf->f);
    if (fclose(cf->f) != 0 || bad) {
        fprintf(stderr, "tandem compare: writing %s failed: %s\n", cf->shown, strerror(errno));
        tdm_file_replace_abort(&cf->out);
        return TDM_STATUS_IO;
    }
    if (tdm_file_replace_commit(&cf->out) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: writing %s failed: %s\n", cf->shown,
                tdm_error_message());
        return TDM_STATUS_IO;
    }
    return TDM_STATUS_OK;
}

/* Trace timestamps are whole microseconds (the format's unit); a span
 * shorter than that is shown as 1 us rather than vanishing. */
static long long tdm_cmp_us(double ms) { return llround(ms * 1e3); }
static long long tdm_cmp_us_dur(double ms)
{
    long long us = llround(ms * 1e3);
    return us > 0 ? us : 1;
}

tdm_status tdm_cmp_write_trace(const char *path, const tdm_cmp_opts *o,
                               tdm_cmp_result *const *res, int n)
{
    (void)o;
    tdm_cmp_file cf;
    TDM_CHECK(tdm_cmp_open(&cf, AT_FDCWD, NULL, path));
    FILE *f = cf.f;
    int first = 1;
#define TDM_EV(...) do { fprintf(f, "%s\n  ", first ? "" : ","); first = 0; fprintf(f, __VA_ARGS__); } while (0)
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        int pid = k + 1;
        TDM_EV("{\"ph\": \"M\", \"pid\": %d, \"name\": \"process_name\", \"args\": {\"name\": "
               "\"%s (%d device%s)\"}}", pid, tdm_cmp_mode_name(r->mode), r->n_dev,
               r->n_dev > 1 ? "s" : "");
        TDM_EV("{\"ph\": \"M\", \"pid\": %d, \"name\": \"process_sort_index\", \"args\": "
               "{\"sort_index\": %d}}", pid, pid);
        for (int d = 0; d < r->n_dev; d++) {
            char name[48];
            if (r->mode == TDM_CMP_DDP || tdm_cmp_is_sharded(r->mode)) {
                snprintf(name, sizeof name, "rank %d", d);
            } else {
                char dev[32];
                tdm_cmp_dev_name(o, d, dev, sizeof dev);
                snprintf(name, sizeof name, "device %s", dev);
            }
            TDM_EV("{\"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"name\": \"thread_name\", "
                   "\"args\": {\"name\": \"%s\"}}", pid, d, name);
        }
        if (r->mode == TDM_CMP_DDP)
            TDM_EV("{\"ph\": \"M\", \"pid\": %d, \"tid\": 1000, \"name\": \"thread_name\", "
                   "\"args\": {\"name\": \"rank 0 all-reduce (buckets)\"}}", pid);
        tdm_cmp_fsdp_trace(f, &first, pid, r, tdm_cmp_us);
        for (int i = 0; i < r->steps; i++) {
            for (int d = 0; d < r->n_dev; d++) {
                const tdm_phase_times *pt = &r->phase[(size_t)i * r->n_dev + d];
                double t = r->step_t0_ms[i];
                for (int q = 0; q < TDM_CMP_NORDER; q++) {
                    tdm_phase p = tdm_cmp_order[q];
                    double dur = pt->ms[p];
                    /* DP phases are fork/join rounds: the next starts when
                     * the slowest device (the step's wall time) is done */
                    double adv = r->mode == TDM_CMP_DP ? r->wall[i].ms[p] : dur;
                    if (dur > 0.0)
                        TDM_EV("{\"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"name\": \"%s\", "
                               "\"cat\": \"phase\", \"ts\": %lld, \"dur\": %lld, \"args\": "
                               "{\"step\": %d}}", pid, d, tdm_phase_name(p), tdm_cmp_us(t),
                               tdm_cmp_us_dur(dur), i + 1);
                    t += adv;
                }
            }
            if (r->mode == TDM_CMP_DDP)
                for (int b = 0; b < r->n_buckets; b++) {
                    const double *e = r->bucket + ((size_t)i * r->n_buckets + b) * 3;
                    double t0 = r->bwd_t0_ms[i];
                    if (e[0] < 0.0) continue;   /* not in this step's plan */
                    TDM_EV("{\"ph\": \"i\", \"s\": \"t\", \"pid\": %d, \"tid\": 1000, \"name\": "
                           "\"bucket %d ready\", \"ts\": %lld, \"args\": {\"step\": %d}}", pid, b,
                           tdm_cmp_us(t0 + e[0]), i + 1);
                    if (e[2] > e[1])
                        TDM_EV("{\"ph\": \"X\", \"pid\": %d, \"tid\": 1000, \"name\": "
                               "\"all-reduce bucket %d\", \"cat\": \"comm\", \"ts\": %lld, "
                               "\"dur\": %lld, \"args\": {\"step\": %d, \"ready_us\": %lld}}",
                               pid, b, tdm_cmp_us(t0 + e[1]), tdm_cmp_us_dur(e[2] - e[1]), i + 1,
                               tdm_cmp_us(e[0]));
                }
        }
    }
    tdm_cmp_pp_trace(f, &first, n + 1, tdm_cmp_us);   /* --modes ...,pp */
    fprintf(f, "\n]}\n");
#undef TDM_EV
    return tdm_cmp_close(&cf);
}

tdm_status tdm_cmp_write_csv(const char *path, const tdm_cmp_opts *o, tdm_cmp_result *const *res,
                             int n_main, int n)
{
    (void)o;
    tdm_cmp_file cf;
    TDM_CHECK(tdm_cmp_open(&cf, AT_FDCWD, NULL, path));
    FILE *f = cf.f;
    fprintf(f, "mode,devices,step,loss,step_ms");
    for (int p = 0; p < TDM_PHASE_COUNT_; p++) {
        fputc(',', f);
        for (const char *c = tdm_phase_name((tdm_phase)p); *c; c++)
            fputc(*c == ' ' || *c == '-' ? '_' : *c, f);
        fputs("_ms", f);
    }
    /* the all-reduce's whole span (first bucket's start to last's end),
     * not only the exposed all_reduce_wait_ms; then main or sweep */
    fprintf(f, ",allreduce_span_ms,run\n");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        for (int i = 0; i < r->steps; i++) {
            fprintf(f, "%s,%d,%d,%.9g,%.4f", tdm_cmp_mode_name(r->mode), r->n_dev, i + 1,
                    r->loss[i], r->step_ms[i]);
            for (int p = 0; p < TDM_PHASE_COUNT_; p++) fprintf(f, ",%.4f", r->wall[i].ms[p]);
            fprintf(f, ",%.4f,%s\n", r->comm_ms[i], k < n_main ? "main" : "sweep");
        }
    }
    return tdm_cmp_close(&cf);
}
