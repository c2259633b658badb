/* tests/test_check_layers.c: tools/check-layers.sh (`make check-layers`,
 * run first by `make test`) passes on this tree and fails, naming the file,
 * the line and the rule, on every kind of wrong-way include planted in a
 * copy of it: one design including another, core/ or models/ or shm/
 * reaching up, a CUDA or MPI header outside cuda/ or mpi/, a public header
 * including an *_impl.h or missing its extern "C" guards, an example using
 * an internal header, the folders still to come (dist/ pp/ tp/ rpc/ ps/),
 * and a folder with no rule at all. Run from the source tree's root, as
 * `make test` does. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "tests/test_util.h"

static char out[1 << 16];

/* Runs the script on root; its output in out, its exit status returned. */
static int check_layers(const char *root)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "sh tools/check-layers.sh '%s' 2>&1", root);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int ws = pclose(p);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128;
}

/* The test's copy of the tree, removed by .fini even when an assertion
 * ends the test early. */
static char copy_dir[160];
static void remove_copy(void)
{
    tu_rmtree(copy_dir);
    copy_dir[0] = '\0';
}

/* A copy of the tree's sources (the folders the script reads) in dir. */
static void copy_tree(char *dir, size_t len)
{
    tu_mkdtemp(dir, len, "layers");
    snprintf(copy_dir, sizeof copy_dir, "%s", dir);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "tar -cf - --exclude='./build*' --exclude='./.*' --exclude='*.o' --exclude='*.d' "
             "$(ls -d */ | grep -v '^build') | tar -xf - -C '%s'", dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

static char *slurp(const char *path, long *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    rewind(f);
    char *s = tu_malloc((size_t)*len + 1);
    cr_assert_eq(fread(s, 1, (size_t)*len, f), (size_t)*len);
    s[*len] = '\0';
    fclose(f);
    return s;
}

static void spit(const char *path, const char *s, size_t len)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(s, 1, len, f), len);
    fclose(f);
}

static void spits(const char *path, const char *s) { spit(path, s, strlen(s)); }

/* Runs the script on dir and expects it to fail with a line that begins
 * with head and names rule; what: the planted fault, for the messages. */
static void expect_line(const char *dir, const char *head, const char *rule, const char *what)
{
    int rc = check_layers(dir);
    cr_assert_eq(rc, 1, "%s: check-layers exited %d:\n%s", what, rc, out);
    size_t hl = strlen(head);
    const char *hit = NULL;
    for (const char *l = out; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL)
        if (!strncmp(l, head, hl)) {
            hit = l;
            break;
        }
    cr_assert_not_null(hit, "%s: no line beginning `%s`:\n%s", what, head, out);
    const char *eol = strchr(hit, '\n');
    int n = eol ? (int)(eol - hit) : (int)strlen(hit);
    char *one = tu_malloc((size_t)n + 1);
    memcpy(one, hit, (size_t)n);
    cr_assert(strstr(one, rule), "%s: the line does not name the rule `%s`:\n%s", what, rule, one);
    free(one);
}

/* Appends `line` to dir/file (made, with its folder, when absent), expects
 * the script to fail with "file:N: <starts>..." (N: the planted line)
 * naming rule, then puts the file back as it was. */
static void expect_caught(const char *dir, const char *file, const char *line, const char *starts,
                          const char *rule)
{
    char path[512], folder[512], head[640], what[640];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    long len = 0;
    char *orig = slurp(path, &len);
    int lines = 0;
    for (long i = 0; i < len; i++) lines += orig[i] == '\n';
    int unended = orig && len > 0 && orig[len - 1] != '\n';
    if (!orig) {
        snprintf(folder, sizeof folder, "%s", path);
        *strrchr(folder, '/') = '\0';
        mkdir(folder, 0700); /* may exist */
    }
    FILE *f = fopen(path, "ab");
    cr_assert_not_null(f, "%s", path);
    fprintf(f, "%s%s\n", unended ? "\n" : "", line);
    fclose(f);
    snprintf(head, sizeof head, "%s:%d: %s", file, lines + unended + 1, starts);
    snprintf(what, sizeof what, "planted `%s` in %s", line, file);
    expect_line(dir, head, rule, what);
    if (orig)
        spit(path, orig, (size_t)len);
    else
        cr_assert_eq(remove(path), 0, "%s", path);
    free(orig);
}

