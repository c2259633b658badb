/* tests/test_doctor_hostile.c: `tandem doctor` on damaged and hostile
 * dumps. The corpus in tests/doctor_corpus/ (one directory per case:
 * truncated files, non-objects, negative, huge and overflowing numbers,
 * missing and extra ranks, RPC calls to ranks out of any job, long and
 * escape-laden strings, a hostile launch.json) and files made here (a 3 GB sparse file, a 2 MB label,
 * seqs spread up to 2^53): each must give one clear verdict or error,
 * never a signal or a hang, and nothing a terminal would act on. The
 * doctor also runs inside tandem train's and tandem launch's failure
 * summary, so each of these would be a crash or a hang of a training job.
 * `make asan` runs this under AddressSanitizer too. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cli_util.h"
#include "tests/timeout_util.h"

/* tests/doctor_corpus, found from the working directory (make test runs
 * from the source tree) or beside this file. */
static const char *hd_corpus(void)
{
    static char path[1024];
    if (access("tests/doctor_corpus", F_OK) == 0) return "tests/doctor_corpus";
    snprintf(path, sizeof path, "%s", __FILE__);
    char *slash = strrchr(path, '/');
    if (slash) snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "doctor_corpus");
    return path;
}

/* `tandem doctor dir`, bounded: a hang ends in SIGALRM (exit 128+14). */
static void hd_doctor(cli_result *r, const char *dir)
{
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        alarm((unsigned)(tu_scaled_ms(20000) / 1000));
        execl(cli_bin(), cli_bin(), "doctor", dir, (char *)NULL);
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

/* One clear verdict: exit 0, 1, 3..6 (not a signal, not usage); the first
 * line and only that one begins "verdict: "; no control byte but the
 * newline, no C1 control; no sanitizer report. */
static void hd_expect_clear(const cli_result *r, const char *what)
{
    cr_assert(r->code < 128, "%s: the doctor was killed by signal %d (%s):\n%s", what,
              r->code - 128, r->code == 128 + SIGALRM ? "a hang" : "a crash", r->out);
    cr_assert(r->code == 0 || r->code == 1 || (r->code >= 3 && r->code <= 6),
              "%s: exit %d:\n%s", what, r->code, r->out);
    cr_assert(!strncmp(r->out, "verdict: ", 9), "%s: no verdict first:\n%s", what, r->out);
    int lines = 0;
    for (const char *p = r->out; (p = strstr(p, "verdict:")); p++)
        if (p == r->out || p[-1] == '\n') lines++;
    cr_assert_eq(lines, 1, "%s: %d lines begin 'verdict:':\n%s", what, lines, r->out);
    for (const unsigned char *p = (const unsigned char *)r->out; *p; p++) {
        cr_assert(*p >= 0x20 || *p == '\n', "%s: control byte 0x%02x in the output:\n%s", what,
                  *p, r->out);
        cr_assert(*p != 0x7f, "%s: DEL in the output", what);
        cr_assert(!(p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f), "%s: a C1 control in the "
                  "output:\n%s", what, r->out);
    }
    cr_assert(!strstr(r->out, "Sanitizer") && !strstr(r->out, "runtime error"),
              "%s: a sanitizer report:\n%s", what, r->out);
}

/* The case's expected outcome where the corpus pins one (else any clear
 * verdict), and what its output must not say. */
typedef struct hd_case {
    const char *name;
    int code;                /* -1: any clear verdict */
    const char *has, *lacks;
} hd_case;

static const hd_case hd_cases[] = {
    {"array_not_object", 1, "an array, not a flight-recorder dump", "OK"},
    {"string_not_object", 1, "not a flight-recorder dump", "verdict: OK"},
    {"truncated", -1, "fr_rank_1.json: not read", NULL},
    {"empty_file", -1, "fr_rank_1.json: not read", NULL},
    {"negative_next_seq", -1, "\"next_seq\" is -1", NULL},
    {"huge_next_seq", -1, NULL, NULL},
    {"overflowing_number", -1, "fr_rank_0.json: not read", NULL},
    {"negative_numbers", -1, "not used", NULL},
    {"negative_rank_and_world", -1, NULL, NULL},
    {"rank_not_its_name", -1, "it says rank 0, not 1", NULL},
    {"extra_rank", 0, "fr_rank_5.json: not used: rank 5 of a job of 2", "evil"},
    {"missing_ranks", 4, "ranks 1,3 left no dump", NULL},
    {"worlds_disagree", -1, "not used", NULL},
    {"huge_world", -1, NULL, NULL},
    {"cause_names_rank_100000", 6, NULL, "rank 100000 was"},
    {"reason_names_negative_rank", 6, NULL, "rank -3 exited"},
    {"long_strings", -1, NULL, NULL},
    {"escapes_in_strings", -1, NULL, "\nverdict: OK"},
    {"entries_not_array", -1, "\"entries\" is an object, not an array", NULL},
    {"entries_not_objects", -1, "an entry is an integer, not an object", NULL},
    {"duplicate_seq", -1, "appears twice", NULL},
    {"seq_beyond_next_seq", -1, "\"seq\" is 50", NULL},
    {"wrong_types", -1, "not a number", NULL},
    {"deep_nesting", 1, "not read", NULL},
    {"hostile_summary", -1, NULL, NULL},
    {"summary_with_bad_dump", 4, "DIED: rank 1 was killed by signal 9", NULL},
    {"not_json_at_all", 1, "not read", NULL},
    {"other_version", -1, "\"version\" is 2", NULL},
    /* an RPC call to a rank out of any job: ignored, not read through */
    {"rpc_peer_out_of_range", -1, NULL, "rank 100000000"},
    {"rpc_peer_negative", -1, NULL, "rank -7"},
};

Test(doctor_hostile, every_corpus_case_gets_one_clear_verdict, .timeout = 600)
{
    const char *base = hd_corpus();
    DIR *d = opendir(base);
    cr_assert_not_null(d, "no corpus at %s", base);
    int n = 0, pinned = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (de->d_name[0] == '.') continue;
        char dir[2048];
        snprintf(dir, sizeof dir, "%s/%s", base, de->d_name);
        cli_result r;
        hd_doctor(&r, dir);
        hd_expect_clear(&r, de->d_name);
        for (size_t i = 0; i < sizeof hd_cases / sizeof hd_cases[0]; i++) {
            const hd_case *c = &hd_cases[i];
            if (strcmp(c->name, de->d_name)) continue;
            pinned++;
            if (c->code >= 0)
                cr_expect_eq(r.code, c->code, "%s: exit %d (expected %d):\n%s", c->name, r.code,
                             c->code, r.out);
            if (c->has) cr_expect(strstr(r.out, c->has), "%s: lacks '%s':\n%s", c->name, c->has,
                                  r.out);
            if (c->lacks) cr_expect(!strstr(r.out, c->lacks), "%s: says '%s':\n%s", c->name,
                                    c->lacks, r.out);
        }
        n++;
    }
    closedir(d);
    cr_expect_eq(pinned, (int)(sizeof hd_cases / sizeof hd_cases[0]),
                 "a case of the table is missing from %s", base);
    cr_expect(n >= 28, "only %d cases in %s", n, base);
}

