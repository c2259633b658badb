/* tests/test_flight.c: the communicator flight recorder (core/flight.h):
 * what an entry holds after a good run, the ring's wrap at TANDEM_FR_SIZE,
 * the dump on a failure (with its reason) and on SIGUSR1, a bad
 * TANDEM_FR_SIZE refused, and TANDEM_FR_SIZE=0 writing nothing. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/flight.h"
#include "core/json.h"
#include "shm/shm_comm.h"
#include "shm/spawn.h"
#include "tests/fr_test_util.h"

static const tdm_json *fr_entries(const tdm_json *doc)
{
    const tdm_json *e = tdm_json_get(doc, "entries");
    cr_assert(e && e->type == TDM_JSON_ARRAY);
    return e;
}

static int64_t fr_int(const tdm_json *o, const char *k)
{
    const tdm_json *v = tdm_json_get(o, k);
    cr_assert(v && (v->type == TDM_JSON_INT || v->type == TDM_JSON_BOOL), "no integer '%s'", k);
    return v->i;
}

static const char *fr_str(const tdm_json *o, const char *k)
{
    const tdm_json *v = tdm_json_get(o, k);
    cr_assert(v && v->type == TDM_JSON_STRING, "no string '%s'", k);
    return v->str;
}

Test(flight, good_run_records_every_call_in_order, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    fr_t_job j = {.steps = 4, .fault_rank = -1};
    cr_assert_eq(fr_t_run(2, &j), TDM_STATUS_OK, "%s", tdm_error_message());
    for (int r = 0; r < 2; r++) {
        tdm_json *doc = fr_t_load(dir, r);
        cr_assert_not_null(doc, "rank %d left no dump", r);
        cr_expect_eq(fr_int(doc, "rank"), r);
        cr_expect_eq(fr_int(doc, "world"), 2);
        cr_expect_eq(fr_int(doc, "failed"), 0);
        cr_expect_str_eq(fr_str(doc, "trigger"), "end");
        cr_expect_str_eq(fr_str(doc, "backend"), "shm");
        cr_expect_eq(fr_int(doc, "last_step"), 4);
        cr_expect_eq(fr_int(doc, "next_seq"), 4 * FR_T_BUCKETS);
        const tdm_json *e = fr_entries(doc);
        cr_assert_eq(e->n, 4 * FR_T_BUCKETS);
        for (int i = 0; i < e->n; i++) {
            const tdm_json *o = &e->items[i];
            int b = i % FR_T_BUCKETS;
            char label[32];
            snprintf(label, sizeof label, "ddp bucket %d", b);
            cr_expect_eq(fr_int(o, "seq"), i);
            cr_expect_str_eq(fr_str(o, "coll"), "all_reduce");
            cr_expect_str_eq(fr_str(o, "dtype"), "float32");
            cr_expect_str_eq(fr_str(o, "op"), "sum");
            cr_expect_eq(fr_int(o, "count"), (int64_t)fr_t_count[b]);
            cr_expect_eq(fr_int(o, "root"), -1);
            cr_expect_str_eq(fr_str(o, "label"), label);
            cr_expect_eq(fr_int(o, "step"), i / FR_T_BUCKETS);
            cr_expect_str_eq(fr_str(o, "state"), "done");
            cr_expect_str_eq(fr_str(o, "status"), "ok");
            int64_t q = fr_int(o, "t_enqueue_ns"), s = fr_int(o, "t_start_ns"),
                    t = fr_int(o, "t_end_ns");
            cr_expect(q > 0 && q <= s && s <= t, "entry %d times %lld %lld %lld", i,
                      (long long)q, (long long)s, (long long)t);
        }
        tdm_json_free(doc);
    }
    fr_t_rm_dir(dir);
}

Test(flight, ring_keeps_the_last_size_entries, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_SIZE", "4", 1);
    fr_t_job j = {.steps = 5, .fault_rank = -1};
    cr_assert_eq(fr_t_run(2, &j), TDM_STATUS_OK, "%s", tdm_error_message());
    tdm_json *doc = fr_t_load(dir, 1);
    cr_assert_not_null(doc);
    cr_expect_eq(fr_int(doc, "ring_size"), 4);
    cr_expect_eq(fr_int(doc, "next_seq"), 15);
    const tdm_json *e = fr_entries(doc);
    cr_assert_eq(e->n, 4);
    for (int i = 0; i < 4; i++) cr_expect_eq(fr_int(&e->items[i], "seq"), 11 + i);
    tdm_json_free(doc);
    fr_t_rm_dir(dir);
}

Test(flight, failure_is_dumped_with_its_reason, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    fr_t_job j = {.steps = 3, .fault_step = 1, .fault_rank = 1, .fault = FR_T_GATHER};
    cr_assert_neq(fr_t_run(2, &j), TDM_STATUS_OK);
    for (int r = 0; r < 2; r++) {
        tdm_json *doc = fr_t_load(dir, r);
        cr_assert_not_null(doc, "rank %d left no dump", r);
        cr_expect_eq(fr_int(doc, "failed"), 1);
        cr_expect(strstr(fr_str(doc, "reason"), "collective #4"), "reason: %s",
                  fr_str(doc, "reason"));
        const tdm_json *e = fr_entries(doc);
        cr_assert_eq(e->n, 5, "rank %d: %d entries", r, e->n);
        const tdm_json *last = &e->items[4];
        cr_expect_str_eq(fr_str(last, "state"), "failed");
        cr_expect_str_eq(fr_str(last, "coll"), r == 1 ? "all_gather" : "all_reduce");
        cr_expect_str_eq(fr_str(last, "label"), "ddp bucket 1");
        cr_expect_eq(fr_int(doc, "last_step"), 1);
        tdm_json_free(doc);
    }
    fr_t_rm_dir(dir);
}

/* SIGUSR1 dumps a live process without stopping it. */
static int fr_sigusr1_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    float x = 1;
    tdm_comm_set_label(comm, "before the signal");
    if (tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM)) return 1;
    if (tdm_comm_rank(comm) == 0) raise(SIGUSR1);
    return tdm_comm_barrier(comm) ? 1 : 0;
}

