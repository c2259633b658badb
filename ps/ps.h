/* ps/ps.h: a parameter server over rpc/ (the design all-reduce
 * replaced): S server ranks each own a contiguous shard of a model's flat
 * parameters and the optimizer state of that shard; W worker ranks each
 * hold a replica of the model, pull the parameters from every server,
 * compute the gradient of their share of a global batch and push each
 * shard of it to its server. Three ways to keep time (--ps-sync):
 *
 *   sync        step t: every worker pulls version t, computes the
 *               gradient of its share with the loss scaled by 1/B (B the
 *               global batch), pushes; a server, once it holds all W
 *               gradients of step t, sums them in worker order (the
 *               global batch's mean-loss gradient, as DDP's all-reduce
 *               sum gives it), steps its optimizer and publishes version
 *               t+1.
 *   bounded:K   stale synchronous parallel: gradients of step t are still
 *               summed and applied as in sync, but a worker may start step
 *               c on any version >= c - K, so it runs at most K steps
 *               ahead of the slowest. bounded:0 is sync, bit for bit.
 *   async       HogWild-style: a server applies each push as it arrives
 *               (one optimizer step per push, of a share's gradient: with
 *               SGD about 1/W of a global step; Adam ignores the scale,
 *               so each push is a whole Adam step: tools refuse adamw)
 *               and workers never wait for each other.
 *
 * Each applied gradient's staleness (the server's version when applied
 * minus the version the worker computed it on) is counted in a
 * histogram. Host devices only (parameters and gradients move through
 * host memory). What it is not: elastic (a server that dies ends the
 * job), nor a key-value store of named tensors: shards are ranges of one
 * flat buffer. */
#ifndef TDM_PS_PS_H
#define TDM_PS_PS_H

#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/status.h"
#include "models/model.h"
#include "models/optim.h"
#include "rpc/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_ps_sync {
    TDM_PS_SYNC = 0,
    TDM_PS_BOUNDED,
    TDM_PS_ASYNC,
} tdm_ps_sync;

/* Longest bound of bounded:K. */
#define TDM_PS_MAX_BOUND 64
/* Staleness histogram: buckets 0..TDM_PS_STALE_BUCKETS-2, the last one
 * for everything above. */
#define TDM_PS_STALE_BUCKETS 17

typedef struct tdm_ps_sync_mode {
    tdm_ps_sync kind;
    int bound;                    /* bounded:K's K (sync: 0) */
} tdm_ps_sync_mode;

/* "sync", "async", "bounded:K" (0 <= K <= TDM_PS_MAX_BOUND). */
tdm_status tdm_ps_sync_parse(const char *s, tdm_ps_sync_mode *out);
/* "sync", "async", "bounded:3" into buf. */
const char *tdm_ps_sync_str(const tdm_ps_sync_mode *m, char *buf, size_t n);

/* The job's roles: ranks 0..servers-1 serve, the rest work. */
typedef struct tdm_ps_layout {
    int servers, workers;
    int64_t n_elem;               /* the model's parameters */
} tdm_ps_layout;

/* Server s's shard [*lo, *hi) of n_elem (as even as can be). */
void tdm_ps_shard(const tdm_ps_layout *l, int s, int64_t *lo, int64_t *hi);

/* --- a server ----------------------------------------------------------- */

typedef struct tdm_ps_server tdm_ps_server;

typedef struct tdm_ps_server_stats {
    int64_t version;              /* optimizer steps applied */
    int64_t pushes, pulls, pulls_early;  /* pulls_early: answered "not yet" */
    int64_t stale[TDM_PS_STALE_BUCKETS];
    int workers_done;
    /* the most steps a pushing worker was ahead of the slowest worker
     * (its step minus the fewest steps any worker had pushed): bounded:K
     * keeps it <= K, sync 0 */
    int64_t clock_gap_max;
} tdm_ps_server_stats;