/* A fresh private directory, removed by hd_rm. */
static void hd_dir(char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/tdm_doc_hostile_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void hd_rm(const char *dir)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static FILE *hd_open(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    return f;
}

/* The header of a dump of rank r of 2, up to the entries. */
static void hd_head(FILE *f, int r, long long next_seq)
{
    fprintf(f, "{\"version\":1,\"rank\":%d,\"world\":2,\"pid\":%d,\"backend\":\"shm\","
               "\"trigger\":\"end\",\"failed\":false,\"status\":\"ok\",\"reason\":\"\","
               "\"last_step\":1,\"ring_size\":2000,\"next_seq\":%lld,\"dump_mono_ns\":1,"
               "\"dump_real_ns\":1,\"entries\":[", r, 100 + r, next_seq);
}

static void hd_entry(FILE *f, int first, long long seq, const char *coll, const char *label)
{
    fprintf(f, "%s{\"seq\":%lld,\"coll\":\"%s\",\"dtype\":\"float32\",\"op\":\"sum\","
               "\"count\":8,\"root\":-1,\"label\":\"%s\",\"step\":0,\"state\":\"done\","
               "\"status\":\"ok\",\"t_enqueue_ns\":1,\"t_start_ns\":1,\"t_end_ns\":2}",
            first ? "" : ",", seq, coll, label);
}

/* A 3 GB file (sparse: no disk) is refused by its size, unread. */
Test(doctor_hostile, a_huge_file_is_refused_unread, .timeout = 120)
{
    char dir[64];
    hd_dir(dir, sizeof dir);
    char path[128];
    snprintf(path, sizeof path, "%s/fr_rank_0.json", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, (off_t)3 << 30), 0);
    close(fd);
    cli_result r;
    hd_doctor(&r, dir);
    hd_expect_clear(&r, "3 GB");
    cr_expect_eq(r.code, 1, "%s", r.out);
    cr_expect(strstr(r.out, "more than the 64 MiB a dump may have (not read)"), "%s", r.out);
    hd_rm(dir);
}

