/* tests/test_safefile.c: the file rules of core/safefile.h, through the
 * writers and readers that use them: another local user (nobody, where the
 * tests run as root) planting a symlink or a world-writable file where a
 * checkpoint's temporary file used to go; a writer killed mid-save leaving
 * no temporary file; FIFOs as inputs and outputs refused without blocking;
 * long names; unsafe directories; streams that refuse links and other
 * users' files. Not a test of what goes in the files. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/data.h"
#include "core/safefile.h"
#include "core/safetensors.h"
#include "tests/safety_util.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void)
{
    tu_mkdtemp(g_dir, sizeof g_dir, "sf");
    /* the second user must reach the shared directories inside */
    cr_assert_eq(chmod(g_dir, 0755), 0);
}
static void teardown(void) { tu_rmtree(g_dir); }

TestSuite(sf, .init = setup, .fini = teardown, .timeout = 60);

static const char *tpath(const char *name) { return tu_tpath(g_dir, name); }

static void mkdir_mode(const char *p, mode_t mode)
{
    cr_assert_eq(mkdir(p, 0700), 0, "%s: %s", p, strerror(errno));
    cr_assert_eq(chmod(p, mode), 0);
}

static tdm_status save_floats(const char *path, size_t n, float fill)
{
    float *v = tu_malloc(n * sizeof *v);
    for (size_t k = 0; k < n; k++) v[k] = fill;
    tdm_st_tensor t = {.name = "w", .dtype = TDM_ST_F32, .ndim = 1, .shape = {(int64_t)n},
                       .data = v, .nbytes = n * sizeof *v};
    tdm_status st = tdm_st_save(path, &t, 1, NULL, 0);
    free(v);
    return st;
}

/* The file at path is a checkpoint holding n copies of fill. */
static void assert_holds(const char *path, size_t n, float fill)
{
    tdm_st_file *f;
    TU_OK(tdm_st_load(&f, path));
    const tdm_st_tensor *t = tdm_st_find(f, "w");
    cr_assert(t && t->nbytes == n * sizeof(float), "%s: wrong tensor", path);
    float v;
    memcpy(&v, (const char *)t->data + t->nbytes - sizeof v, sizeof v);
    cr_assert_eq(v, fill);
    tdm_st_free(f);
}

/* ---- another user plants at the temporary name -------------------------- */

typedef struct plant {
    char at[300], target[300];
    int symlink;    /* else a world-writable empty file */
} plant;

static int do_plant(void *arg)
{
    plant *p = arg;
    if (p->symlink) return symlink(p->target, p->at);
    int fd = open(p->at, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0 || fchmod(fd, 0666) != 0) return -1;
    return close(fd);
}

/* Saving as root into a directory others can write must not write through
 * their symlink (the victim outside is untouched) nor into their file (the
 * checkpoint ends up ours, not theirs): before the fix the temporary file
 * was "<path>.tmp.<pid>", opened O_CREAT | O_TRUNC, and both happened. */
Test(sf, planted_symlink_or_file_at_the_old_temporary_name)
{
    SU_NEED_ROOT();
    char shared[128], priv[128], victim[160], ckpt[160];
    snprintf(shared, sizeof shared, "%s/shared", g_dir);
    snprintf(priv, sizeof priv, "%s/private", g_dir);
    snprintf(victim, sizeof victim, "%s/victim", priv);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt.safetensors", shared);
    mkdir_mode(shared, 0777);   /* like /tmp without the sticky bit */
    mkdir_mode(priv, 0700);
    su_write(victim, "precious\n");
    for (int kind = 0; kind < 2; kind++) {
        plant p = {.symlink = kind == 0};
        snprintf(p.at, sizeof p.at, "%s.tmp.%d", ckpt, (int)getpid());
        snprintf(p.target, sizeof p.target, "%s", victim);
        cr_assert_eq(su_as_nobody(do_plant, &p), 0, "planting %s", p.at);
        struct stat planted;
        cr_assert_eq(lstat(p.at, &planted), 0);
        TU_OK(save_floats(ckpt, 1000, 1.0f + (float)kind));

        char *v = su_slurp(victim, NULL);
        cr_assert_str_eq(v, "precious\n", "the victim outside was overwritten");
        free(v);
        struct stat sb;
        cr_assert_eq(lstat(ckpt, &sb), 0);
        cr_assert(S_ISREG(sb.st_mode), "%s is not a regular file", ckpt);
        cr_assert_eq(sb.st_uid, 0, "the checkpoint belongs to uid %u", (unsigned)sb.st_uid);
        cr_assert_neq(sb.st_ino, planted.st_ino, "the checkpoint is the planted file");
        cr_assert_eq(sb.st_mode & 022, 0, "mode %o", (unsigned)sb.st_mode);
        assert_holds(ckpt, 1000, 1.0f + (float)kind);
        /* what the other user planted is theirs, left as it was */
        struct stat after;
        cr_assert_eq(lstat(p.at, &after), 0);
        cr_assert_eq(after.st_ino, planted.st_ino);
        cr_assert_eq(after.st_size, planted.st_size);
        cr_assert_eq(unlink(p.at), 0);
    }
}