/* Server `index` (= its rank) over rpc: registers its functions (call
 * tdm_rpc_barrier after every rank has made its server or worker).
 * params: the whole model's initial parameters (host, n_elem; the shard
 * is copied); dev: a host device for the optimizer (borrowed). */
tdm_status tdm_ps_server_init(tdm_ps_server **out, tdm_rpc *rpc, tdm_device *dev,
                              const tdm_ps_layout *l, const tdm_ps_sync_mode *mode,
                              const tdm_optim_opts *optim, const float *params);
void tdm_ps_server_free(tdm_ps_server *s);
/* Serves until every worker has said it is done, a worker dies (async
 * goes on without it, with a warning in the log (core/log.h): *lost
 * counts them, lost_why says which and why; sync and bounded stop,
 * naming it), a worker reports its failure (tdm_ps_worker_fail: an
 * error with its message, in every mode) or timeout_ms passes (< 0:
 * none). Async with every worker lost and none done is an error too.
 * lost_why may be NULL. */
tdm_status tdm_ps_server_wait(tdm_ps_server *s, int64_t timeout_ms, int *lost, char *lost_why,
                              size_t n);
void tdm_ps_server_get_stats(tdm_ps_server *s, tdm_ps_server_stats *out);
/* The shard's parameters (host, hi - lo elements; borrowed, valid while
 * the server lives; read them after tdm_ps_server_wait). */
const float *tdm_ps_server_params(const tdm_ps_server *s, int64_t *lo, int64_t *hi);

/* Any rank: every server's shard of the parameters into params (host,
 * n_elem) and, when state is given, of the optimizer's n_state state
 * buffers into state[i] (host, n_elem each); *optim_steps: one count for
 * every shard: sync and bounded, the global steps every server applied;
 * async, the pushes that reached every server (a worker killed between
 * its pushes to two servers leaves one shard a push ahead: not counted).
 * For a checkpoint after training (the servers' latest values, whatever
 * their version). */
tdm_status tdm_ps_gather(tdm_rpc *rpc, const tdm_ps_layout *l, float *params, float **state,
                         int n_state, int64_t *optim_steps, int64_t timeout_ms);

/* --- a worker ----------------------------------------------------------- */

typedef struct tdm_ps_worker tdm_ps_worker;

/* Worker `rank - servers` over rpc, its model m (host device, borrowed;
 * its parameters are overwritten by every pull). */
tdm_status tdm_ps_worker_init(tdm_ps_worker **out, tdm_rpc *rpc, tdm_model *m,
                              const tdm_ps_layout *l, const tdm_ps_sync_mode *mode,
                              int64_t timeout_ms);
void tdm_ps_worker_free(tdm_ps_worker *w);
/* One step on this worker's share (x, y: n samples) of a global batch
 * of global_batch samples: pull (as fresh as the mode needs), forward,
 * the loss gradient scaled by 1/global_batch, backward, push. *loss_sum:
 * the sum of the share's per-sample losses (may be NULL). */
tdm_status tdm_ps_worker_step(tdm_ps_worker *w, const void *x, const int32_t *y, int n,
                              int global_batch, double *loss_sum);
/* The latest parameters into the model (a pull of whatever version the
 * servers hold; after every worker's last step: the final ones). */
tdm_status tdm_ps_worker_pull_latest(tdm_ps_worker *w);
/* Tells every server this worker is done (no more pushes). */
tdm_status tdm_ps_worker_done(tdm_ps_worker *w);
/* Tells every server this worker stops on an error (why: its message),
 * before it leaves: the servers stop the job with it, in every mode (a
 * worker that leaves without done or fail was killed: async goes on
 * without it). Best effort; changes the thread's error message. */
void tdm_ps_worker_fail(tdm_ps_worker *w, const char *why);
/* Steps taken; time spent waiting for fresh enough parameters (ms). */
int64_t tdm_ps_worker_steps(const tdm_ps_worker *w);
double tdm_ps_worker_wait_ms(const tdm_ps_worker *w);

#ifdef __cplusplus
}
#endif

#endif
