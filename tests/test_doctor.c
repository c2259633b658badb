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

static void doctor_case(fr_t_fault fault, int expect_ok, int code, const char *const *phrases)
{
    char dir[64];
    fr_t_dump_dir(dir, sizeof dir);
    setenv("TANDEM_FR_DUMP_ON", "failure", 1);
    fr_t_job j = {.steps = 4, .fault_step = 2, .fault_rank = 1, .fault = fault};
    tdm_status st = fr_t_run(3, &j);
    if (expect_ok) cr_assert_eq(st, TDM_STATUS_OK, "%s", tdm_error_message());
    else cr_assert_neq(st, TDM_STATUS_OK, "the fault went unnoticed");
    cli_result r;
    CLI(&r, "doctor", dir);
    expect(&r, code, "verdict: ");
    if (getenv("TDM_TEST_SHOW")) fprintf(stderr, "%s", r.out);   /* to read the wording */
    for (int i = 0; phrases[i]; i++)
        cr_expect(strstr(r.out, phrases[i]), "doctor's output lacks '%s':\n%s", phrases[i], r.out);
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

Test(doctor, stalled_rank, .timeout = 90)
{
    doctor_case(FR_T_STOP, 0, 5, (const char *const[]){
        "verdict: STALLED: rank 1 is stopped",
        "stopped first: rank 1 (is stopped",
        "the others waited in all_reduce(float32, sum, count=48) 'ddp bucket 1' #7",
        "never entered all_reduce(float32, sum, count=48) 'ddp bucket 1' #7: rank 1",
        "rank 1: no dump", "last completed step: 2", NULL});
}

Test(doctor, killed_rank, .timeout = 90)
{
    doctor_case(FR_T_KILL, 0, 4, (const char *const[]){
        "verdict: DIED: rank 1 was killed by signal 9",
        "stopped first: rank 1 (was killed by signal 9",
        "the others waited in all_reduce(float32, sum, count=48) 'ddp bucket 1' #7",
        "never entered all_reduce(float32, sum, count=48) 'ddp bucket 1' #7: rank 1",
        "last completed step: 2", NULL});
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
