/* tools/compare_out.c: what `tandem compare` writes besides its tables:
 * a Chrome trace-event JSON (Perfetto, chrome://tracing), a CSV of the raw
 * per-step figures, and gnuplot charts (loss curves, throughput, per-phase
 * stacked bars, scaling). Spans of a step are laid out from the measured
 * phase durations in the order the phases run (each phase of DP is a
 * fork/join round, so its devices start it together); DDP's bucket spans
 * use the Reducer's own timestamps. Every file is replaced atomically
 * through core/safefile.h, --plot only in a directory no one else can
 * write, and gnuplot reads its script from a memfd, not from a path. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
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
                             int n)
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
    fprintf(f, ",allreduce_ms\n");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        for (int i = 0; i < r->steps; i++) {
            fprintf(f, "%s,%d,%d,%.9g,%.4f", tdm_cmp_mode_name(r->mode), r->n_dev, i + 1,
                    r->loss[i], r->step_ms[i]);
            for (int p = 0; p < TDM_PHASE_COUNT_; p++) fprintf(f, ",%.4f", r->wall[i].ms[p]);
            fprintf(f, ",%.4f\n", r->comm_ms[i]);
        }
    }
    return tdm_cmp_close(&cf);
}

static int tdm_cmp_have_gnuplot(void)
{
    return system("command -v gnuplot >/dev/null 2>&1") == 0;
}

static const tdm_phase tdm_cmp_shown[] = {
    TDM_PHASE_REPLICATE, TDM_PHASE_SCATTER, TDM_PHASE_FORWARD, TDM_PHASE_GATHER,
    TDM_PHASE_LOSS, TDM_PHASE_BACKWARD, TDM_PHASE_REDUCE, TDM_PHASE_ALLREDUCE_WAIT,
    TDM_PHASE_ALLGATHER_WAIT, TDM_PHASE_REDUCE_SCATTER_WAIT, TDM_PHASE_STEP,
};
#define TDM_CMP_NSHOWN (int)(sizeof tdm_cmp_shown / sizeof tdm_cmp_shown[0])

/* The gnuplot script (malloc'd), or NULL when out of memory. */
static char *tdm_cmp_plot_script(const tdm_cmp_opts *o, int n, int n_sweep)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    fprintf(f,
            "# gnuplot script written by tandem compare; run: gnuplot plots.gp\n"
            "set terminal pngcairo size 900,540 font ',11'\n"
            "set grid ytics\n"
            "set key top right\n"
            "set output 'loss.png'\n"
            "set title 'Training loss, same initial parameters and batches (%s, batch %d)'\n"
            "set xlabel 'step'; set ylabel 'loss (global batch mean)'\n"
            "# the curves coincide when the modes agree: widest first, dashed on top\n"
            "plot for [c=2:%d] 'loss.dat' using 1:c with lines lw (10-2*c) dashtype c-1 title columnhead(c)\n"
            "set output 'throughput.png'\n"
            "set title 'Throughput (median step after warm-up)'\n"
            "set xlabel ''; set ylabel 'samples/s'; unset key\n"
            "set style data histograms; set style fill solid 0.8 border -1; set boxwidth 0.6\n"
            "set yrange [0:*]\n"
            "plot 'phases.dat' every ::1 using 2:xtic(1) lc rgb '#4477aa' notitle\n"
            "set output 'phases.png'\n"
            "set title 'Where a step goes (ms per step, by phase)'\n"
            "set ylabel 'ms per step'; set key outside right\n"
            "set style histogram rowstacked\n"
            "plot for [c=3:%d] 'phases.dat' using c:xtic(1) title columnhead(c)\n",
            o->model, o->batch, n + 1, 2 + TDM_CMP_NSHOWN);
    if (n_sweep > 0)
        fprintf(f,
                "set output 'scaling.png'\n"
                "set style data linespoints; unset style histogram; set key top left\n"
                "set title 'Scaling with device count'\n"
                "set xlabel 'devices'; set ylabel 'samples/s'; set xrange [0.5:*]; set xtics 1\n"
                "plot 'scaling.dat' using 1:2 lw 2 title 'DP', '' using 1:3 lw 2 title 'DDP', "
                "'' using 1:4 with lines dt 2 title 'one device'\n");
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

static const char *const tdm_cmp_pngs[] = {"loss.png", "throughput.png", "phases.png",
                                           "scaling.png"};

/* Runs gnuplot in the directory (dirfd: checked safe, only we can write
 * there) with the script on its stdin, from a memfd: never a path another
 * user could swap between our write and gnuplot's read. Checks that every
 * chart was written afresh. */
