/* tests/test_doc_examples.c: every tandem command README.md and the pages
 * of docs/ show runs as shown and does what it says. The commands are taken from
 * the docs' code blocks (``` fences and 4-space indents): a line whose
 * command is `build/tandem SUB` or `tandem SUB` (after NAME=VALUE
 * variables or an mpirun/nice/srun prefix), a trailing `# comment` cut,
 * `\` continuations joined. docs/examples.list says how each is run
 * (its header has the shortening rule); this test fails when a
 * documented command is not in the list, when a listed one is no longer
 * documented, and when a run exits non-zero or lacks its phrase. The runs
 * go in the docs' order in one temporary directory (a --save before its
 * --resume), with the MPI root variables set for mpirun. */
#include <criterion/criterion.h>
#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/cli_util.h"

#define DX_MAX 256
#define DX_LEN 2048

typedef struct dx_cmd {
    char text[DX_LEN];
    char file[64];
} dx_cmd;

static int dx_sub_known(const char *w, size_t n)
{
    static const char *const subs[] = {"train", "sample", "eval", "plan", "compare", "launch", "bench",
                                       "doctor", "selftest", "info", "--help", "--version"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++)
        if (strlen(subs[i]) == n && !strncmp(w, subs[i], n)) return 1;
    return 0;
}

/* Where the tandem command starts in s (after the prefix), or NULL. */
static const char *dx_find(const char *s)
{
    for (const char *p = s; *p; p++) {
        if (p != s && !isspace((unsigned char)p[-1])) continue;
        const char *t = !strncmp(p, "build/tandem ", 13) ? p + 13
                        : !strncmp(p, "tandem ", 7)     ? p + 7 : NULL;
        if (!t) continue;
        size_t n = strcspn(t, " ");
        if (!dx_sub_known(t, n)) return NULL;
        /* README's command summary ("tandem train     train a model...") */
        if (t == p + 7 && !strncmp(t + n, "  ", 2)) return NULL;
        /* the prefix: NAME=VALUE words, then nothing or a launcher */
        const char *q = s;
        while (q < p) {
            size_t w = strcspn(q, " ");
            const char *eq = memchr(q, '=', w);
            int env = eq && eq > q;
            for (const char *c = q; env && c < eq; c++)
                env = isupper((unsigned char)*c) || *c == '_';
            if (!env) break;
            q += w;
            while (*q == ' ') q++;
        }
        if (q < p && strncmp(q, "mpirun", 6) && strncmp(q, "nice", 4) && strncmp(q, "srun", 4) &&
            strncmp(q, "sudo", 4))
            return NULL;
        return p;
    }
    return NULL;
}

static void dx_trim(char *s)
{
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = 0;
    size_t k = strspn(s, " \t");
    memmove(s, s + k, strlen(s + k) + 1);
}

static int dx_extract_file(const char *path, const char *name, dx_cmd *out, int n)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    char *line = NULL, s[DX_LEN];
    size_t cap = 0;
    int block = 0;
    while (getline(&line, &cap, f) >= 0) {
        line[strcspn(line, "\n")] = 0;
        int indented = !strncmp(line, "    ", 4);
        snprintf(s, sizeof s, "%s", line);
        dx_trim(s);
        if (!strncmp(s, "```", 3)) { block = !block; continue; }
        if (!block && !indented) continue;
        while (strlen(s) && s[strlen(s) - 1] == '\\' && getline(&line, &cap, f) >= 0) {
            s[strlen(s) - 1] = 0;
            line[strcspn(line, "\n")] = 0;
            dx_trim(s);
            dx_trim(line);
            strncat(s, " ", sizeof s - strlen(s) - 1);
            strncat(s, line, sizeof s - strlen(s) - 1);
        }
        const char *c = s;
        if (!strncmp(c, "$ ", 2)) c += 2;
        if (!dx_find(c)) continue;
        char cmd[DX_LEN];
        snprintf(cmd, sizeof cmd, "%s", c);
        char *hash = strstr(cmd, " #");
        if (hash) *hash = 0;
        dx_trim(cmd);
        int dup = 0;
        for (int i = 0; i < n; i++) dup |= !strcmp(out[i].text, cmd);
        if (dup) continue;
        cr_assert_lt(n, DX_MAX);
        snprintf(out[n].text, sizeof out[n].text, "%s", cmd);
        snprintf(out[n].file, sizeof out[n].file, "%s", name);
        n++;
    }
    free(line);
    fclose(f);
    return n;
}

