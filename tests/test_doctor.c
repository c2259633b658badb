/* tests/test_doctor.c: `tandem doctor DIR` on the dumps of real jobs with
 * one injected fault each (tests/fr_test_util.h: three ranks of labelled
 * bucket all_reduces; rank 1 misbehaves at step 2): a skipped bucket,
 * all_gather where the others all_reduce, a different count, a stall
 * (SIGSTOP) and a death (SIGKILL); and a good run. Each checks the
 * verdict's exit code and the lines that name the culprit. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_util.h"
#include "tests/fr_test_util.h"

static char doc_last_out[sizeof(((cli_result *)0)->out)];   /* the last doctor_case's output */

static void doctor_case(fr_t_fault fault, int expect_ok, int code, const char *const *phrases)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    /* rank 2 is slow where rank 1 dies: it must still see the death and
     * dump before the job's teardown stops it */
    fr_t_job j = {.steps = 4, .fault_step = 2, .fault_rank = 1, .fault = fault,
                  .slow_rank = fault == FR_T_KILL ? 2 : 0};
    tdm_status st = fr_t_run(3, &j);
    if (expect_ok) cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    else cr_assert_neq(st, TDM_STATUS_OK, "the fault went unnoticed");
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, code, "verdict: ");
    if (getenv("TDM_TEST_SHOW")) fprintf(stderr, "%s", r.out);   /* to read the wording */
    for (int i = 0; phrases[i]; i++)
        cr_expect(strstr(r.out, phrases[i]), "doctor's output lacks '%s':\n%s", phrases[i], r.out);
    snprintf(doc_last_out, sizeof doc_last_out, "%s", r.out);
    fr_t_rm_dir(dir);
}

/* Step 2 of 4 begins at collective #6 (3 buckets a step); bucket 1 is #7. */

Test(doctor, skipped_bucket, .timeout = 90)
{
    doctor_case(FR_T_SKIP, 0, 3, (const char *const[]){
        "verdict: DESYNC at collective #7: ranks 0,2 called all_reduce(float32, sum, count=48) "
        "'ddp bucket 1'; rank 1 called all_reduce(float32, sum, count=32) 'ddp bucket 2'",
        "rank 1 skipped all_reduce(float32, sum, count=48) 'ddp bucket 1'",
        "odd one out: rank 1, in all_reduce(float32, sum, count=32) 'ddp bucket 2' #7",
        "last completed step: 2", NULL});
}

Test(doctor, all_gather_where_others_all_reduce, .timeout = 90)
{
    doctor_case(FR_T_GATHER, 0, 3, (const char *const[]){
        "verdict: DESYNC at collective #7: ranks 0,2 called all_reduce(float32, sum, count=48) "
        "'ddp bucket 1'; rank 1 called all_gather(float32, count=16) 'ddp bucket 1'",
        "odd one out: rank 1",
        "last completed step: 2", NULL});
}

Test(doctor, different_count, .timeout = 90)
{
    doctor_case(FR_T_COUNT, 0, 3, (const char *const[]){
        "verdict: DESYNC at collective #7: ranks 0,2 called all_reduce(float32, sum, count=48) "
        "'ddp bucket 1'; rank 1 called all_reduce(float32, sum, count=49) 'ddp bucket 1'",
        "odd one out: rank 1",
        NULL});
}

/* Two ranks, and rank 0 calls an extra collective (the `if rank == 0:`
 * bug): one against one, the records cannot say which side is wrong, and
 * the doctor must not pick one (it named rank 1, the healthy one, as the
 * odd one out): it says so and shows both ranks' calls. */