/* A 2 MB collective name and label (the recorder writes short ones)
 * overran a 256-byte stack buffer: the doctor prints a cut of them. */
Test(doctor_hostile, a_2mb_string_is_cut, .timeout = 120)
{
    char dir[64];
    hd_dir(dir, sizeof dir);
    char *label = malloc(2 << 20);
    cr_assert_not_null(label);
    memset(label, 'x', (2 << 20) - 1);
    label[(2 << 20) - 1] = 0;
    for (int r = 0; r < 2; r++) {
        char name[32];
        snprintf(name, sizeof name, "fr_rank_%d.json", r);
        FILE *f = hd_open(dir, name);
        hd_head(f, r, 2);
        hd_entry(f, 1, 0, "all_reduce", "ddp bucket 0");
        hd_entry(f, 0, 1, r ? label : "all_reduce", r ? label : "ddp bucket 1");
        fprintf(f, "]}\n");
        fclose(f);
    }
    free(label);
    cli_result r;
    hd_doctor(&r, dir);
    hd_expect_clear(&r, "2 MB strings");
    cr_expect_eq(r.code, 3, "%s", r.out);
    cr_expect(strstr(r.out, "DESYNC at collective #1"), "%s", r.out);
    cr_expect(strlen(r.out) < 16384, "the output is %zu bytes", strlen(r.out));
    hd_rm(dir);
}

/* 10000 entries whose seqs are spread up to 2^53: the work follows the
 * entries held, not the numbers claimed. */
Test(doctor_hostile, seqs_spread_to_2_53_end_quickly, .timeout = 120)
{
    char dir[64];
    hd_dir(dir, sizeof dir);
    const long long next = 9007199254740992LL;
    for (int r = 0; r < 2; r++) {
        char name[32];
        snprintf(name, sizeof name, "fr_rank_%d.json", r);
        FILE *f = hd_open(dir, name);
        hd_head(f, r, next);
        for (int i = 0; i < 10000; i++)
            hd_entry(f, i == 0, (next / 10000) * i + (r ? 1 : 0), "all_reduce", "ddp bucket 0");
        fprintf(f, "]}\n");
        fclose(f);
    }
    cli_result r;
    hd_doctor(&r, dir);
    hd_expect_clear(&r, "seqs to 2^53");
    hd_rm(dir);
}
