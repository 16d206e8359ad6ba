"""Pipe instructions PipeMorphEngine adds to DeepSpeed's, and the op text of every instruction.

DeepSpeed's own instructions are reused with one more keyword, ``micro_batch`` (every kwarg of an
instruction reaches its handler): ``ForwardPass(buffer_id=0, micro_batch=3)``. The new ones are the
split backward, ``BackwardInputPass`` (B) and ``BackwardWeightPass`` (W), and ``WaitSends``.
``op_text`` names an instruction in traces and errors: ``F3``, ``B3``, ``W3``, ``SEND_F3``,
``RECV_B3`` (waiting for the message), ``POST_F3`` (posting its receive), ``LOAD3``.
"""
from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

from ..plan.ir.ops import Kind

LoadMicroBatch = ds.LoadMicroBatch
ForwardPass = ds.ForwardPass
SendActivation = ds.SendActivation
RecvActivation = ds.RecvActivation
SendGrad = ds.SendGrad
RecvGrad = ds.RecvGrad
ReduceTiedGrads = ds.ReduceTiedGrads
ReduceGrads = ds.ReduceGrads
OptimizerStep = ds.OptimizerStep


class BackwardInputPass(ds.BufferOpInstruction):
    """B: gradient w.r.t. the stage input; keeps what W needs and frees the activation.

    Roughly: ``buffers['input_grads'][buffer_id], work[micro_batch] = backward_input(...)``.
    With ``whole=True`` it runs the micro-batch's whole backward in one pass, as stock's, and leaves
    its W nothing to do (``bw_split.backward_whole``).
    """

    def __init__(self, buffer_id: int, micro_batch: int, **kwargs):
        super().__init__(buffer_id, micro_batch=micro_batch, **kwargs)


class BackwardWeightPass(ds.PipeInstruction):
    """W: parameter gradients of one micro-batch from what its B kept, accumulated in ``.grad``.

    W needs no pipe buffer: B already released it.
    """

    def __init__(self, micro_batch: int, **kwargs):
        super().__init__(micro_batch=micro_batch, **kwargs)


class PostRecvActivation(ds.PipeInstruction):
    """RECV_F of the lowered stream: post the receive of a micro-batch's activation; F waits for it
    (``RecvActivation``). Not recorded as an op: posting takes no time worth a range."""

    def __init__(self, micro_batch: int, **kwargs):
        super().__init__(micro_batch=micro_batch, **kwargs)


class PostRecvGrad(ds.PipeInstruction):
    """RECV_B of the lowered stream: post the receive of a micro-batch's output gradient; B waits
    for it (``RecvGrad``)."""

    def __init__(self, micro_batch: int, **kwargs):
        super().__init__(micro_batch=micro_batch, **kwargs)


POSTS = (PostRecvActivation, PostRecvGrad)


class BeginP2PGroup(ds.PipeInstruction):
    """Under NCCL's rules: the sends and receives up to ``EndP2PGroup`` go out as one group
    (``plan.ir.nccl.nccl_groups``; ``Transport.begin_group``)."""


class EndP2PGroup(ds.PipeInstruction):
    """Issue the group ``BeginP2PGroup`` opened."""


GROUPS = (BeginP2PGroup, EndP2PGroup)
UNRECORDED = POSTS + GROUPS  # no op record or range of their own: they take no time worth one


class WaitSends(ds.PipeInstruction):
    """Wait until every send of this iteration has been received (before reductions and step)."""


_PREFIX = {
    LoadMicroBatch: "LOAD",
    ForwardPass: Kind.F,
    BackwardInputPass: Kind.B,
    BackwardWeightPass: Kind.W,
    SendActivation: Kind.SEND_F,
    RecvActivation: Kind.RECV_F,
    SendGrad: Kind.SEND_B,
    RecvGrad: Kind.RECV_B,
    PostRecvActivation: "POST_F",
    PostRecvGrad: "POST_B",
}


def op_text(cmd: ds.PipeInstruction) -> str:
    """``F3``, ``SEND_B3``, ... for micro-batch instructions; the class name otherwise."""
    prefix = _PREFIX.get(type(cmd))
    if prefix is None or "micro_batch" not in cmd.kwargs:
        return cmd.name
    return f"{prefix}{cmd.kwargs['micro_batch']}"
