/* tests/test_elastic.c: elastic restarts (tools/elastic.h). A DDP run
 * whose rank 2 is SIGKILLed at step 40 (epoch 2 of 3) and restarted once
 * from its epoch-1 checkpoint ends with the same checkpoint, bit for bit,
 * as an uninterrupted run: forked by tandem train and launched by tandem
 * launch; and likewise a gpt forked by tandem train. The budget is kept (K restarts, then exit 1,
 * saying the restarts are used up and what failed each time), and a signal to
 * the launcher is never restarted. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/cli_util.h"

#define EL_TRAIN "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "2048", "--batch", \
                 "64", "--model", "mlp:784-64-10", "--no-eval", "--quiet", "--epochs", "3"

static void el_dir(char *dir)
{
    strcpy(dir, "/tmp/tdm_elastic_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    setenv("TMPDIR", dir, 1);   /* the failed attempt's dumps land here */
}

static void el_rm(const char *dir)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

Test(elastic, train_restart_after_sigkill_is_bit_identical, .timeout = 240)
{
    char dir[64], straight[128], restarted[128];
    el_dir(dir);
    snprintf(straight, sizeof straight, "%s/straight.safetensors", dir);
    snprintf(restarted, sizeof restarted, "%s/restarted.safetensors", dir);
    cli_result r;
    /* one run id for both: their checkpoints must be the same bytes (the
     * "run" metadata included) */
    setenv("TANDEM_RUN_ID", "00000000000000e1", 1);
    CLI(&r, "train", EL_TRAIN, "--device", "cpu:3", "--save", straight);
    expect(&r, 0, NULL);
    setenv("TANDEM_DDP_TEST_KILL", "2:40", 1);
    CLI(&r, "train", EL_TRAIN, "--device", "cpu:3", "--save", restarted, "--max-restarts", "2");
    expect(&r, 0, "tandem train: restart 1 of 2 after 200 ms: rank 2 (pid ");
    expect(&r, 0, "was killed by signal 9 (Killed); every rank starts again from ");
    expect(&r, 0, "(epoch 1, step 32)");
    expect(&r, 0, "epoch 3/3: train loss");
    cr_expect(!strstr(r.out, "restart 2 of 2"), "%s", r.out);
    cr_expect(cli_same_file(straight, restarted),
              "the restarted run's parameters differ from the uninterrupted run's");
    cr_expect(!cli_shm_entries());
    el_rm(dir);
}

/* --model gpt: its ranks are forked by tools/train_text.c, through the
 * same restart loop; 4 steps an epoch, rank 1 killed before step 6. */
Test(elastic, gpt_train_restart_after_sigkill_is_bit_identical, .timeout = 240)
{
    char dir[64], text[128], straight[128], restarted[128];
    el_dir(dir);
    snprintf(text, sizeof text, "%s/text.txt", dir);
    snprintf(straight, sizeof straight, "%s/straight.safetensors", dir);
    snprintf(restarted, sizeof restarted, "%s/restarted.safetensors", dir);
    cli_write_words(text);
#define EL_GPT "train", "--model", "gpt:2-16-2-24", "--data", text, "--mode", "ddp", \
               "--device", "cpu:3", "--epochs", "3", "--max-steps", "4", "--batch", "6", \
               "--lr", "0.01", "--no-eval", "--quiet"
    cli_result r;
    /* one run id for both: their checkpoints must be the same bytes (the
     * "run" metadata included) */
    setenv("TANDEM_RUN_ID", "00000000000000e1", 1);
    CLI(&r, EL_GPT, "--save", straight);
    expect(&r, 0, NULL);
    setenv("TANDEM_DDP_TEST_KILL", "1:6", 1);
    CLI(&r, EL_GPT, "--save", restarted, "--max-restarts", "1");
    expect(&r, 0, "tandem train: rank 1: test fault: SIGKILL before step 6");
    expect(&r, 0, "tandem train: restart 1 of 1 after 200 ms: rank 1 (pid ");
    expect(&r, 0, "every rank starts again from ");
    expect(&r, 0, "(epoch 1, step 4)");
    expect(&r, 0, "resumed");
    expect(&r, 0, "epoch 3/3: train loss");
#undef EL_GPT
    cr_expect(cli_same_file(straight, restarted),
              "the restarted gpt's parameters differ from the uninterrupted run's");
    cr_expect(!cli_shm_entries());
    el_rm(dir);
}

