/* tests/test_install.c: `make install` as a user meets it: tools/install.sh
 * puts the CLI, the archives, the headers and tandem.pc under a prefix,
 * and a program outside the tree builds with `pkg-config --cflags --libs
 * tandem` alone and runs: a host gemm, and, where the CUDA backend is
 * built, a "cuda" device (emulated here), which only works when the CUDA
 * archive's registration constructor was linked in. */
#include <criterion/criterion.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/device.h"
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

Test(install, a_program_builds_from_pkg_config_and_runs, .timeout = 120)
{
    const char *bin = getenv("TANDEM_BIN");
    char build[4096];
    snprintf(build, sizeof build, "%s", bin && *bin ? bin : "build/tandem");
    char *bdir = dirname(build);
    /* a sanitizer build's archives need the sanitizer's runtime */
    const char *san = strstr(bdir, "-asan") ? "-fsanitize=address,undefined"
                      : strstr(bdir, "-tsan") ? "-fsanitize=thread" : "";
    char dir[192], cmd[8192];
    static char out[65536];
    tu_mkdtemp(dir, sizeof dir, "install");
    snprintf(cmd, sizeof cmd, "sh tools/install.sh '%s' '%s/usr' 2>&1", bdir, dir);
    int rc = run(cmd, out, sizeof out);
    cr_assert_eq(rc, 0, "%s: %s", cmd, out);
    const char *files[] = {"usr/bin/tandem", "usr/lib/libtandem.a", "usr/include/tandem/core/device.h",
                           "usr/include/tandem/ddp/ddp.h", "usr/lib/pkgconfig/tandem.pc"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        cr_assert_eq(access(tu_tpath(dir, files[i]), R_OK), 0, "%s not installed", files[i]);
    int cuda = tdm_device_cuda_linked();  /* this binary links the backend iff it was built */
    cr_assert_eq(access(tu_tpath(dir, "usr/lib/libtandem_cuda.a"), R_OK) == 0, cuda);
    cr_assert_eq(access(tu_tpath(dir, "usr/include/tandem/cuda/cuda.h"), R_OK) == 0, cuda);
    int mpi = tdm_mpi_library_version != NULL;  /* likewise mpi/ */
    cr_assert_eq(access(tu_tpath(dir, "usr/lib/libtandem_mpi.a"), R_OK) == 0, mpi);
    cr_assert_eq(access(tu_tpath(dir, "usr/include/tandem/mpi/mpi_comm.h"), R_OK) == 0, mpi);

    FILE *f = fopen(tu_tpath(dir, "prog.c"), "w");
    cr_assert_not_null(f);
    fputs(prog_src, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && cc -std=c11 %s %s -o prog prog.c $(PKG_CONFIG_PATH='%s/usr/lib/pkgconfig' "
             "pkg-config --cflags --libs tandem) 2>&1", dir, san, mpi ? "-DTDM_TEST_MPI" : "", dir);
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
    tu_rmtree(dir);
}