Test(doctor, two_ranks_disagreeing_name_no_odd_one_out, .timeout = 90)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    fr_t_job j = {.steps = 4, .fault_step = 2, .fault_rank = 0, .fault = FR_T_EXTRA};
    cr_assert_neq(fr_t_run(2, &j), TDM_STATUS_OK, "the extra call went unnoticed");
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 3, "verdict: DESYNC at collective #7: rank 0 called all_reduce(float32, sum, "
                  "count=16) 'extra'; rank 1 called all_reduce(float32, sum, count=48) "
                  "'ddp bucket 1'");
    expect(&r, 3, "no majority (1 rank against 1): the records cannot tell which side went "
                  "wrong");
    expect(&r, 3, "    rank 0 called: #5 all_reduce(float32, sum, count=32) 'ddp bucket 2', #6 "
                  "all_reduce(float32, sum, count=64) 'ddp bucket 0', #7 all_reduce(float32, "
                  "sum, count=16) 'extra' (failed)");
    expect(&r, 3, "rank 1 called: #5 all_reduce(float32, sum, count=32) 'ddp bucket 2', #6 "
                  "all_reduce(float32, sum, count=64) 'ddp bucket 0', #7 all_reduce(float32, "
                  "sum, count=48) 'ddp bucket 1' (failed)");
    cr_expect(!strstr(r.out, "odd one out"), "%s", r.out);
    cr_expect(!strstr(r.out, "stopped first"), "%s", r.out);
    fr_t_rm_dir(dir);
}

Test(doctor, stalled_rank, .timeout = 90)
{
    doctor_case(FR_T_STOP, 0, 5, (const char *const[]){
        "verdict: STALLED: rank 1 is stopped",
        "stopped first: rank 1 (is stopped",
        "the others waited in all_reduce(float32, sum, count=48) 'ddp bucket 1' #7",
        "never entered all_reduce(float32, sum, count=48) 'ddp bucket 1' #7: rank 1",
        "rank 1: no dump", "last completed step: 2", NULL});
}

/* Every phrase below holds under every schedule: rank 1 completed #6
 * (its wait ended) and was killed before #7; rank 0 entered #7 and failed
 * there; rank 2, stopped 1.5 s where the fault strikes, either enters #7
 * and fails there too, or is ended by the teardown before it does and
 * leaves no dump: then it never entered #7 either, and the line says so.
 * (Before: "waited in ... #6" when a survivor failed #6 although rank 1
 * had completed it: shm/wait.c and the doctor's frontier.) */
Test(doctor, killed_rank, .timeout = 90)
{
    doctor_case(FR_T_KILL, 0, 4, (const char *const[]){
        "verdict: DIED: rank 1 was killed by signal 9",
        "stopped first: rank 1 (was killed by signal 9",
        "the others waited in all_reduce(float32, sum, count=48) 'ddp bucket 1' #7",
        "never entered all_reduce(float32, sum, count=48) 'ddp bucket 1' #7: rank",
        "last completed step: 2", NULL});
    /* doctor_case removed the directory: the alternatives are checked on
     * the output it kept */
    const char *never = strstr(doc_last_out, "never entered all_reduce(float32, sum, count=48) "
                                             "'ddp bucket 1' #7: ");
    cr_assert_not_null(never, "%s", doc_last_out);
    never += strlen("never entered all_reduce(float32, sum, count=48) 'ddp bucket 1' #7: ");
    static const char *const ok[] = {
        "rank 1 (a rank without a dump counts as not entered) (ranks 0,2 did)\n",
        "ranks 1,2 (a rank without a dump counts as not entered) (rank 0 did)\n"};
    cr_expect(!strncmp(never, ok[0], strlen(ok[0])) || !strncmp(never, ok[1], strlen(ok[1])),
              "%s", doc_last_out);
}

/* The schedule behind a flaky killed_rank: rank 1 completed collective
 * #6 and was killed before #7; rank 0 entered #7 and failed there; rank 2,
 * slow to finish #6, failed #6 when rank 1 died (its data was complete:
 * shm/wait.c no longer does that, but the doctor must not depend on it).
 * Rank 1 entered #6 (rank 0 completed it), so the collective rank 1
 * never entered is #7, not #6: the records of every survivor decide, not
 * the first unfinished entry of one. */
