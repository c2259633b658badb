/* tests/test_install.c: `make install` as a user meets it: tools/install.sh
 * puts the CLI, the archives, the public headers (no *_impl.h) and
 * tandem.pc under a prefix, and programs outside the tree build with
 * `pkg-config --cflags --libs tandem` alone and run:
 * - a C program: a host gemm, and, where the CUDA backend is built, a
 *   "cuda" device (emulated here), which only works when the CUDA
 *   archive's registration constructor was linked in; every installed
 *   header compiles on its own, as C and as C++;
 * - a C++ program (tests/cxx_program.cpp, g++): one device and DDP over
 *   two forked ranks, linked through the headers' extern "C" guards;
 * - the two example programs (examples/ddp_train.c, examples/fsdp_train.c)
 *   under the installed `tandem launch -n 2`, their checkpoints loaded
 *   by a single-device model. */
#include <criterion/criterion.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/device.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"
#include "mpi/mpi_weak.h"

static const char prog_src[] =
    "#include <stdio.h>\n"
    "#include \"core/device.h\"\n"
    "#include \"core/status.h\"\n"
    "int main(void)\n"
    "{\n"
    "    tdm_device *d = NULL;\n"
    "    if (tdm_device_open(&d, \"cpu\", 0, 1)) return 3;\n"
    "    float a[4] = {1, 2, 3, 4}, b[4] = {0, 1, 1, 0}, c[4] = {0};\n"
    "    if (tdm_dev_gemm(d, TDM_TRANS_N, TDM_TRANS_N, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2))\n"
    "        return 4;\n"
    "    printf(\"gemm %g %g %g %g\\n\", c[0], c[1], c[2], c[3]);\n"
    "    tdm_device_free(d);\n"
    "    if (tdm_device_open(&d, \"cuda\", 0, 1)) {\n"
    "        printf(\"cuda: %s\\n\", tdm_error_message());\n"
    "        return 0;\n"
    "    }\n"
    "    printf(\"cuda device %s\\n\", tdm_dev_name(d));\n"
    "    tdm_device_free(d);\n"
    "    return 0;\n"
    "}\n"
    "#ifdef TDM_TEST_MPI\n"
    "#include \"mpi/mpi_comm.h\"\n"
    "__attribute__((constructor)) static void mpi_version(void)\n"
    "{\n"
    "    char v[256];\n"
    "    tdm_mpi_library_version(v, sizeof v);\n"
    "    printf(\"mpi: %s\\n\", v);\n"
    "}\n"
    "#endif\n";

static int run(const char *cmd, char *out, size_t len)
{
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    size_t n = fread(out, 1, len - 1, p);
    out[n] = '\0';
    int ws = pclose(p);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128;
}

/* The test's prefix, removed by .fini even when an assertion ends the
 * test early. */
static char dir[192];
static void remove_dir(void)
{
    tu_rmtree(dir);
    dir[0] = '\0';
}

/* A sanitizer build's archives need the sanitizer's runtime: its flags. */
static const char *san;

/* Installs the tree's build (the one whose tandem runs the tests) under
 * dir/usr. */
static void install(void)
{
    const char *bin = getenv("TANDEM_BIN");
    char build[4096], cmd[8192];
    static char out[65536];
    snprintf(build, sizeof build, "%s", bin && *bin ? bin : "build/tandem");
    char *bdir = dirname(build);
    san = strstr(bdir, "-asan") ? "-fsanitize=address,undefined"
          : strstr(bdir, "-tsan") ? "-fsanitize=thread" : "";
    tu_mkdtemp(dir, sizeof dir, "install");
    snprintf(cmd, sizeof cmd, "sh tools/install.sh '%s' '%s/usr' 2>&1", bdir, dir);
    int rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s: %s", cmd, out);
}

/* "PKG_CONFIG_PATH=... pkg-config --cflags --libs tandem" for dir. */
static const char *pkg_config(void)
{
    static char pc[512];
    snprintf(pc, sizeof pc, "$(PKG_CONFIG_PATH='%s/usr/lib/pkgconfig' pkg-config --cflags --libs "
             "tandem)", dir);
    return pc;
}

