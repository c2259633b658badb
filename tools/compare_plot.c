/* tools/compare_plot.c: `tandem compare --plot DIR`: the data files, the
 * gnuplot script (kept as DIR/plots.gp) and the charts:
 *   loss.png        every mode's loss curve; widest first, each narrower
 *                   and dashed differently, so coinciding curves all show
 *   throughput.png  samples/s per mode, median step with min-max bars; a
 *                   mode on more devices than cores is marked
 *   phases.png      mean ms per step by phase, stacked: one colour per
 *                   phase, the text table's names, only phases some mode has
 *   memory.png      bytes per device or rank by kind, stacked: what
 *                   persists solid, what a step holds hatched; the top is
 *                   the peak
 *   scaling.png     (--sweep) DP and DDP samples/s with min-max bars, the
 *                   ideal line (one device x devices), a mark past the cores
 * Everything is driven by the modes and phases that ran: a new mode or
 * phase gets its curve, bar, colour and legend entry. The directory is
 * checked safe (core/safefile.h); gnuplot reads its script from a memfd. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/safefile.h"
#include "tools/compare.h"
#include "tools/devices.h"

const tdm_phase tdm_cmp_phase_rows[] = {
    TDM_PHASE_REPLICATE, TDM_PHASE_SCATTER, TDM_PHASE_FORWARD, TDM_PHASE_GATHER,
    TDM_PHASE_LOSS, TDM_PHASE_BACKWARD, TDM_PHASE_REDUCE, TDM_PHASE_ALLREDUCE_WAIT,
    TDM_PHASE_ALLGATHER_WAIT, TDM_PHASE_REDUCE_SCATTER_WAIT, TDM_PHASE_STEP,
};
const int tdm_cmp_n_phase_rows = (int)(sizeof tdm_cmp_phase_rows / sizeof tdm_cmp_phase_rows[0]);

const char *tdm_cmp_phase_label(tdm_phase p)
{
    switch (p) {
    case TDM_PHASE_ALLREDUCE_WAIT: return "all-reduce (exposed)";
    case TDM_PHASE_ALLGATHER_WAIT: return "all-gather (exposed)";
    case TDM_PHASE_REDUCE_SCATTER_WAIT: return "reduce-scatter (exp.)";
    default: return tdm_phase_name(p);
    }
}

/* Distinct colours (Paul Tol's bright and muted sets, then Okabe-Ito):
 * phase row i gets colour i; "other" is grey. More rows than colours
 * would repeat one, which tests/test_compare_plot.c would catch. */
static const char *const tdm_cmp_palette[] = {
    "#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#332288",
    "#e69f00", "#8c564b", "#d55e00", "#44aa99", "#cc79a7", "#999933", "#000000",
    "#0072b2", "#117733",
};
#define TDM_CMP_NPALETTE (int)(sizeof tdm_cmp_palette / sizeof tdm_cmp_palette[0])
#define TDM_CMP_OTHER_COLOUR "#bbbbbb"
/* memory.png: ranks shown per mode (the rest are alike: the text table
 * shows two) */
#define TDM_CMP_PLOT_MAX_RANKS 8

static const char *tdm_cmp_colour(int i)
{
    return i < TDM_CMP_NPALETTE ? tdm_cmp_palette[i] : tdm_cmp_palette[i % TDM_CMP_NPALETTE];
}

/* The memory kinds, in stacking order; persist: solid, else hatched. */
static const struct {
    const char *name;
    int persist;
} tdm_cmp_mem_kinds[] = {{"params", 1},     {"grads", 1},       {"optimizer", 1},
                         {"buffers", 1},    {"activations", 0}, {"comm", 0}};
#define TDM_CMP_NMEM (int)(sizeof tdm_cmp_mem_kinds / sizeof tdm_cmp_mem_kinds[0])

static double tdm_cmp_mem_kind(const tdm_cmp_memory *m, int i)
{
    const double v[TDM_CMP_NMEM] = {m->params, m->grads, m->optim, m->buffers, m->activations,
                                    m->comm};
    return v[i];
}