static void doc_write_dump(const char *dir, int rank, int n_done, const char *failed_label,
                           int failed_count)
{
    char path[256];
    snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, rank);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"version\":1,\"rank\":%d,\"world\":3,\"pid\":%d,\"job\":\"00000000000000aa\","
               "\"backend\":\"shm\",\"trigger\":\"failure\",\"failed\":true,"
               "\"status\":\"PEER_FAILED\",\"reason\":\"all_reduce #%d: rank 1 (pid 101) was killed "
               "by signal 9 (Killed); stopping\",\"last_step\":2,\"ring_size\":2000,"
               "\"next_seq\":%d,\"dump_mono_ns\":9,\"dump_real_ns\":9,\"entries\":[",
            rank, 100 + rank, n_done, n_done + 1);
    for (int i = 0; i <= n_done; i++) {
        int fail = i == n_done;
        fprintf(f, "%s{\"seq\":%d,\"coll\":\"all_reduce\",\"dtype\":\"float32\",\"op\":\"sum\","
                   "\"count\":%d,\"root\":-1,\"label\":\"%s\",\"step\":%d,\"state\":\"%s\","
                   "\"status\":\"%s\",\"t_enqueue_ns\":%d,\"t_start_ns\":%d,\"t_end_ns\":%d}",
                i ? "," : "", i, fail ? failed_count : (int)fr_t_count[i % FR_T_BUCKETS],
                fail ? failed_label : (const char *[]){"ddp bucket 0", "ddp bucket 1",
                                                      "ddp bucket 2"}[i % FR_T_BUCKETS],
                i / FR_T_BUCKETS, fail ? "failed" : "done", fail ? "PEER_FAILED" : "ok",
                1000 + i, 1000 + i, 2000 + i);
    }
    fprintf(f, "]}\n");
    fclose(f);
}

Test(doctor, the_collective_a_dead_rank_never_entered_is_after_the_last_completed, .timeout = 30)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    doc_write_dump(dir, 0, 7, "ddp bucket 1", 48);
    doc_write_dump(dir, 2, 6, "ddp bucket 0", 64);
    char path[128];
    snprintf(path, sizeof path, "%s/launch.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"version\":1,\"job\":\"00000000000000aa\",\"world\":3,\"cause\":\"rank 1 "
               "(pid 101) was killed by signal 9 (Killed)\",\"ranks\":[{\"rank\":0,\"pid\":100,"
               "\"wstatus\":256},{\"rank\":1,\"pid\":101,\"wstatus\":9},{\"rank\":2,\"pid\":102,"
               "\"wstatus\":256}]}\n");
    fclose(f);
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 4, "verdict: DIED: rank 1 was killed by signal 9 (Killed); the others waited in "
                  "all_reduce(float32, sum, count=48) 'ddp bucket 1' #7");
    /* rank 2 failed before #7: it never entered it either, and says so */
    expect(&r, 4, "never entered all_reduce(float32, sum, count=48) 'ddp bucket 1' #7: ranks "
                  "1,2 (a rank without a dump counts as not entered) (rank 0 did)");
    fr_t_rm_dir(dir);
}

Test(doctor, good_run_is_ok, .timeout = 90)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);   /* end-of-run dumps */
    fr_t_job j = {.steps = 3, .fault_rank = -1};
    cr_assert_eq(fr_t_run(3, &j), TDM_STATUS_OK, "%s", tdm_error_message());
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 0, "verdict: OK: 3 rank(s) agree on 9 collective(s), none failed");
    fr_t_rm_dir(dir);
}

/* A directory reused by two jobs (a fixed TANDEM_FR_DUMP, as under
 * mpirun): job 1 (3 ranks, 4 steps) leaves fr_rank_2.json behind, which
 * job 2 (2 ranks, 3 steps) does not overwrite. The doctor reads the
 * newest job only, by the job id in every dump; the old file is named in
 * a note. (Before: "3 rank(s) agree on 12 collective(s)" for a job of 2
 * ranks and 9 collectives.) */
Test(doctor, a_reused_directory_reads_only_the_newest_job, .timeout = 90)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);   /* end-of-run dumps */
    fr_t_job j1 = {.steps = 4, .fault_rank = -1};
    cr_assert_eq(fr_t_run(3, &j1), TDM_STATUS_OK, "%s", tdm_error_message());
    fr_t_job j2 = {.steps = 3, .fault_rank = -1};
    cr_assert_eq(fr_t_run(2, &j2), TDM_STATUS_OK, "%s", tdm_error_message());
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 0, "verdict: OK: 2 rank(s) agree on 9 collective(s), none failed");
    expect(&r, 0, "note: fr_rank_2.json: not used: a dump of another job (job ");
    tdm_json *doc = fr_t_load(dir, 0);
    cr_assert_not_null(doc);
    const tdm_json *job = tdm_json_get(doc, "job");
    cr_expect(job && job->type == TDM_JSON_STRING && strlen(job->str) == 16, "no job id");
    tdm_json_free(doc);
    fr_t_rm_dir(dir);
}

