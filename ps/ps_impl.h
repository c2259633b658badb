/* ps/ps_impl.h: what ps/server.c and ps/worker.c share: the names of the
 * servers' functions and the push header. Not a public header. */
#ifndef TDM_PS_PS_IMPL_H
#define TDM_PS_PS_IMPL_H

#include <stdint.h>

#include "ps/ps.h"

#define TDM_PS_FN_PULL "ps.pull"
#define TDM_PS_FN_PUSH "ps.push"
#define TDM_PS_FN_DONE "ps.done"
#define TDM_PS_FN_STATE "ps.state"
/* A worker that stops on an error says so before it leaves: {i32 worker,
 * i32 0} + its message (not NUL-terminated). */
#define TDM_PS_FN_FAIL "ps.fail"
/* How long a failing worker waits for each server to take its message. */
#define TDM_PS_FAIL_TIMEOUT_MS 2000
/* Most workers (a server keeps a gradient slot per worker). */
#define TDM_PS_MAX_WORKERS 64

typedef struct tdm_ps_push_hdr {
    int32_t worker;
    int32_t reserved;
    int64_t clock;                /* the worker's step */
    int64_t version_used;         /* the shard's version its parameters had */
} tdm_ps_push_hdr;

#endif
