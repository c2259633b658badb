/* tests/test_core.c: the ground floor of core/: status messages and their
 * prefixes, TANDEM_DEBUG logging (levels, subsystems, file), the Philox
 * RNG (deterministic streams that depend only on (seed, stream), never on
 * who else draws), device specs, and the phase names the tools print. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/device.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/status.h"
#include "core/timer.h"

Test(core_status, messages_prefixes_and_names)
{
    tdm_error_clear();
    cr_assert_str_eq(tdm_error_message(), "");
    cr_assert_eq(tdm_error_set(TDM_STATUS_IO, "%s: %s", "a.bin", "No such file"), TDM_STATUS_IO);
    cr_assert_str_eq(tdm_error_message(), "a.bin: No such file");
    tdm_error_prefix(TDM_STATUS_IO, "replica %d on device %s", 1, "cpu:1");
    cr_assert_str_eq(tdm_error_message(), "replica 1 on device cpu:1: a.bin: No such file");
    tdm_error_clear();
    tdm_error_prefix(TDM_STATUS_TIMEOUT, "rank 2");
    cr_assert_str_eq(tdm_error_message(), "rank 2: timeout");
    for (int s = 0; s < TDM_STATUS_COUNT_; s++)
        cr_assert(strcmp(tdm_status_name((tdm_status)s), "unknown status"), "status %d", s);
    cr_assert_str_eq(tdm_status_name((tdm_status)999), "unknown status");
    /* long messages are cut, not overflowed */
    char big[4000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    tdm_error_set(TDM_STATUS_FORMAT, "%s", big);
    cr_assert_lt(strlen(tdm_error_message()), sizeof big - 1);
}

static void *other_thread(void *arg)
{
    (void)arg;
    tdm_error_set(TDM_STATUS_INTERNAL, "from the other thread");
    return NULL;
}

Test(core_status, messages_are_per_thread)
{
    tdm_error_set(TDM_STATUS_IO, "mine");
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, other_thread, NULL), 0);
    pthread_join(t, NULL);
    cr_assert_str_eq(tdm_error_message(), "mine");
}

static char *log_capture(const char *level, const char *subsys)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/tandem-log-%d.txt", (int)getpid());
    unlink(path);
    setenv("TANDEM_DEBUG", level, 1);
    if (subsys) setenv("TANDEM_DEBUG_SUBSYS", subsys, 1);
    else unsetenv("TANDEM_DEBUG_SUBSYS");
    setenv("TANDEM_DEBUG_FILE", path, 1);
    tdm_log_reset();
    TDM_WARN(SHM, "warn-shm");
    TDM_INFO(SHM, "info-shm");
    TDM_TRACE(SHM, "trace-shm");
    TDM_INFO(DP, "info-dp");
    TDM_INFO(FSDP, "info-fsdp");
    tdm_log_reset(); /* closes the file */
    static char buf[4096];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    buf[n] = '\0';
    if (f) fclose(f);
    unlink(path);
    return buf;
}

Test(core_log, levels_subsystems_and_file)
{
    char *out = log_capture("WARN", NULL);
    cr_assert(strstr(out, "SHM WARN: warn-shm") && !strstr(out, "info-shm"), "%s", out);
    out = log_capture("INFO", NULL);
    cr_assert(strstr(out, "info-shm") && strstr(out, "info-dp") && !strstr(out, "trace-shm"),
              "%s", out);
    out = log_capture("TRACE", "SHM");
    cr_assert(strstr(out, "trace-shm") && !strstr(out, "info-dp"), "%s", out);
    out = log_capture("INFO", "^SHM");
    cr_assert(!strstr(out, "shm") && strstr(out, "info-dp"), "%s", out);
    /* the sharded modes log under their own name, not DDP's */
    out = log_capture("INFO", "DDP");
    cr_assert(!strstr(out, "info-fsdp"), "%s", out);
    out = log_capture("INFO", "FSDP");
    cr_assert(strstr(out, "FSDP INFO: info-fsdp") && !strstr(out, "info-dp"), "%s", out);
    out = log_capture("NONE", NULL);
    cr_assert_str_eq(out, "");
    tdm_log_set_rank(3);
    out = log_capture("WARN", NULL);
    cr_assert(strstr(out, "[rank 3] SHM WARN"), "%s", out);
    tdm_log_set_rank(-1);
}

Test(core_rng, streams_are_deterministic_and_independent)
{
    tdm_rng a, b, c;
    tdm_rng_init(&a, 42, 7);
    tdm_rng_init(&b, 42, 7);
    tdm_rng_init(&c, 42, 8);
    int same_c = 0;
    for (int i = 0; i < 1000; i++) {
        uint32_t x = tdm_rng_u32(&a), y = tdm_rng_u32(&b), z = tdm_rng_u32(&c);
        cr_assert_eq(x, y, "draw %d", i);
        same_c += x == z;
    }
    cr_assert_lt(same_c, 3, "streams 7 and 8 agree on %d of 1000 draws", same_c);
    tdm_rng_init(&a, 42, 7);
    tdm_rng_init(&b, 43, 7);
    cr_assert_neq(tdm_rng_u64(&a), tdm_rng_u64(&b));
}