/* A healthy rank left unscheduled for a while (here: stopped for 0.7 s,
 * as a loaded machine may leave it) is waited for, not named: the stall
 * bound of the fr_t jobs must be past it. */
Test(doctor, briefly_paused_rank_is_ok, .timeout = 90)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);   /* end-of-run dumps */
    fr_t_job j = {.steps = 3, .fault_step = 1, .fault_rank = 2, .fault = FR_T_PAUSE};
    cr_assert_eq(fr_t_run(3, &j), TDM_STATUS_OK, "%s", tdm_error_message());
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 0, "verdict: OK: 3 rank(s) agree on 9 collective(s), none failed");
    fr_t_rm_dir(dir);
}

Test(doctor, usage_and_empty_dir, .timeout = 30)
{
    cli_result r;
    CLI(&r, "doctor");
    expect(&r, 2, "usage: tandem doctor DIR");
    CLI(&r, "doctor", "--help");
    expect(&r, 0, "Exit codes (the verdict)");
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    CLI(&r, "doctor", dir);
    expect(&r, 1, "no flight-recorder dump in");
    fr_t_rm_dir(dir);
}

/* --- tandem launch and tandem train write the dumps and print the verdict --- */

#define DOC_TRAIN "train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "1024", \
                  "--batch", "64", "--model", "mlp:784-32-10", "--no-eval", "--quiet",       \
                  "--epochs", "1"

static int doc_has(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

Test(doctor, launch_prints_the_verdict_of_a_killed_rank, .timeout = 120)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    unsetenv("TANDEM_FR_DUMP");            /* the launcher picks --log-dir */
    setenv("TANDEM_DDP_TEST_KILL", "1:5", 1);
    cli_result r;
    CLI(&r, "launch", "-n", "2", "--log-dir", dir, "--", cli_bin(), DOC_TRAIN);
    expect(&r, 1, "tandem launch: doctor: DIED: rank 1 was killed by signal 9 (Killed); "
                  "the others waited in all_reduce(float32, sum, count=");
    expect(&r, 1, "'ddp bucket 0'");
    cr_expect(doc_has(dir, "fr_rank_0.json") && doc_has(dir, "launch.json"));
    cr_expect(!doc_has(dir, "fr_rank_1.json"), "a SIGKILLed rank cannot dump");
    CLI(&r, "doctor", dir);
    expect(&r, 4, "stopped first: rank 1 (was killed by signal 9 (Killed))");
    expect(&r, 4, "last completed step: 4");   /* killed before its 5th */
    cr_expect(!cli_shm_entries());
    fr_t_rm_dir(dir);
}

/* The stopped rank is named after the stall bound; the healthy ones must
 * not be, however loaded the machine: as the fr_t jobs' (1.5 s, stretched
 * under the sanitizers), not the 500 ms these tests had. */
static void doc_stall_ms(void)
{
    char v[32];
    snprintf(v, sizeof v, "%d", tu_scaled_ms(1500));
    setenv("TANDEM_SHM_STALL_MS", v, 1);
}

/* Where phrase first appears in out (fails the test when it does not). */
static const char *doc_at(const char *out, const char *phrase)
{
    const char *p = strstr(out, phrase);
    cr_assert_not_null(p, "output lacks '%s':\n%s", phrase, out);
    return p;
}

/* A stopped rank cannot dump or exit: the verdict comes as soon as the
 * others have (a settled teardown, tools/doctor.h), before the summary
 * that follows the SIGKILL of the stopped rank after the grace period,
 * and is not printed twice. */
