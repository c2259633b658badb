/* tests/test_input_paths.c: every path tandem takes (files it reads or
 * writes, directories it writes into or reads dumps from, and the
 * directory named by TANDEM_FR_DUMP), given a FIFO, a character device
 * (/dev/null), a directory where a file is expected (a regular file where
 * a directory is), or a symbolic link to any of them: the command ends at
 * once with exit 1 or 2 and a line that names the path and what it is;
 * never a hang in open(), never a run that goes ahead. Before: `train
 * --model gpt --data FIFO` (single and ddp) and `compare --model gpt --data
 * FIFO` blocked in open() forever, `--save`, `--trace` and `--csv` through
 * a link to a FIFO, a device or a directory replaced the link and exited
 * 0, and the image `--data`, `doctor DIR`, `--plot` and `--log-dir` named
 * the wrong thing ("No such file", "Not a directory"). Also --save through
 * a link of ours to a regular file: that file is written, the link kept. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "inpaths"); }
static void teardown(void) { tu_rmtree(g_dir); }

TestSuite(inpaths, .init = setup, .fini = teardown, .timeout = 600);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

/* A hang shows as SIGALRM (exit 128 + 14): far more than any refusal takes. */
#define PATH_RUN_BOUND_S 30

/* Runs tandem with args (a NULL-terminated list; "@" stands for path) and
 * NAME=path in its environment when env is set; bounded by an alarm. */
static void run_with(cli_result *r, const char *const *args, const char *env, const char *path)
{
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        const char *argv[40];
        int n = 0;
        argv[n++] = cli_bin();
        for (int i = 0; args[i] && n < 39; i++) argv[n++] = strcmp(args[i], "@") ? args[i] : path;
        argv[n] = NULL;
        if (env) setenv(env, path, 1);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) dup2(devnull, 0);
        alarm((unsigned)(PATH_RUN_BOUND_S * tu_timeout_scale()));
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

/* What a flag expects at its path. */
typedef enum { WANT_FILE, WANT_DIR, WANT_FILE_OR_DIR } want;

/* A bad thing to give it: a FIFO, /dev/null, a directory or a regular
 * file (whichever the flag does not take), directly or through a link. */
typedef struct bad_kind {
    const char *name;      /* in the test directory */
    const char *phrase;    /* what the message must call it */
} bad_kind;

/* Makes the bad things afresh (a run that wrongly replaced one must not
 * hide the next case) and returns how many there are for w. */
static int make_kinds(want w, bad_kind *k)
{
    static const char *const names[] = {"fifo", "dir", "file", "l_fifo", "l_dev", "l_dir",
                                        "l_file"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) tu_rmtree(tpath(names[i]));
    cr_assert_eq(mkfifo(tpath("fifo"), 0600), 0);
    cr_assert_eq(mkdir(tpath("dir"), 0755), 0);
    FILE *f = fopen(tpath("file"), "w");
    cr_assert_not_null(f);
    fputs("some bytes\n", f);
    fclose(f);
    cr_assert_eq(symlink(tpath("fifo"), tpath("l_fifo")), 0);
    cr_assert_eq(symlink("/dev/null", tpath("l_dev")), 0);
    cr_assert_eq(symlink(tpath("dir"), tpath("l_dir")), 0);
    cr_assert_eq(symlink(tpath("file"), tpath("l_file")), 0);
    int n = 0;
    k[n++] = (bad_kind){"fifo", "FIFO"};
    k[n++] = (bad_kind){"/dev/null", "character device"};
    k[n++] = (bad_kind){"l_fifo", "FIFO"};
    k[n++] = (bad_kind){"l_dev", "character device"};
    if (w == WANT_FILE) {
        k[n++] = (bad_kind){"dir", "directory"};
        k[n++] = (bad_kind){"l_dir", "directory"};
    } else if (w == WANT_DIR) {
        k[n++] = (bad_kind){"file", "regular file"};
        k[n++] = (bad_kind){"l_file", "regular file"};
    }
    return n;
}