/* A mode on more devices than the machine has cores (host devices, or
 * emulated GPUs, which run on the host): they share the cores. */
static int tdm_cmp_oversubscribed(const tdm_cmp_opts *o, int n_dev)
{
    return n_dev > tdm_device_host_cores() &&
           (o->dl.kind == TDM_DEVICE_HOST || tdm_tool_cuda_emulated());
}

typedef struct tdm_cmp_file {
    FILE *f;
    tdm_file_out out;
} tdm_cmp_file;

static tdm_status tdm_cmp_plot_open(tdm_cmp_file *cf, int dirfd, const char *dir,
                                    const char *name)
{
    int fd = -1;
    cf->f = NULL;
    if (tdm_file_replace_open(&cf->out, dirfd, name) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: cannot write %s/%s: %s\n", dir, name,
                tdm_error_message());
        return TDM_STATUS_IO;
    }
    if ((fd = dup(cf->out.fd)) < 0 || !(cf->f = fdopen(fd, "w"))) {
        fprintf(stderr, "tandem compare: cannot write %s/%s: %s\n", dir, name, strerror(errno));
        if (fd >= 0) close(fd);
        tdm_file_replace_abort(&cf->out);
        return TDM_STATUS_IO;
    }
    return TDM_STATUS_OK;
}

static tdm_status tdm_cmp_plot_close(tdm_cmp_file *cf, const char *dir)
{
    int bad = ferror(cf->f);
    if (fclose(cf->f) != 0 || bad) {
        fprintf(stderr, "tandem compare: writing in %s/ failed: %s\n", dir, strerror(errno));
        tdm_file_replace_abort(&cf->out);
        return TDM_STATUS_IO;
    }
    if (tdm_file_replace_commit(&cf->out) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: writing in %s/ failed: %s\n", dir, tdm_error_message());
        return TDM_STATUS_IO;
    }
    return TDM_STATUS_OK;
}

/* Which phase rows some mode has (a mean above zero). */
static int tdm_cmp_phases_present(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                                  int *present)
{
    int count = 0;
    for (int q = 0; q < tdm_cmp_n_phase_rows; q++) {
        present[q] = 0;
        for (int k = 0; k < n; k++) {
            tdm_phase_times pm;
            tdm_cmp_phase_mean(o, res[k], &pm);
            if (pm.ms[tdm_cmp_phase_rows[q]] > 0.0) present[q] = 1;
        }
        count += present[q];
    }
    return count;
}