Test(doctor, train_prints_the_verdict_of_a_stopped_rank, .timeout = 120)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_DDP_TEST_KILL", "1:3:STOP", 1);
    doc_stall_ms();
    cli_result r;
    CLI(&r, DOC_TRAIN, "--device", "cpu:3");
    expect(&r, 1, "tandem train: doctor: STALLED: rank 1 is stopped (process state T: SIGSTOP "
                  "or job control); the others waited in all_reduce(");
    expect(&r, 1, "tandem train: flight-recorder dumps in /tmp/tdm_fr_test_");
    const char *verdict = doc_at(r.out, "tandem train: doctor: STALLED: rank 1 is stopped");
    const char *teardown = doc_at(r.out, "tandem train: rank 1 is stopped (no dump, no exit of "
                                         "its own): the teardown kills it after its grace");
    const char *summary = doc_at(r.out, "tandem train: ddp: ");
    cr_expect(verdict < teardown && teardown < summary,
              "the verdict must come before the stopped rank is killed:\n%s", r.out);
    cr_expect(!strstr(strchr(verdict, '\n'), "doctor:"), "the verdict was printed twice:\n%s",
              r.out);
    cr_expect(doc_has(dir, "fr_rank_0.json") && doc_has(dir, "fr_rank_2.json") &&
              doc_has(dir, "launch.json"));
    /* the summary says the teardown ended the stopped rank (and that it
     * had stalled), as tandem launch's does */
    char path[128], sum[4096] = "";
    snprintf(path, sizeof path, "%s/launch.json", dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    size_t got = fread(sum, 1, sizeof sum - 1, f);
    sum[got] = 0;
    fclose(f);
    const char *r1 = strstr(sum, "{\"rank\":1,");
    cr_expect(r1 && strstr(r1, "\"induced\":true,\"stalled\":true"),
              "rank 1 not marked ended by the teardown:\n%s", sum);
    cr_expect(!cli_shm_entries());
    fr_t_rm_dir(dir);
}

/* A stopped rank found by the others' timeout rather than by the stall
 * bound (--timeout 3 against the 3 s default bound: either may come
 * first): it is STALLED before and after the teardown kills it, never
 * "DIED" (the SIGKILL was the teardown's, not how it failed). */
Test(doctor, a_stopped_rank_is_stalled_before_and_after_the_teardown, .timeout = 120)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_DDP_TEST_KILL", "1:3:STOP", 1);
    unsetenv("TANDEM_SHM_STALL_MS");
    cli_result r;
    CLI(&r, DOC_TRAIN, "--device", "cpu:2", "--timeout", "3");
    expect(&r, 1, "tandem train: doctor: STALLED: rank 1 ");
    cr_expect(!strstr(r.out, "DIED"), "a stopped rank called dead:\n%s", r.out);
    cr_expect(!cli_shm_entries());
    fr_t_rm_dir(dir);
}

Test(doctor, launch_prints_the_verdict_of_a_stopped_rank_before_killing_it, .timeout = 120)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    unsetenv("TANDEM_FR_DUMP");            /* the launcher picks --log-dir */
    setenv("TANDEM_DDP_TEST_KILL", "1:3:STOP", 1);
    doc_stall_ms();
    cli_result r;
    CLI(&r, "launch", "-n", "2", "--log-dir", dir, "--", cli_bin(), DOC_TRAIN);
    const char *verdict = doc_at(r.out, "tandem launch: doctor: STALLED: rank 1 is stopped "
                                        "(process state T: SIGSTOP or job control); the "
                                        "others waited in all_reduce(");
    const char *summary = doc_at(r.out, "; stopped the other ranks (");
    cr_expect(verdict < summary, "the verdict must come before the stopped rank is killed:\n%s",
              r.out);
    cr_expect(!strstr(strchr(verdict, '\n'), "doctor:"), "the verdict was printed twice:\n%s",
              r.out);
    expect(&r, 1, "tandem launch: flight-recorder dumps in ");
    /* the summary after the teardown has the stopped rank's end */
    CLI(&r, "doctor", dir);
    expect(&r, 5, "rank 1: no dump; was killed by signal 9 (Killed) (by the launcher's "
                  "teardown)");
    cr_expect(!cli_shm_entries());
    fr_t_rm_dir(dir);
}

/* tandem train --mode fsdp too: the ranks dump, the verdict names the
 * killed rank and what the others waited in (a labelled FSDP collective). */