typedef struct path_case {
    const char *label;
    want w;
    const char *env;           /* the path goes in this variable, else "@" in args */
    const char *args[24];
} path_case;

#define IMG "--data", "synthetic", "--synthetic-size", "200", "--model", "mlp:784-16-10", \
            "--epochs", "1", "--quiet"
#define GPT "--model", "gpt:1-16-2-16", "--epochs", "1", "--max-steps", "1", "--no-eval"

static const path_case cases[] = {
    {"train gpt --data", WANT_FILE_OR_DIR, NULL, {"train", GPT, "--data", "@"}},
    {"train gpt ddp --data", WANT_FILE_OR_DIR, NULL,
     {"train", GPT, "--mode", "ddp", "--device", "cpu:2", "--data", "@"}},
    {"compare gpt --data", WANT_FILE_OR_DIR, NULL,
     {"compare", "--model", "gpt:1-16-2-16", "--steps", "2", "--device", "cpu:2", "--data",
      "@"}},
    {"train --data DIR", WANT_DIR, NULL,
     {"train", "--model", "mlp:784-16-10", "--epochs", "1", "--data", "@"}},
    {"train --resume", WANT_FILE, NULL, {"train", IMG, "--resume", "@"}},
    {"train ddp --resume", WANT_FILE, NULL,
     {"train", IMG, "--mode", "ddp", "--device", "cpu:2", "--resume", "@"}},
    {"train --save", WANT_FILE, NULL, {"train", IMG, "--save", "@"}},
    {"train fsdp --save", WANT_FILE, NULL,
     {"train", IMG, "--mode", "fsdp", "--device", "cpu:2", "--save", "@"}},
    {"sample --resume", WANT_FILE, NULL, {"sample", "--resume", "@"}},
    {"compare --trace", WANT_FILE, NULL,
     {"compare", "--data", "synthetic", "--model", "mlp:784-16-10", "--steps", "2", "--trace",
      "@"}},
    {"compare --csv", WANT_FILE, NULL,
     {"compare", "--data", "synthetic", "--model", "mlp:784-16-10", "--steps", "2", "--csv",
      "@"}},
    {"compare --plot", WANT_DIR, NULL,
     {"compare", "--data", "synthetic", "--model", "mlp:784-16-10", "--steps", "2", "--plot",
      "@"}},
    {"launch --log-dir", WANT_DIR, NULL, {"launch", "-n", "1", "--log-dir", "@", "--", "true"}},
    {"doctor DIR", WANT_DIR, NULL, {"doctor", "@"}},
    {"selftest --junit", WANT_FILE, NULL, {"selftest", "--quick", "--junit", "@"}},
    {"selftest --baseline", WANT_FILE, NULL, {"selftest", "--quick", "--baseline", "@"}},
    {"selftest --save-baseline", WANT_FILE, NULL,
     {"selftest", "--quick", "--save-baseline", "@"}},
    {"TANDEM_FR_DUMP", WANT_DIR, "TANDEM_FR_DUMP", {"train", IMG}},
};

