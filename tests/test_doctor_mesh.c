/* tests/test_doctor_mesh.c: `tandem doctor` on jobs that train on
 * communicators split from their first one (dist/mesh.h's dp, pp and tp
 * groups), whose first communicator's record ends with the splits:
 * - the recorder: a split's dumps carry the job rank, the group's id
 *   (the same on its members only) and its members' job ranks;
 * - a killed rank of a tensor-parallel group: the others waited in the
 *   group's collective, not in the splits' all_gather (which every rank
 *   completed, so no rank "never entered" it);
 * - a pipeline of tensor-parallel stages: the sender of a stage's recv is
 *   the link's other member, not the rank a stage's width before;
 * - a stopped rank is STALLED, not the rank that exited after its dump
 *   said why (the abort that followed); its teardown SIGKILL is not how
 *   it stopped.
 * Dumps written here by hand have the recorder's shape (core/flight.c). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/json.h"
#include "tests/cli_util.h"
#include "tests/fr_test_util.h"

#define JOB "00000000000000cc"

/* ---- the recorder ------------------------------------------------------- */

static int split_rank(tdm_comm *comm, void *arg)
{
    (void)arg;
    int r = tdm_comm_rank(comm);
    tdm_comm *sub = NULL;
    if (tdm_comm_split(comm, r / 2, r, &sub)) return 1;
    float x[4] = {1, 2, 3, 4};
    tdm_comm_set_label(sub, "group sum");
    tdm_status st = tdm_comm_all_reduce(sub, x, x, 4, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
    tdm_comm_free(sub);
    return st ? 1 : 0;
}

/* The split's dump of job rank r in dir (the only fr_rank_<r>.c*). */
static tdm_json *split_dump(const char *dir, int r)
{
    char cmd[512], path[512] = "";
    snprintf(cmd, sizeof cmd, "ls %s/fr_rank_%d.c*.json 2>/dev/null", dir, r);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    int lines = 0;
    char line[512];
    while (fgets(line, sizeof line, p)) {
        lines++;
        snprintf(path, sizeof path, "%s", line);
    }
    pclose(p);
    cr_assert_eq(lines, 1, "job rank %d: %d split dumps in %s", r, lines, dir);
    path[strcspn(path, "\n")] = 0;
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text, f);
    fclose(f);
    tdm_json *doc = NULL;
    cr_assert_eq(tdm_json_parse(&doc, text, n), TDM_STATUS_OK, "%s: %s", path, text);
    return doc;
}

Test(doctor_mesh, a_splits_dumps_name_the_group_and_its_job_ranks, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);   /* end-of-run dumps */
    unsetenv("TANDEM_FR_DUMP_ON");
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    cr_assert_eq(tdm_shm_spawn(4, split_rank, NULL, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    char comm[4][24];
    for (int r = 0; r < 4; r++) {
        tdm_json *d = split_dump(dir, r);
        const tdm_json *m = tdm_json_get(d, "members");
        cr_assert(m && m->type == TDM_JSON_ARRAY && m->n == 2, "job rank %d: no members", r);
        cr_expect_eq(m->items[0].i, r / 2 * 2);
        cr_expect_eq(m->items[1].i, r / 2 * 2 + 1);
        const tdm_json *rk = tdm_json_get(d, "rank"), *cr = tdm_json_get(d, "comm_rank");
        cr_expect(rk && rk->i == r, "rank is not the job rank %d", r);
        cr_expect(cr && cr->i == r % 2, "comm_rank is not %d", r % 2);
        const tdm_json *c = tdm_json_get(d, "comm");
        cr_assert(c && c->type == TDM_JSON_STRING && strlen(c->str) == 16, "job rank %d: no id",
                  r);
        snprintf(comm[r], sizeof comm[r], "%s", c->str);
        tdm_json_free(d);
    }
    cr_expect_str_eq(comm[0], comm[1]);
    cr_expect_str_eq(comm[2], comm[3]);
    cr_expect_str_neq(comm[0], comm[2]);
    fr_t_rm_dir(dir);
}

/* ---- dumps by hand ------------------------------------------------------ */

/* A world dump of 4 ranks whose record ends with the splits, done. */
static void world_dump(const char *dir, int rank, const char *reason)
{
    char path[256];
    snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, rank);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"version\":1,\"rank\":%d,\"world\":4,\"pid\":%d,\"job\":\"" JOB "\","
               "\"backend\":\"shm\",\"trigger\":\"end\",\"failed\":true,\"status\":\"aborted\","
               "\"reason\":\"%s\",\"last_step\":0,\"ring_size\":2000,\"next_seq\":3,"
               "\"dump_mono_ns\":9,\"dump_real_ns\":9,\"entries\":[",
            rank, 100 + rank, reason);
    static const char *const lab[] = {"comm split: colors and keys", "comm split: shm segments",
                                      "comm split: joined"};
    for (int i = 0; i < 3; i++)
        fprintf(f, "%s{\"seq\":%d,\"coll\":\"all_gather\",\"dtype\":\"int32\",\"op\":\"-\","
                   "\"count\":1,\"root\":-1,\"label\":\"%s\",\"step\":0,\"state\":\"done\","
                   "\"status\":\"ok\",\"t_enqueue_ns\":%d,\"t_start_ns\":%d,\"t_end_ns\":%d}",
                i ? "," : "", i, lab[i], 10 + i, 10 + i, 11 + i);
    fprintf(f, "]}\n");
    fclose(f);
}