Test(doctor, train_fsdp_prints_the_verdict_of_a_killed_rank, .timeout = 120)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_DDP_TEST_KILL", "1:3", 1);
    cli_result r;
    CLI(&r, "train", "--mode", "fsdp", "--data", "synthetic", "--synthetic-size", "1024",
        "--batch", "64", "--model", "mlp:784-32-10", "--no-eval", "--quiet", "--epochs", "1",
        "--device", "cpu:3");
    expect(&r, 1, "tandem train: doctor: DIED: rank 1 ");
    expect(&r, 1, "'fsdp ");
    expect(&r, 1, "tandem train: fsdp: ");
    expect(&r, 1, "tandem train: flight-recorder dumps in /tmp/tdm_fr_test_");
    cr_expect(doc_has(dir, "fr_rank_0.json") && doc_has(dir, "fr_rank_2.json") &&
              doc_has(dir, "launch.json"));
    cr_expect(!cli_shm_entries());
    /* FSDP tells its communicator the steps, as DDP does: killed before
     * its 3rd step, 2 were completed (it said 0) */
    CLI(&r, "doctor", dir);
    expect(&r, 4, "last completed step: 2 (every rank with a dump)");
    fr_t_rm_dir(dir);
}

/* A dump directory another user can write to is refused before any rank
 * starts (the rule of --log-dir): the launcher would write its summary
 * there and read the verdict from there, where a planted fr_rank_1.json
 * (here a desync labelled 'evil') steered or hung the diagnosis. */
Test(doctor, train_and_launch_refuse_a_dump_directory_others_can_write, .timeout = 120)
{
    char dir[64], path[128];
    fr_t_dump_dir(dir, sizeof dir);
    cr_assert_eq(chmod(dir, 0777), 0);
    snprintf(path, sizeof path, "%s/fr_rank_1.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"version\":1,\"rank\":1,\"world\":2,\"next_seq\":1,\"entries\":[{\"seq\":0,"
               "\"coll\":\"broadcast\",\"label\":\"evil\"}]}\n");
    fclose(f);
    setenv("TANDEM_DDP_TEST_KILL", "1:3", 1);
    cli_result r;
    CLI(&r, DOC_TRAIN, "--device", "cpu:2");
    expect(&r, 2, "tandem train: TANDEM_FR_DUMP ");
    expect(&r, 2, "writable by others");
    cr_expect(!strstr(r.out, "evil"), "%s", r.out);
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), DOC_TRAIN);
    expect(&r, 2, "tandem launch: TANDEM_FR_DUMP ");
    cr_expect(!doc_has(dir, "launch.json"), "the summary was written there");
    cr_expect(!doc_has(dir, "fr_rank_0.json"), "a rank dumped there");
    fr_t_rm_dir(dir);
}

/* A good run leaves nothing: the launcher's own directory is removed. */
Test(doctor, good_runs_leave_no_dump_directory, .timeout = 120)
{
    char tmp[64];
    fr_t_dump_dir(tmp, sizeof tmp);
    unsetenv("TANDEM_FR_DUMP");
    setenv("TMPDIR", tmp, 1);
    cli_result r;
    CLI(&r, DOC_TRAIN, "--device", "cpu:2");
    expect(&r, 0, NULL);
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), DOC_TRAIN);
    expect(&r, 0, NULL);
    DIR *d = opendir(tmp);
    cr_assert_not_null(d);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(d))) n += de->d_name[0] != '.';
    closedir(d);
    cr_expect_eq(n, 0, "left %d entries in %s", n, tmp);
    fr_t_rm_dir(tmp);
}

/* A program without a communicator leaves no dump: the launcher's summary
 * alone still gives the verdict. */
Test(doctor, summary_alone_names_the_rank, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    unsetenv("TANDEM_FR_DUMP");
    cli_result r;
    CLI(&r, "launch", "-n", "2", "--log-dir", dir, "--", "sh", "-c",
        "if [ $RANK = 1 ]; then exit 3; fi; exec sleep 20");
    expect(&r, 1, "tandem launch: doctor: DIED: rank 1 exited with code 3");
    CLI(&r, "doctor", dir);
    expect(&r, 4, "rank 0: no dump; was killed by signal 15 (Terminated) (by the launcher's "
                  "teardown)");
    expect(&r, 4, "last completed step: unknown (no dump)");
    fr_t_rm_dir(dir);
}

