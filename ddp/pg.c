/* ddp/pg.c: launcher environment and process-group set-up. */
#include "ddp/pg.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/log.h"
#include "shm/shm_comm.h"

static tdm_status tdm_ddp_env_int(const char *name, int lo, int hi, int dflt, int *out)
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

void tdm_ddp_env_export(int rank, int world)
{
    char buf[16];
    snprintf(buf, sizeof buf, "%d", rank);
    setenv("RANK", buf, 1);
    setenv("LOCAL_RANK", buf, 1);
    snprintf(buf, sizeof buf, "%d", world);
    setenv("WORLD_SIZE", buf, 1);
    setenv("LOCAL_WORLD_SIZE", buf, 1);
}

tdm_status tdm_ddp_env_from_environ(tdm_ddp_env *env)
{
    tdm_ddp_env e = {0};
    TDM_CHECK(tdm_ddp_env_int("WORLD_SIZE", 1, 1 << 20, -1, &e.world_size));
    TDM_CHECK(tdm_ddp_env_int("RANK", 0, e.world_size - 1, -1, &e.rank));
    TDM_CHECK(tdm_ddp_env_int("LOCAL_WORLD_SIZE", 1, e.world_size, e.world_size,
                              &e.local_world_size));
    TDM_CHECK(tdm_ddp_env_int("LOCAL_RANK", 0, e.local_world_size - 1, e.rank, &e.local_rank));
    *env = e;
    return TDM_STATUS_OK;
}

tdm_status tdm_ddp_pg_init_from_env(tdm_comm **out, tdm_ddp_env *env)
{
    tdm_ddp_env e;
    TDM_CHECK(tdm_ddp_env_from_environ(&e));
    tdm_log_set_rank(e.rank);
    TDM_CHECK(tdm_shm_comm_init_from_env(out, NULL));
    if (env) *env = e;
    return TDM_STATUS_OK;
}
