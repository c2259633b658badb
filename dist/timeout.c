/* dist/timeout.c: the process group's timeout from text and from the
 * environment (see dist/timeout.h). */
#include "dist/timeout.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

tdm_status tdm_dist_timeout_parse(const char *what, const char *text, int64_t *ms)
{
    char *end = NULL;
    errno = 0;
    double s = text && *text ? strtod(text, &end) : NAN;
    /* isfinite also refuses "nan" and "inf", which strtod accepts */
    TDM_REQUIRE(end && !*end && !errno && isfinite(s) && s >= 0.001 &&
                    s <= TDM_DIST_TIMEOUT_MAX_S,
                TDM_STATUS_INVALID_ARG,
                "%s%s'%s': expected a number of seconds from 0.001 to %d (one week), e.g. 600",
                what, what[0] == '-' ? " " : "=", text ? text : "", TDM_DIST_TIMEOUT_MAX_S);
    *ms = (int64_t)llround(s * 1000.0);
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_timeout_from_env(int64_t *ms)
{
    const char *v = getenv(TDM_DIST_ENV_TIMEOUT);
    *ms = 0;
    if (!v || !*v) return TDM_STATUS_OK;
    return tdm_dist_timeout_parse(TDM_DIST_ENV_TIMEOUT, v, ms);
}
