/* models/recompute.h: activation checkpointing (torch.utils.checkpoint,
 * FairScale's checkpoint_wrapper, Megatron's "uniform" recompute): the
 * model's checkpoint units - a GPT block, a CNN conv block (convolution,
 * batchnorm with its relu, max pooling), an MLP linear layer (with its
 * relu) - are grouped into segments of N consecutive units; a segment
 * keeps only its input (the previous segment's output) through the
 * forward pass, and backward, on reaching a segment, runs the segment's
 * forward again from that input into one shared set of buffers, then
 * goes back through it. Memory: one segment's activations plus the
 * segment inputs, instead of every unit's; time: one more forward of the
 * checkpointed units per step.
 *
 * The recomputed forward is the same arithmetic on the same inputs, so
 * gradients are bitwise those of a run without checkpointing; batchnorm
 * reuses the batch statistics its forward computed (its running
 * statistics are updated once, as without checkpointing; torch's
 * checkpoint updates them twice). Before recomputing a segment, backward
 * raises one parameter-use event TDM_MODEL_USE_BACKWARD over the
 * parameters of all its layers: they are all read by the recomputation
 * and again by each layer's own backward (which raises its own event
 * too), so a sharded model (FSDP) gathers the segment's units together
 * and keeps each until its backward is done.
 *
 * The MLP's linear layers keep only their output, which is the next
 * layer's input: with N = 1 nothing can be dropped there; N >= 2 keeps
 * one layer output in N. */
#ifndef TDM_MODELS_RECOMPUTE_H
#define TDM_MODELS_RECOMPUTE_H

#include "models/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 0: keep every activation (the default); N >= 1: segments of N units.
 * Drops the activations: call it between steps. */
tdm_status tdm_model_set_checkpoint(tdm_model *m, int units_per_segment);
int tdm_model_checkpoint(const tdm_model *m);
/* Checkpoint units of the model, and the unit of layer i (-1: a layer
 * outside every unit: the GPT's embeddings, final LayerNorm and head, the
 * CNN's layout changes). */
int tdm_model_n_units(const tdm_model *m);
int tdm_model_layer_unit(const tdm_model *m, int layer);

#ifdef __cplusplus
}
#endif

#endif