static int dx_cmp_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int dx_extract(dx_cmd *out)
{
    int n = dx_extract_file("README.md", "README.md", out, 0);
    DIR *d = opendir("docs");
    cr_assert_not_null(d);
    char *names[128];
    int k = 0;
    struct dirent *e;
    while ((e = readdir(d)) && k < 128) {
        size_t l = strlen(e->d_name);
        if (l > 3 && !strcmp(e->d_name + l - 3, ".md")) names[k++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)k, sizeof *names, dx_cmp_name);
    for (int i = 0; i < k; i++) {
        char path[300], name[64];
        snprintf(path, sizeof path, "docs/%s", names[i]);
        snprintf(name, sizeof name, "docs/%s", names[i]);
        n = dx_extract_file(path, name, out, n);
        free(names[i]);
    }
    return n;
}

typedef struct dx_rule {
    char rule[256], text[DX_LEN], phrase[256];
    int used;
} dx_rule;

static int dx_rules(dx_rule *r)
{
    FILE *f = fopen("docs/examples.list", "r");
    cr_assert_not_null(f, "docs/examples.list is missing");
    char line[DX_LEN * 2];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!line[0] || line[0] == '#') continue;
        char *tab = strchr(line, '\t');
        cr_assert_not_null(tab, "docs/examples.list: no tab in '%s'", line);
        *tab = 0;
        char *text = tab + 1, *tab2 = strchr(text, '\t');
        if (tab2) *tab2 = 0;
        cr_assert_lt(n, DX_MAX);
        snprintf(r[n].rule, sizeof r[n].rule, "%.255s", line);
        snprintf(r[n].text, sizeof r[n].text, "%s", text);
        snprintf(r[n].phrase, sizeof r[n].phrase, "%.255s", tab2 ? tab2 + 1 : "");
        cr_assert(!strcmp(line, "short") || !strcmp(line, "asis") || !strncmp(line, "skip:", 5),
                  "docs/examples.list: rule '%s' (short, asis or skip:WHY)", line);
        n++;
    }
    fclose(f);
    return n;
}

/* The shortening rule of `short`, by subcommand (docs/examples.list). */
static const char *dx_short(const char *cmd)
{
    const char *t = dx_find(cmd);
    t += !strncmp(t, "build/", 6) ? 13 : 7;
    if (!strncmp(t, "train ", 6)) return " --max-steps 2 --no-eval";
    if (!strncmp(t, "compare", 7)) return " --steps 4 --warmup 1";
    if (!strncmp(t, "sample ", 7)) return " --tokens 16";
    if (!strncmp(t, "bench train", 11)) return " --steps 5";   /* its least */
    if (!strncmp(t, "bench gemm", 10) || !strncmp(t, "bench dp", 8)) return "";
    if (!strncmp(t, "bench ", 6)) return " -e 64K -w 1 -i 2";
    return "";
}

/* cmd with build/tandem (or a bare tandem), build/examples/ and
 * file:examples/ (model files) made absolute. */
