/* tests/test_proc.c: core/proc.h reads another process's /proc/PID/stat:
 * the state letter of a running, a stopped and a zombie child (whose
 * exit code is field 52), a command name holding ") (" that must not
 * shift the fields, and a pid that does not exist (NULL, ENOENT). */
#include <criterion/criterion.h>

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/proc.h"
#include "tests/timeout_util.h"

/* Field k (3 = the state) of the fields tdm_proc_stat returns. */
static const char *field(const char *p, int k)
{
    for (int f = 3; f < k && p; f++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    return p;
}

/* waits (bounded) until pid's state letter is want */
static int state_becomes(pid_t pid, char want)
{
    char buf[1024];
    for (int i = 0; i < 2000 * tu_timeout_scale(); i++) {
        const char *p = tdm_proc_stat(pid, buf, sizeof buf);
        if (p && p[0] == want) return 1;
        usleep(1000);
    }
    return 0;
}

Test(proc, states_of_a_child_stopped_then_a_zombie_with_its_exit_code)
{
    pid_t c = fork();
    cr_assert(c >= 0);
    if (c == 0) {
        prctl(PR_SET_NAME, "a) b (c", 0, 0, 0);   /* a name made to mislead */
        raise(SIGSTOP);
        _exit(7);
    }
    cr_assert(state_becomes(c, 'T'), "the stopped child is not 'T'");
    char buf[1024];
    const char *p = tdm_proc_stat(c, buf, sizeof buf);
    cr_assert(p);
    cr_expect(strstr(buf, "(a) b (c)"), "%s", buf);
    cr_expect_eq(atoi(field(p, 4)), (int)getpid(), "field 4 (ppid) of '%s'", p);
    kill(c, SIGCONT);
    cr_assert(state_becomes(c, 'Z'), "the exited child is not 'Z'");
    p = tdm_proc_stat(c, buf, sizeof buf);
    cr_assert(p);
    const char *code = field(p, 52);
    cr_assert(code, "no field 52 in '%s'", p);
    cr_expect_eq(atoi(code), 7 << 8, "exit_code field: '%s'", code);
    int ws;
    cr_assert_eq(waitpid(c, &ws, 0), c);
    errno = 0;
    cr_expect_null(tdm_proc_stat(c, buf, sizeof buf));
    cr_expect_eq(errno, ENOENT, "errno %d after the child was reaped", errno);
}

Test(proc, this_process_runs_and_bad_arguments_are_refused)
{
    char buf[256];
    const char *p = tdm_proc_stat(getpid(), buf, sizeof buf);
    cr_assert(p);
    cr_expect_eq(p[0], 'R', "this process reads itself running: '%c'", p[0]);
    errno = 0;
    cr_expect_null(tdm_proc_stat(0, buf, sizeof buf));
    cr_expect_eq(errno, EINVAL);
    cr_expect_null(tdm_proc_stat(getpid(), buf, 16));
}
