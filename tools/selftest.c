/* tools/selftest.c: `tandem selftest`, one command that says whether
 * multi-device training works on this machine, for CI on a workstation.
 * It runs, in order: devices visible and usable; gemm against a naive
 * host reference; every collective x op at a few sizes over the devices'
 * communicator (shm between host devices, NCCL between GPUs, staged
 * through device buffers; #wrong and busbw against the copy bandwidth);
 * DP and DDP against one device (`tandem compare`'s verdict); checkpoint
 * save/resume bit-exact; a killed rank named within a bound; a short
 * throughput run, compared with a baseline file when one is given. Each
 * check is a JUnit test case (--junit FILE). Checks that need a whole run
 * exec this same binary, so they test exactly what a user runs; those
 * that open devices here run in a forked child, so that this process
 * never initialises CUDA before it forks the collectives' ranks.
 * It is not a benchmark suite (bench is) and not the unit tests. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/device.h"
#include "core/rng.h"
#include "core/safefile.h"
#include "core/timer.h"
#include "dist/run.h"
#include "shm/spawn.h"
#include "tools/devices.h"
#include "tools/selftest.h"
#include "tools/tools.h"

tdm_st_case *tdm_st_begin(tdm_st *t, const char *name)
{
    tdm_st_case *c = &t->c[t->n++];
    memset(c, 0, sizeof *c);
    c->name = name;
    c->secs = (double)tdm_time_ns();
    fprintf(stderr, "selftest: %s ...\n", name);
    return c;
}

void tdm_st_end(tdm_st_case *c) { c->secs = ((double)tdm_time_ns() - c->secs) * 1e-9; }

void tdm_st_fail(tdm_st_case *c, const char *fmt, ...)
{
    if (c->failed) return;   /* the first reason stands */
    c->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->message, sizeof c->message, fmt, ap);
    va_end(ap);
}

/* A skipped check, with the reason (JUnit's <skipped message>). */
void tdm_st_skip(tdm_st_case *c, const char *fmt, ...)
{
    c->skipped = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->message, sizeof c->message, fmt, ap);
    va_end(ap);
}

void tdm_st_fig(tdm_st_case *c, const char *fmt, ...)
{
    size_t l = strlen(c->figures);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->figures + l, sizeof c->figures - l, fmt, ap);
    va_end(ap);
}

