/* dist/pg.c: the launcher's environment and joining its process group. */
#include "dist/pg.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/log.h"
#include "shm/shm_comm.h"

static tdm_status tdm_dist_env_int(const char *name, int lo, int hi, int dflt, int *out)
{
    const char *v = getenv(name);
    if (!v || !*v) {
        TDM_REQUIRE(dflt >= 0, TDM_STATUS_INVALID_ARG,
                    "%s is not set: start this program with `tandem launch -n N -- ...`", name);
        *out = dflt;
        return TDM_STATUS_OK;
    }
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    TDM_REQUIRE(!errno && !*end && x >= lo && x <= hi, TDM_STATUS_INVALID_ARG,
                "%s='%s': expected an integer in %d..%d", name, v, lo, hi);
    *out = (int)x;
    return TDM_STATUS_OK;
}

void tdm_dist_env_export(int rank, int world)
{
    char buf[16];
    snprintf(buf, sizeof buf, "%d", rank);
    setenv("RANK", buf, 1);
    setenv("LOCAL_RANK", buf, 1);
    snprintf(buf, sizeof buf, "%d", world);
    setenv("WORLD_SIZE", buf, 1);
    setenv("LOCAL_WORLD_SIZE", buf, 1);
}

int tdm_dist_launched(void) { return getenv(TDM_SHM_ENV_FD) && getenv("WORLD_SIZE"); }

tdm_status tdm_dist_env_from_environ(tdm_dist_env *env)
{
    tdm_dist_env e = {0};
    TDM_CHECK(tdm_dist_env_int("WORLD_SIZE", 1, 1 << 20, -1, &e.world_size));
    TDM_CHECK(tdm_dist_env_int("RANK", 0, e.world_size - 1, -1, &e.rank));
    TDM_CHECK(tdm_dist_env_int("LOCAL_WORLD_SIZE", 1, e.world_size, e.world_size,
                              &e.local_world_size));
    TDM_CHECK(tdm_dist_env_int("LOCAL_RANK", 0, e.local_world_size - 1, e.rank, &e.local_rank));
    *env = e;
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_pg_init(tdm_comm **out, tdm_dist_env *env, const tdm_dist_pg_opts *opts)
{
    tdm_dist_env e;
    tdm_shm_opts so = {.timeout_ms = opts ? opts->timeout_ms : 0};
    TDM_CHECK(tdm_dist_env_from_environ(&e));
    if (so.timeout_ms < 0)
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "process group: timeout %lld ms is negative",
                             (long long)so.timeout_ms);
    if (so.timeout_ms == 0) TDM_CHECK(tdm_dist_timeout_from_env(&so.timeout_ms));
    if (so.timeout_ms == 0) so.timeout_ms = TDM_DIST_TIMEOUT_DEFAULT_MS;
    tdm_log_set_rank(e.rank);
    TDM_CHECK(tdm_shm_comm_init_from_env(out, &so));
    if (env) *env = e;
    return TDM_STATUS_OK;
}

tdm_status tdm_dist_pg_init_from_env(tdm_comm **out, tdm_dist_env *env)
{
    return tdm_dist_pg_init(out, env, NULL);
}