Test(check_layers, the_tree_keeps_its_layers, .timeout = 60)
{
    int rc = check_layers(".");
    cr_assert_eq(rc, 0, "check-layers fails on this tree (exit %d):\n%s", rc, out);
    cr_assert(strstr(out, "check-layers: ok ("), "%s", out);
}

Test(check_layers, a_design_including_another_fails, .timeout = 120, .fini = remove_copy)
{
    char dir[160];
    copy_tree(dir, sizeof dir);
    const char *designs =
        "the designs (dp ddp fsdp pp tp ps) never include each other; what two need goes down";
    expect_caught(dir, "dp/dp.c", "#include \"ddp/ddp.h\"", "includes \"ddp/ddp.h\": ", designs);
    expect_caught(dir, "fsdp/fsdp.c", "#include \"ddp/ddp.h\"", "includes \"ddp/ddp.h\": ",
                  designs);
    expect_caught(dir, "ddp/ddp.c", "#include \"fsdp/fsdp.h\"", "includes \"fsdp/fsdp.h\": ",
                  designs);
    expect_caught(dir, "ddp/ddp.c", "#include \"dp/dp.h\"", "includes \"dp/dp.h\": ", designs);
    /* relative to the including file, and in a header */
    expect_caught(dir, "dp/pool.c", "#include \"../fsdp/fsdp.h\"",
                  "includes \"../fsdp/fsdp.h\": ", designs);
    expect_caught(dir, "dp/dp.h", "#include \"ddp/ddp.h\"", "includes \"ddp/ddp.h\": ", designs);
}