int tdm_st_exec_marked(const tdm_st *t, int secs, const char *const *env, char *out,
                       size_t cap, double *elapsed, tdm_st_marks *mk, const char *const *args)
{
    if (mk) mk->at_a = mk->at_b = -1;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC)) return -1;
    uint64_t t0 = tdm_time_ns();
    pid_t pid = fork();
    if (pid < 0) { close(fds[0]); close(fds[1]); return -1; }
    if (pid == 0) {
        const char *argv[64];
        int n = 0;
        argv[n++] = t->self;
        for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
        argv[n] = NULL;
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        setpgid(0, 0);   /* its ranks are stopped with it */
        execv(t->self, (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    int timed_out = 0;
    uint64_t end = t0 + (uint64_t)secs * 1000000000ull;
    for (;;) {
        struct pollfd pf = {.fd = fds[0], .events = POLLIN};
        int k = poll(&pf, 1, 100);
        if (k > 0) {
            char buf[4096];
            ssize_t r = read(fds[0], buf, sizeof buf);
            if (r <= 0) break;
            size_t take = (size_t)r < cap - 1 - len ? (size_t)r : cap - 1 - len;
            memcpy(out + len, buf, take);
            len += take;
            out[len] = 0;
            double now = (double)(tdm_time_ns() - t0) * 1e-9;
            if (mk && mk->at_a < 0 && strstr(out, mk->a)) mk->at_a = now;
            if (mk && mk->at_b < 0 && strstr(out, mk->b)) mk->at_b = now;
        }
        if (tdm_time_ns() > end) { timed_out = 1; kill(-pid, SIGKILL); break; }
    }
    out[len] = 0;
    close(fds[0]);
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {}
    if (elapsed) *elapsed = (double)(tdm_time_ns() - t0) * 1e-9;
    if (timed_out) return 124;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

int tdm_st_exec(const tdm_st *t, int secs, const char *const *env, char *out, size_t cap,
                double *elapsed, const char *const *args)
{
    return tdm_st_exec_marked(t, secs, env, out, cap, elapsed, NULL, args);
}

/* The last line of out that contains key (for messages). */
void tdm_st_line(const char *out, const char *key, char *dst, size_t n)
{
    const char *p = NULL, *q = out;
    while ((q = strstr(q, key))) p = q++;
    if (!p) { snprintf(dst, n, "%s", ""); return; }
    while (p > out && p[-1] != '\n') p--;
    while (*p == ' ') p++;
    size_t k = 0;   /* runs of spaces (tables) become one */
    for (; *p && *p != '\n' && k + 1 < n; p++)
        if (*p != ' ' || (k && dst[k - 1] != ' ')) dst[k++] = *p;
    dst[k] = 0;
}

/* Runs body(t, c) in a forked child whose case comes back through shared
 * memory: the checks that open devices in this process would otherwise
 * initialise CUDA here, and a process that has cannot hand CUDA to the
 * ranks it forks later (the collectives). */
static void tdm_st_isolated(tdm_st *t, tdm_st_case *c, void (*body)(tdm_st *, tdm_st_case *))
{
    tdm_st_case *shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        tdm_st_fail(c, "mmap: %s", strerror(errno));
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        tdm_st_fail(c, "fork: %s", strerror(errno));
    } else if (pid == 0) {
        body(t, c);
        *shared = *c;
        _exit(0);
    } else {
        int ws = 0;
        pid_t w;
        while ((w = waitpid(pid, &ws, 0)) < 0 && errno == EINTR) {}
        if (w == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0) {
            double secs = c->secs;   /* the parent's start */
            *c = *shared;
            c->secs = secs;
        } else {
            char how[128] = "could not be waited for";
            if (w == pid) tdm_shm_wait_status_str(ws, how, sizeof how);
            tdm_st_fail(c, "the process running the check %s", how);
        }
    }
    munmap(shared, sizeof *shared);
}

/* The checks --only may name (devices always runs: the rest need it). */
static const char *const tdm_st_names[] = {"devices", "gemm", "collectives",
                                           "dp_ddp_vs_one_device", "checkpoint_resume_bit_exact",
                                           "killed_rank_named", "throughput"};

static int tdm_st_in_list(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        size_t l = strcspn(p, ",");
        if (l == n && !strncmp(p, name, n)) return 1;
        p += l + (p[l] == ',');
    }
    return 0;
}

static int tdm_st_wanted(const tdm_st *t, const char *name)
{
    return !t->only || tdm_st_in_list(t->only, name);
}

static int tdm_st_only_valid(const char *list)
{
    for (const char *p = list; *p;) {
        size_t l = strcspn(p, ",");
        int ok = 0;
        for (size_t i = 0; i < sizeof tdm_st_names / sizeof tdm_st_names[0]; i++)
            ok |= strlen(tdm_st_names[i]) == l && !strncmp(p, tdm_st_names[i], l);
        if (!ok) {
            fprintf(stderr, "tandem selftest: --only: '%.*s' is not a check (see tandem "
                    "selftest --help)\n", (int)l, p);
            return 0;
        }
        p += l + (p[l] == ',');
    }
    return 1;
}

/* --- 1. devices ------------------------------------------------------------ */

/* Each device opens and round-trips a value. */
static void tdm_st_devices_open(tdm_st *t, tdm_st_case *c)
{
    for (int i = 0; i < t->dl.count && !c->failed; i++) {
        tdm_device *d = NULL;
        void *p = NULL;
        float x = 1.5f, y = 0;
        if (tdm_device_open(&d, t->cuda ? "cuda" : "cpu", t->dl.index[i], 1) ||
            tdm_dev_alloc(d, 4, &p) || tdm_dev_copy_from_host(d, p, &x, 4) ||
            tdm_dev_copy_to_host(d, &y, p, 4) || tdm_dev_sync(d) || y != x)
            tdm_st_fail(c, "device %s:%d: %s", t->cuda ? "cuda" : "cpu", t->dl.index[i],
                        y != x && !tdm_error_message()[0] ? "a round trip lost the value"
                                                         : tdm_error_message());
        if (p) tdm_dev_free(d, p);
        tdm_device_free(d);
    }
}

static void tdm_st_devices(tdm_st *t)
{
    tdm_st_case *c = tdm_st_begin(t, "devices");
    /* parsed without initialising CUDA here (forks = 1) */
    tdm_status pst = tdm_dist_parse_devices(&t->dl, t->device, 1);
    if (pst == TDM_STATUS_NO_DEVICE) {
        /* no such device here (no GPU, or no CUDA backend): nothing to
         * check, which is not a failure of what is here */
        tdm_st_skip(c, "--device %s: %s", t->device, tdm_error_message());
        tdm_st_end(c);
        return;
    } else if (pst) {
        tdm_st_fail(c, "--device %s: %s", t->device, tdm_error_message());
    } else {
        t->world = t->dl.count;
        t->cuda = t->dl.kind == TDM_DEVICE_CUDA;
        tdm_st_isolated(t, c, tdm_st_devices_open);
        tdm_st_fig(c, "%d %s device(s)", t->dl.count, t->cuda ? "cuda" : "host");
    }
    char out[TDM_ST_OUT_MAX], line[256];
    int rc = tdm_st_exec(t, 60, NULL, out, sizeof out, NULL, (const char *const[]){"info", NULL});
    tdm_st_line(out, "nvcc", line, sizeof line);
    if (line[0]) tdm_st_fig(c, "%s%s", c->figures[0] ? "; " : "", line);
    tdm_st_line(out, "driver", line, sizeof line);
    if (line[0]) tdm_st_fig(c, "%s%s", c->figures[0] ? "; " : "", line);
    if (rc != 0) tdm_st_fail(c, "tandem info exited %d:\n%s", rc, out);
    tdm_st_end(c);
}

/* --- 2. gemm against a naive reference --------------------------------------- */

static void tdm_st_gemm_run(tdm_st *t, tdm_st_case *c)
{
    static const int shapes[][3] = {{1, 1, 1}, {7, 5, 3}, {64, 48, 33}, {128, 96, 256}};
    tdm_device *d = NULL;
    if (tdm_device_open(&d, t->cuda ? "cuda" : "cpu", t->dl.index[0], 1)) {
        tdm_st_fail(c, "opening the device: %s", tdm_error_message());
        return;
    }
    double worst = 0;
    int cases = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0] && !c->failed; s++)
        for (int tr = 0; tr < 4 && !c->failed; tr++) {
            int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
            tdm_trans ta = tr & 1 ? TDM_TRANS_T : TDM_TRANS_N, tb = tr & 2 ? TDM_TRANS_T : TDM_TRANS_N;
            int lda = ta ? k : m, ldb = tb ? n : k;
            size_t na = (size_t)m * k, nb = (size_t)k * n, nc = (size_t)m * n;
            float *a = malloc(na * 4), *b = malloc(nb * 4), *cr = malloc(nc * 4), *cd = malloc(nc * 4);
            void *da = NULL, *db = NULL, *dc = NULL;
            for (size_t i = 0; i < na; i++) a[i] = (float)((i * 7919) % 13) / 13.0f - 0.5f;
            for (size_t i = 0; i < nb; i++) b[i] = (float)((i * 104729) % 17) / 17.0f - 0.5f;
            /* column-major reference: C(i,j) = sum_l op(A)(i,l) op(B)(l,j) */
            double scale = 0;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    double acc = 0;
                    for (int l = 0; l < k; l++) {
                        float av = ta ? a[l + (size_t)i * lda] : a[i + (size_t)l * lda];
                        float bv = tb ? b[j + (size_t)l * ldb] : b[l + (size_t)j * ldb];
                        acc += (double)av * bv;
                    }
                    cr[i + (size_t)j * m] = (float)acc;
                    if (fabs(acc) > scale) scale = fabs(acc);
                }
            if (tdm_dev_alloc(d, na * 4, &da) || tdm_dev_alloc(d, nb * 4, &db) ||
                tdm_dev_alloc(d, nc * 4, &dc) || tdm_dev_copy_from_host(d, da, a, na * 4) ||
                tdm_dev_copy_from_host(d, db, b, nb * 4) ||
                tdm_dev_gemm(d, ta, tb, m, n, k, 1.0f, da, lda, db, ldb, 0.0f, dc, m) ||
                tdm_dev_copy_to_host(d, cd, dc, nc * 4) || tdm_dev_sync(d)) {
                tdm_st_fail(c, "gemm %dx%dx%d: %s", m, n, k, tdm_error_message());
            } else {
                for (size_t i = 0; i < nc; i++) {
                    double err = fabs((double)cd[i] - cr[i]);
                    if (err > worst) worst = err;
                    if (err > 1e-5 + 1e-4 * scale) {
                        tdm_st_fail(c, "gemm %c%c m=%d n=%d k=%d: element %zu is %.7g, the "
                                    "reference %.7g", ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, i,
                                    (double)cd[i], (double)cr[i]);
                        break;
                    }
                }
            }
            cases++;
            if (da) tdm_dev_free(d, da);
            if (db) tdm_dev_free(d, db);
            if (dc) tdm_dev_free(d, dc);
            free(a);
            free(b);
            free(cr);
            free(cd);
        }
    tdm_st_fig(c, "%d shapes x transposes, max |error| %.2g", cases, worst);
    tdm_device_free(d);
}