/* A split's dump of job rank `rank` (members a,b; k: its number in the
 * process) whose last call (coll, label) began at t and ended `state`. */
static void split_dump_w(const char *dir, int rank, int k, int a, int b, const char *coll,
                         int root, const char *label, const char *state, int t)
{
    char path[256];
    snprintf(path, sizeof path, "%s/fr_rank_%d.c%d.pid%d.json", dir, rank, k, 100 + rank);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    int p2p = !strcmp(coll, "send") || !strcmp(coll, "recv");
    fprintf(f, "{\"version\":1,\"rank\":%d,\"comm_rank\":%d,\"world\":2,\"comm\":\"%016x\","
               "\"members\":[%d,%d],\"pid\":%d,\"job\":\"" JOB "\",\"backend\":\"shm\","
               "\"trigger\":\"end\",\"failed\":true,\"status\":\"peer failed\",\"reason\":\"x\","
               "\"last_step\":0,\"ring_size\":2000,\"next_seq\":2,\"dump_mono_ns\":9,"
               "\"dump_real_ns\":9,\"entries\":["
               "{\"seq\":0,\"coll\":\"%s\",\"dtype\":\"float32\",\"op\":\"%s\",\"count\":64,"
               "\"root\":%d,\"label\":\"%s\",\"step\":0,\"state\":\"done\",\"status\":\"ok\","
               "\"t_enqueue_ns\":100,\"t_start_ns\":100,\"t_end_ns\":101},"
               "{\"seq\":1,\"coll\":\"%s\",\"dtype\":\"float32\",\"op\":\"%s\",\"count\":64,"
               "\"root\":%d,\"label\":\"%s\",\"step\":0,\"state\":\"%s\",\"status\":\"peer "
               "failed\",\"t_enqueue_ns\":%d,\"t_start_ns\":%d,\"t_end_ns\":%d}]}\n",
            rank, rank == a ? 0 : 1, k * 0x100 + a * 0x10 + b, a, b, 100 + rank, coll,
            p2p ? "-" : "sum", root, label, coll, p2p ? "-" : "sum", root, label, state, t, t,
            t + 50);
    fclose(f);
}

static void summary(const char *dir, const char *cause, int dead, int stalled, int wdead)
{
    char path[256];
    snprintf(path, sizeof path, "%s/launch.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"version\":1,\"job\":\"" JOB "\",\"world\":4,\"cause\":\"%s\",\"ranks\":[",
            cause);
    for (int r = 0; r < 4; r++)
        fprintf(f, "%s{\"rank\":%d,\"pid\":%d,\"wstatus\":%d,\"induced\":%s,\"stalled\":%s}",
                r ? "," : "", r, 100 + r, r == dead ? wdead : 256,
                r == stalled ? "true" : "false", r == stalled ? "true" : "false");
    fprintf(f, "]}\n");
    fclose(f);
}