Test(check_layers, the_folders_still_to_come_have_their_rules, .timeout = 120, .fini = remove_copy)
{
    char dir[160];
    copy_tree(dir, sizeof dir);
    const char *designs = "the designs (dp ddp fsdp pp tp ps) never include each other";
    const char *made[] = {"dist", "pp", "tp", "rpc", "ps"};
    for (size_t i = 0; i < sizeof made / sizeof made[0]; i++)
        cr_assert(mkdir(tu_tpath(dir, made[i]), 0700) == 0 || errno == EEXIST, "%s", made[i]);
    const char guarded[] = "#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
                           "#ifdef __cplusplus\n}\n#endif\n";
    spits(tu_tpath(dir, "dist/t_pg.h"), guarded);
    spits(tu_tpath(dir, "tp/t_tp.h"), guarded);
    spits(tu_tpath(dir, "rpc/t_rpc.h"), guarded);
    spits(tu_tpath(dir, "ps/t_ps.h"), guarded);
    /* what each may use passes */
    spits(tu_tpath(dir, "dist/t_pg.c"),
          "#include \"dist/t_pg.h\"\n#include \"models/model.h\"\n#include \"shm/shm_comm.h\"\n");
    spits(tu_tpath(dir, "pp/t_pp.c"), "#include \"dist/t_pg.h\"\n#include \"models/model.h\"\n");
    spits(tu_tpath(dir, "tp/t_tp.c"), "#include \"dist/t_pg.h\"\n#include \"core/comm.h\"\n");
    spits(tu_tpath(dir, "rpc/t_rpc.c"), "#include \"dist/t_pg.h\"\n#include \"core/comm.h\"\n");
    spits(tu_tpath(dir, "ps/t_ps.c"),
          "#include \"rpc/t_rpc.h\"\n#include \"dist/t_pg.h\"\n#include \"models/model.h\"\n");
    spits(tu_tpath(dir, "ddp/t_dist_user.c"), "#include \"dist/t_pg.h\"\n");
    spits(tu_tpath(dir, "fsdp/t_dist_user.c"), "#include \"dist/t_pg.h\"\n");
    int rc = check_layers(dir);
    cr_assert_eq(rc, 0, "an allowed include of the new folders was refused (exit %d):\n%s", rc,
                 out);
    /* and what each may not */
    expect_caught(dir, "pp/t_pp.c", "#include \"tp/t_tp.h\"", "includes \"tp/t_tp.h\": ", designs);
    expect_caught(dir, "tp/t_tp.c", "#include \"ddp/ddp.h\"", "includes \"ddp/ddp.h\": ", designs);
    expect_caught(dir, "ps/t_ps.c", "#include \"fsdp/fsdp.h\"", "includes \"fsdp/fsdp.h\": ",
                  designs);
    expect_caught(dir, "ddp/ddp.c", "#include \"ps/t_ps.h\"", "includes \"ps/t_ps.h\": ", designs);
    expect_caught(dir, "dist/t_pg.c", "#include \"ddp/ddp.h\"", "includes \"ddp/ddp.h\": ",
                  "dist/ may include only dist/, models/, shm/, core/");
    expect_caught(dir, "dist/t_pg.c", "#include \"rpc/t_rpc.h\"", "includes \"rpc/t_rpc.h\": ",
                  "dist/ may include only dist/, models/, shm/, core/");
    expect_caught(dir, "rpc/t_rpc.c", "#include \"models/model.h\"",
                  "includes \"models/model.h\": ", "rpc/ may include only rpc/, dist/, core/");
    expect_caught(dir, "pp/t_pp.c", "#include \"shm/shm_comm.h\"", "includes \"shm/shm_comm.h\": ",
                  "pp/ may include only pp/, dist/, models/, core/");
    expect_caught(dir, "models/model.c", "#include \"dist/t_pg.h\"", "includes \"dist/t_pg.h\": ",
                  "models know nothing of parallelism");
    expect_caught(dir, "shm/coll.c", "#include \"dist/t_pg.h\"", "includes \"dist/t_pg.h\": ",
                  "shm/ -> core only");
    /* a folder nobody gave a rule */
    cr_assert_eq(mkdir(tu_tpath(dir, "sched"), 0700), 0);
    spits(tu_tpath(dir, "sched/sched.c"), "int tdm_sched_x;\n");
    expect_line(dir, "sched/: a folder of C sources with no layer rule",
                "add it to tools/check-layers.sh", "a new folder sched/");
    cr_assert_eq(remove(tu_tpath(dir, "sched/sched.c")), 0);
}

Test(check_layers, the_lower_floors_reach_nothing_above_them, .timeout = 120, .fini = remove_copy)
{
    char dir[160];
    copy_tree(dir, sizeof dir);
    expect_caught(dir, "core/status.c", "#include \"models/model.h\"",
                  "includes \"models/model.h\": ", "core/ reaches nothing above it");
    expect_caught(dir, "core/comm.h", "#include \"shm/shm_comm.h\"",
                  "includes \"shm/shm_comm.h\": ", "core/ reaches nothing above it");
    expect_caught(dir, "models/model.c", "#include \"dp/dp.h\"", "includes \"dp/dp.h\": ",
                  "models know nothing of parallelism");
    expect_caught(dir, "models/optim.c", "#include \"shm/shm_comm.h\"",
                  "includes \"shm/shm_comm.h\": ", "models/ -> core only");
    expect_caught(dir, "shm/coll.c", "#include \"models/model.h\"", "includes \"models/model.h\": ",
                  "shm/ -> core only: it knows nothing of models or training");
    expect_caught(dir, "cuda/hooks.c", "#include \"models/model.h\"",
                  "includes \"models/model.h\": ", "cuda/ may include only cuda/, core/");
    expect_caught(dir, "mpi/job.c", "#include \"ddp/ddp.h\"", "includes \"ddp/ddp.h\": ",
                  "mpi/ may include only mpi/, shm/, core/");
    expect_caught(dir, "dp/dp.c", "#include \"shm/shm_comm.h\"", "includes \"shm/shm_comm.h\": ",
                  "dp/ may include only dp/, models/, core/");
    expect_caught(dir, "ddp/ddp.c", "#include \"tools/args.h\"", "includes \"tools/args.h\": ",
                  "ddp/ may include only ddp/, dist/, models/, core/");
    /* dist/ reaches cuda/ and mpi/ through their weak headers only */
    expect_caught(dir, "dist/run.c", "#include \"cuda/cuda.h\"", "includes \"cuda/cuda.h\": ",
                  "dist/ may include only dist/, models/, shm/, core/, cuda/cuda_weak.h, "
                  "mpi/mpi_weak.h");
    expect_caught(dir, "dist/mpi_job.c", "#include \"mpi/mpi_comm.h\"",
                  "includes \"mpi/mpi_comm.h\": ", "dist/ may include only");
}

