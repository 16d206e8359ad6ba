"""Tensor parallelism inside a stage: what the engine runs and what it refuses, in one place.

A job on DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` gives each stage
``num_mp`` ranks (a tensor-parallel group) per replica. Each of them runs the stage's plan: the same
lowered stream, in the same order (ordered dispatch), so the collectives its layers issue inside F
and B (a column-parallel layer's all-reduce of its input gradient runs in B; W is GEMMs only) meet
in the same order on every rank of the group. Point-to-point messages go from a rank to the rank of
the neighbouring stage with the same tensor-parallel (and data-parallel) coordinate, as stock's do:
``grid.stage_to_global`` keeps every coordinate but the stage. Gradients are reduced over the
data-parallel group, tied layers over their stock groups and the clip norm over DeepSpeed's model
group, all by DeepSpeed's own code. The control loop's exchange gathers every rank's row, and its
decisions (a plan, link routes) are computed from that table or broadcast from rank 0: every rank
of a group switches at the same boundary to the same plan. A boundary between two stages is then
``num_mp`` links per replica; the link estimate pairs each receiver with its sender and keeps the
slowest pair (``control.estimate.link_delays``).

Refused, each with one sentence (``refusal``; the sentences are ``runtime.compat``'s):
DeepSpeed's partitioned activations and gradients (the engine sends every tensor whole), ready
dispatch, also as ``compare``'s side (each rank would pick its next op from its own arrivals), and
moving layers or ranks (the migration and re-mapping code moves one rank per stage and replica).
"""
from __future__ import annotations

from typing import Optional

from ..plan.ir.lower import Dispatch
from .compat import TP_MOVING_REFUSED, TP_PARTITIONED_REFUSED, TP_READY_REFUSED


def tensor_parallel_size(model) -> int:
    """Ranks per stage and replica (DeepSpeed's slice-parallel world size) of a ``PipelineModule``."""
    return model.mpu().get_slice_parallel_world_size()


def refusal(config_class, model, pipemorph) -> Optional[str]:
    """One sentence if this job cannot run with the tensor parallelism its topology asks for, else None
    (also None without tensor parallelism). Every rank gets the same answer (the same config)."""
    if tensor_parallel_size(model) == 1:
        return None
    pipeline = config_class.pipeline
    if pipeline.get("pipe_partitioned") or pipeline.get("grad_partitioned"):
        return TP_PARTITIONED_REFUSED
    if pipemorph.dispatch is Dispatch.READY or (pipemorph.compare.schedule is not None
                                                and pipemorph.compare.dispatch is Dispatch.READY):
        return TP_READY_REFUSED
    if pipemorph.rebalance.enabled or pipemorph.orchestrate.matrix:
        return TP_MOVING_REFUSED
    return None


def switch_refusal(engine, dispatch: Optional[Dispatch]) -> Optional[str]:
    """The sentence refusing ``engine.switch_to(dispatch=...)`` under tensor parallelism, else None."""
    if dispatch is Dispatch.READY and engine.grid.get_slice_parallel_world_size() > 1:
        return TP_READY_REFUSED
    return None


def moving_refusal(engine) -> Optional[str]:
    """The sentence refusing ``repartition``/``remap`` under tensor parallelism, else None."""
    if engine.grid.get_slice_parallel_world_size() > 1:
        return TP_MOVING_REFUSED
    return None