static void tdm_st_gemm(tdm_st *t)
{
    tdm_st_case *c = tdm_st_begin(t, "gemm");
    tdm_st_isolated(t, c, tdm_st_gemm_run);   /* CUDA is not initialised here */
    tdm_st_end(c);
}

/* --- report ------------------------------------------------------------------------ */

static void tdm_st_xml(FILE *f, const char *s)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '&') fputs("&amp;", f);
        else if (ch == '<') fputs("&lt;", f);
        else if (ch == '>') fputs("&gt;", f);
        else if (ch == '"') fputs("&quot;", f);
        else if (ch < 0x20 && ch != '\n' && ch != '\t') fputc(' ', f);   /* not allowed in XML 1.0 */
        else fputc(ch, f);
    }
}

/* A file written whole and replaced atomically (core/safefile.h): the
 * stream to write it; tdm_st_out_close commits it. */
static FILE *tdm_st_out_open(tdm_file_out *o, const char *path)
{
    if (tdm_file_replace_open(o, AT_FDCWD, path) != TDM_STATUS_OK) return NULL;
    int fd = dup(o->fd);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        tdm_error_set(TDM_STATUS_IO, "%s: %s", path, strerror(errno));
        tdm_file_replace_abort(o);
    }
    return f;
}

/* 0 when f was written and is now in place. */
static int tdm_st_out_close(tdm_file_out *o, FILE *f, int bad)
{
    if (fclose(f) != 0 || bad) {
        tdm_error_set(TDM_STATUS_IO, "%s: write failed: %s", o->path, strerror(errno));
        tdm_file_replace_abort(o);
        return -1;
    }
    return tdm_file_replace_commit(o) == TDM_STATUS_OK ? 0 : -1;
}