Test(install, a_program_builds_from_pkg_config_and_runs, .timeout = 120, .fini = remove_dir)
{
    char cmd[8192];
    static char out[65536];
    install();
    int rc;
    const char *files[] = {"usr/bin/tandem", "usr/lib/libtandem.a",
                           "usr/include/tandem/core/device.h", "usr/include/tandem/ddp/ddp.h",
                           "usr/lib/pkgconfig/tandem.pc"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        cr_assert_eq(access(tu_tpath(dir, files[i]), R_OK), 0, "%s not installed", files[i]);
    int cuda = tdm_device_cuda_linked();  /* this binary links the backend iff it was built */
    cr_assert_eq(access(tu_tpath(dir, "usr/lib/libtandem_cuda.a"), R_OK) == 0, cuda);
    cr_assert_eq(access(tu_tpath(dir, "usr/include/tandem/cuda/cuda.h"), R_OK) == 0, cuda);
    int mpi = tdm_mpi_library_version != NULL;  /* likewise mpi/ */
    cr_assert_eq(access(tu_tpath(dir, "usr/lib/libtandem_mpi.a"), R_OK) == 0, mpi);
    cr_assert_eq(access(tu_tpath(dir, "usr/include/tandem/mpi/mpi_comm.h"), R_OK) == 0, mpi);

    /* the public headers only: no *_impl.h (tools/check-layers.sh checks
     * that no public header includes one), and each compiles on its own
     * from the installed tree, as C11 and as C++11 */
    snprintf(cmd, sizeof cmd, "cd '%s/usr/include/tandem' && find . -name '*_impl.h'", dir);
    rc = run(cmd, out, sizeof out);
    cr_assert(rc == 0 && out[0] == '\0', "internal headers were installed:\n%s", out);
    snprintf(cmd, sizeof cmd,
             "cd '%s/usr/include/tandem' && n=0 && for h in */*.h; do n=$((n+1)); "
             "printf '#include \"%%s\"\\n' \"$h\" > ../../../one.c; "
             "cc -std=c11 -Wall -Wextra -Werror -fsyntax-only -I. ../../../one.c "
             "|| echo \"C: $h\"; "
             "g++ -std=c++11 -Wall -Wextra -Werror -pedantic -x c++ -fsyntax-only -I. "
             "../../../one.c "
             "|| echo \"C++: $h\"; done; echo \"headers: $n\"", dir);
    rc = run(cmd, out, sizeof out);
    cr_assert(rc == 0 && !strstr(out, "C: ") && !strstr(out, "C++: ") &&
                  strstr(out, "headers: ") && atoi(strstr(out, "headers: ") + 9) >= 30,
              "an installed header does not compile on its own:\n%s", out);

    FILE *f = fopen(tu_tpath(dir, "prog.c"), "w");
    cr_assert_not_null(f);
    fputs(prog_src, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "cd '%s' && cc -std=c11 %s %s -o prog prog.c %s 2>&1", dir, san,
             mpi ? "-DTDM_TEST_MPI" : "", pkg_config());
    rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "building against the installed tandem failed:\n%s\n%s", cmd, out);
    snprintf(cmd, sizeof cmd, "cd '%s' && TANDEM_CUDA_EMULATOR=1 ./prog 2>&1", dir);
    rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "gemm 3 4 1 2"), "%s", out);
    if (mpi) cr_assert(strstr(out, "mpi: "), "the MPI archive did not link:\n%s", out);
    if (cuda)
        cr_assert(strstr(out, "cuda device cuda-emu:0"), "the CUDA backend is not registered:\n%s",
                  out);
    else
        cr_assert(strstr(out, "cuda: "), "%s", out);
    snprintf(cmd, sizeof cmd, "'%s/usr/bin/tandem' info 2>&1", dir);
    rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s", out);
}

Test(install, a_cxx_program_links_the_c_api, .timeout = 180, .fini = remove_dir)
{
    char cmd[8192], src[4096];
    static char out[65536];
    install();
    cr_assert_not_null(realpath("tests/cxx_program.cpp", src), "run from the source tree's root");
    snprintf(cmd, sizeof cmd,
             "cd '%s' && g++ -std=c++17 -Wall -Wextra -Werror %s -o cxx_program '%s' %s 2>&1", dir,
             san, src, pkg_config());
    int rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "building the C++ program against the installed tandem failed:\n%s\n%s",
                 cmd, out);
    snprintf(cmd, sizeof cmd, "cd '%s' && ./cxx_program 2>&1", dir);
    rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "cxx: one device, 4 steps: loss "), "%s", out);
    cr_assert(strstr(out, "cxx: ddp 2 ranks, 4 steps: parameters within "), "%s", out);
    cr_assert_eq(cli_shm_entries(), 0, "left a tandem entry in /dev/shm");
}

/* Builds examples/<name>.c against the installed tree, runs it under the
 * installed `tandem launch -n 2` for one epoch on synthetic data, and
 * loads its checkpoint into a single-device MLP of dims. */
static void example(const char *name, const int *dims, int n_dims)
{
    char cmd[8192], src[4096], ckpt[300];
    static char out[65536];
    snprintf(cmd, sizeof cmd, "examples/%s.c", name);
    cr_assert_not_null(realpath(cmd, src), "%s: run from the source tree's root", cmd);
    snprintf(cmd, sizeof cmd, "cd '%s' && cc -std=c11 -Wall -Wextra -Werror %s -o %s '%s' %s 2>&1",
             dir, san, name, src, pkg_config());
    int rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "building %s against the installed tandem failed:\n%s\n%s", name, cmd,
                 out);
    snprintf(ckpt, sizeof ckpt, "%s/%s.safetensors", dir, name);
    snprintf(cmd, sizeof cmd, "cd '%s' && usr/bin/tandem launch -n 2 -- ./%s 1 synthetic '%s' 2>&1",
             dir, name, ckpt);
    rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s:\n%s", cmd, out);
    cr_assert(strstr(out, "[rank 0] epoch 1: rank 0 train loss"), "%s", out);
    cr_assert(strstr(out, "test accuracy"), "%s", out);
    cr_assert_eq(cli_shm_entries(), 0, "left a tandem entry in /dev/shm");

    tdm_device *dev;
    tdm_model *m;
    cr_assert(tdm_device_open(&dev, "cpu", 0, 1) == TDM_STATUS_OK);
    cr_assert(tdm_mlp_init(&m, dev, dims, n_dims, 99) == TDM_STATUS_OK);
    tdm_ckpt_info info;
    cr_assert(tdm_checkpoint_load(ckpt, m, NULL, &info) == TDM_STATUS_OK, "%s: %s", name,
              tdm_error_message());
    cr_assert_eq(info.epoch, 1);
    cr_assert_gt(info.step, 0);
    tdm_model_free(m);
    tdm_device_free(dev);
}

Test(install, the_ddp_and_fsdp_examples_build_from_pkg_config, .timeout = 240,
     .fini = remove_dir)
{
    install();
    const int ddp_dims[] = {784, 256, 10}, fsdp_dims[] = {784, 256, 256, 10};
    example("ddp_train", ddp_dims, 3);
    example("fsdp_train", fsdp_dims, 4);
}