Test(elastic, launch_restart_after_sigkill_is_bit_identical, .timeout = 240)
{
    char dir[64], straight[128], restarted[128];
    el_dir(dir);
    snprintf(straight, sizeof straight, "%s/straight.safetensors", dir);
    snprintf(restarted, sizeof restarted, "%s/restarted.safetensors", dir);
    cli_result r;
    /* one run id for both: their checkpoints must be the same bytes (the
     * "run" metadata included) */
    setenv("TANDEM_RUN_ID", "00000000000000e1", 1);
    CLI(&r, "train", EL_TRAIN, "--device", "cpu:3", "--save", straight);
    expect(&r, 0, NULL);
    setenv("TANDEM_DDP_TEST_KILL", "2:40", 1);
    CLI(&r, "launch", "-n", "3", "--max-restarts", "1", "--checkpoint", restarted, "--",
        cli_bin(), "train", EL_TRAIN, "--save", restarted);
    expect(&r, 0, "tandem launch: restart 1 of 1 after 200 ms: rank 2 (pid ");
    char want[256];
    snprintf(want, sizeof want, "every rank starts again from %s (epoch 1, step 32)", restarted);
    expect(&r, 0, want);
    expect(&r, 0, "[rank 0] resumed ");
    cr_expect(cli_same_file(straight, restarted),
              "the restarted run's parameters differ from the uninterrupted run's");
    cr_expect(!cli_shm_entries());
    el_rm(dir);
}

/* Run A (seed 7) leaves ck.st; run B (seed 1, same --save) loses a rank
 * at step 3, before its own first save. B must not resume from A's file
 * (it did: "starts again from ck.st (epoch 2, step 64)", then "nothing
 * to do", exit 0, and A's bytes were B's result): it starts again from
 * the start, says why, and ends with what an uninterrupted B writes. The
 * same under tandem launch --checkpoint. */
#define EL_SHORT "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "2048", "--batch", \
                 "64", "--model", "mlp:784-64-10", "--no-eval", "--quiet", "--epochs", "2", \
                 "--device", "cpu:3"

Test(elastic, a_restart_never_resumes_another_runs_checkpoint, .timeout = 240)
{
    char dir[64], ck[128], straight[128];
    el_dir(dir);
    snprintf(ck, sizeof ck, "%s/ck.st", dir);
    snprintf(straight, sizeof straight, "%s/straight.st", dir);
    cli_result r;
    setenv("TANDEM_RUN_ID", "00000000000000a1", 1);   /* run A */
    CLI(&r, "train", EL_SHORT, "--seed", "7", "--save", ck);
    expect(&r, 0, NULL);
    setenv("TANDEM_RUN_ID", "00000000000000b2", 1);   /* B, and B uninterrupted */
    CLI(&r, "train", EL_SHORT, "--seed", "1", "--save", straight);
    expect(&r, 0, NULL);
    setenv("TANDEM_DDP_TEST_KILL", "1:3", 1);
    CLI(&r, "train", EL_SHORT, "--seed", "1", "--save", ck, "--max-restarts", "1");
    expect(&r, 0, "tandem train: restart 1 of 1 after 200 ms: rank 1 (pid ");
    expect(&r, 0, "every rank starts again from the start: ");
    expect(&r, 0, "ck.st holds another run's checkpoint (run 00000000000000a1), not one this job "
                  "wrote (this job failed before its first save)");
    expect(&r, 0, "epoch 2/2: train loss");
    cr_expect(!strstr(r.out, "nothing to do"), "%s", r.out);
    cr_expect(cli_same_file(straight, ck), "run B ended with another run's checkpoint:\n%s",
              r.out);
    unsetenv("TANDEM_DDP_TEST_KILL");
    /* launched: the ranks' own --save and the launcher's --checkpoint */
    setenv("TANDEM_RUN_ID", "00000000000000a1", 1);
    CLI(&r, "train", EL_SHORT, "--seed", "7", "--save", ck);
    expect(&r, 0, NULL);
    setenv("TANDEM_RUN_ID", "00000000000000b2", 1);
    setenv("TANDEM_DDP_TEST_KILL", "1:3", 1);
    CLI(&r, "launch", "-n", "3", "--max-restarts", "1", "--checkpoint", ck, "--", cli_bin(),
        "train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "2048", "--batch",
        "64", "--model", "mlp:784-64-10", "--no-eval", "--quiet", "--epochs", "2", "--seed", "1",
        "--save", ck);
    expect(&r, 0, "tandem launch: restart 1 of 1 after 200 ms: rank 1 (pid ");
    expect(&r, 0, "every rank starts again from the start: ");
    expect(&r, 0, "holds another run's checkpoint (run 00000000000000a1)");
    cr_expect(!strstr(r.out, "resumed"), "%s", r.out);
    cr_expect(cli_same_file(straight, ck), "launched run B ended with another run's "
              "checkpoint:\n%s", r.out);
    cr_expect(!cli_shm_entries());
    el_rm(dir);
}