static tdm_status tdm_cmp_run_gnuplot(int dirfd, const char *dir, const char *script, int n_png)
{
    int mfd = memfd_create("plots.gp", MFD_CLOEXEC);
    if (mfd < 0 || tdm_file_write_all(mfd, script, strlen(script), "plots.gp (memfd)") ||
        lseek(mfd, 0, SEEK_SET) != 0) {
        fprintf(stderr, "tandem compare: cannot hand gnuplot its script: %s\n",
                mfd < 0 ? strerror(errno) : tdm_error_message());
        if (mfd >= 0) close(mfd);
        return TDM_STATUS_SYSTEM;
    }
    /* stale charts would hide a gnuplot that wrote nothing */
    for (int i = 0; i < n_png; i++) unlinkat(dirfd, tdm_cmp_pngs[i], 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        /* no shell: any character may be in dir */
        if (fchdir(dirfd) == 0 && dup2(mfd, STDIN_FILENO) == STDIN_FILENO)
            execlp("gnuplot", "gnuplot", (char *)NULL);
        _exit(127);
    }
    close(mfd);
    int ws = -1;
    if (pid > 0)
        while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {}
    if (pid < 0 || !WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
        if (pid < 0)
            fprintf(stderr, "tandem compare: cannot start gnuplot: %s\n", strerror(errno));
        else if (WIFSIGNALED(ws))
            fprintf(stderr, "tandem compare: gnuplot was killed by signal %d (%s) drawing the "
                    "charts in %s/ (its script: %s/plots.gp)\n", WTERMSIG(ws),
                    strsignal(WTERMSIG(ws)), dir, dir);
        else
            fprintf(stderr, "tandem compare: gnuplot failed (exit %d) drawing the charts in %s/ "
                    "(its script: %s/plots.gp; its message is above)\n", WEXITSTATUS(ws), dir,
                    dir);
        return TDM_STATUS_SYSTEM;
    }
    for (int i = 0; i < n_png; i++) {
        struct stat sb;
        if (fstatat(dirfd, tdm_cmp_pngs[i], &sb, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(sb.st_mode) || sb.st_size == 0) {
            fprintf(stderr, "tandem compare: gnuplot exited 0 but did not write %s in %s/ "
                    "(is its pngcairo terminal installed? try: cd %s && gnuplot plots.gp)\n",
                    tdm_cmp_pngs[i], dir, dir);
            return TDM_STATUS_SYSTEM;
        }
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_cmp_write_plots(const char *dir, const tdm_cmp_opts *o,
                               tdm_cmp_result *const *res, int n, const int *sweep_dev,
                               const double *sweep_dp, const double *sweep_ddp, int n_sweep,
                               double single_sps)
{
    int dirfd = -1;
    tdm_status st = TDM_STATUS_OK;
    char *script = NULL;
    tdm_cmp_file cf;
    /* checked again here, where it counts: everything below goes through
     * this descriptor */
    if ((st = tdm_dir_open_safe(dir, "--plot", 1, &dirfd)) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
        return st;
    }
    /* data files */
    if ((st = tdm_cmp_open(&cf, dirfd, dir, "loss.dat"))) goto done;
    FILE *f = cf.f;
    fprintf(f, "step");
    for (int k = 0; k < n; k++) fprintf(f, " %s(%d)", tdm_cmp_mode_name(res[k]->mode), res[k]->n_dev);
    fputc('\n', f);
    for (int i = 0; i < o->steps; i++) {
        fprintf(f, "%d", i + 1);
        for (int k = 0; k < n; k++) fprintf(f, " %.9g", res[k]->loss[i]);
        fputc('\n', f);
    }
    if ((st = tdm_cmp_close(&cf))) goto done;
    if ((st = tdm_cmp_open(&cf, dirfd, dir, "phases.dat"))) goto done;
    f = cf.f;
    fprintf(f, "mode samples_per_s");
    for (int q = 0; q < TDM_CMP_NSHOWN; q++) {
        fputc(' ', f);
        for (const char *c = tdm_phase_name(tdm_cmp_shown[q]); *c; c++)
            fputc(*c == ' ' ? '-' : *c, f);
    }
    fputc('\n', f);
    for (int k = 0; k < n; k++) {
        double med, mn, mx;
        tdm_phase_times pm;
        tdm_cmp_step_stats(o, res[k], &med, &mn, &mx);
        tdm_cmp_phase_mean(o, res[k], &pm);
        fprintf(f, "\"%s(%d)\" %.2f", tdm_cmp_mode_name(res[k]->mode), res[k]->n_dev,
                o->batch / med * 1e3);
        for (int q = 0; q < TDM_CMP_NSHOWN; q++) fprintf(f, " %.4f", pm.ms[tdm_cmp_shown[q]]);
        fputc('\n', f);
    }
    if ((st = tdm_cmp_close(&cf))) goto done;
    if (n_sweep > 0) {
        if ((st = tdm_cmp_open(&cf, dirfd, dir, "scaling.dat"))) goto done;
        fprintf(cf.f, "# devices dp_samples_per_s ddp_samples_per_s single\n");
        for (int i = 0; i < n_sweep; i++)
            fprintf(cf.f, "%d %.2f %.2f %.2f\n", sweep_dev[i], sweep_dp[i], sweep_ddp[i],
                    single_sps);
        if ((st = tdm_cmp_close(&cf))) goto done;
    }
    /* the script: kept for the user as plots.gp; gnuplot gets its own copy */
    if (!(script = tdm_cmp_plot_script(o, n, n_sweep))) {
        fprintf(stderr, "tandem compare: out of memory writing the gnuplot script\n");
        st = TDM_STATUS_OUT_OF_MEMORY;
        goto done;
    }
    if ((st = tdm_cmp_open(&cf, dirfd, dir, "plots.gp"))) goto done;
    fputs(script, cf.f);
    if ((st = tdm_cmp_close(&cf))) goto done;
    if (!tdm_cmp_have_gnuplot()) {
        printf("plots: gnuplot is not installed (apt-get install gnuplot-nox, or make deps); "
               "data and script written to %s/ (run: cd %s && gnuplot plots.gp)\n", dir, dir);
        goto done;
    }
    if ((st = tdm_cmp_run_gnuplot(dirfd, dir, script, n_sweep > 0 ? 4 : 3))) goto done;
    printf("plots: %s/loss.png, throughput.png, phases.png%s\n", dir,
           n_sweep > 0 ? ", scaling.png" : "");
done:
    free(script);
    close(dirfd);
    return st;
}