static int tdm_st_junit(const tdm_st *t, const char *path)
{
    tdm_file_out o;
    FILE *f = tdm_st_out_open(&o, path);
    if (!f) return -1;
    int failures = 0, skipped = 0;
    double total = 0;
    for (int i = 0; i < t->n; i++) {
        failures += t->c[i].failed;
        skipped += t->c[i].skipped;
        total += t->c[i].secs;
    }
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    fprintf(f, "<testsuites name=\"tandem selftest\" tests=\"%d\" failures=\"%d\" errors=\"0\" "
               "skipped=\"%d\" time=\"%.3f\">\n", t->n, failures, skipped, total);
    fprintf(f, "  <testsuite name=\"selftest ");
    tdm_st_xml(f, t->device);
    fprintf(f, "\" tests=\"%d\" failures=\"%d\" errors=\"0\" skipped=\"%d\" time=\"%.3f\">\n",
            t->n, failures, skipped, total);
    for (int i = 0; i < t->n; i++) {
        const tdm_st_case *c = &t->c[i];
        fprintf(f, "    <testcase classname=\"tandem.selftest\" name=\"%s\" time=\"%.3f\">\n",
                c->name, c->secs);
        if (c->failed) {
            fprintf(f, "      <failure message=\"");
            char first[256];
            snprintf(first, sizeof first, "%.*s", (int)strcspn(c->message, "\n"), c->message);
            tdm_st_xml(f, first);
            fprintf(f, "\" type=\"failure\">");
            tdm_st_xml(f, c->message);
            fprintf(f, "</failure>\n");
        } else if (c->skipped) {
            fprintf(f, "      <skipped message=\"");
            tdm_st_xml(f, c->message);
            fprintf(f, "\"/>\n");
        }
        fprintf(f, "      <system-out>");
        tdm_st_xml(f, c->figures);
        fprintf(f, "</system-out>\n    </testcase>\n");
    }
    int bad = fprintf(f, "  </testsuite>\n</testsuites>\n") < 0;
    return tdm_st_out_close(&o, f, bad);
}

