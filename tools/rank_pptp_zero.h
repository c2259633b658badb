/* tools/rank_pptp_zero.h: ZeRO-1 on the dp dimension of the 3-D mesh
 * (--mode pp --mesh dp=D,pp=S,tp=N --sharding optimizer). The step is
 * the dp x pp mesh's (tools/rank_pp.c's optim_step hook: each replica
 * steps its 1/D chunk of the stage's flat parameters, here the narrow
 * stage model's, that is this tensor-parallel rank's slices, and the
 * chunks are all-gathered over the dp dimension: the mesh's dp group
 * joins the ranks of one stage and one tp index). What the 3-D mesh adds
 * is the checkpoint's way from a stage's narrow layout to the whole
 * model's: here. */
#ifndef TDM_TOOLS_RANK_PPTP_ZERO_H
#define TDM_TOOLS_RANK_PPTP_ZERO_H

#include "core/status.h"
#include "pp/pp.h"
#include "tools/rank_pptp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A buffer in the stage's (narrow) parameter layout, device memory (a
 * ZeRO-1 optimizer state all-gathered over the dp dimension), into the
 * whole model's layout on the replica's root (stage 0, tp rank 0; whole
 * is host memory there, NULL elsewhere): over this tp index's pipeline
 * onto its stage 0 (tdm_pp_gather_stage), then over stage 0's tp group.
 * what names it in errors. On a failure the pipeline's and the stage's
 * host communicators are aborted (the others wait in a gather).
 * Collective over the replica. */
tdm_status tdm_pptp_gather_stage(tdm_pptp *q, tdm_pp *p, const float *stage, float *whole,
                                 const char *what);

#ifdef __cplusplus
}
#endif

#endif