/* A deadline that came before the waiter ever sampled the peer's
 * heartbeat says "whose heartbeat has stopped" (shm/wait.c): it proves
 * nothing about the peer, which is not blamed for it; "has not advanced
 * for X s" (a beat seen standing still) is what names it STALLED. */
Test(doctor, an_unsampled_heartbeat_blames_no_one, .timeout = 60)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    static const char *const cause[] = {
        "rank 0 timed out after 50 ms in all_reduce #3 waiting for rank 1 (pid 101), whose "
        "heartbeat has stopped",
        "rank 0 timed out after 3000 ms in all_reduce #3 waiting for rank 1 (pid 101), whose "
        "heartbeat has not advanced for 3.0 s: it is stopped, frozen or starved of CPU"};
    for (int k = 0; k < 2; k++) {
        char path[128];
        snprintf(path, sizeof path, "%s/launch.json", dir);
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f);
        fprintf(f, "{\"version\":1,\"job\":\"00000000000000ab\",\"world\":2,\"cause\":\"%s\","
                   "\"ranks\":[{\"rank\":0,\"pid\":100,\"wstatus\":256},{\"rank\":1,\"pid\":101,"
                   "\"wstatus\":256}]}\n", cause[k]);
        fclose(f);
        cli_result r;
        CLI(&r, "doctor", dir);
        if (k == 0)
            cr_expect(!strstr(r.out, "rank 1 was not heard from"), "blamed on an unsampled "
                      "heartbeat:\n%s", r.out);
        else
            cr_expect(strstr(r.out, "verdict: STALLED: rank 1 was not heard from"), "%s", r.out);
    }
    fr_t_rm_dir(dir);
}

/* An MPI job under mpirun (no launcher summary) whose rank 1 was stopped
 * with the job's heartbeats off: rank 0's collective timed out and it
 * dumped; rank 1, stopped, wrote nothing before mpirun's teardown killed
 * it. Under load the teardown's SIGKILL often comes before a stopped
 * rank, sent SIGCONT and SIGTERM, could dump: the others' timeout is then
 * the evidence, and it says the missing rank did not take part while
 * alive, so it is STALLED, not DIED (test_mpi_fr's
 * a_timed_out_wait_dumps_before_the_abort_mpi saw "DIED: rank 1 left no
 * dump" under load). */
Test(doctor, a_rank_without_a_dump_the_others_timed_out_on_is_stalled, .timeout = 30)
{
    char dir[64], path[128];
    fr_t_dump_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/fr_rank_0.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"version\":1,\"rank\":0,\"world\":2,\"pid\":100,\"job\":\"00000000000000ac\","
               "\"backend\":\"mpi\",\"trigger\":\"failure\",\"failed\":true,\"status\":\"TIMEOUT\","
               "\"reason\":\"timeout: mpi: all_reduce #6 (float32, count=48) on rank 0 of 2 did "
               "not complete within 4000 ms (a peer died, stalled or issued a different call)\","
               "\"last_step\":2,\"ring_size\":2000,\"next_seq\":7,\"dump_mono_ns\":9,"
               "\"dump_real_ns\":9,\"entries\":[");
    for (int i = 0; i <= 6; i++)
        fprintf(f, "%s{\"seq\":%d,\"coll\":\"all_reduce\",\"dtype\":\"float32\",\"op\":\"sum\","
                   "\"count\":48,\"root\":-1,\"label\":\"ddp bucket 0\",\"step\":%d,\"state\":"
                   "\"%s\",\"status\":\"%s\",\"t_enqueue_ns\":%d,\"t_start_ns\":%d,"
                   "\"t_end_ns\":%d}", i ? "," : "", i, i / 3, i == 6 ? "failed" : "done",
                i == 6 ? "TIMEOUT" : "ok", 1000 + i, 1000 + i, 2000 + i);
    fprintf(f, "]}\n");
    fclose(f);
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, 5, "verdict: STALLED: rank 1 ");
    expect(&r, 5, "the others timed out waiting");
    fr_t_rm_dir(dir);
}
