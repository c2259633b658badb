/* tests/tsan/criterion/criterion.h: a stand-in for the subset of
 * Criterion's API our tests use, for ThreadSanitizer builds only.
 *
 * Criterion cannot start under TSan (its inheritable arena mmap fails:
 * Snaipe/Criterion#274), so `make tsan` compiles the same test files
 * against this header instead (-Itests/tsan comes before the system's).
 * Each test runs in a forked child, as under Criterion, with its .timeout
 * enforced by alarm(); the runner prints Criterion's "Synthesis:" line so
 * tests/run_all.sh reads both alike. Not a general replacement: only the
 * macros the suite uses exist here. */
#ifndef TDM_TSAN_CRITERION_SHIM_H
#define TDM_TSAN_CRITERION_SHIM_H

#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

struct shim_opts {
    double timeout;
    void (*init)(void);
    void (*fini)(void);
    const char *description;
    int disabled;
};

struct shim_test {
    const char *suite, *name;
    void (*fn)(void);
    const struct shim_opts *opts;
};

#define SHIM_MAX_TESTS 512
static struct shim_test shim_tests[SHIM_MAX_TESTS];
static int shim_ntests;
static jmp_buf shim_jmp;
static int shim_failed;

static inline void shim_register(const char *suite, const char *name, void (*fn)(void),
                                 const struct shim_opts *o)
{
    if (shim_ntests < SHIM_MAX_TESTS)
        shim_tests[shim_ntests++] = (struct shim_test){suite, name, fn, o};
}

struct shim_suite {
    const char *name;
    const struct shim_opts *opts;
};
static struct shim_suite shim_suites[64];
static int shim_nsuites;