static void tdm_st_usage(FILE *f)
{
    fprintf(f,
        "usage: tandem selftest [--device cpu:N|cuda|cuda:I,J..] [--junit FILE] [--quick]\n"
        "                       [--baseline FILE | --save-baseline FILE] [--only LIST]\n"
        "\n"
        "Checks, in order, that multi-device training works on this machine; each\n"
        "check is one JUnit test case with its time and figures:\n"
        "  devices                      visible and usable (a round trip; tandem info)\n"
        "  gemm                         the device's gemm vs a naive host reference\n"
        "  collectives                  every collective x op at a few sizes over the\n"
        "                               devices' communicator (shm; NCCL on GPUs),\n"
        "                               #wrong = 0; busbw vs the copy ceiling\n"
        "  dp_ddp_vs_one_device         tandem compare's equivalence verdict\n"
        "  checkpoint_resume_bit_exact  1 epoch + resume == 2 epochs, bit for bit (DDP)\n"
        "  killed_rank_named            a SIGKILLed rank is named, with the doctor's\n"
        "                               verdict, within 10 s of the fault\n"
        "  throughput                   DDP samples/s, the median of %d windows of %s\n"
        "                               samples (%d with --quick) and their spread; with\n"
        "                               --baseline FILE it fails when more than the\n"
        "                               tolerance below the file's median: %.0f%% + %.0fx the\n"
        "                               wider spread (this run's or the file's), at most %.0f%%\n"
        "\n"
        "  --device SPEC        devices to check                          [cpu:2]\n"
        "  --junit FILE         write the results as JUnit XML (Jenkins, GitLab, GitHub)\n"
        "  --quick              fewer sizes, steps and windows (7 s on 2 host devices of\n"
        "                       a loaded 2-core VM, 11 s without --quick)\n"
        "  --baseline FILE      compare the throughput with FILE's\n"
        "  --save-baseline FILE write this run's throughput (median, spread) to FILE\n"
        "  --only LIST          run only these checks (comma-separated names above;\n"
        "                       devices always runs)\n"
        "\n"
        "Prints one table and 'selftest: N passed, M failed'. Exit codes: 0 every\n"
        "check passed (or was skipped), 1 a check failed, 2 bad usage, 77 no such\n"
        "device here (--device cuda without a GPU): every check skipped, with the\n"
        "reason in the table and the JUnit file.\n",
        TDM_ST_WINDOWS - 1, TDM_ST_WINDOW_SAMPLES, TDM_ST_WINDOWS_QUICK - 1,
        100.0 * TDM_ST_TOL_FLOOR, TDM_ST_TOL_SPREAD_K, 100.0 * TDM_ST_TOL_MAX);
}

/* The files named on the command line, checked before minutes of checks:
 * --baseline must be a readable regular file, --junit and --save-baseline
 * paths that can take one (core/safefile.h: never a FIFO, a device or a
 * directory, nor a link to one). USAGE after saying which. */
static tdm_status tdm_st_check_paths(const tdm_st *t, const char *junit)
{
    const char *const out[2][2] = {{"--junit", junit}, {"--save-baseline", t->save_baseline}};
    for (int i = 0; i < 2; i++)
        if (out[i][1] && tdm_file_replace_check(AT_FDCWD, out[i][1]) != TDM_STATUS_OK)
            return tdm_tool_usage_error("tandem selftest: %s: %s\n", out[i][0],
                                        tdm_error_message());
    int fd;
    if (t->baseline && tdm_file_open_read(t->baseline, &fd, NULL) != TDM_STATUS_OK)
        return tdm_tool_usage_error("tandem selftest: --baseline: %s\n", tdm_error_message());
    if (t->baseline) close(fd);
    return TDM_STATUS_OK;
}

