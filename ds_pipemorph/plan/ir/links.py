"""The link model the simulator, tolerance, queue sizing and control policy share.

A link joins stage i and i+1 and carries messages one way each direction; its delay c (ms) comes
from the costs. How messages queue on it is one of three models:

- ``Latency()``: pure latency, unlimited messages in flight: a message arrives c after it was sent.
- ``Direct()``: one message in flight per direction (one FIFO): a message departs when the one
  before it has arrived, and its sender is blocked until then (a send in the training process).
- ``Delegated(queues=k)``: k independent FIFOs per direction; message n of a direction travels in
  FIFO n % k (as the delegated transport sends them) and the sender never waits.

A link's delay may change over time: per link, ``(time_ms, delay_ms)`` breakpoints, sorted by
time; a message takes the delay in force when it departs (``delay_curves``).

``per_link`` and ``delay_curves`` are where the forms a caller may give (one model or one per link;
a delay or breakpoints) become the one form the replays take: a tuple with one entry per link.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import isfinite
from numbers import Real
from typing import Union

from ...fileio import check_ordered
from .text_enum import TextEnum


class Route(TextEnum):
    """Which path carries a link's messages at run time: torch.distributed in the training process,
    or the staging rings and delegate processes (equal to the strings ``"direct"``, ``"delegated"``)."""

    DIRECT = "direct"
    DELEGATED = "delegated"


@dataclass(frozen=True)
class Latency:
    """Pure latency: a message arrives ``c`` after it was sent, however many are in flight."""

    def __str__(self) -> str:  # noqa: D105
        return "latency"


@dataclass(frozen=True)
class Direct:
    """One message in flight per direction; the sender blocks until the previous one has arrived."""

    def __str__(self) -> str:  # noqa: D105
        return "direct"


@dataclass(frozen=True)
class Delegated:
    """``queues`` FIFOs per direction, each carrying one message at a time; the sender never waits."""

    queues: int = 2

    def __post_init__(self):
        if isinstance(self.queues, bool) or not isinstance(self.queues, int) or self.queues < 1:
            raise ValueError(f"a delegated link needs at least one queue, not {self.queues!r}")

    def __str__(self) -> str:  # noqa: D105
        return f"delegated({self.queues})"


LinkModel = Union[Latency, Direct, Delegated]
LATENCY, DIRECT = Latency(), Direct()
_MODELS = (Latency, Direct, Delegated)
LinkModels = tuple[LinkModel, ...]  # one per link
Breakpoints = tuple[tuple[float, float], ...]  # (time_ms, delay_ms), sorted by time
LinkCurves = tuple[Breakpoints, ...]  # one per link


def per_link(model: Union[LinkModel, Sequence[LinkModel]], links: int) -> LinkModels:
    """One model for each of ``links`` links: a single model applies to all of them; a sequence
    must hold exactly one model per link. Raises ValueError naming what is wrong."""
    if isinstance(model, _MODELS):
        return (model,) * links
    if isinstance(model, (str, bytes)) or not isinstance(model, Sequence):
        raise ValueError(f"a link model is Latency(), Direct() or Delegated(queues=k), not {model!r}")
    out = list(model)
    if len(out) != links:
        raise ValueError(f"{len(out)} link models given for {links} links")
    for i, m in enumerate(out):
        if not isinstance(m, _MODELS):
            raise ValueError(f"link {i}: a link model is Latency(), Direct() or Delegated(queues=k), not {m!r}")
    return tuple(out)


def constant_curves(delays: Sequence[float]) -> LinkCurves:
    """Per link one breakpoint at 0 holding its delay, taken as it is (a ``Costs``'s links)."""
    return tuple(((0.0, c),) for c in delays)


def delay_curves(delays: Sequence[Union[float, Sequence[tuple[float, float]]]], links: int) -> LinkCurves:
    """Per link, sorted breakpoints ``(time_ms, delay_ms)``: each of ``delays`` (one per link) is a
    delay in ms (one breakpoint at 0) or breakpoints. Raises ValueError naming what is wrong."""
    raw = list(delays)
    if len(raw) != links:
        raise ValueError(f"link delays: expected {links} entries (one per link of {links + 1} stages), got {len(raw)}")
    out = []
    for i, d in enumerate(raw):
        curve = ((0.0, float(d)),) if isinstance(d, Real) else tuple((float(t), float(c)) for t, c in d)
        if not curve:
            raise ValueError(f"link {i}: a delay trace needs at least one (time_ms, delay_ms) point")
        check_ordered([t for t, _ in curve], f"link {i}: trace times", unit=" ms")
        for t, c in curve:
            if not (isfinite(c) and c >= 0) or not isfinite(t):
                raise ValueError(f"link {i}: delay {c} ms at {t} ms; delays are finite and >= 0")
        out.append(curve)
    return tuple(out)
