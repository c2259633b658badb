/* tests/test_util.h: small header-only helpers shared by the numeric tests
 * (host device, a deterministic test RNG, tolerance checks, temporary
 * directories). Static functions only: this header is not a library and
 * is included by test_*.c files, never compiled on its own. */
#ifndef TDM_TESTS_TEST_UTIL_H
#define TDM_TESTS_TEST_UTIL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/device.h"
#include "core/rng.h"
#include "core/status.h"

/* Asserts a tdm_status call succeeded, printing the library's message. */
#define TU_OK(expr)                                                                   \
    do {                                                                              \
        tdm_status tu_s_ = (expr);                                                    \
        cr_assert_eq(tu_s_, TDM_STATUS_OK, "%s failed: %s: %s", #expr,                \
                     tdm_status_name(tu_s_), tdm_error_message());                    \
    } while (0)

static inline tdm_device *tu_host(void)
{
    tdm_device *d = NULL;
    TU_OK(tdm_device_open(&d, "cpu", 0, 1));
    return d;
}

static inline tdm_rng tu_rng(uint64_t seed)
{
    tdm_rng r;
    tdm_rng_init(&r, seed, TDM_RNG_STREAM_TEST);
    return r;
}

/* Uniform in [lo, hi). */
static inline float tu_unif(tdm_rng *r, float lo, float hi)
{
    return lo + (hi - lo) * tdm_rng_uniform(r);
}

static inline void tu_fill(tdm_rng *r, float *x, int64_t n, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++) x[i] = tu_unif(r, lo, hi);
}

/* |a - ref| <= atol + rtol |ref| */
static inline int tu_close(double a, double ref, double atol, double rtol)
{
    return fabs(a - ref) <= atol + rtol * fabs(ref);
}

static inline void *tu_malloc(size_t nbytes)
{
    void *p = calloc(1, nbytes ? nbytes : 1);
    cr_assert_not_null(p, "cannot allocate %zu bytes", nbytes);
    return p;
}

/* max over i of |a[i] - ref[i]| / (atol + rtol |ref[i]|): <= 1 means every
 * element is within tolerance. *at (may be NULL): where the max is;
 * *max_abs (may be NULL): the largest |a - ref|. */
static inline double tu_tol_ratio(const float *a, const float *ref, int64_t n, double atol,
                                  double rtol, int64_t *at, double *max_abs)
{
    double worst = 0.0, ma = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)ref[i]);
        double q = d / (atol + rtol * fabs((double)ref[i]));
        if (q > worst) {
            worst = q;
            if (at) *at = i;
        }
        if (d > ma) ma = d;
    }
    if (max_abs) *max_abs = ma;
    return worst;
}

/* ---- temporary directories ---- */

static inline int tu_rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

static inline void tu_mkdtemp(char *dir, size_t len, const char *tag)
{
    snprintf(dir, len, "/tmp/tdm_test_%s_XXXXXX", tag);
    cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
}

static inline void tu_rmtree(const char *dir)
{
    if (dir && dir[0]) nftw(dir, tu_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Every file of dir (a flight recorder's dumps) read into buf, one after
 * another, NUL-terminated (at most cap - 1 bytes); -1 when dir cannot be
 * opened. */
static inline long tu_read_dir(const char *dir, char *buf, size_t cap)
{
    size_t len = 0;
    DIR *d = opendir(dir);
    if (!d || cap == 0) {
        if (d) closedir(d);
        return -1;
    }
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        len += fread(buf + len, 1, cap - 1 - len, f);
        fclose(f);
    }
    closedir(d);
    buf[len] = '\0';
    return (long)len;
}

/* "<dir>/<name>" in one of 8 rotating buffers (several live at once). */
static inline const char *tu_tpath(const char *dir, const char *name)
{
    static char buf[8][256];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, 256, "%s/%s", dir, name);
    return b;
}

#endif