/* A stream's values do not depend on other streams being drawn from, in
 * any interleaving or on any thread: the property DP/DDP equivalence needs. */
typedef struct draw_arg { uint64_t stream; float out[256]; } draw_arg;
static void *draw_thread(void *p)
{
    draw_arg *a = p;
    tdm_rng r;
    tdm_rng_init(&r, 5, a->stream);
    for (int i = 0; i < 256; i++) a->out[i] = tdm_rng_normal(&r);
    return NULL;
}

Test(core_rng, independent_of_threads_and_interleaving)
{
    draw_arg ref[4], thr[4];
    for (int s = 0; s < 4; s++) {
        ref[s].stream = thr[s].stream = TDM_RNG_STREAM_INIT + (uint64_t)s;
        draw_thread(&ref[s]);
    }
    pthread_t t[4];
    for (int s = 0; s < 4; s++) cr_assert_eq(pthread_create(&t[s], NULL, draw_thread, &thr[s]), 0);
    for (int s = 0; s < 4; s++) pthread_join(t[s], NULL);
    for (int s = 0; s < 4; s++)
        cr_assert(!memcmp(ref[s].out, thr[s].out, sizeof ref[s].out), "stream %d", s);
}

Test(core_rng, distributions)
{
    tdm_rng r;
    tdm_rng_init(&r, 1, TDM_RNG_STREAM_TEST);
    double s = 0, q = 0, su = 0;
    const int n = 200000;
    for (int i = 0; i < n; i++) {
        float u = tdm_rng_uniform(&r);
        cr_assert(u >= 0.0f && u < 1.0f);
        su += u;
        double g = tdm_rng_normal(&r);
        cr_assert(isfinite(g));
        s += g;
        q += g * g;
    }
    cr_assert_float_eq(su / n, 0.5, 0.01);
    cr_assert_float_eq(s / n, 0.0, 0.01);
    cr_assert_float_eq(q / n, 1.0, 0.02);
    int counts[7] = {0};
    for (int i = 0; i < 70000; i++) {
        uint64_t v = tdm_rng_below(&r, 7);
        cr_assert_lt(v, 7);
        counts[v]++;
    }
    for (int k = 0; k < 7; k++) cr_assert(counts[k] > 9400 && counts[k] < 10600, "%d", counts[k]);
    int64_t perm[1000];
    int seen[1000] = {0};
    tdm_rng_permutation(&r, perm, 1000);
    int moved = 0;
    for (int i = 0; i < 1000; i++) {
        cr_assert(perm[i] >= 0 && perm[i] < 1000);
        cr_assert_eq(seen[perm[i]]++, 0, "%lld twice", (long long)perm[i]);
        moved += perm[i] != i;
    }
    cr_assert_gt(moved, 900);
}

Test(core_device, spec_parsing)
{
    tdm_device_list l;
    cr_assert_eq(tdm_device_list_parse(&l, "cpu"), TDM_STATUS_OK);
    cr_assert(l.kind == TDM_DEVICE_HOST && l.count == 1 && l.index[0] == 0);
    cr_assert_eq(tdm_device_list_parse(&l, "cpu:4"), TDM_STATUS_OK);
    cr_assert(l.count == 4 && l.index[3] == 3);
    cr_assert_eq(tdm_device_list_parse(&l, "cpu:0,2"), TDM_STATUS_OK);
    cr_assert(l.count == 2 && l.index[1] == 2);
    static const char *bad[] = {"", "cpu:", "cpu:0,", "cpu:x", "cpu:1,1", "cpu:0", "gpu:1",
                                "cpu:2x", "cpu:65", "cpu;2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tdm_error_clear();
        cr_assert_eq(tdm_device_list_parse(&l, bad[i]), TDM_STATUS_INVALID_ARG, "'%s'", bad[i]);
        cr_assert_neq(tdm_error_message()[0], '\0', "no message for '%s'", bad[i]);
    }
    cr_assert_gt(tdm_device_host_cores(), 0);
    tdm_device *d;
    cr_assert_eq(tdm_device_open(&d, "tpu", 0, 1), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_device_open(&d, "cpu", -1, 1), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_device_open(&d, "cpu", 3, 1), TDM_STATUS_OK);
    cr_assert_str_eq(tdm_dev_name(d), "cpu:3");
    tdm_device_free(d);
    tdm_device_free(NULL);
}

Test(core_timer, clock_and_phase_names)
{
    uint64_t a = tdm_time_ns();
    usleep(2000);
    double ms = tdm_time_ms_since(a);
    cr_assert(ms >= 1.9 && ms < 1000.0, "%f", ms);
    for (int p = 0; p < TDM_PHASE_COUNT_; p++)
        cr_assert_neq(tdm_phase_name((tdm_phase)p)[0], '?');
    cr_assert_str_eq(tdm_phase_name(TDM_PHASE_COUNT_), "?");
}
