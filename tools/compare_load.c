/* tools/compare_load.c: what else the machine did while `tandem compare`
 * timed its modes. The CPU time the whole machine spent busy
 * (/proc/stat) minus this process's and its reaped children's (the DDP
 * and sharded ranks, getrusage) over a mode's run is what other
 * processes took, in cores' worth; a mode on more devices than cores
 * shares them. Either makes its figures slower and noisier than the
 * machine's, and the report says so (bench dp uses the same sample).
 *
 * /proc/stat counts in clock ticks per CPU, so the busy figure of a
 * window is known to about one tick per CPU: over a 30 ms run on 2 CPUs
 * that is +-0.7 cores, and a short mode once read "4.50 cores' worth (of
 * 2)". A window too short to know the load within TDM_CMP_LOAD_ERR cores
 * is reported as not measurable, never as a number. */
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/device.h"
#include "tools/compare.h"
#include "tools/devices.h"

void tdm_cmp_load_sample(tdm_cmp_load *c)
{
    memset(c, 0, sizeof *c);
    c->wall_s = (double)tdm_time_ns() * 1e-9;
    struct rusage ru;
    for (int who = 0; who < 2; who++)
        if (getrusage(who ? RUSAGE_CHILDREN : RUSAGE_SELF, &ru) == 0)
            c->self_s += (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
                         (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return;
    unsigned long long v[8] = {0};
    if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
               &v[4], &v[5], &v[6], &v[7]) == 8) {
        /* user nice system idle iowait irq softirq steal: all but idle, iowait */
        double ticks = (double)sysconf(_SC_CLK_TCK);
        c->busy_s = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / ticks;
        c->valid = 1;
    }
    fclose(f);
}

double tdm_cmp_load_min_window(void)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN), ticks = sysconf(_SC_CLK_TCK);
    if (cpus < 1) cpus = 1;
    if (ticks < 1) ticks = 100;
    /* one tick per CPU of error, spread over the window */
    return (double)cpus / ((double)ticks * TDM_CMP_LOAD_ERR);
}

double tdm_cmp_load_other(const tdm_cmp_load *a, const tdm_cmp_load *b)
{
    double wall = b->wall_s - a->wall_s;
    if (!a->valid || !b->valid || wall < tdm_cmp_load_min_window()) return -1.0;
    double other = (b->busy_s - a->busy_s) - (b->self_s - a->self_s);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    other = other > 0 ? other / wall : 0.0;
    /* what is left of the window's error cannot make others use more
     * than the whole machine */
    return cpus > 0 && other > (double)cpus ? (double)cpus : other;
}

int tdm_cmp_load_print(const tdm_cmp_opts *o, tdm_cmp_result *const *res, int n,
                       const double *other_of)
{
    int cores = tdm_device_host_cores(), warned = 0;
    int host = o->dl.kind == TDM_DEVICE_HOST || tdm_tool_cuda_emulated();
    for (int k = 0; k < n; k++) {
        const tdm_cmp_result *r = res[k];
        double other = other_of[r->mode];
        int over = host && r->n_dev > cores;
        int busy = other >= TDM_CMP_BUSY_CORES;
        if (!over && !busy) continue;
        if (!warned) printf("\nLoad\n");
        warned = 1;
        printf("  warning: %s(%d):", tdm_cmp_mode_name(r->mode), r->n_dev);
        if (over)
            printf(" %d devices on %d cores share them;", r->n_dev, cores);
        if (busy)
            printf(" other processes used %.2f cores' worth of CPU during its run "
                   "(of %d);", other, cores);
        printf(" its figures are slower and noisier than this machine's\n");
    }
    if (warned)
        printf("  (measure on an idle machine, or with fewer devices, before comparing speeds)\n");
    return warned;
}