/* The same from the other user's side: a symlink planted at the final name
 * is neither written through nor replaced: the save is refused, saying
 * whose link it is (before: the link was replaced by the checkpoint). */
Test(sf, planted_symlink_at_the_target_is_refused_not_followed)
{
    SU_NEED_ROOT();
    char shared[128], victim[160];
    snprintf(shared, sizeof shared, "%s/shared", g_dir);
    snprintf(victim, sizeof victim, "%s/victim", g_dir);
    mkdir_mode(shared, 01777);
    su_write(victim, "precious\n");
    plant p = {.symlink = 1};
    snprintf(p.at, sizeof p.at, "%s/ckpt.safetensors", shared);
    snprintf(p.target, sizeof p.target, "%s", victim);
    cr_assert_eq(su_as_nobody(do_plant, &p), 0);
    struct stat planted, sb;
    cr_assert_eq(lstat(p.at, &planted), 0);
    cr_assert_eq(save_floats(p.at, 10, 3.0f), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "symbolic link that belongs to uid"), "%s",
              tdm_error_message());
    cr_assert_eq(tdm_file_replace_check(AT_FDCWD, p.at), TDM_STATUS_IO);
    char *v = su_slurp(victim, NULL);
    cr_assert_str_eq(v, "precious\n");
    free(v);
    cr_assert_eq(lstat(p.at, &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode) && sb.st_ino == planted.st_ino, "their link was replaced");
    cr_assert_eq(su_entries(shared, NULL, 0), 1, "a temporary file was left in %s", shared);
}

/* A non-root user cannot replace another user's file in a sticky
 * directory: the check says so before the work (it passed, and the save
 * failed only at the rename). */
static int sticky_refused(void *arg)
{
    tdm_status st = tdm_file_replace_check(AT_FDCWD, arg);
    return st == TDM_STATUS_IO && strstr(tdm_error_message(), "sticky directory") ? 0 : 1;
}

Test(sf, another_users_file_in_a_sticky_directory_is_refused_up_front)
{
    SU_NEED_ROOT();
    char shared[128], path[160];
    snprintf(shared, sizeof shared, "%s/shared", g_dir);
    snprintf(path, sizeof path, "%s/ckpt", shared);
    mkdir_mode(shared, 01777);
    TU_OK(save_floats(path, 4, 1.0f));   /* root's */
    cr_assert_eq(su_as_nobody(sticky_refused, path), 0, "nobody was not told up front");
    assert_holds(path, 4, 1.0f);
}

/* ---- a writer killed mid-save ------------------------------------------- */

/* A child saves a 4 MiB checkpoint over and over and is SIGKILLed at
 * varying moments: the file is always whole, and after the next save the
 * directory holds the checkpoint alone. Before the fix each kill during a
 * write left "<path>.tmp.<pid>" for good. */