Test(inpaths, every_flag_refuses_every_special_file_at_once)
{
    static cli_result r;
    bad_kind k[8];
    char failures[8192] = "";
    size_t fl = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int nk = make_kinds(cases[c].w, k);
        for (int i = 0; i < nk; i++) {
            const char *path = k[i].name[0] == '/' ? k[i].name : tpath(k[i].name);
            run_with(&r, cases[c].args, cases[c].env, path);
            /* the path and what it is, on one line */
            int named = 0;
            for (const char *line = r.out; line && *line;) {
                const char *eol = strchr(line, '\n');
                size_t n = eol ? (size_t)(eol - line) : strlen(line);
                char buf[2048];
                snprintf(buf, sizeof buf, "%.*s", (int)(n < sizeof buf ? n : sizeof buf - 1),
                         line);
                if (strstr(buf, path) && strstr(buf, k[i].phrase)) named = 1;
                line = eol ? eol + 1 : NULL;
            }
            struct stat sb;
            int link_kept = k[i].name[0] != 'l' || (lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode));
            if ((r.code == 1 || r.code == 2) && named && link_kept) continue;
            int w = snprintf(failures + fl, sizeof failures - fl,
                             "%s %s: exit %d%s%s%s; output:\n%.600s\n---\n", cases[c].label,
                             k[i].name, r.code, named ? "" : ", no line naming it as a ",
                             named ? "" : k[i].phrase, link_kept ? "" : ", the link replaced",
                             r.out);
            if (w > 0 && (size_t)w < sizeof failures - fl) fl += (size_t)w;
            else fl = sizeof failures - 1;
        }
    }
    cr_assert_eq(fl, 0, "%s", failures);
}

/* `--save LINK`: judged by what the link points to. A link of ours to a
 * regular file: that file is replaced with the checkpoint and the link
 * stays a link; to /dev/null: refused before training, the link kept.
 * Before: both links were replaced by a regular file (exit 0). */
Test(inpaths, save_through_a_link_writes_its_file_and_keeps_the_link)
{
    static cli_result r;
    FILE *f = fopen(tpath("real.safetensors"), "w");
    cr_assert_not_null(f);
    fputs("old\n", f);
    fclose(f);
    cr_assert_eq(symlink("real.safetensors", tpath("ck")), 0);
    CLI(&r, "train", IMG, "--save", tpath("ck"));
    expect(&r, 0, NULL);
    struct stat sb;
    cr_assert_eq(lstat(tpath("ck"), &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode), "the link was replaced");
    cr_assert_eq(lstat(tpath("real.safetensors"), &sb), 0);
    cr_assert(S_ISREG(sb.st_mode) && sb.st_size > 1000, "the file the link names holds %lld "
              "bytes", (long long)sb.st_size);
    /* and it resumes through the link */
    CLI(&r, "train", IMG, "--epochs", "2", "--resume", tpath("ck"));
    expect(&r, 0, "resumed");

    cr_assert_eq(symlink("/dev/null", tpath("nul")), 0);
    CLI(&r, "train", IMG, "--save", tpath("nul"));
    expect(&r, 2, "is a symbolic link to a character device");
    cr_assert_eq(lstat(tpath("nul"), &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode), "the link to /dev/null was replaced");
    /* a dangling link: nothing to judge it by */
    cr_assert_eq(symlink(tpath("nothing-here"), tpath("dangling")), 0);
    CLI(&r, "train", IMG, "--save", tpath("dangling"));
    expect(&r, 2, "does not exist");
    cr_assert_eq(lstat(tpath("nothing-here"), &sb), -1, "the dangling link was written through");
}

/* As root, `--save /dev/stdin` replaced the system's /dev/stdin link.
 * The same link (to /proc/self/fd/0), made in the test's directory so that
 * a regression cannot break the machine: with stdin a pipe it leads to a
 * FIFO and is refused before training, the link kept. */
Test(inpaths, save_to_a_stdin_link_never_replaces_the_link)
{
    struct stat before, after;
    cr_assert_eq(symlink("/proc/self/fd/0", tpath("stdin")), 0);
    cr_assert_eq(lstat(tpath("stdin"), &before), 0);
    int p[2];
    cr_assert_eq(pipe(p), 0);
    static cli_result r;
    int saved = dup(0);
    dup2(p[0], 0);
    CLI(&r, "train", IMG, "--save", tpath("stdin"));
    dup2(saved, 0);
    close(saved);
    close(p[0]);
    close(p[1]);
    expect(&r, 2, "stdin: is a symbolic link to a FIFO");
    cr_assert_eq(lstat(tpath("stdin"), &after), 0);
    cr_assert(S_ISLNK(after.st_mode) && after.st_ino == before.st_ino, "the link was replaced");
}