int tdm_tool_selftest_main(int argc, char **argv)
{
    tdm_st *t = calloc(1, sizeof *t);
    if (!t) return 1;
    t->device = "cpu:2";
    const char *junit = NULL;
    int rc = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { tdm_st_usage(stdout); rc = 0; goto out; }
        else if (!strcmp(a, "--quick")) t->quick = 1;
        else if (!strcmp(a, "--device") && has) t->device = argv[++i];
        else if (!strcmp(a, "--junit") && has) junit = argv[++i];
        else if (!strcmp(a, "--baseline") && has) t->baseline = argv[++i];
        else if (!strcmp(a, "--save-baseline") && has) t->save_baseline = argv[++i];
        else if (!strcmp(a, "--only") && has) t->only = argv[++i];
        else {
            int needs = !strcmp(a, "--device") || !strcmp(a, "--junit") ||
                        !strcmp(a, "--baseline") || !strcmp(a, "--save-baseline") ||
                        !strcmp(a, "--only");
            fprintf(stderr, "tandem selftest: %s '%s' (see tandem selftest --help)\n",
                    needs ? "missing value after" : "unknown argument", a);
            goto out;
        }
    }
    if (t->baseline && t->save_baseline) {
        fprintf(stderr, "tandem selftest: --baseline and --save-baseline exclude each other\n");
        goto out;
    }
    if (t->only && !tdm_st_only_valid(t->only)) goto out;
    if (tdm_st_check_paths(t, junit) != TDM_STATUS_OK) goto out;
    rc = 1;
    static char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) { fprintf(stderr, "tandem selftest: /proc/self/exe: %s\n", strerror(errno)); goto out; }
    self[sl] = 0;
    t->self = self;
    const char *tmp = getenv("TMPDIR");
    snprintf(t->tmp, sizeof t->tmp, "%s/tandem-selftest-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(t->tmp)) {
        fprintf(stderr, "tandem selftest: mkdtemp %s: %s\n", t->tmp, strerror(errno));
        goto out;
    }
    /* the runs' failure dumps go with the rest, removed at the end */
    setenv("TANDEM_FR_DUMP", t->tmp, 1);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    tdm_st_devices(t);
    if (t->c[0].skipped) {
        /* every check is reported, each skipped with the reason */
        static const char *const rest[] = {"gemm", "collectives", "dp_ddp_vs_one_device",
                                           "checkpoint_resume_bit_exact", "killed_rank_named",
                                           "throughput"};
        for (size_t i = 0; i < sizeof rest / sizeof rest[0]; i++) {
            tdm_st_case *c = tdm_st_begin(t, rest[i]);
            tdm_st_skip(c, "no device to check: %s", t->c[0].message);
            tdm_st_end(c);
        }
    } else if (!t->c[0].failed) {
        static const struct {
            const char *name;
            void (*run)(tdm_st *);
        } checks[] = {{"gemm", tdm_st_gemm},
                      {"collectives", tdm_st_collectives},
                      {"dp_ddp_vs_one_device", tdm_st_compare},
                      {"checkpoint_resume_bit_exact", tdm_st_checkpoint},
                      {"killed_rank_named", tdm_st_killed_rank},
                      {"throughput", tdm_st_throughput}};
        for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++)
            if (tdm_st_wanted(t, checks[i].name)) checks[i].run(t);
    }
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", t->tmp);
    if (system(cmd) != 0) fprintf(stderr, "tandem selftest: could not remove %s\n", t->tmp);

    int passed = 0, failed = 0;
    printf("%-30s %-7s %8s  %s\n", "check", "result", "time (s)", "figures");
    for (int i = 0; i < t->n; i++) {
        const tdm_st_case *c = &t->c[i];
        passed += !c->failed && !c->skipped;
        failed += c->failed;
        printf("%-30s %-7s %8.2f  %s\n", c->name, c->failed ? "FAIL" : c->skipped ? "skipped" : "ok",
               c->secs, c->figures);
        if (c->failed || c->skipped)
            printf("%30s   %.*s\n", "", (int)strcspn(c->message, "\n"), c->message);
    }
    printf("selftest: %d passed, %d failed%s\n", passed, failed,
           t->n - passed - failed ? " (the rest skipped)" : "");
    if (junit && tdm_st_junit(t, junit) != 0) {
        fprintf(stderr, "tandem selftest: --junit: %s\n", tdm_error_message());
        failed++;
    }
    if (t->save_baseline && t->samples_per_s > 0) {
        tdm_file_out o;
        FILE *f = tdm_st_out_open(&o, t->save_baseline);
        if (!f || tdm_st_out_close(&o, f, fprintf(f, "ddp_samples_per_s %s %.1f\nddp_spread %s "
                                                  "%.4f\n", t->device, t->samples_per_s,
                                                  t->device, t->spread) < 0) != 0) {
            fprintf(stderr, "tandem selftest: --save-baseline: %s\n", tdm_error_message());
            failed++;
        }
    }
    /* every check skipped (no such device): nothing was checked, which a
     * CI job must not read as a pass (77: automake's "skipped") */
    rc = failed ? 1 : passed ? 0 : TDM_ST_EXIT_NOTHING_CHECKED;
out:
    free(t);
    return rc;
}