Test(elastic, budget_is_kept, .timeout = 120)
{
    char dir[64];
    el_dir(dir);
    cli_result r;
    CLI(&r, "launch", "-n", "2", "--max-restarts", "2", "--", "false");
    expect(&r, 1, "restart 1 of 2");
    expect(&r, 1, "restart 2 of 2");
    cr_expect(!strstr(r.out, "restart 3"), "%s", r.out);
    CLI(&r, "launch", "-n", "2", "--", "false");
    expect(&r, 1, NULL);
    cr_expect(!strstr(r.out, "restart"), "%s", r.out);
    CLI(&r, "launch", "-n", "2", "--max-restarts", "x", "--", "true");
    expect(&r, 2, "--max-restarts");
    CLI(&r, "train", "--mode", "single", "--max-restarts", "1");
    expect(&r, 2, "--max-restarts applies to --mode ddp");
    el_rm(dir);
}

/* Ctrl-C reaches the launcher: it stops the ranks and is not restarted. */
Test(elastic, a_signal_to_the_launcher_is_never_restarted, .timeout = 60)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        execl(cli_bin(), cli_bin(), "launch", "-n", "2", "--max-restarts", "3", "--", "sh",
              "-c", "echo started; exec sleep 30", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    /* a rank's line means the launcher's handlers are in place (they are
     * installed before the ranks are forked; a slow start, under ASan,
     * must not see the default SIGINT) */
    char out[8192];
    size_t len = 0;
    ssize_t k;
    int sent = 0;
    while ((k = read(fds[0], out + len, sizeof out - 1 - len)) > 0) {
        len += (size_t)k;
        out[len] = 0;
        if (!sent && strstr(out, "] started")) {
            kill(pid, SIGINT);
            sent = 1;
        }
    }
    cr_expect(sent, "the ranks never started: %s", out);
    out[len] = 0;
    close(fds[0]);
    int ws;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    cr_expect(WIFEXITED(ws) && WEXITSTATUS(ws) == 128 + SIGINT, "status 0x%x: %s", ws, out);
    cr_expect(!strstr(out, "restart"), "%s", out);
}

/* --max-restarts restarts the ranks tandem train forks itself: ranks that a
 * launcher started (tandem launch, mpirun) are not restarted by it, and the
 * user is told so instead of the option being dropped in silence. */
Test(elastic, train_under_a_launcher_says_who_restarts, .timeout = 120)
{
    cli_result r;
    CLI(&r, "launch", "-n", "2", "--", cli_bin(), "train", EL_TRAIN, "--device", "cpu",
        "--epochs", "1", "--max-restarts", "2");
    expect(&r, 0, "--max-restarts restarts the ranks tandem train forks itself");
}

/* Restarts that run out end with one line saying so and what failed each
 * time (before: exit 1 after the last restart's summary, with nothing
 * saying that the budget was spent). A launched rank that fails every
 * attempt, and a forked DDP job that diverges every attempt. */
Test(elastic, restarts_used_up_are_said_with_each_failure, .timeout = 180)
{
    char dir[64];
    el_dir(dir);
    static cli_result r;
    CLI(&r, "launch", "-n", "2", "--max-restarts", "2", "--", "sh", "-c",
        "[ $RANK = 1 ] && exit 3; sleep 5");
    expect(&r, 1, "tandem launch: the 2 restarts are used up, every attempt failed: attempt 1: "
                  "rank 1 (pid ");
    expect(&r, 1, "; attempt 2: rank 1 (pid ");
    expect(&r, 1, "; attempt 3: rank 1 (pid ");
    cr_assert(!strstr(r.out, "attempt 4"), "%s", r.out);
    CLI(&r, "train", "--mode", "ddp", "--device", "cpu:2", "--data", "synthetic",
        "--synthetic-size", "512", "--batch", "64", "--model", "mlp:784-16-10", "--epochs", "2",
        "--lr", "1000", "--quiet", "--no-eval", "--max-restarts", "1");
    expect(&r, 1, "tandem train: restart 1 of 1");
    expect(&r, 1, "tandem train: the 1 restart is used up, every attempt failed: attempt 1: ");
    expect(&r, 1, "loss is NaN at step");
    expect(&r, 1, "; attempt 2: ");
    /* a job that did not ask for restarts says nothing of them */
    CLI(&r, "launch", "-n", "2", "--", "false");
    expect(&r, 1, NULL);
    cr_assert(!strstr(r.out, "used up"), "%s", r.out);
    el_rm(dir);
}