Test(sf, killed_writer_leaves_no_temporary_file)
{
    char dir[128], ckpt[160], names[512];
    snprintf(dir, sizeof dir, "%s/k", g_dir);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt.safetensors", dir);
    mkdir_mode(dir, 0755);
    TU_OK(save_floats(ckpt, 1 << 20, 0.0f));
    int litter = 0;
    for (int i = 0; i < 6; i++) {
        pid_t p = fork();
        cr_assert(p >= 0);
        if (p == 0) {
            for (int k = 1;; k++)
                if (save_floats(ckpt, 1 << 20, (float)k) != TDM_STATUS_OK) _exit(1);
        }
        struct timespec ts = {0, (10 + 7 * i) * 1000000L};
        nanosleep(&ts, NULL);
        kill(p, SIGKILL);
        int ws;
        cr_assert_eq(waitpid(p, &ws, 0), p);
        cr_assert(WIFSIGNALED(ws), "the writer failed on its own (exit %d)", WEXITSTATUS(ws));
        tdm_st_file *f;
        TU_OK(tdm_st_load(&f, ckpt));   /* whole, whatever the moment */
        tdm_st_free(f);
        litter += su_entries(dir, names, sizeof names) - 1;
    }
    TU_OK(save_floats(ckpt, 16, 9.0f));
    cr_assert_eq(su_entries(dir, names, sizeof names), 1,
                 "left behind after %d kills (%d temporary files seen): %s", 6, litter, names);
    assert_holds(ckpt, 16, 9.0f);
}

/* ---- FIFOs and other special files -------------------------------------- */

/* Before the fix a FIFO as checkpoint or data blocked in open() forever
 * (this test then ran into its timeout), and saving over one replaced it. */
Test(sf, fifo_as_input_or_output_fails_at_once, .timeout = 20)
{
    const char *fifo = tpath("fifo");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    tdm_st_file *f = NULL;
    tdm_status st = tdm_st_load(&f, fifo);
    cr_assert_eq(st, TDM_STATUS_IO, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "a FIFO, not a regular file"), "%s",
              tdm_error_message());
    cr_assert(strstr(tdm_error_message(), fifo), "%s", tdm_error_message());

    tdm_dataset d;
    st = tdm_data_load_idx(&d, fifo, fifo);
    cr_assert_eq(st, TDM_STATUS_IO, "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "a FIFO"), "%s", tdm_error_message());

    st = save_floats(fifo, 4, 1.0f);
    cr_assert_eq(st, TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "a FIFO, not a regular file"), "%s",
              tdm_error_message());
    struct stat sb;
    cr_assert_eq(lstat(fifo, &sb), 0);
    cr_assert(S_ISFIFO(sb.st_mode), "the FIFO was replaced");
    cr_assert_eq(su_entries(g_dir, NULL, 0), 1);

    st = tdm_st_load(&f, "/dev/null");
    cr_assert_eq(st, TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "a character device"), "%s", tdm_error_message());
    int fd;
    cr_assert_eq(tdm_file_open_write(AT_FDCWD, fifo, TDM_FILE_APPEND, &fd), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "a FIFO"), "%s", tdm_error_message());
}

/* ---- names -------------------------------------------------------------- */

