/* tests/test_shm_named.c: shm segments created and joined by name (for
 * ranks that no tandem process forked, such as an MPI job's ranks on one
 * machine): processes that inherit nothing join by name and compute; the
 * name is gone once they have all attached; and every refusal: a name that
 * exists (O_EXCL), a file that is a symbolic link, not this user's, not
 * mode 0600, not a tandem segment, or of another job. Every test removes
 * what it made; forked children are bounded by alarm(). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "shm/shm_comm.h"

#define JOB 0x1234abcd5678ef01ull

static char name[96];

static void mkname(const char *what)
{
    snprintf(name, sizeof name, "/tandem-test-%d-%s", (int)getpid(), what);
    shm_unlink(name);
}

static int exists(const char *n)
{
    char path[160];
    snprintf(path, sizeof path, "/dev/shm%s", n);
    struct stat sb;
    return lstat(path, &sb) == 0;
}

static void cleanup(void) { shm_unlink(name); }

TestSuite(shm_named, .fini = cleanup, .timeout = 60);

/* A rank that inherited nothing: joins by name, all-reduces, leaves. */
static int child(int rank, int world)
{
    alarm(30);
    tdm_comm *c = NULL;
    tdm_status st = tdm_shm_comm_attach_named(&c, name, rank, world, JOB, NULL);
    if (st) {
        fprintf(stderr, "rank %d: %s\n", rank, tdm_error_message());
        return 1;
    }
    int64_t v = rank + 1, sum = 0;
    st = tdm_comm_all_reduce(c, &v, &sum, 1, TDM_DTYPE_INT64, TDM_REDOP_SUM);
    tdm_comm_free(c);
    return st || sum != (int64_t)world * (world + 1) / 2;
}

Test(shm_named, ranks_join_by_name_and_the_name_goes_once_all_attached)
{
    enum { W = 3 };
    mkname("join");
    tdm_shm_group *g = NULL;
    cr_assert_eq(tdm_shm_group_create_named(&g, name, W, JOB, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    struct stat sb;
    char path[160];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(sb.st_mode & 07777, 0600, "mode %o", sb.st_mode & 07777);
    cr_assert_eq(tdm_shm_group_attached(g), 0);
    pid_t pid[W];
    for (int r = 0; r < W; r++) {
        fflush(NULL);
        pid[r] = fork();
        cr_assert(pid[r] >= 0);
        if (pid[r] == 0) _exit(child(r, W));
    }
    for (int i = 0; i < 3000 && tdm_shm_group_attached(g) < W; i++) usleep(10000);
    cr_assert_eq(tdm_shm_group_attached(g), W);
    for (int r = 0; r < W; r++) cr_assert(tdm_shm_group_rank_attached(g, r));
    /* the last rank to attach removed the name, without the creator */
    for (int i = 0; i < 500 && exists(name); i++) usleep(10000);
    cr_assert(!exists(name), "the name outlived the last attach");
    cr_assert_eq(tdm_shm_unlink_named(name), TDM_STATUS_OK, "gone already: not an error");
    for (int r = 0; r < W; r++) {
        int ws = 0;
        cr_assert_eq(waitpid(pid[r], &ws, 0), pid[r]);
        cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "rank %d: status 0x%x", r, ws);
    }
    tdm_shm_group_free(g);
}

Test(shm_named, a_name_that_exists_is_not_taken_over)
{
    mkname("exists");
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    cr_assert(fd >= 0);
    close(fd);
    tdm_shm_group *g = NULL;
    tdm_status st = tdm_shm_group_create_named(&g, name, 2, JOB, NULL);
    cr_assert_eq(st, TDM_STATUS_MISMATCH);
    cr_assert(strstr(tdm_error_message(), "already exists"), "%s", tdm_error_message());
    cr_assert_null(g);
    cr_assert(exists(name), "someone else's file must stay");
}

/* A segment made right, then changed by test code, refused on attach. */
static void refused(const char *why, tdm_status want, const char *phrase, uint64_t job)
{
    mkname(why);
    tdm_shm_group *g = NULL;
    cr_assert_eq(tdm_shm_group_create_named(&g, name, 2, JOB, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    char path[160];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    if (!strcmp(why, "mode")) cr_assert_eq(chmod(path, 0644), 0);
    if (!strcmp(why, "owner")) cr_assert_eq(chown(path, 65534, 65534), 0, "run as root");
    tdm_comm *c = NULL;
    tdm_status st = tdm_shm_comm_attach_named(&c, name, 0, 2, job, NULL);
    cr_assert_eq(st, want, "%s: %s", tdm_status_name(st), tdm_error_message());
    cr_assert(strstr(tdm_error_message(), phrase), "%s", tdm_error_message());
    cr_assert_null(c);
    cr_assert_eq(tdm_shm_group_attached(g), 0, "a refused rank must not have joined");
    tdm_shm_group_free(g);
}

Test(shm_named, mode_other_than_0600_is_refused)
{
    refused("mode", TDM_STATUS_MISMATCH, "has mode 0644, not 0600", JOB);
}

Test(shm_named, another_owner_is_refused)
{
    if (geteuid() != 0) cr_skip_test("giving the file away needs root");
    refused("owner", TDM_STATUS_MISMATCH, "belongs to uid 65534", JOB);
}

Test(shm_named, another_job_is_refused)
{
    refused("job", TDM_STATUS_MISMATCH, "belongs to job 1234abcd5678ef01, not to this job "
            "(00000000000000aa)", 0xaa);
}

Test(shm_named, a_symbolic_link_is_refused)
{
    mkname("link");
    char target[160], path[160];
    snprintf(target, sizeof target, "/dev/shm%s-target", name);
    snprintf(path, sizeof path, "/dev/shm%s", name);
    int fd = open(target, O_RDWR | O_CREAT | O_EXCL, 0600);
    cr_assert(fd >= 0);
    close(fd);
    cr_assert_eq(symlink(target, path), 0);
    tdm_comm *c = NULL;
    tdm_status st = tdm_shm_comm_attach_named(&c, name, 0, 2, JOB, NULL);
    unlink(target);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert(strstr(tdm_error_message(), "cannot open"), "%s", tdm_error_message());
}

Test(shm_named, a_file_that_is_not_a_segment_is_refused)
{
    mkname("garbage");
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, 8192), 0);
    close(fd);
    tdm_comm *c = NULL;
    tdm_status st = tdm_shm_comm_attach_named(&c, name, 0, 2, JOB, NULL);
    cr_assert_eq(st, TDM_STATUS_FORMAT, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "bad magic"), "%s", tdm_error_message());
}

Test(shm_named, bad_names_are_refused)
{
    tdm_shm_group *g = NULL;
    cr_assert_eq(tdm_shm_group_create_named(&g, "no-slash", 2, JOB, NULL),
                 TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_shm_group_create_named(&g, "/a/b", 2, JOB, NULL), TDM_STATUS_INVALID_ARG);
    tdm_comm *c = NULL;
    cr_assert_eq(tdm_shm_comm_attach_named(&c, "/x", 0, 2, 0, NULL), TDM_STATUS_INVALID_ARG,
                 "a job id is required");
}
