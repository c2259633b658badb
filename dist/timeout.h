/* dist/timeout.h: every bound on time that the multi-process designs
 * share, named once with the reason for its value: the process group's
 * timeout (the deadline of every collective wait, PyTorch's
 * init_process_group(timeout=)), its sources (the API, TANDEM_TIMEOUT,
 * `--timeout`), and the fixed bounds the designs and the CLI use around
 * it. Not the shm segment's own waits (shm/) nor a launcher's grace
 * periods (tools/launch.c). */
#ifndef TDM_DIST_TIMEOUT_H
#define TDM_DIST_TIMEOUT_H

#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The process group's timeout: a rank that waits longer for a peer fails
 * naming it. In the environment it is TANDEM_TIMEOUT, in seconds
 * (`tandem launch --timeout` and `tandem train --timeout` set it for
 * their ranks); it applies where no timeout is given through the API.
 * The default is the shm communicator's 300 s: a collective of the
 * largest model the CLI trains takes well under a second, so five
 * minutes only fires on a peer that is gone, and leaves room for a
 * checkpoint written or a test set evaluated while the others wait. */
#define TDM_DIST_ENV_TIMEOUT "TANDEM_TIMEOUT"
#define TDM_DIST_TIMEOUT_DEFAULT_MS 300000
#define TDM_DIST_TIMEOUT_MAX_S 604800   /* one week: anything longer is a typo */

/* The process group's timeout of ranks that `tandem train` forks itself
 * when neither --timeout nor TANDEM_TIMEOUT says: one machine, ranks
 * started together and watched by their parent, so a minute names a
 * stalled rank while the user still watches the run. */
#define TDM_DIST_FORKED_TIMEOUT_MS 60000

/* How long a rank waits for collectives of its own still in flight when
 * it gives up on them: after it aborted the communicator (the abort ends
 * them at once, with an error) or while freeing a wrapper. The bound only
 * matters for a progress thread that is itself stuck; after it, the work
 * is left running and its memory is not freed under it. */
#define TDM_DIST_DRAIN_TIMEOUT_MS 10000

/* The whole-run bound of training ranks forked by the CLI: none (epochs
 * take what they take; the process group's timeout catches a stall). The
 * largest value whose deadline in ns still fits the spawner's int64
 * arithmetic. */
#define TDM_DIST_RUN_UNBOUNDED_MS (INT64_MAX / 2000000)

/* Parses a number of seconds ("600", "2.5") into ms. what names where the
 * text came from ("--timeout", "TANDEM_TIMEOUT") in the error: anything
 * but a number in [0.001, one week] is INVALID_ARG. */
tdm_status tdm_dist_timeout_parse(const char *what, const char *text, int64_t *ms);
/* TANDEM_TIMEOUT in ms; 0 when it is unset or empty. */
tdm_status tdm_dist_timeout_from_env(int64_t *ms);

#ifdef __cplusplus
}
#endif

#endif