/* dp=2 x tp=2: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}. Rank 3 is
 * killed; rank 2 waited in the tp all-reduce with it (from t=500); ranks
 * 0 and 1 were stopped in theirs by the abort that followed (t=900). */
static void tp_job(const char *dir, int stopped)
{
    for (int r = 0; r < 3; r++) world_dump(dir, r, "tp all-reduce: the job was aborted");
    split_dump_w(dir, 0, 2, 0, 1, "all_reduce", -1, "tp all-reduce forward fc2", "failed", 900);
    split_dump_w(dir, 1, 2, 0, 1, "all_reduce", -1, "tp all-reduce forward fc2", "failed", 910);
    split_dump_w(dir, 2, 2, 2, 3, "all_reduce", -1, "tp all-reduce forward fc2", "failed", 500);
    for (int r = 0; r < 3; r++)
        split_dump_w(dir, r, 3, r % 2, r % 2 + 2, "all_reduce", -1, "ddp bucket 0", "done", 200);
    if (stopped)
        summary(dir, "rank 0 (pid 100) exited with code 1", -1, 3, 256);
    else
        summary(dir, "rank 3 (pid 103) was killed by signal 9 (Killed)", 3, -1, 9);
}

Test(doctor_mesh, a_killed_rank_of_a_tp_group_is_waited_for_in_the_groups_collective,
     .timeout = 30)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    tp_job(dir, 0);
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 4, "verdict: DIED: rank 3 was killed by signal 9 (Killed); the others waited in "
                  "all_reduce(float32, sum, count=64) 'tp all-reduce forward fc2' #1 of the "
                  "communicator of ranks 2,3");
    cr_expect(!strstr(r.out, "comm split"), "a collective every rank completed:\n%s", r.out);
    fr_t_rm_dir(dir);
}

Test(doctor_mesh, a_stopped_rank_is_stalled_not_the_rank_that_exited_after_it,
     .timeout = 30)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    tp_job(dir, 1);
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 5, "verdict: STALLED: rank 3 was stopped or frozen");
    expect(&r, 5, "the others waited in all_reduce(float32, sum, count=64) 'tp all-reduce "
                  "forward fc2' #1 of the communicator of ranks 2,3");
    expect(&r, 5, "stopped first: rank 3 (stopped or frozen; the launcher's teardown killed it "
                  "after)");
    cr_expect(!strstr(r.out, "comm split"), "%s", r.out);
    fr_t_rm_dir(dir);
}

/* pp=2 x tp=2: stage 0 is ranks 0,1, stage 1 ranks 2,3; the links are
 * {0,2} and {1,3}. Rank 1 is killed: rank 3 waits for its activation;
 * ranks 0 and 2 wait for each other once the abort stopped them. */
Test(doctor_mesh, a_pipeline_of_tp_stages_names_the_links_other_rank, .timeout = 30)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    world_dump(dir, 0, "pp: the job was aborted");
    world_dump(dir, 2, "pp: the job was aborted");
    world_dump(dir, 3, "pp: the job was aborted");
    split_dump_w(dir, 0, 4, 0, 2, "recv", 1, "pp recv grad mb 0 stage 1->0", "failed", 700);
    split_dump_w(dir, 2, 4, 0, 2, "recv", 0, "pp recv act mb 1 stage 0->1", "failed", 800);
    split_dump_w(dir, 3, 4, 1, 3, "recv", 0, "pp recv act mb 0 stage 0->1", "failed", 500);
    summary(dir, "rank 1 (pid 101) was killed by signal 9 (Killed)", 1, -1, 9);
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 4, "verdict: DIED: stage 0 (rank 1) never sent act mb 0 to stage 1 (rank 3): it "
                  "was killed by signal 9");
    fr_t_rm_dir(dir);
}