#define TestSuite(suite, ...)                                                             \
    static const struct shim_opts shim_suite_##suite##_opts = {__VA_ARGS__};              \
    __attribute__((constructor)) static void shim_suite_##suite##_reg(void)               \
    {                                                                                     \
        if (shim_nsuites < 64)                                                            \
            shim_suites[shim_nsuites++] =                                                 \
                (struct shim_suite){#suite, &shim_suite_##suite##_opts};                  \
    }

#define Test(suite, name, ...)                                                            \
    static void suite##_##name##_impl(void);                                              \
    static const struct shim_opts suite##_##name##_opts = {__VA_ARGS__};                  \
    __attribute__((constructor)) static void suite##_##name##_reg(void)                   \
    {                                                                                     \
        shim_register(#suite, #name, suite##_##name##_impl, &suite##_##name##_opts);      \
    }                                                                                     \
    static void suite##_##name##_impl(void)

__attribute__((format(printf, 6, 7))) static inline void
shim_check(int ok, int fatal, const char *file, int line, const char *expr, const char *fmt, ...)
{
    if (ok) return;
    fprintf(stderr, "%s:%d: assertion failed: %s", file, line, expr);
    if (fmt && fmt[0] && fmt[1]) { /* " " alone: no message given */
        va_list ap;
        va_start(ap, fmt);
        fputc(':', stderr);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
    shim_failed = 1;
    if (fatal) longjmp(shim_jmp, 1);
}

#define SHIM_CHECK(fatal, cond, text, ...) \
    shim_check(!!(cond), (fatal), __FILE__, __LINE__, text, " " __VA_ARGS__)

#define cr_assert(cond, ...) SHIM_CHECK(1, cond, #cond, __VA_ARGS__)
#define cr_expect(cond, ...) SHIM_CHECK(0, cond, #cond, __VA_ARGS__)
#define cr_assert_fail(...) SHIM_CHECK(1, 0, "cr_assert_fail", __VA_ARGS__)
#define cr_assert_eq(a, b, ...) SHIM_CHECK(1, (a) == (b), #a " == " #b, __VA_ARGS__)
#define cr_expect_eq(a, b, ...) SHIM_CHECK(0, (a) == (b), #a " == " #b, __VA_ARGS__)
#define cr_assert_neq(a, b, ...) SHIM_CHECK(1, (a) != (b), #a " != " #b, __VA_ARGS__)
#define cr_assert_lt(a, b, ...) SHIM_CHECK(1, (a) < (b), #a " < " #b, __VA_ARGS__)
#define cr_assert_leq(a, b, ...) SHIM_CHECK(1, (a) <= (b), #a " <= " #b, __VA_ARGS__)
#define cr_assert_gt(a, b, ...) SHIM_CHECK(1, (a) > (b), #a " > " #b, __VA_ARGS__)
#define cr_assert_geq(a, b, ...) SHIM_CHECK(1, (a) >= (b), #a " >= " #b, __VA_ARGS__)
#define cr_assert_null(p, ...) SHIM_CHECK(1, (p) == NULL, #p " == NULL", __VA_ARGS__)
#define cr_expect_null(p, ...) SHIM_CHECK(0, (p) == NULL, #p " == NULL", __VA_ARGS__)
#define cr_assert_not_null(p, ...) SHIM_CHECK(1, (p) != NULL, #p " != NULL", __VA_ARGS__)
#define cr_assert_str_eq(a, b, ...) SHIM_CHECK(1, !strcmp((a), (b)), #a " == " #b, __VA_ARGS__)
#define cr_expect_str_eq(a, b, ...) SHIM_CHECK(0, !strcmp((a), (b)), #a " == " #b, __VA_ARGS__)
#define cr_assert_float_eq(a, b, eps, ...) \
    SHIM_CHECK(1, fabs((double)(a) - (double)(b)) <= (eps), #a " ~= " #b, __VA_ARGS__)
#define cr_skip_test(...)                                                       \
    do {                                                                        \
        fprintf(stderr, "skipped: " __VA_ARGS__);                               \
        fputc('\n', stderr);                                                    \
        _exit(77);                                                              \
    } while (0)
#define cr_log_info(...) (fprintf(stderr, __VA_ARGS__), fputc('\n', stderr))

/* A test's own options, completed by its suite's (as Criterion merges them). */
static struct shim_opts shim_effective(const struct shim_test *t)
{
    struct shim_opts o = *t->opts;
    for (int i = 0; i < shim_nsuites; i++)
        if (!strcmp(shim_suites[i].name, t->suite)) {
            const struct shim_opts *so = shim_suites[i].opts;
            if (o.timeout <= 0) o.timeout = so->timeout;
            if (!o.init) o.init = so->init;
            if (!o.fini) o.fini = so->fini;
            o.disabled |= so->disabled;
        }
    return o;
}

static int shim_run_one(const struct shim_test *t)
{
    struct shim_opts o = shim_effective(t);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        /* sanitizers slow the code down; TANDEM_TEST_TIMEOUT_SCALE stretches .timeout */
        const char *sc = getenv("TANDEM_TEST_TIMEOUT_SCALE");
        double scale = sc && atof(sc) > 0 ? atof(sc) : 1.0;
        if (o.timeout > 0) alarm((unsigned)ceil(o.timeout * scale));
        if (o.init) o.init();
        if (setjmp(shim_jmp) == 0) t->fn();
        if (o.fini) o.fini();
        fflush(NULL);
        _exit(shim_failed ? 1 : 0);
    }
    int ws;
    while (waitpid(pid, &ws, 0) < 0) {}
    if (WIFEXITED(ws) && WEXITSTATUS(ws) == 77) return 77;
    if (WIFEXITED(ws)) return WEXITSTATUS(ws) ? 1 : 0;
    fprintf(stderr, "[FAIL] %s::%s: crashed with signal %d%s\n", t->suite, t->name,
            WTERMSIG(ws), WTERMSIG(ws) == SIGALRM ? " (timeout)" : "");
    return 2;
}

/* --filter=SUITE/NAME with a trailing * allowed; returns non-zero to skip. */
static int fnmatch_like(const char *pat, const char *s)
{
    size_t n = strlen(pat);
    if (n && pat[n - 1] == '*') return strncmp(pat, s, n - 1) != 0;
    return strcmp(pat, s) != 0;
}

int main(int argc, char **argv)
{
    const char *filter = NULL;
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--filter=", 9)) filter = argv[i] + 9;
    int tested = 0, passed = 0, failed = 0, crashed = 0;
    for (int i = 0; i < shim_ntests; i++) {
        const struct shim_test *t = &shim_tests[i];
        char full[256];
        snprintf(full, sizeof full, "%s/%s", t->suite, t->name);
        if (t->opts->disabled || (filter && fnmatch_like(filter, full))) continue;
        int rc = shim_run_one(t);
        if (rc == 77) {
            fprintf(stderr, "[SKIP] %s::%s\n", t->suite, t->name);
            continue;
        }
        tested++;
        if (rc == 0) passed++;
        else if (rc == 2) crashed++;
        else {
            failed++;
            fprintf(stderr, "[FAIL] %s::%s\n", t->suite, t->name);
        }
    }
    printf("[====] Synthesis: Tested: %d | Passing: %d | Failing: %d | Crashing: %d \n", tested,
           passed, failed, crashed);
    return failed || crashed;
}

#endif
