/* tests/test_api_doc.c: docs/API.md and the pages of docs/api/, the C API reference
 * tools/api-doc.sh generates from the public headers (`make api-doc`),
 * name every public function; and, in a copy of the tree, the generator
 * puts a new function on its floor's page with the comment above it as
 * its contract, keeps internal headers out, and --check catches a page
 * that lacks a function or names one that is gone. Run from the source
 * tree's root, as `make test` does. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/test_util.h"

static char out[1 << 20];   /* every page at once: ~150 KB */

static int sh(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int ws = pclose(p);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128;
}

static char copy_dir[160];
static void remove_copy(void)
{
    tu_rmtree(copy_dir);
    copy_dir[0] = '\0';
}

static void append(const char *path, const char *text)
{
    FILE *f = fopen(path, "a");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

Test(api_doc, the_pages_name_every_public_function, .timeout = 60)
{
    int rc = sh("sh tools/api-doc.sh --check 2>&1");
    cr_assert_eq(rc, 0, "docs/API.md is out of date (run make api-doc):\n%s", out);
    cr_assert(strstr(out, "name every public function ("), "%s", out);
    /* the pages tell what they list: the index links every floor's page */
    rc = sh("grep -c '^| \\[' docs/API.md");
    cr_assert(rc == 0 && atoi(out) >= 8, "docs/API.md lists %s floors", out);
}

Test(api_doc, a_new_function_reaches_its_page_and_check_sees_it, .timeout = 120,
     .fini = remove_copy)
{
    char cmd[1024];
    tu_mkdtemp(copy_dir, sizeof copy_dir, "apidoc");
    snprintf(cmd, sizeof cmd,
             "tar -cf - --exclude='./build*' $(ls -d */ | grep -v '^build') | tar -xf - -C '%s'",
             copy_dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);

    /* a public function without its page: --check names it */
    char hdr[256];
    snprintf(hdr, sizeof hdr, "%s/models/optim.h", copy_dir);
    /* after the header's closing #endif: the generator reads every
     * declaration, wherever it stands */
    append(hdr, "\n/* Adds one to x: the planted contract. */\nint tdm_optim_planted(int x);\n");
    snprintf(cmd, sizeof cmd, "sh tools/api-doc.sh --check '%s' 2>&1", copy_dir);
    int rc = sh(cmd);
    cr_assert_eq(rc, 1, "--check passed a page without tdm_optim_planted:\n%s", out);
    cr_assert(strstr(out, "lack") && strstr(out, "tdm_optim_planted"), "%s", out);

    /* generated: on models' page, one line with its contract */
    snprintf(cmd, sizeof cmd,
             "sh tools/api-doc.sh '%s' 2>&1 && grep -F 'tdm_optim_planted' '%s/docs/api/models.md'",
             copy_dir, copy_dir);
    rc = sh(cmd);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "- `int tdm_optim_planted(int x)`: Adds one to x: the planted contract."),
              "not on the page as one line with its contract:\n%s", out);
    snprintf(cmd, sizeof cmd, "sh tools/api-doc.sh --check '%s' 2>&1", copy_dir);
    cr_assert_eq(sh(cmd), 0, "%s", out);

    /* an internal header's function is not public: not on any page */
    snprintf(hdr, sizeof hdr, "%s/models/model_impl.h", copy_dir);
    append(hdr, "\nint tdm_model_planted_internal(void);\n");
    snprintf(cmd, sizeof cmd, "sh tools/api-doc.sh '%s' >/dev/null && cat '%s'/docs/api/*.md",
             copy_dir, copy_dir);
    cr_assert_eq(sh(cmd), 0);
    cr_assert_null(strstr(out, "tdm_model_planted_internal"), "an *_impl.h function was listed");

    /* a function gone from the headers but still on a page */
    snprintf(cmd, sizeof cmd,
             "cd '%s' && grep -v 'tdm_optim_planted' models/optim.h > o.h && mv o.h models/optim.h "
             "&& sh tools/api-doc.sh --check . 2>&1", copy_dir);
    rc = sh(cmd);
    cr_assert_eq(rc, 1, "--check passed a page naming a function that is gone:\n%s", out);
    cr_assert(strstr(out, "no public header declares") && strstr(out, "tdm_optim_planted"), "%s",
              out);
}