static void dx_resolve(const char *cmd, const char *root, char *out, size_t len)
{
    const char *at = dx_find(cmd);
    size_t o = 0;
    for (const char *p = cmd; *p && o + 1 < len;) {
        if (p == at) {
            int build = !strncmp(p, "build/", 6);
            o += (size_t)snprintf(out + o, len - o, "%s/build/tandem", root);
            p += build ? 12 : 6;
        } else if (!strncmp(p, "build/examples/", 15) && (p == cmd || p[-1] == ' ')) {
            o += (size_t)snprintf(out + o, len - o, "%s/build/examples/", root);
            p += 15;
        } else if (!strncmp(p, "file:examples/", 14) && p > cmd && p[-1] == ' ') {
            /* a model file of examples/models/, run from the temporary directory */
            o += (size_t)snprintf(out + o, len - o, "file:%s/examples/", root);
            p += 14;
        } else {
            out[o++] = *p++;
        }
    }
    out[o < len ? o : len - 1] = 0;
}

/* Each documented command has its line in docs/examples.list, and each
 * line there is still documented. */
Test(doc_examples, every_documented_command_is_listed)
{
    static dx_cmd cmds[DX_MAX];
    static dx_rule rules[DX_MAX];
    int n = dx_extract(cmds), nr = dx_rules(rules);
    cr_assert_gt(n, 20, "only %d commands found in the docs", n);
    int missing = 0;
    for (int i = 0; i < n; i++) {
        int found = 0;
        for (int k = 0; k < nr; k++)
            if (!strcmp(rules[k].text, cmds[i].text)) { rules[k].used = 1; found = 1; }
        if (!found) {
            cr_log_error("%s shows a command docs/examples.list does not have: %s", cmds[i].file,
                         cmds[i].text);
            missing++;
        }
    }
    cr_expect_eq(missing, 0, "%d documented commands are not in docs/examples.list", missing);
    for (int k = 0; k < nr; k++)
        cr_expect(rules[k].used, "docs/examples.list has a command no doc shows: %s",
                  rules[k].text);
}

Test(doc_examples, every_listed_command_runs_and_does_what_it_says, .timeout = 2400)
{
    static dx_cmd cmds[DX_MAX];
    static dx_rule rules[DX_MAX];
    int n = dx_extract(cmds), nr = dx_rules(rules);
    char root[4096], dir[] = "/tmp/tdm_docex_XXXXXX";
    cr_assert_not_null(getcwd(root, sizeof root));
    cr_assert_not_null(mkdtemp(dir));
    int ran = 0, failed = 0;
    for (int i = 0; i < n; i++) {
        const dx_rule *r = NULL;
        for (int k = 0; k < nr; k++)
            if (!strcmp(rules[k].text, cmds[i].text)) r = &rules[k];
        if (!r || !strncmp(r->rule, "skip:", 5)) continue;
        char resolved[DX_LEN * 2], sh[DX_LEN * 3];
        dx_resolve(cmds[i].text, root, resolved, sizeof resolved);
        snprintf(sh, sizeof sh,
                 "cd '%s' && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 && "
                 "exec 2>&1 && %s%s", dir, resolved,
                 !strcmp(r->rule, "short") ? dx_short(cmds[i].text) : "");
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        FILE *p = popen(sh, "r");
        cr_assert_not_null(p);
        static char out[1 << 20];
        size_t len = fread(out, 1, sizeof out - 1, p);
        out[len] = 0;
        while (fread(sh, 1, sizeof sh, p) > 0) {}   /* the rest, unread */
        int ws = pclose(p);
        int code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
        int ok = code == 0 && (!r->phrase[0] || strstr(out, r->phrase));
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ran++;
        fprintf(stderr, "doc example %s: %s (%s): exit %d, %.1f s\n", ok ? "ok" : "FAILED",
                cmds[i].text, r->rule, code,
                (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
        if (!ok) {
            failed++;
            cr_log_error("%s: `%s` (%s%s) exited %d%s%s:\n%.4000s", cmds[i].file, cmds[i].text,
                         r->rule, !strcmp(r->rule, "short") ? dx_short(cmds[i].text) : "", code,
                         r->phrase[0] ? ", expected " : "", r->phrase, out);
        }
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_expect_eq(failed, 0, "%d of %d documented commands failed", failed, ran);
    cr_expect(!cli_shm_entries());
}
