/* tests/cli_util.h: running the tandem binary from a test, with its
 * output captured: $TANDEM_BIN (set by tests/run_all.sh), else
 * build/tandem. Header-only (a .c file in tests/ not named test_... is linked
 * into every test binary). */
#ifndef TDM_TESTS_CLI_UTIL_H
#define TDM_TESTS_CLI_UTIL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/shm_test_util.h"

typedef struct cli_result {
    int code;     /* exit code, or 128 + signal */
    char out[262144];
} cli_result;

static inline const char *cli_bin(void)
{
    const char *b = getenv("TANDEM_BIN");
    return b && *b ? b : "build/tandem";
}

/* Runs tandem with args (NULL-terminated), stdout+stderr captured. */
static inline void cli_run(cli_result *r, const char *const *args)
{
    int fds[2];
    cr_assert(pipe(fds) == 0);
    shm_t_adopt_orphans();   /* for cli_shm_entries() */
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        const char *argv[64];
        int n = 0;
        argv[n++] = cli_bin();
        for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
        argv[n] = NULL;
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        alarm(300); /* bounds a hung child; tests set their own, shorter .timeout */
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t k;
    while ((k = read(fds[0], r->out + len, sizeof r->out - 1 - len)) > 0) len += (size_t)k;
    r->out[len] = '\0';
    close(fds[0]);
    int ws;
    cr_assert(waitpid(pid, &ws, 0) == pid);
    r->code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

#define CLI(r, ...) cli_run((r), (const char *const[]){__VA_ARGS__, NULL})

static inline void expect(const cli_result *r, int code, const char *phrase)
{
    cr_assert_eq(r->code, code, "exit %d (expected %d); output:\n%s", r->code, code, r->out);
    if (phrase)
        cr_assert(strstr(r->out, phrase), "output lacks '%s':\n%s", phrase, r->out);
}

/* Shared-memory segments still held by this process or a descendant (a
 * rank, or a rank's child, left running; see shm_t_segments_held): the
 * segment is a memfd with no name in /dev/shm, so that is where a leak
 * shows. 0 after a run that cleaned up. */
static inline int cli_shm_entries(void) { return shm_t_segments_held(); }

/* The deterministic part of `tandem train`'s "epoch E/N: ..." line in out:
 * its train loss and, if printed, test loss and accuracy (not the
 * throughput). Fails the test when the line is missing. */
static inline void epoch_result(const char *out, const char *epoch, char *buf, size_t len)
{
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no '%s' line in:\n%s", key, out);
    p += strlen(key);
    size_t n = strcspn(p, ",\n");
    const char *t = strstr(p, "test loss");
    const char *eol = strchr(p, '\n');
    size_t m = t && (!eol || t < eol) ? strcspn(t, "\n") : 0;
    snprintf(buf, len, "%.*s | %.*s", (int)n, p, (int)m, m ? t : "");
}

/* "epoch E/N: train loss X, ..., val loss Y nats" in out -> X, Y (the
 * GPT's line). Fails the test when either is missing. */
static inline void cli_epoch_losses(const char *out, const char *epoch, double *train,
                                    double *val)
{
    char key[64];
    snprintf(key, sizeof key, "%s: train loss ", epoch);
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no '%s' line in:\n%s", key, out);
    *train = strtod(p + strlen(key), NULL);
    const char *v = strstr(p, "val loss ");
    cr_assert_not_null(v, "no val loss in:\n%s", out);
    *val = strtod(v + 9, NULL);
}

/* 1 when the two files hold the same bytes (a restarted run's checkpoint
 * against an uninterrupted one's). */
static inline int cli_same_file(const char *a, const char *b)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

/* A small text of twelve words (2400 of them, a sentence every nine) for
 * the GPT's restart tests: 4 steps an epoch at --batch 6 on 3 ranks. */
static inline void cli_write_words(const char *path)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    static const char *const words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a",
                                        "lazy", "dog", "and", "runs", "home"};
    for (int i = 0; i < 2400; i++)
        fprintf(f, "%s%s", words[(i * 7 + i / 5) % 12], i % 9 == 8 ? ".\n" : " ");
    cr_assert_eq(fclose(f), 0, "%s", path);
}

#endif
