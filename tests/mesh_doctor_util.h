/* tests/mesh_doctor_util.h: what a failed `tandem train --mesh ...` run
 * told the user, checked against the mesh (dist/mesh.h's layout, rank =
 * (dp * PP + pp) * TP + tp): the doctor's full output on the dumps the
 * run named, and every "stage S (rank R)" naming R's own stage.
 * Header-only. */
#ifndef TDM_TESTS_MESH_DOCTOR_UTIL_H
#define TDM_TESTS_MESH_DOCTOR_UTIL_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/cli_util.h"

/* `tandem doctor DIR` on the directory the run's last line named. */
static inline void mesh_doctor(const cli_result *run, cli_result *doc)
{
    const char *p = strstr(run->out, "flight-recorder dumps in ");
    cr_assert_not_null(p, "the run named no dump directory:\n%s", run->out);
    char dir[256];
    cr_assert_eq(sscanf(p, "flight-recorder dumps in %255s", dir), 1);
    CLI(doc, "doctor", dir);
}

/* Every "stage S (rank R)" in text has S = R's pp coordinate. */
static inline void mesh_expect_stages(const char *text, int pp, int tp)
{
    for (const char *p = strstr(text, "stage "); p; p = strstr(p + 1, "stage ")) {
        int s, r;
        if (sscanf(p, "stage %d (rank %d)", &s, &r) != 2) continue;
        cr_expect_eq(s, r / tp % pp, "rank %d is at stage %d, not %d (pp=%d, tp=%d):\n%s", r,
                     r / tp % pp, s, pp, tp, text);
    }
}

#endif