Test(flight, sigusr1_dumps_a_running_rank, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);   /* no end-of-run dump to mask it */
    cr_assert_eq(tdm_shm_spawn(2, fr_sigusr1_rank, NULL, NULL, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    tdm_json *doc = fr_t_load(dir, 0);
    cr_assert_not_null(doc, "SIGUSR1 wrote no dump");
    cr_expect_str_eq(fr_str(doc, "trigger"), "SIGUSR1");
    cr_expect_eq(fr_int(doc, "failed"), 0);
    const tdm_json *e = fr_entries(doc);
    cr_assert_eq(e->n, 1);
    cr_expect_str_eq(fr_str(&e->items[0], "label"), "before the signal");
    tdm_json_free(doc);
    cr_expect_null(fr_t_load(dir, 1), "rank 1 got no signal and did not fail");
    fr_t_rm_dir(dir);
}

Test(flight, bad_size_is_refused_and_zero_turns_it_off, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    tdm_shm_group *g = NULL;
    cr_assert_eq(tdm_shm_group_create(&g, 1, NULL), TDM_STATUS_OK);
    tdm_comm *c = NULL;
    setenv("TANDEM_FR_SIZE", "lots", 1);
    cr_expect_eq(tdm_shm_comm_init(&c, g, 0, NULL), TDM_STATUS_INVALID_ARG);
    cr_expect(strstr(tdm_error_message(), "TANDEM_FR_SIZE='lots'"), "%s", tdm_error_message());
    tdm_shm_group_free(g);
    g = NULL;
    setenv("TANDEM_FR_SIZE", "0", 1);
    fr_t_job j = {.steps = 2, .fault_rank = -1};
    cr_assert_eq(fr_t_run(2, &j), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_expect_null(fr_t_load(dir, 0), "the recorder is off: nothing may be written");
    fr_t_rm_dir(dir);
}

/* A rank blocked inside a collective (its peer late) is dumped by SIGUSR1
 * there and then: the dump shows the call running, not yet ended. Rank 1
 * waits for what it needs, not for a fixed time: rank 0 about to call
 * the all_reduce (then a margin for the call to start), and rank 0's dump
 * written, before it joins the all_reduce itself. */
typedef struct {
    atomic_int calling;   /* rank 0 is about to call the all_reduce */
} fr_hung_shared;

/* Poll every 10 ms until *flag is set / path exists; 0 on time out. */
static int fr_wait_flag(atomic_int *flag, int ms)
{
    for (int t = 0; t < ms; t += 10) {
        if (atomic_load(flag)) return 1;
        usleep(10 * 1000);
    }
    return 0;
}

static int fr_wait_file(const char *path, int ms)
{
    for (int t = 0; t < ms; t += 10) {
        if (access(path, F_OK) == 0) return 1;
        usleep(10 * 1000);
    }
    return 0;
}

/* 1 when the file at path contains s. */
static int fr_file_has(const char *path, const char *s)
{
    char buf[8192];
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, s) != NULL;
}

static int fr_hung_rank(tdm_comm *comm, void *arg)
{
    fr_hung_shared *sh = arg;
    int32_t me = (int32_t)getpid(), pids[2];
    if (tdm_comm_all_gather(comm, &me, pids, 1, TDM_DTYPE_INT32)) return 1;
    float x = 1;
    tdm_comm_set_label(comm, "the late one");
    if (tdm_comm_rank(comm) == 1) {
        char path[512];
        snprintf(path, sizeof path, "%s/fr_rank_0.json", getenv("TANDEM_FR_DUMP"));
        if (!fr_wait_flag(&sh->calling, tu_scaled_ms(20000))) return 2;
        /* the call is recorded within microseconds of its start, but a
         * loaded machine may leave rank 0 unscheduled between the flag
         * and the call for longer than any fixed margin: a dump taken
         * before it (no running entry) is taken again */
        for (int k = 0;; k++) {
            usleep(200 * 1000);
            kill(pids[0], SIGUSR1);
            if (!fr_wait_file(path, tu_scaled_ms(20000))) return 3;
            if (fr_file_has(path, "\"running\"")) break;
            if (k == 100) return 4;
            unlink(path);
        }
    } else {
        atomic_store(&sh->calling, 1);
    }
    return tdm_comm_all_reduce(comm, &x, &x, 1, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM) ? 1 : 0;
}

Test(flight, sigusr1_dumps_a_rank_blocked_in_a_collective, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    fr_hung_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert(sh != MAP_FAILED);
    atomic_init(&sh->calling, 0);
    cr_assert_eq(tdm_shm_spawn(2, fr_hung_rank, sh, NULL, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    munmap(sh, sizeof *sh);
    tdm_json *doc = fr_t_load(dir, 0);
    cr_assert_not_null(doc, "SIGUSR1 wrote no dump");
    cr_expect_str_eq(fr_str(doc, "trigger"), "SIGUSR1");
    const tdm_json *e = fr_entries(doc);
    cr_assert_eq(e->n, 2);
    cr_expect_str_eq(fr_str(&e->items[0], "state"), "done");
    cr_expect_str_eq(fr_str(&e->items[1], "coll"), "all_reduce");
    cr_expect_str_eq(fr_str(&e->items[1], "label"), "the late one");
    cr_expect_str_eq(fr_str(&e->items[1], "state"), "running");
    cr_expect_eq(fr_int(&e->items[1], "t_end_ns"), 0);
    tdm_json_free(doc);
    fr_t_rm_dir(dir);
}

/* Only the process's primary communicator writes fr_rank_<R>.json (what
 * the doctor reads); one marked inner (a part of a composite, as hier's)
 * gives the name to the next one made. */
Test(flight, the_composite_communicator_owns_the_rank_file, .timeout = 30)
{
    char dir[64], path[128];
    fr_t_dump_dir(dir, sizeof dir);
    tdm_fr *part = NULL, *other = NULL, *whole = NULL;
    cr_assert_eq(tdm_fr_init(&part, 3, 4, "shm"), TDM_STATUS_OK);
    cr_assert_eq(tdm_fr_init(&other, 0, 2, "mpi"), TDM_STATUS_OK);
    tdm_fr_set_inner(part, 5);
    tdm_fr_set_inner(other, 5);
    cr_assert_eq(tdm_fr_init(&whole, 5, 8, "hier"), TDM_STATUS_OK);
    cr_assert_eq(tdm_fr_dump(part, "request"), 0);
    cr_assert_eq(tdm_fr_dump(other, "request"), 0);
    cr_assert_eq(tdm_fr_dump(whole, "request"), 0);
    snprintf(path, sizeof path, "%s/fr_rank_5.json", dir);
    cr_expect_eq(access(path, F_OK), 0, "the composite's dump is not fr_rank_5.json");
    snprintf(path, sizeof path, "%s/fr_rank_3.json", dir);
    cr_expect(access(path, F_OK) != 0, "the part took the rank's name");
    snprintf(path, sizeof path, "%s/fr_rank_0.json", dir);
    cr_expect(access(path, F_OK) != 0, "the part took the rank's name");
    tdm_json *doc = fr_t_load(dir, 5);
    cr_assert_not_null(doc);
    cr_expect_str_eq(fr_str(doc, "backend"), "hier");
    tdm_json_free(doc);
    /* the parts' dumps carry the job's rank (5), their own (3, 0) beside */
    int parts = 0;
    DIR *dp = opendir(dir);
    cr_assert_not_null(dp);
    for (struct dirent *de; (de = readdir(dp));) {
        if (strncmp(de->d_name, "fr_rank_", 8) || !strcmp(de->d_name, "fr_rank_5.json")) continue;
        cr_expect(!strncmp(de->d_name, "fr_rank_5.c", 11), "a part's dump is %s", de->d_name);
        parts++;
    }
    closedir(dp);
    cr_expect_eq(parts, 2);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    tdm_fr_free(part);
    tdm_fr_free(other);
    tdm_fr_free(whole);
    fr_t_rm_dir(dir);
}

/* A communicator made over a bootstrap one (NCCL's over the shm group:
 * the shm one is made first) takes the rank's name: its collectives are
 * the training's. */
Test(flight, a_communicator_over_a_bootstrap_takes_the_rank_file, .timeout = 30)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    tdm_fr *boot = NULL, *nccl = NULL;
    cr_assert_eq(tdm_fr_init(&boot, 2, 4, "shm"), TDM_STATUS_OK);
    cr_assert_eq(tdm_fr_init(&nccl, 2, 4, "nccl"), TDM_STATUS_OK);
    tdm_fr_set_primary(nccl);
    cr_assert_eq(tdm_fr_dump(boot, "request"), 0);
    cr_assert_eq(tdm_fr_dump(nccl, "request"), 0);
    tdm_json *doc = fr_t_load(dir, 2);
    cr_assert_not_null(doc);
    cr_expect_str_eq(fr_str(doc, "backend"), "nccl");
    tdm_json_free(doc);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    tdm_fr_free(boot);
    tdm_fr_free(nccl);
    fr_t_rm_dir(dir);
}

/* Two writers of one recorder's dump at once (a SIGUSR1 landing while the
 * thread it interrupts is writing an end-of-run or failure dump): each
 * writes its own temporary file, so the file that lands is always one
 * complete dump. The signal is sent as soon as the first writer's
 * temporary file exists (a dump of 60000 entries takes tens of ms), so it
 * lands inside that write on every run. */
typedef struct {
    const char *dir;
    pthread_t target;
    atomic_int stop, sent;
} fr_nested_ctx;

static int fr_tmp_exists(const char *dir)
{
    DIR *d = opendir(dir);
    int found = 0;
    for (struct dirent *de; d && (de = readdir(d));)
        if (de->d_name[0] == '.' && strstr(de->d_name, ".tmp")) found = 1;
    if (d) closedir(d);
    return found;
}

static void *fr_nested_signaller(void *arg)
{
    fr_nested_ctx *x = arg;
    while (!atomic_load(&x->stop)) {
        if (!atomic_load(&x->sent) && fr_tmp_exists(x->dir)) {
            atomic_store(&x->sent, 1);
            pthread_kill(x->target, SIGUSR1);
        }
        usleep(200);
    }
    return NULL;
}

/* The whole file at path, parsed (fails the test when it is not JSON). */
static tdm_json *fr_load_big(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: no dump", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    cr_assert_not_null(text);
    cr_assert_eq(fread(text, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    tdm_json *doc = NULL;
    tdm_status st = tdm_json_parse(&doc, text, (size_t)n);
    free(text);
    cr_assert_eq(st, TDM_STATUS_OK, "%s: a dump written while another was being written does "
                 "not parse: %s", path, tdm_error_message());
    return doc;
}

Test(flight, a_dump_interrupted_by_another_stays_whole, .timeout = 120)
{
    char dir[64], path[128];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_SIZE", "60000", 1);
    tdm_fr *fr = NULL;
    cr_assert_eq(tdm_fr_init(&fr, 0, 1, "shm"), TDM_STATUS_OK);
    tdm_comm_call k = {.coll = TDM_COLL_ALL_REDUCE, .count = 1000, .dtype = TDM_DTYPE_FLOAT32};
    for (int i = 0; i < 60000; i++) {
        tdm_fr_set_label(fr, "a long enough label for a big dump");
        tdm_fr_end(fr, tdm_fr_begin(fr, &k, TDM_FR_RUNNING), TDM_STATUS_OK);
    }
    snprintf(path, sizeof path, "%s/fr_rank_0.json", dir);
    for (int round = 0; round < 5; round++) {
        fr_nested_ctx x = {.dir = dir, .target = pthread_self()};
        pthread_t t;
        cr_assert_eq(pthread_create(&t, NULL, fr_nested_signaller, &x), 0);
        cr_assert_eq(tdm_fr_dump(fr, "end"), 0);
        atomic_store(&x.stop, 1);
        pthread_join(t, NULL);
        cr_assert(atomic_load(&x.sent), "the dump ended before the signal could be sent");
        tdm_json *doc = fr_load_big(path);
        cr_expect_eq(fr_entries(doc)->n, 60000);
        tdm_json_free(doc);
        cr_expect(!fr_tmp_exists(dir), "a temporary file was left behind");
    }
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    tdm_fr_free(fr);
    fr_t_rm_dir(dir);
}

/* TANDEM_FR_DUMP follows the rule of --plot and --log-dir
 * (core/safefile.h): a directory others can write to, one of another
 * user, or a symlink of another user's is refused when the recorder is
 * made, with the reason; a missing one is created 0755. */
Test(flight, a_dump_directory_others_control_is_refused, .timeout = 30)
{
    char dir[64], sub[96], link[96];
    fr_t_dump_dir(dir, sizeof dir);
    tdm_fr *fr = NULL;
    cr_assert_eq(chmod(dir, 0777), 0);
    cr_expect_eq(tdm_fr_init(&fr, 0, 1, "shm"), TDM_STATUS_INVALID_ARG);
    cr_expect(strstr(tdm_error_message(), "TANDEM_FR_DUMP") &&
              strstr(tdm_error_message(), "writable by others"), "%s", tdm_error_message());
    cr_assert_eq(chmod(dir, 0700), 0);
    snprintf(sub, sizeof sub, "%s/new", dir);
    setenv("TANDEM_FR_DUMP", sub, 1);
    cr_assert_eq(tdm_fr_init(&fr, 0, 1, "shm"), TDM_STATUS_OK, "%s", tdm_error_message());
    struct stat sb;
    cr_expect(stat(sub, &sb) == 0 && S_ISDIR(sb.st_mode) && (sb.st_mode & 0777) == 0755);
    tdm_fr_free(fr);
    if (geteuid() == 0) {   /* another user's directory and symlink need root to make */
        cr_assert_eq(chown(sub, 65534, 65534), 0);
        cr_expect_eq(tdm_fr_init(&fr, 0, 1, "shm"), TDM_STATUS_INVALID_ARG);
        cr_expect(strstr(tdm_error_message(), "belongs to uid 65534"), "%s", tdm_error_message());
        cr_assert_eq(chown(sub, 0, 0), 0);
        snprintf(link, sizeof link, "%s/link", dir);
        cr_assert_eq(symlink(sub, link), 0);
        cr_assert_eq(lchown(link, 65534, 65534), 0);
        setenv("TANDEM_FR_DUMP", link, 1);
        cr_expect_eq(tdm_fr_init(&fr, 0, 1, "shm"), TDM_STATUS_INVALID_ARG);
        cr_expect(strstr(tdm_error_message(), "symbolic link that belongs to uid 65534"), "%s",
                  tdm_error_message());
    }
    fr_t_rm_dir(dir);
}