Test(check_layers, cuda_and_mpi_headers_only_in_their_folders, .timeout = 120, .fini = remove_copy)
{
    char dir[160];
    copy_tree(dir, sizeof dir);
    const char *cuda = "only cuda/ includes CUDA, cuBLAS or NCCL headers";
    const char *mpi = "only mpi/ includes mpi.h";
    expect_caught(dir, "tools/info.c", "#include <cuda_runtime_api.h>",
                  "includes <cuda_runtime_api.h>: ", cuda);
    expect_caught(dir, "ddp/ddp.c", "#include <nccl.h>", "includes <nccl.h>: ", cuda);
    expect_caught(dir, "tests/test_core.c", "#include <cublas_v2.h>", "includes <cublas_v2.h>: ",
                  cuda);
    expect_caught(dir, "core/device.c", "#  include \"cuda_runtime.h\"",
                  "includes \"cuda_runtime.h\": ", cuda);
    expect_caught(dir, "dist/mpi_job.c", "#include <mpi.h>", "includes <mpi.h>: ", mpi);
    expect_caught(dir, "shm/coll.c", "#include <mpi.h>", "includes <mpi.h>: ", mpi);
    expect_caught(dir, "tests/test_core.c", "#include \"mpi.h\"", "includes \"mpi.h\": ", mpi);
}

Test(check_layers, public_headers_stay_public, .timeout = 120, .fini = remove_copy)
{
    char dir[160];
    copy_tree(dir, sizeof dir);
    const char *impl = "a public header (installed by make install) includes no *_impl.h";
    expect_caught(dir, "ddp/ddp.h", "#include \"models/model_impl.h\"",
                  "public header includes \"models/model_impl.h\": ", impl);
    expect_caught(dir, "fsdp/fsdp.h", "#include \"fsdp/fsdp_impl.h\"",
                  "public header includes \"fsdp/fsdp_impl.h\": ", impl);
    expect_caught(dir, "examples/ddp_train.c", "#include \"ddp/reducer_impl.h\"",
                  "includes \"ddp/reducer_impl.h\": ",
                  "examples build against the installed headers, which have no *_impl.h");
    /* a public header without extern "C" guards */
    spits(tu_tpath(dir, "models/planted.h"), "int tdm_planted(void);\n");
    expect_line(dir, "models/planted.h: public header without extern \"C\" guards",
                "C++ programs could not link", "a header without guards");
    cr_assert_eq(remove(tu_tpath(dir, "models/planted.h")), 0);
    /* an internal header needs none, and a folder's own _impl.h is its own */
    spits(tu_tpath(dir, "models/planted_impl.h"), "#include \"core/comm_impl.h\"\n");
    int rc = check_layers(dir);
    cr_assert(strstr(out, "planted") == NULL, "an internal header was refused (exit %d):\n%s", rc,
              out);
}