Test(sf, long_names_and_odd_targets)
{
    /* 250 bytes is a valid name; "<name>.tmp.<pid>" was not, so saving
     * failed before the fix */
    char name[300], path[400];
    memset(name, 'n', 250);
    name[250] = '\0';
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    TU_OK(save_floats(path, 8, 2.0f));
    assert_holds(path, 8, 2.0f);
    TU_OK(tdm_file_replace_check(AT_FDCWD, path));
    /* 256 bytes is not, and says so */
    memset(name, 'n', 256);
    name[256] = '\0';
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    cr_assert_eq(tdm_file_replace_check(AT_FDCWD, path), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "longer than the 255"), "%s", tdm_error_message());
    cr_assert_eq(save_floats(path, 8, 2.0f), TDM_STATUS_IO);
    /* a directory, or a path ending in '/' */
    cr_assert_eq(tdm_file_replace_check(AT_FDCWD, g_dir), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "a directory"), "%s", tdm_error_message());
    snprintf(path, sizeof path, "%s/", g_dir);
    cr_assert_eq(tdm_file_replace_check(AT_FDCWD, path), TDM_STATUS_IO);
    cr_assert_eq(tdm_file_replace_check(AT_FDCWD, tpath("no/such/dir/x")), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "No such file"), "%s", tdm_error_message());
    cr_assert_eq(su_entries(g_dir, NULL, 0), 1, "a check left something behind");
    /* a link of ours to a regular file is judged by that file: the file
     * is replaced (atomically, in its own directory), the link kept, also
     * through a chain of links, relative or absolute */
    su_write(tpath("target"), "old\n");
    cr_assert_eq(symlink("target", tpath("link")), 0);
    cr_assert_eq(symlink(tpath("link"), tpath("link2")), 0);
    TU_OK(save_floats(tpath("link2"), 4, 5.0f));
    assert_holds(tpath("target"), 4, 5.0f);
    struct stat sb;
    cr_assert_eq(lstat(tpath("link"), &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode), "the link was replaced");
    cr_assert_eq(lstat(tpath("link2"), &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode), "the link to the link was replaced");
    /* a link of ours to anything else is refused, the link kept */
    cr_assert_eq(mkfifo(tpath("fifo"), 0600), 0);
    const char *odd[][2] = {{"/dev/null", "a character device"}, {"fifo", "a FIFO"},
                            {".", "a directory"}, {"missing", "does not exist"}};
    for (int i = 0; i < 4; i++) {
        unlink(tpath("odd"));
        cr_assert_eq(symlink(odd[i][0], tpath("odd")), 0);
        cr_assert_eq(save_floats(tpath("odd"), 4, 1.0f), TDM_STATUS_IO, "%s", odd[i][0]);
        cr_assert(strstr(tdm_error_message(), odd[i][1]), "%s: %s", odd[i][0],
                  tdm_error_message());
        cr_assert_eq(lstat(tpath("odd"), &sb), 0);
        cr_assert(S_ISLNK(sb.st_mode), "%s: the link was replaced", odd[i][0]);
    }
    cr_assert_eq(lstat(tpath("missing"), &sb), -1, "written through a dangling link");
}

/* The file mode never lets others write, whatever the umask. */
Test(sf, new_files_are_never_writable_by_others)
{
    mode_t old = umask(0);
    TU_OK(save_floats(tpath("a"), 4, 1.0f));
    int fd;
    TU_OK(tdm_file_open_write(AT_FDCWD, tpath("b"), TDM_FILE_TRUNC, &fd));
    close(fd);
    umask(old);
    struct stat sb;
    cr_assert_eq(stat(tpath("a"), &sb), 0);
    cr_assert_eq(sb.st_mode & 022, 0, "mode %o", (unsigned)sb.st_mode);
    cr_assert_eq(stat(tpath("b"), &sb), 0);
    cr_assert_eq(sb.st_mode & 022, 0, "mode %o", (unsigned)sb.st_mode);
}

/* ---- directories -------------------------------------------------------- */

static void expect_unsafe(const char *dir, const char *phrase)
{
    int fd = -1;
    tdm_status st = tdm_dir_open_safe(dir, "--plot", 0, &fd);
    cr_assert_eq(st, TDM_STATUS_INVALID_ARG, "%s accepted (%s)", dir, tdm_error_message());
    cr_assert_eq(fd, -1);
    cr_assert(strstr(tdm_error_message(), phrase), "%s", tdm_error_message());
    cr_assert(strstr(tdm_error_message(), "--plot"), "%s", tdm_error_message());
}

Test(sf, directories_others_can_write_are_refused)
{
    char d[128];
    int fd;
    snprintf(d, sizeof d, "%s/new", g_dir);
    TU_OK(tdm_dir_open_safe(d, "--plot", 1, &fd));   /* created */
    struct stat sb;
    cr_assert_eq(fstat(fd, &sb), 0);
    cr_assert(S_ISDIR(sb.st_mode) && (sb.st_mode & 022) == 0);
    close(fd);
    TU_OK(tdm_dir_open_safe(d, "--plot", 1, &fd));   /* and reused */
    close(fd);
    cr_assert_eq(chmod(d, 0777), 0);
    expect_unsafe(d, "writable by others (mode 0777)");
    expect_unsafe(d, "chmod go-w");
    cr_assert_eq(chmod(d, 01777), 0);
    expect_unsafe(d, "writable by others");
    cr_assert_eq(chmod(d, 0775), 0);
    expect_unsafe(d, "writable by its group");
    cr_assert_eq(chmod(d, 0700), 0);
    /* a link of ours to a safe directory is fine */
    cr_assert_eq(symlink(d, tpath("mylink")), 0);
    TU_OK(tdm_dir_open_safe(tpath("mylink"), "--plot", 0, &fd));
    close(fd);
    /* not a directory */
    su_write(tpath("file"), "x");
    cr_assert_eq(tdm_dir_open_safe(tpath("file"), "--plot", 1, &fd), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "file"), "%s", tdm_error_message());
    cr_assert_eq(tdm_dir_open_safe(tpath("no/such"), "--plot", 1, &fd), TDM_STATUS_IO);
}