/* loss.dat, throughput.dat, phases.dat, memory.dat (and scaling.dat). */
static tdm_status tdm_cmp_plot_data(int dirfd, const char *dir, const tdm_cmp_opts *o,
                                    tdm_cmp_result *const *res, int n, const int *present,
                                    const tdm_cmp_sweep_point *sweep, int n_sweep)
{
    tdm_cmp_file cf;
    TDM_CHECK(tdm_cmp_plot_open(&cf, dirfd, dir, "loss.dat"));
    fprintf(cf.f, "step");
    for (int k = 0; k < n; k++)
        fprintf(cf.f, " %s(%d)", tdm_cmp_mode_name(res[k]->mode), res[k]->n_dev);
    fputc('\n', cf.f);
    for (int i = 0; i < o->steps; i++) {
        fprintf(cf.f, "%d", i + 1);
        for (int k = 0; k < n; k++) fprintf(cf.f, " %.9g", res[k]->loss[i]);
        fputc('\n', cf.f);
    }
    TDM_CHECK(tdm_cmp_plot_close(&cf, dir));

    TDM_CHECK(tdm_cmp_plot_open(&cf, dirfd, dir, "throughput.dat"));
    fprintf(cf.f, "# mode median_samples_per_s min max (from the post-warm-up steps' max, "
                  "median and min time)\n");
    for (int k = 0; k < n; k++) {
        double med, mn, mx;
        tdm_cmp_step_stats(o, res[k], &med, &mn, &mx);
        fprintf(cf.f, "\"%s(%d)%s\" %.2f %.2f %.2f\n", tdm_cmp_mode_name(res[k]->mode),
                res[k]->n_dev, tdm_cmp_oversubscribed(o, res[k]->n_dev) ? "*" : "",
                o->batch / med * 1e3, o->batch / mx * 1e3, o->batch / mn * 1e3);
    }
    TDM_CHECK(tdm_cmp_plot_close(&cf, dir));

    TDM_CHECK(tdm_cmp_plot_open(&cf, dirfd, dir, "phases.dat"));
    fprintf(cf.f, "mode");
    for (int q = 0; q < tdm_cmp_n_phase_rows; q++)
        if (present[q]) fprintf(cf.f, " \"%s\"", tdm_cmp_phase_label(tdm_cmp_phase_rows[q]));
    fprintf(cf.f, " \"other (outside phases)\"\n");
    for (int k = 0; k < n; k++) {
        tdm_phase_times pm;
        double mean, sum = 0.0;
        tdm_cmp_phase_mean(o, res[k], &pm);
        tdm_cmp_means(o, res[k], &mean, NULL, NULL);
        fprintf(cf.f, "\"%s(%d)\"", tdm_cmp_mode_name(res[k]->mode), res[k]->n_dev);
        for (int q = 0; q < tdm_cmp_n_phase_rows; q++) {
            double v = pm.ms[tdm_cmp_phase_rows[q]];
            sum += v;
            if (present[q]) fprintf(cf.f, " %.4f", v);
        }
        fprintf(cf.f, " %.4f\n", mean > sum ? mean - sum : 0.0);
    }
    TDM_CHECK(tdm_cmp_plot_close(&cf, dir));

    TDM_CHECK(tdm_cmp_plot_open(&cf, dirfd, dir, "memory.dat"));
    fprintf(cf.f, "device");
    for (int i = 0; i < TDM_CMP_NMEM; i++) fprintf(cf.f, " %s", tdm_cmp_mem_kinds[i].name);
    fprintf(cf.f, " persistent peak   # MiB\n");
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        int ranks = r->mode == TDM_CMP_DDP || tdm_cmp_is_sharded(r->mode);
        int shown = r->n_dev < TDM_CMP_PLOT_MAX_RANKS ? r->n_dev : TDM_CMP_PLOT_MAX_RANKS;
        for (int d = 0; d < shown; d++) {
            double persist = 0.0, peak = 0.0, mib = 1.0 / (1024.0 * 1024.0);
            fprintf(cf.f, "\"%s %s%d\"", tdm_cmp_mode_name(r->mode), ranks ? "r" : "d", d);
            for (int i = 0; i < TDM_CMP_NMEM; i++) {
                double v = tdm_cmp_mem_kind(&r->mem[d], i) * mib;
                fprintf(cf.f, " %.4f", v);
                peak += v;
                if (tdm_cmp_mem_kinds[i].persist) persist += v;
            }
            fprintf(cf.f, " %.4f %.4f\n", persist, peak);
        }
    }
    TDM_CHECK(tdm_cmp_plot_close(&cf, dir));

    if (n_sweep > 0) {
        TDM_CHECK(tdm_cmp_plot_open(&cf, dirfd, dir, "scaling.dat"));
        fprintf(cf.f, "# devices dp_median dp_min dp_max ddp_median ddp_min ddp_max ideal "
                      "(samples/s)\n");
        for (int i = 0; i < n_sweep; i++) {
            const tdm_cmp_sweep_point *s = &sweep[i];
            if (s->dp[0] <= 0) continue;   /* skipped */
            fprintf(cf.f, "%d %.2f %.2f %.2f %.2f %.2f %.2f %.2f\n", s->devices, s->dp[0],
                    s->dp[1], s->dp[2], s->ddp[0], s->ddp[1], s->ddp[2], s->ideal);
        }
        TDM_CHECK(tdm_cmp_plot_close(&cf, dir));
    }
    return TDM_STATUS_OK;
}

