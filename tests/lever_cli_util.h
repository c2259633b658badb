/* tests/lever_cli_util.h: the scaffolding the levers' CLI tests share
 * (test_cli_levers_pp, _tp, _pptp, test_pp_tp_seq): a temporary
 * directory per test (LV_DIR_PREFIX names it; define it before the
 * include) removed after it, with no shared memory left behind; the
 * last CLI run in g_r; checkpoint paths in that directory; an epoch
 * line's loss and grad norm. Include once, from one test file. */
#ifndef TDM_TESTS_LEVER_CLI_UTIL_H
#define TDM_TESTS_LEVER_CLI_UTIL_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"

#ifndef LV_DIR_PREFIX
#error "define LV_DIR_PREFIX (the temporary directory's prefix) before the include"
#endif

static char g_dir[64];
static cli_result g_r;

static inline void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, LV_DIR_PREFIX); }

static inline void teardown(void)
{
    tu_rmtree(g_dir);
    cr_expect_eq(cli_shm_entries(), 0, "shared memory left behind");
}

/* The last run exited 0. */
static inline void ok(const char *what)
{
    cr_assert_eq(g_r.code, 0, "%s: exit %d:\n%s", what, g_r.code, g_r.out);
}

/* g_dir/name.safetensors; four live at once. */
static inline const char *path(const char *name)
{
    static char buf[4][128];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s.safetensors", g_dir, name);
    return buf[k];
}

/* The epoch line's "train loss X" and "grad norm Y" (without the
 * throughput) into buf. */
static inline void epoch_line(const char *epoch, char *buf, size_t n)
{
    char loss[128];
    epoch_result(g_r.out, epoch, loss, sizeof loss);
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *line = strstr(g_r.out, key), *g = line ? strstr(line, "grad norm ") : NULL;
    const char *eol = line ? strchr(line, '\n') : NULL;
    cr_assert(g && (!eol || g < eol), "no grad norm on the %s line:\n%s", epoch, g_r.out);
    snprintf(buf, n, "%s | %.*s", loss, (int)strcspn(g, "("), g);
}

#endif
