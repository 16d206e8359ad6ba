"""When DeepSpeed's gradient all-reduce at the end of an iteration cannot change a gradient.

``ReduceGrads`` runs ``allreduce_gradients`` on every stage: it gives every trainable parameter
without a gradient a zero one (optimizers then step it: momentum, weight decay, step counts), then
flattens the gradients into buckets, all-reduces each in the data-parallel group, scales them and
copies them back. With one replica (a data-parallel group of one rank) that is the identity exactly
when every trainable parameter already has a gradient and nothing in between rounds: the gradients
are fp32 and travel as fp32 (no fp16/bf16 optimizer, ``communication_data_type`` fp32), DeepSpeed's
own all-reduce does the work (no ZeRO, no MoE, no sequence parallelism) and no pre-division is
configured (``gradient_predivide_factor`` 1: its ``1/f`` then ``f`` would round). The configuration
is read once (``reduction_can_be_identity``); the gradients at every reduction (a parameter without
one, a sparse or non-fp32 one: a migration may bring in a layer). There the engine skips the bucket
copies and the collective; everywhere else DeepSpeed's reduction runs unchanged.
"""
from __future__ import annotations

import torch


def reduction_can_be_identity(engine) -> bool:
    """What of ``reduction_is_identity`` the configuration decides (fixed for an engine's life)."""
    return (engine.dp_world_size == 1
            and getattr(engine, "sequence_parallel_size", 1) == 1
            and not engine.zero_optimization()
            and not engine.fp16_enabled()
            and not engine.bfloat16_enabled()
            and not getattr(engine, "using_bf16_optimizer", False)
            and not engine.has_moe_layers
            and getattr(engine, "_autoep_folding_spec", None) is None
            and engine.communication_data_type == torch.float32
            and engine.gradient_predivide_factor() == 1.0)


def reduction_is_identity(engine, configured: bool) -> bool:
    """Whether ``engine``'s (a DeepSpeed ``PipelineEngine``) ``_exec_reduce_grads`` would leave every
    gradient bit for bit as it is now; ``configured``: ``reduction_can_be_identity(engine)``."""
    return configured and all(p.grad is not None and p.grad.dtype == torch.float32 and not p.grad.is_sparse
                              for p in engine.module.parameters() if p.requires_grad)