/* The gnuplot script (malloc'd), or NULL when out of memory. */
static char *tdm_cmp_plot_script(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                                 const int *present, const tdm_cmp_sweep_point *sweep,
                                 int n_sweep, int any_over)
{
    int mem_present[TDM_CMP_NMEM] = {0};
    for (int k = 0; k < n; k++)
        for (int d = 0; d < res[k]->n_dev && d < TDM_CMP_PLOT_MAX_RANKS; d++)
            for (int i = 0; i < TDM_CMP_NMEM; i++)
                if (tdm_cmp_mem_kind(&res[k]->mem[d], i) > 0) mem_present[i] = 1;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    int cores = tdm_device_host_cores();
    fprintf(f,
            "# gnuplot script written by tandem compare; run: gnuplot plots.gp\n"
            "set terminal pngcairo size 900,540 font ',11'\n"
            "set grid ytics\n"
            "set key top right\n"
            "set output 'loss.png'\n"
            "set title 'Training loss, same initial parameters and batches (%s, batch %d)'\n"
            "set xlabel 'step'; set ylabel 'loss (global batch mean)'\n"
            "# the curves coincide when the modes agree: widest first, each narrower and\n"
            "# dashed differently on top, so that every one shows\n"
            "plot \\\n", o->model, o->batch);
    for (int k = 0; k < n; k++)
        fprintf(f, "  'loss.dat' using 1:%d with lines lw %.1f dashtype %d lc rgb '%s' "
                   "title columnhead(%d)%s\n", k + 2, 1.5 + 2.0 * (n - 1 - k), k + 1,
                tdm_cmp_colour(k), k + 2, k + 1 < n ? ", \\" : "");
    fprintf(f,
            "set output 'throughput.png'\n"
            "set title 'Throughput: median step after warm-up, bars from the slowest to the "
            "fastest step'\n"
            "set xlabel '%s'; set ylabel 'samples/s'; unset key\n"
            "set style fill solid 0.8 border -1; set boxwidth 0.6\n"
            "set yrange [0:*]; set xrange [-0.6:%d.6]\n"
            "plot 'throughput.dat' using 0:2:xtic(1) with boxes lc rgb '#4477aa' notitle, \\\n"
            "  '' using 0:2:3:4 with yerrorbars lc rgb '#000000' pt 0 lw 1.5 notitle\n",
            any_over ? "* more devices than cores: they share the cores" : "", n - 1);
    fprintf(f,
            "set output 'phases.png'\n"
            "set title 'Where a step goes (mean ms per step, by phase, after warm-up)'\n"
            "set xlabel ''; set ylabel 'ms per step'; set key outside right; unset xrange\n"
            "set style data histograms; set style histogram rowstacked\n"
            "set style fill solid 0.85 border -1; set boxwidth 0.6; set xtics rotate by -25\n"
            "plot \\\n");
    int col = 2;
    for (int q = 0; q < tdm_cmp_n_phase_rows; q++) {
        if (!present[q]) continue;
        fprintf(f, "  'phases.dat' using %d%s lc rgb '%s' title columnhead(%d), \\\n", col,
                col == 2 ? ":xtic(1)" : "", tdm_cmp_colour(q), col);
        col++;
    }
    fprintf(f, "  'phases.dat' using %d%s lc rgb '%s' title columnhead(%d)\n", col,
            col == 2 ? ":xtic(1)" : "", TDM_CMP_OTHER_COLOUR, col);
    fprintf(f,
            "set output 'memory.png'\n"
            "set title \"Memory per device or rank (MiB): solid persists between steps,\\n"
            "hatched is held during a step; the top of a bar is the peak\"\n"
            "set ylabel 'MiB'; set xtics rotate by -35\n"
            "plot");
    int first = 1;
    for (int i = 0; i < TDM_CMP_NMEM; i++) {
        if (!mem_present[i]) continue;
        fprintf(f, "%s\\\n  'memory.dat' using %d%s lc rgb '%s' fs %s title '%s%s'",
                first ? " " : ", ", i + 2, first ? ":xtic(1)" : "", tdm_cmp_colour(i),
                tdm_cmp_mem_kinds[i].persist ? "solid 0.85 border -1" : "pattern 4 border -1",
                tdm_cmp_mem_kinds[i].name, tdm_cmp_mem_kinds[i].persist ? "" : " (step)");
        first = 0;
    }
    fprintf(f, "\n");
    if (n_sweep > 0) {
        int max_dev = 1;
        for (int i = 0; i < n_sweep; i++)
            if (sweep[i].devices > max_dev) max_dev = sweep[i].devices;
        fprintf(f,
                "set output 'scaling.png'\n"
                "unset style histogram; set style data linespoints; set key inside top left; "
                "set xtics norotate\n"
                "set title \"Scaling with device count: median step,\\nbars from the slowest "
                "to the fastest step\"\n"
                "set xlabel 'devices'; set ylabel 'samples/s'; set xrange [0.5:%d.5]; "
                "set yrange [0:*]; set xtics 1\n", max_dev);
        if ((o->dl.kind == TDM_DEVICE_HOST || tdm_tool_cuda_emulated()) && max_dev > cores)
            fprintf(f,
                    "set arrow 1 from %d.5, graph 0 to %d.5, graph 1 nohead dt 3 lc rgb "
                    "'#888888'\n"
                    "set label 1 'more devices than the %d cores' at %d.55, graph 0.04 "
                    "left tc rgb '#666666'\n", cores, cores, cores, cores);
        fprintf(f,
                "plot 'scaling.dat' using 1:2:3:4 with yerrorlines lw 2 lc rgb '%s' title 'DP', "
                "\\\n"
                "  '' using 1:5:6:7 with yerrorlines lw 2 lc rgb '%s' title 'DDP', \\\n"
                "  '' using 1:8 with lines dt 2 lw 1.5 lc rgb '#000000' "
                "title 'ideal (one device x devices)'\n",
                tdm_cmp_colour(0), tdm_cmp_colour(1));
    }
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

static const char *const tdm_cmp_pngs[] = {"loss.png", "throughput.png", "phases.png",
                                           "memory.png", "scaling.png"};

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
                               tdm_cmp_result *const *res, int n,
                               const tdm_cmp_sweep_point *sweep, int n_sweep)
{
    int dirfd = -1, present[64] = {0}, any_over = 0;
    tdm_status st = TDM_STATUS_OK;
    char *script = NULL;
    tdm_cmp_file cf;
    /* checked again here, where it counts: everything below goes through
     * this descriptor */
    if ((st = tdm_dir_open_safe(dir, "--plot", 1, &dirfd)) != TDM_STATUS_OK) {
        fprintf(stderr, "tandem compare: %s\n", tdm_error_message());
        return st;
    }
    tdm_cmp_phases_present(o, res, n, present);
    for (int k = 0; k < n; k++) any_over |= tdm_cmp_oversubscribed(o, res[k]->n_dev);
    if ((st = tdm_cmp_plot_data(dirfd, dir, o, res, n, present, sweep, n_sweep))) goto done;
    /* the script: kept for the user as plots.gp; gnuplot gets its own copy */
    if (!(script = tdm_cmp_plot_script(o, res, n, present, sweep, n_sweep, any_over))) {
        fprintf(stderr, "tandem compare: out of memory writing the gnuplot script\n");
        st = TDM_STATUS_OUT_OF_MEMORY;
        goto done;
    }
    if ((st = tdm_cmp_plot_open(&cf, dirfd, dir, "plots.gp"))) goto done;
    fputs(script, cf.f);
    if ((st = tdm_cmp_plot_close(&cf, dir))) goto done;
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        printf("plots: gnuplot is not installed (apt-get install gnuplot-nox, or make deps); "
               "data and script written to %s/ (run: cd %s && gnuplot plots.gp)\n", dir, dir);
        goto done;
    }
    if ((st = tdm_cmp_run_gnuplot(dirfd, dir, script, n_sweep > 0 ? 5 : 4))) goto done;
    printf("plots: %s/loss.png, throughput.png, phases.png, memory.png%s\n", dir,
           n_sweep > 0 ? ", scaling.png" : "");
done:
    free(script);
    close(dirfd);
    return st;
}
