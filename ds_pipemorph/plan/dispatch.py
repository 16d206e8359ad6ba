"""One stage's readiness-driven dispatch rule (RRFP), as the engine applies it while it runs.

The stage's order in the plan is a hint. Whenever the stage is idle it starts, among the ops it
has not run, the first one in the hint that is ready now:

- ``F m``: its activation has arrived (the first stage: always) and fewer than ``cap``
  activations are held (F done, B not done);
- ``B m``: ``F m`` is done and its output gradient has arrived (the last stage: none needed);
- ``W m``: ``B m`` is done.

``plan.ready`` replays the same rule in simulated time; ``docs/ready_dispatch.md`` argues why it
cannot deadlock when every cap is at least 1. The engine runs an op to its end before it picks
the next one, so "done" is "started" here.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from .ops import Op

Arrived = Callable[[str, int], bool]  # (message kind "F" or "B", micro-batch) -> is it in?


class ReadyRule:
    """The rule for one stage and one iteration: ``pick`` the next op, then ``started`` it."""

    def __init__(self, hint: Sequence[Op], cap: int, needs_input: bool, needs_grad: bool):
        if cap < 1:
            raise ValueError(f"cap must be at least 1, not {cap}")
        self.pending: list[Op] = [op.local() for op in hint]
        self.cap, self.needs_input, self.needs_grad = cap, needs_input, needs_grad
        self.forwarded: set[int] = set()
        self.backwarded: set[int] = set()
        self.inflight = 0
        self.peak = 0

    @property
    def finished(self) -> bool:
        return not self.pending

    def is_ready(self, op: Op, arrived: Arrived) -> bool:
        if op.kind == "F":
            return self.inflight < self.cap and (not self.needs_input or arrived("F", op.mb))
        if op.kind == "B":
            return op.mb in self.forwarded and (not self.needs_grad or arrived("B", op.mb))
        return op.mb in self.backwarded

    def pick(self, arrived: Arrived) -> Optional[Op]:
        """The first op of the hint not run yet that is ready now; None if none is."""
        for op in self.pending:
            if self.is_ready(op, arrived):
                return op
        return None

    def started(self, op: Op) -> None:
        self.pending.remove(op)
        if op.kind == "F":
            self.forwarded.add(op.mb)
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        elif op.kind == "B":
            self.backwarded.add(op.mb)
            self.inflight -= 1

    def message_of(self, op: Op):
        """The message ``op`` waits for, as (kind, micro-batch), or None."""
        if op.kind == "F" and self.needs_input:
            return ("F", op.mb)
        if op.kind == "B" and self.needs_grad:
            return ("B", op.mb)
        return None

    def waiting_for(self) -> list[str]:
        """The messages the ops still to run wait for (for an error message), e.g. ``['RECV_B3']``."""
        out = []
        for op in self.pending:
            if op.kind == "F" and self.needs_input:
                out.append(f"RECV_F{op.mb}")
            elif op.kind == "B" and self.needs_grad:
                out.append(f"RECV_B{op.mb}")
        return out