static int do_symlink(void *arg)
{
    plant *p = arg;
    return symlink(p->target, p->at);
}

Test(sf, directories_of_another_user_are_refused)
{
    SU_NEED_ROOT();
    uid_t nobody;
    gid_t ngid;
    su_nobody(&nobody, &ngid);
    char d[128];
    snprintf(d, sizeof d, "%s/theirs", g_dir);
    mkdir_mode(d, 0755);
    cr_assert_eq(chown(d, nobody, ngid), 0);
    expect_unsafe(d, "belongs to uid");
    /* their symlink to a directory that looks safe (ours) */
    char shared[128], mine[128];
    snprintf(shared, sizeof shared, "%s/shared", g_dir);
    snprintf(mine, sizeof mine, "%s/mine", g_dir);
    mkdir_mode(shared, 01777);
    mkdir_mode(mine, 0700);
    plant p = {.symlink = 1};
    snprintf(p.at, sizeof p.at, "%s/plots", shared);
    snprintf(p.target, sizeof p.target, "%s", mine);
    cr_assert_eq(su_as_nobody(do_symlink, &p), 0);
    expect_unsafe(p.at, "symbolic link that belongs to uid");
}

/* ---- streams ------------------------------------------------------------ */

Test(sf, streams_refuse_links_and_files_not_ours)
{
    int fd;
    su_write(tpath("victim"), "precious\n");
    cr_assert_eq(symlink(tpath("victim"), tpath("log")), 0);
    cr_assert_eq(tdm_file_open_write(AT_FDCWD, tpath("log"), TDM_FILE_TRUNC, &fd), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "a symbolic link"), "%s", tdm_error_message());
    cr_assert_eq(link(tpath("victim"), tpath("hard")), 0);
    cr_assert_eq(tdm_file_open_write(AT_FDCWD, tpath("hard"), TDM_FILE_TRUNC, &fd), TDM_STATUS_IO);
    cr_assert(strstr(tdm_error_message(), "hard links"), "%s", tdm_error_message());
    char *v = su_slurp(tpath("victim"), NULL);
    cr_assert_str_eq(v, "precious\n");
    free(v);
    /* ours: truncated, or appended to */
    su_write(tpath("own"), "old\n");
    TU_OK(tdm_file_open_write(AT_FDCWD, tpath("own"), TDM_FILE_APPEND, &fd));
    cr_assert_eq(write(fd, "new\n", 4), 4);
    close(fd);
    v = su_slurp(tpath("own"), NULL);
    cr_assert_str_eq(v, "old\nnew\n");
    free(v);
    int dfd;
    TU_OK(tdm_dir_open_safe(g_dir, "--log-dir", 0, &dfd));
    TU_OK(tdm_file_open_write(dfd, "own", TDM_FILE_TRUNC, &fd));
    close(fd);
    close(dfd);
    size_t len;
    free(su_slurp(tpath("own"), &len));
    cr_assert_eq(len, 0);
    if (geteuid() == 0) {
        uid_t nobody;
        gid_t ngid;
        su_nobody(&nobody, &ngid);
        cr_assert_eq(chown(tpath("own"), nobody, ngid), 0);
        cr_assert_eq(tdm_file_open_write(AT_FDCWD, tpath("own"), TDM_FILE_APPEND, &fd),
                     TDM_STATUS_IO);
        cr_assert(strstr(tdm_error_message(), "another user"), "%s", tdm_error_message());
    }
}
